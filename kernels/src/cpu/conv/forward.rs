//! The forward pass of [`super::conv_bf16`]: images rearranged into channel pairs, the
//! micro-kernel over (positions × 32 output channels) and its transposed stores.

use half::bf16;

use super::pack::{tap_lanes, PackedWeights};
#[cfg(target_arch = "x86_64")]
use super::transpose16;
use super::{available, buffer_len, error, expect_len, ConvDims, MR, NB};
use crate::cpu::{par_ranges, KernelError, SharedMut};

/// Images in a padded channels-last layout of channel pairs: element `((b·hp + y)·wp + x)·cp + q`
/// holds channels `2q` (low half) and `2q + 1` (high half) of image `b` at padded position
/// `(y, x)`; the padding and a missing last channel are zeros.
pub struct ChannelsLast {
    data: Vec<u32>,
    dims: ConvDims,
}

impl ChannelsLast {
    /// `x` (n, c_in, h, w), contiguous, rearranged; parallel over image rows.
    pub fn new(x: &[bf16], dims: ConvDims) -> Result<Self, KernelError> {
        dims.out_hw()?;
        let (hp, wp) = dims.padded();
        let cp = dims.pairs();
        expect_len(x.len(), &[dims.n, dims.c_in, dims.h, dims.w], "image elements", &dims)?;
        let len = buffer_len(&[dims.n, hp, wp, cp], "padded images", &dims)?;
        let mut data = vec![0u32; len];
        let out = SharedMut::new(&mut data);
        let (c, h, w, p) = (dims.c_in, dims.h, dims.w, dims.pad);
        let wide = available();
        // One work item per image row (its padded row: the padding columns stay zero).
        par_ranges(dims.n * h, 8, |rows| {
            for r in rows {
                let (b, y) = (r / h, r % h);
                // SAFETY: padded row (b, y + p) is this row's only.
                let dst = unsafe { out.range(((b * hp + y + p) * wp + p) * cp, w * cp) };
                let image = &x[b * c * h * w..][..c * h * w];
                if wide {
                    // SAFETY: the CPU has AVX-512F, BW and VL (`available`).
                    unsafe { pairs_row_avx512(image, (c, h, w), y, dst) };
                } else {
                    pairs_row(image, (c, h, w), y, dst);
                }
            }
        });
        Ok(ChannelsLast { data, dims })
    }
}

/// Row `y` of `image` (c, h, w) as channel pairs: `dst[x · cp + q]` holds channels 2q and
/// 2q + 1 at column x (the high half zero past the last channel).
pub(super) fn pairs_row(image: &[bf16], (c, h, w): (usize, usize, usize), y: usize, dst: &mut [u32]) {
    let cp = c.div_ceil(2);
    let src = |ch: usize| &image[(ch * h + y) * w..][..w];
    for q in 0..cp {
        let lo = src(2 * q);
        let hi = if 2 * q + 1 < c { Some(src(2 * q + 1)) } else { None };
        for (i, l) in lo.iter().enumerate() {
            let h16 = hi.map_or(0, |hi| hi[i].to_bits() as u32);
            dst[i * cp + q] = l.to_bits() as u32 | (h16 << 16);
        }
    }
}

