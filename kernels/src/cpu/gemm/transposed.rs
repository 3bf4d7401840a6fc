//! A linear layer's `y = x · Wᵀ` with few rows computed as its transpose, `yᵀ = W · xᵀ`, on
//! the `gemm` crate's kernel with the vectors along the rows of x and W's elements broadcast from
//! where they lie: W is read in place, never packed.
//!
//! Why: the crate's kernel runs 4 vectors of 16 rows against 6 columns (AVX-512, `x4x6`). Laid
//! along y's columns (how it multiplies a row-major destination) it needs W's columns side by
//! side, so W — n × k, the largest operand at a hundred rows — is transposed into panels on
//! every call (`staged`'s `by_panels`): in a profile of the products of BERT-base's four layers
//! at 128 rows the transposition took 17 % of the samples against the kernel's 63, and it waits
//! on W coming from memory with nothing to overlap it. Laid along x's rows instead, the kernel
//! broadcasts each W element, six rows of W at a time, each read front to back while the
//! multiply-adds run; what is transposed is x (m × k, once for all threads: [`along_rows`])
//! before and y (m × n) after, at 128 rows a sixth (BERT-base's 768 → 3072) to a third
//! (768 → 768) of W's elements. y is made [`BLOCK_COLUMNS`] columns at a time, each block
//! transposed into place from L2.
//!
//! Where: f32 on CPUs with AVX-512 (`WICK_CPU_AVX512`), [`MIN_ROWS`] to [`MAX_ROWS`] rows of x
//! (other counts padded with zero rows to a multiple of the kernel's vector, 16, so that no
//! micro-kernel runs at a fraction of its lanes: at 100 rows, padded to 112, 0.96–1.12× the
//! panels, the large layers 1.05–1.12×; ViT's 197, padded to 208, lost, 0.84–1.01×), at least
//! [`MIN_COLUMNS`] columns a thread, W along the depth, unless turned off ([`use_transposed`],
//! `WICK_CPU_TRANSPOSED=0`). Medians of
//! alternating rounds in one process against the panels (`cargo bench -p wick-kernels --bench
//! paths_ab -- 128,160,192,256 7 transposed`, two threads, BENCHMARKS.md "W read in place"): at
//! 128 rows 1.00–1.17× on the 13 layer shapes (BERT-base's 1.04–1.17×, the decoder's head 1.17×,
//! those under [`MIN_COLUMNS`] level), reaching 187–205 G multiply-adds a second where the panels
//! ran at 164–179.
//!
//! Numerics: each output the crate's dot product along k over the same terms in the same order
//! as on the panels' path: equal to the bit where the rows are a multiple of 16 (tested; with
//! padded rows the crate's kernels for the last rows can differ from the panels' in the last bit).

use super::blocking::Mat;
use super::switch::Switch;
use super::transpose::transpose;
use super::{Job, Scalar};

/// [`use_transposed`]'s switch.
static SWITCH: Switch = Switch::new("WICK_CPU_TRANSPOSED");

/// Turns this path on (the default) or off, for side-by-side measurements against the panels in
/// one process (`benches/paths_ab.rs`); whole processes take `WICK_CPU_TRANSPOSED=0`. Results
/// are the same bits either way at the rows this path takes.
pub fn use_transposed(on: bool) {
    SWITCH.set(on);
}

/// Rows of x from which products run this way: at 64 rows the two forms ran level.
const MIN_ROWS: usize = 80;

/// Rows of x up to which products run this way: the panels' W transposition weighs less the
/// more rows each of its elements serves; at 192 rows this form ran 0.93–1.08× (median over the
/// shapes 1.00), at 256 0.90–1.02×, at 160 0.98–1.09× (1.03).
const MAX_ROWS: usize = 160;

/// Columns of y made and transposed at a time: a multiple of the kernel's 6 columns and of the
/// transposes' 16, 192 KiB at 128 rows, still in L2 when it is transposed (the crate copies x
/// into its panels once a block). BERT-base at one sentence: 69.2 ms a pass against 70.2 in
/// blocks of 1 536 (medians of 8 alternating rounds; without this path 78.4).
const BLOCK_COLUMNS: usize = 384;

/// Columns of a thread's part of the product from which products run this way: with 192 or
/// 256 columns a thread (MiniLM's 384 → 384 and 1536 → 384, the decoder's 512 → 512 on two
/// threads) this form ran 0.83–0.97× the panels, with 384 (BERT-base's 768 → 768) 0.99–1.04×.
const MIN_COLUMNS: usize = 384;

