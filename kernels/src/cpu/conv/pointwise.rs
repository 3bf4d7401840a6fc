//! A 1×1 stride-1 convolution's weight gradient in bf16, summed along the positions where both
//! operands already lie: `dW[co][ci] = Σ_b Σ_p dY[b][co][p] · X[b][ci][p]`, f32 sums, image by
//! image on the along-the-depth product (`gemm::along_k`; no packing).
//!
//! Why not the blocked product: as `dY · Xᵀ` per image it packs both operands into k-pair panels
//! (a transpose of each, the positions being its depth) and uses each packed element only as
//! many times as the other operand has channels (64 at ResNet-50's first stage): its 56² weight
//! gradients ran at 65 G multiply-adds a second on one core, against 85–105 for the same layers'
//! other products; here 77–88 (`cargo bench -p wick-kernels --bench r50_pointwise`;
//! BENCHMARKS.md, "Convolutional networks at every size (issue 30)").
//!
//! Each output is summed in a fixed order (an image's positions, then the images in order)
//! whatever the thread count.

use half::bf16;

use crate::cpu::gemm::{along_k, Mat};
use crate::cpu::KernelError;

/// True when [`pointwise_weight_grad`] takes a 1×1 stride-1 convolution of `c_in` → `c_out`
/// channels over `positions` positions an image: where the along-the-depth product takes each
/// image's `dY · Xᵀ` (at least 2048 positions, at most 64 channels on one side, AVX512-BF16 and
/// AVX512-BW).
pub fn pointwise_applies(c_in: usize, c_out: usize, positions: usize) -> bool {
    // The shapes of one image's product: (c_out × positions) · (positions × c_in), both along
    // the positions (the checks look at the views' shapes and strides only).
    let (a, b) = (
        Mat { data: &[], rows: c_out, cols: positions, row_stride: positions, col_stride: 1 },
        Mat { data: &[], rows: positions, cols: c_in, row_stride: 1, col_stride: positions },
    );
    along_k::applies(&a, &b)
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
    for b in 0..n {
        let g = Mat::rows(&dy[b * c_out * hw..][..c_out * hw], c_out, hw);
        let xt = Mat::rows(&x[b * c_in * hw..][..c_in * hw], c_in, hw).t();
        along_k::product(&mut dw, g, xt, 1.0, b > 0, true);
    }
    Ok(dw)
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
        if !pointwise_applies(64, 64, 2048) {
            eprintln!("SKIPPED: this CPU has no AVX512-BF16 or AVX512-BW");
            return;
        }
        for (n, c_in, c_out, hw) in
            [(2, 8, 12, 2048 + 17), (3, 12, 4, 2080), (1, 4, 4, 3136), (1, 64, 68, 2048), (2, 3, 13, 2050)]
        {
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
        let wide = values(68 * 2048, 3);
        assert!(pointwise_weight_grad(&wide, &wide, (1, 68, 68, 2048)).is_err(), "both sides above 64 channels");
        assert!(pointwise_weight_grad(&x, &dy, (2, 4, 4, 2048)).is_err(), "lengths");
        assert!(pointwise_weight_grad(&x, &dy, (usize::MAX, 4, 4, 2048)).is_err(), "overflow");
    }
}
