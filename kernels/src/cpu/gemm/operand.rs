//! The left operand of the bf16 products as the blocking reads it: packed by each part as it
//! goes, or once for many products ([`PackedA`]: a convolution's weights, multiplied by every
//! image's columns). Uses `blocking` and `pack`; `bf16` uses it.

use half::bf16;

use super::blocking::{KMajor, Mat, KC};
use super::pack::{pack, pack_to};
use crate::cpu::{KernelError, SharedMut};

/// The left operand of a product: read and packed by each part as it goes, or packed once for
/// every product with it ([`PackedA`]).
pub(super) enum Lhs<'a> {
    /// The operand and its rows.
    Rows(KMajor<'a>, usize),
    Packed(&'a PackedA),
}

impl Lhs<'_> {
    /// Rows of the operand.
    pub(super) fn rows(&self) -> usize {
        match self {
            Lhs::Rows(_, m) => *m,
            Lhs::Packed(p) => p.m,
        }
    }

    /// The `MR`-row panels of rows `r0..r0 + m`, depths `k0..k0 + depth` (slice `slice` of the
    /// product, `pairs` k-pairs): packed into `scratch`, or the packed operand's own.
    pub(super) fn panels<'s, const MR: usize>(
        &'s self,
        (r0, m): (usize, usize),
        (slice, k0, depth): (usize, usize, usize),
        pairs: usize,
        scratch: &'s mut Vec<u32>,
    ) -> &'s [u32] {
        match self {
            Lhs::Rows(v, _) => {
                pack(v, (r0, m), (k0, depth), MR, pairs, scratch);
                scratch
            }
            Lhs::Packed(p) => {
                assert!(p.tile.0 == MR && r0 % MR == 0, "gemm_bf16: a part does not start at a packed panel");
                // Every slice before the last is KC pairs deep.
                let at = slice * p.m.next_multiple_of(MR) * KC + r0 * pairs;
                &p.lanes[at..][..m.div_ceil(MR) * MR * pairs]
            }
        }
    }
}

/// A left operand packed once into the micro-kernel's panels, for many products with it (a
/// convolution's weights, multiplied by every image's or chunk's columns), where each product
/// would pack its own `a` again. Packing deep layers' weights per product was a visible share of
/// an AMP step (BENCHMARKS.md, "Kernel design measurements").
pub struct PackedA {
    pub(super) m: usize,
    pub(super) k: usize,
    /// (rows, 16-lane registers per row) of the micro-tile the panels are packed for.
    pub(super) tile: (usize, usize),
    /// The panels of each depth slice, one slice after another.
    pub(super) lanes: Vec<u32>,
    /// Where the products run on AMX's tiles: `a` as a row-major copy (that kernel packs its own
    /// layout per product).
    pub(super) rows: Vec<bf16>,
}

impl PackedA {
    /// `a` packed into panels for the micro-tile `tile`, or copied row-major for AMX's tiles.
    pub(super) fn build(a: Mat<'_, bf16>, tile: (usize, usize), amx: bool) -> Result<Self, KernelError> {
        if !a.fits() {
            return Err(KernelError {
                kernel: "wick bf16 gemm",
                message: format!("a {}×{} operand outside its {} elements", a.rows, a.cols, a.data.len()),
            });
        }
        let (m, k) = (a.rows, a.cols);
        if amx {
            let rows = (0..m)
                .flat_map(|i| (0..k).map(move |j| (i, j)))
                .map(|(i, j)| a.data[i * a.row_stride + j * a.col_stride])
                .collect();
            return Ok(PackedA { m, k, tile, lanes: Vec::new(), rows });
        }
        Ok(Self::panels_of(&KMajor::rows_of(&a), (0, m), k, tile, true))
    }

