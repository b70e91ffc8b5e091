#!/usr/bin/env bash
# On the device machine, one command for a short GPU loan (under the device tool's 10 minutes
# a command): the checks that matter most first, each under its own limit, so that what ran
# comes back even if a later part runs out of time.
#   1. every test binary, CUDA tests for real (tests.sh)            limit TESTS_LIMIT (240 s)
#   2. attention against SDPA, ResNet-50's convolutions (measure.sh)  limit 150 s
#   3. cargo xtask bench --backend cuda at real sizes (bench.sh)      the time left, less 20 s
#      (RESUME_FROM=<an earlier, unpacked bench> continues it: bench.sh says how)
# $OUT then holds tests.tar.gz, measure.tar.gz, SUMMARY.md, bench.tar.gz, REPORT.md and
# session.txt (what ran, for how long, with which exit status).
# Usage: bash xtask/gpu/session.sh [seconds in all, default 570]
here=$(cd "$(dirname "$0")" && pwd)
total=${1:-570}
start=$SECONDS
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
log="$OUT/session.txt"
left() { echo $((total - (SECONDS - start))); }
part() { # name, limit seconds, command...
  local name=$1 limit=$2; shift 2
  if [ "$limit" -lt 30 ]; then
    echo "$name: not run (${limit} s left)" | tee -a "$log"
    return
  fi
  local t0=$SECONDS
  timeout "$limit" "$@"
  local rc=$?
  echo "$name: exit $rc after $((SECONDS - t0)) s (limit $limit s)" | tee -a "$log"
}
echo "# GPU session $(date -u +%FT%TZ): $(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>&1)" > "$log"
part tests "$(( $(left) < ${TESTS_LIMIT:-240} ? $(left) : ${TESTS_LIMIT:-240} ))" bash "$here/tests.sh"
part measure "$(( $(left) < 150 ? $(left) : 150 ))" bash "$here/measure.sh" attention conv
export BENCH_LIMIT=$(( $(left) - 20 ))
part bench "$(( $(left) - 10 ))" bash "$here/bench.sh"
echo "total: $((SECONDS - start)) s" | tee -a "$log"
