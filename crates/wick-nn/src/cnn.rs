//! Differentiable convolutional building blocks. candle's `max_pool2d` backward fails for
//! overlapping windows (ResNet's 3×3/stride 2) and its batch-norm is inference-only, so pooling,
//! depthwise convolution and train-mode batch normalisation are composed here from strided
//! windows and reductions, all of which candle differentiates. Each is then one graph node
//! ([`crate::fused::node`]) that keeps its inputs only; batch norm computes in f32 and
//! convolutions follow the autocast policy, including the CPU's bf16 → f32 fallback.

use std::sync::{Arc, Mutex};

use candle_core::{DType, Device, Result, Tensor, D};

use crate::autocast::{conv_compute, fp32_compute};
use crate::fused::node;
use crate::native;
pub use crate::native::norm::Activation;
use crate::params::{Buffer, Init, Params};

/// Pads the two spatial dimensions of (N, C, H, W) with `value` on every side.
pub fn pad_spatial(x: &Tensor, pad: usize, value: f64) -> Result<Tensor> {
    if pad == 0 {
        return Ok(x.clone());
    }
    let (n, c, h, w) = x.dims4()?;
    let rows = (Tensor::ones((n, c, pad, w), x.dtype(), x.device())? * value)?;
    let x = Tensor::cat(&[&rows, x, &rows], 2)?;
    let cols = (Tensor::ones((n, c, h + 2 * pad, pad), x.dtype(), x.device())? * value)?;
    Tensor::cat(&[&cols, &x, &cols], 3)
}

/// The (out_h, out_w) grid of elements `x[.., dy + stride*i, dx + stride*j]` of a padded input.
fn window(x: &Tensor, dy: usize, dx: usize, stride: usize, out_h: usize, out_w: usize) -> Result<Tensor> {
    let (n, c, h, w) = x.dims4()?;
    // Take `stride * out` rows starting at the offset (padding the end if the input is short),
    // then keep every `stride`-th one by reshaping.
    let take = |t: Tensor, dim: usize, len: usize, offset: usize, out: usize| -> Result<Tensor> {
        let need = stride * out;
        let available = len - offset;
        let t = if available >= need {
            t.narrow(dim, offset, need)?
        } else {
            let t = t.narrow(dim, offset, available)?;
            let mut shape = t.dims().to_vec();
            shape[dim] = need - available;
            Tensor::cat(&[t.clone(), Tensor::zeros(shape, t.dtype(), t.device())?], dim)?
        };
        Ok(t)
    };
    let t = take(x.clone(), 2, h, dy, out_h)?.reshape((n, c, out_h, stride, w))?.narrow(3, 0, 1)?.squeeze(3)?;
    let t = take(t, 3, w, dx, out_w)?.reshape((n, c, out_h, out_w, stride))?.narrow(4, 0, 1)?.squeeze(4)?;
    Ok(t)
}

fn out_size(len: usize, kernel: usize, stride: usize, pad: usize) -> usize {
    (len + 2 * pad - kernel) / stride + 1
}

/// Max pooling with any kernel, stride and padding (padding never wins the max), as one graph
/// node in `x`'s dtype. The gradient of each output goes to the first maximum of its window in
/// row-major order, as in PyTorch; candle's `max` backward gives it to every tied maximum, and in
/// bf16 ties are common (that doubled gradients into ResNet's stem, the one place its first bf16
/// gradients differed from PyTorch autocast's: BENCHMARKS.md, "Mixed precision (issue 6)").
pub fn max_pool2d(x: &Tensor, kernel: usize, stride: usize, pad: usize) -> Result<Tensor> {
    if native::serves_either(x) {
        return native::pool::max_pool2d(x, kernel, stride, pad);
    }
    max_pool2d_composed(x, kernel, stride, pad)
}

/// [`max_pool2d`] composed from candle's ops (the oracle of its bodies, and the op elsewhere): the
/// windows stacked, their first maxima picked by `argmax` and `gather`, as one node.
pub fn max_pool2d_composed(x: &Tensor, kernel: usize, stride: usize, pad: usize) -> Result<Tensor> {
    node("max_pool2d", &[x], x.dtype(), x.dtype(), move |t| {
        let windows = stacked_windows(&t[0], kernel, stride, pad)?;
        // argmax keeps the first of equal values; gather's backward scatters to that one only.
        let first = windows.argmax_keepdim(0)?;
        windows.gather(&first, 0)?.squeeze(0)
    })
}

