//! Models wick did not build, under its governance: candle-transformers' BERT on the real
//! MiniLM weights and its LLaMA on a small random configuration, loaded through
//! [`SafetensorsWeights`] (pre-flighted from the headers, every tensor labelled by its name) and
//! labelled layer by layer through their own `tracing` spans ([`wick::span_labels`]).
//!
//! Independent truth: candle-transformers' BERT against the zoo's own (two implementations of
//! the same weights), LLaMA's logits against the same model loaded by candle's own `VarBuilder`.

mod common;

use std::path::PathBuf;
use std::sync::Mutex;

use candle_core::{DType, Device, Tensor, D};
use candle_nn::VarBuilder;
use candle_transformers::models::{bert, llama};
use wick::memory::MemoryLimit;
use wick::Engine;
use wick_zoo::bert::SentenceEmbedder;
use wick_zoo::weights::SafetensorsWeights;

// The history is the process heap's: the caching heap is this test binary's allocator.
wick::heap!(caching);

/// Tests that record the process's history, or run a candle-transformers model (whose spans and
/// allocations a recording test would otherwise count as its own: a label `model.1` beside its
/// `model.0`), run one at a time.
static HISTORY: Mutex<()> = Mutex::new(());

fn span_labels() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| wick::span_labels::install().expect("no other subscriber in this test binary"));
}

