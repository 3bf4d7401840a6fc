//! Batch norm backward's per-plane sums `(Σ g', Σ g'·(x − mean))` in f64, written with AVX-512
//! intrinsics for f32 compute over f32 or bf16 storage.
//!
//! Why: the generic form ([`super::lane_sums`]: eight f64 accumulators per sum) compiles to
//! scalar code — LLVM does not vectorise its f32 → f64 widening, even for AVX-512 — and was the
//! largest single cost of MobileNetV2's training step (BENCHMARKS.md, "On a Xeon with AMX").
//! Here one 8-lane f64 register holds each sum's eight accumulators. The arithmetic is the
//! generic form's, operation for operation (the normalised value as a multiply then an add, the
//! mask as a select of g or +0, widened, subtracted, multiplied, added; the lanes summed in
//! order, then the tail), so the sums are the same to the bit — a test compares them.

#[cfg(target_arch = "x86_64")]
use std::any::TypeId;

#[cfg(target_arch = "x86_64")]
use half::bf16;

/// What reaches the sums from `g`: `g` itself, or `g` where the normalised value `x·a + t` lies
/// strictly inside (0, `upper`) and +0 elsewhere (the gradient through a ReLU or ReLU6).
#[derive(Clone, Copy)]
pub enum Through {
    /// `g` itself.
    Identity,
    /// `g` where `x·a + t` lies strictly inside (0, `upper`), +0 elsewhere.
    Masked {
        /// The normalised value's scale.
        a: f32,
        /// Its shift.
        t: f32,
        /// The activation's upper kink (ReLU6: 6; ReLU: +∞).
        upper: f32,
    },
}

/// The sums for f32 compute (`T`) over f32 or bf16 storage (`E`) on a CPU with AVX-512F; None
/// for any other types or CPU (the caller then takes the generic form).
pub fn plane_sums<T: 'static, E: 'static>(g: &[E], x: &[E], mean: f64, through: Through) -> Option<(f64, f64)> {
    #[cfg(target_arch = "x86_64")]
    {
        if TypeId::of::<T>() != TypeId::of::<f32>() || !std::is_x86_feature_detected!("avx512f") {
            return None;
        }
        // SAFETY: AVX-512F (checked above).
        unsafe { sums_as::<E, f32>(g, x, mean, through).or_else(|| sums_as::<E, bf16>(g, x, mean, through)) }
    }
    #[cfg(not(target_arch = "x86_64"))]
    None
}

/// [`sums`] over `g` and `x` when their element type `E` is `L`; None otherwise.
///
/// # Safety
/// The CPU has AVX-512F.
#[cfg(target_arch = "x86_64")]
unsafe fn sums_as<E: 'static, L: Load8 + 'static>(g: &[E], x: &[E], mean: f64, through: Through) -> Option<(f64, f64)> {
    if TypeId::of::<E>() != TypeId::of::<L>() {
        return None;
    }
    let n = g.len().min(x.len());
    // SAFETY: `E` is `L` (the same type: the slices reinterpret as themselves), n elements each.
    let (g, x) = unsafe {
        (std::slice::from_raw_parts(g.as_ptr().cast::<L>(), n), std::slice::from_raw_parts(x.as_ptr().cast::<L>(), n))
    };
    // SAFETY: AVX-512F (the caller's contract); the same length.
    Some(unsafe { sums(g, x, mean, through) })
}

/// A stored element type, loaded eight at a time as f32.
#[cfg(target_arch = "x86_64")]
trait Load8: Copy {
    /// Eight elements from `p` as f32.
    ///
    /// # Safety
    /// `p` points at eight readable elements; the CPU has AVX2.
    unsafe fn load8(p: *const Self) -> std::arch::x86_64::__m256;
    fn f32(self) -> f32;
}

#[cfg(target_arch = "x86_64")]
impl Load8 for f32 {
    #[inline(always)]
    unsafe fn load8(p: *const f32) -> std::arch::x86_64::__m256 {
        // SAFETY: the caller's contract.
        unsafe { std::arch::x86_64::_mm256_loadu_ps(p) }
    }
    fn f32(self) -> f32 {
        self
    }
}

#[cfg(target_arch = "x86_64")]
impl Load8 for bf16 {
    #[inline(always)]
    unsafe fn load8(p: *const bf16) -> std::arch::x86_64::__m256 {
        use std::arch::x86_64::*;
        // SAFETY: the caller's contract. A bf16 is the high half of the f32 with its bits.
        unsafe { _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(_mm_loadu_si128(p.cast())))) }
    }
    fn f32(self) -> f32 {
        self.to_f32()
    }
}

