//! The launch figures of wick's CUDA kernels that the host must know: a multi-tensor launch's
//! table of tensors passed by value ([`Table`], [`tables`], [`table_capacity`]: `src/cuda/table.cuh`),
//! and, below, attention's.
//!
//! The launch figures of attention's CUDA kernels (`src/cuda/nn_attention.cu`, on CUDA cores, and
//! `nn_attention_tc.cu`, on tensor cores): the rows a block takes and each kernel's dynamic shared
//! memory, computed from the kernels' tile layouts without CUDA. wick-nn's launcher
//! (`native::cuda::attention_plan`) launches with these; the emulator's check
//! (`emu/check_attention.cpp`) computes the same figures for its launches, under AddressSanitizer,
//! and holds them to the same table as this module's test
//! (`shared_memory_matches_the_emulators_table`), so the two cannot drift apart unnoticed.

/// The bytes a multi-tensor launch's table of tensors takes at most in the kernel's parameters
/// (`cuda/table.cuh`'s `WICK_TABLE_BUDGET`, which a test reads from there): CUDA's 4 KiB of
/// parameters less room for the launch's other arguments.
pub const TABLE_BUDGET: usize = 3840;

/// The tensors a table of `k` device addresses a tensor holds (`WICK_TABLE_CAPACITY(k)`): each
/// tensor takes its `k` addresses and its length, eight bytes each. More tensors take more
/// launches.
pub const fn table_capacity(k: usize) -> usize {
    TABLE_BUDGET / (8 * (k + 1))
}

/// The one-address tables' capacity (unscale, clipping's squares).
pub const N1: usize = table_capacity(1);
/// SGD's: four addresses a tensor.
pub const N4: usize = table_capacity(4);
/// AdamW's: five addresses a tensor.
pub const N5: usize = table_capacity(5);

/// A multi-tensor launch's tensors as the kernel's parameter takes them by value (`table.cuh`'s
/// `WickTable<K>`, P = K·N): `count` tensors' K device addresses each, then their lengths.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Table<const P: usize, const N: usize> {
    /// Tensor t's addresses at `ptrs[t·K..(t + 1)·K]`.
    pub ptrs: [u64; P],
    /// Tensor t's length.
    pub lens: [i64; N],
    /// The tensors in this table.
    pub count: i32,
}

/// The tables of `tensors` (each one's K = P / N addresses and its length), in order, N a table
/// (the last one holds the rest): one launch each. A tensor with another number of addresses is
/// an error.
pub fn tables<const P: usize, const N: usize>(tensors: &[(Vec<u64>, i64)]) -> Result<Vec<Table<P, N>>, String> {
    let k = P / N;
    if N == 0 || k * N != P {
        return Err(format!("a table of {P} addresses for {N} tensors"));
    }
    tensors
        .chunks(N)
        .map(|chunk| {
            let mut t = Table { ptrs: [0; P], lens: [0; N], count: chunk.len() as i32 };
            for (i, (ptrs, len)) in chunk.iter().enumerate() {
                if ptrs.len() != k {
                    return Err(format!("a table of {k} addresses a tensor was given {}", ptrs.len()));
                }
                t.ptrs[i * k..(i + 1) * k].copy_from_slice(ptrs);
                t.lens[i] = *len;
            }
            Ok(t)
        })
        .collect()
}

/// The three launches of attention's passes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttentionKernel {
    /// Forward: the output and each query row's log-sum-exp.
    Forward,
    /// dq, and each query row's D = dO·o.
    Dq,
    /// dk and dv.
    DkDv,
}

/// Which of the two kernel files runs, and in which compute type.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttentionCores {
    /// The CUDA-core kernels, computing in f32 (f32, f16 and bf16 tensors).
    CudaF32,
    /// The CUDA-core kernels, computing in f64 (f64 tensors).
    CudaF64,
    /// The tensor-core kernels (f16 and bf16 tensors, two bytes an element).
    Tensor,
}

/// Rows a block takes: tensor cores 4 warps of 16; CUDA cores 4 warps of 8 (of 4 in f64, whose
/// values take twice the registers).
pub fn attention_block_rows(cores: AttentionCores) -> usize {
    match cores {
        AttentionCores::Tensor => 64,
        AttentionCores::CudaF64 => 16,
        AttentionCores::CudaF32 => 32,
    }
}

