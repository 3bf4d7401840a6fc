//! fp32 master weights and fp32 optimizer state for low-precision models. candle's AdamW keeps
//! its moments in the parameter dtype (bf16 parameters get bf16 moments and updates that round
//! away); here every parameter has an f32 master copy and f32 state, the update happens in f32,
//! and the model's low-precision parameter is refreshed from the master after each step.

use candle_core::backprop::GradStore;
use candle_core::{DType, Result, Tensor, Var};

use wick_nn::params::Params;

use crate::optim::{AdamW, Optimizer};

struct Entry {
    model: Var,
    master: Tensor,
    state: Vec<Tensor>,
}

/// Checks that `masters` can start the masters of `vars`: one per var, same shapes, floats.
pub(crate) fn check_masters(vars: &[Var], masters: &[Tensor]) -> Result<()> {
    if masters.len() != vars.len() {
        candle_core::bail!("{} master values for {} parameters", masters.len(), vars.len())
    }
    for (i, (source, v)) in masters.iter().zip(vars).enumerate() {
        if source.dims() != v.dims() {
            candle_core::bail!("master {i} has shape {:?}, its parameter {:?}", source.dims(), v.dims());
        }
        if !source.dtype().is_float() {
            candle_core::bail!("master {i} has dtype {:?}, not a floating-point type", source.dtype());
        }
    }
    Ok(())
}

/// f32 masters for `vars`: own copies of `masters` (checked: one per var, same shapes) or of the
/// vars' values, with each var set to its master rounded to the var's dtype.
pub(crate) fn initial_masters(vars: &[Var], masters: Option<&[Tensor]>) -> Result<Vec<Tensor>> {
    let sources: Vec<&Tensor> = match masters {
        Some(m) => m.iter().collect(),
        None => vars.iter().map(|v| v.as_tensor()).collect(),
    };
    // Everything is checked before any parameter is touched: a refused call changes nothing.
    if let Some(m) = masters {
        check_masters(vars, m)?;
    }
    // Own copies (the update writes them), on the parameter's device; an f32 parameter is its
    // own master (a copy would only double its memory).
    let mut out = Vec::with_capacity(vars.len());
    for (source, v) in sources.iter().zip(vars) {
        if v.dtype() == DType::F32 {
            // Given values become the parameter's (through a copy: they may share its storage,
            // which candle refuses to set a variable from); the parameter itself needs nothing.
            if masters.is_some() && source.id() != v.as_tensor().id() {
                v.set(&source.to_device(v.device())?.to_dtype(DType::F32)?.copy()?)?;
            }
            out.push(v.as_tensor().detach());
        } else {
            out.push(source.to_device(v.device())?.to_dtype(DType::F32)?.copy()?.detach());
        }
    }
    if masters.is_some() {
        for (master, v) in out.iter().zip(vars).filter(|(_, v)| v.dtype() != DType::F32) {
            v.set(&master.to_dtype(v.dtype())?)?;
        }
    }
    Ok(out)
}

/// The values of `originals`' parameters (the same model built in f32: the same seed gives the
/// same initial values) in the order of `params`, as masters for [`MasterWeights::with_masters`].
pub fn masters_by_name(params: &Params, originals: &Params) -> std::result::Result<Vec<Tensor>, crate::TrainError> {
    params
        .iter()
        .map(|(name, v)| {
            let original = originals.tensor(name)?;
            if original.dims() != v.dims() {
                return Err(crate::TrainError::Invalid {
                    what: "master weights".into(),
                    message: format!(
                        "`{name}`: the original has shape {:?}, the parameter {:?}",
                        original.dims(),
                        v.dims()
                    ),
                });
            }
            Ok(original)
        })
        .collect()
}

/// Bytes of the parameters `models`.
fn param_bytes<'a>(models: impl Iterator<Item = &'a Var>) -> usize {
    models.map(|v| v.elem_count() * v.dtype().size_in_bytes()).sum()
}

