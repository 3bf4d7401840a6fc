//! What a [`crate::Trainer`] holds when it trains data-parallel: the group, the gradient
//! buckets, the sharded optimizer (ZeRO) when the state is sharded, and the steps every rank
//! takes together — the start-up check that all ranks run the same thing, rank 0's state
//! broadcast to all, the agreement on a step that failed on any rank, the buffers each step
//! starts from.

use std::sync::Arc;

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor, Var};
use wick_nn::params::Params;

use super::buckets::{GradBuckets, ReduceStats, BUCKET_BYTES, FIRST_BUCKET_BYTES};
use super::error::DistError;
use super::flight::Flight;
use super::group::to_bytes;
use super::zero::{PieceInit, PieceRequest, Stepped, ZeroOptimizer};
use super::zero3::{ParamShards, TensorCollectives};
use super::{GpuComm, ProcessGroup, Sharding};
use crate::amp::{GradScaler, MasterState, MasterWeights};
use crate::checkpoint::CheckpointReader;
use crate::error::TrainError;
use crate::optim::Optimizer;

/// Data-parallel settings.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DataParallelOptions {
    /// What is sharded.
    pub sharding: Sharding,
    /// The gradient bucket cap in bytes (PyTorch's 25 MiB).
    pub bucket_bytes: usize,
    /// The first bucket's cap (PyTorch's 1 MiB), and the last one's (see [`super::buckets`]).
    pub first_bucket_bytes: usize,
    /// Start each bucket's reduction from inside backward, as its last gradient completes
    /// (host parameters at stages 0–2; stage 3 reduces each block as its backward ends).
    /// Off: every bucket is reduced after backward.
    pub overlap: bool,
    /// ZeRO stage 3: start the next block's gather (in the last step's order) as soon as the
    /// current block's is done, so that it moves on while the block computes — FSDP's forward
    /// and backward prefetch. Holds one more block's parameters whole; off by default (see
    /// BENCHMARKS.md "Prefetch": on two host ranks it measured no faster). Host ranks only: GPU
    /// ranks refuse it (their gathers run on the compute stream).
    pub prefetch: bool,
    /// ZeRO stage 3: recompute each block in backward (activation checkpointing, the default:
    /// only a block's input is kept, and its gathered parameters are dropped after its forward
    /// pass). Off: the blocks keep their activations as FSDP without checkpointing does — one
    /// forward pass per block fewer, every block's activations held — while each block's
    /// gathered parameters still give their memory back after its forward pass and are gathered
    /// again, into the same tensors, when backward reaches it.
    pub recompute: bool,
    /// ZeRO stage 3 on host ranks: take the tensor path GPU ranks take (the shard's pieces and
    /// gradients as tensors, the process group's tensor collectives, nothing in flight) instead
    /// of the host path (byte buffers, MPI's non-blocking collectives). It is there so that the
    /// GPU ranks' layouts and arithmetic run at two ranks where there are no GPUs
    /// (`tests/multi_rank.rs`); on two host ranks it measured 0.95–1.07× the host path's step
    /// time with a heap peak within −10…+2 % of its (BENCHMARKS.md). GPU ranks always take it.
    /// Off by default.
    pub tensor_path: bool,
}

impl Default for DataParallelOptions {
    fn default() -> Self {
        DataParallelOptions {
            sharding: Sharding::None,
            bucket_bytes: BUCKET_BYTES,
            first_bucket_bytes: FIRST_BUCKET_BYTES,
            overlap: true,
            prefetch: false,
            recompute: true,
            tensor_path: false,
        }
    }
}

/// A rank's shard of a sharded run (on the host, or on GPU ranks over NCCL): masters and
/// optimizer state (stages 1 and 2), or every parameter (stage 3).
pub(crate) enum Shard {
    Zero(ZeroOptimizer),
    Params(Arc<ParamShards>),
}

