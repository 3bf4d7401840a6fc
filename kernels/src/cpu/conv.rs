//! Direct bf16 convolutions with f32 sums on AVX512-BF16: no column matrix (im2col) and no
//! packing of the images.
//!
//! Why: multiplied as a matrix product, a k×k convolution first unfolds every image into a
//! column matrix k² times its size, and the product then packs those columns into panels — two
//! passes over k² copies of the input for each product, a fifth of a ResNet AMP step
//! (BENCHMARKS.md, issue 30). Here the images are rearranged once per call into a padded
//! channels-last layout of channel pairs ([`ChannelsLast`]), and the micro-kernel reads them in
//! place: its tile is `MR` output positions × 32 output channels, and for each tap and input
//! channel pair it broadcasts the pair straight from the image (`vdpbf16ps` multiplies pairs)
//! against 32 output channels' weights packed once per call ([`PackedWeights`]). Any stride
//! works the same way: a position's window starts wherever its offset says.
//!
//! The output is NCHW, as the caller's tensors are: each tile's sums are rounded to bf16 once
//! and written as 32 runs of `MR` consecutive positions (one per output channel).
//!
//! Numerics: each output is one f32 sum over all taps and channel pairs, rounded once to bf16
//! (the pair `(c, c+1)` at one tap added as one by the instruction, which treats subnormal
//! inputs and results as zero, as the bf16 products of [`super::gemm::bf16`] do).

use half::bf16;

use crate::cpu::{KernelError, SharedMut};

/// Output positions of a micro-tile (its rows).
const MR: usize = 12;
/// Output channels of a micro-tile (two 16-lane registers): weights are packed in blocks of it.
const NB: usize = 32;

/// Lanes of one tap in a block of packed weights: the tap's pairs, then 16 unused lanes, so that
/// the k² taps of one pair do not lie a multiple of 4 KB apart (with 128 or 256 pairs they did,
/// all in one set of the L1 cache, and packing missed on every write).
fn tap_lanes(cp: usize) -> usize {
    cp * NB + 16
}

fn error(message: String) -> KernelError {
    KernelError { kernel: "wick direct bf16 convolution", message }
}

/// A convolution's dimensions: images (n, c_in, h, w), weights (c_out, c_in, k, k), the same
/// stride and zero padding along both axes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConvDims {
    /// Images.
    pub n: usize,
    /// Input channels.
    pub c_in: usize,
    /// Image height.
    pub h: usize,
    /// Image width.
    pub w: usize,
    /// Output channels.
    pub c_out: usize,
    /// Kernel size (k × k).
    pub k: usize,
    /// Stride.
    pub stride: usize,
    /// Zero padding on every side.
    pub pad: usize,
}

impl ConvDims {
    /// Output height and width; an error when the window does not fit or a size overflows.
    pub fn out_hw(&self) -> Result<(usize, usize), KernelError> {
        let out = |len: usize| {
            let padded = self.pad.checked_mul(2).and_then(|p| p.checked_add(len));
            match padded {
                Some(p) if self.k > 0 && self.stride > 0 && p >= self.k => Ok((p - self.k) / self.stride + 1),
                _ => Err(error(format!("a {}×{} window does not fit {len} padded by {}", self.k, self.k, self.pad))),
            }
        };
        Ok((out(self.h)?, out(self.w)?))
    }

    /// Channel pairs (the last one half zero when `c_in` is odd).
    fn pairs(&self) -> usize {
        self.c_in.div_ceil(2)
    }

    /// (padded height, padded width).
    fn padded(&self) -> (usize, usize) {
        (self.h + 2 * self.pad, self.w + 2 * self.pad)
    }
}

