//! Vision Transformer with torchvision's parameter names (`vit_b_16` layout), trainable: layer
//! norms, attention and softmax from [`wick_nn::ops`], so every parameter gets its gradient
//! (candle-transformers' ViT trains 2 of its 200).

use candle_core::{DType, Device, Module, Tensor};
use wick::memory::push_label;

use wick_nn::autocast::norm_param_dtype;
use wick_nn::checkpoint::Checkpointing;
use wick_nn::model::{Labelled, Model};
use wick_nn::ops;
use wick_nn::params::{Init, Params};
use wick_nn::to_candle;
use wick_nn::NnError;

/// Parameters of one encoder layer, in the order [`encoder_layer`] takes them.
const LAYER_PARAMS: [&str; 12] = [
    "ln_1.weight",
    "ln_1.bias",
    "self_attention.in_proj_weight",
    "self_attention.in_proj_bias",
    "self_attention.out_proj.weight",
    "self_attention.out_proj.bias",
    "ln_2.weight",
    "ln_2.bias",
    "mlp.0.weight",
    "mlp.0.bias",
    "mlp.3.weight",
    "mlp.3.bias",
];

/// One pre-norm encoder layer over tokens (N, T, hidden).
fn encoder_layer(z: &Tensor, w: &[Tensor], heads: usize) -> candle_core::Result<Tensor> {
    let linear = |x: &Tensor, i: usize| ops::linear(x, &w[i], Some(&w[i + 1]));
    let y = ops::layer_norm(z, &w[0], &w[1], 1e-6)?;
    let attn = ops::attention_packed(&linear(&y, 2)?, heads, None)?;
    let z = ops::linear_add(&attn, &w[4], Some(&w[5]), z)?;
    let y = ops::layer_norm(&z, &w[6], &w[7], 1e-6)?;
    let y = ops::linear_gelu(&y, &w[8], &w[9])?;
    ops::linear_add(&y, &w[10], Some(&w[11]), &z)
}

/// Architecture.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct VitConfig {
    /// Input side in pixels.
    pub image_size: usize,
    /// Patch side in pixels.
    pub patch_size: usize,
    /// Width.
    pub hidden: usize,
    /// Encoder layers.
    pub layers: usize,
    /// Attention heads.
    pub heads: usize,
    /// MLP width.
    pub mlp_dim: usize,
    /// Output classes.
    pub num_classes: usize,
}

impl VitConfig {
    /// A tiny ViT for tests and examples: 32×32 images in 8×8 patches, 2 layers 64 wide with 4
    /// heads, an MLP of 128.
    pub const fn tiny(num_classes: usize) -> Self {
        VitConfig { image_size: 32, patch_size: 8, hidden: 64, layers: 2, heads: 4, mlp_dim: 128, num_classes }
    }

    /// torchvision's ViT-B/16.
    pub fn b16() -> Self {
        VitConfig {
            image_size: 224,
            patch_size: 16,
            hidden: 768,
            layers: 12,
            heads: 12,
            mlp_dim: 3072,
            num_classes: 1000,
        }
    }

    /// Whether the image splits into whole patches and the heads divide the width.
    pub(crate) fn check(&self) -> Result<(), NnError> {
        if self.patch_size == 0
            || !self.image_size.is_multiple_of(self.patch_size)
            || self.heads == 0
            || !self.hidden.is_multiple_of(self.heads)
        {
            return Err(NnError::Invalid {
                what: "vit config".into(),
                message: format!(
                    "image {} must be a multiple of patch {} and hidden {} of heads {}",
                    self.image_size, self.patch_size, self.hidden, self.heads
                ),
            });
        }
        Ok(())
    }

    /// Patches per image plus the class token (`usize::MAX` for a zero patch size or a count that
    /// does not fit; [`Vit::new`] refuses those configurations).
    pub fn tokens(&self) -> usize {
        self.image_size
            .checked_div(self.patch_size)
            .and_then(|side| side.checked_mul(side))
            .and_then(|n| n.checked_add(1))
            .unwrap_or(usize::MAX)
    }

