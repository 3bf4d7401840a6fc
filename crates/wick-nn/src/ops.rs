//! Differentiable building blocks. candle's fused `softmax_last_dim`, `layer_norm`, `rms_norm`,
//! `rope` and `sdpa` compute the right values but drop gradients without an error, so wick
//! composes these from primitive ops, each of which has a backward pass in candle. Norms,
//! attention, RoPE and the loss are then wrapped as single graph nodes ([`crate::fused::node`]):
//! the graph keeps their inputs, not their intermediates, and the f32-class ones compute in f32
//! under autocast ([`crate::Autocast`]). Every function here is checked against finite
//! differences in its tests, and each node against its composed form.

use candle_core::{DType, Result, Tensor, D};

use crate::autocast::fp32_compute;
use crate::fused::node;
use crate::native;

/// Softmax over the last dimension, stabilised by subtracting the row maximum (which carries no
/// gradient of its own: softmax is invariant to the shift).
pub fn softmax_last_dim(x: &Tensor) -> Result<Tensor> {
    let max = x.max_keepdim(D::Minus1)?.detach();
    let e = x.broadcast_sub(&max)?.exp()?;
    e.broadcast_div(&e.sum_keepdim(D::Minus1)?)
}

/// Log-softmax over the last dimension.
pub fn log_softmax_last_dim(x: &Tensor) -> Result<Tensor> {
    let max = x.max_keepdim(D::Minus1)?.detach();
    let shifted = x.broadcast_sub(&max)?;
    shifted.broadcast_sub(&shifted.exp()?.sum_keepdim(D::Minus1)?.log()?)
}

/// Rows `ids` (a 1-D tensor of integer ids) of `table` (vocab, dim), as one node: the table's
/// gradient adds up the gradients of every occurrence of a row, and candle's CPU `index_add`
/// accumulates in the table's dtype, so under autocast the sums are made in f32 and rounded once.
pub fn embedding(table: &Tensor, ids: &Tensor) -> Result<Tensor> {
    if native::serves_either(table) {
        return native::loss::embedding(table, ids, None);
    }
    node("embedding", &[ids, table], table.dtype(), table.dtype(), |t| t[1].embedding(&t[0]))
}

/// [`embedding`] in which the row `padding` (when given) gets no gradient, as PyTorch's
/// `nn.Embedding(padding_idx=…)`: its lookups come from a detached copy of the table, so the
/// forward values are the same and only the gradient differs.
pub fn embedding_with_padding(table: &Tensor, ids: &Tensor, padding: Option<u32>) -> Result<Tensor> {
    let Some(pad) = padding else { return embedding(table, ids) };
    if native::serves_either(table) {
        return native::loss::embedding(table, ids, Some(pad));
    }
    node("embedding", &[ids, table], table.dtype(), table.dtype(), move |t| {
        let (ids, table) = (&t[0], &t[1]);
        let rows = table.embedding(ids)?;
        let frozen = table.detach().embedding(ids)?;
        let is_pad = ids.eq(pad as f64)?.unsqueeze(D::Minus1)?.broadcast_as(rows.shape())?;
        is_pad.where_cond(&frozen, &rows)
    })
}

/// `x + a + b` with `a` and `b` broadcast to `x`'s shape (position and type embeddings added
/// to every sequence), as one node whose backward sums the broadcast gradients in f32.
pub fn add_broadcast(x: &Tensor, a: &Tensor, b: &Tensor) -> Result<Tensor> {
    if native::serves_either(x) {
        return native::loss::add_broadcast(x, a, b);
    }
    node("add", &[x, a, b], x.dtype(), x.dtype(), |t| t[0].broadcast_add(&t[1])?.broadcast_add(&t[2]))
}

/// ReLU with PyTorch's gradient, as one node that keeps its input. candle's own `relu` passes
/// the gradient where the input is exactly 0 (its backward tests `x >= 0`); PyTorch's passes it
/// only where `x > 0`. Exact zeros are common, not a corner case: in a residual block whose last
/// norm scale starts at 0 (`zero_init_residual`) the final ReLU's input is the previous ReLU's
/// output, zeros included, and candle's rule then changed the first gradients of ResNet-50's
/// residual norms completely (relative error 1 against PyTorch in f64). NaN propagates.
pub fn relu(x: &Tensor) -> Result<Tensor> {
    if native::serves_either(x) {
        return native::act::relu(x);
    }
    node("relu", &[x], x.dtype(), x.dtype(), |t| relu_composed(&t[0], None))
}

