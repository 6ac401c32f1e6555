//! The wire layouts of read-write locks and counting semaphores, and their Lua scripts.
//!
//! **Read-write locks** keep Redisson's `RReadWriteLock` layout. For lock name `n`, with
//! `S(n)` = `{n}` (or `n` when it already has a `{`) and owner `o` = `<uuid>:<n>`:
//! - hash `n`: field `mode` (`read` / `write`), field `o` (the owner's read count), field
//!   `o:write` (its write count);
//! - `S(n):o:rwlock_timeout:<i>` (i = 1..count): `1`, with the lease of read hold i;
//! - channel `redisson_rwlock:{n}`: `0` after the last read, `1` after a write release.
//!
//! lockkit adds, all named `lockkit`: hash fields `lockkit-attempt:<uuid>` (the attempt
//! ledger, value `r:<o>` or `w:<o>`), `lockkit-token:<field>` (`t<token>`) and
//! `lockkit-holder:<field>` (the encoded identity), and the sorted set `S(n):lockkit_wwait`
//! of waiting writers (member `o`, score the marker's expiry in server ms). **No lockkit
//! field ever holds a number**: Redisson's read unlock loops `for i = count, 1, -1` over
//! every numeric field. Every new hold takes a token from the key's one counter,
//! `redisson_lock_token:{n}`, which the mutex uses too. A read or write release also
//! publishes `0` on the mutex channel `redisson_lock__channel:{n}`, where lockkit's waiters
//! of every kind listen.
//!
//! **Semaphores** keep Redisson's `RPermitExpirableSemaphore` layout: the string `n` holds
//! the available permits, the sorted set `S(n):timeout` the permits (member: 16 raw id
//! bytes, lockkit's being the acquisition's attempt uuid; score: expiry in ms from the
//! server's `TIME`), and the channel `redisson_sc:{n}` carries the new available count.
//! lockkit adds the hash `S(n):lockkit_permits` (id hex → `t<token>|<owner>|<identity>`) and
//! a short release latch `S(n):lockkit_released:<id hex>`; tokens come from the same key
//! counter as locks.

use std::sync::LazyLock;

use redis::Script;

use super::{LockNames, prefixed};

/// `S(n)`: Redisson's `suffixName` base for `n`.
pub(crate) fn suffix_base(name: &str) -> String {
    if name.contains('{') {
        name.to_owned()
    } else {
        format!("{{{name}}}")
    }
}

/// The waiting-writer set of the lock named `names` (`S(n):lockkit_wwait`, as
/// [`KindNames::waiting_writers`]), without the other names a [`KindNames`] makes: a plain
/// lock's acquisition needs only this one.
pub(crate) fn waiting_writers_of(names: &LockNames) -> String {
    let mut name = suffix_base(&names.lock);
    name.push_str(":lockkit_wwait");
    name
}

/// The Redis names of one key's read-write lock and semaphore layouts, beside
/// [`LockNames`] (all in the lock's cluster slot).
#[derive(Debug, Clone)]
pub(crate) struct KindNames {
    /// The lock hash / the semaphore's available-permits string (`n`).
    pub(crate) lock: String,
    /// The fencing counter shared with the mutex.
    pub(crate) token: String,
    /// The mutex release channel, where lockkit waiters of every kind listen.
    pub(crate) lock_channel: String,
    /// `S(n)`, the prefix of Redisson's per-hold timeout keys.
    pub(crate) base: String,
    /// `redisson_rwlock:{n}`.
    pub(crate) rw_channel: String,
    /// Waiting writers: `S(n):lockkit_wwait`.
    pub(crate) waiting_writers: String,
    /// `S(n):timeout`: the semaphore's permits.
    pub(crate) permits: String,
    /// `redisson_sc:{n}`.
    pub(crate) sem_channel: String,
    /// `S(n):lockkit_permits`: tokens, owners and identities of lockkit's permits.
    pub(crate) permit_info: String,
}

