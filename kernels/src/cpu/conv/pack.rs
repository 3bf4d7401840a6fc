//! Weights packed for [`super::conv_direct`], a block at a time, from either stored layout.

#[cfg(target_arch = "x86_64")]
use super::store_transposed;
use super::{buffer_len, error, expect_len, with_features, ConvDims, Element, NB};
use crate::cpu::KernelError;

/// Lanes of one tap in a block of packed weights: the tap's lanes, then 16 unused ones, so that
/// the k² taps of one lane do not lie a multiple of 4 KB apart (with 128 or 256 lanes they did,
/// all in one set of the L1 cache, and packing missed on every write).
pub(super) fn tap_lanes(cl: usize) -> usize {
    cl * NB + 16
}

/// A convolution's weights as stored, for [`super::conv_direct`], which packs them one block of
/// 32 output channels at a time, in the worker that uses the block (an L2-sized buffer: the
/// whole packed copy, written to memory and read back, took as long as the convolution at
/// ResNet's 512-channel layers at batch 1). A packed block holds, for each tap (16 lanes past
/// the last tap's, see `tap_lanes`), each lane of input channels, the 32 output channels' lanes
/// side by side (zeros past `c_in`; lanes past `c_out` are not written and their sums not
/// stored).
pub struct Weights<'a, E: Element> {
    w: &'a [E],
    geometry: BlockGeometry,
    pub(super) dims: ConvDims,
    /// Lanes of one packed block.
    pub(super) block: usize,
}

impl<'a, E: Element> Weights<'a, E> {
    /// The weights `w` as `layout` stores them, for the convolution `dims`; an error when their
    /// length does not fit or a size overflows.
    pub fn new(dims: ConvDims, w: &'a [E], layout: WeightLayout) -> Result<Self, KernelError> {
        dims.out_hw()?;
        let kk = dims.k * dims.k;
        // Weight (o, i, tap s) is at o·so + i·si + s; flipped, tap t is stored as k² − 1 − t.
        let (transposed, order): (bool, Vec<usize>) = match layout {
            WeightLayout::Forward => (false, (0..kk).collect()),
            WeightLayout::FlippedTransposed => (true, (0..kk).rev().collect()),
        };
        Self::taps(dims, w, transposed, order)
    }

    /// The weights `w` of a k × k convolution (stored (c_out, c_in, k, k) when `dims` is that
    /// convolution, (c_in, c_out, k, k) of the convolution `dims` when `transposed`), packed tap
    /// t holding stored tap `order[t]` (an index below k²): a subset of the taps in any order.
    pub(super) fn taps(dims: ConvDims, w: &'a [E], transposed: bool, order: Vec<usize>) -> Result<Self, KernelError> {
        let (kk, cl) = (dims.k * dims.k, dims.lanes::<E>());
        if order.iter().any(|&s| s >= kk) {
            return Err(error(format!("taps {order:?} of a {}×{} kernel", dims.k, dims.k)));
        }
        // `tap_lanes(cl)`, checked.
        let tl = cl.checked_mul(NB).and_then(|l| l.checked_add(16));
        let tl = tl.ok_or_else(|| error(format!("the weights of {dims:?} overflow")))?;
        let block = buffer_len(&[order.len(), tl], "weights", &dims)?;
        expect_len(w.len(), &[dims.c_out, dims.c_in, kk], "weights", &dims)?;
        let (c_in, c_out) = (dims.c_in, dims.c_out);
        let (so, si) = if transposed { (kk, c_out * kk) } else { (c_in * kk, kk) };
        let geometry = BlockGeometry { c_in, c_out, kk, cl, tl, so, si, order };
        Ok(Weights { w, geometry, dims, block })
    }

    /// Block `cb` packed into `dst` (at least [`Weights::block`] lanes).
    pub(super) fn pack(&self, cb: usize, dst: &mut [u32]) {
        let dst = &mut dst[..self.block];
        if E::available() && self.geometry.kk <= 16 {
            // SAFETY: the CPU has E's features (`available`).
            unsafe { pack_block_wide(self.w, cb, &self.geometry, dst) };
        } else {
            pack_block(self.w, cb, &self.geometry, dst);
        }
    }
}

/// Where [`Weights::pack`] reads and writes: weight (o, i, tap s) at `o·so + i·si + s`, a
/// block's tap t (stored tap `order[t]`) at lane `t·tl`.
pub(super) struct BlockGeometry {
    pub(super) c_in: usize,
    pub(super) c_out: usize,
    pub(super) kk: usize,
    pub(super) cl: usize,
    pub(super) tl: usize,
    pub(super) so: usize,
    pub(super) si: usize,
    pub(super) order: Vec<usize>,
}

