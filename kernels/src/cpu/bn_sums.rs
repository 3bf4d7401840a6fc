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
/// strictly inside (`lower`, `upper`) and +0 elsewhere (the gradient through a ReLU or ReLU6: the
/// bounds are the kinks 0 and 6, moved to where the value as stored would reach them).
#[derive(Clone, Copy)]
pub enum Through {
    /// `g` itself.
    Identity,
    /// `g` where `x·a + t` lies strictly inside (`lower`, `upper`), +0 elsewhere.
    Masked {
        /// The normalised value's scale.
        a: f32,
        /// Its shift.
        t: f32,
        /// The activation's lower kink (0, or the largest value that rounds to 0 when stored).
        lower: f32,
        /// Its upper kink (ReLU6: 6, or the least value that rounds to 6 when stored; ReLU: +∞).
        upper: f32,
    },
}

/// Backward's sums `(Σ g', Σ g'·(x − mean))` of each plane (`planes`: its `g` and its `x`, all
/// of one length) into `out` (one per plane), for f32 compute (`T`) over f32 or bf16 storage
/// (`E`) on a CPU with AVX-512F; false, with `out` untouched, for any other types or CPU,
/// planes of different lengths or an `out` of another length (the caller then takes the
/// generic form). Four planes are summed at a time, each into its own registers: one plane's
/// chain of f64 adds (each waiting for the last) bounded the sums at about two elements a
/// cycle, and a channel's planes (one per image) are independent chains.
pub fn plane_sums<T: 'static, E: 'static>(
    planes: &[(&[E], &[E])],
    mean: f64,
    through: Through,
    out: &mut [(f64, f64)],
) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        if !f32_on_avx512::<T>() {
            return false;
        }
        let len = planes.first().map_or(0, |p| p.0.len());
        if out.len() != planes.len() || planes.iter().any(|(g, x)| g.len() != len || x.len() != len) {
            return false;
        }
        // SAFETY: AVX-512F (checked above); every slice has `len` elements.
        unsafe { sums_as::<E, f32>(planes, mean, through, out) || sums_as::<E, bf16>(planes, mean, through, out) }
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// The statistics' sums of each plane (all of one length) into `out`: `Σ x` (`dev` None) or
/// `Σ (x − dev)²`, as [`super::lane_sums`] sums them, for f32 compute (`T`) over f32 or bf16
/// storage (`E`) on a CPU with AVX-512F; false otherwise (as [`plane_sums`], four planes at a
/// time). The same sums to the bit.
pub fn plane_moments<T: 'static, E: 'static>(planes: &[&[E]], dev: Option<f64>, out: &mut [f64]) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        if !f32_on_avx512::<T>() {
            return false;
        }
        let len = planes.first().map_or(0, |p| p.len());
        if out.len() != planes.len() || planes.iter().any(|x| x.len() != len) {
            return false;
        }
        // SAFETY: AVX-512F (checked above); every slice has `len` elements.
        unsafe { moments_as::<E, f32>(planes, dev, out) || moments_as::<E, bf16>(planes, dev, out) }
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// True when the compute type `T` is f32 and the CPU has AVX-512F: what both kernels need.
#[cfg(target_arch = "x86_64")]
fn f32_on_avx512<T: 'static>() -> bool {
    TypeId::of::<T>() == TypeId::of::<f32>() && std::is_x86_feature_detected!("avx512f")
}

/// `s` as a slice of `L` when its element type `E` is `L`.
#[cfg(target_arch = "x86_64")]
fn as_l<E: 'static, L: 'static>(s: &[E]) -> Option<&[L]> {
    if TypeId::of::<E>() != TypeId::of::<L>() {
        return None;
    }
    // SAFETY: `E` is `L` (the same type: the slice reinterprets as itself).
    Some(unsafe { std::slice::from_raw_parts(s.as_ptr().cast::<L>(), s.len()) })
}

/// A plane as `L`s ([`as_l`]).
#[cfg(target_arch = "x86_64")]
fn plane_as<'a, E: 'static, L: 'static>(x: &&'a [E]) -> Option<&'a [L]> {
    as_l::<E, L>(x)
}

/// A plane's `g` and `x` as `L`s ([`as_l`]).
#[cfg(target_arch = "x86_64")]
fn pair_as<'a, E: 'static, L: 'static>((g, x): &(&'a [E], &'a [E])) -> Option<(&'a [L], &'a [L])> {
    Some((as_l::<E, L>(g)?, as_l::<E, L>(x)?))
}

