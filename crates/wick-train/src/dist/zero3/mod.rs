//! ZeRO stage 3 (PyTorch's FSDP `FULL_SHARD`, DeepSpeed's stage 3): the parameters themselves
//! are sharded. Rank `r` keeps elements `[r·c, (r+1)·c)` of every parameter (`c` = the
//! parameter's elements over the world size, rounded up; the last rank's piece is shorter or
//! empty), as f32 masters with their optimizer state and gradient, and nothing else of it.
//!
//! The model's blocks (the segments of [`wick_nn::checkpoint`]) take their parameters from here
//! through [`wick_nn::checkpoint::ShardedBlocks`]: one all-gather of the block's pieces (in the
//! parameters' dtype) just before the block runs forward, the whole values dropped when it is
//! done, one more all-gather when its backward recomputes it, and one reduce-scatter of its
//! gradients (f32) started as soon as that backward is done and left in flight until the next
//! block's (MPI moves it on inside the next gather) — so a rank holds whole only the block that
//! runs, and one block's reduction buffers beside it. The model's own tensors of those
//! parameters are never read again: their pages go back to the operating system
//! ([`wick::memory::release_pages`]; they read as zeros) after the first update, once the
//! forward pass has shown which parameters belong to a block.
//!
//! Parameters the model reads outside any block (embeddings, the head, a stem) stay whole in
//! the model on every rank, as stage 2 keeps them: their gradients are reduce-scattered after
//! backward and the updated pieces all-gathered back — FSDP's root unit, which holds its
//! parameters for the whole step. One parameter at a time, with no copy beside it where none
//! is needed: an f32 gradient that splits evenly is sent from where it lies, its piece is the
//! receive buffer, and the gather writes every rank's piece straight into the model's tensor
//! (the largest of these set a 58 M decoder's peak before: 666 MiB, now 621 in backward). A
//! parameter used both inside a block and outside is refused.
//!
//! With prefetch on ([`super::DataParallelOptions::prefetch`]), each block's gather, once done,
//! starts the next block's as a non-blocking collective, in the order the last step gathered
//! them (forward, then backward's recomputations in reverse) — FSDP's forward and backward
//! prefetch, for one more block whole.
//!
//! Why recompute (the default): candle keeps a tensor an op saved for backward for as long as
//! the graph lives, so a gathered parameter used by a kept graph cannot be dropped after the
//! forward pass. Recomputing the block in backward (activation checkpointing) keeps only its
//! input, and the gathered values are dropped for real; the cost is one more forward pass of
//! each block. With [`super::DataParallelOptions::recompute`] off the blocks keep their graphs
//! instead ([`wick_nn::checkpoint`]): the gathered tensors stay in the graph but their pages go
//! back after the block's forward pass ([`wick_nn::pages::release`]), the block's parameters are gathered
//! again into them when backward reaches the block's output, and each goes back again once its
//! gradient is complete — FSDP's reshard after forward and its pre-backward gather, with every
//! block's activations held as FSDP holds them without checkpointing.
//!
//! The update is the element-wise rule on each rank's pieces — the same rule on the same values
//! as the replicated update, so stage 3 takes the same step as one process, to the bit.
//!
//! What is said above of pages and MPI is the host path. GPU ranks (and host ranks that ask for
//! it) take the tensor path ([`tensors`]): the same shard, pieces and order of collectives, as
//! tensors on the parameters' device over NCCL (or the group's tensor collectives), with
//! nothing left in flight and no prefetch; a CUDA tensor gives its memory back by exchanging its
//! storage for host zeros ([`wick_nn::pages::release`]).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use candle_core::{DType, Device, Tensor, TensorId, Var};

