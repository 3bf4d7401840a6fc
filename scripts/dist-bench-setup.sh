# Sourced by the multi-process benchmarks (zero-stages.sh, overlap-ab.sh, zero3-cap.sh), from the
# repository root: `bin` is dist_bench (release, feature mpi), built first if missing; Open MPI
# may run as root; one thread per rank.
bin=target/release/examples/dist_bench
if [ ! -x "$bin" ]; then
    cargo build --release -p wick-train --features mpi --example dist_bench || exit 1
fi
if [ "$(id -u)" = 0 ]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi
export RAYON_NUM_THREADS=1
