//! Depthwise convolution (one k×k filter per channel, MobileNetV2) with a closed-form backward:
//! direct loops, parallel over (image, channel) planes in the forward pass and over channels in
//! the backward pass. Stride 1 runs as flat passes over padded planes (rows of 7 or 14 are too
//! short to vectorise); stride 2 splits each input row into its even and odd columns so that
//! every tap reads a contiguous run.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp2, Layout, Result, Shape, Tensor};

use super::conv::Geometry;
use super::elem::{by_elem, elem_tensor, elems, into_plane, store_rows, widened, with_elems, Elem};
use super::{dot, par_ranges, read, with, Real, SharedMut};

/// Writes a row's even columns to `split[..half]` and its odd ones to `split[half..]`, so that a
/// stride-2 tap reads (and writes) a contiguous run.
#[inline(always)]
fn split_even_odd<T: Real>(row: &[T], split: &mut [T], half: usize) {
    let (even, odd) = split.split_at_mut(half);
    // In pairs, so that the loop vectorises (an even/odd branch per element ran scalar).
    let pairs = row.chunks_exact(2);
    if let [last] = pairs.remainder() {
        even[row.len() / 2] = *last;
    }
    for ((e, o), p) in even.iter_mut().zip(odd.iter_mut()).zip(pairs) {
        *e = p[0];
        *o = p[1];
    }
}

/// Adds a row split as by [`split_even_odd`] back onto `row`.
#[inline(always)]
fn add_even_odd<T: Real>(row: &mut [T], split: &[T], half: usize) {
    let (even, odd) = split.split_at(half);
    let len = row.len();
    let mut pairs = row.chunks_exact_mut(2);
    for ((e, o), p) in even.iter().zip(odd).zip(&mut pairs) {
        p[0] = p[0] + *e;
        p[1] = p[1] + *o;
    }
    if let [last] = pairs.into_remainder() {
        *last = *last + even[len / 2];
    }
}

struct Depthwise {
    stride: usize,
    pad: usize,
}

impl Depthwise {
    fn fwd<T: Real, E: Elem<T>>(
        &self,
        sx: &CpuStorage,
        lx: &Layout,
        sw: &CpuStorage,
        lw: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let g = Geometry::new(lx.shape(), lw.shape(), self.stride, self.pad, true)?;
        let (x, w) = (elems::<T, E>(sx, lx)?, read::<T>(sw, lw)?);
        let y = depthwise_forward::<T, E>(x, &w, g);
        Ok((E::into_storage(y), Shape::from((g.n, g.c_in, g.oh, g.ow))))
    }

    /// (dx when wanted, dw).
    fn bwd<T: Real, E: Elem<T>>(
        &self,
        x: &Tensor,
        w: &Tensor,
        dy: &Tensor,
        want_dx: bool,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let g = Geometry::new(x.shape(), w.shape(), self.stride, self.pad, true)?;
        with_elems::<T, E, _>(x, |x| {
            with::<T, _>(w, |w| with_elems::<T, E, _>(dy, |dy| Ok(depthwise_backward::<T, E>(x, w, dy, g, want_dx))))
        })
        .and_then(|(dx, dw)| {
            let dx = dx.map(|dx| elem_tensor::<T, E>(dx, x.shape())).transpose()?;
            Ok((dx, super::weight_grad(w, dw)?))
        })
    }
}

