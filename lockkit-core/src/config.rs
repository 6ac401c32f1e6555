//! Helpers every backend uses to read its URL: durations and query options.

use std::time::Duration;

use crate::{Error, Result};

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
pub fn redact_url(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = rest.find("://") {
        let (head, tail) = rest.split_at(at + 3);
        out.push_str(head);
        let end = tail.find(['/', '?', '#', ',', ' ']).unwrap_or(tail.len());
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
        assert_eq!(redact_url("not a url"), "not a url");
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
