//! Redlock (being written).
use crate::RedisConfig;
use lockkit_core::{Error, Result};
/// Redlock (placeholder while being written).
#[derive(Debug)]
pub struct RedlockBackend;
impl RedlockBackend {
    /// Connect.
    pub async fn from_config(_c: RedisConfig) -> Result<Self> {
        Err(Error::Config("redlock pending".into()))
    }
}
