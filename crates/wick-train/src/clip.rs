//! Gradient clipping by the global 2-norm: PyTorch's `torch.nn.utils.clip_grad_norm_`. The
//! norm is taken over every parameter's gradient at once (`‖g‖ = √Σ‖gᵢ‖²`), and each gradient is
//! multiplied by `min(1, max_norm / (‖g‖ + 10⁻⁶))`, PyTorch's coefficient and ε.
//!
//! The trainer ([`crate::trainer::TrainOptions::clip_grad_norm`], through
//! [`clipped_master_step`]) does not multiply the gradients: it hands the coefficient to the
//! optimizer's update, which multiplies each gradient element as it
//! reads it (`wick_kernels::cpu::optim`, and the fused CUDA update) — no pass and no copy of its
//! own. Under the loss scaler the norm is that of the unscaled gradients, taken only for a step
//! that is applied (PyTorch's order: `unscale_`, clip, `step`). Data-parallel, the norm is of the
//! summed gradients: each rank's share of the squares (ZeRO shards) is summed over the ranks
//! first, so every rank applies the same coefficient.
//!
//! One difference from PyTorch, on purpose: a norm that is not finite (an inf or NaN gradient
//! without a loss scaler to skip the step) is an error and the update does not run, where
//! PyTorch's default multiplies every gradient by NaN and the parameters are lost.

use candle_core::backprop::GradStore;
use candle_core::{CpuStorage, DType, Device, Result, Storage, Tensor, Var};

use crate::amp::{GradScaler, MasterWeights, StepOutcome};
use crate::error::TrainError;

/// PyTorch's ε in the coefficient's denominator.
pub const EPS: f64 = 1e-6;

/// The factor each gradient is multiplied by for a total norm `norm` clipped at `max_norm`:
/// `min(1, max_norm / (norm + ε))`, rounded to f32 once (PyTorch computes it in the gradients'
/// dtype, f32). Exactly 1 when the norm is within bounds, so an unclipped step is unchanged.
pub fn coefficient(norm: f64, max_norm: f64) -> f32 {
    (max_norm / (norm + EPS)).min(1.0) as f32
}

/// `Σ x²` over a CPU tensor's elements in f64 (each widened from its dtype), read in place
/// (`wick_kernels::cpu::optim::sum_of_squares`: the same bits on every machine).
fn cpu_squares(t: &Tensor) -> Result<f64> {
    use wick_kernels::cpu::optim::sum_of_squares;
    let t = t.contiguous()?;
    let (storage, layout) = t.storage_and_layout();
    let (Storage::Cpu(cpu), Some((a, b))) = (&*storage, layout.contiguous_offsets()) else {
        return Err(candle_core::Error::Msg("gradient clipping: a CPU gradient that is not contiguous".into()));
    };
    Ok(match cpu {
        CpuStorage::F32(v) => sum_of_squares(&v[a..b]),
        CpuStorage::BF16(v) => sum_of_squares(&v[a..b]),
        CpuStorage::F16(v) => sum_of_squares(&v[a..b]),
        CpuStorage::F64(v) => v[a..b].iter().map(|x| x * x).sum(),
        _ => return Err(candle_core::Error::Msg(format!("gradient clipping: a {:?} gradient", t.dtype()))),
    })
}

/// The sum of the squared 2-norms of the gradients of `vars` present in `grads` (parameters
/// without a gradient count as zero), in f64. CPU gradients are read in place; on a device each
/// gradient is reduced there and the sums are read back together, one transfer for all.
pub fn grad_squares(grads: &GradStore, vars: &[&Var]) -> Result<f64> {
    #[cfg(feature = "cuda")]
    if let Some(total) = device_squares(grads, vars)? {
        return Ok(total);
    }
    let mut total = 0.0;
    let mut on_device = Vec::new();
    for g in vars.iter().filter_map(|v| grads.get(v.as_tensor())) {
        if g.device().is_cpu() {
            total += cpu_squares(g)?;
        } else {
            on_device.push(g.to_dtype(DType::F32)?.sqr()?.sum_all()?.to_dtype(DType::F64)?);
        }
    }
    let Some(first) = on_device.first() else { return Ok(total) };
    let values: Vec<f64> = if on_device.iter().all(|s| s.device().same_device(first.device())) {
        Tensor::stack(&on_device, 0)?.to_device(&Device::Cpu)?.to_vec1()?
    } else {
        on_device.iter().map(|s| s.to_device(&Device::Cpu)?.to_scalar::<f64>()).collect::<Result<_>>()?
    };
    Ok(values.iter().fold(total, |sum, v| sum + v))
}

