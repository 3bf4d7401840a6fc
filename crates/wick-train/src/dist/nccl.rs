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
use candle_core::backprop::GradStore;
use candle_core::cuda::CudaDType;
use candle_core::{CudaStorage, DType, Device, InplaceOp1, InplaceOp2, Layout, Tensor, Var};
use cudarc::nccl::safe::{Comm, Id, NcclType, ReduceOp as NcclOp};

use super::buckets::{agreed_presence, gradients_of, ReduceStats};
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

// SAFETY: the communicator (a raw `ncclComm_t` inside cudarc's `Comm`, which is why `Comm` is
// neither `Send` nor `Sync`) is reached only through the mutex, so one thread at a time calls
// NCCL on it; NCCL allows a communicator to be used from any host thread as long as calls on it
// do not overlap. Stage 3's shards hand it to the blocks' hooks, which wick-nn requires to be
// `Send + Sync`; they run on the thread of the step.
unsafe impl Send for NcclGroup {}
// SAFETY: as above: every use of the communicator takes the mutex.
unsafe impl Sync for NcclGroup {}

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
        let out = own_copy(t)?;
        self.run(Kind::AllReduce(op), &out, None)?;
        Ok(out)
    }

    /// `root`'s `t` on every rank (each passes a tensor of the same shape and dtype).
    pub fn broadcast(&self, t: &Tensor, root: usize) -> Result<Tensor, DistError> {
        if root >= self.world {
            return Err(DistError::unsupported("NCCL broadcast", format!("root {root} in a group of {}", self.world)));
        }
        let out = own_copy(t)?;
        self.run(Kind::Broadcast(root), &out, None)?;
        Ok(out)
    }

    /// Every rank's `t` concatenated along the first axis, in rank order.
    pub fn all_gather(&self, t: &Tensor) -> Result<Tensor, DistError> {
        let mut dims = t.dims().to_vec();
        let first = dims.first_mut().ok_or_else(|| DistError::unsupported("NCCL all_gather", "a scalar tensor"))?;
        *first = first.checked_mul(self.world).ok_or_else(|| DistError::internal("all_gather: size overflows"))?;
        let out = Tensor::zeros(dims, t.dtype(), t.device())?;
        self.run(Kind::AllGather, &out, Some(&t.contiguous()?))?;
        Ok(out)
    }

    /// The reduction over ranks of `t`, cut along its first axis into one block per rank: this
    /// rank's block (the first axis must split evenly: pad it).
    pub fn reduce_scatter(&self, t: &Tensor, op: ReduceOp) -> Result<Tensor, DistError> {
        let mut dims = t.dims().to_vec();
        let Some(first) = dims.first_mut().filter(|f| **f % self.world == 0) else {
            let message =
                format!("a first axis of {:?} does not split over {} ranks (pad it)", t.dims().first(), self.world);
            return Err(DistError::unsupported("NCCL reduce_scatter", message));
        };
        *first /= self.world;
        let out = Tensor::zeros(dims, t.dtype(), t.device())?;
        self.run(Kind::ReduceScatter(op), &out, Some(&t.contiguous()?))?;
        Ok(out)
    }

    /// Enqueues `kind` on `out` (from `input`, for the collectives with two buffers) and waits
    /// for it with the deadline.
    fn run(&self, kind: Kind, out: &Tensor, input: Option<&Tensor>) -> Result<(), DistError> {
        let device = self.enqueue(kind, out, input)?;
        self.wait(kind.name(), device)
    }

    /// Enqueues `kind` on `out` (from `input`) on `out`'s device's stream, waiting for nothing;
    /// that device.
    fn enqueue<'t>(
        &self,
        kind: Kind,
        out: &'t Tensor,
        input: Option<&Tensor>,
    ) -> Result<&'t candle_core::CudaDevice, DistError> {
        let what = kind.name();
        let Device::Cuda(device) = out.device() else {
            return Err(DistError::unsupported(what, "a host tensor (the MPI group carries those)"));
        };
        if input.is_some_and(|t| !t.device().same_device(out.device()) || t.dtype() != out.dtype()) {
            return Err(DistError::unsupported(what, "the input is on another device or of another dtype"));
        }
        {
            let guard =
                self.comm.lock().map_err(|_| DistError::internal("the NCCL communicator's lock is poisoned"))?;
            let comm = guard.as_ref().ok_or_else(|| aborted(what))?;
            let op = Collective { comm, kind };
            match input {
                None => out.inplace_op1(&op)?,
                Some(t) => out.inplace_op2(t, &op)?,
            }
        }
        Ok(device)
    }

    /// For a step captured as a CUDA graph, whose collectives are graph nodes the host never
    /// waits on inside the step: the sum over ranks of `t` written into `t` itself (a contiguous
    /// tensor of its own), enqueued on its device's stream and not waited for
    /// ([`NcclGroup::wait_for`] waits after the step).
    pub(crate) fn enqueue_all_reduce(&self, t: &Tensor) -> Result<(), DistError> {
        self.enqueue(Kind::AllReduce(ReduceOp::Sum), t, None).map(|_| ())
    }

    /// The sum over ranks of `t` written into `t` itself (a contiguous tensor of its own), once
    /// it is complete: no second buffer.
    pub(crate) fn all_reduce_in_place(&self, t: &Tensor) -> Result<(), DistError> {
        self.run(Kind::AllReduce(ReduceOp::Sum), t, None)
    }

    /// As [`NcclGroup::enqueue_all_reduce`], rank `root`'s `t` written into every rank's `t`.
    pub(crate) fn enqueue_broadcast(&self, t: &Tensor, root: usize) -> Result<(), DistError> {
        if root >= self.world {
            return Err(DistError::unsupported("NCCL broadcast", format!("root {root} in a group of {}", self.world)));
        }
        self.enqueue(Kind::Broadcast(root), t, None).map(|_| ())
    }

    /// Waits for everything enqueued on `device`'s stream (a replayed step's collectives with
    /// the rest), polling with the deadline; past it, aborts the communicator.
    pub(crate) fn wait_for(&self, device: &Device) -> Result<(), DistError> {
        let Device::Cuda(cuda) = device else {
            return Err(DistError::unsupported("NCCL wait", "a host device (the MPI group carries those)"));
        };
        self.wait("the step's NCCL collectives", cuda)
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
            let reduced = packed(bucket, grads, vars, &present, 0)?;
            let t1 = Instant::now();
            self.all_reduce_in_place(&reduced)?;
            let t2 = Instant::now();
            unpack(&reduced, bucket, grads, vars, &present)?;
            stats.buckets += 1;
            stats.bytes += reduced.elem_count() * 4;
            stats.comm_s += (t2 - t1).as_secs_f64();
            stats.pack_s += (t1 - t0).as_secs_f64() + t2.elapsed().as_secs_f64();
        }
        Ok(stats)
    }

    /// For a step captured as a CUDA graph: [`NcclGroup::reduce_gradients`]' sums, enqueued and
    /// not waited for, with nothing agreed on the host — a parameter with a gradient here is taken
    /// to have one on every rank (the same model and batch shapes everywhere, which the run's
    /// setup check and the graph's fixed shapes hold).
    pub(crate) fn enqueue_gradients(
        &self,
        plan: &[Vec<usize>],
        grads: &mut GradStore,
        vars: &[Var],
    ) -> Result<(), DistError> {
        let present: Vec<bool> = vars.iter().map(|v| grads.get(v.as_tensor()).is_some()).collect();
        for bucket in plan {
            let reduced = packed(bucket, grads, vars, &present, 0)?;
            self.enqueue_all_reduce(&reduced)?;
            unpack(&reduced, bucket, grads, vars, &present)?;
        }
        Ok(())
    }
}

