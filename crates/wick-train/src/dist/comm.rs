//! The transport underneath a [`super::ProcessGroup`]: MPI (rsmpi over the system's MPI, feature
//! `mpi`) or the process alone (world size 1, every collective a copy). Slices only; tensors,
//! checks and names are the group's.
//!
//! MPI counts are `int`: every call here is split into pieces of at most [`MAX_COUNT`] elements,
//! so a tensor of any size goes through (each piece is a complete collective of its own, taken in
//! the same order on every rank).

use super::error::DistError;
use super::ReduceOp;

/// The most elements one MPI call carries (below `i32::MAX`, a multiple of every world size up
/// to 2^10 so that reduce-scatter pieces stay equal).
pub(crate) const MAX_COUNT: usize = 1 << 30;

/// An element type the collectives carry.
#[cfg(feature = "mpi")]
pub trait Element: Copy + Default + Send + Sync + 'static + mpi::traits::Equivalence {}
/// An element type the collectives carry.
#[cfg(not(feature = "mpi"))]
pub trait Element: Copy + Default + Send + Sync + 'static {}

impl Element for f32 {}
impl Element for f64 {}
impl Element for u8 {}
impl Element for u16 {}
impl Element for u32 {}
impl Element for u64 {}
impl Element for i64 {}

/// Where the collectives go.
pub(crate) enum Comm {
    /// The process alone.
    Single,
    /// MPI's world communicator.
    #[cfg(feature = "mpi")]
    Mpi(Box<MpiWorld>),
}

/// MPI, initialised once per process; finalised when dropped (rsmpi's `Universe`).
#[cfg(feature = "mpi")]
pub(crate) struct MpiWorld {
    world: mpi::topology::SimpleCommunicator,
    /// Held during every MPI call: calls never overlap (`MPI_THREAD_SERIALIZED`'s rule).
    lock: std::sync::Mutex<()>,
    /// The thread that initialised MPI, when the library granted less than serialized calls
    /// from any thread: only it may call.
    only: Option<std::thread::ThreadId>,
    /// This process's rank and the world size, read once.
    rank_and_size: (usize, usize),
    // Dropped last: `MPI_Finalize`.
    _universe: mpi::environment::Universe,
}

// SAFETY: the communicator is a handle that MPI allows any thread to use under
// MPI_THREAD_SERIALIZED as long as calls do not overlap; every call goes through `MpiWorld::call`,
// which holds `lock` for its duration, and when the library granted less than serialized access,
// refuses calls from any thread but the one that initialised MPI.
#[cfg(feature = "mpi")]
unsafe impl Send for MpiWorld {}
// SAFETY: as above: shared use is serialised by `lock`.
#[cfg(feature = "mpi")]
unsafe impl Sync for MpiWorld {}

#[cfg(feature = "mpi")]
impl MpiWorld {
    /// Initialises MPI, asking for calls from any thread one at a time (`MPI_THREAD_SERIALIZED`).
    pub(crate) fn init() -> Result<Self, DistError> {
        let Some((universe, provided)) = mpi::initialize_with_threading(mpi::Threading::Serialized) else {
            return Err(DistError::Launch {
                message: "MPI is initialised already in this process (one process group per process)".into(),
            });
        };
        let serialized = matches!(provided, mpi::Threading::Serialized | mpi::Threading::Multiple);
        let only = (!serialized).then(|| std::thread::current().id());
        let world = universe.world();
        use mpi::traits::Communicator;
        let rank_and_size = (world.rank().max(0) as usize, world.size().max(1) as usize);
        Ok(MpiWorld { world, lock: std::sync::Mutex::new(()), only, rank_and_size, _universe: universe })
    }

