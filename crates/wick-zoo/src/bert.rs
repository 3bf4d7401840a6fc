//! BERT encoders (MiniLM sentence embeddings with mean pooling), trainable end to end: built on
//! [`wick_nn::ops`], so every parameter gets its gradient (candle-transformers' `BertModel` trains
//! 0 of its 101 parameters, and gives NaN in f16/bf16 from its `f32::MIN` mask).

use std::path::Path;
use wick::memory::push_label;

use candle_core::{DType, Device, Tensor, D};

use crate::error::ZooError;
use crate::weights::WeightFile;
use wick_nn::checkpoint::Checkpointing;
use wick_nn::model::Model;
use wick_nn::ops;
use wick_nn::params::{Init, Params};
use wick_nn::NnError;

/// The architecture, as in a Hugging Face `config.json`.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct BertConfig {
    /// Vocabulary size.
    pub vocab_size: usize,
    /// Hidden size.
    pub hidden_size: usize,
    /// Encoder layers.
    pub num_hidden_layers: usize,
    /// Attention heads.
    pub num_attention_heads: usize,
    /// Feed-forward width.
    pub intermediate_size: usize,
    /// Longest sequence.
    pub max_position_embeddings: usize,
    /// Segment vocabulary.
    pub type_vocab_size: usize,
    /// LayerNorm epsilon.
    pub layer_norm_eps: f64,
    /// The padding token, whose word-embedding row gets no gradient (and starts at zero in a
    /// fresh model), as Hugging Face's `padding_idx`; `pad_token_id` in `config.json`, 0 when
    /// absent (Hugging Face's default), `null` for none.
    #[serde(default = "default_pad_token_id")]
    pub pad_token_id: Option<u32>,
}

fn default_pad_token_id() -> Option<u32> {
    Some(0)
}

/// Keys of a Hugging Face BERT config that do not change the computation wick performs
/// (metadata, training-only dropout and initialisation settings).
const IGNORED_KEYS: &[&str] = &[
    "_name_or_path",
    "architectures",
    "attention_probs_dropout_prob",
    "gradient_checkpointing",
    "hidden_dropout_prob",
    "initializer_range",
    "model_type",
    "transformers_version",
    "use_cache",
    "classifier_dropout",
    "torch_dtype",
];

impl BertConfig {
    /// A tiny encoder for tests and examples: 2 layers 64 wide with 4 heads, a feed-forward of
    /// 128, 64 positions, padding id 0.
    pub const fn tiny(vocab_size: usize) -> Self {
        BertConfig {
            vocab_size,
            hidden_size: 64,
            num_hidden_layers: 2,
            num_attention_heads: 4,
            intermediate_size: 128,
            max_position_embeddings: 64,
            type_vocab_size: 2,
            layer_norm_eps: 1e-12,
            pad_token_id: Some(0),
        }
    }

    /// BERT-base, uncased (Hugging Face's `bert-base-uncased`: 12 × 768, 30 522 tokens; 109 M
    /// parameters).
    pub const fn base() -> Self {
        BertConfig {
            vocab_size: 30_522,
            hidden_size: 768,
            num_hidden_layers: 12,
            num_attention_heads: 12,
            intermediate_size: 3072,
            max_position_embeddings: 512,
            type_vocab_size: 2,
            layer_norm_eps: 1e-12,
            pad_token_id: Some(0),
        }
    }

    /// all-MiniLM-L6-v2's encoder (6 × 384 on BERT-base's vocabulary; 22.7 M parameters).
    pub const fn minilm_l6() -> Self {
        BertConfig {
            hidden_size: 384,
            num_hidden_layers: 6,
            num_attention_heads: 12,
            intermediate_size: 1536,
            ..BertConfig::base()
        }
    }

    /// Parameters of the encoder this configuration describes (`None` when the count overflows).
    pub fn parameter_count(&self) -> Option<usize> {
        let (h, i) = (self.hidden_size, self.intermediate_size);
        let embeddings = self
            .vocab_size
            .checked_add(self.max_position_embeddings)?
            .checked_add(self.type_vocab_size)?
            .checked_add(2)?
            .checked_mul(h)?;
        // Q, K, V, output (h×h + h each), FFN in and out, two layer norms.
        let per_layer =
            h.checked_mul(h)?.checked_mul(4)?.checked_add(i.checked_mul(h)?.checked_mul(2)?)?.checked_add(h * 9 + i)?;
        wick_nn::params::layered_count(Some(embeddings), Some(per_layer), self.num_hidden_layers)
    }

