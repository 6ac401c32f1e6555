//! One command connection, to a single server or to a cluster, and error mapping.

use std::{sync::Mutex, time::Duration};

use lockkit_core::{Error, Interrupt};
use redis::{
    Cmd, RedisError, RedisFuture, Value,
    aio::{ConnectionLike, ConnectionManager},
    cluster_async::ClusterConnection,
};
use tokio::sync::{Semaphore, SemaphorePermit};

pub(crate) const BACKEND: &str = "redis";

/// A reconnecting, multiplexed command connection.
#[derive(Clone)]
pub(crate) enum Conn {
    Single(ConnectionManager),
    Cluster(ClusterConnection),
}

impl ConnectionLike for Conn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Conn::Single(c) => c.req_packed_command(cmd),
            Conn::Cluster(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a redis::Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            Conn::Single(c) => c.req_packed_commands(pipeline, offset, count),
            Conn::Cluster(c) => c.req_packed_commands(pipeline, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Conn::Single(c) => c.get_db(),
            Conn::Cluster(c) => c.get_db(),
        }
    }
}

/// Maps a client error to lockkit's, saying what was being done.
pub(crate) fn backend_error(doing: &str, target: &str, e: RedisError) -> Error {
    // The target may be a URL with a password: never show it.
    let target = &lockkit_core::config::redact_url(target);
    let retryable = e.is_io_error()
        || e.is_timeout()
        || e.is_connection_dropped()
        || e.is_connection_refusal()
        || e.is_cluster_error();
    let hint = if e.is_connection_refusal() || e.is_io_error() {
        "; is the server running and reachable?"
    } else if e.is_timeout() {
        "; the server is slow or paused, or response_timeout is too short"
    } else {
        ""
    };
    Error::backend_with_source(
        BACKEND,
        retryable,
        format!("{doing} on {target} failed: {e}{hint}"),
        e,
    )
}

/// The connections acquisitions run on: the command connection itself, or with
/// `wait_replicas` a few of their own.
///
/// `WAIT` blocks the connection it is sent on for up to its timeout, so an acquisition must
/// not be queued on the server behind another's `WAIT`: it would hold up grants of other
/// keys, and one queued past its response timeout fails although its script may still run
/// and grant (a hold nobody knows of, until its lease ends). So each acquisition has a
/// connection to itself, and waits here, before sending anything, for one to be free.
pub(crate) enum GrantConns {
    /// Multiplexed: every acquisition shares it.
    Shared(Conn),
    /// One acquisition at a time on each.
    Exclusive {
        idle: Mutex<Vec<Conn>>,
        permits: Semaphore,
    },
}

/// An acquisition's use of a grant connection; dropping it hands the connection back.
pub(crate) struct GrantSlot<'a> {
    pub(crate) conn: Conn,
    home: Option<(&'a Mutex<Vec<Conn>>, SemaphorePermit<'a>)>,
}

impl Drop for GrantSlot<'_> {
    fn drop(&mut self) {
        // The connection goes back before the permit (a field, dropped after this).
        if let Some((idle, _)) = &self.home {
            idle.lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .push(self.conn.clone());
        }
    }
}

impl GrantConns {
    pub(crate) fn exclusive(conns: Vec<Conn>) -> Self {
        let permits = Semaphore::new(conns.len());
        GrantConns::Exclusive {
            idle: Mutex::new(conns),
            permits,
        }
    }

    /// A connection for one acquisition, waiting (before anything is sent) while all of
    /// them are in use: at most `within`, and not past `interrupt` (the caller went away).
    /// Either way nothing was sent, so the error is a clean retryable refusal.
    pub(crate) async fn pick(
        &self,
        within: Duration,
        interrupt: Option<&Interrupt>,
    ) -> Result<GrantSlot<'_>, Error> {
        match self {
            GrantConns::Shared(conn) => Ok(GrantSlot {
                conn: conn.clone(),
                home: None,
            }),
            GrantConns::Exclusive { idle, permits } => {
                let unavailable =
                    || Error::backend(BACKEND, true, "no grant connection is available");
                let interrupted = async {
                    match interrupt {
                        Some(interrupt) => interrupt.interrupted().await,
                        None => std::future::pending().await,
                    }
                };
                let permit = tokio::select! {
                    permit = tokio::time::timeout(within, permits.acquire()) => match permit {
                        Ok(Ok(permit)) => permit,
                        Ok(Err(_)) => return Err(unavailable()),
                        Err(_) => {
                            return Err(Error::backend(
                                BACKEND,
                                true,
                                format!(
                                    "every connection for grants that wait for replicas stayed \
                                     busy for {within:?} (other acquisitions waiting on WAIT); \
                                     nothing was sent: retry, or check the replicas"
                                ),
                            ));
                        }
                    },
                    () = interrupted => {
                        return Err(Error::backend(BACKEND, true, "the acquisition was abandoned"));
                    }
                };
                let conn = idle
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .pop()
                    .ok_or_else(unavailable)?;
                Ok(GrantSlot {
                    conn,
                    home: Some((idle, permit)),
                })
            }
        }
    }
}