/// Puts the parameters `models` (their compute copies), `master` bytes of f32 masters and
/// `state` bytes of `optimizer`'s f32 state in `engine`'s memory summary; shared by
/// [`MasterWeights`] and the fused device step.
pub(crate) fn account<'a>(
    engine: &wick::Engine,
    models: impl Iterator<Item = &'a Var> + Clone,
    master: usize,
    optimizer: &Optimizer,
    state: usize,
) {
    let dtypes: std::collections::BTreeSet<String> =
        models.clone().map(|v| format!("{:?}", v.dtype()).to_lowercase()).collect();
    let dtypes: Vec<String> = dtypes.into_iter().collect();
    engine.account(&format!("parameters ({})", dtypes.join("+")), param_bytes(models));
    engine.account("master weights (f32)", master);
    let name = match optimizer {
        Optimizer::SgdMomentum { .. } => "optimizer state (f32 momentum)",
        Optimizer::AdamW(_) => "optimizer state (f32 AdamW moments)",
    };
    engine.account(name, state);
}

/// Master copies and optimizer state for a set of model parameters.
pub struct MasterWeights {
    optimizer: Optimizer,
    entries: Vec<Entry>,
    step: u64,
}

impl MasterWeights {
    /// f32 masters (and zeroed f32 state) for `vars`, starting at the parameters' current values.
    ///
    /// For a low-precision model prefer [`MasterWeights::with_masters`] with the f32 values the
    /// parameters were made from: masters that start at bf16-rounded values sit on the bf16 grid,
    /// so an update smaller than half a bf16 spacing leaves every compute copy where it was until
    /// updates add up to half a spacing — the model trains late. Masters that start at the f32
    /// values lie anywhere between grid points, and small updates move a fair share of the
    /// copies at once (measured on MobileNetV2: a higher loss after 12 AdamW steps from rounded
    /// masters, in wick and in PyTorch alike; BENCHMARKS.md, "Mixed precision (issue 6)").
    pub fn new(vars: &[Var], optimizer: Optimizer) -> Result<Self> {
        Self::with_masters(vars, None, optimizer)
    }

