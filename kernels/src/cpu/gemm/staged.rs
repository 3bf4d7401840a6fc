//! The `gemm` crate's product with `b`'s columns copied, a block at a time, into a buffer first,
//! where they lie along the depth: a linear layer's `x · Wᵀ` with W (out × in) row-major, read
//! in place by the crate, columns `in` elements apart.
//!
//! Why: the crate packs `b` into panels, reading a few of its columns side by side. When they
//! lie a multiple of 4 KiB apart (in = 1024, 3072: BERT-base's and ViT-B's 3072 → 768
//! projection) every one of them falls in the same L1 set, and through any large stride the
//! hardware prefetcher follows no column for long. On two threads of an AMD EPYC (Zen 4) at 128
//! tokens the crate multiplied 128 × 3072 × 768 at 48 G multiply-adds a second, 128 × 1536 × 384
//! (MiniLM) at 58 and 128 × 512 × 32 000 (the decoder's head) at 59; copied first, at 91, 88 and
//! 89 (PyTorch's oneDNN: 87 at the first; `cargo bench -p wick-kernels --bench f32_products`).
//! The copy is one contiguous read of each column into a buffer of [`BLOCK_BYTES`] that stays in
//! L2 while the crate packs it, rows [`stride`] apart so that they fall in different sets.
//! With few rows (f32 on AVX2 and AVX-512), the columns are instead transposed into the crate's
//! panel layout ([`by_panels`]), which it reads without packing them again. With more, on CPUs
//! whose L1 has [`IN_PLACE_L1_WAYS`] ways or more (where the sets' conflicts did not show), the
//! crate reads W in place.
//!
//! Up to [`TILES_MAX_ROWS`] rows of f32 on CPUs with AVX2 but not AVX-512, the product runs on
//! wick's own tiles instead ([`tiles_f32`], which copies W into its own panels).
//!
//! Numerics: the crate's own sums, over the same elements; only where `b` is read from changes
//! (the tiles' own order of f32 sums where they take the product).

use super::blocking::Mat;
use super::switch::Switch;
use super::{crate_product, tiles_f32, Job, Scalar};

/// Bytes of `b` copied at a time: half of a 1 MiB L2, beside the crate's packed panels.
const BLOCK_BYTES: usize = 512 << 10;

/// Rows of `a` from which products are staged: with fewer, the copy weighs more next to the
/// multiply-adds each column serves (wick's own kernel takes most of them, `along_k_f32`).
const MIN_ROWS: usize = 64;

/// Rows of `a` from which products are no longer staged: the crate packs `a` again for every
/// block, and with thousands of rows that outweighs what the copy saves. BERT-base's 3072 → 768
/// at 4 096 rows on the AVX2 paths: 74–76 G multiply-adds a second in blocks of 32 columns, 93 in
/// blocks of 128, 98–100 in place; at 1 024 rows on AVX-512, 104 staged against 96 in place.
const MAX_ROWS: usize = 2048;

/// Rows of `a` up to which `b`'s columns are copied as the crate's micro-kernel panels
/// ([`by_panels`], f32 where [`panel_columns`] gives their width) rather than in blocks: the crate
/// then reads them in place instead of packing each block again, which weighs most when few rows
/// share the packing; each panel is a call of its own, so with more rows `a` is read once a panel.
/// At 128 rows 1.07–1.31× on 10 of 13 layer shapes (medians of 24 alternating runs), at 1 024 rows
/// 0.79–1.10× (BENCHMARKS.md, "Transformer inference (issue 50)").
const PANEL_MAX_ROWS: usize = 256;

/// Depth from which products are staged.
const MIN_DEPTH: usize = 256;

