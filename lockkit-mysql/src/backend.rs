//! `MysqlBackend`: one database ([`Db`]) and the locks of the mode its URL picks; the
//! `LockBackend` impl hands every call to that mode.

use std::{sync::Arc, time::Duration};

use async_trait::async_trait;
use lockkit_core::spi::{AcquireRequest, Grant, Released};
use lockkit_core::{BackendInfo, Error, HolderInfo, LockBackend, LockKey, Result};
use sqlx::AssertSqlSafe;

use crate::{
    Mode, MysqlConfig,
    db::{BACKEND, Db, db_error},
    for_update::ForUpdateLocks,
    row::RowLocks,
};

/// The locks of one mode.
#[derive(Clone)]
enum Locks {
    Row(RowLocks),
    ForUpdate(ForUpdateLocks),
}

/// Locks in a MySQL or MariaDB database; see the crate docs for the two modes.
#[derive(Clone)]
pub struct MysqlBackend {
    db: Arc<Db>,
    locks: Locks,
}

impl std::fmt::Debug for MysqlBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MysqlBackend")
            .field("mode", &self.db.config.mode)
            .field("table", &self.db.config.table)
            .finish()
    }
}

impl MysqlBackend {
    /// Connects as a `mysql://user:pw@host:port/db?mode=row|for-update` URL says (see
    /// [`MysqlConfig::parse`]). The schema is created on first use unless
    /// `create_schema=false`.
    ///
    /// # Errors
    /// [`Error::Config`] for a bad URL; [`Error::Backend`] when the server cannot be reached.
    pub async fn connect(url: &str) -> Result<Self> {
        Self::from_config(MysqlConfig::parse(url)?).await
    }

    /// Connects as `config` says.
    ///
    /// # Errors
    /// As [`MysqlBackend::connect`].
    pub async fn from_config(config: MysqlConfig) -> Result<Self> {
        let db = Db::connect(config).await?;
        let locks = match db.config.mode {
            Mode::Row => Locks::Row(RowLocks::new(db.clone())),
            Mode::ForUpdate => Locks::ForUpdate(ForUpdateLocks::new(db.clone())),
        };
        Ok(MysqlBackend { db, locks })
    }

    /// The mode's locks, which every `LockBackend` call goes to.
    fn locks(&self) -> &dyn LockBackend {
        match &self.locks {
            Locks::Row(locks) => locks,
            Locks::ForUpdate(locks) => locks,
        }
    }

    /// The configuration in force.
    pub fn config(&self) -> &MysqlConfig {
        &self.db.config
    }

    /// Closes every connection of this client. A for-update hold still open ends with its
    /// connection (its guard hears `SessionLost`); a row-mode lease lives in the table and
    /// runs out there. Returns within a few `connect_timeout`s even when the server's link
    /// has gone silent: a connection that is still waiting for an answer then is closed
    /// when its link errors or heals (sqlx pings every connection given back to its pool,
    /// with no time limit, and a pool's close waits for all of them).
    pub async fn close(&self) {
        // Each pool is closed first (sqlx marks it closed when `close` is called), so a
        // statement completing meanwhile does not keep its connection and no acquisition
        // starts; then the holds and waits end and the kept connections go back (a pool's
        // close waits for all its connections).
        let within = self.db.config.connect_timeout;
        let closing_holds = self.db.holds_pool.close();
        if let Locks::ForUpdate(locks) = &self.locks {
            locks.close().await;
        }
        self.db.return_kept_holds();
        let _ = tokio::time::timeout(within, closing_holds).await;
        let closing = self.db.pool.close();
        self.db.return_kept();
        let _ = tokio::time::timeout(within, closing).await;
    }

    /// Dedicated for-update connections open now (held or waiting locks, and idle ones).
    #[cfg(feature = "testing")]
    #[cfg_attr(docsrs, doc(cfg(feature = "testing")))]
    pub fn dedicated_connections(&self) -> u32 {
        self.db.holds_pool.size()
    }

    /// How many of the shared pool's connections are kept out of it between one-statement
    /// calls now (counted without using them).
    #[cfg(feature = "testing")]
    #[cfg_attr(docsrs, doc(cfg(feature = "testing")))]
    pub fn kept_connections(&self) -> usize {
        self.db.kept_count()
    }

    /// How many dedicated for-update connections are kept out of their pool between holds
    /// now.
    #[cfg(feature = "testing")]
    #[cfg_attr(docsrs, doc(cfg(feature = "testing")))]
    pub fn kept_dedicated_connections(&self) -> usize {
        self.db.kept_holds_count()
    }

