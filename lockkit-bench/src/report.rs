//! The run's tables, in Markdown, and the targets checked against them.

use std::{fmt::Write as _, path::Path};

use crate::subjects::{Micros, Scenario};

const BEGIN: &str = "<!-- peerbench:begin -->";
const END: &str = "<!-- peerbench:end -->";

/// Every sample one client gave in one backend's run.
#[derive(Debug)]
pub struct Measured {
    pub label: String,
    pub floor: bool,
    pub lockkit: bool,
    same: Vec<Micros>,
    new: Vec<Micros>,
    wake: Vec<Micros>,
    handoff: Vec<Micros>,
    /// The median of the throughput runs (see [`Measured::add_rate`]).
    pub per_second: Option<f64>,
    /// Every throughput run's rate, in the order run.
    rates: Vec<f64>,
}

impl Measured {
    pub fn new(label: &str, floor: bool, lockkit: bool) -> Self {
        Measured {
            label: label.to_owned(),
            floor,
            lockkit,
            same: Vec::new(),
            new: Vec::new(),
            wake: Vec::new(),
            handoff: Vec::new(),
            per_second: None,
            rates: Vec::new(),
        }
    }

    /// Takes in one throughput run's rate; [`Measured::per_second`] becomes the median of
    /// the runs so far (the lower middle one of an even count).
    pub fn add_rate(&mut self, rate: f64) {
        self.rates.push(rate);
        let mut sorted = self.rates.clone();
        sorted.sort_by(f64::total_cmp);
        self.per_second = sorted.get((sorted.len() - 1) / 2).copied();
    }

    /// The throughput cell: the median, and the range of the runs when there were several.
    fn rate_cell(&self, rate: f64, unit: &str) -> String {
        let low = self.rates.iter().copied().fold(f64::INFINITY, f64::min);
        let high = self.rates.iter().copied().fold(0.0, f64::max);
        let range = if self.rates.len() > 1 {
            format!(
                " ({}–{} in {} runs)",
                thousands(low),
                thousands(high),
                self.rates.len()
            )
        } else {
            String::new()
        };
        format!("{}{unit}{range}", thousands(rate))
    }

    pub fn add(&mut self, scenario: Scenario, samples: Vec<Micros>) {
        match scenario {
            Scenario::SameKey => &mut self.same,
            Scenario::NewKey => &mut self.new,
            Scenario::Wake => &mut self.wake,
            Scenario::Handoff => &mut self.handoff,
        }
        .extend(samples);
    }

    fn samples(&self, scenario: Scenario) -> &[Micros] {
        match scenario {
            Scenario::SameKey => &self.same,
            Scenario::NewKey => &self.new,
            Scenario::Wake => &self.wake,
            Scenario::Handoff => &self.handoff,
        }
    }

    /// The `q` quantile of a scenario's samples.
    pub fn quantile(&self, scenario: Scenario, q: f64) -> Option<Micros> {
        let mut samples = self.samples(scenario).to_vec();
        if samples.is_empty() {
            return None;
        }
        samples.sort_by(f64::total_cmp);
        let rank = ((samples.len() - 1) as f64 * q).round() as usize;
        samples.get(rank.min(samples.len() - 1)).copied()
    }

    fn p50(&self, scenario: Scenario) -> Option<Micros> {
        self.quantile(scenario, 0.5)
    }

    fn cell(&self, scenario: Scenario) -> String {
        match (self.p50(scenario), self.quantile(scenario, 0.99)) {
            (Some(p50), Some(p99)) => format!(
                "{} / {} ({})",
                thousands(p50),
                thousands(p99),
                self.samples(scenario).len()
            ),
            _ => "—".into(),
        }
    }
}

/// One backend's clients.
#[derive(Debug)]
pub struct Section {
    pub backend: String,
    pub measured: Vec<Measured>,
}

impl Section {
    fn find(&self, prefix: &str) -> Option<&Measured> {
        self.measured.iter().find(|m| m.label.starts_with(prefix))
    }
}

