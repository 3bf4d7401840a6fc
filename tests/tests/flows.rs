//! Flows that cross the crates: a zoo model trained with mixed precision through the engine under
//! a cap, pre-flight refusal, the batch finder, and the memory report — what a user does.

use candle_core::{DType, Tensor, Var};
use wick::memory::MemoryLimit;
use wick::{Engine, Error};
use wick_nn::Autocast;
use wick_nn::Model;
use wick_train::amp::{master_step, masters_by_name, scaled_backward, MasterWeights};
use wick_train::optim::{AdamW, Optimizer};
use wick_zoo::llama::{Llama, LlamaConfig};

#[test]
fn a_capped_engine_trains_a_zoo_model_with_amp_and_refuses_what_cannot_fit() {
    let mut engine = Engine::cpu();
    engine.set_memory_limit(Some(MemoryLimit::Bytes(engine.allocated().bytes + (512 << 20)))).unwrap();
    let device = engine.device().clone();
    let config = LlamaConfig::tiny(32);
    let amp = Autocast::new(DType::BF16).unwrap();
    let model = Llama::new(config, amp.model_dtype(), &device).unwrap();
    let f32_start = masters_by_name(&model.params, &Llama::new(config, DType::F32, &device).unwrap().params).unwrap();
    let vars: Vec<Var> = model.params.iter().map(|(_, v)| v.clone()).collect();
    let var_refs: Vec<&Var> = vars.iter().collect();
    let adamw = Optimizer::AdamW(AdamW { lr: 1e-2, beta1: 0.9, beta2: 0.95, eps: 1e-8, weight_decay: 0.0 });
    let mut masters = MasterWeights::with_masters(&vars, Some(&f32_start), adamw).unwrap();
    masters.account(&engine);
    // A fixed batch of a repeating sequence: the loss must fall as the model memorises it.
    let ids: Vec<u32> = (0..4 * 16).map(|i| (i % 7) as u32).collect();
    let ids = Tensor::from_vec(ids, (4, 16), &device).unwrap();
    let mut losses = Vec::new();
    for _ in 0..8 {
        let (loss, _report) = engine
            .try_step("train", |_| -> Result<f32, Error> {
                let loss = model.loss(&ids).map_err(|e| candle_core::Error::Msg(e.to_string()))?;
                let value = loss.to_dtype(DType::F32)?.to_scalar::<f32>()?;
                let mut grads = scaled_backward(&loss, None).map_err(|e| candle_core::Error::Msg(e.to_string()))?;
                master_step(&mut grads, &mut masters, None, &var_refs)
                    .map_err(|e| candle_core::Error::Msg(e.to_string()))?;
                Ok(value)
            })
            .unwrap();
        losses.push(loss);
    }
    assert!(losses[7] < losses[0] * 0.8, "the loss did not fall: {losses:?}");
    // The masters and the optimizer state are accounted and shown.
    let summary = engine.memory_summary();
    assert!(summary.contains("master weights") && summary.contains("AdamW"), "{summary}");
    // Over the cap: refused before allocating, through the engine's constructors and pre-flight.
    assert!(engine.zeros(&[1 << 30], DType::F32).unwrap_err().is_out_of_memory());
    assert!(engine.preflight_tensor(&[1 << 30], DType::F32, "activations").unwrap_err().is_out_of_memory());
    // The batch finder under the same cap: 64 MiB per sample fits 7 or fewer of 512 MiB.
    let plan = engine
        .find_executable_batch_size(64, |e, batch| Ok(e.preflight_tensor(&[batch, 16 << 20], DType::F32, "batch")?))
        .unwrap();
    assert!((1..=8).contains(&plan.batch_size) && plan.batch_size * plan.accumulation_steps >= 64, "{plan:?}");
    // The report renders the timeline the steps marked.
    let html = engine.memory_report().to_html();
    assert!(html.contains("train") && html.contains("<svg"), "the HTML report lacks the step timeline");
}
