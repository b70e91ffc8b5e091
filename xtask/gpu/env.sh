# Sourced by the GPU scripts on the device machine: finds the CUDA libraries (driver, NVRTC,
# cuBLAS, NCCL, cuDNN: the system's or PyTorch's wheels) for the packed binaries. Directories
# sort by name, so the system's /usr/lib/x86_64-linux-gnu (cuDNN 9.14 on the H100 machine)
# comes before PyTorch's wheels under /usr/local; `Device::conv_path` says which cuDNN loaded.
# PyTorch runs through $TORCH_PYTHON, with the library path it was given: it brings its own
# CUDA libraries, and a system cuDNN first on the path stops it ("cuDNN version
# incompatibility").
export VRAM_ORIG_LD_LIBRARY_PATH="${VRAM_ORIG_LD_LIBRARY_PATH-${LD_LIBRARY_PATH:-}}"
libdirs=$(find /usr /opt /lib /lib64 -xdev \( -name 'libcuda.so*' -o -name 'libnvrtc.so*' \
  -o -name 'libcublas.so*' -o -name 'libcublasLt.so*' -o -name 'libcurand.so*' -o -name 'libnccl.so*' \
  -o -name 'libcudnn.so*' \) \
  2>/dev/null | xargs -r -n1 dirname | sort -u | paste -sd: -)
export LD_LIBRARY_PATH="${libdirs}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
# cudarc loads NCCL as libnccl.so (or .so.13, .12, ...), but NCCL installs libnccl.so.2 (the
# unversioned name comes only with its development package): link it under .gpu and require
# NCCL in the tests, so that its test fails rather than skips if it still does not load.
nccl2=$(find /usr /opt /lib /lib64 -xdev -name 'libnccl.so.2' 2>/dev/null | sort | head -n1)
if [ -n "$nccl2" ]; then
  mkdir -p "$PWD/.gpu/nccl-link"
  ln -sf "$nccl2" "$PWD/.gpu/nccl-link/libnccl.so"
  export LD_LIBRARY_PATH="$PWD/.gpu/nccl-link:$LD_LIBRARY_PATH"
  export VRAM_REQUIRE_NCCL=1
fi
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
if [ -f .gpu/bundle.tar.xz ] && [ ! -d .gpu/bin ]; then
  tar -C .gpu -xJf .gpu/bundle.tar.xz || { echo "error: cannot unpack .gpu/bundle.tar.xz" >&2; exit 2; }
fi
[ -d .gpu/bin ] || { echo "error: no .gpu/bin: run xtask/gpu/prepare here and carry [\".gpu\"]" >&2; exit 2; }
TORCH_PYTHON="$PWD/.gpu/python3"
if [ -n "$VRAM_ORIG_LD_LIBRARY_PATH" ]; then
  restore="export LD_LIBRARY_PATH=$(printf %q "$VRAM_ORIG_LD_LIBRARY_PATH")"
else
  restore="unset LD_LIBRARY_PATH"
fi
printf '#!/usr/bin/env bash\n%s\nexec python3 "$@"\n' "$restore" > "$TORCH_PYTHON"
chmod +x "$TORCH_PYTHON"
