//! The `Updater` against the pieces under it: the same update to the bit as f32 masters stepped
//! by hand, the same memory, and f16's initial loss scale.

use candle_core::{DType, Device, Tensor, Var};
use wick_nn::{Autocast, Model};
use wick_train::amp::{master_step, scaled_backward, MasterWeights, StepOutcome, Updater};
use wick_train::optim::{AdamW, Optimizer};
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
