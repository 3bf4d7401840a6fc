//! Dynamic loss scaling with PyTorch's algorithm and defaults (`torch.amp.GradScaler`): the loss
//! is multiplied by `scale` before backward; gradients are unscaled once per step and checked for
//! inf/NaN; a step with non-finite gradients is skipped and the scale backs off, and after
//! `growth_interval` clean steps in a row the scale grows.

use candle_core::backprop::GradStore;
use candle_core::{Tensor, Var};

/// The scaler's settings; `Default` is PyTorch's.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GradScalerConfig {
    /// Starting scale (2^16).
    pub init_scale: f64,
    /// Multiplier after `growth_interval` clean steps (2.0).
    pub growth_factor: f64,
    /// Multiplier after a step with inf/NaN gradients (0.5).
    pub backoff_factor: f64,
    /// Clean steps before the scale grows (2000).
    pub growth_interval: u32,
}

impl Default for GradScalerConfig {
    fn default() -> Self {
        GradScalerConfig { init_scale: 65536.0, growth_factor: 2.0, backoff_factor: 0.5, growth_interval: 2000 }
    }
}

/// Misuse of the scaler's step protocol.
#[derive(Debug, thiserror::Error)]
pub enum ScalerError {
    /// `unscale` was called twice without `update` in between.
    #[error("unscale() has already been called since the last update(); call update() after each step")]
    AlreadyUnscaled,
    /// `update` was called without `unscale`/`step` in this step.
    #[error("update() was called before unscale() or step() in this step")]
    NothingToUpdate,
    /// A configuration value is out of range.
    #[error("invalid GradScaler setting: {0}")]
    InvalidConfig(String),
    /// candle failed.
    #[error("candle: {0}")]
    Candle(#[from] candle_core::Error),
}

/// A loss scaler's position: what [`GradScaler::load_state`] needs to continue exactly.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ScalerState {
    /// The current scale.
    pub scale: f64,
    /// Clean steps in a row since the scale last changed.
    pub growth_tracker: u32,
}

/// What `step` did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StepOutcome {
    /// The optimizer step ran.
    Applied,
    /// Some gradient was inf or NaN: the step was skipped.
    Skipped,
}

/// The loss scaler.
#[derive(Debug, Clone)]
pub struct GradScaler {
    config: GradScalerConfig,
    scale: f64,
    growth_tracker: u32,
    /// Set by `unscale` in the current step: whether a non-finite gradient was found.
    found_inf: Option<bool>,
}

impl GradScaler {
    /// A scaler with PyTorch's defaults.
    pub fn new() -> Self {
        Self::with_config(GradScalerConfig::default()).unwrap_or_else(|_| unreachable!("defaults are valid"))
    }

    /// A scaler with `config` (validated).
    pub fn with_config(config: GradScalerConfig) -> Result<Self, ScalerError> {
        let valid = config.init_scale.is_finite()
            && config.init_scale > 0.0
            && config.growth_factor.is_finite()
            && config.growth_factor > 1.0
            && config.backoff_factor > 0.0
            && config.backoff_factor < 1.0
            && config.growth_interval > 0;
        if !valid {
            return Err(ScalerError::InvalidConfig(format!("{config:?}")));
        }
        Ok(GradScaler { config, scale: config.init_scale, growth_tracker: 0, found_inf: None })
    }

    /// The current scale.
    pub fn scale(&self) -> f64 {
        self.scale
    }

    /// Clean steps since the scale last changed.
    pub fn growth_tracker(&self) -> u32 {
        self.growth_tracker
    }

    /// The scaler's position, to save with a checkpoint (call between steps).
    pub fn state(&self) -> ScalerState {
        ScalerState { scale: self.scale, growth_tracker: self.growth_tracker }
    }

    /// Continues from a saved position: the scale must be finite and positive.
    pub fn load_state(&mut self, state: ScalerState) -> Result<(), ScalerError> {
        if !(state.scale.is_finite() && state.scale > 0.0) {
            return Err(ScalerError::InvalidConfig(format!("saved scale {}", state.scale)));
        }
        self.scale = state.scale;
        self.growth_tracker = state.growth_tracker;
        self.found_inf = None;
        Ok(())
    }

    /// The loss multiplied by the scale, to call `backward` on.
    pub fn scale_loss(&self, loss: &Tensor) -> Result<Tensor, ScalerError> {
        Ok((loss * self.scale)?)
    }

    /// Divides the gradients of `vars` by the scale in place and records whether any is inf or
    /// NaN. Once per step. On a CUDA device with wick's kernels it is one launch per gradient
    /// dtype and one read of a device flag (`super::cuda::unscale_grads`).
    pub fn unscale(&mut self, grads: &mut GradStore, vars: &[&Var]) -> Result<bool, ScalerError> {
        if self.found_inf.is_some() {
            return Err(ScalerError::AlreadyUnscaled);
        }
        let inv = 1.0 / self.scale;
        #[cfg(feature = "cuda")]
        if let Some(found) = super::cuda::unscale_grads(grads, vars, inv)
            .map_err(|e| ScalerError::Candle(candle_core::Error::Msg(e.to_string())))?
        {
            self.found_inf = Some(found);
            return Ok(found);
        }
        let mut found_inf = false;
        for var in vars {
            if let Some(g) = grads.remove(var.as_tensor()) {
                let unscaled = (g.detach() * inv)?;
                // Any inf or NaN makes the sum non-finite.
                let total = unscaled.to_dtype(candle_core::DType::F32)?.sum_all()?.to_scalar::<f32>()?;
                found_inf |= !total.is_finite();
                grads.insert(var.as_tensor(), unscaled);
            }
        }
        self.found_inf = Some(found_inf);
        Ok(found_inf)
    }