/// [`pairs_row`] 16 columns × 16 pairs at a time: the two channels' 16 values widened and
/// joined into one register per pair, the 16 registers transposed into one per column.
///
/// # Safety
/// The CPU has AVX-512F, BW and VL.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
pub(super) unsafe fn pairs_row_avx512(image: &[bf16], (c, h, w): (usize, usize, usize), y: usize, dst: &mut [u32]) {
    use std::arch::x86_64::*;
    let cp = c.div_ceil(2);
    assert!(image.len() >= c * h * w && y < h && dst.len() >= w * cp, "conv_bf16: a row outside its image");
    for q0 in (0..cp).step_by(16) {
        let qn = 16.min(cp - q0);
        for x0 in (0..w).step_by(16) {
            let xn = 16.min(w - x0);
            let load = ((1u32 << xn) - 1) as u16;
            let mut rows = [_mm512_setzero_si512(); 16];
            for (qq, row) in rows.iter_mut().enumerate().take(qn) {
                let ch = 2 * (q0 + qq);
                // SAFETY: channel ch (and ch + 1 when present) of the image, row y, columns
                // x0..x0 + xn: inside `image` (checked above); lanes past xn are not read.
                unsafe {
                    let at = |ch: usize| image.as_ptr().add((ch * h + y) * w + x0).cast::<i16>();
                    let lo = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(load, at(ch)));
                    let hi = if ch + 1 < c {
                        _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(load, at(ch + 1)))
                    } else {
                        _mm512_setzero_si512()
                    };
                    *row = _mm512_or_si512(lo, _mm512_slli_epi32::<16>(hi));
                }
            }
            let cols = transpose16(rows);
            let store = ((1u32 << qn) - 1) as u16;
            for (xx, col) in cols.iter().enumerate().take(xn) {
                // SAFETY: pairs q0..q0 + qn of column x0 + xx, inside `dst` (checked above).
                unsafe { _mm512_mask_storeu_epi32(dst.as_mut_ptr().add((x0 + xx) * cp + q0).cast(), store, *col) };
            }
        }
    }
}

#[cfg(not(target_arch = "x86_64"))]
pub(super) unsafe fn pairs_row_avx512(image: &[bf16], dims: (usize, usize, usize), y: usize, dst: &mut [u32]) {
    pairs_row(image, dims, y, dst)
}

/// The convolution of `x` with `w` into `dst` (n, c_out, oh, ow), each sum rounded to bf16
/// once; parallel over (image, block of 32 output channels). An error when the two were
/// prepared for other dimensions, `dst` has the wrong length, or the CPU lacks AVX512-BF16.
pub fn conv_bf16(dst: &mut [bf16], x: &ChannelsLast, w: &PackedWeights) -> Result<(), KernelError> {
    if x.dims != w.dims {
        return Err(error(format!("images prepared for {:?}, weights for {:?}", x.dims, w.dims)));
    }
    if !available() {
        return Err(error("this CPU has no AVX512-BF16".into()));
    }
    let d = x.dims;
    let (oh, ow) = d.out_hw()?;
    let plane = oh * ow;
    expect_len(dst.len(), &[d.n, d.c_out, plane], "output elements", &d)?;
    let (hp, wp) = d.padded();
    let (cp, taps, blocks) = (d.pairs(), d.k * d.k, d.c_out.div_ceil(NB));
    let block = taps * tap_lanes(cp);
    if d.n == 0 || plane == 0 || d.c_out == 0 {
        return Ok(());
    }
    // The last window's last pair lies inside the images (every read below is at most this far).
    let last = ((d.n - 1) * hp + (oh - 1) * d.stride + d.k - 1) * wp + (ow - 1) * d.stride + d.k - 1;
    assert!((last + 1) * cp <= x.data.len() && blocks * block <= w.data.len(), "conv_bf16: short operands");
    // Offsets of the taps from a window's first element, in pairs.
    let tap_at: Vec<usize> = (0..taps).map(|t| ((t / d.k) * wp + t % d.k) * cp).collect();
    let out = SharedMut::new(dst);
    par_ranges(d.n * blocks, 1, |items| {
        for item in items {
            let (b, cb) = (item / blocks, item % blocks);
            let couts = NB.min(d.c_out - cb * NB);
            // SAFETY: image b's output channels of block cb are this item's only.
            let dst = unsafe { out.range((b * d.c_out + cb * NB) * plane, couts * plane) };
            let wb = &w.data[cb * block..][..block];
            for p0 in (0..plane).step_by(MR) {
                let height = MR.min(plane - p0);
                let mut at = [0usize; MR];
                for (i, a) in at.iter_mut().enumerate() {
                    // A ragged tile repeats its last position (its sums are not stored).
                    let p = (p0 + i).min(plane - 1);
                    *a = ((b * hp + (p / ow) * d.stride) * wp + (p % ow) * d.stride) * cp;
                }
                let tile = Tile { dst: &mut *dst, plane, p0, height, couts };
                // SAFETY: the CPU has AVX512-BF16 (checked); every window of a valid position
                // lies inside image b's padded rows, so `at[i] + tap_at[t] + q` < x's length
                // for every tap and pair; `wb` holds the lanes of every tap.
                unsafe { micro_kernel(&x.data, &at, &tap_at, cp, wb, tile) };
            }
        }
    });
    Ok(())
}