impl KindNames {
    pub(crate) fn new(names: &LockNames) -> Self {
        let base = suffix_base(&names.lock);
        KindNames {
            lock: names.lock.clone(),
            token: names.token.clone(),
            lock_channel: names.channel.clone(),
            rw_channel: prefixed("redisson_rwlock", &names.lock),
            waiting_writers: waiting_writers_of(names),
            permits: format!("{base}:timeout"),
            sem_channel: prefixed("redisson_sc", &names.lock),
            permit_info: format!("{base}:lockkit_permits"),
            base,
        }
    }

    /// The prefix of `owner`'s read timeout keys: `S(n):<owner>:rwlock_timeout`.
    pub(crate) fn read_timeouts(&self, owner: &str) -> String {
        format!("{}:{owner}:rwlock_timeout", self.base)
    }

    /// The release latch of one permit.
    pub(crate) fn permit_latch(&self, id_hex: &str) -> String {
        format!("{}:lockkit_released:{id_hex}", self.base)
    }
}

/// How long a waiting writer's marker lives unless refreshed, in ms.
pub(crate) const WRITER_MARKER_MS: u64 = 3_000;

/// Lua helpers shared by the scripts below.
macro_rules! helpers {
    () => {
        r"
local function now_ms()
  local t = redis.call('time')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local function next_token(counter)
  local now = redis.call('time')
  local floor = now[1] .. string.format('%06d', tonumber(now[2]))
  local token = redis.call('incr', counter)
  if token < tonumber(floor) then
    redis.call('set', counter, floor)
    token = tonumber(floor)
  end
  return token
end
local function tstr(token)
  return 't' .. string.format('%.0f', token)
end
local function untoken(value)
  if not value then return 0 end
  return tonumber(string.sub(value, 2)) or 0
end
local function check_ttl(ttl)
  if not ttl or ttl < 1 or ttl > 1000000000000 then
    return redis.error_reply('ERR lockkit: lease of ' .. tostring(ttl) .. ' ms is out of range')
  end
end
-- Whether a hash field is a Redisson read count (not `mode`, a writer or a lockkit field).
local function is_reader(field, value)
  return tonumber(value) ~= nil and field ~= 'mode' and string.sub(field, 1, 8) ~= 'lockkit-'
    and string.sub(field, -6) ~= ':write'
end
-- The lease left of the read hold counted in `field` (its longest timeout key), 0 if dead.
local function read_ttl(base, field, count)
  local best = 0
  local low = math.max(1, count - 999)
  for i = count, low, -1 do
    local p = redis.call('pttl', base .. ':' .. field .. ':rwlock_timeout:' .. i)
    if p > best then best = p end
  end
  return best
end
-- Forgets the dead read hold of `field`: its count, lockkit fields and attempt ledger.
local function forget_reader(n, base, field, all)
  local count = tonumber(redis.call('hget', n, field) or '0') or 0
  for i = 1, math.min(count, 1000) do
    redis.call('del', base .. ':' .. field .. ':rwlock_timeout:' .. i)
  end
  redis.call('hdel', n, field, 'lockkit-token:' .. field, 'lockkit-holder:' .. field)
  for i = 1, #all, 2 do
    if all[i + 1] == 'r:' .. field then redis.call('hdel', n, all[i]) end
  end
end
-- The longest lease left of the live readers of `n` (0: none), forgetting dead ones.
local function live_readers(n, base)
  local all = redis.call('hgetall', n)
  local best = 0
  local dead = {}
  for i = 1, #all, 2 do
    if is_reader(all[i], all[i + 1]) then
      local left = read_ttl(base, all[i], tonumber(all[i + 1]))
      if left > best then best = left end
      if left <= 0 then dead[#dead + 1] = all[i] end
    end
  end
  for _, field in ipairs(dead) do forget_reader(n, base, field, all) end
  return best
end
-- The soonest expiry of a live waiting-writer marker, in ms from now (false: none), after
-- dropping expired markers. Any owner's: a new read of the writer's own owner waits too,
-- or that writer would wait for its own owner's read.
local function writer_waits(wwait, now)
  redis.call('zremrangebyscore', wwait, '-inf', now)
  local first = redis.call('zrange', wwait, 0, 0, 'WITHSCORES')
  if #first == 0 then return false end
  return math.max(tonumber(first[2]) - now, 1)
end
local function mark_writer(wwait, owner, now, marker)
  if marker > 0 then
    redis.call('zadd', wwait, now + marker, owner)
    if redis.call('pttl', wwait) < marker then redis.call('pexpire', wwait, marker) end
  end
end
local function tohex(bytes)
  return (string.gsub(bytes, '.', function(c) return string.format('%02x', string.byte(c)) end))
end
"
    };
}

// Replies of the acquire scripts: `{1, token, depth}` granted; `{0, ms, why}` busy, `ms`
// the lease or marker left (-1: no expiry, -2: gone) and `why` 0 (a Redisson-layout holder,
// who publishes its release), [`BUSY_FOREIGN`] or 2 (a writer waits: `ms` is when its
// marker runs out; its grant, release or give-up publishes); `{-1, what, n}` the key is used
// as another kind (`MISMATCH_*`); `{-2, 0, 0}` an upgrade. Redisson's score of a permit
// without expiry, `922337203685477`, is never reported as a lease.

/// Busy: held in a foreign format that publishes nothing (poll).
pub(crate) const BUSY_FOREIGN: i64 = 1;
/// Mismatch: this owner holds the key as a plain lock.
pub(crate) const MISMATCH_OWN_LOCK: i64 = 1;
/// Mismatch: this owner holds the key as a read-write lock (a plain lock asked).
pub(crate) const MISMATCH_OWN_RW: i64 = 2;
/// Mismatch: a semaphore of `n` permits (another count asked).
pub(crate) const MISMATCH_PERMITS: i64 = 3;
/// Mismatch: the key is a lock (a semaphore asked).
pub(crate) const MISMATCH_IS_LOCK: i64 = 4;

/// KEYS: n, token, waiting writers, the owner's read timeout prefix. ARGV: ttl ms, `o`,
/// `o:write`, attempt field (`''`: none), identity, `S(n)`.
///
/// Grants a read: a new reader when the key is free or read and no other owner's writer
/// waits, a re-entry of a live read hold (never shortening its lease), or a downgrade when
/// `o` writes. A new hold (also a downgrade) takes a fresh token; a re-entry keeps it. A
/// retried attempt gets the same grant again. A read hold of `o` whose timeout keys all ran
/// out is forgotten first (it is no hold any more).
pub(crate) static ACQUIRE_READ: LazyLock<Script> = LazyLock::new(|| Script::new(ACQUIRE_READ_LUA));

/// The source of [`ACQUIRE_READ`] (for `EVAL` before `WAIT`).
pub(crate) const ACQUIRE_READ_LUA: &str = concat!(
    helpers!(),
    r"
local n, ttl, o, ow, attempt, base = KEYS[1], tonumber(ARGV[1]), ARGV[2], ARGV[3], ARGV[4], ARGV[6]
local bad = check_ttl(ttl)
if bad then return bad end
local t = redis.call('type', n).ok
if t ~= 'none' and t ~= 'hash' then return {0, redis.call('pttl', n), 1} end
local now = now_ms()
local mode = false
if t == 'hash' then
  mode = redis.call('hget', n, 'mode')
  if not mode then
    if redis.call('hexists', n, o) == 1 then return {-1, 1, 0} end
    return {0, redis.call('pttl', n), 0}
  end
end
local count = tonumber(redis.call('hget', n, o) or '0') or 0
if count > 0 and read_ttl(base, o, count) <= 0 then
  forget_reader(n, base, o, redis.call('hgetall', n))
  count = 0
end
if count > 0 and attempt ~= '' and redis.call('hget', n, attempt) == 'r:' .. o then
  for i = 1, math.min(count, 1000) do
    local key = KEYS[4] .. ':' .. i
    if redis.call('pttl', key) < ttl then redis.call('set', key, 1, 'px', ttl) end
  end
  if redis.call('pttl', n) < ttl then redis.call('pexpire', n, ttl) end
  return {1, untoken(redis.call('hget', n, 'lockkit-token:' .. o)), count}
end
if mode == 'write' and redis.call('hexists', n, ow) == 0 then
  return {0, redis.call('pttl', n), 0}
end
if count == 0 and mode ~= 'write' then
  local left = writer_waits(KEYS[3], now)
  if left then return {0, left, 2} end
end
if not mode then redis.call('hset', n, 'mode', 'read') end
local depth = redis.call('hincrby', n, o, 1)
redis.call('set', KEYS[4] .. ':' .. depth, 1, 'px', ttl)
if redis.call('pttl', n) < ttl then redis.call('pexpire', n, ttl) end
local token
if depth == 1 then
  token = next_token(KEYS[2])
  redis.call('hset', n, 'lockkit-token:' .. o, tstr(token))
  if ARGV[5] ~= '' then redis.call('hset', n, 'lockkit-holder:' .. o, ARGV[5]) end
else
  token = untoken(redis.call('hget', n, 'lockkit-token:' .. o))
end
if attempt ~= '' then redis.call('hset', n, attempt, 'r:' .. o) end
return {1, token, depth}
"
);

/// KEYS: n, token, waiting writers. ARGV: ttl ms, `o`, `o:write`, attempt field, identity,
/// `S(n)`, marker ms (0: do not mark).
///
/// Grants a write when the key is free (or only dead readers are left, forgotten first), or
/// re-enters `o`'s write (never shortening the lease). Refuses an upgrade (`o` reads, does
/// not write) and a plain lock of `o`. Busy otherwise; with a marker time, `o` is then
/// registered (or refreshed) as a waiting writer. A grant removes `o`'s marker.
pub(crate) static ACQUIRE_WRITE: LazyLock<Script> =
    LazyLock::new(|| Script::new(ACQUIRE_WRITE_LUA));

/// The source of [`ACQUIRE_WRITE`].
pub(crate) const ACQUIRE_WRITE_LUA: &str = concat!(
    helpers!(),
    r"
local n, ttl, o, ow, attempt, base = KEYS[1], tonumber(ARGV[1]), ARGV[2], ARGV[3], ARGV[4], ARGV[6]
local marker = tonumber(ARGV[7]) or 0
local bad = check_ttl(ttl)
if bad then return bad end
local t = redis.call('type', n).ok
if t ~= 'none' and t ~= 'hash' then return {0, redis.call('pttl', n), 1} end
local now = now_ms()
if t == 'hash' then
  local mode = redis.call('hget', n, 'mode')
  if not mode then
    if redis.call('hexists', n, o) == 1 then return {-1, 1, 0} end
    mark_writer(KEYS[3], o, now, marker)
    return {0, redis.call('pttl', n), 0}
  end
  if mode == 'write' then
    local depth = tonumber(redis.call('hget', n, ow) or '0') or 0
    if depth == 0 then
      mark_writer(KEYS[3], o, now, marker)
      return {0, redis.call('pttl', n), 0}
    end
    if attempt == '' or redis.call('hget', n, attempt) ~= 'w:' .. o then
      depth = redis.call('hincrby', n, ow, 1)
      if attempt ~= '' then redis.call('hset', n, attempt, 'w:' .. o) end
    end
    if redis.call('pttl', n) < ttl then redis.call('pexpire', n, ttl) end
    redis.call('zrem', KEYS[3], o)
    return {1, untoken(redis.call('hget', n, 'lockkit-token:' .. ow)), depth}
  end
  local count = tonumber(redis.call('hget', n, o) or '0') or 0
  if count > 0 and read_ttl(base, o, count) > 0 then return {-2, 0, 0} end
  if live_readers(n, base) > 0 then
    mark_writer(KEYS[3], o, now, marker)
    return {0, redis.call('pttl', n), 0}
  end
  redis.call('del', n)
end
redis.call('hset', n, 'mode', 'write', ow, 1)
redis.call('pexpire', n, ttl)
local token = next_token(KEYS[2])
redis.call('hset', n, 'lockkit-token:' .. ow, tstr(token))
if ARGV[5] ~= '' then redis.call('hset', n, 'lockkit-holder:' .. ow, ARGV[5]) end
if attempt ~= '' then redis.call('hset', n, attempt, 'w:' .. o) end
redis.call('zrem', KEYS[3], o)
return {1, token, 1}
"
);

/// KEYS: waiting writers, mutex channel. ARGV: `o`. Removes `o`'s waiting-writer marker;
/// if it was there, publishes on the mutex channel so readers it kept out try again.
pub(crate) static FORGET_WRITER: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
if redis.call('zrem', KEYS[1], ARGV[1]) == 1 then
  redis.call('publish', KEYS[2], 0)
  return 1
end
return 0
",
    )
});

