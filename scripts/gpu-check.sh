#!/usr/bin/env bash
# Every GPU check and benchmark in one call (well under 8 minutes on one H200; sections after
# WICK_GPU_BUDGET_S, default 420 s, are skipped or shortened, and the run ends at WICK_GPU_HARD_S,
# default 500 s, with what ran packed):
#   - the allocator conformance suite on the CUDA backend;
#   - candle allocations drawn from wick's pool, the cap enforced, candle OOM -> typed error;
#   - the CUDA memory history of labelled candle tensors (CUPTI), with its memory_viz pickle and HTML;
#   - an alloc-heavy candle loop on the default pool vs wick's pool;
#   - allocation traces through wick's CUDA allocator vs raw cuMemAllocAsync vs PyTorch;
#   - the fused AMP kernels (kernels/src/cuda/*.cu) against their CPU references;
#   - wick-nn's CUDA op bodies (activations, norms, batch norm, attention, RoPE, cross-entropy,
#     embeddings, pooling, and the convolutions through cuDNN) against their host bodies, that a
#     GPU pass goes through them, and each beside the composed candle ops it replaces; attention
#     alone beside PyTorch's scaled_dot_product_attention at the zoo's shapes (f32; bf16 on
#     tensor cores and on the CUDA-core kernels);
#   - the fused device step with gradient clipping against the host's clipped step;
#   - the AMP training example on CUDA (f16 with loss scaling, then bf16 clipped), through the fused
#     device step (built with candle's real kernels, the default of scripts/build-gpu-binaries.sh);
#   - a candle-transformers LLaMA under a CUDA engine: its forward time, and out-of-memory as an
#     error both at loading (pre-flight) and in the forward pass (the pool's cap);
#   - a one-rank NCCL communicator: all-reduce of CUDA tensors against the input, and its time; the
#     trainer data-parallel over it, eagerly and as CUDA graphs (the collectives inside the graph),
#     against the trainer alone to the bit;
#   - the zoo's CNNs at 224², batch 32 (f32 train, bf16 AMP train, eval) beside PyTorch on the same
#     GPU: step time, peak allocated memory, and wick's estimator's figure for the same step
#     (benchmarks/zoo-estimates-cuda.json, made on the CPU by scripts/zoo_estimates.py);
#   - a zoo training step (two, from the same seeded model and batch) and an eval pass on the GPU
#     against the same on the CPU, every model, f32 and bf16 AMP (zoo-speed --against-cpu);
#   - which ops of each zoo model's step still run as candle's composition on the GPU (the
#     per-op counts of WICK_PROFILE_OPS: a composed node reports as `NAME (composed)`);
#   - training steps captured as CUDA graphs (zoo-speed --cuda-graph --check-graph: replayed steps
#     against eager ones to the bit, the graph's memory given back; `wick train --cuda-graph`:
#     replayed = eager and exact resume with graphs on, scripts/graph-train-check.sh), and their
#     time beside the eager fused step, PyTorch eager and torch.compile(mode="reduce-overhead")
#     (graph_speed.py);
#   - the zoo's transformers (MiniLM, ViT-S/16, the decoder) at zoo-speed's sizes beside PyTorch,
#     then, while the time budget lasts, at issue 46's sizes (the 12 x 768 decoder by --set).
# Nsight Compute's per-kernel profile of ResNet-18 runs only with WICK_GPU_NCU=1 (2-3 minutes).
# The Rust binaries are built on a machine without a GPU by scripts/build-gpu-binaries.sh into
# .devbuild/ (this machine may have no Rust toolchain), and packed, stripped, into
# .devpack/gpu-binaries.tar.xz (about 11 MB: what travels to a lent GPU machine, whose working
# tree may carry 64 MiB; the device tool's call names `.devpack` in `carry`). Without .devbuild/
# the pack is unpacked here. The real driver and the CUDA 13 libraries of PyTorch's wheels are
# found here and put on the loader path under the names the binaries need.
# Everything it writes (each step's output, the console) is packed at the end into one file,
# $OUT/gpu-check-results.tar.gz (the device tool returns at most 8 files).
set -uo pipefail
cd "$(dirname "$0")/.."
# Each section's start, in seconds since the script began (the whole must stay under 8 minutes).
section() { echo "== [${SECONDS}s] $*"; }
# True while the run is inside its time budget (seconds; the device call's limit is 600).
in_budget() { [ "$SECONDS" -lt "${WICK_GPU_BUDGET_S:-420}" ]; }
bin=${WICK_GPU_BIN:-.devbuild}
if [ ! -x "$bin/gpu-check" ] && [ -f .devpack/gpu-binaries.tar.xz ]; then
  unpacked=$(mktemp -d)
  # Python's tarfile and lzma: no xz program needed there.
  python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])' \
    .devpack/gpu-binaries.tar.xz "$unpacked" || { echo "!! cannot unpack .devpack/gpu-binaries.tar.xz"; exit 1; }
  bin="$unpacked/$(ls "$unpacked" | head -1)"
  section "binaries unpacked from .devpack/gpu-binaries.tar.xz: $(ls "$bin" | tr '\n' ' ')"