    /// Reads and checks a `config.json`: unknown keys, or values wick does not implement
    /// (another activation, relative positions), are errors naming the file and key.
    pub fn from_file(path: &Path) -> Result<Self, ZooError> {
        let err = |message: String| ZooError::Config { path: path.to_path_buf(), message };
        let text = std::fs::read_to_string(path)
            .map_err(|e| ZooError::File { path: path.to_path_buf(), message: e.to_string() })?;
        let value: serde_json::Value = serde_json::from_str(&text).map_err(|e| err(format!("not JSON: {e}")))?;
        let map = value.as_object().ok_or_else(|| err("not a JSON object".into()))?;
        const USED: &[&str] = &[
            "vocab_size",
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "intermediate_size",
            "max_position_embeddings",
            "type_vocab_size",
            "layer_norm_eps",
            "hidden_act",
            "position_embedding_type",
            "pad_token_id",
        ];
        for key in map.keys() {
            if !USED.contains(&key.as_str()) && !IGNORED_KEYS.contains(&key.as_str()) {
                return Err(err(format!("unknown key `{key}`")));
            }
        }
        if let Some(act) = map.get("hidden_act").and_then(|v| v.as_str()).filter(|a| *a != "gelu") {
            return Err(err(format!("hidden_act `{act}` is not supported (only `gelu`)")));
        }
        if let Some(p) = map.get("position_embedding_type").and_then(|v| v.as_str()).filter(|p| *p != "absolute") {
            return Err(err(format!("position_embedding_type `{p}` is not supported (only `absolute`)")));
        }
        let config: BertConfig = serde_json::from_value(value.clone()).map_err(|e| err(e.to_string()))?;
        config.check().map_err(|e| err(e.to_string()))?;
        Ok(config)
    }

    /// Whether the heads divide the width and the padding id lies in the vocabulary.
    pub(crate) fn check(&self) -> Result<(), NnError> {
        let invalid = |message: String| Err(NnError::Invalid { what: "BertConfig".into(), message });
        if self.num_attention_heads == 0 || !self.hidden_size.is_multiple_of(self.num_attention_heads) {
            return invalid(format!(
                "hidden_size {} is not divisible by num_attention_heads {}",
                self.hidden_size, self.num_attention_heads
            ));
        }
        if let Some(pad) = self.pad_token_id.filter(|p| *p as usize >= self.vocab_size) {
            return invalid(format!("pad_token_id {pad} is outside the vocabulary of {}", self.vocab_size));
        }
        Ok(())
    }
}

/// A BERT encoder with trainable parameters.
pub struct Bert {
    /// Architecture.
    pub config: BertConfig,
    /// Every parameter, by its Hugging Face name (without a `bert.` prefix).
    pub params: Params,
    dtype: DType,
}

/// Layer-norm parameters stay f32 in a low-precision model (see
/// the autocast policy).
fn param_dtype(name: &str, dtype: DType) -> DType {
    if name.contains("LayerNorm") {
        wick_nn::autocast::norm_param_dtype(dtype)
    } else {
        dtype
    }
}

/// One post-norm encoder layer; `w` holds the parameters in [`layer_shapes`] order.
fn encoder_layer(x: &Tensor, w: &[Tensor], bias: &Tensor, heads: usize, eps: f64) -> candle_core::Result<Tensor> {
    // Q, K and V as one projection: the hidden states feed one op instead of three, so backward
    // sums no three gradients for them, and attention reads the packed result in place.
    let qkv = ops::linear_stacked(x, &[&w[0], &w[2], &w[4]], Some(&[&w[1], &w[3], &w[5]]))?;
    let ctx = ops::attention_packed(&qkv, heads, Some(bias))?;
    let x = ops::linear_add_layer_norm(&ctx, (&w[6], &w[7]), x, (&w[8], &w[9]), eps)?;
    let inter = ops::linear_gelu(&x, &w[10], &w[11])?;
    ops::linear_add_layer_norm(&inter, (&w[12], &w[13]), &x, (&w[14], &w[15]), eps)
}

