//! Matrix products over slices, with the dimensions and strides checked against the slices
//! before any pointer is formed: f32 and f64 through the `gemm` crate (the crate candle's CPU
//! matmul uses, with its AVX-512 kernels; products of a few rows along the depth on wick's own,
//! `along_k_f32`; `staged` copies a layer's weight to the crate a block at a time, or, up to 256
//! rows on CPUs with AVX2 but not AVX-512, multiplies it on wick's own tiles, `tiles_f32`; from 80
//! to 160 rows on AVX-512, `transposed` computes the product's transpose with W read in place),
//! bf16 × bf16 with f32 sums on CPUs with AVX512-BF16 ([`bf16`], on AMX's tile unit where there
//! is one). The modules form a tree: `blocking` (the matrix view and the bf16 blocking) and
//! `switch` (a path's on/off switch) are leaves; `transpose` (register transpositions) and `amx`
//! use `blocking`; `pack` uses `blocking` and `transpose`; `operand` (packed and row-wise
//! operands) uses `blocking` and `pack`; `along_k` and `along_k_f32` (bf16 and f32 products whose
//! operands both lie along the depth, in place) use `blocking`; `tiles_f32` uses `blocking`,
//! `pack`, `transpose` and `switch`, `transposed` `blocking`, `transpose` and `switch`;
//! [`bf16`] uses them all and chooses the unit and the kernel. This module's [`gemm()`] chooses
//! among `along_k_f32`, `transposed`, `staged` and the crate called in place (`staged` calls
//! back into it, and into `tiles_f32`).

pub(crate) mod along_k;
mod along_k_f32;
mod amx;
pub mod bf16;
mod blocking;
mod operand;
mod pack;
mod staged;
mod switch;
mod tiles_f32;
mod transpose;
mod transposed;

pub use blocking::Mat;
pub use staged::use_blocks;
pub use tiles_f32::use_tiles;
pub use transposed::use_transposed;

use std::mem::MaybeUninit;

use crate::cpu::KernelError;

/// Allocates the scratch the `gemm` crate keeps for the life of each thread that runs a product
/// (its "L2 slab": one L2 cache's bytes, 2 MiB on a Xeon with AMX), on every thread of rayon's
/// global pool and on the calling thread. The crate allocates it on a thread's first product that
/// packs its left operand, so without this a memory measurement counts it in whichever pass a
/// thread first multiplies in — under load another pass than when the machine is quiet: the
/// estimator's profile of ResNet-18's backward moved by 2 MiB between batches, and its read-out at
/// batch 32 from 3.3 to 11.3 MB between runs. Measure after calling it and the slab is part of the
/// process, as the thread pool itself is.
pub fn allocate_thread_scratch() {
    let touch = || gemm_common::gemm::L2_SLAB.with(|slab| drop(slab.borrow()));
    rayon::broadcast(|_| touch());
    touch();
}

/// An element type the `gemm` crate multiplies here: f32 or f64 (sealed).
pub trait Scalar: Copy + Default + Send + Sync + 'static + sealed::Sealed {
    /// 1.
    const ONE: Self;

    /// True where [`Scalar::own_kernel`] runs the product (it reads its destination's rows as
    /// slices, so [`gemm_into`] initialises the destination first there).
    fn has_own_kernel(a: &Mat<'_, Self>, b: &Mat<'_, Self>) -> bool;

    /// Runs `dst = beta·a·b + (dst if accumulate)` (rows `dst_row` apart) on a kernel of wick's
    /// own and returns true where one applies (f32 operands both along the depth, few rows:
    /// `along_k_f32`); false leaves the product to the `gemm` crate. The shapes were checked.
    fn own_kernel(
        dst: &mut [Self],
        dst_row: usize,
        a: Mat<'_, Self>,
        b: Mat<'_, Self>,
        beta: Self,
        accumulate: bool,
        parallel: bool,
    ) -> bool;
}

impl Scalar for f32 {
    const ONE: f32 = 1.0;

