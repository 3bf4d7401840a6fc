//! AMP against f32 on every zoo model: the activations kept for backward, the step's peak and
//! the loss after training the same steps from the same start (target: activations ≤ 0.55×,
//! loss within 2 %; the one recorded miss is in `MISSES`), and every model's f32 and bf16
//! training against PyTorch's training of the same start (`TORCH_REFERENCE`). This binary
//! installs the counting allocator so the peaks are exact; its tests take turns.

use candle_core::{DType, Device};
use wick_nn::Autocast;
use wick_tools::trial::{task, train, trial_optimizer, TrialReport, MODELS};

wick::heap!(counting);

static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

const STEPS: usize = 12;

/// Model and dtype pairs that miss the 2 % loss target on this task, with the gap they must stay
/// under (a regression bound, not the target). MobileNetV2 in bf16 ends 2.8 % above f32 after 12
/// steps. PyTorch misses the target on the same start too: `scripts/torch-reference/amp_trial.py`
/// trains the exported start with `torch.autocast` bf16 and ends 2.2 % above f32; over 12
/// perturbed starts the gap averages 3.0 % in wick and 2.5 % in PyTorch, and they meet 2 % on 2
/// and 1 of 12 (BENCHMARKS.md). In both, the first step's bf16 gradients are about half noise
/// (median relative error 0.51–0.53 to f64) on this deep, batch-normalised network. The bound
/// also guards the masters' start: masters that start at the bf16-rounded weights instead of
/// the f32 ones make the gap 5 % (the bug this bound was tightened after).
const MISSES: &[(&str, &str, f32)] = &[("mobilenet_v2", "bf16", 0.035)];

/// PyTorch's training of the same starts (`fixtures/torch-amp-trial.json`, written by
/// `scripts/torch-reference/amp_trial.py --write-reference`): per model, the largest relative
/// difference allowed between wick's f32 losses and PyTorch's f64 losses at any step, and how far
/// above PyTorch autocast's bf16 gap (to PyTorch f64) wick's may be. Measured: f32 5.9e-7, 6.0e-8,
/// 1.4e-7, 1.4e-7, 5.6e-7, 3.8e-8 (before ReLU's gradient at 0 followed PyTorch's, ResNet-50's was 2.7e-4;
/// before BERT's padding row was frozen as Hugging Face's, BERT's was 2 %); gap excess 0.78,
/// 0.02, 0.02, 0.02, 0.02 and 0.00 points (the masters bug of BENCHMARKS.md made MobileNetV2's and
/// ResNet-50's 3.0 and 0.65). MobileNetV2's f32 training is sensitive to last-bit details —
/// PyTorch's own f32 ends 1.9e-3 from its f64, and wick's moved 3.8e-4 away from it when its
/// batch-norm statistics were summed in f64 — so its bound is PyTorch's f32-vs-f64 difference, not a multiple of
/// wick's lucky 5.9e-7.
const TORCH_REFERENCE: &[(&str, f64, f64)] = &[
    ("mobilenet_v2", 3e-3, 0.010),
    ("resnet18", 1e-5, 0.003),
    ("resnet50", 1e-5, 0.003),
    ("vit", 1e-5, 0.003),
    ("bert", 1e-5, 0.003),
    ("llama", 1e-5, 0.003),
];

/// PyTorch's (f64, autocast bf16) losses for `model`, when the reference has it.
fn torch_losses(model: &str) -> Option<(Vec<f64>, Vec<f64>)> {
    let reference: serde_json::Value = serde_json::from_str(include_str!("fixtures/torch-amp-trial.json")).ok()?;
    let losses = |kind: &str| -> Option<Vec<f64>> {
        reference["models"][model][kind].as_array()?.iter().map(|v| v.as_f64()).collect()
    };
    Some((losses("f64")?, losses("autocast_bf16")?))
}