use super::buckets::ReduceStats;
use super::error::DistError;
use super::pending::{Collective, Outgoing, Pending};
use super::pieces::{clip_over_ranks, push_bytes, rounded, var_from_pieces, with_f32, GatherLayout, WritePieces};
use super::prefetch::{Gathering, Prefetch};
use super::zero::{zeroed_state, PieceInit, PieceRequest, Stepped};
use super::{ProcessGroup, ReduceOp};
use crate::amp::{GradScaler, StepOutcome};
use crate::error::TrainError;
use crate::optim::Optimizer;

mod reduce;
mod tensors;

pub(crate) use tensors::TensorCollectives;

/// One parameter's shard on this rank.
struct Shard {
    dims: Vec<usize>,
    dtype: DType,
    /// Elements each rank contributes to a gather (this rank's piece, padded).
    chunk: usize,
    /// This rank's piece: `(offset, len)` in the parameter's flat elements (`len` may be 0).
    offset: usize,
    len: usize,
    /// The piece's f32 master.
    master: Tensor,
    /// Its optimizer state (empty until the first update).
    state: Vec<Tensor>,
    /// The step's reduced gradient of the piece (f32), when any rank computed one.
    grad: Option<Vec<f32>>,
    /// On GPU ranks, the same as a tensor on the device, in the parameter's dtype ([`tensors`]).
    device_grad: Option<Tensor>,
    /// Whether a block takes it (then the model's own tensor is never read).
    in_block: bool,
    /// Whether the model's own tensor's pages were handed back.
    released: bool,
    /// Whether `master` is a view of the model's own (whole, f32) tensor.
    viewed: bool,
}

struct State {
    shards: Vec<Shard>,
    optimizer: Optimizer,
    step: u64,
    stats: ReduceStats,
    /// The last block's reduce-scatter, in flight: its parameters and their chunks.
    pending: Option<(Vec<usize>, Vec<usize>, Pending)>,
    prefetch: Prefetch,
    /// Blocks run without recomputation ([`super::DataParallelOptions::recompute`] off).
    keep_activations: bool,
}

/// A rank's shard of every parameter, and the blocks' gather and reduce.
pub(crate) struct ParamShards {
    group: ProcessGroup,
    /// The collectives of the tensor path ([`tensors`]: NCCL on GPU ranks, the group's tensor
    /// collectives on host ranks that ask for it); `None`: the host path.
    tensors: Option<Arc<dyn TensorCollectives>>,
    by_id: HashMap<TensorId, usize>,
    state: Mutex<State>,
}