    fn has_own_kernel(a: &Mat<'_, f32>, b: &Mat<'_, f32>) -> bool {
        along_k_f32::applies(a, b) && !gemm_crate_only()
    }

    fn own_kernel(
        dst: &mut [f32],
        dst_row: usize,
        a: Mat<'_, f32>,
        b: Mat<'_, f32>,
        beta: f32,
        accumulate: bool,
        parallel: bool,
    ) -> bool {
        if !Self::has_own_kernel(&a, &b) {
            return false;
        }
        along_k_f32::product(dst, dst_row, a, b, beta, accumulate, parallel);
        true
    }
}

/// True when `WICK_CPU_GEMM_CRATE=1`: every f32 product through the `gemm` crate, for A/B
/// measurements of wick's own kernel (decided once per process).
fn gemm_crate_only() -> bool {
    static ONLY: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ONLY.get_or_init(|| std::env::var_os("WICK_CPU_GEMM_CRATE").is_some_and(|v| v == "1"))
}

impl Scalar for f64 {
    const ONE: f64 = 1.0;

    fn has_own_kernel(_: &Mat<'_, f64>, _: &Mat<'_, f64>) -> bool {
        false
    }

    fn own_kernel(_: &mut [f64], _: usize, _: Mat<'_, f64>, _: Mat<'_, f64>, _: f64, _: bool, _: bool) -> bool {
        false
    }
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for f64 {}
}

/// `dst (m × n, row-major) = beta·a·b + (dst if accumulate)`, parallel inside the product when
/// `parallel` (use false when the caller already runs one product per thread).
pub fn gemm<T: Scalar>(
    dst: &mut [T],
    a: Mat<'_, T>,
    b: Mat<'_, T>,
    beta: T,
    accumulate: bool,
    parallel: bool,
) -> Result<(), KernelError> {
    gemm_rows_apart(dst, b.cols, a, b, beta, accumulate, parallel)
}

/// [`gemm()`] into a destination whose rows lie `dst_row ≥ n` elements apart: element (i, j) at
/// `i·dst_row + j`, the elements between rows untouched. Products side by side in one matrix
/// (Q, K and V from their three weights) write their columns of it in place, each from
/// `&mut dst[first column..]`.
pub fn gemm_rows_apart<T: Scalar>(
    dst: &mut [T],
    dst_row: usize,
    a: Mat<'_, T>,
    b: Mat<'_, T>,
    beta: T,
    accumulate: bool,
    parallel: bool,
) -> Result<(), KernelError> {
    let dims = (a.rows, a.cols, a.fits());
    let Some((m, k, n)) = blocking::product_dims_of("wick gemm", dims, &b, (&mut *dst, dst_row), accumulate)? else {
        return Ok(());
    };
    if T::own_kernel(dst, dst_row, a, b, beta, accumulate, parallel) {
        return Ok(());
    }
    // SAFETY: every element of `a`, `b` and the m rows of n elements dst_row apart lies inside
    // its slice (checked above), and `dst` does not alias the inputs (a `&mut` borrow).
    unsafe {
        crate_paths(Dst(dst.as_mut_ptr()), dst_row, Job { dims: (m, k, n), a, b, j0: 0, beta, accumulate }, parallel)
    };
    Ok(())
}