fn thousands(x: f64) -> String {
    let whole = x.round() as u64;
    if whole < 100 {
        return format!("{x:.1}");
    }
    let digits = whole.to_string();
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// A target of issue 13: what was measured against what, and whether it is met.
struct Target {
    what: String,
    measured: Option<f64>,
    limit: f64,
    /// Met when `measured <= limit` (else when `measured >= limit`).
    at_most: bool,
    detail: String,
}

impl Target {
    /// Met when `mine / theirs <= limit`; the detail names both figures in µs.
    fn at_most(
        what: impl Into<String>,
        mine: Option<f64>,
        theirs: Option<f64>,
        limit: f64,
    ) -> Self {
        Target {
            what: what.into(),
            measured: ratio(mine, theirs),
            limit,
            at_most: true,
            detail: format!(
                "{} µs vs {} µs",
                mine.map_or("—".into(), thousands),
                theirs.map_or("—".into(), thousands)
            ),
        }
    }
}

fn ratio(a: Option<f64>, b: Option<f64>) -> Option<f64> {
    match (a, b) {
        (Some(a), Some(b)) if b > 0.0 => Some(a / b),
        _ => None,
    }
}

fn targets(sections: &[Section]) -> Vec<Target> {
    let mut out = Vec::new();
    let same = Scenario::SameKey;
    for s in sections {
        let lockkit = s.find("lockkit");
        let p50 = |m: Option<&Measured>, sc| m.and_then(|m| m.p50(sc));
        match s.backend.as_str() {
            "redis" | "redlock" => {
                let rslock = s.find("rslock");
                out.push(Target::at_most(
                    format!("{}: lockkit ≤ 0.8x rslock, same key, p50", s.backend),
                    p50(lockkit, same),
                    p50(rslock, same),
                    0.8,
                ));
                if s.backend == "redis" {
                    let ping = s.find("floor: `PING`");
                    let scripts = s.find("floor: two `EVALSHA`s");
                    out.push(Target::at_most(
                        "redis: lockkit ≤ 2.2x `PING`, same key, p50",
                        p50(lockkit, same),
                        p50(ping, same),
                        2.2,
                    ));
                    let (locks, sets) = (
                        lockkit.and_then(|m| m.per_second),
                        ping.and_then(|m| m.per_second),
                    );
                    out.push(Target {
                        what: "redis: throughput (1,000 keys × 32 tasks) ≥ 0.5x the `SET` rate"
                            .into(),
                        measured: ratio(locks, sets),
                        limit: 0.5,
                        at_most: false,
                        detail: format!(
                            "{}/s vs {}/s; any lock of two scripts stays under {}/s here",
                            locks.map_or("—".into(), thousands),
                            sets.map_or("—".into(), thousands),
                            scripts
                                .and_then(|m| m.per_second)
                                .map_or("—".into(), thousands)
                        ),
                    });
                }
            }
            "zk" => {
                let curator = s.find("Curator");
                let kazoo = s.find("kazoo");
                out.push(Target::at_most(
                    "zk: lockkit same key ≤ 1.0x Curator same key, p50",
                    p50(lockkit, same),
                    p50(curator, same),
                    1.0,
                ));
                out.push(Target::at_most(
                    "zk: lockkit new key ≤ 1.3x Curator same key, p50",
                    p50(lockkit, Scenario::NewKey),
                    p50(curator, same),
                    1.3,
                ));
                for (name, peer) in [("Curator", curator), ("kazoo", kazoo)] {
                    for (sc, what) in [(Scenario::Wake, "wake"), (Scenario::Handoff, "handoff")] {
                        out.push(Target::at_most(
                            format!("zk: lockkit {what} ahead of {name} (< 1.0x), p50"),
                            p50(lockkit, sc),
                            p50(peer, sc),
                            1.0,
                        ));
                    }
                }
            }
            "mysql" | "postgres" => {
                let select = s.find("floor: `SELECT 1`");
                let commits = s.find("floor: two one-row");
                for m in s.measured.iter().filter(|m| m.lockkit) {
                    out.push(Target {
                        what: format!("{}: {} ≤ 3x `SELECT 1`, p50", s.backend, m.label),
                        measured: ratio(m.p50(same), p50(select, same)),
                        limit: 3.0,
                        at_most: true,
                        detail: format!(
                            "{} µs vs {} µs (two one-row commits: {} µs, {:.2}x)",
                            m.p50(same).map_or("—".into(), thousands),
                            p50(select, same).map_or("—".into(), thousands),
                            p50(commits, same).map_or("—".into(), thousands),
                            ratio(m.p50(same), p50(commits, same)).unwrap_or(0.0)
                        ),
                    });
                }
            }
            "file" => out.push(Target {
                what: "file: lockkit uncontended ≤ 50 µs, p50".into(),
                measured: p50(lockkit, same),
                limit: 50.0,
                at_most: true,
                detail: "µs".into(),
            }),
            _ => {}
        }
    }
    out
}

/// The tables of a run.
pub fn markdown(sections: &[Section], notes: &[String], quick: bool) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "{BEGIN}");
    let _ = writeln!(
        out,
        "_Generated by `scripts/perf.sh` (`cargo run --release -p lockkit-bench --bin peerbench`) on {}{}. \
         Cells are p50 / p99 in µs (samples); every client of a backend ran in interleaved batches in the same run on the same servers._\n",
        date(),
        if quick {
            ", a `--quick` smoke run: not worth quoting"
        } else {
            ""
        }
    );
    let _ = writeln!(out, "### Targets of issue 13 in this run\n");
    let _ = writeln!(out, "| target | measured | figures | met |");
    let _ = writeln!(out, "|---|---|---|---|");
    for t in targets(sections) {
        let met = match t.measured {
            Some(m) if (t.at_most && m <= t.limit) || (!t.at_most && m >= t.limit) => "yes",
            Some(_) => "**no**",
            None => "not measured",
        };
        let _ = writeln!(
            out,
            "| {} | {} | {} | {met} |",
            t.what,
            t.measured.map_or("—".into(), |m| if t.detail == "µs" {
                format!("{m:.1} µs")
            } else {
                format!("{m:.2}x")
            }),
            if t.detail == "µs" {
                String::new()
            } else {
                t.detail
            }
        );
    }
    for s in sections {
        let _ = writeln!(out, "\n### {}\n", s.backend);
        let _ = writeln!(
            out,
            "| client | same key | new key each time | wake of a blocked waiter | handoff, 16 clients | acquire+release/s, 1,000 keys × 32 tasks |"
        );
        let _ = writeln!(out, "|---|---|---|---|---|---|");
        for m in &s.measured {
            let _ = writeln!(
                out,
                "| {} | {} | {} | {} | {} | {} |",
                m.label,
                m.cell(Scenario::SameKey),
                if m.floor {
                    "—".into()
                } else {
                    m.cell(Scenario::NewKey)
                },
                m.cell(Scenario::Wake),
                m.cell(Scenario::Handoff),
                m.per_second.map_or("—".into(), |r| {
                    if m.label.starts_with("floor: `PING`") {
                        m.rate_cell(r, " `SET`s")
                    } else if m.floor {
                        m.rate_cell(r, " pairs")
                    } else {
                        m.rate_cell(r, "")
                    }
                })
            );
        }
        if let Some(lockkit) = s.measured.iter().find(|m| m.lockkit) {
            let mut ratios = Vec::new();
            for other in s.measured.iter().filter(|m| !m.lockkit) {
                if let Some(r) = ratio(lockkit.p50(Scenario::SameKey), other.p50(Scenario::SameKey))
                {
                    ratios.push(format!("{r:.2}x {}", other.label));
                }
            }
            if !ratios.is_empty() {
                let _ = writeln!(
                    out,
                    "\n{}, same key, p50: {}.",
                    lockkit.label,
                    ratios.join("; ")
                );
            }
            let rates: Vec<String> = s
                .measured
                .iter()
                .filter(|m| !m.lockkit)
                .filter_map(|other| {
                    ratio(lockkit.per_second, other.per_second)
                        .map(|r| format!("{r:.2}x {}", other.label))
                })
                .collect();
            if !rates.is_empty() {
                let _ = writeln!(
                    out,
                    "\n{}, acquire+release per second: {}.",
                    lockkit.label,
                    rates.join("; ")
                );
            }
        }
    }
    if !notes.is_empty() {
        let _ = writeln!(out, "\nNotes of this run:\n");
        for n in notes {
            let _ = writeln!(out, "- {n}");
        }
    }
    let _ = write!(out, "{END}");
    out
}

fn date() -> String {
    std::process::Command::new("date")
        .args(["-u", "+%Y-%m-%d %H:%M UTC"])
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .map_or_else(|| "an unknown date".into(), |s| s.trim().to_owned())
}

/// Puts `markdown` between the markers of `path` (after the first heading when the file
/// has none yet).
pub fn splice(path: &Path, markdown: &str) -> std::io::Result<()> {
    let text = std::fs::read_to_string(path)?;
    let updated = match (text.find(BEGIN), text.find(END)) {
        (Some(b), Some(e)) if e > b => {
            format!("{}{markdown}{}", &text[..b], &text[e + END.len()..])
        }
        _ => match text.find("\n\n") {
            Some(at) => format!("{}\n\n{markdown}\n{}", &text[..at], &text[at..]),
            None => format!("{text}\n\n{markdown}\n"),
        },
    };
    std::fs::write(path, updated)
}
