//! MobileNetV2 with torchvision's parameter names: trainable from scratch, or loaded from
//! torchvision's ImageNet weights (the legacy `.pth` through [`crate::pth`], or a safetensors
//! conversion of it).

use std::collections::HashMap;
use std::path::Path;
use wick::memory::push_label;

use candle_core::{DType, Device, Tensor};

use crate::error::ZooError;
use wick_nn::autocast::norm_param_dtype;
use wick_nn::checkpoint::{run_stateful, Checkpointing};
use wick_nn::cnn::{depthwise_conv2d, global_avg_pool, Activation, BatchNorm, RunningStats};
use wick_nn::params::{Init, Params};
use wick_nn::NnError;

/// torchvision's `_make_divisible`.
fn make_divisible(v: f64, divisor: usize) -> usize {
    let new_v = (((v + divisor as f64 / 2.0) as usize) / divisor * divisor).max(divisor);
    if (new_v as f64) < 0.9 * v {
        new_v + divisor
    } else {
        new_v
    }
}

/// Where the parameters come from.
enum Source<'a> {
    Fresh,
    Weights { path: &'a Path, tensors: &'a HashMap<String, Tensor> },
}

struct Builder<'a> {
    source: Source<'a>,
    params: Params,
    dtype: DType,
    device: Device,
}

impl Builder<'_> {
    /// Parameter `name` in `dtype` (the model's, or f32 for norms under AMP).
    fn tensor(&mut self, name: &str, shape: &[usize], init: Init, dtype: DType) -> Result<Tensor, ZooError> {
        let t = match &self.source {
            Source::Fresh => return Ok(self.params.create(name, shape, init, dtype, &self.device)?),
            Source::Weights { path, tensors } => {
                let bad =
                    |message: String| ZooError::Tensor { path: path.to_path_buf(), tensor: name.to_string(), message };
                let t = tensors.get(name).ok_or_else(|| bad("missing".into()))?;
                if t.dims() != shape {
                    return Err(bad(format!("shape {:?}, expected {:?}", t.dims(), shape)));
                }
                if !t.dtype().is_float() {
                    return Err(bad(format!("dtype {:?} is not a floating-point type", t.dtype())));
                }
                t.to_dtype(dtype)?
            }
        };
        Ok(self.params.insert(name, t)?)
    }

    fn buffer(&self, name: &str, shape: &[usize], fresh: f64, dtype: DType) -> Result<Tensor, ZooError> {
        match &self.source {
            Source::Fresh => Ok((Tensor::ones(shape, dtype, &self.device)? * fresh)?),
            Source::Weights { path, tensors } => {
                let t = tensors.get(name).ok_or_else(|| ZooError::Tensor {
                    path: path.to_path_buf(),
                    tensor: name.into(),
                    message: "missing".into(),
                })?;
                Ok(t.to_dtype(dtype)?)
            }
        }
    }

    fn conv(&mut self, name: &str, shape: [usize; 4]) -> Result<Tensor, ZooError> {
        let fan_out = shape[0] * shape[2] * shape[3];
        self.tensor(&format!("{name}.weight"), &shape, Init::Normal((2.0 / fan_out as f64).sqrt()), self.dtype)
    }

    /// A batch norm, its parameters and statistics in [`norm_param_dtype`] (f32 under AMP).
    fn bn(&mut self, prefix: &str, c: usize) -> Result<BatchNorm, ZooError> {
        let dtype = norm_param_dtype(self.dtype);
        let w = self.tensor(&format!("{prefix}.weight"), &[c], Init::Ones, dtype)?;
        let b = self.tensor(&format!("{prefix}.bias"), &[c], Init::Zeros, dtype)?;
        let mean = self.buffer(&format!("{prefix}.running_mean"), &[c], 0.0, dtype)?;
        let var = self.buffer(&format!("{prefix}.running_var"), &[c], 1.0, dtype)?;
        let running = RunningStats::register(&mut self.params, prefix, mean, var);
        Ok(BatchNorm::from_parts(w, b, running))
    }
}