/// `dst (m × n, row-major) = beta·a·b` into a destination that need not be initialised, returned
/// initialised: [`gemm()`] without the zero fill of a `vec![0; m·n]` that the product overwrites
/// anyway (a write of every output before the product writes it again: 2–4 % of a transformer's
/// pass). `dst` must hold exactly m·n elements.
pub fn gemm_into<'d, T: Scalar>(
    dst: &'d mut [MaybeUninit<T>],
    a: Mat<'_, T>,
    b: Mat<'_, T>,
    beta: T,
    parallel: bool,
) -> Result<&'d mut [T], KernelError> {
    let (m, k, n) = (a.rows, a.cols, b.cols);
    blocking::check_product("wick gemm", (m, k, a.fits()), &b, (dst.len(), n))?;
    if m.checked_mul(n) != Some(dst.len()) {
        return Err(KernelError { kernel: "wick gemm", message: format!("{m}×{n} into {} elements", dst.len()) });
    }
    if m == 0 || n == 0 || k == 0 || T::has_own_kernel(&a, &b) {
        // The own kernel takes its destination as slices: initialised first, as `gemm` has it.
        dst.fill(MaybeUninit::new(T::default()));
        // SAFETY: every element was just written; MaybeUninit<T> has T's layout.
        let init = unsafe { &mut *(dst as *mut [MaybeUninit<T>] as *mut [T]) };
        gemm(init, a, b, beta, false, parallel)?;
        return Ok(init);
    }
    gemm_into_rows_apart(dst, n, a, b, beta, parallel)?;
    // SAFETY: every element was written above (m rows of n, n apart: all m·n); MaybeUninit<T>
    // has T's layout.
    Ok(unsafe { &mut *(dst as *mut [MaybeUninit<T>] as *mut [T]) })
}

/// [`gemm_into`] into a destination whose rows lie `dst_row ≥ n` elements apart, as
/// [`gemm_rows_apart`] has it: writes the n elements from each of the m rows' starts, every one
/// of them, and nothing else, without reading any. Products side by side in one output (Q, K
/// and V from their three weights) fill it without a zero fill first; the output is initialised
/// once every column has been written.
pub fn gemm_into_rows_apart<T: Scalar>(
    dst: &mut [MaybeUninit<T>],
    dst_row: usize,
    a: Mat<'_, T>,
    b: Mat<'_, T>,
    beta: T,
    parallel: bool,
) -> Result<(), KernelError> {
    let (m, k, n) = (a.rows, a.cols, b.cols);
    blocking::check_product("wick gemm", (m, k, a.fits()), &b, (dst.len(), dst_row))?;
    if m == 0 || n == 0 {
        return Ok(());
    }
    if k == 0 || T::has_own_kernel(&a, &b) {
        // The own kernel (few rows) takes its destination as slices: its product is made in
        // memory of its own and copied into the columns. m·n ≤ (m − 1)·dst_row + n ≤ len.
        let mut own = vec![T::default(); m * n];
        gemm(&mut own, a, b, beta, false, parallel)?;
        for (row, src) in dst.chunks_mut(dst_row).zip(own.chunks_exact(n)) {
            row[..n].iter_mut().zip(src).for_each(|(d, s)| {
                d.write(*s);
            });
        }
        return Ok(());
    }
    let job = Job { dims: (m, k, n), a, b, j0: 0, beta, accumulate: false };
    // SAFETY: the shapes were checked against `a`, `b` and the destination's m rows of n
    // elements dst_row apart, which `a` and `b` (shared borrows) cannot alias; the crate's paths
    // write every one of those elements without reading any (`accumulate` false).
    unsafe { crate_paths(Dst(dst.as_mut_ptr().cast()), dst_row, job, parallel) };
    Ok(())
}

/// The destination of [`crate_paths`], handed to the threads that write its disjoint columns.
#[derive(Clone, Copy)]
struct Dst<T>(*mut T);

// SAFETY: the threads write disjoint columns only (`crate_paths`).
unsafe impl<T: Send> Send for Dst<T> {}
// SAFETY: as above.
unsafe impl<T: Send> Sync for Dst<T> {}

/// One product as the crate's paths take it: `beta·a·b` over columns `j0..j0 + n` of `b` (`dims`
/// m, k, n) into an m × n destination, added to what it holds where `accumulate`.
#[derive(Clone, Copy)]
pub(super) struct Job<'a, T> {
    pub(super) dims: (usize, usize, usize),
    pub(super) a: Mat<'a, T>,
    pub(super) b: Mat<'a, T>,
    pub(super) j0: usize,
    pub(super) beta: T,
    pub(super) accumulate: bool,
}

impl<'a, T: Copy> Job<'a, T> {
    /// The same product over the `n` columns of `b` from `j0`.
    pub(super) fn columns(self, b: Mat<'a, T>, j0: usize, n: usize) -> Self {
        Job { dims: (self.dims.0, self.dims.1, n), b, j0, ..self }
    }
}

