//! Who took a hold: host, process, program, when, and with which lockkit. Backends store it
//! beside each hold (a side key, a node's data, a column) so that an operator asking "who
//! holds this key?" gets a process to look at, not an opaque owner id.

use std::{
    fmt::Write as _,
    sync::OnceLock,
    time::{Duration, SystemTime, UNIX_EPOCH},
};

/// The longest host or program name stored; longer ones are cut (at a character
/// boundary), so a record always fits the backends' columns and values.
pub const MAX_NAME_BYTES: usize = 255;

/// The process that took a hold, as stored beside it.
///
/// Backends write it when a hold is first granted (a re-entry keeps the first one) and
/// [`crate::Locker::inspect`] reads it back in [`crate::HolderInfo::identity`]. Stored as
/// one line of compact JSON (see [`HolderIdentity::encode`]) so other tools can read it:
/// `{"host":"web-3","pid":4242,"program":"report","requested_at_ms":1764000000000,"lockkit":"0.1.0"}`.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct HolderIdentity {
    /// The holder's host name.
    pub host: String,
    /// The holder's process id on that host.
    pub pid: u32,
    /// The holder's program (the executable's file name).
    pub program: String,
    /// When the holder asked for the lock, by its wall clock (for people, never for lease
    /// arithmetic). A wait is included: ZooKeeper and etcd store a contender's record when
    /// it joins the queue, and the other backends store what the request carried, so this
    /// is when the holder started to want the lock, at most its wait before the grant.
    pub requested_at: SystemTime,
    /// The lockkit version that took it.
    pub version: String,
}

/// The parts of an identity that do not change during a process's life.
#[derive(Debug)]
struct ThisProcess {
    host: String,
    program: String,
    /// Read once: `getpid` is a system call on every call, and this is read per acquire.
    /// A child forked without `exec` (which Tokio does not support anyway) would report
    /// its parent's.
    pid: u32,
}

fn this_process() -> &'static ThisProcess {
    static THIS: OnceLock<ThisProcess> = OnceLock::new();
    THIS.get_or_init(|| ThisProcess {
        host: cut(&host_name()),
        program: cut(&program_name()),
        pid: std::process::id(),
    })
}

fn host_name() -> String {
    let name = rustix::system::uname();
    let name = name.nodename().to_string_lossy().into_owned();
    if name.is_empty() {
        "unknown-host".to_owned()
    } else {
        name
    }
}

fn program_name() -> String {
    std::env::current_exe()
        .ok()
        .and_then(|exe| exe.file_name().map(|n| n.to_string_lossy().into_owned()))
        .or_else(|| {
            std::env::args_os().next().and_then(|arg| {
                std::path::Path::new(&arg)
                    .file_name()
                    .map(|n| n.to_string_lossy().into_owned())
            })
        })
        .unwrap_or_else(|| "unknown-program".to_owned())
}

/// The longest [`HolderIdentity::encode`] can be: two names of [`MAX_NAME_BYTES`], each
/// character escaped at worst to 6 bytes (`\u001f`) per byte, with the rest of the record.
pub const MAX_ENCODED_BYTES: usize = 2 * 6 * MAX_NAME_BYTES + 6 * MAX_NAME_BYTES / 8 + 128;

/// Appends `text` as a JSON string in ASCII: quotes, backslashes, control and non-ASCII
/// characters escaped (`\uXXXX`, surrogate pairs above the BMP).
fn push_json_string(out: &mut String, text: &str) {
    out.push('"');
    for c in text.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            ' '..='~' => out.push(c),
            _ => {
                let mut units = [0u16; 2];
                for unit in c.encode_utf16(&mut units) {
                    out.push_str(&format!("\\u{unit:04x}"));
                }
            }
        }
    }
    out.push('"');
}

/// A value of a flat JSON object, as [`parse_flat_json`] reads it.
#[derive(Debug, PartialEq)]
enum Flat {
    Text(String),
    Number(u64),
    Other,
}

