//! The forward pass of [`super::conv_direct`]: images rearranged into lanes of channels, the
//! micro-kernel over (positions × 32 output channels) and its transposed stores.

use std::marker::PhantomData;

use super::pack::{tap_lanes, Weights};
use super::{buffer_len, error, expect_len, with_features, ConvDims, Element, MR, NB};
#[cfg(target_arch = "x86_64")]
use super::{store_transposed, transpose16};
use crate::cpu::{par_ranges, KernelError, SharedMut};

/// Images in a padded channels-last layout of 32-bit lanes: element `((b·hp + y)·wp + x)·cl + q`
/// holds lane q of image `b` at padded position `(y, x)` — channels `2q` (low half) and `2q + 1`
/// (high half) for bf16, channel q for f32; the padding and a missing last channel are zeros.
pub struct ChannelsLast<E: Element> {
    pub(super) data: Vec<u32>,
    pub(super) dims: ConvDims,
    element: PhantomData<E>,
}

impl<E: Element> ChannelsLast<E> {
    /// `x` (n, c_in, h, w), contiguous, rearranged; parallel over image rows.
    pub fn new(x: &[E], dims: ConvDims) -> Result<Self, KernelError> {
        dims.out_hw()?;
        let (hp, wp) = dims.padded();
        let cl = dims.lanes::<E>();
        expect_len(x.len(), &[dims.n, dims.c_in, dims.h, dims.w], "image elements", &dims)?;
        let len = buffer_len(&[dims.n, hp, wp, cl], "padded images", &dims)?;
        let mut data = vec![0u32; len];
        let out = SharedMut::new(&mut data);
        let (c, h, w, p) = (dims.c_in, dims.h, dims.w, dims.pad);
        let wide = E::available();
        // One work item per image row (its padded row: the padding columns stay zero).
        par_ranges(dims.n * h, 8, |rows| {
            for r in rows {
                let (b, y) = (r / h, r % h);
                // SAFETY: padded row (b, y + p) is this row's only.
                let dst = unsafe { out.range(((b * hp + y + p) * wp + p) * cl, w * cl) };
                let image = &x[b * c * h * w..][..c * h * w];
                if wide {
                    // SAFETY: the CPU has E's features (`available`).
                    unsafe { lanes_row_wide(image, (c, h, w), y, dst) };
                } else {
                    lanes_row(image, (c, h, w), y, dst);
                }
            }
        });
        Ok(ChannelsLast { data, dims, element: PhantomData })
    }
}

/// Row `y` of `image` (c, h, w) as lanes: `dst[x · cl + q]` holds lane q at column x (a pair's
/// high half zero past the last channel).
pub(super) fn lanes_row<E: Element>(image: &[E], (c, h, w): (usize, usize, usize), y: usize, dst: &mut [u32]) {
    let cl = c.div_ceil(E::PER_LANE);
    let src = |ch: usize| &image[(ch * h + y) * w..][..w];
    for q in 0..cl {
        let lo = src(E::PER_LANE * q);
        let hi = if E::PER_LANE == 2 && 2 * q + 1 < c { Some(src(2 * q + 1)) } else { None };
        for (i, l) in lo.iter().enumerate() {
            dst[i * cl + q] = E::lane(*l, hi.map_or(E::ZERO, |hi| hi[i]));
        }
    }
}

with_features! {
    /// [`lanes_row`] 16 columns × 16 lanes at a time: one register of 16 columns per lane
    /// ([`Element::lanes`]), the 16 registers transposed into one per column.
    ///
    /// # Safety
    /// The CPU has E's features ([`Element::available`]).
    pub(super) unsafe fn lanes_row_wide => lanes_row_avx512(
        image: &[E], dims: (usize, usize, usize), y: usize, dst: &mut [u32],
    )
}

