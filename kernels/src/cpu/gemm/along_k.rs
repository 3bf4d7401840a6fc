//! bf16 products whose operands both lie along the depth — the rows of `a` and the columns of
//! `b` contiguous in k — with few outputs next to a long depth: a weight gradient `dY · colᵀ`
//! over a convolution's positions, where both the output gradient's rows and the unfolded
//! columns' rows run along the positions.
//!
//! Why not the blocked product ([`super::bf16`]): it packs both operands into k-pair panels, a
//! transpose of each here, and uses each packed element only as many times as the other operand
//! has rows — 64 for ResNet's stem and first stage, whose weight gradients ran at 65 G
//! multiply-adds a second on one core against 85–105 for their other products. Here a tile of up
//! to 4 × 4 outputs keeps 16 registers of partial sums, each `vdpbf16ps` multiplying 32 depth
//! elements of one row of `a` and one column of `b` loaded in place, and the registers are
//! summed across their lanes once per product (BENCHMARKS.md, "Convolutional networks at every
//! size (issue 30)").
//!
//! Numerics: each product of two bf16 values is exact in f32; the sums are f32, 16 lanes each
//! summed in depth order, then the lanes (in a fixed order, whatever the thread count).

use half::bf16;

use super::blocking::Mat;
use crate::cpu::SharedMut;

/// Depth below which [`applies`] leaves a product to the blocked kernel: the sums across lanes
/// (one per output) then weigh more next to fewer multiply-adds.
const MIN_DEPTH: usize = 2048;

/// Rows (or columns) of the smaller side of the destination above which [`applies`] leaves a
/// product to the blocked kernel: its packed panels are then used often enough (ResNet-50's
/// 256 → 128 1×1 weight gradient at 56²: 80 G/s blocked, 79 here; 64 → 256: 66 against 77;
/// one core, `cargo bench -p wick-kernels --bench r50_pointwise`).
const MAX_SIDE: usize = 64;

/// True when [`product`] takes `a · b`: the rows of `a` and the columns of `b` contiguous along
/// k, a depth of at least [`MIN_DEPTH`], at most [`MAX_SIDE`] rows or columns of destination, and
/// a CPU with AVX512-BF16 and AVX512-BW (masked 16-bit loads).
pub(crate) fn applies(a: &Mat<'_, bf16>, b: &Mat<'_, bf16>) -> bool {
    a.col_stride == 1
        && b.row_stride == 1
        && a.cols >= MIN_DEPTH
        && a.rows.min(b.cols) <= MAX_SIDE
        && a.rows > 0
        && b.cols > 0
        && available()
}

fn available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        super::bf16::available() && std::is_x86_feature_detected!("avx512bw")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// `dst (m × n, row-major) = beta·a·b + (dst if accumulate)` where [`applies`] holds and the
/// shapes were checked against the slices ([`super::blocking::product_dims`]). The larger side of
/// the destination is cut into blocks of four, each swept against the whole smaller side (which
/// stays in the cache); the blocks are split between threads when `parallel`.
pub(crate) fn product(
    dst: &mut [f32],
    a: Mat<'_, bf16>,
    b: Mat<'_, bf16>,
    beta: f32,
    accumulate: bool,
    parallel: bool,
) {
    let (m, k, n) = (a.rows, a.cols, b.cols);
    // Row r of `a` and column c of `b` as runs of k elements.
    let (a_run, b_run) = (a.row_stride, b.col_stride);
    let rows_outer = m >= n;
    let (outer, inner) = if rows_outer { (m, n) } else { (n, m) };
    let out = SharedMut::new(&mut dst[..m * n]);
    let work = |blocks: std::ops::Range<usize>| {
        for ob in blocks {
            let o0 = ob * 4;
            let on = 4.min(outer - o0);
            for i0 in (0..inner).step_by(4) {
                let inn = 4.min(inner - i0);
                let ((r0, rn), (c0, cn)) = if rows_outer { ((o0, on), (i0, inn)) } else { ((i0, inn), (o0, on)) };
                let rows: [usize; 4] = std::array::from_fn(|i| (r0 + i.min(rn - 1)) * a_run);
                let cols: [usize; 4] = std::array::from_fn(|i| (c0 + i.min(cn - 1)) * b_run);
                // SAFETY: the CPU has AVX512-BF16 and AVX512-BW (`applies`); every run starts at
                // a row of `a` (column of `b`) inside the checked shape and holds k elements
                // (`product_dims` checked the last element of each operand).
                let sums = unsafe { tile(a.data, rows, b.data, cols, k) };
                for (i, row) in sums.iter().enumerate().take(rn) {
                    // SAFETY: row r0 + i, columns c0..c0 + cn of the destination: this block's
                    // only (blocks split the outer side).
                    let d = unsafe { out.range((r0 + i) * n + c0, cn) };
                    for (d, s) in d.iter_mut().zip(row) {
                        *d = if accumulate { *d + beta * s } else { beta * s };
                    }
                }
            }
        }
    };
    let blocks = outer.div_ceil(4);
    if parallel {
        crate::cpu::par_ranges(blocks, 1, work);
    } else {
        work(0..blocks);
    }
}