/// The kernel² windows of each pooling output, stacked in row-major window order:
/// (kernel², N, C, out_h, out_w), padded with a value that never wins a max.
fn stacked_windows(x: &Tensor, kernel: usize, stride: usize, pad: usize) -> Result<Tensor> {
    let (_, _, h, w) = x.dims4()?;
    let (oh, ow) = (out_size(h, kernel, stride, pad), out_size(w, kernel, stride, pad));
    let xp = pad_spatial(x, pad, -1e4)?;
    let mut windows = Vec::with_capacity(kernel * kernel);
    for dy in 0..kernel {
        for dx in 0..kernel {
            windows.push(window(&xp, dy, dx, stride, oh, ow)?);
        }
    }
    Tensor::stack(&windows, 0)
}

/// Depthwise convolution: weight (C, 1, k, k), one filter per channel, as a sum of k² shifted
/// windows scaled per channel (vectorised, and differentiable through every term), as one graph
/// node (in f32 for bf16 on the CPU, like [`conv2d`]).
pub fn depthwise_conv2d(x: &Tensor, weight: &Tensor, pad: usize, stride: usize) -> Result<Tensor> {
    if native::serves(x) || native::serves_conv_on_device(x) {
        return native::depthwise::depthwise_conv2d(x, weight, pad, stride);
    }
    let compute = conv_compute(x.dtype(), x.device());
    node("conv2d", &[x, weight], compute, x.dtype(), move |t| depthwise_conv2d_composed(&t[0], &t[1], pad, stride))
}

/// [`depthwise_conv2d`] composed from windows, products and sums.
pub fn depthwise_conv2d_composed(x: &Tensor, weight: &Tensor, pad: usize, stride: usize) -> Result<Tensor> {
    let (_, c, h, w) = x.dims4()?;
    let (_, _, k, _) = weight.dims4()?;
    let (oh, ow) = (out_size(h, k, stride, pad), out_size(w, k, stride, pad));
    let xp = pad_spatial(x, pad, 0.0)?;
    let mut acc: Option<Tensor> = None;
    for dy in 0..k {
        for dx in 0..k {
            let wk = weight.narrow(2, dy, 1)?.narrow(3, dx, 1)?.reshape((1, c, 1, 1))?;
            let term = window(&xp, dy, dx, stride, oh, ow)?.broadcast_mul(&wk)?;
            acc = Some(match acc {
                Some(a) => (a + term)?,
                None => term,
            });
        }
    }
    acc.ok_or_else(|| candle_core::Error::Msg("empty depthwise kernel".into()))
}

/// A dense (groups = 1) convolution under the autocast policy: wick's op on the CPU and (feature
/// `cuda`, through cuDNN) on a CUDA device; elsewhere candle's, native in `x`'s dtype except bf16
/// on the CPU (which candle cannot convolve), computed in f32 as one node that returns bf16.
pub fn conv2d(x: &Tensor, weight: &Tensor, pad: usize, stride: usize) -> Result<Tensor> {
    if native::serves(x) || native::serves_conv_on_device(x) {
        return native::conv::conv2d(x, weight, pad, stride);
    }
    let compute = conv_compute(x.dtype(), x.device());
    if compute == x.dtype() {
        return x.conv2d(weight, pad, stride, 1, 1);
    }
    node("conv2d", &[x, weight], compute, x.dtype(), move |t| t[0].conv2d(&t[1], pad, stride, 1, 1))
}

/// Global average pooling: (N, C, H, W) → (N, C).
pub fn global_avg_pool(x: &Tensor) -> Result<Tensor> {
    if native::serves_either(x) {
        return native::pool::global_avg_pool(x);
    }
    global_avg_pool_composed(x)
}

/// [`global_avg_pool`] composed from candle's means, as one node.
pub fn global_avg_pool_composed(x: &Tensor) -> Result<Tensor> {
    // A mean is an f32-class reduction (candle's CPU reductions accumulate in the input dtype).
    node("mean", &[x], fp32_compute(x.dtype()), x.dtype(), |t| t[0].mean(D::Minus1)?.mean(D::Minus1))
}

/// Batch norm's ε, PyTorch's default (added to the variance).
const BN_EPS: f64 = 1e-5;

/// Running statistics of a batch norm: two [`Buffer`]s, shared (cheaply cloned) with
/// checkpointed segments and with the [`Params`] store that saves them.
#[derive(Clone)]
pub struct RunningStats {
    mean: Buffer,
    var: Buffer,
}

