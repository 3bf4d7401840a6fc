//! [`ProcessGroup`]: the ranks of a job and the collectives over candle tensors between them.
//!
//! Host tensors travel through MPI. Every tensor collective first agrees, in one small
//! all-reduce, that all ranks called the same collective with the same dtype and shape — a
//! mismatch is a [`DistError::Mismatch`] on every rank that names each rank's tensor, where
//! plain MPI (and PyTorch's gloo) would hang or read past a buffer. Low-precision floats are
//! reduced in f32 and rounded back (MPI has no bf16/f16 sum); for two ranks that is exactly the
//! rounding of candle's own bf16/f16 addition (`x + y` widened, added, rounded).

use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use half::slice::HalfFloatSliceExt;
use half::vec::HalfBitsVecExt;

use super::comm::{Comm, Element};
use super::error::DistError;
use super::launch::Launch;
use super::ReduceOp;

struct Inner {
    comm: Comm,
    launch: Launch,
}

/// The processes of a job: this one's rank among them and the collectives. Cloning shares it.
#[derive(Clone)]
pub struct ProcessGroup {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for ProcessGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ProcessGroup(rank {} of {}, {})", self.rank(), self.world_size(), self.inner.launch.launcher)
    }
}

fn fnv(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| (h ^ b as u64).wrapping_mul(0x100_0000_01b3))
}

impl ProcessGroup {
    /// This process alone (world size 1): every collective is a copy.
    pub fn single() -> Self {
        ProcessGroup { inner: Arc::new(Inner { comm: Comm::Single, launch: Launch::single() }) }
    }

    /// The group the launcher started: MPI's world under `mpirun`/`srun` (initialised here, once
    /// per process), or this process alone when no launcher set anything. Refused, saying what to
    /// do, when the environment names several ranks but this build has no `mpi` feature, or names
    /// them torchrun-style (wick bootstraps over MPI: start the ranks with `mpirun`), or when MPI
    /// sees another world than the environment says.
    pub fn from_env() -> Result<Self, DistError> {
        let launch = Launch::from_env()?;
        if launch.launcher == "none" {
            return Ok(Self::single());
        }
        if !launch.is_mpi() && launch.world_size > 1 {
            return Err(DistError::Launch {
                message: format!(
                    "RANK/WORLD_SIZE say {} ranks, but wick's ranks find each other through MPI: start them with \
                     `mpirun -n {}` (or `wick train --ranks {}`)",
                    launch.world_size, launch.world_size, launch.world_size
                ),
            });
        }
        Self::mpi(launch)
    }

    #[cfg(feature = "mpi")]
    fn mpi(launch: Launch) -> Result<Self, DistError> {
        let comm = Comm::Mpi(Box::new(super::comm::MpiWorld::init()?));
        let (rank, size) = comm.rank_and_size();
        if (rank, size) != (launch.rank, launch.world_size) {
            return Err(DistError::Launch {
                message: format!(
                    "{} says rank {} of {}, MPI says rank {rank} of {size}",
                    launch.launcher, launch.rank, launch.world_size
                ),
            });
        }
        Ok(ProcessGroup { inner: Arc::new(Inner { comm, launch }) })
    }

    #[cfg(not(feature = "mpi"))]
    fn mpi(launch: Launch) -> Result<Self, DistError> {
        if launch.world_size == 1 {
            return Ok(ProcessGroup { inner: Arc::new(Inner { comm: Comm::Single, launch }) });
        }
        Err(DistError::Launch {
            message: format!(
                "{} started {} ranks, but this wick was built without the `mpi` feature (build with \
                 `--features mpi`)",
                launch.launcher, launch.world_size
            ),
        })
    }

    /// This process's rank, from 0.
    pub fn rank(&self) -> usize {
        self.inner.launch.rank
    }

    /// Processes in the job.
    pub fn world_size(&self) -> usize {
        self.inner.launch.world_size
    }

    /// This process's rank on its host.
    pub fn local_rank(&self) -> usize {
        self.inner.launch.local_rank
    }

    /// Whether this is rank 0 (the one that writes shared files and prints).
    pub fn is_root(&self) -> bool {
        self.rank() == 0
    }

    /// Waits until every rank has called it.
    pub fn barrier(&self) -> Result<(), DistError> {
        self.inner.comm.barrier()
    }

    /// Ends the whole job at once, every rank, with exit status `code` (MPI_Abort; `exit` when
    /// alone): for an error that leaves ranks unable to meet again.
    pub fn abort(&self, code: i32) -> ! {
        self.inner.comm.abort(code)
    }

    pub(crate) fn comm(&self) -> &Comm {
        &self.inner.comm
    }

