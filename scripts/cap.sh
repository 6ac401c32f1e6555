#!/usr/bin/env bash
# Regenerates the scenario x backend table of docs/cap.md, its timelines section and the
# timeline pictures docs/lab/SCENARIO-BACKEND.svg from a real run of every fault lab
# scenario against the private servers (the prose around them is hand-written).
#
#   scripts/cap.sh
#
# The lab test (cargo test -p lockkit-lab --test lab, part of scripts/test.sh)
# fails when the committed table differs from what a run produces, or a picture does not
# show what its row says.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
scripts/services.sh up >/dev/null
cargo run -q -p lockkit-cli --features etcd -- lab all --update docs/cap.md