    /// The server connection ids of the shared pool's connections kept between
    /// one-statement calls (row mode's grant of a free key, release of a sole hold,
    /// renewal), for fault tests that `KILL` them.
    ///
    /// # Errors
    /// Database errors.
    #[cfg(feature = "testing")]
    #[cfg_attr(docsrs, doc(cfg(feature = "testing")))]
    pub async fn kept_connection_ids(&self) -> Result<Vec<u64>> {
        self.db
            .kept_connection_ids()
            .await
            .map_err(|e| crate::db::db_error("reading kept connections' ids", e))
    }

    /// The server connection id of a connection of the shared pool (the one a pool of one
    /// connection always hands out), for fault tests that `KILL` it.
    ///
    /// # Errors
    /// Database errors.
    #[cfg(feature = "testing")]
    #[cfg_attr(docsrs, doc(cfg(feature = "testing")))]
    pub async fn pooled_connection_id(&self) -> Result<u64> {
        let (id,): (u64,) = sqlx::query_as("SELECT CONNECTION_ID()")
            .fetch_one(&self.db.pool)
            .await
            .map_err(|e| db_error("SELECT CONNECTION_ID()", e))?;
        Ok(id)
    }

    /// The server connection id holding `key` for-update in this client, if any (for
    /// operators and fault tests: `KILL <id>` ends that hold).
    pub fn connection_holding(&self, key: &LockKey) -> Option<u64> {
        match &self.locks {
            Locks::ForUpdate(locks) => locks.connection_holding(key),
            Locks::Row(_) => None,
        }
    }

    /// Operator action (row mode): takes `key` away from its holders (the plain lock's, and
    /// every read, write and permit hold), clearing their leases as if they had expired;
    /// each holder finds out at its next renewal. Returns whether there
    /// was a live lease. Every backend that can do this names it `take_away`, with this
    /// signature. (A for-update hold is ended by killing its connection:
    /// [`MysqlBackend::connection_holding`], [`MysqlBackend::kill_connection`].)
    ///
    /// # Errors
    /// [`Error::Unsupported`] when a for-update holder (of either mode's client) holds the
    /// key: that hold ends only with its connection, so nothing is changed and the error
    /// says so, rather than answering that nothing was held. Database errors.
    pub async fn take_away(&self, key: &LockKey) -> Result<bool> {
        let name = key.as_str().as_bytes();
        if self.db.clear_live(name).await? {
            return Ok(true);
        }
        if self.db.is_locked(name).await? {
            return Err(Error::Unsupported {
                backend: BACKEND,
                what: format!(
                    "taking `{key}` away from a for-update holder: that hold ends only with its \
                     connection; KILL it (MysqlBackend::connection_holding in the holder's \
                     process, then kill_connection)"
                ),
            });
        }
        Ok(false)
    }

    /// Operator action: `KILL <id>` a server connection (e.g. one from
    /// [`MysqlBackend::connection_holding`]).
    ///
    /// # Errors
    /// Database errors (e.g. no such connection, or no privilege).
    pub async fn kill_connection(&self, id: u64) -> Result<()> {
        sqlx::raw_sql(AssertSqlSafe(format!("KILL {id}")))
            .execute(&self.db.pool)
            .await
            .map_err(|e| db_error(&format!("KILL {id}"), e))?;
        Ok(())
    }

    /// Keys under `prefix` that are held now: live leases (row) or locked rows
    /// (for-update), seen from a fresh connection. For leak checks.
    ///
    /// # Errors
    /// Database errors.
    #[cfg(feature = "testing")]
    #[cfg_attr(docsrs, doc(cfg(feature = "testing")))]
    pub async fn held_under(&self, prefix: &str) -> Result<u64> {
        match &self.locks {
            Locks::Row(locks) => locks.held_under(prefix).await,
            Locks::ForUpdate(locks) => locks.held_under(prefix).await,
        }
    }
}

#[async_trait]
impl LockBackend for MysqlBackend {
    fn info(&self) -> BackendInfo {
        self.locks().info()
    }

    /// [`lockkit_core::spi::sql_response_bound`]: twice the connect timeout and ten seconds
    /// more. MySQL has no bound of its own on a statement the server never answers (sqlx
    /// waits as long as the link stays open), and a for-update wait's end (`KILL` from a connection opened for it, then the waiter's
    /// own statement) takes up to that past the deadline. A row-mode statement that waits
    /// longer behind another transaction's row lock (`innodb_lock_wait_timeout`) is given
    /// up on too, safely: its attempt is given back when it completes.
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

    fn validity_bound(&self, grant: &Grant) -> Option<tokio::time::Instant> {
        self.locks().validity_bound(grant)
    }
}
