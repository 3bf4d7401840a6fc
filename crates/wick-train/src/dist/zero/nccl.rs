//! ZeRO stages 1 and 2 on GPU ranks (feature `nccl`): the host path's shard — the same buckets,
//! blocks and pieces ([`super`]) — with each piece's f32 master and optimizer state on the
//! rank's GPU. A step: each bucket packed (padded to a multiple of the world size) and reduced by
//! NCCL in place (stage 1: all-reduced whole) or reduce-scattered (stage 2: this rank keeps its
//! block), bucket by bucket as the local gradients are taken; the loss scaler's unscale and inf
//! check, and clipping's squares, by the fused multi-tensor kernels over this rank's pieces;
//! this rank's pieces updated in one launch per gradient dtype (a low-precision parameter's
//! piece of the model written, rounded, by the same launch); then each bucket's updated block
//! all-gathered by NCCL and written into every rank's parameters.
//!
//! The host agrees, as on the host path, on which parameters have a gradient, on an inf/NaN
//! finding and on clipping's norm (one small MPI collective each), so the step reads three small
//! values back: it is an eager step (CUDA graphs with ZeRO are refused). The arithmetic is the
//! replicated GPU step's element by element — the same sums (one rank's reduction is its own
//! gradient), the same rounding of a low-precision gradient, the same kernels — so one rank of
//! ZeRO-1/2 takes the replicated step to the bit (`scripts/gpu-check.sh`'s `nccl_check`).

use std::time::Instant;

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor, Var};

use super::{Stepped, ZeroOptimizer};
use crate::amp::cuda::StepItem;
use crate::amp::{GradScaler, StepOutcome};
use crate::dist::buckets::{agreed_presence, ReduceStats};
use crate::dist::error::DistError;
use crate::dist::nccl::{packed, NcclGroup};
use crate::dist::pieces::clip_over_ranks;
use crate::dist::{ProcessGroup, ReduceOp, Sharding};
use crate::error::TrainError;

/// A piece's place in the shard: its bucket and its index among the bucket's pieces.
type At = (usize, usize);

impl ZeroOptimizer {
    /// One sharded step of GPU parameters `vars` from this rank's local gradients `grads`
    /// (consumed) over `nccl`; `group` (MPI, or the process alone) agrees on what the ranks
    /// decide together. The outcome and the reduction's figures.
    pub(crate) fn step_nccl(
        &mut self,
        group: &ProcessGroup,
        nccl: &NcclGroup,
        grads: &mut GradStore,
        vars: &[Var],
        (mut scaler, max_norm): (Option<&mut GradScaler>, Option<f64>),
    ) -> Result<(Stepped, ReduceStats), TrainError> {
        let (rank, world) = (nccl.rank(), nccl.world_size());
        let device = vars.first().map(|v| v.device().clone()).ok_or_else(|| DistError::internal("no parameters"))?;
        let present = agreed_presence(group, grads, vars)?;
        let (reduced, stats) = self.reduce_nccl(nccl, grads, vars, &present)?;
        // Each present piece's gradient: rounded to its parameter's dtype (a copy) when that is
        // not f32, as the replicated path's buckets give them back; an f32 one a view of its
        // bucket's reduced values when every piece of the bucket is f32, else a copy too, so
        // that no f32 bucket outlives its own loop turn beside low-precision copies of it (a
        // rank then holds at most its pieces' gradients and one bucket's reduced values).
        let mut pieces: Vec<(At, Tensor)> = Vec::new();
        for (bi, (b, values)) in self.buckets.iter().zip(reduced).enumerate() {
            let at = self.own_block_at(rank, b);
            let all_f32 = b.pieces.iter().all(|p| vars[p.param].dtype() == DType::F32);
            for (pi, p) in b.pieces.iter().enumerate().filter(|(_, p)| present[p.param]) {
                let g = values.narrow(0, at + p.at, p.len)?;
                let g = match vars[p.param].dtype() {
                    DType::F32 if all_f32 => g,
                    DType::F32 => g.force_contiguous()?,
                    dtype => g.to_dtype(dtype)?,
                };
                pieces.push(((bi, pi), g));
            }
        }
        let kernels = crate::amp::cuda::shared(&device)?;
        let grad_refs: Vec<&Tensor> = pieces.iter().map(|(_, g)| g).collect();
        // The loss scaler (f16): unscale this rank's pieces in place on the device, then every
        // rank takes the same decision from the all-reduced finding before anything changes.
        let mut skipped = false;
        if let Some(s) = scaler.as_deref_mut() {
            let local = kernels.unscale_checked(&grad_refs, (1.0 / s.scale()) as f32)?;
            skipped = group.any(local)?;
            s.set_found_inf(skipped);
        }
        let outcome = if skipped {
            (StepOutcome::Skipped, None)
        } else {
            let squares = match max_norm {
                Some(_) if !grad_refs.is_empty() => kernels.squares_multi(&grad_refs)?,
                _ => 0.0,
            };
            let (factor, norm) = clip_over_ranks(group, max_norm, || Ok(squares))?;
            self.update_nccl(&kernels, &pieces, vars, factor)?;
            self.gather_nccl(nccl, vars, &device, world)?;
            (StepOutcome::Applied, norm)
        };
        if let Some(s) = scaler {
            s.update()?;
        }
        Ok((outcome, stats))
    }

