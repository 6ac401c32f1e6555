#!/usr/bin/env bash
# Brings up the private test servers and runs every test of the workspace against them.
# With CI=true a missing server fails the run instead of being skipped.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
scripts/services.sh up
eval "$(scripts/services.sh env)"
cargo test --workspace
