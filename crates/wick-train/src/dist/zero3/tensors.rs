//! ZeRO-3's tensor path: the host path's shards ([`super`]) — the same pieces, the same blocks,
//! the same order of collectives — with every piece's f32 master, optimizer state and gradient
//! a tensor on the parameters' device and the collectives on tensors ([`TensorCollectives`]).
//! GPU ranks take it over NCCL (feature `nccl`); host ranks can take it over the process
//! group's tensor collectives ([`super::super::DataParallelOptions::tensor_path`]), which is how
//! its layouts are checked at two ranks where there are no GPUs (the host path, byte buffers
//! with MPI's non-blocking collectives, is the faster one there).
//!
//! - A block's gather: this rank's pieces rounded to their parameters' dtypes and padded to their
//!   chunks, end to end (one all-gather per dtype the block holds); each parameter's values cut
//!   from every rank's section into a fresh variable. Kept graphs
//!   ([`super::super::DataParallelOptions::recompute`] off) get their tensors' memory back by
//!   [`wick_nn::pages::refill`] on a GPU (no copy beside the gather's), written in place on the
//!   host.
//! - A block's reduction: its gradients widened to f32, each padded to the world size times its
//!   chunk and laid out rank by rank, reduce-scattered at once (NCCL runs on the compute stream:
//!   nothing is left in flight as on the host path); each piece's sum rounded to the parameter's
//!   dtype, as the replicated paths give gradients back, and added to the step's (on the host,
//!   to the host path's own gradients of the pieces).
//! - The step ([`ParamShards::step`], shared with the host path): the ranks agree on presence,
//!   the inf finding and the norm on the host (one small collective each); on a GPU the unscale,
//!   clipping's squares and the update run on the fused multi-tensor kernels (one launch per
//!   gradient dtype), on the host the host path's arithmetic runs; the parameters read outside
//!   the blocks are gathered back one at a time into the model's tensors; after the first update the model's own tensors of the
//!   blocks' parameters give their memory back ([`wick_nn::pages::release`]: they read as
//!   zeros; a CUDA tensor's storage becomes host zeros).
//!
//! One rank's arithmetic is the replicated step's: the same rounding of each gradient, the same
//! update on the same values. A single GPU runs one rank (NCCL refuses two ranks on one device),
//! so the GPU check is one-rank against the plain trainer to the bit (`scripts/gpu-check.sh`'s
//! `nccl_check`); two ranks run this path on the host in CI (`tests/multi_rank.rs`).

use std::collections::BTreeMap;
use std::time::Instant;

use candle_core::{DType, Device, Tensor, Var};

use super::{lock, ParamShards};
use crate::amp::GradScaler;
use crate::dist::error::DistError;
use crate::dist::zero::Stepped;
use crate::dist::{ProcessGroup, ReduceOp};
use crate::error::TrainError;

/// The collectives over tensors the tensor path needs: NCCL's on GPU ranks, the process group's
/// on host ranks. Both concatenate (all-gather) and cut (reduce-scatter) along the first axis in
/// rank order.
pub(crate) trait TensorCollectives: Send + Sync {
    /// Every rank's `t` end to end along the first axis.
    fn all_gather(&self, t: &Tensor) -> Result<Tensor, DistError>;
    /// This rank's block of the reduction of `t`, cut along the first axis.
    fn reduce_scatter(&self, t: &Tensor, op: ReduceOp) -> Result<Tensor, DistError>;
}

impl TensorCollectives for ProcessGroup {
    fn all_gather(&self, t: &Tensor) -> Result<Tensor, DistError> {
        ProcessGroup::all_gather(self, t)
    }

    fn reduce_scatter(&self, t: &Tensor, op: ReduceOp) -> Result<Tensor, DistError> {
        ProcessGroup::reduce_scatter(self, t, op)
    }
}