    /// Runs `f` on the communicator, alone.
    pub(super) fn call<R>(&self, f: impl FnOnce(&mpi::topology::SimpleCommunicator) -> R) -> Result<R, DistError> {
        if self.only.is_some_and(|t| t != std::thread::current().id()) {
            return Err(DistError::unsupported(
                "collective",
                "this MPI library allows calls from the thread that initialised it only",
            ));
        }
        let _alone = self.lock.lock().unwrap_or_else(|p| p.into_inner());
        Ok(f(&self.world))
    }
}

#[cfg(feature = "mpi")]
pub(super) fn system_op(op: ReduceOp) -> mpi::collective::SystemOperation {
    use mpi::collective::SystemOperation;
    match op {
        ReduceOp::Sum | ReduceOp::Avg => SystemOperation::sum(),
        ReduceOp::Max => SystemOperation::max(),
        ReduceOp::Min => SystemOperation::min(),
    }
}

impl Comm {
    /// (rank, world size).
    pub(crate) fn rank_and_size(&self) -> (usize, usize) {
        match self {
            Comm::Single => (0, 1),
            #[cfg(feature = "mpi")]
            Comm::Mpi(m) => m.rank_and_size,
        }
    }

    /// Waits for every rank.
    pub(crate) fn barrier(&self) -> Result<(), DistError> {
        match self {
            Comm::Single => Ok(()),
            #[cfg(feature = "mpi")]
            Comm::Mpi(m) => {
                use mpi::traits::CommunicatorCollectives;
                m.call(|w| w.barrier())
            }
        }
    }

    /// `recv = op(send over ranks)` (Avg sums; the caller divides).
    pub(crate) fn all_reduce<T: Element>(&self, send: &[T], recv: &mut [T], op: ReduceOp) -> Result<(), DistError> {
        if send.len() != recv.len() {
            return Err(DistError::internal(format!("all_reduce: {} sent, {} to receive", send.len(), recv.len())));
        }
        match self {
            Comm::Single => {
                let _ = op;
                recv.copy_from_slice(send)
            }
            #[cfg(feature = "mpi")]
            Comm::Mpi(m) => {
                use mpi::traits::CommunicatorCollectives;
                m.call(|w| {
                    for (s, r) in send.chunks(MAX_COUNT).zip(recv.chunks_mut(MAX_COUNT)) {
                        w.all_reduce_into(s, r, system_op(op));
                    }
                })?;
            }
        }
        Ok(())
    }

    /// Rank `root`'s `buf` into every rank's.
    pub(crate) fn broadcast<T: Element>(&self, buf: &mut [T], root: usize) -> Result<(), DistError> {
        match self {
            Comm::Single => {
                let _ = (buf, root);
            }
            #[cfg(feature = "mpi")]
            Comm::Mpi(m) => {
                use mpi::traits::{Communicator, Root};
                m.call(|w| {
                    let root = w.process_at_rank(root as i32);
                    for piece in buf.chunks_mut(MAX_COUNT) {
                        root.broadcast_into(piece);
                    }
                })?;
            }
        }
        Ok(())
    }

    /// Every rank's `send` (equal lengths), in rank order, into `recv` (`size × send.len()`).
    pub(crate) fn all_gather<T: Element>(&self, send: &[T], recv: &mut [T]) -> Result<(), DistError> {
        let (_, size) = self.rank_and_size();
        let n = send.len();
        if n.checked_mul(size) != Some(recv.len()) {
            return Err(DistError::internal(format!(
                "all_gather: {n} sent by each of {size}, {} to receive",
                recv.len()
            )));
        }
        match self {
            Comm::Single => recv.copy_from_slice(send),
            #[cfg(feature = "mpi")]
            Comm::Mpi(m) => {
                use mpi::traits::CommunicatorCollectives;
                m.call(|w| {
                    if n <= MAX_COUNT / size.max(1) {
                        w.all_gather_into(send, recv);
                        return;
                    }
                    // Piece by piece: piece k of every rank, then placed at the rank's offset.
                    let piece = MAX_COUNT / size.max(1);
                    let mut scratch = vec![T::default(); piece * size];
                    for start in (0..n).step_by(piece) {
                        let len = piece.min(n - start);
                        let got = &mut scratch[..len * size];
                        w.all_gather_into(&send[start..start + len], got);
                        for r in 0..size {
                            recv[r * n + start..r * n + start + len].copy_from_slice(&got[r * len..(r + 1) * len]);
                        }
                    }
                })?;
            }
        }
        Ok(())
    }