    /// Whether `flag` is set on any rank (an all-reduce MAX): how ranks agree on a decision —
    /// skip a step, stop — before any of them acts on it.
    pub fn any(&self, flag: bool) -> Result<bool, DistError> {
        let mut out = [0u8];
        self.inner.comm.all_reduce(&[flag as u8], &mut out, ReduceOp::Max)?;
        Ok(out[0] != 0)
    }

    /// The lowest rank whose `failed` is set, if any, with its message: every rank learns the
    /// same (a step that failed on one rank stops on all).
    pub fn first_failure(&self, failed: Option<&str>) -> Result<Option<(usize, String)>, DistError> {
        let (world, rank) = (self.world_size(), self.rank());
        let mut first = [0u64];
        let mine = if failed.is_some() { rank as u64 } else { u64::MAX };
        self.inner.comm.all_reduce(&[mine], &mut first, ReduceOp::Min)?;
        if first[0] == u64::MAX {
            return Ok(None);
        }
        let r = first[0] as usize;
        let text = if r == rank { failed.unwrap_or_default().as_bytes().to_vec() } else { Vec::new() };
        let (all, lens) = self.inner.comm.all_gather_var(&text)?;
        let start: usize = lens.iter().take(r.min(world)).sum();
        let end = start + lens.get(r).copied().unwrap_or(0);
        Ok(Some((r, String::from_utf8_lossy(&all[start..end]).into_owned())))
    }

    /// `op` over ranks of `send` into `recv` (same lengths; `Avg` sums): the transport's own
    /// all-reduce on plain slices, with no check that the ranks agree on the length — for
    /// callers that checked that themselves, and to measure the transport.
    pub fn all_reduce_slice<T: Element>(&self, send: &[T], recv: &mut [T], op: ReduceOp) -> Result<(), DistError> {
        self.inner.comm.all_reduce(send, recv, op)
    }

    /// Every rank's `bytes` (lengths may differ), in rank order.
    pub fn all_gather_bytes(&self, bytes: &[u8]) -> Result<Vec<Vec<u8>>, DistError> {
        let (all, lens) = self.inner.comm.all_gather_var(bytes)?;
        let mut at = 0;
        Ok(lens
            .into_iter()
            .map(|len| {
                let part = all[at..at + len].to_vec();
                at += len;
                part
            })
            .collect())
    }

    /// Element-wise sums of `values` over ranks (f64: losses, counts).
    pub fn sum_f64(&self, values: &[f64]) -> Result<Vec<f64>, DistError> {
        let mut out = vec![0f64; values.len()];
        self.inner.comm.all_reduce(values, &mut out, ReduceOp::Sum)?;
        Ok(out)
    }

    /// Refuses, on every rank, when `value` (a setting: the model's description, the options)
    /// is not the same on all ranks, naming the first field that differs and each rank's value.
    pub fn check_same(&self, what: &str, value: &serde_json::Value) -> Result<(), DistError> {
        let text = value.to_string();
        let (all, lens) = self.inner.comm.all_gather_var(text.as_bytes())?;
        let mut values = Vec::with_capacity(lens.len());
        let mut at = 0;
        for len in lens {
            let v: serde_json::Value = serde_json::from_slice(&all[at..at + len])
                .map_err(|e| DistError::internal(format!("check_same: {e}")))?;
            values.push(v);
            at += len;
        }
        for (r, v) in values.iter().enumerate().skip(1) {
            if let Some((path, a, b)) = first_json_difference("", &values[0], v) {
                return Err(DistError::Mismatch {
                    what: what.into(),
                    message: format!("`{path}` is {a} on rank 0 and {b} on rank {r}"),
                });
            }
        }
        Ok(())
    }

    /// Agrees that every rank called collective `what` with the same dtype and shape; names each
    /// rank's when not.
    fn check_layout(&self, what: &str, t: &Tensor) -> Result<(), DistError> {
        if self.world_size() == 1 {
            return Ok(());
        }
        let desc = format!("{what} {:?} {:?}", t.dtype(), t.dims());
        let h = fnv(desc.as_bytes());
        let mut got = [0u64; 2];
        self.inner.comm.all_reduce(&[h, !h], &mut got, ReduceOp::Max)?;
        if got == [h, !h] {
            return Ok(());
        }
        let (all, lens) = self.inner.comm.all_gather_var(desc.as_bytes())?;
        let mut at = 0;
        let mut parts = Vec::new();
        for (r, len) in lens.into_iter().enumerate() {
            parts.push(format!("rank {r}: {}", String::from_utf8_lossy(&all[at..at + len])));
            at += len;
        }
        Err(DistError::Mismatch { what: what.into(), message: parts.join("; ") })
    }

