//! NCCL for CUDA tensors (feature `nccl`: cudarc's `nccl`), one communicator per rank on the
//! rank's GPU, bootstrapped through the process group: rank 0 makes the NCCL id and the group
//! broadcasts its 128 bytes (over MPI with the `mpi` feature; a one-rank group needs none;
//! candle's multi-process example passes it through a file instead). The collectives run on the
//! device's stream, in place on a copy of the tensor.
//!
//! One GPU cannot hold two ranks of one communicator (NCCL refuses a duplicate device), so on a
//! single-GPU machine only a one-rank communicator can run (`scripts/gpu-check.sh`); two-rank
//! correctness is the MPI path's, on the CPU. No watchdog yet: a rank that dies inside an NCCL
//! collective ends the job through mpirun, like any dead rank.

use candle_core::backend::BackendStorage;
use candle_core::{CudaStorage, DType, Device, InplaceOp1, Layout, Tensor};
use cudarc::nccl::safe::{Comm, Id, ReduceOp as NcclOp};

use super::error::DistError;
use super::{ProcessGroup, ReduceOp};

/// A communicator of a group's ranks over NCCL, each rank on its own GPU.
pub struct NcclGroup {
    comm: Comm,
}

impl std::fmt::Debug for NcclGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "NcclGroup(rank {} of {})", self.comm.rank(), self.comm.world_size())
    }
}

fn nccl_error(what: &str, e: impl std::fmt::Debug) -> DistError {
    DistError::unsupported(what, format!("NCCL: {e:?}"))
}

impl NcclGroup {
    /// The communicator of `group`'s ranks, this rank on `device` (its GPU). Every rank learns
    /// whether rank 0 could make the id, and each whether its own communicator started.
    pub fn new(group: &ProcessGroup, device: &Device) -> Result<Self, DistError> {
        let Device::Cuda(cuda) = device else {
            return Err(DistError::unsupported("NCCL", "a communicator needs this rank's CUDA device"));
        };
        let made = group.is_root().then(Id::new);
        let failed = match &made {
            Some(Err(e)) => Some(format!("ncclGetUniqueId: {e:?}")),
            _ => None,
        };
        if let Some((rank, message)) = group.first_failure(failed.as_deref())? {
            return Err(DistError::PeerFailed { rank, message });
        }
        let mut bytes = [0u8; 128];
        if let Some(Ok(id)) = &made {
            for (b, c) in bytes.iter_mut().zip(id.internal()) {
                *b = *c as u8;
            }
        }
        group.comm().broadcast(&mut bytes, 0)?;
        let mut internal = [0 as std::ffi::c_char; 128];
        for (c, b) in internal.iter_mut().zip(bytes) {
            *c = b as std::ffi::c_char;
        }
        let started = Comm::from_rank(cuda.cuda_stream(), group.rank(), group.world_size(), Id::uninit(internal));
        let failed = started.as_ref().err().map(|e| format!("ncclCommInitRank: {e:?}"));
        if let Some((rank, message)) = group.first_failure(failed.as_deref())? {
            return Err(DistError::PeerFailed { rank, message });
        }
        let comm = started.map_err(|e| nccl_error("NCCL", e))?;
        Ok(NcclGroup { comm })
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.comm.rank()
    }

    /// Ranks in the communicator.
    pub fn world_size(&self) -> usize {
        self.comm.world_size()
    }

    /// The sum, mean, maximum or minimum over ranks of `t` (a CUDA tensor of f32, f64, bf16 or
    /// f16), a new tensor on every rank.
    pub fn all_reduce(&self, t: &Tensor, op: ReduceOp) -> Result<Tensor, DistError> {
        if !t.device().is_cuda() {
            return Err(DistError::unsupported("NCCL all_reduce", "a host tensor (the MPI group carries those)"));
        }
        let out = t.contiguous()?.copy()?;
        out.inplace_op1(&AllReduce { comm: &self.comm, op })?;
        Ok(out)
    }
}

struct AllReduce<'a> {
    comm: &'a Comm,
    op: ReduceOp,
}

impl AllReduce<'_> {
    fn op(&self) -> NcclOp {
        match self.op {
            ReduceOp::Sum => NcclOp::Sum,
            ReduceOp::Avg => NcclOp::Avg,
            ReduceOp::Max => NcclOp::Max,
            ReduceOp::Min => NcclOp::Min,
        }
    }
}

impl InplaceOp1 for AllReduce<'_> {
    fn name(&self) -> &'static str {
        "nccl_all_reduce"
    }

    fn cpu_fwd(&self, _: &mut candle_core::CpuStorage, _: &Layout) -> candle_core::Result<()> {
        candle_core::bail!("NCCL reduces CUDA tensors")
    }

    fn cuda_fwd(&self, storage: &mut CudaStorage, layout: &Layout) -> candle_core::Result<()> {
        let Some((a, b)) = layout.contiguous_offsets() else {
            candle_core::bail!("nccl_all_reduce: a contiguous tensor was expected")
        };
        let op = self.op();
        let done = match storage.dtype() {
            DType::F32 => self.comm.all_reduce_in_place(&mut storage.as_cuda_slice_mut::<f32>()?.slice_mut(a..b), &op),
            DType::F64 => self.comm.all_reduce_in_place(&mut storage.as_cuda_slice_mut::<f64>()?.slice_mut(a..b), &op),
            DType::BF16 => {
                self.comm.all_reduce_in_place(&mut storage.as_cuda_slice_mut::<half::bf16>()?.slice_mut(a..b), &op)
            }
            DType::F16 => {
                self.comm.all_reduce_in_place(&mut storage.as_cuda_slice_mut::<half::f16>()?.slice_mut(a..b), &op)
            }
            d => candle_core::bail!("nccl_all_reduce: {d:?} tensors are not reduced"),
        };
        done.map(|_| ()).map_err(|e| candle_core::Error::Msg(format!("ncclAllReduce: {e:?}")))
    }
}
