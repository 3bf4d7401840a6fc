//! The `Updater` against the pieces under it: the same update to the bit as f32 masters stepped
//! by hand, the same memory, and f16's initial loss scale.

use candle_core::{DType, Device, Tensor, Var};
use wick_nn::{Autocast, Model};
use wick_train::amp::{master_step, scaled_backward, GradScaler, MasterWeights, StepOutcome};
use wick_train::optim::{AdamW, Optimizer};
use wick_train::updater::Updater;
use wick_zoo::llama::{Llama, LlamaConfig};

fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
    (a - b).unwrap().abs().unwrap().max_all().unwrap().to_dtype(DType::F64).unwrap().to_scalar::<f64>().unwrap()
}

/// Four sequences of 17 tokens in `0..48`.
fn llama_batch() -> Tensor {
    let ids: Vec<u32> = (0..4 * 17).map(|i| ((i * 5 + i / 3) % 48) as u32).collect();
    Tensor::from_vec(ids, (4, 17), &Device::Cpu).unwrap()
}

#[test]
fn the_updater_makes_the_update_its_parts_make() {
    let engine = wick::Engine::cpu();
    let cpu = engine.device().clone();
    let adamw = Optimizer::AdamW(AdamW { lr: 1e-2, beta1: 0.9, beta2: 0.95, eps: 1e-8, weight_decay: 0.01 });
    let ids = llama_batch();
    let (a, b) = (
        Llama::new(LlamaConfig::tiny(48), DType::F32, &cpu).unwrap(),
        Llama::new(LlamaConfig::tiny(48), DType::F32, &cpu).unwrap(),
    );
    let start: Vec<Tensor> = a.vars().iter().map(|v| v.as_tensor().copy().unwrap()).collect();
    let mut updater = Updater::new(&engine, &a.vars(), &start, adamw, Autocast::off()).unwrap();
    assert!(!updater.fused() && updater.scale().unwrap().is_none());
    let mut masters = MasterWeights::with_masters(&b.vars(), Some(&start), adamw).unwrap();
    let refs: Vec<Var> = b.vars();
    let refs: Vec<&Var> = refs.iter().collect();
    let mut called = false;
    for _ in 0..3 {
        let outcome = updater.step(&a.loss(&ids).unwrap(), &a.vars(), || called = true).unwrap();
        assert_eq!(outcome, StepOutcome::Applied);
        let mut grads = scaled_backward(&b.loss(&ids).unwrap(), None).unwrap();
        master_step(&mut grads, &mut masters, None, &refs).unwrap();
    }
    assert!(called);
    for (x, y) in a.vars().iter().zip(b.vars()) {
        assert_eq!(max_diff(x.as_tensor(), y.as_tensor()), 0.0);
    }
    assert_eq!(updater.memory_bytes(), masters.memory_bytes());
    // f16 scales its loss, with PyTorch's initial scale 2^16.
    let c = Llama::new(LlamaConfig::tiny(48), DType::F16, &cpu).unwrap();
    let f16 = Updater::new(&engine, &c.vars(), &start, adamw, Autocast::new(DType::F16).unwrap()).unwrap();
    assert_eq!(f16.scale().unwrap(), Some(65536.0));
}