fn temp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("wick-ct-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

const SENTENCES: [&str; 3] =
    ["This is an example sentence", "Each sentence is converted", "wick governs memory; candle computes."];

/// Token ids padded to the longest, and the mask, as the zoo's embedder makes them.
fn batch(zoo: &SentenceEmbedder) -> (Tensor, Tensor) {
    let ids: Vec<Vec<u32>> = SENTENCES.iter().map(|t| zoo.token_ids(t).unwrap()).collect();
    let len = ids.iter().map(Vec::len).max().unwrap();
    let flat: Vec<u32> = ids.iter().flat_map(|r| (0..len).map(|j| r.get(j).copied().unwrap_or(0))).collect();
    let mask: Vec<u32> = ids.iter().flat_map(|r| (0..len).map(move |j| u32::from(j < r.len()))).collect();
    (
        Tensor::from_vec(flat, (ids.len(), len), &Device::Cpu).unwrap(),
        Tensor::from_vec(mask, (ids.len(), len), &Device::Cpu).unwrap(),
    )
}

/// Mean over the unmasked tokens, then L2-normalised: sentence-transformers' pooling, written
/// here with candle's ops (not the zoo's).
fn sentence_embeddings(hidden: &Tensor, mask: &Tensor) -> Tensor {
    let m = mask.to_dtype(DType::F32).unwrap().unsqueeze(2).unwrap();
    let sum = hidden.broadcast_mul(&m).unwrap().sum(1).unwrap();
    let mean = sum.broadcast_div(&m.sum(1).unwrap()).unwrap();
    let norm = mean.sqr().unwrap().sum_keepdim(D::Minus1).unwrap().sqrt().unwrap();
    mean.broadcast_div(&norm).unwrap()
}

fn candle_bert(dir: &std::path::Path, engine: &Engine) -> bert::BertModel {
    let config: bert::Config =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    let vb = SafetensorsWeights::open_dir(dir).unwrap().var_builder(engine, DType::F32).unwrap();
    bert::BertModel::load(vb, &config).unwrap()
}

#[test]
fn candle_transformers_minilm_equals_the_zoo_bert() {
    let Some(dir) = common::minilm_dir() else { return };
    let _one = HISTORY.lock().unwrap_or_else(|p| p.into_inner());
    let engine = Engine::cpu();
    let model = candle_bert(&dir, &engine);
    let zoo = SentenceEmbedder::load(&dir, DType::F32, &Device::Cpu).unwrap();
    let (ids, mask) = batch(&zoo);
    let hidden = model.forward(&ids, &ids.zeros_like().unwrap(), Some(&mask)).unwrap();
    let ours: Vec<Vec<f32>> = sentence_embeddings(&hidden, &mask).to_vec2().unwrap();
    let theirs: Vec<Vec<f32>> = zoo.embed(&SENTENCES).unwrap().to_vec2().unwrap();
    let worst = ours.iter().flatten().zip(theirs.iter().flatten()).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
    eprintln!("candle-transformers vs the zoo's BERT: largest difference {worst:e}");
    assert!(worst <= 1e-6, "largest difference {worst}");
}

#[test]
fn a_candle_transformers_bert_is_labelled_by_its_weights_and_its_layers() {
    let Some(dir) = common::minilm_dir() else { return };
    let _one = HISTORY.lock().unwrap_or_else(|p| p.into_inner());
    span_labels();
    // The zoo's embedder only tokenizes here; it is loaded before recording starts.
    let (ids, mask) = batch(&SentenceEmbedder::load(&dir, DType::F32, &Device::Cpu).unwrap());
    let engine = Engine::cpu();
    engine.record_memory_history(Some(200_000)).unwrap();
    let model = candle_bert(&dir, &engine);
    let hidden = model.forward(&ids, &ids.zeros_like().unwrap(), Some(&mask)).unwrap();
    drop(hidden);
    engine.record_memory_history(None).unwrap();
    let history = engine.memory_history();
    let labels: Vec<String> = history.labels.values().map(|p| p.join("/")).collect();
    // Every weight is read under its own name, and nothing else reads under `weights`.
    let weights: Vec<&String> = labels.iter().filter(|l| l.starts_with("weights/")).collect();
    assert!(weights.iter().any(|l| *l == "weights/embeddings.word_embeddings.weight"), "{weights:?}");
    assert!(weights.iter().any(|l| *l == "weights/encoder.layer.5.output.dense.weight"), "{weights:?}");
    // The forward pass's allocations carry the model's own layer names.
    for expected in ["model/embeddings", "model/encoder/layer.0/attn.0/self-attn.0", "model/encoder/layer.5/inter.0"] {
        assert!(labels.iter().any(|l| l.starts_with(expected)), "no label under {expected}: {labels:?}");
    }
    // The embedding matrix (30522 × 384 f32, 46.9 MB) is held at the peak under its name.
    let held = history.held_at_peak().unwrap();
    eprintln!("{held}");
    let row = held.rows.iter().find(|r| r.0 == "weights/embeddings.word_embeddings.weight").unwrap();
    assert!(row.1 >= 30522 * 384 * 4, "{row:?}");
}

/// A small LLaMA (candle-transformers' own code) with random weights written to a file.
fn llama_files(dir: &std::path::Path) -> (llama::Config, PathBuf) {
    let config = llama::Config {
        hidden_size: 64,
        intermediate_size: 160,
        vocab_size: 300,
        num_hidden_layers: 3,
        num_attention_heads: 4,
        num_key_value_heads: 2,
        use_flash_attn: false,
        rms_norm_eps: 1e-5,
        rope_theta: 10_000.0,
        bos_token_id: None,
        eos_token_id: None,
        rope_scaling: None,
        max_position_embeddings: 64,
        tie_word_embeddings: false,
    };
    let map = candle_nn::VarMap::new();
    let vb = VarBuilder::from_varmap(&map, DType::F32, &Device::Cpu);
    llama::Llama::load(vb, &config).unwrap();
    let path = dir.join("model.safetensors");
    let tensors: std::collections::HashMap<String, Tensor> =
        map.data().lock().unwrap().iter().map(|(k, v)| (k.clone(), v.as_tensor().clone())).collect();
    wick::tensor_files::write_safetensors(&path, &tensors).unwrap();
    (config, path)
}

fn llama_logits(model: &llama::Llama, config: &llama::Config) -> Vec<f32> {
    let mut cache = llama::Cache::new(false, DType::F32, config, &Device::Cpu).unwrap();
    let ids = Tensor::new(&[[1u32, 17, 250, 42, 7, 99]], &Device::Cpu).unwrap();
    model.forward(&ids, 0, &mut cache).unwrap().flatten_all().unwrap().to_vec1().unwrap()
}

#[test]
fn a_candle_transformers_llama_loads_through_wick_and_equals_candles_own_loading() {
    let dir = temp("llama");
    let (config, path) = llama_files(&dir);
    let _one = HISTORY.lock().unwrap_or_else(|p| p.into_inner());
    span_labels();
    let engine = Engine::cpu();
    engine.record_memory_history(Some(100_000)).unwrap();
    let vb = SafetensorsWeights::open(&[&path]).unwrap().var_builder(&engine, DType::F32).unwrap();
    let ours = llama_logits(&llama::Llama::load(vb, &config).unwrap(), &config);
    engine.record_memory_history(None).unwrap();
    // SAFETY: the file is this test's own and nothing changes it while it is mapped.
    let vb = unsafe { VarBuilder::from_mmaped_safetensors(&[&path], DType::F32, &Device::Cpu).unwrap() };
    let theirs = llama_logits(&llama::Llama::load(vb, &config).unwrap(), &config);
    assert_eq!(ours.len(), 300);
    assert!(ours.iter().zip(&theirs).all(|(a, b)| a.to_bits() == b.to_bits()), "the logits differ");
    let labels: Vec<String> = engine.memory_history().labels.values().map(|p| p.join("/")).collect();
    assert!(labels.iter().any(|l| l == "weights/model.layers.2.mlp.down_proj.weight"), "{labels:?}");
    // LLaMA's blocks are entered at the top (its `forward` has no span of its own).
    assert!(labels.iter().any(|l| l.starts_with("block.2/attn.0/linear.")), "{labels:?}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// The largest tensor's bytes in a safetensors file, read with the `safetensors` crate.
fn largest_tensor_bytes(path: &std::path::Path) -> usize {
    let bytes = std::fs::read(path).unwrap();
    let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    file.tensors().iter().map(|(_, t)| t.data().len()).max().unwrap()
}

#[test]
fn weights_over_the_budget_are_refused_before_any_is_read() {
    let dir = temp("budget");
    let (_, path) = llama_files(&dir);
    let weights = SafetensorsWeights::open(&[&path]).unwrap();
    // Stored in f32: loaded as f32 the tensors are read in place (no conversion); as bf16 they
    // take half, plus the largest tensor's f32 copy while it is converted.
    let need = weights.load_bytes(DType::F32).unwrap();
    assert_eq!(need, weights.stored_bytes());
    let largest = largest_tensor_bytes(&path);
    assert_eq!(weights.load_bytes(DType::BF16).unwrap(), weights.stored_bytes() / 2 + largest);
    let mut engine = Engine::cpu();
    engine.set_memory_limit(Some(MemoryLimit::Bytes(engine.allocated().bytes + need / 2))).unwrap();
    // Refused by `var_builder`, which reads no tensor: out-of-memory, naming the file.
    let err = weights.var_builder(&engine, DType::F32).err().unwrap();
    let text = err.to_string();
    assert!(matches!(&err, wick_zoo::ZooError::Nn(wick_nn::NnError::Memory(e)) if e.is_out_of_memory()), "{text}");
    assert!(text.contains("model.safetensors"), "{text}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn damaged_weight_files_are_errors_that_name_the_file_and_the_tensor() {
    let dir = temp("damaged");
    let (_, path) = llama_files(&dir);
    let bytes = std::fs::read(&path).unwrap();
    let engine = Engine::cpu();
    // Cut short: refused at open, from the header.
    let cut = dir.join("cut.safetensors");
    std::fs::write(&cut, &bytes[..bytes.len() - 10]).unwrap();
    let err = SafetensorsWeights::open(&[&cut]).unwrap_err().to_string();
    assert!(err.contains("cut.safetensors") && err.contains("data bytes"), "{err}");
    // Not a safetensors file at all, and an empty one.
    for (name, content) in [("text.safetensors", &b"{\"not\": \"safetensors\"}"[..]), ("empty.safetensors", &[][..])] {
        let p = dir.join(name);
        std::fs::write(&p, content).unwrap();
        let err = SafetensorsWeights::open(&[&p]).unwrap_err().to_string();
        assert!(err.contains(name) && err.contains("not a safetensors file"), "{err}");
    }
    // Cut short after it was opened: the read of a tensor past the end is an error naming it.
    let late = dir.join("late.safetensors");
    std::fs::write(&late, &bytes).unwrap();
    let weights = SafetensorsWeights::open(&[&late]).unwrap();
    let names: Vec<String> = weights.names().map(str::to_string).collect();
    std::fs::OpenOptions::new().write(true).open(&late).unwrap().set_len(bytes.len() as u64 / 2).unwrap();
    let vb = weights.var_builder(&engine, DType::F32).unwrap();
    let (name, err) = names
        .iter()
        .find_map(|name| vb.get_unchecked(name).err().map(|e| (name, e.to_string())))
        .expect("a tensor past the cut reads as an error");
    assert!(err.contains("late.safetensors") && err.contains(name.as_str()) && err.contains("cut short"), "{err}");
    // The wrong shape for a tensor: named, with both shapes.
    let weights = SafetensorsWeights::open(&[&path]).unwrap();
    let vb = weights.var_builder(&engine, DType::F32).unwrap();
    let err = vb.get((3, 3), "model.norm.weight").unwrap_err().to_string();
    assert!(err.contains("model.norm.weight") && err.contains("[64]") && err.contains("[3, 3]"), "{err}");
    // A tensor the file lacks: candle's own error for it (models test `contains_tensor`).
    assert!(vb.get(64, "no.such.weight").is_err() && !vb.contains_tensor("no.such.weight"));
    // The same tensor in two files is refused.
    let dup = dir.join("dup.safetensors");
    std::fs::write(&dup, &bytes).unwrap();
    let err = SafetensorsWeights::open(&[&path, &dup]).unwrap_err().to_string();
    assert!(err.contains("is also in"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_sharded_folder_opens_through_its_index_and_an_index_may_not_leave_it() {
    let dir = temp("sharded");
    let a = Tensor::arange(0f32, 6.0, &Device::Cpu).unwrap().reshape((2, 3)).unwrap();
    let b = Tensor::new(&[7f32, 8.0], &Device::Cpu).unwrap();
    for (file, name, t) in [("part-1.safetensors", "a", &a), ("part-2.safetensors", "b", &b)] {
        let one: std::collections::HashMap<String, Tensor> = [(name.to_string(), t.clone())].into();
        wick::tensor_files::write_safetensors(&dir.join(file), &one).unwrap();
    }
    let index = dir.join("model.safetensors.index.json");
    std::fs::write(&index, r#"{"weight_map": {"a": "part-1.safetensors", "b": "part-2.safetensors"}}"#).unwrap();
    let weights = SafetensorsWeights::open_dir(&dir).unwrap();
    assert_eq!(weights.paths().len(), 2);
    let vb = weights.var_builder(&Engine::cpu(), DType::F64).unwrap();
    assert_eq!(vb.get((2, 3), "a").unwrap().to_vec2::<f64>().unwrap(), [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]);
    assert_eq!(vb.get(2, "b").unwrap().dtype(), DType::F64);
    std::fs::write(&index, r#"{"weight_map": {"a": "../part-1.safetensors"}}"#).unwrap();
    let err = SafetensorsWeights::open_dir(&dir).unwrap_err().to_string();
    assert!(err.contains("not a file in this folder"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}
