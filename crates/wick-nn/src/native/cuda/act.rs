//! The CUDA bodies of the element-wise activations (`kernels/src/cuda/nn_act.cu`): each forward
//! and each backward one launch over contiguous tensors, computing in f32 (f64 for f64) and
//! rounding once, as the host bodies in `crate::native::act` do.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{CudaSlice, CudaView, DeviceRepr, PushKernelArg};
use candle_core::cuda_backend::{CudaDType, CudaDevice, CudaStorage};
use candle_core::{Layout, Result, Shape, Storage, Tensor, WithDType};

use super::{by_cuda_elem, elementwise, err, function, output, suffix, tensor, view, with_cuda};

const MODULE: &str = "nn_act";

/// Launches `wick_{kernel}_{dtype}(inputs…, out, n, param)` and returns `out`.
fn launch_map<E: CudaDType + WithDType + DeviceRepr>(
    dev: &CudaDevice,
    kernel: &str,
    inputs: &[CudaView<'_, E>],
    param: f64,
) -> Result<CudaSlice<E>> {
    let n = inputs.first().map(|v| v.len()).unwrap_or(0);
    if inputs.iter().any(|v| v.len() != n) {
        return Err(err(format!("{kernel}: inputs of different lengths")));
    }
    let f = function(dev, MODULE, &format!("wick_{kernel}_{}", suffix(E::DTYPE)?))?;
    let mut out = output::<E>(dev, n)?;
    let len = n as i64;
    let stream = dev.cuda_stream();
    let mut launch = stream.launch_builder(&f);
    for v in inputs {
        launch.arg(v);
    }
    launch.arg(&mut out).arg(&len).arg(&param);
    // SAFETY: the kernel takes the inputs (each `n` elements of E), the output (`n` elements of
    // E, allocated above), `n` as a 64-bit integer and one double, in this order.
    unsafe { launch.launch(elementwise(n)) }.map_err(|e| err(format!("{kernel}: {e}")))?;
    Ok(out)
}

/// A forward pass: `kernel` over same-length contiguous inputs, the output shaped like the first.
pub(crate) fn forward(kernel: &str, inputs: &[(&CudaStorage, &Layout)], param: f64) -> Result<(CudaStorage, Shape)> {
    let (first, layout) = *inputs.first().ok_or_else(|| err(format!("{kernel}: no input")))?;
    let dev = first.device();
    if inputs.iter().any(|(s, _)| s.dtype() != first.dtype()) {
        return Err(err(format!("{kernel}: inputs of different dtypes")));
    }
    let storage = by_cuda_elem!(first.dtype(), E => {
        let views = inputs.iter().map(|(s, l)| view::<E>(s, l)).collect::<Result<Vec<_>>>()?;
        launch_map::<E>(dev, kernel, &views, param).map(|out| CudaStorage::wrap_cuda_slice(out, dev.clone()))
    })?;
    Ok((storage, layout.shape().clone()))
}

/// Runs `f` over the CUDA storages and layouts of same-shaped, same-dtype tensors (made
/// contiguous first).
fn with_storages<R>(what: &str, ts: &[&Tensor], f: impl FnOnce(&[(&CudaStorage, &Layout)]) -> Result<R>) -> Result<R> {
    let first = ts.first().ok_or_else(|| err(format!("{what}: no input")))?;
    if ts.iter().any(|t| t.shape() != first.shape() || t.dtype() != first.dtype()) {
        return Err(err(format!("{what}: inputs of different shapes or dtypes")));
    }
    with_cuda(what, ts, f)
}

/// A gradient: `kernel` over same-shaped tensors (the op's inputs, then the output gradient), a
/// tensor shaped like them.
pub(crate) fn grad(kernel: &str, ts: &[&Tensor], param: f64) -> Result<Tensor> {
    let (storage, shape) = with_storages(kernel, ts, |pairs| forward(kernel, pairs, param))?;
    Ok(Tensor::from_storage(Storage::Cuda(storage), shape, candle_core::op::BackpropOp::none(), false))
}

/// `silu(a)·b`'s gradients with respect to `a` and `b` for the output gradient `g`, one launch.
pub(crate) fn silu_mul_grads(a: &Tensor, b: &Tensor, g: &Tensor) -> Result<(Tensor, Tensor)> {
    with_storages("silu_mul backward", &[a, b, g], |pairs| {
        let dev = pairs[0].0.device();
        by_cuda_elem!(a.dtype(), E => {
            let v = pairs.iter().map(|(s, l)| view::<E>(s, l)).collect::<Result<Vec<_>>>()?;
            let n = v[0].len();
            let f = function(dev, MODULE, &format!("wick_silu_mul_grad_{}", suffix(E::DTYPE)?))?;
            let (mut da, mut db) = (output::<E>(dev, n)?, output::<E>(dev, n)?);
            let len = n as i64;
            let stream = dev.cuda_stream();
            let mut launch = stream.launch_builder(&f);
            launch.arg(&v[0]).arg(&v[1]).arg(&v[2]).arg(&mut da).arg(&mut db).arg(&len);
            // SAFETY: (a, b, g, da, db: `n` elements of E each; n) as the kernel declares them.
            unsafe { launch.launch(elementwise(n)) }.map_err(|e| err(format!("silu_mul backward: {e}")))?;
            Ok((tensor(da, dev, a.shape()), tensor(db, dev, b.shape())))
        })
    })
}

/// `silu(a)·b` of rows of `2·width` holding `a` then `b`: (rows × width).
pub(crate) fn silu_mul_packed(s: &CudaStorage, l: &Layout, width: usize, shape: Shape) -> Result<(CudaStorage, Shape)> {
    let dev = s.device();
    let storage = by_cuda_elem!(s.dtype(), E => {
        let u = view::<E>(s, l)?;
        let rows = u.len() / (2 * width).max(1);
        let f = function(dev, MODULE, &format!("wick_silu_mul_packed_{}", suffix(E::DTYPE)?))?;
        let mut y = output::<E>(dev, rows * width)?;
        let (r, w) = (rows as i64, width as i64);
        let stream = dev.cuda_stream();
        let mut launch = stream.launch_builder(&f);
        launch.arg(&u).arg(&mut y).arg(&r).arg(&w);
        // SAFETY: u holds rows × 2·width elements, y rows × width; then the two counts.
        unsafe { launch.launch(elementwise(rows * width)) }.map_err(|e| err(format!("silu_mul: {e}")))?;
        Ok(CudaStorage::wrap_cuda_slice(y, dev.clone()))
    })?;
    Ok((storage, shape))
}

/// The packed `silu(a)·b`'s gradient: `du` shaped like `u`, each row's `a` part then `b` part.
pub(crate) fn silu_mul_packed_grad(u: &Tensor, g: &Tensor, width: usize) -> Result<Tensor> {
    with_cuda("silu_mul backward", &[u, g], |p| {
        let [(su, lu), (sg, lg)] = [p[0], p[1]];
        let dev = su.device();
        by_cuda_elem!(u.dtype(), E => {
            let (uv, gv) = (view::<E>(su, lu)?, view::<E>(sg, lg)?);
            let rows = uv.len() / (2 * width).max(1);
            if gv.len() != rows * width {
                return Err(err(format!("silu_mul backward: gradient of {} elements for {rows} × {width}", gv.len())));
            }
            let f = function(dev, MODULE, &format!("wick_silu_mul_packed_grad_{}", suffix(E::DTYPE)?))?;
            let mut du = output::<E>(dev, uv.len())?;
            let (r, w) = (rows as i64, width as i64);
            let stream = dev.cuda_stream();
            let mut launch = stream.launch_builder(&f);
            launch.arg(&uv).arg(&gv).arg(&mut du).arg(&r).arg(&w);
            // SAFETY: u and du hold rows × 2·width elements, g rows × width; then the two counts.
            unsafe { launch.launch(elementwise(rows * width)) }.map_err(|e| err(format!("silu_mul backward: {e}")))?;
            Ok(tensor(du, dev, u.shape()))
        })
    })
}
