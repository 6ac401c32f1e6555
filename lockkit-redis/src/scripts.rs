//! The Lua scripts: each operation is one atomic script, loaded once and run by SHA.
//!
//! They keep Redisson's RLock layout (see [`crate::naming`]) and add the fencing counter
//! the way Redisson's RFencedLock does: incremented only when a new holder takes the lock.
//! A key of another type (a plain string set by another client) counts as held.

use std::sync::LazyLock;

use redis::Script;

/// KEYS: lock, token. ARGV: ttl ms, owner field.
/// Returns `{1, token, depth}` when granted, `{0, pttl, 0}` when held by someone else.
///
/// A missing token counter is seeded with the server's clock in microseconds since the
/// epoch before it is incremented, so a server that lost its data (restarted without
/// persistence, or a replica promoted before the counter reached it) still hands out
/// tokens greater than any it gave before, unless its clock stepped back or it granted
/// more than one lock per microsecond on average. Seeded values stay below 2^53, so the
/// Lua arithmetic on them is exact.
pub static ACQUIRE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
local t = redis.call('type', KEYS[1]).ok
if t == 'none' then
  redis.call('hincrby', KEYS[1], ARGV[2], 1)
  redis.call('pexpire', KEYS[1], ARGV[1])
  if redis.call('exists', KEYS[2]) == 0 then
    local now = redis.call('time')
    redis.call('set', KEYS[2], now[1] .. string.format('%06d', tonumber(now[2])))
  end
  return {1, redis.call('incr', KEYS[2]), 1}
end
if t == 'hash' and redis.call('hexists', KEYS[1], ARGV[2]) == 1 then
  local depth = redis.call('hincrby', KEYS[1], ARGV[2], 1)
  redis.call('pexpire', KEYS[1], ARGV[1])
  return {1, tonumber(redis.call('get', KEYS[2]) or '0'), depth}
end
return {0, redis.call('pttl', KEYS[1]), 0}
",
    )
});

/// KEYS: lock. ARGV: ttl ms, owner field. Returns 1 if renewed, 0 if not ours.
pub static RENEW: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
if redis.call('type', KEYS[1]).ok == 'hash' and redis.call('hexists', KEYS[1], ARGV[2]) == 1 then
  redis.call('pexpire', KEYS[1], ARGV[1])
  return 1
end
return 0
",
    )
});

/// KEYS: lock, channel. ARGV: owner field, ttl ms for the remaining holds.
/// Returns -1 if not ours, else the holds left (0: released and published).
pub static RELEASE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
if redis.call('type', KEYS[1]).ok ~= 'hash' or redis.call('hexists', KEYS[1], ARGV[1]) == 0 then
  return -1
end
local left = redis.call('hincrby', KEYS[1], ARGV[1], -1)
if left > 0 then
  redis.call('pexpire', KEYS[1], ARGV[2])
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
