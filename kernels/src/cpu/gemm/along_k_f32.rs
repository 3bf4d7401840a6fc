//! f32 products whose operands both lie along the depth — the rows of `a` and the columns of
//! `b` contiguous in k — read in place: a linear layer's forward `x · Wᵀ`, x (tokens × in) and W
//! (out × in) both row-major.
//!
//! Why not the `gemm` crate: it packs W into panels at every call (W is the larger operand of an
//! inference product: 384 × 1536 against a dozen tokens for one short sentence), and for a few
//! rows the packing is most of the product's time ([`MAX_ROWS`] says where the crate takes over).
//! Here a tile of R rows of `a` × 4 columns of `b` keeps R · 4 registers of partial sums over a
//! block of depth, each element of `a` and `b` loaded in place once per tile, and the registers
//! are summed across their lanes once per tile and block (a transposing `hadd` network: five
//! instructions for four sums).
//!
//! Blocking: depth in blocks of [`KC`] (one tile's rows of both operands stay in L1), the
//! columns of `b` in blocks of [`NB`] swept against every row of `a` (the block stays in L2).
//! Threads take blocks of the destination's larger side.
//!
//! Numerics: f32 sums; each destination element is summed in the same order whatever m, n and
//! the thread count (lanes in depth order within a block, the lanes in a fixed order, the
//! blocks in depth order), so a product over a batch and over its halves agree to the bit while
//! both take this kernel (up to [`MAX_ROWS`] rows; larger products go to the `gemm` crate).
//!
//! Instruction sets: AVX-512F (4 × 4 tiles of 16 lanes), AVX2 with FMA (3 × 4 tiles of 8 lanes:
//! twelve sums, three rows and one column in flight fill the 16 registers); elsewhere, or with
//! `WICK_CPU_AVX512=0` for the AVX2 kernel on an AVX-512 CPU ([`crate::cpu::avx512`]), as
//! detected.

use super::blocking::Mat;
use crate::cpu::SharedMut;

/// Depth of a block: R + 4 runs of 512 f32 (16 KiB at R = 4) stay in a 32 KiB L1.
const KC: usize = 512;

/// Columns of `b` swept together against every row of `a`: 64 runs of a depth block (128 KiB).
const NB: usize = 64;

/// Depth below which [`applies`] leaves a product to the `gemm` crate: the sums across lanes then
/// weigh more next to fewer multiply-adds.
const MIN_DEPTH: usize = 128;

/// Rows of `a` above which [`applies`] leaves a product to the `gemm` crate. Up to here the
/// crate's packing of W costs more than the product: all-MiniLM-L6-v2's sentences of 6–40 tokens
/// one at a time, 147 sentences a second with this kernel against 90 through the crate (two
/// threads, processes alternating with PyTorch's). From 128 rows on, whole models ran bimodally
/// per process with this kernel (BERT-base at one 128-token sentence: 140–230 ms a pass against
/// 188 through the crate; MiniLM 30 against 23.5), though it led in the product bench; the crate
/// takes them (BENCHMARKS.md, "Transformer inference (issue 50)").
const MAX_ROWS: usize = 64;

/// The kernel this CPU runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Isa {
    Avx512,
    Avx2,
}

impl Isa {
    /// Rows of `a` in one tile.
    fn tile_rows(self) -> usize {
        match self {
            Isa::Avx512 => 4,
            Isa::Avx2 => 3,
        }
    }
}

fn isa() -> Option<Isa> {
    #[cfg(target_arch = "x86_64")]
    {
        if crate::cpu::avx512() {
            return Some(Isa::Avx512);
        }
        if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
            return Some(Isa::Avx2);
        }
    }
    None
}

/// True when [`product`] takes `a · b`: the rows of `a` and the columns of `b` contiguous along
/// k, a depth of at least [`MIN_DEPTH`], at most [`MAX_ROWS`] rows, a non-empty destination, and
/// a CPU with AVX2 and FMA.
pub(crate) fn applies(a: &Mat<'_, f32>, b: &Mat<'_, f32>) -> bool {
    a.col_stride == 1
        && b.row_stride == 1
        && a.cols >= MIN_DEPTH
        && (1..=MAX_ROWS).contains(&a.rows)
        && b.cols > 0
        && isa().is_some()
}

