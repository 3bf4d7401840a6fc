//! Model configurations that ask for more than the machine has (a typo'd layer count, a huge
//! vocabulary, sizes whose product overflows) are refused before anything is allocated — they
//! aborted the process before — and each model's parameter count formula, used for that
//! pre-flight, matches the parameters its constructor really creates.

mod common;

use candle_core::{DType, Device};
use wick::memory::MemoryError;
use wick_nn::NnError;
use wick_zoo::bert::{Bert, BertConfig, SentenceEmbedder};
use wick_zoo::llama::{Llama, LlamaConfig};
use wick_zoo::vit::{Vit, VitConfig};
use wick_zoo::ZooError;

fn bert_config() -> BertConfig {
    BertConfig {
        vocab_size: 50,
        hidden_size: 16,
        num_hidden_layers: 2,
        num_attention_heads: 2,
        intermediate_size: 24,
        max_position_embeddings: 12,
        type_vocab_size: 2,
        layer_norm_eps: 1e-12,
        pad_token_id: Some(0),
    }
}

fn vit_config() -> VitConfig {
    VitConfig { image_size: 16, patch_size: 4, hidden: 8, layers: 2, heads: 2, mlp_dim: 12, num_classes: 3 }
}

#[test]
fn parameter_counts_match_the_models_built() {
    let cpu = Device::Cpu;
    let bert = Bert::new(bert_config(), DType::F32, &cpu).unwrap();
    assert_eq!(bert_config().parameter_count(), Some(bert.params.numel()));
    let llama = Llama::new(LlamaConfig::tiny(40), DType::F32, &cpu).unwrap();
    assert_eq!(LlamaConfig::tiny(40).parameter_count(), Some(llama.params.numel()));
    let vit = Vit::new(vit_config(), DType::F32, &cpu).unwrap();
    assert_eq!(vit_config().parameter_count(), Some(vit.params.numel()));
}

/// The error must be out-of-memory from pre-flight (or a size that cannot be represented).
fn refused(result: Result<impl Sized, NnError>) {
    match result {
        Err(NnError::Memory(MemoryError::OutOfMemory(oom))) => {
            assert!(oom.device.contains("parameters"), "{}", oom.device)
        }
        Err(NnError::Memory(MemoryError::TooLarge { .. })) => {}
        Err(other) => panic!("expected a pre-flight refusal, got: {other}"),
        Ok(_) => panic!("an impossible model was built"),
    }
}

#[test]
fn impossible_configurations_are_refused_before_allocating() {
    let cpu = Device::Cpu;
    refused(Bert::new(BertConfig { num_hidden_layers: 100_000_000, ..bert_config() }, DType::F32, &cpu));
    refused(Bert::new(BertConfig { vocab_size: 1 << 40, ..bert_config() }, DType::F32, &cpu));
    refused(Bert::new(BertConfig { hidden_size: 1 << 40, num_attention_heads: 1, ..bert_config() }, DType::F32, &cpu));
    refused(Llama::new(LlamaConfig { num_layers: 100_000_000, ..LlamaConfig::tiny(40) }, DType::F32, &cpu));
    refused(Llama::new(LlamaConfig { vocab_size: usize::MAX / 2, ..LlamaConfig::tiny(40) }, DType::F32, &cpu));
    refused(Vit::new(VitConfig { layers: 100_000_000, ..vit_config() }, DType::F32, &cpu));
    refused(Vit::new(VitConfig { num_classes: 1 << 50, ..vit_config() }, DType::F32, &cpu));
    // A zero patch size divided by zero.
    assert!(matches!(
        Vit::new(VitConfig { patch_size: 0, ..vit_config() }, DType::F32, &cpu),
        Err(NnError::Invalid { .. })
    ));
}

#[test]
fn a_config_with_more_layers_than_its_weights_is_an_error_naming_the_file() {
    let Some(dir) = common::minilm_dir() else { return };
    let tmp = std::env::temp_dir().join(format!("wick-configs-{}", std::process::id()));
    std::fs::create_dir_all(&tmp).unwrap();
    for file in ["model.safetensors", "tokenizer.json"] {
        std::fs::copy(dir.join(file), tmp.join(file)).unwrap();
    }
    let config = std::fs::read_to_string(dir.join("config.json")).unwrap();
    let config = config.replace("\"num_hidden_layers\": 6", "\"num_hidden_layers\": 100000000");
    assert!(config.contains("100000000"));
    std::fs::write(tmp.join("config.json"), config).unwrap();
    let err = SentenceEmbedder::load(&tmp, DType::F32, &Device::Cpu).err().expect("loaded").to_string();
    assert!(err.contains("model.safetensors") && err.contains("100000000 layers"), "{err}");
    std::fs::remove_dir_all(&tmp).ok();
}

