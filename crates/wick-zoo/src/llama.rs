//! A small LLaMA-style decoder trainable from scratch: RMSNorm, rotary positions, causal
//! attention and a SwiGLU feed-forward, all from [`wick_nn::ops`] so every parameter trains.

use std::path::Path;

use candle_core::{DType, Device, Module, Tensor};
use wick::memory::push_label;

use wick_nn::autocast::norm_param_dtype;
use wick_nn::checkpoint::Checkpointing;
use wick_nn::model::Model;
use wick_nn::ops;
use wick_nn::params::{Init, Params};
use wick_nn::to_candle;
use wick_nn::NnError;

use crate::error::ZooError;

/// Parameters of one decoder layer, in the order [`decoder_layer`] takes them.
const LAYER_PARAMS: [&str; 9] = [
    "attn_norm.weight",
    "q.weight",
    "k.weight",
    "v.weight",
    "o.weight",
    "mlp_norm.weight",
    "gate.weight",
    "up.weight",
    "down.weight",
];

/// One pre-norm decoder layer: attention with rotary positions, then a SwiGLU feed-forward.
fn decoder_layer(
    x: &Tensor,
    w: &[Tensor],
    c: &LlamaConfig,
    cos: &Tensor,
    sin: &Tensor,
    mask: &Tensor,
) -> candle_core::Result<Tensor> {
    let heads = c.num_heads;
    let h = ops::rms_norm(x, &w[0], c.rms_eps)?;
    // q, k and v from one projection, rotated and attended in place.
    let qkv = ops::linear_stacked(&h, &[&w[1], &w[2], &w[3]], None)?;
    let attn = ops::attention_packed(&ops::rope_packed(&qkv, heads, cos, sin)?, heads, Some(mask))?;
    let x = ops::linear_add(&attn, &w[4], None, x)?;
    let h = ops::rms_norm(&x, &w[5], c.rms_eps)?;
    // Gate and up from one projection.
    let gated = ops::silu_mul_packed(&ops::linear_stacked(&h, &[&w[6], &w[7]], None)?)?;
    ops::linear_add(&gated, &w[8], None, &x)
}

/// Architecture of the decoder.
#[derive(Debug, Clone, Copy, PartialEq, serde::Deserialize, serde::Serialize)]
pub struct LlamaConfig {
    /// Vocabulary size.
    pub vocab_size: usize,
    /// Model width.
    pub hidden_size: usize,
    /// Decoder layers.
    pub num_layers: usize,
    /// Attention heads.
    pub num_heads: usize,
    /// SwiGLU width.
    pub intermediate_size: usize,
    /// Longest sequence.
    pub max_seq: usize,
    /// RMSNorm epsilon.
    pub rms_eps: f64,
    /// RoPE base.
    pub rope_theta: f64,
}

impl LlamaConfig {
    /// A tiny configuration for tests and examples.
    pub fn tiny(vocab_size: usize) -> Self {
        LlamaConfig {
            vocab_size,
            hidden_size: 32,
            num_layers: 2,
            num_heads: 4,
            intermediate_size: 64,
            max_seq: 64,
            rms_eps: 1e-6,
            rope_theta: 10_000.0,
        }
    }

    /// Llama-2-7B's shapes (multi-head attention, as the zoo's decoder; 6.7 B parameters).
    pub fn llama2_7b() -> Self {
        LlamaConfig {
            vocab_size: 32_000,
            hidden_size: 4096,
            num_layers: 32,
            num_heads: 32,
            intermediate_size: 11_008,
            max_seq: 4096,
            rms_eps: 1e-5,
            rope_theta: 10_000.0,
        }
    }

    /// Llama-2-13B's shapes (13 B parameters).
    pub fn llama2_13b() -> Self {
        LlamaConfig { hidden_size: 5120, num_layers: 40, num_heads: 40, intermediate_size: 13_824, ..Self::llama2_7b() }
    }

