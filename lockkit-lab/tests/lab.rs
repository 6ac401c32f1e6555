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

/// The committed `docs/cap.md` must hold exactly the table this run renders.
fn check_document(reports: &[lab::Report]) -> Result<(), String> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../docs/cap.md");
    let committed = std::fs::read_to_string(&path)
        .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    let regenerated = lab::splice_table(&committed, &lab::render_table(reports))?;
    if regenerated == committed {
        return Ok(());
    }
    let diff: Vec<String> = committed
        .lines()
        .zip(regenerated.lines())
        .filter(|(a, b)| a != b)
        .take(10)
        .map(|(a, b)| format!("  committed:   {a}\n  this run:    {b}"))
        .collect();
    Err(format!(
        "{} differs from this run; regenerate it with `scripts/cap.sh` and review the change:\n{}",
        path.display(),
        diff.join("\n")
    ))
}
