#!/usr/bin/env bash
# The long tests: the benchmark-sized validations kept out of `cargo test --workspace` so that the
# README's test command stays within minutes. CI (`.ci/run`) runs them on every change, right after
# that command and in the same target folder, so nothing is compiled twice:
#  1. the `#[ignore]`d tests and the fuzz suite's full run (`--ignored`): the estimator's
#     validation sweep (every model family, every mode, measured), the project built outside the
#     workspace from the README's lines, 10 000 mutations per parser;
#  2. several processes under a real mpirun (2 ranks x 1 thread): the multi-rank equivalences at
#     every ZeRO stage and precision, sharded checkpoints at any world size, per-rank peaks against
#     the estimate, `wick train --ranks 2` with ranks killed at random moments. These tests and
#     the programs they start need the `mpi` feature: built once here, the rank program
#     (`dist_ranks`) by `cargo build`, the tests and their `wick` by `cargo test`, no build inside a
#     test.
# Both run in the dev profile the tests use, where every crate that runs a model (wick-nn,
# wick-train, wick-kernels, wick-zoo, wick-memory and all dependencies) is compiled at
# opt-level 3 as in release, debug assertions kept: a release build would compile the whole
# dependency tree a second time (about the test build's 399 s, BENCHMARKS.md "Build and test
# times"; the sweep itself was not timed in release).
# Without mpirun or mpicc, part 2 is skipped with a line saying so, or fails where
# WICK_REQUIRE_MPI is set (as CI sets it); without libclang its build fails.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)

echo "-- long tests 1/2: the ignored tests and the full fuzz run"
cargo test --workspace -- --ignored
part1=$(($(date +%s) - start))

echo "-- long tests 2/2: several processes under mpirun (feature mpi)"
if command -v mpirun >/dev/null && command -v mpicc >/dev/null; then
    # As root Open MPI asks for both variables before it starts ranks.
    if [ "$(id -u)" = 0 ]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi
    # `--workspace`: the same feature unification as the default build, so only what the feature
    # changes is compiled again (wick-train, wick-cli, mpi's bindings). The rank program first:
    # `cargo test --example` would build it as a test harness, not as the program.
    mpi=(--workspace --features wick-train/mpi,wick-cli/mpi)
    cargo build "${mpi[@]}" --example dist_ranks
    cargo test "${mpi[@]}" --test multi_rank --test ranks
else
    if [ -n "${WICK_REQUIRE_MPI:-}" ]; then
        echo "!! WICK_REQUIRE_MPI is set and MPI is missing (mpirun, mpicc)"; exit 1
    fi
    echo "SKIPPED: the multi-process tests need MPI and libclang: apt-get install openmpi-bin libopenmpi-dev libclang-dev"
fi
echo "-- long tests: $part1 s ignored tests and fuzz, $(($(date +%s) - start - part1)) s several processes"
