//! The memory estimator against measured peaks (counting allocator, CPU, f32) for every zoo model
//! in inference and a training step (SGD): within ±15 % (mixed-precision training is checked
//! beside the f32 masters it counts, in wick-train's `estimate_amp` test). The heap counters are
//! process-wide: this binary holds this one test.

use candle_core::{DType, Device, Tensor};
use wick::host_memory::{counted_heap, counted_peak, reset_counted_peak};
use wick_nn::params::Params;
use wick_nn::Model;
use wick_zoo::estimate::{estimate, largest_batch, ActivationProfile, Mode};

wick::heap!(counting);

/// Above every profiled training batch (1 to 16): the estimate extrapolates.
const BATCH: usize = 24;

/// Samples in the data, enough for the largest profiled batch (inference runs up to 32).
const SAMPLES: usize = 32;

/// Peak of `mode` at `batch`, counting the parameters but no other resident data.
fn measure(params: &Params, run: &dyn Fn(usize) -> Tensor, batch: usize, mode: Mode) -> usize {
    let parameters: usize = params.iter().map(|(_, v)| v.elem_count() * v.dtype().size_in_bytes()).sum();
    let base = counted_heap().unwrap() - parameters;
    reset_counted_peak();
    if mode == Mode::Inference {
        // Inference as it is run: under no_grad.
        drop(wick_nn::no_grad(|| run(batch)));
    } else {
        let out = run(batch);
        let grads = out.backward().unwrap();
        params.sgd_step(&grads, 1e-3).unwrap();
    }
    counted_peak().unwrap() - base
}

/// Estimates and measures one model; returns the table row and whether both modes are in range.
fn check(name: &str, params: &Params, run: &dyn Fn(usize) -> Tensor) -> (String, bool) {
    let profile = ActivationProfile::measure(params, |b| Ok(run(b))).unwrap();
    let mut row = format!("| {name} |");
    let mut ok = true;
    for mode in [Mode::Inference, Mode::TrainSgd] {
        let e = estimate(params, &profile, BATCH, mode);
        let m = measure(params, run, BATCH, mode);
        let ratio = e.total as f64 / m as f64;
        ok &= (0.85..=1.15).contains(&ratio);
        let mib = |b: usize| b as f64 / 1048576.0;
        row += &format!(" {:.1} / {:.1} ({:+.1} %) |", mib(e.total), mib(m), (ratio - 1.0) * 100.0);
        if mode == Mode::TrainSgd {
            row += &format!(" {:.1} / {:.1} / {:.1} |", mib(e.parameters), mib(e.activations), mib(e.workspace));
        }
    }
    (row, ok)
}

