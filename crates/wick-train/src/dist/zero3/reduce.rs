//! ZeRO-3's gradient reductions: each block's gradients reduce-scattered into every rank's
//! pieces as soon as its backward is done, left in flight until the next block's, and the
//! gradients of the parameters read outside the blocks reduced one at a time after backward.

use std::time::Instant;

use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor, Var};

use super::{lock, ParamShards, Shard};
use crate::dist::error::DistError;
use crate::dist::pending::{Collective, Outgoing, Pending};
use crate::dist::pieces::{rounded, with_f32};
use crate::error::TrainError;

impl ParamShards {
    /// Sums the gradients `grads` of parameters `which` over ranks into each rank's pieces (one
    /// reduce-scatter; a missing gradient counts zeros), rounded to the parameters' dtypes as the
    /// replicated path does, and adds them to the step's. The reduce-scatter is left in flight
    /// (the previous one completed first): it runs on during the next block's gather and
    /// backward, and [`ParamShards::finish_pending`] completes it.
    pub(super) fn reduce_into(&self, which: &[usize], grads: &[Option<Tensor>]) -> Result<(), DistError> {
        if let Some(comm) = &self.tensors {
            return self.reduce_into_tensors(comm.as_ref(), which, grads);
        }
        self.finish_pending()?;
        let t0 = Instant::now();
        let world = self.group.world_size();
        let chunks: Vec<usize> = {
            let st = lock(&self.state);
            which.iter().map(|&i| st.shards[i].chunk).collect()
        };
        let section: usize = chunks.iter().sum();
        // One f32 gradient that splits evenly (no padding) is sent from where it lies.
        let direct = match (grads, chunks.as_slice()) {
            ([Some(g)], [chunk])
                if g.dtype() == DType::F32
                    && g.device().is_cpu()
                    && g.is_contiguous()
                    && g.elem_count() == chunk * world =>
            {
                Some(g.clone())
            }
            _ => None,
        };
        let send = match direct {
            Some(g) => Outgoing::Tensor(g),
            None => {
                let mut send = vec![0f32; section * world];
                // One gradient widened at a time, straight into each rank's section.
                let mut start = 0;
                for (g, &chunk) in grads.iter().zip(&chunks) {
                    if let Some(g) = g {
                        with_f32(g, |g| {
                            for r in 0..world {
                                let (a, b) = ((r * chunk).min(g.len()), ((r + 1) * chunk).min(g.len()));
                                let at = r * section + start;
                                send[at..at + (b - a)].copy_from_slice(&g[a..b]);
                            }
                        })?;
                    }
                    start += chunk;
                }
                Outgoing::Owned(send)
            }
        };
        let t1 = Instant::now();
        let pending = Pending::start(self.group.comm(), send, Collective::ReduceScatter)?;
        let t2 = Instant::now();
        let mut st = lock(&self.state);
        st.pending = Some((which.to_vec(), chunks, pending));
        st.stats.buckets += 1;
        st.stats.bytes += section * world * 4;
        st.stats.comm_s += (t2 - t1).as_secs_f64();
        st.stats.pack_s += (t1 - t0).as_secs_f64();
        Ok(())
    }

    /// The start of a step: what a step that failed in this process left behind — a
    /// reduce-scatter in flight, earlier micro-batches' gradients summed into the pieces, a
    /// block's gather prefetched, the gathers' order so far — dropped, so that every step starts
    /// from nothing, as the plain trainer's does. (On several ranks a failure inside a step ends
    /// the job instead: the others wait in a collective it will not reach.)
    pub(crate) fn begin_step(&self) -> Result<(), DistError> {
        self.finish_pending()?;
        let stale = {
            let mut st = lock(&self.state);
            st.shards.iter_mut().for_each(|s| (s.grad, s.device_grad) = (None, None));
            st.stats = Default::default();
            st.prefetch.abandon()
        };
        if let Some(g) = stale {
            drop(self.finish_gather(g)?);
        }
        Ok(())
    }

    /// Completes the reduce-scatter in flight, if any: each rank's piece of the sum added to
    /// the step's gradients.
    pub(super) fn finish_pending(&self) -> Result<(), DistError> {
        let Some((which, chunks, pending)) = lock(&self.state).pending.take() else { return Ok(()) };
        let t0 = Instant::now();
        let mut recv = pending.finish(self.group.comm())?;
        let t1 = Instant::now();
        let mut st = lock(&self.state);
        let mut at = 0;
        let single = which.len() == 1;
        for (&i, &chunk) in which.iter().zip(&chunks) {
            let s = &mut st.shards[i];
            // One parameter's piece is the receive buffer itself (no copy beside it).
            let piece = if single {
                recv.truncate(s.len);
                std::mem::take(&mut recv)
            } else {
                recv[at..at + s.len].to_vec()
            };
            at += chunk;
            s.add_piece(piece);
        }
        st.stats.comm_s += (t1 - t0).as_secs_f64();
        st.stats.pack_s += t1.elapsed().as_secs_f64();
        Ok(())
    }

    /// Reduces the gradients of the parameters read outside the blocks (in `grads`, removed
    /// from it), one parameter at a time; refuses a block's parameter that has one there too (used inside a block and
    /// outside).
    pub(crate) fn reduce_rest(&self, grads: &mut GradStore, vars: &[Var]) -> Result<(), TrainError> {
        let t0 = Instant::now();
        self.end_prefetch()?;
        self.finish_pending()?;
        let blocks: Vec<bool> = lock(&self.state).shards.iter().map(|s| s.in_block).collect();
        for (i, v) in vars.iter().enumerate() {
            let g = grads.remove(v.as_tensor());
            if blocks[i] {
                if g.is_some() {
                    let message = format!(
                        "parameter {i} is used inside a block and outside it: ZeRO-3 cannot shard a parameter the \
                         model also reads whole (train it with stage 2)"
                    );
                    return Err(DistError::unsupported("ZeRO-3", message).into());
                }
                continue;
            }
            // One parameter at a time, each reduction completed before the next gradient is
            // widened (no computation left to hide it behind; one at a time holds the least).
            self.reduce_into(&[i], &[g])?;
            self.finish_pending()?;
        }
        lock(&self.state).stats.exposed_s += t0.elapsed().as_secs_f64();
        Ok(())
    }
}

impl Shard {
    /// Adds this rank's piece of a reduction (f32, the sum over ranks) to the step's gradient of
    /// the piece, rounded to the parameter's dtype as the replicated path's gradients are.
    pub(super) fn add_piece(&mut self, mut piece: Vec<f32>) {
        rounded(&mut piece, self.dtype);
        match &mut self.grad {
            Some(sum) => {
                sum.iter_mut().zip(&piece).for_each(|(a, b)| *a += b);
                rounded(sum, self.dtype);
            }
            None => self.grad = Some(piece),
        }
    }
}
