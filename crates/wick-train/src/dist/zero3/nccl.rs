//! ZeRO-3 on GPU ranks (feature `nccl`): the host path's shards ([`super`]) — the same pieces,
//! the same blocks, the same order of collectives — with every piece's f32 master, optimizer
//! state and gradient on the rank's GPU, and NCCL in place of MPI's byte buffers.
//!
//! - A block's gather: this rank's pieces of its parameters, each rounded to its parameter's
//!   dtype and padded to its chunk, end to end (one NCCL all-gather per dtype the block holds);
//!   each parameter's values cut from every rank's section into a fresh variable on the GPU.
//!   Kept graphs ([`super::super::DataParallelOptions::recompute`] off) get their tensors'
//!   device memory back by [`wick_nn::pages::refill`] (no copy beside the gather's).
//! - A block's reduction: its gradients widened to f32, each padded to the world size times its
//!   chunk and laid out rank by rank, reduce-scattered by NCCL at once (NCCL runs on the
//!   compute stream, so there is no reduction left in flight as on the host); each piece's sum
//!   rounded to the parameter's dtype, as the replicated GPU path's buckets give gradients back,
//!   and added to the step's.
//! - The step: the ranks agree on presence, the inf finding and the norm on the host (one small
//!   collective each, as on the host path); the unscale, clipping's squares and the update run
//!   on the fused multi-tensor kernels (one launch per gradient dtype); the parameters read
//!   outside the blocks are gathered back one at a time into the model's tensors; after the
//!   first update the model's own tensors of the blocks' parameters give their device memory
//!   back ([`wick_nn::pages::release`]: they read as zeros).
//!
//! One rank's arithmetic is the replicated GPU step's: the same rounding of each gradient, the
//! same kernels on the same values. A single GPU runs one rank (NCCL refuses two ranks on one
//! device), so the device check is one-rank against the plain trainer to the bit
//! (`scripts/gpu-check.sh`'s `nccl_check`); the two-rank arithmetic is the host path's.

#[cfg(feature = "nccl")]
mod on {
    use std::collections::BTreeMap;
    use std::time::Instant;

    use candle_core::{DType, Tensor, Var};

    use super::super::{lock, ParamShards, State};
    use crate::amp::cuda::StepItem;
    use crate::amp::{GradScaler, StepOutcome};
    use crate::dist::buckets::ReduceStats;
    use crate::dist::error::DistError;
    use crate::dist::nccl::NcclGroup;
    use crate::dist::pieces::clip_over_ranks;
    use crate::dist::zero::{zeroed_state, Stepped};
    use crate::dist::ReduceOp;
    use crate::error::TrainError;

    /// Parameter `i`'s piece of a dtype's section: where it starts and its chunk.
    struct Placed {
        i: usize,
        start: usize,
        chunk: usize,
    }