impl Shard {
    /// This rank's shard for `stage` from what `fetch` gives per parameter piece, with
    /// `optimizer` after `steps` steps; stage 3 over NCCL when the parameters are on GPUs (`gpu`),
    /// or over the group's tensor collectives on host ranks asking for the tensor path.
    fn new(
        group: &ProcessGroup,
        (gpu, tensor_path): (Option<&Arc<GpuComm>>, bool),
        vars: &[Var],
        plan: &[Vec<usize>],
        stage: Sharding,
        (optimizer, steps): (Optimizer, u64),
        fetch: &mut dyn FnMut(&PieceRequest) -> Result<PieceInit, TrainError>,
    ) -> Result<Self, TrainError> {
        Ok(match stage {
            Sharding::Parameters => {
                // GPU ranks over NCCL; host ranks over the group's tensor collectives on request.
                let tensors: Option<Arc<dyn TensorCollectives>> = match gpu {
                    Some(g) => Some(g.clone()),
                    None if tensor_path => Some(Arc::new(group.clone())),
                    None => None,
                };
                Shard::Params(Arc::new(ParamShards::new(group, tensors, vars, optimizer, steps, fetch)?))
            }
            _ => Shard::Zero(ZeroOptimizer::new(group, vars, plan, stage, optimizer, steps, fetch)?),
        })
    }

    /// The same shard, with stage 3's block options ([`DataParallelOptions::prefetch`],
    /// [`DataParallelOptions::recompute`]).
    fn blocks(self, prefetch: bool, recompute: bool) -> Self {
        if let Shard::Params(p) = &self {
            p.set_prefetch(prefetch);
            p.set_recompute(recompute);
        }
        self
    }
}

/// A trainer's data-parallel state.
pub(crate) struct Parallel {
    pub(crate) group: ProcessGroup,
    pub(crate) buckets: GradBuckets,
    zero: Option<Shard>,
    /// NCCL, when the parameters are on a GPU (shared with stage 3's shards).
    gpu: Option<Arc<GpuComm>>,
    pub(crate) last: ReduceStats,
    overlap: bool,
    /// Stage 3's prefetch ([`DataParallelOptions::prefetch`]).
    prefetch: bool,
    /// Stage 3's recomputation ([`DataParallelOptions::recompute`]).
    recompute: bool,
    /// Stage 3's tensor path on host ranks ([`DataParallelOptions::tensor_path`]).
    tensor_path: bool,
}

/// NCCL for `vars` when they are on a GPU (every stage), `None` for host parameters.
fn gpu_comm(group: &ProcessGroup, vars: &[Var]) -> Result<Option<Arc<GpuComm>>, TrainError> {
    let Some(device) = vars.iter().map(|v| v.device()).find(|d| d.is_cuda()) else { return Ok(None) };
    #[cfg(feature = "nccl")]
    return Ok(Some(Arc::new(super::nccl::NcclGroup::new(group, device)?)));
    #[cfg(not(feature = "nccl"))]
    {
        let _ = (group, device);
        Err(DistError::unsupported("data parallel", "GPU parameters need wick-train's `nccl` feature").into())
    }
}

impl Parallel {
    /// The group and the buckets, once `setup` (the model, its parameters and the training
    /// options) and `options` are the same on every rank (refused on every rank, naming the
    /// field, when not).
    fn prepare(
        group: &ProcessGroup,
        options: DataParallelOptions,
        setup: serde_json::Value,
        vars: &[Var],
        params: &Params,
    ) -> Result<(GradBuckets, Option<Arc<GpuComm>>), TrainError> {
        if options.bucket_bytes == 0 || options.first_bucket_bytes == 0 {
            return Err(DistError::unsupported("data parallel", "bucket caps must be positive").into());
        }
        let setup = serde_json::json!({
            "setup": setup,
            "sharding": options.sharding,
            "bucket_bytes": options.bucket_bytes,
            "first_bucket_bytes": options.first_bucket_bytes,
            "overlap": options.overlap,
            "prefetch": options.prefetch,
            "recompute": options.recompute,
            "tensor_path": options.tensor_path,
        });
        group.check_same("training setup", &setup)?;
        let gpu = gpu_comm(group, vars)?;
        if (gpu.is_some() || options.tensor_path) && options.sharding == Sharding::Parameters && options.prefetch {
            let message = "stage 3's prefetch overlaps MPI gathers on the host path; GPU ranks (and the tensor \
                           path) gather on the compute stream (turn prefetch off)";
            return Err(DistError::unsupported("data parallel", message).into());
        }
        let registered = params.registration_order();
        Ok((GradBuckets::new(vars, &registered, options.first_bucket_bytes, options.bucket_bytes), gpu))
    }

