//! The whole conformance catalogue against `FileBackend`: no server, and the crash cases
//! run in real child processes.

mod file {
    lockkit_conformance::suite!(Some(lockkit_conformance::FileHarness::new(concat!(
        env!("CARGO_TARGET_TMPDIR"),
        "/file-locks"
    ))));
}
