//! The zoo's benchmark configurations, for `zoo-speed` and (through `zoo-speed --list`, which
//! prints them as JSON) `scripts/torch-reference/zoo_speed.py`, so that both sides build the same
//! shapes: each model's architecture, its inputs' sizes ([`Sizes`]) and its optimizer, with any
//! field of its configuration changed by `--set KEY=VALUE` ([`parse_set`], [`configs`]) — the
//! width, depth, heads or vocabulary of a transformer, the width of a CNN — and the model built
//! from that one description ([`spec`]).

use anyhow::{bail, Context, Result};
use serde_json::{json, Value};
use wick_train::optim::{AdamW, Optimizer};
use wick_zoo::bert::BertConfig;
use wick_zoo::llama::LlamaConfig;
use wick_zoo::registry::ModelSpec;
use wick_zoo::resnet::ResNetDepth;
use wick_zoo::vit::VitConfig;

use crate::DECODER;

/// The inputs' sizes: side of the square images, and inputs per batch and tokens per sequence
/// where given (each model's default otherwise).
#[derive(Clone, Copy, Debug)]
pub struct Sizes {
    /// Side of the vision models' square images.
    pub image: usize,
    /// Images or sequences per batch ([`IMAGES`] / [`SEQUENCES`] when not given).
    pub batch: Option<usize>,
    /// Tokens per sequence (each text model's own default when not given).
    pub seq: Option<usize>,
}

impl Sizes {
    /// Images per batch.
    pub fn images(&self) -> usize {
        self.batch.unwrap_or(IMAGES)
    }

    /// Sequences per batch.
    pub fn sequences(&self) -> usize {
        self.batch.unwrap_or(SEQUENCES)
    }
}

/// ViT-S/16 (DeiT-S's shapes) on `image`² images.
fn vit_s16(image: usize) -> VitConfig {
    VitConfig { image_size: image, patch_size: 16, hidden: 384, layers: 12, heads: 6, mlp_dim: 1536, num_classes: 10 }
}

/// ViT-B/16 (torchvision's shapes) on `image`² images.
fn vit_b16(image: usize) -> VitConfig {
    VitConfig { image_size: image, patch_size: 16, hidden: 768, layers: 12, heads: 12, mlp_dim: 3072, num_classes: 10 }
}

/// A 512 × 8 LLaMA-style decoder on a 32 000-token vocabulary (LLaMA's), SwiGLU at 1 408
/// (2.75 × the width, a multiple of 64): a small language model's shapes, where the output
/// layer is a third of the parameters and of a prefill's products.
const DECODER_512: LlamaConfig = LlamaConfig {
    vocab_size: 32_000,
    hidden_size: 512,
    num_layers: 8,
    num_heads: 8,
    intermediate_size: 1408,
    max_seq: 256,
    rms_eps: 1e-6,
    rope_theta: 10_000.0,
};

/// Classes of the vision models' labels.
const CLASSES: usize = 10;
/// Images per batch unless given.
pub const IMAGES: usize = 16;
/// Sequences per batch unless given.
pub const SEQUENCES: usize = 8;

