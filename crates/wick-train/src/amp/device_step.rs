//! The AMP step on a CUDA device with the fused kernels (feature `cuda`): the loss scale, the
//! growth tracker, the inf flag, the optimizer's step count, its hyper-parameters and the step's
//! scalars live on the device, so a step needs no host round trip and reads no value from the
//! host while it runs — the loss is multiplied by the device scale, the gradients are unscaled
//! and checked in one multi-tensor launch per dtype, clipping's norm and coefficient and AdamW's
//! constants are computed on the device (`wick_step_scalars`), the optimizer's update (AdamW, or
//! SGD with momentum) runs on every parameter in one multi-tensor launch per dtype that does
//! nothing when the step is skipped, and the scale is updated on the device. This is PyTorch's
//! `GradScaler` + fused optimizer arrangement with `capturable=True`; the host-side
//! [`super::GradScaler`] and [`super::MasterWeights::step`] compute the same thing (the update's
//! arithmetic is the same kernels', the host's to the bit, and so are the step's scalars).

use candle_core::backprop::GradStore;
use candle_core::cuda_backend::cudarc::driver::CudaSlice;
use candle_core::{DType, Device, Tensor, Var};
use wick::cuda_graph::copy_into;
use wick_kernels::step_scalars::{Slot, HYPERS, SLOTS};

use super::cuda::{AmpKernels, StepItem};
use super::{GradScalerConfig, MasterState, ScalerState};
use crate::error::TrainError;
use crate::optim::Optimizer;

/// One parameter: the model's compute copy, its f32 master (the parameter itself when it is f32)
/// and its f32 optimizer state (AdamW's two moments, or SGD's momentum buffer).
struct Param {
    model: Var,
    master: Tensor,
    state: Vec<Tensor>,
}

/// The gradients of one step between [`DeviceAmp::unscale`] and [`DeviceAmp::apply`]: each
/// parameter's index and its (unscaled) gradient, and the device's inf flag.
pub struct Unscaled {
    present: Vec<(usize, Tensor)>,
    found_inf: Tensor,
}

/// A driver call's failure as the step's error.
fn driver(e: candle_core::cuda_backend::cudarc::driver::DriverError) -> TrainError {
    TrainError::from(candle_core::Error::wrap(e))
}

fn refused(message: String) -> TrainError {
    TrainError::Invalid { what: "optimizer state".into(), message }
}

/// What a step did, read back after it ([`DeviceAmp::last_step`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepReport {
    /// The update did not run: an inf or NaN gradient under the loss scaler, or a clipping norm
    /// that is not finite.
    pub skipped: bool,
    /// The latter: a clipping norm that is not finite without the loss scaler's flag (an error
    /// for the caller: nothing was applied).
    pub bad_norm: bool,
    /// With clipping, the gradients' total norm before clipping (of a skipped step too).
    pub norm: Option<f64>,
}

/// f32 masters, f32 optimizer state, a device-resident loss scale and the step's device-resident
/// scalars, stepped by the fused kernels.
pub struct DeviceAmp {
    kernels: std::sync::Arc<AmpKernels>,
    params: Vec<Param>,
    optimizer: Optimizer,
    scaler: Option<(GradScalerConfig, Tensor, Tensor)>,
    /// The hyper-parameters on the device (`wick_kernels::step_scalars::Hyper`'s order) and the
    /// values last written there: rewritten only when one changes (a schedule's learning rate).
    hyper: (CudaSlice<f64>, [f64; HYPERS]),
    /// The applied steps (AdamW's t − 1), advanced on the device unless a step is skipped.
    counter: CudaSlice<i32>,
    /// The last step's scalars (`wick_kernels::step_scalars::Slot`) and clipping's norm.
    block: CudaSlice<f32>,
    norm: CudaSlice<f64>,
    /// Whether the last step clipped (its norm is then reported).
    clipped: bool,
}