/// ReLU6 (`min(max(x, 0), 6)`) with PyTorch's gradient (`hardtanh`'s: only where 0 < x < 6), as
/// one node that keeps its input (candle's `clamp` keeps two tensors and halves the gradient
/// where `x` equals a bound). NaN propagates.
pub fn relu6(x: &Tensor) -> Result<Tensor> {
    if native::serves_either(x) {
        return native::act::relu6(x);
    }
    node("relu6", &[x], x.dtype(), x.dtype(), |t| relu_composed(&t[0], Some(6.0)))
}

/// `a + b` (a residual connection). On the CPU, for same-shaped bf16 or f16 inputs, one op that
/// computes the sum in f32 inside its vectorised loop (candle's bf16 addition converts eight
/// elements per out-of-line call); the same values, rounded once. candle's `+` otherwise (in
/// f32 it is as fast, without a custom op's overhead).
pub fn add(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    let low = matches!(a.dtype(), DType::BF16 | DType::F16);
    if low && native::serves(a) && a.shape() == b.shape() && a.dtype() == b.dtype() {
        return native::act::add(a, b);
    }
    a + b
}

/// `relu(a + b)` (the end of a residual block) with PyTorch's gradient: one op on the CPU that
/// neither stores nor keeps the sum (backward recomputes it); `relu(a + b)` elsewhere.
pub fn add_relu(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    if native::serves_either(a) {
        return native::act::add_relu(a, b);
    }
    relu(&(a + b)?)
}

/// GELU (erf form) as one op keeping its input: computed in f32 (f64 for f64) and rounded once
/// on the CPU; candle's `gelu_erf` elsewhere.
pub fn gelu(x: &Tensor) -> Result<Tensor> {
    if native::serves_either(x) {
        return native::act::gelu(x);
    }
    x.gelu_erf()
}

/// [`silu_mul`] of the two halves of a packed (…, 2·I) tensor (`a` then `b` along the last
/// dimension), as one fused gate-and-up projection writes them: one projection instead of two,
/// and no gradient of their shared input summed by candle.
pub fn silu_mul_packed(u: &Tensor) -> Result<Tensor> {
    if native::serves_either(u) {
        return native::act::silu_mul_packed(u);
    }
    let half = u.dim(D::Minus1)? / 2;
    silu_mul(&u.narrow(D::Minus1, 0, half)?, &u.narrow(D::Minus1, half, half)?)
}

/// `silu(a)·b` (SwiGLU's gate) as one op keeping `a` and `b`: computed in f32 (f64 for f64) on
/// the CPU; candle's `silu` and `mul` elsewhere.
pub fn silu_mul(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    if native::serves_either(a) {
        return native::act::silu_mul(a, b);
    }
    a.silu()? * b
}

/// ReLU (`max` None) or ReLU6 (`max` 6) composed from candle's ops with PyTorch's gradient (the
/// oracle of the CPU kernels, and the op elsewhere): `x` clamped to `[0, max]` by selection, so
/// that autograd passes the gradient only strictly inside (comparisons carry no gradient) and
/// NaN, which fails both tests, passes through.
pub fn relu_composed(x: &Tensor, max: Option<f64>) -> Result<Tensor> {
    // The bounds as broadcast scalars: no full-size constant tensors.
    let bound = |v: f64| Tensor::new(v, x.device())?.to_dtype(x.dtype())?.broadcast_as(x.shape());
    let y = x.le(0.0)?.where_cond(&bound(0.0)?, x)?;
    match max {
        Some(max) => x.ge(max)?.where_cond(&bound(max)?, &y),
        None => Ok(y),
    }
}

/// `x @ weightᵀ (+ bias)` for `x` (..., in) and `weight` (out, in): a low-precision op under
/// autocast (the matmul runs in `x`'s dtype), as one node whose backward accumulates the weight
/// and bias gradients in f32.
pub fn linear(x: &Tensor, weight: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
    if native::serves_either(x) {
        return native::linear::linear(x, weight, bias);
    }
    let f = |t: &[Tensor]| -> Result<Tensor> {
        // candle's CUDA product takes rows only at their natural stride: a strided input (ViT's
        // class token, one row of each sequence) is made contiguous first (a no-op when it is).
        let y = t[0].contiguous()?.broadcast_matmul(&t[1].t()?)?;
        match t.get(2) {
            Some(b) => y.broadcast_add(b),
            None => Ok(y),
        }
    };
    match bias {
        Some(b) => node("linear", &[x, weight, b], x.dtype(), x.dtype(), f),
        None => node("linear", &[x, weight], x.dtype(), x.dtype(), f),
    }
}