    /// Parameters of the model this configuration describes (`None` when the count overflows).
    pub fn parameter_count(&self) -> Option<usize> {
        let (h, m, c) = (self.hidden, self.mlp_dim, self.num_classes);
        let tokens = Some(self.tokens()).filter(|t| *t != usize::MAX)?;
        // Patch projection (weight and bias), class token, positions, final norm, head.
        let fixed = self
            .patch_size
            .checked_mul(self.patch_size)?
            .checked_mul(3)?
            .checked_add(tokens)?
            .checked_add(4)?
            .checked_add(c)?
            .checked_mul(h)?
            .checked_add(c)?;
        // In-projection (3h×h + 3h), out-projection (h×h + h), two norms, MLP (m×h + m, h×m + h).
        let per_layer =
            h.checked_mul(h)?.checked_mul(4)?.checked_add(m.checked_mul(h)?.checked_mul(2)?)?.checked_add(9 * h + m)?;
        wick_nn::params::layered_count(Some(fixed), Some(per_layer), self.layers)
    }
}

/// The model.
pub struct Vit {
    /// Architecture.
    pub config: VitConfig,
    /// Every parameter by torchvision name.
    pub params: Params,
}

impl Vit {
    /// A fresh model.
    pub fn new(config: VitConfig, dtype: DType, device: &Device) -> Result<Self, NnError> {
        let c = config;
        c.check()?;
        wick_nn::params::preflight_parameters(c.parameter_count(), dtype, device, "ViT")?;
        let (h, m) = (c.hidden, c.mlp_dim);
        let mut p = Params::default();
        let fan_in = 3 * c.patch_size * c.patch_size;
        p.create(
            "conv_proj.weight",
            &[h, 3, c.patch_size, c.patch_size],
            Init::Normal((1.0 / fan_in as f64).sqrt()),
            dtype,
            device,
        )?;
        p.create("conv_proj.bias", &[h], Init::Zeros, dtype, device)?;
        p.create("class_token", &[1, 1, h], Init::Zeros, dtype, device)?;
        p.create("encoder.pos_embedding", &[1, c.tokens(), h], Init::Normal(0.02), dtype, device)?;
        for l in 0..c.layers {
            let n = format!("encoder.layers.encoder_layer_{l}");
            for (suffix, shape, init) in [
                (LAYER_PARAMS[0], vec![h], Init::Ones),
                (LAYER_PARAMS[1], vec![h], Init::Zeros),
                (LAYER_PARAMS[2], vec![3 * h, h], Init::Normal((1.0 / h as f64).sqrt())),
                (LAYER_PARAMS[3], vec![3 * h], Init::Zeros),
                (LAYER_PARAMS[4], vec![h, h], Init::Normal((1.0 / h as f64).sqrt())),
                (LAYER_PARAMS[5], vec![h], Init::Zeros),
                (LAYER_PARAMS[6], vec![h], Init::Ones),
                (LAYER_PARAMS[7], vec![h], Init::Zeros),
                (LAYER_PARAMS[8], vec![m, h], Init::Normal(0.02)),
                (LAYER_PARAMS[9], vec![m], Init::Normal(1e-6)),
                (LAYER_PARAMS[10], vec![h, m], Init::Normal(0.02)),
                (LAYER_PARAMS[11], vec![h], Init::Normal(1e-6)),
            ] {
                // Layer-norm parameters stay f32 under AMP (`norm_param_dtype`).
                let dtype = if suffix.starts_with("ln_") { norm_param_dtype(dtype) } else { dtype };
                p.create(&format!("{n}.{suffix}"), &shape, init, dtype, device)?;
            }
        }
        p.create("encoder.ln.weight", &[h], Init::Ones, norm_param_dtype(dtype), device)?;
        p.create("encoder.ln.bias", &[h], Init::Zeros, norm_param_dtype(dtype), device)?;
        // torchvision zero-initialises the head; a small normal keeps every gradient non-zero
        // from the first step, which the zoo's tests require.
        p.create("heads.head.weight", &[c.num_classes, h], Init::Normal(0.01), dtype, device)?;
        p.create("heads.head.bias", &[c.num_classes], Init::Zeros, dtype, device)?;
        Ok(Vit { config, params: p })
    }