/// True when [`product`] stages `a · b`: `b`'s columns contiguous along the depth but not next
/// to each other, a depth of at least [`MIN_DEPTH`] and [`MIN_ROWS`] up to [`MAX_ROWS`] rows.
pub(super) fn applies<T>(a: &Mat<'_, T>, b: &Mat<'_, T>) -> bool {
    b.row_stride == 1
        && b.cols > 1
        && b.col_stride != 0
        && b.rows >= MIN_DEPTH
        && (MIN_ROWS..MAX_ROWS).contains(&a.rows)
}

/// Columns a block holds a multiple of: the rows of the crate's widest micro-kernel (it runs
/// with the destination transposed, so `b`'s columns are its rows), 4 vectors of 16 f32 on
/// AVX-512 (its `x4x6`), 16 elements otherwise (AVX2's `x2x6`, and the f64 kernels'). A ragged
/// block runs its last columns on the narrower kernels: at 128 rows, MiniLM's 1536 → 384 in
/// blocks of 80 columns (64 + 16) ran at 94 G multiply-adds a second, in blocks of 64 at 106, the
/// decoder's 1408 → 512 at 90 against 103 (BENCHMARKS.md, "Transformer inference (issue 50)").
/// Asked of [`crate::cpu::avx512`] (as [`panel_columns`] is), so that `WICK_CPU_AVX512=0` (with a
/// build of the crate without its AVX-512 kernels) blocks as an AVX2 CPU does: on hardware
/// detection alone, that measurement rounded blocks to 64 columns (and took AVX-512's panels) for
/// the crate's AVX2 kernels, which no AVX2 CPU does.
fn kernel_rows<T>() -> usize {
    if std::mem::size_of::<T>() == 4 && crate::cpu::avx512() {
        return 64;
    }
    16
}

/// Columns of each panel where [`by_panels`] takes the product (f32 on CPUs with AVX2), `None`
/// where the blocks do. On AVX-512 the crate's widest micro-kernel (64). On AVX2 two of its
/// 16-row micro-kernels: against the blocks, panels of 32 ran at or above 1.0× on 9 to 12 of the
/// 13 layer shapes in each of four paired runs at 128 to 256 rows (mostly 1.00–1.17×, BERT-base's
/// 768 → 2304 1.04–1.51×, the lowest 0.95×); panels of 16 about as well, but 0.97–0.99× on the
/// vocabulary head (512 → 32 000), where 32 held level (`WICK_CPU_AVX512=0` with the crate built
/// without its AVX-512 kernels, on a Xeon; BENCHMARKS.md "Transformer inference (issue 50)").
fn panel_columns<T>() -> Option<usize> {
    if std::mem::size_of::<T>() != 4 {
        return None;
    }
    if crate::cpu::avx512() {
        return Some(64);
    }
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
        return Some(32);
    }
    None
}

/// Elements from one staged column to the next: the depth rounded up to a 64-byte line, and
/// one line more where that is a multiple of 1 KiB (columns in the same L1 set every few).
fn stride<T>(k: usize) -> usize {
    let line = (64 / std::mem::size_of::<T>()).max(1);
    let s = k.div_ceil(line) * line;
    if (s * std::mem::size_of::<T>()).is_multiple_of(1024) {
        s + line
    } else {
        s
    }
}

/// The crate's one-thread product of `a` and columns `j0..j0 + n` of `b` into the m × n matrix
/// at `dst` (rows `dst_row` apart), `b`'s columns copied a block at a time where [`applies`]
/// holds, read in place otherwise.
///
/// # Safety
/// As [`crate_product`]'s.
pub(super) unsafe fn product<T: Scalar>(dst: *mut T, dst_row: usize, job: Job<'_, T>) {
    let Job { dims: (m, ..), a, b, .. } = job;
    let none = ::gemm::Parallelism::None;
    if !applies(&a, &b) {
        // SAFETY: the caller's contract.
        unsafe { crate_product(dst, dst_row, job, none) };
        return;
    }
    if m <= TILES_MAX_ROWS {
        if let Some(job) = as_f32(job).filter(tiles_f32::applies) {
            // SAFETY: the caller's contract; T is f32.
            unsafe { tiles_f32::product(dst.cast(), dst_row, job) };
            return;
        }
    }
    if let Some(r) = panel_columns::<T>().filter(|_| m <= PANEL_MAX_ROWS) {
        // SAFETY: the caller's contract.
        unsafe { by_panels(dst, dst_row, job, r) };
        return;
    }
    if !BLOCKS.on() {
        // SAFETY: the caller's contract.
        unsafe { crate_product(dst, dst_row, job, none) };
        return;
    }
    // SAFETY: the caller's contract.
    unsafe { by_blocks(dst, dst_row, job) };
}

