#!/usr/bin/env bash
# Brings up the private test servers and runs every test of the workspace against them.
# With CI=true a missing server fails the run instead of being skipped.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
scripts/services.sh up
eval "$(scripts/services.sh env)"
# The shared conformance suites (every backend's `conformance` binary, and the in-memory
# and file suites') wait on leases and servers, not on the CPU, and every case works under
# keys of its own: eight cases at a time. Everything else, some of it with sub-second
# leases and fault timings, four at a time. (All at twelve took 17 min against 18, and
# PostgreSQL's own cases with sub-second leases then failed; the suites alone at twelve
# overloaded the three-member ZooKeeper ensemble once in CI: requests unanswered in 800 ms.)
suites=(conformance memory file)
suite_targets=()
for name in "${suites[@]}"; do suite_targets+=(--test "$name"); done
RUST_TEST_THREADS="${LOCKKIT_SUITE_THREADS:-8}" cargo test --workspace "${suite_targets[@]}"
export RUST_TEST_THREADS="${RUST_TEST_THREADS:-4}"
# Every other test target of the workspace, by name, from cargo's metadata.
others=()
while read -r name; do
  [[ " ${suites[*]} " == *" $name "* ]] || others+=(--test "$name")
done < <(cargo metadata --no-deps --format-version 1 \
  | grep -o '"kind":\["test"\][^}]*"name":"[^"]*"' | sed 's/.*"name":"//; s/"$//' | sort -u)
(( ${#others[@]} > 0 )) || { echo "scripts/test.sh: found no test targets in cargo metadata" >&2; exit 1; }
cargo test --workspace --lib --bins --examples "${others[@]}"
cargo test --workspace --doc
