//! The optimizer step of a training loop of one's own, placed where it runs best: on a CUDA
//! device with wick-kernels' fused kernels compiled in, the fused device step
//! (`amp::device_step`, feature `cuda`: loss scale and inf flag on the device, no host round trip);
//! elsewhere f32 [`MasterWeights`] and the host-side [`GradScaler`]. Callers hold one [`Updater`]
//! and never ask which it is (the choice, and why the fused step was not taken, is in
//! [`Updater::describe`]). With [`Updater::clip_grad_norm`] both clip the gradients by their
//! global norm as the trainer does ([`crate::clip`]: the norm of the unscaled gradients, its
//! coefficient folded into the update; on the device both computed there, and one read of what
//! the step did after it).
//!
//! Above `amp` and `clip`, which it puts together (clipping's step uses `amp`'s masters).

use candle_core::{Tensor, Var};

use crate::amp::{scaled_backward, GradScaler, MasterWeights, StepOutcome};
use crate::error::TrainError;
use crate::optim::Optimizer;
use wick_nn::Autocast;

enum Path {
    Host {
        masters: MasterWeights,
        scaler: Option<GradScaler>,
        why: Option<String>,
    },
    #[cfg(feature = "cuda")]
    Device(Box<crate::amp::device_step::DeviceAmp>),
}

/// Backward and the optimizer step of a (mixed-precision) training run: f32 masters and
/// optimizer state for the parameters, loss scaling when `autocast` needs it (f16).
pub struct Updater {
    path: Path,
    /// The clipping bound ([`Updater::clip_grad_norm`]).
    clip: Option<f64>,
    /// The last step's total norm before clipping.
    last_norm: Option<f64>,
}

impl Updater {
    /// An updater for `vars` (the model's compute copies), whose f32 masters start at `masters`
    /// (the f32 values the parameters were made from; see [`MasterWeights::with_masters`]), with
    /// its memory accounted in `engine`'s report. On a CUDA engine the fused device step is
    /// tried first (AdamW or SGD with momentum, one launch per gradient dtype); when it cannot be
    /// had (kernels not compiled in, a driver that rejects them) the host path runs and
    /// [`Updater::describe`] says why.
    pub fn new(
        engine: &wick::Engine,
        vars: &[Var],
        masters: &[Tensor],
        optimizer: Optimizer,
        autocast: Autocast,
    ) -> Result<Self, TrainError> {
        let mut why = None;
        #[cfg(feature = "cuda")]
        if engine.device().is_cuda() {
            let scaler = autocast.needs_loss_scaling().then(crate::amp::GradScalerConfig::default);
            match crate::amp::device_step::DeviceAmp::new(engine.device(), vars, Some(masters), optimizer, scaler) {
                Ok(amp) => {
                    amp.account(engine);
                    return Ok(Updater { path: Path::Device(Box::new(amp)), clip: None, last_norm: None });
                }
                Err(e) => why = Some(e.to_string()),
            }
        }
        let masters = MasterWeights::with_masters(vars, Some(masters), optimizer)?;
        masters.account(engine);
        let scaler = autocast.needs_loss_scaling().then(GradScaler::new);
        Ok(Updater { path: Path::Host { masters, scaler, why: why.take() }, clip: None, last_norm: None })
    }

    /// Clips every later step's gradients to a total 2-norm of at most `max_norm` (PyTorch's
    /// `clip_grad_norm_` between `unscale_` and `step`), or stops clipping with `None`. A bound
    /// that is not a positive finite number is an error and changes nothing.
    pub fn clip_grad_norm(&mut self, max_norm: Option<f64>) -> Result<(), TrainError> {
        if let Some(max_norm) = max_norm {
            crate::clip::check_max_norm(max_norm)?;
        }
        self.clip = max_norm;
        Ok(())
    }

