//! One autograd node for a composite computation.
//!
//! candle's autograd keeps every op's inputs alive until the loss is dropped, so a layer norm
//! written as eight primitive ops keeps eight tensors, and casting to f32 for a numerically
//! sensitive op adds f32 copies to the graph. A [`node`] runs the whole computation on detached
//! inputs (in a chosen compute dtype), returns the result in the activation dtype, and keeps only
//! its inputs: backward recomputes the computation in f32 (f64 for f64 inputs) with gradients on
//! and back-propagates through it (a vector–Jacobian product), so the gradients are candle's own
//! gradients of the same computation, accumulated in f32.
//!
//! This is how the models keep AMP's saved activations in the low-precision dtype while softmax,
//! normalisation and losses compute in f32 (the autocast policy of [`crate::Autocast`]), and how composite
//! ops (attention, pooling, batch norm) cost one saved input instead of every intermediate.

use std::sync::{Arc, Mutex};

use candle_core::backend::{BackendDevice, BackendStorage};
use candle_core::{CpuStorage, CustomOp1, CustomOp2, CustomOp3, DType, Layout, Result, Shape, Storage, Tensor, Var};

/// A node's computation: its inputs (in the compute dtype) to its output.
pub type NodeFn = dyn Fn(&[Tensor]) -> Result<Tensor> + Send + Sync;

struct Node {
    compute: DType,
    f: Arc<NodeFn>,
    result: Handoff,
}

/// A forward result computed before its custom op is applied, handed to the op's `fwd` once as
/// the op's own output storage (so the graph holds it as the op's result, with no extra copy
/// kept).
pub(crate) struct Handoff {
    name: &'static str,
    result: Mutex<Option<Tensor>>,
}

/// A fresh, exactly sized, contiguous copy of `layout`'s elements of `src` (a storage's own
/// clone would copy the whole buffer behind a view).
pub(crate) fn materialize_cpu(src: &CpuStorage, layout: &Layout) -> Result<CpuStorage> {
    let mut dst = src.device().zeros_impl(layout.shape(), src.dtype())?;
    src.copy_strided_src(&mut dst, 0, layout)?;
    Ok(dst)
}

pub(crate) fn materialize_cuda(src: &candle_core::CudaStorage, layout: &Layout) -> Result<candle_core::CudaStorage> {
    let mut dst = src.device().zeros_impl(layout.shape(), src.dtype())?;
    src.copy_strided_src(&mut dst, 0, layout)?;
    Ok(dst)
}

impl Handoff {
    /// Holds `result` for the op called `name`.
    pub(crate) fn new(name: &'static str, result: Tensor) -> Self {
        Handoff { name, result: Mutex::new(Some(result)) }
    }

    fn take(&self) -> Result<Tensor> {
        self.result
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
            .ok_or_else(|| candle_core::Error::Msg(format!("{}: forward result already taken", self.name)))
    }

    /// The result as a CPU op's output.
    pub(crate) fn cpu(&self) -> Result<(CpuStorage, Shape)> {
        let y = self.take()?;
        let (storage, layout) = y.storage_and_layout();
        match &*storage {
            Storage::Cpu(s) => Ok((materialize_cpu(s, layout)?, y.shape().clone())),
            _ => Err(candle_core::Error::Msg(format!("{}: result is not on the CPU", self.name))),
        }
    }

    /// The result as a CUDA op's output.
    pub(crate) fn cuda(&self) -> Result<(candle_core::CudaStorage, Shape)> {
        let y = self.take()?;
        let (storage, layout) = y.storage_and_layout();
        match &*storage {
            Storage::Cuda(s) => Ok((materialize_cuda(s, layout)?, y.shape().clone())),
            _ => Err(candle_core::Error::Msg(format!("{}: result is not on the CUDA device", self.name))),
        }
    }
}

impl Node {
    /// Gradients of the inputs: recompute with gradients on, then back-propagate `grad` through
    /// the recomputation. Backward runs in f32 even for a node that computes forward in bf16 or
    /// f16: candle's CPU reductions accumulate in the tensor's own dtype (a bf16 sum of 4096
    /// ones is 256), and a backward pass is full of reductions (bias and broadcast gradients,
    /// weight gradients of convolutions written as sums).
    fn vjp(&self, args: &[&Tensor], grad: &Tensor) -> Result<Vec<Option<Tensor>>> {
        let compute = crate::autocast::fp32_compute(self.compute);
        let mut inputs = Vec::with_capacity(args.len());
        let mut vars = Vec::with_capacity(args.len());
        for a in args {
            if a.track_op() && a.dtype().is_float() {
                let v = Var::from_tensor(&a.detach().to_dtype(compute)?)?;
                inputs.push(v.as_tensor().clone());
                vars.push(Some(v));
            } else {
                inputs.push(to_compute(&a.detach(), compute)?);
                vars.push(None);
            }
        }
        let y = (self.f)(&inputs)?;
        let grads = (y.to_dtype(compute)? * grad.detach().to_dtype(compute)?)?.sum_all()?.backward()?;
        args.iter()
            .zip(vars)
            .map(|(a, v)| match v.and_then(|v| grads.get(v.as_tensor()).cloned()) {
                // Detached: a gradient must not keep the recomputation's graph alive (candle's
                // leaf gradients carry the graph of the ops that made them).
                Some(g) => Ok(Some(g.detach().to_dtype(a.dtype())?)),
                None => Ok(None),
            })
            .collect()
    }
}

