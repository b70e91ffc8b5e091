#!/usr/bin/env bash
# On the device machine: every experiment on CUDA at real sizes; the report packed into one
# file ($OUT/bench.tar.gz: REPORT.md, JSON, SVG, bench-run.json) to commit under
# reports/<gpu>/.
# RESUME_FROM=<folder> (a committed earlier bench.tar.gz, unpacked, with its bench-run.json)
# keeps what that run finished on the same GPU and settings and runs the rest (--resume), so
# that a bench longer than one loan finishes over several.
source "$(dirname "$0")/env.sh"
res=$(mktemp -d)/bench
resume=()
if [ -n "${RESUME_FROM:-}" ]; then
  if [ -f "$RESUME_FROM/bench-run.json" ]; then
    mkdir -p "$res"
    cp -r "$RESUME_FROM"/. "$res"/
    resume=(--resume)
  else
    echo "RESUME_FROM=$RESUME_FROM holds no bench-run.json: running every experiment"
  fi
fi
# BENCH_LIMIT (seconds) stops the bench in time for what it wrote to come back; the report
# and bench-run.json are rewritten after each experiment, so what finished is in them.
timeout "${BENCH_LIMIT:-3000}" .gpu/bin/xtask bench --backend cuda --out "$res" "${resume[@]}" "$@" 2>&1 | tail -n 60
status=${PIPESTATUS[0]}
[ -d "$res" ] && tar czf "$OUT/bench.tar.gz" -C "$(dirname "$res")" bench
cp "$res/REPORT.md" "$OUT/REPORT.md" 2>/dev/null
exit "$status"
