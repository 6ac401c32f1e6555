//! The catalogue is the single list of cases: every `pub async fn` under `src/cases/`
//! must be in it (or no backend would run it), and it must be as large as the issue asks.

use std::collections::BTreeSet;

#[test]
fn every_case_function_is_in_the_catalogue() {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/src/cases");
    let mut defined = BTreeSet::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        let module = path.file_stem().unwrap().to_string_lossy().into_owned();
        if module == "mod" {
            continue;
        }
        let source = std::fs::read_to_string(&path).unwrap();
        for line in source.lines() {
            if let Some(rest) = line.strip_prefix("pub async fn ") {
                let name = rest.split(['<', '(']).next().unwrap();
                defined.insert(format!("{module}::{name}"));
            }
        }
    }
    let listed: BTreeSet<String> = lockkit_conformance::CATALOGUE
        .iter()
        .map(|s| s.to_string())
        .collect();
    let unlisted: Vec<_> = defined.difference(&listed).collect();
    let phantom: Vec<_> = listed.difference(&defined).collect();
    assert!(
        unlisted.is_empty(),
        "cases missing from the catalogue: {unlisted:?}"
    );
    assert!(
        phantom.is_empty(),
        "catalogue entries without a case: {phantom:?}"
    );
    assert!(listed.len() >= 45, "only {} cases", listed.len());
}

#[test]
fn omitting_a_case_is_detected() {
    // A hand-rolled instantiation in this binary has no conformance tests at all, so the
    // completeness check must fail for it.
    let result = std::panic::catch_unwind(|| {
        lockkit_conformance::assert_catalogue_instantiated("catalogue::hand_rolled")
    });
    let message = result.expect_err("an empty instantiation passed the completeness check");
    let message = message
        .downcast_ref::<String>()
        .cloned()
        .unwrap_or_default();
    assert!(message.contains("omits"), "{message}");
}
