//! ZeRO stages 1 and 2 (Rajbhandari et al., SC'20): the optimizer's state and the f32 masters
//! sharded over the ranks, each rank updating only its shard, the updated shards all-gathered
//! into every rank's parameters.
//!
//! Layout: the gradient buckets ([`super::buckets`]), each padded to a multiple of the world size
//! and cut into equal blocks; rank `r` owns block `r` of every bucket (DeepSpeed's flat
//! partition, so a parameter may straddle two ranks and any world size shards any model — the
//! padding is at most `world − 1` elements per bucket). Within its block a rank keeps one state
//! entry per parameter piece, so the update is the same element-wise rule on the same values as
//! the replicated one: ZeRO and plain data parallel give the same parameters to the bit.
//!
//! Stage 1 all-reduces each bucket (every rank holds the whole reduced gradient until the
//! update); stage 2 reduce-scatters it (a rank keeps only its block, the rest is freed bucket by
//! bucket). The buckets' collectives start from inside backward (a `flight`) or after it; a
//! stage-2 bucket reduced during backward leaves only this rank's block beside the rest of
//! backward, the buckets still to come hold every local gradient in both stages.
//!
//! GPU parameters (feature `nccl`) keep the same shard on their GPU and take the step of
//! [`nccl`]: NCCL's collectives and the fused kernels in place of MPI's and the host's loops.

#[cfg(feature = "nccl")]
mod nccl;

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor, Var};

use super::buckets::{agree_presence, block_of, ReduceStats};
use super::error::DistError;
use super::flight::{Flight, Unit};
use super::pending::Collective;
use super::pieces::{clip_over_ranks, rounded, vec_f32, with_f32};
use super::{ProcessGroup, Sharding};
use crate::amp::{GradScaler, StepOutcome};
use crate::error::TrainError;
use crate::optim::Optimizer;

/// A piece of parameter `param` (`len` elements from `offset`) at `at` in its bucket's block,
/// with its f32 master when the parameter is not f32 (an f32 parameter is its own master).
struct Piece {
    param: usize,
    offset: usize,
    len: usize,
    at: usize,
    master: Option<Tensor>,
}

impl Piece {
    /// The piece of its parameter: a view into the model's own tensor.
    fn of_param(&self, vars: &[Var]) -> candle_core::Result<Tensor> {
        vars[self.param].as_tensor().flatten_all()?.narrow(0, self.offset, self.len)
    }

    /// Its f32 values, where the update writes them: its own master, or the f32 parameter's
    /// piece itself (updated in place, as the replicated update does).
    fn f32_values(&self, vars: &[Var]) -> candle_core::Result<Tensor> {
        match &self.master {
            Some(m) => Ok(m.clone()),
            None => self.of_param(vars),
        }
    }
}

/// A piece's optimizer state made at its first update: `optimizer`'s state tensors, f32 zeros
/// of `len` elements on `device` (PyTorch's optimizers make theirs zeroed at their first step).
pub(super) fn zeroed_state(optimizer: Optimizer, len: usize, device: &Device) -> candle_core::Result<Vec<Tensor>> {
    (0..optimizer.states()).map(|_| Tensor::zeros(len, DType::F32, device)).collect()
}

struct ShardBucket {
    /// Parameters, in bucket order, with where each starts in the bucket.
    members: Vec<(usize, usize)>,
    /// Elements in each rank's block (the bucket padded to a multiple of the world size).
    block: usize,
    pieces: Vec<Piece>,
    /// Optimizer state of each piece.
    states: Vec<Vec<Tensor>>,
}

/// A rank's shard of the optimizer: masters and state of its blocks, and the step count.
pub(crate) struct ZeroOptimizer {
    stage: Sharding,
    optimizer: Optimizer,
    step: u64,
    buckets: Vec<ShardBucket>,
}

/// A step's outcome and, when clipping, the gradients' total norm before it.
pub(crate) type Stepped = (StepOutcome, Option<f64>);

/// What [`ZeroOptimizer::new`] asks for one parameter.
pub(crate) struct PieceRequest {
    /// The parameter.
    pub(crate) param: usize,
    /// This rank's piece of it, `(offset, len)` in its flat elements (`None`: it holds none).
    pub(crate) range: Option<(usize, usize)>,
    /// Whether the piece needs its own f32 master (a low-precision parameter).
    pub(crate) master: bool,
}

