//! Pooling with closed-form backward passes: max pooling (the gradient of each window goes to its
//! first maximum in row-major order, as PyTorch's `max_pool2d`; padding never wins) and global
//! average pooling. Max pooling keeps only its input: backward finds each window's maximum again.
//! With the `cuda` feature both have CUDA bodies too (`super::cuda::pool`).

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp1, Layout, Result, Shape, Tensor};

use super::elem::{by_elem, elem_tensor, elems, into_plane, widened, with_elems, Elem};
use super::{par_ranges, read, sum, tensor, with, Real, SharedMut};

fn dims4(shape: &Shape) -> Result<(usize, usize, usize, usize)> {
    match shape.dims() {
        [n, c, h, w] => Ok((*n, *c, *h, *w)),
        d => Err(candle_core::Error::Msg(format!("pooling: expected (N, C, H, W), got {d:?}"))),
    }
}

/// Output length of a window sweep, or an error when the window does not fit.
pub(crate) fn out_len(len: usize, kernel: usize, stride: usize, pad: usize) -> Result<usize> {
    let padded = len + 2 * pad;
    if kernel == 0 || stride == 0 || padded < kernel {
        return Err(candle_core::Error::Msg(format!(
            "window {kernel} (stride {stride}, padding {pad}) does not fit a length of {len}"
        )));
    }
    Ok((padded - kernel) / stride + 1)
}

struct MaxPool {
    kernel: usize,
    stride: usize,
    pad: usize,
}

impl MaxPool {
    /// For each output position along an axis of `len` inputs, the input range of its window
    /// (padding excluded; never empty, since padding is at most half the kernel).
    fn windows(&self, len: usize, out: usize) -> Vec<(usize, usize)> {
        (0..out)
            .map(|o| {
                let start = o * self.stride;
                (start.saturating_sub(self.pad), (start + self.kernel).saturating_sub(self.pad).min(len))
            })
            .collect()
    }

    /// Index (within the plane) of the first maximum of the window rows `ys` × columns `xs`,
    /// NaN winning as in PyTorch (a later NaN replaces an earlier one).
    #[inline]
    fn argmax<T: Real>(plane: &[T], w: usize, ys: (usize, usize), xs: (usize, usize)) -> usize {
        let mut at = ys.0 * w + xs.0;
        let mut best = plane[at];
        for iy in ys.0..ys.1 {
            let base = iy * w + xs.0;
            for (j, &v) in plane[base..iy * w + xs.1].iter().enumerate() {
                if v > best || v.is_nan() {
                    (best, at) = (v, base + j);
                }
            }
        }
        at
    }

    /// The columns `lo..hi` of outputs whose windows lie wholly inside a row of `w` inputs.
    fn interior(&self, w: usize, ow: usize) -> (usize, usize) {
        let lo = self.pad.div_ceil(self.stride).min(ow);
        let hi = if w + self.pad >= self.kernel { ((w + self.pad - self.kernel) / self.stride + 1).min(ow) } else { 0 };
        (lo, hi.max(lo))
    }