    impl ParamShards {
        /// Every rank's pieces of parameters `which`, whole, as fresh variables on the GPU (in
        /// `which`'s order): one all-gather per dtype.
        fn gathered_nccl(&self, nccl: &NcclGroup, which: &[usize]) -> Result<Vec<Tensor>, DistError> {
            let world = nccl.world_size();
            let t0 = Instant::now();
            // The parameters by dtype, each dtype's pieces end to end.
            let mut sections: BTreeMap<u8, (DType, Vec<Placed>, Vec<Tensor>, usize)> = BTreeMap::new();
            {
                let st = lock(&self.state);
                for &i in which {
                    let s = &st.shards[i];
                    let entry = sections.entry(dtype_key(s.dtype)).or_insert_with(|| (s.dtype, vec![], vec![], 0));
                    entry.1.push(Placed { i, start: entry.3, chunk: s.chunk });
                    entry.2.push(s.master.to_dtype(s.dtype)?);
                    if s.chunk > s.len {
                        entry.2.push(Tensor::zeros(s.chunk - s.len, s.dtype, s.master.device())?);
                    }
                    entry.3 += s.chunk;
                }
            }
            let mut out: Vec<Option<Tensor>> = vec![None; which.len()];
            let (mut comm_s, mut bytes) = (0.0, 0usize);
            for (_, (dtype, placed, parts, section)) in sections {
                let send = Tensor::cat(&parts, 0)?;
                drop(parts);
                let t1 = Instant::now();
                let full = nccl.all_gather(&send)?;
                comm_s += t1.elapsed().as_secs_f64();
                bytes += section * dtype.size_in_bytes();
                drop(send);
                let by_rank = full.reshape((world, section))?;
                for p in placed {
                    let dims = lock(&self.state).shards[p.i].dims.clone();
                    let elems: usize = dims.iter().product();
                    let values = by_rank.narrow(1, p.start, p.chunk)?.contiguous()?.flatten_all()?;
                    let values = values.narrow(0, 0, elems)?.reshape(dims)?;
                    let k = which.iter().position(|&w| w == p.i).ok_or_else(|| DistError::internal("gather order"))?;
                    out[k] = Some(Var::from_tensor(&values)?.as_tensor().clone());
                }
            }
            let mut st = lock(&self.state);
            st.stats.comm_s += comm_s;
            st.stats.pack_s += t0.elapsed().as_secs_f64() - comm_s;
            st.stats.bytes += bytes;
            out.into_iter().map(|t| t.ok_or_else(|| DistError::internal("a parameter left out of a gather"))).collect()
        }

        /// Block `which`'s parameters whole (marked as the blocks' own).
        pub(in crate::dist::zero3) fn gather_block_nccl(
            &self,
            nccl: &NcclGroup,
            which: &[usize],
        ) -> Result<Vec<Tensor>, DistError> {
            {
                let mut st = lock(&self.state);
                which.iter().for_each(|&i| st.shards[i].in_block = true);
            }
            self.gathered_nccl(nccl, which)
        }

        /// Block `which`'s parameters whole again in `into` (tensors an earlier gather of them
        /// returned, released since): each gets the fresh values' device memory.
        pub(in crate::dist::zero3) fn regather_block_nccl(
            &self,
            nccl: &NcclGroup,
            which: &[usize],
            into: &[Tensor],
        ) -> Result<(), DistError> {
            if into.len() != which.len() {
                return Err(DistError::internal("ZeRO-3: parameters gathered into another number of tensors"));
            }
            for (fresh, target) in self.gathered_nccl(nccl, which)?.iter().zip(into) {
                wick_nn::pages::refill(target, fresh)?;
            }
            Ok(())
        }

        /// Every parameter whole, as fresh tensors, one at a time (a collective).
        pub(in crate::dist::zero3) fn gather_all_nccl(&self, nccl: &NcclGroup) -> Result<Vec<Tensor>, TrainError> {
            let n = lock(&self.state).shards.len();
            let mut out = Vec::with_capacity(n);
            for i in 0..n {
                out.extend(self.gathered_nccl(nccl, &[i])?.into_iter().map(|t| t.detach()));
            }
            Ok(out)
        }