/// True when `inputs` (the first one the op's input) want no gradient — inside
/// [`crate::no_grad`], or none tracked — and lie on the CPU in f32 or f64, all of one dtype: the
/// fused inference forms of the linear layers below apply.
fn cpu_inference(inputs: &[&Tensor]) -> bool {
    let Some(first) = inputs.first() else { return false };
    let no_grad_wanted = !crate::grad_enabled() || !inputs.iter().any(|t| t.track_op());
    no_grad_wanted
        && native::serves(first)
        && matches!(first.dtype(), DType::F32 | DType::F64)
        && inputs.iter().all(|t| t.dtype() == first.dtype())
}

/// [`linear`] of `x` and the weights stacked (`[W₀; W₁; …]`, their biases likewise): Q, K and V,
/// or a gate and its up projection, as one projection that the model keeps as separate
/// parameters. With no gradient wanted on the CPU in f32 or f64 (see [`linear_gelu`]), each
/// weight's product is written into its columns of the output in place; otherwise the weights
/// are stacked (a copy of them all) and passed to [`linear`], whose node gives each its gradient
/// through the stacking.
pub fn linear_stacked(x: &Tensor, weights: &[&Tensor], biases: Option<&[&Tensor]>) -> Result<Tensor> {
    let mut inputs = vec![x];
    inputs.extend(weights.iter().copied().chain(biases.unwrap_or(&[]).iter().copied()));
    if cpu_inference(&inputs) {
        return native::linear::linear_stacked(x, weights, biases);
    }
    let bias = biases.map(|b| Tensor::cat(b, 0)).transpose()?;
    linear(x, &Tensor::cat(weights, 0)?, bias.as_ref())
}

/// `gelu(linear(x, weight, bias))`, a transformer's feed-forward expansion. With no gradient
/// wanted (inside [`crate::no_grad`], or no input tracked) on the CPU in f32 or f64 every
/// operand of one dtype, GELU is applied as each row of the product is finished (one pass, no
/// intermediate tensor), equal to the two ops' output bit for bit; otherwise the two ops.
pub fn linear_gelu(x: &Tensor, weight: &Tensor, bias: &Tensor) -> Result<Tensor> {
    if cpu_inference(&[x, weight, bias]) {
        return native::epilogue::linear_then(x, weight, Some(bias), native::epilogue::Then::Gelu);
    }
    gelu(&linear(x, weight, Some(bias))?)
}

/// `add(linear(x, weight, bias), residual)`, a pre-norm block's projection back onto its
/// residual stream (`residual` has the output's shape); fused for inference as [`linear_gelu`].
pub fn linear_add(x: &Tensor, weight: &Tensor, bias: Option<&Tensor>, residual: &Tensor) -> Result<Tensor> {
    let mut inputs = vec![x, weight, residual];
    inputs.extend(bias);
    if cpu_inference(&inputs) {
        return native::epilogue::linear_then(x, weight, bias, native::epilogue::Then::Add(residual));
    }
    add(&linear(x, weight, bias)?, residual)
}

/// `layer_norm(add(linear(x, weight, bias), residual), norm_weight, norm_bias, eps)`, the end of
/// a post-norm block (BERT's); fused for inference as [`linear_gelu`].
pub fn linear_add_layer_norm(
    x: &Tensor,
    (weight, bias): (&Tensor, &Tensor),
    residual: &Tensor,
    (norm_weight, norm_bias): (&Tensor, &Tensor),
    eps: f64,
) -> Result<Tensor> {
    if cpu_inference(&[x, weight, bias, residual, norm_weight, norm_bias]) {
        let then = native::epilogue::Then::AddLayerNorm { residual, weight: norm_weight, bias: norm_bias, eps };
        return native::epilogue::linear_then(x, weight, Some(bias), then);
    }
    layer_norm(&add(&linear(x, weight, Some(bias))?, residual)?, norm_weight, norm_bias, eps)
}

