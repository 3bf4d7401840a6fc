//! The exponentials of a softmax over rows of f32 scores, as attention's forward pass takes them:
//! each row replaced by `exp(row − its max)`, with its max and the sum of its exponentials (the
//! caller divides the row's outputs rather than its probabilities, and takes the log-sum-exp
//! `max + ln sum` only where a backward pass will want it: one library `ln` per row cost a third
//! of a 128-key row's exponentials); and as its backward pass recomputes them, each row replaced
//! by `exp(row − a given shift)` (its log-sum-exp: the probabilities again).
//!
//! Written with AVX-512 and AVX2 intrinsics because the rows are short — a head of 128 tokens
//! has 128 scores a row — and per row a maximum and a sum must be reduced across a vector's
//! lanes: compiled from plain loops, those reductions went through the stack lane by lane and
//! cost as much as the row's exponentials. The exponential is [`math::exp_nonpositive_f32`]'s
//! (the same reduction and polynomial, with fused multiply-adds), so the three bodies agree to
//! within the rounding of those fused operations.

use super::math;

/// Rows of `s`, `sk` scores each: every score replaced by `exp(score − the row's max)`, the row's
/// max into `max` and the sum of its exponentials into `sum`. Rows beyond the shortest of
/// `s.len() / sk`, `max` and `sum` are left alone; `sk = 0` does nothing.
pub fn exp_rows_f32(s: &mut [f32], sk: usize, max: &mut [f32], sum: &mut [f32]) {
    if sk == 0 {
        return;
    }
    #[cfg(target_arch = "x86_64")]
    {
        if super::avx512() {
            // SAFETY: the CPU has AVX-512F (checked by `avx512`).
            return unsafe { rows_avx512(s, sk, max, sum) };
        }
        if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
            // SAFETY: the CPU has AVX2 and FMA.
            return unsafe { rows_avx2(s, sk, max, sum) };
        }
    }
    rows_scalar(s, sk, max, sum);
}

/// The portable body (and the reference of the tests).
fn rows_scalar(s: &mut [f32], sk: usize, maxes: &mut [f32], sums: &mut [f32]) {
    for ((row, m), sm) in s.chunks_exact_mut(sk).zip(maxes.iter_mut()).zip(sums.iter_mut()) {
        let max = math::max_f32(row);
        let mut sum = 0.0;
        for v in row.iter_mut() {
            *v = math::exp_nonpositive_f32(*v - max);
            sum += *v;
        }
        (*m, *sm) = (max, sum);
    }
}

/// Rows of `s`, `sk` values each: every value replaced by `exp(value − shift[r])`, where every
/// difference is at most 0 (a row's log-sum-exp as the shift: attention's backward pass recomputing
/// its probabilities from the forward pass's statistics; a positive difference counts as 0). Rows
/// beyond the shorter of `s.len() / sk` and `shift` are left alone; `sk = 0` does nothing.
pub fn exp_shifted_rows_f32(s: &mut [f32], sk: usize, shift: &[f32]) {
    if sk == 0 {
        return;
    }
    #[cfg(target_arch = "x86_64")]
    {
        if super::avx512() {
            // SAFETY: the CPU has AVX-512F (checked by `avx512`).
            return unsafe { shifted_avx512(s, sk, shift) };
        }
        if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
            // SAFETY: the CPU has AVX2 and FMA.
            return unsafe { shifted_avx2(s, sk, shift) };
        }
    }
    shifted_scalar(s, sk, shift);
}

/// The portable body of [`exp_shifted_rows_f32`] (and the reference of the tests).
fn shifted_scalar(s: &mut [f32], sk: usize, shift: &[f32]) {
    for (row, l) in s.chunks_exact_mut(sk).zip(shift) {
        row.iter_mut().for_each(|v| *v = math::exp_nonpositive_f32(*v - l));
    }
}

