//! Named trainable parameters: every tensor a model learns is a `Var` registered here, so a test
//! (or an optimiser) can reach each one by name and nothing is trained by accident or left out.
//! Beside them, the named [`Buffer`]s: state a model changes while training without learning it
//! (batch norm's running statistics; PyTorch's `register_buffer`), which a checkpoint must keep
//! too.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use candle_core::{DType, Device, Result, Tensor, Var};
use rand_xoshiro::rand_core::{Rng, SeedableRng};
use rand_xoshiro::SplitMix64;

/// How a fresh parameter is initialised.
#[derive(Debug, Clone, Copy)]
pub enum Init {
    /// All zeros (biases).
    Zeros,
    /// All ones (norm scales).
    Ones,
    /// Normal with this standard deviation (weights, embeddings).
    Normal(f64),
}

/// Normally distributed values from a seeded generator (SplitMix64 and Box–Muller), so that
/// model initialisation and test data are reproducible (candle's CPU generator cannot be seeded).
pub fn normal_tensor(shape: &[usize], std: f64, seed: u64, dtype: DType, device: &Device) -> Result<Tensor> {
    let n: usize = shape.iter().product();
    let mut rng = SplitMix64::seed_from_u64(seed);
    // 53 random bits in (0, 1].
    let mut next = || ((rng.next_u64() >> 11) as f64 + 1.0) / (1u64 << 53) as f64;
    let mut values = Vec::with_capacity(n + 1);
    while values.len() < n {
        let (u1, u2) = (next(), next());
        let r = (-2.0 * u1.ln()).sqrt() * std;
        let theta = std::f64::consts::TAU * u2;
        values.push((r * theta.cos()) as f32);
        values.push((r * theta.sin()) as f32);
    }
    values.truncate(n);
    Tensor::from_vec(values, shape, device)?.to_dtype(dtype)
}

/// Parameters at least this large are pre-flighted one by one as they are created (the models
/// also pre-flight their total first; see [`preflight_parameters`]).
pub const PREFLIGHT_FROM: usize = 16 << 20;

/// Pre-flight for `bytes` on `device` (`None`: not representable). On the CPU the host must be
/// able to give them now ([`wick::host_memory::preflight_host`]); CUDA allocations fail with an
/// error by themselves, so there only an unrepresentable size is refused.
pub fn preflight_bytes(bytes: Option<usize>, device: &Device, what: &str) -> std::result::Result<(), crate::NnError> {
    use wick::memory::MemoryError;
    match bytes {
        None => {
            Err(MemoryError::TooLarge { requested: usize::MAX, capacity: 0, device: format!("{device:?} ({what})") }
                .into())
        }
        Some(bytes) if device.is_cpu() => Ok(wick::host_memory::preflight_host(bytes, what)?),
        Some(_) => Ok(()),
    }
}

/// Pre-flight for a model of `count` parameters (`None`: the count overflows) in `dtype`, before
/// any is created: a configuration asking for more than the host can give (a typo'd layer count,
/// a huge vocabulary) is `OutOfMemory` with advice instead of an aborted process.
pub fn preflight_parameters(
    count: Option<usize>,
    dtype: DType,
    device: &Device,
    what: &str,
) -> std::result::Result<(), crate::NnError> {
    preflight_bytes(count.and_then(|c| c.checked_mul(dtype.size_in_bytes())), device, &format!("{what} parameters"))
}

/// `fixed + per_layer × layers` with overflow as `None`.
pub fn layered_count(fixed: Option<usize>, per_layer: Option<usize>, layers: usize) -> Option<usize> {
    per_layer?.checked_mul(layers)?.checked_add(fixed?)
}

/// Parameters by name, in name order, remembering the order they were registered in. Fresh
/// parameters are drawn from a seeded generator: the same seed gives the same model.
#[derive(Debug)]
pub struct Params {
    vars: BTreeMap<String, Var>,
    /// The names in the order they were first registered.
    registered: Vec<String>,
    buffers: BTreeMap<String, Buffer>,
    seed: u64,
}

/// A named tensor that is not trained but changes in training (a running statistic), shared by
/// the layer that updates it and the [`Params`] store that saves it; cloning shares it.
#[derive(Clone)]
pub struct Buffer(Arc<Mutex<Tensor>>);

