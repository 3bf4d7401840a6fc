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
    // Dropped last: `MPI_Finalize`.
    _universe: mpi::environment::Universe,
}

#[cfg(feature = "mpi")]
impl MpiWorld {
    /// Initialises MPI (calls from any thread, one at a time: `MPI_THREAD_SERIALIZED`).
    pub(crate) fn init() -> Result<Self, DistError> {
        let Some((universe, _provided)) = mpi::initialize_with_threading(mpi::Threading::Serialized) else {
            return Err(DistError::Launch {
                message: "MPI is initialised already in this process (one process group per process)".into(),
            });
        };
        let world = universe.world();
        Ok(MpiWorld { world, _universe: universe })
    }
}

#[cfg(feature = "mpi")]
fn system_op(op: ReduceOp) -> mpi::collective::SystemOperation {
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
            Comm::Mpi(m) => {
                use mpi::traits::Communicator;
                (m.world.rank().max(0) as usize, m.world.size().max(1) as usize)
            }
        }
    }

    /// Waits for every rank.
    pub(crate) fn barrier(&self) {
        match self {
            Comm::Single => {}
            #[cfg(feature = "mpi")]
            Comm::Mpi(m) => {
                use mpi::traits::CommunicatorCollectives;
                m.world.barrier()
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
                for (s, r) in send.chunks(MAX_COUNT).zip(recv.chunks_mut(MAX_COUNT)) {
                    m.world.all_reduce_into(s, r, system_op(op));
                }
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
                let root = m.world.process_at_rank(root as i32);
                for piece in buf.chunks_mut(MAX_COUNT) {
                    root.broadcast_into(piece);
                }
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
                if n <= MAX_COUNT / size.max(1) {
                    m.world.all_gather_into(send, recv);
                } else {
                    // Piece by piece: piece k of every rank, then placed at the rank's offset.
                    let piece = MAX_COUNT / size.max(1);
                    let mut scratch = vec![T::default(); piece * size];
                    for start in (0..n).step_by(piece) {
                        let len = piece.min(n - start);
                        let got = &mut scratch[..len * size];
                        m.world.all_gather_into(&send[start..start + len], got);
                        for r in 0..size {
                            recv[r * n + start..r * n + start + len].copy_from_slice(&got[r * len..(r + 1) * len]);
                        }
                    }
                }
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
                m.world.all_gather_varcount_into(send, &mut partition);
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
                if n <= MAX_COUNT / size.max(1) {
                    m.world.reduce_scatter_block_into(send, recv, system_op(op));
                } else {
                    // Block-wise pieces: piece k of every rank's block, gathered into one send.
                    let piece = MAX_COUNT / size.max(1);
                    let mut scratch = vec![T::default(); piece * size];
                    for start in (0..n).step_by(piece) {
                        let len = piece.min(n - start);
                        for r in 0..size {
                            scratch[r * len..(r + 1) * len].copy_from_slice(&send[r * n + start..r * n + start + len]);
                        }
                        m.world.reduce_scatter_block_into(
                            &scratch[..len * size],
                            &mut recv[start..start + len],
                            system_op(op),
                        );
                    }
                }
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
                m.world.abort(code)
            }
        }
    }
}