    /// The state of a run that joined: the group, its buckets, this rank's shard when sharded,
    /// NCCL for GPU parameters, and the options' overlap and stage-3 settings.
    fn assembled(
        group: ProcessGroup,
        buckets: GradBuckets,
        zero: Option<Shard>,
        gpu: Option<Arc<GpuComm>>,
        options: DataParallelOptions,
    ) -> Self {
        Parallel {
            group,
            buckets,
            zero,
            gpu,
            last: ReduceStats::default(),
            overlap: options.overlap,
            prefetch: options.prefetch,
            recompute: options.recompute,
            tensor_path: options.tensor_path,
        }
    }

    /// Joins the group with the whole state in `masters`: refuses unless `setup` is the same on
    /// every rank, then takes rank 0's masters, optimizer state and buffers everywhere; with
    /// sharding, keeps only this rank's shard of them (`masters` is left empty).
    pub(crate) fn start(
        group: ProcessGroup,
        options: DataParallelOptions,
        setup: serde_json::Value,
        vars: &[Var],
        masters: &mut MasterWeights,
        params: &Params,
    ) -> Result<Self, TrainError> {
        let (buckets, gpu) = Self::prepare(&group, options, setup, vars, params)?;
        // Rank 0's f32 master and optimizer state of parameter `i`, on every rank (a GPU's
        // through the host, once).
        let from_root = |i: usize| -> Result<(Tensor, Vec<Tensor>), TrainError> {
            let missing = || DistError::internal(format!("no master for parameter {i}"));
            let root = |t: &Tensor| -> Result<Tensor, TrainError> {
                Ok(group.broadcast(&t.to_device(&Device::Cpu)?, 0)?.to_device(t.device())?)
            };
            let master = root(masters.master(i).ok_or_else(missing)?)?;
            let state = masters.state_of(i).ok_or_else(missing)?;
            Ok((master, state.iter().map(root).collect::<Result<Vec<_>, _>>()?))
        };
        let (steps, optimizer) = (masters.steps(), masters.optimizer());
        let zero = if options.sharding == Sharding::None {
            // Replicated: every rank takes rank 0's whole state.
            let (all_masters, states) =
                (0..vars.len()).map(from_root).collect::<Result<Vec<_>, _>>()?.into_iter().unzip();
            // Rank 0 holds them already.
            if !group.is_root() {
                masters.load_state(&MasterState { step: steps, masters: all_masters, states })?;
            }
            None
        } else {
            // Sharded: parameter by parameter, every rank's parameter set from rank 0's master
            // and this rank's pieces kept; then the whole state goes.
            let mut fetch = |request: &PieceRequest| -> Result<PieceInit, TrainError> {
                let i = request.param;
                let (master, state) = from_root(i)?;
                // Rank 0's parameters are its masters (rounded) already.
                if !group.is_root() {
                    let v = &vars[i];
                    v.set(&master.to_dtype(v.dtype())?)?;
                }
                PieceInit::narrowed(request, &master, Some(&state))
            };
            let z = Shard::new(
                &group,
                (gpu.as_ref(), options.tensor_path),
                vars,
                buckets.plan(),
                options.sharding,
                (optimizer, steps),
                &mut fetch,
            )?
            .blocks(options.prefetch, options.recompute);
            *masters = MasterWeights::new(&[], optimizer)?;
            Some(z)
        };
        broadcast_buffers(&group, params)?;
        Ok(Self::assembled(group, buckets, zero, gpu, options))
    }

