//! The Redis fence: one Lua script checks the resource's newest token, raises it, and
//! makes the write, so no other command can come in between.

use lockkit_redis::{RedisConfig, Topology};
use redis::{Script, Value, aio::ConnectionManager};

use crate::{Error, FencingToken, Result};

const BACKEND: &str = "redis";

/// Checks `ARGV[1]` against the newest token in `KEYS[1]` (compared as decimal numbers of
/// any size: Lua's numbers would lose precision above 2^53), answers `{0, newest}` for an
/// older token, else raises the fence and goes on to the write that follows.
const PREAMBLE: &str = r"
local function older(a, b)
  if #a ~= #b then return #a < #b end
  return a < b
end
local newest = redis.call('GET', KEYS[1])
if newest and older(ARGV[1], newest) then
  return {0, newest}
end
if newest ~= ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[1])
end
";

/// A fence in Redis: per resource, the newest token that wrote is kept in
/// `<prefix>lockkit:fence:<resource>`, and each write runs in one script with its check.
///
/// This type talks to one server (`redis://`, `rediss://`), the one holding the data it
/// guards. The fence keys have no expiry: a `maxmemory` policy that evicts keys without
/// one (`allkeys-*`) can evict a fence and admit a stale writer, and a failover to a
/// replica that missed the last write loses the raise with it; use `noeviction` or
/// `volatile-*`, and persistence, for data worth fencing.
#[derive(Clone)]
pub struct RedisFence {
    conn: ConnectionManager,
    prefix: String,
}

impl std::fmt::Debug for RedisFence {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisFence")
            .field("prefix", &self.prefix)
            .finish_non_exhaustive()
    }
}

fn redis_error(doing: &str, e: redis::RedisError) -> Error {
    let retryable = e.is_io_error() || e.is_timeout() || e.is_connection_dropped();
    Error::backend_with_source(BACKEND, retryable, format!("{doing} failed: {e}"), e)
}

/// A fenced script that failed after it may have been sent: a timeout or a dropped
/// connection can hide a script that ran, so the outcome is unknown and a blind retry could
/// apply the write twice (or be refused as if nothing was written). Never retryable.
fn script_error(resource: &str, e: redis::RedisError) -> Error {
    let lost = e.is_io_error() || e.is_timeout() || e.is_connection_dropped();
    let message = if lost {
        format!(
            "the fenced write to `{resource}` got no answer ({e}); it may or may not have run, \
             so check before writing again (or make the write idempotent)"
        )
    } else {
        format!("the fenced write to `{resource}` failed: {e}")
    };
    Error::backend_with_source(BACKEND, false, message, e)
}

impl RedisFence {
    /// A fence over `conn`, its keys under `prefix` (as the lock URL's `?prefix=`).
    pub fn new(conn: ConnectionManager, prefix: impl Into<String>) -> Self {
        RedisFence {
            conn,
            prefix: prefix.into(),
        }
    }

    /// Connects to the server of a `redis://` or `rediss://` lock URL (its `?prefix=` is
    /// the fence keys' prefix too).
    ///
    /// # Errors
    /// [`Error::Config`] for a bad URL, [`Error::Unsupported`] for a cluster or Redlock URL,
    /// [`Error::Backend`] when the server cannot be reached.
    pub async fn connect(url: &str) -> Result<Self> {
        let config = RedisConfig::parse(url)?;
        let Topology::Single(node) = &config.topology else {
            return Err(Error::Unsupported {
                backend: BACKEND,
                what: "a fence over a cluster or Redlock URL: give the fence one server \
                       (redis://), the one that holds the data it guards"
                    .into(),
            });
        };
        let client = redis::Client::open(node.as_str())
            .map_err(|e| Error::Config(format!("bad Redis URL: {e}")))?;
        let conn = ConnectionManager::new(client)
            .await
            .map_err(|e| redis_error("connecting the fence", e))?;
        Ok(Self::new(conn, config.prefix))
    }

    /// The key holding `resource`'s newest token.
    pub fn fence_key(&self, resource: &str) -> String {
        format!("{}lockkit:fence:{resource}", self.prefix)
    }