/// (name suffix, shape) of every parameter of one encoder layer.
fn layer_shapes(c: &BertConfig) -> Vec<(&'static str, Vec<usize>, Init)> {
    let (h, i) = (c.hidden_size, c.intermediate_size);
    let w = Init::Normal(0.02);
    vec![
        ("attention.self.query.weight", vec![h, h], w),
        ("attention.self.query.bias", vec![h], Init::Zeros),
        ("attention.self.key.weight", vec![h, h], w),
        ("attention.self.key.bias", vec![h], Init::Zeros),
        ("attention.self.value.weight", vec![h, h], w),
        ("attention.self.value.bias", vec![h], Init::Zeros),
        ("attention.output.dense.weight", vec![h, h], w),
        ("attention.output.dense.bias", vec![h], Init::Zeros),
        ("attention.output.LayerNorm.weight", vec![h], Init::Ones),
        ("attention.output.LayerNorm.bias", vec![h], Init::Zeros),
        ("intermediate.dense.weight", vec![i, h], w),
        ("intermediate.dense.bias", vec![i], Init::Zeros),
        ("output.dense.weight", vec![h, i], w),
        ("output.dense.bias", vec![h], Init::Zeros),
        ("output.LayerNorm.weight", vec![h], Init::Ones),
        ("output.LayerNorm.bias", vec![h], Init::Zeros),
    ]
}

fn all_shapes(c: &BertConfig) -> Vec<(String, Vec<usize>, Init)> {
    let h = c.hidden_size;
    let mut out = vec![
        ("embeddings.word_embeddings.weight".to_string(), vec![c.vocab_size, h], Init::Normal(0.02)),
        ("embeddings.position_embeddings.weight".to_string(), vec![c.max_position_embeddings, h], Init::Normal(0.02)),
        ("embeddings.token_type_embeddings.weight".to_string(), vec![c.type_vocab_size, h], Init::Normal(0.02)),
        ("embeddings.LayerNorm.weight".to_string(), vec![h], Init::Ones),
        ("embeddings.LayerNorm.bias".to_string(), vec![h], Init::Zeros),
    ];
    for l in 0..c.num_hidden_layers {
        for (suffix, shape, init) in layer_shapes(c) {
            out.push((format!("encoder.layer.{l}.{suffix}"), shape, init));
        }
    }
    out
}

impl Bert {
    /// A freshly initialised model (normal(0, 0.02) weights, as BERT's initialiser).
    pub fn new(config: BertConfig, dtype: DType, device: &Device) -> Result<Self, NnError> {
        config.check()?;
        wick_nn::params::preflight_parameters(config.parameter_count(), dtype, device, "BERT")?;
        let mut params = Params::default();
        for (name, shape, init) in all_shapes(&config) {
            params.create(&name, &shape, init, param_dtype(&name, dtype), device)?;
        }
        if let Some(pad) = config.pad_token_id {
            let vocab = config.vocab_size;
            // Hugging Face initialises the padding row to zeros.
            let table = params
                .get("embeddings.word_embeddings.weight")
                .ok_or_else(|| NnError::Invalid { what: "BertConfig".into(), message: "no word embeddings".into() })?;
            let keep: Vec<f32> = (0..vocab).map(|i| if i == pad as usize { 0.0 } else { 1.0 }).collect();
            let keep = Tensor::from_vec(keep, (vocab, 1), device)?.to_dtype(table.dtype())?;
            table.set(&table.as_tensor().broadcast_mul(&keep)?)?;
        }
        Ok(Bert { config, params, dtype })
    }

    /// Loads every encoder tensor from `weights` (shapes checked; the pooler is not used).
    pub fn load(config: BertConfig, weights: &WeightFile, dtype: DType) -> Result<Self, ZooError> {
        // The configuration's sizes are checked against the file before anything is built from
        // them: a layer count the file cannot hold is an error, not millions of names.
        let expected = config.num_hidden_layers.checked_mul(layer_shapes(&config).len()).and_then(|n| n.checked_add(5));
        if expected.is_none_or(|n| n > weights.len()) {
            return Err(ZooError::File {
                path: weights.path().to_path_buf(),
                message: format!(
                    "the configuration's {} layers need {} tensors; the file has {}",
                    config.num_hidden_layers,
                    expected.map_or("more than usize::MAX".to_string(), |n| n.to_string()),
                    weights.len()
                ),
            });
        }
        let mut params = Params::default();
        for (name, shape, _) in all_shapes(&config) {
            params.insert(&name, weights.get(&name, &shape, param_dtype(&name, dtype))?)?;
        }
        Ok(Bert { config, params, dtype })
    }

    fn p(&self, name: &str) -> Result<Tensor, NnError> {
        self.params.tensor(name)
    }

