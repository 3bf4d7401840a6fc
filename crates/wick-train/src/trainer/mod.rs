//! Training runs that can stop and continue: a [`Trainer`] over any zoo [`Model`] (f32 or mixed
//! precision with f32 masters and the loss scaler, a learning-rate schedule, gradient
//! accumulation, activation checkpointing) whose whole state — f32 masters (the parameters),
//! the model's buffers (batch norm's running statistics), optimizer state, loss-scaler state,
//! the step and the run's data position — is saved as a
//! training checkpoint ([`crate::checkpoint`]) and restored exactly: on the CPU a resumed run takes the same
//! steps, to the bit, as one that was never interrupted (the kernels sum in a fixed order).
//! Saving is in `save`, reading a checkpoint back in `resume`; steps run as CUDA graphs
//! ([`TrainOptions::cuda_graph`]) in `graph`.
//!
//! ```
//! use candle_core::{DType, Device, Tensor};
//! use wick_zoo::llama::{Llama, LlamaConfig};
//! use wick_train::trainer::{TrainOptions, Trainer};
//! use wick_train::CheckpointDir;
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let dir = std::env::temp_dir().join(format!("wick-doc-train-{}", std::process::id()));
//! let config = LlamaConfig::tiny(16);
//! let describe = serde_json::json!({"kind": "llama", "config": config});
//! let ids = Tensor::new(&[[1u32, 2, 3, 4, 5, 6]], &Device::Cpu)?;
//! let model = Llama::new(config, DType::F32, &Device::Cpu)?;
//! let mut trainer = Trainer::new(model, describe.clone(), None, TrainOptions::default())?;
//! trainer.train_step(std::slice::from_ref(&ids))?;
//! let checkpoints = CheckpointDir::new(&dir, 2)?;
//! trainer.save(&checkpoints, serde_json::json!({"position": 1}))?;
//!
//! // Later, in another process: the same model, built the same way, continues from step 1.
//! let model = Llama::new(config, DType::F32, &Device::Cpu)?;
//! let mut again = Trainer::new(model, describe, None, TrainOptions::default())?;
//! let resumed = again.resume(&checkpoints)?;
//! assert_eq!((resumed.step, again.step()), (1, 1));
//! # std::fs::remove_dir_all(&dir)?;
//! # Ok(())
//! # }
//! ```

use std::path::PathBuf;
use wick::memory::push_label;

use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor, Var};

use crate::checkpoint::ParamInfo;

use crate::amp::{GradScaler, MasterWeights, ScalerState, StepOutcome};
use crate::dist::buckets::ReduceStats;
use crate::dist::flight::Flight;
use crate::dist::parallel::{broadcast_buffers, Parallel};
use crate::dist::{DataParallelOptions, ProcessGroup, Sharding};
use crate::error::TrainError;
use crate::optim::{AdamW, LrSchedule, Optimizer};
use wick_nn::checkpoint::Checkpointing;
use wick_nn::model::Model;
use wick_nn::Autocast;

mod graph;
#[cfg(feature = "cuda")]
mod graph_dp;
mod resume;
mod save;

pub use graph::GraphOptions;
use graph::GraphRun;
pub use save::PendingSave;

/// What a [`Trainer`] does each step.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TrainOptions {
    /// The update rule and its (base) learning rate.
    pub optimizer: Optimizer,
    /// The learning-rate schedule.
    pub schedule: LrSchedule,
    /// Mixed precision: must match the dtype the model was built in (the loss scaler runs for
    /// f16).
    pub autocast: Autocast,
    /// Recompute each block in backward instead of keeping its activations.
    pub activation_checkpointing: bool,
    /// Clip the gradients to this total 2-norm before each update (PyTorch's
    /// `clip_grad_norm_(params, max_norm)` between `backward` and `step`; see [`crate::clip`]).
    pub clip_grad_norm: Option<f64>,
    /// Run each step as a CUDA graph after a few eager ones (a model on a CUDA device, built
    /// with the `cuda` feature; refused otherwise, and with ZeRO's sharded stages; data-parallel
    /// replicated on GPUs over NCCL, the collectives inside the graph): the masters,
    /// the optimizer state and the loss scaler then live on the device
    /// (`crate::amp::device_step`), and [`Trainer::masters`] is empty.
    pub cuda_graph: Option<GraphOptions>,
}

