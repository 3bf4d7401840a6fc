//! The zoo by name and size: one place that turns "ResNet-50 at 224²" or "BERT-base at 128
//! tokens" into a built model with one interface, instead of a `match` on model names in every
//! binary. [`ModelSpec`] is an architecture at a size (its configuration and its input shape);
//! [`ModelSpec::named`] knows the published ones ([`NAMED`]: torchvision's ResNet-18/34/50,
//! MobileNetV2 and ViT-B/16, BERT-base, all-MiniLM-L6-v2 and Llama-2-7B/13B shapes);
//! [`ModelSpec::build`] makes a [`ZooModel`], which trains and evaluates on a [`ZooBatch`] like
//! any [`Model`]; [`ModelSpec::batch`] makes a deterministic synthetic batch of any size and
//! [`ModelSpec::profile`] the estimator's memory profile (a LLaMA through one and two layers,
//! extrapolated to its depth, since a 7B model does not fit here as an f32 model to profile).
//!
//! Benchmarks and trials that need other sizes write their own [`ModelSpec`] (a struct literal)
//! and their own batches; they still build through [`ModelSpec::build`].
//!
//! ```
//! use candle_core::{DType, Device};
//! use wick_nn::Model;
//! use wick_zoo::registry::{Input, ModelSpec};
//!
//! # fn main() -> Result<(), wick_zoo::ZooError> {
//! let spec = ModelSpec::named("resnet18", Input { image: 32, ..Input::default() })?;
//! let model = spec.build(DType::F32, &Device::Cpu)?;
//! assert_eq!(model.params().numel(), 11_689_512); // torchvision's count
//! let loss = model.loss(&spec.batch(2, DType::F32, &Device::Cpu)?)?;
//! assert!(loss.to_scalar::<f32>()?.is_finite());
//! # Ok(())
//! # }
//! ```

use std::path::Path;
use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use wick_nn::checkpoint::Checkpointing;
use wick_nn::params::{normal_tensor, Params};
use wick_nn::{Labelled, Model, NnError, TensorBatch};

use crate::bert::{Bert, BertConfig, SentenceBatch};
use crate::error::ZooError;
use crate::estimate::{ActivationProfile, BlockBytes, BlockRecorder, ParamBytes, Piecewise};
use crate::llama::{Llama, LlamaConfig};
use crate::mobilenet::MobileNetV2;
use crate::resnet::{ResNet, ResNetDepth};
use crate::vit::{Vit, VitConfig};

/// A model known by name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Named {
    /// The name a command line takes (`resnet18`, `bert-base`, ...).
    pub name: &'static str,
    /// What it is, for a report ("ResNet-18").
    pub title: &'static str,
    /// Where its shapes come from and how large it is, for `--help`.
    pub about: &'static str,
}

/// The published models [`ModelSpec::named`] builds, in the order a help text lists them.
pub const NAMED: [Named; 9] = [
    Named { name: "resnet18", title: "ResNet-18", about: "torchvision's ResNet-18 (11.7 M parameters)" },
    Named { name: "resnet34", title: "ResNet-34", about: "torchvision's ResNet-34 (21.8 M)" },
    Named { name: "resnet50", title: "ResNet-50", about: "torchvision's ResNet-50 (25.6 M)" },
    Named { name: "mobilenet_v2", title: "MobileNetV2", about: "torchvision's MobileNetV2, width 1.0 (3.5 M)" },
    Named { name: "vit_b_16", title: "ViT-B/16", about: "torchvision's ViT-B/16 (86.6 M) at 224²" },
    Named {
        name: "bert-base",
        title: "BERT-base",
        about: "BERT-base, uncased vocabulary (109 M), with a two-class readout",
    },
    Named { name: "minilm", title: "all-MiniLM-L6-v2", about: "all-MiniLM-L6-v2's encoder (22.7 M)" },
    Named {
        name: "llama2-7b",
        title: "LLaMA (Llama-2-7B shapes)",
        about: "a LLaMA-style decoder with Llama-2-7B's shapes (6.7 B), profiled through one and two layers",
    },
    Named { name: "llama2-13b", title: "LLaMA (Llama-2-13B shapes)", about: "with Llama-2-13B's shapes (13 B)" },
];

