//! Gradient clipping in the trainer against PyTorch's `clip_grad_norm_` (the losses, the norms it
//! returned and the parameters after eight steps of AdamW and of SGD with momentum, saved by
//! `scripts/torch-reference/clip_grad_norm.py` in `fixtures/torch-clip.json`), and a non-finite
//! norm refused with nothing changed.

use candle_core::{DType, Device, Tensor};
use wick_nn::params::Params;
use wick_nn::{Checkpointing, Model, NnError};
use wick_train::optim::AdamW;
use wick_train::trainer::{TrainOptions, Trainer};
use wick_train::Optimizer;

/// `scale · sin(seed + 0.7·k + 0.3·k²/n)` over the flat index `k`: the script's closed form.
fn values(shape: &[usize], seed: f64, scale: f64) -> Tensor {
    let n: usize = shape.iter().product();
    let flat: Vec<f32> =
        (0..n).map(|k| (scale * (seed + 0.7 * k as f64 + 0.3 * (k * k) as f64 / n as f64).sin()) as f32).collect();
    Tensor::from_vec(flat, shape, &Device::Cpu).unwrap()
}

/// 6 → 8, tanh, → 3, mean squared error: the script's model.
struct Mlp {
    params: Params,
}

impl Mlp {
    fn new() -> Mlp {
        let mut params = Params::with_seed(0);
        for (name, shape, seed, scale) in
            [("w1", &[8, 6][..], 1.0, 0.6), ("b1", &[8], 2.0, 0.1), ("w2", &[3, 8], 3.0, 0.5), ("b2", &[3], 4.0, 0.1)]
        {
            params.insert(name, values(shape, seed, scale)).unwrap();
        }
        Mlp { params }
    }

    fn get(&self, name: &str) -> Tensor {
        self.params.get(name).unwrap().as_tensor().clone()
    }
}

impl Model for Mlp {
    type Batch = (Tensor, Tensor);

    fn params(&self) -> &Params {
        &self.params
    }

    fn loss_with(&self, (x, target): &(Tensor, Tensor), _: Option<&Checkpointing>) -> Result<Tensor, NnError> {
        let h = x.matmul(&self.get("w1").t()?)?.broadcast_add(&self.get("b1"))?.tanh()?;
        let y = h.matmul(&self.get("w2").t()?)?.broadcast_add(&self.get("b2"))?;
        Ok((y - target)?.sqr()?.mean_all()?)
    }
}

fn batch() -> (Tensor, Tensor) {
    (values(&[5, 6], 5.0, 1.0), values(&[5, 3], 6.0, 2.0))
}

fn trainer(optimizer: Optimizer, clip: Option<f64>) -> Trainer<Mlp> {
    let options = TrainOptions { optimizer, clip_grad_norm: clip, ..TrainOptions::default() };
    Trainer::new(Mlp::new(), serde_json::json!({"model": "mlp"}), None, options).unwrap()
}

fn flat(t: &Trainer<Mlp>, name: &str) -> Vec<f32> {
    t.model().get(name).flatten_all().unwrap().to_vec1().unwrap()
}

fn close(a: f64, b: f64, tol: f64) -> bool {
    (a - b).abs() <= tol * b.abs().max(1e-3)
}