impl RunningStats {
    /// Statistics starting at (`mean`, `var`), registered in `params` as PyTorch names them:
    /// `{prefix}.running_mean` and `{prefix}.running_var`.
    pub fn register(params: &mut Params, prefix: &str, mean: Tensor, var: Tensor) -> Self {
        RunningStats {
            mean: params.register_buffer(&format!("{prefix}.running_mean"), mean),
            var: params.register_buffer(&format!("{prefix}.running_var"), var),
        }
    }

    /// The running (mean, variance).
    pub fn get(&self) -> (Tensor, Tensor) {
        (self.mean.get(), self.var.get())
    }

    fn set(&self, mean: &Tensor, var: &Tensor) -> Result<()> {
        self.mean.set(mean)?;
        self.var.set(var)
    }

    /// Batch normalisation of `x` (N, C, H, W) over (N, H, W) per channel with `weight`/`bias`:
    /// batch statistics when `train` (with gradient; the running estimates move by PyTorch's
    /// momentum 0.1 with the unbiased variance when `update`), the running estimates otherwise.
    pub fn normalize(&self, x: &Tensor, weight: &Tensor, bias: &Tensor, train: bool, update: bool) -> Result<Tensor> {
        self.normalize_act(x, weight, bias, train, update, Activation::Identity)
    }

    /// [`RunningStats::normalize`] followed by `act` (ReLU or ReLU6, PyTorch's gradients). On
    /// the CPU, and on a CUDA device with wick's kernels, it is one op: the normalised values
    /// before the activation are neither stored nor kept for backward.
    pub fn normalize_act(
        &self,
        x: &Tensor,
        weight: &Tensor,
        bias: &Tensor,
        train: bool,
        update: bool,
        act: Activation,
    ) -> Result<Tensor> {
        let (eps, momentum) = (BN_EPS, 0.1);
        if native::serves_either(x) {
            return self.normalize_native(x, weight, bias, (train, update, act), eps, momentum);
        }
        let y = self.normalize_composed(x, weight, bias, train, update, eps, momentum)?;
        match act {
            Activation::Identity => Ok(y),
            Activation::Relu => crate::ops::relu(&y),
            Activation::Relu6 => crate::ops::relu6(&y),
        }
    }

    /// `act(batch_norm(conv2d(x, w, pad, stride)) + residual)` for `conv = (w, pad, stride)`
    /// and `norm = (weight, bias)`: the residual, when given, is added before `act`; batch norm
    /// as [`RunningStats::normalize`] with `(train, update)`. Inference on the CPU (`!train`,
    /// f32 or f64, no gradient wanted: inside [`crate::no_grad`] or no input tracked) runs as
    /// one pass over the convolution's output (the norm, residual and activation applied as it
    /// is written), with the outputs of the separate ops bit for bit; anything else runs them
    /// one by one.
    pub fn conv_normalize_act(
        &self,
        x: &Tensor,
        (w, pad, stride): (&Tensor, usize, usize),
        (weight, bias): (&Tensor, &Tensor),
        (train, update): (bool, bool),
        residual: Option<&Tensor>,
        act: Activation,
    ) -> Result<Tensor> {
        let eps = BN_EPS;
        let no_grad_wanted =
            !crate::grad::grad_enabled() || ![x, w, weight, bias].iter().chain(residual.as_ref()).any(|t| t.track_op());
        if !train && no_grad_wanted && native::serves(x) {
            let (mean, var) = self.get();
            let norm = native::conv::EvalNorm { weight, bias, mean: &mean, var: &var, eps };
            if let Some(y) = native::conv::conv_norm_eval(x, w, (pad, stride), norm, residual, act)? {
                return Ok(y);
            }
        }
        let Some(r) = residual else {
            return self.normalize_act(&conv2d(x, w, pad, stride)?, weight, bias, train, update, act);
        };
        // The convolution's output is a temporary, dropped before the residual is added.
        let h = self.normalize(&conv2d(x, w, pad, stride)?, weight, bias, train, update)?;
        match act {
            Activation::Relu => crate::ops::add_relu(&h, r),
            Activation::Identity => h + r,
            Activation::Relu6 => crate::ops::relu6(&(h + r)?),
        }
    }

