#!/usr/bin/env bash
# On the device machine, one command for a short GPU loan (under the device tool's 10 minutes
# a command): the checks that matter most first, each under its own limit, so that what ran
# comes back even if a later part runs out of time.
#   1. every test binary, CUDA tests for real (tests.sh)          limit TESTS_LIMIT (240 s)
#   2. measure.sh's MEASURE_PARTS (default "twin attention")       limit MEASURE_LIMIT (300 s)
#      twin: the speed and memory goals, TWIN_MODELS (default GPT-2 small at batch 8 and
#      ResNet-50 at 64) in vram and in PyTorch's recipes (defaults, bf16 autocast,
#      torch.compile), with --profile, at most TWIN_LIMIT (200 s); attention: vram's fused
#      attention against SDPA; also kernels, trace, plan, conv (measure.sh says what each is)
#   3. cargo xtask bench --backend cuda at real sizes (bench.sh)   the time left, less 20 s;
#      the report is rewritten after each experiment, and RESUME_FROM=<an earlier, unpacked
#      bench.tar.gz> continues that bench (bench.sh says how)
# $OUT then holds tests.tar.gz, measure.tar.gz, SUMMARY.md, TWIN.md, bench.tar.gz, REPORT.md
# and session.txt (what ran, for how long, with which exit status): 7 of the 8 files a
# command may return.
# Usage: bash xtask/gpu/session.sh [seconds in all, default 570]
here=$(cd "$(dirname "$0")" && pwd)
total=${1:-570}
start=$SECONDS
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
log="$OUT/session.txt"
left() { echo $((total - (SECONDS - start))); }
cap() { local l; l=$(left); echo $((l < $1 ? l : $1)); }
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
t=$(cap "${TESTS_LIMIT:-240}")
TESTS_LIMIT=$t part tests "$((t + 5))" bash "$here/tests.sh"
# measure.sh bounds its own runs by MEASURE_LIMIT and packs what ran; the outer limit is a
# backstop a little beyond it.
m=$(cap "${MEASURE_LIMIT:-300}")
# shellcheck disable=SC2086
MEASURE_LIMIT=$m TWIN_LIMIT=${TWIN_LIMIT:-200} TWIN_MODELS=${TWIN_MODELS:-gpt2-small,resnet50} \
  part measure "$((m + 10))" bash "$here/measure.sh" ${MEASURE_PARTS:-twin attention}
export BENCH_LIMIT=$(( $(left) - 20 ))
part bench "$(( $(left) - 10 ))" bash "$here/bench.sh"
echo "total: $((SECONDS - start)) s" | tee -a "$log"