    /// Joins the group for a run whose masters, optimizer state and loss scale live in a step
    /// captured as a CUDA graph (replicated, on GPUs over NCCL): the same checks as
    /// [`Parallel::start`] and rank 0's buffers everywhere; the caller takes rank 0's state into
    /// the step's own tensors over [`Parallel::gpu`].
    pub(crate) fn start_graph(
        group: ProcessGroup,
        options: DataParallelOptions,
        setup: serde_json::Value,
        vars: &[Var],
        params: &Params,
    ) -> Result<Self, TrainError> {
        if options.sharding != Sharding::None {
            return Err(DistError::internal("a graph's run is replicated").into());
        }
        let (buckets, gpu) = Self::prepare(&group, options, setup, vars, params)?;
        if gpu.is_none() {
            return Err(DistError::unsupported("data parallel", "a CUDA graph's step needs GPU parameters").into());
        }
        broadcast_buffers(&group, params)?;
        Ok(Self::assembled(group, buckets, None, gpu, options))
    }

    /// NCCL, when the parameters are on GPUs.
    #[cfg(feature = "nccl")]
    pub(crate) fn gpu(&self) -> Option<&GpuComm> {
        self.gpu.as_deref()
    }

    /// Starts a sharded run (`options.sharding` is not `None`) without the whole state ever
    /// existing: parameter by parameter, rank 0's f32 value — its `start` (the f32 values of a
    /// low-precision model's parameters, checked by the caller) or the parameter — is
    /// broadcast, every rank's parameter set from it, and this rank keeps its piece of it as the
    /// master; the optimizer state is made, zeroed, at the first update. Then rank 0's buffers
    /// everywhere.
    pub(crate) fn start_sharded(
        group: ProcessGroup,
        options: DataParallelOptions,
        setup: serde_json::Value,
        vars: &[Var],
        start: Option<&[Tensor]>,
        optimizer: Optimizer,
        params: &Params,
    ) -> Result<Self, TrainError> {
        if options.sharding == Sharding::None {
            return Err(DistError::internal("a sharded start without sharding").into());
        }
        let (buckets, gpu) = Self::prepare(&group, options, setup, vars, params)?;
        let mut fetch = |request: &PieceRequest| -> Result<PieceInit, TrainError> {
            let v = &vars[request.param];
            let own = match start {
                Some(s) => s[request.param].to_device(&Device::Cpu)?.to_dtype(DType::F32)?,
                None => v.as_tensor().to_device(&Device::Cpu)?.to_dtype(DType::F32)?,
            };
            // Through the host (a GPU's parameter too), once.
            let value = group.broadcast(&own, 0)?.to_device(v.device())?;
            // Rank 0's parameter is this value already, unless it starts from `start`.
            if !group.is_root() || start.is_some() {
                v.set(&value.to_dtype(v.dtype())?.copy()?)?;
            }
            PieceInit::narrowed(request, &value, None)
        };
        let z = Shard::new(
            &group,
            (gpu.as_ref(), options.tensor_path),
            vars,
            buckets.plan(),
            options.sharding,
            (optimizer, 0),
            &mut fetch,
        )?
        .blocks(options.prefetch, options.recompute);
        broadcast_buffers(&group, params)?;
        Ok(Self::assembled(group, buckets, Some(z), gpu, options))
    }

    /// This rank's shard of a sharded run as the checkpoint `reader` holds it (saved at any
    /// world size, sharded or not): its pieces of the f32 masters and of the optimizer state,
    /// read by range. Nothing changes here (see [`Parallel::set_shard`]); no collective runs.
    pub(crate) fn read_shard(
        &self,
        vars: &[Var],
        names: &[String],
        reader: &mut CheckpointReader,
    ) -> Result<Option<Shard>, TrainError> {
        let Some(z) = &self.zero else { return Ok(None) };
        let (stage, optimizer) = match z {
            Shard::Zero(z) => (z.stage(), z.optimizer()),
            Shard::Params(p) => (Sharding::Parameters, p.optimizer()),
        };
        let steps = reader.manifest().optimizer_steps;
        let mut fetch = |request: &PieceRequest| -> Result<PieceInit, TrainError> {
            let Some((offset, len)) = request.range else { return Ok(PieceInit::default()) };
            let name = &names[request.param];
            let device = vars[request.param].device();
            let mut read = |key: String| -> Result<Tensor, TrainError> {
                Ok(Tensor::from_vec(reader.read_f32(&key, offset, len)?, len, device)?)
            };
            let master = request.master.then(|| read(format!("master/{name}"))).transpose()?;
            let state = (0..optimizer.states()).map(|k| read(format!("state{k}/{name}"))).collect::<Result<_, _>>()?;
            Ok(PieceInit { master, state })
        };
        let plan = self.buckets.plan();
        let shard = Shard::new(
            &self.group,
            (self.gpu.as_ref(), self.tensor_path),
            vars,
            plan,
            stage,
            (optimizer, steps),
            &mut fetch,
        )?
        .blocks(self.prefetch, self.recompute);
        if let (Shard::Params(new), Shard::Params(old)) = (&shard, z) {
            new.inherit(old);
        }
        Ok(Some(shard))
    }