wide_kernel! {
    /// The depthwise convolution of images `x` (stored as `E`, widened as read) with filters `w`
    /// (C, k·k), each output summed in `T` and stored (rounded once) as `E`.
    fn depthwise_forward<T, E>(x: &[E], w: &[T], g: Geometry) -> Vec<E> {
        let (hw, ohw, kk) = (g.h * g.w, g.cols(), g.k * g.k);
        let mut y = vec![E::store(T::zero()); g.n * g.c_in * ohw];
        let out = SharedMut::new(&mut y);
        // Per kernel column: the output columns it reaches and their first input column.
        let taps = g.taps();
        par_ranges(g.n * g.c_in, 1, |r| {
            // Stride 2: each input row split into its even and odd columns, so that every tap
            // reads a contiguous run.
            let half = g.w.div_ceil(2);
            let mut split = vec![T::zero(); if g.stride == 2 { 2 * half } else { 0 }];
            // Stride 1: the plane padded, and the output in padded rows, so that each tap is one
            // flat pass over the whole plane (rows of 7 or 14 are too short to vectorise well).
            let (ph, pw) = (g.h + 2 * g.pad, g.w + 2 * g.pad);
            let flat = g.stride == 1;
            let mut padded = vec![T::zero(); if flat { ph * pw + g.k } else { 0 }];
            let mut wide = vec![T::zero(); if flat { g.oh * pw } else { 0 }];
            // Planes stored as bf16/f16 are widened (and outputs rounded) whole, not row by row.
            let (mut xs, mut ys) = (Vec::new(), Vec::new());
            for p in r {
                let filter = &w[(p % g.c_in) * kk..][..kk];
                let plane = widened(&x[p * hw..(p + 1) * hw], &mut xs);
                // SAFETY: one plane per index.
                let dst = unsafe { out.range(p * ohw, ohw) };
                if flat {
                    for (iy, src) in plane.chunks(g.w).enumerate() {
                        padded[(iy + g.pad) * pw + g.pad..][..g.w].copy_from_slice(src);
                    }
                    wide.iter_mut().for_each(|v| *v = T::zero());
                    for dy in 0..g.k {
                        for dx in 0..g.k {
                            let f = filter[dy * g.k + dx];
                            let src = &padded[dy * pw + dx..][..g.oh * pw];
                            for (v, s) in wide.iter_mut().zip(src) {
                                *v = *v + f * *s;
                            }
                        }
                    }
                    store_rows(dst, &wide, g.ow, pw, &mut ys);
                    continue;
                }
                into_plane(dst, &mut ys, |sums| {
                    for (oy, row) in sums.chunks_mut(g.ow).enumerate() {
                        row.iter_mut().for_each(|v| *v = T::zero());
                        for dy in 0..g.k {
                            let Some(iy) = g.source(oy, dy, g.h) else { continue };
                            let src = &plane[iy * g.w..(iy + 1) * g.w];
                            if g.stride == 2 {
                                split_even_odd(src, &mut split, half);
                            }
                            for (dx, (r, first)) in taps.iter().enumerate() {
                                let f = filter[dy * g.k + dx];
                                if g.stride == 2 {
                                    let run = &split[(first % 2) * half + first / 2..][..r.len()];
                                    // Contiguous on both sides: vectorises.
                                    for (v, s) in row[r.clone()].iter_mut().zip(run) {
                                        *v = *v + f * *s;
                                    }
                                } else {
                                    for (v, ix) in row[r.clone()].iter_mut().zip((*first..).step_by(g.stride)) {
                                        *v = *v + f * src[ix];
                                    }
                                }
                            }
                        }
                    }
                });
            }
        });
        y
    }
}

