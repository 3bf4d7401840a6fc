//! The two passes of a softmax cross-entropy over f32 logits, one row (one example's scores over
//! the vocabulary) at a time: the row's log-sum-exp (the forward pass: the loss is it less the
//! target's score) and the row's probabilities times a factor (the backward pass: `p·g/n`, from
//! which the caller takes `g/n` at the target).
//!
//! Written with AVX-512 and AVX2 intrinsics, as attention's softmax rows are ([`super::softmax`]),
//! because the rows are long and every element takes one exponential: a decoder's 32 000-token
//! vocabulary at 8 × 256 tokens is 65 M exponentials a pass each way, which the library's scalar
//! f64 `exp` took 200 ms for (12 % of the 58 M-parameter decoder's step). The exponential is
//! [`math::exp_nonpositive_f32`]'s polynomial (every argument here is at most 0: a score less
//! its row's largest, or less its log-sum-exp).
//!
//! Rationale for the f64 sum: a row's exponentials are added in f32 vector lanes over blocks of
//! [`BLOCK`] elements, and each block's sum is added in f64, so the rounding a 32 000-element row
//! gathers stays that of a 1 024-element one (about 10⁻⁷ of the sum, where one f32 sum over the
//! whole row could drift by 10⁻⁵).

use super::math;

/// Elements a row's exponentials are summed over in f32 before the block's sum is added in f64.
pub const BLOCK: usize = 1024;

/// `ln Σ exp(row)`, worked out as `max + ln Σ exp(row − max)` (the exponentials summed as the
/// module says). NaN when the row holds a NaN or +∞, or is empty or all −∞ (as
/// PyTorch's `logsumexp` of such a row, but for the empty one, where it gives −∞).
pub fn log_sum_exp_f32(row: &[f32]) -> f64 {
    if row.is_empty() {
        return f64::NAN;
    }
    #[cfg(target_arch = "x86_64")]
    {
        if super::avx512() {
            // SAFETY: the CPU has AVX-512F (checked by `avx512`).
            return unsafe { lse_avx512(row) };
        }
        if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
            // SAFETY: the CPU has AVX2 and FMA.
            return unsafe { lse_avx2(row) };
        }
    }
    lse_scalar(row)
}

/// The portable body of [`log_sum_exp_f32`] (and the reference of the tests).
fn lse_scalar(row: &[f32]) -> f64 {
    let max = math::max_f32(row);
    let sum: f64 = row
        .chunks(BLOCK)
        .map(|block| f64::from(block.iter().map(|v| math::exp_nonpositive_f32(*v - max)).sum::<f32>()))
        .sum();
    f64::from(max) + sum.ln()
}

/// `dst[j] = exp(src[j] − shift)·scale` over the shorter of the two (every difference at most 0:
/// a row's log-sum-exp as the shift gives its probabilities; a positive difference counts as 0).
pub fn exp_shifted_scaled_f32(src: &[f32], dst: &mut [f32], shift: f32, scale: f32) {
    let n = src.len().min(dst.len());
    let (src, dst) = (&src[..n], &mut dst[..n]);
    #[cfg(target_arch = "x86_64")]
    {
        if super::avx512() {
            // SAFETY: the CPU has AVX-512F (checked by `avx512`).
            return unsafe { shifted_avx512(src, dst, shift, scale) };
        }
        if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
            // SAFETY: the CPU has AVX2 and FMA.
            return unsafe { shifted_avx2(src, dst, shift, scale) };
        }
    }
    shifted_scalar(src, dst, shift, scale);
}

/// The portable body of [`exp_shifted_scaled_f32`] (and the reference of the tests).
fn shifted_scalar(src: &[f32], dst: &mut [f32], shift: f32, scale: f32) {
    for (d, s) in dst.iter_mut().zip(src) {
        *d = math::exp_nonpositive_f32(*s - shift) * scale;
    }
}

/// [`log_sum_exp_f32`] on 16 lanes, the tail under a mask.
///
/// # Safety
/// The CPU has AVX-512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn lse_avx512(row: &[f32]) -> f64 {
    use std::arch::x86_64::*;
    let (n, p) = (row.len(), row.as_ptr());
    let (whole, tail) = (n / 16 * 16, n % 16);
    let tail_mask: __mmask16 = ((1u32 << tail) - 1) as __mmask16;
    // Every load: 16 lanes from an offset below `whole`, or the tail's lanes from `whole` under
    // `tail_mask` — within the row.
    let max = math::x86::max16(row);
    let mv = _mm512_set1_ps(max);
    let mut sum = 0.0f64;
    for start in (0..whole).step_by(BLOCK) {
        let mut acc = _mm512_setzero_ps();
        for j in (start..whole.min(start + BLOCK)).step_by(16) {
            // SAFETY: within the row (above).
            acc = _mm512_add_ps(acc, math::x86::exp16(_mm512_sub_ps(unsafe { _mm512_loadu_ps(p.add(j)) }, mv)));
        }
        sum += f64::from(_mm512_reduce_add_ps(acc));
    }
    if tail > 0 {
        // SAFETY: the tail's lanes under its mask (above).
        let v = unsafe { _mm512_maskz_loadu_ps(tail_mask, p.add(whole)) };
        let e = _mm512_maskz_mov_ps(tail_mask, math::x86::exp16(_mm512_sub_ps(v, mv)));
        sum += f64::from(_mm512_reduce_add_ps(e));
    }
    f64::from(max) + sum.ln()
}