/// The product on the `gemm` crate: one thread, the crate's own threading for few columns, or
/// the destination's columns split between the threads.
///
/// # Safety
/// Every element of `a`, of the job's columns of `b` and of the m rows of n elements `dst_row`
/// apart at `dst` lies inside its allocation; the destination aliases neither input and nothing
/// else reads or writes it meanwhile; where `accumulate` holds, its elements are initialised.
unsafe fn crate_paths<T: Scalar>(dst: Dst<T>, dst_row: usize, job: Job<'_, T>, parallel: bool) {
    let n = job.dims.2;
    let threads = if parallel { rayon::current_num_threads() } else { 1 };
    if threads >= 2 && n < SPLIT_COLUMNS * threads {
        // Too few columns to split: the crate's own threading.
        // SAFETY: the caller's contract.
        unsafe { crate_product(dst.0, dst_row, job, ::gemm::Parallelism::Rayon(threads)) };
        return;
    }
    // The destination's columns split between the threads, each a one-thread product: the
    // crate's own threading of a long depth against few columns left a thread idle (BERT-base's
    // 3072 → 768 projection: 26 G multiply-adds a second at 128 tokens on two threads, 49 split;
    // 76 and 96 at 1024 tokens; `cargo bench -p wick-kernels --bench f32_products`, and
    // BENCHMARKS.md "Transformer inference (issue 50)" for whole models).
    let chunk = if threads < 2 { n } else { n.div_ceil(threads).div_ceil(16) * 16 };
    // Each part on the transposed form (x laid along its rows once for all of them) or on the
    // staged paths.
    let along_rows;
    let (job, part): (Job<'_, T>, PartFn<T>) = if transposed::applies(&job, chunk) {
        along_rows = transposed::along_rows(job.a);
        (Job { a: along_rows.view(), ..job }, transposed::product::<T>)
    } else {
        (job, staged::product::<T>)
    };
    if threads < 2 {
        // SAFETY: the caller's contract (for the transposed form, without `accumulate`: checked
        // by `applies`).
        unsafe { part(dst.0, dst_row, job) };
        return;
    }
    rayon::scope(|s| {
        for j0 in (0..n).step_by(chunk) {
            let cols = chunk.min(n - j0);
            s.spawn(move |_| {
                let out = dst;
                // SAFETY: columns j0..j0 + cols (j0 < n) of every row of the destination and of
                // `b` (the caller's contract), written by this task only (the tasks' column
                // ranges are disjoint); as above for `accumulate`.
                unsafe { part(out.0.add(j0), dst_row, job.columns(job.b, job.j0 + j0, cols)) }
            });
        }
    });
}