/// `dst (m × n, rows dst_row apart) = beta·a·b + (dst if accumulate)` where [`applies`] holds
/// and the shapes were checked against the slices (`super::gemm_rows_apart`).
pub(crate) fn product(
    dst: &mut [f32],
    dst_row: usize,
    a: Mat<'_, f32>,
    b: Mat<'_, f32>,
    beta: f32,
    accumulate: bool,
    parallel: bool,
) {
    let Some(isa) = isa() else { return };
    let (m, n) = (a.rows, b.cols);
    let rows_per_tile = isa.tile_rows();
    let out = SharedMut::new(dst);
    // Threads split the larger side of the destination: column blocks of `b`, or row blocks of
    // `a` as long as the rows of one tile.
    let by_columns = n >= m;
    let (units, unit) =
        if by_columns { (n.div_ceil(NB), NB) } else { (m.div_ceil(rows_per_tile * 8), rows_per_tile * 8) };
    let work = |range: std::ops::Range<usize>| {
        let (lo, hi) = (range.start * unit, (range.end * unit).min(if by_columns { n } else { m }));
        let (rows, cols) = if by_columns { (0..m, lo..hi) } else { (lo..hi, 0..n) };
        block((&out, dst_row), a, b, (rows, cols), (beta, accumulate), isa);
    };
    if parallel {
        crate::cpu::par_ranges(units, 1, work);
    } else {
        work(0..units);
    }
}