    /// Puts a shard [`Parallel::read_shard`] read in place of this rank's.
    pub(crate) fn set_shard(&mut self, shard: Shard) {
        self.zero = Some(shard);
    }

    /// Stage 3's parameter shards (the blocks' source), when the parameters are sharded.
    pub(crate) fn param_shards(&self) -> Option<&Arc<ParamShards>> {
        match &self.zero {
            Some(Shard::Params(p)) => Some(p),
            _ => None,
        }
    }

    /// Whether the optimizer state is sharded.
    pub(crate) fn sharded(&self) -> bool {
        self.zero.is_some()
    }

    /// The sharded optimizer's steps, when sharded.
    pub(crate) fn sharded_steps(&self) -> Option<u64> {
        self.zero.as_ref().map(|z| match z {
            Shard::Zero(z) => z.steps(),
            Shard::Params(p) => p.steps(),
        })
    }

    /// This rank's share of a sharded checkpoint (see `ZeroOptimizer::checkpoint_tensors`;
    /// rank 0 adds the f32 parameters whole).
    pub(crate) fn shard_tensors(
        &self,
        vars: &[Var],
        names: &[String],
    ) -> Result<Option<std::collections::HashMap<String, Tensor>>, TrainError> {
        let root = self.group.is_root();
        self.zero
            .as_ref()
            .map(|z| match z {
                Shard::Zero(z) => z.checkpoint_tensors(vars, names, root),
                Shard::Params(p) => p.checkpoint_tensors(names),
            })
            .transpose()
    }

    /// This rank's bytes of f32 masters and optimizer state when sharded.
    pub(crate) fn shard_bytes(&self) -> Option<(usize, usize)> {
        self.zero.as_ref().map(|z| match z {
            Shard::Zero(z) => z.memory_bytes(),
            Shard::Params(p) => p.memory_bytes(),
        })
    }

    /// f32 bytes of all gradient buckets.
    pub(crate) fn bucket_bytes(&self) -> usize {
        self.buckets.bytes()
    }

    /// Every rank's outcome of its local part of a step: its own when it failed, a
    /// [`DistError::PeerFailed`] naming the first rank that failed when another did, the value
    /// when none did. Every rank calls it once per step, so none waits in a collective the
    /// others never reach.
    pub(crate) fn agree<T>(&self, local: Result<T, TrainError>) -> Result<T, TrainError> {
        let message = local.as_ref().err().map(ToString::to_string);
        match (self.group.first_failure(message.as_deref())?, local) {
            (None, Ok(v)) => Ok(v),
            (Some((r, _)), Err(e)) if r == self.group.rank() => Err(e),
            (Some((rank, message)), _) => Err(DistError::PeerFailed { rank, message }.into()),
            (None, Err(e)) => Err(e),
        }
    }

    /// The step's reduction, to start from inside its last backward pass ([`Flight::ready`]),
    /// when it overlaps: host parameters at stages 0–2 with `overlap` on.
    pub(crate) fn flight(&self, vars: &[Var]) -> Result<Option<Flight>, TrainError> {
        if !self.overlap || self.gpu.is_some() {
            return Ok(None);
        }
        Ok(match &self.zero {
            None => Some(self.buckets.flight(vars)?),
            Some(Shard::Zero(z)) => Some(z.flight(&self.group, vars)?),
            Some(Shard::Params(_)) => None,
        })
    }

