//! lockkit's metrics through a real recorder: names, labels, and the opt-in key label.
#![cfg(feature = "metrics")]

use lockkit::{Locker, MemoryBackend, telemetry};
use metrics_exporter_prometheus::PrometheusBuilder;

#[tokio::test]
async fn metrics_carry_the_key_only_when_asked() {
    let recorder = PrometheusBuilder::new().build_recorder();
    let handle = recorder.handle();
    metrics::set_global_recorder(recorder).expect("the only recorder of this test binary");
    let locker = Locker::new(MemoryBackend::new());

    let guard = locker.acquire("plain/key").await.unwrap();
    guard.release().await.unwrap();
    telemetry::label_keys(true);
    let guard = locker.acquire("labelled/key").await.unwrap();
    assert!(locker.try_acquire("labelled/key").await.unwrap().is_none());
    guard.release().await.unwrap();
    telemetry::label_keys(false);

    let text = handle.render();
    assert!(
        text.contains(
            r#"lockkit_acquisitions_total{backend="memory",outcome="granted",key="labelled/key"} 1"#
        ),
        "{text}"
    );
    assert!(
        text.contains(
            r#"lockkit_acquisitions_total{backend="memory",outcome="busy",key="labelled/key"} 1"#
        ),
        "{text}"
    );
    assert!(
        text.contains(r#"lockkit_acquisitions_total{backend="memory",outcome="granted"} 1"#),
        "the unlabelled acquisition: {text}"
    );
    assert!(
        text.contains(r#"lockkit_hold_seconds_count{backend="memory",key="labelled/key"} 1"#),
        "{text}"
    );
    assert!(!text.contains("plain/key"), "a key label while off: {text}");
    assert!(
        text.contains(r#"lockkit_holds{backend="memory"} 0"#),
        "{text}"
    );
}