    /// Every rank's `send` (lengths may differ), in rank order: the whole and each rank's length.
    pub(crate) fn all_gather_var<T: Element>(&self, send: &[T]) -> Result<(Vec<T>, Vec<usize>), DistError> {
        let (_, size) = self.rank_and_size();
        let mut lens = vec![0u64; size];
        self.all_gather(&[send.len() as u64], &mut lens)?;
        let lens: Vec<usize> = lens.into_iter().map(|l| l as usize).collect();
        let total = lens.iter().try_fold(0usize, |a, &l| a.checked_add(l));
        let total = total.filter(|&t| t <= MAX_COUNT).ok_or_else(|| DistError::internal("all_gather_var: too long"))?;
        let mut out = vec![T::default(); total];
        match self {
            Comm::Single => out.copy_from_slice(send),
            #[cfg(feature = "mpi")]
            Comm::Mpi(m) => {
                use mpi::datatype::PartitionMut;
                use mpi::traits::CommunicatorCollectives;
                let counts: Vec<i32> = lens.iter().map(|&l| l as i32).collect();
                let displs: Vec<i32> =
                    counts.iter().scan(0i32, |acc, &c| Some(std::mem::replace(acc, *acc + c))).collect();
                let mut partition = PartitionMut::new(&mut out[..], counts, &displs[..]);
                m.call(|w| w.all_gather_varcount_into(send, &mut partition))?;
            }
        }
        Ok((out, lens))
    }

    /// `op` over ranks of `send` (`size × recv.len()`), block `rank` of it into `recv`.
    pub(crate) fn reduce_scatter<T: Element>(&self, send: &[T], recv: &mut [T], op: ReduceOp) -> Result<(), DistError> {
        let (_, size) = self.rank_and_size();
        let n = recv.len();
        if n.checked_mul(size) != Some(send.len()) {
            return Err(DistError::internal(format!("reduce_scatter: {} sent, {n} each to {size}", send.len())));
        }
        match self {
            Comm::Single => {
                let _ = op;
                recv.copy_from_slice(send)
            }
            #[cfg(feature = "mpi")]
            Comm::Mpi(m) => {
                use mpi::traits::CommunicatorCollectives;
                m.call(|w| {
                    if n <= MAX_COUNT / size.max(1) {
                        w.reduce_scatter_block_into(send, recv, system_op(op));
                        return;
                    }
                    // Block-wise pieces: piece k of every rank's block, gathered into one send.
                    let piece = MAX_COUNT / size.max(1);
                    let mut scratch = vec![T::default(); piece * size];
                    for start in (0..n).step_by(piece) {
                        let len = piece.min(n - start);
                        for r in 0..size {
                            scratch[r * len..(r + 1) * len].copy_from_slice(&send[r * n + start..r * n + start + len]);
                        }
                        w.reduce_scatter_block_into(
                            &scratch[..len * size],
                            &mut recv[start..start + len],
                            system_op(op),
                        );
                    }
                })?;
            }
        }
        Ok(())
    }

    /// Ends the whole job now (every rank), with `code`.
    pub(crate) fn abort(&self, code: i32) -> ! {
        match self {
            Comm::Single => std::process::exit(code),
            #[cfg(feature = "mpi")]
            Comm::Mpi(m) => {
                use mpi::traits::Communicator;
                // No lock: another thread may be inside a collective that will never finish.
                m.world.abort(code)
            }
        }
    }
}
