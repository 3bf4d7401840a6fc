//! NCCL for CUDA tensors (feature `nccl`: cudarc's `nccl`), one communicator per rank on the
//! rank's GPU, bootstrapped through the process group: rank 0 makes the NCCL id and the group
//! broadcasts its 128 bytes (over MPI with the `mpi` feature; a one-rank group needs none;
//! candle's multi-process example passes it through a file instead). The collectives run on the
//! device's stream, in place on a copy of the tensor.
//!
//! One GPU cannot hold two ranks of one communicator (NCCL refuses a duplicate device), so on a
//! single-GPU machine only a one-rank communicator can run (`scripts/gpu-check.sh`); two-rank
//! correctness is the MPI path's, on the CPU.
//!
//! **Timeout** (PyTorch's `TORCH_NCCL_BLOCKING_WAIT` with its watchdog's abort): an NCCL
//! collective is only enqueued on the stream, and a peer that never joins it leaves its kernel
//! spinning on the GPU forever. Each collective here waits for its completion event by polling
//! with a deadline ([`NcclGroup::timeout`]: `WICK_NCCL_TIMEOUT_S`, else 600 s, PyTorch's
//! default); past it the communicator is aborted (`ncclCommAbort`, which ends the spinning
//! kernels) and the call returns [`DistError::Timeout`]; the group cannot be used again. A rank
//! that dies still ends the whole job through mpirun first, as on the MPI path.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use candle_core::backend::BackendStorage;
use candle_core::{CudaStorage, DType, Device, InplaceOp1, Layout, Tensor};
use cudarc::nccl::safe::{Comm, Id, ReduceOp as NcclOp};

use candle_core::backprop::GradStore;
use candle_core::Var;

use super::buckets::{agreed_presence, ReduceStats};
use super::error::DistError;
use super::{ProcessGroup, ReduceOp};

/// A communicator of a group's ranks over NCCL, each rank on its own GPU.
pub struct NcclGroup {
    /// `None` once aborted after a timeout.
    comm: Mutex<Option<Comm>>,
    rank: usize,
    world: usize,
    timeout: Duration,
}

impl std::fmt::Debug for NcclGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "NcclGroup(rank {} of {}, timeout {:?})", self.rank, self.world, self.timeout)
    }
}

/// The collectives' timeout: `WICK_NCCL_TIMEOUT_S` (seconds, positive), else 600 s.
fn timeout_from_env() -> Result<Duration, DistError> {
    match std::env::var("WICK_NCCL_TIMEOUT_S") {
        Err(_) => Ok(Duration::from_secs(600)),
        Ok(s) => match s.trim().parse::<f64>() {
            Ok(v) if v.is_finite() && v > 0.0 && v < 1e9 => Ok(Duration::from_secs_f64(v)),
            _ => Err(DistError::Launch {
                message: format!("WICK_NCCL_TIMEOUT_S={s:?} is not a positive number of seconds"),
            }),
        },
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
        let (rank, world) = (comm.rank(), comm.world_size());
        Ok(NcclGroup { comm: Mutex::new(Some(comm)), rank, world, timeout: timeout_from_env()? })
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Ranks in the communicator.
    pub fn world_size(&self) -> usize {
        self.world
    }

    /// How long a collective may take before the communicator is aborted.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Sets [`NcclGroup::timeout`].
    pub fn set_timeout(&mut self, timeout: Duration) {
        self.timeout = timeout;
    }

    /// The sum, mean, maximum or minimum over ranks of `t` (a CUDA tensor of f32, f64, bf16 or
    /// f16), a new tensor on every rank, once it is complete (or [`DistError::Timeout`]).
    pub fn all_reduce(&self, t: &Tensor, op: ReduceOp) -> Result<Tensor, DistError> {
        let what = "NCCL all_reduce";
        let Device::Cuda(device) = t.device() else {
            return Err(DistError::unsupported(what, "a host tensor (the MPI group carries those)"));
        };
        let out = t.contiguous()?.copy()?;
        {
            let guard =
                self.comm.lock().map_err(|_| DistError::internal("the NCCL communicator's lock is poisoned"))?;
            let comm = guard.as_ref().ok_or_else(|| aborted(what))?;
            out.inplace_op1(&AllReduce { comm, op })?;
        }
        self.wait(what, device)?;
        Ok(out)
    }

    /// Waits for what is enqueued on `device`'s stream, polling its completion with the
    /// deadline; past it, aborts the communicator.
    fn wait(&self, what: &str, device: &candle_core::CudaDevice) -> Result<(), DistError> {
        let stream = device.cuda_stream();
        let done = stream.record_event(None).map_err(|e| nccl_error(what, e))?;
        let start = Instant::now();
        loop {
            match done.try_is_complete() {
                Ok(true) => return Ok(()),
                Ok(false) => {}
                Err(e) => return Err(nccl_error(what, e)),
            }
            if start.elapsed() > self.timeout {
                // Dropping cudarc's communicator calls ncclCommAbort.
                let comm = self.comm.lock().ok().and_then(|mut c| c.take());
                drop(comm);
                return Err(DistError::Timeout { what: what.into(), seconds: self.timeout.as_secs_f64() });
            }
            std::thread::sleep(Duration::from_micros(20));
        }
    }
}

impl NcclGroup {
    /// Sums `grads` (of `vars`, on this rank's GPU) over the ranks, bucket by bucket as `plan`
    /// groups the parameters: each bucket's gradients flattened into one f32 tensor on the GPU,
    /// all-reduced in place, and each gradient put back as a view of it (rounded to its
    /// parameter's dtype when that is not f32, as the host path does). Which parameters have a
    /// gradient is agreed first through `group`, so a parameter unused on some ranks cannot
    /// leave the others waiting.
    pub(crate) fn reduce_gradients(
        &self,
        group: &ProcessGroup,
        plan: &[Vec<usize>],
        grads: &mut GradStore,
        vars: &[Var],
    ) -> Result<ReduceStats, DistError> {
        let present = agreed_presence(group, grads, vars)?;
        let mut stats = ReduceStats::default();
        for bucket in plan {
            let t0 = Instant::now();
            let mut parts = Vec::with_capacity(bucket.len());
            for &i in bucket {
                let v = &vars[i];
                parts.push(match grads.remove(v.as_tensor()) {
                    Some(g) if present[i] => g.detach().flatten_all()?.to_dtype(DType::F32)?,
                    _ => Tensor::zeros(v.elem_count(), DType::F32, v.device())?,
                });
            }
            let flat = Tensor::cat(&parts, 0)?;
            drop(parts);
            let t1 = Instant::now();
            let reduced = self.all_reduce(&flat, ReduceOp::Sum)?;
            drop(flat);
            let t2 = Instant::now();
            let mut at = 0;
            for &i in bucket {
                let v = &vars[i];
                if present[i] {
                    let g = reduced.narrow(0, at, v.elem_count())?.reshape(v.dims())?.to_dtype(v.dtype())?;
                    grads.insert(v.as_tensor(), g);
                }
                at += v.elem_count();
            }
            stats.buckets += 1;
            stats.bytes += at * 4;
            stats.comm_s += (t2 - t1).as_secs_f64();
            stats.pack_s += (t1 - t0).as_secs_f64() + t2.elapsed().as_secs_f64();
        }
        Ok(stats)
    }
}

fn aborted(what: &str) -> DistError {
    DistError::unsupported(what, "the communicator was aborted after a timeout; start a new group")
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
