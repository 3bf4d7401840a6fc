//! A 1×1 stride-1 convolution's weight gradient in bf16, summed along the positions where both
//! operands already lie: `dW[co][ci] = Σ_b Σ_p dY[b][co][p] · X[b][ci][p]`, f32 sums.
//!
//! Why not the product: as `dY · Xᵀ` per image, the bf16 product packs both operands into
//! k-pair panels (a transpose of each, the positions being its depth) and uses each packed
//! element only as many times as the other operand has channels (64 at ResNet-50's first
//! stage): its 56² weight gradients ran at 65 G multiply-adds a second on one core, against
//! 85–105 for the same layers' other products; here 77–88 (`cargo bench -p wick-kernels --bench
//! r50_pointwise`; BENCHMARKS.md, "Convolutional networks at every size (issue 30)"). Here a 4 × 4 tile of outputs keeps 16 registers of partial sums, each
//! `vdpbf16ps` multiplying 32 positions of one output-gradient row and one image row loaded in
//! place; the 16 registers are summed across their lanes once per image.
//!
//! Blocking: per image, the operand with fewer channels is swept whole for each block of four
//! rows of the other (it stays in the L2 cache: 64 channels of 56² positions are 400 KB); the
//! threads split those blocks, so each output is one thread's, summed in a fixed order (images
//! in order, 16 lanes then across them) whatever the thread count.

use half::bf16;

use crate::cpu::{par_ranges, KernelError, SharedMut};

/// Positions per image below which [`pointwise_applies`] leaves the product in place: the
/// per-image sums across lanes (16 per tile) cost more next to fewer multiply-adds.
const MIN_POSITIONS: usize = 2048;

/// Channels of the smaller operand above which [`pointwise_applies`] leaves the product in
/// place: its packed panels are then used often enough (ResNet-50's 256 → 128 at 56²: 80 G/s
/// by the product, 79 here; 64 → 256: 66 against 77; one core, `r50_pointwise`).
const MAX_FEWER_CHANNELS: usize = 64;

/// True when [`pointwise_weight_grad`] takes a 1×1 stride-1 convolution of `c_in` → `c_out`
/// channels over `positions` positions an image: AVX512-BF16 and AVX512-BW (masked 16-bit
/// loads), both channel counts multiples of 4, at most [`MAX_FEWER_CHANNELS`] on one side, and
/// at least [`MIN_POSITIONS`] positions.
pub fn pointwise_applies(c_in: usize, c_out: usize, positions: usize) -> bool {
    c_in.is_multiple_of(4)
        && c_out.is_multiple_of(4)
        && c_in > 0
        && c_out > 0
        && c_in.min(c_out) <= MAX_FEWER_CHANNELS
        && positions >= MIN_POSITIONS
        && available()
}

fn available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        crate::cpu::gemm::bf16::available() && std::is_x86_feature_detected!("avx512bw")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

fn error(message: String) -> KernelError {
    KernelError { kernel: "wick 1×1 weight gradient", message }
}

/// The weight gradient (C_out × C_in, row-major f32) of a 1×1 stride-1 convolution with images
/// `x` (N, C_in, positions) and output gradients `dy` (N, C_out, positions), `dims` = (N, C_in,
/// C_out, positions). An error unless [`pointwise_applies`] holds and the lengths fit.
pub fn pointwise_weight_grad(
    x: &[bf16],
    dy: &[bf16],
    (n, c_in, c_out, hw): (usize, usize, usize, usize),
) -> Result<Vec<f32>, KernelError> {
    if !pointwise_applies(c_in, c_out, hw) {
        return Err(error(format!("{c_in} → {c_out} channels over {hw} positions, or no AVX512-BF16")));
    }
    let len = |c: usize| n.checked_mul(c).and_then(|v| v.checked_mul(hw));
    if len(c_in) != Some(x.len()) || len(c_out) != Some(dy.len()) {
        return Err(error(format!(
            "{} image and {} gradient elements for {n} × ({c_in} → {c_out}) × {hw}",
            x.len(),
            dy.len()
        )));
    }
    let mut dw = vec![0f32; c_out * c_in];
    // Rows of the operand with more channels are blocked (outer), the other swept (inner).
    let outer_is_dy = c_out >= c_in;
    let (outer, inner) = if outer_is_dy { (c_out, c_in) } else { (c_in, c_out) };
    let out = SharedMut::new(&mut dw);
    par_ranges(outer / 4, 1, |blocks| {
        for b in 0..n {
            let (xb, gb) = (&x[b * c_in * hw..][..c_in * hw], &dy[b * c_out * hw..][..c_out * hw]);
            let (o_rows, i_rows) = if outer_is_dy { (gb, xb) } else { (xb, gb) };
            for ob in blocks.clone() {
                let o = &o_rows[ob * 4 * hw..][..4 * hw];
                for ib in 0..inner / 4 {
                    let i = &i_rows[ib * 4 * hw..][..4 * hw];
                    // SAFETY: AVX512-BF16 (checked by `pointwise_applies`); both blocks hold 4
                    // rows of `hw`.
                    let sums = unsafe { tile(o, i, hw) };
                    for (r, row) in sums.iter().enumerate() {
                        for (c, s) in row.iter().enumerate() {
                            let (co, ci) =
                                if outer_is_dy { (ob * 4 + r, ib * 4 + c) } else { (ib * 4 + c, ob * 4 + r) };
                            // SAFETY: output (co, ci) belongs to block `ob` of the outer rows,
                            // which only this range holds.
                            let d = unsafe { out.range(co * c_in + ci, 1) };
                            d[0] += s;
                        }
                    }
                }
            }
        }
    });
    Ok(dw)
}

