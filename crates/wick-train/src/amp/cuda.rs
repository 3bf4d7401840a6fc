//! The fused AMP kernels on a CUDA device (feature `cuda`): multi-tensor unscale with inf/NaN
//! check and the loss-scale update, compiled and embedded by the wick-kernels crate — and the
//! optimizer's step (SGD with momentum, AdamW, on f32 parameters or on the f32 masters of
//! low-precision ones, writing the model's copy), per parameter or multi-tensor (every parameter
//! of one gradient dtype in one launch, optionally skipped by a device flag: what
//! [`super::MasterWeights`] and the device AMP step run on a CUDA device).
//! Their CPU references are `wick_kernels::reference` and `wick_kernels::cpu::optim`; the
//! `amp-gpu-check` tool compares the two.
//!
//! The kernels work in place on the tensors they are given, on candle's stream of the device
//! (so they are ordered after the ops that produced their inputs). Give them tensors that own
//! their storage (gradients, masters, moments, parameters), not views into another tensor.

use candle_core::cuda_backend::cudarc::driver::{
    CudaFunction, CudaSlice, CudaStream, DevicePtr, DeviceRepr, LaunchConfig, PushKernelArg,
};
use candle_core::cuda_backend::CudaStorageSlice;
use candle_core::{DType, Device, Storage, Tensor};

use crate::error::TrainError;
use crate::optim::Optimizer;
use wick_kernels::cpu::optim::AdamWStep;
use wick_kernels::launch::{Table, N1, N4, N5};

fn err(message: impl Into<String>) -> TrainError {
    TrainError::Invalid { what: "amp cuda kernels".into(), message: message.into() }
}

use wick_kernels::fatbin;

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

/// A multi-tensor launch's table (`wick_kernels::launch::Table`, C's `WickTable<K>`) as a kernel
/// argument passed by value.
#[repr(transparent)]
#[derive(Clone, Copy)]
struct Arg<T>(T);

// SAFETY: `Table` is plain data in C's layout — `WickTable<K>`'s two arrays of 8-byte integers
// and an int, padded to 8 bytes on both sides (sizes asserted below and in table.cuh) — with no
// pointers the host follows; `Arg` is transparent over it.
unsafe impl<const P: usize, const N: usize> DeviceRepr for Arg<Table<P, N>> {}

/// One address a tensor (unscale, squares).
type Table1 = Arg<Table<N1, N1>>;
/// SGD's four.
type Table4 = Arg<Table<{ 4 * N4 }, N4>>;
/// AdamW's five.
type Table5 = Arg<Table<{ 5 * N5 }, N5>>;

// The tables' sizes are C's (`table.cuh` asserts the same): K + 1 eight-byte values a tensor, and
// the count padded to eight bytes — within the budget.
const _: () = {
    assert!(std::mem::size_of::<Table1>() == 8 * 2 * N1 + 8);
    assert!(std::mem::size_of::<Table4>() == 8 * 5 * N4 + 8);
    assert!(std::mem::size_of::<Table5>() == 8 * 6 * N5 + 8);
    assert!(std::mem::size_of::<Table5>() <= wick_kernels::launch::TABLE_BUDGET + 8);
};

/// [`wick_kernels::launch::tables`] as kernel arguments.
fn tables<const P: usize, const N: usize>(tensors: &[(Vec<u64>, i64)]) -> Result<Vec<Arg<Table<P, N>>>, TrainError> {
    Ok(wick_kernels::launch::tables(tensors).map_err(err)?.into_iter().map(Arg).collect())
}

/// One dtype's tensors for [`AmpKernels::unscale_`] and [`AmpKernels::squares_partials`]: their
/// tables, and the grid's x (blocks within a tensor, from the longest; y is a table's count).
struct TensorList {
    tables: Vec<Table1>,
    grid_x: u32,
}

