//! Mixed precision: the loss scaler ([`GradScaler`]), fp32 master weights with fp32 optimizer
//! state ([`MasterWeights`]), and the fused device step (`device_step`: the kernels of the
//! wick-kernels crate, launched by `cuda`, with the `cuda` feature) that `crate::updater::Updater`
//! takes on a CUDA device, and the same step captured as a CUDA graph (`graph_step`). The autocast switch, the op policy the models
//! follow, is the network layer's (`wick_nn::Autocast`). The AMP-vs-f32
//! trial that checks all of it is a harness, in `tools/` (wick-tools).

#[cfg(feature = "cuda")]
pub mod cuda;
#[cfg(feature = "cuda")]
pub mod device_step;
mod grad_scaler;
#[cfg(feature = "cuda")]
pub mod graph_step;
mod master;

pub use grad_scaler::{GradScaler, GradScalerConfig, ScalerError, ScalerState, StepOutcome};
pub(crate) use master::account as account_holdings;
pub(crate) use master::check_masters;
pub use master::{masters_by_name, MasterState, MasterWeights};

use candle_core::backprop::GradStore;
use candle_core::{Tensor, Var};

/// Back-propagates `loss`, multiplied by the loss scale first when there is a scaler (f16).
pub fn scaled_backward(loss: &Tensor, scaler: Option<&GradScaler>) -> Result<GradStore, ScalerError> {
    match scaler {
        Some(s) => Ok(s.scale_loss(loss)?.backward()?),
        None => Ok(loss.backward()?),
    }
}

/// Gradient accumulation: `grads` (of one micro-batch) added to the sum of the earlier ones
/// (`total`, none for the first), parameter by parameter in the order of `vars`.
pub fn add_grads<'a>(
    total: Option<GradStore>,
    grads: GradStore,
    vars: impl IntoIterator<Item = &'a Var>,
) -> candle_core::Result<GradStore> {
    let Some(mut sum) = total else { return Ok(grads) };
    for v in vars {
        if let Some(g) = grads.get(v.as_tensor()) {
            let next = match sum.remove(v.as_tensor()) {
                Some(s) => (s + g)?,
                None => g.clone(),
            };
            sum.insert(v.as_tensor(), next);
        }
    }
    Ok(sum)
}

/// One update of `masters` from the gradients of `vars`: through the scaler when there is one
/// (unscale, skip on inf/NaN, update the scale), directly otherwise.
pub fn master_step(
    grads: &mut GradStore,
    masters: &mut MasterWeights,
    scaler: Option<&mut GradScaler>,
    vars: &[&Var],
) -> Result<StepOutcome, ScalerError> {
    match scaler {
        Some(s) => {
            let outcome = s.step(grads, vars, |g| masters.step(g))?;
            s.update()?;
            Ok(outcome)
        }
        None => {
            masters.step(grads)?;
            Ok(StepOutcome::Applied)
        }
    }
}