#[cfg(feature = "nccl")]
impl TensorCollectives for crate::dist::nccl::NcclGroup {
    fn all_gather(&self, t: &Tensor) -> Result<Tensor, DistError> {
        crate::dist::nccl::NcclGroup::all_gather(self, t)
    }

    fn reduce_scatter(&self, t: &Tensor, op: ReduceOp) -> Result<Tensor, DistError> {
        crate::dist::nccl::NcclGroup::reduce_scatter(self, t, op)
    }
}

#[cfg(not(feature = "nccl"))]
impl TensorCollectives for crate::dist::GpuComm {
    fn all_gather(&self, _: &Tensor) -> Result<Tensor, DistError> {
        match *self {}
    }

    fn reduce_scatter(&self, _: &Tensor, _: ReduceOp) -> Result<Tensor, DistError> {
        match *self {}
    }
}

/// Parameter `i`'s piece of a dtype's section: where it starts and its chunk.
struct Placed {
    i: usize,
    start: usize,
    chunk: usize,
}

impl ParamShards {
    /// Every rank's pieces of parameters `which`, whole, as fresh variables on the parameters'
    /// device (in `which`'s order): one all-gather per dtype.
    fn gathered_tensors(&self, comm: &dyn TensorCollectives, which: &[usize]) -> Result<Vec<Tensor>, DistError> {
        let world = self.group.world_size();
        let t0 = Instant::now();
        // The parameters by dtype: where each one's piece lies in its dtype's section.
        let mut sections: BTreeMap<u8, (DType, Vec<Placed>, usize)> = BTreeMap::new();
        let device = {
            let st = lock(&self.state);
            for &i in which {
                let s = &st.shards[i];
                let entry = sections.entry(dtype_key(s.dtype)).or_insert_with(|| (s.dtype, vec![], 0));
                entry.1.push(Placed { i, start: entry.2, chunk: s.chunk });
                entry.2 += s.chunk;
            }
            match which.first() {
                Some(&i) => st.shards[i].master.device().clone(),
                None => return Ok(Vec::new()),
            }
        };
        let mut out: Vec<Option<Tensor>> = vec![None; which.len()];
        let (mut comm_s, mut bytes) = (0.0, 0usize);
        for (_, (dtype, placed, section)) in sections {
            // This rank's pieces written into the section where they lie (the padding zeros),
            // each rounded to its dtype on the way: no copy of the whole section beside it.
            let send = Tensor::zeros(section, dtype, &device)?;
            for p in &placed {
                let st = lock(&self.state);
                let s = &st.shards[p.i];
                if s.len > 0 {
                    send.slice_set(&s.master.to_dtype(dtype)?.contiguous()?, 0, p.start)?;
                }
            }
            let t1 = Instant::now();
            let full = comm.all_gather(&send)?;
            comm_s += t1.elapsed().as_secs_f64();
            bytes += section * dtype.size_in_bytes();
            drop(send);
            let by_rank = full.reshape((world, section))?;
            for p in placed {
                let dims = lock(&self.state).shards[p.i].dims.clone();
                let elems: usize = dims.iter().product();
                // The parameter as a fresh variable, every rank's piece copied straight in.
                let var = Var::zeros(dims, dtype, &device)?;
                let flat = var.as_tensor().flatten_all()?;
                for r in 0..world {
                    let (from, to) = ((r * p.chunk).min(elems), ((r + 1) * p.chunk).min(elems));
                    if to > from {
                        let piece = by_rank.narrow(0, r, 1)?.narrow(1, p.start, to - from)?.reshape(to - from)?;
                        flat.slice_set(&piece, 0, from)?;
                    }
                }
                let k = which.iter().position(|&w| w == p.i).ok_or_else(|| DistError::internal("gather order"))?;
                out[k] = Some(var.as_tensor().clone());
            }
        }
        let mut st = lock(&self.state);
        st.stats.comm_s += comm_s;
        st.stats.pack_s += t0.elapsed().as_secs_f64() - comm_s;
        st.stats.bytes += bytes;
        out.into_iter().map(|t| t.ok_or_else(|| DistError::internal("a parameter left out of a gather"))).collect()
    }

