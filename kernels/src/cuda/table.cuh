// A multi-tensor launch's tensors, passed by value in the kernel's parameters (PyTorch's
// MultiTensorApply arrangement): nothing is uploaded before a launch, so an eager step makes no
// host-to-device copy for its lists, and a launch captured in a CUDA graph replays exactly as it
// was made. Tensor t's K addresses are ptrs[t·K + j], its length lens[t]; `count` tensors of at
// most N. N is the most that keeps the table within WICK_TABLE_BUDGET bytes, leaving room in
// CUDA's 4 KiB of kernel parameters for the launch's other arguments; more tensors take more
// launches (wick_kernels::launch::table_capacity states the same rule, and a Rust test reads the
// budget from this file).
#pragma once

#define WICK_TABLE_BUDGET 3840

// The tensors a table of K addresses a tensor holds at most.
#define WICK_TABLE_CAPACITY(K) (WICK_TABLE_BUDGET / (8 * ((K) + 1)))

template <int K>
struct WickTable {
    long long ptrs[K * WICK_TABLE_CAPACITY(K)];
    long long lens[WICK_TABLE_CAPACITY(K)];
    int count;
};

// K + 1 eight-byte values a tensor and the count padded to eight bytes (wick-train's launcher
// asserts the same sizes), within the budget.
static_assert(sizeof(WickTable<1>) == 8 * 2 * WICK_TABLE_CAPACITY(1) + 8, "the launcher's layout");
static_assert(sizeof(WickTable<4>) == 8 * 5 * WICK_TABLE_CAPACITY(4) + 8, "the launcher's layout");
static_assert(sizeof(WickTable<5>) == 8 * 6 * WICK_TABLE_CAPACITY(5) + 8, "the launcher's layout");
static_assert(sizeof(WickTable<5>) <= WICK_TABLE_BUDGET + 8, "a table stays within its budget");