/// Checks `full` (f32) and, for bf16, the gap of `amp` against PyTorch's training of the same
/// start; returns the failures.
fn check_against_torch(model: &str, full: &TrialReport, amp: &TrialReport) -> Vec<String> {
    let Some(&(_, f32_tolerance, gap_margin)) = TORCH_REFERENCE.iter().find(|(m, _, _)| *m == model) else {
        return Vec::new();
    };
    let Some((f64_losses, bf16_losses)) = torch_losses(model) else {
        return vec![format!("{model}: no PyTorch losses in fixtures/torch-amp-trial.json")];
    };
    let mut failures = Vec::new();
    if f64_losses.len() != full.losses.len() {
        failures.push(format!("{model}: {} PyTorch losses for {} of wick's", f64_losses.len(), full.losses.len()));
        return failures;
    }
    let worst = full.losses.iter().zip(&f64_losses).map(|(w, t)| (*w as f64 - t).abs() / t).fold(0.0, f64::max);
    println!(
        "|   ↳ {model}: f32 losses vs PyTorch f64, largest relative difference over the steps {worst:.1e} | | | | | |"
    );
    if worst > f32_tolerance {
        failures.push(format!("{model}: f32 training is {worst:.1e} from PyTorch's f64 (allowed {f32_tolerance:.0e})"));
    }
    if amp.dtype == "bf16" {
        let last = |l: &[f64]| l[l.len() - 1];
        let torch_gap = (last(&bf16_losses) - last(&f64_losses)).abs() / last(&f64_losses);
        let wick_gap = (*amp.losses.last().unwrap_or(&f32::NAN) as f64 - last(&f64_losses)).abs() / last(&f64_losses);
        println!(
            "|   ↳ {model}: bf16 gap to f64, wick {:.2} % vs PyTorch autocast {:.2} % | | | | | |",
            100.0 * wick_gap,
            100.0 * torch_gap
        );
        if wick_gap.is_nan() || wick_gap > torch_gap + gap_margin {
            failures.push(format!(
                "{model}: bf16 gap {:.2} % is more than {:.1} points above PyTorch autocast's {:.2} %",
                100.0 * wick_gap,
                100.0 * gap_margin,
                100.0 * torch_gap
            ));
        }
    }
    failures
}

fn run(model: &str, autocast: Autocast) -> TrialReport {
    let t = task(model, autocast, &Device::Cpu).unwrap_or_else(|e| panic!("{model}: {e}"));
    train(&t, autocast, STEPS, trial_optimizer()).unwrap_or_else(|e| panic!("{model} {autocast:?}: {e}"))
}

fn mib(b: usize) -> f64 {
    b as f64 / 1048576.0
}

