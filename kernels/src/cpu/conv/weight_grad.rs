//! The weight gradient of a stride-1 convolution, directly: `dW[o][i][t] = Σ dY[o][p] ·
//! x[i][p + t]` over every output position p of every image, with no column matrix.
//!
//! `vdpbf16ps` sums pairs, so here the pairs run along the positions: two neighbouring output
//! positions of one row (2m, 2m + 1). The output gradients are rearranged once per call so that
//! such a pair of 32 output channels is two registers ([`PositionPairs`]); the images are copied
//! once with their zero padding ([`PaddedImages`]), where the two inputs a pair of positions
//! meets through one tap are neighbours too — a 32-bit broadcast straight from the image. The
//! micro-kernel's tile is `MR` weight rows (input channel, tap) × 32 output channels, summed in
//! registers over all positions and stored once, transposed, into the (C_out, C_in·k·k) f32
//! gradient.

use half::bf16;

#[cfg(target_arch = "x86_64")]
use super::transpose16;
use super::{available, buffer_len, error, expect_len, ConvDims, MR, NB};
use crate::cpu::{par_ranges, KernelError, SharedMut};

/// Output gradients as pairs of neighbouring positions: element `((b·oh + y)·mw + m)·co + o`
/// holds output channel o's gradient at (y, 2m) (low half) and (y, 2m + 1) (high half; zero
/// past the row's end), `mw = ⌈ow / 2⌉`, `co` the output channels rounded up to 32 (zeros).
pub struct PositionPairs {
    data: Vec<u32>,
    dims: ConvDims,
}

impl PositionPairs {
    /// `dy` (n, c_out, oh, ow), contiguous, rearranged; parallel over output rows.
    pub fn new(dy: &[bf16], dims: ConvDims) -> Result<Self, KernelError> {
        let (oh, ow) = dims.out_hw()?;
        let (mw, co) = (ow.div_ceil(2), dims.c_out.div_ceil(NB) * NB);
        expect_len(dy.len(), &[dims.n, dims.c_out, oh, ow], "output gradients", &dims)?;
        let len = buffer_len(&[dims.n, oh, mw, co], "output gradients", &dims)?;
        let mut data = vec![0u32; len];
        let out = SharedMut::new(&mut data);
        let wide = available();
        let c = dims.c_out;
        par_ranges(dims.n * oh, 8, |rows| {
            for r in rows {
                let (b, y) = (r / oh, r % oh);
                // SAFETY: output row r's pairs are this item's only.
                let dst = unsafe { out.range(r * mw * co, mw * co) };
                let grads = &dy[b * c * oh * ow..][..c * oh * ow];
                if wide {
                    // SAFETY: the CPU has AVX-512F, BW and VL (`available`).
                    unsafe { pair_row_avx512(grads, (c, oh, ow), y, co, dst) };
                } else {
                    pair_row(grads, (c, oh, ow), y, co, dst);
                }
            }
        });
        Ok(PositionPairs { data, dims })
    }
}

/// Row y of `grads` (c, oh, ow) as position pairs: `dst[m·co + o]` holds channel o at 2m and
/// 2m + 1.
pub(super) fn pair_row(grads: &[bf16], (c, oh, ow): (usize, usize, usize), y: usize, co: usize, dst: &mut [u32]) {
    for o in 0..c {
        let row = &grads[(o * oh + y) * ow..][..ow];
        for (m, pair) in row.chunks(2).enumerate() {
            let hi = pair.get(1).map_or(0, |h| h.to_bits() as u32);
            dst[m * co + o] = pair[0].to_bits() as u32 | (hi << 16);
        }
    }
}

