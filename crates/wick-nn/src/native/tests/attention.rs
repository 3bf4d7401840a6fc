//! Attention's forward pass by blocks of query rows, against the composed form.

use candle_core::{DType, Device, Tensor};

use super::{check, randn};
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
