//! The memory estimator for mixed-precision training (bf16 models, f32 masters and AdamW state)
//! against the measured peak of the real update (`MasterWeights`), counting allocator, CPU:
//! within ±15 %. The heap counters are process-wide: this binary holds this one test.

use candle_core::{DType, Device, Tensor};
use wick::host_memory::{counted_heap, counted_peak, reset_counted_peak};
use wick_nn::ops::cross_entropy;
use wick_nn::params::Params;
use wick_nn::Model;
use wick_train::amp::MasterWeights;
use wick_train::optim::{AdamW, Optimizer};
use wick_zoo::estimate::{estimate_amp, ActivationProfile, Mode};
use wick_zoo::llama::{Llama, LlamaConfig};
use wick_zoo::resnet::{ResNet, ResNetDepth};

wick::heap!(counting);

/// Above every profiled training batch (1 to 16): the estimate extrapolates.
const BATCH: usize = 24;

/// Samples in the data, enough for the largest profiled batch (inference runs up to 32).
const SAMPLES: usize = 32;

/// Peak of a steady-state mixed-precision AdamW step (the second one) at `batch`, counting the
/// model's parameters, the f32 masters and state, and nothing else resident.
fn measure_amp(params: &Params, run: &dyn Fn(usize) -> Tensor, batch: usize) -> usize {
    let parameters: usize = params.iter().map(|(_, v)| v.elem_count() * v.dtype().size_in_bytes()).sum();
    let base = counted_heap().unwrap() - parameters;
    let vars: Vec<_> = params.iter().map(|(_, v)| v.clone()).collect();
    let opt = Optimizer::AdamW(AdamW { lr: 1e-4, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.0 });
    let mut masters = MasterWeights::new(&vars, opt).unwrap();
    let mut step = || {
        let grads = run(batch).backward().unwrap();
        masters.step(&grads).unwrap();
    };
    step();
    reset_counted_peak();
    step();
    counted_peak().unwrap() - base
}

#[test]
fn amp_training_estimates_are_within_15_percent_of_measured_peaks() {
    let dev = Device::Cpu;
    let bf = DType::BF16;
    let take = |t: &Tensor, b: usize| t.narrow(0, 0, b).unwrap();
    let tokens =
        Tensor::from_vec((0..SAMPLES * 64).map(|i| (i * 7 % 100) as u32).collect::<Vec<_>>(), (SAMPLES, 64), &dev)
            .unwrap();
    let images = wick_nn::params::normal_tensor(&[SAMPLES, 3, 64, 64], 1.0, 13, bf, &dev).unwrap();
    let labels = Tensor::from_vec((0..SAMPLES as u32).map(|i| i % 2).collect::<Vec<_>>(), SAMPLES, &dev).unwrap();
    let config = LlamaConfig {
        vocab_size: 100,
        hidden_size: 128,
        num_layers: 4,
        intermediate_size: 512,
        ..LlamaConfig::tiny(100)
    };
    let llama = Llama::new(config, bf, &dev).unwrap();
    let resnet = ResNet::new(ResNetDepth::R18, 2, 16, bf, &dev).unwrap();
    let llama_run = |b: usize| llama.loss(&take(&tokens, b)).unwrap();
    let resnet_run =
        |b: usize| cross_entropy(&resnet.forward(&take(&images, b), true).unwrap(), &take(&labels, b)).unwrap();
    type Case<'a> = (&'a str, &'a Params, &'a dyn Fn(usize) -> Tensor);
    let cases: [Case; 2] = [
        ("LLaMA 4×128, seq 64, bf16", &llama.params, &llama_run),
        ("ResNet-18 w16, 64², bf16", &resnet.params, &resnet_run),
    ];
    println!("\n| model (batch {BATCH}, AdamW on f32 masters) | estimate / measured MiB | params / masters / state / activations / workspace MiB |");
    println!("|---|---|---|");
    let mut ok = true;
    for (name, params, run) in cases {
        let profile = ActivationProfile::measure(params, |b| Ok(run(b))).unwrap();
        let e = estimate_amp(params, &profile, BATCH, Mode::TrainAdamW);
        // The masters and state are f32 whatever the model's dtype.
        let numel: usize = params.iter().map(|(_, v)| v.elem_count()).sum();
        assert_eq!((e.master_weights, e.optimizer_state), (4 * numel, 8 * numel), "{name}");
        let m = measure_amp(params, run, BATCH);
        let ratio = e.total as f64 / m as f64;
        ok &= (0.85..=1.15).contains(&ratio);
        let mib = |b: usize| b as f64 / 1048576.0;
        println!(
            "| {name} | {:.1} / {:.1} ({:+.1} %) | {:.1} / {:.1} / {:.1} / {:.1} / {:.1} |",
            mib(e.total),
            mib(m),
            (ratio - 1.0) * 100.0,
            mib(e.parameters),
            mib(e.master_weights),
            mib(e.optimizer_state),
            mib(e.activations),
            mib(e.workspace)
        );
    }
    assert!(ok, "an AMP estimate is outside ±15 % of its measurement");
}
