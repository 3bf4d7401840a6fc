//! f32 products of a linear layer, `x · Wᵀ` (x: m × k, rows along the depth; W's columns along
//! the depth), on register tiles of wick's own for CPUs with AVX2 and FMA but not AVX-512: 6 rows
//! of x × 16 columns of W, twelve 8-lane sums, three of the sixteen registers left for the
//! panel's two vectors and the broadcast.
//!
//! Why: on the AVX2 paths these tiles multiplied the transformers' layer shapes 1.05–1.29× as
//! fast as the `gemm` crate's own kernel (its `x2x6`, run on the transposed problem, W copied
//! into its panels by `staged`) at 128 rows, 1.01–1.08× at 197 and 0.98–1.15× at 256 (medians of
//! 7 alternating rounds in one process, `cargo bench -p wick-kernels --bench paths_ab -- 128,197,256 7 tiles`;
//! BENCHMARKS.md "Transformer inference (issue 50)"). At 1 024 rows an earlier form of them ran
//! 0.93–1.08× (the crate keeps those). On AVX-512 the same design (8 × 32 or 12 × 32 tiles) ran
//! at 0.85–1.05× the crate's 64 × 6 kernel, which keeps those products.
//!
//! Blocking: W a panel of 16 columns at a time, copied depth-major a slice of [`KC`] depths at a
//! time (16 KiB, in L1 while every tile of x's rows passes it; the slice of x's rows stays in
//! L2). While one slice is multiplied, the next one's columns are fetched into L2: W comes from
//! memory (a model's weights are not in cache), and the copy would otherwise wait on it. x is
//! read in place, or, for wide products ([`PACK_MIN_COLUMNS`]), packed once per product tile by
//! tile (element (i, p) of a tile's slice at p·6 + i: one pointer and immediate offsets in the
//! inner loop, no address arithmetic beside the multiply-adds).
//!
//! Numerics: f32 sums in depth order within a slice of [`KC`], the slices added into the
//! destination in depth order: each element the same whatever m, n and the thread count.

use super::blocking::Mat;
use super::pack::fill_panel;
use super::switch::Switch;
use super::Job;

/// Depths of one slice.
const KC: usize = 256;

/// Columns of W (of this thread's part of the product) from which x is packed: each element of
/// x then serves at least that many multiply-adds, against a share of one register
/// transposition. With fewer, reading x's rows in place (six rows' addresses formed beside the
/// multiply-adds) led: BERT-base's 768 → 768 and 3072 → 768 and MiniLM's 1536 → 384 (384 or
/// 192 columns a thread) 1.03–1.10× the crate in place against 0.92–1.06× packed, while the
/// wide layers (1 152 columns a thread and more) ran 1.04–1.29× packed against 1.02–1.11× in
/// place (medians of alternating runs in one process at 128, 197 and 256 rows).
const PACK_MIN_COLUMNS: usize = 1024;

/// Rows of x in one tile.
const ROWS: usize = 6;

/// Columns of W in one tile (two vectors of 8 f32).
const NR: usize = 16;

/// True where the tiles take products: CPUs with AVX2 and FMA ([`runs_here`]) but not AVX-512
/// ([`crate::cpu::avx512`], so that `WICK_CPU_AVX512=0` takes them on an AVX-512 CPU), unless
/// turned off ([`use_tiles`], or `WICK_CPU_TILES=0` in the environment for whole processes).
fn available() -> bool {
    runs_here() && !crate::cpu::avx512() && switched_on()
}

/// [`use_tiles`]'s switch.
static SWITCH: Switch = Switch::new("WICK_CPU_TILES");

fn switched_on() -> bool {
    SWITCH.on()
}

/// Turns wick's own f32 tiles on (the default) or off, for side-by-side measurements against the
/// `gemm` crate's kernel in one process (`benches/paths_ab.rs`); whole processes take
/// `WICK_CPU_TILES=0`. Results differ only in the order of the f32 sums.
pub fn use_tiles(on: bool) {
    SWITCH.set(on);
}

/// True on CPUs with AVX2 and FMA, which the tiles need.
fn runs_here() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma")
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// True when x's rows and W's columns lie along the depth, as the tiles read them.
fn along_depth(job: &Job<'_, f32>) -> bool {
    job.a.col_stride == 1 && job.b.row_stride == 1
}

/// True when [`product`] takes the job: operands [`along_depth`], on a CPU where the tiles run
/// ([`available`]).
pub(super) fn applies(job: &Job<'_, f32>) -> bool {
    along_depth(job) && available()
}