/// `$call` on each group `$group` of up to four of `$planes`, each converted by `$conv` (a plane
/// as the kernel's element type), its results written to the group's places in `$out`; false
/// when `$conv` does not take the planes' element type (nothing written).
#[cfg(target_arch = "x86_64")]
macro_rules! by_fours {
    ($planes:expr, $out:expr, $conv:expr, |$group:ident| $call:expr) => {{
        if $planes.first().is_some_and(|p| $conv(p).is_none()) {
            return false;
        }
        for (c, out) in $planes.chunks(4).zip($out.chunks_mut(4)) {
            let at = |i: usize| $conv(&c[i]).unwrap_or_default();
            match c.len() {
                4 => {
                    let $group = [at(0), at(1), at(2), at(3)];
                    out.copy_from_slice(&$call)
                }
                3 => {
                    let $group = [at(0), at(1), at(2)];
                    out.copy_from_slice(&$call)
                }
                2 => {
                    let $group = [at(0), at(1)];
                    out.copy_from_slice(&$call)
                }
                _ => {
                    let $group = [at(0)];
                    out.copy_from_slice(&$call)
                }
            }
        }
        true
    }};
}

/// [`sums`] over the planes into `out` when their element type `E` is `L`; false otherwise.
///
/// # Safety
/// The CPU has AVX-512F; every slice has the same length; `out` has one place per plane.
#[cfg(target_arch = "x86_64")]
unsafe fn sums_as<E: 'static, L: Load8 + 'static>(
    planes: &[(&[E], &[E])],
    mean: f64,
    through: Through,
    out: &mut [(f64, f64)],
) -> bool {
    // SAFETY: AVX-512F (the caller's contract); the same lengths.
    by_fours!(planes, out, pair_as::<E, L>, |group| unsafe { sums(group, mean, through) })
}