    /// The maxima of output row `oy` (its window rows `ys`) into `best` and their indices in
    /// the plane into `at`, both indexed by output column, for a plane without NaN (`clean`;
    /// otherwise every output takes [`MaxPool::argmax`]'s exact path). The interior columns
    /// (`lo..hi`) sweep the window one tap at a time across the whole row: f32 planes (bf16
    /// ones widened) on AVX-512, sixteen outputs a vector
    /// ([`wick_kernels::cpu::pool::max_row_first`]), else with branch-free selects:
    /// consecutive outputs are independent work, where one compare chain per output was
    /// latency-bound and its random compares mispredicted (the first version: max pooling
    /// forward + backward on ResNet's stem; BENCHMARKS.md, "Kernel design measurements"). A tap
    /// replaces the maximum only when strictly greater, so the first maximum in row-major order
    /// wins, as in `argmax`.
    #[allow(clippy::too_many_arguments)]
    fn row<T: Real>(
        &self,
        plane: &[T],
        w: usize,
        ys: (usize, usize),
        cols: &[(usize, usize)],
        (lo, hi): (usize, usize),
        clean: bool,
        best: &mut [T],
        at: &mut [u32],
    ) {
        let (lo, hi) = if clean { (lo, hi) } else { (cols.len(), cols.len()) };
        for ox in (0..lo).chain(hi..cols.len()) {
            // The plane's length fits u32 (`MaxPool::bwd` checks).
            let i = Self::argmax(plane, w, ys, cols[ox]);
            (at[ox], best[ox]) = (i as u32, plane[i]);
        }
        if lo >= hi {
            return;
        }
        let (s, k, pad) = (self.stride, self.kernel, self.pad);
        let (best, at) = (&mut best[lo..hi], &mut at[lo..hi]);
        let x0 = lo * s - pad;
        if let (Some(p32), Some(b32)) = (T::as_f32(plane), T::as_f32_mut(best)) {
            if wick_kernels::cpu::pool::max_row_first(p32, w, ys, (x0, s, k), b32, at) {
                return;
            }
        }
        for (j, (b, a)) in best.iter_mut().zip(at.iter_mut()).enumerate() {
            let i = ys.0 * w + x0 + j * s;
            (*a, *b) = (i as u32, plane[i]);
        }
        for iy in ys.0..ys.1 {
            // The inputs of this window row for every interior output: `row[j·s + dx]`.
            let row = &plane[iy * w + x0..(iy + 1) * w];
            for dx in 0..k {
                if iy == ys.0 && dx == 0 {
                    continue;
                }
                let base = iy * w + x0 + dx;
                for (j, (b, a)) in best.iter_mut().zip(at.iter_mut()).enumerate() {
                    let v = row[j * s + dx];
                    // No NaN here: a plain compare decides.
                    let take = v > *b;
                    *a = std::hint::select_unpredictable(take, (base + j * s) as u32, *a);
                    *b = std::hint::select_unpredictable(take, v, *b);
                }
            }
        }
    }

    /// The CUDA body's sweep over an input of `shape`, checked as the host's.
    #[cfg(feature = "cuda")]
    fn sweep(&self, shape: &Shape) -> Result<super::cuda::pool::Sweep> {
        let (n, c, h, w) = dims4(shape)?;
        let (oh, ow) = self.out(h, w)?;
        let (kernel, stride, pad) = (self.kernel, self.stride, self.pad);
        Ok(super::cuda::pool::Sweep { planes: n * c, h, w, oh, ow, kernel, stride, pad })
    }

    /// Output sizes, checked.
    fn out(&self, h: usize, w: usize) -> Result<(usize, usize)> {
        if 2 * self.pad > self.kernel {
            return Err(candle_core::Error::Msg(format!(
                "max_pool2d: padding {} is more than half the kernel {}",
                self.pad, self.kernel
            )));
        }
        Ok((out_len(h, self.kernel, self.stride, self.pad)?, out_len(w, self.kernel, self.stride, self.pad)?))
    }

    /// Reads and writes the tensor's own elements: a bf16 plane is widened into a per-thread
    /// buffer that stays in the cache and its maxima (input values, exact) stored back as bf16.
    /// Widening whole tensors cost AMP's ResNet steps two f32 copies of the stem's output
    /// (BENCHMARKS.md, "Convolutional networks at every size (issue 30)").
    fn fwd<T: Real, E: Elem<T>>(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let (n, c, h, w) = dims4(l.shape())?;
        let (oh, ow) = self.out(h, w)?;
        let (rows, cols) = (self.windows(h, oh), self.windows(w, ow));
        let x = elems::<T, E>(s, l)?;
        let mut y = vec![E::store(T::zero()); n * c * oh * ow];
        let out = SharedMut::new(&mut y);
        let (lo, hi) = self.interior(w, ow);
        par_ranges(n * c, 1, |r| {
            let (mut wide, mut maxima, mut at) = (Vec::new(), Vec::new(), Vec::new());
            for p in r {
                let plane = widened::<T, E>(&x[p * h * w..(p + 1) * h * w], &mut wide);
                // SAFETY: one plane per index.
                let dst = unsafe { out.range(p * oh * ow, oh * ow) };
                // The interior of a plane without NaN: values only (the window's first maximum
                // matters for the gradient, not for the value); the edges and any plane with a
                // NaN take `argmax`'s exact path.
                let clean = !plane.iter().any(|v| v.is_nan());
                let (lo, hi) = if clean { (lo, hi) } else { (ow, ow) };
                into_plane::<T, E>(dst, &mut maxima, |dst| {
                    for (oy, ys) in rows.iter().enumerate() {
                        let best = &mut dst[oy * ow..(oy + 1) * ow];
                        for ox in (0..lo).chain(hi..ow) {
                            best[ox] = plane[Self::argmax(plane, w, *ys, cols[ox])];
                        }
                        if lo < hi {
                            let x0 = lo * self.stride - self.pad;
                            let best = &mut best[lo..hi];
                            let geometry = (x0, self.stride, self.kernel);
                            let swept = match (T::as_f32(plane), T::as_f32_mut(best)) {
                                (Some(p32), Some(b32)) => {
                                    at.resize(hi - lo, 0);
                                    wick_kernels::cpu::pool::max_row_first(p32, w, *ys, geometry, b32, &mut at)
                                }
                                _ => false,
                            };
                            if !swept {
                                max_interior(plane, w, *ys, x0, self.stride, self.kernel, best);
                            }
                        }
                    }
                });
            }
        });
        Ok((E::into_storage(y), Shape::from((n, c, oh, ow))))
    }

