use super::forward::{lanes_row, lanes_row_wide};
use super::pack::{pack_block, pack_block_wide, tap_lanes, BlockGeometry};
use super::weight_grad::{position_row, position_row_wide};
use super::*;
use half::bf16;

/// A value as f64, whichever element it is.
trait Exact: Element {
    fn f64(self) -> f64;
    fn from_bf16(v: bf16) -> Self;
    /// The relative rounding of a stored output (bf16: one rounding; f32: none past the sum's).
    const STORED: f64;
}
impl Exact for bf16 {
    fn f64(self) -> f64 {
        self.to_f64()
    }
    fn from_bf16(v: bf16) -> Self {
        v
    }
    const STORED: f64 = 1.0 / 256.0;
}
impl Exact for f32 {
    fn f64(self) -> f64 {
        self as f64
    }
    fn from_bf16(v: bf16) -> Self {
        v.to_f32()
    }
    const STORED: f64 = 0.0;
}

/// True (and says so) when this CPU lacks E's features, so that `what` is not run.
fn skipped<E: Exact>(what: &str) -> bool {
    if available::<E>() {
        return false;
    }
    eprintln!("SKIPPED: this CPU lacks the AVX-512 features of {:?}; {what} is not run", E::ZERO);
    true
}

/// [`values`] as elements of E (exact in both).
fn elements<E: Exact>(len: usize, seed: u64) -> Vec<E> {
    values(len, seed).into_iter().map(E::from_bf16).collect()
}

/// Deterministic values in about [-1, 1), held exactly by bf16.
fn values(len: usize, seed: u64) -> Vec<bf16> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            bf16::from_f32(((s >> 40) as f32 / (1u64 << 23) as f32) - 1.0)
        })
        .collect()
}

/// Calls `f(output, input, weight)` with the indices of every product of the convolution `d`:
/// output (n, c_out, oh, ow), input (n, c_in, h, w) and weight (c_out, c_in, k, k), for each tap
/// whose input lies inside the image (padding contributes nothing).
fn products(d: ConvDims, mut f: impl FnMut(usize, usize, usize)) {
    let (oh, ow) = d.out_hw().unwrap();
    for b in 0..d.n {
        for o in 0..d.c_out {
            for y in 0..oh {
                for xx in 0..ow {
                    for i in 0..d.c_in {
                        for ky in 0..d.k {
                            for kx in 0..d.k {
                                let (iy, ix) = (
                                    (y * d.stride + ky) as isize - d.pad as isize,
                                    (xx * d.stride + kx) as isize - d.pad as isize,
                                );
                                if iy < 0 || ix < 0 || iy >= d.h as isize || ix >= d.w as isize {
                                    continue;
                                }
                                let input = ((b * d.c_in + i) * d.h + iy as usize) * d.w + ix as usize;
                                let weight = ((o * d.c_in + i) * d.k + ky) * d.k + kx;
                                f(((b * d.c_out + o) * oh + y) * ow + xx, input, weight);
                            }
                        }
                    }
                }
            }
        }
    }
}

/// Sums in f64 over the products of `d`: `len` sums, product (output, input, weight) adding
/// `term(…)` to sum `at(…)`; (exact sums, sums of magnitudes).
fn sums(
    d: ConvDims,
    len: usize,
    at: impl Fn(usize, usize, usize) -> usize,
    term: impl Fn(usize, usize, usize) -> f64,
) -> (Vec<f64>, Vec<f64>) {
    let (mut out, mut mag) = (vec![0.0; len], vec![0.0; len]);
    products(d, |o, i, w| {
        let (a, t) = (at(o, i, w), term(o, i, w));
        out[a] += t;
        mag[a] += t.abs();
    });
    (out, mag)
}

/// The convolution in f64 from the same bf16 values: (exact sums, sums of magnitudes).
fn reference<E: Exact>(x: &[E], w: &[E], d: ConvDims) -> (Vec<f64>, Vec<f64>) {
    let (oh, ow) = d.out_hw().unwrap();
    sums(d, d.n * d.c_out * oh * ow, |o, _, _| o, |_, i, wi| x[i].f64() * w[wi].f64())
}