    /// Rows `r0..r0 + m` of `v` (depth `k`) packed into panels for the micro-tile `tile`; the
    /// packing is split between the threads when `parallel`.
    pub(super) fn panels_of(
        v: &KMajor<'_>,
        (r0, m): (usize, usize),
        k: usize,
        tile: (usize, usize),
        parallel: bool,
    ) -> Self {
        let mr = tile.0;
        let panels = m.div_ceil(mr);
        let mut packed = PackedA { m, k, tile, lanes: vec![0; panels * mr * k.div_ceil(2)], rows: Vec::new() };
        // Each slice's panels, split between the threads in runs of whole panels: the packing
        // is no longer shared by a parallel product's parts, so it is shared here (at batch 1
        // packing deep layers' weights on one thread made ResNet-18's AMP step slower).
        let threads = if parallel { rayon::current_num_threads().max(1) } else { 1 };
        let per = panels.div_ceil(threads).max(1);
        let mut rest = &mut packed.lanes[..];
        for k0 in (0..k).step_by(2 * KC) {
            let depth = (2 * KC).min(k - k0);
            let pairs = depth.div_ceil(2);
            let (slice, tail) = rest.split_at_mut(panels * mr * pairs);
            rest = tail;
            use rayon::prelude::*;
            slice.par_chunks_mut(per * mr * pairs).enumerate().for_each(|(i, run)| {
                let at = i * per * mr;
                pack_to(v, (r0 + at, (m - at).min(per * mr)), (k0, depth), mr, run);
            });
        }
        packed
    }

    /// The `m × k` operand whose row r `fill(r, row)` writes, packed for the micro-tile `tile`
    /// (a panel's rows at a time: the operand is never stored whole), or written out row-major
    /// for AMX's tiles. The packing is split between the threads.
    pub(super) fn build_rows(
        (m, k): (usize, usize),
        tile: (usize, usize),
        fill: &(dyn Fn(usize, &mut [bf16]) + Sync),
        amx: bool,
    ) -> Self {
        let mut packed = PackedA { m, k, tile, lanes: Vec::new(), rows: Vec::new() };
        if amx {
            packed.rows = vec![bf16::ZERO; m * k];
            for (r, row) in packed.rows.chunks_exact_mut(k.max(1)).enumerate().take(m) {
                fill(r, row);
            }
            return packed;
        }
        let mr = tile.0;
        let panels = m.div_ceil(mr);
        packed.lanes = vec![0; panels * mr * k.div_ceil(2)];
        let out = SharedMut::new(&mut packed.lanes);
        let per = panels.div_ceil(rayon::current_num_threads().max(1)).max(1);
        use rayon::prelude::*;
        (0..panels.div_ceil(per)).into_par_iter().for_each(|chunk| {
            let mut rows = vec![bf16::ZERO; mr * k];
            for panel in chunk * per..((chunk + 1) * per).min(panels) {
                let count = mr.min(m - panel * mr);
                for (i, row) in rows.chunks_exact_mut(k.max(1)).enumerate().take(count) {
                    fill(panel * mr + i, row);
                }
                let v = KMajor { data: &rows, outer: k, step: 1 };
                let mut at = 0;
                for k0 in (0..k).step_by(2 * KC) {
                    let depth = (2 * KC).min(k - k0);
                    let pairs = depth.div_ceil(2);
                    // SAFETY: panel `panel`'s lanes of this slice: `mr · pairs` lanes from
                    // `at + panel · mr · pairs`, inside the slice's `panels · mr · pairs`; each
                    // panel belongs to one chunk, so no two threads write the same lanes.
                    let dst = unsafe { out.range(at + panel * mr * pairs, mr * pairs) };
                    pack_to(&v, (0, count), (k0, depth), mr, dst);
                    at += panels * mr * pairs;
                }
            }
        });
        packed
    }

    /// Rows × columns of the operand.
    pub fn dims(&self) -> (usize, usize) {
        (self.m, self.k)
    }

    /// True when the products run on AMX's tiles (`a` kept row-major).
    pub(super) fn on_tiles(&self) -> bool {
        self.lanes.is_empty() && self.m * self.k > 0
    }
}
