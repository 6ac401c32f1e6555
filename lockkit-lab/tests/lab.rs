//! The fault lab against the private servers: every scenario of
//! `lockkit_lab::CATALOGUE`, one at a time, each checked against what it
//! expects; then the table they produce must equal the one committed in `docs/cap.md`.
//!
//! A plain `main` (harness = false): the scenarios pause and kill shared servers, so they
//! must not run in parallel, and the document check needs all their results. Arguments
//! are substrings that select scenarios (`cargo test -p lockkit-lab --test lab --
//! failover`); the document check runs only when every scenario ran.
//! The same binary is the lab's child holder when started with `LOCKKIT_LAB_CHILD_URL`.

use std::{io::Write, path::PathBuf, process::ExitCode, sync::Arc, time::Duration};

use lockkit_conformance::env;
use lockkit_lab::{self as lab, CATALOGUE, ChildCommand, Connect, Lab, Services};

fn connector() -> Connect {
    Arc::new(|url: String| Box::pin(async move { lockkit::backend(&url).await }))
}

fn main() -> ExitCode {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a tokio runtime");
    if lab::child_requested() {
        let code = runtime.block_on(lab::child_main(connector()));
        return ExitCode::from(u8::try_from(code).unwrap_or(1));
    }
    // Servers are configured by scripts/test.sh; without them, skip loudly (fail in CI).
    if env::service_url("LOCKKIT_TEST_REDIS_URL").is_none() {
        return ExitCode::SUCCESS;
    }
    let filters: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with('-'))
        .collect();
    runtime.block_on(run(filters))
}

async fn run(filters: Vec<String>) -> ExitCode {
    let exe = std::env::current_exe().expect("the test binary's path");
    let child = ChildCommand {
        program: exe,
        args: Vec::new(),
    };
    let services = match Services::locate() {
        Ok(services) => services,
        Err(e) => {
            eprintln!("lab: cannot start: {e}");
            return ExitCode::FAILURE;
        }
    };
    let lab = match Lab::new(connector(), child, services).await {
        Ok(lab) => lab,
        Err(e) => {
            eprintln!("lab: cannot start: {e}");
            return ExitCode::FAILURE;
        }
    };
    let selected: Vec<_> = CATALOGUE
        .iter()
        .filter(|d| {
            let name = d.name();
            filters.is_empty() || filters.iter().any(|f| name.contains(f.as_str()))
        })
        .collect();
    println!("\nrunning {} lab scenarios, one at a time", selected.len());
    let mut reports = Vec::new();
    let mut failed = Vec::new();
    for def in &selected {
        let name = def.name();
        print!("lab {name} ... ");
        let _ = std::io::stdout().flush();
        let report = lab::run(&lab, def).await;
        if report.passed() {
            println!("ok ({:.1} s)\n{report}", report.elapsed.as_secs_f64());
        } else {
            println!("FAILED ({:.1} s)\n{report}", report.elapsed.as_secs_f64());
            failed.push(name);
        }
        reports.push(report);
    }
    if filters.is_empty() {
        match check_document(&reports) {
            Ok(()) => println!("lab docs/cap.md matches this run ... ok"),
            Err(e) => {
                println!("lab docs/cap.md matches this run ... FAILED\n{e}");
                failed.push("docs/cap.md".into());
            }
        }
    }
    let total: Duration = reports.iter().map(|r| r.elapsed).sum();
    if failed.is_empty() {
        println!(
            "\nlab result: ok. {} scenarios passed in {:.1} s\n",
            reports.len(),
            total.as_secs_f64()
        );
        ExitCode::SUCCESS
    } else {
        println!(
            "\nlab result: FAILED. {} of {} failed: {}\n",
            failed.len(),
            reports.len(),
            failed.join(", ")
        );
        ExitCode::FAILURE
    }
}

/// The committed `docs/cap.md` must hold exactly the table and timelines section this run
/// renders, and every row's picture in `docs/lab/` must show what the row says.
fn check_document(reports: &[lab::Report]) -> Result<(), String> {
    let docs = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../docs");
    let path = docs.join("cap.md");
    let committed = std::fs::read_to_string(&path)
        .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    let regenerated = lab::render_document(&committed, reports)?;
    if regenerated != committed {
        let diff: Vec<String> = committed
            .lines()
            .zip(regenerated.lines())
            .filter(|(a, b)| a != b)
            .take(10)
            .map(|(a, b)| format!("  committed:   {a}\n  this run:    {b}"))
            .collect();
        return Err(format!(
            "{} differs from this run; regenerate it with `scripts/cap.sh` and review the change:\n{}",
            path.display(),
            diff.join("\n")
        ));
    }
    let mut problems = Vec::new();
    for report in reports {
        let file = lab::svg::file_name(report.scenario, report.backend);
        if !committed.contains(&format!("[picture]({}/{file})", lab::PICTURES_DIR)) {
            problems.push(format!("docs/cap.md's table does not link {file}"));
        }
        if !committed.contains(&format!(
            "![{} on {}: the timeline of a real run]({}/{file})",
            report.scenario,
            report.backend,
            lab::PICTURES_DIR
        )) {
            problems.push(format!("docs/cap.md does not embed {file}"));
        }
        let committed_svg = docs.join(lab::PICTURES_DIR).join(&file);
        match std::fs::read_to_string(&committed_svg) {
            Ok(text) => problems.extend(
                check_picture(&text, report)
                    .into_iter()
                    .map(|p| format!("docs/lab/{file}: {p}")),
            ),
            Err(e) => problems.push(format!(
                "cannot read {}: {e} (scripts/cap.sh writes it)",
                committed_svg.display()
            )),
        }
        // This run's own picture must show the same.
        problems.extend(
            check_picture(&lab::svg::render(report), report)
                .into_iter()
                .map(|p| format!("{file} as drawn from this run: {p}")),
        );
    }
    if problems.is_empty() {
        Ok(())
    } else {
        Err(format!(
            "the timeline pictures do not show what the table says (regenerate with \
             `scripts/cap.sh`):\n  {}",
            problems.join("\n  ")
        ))
    }
}