impl TensorList {
    /// The launch shape of table `t`.
    fn config(&self, t: &Table1) -> LaunchConfig {
        LaunchConfig { grid_dim: (self.grid_x, t.0.count as u32, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 }
    }

    /// The tensors it holds.
    fn count(&self) -> usize {
        self.tables.iter().map(|t| t.0.count as usize).sum()
    }
}

/// Clipping's partial sums of squares on the device ([`AmpKernels::squares_partials`]): one f64
/// per (block, tensor) of each gradient dtype's launch, the f32 section first, then f16's, then
/// bf16's, each ending at `ends[k]` (cumulative).
pub struct Partials {
    /// The sums.
    pub sums: CudaSlice<f64>,
    /// Where each dtype's section ends.
    pub ends: [i64; 3],
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
    // Each storage once: a gradient sharing another's storage, or a view, gets its own copy.
    let mut seen = std::collections::HashSet::new();
    let mut owned = Vec::with_capacity(present.len());
    for (var, g) in present {
        let storage = {
            let (storage, _) = g.storage_and_layout();
            &*storage as *const Storage as usize
        };
        let whole = g.is_contiguous() && g.layout().start_offset() == 0;
        let g = if whole && seen.insert(storage) { g } else { g.copy().map_err(|e| err(e.to_string()))? };
        owned.push((var, g));
    }
    let refs: Vec<&Tensor> = owned.iter().map(|(_, g)| g).collect();
    let inv_scale = Tensor::new(&[inv as f32], &device).map_err(|e| err(e.to_string()))?;
    let found = Tensor::zeros(1, DType::F32, &device).map_err(|e| err(e.to_string()))?;
    kernels.unscale_(&refs, &inv_scale, &found)?;
    let flag = found.to_vec1::<f32>().map_err(|e| err(e.to_string()))?;
    for (var, g) in owned {
        grads.insert(var.as_tensor(), g);
    }
    Ok(Some(flag.first().is_some_and(|f| *f != 0.0)))
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

    /// `Σ g²` over every element of `grads` (f32, f16 or bf16, on this device), in f64: the
    /// partial sums of [`AmpKernels::squares_partials`] read back in one transfer and added up in
    /// order on the host (each dtype's section from zero, then the sections) — gradient
    /// clipping's squared norm without a per-parameter kernel, allocation or read, and the same
    /// bits every run (and the same order as the device's `wick_step_scalars`).
    pub fn squares_multi(&self, grads: &[&Tensor]) -> Result<f64, TrainError> {
        let Some(Partials { sums, ends }) = self.squares_partials(grads)? else { return Ok(0.0) };
        let sums = self.stream.clone_dtoh(&sums).map_err(|e| err(e.to_string()))?;
        let mut total = 0.0;
        let mut at = 0;
        for end in ends {
            let end = end as usize;
            total += sums[at..end].iter().sum::<f64>();
            at = end;
        }
        Ok(total)
    }

    /// Clipping's partial sums of squares of `grads`, left on the device: one launch per dtype
    /// writing each (block, tensor)'s f64 sum into one buffer, the f32 gradients' section first,
    /// then f16's, then bf16's, and where each section ends (cumulative) — what
    /// [`AmpKernels::step_scalars_`] adds up on the device. `None` for no gradients. Nothing is
    /// read back.
    pub fn squares_partials(&self, grads: &[&Tensor]) -> Result<Option<Partials>, TrainError> {
        let lists = self.tensor_lists(grads)?;
        let mut ends = [0i64; 3];
        let mut total = 0usize;
        for (end, list) in ends.iter_mut().zip(&lists) {
            if let Some(l) = list {
                total = (l.grid_x as usize)
                    .checked_mul(l.count())
                    .and_then(|n| n.checked_add(total))
                    .ok_or_else(|| err("too many gradients"))?;
            }
            *end = i64::try_from(total).map_err(|_| err("too many gradients"))?;
        }
        if total == 0 {
            return Ok(None);
        }
        let partials = self.stream.alloc_zeros::<f64>(total).map_err(|e| err(e.to_string()))?;
        let base = partials.device_ptr(&self.stream).0;
        let mut start = 0u64;
        for ((func, list), end) in self.squares_multi.iter().zip(lists).zip(ends) {
            if let Some(l) = list {
                // Each table's sums follow the previous table's: the order of one launch over all.
                let mut at = base + start * 8;
                for table in &l.tables {
                    let mut launch = self.stream.launch_builder(func);
                    launch.arg(table).arg(&at);
                    // SAFETY: `wick_squares_multi_*`'s arguments in order (a `WickTable<1>` by
                    // value, the partials' address); every address in the table a live device
                    // buffer of the stated length and dtype, kept alive by the caller's tensors;
                    // `at` is this table's part of this dtype's section of the partials buffer
                    // (alive until it is returned), grid_x doubles a tensor.
                    unsafe { launch.launch(l.config(table)) }.map_err(|e| err(e.to_string()))?;
                    at += table.0.count as u64 * l.grid_x as u64 * 8;
                }
            }
            start = end as u64;
        }
        Ok(Some(Partials { sums: partials, ends }))
    }