    /// The update: gradients summed over ranks (bucket by bucket; those in `flight` started
    /// already), the inf/NaN decision of the loss scaler agreed, then the replicated update
    /// (`masters`) or this rank's sharded one, clipped to `max_norm` when given; the outcome and
    /// the gradients' norm (when clipping).
    pub(crate) fn update(
        &mut self,
        grads: &mut GradStore,
        flight: Option<Flight>,
        vars: &[Var],
        masters: &mut MasterWeights,
        (scaler, max_norm): (Option<&mut GradScaler>, Option<f64>),
        lr: f64,
    ) -> Result<Stepped, TrainError> {
        match self.zero.as_mut() {
            Some(Shard::Zero(z)) => {
                z.set_learning_rate(lr);
                let (outcome, stats) = match (&self.gpu, flight) {
                    (None, Some(f)) => z.step_from(&self.group, f, vars, (scaler, max_norm))?,
                    (None, None) => z.step(&self.group, grads, vars, (scaler, max_norm))?,
                    #[cfg(feature = "nccl")]
                    (Some(nccl), _) => z.step_nccl(&self.group, nccl, grads, vars, (scaler, max_norm))?,
                    #[cfg(not(feature = "nccl"))]
                    (Some(never), _) => match **never {},
                };
                self.last = stats;
                return Ok(outcome);
            }
            Some(Shard::Params(p)) => {
                p.reduce_rest(grads, vars)?;
                let (outcome, stats) = p.step(vars, (scaler, max_norm), lr)?;
                self.last = stats;
                return Ok(outcome);
            }
            None => {}
        }
        self.last = match (&self.gpu, flight) {
            (None, Some(f)) => self.buckets.finish(&self.group, f, grads, vars)?,
            (None, None) => self.buckets.reduce(&self.group, grads, vars)?,
            #[cfg(feature = "nccl")]
            (Some(nccl), _) => nccl.reduce_gradients(&self.group, self.buckets.plan(), grads, vars)?,
            #[cfg(not(feature = "nccl"))]
            (Some(never), _) => match **never {},
        };
        masters.set_learning_rate(lr);
        let refs: Vec<&Var> = vars.iter().collect();
        let scaler = match scaler {
            Some(s) => {
                // Every rank holds the same summed gradients, so the finding is the same; it is
                // agreed all the same, one byte, before any rank acts on it.
                let found = s.unscale(grads, &refs)?;
                s.set_found_inf(self.group.any(found)?);
                Some(s)
            }
            None => None,
        };
        // Every rank holds the same summed gradients: the same norm and coefficient everywhere.
        crate::clip::clipped_master_step(grads, masters, scaler, &refs, max_norm)
    }
}

/// Rank 0's buffers (batch norm's running statistics) into every rank's, in one broadcast —
/// PyTorch DDP's `broadcast_buffers=True`, done when a run joins and before each step.
pub(crate) fn broadcast_buffers(group: &ProcessGroup, params: &Params) -> Result<(), TrainError> {
    if group.world_size() == 1 {
        return Ok(());
    }
    let buffers: Vec<_> = params.buffers().map(|(_, b)| b).collect();
    if buffers.is_empty() {
        return Ok(());
    }
    let values: Vec<Tensor> = buffers.iter().map(|b| b.get()).collect();
    let mut bytes = Vec::new();
    let mut lens = Vec::with_capacity(values.len());
    for t in &values {
        let b = to_bytes(t)?;
        lens.push(b.len());
        bytes.extend_from_slice(&b);
    }
    // The same buffers everywhere was checked when the run joined (`check_same` of the setup).
    group.comm().broadcast(&mut bytes, 0)?;
    let mut at = 0;
    for ((buffer, t), len) in buffers.iter().zip(&values).zip(lens) {
        let value = Tensor::from_raw_buffer(&bytes[at..at + len], t.dtype(), t.dims(), t.device())?;
        at += len;
        buffer.set(&value)?;
    }
    Ok(())
}
