//! f32 products of a linear layer, `x · Wᵀ` (x: m × k rows along the depth, W's columns along
//! the depth), on register tiles of wick's own: R rows of x × a panel of W's columns, the panel
//! copied once per product into a buffer that stays in L1 while every row of x passes it.
//!
//! Why not the `gemm` crate's micro-kernel: with W in its panels of 64 columns over the whole
//! depth (`staged`'s `by_panels`), each of the crate's 64 × 6 tiles streams the panel from L2 —
//! 256 bytes for every 24 multiply-adds, against 80–100 G multiply-adds a second at 128 rows where
//! MKL ran 88–135 (BENCHMARKS.md, "What still stands"). Here the panel is [`NR`] columns by a
//! slice of [`KC`] depths (32 KiB), x's rows are read in place (R runs of the slice, from L2),
//! and a step of the depth is two vector loads from L1 and R broadcasts for 2R multiply-adds.
//!
//! Tiles: AVX-512F 8 rows × 32 columns (sixteen 16-lane sums), AVX2 with FMA 6 × 16 (twelve
//! 8-lane sums; three of the sixteen registers left for the panel's two vectors and the
//! broadcast). Elsewhere, or for x not along the depth, [`applies`] is false and the crate takes
//! the product.
//!
//! Numerics: f32 sums in depth order within a slice of [`KC`], the slices added into the
//! destination in depth order; each element the same whatever m, n and the thread count.

use super::blocking::Mat;
use super::pack::fill_panel;
use super::Job;

/// Depths of one slice: a panel of [`NR`] columns of AVX-512 by 256 depths is 32 KiB, an L1 of
/// Zen 4's size (48 KiB on Sapphire Rapids) beside the rows of x being read.
const KC: usize = 256;

/// The tile each instruction set runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Isa {
    Avx512,
    Avx2,
}

impl Isa {
    /// (rows of x, columns of W) of one tile.
    fn tile(self) -> (usize, usize) {
        match self {
            Isa::Avx512 => (12, 32),
            Isa::Avx2 => (6, 16),
        }
    }
}

fn isa() -> Option<Isa> {
    #[cfg(target_arch = "x86_64")]
    {
        if crate::cpu::avx512() {
            return Some(Isa::Avx512);
        }
        if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
            return Some(Isa::Avx2);
        }
    }
    None
}

/// True when [`product`] takes the job: x's rows along the depth (W's columns are, where
/// `staged` stages) and a CPU with AVX2 and FMA.
pub(super) fn applies(job: &Job<'_, f32>) -> bool {
    job.a.col_stride == 1 && job.b.row_stride == 1 && isa().is_some()
}

/// `dst (m × n, rows dst_row apart) = beta·a·b + (dst if accumulate)` over columns
/// `j0..j0 + n` of `b`, one thread; where `accumulate` is false the destination is written
/// without being read (it may be uninitialised memory). Does nothing where [`applies`] is false.
///
/// # Safety
/// `dst` is valid for writes (and reads where `accumulate`) of the m rows of n elements
/// `dst_row` apart, aliases neither operand, and nothing else reads or writes them meanwhile.
/// The operands' extents are checked here.
pub(super) unsafe fn product(dst: *mut f32, dst_row: usize, job: Job<'_, f32>) {
    let Job { dims: (m, k, n), a, b, j0, beta, accumulate } = job;
    let Some(isa) = isa().filter(|_| applies(&job)) else { return };
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        if !accumulate {
            for i in 0..m {
                // SAFETY: row i's n elements (the caller's contract).
                unsafe { std::ptr::write_bytes(dst.add(i * dst_row), 0, n) };
            }
        }
        return;
    }
    // Every run read below lies inside its operand: row i of x from i·row_stride over k depths,
    // column j of W from j·col_stride over k depths.
    let a_end = (m - 1).checked_mul(a.row_stride).and_then(|e| e.checked_add(k));
    let b_end = (j0 + n - 1).checked_mul(b.col_stride).and_then(|e| e.checked_add(k));
    assert!(
        a_end.is_some_and(|e| e <= a.data.len()) && b_end.is_some_and(|e| e <= b.data.len()),
        "tiles_f32: an operand shorter than its shape"
    );
    let (rows, nr) = isa.tile();
    let mut panel = vec![0f32; nr * KC.min(k)];
    let mut narrow: Vec<f32> = Vec::new();
    let tiles = m.div_ceil(rows);
    // Blocks of W (a panel's columns over a slice of the depth), panel by panel: each column is
    // read along the depth, and the destination's rows of one panel stay in cache across the
    // slices. While one block's tiles run, the next block's columns are fetched into L2, a part
    // before each tile: W comes from memory (a model's weights are not in cache), and packing
    // would otherwise wait on it.
    let blocks = (0..n).step_by(nr).flat_map(|c0| (0..k).step_by(KC).map(move |p0| (c0, p0)));
    let mut ahead = blocks.clone().skip(1);
    for (c0, p0) in blocks {
        let (w, kc) = (nr.min(n - c0), KC.min(k - p0));
        let add = accumulate || p0 > 0;
        if w == nr {
            fill_panel(&mut panel, &b.data[p0..], b.col_stride, (j0 + c0, w, kc));
        } else {
            // The last, narrower panel: its columns spread to the tile's width, zeros beside.
            narrow.resize(w * kc, 0.0);
            fill_panel(&mut narrow, &b.data[p0..], b.col_stride, (j0 + c0, w, kc));
            for (to, from) in panel.chunks_exact_mut(nr).zip(narrow.chunks_exact(w)) {
                to[..w].copy_from_slice(from);
                to[w..].fill(0.0);
            }
        }
        let next = ahead.next().map(|(c, p)| Runs {
            first: (j0 + c) * b.col_stride + p,
            apart: b.col_stride,
            count: nr.min(n - c),
            len: KC.min(k - p),
        });
        for (t, r0) in (0..m).step_by(rows).enumerate() {
            if let Some(next) = &next {
                next.prefetch(b.data, t, tiles);
            }
            let r = rows.min(m - r0);
            let tile = Tile {
                kc,
                x: a.data[r0 * a.row_stride + p0..].as_ptr(),
                x_row: a.row_stride,
                panel: panel.as_ptr(),
                // SAFETY: row r0 and column c0 of the destination (r0 < m, c0 < n).
                dst: unsafe { dst.add(r0 * dst_row + c0) },
                dst_row,
                cols: w,
                beta,
                add,
            };
            // SAFETY: the ISA was detected; x's rows r0..r0 + r hold depths p0..p0 + kc
            // (checked above), the panel kc steps of the tile's width, the destination r rows
            // of w elements (the caller's contract).
            unsafe { tile.run(isa, r) };
        }
    }
}

