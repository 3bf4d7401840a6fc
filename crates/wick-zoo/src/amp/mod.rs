//! Mixed precision. So far: the loss scaler and fp32 master weights with fp32 optimizer state;
//! the autocast policy inside the zoo models and the fused CUDA kernels come with the rest of the
//! AMP work.

mod grad_scaler;
mod master;

pub use grad_scaler::{GradScaler, GradScalerConfig, ScalerError, StepOutcome};
pub use master::{MasterOptimizer, MasterWeights};