/// Every element of `got` within one rounding of the element (bf16) of the exact sum, plus the
/// f32 sums' own error over `depth` terms.
fn assert_within<E: Exact>(got: &[E], (exact, mag): (Vec<f64>, Vec<f64>), depth: usize, what: &str) {
    for (at, ((g, e), m)) in got.iter().zip(&exact).zip(&mag).enumerate() {
        let bound = e.abs() * E::STORED + m * depth as f64 * 2f64.powi(-24);
        assert!((g.f64() - e).abs() <= bound, "{what} {at}: {g:?} against {e} (bound {bound})");
    }
}

/// Every output within one rounding of the element (bf16) of the exact sum, plus the f32 sums'
/// own error: over strides 1 and 2, paddings 0–3, kernels 1, 3, 5 and 7, odd channel counts (a
/// half-empty last pair), output channels that leave a block ragged, images smaller than a tile,
/// planes of 49, 84 and 196 positions (the first and last tiled 7 positions at a time),
/// and the weights read through a flipped and transposed view (the input gradient's use) — for
/// bf16 and for f32.
#[test]
fn direct_convolutions_match_an_f64_reference() {
    convolutions_match::<bf16>();
    convolutions_match::<f32>();
}

fn convolutions_match<E: Exact>() {
    if skipped::<E>("the direct convolution") {
        return;
    }
    let cases = [
        ConvDims { n: 2, c_in: 16, h: 9, w: 11, c_out: 32, k: 3, stride: 1, pad: 1 },
        ConvDims { n: 1, c_in: 7, h: 8, w: 8, c_out: 40, k: 3, stride: 2, pad: 1 },
        ConvDims { n: 3, c_in: 24, h: 5, w: 4, c_out: 8, k: 1, stride: 1, pad: 0 },
        ConvDims { n: 2, c_in: 10, h: 12, w: 7, c_out: 33, k: 5, stride: 1, pad: 2 },
        ConvDims { n: 1, c_in: 64, h: 3, w: 3, c_out: 64, k: 3, stride: 1, pad: 1 },
        ConvDims { n: 2, c_in: 6, h: 10, w: 10, c_out: 16, k: 1, stride: 2, pad: 0 },
        ConvDims { n: 1, c_in: 3, h: 13, w: 13, c_out: 20, k: 7, stride: 2, pad: 3 },
        ConvDims { n: 2, c_in: 17, h: 6, w: 19, c_out: 48, k: 3, stride: 1, pad: 1 },
        ConvDims { n: 1, c_in: 18, h: 14, w: 14, c_out: 35, k: 3, stride: 1, pad: 1 },
    ];
    for (c, d) in cases.into_iter().enumerate() {
        let x = elements::<E>(d.n * d.c_in * d.h * d.w, 2 * c as u64 + 1);
        let w = elements::<E>(d.c_out * d.c_in * d.k * d.k, 2 * c as u64 + 2);
        let (oh, ow) = d.out_hw().unwrap();
        let mut got = vec![E::ZERO; d.n * d.c_out * oh * ow];
        let wp = Weights::new(d, &w, WeightLayout::Forward).unwrap();
        conv_direct(&mut got, &ChannelsLast::new(&x, d).unwrap(), &wp).unwrap();
        assert_within(&got, reference(&x, &w, d), d.c_in * d.k * d.k, &format!("{d:?}: output"));
        // The same weights stored flipped and transposed.
        let t: Vec<E> = (0..w.len())
            .map(|a| {
                let (kx, ky, o, i) = (a % d.k, a / d.k % d.k, a / (d.k * d.k) % d.c_out, a / (d.k * d.k * d.c_out));
                w[((o * d.c_in + i) * d.k + (d.k - 1 - ky)) * d.k + (d.k - 1 - kx)]
            })
            .collect();
        let flipped = Weights::new(d, &t, WeightLayout::FlippedTransposed).unwrap();
        let mut again = vec![E::ZERO; got.len()];
        conv_direct(&mut again, &ChannelsLast::new(&x, d).unwrap(), &flipped).unwrap();
        assert_eq!(again, got, "{d:?}: the flipped view");
    }
}