/// The input size of a named model: the image side of the CNNs (ViT keeps its configured
/// size) and the sequence length of the text models.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Input {
    /// Image side, at least 32 (the CNNs downsample 32×).
    pub image: usize,
    /// Tokens per sequence, at least 1 (2 for a decoder's next-token loss).
    pub seq: usize,
}

impl Default for Input {
    /// ImageNet's 224² and 128 tokens.
    fn default() -> Self {
        Input { image: 224, seq: 128 }
    }
}

/// An architecture at a size: its configuration and its input shape.
#[derive(Debug, Clone, PartialEq)]
pub enum ModelSpec {
    /// A ResNet on `image`² RGB images; `width` is the first stage's (64 in torchvision's).
    ResNet {
        /// Which depth.
        depth: ResNetDepth,
        /// Output classes.
        classes: usize,
        /// The first stage's width.
        width: usize,
        /// Image side.
        image: usize,
    },
    /// MobileNetV2 on `image`² RGB images.
    MobileNetV2 {
        /// Output classes.
        classes: usize,
        /// The width multiplier (1.0 in torchvision's).
        width_mult: f64,
        /// Image side.
        image: usize,
    },
    /// A vision transformer on its configured image size.
    Vit(VitConfig),
    /// A BERT encoder on `seq`-token sentences, classified into two classes through a readout.
    Bert {
        /// The encoder.
        config: BertConfig,
        /// Tokens per sentence.
        seq: usize,
    },
    /// A LLaMA-style decoder trained on next-token prediction of `seq`-token sequences.
    Llama {
        /// The decoder (its `max_seq` is set to `seq` when built).
        config: LlamaConfig,
        /// Tokens per sequence.
        seq: usize,
    },
}

impl ModelSpec {
    /// The published model `name` (one of [`NAMED`]) at `input`, or an error listing the names.
    pub fn named(name: &str, input: Input) -> Result<Self, ZooError> {
        let (image, seq) = (input.image, input.seq);
        let cnn = |depth| ModelSpec::ResNet { depth, classes: 1000, width: 64, image };
        let spec = match name {
            "resnet18" => cnn(ResNetDepth::R18),
            "resnet34" => cnn(ResNetDepth::R34),
            "resnet50" => cnn(ResNetDepth::R50),
            "mobilenet_v2" => ModelSpec::MobileNetV2 { classes: 1000, width_mult: 1.0, image },
            "vit_b_16" => ModelSpec::Vit(VitConfig::b16()),
            "bert-base" => ModelSpec::Bert { config: BertConfig::base(), seq },
            "minilm" => ModelSpec::Bert { config: BertConfig::minilm_l6(), seq },
            "llama2-7b" => ModelSpec::Llama { config: LlamaConfig::llama2_7b(), seq },
            "llama2-13b" => ModelSpec::Llama { config: LlamaConfig::llama2_13b(), seq },
            other => {
                let names: Vec<&str> = NAMED.iter().map(|n| n.name).collect();
                return Err(invalid(format!("no model named `{other}` (the zoo has {})", names.join(", "))));
            }
        };
        spec.check()?;
        Ok(spec)
    }

    /// The model a Hugging Face `config.json` describes (`model_type: llama` for the decoder,
    /// BERT otherwise) at `seq` tokens.
    pub fn from_hf_config(path: &Path, seq: usize) -> Result<Self, ZooError> {
        let spec = match LlamaConfig::from_hf_config(path)? {
            Some(config) => ModelSpec::Llama { config, seq },
            None => ModelSpec::Bert { config: BertConfig::from_file(path)?, seq },
        };
        spec.check()?;
        Ok(spec)
    }