/// `dst (m × n, rows dst_row apart) = beta·a·b + (dst if accumulate)` over columns
/// `j0..j0 + n` of `b`, one thread; where `accumulate` is false the destination is written
/// without being read (it may be uninitialised memory). Does nothing unless x's rows and W's
/// columns lie along the depth on a CPU with AVX2 and FMA ([`applies`] decides where it is
/// called).
///
/// # Safety
/// `dst` is valid for writes (and reads where `accumulate`) of the m rows of n elements
/// `dst_row` apart, aliases neither operand, and nothing else reads or writes them meanwhile.
/// The operands' extents are checked here.
pub(super) unsafe fn product(dst: *mut f32, dst_row: usize, job: Job<'_, f32>) {
    if !along_depth(&job) || !runs_here() {
        return;
    }
    let Job { dims: (m, k, n), a, b, j0, beta, accumulate } = job;
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
    // x packed where each of its elements serves enough columns to pay for the copy.
    let xs = (n >= PACK_MIN_COLUMNS).then(|| pack_rows(&a, (m, k)));
    let mut panel = vec![0f32; NR * KC.min(k)];
    let mut narrow: Vec<f32> = Vec::new();
    let tiles = m.div_ceil(ROWS);
    let blocks = (0..n).step_by(NR).flat_map(|c0| (0..k).step_by(KC).map(move |p0| (c0, p0)));
    let mut ahead = blocks.clone().skip(1);
    for (c0, p0) in blocks {
        let (w, kc) = (NR.min(n - c0), KC.min(k - p0));
        let add = accumulate || p0 > 0;
        if w == NR {
            fill_panel(&mut panel, &b.data[p0..], b.col_stride, (j0 + c0, w, kc));
        } else {
            // The last, narrower panel: its columns spread to the tile's width, zeros beside.
            narrow.resize(w * kc, 0.0);
            fill_panel(&mut narrow, &b.data[p0..], b.col_stride, (j0 + c0, w, kc));
            for (to, from) in panel.chunks_exact_mut(NR).zip(narrow.chunks_exact(w)) {
                to[..w].copy_from_slice(from);
                to[w..].fill(0.0);
            }
        }
        let next = ahead.next().map(|(c, p)| Runs {
            first: (j0 + c) * b.col_stride + p,
            apart: b.col_stride,
            count: NR.min(n - c),
            len: KC.min(k - p),
        });
        for (t, r0) in (0..m).step_by(ROWS).enumerate() {
            if let Some(next) = &next {
                next.prefetch(b.data, t, tiles);
            }
            let r = ROWS.min(m - r0);
            let (x, x_row) = match &xs {
                Some(xs) => (xs[r0 * k + p0 * r..].as_ptr(), None),
                None => (a.data[r0 * a.row_stride + p0..].as_ptr(), Some(a.row_stride)),
            };
            let tile = Tile {
                kc,
                x,
                x_row,
                panel: panel.as_ptr(),
                // SAFETY: row r0 and column c0 of the destination (r0 < m, c0 < n).
                dst: unsafe { dst.add(r0 * dst_row + c0) },
                dst_row,
                cols: w,
                beta,
                add,
            };
            // SAFETY: AVX2 and FMA were detected; x holds kc depths of rows r0..r0 + r (packed,
            // or in place: checked above), the panel kc steps of 16, the destination r rows of w
            // elements (the caller's contract).
            unsafe { tile.run(r) };
        }
    }
}

/// x's m rows packed as the tiles read them: the tile of rows r0..r0 + r (r ≤ [`ROWS`]) from
/// r0·k, its slice of depths from p0 at r0·k + p0·r, element (i, p) of the slice at p·r + i;
/// eight elements more at the end. Eight depths of eight rows at a time are one register
/// transposition (AVX2), each depth's r elements stored as eight lanes, the lanes past r written
/// over by the next depth (or the next slice); the depths past the last eight one by one.
fn pack_rows(a: &Mat<'_, f32>, (m, k): (usize, usize)) -> Vec<f32> {
    let rows = ROWS;
    let mut xs = vec![0f32; m * k + 8];
    for r0 in (0..m).step_by(rows) {
        let r = rows.min(m - r0);
        let row = |i: usize| &a.data[(r0 + i.min(r - 1)) * a.row_stride..][..k];
        for p0 in (0..k).step_by(KC) {
            let kc = KC.min(k - p0);
            let at = r0 * k + p0 * r;
            let whole = kc / 8 * 8;
            #[cfg(target_arch = "x86_64")]
            for q in (0..whole).step_by(8) {
                let src: [*const u8; 8] = std::array::from_fn(|i| row(i)[p0 + q..p0 + q + 8].as_ptr().cast());
                let to = &mut xs[at + q * r..];
                assert!(to.len() >= 7 * r + 8);
                // SAFETY: the CPU has AVX2 (every tile's ISA does); each source holds eight f32;
                // `to` holds the eight depths' stores, r apart, eight lanes each (checked).
                unsafe { super::transpose::transpose8x8(src, to.as_mut_ptr().cast(), r) };
            }
            #[cfg(not(target_arch = "x86_64"))]
            let whole = 0;
            for p in whole..kc {
                for i in 0..r {
                    xs[at + p * r + i] = row(i)[p0 + p];
                }
            }
        }
    }
    xs
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
                unsafe {
                    std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T1 }>((v as *const f32).cast())
                };
            }
            #[cfg(not(target_arch = "x86_64"))]
            let _ = (data, at);
        }
    }
}