    /// Batch norm as graph nodes over candle's ops (a device without wick's kernels).
    #[allow(clippy::too_many_arguments)]
    fn normalize_composed(
        &self,
        x: &Tensor,
        weight: &Tensor,
        bias: &Tensor,
        train: bool,
        update: bool,
        eps: f64,
        momentum: f64,
    ) -> Result<Tensor> {
        let compute = fp32_compute(x.dtype());
        if !train {
            let (mean, var) = self.get();
            return node("batch_norm", &[x, weight, bias], compute, x.dtype(), move |t| {
                let (m, v) = (mean.to_dtype(t[0].dtype())?, var.to_dtype(t[0].dtype())?);
                affine_normalize(&t[0], &m, &v, &t[1], &t[2], eps)
            });
        }
        // The forward call of the node's function (its first; backward calls it again to
        // recompute) hands its f32 batch statistics out, detached, for the running estimates.
        let handed_out: Arc<Mutex<Option<(Tensor, Tensor)>>> = Arc::new(Mutex::new(None));
        let first_call = Arc::new(std::sync::atomic::AtomicBool::new(update));
        let slot = handed_out.clone();
        let y = node("batch_norm", &[x, weight, bias], compute, x.dtype(), move |t| {
            let (mean, var) = batch_stats(&t[0])?;
            if first_call.swap(false, std::sync::atomic::Ordering::Relaxed) {
                *slot.lock().unwrap_or_else(|p| p.into_inner()) = Some((mean.detach(), var.detach()));
            }
            affine_normalize(&t[0], &mean, &var, &t[1], &t[2], eps)
        })?;
        let stats = handed_out.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some((mean, var)) = stats {
            // The running estimates move once per forward pass.
            let (n, _, h, w) = x.dims4()?;
            let count = (n * h * w) as f64;
            let (old_mean, old_var) = self.get();
            let dtype = old_mean.dtype();
            let unbiased = (var.flatten_all()? * (count / (count - 1.0).max(1.0)))?;
            let blend = |old: &Tensor, new: Tensor| -> Result<Tensor> {
                ((old.to_dtype(compute)? * (1.0 - momentum))? + (new * momentum)?)?.to_dtype(dtype)
            };
            self.set(&blend(&old_mean, mean.flatten_all()?)?, &blend(&old_var, unbiased)?)?;
        }
        Ok(y)
    }
}

impl RunningStats {
    /// [`RunningStats::normalize_act`] as one op of wick-nn's (`native::norm`; on the CPU or a
    /// CUDA device): the statistics computed once (summed in f64), the running estimates moved
    /// from them.
    fn normalize_native(
        &self,
        x: &Tensor,
        weight: &Tensor,
        bias: &Tensor,
        (train, update, act): (bool, bool, Activation),
        eps: f64,
        momentum: f64,
    ) -> Result<Tensor> {
        let (mean, var) = self.get();
        if !train {
            return native::norm::batch_norm_given(x, (&mean, &var), (weight, bias), eps, act);
        }
        let running = update.then_some(native::norm::Running { mean: &mean, var: &var, momentum });
        let (y, moved) = native::norm::batch_norm_train(x, (weight, bias), eps, act, running)?;
        if let Some((mean, var)) = moved {
            self.set(&mean, &var)?;
        }
        Ok(y)
    }
}

/// Per-channel mean and biased variance of (N, C, H, W) over (N, H, W), shaped (1, C, 1, 1).
fn batch_stats(x: &Tensor) -> Result<(Tensor, Tensor)> {
    let mean = x.mean_keepdim(0)?.mean_keepdim(2)?.mean_keepdim(3)?;
    let var = x.broadcast_sub(&mean)?.sqr()?.mean_keepdim(0)?.mean_keepdim(2)?.mean_keepdim(3)?;
    Ok((mean, var))
}

fn affine_normalize(
    x: &Tensor,
    mean: &Tensor,
    var: &Tensor,
    weight: &Tensor,
    bias: &Tensor,
    eps: f64,
) -> Result<Tensor> {
    let shape = (1, x.dim(1)?, 1, 1);
    let normed = x.broadcast_sub(&mean.reshape(shape)?)?.broadcast_div(&(var.reshape(shape)? + eps)?.sqrt()?)?;
    normed.broadcast_mul(&weight.reshape(shape)?)?.broadcast_add(&bias.reshape(shape)?)
}

/// Batch normalisation with trainable scale and shift (see [`RunningStats::normalize`]).
pub struct BatchNorm {
    /// Scale parameter (trainable).
    pub weight: Tensor,
    /// Shift parameter (trainable).
    pub bias: Tensor,
    /// Running estimates.
    pub running: RunningStats,
}

