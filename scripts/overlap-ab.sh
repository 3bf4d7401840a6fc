#!/usr/bin/env bash
# The gradient reduction started from inside backward (the default) against after it, side by
# side (issue 48): 2 ranks × 1 thread of `dist_bench train`, the two alternating run by run, every
# configuration in every round. Not part of CI: a benchmark, its output recorded under
# benchmarks/ and its table in BENCHMARKS.md ("Overlap").
#
#   scripts/overlap-ab.sh [ROUNDS] [STEPS]      (defaults: 3 rounds, 6 timed steps)
#
# Rows: the main job's decoder (global batch 8, ZeRO-0/1/2), ResNet-18 at 224² (batch 8, ZeRO-0/2),
# the 58 M-parameter decoder over a 32 000-token vocabulary (batch 8, ZeRO-0/2). Per row and
# setting, medians over every timed step of every round: the step, the time in MPI calls, the
# time the step waited for the reduction after backward ("exposed") and its share of the step.
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-3}
steps=${2:-6}
# shellcheck source=scripts/dist-bench-setup.sh
. scripts/dist-bench-setup.sh
out=$(mktemp)
trap 'rm -f "$out"' EXIT
echo "# dist_bench train (release, feature mpi), mpirun -n 2 --oversubscribe --bind-to none, RAYON_NUM_THREADS=1; $(lscpu | sed -n 's/^Model name: *//p'); $(date -u)"
rows=("decoder 0" "decoder 1" "decoder 2" "resnet18 0" "resnet18 2" "decoder-512 0" "decoder-512 2")
for round in $(seq 1 "$rounds"); do
    for row in "${rows[@]}"; do
        read -r model zero <<<"$row"
        # Alternate which setting runs first.
        if [ $((round % 2)) = 1 ]; then settings=("" "--no-overlap"); else settings=("--no-overlap" ""); fi
        for setting in "${settings[@]}"; do
            echo "== round $round: 2 ranks $model batch 8 --zero $zero ${setting:-(overlap)}"
            # shellcheck disable=SC2086
            mpirun -n 2 --oversubscribe --bind-to none -x RAYON_NUM_THREADS "$bin" train --model "$model" \
                --batch 8 --image 224 --steps "$steps" --warmup 2 --zero "$zero" $setting | tail -1 | tee -a "$out"
        done
    done
done
python3 - "$out" <<'PY'
import json, statistics as st, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
groups = {}
for r in rows:
    groups.setdefault((r["model"], r["zero"], r["overlap"]), []).append(r)
print()
print("| model | ZeRO | reduction | step (ms) | in MPI calls (ms) | exposed after backward (ms) | exposed / step | buckets started in backward | in flight, not waited for |")
print("|---|---|---|---|---|---|---|---|---|")
seen = []
for (model, zero, overlap) in groups:
    if (model, zero) not in seen:
        seen.append((model, zero))
for model, zero in seen:
    for overlap in (False, True):
        rs = groups.get((model, zero, overlap), [])
        if not rs:
            continue
        ms = st.median([m for r in rs for m in r["ms"]])
        comm = st.median([m for r in rs for m in r["comm_ms"]])
        red = [x for r in rs for x in r["reduce"]]
        exposed = st.median([x["exposed_ms"] for x in red])
        hidden = st.median([x["hidden"] for x in red])
        started = f"{red[0]['overlapped']} of {red[0]['buckets']}"
        setting = "in backward" if overlap else "after backward"
        print(f"| {model} | {zero} | {setting} | {ms:.1f} | {comm:.1f} | {exposed:.1f} | {100 * exposed / ms:.1f} % | {started} | {100 * hidden:.0f} % |")
PY