/// [`log_sum_exp_f32`] on 8 lanes, the tail one element at a time.
///
/// # Safety
/// The CPU has AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn lse_avx2(row: &[f32]) -> f64 {
    use std::arch::x86_64::*;
    let (n, p) = (row.len(), row.as_ptr());
    let whole = n / 8 * 8;
    // Every load: 8 lanes from an offset below `whole`, within the row.
    let max = math::x86::max8(row);
    let mv = _mm256_set1_ps(max);
    let mut sum = 0.0f64;
    for start in (0..whole).step_by(BLOCK) {
        let mut acc = _mm256_setzero_ps();
        for j in (start..whole.min(start + BLOCK)).step_by(8) {
            // SAFETY: within the row (above).
            acc = _mm256_add_ps(acc, math::x86::exp8(_mm256_sub_ps(unsafe { _mm256_loadu_ps(p.add(j)) }, mv)));
        }
        sum += f64::from(math::x86::fold8(acc, |a, b| _mm_add_ps(a, b)));
    }
    let tail: f32 = row[whole..].iter().map(|v| math::exp_nonpositive_f32(*v - max)).sum();
    f64::from(max) + (sum + f64::from(tail)).ln()
}

/// [`exp_shifted_scaled_f32`] on 16 lanes, the tail under a mask.
///
/// # Safety
/// The CPU has AVX-512F; `src` and `dst` have the same length.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn shifted_avx512(src: &[f32], dst: &mut [f32], shift: f32, scale: f32) {
    use std::arch::x86_64::*;
    let n = src.len().min(dst.len());
    let (s, d) = (src.as_ptr(), dst.as_mut_ptr());
    let (whole, tail) = (n / 16 * 16, n % 16);
    let tail_mask: __mmask16 = ((1u32 << tail) - 1) as __mmask16;
    let (lv, sv) = (_mm512_set1_ps(shift), _mm512_set1_ps(scale));
    // Every load and store: 16 lanes from an offset below `whole`, or the tail's lanes under its
    // mask — within both slices (`n` is the shorter length).
    for j in (0..whole).step_by(16) {
        // SAFETY: within both slices (above).
        unsafe {
            let e = math::x86::exp16(_mm512_sub_ps(_mm512_loadu_ps(s.add(j)), lv));
            _mm512_storeu_ps(d.add(j), _mm512_mul_ps(e, sv));
        }
    }
    if tail > 0 {
        // SAFETY: the tail's lanes under its mask (above).
        unsafe {
            let e = math::x86::exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail_mask, s.add(whole)), lv));
            _mm512_mask_storeu_ps(d.add(whole), tail_mask, _mm512_mul_ps(e, sv));
        }
    }
}

/// [`exp_shifted_scaled_f32`] on 8 lanes, the tail one element at a time.
///
/// # Safety
/// The CPU has AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn shifted_avx2(src: &[f32], dst: &mut [f32], shift: f32, scale: f32) {
    use std::arch::x86_64::*;
    let n = src.len().min(dst.len());
    let (s, d) = (src.as_ptr(), dst.as_mut_ptr());
    let whole = n / 8 * 8;
    let (lv, sv) = (_mm256_set1_ps(shift), _mm256_set1_ps(scale));
    for j in (0..whole).step_by(8) {
        // SAFETY: 8 lanes from an offset below `whole`, within both slices.
        unsafe {
            let e = math::x86::exp8(_mm256_sub_ps(_mm256_loadu_ps(s.add(j)), lv));
            _mm256_storeu_ps(d.add(j), _mm256_mul_ps(e, sv));
        }
    }
    shifted_scalar(&src[whole..n], &mut dst[whole..n], shift, scale);
}

#[cfg(test)]
mod tests {
    use super::*;

    type Lse = fn(&[f32]) -> f64;
    type Shifted = fn(&[f32], &mut [f32], f32, f32);

