//! `wick estimate --measure`: one step of each estimated mode run on the CPU as wick runs it,
//! and its peak, beside the estimate. Inference is the forward pass under `no_grad`; plain SGD
//! is `Params::sgd_step` after backward; SGD with momentum and AdamW are one
//! `wick_train::Trainer` step (its f32 masters and optimizer state made when the trainer is,
//! the graph dropped before the update, the update in place), with bf16 autocast and activation
//! checkpointing as asked. Each mode gets a freshly built model, so no mode's state is in the
//! next one's figure.

use anyhow::{Context, Result};
use candle_core::{DType, Device};
use wick::host_memory::{exact_heap, exact_peak, reset_exact_peak};
use wick_nn::checkpoint::Checkpointing;
use wick_nn::{Autocast, Model};
use wick_train::optim::{AdamW, LrSchedule, Optimizer};
use wick_train::trainer::{TrainOptions, Trainer};
use wick_zoo::estimate::{Mode, ParamBytes};
use wick_zoo::registry::ModelSpec;

/// What a measured step ran: the model, its precision and whether its blocks were checkpointed.
pub struct Step<'a> {
    /// The model.
    pub spec: &'a ModelSpec,
    /// bf16 autocast (a bf16 model with f32 masters) instead of f32.
    pub amp: bool,
    /// Activation checkpointing.
    pub checkpointing: bool,
}

/// Why plain SGD is neither estimated nor measured under mixed precision.
pub const PLAIN_SGD_UNDER_AMP: &str =
    "plain SGD is not a mixed-precision mode wick trains (the f32 masters update with momentum or AdamW)";

/// The peak heap bytes of one `mode` step at `batch` — the model's parameters, the batch, the
/// graph, the gradients, the optimizer's state and masters, the transients — over what the
/// process held before; `None` without an exact heap (wick's caching heap or counting allocator).
pub fn peak(step: &Step, batch: usize, mode: Mode) -> Result<Option<usize>> {
    if mode == Mode::TrainSgd && step.amp {
        anyhow::bail!("{PLAIN_SGD_UNDER_AMP}");
    }
    if exact_heap().is_none() {
        return Ok(None);
    }
    let dtype = if step.amp { DType::BF16 } else { DType::F32 };
    let device = Device::Cpu;
    let model = step.spec.build(dtype, &device).context("building the model to measure")?;
    let params = ParamBytes::of(model.params()).total;
    // The products' per-thread scratch lives as long as the process's threads: not the step's.
    wick_nn::cpu::allocate_thread_scratch();
    let Some((before, _)) = exact_heap() else { return Ok(None) };
    reset_exact_peak();
    let batch = || step.spec.batch(batch, dtype, &device);
    match mode {
        Mode::Inference => drop(wick_nn::no_grad(|| model.loss(&batch()?).map_err(anyhow::Error::from))?),
        Mode::TrainSgd => {
            let checkpoint = step.checkpointing.then(Checkpointing::new);
            let loss = model.loss_with(&batch()?, checkpoint.as_ref())?;
            let grads = match &checkpoint {
                Some(c) => c.backward(&loss, model.params())?,
                None => loss.backward()?,
            };
            // The graph goes before the update, as in the trainer.
            drop(loss);
            model.params().sgd_step(&grads, 1e-6)?;
        }
        Mode::TrainSgdMomentum | Mode::TrainAdamW => {
            let optimizer = if mode == Mode::TrainAdamW {
                Optimizer::AdamW(AdamW { lr: 1e-6, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.01 })
            } else {
                Optimizer::SgdMomentum { lr: 1e-6, momentum: 0.9 }
            };
            let options = TrainOptions {
                optimizer,
                schedule: LrSchedule::Constant,
                autocast: if step.amp { Autocast::bf16() } else { Autocast::off() },
                activation_checkpointing: step.checkpointing,
                // Clipping's norm is taken a gradient at a time in place on the CPU: no memory.
                clip_grad_norm: None,
                cuda_graph: None,
            };
            let mut trainer = Trainer::new(model, serde_json::Value::Null, None, options)?;
            trainer.train_step(&[batch()?])?;
        }
    }
    Ok(exact_peak().map(|(peak, _)| peak.saturating_sub(before) + params))
}