    /// Block `which`'s parameters whole (marked as the blocks' own).
    pub(in crate::dist::zero3) fn gather_block_tensors(
        &self,
        comm: &dyn TensorCollectives,
        which: &[usize],
    ) -> Result<Vec<Tensor>, DistError> {
        {
            let mut st = lock(&self.state);
            which.iter().for_each(|&i| st.shards[i].in_block = true);
        }
        self.gathered_tensors(comm, which)
    }

    /// Block `which`'s parameters whole again in `into` (tensors an earlier gather of them
    /// returned, released since): on a GPU each gets the fresh values' device memory, on the
    /// host the values are written into its pages.
    pub(in crate::dist::zero3) fn regather_block_tensors(
        &self,
        comm: &dyn TensorCollectives,
        which: &[usize],
        into: &[Tensor],
    ) -> Result<(), DistError> {
        if into.len() != which.len() {
            return Err(DistError::internal("ZeRO-3: parameters gathered into another number of tensors"));
        }
        for (fresh, target) in self.gathered_tensors(comm, which)?.iter().zip(into) {
            if target.device().is_cuda() {
                wick_nn::pages::refill(target, fresh)?;
            } else {
                // Host pages come back by being written (counted again first).
                wick_nn::pages::reclaim(target)?;
                target.flatten_all()?.slice_set(&fresh.flatten_all()?, 0, 0)?;
            }
        }
        Ok(())
    }

    /// Every parameter whole, as fresh tensors, one at a time (a collective).
    pub(in crate::dist::zero3) fn gather_all_tensors(
        &self,
        comm: &dyn TensorCollectives,
    ) -> Result<Vec<Tensor>, TrainError> {
        let n = lock(&self.state).shards.len();
        let mut out = Vec::with_capacity(n);
        for i in 0..n {
            out.extend(self.gathered_tensors(comm, &[i])?.into_iter().map(|t| t.detach()));
        }
        Ok(out)
    }

    /// Sums the gradients `grads` of parameters `which` over ranks into each rank's pieces
    /// (one reduce-scatter; a missing gradient counts zeros), rounded to the parameters'
    /// dtypes, and adds them to the step's.
    pub(in crate::dist::zero3) fn reduce_into_tensors(
        &self,
        comm: &dyn TensorCollectives,
        which: &[usize],
        grads: &[Option<Tensor>],
    ) -> Result<(), DistError> {
        let t0 = Instant::now();
        let world = self.group.world_size();
        let mut placed = Vec::with_capacity(which.len());
        let mut section = 0usize;
        let device = {
            let st = lock(&self.state);
            for &i in which {
                placed.push((i, section));
                section += st.shards[i].chunk;
            }
            match which.first() {
                Some(&i) => st.shards[i].master.device().clone(),
                None => return Ok(()),
            }
        };
        // One f32 gradient that splits evenly over the ranks (no padding) is sent from where it
        // lies, as on the host path.
        let direct = match grads {
            [Some(g)] if g.dtype() == DType::F32 && g.is_contiguous() && g.elem_count() == section * world => {
                Some(g.flatten_all()?)
            }
            _ => None,
        };
        let send = match direct {
            Some(g) => g,
            None => self.packed_gradients(&placed, grads, (world, section), &device)?,
        };
        let t1 = Instant::now();
        let mine = comm.reduce_scatter(&send, ReduceOp::Sum)?;
        let t2 = Instant::now();
        drop(send);
        let mut st = lock(&self.state);
        for (i, start) in placed {
            let s = &mut st.shards[i];
            if !mine.device().is_cuda() {
                // On the host the piece joins the host path's gradients, summed and rounded there.
                s.add_piece(mine.narrow(0, start, s.len)?.to_vec1::<f32>()?);
                continue;
            }
            if s.len == 0 {
                continue;
            }
            // The sum rounded to the parameter's dtype; an f32 piece of a block is a copy of its
            // own size (`copy` of a view would clone the whole buffer behind it), so that no
            // block's whole reduction outlives its turn beside the pieces.
            let view = mine.narrow(0, start, s.len)?;
            let piece = match s.dtype {
                DType::F32 if which.len() == 1 => view,
                DType::F32 => view.force_contiguous()?,
                dtype => view.to_dtype(dtype)?,
            };
            s.device_grad = Some(match s.device_grad.take() {
                Some(sum) => (sum + piece)?,
                None => piece,
            });
        }
        st.stats.buckets += 1;
        st.stats.bytes += section * world * 4;
        st.stats.comm_s += (t2 - t1).as_secs_f64();
        st.stats.pack_s += (t1 - t0).as_secs_f64() + t2.elapsed().as_secs_f64();
        Ok(())
    }