fn lock(m: &Mutex<State>) -> std::sync::MutexGuard<'_, State> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl ParamShards {
    /// This rank's shards of `vars`, from what `fetch` gives for each parameter's piece (always
    /// asked with its f32 master) — called for every parameter in order on every rank (it may
    /// run collectives) — after `steps` optimizer steps.
    pub(crate) fn new(
        group: &ProcessGroup,
        tensors: Option<Arc<dyn TensorCollectives>>,
        vars: &[Var],
        optimizer: Optimizer,
        steps: u64,
        fetch: &mut dyn FnMut(&PieceRequest) -> Result<PieceInit, TrainError>,
    ) -> Result<Self, TrainError> {
        let (rank, world) = (group.rank(), group.world_size());
        let mut shards = Vec::with_capacity(vars.len());
        for (i, v) in vars.iter().enumerate() {
            if !v.device().is_cpu() && tensors.is_none() {
                return Err(DistError::internal("ZeRO-3: GPU parameters take the tensor path (NCCL)").into());
            }
            let elems = v.elem_count();
            let chunk = elems.div_ceil(world).max(1);
            let offset = (rank * chunk).min(elems);
            let len = ((rank + 1) * chunk).min(elems) - offset;
            let request = PieceRequest { param: i, range: (len > 0).then_some((offset, len)), master: true };
            let init = fetch(&request)?;
            let fits = |t: &Tensor| t.dtype() == DType::F32 && t.elem_count() == len;
            let master = match init.master {
                Some(m) if fits(&m) => m,
                None if len == 0 => Tensor::zeros(0, DType::F32, v.device())?,
                _ => return Err(DistError::internal(format!("ZeRO-3: a wrong piece of parameter {i}")).into()),
            };
            if !(init.state.is_empty() || init.state.len() == optimizer.states()) || !init.state.iter().all(fits) {
                return Err(DistError::internal(format!("ZeRO-3: a wrong state piece of parameter {i}")).into());
            }
            shards.push(Shard {
                dims: v.dims().to_vec(),
                dtype: v.dtype(),
                chunk,
                offset,
                len,
                master,
                state: init.state,
                grad: None,
                device_grad: None,
                in_block: false,
                released: false,
                viewed: false,
            });
        }
        let by_id = vars.iter().enumerate().map(|(i, v)| (v.as_tensor().id(), i)).collect();
        let state = State {
            shards,
            optimizer,
            step: steps,
            stats: ReduceStats::default(),
            pending: None,
            prefetch: Prefetch::default(),
            keep_activations: false,
        };
        Ok(ParamShards { group: group.clone(), tensors, by_id, state: Mutex::new(state) })
    }

    fn indices(&self, weights: &[Tensor]) -> candle_core::Result<Vec<usize>> {
        weights
            .iter()
            .map(|w| {
                self.by_id.get(&w.id()).copied().ok_or_else(|| {
                    candle_core::Error::Msg(
                        "ZeRO-3: a block was given a tensor that is not one of the model's parameters (pass the \
                         parameters themselves to the segment)"
                            .into(),
                    )
                })
            })
            .collect()
    }

    /// Every rank's pieces of parameters `which`, whole, as fresh variables.
    fn gather_whole(&self, which: &[usize]) -> Result<Vec<Tensor>, DistError> {
        let (send, layout) = self.pack(which)?;
        let recv = self.all_gather(send)?;
        self.made_whole(&recv, &layout)
    }

    /// Every rank's pieces of parameter `i`, written where they belong into `target` (the
    /// model's own tensor of it, in its dtype): the parameter whole again with no copy of it
    /// made on the way.
    fn gather_into(&self, i: usize, target: &Tensor) -> Result<(), DistError> {
        let (send, layout) = self.pack(&[i])?;
        let recv = self.all_gather(send)?;
        self.write_whole(&recv, &layout, std::slice::from_ref(target))
    }

    /// Every rank's pieces of a gather's parameters (`recv`, laid out as `layout` says)
    /// written where they belong into `into`, one tensor per parameter, each in its shape and
    /// dtype.
    fn write_whole(&self, recv: &[u8], layout: &GatherLayout, into: &[Tensor]) -> Result<(), DistError> {
        if into.len() != layout.placed.len() {
            return Err(DistError::internal("ZeRO-3: parameters gathered into another number of tensors"));
        }
        let t0 = Instant::now();
        for (k, ((_, _, dtype, dims), target)) in layout.placed.iter().zip(into).enumerate() {
            if target.dtype() != *dtype || target.dims() != dims.as_slice() {
                let i = layout.which[k];
                return Err(DistError::internal(format!("ZeRO-3: parameter {i} changed shape or dtype")));
            }
            let pieces = layout.pieces(recv, self.group.world_size(), k).collect();
            target.inplace_op1(&WritePieces { pieces })?;
        }
        lock(&self.state).stats.pack_s += t0.elapsed().as_secs_f64();
        Ok(())
    }

    /// This rank's pieces of parameters `which`, packed in their dtypes, and where each lies.
    fn pack(&self, which: &[usize]) -> Result<(Vec<u8>, GatherLayout), DistError> {
        let t0 = Instant::now();
        let mut send = Vec::new();
        let mut placed = Vec::with_capacity(which.len());
        let mut st = lock(&self.state);
        for &i in which {
            let s = &st.shards[i];
            let at = send.len();
            with_f32(&s.master, |values| push_bytes(values, s.chunk, s.dtype, &mut send))??;
            placed.push((at, send.len() - at, s.dtype, s.dims.clone()));
        }
        st.stats.pack_s += t0.elapsed().as_secs_f64();
        st.stats.bytes += send.len();
        let layout = GatherLayout { which: which.to_vec(), per_rank: send.len(), placed };
        Ok((send, layout))
    }

    /// Every rank's `send`, laid end to end (one blocking all-gather).
    fn all_gather(&self, send: Vec<u8>) -> Result<Vec<u8>, DistError> {
        let size = send.len().checked_mul(self.group.world_size());
        let mut recv = vec![0u8; size.ok_or_else(|| DistError::internal("gather size"))?];
        let t0 = Instant::now();
        self.group.comm().all_gather(&send, &mut recv)?;
        lock(&self.state).stats.comm_s += t0.elapsed().as_secs_f64();
        Ok(recv)
    }

    /// The parameters of a gather, as fresh variables made from every rank's bytes in `recv`.
    fn made_whole(&self, recv: &[u8], layout: &GatherLayout) -> Result<Vec<Tensor>, DistError> {
        let t0 = Instant::now();
        let mut out = Vec::with_capacity(layout.placed.len());
        for (k, (_, _, dtype, dims)) in layout.placed.iter().enumerate() {
            out.push(var_from_pieces(layout.pieces(recv, self.group.world_size(), k), *dtype, dims)?);
        }
        lock(&self.state).stats.pack_s += t0.elapsed().as_secs_f64();
        Ok(out)
    }

    /// Starts the gather of parameters `which` (MPI's non-blocking all-gather), to be finished
    /// when their block asks for them.
    fn start_gather(&self, which: &[usize]) -> Result<Gathering, DistError> {
        let (send, layout) = self.pack(which)?;
        let t0 = Instant::now();
        let pending = Pending::start(self.group.comm(), Outgoing::Owned(send), Collective::AllGather)?;
        lock(&self.state).stats.comm_s += t0.elapsed().as_secs_f64();
        Ok(Gathering { layout, pending })
    }

    /// Waits for a gather in flight: every rank's bytes.
    fn finish_gather(&self, gathering: Gathering) -> Result<(Vec<u8>, GatherLayout), DistError> {
        let t0 = Instant::now();
        let recv = gathering.pending.finish(self.group.comm())?;
        lock(&self.state).stats.comm_s += t0.elapsed().as_secs_f64();
        Ok((recv, gathering.layout))
    }

    /// Block `which`'s parameters whole: from the gather prefetched for it, or gathered now;
    /// then, with prefetching on and this step following the last one's order so far, the
    /// next block's gather started.
    fn gather_block(&self, which: Vec<usize>) -> Result<Vec<Tensor>, DistError> {
        if let Some(comm) = &self.tensors {
            return self.gather_block_tensors(comm.as_ref(), &which);
        }
        self.gather_block_with(which, |recv, layout| self.made_whole(recv, layout))
    }

    /// Block `which`'s parameters whole again, written into `into` (what an earlier
    /// [`ParamShards::gather_block`] of them returned), as [`ParamShards::gather_block`] gathers.
    fn regather_block(&self, which: Vec<usize>, into: &[Tensor]) -> Result<(), DistError> {
        if let Some(comm) = &self.tensors {
            return self.regather_block_tensors(comm.as_ref(), &which, into);
        }
        self.gather_block_with(which, |recv, layout| self.write_whole(recv, layout, into))
    }

    /// Every rank's bytes of block `which`'s parameters, from the gather prefetched for it or
    /// gathered now, handed to `deliver`; then, with prefetching on and this step following the
    /// last one's order so far, the next block's gather started.
    fn gather_block_with<R>(
        &self,
        which: Vec<usize>,
        deliver: impl FnOnce(&[u8], &GatherLayout) -> Result<R, DistError>,
    ) -> Result<R, DistError> {
        let (prefetched, on) = {
            let mut st = lock(&self.state);
            which.iter().for_each(|&i| st.shards[i].in_block = true);
            (st.prefetch.in_flight.take(), st.prefetch.on)
        };
        let out = match prefetched {
            Some(g) if g.layout.which == which => {
                let (recv, layout) = self.finish_gather(g)?;
                lock(&self.state).stats.prefetched += 1;
                deliver(&recv, &layout)?
            }
            other => {
                // Another block's (the order changed): every rank started it, so every rank
                // completes it, and drops it.
                if let Some(g) = other {
                    drop(self.finish_gather(g)?);
                }
                let (send, layout) = self.pack(&which)?;
                let recv = self.all_gather(send)?;
                deliver(&recv, &layout)?
            }
        };
        if on {
            let next = lock(&self.state).prefetch.follow(which);
            if let Some(next) = next {
                let g = self.start_gather(&next)?;
                lock(&self.state).prefetch.in_flight = Some(g);
            }
        }
        Ok(out)
    }

    /// The end of a step's gathers: one still in flight completed and dropped, and this step's
    /// order kept for the next.
    fn end_prefetch(&self) -> Result<(), DistError> {
        let stale = lock(&self.state).prefetch.end_step();
        if let Some(g) = stale {
            drop(self.finish_gather(g)?);
        }
        Ok(())
    }

    /// Whether each block's forward and backward start the next block's gather (see
    /// [`super::DataParallelOptions::prefetch`]).
    pub(crate) fn set_prefetch(&self, on: bool) {
        lock(&self.state).prefetch.on = on;
    }

    /// Whether the blocks keep their activations instead of recomputing them in backward (see
    /// [`super::DataParallelOptions::recompute`]).
    pub(crate) fn set_recompute(&self, on: bool) {
        lock(&self.state).keep_activations = !on;
    }

    /// The step: the reduced gradients' presence agreed, unscaled and checked through the
    /// scaler, clipped by the norm over every rank's shards (with `max_norm`), each piece
    /// updated, the parameters outside blocks all-gathered back into the model, and (once) the
    /// model's copies of the blocks' parameters handed back.
    pub(crate) fn step(
        &self,
        vars: &[Var],
        (scaler, max_norm): (Option<&mut GradScaler>, Option<f64>),
        lr: f64,
    ) -> Result<(Stepped, ReduceStats), TrainError> {
        self.finish_pending()?;
        let outcome = match vars.first() {
            Some(v) if v.device().is_cuda() => self.update_on_gpu(v.device(), (scaler, max_norm), lr)?,
            _ => self.update_pieces((scaler, max_norm), lr)?,
        };
        // Every rank's updated pieces of the parameters read outside blocks, into the model.
        let rest: Vec<usize> = {
            let st = lock(&self.state);
            (0..st.shards.len()).filter(|&i| !st.shards[i].in_block).collect()
        };
        // One parameter at a time, written into the model's tensor from the receive buffer:
        // never more than one whole beside the model.
        for &i in &rest {
            match &self.tensors {
                Some(comm) => self.gather_into_tensors(comm.as_ref(), i, &vars[i])?,
                None => self.gather_into(i, vars[i].as_tensor())?,
            }
        }
        Ok((outcome, self.settle(vars)?))
    }

    /// The step's arithmetic on the host: the reduced gradients' presence agreed, unscaled and
    /// checked through the scaler, clipped by the norm over every rank's shards, each present
    /// piece updated; the gradients dropped.
    fn update_pieces(
        &self,
        (mut scaler, max_norm): (Option<&mut GradScaler>, Option<f64>),
        lr: f64,
    ) -> Result<Stepped, TrainError> {
        let mut st = lock(&self.state);
        st.optimizer.set_lr(lr);
        let local: Vec<u8> = st.shards.iter().map(|s| s.grad.is_some() as u8).collect();
        let mut present = vec![0u8; local.len()];
        self.group.comm().all_reduce(&local, &mut present, ReduceOp::Max)?;
        let mut skipped = false;
        if let Some(s) = scaler.as_deref_mut() {
            let inv = (1.0 / s.scale()) as f32;
            let mut found = false;
            for sh in st.shards.iter_mut() {
                if let Some(g) = &mut sh.grad {
                    g.iter_mut().for_each(|v| *v *= inv);
                    rounded(g, sh.dtype);
                    found |= g.iter().any(|v| !v.is_finite());
                }
            }
            skipped = self.group.any(found)?;
            s.set_found_inf(skipped);
        }
        let outcome = if skipped {
            (StepOutcome::Skipped, None)
        } else {
            let (factor, norm) = self.clip(&st, max_norm)?;
            (Self::update(&mut st, &present, factor)?, norm)
        };
        if let Some(s) = scaler {
            s.update()?;
        }
        st.shards.iter_mut().for_each(|s| s.grad = None);
        Ok(outcome)
    }

    /// The end of a step, once the parameters outside the blocks are back in the model: the
    /// model's copies of the blocks' parameters handed back (once; they read as zeros), each
    /// whole f32 parameter outside them made its own piece's master, and the step's figures.
    fn settle(&self, vars: &[Var]) -> Result<ReduceStats, TrainError> {
        let mut st = lock(&self.state);
        for (s, v) in st.shards.iter_mut().zip(vars) {
            if s.in_block && !s.released {
                wick_nn::pages::release(v.as_tensor())?;
                s.released = true;
            } else if !s.in_block && s.dtype == DType::F32 && !s.viewed && s.len > 0 {
                // A whole f32 parameter is its own master, as in the other stages: its piece
                // becomes a view of it (the values are the same, to the bit).
                s.master = v.as_tensor().flatten_all()?.narrow(0, s.offset, s.len)?;
                s.viewed = true;
            }
        }
        Ok(std::mem::take(&mut st.stats))
    }

    /// Gradient clipping's coefficient and the norm, over this rank's shards and the others'.
    fn clip(&self, st: &State, max_norm: Option<f64>) -> Result<(f32, Option<f64>), TrainError> {
        clip_over_ranks(&self.group, max_norm, || {
            Ok(st.shards.iter().filter_map(|s| s.grad.as_deref()).map(wick_kernels::cpu::optim::sum_of_squares).sum())
        })
    }

    fn update(st: &mut State, present: &[u8], factor: f32) -> Result<StepOutcome, TrainError> {
        st.step += 1;
        let (t, optimizer) = (st.step as i32, st.optimizer);
        for (s, _) in st.shards.iter_mut().zip(present).filter(|(s, p)| **p != 0 && s.len > 0) {
            let g = match &s.grad {
                Some(g) => Tensor::from_slice(g, s.len, &Device::Cpu)?,
                None => Tensor::zeros(s.len, DType::F32, &Device::Cpu)?,
            };
            if s.state.is_empty() {
                s.state = zeroed_state(optimizer, s.len, &Device::Cpu)?;
            }
            s.state = crate::optim::step(&s.master, &g, &s.state, (optimizer, t), factor)?;
        }
        Ok(StepOutcome::Applied)
    }

    /// The update rule (its current learning rate).
    pub(crate) fn optimizer(&self) -> Optimizer {
        lock(&self.state).optimizer
    }

    /// Optimizer steps taken.
    pub(crate) fn steps(&self) -> u64 {
        lock(&self.state).step
    }

    /// Bytes of this rank's f32 masters of low-precision parameters (an f32 parameter's piece
    /// is the parameter itself, as in the other stages) and of its optimizer state.
    pub(crate) fn memory_bytes(&self) -> (usize, usize) {
        let st = lock(&self.state);
        let master = st.shards.iter().filter(|s| s.dtype != DType::F32).map(|s| s.len * 4).sum();
        let state = st.shards.iter().map(|s| s.state.len() * s.len * 4).sum();
        (master, state)
    }

    /// Bytes of this rank's pieces of f32 parameters the blocks take (the only copy of those
    /// values on this rank once the model's are handed back; low-precision parameters' pieces
    /// are their masters, in [`ParamShards::memory_bytes`]).
    pub(crate) fn block_piece_bytes(&self) -> usize {
        let st = lock(&self.state);
        st.shards.iter().filter(|s| s.in_block && s.dtype == DType::F32).map(|s| s.len * 4).sum()
    }

    /// Takes over from `earlier` (the shard this one replaces, on a resume) which parameters the
    /// blocks take and which model copies were handed back: those are not written again.
    pub(crate) fn inherit(&self, earlier: &ParamShards) {
        let old = lock(&earlier.state);
        let mut st = lock(&self.state);
        for (s, o) in st.shards.iter_mut().zip(&old.shards) {
            (s.in_block, s.released) = (o.in_block, o.released);
        }
    }

    /// Whether the model's own tensor of parameter `i` was handed back (it reads as zeros).
    pub(crate) fn released(&self, i: usize) -> bool {
        lock(&self.state).shards.get(i).is_some_and(|s| s.released)
    }

    /// Every parameter whole, as fresh tensors (a collective: every rank calls it).
    pub(crate) fn gather_all(&self) -> Result<Vec<Tensor>, TrainError> {
        if let Some(comm) = &self.tensors {
            return self.gather_all_tensors(comm.as_ref());
        }
        let n = lock(&self.state).shards.len();
        let mut out = Vec::with_capacity(n);
        // One parameter at a time: never more than one whole beside the shards.
        for i in 0..n {
            out.extend(self.gather_whole(&[i])?.into_iter().map(|t| t.detach()));
        }
        Ok(out)
    }

    /// This rank's share of a checkpoint: every piece's master and state, named
    /// `master/NAME#OFFSET` and `stateK/NAME#OFFSET`.
    pub(crate) fn checkpoint_tensors(&self, names: &[String]) -> Result<HashMap<String, Tensor>, TrainError> {
        let st = lock(&self.state);
        let mut out = HashMap::new();
        for (s, name) in st.shards.iter().zip(names).filter(|(s, _)| s.len > 0) {
            // A piece of its own size (`copy` of a view would clone the parameter behind it).
            out.insert(format!("master/{name}#{}", s.offset), s.master.force_contiguous()?);
            for k in 0..st.optimizer.states() {
                let t = match s.state.get(k) {
                    Some(t) => t.copy()?,
                    None => Tensor::zeros(s.len, DType::F32, &Device::Cpu)?,
                };
                out.insert(format!("state{k}/{name}#{}", s.offset), t);
            }
        }
        Ok(out)
    }
}

impl wick_nn::checkpoint::ShardedBlocks for ParamShards {
    fn gather(&self, weights: &[Tensor]) -> candle_core::Result<Vec<Tensor>> {
        let which = self.indices(weights)?;
        self.gather_block(which).map_err(candle_core::Error::wrap)
    }

    fn reduce(&self, weights: &[Tensor], grads: Vec<Option<Tensor>>) -> candle_core::Result<()> {
        let which = self.indices(weights)?;
        self.reduce_into(&which, &grads).map_err(candle_core::Error::wrap)
    }

    fn keeps_activations(&self) -> bool {
        lock(&self.state).keep_activations
    }

    fn regather(&self, weights: &[Tensor], into: &[Tensor]) -> candle_core::Result<()> {
        let which = self.indices(weights)?;
        self.regather_block(which, into).map_err(candle_core::Error::wrap)
    }
}

/// The hooks a [`wick_nn::checkpoint::Checkpointing::sharded`] context takes.
pub(crate) fn blocks(shards: &Arc<ParamShards>) -> Arc<dyn wick_nn::checkpoint::ShardedBlocks> {
    shards.clone()
}
