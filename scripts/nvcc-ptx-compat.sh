#!/usr/bin/env bash
# Stands in for nvcc when candle's kernels are built for a GPU machine whose driver is older than
# the toolkit: runs the real nvcc ($WICK_REAL_NVCC) and rewrites the `.version` line of the PTX it
# wrote (`-o FILE`, or `--output-directory DIR` with one .ptx per .cu) to $WICK_PTX_VERSION
# (default 9.0, what a CUDA 13.0 / 580 driver JIT-compiles). nvcc 13.4 writes PTX 9.4, which
# such a driver rejects. Untested on a GPU so far (see the session notes).
set -euo pipefail
"${WICK_REAL_NVCC:?set WICK_REAL_NVCC to the real nvcc}" "$@"
outputs=()
prev=""
dir=""
sources=()
for a in "$@"; do
  case "$prev" in
    -o) outputs+=("$a") ;;
    --output-directory|-odir) dir="$a" ;;
  esac
  case "$a" in *.cu) sources+=("$a") ;; esac
  prev="$a"
done
if [ -n "$dir" ]; then
  for s in "${sources[@]}"; do outputs+=("$dir/$(basename "$s" .cu).ptx"); done
fi
for out in "${outputs[@]}"; do
  if [ -f "$out" ] && head -c 4096 "$out" | grep -q '^\.version '; then
    sed -i "s/^\.version .*/.version ${WICK_PTX_VERSION:-9.0}/" "$out"
  fi
done