impl DeviceAmp {
    /// Masters and zeroed optimizer state for `vars` (on `device`, a CUDA device), the optimizer
    /// `optimizer`, and a loss scaler with `scaler`'s settings when given (f16 training). The
    /// masters start at `masters` (the f32 values the low-precision parameters were made from;
    /// see [`super::MasterWeights::with_masters`] for why) or at the parameters' values.
    pub fn new(
        device: &Device,
        vars: &[Var],
        masters: Option<&[Tensor]>,
        optimizer: Optimizer,
        scaler: Option<GradScalerConfig>,
    ) -> Result<Self, TrainError> {
        let kernels = super::cuda::shared(device)?;
        // The masters are own copies (the kernels write them in place); an f32 parameter is its
        // own master.
        let params = vars
            .iter()
            .zip(super::master::initial_masters(vars, masters)?)
            .map(|(v, master)| -> Result<Param, TrainError> {
                let state = (0..optimizer.states()).map(|_| master.zeros_like()).collect::<Result<Vec<_>, _>>()?;
                Ok(Param { model: v.clone(), master, state })
            })
            .collect::<Result<Vec<_>, _>>()?;
        let scaler = match scaler {
            Some(config) => {
                Some((config, Tensor::new(&[config.init_scale as f32], device)?, Tensor::new(&[0i32], device)?))
            }
            None => None,
        };
        let stream = kernels.stream().clone();
        let values = optimizer.hyper().to_array();
        let hyper = (stream.clone_htod(&values).map_err(driver)?, values);
        let counter = stream.alloc_zeros::<i32>(1).map_err(driver)?;
        let block = stream.alloc_zeros::<f32>(SLOTS).map_err(driver)?;
        let norm = stream.alloc_zeros::<f64>(1).map_err(driver)?;
        Ok(DeviceAmp { kernels, params, optimizer, scaler, hyper, counter, block, norm, clipped: false })
    }

    /// Sets the learning rate of the next steps (a schedule's step): written to the device's
    /// hyper-parameters before the next step, not read by the host during it.
    pub fn set_learning_rate(&mut self, rate: f64) {
        self.optimizer.set_lr(rate);
    }

    /// The `i`-th parameter's f32 master (the parameter itself when it is f32).
    pub fn master(&self, i: usize) -> Option<&Tensor> {
        self.params.get(i).map(|p| &p.master)
    }

    /// The parameters (the model's compute copies), in order.
    pub fn vars(&self) -> impl Iterator<Item = &Var> {
        self.params.iter().map(|p| &p.model)
    }

    /// The loss to call `backward` on: multiplied by the device scale when scaling.
    pub fn scale_loss(&self, loss: &Tensor) -> Result<Tensor, TrainError> {
        Ok(match &self.scaler {
            Some((_, scale, _)) => loss.broadcast_mul(&scale.to_dtype(loss.dtype())?.reshape(())?)?,
            None => loss.clone(),
        })
    }

    /// The current scale (a host read: for display, not needed by the step).
    pub fn scale(&self) -> Result<Option<f32>, TrainError> {
        match &self.scaler {
            Some((_, s, _)) => Ok(Some(s.to_device(&Device::Cpu)?.to_vec1::<f32>()?[0])),
            None => Ok(None),
        }
    }

    /// True when the loss is scaled (f16): a step with an inf or NaN gradient is then skipped.
    pub fn scales(&self) -> bool {
        self.scaler.is_some()
    }

    /// One step from `grads` (of the scaled loss), unclipped: [`DeviceAmp::unscale`], then
    /// [`DeviceAmp::apply`]. Nothing is read back.
    pub fn step(&mut self, grads: &GradStore) -> Result<(), TrainError> {
        let unscaled = self.unscale(grads)?;
        self.apply(unscaled, None)
    }

    /// The first half of a step: the gradients of the parameters that have one, unscaled in
    /// place and checked for inf/NaN in one launch per dtype when the loss is scaled (the
    /// device flag set where one is found). Nothing is read back.
    pub fn unscale(&self, grads: &GradStore) -> Result<Unscaled, TrainError> {
        let found_inf = Tensor::zeros(1, DType::F32, self.kernels.device())?;
        let present: Vec<(usize, Tensor)> = self
            .params
            .iter()
            .enumerate()
            .filter_map(|(i, s)| grads.get(s.model.as_tensor()).map(|g| (i, g.clone())))
            .map(|(i, g)| Ok((i, g.contiguous()?)))
            .collect::<Result<_, candle_core::Error>>()?;
        if let Some((_, scale, _)) = &self.scaler {
            let inv = scale.recip()?;
            let refs: Vec<&Tensor> = present.iter().map(|(_, g)| g).collect();
            self.kernels.unscale_(&refs, &inv, &found_inf)?;
        }
        Ok(Unscaled { present, found_inf })
    }