impl Default for TrainOptions {
    /// AdamW (lr 1e-3, β 0.9/0.999, ε 1e-8, no decay), constant rate, f32, no checkpointing, no
    /// clipping, eager steps.
    fn default() -> Self {
        TrainOptions {
            optimizer: Optimizer::AdamW(AdamW { lr: 1e-3, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.0 }),
            schedule: LrSchedule::Constant,
            autocast: Autocast::off(),
            activation_checkpointing: false,
            clip_grad_norm: None,
            cuda_graph: None,
        }
    }
}

/// One training step's outcome.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepRecord {
    /// The step number (1 for the first).
    pub step: u64,
    /// The mean loss over the step's micro-batches.
    pub loss: f32,
    /// The learning rate the update used.
    pub lr: f64,
    /// Whether the update ran (skipped when the loss scaler found inf/NaN gradients).
    pub outcome: StepOutcome,
    /// With [`TrainOptions::clip_grad_norm`], the gradients' total norm before clipping (what
    /// PyTorch's `clip_grad_norm_` returns); none for a skipped step or without clipping.
    pub grad_norm: Option<f64>,
}

/// Where [`Trainer::resume`] continued from.
#[derive(Debug, Clone)]
pub struct Resumed {
    /// The step the run continues after.
    pub step: u64,
    /// The run's own data saved with it (e.g. its data loader's position).
    pub data: serde_json::Value,
    /// The manifest that was loaded.
    pub manifest: PathBuf,
    /// Newer checkpoints that were damaged and passed over, with why.
    pub skipped: Vec<String>,
}

/// A training run over `M`: the model, its f32 masters and optimizer state, the loss scaler
/// (f16), and the step count.
pub struct Trainer<M: Model> {
    model: M,
    description: serde_json::Value,
    vars: Vec<Var>,
    masters: MasterWeights,
    scaler: Option<GradScaler>,
    options: TrainOptions,
    base_lr: f64,
    step: u64,
    parallel: Option<Parallel>,
    /// The steps as CUDA graphs, holding the masters, state and scaler on the device.
    graph: Option<Box<GraphRun>>,
}

fn invalid(what: &str, message: String) -> TrainError {
    TrainError::Invalid { what: what.into(), message }
}

fn dtype_name(dtype: DType) -> String {
    format!("{dtype:?}").to_lowercase()
}

impl<M: Model> Trainer<M> {
    /// A run of `model`, described by `description` (what it is — kind and configuration — as
    /// the checkpoints record it and a resume compares it), with f32 masters starting at `start`
    /// (the f32 values of a low-precision model's parameters; see
    /// [`MasterWeights::with_masters`]) or at the parameters.
    pub fn new(
        model: M,
        description: serde_json::Value,
        start: Option<&[Tensor]>,
        options: TrainOptions,
    ) -> Result<Self, TrainError> {
        let vars = model.vars();
        let Some(graph) = options.cuda_graph else {
            let masters = MasterWeights::with_masters(&vars, start, options.optimizer)?;
            return Ok(Self::assemble(model, description, vars, masters, options));
        };
        // The device step holds the masters, the state and the scale.
        let run = GraphRun::new(&vars, start, &options, graph)?;
        let mut trainer =
            Self::assemble(model, description, vars, MasterWeights::new(&[], options.optimizer)?, options);
        trainer.scaler = None;
        trainer.graph = Some(Box::new(run));
        Ok(trainer)
    }

    /// A run at step 0 alone, holding `masters`.
    fn assemble(
        model: M,
        description: serde_json::Value,
        vars: Vec<Var>,
        masters: MasterWeights,
        options: TrainOptions,
    ) -> Self {
        Trainer {
            model,
            description,
            vars,
            masters,
            scaler: options.autocast.needs_loss_scaling().then(GradScaler::new),
            base_lr: options.optimizer.lr(),
            options,
            step: 0,
            parallel: None,
            graph: None,
        }
    }

