//! A data-parallel step captured as a CUDA graph (feature `nccl`): its collectives over NCCL —
//! rank 0's buffers broadcast at the start, the gradient buckets and the loss all-reduced after
//! the last backward — enqueued on the step's stream, none waited for inside the step
//! ([`Dp::wait`] after it, with NCCL's deadline); and rank 0's state taken when a run joins.

use candle_core::{Tensor, Var};

use crate::amp::device_step::DeviceAmp;
use crate::dist::parallel::Parallel;
use crate::error::TrainError;

/// The step's collectives.
#[cfg(feature = "nccl")]
pub(super) struct Dp<'a> {
    nccl: &'a crate::dist::nccl::NcclGroup,
    plan: &'a [Vec<usize>],
    vars: &'a [Var],
    buffers: Vec<Tensor>,
    device: candle_core::Device,
}

/// Without NCCL there is no data-parallel step on GPUs (the group refuses GPU parameters).
#[cfg(not(feature = "nccl"))]
pub(super) struct Dp<'a>(std::convert::Infallible, std::marker::PhantomData<&'a ()>);

const NO_NCCL: &str = "a data-parallel CUDA graph step needs NCCL for GPU parameters (wick-train's `nccl` feature)";

fn refused(message: &str) -> TrainError {
    super::invalid("CUDA graph", message.into())
}

#[cfg(feature = "nccl")]
fn comm_error(e: crate::dist::DistError) -> candle_core::Error {
    candle_core::Error::wrap(e)
}

#[cfg(feature = "nccl")]
impl<'a> Dp<'a> {
    /// The collectives of `p` for `vars` and the buffers of `params`.
    pub(super) fn new(p: &'a Parallel, vars: &'a [Var], params: &wick_nn::params::Params) -> Result<Self, TrainError> {
        let nccl = p.gpu().ok_or_else(|| refused(NO_NCCL))?;
        let device = vars.first().map(|v| v.device().clone()).ok_or_else(|| refused("the model has no parameters"))?;
        let buffers = params.buffers().map(|(_, b)| b.get()).collect();
        Ok(Dp { nccl, plan: p.buckets.plan(), vars, buffers, device })
    }

    /// Rank 0's masters and optimizer state into `amp`'s own tensors (and its low-precision
    /// parameters from them), waited for.
    pub(super) fn take_roots_state(p: &Parallel, amp: &mut DeviceAmp) -> Result<(), TrainError> {
        let nccl = p.gpu().ok_or_else(|| refused(NO_NCCL))?;
        let mut device = None;
        amp.rewrite_state(&mut |t| {
            device = Some(t.device().clone());
            Ok(nccl.enqueue_broadcast(t, 0)?)
        })?;
        match device {
            Some(d) => Ok(nccl.wait_for(&d)?),
            None => Ok(()),
        }
    }

    /// Rank 0's buffers into every rank's, in place (PyTorch DDP's `broadcast_buffers`).
    pub(super) fn begin(&self) -> candle_core::Result<()> {
        if self.nccl.world_size() == 1 {
            return Ok(());
        }
        self.buffers.iter().try_for_each(|b| self.nccl.enqueue_broadcast(b, 0).map_err(comm_error))
    }

    pub(super) fn ranks(&self) -> usize {
        self.nccl.world_size()
    }

    /// The gradients, bucket by bucket, and the loss summed over the ranks in place.
    pub(super) fn reduce(
        &self,
        grads: &mut candle_core::backprop::GradStore,
        loss: &Tensor,
    ) -> candle_core::Result<()> {
        self.nccl.enqueue_gradients(self.plan, grads, self.vars).map_err(comm_error)?;
        self.nccl.enqueue_all_reduce(loss).map_err(comm_error)
    }

    /// Everything the step enqueued, waited for with NCCL's deadline.
    pub(super) fn wait(&self) -> Result<(), TrainError> {
        Ok(self.nccl.wait_for(&self.device)?)
    }
}

#[cfg(not(feature = "nccl"))]
impl<'a> Dp<'a> {
    pub(super) fn new(_: &'a Parallel, _: &'a [Var], _: &wick_nn::params::Params) -> Result<Self, TrainError> {
        Err(refused(NO_NCCL))
    }

    pub(super) fn take_roots_state(_: &Parallel, _: &mut DeviceAmp) -> Result<(), TrainError> {
        Err(refused(NO_NCCL))
    }

    pub(super) fn begin(&self) -> candle_core::Result<()> {
        match self.0 {}
    }

    pub(super) fn ranks(&self) -> usize {
        match self.0 {}
    }

    pub(super) fn reduce(&self, _: &mut candle_core::backprop::GradStore, _: &Tensor) -> candle_core::Result<()> {
        match self.0 {}
    }

    pub(super) fn wait(&self) -> Result<(), TrainError> {
        match self.0 {}
    }
}