/// What a picture must show, checked by its structure rather than its bytes (timings
/// differ from run to run): it is SVG, names its scenario and backend, and has the marks
/// the row's outcome implies.
fn check_picture(text: &str, report: &lab::Report) -> Vec<String> {
    let doc = match roxmltree::Document::parse(text) {
        Ok(doc) => doc,
        Err(e) => return vec![format!("not well-formed XML: {e}")],
    };
    let mut problems = Vec::new();
    let root = doc.root_element();
    if root.tag_name().name() != "svg"
        || root.tag_name().namespace() != Some("http://www.w3.org/2000/svg")
    {
        problems.push("the root is not an SVG element".to_owned());
    }
    for (attribute, want) in [
        ("data-scenario", report.scenario),
        ("data-backend", report.backend),
    ] {
        if root.attribute(attribute) != Some(want) {
            problems.push(format!(
                "{attribute} is {:?}, not `{want}`",
                root.attribute(attribute)
            ));
        }
    }
    // (actor, time) of each element whose class list has `class`.
    let marks = |class: &str| -> Vec<(String, f64)> {
        doc.descendants()
            .filter(|n| {
                n.attribute("class")
                    .is_some_and(|c| c.split_whitespace().any(|w| w == class))
            })
            .map(|n| {
                (
                    n.attribute("data-actor").unwrap_or_default().to_owned(),
                    n.attribute("data-t")
                        .and_then(|t| t.parse().ok())
                        .unwrap_or(f64::NAN),
                )
            })
            .collect()
    };
    let by = |class: &str, actor: &str| -> Vec<f64> {
        marks(class)
            .into_iter()
            .filter(|(a, _)| a == actor)
            .map(|(_, t)| t)
            .collect()
    };
    require(
        &mut problems,
        !by("grant", "holder").is_empty(),
        "no grant marker for the holder",
    );
    let rival_grants = by("grant", "rival");
    require(
        &mut problems,
        !rival_grants.is_empty(),
        "no grant marker for the rival",
    );
    require(&mut problems, !marks("fault").is_empty(), "no fault window");
    require(&mut problems, !marks("lease").is_empty(), "no lease span");
    let Some(seen) = &report.observed else {
        return problems;
    };
    let first_rival = rival_grants.iter().copied().fold(f64::INFINITY, f64::min);
    let lost = by("lost", "holder");
    match seen.lost {
        lab::LostSignal::Never => require(
            &mut problems,
            lost.is_empty(),
            "a lost marker, but the lock was kept",
        ),
        lab::LostSignal::AfterRival => require(
            &mut problems,
            lost.iter().any(|t| *t >= first_rival),
            "no lost marker after the rival's grant (the row says lost after a rival's grant)",
        ),
        lab::LostSignal::BeforeRival => require(
            &mut problems,
            lost.iter().any(|t| *t <= first_rival),
            "no lost marker before the rival's grant (the row says lost before it)",
        ),
    }
    let refused = by("write-refused", "holder");
    let stale_accepted = by("write-stale-accepted", "holder");
    match seen.stale {
        lab::Stale::Refused => {
            require(
                &mut problems,
                !refused.is_empty(),
                "no refused-write marker for the holder (the row says the stale write was refused)",
            );
            let newer = by("write-accepted", "rival");
            require(
                &mut problems,
                newer.iter().any(|t| refused.iter().any(|r| t <= r)),
                "no accepted write by the rival before the holder's refused one",
            );
        }
        lab::Stale::Accepted => require(
            &mut problems,
            !stale_accepted.is_empty(),
            "no accepted-stale-write marker (the row says fencing failed)",
        ),
        lab::Stale::NoStaleHolder => require(
            &mut problems,
            refused.is_empty() && stale_accepted.is_empty(),
            "a stale write is drawn, but the row says there was no stale holder",
        ),
    }
    let double = !marks("double-grant").is_empty();
    require(
        &mut problems,
        double == seen.double_grant,
        if seen.double_grant {
            "no double-grant band (the row says double grant)"
        } else {
            "a double-grant band, but the row says no double grant"
        },
    );
    problems
}

/// Adds `what` to `problems` unless `ok`.
fn require(problems: &mut Vec<String>, ok: bool, what: &str) {
    if !ok {
        problems.push(what.to_owned());
    }
}
