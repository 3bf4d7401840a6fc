//! The inference forms of the linear layers: separate weights as one projection, and the
//! products finished with GELU, a residual, or a residual and layer norm.

use candle_core::{DType, Result, Tensor};

use super::{check, max_rel_diff, randn, values};
use crate::ops;

/// Separate weights as one projection: with gradients through the stacked weights, as the
/// product of the stacked matrix; with none wanted, each product in its columns in place, in
/// memory not zero-filled first (the own kernel's few rows, the panels', the staged copies',
/// the crate's past them, split columns), against f64 in f32 and f64.
#[test]
fn stacked_linear_matches_the_stacked_weights() -> Result<()> {
    let (x, ws, bs) = (randn(&[2, 3, 6], 4), [randn(&[4, 6], 5), randn(&[2, 6], 6)], [randn(&[4], 7), randn(&[2], 8)]);
    let oracle = |t: &[Tensor]| {
        let w = Tensor::cat(&[&t[1], &t[2]], 0)?;
        t[0].broadcast_matmul(&w.t()?)?.broadcast_add(&Tensor::cat(&[&t[3], &t[4]], 0)?)
    };
    let inputs = [x, ws[0].clone(), ws[1].clone(), bs[0].clone(), bs[1].clone()];
    check("linear_stacked", &inputs, |t| ops::linear_stacked(&t[0], &[&t[1], &t[2]], Some(&[&t[3], &t[4]])), oracle);
    for (rows, k, outs) in
        [(40, 300, [50, 20, 70]), (150, 300, [200, 60, 90]), (150, 64, [30, 5, 9]), (2100, 64, [80, 7, 30])]
    {
        let x = randn(&[rows, k], 9);
        let ws: Vec<Tensor> = outs.iter().enumerate().map(|(i, &o)| randn(&[o, k], 10 + i as u64)).collect();
        let bs: Vec<Tensor> = outs.iter().enumerate().map(|(i, &o)| randn(&[o], 20 + i as u64)).collect();
        let truth = values(&x.matmul(&Tensor::cat(&ws, 0)?.t()?)?.broadcast_add(&Tensor::cat(&bs, 0)?)?);
        for dtype in [DType::F64, DType::F32] {
            let cast = |ts: &[Tensor]| ts.iter().map(|t| t.to_dtype(dtype)).collect::<Result<Vec<_>>>();
            let (ws, bs) = (cast(&ws)?, cast(&bs)?);
            let y = crate::no_grad(|| {
                ops::linear_stacked(
                    &x.to_dtype(dtype)?,
                    &ws.iter().collect::<Vec<_>>(),
                    Some(&bs.iter().collect::<Vec<_>>()),
                )
            })?;
            assert_eq!(y.dims(), &[rows, outs.iter().sum::<usize>()]);
            let tol = if dtype == DType::F64 { 1e-12 } else { 1e-5 };
            let diff = max_rel_diff(&values(&y), &truth);
            assert!(diff < tol, "{rows} × {k} → {outs:?} in {dtype:?}: {diff:e}");
        }
    }
    // Shapes that do not fit are errors.
    let (x, w) = (randn(&[3, 6], 1), randn(&[4, 6], 2));
    crate::no_grad(|| {
        assert!(ops::linear_stacked(&x, &[&w, &randn(&[4, 5], 3)], None).is_err());
        assert!(ops::linear_stacked(&x, &[&w, &w], Some(&[&randn(&[4], 3)])).is_err());
        assert!(ops::linear_stacked(&x, &[&w, &w], Some(&[&randn(&[4], 3), &randn(&[3], 4)])).is_err());
    });
    Ok(())
}

/// The fused inference epilogues give the separate ops' outputs bit for bit (f32 and f64, few
/// rows and many), keep the separate ops' gradients when one is wanted, and refuse operands that
/// do not fit.
#[test]
fn linear_epilogues_match_the_separate_ops() -> Result<()> {
    for (batch, seq, k, n) in [(2, 7, 150, 40), (3, 50, 300, 130)] {
        let (x, r) = (randn(&[batch, seq, k], 1), randn(&[batch, seq, n], 4));
        let (w, b) = (randn(&[n, k], 2), randn(&[n], 3));
        let (nw, nb) = (randn(&[n], 5), randn(&[n], 6));
        for dtype in [DType::F32, DType::F64] {
            let [x, w, b, r, nw, nb] = [&x, &w, &b, &r, &nw, &nb].map(|t| t.to_dtype(dtype).unwrap());
            let pairs = crate::no_grad(|| -> Result<Vec<(Tensor, Tensor)>> {
                let y = ops::linear(&x, &w, Some(&b))?;
                Ok(vec![
                    (ops::linear_gelu(&x, &w, &b)?, ops::gelu(&y)?),
                    (ops::linear_add(&x, &w, Some(&b), &r)?, ops::add(&y, &r)?),
                    (ops::linear_add(&x, &w, None, &r)?, ops::add(&ops::linear(&x, &w, None)?, &r)?),
                    (
                        ops::linear_add_layer_norm(&x, (&w, &b), &r, (&nw, &nb), 1e-5)?,
                        ops::layer_norm(&ops::add(&y, &r)?, &nw, &nb, 1e-5)?,
                    ),
                ])
            })?;
            for (i, (fused, separate)) in pairs.iter().enumerate() {
                assert_eq!(fused.dims(), separate.dims());
                assert_eq!(values(fused), values(separate), "epilogue {i}, {batch} × {seq} × {k} × {n}, {dtype:?}");
            }
        }
    }
    // With gradients: the separate ops, checked against their composition.
    let (x, w, b, r) = (randn(&[2, 3, 6], 7), randn(&[4, 6], 8), randn(&[4], 9), randn(&[2, 3, 4], 10));
    let (nw, nb) = (randn(&[4], 11), randn(&[4], 12));
    let oracle = |t: &[Tensor]| {
        let y = (t[0].broadcast_matmul(&t[1].t()?)?.broadcast_add(&t[2])? + &t[3])?;
        ops::layer_norm_composed(&y, &t[4], &t[5], 1e-5)
    };
    let inputs = [x.clone(), w.clone(), b.clone(), r.clone(), nw.clone(), nb.clone()];
    let fused = |t: &[Tensor]| ops::linear_add_layer_norm(&t[0], (&t[1], &t[2]), &t[3], (&t[4], &t[5]), 1e-5);
    check("linear_add_layer_norm", &inputs, fused, oracle);
    // Operands that do not fit.
    crate::no_grad(|| {
        assert!(ops::linear_add(&x, &w, Some(&b), &randn(&[2, 3, 5], 1)).is_err());
        assert!(ops::linear_gelu(&x, &w, &randn(&[3], 1)).is_err());
        assert!(ops::linear_gelu(&x, &randn(&[4, 5], 1), &b).is_err());
        assert!(ops::linear_add_layer_norm(&x, (&w, &b), &r, (&randn(&[3], 1), &nb), 1e-5).is_err());
    });
    Ok(())
}