    fn p(&self, name: &str) -> Result<Tensor, NnError> {
        self.params.tensor(name)
    }

    fn linear(&self, x: &Tensor, w: &str, b: &str) -> Result<Tensor, NnError> {
        Ok(ops::linear(x, &self.p(w)?, Some(&self.p(b)?))?)
    }

    /// Logits (N, classes) for images (N, 3, image_size, image_size).
    pub fn forward(&self, x: &Tensor) -> Result<Tensor, NnError> {
        self.forward_with(x, None)
    }

    /// As [`Vit::forward`], with each encoder layer checkpointed when `checkpoint` is given.
    pub fn forward_with(&self, x: &Tensor, checkpoint: Option<&Checkpointing>) -> Result<Tensor, NnError> {
        let c = &self.config;
        let n = x.dim(0)?;
        let (h, heads) = (c.hidden, c.heads);
        let embed = push_label("embed");
        let patches = wick_nn::cnn::conv2d(x, &self.p("conv_proj.weight")?, 0, c.patch_size)?;
        let tokens = patches.flatten_from(2)?.transpose(1, 2)?;
        // Tokens (N, patches, h). The patch bias, the class token and the position embedding go
        // in through `add_broadcast` (one op on the CPU and on a GPU): their gradients are sums
        // over the batch (and the patches), made in f32 there where candle's CPU reductions would
        // accumulate bf16 in bf16 under autocast. Row 0 is the class token plus its position, the
        // rest the patches plus the bias and theirs.
        let (cls, pos, bias) = (self.p("class_token")?, self.p("encoder.pos_embedding")?, self.p("conv_proj.bias")?);
        let count = tokens.dim(1)?;
        let rows = ops::add_broadcast(&tokens, &bias, &pos.narrow(1, 1, count)?)?;
        let zero = Tensor::zeros((n, 1, h), tokens.dtype(), tokens.device())?;
        let first = ops::add_broadcast(&zero, &cls, &pos.narrow(1, 0, 1)?)?;
        let mut z = Tensor::cat(&[&first, &rows], 1)?;
        drop(embed);
        for l in 0..c.layers {
            let _layer = push_label(&format!("encoder.layers.{l}"));
            let weights: Vec<Tensor> = LAYER_PARAMS
                .iter()
                .map(|s| self.p(&format!("encoder.layers.encoder_layer_{l}.{s}")))
                .collect::<Result<_, _>>()?;
            z = match checkpoint {
                Some(ckpt) => ckpt.segment(&z, weights, move |z, w| encoder_layer(z, w, heads))?,
                None => encoder_layer(&z, &weights, heads)?,
            };
        }
        let _head = push_label("head");
        let z = ops::layer_norm(&z, &self.p("encoder.ln.weight")?, &self.p("encoder.ln.bias")?, 1e-6)?;
        let cls = z.narrow(1, 0, 1)?.squeeze(1)?;
        self.linear(&cls, "heads.head.weight", "heads.head.bias")
    }
}

/// Trained on classification: cross-entropy of the logits against the labels.
impl Model for Vit {
    type Batch = Labelled;

    fn params(&self) -> &Params {
        &self.params
    }

    fn loss_with(&self, batch: &Labelled, checkpoint: Option<&Checkpointing>) -> Result<Tensor, NnError> {
        Ok(ops::cross_entropy(&self.forward_with(&batch.inputs, checkpoint)?, &batch.labels)?)
    }

    wick_nn::tensor_batches!();
}

/// Images (N, 3, image_size, image_size) to logits (N, classes).
impl Module for Vit {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        Vit::forward(self, x).map_err(to_candle)
    }
}