    /// One multi-tensor step's scalars computed on the device (`wick_step_scalars`) into `block`
    /// ([`wick_kernels::step_scalars::SLOTS`] f32) from `hyper` (the f64 hyper-parameters in
    /// `wick_kernels::step_scalars::Hyper`'s order), `counter` (the applied steps, advanced
    /// unless the step is skipped), the loss scaler's `found_inf` (one-element f32) and, for
    /// clipping, the partial sums of [`AmpKernels::squares_partials`] (the norm written to
    /// `norm`). One thread, nothing read back: a step that needs no host value while it runs.
    pub fn step_scalars_(
        &self,
        hyper: &CudaSlice<f64>,
        counter: &mut CudaSlice<i32>,
        found_inf: Option<&Tensor>,
        clip: Option<&Partials>,
        block: &mut CudaSlice<f32>,
        norm: &mut CudaSlice<f64>,
    ) -> Result<(), TrainError> {
        use wick_kernels::step_scalars::{HYPERS, SLOTS};
        if hyper.len() != HYPERS || counter.len() != 1 || block.len() != SLOTS || norm.len() != 1 {
            return Err(err(format!("step scalars: {HYPERS} hyper-parameters, one counter, {SLOTS} slots, one norm")));
        }
        let inf = match found_inf {
            Some(flag) => {
                check_scalar(flag, DType::F32, "found_inf")?;
                address(flag, &self.stream)?
            }
            None => 0,
        };
        let (partials, [e0, e1, e2]) = match clip {
            Some(p) => (p.sums.device_ptr(&self.stream).0, p.ends),
            None => (0, [0; 3]),
        };
        let mut launch = self.stream.launch_builder(&self.step_scalars);
        launch.arg(hyper).arg(counter).arg(&inf).arg(&partials).arg(&e0).arg(&e1).arg(&e2).arg(block).arg(norm);
        // SAFETY: `wick_step_scalars`'s arguments in order: the hyper-parameters (HYPERS f64), the
        // counter (one i32), the flag's address or 0, the partials' address (e2 doubles, alive in
        // the caller's buffer) or 0 with the three section ends, the block (SLOTS f32) and the
        // norm (one f64) — lengths checked above.
        unsafe { launch.launch(LaunchConfig::for_num_elems(1)) }.map_err(|e| err(e.to_string()))?;
        Ok(())
    }

    /// The tensors of `grads` by dtype (f32, f16, bf16) as a multi-tensor launch takes them — in
    /// tables of their addresses and lengths, with the grid's x — or `None` for a dtype none of
    /// them has.
    fn tensor_lists(&self, grads: &[&Tensor]) -> Result<[Option<TensorList>; 3], TrainError> {
        let mut lists: [Option<TensorList>; 3] = Default::default();
        for (index, list) in lists.iter_mut().enumerate() {
            let mut tensors = Vec::new();
            for g in grads {
                if dtype_index(g.dtype())? == index {
                    tensors.push((vec![address(g, &self.stream)?], g.elem_count() as i64));
                }
            }
            if tensors.is_empty() {
                continue;
            }
            let longest = tensors.iter().map(|(_, n)| *n).max().unwrap_or(1) as usize;
            *list = Some(TensorList { tables: tables(&tensors)?, grid_x: blocks(longest).min(64) });
        }
        Ok(lists)
    }