fn to_compute(t: &Tensor, compute: DType) -> Result<Tensor> {
    if t.dtype().is_float() {
        t.to_dtype(compute)
    } else {
        Ok(t.clone())
    }
}

impl CustomOp1 for Node {
    fn name(&self) -> &'static str {
        self.result.name
    }
    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        self.result.cpu()
    }
    fn cuda_fwd(&self, _: &candle_core::CudaStorage, _: &Layout) -> Result<(candle_core::CudaStorage, Shape)> {
        self.result.cuda()
    }
    fn bwd(&self, arg: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        Ok(self.vjp(&[arg], grad)?.pop().flatten())
    }
}

impl CustomOp2 for Node {
    fn name(&self) -> &'static str {
        self.result.name
    }
    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        self.result.cpu()
    }
    fn cuda_fwd(
        &self,
        _: &candle_core::CudaStorage,
        _: &Layout,
        _: &candle_core::CudaStorage,
        _: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        self.result.cuda()
    }
    fn bwd(&self, a: &Tensor, b: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let mut g = self.vjp(&[a, b], grad)?.into_iter();
        Ok((g.next().flatten(), g.next().flatten()))
    }
}

impl CustomOp3 for Node {
    fn name(&self) -> &'static str {
        self.result.name
    }
    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        self.result.cpu()
    }
    fn cuda_fwd(
        &self,
        _: &candle_core::CudaStorage,
        _: &Layout,
        _: &candle_core::CudaStorage,
        _: &Layout,
        _: &candle_core::CudaStorage,
        _: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        self.result.cuda()
    }
    fn bwd(
        &self,
        a: &Tensor,
        b: &Tensor,
        c: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let mut g = self.vjp(&[a, b, c], grad)?.into_iter();
        Ok((g.next().flatten(), g.next().flatten(), g.next().flatten()))
    }
}

/// Runs `f` on `inputs` cast to `compute` (integer inputs pass unchanged) and returns its result
/// cast to `out`, as one autograd node that keeps only `inputs`. Constants that need no gradient
/// (masks, tables) belong in `f`'s closure, not in `inputs`. One to three inputs.
pub fn node(
    name: &'static str,
    inputs: &[&Tensor],
    compute: DType,
    out: DType,
    f: impl Fn(&[Tensor]) -> Result<Tensor> + Send + Sync + 'static,
) -> Result<Tensor> {
    // Under `WICK_PROFILE_OPS` each composed node's forward is counted as `NAME (composed)`: on a
    // GPU, the ops that still run as candle's composition rather than an op of their own.
    if crate::native::profile::enabled() {
        let key = format!("{name} (composed)");
        let shapes = || inputs.iter().map(|t| format!("{:?}", t.dims())).collect::<Vec<_>>().join(" · ");
        return crate::native::profile::time(&key, "forward", shapes, || composed(name, inputs, compute, out, f));
    }
    composed(name, inputs, compute, out, f)
}

