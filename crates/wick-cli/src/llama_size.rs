//! LLaMA-style decoders for `wick estimate` and `wick fit-batch`: by size name or from a Hugging
//! Face `config.json`. A 7B model does not fit this process as an f32 model to profile, so the
//! estimate profiles the same widths with one and with two layers and extrapolates to the depth
//! ([`ActivationProfile::with_layers`]); the parameter bytes come from the configuration.

use anyhow::{Context, Result};
use candle_core::{DType, Device};
use wick_nn::checkpoint::Checkpointing;
use wick_nn::Model;
use wick_zoo::estimate::{ActivationProfile, ParamBytes};
use wick_zoo::llama::{Llama, LlamaConfig};

use crate::models::{leak, token_ids, Built};

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
