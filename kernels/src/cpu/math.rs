//! `exp` and `erf` for the element-wise kernels, written without branches or library calls so
//! that loops over slices vectorise (the C library's `expf`/`erff` are scalar calls, and were
//! most of GELU's and the softmaxes' time). f32 only: f64 inputs use the standard library's and
//! candle's functions, which the f64 gradient checks compare against exactly.

/// Runs `f` compiled for the widest vector instructions this CPU has (AVX-512 unless
/// `WICK_CPU_AVX512=0` ([`super::avx512`]), else AVX2 with FMA, else the baseline): `f` is
/// inlined into a function built with those features, so its loops vectorise for them. Run-time
/// detection keeps every x86-64 CPU working. Use it around a loop's body, on the thread that runs
/// the loop (a closure handed to rayon is not inlined).
#[inline(always)]
pub fn vectorized<R>(f: impl FnOnce() -> R) -> R {
    #[cfg(target_arch = "x86_64")]
    {
        if super::avx512() {
            // SAFETY: the CPU has AVX-512F (checked by `avx512`).
            return unsafe { avx512(f) };
        }
        if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
            // SAFETY: the CPU has AVX2 and FMA (checked above).
            return unsafe { avx2(f) };
        }
    }
    f()
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn avx512<R>(f: impl FnOnce() -> R) -> R {
    f()
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn avx2<R>(f: impl FnOnce() -> R) -> R {
    f()
}

/// ln 2 in two parts for exp's Cody–Waite reduction: `n·LN2_HI` is exact for the n that occur.
pub(crate) const EXP_LN2_HI: f32 = 0.693_359_4;
/// The rest of ln 2 after [`EXP_LN2_HI`].
pub(crate) const EXP_LN2_LO: f32 = -2.121_944_4e-4;
/// Above this, e^x overflows f32.
const EXP_HI: f32 = 88.722_84;
/// Below this, e^x is under f32's smallest normal: exp gives 0.
pub(crate) const EXP_LO: f32 = -87.336_55;
/// Rounds to nearest by adding 1.5·2²³: the sum's low mantissa bits are then the integer (no
/// `round`, a library call on baseline x86-64, and no float-to-int conversion).
pub(crate) const EXP_ROUND: f32 = 12_582_912.0;
/// The Cephes `expf` polynomial's coefficients, highest degree first (its 5.0000001201e-1 is 0.5
/// in f32).
pub(crate) const EXP_POLY: [f32; 6] =
    [1.987_569_1e-4, 1.398_199_9e-3, 8.333_452e-3, 4.166_579_6e-2, 1.666_666_5e-1, 0.5];

/// exp's reduction and polynomial for `xc` in [`EXP_LO`, `EXP_HI`]: `(e, n)` with
/// `e^xc = e · 2^n`, `e` in [1/√2, √2].
#[inline(always)]
fn exp_parts(xc: f32) -> (f32, i32) {
    let t = xc * std::f32::consts::LOG2_E + EXP_ROUND;
    let n = t - EXP_ROUND;
    let ni = t.to_bits() as i32 - EXP_ROUND.to_bits() as i32;
    let r = xc - n * EXP_LN2_HI - n * EXP_LN2_LO;
    let mut p = EXP_POLY[0];
    for c in &EXP_POLY[1..] {
        p = p * r + c;
    }
    (p * r * r + r + 1.0, ni)
}

/// 2^k for k in −126..=127, through the exponent bits.
#[inline(always)]
fn pow2(k: i32) -> f32 {
    f32::from_bits(((k + 127) as u32) << 23)
}

/// `e^x` in f32: Cody–Waite range reduction by ln 2 and a degree-6 polynomial (the Cephes
/// `expf` coefficients); within 2 ulp of the correctly rounded value over the whole range, 0 below
/// −87.3 and +∞ above 88.7, NaN for NaN.
#[inline(always)]
// `max`/`min` rather than `clamp`: they lower to vector min/max (clamp's NaN rule does not).
#[allow(clippy::manual_clamp)]
pub fn exp_f32(x: f32) -> f32 {
    // Below LO the result is 0 (selected at the end); computing it from x = 0 instead of from
    // LO keeps the scaling below from producing a subnormal product, which Intel cores finish in
    // a microcode assist (~100 cycles): a causal mask's −∞ scores, half of every softmax row,
    // made attention's forward several times slower on a Xeon (BENCHMARKS.md, "On a Xeon with
    // AMX").
    let xc = if x < EXP_LO { 0.0 } else { x.min(EXP_HI) };
    let (e, ni) = exp_parts(xc);
    // 2^n in two halves so n = 128 (x near the top) and n = −126 (near the bottom) stay
    // representable.
    let half = ni >> 1;
    let y = e * pow2(half) * pow2(ni - half);
    let y = if x > EXP_HI { f32::INFINITY } else { y };
    let y = if x < EXP_LO { 0.0 } else { y };
    if x.is_nan() {
        x
    } else {
        y
    }
}

/// `e^x` in f32 for `x ≤ 0`, as a softmax takes it (`score − row max`): [`exp_f32`]'s reduction
/// and polynomial without what only positive arguments need — the overflow clamp, the
/// two-step scaling that keeps 2^128 representable, the NaN select (a NaN argument gives NaN
/// through the arithmetic) — about a third fewer vector operations. Within 2 ulp of the
/// correctly rounded value down to −87.3, 0 below; a positive `x` counts as 0 (the result is 1).
#[inline(always)]
pub fn exp_nonpositive_f32(x: f32) -> f32 {
    // Below LO the result is 0 (selected at the end), computed from LO so that no subnormal
    // product takes a microcode assist (see `exp_f32`); compares that are false for NaN, so NaN
    // stays NaN.
    let xc = if x > 0.0 { 0.0 } else { x };
    let xc = if xc < EXP_LO { EXP_LO } else { xc };
    let (e, ni) = exp_parts(xc);
    // n ≥ −126 here, so 2^n is one normal f32.
    let y = e * pow2(ni);
    if x < EXP_LO {
        0.0
    } else {
        y
    }
}

/// The error function in f32, as the rational approximation of Eigen's `generic_fast_erf_float`
/// (odd degree-13 numerator over even degree-8 denominator, on x clamped to [−4, 4], where erf
/// is ±1 to f32 precision); within a few ulp of the exact value.
#[inline(always)]
#[allow(clippy::manual_clamp)]
pub fn erf_f32(v: f32) -> f32 {
    let x = v.max(-4.0).min(4.0);
    let x2 = x * x;
    let p = -2.726_142_3e-10f32;
    let p = p * x2 + 2.770_681_4e-8;
    let p = p * x2 + -2.101_024e-6;
    let p = p * x2 + -5.692_506_4e-5;
    let p = p * x2 + -7.349_906_3e-4;
    let p = p * x2 + -2.954_600_4e-3;
    let p = p * x2 + -1.609_603_3e-2;
    let q = -1.456_607_2e-5f32;
    let q = q * x2 + -2.133_740_6e-4;
    let q = q * x2 + -1.682_827e-3;
    let q = q * x2 + -7.373_329_2e-3;
    let q = q * x2 + -1.426_474e-2;
    // NaN: `max`/`min` above returned a bound, so put it back.
    let y = x * p / q;
    if v.is_nan() {
        v
    } else {
        y
    }
}

/// The largest of `row` (−∞ for an empty row; a NaN is passed over unless it comes first) — the
/// softmax rows' and cross-entropy's maximum, before their exponentials (which carry a NaN on).
#[inline(always)]
pub(crate) fn max_f32(row: &[f32]) -> f32 {
    row.iter().fold(f32::NEG_INFINITY, |m, v| if *v > m { *v } else { m })
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod x86 {
    //! The polynomial of [`super::exp_nonpositive_f32`] on AVX-512 and AVX2 vectors (the
    //! softmax rows and cross-entropy kernels), and a lane fold.

    use std::arch::x86_64::*;

    use super::{EXP_LN2_HI as LN2_HI, EXP_LN2_LO as LN2_LO, EXP_LO as LO, EXP_POLY as POLY, EXP_ROUND as ROUND};

    /// `e^x` of 16 arguments at most 0 (a positive one counts as 0); NaN stays NaN.
    #[inline]
    #[target_feature(enable = "avx512f")]
    pub(crate) fn exp16(x: __m512) -> __m512 {
        // `min(0, x)` and `max(LO, ·)` return their second operand for a NaN one.
        let xc = _mm512_max_ps(_mm512_set1_ps(LO), _mm512_min_ps(_mm512_setzero_ps(), x));
        let round = _mm512_set1_ps(ROUND);
        let t = _mm512_fmadd_ps(xc, _mm512_set1_ps(std::f32::consts::LOG2_E), round);
        let n = _mm512_sub_ps(t, round);
        let ni = _mm512_sub_epi32(_mm512_castps_si512(t), _mm512_set1_epi32(ROUND.to_bits() as i32));
        let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_HI), xc);
        let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_LO), r);
        let mut p = _mm512_set1_ps(POLY[0]);
        for c in &POLY[1..] {
            p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(*c));
        }
        let e = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.0));
        let scale = _mm512_slli_epi32::<23>(_mm512_add_epi32(ni, _mm512_set1_epi32(127)));
        let y = _mm512_mul_ps(e, _mm512_castsi512_ps(scale));
        // 0 below LO (false for NaN, which keeps its NaN).
        let below = _mm512_cmp_ps_mask::<_CMP_LT_OQ>(x, _mm512_set1_ps(LO));
        _mm512_maskz_mov_ps(!below, y)
    }

    /// [`exp16`] on 8 lanes.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub(crate) fn exp8(x: __m256) -> __m256 {
        let xc = _mm256_max_ps(_mm256_set1_ps(LO), _mm256_min_ps(_mm256_setzero_ps(), x));
        let round = _mm256_set1_ps(ROUND);
        let t = _mm256_fmadd_ps(xc, _mm256_set1_ps(std::f32::consts::LOG2_E), round);
        let n = _mm256_sub_ps(t, round);
        let ni = _mm256_sub_epi32(_mm256_castps_si256(t), _mm256_set1_epi32(ROUND.to_bits() as i32));
        let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_HI), xc);
        let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_LO), r);
        let mut p = _mm256_set1_ps(POLY[0]);
        for c in &POLY[1..] {
            p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(*c));
        }
        let e = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0));
        let scale = _mm256_slli_epi32::<23>(_mm256_add_epi32(ni, _mm256_set1_epi32(127)));
        let y = _mm256_mul_ps(e, _mm256_castsi256_ps(scale));
        let below = _mm256_cmp_ps::<_CMP_LT_OQ>(x, _mm256_set1_ps(LO));
        _mm256_andnot_ps(below, y)
    }

    /// 8 lanes folded into one by `f` (`max` for the row's largest, `add` for its sum).
    #[inline]
    #[target_feature(enable = "avx2")]
    pub(crate) fn fold8(v: __m256, f: impl Fn(__m128, __m128) -> __m128) -> f32 {
        let h = f(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let h = f(h, _mm_movehl_ps(h, h));
        _mm_cvtss_f32(f(h, _mm_movehdup_ps(h)))
    }

    /// [`super::max_f32`] on 16 lanes, the tail under a mask (a NaN may or may not be taken).
    #[inline]
    #[target_feature(enable = "avx512f")]
    pub(crate) fn max16(row: &[f32]) -> f32 {
        let (n, p) = (row.len(), row.as_ptr());
        let (whole, tail) = (n / 16 * 16, n % 16);
        let mut m = _mm512_set1_ps(f32::NEG_INFINITY);
        for j in (0..whole).step_by(16) {
            // SAFETY: 16 lanes from an offset below `whole`, within the row.
            m = _mm512_max_ps(m, unsafe { _mm512_loadu_ps(p.add(j)) });
        }
        if tail > 0 {
            let tail_mask: __mmask16 = ((1u32 << tail) - 1) as __mmask16;
            // SAFETY: the tail's `tail` lanes from `whole` under their mask, within the row.
            let v = unsafe { _mm512_maskz_loadu_ps(tail_mask, p.add(whole)) };
            m = _mm512_mask_max_ps(m, tail_mask, m, v);
        }
        _mm512_reduce_max_ps(m)
    }

    /// [`super::max_f32`] on 8 lanes, the tail one value at a time.
    #[inline]
    #[target_feature(enable = "avx2")]
    pub(crate) fn max8(row: &[f32]) -> f32 {
        let whole = row.len() / 8 * 8;
        let mut m = _mm256_set1_ps(f32::NEG_INFINITY);
        for j in (0..whole).step_by(8) {
            // SAFETY: 8 lanes from an offset below `whole`, within the row.
            m = _mm256_max_ps(m, unsafe { _mm256_loadu_ps(row.as_ptr().add(j)) });
        }
        let max = fold8(m, |a, b| _mm_max_ps(a, b));
        let tail_max = super::max_f32(&row[whole..]);
        if tail_max > max {
            tail_max
        } else {
            max
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ulps(a: f32, b: f32) -> u32 {
        if a == b {
            return 0;
        }
        let key = |v: f32| {
            let bits = v.to_bits() as i64;
            if bits < 0x8000_0000 {
                bits
            } else {
                0x8000_0000 - bits
            }
        };
        (key(a) - key(b)).unsigned_abs() as u32
    }

    /// Every 97th f32 between −90 and 90, against f64's exp rounded to f32.
    #[test]
    fn exp_is_within_two_ulp() {
        let mut worst = 0;
        let mut bits = (-90f32).to_bits();
        let mut x = -90f32;
        while x < 90.0 {
            let exact = (x as f64).exp() as f32;
            let got = exp_f32(x);
            if exact.is_finite() && exact > f32::MIN_POSITIVE {
                worst = worst.max(ulps(got, exact));
            }
            bits = if x < 0.0 { bits.wrapping_sub(97) } else { bits.wrapping_add(97) };
            x = if x < 0.0 && bits < 0x8000_0000 { 0.0 } else { f32::from_bits(bits) };
            if x == 0.0 {
                bits = 0;
                x = f32::from_bits(1);
            }
        }
        assert!(worst <= 2, "exp: {worst} ulp");
        assert_eq!(exp_f32(0.0), 1.0);
        assert_eq!(exp_f32(-100.0), 0.0);
        assert_eq!(exp_f32(100.0), f32::INFINITY);
        assert_eq!(exp_f32(f32::NEG_INFINITY), 0.0);
        assert!(exp_f32(f32::NAN).is_nan());
        assert!(exp_f32(88.7).is_finite());
    }

    /// Every 31st f32 between −90 and 0, against f64's exp rounded to f32; the edges.
    #[test]
    fn exp_of_nonpositive_arguments_is_within_two_ulp() {
        let mut worst = 0;
        let mut bits = (-90f32).to_bits();
        while bits > 0x8000_0000 {
            let x = f32::from_bits(bits);
            let exact = (x as f64).exp() as f32;
            let got = exp_nonpositive_f32(x);
            if exact > f32::MIN_POSITIVE {
                worst = worst.max(ulps(got, exact));
            } else {
                assert!(got == 0.0 || got <= f32::MIN_POSITIVE * 2.0, "exp({x}) = {got}");
            }
            bits -= 31;
        }
        assert!(worst <= 2, "exp: {worst} ulp");
        assert_eq!(exp_nonpositive_f32(0.0), 1.0);
        assert_eq!(exp_nonpositive_f32(-0.0), 1.0);
        assert_eq!(exp_nonpositive_f32(3.0), 1.0);
        assert_eq!(exp_nonpositive_f32(-100.0), 0.0);
        assert_eq!(exp_nonpositive_f32(f32::NEG_INFINITY), 0.0);
        assert!(exp_nonpositive_f32(f32::NAN).is_nan());
    }

    /// erf against the f64 implementation candle uses, over [−6, 6].
    #[test]
    fn erf_is_close_to_f64() {
        let mut worst = 0f64;
        for i in -600_000..=600_000 {
            let x = i as f32 * 1e-5;
            let exact = candle_core::cpu::erf::erf_f64(x as f64);
            let err = (erf_f32(x) as f64 - exact).abs();
            worst = worst.max(err / exact.abs().clamp(f32::EPSILON as f64, 1.0));
        }
        // Relative error of a few f32 epsilons (absolute near 0, where erf ≈ 2x/√π).
        assert!(worst < 4.0 * f32::EPSILON as f64, "erf: {worst:e}");
        assert_eq!(erf_f32(10.0), 1.0);
        assert_eq!(erf_f32(-10.0), -1.0);
        assert!(erf_f32(f32::NAN).is_nan());
    }
}