/// The text models: name, configuration (as JSON: its kind and `config`) and default tokens.
fn text_models() -> [(&'static str, Value, usize); 4] {
    let llama = |c: LlamaConfig| json!({"kind": "llama", "config": c, "optimizer": "adamw"});
    let bert = |c: BertConfig| json!({"kind": "bert", "config": c, "optimizer": "adamw"});
    [
        ("decoder", llama(DECODER), 64),
        ("decoder-512", llama(DECODER_512), 256),
        ("bert", bert(BertConfig::minilm_l6()), 128),
        ("bert-base", bert(BertConfig::base()), 128),
    ]
}

/// Fields that follow the inputs' sizes (`--image`, `--seq`) and so cannot be set.
const FOLLOW_SIZES: [(&str, &str); 2] = [("image_size", "--image"), ("max_seq", "--seq")];

/// One `--set KEY=VALUE`: the value read as JSON (`768`, `1e-5`, `true`), else taken as a string.
pub fn parse_set(arg: &str) -> Result<(String, Value), String> {
    let (key, value) = arg.split_once('=').ok_or_else(|| format!("`{arg}` is not KEY=VALUE"))?;
    let key = key.trim();
    if key.is_empty() {
        return Err(format!("`{arg}` names no field"));
    }
    let value = serde_json::from_str(value.trim()).unwrap_or_else(|_| Value::String(value.trim().to_string()));
    Ok((key.to_string(), value))
}

/// Adds `extra`'s fields to the object `v`.
fn extend(mut v: Value, extra: Value) -> Value {
    if let (Some(v), Some(extra)) = (v.as_object_mut(), extra.as_object()) {
        v.extend(extra.clone());
    }
    v
}

/// Every benchmark configuration at `sizes`, as the PyTorch script reads them, with `sets`
/// applied to `model`'s: a field of its `config` (the transformers'), or its `width` (ResNet) or
/// `width_mult` (MobileNetV2). A field the model does not have, one that follows the sizes, a
/// value of the wrong type or `sets` without a model are errors; the result is checked by
/// building its [`spec`].
pub fn configs(sizes: Sizes, model: Option<&str>, sets: &[(String, Value)]) -> Result<Value> {
    let vision = |extra: Value| {
        let v = json!({"batch": sizes.images(), "image": sizes.image, "classes": CLASSES, "optimizer": "sgd"});
        extend(v, extra)
    };
    let mut all = json!({
        "vit": vision(json!({"kind": "vit", "config": vit_s16(sizes.image), "optimizer": "adamw"})),
        "vit-b16": vision(json!({"kind": "vit", "config": vit_b16(sizes.image), "optimizer": "adamw"})),
        "resnet18": vision(json!({"kind": "resnet", "depth": 18, "width": 64})),
        "resnet50": vision(json!({"kind": "resnet", "depth": 50, "width": 64})),
        "mobilenet_v2": vision(json!({"kind": "mobilenet_v2", "width_mult": 1.0})),
    });
    for (name, json, tokens) in text_models() {
        all[name] = extend(json, json!({"batch": sizes.sequences(), "seq": sizes.seq.unwrap_or(tokens)}));
    }
    if sets.is_empty() {
        return Ok(all);
    }
    let Some(model) = model else { bail!("--set changes one model's configuration: name it with --model") };
    let Some(entry) = all.get_mut(model) else { bail!("unknown model `{model}`; --list shows the configurations") };
    for (key, value) in sets {
        set_field(entry, model, key, value)?;
    }
    let changed: Vec<String> = sets.iter().map(|(k, v)| format!("{k} = {v}")).collect();
    spec(model, entry).with_context(|| format!("{model} with {}", changed.join(", ")))?;
    Ok(all)
}

/// Sets `key` of one model's configuration `entry` to `value` (see [`configs`]).
fn set_field(entry: &mut Value, model: &str, key: &str, value: &Value) -> Result<()> {
    if let Some((_, flag)) = FOLLOW_SIZES.iter().find(|(k, _)| *k == key) {
        bail!("{model}: `{key}` follows the inputs' sizes; give {flag} instead");
    }
    // The transformers' fields are those of their `config`; the CNNs have one each.
    let slot = match entry.get_mut("config") {
        Some(config) => config.get_mut(key),
        None if ["width", "width_mult"].contains(&key) => entry.get_mut(key),
        None => None,
    };
    let Some(slot) = slot else { bail!("{model} has no configuration field `{key}`; --list shows them") };
    *slot = value.clone();
    Ok(())
}

/// The JSON field `key` of `entry` as `T`.
fn field<T: serde::de::DeserializeOwned>(entry: &Value, key: &str) -> Result<T> {
    let v = entry.get(key).with_context(|| format!("no `{key}`"))?;
    serde_json::from_value(v.clone()).with_context(|| format!("`{key}` = {v}"))
}

/// The model one configuration of [`configs`] describes, checked, and its optimizer (AdamW for
/// the transformers, SGD with momentum for the CNNs, as PyTorch's side builds them). A decoder
/// trains on its tokens + 1 ids (next-token prediction of `seq` tokens; the one more position
/// changes only the length of the rotary tables).
pub fn spec(name: &str, entry: &Value) -> Result<(ModelSpec, Optimizer)> {
    let kind: String = field(entry, "kind")?;
    let spec = match kind.as_str() {
        "llama" => {
            let seq = field::<usize>(entry, "seq")? + 1;
            let config: LlamaConfig = field(entry, "config")?;
            ModelSpec::Llama { config: LlamaConfig { max_seq: seq, ..config }, seq }
        }
        "bert" => ModelSpec::Bert { config: field(entry, "config")?, seq: field(entry, "seq")? },
        "vit" => ModelSpec::Vit(field(entry, "config")?),
        "resnet" => {
            let depth = match field::<usize>(entry, "depth")? {
                18 => ResNetDepth::R18,
                34 => ResNetDepth::R34,
                50 => ResNetDepth::R50,
                other => bail!("{name}: no ResNet of depth {other}"),
            };
            ModelSpec::ResNet {
                depth,
                classes: field(entry, "classes")?,
                width: field(entry, "width")?,
                image: field(entry, "image")?,
            }
        }
        "mobilenet_v2" => ModelSpec::MobileNetV2 {
            classes: field(entry, "classes")?,
            width_mult: field(entry, "width_mult")?,
            image: field(entry, "image")?,
        },
        other => bail!("{name}: no model of kind `{other}`"),
    };
    spec.check()?;
    let optimizer = match field::<String>(entry, "optimizer")?.as_str() {
        "adamw" => Optimizer::AdamW(AdamW { lr: 1e-4, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.01 }),
        "sgd" => Optimizer::SgdMomentum { lr: 0.01, momentum: 0.9 },
        other => bail!("{name}: no optimizer `{other}`"),
    };
    Ok((spec, optimizer))
}

#[cfg(test)]
mod tests {
    use super::*;

    const SIZES: Sizes = Sizes { image: 224, batch: None, seq: None };

    fn set(arg: &str) -> (String, Value) {
        parse_set(arg).unwrap()
    }

    /// The GPU decoder (12 × 768 at 512 tokens) from `decoder-512` by `--set`: the JSON
    /// PyTorch's side reads carries the change, the spec built from it has those shapes (its
    /// parameter count is the closed form's), and the other models are untouched.
    #[test]
    fn sets_change_one_model_and_its_spec() {
        let sizes = Sizes { seq: Some(512), ..SIZES };
        let sets = [set("hidden_size=768"), set("num_layers=12"), set("num_heads=12"), set("intermediate_size=2048")];
        let all = configs(sizes, Some("decoder-512"), &sets).unwrap();
        assert_eq!(all["decoder-512"]["config"]["hidden_size"], 768);
        assert_eq!(all["decoder-512"]["config"]["num_layers"], 12);
        assert_eq!(all["decoder-512"]["seq"], 512);
        assert_eq!(all["decoder"], configs(sizes, None, &[]).unwrap()["decoder"]);
        let (built, optimizer) = spec("decoder-512", &all["decoder-512"]).unwrap();
        let ModelSpec::Llama { config, seq } = built else { panic!("{built:?}") };
        assert_eq!(
            (config.hidden_size, config.num_layers, config.num_heads, seq, config.max_seq),
            (768, 12, 12, 513, 513)
        );
        // Embedding and head 2·32 000·768, a final norm, 12 layers of 4·768² + 3·2 048·768 + 2·768.
        let layer = 4 * 768 * 768 + 3 * 2048 * 768 + 2 * 768;
        assert_eq!(config.parameter_count(), Some(2 * 32_000 * 768 + 768 + 12 * layer));
        assert!(matches!(optimizer, Optimizer::AdamW(_)));
        // A CNN's width; BERT's and ViT's fields by their own names.
        let all = configs(SIZES, Some("resnet18"), &[set("width=32")]).unwrap();
        let (built, _) = spec("resnet18", &all["resnet18"]).unwrap();
        assert!(matches!(built, ModelSpec::ResNet { width: 32, image: 224, .. }), "{built:?}");
        let all = configs(SIZES, Some("vit"), &[set("layers=2")]).unwrap();
        assert!(matches!(
            spec("vit", &all["vit"]).unwrap().0,
            ModelSpec::Vit(VitConfig { layers: 2, hidden: 384, .. })
        ));
        let all = configs(SIZES, Some("bert"), &[set("num_hidden_layers=3")]).unwrap();
        let ModelSpec::Bert { config, seq: 128 } = spec("bert", &all["bert"]).unwrap().0 else { panic!() };
        assert_eq!(config.num_hidden_layers, 3);
    }

    /// Without `--set` every configuration builds its spec, with the defaults' shapes.
    #[test]
    fn every_default_configuration_is_a_spec() {
        let all = configs(SIZES, None, &[]).unwrap();
        let names: Vec<&String> = all.as_object().unwrap().keys().collect();
        assert_eq!(names.len(), 9, "{names:?}");
        for name in names {
            spec(name, &all[name]).unwrap_or_else(|e| panic!("{name}: {e:#}"));
        }
        let ModelSpec::Llama { config, seq } = spec("decoder-512", &all["decoder-512"]).unwrap().0 else { panic!() };
        assert_eq!((config, seq), (LlamaConfig { max_seq: 257, ..DECODER_512 }, 257));
    }

    /// What cannot be set is refused with the reason, and nothing is half-changed: no model, an
    /// unknown model or field, a field that follows the sizes, a CNN's other fields, a value of
    /// the wrong type, a size of 0, heads that do not divide the width; `KEY=VALUE` itself.
    #[test]
    fn bad_sets_are_errors() {
        let fails = |model: Option<&str>, arg: &str, says: &str| {
            let e = format!("{:#}", configs(SIZES, model, &[set(arg)]).unwrap_err());
            assert!(e.contains(says), "{model:?} {arg}: {e}");
        };
        fails(None, "hidden_size=768", "name it with --model");
        fails(Some("gpt5"), "hidden_size=768", "unknown model `gpt5`");
        fails(Some("decoder"), "hidden=768", "no configuration field `hidden`");
        fails(Some("decoder"), "max_seq=9", "give --seq");
        fails(Some("vit"), "image_size=64", "give --image");
        fails(Some("resnet18"), "depth=34", "no configuration field `depth`");
        fails(Some("resnet18"), "batch=3", "no configuration field `batch`");
        fails(Some("decoder"), "hidden_size=abc", "hidden_size = \"abc\"");
        fails(Some("decoder"), "hidden_size=-3", "hidden_size = -3");
        fails(Some("decoder"), "vocab_size=0", "`vocab_size` is 0");
        fails(Some("bert"), "num_attention_heads=5", "not divisible");
        fails(Some("mobilenet_v2"), "width_mult=0", "width multiplier");
        assert_eq!(set("rms_eps=1e-5"), ("rms_eps".into(), json!(1e-5)));
        assert_eq!(set(" name = x "), ("name".into(), json!("x")));
        assert!(parse_set("hidden_size").is_err() && parse_set("=3").is_err());
    }
}