    /// As [`MaxPool::fwd`], plane by plane: a bf16 plane's gradient is summed in f32 in a
    /// per-thread buffer and rounded once into the result, as the whole-tensor f32 path did.
    fn bwd<T: Real, E: Elem<T>>(&self, x: &Tensor, g: &Tensor) -> Result<Tensor> {
        let (n, c, h, w) = dims4(x.shape())?;
        let (oh, ow) = self.out(h, w)?;
        let (rows, cols) = (self.windows(h, oh), self.windows(w, ow));
        // The result itself is the f32 (f64) sum, zeroed once by its allocation; a bf16 plane's
        // sum is a reused buffer, zeroed per plane.
        let in_place = E::compute_slice(&[]).is_some();
        let dx = with_elems::<T, E, _>(x, |x| {
            with_elems::<T, E, _>(g, |g| {
                if g.len() != n * c * oh * ow {
                    return Err(candle_core::Error::Msg("max_pool2d backward: gradient shape".into()));
                }
                if u32::try_from(h * w).is_err() {
                    return Err(candle_core::Error::Msg(format!(
                        "max_pool2d backward: a {h}×{w} plane has more positions than u32 indices hold"
                    )));
                }
                let mut dx = vec![E::store(T::zero()); x.len()];
                let out = SharedMut::new(&mut dx);
                let inner = self.interior(w, ow);
                par_ranges(n * c, 1, |r| {
                    let (mut best, mut at) = (vec![T::zero(); ow], vec![0u32; ow]);
                    let (mut wide, mut grads, mut sums) = (Vec::new(), Vec::new(), Vec::new());
                    for p in r {
                        let plane = widened::<T, E>(&x[p * h * w..(p + 1) * h * w], &mut wide);
                        let gp = widened::<T, E>(&g[p * oh * ow..(p + 1) * oh * ow], &mut grads);
                        // SAFETY: one plane per index.
                        let dst = unsafe { out.range(p * h * w, h * w) };
                        let clean = !plane.iter().any(|v| v.is_nan());
                        into_plane::<T, E>(dst, &mut sums, |dst| {
                            if !in_place {
                                dst.fill(T::zero());
                            }
                            for (oy, ys) in rows.iter().enumerate() {
                                self.row(plane, w, *ys, &cols, inner, clean, &mut best, &mut at);
                                for (i, gv) in at.iter().zip(&gp[oy * ow..(oy + 1) * ow]) {
                                    dst[*i as usize] = dst[*i as usize] + *gv;
                                }
                            }
                        });
                    }
                });
                Ok(dx)
            })
        })?;
        elem_tensor::<T, E>(dx, x.shape())
    }
}

wide_kernel! {
    /// The maxima of consecutive interior outputs `best` of one output row of a plane without
    /// NaN (window rows `ys`, the first window's first input column `x0`, stride `s`, kernel
    /// `k`), values only, one tap at a time across the row (independent lanes), compiled for
    /// the CPU's widest vectors. Max pooling's forward pass ran its index-tracking sweep in
    /// baseline SSE2: BENCHMARKS.md, "Convolutional networks at every size (issue 30)".
    fn max_interior<T>(plane: &[T], w: usize, ys: (usize, usize), x0: usize, s: usize, k: usize, best: &mut [T]) {
        let n = best.len();
        for iy in ys.0..ys.1 {
            let row = &plane[iy * w + x0..(iy + 1) * w];
            for dx in 0..k {
                let taps = row[dx..].iter().step_by(s).take(n);
                if iy == ys.0 && dx == 0 {
                    best.iter_mut().zip(taps).for_each(|(b, v)| *b = *v);
                } else if s == 2 && row.len() >= dx + 2 * n {
                    // Pairs: the compiler vectorises the even lanes' gather.
                    for (b, pair) in best.iter_mut().zip(row[dx..dx + 2 * n].chunks_exact(2)) {
                        *b = if pair[0] > *b { pair[0] } else { *b };
                    }
                } else {
                    best.iter_mut().zip(taps).for_each(|(b, v)| *b = if *v > *b { *v } else { *b });
                }
            }
        }
    }
}