/// What a source gives for a [`PieceRequest`]: the piece's f32 master when asked for, and its
/// optimizer state (f32, `len` elements each; none for a fresh start: the first update makes it
/// zeroed, as PyTorch's optimizers make their state at their first step); empty when the rank
/// holds no piece.
#[derive(Default)]
pub(crate) struct PieceInit {
    pub(crate) master: Option<Tensor>,
    pub(crate) state: Vec<Tensor>,
}

impl PieceInit {
    /// The request's piece of whole tensors: `master` (any float dtype) and `state` (`None`:
    /// a fresh start).
    pub(crate) fn narrowed(
        request: &PieceRequest,
        master: &Tensor,
        state: Option<&[Tensor]>,
    ) -> Result<Self, TrainError> {
        let Some((offset, len)) = request.range else {
            return Ok(PieceInit::default());
        };
        // A piece of its own size: `copy` of a view would clone the whole buffer behind it.
        let take = |t: &Tensor| -> Result<Tensor, TrainError> {
            Ok(t.flatten_all()?.narrow(0, offset, len)?.to_dtype(DType::F32)?.force_contiguous()?)
        };
        let state = state.unwrap_or_default().iter().map(take).collect::<Result<Vec<_>, _>>()?;
        Ok(PieceInit { master: request.master.then(|| take(master)).transpose()?, state })
    }
}

impl ZeroOptimizer {
    /// This rank's shard over the buckets `plan`, from what `fetch` gives for each parameter's
    /// piece — called for every parameter, in bucket order, on every rank (it may run
    /// collectives) — after `steps` optimizer steps. Only one parameter's tensors are asked for
    /// at a time.
    pub(crate) fn new(
        group: &ProcessGroup,
        vars: &[Var],
        plan: &[Vec<usize>],
        stage: Sharding,
        optimizer: Optimizer,
        steps: u64,
        fetch: &mut dyn FnMut(&PieceRequest) -> Result<PieceInit, TrainError>,
    ) -> Result<Self, TrainError> {
        let (rank, world) = (group.rank(), group.world_size());
        let mut buckets = Vec::with_capacity(plan.len());
        for members in plan {
            let mut at = 0usize;
            let mut placed = Vec::with_capacity(members.len());
            for &i in members {
                placed.push((i, at));
                at =
                    at.checked_add(vars[i].elem_count()).ok_or_else(|| DistError::internal("bucket size overflows"))?;
            }
            let elems = at;
            let block = block_of(elems, world);
            let (lo, hi) = (rank * block, ((rank + 1) * block).min(elems));
            let mut pieces = Vec::new();
            let mut states = Vec::new();
            for &(i, start) in &placed {
                let end = start + vars[i].elem_count();
                let (a, b) = (start.max(lo), end.min(hi));
                let range = (a < b).then_some((a - start, b - a));
                let request = PieceRequest { param: i, range, master: vars[i].dtype() != DType::F32 };
                let init = fetch(&request)?;
                let Some((offset, len)) = range else { continue };
                let fits = |t: &Tensor| t.dtype() == DType::F32 && t.elem_count() == len;
                if init.master.is_some() != request.master
                    || !init.master.iter().all(fits)
                    || !(init.state.is_empty() || init.state.len() == optimizer.states())
                    || !init.state.iter().all(fits)
                {
                    return Err(
                        DistError::internal(format!("the shard's source gave parameter {i} a wrong piece")).into()
                    );
                }
                states.push(init.state);
                pieces.push(Piece { param: i, offset, len, at: a - lo, master: init.master });
            }
            buckets.push(ShardBucket { members: placed, block, pieces, states });
        }
        Ok(ZeroOptimizer { stage, optimizer, step: steps, buckets })
    }

    /// Bytes of this rank's f32 masters and optimizer state.
    pub(crate) fn memory_bytes(&self) -> (usize, usize) {
        let bytes = |t: &Tensor| t.elem_count() * t.dtype().size_in_bytes();
        let master =
            self.buckets.iter().flat_map(|b| b.pieces.iter().filter_map(|p| p.master.as_ref())).map(bytes).sum();
        let state = self.buckets.iter().flat_map(|b| b.states.iter().flatten()).map(bytes).sum();
        (master, state)
    }

    /// What is sharded.
    pub(crate) fn stage(&self) -> Sharding {
        self.stage
    }

    /// The update rule (its current learning rate).
    pub(crate) fn optimizer(&self) -> Optimizer {
        self.optimizer
    }

    /// Optimizer steps taken.
    pub(crate) fn steps(&self) -> u64 {
        self.step
    }