/// # Safety
/// The CPU has AVX-512F; `g` and `x` have the same length.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2")]
unsafe fn sums<L: Load8>(g: &[L], x: &[L], mean: f64, through: Through) -> (f64, f64) {
    use std::arch::x86_64::*;
    let whole = g.len() / 8 * 8;
    let (mut sg, mut sgx) = (_mm512_setzero_pd(), _mm512_setzero_pd());
    let m = _mm512_set1_pd(mean);
    for i in (0..whole).step_by(8) {
        // SAFETY: elements i..i+8 lie inside both slices (i + 8 ≤ whole ≤ len).
        let (gv, xv) = unsafe { (L::load8(g.as_ptr().add(i)), L::load8(x.as_ptr().add(i))) };
        let gv = match through {
            Through::Identity => gv,
            Through::Masked { a, t, upper } => {
                let y = _mm256_add_ps(_mm256_mul_ps(xv, _mm256_set1_ps(a)), _mm256_set1_ps(t));
                let inside = _mm256_and_ps(
                    _mm256_cmp_ps::<_CMP_GT_OQ>(y, _mm256_setzero_ps()),
                    _mm256_cmp_ps::<_CMP_LT_OQ>(y, _mm256_set1_ps(upper)),
                );
                _mm256_and_ps(gv, inside)
            }
        };
        let (gd, xd) = (_mm512_cvtps_pd(gv), _mm512_cvtps_pd(xv));
        sg = _mm512_add_pd(sg, gd);
        sgx = _mm512_add_pd(sgx, _mm512_mul_pd(gd, _mm512_sub_pd(xd, m)));
    }
    let (mut lanes_g, mut lanes_gx) = ([0f64; 8], [0f64; 8]);
    // SAFETY: eight f64 each.
    unsafe {
        _mm512_storeu_pd(lanes_g.as_mut_ptr(), sg);
        _mm512_storeu_pd(lanes_gx.as_mut_ptr(), sgx);
    }
    let (mut tail_g, mut tail_gx) = (-0.0f64, -0.0f64);
    for (gv, xv) in g[whole..].iter().zip(&x[whole..]) {
        let (gv, xv) = (gv.f32(), xv.f32());
        let gv = match through {
            Through::Identity => gv,
            Through::Masked { a, t, upper } => {
                let y = xv * a + t;
                if y > 0.0 && y < upper {
                    gv
                } else {
                    0.0
                }
            }
        };
        let gd = f64::from(gv);
        tail_g += gd;
        tail_gx += gd * (f64::from(xv) - mean);
    }
    (lanes_g.iter().sum::<f64>() + tail_g, lanes_gx.iter().sum::<f64>() + tail_gx)
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::*;

    /// The generic form, as batch norm's backward took it before.
    fn generic<E: Copy + Into<f32>>(g: &[E], x: &[E], mean: f64, through: Through) -> (f64, f64) {
        let [a, b] = crate::cpu::lane_sums(g, x, |gv, xv| {
            let (gv, xv): (f32, f32) = (gv.into(), xv.into());
            let gv = match through {
                Through::Identity => gv,
                Through::Masked { a, t, upper } => {
                    std::hint::select_unpredictable((xv * a + t > 0.0) & (xv * a + t < upper), gv, 0.0)
                }
            };
            let gv = f64::from(gv);
            [gv, gv * (f64::from(xv) - mean)]
        });
        (a, b)
    }

    #[test]
    fn sums_equal_the_generic_form_to_the_bit() {
        if !std::is_x86_feature_detected!("avx512f") {
            eprintln!("SKIPPED: this CPU has no AVX-512F");
            return;
        }
        let value =
            |i: usize, s: f32| ((i as f32 * 0.731 + s).sin() * 3.0) + if i.is_multiple_of(7) { 1e-3 } else { 0.0 };
        let throughs = [
            Through::Identity,
            Through::Masked { a: 1.3, t: -0.2, upper: f32::INFINITY },
            Through::Masked { a: 0.7, t: 0.4, upper: 6.0 },
        ];
        for len in [0usize, 1, 7, 8, 9, 15, 16, 17, 63, 1000, 3137] {
            let g: Vec<f32> = (0..len).map(|i| value(i, 0.3)).collect();
            let x: Vec<f32> = (0..len).map(|i| value(i, 1.9) * 2.0).collect();
            let (gb, xb): (Vec<bf16>, Vec<bf16>) =
                (g.iter().map(|v| bf16::from_f32(*v)).collect(), x.iter().map(|v| bf16::from_f32(*v)).collect());
            for through in throughs {
                for mean in [0.0, 0.37, -1.25] {
                    let fast = plane_sums::<f32, f32>(&g, &x, mean, through).expect("AVX-512F");
                    let want = generic(&g, &x, mean, through);
                    assert_eq!(
                        (fast.0.to_bits(), fast.1.to_bits()),
                        (want.0.to_bits(), want.1.to_bits()),
                        "f32, len {len}"
                    );
                    let fast = plane_sums::<f32, bf16>(&gb, &xb, mean, through).expect("AVX-512F");
                    let want = generic(&gb, &xb, mean, through);
                    assert_eq!(
                        (fast.0.to_bits(), fast.1.to_bits()),
                        (want.0.to_bits(), want.1.to_bits()),
                        "bf16, len {len}"
                    );
                }
            }
        }
        // Other compute types take the generic form.
        assert!(plane_sums::<f64, f64>(&[1.0], &[1.0], 0.0, Through::Identity).is_none());
    }
}