impl CustomOp1 for MaxPool {
    fn name(&self) -> &'static str {
        "max_pool2d"
    }
    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        by_elem!(s.dtype(), T, E => self.fwd::<T, E>(s, l))
    }
    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s: &candle_core::CudaStorage, l: &Layout) -> Result<(candle_core::CudaStorage, Shape)> {
        let sweep = self.sweep(l.shape())?;
        let (n, c, _, _) = dims4(l.shape())?;
        super::cuda::pool::max_pool((s, l), sweep, Shape::from((n, c, sweep.oh, sweep.ow)))
    }
    fn bwd(&self, x: &Tensor, _res: &Tensor, g: &Tensor) -> Result<Option<Tensor>> {
        #[cfg(feature = "cuda")]
        if x.device().is_cuda() {
            return super::cuda::pool::max_pool_grad(x, g, self.sweep(x.shape())?).map(Some);
        }
        by_elem!(x.dtype(), T, E => self.bwd::<T, E>(x, g)).map(Some)
    }
}

/// Max pooling on the CPU or (feature `cuda`) a CUDA device (see [`crate::cnn::max_pool2d`]).
pub fn max_pool2d(x: &Tensor, kernel: usize, stride: usize, pad: usize) -> Result<Tensor> {
    super::apply1(&x.contiguous()?, MaxPool { kernel, stride, pad })
}

/// Mean over the two spatial dimensions: (N, C, H, W) → (N, C), summed in f64.
struct GlobalAvg;

impl GlobalAvg {
    fn fwd<T: Real>(s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let (n, c, h, w) = dims4(l.shape())?;
        let x = read::<T>(s, l)?;
        let hw = (h * w).max(1);
        let y: Vec<T> = (0..n * c).map(|p| T::of(sum(&x[p * hw..(p + 1) * hw]) / hw as f64)).collect();
        Ok((T::storage(y, s.dtype())?, Shape::from((n, c))))
    }

    fn bwd<T: Real>(x: &Tensor, g: &Tensor) -> Result<Tensor> {
        let (_, _, h, w) = dims4(x.shape())?;
        let hw = (h * w).max(1);
        let scale = T::of(1.0 / hw as f64);
        let dx = with::<T, _>(g, |g| Ok(g.iter().flat_map(|v| std::iter::repeat_n(*v * scale, hw)).collect()))?;
        tensor(dx, x.shape(), x.dtype())
    }
}

impl CustomOp1 for GlobalAvg {
    fn name(&self) -> &'static str {
        "global_avg_pool"
    }
    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        by_real!(s.dtype(), T => GlobalAvg::fwd::<T>(s, l))
    }
    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s: &candle_core::CudaStorage, l: &Layout) -> Result<(candle_core::CudaStorage, Shape)> {
        let (n, c, h, w) = dims4(l.shape())?;
        super::cuda::pool::global_avg((s, l), n * c, h * w, Shape::from((n, c)))
    }
    fn bwd(&self, x: &Tensor, _res: &Tensor, g: &Tensor) -> Result<Option<Tensor>> {
        #[cfg(feature = "cuda")]
        if x.device().is_cuda() {
            let (_, _, h, w) = dims4(x.shape())?;
            return super::cuda::pool::global_avg_grad(x, g, h * w).map(Some);
        }
        Ok(Some(by_real!(x.dtype(), T => GlobalAvg::bwd::<T>(x, g)?)))
    }
}

/// Global average pooling on the CPU or (feature `cuda`) a CUDA device (see
/// [`crate::cnn::global_avg_pool`]).
pub fn global_avg_pool(x: &Tensor) -> Result<Tensor> {
    super::apply1(&x.contiguous()?, GlobalAvg)
}
