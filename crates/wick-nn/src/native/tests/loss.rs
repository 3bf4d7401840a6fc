//! Cross-entropy on f32 logits (the vector kernels of `wick_kernels::cpu::cross_entropy`) against
//! the same op on the same values in f64 (the library's `exp`, every sum in f64): the loss and
//! every gradient, at a real vocabulary's width and at widths that leave every vector tail.

use candle_core::{DType, Device, Tensor, Var};

use crate::native;
use crate::params::normal_tensor;

/// The loss and the logits' gradient (of the loss times 0.7) in `dtype`, as f64.
fn loss_and_grad(logits: &Tensor, targets: &Tensor, dtype: DType) -> (f64, Vec<f64>) {
    let x = Var::from_tensor(&logits.to_dtype(dtype).unwrap()).unwrap();
    let loss = native::loss::cross_entropy(x.as_tensor(), targets).unwrap();
    let grads = (&loss * 0.7).unwrap().backward().unwrap();
    let g = grads.get(&x).unwrap().flatten_all().unwrap().to_dtype(DType::F64).unwrap().to_vec1().unwrap();
    (loss.to_dtype(DType::F64).unwrap().to_scalar().unwrap(), g)
}

#[test]
fn f32_cross_entropy_matches_f64_at_every_width() {
    for (rows, width) in [(3, 1), (5, 7), (4, 17), (3, 33), (6, 1025), (3, 30_522), (2, 32_000)] {
        // Scores spread as a trained head's are (a few large, most near zero), with the targets
        // spread over the row; the f32 values are what both runs see.
        let logits = (normal_tensor(&[rows, width], 3.0, width as u64, DType::F32, &Device::Cpu).unwrap())
            .to_dtype(DType::F64)
            .unwrap();
        let t: Vec<u32> = (0..rows).map(|i| ((i * 7919 + 3) % width) as u32).collect();
        let targets = Tensor::new(t.as_slice(), &Device::Cpu).unwrap();
        let (l32, g32) = loss_and_grad(&logits, &targets, DType::F32);
        let (l64, g64) = loss_and_grad(&logits, &targets, DType::F64);
        assert!((l32 - l64).abs() <= 1e-6 * l64.abs().max(1.0), "{rows} x {width}: loss {l32} vs {l64}");
        let top = g64.iter().fold(0.0f64, |m, v| m.max(v.abs()));
        for (j, (a, b)) in g32.iter().zip(&g64).enumerate() {
            assert!(
                (a - b).abs() <= 2e-6 * b.abs() + 1e-9 * top,
                "{rows} x {width}: gradient {j} (row {}, target {}) {a} vs {b}",
                j / width,
                t[j / width]
            );
        }
        // The rows' gradients sum to 0 (the probabilities sum to 1, the target takes 1 back).
        for (r, row) in g32.chunks(width).enumerate() {
            let sum: f64 = row.iter().sum();
            assert!(sum.abs() <= 1e-6 * top.max(1e-3), "{rows} x {width}: row {r}'s gradients sum to {sum}");
        }
    }
}

/// bf16 logits (a model under autocast), widened a row at a time: the loss as f32 logits of the
/// same values give it, the gradient that one rounded to bf16.
#[test]
fn bf16_cross_entropy_is_the_f32_one_rounded() {
    for (rows, width) in [(3, 7), (4, 33), (2, 32_000)] {
        let logits = normal_tensor(&[rows, width], 3.0, 5 + width as u64, DType::BF16, &Device::Cpu).unwrap();
        let t: Vec<u32> = (0..rows).map(|i| ((i * 104_729 + 1) % width) as u32).collect();
        let targets = Tensor::new(t.as_slice(), &Device::Cpu).unwrap();
        let (lb, gb) = loss_and_grad(&logits, &targets, DType::BF16);
        let (l32, g32) = loss_and_grad(&logits, &targets, DType::F32);
        assert_eq!(lb, l32, "{rows} x {width}: the loss of the same values");
        for (j, (a, b)) in gb.iter().zip(&g32).enumerate() {
            let rounded = f64::from(half::bf16::from_f32(*b as f32).to_f32());
            assert_eq!(*a, rounded, "{rows} x {width}: gradient {j}");
        }
    }
}

/// A target outside the vocabulary is an error, not a panic.
#[test]
fn f32_cross_entropy_refuses_bad_targets() {
    let logits = Tensor::zeros((2, 5), DType::F32, &Device::Cpu).unwrap();
    let bad = Tensor::new(&[1u32, 5], &Device::Cpu).unwrap();
    assert!(native::loss::cross_entropy(&logits, &bad).is_err(), "a target outside the vocabulary");
}