/// `bucket`'s gradients taken out of `grads`, flattened into one f32 tensor of its own (zeros
/// for a parameter not `present`), followed by `pad` zeros (ZeRO's buckets split evenly over
/// the ranks).
pub(super) fn packed(
    bucket: &[usize],
    grads: &mut GradStore,
    vars: &[Var],
    present: &[bool],
    pad: usize,
) -> Result<Tensor, DistError> {
    let mut parts = Vec::with_capacity(bucket.len() + 1);
    for &i in bucket {
        let v = &vars[i];
        parts.push(match grads.remove(v.as_tensor()) {
            Some(g) if present[i] => g.detach().flatten_all()?.to_dtype(DType::F32)?,
            _ => Tensor::zeros(v.elem_count(), DType::F32, v.device())?,
        });
    }
    if pad > 0 {
        let device = parts.first().map(|p| p.device().clone()).ok_or_else(|| DistError::internal("an empty bucket"))?;
        parts.push(Tensor::zeros(pad, DType::F32, &device)?);
    }
    // A tensor of its own, reduced in place with no second copy (`cat` of several parts makes
    // one; of one part it hands back that part, which may share a gradient's storage).
    Ok(match parts.as_slice() {
        [one] => own_copy(one)?,
        _ => Tensor::cat(&parts, 0)?,
    })
}

/// Each `present` parameter's gradient put back into `grads` from the reduced bucket (views of
/// it, rounded to the parameter's dtype when that is not f32, as the host path does).
fn unpack(
    reduced: &Tensor,
    bucket: &[usize],
    grads: &mut GradStore,
    vars: &[Var],
    present: &[bool],
) -> Result<(), DistError> {
    for (&i, g) in bucket.iter().zip(gradients_of(reduced, bucket, vars)?) {
        if present[i] {
            grads.insert(vars[i].as_tensor(), g);
        }
    }
    Ok(())
}

/// `t`'s values in a contiguous tensor of its own (the collectives write their result into it):
/// one copy of exactly its elements, whether `t` is contiguous or not (`copy` of a view would
/// clone the whole buffer behind it).
fn own_copy(t: &Tensor) -> Result<Tensor, DistError> {
    Ok(t.force_contiguous()?)
}