/// True when [`crate_paths`](super) runs `job` this way, each thread's part `columns` wide (see
/// the module's doc). x's layout does not matter: it is laid along its rows first
/// ([`along_rows`]), once for every thread.
pub(super) fn applies<T: Scalar>(job: &Job<'_, T>, columns: usize) -> bool {
    let (m, k, _) = job.dims;
    std::any::TypeId::of::<T>() == std::any::TypeId::of::<f32>()
        && !job.accumulate
        && job.b.row_stride == 1
        && job.b.col_stride != 0
        && columns >= MIN_COLUMNS
        && k >= 16
        && (MIN_ROWS..=MAX_ROWS).contains(&m)
        && m.next_multiple_of(16).checked_mul(k).is_some()
        && crate::cpu::avx512()
        && SWITCH.on()
}

/// x laid along its rows, its row count rounded up to the kernel's vector (16) with rows of
/// zeros: element (i, p) at `p·rows + i`, which the crate reads as a column-major left operand
/// (xᵀ's rows side by side) whose every micro-kernel runs whole vectors.
pub(super) struct AlongRows<T> {
    data: Vec<T>,
    /// x's rows and the zero rows after them: a multiple of 16.
    rows: usize,
    cols: usize,
}

impl<T> AlongRows<T> {
    /// x again, with the zero rows (`rows` × k), its rows along the memory.
    pub(super) fn view(&self) -> Mat<'_, T> {
        Mat { data: &self.data, rows: self.rows, cols: self.cols, row_stride: 1, col_stride: self.rows }
    }
}

/// `a` (any strides) laid along its rows with zero rows up to a multiple of 16, in memory that is
/// written once (no zero fill first).
pub(super) fn along_rows<T: Scalar>(a: Mat<'_, T>) -> AlongRows<T> {
    let (m, k) = (a.rows, a.cols);
    let rows = m.next_multiple_of(16);
    let len = rows.checked_mul(k).expect("rows × k fits in usize (checked by `applies`)");
    let mut data: Vec<T> = Vec::with_capacity(len);
    let out = data.as_mut_ptr();
    // SAFETY: the buffer holds rows·k elements, element (i, p) at p·rows + i for i < m ≤ rows,
    // p < k, and nothing else refers to it.
    unsafe { transpose(out, rows, a) };
    for p in 0..k {
        for i in m..rows {
            // SAFETY: p·rows + i < rows·k, inside the buffer.
            unsafe { out.add(p * rows + i).write(T::default()) };
        }
    }
    // SAFETY: every one of the rows·k elements was written just now.
    unsafe { data.set_len(len) };
    AlongRows { data, rows, cols: k }
}