    /// The sum, mean, maximum or minimum over ranks of `t` (any float dtype; integers for sum,
    /// max and min), on every rank.
    pub fn all_reduce(&self, t: &Tensor, op: ReduceOp) -> Result<Tensor, DistError> {
        let what = "all_reduce";
        host(what, t)?;
        self.check_layout(what, t)?;
        let world = self.world_size();
        let reduce = |t: &Tensor| -> Result<Tensor, DistError> {
            match t.dtype() {
                DType::F32 => self.reduce_as::<f32>(t, op),
                DType::F64 => self.reduce_as::<f64>(t, op),
                DType::U32 if op != ReduceOp::Avg => self.reduce_as::<u32>(t, op),
                DType::I64 if op != ReduceOp::Avg => self.reduce_as::<i64>(t, op),
                DType::U8 if op != ReduceOp::Avg => self.reduce_as::<u8>(t, op),
                d => Err(DistError::unsupported(what, format!("{op:?} of {d:?} tensors"))),
            }
        };
        let out = match t.dtype() {
            DType::BF16 | DType::F16 => reduce(&t.to_dtype(DType::F32)?)?.to_dtype(t.dtype())?,
            _ => reduce(t)?,
        };
        if op == ReduceOp::Avg && world > 1 {
            return Ok((out / world as f64)?);
        }
        Ok(out)
    }

    fn reduce_as<T: Element + candle_core::WithDType>(&self, t: &Tensor, op: ReduceOp) -> Result<Tensor, DistError> {
        let send = t.flatten_all()?.to_vec1::<T>()?;
        let mut recv = vec![T::default(); send.len()];
        self.inner.comm.all_reduce(&send, &mut recv, op)?;
        drop(send);
        Ok(Tensor::from_vec(recv, t.shape(), &Device::Cpu)?)
    }

    /// Rank `root`'s `t` on every rank (the others' values are ignored; their shape and dtype
    /// must match root's).
    pub fn broadcast(&self, t: &Tensor, root: usize) -> Result<Tensor, DistError> {
        let what = "broadcast";
        host(what, t)?;
        if root >= self.world_size() {
            return Err(DistError::unsupported(what, format!("root {root} in a group of {}", self.world_size())));
        }
        self.check_layout(what, t)?;
        if self.world_size() == 1 {
            return Ok(t.clone());
        }
        let mut bytes = to_bytes(t)?;
        self.inner.comm.broadcast(&mut bytes, root)?;
        Ok(Tensor::from_raw_buffer(&bytes, t.dtype(), t.dims(), &Device::Cpu)?)
    }

    /// Every rank's `t` concatenated along its first axis in rank order (a scalar gathers into
    /// a vector of `world_size` values).
    pub fn all_gather(&self, t: &Tensor) -> Result<Tensor, DistError> {
        let what = "all_gather";
        host(what, t)?;
        self.check_layout(what, t)?;
        let t = if t.rank() == 0 { t.reshape(1)? } else { t.clone() };
        let mut dims = t.dims().to_vec();
        dims[0] = dims[0]
            .checked_mul(self.world_size())
            .ok_or_else(|| DistError::unsupported(what, "the gathered size overflows"))?;
        let n = t.elem_count() * self.world_size();
        // Floats are sent from where they lie and received straight into the result's buffer
        // (half floats as their bits); other dtypes as bytes.
        match t.dtype() {
            DType::F32 => {
                let mut recv = vec![0f32; n];
                with_slice::<f32, _>(&t, |send| self.inner.comm.all_gather(send, &mut recv))??;
                Ok(Tensor::from_vec(recv, dims, &Device::Cpu)?)
            }
            DType::BF16 => {
                let mut recv = vec![0u16; n];
                let send = |s: &[half::bf16]| self.inner.comm.all_gather(s.reinterpret_cast(), &mut recv);
                with_slice::<half::bf16, _>(&t, send)??;
                Ok(Tensor::from_vec(recv.reinterpret_into::<half::bf16>(), dims, &Device::Cpu)?)
            }
            DType::F16 => {
                let mut recv = vec![0u16; n];
                let send = |s: &[half::f16]| self.inner.comm.all_gather(s.reinterpret_cast(), &mut recv);
                with_slice::<half::f16, _>(&t, send)??;
                Ok(Tensor::from_vec(recv.reinterpret_into::<half::f16>(), dims, &Device::Cpu)?)
            }
            _ => {
                let bytes = to_bytes(&t)?;
                let mut out = vec![0u8; bytes.len() * self.world_size()];
                self.inner.comm.all_gather(&bytes, &mut out)?;
                Ok(Tensor::from_raw_buffer(&out, t.dtype(), &dims, &Device::Cpu)?)
            }
        }
    }