/// Layer normalisation over the last dimension with an affine transform, composed from
/// primitive ops (every intermediate is kept by the graph; see [`layer_norm`]).
pub fn layer_norm_composed(x: &Tensor, weight: &Tensor, bias: &Tensor, eps: f64) -> Result<Tensor> {
    let mean = x.mean_keepdim(D::Minus1)?;
    let centered = x.broadcast_sub(&mean)?;
    let var = centered.sqr()?.mean_keepdim(D::Minus1)?;
    let normed = centered.broadcast_div(&(var + eps)?.sqrt()?)?;
    normed.broadcast_mul(weight)?.broadcast_add(bias)
}

/// Layer normalisation over the last dimension with an affine transform: one graph node that
/// computes in f32 (f64 for f64 inputs) and returns the input's dtype (an f32-class op under
/// autocast).
pub fn layer_norm(x: &Tensor, weight: &Tensor, bias: &Tensor, eps: f64) -> Result<Tensor> {
    if native::serves_either(x) {
        return native::row_norm::layer_norm(x, weight, bias, eps);
    }
    node("layer_norm", &[x, weight, bias], fp32_compute(x.dtype()), x.dtype(), move |t| {
        layer_norm_composed(&t[0], &t[1], &t[2], eps)
    })
}

/// RMS normalisation composed from primitive ops (see [`rms_norm`]).
pub fn rms_norm_composed(x: &Tensor, weight: &Tensor, eps: f64) -> Result<Tensor> {
    let ms = x.sqr()?.mean_keepdim(D::Minus1)?;
    x.broadcast_div(&(ms + eps)?.sqrt()?)?.broadcast_mul(weight)
}

/// RMS normalisation over the last dimension (LLaMA): one graph node computing in f32.
pub fn rms_norm(x: &Tensor, weight: &Tensor, eps: f64) -> Result<Tensor> {
    if native::serves_either(x) {
        return native::row_norm::rms_norm(x, weight, eps);
    }
    node("rms_norm", &[x, weight], fp32_compute(x.dtype()), x.dtype(), move |t| rms_norm_composed(&t[0], &t[1], eps))
}

/// Cross-entropy of `logits` (N, C) against integer `targets` (N), averaged, composed from
/// primitive ops.
pub fn cross_entropy_composed(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
    let logp = log_softmax_last_dim(logits)?;
    let picked = logp.gather(&targets.unsqueeze(1)?, 1)?;
    picked.mean_all()?.neg()
}

/// Cross-entropy of `logits` (N, C) against integer `targets` (N), averaged: one graph node that
/// computes in f32 and returns f32 whatever the logits' dtype (losses are f32-class ops).
pub fn cross_entropy(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
    if native::serves_either(logits) {
        return native::loss::cross_entropy(logits, targets);
    }
    let compute = fp32_compute(logits.dtype());
    let targets = targets.clone();
    node("cross_entropy", &[logits], compute, compute, move |t| cross_entropy_composed(&t[0], &targets))
}

/// Rotary position embedding applied to `x` of shape (batch, heads, seq, head_dim), rotating
/// pairs (i, i + head_dim/2) as in LLaMA, with precomputed `cos`/`sin` of shape (seq, head_dim/2).
/// One graph node in `x`'s dtype (the tables are constants).
pub fn rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    if native::serves_either(x) {
        return native::rope::rope(x, cos, sin);
    }
    let (cos, sin) = (cos.clone(), sin.clone());
    // The tables follow the input's dtype (backward recomputes in f32).
    node("rope", &[x], x.dtype(), x.dtype(), move |t| {
        rope_composed(&t[0], &cos.to_dtype(t[0].dtype())?, &sin.to_dtype(t[0].dtype())?)
    })
}

/// [`rope`] of the q and k inside a packed (B, S, 3·H·D) projection (q, k and v side by side,
/// each with its `heads` side by side, as [`attention_packed`] reads it); v passes through. One
/// fused projection, rotation and attention instead of three projections, their head splits and
/// two rotations (whose input, used three times, had its gradient summed by candle).
pub fn rope_packed(qkv: &Tensor, heads: usize, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    if native::serves_either(qkv) {
        return native::rope::rope_packed(qkv, heads, cos, sin);
    }
    let (n, t, e) = qkv.dims3()?;
    if heads == 0 || e % (3 * heads) != 0 {
        candle_core::bail!("rope: packed q, k, v of width {e} do not split into 3 × {heads} heads");
    }
    let (h, hd) = (e / 3, e / (3 * heads));
    let part = |i: usize| qkv.narrow(2, i * h, h)?.reshape((n, t, heads, hd))?.transpose(1, 2);
    let rotated = |i: usize| rope(&part(i)?.contiguous()?, cos, sin)?.transpose(1, 2)?.reshape((n, t, h));
    Tensor::cat(&[rotated(0)?, rotated(1)?, qkv.narrow(2, 2 * h, h)?], 2)
}

