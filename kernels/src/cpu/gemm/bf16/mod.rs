//! bf16 × bf16 → f32 matrix products with AVX512-BF16's `vdpbf16ps` (two bf16 products per
//! f32 lane, added to an f32 accumulator), the CPU counterpart of the tensor-core products
//! autocast uses on a GPU and of oneDNN's bf16 kernels behind PyTorch's CPU autocast.
//!
//! Why a kernel of our own: the `gemm` crate (candle's CPU matmul, used for f32/f64 in
//! [`super::gemm`]) has no bf16 kernel, so AMP's linear layers and convolutions widened both
//! operands to f32 first and multiplied at f32 speed — the reason AMP steps were slower than f32
//! ones. `vdpbf16ps` does twice the multiply-adds of an f32 FMA per instruction and reads half
//! the bytes — faster on AMD's cores; Intel's issue it on one port (no faster than f32 FMAs), and
//! where they have AMX's tile unit the same blocking runs on it instead (`amx`).
//!
//! Layout (BLIS): the product runs over blocks of `MC` rows × `NC` columns of the destination,
//! each block over `KC` deep slices; a slice of `a` is packed into `MR`-row panels and one of `b`
//! into `NR`-column panels, both as consecutive k-pairs (the instruction's operand: element
//! 2p in the low half of a 32-bit lane, 2p+1 in the high), zero-padded at ragged edges. The
//! micro-kernel keeps an `MR × NR` tile of f32 sums in 24 registers.
//!
//! Numerics: the products of two bf16 values are exact in f32; the sums are f32 (the pair is
//! added as one, then to the accumulator, rounding to nearest even), and the instruction treats
//! subnormal inputs and results as zero — as oneDNN's and the GPU's bf16 products do, and within
//! the tolerance autocast accepts. Tests compare with an f64 product.

use half::bf16;

use super::blocking::{product_dims, product_dims_of, Mat};
use super::blocking::{Dest, KMajor, Part, KC, NC};
use super::operand::Lhs;
pub use super::operand::PackedA;
use super::pack::pack;
use crate::cpu::{KernelError, SharedMut};

/// Micro-tile shapes, rows × 16-lane registers per row (12 × 32, 8 × 48, 24 × 16 sums: 24 of
/// the 32 vector registers each), with their relative cost per tile element: 24 × 16 loads a
/// broadcast per multiply-add and ran clearly slower than 12 × 32, 8 × 48 about as fast
/// (BENCHMARKS.md, "Kernel design measurements"). The cheapest for the padded destination is used: a product with 16 columns (a
/// dW of 16 input channels) fills a 24 × 16 tile whole but half of a 12 × 32 one.
const TILES: [(usize, usize, usize); 3] = [(12, 2, 20), (8, 3, 21), (24, 1, 30)];
/// Elements of every micro-tile (12·32 = 24·16 = 8·48).
const TILE: usize = 384;
/// Rows of a block (its packed `a` stays in the L2 cache).
const MC: usize = 144;
/// True when this CPU runs [`gemm_bf16`] (AVX512-BF16, with AVX-512F).
pub fn available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::is_x86_feature_detected!("avx512bf16") && std::is_x86_feature_detected!("avx512f")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// `dst (m × n, row-major f32) = beta·a·b + (dst if accumulate)` with bf16 operands, parallel
/// over blocks of the destination when `parallel`. An error when the shapes do not fit their
/// slices or the CPU lacks AVX512-BF16 (check [`available`] first).
///
/// Where both operands lie along the depth, with a long depth and few outputs (a convolution's
/// weight gradient over many positions), the product runs on them in place (`along_k`).
pub fn gemm_bf16(
    dst: &mut [f32],
    a: Mat<'_, bf16>,
    b: Mat<'_, bf16>,
    beta: f32,
    accumulate: bool,
    parallel: bool,
) -> Result<(), KernelError> {
    let amx = super::amx::available();
    if !amx && super::along_k::applies(&a, &b) {
        if product_dims("wick bf16 gemm", &a, &b, dst, accumulate)?.is_some() {
            super::along_k::product(dst, a, b, beta, accumulate, parallel);
        }
        return Ok(());
    }
    gemm_into(dst, a, b, beta, accumulate, parallel, amx)
}