fi
final=${OUT:-/tmp}
out=$(mktemp -d)
exec > >(tee "$out/console.txt") 2>&1
tee_pid=$!
pack_results() {
  section "results: $final/gpu-check-results.tar.gz"
  exec 1>&- 2>&-
  wait "$tee_pid" 2>/dev/null
  tar -czf "$final/gpu-check-results.tar.gz" -C "$out" .
}
trap pack_results EXIT
# The hard stop: the device call is killed at its own limit (540-600 s), and a killed script packs
# nothing. At WICK_GPU_HARD_S (default 500) the watchdog ends whatever step runs (the script's
# children but the console's tee) and the script exits through the trap above, so what ran so far
# comes back. (bash runs a TERM trap only once the foreground command has ended: hence the kill.)
hard=${WICK_GPU_HARD_S:-500}
trap 'echo "!! stopped at ${SECONDS}s by the hard limit of ${hard}s (WICK_GPU_HARD_S): the steps after this did not run"; exit 124' TERM
(
  sleep "$hard"
  for p in $(pgrep -P $$); do
    [ "$p" != "$tee_pid" ] && [ "$p" != "$BASHPID" ] && kill -TERM "$p" 2>/dev/null
  done
  kill -TERM $$ 2>/dev/null
) &
watchdog=$!
libs=$(mktemp -d)
link() { # link NAME: find the real library NAME.* and expose it as NAME
  local found
  found=$( (ldconfig -p 2>/dev/null | awk -v n="$1" '$1 ~ "^"n {print $NF}'; \
            find /usr/local/nvidia /usr/lib/x86_64-linux-gnu /usr/local/cuda* \
                 "$(python3 -c 'import nvidia,os;print(os.path.dirname(nvidia.__path__[0]) + "/nvidia")' 2>/dev/null)" \
                 -name "$1*" 2>/dev/null) | grep -v stub | head -1)
  [ -n "$found" ] && ln -sf "$found" "$libs/$2" && echo "  $2 -> $found"
}
section "libraries"
link libcuda.so libcuda.so.1
link libcublas.so libcublas.so.13
link libcublasLt.so libcublasLt.so.13
link libcurand.so libcurand.so.10
link libnvrtc.so libnvrtc.so.13
link libcudart.so libcudart.so.13
# NCCL for the one-rank communicator check (PyTorch's wheels carry nvidia-nccl).
link libnccl.so libnccl.so.2
# CUPTI for the CUDA memory history (PyTorch's wheels carry one; wick opens it at run time).
link libcupti.so libcupti.so && export WICK_CUPTI="$libs/libcupti.so"
# cuDNN for the convolutions (PyTorch's nvidia-cudnn wheel; wick opens it at run time). Its real
# path, not a link: the wheel's front library finds its sub-libraries beside itself ($ORIGIN).
cudnn=$(python3 -c 'import nvidia.cudnn, os; print(os.path.join(nvidia.cudnn.__path__[0], "lib", "libcudnn.so.9"))' 2>/dev/null)
[ -f "$cudnn" ] || cudnn=$(ldconfig -p 2>/dev/null | awk '$1 ~ /^libcudnn.so.9/ {print $NF}' | head -1)
if [ -n "$cudnn" ] && [ -f "$cudnn" ]; then
  export WICK_CUDNN="$cudnn"
  echo "  cuDNN -> $cudnn"