/// [`rope`] composed from primitive ops.
pub fn rope_composed(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let half = x.dim(D::Minus1)? / 2;
    let x1 = x.narrow(D::Minus1, 0, half)?;
    let x2 = x.narrow(D::Minus1, half, half)?;
    let rotated_1 = (x1.broadcast_mul(cos)? - x2.broadcast_mul(sin)?)?;
    let rotated_2 = (x1.broadcast_mul(sin)? + x2.broadcast_mul(cos)?)?;
    Tensor::cat(&[rotated_1, rotated_2], D::Minus1)
}

/// cos/sin tables for [`rope`]: positions `0..seq`, frequencies `theta^(-2i/dim)`.
pub fn rope_tables(
    seq: usize,
    head_dim: usize,
    theta: f64,
    dtype: DType,
    device: &candle_core::Device,
) -> Result<(Tensor, Tensor)> {
    let half = head_dim / 2;
    let inv: Vec<f32> = (0..half).map(|i| (1.0 / theta.powf(2.0 * i as f64 / head_dim as f64)) as f32).collect();
    let inv = Tensor::from_vec(inv, (1, half), device)?;
    let pos = Tensor::arange(0u32, seq as u32, device)?.to_dtype(DType::F32)?.reshape((seq, 1))?;
    let angles = pos.broadcast_mul(&inv)?;
    Ok((angles.cos()?.to_dtype(dtype)?, angles.sin()?.to_dtype(dtype)?))
}

/// Scaled dot-product attention composed from primitive ops: the matmuls in the inputs' dtype,
/// the scaled scores, bias and softmax in f32 (f64 for f64 inputs), probabilities cast back to
/// the inputs' dtype for the second matmul — autocast's policy, written out.
pub fn attention_composed(q: &Tensor, k: &Tensor, v: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
    let scale = 1.0 / (q.dim(D::Minus1)? as f64).sqrt();
    let wide = fp32_compute(q.dtype());
    let scores = (q.matmul(&k.t()?.contiguous()?)?.to_dtype(wide)? * scale)?;
    let scores = match bias {
        Some(b) => scores.broadcast_add(&b.to_dtype(wide)?)?,
        None => scores,
    };
    softmax_last_dim(&scores)?.to_dtype(v.dtype())?.matmul(v)
}

/// Scaled dot-product attention over (batch, heads, seq, head_dim) with an additive `bias`
/// broadcastable to (batch, heads, seq_q, seq_k) (0 where attending, a large negative elsewhere).
/// One graph node: only q, k and v are kept, never the (seq × seq) scores or probabilities, which
/// backward recomputes.
pub fn attention(q: &Tensor, k: &Tensor, v: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
    if native::serves_attention(q, q.dim(D::Minus1)?) {
        return native::attention::attention(q, k, v, bias);
    }
    let bias = bias.cloned();
    node("attention", &[q, k, v], q.dtype(), q.dtype(), move |t| attention_composed(&t[0], &t[1], &t[2], bias.as_ref()))
}

/// Self-attention of `qkv` (batch, seq, 3·heads·head_dim: q, k and v side by side, as one fused
/// projection writes them) into (batch, seq, heads·head_dim), the heads side by side — the same
/// values as splitting q, k and v into (batch, heads, seq, head_dim), [`attention`], and merging
/// the heads back. On the CPU one op reads the packed layout in place: no split copies of q, k
/// and v, no merge copy of the output, and in backward one packed gradient instead of three
/// padded ones summed.
pub fn attention_packed(qkv: &Tensor, heads: usize, bias: Option<&Tensor>) -> Result<Tensor> {
    let head_dim = if heads == 0 { 0 } else { qkv.dim(D::Minus1)? / (3 * heads) };
    if native::serves_attention(qkv, head_dim) {
        return native::attention::attention_packed(qkv, heads, bias);
    }
    let (n, t, e) = qkv.dims3()?;
    if heads == 0 || e % (3 * heads) != 0 {
        candle_core::bail!("attention: packed q, k, v of width {e} do not split into 3 × {heads} heads");
    }
    let (h, hd) = (e / 3, e / (3 * heads));
    let split = |i: usize| qkv.narrow(2, i * h, h)?.reshape((n, t, heads, hd))?.transpose(1, 2)?.contiguous();
    attention(&split(0)?, &split(1)?, &split(2)?, bias)?.transpose(1, 2)?.reshape((n, t, h))
}

