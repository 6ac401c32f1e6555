//! The Lua scripts: each operation is one atomic script, loaded once and run by SHA.
//!
//! They keep Redisson's RLock layout (see [`crate::naming`]) and add the fencing counter
//! the way Redisson's RFencedLock does: incremented only when a new holder takes the lock.
//! A key of another type (a plain string set by another client) counts as held.

use std::sync::LazyLock;

use redis::Script;

/// The hash field that records one acquisition (`AcquireRequest::attempt`) beside the
/// owner's hold count, so a retried acquire or release takes effect once. Redisson reads only
/// its own `<uuid>:<thread>` fields and `exists`, so extra fields keep the layout compatible;
/// they go with the hash when the lock is released or expires.
pub const ATTEMPT_FIELD_PREFIX: &str = "lockkit-attempt:";

/// Longest lease the scripts accept, in ms (about 31 years): checked before anything is
/// written, so an absurd TTL never leaves a lock without an expiry.
pub const MAX_TTL_MS: u64 = 1_000_000_000_000;

/// KEYS: lock, token. ARGV: ttl ms, owner field, attempt field (`''`: none).
/// Returns `{1, token, depth}` when granted, `{0, pttl, 0}` when held by someone else in
/// Redisson's layout (who publishes on release), `{0, pttl, 1}` when held in another format
/// (a plain `SET NX PX` string: nobody publishes its release), or an error (before any
/// write) for a TTL out of range.
///
/// A new holder's token is the incremented counter, raised to the server's clock in
/// microseconds since the epoch when the counter is behind it. So a server that lost the
/// counter or holds an old copy of it (restarted without persistence, a replica promoted
/// before the last increments reached it) still hands out tokens greater than any given
/// before, unless clocks stepped back by more than the time since those grants; and the
/// counter still only grows. Values stay below 2^53, so the Lua arithmetic is exact.
///
/// A reentrant acquisition makes the lease the longer of what is left and the new TTL:
/// never shorter, since an outer guard relies on it. An attempt that already took effect
/// (a retry after a lost reply) gets the same grant again, without a second hold.
pub static ACQUIRE: LazyLock<Script> = LazyLock::new(|| Script::new(ACQUIRE_LUA));

/// The source of [`ACQUIRE`], for `EVAL` in a pipeline with `WAIT` (the two must run on one
/// connection, in order). A retried attempt rewrites its marker, so the connection has a
/// write for `WAIT` to count even when nothing else changes.
pub(crate) const ACQUIRE_LUA: &str = r"
local ttl = tonumber(ARGV[1])
if not ttl or ttl < 1 or ttl > 1000000000000 then
  return redis.error_reply('ERR lockkit: lease of ' .. tostring(ARGV[1]) .. ' ms is out of range')
end
local t = redis.call('type', KEYS[1]).ok
if t == 'none' then
  redis.call('hincrby', KEYS[1], ARGV[2], 1)
  if ARGV[3] ~= '' then redis.call('hset', KEYS[1], ARGV[3], 1) end
  redis.call('pexpire', KEYS[1], ttl)
  local now = redis.call('time')
  local floor = now[1] .. string.format('%06d', tonumber(now[2]))
  local token = redis.call('incr', KEYS[2])
  if token < tonumber(floor) then
    redis.call('set', KEYS[2], floor)
    token = tonumber(floor)
  end
  return {1, token, 1}
end
if t == 'hash' and redis.call('hexists', KEYS[1], ARGV[2]) == 1 then
  local depth
  if ARGV[3] ~= '' and redis.call('hexists', KEYS[1], ARGV[3]) == 1 then
    redis.call('hset', KEYS[1], ARGV[3], 1)
    depth = tonumber(redis.call('hget', KEYS[1], ARGV[2]))
  else
    depth = redis.call('hincrby', KEYS[1], ARGV[2], 1)
    if ARGV[3] ~= '' then redis.call('hset', KEYS[1], ARGV[3], 1) end
  end
  if redis.call('pttl', KEYS[1]) < ttl then redis.call('pexpire', KEYS[1], ttl) end
  return {1, tonumber(redis.call('get', KEYS[2]) or '0'), depth}
end
if t == 'hash' then
  return {0, redis.call('pttl', KEYS[1]), 0}
end
return {0, redis.call('pttl', KEYS[1]), 1}
";

/// KEYS: lock. ARGV: ttl ms, owner field. Returns 1 if renewed, 0 if not ours. The lease
/// becomes the longer of what is left and `ttl`: a renewal never shortens it.
pub static RENEW: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
if redis.call('type', KEYS[1]).ok == 'hash' and redis.call('hexists', KEYS[1], ARGV[2]) == 1 then
  if redis.call('pttl', KEYS[1]) < tonumber(ARGV[1]) then
    redis.call('pexpire', KEYS[1], ARGV[1])
  end
  return 1
end
return 0
",
    )
});

/// KEYS: lock, channel. ARGV: owner field, the grant's attempt field (`''`: release one hold
/// whatever acquired it). Returns -1 if not ours, else the holds left (0: released and
/// published). A partial release leaves the lease as it is. With an attempt field, only a
/// hold that attempt added is given back, once: a retried release, or a give-back on a
/// master whose vote failed, changes nothing and reports the holds left.
pub static RELEASE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
if redis.call('type', KEYS[1]).ok ~= 'hash' or redis.call('hexists', KEYS[1], ARGV[1]) == 0 then
  return -1
end
if ARGV[2] ~= '' then
  if redis.call('hdel', KEYS[1], ARGV[2]) == 0 then
    return tonumber(redis.call('hget', KEYS[1], ARGV[1]))
  end
end
local left = redis.call('hincrby', KEYS[1], ARGV[1], -1)
if left > 0 then
  return left
end
redis.call('del', KEYS[1])
redis.call('publish', KEYS[2], 0)
return 0
",
    )
});

/// KEYS: lock, token. Returns `{type, pttl, token, field1, count1, ...}`.
pub static INSPECT: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
local t = redis.call('type', KEYS[1]).ok
local out = {t, redis.call('pttl', KEYS[1]), redis.call('get', KEYS[2]) or ''}
if t == 'hash' then
  local all = redis.call('hgetall', KEYS[1])
  for i = 1, #all do out[#out + 1] = all[i] end
elseif t == 'string' then
  out[#out + 1] = redis.call('get', KEYS[1])
end
return out
",
    )
});

/// KEYS: token. ARGV: a token value. Raises the counter to at least ARGV[1] (Redlock's
/// write-back of the highest token seen). Returns the counter.
pub static RAISE_TOKEN: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
local current = tonumber(redis.call('get', KEYS[1]) or '0')
local wanted = tonumber(ARGV[1])
if wanted > current then
  redis.call('set', KEYS[1], ARGV[1])
  return wanted
end
return current
",
    )
});