    /// Runs `PREAMBLE` + `body` with the fence key and token first; `Ok(result)` when
    /// admitted.
    async fn run(
        &self,
        token: FencingToken,
        resource: &str,
        body: &str,
        keys: &[&str],
        args: &[&str],
    ) -> Result<Value> {
        let script = Script::new(&format!(
            "{PREAMBLE}\nlocal function body()\n{body}\nend\nreturn {{1, body()}}"
        ));
        let mut invocation = script.key(self.fence_key(resource));
        invocation.arg(token.get().to_string());
        for key in keys {
            invocation.key(*key);
        }
        for arg in args {
            invocation.arg(*arg);
        }
        let answer: Vec<Value> = invocation
            .invoke_async(&mut self.conn.clone())
            .await
            .map_err(|e| script_error(resource, e))?;
        let mut answer = answer.into_iter();
        match (answer.next(), answer.next()) {
            (Some(Value::Int(1)), result) => Ok(result.unwrap_or(Value::Nil)),
            (Some(Value::Int(0)), Some(newest)) => {
                let newest: String = redis::from_redis_value(newest).map_err(|e| {
                    Error::backend(BACKEND, false, format!("reading the newest token: {e}"))
                })?;
                // A fence that does not read as a token refuses every write (it fails
                // closed), and says so: it is not a newer holder's.
                let Ok(newer) = newest.parse::<u64>() else {
                    return Err(Error::backend(
                        BACKEND,
                        false,
                        format!(
                            "the fence of `{resource}` holds {newest:?}, which is not a token: \
                             every write is refused until it is mended (SET it to the newest \
                             token that wrote, or DEL it if none did)"
                        ),
                    ));
                };
                Err(Error::Fenced {
                    resource: resource.to_owned(),
                    token,
                    newer: FencingToken::new(newer),
                })
            }
            other => Err(Error::backend(
                BACKEND,
                false,
                format!("the fenced write answered {other:?}"),
            )),
        }
    }

    /// Accepts `token` for `resource` if it is not older than the newest that wrote,
    /// raising the bar to it, without writing anything else (`lockkit fence`).
    ///
    /// # Errors
    /// [`Error::Fenced`] for an older token; [`Error::Backend`] for Redis errors.
    pub async fn admit(&self, token: impl Into<FencingToken>, resource: &str) -> Result<()> {
        self.run(token.into(), resource, "return 1", &[], &[])
            .await
            .map(|_| ())
    }

    /// `SET key value` if `token` is not older than the newest that wrote to `resource`.
    ///
    /// # Errors
    /// [`Error::Fenced`] (nothing written) for an older token; [`Error::Backend`] for Redis
    /// errors, never retryable: one without an answer (a timeout, a dropped connection;
    /// the connection's default response timeout is 500 ms) says the write may or may not
    /// have run.
    pub async fn set(
        &self,
        token: impl Into<FencingToken>,
        resource: &str,
        key: &str,
        value: &str,
    ) -> Result<()> {
        let body = "redis.call('SET', KEYS[2], ARGV[2]) return 1";
        self.run(token.into(), resource, body, &[key], &[value])
            .await
            .map(|_| ())
    }

    /// `HSET key field value` if `token` is not older than the newest that wrote to
    /// `resource`.
    ///
    /// # Errors
    /// As [`RedisFence::set`].
    pub async fn hset(
        &self,
        token: impl Into<FencingToken>,
        resource: &str,
        key: &str,
        field: &str,
        value: &str,
    ) -> Result<()> {
        let body = "redis.call('HSET', KEYS[2], ARGV[2], ARGV[3]) return 1";
        self.run(token.into(), resource, body, &[key], &[field, value])
            .await
            .map(|_| ())
    }

    /// `DEL key` if `token` is not older than the newest that wrote to `resource`.
    ///
    /// # Errors
    /// As [`RedisFence::set`].
    pub async fn del(
        &self,
        token: impl Into<FencingToken>,
        resource: &str,
        key: &str,
    ) -> Result<()> {
        let body = "redis.call('DEL', KEYS[2]) return 1";
        self.run(token.into(), resource, body, &[key], &[])
            .await
            .map(|_| ())
    }

    /// Runs the Lua `body` if `token` is not older than the newest that wrote to
    /// `resource`, in the same script as the check, and returns what it returns. In
    /// `body`, `KEYS[1]` is the fence key and `ARGV[1]` the token: your `keys` start at
    /// `KEYS[2]` and your `args` at `ARGV[2]`.
    ///
    /// Redis does not roll a script back: if `body` fails half-way, the writes it made
    /// before the failure stay, and so does the raised fence (which only refuses tokens
    /// older than one already handed out). Check what you need before you write.
    ///
    /// # Errors
    /// As [`RedisFence::set`], and the script's own errors.
    pub async fn eval(
        &self,
        token: impl Into<FencingToken>,
        resource: &str,
        body: &str,
        keys: &[&str],
        args: &[&str],
    ) -> Result<Value> {
        self.run(token.into(), resource, body, keys, args).await
    }
}