    /// f32 masters that start at `masters` (one per var, same shapes; any float dtype — the f32
    /// initial or loaded values of a model whose parameters are in bf16/f16), or at the
    /// parameters' current values when `None`; zeroed f32 state. Each parameter is set to its
    /// master rounded to the parameter's dtype, so the model computes with the masters' values.
    pub fn with_masters(vars: &[Var], masters: Option<&[Tensor]>, optimizer: Optimizer) -> Result<Self> {
        let states = optimizer.states();
        let entries = vars
            .iter()
            .zip(initial_masters(vars, masters)?)
            .map(|(v, master)| {
                let state = (0..states).map(|_| master.zeros_like()).collect::<Result<Vec<_>>>()?;
                Ok(Entry { model: v.clone(), master, state })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(MasterWeights { optimizer, entries, step: 0 })
    }

    /// Bytes of the master copies and of the optimizer state (for the engine's summary). An f32
    /// parameter is its own master: it adds no master bytes.
    pub fn memory_bytes(&self) -> (usize, usize) {
        let bytes = |t: &Tensor| t.elem_count() * t.dtype().size_in_bytes();
        let master = self.entries.iter().filter(|e| e.model.dtype() != DType::F32).map(|e| bytes(&e.master)).sum();
        let state = self.entries.iter().flat_map(|e| e.state.iter()).map(bytes).sum();
        (master, state)
    }

    /// Bytes of the model's own parameters (the low-precision compute copies under AMP).
    pub fn model_bytes(&self) -> usize {
        param_bytes(self.entries.iter().map(|e| &e.model))
    }

    /// Puts the compute copies, the f32 masters and the f32 optimizer state in `engine`'s
    /// memory summary (see [`wick::Engine::account`]).
    pub fn account(&self, engine: &wick::Engine) {
        let (master, state) = self.memory_bytes();
        account(engine, self.entries.iter().map(|e| &e.model), master, &self.optimizer, state);
    }

    /// The f32 master of the `i`-th parameter.
    pub fn master(&self, i: usize) -> Option<&Tensor> {
        self.entries.get(i).map(|e| &e.master)
    }

    /// The optimizer state of the `i`-th parameter (f32; empty for plain SGD).
    pub(crate) fn state_of(&self, i: usize) -> Option<&[Tensor]> {
        self.entries.get(i).map(|e| e.state.as_slice())
    }

    /// One update from `grads` (already unscaled), in f32; parameters without a gradient keep
    /// their values. The model's parameters are then refreshed from the masters. On a CUDA device
    /// with wick's kernels every parameter is updated in one launch per gradient dtype, the state
    /// in place (the host's arithmetic to the bit); elsewhere on a device, composed tensor ops.
    pub fn step(&mut self, grads: &GradStore) -> Result<()> {
        self.step_clipped(grads, 1.0)
    }

    /// [`MasterWeights::step`] with every gradient element multiplied by `coefficient` as the
    /// update reads it: gradient clipping's coefficient, folded into the update instead of a pass
    /// over the gradients of its own. 1 is the plain step, to the bit.
    pub fn step_clipped(&mut self, grads: &GradStore, coefficient: f32) -> Result<()> {
        self.step += 1;
        let t = self.step as i32;
        // The entries for the fused multi-tensor step, with their gradients.
        #[cfg(feature = "cuda")]
        let mut batch = Batch::default();
        for i in 0..self.entries.len() {
            let e = &mut self.entries[i];
            let Some(g) = grads.get(e.model.as_tensor()) else { continue };
            // Detached: candle's parameter gradients carry the graph of the ops that made them
            // (activations included), and state built from them would keep it alive across steps.
            if e.master.device().is_cpu() && g.device().is_cpu() {
                // One fused pass, in place (the f32 parameter itself when it is its own master).
                e.state = crate::optim::step(&e.master, &g.detach(), &e.state, (self.optimizer, t), coefficient)?;
                if e.model.dtype() != DType::F32 {
                    crate::optim::copy_into(e.model.as_tensor(), &e.master)?;
                }
                continue;
            }
            #[cfg(feature = "cuda")]
            if let Some(kernels) = fused(batch.kernels.as_ref(), &e.master) {
                // Each master's own tensors, in place (the snapshots of `state` and `load_state`
                // are copies): collected, then one launch per gradient dtype below.
                batch.entries.push((i, g.detach().contiguous()?));
                batch.kernels = Some(kernels);
                continue;
            }
            composed_step(e, g, (self.optimizer, t), coefficient)?;
        }
        #[cfg(feature = "cuda")]
        if let Some(kernels) = batch.kernels {
            let items: Vec<super::cuda::StepItem<'_>> = batch
                .entries
                .iter()
                .map(|(i, g)| {
                    let e = &self.entries[*i];
                    let model = (e.model.dtype() != DType::F32).then(|| e.model.as_tensor());
                    super::cuda::StepItem { target: &e.master, grad: g, state: &e.state, model }
                })
                .collect();
            kernels
                .optimizer_step_multi_(&items, self.optimizer, t, None, coefficient)
                .map_err(|e| candle_core::Error::Msg(e.to_string()))?;
        }
        Ok(())
    }
}

/// The parameters of one step that take the fused multi-tensor update on a CUDA device (all on
/// the kernels' device: [`fused`] answers for no other).
#[cfg(feature = "cuda")]
#[derive(Default)]
struct Batch {
    /// (entry index, its gradient made contiguous).
    entries: Vec<(usize, Tensor)>,
    kernels: Option<std::sync::Arc<super::cuda::AmpKernels>>,
}

/// One parameter's update as composed tensor ops (a device without wick's kernels).
fn composed_step(e: &mut Entry, g: &Tensor, (optimizer, t): (Optimizer, i32), coefficient: f32) -> Result<()> {
    let mut g = g.detach().to_dtype(DType::F32)?;
    if coefficient != 1.0 {
        g = g.affine(f64::from(coefficient), 0.0)?;
    }
    match optimizer {
        Optimizer::SgdMomentum { lr, momentum } => {
            let b = ((&e.state[0] * momentum)? + &g)?;
            e.master = (&e.master - (&b * lr)?)?;
            e.state[0] = b;
        }
        Optimizer::AdamW(AdamW { lr, beta1, beta2, eps, weight_decay }) => {
            let m = ((&e.state[0] * beta1)? + (&g * (1.0 - beta1))?)?;
            let v = ((&e.state[1] * beta2)? + (g.sqr()? * (1.0 - beta2))?)?;
            let m_hat = (&m / (1.0 - beta1.powi(t)))?;
            let v_hat = (&v / (1.0 - beta2.powi(t)))?;
            let decayed = (&e.master * (1.0 - lr * weight_decay))?;
            e.master = (decayed - ((m_hat / (v_hat.sqrt()? + eps)?)? * lr)?)?;
            e.state = vec![m, v];
        }
    }
    if e.model.dtype() == DType::F32 {
        // Its own master: write the new value into the parameter and keep sharing it.
        e.model.set(&e.master)?;
        e.master = e.model.as_tensor().detach();
    } else {
        e.model.set(&e.master.to_dtype(e.model.dtype())?)?;
    }
    Ok(())
}

/// Everything [`MasterWeights`] needs to continue exactly where it was: the step count (AdamW's
/// bias corrections) and, per parameter, the f32 master and the f32 optimizer state.
#[derive(Debug, Clone)]
pub struct MasterState {
    /// Optimizer steps taken.
    pub step: u64,
    /// Each parameter's f32 master, in the order of the vars.
    pub masters: Vec<Tensor>,
    /// Each parameter's optimizer state: SGD's momentum buffer, or AdamW's two moments (f32).
    pub states: Vec<Vec<Tensor>>,
}

impl MasterWeights {
    /// The optimizer steps taken so far.
    pub fn steps(&self) -> u64 {
        self.step
    }

    /// The optimizer rule and settings.
    pub fn optimizer(&self) -> Optimizer {
        self.optimizer
    }

    /// Sets the learning rate of the next steps (a schedule's step; the rest of the settings
    /// stay).
    pub fn set_learning_rate(&mut self, rate: f64) {
        self.optimizer.set_lr(rate);
    }

    /// A copy of the whole state (own storage: later steps do not change it).
    pub fn state(&self) -> Result<MasterState> {
        let masters = self.entries.iter().map(|e| e.master.copy()).collect::<Result<Vec<_>>>()?;
        let states = self
            .entries
            .iter()
            .map(|e| e.state.iter().map(|t| t.copy()).collect::<Result<Vec<_>>>())
            .collect::<Result<Vec<_>>>()?;
        Ok(MasterState { step: self.step, masters, states })
    }

    /// Continues from `state` (from [`MasterWeights::state`] for the same parameters and
    /// optimizer): masters, optimizer state and step count are replaced and every parameter is
    /// set to its master (rounded to the parameter's dtype). Everything is checked first: a
    /// refused state changes nothing.
    pub fn load_state(&mut self, state: &MasterState) -> Result<()> {
        let n = self.entries.len();
        if state.masters.len() != n || state.states.len() != n {
            candle_core::bail!(
                "optimizer state for {} masters and {} states, this optimizer has {n} parameters",
                state.masters.len(),
                state.states.len()
            );
        }
        for (i, ((e, m), s)) in self.entries.iter().zip(&state.masters).zip(&state.states).enumerate() {
            if m.dims() != e.master.dims() {
                candle_core::bail!("master {i} has shape {:?}, its parameter {:?}", m.dims(), e.master.dims());
            }
            if s.len() != e.state.len() || s.iter().any(|t| t.dims() != e.master.dims()) {
                candle_core::bail!(
                    "optimizer state {i}: {} tensors of shapes {:?}, expected {} of {:?}",
                    s.len(),
                    s.iter().map(|t| t.dims().to_vec()).collect::<Vec<_>>(),
                    e.state.len(),
                    e.master.dims()
                );
            }
        }
        for ((e, m), s) in self.entries.iter_mut().zip(&state.masters).zip(&state.states) {
            let device = e.master.device().clone();
            let master = m.to_device(&device)?.to_dtype(DType::F32)?.copy()?;
            if e.model.dtype() == DType::F32 {
                // Its own master: the parameter takes the value and the master shares it again.
                e.model.set(&master)?;
                e.master = e.model.as_tensor().detach();
            } else {
                e.model.set(&master.to_dtype(e.model.dtype())?)?;
                e.master = master.detach();
            }
            e.state = s.iter().map(|t| t.to_device(&device)?.to_dtype(DType::F32)?.copy()).collect::<Result<_>>()?;
        }
        self.step = state.step;
        Ok(())
    }
}

/// The fused CUDA kernels for the update of `master` (a CUDA tensor) in this step's batch: those
/// of the device `chosen` for the batch (the first CUDA master's; `super::cuda::shared` loads them
/// once per device for the process), else the master's own; `None` where they are not available
/// (a build without them) or `master` lies on another device than the batch's (one model over
/// several GPUs): the composed update runs.
#[cfg(feature = "cuda")]
fn fused(
    chosen: Option<&std::sync::Arc<super::cuda::AmpKernels>>,
    master: &Tensor,
) -> Option<std::sync::Arc<super::cuda::AmpKernels>> {
    if !master.device().is_cuda() {
        return None;
    }
    let kernels = match chosen {
        Some(kernels) => kernels.clone(),
        None => super::cuda::shared(master.device()).ok()?,
    };
    kernels.device().same_device(master.device()).then_some(kernels)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// AdamW written out in f64 on plain vectors, as the reference.
    fn reference_adamw(w: &mut [f64], m: &mut [f64], v: &mut [f64], g: &[f64], t: i32, lr: f64, wd: f64) {
        let (b1, b2, eps) = (0.9, 0.999, 1e-8);
        for i in 0..w.len() {
            m[i] = b1 * m[i] + (1.0 - b1) * g[i];
            v[i] = b2 * v[i] + (1.0 - b2) * g[i] * g[i];
            let (mh, vh) = (m[i] / (1.0 - b1.powi(t)), v[i] / (1.0 - b2.powi(t)));
            w[i] = w[i] * (1.0 - lr * wd) - lr * mh / (vh.sqrt() + eps);
        }
    }

    #[test]
    fn adamw_on_bf16_parameters_keeps_f32_masters_that_match_the_reference() {
        let dev = Device::Cpu;
        let init: Vec<f32> = vec![0.5, -1.25, 2.0, 0.003];
        let param =
            Var::from_tensor(&Tensor::new(init.as_slice(), &dev).unwrap().to_dtype(DType::BF16).unwrap()).unwrap();
        let opt = Optimizer::AdamW(AdamW { lr: 1e-3, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.01 });
        let mut masters = MasterWeights::new(std::slice::from_ref(&param), opt).unwrap();
        let mut w: Vec<f64> = param.as_tensor().to_dtype(DType::F64).unwrap().to_vec1().unwrap();
        let (mut m, mut v) = (vec![0.0; 4], vec![0.0; 4]);
        let target = Tensor::new(&[1.0f32, 1.0, 1.0, 1.0], &dev).unwrap();
        for t in 1..=20 {
            let p32 = param.as_tensor().to_dtype(DType::F32).unwrap();
            let loss = (p32 - &target).unwrap().sqr().unwrap().sum_all().unwrap();
            let grads = loss.backward().unwrap();
            let g: Vec<f64> = grads.get(param.as_tensor()).unwrap().to_dtype(DType::F64).unwrap().to_vec1().unwrap();
            reference_adamw(&mut w, &mut m, &mut v, &g, t, 1e-3, 0.01);
            masters.step(&grads).unwrap();
        }
        let master: Vec<f32> = masters.master(0).unwrap().to_vec1().unwrap();
        for (a, b) in master.iter().zip(&w) {
            assert!((*a as f64 - b).abs() < 1e-6, "master {a} vs reference {b}");
        }
        // Each update of ~1e-3 alone would round away in bf16 (its spacing at 2.0 is 1/64):
        // applied directly to the bf16 value, 20 of them leave it at 2.0.
        let mut direct = Tensor::new(&[2.0f32], &dev).unwrap().to_dtype(DType::BF16).unwrap();
        for _ in 0..20 {
            direct = (direct - 1e-3).unwrap();
        }
        assert_eq!(direct.to_dtype(DType::F32).unwrap().to_vec1::<f32>().unwrap(), vec![2.0]);
        // The f32 master accumulates them.
        assert!((master[2] - 2.0).abs() > 0.015);
        let model: Vec<f32> = param.as_tensor().to_dtype(DType::F32).unwrap().to_vec1().unwrap();
        let rounded: Vec<f32> = Tensor::new(master.as_slice(), &dev)
            .unwrap()
            .to_dtype(DType::BF16)
            .unwrap()
            .to_dtype(DType::F32)
            .unwrap()
            .to_vec1()
            .unwrap();
        assert_eq!(model, rounded, "the model holds the masters rounded to bf16");
        assert_eq!(masters.memory_bytes(), (16, 32));
        assert_eq!(masters.model_bytes(), 8);
        // The engine's summary shows each part.
        let engine = wick::Engine::cpu();
        masters.account(&engine);
        let holdings = engine.memory_report().holdings;
        let find = |what: &str| holdings.iter().find(|h| h.what == what).map(|h| h.bytes);
        assert_eq!(find("parameters (bf16)"), Some(8));
        assert_eq!(find("master weights (f32)"), Some(16));
        assert_eq!(find("optimizer state (f32 AdamW moments)"), Some(32));
    }

    #[test]
    fn sgd_momentum_matches_pytorch_form() {
        let dev = Device::Cpu;
        let param = Var::from_tensor(&Tensor::new(&[1.0f32], &dev).unwrap()).unwrap();
        let mut masters =
            MasterWeights::new(std::slice::from_ref(&param), Optimizer::SgdMomentum { lr: 0.1, momentum: 0.9 })
                .unwrap();
        // Constant gradient 2: b1 = 2, w1 = 1 - 0.2 = 0.8; b2 = 0.9*2 + 2 = 3.8, w2 = 0.8 - 0.38 = 0.42.
        for expected in [0.8f32, 0.42] {
            let loss = (param.as_tensor() * 2.0).unwrap().sum_all().unwrap();
            masters.step(&loss.backward().unwrap()).unwrap();
            let w: Vec<f32> = param.as_tensor().to_vec1().unwrap();
            assert!((w[0] - expected).abs() < 1e-6, "{w:?} vs {expected}");
        }
    }

    /// One SGD step of `lr` (gradient 1 everywhere) on bf16 parameters whose masters start at
    /// `masters` (None: at the parameters' values); returns the bf16 values before and after.
    fn sgd_copies(values: &[f32], masters: Option<&[f32]>, lr: f64) -> (Vec<f32>, Vec<f32>) {
        let dev = Device::Cpu;
        let param = Var::from_tensor(&Tensor::new(values, &dev).unwrap().to_dtype(DType::BF16).unwrap()).unwrap();
        let given = masters.map(|m| vec![Tensor::new(m, &dev).unwrap()]);
        let opt = Optimizer::SgdMomentum { lr, momentum: 0.0 };
        let mut masters = MasterWeights::with_masters(std::slice::from_ref(&param), given.as_deref(), opt).unwrap();
        let read = |p: &Var| p.as_tensor().to_dtype(DType::F32).unwrap().to_vec1::<f32>().unwrap();
        let before = read(&param);
        let loss = param.as_tensor().to_dtype(DType::F32).unwrap().sum_all().unwrap();
        masters.step(&loss.backward().unwrap()).unwrap();
        (before, read(&param))
    }

    /// Why masters start at the f32 values: an update of 1e-3 on values in [1, 2) (bf16 spacing
    /// 1/128) moves no bf16 copy when the masters are the rounded values, while masters at the
    /// f32 values (uniform between grid points) move about 1e-3 · 128 ≈ 12.8 % of the copies by
    /// one spacing, so the copies' mean moves by the update (rounding to nearest is unbiased
    /// over uniform offsets).
    #[test]
    fn masters_from_f32_values_let_bf16_copies_follow_small_updates() {
        let n = 20_000;
        let u: Vec<f32> =
            wick_nn::params::normal_tensor(&[n], 1.0, 77, DType::F32, &Device::Cpu).unwrap().to_vec1().unwrap();
        // Values in [1, 2), spread over many bf16 cells.
        let values: Vec<f32> = u.iter().map(|x| 1.0 + (x.abs() * 0.37).fract()).collect();
        let lr = 1e-3;
        let (before, after) = sgd_copies(&values, None, lr);
        assert_eq!(before, after, "rounded masters: no copy moves");
        let (before, after) = sgd_copies(&values, Some(&values), lr);
        let moved = before.iter().zip(&after).filter(|(a, b)| a != b).count() as f64 / n as f64;
        assert!((moved - 0.128).abs() < 0.02, "{:.3} of the copies moved (expected ≈ 0.128)", moved);
        let shift = before.iter().zip(&after).map(|(a, b)| (b - a) as f64).sum::<f64>() / n as f64;
        assert!((shift + lr).abs() < 2e-4, "mean shift of the copies {shift:.2e} (expected {:.0e})", -lr);
        // The copies start as the given masters rounded to bf16.
        // bf16 round-to-nearest-even on the bits (finite values), independent of candle's cast.
        let rne = |v: f32| f32::from_bits((v.to_bits() + 0x7FFF + ((v.to_bits() >> 16) & 1)) & 0xFFFF_0000);
        let rounded: Vec<f32> = values.iter().map(|v| rne(*v)).collect();
        assert_eq!(before, rounded);
    }

    /// An f32 parameter is its own master: given its own values (or a view of them), or other
    /// values, it takes them and updates in place; no copy is kept.
    #[test]
    fn f32_parameters_are_their_own_masters() {
        let dev = Device::Cpu;
        let param = Var::from_tensor(&Tensor::new(&[1.0f32, 2.0], &dev).unwrap()).unwrap();
        let opt = Optimizer::SgdMomentum { lr: 0.5, momentum: 0.0 };
        let vars = std::slice::from_ref(&param);
        for given in [param.as_tensor().clone(), param.as_tensor().detach()] {
            let masters = MasterWeights::with_masters(vars, Some(&[given]), opt).unwrap();
            assert_eq!(masters.memory_bytes().0, 0, "no master copies");
        }
        let other = Tensor::new(&[3.0f32, 4.0], &dev).unwrap();
        let mut masters = MasterWeights::with_masters(vars, Some(&[other]), opt).unwrap();
        assert_eq!(param.as_tensor().to_vec1::<f32>().unwrap(), vec![3.0, 4.0]);
        let loss = param.as_tensor().sum_all().unwrap();
        masters.step(&loss.backward().unwrap()).unwrap();
        assert_eq!(param.as_tensor().to_vec1::<f32>().unwrap(), vec![2.5, 3.5]);
        assert_eq!(masters.master(0).unwrap().to_vec1::<f32>().unwrap(), vec![2.5, 3.5]);
    }

    #[test]
    fn given_masters_are_checked() {
        let dev = Device::Cpu;
        let param = Var::from_tensor(&Tensor::zeros(3, DType::BF16, &dev).unwrap()).unwrap();
        let opt = Optimizer::SgdMomentum { lr: 0.1, momentum: 0.0 };
        let vars = std::slice::from_ref(&param);
        let err = |m: Vec<Tensor>| MasterWeights::with_masters(vars, Some(&m), opt).err().map(|e| e.to_string());
        let count = err(vec![]).unwrap_or_default();
        assert!(count.contains("0 master values for 1 parameters"), "{count}");
        let shape = err(vec![Tensor::zeros(4, DType::F32, &dev).unwrap()]).unwrap_or_default();
        assert!(shape.contains("shape [4]"), "{shape}");
        let dtype = err(vec![Tensor::zeros(3, DType::U32, &dev).unwrap()]).unwrap_or_default();
        assert!(dtype.contains("not a floating-point type"), "{dtype}");
        // A bad second master leaves the first parameter as it was too.
        let other = Var::from_tensor(&Tensor::zeros(2, DType::BF16, &dev).unwrap()).unwrap();
        let two = [param.clone(), other];
        let bad = [Tensor::ones(3, DType::F32, &dev).unwrap(), Tensor::ones(5, DType::F32, &dev).unwrap()];
        assert!(MasterWeights::with_masters(&two, Some(&bad), opt).is_err());
        // Nothing was changed by the refused calls.
        assert_eq!(param.as_tensor().to_dtype(DType::F32).unwrap().to_vec1::<f32>().unwrap(), vec![0.0; 3]);
    }
}
