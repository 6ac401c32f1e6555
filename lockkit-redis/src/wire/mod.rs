//! The wire layout, compatible with Redisson's RLock: where a lock lives in Redis, and the
//! Lua scripts that change it.
//!
//! For lock name `n` (prefix + key):
//! - the lock is a hash at `n`, field `<owner-uuid>:<id>`, value the hold count;
//! - the release channel is `redisson_lock__channel:{n}`;
//! - the fencing counter is `redisson_lock_token:{n}`;
//! - lockkit's waiting plain locks queue in `{n}:lockkit_queue` (see [`queue_of`]).
//!
//! Redisson writes `prefix:{name}` unless the name already has a `{`; then it writes
//! `prefix:name`, so that a name's own hash tag keeps all three in one cluster slot.
//!
//! The Lua scripts: each operation is one atomic script, loaded once and run by SHA.
//!
//! They keep Redisson's RLock layout (above) and add the fencing counter
//! the way Redisson's RFencedLock does: incremented only when a new holder takes the lock.
//! A key of another type (a plain string set by another client) counts as held.

use std::sync::LazyLock;

use lockkit_core::{Error, LockKey, Result};
use redis::Script;

mod rw;
pub(crate) use rw::*;

/// The three Redis names of one lock.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LockNames {
    /// The hash holding owner -> hold count.
    pub lock: String,
    /// The channel a release publishes `0` on.
    pub channel: String,
    /// The fencing counter.
    pub token: String,
}

/// The hash tag Redis Cluster would use for `key`, if it has one.
fn hash_tag(key: &str) -> Option<&str> {
    let open = key.find('{')?;
    let close = key[open + 1..].find('}')?;
    (close > 0).then(|| &key[open + 1..open + 1 + close])
}

fn prefixed(prefix: &str, name: &str) -> String {
    if name.contains('{') {
        format!("{prefix}:{name}")
    } else {
        format!("{prefix}:{{{name}}}")
    }
}

impl LockNames {
    /// Names for `key` under `prefix`. In cluster mode a name whose braces would put its
    /// counter in another slot than its lock is refused.
    ///
    /// # Errors
    /// [`Error::InvalidKey`] in cluster mode for names with unbalanced or empty braces.
    pub fn new(prefix: &str, key: &LockKey, cluster: bool) -> Result<Self> {
        let lock = format!("{prefix}{key}");
        // A name with braces but no hash tag is hashed whole, while the counter and
        // channel (`prefix:{name}`) would take the text up to its first `}` as their tag:
        // another slot.
        if cluster && lock.contains(['{', '}']) && hash_tag(&lock).is_none() {
            return Err(Error::InvalidKey {
                reason: format!(
                    "in Redis Cluster mode `{lock}` has braces but no non-empty `{{tag}}`, so its \
                     counter and channel could land in another slot; balance the braces or drop them"
                ),
            });
        }
        Ok(LockNames {
            channel: prefixed("redisson_lock__channel", &lock),
            token: prefixed("redisson_lock_token", &lock),
            lock,
        })
    }
}

// ---- the scripts

/// The hash field that records one acquisition (`AcquireRequest::attempt`) beside the
/// owner's hold count, so a retried acquire or release takes effect once. Redisson reads only
/// its own `<uuid>:<thread>` fields and `exists`, so extra fields keep the layout compatible;
/// they go with the hash when the lock is released or expires.
pub(crate) const ATTEMPT_FIELD_PREFIX: &str = "lockkit-attempt:";

/// The hash field that stores who took the hold ([`lockkit_core::HolderIdentity`], encoded),
/// written with a new holder's first count and gone with the hash. Redisson ignores it, as it
/// ignores the attempt fields.
pub(crate) const HOLDER_FIELD: &str = "lockkit-holder";