    /// This rank's share of a checkpoint: each piece's master (low-precision parameters) and
    /// state, named `master/NAME#OFFSET` and `stateK/NAME#OFFSET` (offsets in the parameter's
    /// elements); with `whole_f32`, also each f32 parameter whole as `master/NAME` (every rank
    /// holds those, so one writes them).
    pub(crate) fn checkpoint_tensors(
        &self,
        vars: &[Var],
        names: &[String],
        whole_f32: bool,
    ) -> Result<std::collections::HashMap<String, Tensor>, TrainError> {
        let mut out = std::collections::HashMap::new();
        for b in &self.buckets {
            for (p, state) in b.pieces.iter().zip(&b.states) {
                let name = &names[p.param];
                if let Some(m) = &p.master {
                    out.insert(format!("master/{name}#{}", p.offset), m.copy()?);
                }
                for k in 0..self.optimizer.states() {
                    // Before the first update a fresh start's state is zero.
                    let t = match state.get(k) {
                        Some(t) => t.copy()?,
                        None => Tensor::zeros(p.len, DType::F32, &Device::Cpu)?,
                    };
                    out.insert(format!("state{k}/{name}#{}", p.offset), t);
                }
            }
        }
        for (v, name) in vars.iter().zip(names).filter(|(v, _)| whole_f32 && v.dtype() == DType::F32) {
            out.insert(format!("master/{name}"), v.as_tensor().copy()?);
        }
        Ok(out)
    }

    pub(crate) fn set_learning_rate(&mut self, lr: f64) {
        self.optimizer.set_lr(lr);
    }

    /// The collectives of the reduction: each bucket padded to a multiple of the world size,
    /// all-reduced (stage 1) or reduce-scattered (stage 2).
    fn units(&self, world: usize) -> (Vec<Unit>, Collective) {
        let units = self
            .buckets
            .iter()
            .map(|b| Unit { members: b.members.iter().map(|&(i, _)| i).collect(), len: b.block * world, direct: false })
            .collect();
        let collective = match self.stage {
            Sharding::OptimizerState => Collective::AllReduce,
            _ => Collective::ReduceScatter,
        };
        (units, collective)
    }

    /// Where this rank's block starts in bucket `b`'s reduced values: stage 1 reduces the whole
    /// bucket, stage 2 only the block.
    fn own_block_at(&self, rank: usize, b: &ShardBucket) -> usize {
        match self.stage {
            Sharding::OptimizerState => rank * b.block,
            _ => 0,
        }
    }

    /// A reduction of `vars`' gradients (to start from inside backward, [`Flight::ready`]): each
    /// bucket's reduced block (stage 1: inside the whole reduced bucket), its low-precision
    /// pieces rounded to their dtype as the replicated path does, as it completes.
    pub(crate) fn flight(&self, group: &ProcessGroup, vars: &[Var]) -> Result<Flight, DistError> {
        let (units, collective) = self.units(group.world_size());
        let low: Vec<Vec<(usize, usize, DType)>> = self
            .buckets
            .iter()
            .map(|b| {
                let at = self.own_block_at(group.rank(), b);
                b.pieces.iter().map(|p| (at + p.at, p.len, vars[p.param].dtype())).collect()
            })
            .collect();
        let finisher = Box::new(move |u: usize, _: &Unit, mut values: Vec<f32>| -> Result<Vec<Tensor>, DistError> {
            for &(start, len, dtype) in &low[u] {
                rounded(&mut values[start..start + len], dtype);
            }
            let n = values.len();
            Ok(vec![Tensor::from_vec(values, n, &Device::Cpu)?])
        });
        Flight::new(units, collective, vars, finisher)
    }

    /// One sharded step from this rank's local gradients `grads` (consumed): see
    /// [`ZeroOptimizer::step_from`].
    pub(crate) fn step(
        &mut self,
        group: &ProcessGroup,
        grads: &mut GradStore,
        vars: &[Var],
        (scaler, max_norm): (Option<&mut GradScaler>, Option<f64>),
    ) -> Result<(Stepped, ReduceStats), TrainError> {
        let mut flight = self.flight(group, vars)?;
        flight.close(group.comm(), Some(grads))?;
        self.step_from(group, flight, vars, (scaler, max_norm))
    }

