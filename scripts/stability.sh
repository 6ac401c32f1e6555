#!/usr/bin/env bash
# Stability check for issue 11: N fresh clones of this checkout's HEAD, each running
# `CI=true .ci/run` at LOCKKIT_PORT_OFFSET (default 2000) while two busy loops load the
# cores. Appends one line per run to /tmp/stability.txt; logs in /tmp/stab-run-<i>.log.
# Usage: scripts/stability.sh [N]
set -u
N=${1:-5}
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
offset=${LOCKKIT_PORT_OFFSET:-2000}
out=/tmp/stability.txt
busy() { while :; do :; done; }
busy & b1=$!
busy & b2=$!
trap 'kill $b1 $b2 2>/dev/null' EXIT
for i in $(seq 1 "$N"); do
  dir=/tmp/stab-clone-$i
  # Servers an interrupted earlier run left behind would hold the ports (and their state
  # goes with the clone): stop them through that clone's own script before removing it.
  for old in /tmp/stab-clone-*; do
    [[ -x "$old/scripts/services.sh" ]] || continue
    (cd "$old" && LOCKKIT_PORT_OFFSET=$offset CARGO_TARGET_DIR=/tmp/stab-target \
      scripts/services.sh down > /dev/null 2>&1)
  done
  rm -rf "$dir"
  git clone -q "$repo" "$dir"
  commit=$(git -C "$dir" rev-parse --short HEAD)
  start=$(date +%s)
  (cd "$dir" && CI=true CARGO_INCREMENTAL=0 LOCKKIT_PORT_OFFSET=$offset CARGO_TARGET_DIR=/tmp/stab-target \
    bash .ci/run > "/tmp/stab-run-$i.log" 2>&1)
  rc=$?
  (cd "$dir" && LOCKKIT_PORT_OFFSET=$offset CARGO_TARGET_DIR=/tmp/stab-target \
    scripts/services.sh down > /dev/null 2>&1)
  failed=$(grep -hE '^test .*FAILED$' "/tmp/stab-run-$i.log" | tr '\n' ' ')
  echo "run $i of $commit: rc=$rc $(( $(date +%s) - start )) s; failed: ${failed:-none}" >> "$out"
done
