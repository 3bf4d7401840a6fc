//! Inference's convolution + batch norm (+ residual) + activation as one pass: the batch norm's
//! affine map on running statistics, the residual and the activation are applied to each run of
//! the convolution's outputs as the product writes it, while it is still in the cache — no
//! second tensor, no pass of batch norm's own, no residual add of its own. Where the direct f32
//! kernel computes the convolution (as it does for the unfused op), the same epilogue runs as a
//! pass over each image's planes after it.
//!
//! Why not fold the batch norm into the convolution's weights (as inference engines do): folded
//! weights are a second copy of every convolution's weights to keep in step with training
//! (invalidated whenever a parameter or a running statistic moves), and a product with scaled
//! weights rounds differently. The affine map costs one multiply-add per output in a pass that
//! runs anyway, and the outputs are those of the unfused ops bit for bit (f32 and f64; the test
//! `inference_in_one_pass_equals_the_separate_ops` in wick-zoo states it).

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp2, CustomOp3, DType, Layout, Result, Shape, Tensor};

use super::super::norm::{affine, inverse_deviations, Activation};
use super::super::profile::Profiled;
use super::super::{read, Mat, Real};
use super::plan::CHUNK_BYTES;
use super::unfold::Geometry;
use super::{direct, err, Conv2d};

/// What a convolution's output pass does to a run of outputs after the product.
pub(super) trait Epilogue<O>: Sync {
    /// False for [`Plain`] (runs written in place need not be visited).
    const ACTIVE: bool = true;
    /// Writes outputs `at..at + out.len()` of channel `channel` of image `image` into `out`,
    /// from the product's sums `sums` (the same length), or from `out` itself when `None`.
    fn write(&self, image: usize, channel: usize, at: usize, sums: Option<&[O]>, out: &mut [O]);
}

/// The plain convolution.
pub(super) struct Plain;

impl<O: Copy> Epilogue<O> for Plain {
    const ACTIVE: bool = false;
    #[inline(always)]
    fn write(&self, _: usize, _: usize, _: usize, sums: Option<&[O]>, out: &mut [O]) {
        if let Some(sums) = sums {
            out.copy_from_slice(sums);
        }
    }
}

/// `act(y·scale + shift (+ residual))` per channel.
struct NormAct<'a, T> {
    scale: Vec<T>,
    shift: Vec<T>,
    residual: Option<&'a [T]>,
    act: Activation,
    /// Channels and positions per image.
    channels: usize,
    cols: usize,
}

impl<T: Real> NormAct<'_, T> {
    /// The epilogue applied to every output of `y` (n, channels, cols) in place, after a
    /// convolution that wrote them plainly; parallel over runs.
    fn apply(&self, y: &mut [T]) {
        use rayon::prelude::*;
        y.par_chunks_exact_mut(self.cols.max(1))
            .enumerate()
            .for_each(|(i, run)| self.write(i / self.channels, i % self.channels, 0, None, run));
    }
}

impl<T: Real> Epilogue<T> for NormAct<'_, T> {
    fn write(&self, image: usize, channel: usize, at: usize, sums: Option<&[T]>, out: &mut [T]) {
        let residual = self.residual.map(|r| &r[(image * self.channels + channel) * self.cols + at..][..out.len()]);
        let (a, t, act) = (self.scale[channel], self.shift[channel], self.act);
        norm_run(out, sums, residual, a, t, act);
    }
}

wide_kernel! {
    /// `out = act(sums·a + t (+ residual))`, the same operations in the same order as batch
    /// norm's forward followed by the residual add; `sums` is `out` itself where `None`.
    fn norm_run<T>(out: &mut [T], sums: Option<&[T]>, residual: Option<&[T]>, a: T, t: T, act: Activation) {
        let n = out.len();
        let sums = sums.map(|s| &s[..n]);
        let residual = residual.map(|r| &r[..n]);
        // One loop per case, so each body has no branch and vectorises.
        macro_rules! each {
            ($f:expr) => {
                match sums {
                    Some(s) => out.iter_mut().zip(s).enumerate().for_each(|(i, (o, s))| *o = $f(*s, i)),
                    None => out.iter_mut().enumerate().for_each(|(i, o)| *o = $f(*o, i)),
                }
            };
        }
        match (residual, act) {
            (Some(r), Activation::Relu) => each!(|s: T, i: usize| Activation::Relu.apply((s * a + t) + r[i])),
            (Some(r), Activation::Relu6) => each!(|s: T, i: usize| Activation::Relu6.apply((s * a + t) + r[i])),
            (Some(r), Activation::Identity) => each!(|s: T, i: usize| (s * a + t) + r[i]),
            (None, Activation::Relu) => each!(|s: T, _| Activation::Relu.apply(s * a + t)),
            (None, Activation::Relu6) => each!(|s: T, _| Activation::Relu6.apply(s * a + t)),
            (None, Activation::Identity) => each!(|s: T, _| s * a + t),
        }
    }
}

/// The fused op: a convolution and batch norm's statistics, weight and bias (in f64), the
/// activation after the optional residual. Inference only: it has no backward.
struct ConvNorm {
    stride: usize,
    pad: usize,
    weight: Vec<f64>,
    bias: Vec<f64>,
    mean: Vec<f64>,
    invstd: Vec<f64>,
    act: Activation,
}