impl BatchNorm {
    /// Registers `{prefix}.weight`/`.bias` as parameters; running statistics start at (0, 1).
    /// All of them are f32 in a bf16/f16 model (the autocast policy keeps normalisation parameters in f32).
    pub fn new(params: &mut Params, prefix: &str, channels: usize, dtype: DType, device: &Device) -> Result<Self> {
        let dtype = crate::autocast::norm_param_dtype(dtype);
        let weight = params.create(&format!("{prefix}.weight"), &[channels], Init::Ones, dtype, device)?;
        let bias = params.create(&format!("{prefix}.bias"), &[channels], Init::Zeros, dtype, device)?;
        let (mean, var) = (Tensor::zeros(channels, dtype, device)?, Tensor::ones(channels, dtype, device)?);
        let running = RunningStats::register(params, prefix, mean, var);
        Ok(BatchNorm { weight, bias, running })
    }

    /// Loaded parameters and statistics (already registered by the caller).
    pub fn from_parts(weight: Tensor, bias: Tensor, running: RunningStats) -> Self {
        BatchNorm { weight, bias, running }
    }

    /// The running (mean, variance).
    pub fn running_stats(&self) -> (Tensor, Tensor) {
        self.running.get()
    }

    /// Normalises `x` (N, C, H, W), updating the running estimates in training.
    pub fn forward(&self, x: &Tensor, train: bool) -> Result<Tensor> {
        self.running.normalize(x, &self.weight, &self.bias, train, true)
    }

    /// [`BatchNorm::forward`] followed by `act`, as one op on the CPU.
    pub fn forward_act(&self, x: &Tensor, train: bool, act: Activation) -> Result<Tensor> {
        self.running.normalize_act(x, &self.weight, &self.bias, train, true, act)
    }

