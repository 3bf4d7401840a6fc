//! The AMP step on a CUDA device with the fused kernels (feature `cuda`): the loss scale, the
//! growth tracker and the inf flag live on the device, so a step needs no host round trip — the
//! loss is multiplied by the device scale, the gradients are unscaled and checked in one
//! multi-tensor launch per dtype, every parameter gets one fused AdamW launch (which does nothing
//! when the flag is set), and the scale is updated on the device. This is PyTorch's
//! `GradScaler` + fused `AdamW` arrangement; the host-side [`super::GradScaler`] and
//! [`super::MasterWeights::step`] compute the same thing with candle tensor ops.

use crate::optim::AdamW;
use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor, Var};

use super::cuda::AmpKernels;
use super::GradScalerConfig;
use crate::error::TrainError;

/// One parameter: the model's compute copy, its f32 master and the f32 AdamW moments.
struct Slot {
    model: Var,
    master: Tensor,
    m: Tensor,
    v: Tensor,
}

/// f32 masters, f32 AdamW state and a device-resident loss scale, stepped by the fused kernels.
pub struct DeviceAmp {
    kernels: AmpKernels,
    slots: Vec<Slot>,
    /// The optimizer as given (for the memory summary's names).
    optimizer: crate::optim::Optimizer,
    /// AdamW's settings.
    adamw: AdamW,
    step: i32,
    scaler: Option<(GradScalerConfig, Tensor, Tensor)>,
    one: Tensor,
    /// The previous step's inf flag, read at the next step: a skipped step must not advance
    /// AdamW's step count (its bias corrections), as in PyTorch's fused AdamW.
    last_flag: Option<Tensor>,
}

impl DeviceAmp {
    /// Masters and zeroed moments for `vars` (on `device`, a CUDA device), AdamW with the given
    /// settings, and a loss scaler with `scaler`'s settings when given (f16 training). The
    /// masters start at `masters` (the f32 values the low-precision parameters were made from;
    /// see [`super::MasterWeights::with_masters`] for why) or at the parameters' values.
    pub fn new(
        device: &Device,
        vars: &[Var],
        masters: Option<&[Tensor]>,
        optimizer: crate::optim::Optimizer,
        scaler: Option<GradScalerConfig>,
    ) -> Result<Self, TrainError> {
        let crate::optim::Optimizer::AdamW(adamw) = optimizer else {
            return Err(TrainError::Invalid {
                what: "device AMP step".into(),
                message: format!("the fused device step implements AdamW, not {optimizer:?}"),
            });
        };
        let kernels = AmpKernels::load(device)?;
        // Own copies: the kernels write them in place.
        let slots = vars
            .iter()
            .zip(super::master::initial_masters(vars, masters)?)
            .map(|(v, master)| -> Result<Slot, TrainError> {
                Ok(Slot { model: v.clone(), m: master.zeros_like()?, v: master.zeros_like()?, master })
            })
            .collect::<Result<Vec<_>, _>>()?;
        let scaler = match scaler {
            Some(config) => {
                Some((config, Tensor::new(&[config.init_scale as f32], device)?, Tensor::new(&[0i32], device)?))
            }
            None => None,
        };
        Ok(DeviceAmp {
            kernels,
            slots,
            optimizer,
            adamw,
            step: 0,
            scaler,
            one: Tensor::new(&[1f32], device)?,
            last_flag: None,
        })
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

    /// One step from `grads` (of the scaled loss): unscale and check, fused AdamW on every
    /// parameter with a gradient (skipped on the device when a gradient is not finite), scale
    /// update. Returns the device flag (1.0 when the step was skipped) without reading it.
    pub fn step(&mut self, grads: &GradStore) -> Result<Tensor, TrainError> {
        if let Some(flag) = self.last_flag.take() {
            // One scalar read, of a step that finished while this one's backward ran.
            if flag.to_device(&Device::Cpu)?.to_vec1::<f32>()?[0] != 0.0 {
                self.step -= 1;
            }
        }
        self.step += 1;
        let found_inf = Tensor::zeros(1, DType::F32, self.one.device())?;
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
        for (i, g) in &present {
            let s = &self.slots[*i];
            self.kernels.adamw_(
                &s.master,
                &s.m,
                &s.v,
                g,
                s.model.as_tensor(),
                &self.adamw,
                self.step,
                &self.one,
                &found_inf,
            )?;
        }
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

    /// Bytes of the f32 masters and of the f32 moments.
    pub fn memory_bytes(&self) -> (usize, usize) {
        let master = self.slots.iter().map(|s| s.master.elem_count() * 4).sum();
        (master, 2 * master)
    }

    /// Puts the compute copies, the f32 masters and the f32 AdamW moments in `engine`'s memory
    /// summary, under the names [`super::MasterWeights::account`] uses.
    pub fn account(&self, engine: &wick::Engine) {
        let (master, state) = self.memory_bytes();
        super::master::account(engine, self.slots.iter().map(|s| &s.model), master, &self.optimizer, state);
    }
}