    /// The bodies this CPU runs: the dispatcher's choice, the portable one and each vector body.
    fn bodies() -> Vec<(&'static str, Lse, Shifted)> {
        let mut all: Vec<(&'static str, Lse, Shifted)> =
            vec![("dispatched", log_sum_exp_f32, exp_shifted_scaled_f32), ("scalar", lse_scalar, shifted_scalar)];
        #[cfg(target_arch = "x86_64")]
        {
            if std::is_x86_feature_detected!("avx512f") {
                // SAFETY: the CPU has AVX-512F; the test's slices have equal lengths.
                all.push(("avx512", |r| unsafe { lse_avx512(r) }, |s, d, l, k| unsafe { shifted_avx512(s, d, l, k) }));
            }
            if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
                // SAFETY: the CPU has AVX2 and FMA.
                all.push(("avx2", |r| unsafe { lse_avx2(r) }, |s, d, l, k| unsafe { shifted_avx2(s, d, l, k) }));
            }
        }
        all
    }

    /// A row of `n` scores spread over [−12, 13), some masked to −1e4 and to −∞.
    fn row(n: usize, seed: usize) -> Vec<f32> {
        (0..n)
            .map(|j| match (j + seed) % 97 {
                5 => -1e4,
                11 => f32::NEG_INFINITY,
                _ => (((j + seed) * 2_654_435_761) % 1000) as f32 / 40.0 - 12.0,
            })
            .collect()
    }

    fn exact_lse(row: &[f32]) -> f64 {
        let m = row.iter().map(|v| f64::from(*v)).fold(f64::NEG_INFINITY, f64::max);
        m + row.iter().map(|v| (f64::from(*v) - m).exp()).sum::<f64>().ln()
    }

    /// Rows with tails of every length and a real vocabulary's (several f64 blocks): each body's
    /// log-sum-exp within 10⁻⁶ of f64's, and within 4·10⁻⁷ relative of the portable body's.
    #[test]
    fn every_body_matches_f64() {
        for n in [1, 3, 7, 8, 9, 15, 16, 17, 31, 33, 128, 1000, 1024, 1025, 30_522, 32_000] {
            let r = row(n, n);
            let (exact, portable) = (exact_lse(&r), lse_scalar(&r));
            for (body, lse, _) in bodies() {
                let got = lse(&r);
                assert!((got - exact).abs() <= 1e-6 * exact.abs().max(1.0), "{body} n {n}: {got} vs {exact}");
                assert!((got - portable).abs() <= 4e-7 * portable.abs().max(1.0), "{body} n {n}: {got} vs {portable}");
            }
        }
    }

    /// A NaN or +∞ score makes the row's log-sum-exp NaN in every body, as an all −∞ row does; an
    /// empty row is NaN too.
    #[test]
    fn bad_rows_give_nan() {
        for n in [1, 5, 16, 40, 2000] {
            let all_masked = vec![f32::NEG_INFINITY; n];
            for (body, lse, _) in bodies() {
                for bad in [f32::NAN, f32::INFINITY] {
                    for at in [0, n / 2, n - 1] {
                        let mut r = row(n, 3);
                        r[at] = bad;
                        assert!(lse(&r).is_nan(), "{body} n {n}: {bad} at {at}");
                    }
                }
                assert!(lse(&all_masked).is_nan(), "{body} n {n}: all −∞");
            }
        }
        assert!(log_sum_exp_f32(&[]).is_nan());
    }

    /// The scaled probabilities against f64 and the portable body, tails of every length; the
    /// shorter slice bounds what is written; a NaN stays NaN.
    #[test]
    fn every_shifted_body_matches_f64() {
        for n in [1, 3, 7, 8, 9, 15, 16, 17, 31, 33, 128, 1025, 32_000] {
            let mut r = row(n, 7);
            r[n / 2] = f32::NAN;
            let shift = exact_lse(&r.iter().copied().filter(|v| !v.is_nan()).collect::<Vec<_>>()) as f32;
            let scale = 0.37f32;
            let mut want = vec![0.0; n];
            shifted_scalar(&r, &mut want, shift, scale);
            for (body, _, shifted) in bodies() {
                // One element more in `dst` than in `src`: it must stay as it is.
                let mut got = vec![-5.0; n + 1];
                shifted(&r, &mut got[..n], shift, scale);
                assert_eq!(got[n], -5.0, "{body} n {n}: wrote past the row");
                if body == "dispatched" {
                    let mut longer = vec![-5.0; n + 1];
                    exp_shifted_scaled_f32(&r, &mut longer, shift, scale);
                    assert_eq!(longer[n], -5.0, "{body} n {n}: wrote past the shorter slice");
                }
                for j in 0..n {
                    let (g, w, x) = (got[j], want[j], r[j]);
                    if x.is_nan() {
                        assert!(g.is_nan(), "{body} n {n} {j}: NaN in, {g} out");
                        continue;
                    }
                    let exact = f64::from(x - shift).min(0.0).exp() * f64::from(scale);
                    assert!((f64::from(g) - exact).abs() <= 5e-7 * exact + 1e-37, "{body} n {n} {j}: {g} vs {exact}");
                    assert!((g - w).abs() <= 4e-7 * w, "{body} n {n} {j}: {g} vs portable {w}");
                }
            }
        }
    }
}
