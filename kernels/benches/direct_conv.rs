//! The direct convolution and weight gradient, bf16 and f32, at ResNet-18's 3×3 stride-1 shapes
//! (224², one image, one thread): multiply-adds a second of each (the convolution's time includes
//! packing its weights), and the time of what each call prepares (images rearranged into lanes
//! of channels; images padded, output gradients rearranged into lanes of positions) beside it;
//! then, at ResNet's 3×3 stride-2 shapes (batch 8), the forward convolution next to the strided
//! input gradient (the same multiply-adds; each whole call, preparation included).
//! BENCHMARKS.md, "Convolutional networks at every size (issue 30)" and "Stride-2 input
//! gradients direct", cite its output.
//!
//! `cargo bench -p wick-kernels --bench direct_conv`

use half::bf16;
use wick_kernels::cpu::conv::{available, conv_direct, weight_grad_direct, ChannelsLast, ConvDims, Element};
use wick_kernels::cpu::conv::{input_grad_strided, PaddedImages, PositionLanes, WeightLayout, Weights};

mod timing;

fn main() {
    rayon::ThreadPoolBuilder::new().num_threads(1).build_global().ok();
    println!(
        "| element | C_in = C_out, image | convolution | G multiply-adds/s | images rearranged | weight gradient | G multiply-adds/s | its operands rearranged |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    measure::<bf16>("bf16", bf16::from_f32);
    measure::<f32>("f32", |v| v);
    println!();
    println!("| element | stride 2: C_in = C_out, image, batch 8 | convolution | G multiply-adds/s | input gradient | G multiply-adds/s |");
    println!("|---|---|---|---|---|---|");
    strided::<bf16>("bf16", bf16::from_f32);
    strided::<f32>("f32", |v| v);
}

fn strided<E: Element>(name: &str, from: impl Fn(f32) -> E) {
    if !available::<E>() {
        return;
    }
    for (c, hw) in [(128usize, 56usize), (256, 28), (512, 14)] {
        let d = ConvDims { n: 8, c_in: c, h: hw, w: hw, c_out: c, k: 3, stride: 2, pad: 1 };
        let plane = (hw / 2) * (hw / 2);
        let w: Vec<E> = (0..c * c * 9).map(|i| from((i % 97) as f32 * 0.01)).collect();
        let x: Vec<E> = (0..d.n * c * hw * hw).map(|i| from((i % 89) as f32 * 0.01)).collect();
        let dy: Vec<E> = (0..d.n * c * plane).map(|i| from((i % 83) as f32 * 0.01)).collect();
        let (mut y, mut dx) = (vec![E::ZERO; dy.len()], vec![E::ZERO; x.len()]);
        let forward = timing::best(5, 1, &mut || {
            if let (Ok(xs), Ok(ws)) = (ChannelsLast::new(&x, d), Weights::new(d, &w, WeightLayout::Forward)) {
                drop(conv_direct(&mut y, &xs, &ws));
            }
        });
        let input = timing::best(5, 1, &mut || drop(input_grad_strided(&mut dx, &dy, &w, d)));
        let macs = (d.n * c * c * 9 * plane) as f64;
        println!(
            "| {name} | {c}, {hw}² | {:.2} ms | {:.1} | {:.2} ms | {:.1} |",
            forward * 1e3,
            macs / forward / 1e9,
            input * 1e3,
            macs / input / 1e9
        );
    }
}

fn measure<E: Element>(name: &str, from: impl Fn(f32) -> E) {
    if !available::<E>() {
        println!("this CPU lacks the AVX-512 features of {name}: nothing to measure");
        return;
    }
    for (c, hw) in [(64usize, 56usize), (128, 28), (256, 14), (512, 7)] {
        let d = ConvDims { n: 1, c_in: c, h: hw, w: hw, c_out: c, k: 3, stride: 1, pad: 1 };
        let w: Vec<E> = (0..c * c * 9).map(|i| from((i % 97) as f32 * 0.01)).collect();
        let x: Vec<E> = (0..c * hw * hw).map(|i| from((i % 89) as f32 * 0.01)).collect();
        let best = |f: &mut dyn FnMut()| timing::best(5, 10, f);
        let (Ok(xs), Ok(ws)) = (ChannelsLast::new(&x, d), Weights::new(d, &w, WeightLayout::Forward)) else {
            return;
        };
        let mut y = vec![E::ZERO; c * hw * hw];
        let conv = best(&mut || drop(conv_direct(&mut y, &xs, &ws)));
        let rearrange = best(&mut || drop(ChannelsLast::new(&x, d)));
        let (Ok(xp), Ok(gp)) = (PaddedImages::new(&x, d), PositionLanes::new(&y, d)) else { return };
        let mut dw = vec![0f32; c * c * 9];
        let grad = best(&mut || drop(weight_grad_direct(&mut dw, &xp, &gp)));
        let operands = best(&mut || drop((PaddedImages::new(&x, d), PositionLanes::new(&y, d))));
        let macs = (c * c * 9 * hw * hw) as f64;
        println!(
            "| {name} | {c}, {hw}² | {:.3} ms | {:.1} | {:.3} ms | {:.3} ms | {:.1} | {:.3} ms |",
            conv * 1e3,
            macs / conv / 1e9,
            rearrange * 1e3,
            grad * 1e3,
            macs / grad / 1e9,
            operands * 1e3
        );
    }
}
