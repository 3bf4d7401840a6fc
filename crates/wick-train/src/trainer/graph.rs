//! A [`super::Trainer`] whose steps run as CUDA graphs ([`super::TrainOptions::cuda_graph`]):
//! the fused device step (`crate::amp::device_step`) holds the f32 masters, the optimizer state
//! and the loss scaler on the device, and `crate::amp::graph_step` captures a step — every
//! micro-batch's forward and backward and the one update — after its warm-up and replays it with
//! each step's batch copied into the graph's own inputs. Checkpoints hold the same tensors as the
//! eager trainer's and resume either way; a resumed state is written into the memory the graph
//! reads, so a graph captured before stays valid.
//!
//! Data-parallel (replicated, on GPUs over NCCL: wick-train's `nccl` feature), the graph holds
//! the step's collectives too — rank 0's buffers broadcast at its start, each gradient bucket and
//! the loss all-reduced after the last backward — and nothing of the step is agreed on the host:
//! the ranks run the same model on batches of the same shapes (the run's setup check), so a
//! parameter with a gradient on one rank has one on all, and the summed gradients give every
//! rank the same skip and clipping decisions. The host waits for the replay's collectives with
//! NCCL's deadline (the communicator aborted past it) before reading what the step did. Joining
//! the group takes rank 0's masters, optimizer state and buffers into this rank's own tensors.
//!
//! A rank that fails inside a step leaves the others waiting in a collective of the graph until
//! NCCL's deadline (the eager data-parallel step agrees on failures through MPI first; a graph
//! cannot), and mpirun ends the job when that rank's process ends.
//!
//! Refused with the reason: a build without CUDA or a run on the CPU (at [`super::Trainer::new`]),
//! ZeRO's sharded stages (their step agrees on the host; stage 3's gathers make fresh tensors each step). A model whose batches are
//! not tensors alone ([`wick_nn::Model::batch_tensors`]) steps eagerly on the device path, saying
//! why.

use candle_core::{Tensor, Var};

#[cfg(feature = "cuda")]
use super::graph_dp::Dp;
use crate::amp::{MasterState, ScalerState, StepOutcome};
use crate::dist::parallel::Parallel;
use crate::error::TrainError;
use wick_nn::model::Model;

/// How a trainer runs its steps as CUDA graphs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GraphOptions {
    /// Eager steps of a batch shape before it is captured (at least one is run): they make
    /// everything the step keeps, choose cuDNN's algorithms and fill the upload cache a capture
    /// needs. PyTorch's examples warm up three.
    pub warmup: usize,
    /// Give each batch shape a graph of its own (each keeps its memory while the run lives)
    /// instead of running every shape but the first eagerly.
    pub recapture_per_shape: bool,
}

impl Default for GraphOptions {
    /// Three warm-up steps, one graph.
    fn default() -> Self {
        GraphOptions { warmup: 3, recapture_per_shape: false }
    }
}

/// The reason a sharded run does not take CUDA graphs.
pub(super) const NOT_SHARDED: &str = "CUDA graphs are refused for ZeRO's sharded stages: their step agrees on \
     the host every time (which parameters have gradients, an inf/NaN finding, clipping's norm; stage 3 gathers \
     its blocks into fresh tensors every step), which a captured step cannot hold — train replicated (ZeRO stage 0) \
     with --cuda-graph, or sharded without it";

fn refused(message: impl Into<String>) -> TrainError {
    super::invalid("CUDA graph", message.into())
}

/// The graph path of a trainer: the captured step and its device-resident state.
pub(super) struct GraphRun {
    #[cfg(feature = "cuda")]
    step: crate::amp::graph_step::GraphStep,
    #[cfg(not(feature = "cuda"))]
    never: std::convert::Infallible,
}

/// What a step of the graph path did.
pub(super) struct GraphOutcome {
    pub loss: f32,
    pub outcome: StepOutcome,
    pub grad_norm: Option<f64>,
}

#[cfg(not(feature = "cuda"))]
impl GraphRun {
    pub(super) fn new(
        _: &[Var],
        _: Option<&[Tensor]>,
        _: &super::TrainOptions,
        _: GraphOptions,
    ) -> Result<Self, TrainError> {
        Err(refused("this build of wick has no CUDA (build with the `cuda` feature)"))
    }