    /// Whether the input fits the architecture: images of at least 32², sequences within the
    /// model's positions (and of at least two tokens for a decoder); and whether the architecture
    /// is one: no size that must count something (classes, widths, heads, a vocabulary) is zero,
    /// MobileNetV2's width multiplier is positive and finite, and each transformer's own
    /// configuration check passes (heads that divide the width, whole patches, a padding id in
    /// the vocabulary).
    pub fn check(&self) -> Result<(), ZooError> {
        if let Some(name) = self.counts().iter().find(|(_, n)| *n == 0).map(|(name, _)| name) {
            return Err(invalid(format!("`{name}` is 0; the model needs at least 1")));
        }
        // Each transformer's configuration checks its own shapes (as its constructor does).
        match self {
            ModelSpec::MobileNetV2 { width_mult, .. } if !(width_mult.is_finite() && *width_mult > 0.0) => {
                return Err(invalid(format!("a width multiplier of {width_mult} is not a positive number")));
            }
            ModelSpec::Vit(config) => config.check()?,
            ModelSpec::Bert { config, .. } => config.check()?,
            ModelSpec::Llama { config, .. } => config.check()?,
            _ => {}
        }
        match self {
            ModelSpec::ResNet { image, .. } | ModelSpec::MobileNetV2 { image, .. } if *image < 32 => {
                Err(invalid(format!("an image side of {image} is below the 32 the CNNs downsample by")))
            }
            ModelSpec::Bert { config, seq } if *seq == 0 || *seq > config.max_position_embeddings => {
                Err(invalid(format!(
                    "a sequence of {seq} is not between 1 and the model's {} positions",
                    config.max_position_embeddings
                )))
            }
            ModelSpec::Llama { config, seq } if *seq < 2 || *seq > config.max_seq => Err(invalid(format!(
                "a sequence of {seq} is not between 2 (next-token prediction) and the model's {} positions",
                config.max_seq
            ))),
            _ => Ok(()),
        }
    }

    /// The sizes of the architecture that count something and so cannot be 0, by field name.
    fn counts(&self) -> Vec<(&'static str, usize)> {
        match self {
            ModelSpec::ResNet { classes, width, .. } => vec![("classes", *classes), ("width", *width)],
            ModelSpec::MobileNetV2 { classes, .. } => vec![("classes", *classes)],
            ModelSpec::Vit(c) => vec![
                ("patch_size", c.patch_size),
                ("hidden", c.hidden),
                ("heads", c.heads),
                ("mlp_dim", c.mlp_dim),
                ("num_classes", c.num_classes),
            ],
            ModelSpec::Bert { config: c, .. } => vec![
                ("vocab_size", c.vocab_size),
                ("hidden_size", c.hidden_size),
                ("num_attention_heads", c.num_attention_heads),
                ("intermediate_size", c.intermediate_size),
                ("type_vocab_size", c.type_vocab_size),
            ],
            ModelSpec::Llama { config: c, .. } => vec![
                ("vocab_size", c.vocab_size),
                ("hidden_size", c.hidden_size),
                ("num_heads", c.num_heads),
                ("intermediate_size", c.intermediate_size),
            ],
        }
    }

    /// The input size in words ("224²", "sequence 128").
    pub fn input_words(&self) -> String {
        match self {
            ModelSpec::ResNet { image, .. } | ModelSpec::MobileNetV2 { image, .. } => format!("{image}²"),
            ModelSpec::Vit(config) => format!("{}²", config.image_size),
            ModelSpec::Bert { seq, .. } | ModelSpec::Llama { seq, .. } => format!("sequence {seq}"),
        }
    }

    /// Parameters of the model from its configuration, without building it: the transformers'
    /// closed forms (`None` when the count overflows); `None` for the CNNs, whose count is a
    /// built model's [`Params::numel`].
    pub fn parameter_count(&self) -> Option<usize> {
        match self {
            ModelSpec::Vit(config) => config.parameter_count(),
            ModelSpec::Bert { config, .. } => config.parameter_count(),
            ModelSpec::Llama { config, .. } => config.parameter_count(),
            ModelSpec::ResNet { .. } | ModelSpec::MobileNetV2 { .. } => None,
        }
    }