    /// `act(self(conv2d(x, w, pad, stride)))`, one pass for inference on the CPU
    /// ([`RunningStats::conv_normalize_act`]).
    pub fn conv_forward_act(
        &self,
        x: &Tensor,
        conv: (&Tensor, usize, usize),
        train: bool,
        act: Activation,
    ) -> Result<Tensor> {
        self.running.conv_normalize_act(x, conv, (&self.weight, &self.bias), (train, true), None, act)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Var;

    fn vals(t: &Tensor) -> Vec<f64> {
        t.flatten_all().unwrap().to_dtype(DType::F64).unwrap().to_vec1().unwrap()
    }

    #[test]
    fn max_pool_matches_a_direct_loop_and_routes_gradients() {
        let dev = Device::Cpu;
        let x = Var::from_tensor(&Tensor::randn(0f64, 1.0, (1, 2, 7, 7), &dev).unwrap()).unwrap();
        let y = max_pool2d(x.as_tensor(), 3, 2, 1).unwrap();
        assert_eq!(y.dims(), &[1, 2, 4, 4]);
        let xv = vals(x.as_tensor());
        let at = |c: usize, i: isize, j: isize| {
            if (0..7).contains(&i) && (0..7).contains(&j) {
                xv[c * 49 + i as usize * 7 + j as usize]
            } else {
                f64::MIN
            }
        };
        let yv = vals(&y);
        for c in 0..2 {
            for oi in 0..4 {
                for oj in 0..4 {
                    let mut m = f64::MIN;
                    for di in 0..3 {
                        for dj in 0..3 {
                            m = m.max(at(c, oi as isize * 2 - 1 + di, oj as isize * 2 - 1 + dj));
                        }
                    }
                    assert_eq!(yv[c * 16 + oi * 4 + oj], m);
                }
            }
        }
        // The gradient of the sum lands on the winners only, once per window they win.
        let g = vals(y.sum_all().unwrap().backward().unwrap().get(&x).unwrap());
        assert_eq!(g.iter().sum::<f64>(), 32.0);
        assert!(g.iter().all(|v| *v >= 0.0 && v.fract() == 0.0));
    }

    /// Ties: PyTorch's max_pool2d gives each output's gradient to the first maximum of its window
    /// (row-major), once.
    #[test]
    fn max_pool_gives_a_tied_windows_gradient_to_its_first_maximum() {
        let dev = Device::Cpu;
        // One 2×2 window, no padding: maxima 5 at (0, 1) and (1, 0).
        let x = Var::from_tensor(&Tensor::new(&[[[[1f32, 5.0], [5.0, 2.0]]]], &dev).unwrap()).unwrap();
        let y = max_pool2d(x.as_tensor(), 2, 2, 0).unwrap();
        assert_eq!(y.flatten_all().unwrap().to_vec1::<f32>().unwrap(), vec![5.0]);
        let g = y.sum_all().unwrap().backward().unwrap();
        let g: Vec<f32> = g.get(x.as_tensor()).unwrap().flatten_all().unwrap().to_vec1().unwrap();
        assert_eq!(g, vec![0.0, 1.0, 0.0, 0.0]);
        // The same in bf16, where the node's backward recomputes in f32.
        let xb = Var::from_tensor(&x.as_tensor().to_dtype(DType::BF16).unwrap()).unwrap();
        let yb = max_pool2d(xb.as_tensor(), 2, 2, 0).unwrap();
        let gb = yb.to_dtype(DType::F32).unwrap().sum_all().unwrap().backward().unwrap();
        let gb = gb.get(xb.as_tensor()).unwrap().to_dtype(DType::F32).unwrap();
        assert_eq!(gb.flatten_all().unwrap().to_vec1::<f32>().unwrap(), vec![0.0, 1.0, 0.0, 0.0]);
    }

    #[test]
    fn depthwise_matches_grouped_convolution() {
        let dev = Device::Cpu;
        let x = Tensor::randn(0f64, 1.0, (2, 3, 9, 9), &dev).unwrap();
        let w = Tensor::randn(0f64, 1.0, (3, 1, 3, 3), &dev).unwrap();
        for stride in [1, 2] {
            let ours = depthwise_conv2d(&x, &w, 1, stride).unwrap();
            let reference = x.conv2d(&w, 1, stride, 1, 3).unwrap();
            assert_eq!(ours.dims(), reference.dims());
            let diff = (ours - reference).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f64>().unwrap();
            assert!(diff < 1e-12, "stride {stride}: {diff}");
        }
    }

    #[test]
    fn batch_norm_normalises_in_training_and_tracks_running_stats() {
        let dev = Device::Cpu;
        let mut params = Params::default();
        let bn = BatchNorm::new(&mut params, "bn", 2, DType::F64, &dev).unwrap();
        let x = Tensor::randn(3f64, 2.0, (4, 2, 5, 5), &dev).unwrap();
        let y = bn.forward(&x, true).unwrap();
        let mean = vals(&y.mean_keepdim(0).unwrap().mean_keepdim(2).unwrap().mean_keepdim(3).unwrap());
        assert!(mean.iter().all(|m| m.abs() < 1e-10));
        let (rm, rv) = bn.running_stats();
        let xm = vals(&x.mean_keepdim(0).unwrap().mean_keepdim(2).unwrap().mean_keepdim(3).unwrap());
        for (r, m) in vals(&rm).iter().zip(&xm) {
            assert!((r - 0.1 * m).abs() < 1e-12, "running mean moves 10 % towards the batch mean");
        }
        assert!(vals(&rv).iter().all(|v| *v > 0.9), "running variance moves from 1 towards the batch variance");
        let eval = bn.forward(&x, false).unwrap();
        assert_eq!(eval.dims(), x.dims());
    }

    /// With gradients on, the statistics still move once per forward pass: backward recomputes
    /// the normalisation but leaves the running estimates alone.
    #[test]
    fn batch_norm_running_stats_move_once_per_forward_with_backward() {
        let dev = Device::Cpu;
        let mut params = Params::default();
        let bn = BatchNorm::new(&mut params, "bn", 3, DType::F32, &dev).unwrap();
        let x = Var::from_tensor(&Tensor::randn(2f32, 1.0, (4, 3, 6, 6), &dev).unwrap()).unwrap();
        let y = bn.forward(x.as_tensor(), true).unwrap();
        let grads = y.sqr().unwrap().sum_all().unwrap().backward().unwrap();
        assert!(grads.get(x.as_tensor()).is_some());
        let xm = vals(&x.as_tensor().mean_keepdim(0).unwrap().mean_keepdim(2).unwrap().mean_keepdim(3).unwrap());
        let (rm, _) = bn.running_stats();
        for (r, m) in vals(&rm).iter().zip(&xm) {
            assert!((r - 0.1 * m).abs() < 1e-5, "running mean {r} after one forward (batch mean {m})");
        }
    }
}