/// `Σ_p o[r][p] · i[c][p]` for the 4 × 4 rows of `o` and `i` (each 4 rows of `hw`), f32 sums.
///
/// # Safety
/// The CPU has AVX512-BF16, AVX512-BW and AVX-512F; `o` and `i` hold at least `4 · hw`
/// elements.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512bf16,avx512bw,avx512f")]
unsafe fn tile(o: &[bf16], i: &[bf16], hw: usize) -> [[f32; 4]; 4] {
    use std::arch::x86_64::*;
    assert!(o.len() >= 4 * hw && i.len() >= 4 * hw, "1×1 weight gradient: short rows");
    let mut acc = [[_mm512_setzero_ps(); 4]; 4];
    let (op, ip) = (o.as_ptr(), i.as_ptr());
    let mut p = 0;
    while p < hw {
        let lanes = (hw - p).min(32);
        let mask: __mmask32 = if lanes == 32 { u32::MAX } else { (1u32 << lanes) - 1 };
        // SAFETY: positions p..p + lanes of each row (masked loads read no others). Written
        // out, not in closures: an array of loads built by a closure ran at 54 G/s against 88
        // (the closure does not inherit this function's target features).
        unsafe {
            let i0: __m512bh = std::mem::transmute(_mm512_maskz_loadu_epi16(mask, ip.add(p).cast()));
            let i1: __m512bh = std::mem::transmute(_mm512_maskz_loadu_epi16(mask, ip.add(hw + p).cast()));
            let i2: __m512bh = std::mem::transmute(_mm512_maskz_loadu_epi16(mask, ip.add(2 * hw + p).cast()));
            let i3: __m512bh = std::mem::transmute(_mm512_maskz_loadu_epi16(mask, ip.add(3 * hw + p).cast()));
            for (r, sums) in acc.iter_mut().enumerate() {
                let ov: __m512bh = std::mem::transmute(_mm512_maskz_loadu_epi16(mask, op.add(r * hw + p).cast()));
                sums[0] = _mm512_dpbf16_ps(sums[0], ov, i0);
                sums[1] = _mm512_dpbf16_ps(sums[1], ov, i1);
                sums[2] = _mm512_dpbf16_ps(sums[2], ov, i2);
                sums[3] = _mm512_dpbf16_ps(sums[3], ov, i3);
            }
        }
        p += 32;
    }
    let mut sums = [[0f32; 4]; 4];
    for (row, acc) in sums.iter_mut().zip(&acc) {
        for (s, a) in row.iter_mut().zip(acc) {
            *s = _mm512_reduce_add_ps(*a);
        }
    }
    sums
}

#[cfg(not(target_arch = "x86_64"))]
unsafe fn tile(_: &[bf16], _: &[bf16], _: usize) -> [[f32; 4]; 4] {
    unreachable!("pointwise_weight_grad checks pointwise_applies() first")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn values(len: usize, seed: usize) -> Vec<bf16> {
        (0..len).map(|i| bf16::from_f32((((i * 7919 + seed * 104_729) % 251) as f32 - 125.0) / 64.0)).collect()
    }

    /// Against an f64 sum of the same products, over both blockings (more output channels and
    /// more input channels), a ragged last step of positions and several images; within f32
    /// summation error (each product of two bf16 values is exact in f32).
    #[test]
    fn equals_an_f64_sum() {
        if !available() {
            eprintln!("SKIPPED: this CPU has no AVX512-BF16 or AVX512-BW");
            return;
        }
        for (n, c_in, c_out, hw) in [(2, 8, 12, 2048 + 17), (3, 12, 4, 2080), (1, 4, 4, 3136), (1, 64, 68, 2048)] {
            let (x, dy) = (values(n * c_in * hw, 1), values(n * c_out * hw, 2));
            let dw = pointwise_weight_grad(&x, &dy, (n, c_in, c_out, hw)).unwrap();
            for co in 0..c_out {
                for ci in 0..c_in {
                    let (mut want, mut scale) = (0f64, 0f64);
                    for b in 0..n {
                        for p in 0..hw {
                            let t = dy[(b * c_out + co) * hw + p].to_f64() * x[(b * c_in + ci) * hw + p].to_f64();
                            want += t;
                            scale += t.abs();
                        }
                    }
                    let got = dw[co * c_in + ci] as f64;
                    assert!(
                        (got - want).abs() <= 1e-5 * scale,
                        "{n}×{c_in}→{c_out}×{hw} ({co}, {ci}): {got} vs {want}"
                    );
                }
            }
        }
    }

    /// What it does not take is an error, not a wrong answer.
    #[test]
    fn refuses_what_it_does_not_take() {
        let (x, dy) = (values(4 * 2048, 1), values(4 * 2048, 2));
        assert!(pointwise_weight_grad(&x, &dy, (1, 4, 4, 1024)).is_err(), "too few positions");
        assert!(pointwise_weight_grad(&x, &dy, (1, 3, 4, 2048)).is_err(), "channels not a multiple of 4");
        let wide = values(68 * 2048, 3);
        assert!(pointwise_weight_grad(&wide, &wide, (1, 68, 68, 2048)).is_err(), "both sides above 64 channels");
        assert!(pointwise_weight_grad(&x, &dy, (2, 4, 4, 2048)).is_err(), "lengths");
        assert!(pointwise_weight_grad(&x, &dy, (usize::MAX, 4, 4, 2048)).is_err(), "overflow");
    }
}