/// The destination's rows × cols part of the product, depth block by depth block.
fn block(
    (out, dst_row): (&SharedMut<'_, f32>, usize),
    a: Mat<'_, f32>,
    b: Mat<'_, f32>,
    (rows, cols): (std::ops::Range<usize>, std::ops::Range<usize>),
    (beta, accumulate): (f32, bool),
    isa: Isa,
) {
    let k = a.cols;
    let r_tile = isa.tile_rows();
    for k0 in (0..k).step_by(KC) {
        let kc = KC.min(k - k0);
        // The first depth block writes (or adds to what was there); later ones add.
        let add = accumulate || k0 > 0;
        for c_block in (cols.start..cols.end).step_by(NB) {
            let c_end = (c_block + NB).min(cols.end);
            for r0 in (rows.start..rows.end).step_by(r_tile) {
                let rn = r_tile.min(rows.end - r0);
                let a_runs: [usize; 4] = std::array::from_fn(|i| (r0 + i.min(rn - 1)) * a.row_stride + k0);
                for c0 in (c_block..c_end).step_by(4) {
                    let cn = 4.min(c_end - c0);
                    let b_runs: [usize; 4] = std::array::from_fn(|j| (c0 + j.min(cn - 1)) * b.col_stride + k0);
                    // SAFETY: `isa` was detected on this CPU; each run starts at row r0 + i of
                    // `a` (column c0 + j of `b`) at depth k0 and holds kc ≤ k − k0 elements, all
                    // inside the operand (`product_dims` checked its last element).
                    let sums = unsafe {
                        match isa {
                            Isa::Avx512 => tile_avx512(a.data, a_runs, b.data, b_runs, kc),
                            Isa::Avx2 => tile_avx2(a.data, a_runs, b.data, b_runs, kc),
                        }
                    };
                    for (i, row) in sums.iter().enumerate().take(rn) {
                        // SAFETY: row r0 + i, columns c0..c0 + cn: inside this call's part of
                        // the destination, which no other thread writes (parts split one side).
                        let d = unsafe { out.range((r0 + i) * dst_row + c0, cn) };
                        for (d, s) in d.iter_mut().zip(row) {
                            *d = if add { *d + beta * s } else { beta * s };
                        }
                    }
                }
            }
        }
    }
}

/// `sums[r][c] = Σ_p a[a_runs[r] + p] · b[b_runs[c] + p]` over `k` elements (rows 0..4).
///
/// # Safety
/// The CPU has AVX-512F; each run `a_runs[r]..a_runs[r] + k` lies inside `a` and
/// `b_runs[c]..b_runs[c] + k` inside `b`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn tile_avx512(a: &[f32], a_runs: [usize; 4], b: &[f32], b_runs: [usize; 4], k: usize) -> [[f32; 4]; 4] {
    use std::arch::x86_64::*;
    assert!(
        a_runs.iter().all(|r| r + k <= a.len()) && b_runs.iter().all(|c| c + k <= b.len()),
        "along_k_f32: a run outside its operand"
    );
    let (ap, bp) = (a.as_ptr(), b.as_ptr());
    let mut acc = [[_mm512_setzero_ps(); 4]; 4];
    let full = k - k % 16;
    let mut p = 0;
    // SAFETY: elements p..p + 16 of each run, p + 16 ≤ full ≤ k (checked above). Written out,
    // as `along_k`'s bf16 tile: closures are not inlined under target features.
    unsafe {
        while p < full {
            let b0 = _mm512_loadu_ps(bp.add(b_runs[0] + p));
            let b1 = _mm512_loadu_ps(bp.add(b_runs[1] + p));
            let b2 = _mm512_loadu_ps(bp.add(b_runs[2] + p));
            let b3 = _mm512_loadu_ps(bp.add(b_runs[3] + p));
            for (r, sums) in acc.iter_mut().enumerate() {
                let av = _mm512_loadu_ps(ap.add(a_runs[r] + p));
                sums[0] = _mm512_fmadd_ps(av, b0, sums[0]);
                sums[1] = _mm512_fmadd_ps(av, b1, sums[1]);
                sums[2] = _mm512_fmadd_ps(av, b2, sums[2]);
                sums[3] = _mm512_fmadd_ps(av, b3, sums[3]);
            }
            p += 16;
        }
    }
    if p < k {
        let mask: __mmask16 = (1u16 << (k - p)) - 1;
        // SAFETY: the masked loads read elements p..k of each run only (checked above).
        unsafe {
            let b0 = _mm512_maskz_loadu_ps(mask, bp.add(b_runs[0] + p));
            let b1 = _mm512_maskz_loadu_ps(mask, bp.add(b_runs[1] + p));
            let b2 = _mm512_maskz_loadu_ps(mask, bp.add(b_runs[2] + p));
            let b3 = _mm512_maskz_loadu_ps(mask, bp.add(b_runs[3] + p));
            for (r, sums) in acc.iter_mut().enumerate() {
                let av = _mm512_maskz_loadu_ps(mask, ap.add(a_runs[r] + p));
                sums[0] = _mm512_fmadd_ps(av, b0, sums[0]);
                sums[1] = _mm512_fmadd_ps(av, b1, sums[1]);
                sums[2] = _mm512_fmadd_ps(av, b2, sums[2]);
                sums[3] = _mm512_fmadd_ps(av, b3, sums[3]);
            }
        }
    }
    let mut sums = [[0f32; 4]; 4];
    for (row, acc) in sums.iter_mut().zip(&acc) {
        *row = four_sums(halves(acc[0]), halves(acc[1]), halves(acc[2]), halves(acc[3]));
    }
    sums
}

/// 16 lanes to 8: the two halves of `v` added.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2")]
#[inline]
fn halves(v: std::arch::x86_64::__m512) -> std::arch::x86_64::__m256 {
    use std::arch::x86_64::*;
    let high = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v)));
    _mm256_add_ps(_mm512_castps512_ps256(v), high)
}