/// True when [`gemm_bf16_rounded`] takes a product of depth `k` (its sums are rounded as they
/// are stored, so all of k must be summed in one slice).
pub fn rounds_directly(k: usize) -> bool {
    k <= 2 * KC
}

/// `dst (m × n, row-major bf16) = a·b`, each f32 sum rounded once as it is stored (no f32
/// result and no separate rounding pass). An error unless [`rounds_directly`] holds for the
/// depth, and as [`gemm_bf16`].
pub fn gemm_bf16_rounded(
    dst: &mut [bf16],
    a: Mat<'_, bf16>,
    b: Mat<'_, bf16>,
    parallel: bool,
) -> Result<(), KernelError> {
    rounded_depth(a.cols)?;
    gemm_into(dst, a, b, 1.0, false, parallel, super::amx::available())
}

/// An error unless this CPU runs the products ([`available`]).
fn require_cpu() -> Result<(), KernelError> {
    if available() {
        return Ok(());
    }
    Err(KernelError { kernel: "wick bf16 gemm", message: "this CPU has no AVX512-BF16".into() })
}

/// An error unless [`rounds_directly`] holds for depth `k`.
fn rounded_depth(k: usize) -> Result<(), KernelError> {
    if rounds_directly(k) {
        return Ok(());
    }
    Err(KernelError { kernel: "wick bf16 gemm", message: format!("depth {k} is summed in slices") })
}

/// [`gemm_bf16`] and [`gemm_bf16_rounded`]: checks, then the product on the tile unit when
/// `amx` (`amx`), else with `vdpbf16ps` and the micro-tile that suits the shape.
fn gemm_into<D: Dest>(
    dst: &mut [D],
    a: Mat<'_, bf16>,
    b: Mat<'_, bf16>,
    beta: f32,
    accumulate: bool,
    parallel: bool,
    amx: bool,
) -> Result<(), KernelError> {
    require_cpu()?;
    let Some((_, k, _)) = product_dims("wick bf16 gemm", &a, &b, dst, accumulate)? else {
        return Ok(());
    };
    if amx {
        let (av, bv, dims) = (KMajor::rows_of(&a), KMajor::cols_of(&b), (a.rows, k, b.cols));
        split(dst, (av, bv), dims, parallel, (super::amx::MR, super::amx::NR), |part, a, b| {
            part.product_amx(a, b, k, beta, accumulate)
        });
        return Ok(());
    }
    products_avx512(dst, (a, b), beta, accumulate, parallel);
    Ok(())
}

/// [`gemm_into`] (shapes checked) with `vdpbf16ps` and the micro-tile that suits the shape.
fn products_avx512<D: Dest>(
    dst: &mut [D],
    (a, b): (Mat<'_, bf16>, Mat<'_, bf16>),
    beta: f32,
    accumulate: bool,
    parallel: bool,
) {
    let (av, bv) = (Lhs::Rows(KMajor::rows_of(&a), a.rows), KMajor::cols_of(&b));
    products_in(dst, (av, bv), (b.rows, b.cols), tile_for(a.rows, b.cols), (beta, accumulate), parallel);
}

/// The micro-tile (rows, 16-lane registers per row) that costs least for an m × n destination.
fn tile_for(m: usize, n: usize) -> (usize, usize) {
    let cost = |&(mr, nv, weight): &(usize, usize, usize)| {
        m.next_multiple_of(mr).saturating_mul(n.next_multiple_of(16 * nv)).saturating_mul(weight)
    };
    TILES.iter().min_by_key(|t| cost(t)).map_or((12, 2), |t| (t.0, t.1))
}

/// The product `a·b` with `vdpbf16ps` and the micro-tile `shape` (shapes checked; a packed `a`
/// was packed for this tile).
fn products_in<D: Dest>(
    dst: &mut [D],
    (a, b): (Lhs<'_>, KMajor<'_>),
    (k, n): (usize, usize),
    shape: (usize, usize),
    (beta, accumulate): (f32, bool),
    parallel: bool,
) {
    let dims = (a.rows(), k, n);
    let run = |part: &Part<'_, D>, a: &Lhs<'_>, b: &KMajor<'_>| match shape {
        (24, 1) => part.product::<24, 1>(a, b, k, beta, accumulate),
        (8, 3) => part.product::<8, 3>(a, b, k, beta, accumulate),
        _ => part.product::<12, 2>(a, b, k, beta, accumulate),
    };
    split(dst, (a, b), dims, parallel, (shape.0, 16 * shape.1), run);
}

