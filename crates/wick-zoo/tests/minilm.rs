//! all-MiniLM-L6-v2 with its real weights: tokenization against the shipped vocabulary and
//! embeddings against the published values.

mod common;

use candle_core::{DType, Device};
use wick_zoo::bert::{BertConfig, SentenceEmbedder};
use wick_zoo::ZooError;

/// sentence-transformers' model card: the normalised embedding of this sentence starts so.
const PUBLISHED: [f32; 4] = [0.0676569, 0.0634959, 0.0487131, 0.0793050];

#[test]
fn minilm_matches_published_embedding_and_vocabulary() {
    let Some(dir) = common::minilm_dir() else { return };
    let model = SentenceEmbedder::load(&dir, DType::F32, &Device::Cpu).unwrap();
    // Independent truth for the tokenizer: line numbers of vocab.txt.
    let vocab = std::fs::read_to_string(dir.join("vocab.txt")).unwrap();
    let id = |w: &str| vocab.lines().position(|l| l == w).unwrap() as u32;
    let expected: Vec<u32> =
        ["[CLS]", "this", "is", "an", "example", "sentence", "[SEP]"].iter().map(|w| id(w)).collect();
    assert_eq!(model.token_ids("This is an example sentence").unwrap(), expected);
    let e = model.embed(&["This is an example sentence", "Each sentence is converted"]).unwrap();
    let first: Vec<f32> = e.get(0).unwrap().to_vec1().unwrap();
    for (i, (got, want)) in first.iter().zip(PUBLISHED).enumerate() {
        assert!((got - want).abs() <= 1e-5, "component {i}: {got} vs published {want}");
    }
    let norm: f32 = first.iter().map(|v| v * v).sum::<f32>().sqrt();
    assert!((norm - 1.0).abs() < 1e-5);
    // Padding does not change a sentence's embedding (the mask works).
    let alone: Vec<f32> = model.embed(&["Each sentence is converted"]).unwrap().get(0).unwrap().to_vec1().unwrap();
    let padded: Vec<f32> = e.get(1).unwrap().to_vec1().unwrap();
    assert!(alone.iter().zip(&padded).all(|(a, b)| (a - b).abs() < 1e-5));
}

#[test]
fn minilm_embeds_up_to_the_models_own_max_seq_length() {
    // 242 tokens: the tokenizer file truncates at 128, sentence-transformers at the model's
    // `max_seq_length` (256). Reference: Hugging Face BertModel in f64, mean-pooled and normalised
    // (scripts/torch-reference/minilm_long.py).
    let Some(dir) = common::minilm_dir() else { return };
    let fixture: serde_json::Value =
        serde_json::from_str(include_str!("fixtures/minilm-long.json")).expect("fixture is JSON");
    let text = fixture["text"].as_str().unwrap();
    let reference: Vec<f64> = fixture["embedding"].as_array().unwrap().iter().map(|v| v.as_f64().unwrap()).collect();
    let model = SentenceEmbedder::load(&dir, DType::F32, &Device::Cpu).unwrap();
    assert_eq!(model.token_ids(text).unwrap().len() as u64, fixture["tokens"].as_u64().unwrap());
    let e: Vec<f32> = model.embed(&[text]).unwrap().get(0).unwrap().to_vec1().unwrap();
    let worst = e.iter().zip(&reference).map(|(a, b)| (*a as f64 - b).abs()).fold(0.0, f64::max);
    assert!(worst < 1e-5, "largest difference from the reference: {worst}");
}

