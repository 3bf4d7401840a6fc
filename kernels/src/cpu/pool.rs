//! Max pooling's window sweep with the position of each window's first maximum, on AVX-512:
//! what max pooling's backward pass recomputes from its input to route each output's gradient
//! (wick keeps no indices from the forward pass; PyTorch keeps an int64 per output).
//!
//! Sixteen consecutive outputs of a row are one vector: each window tap is a load (stride 1) or
//! two loads and an even-lane permute (stride 2), a compare, and two masked moves (the value and
//! its u32 index), so the first maximum in row-major order wins exactly as a scalar sweep with a
//! strict `>` does. The scalar sweep kept usize indices and selects per output and did not
//! vectorise (BENCHMARKS.md, "Convolutional networks at every size (issue 30)").

/// For the `best.len()` consecutive outputs of one output row whose windows lie inside the
/// plane's rows (window rows `ys.0..ys.1`, the first output's window starting at column `x0`,
/// stride `s`, kernel width `k`, rows of `w` inputs): each window's maximum into `best` and the
/// index in `plane` of its first maximum (rows in order, columns in order) into `at`.
///
/// For planes without NaN (a NaN never compares greater; the caller routes planes with NaN to
/// its exact path). Returns false and writes nothing when it does not apply: a CPU without
/// AVX-512F, a stride other than 1 or 2, a plane longer than `u32::MAX`, `best` and `at` of
/// different or zero lengths, no window rows, or a window outside the plane's rows.
pub fn max_row_first(
    plane: &[f32],
    w: usize,
    ys: (usize, usize),
    (x0, s, k): (usize, usize, usize),
    best: &mut [f32],
    at: &mut [u32],
) -> bool {
    let n = best.len();
    let fits = n > 0
        && at.len() == n
        && (s == 1 || s == 2)
        && k > 0
        && ys.0 < ys.1
        && u32::try_from(plane.len()).is_ok()
        && ys.1.checked_mul(w).is_some_and(|end| end <= plane.len())
        && (n - 1).checked_mul(s).and_then(|last| last.checked_add(x0 + k)).is_some_and(|end| end <= w);
    if !fits || !available() {
        return false;
    }
    // SAFETY: AVX-512F is present (checked); every window tap of every output lies inside its
    // row of `plane` (checked above), and `best`/`at` hold n elements.
    unsafe { sweep(plane, w, ys, (x0, s, k), best, at) };
    true
}

/// True when this CPU runs [`max_row_first`].
fn available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::is_x86_feature_detected!("avx512f")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// [`max_row_first`] once its arguments are checked.
///
/// # Safety
/// The CPU has AVX-512F; `s` is 1 or 2; `plane` holds rows `ys.0..ys.1` of `w` elements, and
/// `x0 + (n − 1)·s + k ≤ w` for `n = best.len() = at.len() > 0`; `plane.len() ≤ u32::MAX`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn sweep(
    plane: &[f32],
    w: usize,
    ys: (usize, usize),
    (x0, s, k): (usize, usize, usize),
    best: &mut [f32],
    at: &mut [u32],
) {
    use std::arch::x86_64::*;
    let n = best.len();
    let p = plane.as_ptr();
    let lanes = _mm512_mullo_epi32(
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
        _mm512_set1_epi32(s as i32),
    );
    let evens = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    for b0 in (0..n).step_by(16) {
        let count = (n - b0).min(16);
        let out_mask: __mmask16 = if count == 16 { u16::MAX } else { (1u16 << count) - 1 };
        // Elements one load of this block spans: every s-th from the first lane's.
        let span = (count - 1) * s + 1;
        let (m1, m2): (__mmask16, __mmask16) = {
            let bits = |len: usize| if len >= 16 { u16::MAX } else { (1u16 << len) - 1 };
            (bits(span), bits(span.saturating_sub(16)))
        };
        let (mut bv, mut iv) = (_mm512_setzero_ps(), _mm512_setzero_si512());
        for iy in ys.0..ys.1 {
            for dx in 0..k {
                let off = iy * w + x0 + dx + b0 * s;
                // SAFETY: lane j reads element off + j·s ≤ off + span − 1, inside row iy (the
                // caller's bounds); masked-off lanes are not read, and the second load is made
                // only when some of its lanes are in range.
                let v = unsafe {
                    let lo = _mm512_maskz_loadu_ps(m1, p.add(off).cast());
                    if s == 1 {
                        lo
                    } else {
                        let hi = if m2 != 0 {
                            _mm512_maskz_loadu_ps(m2, p.add(off + 16).cast())
                        } else {
                            _mm512_setzero_ps()
                        };
                        _mm512_permutex2var_ps(lo, evens, hi)
                    }
                };
                let idx = _mm512_add_epi32(_mm512_set1_epi32(off as u32 as i32), lanes);
                if iy == ys.0 && dx == 0 {
                    (bv, iv) = (v, idx);
                } else {
                    // Strictly greater: an equal later tap leaves the first maximum in place.
                    let take = _mm512_mask_cmp_ps_mask::<_CMP_GT_OQ>(out_mask, v, bv);
                    bv = _mm512_mask_mov_ps(bv, take, v);
                    iv = _mm512_mask_mov_epi32(iv, take, idx);
                }
            }
        }
        // SAFETY: outputs b0..b0 + count of `best` and `at` (masked stores).
        unsafe {
            _mm512_mask_storeu_ps(best.as_mut_ptr().add(b0).cast(), out_mask, bv);
            _mm512_mask_storeu_epi32(at.as_mut_ptr().add(b0).cast(), out_mask, iv);
        }
    }
}

