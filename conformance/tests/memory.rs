//! The whole conformance catalogue against the in-process `MemoryBackend`.

mod memory {
    lockkit_conformance::suite!(Some(lockkit_conformance::MemoryHarness::new()));
}

/// `run_all` (the entry point for backend authors outside this workspace) runs every case.
#[test]
fn run_all_covers_the_catalogue() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    let report = runtime.block_on(lockkit_conformance::run_all(std::sync::Arc::new(
        lockkit_conformance::MemoryHarness::new(),
    )));
    assert!(report.is_success(), "failed: {:?}", report.failed);
    assert_eq!(
        report.passed.len() + report.skipped.len(),
        lockkit_conformance::CATALOGUE.len()
    );
    // Only the cases that need other processes, or a network link to count or cut, may
    // skip on an in-process backend.
    for (case, why) in &report.skipped {
        assert!(
            why.contains("across processes")
                || why.contains("`requests_sent` hook")
                || why.contains("`cut_link` hook")
                || why.contains("(queued_wait)"),
            "{case} skipped: {why}"
        );
    }
}
