//! How every backend reads its URL: [`LockUrl`] cuts it into scheme, user, hosts, path and
//! options (one parser, with strict form decoding, for single- and multi-host URLs alike), and the option values are read with [`parse_duration`] and [`parse_count`].
//! `?ttl=` is read by every backend and means the same everywhere: the default lease.

use std::time::Duration;

use crate::{Error, Result};

/// Decodes one option name or value as a form does (`+` is a space, `%XX` a byte),
/// strictly: a bad escape or bytes that are not UTF-8 are refused rather than guessed at, so
/// two different prefixes can never decode to one.
fn decode_option(text: &str, shown: &str) -> Result<String> {
    let bad = |what: &str| Error::Config(format!("{what} in `{text}` of `{shown}`"));
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'%' => {
                let byte = text
                    .get(i + 1..i + 3)
                    .and_then(|hex| u8::from_str_radix(hex, 16).ok())
                    .ok_or_else(|| bad("a bad percent escape (write %XX with two hex digits)"))?;
                out.push(byte);
                i += 3;
            }
            b'+' => {
                out.push(b' ');
                i += 1;
            }
            b => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8(out).map_err(|_| bad("escapes that are not UTF-8"))
}

/// One `name=value` option of a URL.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UrlOption {
    /// The name, decoded.
    pub name: String,
    /// The value, decoded (`%3A` is `:`, `+` is a space).
    pub value: String,
    /// The pair as written, for options passed on to a driver.
    pub raw: String,
}

impl UrlOption {
    /// The value as written, not decoded (for options read verbatim before decoding
    /// existed, such as ZooKeeper's `root`).
    pub fn raw_value(&self) -> &str {
        self.raw.split_once('=').map_or("", |(_, value)| value)
    }
}

/// A lock service URL, `scheme://[userinfo@]host[:port][,host[:port]...][/path][?options]`,
/// cut into its parts without assuming one host (which `url::Url` does).
#[derive(Debug, Clone)]
pub struct LockUrl {
    /// The scheme, e.g. `redis+cluster`.
    pub scheme: String,
    /// Everything between `://` and `?`, as written (credentials included: never show it).
    pub base: String,
    /// `user[:password]` before the last `@` of [`LockUrl::base`], as written.
    pub userinfo: Option<String>,
    /// The hosts, as written (`h:p`), in order; never empty strings.
    pub hosts: Vec<String>,
    /// What follows the first `/` after the hosts (`None`: no `/` at all).
    pub path: Option<String>,
    /// The options, in order.
    pub options: Vec<UrlOption>,
    /// The URL with its password hidden, for messages.
    pub shown: String,
}

impl LockUrl {
    /// Cuts `url` into its parts, if its scheme is one of `schemes`; `form` is the accepted
    /// shape, quoted in the error.
    ///
    /// # Errors
    /// [`Error::Config`] for another scheme, no `://`, or an empty host.
    pub fn parse(url: &str, schemes: &[&str], form: &str) -> Result<Self> {
        let shown = redact_url(url);
        let Some((scheme, rest)) = url
            .split_once("://")
            .filter(|(scheme, _)| schemes.contains(scheme))
        else {
            return Err(Error::Config(format!(
                "`{shown}` is not a URL of this kind; write {form}"
            )));
        };
        let (base, query) = rest.split_once('?').unwrap_or((rest, ""));
        // RFC 3986: the authority ends at the first `/` (a `/` in a password must be
        // written `%2F`), and the user part at the authority's last `@`.
        let (authority, path) = match base.split_once('/') {
            Some((authority, path)) => (authority, Some(path.to_owned())),
            None => (base, None),
        };
        // A fragment names no part of a lock URL: dropped, it would change what the URL
        // means without a word (`?mode=row#x` read as `row`); kept, it would be read into a
        // database name or an option's value. A `#` in a value is written `%23`. (In the
        // user part, where passwords often carry a bare `#`, it is left as it is.)
        if path.as_deref().is_some_and(|path| path.contains('#')) || query.contains('#') {
            return Err(Error::Config(format!(
                "`{shown}` has a fragment (`#...`), which no lock URL takes: write a `#` in \
                 a name or value as %23"
            )));
        }
        let (userinfo, hosts) = match authority.rsplit_once('@') {
            Some((user, hosts)) => (Some(user.to_owned()), hosts),
            None => (None, authority),
        };
        let hosts: Vec<String> = if hosts.is_empty() {
            Vec::new()
        } else {
            hosts.split(',').map(str::to_owned).collect()
        };
        if hosts.iter().any(String::is_empty) {
            return Err(Error::Config(format!(
                "`{shown}` names an empty host; write {form}"
            )));
        }
        let mut options = Vec::new();
        for raw in query.split('&').filter(|pair| !pair.is_empty()) {
            let (name, value) = raw.split_once('=').unwrap_or((raw, ""));
            options.push(UrlOption {
                name: decode_option(name, &shown)?,
                value: decode_option(value, &shown)?,
                raw: raw.to_owned(),
            });
        }
        Ok(LockUrl {
            scheme: scheme.to_owned(),
            base: base.to_owned(),
            userinfo,
            hosts,
            path,
            options,
            shown,
        })
    }