/// `sums[r][c]` as [`tile_avx512`] for rows 0..3 (row 3 is left zero).
///
/// # Safety
/// The CPU has AVX2 and FMA; the runs of rows 0..3 and of every column lie inside their operand.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn tile_avx2(a: &[f32], a_runs: [usize; 4], b: &[f32], b_runs: [usize; 4], k: usize) -> [[f32; 4]; 4] {
    use std::arch::x86_64::*;
    assert!(
        a_runs[..3].iter().all(|r| r + k <= a.len()) && b_runs.iter().all(|c| c + k <= b.len()),
        "along_k_f32: a run outside its operand"
    );
    let (ap, bp) = (a.as_ptr(), b.as_ptr());
    let mut acc = [[_mm256_setzero_ps(); 4]; 3];
    let full = k - k % 8;
    let mut p = 0;
    // SAFETY: elements p..p + 8 of each run, p + 8 ≤ full ≤ k (checked above).
    unsafe {
        while p < full {
            let a0 = _mm256_loadu_ps(ap.add(a_runs[0] + p));
            let a1 = _mm256_loadu_ps(ap.add(a_runs[1] + p));
            let a2 = _mm256_loadu_ps(ap.add(a_runs[2] + p));
            for (c, &run) in b_runs.iter().enumerate() {
                let bv = _mm256_loadu_ps(bp.add(run + p));
                acc[0][c] = _mm256_fmadd_ps(a0, bv, acc[0][c]);
                acc[1][c] = _mm256_fmadd_ps(a1, bv, acc[1][c]);
                acc[2][c] = _mm256_fmadd_ps(a2, bv, acc[2][c]);
            }
            p += 8;
        }
    }
    if p < k {
        // The last k mod 8 elements through a lane mask (maskload reads no masked-off element).
        let lanes = (k - p) as i32;
        let mask = _mm256_setr_epi32(
            -((lanes > 0) as i32),
            -((lanes > 1) as i32),
            -((lanes > 2) as i32),
            -((lanes > 3) as i32),
            -((lanes > 4) as i32),
            -((lanes > 5) as i32),
            -((lanes > 6) as i32),
            0,
        );
        // SAFETY: the masked loads read elements p..k of each run only (checked above).
        unsafe {
            let a0 = _mm256_maskload_ps(ap.add(a_runs[0] + p), mask);
            let a1 = _mm256_maskload_ps(ap.add(a_runs[1] + p), mask);
            let a2 = _mm256_maskload_ps(ap.add(a_runs[2] + p), mask);
            for (c, &run) in b_runs.iter().enumerate() {
                let bv = _mm256_maskload_ps(bp.add(run + p), mask);
                acc[0][c] = _mm256_fmadd_ps(a0, bv, acc[0][c]);
                acc[1][c] = _mm256_fmadd_ps(a1, bv, acc[1][c]);
                acc[2][c] = _mm256_fmadd_ps(a2, bv, acc[2][c]);
            }
        }
    }
    let mut sums = [[0f32; 4]; 4];
    for (row, acc) in sums.iter_mut().zip(&acc) {
        *row = four_sums(acc[0], acc[1], acc[2], acc[3]);
    }
    sums
}

/// The sums of the eight lanes of each of `a`, `b`, `c` and `d`: two `hadd`s pair the lanes
/// within each 128-bit half, a third gathers the four vectors, and the halves are added.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
fn four_sums(
    a: std::arch::x86_64::__m256,
    b: std::arch::x86_64::__m256,
    c: std::arch::x86_64::__m256,
    d: std::arch::x86_64::__m256,
) -> [f32; 4] {
    use std::arch::x86_64::*;
    let ab = _mm256_hadd_ps(a, b);
    let cd = _mm256_hadd_ps(c, d);
    let all = _mm256_hadd_ps(ab, cd);
    let s = _mm_add_ps(_mm256_castps256_ps128(all), _mm256_extractf128_ps::<1>(all));
    let mut out = [0f32; 4];
    // SAFETY: `out` holds four f32.
    unsafe { _mm_storeu_ps(out.as_mut_ptr(), s) };
    out
}

#[cfg(not(target_arch = "x86_64"))]
unsafe fn tile_avx512(_: &[f32], _: [usize; 4], _: &[f32], _: [usize; 4], _: usize) -> [[f32; 4]; 4] {
    unreachable!("along_k_f32::isa() is None off x86-64")
}

