//! A training step run as a CUDA graph (feature `cuda`): the fused device step ([`DeviceAmp`]),
//! whose update reads nothing from the host while it runs, and a model's forward and backward,
//! captured once as one graph (`wick::cuda_graph`) and replayed at every later step — the host
//! launches one graph instead of every kernel of the step.
//!
//! The first `warmup` steps run eagerly with candle's upload cache on (they make the optimizer's
//! state, choose cuDNN's algorithms and fill the cache the capture needs); the next is captured
//! and replayed at once (a capture runs nothing), and every later step replays it. A capture the
//! driver or the step refuses is reported ([`GraphStep::refused`]) and every step then runs
//! eagerly — the same step, never a wrong one. The loss is written into a tensor made before the
//! capture ([`GraphStep::last_loss`]); the forward must read its inputs from tensors made before
//! the capture too (copy each new batch into them before the step: a replay reads them where they
//! are). A step of another shape needs another graph: [`GraphStep::new`] once per shape.

use candle_core::{DType, Device, Tensor};
use wick::cuda_graph::{self, GraphError, StepGraph};

use super::device_step::{DeviceAmp, StepReport};
use crate::error::TrainError;

/// The memory report's line for the device's graph memory ([`GraphStep::account`]).
pub const GRAPH_MEMORY: &str = "CUDA graphs (the driver's graph pool)";

/// A training step that runs as a CUDA graph after its warm-up.
pub struct GraphStep {
    amp: DeviceAmp,
    device: Device,
    clip: Option<f64>,
    /// The last step's loss (one f32), written by the step itself.
    loss: Tensor,
    graph: Option<StepGraph>,
    warmup: usize,
    taken: usize,
    refused: Option<String>,
}

fn graph_error(e: GraphError) -> TrainError {
    TrainError::Invalid { what: "CUDA graph step".into(), message: e.to_string() }
}

impl GraphStep {
    /// A step updating `amp`'s parameters on `device` (a CUDA device), clipped to `clip` when
    /// given, captured after `warmup` eager steps (at least one).
    pub fn new(amp: DeviceAmp, device: &Device, clip: Option<f64>, warmup: usize) -> Result<Self, TrainError> {
        if !device.is_cuda() {
            return Err(TrainError::Invalid {
                what: "CUDA graph step".into(),
                message: format!("CUDA graphs need a CUDA device, not {:?}", device.location()),
            });
        }
        if let Some(max_norm) = clip {
            crate::clip::check_max_norm(max_norm)?;
        }
        let loss = Tensor::zeros(1, DType::F32, device)?;
        Ok(GraphStep {
            amp,
            device: device.clone(),
            clip,
            loss,
            graph: None,
            warmup: warmup.max(1),
            taken: 0,
            refused: None,
        })
    }

    /// One step: forward (`forward` returns the loss, reading tensors made before the capture),
    /// backward and the update — eagerly during the warm-up or after a refusal, captured at the
    /// first step after the warm-up, replayed after that. Nothing is read back
    /// ([`GraphStep::last_loss`], [`GraphStep::last_step`] read what happened).
    pub fn step(&mut self, forward: &dyn Fn() -> candle_core::Result<Tensor>) -> Result<(), TrainError> {
        self.taken += 1;
        // Host code does not run in a replay: the learning rate of this step goes to the device
        // now (a copy only when it changed), before the graph reads it there.
        self.amp.write_hyper(self.clip)?;
        if let Some(graph) = &self.graph {
            return graph.replay().map_err(graph_error);
        }
        if self.taken > self.warmup && self.refused.is_none() {
            let (amp, loss, clip) = (&mut self.amp, &self.loss, self.clip);
            match cuda_graph::capture(&self.device, || {
                one_step(amp, loss, clip, forward).map_err(candle_core::Error::wrap)
            }) {
                Ok(graph) => {
                    graph.replay().map_err(graph_error)?;
                    self.graph = Some(graph);
                    return Ok(());
                }
                Err(GraphError::Refused(why)) => self.refused = Some(why),
                Err(e) => return Err(graph_error(e)),
            }
        }
        let (amp, loss, clip) = (&mut self.amp, &self.loss, self.clip);
        cuda_graph::warm_up(&self.device, || one_step(amp, loss, clip, forward)).map_err(graph_error)?
    }

    /// Sets the learning rate of the next steps (a schedule's step; replays read it from the
    /// device).
    pub fn set_learning_rate(&mut self, rate: f64) {
        self.amp.set_learning_rate(rate);
    }

    /// The last step's loss (a host read: waits for the step).
    pub fn last_loss(&self) -> Result<f32, TrainError> {
        Ok(self.loss.to_vec1::<f32>()?.first().copied().unwrap_or(f32::NAN))
    }

    /// What the last step's update did (a host read).
    pub fn last_step(&self) -> Result<StepReport, TrainError> {
        self.amp.last_step()
    }

    /// The captured graph, once there is one.
    pub fn graph(&self) -> Option<&StepGraph> {
        self.graph.as_ref()
    }

    /// Why the step runs eagerly, when its capture was refused.
    pub fn refused(&self) -> Option<&str> {
        self.refused.as_deref()
    }

    /// The fused step it drives.
    pub fn amp(&self) -> &DeviceAmp {
        &self.amp
    }

    /// Puts the device's graph memory (the driver's graph pool, which holds the captured step's
    /// tensors outside wick's pool) in `engine`'s memory report as a line of its own, with the
    /// fused step's masters and state ([`DeviceAmp::account`]).
    pub fn account(&self, engine: &wick::Engine) -> Result<(), TrainError> {
        self.amp.account(engine);
        let memory = cuda_graph::graph_memory(&self.device).map_err(graph_error)?;
        engine.account(GRAPH_MEMORY, usize::try_from(memory.reserved).unwrap_or(usize::MAX));
        Ok(())
    }
}

/// Forward, backward and the fused update, the loss copied into `loss`: what is captured.
fn one_step(
    amp: &mut DeviceAmp,
    loss: &Tensor,
    clip: Option<f64>,
    forward: &dyn Fn() -> candle_core::Result<Tensor>,
) -> Result<(), TrainError> {
    let value = forward()?;
    loss.slice_set(&value.to_dtype(DType::F32)?.reshape(1)?, 0, 0)?;
    let grads = amp.scale_loss(&value)?.backward()?;
    drop(value);
    let unscaled = amp.unscale(&grads)?;
    drop(grads);
    amp.apply(unscaled, clip)
}
