//! A zero lease is refused by lockkit itself, even for a backend that declares no minimum.

use std::time::Duration;

use lockkit_core::spi::validate_ttl;
use lockkit_core::{BackendInfo, Capabilities, Consistency, Error, LockOptions};

#[test]
fn zero_ttl_is_refused_without_a_backend_minimum() {
    let info = BackendInfo::new(
        "test",
        Consistency::Cp,
        Capabilities {
            min_ttl: Duration::ZERO,
            ..Capabilities::default()
        },
    );
    assert!(matches!(
        validate_ttl(Duration::ZERO, &info),
        Err(Error::InvalidTtl { .. })
    ));
    let mut options = LockOptions::default();
    options.ttl = Duration::ZERO;
    options.watchdog = false;
    assert!(matches!(
        options.validate(&info),
        Err(Error::InvalidTtl { .. })
    ));
    assert!(validate_ttl(Duration::from_nanos(1), &info).is_ok());
}
