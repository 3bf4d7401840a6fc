//! The fused AMP kernels on a CUDA device (feature `cuda`): multi-tensor unscale with inf/NaN
//! check and the loss-scale update, compiled and embedded by the wick-kernels crate — and the
//! optimizer's step (SGD with momentum, AdamW, on f32 parameters or on the f32 masters of
//! low-precision ones, writing the model's copy), per parameter or multi-tensor (every parameter
//! of one gradient dtype in one launch, optionally skipped by a device flag: what
//! [`super::MasterWeights`] and the device AMP step run on a CUDA device).
//! Their CPU references are `wick_kernels::reference` and `wick_kernels::cpu::optim`; the
//! `amp-gpu-check` tool compares the two. The multi-tensor launches (and the step's scalars
//! computed on the device) are in `multi`; loading, the per-parameter step and the scale's update
//! here.
//!
//! The kernels work in place on the tensors they are given, on candle's stream of the device
//! (so they are ordered after the ops that produced their inputs). Give them tensors that own
//! their storage (gradients, masters, moments, parameters), not views into another tensor.

use candle_core::cuda_backend::cudarc::driver::{CudaFunction, CudaStream, DevicePtr, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::CudaStorageSlice;
use candle_core::{DType, Device, Storage, Tensor};

use crate::error::TrainError;
use crate::optim::Optimizer;
use wick_kernels::cpu::optim::AdamWStep;

fn err(message: impl Into<String>) -> TrainError {
    TrainError::Invalid { what: "amp cuda kernels".into(), message: message.into() }
}

use wick_kernels::fatbin;

mod multi;
pub use multi::Partials;

/// The AMP kernels loaded on one device.
pub struct AmpKernels {
    /// The device they were loaded on: they launch on its stream, for its tensors only.
    device: Device,
    stream: std::sync::Arc<CudaStream>,
    /// f32, f16, bf16.
    unscale: [CudaFunction; 3],
    update_scale: CudaFunction,
    /// The optimizer's step by the gradient's dtype (f32, f16, bf16): SGD with momentum, AdamW.
    sgd_step: [CudaFunction; 3],
    adamw_step: [CudaFunction; 3],
    /// The same, every parameter of one gradient dtype in one launch (state in place).
    sgd_multi: [CudaFunction; 3],
    adamw_multi: [CudaFunction; 3],
    /// Gradient clipping's squared norm, every gradient of one dtype in one launch.
    squares_multi: [CudaFunction; 3],
    /// A multi-tensor step's scalars from the device's own state (`wick_step_scalars`).
    step_scalars: CudaFunction,
}

/// One parameter's part in [`AmpKernels::optimizer_step_multi_`]: the f32 tensor updated (the
/// parameter, or the master of a low-precision one), its gradient, its optimizer state (updated
/// in place) and, for a low-precision parameter, its model copy.
pub struct StepItem<'a> {
    /// The f32 parameter or master.
    pub target: &'a Tensor,
    /// Its gradient (f32, or the model's dtype).
    pub grad: &'a Tensor,
    /// Its f32 state: SGD's momentum buffer, or AdamW's two moments.
    pub state: &'a [Tensor],
    /// The model's low-precision copy (None for an f32 parameter, its own master).
    pub model: Option<&'a Tensor>,
}

impl StepItem<'_> {
    /// Checks the item for `rule`: its state's count, every f32 tensor as long as the gradient,
    /// and a model copy exactly when the gradient is low-precision (of the copy's dtype).
    fn check(&self, rule: Optimizer) -> Result<(), TrainError> {
        let (n, states) = (self.grad.elem_count(), rule.states());
        if self.state.len() != states {
            return Err(err(format!("{states} state tensors expected, {} given", self.state.len())));
        }
        for t in std::iter::once(self.target).chain(self.state) {
            if t.dtype() != DType::F32 || t.elem_count() != n {
                return Err(err(format!("the target and the state must be f32 with {n} elements")));
            }
        }
        match (self.model, self.grad.dtype()) {
            (None, DType::F32) => Ok(()),
            (Some(m), d) if d != DType::F32 && m.dtype() == d && m.elem_count() == n => Ok(()),
            _ => Err(err("an f32 gradient updates its own parameter; a low-precision one its model copy")),
        }
    }
}