/// [`exp_shifted_rows_f32`] on 16 lanes, each row's tail under a mask.
///
/// # Safety
/// The CPU has AVX-512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn shifted_avx512(s: &mut [f32], sk: usize, shift: &[f32]) {
    use std::arch::x86_64::*;
    let (whole, tail) = (sk / 16 * 16, sk % 16);
    let tail_mask: __mmask16 = ((1u32 << tail) - 1) as __mmask16;
    for (row, l) in s.chunks_exact_mut(sk).zip(shift) {
        // Every load and store: 16 lanes below `whole`, or the tail's under its mask (in the row).
        let (p, lv) = (row.as_mut_ptr(), _mm512_set1_ps(*l));
        for j in (0..whole).step_by(16) {
            // SAFETY: within the row (above).
            unsafe { _mm512_storeu_ps(p.add(j), math::x86::exp16(_mm512_sub_ps(_mm512_loadu_ps(p.add(j)), lv))) };
        }
        if tail > 0 {
            // SAFETY: the tail's lanes under its mask (above).
            unsafe {
                let v = _mm512_maskz_loadu_ps(tail_mask, p.add(whole));
                _mm512_mask_storeu_ps(p.add(whole), tail_mask, math::x86::exp16(_mm512_sub_ps(v, lv)));
            }
        }
    }
}

/// [`exp_shifted_rows_f32`] on 8 lanes, each row's tail one value at a time.
///
/// # Safety
/// The CPU has AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn shifted_avx2(s: &mut [f32], sk: usize, shift: &[f32]) {
    use std::arch::x86_64::*;
    let whole = sk / 8 * 8;
    for (row, l) in s.chunks_exact_mut(sk).zip(shift) {
        let (p, lv) = (row.as_mut_ptr(), _mm256_set1_ps(*l));
        for j in (0..whole).step_by(8) {
            // SAFETY: 8 lanes from an offset below `whole`, within the row.
            unsafe { _mm256_storeu_ps(p.add(j), math::x86::exp8(_mm256_sub_ps(_mm256_loadu_ps(p.add(j)), lv))) };
        }
        for v in &mut row[whole..] {
            *v = math::exp_nonpositive_f32(*v - l);
        }
    }
}

/// [`exp_rows_f32`] on 16 lanes, the rows' tails under a mask.
///
/// # Safety
/// The CPU has AVX-512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn rows_avx512(s: &mut [f32], sk: usize, maxes: &mut [f32], sums: &mut [f32]) {
    use std::arch::x86_64::*;
    let (whole, tail) = (sk / 16 * 16, sk % 16);
    let tail_mask: __mmask16 = ((1u32 << tail) - 1) as __mmask16;
    for ((row, m_out), s_out) in s.chunks_exact_mut(sk).zip(maxes.iter_mut()).zip(sums.iter_mut()) {
        // Every load and store below: 16 lanes from an offset below `whole`, or the tail's
        // `tail` lanes from `whole` under `tail_mask` — within the row's `sk` elements.
        let max = math::x86::max16(row);
        let p = row.as_mut_ptr();
        let mv = _mm512_set1_ps(max);
        let mut acc = _mm512_setzero_ps();
        for j in (0..whole).step_by(16) {
            // SAFETY: within the row (above).
            let v = unsafe { _mm512_loadu_ps(p.add(j)) };
            let e = math::x86::exp16(_mm512_sub_ps(v, mv));
            // SAFETY: within the row (above).
            unsafe { _mm512_storeu_ps(p.add(j), e) };
            acc = _mm512_add_ps(acc, e);
        }
        if tail > 0 {
            // SAFETY: the tail's lanes under its mask (above).
            let v = unsafe { _mm512_maskz_loadu_ps(tail_mask, p.add(whole)) };
            let e = math::x86::exp16(_mm512_sub_ps(v, mv));
            // SAFETY: the tail's lanes under its mask (above).
            unsafe { _mm512_mask_storeu_ps(p.add(whole), tail_mask, e) };
            acc = _mm512_mask_add_ps(acc, tail_mask, acc, e);
        }
        (*m_out, *s_out) = (max, _mm512_reduce_add_ps(acc));
    }
}