/// Reads a flat JSON object (string, unsigned integer, `true`/`false`/`null` values; no
/// nesting) into its fields, or `None` for anything else. Enough for identity records,
/// without a JSON library in the core crate.
fn parse_flat_json(text: &str) -> Option<Vec<(String, Flat)>> {
    let mut chars = text.trim().chars().peekable();
    let skip_space = |chars: &mut std::iter::Peekable<std::str::Chars<'_>>| {
        while chars.peek().is_some_and(|c| c.is_ascii_whitespace()) {
            chars.next();
        }
    };
    // UTF-16 units, so escaped surrogate pairs join and lone surrogates are refused.
    let read_string = |chars: &mut std::iter::Peekable<std::str::Chars<'_>>| -> Option<String> {
        if chars.next()? != '"' {
            return None;
        }
        let mut units: Vec<u16> = Vec::new();
        let mut buffer = [0u16; 2];
        loop {
            let c = match chars.next()? {
                '"' => break,
                '\\' => match chars.next()? {
                    'u' => {
                        let hex: String = (0..4).map(|_| chars.next()).collect::<Option<_>>()?;
                        units.push(u16::from_str_radix(&hex, 16).ok()?);
                        continue;
                    }
                    '"' => '"',
                    '\\' => '\\',
                    '/' => '/',
                    'b' => '\u{8}',
                    'f' => '\u{c}',
                    'n' => '\n',
                    'r' => '\r',
                    't' => '\t',
                    _ => return None,
                },
                c if u32::from(c) < 0x20 => return None,
                c => c,
            };
            units.extend_from_slice(c.encode_utf16(&mut buffer));
        }
        String::from_utf16(&units).ok()
    };
    skip_space(&mut chars);
    if chars.next()? != '{' {
        return None;
    }
    let mut fields = Vec::new();
    skip_space(&mut chars);
    if chars.peek() == Some(&'}') {
        chars.next();
    } else {
        loop {
            skip_space(&mut chars);
            let name = read_string(&mut chars)?;
            skip_space(&mut chars);
            if chars.next()? != ':' {
                return None;
            }
            skip_space(&mut chars);
            let value = match chars.peek()? {
                '"' => Flat::Text(read_string(&mut chars)?),
                '0'..='9' => {
                    let mut digits = String::new();
                    while let Some(d) = chars.peek().copied().filter(char::is_ascii_digit) {
                        digits.push(d);
                        chars.next();
                    }
                    Flat::Number(digits.parse().ok()?)
                }
                't' | 'f' | 'n' => {
                    let word: String = std::iter::from_fn(|| {
                        chars
                            .peek()
                            .copied()
                            .filter(char::is_ascii_alphabetic)
                            .inspect(|_| {
                                chars.next();
                            })
                    })
                    .collect();
                    if !matches!(word.as_str(), "true" | "false" | "null") {
                        return None;
                    }
                    Flat::Other
                }
                _ => return None,
            };
            fields.push((name, value));
            skip_space(&mut chars);
            match chars.next()? {
                ',' => continue,
                '}' => break,
                _ => return None,
            }
        }
    }
    skip_space(&mut chars);
    chars.next().is_none().then_some(fields)
}

/// The text field `name` of `fields`.
fn text_field<'a>(fields: &'a [(String, Flat)], name: &str) -> Option<&'a str> {
    fields.iter().find_map(|(n, v)| match v {
        Flat::Text(t) if n == name => Some(t.as_str()),
        _ => None,
    })
}

/// The number field `name` of `fields`.
fn number_field(fields: &[(String, Flat)], name: &str) -> Option<u64> {
    fields.iter().find_map(|(n, v)| match v {
        Flat::Number(x) if n == name => Some(*x),
        _ => None,
    })
}

/// `text` cut to at most [`MAX_NAME_BYTES`] bytes at a character boundary.
fn cut(text: &str) -> String {
    cut_str(text).to_owned()
}

/// `text` cut to at most [`MAX_NAME_BYTES`] bytes, at a character boundary.
fn cut_str(text: &str) -> &str {
    if text.len() <= MAX_NAME_BYTES {
        return text;
    }
    let mut end = MAX_NAME_BYTES;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}

impl HolderIdentity {
    /// This process, acquiring now.
    pub fn now() -> Self {
        let this = this_process();
        HolderIdentity {
            host: this.host.clone(),
            pid: this.pid,
            program: this.program.clone(),
            requested_at: SystemTime::now(),
            version: env!("CARGO_PKG_VERSION").to_owned(),
        }
    }

    /// Describes a holder (for tools that store identities of their own).
    pub fn new(host: &str, pid: u32, program: &str, requested_at: SystemTime) -> Self {
        HolderIdentity {
            host: cut(host),
            pid,
            program: cut(program),
            requested_at,
            version: env!("CARGO_PKG_VERSION").to_owned(),
        }
    }

    /// Milliseconds since the Unix epoch of [`HolderIdentity::requested_at`] (0 before it).
    pub fn requested_at_ms(&self) -> u64 {
        self.requested_at
            .duration_since(UNIX_EPOCH)
            .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
            .unwrap_or(0)
    }

    /// One line of compact JSON in ASCII (every other character escaped as `\uXXXX`, so a
    /// column or value of any character set takes it), at most [`MAX_ENCODED_BYTES`]: what
    /// backends store.
    pub fn encode(&self) -> String {
        self.encode_with_owner(None)
    }

