//! Bad input is refused with a typed error before any I/O.

use std::time::Duration;

use lockkit_core::spi::AcquireRequest;
use lockkit_core::{Error, LockKey, LossSignal, OwnerId};

use super::{LONG_TTL, assert_busy};
use crate::{Check, Harness, Outcome, Space, support::expect_err};

/// An empty key is `InvalidKey`.
pub async fn empty_key_is_refused<H: Harness>(h: &H) -> Outcome {
    let a = h.client().await;
    expect_err(a.acquire("").await, "acquire ``", |e| {
        matches!(e, Error::InvalidKey { .. })
    });
    expect_err(a.try_acquire("").await, "try_acquire ``", |e| {
        matches!(e, Error::InvalidKey { .. })
    });
    expect_err(a.inspect("").await, "inspect ``", |e| {
        matches!(e, Error::InvalidKey { .. })
    });
    Outcome::Passed
}

/// A key over the size limit is `InvalidKey`, and one at the limit works.
pub async fn oversized_key_is_refused<H: Harness>(h: &H) -> Outcome {
    let space = Space::new("oversized_key_is_refused");
    let a = h.client().await;
    let pad = |len: usize| {
        format!(
            "{}{}",
            space.prefix(),
            "x".repeat(len - space.prefix().len())
        )
    };
    let too_long = pad(LockKey::MAX_BYTES + 1);
    let err = expect_err(a.acquire(too_long.as_str()).await, "oversized key", |e| {
        matches!(e, Error::InvalidKey { .. })
    });
    assert!(
        err.to_string().contains("bytes"),
        "the message should say what the limit is: {err}"
    );
    let longest = pad(LockKey::MAX_BYTES);
    let guard = a
        .try_acquire(longest.as_str())
        .ttl(LONG_TTL)
        .await
        .check("a key at the limit")
        .check("free key");
    guard.release().await.check("release");
    Outcome::Passed
}

/// Odd keys (Unicode, `/`, `..`, spaces, NUL, lookalikes) are either refused with
/// `InvalidKey` or stored faithfully: all accepted keys are distinct locks, held at once.
pub async fn odd_keys_are_distinct_or_refused<H: Harness>(h: &H) -> Outcome {
    let space = Space::new("odd_keys_are_distinct_or_refused");
    let names = [
        "a/b",
        "a%2Fb",
        "a_b",
        "a b",
        "a\u{a0}b",
        "a//b",
        "a/b/",
        "/a/b",
        "A/B",
        "../x",
        "./x",
        "x/..",
        "..",
        ".",
        "a..b",
        "a.b",
        "ключ",
        "🔒",
        "e\u{301}",
        "\u{e9}",
        "a:b",
        "{a}b",
        "a*b",
        "a?b",
        "a\0b",
        "a\nb",
        "tab\tkey",
        "a\\b",
        "'; DROP TABLE x; --",
        "%",
        "%%",
    ];
    let (a, b) = (h.client().await, h.client().await);
    let mut held = Vec::new();
    for name in names {
        let key = format!("{}{name}", space.prefix());
        match a.try_acquire(key.as_str()).ttl(LONG_TTL).await {
            Ok(Some(guard)) => held.push((name, guard)),
            Ok(None) => panic!("`{}` collided with an earlier odd key", name.escape_debug()),
            Err(Error::InvalidKey { .. }) => {}
            Err(e) => panic!(
                "`{}` failed with a non-InvalidKey error: {e}",
                name.escape_debug()
            ),
        }
    }
    assert!(
        held.len() >= 10,
        "most odd but printable keys should be usable; only {} were",
        held.len()
    );
    for (name, guard) in &held {
        assert_busy(
            &b,
            guard.key(),
            &format!("odd key `{}`", name.escape_debug()),
        )
        .await;
        let info = b
            .inspect(guard.key())
            .await
            .check("inspect")
            .check("an odd key's holder");
        assert_eq!(info.owner, guard.owner().to_string());
    }
    for (_, guard) in held {
        guard.release().await.check("release");
    }
    Outcome::Passed
}