fn aborted(what: &str) -> DistError {
    DistError::unsupported(what, "the communicator was aborted after a timeout; start a new group")
}

/// One collective on one buffer (`In`) or from one into another (`Into`).
#[derive(Clone, Copy)]
enum Kind {
    AllReduce(ReduceOp),
    Broadcast(usize),
    AllGather,
    ReduceScatter(ReduceOp),
}

struct Collective<'a> {
    comm: &'a Comm,
    kind: Kind,
}

fn nccl_op(op: ReduceOp) -> NcclOp {
    match op {
        ReduceOp::Sum => NcclOp::Sum,
        ReduceOp::Avg => NcclOp::Avg,
        ReduceOp::Max => NcclOp::Max,
        ReduceOp::Min => NcclOp::Min,
    }
}

fn contiguous(layout: &Layout) -> candle_core::Result<(usize, usize)> {
    layout.contiguous_offsets().ok_or_else(|| candle_core::Error::Msg("NCCL: a contiguous tensor was expected".into()))
}

impl Collective<'_> {
    /// `kind` in place on `dst[a..b]`.
    fn in_place<T: CudaDType + NcclType>(
        &self,
        dst: &mut CudaStorage,
        (a, b): (usize, usize),
    ) -> candle_core::Result<()> {
        let mut view = dst.as_cuda_slice_mut::<T>()?.slice_mut(a..b);
        let done = match self.kind {
            Kind::AllReduce(op) => self.comm.all_reduce_in_place(&mut view, &nccl_op(op)),
            Kind::Broadcast(root) => self.comm.broadcast_in_place(&mut view, root as i32),
            _ => candle_core::bail!("NCCL: this collective needs two buffers"),
        };
        done.map(|_| ()).map_err(|e| candle_core::Error::Msg(format!("NCCL {}: {e:?}", self.name())))
    }

    /// `kind` from `src[c..d]` into `dst[a..b]`.
    fn into<T: CudaDType + NcclType>(
        &self,
        dst: &mut CudaStorage,
        (a, b): (usize, usize),
        src: &CudaStorage,
        (c, d): (usize, usize),
    ) -> candle_core::Result<()> {
        let from = src.as_cuda_slice::<T>()?.slice(c..d);
        let mut to = dst.as_cuda_slice_mut::<T>()?.slice_mut(a..b);
        let done = match self.kind {
            Kind::AllGather => self.comm.all_gather(&from, &mut to),
            Kind::ReduceScatter(op) => self.comm.reduce_scatter(&from, &mut to, &nccl_op(op)),
            _ => candle_core::bail!("NCCL: this collective runs in place"),
        };
        done.map(|_| ()).map_err(|e| candle_core::Error::Msg(format!("NCCL {}: {e:?}", self.name())))
    }

    fn name(&self) -> &'static str {
        self.kind.name()
    }
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::AllReduce(_) => "nccl_all_reduce",
            Kind::Broadcast(_) => "nccl_broadcast",
            Kind::AllGather => "nccl_all_gather",
            Kind::ReduceScatter(_) => "nccl_reduce_scatter",
        }
    }
}

impl InplaceOp1 for Collective<'_> {
    fn name(&self) -> &'static str {
        Collective::name(self)
    }

    fn cpu_fwd(&self, _: &mut candle_core::CpuStorage, _: &Layout) -> candle_core::Result<()> {
        candle_core::bail!("NCCL carries CUDA tensors")
    }

    fn cuda_fwd(&self, storage: &mut CudaStorage, layout: &Layout) -> candle_core::Result<()> {
        let range = contiguous(layout)?;
        match storage.dtype() {
            DType::F32 => self.in_place::<f32>(storage, range),
            DType::F64 => self.in_place::<f64>(storage, range),
            DType::BF16 => self.in_place::<half::bf16>(storage, range),
            DType::F16 => self.in_place::<half::f16>(storage, range),
            d => candle_core::bail!("{}: {d:?} tensors are not carried", self.name()),
        }
    }
}

impl InplaceOp2 for Collective<'_> {
    fn name(&self) -> &'static str {
        Collective::name(self)
    }

    fn cpu_fwd(
        &self,
        _: &mut candle_core::CpuStorage,
        _: &Layout,
        _: &candle_core::CpuStorage,
        _: &Layout,
    ) -> candle_core::Result<()> {
        candle_core::bail!("NCCL carries CUDA tensors")
    }

    fn cuda_fwd(&self, dst: &mut CudaStorage, dl: &Layout, src: &CudaStorage, sl: &Layout) -> candle_core::Result<()> {
        let (to, from) = (contiguous(dl)?, contiguous(sl)?);
        match dst.dtype() {
            DType::F32 => self.into::<f32>(dst, to, src, from),
            DType::F64 => self.into::<f64>(dst, to, src, from),
            DType::BF16 => self.into::<half::bf16>(dst, to, src, from),
            DType::F16 => self.into::<half::f16>(dst, to, src, from),
            d => candle_core::bail!("{}: {d:?} tensors are not carried", self.name()),
        }
    }
}