    /// Refuses a URL that names no host (`redis:///0`); `form` is the accepted shape.
    ///
    /// # Errors
    /// [`Error::Config`] when [`LockUrl::hosts`] is empty.
    pub fn require_hosts(&self, form: &str) -> Result<()> {
        if self.hosts.is_empty() {
            return Err(Error::Config(format!(
                "`{}` names no host; write {form}",
                self.shown
            )));
        }
        Ok(())
    }

    /// The error for an option none of `known` names.
    pub fn unknown_option(&self, option: &UrlOption, known: &str) -> Error {
        Error::Config(format!(
            "unknown option `{}` in `{}`; known: {known}",
            option.name, self.shown
        ))
    }
}

/// Checks that the options of a URL that takes no other (`memory://`, `file://`) are only
/// a valid `ttl`.
///
/// # Errors
/// [`Error::Config`] naming the option that is not `ttl`, or a `ttl` that is not a duration.
pub fn only_ttl_option(url: &str, query: &str) -> Result<()> {
    let shown = redact_url(url);
    for raw in query.split('&').filter(|pair| !pair.is_empty()) {
        let (name, value) = raw.split_once('=').unwrap_or((raw, ""));
        let (name, value) = (decode_option(name, &shown)?, decode_option(value, &shown)?);
        if name != "ttl" {
            return Err(Error::Config(format!(
                "unknown option `{name}` in `{}`; this backend takes only `ttl`",
                redact_url(url)
            )));
        }
        parse_duration("ttl", &value)?;
    }
    Ok(())
}

/// The `?ttl=` of `url`, whatever its scheme: the default lease of locks taken through it.
///
/// # Errors
/// [`Error::Config`] when `ttl` is not a duration.
pub fn url_ttl(url: &str) -> Result<Option<Duration>> {
    let Some((_, query)) = url.split_once('?') else {
        return Ok(None);
    };
    let shown = redact_url(url);
    let mut ttl = None;
    for raw in query.split('&').filter(|pair| !pair.is_empty()) {
        let (name, value) = raw.split_once('=').unwrap_or((raw, ""));
        if decode_option(name, &shown)? == "ttl" {
            ttl = Some(parse_duration("ttl", &decode_option(value, &shown)?)?);
        }
    }
    Ok(ttl)
}

/// Parses a duration such as `250ms`, `30s`, `2m`, `1h` or `1.5s`.
///
/// # Errors
/// [`Error::Config`] naming the option and the accepted forms.
pub fn parse_duration(option: &str, text: &str) -> Result<Duration> {
    let bad = || {
        Error::Config(format!(
            "`{option}={text}` is not a duration; write it with a unit, e.g. `250ms`, `30s`, `2m`"
        ))
    };
    let text = text.trim();
    let split = text
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .ok_or_else(bad)?;
    let (number, unit) = text.split_at(split);
    let number: f64 = number.parse().map_err(|_| bad())?;
    let seconds = match unit {
        "ms" => number / 1000.0,
        "s" => number,
        "m" => number * 60.0,
        "h" => number * 3600.0,
        _ => return Err(bad()),
    };
    Duration::try_from_secs_f64(seconds).map_err(|_| bad())
}

/// Parses a count such as `3`.
///
/// # Errors
/// [`Error::Config`] naming the option.
pub fn parse_count(option: &str, text: &str) -> Result<u32> {
    text.trim().parse().map_err(|_| {
        Error::Config(format!(
            "`{option}={text}` is not a whole number; give a count such as `1`"
        ))
    })
}

