//! Attention's forward pass by blocks of query rows, against the composed form.

use candle_core::{DType, Device, Tensor, Var};

use super::{check, max_rel_diff, randn, values, weighted_sum};
use crate::{native, ops};

/// Sequences longer than one block of query rows: a causal mask (each block weighs only the keys
/// up to its last row, the rest left out), padding at the end of one sequence and in the middle
/// of the other, a row masked throughout (it weighs every key alike, as the composed form does),
/// no bias (blocks of every key), and q, k, v packed as the decoder projects them; values and
/// gradients against the composed form.
#[test]
fn attention_over_blocks_of_queries_matches_its_composed_form() {
    let (s, d) = (150, 4);
    let (q, k, v) = (randn(&[1, 2, s, d], 60), randn(&[1, 2, s, d], 61), randn(&[1, 2, s, d], 62));
    let causal = ops::causal_bias(s, DType::F64, &Device::Cpu).unwrap();
    let mut masks: Vec<f64> = (0..s).flat_map(|i| (0..s).map(move |j| if j > i { -1e4 } else { 0.0 })).collect();
    masks[70 * s..71 * s].fill(-1e4);
    let with_row = Tensor::from_vec(masks, (s, s), &Device::Cpu).unwrap();
    let pad: Vec<f64> = (0..2 * s).map(|i| if i >= 2 * s - 30 || i == 40 { -1e4 } else { 0.0 }).collect();
    let padding = Tensor::from_vec(pad, (2, 1, 1, s), &Device::Cpu).unwrap();
    let (qb, kb, vb) = (randn(&[2, 2, s, d], 63), randn(&[2, 2, s, d], 64), randn(&[2, 2, s, d], 65));
    for (name, inputs, bias) in [
        ("attention (causal, 150 tokens)", [&q, &k, &v], Some(&causal)),
        ("attention (causal and a masked row)", [&q, &k, &v], Some(&with_row)),
        ("attention (padding, 150 tokens)", [&qb, &kb, &vb], Some(&padding)),
        ("attention (no bias, 150 tokens)", [&q, &k, &v], None),
    ] {
        check(
            name,
            &inputs.map(|t| t.clone()),
            |t| native::attention::attention(&t[0], &t[1], &t[2], bias),
            |t| ops::attention_composed(&t[0], &t[1], &t[2], bias),
        );
    }
    let long = randn(&[1, 300, 24], 66);
    let split = |t: &Tensor, i: usize| t.narrow(2, i * 8, 8)?.reshape((1, 300, 2, 4))?.transpose(1, 2)?.contiguous();
    let merged = |o: Tensor| o.transpose(1, 2)?.reshape((1, 300, 8));
    let causal = ops::causal_bias(300, DType::F64, &Device::Cpu).unwrap();
    for (name, bias) in [("attention (packed, causal, 300 tokens)", Some(&causal)), ("attention (packed, 300)", None)] {
        check(
            name,
            std::slice::from_ref(&long),
            |t| native::attention::attention_packed(&t[0], 2, bias),
            |t| merged(ops::attention_composed(&split(&t[0], 0)?, &split(&t[0], 1)?, &split(&t[0], 2)?, bias)?),
        );
    }
}

/// In f32 (the vector softmax kernel, rows of 150 and 37 keys: tails under a mask), values and
/// gradients against the composed form in f64; in eval (no gradients: no log-sum-exps worked out)
/// the same values bit for bit as with gradients on; and a bias of another dtype than the
/// inputs (read through a conversion) gives what the same bias converted first gives.
#[test]
fn attention_in_f32_in_eval_and_with_a_bias_of_another_dtype() {
    let f32s = |t: &Tensor| t.to_dtype(DType::F32).unwrap();
    for s in [150, 37] {
        let d = 8;
        let inputs = [randn(&[2, 2, s, d], 70), randn(&[2, 2, s, d], 71), randn(&[2, 2, s, d], 72)];
        let causal = ops::causal_bias(s, DType::F64, &Device::Cpu).unwrap();
        for bias in [Some(&causal), None] {
            let name = format!("f32 attention, {s} keys, bias {}", bias.is_some());
            let vars: Vec<Var> = inputs.iter().map(|t| Var::from_tensor(&f32s(t)).unwrap()).collect();
            let b32 = bias.map(f32s);
            let out = native::attention::attention(&vars[0], &vars[1], &vars[2], b32.as_ref()).unwrap();
            let want = ops::attention_composed(&inputs[0], &inputs[1], &inputs[2], bias).unwrap();
            let diff = max_rel_diff(&values(&out), &values(&want));
            assert!(diff < 2e-6, "{name}: values differ by {diff:e}");
            // Gradients against the composed form's in f64.
            let grads = weighted_sum(&out).unwrap().backward().unwrap();
            let wvars: Vec<Var> = inputs.iter().map(|t| Var::from_tensor(t).unwrap()).collect();
            let wout = ops::attention_composed(&wvars[0], &wvars[1], &wvars[2], bias).unwrap();
            let wgrads = weighted_sum(&wout).unwrap().backward().unwrap();
            for (i, (v, w)) in vars.iter().zip(&wvars).enumerate() {
                let diff = max_rel_diff(&values(grads.get(v).unwrap()), &values(wgrads.get(w).unwrap()));
                assert!(diff < 2e-5, "{name}: gradient of input {i} differs by {diff:e}");
            }
            // Eval: untracked inputs, and tracked ones under no_grad.
            let plain: Vec<Tensor> = inputs.iter().map(f32s).collect();
            let untracked = native::attention::attention(&plain[0], &plain[1], &plain[2], b32.as_ref()).unwrap();
            let no_grad =
                crate::grad::no_grad(|| native::attention::attention(&vars[0], &vars[1], &vars[2], b32.as_ref()))
                    .unwrap();
            assert_eq!(values(&untracked), values(&out), "{name}: untracked inputs");
            assert_eq!(values(&no_grad), values(&out), "{name}: under no_grad");
        }
    }
    // A bias of another dtype: read through a conversion, as if converted first.
    let s = 40;
    let inputs = [randn(&[1, 2, s, 8], 73), randn(&[1, 2, s, 8], 74), randn(&[1, 2, s, 8], 75)];
    let pad: Vec<f32> = (0..s).map(|j| if j >= s - 5 { -1e4 } else { (j as f32 * 0.37).sin() }).collect();
    let bias = Tensor::from_vec(pad, (1, 1, 1, s), &Device::Cpu).unwrap();
    for (inputs_dtype, bias_dtype) in
        [(DType::F32, DType::BF16), (DType::F32, DType::F64), (DType::F64, DType::F32), (DType::F64, DType::BF16)]
    {
        let x: Vec<Tensor> = inputs.iter().map(|t| t.to_dtype(inputs_dtype).unwrap()).collect();
        let b = bias.to_dtype(bias_dtype).unwrap();
        let converted = b.to_dtype(inputs_dtype).unwrap();
        let got = native::attention::attention(&x[0], &x[1], &x[2], Some(&b)).unwrap();
        let want = native::attention::attention(&x[0], &x[1], &x[2], Some(&converted)).unwrap();
        assert_eq!(values(&got), values(&want), "{inputs_dtype:?} inputs, {bias_dtype:?} bias");
    }
}
