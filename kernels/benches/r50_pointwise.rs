//! bf16 products at ResNet-50's 1×1 convolution shapes (224², batch 8), one thread: the forward
//! product per image (weights × image), the input gradient's (weightsᵀ × output gradient), with
//! f32 sums stored as f32 and rounded to bf16 as stored where the depth allows, and the weight
//! gradient over the batch's positions (output gradient × imageᵀ; and, at 56², summed along the
//! positions in place: `pointwise_weight_grad`). G multiply-adds a second.
//! BENCHMARKS.md, "Stride-2 input gradients direct", cites its output.
//!
//! `cargo bench -p wick-kernels --bench r50_pointwise`

use half::bf16;
use wick_kernels::cpu::conv::{pointwise_applies, pointwise_weight_grad};
use wick_kernels::cpu::gemm::{bf16 as kernel, Mat};

mod timing;

/// (output channels, input channels, positions per image) of each 1×1 layer.
const LAYERS: [(usize, usize, usize); 12] = [
    (64, 64, 3136),
    (256, 64, 3136),
    (64, 256, 3136),
    (128, 256, 3136),
    (512, 128, 784),
    (128, 512, 784),
    (256, 512, 784),
    (1024, 256, 196),
    (256, 1024, 196),
    (512, 1024, 196),
    (2048, 512, 49),
    (512, 2048, 49),
];

fn main() {
    if !kernel::available() {
        println!("this CPU has no AVX512-BF16: nothing to measure");
        return;
    }
    rayon::ThreadPoolBuilder::new().num_threads(1).build_global().ok();
    println!("| product | m × k × n | f32 sums | rounded to bf16 |");
    println!("|---|---|---|---|");
    for (c_out, c_in, positions) in LAYERS {
        for (what, (m, k, n)) in [("forward", (c_out, c_in, positions)), ("input gradient", (c_in, c_out, positions))] {
            let a = data(m * k, 97);
            let b = data(k * n, 89);
            let (ma, mb) = (Mat::rows(&a, m, k), Mat::rows(&b, k, n));
            let (mut c, mut cb) = (vec![0f32; m * n], vec![bf16::ZERO; m * n]);
            let Ok(packed) = kernel::PackedA::new(ma, n) else { return };
            let f32_sums =
                timing::rate(m * k * n, &mut || drop(kernel::gemm_bf16_packed(&mut c, &packed, mb, 1.0, false, false)));
            let rounded = if kernel::rounds_directly(k) {
                let r = timing::rate(m * k * n, &mut || {
                    drop(kernel::gemm_bf16_packed_rounded(&mut cb, &packed, mb, false))
                });
                format!("{r:.1}")
            } else {
                "–".into()
            };
            println!("| {what} | {m} × {k} × {n} | {f32_sums:.1} | {rounded} |");
        }
        let k = 8 * positions;
        let (dy, x) = (data(c_out * k, 97), data(c_in * k, 89));
        let mut dw = vec![0f32; c_out * c_in];
        let (a, b) = (Mat::rows(&dy, c_out, k), Mat::rows(&x, c_in, k).t());
        let r = timing::rate(c_out * c_in * k, &mut || drop(kernel::gemm_bf16(&mut dw, a, b, 1.0, false, false)));
        println!("| weight gradient | {c_out} × {k} × {c_in} | {r:.1} | – |");
        if pointwise_applies(c_in, c_out, positions) {
            let dims = (8, c_in, c_out, positions);
            let r = timing::rate(c_out * c_in * k, &mut || drop(pointwise_weight_grad(&x, &dy, dims)));
            println!("| weight gradient along positions | {c_out} × {k} × {c_in} | {r:.1} | – |");
        }
    }
}

fn data(len: usize, modulus: usize) -> Vec<bf16> {
    (0..len).map(|i| bf16::from_f32((i % modulus) as f32 * 0.01)).collect()
}
