//! Mixed precision. This first part is the loss scaler; the autocast policy, fp32 master
//! weights and the fused CUDA kernels come with the rest of the AMP work.

mod grad_scaler;

pub use grad_scaler::{GradScaler, GradScalerConfig, ScalerError, StepOutcome};