/// One thread's part of a product on one of the paths (`staged::product`, `transposed::product`).
type PartFn<T> = unsafe fn(*mut T, usize, Job<'_, T>);

/// Columns per thread from which the threads split the destination's columns.
const SPLIT_COLUMNS: usize = 64;

/// The `gemm` crate's product `job` into the m × n matrix at `dst` with rows `dst_row` apart.
///
/// # Safety
/// Every element of `a`, of the job's columns of `b` and of the destination lies inside its
/// allocation, strides fit in isize, the destination aliases neither input, and nothing else
/// reads or writes the destination's elements meanwhile.
unsafe fn crate_product<T: Scalar>(dst: *mut T, dst_row: usize, job: Job<'_, T>, parallelism: ::gemm::Parallelism) {
    // SAFETY: the caller's contract; element (i, j) at i·dst_row + j.
    unsafe { crate_call(dst, (dst_row, 1), job, parallelism) }
}

/// The `gemm` crate's product `job` into the m × n matrix at `dst` whose element (i, j) lies at
/// `i·rows + j·cols` for `(rows, cols)` = `dst_strides`: row-major (`crate_product`) or
/// column-major (`transposed`'s blocks).
///
/// # Safety
/// As [`crate_product`]'s.
unsafe fn crate_call<T: Scalar>(
    dst: *mut T,
    (dst_rs, dst_cs): (usize, usize),
    job: Job<'_, T>,
    parallelism: ::gemm::Parallelism,
) {
    let Job { dims: (m, k, n), a, b, j0, beta, accumulate } = job;
    // SAFETY: the caller's contract; column j0 of `b` starts inside its slice.
    unsafe {
        ::gemm::gemm(
            m,
            n,
            k,
            dst,
            dst_cs as isize,
            dst_rs as isize,
            accumulate,
            a.data.as_ptr(),
            a.col_stride as isize,
            a.row_stride as isize,
            b.data.as_ptr().add(j0 * b.col_stride),
            b.col_stride as isize,
            b.row_stride as isize,
            T::ONE,
            beta,
            false,
            false,
            false,
            parallelism,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn naive(a: Mat<'_, f64>, b: Mat<'_, f64>) -> Vec<f64> {
        let mut out = vec![0.0; a.rows * b.cols];
        for i in 0..a.rows {
            for j in 0..b.cols {
                out[i * b.cols + j] = (0..a.cols)
                    .map(|p| a.data[i * a.row_stride + p * a.col_stride] * b.data[p * b.row_stride + j * b.col_stride])
                    .sum();
            }
        }
        out
    }

    #[test]
    fn products_with_transposes_match_a_naive_loop() {
        let a: Vec<f64> = (0..35).map(|i| (i as f64 * 0.37).sin()).collect();
        let b: Vec<f64> = (0..35).map(|i| (i as f64 * 0.11).cos()).collect();
        // (5×7)·(7×5), (5×7)·(5×7)ᵀ, (7×5)ᵀ·(7×5).
        for (ma, mb) in [
            (Mat::rows(&a, 5, 7), Mat::rows(&b, 7, 5)),
            (Mat::rows(&a, 5, 7), Mat::rows(&b, 5, 7).t()),
            (Mat::rows(&a, 7, 5).t(), Mat::rows(&b, 7, 5)),
        ] {
            let mut out = vec![1.0; ma.rows * mb.cols];
            gemm(&mut out, ma, mb, 1.0, false, true).unwrap();
            let expected = naive(ma, mb);
            assert!(out.iter().zip(&expected).all(|(x, y)| (x - y).abs() < 1e-12));
            // Accumulating adds to what is there.
            gemm(&mut out, ma, mb, 2.0, true, false).unwrap();
            assert!(out.iter().zip(&expected).all(|(x, y)| (x - 3.0 * y).abs() < 1e-12));
        }
    }

    /// Linear layers' products that `staged` copies (W's columns along the depth, far apart):
    /// more columns than one copied block holds, W inside a wider buffer, one thread and split
    /// columns, written and accumulated; against the naive loop in f64. 70 rows take the f32
    /// panels on AVX2 and AVX-512 (ragged in both directions: 1030 deep, a last panel narrower
    /// than the others), 300 the blocks (or, on an L1 of 12 ways or more, the crate in place;
    /// `staged`'s own test runs the blocks on every CPU).
    #[test]
    fn staged_products_match_a_naive_loop() {
        for m in [70, 300] {
            staged_product_matches_a_naive_loop(m);
        }
    }

    fn staged_product_matches_a_naive_loop(m: usize) {
        let (k, n, row) = (1030, 300, 1040);
        let x: Vec<f64> = (0..m * k).map(|i| (i as f64 * 0.37).sin()).collect();
        let w: Vec<f64> = (0..n * row).map(|i| (i as f64 * 0.11).cos()).collect();
        let (xm, wm) = (Mat::rows(&x, m, k), Mat { data: &w[..], rows: n, cols: k, row_stride: row, col_stride: 1 });
        assert!(staged::applies(&xm, &wm.t()));
        let expected = naive(xm, wm.t());
        let (x32, w32): (Vec<f32>, Vec<f32>) =
            (x.iter().map(|&v| v as f32).collect(), w.iter().map(|&v| v as f32).collect());
        let wm32 = Mat { data: &w32[..], rows: n, cols: k, row_stride: row, col_stride: 1 };
        for parallel in [false, true] {
            let mut out = vec![1.0; m * n];
            gemm(&mut out, xm, wm.t(), 1.0, false, parallel).unwrap();
            assert!(out.iter().zip(&expected).all(|(x, y)| (x - y).abs() < 1e-9));
            gemm(&mut out, xm, wm.t(), 2.0, true, parallel).unwrap();
            assert!(out.iter().zip(&expected).all(|(x, y)| (x - 3.0 * y).abs() < 1e-9));
            let mut out = vec![0f32; m * n];
            gemm(&mut out, Mat::rows(&x32, m, k), wm32.t(), 1.0, false, parallel).unwrap();
            // f32 sums of 1030 terms of size ≤ 1: within 1e-3 of the f64 truth.
            assert!(out.iter().zip(&expected).all(|(x, y)| (*x as f64 - y).abs() < 1e-3));
        }
    }

    /// `gemm_into` writes every element, equal to the bit to `gemm` into zeros, on each path:
    /// the own kernel (few rows along the depth), the f32 panels, the staged blocks (the crate in
    /// place on an L1 of 12 ways or more), the crate in place (past the staged rows), the crate's
    /// own threading (few columns), f64; the destination starts as NaN so that an element left
    /// unwritten shows. A destination of the wrong length is an error.
    #[test]
    fn products_into_fresh_memory_equal_products_into_zeros() {
        fn check<T: Scalar + std::fmt::Debug + PartialEq>(m: usize, k: usize, n: usize, nan: T, of: impl Fn(f64) -> T) {
            let x: Vec<T> = (0..m * k).map(|i| of((i as f64 * 0.37).sin())).collect();
            let w: Vec<T> = (0..n * k).map(|i| of((i as f64 * 0.11).cos())).collect();
            let (xm, wm) = (Mat::rows(&x, m, k), Mat::rows(&w, n, k).t());
            for parallel in [false, true] {
                let mut want = vec![T::default(); m * n];
                gemm(&mut want, xm, wm, of(0.5), false, parallel).unwrap();
                let mut fresh = vec![MaybeUninit::new(nan); m * n];
                let got = gemm_into(&mut fresh, xm, wm, of(0.5), parallel).unwrap();
                assert!(got == &want[..], "{m}×{k}×{n} parallel {parallel}");
            }
        }
        for (m, k, n) in [(8, 300, 40), (70, 1030, 300), (300, 300, 200), (2100, 260, 150), (90, 64, 100), (3, 0, 5)] {
            check::<f32>(m, k, n, f32::NAN, |v| v as f32);
        }
        check::<f64>(300, 300, 200, f64::NAN, |v| v);
        let (x, w) = (vec![1f32; 6], vec![1f32; 6]);
        let mut short = vec![MaybeUninit::new(0f32); 3];
        assert!(gemm_into(&mut short, Mat::rows(&x, 2, 3), Mat::rows(&w, 2, 3).t(), 1.0, false).is_err());
        let mut long = vec![MaybeUninit::new(0f32); 5];
        assert!(gemm_into(&mut long, Mat::rows(&x, 2, 3), Mat::rows(&w, 2, 3).t(), 1.0, false).is_err());
    }

    /// Products written side by side into one destination (rows wider than each) equal the
    /// product of the stacked operands, and leave the elements between rows as they were; the
    /// own kernel's, the panels', the staged and the crate's paths alike, and a depth of 0. Into
    /// fresh memory (`gemm_into_rows_apart`) they write the same bits and nothing between rows.
    #[test]
    fn products_side_by_side_match_one_product() {
        for (m, k, parts) in [
            (5, 200, [30, 7]),
            (90, 300, [150, 40]),
            (70, 20, [9, 3]),
            (300, 300, [150, 70]),
            (2100, 64, [150, 40]),
            (3, 0, [5, 2]),
        ] {
            let n: usize = parts.iter().sum();
            let x: Vec<f32> = (0..m * k).map(|i| (i as f32 * 0.37).sin()).collect();
            let w: Vec<f32> = (0..n * k).map(|i| (i as f32 * 0.11).cos()).collect();
            let mut whole = vec![0f32; m * n];
            gemm(&mut whole, Mat::rows(&x, m, k), Mat::rows(&w, n, k).t(), 1.0, false, true).unwrap();
            // Rows n + 3 apart: three untouched elements after each.
            let row = n + 3;
            let mut side = vec![-7f32; m * row];
            let mut j0 = 0;
            for p in parts {
                let wp = Mat::rows(&w[j0 * k..(j0 + p) * k], p, k).t();
                gemm_rows_apart(&mut side[j0..], row, Mat::rows(&x, m, k), wp, 1.0, false, true).unwrap();
                j0 += p;
            }
            for i in 0..m {
                let (got, want) = (&side[i * row..i * row + n], &whole[i * n..(i + 1) * n]);
                assert!(got.iter().zip(want).all(|(a, b)| (a - b).abs() <= 1e-4 * (1.0 + b.abs())), "row {i}");
                assert!(side[i * row + n..(i + 1) * row].iter().all(|&v| v == -7.0));
            }
            // The same into memory that starts as NaN: each product's columns equal, to the
            // bit, what `gemm_rows_apart` wrote into the zeros' place, and the gaps keep NaN.
            let mut fresh = vec![MaybeUninit::new(f32::NAN); m * row];
            let mut j0 = 0;
            for p in parts {
                let wp = Mat::rows(&w[j0 * k..(j0 + p) * k], p, k).t();
                gemm_into_rows_apart(&mut fresh[j0..], row, Mat::rows(&x, m, k), wp, 1.0, true).unwrap();
                j0 += p;
            }
            // SAFETY: every element was initialised (NaN, then the products).
            let fresh: Vec<f32> = fresh.iter().map(|v| unsafe { v.assume_init() }).collect();
            for i in 0..m {
                let (got, want) = (&fresh[i * row..i * row + n], &side[i * row..i * row + n]);
                assert!(got.iter().zip(want).all(|(a, b)| a.to_bits() == b.to_bits()), "row {i}");
                assert!(fresh[i * row + n..(i + 1) * row].iter().all(|v| v.is_nan()));
            }
        }
        let mut gaps = vec![MaybeUninit::new(0f32); 8];
        let a = vec![0f32; 6];
        assert!(gemm_into_rows_apart(&mut gaps, 1, Mat::rows(&a, 2, 3), Mat::rows(&a, 3, 2), 1.0, false).is_err());
        assert!(gemm_into_rows_apart(&mut gaps, 7, Mat::rows(&a, 2, 3), Mat::rows(&a, 3, 2), 1.0, false).is_err());
        let (a, mut out) = (vec![0f32; 6], vec![0f32; 8]);
        // Rows closer than a row's length, or a last row past the end.
        assert!(gemm_rows_apart(&mut out, 1, Mat::rows(&a, 2, 3), Mat::rows(&a, 3, 2), 1.0, false, false).is_err());
        assert!(gemm_rows_apart(&mut out, 7, Mat::rows(&a, 2, 3), Mat::rows(&a, 3, 2), 1.0, false, false).is_err());
        assert!(gemm_rows_apart(&mut out, 6, Mat::rows(&a, 2, 3), Mat::rows(&a, 3, 2), 1.0, false, false).is_ok());
    }

    #[test]
    fn shapes_that_do_not_fit_are_errors() {
        let a = vec![0f32; 6];
        let mut out = vec![0f32; 4];
        assert!(gemm(&mut out, Mat::rows(&a, 2, 3), Mat::rows(&a, 2, 3), 1.0, false, false).is_err());
        assert!(gemm(&mut out, Mat::rows(&a, 3, 2), Mat::rows(&a, 2, 3), 1.0, false, false).is_err());
        let short = Mat { data: &a[..5], rows: 2, cols: 3, row_stride: 3, col_stride: 1 };
        assert!(gemm(&mut out, short, Mat::rows(&a, 3, 2), 1.0, false, false).is_err());
    }
}
