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
/// A new holder's token is the incremented counter, raised to the server's clock in
/// microseconds since the epoch when the counter is behind it. So a server that lost the
/// counter or holds an old copy of it (restarted without persistence, a replica promoted
/// before the last increments reached it) still hands out tokens greater than any given
/// before, unless clocks stepped back by more than the time since those grants; and the
/// counter still only grows. Values stay below 2^53, so the Lua arithmetic is exact.
pub static ACQUIRE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
local t = redis.call('type', KEYS[1]).ok
if t == 'none' then
  redis.call('hincrby', KEYS[1], ARGV[2], 1)
  redis.call('pexpire', KEYS[1], ARGV[1])
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