    /// A Hugging Face LLaMA `config.json` (`model_type: llama`), or `None` for another model
    /// type. Grouped-query attention, sizes that overflow and zero layers are errors naming the
    /// file.
    pub fn from_hf_config(path: &Path) -> Result<Option<Self>, ZooError> {
        let config = |message: String| ZooError::Config { path: path.to_path_buf(), message };
        let text = std::fs::read_to_string(path)
            .map_err(|e| ZooError::File { path: path.to_path_buf(), message: e.to_string() })?;
        let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| config(format!("not JSON: {e}")))?;
        if v.get("model_type").and_then(|t| t.as_str()) != Some("llama") {
            return Ok(None);
        }
        let number = |key: &str| -> Result<usize, ZooError> {
            v.get(key)
                .and_then(|n| n.as_u64())
                .and_then(|n| usize::try_from(n).ok())
                .ok_or_else(|| config(format!("`{key}` must be a whole number")))
        };
        let heads = number("num_attention_heads")?;
        if let Some(kv) = v.get("num_key_value_heads").and_then(|n| n.as_u64()) {
            if kv != heads as u64 {
                return Err(config(format!(
                    "grouped-query attention ({kv} key/value heads for {heads}) is not in the zoo's LLaMA"
                )));
            }
        }
        let parsed = LlamaConfig {
            vocab_size: number("vocab_size")?,
            hidden_size: number("hidden_size")?,
            num_layers: number("num_hidden_layers")?,
            num_heads: heads,
            intermediate_size: number("intermediate_size")?,
            max_seq: number("max_position_embeddings").unwrap_or(4096),
            rms_eps: v.get("rms_norm_eps").and_then(|n| n.as_f64()).unwrap_or(1e-6),
            rope_theta: v.get("rope_theta").and_then(|n| n.as_f64()).unwrap_or(10_000.0),
        };
        if parsed.parameter_count().is_none() || parsed.num_layers == 0 {
            return Err(config("the sizes overflow or there are no layers".into()));
        }
        Ok(Some(parsed))
    }

    /// Parameters of the decoder this configuration describes (`None` when the count overflows).
    pub fn parameter_count(&self) -> Option<usize> {
        let (h, i, v) = (self.hidden_size, self.intermediate_size, self.vocab_size);
        // Embedding, final norm, LM head.
        let fixed = v.checked_mul(2)?.checked_add(1)?.checked_mul(h)?;
        // Q, K, V, O (h×h), two RMSNorm scales, gate, up and down (i×h).
        let per_layer =
            h.checked_mul(h)?.checked_mul(4)?.checked_add(i.checked_mul(h)?.checked_mul(3)?)?.checked_add(2 * h)?;
        wick_nn::params::layered_count(Some(fixed), Some(per_layer), self.num_layers)
    }

    /// Whether the heads split the width into even head sizes (RoPE rotates pairs).
    pub(crate) fn check(&self) -> Result<(), NnError> {
        if self.num_heads == 0
            || !self.hidden_size.is_multiple_of(self.num_heads)
            || !(self.hidden_size / self.num_heads).is_multiple_of(2)
        {
            return Err(NnError::Invalid {
                what: "llama config".into(),
                message: format!(
                    "hidden_size {} must split into an even head size over {} heads",
                    self.hidden_size, self.num_heads
                ),
            });
        }
        Ok(())
    }
}

/// The decoder with its parameters.
pub struct Llama {
    /// Architecture.
    pub config: LlamaConfig,
    /// Every parameter by name.
    pub params: Params,
    dtype: DType,
}

impl Llama {
    /// A freshly initialised model.
    pub fn new(config: LlamaConfig, dtype: DType, device: &Device) -> Result<Self, NnError> {
        config.check()?;
        wick_nn::params::preflight_parameters(config.parameter_count(), dtype, device, "LLaMA")?;
        let (h, i, v) = (config.hidden_size, config.intermediate_size, config.vocab_size);
        let std = 0.02;
        let mut params = Params::default();
        params.create("embed.weight", &[v, h], Init::Normal(std), dtype, device)?;
        for l in 0..config.num_layers {
            for (name, shape, init) in [
                ("attn_norm.weight", vec![h], Init::Ones),
                ("q.weight", vec![h, h], Init::Normal(std)),
                ("k.weight", vec![h, h], Init::Normal(std)),
                ("v.weight", vec![h, h], Init::Normal(std)),
                ("o.weight", vec![h, h], Init::Normal(std)),
                ("mlp_norm.weight", vec![h], Init::Ones),
                ("gate.weight", vec![i, h], Init::Normal(std)),
                ("up.weight", vec![i, h], Init::Normal(std)),
                ("down.weight", vec![h, i], Init::Normal(std)),
            ] {
                // RMSNorm scales stay f32 under AMP (`norm_param_dtype`).
                let dtype = if name.contains("norm") { norm_param_dtype(dtype) } else { dtype };
                params.create(&format!("layers.{l}.{name}"), &shape, init, dtype, device)?;
            }
        }
        params.create("norm.weight", &[h], Init::Ones, norm_param_dtype(dtype), device)?;
        params.create("lm_head.weight", &[v, h], Init::Normal(std), dtype, device)?;
        Ok(Llama { config, params, dtype })
    }