    /// The model. Under ZeRO-3 the parameters its blocks take live only as shards once the run
    /// has stepped, and the model's own copies of them read as zeros: read the values with
    /// [`Trainer::gathered_parameters`].
    pub fn model(&self) -> &M {
        &self.model
    }

    /// The masters and optimizer state (empty when a data-parallel run shards them, see
    /// [`Trainer::optimizer_bytes`], and when steps run as CUDA graphs: [`Trainer::master`] reads
    /// the masters wherever they live).
    pub fn masters(&self) -> &MasterWeights {
        &self.masters
    }

    /// Steps taken.
    pub fn step(&self) -> u64 {
        self.step
    }

    /// The `i`-th parameter's f32 master, wherever it lives (the device step's, when steps run as
    /// CUDA graphs); none past the last, or when a data-parallel run shards the masters.
    pub fn master(&self, i: usize) -> Option<&Tensor> {
        match &self.graph {
            Some(g) => g.master(i),
            None => self.masters.master(i),
        }
    }

    /// A copy of the masters, the optimizer state and its step count, wherever they live (the
    /// device's, when steps run as CUDA graphs): what a checkpoint saves. Empty when a
    /// data-parallel run shards them.
    pub fn master_state(&self) -> Result<crate::amp::MasterState, TrainError> {
        match &self.graph {
            Some(g) => g.state(),
            None => Ok(self.masters.state()?),
        }
    }

    /// The captured step, when steps run as CUDA graphs: its graphs, why a step ran eagerly,
    /// what the last update did.
    #[cfg(feature = "cuda")]
    pub fn graph_step(&self) -> Option<&crate::amp::graph_step::GraphStep> {
        self.graph.as_ref().map(|g| g.step())
    }

    /// True when the loss is scaled (f16).
    fn scales(&self) -> bool {
        self.scaler.is_some() || self.graph.as_ref().is_some_and(|g| g.scales())
    }

    /// The loss scaler's state, wherever it lives.
    fn scaler_state(&self) -> Result<Option<ScalerState>, TrainError> {
        match &self.graph {
            Some(g) => g.scaler_state(),
            None => Ok(self.scaler.as_ref().map(GradScaler::state)),
        }
    }

    /// Trains data-parallel in `group` from now on: each rank's micro-batches are its share of
    /// the step, gradients are summed over ranks (buckets of `options.bucket_bytes`), and every
    /// rank applies the same update — or, sharded ([`crate::dist::Sharding`]), its shard of it.
    ///
    /// Refused on every rank, naming the field, unless every rank runs the same model,
    /// parameters, buffers, options, step and scaler state. Then rank 0's masters, optimizer
    /// state and buffers become every rank's (resume, if at all, before this). Sharded, each
    /// rank keeps only its shard of masters and state ([`Trainer::masters`] is then empty).
    ///
    /// With CUDA graphs ([`TrainOptions::cuda_graph`]: replicated, on GPUs over NCCL) the
    /// step's collectives are in its graph and rank 0's state is taken into the step's own
    /// tensors; ZeRO's sharded stages are refused with the reason.
    pub fn data_parallel(mut self, group: ProcessGroup, options: DataParallelOptions) -> Result<Self, TrainError> {
        let setup = self.setup()?;
        if let Some(g) = self.graph.as_mut() {
            if options.sharding != Sharding::None {
                return Err(invalid("CUDA graph", graph::NOT_SHARDED.into()));
            }
            let parallel = Parallel::start_graph(group, options, setup, &self.vars, self.model.params())?;
            g.join(&parallel)?;
            self.parallel = Some(parallel);
            return Ok(self);
        }
        let parallel = Parallel::start(group, options, setup, &self.vars, &mut self.masters, self.model.params())?;
        self.parallel = Some(parallel);
        Ok(self)
    }