/// KEYS: token, n. ARGV: a token value, the hold's field (`o` for a read, `o:write` for a
/// write). Redlock's write-back for a read or write hold: raises the counter to at least
/// the token (as [`super::RAISE_TOKEN`]) and, if the hash is a read-write lock that still
/// has the hold, records the token as the hold's (`lockkit-token:<field>`), so a re-entry
/// or a retried attempt on this master reports the quorum's token, not this master's own.
/// Returns the counter.
pub(crate) static RAISE_HOLD_TOKEN: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
local current = tonumber(redis.call('get', KEYS[1]) or '0')
local wanted = tonumber(ARGV[1])
if wanted > current then
  redis.call('set', KEYS[1], ARGV[1])
  current = wanted
end
if redis.call('type', KEYS[2]).ok == 'hash' and redis.call('hexists', KEYS[2], 'mode') == 1
  and redis.call('hexists', KEYS[2], ARGV[2]) == 1 then
  redis.call('hset', KEYS[2], 'lockkit-token:' .. ARGV[2], 't' .. ARGV[1])
end
return current
",
    )
});

/// KEYS: n, the owner's read timeout prefix. ARGV: ttl ms, `o`, `S(n)`. Returns 1 if `o`'s
/// read hold is live and now lasts at least `ttl` (each timeout key and the hash: never
/// shortened), 0 if it is not held (a dead hold is forgotten).
pub(crate) static RENEW_READ: LazyLock<Script> = LazyLock::new(|| {
    Script::new(concat!(
        helpers!(),
        r"
local n, ttl, o, base = KEYS[1], tonumber(ARGV[1]), ARGV[2], ARGV[3]
if redis.call('type', n).ok ~= 'hash' or not redis.call('hget', n, 'mode') then return 0 end
local count = tonumber(redis.call('hget', n, o) or '0') or 0
if count == 0 then return 0 end
if read_ttl(base, o, count) <= 0 then
  forget_reader(n, base, o, redis.call('hgetall', n))
  return 0
end
for i = 1, math.min(count, 1000) do
  local key = KEYS[2] .. ':' .. i
  local p = redis.call('pttl', key)
  if p > 0 and p < ttl then redis.call('pexpire', key, ttl) end
end
if redis.call('pttl', n) < ttl then redis.call('pexpire', n, ttl) end
return 1
"
    ))
});