#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn lanes_row_avx512<E: Element>(image: &[E], (c, h, w): (usize, usize, usize), y: usize, dst: &mut [u32]) {
    // SAFETY: `with_features` compiles this into a kernel with AVX-512F, BW and VL, run
    // only where the CPU has them; the reads and writes are checked as they are made.
    unsafe {
        use std::arch::x86_64::*;
        let cl = c.div_ceil(E::PER_LANE);
        assert!(image.len() >= c * h * w && y < h && dst.len() >= w * cl, "conv_direct: a row outside its image");
        for q0 in (0..cl).step_by(16) {
            let qn = 16.min(cl - q0);
            for x0 in (0..w).step_by(16) {
                let xn = 16.min(w - x0);
                let mut rows = [_mm512_setzero_si512(); 16];
                for (qq, row) in rows.iter_mut().enumerate().take(qn) {
                    let ch = E::PER_LANE * (q0 + qq);
                    // SAFETY: channel ch (and ch + 1 when a lane holds it) of the image, row y,
                    // columns x0..x0 + xn: inside `image` (checked above); lanes past xn are not read.
                    let at = |ch: usize| image.as_ptr().add((ch * h + y) * w + x0);
                    let hi = if E::PER_LANE == 2 && ch + 1 < c { Some(at(ch + 1)) } else { None };
                    *row = E::lanes(at(ch), hi, xn);
                }
                // Lanes q0..q0 + qn of columns x0..x0 + xn.
                store_transposed(rows, (xn, qn), dst, (x0 * cl + q0, cl));
            }
        }
    }
}

/// The convolution of `x` with `w` into `dst` (n, c_out, oh, ow), each sum stored once (bf16:
/// rounded once); parallel over blocks of 32 output channels (and over groups of images where
/// the blocks alone would not give every thread two items), each worker packing the blocks it
/// uses. An error when the two were prepared for other dimensions, `dst` has the wrong length,
/// or the CPU lacks E's features.
pub fn conv_direct<E: Element>(dst: &mut [E], x: &ChannelsLast<E>, w: &Weights<'_, E>) -> Result<(), KernelError> {
    if x.dims != w.dims {
        return Err(error(format!("images prepared for {:?}, weights for {:?}", x.dims, w.dims)));
    }
    if !E::available() {
        return Err(error(format!("this CPU lacks the AVX-512 features of {:?} convolutions", E::ZERO)));
    }
    let d = x.dims;
    let (oh, ow) = d.out_hw()?;
    let plane = oh * ow;
    expect_len(dst.len(), &[d.n, d.c_out, plane], "output elements", &d)?;
    let (hp, wp) = d.padded();
    let (cl, taps, blocks) = (d.lanes::<E>(), d.k * d.k, d.c_out.div_ceil(NB));
    if d.n == 0 || plane == 0 || d.c_out == 0 {
        return Ok(());
    }
    // The last window's last lane lies inside the images (every read below is at most this far).
    let last = ((d.n - 1) * hp + (oh - 1) * d.stride + d.k - 1) * wp + (ow - 1) * d.stride + d.k - 1;
    assert!((last + 1) * cl <= x.data.len() && w.block >= taps * tap_lanes(cl), "conv_direct: short operands");
    // Offsets of the taps from a window's first element, in lanes.
    let tap_at: Vec<usize> = (0..taps).map(|t| ((t / d.k) * wp + t % d.k) * cl).collect();
    let out = SharedMut::new(dst);
    block_items(
        (blocks, d.n),
        w.block,
        |cb, packed| w.pack(cb, packed),
        |cb, b, packed| {
            let couts = NB.min(d.c_out - cb * NB);
            // SAFETY: image b's output channels of block cb are this item's only.
            let dst = unsafe { out.range((b * d.c_out + cb * NB) * plane, couts * plane) };
            // SAFETY: the CPU has E's features (checked above); every window lies inside the images
            // (`last`, checked above); `packed` holds block cb's taps.
            unsafe { plane_tiles(x, (b, plane, ow), (&tap_at, cl), packed, dst, couts) };
        },
    );
    Ok(())
}