impl PackedA {
    /// `a` packed for products with about `n` columns (which chooses the micro-tile). An error
    /// when `a` does not lie inside its slice or the CPU lacks AVX512-BF16.
    pub fn new(a: Mat<'_, bf16>, n: usize) -> Result<Self, KernelError> {
        Self::packed(a, n, super::amx::available())
    }

    /// The `m × k` operand whose row r `fill(r, row)` writes (`k` elements), packed for
    /// products with about `n` columns without being stored whole: a convolution's flipped
    /// weights for its input gradient, straight from the weights. An error when the CPU lacks
    /// AVX512-BF16 or `m · k` overflows.
    pub fn from_rows(
        (m, k): (usize, usize),
        n: usize,
        fill: &(dyn Fn(usize, &mut [bf16]) + Sync),
    ) -> Result<Self, KernelError> {
        Self::rows_packed((m, k), n, fill, super::amx::available())
    }

    fn rows_packed(
        (m, k): (usize, usize),
        n: usize,
        fill: &(dyn Fn(usize, &mut [bf16]) + Sync),
        amx: bool,
    ) -> Result<Self, KernelError> {
        require_cpu()?;
        if m.checked_add(48).zip(k.checked_add(1)).and_then(|(r, d)| r.checked_mul(d)).is_none() {
            return Err(KernelError { kernel: "wick bf16 gemm", message: format!("a {m}×{k} operand overflows") });
        }
        Ok(PackedA::build_rows((m, k), tile_for(m, n), fill, amx))
    }

    fn packed(a: Mat<'_, bf16>, n: usize, amx: bool) -> Result<Self, KernelError> {
        require_cpu()?;
        PackedA::build(a, tile_for(a.rows, n), amx)
    }
}

/// [`gemm_bf16`] with `a` packed beforehand.
pub fn gemm_bf16_packed(
    dst: &mut [f32],
    a: &PackedA,
    b: Mat<'_, bf16>,
    beta: f32,
    accumulate: bool,
    parallel: bool,
) -> Result<(), KernelError> {
    packed_into(dst, a, b, beta, accumulate, parallel)
}

/// [`gemm_bf16_rounded`] with `a` packed beforehand.
pub fn gemm_bf16_packed_rounded(
    dst: &mut [bf16],
    a: &PackedA,
    b: Mat<'_, bf16>,
    parallel: bool,
) -> Result<(), KernelError> {
    rounded_depth(a.k)?;
    packed_into(dst, a, b, 1.0, false, parallel)
}

fn packed_into<D: Dest>(
    dst: &mut [D],
    a: &PackedA,
    b: Mat<'_, bf16>,
    beta: f32,
    accumulate: bool,
    parallel: bool,
) -> Result<(), KernelError> {
    if a.on_tiles() {
        let rows = Mat::rows(&a.rows, a.m, a.k);
        return gemm_into(dst, rows, b, beta, accumulate, parallel, true);
    }
    if product_dims_of("wick bf16 gemm", (a.m, a.k, true), &b, (dst, b.cols), accumulate)?.is_none() {
        return Ok(());
    }
    products_in(dst, (Lhs::Packed(a), KMajor::cols_of(&b)), (b.rows, b.cols), a.tile, (beta, accumulate), parallel);
    Ok(())
}

