#!/bin/sh
# Run `make test` (TEST_WORKERS workers, default auto: tests/conftest.py; the setup is a no-op
# once made) N times (default 3) while a busy loop occupies one core at normal priority:
# the check that the suite's timing promises hold on a busy 2-core host (docs/reliability.md,
# "The on-time promise"). Meant to be started in the background, as CI wrappers do:
#
#   nohup scripts/suite_under_hog.sh 3 > .triton/hog/nohup.out 2>&1 &
#
# Each run's output goes to .triton/hog/run-<i>.log, a line per run to
# .triton/hog/summary.txt. Exits non-zero if any run failed. The hog is stopped on exit, also on
# SIGINT/SIGTERM (the script installs its own handlers: a background job inherits SIGINT ignored).
set -u
runs=${1:-3}
here=$(cd "$(dirname "$0")/.." && pwd)
out="$here/.triton/hog"
mkdir -p "$out"
: > "$out/summary.txt"

sh -c 'while :; do :; done' &
hog=$!
stop() { kill "$hog" 2>/dev/null; }
trap 'stop; exit 130' INT
trap 'stop; exit 143' TERM
trap stop EXIT

failed=0
i=1
while [ "$i" -le "$runs" ]; do
    started=$(date +%s)
    (cd "$here" && make --no-print-directory test TEST_WORKERS="${TEST_WORKERS:-auto}") \
        > "$out/run-$i.log" 2>&1
    code=$?
    took=$(( $(date +%s) - started ))
    echo "run $i: exit $code in ${took} s: $(tail -n 1 "$out/run-$i.log")" >> "$out/summary.txt"
    [ "$code" -eq 0 ] || failed=1
    i=$((i + 1))
done
exit "$failed"