/// Clipping through the updater takes the step the trainer's pieces take: the same parameters,
/// to the bit, as `clip::clipped_master_step` by hand (f32; bf16 with f32 masters; f16 with the
/// loss scaler), the norm before clipping reported and equal to `clip::grad_norm` of the same
/// gradients (unscaled), a bound that
/// actually clips (the parameters differ from an unclipped run), and bad bounds refused.
#[test]
fn the_updater_clips_as_the_trainer_does() {
    let engine = wick::Engine::cpu();
    let cpu = engine.device().clone();
    let adamw = Optimizer::AdamW(AdamW { lr: 1e-2, beta1: 0.9, beta2: 0.95, eps: 1e-8, weight_decay: 0.01 });
    let ids = llama_batch();
    let start: Vec<Tensor> = Llama::new(LlamaConfig::tiny(48), DType::F32, &cpu)
        .unwrap()
        .vars()
        .iter()
        .map(|v| v.as_tensor().copy().unwrap())
        .collect();
    for autocast in [Autocast::off(), Autocast::bf16(), Autocast::new(DType::F16).unwrap()] {
        let dtype = autocast.model_dtype();
        let [a, b, c] = [0; 3].map(|_| Llama::new(LlamaConfig::tiny(48), dtype, &cpu).unwrap());
        let mut clipped = Updater::new(&engine, &a.vars(), &start, adamw, autocast).unwrap();
        clipped.clip_grad_norm(Some(0.05)).unwrap();
        let mut free = Updater::new(&engine, &c.vars(), &start, adamw, autocast).unwrap();
        let mut masters = MasterWeights::with_masters(&b.vars(), Some(&start), adamw).unwrap();
        // f16 scales its loss: the norm is that of the unscaled gradients.
        let mut scaler = autocast.needs_loss_scaling().then(GradScaler::new);
        let vars = b.vars();
        let refs: Vec<&Var> = vars.iter().collect();
        for _ in 0..3 {
            assert_eq!(clipped.step(&a.loss(&ids).unwrap(), &a.vars(), || {}).unwrap(), StepOutcome::Applied);
            free.step(&c.loss(&ids).unwrap(), &c.vars(), || {}).unwrap();
            assert_eq!(free.last_grad_norm(), None);
            let mut grads = scaled_backward(&b.loss(&ids).unwrap(), scaler.as_ref()).unwrap();
            let scale = scaler.as_ref().map_or(1.0, GradScaler::scale);
            let want = wick_train::clip::grad_norm(&grads, &refs).unwrap() / scale;
            let (outcome, norm) =
                wick_train::clip::clipped_master_step(&mut grads, &mut masters, scaler.as_mut(), &refs, Some(0.05))
                    .unwrap();
            assert_eq!(outcome, StepOutcome::Applied);
            let norm = norm.unwrap();
            assert!((norm - want).abs() <= 1e-6 * want, "{dtype:?}: {norm} against {want}");
            assert_eq!(clipped.last_grad_norm(), Some(norm), "{dtype:?}");
            assert!(norm > 0.05, "{dtype:?}: the bound clips ({norm})");
        }
        let mut moved = 0.0f64;
        for ((x, y), z) in a.vars().iter().zip(b.vars()).zip(c.vars()) {
            assert_eq!(max_diff(x.as_tensor(), y.as_tensor()), 0.0, "{dtype:?}");
            moved = moved.max(max_diff(x.as_tensor(), z.as_tensor()));
        }
        assert!(moved > 0.0, "{dtype:?}: clipping changed nothing");
    }
    let a = Llama::new(LlamaConfig::tiny(48), DType::F32, &cpu).unwrap();
    let mut updater = Updater::new(&engine, &a.vars(), &start, adamw, Autocast::off()).unwrap();
    for bad in [0.0, -1.0, f64::NAN, f64::INFINITY] {
        let e = updater.clip_grad_norm(Some(bad)).unwrap_err().to_string();
        assert!(e.contains("positive finite"), "{bad}: {e}");
    }
}

/// Without a loss scaler, a gradient that is not finite under clipping is an error and the
/// parameters are as they were (PyTorch's default would multiply them by NaN).
#[test]
fn a_non_finite_norm_stops_the_updater_and_changes_nothing() {
    let engine = wick::Engine::cpu();
    let cpu = engine.device().clone();
    let adamw = Optimizer::AdamW(AdamW { lr: 1e-2, beta1: 0.9, beta2: 0.95, eps: 1e-8, weight_decay: 0.0 });
    let a = Llama::new(LlamaConfig::tiny(48), DType::F32, &cpu).unwrap();
    let start: Vec<Tensor> = a.vars().iter().map(|v| v.as_tensor().copy().unwrap()).collect();
    let mut updater = Updater::new(&engine, &a.vars(), &start, adamw, Autocast::off()).unwrap();
    updater.clip_grad_norm(Some(1.0)).unwrap();
    let loss = (a.loss(&llama_batch()).unwrap() * f64::INFINITY).unwrap();
    let e = updater.step(&loss, &a.vars(), || {}).unwrap_err().to_string();
    assert!(e.contains("total norm") && e.contains("not applied"), "{e}");
    assert_eq!(updater.last_grad_norm(), None);
    for (v, s) in a.vars().iter().zip(&start) {
        assert_eq!(max_diff(v.as_tensor(), s), 0.0);
    }
}
