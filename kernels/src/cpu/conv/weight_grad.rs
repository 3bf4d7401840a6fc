//! The weight gradient of a stride-1 convolution, directly: `dW[o][i][t] = Σ dY[o][p] ·
//! x[i][p + t]` over every output position p of every image, with no column matrix.
//!
//! The lanes run along the positions: `vdpbf16ps` sums pairs, so a bf16 lane is two neighbouring
//! output positions of one row (2m, 2m + 1); an f32 lane is one. The output gradients are
//! rearranged once per call so that a lane of 32 output channels is two registers
//! ([`PositionLanes`]); the images are copied once with their zero padding ([`PaddedImages`]),
//! where the inputs a lane of positions meets through one tap are neighbours too — a 32-bit
//! broadcast straight from the image. The
//! micro-kernel's tile is `MR` weight rows (input channel, tap) × 32 output channels, summed in
//! registers over all positions and stored once, transposed, into the (C_out, C_in·k·k) f32
//! gradient.

use std::marker::PhantomData;

use super::{buffer_len, error, expect_len, with_features, ConvDims, Element, MR, NB};
#[cfg(target_arch = "x86_64")]
use super::{store_transposed, transpose16};
use crate::cpu::{par_ranges, KernelError, SharedMut};

/// Output gradients as lanes of neighbouring positions: element `((b·oh + y)·mw + m)·co + o`
/// holds output channel o's gradient at (y, 2m) (low half) and (y, 2m + 1) (high half; zero
/// past the row's end) for bf16, at (y, m) for f32; `mw = ⌈ow / per lane⌉`, `co` the output
/// channels rounded up to 32 (zeros).
pub struct PositionLanes<E: Element> {
    data: Vec<u32>,
    dims: ConvDims,
    element: PhantomData<E>,
}

impl<E: Element> PositionLanes<E> {
    /// `dy` (n, c_out, oh, ow), contiguous, rearranged; parallel over output rows.
    pub fn new(dy: &[E], dims: ConvDims) -> Result<Self, KernelError> {
        let (oh, ow) = dims.out_hw()?;
        let (mw, co) = (ow.div_ceil(E::PER_LANE), dims.c_out.div_ceil(NB) * NB);
        expect_len(dy.len(), &[dims.n, dims.c_out, oh, ow], "output gradients", &dims)?;
        let len = buffer_len(&[dims.n, oh, mw, co], "output gradients", &dims)?;
        let mut data = vec![0u32; len];
        let out = SharedMut::new(&mut data);
        let wide = E::available();
        let c = dims.c_out;
        par_ranges(dims.n * oh, 8, |rows| {
            for r in rows {
                let (b, y) = (r / oh, r % oh);
                // SAFETY: output row r's lanes are this item's only.
                let dst = unsafe { out.range(r * mw * co, mw * co) };
                let grads = &dy[b * c * oh * ow..][..c * oh * ow];
                if wide {
                    // SAFETY: the CPU has E's features (`available`).
                    unsafe { position_row_wide(grads, (c, oh, ow), (y, co), dst) };
                } else {
                    position_row(grads, (c, oh, ow), (y, co), dst);
                }
            }
        });
        Ok(PositionLanes { data, dims, element: PhantomData })
    }
}

/// Row y of `grads` (c, oh, ow) as lanes of positions: `dst[m·co + o]` holds channel o at
/// positions `m·per lane..`.
pub(super) fn position_row<E: Element>(
    grads: &[E],
    (c, oh, ow): (usize, usize, usize),
    (y, co): (usize, usize),
    dst: &mut [u32],
) {
    for o in 0..c {
        let row = &grads[(o * oh + y) * ow..][..ow];
        for (m, lane) in row.chunks(E::PER_LANE).enumerate() {
            dst[m * co + o] = E::lane(lane[0], lane.get(1).copied().unwrap_or(E::ZERO));
        }
    }
}

with_features! {
    /// [`position_row`] 16 channels × 16 lanes at a time: each channel's run of values is 16
    /// lanes as it lies in memory ([`Element::run`]); the 16 registers transposed into one per
    /// lane of positions.
    ///
    /// # Safety
    /// The CPU has E's features ([`Element::available`]).
    pub(super) unsafe fn position_row_wide => position_row_avx512(
        grads: &[E], dims: (usize, usize, usize), row: (usize, usize), dst: &mut [u32],
    )
}

#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn position_row_avx512<E: Element>(
    grads: &[E],
    (c, oh, ow): (usize, usize, usize),
    (y, co): (usize, usize),
    dst: &mut [u32],
) {
    // SAFETY: `with_features` compiles this into a kernel with AVX-512F, BW and VL, run
    // only where the CPU has them; the reads and writes are checked as they are made.
    unsafe {
        use std::arch::x86_64::*;
        let mw = ow.div_ceil(E::PER_LANE);
        assert!(
            grads.len() >= c * oh * ow && y < oh && co >= c && dst.len() >= mw * co,
            "conv_direct: a row outside its gradients"
        );
        for o0 in (0..c).step_by(16) {
            let on = 16.min(c - o0);
            for m0 in (0..mw).step_by(16) {
                let (mn, values) = (16.min(mw - m0), (16 * E::PER_LANE).min(ow - E::PER_LANE * m0));
                let mut rows = [_mm512_setzero_si512(); 16];
                for (oo, row) in rows.iter_mut().enumerate().take(on) {
                    // SAFETY: channel o0 + oo's row y, values per lane · m0.. (`values` of them,
                    // inside the row, checked above); values past them are not read.
                    *row = E::run(grads.as_ptr().add(((o0 + oo) * oh + y) * ow + E::PER_LANE * m0), values);
                }
                // Channels o0..o0 + on of lanes m0..m0 + mn.
                store_transposed(rows, (mn, on), dst, (m0 * co + o0, co));
            }
        }
    }
}