/// The input gradient of `d` in f64 from the same values: (exact sums, sums of magnitudes).
fn reference_input_grad<E: Exact>(dy: &[E], w: &[E], d: ConvDims) -> (Vec<f64>, Vec<f64>) {
    sums(d, d.n * d.c_in * d.h * d.w, |_, i, _| i, |o, _, wi| dy[o].f64() * w[wi].f64())
}

/// The strided input gradient within one rounding of the element (bf16) of the exact sum, plus
/// the f32 sums' own error: 3 × 3 stride 2 (ResNet's, 49- and 196-position phase planes, which
/// take the 7-row tiles), odd output-channel counts (a half-empty last pair), input channels
/// that leave a block ragged, 1 × 1 stride 2 (three phases without taps: zeros), 2 × 2 and
/// 4 × 4 stride 2, 3 × 3 stride 3 — for bf16 and for f32.
#[test]
fn strided_input_gradients_match_an_f64_reference() {
    strided_match::<bf16>();
    strided_match::<f32>();
}

fn strided_match<E: Exact>() {
    if skipped::<E>("the strided input gradient") {
        return;
    }
    let cases = [
        ConvDims { n: 2, c_in: 32, h: 8, w: 10, c_out: 16, k: 3, stride: 2, pad: 1 },
        ConvDims { n: 1, c_in: 40, h: 14, w: 14, c_out: 17, k: 3, stride: 2, pad: 1 },
        ConvDims { n: 3, c_in: 64, h: 28, w: 28, c_out: 32, k: 3, stride: 2, pad: 1 },
        ConvDims { n: 2, c_in: 24, h: 6, w: 6, c_out: 20, k: 1, stride: 2, pad: 0 },
        ConvDims { n: 1, c_in: 16, h: 8, w: 6, c_out: 33, k: 2, stride: 2, pad: 0 },
        ConvDims { n: 2, c_in: 35, h: 8, w: 8, c_out: 16, k: 4, stride: 2, pad: 1 },
        ConvDims { n: 1, c_in: 16, h: 9, w: 12, c_out: 16, k: 3, stride: 3, pad: 1 },
    ];
    for (c, d) in cases.into_iter().enumerate() {
        assert!(strided_applies(&d), "{d:?}");
        let (oh, ow) = d.out_hw().unwrap();
        let dy = elements::<E>(d.n * d.c_out * oh * ow, 3 * c as u64 + 1);
        let w = elements::<E>(d.c_out * d.c_in * d.k * d.k, 3 * c as u64 + 2);
        let mut got = vec![E::ZERO; d.n * d.c_in * d.h * d.w];
        input_grad_strided(&mut got, &dy, &w, d).unwrap();
        let exact = reference_input_grad(&dy, &w, d);
        assert_within(&got, exact, d.c_out * d.k * d.k, &format!("{d:?}: input gradient"));
    }
    // Geometries it does not take are errors, not wrong answers.
    let d = ConvDims { n: 1, c_in: 16, h: 7, w: 8, c_out: 16, k: 3, stride: 2, pad: 1 };
    assert!(!strided_applies(&d), "an odd height");
    let mut dx = vec![E::ZERO; 16 * 7 * 8];
    assert!(input_grad_strided(&mut dx, &[E::ZERO; 16 * 4 * 4], &[E::ZERO; 16 * 16 * 9], d).is_err());
    assert!(!strided_applies(&ConvDims { stride: 1, h: 8, ..d }), "stride 1");
    let (d, mut dx) = (ConvDims { h: 8, ..d }, vec![E::ZERO; 16 * 8 * 8]);
    assert!(input_grad_strided(&mut dx, &[E::ZERO; 16 * 4 * 4], &[E::ZERO; 16 * 16 * 9], d).is_ok(), "fitting");
    assert!(input_grad_strided(&mut dx, &[E::ZERO; 16 * 4 * 4 - 1], &[E::ZERO; 16 * 16 * 9], d).is_err(), "short dy");
    assert!(input_grad_strided(&mut dx[1..], &[E::ZERO; 16 * 4 * 4], &[E::ZERO; 16 * 16 * 9], d).is_err(), "short dx");
}