/// Block `cb` of the packed weights, lane by lane and channel by channel: each channel's runs of
/// taps are read whole and spread over the lane's k² taps (lines that stay in the L1 cache for
/// the 32 channels).
pub(super) fn pack_block<E: Element>(w: &[E], cb: usize, g: &BlockGeometry, dst: &mut [u32]) {
    let kk = g.kk;
    for q in 0..g.cl {
        let hi = E::PER_LANE == 2 && 2 * q + 1 < g.c_in;
        for j in 0..NB.min(g.c_out - cb * NB) {
            let at = (cb * NB + j) * g.so + E::PER_LANE * q * g.si;
            let lo = &w[at..][..kk];
            let high = if hi { &w[at + g.si..][..kk] } else { &[] };
            for (t, &s) in g.order.iter().enumerate() {
                dst[t * g.tl + q * NB + j] = E::lane(lo[s], high.get(s).copied().unwrap_or(E::ZERO));
            }
        }
    }
}

with_features! {
    /// [`pack_block`] 16 channels × one lane at a time, for kernels of at most 16 taps: each
    /// channel's taps loaded as one register of lanes ([`Element::lanes`]), put in the packed
    /// order, the 16 registers transposed into one run of 16 channels per packed tap.
    ///
    /// # Safety
    /// The CPU has E's features ([`Element::available`]).
    pub(super) unsafe fn pack_block_wide => pack_block_avx512(
        w: &[E], cb: usize, g: &BlockGeometry, dst: &mut [u32],
    )
}

#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn pack_block_avx512<E: Element>(w: &[E], cb: usize, g: &BlockGeometry, dst: &mut [u32]) {
    // SAFETY: `with_features` compiles this into a kernel with AVX-512F, BW and VL, run
    // only where the CPU has them; the reads and writes are checked as they are made.
    unsafe {
        use std::arch::x86_64::*;
        let (kk, taps, couts) = (g.kk, g.order.len(), NB.min(g.c_out - cb * NB));
        assert!(
            kk <= 16 && (1..=kk).contains(&taps) && dst.len() >= (taps - 1) * g.tl + g.cl * NB,
            "conv_direct: a block outside its lanes"
        );
        // Lane t takes the loaded lane order[t] (stored taps are below kk: `Weights::taps`).
        let mut order = [0i32; 16];
        for (o, &s) in order.iter_mut().zip(&g.order) {
            *o = s as i32;
        }
        let identity = g.order.iter().enumerate().all(|(t, &s)| t == s);
        // SAFETY: 16 i32 values read from the array.
        let order = _mm512_loadu_si512(order.as_ptr().cast());
        for q in 0..g.cl {
            let hi = E::PER_LANE == 2 && 2 * q + 1 < g.c_in;
            for j0 in (0..couts).step_by(16) {
                let lanes = 16.min(couts - j0);
                let mut rows = [_mm512_setzero_si512(); 16];
                for (jj, row) in rows.iter_mut().enumerate().take(lanes) {
                    let at = (cb * NB + j0 + jj) * g.so + E::PER_LANE * q * g.si;
                    let (lo, high) = (&w[at..][..kk], if hi { Some(&w[at + g.si..][..kk]) } else { None });
                    // Each channel's runs, `PREFETCH` lanes ahead (with the forward layout
                    // every channel is a stream of its own, more than the hardware follows);
                    // the address stays inside `w`.
                    let ahead = at + PREFETCH * E::PER_LANE * g.si;
                    if ahead < w.len() {
                        _mm_prefetch::<_MM_HINT_T0>(w.as_ptr().add(ahead).cast());
                    }
                    // SAFETY: kk ≤ 16 values of each run (slices checked above); lanes past kk
                    // are not read.
                    let taps = E::lanes(lo.as_ptr(), high.map(|h| h.as_ptr()), kk);
                    *row = if identity { taps } else { _mm512_permutexvar_epi32(order, taps) };
                }
                // Channels j0..j0 + lanes of lane q at each packed tap.
                store_transposed(rows, (taps, lanes), dst, (q * NB + j0, g.tl));
            }
        }
    }
}

/// Lanes of input channels ahead that [`pack_block_wide`] prefetches each channel's weights.
const PREFETCH: usize = 16;

/// How weights are stored for [`Weights::new`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WeightLayout {
    /// (c_out, c_in, k, k), as the convolution uses them.
    Forward,
    /// (c_in, c_out, k, k) with each k × k kernel rotated by 180°: the weights of the
    /// convolution whose input gradient this convolution computes, used as they are stored.
    FlippedTransposed,
}
