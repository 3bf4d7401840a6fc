#!/usr/bin/env bash
# usage: cuda-link-stubs.sh OUTDIR [BINARY...]
# Makes CUDA libraries to link against on a machine without CUDA. Without BINARY they are empty
# (link with -Wl,--warn-unresolved-symbols; the real libraries resolve the symbols at run time on
# a GPU machine). With BINARYs every CUDA symbol any of them needs is defined and returns an error,
# so each binary starts and its CUDA calls fail cleanly (the "no driver" path). Each library carries the
# SONAME of the real one, so a binary linked here loads the real driver and CUDA 13 libraries there.
set -euo pipefail
out=$1; shift
mkdir -p "$out"
declare -A soname=([cuda]=libcuda.so.1 [cublas]=libcublas.so.13 [cublasLt]=libcublasLt.so.13 [curand]=libcurand.so.10 [nvrtc]=libnvrtc.so.13 [cudart]=libcudart.so.13 [nccl]=libnccl.so.2)
for l in "${!soname[@]}"; do : > "$out/$l.c"; done
if [ $# -gt 0 ]; then
  for s in $(for b in "$@"; do nm -D --undefined-only "$b"; done | awk '{print $2}' | sed 's/@.*//' | grep -E '^(cu[A-Z]|cuda[A-Z]|__cuda|nvrtc|cublas|curand|nccl)' | sort -u); do
    # __cuda*: the runtime's registration and launch hooks that nvcc-compiled objects (candle's
    # static kernels) call; as no-ops they let such a binary start without CUDA.
    case $s in __cuda*) l=cudart; r=0;; cuda[A-Z]*) l=cudart; r=35;; cublasLt*) l=cublasLt; r=1;; cublas*) l=cublas; r=1;; curand*) l=curand; r=203;; nvrtc*) l=nvrtc; r=1;; nccl*) l=nccl; r=1;; *) l=cuda; r=34;; esac
    echo "int $s(void){return $r;}" >> "$out/$l.c"
  done
fi
for l in "${!soname[@]}"; do
  cc -shared -fPIC -Wl,-soname,"${soname[$l]}" "$out/$l.c" -o "$out/lib$l.so"
  ln -sf "lib$l.so" "$out/${soname[$l]}"
done