/// [`product`] with `b`'s columns copied a block of [`BLOCK_BYTES`] at a time, rows [`stride`]
/// apart, for the crate.
///
/// # Safety
/// As [`product`]'s.
unsafe fn by_blocks<T: Scalar>(dst: *mut T, dst_row: usize, job: Job<'_, T>) {
    let Job { dims: (_, k, n), b, j0, .. } = job;
    let st = stride::<T>(k);
    let rows = kernel_rows::<T>();
    let per_block = (BLOCK_BYTES / (st * std::mem::size_of::<T>()) / rows * rows).clamp(rows, 256);
    let mut buf: Vec<T> = Vec::with_capacity(per_block.min(n) * st);
    for c0 in (0..n).step_by(per_block) {
        let cols = per_block.min(n - c0);
        buf.clear();
        for c in j0 + c0..j0 + c0 + cols {
            let start = c * b.col_stride;
            // Inside `b`: the caller's contract covers columns j0..j0 + n over the depth k.
            buf.extend_from_slice(&b.data[start..start + k]);
            buf.resize(buf.len() + st - k, T::default());
        }
        let staged = Mat { data: &buf[..], rows: k, cols, row_stride: 1, col_stride: st };
        // SAFETY: the caller's contract for the destination's columns c0..c0 + cols (inside its
        // n); the staged block holds `cols` columns of k elements `st` apart.
        unsafe { crate_product(dst.add(c0), dst_row, job.columns(staged, 0, cols), ::gemm::Parallelism::None) };
    }
}

/// L1 ways from which W is read in place rather than copied in blocks. The blocks exist for the
/// columns that fall in the same L1 sets (module doc): on an AMD EPYC (Zen 4: 32 KiB, 8 ways)
/// they ran 1.5–1.9× the crate in place at 128 rows (before the panels took those) and 1.08×
/// at 1 024 (BERT-base's 3072 → 768). On a Xeon with a 48 KiB, 12-way L1 the crate in place
/// led on every layer shape but those 2 KiB apart: at 1 024 rows the blocks ran 0.94–1.00× over
/// depths 384–3 072 (512: 1.03×), BERT-base's and MiniLM's layers 0.96–0.99× at 1 024 rows and
/// 0.93–1.02× at 2 000, the decoder's 1.00–1.08× (`cargo bench -p wick-kernels --bench paths_ab
/// -- 512,1024,2000 5 blocks`, BENCHMARKS.md "W read in place"); in place the crate ran level
/// with PyTorch's MKL there. So on such a cache the blocks give way to the crate in place.
const IN_PLACE_L1_WAYS: usize = 12;

/// On where W is copied in blocks for products of more rows than the panels take: by default on
/// an L1 of fewer than [`IN_PLACE_L1_WAYS`] ways ([`use_blocks`] and `WICK_CPU_BLOCKS` set it
/// either way).
static BLOCKS: Switch =
    Switch::with_default("WICK_CPU_BLOCKS", || gemm_common::cache::CACHE_INFO[0].associativity < IN_PLACE_L1_WAYS);

/// Turns the copied blocks (products of more rows than the panels take) on or off (the crate
/// reading W in place) whatever the CPU's L1, for side-by-side measurements in one process
/// (`benches/paths_ab.rs`); whole processes take `WICK_CPU_BLOCKS=0` or `=1`. Results are the
/// same bits.
pub fn use_blocks(on: bool) {
    BLOCKS.set(on);
}