impl ConvNorm {
    /// The fused op with `conv` computing the convolution and its epilogue.
    fn run<T: Real>(
        &self,
        (sx, lx): (&CpuStorage, &Layout),
        (sw, lw): (&CpuStorage, &Layout),
        residual: Option<(&CpuStorage, &Layout)>,
        conv: impl FnOnce(&Geometry, &[T], &[T], &NormAct<'_, T>) -> Result<Vec<T>>,
    ) -> Result<(CpuStorage, Shape)> {
        let g = Geometry::new(lx.shape(), lw.shape(), self.stride, self.pad, false)?;
        let shape = Shape::from((g.n, g.c_out, g.oh, g.ow));
        if [self.weight.len(), self.bias.len(), self.mean.len(), self.invstd.len()].iter().any(|&c| c != g.c_out) {
            return Err(err(format!(
                "conv + batch norm: {} output channels, {} norm weights",
                g.c_out,
                self.weight.len()
            )));
        }
        let (x, w) = (read::<T>(sx, lx)?, read::<T>(sw, lw)?);
        let r = match residual {
            Some((sr, lr)) if lr.shape() == &shape => Some(read::<T>(sr, lr)?),
            Some((_, lr)) => {
                return Err(err(format!("conv + batch norm: residual {:?} for an output {shape:?}", lr.shape())))
            }
            None => None,
        };
        let (scale, shift) = affine::<T>(|c| self.weight[c], |c| self.bias[c], &self.mean, &self.invstd);
        let epilogue =
            NormAct { scale, shift, residual: r.as_deref(), act: self.act, channels: g.c_out, cols: g.cols() };
        let y = conv(&g, &x, &w, &epilogue)?;
        Ok((T::storage(y, sx.dtype())?, shape))
    }

    /// The convolution with the epilogue applied as its product writes each run.
    fn by_product<T: Real>(&self, g: &Geometry, x: &[T], w: &[T], epilogue: &NormAct<'_, T>) -> Result<Vec<T>> {
        let conv = Conv2d { stride: self.stride, pad: self.pad, chunk: CHUNK_BYTES };
        conv.forward_by(g, x, Mat::rows(w, g.c_out, g.rows()), epilogue)
    }

    fn dispatch(
        &self,
        x: (&CpuStorage, &Layout),
        w: (&CpuStorage, &Layout),
        r: Option<(&CpuStorage, &Layout)>,
    ) -> Result<(CpuStorage, Shape)> {
        match x.0.dtype() {
            // The convolution computed as the unfused op computes it (the outputs equal bit for
            // bit): directly where `direct` applies, the epilogue then a pass of its own.
            DType::F32 => self.run::<f32>(x, w, r, |g, x, w, epilogue| match direct::applies::<f32>(g) {
                true => direct::forward(g, x, w).map(|mut y| {
                    epilogue.apply(&mut y);
                    y
                }),
                false => self.by_product(g, x, w, epilogue),
            }),
            DType::F64 => self.run::<f64>(x, w, r, |g, x, w, epilogue| self.by_product(g, x, w, epilogue)),
            other => Err(err(format!("conv + batch norm: {other:?} images (f32 and f64 only)"))),
        }
    }
}

impl CustomOp2 for ConvNorm {
    fn name(&self) -> &'static str {
        "conv_norm"
    }
    fn cpu_fwd(&self, sx: &CpuStorage, lx: &Layout, sw: &CpuStorage, lw: &Layout) -> Result<(CpuStorage, Shape)> {
        self.dispatch((sx, lx), (sw, lw), None)
    }
}

impl CustomOp3 for ConvNorm {
    fn name(&self) -> &'static str {
        "conv_norm"
    }
    fn cpu_fwd(
        &self,
        sx: &CpuStorage,
        lx: &Layout,
        sw: &CpuStorage,
        lw: &Layout,
        sr: &CpuStorage,
        lr: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        self.dispatch((sx, lx), (sw, lw), Some((sr, lr)))
    }
}

/// Batch norm's parameters and running statistics for [`conv_norm_eval`]: weight, bias, mean
/// and biased variance per channel, and ε.
pub(crate) struct EvalNorm<'a> {
    /// Scale per channel.
    pub weight: &'a Tensor,
    /// Shift per channel.
    pub bias: &'a Tensor,
    /// Running mean.
    pub mean: &'a Tensor,
    /// Running (biased) variance.
    pub var: &'a Tensor,
    /// Added to the variance.
    pub eps: f64,
}

/// `act(batch_norm(conv2d(x, weight)) (+ residual))` for inference on the CPU, in one pass over
/// the output, with no graph: the caller makes sure no gradient is wanted. `None` for inputs
/// this op does not take (other than f32/f64 images and weights of one dtype); the caller then
/// runs the ops one by one.
pub(crate) fn conv_norm_eval(
    x: &Tensor,
    weight: &Tensor,
    (pad, stride): (usize, usize),
    norm: EvalNorm<'_>,
    residual: Option<&Tensor>,
    act: Activation,
) -> Result<Option<Tensor>> {
    let dtypes_fit = matches!(x.dtype(), DType::F32 | DType::F64)
        && weight.dtype() == x.dtype()
        && residual.is_none_or(|r| r.dtype() == x.dtype());
    if !dtypes_fit {
        return Ok(None);
    }
    let vec = |t: &Tensor| -> Result<Vec<f64>> { t.to_dtype(DType::F64)?.flatten_all()?.to_vec1() };
    let op = ConvNorm {
        stride,
        pad,
        weight: vec(norm.weight)?,
        bias: vec(norm.bias)?,
        mean: vec(norm.mean)?,
        invstd: inverse_deviations(&vec(norm.var)?, norm.eps),
        act,
    };
    let (x, weight) = (x.contiguous()?, weight.contiguous()?);
    let y = match residual {
        Some(r) => x.apply_op3_no_bwd(&weight, &r.contiguous()?, &Profiled(op))?,
        None => x.apply_op2_no_bwd(&weight, &Profiled(op))?,
    };
    Ok(Some(y))
}