    /// A run of `model` that trains data-parallel in `group` from the start: as
    /// [`Trainer::new`] followed by [`Trainer::data_parallel`], except that a sharded run
    /// ([`crate::dist::Sharding`]) never holds the whole optimizer state, nor the whole f32
    /// masters of a low-precision model — each rank keeps only its shard of rank 0's parameters
    /// (or `start`), broadcast one at a time, and makes its shard of the optimizer state at the
    /// first update. A model whose optimizer state fits only
    /// when sharded starts this way. Resume after it ([`Trainer::resume`]: each rank then reads
    /// only its share).
    pub fn new_data_parallel(
        model: M,
        description: serde_json::Value,
        start: Option<&[Tensor]>,
        options: TrainOptions,
        group: ProcessGroup,
        parallel: DataParallelOptions,
    ) -> Result<Self, TrainError> {
        if options.cuda_graph.is_some() && parallel.sharding != Sharding::None {
            return Err(invalid("CUDA graph", graph::NOT_SHARDED.into()));
        }
        if parallel.sharding == Sharding::None {
            return Self::new(model, description, start, options)?.data_parallel(group, parallel);
        }
        let vars = model.vars();
        if let Some(s) = start {
            crate::amp::check_masters(&vars, s)?;
        }
        // The masters and state are the shards `Parallel::start_sharded` makes.
        let masters = MasterWeights::new(&[], options.optimizer)?;
        let mut trainer = Self::assemble(model, description, vars, masters, options);
        let setup = trainer.setup()?;
        let params = trainer.model.params();
        let p = Parallel::start_sharded(group, parallel, setup, &trainer.vars, start, options.optimizer, params)?;
        trainer.parallel = Some(p);
        Ok(trainer)
    }

    /// What every rank of a process group must agree on to train together.
    fn setup(&self) -> Result<serde_json::Value, TrainError> {
        Ok(serde_json::json!({
            "model": self.description,
            "params": self.param_infos(),
            "buffers": self.buffer_infos(),
            "options": format!("{:?}", self.options),
            "step": self.step,
            "scaler": self.scaler_state()?,
        }))
    }

    /// This rank's bytes of f32 masters and of optimizer state (its shard when sharded): the
    /// shards of all ranks add up to one process's figures exactly (padding holds no state).
    pub fn optimizer_bytes(&self) -> (usize, usize) {
        if let Some(g) = &self.graph {
            return g.memory_bytes();
        }
        self.parallel.as_ref().and_then(Parallel::shard_bytes).unwrap_or_else(|| self.masters.memory_bytes())
    }

    /// Puts what the run holds in `engine`'s memory summary: the parameters, the f32 masters
    /// and the optimizer state (this rank's shard when sharded), and under a process group the
    /// gradient buckets (the reduced gradients live in them).
    ///
    /// Under ZeRO-3, the parameters the model still holds (those read outside the blocks) and
    /// this rank's f32 pieces of the blocks' f32 parameters, in place of the buckets it does not
    /// use. With CUDA graphs, the graphs' memory (the driver's graph pool) as a line of its own,
    /// when the driver reports it.
    pub fn account(&self, engine: &wick::Engine) {
        if let Some(g) = &self.graph {
            // Without the driver's figure the line is left out; the rest is already accounted.
            let _ = g.account(engine);
            return;
        }
        let (master, state) = self.optimizer_bytes();
        let shards = self.parallel.as_ref().and_then(Parallel::param_shards);
        let released = |i: usize| shards.is_some_and(|s| s.released(i));
        let held = self.vars.iter().enumerate().filter(|(i, _)| !released(*i)).map(|(_, v)| v);
        crate::amp::account_holdings(engine, held, master, &self.options.optimizer, state);
        if let Some(p) = &self.parallel {
            let ranks = format!("{} of {} ranks", p.group.rank(), p.group.world_size());
            match shards {
                Some(s) => engine.account(&format!("parameter pieces (ZeRO-3, f32, {ranks})"), s.block_piece_bytes()),
                None => engine.account(&format!("gradient buckets (f32, {ranks})"), p.bucket_bytes()),
            }
        }
    }

    /// Every parameter's current value, whole, by name: the model's own tensors, or under ZeRO-3
    /// (where the blocks' parameters live only as shards and the model's copies read as zeros)
    /// gathered from every rank, one parameter at a time — a collective: every rank calls it.
    pub fn gathered_parameters(&self) -> Result<Vec<(String, Tensor)>, TrainError> {
        let names = self.model.params().iter().map(|(n, _)| n.clone());
        let values = match self.parallel.as_ref().and_then(Parallel::param_shards) {
            Some(shards) => shards.gather_all()?,
            None => self.vars.iter().map(|v| v.as_tensor().detach()).collect(),
        };
        Ok(names.zip(values).collect())
    }