/// The work of `units` blocks of packed weights over `n` images, in parallel: items are (unit,
/// group of images), unit-major so that a worker's items share blocks, with images grouped only
/// where the units alone would not give every thread two items. A worker packs a unit's block
/// once for its consecutive items of that unit (`pack(unit, buffer)`, into a buffer of `lanes`),
/// then runs `image(unit, b, packed)` for each image b of the item.
pub(super) fn block_items(
    (units, n): (usize, usize),
    lanes: usize,
    pack: impl Fn(usize, &mut [u32]) + Sync,
    image: impl Fn(usize, usize, &[u32]) + Sync,
) {
    if units == 0 || n == 0 {
        return;
    }
    let threads = rayon::current_num_threads().max(1);
    let per = n.div_ceil((2 * threads).div_ceil(units).clamp(1, n));
    let groups = n.div_ceil(per);
    par_ranges(units * groups, 1, |items| {
        let mut packed = vec![0u32; lanes];
        let mut have = None;
        for item in items {
            let (unit, group) = (item / groups, item % groups);
            if have != Some(unit) {
                pack(unit, &mut packed);
                have = Some(unit);
            }
            for b in group * per..((group + 1) * per).min(n) {
                image(unit, b, &packed);
            }
        }
    });
}

/// Image `b`'s plane of `dst` (its block's `couts` output channels) in tiles of [`MR`] or
/// [`SHORT`] positions, whichever suits the plane.
///
/// # Safety
/// As [`tiles`].
pub(super) unsafe fn plane_tiles<E: Element>(
    x: &ChannelsLast<E>,
    (b, plane, ow): (usize, usize, usize),
    (tap_at, cl): (&[usize], usize),
    packed: &[u32],
    dst: &mut [E],
    couts: usize,
) {
    // SAFETY: the caller's contract.
    unsafe {
        if plane % SHORT == 0 && plane % MR != 0 && plane < SHORT_BELOW {
            tiles::<E, SHORT>(x, (b, plane, ow), (tap_at, cl), packed, dst, couts);
        } else {
            tiles::<E, MR>(x, (b, plane, ow), (tap_at, cl), packed, dst, couts);
        }
    }
}

/// Tile rows for planes that are a multiple of it and not of [`MR`] (ResNet's 7 × 7 and 14 × 14
/// layers: 12 rows compute 60 positions for 49 and 204 for 196). The shorter tile stores more
/// often a position (its 16 × 16 transposition carries 7 rows, not 12), so only below
/// [`SHORT_BELOW`] positions, where 12 rows waste at least a few percent: at 14² the 7-row tiles
/// ran 1.035× as fast (BENCHMARKS.md, "fifth session").
const SHORT: usize = 7;
/// Positions from which [`MR`] rows are used whatever the plane.
const SHORT_BELOW: usize = 400;
// The kernels below are instantiated with these two as literals.
const _: () = assert!(MR == 12 && SHORT == 7);

/// Image `b`'s plane of `dst` (its block's `couts` output channels) in tiles of `M` positions.
///
/// # Safety
/// The CPU has E's features; image b's every window (`tap_at`, `cl` lanes) lies inside `x`.
unsafe fn tiles<E: Element, const M: usize>(
    x: &ChannelsLast<E>,
    (b, plane, ow): (usize, usize, usize),
    (tap_at, cl): (&[usize], usize),
    packed: &[u32],
    dst: &mut [E],
    couts: usize,
) {
    let d = x.dims;
    let (hp, wp) = d.padded();
    for p0 in (0..plane).step_by(M) {
        let height = M.min(plane - p0);
        let mut at = [0usize; M];
        for (i, a) in at.iter_mut().enumerate() {
            // A ragged tile repeats its last position (its sums are not stored).
            let p = (p0 + i).min(plane - 1);
            *a = ((b * hp + (p / ow) * d.stride) * wp + (p % ow) * d.stride) * cl;
        }
        let tile = Tile { dst: &mut *dst, plane, p0, height, couts };
        // SAFETY: the caller's contract: the CPU has E's features, and every window of a valid
        // position lies inside image b's padded rows, so `at[i] + tap_at[t] + q` < x's length
        // for every tap and lane; the kernel checks that `packed` holds the lanes of every tap.
        unsafe {
            match M {
                MR => micro_kernel(&x.data, &at[..], tap_at, cl, packed, tile),
                _ => micro_kernel_short(&x.data, &at[..], tap_at, cl, packed, tile),
            }
        }
    }
}