    fn p(&self, name: &str) -> Result<Tensor, NnError> {
        self.params.tensor(name)
    }

    fn proj(&self, x: &Tensor, name: &str) -> Result<Tensor, NnError> {
        Ok(ops::linear(x, &self.p(name)?, None)?)
    }

    /// Logits (batch, seq, vocab) for token ids (batch, seq).
    pub fn forward(&self, ids: &Tensor) -> Result<Tensor, NnError> {
        self.forward_with(ids, None)
    }

    /// As [`Llama::forward`], with each decoder layer checkpointed when `checkpoint` is given.
    pub fn forward_with(&self, ids: &Tensor, checkpoint: Option<&Checkpointing>) -> Result<Tensor, NnError> {
        let c = self.config;
        let (batch, seq) = ids.dims2()?;
        if seq > c.max_seq {
            return Err(NnError::Invalid {
                what: "input".into(),
                message: format!("sequence {seq} exceeds max_seq {}", c.max_seq),
            });
        }
        let device = ids.device();
        let hd = c.hidden_size / c.num_heads;
        let (cos, sin) = ops::rope_tables(seq, hd, c.rope_theta, self.dtype, device)?;
        let mask = ops::causal_bias(seq, self.dtype, device)?;
        let embed = push_label("embed");
        let mut x =
            ops::embedding(&self.p("embed.weight")?, &ids.flatten_all()?)?.reshape((batch, seq, c.hidden_size))?;
        drop(embed);
        for l in 0..c.num_layers {
            let _layer = push_label(&format!("layers.{l}"));
            let weights: Vec<Tensor> =
                LAYER_PARAMS.iter().map(|n| self.p(&format!("layers.{l}.{n}"))).collect::<Result<_, _>>()?;
            x = match checkpoint {
                Some(ckpt) => {
                    let (cos, sin, mask) = (cos.clone(), sin.clone(), mask.clone());
                    ckpt.segment(&x, weights, move |x, w| decoder_layer(x, w, &c, &cos, &sin, &mask))?
                }
                None => decoder_layer(&x, &weights, &c, &cos, &sin, &mask)?,
            };
        }
        let _head = push_label("lm_head");
        let x = ops::rms_norm(&x, &self.p("norm.weight")?, c.rms_eps)?;
        self.proj(&x, "lm_head.weight")
    }
}

/// Trained on next-token prediction: the batch is token ids (batch, seq), u32, and the loss is
/// the cross-entropy of each position's logits against the token that follows it.
impl Model for Llama {
    type Batch = Tensor;

    fn params(&self) -> &Params {
        &self.params
    }

    fn loss_with(&self, ids: &Tensor, checkpoint: Option<&Checkpointing>) -> Result<Tensor, NnError> {
        let (batch, seq) = ids.dims2()?;
        if seq < 2 {
            return Err(NnError::Invalid {
                what: "input".into(),
                message: format!("next-token loss needs at least 2 tokens per sequence, got {seq}"),
            });
        }
        let logits = self.forward_with(&ids.narrow(1, 0, seq - 1)?, checkpoint)?;
        let targets = ids.narrow(1, 1, seq - 1)?.flatten_all()?;
        Ok(ops::cross_entropy(&logits.reshape((batch * (seq - 1), self.config.vocab_size))?, &targets)?)
    }

    wick_nn::tensor_batches!();
}

/// Token ids (batch, seq) to logits (batch, seq, vocab).
impl Module for Llama {
    fn forward(&self, ids: &Tensor) -> candle_core::Result<Tensor> {
        Llama::forward(self, ids).map_err(to_candle)
    }
}