/// KEYS: n. ARGV: ttl ms, `o:write`. Returns 1 if `o` writes (the lease is now at least
/// `ttl`, never shortened), 0 if not.
pub(crate) static RENEW_WRITE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
if redis.call('type', KEYS[1]).ok == 'hash' and redis.call('hget', KEYS[1], 'mode') == 'write'
  and redis.call('hexists', KEYS[1], ARGV[2]) == 1 then
  if redis.call('pttl', KEYS[1]) < tonumber(ARGV[1]) then
    redis.call('pexpire', KEYS[1], ARGV[1])
  end
  return 1
end
return 0
",
    )
});

/// KEYS: n, rw channel, mutex channel, the owner's read timeout prefix. ARGV: `o`, attempt
/// field (`''`: any), `S(n)`.
///
/// Gives back one read hold of `o` as Redisson's read unlock does (the count, then the
/// topmost timeout key). Returns -1 if `o` holds no live read, else the holds left. When the
/// last read of the key ends the hash goes and `0` is published on both channels; while
/// other readers live the hash's lease becomes the longest of theirs; while `o` still
/// writes nothing else changes. A retried release (its attempt already given back) changes
/// nothing.
pub(crate) static RELEASE_READ: LazyLock<Script> = LazyLock::new(|| {
    Script::new(concat!(
        helpers!(),
        r"
local n, o, attempt, base = KEYS[1], ARGV[1], ARGV[2], ARGV[3]
if redis.call('type', n).ok ~= 'hash' then return -1 end
local mode = redis.call('hget', n, 'mode')
local count = tonumber(redis.call('hget', n, o) or '0') or 0
if not mode or count == 0 then return -1 end
if read_ttl(base, o, count) <= 0 then
  forget_reader(n, base, o, redis.call('hgetall', n))
  count = 0
elseif attempt ~= '' then
  if redis.call('hget', n, attempt) ~= 'r:' .. o then return count end
  redis.call('hdel', n, attempt)
end
if count > 0 then
  local left = redis.call('hincrby', n, o, -1)
  local top = KEYS[4] .. ':' .. (left + 1)
  if left > 0 then
    -- Redisson deletes the topmost timeout key whichever hold ends: the holds left keep
    -- the longest lease of those it counted (a short re-entry given back must not cut a
    -- longer one it leaves behind).
    local keep = redis.call('pttl', top)
    local below = KEYS[4] .. ':' .. left
    if keep > redis.call('pttl', below) then redis.call('set', below, 1, 'px', keep) end
  end
  redis.call('del', top)
  if left > 0 then return left end
  redis.call('hdel', n, o, 'lockkit-token:' .. o, 'lockkit-holder:' .. o)
end
if mode == 'write' then return count > 0 and 0 or -1 end
local longest = live_readers(n, base)
if longest > 0 then
  redis.call('pexpire', n, longest)
else
  redis.call('del', n)
  redis.call('publish', KEYS[2], 0)
  redis.call('publish', KEYS[3], 0)
end
if count == 0 then return -1 end
return 0
"
    ))
});