/// [`node`]'s body.
fn composed(
    name: &'static str,
    inputs: &[&Tensor],
    compute: DType,
    out: DType,
    f: impl Fn(&[Tensor]) -> Result<Tensor> + Send + Sync + 'static,
) -> Result<Tensor> {
    let detached: Vec<Tensor> = inputs.iter().map(|t| to_compute(&t.detach(), compute)).collect::<Result<_>>()?;
    let y = f(&detached)?.to_dtype(out)?;
    drop(detached);
    // Nothing to differentiate (inference, a recomputation on detached inputs, or inside
    // `no_grad`): no node.
    if !crate::grad_enabled() || !inputs.iter().any(|t| t.track_op()) {
        return Ok(y);
    }
    let op = Node { compute, f: Arc::new(f), result: Handoff::new(name, y) };
    match inputs {
        [a] => a.apply_op1(op),
        [a, b] => a.apply_op2(b, op),
        [a, b, c] => a.apply_op3(b, c, op),
        _ => Err(candle_core::Error::Msg(format!("{name}: a node takes 1 to 3 inputs, got {}", inputs.len()))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, D};

    fn vals(t: &Tensor) -> Vec<f64> {
        t.flatten_all().unwrap().to_dtype(DType::F64).unwrap().to_vec1().unwrap()
    }

    /// The node's gradients equal candle's gradients of the same computation written inline.
    #[test]
    fn node_gradients_match_the_inline_computation() {
        let dev = Device::Cpu;
        let f = |t: &[Tensor]| -> Result<Tensor> {
            let h = t[0].broadcast_mul(&t[1])?.tanh()?;
            h.broadcast_add(&t[2])?.exp()?.sum_keepdim(D::Minus1)
        };
        let make = |seed| Var::from_tensor(&Tensor::randn(0f64, 1.0, (3, 4), &dev).unwrap().affine(seed, 0.0).unwrap());
        let (a, b, c) = (make(1.0).unwrap(), make(0.5).unwrap(), make(0.25).unwrap());
        let inline = f(&[a.as_tensor().clone(), b.as_tensor().clone(), c.as_tensor().clone()]).unwrap();
        let fused = node("test", &[a.as_tensor(), b.as_tensor(), c.as_tensor()], DType::F64, DType::F64, f).unwrap();
        assert_eq!(vals(&inline), vals(&fused));
        let w = Tensor::new(&[[1.0f64], [-2.0], [3.0]], &dev).unwrap();
        let gi = (inline * &w).unwrap().sum_all().unwrap().backward().unwrap();
        let gf = (fused * &w).unwrap().sum_all().unwrap().backward().unwrap();
        for v in [&a, &b, &c] {
            let (x, y) = (vals(gi.get(v).unwrap()), vals(gf.get(v).unwrap()));
            assert!(x.iter().zip(&y).all(|(p, q)| (p - q).abs() < 1e-12), "{x:?} vs {y:?}");
        }
    }

    /// The graph behind a node keeps its inputs and output, not the intermediates.
    #[test]
    fn node_keeps_only_its_inputs() {
        let dev = Device::Cpu;
        let x = Var::from_tensor(&Tensor::randn(0f32, 1.0, (64, 64), &dev).unwrap()).unwrap();
        let chain = |t: &[Tensor]| t[0].exp()?.sqr()?.tanh()?.sin();
        let input = (x.as_tensor() * 2.0).unwrap();
        let inline = chain(std::slice::from_ref(&input)).unwrap();
        let fused = node("test", &[&input], DType::F32, DType::F32, chain).unwrap();
        let inline_bytes = crate::graph::graph_bytes(&inline).total;
        let fused_bytes = crate::graph::graph_bytes(&fused).total;
        // input + 4 intermediates vs input + output.
        assert_eq!(inline_bytes, 5 * 64 * 64 * 4);
        assert_eq!(fused_bytes, 2 * 64 * 64 * 4);
    }

    /// In low precision, the node computes in f32 and keeps its input in bf16.
    #[test]
    fn low_precision_inputs_compute_in_f32() {
        let dev = Device::Cpu;
        let x =
            Var::from_tensor(&Tensor::randn(0f32, 1.0, (8, 16), &dev).unwrap().to_dtype(DType::BF16).unwrap()).unwrap();
        let sm = |t: &[Tensor]| {
            assert_eq!(t[0].dtype(), DType::F32, "computes in f32");
            crate::ops::softmax_last_dim(&t[0])
        };
        let y = node("softmax", &[x.as_tensor()], DType::F32, DType::BF16, sm).unwrap();
        assert_eq!(y.dtype(), DType::BF16);
        let reference = crate::ops::softmax_last_dim(&x.as_tensor().to_dtype(DType::F32).unwrap()).unwrap();
        let err = vals(&y).iter().zip(vals(&reference)).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max);
        assert!(err < 4e-3, "bf16 rounding of an f32 softmax, max error {err}");
        let g = y.sum_all().unwrap().backward().unwrap();
        let gx = g.get(&x).unwrap();
        assert_eq!(gx.dtype(), DType::BF16);
        // Softmax rows sum to one, so the gradient of the sum is zero.
        assert!(vals(gx).iter().all(|v| v.abs() < 1e-6));
    }

    #[test]
    fn too_many_inputs_is_an_error() {
        let x = Var::from_tensor(&Tensor::zeros(2, DType::F32, &Device::Cpu).unwrap()).unwrap();
        let t = x.as_tensor();
        let err = node("four", &[t, t, t, t], DType::F32, DType::F32, |t| Ok(t[0].clone())).unwrap_err();
        assert!(err.to_string().contains("1 to 3 inputs"), "{err}");
    }
}