    pub(super) fn train_step<M: Model>(
        &mut self,
        _: &M,
        _: &[M::Batch],
        _: (bool, f64),
        _: Option<(&Parallel, &[Var])>,
    ) -> Result<GraphOutcome, TrainError> {
        match self.never {}
    }

    pub(super) fn join(&mut self, _: &Parallel) -> Result<(), TrainError> {
        match self.never {}
    }

    pub(super) fn state(&self) -> Result<MasterState, TrainError> {
        match self.never {}
    }

    pub(super) fn master(&self, _: usize) -> Option<&Tensor> {
        match self.never {}
    }

    pub(super) fn load_state(&mut self, _: &MasterState) -> Result<(), TrainError> {
        match self.never {}
    }

    pub(super) fn scaler_state(&self) -> Result<Option<ScalerState>, TrainError> {
        match self.never {}
    }

    pub(super) fn load_scaler_state(&mut self, _: ScalerState) -> Result<(), TrainError> {
        match self.never {}
    }

    pub(super) fn scales(&self) -> bool {
        match self.never {}
    }

    pub(super) fn memory_bytes(&self) -> (usize, usize) {
        match self.never {}
    }

    pub(super) fn account(&self, _: &wick::Engine) -> Result<(), TrainError> {
        match self.never {}
    }
}

#[cfg(feature = "cuda")]
impl GraphRun {
    /// The device state for `vars` (on a CUDA device), masters from `start` or the parameters,
    /// and the step that captures it.
    pub(super) fn new(
        vars: &[Var],
        start: Option<&[Tensor]>,
        options: &super::TrainOptions,
        graph: GraphOptions,
    ) -> Result<Self, TrainError> {
        use crate::amp::device_step::DeviceAmp;
        use crate::amp::graph_step::GraphStep;
        let device = vars.first().map(|v| v.device().clone()).ok_or_else(|| refused("the model has no parameters"))?;
        if !device.is_cuda() {
            return Err(refused(format!(
                "CUDA graphs need a model on a CUDA device, this one is on {:?}",
                device.location()
            )));
        }
        let scaler = options.autocast.needs_loss_scaling().then(crate::amp::GradScalerConfig::default);
        let amp = DeviceAmp::new(&device, vars, start, options.optimizer, scaler)?;
        let step = GraphStep::new(amp, &device, options.clip_grad_norm, graph.warmup)?
            .recapture_per_shape(graph.recapture_per_shape);
        Ok(GraphRun { step })
    }

    /// The captured step.
    pub(super) fn step(&self) -> &crate::amp::graph_step::GraphStep {
        &self.step
    }

    /// One step over `micro_batches` (activation checkpointing when `checkpointing`) at
    /// learning rate `lr`, data-parallel in `parallel` over `vars` when given, then one read of
    /// what it did.
    pub(super) fn train_step<M: Model>(
        &mut self,
        model: &M,
        micro_batches: &[M::Batch],
        (checkpointing, lr): (bool, f64),
        parallel: Option<(&Parallel, &[Var])>,
    ) -> Result<GraphOutcome, TrainError> {
        self.step.set_learning_rate(lr);
        let dp = match parallel {
            Some((p, vars)) => Some(Dp::new(p, vars, model.params())?),
            None => None,
        };
        let checkpointing = checkpointing.then(wick_nn::Checkpointing::new);
        let body = Body { model, micro_batches, checkpointing, dp };
        match micro_batches.iter().map(M::batch_tensors).collect::<Option<Vec<_>>>() {
            Some(tensors) => self.step.step_accumulated(&tensors, &body)?,
            None => {
                let none: Vec<&[Tensor]> = vec![&[]; micro_batches.len()];
                let why = "the model's batches are not tensors alone (Model::batch_tensors), so its steps run eagerly";
                self.step.run_eager(&none, &Given(&body), why.into())?
            }
        }
        if let Some(dp) = &body.dp {
            // The replay's collectives, waited for with NCCL's deadline before anything is read.
            dp.wait()?;
        }
        let report = self.step.last_step()?;
        if report.bad_norm {
            return Err(crate::clip::non_finite(report.norm.unwrap_or(f64::NAN)));
        }
        let loss = self.step.last_loss()?;
        let (outcome, grad_norm) = match report.skipped {
            true => (StepOutcome::Skipped, None),
            false => (StepOutcome::Applied, report.norm),
        };
        Ok(GraphOutcome { loss, outcome, grad_norm })
    }