#[test]
fn bad_weight_files_and_configs_are_clear_errors() {
    let dir = std::env::temp_dir().join(format!("wick-zoo-bad-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let cfg = dir.join("config.json");
    // A valid small config with `extra` keys appended; the error `from_file` gives, if any.
    let config_error = |extra: &str| -> Option<String> {
        let base = r#""vocab_size": 10, "hidden_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2,
        "intermediate_size": 16, "max_position_embeddings": 16, "type_vocab_size": 2, "layer_norm_eps": 1e-12"#;
        std::fs::write(&cfg, format!("{{{base}{extra}}}")).unwrap();
        BertConfig::from_file(&cfg).err().map(|e| e.to_string())
    };
    let err = config_error(r#", "rotary_dim": 4"#).unwrap_or_default();
    assert!(err.contains("config.json") && err.contains("unknown key `rotary_dim`"), "{err}");
    let err = config_error(r#", "hidden_act": "relu""#).unwrap_or_default();
    assert!(err.contains("hidden_act `relu`"), "{err}");
    let err = config_error(r#", "pad_token_id": 10"#).unwrap_or_default();
    assert!(err.contains("pad_token_id 10 is outside the vocabulary of 10"), "{err}");
    assert_eq!(config_error(""), None);
    let config = BertConfig::from_file(&cfg).unwrap();
    // Hugging Face's default padding token, whose row starts at zero in a fresh model.
    assert_eq!(config.pad_token_id, Some(0));
    let fresh = wick_zoo::bert::Bert::new(config.clone(), DType::F32, &Device::Cpu).unwrap();
    let row0: Vec<f32> =
        fresh.params.tensor("embeddings.word_embeddings.weight").unwrap().get(0).unwrap().to_vec1().unwrap();
    assert!(row0.iter().all(|v| *v == 0.0));
    // Missing weights file, corrupt weights file, a tensor of the wrong shape.
    let err = SentenceEmbedder::load(&dir, DType::F32, &Device::Cpu).err().unwrap();
    assert!(matches!(err, ZooError::File { .. }) && err.to_string().contains("model.safetensors"), "{err}");
    std::fs::write(dir.join("model.safetensors"), b"garbage").unwrap();
    let err = SentenceEmbedder::load(&dir, DType::F32, &Device::Cpu).err().unwrap().to_string();
    assert!(err.contains("model.safetensors") && err.contains("not a readable safetensors"), "{err}");
    let model = wick_zoo::bert::Bert::new(config, DType::F32, &Device::Cpu).unwrap();
    let mut tensors: std::collections::HashMap<String, candle_core::Tensor> =
        model.params.iter().map(|(k, v)| (k.clone(), v.as_tensor().clone())).collect();
    tensors.insert(
        "encoder.layer.0.output.dense.weight".into(),
        candle_core::Tensor::zeros((3, 3), DType::F32, &Device::Cpu).unwrap(),
    );
    candle_core::safetensors::save(&tensors, dir.join("model.safetensors")).unwrap();
    std::fs::write(dir.join("tokenizer.json"), "{}").unwrap();
    let weights = wick_zoo::weights::WeightFile::open(&dir.join("model.safetensors"), &Device::Cpu).unwrap();
    let err = wick_zoo::bert::Bert::load(BertConfig::from_file(&cfg).unwrap(), &weights, DType::F32)
        .err()
        .unwrap()
        .to_string();
    assert!(
        err.contains("encoder.layer.0.output.dense.weight") && err.contains("shape [3, 3], expected [8, 16]"),
        "{err}"
    );
    let err = SentenceEmbedder::load(&dir, DType::F32, &Device::Cpu).err().unwrap().to_string();
    assert!(err.contains("shape [3, 3]"), "{err}");
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn minilm_loads_from_an_offline_hf_hub_cache() {
    let Some(dir) = common::minilm_dir() else { return };
    // Lay the real files out as the hub cache does: blobs, a snapshot of symlinks, refs/main.
    let root = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("hf-cache-{}", std::process::id()));
    let repo = root.join("models--sentence-transformers--all-MiniLM-L6-v2");
    let commit = "8b3219a92973c328a8e22fadcfa821b5dc75636a";
    std::fs::create_dir_all(repo.join("blobs")).unwrap();
    std::fs::create_dir_all(repo.join("snapshots").join(commit)).unwrap();
    std::fs::create_dir_all(repo.join("refs")).unwrap();
    std::fs::write(repo.join("refs/main"), commit).unwrap();
    for (i, file) in ["config.json", "model.safetensors", "tokenizer.json"].iter().enumerate() {
        let blob = repo.join("blobs").join(format!("blob{i}"));
        std::fs::copy(dir.join(file), &blob).unwrap();
        std::os::unix::fs::symlink(&blob, repo.join("snapshots").join(commit).join(file)).unwrap();
    }
    let files = ["config.json", "model.safetensors", "tokenizer.json"];
    let snapshot =
        wick_zoo::weights::hf_cache_snapshot(Some(&root), "sentence-transformers/all-MiniLM-L6-v2", &files).unwrap();
    let model = SentenceEmbedder::load(&snapshot, DType::F32, &Device::Cpu).unwrap();
    let e: Vec<f32> = model.embed(&["This is an example sentence"]).unwrap().get(0).unwrap().to_vec1().unwrap();
    assert!((e[0] - PUBLISHED[0]).abs() <= 1e-5);
    let err = wick_zoo::weights::hf_cache_snapshot(Some(&root), "org/absent-model", &files).unwrap_err().to_string();
    assert!(err.contains("not in the hub cache") && err.contains("models--org--absent-model"), "{err}");
    std::fs::remove_dir_all(&root).ok();
}

/// Under autocast (the model built in bf16 or f16, layer norms and softmax in f32, masks finite)
/// the real model's embeddings have no NaN and stay within cosine 0.999 of the f32 ones,
/// padding included (candle-transformers' `BertModel` gives NaN here: its mask is `f32::MIN`).
#[test]
fn minilm_under_autocast_matches_f32() {
    let Some(dir) = common::minilm_dir() else { return };
    let texts = [
        "This is an example sentence",
        "Each sentence is converted",
        "Mixed precision halves the memory of activations without changing what a model computes",
        "a",
    ];
    let reference = SentenceEmbedder::load(&dir, DType::F32, &Device::Cpu).unwrap().embed(&texts).unwrap();
    for autocast in [wick_nn::Autocast::bf16(), wick_nn::Autocast::f16()] {
        let model = SentenceEmbedder::load(&dir, autocast.model_dtype(), &Device::Cpu).unwrap();
        let e = model.embed(&texts).unwrap().to_dtype(DType::F32).unwrap();
        for (i, text) in texts.iter().enumerate() {
            let a: Vec<f32> = reference.get(i).unwrap().to_vec1().unwrap();
            let b: Vec<f32> = e.get(i).unwrap().to_vec1().unwrap();
            assert!(b.iter().all(|v| v.is_finite()), "{autocast:?} `{text}`: non-finite embedding");
            let dot: f32 = a.iter().zip(&b).map(|(x, y)| x * y).sum();
            let cosine =
                dot / (a.iter().map(|x| x * x).sum::<f32>().sqrt() * b.iter().map(|x| x * x).sum::<f32>().sqrt());
            println!("{:?} `{text}`: cosine to f32 {cosine:.6}", autocast.model_dtype());
            assert!(cosine >= 0.999, "{autocast:?} `{text}`: cosine {cosine}");
        }
    }
}