    fn encode_with_owner(&self, owner: Option<&str>) -> String {
        let mut out = String::with_capacity(160);
        out.push_str("{\"host\":");
        push_json_string(&mut out, &self.host);
        // `write!` into the string itself: this runs on every acquisition.
        let _ = write!(out, ",\"pid\":{},\"program\":", self.pid);
        push_json_string(&mut out, &self.program);
        let _ = write!(
            out,
            ",\"requested_at_ms\":{},\"lockkit\":",
            self.requested_at_ms()
        );
        push_json_string(&mut out, cut_str(&self.version));
        if let Some(owner) = owner {
            out.push_str(",\"owner\":");
            push_json_string(&mut out, cut_str(owner));
        }
        out.push('}');
        out
    }

    /// [`HolderIdentity::encode`] with the owner it belongs to, for a store where a client
    /// that knows nothing of identities (an older lockkit) may take the hold over without
    /// clearing it: [`HolderIdentity::decode_for`] then refuses the stale identity.
    pub fn encode_for(&self, owner: &str) -> String {
        self.encode_with_owner(Some(owner))
    }

    /// Reads what [`HolderIdentity::encode_for`] wrote, only if it was written for `owner`
    /// (a record without an owner is accepted).
    pub fn decode_for(stored: &str, owner: &str) -> Option<Self> {
        let fields = parse_flat_json(stored)?;
        match fields.iter().find(|(name, _)| name == "owner") {
            Some((_, written_for)) if *written_for != Flat::Text(owner.to_owned()) => None,
            _ => Self::from_fields(&fields),
        }
    }

    /// Reads what [`HolderIdentity::encode`] wrote. Anything else (another client's data,
    /// such as the IP address Curator writes into its lock nodes, or an empty value) is
    /// `None`: the holder is then simply not identified.
    pub fn decode(stored: &str) -> Option<Self> {
        Self::from_fields(&parse_flat_json(stored)?)
    }

    fn from_fields(fields: &[(String, Flat)]) -> Option<Self> {
        let host = text_field(fields, "host")?;
        let pid = u32::try_from(number_field(fields, "pid")?).ok()?;
        let program = text_field(fields, "program")?;
        let at = number_field(fields, "requested_at_ms")?;
        let version = text_field(fields, "lockkit").unwrap_or("");
        Some(HolderIdentity {
            host: cut(host),
            pid,
            program: cut(program),
            requested_at: UNIX_EPOCH + Duration::from_millis(at),
            version: cut(version),
        })
    }

    /// [`HolderIdentity::decode`] of raw bytes (a ZooKeeper node's data, an etcd value).
    pub fn decode_bytes(stored: &[u8]) -> Option<Self> {
        std::str::from_utf8(stored).ok().and_then(Self::decode)
    }
}

/// The value a contender node or key carries (ZooKeeper, etcd): the owner on the first line,
/// followed after a space by the hold count when above one, and the holder's identity
/// ([`HolderIdentity::encode`]) on the second line.
pub fn contender_record(owner: &str, depth: u32, identity: &str) -> String {
    if depth > 1 {
        format!("{owner} {depth}\n{identity}")
    } else {
        format!("{owner}\n{identity}")
    }
}

