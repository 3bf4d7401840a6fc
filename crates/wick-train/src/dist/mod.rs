//! More than one process: a [`ProcessGroup`] of ranks started by a launcher (`mpirun`, `srun`),
//! collectives over candle tensors between them, and data-parallel training
//! ([`crate::Trainer::data_parallel`]) with optional sharding of the optimizer's state
//! ([`Sharding`]).
//!
//! The transport is an existing engine, never wick's own: MPI through rsmpi (feature `mpi`, over
//! the system's MPI — Open MPI or MPICH), which also runs on one host over shared memory.
//! Without the feature a group is the process alone, and the same code trains on one rank.
//!
//! | module | what it owns |
//! |---|---|
//! | `comm` | the transport under a group: MPI's world (serialised calls, counts split below `i32::MAX`) or the process alone |
//! | `pending` | a collective in flight: MPI's non-blocking all-reduce, reduce-scatter or all-gather owning its buffers, tested and finished later |
//! | [`launch`] | who this process is, from the launcher's environment ([`Launch`]) |
//! | [`group`] | [`ProcessGroup`]: rank, world size, and `all_reduce`/`broadcast`/`all_gather`/`reduce_scatter`/`barrier` over tensors, with every rank agreeing on dtypes and shapes first |
//! | [`buckets`] | gradient buckets (PyTorch DDP's sizes and order) and the data-parallel gradient sum |
//! | [`parallel`] | what a [`crate::Trainer`] holds under a group: the options ([`DataParallelOptions`]), the start-up checks and broadcasts, the step's agreement on failures, the update (replicated, or sharded as [`Sharding`] says) |
//! | `flight` | one step's reduction in flight: buckets started in order from inside backward (the patched candle's gradient hook) as their gradients complete, the rest after it; one bucket in flight at a time |
//! | `zero` | ZeRO stages 1 and 2: a rank's shard of masters and optimizer state, the reduce-scatter, the sharded update and the all-gather — over MPI on the host, or (`zero::nccl`) over NCCL with the fused kernels on GPUs |
//! | `pieces` | a parameter's pieces under stage 3: packed as bytes in its dtype, placed in a gather's bytes, made whole again (a fresh variable, or written into the model's tensor), its pages handed back |
//! | `prefetch` | stage 3's prefetch: the next block in the last step's order, and its gather in flight |
//! | `zero3` | ZeRO stage 3: a rank's shard of every parameter; the blocks' gather before they run (the next one's prefetched, as an option), again for backward (recomputed, or gathered back into the tensors the forward pass released) and reduce-scatter as their backward ends (in flight until the next block's; `zero3::reduce`); the tensor path (`zero3::tensors`): the same shard as tensors on the parameters' device over tensor collectives — NCCL on GPU ranks (the model's GPU copies of the blocks' parameters handed back by `wick_nn::pages::release`), the group's on host ranks that ask for it (`DataParallelOptions::tensor_path`, how CI runs it at two ranks) |
//! | `nccl` | (feature `nccl`) `NcclGroup`: an NCCL communicator per rank on its GPU, its id broadcast through the group (MPI for several ranks); `all_reduce`, `broadcast`, `all_gather`, `reduce_scatter` of CUDA tensors, each with a deadline; the trainer's GPU gradient buckets |
//! | [`error`] | [`DistError`] |
//!
//! A rank that dies cannot become an error here: rsmpi runs MPI with its errors-are-fatal
//! handler, so mpirun ends the whole job and names the rank; resilience is the trainer's
//! checkpoints (a resumed run continues bit-exactly).

pub mod buckets;
mod comm;
pub mod error;
pub(crate) mod flight;
pub mod group;
pub mod launch;
#[cfg(feature = "nccl")]
pub mod nccl;
pub mod parallel;
mod pending;
mod pieces;
mod prefetch;
pub(crate) mod zero;
pub(crate) mod zero3;

pub use comm::Element;
pub use error::DistError;
pub use group::ProcessGroup;
pub use launch::Launch;
pub use parallel::DataParallelOptions;

/// The communicator for tensors on a GPU.
#[cfg(feature = "nccl")]
pub(crate) type GpuComm = nccl::NcclGroup;
/// Without the `nccl` feature there is none (GPU parameters are refused).
#[cfg(not(feature = "nccl"))]
pub(crate) enum GpuComm {}

/// How a collective combines the ranks' values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReduceOp {
    /// The sum.
    Sum,
    /// The mean (the sum divided by the world size; floats only).
    Avg,
    /// The largest.
    Max,
    /// The smallest.
    Min,
}

/// How much of the training state each rank keeps whole.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum Sharding {
    /// Every rank holds everything (plain data parallel, PyTorch DDP).
    None,
    /// ZeRO stage 1: the f32 masters and the optimizer state are sharded; gradients are
    /// all-reduced whole.
    OptimizerState,
    /// ZeRO stage 2: as stage 1, and gradients are reduce-scattered (a rank keeps its shard).
    Gradients,
    /// ZeRO stage 3 (FSDP's `FULL_SHARD`): as stage 2, and the parameters of the model's blocks
    /// are sharded too — each block gathered whole just before it runs, forward and (recomputed)
    /// backward, and dropped after.
    Parameters,
}

impl Sharding {
    /// The ZeRO stage (0 for none).
    pub fn stage(self) -> u8 {
        match self {
            Sharding::None => 0,
            Sharding::OptimizerState => 1,
            Sharding::Gradients => 2,
            Sharding::Parameters => 3,
        }
    }

    /// The sharding of ZeRO stage `stage` (0 to 3).
    pub fn from_stage(stage: u8) -> Result<Self, DistError> {
        match stage {
            0 => Ok(Sharding::None),
            1 => Ok(Sharding::OptimizerState),
            2 => Ok(Sharding::Gradients),
            3 => Ok(Sharding::Parameters),
            s => Err(DistError::unsupported("sharding", format!("ZeRO stage {s}: the stages are 0, 1, 2 and 3"))),
        }
    }
}
