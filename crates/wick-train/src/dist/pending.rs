//! A collective in flight: MPI's non-blocking all-reduce or reduce-scatter (a sum of f32
//! values), started now and finished later, owning its buffers until it completes.
//!
//! Open MPI moves a non-blocking collective on inside the rank's later MPI calls (this one's
//! [`Pending::test`] among them); with one thread per rank nothing else does. Alone, and past
//! MPI's counts, the collective runs to completion when it is started.

use candle_core::{CpuStorage, Storage, Tensor};

use super::comm::Comm;
use super::error::DistError;
use super::ReduceOp;

/// Which collective: every rank gets the whole sum, or block `rank` of it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Collective {
    AllReduce,
    /// The values are `world` equal blocks.
    ReduceScatter,
}

/// What a collective sends: values of its own, or a contiguous f32 host tensor read where it
/// lies (a large gradient, reduced without a copy into a bucket).
pub(crate) enum Outgoing {
    Owned(Vec<f32>),
    Tensor(Tensor),
}

impl Outgoing {
    fn len(&self) -> usize {
        match self {
            Outgoing::Owned(v) => v.len(),
            Outgoing::Tensor(t) => t.elem_count(),
        }
    }

    /// Runs `f` on the values.
    fn with<R>(&self, f: impl FnOnce(&[f32]) -> R) -> Result<R, DistError> {
        match self {
            Outgoing::Owned(v) => Ok(f(v)),
            Outgoing::Tensor(t) => {
                let (storage, layout) = t.storage_and_layout();
                match (&*storage, layout.contiguous_offsets()) {
                    (Storage::Cpu(CpuStorage::F32(v)), Some((a, b))) => Ok(f(&v[a..b])),
                    _ => Err(DistError::internal("a contiguous f32 host gradient was expected")),
                }
            }
        }
    }
}

/// The buffers a request in flight reads and writes: leaked boxes (taken back when it
/// completes) or a tensor kept alive.
#[cfg(feature = "mpi")]
enum Held {
    Leaked(*mut [f32]),
    Tensor(Tensor),
}

/// A collective in flight ([`Pending::start`]).
pub(crate) struct Pending {
    #[cfg(feature = "mpi")]
    request: Option<mpi::request::Request<'static, [f32], mpi::request::StaticScope>>,
    /// What `request` sends from, and its receive buffer (a leaked box).
    #[cfg(feature = "mpi")]
    buffers: Option<(Held, *mut [f32])>,
    /// The result, once complete.
    done: Option<Vec<f32>>,
}

// SAFETY: the buffers are owned by this value alone (leaked boxes no one else points to, or a
// tensor whose storage no one writes: a gradient taken out of the store), and MPI calls on the
// request go through `MpiWorld::call`'s lock like every other call.
unsafe impl Send for Pending {}

impl Pending {
    /// Starts the sum of `send` over ranks (`collective` says who gets what).
    pub(crate) fn start(comm: &Comm, send: Outgoing, collective: Collective) -> Result<Pending, DistError> {
        let (_, size) = comm.rank_and_size();
        let n = send.len();
        let out = match collective {
            Collective::AllReduce => n,
            Collective::ReduceScatter if n.is_multiple_of(size.max(1)) => n / size.max(1),
            Collective::ReduceScatter => {
                return Err(DistError::internal(format!("reduce_scatter: {n} values over {size} ranks")));
            }
        };
        #[cfg(feature = "mpi")]
        if let Comm::Mpi(m) = comm {
            if n <= super::comm::MAX_COUNT {
                use mpi::traits::CommunicatorCollectives;
                let (held, from): (Held, *const [f32]) = match send {
                    Outgoing::Owned(v) => {
                        let p = Box::into_raw(v.into_boxed_slice());
                        (Held::Leaked(p), p as *const [f32])
                    }
                    Outgoing::Tensor(t) => {
                        let p = Outgoing::Tensor(t.clone()).with(|v| v as *const [f32])?;
                        (Held::Tensor(t), p)
                    }
                };
                let recv: *mut [f32] = Box::into_raw(vec![0f32; out].into_boxed_slice());
                // SAFETY: `from` points into a leaked box or into the storage of a tensor held
                // in `buffers` (a gradient no one writes, whose storage lives as long as the
                // tensor); `recv` is a box just leaked. The request gets the only references
                // used until it completes, and `buffers` keeps both alive until then.
                let (s, r) = unsafe { (&*from, &mut *recv) };
                let sum = super::comm::system_op(ReduceOp::Sum);
                let request = m.call(|w| match collective {
                    Collective::AllReduce => w.immediate_all_reduce_into(mpi::request::StaticScope, s, r, sum),
                    Collective::ReduceScatter => {
                        w.immediate_reduce_scatter_block_into(mpi::request::StaticScope, s, r, sum)
                    }
                })?;
                return Ok(Pending { request: Some(request), buffers: Some((held, recv)), done: None });
            }
        }
        let mut recv = vec![0f32; out];
        send.with(|values| match collective {
            Collective::AllReduce => comm.all_reduce(values, &mut recv, ReduceOp::Sum),
            Collective::ReduceScatter => comm.reduce_scatter(values, &mut recv, ReduceOp::Sum),
        })??;
        Ok(Pending {
            #[cfg(feature = "mpi")]
            request: None,
            #[cfg(feature = "mpi")]
            buffers: None,
            done: Some(recv),
        })
    }

    /// Whether it completed (an MPI call that also moves it on).
    pub(crate) fn test(&mut self, comm: &Comm) -> Result<bool, DistError> {
        if self.done.is_some() {
            return Ok(true);
        }
        #[cfg(feature = "mpi")]
        if let (Some(request), Comm::Mpi(m)) = (self.request.take(), comm) {
            match m.call(|_| request.test())? {
                Ok(_) => {
                    self.done = Some(self.take_result()?);
                    return Ok(true);
                }
                Err(request) => {
                    self.request = Some(request);
                    return Ok(false);
                }
            }
        }
        let _ = comm;
        Err(DistError::internal("a collective in flight without a request"))
    }

    /// Waits for it (on `comm`, the one that started it): the sum, or this rank's block of it.
    pub(crate) fn finish(mut self, comm: &Comm) -> Result<Vec<f32>, DistError> {
        if let Some(done) = self.done.take() {
            return Ok(done);
        }
        #[cfg(feature = "mpi")]
        if let (Some(request), Comm::Mpi(m)) = (self.request.take(), comm) {
            m.call(|_| request.wait())?;
            return self.take_result();
        }
        let _ = comm;
        Err(DistError::internal("a collective finished twice"))
    }

    /// The receive buffer of a completed request, its send buffer freed.
    #[cfg(feature = "mpi")]
    fn take_result(&mut self) -> Result<Vec<f32>, DistError> {
        let Some((held, recv)) = self.buffers.take() else {
            return Err(DistError::internal("a collective's buffers were taken twice"));
        };
        // SAFETY: the request completed, so MPI no longer touches the buffers, which are the
        // boxes leaked in `start` (taken back once) or a tensor dropped here.
        unsafe {
            match held {
                Held::Leaked(send) => drop(Box::from_raw(send)),
                Held::Tensor(t) => drop(t),
            }
            Ok(Box::from_raw(recv).into_vec())
        }
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        // Dropped before it completed (a step that failed): the request and its buffers are
        // left as they are, never freed while MPI may still write into them.
        #[cfg(feature = "mpi")]
        if let Some(request) = self.request.take() {
            std::mem::forget(request);
            if let Some((held, _)) = self.buffers.take() {
                std::mem::forget(held);
            }
        }
    }
}