fn dtype_index(dtype: DType) -> Result<usize, TrainError> {
    match dtype {
        DType::F32 => Ok(0),
        DType::F16 => Ok(1),
        DType::BF16 => Ok(2),
        other => Err(err(format!("the AMP kernels take f32, f16 or bf16 tensors, not {other:?}"))),
    }
}

/// The device address of `t`'s first element (contiguous tensors only).
fn address(t: &Tensor, stream: &CudaStream) -> Result<u64, TrainError> {
    let (storage, layout) = t.storage_and_layout();
    if !layout.is_contiguous() {
        return Err(err("the AMP kernels need contiguous tensors"));
    }
    let Storage::Cuda(cuda) = &*storage else {
        return Err(err(format!("tensor is on {:?}, not a CUDA device", t.device().location())));
    };
    // The read event the pointer guard records is not needed: every launch here is on the same
    // stream as the ops that use these tensors, which orders them.
    let base = match &cuda.slice {
        CudaStorageSlice::F32(s) => s.device_ptr(stream).0,
        CudaStorageSlice::F16(s) => s.device_ptr(stream).0,
        CudaStorageSlice::BF16(s) => s.device_ptr(stream).0,
        CudaStorageSlice::I32(s) => s.device_ptr(stream).0,
        CudaStorageSlice::F64(s) => s.device_ptr(stream).0,
        _ => return Err(err(format!("unsupported dtype {:?}", t.dtype()))),
    };
    Ok(base + (layout.start_offset() * t.dtype().size_in_bytes()) as u64)
}

fn check_scalar(t: &Tensor, dtype: DType, what: &str) -> Result<(), TrainError> {
    if t.dtype() != dtype || t.elem_count() != 1 {
        return Err(err(format!("{what} must be a one-element {dtype:?} tensor, got {:?} {:?}", t.dtype(), t.shape())));
    }
    Ok(())
}

fn blocks(n: usize) -> u32 {
    n.div_ceil(256).clamp(1, 1024) as u32
}

/// The kernels on `device`, loaded once per device for the process (the outcome kept: a device
/// whose kernels cannot be loaded — a build without them, a driver that rejects them — gives the
/// same error every time without loading again).
pub fn shared(device: &Device) -> Result<std::sync::Arc<AmpKernels>, TrainError> {
    type Loaded = Vec<(Device, Result<std::sync::Arc<AmpKernels>, String>)>;
    static LOADED: std::sync::Mutex<Loaded> = std::sync::Mutex::new(Vec::new());
    if !device.is_cuda() {
        return Err(err(format!("the AMP kernels need a CUDA device, not {:?}", device.location())));
    }
    let mut loaded = LOADED.lock().unwrap_or_else(|p| p.into_inner());
    let outcome = match loaded.iter().find(|(d, _)| d.same_device(device)) {
        Some((_, outcome)) => outcome.clone(),
        None => {
            // The reason kept as its message (a TrainError is not Clone), given back as the same error.
            let outcome = AmpKernels::load(device).map(std::sync::Arc::new).map_err(|e| match e {
                TrainError::Invalid { message, .. } => message,
                other => other.to_string(),
            });
            loaded.push((device.clone(), outcome.clone()));
            outcome
        }
    };
    outcome.map_err(err)
}