impl std::fmt::Debug for Buffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let t = self.get();
        write!(f, "Buffer({:?}, {:?})", t.dims(), t.dtype())
    }
}

impl Buffer {
    /// A buffer holding `t`.
    pub fn new(t: Tensor) -> Self {
        Buffer(Arc::new(Mutex::new(t)))
    }

    /// Its current value.
    pub fn get(&self) -> Tensor {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Replaces the value by `t`, which must have the same shape and dtype (a buffer keeps its
    /// form; a loaded value of another form is an error and changes nothing). On a CUDA device
    /// the values are copied into the buffer's own memory (a value read before with
    /// [`Buffer::get`] shares it and sees the new values): a training step captured as a CUDA
    /// graph replays on fixed addresses, so the running statistics must move where the next
    /// replay reads them, and a capture cannot free memory made before it (`wick::cuda_graph`).
    pub fn set(&self, t: &Tensor) -> Result<()> {
        let mut slot = self.0.lock().unwrap_or_else(|p| p.into_inner());
        if slot.dims() != t.dims() || slot.dtype() != t.dtype() {
            return Err(candle_core::Error::Msg(format!(
                "buffer is {:?} {:?}, the new value {:?} {:?}",
                slot.dims(),
                slot.dtype(),
                t.dims(),
                t.dtype()
            )));
        }
        let value = t.to_device(slot.device())?;
        if slot.device().is_cuda() && slot.is_contiguous() {
            // Refused before anything is copied where the two share their storage (the buffer
            // set to its own value): then the value itself is kept, as on the host.
            if slot.flatten_all()?.slice_set(&value.flatten_all()?.contiguous()?, 0, 0).is_ok() {
                return Ok(());
            }
        }
        *slot = value;
        Ok(())
    }
}

impl Default for Params {
    fn default() -> Self {
        Params::with_seed(0x005E_ED0F_71C4)
    }
}

impl Params {
    /// An empty store whose fresh parameters derive from `seed`.
    pub fn with_seed(seed: u64) -> Self {
        Params { vars: BTreeMap::new(), registered: Vec::new(), buffers: BTreeMap::new(), seed }
    }

    /// Creates and registers a parameter. A tensor of [`PREFLIGHT_FROM`] bytes or more is
    /// pre-flighted first (candle's CPU allocations cannot fail; one over the budget aborts).
    pub fn create(&mut self, name: &str, shape: &[usize], init: Init, dtype: DType, device: &Device) -> Result<Tensor> {
        let bytes = shape.iter().try_fold(dtype.size_in_bytes(), |a, &d| a.checked_mul(d));
        if bytes.is_none_or(|b| b >= PREFLIGHT_FROM) {
            preflight_bytes(bytes, device, &format!("parameter {name} {shape:?}")).map_err(candle_core::Error::wrap)?;
        }
        let t = match init {
            Init::Zeros => Tensor::zeros(shape, dtype, device)?,
            Init::Ones => Tensor::ones(shape, dtype, device)?,
            Init::Normal(std) => {
                // Each parameter's stream depends on the store's seed and its position.
                let seed = self.seed ^ (self.vars.len() as u64 + 1).wrapping_mul(0xD6E8_FEB8_6659_FD93);
                normal_tensor(shape, std, seed, dtype, device)?
            }
        };
        self.insert(name, t)
    }

    /// Registers an existing tensor (loaded weights) as a parameter.
    pub fn insert(&mut self, name: &str, t: Tensor) -> Result<Tensor> {
        let var = Var::from_tensor(&t)?;
        let out = var.as_tensor().clone();
        if self.vars.insert(name.to_string(), var).is_none() {
            self.registered.push(name.to_string());
        }
        Ok(out)
    }

    /// All parameters, in name order.
    pub fn iter(&self) -> impl Iterator<Item = (&String, &Var)> {
        self.vars.iter()
    }

    /// The parameters' positions in [`Params::iter`]'s (name) order, listed in the order they
    /// were registered — for a model built layer by layer, the order its forward pass first
    /// reads them, which backward reverses (the order PyTorch's DDP buckets gradients in, from
    /// `model.parameters()`). Name order differs from it as soon as a name holds a number of two
    /// digits: `layers.10` sorts before `layers.2`.
    pub fn registration_order(&self) -> Vec<usize> {
        let at: std::collections::HashMap<&str, usize> =
            self.vars.keys().enumerate().map(|(i, name)| (name.as_str(), i)).collect();
        self.registered.iter().filter_map(|name| at.get(name.as_str()).copied()).collect()
    }

    /// The parameter `name`.
    pub fn get(&self, name: &str) -> Option<&Var> {
        self.vars.get(name)
    }

    /// The current value of parameter `name` (tracked for gradients), or an error naming it.
    pub fn tensor(&self, name: &str) -> std::result::Result<Tensor, crate::NnError> {
        self.vars
            .get(name)
            .map(|v| v.as_tensor().clone())
            .ok_or_else(|| crate::NnError::Invalid { what: "model".into(), message: format!("no parameter `{name}`") })
    }

    /// Number of parameters (tensors).
    pub fn len(&self) -> usize {
        self.vars.len()
    }

    /// True when there are none.
    pub fn is_empty(&self) -> bool {
        self.vars.is_empty()
    }

    /// Total scalar count.
    pub fn numel(&self) -> usize {
        self.vars.values().map(|v| v.elem_count()).sum()
    }

    /// Registers `t` as the buffer `name` and returns it (shared: the caller updates it, the
    /// store reads and restores it).
    pub fn register_buffer(&mut self, name: &str, t: Tensor) -> Buffer {
        let buffer = Buffer::new(t);
        self.buffers.insert(name.to_string(), buffer.clone());
        buffer
    }

    /// All buffers, in name order.
    pub fn buffers(&self) -> impl Iterator<Item = (&String, &Buffer)> {
        self.buffers.iter()
    }

    /// The buffer `name`.
    pub fn buffer(&self, name: &str) -> Option<&Buffer> {
        self.buffers.get(name)
    }

    /// One plain SGD step with learning rate `lr`, for the parameters that have a gradient.
    pub fn sgd_step(&self, grads: &candle_core::backprop::GradStore, lr: f64) -> Result<()> {
        for var in self.vars.values() {
            if let Some(g) = grads.get(var) {
                var.set(&(var.as_tensor() - (g * lr)?)?)?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seeded_normals_are_reproducible_and_normal() {
        let dev = Device::Cpu;
        let a: Vec<f32> = normal_tensor(&[20_001], 2.0, 3, DType::F32, &dev).unwrap().to_vec1().unwrap();
        let b: Vec<f32> = normal_tensor(&[20_001], 2.0, 3, DType::F32, &dev).unwrap().to_vec1().unwrap();
        let c: Vec<f32> = normal_tensor(&[20_001], 2.0, 4, DType::F32, &dev).unwrap().to_vec1().unwrap();
        assert_eq!(a, b);
        assert_ne!(a, c);
        let n = a.len() as f64;
        let mean = a.iter().map(|v| *v as f64).sum::<f64>() / n;
        let var = a.iter().map(|v| (*v as f64 - mean).powi(2)).sum::<f64>() / n;
        assert!(mean.abs() < 0.05, "mean {mean}");
        assert!((var.sqrt() - 2.0).abs() < 0.05, "std {}", var.sqrt());
        // Same seed, same model.
        let mut p = Params::with_seed(9);
        let mut q = Params::with_seed(9);
        let x = p.create("w", &[4, 4], Init::Normal(0.1), DType::F32, &dev).unwrap();
        let y = q.create("w", &[4, 4], Init::Normal(0.1), DType::F32, &dev).unwrap();
        assert_eq!(
            x.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            y.flatten_all().unwrap().to_vec1::<f32>().unwrap()
        );
    }

    #[test]
    fn the_registration_order_is_kept_beside_the_name_order() {
        let mut p = Params::default();
        for name in ["layers.0.w", "layers.1.w", "layers.2.w", "layers.10.w", "head.w", "layers.1.w"] {
            p.create(name, &[1], Init::Zeros, DType::F32, &Device::Cpu).unwrap();
        }
        let names: Vec<&str> = p.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, ["head.w", "layers.0.w", "layers.1.w", "layers.10.w", "layers.2.w"]);
        // A name registered again keeps its first place.
        let order: Vec<&str> = p.registration_order().into_iter().map(|i| names[i]).collect();
        assert_eq!(order, ["layers.0.w", "layers.1.w", "layers.2.w", "layers.10.w", "head.w"]);
    }
}