/// [`exp_rows_f32`] on 8 lanes, the rows' tails one score at a time.
///
/// # Safety
/// The CPU has AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn rows_avx2(s: &mut [f32], sk: usize, maxes: &mut [f32], sums: &mut [f32]) {
    use std::arch::x86_64::*;
    let whole = sk / 8 * 8;
    for ((row, m_out), s_out) in s.chunks_exact_mut(sk).zip(maxes.iter_mut()).zip(sums.iter_mut()) {
        // Every load and store below: 8 lanes from an offset below `whole`, within the row.
        let max = math::x86::max8(row);
        let p = row.as_mut_ptr();
        let mv = _mm256_set1_ps(max);
        let mut acc = _mm256_setzero_ps();
        for j in (0..whole).step_by(8) {
            // SAFETY: within the row (above).
            let v = unsafe { _mm256_loadu_ps(p.add(j)) };
            let e = math::x86::exp8(_mm256_sub_ps(v, mv));
            // SAFETY: within the row (above).
            unsafe { _mm256_storeu_ps(p.add(j), e) };
            acc = _mm256_add_ps(acc, e);
        }
        let mut sum = math::x86::fold8(acc, |a, b| _mm_add_ps(a, b));
        for v in &mut row[whole..] {
            *v = math::exp_nonpositive_f32(*v - max);
            sum += *v;
        }
        (*m_out, *s_out) = (max, sum);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Scores with long and short rows, tails of every length, masked (−1e4) and −∞ keys, against
    /// the scalar body and against f64.
    #[test]
    fn every_body_matches_f64() {
        for sk in [1, 3, 7, 8, 9, 15, 16, 17, 31, 33, 128, 200] {
            let rows = 5;
            let s: Vec<f32> = (0..rows * sk)
                .map(|i| {
                    let (row, j) = (i / sk, i % sk);
                    match (row, j % 7) {
                        (1, _) if j > 0 => -1e4,
                        (2, 3) => f32::NEG_INFINITY,
                        _ => ((i * 2_654_435_761) % 1000) as f32 / 40.0 - 12.0,
                    }
                })
                .collect();
            let mut want = s.clone();
            let (mut max0, mut sum0) = (vec![0.0; rows], vec![0.0; rows]);
            rows_scalar(&mut want, sk, &mut max0, &mut sum0);
            for (body, run) in bodies() {
                let mut got = s.clone();
                let (mut max, mut sum) = (vec![0.0; rows], vec![0.0; rows]);
                run(&mut got, sk, &mut max, &mut sum);
                check(body, &s, sk, (&got, &max, &sum), (&want, &max0, &sum0));
            }
        }
    }

    type Body = fn(&mut [f32], usize, &mut [f32], &mut [f32]);

    /// The bodies this CPU runs: the dispatcher's choice and each vector body it has.
    fn bodies() -> Vec<(&'static str, Body)> {
        let mut all: Vec<(&'static str, Body)> = vec![("dispatched", exp_rows_f32)];
        #[cfg(target_arch = "x86_64")]
        {
            if std::is_x86_feature_detected!("avx512f") {
                // SAFETY: the CPU has AVX-512F.
                all.push(("avx512", |s, sk, l, i| unsafe { rows_avx512(s, sk, l, i) }));
            }
            if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
                // SAFETY: the CPU has AVX2 and FMA.
                all.push(("avx2", |s, sk, l, i| unsafe { rows_avx2(s, sk, l, i) }));
            }
        }
        all
    }

    /// One body's rows against f64 and against the scalar body.
    #[allow(clippy::type_complexity)]
    fn check(
        body: &str,
        s: &[f32],
        sk: usize,
        (got, max, sum): (&[f32], &[f32], &[f32]),
        (want, max0, sum0): (&[f32], &[f32], &[f32]),
    ) {
        for (r, row) in s.chunks(sk).enumerate() {
            let exact_max = row.iter().map(|v| f64::from(*v)).fold(f64::NEG_INFINITY, f64::max);
            let exact_sum: f64 = row.iter().map(|v| (f64::from(*v) - exact_max).exp()).sum();
            assert_eq!(f64::from(max[r]), exact_max, "{body} sk {sk} row {r}: max");
            let err = (f64::from(sum[r]) - exact_sum).abs() / exact_sum;
            assert!(err < 1e-6, "{body} sk {sk} row {r}: sum {} vs {exact_sum}", sum[r]);
            assert!(max[r] == max0[r] && (sum[r] - sum0[r]).abs() <= 1e-6 * sum0[r], "{body} sk {sk} row {r}");
            let maxf = row.iter().fold(f32::NEG_INFINITY, |m, v| m.max(*v));
            for (j, v) in row.iter().enumerate() {
                // From the difference as the kernels round it.
                let exact = f64::from(*v - maxf).exp();
                let (g, w) = (got[r * sk + j], want[r * sk + j]);
                assert!(
                    (f64::from(g) - exact).abs() <= 4e-7 * exact + 1e-37,
                    "{body} sk {sk} ({r}, {j}): {g} vs {exact}"
                );
                assert!((g - w).abs() <= 3e-7 * w, "{body} sk {sk} ({r}, {j}): {g} vs scalar {w}");
            }
        }
    }

    /// The shifted exponentials (backward's probabilities from the forward pass's log-sum-exps)
    /// in every body against f64 and the scalar body: tails of every length, masked (−1e4) and
    /// −∞ scores, a NaN that stays NaN, rows past `shift` left alone.
    #[test]
    fn every_shifted_body_matches_f64() {
        type Shifted = fn(&mut [f32], usize, &[f32]);
        let mut bodies: Vec<(&str, Shifted)> = vec![("dispatched", exp_shifted_rows_f32), ("scalar", shifted_scalar)];
        #[cfg(target_arch = "x86_64")]
        {
            if std::is_x86_feature_detected!("avx512f") {
                // SAFETY: the CPU has AVX-512F.
                bodies.push(("avx512", |s, sk, l| unsafe { shifted_avx512(s, sk, l) }));
            }
            if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
                // SAFETY: the CPU has AVX2 and FMA.
                bodies.push(("avx2", |s, sk, l| unsafe { shifted_avx2(s, sk, l) }));
            }
        }
        for sk in [1, 3, 7, 8, 9, 15, 16, 17, 31, 33, 128, 200] {
            let rows = 5;
            let mut s: Vec<f32> = (0..rows * sk)
                .map(|i| match (i / sk, i % 7) {
                    (1, 2) => -1e4,
                    (2, 3) => f32::NEG_INFINITY,
                    _ => ((i * 2_654_435_761) % 1000) as f32 / 40.0 - 12.0,
                })
                .collect();
            s[3 * sk + sk / 2] = f32::NAN;
            // Each row's log-sum-exp (in f64, rounded), one row fewer than the scores: the last
            // row must stay as it is.
            let shift: Vec<f32> = s
                .chunks(sk)
                .take(rows - 1)
                .map(|row| {
                    let finite = row.iter().filter(|v| !v.is_nan()).map(|v| f64::from(*v));
                    let m = finite.clone().fold(f64::NEG_INFINITY, f64::max);
                    (m + finite.map(|v| (v - m).exp()).sum::<f64>().ln()) as f32
                })
                .collect();
            let mut want = s.clone();
            shifted_scalar(&mut want, sk, &shift);
            for (body, run) in &bodies {
                let mut got = s.clone();
                run(&mut got, sk, &shift);
                for (i, (&g, &w)) in got.iter().zip(&want).enumerate() {
                    let (r, x) = (i / sk, s[i]);
                    if r == rows - 1 || x.is_nan() {
                        assert!(
                            g.to_bits() == x.to_bits() || (x.is_nan() && g.is_nan()),
                            "{body} sk {sk} ({r}): {g} for {x}"
                        );
                        continue;
                    }
                    let exact = f64::from(x - shift[r]).min(0.0).exp();
                    assert!((f64::from(g) - exact).abs() <= 4e-7 * exact + 1e-37, "{body} sk {sk} {i}: {g} vs {exact}");
                    assert!((g - w).abs() <= 3e-7 * w, "{body} sk {sk} {i}: {g} vs scalar {w}");
                }
            }
        }
    }

    /// A NaN score makes its row NaN in every body, as the composed softmax does.
    #[test]
    fn a_nan_score_gives_a_nan_row() {
        for (sk, (body, run)) in [5, 16, 40].into_iter().flat_map(|sk| bodies().into_iter().map(move |b| (sk, b))) {
            let mut s: Vec<f32> = (0..sk).map(|j| j as f32).collect();
            s[sk / 2] = f32::NAN;
            let (mut max, mut sum) = ([0.0], [0.0]);
            run(&mut s, sk, &mut max, &mut sum);
            assert!(sum[0].is_nan(), "{body} sk {sk}: sum {}", sum[0]);
            assert!(s[sk / 2].is_nan(), "{body} sk {sk}: the NaN score stays NaN");
        }
    }
}