/// `count` runs of `len` elements, `apart` from one to the next, from `first`: a block of W's
/// columns.
struct Runs {
    first: usize,
    apart: usize,
    count: usize,
    len: usize,
}

impl Runs {
    /// Fetches part `part` of `parts` of the runs' cache lines into L2 (a hint: no fault, no
    /// effect on results; the addresses lie inside `data`).
    fn prefetch(&self, data: &[f32], part: usize, parts: usize) {
        let per_run = self.len.div_ceil(16);
        let lines = self.count * per_run;
        let (lo, hi) = (part * lines / parts, (part + 1) * lines / parts);
        for l in lo..hi {
            let at = self.first + (l / per_run) * self.apart + (l % per_run) * 16;
            #[cfg(target_arch = "x86_64")]
            if let Some(v) = data.get(at) {
                // SAFETY: a prefetch reads nothing architecturally; the address is inside `data`.
                unsafe { std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T1 }>((v as *const f32).cast()) };
            }
            #[cfg(not(target_arch = "x86_64"))]
            let _ = (data, at);
        }
    }
}

/// One tile's operands: `kc` depths of R rows of x (`x_row` apart) against a panel of `kc`
/// steps of the tile's width, into R rows of `cols` elements at `dst`; `add`: added to what the
/// destination holds, else written over it unread.
struct Tile {
    kc: usize,
    x: *const f32,
    x_row: usize,
    panel: *const f32,
    dst: *mut f32,
    dst_row: usize,
    cols: usize,
    beta: f32,
    add: bool,
}

/// `$kernel::<R>($tile)` for the `R` among the listed heights that equals `$r` (1 for any other).
macro_rules! by_rows {
    ($r:expr, $kernel:ident, $tile:expr, $($rows:literal),+) => {
        match $r {
            $($rows => $kernel::<$rows>($tile),)+
            _ => $kernel::<1>($tile),
        }
    };
}
use by_rows;