    /// The process group the run trains in (`None`: alone).
    pub fn group(&self) -> Option<&ProcessGroup> {
        self.parallel.as_ref().map(|p| &p.group)
    }

    /// What the last step's gradient reduction did (buckets, bytes, seconds communicating).
    pub fn last_reduce(&self) -> Option<ReduceStats> {
        self.parallel.as_ref().map(|p| p.last)
    }

    /// A data-parallel trainer's gradient buckets: each one's parameters (positions in the
    /// model's `params().iter()`), in the order they are reduced (see `dist::buckets`).
    pub fn gradient_buckets(&self) -> Option<&[Vec<usize>]> {
        self.parallel.as_ref().map(|p| p.buckets.plan())
    }

    /// One step over `micro_batches` (gradient accumulation: each micro-batch's loss counts
    /// `1/n`, the gradients are summed in order, then one update). Data-parallel, every rank
    /// passes its own `n` micro-batches and each counts `1/(n × world size)`: two ranks with one
    /// micro-batch each take the same step, to the bit, as one process with both. A failure on
    /// any rank stops the step on every rank before anything is applied.
    pub fn train_step(&mut self, micro_batches: &[M::Batch]) -> Result<StepRecord, TrainError> {
        if micro_batches.is_empty() {
            return Err(invalid("train step", "no micro-batches".into()));
        }
        if let Some(max_norm) = self.options.clip_grad_norm {
            crate::clip::check_max_norm(max_norm)?;
        }
        let world = self.parallel.as_ref().map_or(1, |p| p.group.world_size());
        let n = micro_batches.len() as f64 * world as f64;
        // What is allocated is recorded under the step and its phase (a history names them).
        let _step = push_label("train_step");
        if let Some(g) = self.graph.as_mut() {
            let lr = self.base_lr * self.options.schedule.factor(self.step);
            let parallel = self.parallel.as_ref().map(|p| (p, self.vars.as_slice()));
            let done =
                g.train_step(&self.model, micro_batches, (self.options.activation_checkpointing, lr), parallel)?;
            self.step += 1;
            let (loss, outcome, grad_norm) = (done.loss, done.outcome, done.grad_norm);
            return Ok(StepRecord { step: self.step, loss, lr, outcome, grad_norm });
        }
        if let Some(p) = &self.parallel {
            broadcast_buffers(&p.group, self.model.params())?;
            if let Some(shards) = p.param_shards() {
                shards.begin_step()?;
            }
        }
        let mut flight = match &self.parallel {
            Some(p) => p.flight(&self.vars)?,
            None => None,
        };
        let mut local = self.accumulate(micro_batches, n, flight.as_mut());
        if let (Some(p), Some(f)) = (&self.parallel, flight.as_mut()) {
            // Every bucket is started before the step's agreement, whatever happened here: the
            // other ranks' buckets are in flight, and collectives must match in order.
            if let Err(e) = f.close(p.group.comm(), local.as_mut().ok().map(|(g, _)| g)) {
                eprintln!(
                    "rank {}: {e}; the other ranks' reductions cannot be matched, so the job ends here",
                    p.group.rank()
                );
                p.group.abort(1);
            }
        }
        if let (Some(p), Err(e)) = (&self.parallel, &local) {
            if p.param_shards().is_some() && world > 1 {
                // Under ZeRO-3 the other ranks are inside a block's collective that this rank
                // will not reach: nothing can be agreed, and the job ends naming this rank (the
                // newest checkpoint resumes it).
                eprintln!(
                    "rank {}: {e}; under ZeRO-3 the other ranks wait inside a collective of the step, so the job \
                     ends here",
                    p.group.rank()
                );
                p.group.abort(1);
            }
        }
        let (mut grads, loss_sum) = match &self.parallel {
            Some(p) => {
                let (grads, loss) = match p.agree(local) {
                    Ok(v) => v,
                    Err(e) => {
                        // The step is off on every rank: its reductions complete and are dropped.
                        if let Some(f) = flight.take() {
                            let _ = f.finish(p.group.comm());
                        }
                        return Err(e);
                    }
                };
                (grads, p.group.sum_f64(&[loss])?[0])
            }
            None => local?,
        };
        let _optimizer = push_label("optimizer");
        let lr = self.base_lr * self.options.schedule.factor(self.step);
        let clip = self.options.clip_grad_norm;
        let (outcome, grad_norm) = match self.parallel.as_mut() {
            Some(p) => {
                let scaling = (self.scaler.as_mut(), clip);
                p.update(&mut grads, flight, &self.vars, &mut self.masters, scaling, lr)?
            }
            None => {
                self.masters.set_learning_rate(lr);
                let refs: Vec<&Var> = self.vars.iter().collect();
                crate::clip::clipped_master_step(&mut grads, &mut self.masters, self.scaler.as_mut(), &refs, clip)?
            }
        };
        self.step += 1;
        Ok(StepRecord { step: self.step, loss: (loss_sum / n) as f32, lr, outcome, grad_norm })
    }

