#!/usr/bin/env bash
# Builds the GPU-check binaries on a machine with no GPU and no CUDA toolkit, into .devbuild/:
# candle's kernels are compiled by the fake nvcc (so only kernel-free candle ops work: zeros,
# copies, cuBLAS), and CUDA libraries are linked as empty stubs carrying the real SONAMEs.
set -euo pipefail
cd "$(dirname "$0")/.."
shared=${WICK_SHARED:-../shared}
mkdir -p .cache/fake-nvcc .devbuild
ln -sf "$(realpath "$shared/tools/fake-nvcc")" .cache/fake-nvcc/nvcc
bash scripts/cuda-link-stubs.sh target/cuda-stubs-empty
export PATH="$PWD/.cache/fake-nvcc:$PATH" CUDA_COMPUTE_CAP=80 LIBRARY_PATH="$PWD/target/cuda-stubs-empty"
flags=(-- -C link-arg=-Wl,--warn-unresolved-symbols)
build() { # pass 1 links against empty stubs (the linker then drops them: --as-needed), pass 2
          # relinks against stubs defining every symbol pass 1 left open, so the binary records them.
  cargo rustc --release "$@" "${flags[@]}"
}
build -p wick --features cuda --bin gpu-check
build -p wick-memory --features cuda --test conformance_cuda
test_bin() { ls -t target/release/deps/conformance_cuda-* | grep -v '\.d$' | head -1; }
bash scripts/cuda-link-stubs.sh target/cuda-stubs-gpu target/release/gpu-check
export LIBRARY_PATH="$PWD/target/cuda-stubs-gpu"
touch crates/wick/src/bin/gpu_check.rs crates/wick-memory/tests/conformance_cuda.rs
build -p wick --features cuda --bin gpu-check
build -p wick-memory --features cuda --test conformance_cuda
cp target/release/gpu-check .devbuild/
cp "$(test_bin)" .devbuild/conformance_cuda
for b in .devbuild/*; do echo "$b needs: $(readelf -d "$b" | awk '/NEEDED/ {print $5}' | tr -d '[]' | tr '\n' ' ')"; done
