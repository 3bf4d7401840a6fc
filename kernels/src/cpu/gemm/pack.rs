//! Packing bf16 operands into the k-pair panels of [`super::bf16`] and
//! [`super::amx`]: lane i of pair p of a panel holds one row's depths 2p (low half) and
//! 2p+1 (high half), `width` lanes per pair.
//!
//! Where a row's depths are neighbours in memory (`step == 1`: a weight in (out, in) layout, a
//! transposed operand), a panel is the transposition of its rows' pairs. That runs as 8 × 8
//! transpositions of 32-bit lanes in AVX2 registers (8 row loads, 24 shuffles, 8 stores per 64
//! lanes). Why not the compiler's: the former block-buffer form compiled to a gather per 8 lanes,
//! slow on AMD's cores, where packing, most of it there, was a visible share of a ResNet-18 AMP
//! step (BENCHMARKS.md, "Kernel design measurements"). The 8 × 8 transposition itself lives in
//! [`super::transpose`], beside the f32 panels' ([`fill_panel`]) it also serves.

use half::bf16;

use super::blocking::{KMajor, Mat};
use super::transpose::{self, transpose8x8, T8};

/// Packs rows `r0..r0+count` of `v`, depths `k0..k0+depth`, as `width`-lane panels of k-pairs:
/// lane i of pair p of panel P holds row P·width+i's depths 2p (low half) and 2p+1 (high half);
/// lanes past `count` and the odd depth's missing partner are zero. Every lane is written (no
/// zero fill first). Compiled for AVX-512 where the CPU has it (the interleaving vectorises).
///
/// `padded` (at least `depth.div_ceil(2)`) is the k-pairs of every panel; those past the depth are zero
/// (the AMX kernel's depth steps are 16 pairs).
pub(super) fn pack(
    v: &KMajor<'_>,
    (r0, count): (usize, usize),
    (k0, depth): (usize, usize),
    width: usize,
    padded: usize,
    out: &mut Vec<u32>,
) {
    let len = count.div_ceil(width) * width * padded.max(depth.div_ceil(2));
    // Grown with zeros only when longer than before; `pack_into` writes every lane.
    if out.len() < len {
        out.resize(len, 0);
    }
    pack_to(v, (r0, count), (k0, depth), width, &mut out[..len])
}

/// [`pack`] into `out`, whose length (whole panels of `width` lanes) sets the k-pairs of every
/// panel.
pub(super) fn pack_to(
    v: &KMajor<'_>,
    (r0, count): (usize, usize),
    (k0, depth): (usize, usize),
    width: usize,
    out: &mut [u32],
) {
    let len = out.len();
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx512bw") {
        #[target_feature(enable = "avx512f,avx512bw")]
        fn wide(v: &KMajor<'_>, r0: usize, count: usize, k0: usize, depth: usize, width: usize, out: &mut [u32]) {
            pack_into::<true>(v, r0, count, k0, depth, width, out)
        }
        // SAFETY: the CPU has AVX-512F and AVX-512BW.
        return unsafe { wide(v, r0, count, k0, depth, width, &mut out[..len]) };
    }
    pack_into::<false>(v, r0, count, k0, depth, width, &mut out[..len])
}

