//! LLaMA-style decoders for `wick estimate` and `wick fit-batch`: by size name or from a Hugging
//! Face `config.json`. A 7B model does not fit this process as an f32 model to profile, so the
//! estimate profiles the same widths with one and with two layers and extrapolates to the depth
//! ([`ActivationProfile::with_layers`]); the parameter bytes come from the configuration.

use std::path::Path;

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device};
use wick_nn::checkpoint::Checkpointing;
use wick_nn::Model;
use wick_zoo::estimate::{ActivationProfile, ParamBytes};
use wick_zoo::llama::{Llama, LlamaConfig};

use crate::models::{leak, token_ids, Built};

/// Llama-2-7B's shapes (multi-head attention, as the zoo's decoder).
pub fn llama2_7b() -> LlamaConfig {
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

/// Llama-2-13B's shapes.
pub fn llama2_13b() -> LlamaConfig {
    LlamaConfig { hidden_size: 5120, num_layers: 40, num_heads: 40, intermediate_size: 13_824, ..llama2_7b() }
}

/// A Hugging Face LLaMA `config.json` (`model_type: llama`), or `None` for another model type.
pub fn from_file(path: &Path) -> Result<Option<LlamaConfig>> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let v: serde_json::Value = serde_json::from_str(&text).with_context(|| format!("{}: not JSON", path.display()))?;
    if v.get("model_type").and_then(|t| t.as_str()) != Some("llama") {
        return Ok(None);
    }
    let number = |key: &str| -> Result<usize> {
        v.get(key)
            .and_then(|n| n.as_u64())
            .and_then(|n| usize::try_from(n).ok())
            .with_context(|| format!("{}: `{key}` must be a whole number", path.display()))
    };
    let heads = number("num_attention_heads")?;
    if let Some(kv) = v.get("num_key_value_heads").and_then(|n| n.as_u64()) {
        if kv as usize != heads {
            bail!(
                "{}: grouped-query attention ({kv} key/value heads for {heads}) is not in the zoo's LLaMA",
                path.display()
            );
        }
    }
    let config = LlamaConfig {
        vocab_size: number("vocab_size")?,
        hidden_size: number("hidden_size")?,
        num_layers: number("num_hidden_layers")?,
        num_heads: heads,
        intermediate_size: number("intermediate_size")?,
        max_seq: number("max_position_embeddings").unwrap_or(4096),
        rms_eps: v.get("rms_norm_eps").and_then(|n| n.as_f64()).unwrap_or(1e-6),
        rope_theta: v.get("rope_theta").and_then(|n| n.as_f64()).unwrap_or(10_000.0),
    };
    if config.parameter_count().is_none() || config.num_layers == 0 {
        bail!("{}: the sizes overflow or there are no layers", path.display());
    }
    Ok(Some(config))
}

/// The parameter bytes of `config` in `dtype` (norm scales stay f32 under autocast).
pub fn param_bytes(config: &LlamaConfig, dtype: DType) -> Result<ParamBytes> {
    let count = config.parameter_count().context("the parameter count overflows")?;
    let (h, i, v) = (config.hidden_size, config.intermediate_size, config.vocab_size);
    let norms = (2 * config.num_layers + 1).saturating_mul(h);
    let largest = v.saturating_mul(h).max(i.saturating_mul(h));
    let size = dtype.size_in_bytes();
    Ok(ParamBytes {
        total: (count - norms).saturating_mul(size).saturating_add(norms.saturating_mul(4)),
        largest: largest.saturating_mul(size),
        f32_total: count.saturating_mul(4),
        largest_f32: largest.saturating_mul(4),
    })
}

/// The whole decoder, built to run (`--measure`).
pub fn build(config: LlamaConfig, dtype: DType, seq: usize, what: String) -> Result<Built> {
    let config = LlamaConfig { max_seq: seq, ..config };
    wick_nn::params::preflight_parameters(config.parameter_count(), dtype, &Device::Cpu, "the LLaMA model")?;
    let model = leak(Llama::new(config, dtype, &Device::Cpu)?);
    Ok(Built {
        params: &model.params,
        loss: Box::new(move |b, c| {
            model.loss_with(&token_ids(b, seq, config.vocab_size)?, c).map_err(candle_core::Error::wrap)
        }),
        what,
    })
}

/// The profile of `config` at `layers` layers, from one- and two-layer models of its widths
/// (training with each layer checkpointed when `checkpointing`).
pub fn profile(config: LlamaConfig, dtype: DType, seq: usize, checkpointing: bool) -> Result<ActivationProfile> {
    let mut profiles = Vec::new();
    for layers in [1, 2] {
        let model = Llama::new(LlamaConfig { num_layers: layers, max_seq: seq, ..config }, dtype, &Device::Cpu)?;
        let loss = |b: usize, c: Option<&Checkpointing>| {
            model.loss_with(&token_ids(b, seq, config.vocab_size)?, c).map_err(candle_core::Error::wrap)
        };
        profiles.push(ActivationProfile::measure_with(&model.params, loss, checkpointing)?);
    }
    Ok(ActivationProfile::with_layers(&profiles[0], &profiles[1], config.num_layers))
}