/// The product `a·b` into `dst` (shapes checked) as parts of whole `mr × nr` micro-tiles, one
/// per thread when `parallel`, each computed by `run`.
fn split<D: Dest, A: Sync>(
    dst: &mut [D],
    (av, bv): (A, KMajor<'_>),
    (m, k, n): (usize, usize, usize),
    parallel: bool,
    (mr, nr): (usize, usize),
    run: impl Fn(&Part<'_, D>, &A, &KMajor<'_>) + Sync,
) {
    let threads = if parallel { rayon::current_num_threads().max(1) } else { 1 };
    let out = SharedMut::new(&mut dst[..m * n]);
    let whole = Part { out: &out, n, rows: 0..m, cols: 0..n };
    // Parallel: one part per thread, each packing its own operands. Splitting the rows makes
    // every part pack all of `b`, splitting the columns all of `a`: the smaller is repacked.
    let (split_rows, unit, len) = if m >= n { (true, mr, m) } else { (false, nr, n) };
    let parts = threads.min(len.div_ceil(unit)).min((m * n * k / MIN_PART_MACS).max(1));
    if parts <= 1 {
        run(&whole, &av, &bv);
        return;
    }
    let step = len.div_ceil(parts).next_multiple_of(unit);
    use rayon::prelude::*;
    (0..len.div_ceil(step)).into_par_iter().for_each(|i| {
        let range = i * step..((i + 1) * step).min(len);
        let part =
            if split_rows { Part { rows: range, ..whole.clone() } } else { Part { cols: range, ..whole.clone() } };
        run(&part, &av, &bv);
    });
}

/// Multiply-adds below which a product is not split between threads.
const MIN_PART_MACS: usize = 1 << 17;

impl<D: Dest> Part<'_, D> {
    /// This part of `beta·a·b (+ dst)`, block by block.
    fn product<const MR: usize, const NV: usize>(
        &self,
        a: &Lhs<'_>,
        b: &KMajor<'_>,
        k: usize,
        beta: f32,
        accumulate: bool,
    ) {
        let nr = 16 * NV;
        let (mut sa, mut pb) = (Vec::new(), Vec::new());
        let mut tile = [0f32; TILE];
        let m = self.rows.len();
        // A part wider than one column block packs its rows of `a` once, not once per block
        // (a weight gradient's `a` is the output gradient, 2 to 9 blocks wide in ResNet).
        let (local, local_lhs);
        let (a, a_row) = match a {
            Lhs::Rows(v, _) if self.cols.len() > NC => {
                local = PackedA::panels_of(v, (self.rows.start, m), k, (MR, NV), false);
                local_lhs = Lhs::Packed(&local);
                (&local_lhs, 0)
            }
            _ => (a, self.rows.start),
        };
        // Whole panels per block: only the part's last panel may be ragged (a ragged panel goes
        // through the tile buffer).
        let nc = NC.next_multiple_of(nr);
        for c0 in self.cols.clone().step_by(nc) {
            let cols = nc.min(self.cols.end - c0);
            for (slice, k0) in (0..k).step_by(2 * KC).enumerate() {
                let depth = (2 * KC).min(k - k0);
                let pairs = depth.div_ceil(2);
                let pa = a.panels::<MR>((a_row, m), (slice, k0, depth), pairs, &mut sa);
                pack(b, (c0, cols), (k0, depth), nr, pairs, &mut pb);
                let add = accumulate || slice > 0;
                for r0 in (0..m.div_ceil(MR)).step_by(MC / MR) {
                    for jp in 0..cols.div_ceil(nr) {
                        let bp = &pb[jp * nr * pairs..][..nr * pairs];
                        let width = nr.min(cols - jp * nr);
                        for ip in r0..(r0 + MC / MR).min(m.div_ceil(MR)) {
                            let ap = &pa[ip * MR * pairs..][..MR * pairs];
                            let height = MR.min(m - ip * MR);
                            if height == MR && width == nr {
                                // A whole tile: the sums go straight into the destination rows.
                                let rows: [&mut [D]; MR] = std::array::from_fn(|i| {
                                    let row = self.rows.start + ip * MR + i;
                                    // SAFETY: as below (one row segment per tile row).
                                    unsafe { self.out.range(row * self.n + c0 + jp * nr, nr) }
                                });
                                // SAFETY: `gemm_bf16` checked `available()`; the panels hold
                                // `pairs` k-pairs of MR (nr) lanes and every row nr elements.
                                unsafe { micro_kernel::<D, MR, NV, NV>(pairs, ap, bp, Sink::Rows(rows, beta, add)) };
                                continue;
                            }
                            // A ragged panel: only the registers its columns reach (a group of
                            // two 7² images is 98 columns, three 32-column panels and 2 more,
                            // which took a whole fourth panel's multiply-adds).
                            let sink = Sink::Tile(&mut tile);
                            // SAFETY: as above, into the tile (MR·nr = TILE elements); the
                            // narrower kernels read the first 16·W lanes of each k-pair's nr.
                            unsafe {
                                match width.div_ceil(16) {
                                    1 if NV > 1 => micro_kernel::<D, MR, NV, 1>(pairs, ap, bp, sink),
                                    2 if NV > 2 => micro_kernel::<D, MR, NV, 2>(pairs, ap, bp, sink),
                                    _ => micro_kernel::<D, MR, NV, NV>(pairs, ap, bp, sink),
                                }
                            };
                            for i in 0..height {
                                let row = self.rows.start + ip * MR + i;
                                // SAFETY: parts are disjoint rectangles of the destination, and
                                // within one part each (row, column panel) is written once at a
                                // time.
                                let dst = unsafe { self.out.range(row * self.n + c0 + jp * nr, width) };
                                let sums = &tile[i * nr..][..width];
                                D::put(dst, sums, beta, add);
                            }
                        }
                    }
                }
            }
        }
    }
}