/// [`pair_row`] 16 channels × 16 pairs at a time: each channel's 32 values are 16 pairs as
/// they lie in memory; the 16 registers transposed into one per pair.
///
/// # Safety
/// The CPU has AVX-512F, BW and VL.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
pub(super) unsafe fn pair_row_avx512(
    grads: &[bf16],
    (c, oh, ow): (usize, usize, usize),
    y: usize,
    co: usize,
    dst: &mut [u32],
) {
    use std::arch::x86_64::*;
    let mw = ow.div_ceil(2);
    assert!(
        grads.len() >= c * oh * ow && y < oh && co >= c && dst.len() >= mw * co,
        "conv_bf16: a row outside its gradients"
    );
    for o0 in (0..c).step_by(16) {
        let on = 16.min(c - o0);
        for m0 in (0..mw).step_by(16) {
            let (mn, values) = (16.min(mw - m0), 32.min(ow - 2 * m0));
            let load = if values == 32 { u32::MAX } else { (1u32 << values) - 1 };
            let mut rows = [_mm512_setzero_si512(); 16];
            for (oo, row) in rows.iter_mut().enumerate().take(on) {
                // SAFETY: channel o0 + oo's row y, values 2·m0.. (`values` of them, inside
                // the row, checked above); lanes past them are not read.
                unsafe {
                    let at = grads.as_ptr().add(((o0 + oo) * oh + y) * ow + 2 * m0);
                    *row = _mm512_maskz_loadu_epi16(load, at.cast());
                }
            }
            let cols = transpose16(rows);
            let store = ((1u32 << on) - 1) as u16;
            for (mm, col) in cols.iter().enumerate().take(mn) {
                // SAFETY: channels o0..o0 + on of pair m0 + mm, inside `dst` (checked above).
                unsafe { _mm512_mask_storeu_epi32(dst.as_mut_ptr().add((m0 + mm) * co + o0).cast(), store, *col) };
            }
        }
    }
}

#[cfg(not(target_arch = "x86_64"))]
pub(super) unsafe fn pair_row_avx512(
    grads: &[bf16],
    dims: (usize, usize, usize),
    y: usize,
    co: usize,
    dst: &mut [u32],
) {
    pair_row(grads, dims, y, co, dst)
}

/// Images with their zero padding, NCHW, and one more zero column: element
/// `((b·c_in + i)·hp + y)·wq + x`, `wq = w + 2·pad + 1` (a pair of positions at a row's odd
/// end reads its second input there, against a zero gradient).
pub struct PaddedImages {
    data: Vec<bf16>,
    dims: ConvDims,
}

impl PaddedImages {
    /// `x` (n, c_in, h, w), contiguous, copied; parallel over planes.
    pub fn new(x: &[bf16], dims: ConvDims) -> Result<Self, KernelError> {
        dims.out_hw()?;
        let (hp, wp) = dims.padded();
        let wq = wp + 1;
        let (c, h, w, p) = (dims.c_in, dims.h, dims.w, dims.pad);
        expect_len(x.len(), &[dims.n, c, h, w], "image elements", &dims)?;
        let len = buffer_len(&[dims.n, c, hp, wq], "padded images", &dims)?;
        let mut data = vec![bf16::ZERO; len];
        let out = SharedMut::new(&mut data);
        par_ranges(dims.n * c, 4, |planes| {
            for plane in planes {
                // SAFETY: padded plane `plane` is this item's only.
                let dst = unsafe { out.range(plane * hp * wq, hp * wq) };
                for (y, row) in x[plane * h * w..][..h * w].chunks_exact(w.max(1)).enumerate() {
                    dst[(y + p) * wq + p..][..w].copy_from_slice(row);
                }
            }
        });
        Ok(PaddedImages { data, dims })
    }
}

/// The weight gradient of the stride-1 convolution `dims` into `dw` ((C_out, C_in·k·k), f32):
/// the sums over every position of every image of `dy`'s pairs times the images' windows;
/// parallel over (32 output channels, `MR` weight rows). An error when the two were prepared
/// for other dimensions, the stride is not 1, `dw` has the wrong length, or the CPU lacks
/// AVX512-BF16 with AVX-512 BW/VL.
pub fn weight_grad_bf16(dw: &mut [f32], x: &PaddedImages, dy: &PositionPairs) -> Result<(), KernelError> {
    let d = x.dims;
    if d != dy.dims || d.stride != 1 {
        return Err(error(format!("images prepared for {:?}, gradients for {:?} (stride 1 only)", d, dy.dims)));
    }
    if !available() {
        return Err(error("this CPU has no AVX512-BF16 with AVX-512 BW/VL".into()));
    }
    let (oh, ow) = d.out_hw()?;
    let (kk, rows) = (d.k * d.k, d.c_in * d.k * d.k);
    if Some(dw.len()) != d.c_out.checked_mul(rows) {
        return Err(error(format!("a weight gradient of {} elements for {d:?}", dw.len())));
    }
    if d.n == 0 || oh == 0 || rows == 0 || d.c_out == 0 {
        dw.fill(0.0);
        return Ok(());
    }
    let (hp, wp) = d.padded();
    let wq = wp + 1;
    let (mw, co) = (ow.div_ceil(2), d.c_out.div_ceil(NB) * NB);
    // The farthest 32-bit read: the last image's last plane, its last row, column wp (the extra
    // zero column); and the last pair's 32 output channels.
    assert!(
        (d.n * d.c_in * hp - 1) * wq + wp < x.data.len() && d.n * oh * mw * co <= dy.data.len(),
        "conv_bf16: short operands"
    );
    let (blocks, tiles) = (co / NB, rows.div_ceil(MR));
    let out = SharedMut::new(dw);
    par_ranges(blocks * tiles, 1, |items| {
        for item in items {
            let (cb, r0) = (item / tiles, (item % tiles) * MR);
            let height = MR.min(rows - r0);
            // Weight row r = (input channel, tap)'s first input, from a position's.
            let mut at = [0usize; MR];
            for (i, a) in at.iter_mut().enumerate() {
                let r = (r0 + i).min(rows - 1);
                let (ci, t) = (r / kk, r % kk);
                *a = (ci * hp + t / d.k) * wq + t % d.k;
            }
            let mut by_channel = [0f32; NB * 16];
            // SAFETY: the CPU has AVX512-BF16, AVX-512 BW/VL (checked); every read is inside
            // the operands (the farthest checked above).
            unsafe { micro_kernel(&x.data, &at, &dy.data[cb * NB..], (d, oh, mw, co), &mut by_channel) };
            for j in 0..NB.min(d.c_out - cb * NB) {
                // SAFETY: output channel cb·32 + j's rows r0..r0 + height are this item's only.
                let run = unsafe { out.range((cb * NB + j) * rows + r0, height) };
                run.copy_from_slice(&by_channel[j * 16..][..height]);
            }
        }
    });
    Ok(())
}