/// The hash field that keeps a hold's fencing token (`t<token>`), written with a new
/// holder's first count and gone with the hash. A re-entry reports the counter, or this
/// when the counter is behind it (gone: evicted by an `allkeys-*` policy, deleted by an
/// operator), and puts the counter back up to it; before, such a re-entry reported token 0,
/// which the core took for a hold gone on the server. Not a number, so nothing that reads
/// the fields' numbers as hold counts takes it for one; Redisson ignores it.
pub(crate) const TOKEN_FIELD: &str = "lockkit-token";

/// The hash field that says waiters are queued for the key (see [`queue_of`]): written by a
/// queued waiter into the hold it waits behind, and by a queued waiter's grant while others
/// are still queued, so that the release of that hold names the next waiter. Gone with the
/// hash; Redisson ignores it. Its value (`q`) is not a number, so that nothing that reads
/// the fields' numbers as hold counts (lockkit before the queue, Redisson's read unlock)
/// takes it for one. The queue's operations run under `pcall`: a key of another type under
/// the queue's name (a lock named so) leaves the waiters without a queue, never a lock
/// without its release.
pub(crate) const QUEUE_FIELD: &str = "lockkit-queue";

/// How long a key's waiter queue outlives its last enqueue, in ms. A waiter re-enqueues
/// (keeping its place) at each busy answer; a queue that ran out only makes the next release
/// wake every waiter, as a release without a queue does.
/// (The script writes it as a literal; a unit test holds the two together.)
#[cfg_attr(not(test), allow(dead_code))]
pub(crate) const QUEUE_LIFE_MS: u64 = 60_000;

/// The smallest waiter id a release names (`2^61`): every id is at least this, so that a
/// release message can name one (Redisson's waiters read messages as numbers and act on `0`
/// and `1` only) and nothing else on the channel passes for one.
pub(crate) const NAMED_WAITER_MIN: u64 = 1 << 61;

/// The waiter queue of the lock named `names` (`S(n):lockkit_queue`, in the lock's cluster
/// slot): a sorted set of the ids of lockkit's waiting plain acquisitions, by the server
/// time in µs each first queued. The release of a hold that waiters queued behind pops the
/// earliest and names it on the release channel, before the `0` every Redisson waiter
/// listens for: the named waiter tries at once, the others stay asleep (see
/// `conn::ReleaseMessages`) instead of all running a script for one grant.
pub(crate) fn queue_of(names: &LockNames) -> String {
    let mut name = rw::suffix_base(&names.lock);
    name.push_str(":lockkit_queue");
    name
}

/// The base of the message that follows a queued waiter's `-<id>` on the release channel:
/// `-(base + lease ms)`, the new hold's lease. The waiters that heard the key taken sleep on,
/// but not past that lease: a holder that dies (or pauses) publishes no release, and the
/// lease they learned before the handoff was the previous holder's, which may end much
/// later. Below every negated id (ids are under `2^62`, the base is `5 * 10^18`), so a
/// lockkit client that does not know it takes it for the grant of a waiter that is not its
/// own (it sleeps on, as after the `-<id>`); Redisson ignores every number but `0` and `1`.
pub(crate) const TAKEN_LEASE_BASE: u64 = 5_000_000_000_000_000_000;

/// [`ACQUIRE`]'s third reply value when busy and the owner is marked as a waiting writer.
pub(crate) const BUSY_MARKED: i64 = 2;

/// How far ahead of a server's clock [`ACQUIRE`] accepts a proposed token (the `20000` µs
/// of its source).
pub(crate) const PROPOSAL_AHEAD_AT_MOST: std::time::Duration = std::time::Duration::from_millis(20);

/// Longest lease the scripts accept, in ms (about 31 years): checked before anything is
/// written, so an absurd TTL never leaves a lock without an expiry.
pub(crate) const MAX_TTL_MS: u64 = 1_000_000_000_000;