/// Images with their zero padding, NCHW, and for bf16 one more zero column: element
/// `((b·c_in + i)·hp + y)·wq + x`, `wq = w + 2·pad + per lane − 1` (a pair of positions at a
/// row's odd end reads its second input there, against a zero gradient).
pub struct PaddedImages<E: Element> {
    data: Vec<E>,
    dims: ConvDims,
}

impl<E: Element> PaddedImages<E> {
    /// `x` (n, c_in, h, w), contiguous, copied; parallel over planes.
    pub fn new(x: &[E], dims: ConvDims) -> Result<Self, KernelError> {
        dims.out_hw()?;
        let (hp, wp) = dims.padded();
        let wq = wp + E::PER_LANE - 1;
        let (c, h, w, p) = (dims.c_in, dims.h, dims.w, dims.pad);
        expect_len(x.len(), &[dims.n, c, h, w], "image elements", &dims)?;
        let len = buffer_len(&[dims.n, c, hp, wq], "padded images", &dims)?;
        let mut data = vec![E::ZERO; len];
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
/// the sums over every position of every image of `dy`'s lanes times the images' windows;
/// parallel over (32 output channels, `MR` weight rows). An error when the two were prepared
/// for other dimensions, the stride is not 1, `dw` has the wrong length, or the CPU lacks E's
/// features.
pub fn weight_grad_direct<E: Element>(
    dw: &mut [f32],
    x: &PaddedImages<E>,
    dy: &PositionLanes<E>,
) -> Result<(), KernelError> {
    let d = x.dims;
    if d != dy.dims || d.stride != 1 {
        return Err(error(format!("images prepared for {:?}, gradients for {:?} (stride 1 only)", d, dy.dims)));
    }
    if !E::available() {
        return Err(error(format!("this CPU lacks the AVX-512 features of {:?} convolutions", E::ZERO)));
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
    let wq = wp + E::PER_LANE - 1;
    let (mw, co) = (ow.div_ceil(E::PER_LANE), d.c_out.div_ceil(NB) * NB);
    // The farthest 32-bit read: the last image's last plane, its last row, its last column (for
    // bf16 the extra zero one); and the last lane's 32 output channels.
    assert!(
        d.n * d.c_in * hp * wq <= x.data.len() && d.n * oh * mw * co <= dy.data.len(),
        "conv_direct: short operands"
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
            // SAFETY: the CPU has E's features (checked); every read is inside the operands
            // (the farthest checked above).
            unsafe { grad_kernel(&x.data, &at, &dy.data[cb * NB..], (d, oh, mw, co), &mut by_channel) };
            for j in 0..NB.min(d.c_out - cb * NB) {
                // SAFETY: output channel cb·32 + j's rows r0..r0 + height are this item's only.
                let run = unsafe { out.range((cb * NB + j) * rows + r0, height) };
                run.copy_from_slice(&by_channel[j * 16..][..height]);
            }
        }
    });
    Ok(())
}

with_features! {
    /// The `MR × 32` sums of one tile over every lane of positions, stored by output channel
    /// (channel j's `MR` rows at `16·j` of `by_channel`, transposed in registers: a scalar copy
    /// of the 384 sums cost a tenth of the kernel's time at ResNet's 7×7 layers). Weight row i's
    /// input for the lane at (b, y, m) is the 32 bits at `at[i] + b·c_in·hp·wq + y·wq + m · per
    /// lane` of `x`; the lane's 32 output channels the 32 lanes at `((b·oh + y)·mw + m)·co` of
    /// `dy`.
    ///
    /// # Safety
    /// The CPU has E's features; every such read lies inside `x` and `dy`.
    unsafe fn grad_kernel => grad_kernel_avx512(
        x: &[E], at: &[usize; MR], dy: &[u32], dims: (ConvDims, usize, usize, usize),
        by_channel: &mut [f32; NB * 16],
    )
}

#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn grad_kernel_avx512<E: Element>(
    x: &[E],
    at: &[usize; MR],
    dy: &[u32],
    (d, oh, mw, co): (ConvDims, usize, usize, usize),
    by_channel: &mut [f32; NB * 16],
) {
    // SAFETY: `with_features` compiles this into a kernel with AVX-512F, BW and VL, run
    // only where the CPU has them; the reads and writes are checked as they are made.
    unsafe {
        use std::arch::x86_64::*;
        let (hp, wq) = (d.h + 2 * d.pad, d.w + 2 * d.pad + E::PER_LANE - 1);
        let mut acc = [[_mm512_setzero_ps(); 2]; MR];
        let mut rows = [x.as_ptr(); MR];
        for (r, a) in rows.iter_mut().zip(at) {
            // SAFETY: inside x (the caller's contract).
            *r = r.add(*a);
        }
        let mut g = dy.as_ptr();
        for b in 0..d.n {
            for y in 0..oh {
                let row = b * d.c_in * hp * wq + y * wq;
                for m in 0..mw {
                    // SAFETY: the caller's contract: 32 lanes at g, 32 bits at each row's lane.
                    let g0 = _mm512_loadu_si512(g.cast());
                    let g1 = _mm512_loadu_si512(g.add(16).cast());
                    for (s, r) in acc.iter_mut().zip(&rows) {
                        let lane = r.add(row + E::PER_LANE * m).cast::<u32>();
                        s[0] = E::madd(s[0], lane, g0);
                        s[1] = E::madd(s[1], lane, g1);
                    }
                    g = g.add(co);
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
                _mm512_storeu_si512(by_channel[(16 * v + jj) * 16..].as_mut_ptr().cast(), *run);
            }
        }
    }
}