/// The dynamic shared memory, in bytes, a block of `kernel` uses at head dimension `d`.
///
/// CUDA cores (the compute type's values): the block's rows by d, 32 rows by d + 1 (padded: 32
/// lanes, 32 banks), probabilities of the block's rows by 32; dq twice the first two, dk/dv also
/// twice the probabilities, plus its query tile's log-sum-exps, D (compute type) and ends (i32).
/// Tensor cores (d padded to d16, a multiple of 16; ld = d16 + 8 and ldo = d16 + 4 elements, whole
/// 16 bytes): tiles of 64 rows by ld in the storage type (three forward, four backward), per warp
/// one f32 score tile 16 × 68 (two backward), one probability tile 16 × 72 in the storage type
/// (two in dk/dv) and forward's f32 output rows 16 × ldo; dk/dv's 64 log-sum-exps, D (f32) and
/// ends (i32).
pub fn attention_shared_bytes(cores: AttentionCores, kernel: AttentionKernel, d: usize) -> usize {
    use AttentionKernel::*;
    match cores {
        AttentionCores::Tensor => {
            let (e, d16) = (2, d.div_ceil(16) * 16);
            let (ld, ldo) = (d16 + 8, d16 + 4);
            match kernel {
                Forward => 3 * 64 * ld * e + 4 * 16 * 68 * 4 + 4 * 16 * ldo * 4 + 4 * 16 * 72 * e,
                Dq => 4 * 64 * ld * e + 4 * 32 * 68 * 4 + 4 * 16 * 72 * e,
                DkDv => 4 * 64 * ld * e + 4 * 32 * 68 * 4 + 2 * 4 * 16 * 72 * e + 64 * 4 * 2 + 64 * 4,
            }
        }
        AttentionCores::CudaF32 | AttentionCores::CudaF64 => {
            let size = if cores == AttentionCores::CudaF64 { 8 } else { 4 };
            let (rows, kd) = (attention_block_rows(cores), d + 1);
            match kernel {
                Forward => (rows * d + 32 * kd + rows * 32) * size,
                Dq => (2 * rows * d + 2 * 32 * kd + rows * 32) * size,
                DkDv => (2 * rows * d + 2 * 32 * kd + 2 * rows * 32 + 64) * size + 32 * 4,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The budget is the kernels' (read from table.cuh), and the capacities are what its macro
    /// gives: 240 addresses for one a tensor (unscale, squares), 96 tensors for SGD, 80 for AdamW.
    #[test]
    fn table_capacity_is_the_kernels() {
        let header = include_str!("cuda/table.cuh");
        let budget: usize = header
            .lines()
            .find_map(|l| l.strip_prefix("#define WICK_TABLE_BUDGET "))
            .and_then(|v| v.trim().parse().ok())
            .expect("table.cuh defines WICK_TABLE_BUDGET");
        assert_eq!(budget, TABLE_BUDGET);
        assert!(header.contains("#define WICK_TABLE_CAPACITY(K) (WICK_TABLE_BUDGET / (8 * ((K) + 1)))"));
        assert_eq!((table_capacity(1), table_capacity(4), table_capacity(5)), (240, 96, 80));
    }

    /// 82 tensors of five addresses make a full table of 80 and one of 2, every address and
    /// length where the kernel reads it; a tensor with four addresses is refused; none, no table.
    #[test]
    fn tables_hold_each_tensor_where_the_kernel_reads_it() {
        let tensors: Vec<(Vec<u64>, i64)> =
            (0..82u64).map(|t| ((0..5).map(|j| 1000 * t + j).collect(), 7 + t as i64)).collect();
        let list: Vec<Table<{ 5 * N5 }, N5>> = tables(&tensors).unwrap();
        assert_eq!(list.iter().map(|t| t.count).collect::<Vec<_>>(), vec![80, 2]);
        for (t, (ptrs, len)) in tensors.iter().enumerate() {
            let (table, i) = (&list[t / N5], t % N5);
            assert_eq!(&table.ptrs[5 * i..5 * i + 5], &ptrs[..], "tensor {t}");
            assert_eq!(table.lens[i], *len, "tensor {t}");
        }
        assert!(list[1].ptrs[10..].iter().all(|&p| p == 0) && list[1].lens[2..].iter().all(|&n| n == 0));
        let bad = vec![(vec![1, 2, 3, 4], 3i64)];
        assert!(tables::<{ 5 * N5 }, N5>(&bad).unwrap_err().contains("given 4"));
        assert!(tables::<N1, N1>(&[]).unwrap().is_empty());
        assert_eq!(std::mem::size_of::<Table<{ 5 * N5 }, N5>>(), 8 * 6 * N5 + 8);
    }

    /// The table `emu/check_attention.cpp` holds its own figures to (`shared_table`): the same
    /// bytes for the same kernels, computed twice, in Rust here and in C++ there.
    pub(super) const TABLE: [(AttentionCores, AttentionKernel, usize, usize); 9] = [
        (AttentionCores::CudaF32, AttentionKernel::Forward, 64, 20608),
        (AttentionCores::CudaF32, AttentionKernel::Dq, 100, 55552),
        (AttentionCores::CudaF32, AttentionKernel::DkDv, 64, 41600),
        (AttentionCores::CudaF64, AttentionKernel::Dq, 64, 53760),
        (AttentionCores::CudaF64, AttentionKernel::DkDv, 128, 107648),
        (AttentionCores::Tensor, AttentionKernel::Forward, 64, 71680),
        (AttentionCores::Tensor, AttentionKernel::Dq, 64, 80896),
        (AttentionCores::Tensor, AttentionKernel::DkDv, 128, 123648),
        (AttentionCores::Tensor, AttentionKernel::Forward, 100, 102400),
    ];

    #[test]
    fn shared_memory_matches_the_emulators_table() {
        for (cores, kernel, d, bytes) in TABLE {
            assert_eq!(attention_shared_bytes(cores, kernel, d), bytes, "{cores:?} {kernel:?} d {d}");
        }
    }

    #[test]
    fn blocks_take_whole_warps_of_rows() {
        assert_eq!(attention_block_rows(AttentionCores::Tensor), 4 * 16);
        assert_eq!(attention_block_rows(AttentionCores::CudaF32), 4 * 8);
        assert_eq!(attention_block_rows(AttentionCores::CudaF64), 4 * 4);
    }
}