/// `text` with the password of every URL in it replaced by `***`
/// (`redis://user:secret@h:1,redis://:pw@h:2` becomes `redis://user:***@h:1,redis://:***@h:2`),
/// for errors, logs and `Debug` output: credentials never leave through them.
///
/// It errs on the side of hiding: a password with `/`, `?`, `#` or `@` in it is hidden whole, and a
/// malformed URL (`redis:/u:pw@h`, `mysql//u:pw@h`) loses everything between its first `:`
/// and its last `@`.
pub fn redact_url(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut word = String::new();
    for c in text.chars() {
        if c.is_whitespace() {
            out.push_str(&redact_word(&word));
            word.clear();
            out.push(c);
        } else {
            word.push(c);
        }
    }
    out.push_str(&redact_word(&word));
    out
}

/// [`redact_url`] of one whitespace-free word.
fn redact_word(word: &str) -> String {
    if !word.contains("://") {
        // Not a well-formed URL; hide whatever could be `user:password@`.
        let word = match (word.find(':'), word.rfind('@')) {
            (Some(colon), Some(at)) if colon < at => {
                format!("{}:***{}", &word[..colon], &word[at..])
            }
            _ => word.to_owned(),
        };
        return redact_query_secrets(&word);
    }
    let mut out = String::with_capacity(word.len());
    let mut rest = word;
    while let Some(at) = rest.find("://") {
        let (head, tail) = rest.split_at(at + 3);
        out.push_str(head);
        // This URL runs to the next URL of a list, or to the end of the word; its user part
        // to its last `@`, wherever that is: a malformed password may hold `/`, `?` or `#`
        // (hiding a path or query with an `@` in it too is the price).
        let mut end = tail.len();
        if let Some(next) = tail.find("://") {
            end = tail[..next].rfind(',').unwrap_or(next);
        }
        let authority = &tail[..end];
        match authority.rfind('@') {
            Some(user_end) => {
                let userinfo = &authority[..user_end];
                match userinfo.find(':') {
                    Some(colon) => {
                        out.push_str(&userinfo[..colon]);
                        out.push_str(":***");
                    }
                    None => out.push_str(userinfo),
                }
                out.push_str(&authority[user_end..]);
            }
            None => out.push_str(authority),
        }
        rest = &tail[end..];
    }
    out.push_str(rest);
    redact_query_secrets(&out)
}

