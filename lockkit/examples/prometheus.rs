//! lockkit's metrics in Prometheus text form: install a recorder (here the
//! `metrics-exporter-prometheus` one, without its HTTP listener), take and contend a lock,
//! then render what was recorded. A service would serve `handle.render()` at `/metrics`
//! (or let the exporter's own listener do it, as `lockkit run --metrics-addr` does).
//!
//! ```sh
//! cargo run -p lockkit --example prometheus --features metrics
//! ```

use std::time::Duration;

use lockkit::{Locker, MemoryBackend};
use metrics_exporter_prometheus::PrometheusBuilder;

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let recorder = PrometheusBuilder::new().build_recorder();
    let handle = recorder.handle();
    metrics::set_global_recorder(recorder)?;

    let locker = Locker::new(MemoryBackend::new());
    for _ in 0..3 {
        let guard = locker.acquire("orders/42").await?;
        guard.release().await?;
    }
    let held = locker.acquire("orders/42").await?;
    // Contended: a zero wait is refused at once, a short one times out.
    assert!(locker.try_acquire("orders/42").await?.is_none());
    let timed_out = locker
        .acquire("orders/42")
        .wait(Duration::from_millis(20))
        .await;
    assert!(timed_out.is_err());
    held.release().await?;

    let text = handle.render();
    print!("{text}");
    for name in [
        "lockkit_acquisitions_total",
        "lockkit_acquire_wait_seconds",
        "lockkit_hold_seconds",
    ] {
        if !text.contains(name) {
            return Err(format!("{name} was not recorded").into());
        }
    }
    Ok(())
}
