//! The allocation history of real zoo training, under the caching heap (the allocator that
//! serves candle's buffers): the "held at the peak" table of a training step accounts for the
//! measured peak; allocations carry the trainer's phases and the model's layer names; the leak
//! finder stays quiet on the training loop and names a planted leak (losses kept across steps
//! with their graph). One test per concern, run one after another: the history is process-wide.

use std::sync::Mutex;

use candle_core::{Device, Tensor};
use wick::{Engine, LeakFinder};
use wick_nn::Model;
use wick_train::trainer::{TrainOptions, Trainer};
use wick_zoo::llama::{Llama, LlamaConfig};

wick::heap!(caching);

/// The history is the process's: tests take turns.
static TURN: Mutex<()> = Mutex::new(());

const CONFIG: LlamaConfig = LlamaConfig {
    vocab_size: 64,
    hidden_size: 128,
    num_layers: 2,
    num_heads: 4,
    intermediate_size: 256,
    max_seq: 64,
    rms_eps: 1e-6,
    rope_theta: 10_000.0,
};

fn batch(step: u64) -> Tensor {
    let ids: Vec<u32> = (0..8 * 64).map(|i| ((i as u64 * 7 + step * 5 + i as u64 / 9) % 64) as u32).collect();
    Tensor::from_vec(ids, (8, 64), &Device::Cpu).unwrap_or_else(|e| panic!("{e}"))
}

fn trainer() -> Trainer<Llama> {
    let model = Llama::new(CONFIG, candle_core::DType::F32, &Device::Cpu).unwrap_or_else(|e| panic!("{e}"));
    Trainer::new(model, serde_json::json!({"kind": "llama"}), None, TrainOptions::default())
        .unwrap_or_else(|e| panic!("{e}"))
}

#[test]
fn held_at_the_peak_accounts_for_a_training_steps_measured_peak() {
    let _turn = TURN.lock().unwrap_or_else(|p| p.into_inner());
    let engine = Engine::cpu();
    let mut t = trainer();
    t.train_step(&[batch(0)]).unwrap_or_else(|e| panic!("{e}")); // optimizer state made
    engine.record_memory_history(Some(1 << 18)).unwrap_or_else(|e| panic!("{e}"));
    engine.reset_peak_memory_stats();
    t.train_step(&[batch(1)]).unwrap_or_else(|e| panic!("{e}"));
    let measured = engine.peak_allocated().unwrap_or_else(|| panic!("an exact peak")).bytes;
    let history = engine.memory_history();
    engine.record_memory_history(None).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(history.heap.dropped, 0);
    let held = history.held_at_peak().unwrap_or_else(|| panic!("a peak"));
    let accounted = held.rows.iter().map(|r| r.1).sum::<usize>() + held.before_recording + held.history_ring;
    assert_eq!(accounted, held.total, "every byte at the peak is in a row");
    let error = (held.total as f64 - measured as f64) / measured as f64;
    println!("{held}\nmeasured peak {measured}, held at the peak {} ({:+.3} %)", held.total, 100.0 * error);
    assert!(error.abs() < 0.01, "held at the peak {} vs measured {measured}: {:+.3} %", held.total, 100.0 * error);
    // The step's activations are named by phase and layer.
    let labels: Vec<&str> = held.rows.iter().map(|r| r.0.as_str()).collect();
    assert!(labels.iter().any(|l| l.starts_with("train_step/forward/layers.1")), "{labels:?}");
    assert!(
        history.heap.events.iter().any(|e| history.label_text(e.label).starts_with("train_step/backward")),
        "no allocation under train_step/backward"
    );
    assert!(
        history.heap.events.iter().any(|e| history.label_text(e.label) == "train_step/optimizer"),
        "no allocation under train_step/optimizer"
    );
}

#[test]
fn the_leak_finder_is_quiet_on_training_and_names_kept_losses() {
    let _turn = TURN.lock().unwrap_or_else(|p| p.into_inner());
    let engine = Engine::cpu();
    engine.record_memory_history(Some(1 << 20)).unwrap_or_else(|e| panic!("{e}"));
    // The real loop: no report.
    let mut t = trainer();
    let mut finder = LeakFinder::new(2, 3);
    for step in 0..8 {
        t.train_step(&[batch(step)]).unwrap_or_else(|e| panic!("{e}"));
        let report = finder.end_step(&engine);
        assert!(report.is_none(), "false alarm at step {step}: {}", report.map(|r| r.to_string()).unwrap_or_default());
    }
    // The planted leak: each step's loss kept (PyTorch's `total_loss += loss`), with the graph
    // it carries — every activation of its step.
    let model = Llama::new(CONFIG, candle_core::DType::F32, &Device::Cpu).unwrap_or_else(|e| panic!("{e}"));
    let mut kept = Vec::new();
    let mut finder = LeakFinder::new(2, 3);
    let mut found = None;
    for step in 0..8 {
        let loss = engine
            .try_step("leaky_step", |_| {
                let loss = {
                    let _forward = wick::memory::push_label("forward");
                    model.loss_with(&batch(step), None).map_err(|e| wick::Error::Candle(candle_core::Error::wrap(e)))?
                };
                let _backward = wick::memory::push_label("backward");
                drop(loss.backward()?);
                Ok(loss)
            })
            .unwrap_or_else(|e| panic!("{e}"))
            .0;
        kept.push(loss);
        if let Some(report) = finder.end_step(&engine) {
            found = Some(report);
            break;
        }
    }
    engine.record_memory_history(None).unwrap_or_else(|e| panic!("{e}"));
    let report = found.unwrap_or_else(|| panic!("the kept gradients were not found"));
    println!("{report}");
    assert!(report.grown > 0);
    // The activations the kept graphs hold are named by the step, phase and layer that made them.
    assert!(report.rows.iter().any(|r| r.0.starts_with("leaky_step/forward/layers.")), "rows: {:?}", report.rows);
    drop(kept);
}
