#!/usr/bin/env bash
# On the device machine, in one command (under 10 minutes): the GPU issue's measurements, each
# bounded by a timeout so that one failure does not cost the others.
#   1. kernels: copy bandwidth, add as a fraction of it, matmul 8192^3; PyTorch's in the same run
#   2. allocator: cached pair vs cuMemAlloc + cuMemFree, vs PyTorch's caching allocator
#   3. the PyTorch twin of the reference models (cargo xtask twin --backend cuda --profile)
#   4. a PyTorch training trace (default and expandable segments) replayed by vram --strict
#   5. cargo xtask plan --verify on CUDA (the virtual prediction against the measured peak)
#   6. conv: ResNet-50's convolutions one by one, vram's own kernels (cuda_conv), vram through
#      cuDNN (cuda_conv_cudnn) and PyTorch (torch_conv.py)
#   7. attention: vram's fused attention (cuda_attention) against PyTorch's SDPA, flash backend
#      (torch_attention.py), b8 h12 d64 bf16 causal at 1024 and 4096 tokens
# Everything lands in $OUT/measure.tar.gz; $OUT/SUMMARY.md has the tables.
# Arguments pick parts (kernels, twin, trace, plan, conv, attention); none runs them all.
# MEASURE_LIMIT (seconds) bounds the whole call: each run's timeout is cut to what is left,
# less 15 s, so that the results are packed in time. TWIN_MODELS (comma-separated) picks the
# twin's models (default: all of them), TWIN_LIMIT its limit (default 300 s).
source "$(dirname "$0")/env.sh"
budget=${MEASURE_LIMIT:-100000}
began=$SECONDS
here=$(cd "$(dirname "$0")" && pwd)
R=$(mktemp -d)/measure
mkdir -p "$R/trace"
S="$R/SUMMARY.md"
say() { echo "$@" | tee -a "$S"; }
run() { # name, timeout seconds, command...
  local name=$1 limit=$2; shift 2
  local left=$((budget - (SECONDS - began) - 15))
  [ "$limit" -gt "$left" ] && limit=$left
  say ""; say "## $name"; say ""
  if [ "$limit" -lt 10 ]; then
    say "not run: out of time (MEASURE_LIMIT $budget s)"
    return
  fi
  say '```'
  timeout "$limit" "$@" > "$R/$name.txt" 2>&1
  local rc=$?
  tail -n 40 "$R/$name.txt" | tee -a "$S"
  say '```'; say "exit status: $rc"
}
say "# GPU measurements ($(date -u +%FT%TZ))"
say "$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1)"
say "$("$TORCH_PYTHON" -c 'import torch; print("PyTorch", torch.__version__, "CUDA", torch.version.cuda)' 2>&1)"
parts=" ${*:-kernels twin trace plan conv attention} "
wants() { [[ "$parts" == *" $1 "* ]]; }
if wants kernels; then
  run cuda_bench 120 .gpu/bin/cuda_bench
  run cuda_pairs 120 .gpu/bin/cuda_pairs
  run torch_bench 180 "$TORCH_PYTHON" "$here/torch_bench.py" --vram-kernels "$R/cuda_bench.txt" --vram-pairs "$R/cuda_pairs.txt"
fi
if wants twin; then
  run twin "${TWIN_LIMIT:-300}" .gpu/bin/xtask twin --backend cuda --profile --python "$TORCH_PYTHON" --out "$R/twin" \
    ${TWIN_MODELS:+--models "$TWIN_MODELS"}
  cp "$R/twin/TWIN.md" "$R/TWIN.md" 2>/dev/null
  find "$R/twin" \( -name 'weights.f32' -o -name 'input.*' -o -name 'targets.u32' \) -delete
fi
if wants trace; then
  for conf in default expandable; do
    c=""; [ "$conf" = expandable ] && c="expandable_segments:True"
    run "record_$conf" 120 "$TORCH_PYTHON" "$here/record_trace.py" "$R/trace/torch_step_$conf.pickle" ${c:+--conf "$c"}
    run "replay_$conf" 120 .gpu/bin/xtask replay "$R/trace/torch_step_$conf.pickle" --strict --out "$R/trace"
  done
fi
if wants plan; then
  run plan_verify 240 .gpu/bin/xtask plan --model gpt2-small --batch 32 --device-memory 79GiB --verify
  # ResNet-50 bf16 channels_last planned with the cuDNN choices the twin's run recorded, and
  # checked on the GPU (the twin's autocast recipe runs it channels_last where cuDNN loads).
  rec="$R/twin/resnet50/cudnn-choices.json"
  if [ -f "$rec" ]; then
    run plan_verify_cudnn 240 .gpu/bin/xtask plan --model resnet50 --batch 64 --device-memory 79GiB \
      --precision autocast-bf16 --channels-last --cudnn-choices "$rec" --verify
  fi
fi
if wants conv; then
  run cuda_conv 120 env VRAM_CONV_BACKEND=own .gpu/bin/cuda_conv
  run cuda_conv_cudnn 120 env VRAM_CONV_BACKEND=cudnn .gpu/bin/cuda_conv
  run torch_conv 120 "$TORCH_PYTHON" "$here/torch_conv.py"
fi
if wants attention; then
  run cuda_attention 120 .gpu/bin/cuda_attention
  run torch_attention 120 "$TORCH_PYTHON" "$here/torch_attention.py"
fi
tar czf "$OUT/measure.tar.gz" -C "$(dirname "$R")" measure
cp "$S" "$OUT/SUMMARY.md"
cp "$R/TWIN.md" "$OUT/TWIN.md" 2>/dev/null
echo "written: $OUT/measure.tar.gz, $OUT/SUMMARY.md"