/// [`super::GradScaler::unscale`] on a CUDA device: the gradients of `vars` multiplied by `inv`
/// in place by the multi-tensor kernel (one launch per dtype) and checked for inf/NaN on the
/// device, with one read of the flag — where the composed form read one sum back per parameter.
/// `None` (nothing done) unless every gradient is an f32, f16 or bf16 tensor on one CUDA device
/// whose kernels load. A gradient that is a view, or whose storage another gradient shares, is
/// copied first (the kernel works in place).
pub(crate) fn unscale_grads(
    grads: &mut candle_core::backprop::GradStore,
    vars: &[&candle_core::Var],
    inv: f64,
) -> Result<Option<bool>, TrainError> {
    let present: Vec<(&candle_core::Var, Tensor)> =
        vars.iter().filter_map(|v| grads.get(v.as_tensor()).map(|g| (*v, g.detach()))).collect();
    let Some((_, first)) = present.first() else { return Ok(None) };
    let device = first.device().clone();
    let fits =
        |g: &Tensor| g.device().same_device(&device) && matches!(g.dtype(), DType::F32 | DType::F16 | DType::BF16);
    if !present.iter().all(|(_, g)| fits(g)) {
        return Ok(None);
    }
    let Ok(kernels) = shared(&device) else { return Ok(None) };
    // Each storage once: a gradient sharing another's storage, or a view, gets its own copy of
    // exactly its elements (`copy` of a view would clone the whole buffer behind it).
    let mut seen = std::collections::HashSet::new();
    let mut owned = Vec::with_capacity(present.len());
    for (var, g) in present {
        let storage = {
            let (storage, _) = g.storage_and_layout();
            &*storage as *const Storage as usize
        };
        let whole = g.is_contiguous() && g.layout().start_offset() == 0;
        let g = if whole && seen.insert(storage) { g } else { g.force_contiguous().map_err(|e| err(e.to_string()))? };
        owned.push((var, g));
    }
    let refs: Vec<&Tensor> = owned.iter().map(|(_, g)| g).collect();
    let found = kernels.unscale_checked(&refs, inv as f32)?;
    for (var, g) in owned {
        grads.insert(var.as_tensor(), g);
    }
    Ok(Some(found))
}

impl AmpKernels {
    /// Loads the kernels on `device` (a CUDA device). Errors when the crate was built without
    /// `WICK_KERNELS_NVCC` or the driver rejects the module.
    pub fn load(device: &Device) -> Result<Self, TrainError> {
        let Device::Cuda(cuda) = device else {
            return Err(err(format!("the AMP kernels need a CUDA device, not {:?}", device.location())));
        };
        let stream = cuda.cuda_stream();
        let module = |name: &str| {
            let bytes = fatbin(name).ok_or_else(|| {
                err("wick-train was built without its CUDA kernels: build with WICK_KERNELS_NVCC=<path to nvcc>")
            })?;
            stream
                .context()
                .load_module(candle_core::cuda_backend::cudarc::nvrtc::Ptx::from_binary(bytes.to_vec()))
                .map_err(|e| err(format!("loading {name}: {e}")))
        };
        let (unscale, update) = (module("amp_unscale")?, module("amp_update_scale")?);
        let optim = module("optim_step")?;
        let f = |m: &std::sync::Arc<candle_core::cuda_backend::cudarc::driver::CudaModule>, name: &str| {
            m.load_function(name).map_err(|e| err(format!("{name}: {e}")))
        };
        Ok(AmpKernels {
            unscale: [
                f(&unscale, "wick_amp_unscale_f32")?,
                f(&unscale, "wick_amp_unscale_f16")?,
                f(&unscale, "wick_amp_unscale_bf16")?,
            ],
            update_scale: f(&update, "wick_amp_update_scale")?,
            sgd_step: [
                f(&optim, "wick_sgd_momentum_f32")?,
                f(&optim, "wick_sgd_momentum_f16")?,
                f(&optim, "wick_sgd_momentum_bf16")?,
            ],
            adamw_step: [
                f(&optim, "wick_adamw_step_f32")?,
                f(&optim, "wick_adamw_step_f16")?,
                f(&optim, "wick_adamw_step_bf16")?,
            ],
            sgd_multi: [
                f(&optim, "wick_sgd_momentum_multi_f32")?,
                f(&optim, "wick_sgd_momentum_multi_f16")?,
                f(&optim, "wick_sgd_momentum_multi_bf16")?,
            ],
            adamw_multi: [
                f(&optim, "wick_adamw_multi_f32")?,
                f(&optim, "wick_adamw_multi_f16")?,
                f(&optim, "wick_adamw_multi_bf16")?,
            ],
            squares_multi: [
                f(&optim, "wick_squares_multi_f32")?,
                f(&optim, "wick_squares_multi_f16")?,
                f(&optim, "wick_squares_multi_bf16")?,
            ],
            step_scalars: f(&optim, "wick_step_scalars")?,
            stream,
            device: device.clone(),
        })
    }