else
  echo "!! no cuDNN found: wick's GPU convolutions will say so"
fi
export LD_LIBRARY_PATH="$libs:${LD_LIBRARY_PATH:-}"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
date -u

status=0
section "candle governance, alloc-heavy loop, trace replay"
"$bin/gpu-check" 2>&1 | tee "$out/gpu-check.txt" || status=1
section "PyTorch side by side"
python3 scripts/gpu_check_torch.py crates/wick-trace/traces/transformer-train.json \
  crates/wick-trace/traces/inference-server.json 2>&1 | tee "$out/gpu-check-torch.txt" || status=1
echo "   (PyTorch with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True)"
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python3 scripts/gpu_check_torch.py \
  crates/wick-trace/traces/transformer-train.json crates/wick-trace/traces/inference-server.json 2>&1 \
  | tee -a "$out/gpu-check-torch.txt" || status=1
section "AMP kernels against their CPU references"
timeout 120 "$bin/amp-gpu-check" 2>&1 | tee "$out/gpu-amp-kernels.txt"
[ "${PIPESTATUS[0]}" = 0 ] || status=1
section "wick-nn's CUDA op bodies against their host bodies, and beside the composed ops"
if [ -x "$bin/nn-gpu-check" ]; then
  timeout 180 "$bin/nn-gpu-check" 2>&1 | tee "$out/gpu-nn-ops.txt"
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
  WICK_CUDNN=/nonexistent/libcudnn.so.9 timeout 30 "$bin/nn-gpu-check" --expect-no-cudnn 2>&1 | tee -a "$out/gpu-nn-ops.txt"
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
  timeout 60 "$bin/nn-gpu-check" --capped-oom 2>&1 | tee -a "$out/gpu-nn-ops.txt"
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
  section "attention alone beside PyTorch's scaled_dot_product_attention (f32, bf16 on tensor and CUDA cores)"
  (PYTHONUNBUFFERED=1 timeout 150 python3 scripts/torch-reference/attention_speed.py --wick "$bin/nn-gpu-check" \
    --rounds 2) 2>&1 | tee "$out/gpu-attention-speed.txt"
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
else
  echo "!! SKIPPED: $bin/nn-gpu-check not built (scripts/build-gpu-binaries.sh with WICK_CANDLE_NVCC=fake leaves it out)"
fi
section "AMP training example on CUDA"
if [ -x "$bin/train-amp" ]; then
  # bf16 also clips its gradients (the fused step with the norm's coefficient, no scaler).
  for precision in f16 bf16; do
    clip=(); [ $precision = bf16 ] && clip=(--clip-grad-norm 1.0)
    timeout 90 "$bin/train-amp" --device cuda --precision $precision --steps 100 --batch 32 --seq 128 ${clip[@]+"${clip[@]}"} \
      --report "$out/gpu-train-amp-$precision.html" 2>&1 | tee "$out/gpu-train-amp-$precision.txt"
    [ "${PIPESTATUS[0]}" = 0 ] || status=1
  done
  # The main job with each step after the first as a CUDA graph (f16: the scaler's skips on the
  # device inside the graph), each batch copied into the graph's input (issue 47).
  timeout 90 "$bin/train-amp" --device cuda --precision f16 --steps 100 --batch 32 --seq 128 --cuda-graph 2>&1 \
    | tee "$out/gpu-train-amp-graph.txt"
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
else
  echo "!! SKIPPED: $bin/train-amp not built (scripts/build-gpu-binaries.sh with WICK_CANDLE_NVCC=fake leaves it out)"
