//! Training checkpoints and exact resume: a run saved at step k and resumed in a fresh trainer
//! takes the same steps to the bit as the run that went on (f32, bf16 and f16 with its loss
//! scaler, SGD and AdamW with a schedule, gradient accumulation, activation checkpointing); a
//! damaged newest checkpoint is passed over with the reason; a checkpoint of another run is
//! refused with what differs, and nothing changes; batch norm's running statistics come back too.

use std::path::PathBuf;

use candle_core::{DType, Device, Tensor};
use wick_nn::Autocast;
use wick_nn::{Labelled, Model};
use wick_train::amp::{masters_by_name, StepOutcome};
use wick_train::optim::{AdamW, LrSchedule};
use wick_train::trainer::{TrainOptions, Trainer};
use wick_train::CheckpointDir;
use wick_train::Optimizer;
use wick_zoo::llama::{Llama, LlamaConfig};
use wick_zoo::resnet::{ResNet, ResNetDepth};

const CONFIG: LlamaConfig = LlamaConfig {
    vocab_size: 24,
    hidden_size: 32,
    num_layers: 2,
    num_heads: 4,
    intermediate_size: 48,
    max_seq: 32,
    rms_eps: 1e-6,
    rope_theta: 10_000.0,
};

fn describe(config: &LlamaConfig) -> serde_json::Value {
    serde_json::json!({"kind": "llama", "config": config})
}

/// The run's batch for a step: a pure function of the step (the data position).
fn batch(step: u64, micro: usize) -> Tensor {
    let ids: Vec<u32> = (0..4 * 12)
        .map(|i| ((i as u64 * 7 + step * 5 + micro as u64 * 3 + (i as u64 / 5) * step) % 24) as u32)
        .collect();
    Tensor::from_vec(ids, (4, 12), &Device::Cpu).unwrap()
}