/// Rows of `a` up to which f32 products run on wick's own tiles where [`tiles_f32::applies`]
/// (AVX2 without AVX-512): at 1 024 rows the crate's kernel kept level with them or led
/// (0.93–1.08×, medians of alternating runs in one process).
const TILES_MAX_ROWS: usize = 256;

/// The job as the f32 job it is, where `T` is f32.
fn as_f32<T: Scalar>(job: Job<'_, T>) -> Option<Job<'_, f32>> {
    if std::any::TypeId::of::<T>() != std::any::TypeId::of::<f32>() {
        return None;
    }
    let cast = |m: Mat<'_, T>| Mat {
        // SAFETY: T is f32 (checked above): the same elements, the same layout.
        data: unsafe { std::slice::from_raw_parts(m.data.as_ptr().cast::<f32>(), m.data.len()) },
        rows: m.rows,
        cols: m.cols,
        row_stride: m.row_stride,
        col_stride: m.col_stride,
    };
    // SAFETY: as above, for the one scalar.
    let beta = unsafe { std::mem::transmute_copy::<T, f32>(&job.beta) };
    Some(Job { dims: job.dims, a: cast(job.a), b: cast(job.b), j0: job.j0, beta, accumulate: job.accumulate })
}

/// [`product`] with `b`'s columns copied into panels of `r` columns ([`panel_columns`]): panel q
/// holds columns qr..qr + r, element (p, j) at p·r + j, which the crate reads as a column-major
/// left operand (its transposed problem) without packing it into its own panels first (it
/// copies it whole into its per-thread buffer, a contiguous read).
///
/// # Safety
/// As [`product`]'s.
unsafe fn by_panels<T: Scalar>(dst: *mut T, dst_row: usize, job: Job<'_, T>, r: usize) {
    let Job { dims: (_, k, n), b, j0, .. } = job;
    let none = ::gemm::Parallelism::None;
    let mut panel: Vec<T> = vec![T::default(); r * k];
    for c0 in (0..n).step_by(r) {
        let w = r.min(n - c0);
        super::pack::fill_panel(&mut panel, b.data, b.col_stride, (j0 + c0, w, k));
        let staged = Mat { data: &panel[..w * k], rows: k, cols: w, row_stride: w, col_stride: 1 };
        // SAFETY: the caller's contract for the destination's columns c0..c0 + w.
        unsafe { crate_product(dst.add(c0), dst_row, job.columns(staged, 0, w), none) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strides_leave_the_one_kib_multiples() {
        assert_eq!(stride::<f32>(3072), 3088);
        assert_eq!(stride::<f32>(1000), 1008);
        assert_eq!(stride::<f32>(768), 784);
        assert_eq!(stride::<f64>(512), 520);
        for k in 1..5000 {
            let s = stride::<f32>(k);
            assert!(s >= k && s.is_multiple_of(16) && !(s * 4).is_multiple_of(1024), "{k} → {s}");
        }
    }

    /// The copied blocks whatever this CPU's L1 (on a 12-way one the products' dispatch reads W
    /// in place instead): f32 and f64, several blocks with a ragged last one (depth 1030: 64
    /// columns a block), columns from j0 > 0, written and accumulated, against an f64 loop.
    #[test]
    fn blocks_match_a_naive_loop() {
        let (m, k, n, row, j0, dst_row) = (300, 1030, 150, 1040, 3, 157);
        let x: Vec<f64> = (0..m * k).map(|i| (i as f64 * 0.37).sin()).collect();
        let w: Vec<f64> = (0..(n + j0) * row).map(|i| (i as f64 * 0.11).cos()).collect();
        let truth = |i: usize, j: usize| -> f64 { (0..k).map(|p| x[i * k + p] * w[(j0 + j) * row + p]).sum() };
        fn run<T: Scalar>(
            x: &[T],
            w: &[T],
            (m, k, n, row, j0, dst_row): (usize, usize, usize, usize, usize, usize),
            beta: T,
        ) -> Vec<T> {
            let b = Mat { data: w, rows: k, cols: n + j0, row_stride: 1, col_stride: row };
            let mut out = vec![T::default(); m * dst_row];
            for accumulate in [false, true] {
                let job = Job { dims: (m, k, n), a: Mat::rows(x, m, k), b, j0, beta, accumulate };
                // SAFETY: x holds m rows of k; W columns j0..j0 + n of k elements, row apart; the
                // destination m rows of n elements dst_row apart; no aliasing; `accumulate` only
                // after the first product wrote every element.
                unsafe { by_blocks(out.as_mut_ptr(), dst_row, job) };
            }
            out
        }
        let dims = (m, k, n, row, j0, dst_row);
        let got64 = run(&x, &w, dims, 2.0);
        let (x32, w32): (Vec<f32>, Vec<f32>) =
            (x.iter().map(|&v| v as f32).collect(), w.iter().map(|&v| v as f32).collect());
        let got32 = run(&x32, &w32, dims, 2.0f32);
        for i in 0..m {
            for j in 0..n {
                // Written (2·truth), then accumulated (2·truth more).
                let want = 4.0 * truth(i, j);
                assert!((got64[i * dst_row + j] - want).abs() < 1e-9, "f64 ({i}, {j})");
                assert!((got32[i * dst_row + j] as f64 - want).abs() < 4e-3, "f32 ({i}, {j})");
            }
            assert!(got64[i * dst_row + n..(i + 1) * dst_row].iter().all(|&v| v == 0.0));
        }
    }

    /// Panels of every width a CPU may take (32 on AVX2, 64 on AVX-512, whichever this CPU
    /// uses), written and accumulated into rows wider than the product, against an f64 loop: W
    /// inside a wider buffer (columns 1030 deep, 1040 apart), a first column other than 0, a
    /// last panel narrower than the others.
    #[test]
    fn panels_of_each_width_match_a_naive_loop() {
        let (m, k, n, row, j0, dst_row) = (70, 1030, 150, 1040, 3, 157);
        let x: Vec<f32> = (0..m * k).map(|i| (i as f32 * 0.37).sin()).collect();
        let w: Vec<f32> = (0..(n + j0) * row).map(|i| (i as f32 * 0.11).cos()).collect();
        let truth =
            |i: usize, j: usize| -> f64 { (0..k).map(|p| x[i * k + p] as f64 * w[(j0 + j) * row + p] as f64).sum() };
        let b = Mat { data: &w[..], rows: k, cols: n + j0, row_stride: 1, col_stride: row };
        for r in [32, 64] {
            let mut out = vec![f32::NAN; m * dst_row];
            for (accumulate, scale) in [(false, 1.0), (true, 2.0)] {
                let job = Job { dims: (m, k, n), a: Mat::rows(&x, m, k), b, j0, beta: 2.0, accumulate };
                // SAFETY: x holds m rows of k; W columns j0..j0 + n of k elements; the destination
                // m rows of n elements dst_row apart; no aliasing; `accumulate` only after the
                // first product has written every element.
                unsafe { by_panels(out.as_mut_ptr(), dst_row, job, r) };
                for i in 0..m {
                    for j in 0..n {
                        let (got, want) = (out[i * dst_row + j] as f64, 2.0 * scale * truth(i, j));
                        assert!((got - want).abs() < 2e-3, "panels of {r}: ({i}, {j}) {got} against {want}");
                    }
                    // Nothing written between rows.
                    assert!(out[i * dst_row + n..(i + 1) * dst_row].iter().all(|v| v.is_nan()), "panels of {r}");
                }
            }
        }
    }
}