/// The `MR × 32` sums of one tile over every position pair, stored by output channel (channel
/// j's `MR` rows at `16·j` of `by_channel`, transposed in registers: a scalar copy of the 384
/// sums cost a tenth of the kernel's time at ResNet's 7×7 layers). Weight row i's input for
/// the pair at (b, y, m) is the 32 bits at `at[i] + b·c_in·hp·wq + y·wq + 2m` of `x`; the
/// pair's 32 output channels the 32 lanes at `((b·oh + y)·mw + m)·co` of `dy`.
///
/// # Safety
/// The CPU has AVX512-BF16 and AVX-512F; every such read lies inside `x` and `dy`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512bf16,avx512f")]
unsafe fn micro_kernel(
    x: &[bf16],
    at: &[usize; MR],
    dy: &[u32],
    (d, oh, mw, co): (ConvDims, usize, usize, usize),
    by_channel: &mut [f32; NB * 16],
) {
    use std::arch::x86_64::*;
    let (hp, wq) = (d.h + 2 * d.pad, d.w + 2 * d.pad + 1);
    let mut acc = [[_mm512_setzero_ps(); 2]; MR];
    let mut rows = [x.as_ptr(); MR];
    for (r, a) in rows.iter_mut().zip(at) {
        // SAFETY: inside x (the caller's contract).
        *r = unsafe { r.add(*a) };
    }
    let mut g = dy.as_ptr();
    for b in 0..d.n {
        for y in 0..oh {
            let row = b * d.c_in * hp * wq + y * wq;
            for m in 0..mw {
                // SAFETY: the caller's contract: 32 lanes at g, 32 bits at each row's pair.
                unsafe {
                    let g0: __m512bh = std::mem::transmute(_mm512_loadu_si512(g.cast()));
                    let g1: __m512bh = std::mem::transmute(_mm512_loadu_si512(g.add(16).cast()));
                    for (s, r) in acc.iter_mut().zip(&rows) {
                        let pair = r.add(row + 2 * m).cast::<u32>().read_unaligned();
                        let a: __m512bh = std::mem::transmute(_mm512_set1_epi32(pair as i32));
                        s[0] = _mm512_dpbf16_ps(s[0], a, g0);
                        s[1] = _mm512_dpbf16_ps(s[1], a, g1);
                    }
                    g = g.add(co);
                }
            }
        }
    }
    for v in 0..2 {
        let mut rows = [_mm512_setzero_si512(); 16];
        for (r, s) in rows.iter_mut().zip(&acc) {
            *r = _mm512_castps_si512(s[v]);
        }
        for (jj, run) in transpose16(rows).iter().enumerate() {
            // SAFETY: 16 floats inside `by_channel`.
            unsafe { _mm512_storeu_si512(by_channel[(16 * v + jj) * 16..].as_mut_ptr().cast(), *run) };
        }
    }
}

#[cfg(not(target_arch = "x86_64"))]
unsafe fn micro_kernel(
    _: &[bf16],
    _: &[usize; MR],
    _: &[u32],
    _: (ConvDims, usize, usize, usize),
    _: &mut [f32; NB * 16],
) {
    unreachable!("weight_grad_bf16 checks available() first")
}
