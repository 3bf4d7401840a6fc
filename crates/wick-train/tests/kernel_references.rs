//! The CPU references of the fused CUDA kernels (wick-kernels) against what the host path
//! computes: the scale update against `GradScaler`, unscale's inf/NaN check, AdamW against
//! `MasterWeights`. (The GPU check compares the kernels themselves with these references.)

use candle_core::{DType, Device, Tensor, Var};
use wick_kernels::reference::{adamw_master, unscale_and_check, update_scale, ScaleState};
use wick_train::amp::{GradScaler, GradScalerConfig, MasterWeights};
use wick_train::optim::{AdamW, Optimizer};

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

/// The fused AdamW reference equals `MasterWeights`' AdamW on the same gradients.
#[test]
fn adamw_reference_matches_master_weights() {
    let dev = Device::Cpu;
    let n = 257;
    let start = wick_nn::params::normal_tensor(&[n], 1.0, 3, DType::F32, &dev).unwrap();
    let var = Var::from_tensor(&start).unwrap();
    // One description of AdamW for the host path and the reference, in values exact in f32 (the
    // reference computes in f32 as the kernel does).
    let hyper = AdamW {
        lr: 1e-2f32 as f64,
        beta1: 0.9f32 as f64,
        beta2: 0.999f32 as f64,
        eps: 1e-8f32 as f64,
        weight_decay: 0.01f32 as f64,
    };
    let opt = Optimizer::AdamW(hyper);
    let mut masters = MasterWeights::new(std::slice::from_ref(&var), opt).unwrap();
    let mut master: Vec<f32> = start.to_vec1().unwrap();
    let (mut m, mut v) = (vec![0.0f32; n], vec![0.0f32; n]);
    for step in 1..=5 {
        let g = wick_nn::params::normal_tensor(&[n], 0.5, 100 + step as u64, DType::F32, &dev).unwrap();
        let loss = (var.as_tensor() * &g).unwrap().sum_all().unwrap();
        masters.step(&loss.backward().unwrap()).unwrap();
        let scale = 256.0f32;
        let scaled: Vec<f32> = (g * scale as f64).unwrap().to_vec1().unwrap();
        adamw_master(&mut master, &mut m, &mut v, &scaled, &hyper, step, 1.0 / scale, false);
        let expected: Vec<f32> = masters.master(0).unwrap().to_vec1().unwrap();
        for i in 0..n {
            assert!((master[i] - expected[i]).abs() <= 1e-6 * (1.0 + expected[i].abs()), "step {step} [{i}]");
        }
    }
    // A skipped step changes nothing.
    let before = master.clone();
    adamw_master(&mut master, &mut m, &mut v, &vec![f32::NAN; n], &hyper, 6, 1.0, true);
    assert_eq!(master, before);
}