    /// With clipping, the last step's total gradient norm before clipping (what PyTorch's
    /// `clip_grad_norm_` returns); none without clipping or for a skipped step.
    pub fn last_grad_norm(&self) -> Option<f64> {
        self.last_norm
    }

    /// Back-propagates `loss` (scaled when there is a loss scaler), calls `after_backward` (the
    /// graph is gone by then: the moment to read a step's peak), and updates the parameters,
    /// clipping the gradients first where [`Updater::clip_grad_norm`] asks. A step whose
    /// gradients are not finite is skipped (and the scale lowered), as PyTorch's `GradScaler`
    /// does; without a scaler, a non-finite norm under clipping is an error and nothing is
    /// applied ([`crate::clip`]).
    pub fn step(
        &mut self,
        loss: &Tensor,
        vars: &[Var],
        after_backward: impl FnOnce(),
    ) -> Result<StepOutcome, TrainError> {
        self.last_norm = None;
        let clip = self.clip;
        match &mut self.path {
            Path::Host { masters, scaler, .. } => {
                let mut grads = scaled_backward(loss, scaler.as_ref())?;
                after_backward();
                let refs: Vec<&Var> = vars.iter().collect();
                let (outcome, norm) =
                    crate::clip::clipped_master_step(&mut grads, masters, scaler.as_mut(), &refs, clip)?;
                self.last_norm = norm;
                Ok(outcome)
            }
            #[cfg(feature = "cuda")]
            Path::Device(amp) => {
                let grads = amp.scale_loss(loss)?.backward()?;
                after_backward();
                let unscaled = amp.unscale(&grads)?;
                drop(grads);
                // Clipping's norm and coefficient are computed on the device with the rest of the
                // step; the one read is after it. Under a scaler a step with an inf or NaN
                // gradient is skipped on the device whatever the norm (which is not reported);
                // without one a norm that is not finite skips it too, and is the error here.
                amp.apply(unscaled, clip)?;
                let report = amp.last_step()?;
                if report.bad_norm {
                    return Err(crate::clip::non_finite(report.norm.unwrap_or(f64::NAN)));
                }
                if report.skipped {
                    return Ok(StepOutcome::Skipped);
                }
                self.last_norm = report.norm;
                Ok(StepOutcome::Applied)
            }
        }
    }

    /// Sets the learning rate of the next steps (a schedule's step).
    pub fn set_learning_rate(&mut self, rate: f64) {
        match &mut self.path {
            Path::Host { masters, .. } => masters.set_learning_rate(rate),
            #[cfg(feature = "cuda")]
            Path::Device(amp) => amp.set_learning_rate(rate),
        }
    }

    /// The current loss scale, when the run scales its loss.
    pub fn scale(&self) -> Result<Option<f64>, TrainError> {
        match &self.path {
            Path::Host { scaler, .. } => Ok(scaler.as_ref().map(|s| s.scale())),
            #[cfg(feature = "cuda")]
            Path::Device(amp) => Ok(amp.scale()?.map(f64::from)),
        }
    }

    /// Bytes of the f32 masters and of the optimizer state.
    pub fn memory_bytes(&self) -> (usize, usize) {
        match &self.path {
            Path::Host { masters, .. } => masters.memory_bytes(),
            #[cfg(feature = "cuda")]
            Path::Device(amp) => amp.memory_bytes(),
        }
    }

    /// True when the fused device step runs.
    pub fn fused(&self) -> bool {
        !matches!(self.path, Path::Host { .. })
    }

    /// One line for the user: which step runs, and why the fused one does not when it was tried.
    pub fn describe(&self) -> String {
        match &self.path {
            Path::Host { why: Some(why), .. } => {
                format!("Fused AMP kernels unavailable ({why}); the update runs with host-side masters.")
            }
            Path::Host { why: None, .. } => "The update runs with f32 masters on the host path.".into(),
            #[cfg(feature = "cuda")]
            Path::Device(_) => "Fused AMP kernels loaded: the step runs on the device without host round trips.".into(),
        }
    }
}