/// An additive causal mask (seq, seq): 0 on and below the diagonal, `-1e4` above. A finite value
/// keeps low-precision dtypes free of NaN (exp underflows to exactly 0 either way in f32).
pub fn causal_bias(seq: usize, dtype: DType, device: &candle_core::Device) -> Result<Tensor> {
    let len = seq
        .checked_mul(seq)
        .ok_or_else(|| candle_core::Error::Msg(format!("causal_bias: {seq} × {seq} elements overflow")))?;
    // Zeros, then each row's part above the diagonal filled (a per-element `flat_map` collect
    // was 1 M closures and capacity checks at 1 024 tokens, once per forward pass).
    let mut mask = vec![0f32; len];
    for (i, row) in mask.chunks_exact_mut(seq.max(1)).enumerate() {
        row[i + 1..].fill(-1e4);
    }
    Tensor::from_vec(mask, (seq, seq), device)?.to_dtype(dtype)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    /// Central finite differences of `f` (a scalar function of `x`) against candle's gradient.
    fn check_gradient(shape: &[usize], f: impl Fn(&Tensor) -> Result<Tensor>) {
        let dev = Device::Cpu;
        let x = Var::from_tensor(&Tensor::randn(0f64, 1.0, shape, &dev).unwrap()).unwrap();
        let y = f(x.as_tensor()).unwrap();
        let grads = y.backward().unwrap();
        let analytic: Vec<f64> = grads.get(&x).expect("gradient reaches x").flatten_all().unwrap().to_vec1().unwrap();
        let base: Vec<f64> = x.as_tensor().flatten_all().unwrap().to_vec1().unwrap();
        let again = f(&Tensor::from_vec(base.clone(), shape, &dev).unwrap()).unwrap().to_scalar::<f64>().unwrap();
        let first = y.to_scalar::<f64>().unwrap();
        assert!((again - first).abs() < 1e-9, "f is not deterministic: {first} vs {again}");
        let entries: Vec<usize> = (0..base.len()).collect();
        let numeric = crate::gradcheck::central_differences(&base, &entries, &[1e-5], &analytic, |v| {
            f(&Tensor::from_vec(v.to_vec(), shape, &dev).unwrap()).unwrap().to_scalar::<f64>().unwrap()
        });
        for (i, numeric) in numeric.into_iter().enumerate() {
            let err = (numeric - analytic[i]).abs();
            assert!(
                err < 1e-6 * (1.0 + numeric.abs()),
                "d/dx[{i}] of {shape:?}: numeric {numeric}, autograd {}",
                analytic[i]
            );
        }
        assert!(analytic.iter().any(|g| g.abs() > 1e-8), "gradient is not identically zero");
    }

    fn weighted_sum(t: &Tensor) -> Result<Tensor> {
        // A fixed, non-uniform weighting so every output element matters differently.
        let n = t.elem_count();
        let w = Tensor::arange(1u32, n as u32 + 1, t.device())?.to_dtype(DType::F64)?.reshape(t.shape())?;
        (t * w.sin()?)?.sum_all()
    }

    #[test]
    fn softmax_and_log_softmax_gradients() {
        check_gradient(&[3, 5], |x| weighted_sum(&softmax_last_dim(x)?));
        check_gradient(&[3, 5], |x| weighted_sum(&log_softmax_last_dim(x)?));
        let dev = Device::Cpu;
        let x = Tensor::randn(0f32, 3.0, (4, 7), &dev).unwrap();
        let ours: Vec<f32> = softmax_last_dim(&x).unwrap().flatten_all().unwrap().to_vec1().unwrap();
        let fused: Vec<f32> = candle_nn::ops::softmax_last_dim(&x).unwrap().flatten_all().unwrap().to_vec1().unwrap();
        assert!(ours.iter().zip(&fused).all(|(a, b)| (a - b).abs() < 1e-6), "same values as candle's fused op");
    }

    #[test]
    fn norm_gradients_reach_input_and_parameters() {
        let dev = Device::Cpu;
        let w = Tensor::randn(1f64, 0.1, 6, &dev).unwrap();
        let b = Tensor::randn(0f64, 0.1, 6, &dev).unwrap();
        check_gradient(&[2, 6], |x| weighted_sum(&layer_norm(x, &w, &b, 1e-5)?));
        let input = Tensor::randn(0f64, 1.0, (2, 6), &dev).unwrap();
        check_gradient(&[6], |wt| weighted_sum(&layer_norm(&input, wt, &b, 1e-5)?));
        check_gradient(&[6], |bt| weighted_sum(&layer_norm(&input, &w, bt, 1e-5)?));
        check_gradient(&[6], |wt| weighted_sum(&rms_norm(&input, wt, 1e-6)?));
        check_gradient(&[2, 6], |x| weighted_sum(&rms_norm(x, &w, 1e-6)?));
        let x = Tensor::randn(0f32, 1.0, (3, 8), &dev).unwrap();
        let (wf, bf) = (Tensor::ones(8, DType::F32, &dev).unwrap(), Tensor::zeros(8, DType::F32, &dev).unwrap());
        let ours: Vec<f32> = layer_norm(&x, &wf, &bf, 1e-5).unwrap().flatten_all().unwrap().to_vec1().unwrap();
        let fused: Vec<f32> =
            candle_nn::ops::layer_norm(&x, &wf, &bf, 1e-5).unwrap().flatten_all().unwrap().to_vec1().unwrap();
        assert!(ours.iter().zip(&fused).all(|(a, b)| (a - b).abs() < 1e-5));
    }

    /// The causal bias by its definition: 0 on and below the diagonal, -1e4 above; no rows.
    #[test]
    fn causal_bias_is_its_definition() {
        let dev = Device::Cpu;
        for seq in [0, 1, 5] {
            let got: Vec<f32> = causal_bias(seq, DType::F32, &dev).unwrap().flatten_all().unwrap().to_vec1().unwrap();
            let want: Vec<f32> = (0..seq * seq).map(|e| if e % seq > e / seq { -1e4 } else { 0.0 }).collect();
            assert_eq!(got, want, "{seq}");
        }
    }

    #[test]
    fn rope_attention_and_cross_entropy_gradients() {
        let dev = Device::Cpu;
        let (cos, sin) = rope_tables(3, 4, 10_000.0, DType::F64, &dev).unwrap();
        check_gradient(&[1, 2, 3, 4], |x| weighted_sum(&rope(x, &cos, &sin)?));
        let k = Tensor::randn(0f64, 1.0, (1, 2, 3, 4), &dev).unwrap();
        let v = Tensor::randn(0f64, 1.0, (1, 2, 3, 4), &dev).unwrap();
        let bias = causal_bias(3, DType::F64, &dev).unwrap();
        check_gradient(&[1, 2, 3, 4], |q| weighted_sum(&attention(q, &k, &v, Some(&bias))?));
        let targets = Tensor::new(&[1u32, 0, 3], &dev).unwrap();
        check_gradient(&[3, 4], |x| cross_entropy(x, &targets));
        // rope at position 0 is the identity.
        let x = Tensor::randn(0f64, 1.0, (1, 1, 1, 4), &dev).unwrap();
        let r = rope(&x, &cos.narrow(0, 0, 1).unwrap(), &sin.narrow(0, 0, 1).unwrap()).unwrap();
        assert!((r - &x).unwrap().abs().unwrap().sum_all().unwrap().to_scalar::<f64>().unwrap() < 1e-12);
    }

    /// Values and gradients of `relu`/`relu6` at the points where conventions differ, against
    /// PyTorch's definitions: `relu'(x) = [x > 0]`, `hardtanh'(x) = [0 < x < 6]`, NaN kept.
    #[test]
    fn relu_and_relu6_follow_pytorch_at_the_kinks() {
        let dev = Device::Cpu;
        let points = [-2.0f32, 0.0, 1e-30, 0.5, 3.0, 6.0, 7.0, f32::INFINITY, f32::NEG_INFINITY, f32::NAN];
        let x = Tensor::new(&points, &dev).unwrap();
        let relu_values: Vec<f32> = relu(&x).unwrap().to_vec1().unwrap();
        let relu6_values: Vec<f32> = relu6(&x).unwrap().to_vec1().unwrap();
        for (i, p) in points.iter().enumerate() {
            let (r, r6) = (p.max(0.0), p.clamp(0.0, 6.0));
            if p.is_nan() {
                assert!(relu_values[i].is_nan() && relu6_values[i].is_nan(), "NaN propagates");
            } else {
                assert_eq!((relu_values[i], relu6_values[i]), (r, r6), "at {p}");
                assert!(relu_values[i].is_sign_positive(), "+0, not -0, at {p}");
            }
        }
        let finite = &points[..7];
        let var = Var::from_tensor(&Tensor::new(finite, &dev).unwrap()).unwrap();
        let grad = |y: Tensor| -> Vec<f32> {
            y.sum_all().unwrap().backward().unwrap().get(var.as_tensor()).unwrap().to_vec1().unwrap()
        };
        let expected_relu: Vec<f32> = finite.iter().map(|p| f32::from(*p > 0.0)).collect();
        let expected_relu6: Vec<f32> = finite.iter().map(|p| f32::from(*p > 0.0 && *p < 6.0)).collect();
        assert_eq!(grad(relu(var.as_tensor()).unwrap()), expected_relu);
        assert_eq!(grad(relu6(var.as_tensor()).unwrap()), expected_relu6);
        // What the nodes replace: candle's relu passes the gradient at exactly 0, and its clamp
        // halves it at both bounds. (If candle changes this, the comment on `relu` needs to.)
        let candle_relu = grad(var.as_tensor().relu().unwrap());
        assert_eq!(candle_relu[1], 1.0);
        let candle_clamp = grad(var.as_tensor().clamp(0f32, 6f32).unwrap());
        assert_eq!((candle_clamp[1], candle_clamp[5]), (0.5, 0.5));
    }

    /// A row used 4096 times gets a gradient of 4096 (the number of uses, exactly representable in
    /// bf16): summed in f32. candle's own bf16 `embedding` backward gets 256 (bf16 accumulation
    /// stops growing when 1 is below half its spacing).
    #[test]
    fn embedding_and_broadcast_gradients_are_summed_in_f32() {
        let dev = Device::Cpu;
        let table = Var::from_tensor(&Tensor::zeros((3, 2), DType::BF16, &dev).unwrap()).unwrap();
        let ids = Tensor::new(vec![1u32; 4096], &dev).unwrap();
        let row = |y: Tensor| -> Vec<f32> {
            let g = y.to_dtype(DType::F32).unwrap().sum_all().unwrap().backward().unwrap();
            let g = g.get(table.as_tensor()).unwrap().to_dtype(DType::F32).unwrap();
            g.narrow(0, 1, 1).unwrap().flatten_all().unwrap().to_vec1().unwrap()
        };
        assert_eq!(row(embedding(table.as_tensor(), &ids).unwrap()), vec![4096.0, 4096.0]);
        assert_eq!(row(table.as_tensor().embedding(&ids).unwrap()), vec![256.0, 256.0]);
        // The same for parameters broadcast over 4096 rows.
        let x = Tensor::zeros((4096, 2), DType::BF16, &dev).unwrap();
        let a = Var::from_tensor(&Tensor::zeros((1, 2), DType::BF16, &dev).unwrap()).unwrap();
        let b = Var::from_tensor(&Tensor::zeros(2, DType::BF16, &dev).unwrap()).unwrap();
        let y = add_broadcast(&x, a.as_tensor(), b.as_tensor()).unwrap();
        let g = y.to_dtype(DType::F32).unwrap().sum_all().unwrap().backward().unwrap();
        for v in [&a, &b] {
            let g: Vec<f32> =
                g.get(v.as_tensor()).unwrap().to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1().unwrap();
            assert_eq!(g, vec![4096.0, 4096.0]);
        }
    }

    /// The padding row gets no gradient; the others get one per use; the values are the table's.
    #[test]
    fn embedding_with_padding_freezes_the_padding_row_only() {
        let dev = Device::Cpu;
        let table = Var::from_tensor(&Tensor::new(&[[1f32, 2.0], [3.0, 4.0], [5.0, 6.0]], &dev).unwrap()).unwrap();
        let ids = Tensor::new(&[0u32, 2, 0, 1, 2, 2], &dev).unwrap();
        let y = embedding_with_padding(table.as_tensor(), &ids, Some(0)).unwrap();
        let plain = table.as_tensor().embedding(&ids).unwrap();
        assert_eq!(y.to_vec2::<f32>().unwrap(), plain.to_vec2::<f32>().unwrap());
        let g = y.sum_all().unwrap().backward().unwrap();
        let g = g.get(table.as_tensor()).unwrap().to_vec2::<f32>().unwrap();
        assert_eq!(g, vec![vec![0.0, 0.0], vec![1.0, 1.0], vec![3.0, 3.0]]);
    }
}