/// KEYS: lock, token, waiting writers (`S(n):lockkit_wwait`, see [`KindNames`]), waiter
/// queue ([`queue_of`]), release channel. ARGV: ttl ms, owner field, attempt field (`''`: none), the holder's
/// identity (`''`: none; stored in [`HOLDER_FIELD`] by a new holder only), marker ms (`0`,
/// `''` or absent: do not mark), a proposed token (decimal, below 2^53; `''` or absent: none), the waiter's
/// queue id (`''` or absent: does not queue; else decimal, at least [`NAMED_WAITER_MIN`]),
/// `1` when an earlier attempt of the same wait may have queued it (its grant then
/// leaves the queue), and the score of the place the wait had (`''` or absent: none).
/// ARGV[1] is the TTL in canonical decimal (no sign, no leading zero, no exponent).
///
/// A waiter that finds the key held by others in Redisson's layout queues (keeping its
/// place if it is queued already, see [`queue_of`]) and flags the hold ([`QUEUE_FIELD`]),
/// and the answer carries its place's score as a fourth value. A waiter that is not queued
/// but had a place (a release named it, popping it, and a newcomer took the key before it
/// came) queues again at that place's score (an earlier one than now only), so the next
/// release names it again instead of every waiter that queued after it first; a
/// queued waiter's grant leaves the queue, and while others are queued flags the new hold
/// and publishes its id negated (`-<id>`, a number Redisson ignores) on the release
/// channel, followed by the new lease (`-(TAKEN_LEASE_BASE + ttl)`, see
/// [`TAKEN_LEASE_BASE`]): the waiters that heard another waiter named then know the key is
/// taken, and sleep on instead of trying after their grace, until that lease ends at most.
/// Returns `{1, token, depth}` when granted, `{0, pttl, 0}` when held by someone else in
/// Redisson's layout (who publishes on release; `{0, pttl, 0, score}` when it queued), `{0, pttl, 1}` when held in another format
/// (a plain `SET NX PX` string: nobody publishes its release), `{0, pttl, 2}` when held as
/// a read-write lock by others and the owner was registered as a waiting writer (it must
/// try again within a third of the marker's life to keep it), `{-1, 2, 0}` when the owner
/// holds the key as a read-write lock (a hash with a `mode` field, where the owner's read
/// count must never pass for a mutex hold), or an error (before any write) for a TTL out of
/// range. A read-write lock of other owners is busy.
///
/// A plain lock counts as a writer: with a marker time, an owner that finds the key read
/// or written by others registers (or refreshes) itself in the waiting-writer set, which
/// keeps new readers out (as [`ACQUIRE_WRITE`] does for a writer); a grant removes the
/// owner's marker.
///
/// A new holder's token is the incremented counter, raised to the server's clock in
/// microseconds since the epoch when the counter is behind it, and to the proposed token
/// when that is higher still but at most [`PROPOSAL_AHEAD_AT_MOST`] ahead of the server's
/// clock (Redlock proposes one token to every master, so that a quorum's counters agree
/// after one round and need no write-back). So no token is ever more than that ahead of
/// the clock of the server that gave it, and a server wiped (or a replica promoted) later
/// than that still counts past it from its clock. So a server that lost the
/// counter or holds an old copy of it (restarted without persistence, a replica promoted
/// before the last increments reached it) still hands out tokens greater than any given
/// before, unless clocks stepped back by more than the time since those grants; and the
/// counter still only grows. Values stay below 2^53, so the Lua arithmetic is exact.
///
/// The counter is raised with one `SET … KEEPTTL GET` (the floor), whose answer (the old
/// counter) decides: at or past the floor, a second `SET` writes the counter plus one. An
/// old counter that this cannot count exactly (not the canonical decimal of an integer from
/// 0 to 2^53 - 2: negative, leading zeros, past 2^53, not a number) is put back as it was,
/// and `INCR` counts it as before (or refuses it, as before); so does a server before
/// Redis 6.2, which refuses the `GET` option without writing. The counter's TTL, if anyone
/// set one, is kept on this path (the clock-raising `SET` of `INCR`'s path drops it).
///
/// A new holder's token is also kept in the hash ([`TOKEN_FIELD`]); a re-entry reports the
/// counter, or that token when the counter is behind it (and raises the counter to it).
///
/// A reentrant acquisition makes the lease the longer of what is left and the new TTL:
/// never shorter, since an outer guard relies on it. An attempt that already took effect
/// (a retry after a lost reply) gets the same grant again, without a second hold.
pub(crate) static ACQUIRE: LazyLock<Script> = LazyLock::new(|| Script::new(ACQUIRE_LUA));

