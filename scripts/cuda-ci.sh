#!/usr/bin/env bash
# CUDA checks that need no GPU (run by .ci/run):
#  1. type-check and lint every `cuda` code path with the fake nvcc from ../shared/tools;
#  2. build the CUDA test binary, link it against stub CUDA libraries whose every call fails, run
#     it, and check that the "no driver" path returns a clear error instead of panicking;
#  3. compile kernels/src/cuda/*.cu with a real nvcc: PTX for sm_80 and sm_90, and the fatbins that
#     the wick-kernels build script embeds (the cargo check of step 1 builds them with that nvcc);
#     and run wick-nn's kernels on the host emulator (kernels/emu: one OS thread per CUDA thread)
#     against direct f64 references, so their indexing and arithmetic are tested without a GPU;
#  4. check the cuDNN figures the GPU convolutions pass (crates/wick-nn/src/native/cuda/cudnn.rs)
#     against cudarc's bindings of cuDNN's headers (scripts/cudnn_abi.py);
#  5. read the CUPTI figures the CUDA memory history relies on from CUPTI's real headers (PyPI's
#     nvidia-cuda-cupti) and compare them with crates/wick/src/cupti_abi.expected.
set -euo pipefail
cd "$(dirname "$0")/.."
shared=${WICK_SHARED:-../shared}
if [ ! -x "$shared/tools/fake-nvcc" ]; then
  echo "!! CUDA checks SKIPPED: $shared/tools/fake-nvcc not found (set WICK_SHARED)"; exit 1
fi
mkdir -p .cache/fake-nvcc
ln -sf "$(realpath "$shared/tools/fake-nvcc")" .cache/fake-nvcc/nvcc
export PATH="$PWD/.cache/fake-nvcc:$PATH" CUDA_COMPUTE_CAP=80

echo "-- a real nvcc for kernels/src/cuda/*.cu (PyPI CUDA toolkit)"
cuda_home=$(sh "$shared/tools/cuda-toolkit-pypi.sh" "$PWD/.cache/cuda-toolkit" | tail -1)
export WICK_KERNELS_NVCC="$cuda_home/bin/nvcc"
"$WICK_KERNELS_NVCC" --version | tail -1

echo "-- cargo check / clippy with --features cuda (fake nvcc for candle, real nvcc for kernels/)"
features=wick/cuda,wick-train/cuda,wick-examples/cuda,wick-tools/cuda,wick-cli/cuda
cargo check --workspace --all-targets --features "$features"
cargo clippy --workspace --all-targets --features "$features" -- -D warnings
ls target/debug/build/wick-kernels-*/out/*.fatbin >/dev/null || { echo "!! the kernels were not compiled into wick-kernels"; exit 1; }

echo "-- the NCCL path (wick-train features nccl + mpi: cudarc's nccl, bootstrapped over MPI) type-checked"
cargo clippy -p wick-train -p wick-cli --all-targets --features wick-train/nccl,wick-train/mpi,wick-cli/nccl -- -D warnings

echo "-- no-driver path: test binary linked against failing stubs"
bash scripts/cuda-link-stubs.sh target/cuda-stubs-empty
# Builds the CUDA test binary with the libraries found in $1 and prints its path (from cargo's
# own report, not a guess among the test binaries of other feature sets).
build_test() {
  LIBRARY_PATH="$1" cargo rustc -p wick-memory --features cuda --test conformance_cuda --message-format=json \
    -- -C link-arg=-Wl,--warn-unresolved-symbols \
    | python3 -c 'import json,sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("target", {}).get("name") == "conformance_cuda" and m.get("executable"):
        print(m["executable"])'
}
binary=$(build_test "$PWD/target/cuda-stubs-empty")
stubs=target/cuda-stubs-failing
sh "$shared/tools/cuda-stubs.sh" "$binary" "$PWD/$stubs" >/dev/null
# Relink against the failing stubs so the binary records them as needed libraries.
touch crates/wick-memory/tests/conformance_cuda.rs
binary=$(build_test "$PWD/$stubs")
readelf -d "$binary" | grep -q 'libcuda' || { echo "!! the test binary does not link libcuda"; exit 1; }
LD_LIBRARY_PATH="$PWD/$stubs" WICK_EXPECT_NO_DRIVER=1 "$binary" --nocapture

echo "-- kernels/src/cuda/*.cu with a real nvcc"
shopt -s nullglob
kernels=(kernels/src/cuda/*.cu)
if [ ${#kernels[@]} -eq 0 ]; then
  echo "no CUDA kernels in kernels/ yet: nothing to compile"
else
  mkdir -p target/ptx
  for k in "${kernels[@]}"; do
    for arch in 80 90; do
      "$cuda_home/bin/nvcc" --ptx -arch=sm_$arch "$k" -o "target/ptx/$(basename "$k" .cu).sm_$arch.ptx"
    done
  done
  ls target/ptx
fi

echo "-- wick-nn's CUDA kernels on the host emulator (kernels/emu) against direct f64 references"
mkdir -p target
# C++20 (<barrier>) and _Float16: Debian's g++ 12.
command -v g++ >/dev/null 2>&1 || apt-get install -y g++ >/dev/null 2>&1 || { apt-get update >/dev/null && apt-get install -y g++ >/dev/null; }
# Under AddressSanitizer: a kernel that strays past its shared memory (the launchers' byte counts,
# which the checks give exactly) or past an operand fails here.
g++ -std=c++20 -O1 -g -fsanitize=address -ffp-contract=off -pthread -Wall -Wno-unknown-pragmas -Werror -I kernels/emu \
  kernels/emu/check*.cpp -o target/emu-check
target/emu-check | tail -3

echo "-- cuDNN figures of the GPU convolutions (opened at run time), against cudarc's bindings of cuDNN's headers"
python3 scripts/cudnn_abi.py | tail -1

echo "-- CUPTI ABI of the CUDA memory history, from CUPTI's headers"
cupti_dir=.cache/cupti
if [ ! -f "$cupti_dir/nvidia/cu13/include/cupti.h" ]; then
  mkdir -p "$cupti_dir/whl"
  python3 -m pip download -q --no-deps -d "$cupti_dir/whl" nvidia-cuda-cupti==13.4.92
  for w in "$cupti_dir"/whl/*.whl; do python3 -m zipfile -e "$w" "$cupti_dir"; done
fi
mkdir -p target/cupti
gcc -Wall -Werror -I "$cuda_home/include" -I "$cupti_dir/nvidia/cu13/include" scripts/cupti_abi.c -o target/cupti/abi
target/cupti/abi > target/cupti/abi.txt
diff -u crates/wick/src/cupti_abi.expected target/cupti/abi.txt \
  || { echo "!! CUPTI's headers disagree with crates/wick/src/cupti_abi.expected (and so with cupti_abi.rs)"; exit 1; }
echo "CUPTI ABI matches ($(wc -l < target/cupti/abi.txt) figures)"
