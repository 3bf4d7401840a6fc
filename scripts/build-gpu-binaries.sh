#!/usr/bin/env bash
# Builds the GPU-check binaries on a machine with no GPU and no CUDA toolkit, into .devbuild/ (and
# packed for the GPU machine into .devpack/gpu-binaries.tar.xz, at the end):
# wick's kernels (kernels/src/cuda/*.cu) and candle's are compiled by the real PyPI nvcc (7 min here on
# 2 cores), candle's through scripts/nvcc-ptx-compat.sh, which writes PTX that a CUDA 13.0 driver
# accepts; CUDA libraries are linked as empty stubs carrying the real SONAMEs.
#
# WICK_CANDLE_NVCC=fake compiles candle's kernels with the fake nvcc instead (faster; only
# kernel-free candle ops then work on the GPU — zeros, copies, cuBLAS — so train-amp is left out).
set -euo pipefail
cd "$(dirname "$0")/.."
shared=${WICK_SHARED:-../shared}
mkdir -p .cache/fake-nvcc .devbuild
cuda_home=$(sh "$shared/tools/cuda-toolkit-pypi.sh" "$PWD/.cache/cuda-toolkit" | tail -1)
export WICK_KERNELS_NVCC="$cuda_home/bin/nvcc"
if [ "${WICK_CANDLE_NVCC:-real}" = real ]; then
  # The wrapper stands in for nvcc on PATH; it calls the real one and fixes the PTX version.
  ln -sf "$PWD/scripts/nvcc-ptx-compat.sh" .cache/fake-nvcc/nvcc
  export WICK_REAL_NVCC="$cuda_home/bin/nvcc"
else
  ln -sf "$(realpath "$shared/tools/fake-nvcc")" .cache/fake-nvcc/nvcc
fi
bash scripts/cuda-link-stubs.sh target/cuda-stubs-empty
# cudarc's bindings follow the CUDA version of the driver the binaries run on (the H200 machines'
# 580 driver: CUDA 13.0), not the newer toolkit that compiles the kernels (PTX made compatible by
# the wrapper above); cudarc would otherwise read the version from `nvcc --version`.
export CUDARC_CUDA_VERSION=${CUDARC_CUDA_VERSION:-13000}
export PATH="$PWD/.cache/fake-nvcc:$PATH" CUDA_COMPUTE_CAP=80 LIBRARY_PATH="$PWD/target/cuda-stubs-empty"
flags=(-- -C link-arg=-Wl,--warn-unresolved-symbols)
build() { # pass 1 links against empty stubs (the linker then drops them: --as-needed), pass 2
          # relinks against stubs defining every symbol pass 1 left open, so the binary records them.
  cargo rustc --release "$@" "${flags[@]}"
}
build -p wick-tools --features cuda --bin gpu-check
build -p wick-memory --features cuda --test conformance_cuda
build -p wick-tools --features cuda --bin amp-gpu-check
build -p wick-tools --features cuda --bin nn-gpu-check
build -p wick-examples --features cuda --bin train-amp
build -p wick-examples --features cuda --bin byo-model
build -p wick-examples --features cuda --bin zoo-speed
build -p wick-cli --features cuda --bin wick
build -p wick-train --features nccl --example nccl_check
test_bin() { ls -t target/release/deps/conformance_cuda-* | grep -v '\.d$' | head -1; }
bash scripts/cuda-link-stubs.sh target/cuda-stubs-gpu target/release/gpu-check target/release/amp-gpu-check \
  target/release/nn-gpu-check \
  target/release/train-amp target/release/byo-model target/release/zoo-speed target/release/wick \
  target/release/examples/nccl_check \
  "$(test_bin)"
export LIBRARY_PATH="$PWD/target/cuda-stubs-gpu"
# Each binary's own source, touched so that pass 2 relinks it (a path that moved would silently
# leave its binary linked against the empty stubs: refused here).
for f in tools/src/bin/gpu_check.rs crates/wick-memory/tests/conformance_cuda.rs \
  tools/src/bin/amp_gpu_check.rs tools/src/bin/nn_gpu_check/main.rs examples/src/bin/train_amp.rs examples/src/bin/byo_model.rs \
  examples/src/bin/zoo_speed/main.rs crates/wick-cli/src/main.rs crates/wick-train/examples/nccl_check.rs; do
  [ -f "$f" ] || { echo "!! $f does not exist: update this list"; exit 1; }
  touch "$f"
done
build -p wick-tools --features cuda --bin gpu-check
build -p wick-memory --features cuda --test conformance_cuda
build -p wick-tools --features cuda --bin amp-gpu-check
build -p wick-tools --features cuda --bin nn-gpu-check
build -p wick-examples --features cuda --bin train-amp
build -p wick-examples --features cuda --bin byo-model
build -p wick-examples --features cuda --bin zoo-speed
build -p wick-cli --features cuda --bin wick
build -p wick-train --features nccl --example nccl_check
cp target/release/gpu-check target/release/amp-gpu-check target/release/examples/nccl_check .devbuild/
# train-amp needs candle's kernels: keep it only when they were really compiled.
# byo-model (a candle-transformers model), zoo-speed (the zoo's models) and nn-gpu-check (candle's
# casts, products and sums around wick's ops) too, and `wick` (train --device cuda --cuda-graph).
if [ "${WICK_CANDLE_NVCC:-real}" = real ]; then
  cp target/release/train-amp target/release/byo-model target/release/zoo-speed target/release/nn-gpu-check \
    target/release/wick .devbuild/
else
  rm -f .devbuild/train-amp .devbuild/byo-model .devbuild/zoo-speed .devbuild/nn-gpu-check .devbuild/wick
fi
cp "$(test_bin)" .devbuild/conformance_cuda
for b in .devbuild/*; do echo "$b needs: $(readelf -d "$b" | awk '/NEEDED/ {print $5}' | tr -d '[]' | tr '\n' ' ')"; done
# Every one of them drives the GPU: one that does not record libcuda was not relinked by pass 2.
for b in .devbuild/*; do
  readelf -d "$b" | grep -q 'libcuda.so' || { echo "!! $b does not link libcuda: pass 2 did not relink it"; exit 1; }
done
# What travels to a lent GPU machine (its working tree carries 64 MiB at most): the binaries
# stripped and packed with a window that spans them all (they share candle's and wick's kernels),
# 370 MB -> about 11 MB; scripts/gpu-check.sh unpacks it when .devbuild/ is not there.
pack=$(mktemp -d)
mkdir -p "$pack/bin" .devpack
for b in .devbuild/*; do strip -o "$pack/bin/$(basename "$b")" "$b"; done
tar -cf - -C "$pack" bin | xz -9 --lzma2=preset=9,dict=384MiB -T1 > .devpack/gpu-binaries.tar.xz.tmp
mv .devpack/gpu-binaries.tar.xz.tmp .devpack/gpu-binaries.tar.xz
rm -rf "$pack"
ls -l .devpack/gpu-binaries.tar.xz