/// Images, weights and outputs that do not fit together are errors, before anything is read.
#[test]
fn mismatched_convolutions_are_errors() {
    let d = ConvDims { n: 1, c_in: 4, h: 5, w: 5, c_out: 4, k: 3, stride: 1, pad: 1 };
    let x = values(100, 1);
    assert!(ChannelsLast::new(&x[..99], d).is_err(), "short images");
    assert!(ChannelsLast::new(&x, ConvDims { k: 8, ..d }).is_err(), "a window wider than the image");
    assert!(ChannelsLast::new(&x, ConvDims { stride: 0, ..d }).is_err(), "stride 0");
    let ones = vec![bf16::ONE; 4 * 4 * 9];
    assert!(Weights::new(ConvDims { c_out: usize::MAX, ..d }, &ones, WeightLayout::Forward).is_err(), "overflow");
    assert!(Weights::new(d, &ones[1..], WeightLayout::Forward).is_err(), "short weights");
    if !available::<bf16>() {
        eprintln!("SKIPPED: this CPU has no AVX512-BF16; the output checks are not run");
        return;
    }
    let xs = ChannelsLast::new(&x, d).unwrap();
    let ws = Weights::new(d, &ones, WeightLayout::Forward).unwrap();
    assert!(conv_direct(&mut [bf16::ZERO; 99], &xs, &ws).is_err(), "short output");
    let other = Weights::new(ConvDims { c_out: 5, ..d }, &[bf16::ONE; 5 * 4 * 9], WeightLayout::Forward).unwrap();
    assert!(conv_direct(&mut [bf16::ZERO; 100], &xs, &other).is_err(), "weights of another convolution");
    let mut y = [bf16::ZERO; 100];
    conv_direct(&mut y, &xs, &ws).unwrap();
    // All-one weights: each output counts its window's inputs times the four channels' values.
    assert!(y.iter().any(|v| *v != bf16::ZERO));
}

/// The register transposition against its definition.
#[cfg(target_arch = "x86_64")]
#[test]
fn transposition_of_sixteen_registers() {
    if !std::is_x86_feature_detected!("avx512f") {
        eprintln!("SKIPPED: this CPU has no AVX-512");
        return;
    }
    let m: Vec<u32> = (0..256).map(|i| i * 7 + 3).collect();
    // SAFETY: AVX-512F is present (checked); each row is 16 lanes of `m`, each result 16 lanes of `t`.
    let t = unsafe {
        use std::arch::x86_64::*;
        let mut rows = [_mm512_setzero_si512(); 16];
        for (i, r) in rows.iter_mut().enumerate() {
            *r = _mm512_loadu_si512(m[16 * i..].as_ptr().cast());
        }
        let out = transpose16(rows);
        let mut t = vec![0u32; 256];
        for (j, o) in out.iter().enumerate() {
            _mm512_storeu_si512(t[16 * j..].as_mut_ptr().cast(), *o);
        }
        t
    };
    for i in 0..16 {
        for j in 0..16 {
            assert_eq!(t[16 * j + i], m[16 * i + j], "lane {i} of result {j}");
        }
    }
}

/// The vectorised lanes of channels equal the lane-by-lane ones: widths and lane counts below,
/// at and past 16, and an odd channel count; bf16 and f32.
#[test]
fn channel_lanes_by_registers_equal_the_plain_ones() {
    channel_lanes_match::<bf16>();
    channel_lanes_match::<f32>();
}

