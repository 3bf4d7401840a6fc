//! The AMP step on a CUDA device with the fused kernels (feature `cuda`): the loss scale, the
//! growth tracker and the inf flag live on the device, so a step needs no host round trip — the
//! loss is multiplied by the device scale, the gradients are unscaled and checked in one
//! multi-tensor launch per dtype, the optimizer's update (AdamW, or SGD with momentum) runs on
//! every parameter in one multi-tensor launch per dtype that does nothing when the flag is set,
//! and the scale is updated on the device. This is PyTorch's `GradScaler` + fused optimizer
//! arrangement; the host-side [`super::GradScaler`] and [`super::MasterWeights::step`] compute the
//! same thing (the update's arithmetic is the same kernels', the host's to the bit).

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor, Var};

use super::cuda::{AmpKernels, StepItem};
use super::GradScalerConfig;
use crate::error::TrainError;
use crate::optim::Optimizer;

/// One parameter: the model's compute copy, its f32 master (the parameter itself when it is f32)
/// and its f32 optimizer state (AdamW's two moments, or SGD's momentum buffer).
struct Slot {
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

/// f32 masters, f32 optimizer state and a device-resident loss scale, stepped by the fused kernels.
pub struct DeviceAmp {
    kernels: std::sync::Arc<AmpKernels>,
    slots: Vec<Slot>,
    optimizer: Optimizer,
    step: i32,
    scaler: Option<(GradScalerConfig, Tensor, Tensor)>,
    /// The previous step's inf flag, read at the next step: a skipped step must not advance
    /// AdamW's step count (its bias corrections), as in PyTorch's fused AdamW.
    last_flag: Option<Tensor>,
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
        let slots = vars
            .iter()
            .zip(super::master::initial_masters(vars, masters)?)
            .map(|(v, master)| -> Result<Slot, TrainError> {
                let state = (0..optimizer.states()).map(|_| master.zeros_like()).collect::<Result<Vec<_>, _>>()?;
                Ok(Slot { model: v.clone(), master, state })
            })
            .collect::<Result<Vec<_>, _>>()?;
        let scaler = match scaler {
            Some(config) => {
                Some((config, Tensor::new(&[config.init_scale as f32], device)?, Tensor::new(&[0i32], device)?))
            }
            None => None,
        };
        Ok(DeviceAmp { kernels, slots, optimizer, step: 0, scaler, last_flag: None })
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

    /// One step from `grads` (of the scaled loss): [`DeviceAmp::unscale`], then
    /// [`DeviceAmp::apply`] with the gradients as they are. Returns the device flag (1.0 when the
    /// step was skipped) without reading it.
    pub fn step(&mut self, grads: &GradStore) -> Result<Tensor, TrainError> {
        let unscaled = self.unscale(grads)?;
        self.apply(unscaled, 1.0)
    }

    /// The first half of a step: the gradients of the parameters that have one, unscaled in
    /// place and checked for inf/NaN in one launch per dtype when the loss is scaled (the
    /// device flag set where one is found). Nothing is read back.
    pub fn unscale(&self, grads: &GradStore) -> Result<Unscaled, TrainError> {
        let found_inf = Tensor::zeros(1, DType::F32, self.kernels.device())?;
        let present: Vec<(usize, Tensor)> = self
            .slots
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

    /// The sum of the squares of the unscaled gradients, every gradient of a dtype in one launch
    /// and one read for all (gradient clipping's norm, squared; inf or NaN where a gradient is).
    pub fn squares(&self, unscaled: &Unscaled) -> Result<f64, TrainError> {
        let refs: Vec<&Tensor> = unscaled.present.iter().map(|(_, g)| g).collect();
        self.kernels.squares_multi(&refs)
    }

    /// The second half of a step: the optimizer's update on every parameter with a gradient in
    /// one launch per dtype, each gradient element multiplied by `factor` as it is read
    /// (clipping's coefficient; 1 leaves it as it is), skipped on the device when the flag is set;
    /// then the scale's update. Returns the device flag (1.0 when the step was skipped) without
    /// reading it.
    pub fn apply(&mut self, unscaled: Unscaled, factor: f32) -> Result<Tensor, TrainError> {
        if let Some(flag) = self.last_flag.take() {
            // One scalar read, of a step that finished while this one's backward ran.
            if flag.to_device(&Device::Cpu)?.to_vec1::<f32>()?[0] != 0.0 {
                self.step -= 1;
            }
        }
        self.step += 1;
        let Unscaled { present, found_inf } = unscaled;
        let items: Vec<StepItem<'_>> = present
            .iter()
            .map(|(i, g)| {
                let s = &self.slots[*i];
                let model = (s.model.dtype() != DType::F32).then(|| s.model.as_tensor());
                StepItem { target: &s.master, grad: g, state: &s.state, model }
            })
            .collect();
        self.kernels.optimizer_step_multi_(&items, self.optimizer, self.step, Some(&found_inf), factor)?;
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
        self.last_flag = Some(found_inf.clone());
        Ok(found_inf)
    }

    /// Bytes of the f32 masters of the low-precision parameters and of the f32 optimizer state.
    pub fn memory_bytes(&self) -> (usize, usize) {
        let bytes = |s: &Slot| s.master.elem_count() * 4;
        let master = self.slots.iter().filter(|s| s.model.dtype() != DType::F32).map(bytes).sum();
        let state = self.slots.iter().map(|s| bytes(s) * s.state.len()).sum();
        (master, state)
    }

    /// Puts the compute copies, the f32 masters and the f32 optimizer state in `engine`'s memory
    /// summary, under the names [`super::MasterWeights::account`] uses.
    pub fn account(&self, engine: &wick::Engine) {
        let (master, state) = self.memory_bytes();
        super::master::account(engine, self.slots.iter().map(|s| &s.model), master, &self.optimizer, state);
    }
}