fn temp_dir(name: &str) -> PathBuf {
    let name: String = name.chars().map(|c| if c.is_ascii_alphanumeric() || c == '-' { c } else { '_' }).collect();
    let dir = std::env::temp_dir().join(format!("wick-train-test-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

fn trainer(options: TrainOptions, config: LlamaConfig) -> Trainer<Llama> {
    let dtype = options.autocast.model_dtype();
    let model = Llama::new(config, dtype, &Device::Cpu).unwrap();
    let start = (dtype != DType::F32).then(|| {
        masters_by_name(&model.params, &Llama::new(config, DType::F32, &Device::Cpu).unwrap().params).unwrap()
    });
    Trainer::new(model, describe(&config), start.as_deref(), options).unwrap()
}

fn run_steps(t: &mut Trainer<Llama>, steps: std::ops::Range<u64>, micro: usize) -> Vec<(f32, StepOutcome)> {
    steps
        .map(|s| {
            let batches: Vec<Tensor> = (0..micro).map(|m| batch(s, m)).collect();
            let r = t.train_step(&batches).unwrap();
            (r.loss, r.outcome)
        })
        .collect()
}

fn bits(t: &Trainer<Llama>) -> Vec<Vec<u32>> {
    let mut out = Vec::new();
    for (i, v) in t.model().vars().iter().enumerate() {
        let p: Vec<f32> = v.as_tensor().to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1().unwrap();
        let m: Vec<f32> = t.masters().master(i).unwrap().flatten_all().unwrap().to_vec1().unwrap();
        out.push(p.iter().chain(&m).map(|x| x.to_bits()).collect());
    }
    out
}

fn resume_matches(name: &str, options: TrainOptions, micro: usize) {
    let dir = temp_dir(name);
    let checkpoints = CheckpointDir::new(&dir, 3).unwrap();
    let mut straight = trainer(options, CONFIG);
    let first = run_steps(&mut straight, 0..3, micro);
    straight.save(&checkpoints, serde_json::json!({"next_batch": 3})).unwrap();
    let rest = run_steps(&mut straight, 3..7, micro);

    let mut resumed = trainer(options, CONFIG);
    let r = resumed.resume(&checkpoints).unwrap();
    assert_eq!((r.step, r.data["next_batch"].as_u64()), (3, Some(3)), "{name}");
    assert!(r.skipped.is_empty());
    let again = run_steps(&mut resumed, 3..7, micro);
    assert_eq!(rest, again, "{name}: the resumed run's losses differ");
    assert!(bits(&straight) == bits(&resumed), "{name}: the resumed run's parameters or masters differ");
    // It trained: the losses fell.
    assert!(again[3].0 < first[0].0, "{name}: {first:?} then {again:?}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_resumed_run_takes_the_same_steps_to_the_bit() {
    let adamw = Optimizer::AdamW(AdamW { lr: 3e-3, beta1: 0.9, beta2: 0.95, eps: 1e-8, weight_decay: 0.01 });
    let cosine = LrSchedule::WarmupCosine { warmup: 2, total: 7, min_factor: 0.1 };
    let f32_options = TrainOptions { optimizer: adamw, schedule: cosine, ..TrainOptions::default() };
    resume_matches("f32-adamw-cosine", f32_options, 1);
    resume_matches("bf16", TrainOptions { autocast: Autocast::bf16(), ..f32_options }, 1);
    let sgd = Optimizer::SgdMomentum { lr: 0.05, momentum: 0.9 };
    resume_matches("sgd-accumulated", TrainOptions { optimizer: sgd, ..f32_options }, 2);
    resume_matches("checkpointed", TrainOptions { activation_checkpointing: true, ..f32_options }, 1);
}

/// Clipping's norm is of the step's gradients alone: a clipped run (f32; bf16 with f32 masters;
/// f16 under the loss scaler, the norm of the unscaled gradients) resumes to the bit.
#[test]
fn a_clipped_run_resumes_to_the_bit() {
    let bound = Some(0.05);
    for autocast in [Autocast::off(), Autocast::bf16(), Autocast::f16()] {
        let options = TrainOptions { autocast, clip_grad_norm: bound, ..TrainOptions::default() };
        // The bound is below the norms of this run: every step is clipped.
        let mut t = trainer(options, CONFIG);
        for s in 0..2 {
            let r = t.train_step(&[batch(s, 0)]).unwrap();
            let clipped = r.grad_norm.is_some_and(|n| n > 0.05) || r.outcome == StepOutcome::Skipped;
            assert!(clipped, "{autocast:?}: {r:?}");
        }
        resume_matches(&format!("clipped-{autocast:?}"), options, 1);
    }
}

#[test]
fn an_f16_run_resumes_its_loss_scaler() {
    let options = TrainOptions { autocast: Autocast::f16(), ..TrainOptions::default() };
    resume_matches("f16", options, 1);
    // The scale itself is saved and restored (PyTorch's initial 2^16, halved on overflow).
    let dir = temp_dir("f16-scale");
    let checkpoints = CheckpointDir::new(&dir, 1).unwrap();
    let mut t = trainer(options, CONFIG);
    run_steps(&mut t, 0..2, 1);
    let path = t.save(&checkpoints, serde_json::Value::Null).unwrap();
    let manifest: serde_json::Value = serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap();
    let scale = manifest["scaler"]["scale"].as_f64().unwrap();
    assert!(scale > 0.0 && scale <= 65536.0);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_damaged_newest_checkpoint_is_passed_over_with_the_reason() {
    let dir = temp_dir("damaged");
    let checkpoints = CheckpointDir::new(&dir, 5).unwrap();
    let mut t = trainer(TrainOptions::default(), CONFIG);
    for s in 0..3 {
        run_steps(&mut t, s..s + 1, 1);
        t.save(&checkpoints, serde_json::json!({"step": s + 1})).unwrap();
    }
    assert_eq!(checkpoints.steps().unwrap(), vec![1, 2, 3]);
    // Flip one byte of step 3's tensors, cut step 2's short.
    let file = |s: u64| dir.join(format!("step-{s:010}.safetensors"));
    let mut bytes = std::fs::read(file(3)).unwrap();
    let middle = bytes.len() / 2;
    bytes[middle] ^= 0x40;
    std::fs::write(file(3), &bytes).unwrap();
    let bytes = std::fs::read(file(2)).unwrap();
    std::fs::write(file(2), &bytes[..bytes.len() - 100]).unwrap();

    let mut fresh = trainer(TrainOptions::default(), CONFIG);
    let r = fresh.resume(&checkpoints).unwrap();
    assert_eq!(r.step, 1);
    assert_eq!(r.skipped.len(), 2, "{:?}", r.skipped);
    assert!(r.skipped[0].contains("step 3") && r.skipped[0].contains("checksum"), "{:?}", r.skipped);
    assert!(r.skipped[1].contains("step 2") && r.skipped[1].contains("truncated"), "{:?}", r.skipped);

    // Every checkpoint damaged: an error listing each; none at all: a clear error.
    std::fs::write(file(1), b"not safetensors").unwrap();
    let err = fresh.resume(&checkpoints).unwrap_err().to_string();
    assert!(err.contains("no usable checkpoint") && err.contains("step 1") && err.contains("step 3"), "{err}");
    let empty = CheckpointDir::new(&temp_dir("empty"), 2).unwrap();
    let err = fresh.resume(&empty).unwrap_err().to_string();
    assert!(err.contains("no checkpoint in"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
    let _ = std::fs::remove_dir_all(empty.path());
}

#[test]
fn a_checkpoint_of_another_run_is_refused_with_what_differs_and_nothing_changes() {
    let dir = temp_dir("other");
    let checkpoints = CheckpointDir::new(&dir, 2).unwrap();
    let mut t = trainer(TrainOptions::default(), CONFIG);
    run_steps(&mut t, 0..1, 1);
    t.save(&checkpoints, serde_json::Value::Null).unwrap();

    let wider = LlamaConfig { hidden_size: 64, ..CONFIG };
    let mut other = trainer(TrainOptions::default(), wider);
    let before = bits(&other);
    let err = other.resume(&checkpoints).unwrap_err().to_string();
    assert!(
        err.contains("another run") && err.contains("`embed.weight` is [24, 32] f32 there, [24, 64] f32 here"),
        "{err}"
    );
    assert!(bits(&other) == before && other.step() == 0, "a refused resume changed the run");

    let other_eps = LlamaConfig { rms_eps: 1e-5, ..CONFIG };
    let err = trainer(TrainOptions::default(), other_eps).resume(&checkpoints).unwrap_err().to_string();
    assert!(err.contains("its model is"), "{err}");

    let sgd = TrainOptions { optimizer: Optimizer::SgdMomentum { lr: 0.1, momentum: 0.9 }, ..TrainOptions::default() };
    let err = trainer(sgd, CONFIG).resume(&checkpoints).unwrap_err().to_string();
    assert!(err.contains("its optimizer is AdamW"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn only_the_newest_checkpoints_are_kept_and_a_background_save_is_the_same() {
    let dir = temp_dir("keep");
    let checkpoints = CheckpointDir::new(&dir, 2).unwrap();
    // What a killed writer of step 2 left, and a writer of step 9 that may still be at work
    // (another rank's shard): opening the folder again (as every rank does) removes neither;
    // the commit of step 2 removes the first, and the second is left.
    let orphan = ".step-0000000002.safetensors.tmp-1-2";
    let in_flight = ".step-0000000009.shard-1-of-2.safetensors.tmp-1-3";
    for name in [orphan, in_flight] {
        std::fs::write(dir.join(name), b"partial").unwrap();
    }
    CheckpointDir::new(&dir, 2).unwrap();
    assert!(dir.join(orphan).exists() && dir.join(in_flight).exists(), "opening the folder removed a file");
    let mut t = trainer(TrainOptions::default(), CONFIG);
    for s in 0..4 {
        run_steps(&mut t, s..s + 1, 1);
        if s < 3 {
            t.save(&checkpoints, serde_json::Value::Null).unwrap();
        } else {
            let pending = t.save_in_background(&checkpoints, serde_json::Value::Null).unwrap();
            assert!(pending.stall_s >= 0.0);
            pending.wait().unwrap();
        }
    }
    assert_eq!(checkpoints.steps().unwrap(), vec![3, 4]);
    let mut files: Vec<String> =
        std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
    files.sort();
    assert_eq!(
        files,
        [
            in_flight,
            "step-0000000003.json",
            "step-0000000003.safetensors",
            "step-0000000004.json",
            "step-0000000004.safetensors"
        ]
    );
    let mut fresh = trainer(TrainOptions::default(), CONFIG);
    assert_eq!(fresh.resume(&checkpoints).unwrap().step, 4);
    assert!(bits(&fresh) == bits(&t));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn the_schedule_warms_up_linearly_and_decays_by_a_cosine() {
    let s = LrSchedule::WarmupCosine { warmup: 4, total: 10, min_factor: 0.1 };
    let expected = [(0, 0.25), (3, 1.0), (4, 1.0), (7, 0.55), (10, 0.1), (20, 0.1)];
    for (step, factor) in expected {
        assert!((s.factor(step) - factor).abs() < 1e-12, "step {step}: {} vs {factor}", s.factor(step));
    }
    assert_eq!(LrSchedule::Constant.factor(1000), 1.0);
}

/// A batch of `step`'s images and labels for a small classifier (a pure function of the step).
fn images(step: u64) -> Labelled {
    let n = 4 * 3 * 32 * 32;
    let x: Vec<f32> = (0..n).map(|i| (((i as u64 * 31 + step * 17) % 97) as f32 / 48.0) - 1.0).collect();
    let labels: Vec<u32> = (0..4).map(|i| ((i + step) % 3) as u32).collect();
    Labelled {
        inputs: Tensor::from_vec(x, (4, 3, 32, 32), &Device::Cpu).unwrap(),
        labels: Tensor::from_vec(labels, 4, &Device::Cpu).unwrap(),
    }
}

fn buffers(model: &ResNet) -> Vec<(String, Vec<u32>)> {
    model
        .params
        .buffers()
        .map(|(name, b)| {
            let v: Vec<f32> = b.get().to_dtype(DType::F32).unwrap().to_vec1().unwrap();
            (name.clone(), v.iter().map(|x| x.to_bits()).collect())
        })
        .collect()
}

#[test]
fn batch_norm_running_statistics_are_saved_and_restored() {
    let dir = temp_dir("resnet-buffers");
    let checkpoints = CheckpointDir::new(&dir, 2).unwrap();
    let options =
        TrainOptions { optimizer: Optimizer::SgdMomentum { lr: 0.05, momentum: 0.9 }, ..TrainOptions::default() };
    let describe = serde_json::json!({"kind": "resnet18", "width": 4});
    let fresh = || ResNet::new(ResNetDepth::R18, 3, 4, DType::F32, &Device::Cpu).unwrap();
    let mut straight = Trainer::new(fresh(), describe.clone(), None, options).unwrap();
    // 20 buffers: a running mean and variance for each of the ten batch norms.
    assert_eq!(straight.buffer_infos().len(), 2 * 20);
    for s in 0..2 {
        straight.train_step(&[images(s)]).unwrap();
    }
    straight.save(&checkpoints, serde_json::Value::Null).unwrap();
    let saved = buffers(straight.model());
    for s in 2..4 {
        straight.train_step(&[images(s)]).unwrap();
    }

    let mut resumed = Trainer::new(fresh(), describe, None, options).unwrap();
    let untouched = buffers(resumed.model());
    resumed.resume(&checkpoints).unwrap();
    assert_ne!(saved, untouched, "training moved the running statistics");
    assert_eq!(buffers(resumed.model()), saved, "the running statistics were restored");
    for s in 2..4 {
        resumed.train_step(&[images(s)]).unwrap();
    }
    assert_eq!(buffers(resumed.model()), buffers(straight.model()));
    // Inference uses them: the two models agree to the bit in eval mode.
    let eval = |m: &ResNet| -> Vec<u32> {
        let y: Vec<f32> = m.forward(&images(9).inputs, false).unwrap().flatten_all().unwrap().to_vec1().unwrap();
        y.iter().map(|x| x.to_bits()).collect()
    };
    assert_eq!(eval(resumed.model()), eval(straight.model()));
    let _ = std::fs::remove_dir_all(&dir);
}