    /// The reduction over ranks of `t`, split along its first axis: rank `r` gets block `r`.
    /// The first axis must split evenly over the ranks (pad it otherwise).
    pub fn reduce_scatter(&self, t: &Tensor, op: ReduceOp) -> Result<Tensor, DistError> {
        let what = "reduce_scatter";
        host(what, t)?;
        let world = self.world_size();
        let d0 = t.dims().first().copied().unwrap_or(0);
        if t.rank() == 0 || !d0.is_multiple_of(world) {
            return Err(DistError::unsupported(
                what,
                format!("a first axis of {d0} does not split over {world} ranks (pad it to a multiple of {world})"),
            ));
        }
        let block = d0 / world;
        if t.dtype() != DType::F32 {
            // Other dtypes: the whole reduction, then this rank's block (f32, the gradients'
            // type, takes MPI's own reduce-scatter below).
            return Ok(self.all_reduce(t, op)?.narrow(0, self.rank() * block, block)?.contiguous()?);
        }
        self.check_layout(what, t)?;
        // Sent from where the values lie (a contiguous host tensor), received into the result.
        let mut recv = vec![0f32; t.elem_count() / world];
        with_slice::<f32, _>(t, |send| self.inner.comm.reduce_scatter(send, &mut recv, op))??;
        let mut dims = t.dims().to_vec();
        dims[0] = block;
        let mine = Tensor::from_vec(recv, dims, &Device::Cpu)?;
        Ok(if op == ReduceOp::Avg && world > 1 { (mine / world as f64)? } else { mine })
    }
}

/// Walks two JSON values for the first path where they differ.
fn first_json_difference(path: &str, a: &serde_json::Value, b: &serde_json::Value) -> Option<(String, String, String)> {
    use serde_json::Value;
    match (a, b) {
        (Value::Object(x), Value::Object(y)) => {
            let keys: std::collections::BTreeSet<&String> = x.keys().chain(y.keys()).collect();
            for k in keys {
                let p = if path.is_empty() { k.clone() } else { format!("{path}.{k}") };
                match (x.get(k), y.get(k)) {
                    (Some(u), Some(v)) => {
                        if let Some(d) = first_json_difference(&p, u, v) {
                            return Some(d);
                        }
                    }
                    (u, v) => {
                        let show = |o: Option<&Value>| o.map_or("absent".to_string(), |v| v.to_string());
                        return Some((p, show(u), show(v)));
                    }
                }
            }
            None
        }
        (Value::Array(x), Value::Array(y)) if x.len() == y.len() => {
            x.iter().zip(y).enumerate().find_map(|(i, (u, v))| first_json_difference(&format!("{path}[{i}]"), u, v))
        }
        _ if a == b => None,
        _ => {
            Some((if path.is_empty() { "(the whole value)".into() } else { path.into() }, a.to_string(), b.to_string()))
        }
    }
}

fn host(what: &str, t: &Tensor) -> Result<(), DistError> {
    if t.device().is_cpu() {
        return Ok(());
    }
    Err(DistError::unsupported(
        what,
        "a device tensor: the MPI group carries host tensors (NCCL for CUDA tensors is not built yet; copy to the host)",
    ))
}

/// Runs `f` on a host tensor's values of type `T`: read where they lie when the tensor is
/// contiguous, from a copy otherwise.
pub(in crate::dist) fn with_slice<T: candle_core::WithDType, R>(
    t: &Tensor,
    f: impl FnOnce(&[T]) -> R,
) -> Result<R, DistError> {
    {
        let (storage, layout) = t.storage_and_layout();
        if let (candle_core::Storage::Cpu(cpu), Some((a, b))) = (&*storage, layout.contiguous_offsets()) {
            return Ok(f(&cpu.as_slice::<T>()?[a..b]));
        }
    }
    Ok(f(&t.flatten_all()?.to_vec1::<T>()?))
}

/// A host tensor's bytes, in element order.
pub(crate) fn to_bytes(t: &Tensor) -> Result<Vec<u8>, DistError> {
    let t = t.flatten_all()?;
    fn raw<T: candle_core::WithDType>(t: &Tensor) -> Result<Vec<u8>, DistError> {
        let v = t.to_vec1::<T>()?;
        let n = std::mem::size_of_val(v.as_slice());
        let mut out = vec![0u8; n];
        // SAFETY: `v` is `n` bytes of plain numbers (candle's element types have no padding
        // and every bit pattern is valid as bytes); `out` is `n` bytes.
        unsafe { std::ptr::copy_nonoverlapping(v.as_ptr() as *const u8, out.as_mut_ptr(), n) };
        Ok(out)
    }
    match t.dtype() {
        DType::U8 => raw::<u8>(&t),
        DType::U32 => raw::<u32>(&t),
        DType::I64 => raw::<i64>(&t),
        DType::BF16 => raw::<half::bf16>(&t),
        DType::F16 => raw::<half::f16>(&t),
        DType::F32 => raw::<f32>(&t),
        DType::F64 => raw::<f64>(&t),
        d => Err(DistError::unsupported("collective", format!("{d:?} tensors"))),
    }
}
