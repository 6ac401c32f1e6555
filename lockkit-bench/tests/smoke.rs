//! The peer benchmark runs end to end (a `--quick` run on Redis, ZooKeeper and the file
//! backend): every client, peers included, gives figures for the scenarios it takes part
//! in, and the tables name them. The figures themselves are not checked: timings belong in
//! the benchmark, not in a test.

use std::process::Command;

use lockkit_conformance::env;

#[test]
fn a_quick_run_measures_every_client() {
    if std::env::var("LOCKKIT_TEST_REDIS_URL").is_err() {
        assert!(
            !env::in_ci(),
            "the services are not up in CI: scripts/test.sh starts them"
        );
        eprintln!("lockkit: SKIPPED, run eval \"$(scripts/services.sh env)\" first");
        return;
    }
    let out = Command::new(env!("CARGO_BIN_EXE_peerbench"))
        .args(["--quick", "--backends", "redis,zk,file"])
        .output()
        .unwrap();
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "peerbench failed ({}):\n{table}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    for client in [
        "| lockkit |",
        "| rslock 0.10 |",
        "| redis-py 5 `Lock` |",
        "| kazoo 2.11 `Lock` |",
        "| Curator 5.4 `InterProcessMutex` |",
        "| floor: `PING`",
        "| floor: two `EVALSHA`s of an empty script |",
        "| floor: ephemeral create + delete |",
        "| floor: `flock` + unlock |",
    ] {
        let row = table
            .lines()
            .find(|l| l.starts_with(client))
            .unwrap_or_else(|| panic!("no row for {client} in:\n{table}"));
        let same_key = row.split('|').nth(2).unwrap().trim();
        assert!(
            same_key.chars().next().is_some_and(|c| c.is_ascii_digit()),
            "{client} has no same-key figure: {row}"
        );
    }
    // Every peer also took part in the contended scenarios (wake and handoff).
    for peer in ["| kazoo", "| Curator", "| redis-py", "| rslock"] {
        let row = table.lines().find(|l| l.starts_with(peer)).unwrap();
        let cells: Vec<&str> = row.split('|').map(str::trim).collect();
        assert!(
            cells[4].starts_with(|c: char| c.is_ascii_digit())
                && cells[5].starts_with(|c: char| c.is_ascii_digit()),
            "{peer} lacks wake or handoff figures: {row}"
        );
    }
    // Throughput: lockkit, rslock and both Redis floors have a rate (the last column).
    for client in ["| lockkit |", "| rslock", "| floor: `PING`", "| floor: two"] {
        let row = table.lines().find(|l| l.starts_with(client)).unwrap();
        let rate = row.trim_end_matches('|').rsplit('|').next().unwrap().trim();
        assert!(
            rate.starts_with(|c: char| c.is_ascii_digit()),
            "{client} has no throughput: {row}"
        );
    }
    assert!(
        table.contains("lockkit, acquire+release per second: "),
        "{table}"
    );
    assert!(table.contains("### Targets of issue 13"), "{table}");
}