#[test]
fn estimates_are_within_15_percent_of_measured_peaks() {
    use wick_nn::ops::cross_entropy;
    use wick_zoo::bert::{Bert, BertConfig};
    use wick_zoo::llama::{Llama, LlamaConfig};
    use wick_zoo::mobilenet::MobileNetV2;
    use wick_zoo::resnet::{ResNet, ResNetDepth};
    use wick_zoo::vit::{Vit, VitConfig};
    let dev = Device::Cpu;
    let f = DType::F32;
    let images = wick_nn::params::normal_tensor(&[SAMPLES, 3, 64, 64], 1.0, 13, f, &dev).unwrap();
    let labels = Tensor::from_vec((0..SAMPLES as u32).map(|i| i % 2).collect::<Vec<_>>(), SAMPLES, &dev).unwrap();
    let tokens =
        Tensor::from_vec((0..SAMPLES * 64).map(|i| (i * 7 % 100) as u32).collect::<Vec<_>>(), (SAMPLES, 64), &dev)
            .unwrap();
    let mask = Tensor::ones((SAMPLES, 64), DType::U32, &dev).unwrap();
    let take = |t: &Tensor, b: usize| t.narrow(0, 0, b).unwrap();
    let mut rows = Vec::new();

    let bert = Bert::new(
        BertConfig {
            vocab_size: 100,
            hidden_size: 128,
            num_hidden_layers: 4,
            num_attention_heads: 4,
            intermediate_size: 512,
            max_position_embeddings: 64,
            type_vocab_size: 2,
            layer_norm_eps: 1e-12,
            pad_token_id: Some(0),
        },
        f,
        &dev,
    )
    .unwrap();
    rows.push(check("BERT 4×128, seq 64", &bert.params, &|b| {
        bert.forward(&take(&tokens, b), &take(&mask, b)).unwrap().sqr().unwrap().mean_all().unwrap()
    }));
    drop(bert);
    let llama = Llama::new(
        LlamaConfig {
            vocab_size: 100,
            hidden_size: 128,
            num_layers: 4,
            num_heads: 4,
            intermediate_size: 512,
            max_seq: 64,
            rms_eps: 1e-6,
            rope_theta: 1e4,
        },
        f,
        &dev,
    )
    .unwrap();
    rows.push(check("LLaMA 4×128, seq 64", &llama.params, &|b| llama.loss(&take(&tokens, b)).unwrap()));
    drop(llama);
    let vit = Vit::new(
        VitConfig { image_size: 64, patch_size: 8, hidden: 128, layers: 4, heads: 4, mlp_dim: 512, num_classes: 2 },
        f,
        &dev,
    )
    .unwrap();
    rows.push(check("ViT 4×128, 64², patch 8", &vit.params, &|b| {
        cross_entropy(&vit.forward(&take(&images, b)).unwrap(), &take(&labels, b)).unwrap()
    }));
    drop(vit);
    for (depth, name) in [
        (ResNetDepth::R18, "ResNet-18 w16, 64²"),
        (ResNetDepth::R34, "ResNet-34 w16, 64²"),
        (ResNetDepth::R50, "ResNet-50 w16, 64²"),
    ] {
        let net = ResNet::new(depth, 2, 16, f, &dev).unwrap();
        rows.push(check(name, &net.params, &|b| {
            cross_entropy(&net.forward(&take(&images, b), true).unwrap(), &take(&labels, b)).unwrap()
        }));
    }
    let mbn = MobileNetV2::new(2, 0.5, f, &dev).unwrap();
    rows.push(check("MobileNetV2 ×0.5, 64²", &mbn.params, &|b| {
        cross_entropy(&mbn.forward(&take(&images, b), true).unwrap(), &take(&labels, b)).unwrap()
    }));
    // The largest batch under a budget is consistent with the estimate.
    let profile = ActivationProfile::measure(&mbn.params, |b| {
        let logits = mbn.forward(&take(&images, b), true).map_err(|e| candle_core::Error::Msg(e.to_string()))?;
        cross_entropy(&logits, &take(&labels, b))
    })
    .unwrap();
    let budget = estimate(&mbn.params, &profile, 40, Mode::TrainAdamW).total + 1;
    assert_eq!(largest_batch(&mbn.params, &profile, Mode::TrainAdamW, budget, 1000), 40);
    // No upper bound on the search: the estimate saturates ("does not fit") instead of overflowing.
    assert_eq!(largest_batch(&mbn.params, &profile, Mode::TrainAdamW, budget, usize::MAX), 40);
    assert_eq!(estimate(&mbn.params, &profile, usize::MAX, Mode::TrainAdamW).total, usize::MAX);
    // One profile, the three ways an update runs: only the workspace moves, and it orders as the
    // updates' temporaries do (a fused in-place update makes nothing beside the state; the CPU's
    // makes one parameter's new state; tensor ops make old and new of everything). A GPU estimate
    // (fused) is thus never above the CPU's from the same profile.
    use wick_zoo::estimate::{estimate_bytes, ParamBytes, Update};
    let bytes = ParamBytes::of(&mbn.params);
    let mut apart = 0;
    for batch in [1, 8, 40] {
        for mode in [Mode::TrainSgdMomentum, Mode::TrainAdamW] {
            let [fused, in_place, out_of_place] = [Update::Fused, Update::InPlace, Update::OutOfPlace]
                .map(|u| estimate_bytes(bytes, &profile, batch, mode, false, u));
            for e in [&fused, &out_of_place] {
                assert_eq!(
                    (e.parameters, e.gradients, e.optimizer_state, e.activations),
                    (in_place.parameters, in_place.gradients, in_place.optimizer_state, in_place.activations)
                );
            }
            assert!(
                fused.workspace <= in_place.workspace && in_place.workspace <= out_of_place.workspace,
                "{batch} {mode:?}"
            );
            assert!(fused.total <= in_place.total && in_place.total <= out_of_place.total, "{batch} {mode:?}");
            apart += usize::from(fused.total < out_of_place.total);
        }
    }
    // Where backward's gradients in flight outgrow every update's temporaries the three meet;
    // at batch 1 they do not.
    assert!(apart >= 2, "{apart}");

    println!("\n| model (batch {BATCH}, f32) | inference: estimate / measured MiB | training (SGD): estimate / measured MiB | training: params / activations / workspace MiB |");
    println!("|---|---|---|---|");
    for (row, _) in &rows {
        println!("{row}");
    }
    assert!(rows.iter().all(|(_, ok)| *ok), "an estimate is outside ±15 % of its measurement");
}
