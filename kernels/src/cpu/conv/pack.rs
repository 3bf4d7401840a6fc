//! Weights packed for [`super::conv_bf16`], once per call, from either stored layout.

use half::bf16;

#[cfg(target_arch = "x86_64")]
use super::transpose16;
use super::{available, buffer_len, error, expect_len, ConvDims, NB};
use crate::cpu::{par_ranges, KernelError, SharedMut};

/// Lanes of one tap in a block of packed weights: the tap's pairs, then 16 unused lanes, so that
/// the k² taps of one pair do not lie a multiple of 4 KB apart (with 128 or 256 pairs they did,
/// all in one set of the L1 cache, and packing missed on every write).
pub(super) fn tap_lanes(cp: usize) -> usize {
    cp * NB + 16
}

/// Weights packed for [`super::conv_bf16`] once per call: for each block of 32 output channels,
/// each tap (16 lanes past the last tap's pairs, see `tap_lanes`), each input channel pair, the
/// 32 channels' pairs side by side (zeros past `c_out` and `c_in`).
pub struct PackedWeights {
    pub(super) data: Vec<u32>,
    pub(super) dims: ConvDims,
}

impl PackedWeights {
    /// The weights `w` as `layout` stores them, packed for the convolution `dims`.
    pub fn new(dims: ConvDims, w: &[bf16], layout: WeightLayout) -> Result<Self, KernelError> {
        dims.out_hw()?;
        let (kk, cp, blocks) = (dims.k * dims.k, dims.pairs(), dims.c_out.div_ceil(NB));
        // `tap_lanes(cp)`, checked.
        let tl = cp.checked_mul(NB).and_then(|l| l.checked_add(16));
        let tl = tl.ok_or_else(|| error(format!("the weights of {dims:?} overflow")))?;
        let (block, len) = (buffer_len(&[kk, tl], "weights", &dims)?, buffer_len(&[kk, tl, blocks], "weights", &dims)?);
        expect_len(w.len(), &[dims.c_out, dims.c_in, kk], "weights", &dims)?;
        let (c_in, c_out) = (dims.c_in, dims.c_out);
        // Weight (o, i, tap s) is at o·so + i·si + s; flipped, tap t is stored as k² − 1 − t.
        let (so, si, flipped) = match layout {
            WeightLayout::Forward => (c_in * kk, kk, false),
            WeightLayout::FlippedTransposed => (kk, c_out * kk, true),
        };
        let mut data = vec![0u32; len];
        let out = SharedMut::new(&mut data);
        let geometry = BlockGeometry { c_in, c_out, kk, cp, tl, so, si, flipped };
        let wide = available() && kk <= 16;
        // One block of output channels per item.
        par_ranges(blocks, 1, |range| {
            for cb in range {
                // SAFETY: block `cb` is this item's only.
                let dst = unsafe { out.range(cb * block, block) };
                if wide {
                    // SAFETY: the CPU has AVX-512F, BW and VL (`available`).
                    unsafe { pack_block_avx512(w, cb, &geometry, dst) };
                } else {
                    pack_block(w, cb, &geometry, dst);
                }
            }
        });
        Ok(PackedWeights { data, dims })
    }
}

/// Where [`PackedWeights::new`] reads and writes: weight (o, i, tap s) at `o·so + i·si + s`
/// (tap t stored as k² − 1 − t when `flipped`), a block's tap t at lane `t·tl`.
pub(super) struct BlockGeometry {
    pub(super) c_in: usize,
    pub(super) c_out: usize,
    pub(super) kk: usize,
    pub(super) cp: usize,
    pub(super) tl: usize,
    pub(super) so: usize,
    pub(super) si: usize,
    pub(super) flipped: bool,
}

