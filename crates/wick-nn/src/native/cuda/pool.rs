//! The CUDA bodies of max pooling and global average pooling (`kernels/src/cuda/nn_pool.cu`): one
//! launch each way. Max pooling keeps only its input, as the host op; its backward is a gather
//! (each input sums the gradients of the windows whose first maximum it is, in the host's order).

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::PushKernelArg;
use candle_core::cuda_backend::CudaStorage;
use candle_core::{Layout, Result, Shape, Tensor, WithDType};

use super::{by_cuda_elem, elementwise, err, function, output, suffix, tensor, view, warp_per_row, with_cuda};

const MODULE: &str = "nn_pool";

/// A max-pooling window sweep: (N·C planes, H, W, out H, out W, kernel, stride, padding).
#[derive(Clone, Copy)]
pub(crate) struct Sweep {
    pub(crate) planes: usize,
    pub(crate) h: usize,
    pub(crate) w: usize,
    pub(crate) oh: usize,
    pub(crate) ow: usize,
    pub(crate) kernel: usize,
    pub(crate) stride: usize,
    pub(crate) pad: usize,
}

impl Sweep {
    fn args(&self) -> [i64; 8] {
        [self.planes, self.h, self.w, self.oh, self.ow, self.kernel, self.stride, self.pad].map(|v| v as i64)
    }
}

/// Max pooling's forward pass: (N, C, oh, ow) of `shape`.
pub(crate) fn max_pool((s, l): (&CudaStorage, &Layout), sweep: Sweep, shape: Shape) -> Result<(CudaStorage, Shape)> {
    let dev = s.device();
    let n = sweep.planes * sweep.oh * sweep.ow;
    let storage = by_cuda_elem!(s.dtype(), E => {
        let x = view::<E>(s, l)?;
        let f = function(dev, MODULE, &format!("wick_max_pool_{}", suffix(E::DTYPE)?))?;
        let mut y = output::<E>(dev, n)?;
        let a = sweep.args();
        let stream = dev.cuda_stream();
        let mut launch = stream.launch_builder(&f);
        launch.arg(&x).arg(&mut y);
        for v in &a {
            launch.arg(v);
        }
        // SAFETY: (x: planes × h × w of E; y: planes × oh × ow of E; then eight 64-bit sizes), in
        // order; every window lies in its plane (the host op checked the sweep).
        unsafe { launch.launch(elementwise(n)) }.map_err(|e| err(format!("max_pool2d: {e}")))?;
        Ok(CudaStorage::wrap_cuda_slice(y, dev.clone()))
    })?;
    Ok((storage, shape))
}

/// Max pooling's input gradient from the input `x` and the output gradient `g`.
pub(crate) fn max_pool_grad(x: &Tensor, g: &Tensor, sweep: Sweep) -> Result<Tensor> {
    if g.elem_count() != sweep.planes * sweep.oh * sweep.ow || g.dtype() != x.dtype() {
        return Err(err("max_pool2d backward: gradient shape"));
    }
    with_cuda("max_pool2d backward", &[x, g], |p| {
        let [(sx, lx), (sg, lg)] = [p[0], p[1]];
        let dev = sx.device();
        by_cuda_elem!(x.dtype(), E => {
            let (xv, gv) = (view::<E>(sx, lx)?, view::<E>(sg, lg)?);
            let f = function(dev, MODULE, &format!("wick_max_pool_grad_{}", suffix(E::DTYPE)?))?;
            let mut dx = output::<E>(dev, xv.len())?;
            let a = sweep.args();
            let stream = dev.cuda_stream();
            let mut launch = stream.launch_builder(&f);
            launch.arg(&xv).arg(&gv).arg(&mut dx);
            for v in &a {
                launch.arg(v);
            }
            // SAFETY: (x, dx: planes × h × w of E; g: planes × oh × ow of E; eight sizes), in order.
            unsafe { launch.launch(elementwise(xv.len())) }.map_err(|e| err(format!("max_pool2d backward: {e}")))?;
            Ok(tensor(dx, dev, x.shape()))
        })
    })
}

/// Global average pooling's forward pass: one warp a plane, summed in f64.
pub(crate) fn global_avg(
    (s, l): (&CudaStorage, &Layout),
    planes: usize,
    hw: usize,
    shape: Shape,
) -> Result<(CudaStorage, Shape)> {
    let dev = s.device();
    let storage = by_cuda_elem!(s.dtype(), E => {
        let x = view::<E>(s, l)?;
        let f = function(dev, MODULE, &format!("wick_global_avg_{}", suffix(E::DTYPE)?))?;
        let mut y = output::<E>(dev, planes)?;
        let (p, n) = (planes as i64, hw as i64);
        let stream = dev.cuda_stream();
        let mut launch = stream.launch_builder(&f);
        launch.arg(&x).arg(&mut y).arg(&p).arg(&n);
        let grid = warp_per_row(planes);
        // SAFETY: (x: planes × hw of E; y: planes of E; planes, hw), in order.
        unsafe { launch.launch(grid) }.map_err(|e| err(format!("global_avg_pool: {e}")))?;
        Ok(CudaStorage::wrap_cuda_slice(y, dev.clone()))
    })?;
    Ok((storage, shape))
}

/// Global average pooling's input gradient: each plane `g / hw`.
pub(crate) fn global_avg_grad(x: &Tensor, g: &Tensor, hw: usize) -> Result<Tensor> {
    let planes = x.elem_count() / hw.max(1);
    if g.elem_count() != planes || g.dtype() != x.dtype() {
        return Err(err("global_avg_pool backward: gradient shape"));
    }
    with_cuda("global_avg_pool backward", &[g], |p| {
        let (sg, lg) = p[0];
        let dev = sg.device();
        by_cuda_elem!(x.dtype(), E => {
            let gv = view::<E>(sg, lg)?;
            let f = function(dev, MODULE, &format!("wick_global_avg_grad_{}", suffix(E::DTYPE)?))?;
            let mut dx = output::<E>(dev, planes * hw)?;
            let (np, n) = (planes as i64, hw as i64);
            let stream = dev.cuda_stream();
            let mut launch = stream.launch_builder(&f);
            launch.arg(&gv).arg(&mut dx).arg(&np).arg(&n);
            // SAFETY: (g: planes of E; dx: planes × hw of E; planes, hw), in order.
            unsafe { launch.launch(elementwise(planes * hw)) }.map_err(|e| err(format!("global_avg_pool backward: {e}")))?;
            Ok(tensor(dx, dev, x.shape()))
        })
    })
}