    /// Builds the model with fresh seeded parameters in `dtype` on `device` (pre-flight
    /// refuses one that does not fit).
    pub fn build(&self, dtype: DType, device: &Device) -> Result<ZooModel, ZooError> {
        self.check()?;
        Ok(match self {
            ModelSpec::ResNet { depth, classes, width, .. } => {
                ZooModel::ResNet(ResNet::new(*depth, *classes, *width, dtype, device)?)
            }
            ModelSpec::MobileNetV2 { classes, width_mult, .. } => {
                ZooModel::MobileNetV2(MobileNetV2::new(*classes, *width_mult, dtype, device)?)
            }
            ModelSpec::Vit(config) => ZooModel::Vit(Vit::new(*config, dtype, device)?),
            ModelSpec::Bert { config, .. } => ZooModel::Bert(Bert::new(config.clone(), dtype, device)?),
            ModelSpec::Llama { config, seq } => {
                ZooModel::Llama(Llama::new(LlamaConfig { max_seq: *seq, ..*config }, dtype, device)?)
            }
        })
    }

    /// A synthetic batch of `n` examples in `dtype` (the images; ids and labels are u32), the
    /// same for the same arguments: seeded normal images with labels `i % classes`; token ids
    /// spread over the whole vocabulary (a multiplicative hash of the position, so every row of
    /// a real-sized embedding table is reached) with a full attention mask and a seeded
    /// two-class readout for BERT.
    pub fn batch(&self, n: usize, dtype: DType, device: &Device) -> Result<ZooBatch, ZooError> {
        let labels = |classes: usize| -> Result<Tensor, ZooError> {
            let classes = classes.max(1);
            Ok(Tensor::new((0..n).map(|i| (i % classes) as u32).collect::<Vec<_>>(), device)?)
        };
        let images = |side: usize, classes: usize| -> Result<ZooBatch, ZooError> {
            let shape = [n, 3, side, side];
            Ok(ZooBatch::Images(Labelled {
                inputs: normal_tensor(&shape, 1.0, 11, DType::F32, device)?.to_dtype(dtype)?,
                labels: labels(classes)?,
            }))
        };
        Ok(match self {
            ModelSpec::ResNet { classes, image, .. } | ModelSpec::MobileNetV2 { classes, image, .. } => {
                images(*image, *classes)?
            }
            ModelSpec::Vit(config) => images(config.image_size, config.num_classes)?,
            ModelSpec::Bert { config, seq } => ZooBatch::Sentences(SentenceBatch {
                ids: token_ids(n, *seq, config.vocab_size, device)?,
                mask: Tensor::ones((n, *seq), DType::U32, device)?,
                readout: normal_tensor(&[config.hidden_size, 2], 0.05, 5, DType::F32, device)?,
                labels: labels(2)?,
            }),
            ModelSpec::Llama { config, seq } => ZooBatch::Tokens(token_ids(n, *seq, config.vocab_size, device)?),
        })
    }

    /// The model's parameter bytes in `dtype` without building it (under autocast the norm
    /// scales of a decoder stay f32), for the models too large to build here; `None` for the
    /// CNNs and when a count overflows.
    pub fn param_bytes(&self, dtype: DType) -> Option<ParamBytes> {
        let ModelSpec::Llama { config, .. } = self else { return None };
        let count = config.parameter_count()?;
        let (h, i, v) = (config.hidden_size, config.intermediate_size, config.vocab_size);
        let norms = (2 * config.num_layers + 1).saturating_mul(h);
        let largest = v.saturating_mul(h).max(i.saturating_mul(h));
        let size = dtype.size_in_bytes();
        Some(ParamBytes {
            total: (count - norms).saturating_mul(size).saturating_add(norms.saturating_mul(4)),
            largest: largest.saturating_mul(size),
            f32_total: count.saturating_mul(4),
            largest_f32: largest.saturating_mul(4),
        })
    }

    /// Whether [`ModelSpec::profile`] profiles through one and two layers and extrapolates to
    /// the depth instead of building the whole model (the decoders).
    pub fn profiled_by_layers(&self) -> bool {
        matches!(self, ModelSpec::Llama { .. })
    }