    /// The device the kernels were loaded on (they take its tensors only).
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The stream they launch on (candle's stream of that device).
    pub fn stream(&self) -> &std::sync::Arc<CudaStream> {
        &self.stream
    }

    /// Multiplies every gradient by `inv_scale` (a one-element f32 tensor on the device) in
    /// place and sets `found_inf` (one-element f32, not cleared here) to 1 if any result is inf
    /// or NaN: one launch per dtype, covering all tensors of that dtype.
    pub fn unscale_(&self, grads: &[&Tensor], inv_scale: &Tensor, found_inf: &Tensor) -> Result<(), TrainError> {
        check_scalar(inv_scale, DType::F32, "inv_scale")?;
        check_scalar(found_inf, DType::F32, "found_inf")?;
        let (inv, flag) = (address(inv_scale, &self.stream)?, address(found_inf, &self.stream)?);
        for (func, list) in self.unscale.iter().zip(self.tensor_lists(grads)?) {
            let Some(l) = list else { continue };
            for table in &l.tables {
                let mut launch = self.stream.launch_builder(func);
                launch.arg(table).arg(&flag).arg(&inv);
                // SAFETY: the arguments match the kernel's signature (a `WickTable<1>` by value,
                // the flag, the scale); every address in the table is a live device buffer of
                // the stated length and dtype, kept alive by the caller's tensors.
                unsafe { launch.launch(l.config(table)) }.map_err(|e| err(e.to_string()))?;
            }
        }
        Ok(())
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

    /// The optimizer's step for many parameters at once, in place (the trainer's use): one launch
    /// per gradient dtype over every item of that dtype, the same arithmetic as
    /// [`AmpKernels::optimizer_step_`] element for element (the host's to the bit). Every item is
    /// checked before anything launches; an error leaves every tensor as it was. With `skip` (a
    /// one-element f32 device flag: the loss scaler's `found_inf`), the launches change nothing
    /// when the flag is non-zero — the step is skipped on the device, without a host read. Every
    /// gradient element is multiplied by `factor` as it is read (gradient clipping's coefficient,
    /// 1 for none, which changes no bit). The step's scalars are computed here
    /// (`wick_kernels::step_scalars::host`) and copied to the device with the tensor lists.
    pub fn optimizer_step_multi_(
        &self,
        items: &[StepItem<'_>],
        rule: Optimizer,
        step: i32,
        skip: Option<&Tensor>,
        factor: f32,
    ) -> Result<(), TrainError> {
        let block = wick_kernels::step_scalars::host(&rule.hyper(), step, factor);
        let block = self.stream.clone_htod(&block).map_err(|e| err(e.to_string()))?;
        self.optimizer_step_multi_with_(items, rule, &block, skip)
    }

    /// [`AmpKernels::optimizer_step_multi_`] with the step's scalars already on the device in
    /// `block` (written by [`AmpKernels::step_scalars_`]: its constants, clipping's factor and its
    /// skip flag, which skips the step like `skip` does).
    pub fn optimizer_step_multi_with_(
        &self,
        items: &[StepItem<'_>],
        rule: Optimizer,
        block: &CudaSlice<f32>,
        skip: Option<&Tensor>,
    ) -> Result<(), TrainError> {
        if block.len() != wick_kernels::step_scalars::SLOTS {
            return Err(err("the step's scalars must be one block of wick_kernels::step_scalars::SLOTS values"));
        }
        let skip = match skip {
            Some(flag) => {
                check_scalar(flag, DType::F32, "skip")?;
                address(flag, &self.stream)?
            }
            None => 0,
        };
        let mut groups: [Vec<(Vec<u64>, i64)>; 3] = Default::default();
        for item in items {
            item.check(rule)?;
            let p = |t: &Tensor| address(t, &self.stream);
            let mut ptrs = vec![p(item.target)?];
            for s in item.state {
                ptrs.push(p(s)?);
            }
            ptrs.push(p(item.grad)?);
            ptrs.push(item.model.map(p).transpose()?.unwrap_or(0));
            groups[dtype_index(item.grad.dtype())?].push((ptrs, item.grad.elem_count() as i64));
        }
        for (index, group) in groups.iter().enumerate() {
            if group.is_empty() {
                continue;
            }
            let longest = group.iter().map(|(_, n)| *n).max().unwrap_or(1) as usize;
            let grid_x = blocks(longest).min(64);
            match rule {
                Optimizer::SgdMomentum { .. } => {
                    let list: Vec<Table4> = tables(group)?;
                    self.launch_step(&self.sgd_multi[index], &list, grid_x, block, skip)?;
                }
                Optimizer::AdamW(_) => {
                    let list: Vec<Table5> = tables(group)?;
                    self.launch_step(&self.adamw_multi[index], &list, grid_x, block, skip)?;
                }
            }
        }
        Ok(())
    }

    /// One multi-tensor update launch a table: `func` (`wick_sgd_momentum_multi_*` with SGD's
    /// tables, `wick_adamw_multi_*` with AdamW's) with the table by value, the step's block and
    /// the skip flag's address (or 0).
    fn launch_step<const P: usize, const N: usize>(
        &self,
        func: &CudaFunction,
        list: &[Arg<Table<P, N>>],
        grid_x: u32,
        block: &CudaSlice<f32>,
        skip: u64,
    ) -> Result<(), TrainError> {
        for table in list {
            let config = LaunchConfig {
                grid_dim: (grid_x, table.0.count as u32, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            };
            let mut launch = self.stream.launch_builder(func);
            launch.arg(table).arg(block).arg(&skip);
            // SAFETY: the kernel's arguments in order: a `WickTable<P / N>` by value (the caller
            // pairs SGD's kernels with 4-address tables, AdamW's with 5) whose addresses —
            // parameter, state, gradient, model copy or 0 — are live device buffers of the
            // item's length and stated type, kept alive by the caller's tensors; the block of
            // SLOTS f32 (length checked by the caller); the skip flag's address (a live
            // one-element f32) or 0.
            unsafe { launch.launch(config) }.map_err(|e| err(e.to_string()))?;
        }
        Ok(())
    }
}