#[cfg(not(target_arch = "x86_64"))]
unsafe fn tile_avx2(_: &[f32], _: [usize; 4], _: &[f32], _: [usize; 4], _: usize) -> [[f32; 4]; 4] {
    unreachable!("along_k_f32::isa() is None off x86-64")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data(len: usize, seed: u64) -> Vec<f32> {
        (0..len).map(|i| ((((i as u64 + 3) * seed) % 1009) as f32 / 1009.0) - 0.5).collect()
    }

    /// f64 sums of the same products.
    fn naive(a: Mat<'_, f32>, b: Mat<'_, f32>) -> Vec<f64> {
        let mut out = vec![0.0; a.rows * b.cols];
        for i in 0..a.rows {
            for j in 0..b.cols {
                out[i * b.cols + j] = (0..a.cols)
                    .map(|p| {
                        a.data[i * a.row_stride + p * a.col_stride] as f64
                            * b.data[p * b.row_stride + j * b.col_stride] as f64
                    })
                    .sum();
            }
        }
        out
    }

    /// Both kernels this CPU can run (AVX2 on an AVX-512 CPU too).
    fn kernels() -> Vec<Isa> {
        let mut v = Vec::new();
        #[cfg(target_arch = "x86_64")]
        {
            if std::is_x86_feature_detected!("avx512f") {
                v.push(Isa::Avx512);
            }
            if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
                v.push(Isa::Avx2);
            }
        }
        if v.is_empty() {
            eprintln!("note: no AVX2 here: the f32 products along the depth are not tested");
        }
        v
    }

    /// The whole destination through `block` with one kernel, as `product` runs it on one thread.
    fn run(isa: Isa, dst: &mut [f32], a: Mat<'_, f32>, b: Mat<'_, f32>, beta: f32, accumulate: bool) {
        let (m, n) = (a.rows, b.cols);
        let out = SharedMut::new(&mut dst[..m * n]);
        block((&out, n), a, b, (0..m, 0..n), (beta, accumulate), isa);
    }

    #[test]
    fn products_match_f64_sums_at_ragged_shapes_for_each_kernel() {
        // Rows and columns that leave partial tiles, depths with partial vectors and more than
        // one depth block, row strides wider than the depth.
        for isa in kernels() {
            for (m, k, n) in [(1, 128, 1), (5, 130, 7), (13, 515, 66), (4, 1030, 130), (128, 768, 9), (3, 1543, 4)] {
                let (a_stride, w_stride) = (k + 3, k + 1);
                let av = data(m * a_stride, 37);
                let wv = data(n * w_stride, 53);
                let a = Mat { data: &av, rows: m, cols: k, row_stride: a_stride, col_stride: 1 };
                let b = Mat { data: &wv, rows: n, cols: k, row_stride: w_stride, col_stride: 1 }.t();
                let expected = naive(a, b);
                let mut dst = vec![7.0f32; m * n];
                run(isa, &mut dst, a, b, 1.0, false);
                for (got, want) in dst.iter().zip(&expected) {
                    // f32 sums of k products of values in ±0.5.
                    assert!((*got as f64 - want).abs() <= 1e-6 * k as f64, "{isa:?} {m}×{k}×{n}: {got} vs {want}");
                }
                // Accumulating adds beta times the product to what is there.
                run(isa, &mut dst, a, b, -2.0, true);
                for (got, want) in dst.iter().zip(&expected) {
                    assert!((*got as f64 + want).abs() <= 3e-6 * k as f64, "{isa:?} accumulate {m}×{k}×{n}");
                }
            }
        }
    }

    #[test]
    fn each_output_is_the_same_to_the_bit_whatever_the_batch_and_the_threads() {
        // A batch's product and its halves' (the two ranks of data-parallel training) agree to
        // the bit, one thread or the pool, split by rows or by columns.
        let (m, k, n) = (24, 700, 150);
        let (av, wv) = (data(m * k, 41), data(n * k, 43));
        let b = Mat::rows(&wv, n, k).t();
        if !applies(&Mat::rows(&av, m, k), &b) {
            eprintln!("note: no AVX2 here: nothing to compare");
            return;
        }
        let mut whole = vec![0f32; m * n];
        product(&mut whole, n, Mat::rows(&av, m, k), b, 1.0, false, true);
        for rows in [1, 3, 12, 24] {
            for parallel in [false, true] {
                let mut part = vec![0f32; rows * n];
                product(&mut part, n, Mat::rows(&av[..rows * k], rows, k), b, 1.0, false, parallel);
                assert_eq!(part, whole[..rows * n], "{rows} rows, parallel {parallel}");
            }
        }
        // A tall product (split by rows) against the same rows in a wide one's layout.
        let mut tall = vec![0f32; m * 8];
        product(&mut tall, 8, Mat::rows(&av, m, k), Mat::rows(&wv[..8 * k], 8, k).t(), 1.0, false, true);
        for i in 0..m {
            assert_eq!(tall[i * 8..(i + 1) * 8], whole[i * n..i * n + 8]);
        }
    }
}