/// Where an MR-row micro-tile's sums go.
enum Sink<'a, D, const MR: usize> {
    /// Stored row after row into a [`TILE`]-element buffer.
    Tile(&'a mut [f32; TILE]),
    /// Into MR destination rows of a tile's width each: `row = beta·sums (+ row when the flag)`.
    Rows([&'a mut [D]; MR], f32, bool),
}

/// The `MR × 16·W` product `ap · bp` over `pairs` k-pairs, into `sink`: the first `W` of the
/// panel's `NV` 16-lane registers (a ragged panel's columns), or all of them (`W = NV`).
///
/// # Safety
/// The CPU has AVX512-BF16 and AVX-512F; `ap` holds `pairs · MR` lanes and `bp` `pairs · 16·NV`;
/// MR · 16·NV is at most [`TILE`]; a `Sink::Rows` row holds at least 16·NV elements.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512bf16,avx512f")]
unsafe fn micro_kernel<D: Dest, const MR: usize, const NV: usize, const W: usize>(
    pairs: usize,
    ap: &[u32],
    bp: &[u32],
    sink: Sink<'_, D, MR>,
) {
    use std::arch::x86_64::*;
    let nr = 16 * NV;
    assert!(W <= NV, "gemm_bf16: more registers than the panel has");
    assert!(ap.len() >= pairs * MR && bp.len() >= pairs * nr && MR * nr <= TILE, "gemm_bf16: short panels");
    let mut acc = [[_mm512_setzero_ps(); W]; MR];
    let (mut a, mut b) = (ap.as_ptr(), bp.as_ptr());
    for _ in 0..pairs {
        // SAFETY: `b` points at nr lanes (W ≤ NV 64-byte loads), `a` at MR lanes, inside the
        // panels (checked lengths above).
        unsafe {
            let bv: [__m512bh; W] =
                std::array::from_fn(|v| std::mem::transmute(_mm512_loadu_si512(b.add(16 * v).cast())));
            for (i, row) in acc.iter_mut().enumerate() {
                let ai: __m512bh = std::mem::transmute(_mm512_set1_epi32(*a.add(i) as i32));
                for (sum, bv) in row.iter_mut().zip(&bv) {
                    *sum = _mm512_dpbf16_ps(*sum, ai, *bv);
                }
            }
            a = a.add(MR);
            b = b.add(nr);
        }
    }
    match sink {
        Sink::Tile(tile) => {
            for (i, row) in acc.iter().enumerate() {
                for (v, sum) in row.iter().enumerate() {
                    // SAFETY: row i of the tile, register v: inside MR·nr ≤ TILE floats.
                    unsafe { _mm512_storeu_ps(tile[i * nr + 16 * v..].as_mut_ptr(), *sum) };
                }
            }
        }
        Sink::Rows(rows, beta, add) => {
            assert!(W == NV, "gemm_bf16: a whole tile's rows take every register");
            let scale = _mm512_set1_ps(beta);
            for (dst, sums) in rows.into_iter().zip(&acc) {
                assert!(dst.len() >= nr, "gemm_bf16: a destination row shorter than a tile");
                let p = dst.as_mut_ptr();
                for (v, sum) in sums.iter().enumerate() {
                    // SAFETY: `dst` has nr = 16·NV elements (checked); the CPU's features are
                    // this function's.
                    unsafe { D::put16(p.add(16 * v), *sum, scale, add) };
                }
            }
        }
    }
}

#[cfg(not(target_arch = "x86_64"))]
unsafe fn micro_kernel<D: Dest, const MR: usize, const NV: usize, const W: usize>(
    _: usize,
    _: &[u32],
    _: &[u32],
    _: Sink<'_, D, MR>,
) {
    unreachable!("gemm_bf16 checks available() first")
}

#[cfg(test)]
mod tests;