/// The source of [`ACQUIRE`], for `EVAL` in a pipeline with `WAIT` (the two must run on one
/// connection, in order). A retried attempt rewrites its marker, so the connection has a
/// write for `WAIT` to count even when nothing else changes.
pub(crate) const ACQUIRE_LUA: &str = r"
local ttl = tonumber(ARGV[1])
if not ttl or ttl < 1 or ttl > 1000000000000 or not string.match(ARGV[1], '^[1-9]%d*$') then
  return redis.error_reply('ERR lockkit: lease of ' .. tostring(ARGV[1]) .. ' ms is out of range')
end
local t = redis.call('type', KEYS[1]).ok
if t == 'none' then
  redis.call('zrem', KEYS[3], ARGV[2])
  local others_queued = false
  if ARGV[8] == '1' then
    redis.pcall('zrem', KEYS[4], ARGV[7])
    local queued = redis.pcall('zcard', KEYS[4])
    others_queued = type(queued) == 'number' and queued > 0
    if others_queued then
      redis.call('publish', KEYS[5], '-' .. ARGV[7])
      redis.call('publish', KEYS[5], '-5' .. string.format('%018d', ttl))
    end
  end
  local now = redis.call('time')
  local floor = now[1] .. string.format('%06d', tonumber(now[2]))
  local proposed = ARGV[6]
  if proposed and #proposed <= 16 and string.match(proposed, '^[1-9]%d*$') then
    local p = tonumber(proposed)
    if p > tonumber(floor) and p <= tonumber(floor) + 20000 then
      floor = proposed
    end
  end
  local token, token_text = tonumber(floor), floor
  local before = redis.pcall('set', KEYS[2], floor, 'KEEPTTL', 'GET')
  local exact = before == false or before == '0' or (type(before) == 'string'
    and string.match(before, '^[1-9]%d*$') ~= nil
    and (#before < 16 or (#before == 16 and before <= '9007199254740990')))
  if not exact then
    if type(before) == 'string' then redis.call('set', KEYS[2], before, 'KEEPTTL') end
    local counted = redis.call('incr', KEYS[2])
    if counted < token then
      redis.call('set', KEYS[2], floor)
    else
      token, token_text = counted, string.format('%.0f', counted)
    end
  elseif before and tonumber(before) >= token then
    token = tonumber(before) + 1
    token_text = string.format('%.0f', token)
    redis.call('set', KEYS[2], token_text, 'KEEPTTL')
  end
  local fields = {'hset', KEYS[1], ARGV[2], '1', 'lockkit-token', 't' .. token_text}
  if others_queued then
    fields[#fields + 1] = 'lockkit-queue'
    fields[#fields + 1] = 'q'
  end
  if ARGV[3] ~= '' then
    fields[#fields + 1] = ARGV[3]
    fields[#fields + 1] = '1'
  end
  if ARGV[4] and ARGV[4] ~= '' then
    fields[#fields + 1] = 'lockkit-holder'
    fields[#fields + 1] = ARGV[4]
  end
  redis.call(unpack(fields))
  redis.call('pexpire', KEYS[1], ARGV[1])
  return {1, token, 1}
end
if t == 'hash' and redis.call('hexists', KEYS[1], 'mode') == 1 then
  if redis.call('hexists', KEYS[1], ARGV[2]) == 1 or redis.call('hexists', KEYS[1], ARGV[2] .. ':write') == 1 then
    return {-1, 2, 0}
  end
  local marker = tonumber(ARGV[5]) or 0
  if marker > 0 then
    local now = redis.call('time')
    redis.call('zadd', KEYS[3], tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000) + marker, ARGV[2])
    if redis.call('pttl', KEYS[3]) < marker then redis.call('pexpire', KEYS[3], marker) end
    return {0, redis.call('pttl', KEYS[1]), 2}
  end
  return {0, redis.call('pttl', KEYS[1]), 0}
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
  redis.call('zrem', KEYS[3], ARGV[2])
  if ARGV[8] == '1' then redis.pcall('zrem', KEYS[4], ARGV[7]) end
  local token = tonumber(redis.call('get', KEYS[2]) or '0') or 0
  local own = tonumber(string.sub(redis.call('hget', KEYS[1], 'lockkit-token') or '', 2)) or 0
  if own > token then
    redis.call('set', KEYS[2], string.format('%.0f', own))
    token = own
  end
  return {1, token, depth}
end
if t == 'hash' then
  if ARGV[7] and ARGV[7] ~= '' then
    local now = redis.call('time')
    local score = now[1] .. string.format('%06d', tonumber(now[2]))
    local kept = ARGV[9]
    if kept and #kept <= 16 and string.match(kept, '^[1-9]%d*$') and tonumber(kept) < tonumber(score) then
      score = kept
    end
    local queued = redis.pcall('zadd', KEYS[4], 'NX', score, ARGV[7])
    if type(queued) == 'number' then
      redis.call('pexpire', KEYS[4], 60000)
      redis.call('hset', KEYS[1], 'lockkit-queue', 'q')
      if queued == 0 then score = redis.call('zscore', KEYS[4], ARGV[7]) end
      return {0, redis.call('pttl', KEYS[1]), 0, tonumber(score)}
    end
  end
  return {0, redis.call('pttl', KEYS[1]), 0}
end
return {0, redis.call('pttl', KEYS[1]), 1}
";

/// KEYS: lock. ARGV: ttl ms, owner field. Returns 1 if renewed, 0 if not ours (also when
/// the hash is a read-write lock, where the owner's field is a read count, not a mutex
/// hold). The lease becomes the longer of what is left and `ttl`: a renewal never shortens
/// it.
pub(crate) static RENEW: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
local found = redis.pcall('hmget', KEYS[1], ARGV[2], 'mode')
if found.err or not found[1] or found[2] then
  return 0
end
if redis.call('pttl', KEYS[1]) < tonumber(ARGV[1]) then
  redis.call('pexpire', KEYS[1], ARGV[1])
end
return 1
",
    )
});

/// KEYS: lock, channel, waiter queue ([`queue_of`]). ARGV: owner field, the grant's attempt
/// field (`''`: release one hold whatever acquired it). Returns -1 if not ours (also on a read-write lock's hash: a stale
/// mutex grant must never take the owner's read count, nor delete other readers' hash),
/// else the holds left (0: released and
/// published). A partial release leaves the lease as it is. With an attempt field, only a
/// hold that attempt added is given back, once: a retried release, or a give-back on a
/// master whose vote failed, changes nothing and reports the holds left.
///
/// The last hold's release of a hold flagged [`QUEUE_FIELD`] pops the queue's earliest
/// waiter and publishes its id on the channel right before the `0` (one script: the two are
/// adjacent on every subscriber connection).
///
/// One `HMGET` reads the owner's count, the read-write `mode`, the attempt's field and the
/// queue flag (a key
/// of another type answers it with an error, caught: not ours; the server still counts it
/// in `errorstat_WRONGTYPE`); the last hold deletes the hash without counting down first.
/// A count that is not an integer (as `HINCRBY` reads it) is an error, and changes nothing. Each `redis.call` costs the server about as much as a
/// command of its own, and this is half of every uncontended pair.
pub(crate) static RELEASE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
local found = redis.pcall('hmget', KEYS[1], ARGV[1], 'mode', ARGV[2], 'lockkit-queue')
if found.err or not found[1] or found[2] then
  return -1
end
if not string.find(found[1], '^%-?%d+$') then
  return redis.error_reply('ERR lockkit: the hold count of ' .. ARGV[1] .. ' is not an integer')
end
local count = tonumber(found[1])
if ARGV[2] ~= '' and not found[3] then
  return count
end
if count > 1 then
  if ARGV[2] ~= '' then redis.call('hdel', KEYS[1], ARGV[2]) end
  return redis.call('hincrby', KEYS[1], ARGV[1], -1)
end
redis.call('del', KEYS[1])
if found[4] then
  local next = redis.pcall('zpopmin', KEYS[3])
  if type(next) == 'table' and next[1] then redis.call('publish', KEYS[2], next[1]) end
end
redis.call('publish', KEYS[2], '0')
return 0
",
    )
});

/// KEYS: lock, token. Returns `{type, pttl, token, field1, count1, ...}`.
pub(crate) static INSPECT: LazyLock<Script> = LazyLock::new(|| {
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

/// KEYS: token. ARGV: a token value. Raises the counter to at least `ARGV[1]` (Redlock's
/// write-back of the highest token seen). Returns the counter.
pub(crate) static RAISE_TOKEN: LazyLock<Script> = LazyLock::new(|| {
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

#[cfg(test)]
mod tests {
    use super::*;

    fn names(key: &str, cluster: bool) -> Result<LockNames> {
        LockNames::new("", &LockKey::new(key).unwrap(), cluster)
    }

    fn names_in(key: &str) -> LockNames {
        LockNames::new("p/", &LockKey::new(key).unwrap(), true).unwrap()
    }

    #[test]
    fn the_acquire_script_bounds_a_proposal_as_documented() {
        let micros = PROPOSAL_AHEAD_AT_MOST.as_micros();
        assert!(ACQUIRE_LUA.contains(&format!("p <= tonumber(floor) + {micros} then")));
    }

    #[test]
    fn the_acquire_script_publishes_the_taken_lease_above_its_base() {
        assert_eq!(TAKEN_LEASE_BASE, 5 * 10u64.pow(18));
        // `-5` then the lease in 18 digits: `-(TAKEN_LEASE_BASE + ttl)`.
        assert!(ACQUIRE_LUA.contains("'-5' .. string.format('%018d', ttl)"));
        // Every lease message is an i64, below every negated id.
        const { assert!(TAKEN_LEASE_BASE + MAX_TTL_MS < i64::MAX as u64) };
        const { assert!(TAKEN_LEASE_BASE > 2 * NAMED_WAITER_MIN) };
    }

    #[test]
    fn the_scripts_name_the_holder_field() {
        assert!(ACQUIRE_LUA.contains(&format!("'{HOLDER_FIELD}'")));
        assert_eq!(ACQUIRE_LUA.matches(&format!("'{TOKEN_FIELD}'")).count(), 2);
    }

    #[test]
    fn the_scripts_name_the_queue_field_and_life() {
        assert!(ACQUIRE_LUA.contains(&format!("'{QUEUE_FIELD}'")));
        assert!(ACQUIRE_LUA.contains(&format!("pexpire', KEYS[4], {QUEUE_LIFE_MS})")));
        let names = names("orders/42", false).unwrap();
        assert_eq!(queue_of(&names), "{orders/42}:lockkit_queue");
        let names = names_in("a{b}c");
        assert_eq!(hash_tag(&queue_of(&names)), hash_tag(&names.lock));
    }

    #[test]
    fn redisson_layout() {
        let n = names("orders/42", false).unwrap();
        assert_eq!(n.lock, "orders/42");
        assert_eq!(n.channel, "redisson_lock__channel:{orders/42}");
        assert_eq!(n.token, "redisson_lock_token:{orders/42}");
        let n = names("a{b}c", true).unwrap();
        assert_eq!(n.channel, "redisson_lock__channel:a{b}c");
        assert_eq!(hash_tag(&n.channel), hash_tag(&n.lock));
    }

    #[test]
    fn cluster_refuses_braces_without_a_tag() {
        assert!(names("a{", true).is_err());
        assert!(names("a{}b", true).is_err());
        assert!(
            names("a}b", true).is_err(),
            "a `}}` alone moves the counter's slot"
        );
        assert!(names("a}b", false).is_ok());
        assert!(names("a{", false).is_ok());
    }
}