/// [`pack`]'s body; `WIDE`: the caller is compiled for AVX-512 (AVX2 included), so the 8 × 8
/// transpositions may run.
#[inline(always)]
fn pack_into<const WIDE: bool>(
    v: &KMajor<'_>,
    r0: usize,
    count: usize,
    k0: usize,
    depth: usize,
    width: usize,
    out: &mut [u32],
) {
    let pairs = depth.div_ceil(2);
    let whole = depth / 2;
    let panels = count.div_ceil(width);
    if panels == 0 || out.is_empty() {
        return;
    }
    let panel = out.len() / panels;
    for (index, lanes) in out.chunks_exact_mut(panel).enumerate() {
        let (lanes, padding) = lanes.split_at_mut(width * pairs);
        padding.fill(0);
        let first = r0 + index * width;
        let live = width.min(r0 + count - first);
        // Pairs the fast paths below wrote; the rest lane by lane.
        let mut done = 0;
        if v.step == 1 {
            // Each row's pairs are neighbours: the panel is their transposition, 8 lanes × 8
            // pairs at a time in registers (lanes past `live` read as zero rows; a panel edge of
            // fewer than 8 lanes goes through a buffer).
            let pairs8 = if WIDE && cfg!(target_arch = "x86_64") { whole / T8 * T8 } else { 0 };
            #[cfg(target_arch = "x86_64")]
            if pairs8 > 0 {
                let row = |i: usize| &v.data[(first + i) * v.outer + k0..][..depth];
                let zeros = [bf16::ZERO; 2 * T8];
                let mut edge = [0u32; T8 * T8];
                for i0 in (0..width).step_by(T8) {
                    let n = T8.min(width - i0);
                    for p0 in (0..pairs8).step_by(T8) {
                        // A loop, not `std::array::from_fn`: its closure, compiled with the
                        // caller's AVX-512, is not inlined into `from_fn` (compiled without):
                        // a call per row (BENCHMARKS.md, "Kernel design measurements").
                        let mut src: [&[bf16]; T8] = [&zeros[..]; T8];
                        for (r, s) in src.iter_mut().enumerate().take(live.saturating_sub(i0)) {
                            *s = &row(i0 + r)[2 * p0..2 * (p0 + T8)];
                        }
                        if n == T8 {
                            let dst = &mut lanes[p0 * width + i0..][..(T8 - 1) * width + T8];
                            // SAFETY: `pairs8 > 0` only when `WIDE`: the caller runs with
                            // AVX-512, which includes AVX2.
                            unsafe { transpose8(src, dst, width) };
                        } else {
                            // SAFETY: as above.
                            unsafe { transpose8(src, &mut edge, T8) };
                            for (p, run) in edge.chunks_exact(T8).enumerate() {
                                lanes[(p0 + p) * width + i0..][..n].copy_from_slice(&run[..n]);
                            }
                        }
                    }
                }
            }
            done = pairs8;
        } else if v.outer == 1 {
            // Rows are neighbours in memory: interleave depth 2p's and 2p+1's runs.
            for (p, dst) in lanes.chunks_exact_mut(width).enumerate() {
                let even = &v.data[first + (k0 + 2 * p) * v.step..][..live];
                if p < whole {
                    let odd = &v.data[first + (k0 + 2 * p + 1) * v.step..][..live];
                    dst.iter_mut().zip(even.iter().zip(odd)).for_each(|(d, (e, o))| *d = pair(*e, *o));
                } else {
                    dst.iter_mut().zip(even).for_each(|(d, e)| *d = pair(*e, bf16::ZERO));
                }
                dst[live..].fill(0);
            }
            done = pairs;
        }
        let at = |q: usize, i: usize| v.data[(first + i) * v.outer + (k0 + q) * v.step];
        for (p, dst) in lanes.chunks_exact_mut(width).enumerate().skip(done) {
            for (i, d) in dst.iter_mut().enumerate() {
                *d = if i >= live {
                    0
                } else {
                    pair(at(2 * p, i), if p < whole { at(2 * p + 1, i) } else { bf16::ZERO })
                };
            }
        }
    }
}

/// Eight rows of eight k-pairs (`src[r]`: 16 bf16 values) transposed into eight runs of eight
/// lanes: run p, at `dst[p · stride..][..8]`, holds pair p of every row.
///
/// # Safety
/// The CPU has AVX2. (`src` rows of 16 values and `dst` of at least `7 · stride + 8` lanes are
/// checked.)
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn transpose8(src: [&[bf16]; T8], dst: &mut [u32], stride: usize) {
    assert!(src.iter().all(|r| r.len() == 2 * T8) && dst.len() >= (T8 - 1) * stride + T8);
    // SAFETY: each row holds 32 bytes and `dst` the eight runs (checked above); AVX2 is the
    // caller's contract.
    unsafe { transpose8x8(src.map(|r| r.as_ptr().cast()), dst.as_mut_ptr(), stride) }
}