    /// The device the kernels were loaded on (they take its tensors only).
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The stream they launch on (candle's stream of that device).
    pub fn stream(&self) -> &std::sync::Arc<CudaStream> {
        &self.stream
    }

    /// The scale update on the device: `scale` (one-element f32), `growth_tracker`
    /// (one-element i32) and `found_inf` (one-element f32) as PyTorch's `_amp_update_scale_`.
    pub fn update_scale_(
        &self,
        scale: &Tensor,
        growth_tracker: &Tensor,
        found_inf: &Tensor,
        growth_factor: f32,
        backoff_factor: f32,
        growth_interval: i32,
    ) -> Result<(), TrainError> {
        check_scalar(scale, DType::F32, "scale")?;
        check_scalar(growth_tracker, DType::I32, "growth_tracker")?;
        check_scalar(found_inf, DType::F32, "found_inf")?;
        let (s, g, f) =
            (address(scale, &self.stream)?, address(growth_tracker, &self.stream)?, address(found_inf, &self.stream)?);
        let mut launch = self.stream.launch_builder(&self.update_scale);
        launch.arg(&s).arg(&g).arg(&f).arg(&growth_factor).arg(&backoff_factor).arg(&growth_interval);
        // SAFETY: three one-element device buffers of the kernel's types, kept alive by the caller.
        unsafe { launch.launch(LaunchConfig::for_num_elems(1)) }.map_err(|e| err(e.to_string()))?;
        Ok(())
    }

    /// Step `step` (from 1) of `rule` on `target` (f32, updated in place) from `grad`, reading
    /// the old `state` and writing `new_state` (f32, `rule.states()` each, `grad`'s length; the
    /// same tensors update the state in place, as [`super::MasterWeights`] does), and writing
    /// the new values rounded into `model` when given (a low-precision model's compute copy,
    /// `grad`'s dtype); an f32 `grad` takes no `model` (the parameter is its own master). The
    /// arithmetic of `wick_kernels::cpu::optim`, to the bit.
    pub fn optimizer_step_(
        &self,
        target: &Tensor,
        grad: &Tensor,
        (state, new_state): (&[Tensor], &[Tensor]),
        model: Option<&Tensor>,
        rule: Optimizer,
        step: i32,
    ) -> Result<(), TrainError> {
        let n = grad.elem_count();
        // The new state is checked as the old one is (the same count, f32, the same length).
        for state in [state, new_state] {
            StepItem { target, grad, state, model }.check(rule)?;
        }
        let p = |t: &Tensor| address(t, &self.stream);
        let (pt, pg) = (p(target)?, p(grad)?);
        let pmodel = model.map(p).transpose()?.unwrap_or(0);
        let len = n as i64;
        let index = dtype_index(grad.dtype())?;
        let config = LaunchConfig { grid_dim: (blocks(n), 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        match rule {
            Optimizer::SgdMomentum { lr, momentum } => {
                let (pb, pb_new) = (p(&state[0])?, p(&new_state[0])?);
                let (lr, momentum) = (lr as f32, momentum as f32);
                let mut launch = self.stream.launch_builder(&self.sgd_step[index]);
                launch.arg(&pt).arg(&pb).arg(&pb_new).arg(&pg).arg(&pmodel).arg(&len).arg(&lr).arg(&momentum);
                // SAFETY: argument types and order match `wick_sgd_momentum_*`; every buffer holds
                // `n` elements of the stated type (the model pointer is null for f32, where the
                // kernel takes no copy) and is kept alive by the caller's tensors.
                unsafe { launch.launch(config) }.map_err(|e| err(e.to_string()))?;
            }
            Optimizer::AdamW(hyper) => {
                let (pm, pv, pm_new, pv_new) = (p(&state[0])?, p(&state[1])?, p(&new_state[0])?, p(&new_state[1])?);
                // The host loop's constants, computed in f64 and rounded to f32 alike.
                let AdamWStep { b1, b2, c1, c2, eps, decay, step_size, inv_bc2_sqrt } = hyper.step_constants(step);
                let mut launch = self.stream.launch_builder(&self.adamw_step[index]);
                launch.arg(&pt).arg(&pm).arg(&pv).arg(&pm_new).arg(&pv_new).arg(&pg).arg(&pmodel).arg(&len);
                launch.arg(&b1).arg(&b2).arg(&c1).arg(&c2).arg(&eps).arg(&decay).arg(&step_size).arg(&inv_bc2_sqrt);
                // SAFETY: argument types and order match `wick_adamw_step_*`; as above.
                unsafe { launch.launch(config) }.map_err(|e| err(e.to_string()))?;
            }
        }
        Ok(())
    }
}