wide_kernel! {
    /// (dx when wanted, dw) of the depthwise convolution (images and output gradients stored as
    /// `E`, widened as read; dx summed in `T` and stored, rounded once, as `E`).
    fn depthwise_backward<T, E>(x: &[E], w: &[T], dy: &[E], g: Geometry, want_dx: bool) -> (Option<Vec<E>>, Vec<T>) {
        let (hw, ohw, kk) = (g.h * g.w, g.cols(), g.k * g.k);
        let taps = g.taps();
        let mut dx = if want_dx { vec![E::store(T::zero()); x.len()] } else { Vec::new() };
        let mut dw = vec![T::zero(); g.c_in * kk];
        let (sdx, sdw) = (SharedMut::new(&mut dx), SharedMut::new(&mut dw));
        // Parallel over channels: each channel's filter gradient sums over images.
        par_ranges(g.c_in, 1, |r| {
            // Stride 1: padded planes and the output gradient in padded rows (zeros in
            // the extra columns), so that each tap is one flat dot product (dW) and
            // one flat multiply-add (dX) over the whole plane.
            let (ph, pw) = (g.h + 2 * g.pad, g.w + 2 * g.pad);
            let flat = g.stride == 1;
            let size = |n: usize| if flat { n } else { 0 };
            let (mut padded, mut dpadded) =
                (vec![T::zero(); size(ph * pw + g.k)], vec![T::zero(); size(ph * pw + g.k)]);
            let mut wide = vec![T::zero(); size(g.oh * pw)];
            let half = g.w.div_ceil(2);
            let stride2 = |n: usize| if g.stride == 2 { n } else { 0 };
            let (mut split, mut dsplit) = (vec![T::zero(); stride2(2 * half)], vec![T::zero(); stride2(2 * half)]);
            // Planes stored as bf16/f16 are widened (and input gradients rounded) whole.
            let (mut xs, mut gs, mut ys) = (Vec::new(), Vec::new(), Vec::new());
            // Strides of 2 and more: a plane's input gradient summed here, then stored.
            let mut dacc = vec![T::zero(); if !flat && want_dx { hw } else { 0 }];
            // Image by image, this part's channels within each: its planes are neighbours in
            // memory, read as one stream (channel by channel, each image's small planes — 98
            // bytes at 7×7 in bf16 — were scattered reads the prefetcher could not follow). Each
            // channel still adds its images' dW terms in image order.
            for b in 0..g.n {
                for c in r.clone() {
                    let filter = &w[c * kk..][..kk];
                    // SAFETY: one channel per index.
                    let dwc = unsafe { sdw.range(c * kk, kk) };
                    let p = b * g.c_in + c;
                    let plane = widened(&x[p * hw..(p + 1) * hw], &mut xs);
                    let gp = widened(&dy[p * ohw..(p + 1) * ohw], &mut gs);
                    // SAFETY: plane `p` belongs to channel `c` only.
                    let mut dplane = want_dx.then(|| unsafe { sdx.range(p * hw, hw) });
                    dacc.iter_mut().for_each(|v| *v = T::zero());
                    if flat {
                        for (iy, src) in plane.chunks(g.w).enumerate() {
                            padded[(iy + g.pad) * pw + g.pad..][..g.w].copy_from_slice(src);
                        }
                        for (oy, src) in gp.chunks(g.ow).enumerate() {
                            wide[oy * pw..oy * pw + g.ow].copy_from_slice(src);
                        }
                        if want_dx {
                            dpadded.iter_mut().for_each(|v| *v = T::zero());
                        }
                        for t in 0..kk {
                            let off = (t / g.k) * pw + t % g.k;
                            let span = &padded[off..off + g.oh * pw];
                            dwc[t] = dwc[t] + T::of(dot(&wide, span));
                            if want_dx {
                                let f = filter[t];
                                for (d, v) in dpadded[off..off + g.oh * pw].iter_mut().zip(&wide) {
                                    *d = *d + f * *v;
                                }
                            }
                        }
                        if let Some(d) = dplane.as_deref_mut() {
                            store_rows(d, &dpadded[g.pad * pw + g.pad..], g.w, pw, &mut ys);
                        }
                        continue;
                    }
                    if g.stride == 2 {
                        // Each input row split into its even and odd columns (as in the forward
                        // pass), so that every tap's dot product and gradient update run over
                        // contiguous elements; a row's input gradient gathers in its split form
                        // and is added back once.
                        for oy in 0..g.oh {
                            let grow = &gp[oy * g.ow..(oy + 1) * g.ow];
                            for dy_ in 0..g.k {
                                let Some(iy) = g.source(oy, dy_, g.h) else { continue };
                                let src = &plane[iy * g.w..(iy + 1) * g.w];
                                split_even_odd(src, &mut split, half);
                                dsplit.iter_mut().for_each(|v| *v = T::zero());
                                for (dx_, (r, first)) in taps.iter().enumerate() {
                                    if r.is_empty() {
                                        continue;
                                    }
                                    let at = (first % 2) * half + first / 2;
                                    let gr = &grow[r.clone()];
                                    let t = dy_ * g.k + dx_;
                                    dwc[t] = dwc[t] + T::of(dot(gr, &split[at..at + r.len()]));
                                    if want_dx {
                                        let f = filter[t];
                                        for (d, gv) in dsplit[at..at + r.len()].iter_mut().zip(gr) {
                                            *d = *d + f * *gv;
                                        }
                                    }
                                }
                                if want_dx {
                                    add_even_odd(&mut dacc[iy * g.w..(iy + 1) * g.w], &dsplit, half);
                                }
                            }
                        }
                    } else {
                        // Strides of 3 and more (stride 1 and 2 took the paths above).
                        for oy in 0..g.oh {
                            let grow = &gp[oy * g.ow..(oy + 1) * g.ow];
                            for dy_ in 0..g.k {
                                let Some(iy) = g.source(oy, dy_, g.h) else { continue };
                                let src = &plane[iy * g.w..(iy + 1) * g.w];
                                for (dx_, (r, first)) in taps.iter().enumerate() {
                                    let f = filter[dy_ * g.k + dx_];
                                    let mut acc = T::zero();
                                    for (gv, ix) in grow[r.clone()].iter().zip((*first..).step_by(g.stride)) {
                                        acc = acc + *gv * src[ix];
                                    }
                                    dwc[dy_ * g.k + dx_] = dwc[dy_ * g.k + dx_] + acc;
                                    if want_dx {
                                        let drow = &mut dacc[iy * g.w..(iy + 1) * g.w];
                                        for (gv, ix) in grow[r.clone()].iter().zip((*first..).step_by(g.stride)) {
                                            drow[ix] = drow[ix] + f * *gv;
                                        }
                                    }
                                }
                            }
                        }
                    }
                    if let Some(d) = dplane {
                        d.iter_mut().zip(&dacc).for_each(|(d, v)| *d = E::store(*v));
                    }
                }
            }
        });
        (want_dx.then_some(dx), dw)
    }
}

