#!/usr/bin/env bash
# Builds the binaries that measure an AVX2 machine's paths on an AVX-512 one: `zoo-speed`,
# `embed-speed` and the `f32_products` bench from the committed HEAD with the `gemm` crate's
# `x86-v4` feature off (its AVX2 kernels, as an AVX2 CPU runs them), into target/avx2. Run them
# with WICK_CPU_AVX512=0 (wick's own kernels and blocking take their AVX2 code), e.g.
#
#   scripts/build-avx2-binaries.sh
#   WICK_CPU_AVX512=0 MKL_ENABLE_INSTRUCTIONS=AVX2 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 \
#     scripts/transformer-eval.sh OUT target/avx2/release/zoo-speed target/avx2/release/embed-speed
#
# The source is a detached git worktree of HEAD at target/avx2-src (uncommitted changes are not
# in it); only its Cargo.toml differs. A first build takes about 10 minutes on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
src=target/avx2-src
if [ ! -e "$src/.git" ]; then
  rm -rf "$src"
  git worktree add --detach "$src" HEAD >/dev/null
fi
# Whatever was changed or added in the worktree (its Cargo.toml edit, files copied in by hand
# for an experiment) is dropped: it builds HEAD as committed.
git -C "$src" reset -q --hard
git -C "$src" clean -fdq
git -C "$src" checkout -q --detach "$(git rev-parse HEAD)"
sed -i 's/^gemm = { version = "\([^"]*\)", features = \["x86-v4"\] }/gemm = { version = "\1" }/' "$src/Cargo.toml"
if grep -q 'x86-v4' "$src/Cargo.toml"; then
  echo "build-avx2-binaries: could not turn off gemm's x86-v4 in $src/Cargo.toml" >&2
  exit 1
fi
export CARGO_TARGET_DIR="$root/target/avx2" CARGO_INCREMENTAL=0
(cd "$src" && cargo build --release -p wick-examples --bin zoo-speed --bin embed-speed)
bench=$(cd "$src" && cargo bench -p wick-kernels --bench f32_products --no-run --message-format=json 2>/dev/null \
  | python3 -c 'import sys, json
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m["target"]["name"] == "f32_products" and m.get("executable"):
        print(m["executable"])')
echo "AVX2-path binaries (run with WICK_CPU_AVX512=0):"
echo "  $root/target/avx2/release/zoo-speed"
echo "  $root/target/avx2/release/embed-speed"
echo "  $bench"
