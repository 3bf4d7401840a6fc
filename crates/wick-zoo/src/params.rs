//! Named trainable parameters: every tensor a model learns is a `Var` registered here, so a test
//! (or an optimiser) can reach each one by name and nothing is trained by accident or left out.

use std::collections::BTreeMap;

use candle_core::{DType, Device, Result, Tensor, Var};

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

/// Parameters by name, in name order.
#[derive(Debug, Default)]
pub struct Params {
    vars: BTreeMap<String, Var>,
}

impl Params {
    /// Creates and registers a parameter.
    pub fn create(&mut self, name: &str, shape: &[usize], init: Init, dtype: DType, device: &Device) -> Result<Tensor> {
        let t = match init {
            Init::Zeros => Tensor::zeros(shape, dtype, device)?,
            Init::Ones => Tensor::ones(shape, dtype, device)?,
            Init::Normal(std) => Tensor::randn(0f32, std as f32, shape, device)?.to_dtype(dtype)?,
        };
        self.insert(name, t)
    }

    /// Registers an existing tensor (loaded weights) as a parameter.
    pub fn insert(&mut self, name: &str, t: Tensor) -> Result<Tensor> {
        let var = Var::from_tensor(&t)?;
        let out = var.as_tensor().clone();
        self.vars.insert(name.to_string(), var);
        Ok(out)
    }

    /// All parameters, in name order.
    pub fn iter(&self) -> impl Iterator<Item = (&String, &Var)> {
        self.vars.iter()
    }

    /// The parameter `name`.
    pub fn get(&self, name: &str) -> Option<&Var> {
        self.vars.get(name)
    }

    /// The current value of parameter `name` (tracked for gradients), or an error naming it.
    pub fn tensor(&self, name: &str) -> std::result::Result<Tensor, crate::ZooError> {
        self.vars.get(name).map(|v| v.as_tensor().clone()).ok_or_else(|| crate::ZooError::Config {
            path: "<model>".into(),
            message: format!("no parameter `{name}`"),
        })
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
