//! A small seedable random source for the randomized tests, and their seed.

use std::time::Duration;

/// SplitMix64: small, seedable, good enough to pick operations.
#[derive(Debug, Clone)]
pub struct Rng(pub u64);

impl Rng {
    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A number below `n` (0 for an `n` of 0).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n.max(1)
    }

    /// One of `items` (which must not be empty).
    pub fn pick<T: Copy>(&mut self, items: &[T]) -> T {
        items[self.below(items.len() as u64) as usize]
    }

    /// A duration from zero to `max`, in microseconds.
    pub fn duration(&mut self, max: Duration) -> Duration {
        let max_us = u64::try_from(max.as_micros()).unwrap_or(u64::MAX);
        Duration::from_micros(self.below(max_us + 1))
    }
}

/// `LOCKKIT_TORTURE_SEED` when set (to replay a run), else one from the clock and the
/// process id. Print it where a run can fail.
pub fn torture_seed() -> u64 {
    env_u64("LOCKKIT_TORTURE_SEED").unwrap_or_else(|| {
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        t ^ u64::from(std::process::id())
    })
}

/// The environment variable `name` as a number, if it is one.
pub fn env_u64(name: &str) -> Option<u64> {
    std::env::var(name).ok()?.trim().parse().ok()
}