impl Tile {
    /// Runs the tile on `r` rows (1 up to the ISA's tile rows).
    ///
    /// # Safety
    /// The CPU has the ISA; the pointers hold what [`Tile`] says for `r` rows.
    unsafe fn run(&self, isa: Isa, r: usize) {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the caller's contract.
        unsafe {
            match isa {
                Isa::Avx512 => by_rows!(r, avx512, self, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1),
                Isa::Avx2 => by_rows!(r, avx2, self, 6, 5, 4, 3, 2, 1),
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = (isa, r);
    }
}

/// R rows × 32 columns on AVX-512F.
///
/// # Safety
/// As [`Tile::run`]'s, with `R` rows and a panel 32 wide.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn avx512<const R: usize>(t: &Tile) {
    use std::arch::x86_64::*;
    let mut acc = [[_mm512_setzero_ps(); 2]; R];
    // SAFETY: rows i < R of x, depths p < kc; panel steps p < kc of 32 (the caller's contract).
    unsafe {
        let x: [*const f32; R] = std::array::from_fn(|i| t.x.add(i * t.x_row));
        let mut wp = t.panel;
        for p in 0..t.kc {
            let w0 = _mm512_loadu_ps(wp);
            let w1 = _mm512_loadu_ps(wp.add(16));
            for (i, sums) in acc.iter_mut().enumerate() {
                let v = _mm512_set1_ps(*x[i].add(p));
                sums[0] = _mm512_fmadd_ps(v, w0, sums[0]);
                sums[1] = _mm512_fmadd_ps(v, w1, sums[1]);
            }
            wp = wp.add(32);
        }
        let beta = _mm512_set1_ps(t.beta);
        let masks = [lanes16(t.cols), lanes16(t.cols.saturating_sub(16))];
        for (i, sums) in acc.iter().enumerate() {
            for (h, (&s, &mask)) in sums.iter().zip(&masks).enumerate() {
                let d = t.dst.add(i * t.dst_row + 16 * h);
                let mut v = _mm512_mul_ps(s, beta);
                if t.add {
                    v = _mm512_add_ps(_mm512_maskz_loadu_ps(mask, d), v);
                }
                _mm512_mask_storeu_ps(d, mask, v);
            }
        }
    }
}

/// The mask of the first `n` (at most 16) of 16 lanes.
#[cfg(target_arch = "x86_64")]
fn lanes16(n: usize) -> u16 {
    if n >= 16 {
        u16::MAX
    } else {
        (1u16 << n) - 1
    }
}

/// R rows × 16 columns on AVX2 with FMA.
///
/// # Safety
/// As [`Tile::run`]'s, with `R` rows and a panel 16 wide.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn avx2<const R: usize>(t: &Tile) {
    use std::arch::x86_64::*;
    let mut acc = [[_mm256_setzero_ps(); 2]; R];
    // SAFETY: rows i < R of x, depths p < kc; panel steps p < kc of 16 (the caller's contract).
    unsafe {
        let x: [*const f32; R] = std::array::from_fn(|i| t.x.add(i * t.x_row));
        let mut wp = t.panel;
        for p in 0..t.kc {
            let w0 = _mm256_loadu_ps(wp);
            let w1 = _mm256_loadu_ps(wp.add(8));
            for (i, sums) in acc.iter_mut().enumerate() {
                let v = _mm256_broadcast_ss(&*x[i].add(p));
                sums[0] = _mm256_fmadd_ps(v, w0, sums[0]);
                sums[1] = _mm256_fmadd_ps(v, w1, sums[1]);
            }
            wp = wp.add(16);
        }
        let beta = _mm256_set1_ps(t.beta);
        let lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        let cols = t.cols.min(16) as i32;
        let masks = [_mm256_cmpgt_epi32(_mm256_set1_epi32(cols), lane), _mm256_cmpgt_epi32(_mm256_set1_epi32(cols - 8), lane)];
        for (i, sums) in acc.iter().enumerate() {
            for (h, (&s, &mask)) in sums.iter().zip(&masks).enumerate() {
                let d = t.dst.add(i * t.dst_row + 8 * h);
                let mut v = _mm256_mul_ps(s, beta);
                if t.add {
                    v = _mm256_add_ps(_mm256_maskload_ps(d, mask), v);
                }
                _mm256_maskstore_ps(d, mask, v);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Against an f64 loop: ragged rows (every tile height) and columns (a last panel narrower
    /// than the tile), a depth over several slices and not a multiple of one, x and W inside
    /// wider buffers, a first column other than 0, written into NaN (unread) and accumulated.
    #[test]
    fn tiles_match_a_naive_loop() {
        if isa().is_none() {
            eprintln!("tiles_f32: skipped, this CPU has neither AVX-512F nor AVX2 with FMA");
            return;
        }
        for (m, k, n) in [(13, 600, 45), (8, 256, 32), (70, 1030, 150), (1, 5, 3), (3, 0, 7)] {
            let (x_row, w_row, j0, dst_row) = (k + 5, k + 3, 2, n + 4);
            let x: Vec<f32> = (0..m * x_row).map(|i| (i as f32 * 0.37).sin()).collect();
            let w: Vec<f32> = (0..(n + j0) * w_row).map(|i| (i as f32 * 0.11).cos()).collect();
            let truth = |i: usize, j: usize| -> f64 {
                (0..k).map(|p| x[i * x_row + p] as f64 * w[(j0 + j) * w_row + p] as f64).sum()
            };
            let a = Mat { data: &x[..], rows: m, cols: k, row_stride: x_row, col_stride: 1 };
            let b = Mat { data: &w[..], rows: k, cols: n + j0, row_stride: 1, col_stride: w_row };
            let mut out = vec![f32::NAN; m * dst_row];
            for (accumulate, scale) in [(false, 1.0), (true, 2.0)] {
                let job = Job { dims: (m, k, n), a, b, j0, beta: 0.5, accumulate };
                assert!(applies(&job));
                // SAFETY: the destination holds m rows of n elements dst_row apart, initialised
                // where `accumulate` reads them (the first product wrote every one).
                unsafe { product(out.as_mut_ptr(), dst_row, job) };
                for i in 0..m {
                    for j in 0..n {
                        let (got, want) = (out[i * dst_row + j] as f64, 0.5 * scale * truth(i, j));
                        assert!((got - want).abs() < 2e-3, "{m}×{k}×{n} ({i}, {j}): {got} against {want}");
                    }
                    assert!(out[i * dst_row + n..(i + 1) * dst_row].iter().all(|v| v.is_nan()), "between rows");
                }
            }
        }
    }
}
