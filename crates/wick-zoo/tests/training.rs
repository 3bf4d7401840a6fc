//! Every zoo model trains: each parameter gets a finite, non-zero gradient; autograd agrees with
//! finite differences on a tiny configuration; a few steps on a synthetic task lower the loss.

use candle_core::{DType, Device, Tensor, Var};
use wick_nn::gradcheck::central_differences;
use wick_nn::params::Params;
use wick_nn::Model;
use wick_zoo::bert::{Bert, BertConfig};
use wick_zoo::llama::{Llama, LlamaConfig};

fn tiny_bert() -> BertConfig {
    BertConfig {
        vocab_size: 30,
        hidden_size: 16,
        num_hidden_layers: 2,
        num_attention_heads: 2,
        intermediate_size: 32,
        max_position_embeddings: 16,
        type_vocab_size: 2,
        layer_norm_eps: 1e-12,
        pad_token_id: Some(0),
    }
}

fn assert_all_gradients(params: &Params, grads: &candle_core::backprop::GradStore, skip: &[&str]) {
    let mut checked = 0;
    for (name, var) in params.iter() {
        if skip.contains(&name.as_str()) {
            continue;
        }
        let g = grads.get(var).unwrap_or_else(|| panic!("`{name}` received no gradient"));
        let values: Vec<f64> = g.flatten_all().unwrap().to_dtype(DType::F64).unwrap().to_vec1().unwrap();
        assert!(values.iter().all(|v| v.is_finite()), "`{name}` has a non-finite gradient");
        assert!(values.iter().any(|v| v.abs() > 0.0), "`{name}` has an all-zero gradient");
        checked += 1;
    }
    assert_eq!(checked + skip.len(), params.len());
}

/// Central differences for a few entries of one parameter, against autograd.
fn finite_difference(var: &Var, loss: impl Fn() -> f64, analytic: &Tensor, entries: &[usize]) {
    let shape = var.as_tensor().dims().to_vec();
    let base: Vec<f64> = var.as_tensor().flatten_all().unwrap().to_vec1().unwrap();
    let analytic: Vec<f64> = analytic.flatten_all().unwrap().to_vec1().unwrap();
    let numeric = central_differences(&base, entries, &[1e-6], &analytic, |v| {
        var.set(&Tensor::from_vec(v.to_vec(), shape.as_slice(), &Device::Cpu).unwrap()).unwrap();
        loss()
    });
    for (&i, numeric) in entries.iter().zip(numeric) {
        let err = (numeric - analytic[i]).abs();
        assert!(err <= 1e-6 + 1e-4 * numeric.abs(), "entry {i}: numeric {numeric}, autograd {}", analytic[i]);
    }
    var.set(&Tensor::from_vec(base, shape.as_slice(), &Device::Cpu).unwrap()).unwrap();
}

fn bert_batch() -> (Tensor, Tensor) {
    let ids = Tensor::new(&[[1u32, 5, 7, 9, 2, 0], [1, 4, 8, 2, 0, 0]], &Device::Cpu).unwrap();
    let mask = Tensor::new(&[[1u32, 1, 1, 1, 1, 0], [1, 1, 1, 1, 0, 0]], &Device::Cpu).unwrap();
    (ids, mask)
}

#[test]
fn bert_trains_every_parameter() {
    let model = Bert::new(tiny_bert(), DType::F64, &Device::Cpu).unwrap();
    let (ids, mask) = bert_batch();
    let target = wick_nn::params::normal_tensor(&[2, 16], 1.0, 5, DType::F64, &Device::Cpu).unwrap();
    let loss_of = |m: &Bert| -> Tensor {
        let pooled = Bert::mean_pool(&m.forward(&ids, &mask).unwrap(), &mask).unwrap();
        (pooled - &target).unwrap().sqr().unwrap().mean_all().unwrap()
    };
    let loss = loss_of(&model);
    let grads = loss.backward().unwrap();
    // Only segment 0 is used, so the second token-type row gets none; the tensor still does.
    assert_all_gradients(&model.params, &grads, &[]);
    for name in [
        "encoder.layer.1.attention.self.query.weight",
        "embeddings.LayerNorm.weight",
        "encoder.layer.0.output.dense.bias",
    ] {
        let var = model.params.get(name).unwrap();
        let scalar = || loss_of(&model).to_scalar::<f64>().unwrap();
        finite_difference(var, scalar, grads.get(var).unwrap(), &[0, 3, 7]);
    }
    let first = loss.to_scalar::<f64>().unwrap();
    for _ in 0..30 {
        let grads = loss_of(&model).backward().unwrap();
        model.params.sgd_step(&grads, 0.5).unwrap();
    }
    let last = loss_of(&model).to_scalar::<f64>().unwrap();
    assert!(last < 0.5 * first, "loss {first} -> {last}");
}

#[test]
fn llama_trains_every_parameter_and_learns_a_sequence() {
    let config = LlamaConfig {
        vocab_size: 16,
        hidden_size: 16,
        num_layers: 2,
        num_heads: 2,
        intermediate_size: 32,
        max_seq: 16,
        rms_eps: 1e-6,
        rope_theta: 10_000.0,
    };
    let model = Llama::new(config, DType::F64, &Device::Cpu).unwrap();
    // Synthetic task: counting sequences modulo the vocabulary, from several starting points.
    let rows: Vec<u32> = (0..4u32).flat_map(|s| (0..12u32).map(move |i| (s * 3 + i) % 16)).collect();
    let ids = Tensor::from_vec(rows, (4, 12), &Device::Cpu).unwrap();
    let loss = model.loss(&ids).unwrap();
    let grads = loss.backward().unwrap();
    assert_all_gradients(&model.params, &grads, &[]);
    for name in ["layers.0.q.weight", "layers.1.down.weight", "norm.weight"] {
        let var = model.params.get(name).unwrap();
        let scalar = || model.loss(&ids).unwrap().to_scalar::<f64>().unwrap();
        finite_difference(var, scalar, grads.get(var).unwrap(), &[0, 5, 11]);
    }
    let first = loss.to_scalar::<f64>().unwrap();
    for _ in 0..60 {
        let grads = model.loss(&ids).unwrap().backward().unwrap();
        model.params.sgd_step(&grads, 1.0).unwrap();
    }
    let last = model.loss(&ids).unwrap().to_scalar::<f64>().unwrap();
    assert!(last < 0.5 * first, "loss {first} -> {last}");
    assert!(Llama::new(LlamaConfig { num_heads: 3, ..config }, DType::F32, &Device::Cpu).is_err());
}