/// Columns `first..first + w` of `b` (each `k` long, `col_stride` apart: `b` lies along the
/// depth) laid out as one panel: element (p, j) at `panel[p · w + j]`, through
/// [`transpose::transpose`] (register blocks for f32; a plain loop ran at a third of a copy's
/// speed).
pub(super) fn fill_panel<T: Copy + 'static>(
    panel: &mut [T],
    b: &[T],
    col_stride: usize,
    (first, w, k): (usize, usize, usize),
) {
    assert!(panel.len() >= w * k);
    if w == 0 || k == 0 {
        return;
    }
    let start = first.checked_mul(col_stride).filter(|&s| s <= b.len()).expect("the panel's columns lie in b");
    let columns = Mat { data: &b[start..], rows: w, cols: k, row_stride: col_stride, col_stride: 1 };
    // SAFETY: element (p, j) goes to p·w + j < k·w ≤ panel.len() (checked), which nothing else
    // touches (a `&mut` borrow).
    unsafe { transpose::transpose(panel.as_mut_ptr(), w, columns) };
}

/// Two bf16 values as one 32-bit lane: `lo` in the low half (the instruction's even element).
#[inline(always)]
pub(super) fn pair(lo: bf16, hi: bf16) -> u32 {
    u32::from(lo.to_bits()) | (u32::from(hi.to_bits()) << 16)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The lane-by-lane definition of a packed panel, straight from [`pack`]'s documentation.
    fn by_definition(
        v: &KMajor<'_>,
        (r0, count): (usize, usize),
        (k0, depth): (usize, usize),
        width: usize,
        padded: usize,
    ) -> Vec<u32> {
        let padded = padded.max(depth.div_ceil(2));
        let at = |r: usize, q: usize| if q < depth { v.data[r * v.outer + (k0 + q) * v.step] } else { bf16::ZERO };
        let mut out = vec![0u32; count.div_ceil(width) * width * padded];
        for (lane, d) in out.iter_mut().enumerate() {
            let (panel, rest) = (lane / (width * padded), lane % (width * padded));
            let (p, i) = (rest / width, rest % width);
            let r = panel * width + i;
            if r < count && 2 * p < depth {
                *d = pair(at(r0 + r, 2 * p), at(r0 + r, 2 * p + 1));
            }
        }
        out
    }

    #[test]
    fn packed_panels_are_the_pairs_by_definition() {
        let data: Vec<bf16> = (0..40_000).map(|i| bf16::from_bits((i * 7919 % 65_521) as u16)).collect();
        // Row-neighbour depths (the register transposition), column neighbours, and strided.
        for (outer, step) in [(301, 1), (1, 97), (3, 90)] {
            for width in [8, 12, 16, 24, 32, 48] {
                for &(r0, count) in &[(0, 1), (2, 7), (1, 8), (5, 12), (3, 40), (0, 61)] {
                    for &(k0, depth) in &[(0, 1), (0, 16), (2, 17), (1, 33), (4, 95), (0, 64)] {
                        if (r0 + count - 1) * outer + (k0 + depth - 1) * step >= data.len() {
                            continue;
                        }
                        let v = KMajor { data: &data, outer, step };
                        for padded in [0, depth.div_ceil(2).div_ceil(16) * 16] {
                            let expected = by_definition(&v, (r0, count), (k0, depth), width, padded);
                            // Stale contents must not survive: every lane is written.
                            let mut out = vec![0xDEAD_BEEF; expected.len() + 5];
                            pack(&v, (r0, count), (k0, depth), width, padded, &mut out);
                            let at = format!("outer {outer} step {step} width {width} rows {r0}+{count} depths {k0}+{depth} padded {padded}");
                            assert_eq!(&out[..expected.len()], &expected[..], "{at}");
                        }
                    }
                }
            }
        }
    }
}