    /// Rank r's section (row r of a `(world, section)` f32 buffer, flattened): its piece of every
    /// parameter, end to end. Each gradient is written in where its pieces lie, widened to f32 a
    /// part at a time (a missing one and the padding stay zeros): nothing beside the buffer but
    /// one part's widened copy.
    fn packed_gradients(
        &self,
        placed: &[(usize, usize)],
        grads: &[Option<Tensor>],
        (world, section): (usize, usize),
        device: &Device,
    ) -> Result<Tensor, DistError> {
        let send = Tensor::zeros((world, section), DType::F32, device)?;
        for (&(i, start), g) in placed.iter().zip(grads) {
            let Some(g) = g else { continue };
            let chunk = lock(&self.state).shards[i].chunk;
            let g = g.flatten_all()?;
            let elems = g.elem_count();
            let (rows, rest) = (elems / chunk, elems % chunk);
            if rows > 0 {
                let part = g.narrow(0, 0, rows * chunk)?.to_dtype(DType::F32)?.contiguous()?;
                send.narrow(0, 0, rows)?.slice_set(&part.reshape((rows, chunk))?, 1, start)?;
            }
            if rest > 0 {
                let part = g.narrow(0, rows * chunk, rest)?.to_dtype(DType::F32)?.contiguous()?;
                send.narrow(0, rows, 1)?.slice_set(&part.reshape((1, rest))?, 1, start)?;
            }
        }
        Ok(send.flatten_all()?)
    }

    /// Every rank's piece of parameter `i` (outside the blocks) written into `var`, the model's
    /// own tensor of it: no whole copy beside the gather's buffer.
    pub(in crate::dist::zero3) fn gather_into_tensors(
        &self,
        comm: &dyn TensorCollectives,
        i: usize,
        var: &Var,
    ) -> Result<(), TrainError> {
        let t0 = Instant::now();
        let (send, dims, dtype) = {
            let st = lock(&self.state);
            let s = &st.shards[i];
            let piece = s.master.to_dtype(s.dtype)?.contiguous()?;
            let send = if s.len == s.chunk {
                piece
            } else {
                let send = Tensor::zeros(s.chunk, s.dtype, s.master.device())?;
                if s.len > 0 {
                    send.slice_set(&piece, 0, 0)?;
                }
                send
            };
            (send, s.dims.clone(), s.dtype)
        };
        let t1 = Instant::now();
        let full = comm.all_gather(&send)?;
        let comm_s = t1.elapsed().as_secs_f64();
        drop(send);
        let elems: usize = dims.iter().product();
        var.set(&full.narrow(0, 0, elems)?.reshape(dims)?)?;
        let mut st = lock(&self.state);
        st.stats.comm_s += comm_s;
        st.stats.pack_s += t0.elapsed().as_secs_f64() - comm_s;
        st.stats.bytes += full.elem_count() / self.group.world_size().max(1) * dtype.size_in_bytes();
        Ok(())
    }