fi
section "a candle-transformers model (LLaMA 8x512, vocab 32k) under a CUDA engine (issue 31)"
if [ -x "$bin/byo-model" ]; then
  byo=$(mktemp -d)
  "$bin/byo-model" --model llama --prepare "$byo"
  timeout 120 "$bin/byo-model" --model llama --dir "$byo" --device cuda --batch 4 --seq 256 --steps 5 2>&1 \
    | tee "$out/gpu-byo.txt"
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
  # Capped below the weights (221 MiB in f32): refused by the pre-flight before loading. Capped
  # above them but below the forward pass (batch 8 x 512 tokens: the logits alone are 500 MiB):
  # loaded, then candle's CUDA out-of-memory as an error. Both must say so and exit non-zero.
  for case in "weights:--cap-mib 128" "forward:--cap-mib 260 --batch 8 --seq 512"; do
    where=${case%%:*}
    timeout 60 "$bin/byo-model" --model llama --dir "$byo" --device cuda ${case#*:} --steps 1 > "$out/gpu-byo-$where.txt" 2>&1
    [ $? != 0 ] || status=1
    grep -m1 'out of memory' "$out/gpu-byo-$where.txt" | cut -c1-400
    oom=$(grep -c 'out of memory, as an error' "$out/gpu-byo-$where.txt")
    at_weights=$(grep -c 'out of memory, as an error.*(weights ' "$out/gpu-byo-$where.txt")
    if [ "$where" = weights ]; then [ "$at_weights" -ge 1 ] || status=1; else [ "$oom" -ge 1 ] && [ "$at_weights" = 0 ] || status=1; fi
    echo "   capped ($where): out-of-memory errors $oom, at the weights' pre-flight $at_weights"
  done
  rm -rf "$byo"
else
  echo "!! SKIPPED: $bin/byo-model not built (scripts/build-gpu-binaries.sh with WICK_CANDLE_NVCC=fake leaves it out)"
fi
section "NCCL, one rank (a single GPU cannot host two ranks of a communicator)"
timeout 120 "$bin/nccl_check" 2>&1 | tail -30 | tee "$out/gpu-nccl.txt"
[ "${PIPESTATUS[0]}" = 0 ] || status=1
section "the zoo on the GPU beside PyTorch: step time, peak, the estimator (issue 30's sizes)"
if [ -x "$bin/zoo-speed" ]; then
  zoo=$(realpath "$bin/zoo-speed")
  estimates=$(realpath benchmarks/zoo-estimates-cuda.json)
  (cd scripts/torch-reference && PYTHONUNBUFFERED=1 timeout 300 python3 zoo_speed.py --wick "$zoo" --device cuda \
    --models resnet18,resnet50,mobilenet_v2 --modes train,amp,eval --image 224 --batches 32 \
    --rounds 2 --steps 5 --warmup 2 --estimates "$estimates" --json "$out/gpu-zoo.json") 2>&1 | tee "$out/gpu-zoo.txt"
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
  section "a zoo training step on the GPU against the same step on the CPU (two steps; eval: the outputs)"
  for model in resnet18 resnet50 mobilenet_v2 bert vit decoder; do
    for mode in train amp eval; do
      in_budget || { echo "   $model $mode: skipped, over the time budget"; continue; }
      timeout 60 "$bin/zoo-speed" --model $model --mode $mode --image 64 --batch 4 --seq 32 --against-cpu --device cuda \
        2>&1 | tail -1 | tee -a "$out/gpu-zoo-against-cpu.txt"
      [ "${PIPESTATUS[0]}" = 0 ] || status=1
    done
  done
  section "the ops of a zoo step that still run as candle's composition on the GPU (WICK_PROFILE_OPS counts)"
  for model in resnet18 resnet50 mobilenet_v2 bert vit decoder; do
    for mode in train amp; do
      in_budget || { echo "   $model $mode: skipped, over the time budget"; continue; }
      composed=$(WICK_PROFILE_OPS=1 timeout 60 "$bin/zoo-speed" --model $model --mode $mode --image 64 --batch 4 \
        --seq 32 --steps 1 --warmup 0 --device cuda 2>&1 | grep '(composed)' | awk '{print $1, $2, $4, $5}' | tr '\n' ';')
      echo "   $model $mode: ${composed:-none}" | tee -a "$out/gpu-zoo-composed.txt"
    done
  done
  section "the zoo's transformers on the GPU beside PyTorch (zoo-speed's sizes)"
  (cd scripts/torch-reference && PYTHONUNBUFFERED=1 timeout 150 python3 zoo_speed.py --wick "$zoo" --device cuda \
    --models bert,vit,decoder --modes train,eval --rounds 1 --steps 5 --json "$out/gpu-zoo-transformers.json") 2>&1 \
    | tee "$out/gpu-zoo-transformers.txt"
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
  section "training steps as CUDA graphs (issue 47): replayed vs eager to the bit, graph memory given back"
  for config in "bert train" "bert amp" "decoder train" "vit amp" "resnet18 train --image 64 --batch 8" \
    "bert eval" "resnet18 eval --image 64 --batch 8"; do
    in_budget || { echo "   $config: skipped, over the time budget" | tee -a "$out/gpu-graph-check.txt"; continue; }
    set -- $config
    model=$1 mode=$2
    shift 2
    timeout 90 "$bin/zoo-speed" --model "$model" --mode "$mode" "$@" --device cuda --cuda-graph --check-graph \
      --steps 4 --warmup 2 \
      2>&1 | tail -3 | tee -a "$out/gpu-graph-check.txt"
    [ "${PIPESTATUS[0]}" = 0 ] || status=1
  done
  # The trainer's graph path through `wick train --cuda-graph`: replayed = eager and exact resume.
  if [ -x "$bin/wick" ] && in_budget; then
    timeout 240 bash scripts/graph-train-check.sh "$bin/wick" "$out/graph-train" 2>&1 | tee "$out/gpu-graph-train.txt"
    [ "${PIPESTATUS[0]}" = 0 ] || status=1
  else
    echo "   wick train --cuda-graph: skipped ($bin/wick missing or over the time budget)" | tee "$out/gpu-graph-train.txt"
  fi
  if in_budget; then
    (cd scripts/torch-reference && PYTHONUNBUFFERED=1 timeout 150 python3 graph_speed.py --wick "$zoo" \
      --models bert,decoder --modes train --rounds 1 --steps 10 --warmup 3 --json "$out/gpu-graph-speed.json") 2>&1 \
      | tee "$out/gpu-graph-speed.txt"
  else
    echo "   graph_speed.py: skipped, over the time budget" | tee "$out/gpu-graph-speed.txt"
  fi
  # Inference as a graph (wick::cuda_graph::GraphForward) beside PyTorch's, while the budget lasts.
  if in_budget; then
    (cd scripts/torch-reference && PYTHONUNBUFFERED=1 timeout 100 python3 graph_speed.py --wick "$zoo" \
      --models bert,resnet18 --modes eval --rounds 1 --steps 10 --warmup 3 --json "$out/gpu-graph-speed-eval.json") \
      2>&1 | tee "$out/gpu-graph-speed-eval.txt"
  fi
  section "gradient clipping on the GPU: what it adds to a step, beside PyTorch's clip_grad_norm_"
  if in_budget; then
    (cd scripts/torch-reference && PYTHONUNBUFFERED=1 timeout 90 python3 clip_speed.py --wick "$zoo" --device cuda \
      --models decoder,resnet18 --rounds 1 --steps 5) 2>&1 | tee "$out/gpu-clip-speed.txt"
  else
    echo "   skipped, over the time budget" | tee "$out/gpu-clip-speed.txt"
  fi
  section "issue 46's transformer rows at its sizes beside PyTorch (while the time budget lasts)"
  # MiniLM and BERT-base at 128 tokens x 32, ViT-B/16 at 224^2 x 64, and a 12 x 768 decoder
  # (zoo-speed's decoder-512 widened by --set; SwiGLU 2 112, 2.75 x the width) at 512 tokens x 8.
  for row in "bert --seqs 128 --batches 32" "bert-base --seqs 128 --batches 32" "vit-b16 --image 224 --batches 64" \
      "decoder-512 --seqs 512 --batches 8 --set hidden_size=768 --set num_layers=12 --set num_heads=12 --set intermediate_size=2112"; do
    in_budget || { echo "   ${row%% *}: skipped, over the time budget" | tee -a "$out/gpu-issue46-rows.txt"; continue; }
    (cd scripts/torch-reference && PYTHONUNBUFFERED=1 timeout 90 python3 zoo_speed.py --wick "$zoo" --device cuda \
      --models $row --modes train,amp,eval --rounds 1 --steps 3 --warmup 2) 2>&1 | tee -a "$out/gpu-issue46-rows.txt"
    [ "${PIPESTATUS[0]}" = 0 ] || status=1
  done
  section "where the zoo's GPU step goes: phases, and each kernel's time under Nsight Compute"
  for config in "resnet18 train" "resnet18 amp" "resnet18 eval" "resnet50 train"; do
    in_budget || { echo "   $config: skipped, over the time budget"; continue; }
    set -- $config
    timeout 60 "$bin/zoo-speed" --model $1 --mode $2 --image 224 --batch 32 --steps 3 --warmup 2 --device cuda 2>&1 \
      | tail -1 | tee -a "$out/gpu-zoo-phases.txt"
  done
  if [ "${WICK_GPU_NCU:-0}" = 1 ] && command -v ncu >/dev/null; then
    # One metric (each kernel's duration): one replay pass per kernel. One step, no warm-up.
    for mode in eval train; do
      timeout 150 ncu --metrics gpu__time_duration.sum --print-summary per-kernel --csv \
        "$bin/zoo-speed" --model resnet18 --mode $mode --image 224 --batch 32 --steps 1 --warmup 0 --device cuda \
        > "$out/gpu-zoo-ncu-$mode.csv" 2>&1
      echo "   ncu resnet18 $mode: exit $?, $(wc -l < "$out/gpu-zoo-ncu-$mode.csv") lines"
    done
    python3 scripts/ncu_summary.py "$out/gpu-zoo-ncu-eval.csv" "$out/gpu-zoo-ncu-train.csv" | tee "$out/gpu-zoo-kernels.txt"
  else
    echo "   (no per-kernel profile: set WICK_GPU_NCU=1 with Nsight Compute installed)"
  fi
else
  echo "!! SKIPPED: $bin/zoo-speed not built (the zoo's GPU table and profile)"
fi
section "conformance suite on the CUDA backend"
in_budget || export WICK_CONFORMANCE_CASES=${WICK_CONFORMANCE_CASES:-1000}
WICK_CONFORMANCE_CASES=${WICK_CONFORMANCE_CASES:-10000} timeout 240 "$bin/conformance_cuda" --nocapture 2>&1 \
  | tail -20 | tee "$out/gpu-conformance.txt"
[ "${PIPESTATUS[0]}" = 0 ] || status=1
date -u
kill "$watchdog" 2>/dev/null
exit $status