        /// Sums the gradients `grads` of parameters `which` over ranks into each rank's pieces
        /// (one reduce-scatter; a missing gradient counts zeros), rounded to the parameters'
        /// dtypes, and adds them to the step's.
        pub(in crate::dist::zero3) fn reduce_into_nccl(
            &self,
            nccl: &NcclGroup,
            which: &[usize],
            grads: &[Option<Tensor>],
        ) -> Result<(), DistError> {
            let t0 = Instant::now();
            let world = nccl.world_size();
            let mut rows = Vec::with_capacity(which.len());
            let mut placed = Vec::with_capacity(which.len());
            let mut section = 0usize;
            {
                let st = lock(&self.state);
                for (&i, g) in which.iter().zip(grads) {
                    let s = &st.shards[i];
                    let elems: usize = s.dims.iter().product();
                    let padded = s.chunk.checked_mul(world).ok_or_else(|| DistError::internal("gradient size"))?;
                    let device = s.master.device();
                    let mut flat = match g {
                        Some(g) => g.to_dtype(DType::F32)?.flatten_all()?,
                        None => Tensor::zeros(elems, DType::F32, device)?,
                    };
                    if padded > elems {
                        flat = Tensor::cat(&[flat, Tensor::zeros(padded - elems, DType::F32, device)?], 0)?;
                    }
                    rows.push(flat.reshape((world, s.chunk))?);
                    placed.push((i, section));
                    section += s.chunk;
                }
            }
            // Rank r's section: its piece of every parameter, end to end.
            let send = Tensor::cat(&rows, 1)?.flatten_all()?;
            drop(rows);
            let t1 = Instant::now();
            let mine = nccl.reduce_scatter(&send, ReduceOp::Sum)?;
            let t2 = Instant::now();
            drop(send);
            let mut st = lock(&self.state);
            for (i, start) in placed {
                let s = &mut st.shards[i];
                if s.len == 0 {
                    continue;
                }
                // The sum rounded to the parameter's dtype; an f32 piece of a block is a copy, so
                // that no block's whole reduction outlives its turn beside the pieces.
                let view = mine.narrow(0, start, s.len)?;
                let piece = match s.dtype {
                    DType::F32 if which.len() == 1 => view,
                    DType::F32 => view.copy()?,
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

        /// The step on GPU ranks (see the module's documentation).
        pub(in crate::dist::zero3) fn step_nccl(
            &self,
            nccl: &NcclGroup,
            vars: &[Var],
            (mut scaler, max_norm): (Option<&mut GradScaler>, Option<f64>),
            lr: f64,
        ) -> Result<(Stepped, ReduceStats), TrainError> {
            let device =
                vars.first().map(|v| v.device().clone()).ok_or_else(|| DistError::internal("no parameters"))?;
            let kernels = crate::amp::cuda::shared(&device)?;
            let mut st = lock(&self.state);
            st.optimizer.set_lr(lr);
            let local: Vec<u8> = st.shards.iter().map(|s| s.device_grad.is_some() as u8).collect();
            let mut present = vec![0u8; local.len()];
            self.group.comm().all_reduce(&local, &mut present, ReduceOp::Max)?;
            let mut skipped = false;
            if let Some(s) = scaler.as_deref_mut() {
                let grads: Vec<&Tensor> = st.shards.iter().filter_map(|s| s.device_grad.as_ref()).collect();
                let found = Tensor::zeros(1, DType::F32, &device)?;
                if !grads.is_empty() {
                    let inv_scale = Tensor::new(&[(1.0 / s.scale()) as f32], &device)?;
                    kernels.unscale_(&grads, &inv_scale, &found)?;
                }
                let local = found.to_vec1::<f32>()?.first().is_some_and(|f| *f != 0.0);
                skipped = self.group.any(local)?;
                s.set_found_inf(skipped);
            }
            let outcome = if skipped {
                (StepOutcome::Skipped, None)
            } else {
                let grads: Vec<&Tensor> = st.shards.iter().filter_map(|s| s.device_grad.as_ref()).collect();
                let squares = match max_norm {
                    Some(_) if !grads.is_empty() => kernels.squares_multi(&grads)?,
                    _ => 0.0,
                };
                let (factor, norm) = clip_over_ranks(&self.group, max_norm, || Ok(squares))?;
                Self::update_nccl(&mut st, &kernels, &present, factor)?;
                (StepOutcome::Applied, norm)
            };
            if let Some(s) = scaler {
                s.update()?;
            }
            st.shards.iter_mut().for_each(|s| s.device_grad = None);
            let rest: Vec<usize> = (0..st.shards.len()).filter(|&i| !st.shards[i].in_block).collect();
            drop(st);
            // The parameters read outside the blocks, one at a time, into the model's tensors.
            for &i in &rest {
                let whole = self.gathered_nccl(nccl, &[i])?;
                if let Some(values) = whole.first() {
                    vars[i].set(values)?;
                }
            }
            let mut st = lock(&self.state);
            for (s, v) in st.shards.iter_mut().zip(vars) {
                if s.in_block && !s.released {
                    wick_nn::pages::release(v.as_tensor())?;
                    s.released = true;
                } else if !s.in_block && s.dtype == DType::F32 && !s.viewed && s.len > 0 {
                    // A whole f32 parameter is its own master, as in the other stages.
                    s.master = v.as_tensor().flatten_all()?.narrow(0, s.offset, s.len)?;
                    s.viewed = true;
                }
            }
            let stats = std::mem::take(&mut st.stats);
            Ok((outcome, stats))
        }

        /// This rank's pieces updated in one multi-tensor launch per gradient dtype.
        fn update_nccl(
            st: &mut State,
            kernels: &crate::amp::cuda::AmpKernels,
            present: &[u8],
            factor: f32,
        ) -> Result<(), TrainError> {
            st.step += 1;
            let t = i32::try_from(st.step).map_err(|_| DistError::internal("the step count overflows"))?;
            let optimizer = st.optimizer;
            let mut grads = Vec::new();
            for (s, _) in st.shards.iter_mut().zip(present).filter(|(s, p)| **p != 0 && s.len > 0) {
                if s.state.is_empty() {
                    s.state = zeroed_state(optimizer, s.len, s.master.device())?;
                }
                // Another rank's gradient only: this rank's share of it is zeros.
                grads.push(match &s.device_grad {
                    Some(g) => g.clone(),
                    None => Tensor::zeros(s.len, s.dtype, s.master.device())?,
                });
            }
            let items: Vec<StepItem<'_>> = st
                .shards
                .iter()
                .zip(present)
                .filter(|(s, p)| **p != 0 && s.len > 0)
                .zip(&grads)
                .map(|((s, _), grad)| StepItem { target: &s.master, grad, state: &s.state, model: None })
                .collect();
            kernels.optimizer_step_multi_(&items, optimizer, t, None, factor)
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
}

#[cfg(not(feature = "nccl"))]
mod off {
    //! Without NCCL no shard has a GPU communicator: these are never reached.
    use candle_core::{Tensor, Var};

    use super::super::ParamShards;
    use crate::amp::GradScaler;
    use crate::dist::buckets::ReduceStats;
    use crate::dist::error::DistError;
    use crate::dist::zero::Stepped;
    use crate::dist::GpuComm;
    use crate::error::TrainError;

    impl ParamShards {
        pub(in crate::dist::zero3) fn gather_block_nccl(
            &self,
            n: &GpuComm,
            _: &[usize],
        ) -> Result<Vec<Tensor>, DistError> {
            match *n {}
        }

        pub(in crate::dist::zero3) fn regather_block_nccl(
            &self,
            n: &GpuComm,
            _: &[usize],
            _: &[Tensor],
        ) -> Result<(), DistError> {
            match *n {}
        }

        pub(in crate::dist::zero3) fn gather_all_nccl(&self, n: &GpuComm) -> Result<Vec<Tensor>, TrainError> {
            match *n {}
        }

        pub(in crate::dist::zero3) fn reduce_into_nccl(
            &self,
            n: &GpuComm,
            _: &[usize],
            _: &[Option<Tensor>],
        ) -> Result<(), DistError> {
            match *n {}
        }

        pub(in crate::dist::zero3) fn step_nccl(
            &self,
            n: &GpuComm,
            _: &[Var],
            _: (Option<&mut GradScaler>, Option<f64>),
            _: f64,
        ) -> Result<(Stepped, ReduceStats), TrainError> {
            match *n {}
        }
    }
}
