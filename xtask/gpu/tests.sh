#!/usr/bin/env bash
# On the device machine: every packed test binary (CUDA tests for real), their logs packed
# into one file ($OUT takes 8 files at most). TESTS_LIMIT (seconds) stops the run in time
# for the logs of what ran to be packed.
source "$(dirname "$0")/env.sh"
logs=$(mktemp -d)
OUT= timeout "$(( ${TESTS_LIMIT:-3000} - 15 ))" bash .gpu/run "$@" 2>&1 | tee "$logs/run.txt"
status=${PIPESTATUS[0]}
[ "$status" = 124 ] && echo "tests: stopped at TESTS_LIMIT (${TESTS_LIMIT} s); the logs hold what ran"
cp .gpu/*.log "$logs/" 2>/dev/null
grep -h "skipped: no CUDA\|skipped: no NCCL" .gpu/*.log | sort | uniq -c > "$logs/skipped.txt" || true
echo "distinct \"skipped: no CUDA/NCCL\" lines (none on a working GPU): $(wc -l < "$logs/skipped.txt")"
grep -h "skipped: no cuDNN\|convolutions through cuDNN\|batch norm through cuDNN" .gpu/*.log | sort | uniq -c > "$logs/cudnn.txt" || true
echo "cuDNN: $(head -n 3 "$logs/cudnn.txt" | tr -s ' ' | paste -sd ';' -)"
tar czf "$OUT/tests.tar.gz" -C "$logs" .
exit "$status"
