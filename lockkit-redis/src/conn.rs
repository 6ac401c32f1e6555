//! One command connection, to a single server or to a cluster, and error mapping.

use lockkit_core::Error;
use redis::{
    Cmd, RedisError, RedisFuture, Value,
    aio::{ConnectionLike, ConnectionManager},
    cluster_async::ClusterConnection,
};

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
