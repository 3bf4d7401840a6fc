#!/usr/bin/env bash
# A model that cannot train in one process under a memory cap, training under ZeRO-3 on two
# ranks with the same cap per rank (issue 48). Each process runs in a memory cgroup of its own
# (cgroup v1 `memory.limit_in_bytes` or v2 `memory.max`, created here: needs root and a
# writable cgroup tree). Not part of CI: a benchmark, its output recorded under benchmarks/.
#
#   scripts/zero3-cap.sh [CAP_MIB] [MODEL]      (defaults: 3072 decoder-1024)
#
# The program is dist_bench (release, feature mpi), built first if missing. One process takes
# the global batch of 8 alone; the two ranks take 4 each. What each run printed, and how it
# ended, goes to stdout.
set -uo pipefail
cd "$(dirname "$0")/.."
cap_mib=${1:-3072}
model=${2:-decoder-1024}
# shellcheck source=scripts/dist-bench-setup.sh
. scripts/dist-bench-setup.sh
# A refusal's backtrace, when asked for, is resolved from the binary's debug information at
# exit: hundreds of MiB a capped process at its limit does not have (the kernel then ends it
# after the typed error was printed). The run shows what a user without RUST_BACKTRACE sees.
unset RUST_BACKTRACE RUST_LIB_BACKTRACE
cap=$((cap_mib * 1024 * 1024))

# A command line that moves the shell into cgroup NAME capped at $cap, then runs the rest.
if [ -w /sys/fs/cgroup/memory ]; then
    root=/sys/fs/cgroup/memory
    enter='d=$0/$1${OMPI_COMM_WORLD_RANK:-}; mkdir -p $d && echo $2 > $d/memory.limit_in_bytes && { echo $2 > $d/memory.memsw.limit_in_bytes 2>/dev/null; true; } && echo $$ > $d/cgroup.procs && shift 2 && exec "$@"'
elif [ -w /sys/fs/cgroup/cgroup.procs ]; then
    root=/sys/fs/cgroup
    enter='d=$0/$1${OMPI_COMM_WORLD_RANK:-}; mkdir -p $d && echo $2 > $d/memory.max && { echo 0 > $d/memory.swap.max 2>/dev/null; true; } && echo $$ > $d/cgroup.procs && shift 2 && exec "$@"'
else
    echo "SKIPPED: no writable memory cgroup tree here"; exit 0
fi

echo "# $(date -u) · $(lscpu | sed -n 's/^Model name: *//p') · cap $cap_mib MiB per process · $model, global batch 8"
echo "== one process, batch 8, no sharding, capped"
sh -c "$enter" "$root" wick-cap-one "$cap" "$bin" train --model "$model" --batch 8 --steps 2 --warmup 1 2>&1 | tail -5
echo "exit status ${PIPESTATUS[0]}"
echo "== two ranks, ZeRO-3, batch 4 each, each rank capped"
mpirun -n 2 --oversubscribe --bind-to none -x RAYON_NUM_THREADS \
    sh -c "$enter" "$root" wick-cap-rank "$cap" \
    "$bin" train --model "$model" --batch 8 --steps 2 --warmup 1 --zero 3 2>&1 | tail -5
echo "exit status ${PIPESTATUS[0]}"
rmdir "$root"/wick-cap-one "$root"/wick-cap-rank* 2>/dev/null
true