    pub(super) fn state(&self) -> Result<MasterState, TrainError> {
        self.step.amp().state()
    }

    pub(super) fn master(&self, i: usize) -> Option<&Tensor> {
        self.step.amp().master(i)
    }

    /// Joining `parallel`: rank 0's masters and optimizer state into this rank's, over NCCL.
    pub(super) fn join(&mut self, parallel: &Parallel) -> Result<(), TrainError> {
        Dp::take_roots_state(parallel, self.step.amp_mut())
    }

    pub(super) fn load_state(&mut self, state: &MasterState) -> Result<(), TrainError> {
        self.step.amp_mut().load_state(state)
    }

    pub(super) fn scaler_state(&self) -> Result<Option<ScalerState>, TrainError> {
        self.step.amp().scaler_state()
    }

    pub(super) fn load_scaler_state(&mut self, state: ScalerState) -> Result<(), TrainError> {
        self.step.amp_mut().load_scaler_state(state)
    }

    pub(super) fn scales(&self) -> bool {
        self.step.amp().scales()
    }

    pub(super) fn memory_bytes(&self) -> (usize, usize) {
        self.step.amp().memory_bytes()
    }

    pub(super) fn account(&self, engine: &wick::Engine) -> Result<(), TrainError> {
        self.step.account(engine)
    }
}

/// A trainer's micro-batches as a captured step's body: each micro-batch's loss on the step's
/// own inputs, checkpointing's backward where the run checkpoints, and a data-parallel run's
/// collectives.
#[cfg(feature = "cuda")]
struct Body<'a, M: Model> {
    model: &'a M,
    micro_batches: &'a [M::Batch],
    checkpointing: Option<wick_nn::Checkpointing>,
    dp: Option<Dp<'a>>,
}

#[cfg(feature = "cuda")]
impl<M: Model> crate::amp::graph_step::StepBody for Body<'_, M> {
    fn loss(&self, k: usize, inputs: &[Tensor]) -> candle_core::Result<Tensor> {
        let given = self.micro_batches.get(k).ok_or_else(|| candle_core::Error::Msg(format!("no micro-batch {k}")))?;
        let batch = M::batch_with(given, inputs).map_err(wick_nn::to_candle)?;
        self.model.loss_with(&batch, self.checkpointing.as_ref()).map_err(wick_nn::to_candle)
    }

    fn backward(&self, loss: &Tensor) -> candle_core::Result<candle_core::backprop::GradStore> {
        match &self.checkpointing {
            Some(c) => c.backward(loss, self.model.params()),
            None => loss.backward(),
        }
    }

    fn begin(&self) -> candle_core::Result<()> {
        self.dp.as_ref().map_or(Ok(()), Dp::begin)
    }

    fn ranks(&self) -> usize {
        self.dp.as_ref().map_or(1, Dp::ranks)
    }

    fn reduce(&self, grads: &mut candle_core::backprop::GradStore, loss: &Tensor) -> candle_core::Result<()> {
        self.dp.as_ref().map_or(Ok(()), |dp| dp.reduce(grads, loss))
    }
}

/// A body run on the micro-batches as given (not on inputs of the step's own).
#[cfg(feature = "cuda")]
struct Given<'b, 'a, M: Model>(&'b Body<'a, M>);

#[cfg(feature = "cuda")]
impl<M: Model> crate::amp::graph_step::StepBody for Given<'_, '_, M> {
    fn loss(&self, k: usize, _: &[Tensor]) -> candle_core::Result<Tensor> {
        let batch =
            self.0.micro_batches.get(k).ok_or_else(|| candle_core::Error::Msg(format!("no micro-batch {k}")))?;
        self.0.model.loss_with(batch, self.0.checkpointing.as_ref()).map_err(wick_nn::to_candle)
    }

    fn backward(&self, loss: &Tensor) -> candle_core::Result<candle_core::backprop::GradStore> {
        self.0.backward(loss)
    }

    fn begin(&self) -> candle_core::Result<()> {
        self.0.begin()
    }

    fn ranks(&self) -> usize {
        self.0.ranks()
    }

    fn reduce(&self, grads: &mut candle_core::backprop::GradStore, loss: &Tensor) -> candle_core::Result<()> {
        self.0.reduce(grads, loss)
    }
}