#[test]
fn cnn_constructors_refuse_a_parameter_the_host_cannot_hold() {
    use wick_zoo::mobilenet::MobileNetV2;
    use wick_zoo::resnet::{ResNet, ResNetDepth};
    let cpu = Device::Cpu;
    for err in [
        ResNet::new(ResNetDepth::R18, 1 << 40, 16, DType::F32, &cpu).err().expect("built").to_string(),
        MobileNetV2::new(1 << 40, 0.5, DType::F32, &cpu).err().expect("built").to_string(),
        ResNet::new(ResNetDepth::R18, 10, 1 << 62, DType::F32, &cpu).err().expect("built").to_string(),
    ] {
        assert!(err.contains("out of memory") || err.contains("can never succeed"), "{err}");
    }
}

#[test]
fn a_weight_file_is_preflighted_from_its_header() {
    // A header that declares a 1 PiB tensor: refused as out of memory from the header alone,
    // before candle maps and copies anything.
    let header = br#"{"w":{"dtype":"F32","shape":[281474976710656],"data_offsets":[0,1125899906842624]}}"#;
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(header);
    bytes.extend_from_slice(&[0u8; 64]);
    let path = std::env::temp_dir().join(format!("wick-huge-{}.safetensors", std::process::id()));
    std::fs::write(&path, bytes).unwrap();
    let result = wick_zoo::weights::WeightFile::open(&path, &Device::Cpu);
    std::fs::remove_file(&path).ok();
    match result {
        Err(ZooError::Nn(NnError::Memory(MemoryError::OutOfMemory(oom)))) => {
            assert!(oom.device.contains("wick-huge"), "{}", oom.device)
        }
        Err(other) => panic!("expected out of memory, got: {other}"),
        Ok(_) => panic!("a 1 PiB file was loaded"),
    }
}

/// The named configurations against their published parameter counts (Meta's Llama 2 release:
/// 6,738,415,616 and 13,015,864,320; `bert-base-uncased`: 109,482,240 with the pooler's 590,592,
/// which the zoo's encoder does not have).
#[test]
fn named_configurations_have_their_published_sizes() {
    assert_eq!(LlamaConfig::llama2_7b().parameter_count(), Some(6_738_415_616));
    assert_eq!(LlamaConfig::llama2_13b().parameter_count(), Some(13_015_864_320));
    assert_eq!(BertConfig::base().parameter_count(), Some(109_482_240 - 590_592));
}

/// A Hugging Face `config.json`: a LLaMA one read, another model type passed over, and a
/// grouped-query one refused naming the file.
#[test]
fn llama_hf_configs_are_read_or_refused_naming_the_file() {
    let dir = std::env::temp_dir().join(format!("wick-llama-config-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let write = |name: &str, json: &str| {
        let path = dir.join(name);
        std::fs::write(&path, json).unwrap();
        path
    };
    let llama = r#"{"model_type": "llama", "vocab_size": 8000, "hidden_size": 384, "num_hidden_layers": 6,
        "num_attention_heads": 6, "intermediate_size": 1024, "max_position_embeddings": 512}"#;
    let read = LlamaConfig::from_hf_config(&write("llama.json", llama)).unwrap().expect("a llama config");
    assert_eq!((read.vocab_size, read.hidden_size, read.num_layers, read.max_seq), (8000, 384, 6, 512));
    assert!(LlamaConfig::from_hf_config(&write("bert.json", r#"{"model_type": "bert"}"#)).unwrap().is_none());
    let gqa = llama.replace("\"num_attention_heads\": 6", "\"num_attention_heads\": 6, \"num_key_value_heads\": 2");
    let err = LlamaConfig::from_hf_config(&write("gqa.json", &gqa)).unwrap_err().to_string();
    assert!(err.contains("gqa.json") && err.contains("grouped-query"), "{err}");
    let err = LlamaConfig::from_hf_config(&dir.join("missing.json")).unwrap_err().to_string();
    assert!(err.contains("missing.json"), "{err}");
    std::fs::remove_dir_all(&dir).ok();
}
