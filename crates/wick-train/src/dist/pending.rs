//! A collective in flight: MPI's non-blocking all-reduce or reduce-scatter (a sum), or
//! all-gather, started now and finished later, owning its buffers until it completes.
//!
//! Open MPI moves a non-blocking collective on inside the rank's later MPI calls (this one's
//! [`Pending::test`] among them); with one thread per rank nothing else does. Alone, and past
//! MPI's counts, the collective runs to completion when it is started.

use std::any::Any;

use candle_core::{CpuStorage, Storage, Tensor};

use super::comm::{Comm, Element};
use super::error::DistError;
use super::ReduceOp;

/// Which collective: every rank gets the whole sum, or block `rank` of it, or every rank's
/// values in rank order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Collective {
    AllReduce,
    /// The values are `world` equal blocks.
    ReduceScatter,
    AllGather,
}

/// What a collective sends: values of its own, or a contiguous f32 host tensor read where it
/// lies (a large gradient, reduced without a copy into a bucket).
pub(crate) enum Outgoing<T = f32> {
    Owned(Vec<T>),
    Tensor(Tensor),
}

impl<T: Element> Outgoing<T> {
    fn len(&self) -> usize {
        match self {
            Outgoing::Owned(v) => v.len(),
            Outgoing::Tensor(t) => t.elem_count(),
        }
    }

    /// Runs `f` on the values.
    fn with<R>(&self, f: impl FnOnce(&[T]) -> R) -> Result<R, DistError> {
        match self {
            Outgoing::Owned(v) => Ok(f(v)),
            Outgoing::Tensor(t) => {
                let (storage, layout) = t.storage_and_layout();
                let values = match (&*storage, layout.contiguous_offsets()) {
                    (Storage::Cpu(CpuStorage::F32(v)), Some((a, b))) => {
                        (v as &dyn Any).downcast_ref::<Vec<T>>().map(|v| &v[a..b])
                    }
                    _ => None,
                };
                match values {
                    Some(v) => Ok(f(v)),
                    None => Err(DistError::internal("a contiguous f32 host gradient was expected")),
                }
            }
        }
    }
}

/// The buffers a request in flight reads and writes: leaked boxes (taken back when it
/// completes) or a tensor kept alive.
#[cfg(feature = "mpi")]
enum Held<T> {
    Leaked(*mut [T]),
    Tensor(Tensor),
}

/// A collective in flight ([`Pending::start`]).
pub(crate) struct Pending<T: Element = f32> {
    #[cfg(feature = "mpi")]
    request: Option<mpi::request::Request<'static, [T], mpi::request::StaticScope>>,
    /// What `request` sends from, and its receive buffer (a leaked box).
    #[cfg(feature = "mpi")]
    buffers: Option<(Held<T>, *mut [T])>,
    /// The result, once complete.
    done: Option<Vec<T>>,
}

// SAFETY: the buffers are owned by this value alone (leaked boxes no one else points to, or a
// tensor whose storage no one writes: a gradient taken out of the store), and MPI calls on the
// request go through `MpiWorld::call`'s lock like every other call.
unsafe impl<T: Element> Send for Pending<T> {}

impl<T: Element> Pending<T> {
    /// Starts `collective` of `send` over ranks (a sum, or every rank's values).
    pub(crate) fn start(comm: &Comm, send: Outgoing<T>, collective: Collective) -> Result<Self, DistError> {
        let (_, size) = comm.rank_and_size();
        let n = send.len();
        let out = match collective {
            Collective::AllReduce => n,
            Collective::ReduceScatter if n.is_multiple_of(size.max(1)) => n / size.max(1),
            Collective::ReduceScatter => {
                return Err(DistError::internal(format!("reduce_scatter: {n} values over {size} ranks")));
            }
            Collective::AllGather => {
                n.checked_mul(size).ok_or_else(|| DistError::internal(format!("all_gather: {n} × {size} values")))?
            }
        };
        #[cfg(feature = "mpi")]
        if let Comm::Mpi(m) = comm {
            if out.max(n) <= super::comm::MAX_COUNT {
                use mpi::traits::CommunicatorCollectives;
                let (held, from): (Held<T>, *const [T]) = match send {
                    Outgoing::Owned(v) => {
                        let p = Box::into_raw(v.into_boxed_slice());
                        (Held::Leaked(p), p as *const [T])
                    }
                    Outgoing::Tensor(t) => {
                        let p = Outgoing::<T>::Tensor(t.clone()).with(|v| v as *const [T])?;
                        (Held::Tensor(t), p)
                    }
                };
                let recv: *mut [T] = Box::into_raw(vec![T::default(); out].into_boxed_slice());
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
                    Collective::AllGather => w.immediate_all_gather_into(mpi::request::StaticScope, s, r),
                })?;
                return Ok(Pending { request: Some(request), buffers: Some((held, recv)), done: None });
            }
        }
        let mut recv = vec![T::default(); out];
        send.with(|values| match collective {
            Collective::AllReduce => comm.all_reduce(values, &mut recv, ReduceOp::Sum),
            Collective::ReduceScatter => comm.reduce_scatter(values, &mut recv, ReduceOp::Sum),
            Collective::AllGather => comm.all_gather(values, &mut recv),
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

    /// Waits for it (on `comm`, the one that started it): the sum, this rank's block of it, or
    /// every rank's values.
    pub(crate) fn finish(mut self, comm: &Comm) -> Result<Vec<T>, DistError> {
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
    fn take_result(&mut self) -> Result<Vec<T>, DistError> {
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

impl<T: Element> Drop for Pending<T> {
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