#[test]
fn clipped_training_follows_pytorch() {
    let reference: serde_json::Value =
        serde_json::from_str(include_str!("fixtures/torch-clip.json")).expect("the fixture is JSON");
    let runs = reference["runs"].as_array().expect("runs");
    assert_eq!(runs.len(), 2);
    for run in runs {
        let kind = run["kind"].as_str().unwrap_or_default();
        let (lr, max_norm) = (run["lr"].as_f64().unwrap(), run["max_norm"].as_f64().unwrap());
        let optimizer = match kind {
            "adamw" => Optimizer::AdamW(AdamW { lr, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.01 }),
            _ => Optimizer::SgdMomentum { lr, momentum: 0.9 },
        };
        let mut t = trainer(optimizer, Some(max_norm));
        let mut plain = trainer(optimizer, None);
        let (mut clipped, mut within) = (0, 0);
        for (step, (want_loss, want_norm)) in
            run["losses"].as_array().unwrap().iter().zip(run["norms"].as_array().unwrap()).enumerate()
        {
            let r = t.train_step(&[batch()]).unwrap();
            let (want_loss, want_norm) = (want_loss.as_f64().unwrap(), want_norm.as_f64().unwrap());
            let norm = r.grad_norm.expect("a clipped step reports its norm");
            assert!(close(f64::from(r.loss), want_loss, 1e-5), "{kind} step {step}: loss {} vs {want_loss}", r.loss);
            assert!(close(norm, want_norm, 1e-5), "{kind} step {step}: norm {norm} vs {want_norm}");
            if want_norm > max_norm {
                clipped += 1
            } else {
                within += 1
            }
            assert_eq!(plain.train_step(&[batch()]).unwrap().grad_norm, None);
        }
        // The fixture has steps on both sides of the bound.
        assert!(clipped >= 2 && within >= 2, "{kind}: {clipped} clipped, {within} within");
        let mut apart = 0f32;
        for (name, want) in run["params"].as_object().unwrap() {
            let want: Vec<f32> = want.as_array().unwrap().iter().map(|v| v.as_f64().unwrap() as f32).collect();
            let got = flat(&t, name);
            assert_eq!(got.len(), want.len(), "{kind} {name}");
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                assert!((g - w).abs() <= 2e-5 * w.abs().max(1.0), "{kind} {name}[{i}]: {g} vs {w}");
            }
            apart = flat(&plain, name).iter().zip(&got).fold(apart, |m, (p, g)| m.max((p - g).abs()));
        }
        // Without clipping the run ends elsewhere: the bound did something.
        assert!(apart > 1e-3, "{kind}: the unclipped run ends {apart} away");
    }
}

#[test]
fn a_non_finite_norm_is_refused_and_the_run_goes_on() {
    let adamw = Optimizer::AdamW(AdamW { lr: 0.05, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.01 });
    let mut t = trainer(adamw, Some(1.0));
    t.train_step(&[batch()]).unwrap();
    let before: Vec<Vec<f32>> = ["b1", "b2", "w1", "w2"].iter().map(|n| flat(&t, n)).collect();
    let (x, target) = batch();
    let bad = x.broadcast_mul(&Tensor::new(&[f32::INFINITY, 1.0, 1.0, 1.0, 1.0, 1.0], &Device::Cpu).unwrap()).unwrap();
    let err = t.train_step(&[(bad, target)]).err().map(|e| e.to_string()).unwrap_or_default();
    assert!(err.contains("total norm is") && err.contains("parameters are unchanged"), "{err}");
    let after: Vec<Vec<f32>> = ["b1", "b2", "w1", "w2"].iter().map(|n| flat(&t, n)).collect();
    assert_eq!(before, after);
    assert_eq!((t.step(), t.masters().steps()), (1, 1));
    // The run continues as one that never saw the bad batch.
    let mut straight = trainer(adamw, Some(1.0));
    straight.train_step(&[batch()]).unwrap();
    assert_eq!(t.train_step(&[batch()]).unwrap(), straight.train_step(&[batch()]).unwrap());
    assert_eq!(flat(&t, "w1"), flat(&straight, "w1"));
    // A bound that is not a positive number is refused before any work.
    let mut wrong = trainer(adamw, Some(-1.0));
    let err = wrong.train_step(&[batch()]).err().map(|e| e.to_string()).unwrap_or_default();
    assert!(err.contains("positive finite"), "{err}");
    assert_eq!(
        wrong.model().get("w1").to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap(),
        flat(&trainer(adamw, None), "w1")
    );
}