/// KEYS: n, rw channel, mutex channel. ARGV: `o:write`, attempt field (`''`: any), `o`,
/// `S(n)`.
///
/// Gives back one write hold. Returns -1 if `o` does not write, else the holds left (a
/// partial release leaves the lease as it is). At the last one: if `o` (or anyone) still
/// reads, the mode becomes `read` with the readers' longest lease; otherwise the hash goes.
/// Either way `1` is published on the rw channel and `0` on the mutex channel.
pub(crate) static RELEASE_WRITE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(concat!(
        helpers!(),
        r"
local n, ow, attempt, o, base = KEYS[1], ARGV[1], ARGV[2], ARGV[3], ARGV[4]
if redis.call('type', n).ok ~= 'hash' or redis.call('hget', n, 'mode') ~= 'write' then return -1 end
local count = tonumber(redis.call('hget', n, ow) or '0') or 0
if count == 0 then return -1 end
if attempt ~= '' then
  if redis.call('hget', n, attempt) ~= 'w:' .. o then return count end
  redis.call('hdel', n, attempt)
end
local left = redis.call('hincrby', n, ow, -1)
if left > 0 then return left end
redis.call('hdel', n, ow, 'lockkit-token:' .. ow, 'lockkit-holder:' .. ow)
local longest = live_readers(n, base)
if longest > 0 then
  redis.call('hset', n, 'mode', 'read')
  redis.call('pexpire', n, longest)
else
  redis.call('del', n)
end
redis.call('publish', KEYS[2], 1)
redis.call('publish', KEYS[3], 0)
return 0
"
    ))
});