    /// The estimator's memory profile of the model in `dtype` on the CPU (training with each
    /// block checkpointed when `checkpointing`; the batches of `extra` inside the profiled range
    /// profiled too, see [`ActivationProfile::measure_at`]), from the whole model, or for a
    /// decoder from one- and two-layer models of its widths ([`ActivationProfile::with_layers`]);
    /// with the whole model's parameter bytes (a decoder's from its configuration).
    pub fn profile(
        &self,
        dtype: DType,
        checkpointing: bool,
        extra: &[usize],
    ) -> Result<(ActivationProfile, ParamBytes), ZooError> {
        // The profile and the parameters' bytes.
        let profile_of = |spec: &ModelSpec| {
            with_loss(spec, dtype, |params, loss| {
                let profile = ActivationProfile::measure_at(params, loss, checkpointing, extra)?;
                Ok((profile, ParamBytes::of(params)))
            })
        };
        match self {
            ModelSpec::Llama { config, seq } => {
                let layers = |n| ModelSpec::Llama { config: LlamaConfig { num_layers: n, ..*config }, seq: *seq };
                let ((one, one_bytes), (two, two_bytes)) = (profile_of(&layers(1))?, profile_of(&layers(2))?);
                // A parameter's gradient has its parameter's size.
                let layer_gradients = two_bytes.total.saturating_sub(one_bytes.total);
                let bytes = self.param_bytes(dtype).ok_or_else(|| invalid("the parameter count overflows".into()))?;
                Ok((ActivationProfile::with_layers(&one, &two, config.num_layers, layer_gradients), bytes))
            }
            _ => profile_of(self),
        }
    }

    /// [`ModelSpec::profile`] for a rank of `world` under ZeRO stage 3: every block run through a
    /// [`BlockRecorder`] ([`ActivationProfile::measure_sharded`]: recomputed, or with
    /// `recompute` false kept as wick-train's `DataParallelOptions::recompute` keeps them, with
    /// the gather's and the reduce-scatter's buffers a rank allocates); with the parameters' bytes,
    /// where they are ([`BlockBytes`]) and the largest block's name (its parameters' common
    /// prefix). A decoder is profiled through one and two layers, as there, its blocks counted
    /// to its depth.
    pub fn profile_sharded(
        &self,
        dtype: DType,
        world: usize,
        recompute: bool,
        extra: &[usize],
    ) -> Result<(ActivationProfile, ParamBytes, BlockBytes, String), ZooError> {
        let profile_of = |spec: &ModelSpec| {
            with_loss(spec, dtype, |params, loss| {
                let recorder = Arc::new(BlockRecorder::new(params, world).keeping_activations(!recompute));
                let profile = ActivationProfile::measure_sharded(params, loss, recorder.clone(), extra)?;
                let (blocks, largest) = recorder.bytes();
                Ok((profile, ParamBytes::of(params), blocks, largest))
            })
        };
        match self {
            ModelSpec::Llama { config, seq } => {
                let layers = |n| ModelSpec::Llama { config: LlamaConfig { num_layers: n, ..*config }, seq: *seq };
                let (one, _, blocks, name) = profile_of(&layers(1))?;
                let (two, ..) = profile_of(&layers(2))?;
                let bytes = self.param_bytes(dtype).ok_or_else(|| invalid("the parameter count overflows".into()))?;
                // No layer's gradients are in the store a stage-3 profile subtracts, so none
                // lowers the workspace with depth; and what a rank holds beyond the graph and the
                // gradients is one block's (its gathered parameters, its recomputation, one
                // reduce-scatter in flight beside the next block's backward), which does not grow
                // with depth either: read at the larger of the two profiles, not extended.
                let mut profile = ActivationProfile::with_layers(&one, &two, config.num_layers, 0);
                if let (Some(a), Some(b)) = (&one.backward_workspace, &two.backward_workspace) {
                    let points = a.points.iter().zip(&b.points).map(|(&(x, u), &(_, v))| (x, u.max(v))).collect();
                    profile.backward_workspace = Some(Piecewise { points });
                }
                let name = format!("{name} (every layer alike)");
                Ok((profile, bytes, blocks.with_layers(config.num_layers), name))
            }
            _ => profile_of(self),
        }
    }
}