    /// The second half of a step: with `clip` (a positive finite bound), clipping's norm of the
    /// unscaled gradients and its coefficient on the device; the step's scalars on the device
    /// (AdamW's constants from the device's step count, which a skipped step does not advance);
    /// the optimizer's update on every parameter with a gradient in one launch per dtype, each
    /// gradient element multiplied by the coefficient as it is read, skipped on the device under
    /// the scaler's flag or a clipping norm that is not finite; then the scale's update. Nothing
    /// is read back ([`DeviceAmp::last_step`] reads what happened); the only transfer is the
    /// hyper-parameters' when one changed since the last step.
    pub fn apply(&mut self, unscaled: Unscaled, clip: Option<f64>) -> Result<(), TrainError> {
        self.write_hyper(clip)?;
        let Unscaled { present, found_inf } = unscaled;
        let refs: Vec<&Tensor> = present.iter().map(|(_, g)| g).collect();
        let partials = match clip {
            Some(_) => self.kernels.squares_partials(&refs)?,
            None => None,
        };
        let inf = self.scaler.as_ref().map(|_| &found_inf);
        self.kernels.step_scalars_(
            &self.hyper.0,
            &mut self.counter,
            inf,
            partials.as_ref(),
            &mut self.block,
            &mut self.norm,
        )?;
        self.clipped = partials.is_some();
        let items: Vec<StepItem<'_>> = present
            .iter()
            .map(|(i, g)| {
                let s = &self.params[*i];
                let model = (s.model.dtype() != DType::F32).then(|| s.model.as_tensor());
                StepItem { target: &s.master, grad: g, state: &s.state, model }
            })
            .collect();
        self.kernels.optimizer_step_multi_with_(&items, self.optimizer, &self.block, None)?;
        if let Some((config, scale, tracker)) = &self.scaler {
            self.kernels.update_scale_(
                scale,
                tracker,
                &found_inf,
                config.growth_factor as f32,
                config.backoff_factor as f32,
                config.growth_interval as i32,
            )?;
        }
        Ok(())
    }

    /// Writes the hyper-parameters of the next step (the learning rate, clipping's bound `clip`)
    /// to the device when one changed since they were last written. [`DeviceAmp::apply`] does it
    /// itself; a step replayed from a CUDA graph runs no host code, so its caller does it before
    /// each replay (`super::graph_step`).
    pub fn write_hyper(&mut self, clip: Option<f64>) -> Result<(), TrainError> {
        let mut values = self.optimizer.hyper();
        values.max_norm = clip.unwrap_or(0.0);
        let values = values.to_array();
        if values != self.hyper.1 {
            self.kernels.stream().memcpy_htod(&values, &mut self.hyper.0).map_err(driver)?;
            self.hyper.1 = values;
        }
        Ok(())
    }

    /// What the last step did: one read of its scalars (and of clipping's norm when it clipped),
    /// after the step — the host's only wait for the device in a step.
    pub fn last_step(&self) -> Result<StepReport, TrainError> {
        let stream = self.kernels.stream();
        let block = stream.clone_dtoh(&self.block).map_err(driver)?;
        let norm = match self.clipped {
            true => stream.clone_dtoh(&self.norm).map_err(driver)?.first().copied(),
            false => None,
        };
        Ok(StepReport {
            skipped: block[Slot::Skip as usize] != 0.0,
            bad_norm: block[Slot::BadNorm as usize] != 0.0,
            norm,
        })
    }

    /// The steps applied so far (AdamW's step count; a host read).
    pub fn applied_steps(&self) -> Result<i32, TrainError> {
        let counter = self.kernels.stream().clone_dtoh(&self.counter).map_err(driver)?;
        Ok(counter.first().copied().unwrap_or(0))
    }

    /// A copy of the whole state on the host, as [`super::MasterWeights::state`] gives it (the
    /// applied steps, each f32 master, each f32 optimizer state): a checkpoint's. Waits for the
    /// device.
    pub fn state(&self) -> Result<MasterState, TrainError> {
        let step = u64::try_from(self.applied_steps()?).unwrap_or(0);
        let host = |t: &Tensor| t.to_device(&Device::Cpu);
        let masters = self.params.iter().map(|p| host(&p.master)).collect::<Result<Vec<_>, _>>()?;
        let states = self
            .params
            .iter()
            .map(|p| p.state.iter().map(host).collect::<Result<Vec<_>, _>>())
            .collect::<Result<Vec<_>, _>>()?;
        Ok(MasterState { step, masters, states })
    }

