#!/usr/bin/env bash
# `wick train --device cuda --cuda-graph` on a GPU (issue 47; run by scripts/gpu-check.sh, about a
# minute), each comparison to the bit, for f32 (two micro-batches a step, clipped) and f16 (the
# loss scaler's skips decided on the device inside the graph):
#   1. replayed = eager: the run with every step after the third replayed from a CUDA graph, and
#      the same run with every step eager through the same device step (--graph-warmup past
#      --steps): the same loss at every step (metrics.jsonl) and the same final masters and
#      parameters (final.json's SHA-256 of each);
#   2. exact resume with graphs on: the graph run again, its checkpoints after step 10 removed,
#      resumed (warm-up and capture again) to the end: the same as the uninterrupted run of 1;
#   3. the time per step (metrics' ms, the median of steps 6 on) of the graph run, the eager device
#      step and the trainer without --cuda-graph (host-side masters), side by side in this run.
# Usage: graph-train-check.sh WICK_BINARY OUT_DIR. Exit status 1 when a comparison fails.
set -uo pipefail
wick=$1
out=$2
mkdir -p "$out"
status=0
steps=40
for precision in off f16; do
  common=(train --device cuda --precision "$precision" --steps "$steps" --save-every 10 --keep 4 --accumulate 2)
  [ "$precision" = off ] && common+=(--clip-grad-norm 1.0)
  run() { # run NAME ARGS...: a fresh run in $out/NAME
    local dir="$out/$precision-$1"
    shift
    rm -rf "$dir"
    timeout 120 "$wick" "${common[@]}" --dir "$dir" "$@" >"$dir.log" 2>&1 || {
      echo "!! $precision $dir failed: $(tail -3 "$dir.log")"
      status=1
    }
  }
  run graph --cuda-graph
  run eager --cuda-graph --graph-warmup 100000
  run host
  # The graph run again, resumed from its step-10 checkpoint.
  cp -r "$out/$precision-graph" "$out/$precision-resumed"
  rm -f "$out/$precision-resumed"/step-00000000{20,30,40}* "$out/$precision-resumed/final.json"
  timeout 120 "$wick" "${common[@]}" --dir "$out/$precision-resumed" --cuda-graph --resume \
    >"$out/$precision-resumed.log" 2>&1 || { echo "!! $precision resume failed"; status=1; }
  grep -h "CUDA graph" "$out/$precision-graph.log" "$out/$precision-resumed.log" | sed "s/^/   $precision: /"
  python3 - "$out" "$precision" "$steps" <<'EOF' || status=1
import json, statistics, sys
out, precision, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
def load(name):
    d = f"{out}/{precision}-{name}"
    try:
        rows = [json.loads(l) for l in open(f"{d}/metrics.jsonl")]
        final = json.load(open(f"{d}/final.json"))
    except OSError as e:
        print(f"!! {precision} {name}: {e}")
        return None
    return rows, final
runs = {n: load(n) for n in ("graph", "eager", "resumed", "host")}
ok = True
def same(a, b, what):
    global ok
    ra, rb = runs[a], runs[b]
    if ra is None or rb is None:
        ok = False
        return
    la = [(r["step"], r["loss"]) for r in ra[0]]
    lb = [(r["step"], r["loss"]) for r in rb[0]]
    steps_ok = [s for s, _ in la] == list(range(1, steps + 1)) and [s for s, _ in lb] == list(range(1, steps + 1))
    losses = la == lb
    digests = all(ra[1][k] == rb[1][k] for k in ("masters_sha256", "params_sha256"))
    verdict = "identical" if steps_ok and losses and digests else "DIFFER"
    ok &= verdict == "identical"
    print(f"   {precision}: {what}: losses of {len(la)} steps and final masters/parameters {verdict}")
same("graph", "eager", "replayed vs eager device step")
same("graph", "resumed", "uninterrupted vs resumed at step 10 (graphs on)")
if runs["host"] and runs["graph"]:
    h, g = runs["host"][0], runs["graph"][0]
    diff = max(abs(a["loss"] - b["loss"]) for a, b in zip(h, g))
    print(f"   {precision}: host-side masters vs device step, largest loss difference over the run {diff:.3g}")
times = {}
for name in ("graph", "eager", "host"):
    if runs[name]:
        times[name] = statistics.median(r["ms"] for r in runs[name][0][5:])
if len(times) == 3:
    print(f"   {precision}: ms/step (median of steps 6-{steps}) graph {times['graph']:.2f} · eager device step "
          f"{times['eager']:.2f} · host masters {times['host']:.2f} · eager/graph {times['eager'] / times['graph']:.2f}x")
json.dump({"precision": precision, "ms": times, "ok": ok}, open(f"{out}/{precision}-summary.json", "w"))
sys.exit(0 if ok else 1)
EOF
done
exit $status
