//! Owner identities.

use std::fmt;

use uuid::Uuid;

/// Who holds a lock. Reentrancy is keyed by this identity, never by thread or task.
///
/// Its text form is `<client-uuid>:<n>`, the shape Redisson uses for hash fields, so a
/// backend may store it as is. `client` identifies one [`crate::Locker`] (one process's
/// client); `n` tells apart owners created by that locker.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct OwnerId {
    client: Uuid,
    n: u64,
}

impl OwnerId {
    /// Builds an owner id from its parts.
    pub const fn new(client: Uuid, n: u64) -> Self {
        OwnerId { client, n }
    }

    /// A fresh random owner, unique across processes and machines.
    pub fn random() -> Self {
        OwnerId::new(Uuid::new_v4(), 1)
    }

    /// The client (locker instance) part.
    pub const fn client(&self) -> Uuid {
        self.client
    }

    /// The per-client number.
    pub const fn n(&self) -> u64 {
        self.n
    }
}

impl fmt::Display for OwnerId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.client, self.n)
    }
}

impl fmt::Debug for OwnerId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "OwnerId({self})")
    }
}

impl std::str::FromStr for OwnerId {
    type Err = crate::Error;
    fn from_str(s: &str) -> crate::Result<Self> {
        let bad =
            || crate::Error::Config(format!("`{s}` is not an owner id of the form <uuid>:<n>"));
        let (client, n) = s.rsplit_once(':').ok_or_else(bad)?;
        let client = Uuid::parse_str(client).map_err(|_| bad())?;
        let n = n.parse().map_err(|_| bad())?;
        Ok(OwnerId::new(client, n))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_through_text() {
        let o = OwnerId::random();
        assert_eq!(o.to_string().parse::<OwnerId>().unwrap(), o);
        assert!("nope".parse::<OwnerId>().is_err());
    }
}