/// `dst (m × n, rows dst_row apart) = beta·a·b` over columns `j0..j0 + n` of `b`, as yᵀ = bᵀ·aᵀ
/// made [`BLOCK_COLUMNS`] at a time and transposed into place. `a` may have more rows than m
/// (x [`along_rows`] with its zero rows: those are multiplied too, and dropped). Any layout of
/// `a` gives the same bits; x laid along its rows is the fast one.
///
/// # Safety
/// As `crate_product`'s, and `job.accumulate` is false.
pub(super) unsafe fn product<T: Scalar>(dst: *mut T, dst_row: usize, job: Job<'_, T>) {
    let Job { dims: (m, k, n), a, b, j0, beta, .. } = job;
    debug_assert!(!job.accumulate && a.rows >= m && a.cols == k);
    // The rows multiplied: x's and its zero rows.
    let rows = a.rows.max(m);
    let mut block: Vec<T> = Vec::with_capacity(rows * BLOCK_COLUMNS.min(n));
    for c0 in (0..n).step_by(BLOCK_COLUMNS) {
        let cols = BLOCK_COLUMNS.min(n - c0);
        // SAFETY: `a` holds `rows` × k elements at its strides and `b` columns j0 + c0..j0 + c0 +
        // cols of k (the caller's contract, `along_rows`); the block's capacity holds rows × cols
        // elements, column-major, which the crate writes without reading (`read_dst` false), and
        // aliases neither.
        unsafe {
            let part = Job { dims: (rows, k, cols), a, b, j0: j0 + c0, beta, accumulate: false };
            super::crate_call(block.as_mut_ptr(), (1, rows), part, ::gemm::Parallelism::None);
            block.set_len(rows * cols);
        }
        // x's m rows of the block (its zero rows' products left out).
        let made = Mat { data: &block[..], rows: cols, cols: m, row_stride: rows, col_stride: 1 };
        // SAFETY: the destination's m rows of columns c0..c0 + cols, dst_row apart, are this
        // call's (the caller's contract): element (i, c0 + j) at i·dst_row + c0 + j.
        unsafe { transpose(dst.add(c0), dst_row, made) };
        block.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The transposed product equals the crate's in place (row-major destination): to the bit at
    /// row counts this path takes, within an ulp at others, over several column blocks with a
    /// ragged last one, columns from j0 > 0, W inside a wider buffer, rows of the destination
    /// wider than n, x row-major and laid along its rows.
    #[test]
    fn equals_the_row_major_product_to_the_bit() {
        for (m, k, n) in
            [(64, 300, 200), (128, 768, 420), (96, 17, 7), (130, 64, 385), (112, 40, 1600), (197, 384, 500)]
        {
            let (j0, row, dst_row) = (3, k + 5, n + 9);
            let x: Vec<f32> = (0..m * k).map(|i| (i as f32 * 0.37).sin()).collect();
            let w: Vec<f32> = (0..(n + j0) * row).map(|i| (i as f32 * 0.11).cos()).collect();
            let b = Mat { data: &w[..], rows: k, cols: n + j0, row_stride: 1, col_stride: row };
            let job = Job { dims: (m, k, n), a: Mat::rows(&x, m, k), b, j0, beta: 0.5, accumulate: false };
            let mut want = vec![f32::NAN; m * dst_row];
            // SAFETY: x holds m × k, W columns j0..j0 + n of k, the destination m rows of n,
            // dst_row apart.
            unsafe { super::super::crate_product(want.as_mut_ptr(), dst_row, job, ::gemm::Parallelism::None) };
            let xt = along_rows(Mat::rows(&x, m, k));
            // x's rows, then zero rows up to a multiple of 16.
            let rows = m.next_multiple_of(16);
            let of_x = |i: usize, p: usize| if i < m { x[i * k + p] } else { 0.0 };
            assert!((0..rows).all(|i| (0..k).all(|p| xt.data[p * rows + i] == of_x(i, p))));
            for a in [Mat::rows(&x, m, k), xt.view()] {
                let mut got = vec![f32::NAN; m * dst_row];
                // SAFETY: as above.
                unsafe { product(got.as_mut_ptr(), dst_row, Job { a, ..job }) };
                for i in 0..m {
                    let (g, w) = (&got[i * dst_row..][..n], &want[i * dst_row..][..n]);
                    // Bit for bit where the rows are a multiple of 16; elsewhere the crate's tail
                    // kernels may order a sum otherwise (130 rows: 1 element of 385 a row, 1 ulp).
                    let same = |g: &f32, w: &f32| {
                        g.to_bits() == w.to_bits() || (m % 16 != 0 && (g - w).abs() <= 1e-6 * (1.0 + w.abs()))
                    };
                    assert!(g.iter().zip(w).all(|(g, w)| same(g, w)), "{m}×{k}×{n} row {i}");
                    assert!(got[i * dst_row + n..][..dst_row - n].iter().all(|v| v.is_nan()));
                }
            }
        }
    }

    /// Through the products' dispatch (`gemm`, one thread and split between the threads): the
    /// rows and columns this path takes, against f64 sums. Says so where this CPU does not take
    /// the path (no AVX-512), and checks the same products on the other paths then.
    #[test]
    fn layer_products_through_the_dispatch_match_f64() {
        let (m, k, n) = (128, 300, 900);
        let x: Vec<f32> = (0..m * k).map(|i| (i as f32 * 0.37).sin()).collect();
        let w: Vec<f32> = (0..n * k).map(|i| (i as f32 * 0.11).cos()).collect();
        let (xm, wm) = (Mat::rows(&x, m, k), Mat::rows(&w, n, k).t());
        let job = Job { dims: (m, k, n), a: xm, b: wm, j0: 0, beta: 1.0, accumulate: false };
        if !applies(&job, n / 2) {
            eprintln!("the transposed products do not run on this CPU (no AVX-512, or turned off)");
        }
        for parallel in [false, true] {
            let mut out = vec![f32::NAN; m * n];
            super::super::gemm(&mut out, xm, wm, 1.0, false, parallel).unwrap();
            for i in 0..m {
                for j in 0..n {
                    let want: f64 = (0..k).map(|p| x[i * k + p] as f64 * w[j * k + p] as f64).sum();
                    let got = out[i * n + j] as f64;
                    assert!((got - want).abs() < 1e-3, "({i}, {j}): {got} against {want}, parallel {parallel}");
                }
            }
        }
    }
}
