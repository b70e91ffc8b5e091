#!/usr/bin/env bash
# On the device machine: every experiment on CUDA at real sizes; the report packed into one
# file ($OUT/bench.tar.gz: REPORT.md, JSON, SVG) to commit under reports/h100/.
source "$(dirname "$0")/env.sh"
res=$(mktemp -d)/bench
# BENCH_LIMIT (seconds) stops the bench in time for what it wrote to come back.
timeout "${BENCH_LIMIT:-3000}" .gpu/bin/xtask bench --backend cuda --out "$res" "$@" 2>&1 | tail -n 60
status=${PIPESTATUS[0]}
tar czf "$OUT/bench.tar.gz" -C "$(dirname "$res")" bench
cp "$res/REPORT.md" "$OUT/REPORT.md" 2>/dev/null
exit "$status"