/// A zero TTL is `InvalidTtl`, for acquire and for extend.
pub async fn zero_ttl_is_refused<H: Harness>(h: &H) -> Outcome {
    let space = Space::new("zero_ttl_is_refused");
    let key = space.key("k");
    let a = h.client().await;
    expect_err(a.acquire(&key).ttl(Duration::ZERO).await, "zero ttl", |e| {
        matches!(e, Error::InvalidTtl { .. })
    });
    assert_eq!(
        a.inspect(&key).await.check("inspect"),
        None,
        "a refused acquire must not touch the server"
    );
    let guard = a
        .try_acquire(&key)
        .ttl(LONG_TTL)
        .await
        .check("acquire")
        .check("free key");
    expect_err(guard.extend(Duration::ZERO).await, "extend to zero", |e| {
        matches!(e, Error::InvalidTtl { .. })
    });
    assert!(guard.is_valid());
    guard.release().await.check("release");
    Outcome::Passed
}

/// A TTL outside the backend's accepted range is `InvalidTtl` naming the range.
pub async fn ttl_outside_backend_range_is_refused<H: Harness>(h: &H) -> Outcome {
    let space = Space::new("ttl_outside_backend_range_is_refused");
    let key = space.key("k");
    let a = h.client().await;
    let caps = a.info().capabilities.clone();
    let mut checked = 0;
    if caps.min_ttl > Duration::from_nanos(1) {
        let err = expect_err(
            a.acquire(&key).ttl(caps.min_ttl / 2).await,
            "ttl below the minimum",
            |e| matches!(e, Error::InvalidTtl { .. }),
        );
        assert!(
            err.to_string().contains(&format!("{:?}", caps.min_ttl)),
            "the message should name the range: {err}"
        );
        checked += 1;
    }
    if let Some(max) = caps.max_ttl {
        expect_err(
            a.acquire(&key).ttl(max + Duration::from_secs(1)).await,
            "ttl above the maximum",
            |e| matches!(e, Error::InvalidTtl { .. }),
        );
        checked += 1;
    }
    assert!(checked > 0, "the backend declares no ttl limit to test");
    assert_eq!(a.inspect(&key).await.check("inspect"), None);
    Outcome::Passed
}

/// A TTL beyond any lease (`Duration::MAX`, 10,000 years) is `InvalidTtl` before any I/O,
/// on every backend whatever it declares: `ttl(Duration::MAX)` panicked after the grant
/// (an instant that far ahead overflows), and MySQL row mode wrote 10,000 years as a
/// server error and `u64::MAX` µs as a lease that had already ended (another owner was
/// granted the key while the guard was valid; review 31). The longest TTL accepted is a
/// lease like any other: held, and the key busy for another client. A huge `max_hold`
/// means "renew for as long as the guard lives".
pub async fn huge_ttls_are_refused_or_held<H: Harness>(h: &H) -> Outcome {
    let space = Space::new("huge_ttls_are_refused_or_held");
    let key = space.key("k");
    let (a, b) = (h.client().await, h.client().await);
    for ttl in [
        Duration::MAX,
        Duration::from_secs(10_000 * 365 * 24 * 3600),
        lockkit_core::MAX_TTL + Duration::from_secs(1),
    ] {
        expect_err(a.try_acquire(&key).ttl(ttl).await, "a huge ttl", |e| {
            matches!(e, Error::InvalidTtl { .. })
        });
    }
    assert_eq!(
        a.inspect(&key).await.check("inspect"),
        None,
        "a refused acquire must not touch the server"
    );
    let longest = a
        .info()
        .capabilities
        .max_ttl
        .map_or(lockkit_core::MAX_TTL, |max| max.min(lockkit_core::MAX_TTL));
    let guard = a
        .try_acquire(&key)
        .ttl(longest)
        .max_hold(Duration::MAX)
        .await
        .check("acquire with the longest ttl")
        .check("free key");
    assert!(guard.is_valid());
    assert!(
        b.try_acquire(&key)
            .ttl(LONG_TTL)
            .await
            .check("rival")
            .is_none(),
        "the longest lease ({longest:?}) was granted, and another client was granted it too"
    );
    expect_err(
        guard.extend(Duration::MAX).await,
        "extend to a huge ttl",
        |e| matches!(e, Error::InvalidTtl { .. }),
    );
    assert!(guard.is_valid());
    guard.release().await.check("release");
    // A backend driven directly (the SPI), where no Locker checks the TTL: `Duration::MAX`
    // never panics, and a grant is a lease like any other (MySQL row mode granted the
    // key to the next owner too; helper-34's review).
    let backend = a.backend().clone();
    let request = AcquireRequest::new(
        key.clone(),
        OwnerId::random(),
        Duration::MAX,
        LossSignal::new(),
    );
    if let Ok(Some(grant)) = backend.try_acquire(&request).await {
        assert!(
            b.try_acquire(&key)
                .ttl(LONG_TTL)
                .await
                .check("rival")
                .is_none(),
            "a grant of Duration::MAX through the SPI was granted to another client too"
        );
        backend
            .release(&grant)
            .await
            .check("release through the SPI");
    }
    Outcome::Passed
}

