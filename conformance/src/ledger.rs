//! A ledger of critical sections shared by processes: each holder of a lock, whatever its
//! client (lockkit, kazoo, redis-py, etcdctl), appends `enter <key> <who>` right after its
//! grant and `exit <key> <who>` right before its release, each line in one `write` to a
//! file opened for appending, so the file's order is the order of those writes in time.
//! Two holders of one key at once show as an `enter` while the key is entered.

use std::{
    collections::HashMap,
    fs::{File, OpenOptions},
    io::Write,
    path::{Path, PathBuf},
};

/// A ledger file in a directory of its own under the system's temporary directory,
/// removed when dropped.
#[derive(Debug)]
pub struct Ledger {
    dir: PathBuf,
    path: PathBuf,
    file: File,
}

/// What a ledger held: the holds of each holder, by the holder's name up to its first `-`
/// (`lockkit-3` counts as `lockkit`).
#[derive(Debug, Default)]
pub struct LedgerSummary {
    /// Holds by kind of holder.
    pub holds: HashMap<String, usize>,
}

impl LedgerSummary {
    /// Holds of holders whose name starts with `kind` and a `-`.
    pub fn of(&self, kind: &str) -> usize {
        self.holds.get(kind).copied().unwrap_or(0)
    }
}

impl Ledger {
    /// A new empty ledger.
    ///
    /// # Errors
    /// When its directory or file cannot be made.
    pub fn new() -> std::io::Result<Ledger> {
        let dir = std::env::temp_dir().join(format!(
            "lockkit-ledger-{}-{}",
            std::process::id(),
            uuid::Uuid::new_v4().simple()
        ));
        std::fs::create_dir_all(&dir)?;
        let path = dir.join("ledger");
        let file = OpenOptions::new().create(true).append(true).open(&path)?;
        Ok(Ledger { dir, path, file })
    }

    /// The file, for other processes to append to (`O_APPEND`, one line per `write`).
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Records that `who` (no spaces) entered `key`'s critical section.
    ///
    /// # Errors
    /// When the line cannot be written.
    pub fn enter(&self, key: &str, who: &str) -> std::io::Result<()> {
        self.line("enter", key, who)
    }

    /// Records that `who` is about to leave `key`'s critical section.
    ///
    /// # Errors
    /// When the line cannot be written.
    pub fn exit(&self, key: &str, who: &str) -> std::io::Result<()> {
        self.line("exit", key, who)
    }

    fn line(&self, what: &str, key: &str, who: &str) -> std::io::Result<()> {
        // One write: appended whole, at the end, whoever else appends.
        (&self.file).write_all(format!("{what} {key} {who}\n").as_bytes())
    }

    /// Reads the ledger back: the holds of each kind of holder, or the first place where
    /// two holders were inside one key at once (or a holder left a key it was not in).
    ///
    /// # Errors
    /// The violation, with its line, or a read error.
    pub fn check(&self) -> Result<LedgerSummary, String> {
        let text = std::fs::read_to_string(&self.path).map_err(|e| e.to_string())?;
        let mut inside: HashMap<&str, &str> = HashMap::new();
        let mut summary = LedgerSummary::default();
        for (number, line) in text.lines().enumerate() {
            let number = number + 1;
            let fields: Vec<&str> = line.split(' ').collect();
            let [what, key, who] = fields.as_slice() else {
                return Err(format!(
                    "line {number} is not `enter|exit <key> <who>`: {line:?}"
                ));
            };
            match *what {
                "enter" => {
                    if let Some(holder) = inside.insert(key, who) {
                        return Err(format!(
                            "line {number}: {who} entered key {key} while {holder} was inside"
                        ));
                    }
                    let kind = who.split('-').next().unwrap_or(who);
                    *summary.holds.entry(kind.to_owned()).or_default() += 1;
                }
                "exit" => match inside.remove(key) {
                    Some(holder) if holder == *who => {}
                    holder => {
                        return Err(format!(
                            "line {number}: {who} left key {key}, which {holder:?} was inside"
                        ));
                    }
                },
                _ => return Err(format!("line {number}: unknown record {line:?}")),
            }
        }
        if let Some((key, who)) = inside.iter().next() {
            return Err(format!("{who} never left key {key}"));
        }
        Ok(summary)
    }
}

impl Drop for Ledger {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn alternating_holders_pass_and_an_overlap_is_found() {
        let ledger = Ledger::new().unwrap();
        ledger.enter("0", "lockkit-1").unwrap();
        ledger.exit("0", "lockkit-1").unwrap();
        ledger.enter("0", "kazoo-7").unwrap();
        ledger.enter("1", "lockkit-1").unwrap();
        ledger.exit("0", "kazoo-7").unwrap();
        ledger.exit("1", "lockkit-1").unwrap();
        let summary = ledger.check().unwrap();
        assert_eq!((summary.of("lockkit"), summary.of("kazoo")), (2, 1));

        ledger.enter("0", "lockkit-2").unwrap();
        ledger.enter("0", "kazoo-7").unwrap();
        let found = ledger.check().unwrap_err();
        assert!(
            found.contains("kazoo-7 entered key 0 while lockkit-2"),
            "{found}"
        );
    }
}
