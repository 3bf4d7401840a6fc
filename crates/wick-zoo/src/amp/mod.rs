//! Mixed precision: the autocast policy ([`autocast`]), the loss scaler ([`GradScaler`]), fp32
//! master weights with fp32 optimizer state ([`MasterWeights`]), and CPU references of the fused
//! CUDA kernels in `kernels/` ([`mod@reference`]; the kernels themselves in `cuda_kernels` and
//! `device_step` with the `cuda` feature), and the AMP-vs-f32 trial ([`trial`]).

pub mod autocast;
#[cfg(feature = "cuda")]
pub mod cuda_kernels;
#[cfg(feature = "cuda")]
pub mod device_step;
mod grad_scaler;
mod master;
pub mod reference;
pub mod trial;

pub use autocast::Autocast;
pub use grad_scaler::{GradScaler, GradScalerConfig, ScalerError, StepOutcome};
pub use master::{MasterOptimizer, MasterWeights};
