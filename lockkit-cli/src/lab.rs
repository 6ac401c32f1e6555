//! `lockkit lab`: the fault lab of `lockkit_lab`, from the command line.

use std::{path::Path, process::ExitCode, sync::Arc};

use lockkit_lab::{self as lab, CATALOGUE, ChildCommand, Connect, Lab, Services};

/// The facade's `backend(url)`, as the lab wants it.
pub fn connector() -> Connect {
    Arc::new(|url: String| Box::pin(async move { lockkit::backend(&url).await }))
}

/// Where `lockkit lab` writes what it saw, besides the terminal.
#[derive(Debug, Clone, Copy, Default)]
pub struct Output<'a> {
    /// The Markdown document whose generated parts are rewritten (pictures go to `lab/`
    /// beside it).
    pub update: Option<&'a Path>,
    /// A directory for each run's timeline picture.
    pub svg: Option<&'a Path>,
}

/// Runs the selected scenarios one at a time, printing each timeline as it happens.
pub async fn main(scenario: &str, backend: Option<&str>, list: bool, out: Output<'_>) -> ExitCode {
    let update = out.update;
    if list {
        for def in CATALOGUE {
            println!(
                "{:<18} --backend {:<20} {}",
                def.scenario, def.backend, def.what
            );
        }
        return ExitCode::SUCCESS;
    }
    let selected: Vec<_> = CATALOGUE
        .iter()
        .filter(|d| scenario == "all" || d.scenario == scenario)
        .filter(|d| backend.is_none_or(|b| d.backend == b))
        .collect();
    if selected.is_empty() {
        let mut ids: Vec<&str> = CATALOGUE.iter().map(|d| d.scenario).collect();
        ids.dedup();
        eprintln!(
            "lockkit: no lab scenario `{scenario}`{}; scenarios: all, {} (see --list)",
            backend.map_or(String::new(), |b| format!(" on `{b}`")),
            ids.join(", ")
        );
        return ExitCode::from(2);
    }
    if update.is_some() && selected.len() != CATALOGUE.len() {
        eprintln!("lockkit: --update needs every scenario: run `lockkit lab all --update FILE`");
        return ExitCode::from(2);
    }
    let Ok(exe) = std::env::current_exe() else {
        eprintln!("lockkit: cannot find this program's path to start the child holder");
        return ExitCode::from(2);
    };
    let child = ChildCommand {
        program: exe,
        args: Vec::new(),
    };
    let lab = match Services::locate() {
        Ok(services) => Lab::new(connector(), child, services).await,
        Err(e) => Err(e),
    };
    let lab = match lab {
        Ok(lab) => lab.live(true),
        Err(e) => {
            eprintln!("lockkit: the lab needs the private servers (scripts/services.sh up): {e}");
            return ExitCode::from(2);
        }
    };
    let mut reports = Vec::new();
    let mut progress = crate::progress::Progress::new(selected.len());
    for def in selected {
        progress.step(&format!("{} on {}", def.scenario, def.backend));
        let report = lab::run(&lab, def).await;
        progress.clear();
        print_verdict(&report);
        reports.push(report);
    }
    drop(progress);
    let failed: Vec<String> = reports
        .iter()
        .filter(|r| !r.passed())
        .map(lab::Report::name)
        .collect();
    println!("\n{}", lab::render_table(&reports));
    if let Some(path) = update {
        if !failed.is_empty() {
            eprintln!(
                "lockkit: not updating {}: {} run(s) failed",
                path.display(),
                failed.len()
            );
            return ExitCode::FAILURE;
        }
        match lab::update_document(path, &reports) {
            Ok(pictures) => println!(
                "updated {} and {} timeline pictures beside it",
                path.display(),
                pictures.len()
            ),
            Err(e) => {
                eprintln!("lockkit: cannot update {}: {e}", path.display());
                return ExitCode::FAILURE;
            }
        }
    }
    if let Some(dir) = out.svg {
        let drawn = std::fs::create_dir_all(dir).and_then(|()| {
            reports.iter().try_for_each(|r| {
                let file = dir.join(lab::svg::file_name(r.scenario, r.backend));
                std::fs::write(&file, lab::svg::render(r))?;
                println!("timeline picture: {}", file.display());
                Ok(())
            })
        });
        if let Err(e) = drawn {
            eprintln!(
                "lockkit: cannot write the pictures into {}: {e}",
                dir.display()
            );
            return ExitCode::FAILURE;
        }
    }
    if failed.is_empty() {
        println!("every run behaved as expected");
        ExitCode::SUCCESS
    } else {
        println!("FAILED: {}", failed.join(", "));
        ExitCode::FAILURE
    }
}

fn print_verdict(report: &lab::Report) {
    match &report.observed {
        Some(seen) => {
            println!(
                "  double grant: {}{}",
                if seen.double_grant { "YES" } else { "no" },
                if seen.double_grant && report.expect.double_grant {
                    " (the hazard this scenario shows)"
                } else {
                    ""
                }
            );
            for v in &seen.violations {
                println!("    checker: {v}");
            }
            println!("  lost signalled: {}", seen.lost);
            println!("  stale write refused: {}", seen.stale);
        }
        None => println!("  (stopped before it could be judged)"),
    }
    if report.passed() {
        println!(
            "  verdict: as expected ({:.1} s)\n",
            report.elapsed.as_secs_f64()
        );
    } else {
        println!("  verdict: FAILED ({:.1} s)", report.elapsed.as_secs_f64());
        for p in &report.problems {
            println!("    - {p}");
        }
        println!();
    }
}
