#!/usr/bin/env bash
# The peer benchmark of issue 13: lockkit beside rslock, redis-py, kazoo, Apache Curator and
# each server's floor, in one run on the private servers, written into docs/performance.md
# (between its peerbench markers). Arguments go to peerbench, e.g. --backends redis,zk or
# --quick (a smoke run). Quiet the machine first: other builds and tests skew the figures.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
scripts/services.sh up >&2
eval "$(scripts/services.sh env)"
cargo build --release -p lockkit-bench --bin peerbench >&2
exec target/release/peerbench --write docs/performance.md "$@"