    /// The step's arithmetic on GPU ranks, on the fused multi-tensor kernels: the presence of
    /// each piece's gradient, the inf finding and clipping's norm agreed on the host as the host
    /// path agrees them; the unscale in place, the squares, and each present piece updated in one
    /// launch per gradient dtype (a piece's optimizer state made, zeroed, at its first update);
    /// the gradients dropped.
    #[cfg(feature = "cuda")]
    pub(in crate::dist::zero3) fn update_on_gpu(
        &self,
        device: &Device,
        (mut scaler, max_norm): (Option<&mut GradScaler>, Option<f64>),
        lr: f64,
    ) -> Result<Stepped, TrainError> {
        use crate::amp::cuda::StepItem;
        use crate::amp::StepOutcome;
        use crate::dist::pieces::clip_over_ranks;
        use crate::dist::zero::zeroed_state;
        let kernels = crate::amp::cuda::shared(device)?;
        let mut st = lock(&self.state);
        st.optimizer.set_lr(lr);
        let local: Vec<u8> = st.shards.iter().map(|s| s.device_grad.is_some() as u8).collect();
        let mut present = vec![0u8; local.len()];
        self.group.comm().all_reduce(&local, &mut present, ReduceOp::Max)?;
        let grads: Vec<&Tensor> = st.shards.iter().filter_map(|s| s.device_grad.as_ref()).collect();
        let mut skipped = false;
        if let Some(s) = scaler.as_deref_mut() {
            skipped = self.group.any(kernels.unscale_checked(&grads, (1.0 / s.scale()) as f32)?)?;
            s.set_found_inf(skipped);
        }
        let outcome = if skipped {
            (StepOutcome::Skipped, None)
        } else {
            let squares = if max_norm.is_some() && !grads.is_empty() { kernels.squares_multi(&grads)? } else { 0.0 };
            let (factor, norm) = clip_over_ranks(&self.group, max_norm, || Ok(squares))?;
            st.step += 1;
            let t = i32::try_from(st.step).map_err(|_| DistError::internal("the step count overflows"))?;
            let optimizer = st.optimizer;
            let mut zeros = Vec::new();
            for (s, _) in st.shards.iter_mut().zip(&present).filter(|(s, p)| **p != 0 && s.len > 0) {
                if s.state.is_empty() {
                    s.state = zeroed_state(optimizer, s.len, device)?;
                }
                // Another rank's gradient only: this rank's share of it is zeros.
                zeros.push(match s.device_grad {
                    Some(_) => None,
                    None => Some(Tensor::zeros(s.len, s.dtype, device)?),
                });
            }
            let items: Vec<StepItem<'_>> = st
                .shards
                .iter()
                .zip(&present)
                .filter(|(s, p)| **p != 0 && s.len > 0)
                .zip(&zeros)
                .filter_map(|((s, _), zero)| {
                    let grad = s.device_grad.as_ref().or(zero.as_ref())?;
                    Some(StepItem { target: &s.master, grad, state: &s.state, model: None })
                })
                .collect();
            kernels.optimizer_step_multi_(&items, optimizer, t, None, factor)?;
            (StepOutcome::Applied, norm)
        };
        if let Some(s) = scaler {
            s.update()?;
        }
        st.shards.iter_mut().for_each(|s| s.device_grad = None);
        Ok(outcome)
    }

    /// Without CUDA no parameter is on a GPU.
    #[cfg(not(feature = "cuda"))]
    pub(in crate::dist::zero3) fn update_on_gpu(
        &self,
        _: &Device,
        _: (Option<&mut GradScaler>, Option<f64>),
        _: f64,
    ) -> Result<Stepped, TrainError> {
        Err(DistError::internal("ZeRO-3: a GPU parameter in a build without CUDA").into())
    }
}

/// An order of dtypes for a block's sections (the same on every rank).
fn dtype_key(dtype: DType) -> u8 {
    match dtype {
        DType::F32 => 0,
        DType::BF16 => 1,
        DType::F16 => 2,
        DType::F64 => 3,
        _ => 4,
    }
}