fn compare(low: Autocast) {
    let _turn = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let mut failures = Vec::new();
    println!("\n| model | activations f32 → {0:?} MiB (ratio) | step peak f32 → {0:?} MiB (ratio) | loss at step 0 | loss after {STEPS} steps: f32 / {0:?} (difference) | skipped |", low.model_dtype());
    println!("|---|---|---|---|---|---|");
    for model in MODELS {
        let full = run(model, Autocast::off());
        let amp = run(model, low);
        let ratio = amp.activation_bytes as f64 / full.activation_bytes as f64;
        let (pf, pa) = (full.step_peak_bytes.unwrap_or(0), amp.step_peak_bytes.unwrap_or(0));
        let (lf, la) = (*full.losses.last().unwrap(), *amp.losses.last().unwrap());
        let diff = (la - lf).abs() / lf.abs();
        println!(
            "| {model} | {:.2} → {:.2} ({ratio:.3}) | {:.2} → {:.2} ({:.3}) | {:.4} | {lf:.4} / {la:.4} ({:.2} %) | {} |",
            mib(full.activation_bytes),
            mib(amp.activation_bytes),
            mib(pf),
            mib(pa),
            pa as f64 / pf as f64,
            full.losses[0],
            100.0 * diff,
            amp.skipped_steps
        );
        assert!(full.step_peak_bytes.is_some(), "the counting allocator is installed");
        if amp.losses.iter().chain(&full.losses).any(|l| !l.is_finite()) {
            failures.push(format!("{model}: a loss is not finite: {:?} / {:?}", full.losses, amp.losses));
        }
        // Training must have done something, or "same loss" means nothing.
        if lf > 0.98 * full.losses[0] {
            failures.push(format!("{model}: f32 loss did not fall ({} → {lf})", full.losses[0]));
        }
        if ratio > 0.55 {
            failures.push(format!("{model}: AMP keeps {ratio:.3} × the f32 activations (target ≤ 0.55)"));
        }
        let miss = MISSES.iter().find(|(m, d, _)| *m == model && *d == amp.dtype);
        match miss {
            Some((_, _, bound)) => {
                if diff > 0.02 {
                    println!(
                        "|   ↳ {model} {}: loss target missed ({:.2} % > 2 %), a known gap (see MISSES) | | | | | |",
                        amp.dtype,
                        100.0 * diff
                    );
                } else {
                    // The allowance stays for CPUs whose products widen to f32 (a larger gap).
                    println!(
                        "|   ↳ {model} {}: within 2 % here ({:.2} %; MISSES allows {:.1} %) | | | | | |",
                        amp.dtype,
                        100.0 * diff,
                        100.0 * bound
                    );
                }
                if diff > *bound {
                    failures.push(format!(
                        "{model}: loss gap {:.2} % grew past its recorded {:.0} %",
                        100.0 * diff,
                        100.0 * bound
                    ));
                }
            }
            None if diff > 0.02 => {
                failures
                    .push(format!("{model}: loss after {STEPS} steps differs by {:.2} % (target ≤ 2 %)", 100.0 * diff));
            }
            None => {}
        }
        failures.extend(check_against_torch(model, &full, &amp));
        // The masters and their state are f32 whatever the model's dtype: the same AdamW state
        // (two f32 moments per parameter) in both runs, an f32 master for each bf16/f16
        // parameter under AMP, and none for f32 ones (norms under AMP, every parameter in f32),
        // which are their own masters.
        assert_eq!(amp.master_bytes.1, full.master_bytes.1, "{model}: f32 optimizer state");
        let low_params = task(model, low, &Device::Cpu).unwrap_or_else(|e| panic!("{model}: {e}")).vars;
        let copies: usize = low_params.iter().filter(|v| v.dtype() != DType::F32).map(|v| 4 * v.elem_count()).sum();
        assert_eq!(amp.master_bytes.0, copies, "{model}: an f32 master for every low-precision parameter");
        assert_eq!(full.master_bytes.0, 0, "{model}: an f32 model has no master copies");
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

#[test]
fn bf16_autocast_halves_activations_and_trains_like_f32() {
    compare(Autocast::bf16());
}

#[test]
fn f16_autocast_with_loss_scaling_halves_activations_and_trains_like_f32() {
    compare(Autocast::f16());
}

/// Training steps on f32 masters leave the heap where it was: nothing from one step's graph is
/// kept by the masters, the optimizer state or the gradients (candle's parameter gradients carry
/// the graph of the ops that made them; the AMP code detaches them).
#[test]
fn master_weight_steps_do_not_accumulate_memory() {
    let _turn = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    for model in ["resnet18", "llama"] {
        for autocast in [Autocast::bf16(), Autocast::f16()] {
            let t = task(model, autocast, &Device::Cpu).unwrap();
            let mut masters = wick_train::amp::MasterWeights::new(&t.vars, trial_optimizer()).unwrap();
            let mut scaler = autocast.needs_loss_scaling().then(wick_train::amp::GradScaler::new);
            let refs: Vec<&candle_core::Var> = t.vars.iter().collect();
            let mut after = Vec::new();
            for _ in 0..4 {
                let loss = (t.loss)().unwrap();
                let mut grads = wick_train::amp::scaled_backward(&loss, scaler.as_ref()).unwrap();
                drop(loss);
                wick_train::amp::master_step(&mut grads, &mut masters, scaler.as_mut(), &refs).unwrap();
                drop(grads);
                after.push(wick::host_memory::counted_heap().unwrap());
            }
            // The first step creates the masters' own copies; after it the heap stays put.
            assert_eq!(after[1], after[3], "{model} {autocast:?}: heap after steps {after:?}");
        }
    }
}