    fn norm(&self, x: &Tensor, prefix: &str) -> Result<Tensor, NnError> {
        let (w, b) = (self.p(&format!("{prefix}.weight"))?, self.p(&format!("{prefix}.bias"))?);
        Ok(ops::layer_norm(x, &w, &b, self.config.layer_norm_eps)?)
    }

    /// Hidden states (batch, seq, hidden) for `input_ids` (batch, seq) and `attention_mask`
    /// (batch, seq; 1 for tokens, 0 for padding).
    pub fn forward(&self, input_ids: &Tensor, attention_mask: &Tensor) -> Result<Tensor, NnError> {
        self.forward_with(input_ids, attention_mask, None)
    }

    /// As [`Bert::forward`], with each encoder layer checkpointed when `checkpoint` is given.
    pub fn forward_with(
        &self,
        input_ids: &Tensor,
        attention_mask: &Tensor,
        checkpoint: Option<&Checkpointing>,
    ) -> Result<Tensor, NnError> {
        let c = &self.config;
        let (batch, seq) = input_ids.dims2()?;
        if seq > c.max_position_embeddings {
            return Err(NnError::Invalid {
                what: "input".into(),
                message: format!(
                    "sequence of {seq} tokens exceeds max_position_embeddings {}",
                    c.max_position_embeddings
                ),
            });
        }
        let embed = push_label("embeddings");
        let table = self.p("embeddings.word_embeddings.weight")?;
        let words = ops::embedding_with_padding(&table, &input_ids.flatten_all()?, c.pad_token_id)?;
        let positions = self.p("embeddings.position_embeddings.weight")?.narrow(0, 0, seq)?;
        let types = self.p("embeddings.token_type_embeddings.weight")?.narrow(0, 0, 1)?;
        let x = ops::add_broadcast(&words.reshape((batch, seq, c.hidden_size))?, &positions, &types)?;
        let mut x = self.norm(&x, "embeddings.LayerNorm")?;
        // Additive mask: 0 for tokens, -1e4 for padding (finite, so no NaN in low precision).
        let bias = ((attention_mask.to_dtype(self.dtype)?.ones_like()? - attention_mask.to_dtype(self.dtype)?)?
            * -1e4)?
            .reshape((batch, 1, 1, seq))?;
        drop(embed);
        let names: Vec<&str> = layer_shapes(c).into_iter().map(|(n, _, _)| n).collect();
        let heads = c.num_attention_heads;
        let eps = c.layer_norm_eps;
        for l in 0..c.num_hidden_layers {
            let _layer = push_label(&format!("encoder.layer.{l}"));
            let weights: Vec<Tensor> =
                names.iter().map(|n| self.p(&format!("encoder.layer.{l}.{n}"))).collect::<Result<_, _>>()?;
            x = match checkpoint {
                Some(ckpt) => {
                    let bias = bias.clone();
                    ckpt.segment(&x, weights, move |x, w| encoder_layer(x, w, &bias, heads, eps))?
                }
                None => encoder_layer(&x, &weights, &bias, heads, eps)?,
            };
        }
        Ok(x)
    }

    /// Mean of the token states under the mask (sentence-transformers' mean pooling), reduced
    /// in f32 (an f32-class op under autocast); the result is f32 (f64 for f64 states).
    pub fn mean_pool(hidden: &Tensor, attention_mask: &Tensor) -> Result<Tensor, NnError> {
        let hidden = hidden.to_dtype(wick_nn::autocast::fp32_compute(hidden.dtype()))?;
        let mask = attention_mask.to_dtype(hidden.dtype())?.unsqueeze(D::Minus1)?;
        let summed = hidden.broadcast_mul(&mask)?.sum(1)?;
        Ok(summed.broadcast_div(&mask.sum(1)?.clamp(1e-9, f64::MAX)?)?)
    }

    /// L2 normalisation of each row.
    pub fn normalize(x: &Tensor) -> Result<Tensor, NnError> {
        Ok(x.broadcast_div(&x.sqr()?.sum_keepdim(D::Minus1)?.sqrt()?.clamp(1e-12, f64::MAX)?)?)
    }
}