/// KEYS: n, permits zset, sem channel, permit info. Purges expired permits (at most 1000):
/// each gives its permit back to the count, which is published.
macro_rules! purge_permits {
    () => {
        r"
local function purge(now)
  local expired = redis.call('zrangebyscore', KEYS[2], 0, now, 'limit', 0, 1000)
  if #expired == 0 then return end
  for _, id in ipairs(expired) do
    redis.call('zrem', KEYS[2], id)
    redis.call('hdel', KEYS[4], tohex(id))
  end
  if redis.call('type', KEYS[1]).ok == 'string' then
    local v = redis.call('incrby', KEYS[1], #expired)
    if v > 0 then redis.call('publish', KEYS[3], v) end
  end
end
"
    };
}

/// KEYS: n, permits zset, sem channel, permit info, token. ARGV: limit, ttl ms, permit id
/// (16 bytes), `t..|owner|identity` tail (`|owner|identity`), id hex.
///
/// Purges expired permits, creates the count (`limit` less the permits out) if absent, and
/// refuses a count that disagrees (`available + out ≠ limit`). A retried attempt finds its
/// permit (never shortened). Otherwise takes a permit if one is available, with a fresh
/// token; busy with the soonest lease end otherwise.
pub(crate) static ACQUIRE_PERMIT: LazyLock<Script> =
    LazyLock::new(|| Script::new(ACQUIRE_PERMIT_LUA));

/// The source of [`ACQUIRE_PERMIT`].
pub(crate) const ACQUIRE_PERMIT_LUA: &str = concat!(
    helpers!(),
    purge_permits!(),
    r"
local limit, ttl, id = tonumber(ARGV[1]), tonumber(ARGV[2]), ARGV[3]
local bad = check_ttl(ttl)
if bad then return bad end
local t = redis.call('type', KEYS[1]).ok
if t ~= 'none' and t ~= 'string' then return {-1, 4, 0} end
local now = now_ms()
purge(now)
local used = redis.call('zcard', KEYS[2])
local avail = nil
if t == 'string' then
  avail = tonumber(redis.call('get', KEYS[1]))
  if avail == nil then return {0, redis.call('pttl', KEYS[1]), 1} end
  if avail + used ~= limit then return {-1, 3, avail + used} end
else
  if used > limit then return {-1, 3, used} end
  avail = limit - used
  redis.call('set', KEYS[1], avail)
end
local score = redis.call('zscore', KEYS[2], id)
if score then
  if tonumber(score) < now + ttl then redis.call('zadd', KEYS[2], now + ttl, id) end
  if redis.call('pttl', KEYS[4]) < ttl then redis.call('pexpire', KEYS[4], ttl) end
  local info = redis.call('hget', KEYS[4], ARGV[5]) or ''
  return {1, untoken(string.match(info, '^[^|]*')), 1}
end
if avail >= 1 then
  redis.call('decrby', KEYS[1], 1)
  redis.call('zadd', KEYS[2], now + ttl, id)
  local keep = redis.call('pttl', KEYS[1])
  if keep > 0 then redis.call('pexpire', KEYS[2], keep) end
  local token = next_token(KEYS[5])
  redis.call('hset', KEYS[4], ARGV[5], tstr(token) .. ARGV[4])
  if redis.call('pttl', KEYS[4]) < ttl then redis.call('pexpire', KEYS[4], ttl) end
  return {1, token, 1}
end
local first = redis.call('zrange', KEYS[2], 0, 0, 'WITHSCORES')
if first[2] and tonumber(first[2]) < 922337203685477 then
  return {0, math.max(tonumber(first[2]) - now, 1), 0}
end
return {0, -1, 0}
"
);

/// KEYS: n, permits zset, sem channel, permit info. ARGV: permit id, ttl ms, id hex.
/// Returns 1 if the permit is live and now lasts at least `ttl` (never shortened), 0 if
/// not (expired permits are purged).
pub(crate) static RENEW_PERMIT: LazyLock<Script> = LazyLock::new(|| {
    Script::new(concat!(
        helpers!(),
        purge_permits!(),
        r"
local now = now_ms()
purge(now)
local ttl = tonumber(ARGV[2])
local score = redis.call('zscore', KEYS[2], ARGV[1])
if not score then return 0 end
if tonumber(score) < now + ttl then redis.call('zadd', KEYS[2], now + ttl, ARGV[1]) end
if redis.call('pttl', KEYS[4]) < ttl then redis.call('pexpire', KEYS[4], ttl) end
return 1
"
    ))
});

/// KEYS: n, permits zset, sem channel, permit info, latch. ARGV: permit id, id hex.
/// Returns 0 when the permit was given back (now, or by the release this one retries:
/// the latch), -1 when it was not held (expired: it is purged). A release publishes the new
/// available count.
pub(crate) static RELEASE_PERMIT: LazyLock<Script> = LazyLock::new(|| {
    Script::new(concat!(
        helpers!(),
        purge_permits!(),
        r"
if redis.call('exists', KEYS[5]) == 1 then return 0 end
purge(now_ms())
if redis.call('zrem', KEYS[2], ARGV[1]) == 0 then return -1 end
redis.call('hdel', KEYS[4], ARGV[2])
if redis.call('type', KEYS[1]).ok == 'string' then
  redis.call('publish', KEYS[3], redis.call('incrby', KEYS[1], 1))
end
redis.call('set', KEYS[5], 1, 'px', 10000)
return 0
"
    ))
});

/// KEYS: n, token, permits zset, permit info, waiting writers. ARGV: `S(n)`.
///
/// Every live hold of a read-write lock or semaphore, read-only:
/// - `{'rw', waiting writers, field, depth, ttl ms, token, identity, ...}` (writer first);
/// - `{'sem', available, permits out (live or not yet purged), id hex, ttl ms, info, ...}`;
/// - `{'other'}` for anything else (a plain lock, a free key, a foreign value).
pub(crate) static HOLDERS: LazyLock<Script> = LazyLock::new(|| {
    Script::new(concat!(
        helpers!(),
        r"
local n, base = KEYS[1], ARGV[1]
local t = redis.call('type', n).ok
local now = now_ms()
if t == 'hash' then
  local mode = redis.call('hget', n, 'mode')
  if not mode then return {'other'} end
  local out = {'rw', redis.call('zcount', KEYS[5], now, '+inf')}
  local all = redis.call('hgetall', n)
  local values = {}
  for i = 1, #all, 2 do values[all[i]] = all[i + 1] end
  for i = 1, #all, 2 do
    local field, count = all[i], tonumber(all[i + 1])
    if count and string.sub(field, -6) == ':write' and string.sub(field, 1, 8) ~= 'lockkit-' then
      local ttl = redis.call('pttl', n)
      out[#out + 1] = field; out[#out + 1] = count; out[#out + 1] = ttl
      out[#out + 1] = values['lockkit-token:' .. field] or ''
      out[#out + 1] = values['lockkit-holder:' .. field] or ''
    end
  end
  for i = 1, #all, 2 do
    local field = all[i]
    if is_reader(field, all[i + 1]) then
      local count = tonumber(all[i + 1])
      local ttl = read_ttl(base, field, count)
      if ttl > 0 then
        out[#out + 1] = field; out[#out + 1] = count; out[#out + 1] = ttl
        out[#out + 1] = values['lockkit-token:' .. field] or ''
        out[#out + 1] = values['lockkit-holder:' .. field] or ''
      end
    end
  end
  return out
end
if t == 'string' or redis.call('exists', KEYS[3]) == 1 then
  local avail = false
  if t == 'string' then avail = tonumber(redis.call('get', n)) end
  if t == 'string' and not avail then return {'other'} end
  local out = {'sem', avail or 0, redis.call('zcard', KEYS[3])}
  local permits = redis.call('zrangebyscore', KEYS[3], '(' .. now, '+inf', 'WITHSCORES')
  for i = 1, #permits, 2 do
    local hex = tohex(permits[i])
    local score = tonumber(permits[i + 1])
    local ttl = -1
    if score < 922337203685477 then ttl = score - now end
    out[#out + 1] = hex; out[#out + 1] = ttl
    out[#out + 1] = redis.call('hget', KEYS[4], hex) or ''
  end
  return out
end
return {'other'}
"
    ))
});

#[cfg(test)]
mod tests {
    use super::*;
    use lockkit_core::LockKey;

    #[test]
    fn a_plain_locks_waiting_writers_are_the_read_write_locks() {
        for (key, cluster) in [("orders/42", false), ("a{b}c", true), ("x}y", false)] {
            let names = LockNames::new("p/", &LockKey::new(key).unwrap(), cluster).unwrap();
            assert_eq!(
                waiting_writers_of(&names),
                KindNames::new(&names).waiting_writers,
                "{key}"
            );
        }
        // Redisson's `suffixName`: the name in braces, unless it has a hash tag already.
        let names = LockNames::new("", &LockKey::new("orders/42").unwrap(), false).unwrap();
        assert_eq!(waiting_writers_of(&names), "{orders/42}:lockkit_wwait");
        let names = LockNames::new("p/", &LockKey::new("a{b}c").unwrap(), true).unwrap();
        assert_eq!(waiting_writers_of(&names), "p/a{b}c:lockkit_wwait");
    }
}