    /// Each bucket's local gradients taken out of `grads`, packed and padded, and reduced over
    /// the ranks: all-reduced in place (stage 1) or reduce-scattered to this rank's block (stage
    /// 2, the packed bucket freed at once).
    fn reduce_nccl(
        &self,
        nccl: &NcclGroup,
        grads: &mut GradStore,
        vars: &[Var],
        present: &[bool],
    ) -> Result<(Vec<Tensor>, ReduceStats), TrainError> {
        let world = nccl.world_size();
        let mut stats = ReduceStats::default();
        let mut reduced = Vec::with_capacity(self.buckets.len());
        for b in &self.buckets {
            let t0 = Instant::now();
            let members: Vec<usize> = b.members.iter().map(|&(i, _)| i).collect();
            let elems: usize = members.iter().map(|&i| vars[i].elem_count()).sum();
            let padded = b.block.checked_mul(world).ok_or_else(|| DistError::internal("bucket size overflows"))?;
            let bucket = packed(&members, grads, vars, present, padded.saturating_sub(elems))?;
            let t1 = Instant::now();
            let values = match self.stage {
                Sharding::OptimizerState => {
                    nccl.all_reduce_in_place(&bucket)?;
                    bucket
                }
                _ => nccl.reduce_scatter(&bucket, ReduceOp::Sum)?,
            };
            stats.buckets += 1;
            stats.bytes += padded * 4;
            stats.comm_s += t1.elapsed().as_secs_f64();
            stats.pack_s += (t1 - t0).as_secs_f64();
            reduced.push(values);
        }
        stats.exposed_s = stats.comm_s + stats.pack_s;
        Ok((reduced, stats))
    }

    /// The update of this rank's `pieces` (their gradients, unscaled) in one multi-tensor launch
    /// per gradient dtype, every gradient multiplied by `factor`: a low-precision parameter's f32
    /// master, with its piece of the model rounded by the same launch; an f32 parameter's piece
    /// in place. A piece's optimizer state is made, zeroed, at its first update.
    fn update_nccl(
        &mut self,
        kernels: &crate::amp::cuda::AmpKernels,
        pieces: &[(At, Tensor)],
        vars: &[Var],
        factor: f32,
    ) -> Result<(), TrainError> {
        self.step += 1;
        let t = i32::try_from(self.step).map_err(|_| DistError::internal("the step count overflows"))?;
        // (target, model copy) of each piece: the parameter's piece itself where it is f32.
        let mut targets = Vec::with_capacity(pieces.len());
        for &((bi, pi), _) in pieces {
            let b = &mut self.buckets[bi];
            let p = &b.pieces[pi];
            if b.states[pi].is_empty() {
                b.states[pi] = super::zeroed_state(self.optimizer, p.len, vars[p.param].device())?;
            }
            let model = p.master.is_some().then(|| p.of_param(vars)).transpose()?;
            targets.push((p.f32_values(vars)?, model));
        }
        let items: Vec<StepItem<'_>> = pieces
            .iter()
            .zip(&targets)
            .map(|(((bi, pi), grad), (target, model))| StepItem {
                target,
                grad,
                state: &self.buckets[*bi].states[*pi],
                model: model.as_ref(),
            })
            .collect();
        kernels.optimizer_step_multi_(&items, self.optimizer, t, None, factor)
    }

    /// Each bucket's block of updated f32 values (each piece's master, or its parameter's piece
    /// when that is f32; zeros for the padding) all-gathered over the ranks and written into
    /// every parameter of the bucket, rounded to its dtype.
    fn gather_nccl(&self, nccl: &NcclGroup, vars: &[Var], device: &Device, world: usize) -> Result<(), TrainError> {
        for b in &self.buckets {
            let mut parts = Vec::with_capacity(b.pieces.len() + 1);
            let mut filled = 0usize;
            for p in &b.pieces {
                parts.push(p.f32_values(vars)?);
                filled += p.len;
            }
            if filled < b.block {
                parts.push(Tensor::zeros(b.block - filled, DType::F32, device)?);
            }
            let mine = Tensor::cat(&parts, 0)?;
            drop(parts);
            let full = nccl.all_gather(&mine)?;
            drop(mine);
            if full.elem_count() != b.block * world {
                return Err(DistError::internal("an all-gather of the wrong length").into());
            }
            for &(i, start) in &b.members {
                let v = &vars[i];
                let values = full.narrow(0, start, v.elem_count())?.reshape(v.dims())?;
                v.set(&if v.dtype() == DType::F32 { values } else { values.to_dtype(v.dtype())? })?;
            }
        }
        Ok(())
    }
}