#[cfg(not(target_arch = "x86_64"))]
unsafe fn sweep(_: &[f32], _: usize, _: (usize, usize), _: (usize, usize, usize), _: &mut [f32], _: &mut [u32]) {
    unreachable!("max_row_first checks available() first")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The scalar definition: rows in order, columns in order, strictly greater replaces.
    fn reference(
        plane: &[f32],
        w: usize,
        ys: (usize, usize),
        (x0, s, k): (usize, usize, usize),
        n: usize,
    ) -> Vec<(f32, u32)> {
        (0..n)
            .map(|j| {
                let mut best = (f32::NEG_INFINITY, u32::MAX);
                for iy in ys.0..ys.1 {
                    for dx in 0..k {
                        let i = iy * w + x0 + j * s + dx;
                        if best.1 == u32::MAX || plane[i] > best.0 {
                            best = (plane[i], i as u32);
                        }
                    }
                }
                best
            })
            .collect()
    }

    /// Every stride, kernel, row count and length up to past two vectors (ragged blocks), on
    /// planes full of ties (values from a handful of levels), against the scalar definition;
    /// the tie-breaking is the point (a `>=` or a reversed tap order fails it).
    #[test]
    fn sweep_equals_the_scalar_definition_ties_included() {
        if !available() {
            eprintln!("SKIPPED: this CPU has no AVX-512F");
            return;
        }
        let w = 80;
        let plane: Vec<f32> = (0..w * 6).map(|i| ((i * 7919) % 5) as f32 - 2.0).collect();
        for s in [1, 2] {
            for k in 1..=4 {
                for rows in [(0, 1), (1, 4), (2, 5)] {
                    for x0 in [0, 3] {
                        for n in 1..=((w - x0 - k) / s + 1).min(37) {
                            let (mut best, mut at) = (vec![0f32; n], vec![0u32; n]);
                            assert!(max_row_first(&plane, w, rows, (x0, s, k), &mut best, &mut at));
                            let want = reference(&plane, w, rows, (x0, s, k), n);
                            let got: Vec<(f32, u32)> = best.into_iter().zip(at).collect();
                            assert_eq!(got, want, "s {s} k {k} rows {rows:?} x0 {x0} n {n}");
                        }
                    }
                }
            }
        }
    }

    /// Arguments it does not take leave the outputs alone and say so.
    #[test]
    fn refuses_what_it_does_not_take() {
        let plane = vec![1f32; 64];
        let (mut best, mut at) = (vec![7f32; 4], vec![9u32; 4]);
        for (ys, geom) in [
            ((0, 1), (0, 3, 2)), // stride 3
            ((0, 9), (0, 2, 2)), // rows past the plane
            ((1, 1), (0, 2, 2)), // no rows
            ((0, 1), (2, 2, 2)), // the last window past the row: 2 + 3·2 + 2 > 8
            ((0, 1), (0, 1, 0)), // no kernel
        ] {
            assert!(!max_row_first(&plane, 8, ys, geom, &mut best, &mut at), "{ys:?} {geom:?}");
        }
        assert!(!max_row_first(&plane, 8, (0, 1), (0, 1, 2), &mut best, &mut at[..3]));
        assert_eq!((best, at), (vec![7f32; 4], vec![9u32; 4]));
    }
}