/// True when this CPU runs [`conv_bf16`] (AVX512-BF16 with AVX-512F, BW and VL).
pub fn available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        super::gemm::bf16::available()
            && std::is_x86_feature_detected!("avx512bw")
            && std::is_x86_feature_detected!("avx512vl")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

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
        let image = [dims.c_in, dims.h, dims.w].iter().try_fold(dims.n, |a, b| a.checked_mul(*b));
        if image != Some(x.len()) {
            return Err(error(format!("{} image elements for {dims:?}", x.len())));
        }
        let len = [hp, wp, cp]
            .iter()
            .try_fold(dims.n, |a, b| a.checked_mul(*b))
            .ok_or_else(|| error(format!("the padded images of {dims:?} overflow")))?;
        let mut data = vec![0u32; len];
        let out = SharedMut::new(&mut data);
        let (c, h, w, p) = (dims.c_in, dims.h, dims.w, dims.pad);
        let wide = available();
        // One work item per image row (its padded row: the padding columns stay zero).
        super::par_ranges(dims.n * h, 8, |rows| {
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
fn pairs_row(image: &[bf16], (c, h, w): (usize, usize, usize), y: usize, dst: &mut [u32]) {
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
unsafe fn pairs_row_avx512(image: &[bf16], (c, h, w): (usize, usize, usize), y: usize, dst: &mut [u32]) {
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
unsafe fn pairs_row_avx512(image: &[bf16], dims: (usize, usize, usize), y: usize, dst: &mut [u32]) {
    pairs_row(image, dims, y, dst)
}

/// Weights packed for [`conv_bf16`] once per call: for each block of 32 output channels, each
/// tap ([`tap_lanes`] apart), each input channel pair, the 32 channels' pairs side by side
/// (zeros past `c_out` and `c_in`).
pub struct PackedWeights {
    data: Vec<u32>,
    dims: ConvDims,
}

impl PackedWeights {
    /// The weights `w` as `layout` stores them, packed for the convolution `dims`.
    pub fn new(dims: ConvDims, w: &[bf16], layout: WeightLayout) -> Result<Self, KernelError> {
        dims.out_hw()?;
        let (kk, cp, blocks) = (dims.k * dims.k, dims.pairs(), dims.c_out.div_ceil(NB));
        let overflow = || error(format!("the weights of {dims:?} overflow"));
        let block =
            cp.checked_mul(NB).and_then(|l| l.checked_add(16)).and_then(|l| l.checked_mul(kk)).ok_or_else(overflow)?;
        let len = block.checked_mul(blocks).ok_or_else(overflow)?;
        let stored = [dims.c_in, kk].iter().try_fold(dims.c_out, |a, b| a.checked_mul(*b));
        if stored != Some(w.len()) {
            return Err(error(format!("{} weights for {dims:?}", w.len())));
        }
        let (c_in, c_out) = (dims.c_in, dims.c_out);
        // Weight (o, i, tap s) is at o·so + i·si + s; flipped, tap t is stored as k² − 1 − t.
        let (so, si, flipped) = match layout {
            WeightLayout::Forward => (c_in * kk, kk, false),
            WeightLayout::FlippedTransposed => (kk, c_out * kk, true),
        };
        let mut data = vec![0u32; len];
        let out = SharedMut::new(&mut data);
        let tl = tap_lanes(cp);
        let geometry = BlockGeometry { c_in, c_out, kk, cp, tl, so, si, flipped };
        let wide = available() && kk <= 16;
        // One block of output channels per item.
        super::par_ranges(blocks, 1, |range| {
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
struct BlockGeometry {
    c_in: usize,
    c_out: usize,
    kk: usize,
    cp: usize,
    tl: usize,
    so: usize,
    si: usize,
    flipped: bool,
}

/// Block `cb` of the packed weights, pair by pair and channel by channel: each channel's two
/// runs of taps are read whole and spread over the pair's lanes of the k² taps (lines that stay
/// in the L1 cache for the 32 channels).
fn pack_block(w: &[bf16], cb: usize, g: &BlockGeometry, dst: &mut [u32]) {
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
unsafe fn pack_block_avx512(w: &[bf16], cb: usize, g: &BlockGeometry, dst: &mut [u32]) {
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
unsafe fn pack_block_avx512(w: &[bf16], cb: usize, g: &BlockGeometry, dst: &mut [u32]) {
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
    if Some(dst.len()) != [d.c_out, plane].iter().try_fold(d.n, |a, b| a.checked_mul(*b)) {
        return Err(error(format!("an output of {} elements for {d:?}", dst.len())));
    }
    let (hp, wp) = d.padded();
    let (cp, taps, blocks) = (d.pairs(), d.k * d.k, d.c_out.div_ceil(NB));
    let block = taps * tap_lanes(cp);
    // The last window's last pair lies inside the images (every read below is at most this far).
    if d.n == 0 || plane == 0 || d.c_out == 0 {
        return Ok(());
    }
    let last = ((d.n - 1) * hp + (oh - 1) * d.stride + d.k - 1) * wp + (ow - 1) * d.stride + d.k - 1;
    assert!((last + 1) * cp <= x.data.len() && blocks * block <= w.data.len(), "conv_bf16: short operands");
    // Offsets of the taps from a window's first element, in pairs.
    let tap_at: Vec<usize> = (0..taps).map(|t| ((t / d.k) * wp + t % d.k) * cp).collect();
    let out = SharedMut::new(dst);
    super::par_ranges(d.n * blocks, 1, |items| {
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

/// The `MR × 32` sums of one tile, rounded to bf16 and stored into `tile`: position `i`'s window starts at pair `at[i]` of `x`, tap `t`
/// `tap_at[t]` further, and the weights run (pair, 32 channels) through `w` from tap `t`'s
/// start, `t · tap_lanes(cp)`.
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

/// Sixteen registers of 16 32-bit lanes transposed: lane i of result j is lane j of row i.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
fn transpose16(r: [std::arch::x86_64::__m512i; 16]) -> [std::arch::x86_64::__m512i; 16] {
    use std::arch::x86_64::*;
    let z = _mm512_setzero_si512();
    // Rows 2k, 2k + 1 interleaved by lane, then rows 4k..4k + 3 by lane pairs: u[4k + m]'s
    // 128-bit part l holds column 4l + m of rows 4k..4k + 3.
    let mut t = [z; 16];
    for k in 0..8 {
        t[2 * k] = _mm512_unpacklo_epi32(r[2 * k], r[2 * k + 1]);
        t[2 * k + 1] = _mm512_unpackhi_epi32(r[2 * k], r[2 * k + 1]);
    }
    let mut u = [z; 16];
    for k in 0..4 {
        u[4 * k] = _mm512_unpacklo_epi64(t[4 * k], t[4 * k + 2]);
        u[4 * k + 1] = _mm512_unpackhi_epi64(t[4 * k], t[4 * k + 2]);
        u[4 * k + 2] = _mm512_unpacklo_epi64(t[4 * k + 1], t[4 * k + 3]);
        u[4 * k + 3] = _mm512_unpackhi_epi64(t[4 * k + 1], t[4 * k + 3]);
    }
    // The 128-bit parts gathered: column 4l + m is part l of u[m], u[4 + m], u[8 + m], u[12 + m].
    let mut out = [z; 16];
    for m in 0..4 {
        let even_a = _mm512_shuffle_i32x4::<0x88>(u[m], u[4 + m]);
        let even_b = _mm512_shuffle_i32x4::<0x88>(u[8 + m], u[12 + m]);
        let odd_a = _mm512_shuffle_i32x4::<0xdd>(u[m], u[4 + m]);
        let odd_b = _mm512_shuffle_i32x4::<0xdd>(u[8 + m], u[12 + m]);
        out[m] = _mm512_shuffle_i32x4::<0x88>(even_a, even_b);
        out[8 + m] = _mm512_shuffle_i32x4::<0xdd>(even_a, even_b);
        out[4 + m] = _mm512_shuffle_i32x4::<0x88>(odd_a, odd_b);
        out[12 + m] = _mm512_shuffle_i32x4::<0xdd>(odd_a, odd_b);
    }
    out
}

#[cfg(not(target_arch = "x86_64"))]
unsafe fn micro_kernel(_: &[u32], _: &[usize; MR], _: &[usize], _: usize, _: &[u32], _: Tile<'_>) {
    unreachable!("conv_bf16 checks available() first")
}

#[cfg(test)]
mod tests;