    /// Replaces this step's inf/NaN finding with `found`: the decision a process group agreed
    /// on (an all-reduce MAX of every rank's finding), so that every rank skips or applies the
    /// same step. Counts as this step's unscale.
    pub fn set_found_inf(&mut self, found: bool) {
        self.found_inf = Some(found);
    }

    /// Unscales (if not done yet) and runs `optimizer_step` unless a gradient was non-finite.
    pub fn step(
        &mut self,
        grads: &mut GradStore,
        vars: &[&Var],
        optimizer_step: impl FnOnce(&GradStore) -> candle_core::Result<()>,
    ) -> Result<StepOutcome, ScalerError> {
        let found_inf = match self.found_inf {
            Some(found) => found,
            None => self.unscale(grads, vars)?,
        };
        if found_inf {
            return Ok(StepOutcome::Skipped);
        }
        optimizer_step(grads)?;
        Ok(StepOutcome::Applied)
    }

    /// Adjusts the scale after a step: back off on inf/NaN, grow after `growth_interval` clean
    /// steps (PyTorch's `_amp_update_scale_`).
    pub fn update(&mut self) -> Result<(), ScalerError> {
        let found_inf = self.found_inf.take().ok_or(ScalerError::NothingToUpdate)?;
        if found_inf {
            self.scale *= self.config.backoff_factor;
            self.growth_tracker = 0;
        } else {
            let successful = self.growth_tracker + 1;
            if successful == self.config.growth_interval {
                let grown = self.scale * self.config.growth_factor;
                // PyTorch keeps the old scale if growing would overflow.
                if grown.is_finite() {
                    self.scale = grown;
                }
                self.growth_tracker = 0;
            } else {
                self.growth_tracker = successful;
            }
        }
        Ok(())
    }
}

impl Default for GradScaler {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device};

    /// A scripted run: each step's gradient is finite or not; after each step the scale, the
    /// growth tracker and whether the step ran are checked against values worked out by hand
    /// from PyTorch's algorithm (growth interval 3 to keep the script short).
    #[test]
    fn scripted_steps_follow_pytorch_algorithm() {
        let config = GradScalerConfig { init_scale: 8.0, growth_factor: 2.0, backoff_factor: 0.5, growth_interval: 3 };
        let mut scaler = GradScaler::with_config(config).unwrap();
        let w = Var::from_tensor(&Tensor::ones(4, DType::F32, &Device::Cpu).unwrap()).unwrap();
        // (gradient finite?, expected outcome, expected scale after update, expected tracker)
        let script = [
            (true, StepOutcome::Applied, 8.0, 1),
            (true, StepOutcome::Applied, 8.0, 2),
            (true, StepOutcome::Applied, 16.0, 0), // third clean step: grow
            (false, StepOutcome::Skipped, 8.0, 0), // inf: back off, skip
            (true, StepOutcome::Applied, 8.0, 1),
            (false, StepOutcome::Skipped, 4.0, 0),
            (false, StepOutcome::Skipped, 2.0, 0), // NaN this time
            (true, StepOutcome::Applied, 2.0, 1),
            (true, StepOutcome::Applied, 2.0, 2),
            (true, StepOutcome::Applied, 4.0, 0),
        ];
        let mut applied = 0;
        for (i, (finite, outcome, scale, tracker)) in script.into_iter().enumerate() {
            let loss = if finite {
                (w.as_tensor() * 3.0).unwrap().sum_all().unwrap()
            } else if i == 6 {
                (w.as_tensor() * f64::NAN).unwrap().sum_all().unwrap()
            } else {
                (w.as_tensor() * f64::INFINITY).unwrap().sum_all().unwrap()
            };
            let mut grads = scaler.scale_loss(&loss).unwrap().backward().unwrap();
            let got = scaler
                .step(&mut grads, &[&w], |g| {
                    // The optimizer sees unscaled gradients: d(3·sum(w))/dw = 3.
                    let v: Vec<f32> = g.get(&w).unwrap().to_vec1()?;
                    assert!(v.iter().all(|x| (*x - 3.0).abs() < 1e-6), "step {i}: {v:?}");
                    applied += 1;
                    Ok(())
                })
                .unwrap();
            scaler.update().unwrap();
            assert_eq!((got, scaler.scale(), scaler.growth_tracker()), (outcome, scale, tracker), "step {i}");
        }
        assert_eq!(applied, 7, "the optimizer ran on exactly the clean steps");
    }

    #[test]
    fn protocol_misuse_is_an_error() {
        let mut scaler = GradScaler::new();
        assert_eq!(scaler.scale(), 65536.0);
        assert!(matches!(scaler.update(), Err(ScalerError::NothingToUpdate)));
        let w = Var::from_tensor(&Tensor::ones(2, DType::F32, &Device::Cpu).unwrap()).unwrap();
        let mut grads = scaler.scale_loss(&w.as_tensor().sum_all().unwrap()).unwrap().backward().unwrap();
        assert!(!scaler.unscale(&mut grads, &[&w]).unwrap());
        assert!(matches!(scaler.unscale(&mut grads, &[&w]), Err(ScalerError::AlreadyUnscaled)));
        scaler.update().unwrap();
        assert!(GradScaler::with_config(GradScalerConfig { backoff_factor: 1.5, ..Default::default() }).is_err());
        assert!(GradScaler::with_config(GradScalerConfig { growth_interval: 0, ..Default::default() }).is_err());
    }
}