impl CustomOp2 for Depthwise {
    fn name(&self) -> &'static str {
        "depthwise_conv2d"
    }
    fn cpu_fwd(&self, sx: &CpuStorage, lx: &Layout, sw: &CpuStorage, lw: &Layout) -> Result<(CpuStorage, Shape)> {
        by_elem!(sx.dtype(), T, E => self.fwd::<T, E>(sx, lx, sw, lw))
    }
    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        sx: &candle_core::CudaStorage,
        lx: &Layout,
        sw: &candle_core::CudaStorage,
        lw: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        super::cuda::conv::forward((sx, lx), (sw, lw), self.stride, self.pad, true)
    }
    fn bwd(&self, x: &Tensor, w: &Tensor, _res: &Tensor, dy: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let want_dx = x.track_op();
        #[cfg(feature = "cuda")]
        if x.device().is_cuda() {
            return super::cuda::conv::backward(x, w, dy, (self.stride, self.pad, true), (want_dx, w.track_op()));
        }
        by_elem!(x.dtype(), T, E => self.bwd::<T, E>(x, w, dy, want_dx))
    }
}

/// A depthwise convolution (`weight` (C, 1, k, k)): on the CPU computed in f32 (f64 for f64); on a
/// CUDA device (feature `cuda`) through cuDNN with C groups.
pub fn depthwise_conv2d(x: &Tensor, weight: &Tensor, pad: usize, stride: usize) -> Result<Tensor> {
    super::apply2(&x.contiguous()?, &weight.contiguous()?, Depthwise { stride, pad })
}

#[cfg(test)]
mod tests {
    use candle_core::{Device, Tensor};

    #[test]
    fn empty_images_are_refused_not_walked() {
        let w = Tensor::ones((2, 1, 3, 3), candle_core::DType::F32, &Device::Cpu).unwrap();
        for shape in [(1, 2, 0, 5), (1, 2, 5, 0)] {
            let x = Tensor::ones(shape, candle_core::DType::F32, &Device::Cpu).unwrap();
            let err = super::depthwise_conv2d(&x, &w, 1, 1).unwrap_err().to_string();
            assert!(err.contains("empty spatial dimension"), "{err}");
        }
    }
}