/// [`moments`] over the planes into `out` when their element type `E` is `L`; false otherwise.
///
/// # Safety
/// The CPU has AVX-512F; every slice has the same length; `out` has one place per plane.
#[cfg(target_arch = "x86_64")]
unsafe fn moments_as<E: 'static, L: Load8 + 'static>(planes: &[&[E]], dev: Option<f64>, out: &mut [f64]) -> bool {
    // SAFETY: AVX-512F (the caller's contract); the same lengths.
    by_fours!(planes, out, plane_as::<E, L>, |group| unsafe { moments(group, dev) })
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

/// Each plane's backward sums, `P` planes at once.
///
/// # Safety
/// The CPU has AVX-512F; every slice has the same length.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2")]
unsafe fn sums<L: Load8, const P: usize>(planes: [(&[L], &[L]); P], mean: f64, through: Through) -> [(f64, f64); P] {
    use std::arch::x86_64::*;
    let len = planes.first().map_or(0, |p| p.0.len());
    let whole = len / 8 * 8;
    let (mut sg, mut sgx) = ([_mm512_setzero_pd(); P], [_mm512_setzero_pd(); P]);
    let m = _mm512_set1_pd(mean);
    for i in (0..whole).step_by(8) {
        for (p, (g, x)) in planes.iter().enumerate() {
            // SAFETY: elements i..i+8 lie inside both slices (i + 8 ≤ whole ≤ len).
            let (gv, xv) = unsafe { (L::load8(g.as_ptr().add(i)), L::load8(x.as_ptr().add(i))) };
            let gv = match through {
                Through::Identity => gv,
                Through::Masked { a, t, lower, upper } => {
                    let y = _mm256_add_ps(_mm256_mul_ps(xv, _mm256_set1_ps(a)), _mm256_set1_ps(t));
                    let inside = _mm256_and_ps(
                        _mm256_cmp_ps::<_CMP_GT_OQ>(y, _mm256_set1_ps(lower)),
                        _mm256_cmp_ps::<_CMP_LT_OQ>(y, _mm256_set1_ps(upper)),
                    );
                    _mm256_and_ps(gv, inside)
                }
            };
            let (gd, xd) = (_mm512_cvtps_pd(gv), _mm512_cvtps_pd(xv));
            sg[p] = _mm512_add_pd(sg[p], gd);
            sgx[p] = _mm512_add_pd(sgx[p], _mm512_mul_pd(gd, _mm512_sub_pd(xd, m)));
        }
    }
    std::array::from_fn(|p| {
        let (g, x) = planes[p];
        let (mut tail_g, mut tail_gx) = (-0.0f64, -0.0f64);
        for (gv, xv) in g[whole..].iter().zip(&x[whole..]) {
            let (gv, xv) = (gv.f32(), xv.f32());
            let gv = match through {
                Through::Identity => gv,
                Through::Masked { a, t, lower, upper } => {
                    let y = xv * a + t;
                    if y > lower && y < upper {
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
        (lanes(sg[p]).iter().sum::<f64>() + tail_g, lanes(sgx[p]).iter().sum::<f64>() + tail_gx)
    })
}

/// Each plane's `Σ x` or `Σ (x − dev)²`, `P` planes at once.
///
/// # Safety
/// The CPU has AVX-512F; every slice has the same length.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2")]
unsafe fn moments<L: Load8, const P: usize>(planes: [&[L]; P], dev: Option<f64>) -> [f64; P] {
    use std::arch::x86_64::*;
    let len = planes.first().map_or(0, |p| p.len());
    let whole = len / 8 * 8;
    let mut acc = [_mm512_setzero_pd(); P];
    let m = _mm512_set1_pd(dev.unwrap_or(0.0));
    for i in (0..whole).step_by(8) {
        for (p, x) in planes.iter().enumerate() {
            // SAFETY: elements i..i+8 lie inside the slice (i + 8 ≤ whole ≤ len).
            let xd = _mm512_cvtps_pd(unsafe { L::load8(x.as_ptr().add(i)) });
            let term = match dev {
                None => xd,
                Some(_) => {
                    let d = _mm512_sub_pd(xd, m);
                    _mm512_mul_pd(d, d)
                }
            };
            acc[p] = _mm512_add_pd(acc[p], term);
        }
    }
    std::array::from_fn(|p| {
        let mut tail = -0.0f64;
        for v in &planes[p][whole..] {
            let v = f64::from(v.f32());
            tail += match dev {
                None => v,
                Some(m) => (v - m) * (v - m),
            };
        }
        lanes(acc[p]).iter().sum::<f64>() + tail
    })
}

/// A register's eight f64 lanes, in order.
#[cfg(target_arch = "x86_64")]
fn lanes(r: std::arch::x86_64::__m512d) -> [f64; 8] {
    // SAFETY: a 512-bit register is eight f64, in lane order.
    unsafe { std::mem::transmute(r) }
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
                Through::Masked { a, t, lower, upper } => {
                    std::hint::select_unpredictable((xv * a + t > lower) & (xv * a + t < upper), gv, 0.0)
                }
            };
            let gv = f64::from(gv);
            [gv, gv * (f64::from(xv) - mean)]
        });
        (a, b)
    }

    /// The values of plane `k` of length `len` (distinct per plane, with ties and a few small
    /// values).
    fn plane(k: usize, len: usize, s: f32) -> Vec<f32> {
        (0..len)
            .map(|i| {
                ((i as f32 * 0.731 + s + k as f32 * 0.37).sin() * 3.0) + if i.is_multiple_of(7) { 1e-3 } else { 0.0 }
            })
            .collect()
    }

    /// One to nine planes at once (whole groups of four and every remainder), each plane's sums
    /// against the generic form's of that plane alone, to the bit.
    #[test]
    fn sums_equal_the_generic_form_to_the_bit() {
        if !std::is_x86_feature_detected!("avx512f") {
            eprintln!("SKIPPED: this CPU has no AVX-512F");
            return;
        }
        let throughs = [
            Through::Identity,
            Through::Masked { a: 1.3, t: -0.2, lower: 0.0, upper: f32::INFINITY },
            Through::Masked { a: 0.7, t: 0.4, lower: 0.0, upper: 6.0 },
            Through::Masked { a: 0.7, t: 0.4, lower: 0.25, upper: 5.984375 },
        ];
        for len in [0usize, 1, 7, 8, 9, 15, 16, 17, 63, 1000, 3137] {
            for count in [1usize, 2, 3, 4, 5, 9] {
                let g: Vec<Vec<f32>> = (0..count).map(|k| plane(k, len, 0.3)).collect();
                let x: Vec<Vec<f32>> =
                    (0..count).map(|k| plane(k, len, 1.9).iter().map(|v| v * 2.0).collect()).collect();
                let narrow = |v: &Vec<f32>| v.iter().map(|v| bf16::from_f32(*v)).collect::<Vec<bf16>>();
                let (gb, xb): (Vec<Vec<bf16>>, Vec<Vec<bf16>>) =
                    (g.iter().map(narrow).collect(), x.iter().map(narrow).collect());
                for through in throughs {
                    for mean in [0.0, 0.37, -1.25] {
                        let pairs: Vec<(&[f32], &[f32])> = g.iter().zip(&x).map(|(g, x)| (&g[..], &x[..])).collect();
                        let mut fast = vec![(0.0, 0.0); count];
                        assert!(plane_sums::<f32, f32>(&pairs, mean, through, &mut fast), "AVX-512F");
                        let pairs_b: Vec<(&[bf16], &[bf16])> =
                            gb.iter().zip(&xb).map(|(g, x)| (&g[..], &x[..])).collect();
                        let mut fast_b = vec![(0.0, 0.0); count];
                        assert!(plane_sums::<f32, bf16>(&pairs_b, mean, through, &mut fast_b), "AVX-512F");
                        for k in 0..count {
                            let bits = |v: (f64, f64)| (v.0.to_bits(), v.1.to_bits());
                            assert_eq!(
                                bits(fast[k]),
                                bits(generic(&g[k], &x[k], mean, through)),
                                "f32, len {len}, plane {k} of {count}"
                            );
                            assert_eq!(
                                bits(fast_b[k]),
                                bits(generic(&gb[k], &xb[k], mean, through)),
                                "bf16, len {len}, plane {k} of {count}"
                            );
                        }
                    }
                }
            }
        }
        // Other compute types, and planes of different lengths, take the generic form.
        let (one, two) = ([1.0f32], [1.0f32, 2.0]);
        let mut out = [(0.0, 0.0); 2];
        assert!(!plane_sums::<f64, f64>(&[(&[1.0], &[1.0])], 0.0, Through::Identity, &mut out[..1]));
        assert!(!plane_sums::<f32, f32>(&[(&one, &one), (&two, &two)], 0.0, Through::Identity, &mut out));
        assert!(!plane_sums::<f32, f32>(&[(&one, &one)], 0.0, Through::Identity, &mut out));
    }

    /// The statistics' sums (`Σ x`, and `Σ (x − m)²` with the deviation squared as a product of
    /// the same difference) against the generic form, plane by plane, to the bit.
    #[test]
    fn moments_equal_the_generic_form_to_the_bit() {
        if !std::is_x86_feature_detected!("avx512f") {
            eprintln!("SKIPPED: this CPU has no AVX-512F");
            return;
        }
        fn generic<E: Copy + Into<f32>>(x: &[E], dev: Option<f64>) -> f64 {
            let [s] = crate::cpu::lane_sums(x, x, |v, _| {
                let v = f64::from(v.into());
                [match dev {
                    None => v,
                    Some(m) => {
                        let d = v - m;
                        d * d
                    }
                }]
            });
            s
        }
        for len in [0usize, 1, 7, 8, 9, 33, 1000, 3137] {
            for count in [1usize, 3, 4, 6] {
                let x: Vec<Vec<f32>> = (0..count).map(|k| plane(k, len, 0.4)).collect();
                let xb: Vec<Vec<bf16>> = x.iter().map(|p| p.iter().map(|v| bf16::from_f32(*v)).collect()).collect();
                for dev in [None, Some(0.0), Some(0.37), Some(-1.25)] {
                    let planes: Vec<&[f32]> = x.iter().map(|p| &p[..]).collect();
                    let planes_b: Vec<&[bf16]> = xb.iter().map(|p| &p[..]).collect();
                    let (mut fast, mut fast_b) = (vec![0.0; count], vec![0.0; count]);
                    assert!(plane_moments::<f32, f32>(&planes, dev, &mut fast), "AVX-512F");
                    assert!(plane_moments::<f32, bf16>(&planes_b, dev, &mut fast_b), "AVX-512F");
                    for k in 0..count {
                        assert_eq!(fast[k].to_bits(), generic(&x[k], dev).to_bits(), "f32, len {len}, plane {k}");
                        assert_eq!(fast_b[k].to_bits(), generic(&xb[k], dev).to_bits(), "bf16, len {len}, plane {k}");
                    }
                }
            }
        }
        assert!(!plane_moments::<f64, f64>(&[&[1.0]], None, &mut [0.0]));
    }
}