/// Builds `spec` in `dtype` on the CPU and hands `profile` its parameters and its loss at a
/// batch size, in a checkpointing context or none (what the estimator's profiles run).
fn with_loss<T>(
    spec: &ModelSpec,
    dtype: DType,
    profile: impl FnOnce(
        &Params,
        &dyn Fn(usize, Option<&Checkpointing>) -> candle_core::Result<Tensor>,
    ) -> Result<T, ZooError>,
) -> Result<T, ZooError> {
    let model = spec.build(dtype, &Device::Cpu)?;
    let loss = |b: usize, c: Option<&Checkpointing>| {
        model.loss_with(&spec.batch(b, dtype, &Device::Cpu).map_err(to_candle)?, c).map_err(candle_core::Error::wrap)
    };
    profile(model.params(), &loss)
}

/// Token ids (`batch`, `seq`) spread over `vocab` (a multiplicative hash of the position).
fn token_ids(batch: usize, seq: usize, vocab: usize, device: &Device) -> Result<Tensor, ZooError> {
    let n = batch.checked_mul(seq).ok_or_else(|| invalid(format!("{batch} × {seq} tokens overflow")))?;
    let vocab = u32::try_from(vocab.max(1)).unwrap_or(u32::MAX);
    let ids: Vec<u32> = (0..n).map(|i| (i as u32).wrapping_mul(2_654_435_761) % vocab).collect();
    Ok(Tensor::from_vec(ids, (batch, seq), device)?)
}

fn invalid(message: String) -> ZooError {
    NnError::invalid("model", message).into()
}

fn to_candle(e: ZooError) -> candle_core::Error {
    candle_core::Error::wrap(e)
}

/// A built zoo model: one of the zoo's architectures behind one interface.
pub enum ZooModel {
    /// A ResNet.
    ResNet(ResNet),
    /// A MobileNetV2.
    MobileNetV2(MobileNetV2),
    /// A vision transformer.
    Vit(Vit),
    /// A BERT encoder.
    Bert(Bert),
    /// A LLaMA-style decoder.
    Llama(Llama),
}

/// A batch for a [`ZooModel`]: the batch type of the architecture inside.
#[derive(Debug, Clone)]
pub enum ZooBatch {
    /// Labelled images, for the CNNs and ViT.
    Images(Labelled),
    /// Classified sentences, for BERT.
    Sentences(SentenceBatch),
    /// Token ids (batch, seq), u32, for the decoder's next-token prediction.
    Tokens(Tensor),
}

impl ZooBatch {
    /// Examples `start..start + len` of the batch (views, no copy): a micro-batch for gradient
    /// accumulation, or one rank's share of a data-parallel batch. BERT's readout is shared by
    /// every example and stays whole.
    pub fn narrow(&self, start: usize, len: usize) -> Result<ZooBatch, ZooError> {
        Ok(match self {
            ZooBatch::Tokens(ids) => ZooBatch::Tokens(ids.narrow(0, start, len)?),
            ZooBatch::Images(l) => ZooBatch::Images(Labelled {
                inputs: l.inputs.narrow(0, start, len)?,
                labels: l.labels.narrow(0, start, len)?,
            }),
            ZooBatch::Sentences(s) => ZooBatch::Sentences(SentenceBatch {
                ids: s.ids.narrow(0, start, len)?,
                mask: s.mask.narrow(0, start, len)?,
                readout: s.readout.clone(),
                labels: s.labels.narrow(0, start, len)?,
            }),
        })
    }
}