/// Block `cb` of the packed weights, pair by pair and channel by channel: each channel's two
/// runs of taps are read whole and spread over the pair's lanes of the k² taps (lines that stay
/// in the L1 cache for the 32 channels).
pub(super) fn pack_block(w: &[bf16], cb: usize, g: &BlockGeometry, dst: &mut [u32]) {
    let kk = g.kk;
    for q in 0..g.cp {
        let hi = 2 * q + 1 < g.c_in;
        for j in 0..NB.min(g.c_out - cb * NB) {
            let at = (cb * NB + j) * g.so + 2 * q * g.si;
            let lo = &w[at..][..kk];
            let high = if hi { &w[at + g.si..][..kk] } else { &[] };
            for t in 0..kk {
                let s = if g.flipped { kk - 1 - t } else { t };
                let h = high.get(s).map_or(0, |h| h.to_bits() as u32);
                dst[t * g.tl + q * NB + j] = lo[s].to_bits() as u32 | (h << 16);
            }
        }
    }
}

/// [`pack_block`] 16 channels × one pair at a time, for kernels of at most 16 taps: each
/// channel's two runs of taps loaded into one register and interleaved into (low, high) lanes
/// tap by tap, the 16 registers transposed into one run of 16 channels per tap.
///
/// # Safety
/// The CPU has AVX-512F, BW and VL.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
pub(super) unsafe fn pack_block_avx512(w: &[bf16], cb: usize, g: &BlockGeometry, dst: &mut [u32]) {
    use std::arch::x86_64::*;
    let (kk, couts) = (g.kk, NB.min(g.c_out - cb * NB));
    assert!(kk <= 16 && dst.len() >= (kk - 1) * g.tl + g.cp * NB, "conv_bf16: a block outside its lanes");
    // 16-bit lane 2t takes the low run's tap s(t) (lanes 0..16), lane 2t + 1 the high run's
    // (lanes 16..32).
    let mut order = [0i16; 32];
    for t in 0..kk {
        let s = if g.flipped { kk - 1 - t } else { t };
        order[2 * t] = s as i16;
        order[2 * t + 1] = 16 + s as i16;
    }
    // SAFETY: 32 i16 values read from the array.
    let order = unsafe { _mm512_loadu_si512(order.as_ptr().cast()) };
    let taps = ((1u32 << kk) - 1) as u16;
    for q in 0..g.cp {
        let hi = 2 * q + 1 < g.c_in;
        for j0 in (0..couts).step_by(16) {
            let lanes = 16.min(couts - j0);
            let mut rows = [_mm512_setzero_si512(); 16];
            for (jj, row) in rows.iter_mut().enumerate().take(lanes) {
                let at = (cb * NB + j0 + jj) * g.so + 2 * q * g.si;
                let (lo, high) = (&w[at..][..kk], if hi { &w[at + g.si..][..kk] } else { &[][..] });
                // SAFETY: kk ≤ 16 values of each run (slices checked above); lanes past kk
                // are not read.
                unsafe {
                    let l = _mm256_maskz_loadu_epi16(taps, lo.as_ptr().cast());
                    let h =
                        if hi { _mm256_maskz_loadu_epi16(taps, high.as_ptr().cast()) } else { _mm256_setzero_si256() };
                    *row = _mm512_permutexvar_epi16(order, _mm512_inserti64x4::<1>(_mm512_castsi256_si512(l), h));
                }
            }
            let runs = transpose16(rows);
            let store = ((1u32 << lanes) - 1) as u16;
            for (t, run) in runs.iter().enumerate().take(kk) {
                let at = t * g.tl + q * NB + j0;
                assert!(at + lanes <= dst.len(), "conv_bf16: a run outside its block");
                // SAFETY: lanes at..at + lanes of dst (checked).
                unsafe { _mm512_mask_storeu_epi32(dst.as_mut_ptr().add(at).cast(), store, *run) };
            }
        }
    }
}

#[cfg(not(target_arch = "x86_64"))]
pub(super) unsafe fn pack_block_avx512(w: &[bf16], cb: usize, g: &BlockGeometry, dst: &mut [u32]) {
    pack_block(w, cb, g, dst)
}

/// How weights are stored for [`PackedWeights::new`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WeightLayout {
    /// (c_out, c_in, k, k), as the convolution uses them.
    Forward,
    /// (c_in, c_out, k, k) with each k × k kernel rotated by 180°: the weights of the
    /// convolution whose input gradient this convolution computes, used as they are stored.
    FlippedTransposed,
}