/// The fixed part of an inverted-residual block; its weights are passed in, so the same code
/// runs plainly or as a checkpointed segment.
#[derive(Clone)]
struct BlockSpec {
    expand: Option<RunningStats>,
    stride: usize,
    depthwise: RunningStats,
    project: RunningStats,
    residual: bool,
}

impl BlockSpec {
    /// `w`: [expand conv, its norm weight, bias] when expanding, then depthwise conv, norm
    /// weight, bias, projection conv, norm weight, bias.
    fn apply(&self, x: &Tensor, w: &[Tensor], train: bool, update: bool) -> candle_core::Result<Tensor> {
        let (mut h, mut i) = (x.clone(), 0);
        if let Some(stats) = &self.expand {
            h = stats.conv_normalize_act(
                &h,
                (&w[0], 0, 1),
                (&w[1], &w[2]),
                (train, update),
                None,
                Activation::Relu6,
            )?;
            i = 3;
        }
        h = self.depthwise.normalize_act(
            &depthwise_conv2d(&h, &w[i], 1, self.stride)?,
            &w[i + 1],
            &w[i + 2],
            train,
            update,
            Activation::Relu6,
        )?;
        let residual = self.residual.then_some(x);
        let (conv, norm) = ((&w[i + 3], 0, 1), (&w[i + 4], &w[i + 5]));
        self.project.conv_normalize_act(&h, conv, norm, (train, update), residual, Activation::Identity)
    }
}

struct Block {
    /// torchvision's module name (`features.4`), the label its allocations are recorded under.
    name: String,
    spec: BlockSpec,
    weights: Vec<Tensor>,
}

/// MobileNetV2.
pub struct MobileNetV2 {
    /// Every parameter, by torchvision name.
    pub params: Params,
    stem: (Tensor, BatchNorm),
    blocks: Vec<Block>,
    last: (Tensor, BatchNorm),
    classifier: (Tensor, Tensor),
}

impl MobileNetV2 {
    /// A fresh model; `width_mult` 1.0 is the standard one.
    pub fn new(num_classes: usize, width_mult: f64, dtype: DType, device: &Device) -> Result<Self, ZooError> {
        let builder = Builder { source: Source::Fresh, params: Params::default(), dtype, device: device.clone() };
        Self::build(builder, num_classes, width_mult)
    }

    /// torchvision's ImageNet model from a state dict (the tensors of a `.pth` or safetensors).
    pub fn from_tensors(
        path: &Path,
        tensors: &HashMap<String, Tensor>,
        dtype: DType,
        device: &Device,
    ) -> Result<Self, ZooError> {
        let builder = Builder {
            source: Source::Weights { path, tensors },
            params: Params::default(),
            dtype,
            device: device.clone(),
        };
        Self::build(builder, 1000, 1.0)
    }