    /// This rank's forward and backward passes over `micro_batches`, each loss divided by `n`:
    /// the summed gradients and the summed (undivided) losses. With `flight`, the last backward
    /// pass hands each completed gradient to it (added to the earlier micro-batches' sum there)
    /// and the store returned holds what it did not take.
    fn accumulate(
        &self,
        micro_batches: &[M::Batch],
        n: f64,
        mut flight: Option<&mut Flight>,
    ) -> Result<(GradStore, f64), TrainError> {
        // The losses are read back once, after every backward pass: on a GPU each read waits for
        // the device, and one read a micro-batch stalled the host between them.
        let (mut total, mut losses) = (None::<GradStore>, Vec::with_capacity(micro_batches.len()));
        let shards = self.parallel.as_ref().and_then(Parallel::param_shards);
        for (k, batch) in micro_batches.iter().enumerate() {
            let ckpt = match shards {
                // ZeRO-3: every block takes its parameters from the shards.
                Some(s) => Some(Checkpointing::sharded(crate::dist::zero3::blocks(s))),
                None => self.options.activation_checkpointing.then(Checkpointing::new),
            };
            let forward = push_label("forward");
            let loss = self.model.loss_with(batch, ckpt.as_ref())?;
            losses.push(loss.detach());
            let mut loss = if n > 1.0 { (loss / n)? } else { loss };
            if let Some(s) = &self.scaler {
                loss = s.scale_loss(&loss)?;
            }
            drop(forward);
            let _backward = push_label("backward");
            if let (Some(f), Some(p), true) = (flight.as_deref_mut(), &self.parallel, k + 1 == micro_batches.len()) {
                f.set_previous(total.take());
                let comm = p.group.comm();
                let mut ready =
                    |var: &Tensor, store: &mut GradStore| f.ready(comm, var, store).map_err(candle_core::Error::wrap);
                total = Some(match &ckpt {
                    Some(c) => c.backward_with_hook(&loss, self.model.params(), &mut ready)?,
                    None => loss.backward_with_hook(&mut ready)?,
                });
                continue;
            }
            let grads = match &ckpt {
                Some(c) => c.backward(&loss, self.model.params())?,
                None => loss.backward()?,
            };
            total = Some(crate::amp::add_grads(total, grads, &self.vars)?);
        }
        let grads = total.ok_or_else(|| invalid("train step", "no gradients".into()))?;
        let losses = Tensor::stack(&losses, 0)?.to_dtype(DType::F64)?.to_vec1::<f64>()?;
        Ok((grads, losses.iter().sum()))
    }

    /// The parameters as a manifest records them.
    pub fn param_infos(&self) -> Vec<ParamInfo> {
        self.model
            .params()
            .iter()
            .map(|(name, v)| ParamInfo { name: name.clone(), shape: v.dims().to_vec(), dtype: dtype_name(v.dtype()) })
            .collect()
    }

    /// The buffers as a manifest records them.
    pub fn buffer_infos(&self) -> Vec<ParamInfo> {
        self.model
            .params()
            .buffers()
            .map(|(name, b)| {
                let t = b.get();
                ParamInfo { name: name.clone(), shape: t.dims().to_vec(), dtype: dtype_name(t.dtype()) }
            })
            .collect()
    }
}