    /// Continues from `state` (a checkpoint's, of the same parameters and optimizer): every
    /// master, optimizer state and the step count copied into the memory the step already uses
    /// (a captured step keeps reading it there), and each low-precision parameter set from its
    /// master. Everything is checked first: a refused state changes nothing.
    pub fn load_state(&mut self, state: &MasterState) -> Result<(), TrainError> {
        let n = self.params.len();
        if state.masters.len() != n || state.states.len() != n {
            let (m, s) = (state.masters.len(), state.states.len());
            return Err(refused(format!("{m} masters and {s} states for {n} parameters")));
        }
        for (i, ((p, m), s)) in self.params.iter().zip(&state.masters).zip(&state.states).enumerate() {
            if m.dims() != p.master.dims() || s.len() != p.state.len() || s.iter().any(|t| t.dims() != p.master.dims())
            {
                let shapes: Vec<_> = s.iter().map(|t| t.dims().to_vec()).collect();
                return Err(refused(format!(
                    "parameter {i}: a master of {:?} and states {shapes:?}, expected {} of {:?}",
                    m.dims(),
                    p.state.len(),
                    p.master.dims()
                )));
            }
        }
        let step = i32::try_from(state.step)
            .map_err(|_| refused(format!("{} optimizer steps: the device counts at most {}", state.step, i32::MAX)))?;
        for ((p, m), s) in self.params.iter().zip(&state.masters).zip(&state.states) {
            copy_into(&p.master, m)?;
            if p.model.dtype() != DType::F32 {
                p.model.set(&p.master.to_dtype(p.model.dtype())?)?;
            }
            for (dst, src) in p.state.iter().zip(s) {
                copy_into(dst, src)?;
            }
        }
        self.kernels.stream().memcpy_htod(&[step], &mut self.counter).map_err(driver)?;
        Ok(())
    }

    /// Lets `write` replace every f32 master and optimizer state in place (a data-parallel run
    /// taking rank 0's state: a broadcast into each), then sets each low-precision parameter from
    /// its master.
    #[cfg(feature = "nccl")]
    pub(crate) fn rewrite_state(
        &mut self,
        write: &mut dyn FnMut(&Tensor) -> Result<(), TrainError>,
    ) -> Result<(), TrainError> {
        for p in &self.params {
            write(&p.master)?;
            p.state.iter().try_for_each(&mut *write)?;
        }
        // The writes are ordered on the stream before these casts.
        for p in self.params.iter().filter(|p| p.model.dtype() != DType::F32) {
            p.model.set(&p.master.to_dtype(p.model.dtype())?)?;
        }
        Ok(())
    }

    /// The loss scaler's state (a host read), when the loss is scaled.
    pub fn scaler_state(&self) -> Result<Option<ScalerState>, TrainError> {
        let Some((_, scale, tracker)) = &self.scaler else { return Ok(None) };
        let scale = scale.to_device(&Device::Cpu)?.to_vec1::<f32>()?.first().copied().unwrap_or(f32::NAN);
        let tracker = tracker.to_device(&Device::Cpu)?.to_vec1::<i32>()?.first().copied().unwrap_or(0);
        Ok(Some(ScalerState { scale: f64::from(scale), growth_tracker: u32::try_from(tracker).unwrap_or(0) }))
    }

    /// Continues the loss scaler from `saved` (a positive finite scale), written where the step
    /// reads it. An error, changing nothing, without a scaler or for a bad scale.
    pub fn load_scaler_state(&mut self, saved: ScalerState) -> Result<(), TrainError> {
        let Some((_, scale, tracker)) = &self.scaler else {
            return Err(refused("this step does not scale its loss".into()));
        };
        let value = saved.scale as f32;
        if !(value.is_finite() && value > 0.0) {
            return Err(refused(format!("saved loss scale {}", saved.scale)));
        }
        let count = i32::try_from(saved.growth_tracker)
            .map_err(|_| refused(format!("saved growth tracker {}", saved.growth_tracker)))?;
        copy_into(scale, &Tensor::new(&[value], &Device::Cpu)?)?;
        copy_into(tracker, &Tensor::new(&[count], &Device::Cpu)?)?;
        Ok(())
    }

    /// Bytes of the f32 masters of the low-precision parameters and of the f32 optimizer state.
    pub fn memory_bytes(&self) -> (usize, usize) {
        let bytes = |s: &Param| s.master.elem_count() * 4;
        let master = self.params.iter().filter(|s| s.model.dtype() != DType::F32).map(bytes).sum();
        let state = self.params.iter().map(|s| bytes(s) * s.state.len()).sum();
        (master, state)
    }

    /// Puts the compute copies, the f32 masters and the f32 optimizer state in `engine`'s memory
    /// summary, under the names [`super::MasterWeights::account`] uses.
    pub fn account(&self, engine: &wick::Engine) {
        let (master, state) = self.memory_bytes();
        super::master::account(engine, self.params.iter().map(|s| &s.model), master, &self.optimizer, state);
    }
}