/// Reads a [`contender_record`]: owner, depth and identity. What another client wrote
/// (Curator's IP address, kazoo's identifier, nothing at all) is reported as the owner, with
/// depth 1 and no identity; an empty value as `another client's <name>`.
pub fn parse_contender_record(data: &[u8], name: &str) -> (String, u32, Option<HolderIdentity>) {
    let text = String::from_utf8_lossy(data);
    let (first, rest) = text.split_once('\n').unwrap_or((&text, ""));
    let identity = HolderIdentity::decode(rest);
    let (owner, depth) = match first.split_once(' ') {
        Some((owner, depth)) if depth.parse::<u32>().is_ok() => {
            (owner.to_owned(), depth.parse().unwrap_or(1))
        }
        _ if first.is_empty() => (format!("another client's {name}"), 1),
        _ => (first.to_owned(), 1),
    };
    (owner, depth, identity)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn contender_records_round_trip_and_foreign_data_is_an_owner() {
        let identity = HolderIdentity::now();
        let record = contender_record("u:1", 3, &identity.encode());
        let (owner, depth, back) = parse_contender_record(record.as_bytes(), "n");
        assert_eq!((owner.as_str(), depth), ("u:1", 3));
        assert_eq!(back.map(|b| b.pid), Some(identity.pid));
        let record = contender_record("u:1", 1, &identity.encode());
        assert_eq!(parse_contender_record(record.as_bytes(), "n").1, 1);
        // Records written before identities were stored.
        assert_eq!(
            parse_contender_record(b"u:1 2", "n"),
            ("u:1".into(), 2, None)
        );
        assert_eq!(parse_contender_record(b"u:1", "n"), ("u:1".into(), 1, None));
        let (owner, _, back) = parse_contender_record(b"10.0.0.7", "n");
        assert_eq!((owner.as_str(), back), ("10.0.0.7", None));
        assert_eq!(
            parse_contender_record(b"", "node n").0,
            "another client's node n"
        );
    }

    #[test]
    fn an_identity_round_trips_to_the_millisecond() {
        let identity = HolderIdentity::now();
        assert_eq!(identity.pid, std::process::id());
        assert!(!identity.host.is_empty());
        let back = HolderIdentity::decode(&identity.encode()).unwrap();
        assert_eq!(back.host, identity.host);
        assert_eq!(back.program, identity.program);
        assert_eq!(back.requested_at_ms(), identity.requested_at_ms());
        assert_eq!(back.version, env!("CARGO_PKG_VERSION"));
    }

    #[test]
    fn names_with_quotes_and_long_names_survive() {
        let long = "é".repeat(400);
        let identity = HolderIdentity::new("h\"o\nst", 7, &long, UNIX_EPOCH);
        assert!(identity.program.len() <= MAX_NAME_BYTES);
        let encoded = identity.encode();
        assert!(!encoded.contains('\n'), "one line: {encoded}");
        assert!(encoded.is_ascii(), "ASCII: {encoded}");
        assert_eq!(HolderIdentity::decode(&encoded), Some(identity));
    }

    #[test]
    fn the_worst_names_stay_within_the_bound() {
        let controls = "\u{1}".repeat(MAX_NAME_BYTES);
        let emoji = "🔒".repeat(MAX_NAME_BYTES);
        for (host, program) in [
            (&controls, &emoji),
            (&emoji, &controls),
            (&controls, &controls),
        ] {
            let identity = HolderIdentity::new(host, u32::MAX, program, UNIX_EPOCH);
            let encoded = identity.encode();
            assert!(encoded.is_ascii());
            assert!(encoded.len() <= MAX_ENCODED_BYTES, "{}", encoded.len());
            assert_eq!(HolderIdentity::decode(&encoded), Some(identity));
        }
    }

    #[test]
    fn an_identity_written_for_another_owner_is_refused() {
        let identity = HolderIdentity::now();
        let record = identity.encode_for("a:1");
        assert!(record.is_ascii());
        assert_eq!(
            HolderIdentity::decode_for(&record, "a:1").map(|i| i.pid),
            Some(identity.pid)
        );
        assert_eq!(HolderIdentity::decode_for(&record, "b:1"), None);
        assert!(HolderIdentity::decode_for(&identity.encode(), "b:1").is_some());
        assert!(HolderIdentity::decode(&record).is_some());
    }

    #[test]
    fn the_reader_takes_escapes_spaces_and_unknown_fields() {
        let stored = " { \"host\" : \"h\\u00e9\\ud83d\\udd12\\n\\\"\", \"pid\":7, \"x\":null, \"program\":\"p\\/q\",\"requested_at_ms\":5, \"y\": true} ";
        let identity = HolderIdentity::decode(stored).unwrap();
        assert_eq!(identity.host, "h\u{e9}\u{1f512}\n\"");
        assert_eq!(identity.program, "p/q");
        assert_eq!((identity.pid, identity.requested_at_ms()), (7, 5));
        for broken in [
            "{\"host\":\"\\ud83d\",\"pid\":1,\"program\":\"p\",\"requested_at_ms\":1}",
            "{\"host\":\"h\",\"pid\":-1,\"program\":\"p\",\"requested_at_ms\":1}",
            "{\"host\":\"h\",\"pid\":1,\"program\":\"p\",\"requested_at_ms\":1} trailing",
            "{\"host\":{\"a\":1},\"pid\":1,\"program\":\"p\",\"requested_at_ms\":1}",
            "{\"host\":\"h\",\"pid\":1,\"program\":\"p\",\"requested_at_ms\":1",
        ] {
            assert_eq!(HolderIdentity::decode(broken), None, "{broken}");
        }
    }

    #[test]
    fn foreign_data_is_not_an_identity() {
        for foreign in ["", "127.0.0.1", "{}", "{\"host\":1}", "\u{0}"] {
            assert_eq!(HolderIdentity::decode(foreign), None, "{foreign:?}");
        }
        assert_eq!(HolderIdentity::decode_bytes(&[0xff, 0xfe]), None);
    }
}
