#!/usr/bin/env bash
# Two dist_bench binaries side by side (issue 48's A/B measurements): 2 ranks × 1 thread, global
# batch 8, the binaries alternating run by run. Not part of CI: its output is recorded under
# benchmarks/ and summarised in BENCHMARKS.md.
#
#   scripts/dist-bench-ab.sh OLD NEW [MODELS] [ROUNDS] [STEPS] [-- FLAGS...]
#        (defaults: decoder-512,decoder-1024 3 5; FLAGS default: --zero 3)
#
# Prints one line per run (median step, time in MPI calls, packing, heap and resident peaks per
# rank), then the medians over rounds of each binary and their ratio.
set -euo pipefail
cd "$(dirname "$0")/.."
old=$1 new=$2
models=${3:-decoder-512,decoder-1024}
rounds=${4:-3}
steps=${5:-5}
shift $(($# < 5 ? $# : 5))
[ "${1:-}" = "--" ] && shift
flags=("$@")
[ ${#flags[@]} -eq 0 ] && flags=(--zero 3)
# shellcheck source=scripts/dist-bench-setup.sh
. scripts/dist-bench-setup.sh
out=$(mktemp)
trap 'rm -f "$out"' EXIT
echo "# dist_bench A/B: old $old, new $new; train --batch 8 --steps $steps --warmup 2 ${flags[*]}; mpirun -n 2 --oversubscribe --bind-to none, RAYON_NUM_THREADS=1; $(lscpu | sed -n 's/^Model name: *//p'); $(date -u)"
for round in $(seq 1 "$rounds"); do
    for model in ${models//,/ }; do
        for which in old new; do
            b=$old; [ "$which" = new ] && b=$new
            line=$(mpirun -n 2 --oversubscribe --bind-to none -x RAYON_NUM_THREADS "$b" train --model "$model" \
                --batch 8 --steps "$steps" --warmup 2 "${flags[@]}" | tail -1)
            echo "{\"round\": $round, \"which\": \"$which\", \"run\": $line}" >>"$out"
            python3 - "$(tail -1 "$out")" <<'PY'
import json, statistics, sys
r = json.loads(sys.argv[1])
run = r["run"]
pack = statistics.median([x["pack_ms"] for x in run["reduce"]]) if run["reduce"] else 0
print("round %d %s %s step %.1f comm %.1f pack %.1f heap %.1f rss %.1f" % (
    r["round"], run["model"], r["which"], statistics.median(run["ms"]), statistics.median(run["comm_ms"]), pack,
    max(run["heap_peak_mib"]), max(run["peak_rss_mib"])))
PY
        done
    done
done
python3 - "$out" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
print()
print("| model | old step (ms) | new step (ms) | new / old | old heap peak (MiB) | new heap peak (MiB) |")
print("|---|---|---|---|---|---|")
for model in dict.fromkeys(r["run"]["model"] for r in rows):
    def med(which, f):
        return statistics.median(f(r["run"]) for r in rows if r["which"] == which and r["run"]["model"] == model)
    step = lambda run: statistics.median(run["ms"])
    heap = lambda run: max(run["heap_peak_mib"])
    o, n = med("old", step), med("new", step)
    print(f"| {model} | {o:.0f} | {n:.0f} | {n / o:.3f} | {med('old', heap):.1f} | {med('new', heap):.1f} |")
PY
