//! The CPU references of the fused CUDA kernels (wick-kernels) against what the host path
//! computes: the scale update against `GradScaler`, and unscale's inf/NaN check. (The GPU check
//! compares the kernels themselves with these references; the optimizer's kernels are compared
//! with the host's loops, `wick_kernels::cpu::optim`, to the bit.)

use candle_core::{DType, Device, Tensor, Var};
use wick_kernels::reference::{unscale_and_check, update_scale, ScaleState};
use wick_train::amp::{GradScaler, GradScalerConfig};

/// The update kernel's reference and `GradScaler` agree over a long random run.
#[test]
fn update_scale_reference_matches_grad_scaler() {
    let config = GradScalerConfig { init_scale: 1024.0, growth_factor: 2.0, backoff_factor: 0.5, growth_interval: 4 };
    let mut scaler = GradScaler::with_config(config).unwrap();
    let mut state = ScaleState { scale: 1024.0, growth_tracker: 0 };
    let dev = Device::Cpu;
    let w = Var::from_tensor(&Tensor::ones(3, DType::F32, &dev).unwrap()).unwrap();
    let mut bits = 0x2545_F491_4F6C_DD1Du64;
    for step in 0..200 {
        bits ^= bits << 13;
        bits ^= bits >> 7;
        bits ^= bits << 17;
        let overflow = bits.is_multiple_of(5);
        let g = if overflow { f32::INFINITY } else { 1.0 };
        let loss = (w.as_tensor() * g as f64).unwrap().sum_all().unwrap();
        let mut grads = loss.backward().unwrap();
        let found = scaler.unscale(&mut grads, &[&w]).unwrap();
        assert_eq!(found, overflow, "step {step}");
        scaler.update().unwrap();
        update_scale(&mut state, found, 2.0, 0.5, 4);
        assert_eq!(state.scale as f64, scaler.scale(), "step {step}");
        assert_eq!(state.growth_tracker as u32, scaler.growth_tracker(), "step {step}");
    }
}

#[test]
fn unscale_reference_finds_inf_and_nan() {
    let mut a = vec![2.0f32, 4.0];
    let mut b = vec![8.0f32];
    assert!(!unscale_and_check(&mut [&mut a, &mut b], 0.5));
    assert_eq!((a.as_slice(), b.as_slice()), (&[1.0, 2.0][..], &[4.0][..]));
    let mut c = vec![1.0f32, f32::NAN];
    assert!(unscale_and_check(&mut [&mut a, &mut c], 1.0));
    let mut d = vec![f32::MAX];
    assert!(unscale_and_check(&mut [&mut d], 4.0), "overflow in the product counts");
}