/// Sentences to classify: token ids with their attention mask, whose hidden states are
/// mean-pooled over the tokens (as sentence-transformers pools MiniLM) and mapped to class
/// logits by a fixed readout that is not trained.
#[derive(Debug, Clone)]
pub struct SentenceBatch {
    /// Token ids (batch, seq), u32.
    pub ids: Tensor,
    /// Attention mask (batch, seq), u32: 1 for tokens, 0 for padding.
    pub mask: Tensor,
    /// The readout (hidden, classes), f32.
    pub readout: Tensor,
    /// Class indices (batch), u32.
    pub labels: Tensor,
}

/// Trained on sentence classification ([`SentenceBatch`]): cross-entropy of the readout of the
/// mean-pooled hidden states against the labels.
impl Model for Bert {
    type Batch = SentenceBatch;

    fn params(&self) -> &Params {
        &self.params
    }

    fn loss_with(&self, batch: &SentenceBatch, checkpoint: Option<&Checkpointing>) -> Result<Tensor, NnError> {
        let hidden = self.forward_with(&batch.ids, &batch.mask, checkpoint)?;
        let pooled = Bert::mean_pool(&hidden, &batch.mask)?;
        Ok(ops::cross_entropy(&pooled.matmul(&batch.readout)?, &batch.labels)?)
    }

    wick_nn::tensor_batches!();
}

/// Ids, mask, readout, labels.
impl wick_nn::TensorBatch for SentenceBatch {
    fn tensors(&self) -> Vec<Tensor> {
        vec![self.ids.clone(), self.mask.clone(), self.readout.clone(), self.labels.clone()]
    }

    fn with_tensors(&self, tensors: &[Tensor]) -> Result<Self, NnError> {
        let [ids, mask, readout, labels] = wick_nn::model::exactly::<4>(tensors)?;
        Ok(SentenceBatch { ids: ids.clone(), mask: mask.clone(), readout: readout.clone(), labels: labels.clone() })
    }
}

/// The longest padded sequence a tokenizer file may ask for (no model's context is longer).
pub const MAX_TOKENS: usize = 1 << 20;

/// Reads a Hugging Face `tokenizer.json`. Errors name the file; a panic inside the tokenizers
/// crate's parser (0.23.2 `expect`s while deserialising a malformed `decoder`, found by wick's
/// fuzz suite) is caught and reported as an error too, so a bad file cannot kill a notebook.
pub fn load_tokenizer(path: &Path) -> Result<tokenizers::Tokenizer, ZooError> {
    let fail = |message: String| ZooError::File { path: path.to_path_buf(), message };
    let bytes = std::fs::read(path).map_err(|e| fail(e.to_string()))?;
    let tokenizer = match std::panic::catch_unwind(|| tokenizers::Tokenizer::from_bytes(&bytes)) {
        Ok(Ok(tokenizer)) => tokenizer,
        Ok(Err(e)) => return Err(fail(format!("not a tokenizer: {e}"))),
        Err(panic) => {
            return Err(fail(format!("not a tokenizer (the tokenizers crate panicked: {})", panic_text(&*panic))))
        }
    };
    // Fixed padding makes every encoding that long: a crafted length (2³² tokens) is a 16 GiB
    // allocation, which aborts. Refuse lengths no model has before anything is encoded.
    if let Some(padding) = tokenizer.get_padding() {
        let fixed = match padding.strategy {
            tokenizers::PaddingStrategy::Fixed(n) => n,
            tokenizers::PaddingStrategy::BatchLongest => 0,
        };
        let longest = fixed.max(padding.pad_to_multiple_of.unwrap_or(0));
        if longest > MAX_TOKENS {
            return Err(fail(format!("padding to {longest} tokens (more than {MAX_TOKENS}) is not a real setting")));
        }
    }
    // A file can parse and still panic on every input (a template naming a special token the
    // file does not define indexes a map that lacks it): probe it once here.
    encode(&tokenizer, "wick probe").map_err(|e| fail(format!("the tokenizer fails on a probe input: {e}")))?;
    Ok(tokenizer)
}

/// `tokenizer.encode(text, true)`, with a panic inside the tokenizers crate as an error.
fn encode(tokenizer: &tokenizers::Tokenizer, text: &str) -> Result<tokenizers::Encoding, ZooError> {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| tokenizer.encode(text, true))) {
        Ok(Ok(encoding)) => Ok(encoding),
        Ok(Err(e)) => Err(ZooError::Tokenizer(e.to_string())),
        Err(panic) => Err(ZooError::Tokenizer(format!("the tokenizers crate panicked: {}", panic_text(&*panic)))),
    }
}

fn panic_text(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_else(|| "unknown".into())
}

