#!/usr/bin/env bash
# Two ranks of the 58 M- and 168 M-parameter decoders (vocabulary 32 000) at every ZeRO stage:
# each rank's step time, heap peak and resident peak (issue 48). Not part of CI: a benchmark,
# its output recorded under benchmarks/ and its table in BENCHMARKS.md ("ZeRO-3").
#
#   scripts/zero-stages.sh [MODELS] [STEPS]      (defaults: decoder-512,decoder-1024 3)
#
# The program is dist_bench (release, feature mpi), built first if missing; 2 ranks × 1 thread,
# global batch 8, two warm-up steps. Prints each run's JSON line, then the table.
set -euo pipefail
cd "$(dirname "$0")/.."
models=${1:-decoder-512,decoder-1024}
steps=${2:-3}
# shellcheck source=scripts/dist-bench-setup.sh
. scripts/dist-bench-setup.sh
out=$(mktemp)
trap 'rm -f "$out"' EXIT
echo "# dist_bench train (release, feature mpi), mpirun -n 2 --oversubscribe --bind-to none, RAYON_NUM_THREADS=1; $(lscpu | sed -n 's/^Model name: *//p'); $(date -u)"
for model in ${models//,/ }; do
    for flags in "--zero 0" "--zero 2" "--zero 2 --checkpointing" "--zero 3" "--zero 3 --no-recompute"; do
        echo "== 2 ranks $model batch 8 $flags"
        # shellcheck disable=SC2086
        mpirun -n 2 --oversubscribe --bind-to none -x RAYON_NUM_THREADS "$bin" train --model "$model" \
            --batch 8 --steps "$steps" --warmup 2 $flags | tail -1 | tee -a "$out"
    done
done
python3 - "$out" <<'EOF'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
print()
print("| model | stage | step (s) | step / replicated | heap peak per rank (MiB) | resident peak per rank (MiB) | reduction per step (s) |")
print("|---|---|---|---|---|---|---|")
base = {}
for r in rows:
    ms = statistics.median(r["ms"])
    if r["zero"] == 0:
        base[r["model"]] = ms
    stage = f"ZeRO-{r['zero']}" + (" + checkpointing" if r["checkpointing"] else "")
    stage += " without recomputation" if r["zero"] == 3 and not r.get("recompute", True) else ""
    print(f"| {r['model']} | {stage} | {ms / 1e3:.2f} | {ms / base[r['model']]:.2f} | {max(r['heap_peak_mib']):.0f} | "
          f"{max(r['peak_rss_mib']):.0f} | {statistics.median(r['comm_ms']) / 1e3:.2f} |")
EOF