impl ZooModel {
    /// The model's output for `batch` in evaluation mode (batch norm on its running
    /// statistics): logits for the classifiers and the decoder (of every position of the ids),
    /// the last hidden states for BERT.
    pub fn forward(&self, batch: &ZooBatch) -> Result<Tensor, NnError> {
        match (self, batch) {
            (ZooModel::ResNet(m), ZooBatch::Images(b)) => m.forward(&b.inputs, false),
            (ZooModel::MobileNetV2(m), ZooBatch::Images(b)) => m.forward(&b.inputs, false),
            (ZooModel::Vit(m), ZooBatch::Images(b)) => m.forward(&b.inputs),
            (ZooModel::Bert(m), ZooBatch::Sentences(b)) => m.forward(&b.ids, &b.mask),
            (ZooModel::Llama(m), ZooBatch::Tokens(ids)) => m.forward(ids),
            (model, batch) => Err(mismatch(model, batch)),
        }
    }

    /// Zeroes the last batch norm of every residual branch (torchvision's
    /// `zero_init_residual`) in the CNNs; the transformers have none, and are left as built.
    pub fn zero_init_residual(&self) -> Result<(), NnError> {
        match self {
            ZooModel::ResNet(m) => m.zero_init_residual(),
            ZooModel::MobileNetV2(m) => m.zero_init_residual(),
            ZooModel::Vit(_) | ZooModel::Bert(_) | ZooModel::Llama(_) => Ok(()),
        }
    }

    fn kind(&self) -> &'static str {
        match self {
            ZooModel::ResNet(_) => "ResNet",
            ZooModel::MobileNetV2(_) => "MobileNetV2",
            ZooModel::Vit(_) => "ViT",
            ZooModel::Bert(_) => "BERT",
            ZooModel::Llama(_) => "LLaMA",
        }
    }
}

fn mismatch(model: &ZooModel, batch: &ZooBatch) -> NnError {
    let batch = match batch {
        ZooBatch::Images(_) => "images",
        ZooBatch::Sentences(_) => "sentences",
        ZooBatch::Tokens(_) => "token ids",
    };
    NnError::invalid("batch", format!("a {} model does not take a batch of {batch}", model.kind()))
}

impl Model for ZooModel {
    type Batch = ZooBatch;

    fn params(&self) -> &Params {
        match self {
            ZooModel::ResNet(m) => m.params(),
            ZooModel::MobileNetV2(m) => m.params(),
            ZooModel::Vit(m) => m.params(),
            ZooModel::Bert(m) => m.params(),
            ZooModel::Llama(m) => m.params(),
        }
    }

    fn loss_with(&self, batch: &ZooBatch, checkpoint: Option<&Checkpointing>) -> Result<Tensor, NnError> {
        match (self, batch) {
            (ZooModel::ResNet(m), ZooBatch::Images(b)) => m.loss_with(b, checkpoint),
            (ZooModel::MobileNetV2(m), ZooBatch::Images(b)) => m.loss_with(b, checkpoint),
            (ZooModel::Vit(m), ZooBatch::Images(b)) => m.loss_with(b, checkpoint),
            (ZooModel::Bert(m), ZooBatch::Sentences(b)) => m.loss_with(b, checkpoint),
            (ZooModel::Llama(m), ZooBatch::Tokens(ids)) => m.loss_with(ids, checkpoint),
            (model, batch) => Err(mismatch(model, batch)),
        }
    }

    wick_nn::tensor_batches!();
}

/// The variant's own tensors ([`Labelled`]'s, [`SentenceBatch`]'s, or the ids); the variant is
/// kept.
impl TensorBatch for ZooBatch {
    fn tensors(&self) -> Vec<Tensor> {
        match self {
            ZooBatch::Images(b) => b.tensors(),
            ZooBatch::Sentences(b) => b.tensors(),
            ZooBatch::Tokens(ids) => ids.tensors(),
        }
    }

    fn with_tensors(&self, tensors: &[Tensor]) -> Result<Self, NnError> {
        Ok(match self {
            ZooBatch::Images(b) => ZooBatch::Images(b.with_tensors(tensors)?),
            ZooBatch::Sentences(b) => ZooBatch::Sentences(b.with_tensors(tensors)?),
            ZooBatch::Tokens(ids) => ZooBatch::Tokens(ids.with_tensors(tensors)?),
        })
    }
}