    fn build(mut b: Builder<'_>, num_classes: usize, width_mult: f64) -> Result<Self, ZooError> {
        let mut input = make_divisible(32.0 * width_mult, 8);
        let last_channel = make_divisible(1280.0 * width_mult.max(1.0), 8);
        let stem = (b.conv("features.0.0", [input, 3, 3, 3])?, b.bn("features.0.1", input)?);
        let settings =
            [(1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1), (6, 160, 3, 2), (6, 320, 1, 1)];
        let mut blocks = Vec::new();
        let mut index = 1;
        for (t, c, n, s) in settings {
            let output = make_divisible(c as f64 * width_mult, 8);
            for i in 0..n {
                let stride = if i == 0 { s } else { 1 };
                let hidden = (input as f64 * t as f64).round() as usize;
                let p = format!("features.{index}.conv");
                let mut weights = Vec::new();
                let (expand, next) = if t != 1 {
                    weights.push(b.conv(&format!("{p}.0.0"), [hidden, input, 1, 1])?);
                    let bn = b.bn(&format!("{p}.0.1"), hidden)?;
                    weights.extend([bn.weight, bn.bias]);
                    (Some(bn.running), 1)
                } else {
                    (None, 0)
                };
                weights.push(b.conv(&format!("{p}.{next}.0"), [hidden, 1, 3, 3])?);
                let dw = b.bn(&format!("{p}.{next}.1"), hidden)?;
                weights.extend([dw.weight, dw.bias]);
                weights.push(b.conv(&format!("{p}.{}", next + 1), [output, hidden, 1, 1])?);
                let pj = b.bn(&format!("{p}.{}", next + 2), output)?;
                weights.extend([pj.weight, pj.bias]);
                let spec = BlockSpec {
                    expand,
                    stride,
                    depthwise: dw.running,
                    project: pj.running,
                    residual: stride == 1 && input == output,
                };
                blocks.push(Block { name: format!("features.{index}"), spec, weights });
                input = output;
                index += 1;
            }
        }
        let last = (
            b.conv(&format!("features.{index}.0"), [last_channel, input, 1, 1])?,
            b.bn(&format!("features.{index}.1"), last_channel)?,
        );
        let classifier = (
            b.tensor("classifier.1.weight", &[num_classes, last_channel], Init::Normal(0.01), b.dtype)?,
            b.tensor("classifier.1.bias", &[num_classes], Init::Zeros, b.dtype)?,
        );
        Ok(MobileNetV2 { params: b.params, stem, blocks, last, classifier })
    }

    /// The residual-block counterpart of torchvision ResNet's `zero_init_residual=True`: the
    /// projection norm's scale of every block with a skip connection starts at zero, so those
    /// blocks start as the identity.
    pub fn zero_init_residual(&self) -> Result<(), NnError> {
        for block in self.blocks.iter().filter(|b| b.spec.residual) {
            let n = block.weights.len();
            let scale = &block.weights[n - 2];
            if let Some((_, var)) = self.params.iter().find(|(_, v)| v.as_tensor().id() == scale.id()) {
                var.set(&var.zeros_like()?)?;
            }
        }
        Ok(())
    }

    /// Logits (N, classes) for images (N, 3, H, W), normalised as torchvision expects.
    pub fn forward(&self, x: &Tensor, train: bool) -> Result<Tensor, NnError> {
        self.forward_with(x, train, None)
    }

    /// As [`MobileNetV2::forward`], with each inverted-residual block checkpointed when
    /// `checkpoint` is given (batch-norm statistics move once, in the forward pass).
    pub fn forward_with(&self, x: &Tensor, train: bool, checkpoint: Option<&Checkpointing>) -> Result<Tensor, NnError> {
        let stem = push_label("features.0");
        let mut x = self.stem.1.conv_forward_act(x, (&self.stem.0, 1, 2), train, Activation::Relu6)?;
        drop(stem);
        for block in &self.blocks {
            let _block = push_label(&block.name);
            x = run_stateful(checkpoint, &x, &block.weights, &block.spec, move |spec, x, w, update| {
                spec.apply(x, w, train, update)
            })?;
        }
        let last = push_label("features.last");
        let x = self.last.1.conv_forward_act(&x, (&self.last.0, 0, 1), train, Activation::Relu6)?;
        drop(last);
        let _head = push_label("classifier");
        Ok(wick_nn::ops::linear(&global_avg_pool(&x)?, &self.classifier.0, Some(&self.classifier.1))?)
    }
}

crate::classifier::cnn_classifier!(MobileNetV2);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn make_divisible_matches_torchvision() {
        assert_eq!(make_divisible(32.0, 8), 32);
        assert_eq!(make_divisible(16.0 * 0.35, 8), 8);
        assert_eq!(make_divisible(24.0 * 0.75, 8), 24);
        assert_eq!(make_divisible(1280.0, 8), 1280);
    }
}