    /// One sharded step from `flight` (made by [`ZeroOptimizer::flight`]): complete each
    /// bucket's reduction (all-reduce for stage 1, reduce-scatter for stage 2), unscale and
    /// agree on inf/NaN through the scaler, clip by the norm over every rank's pieces (when
    /// `max_norm` is given), update this rank's pieces, all-gather the blocks into the parameters.
    pub(crate) fn step_from(
        &mut self,
        group: &ProcessGroup,
        flight: Flight,
        vars: &[Var],
        (mut scaler, max_norm): (Option<&mut GradScaler>, Option<f64>),
    ) -> Result<(Stepped, ReduceStats), TrainError> {
        let (results, local, stats) = flight.finish(group.comm())?;
        let present = agree_presence(group, &local)?;
        // Each bucket's reduced gradient block, and where this rank's block starts in it.
        let mut blocks: Vec<(Tensor, usize)> = Vec::with_capacity(self.buckets.len());
        for (b, (_, reduced)) in self.buckets.iter().zip(results) {
            let at = self.own_block_at(group.rank(), b);
            let block = reduced.into_iter().next().ok_or_else(|| DistError::internal("a bucket reduced to nothing"))?;
            blocks.push((block, at));
        }
        // The loss scaler (f16): unscale this rank's pieces, then every rank takes the same
        // decision from the all-reduced finding before anything changes.
        let mut skipped = false;
        if let Some(s) = scaler.as_deref_mut() {
            let inv = (1.0 / s.scale()) as f32;
            let mut found = false;
            for (b, (block, at)) in self.buckets.iter().zip(blocks.iter_mut()) {
                let mut values = vec_f32(block)?;
                for p in b.pieces.iter().filter(|p| present[p.param]) {
                    let piece = &mut values[*at + p.at..*at + p.at + p.len];
                    piece.iter_mut().for_each(|v| *v *= inv);
                    rounded(piece, vars[p.param].dtype());
                    found |= piece.iter().any(|v| !v.is_finite());
                }
                let n = values.len();
                *block = Tensor::from_vec(values, n, &Device::Cpu)?;
            }
            skipped = group.any(found)?;
            s.set_found_inf(skipped);
        }
        let outcome = if skipped {
            (StepOutcome::Skipped, None)
        } else {
            let (factor, norm) = self.clip(group, &blocks, &present, max_norm)?;
            (self.update(group, vars, &blocks, &present, factor)?, norm)
        };
        if let Some(s) = scaler {
            s.update()?;
        }
        Ok((outcome, stats))
    }

    /// Gradient clipping's coefficient and the norm, over this rank's pieces and the others'.
    fn clip(
        &self,
        group: &ProcessGroup,
        blocks: &[(Tensor, usize)],
        present: &[bool],
        max_norm: Option<f64>,
    ) -> Result<(f32, Option<f64>), TrainError> {
        clip_over_ranks(group, max_norm, || {
            let mut squares = 0.0;
            for (b, (block, at)) in self.buckets.iter().zip(blocks) {
                squares += with_f32(block, |values| {
                    let pieces = b.pieces.iter().filter(|p| present[p.param]);
                    pieces
                        .map(|p| wick_kernels::cpu::optim::sum_of_squares(&values[*at + p.at..*at + p.at + p.len]))
                        .sum::<f64>()
                })?;
            }
            Ok(squares)
        })
    }

    fn update(
        &mut self,
        group: &ProcessGroup,
        vars: &[Var],
        blocks: &[(Tensor, usize)],
        present: &[bool],
        factor: f32,
    ) -> Result<StepOutcome, TrainError> {
        let world = group.world_size();
        self.step += 1;
        let t = self.step as i32;
        for (b, (grad, at)) in self.buckets.iter_mut().zip(blocks) {
            let mut mine = vec![0f32; b.block];
            for (p, state) in b.pieces.iter().zip(b.states.iter_mut()) {
                let target = p.f32_values(vars)?;
                if present[p.param] {
                    if state.is_empty() {
                        *state = zeroed_state(self.optimizer, p.len, &Device::Cpu)?;
                    }
                    let g = grad.narrow(0, at + p.at, p.len)?;
                    *state = crate::optim::step(&target, &g, state, (self.optimizer, t), factor)?;
                }
                mine[p.at..p.at + p.len].copy_from_slice(&vec_f32(&target)?);
            }
            let mut full = vec![0f32; b.block * world];
            group.comm().all_gather(&mine, &mut full)?;
            drop(mine);
            for &(i, start) in &b.members {
                let v = &vars[i];
                let values = Tensor::from_slice(&full[start..start + v.elem_count()], v.dims(), &Device::Cpu)?;
                crate::optim::copy_into(v.as_tensor(), &values)?;
            }
        }
        Ok(StepOutcome::Applied)
    }
}
