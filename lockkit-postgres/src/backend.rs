//! `PostgresBackend`: one database ([`Db`]) and the locks of the mode its URL picks.

use std::{sync::Arc, time::Duration};

use async_trait::async_trait;
use lockkit_core::spi::{AcquireRequest, Grant, Released};
use lockkit_core::{BackendInfo, HolderInfo, LockBackend, LockKey, Result};

use crate::{Mode, PostgresConfig, advisory::AdvisoryLocks, db::Db, row::RowLocks};

/// The locks of one mode.
#[derive(Clone)]
enum Locks {
    Row(RowLocks),
    Advisory(AdvisoryLocks),
}

/// Locks in a PostgreSQL database; see the crate docs for the two modes.
#[derive(Clone)]
pub struct PostgresBackend {
    db: Arc<Db>,
    locks: Locks,
}

impl std::fmt::Debug for PostgresBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PostgresBackend")
            .field("mode", &self.db.config.mode)
            .field("table", &self.db.config.table)
            .finish()
    }
}

impl PostgresBackend {
    /// Connects as a `postgres://user:pw@host:port/db?mode=row|advisory` URL says (see
    /// [`PostgresConfig::parse`]). The table is created on first use unless
    /// `create_schema=false`.
    ///
    /// # Errors
    /// [`lockkit_core::Error::Config`] for a bad URL, a missing table with
    /// `create_schema=false`, or `mode=advisory` on a server older than PostgreSQL 14;
    /// [`lockkit_core::Error::Backend`] when the server cannot be reached.
    pub async fn connect(url: &str) -> Result<Self> {
        Self::from_config(PostgresConfig::parse(url)?).await
    }

    /// Connects as `config` says.
    ///
    /// # Errors
    /// As [`PostgresBackend::connect`].
    pub async fn from_config(config: PostgresConfig) -> Result<Self> {
        let db = Db::connect(config).await?;
        let locks = match db.config.mode {
            Mode::Row => Locks::Row(RowLocks::new(db.clone())),
            Mode::Advisory => Locks::Advisory(AdvisoryLocks::new(db.clone()).await?),
        };
        Ok(PostgresBackend { db, locks })
    }

    /// The mode's locks, which every `LockBackend` call goes to.
    fn locks(&self) -> &dyn LockBackend {
        match &self.locks {
            Locks::Row(locks) => locks,
            Locks::Advisory(locks) => locks,
        }
    }

    /// The configuration in force.
    pub fn config(&self) -> &PostgresConfig {
        &self.db.config
    }

    /// Closes every connection of this client (a row-mode waiter still waiting then polls,
    /// and fails once the pool is closed; advisory holds end with their connections).
    pub async fn close(&self) {
        match &self.locks {
            Locks::Row(locks) => locks.stop_listening(),
            Locks::Advisory(locks) => locks.close().await,
        }
        // Closed first (sqlx marks the pool closed when `close` is called), so a statement
        // completing meanwhile does not keep its connection; then the kept ones go back.
        let closing = self.db.pool.close();
        self.db.return_kept();
        closing.await;
    }

    /// Operator action: takes `key` away from its holder. In row mode its lease is cleared
    /// as if it had expired and its waiters are woken; the holder finds out at its next
    /// renewal. In advisory mode the session holding the lock is ended
    /// (`pg_terminate_backend`); the holder finds out at its next liveness check. Returns
    /// whether there was a holder. Every backend that can do this names it `take_away`,
    /// with this signature.
    ///
    /// # Errors
    /// Database errors.
    pub async fn take_away(&self, key: &LockKey) -> Result<bool> {
        match &self.locks {
            Locks::Row(locks) => locks.take_away(key).await,
            Locks::Advisory(locks) => locks.take_away(key).await,
        }
    }

    /// Keys under `prefix` with a live lease now. For leak checks.
    ///
    /// # Errors
    /// Database errors.
    #[cfg(feature = "testing")]
    #[cfg_attr(docsrs, doc(cfg(feature = "testing")))]
    pub async fn held_under(&self, prefix: &str) -> Result<u64> {
        match &self.locks {
            Locks::Row(locks) => locks.held_under(prefix).await,
            Locks::Advisory(locks) => locks.held_under(prefix).await,
        }
    }

    /// How many of the shared pool's connections are kept out of it between one-statement
    /// calls now (counted without using them).
    #[cfg(feature = "testing")]
    #[cfg_attr(docsrs, doc(cfg(feature = "testing")))]
    pub fn kept_connections(&self) -> usize {
        self.db.kept_count()
    }

    /// How many dedicated connections (advisory mode) are kept out of their pool between
    /// holds now (0 in row mode).
    #[cfg(feature = "testing")]
    #[cfg_attr(docsrs, doc(cfg(feature = "testing")))]
    pub fn kept_dedicated_connections(&self) -> usize {
        match &self.locks {
            Locks::Row(_) => 0,
            Locks::Advisory(locks) => locks.kept_count(),
        }
    }

    /// The server process ids of the shared pool's connections kept out of it between
    /// one-statement calls now, for fault tests that end them.
    ///
    /// # Errors
    /// Database errors.
    #[cfg(feature = "testing")]
    #[cfg_attr(docsrs, doc(cfg(feature = "testing")))]
    pub async fn kept_connection_pids(&self) -> Result<Vec<i32>> {
        self.db
            .kept_connection_pids()
            .await
            .map_err(|e| self.db.error("reading kept connections' process ids", e))
    }

    /// Keys this client's waiters listen for now (none once every wait has ended).
    #[cfg(feature = "testing")]
    #[cfg_attr(docsrs, doc(cfg(feature = "testing")))]
    pub fn waiting_keys(&self) -> usize {
        match &self.locks {
            Locks::Row(locks) => locks.waiting_keys(),
            Locks::Advisory(_) => 0,
        }
    }
}

#[async_trait]
impl LockBackend for PostgresBackend {
    fn info(&self) -> BackendInfo {
        self.locks().info()
    }

    /// [`lockkit_core::spi::sql_response_bound`] of the connect timeout.
    fn response_bound(&self) -> Duration {
        lockkit_core::spi::sql_response_bound(self.db.config.connect_timeout)
    }

    async fn try_acquire(&self, req: &AcquireRequest) -> Result<Option<Grant>> {
        self.locks().try_acquire(req).await
    }

    async fn acquire(&self, req: &AcquireRequest, wait: Duration) -> Result<Grant> {
        self.locks().acquire(req, wait).await
    }

    async fn renew(&self, grant: &Grant, ttl: Duration) -> Result<()> {
        self.locks().renew(grant, ttl).await
    }

    async fn release(&self, grant: &Grant) -> Result<Released> {
        self.locks().release(grant).await
    }

    async fn ping(&self) -> Result<()> {
        self.locks().ping().await
    }

    async fn inspect(&self, key: &LockKey) -> Result<Option<HolderInfo>> {
        self.locks().inspect(key).await
    }

    async fn holders(&self, key: &LockKey) -> Result<Vec<HolderInfo>> {
        self.locks().holders(key).await
    }
}
