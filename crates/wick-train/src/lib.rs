//! # wick-train
//!
//! Training on top of the network layer (`wick-nn`): what burn-optim + burn-train and
//! `torch.optim` + `torch.amp` + `torch.utils.data` + `torch.distributed` are to their stacks.
//!
//! | module | what it owns |
//! |---|---|
//! | [`optim`] | the optimizer rules ([`Optimizer`]: SGD with momentum, AdamW) applied in one in-place pass, and the step that rounds f32 masters into a model's compute copies |
//! | [`clip`] | gradient clipping by the global norm (PyTorch's `clip_grad_norm_`), its coefficient folded into the update |
//! | [`amp`] | mixed precision: the loss scaler ([`amp::GradScaler`]), f32 master weights with f32 optimizer state ([`amp::MasterWeights`]), the fused device step (feature `cuda` launches wick-kernels' fused kernels, and [`amp::MasterWeights`]' step is one launch per parameter there), and that step captured as a CUDA graph (`amp::graph_step`, feature `cuda`) |
//! | [`updater`] | [`updater::Updater`]: backward and the update of a loop of one's own, on the host or fused on a CUDA device, clipped by the global norm where asked |
//! | [`trainer`] | [`Trainer`]: a training run over any [`wick_nn::Model`] (precision, LR schedule, accumulation, activation checkpointing, steps as CUDA graphs) that saves and resumes bit-exactly |
//! | [`checkpoint`] | training checkpoints on disk ([`CheckpointDir`]: tensors and manifest written atomically, checked and fallen back on when damaged) |
//! | [`data`] | the data loader ([`data::Loader`]: worker threads, pinned order, resumable positions) and its datasets |
//! | [`dist`] | more than one process: the [`dist::ProcessGroup`] (MPI through rsmpi, feature `mpi`), collectives over tensors, gradient buckets, ZeRO sharding of the optimizer state |
//! | [`jobs`] | detached runs ([`jobs::Job`]: a process in its own session, its status file, attach and stop) |
//! | [`error`] | [`TrainError`] |
//!
//! Activation checkpointing (recompute instead of keep) is the network layer's
//! (`wick_nn::checkpoint`); a "checkpoint" in this crate is always a training checkpoint.

pub mod amp;
pub mod checkpoint;
pub mod clip;
pub mod data;
pub mod dist;
pub mod error;
pub mod jobs;
pub mod optim;
pub mod trainer;
pub mod updater;

pub use checkpoint::CheckpointDir;
pub use error::TrainError;
pub use optim::Optimizer;
pub use trainer::Trainer;