/// Where a micro-tile's sums go: positions `p0..p0 + height` of the first `couts` of 32
/// output planes (`plane` positions each) in `dst`.
struct Tile<'a> {
    dst: &'a mut [bf16],
    plane: usize,
    p0: usize,
    height: usize,
    couts: usize,
}

/// The `MR × 32` sums of one tile, rounded to bf16 and stored into `tile`: position `i`'s
/// window starts at pair `at[i]` of `x`, tap `t` `tap_at[t]` further, and the weights run
/// (pair, 32 channels) through `w` from tap `t`'s start, `t · tap_lanes(cp)`.
///
/// # Safety
/// The CPU has AVX512-BF16, AVX-512F, BW and VL; `at[i] + tap_at[t] + cp − 1 < x.len()` for
/// every i and t; `w` holds the lanes of `tap_at.len()` taps.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512bf16,avx512f,avx512bw,avx512vl")]
unsafe fn micro_kernel(x: &[u32], at: &[usize; MR], tap_at: &[usize], cp: usize, w: &[u32], tile: Tile<'_>) {
    use std::arch::x86_64::*;
    let Tile { dst, plane, p0, height, couts } = tile;
    assert!(
        height <= MR && p0 + height <= plane && couts <= NB && couts * plane <= dst.len(),
        "conv_bf16: a tile outside its planes"
    );
    let tl = tap_lanes(cp);
    assert!(w.len() >= tap_at.len() * tl, "conv_bf16: short weights");
    let mut acc = [[_mm512_setzero_ps(); 2]; MR];
    let base = x.as_ptr();
    for (ti, &t) in tap_at.iter().enumerate() {
        let mut wp = w[ti * tl..].as_ptr();
        let mut rows = [base; MR];
        for (r, a) in rows.iter_mut().zip(at) {
            // SAFETY: inside x (the caller's contract).
            *r = unsafe { base.add(a + t) };
        }
        for q in 0..cp {
            // SAFETY: 32 lanes of w at wp (checked length), pair q of each window inside x.
            unsafe {
                let w0: __m512bh = std::mem::transmute(_mm512_loadu_si512(wp.cast()));
                let w1: __m512bh = std::mem::transmute(_mm512_loadu_si512(wp.add(16).cast()));
                for (sums, r) in acc.iter_mut().zip(&rows) {
                    let a: __m512bh = std::mem::transmute(_mm512_set1_epi32(*r.add(q) as i32));
                    sums[0] = _mm512_dpbf16_ps(sums[0], a, w0);
                    sums[1] = _mm512_dpbf16_ps(sums[1], a, w1);
                }
                wp = wp.add(NB);
            }
        }
    }
    // Each register of 16 output channels at the MR positions, transposed (16 × 16, the rows
    // past MR zero) into 16 runs of positions, rounded to bf16 (`vcvtneps2bf16`: to nearest
    // even, as `round_bf16`) and stored, `height` lanes of each.
    let mask: __mmask16 = ((1u32 << height) - 1) as u16;
    for v in 0..2 {
        let mut rows = [_mm512_setzero_si512(); 16];
        for (r, sums) in rows.iter_mut().zip(&acc) {
            *r = _mm512_castps_si512(sums[v]);
        }
        let runs = transpose16(rows);
        for (jj, run) in runs.iter().enumerate().take(couts.saturating_sub(16 * v)) {
            let h: __m256bh = _mm512_cvtneps_pbh(_mm512_castsi512_ps(*run));
            // SAFETY: plane 16v + jj < couts, positions p0..p0 + height inside it (checked).
            unsafe {
                let at = dst.as_mut_ptr().add((16 * v + jj) * plane + p0);
                _mm256_mask_storeu_epi16(at.cast(), mask, std::mem::transmute::<__m256bh, __m256i>(h));
            }
        }
    }
}

#[cfg(not(target_arch = "x86_64"))]
unsafe fn micro_kernel(_: &[u32], _: &[usize; MR], _: &[usize], _: usize, _: &[u32], _: Tile<'_>) {
    unreachable!("conv_bf16 checks available() first")
}