/// `sums[r][c] = Σ_p a[rows[r] + p] · b[cols[c] + p]` over `k` elements, f32 sums.
///
/// # Safety
/// The CPU has AVX512-BF16, AVX512-BW and AVX-512F; each run `rows[r]..rows[r] + k` lies inside
/// `a` and `cols[c]..cols[c] + k` inside `b`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512bf16,avx512bw,avx512f")]
pub(crate) unsafe fn tile(a: &[bf16], rows: [usize; 4], b: &[bf16], cols: [usize; 4], k: usize) -> [[f32; 4]; 4] {
    use std::arch::x86_64::*;
    assert!(
        rows.iter().all(|r| r + k <= a.len()) && cols.iter().all(|c| c + k <= b.len()),
        "along_k: a run outside its operand"
    );
    let mut acc = [[_mm512_setzero_ps(); 4]; 4];
    let (ap, bp) = (a.as_ptr(), b.as_ptr());
    let mut p = 0;
    while p < k {
        let lanes = (k - p).min(32);
        let mask: __mmask32 = if lanes == 32 { u32::MAX } else { (1u32 << lanes) - 1 };
        // SAFETY: elements p..p + lanes of each run (checked above; masked loads read no
        // others). Written out: a version that built the four loads with `std::array::from_fn`
        // ran at 54 G/s against 88 (one core, 64 × 25088 × 64; under target features its
        // closure is not inlined: BENCHMARKS.md, "bf16 packing without `std::array::from_fn`").
        unsafe {
            let b0: __m512bh = std::mem::transmute(_mm512_maskz_loadu_epi16(mask, bp.add(cols[0] + p).cast()));
            let b1: __m512bh = std::mem::transmute(_mm512_maskz_loadu_epi16(mask, bp.add(cols[1] + p).cast()));
            let b2: __m512bh = std::mem::transmute(_mm512_maskz_loadu_epi16(mask, bp.add(cols[2] + p).cast()));
            let b3: __m512bh = std::mem::transmute(_mm512_maskz_loadu_epi16(mask, bp.add(cols[3] + p).cast()));
            for (r, sums) in acc.iter_mut().enumerate() {
                let av: __m512bh = std::mem::transmute(_mm512_maskz_loadu_epi16(mask, ap.add(rows[r] + p).cast()));
                sums[0] = _mm512_dpbf16_ps(sums[0], av, b0);
                sums[1] = _mm512_dpbf16_ps(sums[1], av, b1);
                sums[2] = _mm512_dpbf16_ps(sums[2], av, b2);
                sums[3] = _mm512_dpbf16_ps(sums[3], av, b3);
            }
        }
        p += 32;
    }
    let mut sums = [[0f32; 4]; 4];
    for (row, acc) in sums.iter_mut().zip(&acc) {
        for (s, a) in row.iter_mut().zip(acc) {
            *s = _mm512_reduce_add_ps(*a);
        }
    }
    sums
}

#[cfg(not(target_arch = "x86_64"))]
pub(crate) unsafe fn tile(_: &[bf16], _: [usize; 4], _: &[bf16], _: [usize; 4], _: usize) -> [[f32; 4]; 4] {
    unreachable!("along_k::product checks applies() first")
}