/// [`grad_squares`] on a CUDA device with wick's kernels: every gradient in one launch per dtype
/// (`AmpKernels::squares_multi`), or `None` where the gradients are not all f32/f16/bf16 on one
/// CUDA device whose kernels load (the reduction per tensor runs then).
#[cfg(feature = "cuda")]
fn device_squares(grads: &GradStore, vars: &[&Var]) -> Result<Option<f64>> {
    let present: Vec<Tensor> =
        vars.iter().filter_map(|v| grads.get(v.as_tensor())).map(|g| g.contiguous()).collect::<Result<_>>()?;
    let Some(first) = present.first() else { return Ok(None) };
    let device = first.device().clone();
    let fits =
        |g: &Tensor| g.device().same_device(&device) && matches!(g.dtype(), DType::F32 | DType::F16 | DType::BF16);
    if !device.is_cuda() || !present.iter().all(fits) {
        return Ok(None);
    }
    let Ok(kernels) = crate::amp::cuda::shared(&device) else { return Ok(None) };
    let refs: Vec<&Tensor> = present.iter().collect();
    kernels.squares_multi(&refs).map(Some).map_err(candle_core::Error::wrap)
}

/// The global 2-norm of the gradients of `vars` in `grads` (PyTorch's `total_norm`).
pub fn grad_norm(grads: &GradStore, vars: &[&Var]) -> Result<f64> {
    Ok(grad_squares(grads, vars)?.sqrt())
}

/// The coefficient for the total norm `norm` (see [`coefficient`]), or an error that names the
/// norm when it is not finite: the update must not run (see the module's note).
pub fn checked_coefficient(norm: f64, max_norm: f64) -> std::result::Result<f32, TrainError> {
    if !norm.is_finite() {
        return Err(non_finite(norm));
    }
    Ok(coefficient(norm, max_norm))
}

/// The error of a step whose gradients' total norm `norm` is not finite (nothing applied).
pub(crate) fn non_finite(norm: f64) -> TrainError {
    TrainError::Invalid {
        what: "gradient clipping".into(),
        message: format!(
            "the gradients' total norm is {norm} (an inf or NaN gradient); the update was not applied and the \
             parameters are unchanged. Lower the learning rate, or train in mixed precision with a loss scaler, \
             which skips such steps"
        ),
    }
}

/// Clips the gradients of `vars` in `grads` to a total norm of at most `max_norm`, in place (each
/// replaced by itself times the coefficient), and returns the norm before clipping — PyTorch's
/// `clip_grad_norm_` for a loop of one's own. A non-finite norm is an error and leaves the
/// gradients as they were. (The trainer folds the coefficient into the update instead.)
pub fn clip_grad_norm(grads: &mut GradStore, vars: &[&Var], max_norm: f64) -> std::result::Result<f64, TrainError> {
    check_max_norm(max_norm)?;
    let norm = grad_norm(grads, vars)?;
    let factor = checked_coefficient(norm, max_norm)?;
    for v in vars {
        if let Some(g) = grads.remove(v.as_tensor()) {
            let g = g.detach();
            let scaled = if factor == 1.0 { g } else { g.affine(f64::from(factor), 0.0)? };
            grads.insert(v.as_tensor(), scaled);
        }
    }
    Ok(norm)
}

/// A clipping bound must be a positive finite number.
pub fn check_max_norm(max_norm: f64) -> std::result::Result<(), TrainError> {
    if max_norm.is_finite() && max_norm > 0.0 {
        return Ok(());
    }
    Err(TrainError::Invalid {
        what: "gradient clipping".into(),
        message: format!("the maximum norm must be a positive finite number, not {max_norm}"),
    })
}