/// `max_seq_length` of `sentence_bert_config.json` in `dir` (`None` without that file), checked
/// against the model's position table.
fn max_seq_length(dir: &Path, config: &BertConfig) -> Result<Option<usize>, ZooError> {
    let path = dir.join("sentence_bert_config.json");
    if !path.is_file() {
        return Ok(None);
    }
    let err = |message: String| ZooError::Config { path: path.clone(), message };
    let text = std::fs::read_to_string(&path).map_err(|e| err(e.to_string()))?;
    let value: serde_json::Value = serde_json::from_str(&text).map_err(|e| err(format!("not JSON: {e}")))?;
    let Some(len) = value.get("max_seq_length") else { return Ok(None) };
    let len = len.as_u64().and_then(|l| usize::try_from(l).ok()).ok_or_else(|| err(format!("max_seq_length {len}")))?;
    if len == 0 || len > config.max_position_embeddings {
        return Err(err(format!(
            "max_seq_length {len} is outside 1..={} (max_position_embeddings)",
            config.max_position_embeddings
        )));
    }
    Ok(Some(len))
}

/// all-MiniLM-L6-v2 style sentence embeddings: tokenizer + BERT + mean pooling + normalisation.
pub struct SentenceEmbedder {
    /// The encoder.
    pub bert: Bert,
    tokenizer: tokenizers::Tokenizer,
}

impl SentenceEmbedder {
    /// Loads `config.json`, `model.safetensors` and `tokenizer.json` from `dir`.
    pub fn load(dir: &Path, dtype: DType, device: &Device) -> Result<Self, ZooError> {
        let config = BertConfig::from_file(&dir.join("config.json"))?;
        let weights = WeightFile::open(&dir.join("model.safetensors"), device)?;
        let bert = Bert::load(config, &weights, dtype)?;
        let tokenizer_path = dir.join("tokenizer.json");
        let mut tokenizer = load_tokenizer(&tokenizer_path)?;
        // The shipped tokenizer pads every input to 128 tokens; `embed` pads a batch itself.
        tokenizer.with_padding(None);
        // sentence-transformers truncates at the model's `max_seq_length`, not at the tokenizer
        // file's own setting (128 for all-MiniLM-L6-v2, whose model uses 256).
        let max_len = max_seq_length(dir, &bert.config)?;
        if let Some(max_len) = max_len {
            let mut truncation = tokenizer.get_truncation().cloned().unwrap_or_default();
            truncation.max_length = max_len;
            tokenizer
                .with_truncation(Some(truncation))
                .map_err(|e| ZooError::File { path: tokenizer_path.clone(), message: format!("truncation: {e}") })?;
        }
        Ok(SentenceEmbedder { bert, tokenizer })
    }

    /// Token ids of `text` (with `[CLS]`/`[SEP]`).
    pub fn token_ids(&self, text: &str) -> Result<Vec<u32>, ZooError> {
        let enc = encode(&self.tokenizer, text)?;
        Ok(enc.get_ids().to_vec())
    }

    /// Normalised embeddings (batch, hidden) of `texts`, padded to the longest; computed under
    /// [`wick_nn::no_grad`] (inference: no graph, nothing kept for a backward pass).
    pub fn embed(&self, texts: &[&str]) -> Result<Tensor, ZooError> {
        wick_nn::no_grad(|| self.embed_with_graph(texts))
    }

    fn embed_with_graph(&self, texts: &[&str]) -> Result<Tensor, ZooError> {
        let device = self.bert.params.iter().next().map(|(_, v)| v.device().clone()).unwrap_or(Device::Cpu);
        let ids: Vec<Vec<u32>> = texts.iter().map(|t| self.token_ids(t)).collect::<Result<_, _>>()?;
        let len = ids.iter().map(|i| i.len()).max().unwrap_or(0);
        let mut flat = Vec::with_capacity(ids.len() * len);
        let mut mask = Vec::with_capacity(ids.len() * len);
        for row in &ids {
            for j in 0..len {
                flat.push(row.get(j).copied().unwrap_or(0));
                mask.push(u32::from(j < row.len()));
            }
        }
        let input = Tensor::from_vec(flat, (ids.len(), len), &device)?;
        let mask = Tensor::from_vec(mask, (ids.len(), len), &device)?;
        let hidden = self.bert.forward(&input, &mask)?;
        Ok(Bert::normalize(&Bert::mean_pool(&hidden, &mask)?)?)
    }
}