/// Where a micro-tile's sums go: positions `p0..p0 + height` of the first `couts` of 32
/// output planes (`plane` positions each) in `dst`.
struct Tile<'a, E> {
    dst: &'a mut [E],
    plane: usize,
    p0: usize,
    height: usize,
    couts: usize,
}

with_features! {
    /// The `MR × 32` sums of one tile (`at.len()` = [`MR`] positions), stored into `tile`:
    /// position `i`'s window starts at lane
    /// `at[i]` of `x`, tap `t` `tap_at[t]` further, and the weights run (lane, 32 channels)
    /// through `w` from tap `t`'s start, `t · tap_lanes(cl)`.
    ///
    /// # Safety
    /// The CPU has E's features; `at[i] + tap_at[t] + cl − 1 < x.len()` for every i and t; `w`
    /// holds the lanes of `tap_at.len()` taps.
    unsafe fn micro_kernel => micro_kernel_avx512::<12>(
        x: &[u32], at: &[usize], tap_at: &[usize], cl: usize, w: &[u32], tile: Tile<'_, E>,
    )
}

with_features! {
    /// [`micro_kernel`] with [`SHORT`] positions.
    ///
    /// # Safety
    /// As [`micro_kernel`].
    unsafe fn micro_kernel_short => micro_kernel_avx512::<7>(
        x: &[u32], at: &[usize], tap_at: &[usize], cl: usize, w: &[u32], tile: Tile<'_, E>,
    )
}

#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn micro_kernel_avx512<E: Element, const M: usize>(
    x: &[u32],
    at: &[usize],
    tap_at: &[usize],
    cl: usize,
    w: &[u32],
    tile: Tile<'_, E>,
) {
    // SAFETY: `with_features` compiles this into a kernel with AVX-512F, BW and VL, run
    // only where the CPU has them; the reads and writes are checked as they are made.
    unsafe {
        use std::arch::x86_64::*;
        let Tile { dst, plane, p0, height, couts } = tile;
        assert!(
            at.len() == M && height <= M && p0 + height <= plane && couts <= NB && couts * plane <= dst.len(),
            "conv_direct: a tile outside its planes"
        );
        let tl = tap_lanes(cl);
        assert!(w.len() >= tap_at.len() * tl, "conv_direct: short weights");
        let mut acc = [[_mm512_setzero_ps(); 2]; M];
        let base = x.as_ptr();
        for (ti, &t) in tap_at.iter().enumerate() {
            let mut wp = w[ti * tl..].as_ptr();
            let mut rows = [base; M];
            for (r, a) in rows.iter_mut().zip(at) {
                // SAFETY: inside x (the caller's contract).
                *r = base.add(a + t);
            }
            for q in 0..cl {
                // SAFETY: 32 lanes of w at wp (checked length), lane q of each window inside x.
                let w0 = _mm512_loadu_si512(wp.cast());
                let w1 = _mm512_loadu_si512(wp.add(16).cast());
                for (sums, r) in acc.iter_mut().zip(&rows) {
                    sums[0] = E::madd(sums[0], r.add(q), w0);
                    sums[1] = E::madd(sums[1], r.add(q), w1);
                }
                wp = wp.add(NB);
            }
        }
        // Each register of 16 output channels at the M positions, transposed (16 × 16, the rows
        // past M zero) into 16 runs of positions and stored, `height` lanes of each.
        let mask: __mmask16 = ((1u32 << height) - 1) as u16;
        for v in 0..2 {
            let mut rows = [_mm512_setzero_si512(); 16];
            for (r, sums) in rows.iter_mut().zip(&acc) {
                *r = _mm512_castps_si512(sums[v]);
            }
            let runs = transpose16(rows);
            for (jj, run) in runs.iter().enumerate().take(couts.saturating_sub(16 * v)) {
                // SAFETY: plane 16v + jj < couts, positions p0..p0 + height inside it (checked).
                E::store(dst.as_mut_ptr().add((16 * v + jj) * plane + p0), mask, _mm512_castsi512_ps(*run));
            }
        }
    }
}