/// Inconsistent options (renewal period not below the TTL, zero `max_hold`) are refused.
pub async fn invalid_options_are_refused<H: Harness>(h: &H) -> Outcome {
    let space = Space::new("invalid_options_are_refused");
    let key = space.key("k");
    let a = h.client().await;
    expect_err(
        a.acquire(&key).ttl(LONG_TTL).renew_every(LONG_TTL).await,
        "renewal period = ttl",
        |e| matches!(e, Error::Config(_)),
    );
    expect_err(
        a.acquire(&key)
            .ttl(LONG_TTL)
            .renew_every(Duration::ZERO)
            .await,
        "zero renewal period",
        |e| matches!(e, Error::Config(_)),
    );
    expect_err(
        a.acquire(&key).max_hold(Duration::ZERO).await,
        "zero max_hold",
        |e| matches!(e, Error::Config(_)),
    );
    assert_eq!(a.inspect(&key).await.check("inspect"), None);
    Outcome::Passed
}

/// Malformed URLs are refused with `Config`.
pub async fn bad_url_is_refused<H: Harness>(h: &H) -> Outcome {
    let urls = h.malformed_urls();
    if urls.is_empty() {
        return Outcome::Skipped("the harness lists no malformed URLs".into());
    }
    for url in urls {
        match h.connect(&url).await {
            Err(Error::Config(message)) => assert!(!message.is_empty()),
            Err(e) => panic!("`{url}` failed with a non-Config error: {e}"),
            Ok(_) => panic!("`{url}` was accepted"),
        }
    }
    Outcome::Passed
}

/// Control characters (`U+0000..=U+001F`, `U+007F`) are refused alike by every backend,
/// before any I/O, for acquire and inspect.
pub async fn control_chars_are_refused<H: Harness>(h: &H) -> Outcome {
    let space = Space::new("control_chars_are_refused");
    let a = h.client().await;
    for name in ["a\0b", "a\nb", "tab\tkey", "a\rb", "esc\u{1b}", "del\u{7f}"] {
        let key = format!("{}{name}", space.prefix());
        let doing = format!("key with a control character `{}`", name.escape_debug());
        expect_err(
            a.try_acquire(key.as_str()).ttl(LONG_TTL).await,
            &doing,
            |e| matches!(e, Error::InvalidKey { .. }),
        );
        expect_err(a.inspect(key.as_str()).await, &doing, |e| {
            matches!(e, Error::InvalidKey { .. })
        });
    }
    Outcome::Passed
}
