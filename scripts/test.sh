#!/usr/bin/env bash
# Brings up the private test servers and runs every test of the workspace against them.
# With CI=true a missing server fails the run instead of being skipped.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
scripts/services.sh up
eval "$(scripts/services.sh env)"
# Most cases wait on servers and leases, not on the CPU: four at a time per test binary
# keeps the whole run well inside CI's budget on two cores.
export RUST_TEST_THREADS="${RUST_TEST_THREADS:-4}"
cargo test --workspace