/// One tile's operands: `kc` depths of R rows of x (packed: element (i, p) at p·R + i; or in
/// place, rows `x_row` apart) against a panel of `kc` steps of 16 columns, into R rows of `cols`
/// (≤ 16) elements at `dst`; `add`: added to what the destination holds, else written over it
/// unread.
struct Tile {
    kc: usize,
    x: *const f32,
    x_row: Option<usize>,
    panel: *const f32,
    dst: *mut f32,
    dst_row: usize,
    cols: usize,
    beta: f32,
    add: bool,
}

impl Tile {
    /// Runs the tile on `r` rows (1 to [`ROWS`]).
    ///
    /// # Safety
    /// The CPU has AVX2 and FMA; the pointers hold what [`Tile`] says for `r` rows.
    unsafe fn run(&self, r: usize) {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the caller's contract.
        unsafe {
            match r {
                6 => avx2::<6>(self),
                5 => avx2::<5>(self),
                4 => avx2::<4>(self),
                3 => avx2::<3>(self),
                2 => avx2::<2>(self),
                _ => avx2::<1>(self),
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = r;
    }
}

/// R rows × 16 columns on AVX2 with FMA, x packed or read in place (`x_row`).
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
        if let Some(x_row) = t.x_row {
            // In place: each row's own run. Not written out several steps at a time: with R row
            // addresses live, that spilled registers.
            let x: [*const f32; R] = std::array::from_fn(|i| t.x.add(i * x_row));
            let mut wp = t.panel;
            for p in 0..t.kc {
                let w0 = _mm256_loadu_ps(wp);
                let w1 = _mm256_loadu_ps(wp.add(8));
                for (sums, row) in acc.iter_mut().zip(&x) {
                    let v = _mm256_broadcast_ss(&*row.add(p));
                    sums[0] = _mm256_fmadd_ps(v, w0, sums[0]);
                    sums[1] = _mm256_fmadd_ps(v, w1, sums[1]);
                }
                wp = wp.add(16);
            }
        } else {
            // Packed: one step of the depth is two vectors of the panel against a broadcast of
            // each row, written out four steps at a time (immediate offsets from one pointer).
            macro_rules! step {
                ($p:expr, $u:expr) => {{
                    let w0 = _mm256_loadu_ps(t.panel.add(($p + $u) * 16));
                    let w1 = _mm256_loadu_ps(t.panel.add(($p + $u) * 16 + 8));
                    for (i, sums) in acc.iter_mut().enumerate() {
                        let v = _mm256_broadcast_ss(&*t.x.add(($p + $u) * R + i));
                        sums[0] = _mm256_fmadd_ps(v, w0, sums[0]);
                        sums[1] = _mm256_fmadd_ps(v, w1, sums[1]);
                    }
                }};
            }
            let whole = t.kc / 4 * 4;
            let mut p = 0;
            while p < whole {
                step!(p, 0);
                step!(p, 1);
                step!(p, 2);
                step!(p, 3);
                p += 4;
            }
            while p < t.kc {
                step!(p, 0);
                p += 1;
            }
        }
        store(t, &acc);
    }
}

/// A tile's sums times beta into its R rows of `cols` columns, added to what they hold where
/// `add` (masked loads and stores: nothing past `cols` is read or written).
///
/// # Safety
/// As [`Tile::run`]'s, with `R` rows.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn store<const R: usize>(t: &Tile, acc: &[[std::arch::x86_64::__m256; 2]; R]) {
    use std::arch::x86_64::*;
    // SAFETY: rows i < R of the destination, columns below `cols` (the caller's contract).
    unsafe {
        let beta = _mm256_set1_ps(t.beta);
        let lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        let cols = t.cols.min(16) as i32;
        let masks =
            [_mm256_cmpgt_epi32(_mm256_set1_epi32(cols), lane), _mm256_cmpgt_epi32(_mm256_set1_epi32(cols - 8), lane)];
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
    /// than the tile), a depth over several slices and not a multiple of one (nor of the packing's
    /// eight), x and W inside wider buffers, a first column other than 0, written into NaN
    /// (unread) and accumulated; x read in place and packed (from [`PACK_MIN_COLUMNS`] columns).
    #[test]
    fn tiles_match_a_naive_loop() {
        if !runs_here() {
            eprintln!("tiles_f32: SKIPPED, this CPU has no AVX2 with FMA");
            return;
        }
        for (m, k, n) in
            [(13, 600, 45), (8, 256, 32), (70, 1030, 150), (1, 5, 3), (3, 0, 7), (20, 300, 1030), (7, 261, 1024)]
        {
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