fn channel_lanes_match<E: Exact>() {
    if skipped::<E>("the vectorised rearrangement") {
        return;
    }
    for (c, h, w) in [(3, 2, 5), (32, 3, 16), (45, 2, 37), (64, 1, 7)] {
        let image = elements::<E>(c * h * w, (c * w) as u64);
        for y in 0..h {
            let cl = c.div_ceil(E::PER_LANE);
            let (mut plain, mut wide) = (vec![1u32; w * cl], vec![2u32; w * cl]);
            lanes_row(&image, (c, h, w), y, &mut plain);
            // SAFETY: the CPU has E's features (`available`).
            unsafe { lanes_row_wide(&image, (c, h, w), y, &mut wide) };
            assert_eq!(plain, wide, "{:?}: c {c}, w {w}, row {y}", E::ZERO);
        }
    }
}

/// Weights packed by registers equal the lane-by-lane packing, in both layouts: odd channel
/// counts, ragged blocks, 1×1 and 3×3 kernels; bf16 and f32.
#[test]
fn weights_packed_by_registers_equal_the_plain_packing() {
    packing_matches::<bf16>();
    packing_matches::<f32>();
}

fn packing_matches<E: Exact>() {
    if skipped::<E>("the vectorised packing") {
        return;
    }
    for (c_in, c_out, k) in [(7, 40, 3), (64, 64, 3), (33, 17, 1), (16, 96, 3)] {
        let w = elements::<E>(c_out * c_in * k * k, (c_in + k) as u64);
        let kk = k * k;
        let cl = c_in.div_ceil(E::PER_LANE);
        // Forward, flipped and transposed, and a subset of the taps out of order.
        let subset: Vec<usize> = (0..kk).rev().step_by(2).collect();
        let layouts =
            [(c_in * kk, kk, (0..kk).collect()), (kk, c_out * kk, (0..kk).rev().collect()), (kk, c_out * kk, subset)];
        for (so, si, order) in layouts {
            let flipped = format!("{order:?}");
            let taps = order.len();
            let g = BlockGeometry { c_in, c_out, kk, cl, tl: tap_lanes(cl), so, si, order };
            for cb in 0..c_out.div_ceil(NB) {
                let (mut plain, mut wide) = (vec![0u32; taps * g.tl], vec![0u32; taps * g.tl]);
                pack_block(&w, cb, &g, &mut plain);
                // SAFETY: the CPU has E's features (`available`).
                unsafe { pack_block_wide(&w, cb, &g, &mut wide) };
                assert_eq!(plain, wide, "{:?}: c_in {c_in}, c_out {c_out}, k {k}, taps {flipped}, block {cb}", E::ZERO);
            }
        }
    }
}

/// The weight gradient in f64 from the same bf16 values: (exact sums, sums of magnitudes).
fn reference_weight_grad<E: Exact>(x: &[E], dy: &[E], d: ConvDims) -> (Vec<f64>, Vec<f64>) {
    sums(d, d.c_out * d.c_in * d.k * d.k, |_, _, wi| wi, |o, i, _| x[i].f64() * dy[o].f64())
}

/// Every weight gradient within the f32 sums' own error of the exact sum (they are not rounded
/// to bf16 here): odd and even output widths (a pair half past a row's end), paddings 0–2,
/// kernels 1, 3 and 5, ragged blocks of output channels, weight rows not a multiple of the
/// tile, several images; bf16 and f32.
#[test]
fn direct_weight_gradients_match_an_f64_reference() {
    weight_gradients_match::<bf16>();
    weight_gradients_match::<f32>();
}