/// [`crate::amp::master_step`] with the gradients clipped to a total norm of `max_norm` when
/// given: the norm of the unscaled gradients, taken only when the step is applied, its
/// coefficient folded into the update. Returns the outcome and the norm before clipping (none
/// without clipping, or for a skipped step). A non-finite norm without a scaler is an error and
/// nothing is applied.
pub fn clipped_master_step(
    grads: &mut GradStore,
    masters: &mut MasterWeights,
    scaler: Option<&mut GradScaler>,
    vars: &[&Var],
    max_norm: Option<f64>,
) -> std::result::Result<(StepOutcome, Option<f64>), TrainError> {
    let Some(max_norm) = max_norm else {
        return Ok((crate::amp::master_step(grads, masters, scaler, vars)?, None));
    };
    check_max_norm(max_norm)?;
    match scaler {
        Some(s) => {
            let mut norm = None;
            let outcome = s.step(grads, vars, |g| {
                // Every gradient is finite here (the scaler skips the step otherwise).
                let n = grad_norm(g, vars)?;
                norm = Some(n);
                masters.step_clipped(g, coefficient(n, max_norm))
            })?;
            s.update()?;
            Ok((outcome, norm))
        }
        None => {
            let n = grad_norm(grads, vars)?;
            masters.step_clipped(grads, checked_coefficient(n, max_norm)?)?;
            Ok((StepOutcome::Applied, Some(n)))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The coefficient is PyTorch's, 1 within bounds, and the norm is the 2-norm of all
    /// gradients together; clipping scales every gradient by it.
    #[test]
    fn clipping_scales_to_the_bound_by_the_global_norm() -> std::result::Result<(), TrainError> {
        assert_eq!(coefficient(0.5, 1.0), 1.0);
        assert_eq!(coefficient(10.0, 1.0), (1.0 / (10.0 + 1e-6)) as f32);
        let dev = Device::Cpu;
        let a = Var::new(&[0f32; 3], &dev)?;
        let b = Var::new(&[[0f32; 2]; 2], &dev)?;
        let c = Var::new(&[0f32; 2], &dev)?;
        let loss = ((a.as_tensor() * 3.0)?.sum_all()? + (b.as_tensor() * -4.0)?.sum_all()?)?;
        let mut grads = loss.backward()?;
        let vars = [&a, &b, &c];
        // ‖g‖ = √(3·9 + 4·16) = √91; c has no gradient.
        let want = 91f64.sqrt();
        assert!((grad_norm(&grads, &vars)? - want).abs() < 1e-12);
        let norm = clip_grad_norm(&mut grads, &vars, 1.0)?;
        assert!((norm - want).abs() < 1e-12);
        let k = coefficient(want, 1.0);
        let ga: Vec<f32> = grads.get(a.as_tensor()).map(|g| g.to_vec1()).transpose()?.unwrap_or_default();
        assert_eq!(ga, vec![3.0 * k; 3]);
        assert!((grad_norm(&grads, &vars)? - 1.0).abs() < 1e-6);
        // Within bounds nothing changes, to the bit.
        let before: Vec<f32> = grads.get(a.as_tensor()).map(|g| g.to_vec1()).transpose()?.unwrap_or_default();
        clip_grad_norm(&mut grads, &vars, 5.0)?;
        let after: Vec<f32> = grads.get(a.as_tensor()).map(|g| g.to_vec1()).transpose()?.unwrap_or_default();
        assert_eq!(before, after);
        Ok(())
    }

    #[test]
    fn a_non_finite_norm_or_a_bad_bound_is_an_error_and_changes_nothing() -> std::result::Result<(), TrainError> {
        let a = Var::new(&[1f32, 2.0], &Device::Cpu)?;
        let loss = (a.as_tensor() * f64::INFINITY)?.sum_all()?;
        let mut grads = loss.backward()?;
        let err = clip_grad_norm(&mut grads, &[&a], 1.0).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(err.contains("total norm is inf") && err.contains("not applied"), "{err}");
        let g: Vec<f32> = grads.get(a.as_tensor()).map(|g| g.to_vec1()).transpose()?.unwrap_or_default();
        assert_eq!(g, vec![f32::INFINITY; 2]);
        for bad in [0.0, -1.0, f64::NAN, f64::INFINITY] {
            let err = clip_grad_norm(&mut grads, &[&a], bad).err().map(|e| e.to_string()).unwrap_or_default();
            assert!(err.contains("positive finite"), "{bad}: {err}");
        }
        Ok(())
    }
}