/// Query parameters that carry a secret (libpq's `?password=`, `sslpassword=`, and their
/// kin): their values become `***`.
fn redact_query_secrets(url: &str) -> String {
    const SECRET: [&str; 5] = ["password", "sslpassword", "passwd", "pwd", "pass"];
    let mut out = String::with_capacity(url.len());
    let mut rest = url;
    // Each parameter starts after a `?` or `&` and runs to the next `&` (or `,`, where the
    // next URL of a list starts; `#`; the backtick closing a quoted URL in a message) or
    // the word's end: a password holding one of those shows what follows it.
    while let Some(sep) = rest.find(['?', '&']) {
        let (head, tail) = rest.split_at(sep + 1);
        out.push_str(head);
        let end = tail.find(['&', ',', '#', '`']).unwrap_or(tail.len());
        let param = &tail[..end];
        match param.split_once('=') {
            Some((name, _)) if SECRET.iter().any(|s| name.eq_ignore_ascii_case(s)) => {
                out.push_str(name);
                out.push_str("=***");
            }
            _ => out.push_str(param),
        }
        rest = &tail[end..];
    }
    out.push_str(rest);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passwords_are_redacted() {
        assert_eq!(
            redact_url("mysql://lockkit:s3cret@127.0.0.1:3306/db?mode=row"),
            "mysql://lockkit:***@127.0.0.1:3306/db?mode=row"
        );
        assert_eq!(
            redact_url("redis://u:a@b@h:1,redis://:pw@h:2 and zk://h:3/x"),
            "redis://u:***@h:1,redis://:***@h:2 and zk://h:3/x"
        );
        assert_eq!(redact_url("redis://h:1/0"), "redis://h:1/0");
        assert_eq!(
            redact_url("postgres://u@h/db?mode=row&password=s3cret&sslmode=disable"),
            "postgres://u@h/db?mode=row&password=***&sslmode=disable"
        );
        assert_eq!(
            redact_url("postgres://h/db?PASSWORD=x,postgres://h2/db?pwd=y"),
            "postgres://h/db?PASSWORD=***,postgres://h2/db?pwd=***"
        );
        assert_eq!(
            redact_url("etcd://h:1?prefix=/a&ttl=3s and token=5"),
            "etcd://h:1?prefix=/a&ttl=3s and token=5"
        );
        assert_eq!(redact_url("`h/db?password=x`"), "`h/db?password=***`");
        assert_eq!(redact_url("redis://u:pa/ss@h:1/0"), "redis://u:***@h:1/0");
        assert_eq!(redact_url("redis://u:pa?ss@h"), "redis://u:***@h");
        assert_eq!(
            redact_url("redis://u:pa#ss@h:6379/0"),
            "redis://u:***@h:6379/0"
        );
        assert_eq!(
            redact_url("bad `redis:/u:S3CRET@h`: no"),
            "bad `redis:***@h`: no"
        );
        assert_eq!(
            redact_url("mysql//lockkit:S3CRET@h/db"),
            "mysql//lockkit:***@h/db"
        );
        assert_eq!(
            redact_url("redlock://:a@h1,:b@h2,redis://h3"),
            "redlock://:***@h2,redis://h3"
        );
        assert_eq!(redact_url("not a url"), "not a url");
    }

    #[test]
    fn urls_with_several_hosts_users_paths_and_options() {
        let url = LockUrl::parse(
            "redis+cluster://u:pa%2Fss@h1:1,h2:2/0?prefix=app%3A&ttl=5s&flag",
            &["redis+cluster"],
            "redis+cluster://h1,h2",
        )
        .unwrap();
        assert_eq!(url.userinfo.as_deref(), Some("u:pa%2Fss"));
        assert_eq!(url.hosts, ["h1:1", "h2:2"]);
        assert_eq!(url.path.as_deref(), Some("0"));
        let options: Vec<_> = url
            .options
            .iter()
            .map(|o| (o.name.as_str(), o.value.as_str()))
            .collect();
        assert_eq!(options, [("prefix", "app:"), ("ttl", "5s"), ("flag", "")]);
        assert!(!url.shown.contains("pa%2Fss"), "{}", url.shown);
        // A `@` in the path is not a user part (RFC 3986: the authority ends at `/`).
        let at_in_path = LockUrl::parse("zk://h/app@x", &["zk"], "zk://h").unwrap();
        assert_eq!(
            (at_in_path.userinfo, at_in_path.path.as_deref()),
            (None, Some("app@x"))
        );
        // No host at all is for the backend to judge (a MySQL socket URL has none).
        let socket = LockUrl::parse("mysql:///db?socket=/s", &["mysql"], "mysql://h/db").unwrap();
        assert!(socket.hosts.is_empty() && socket.require_hosts("mysql://h/db").is_err());
        // Bad escapes are refused, not guessed at; raw values stay available.
        for bad in ["zk://h?root=%zz", "zk://h?root=%FF", "zk://h?ro%t=1"] {
            assert!(LockUrl::parse(bad, &["zk"], "zk://h").is_err(), "{bad}");
        }
        let raw = LockUrl::parse("zk://h?root=/a+b", &["zk"], "zk://h").unwrap();
        assert_eq!(
            (raw.options[0].value.as_str(), raw.options[0].raw_value()),
            ("/a b", "/a+b")
        );
        let plain = LockUrl::parse("zk://h", &["zk"], "zk://h").unwrap();
        assert_eq!((plain.userinfo, plain.path), (None, None));
        // A fragment is refused wherever it would change a name or a value.
        for bad in ["zk://h?root=/a#b", "zk://h/app#x", "zk://h?ttl=5s#"] {
            let refused = LockUrl::parse(bad, &["zk"], "zk://h")
                .map(|_| ())
                .unwrap_err();
            assert!(refused.to_string().contains("fragment"), "{bad}: {refused}");
        }
        let hash_in_password = LockUrl::parse("zk://u:p#w@h/x", &["zk"], "zk://h").unwrap();
        assert_eq!(hash_in_password.userinfo.as_deref(), Some("u:p#w"));
        for bad in ["zk://a,,b", "zk://,b", "redis://h", "zk:/h"] {
            assert!(LockUrl::parse(bad, &["zk"], "zk://h").is_err(), "{bad}");
        }
        assert_eq!(
            url_ttl("file:///tmp/x?ttl=250ms").unwrap(),
            Some(Duration::from_millis(250))
        );
        assert_eq!(url_ttl("memory://").unwrap(), None);
        assert!(url_ttl("redis://h?ttl=5").is_err());
    }

    #[test]
    fn durations() {
        assert_eq!(
            parse_duration("t", "250ms").unwrap(),
            Duration::from_millis(250)
        );
        assert_eq!(
            parse_duration("t", "1.5s").unwrap(),
            Duration::from_millis(1500)
        );
        assert_eq!(parse_duration("t", "2m").unwrap(), Duration::from_secs(120));
        for bad in ["", "10", "s", "1x", "-1s", "1e9999h"] {
            assert!(parse_duration("t", bad).is_err(), "{bad}");
        }
    }
}