fn weight_gradients_match<E: Exact>() {
    if skipped::<E>("the weight gradient") {
        return;
    }
    let cases = [
        ConvDims { n: 2, c_in: 16, h: 9, w: 11, c_out: 32, k: 3, stride: 1, pad: 1 },
        ConvDims { n: 1, c_in: 5, h: 8, w: 8, c_out: 40, k: 3, stride: 1, pad: 0 },
        ConvDims { n: 3, c_in: 7, h: 6, w: 5, c_out: 17, k: 5, stride: 1, pad: 2 },
        ConvDims { n: 2, c_in: 24, h: 7, w: 7, c_out: 64, k: 3, stride: 1, pad: 1 },
        ConvDims { n: 1, c_in: 9, h: 4, w: 36, c_out: 8, k: 1, stride: 1, pad: 0 },
    ];
    for (c, d) in cases.into_iter().enumerate() {
        let (oh, ow) = d.out_hw().unwrap();
        let x = elements::<E>(d.n * d.c_in * d.h * d.w, 3 * c as u64 + 1);
        let dy = elements::<E>(d.n * d.c_out * oh * ow, 3 * c as u64 + 2);
        let mut got = vec![f32::NAN; d.c_out * d.c_in * d.k * d.k];
        let (xs, gs) = (PaddedImages::new(&x, d).unwrap(), PositionLanes::new(&dy, d).unwrap());
        weight_grad_direct(&mut got, &xs, &gs).unwrap();
        let (exact, mag) = reference_weight_grad(&x, &dy, d);
        let depth = (d.n * oh * ow) as f64;
        for (at, ((g, e), m)) in got.iter().zip(&exact).zip(&mag).enumerate() {
            let bound = m * depth * 2f64.powi(-24) + 1e-30;
            assert!((*g as f64 - e).abs() <= bound, "{d:?}: weight {at}: {g} against {e} (bound {bound})");
        }
    }
    // Other strides and mismatched operands are errors.
    let d = ConvDims { n: 1, c_in: 4, h: 6, w: 6, c_out: 4, k: 3, stride: 1, pad: 1 };
    let (x, dy) = (elements::<E>(144, 1), elements::<E>(144, 2));
    let (xs, gs) = (PaddedImages::new(&x, d).unwrap(), PositionLanes::new(&dy, d).unwrap());
    assert!(weight_grad_direct(&mut [0.0; 143], &xs, &gs).is_err(), "short gradient");
    let strided = ConvDims { stride: 2, ..d };
    let (xs2, gs2) = (PaddedImages::new(&x, strided).unwrap(), PositionLanes::new(&dy[..36], strided).unwrap());
    assert!(weight_grad_direct(&mut [0.0; 144], &xs2, &gs2).is_err(), "stride 2");
    assert!(weight_grad_direct(&mut [0.0; 144], &xs, &gs2).is_err(), "operands of two convolutions");
    assert!(PositionLanes::new(&dy[..143], d).is_err(), "short output gradients");
}

/// Output-gradient lanes by registers equal the plain ones: widths odd and even, below and past
/// 32 values, channel counts below and past 16; bf16 and f32.
#[test]
fn position_lanes_by_registers_equal_the_plain_ones() {
    position_lanes_match::<bf16>();
    position_lanes_match::<f32>();
}

fn position_lanes_match<E: Exact>() {
    if skipped::<E>("the vectorised rearrangement") {
        return;
    }
    for (c, oh, ow) in [(3, 2, 5), (32, 3, 32), (45, 2, 37), (17, 1, 64)] {
        let grads = elements::<E>(c * oh * ow, (c * ow) as u64);
        let co = c.div_ceil(32) * 32;
        let mw = ow.div_ceil(E::PER_LANE);
        for y in 0..oh {
            let (mut plain, mut wide) = (vec![0u32; mw * co], vec![0u32; mw * co]);
            position_row(&grads, (c, oh, ow), (y, co), &mut plain);
            // SAFETY: the CPU has E's features (`available`).
            unsafe { position_row_wide(&grads, (c, oh, ow), (y, co), &mut wide) };
            assert_eq!(plain, wide, "{:?}: c {c}, ow {ow}, row {y}", E::ZERO);
        }
    }
}
