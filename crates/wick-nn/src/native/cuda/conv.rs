//! The CUDA bodies of the dense and depthwise convolutions: cuDNN's forward, backward-data and
//! backward-filter (`super::cudnn`), on candle's stream of the device.
//!
//! Policies (PyTorch's `Conv_v7.cpp` with `benchmark=False`, unless said):
//! - **Algorithm**: cuDNN's heuristic list for the shape, the first that succeeds *and is
//!   deterministic* (the same bits on every run: wick's resume is exact; PyTorch's default allows
//!   atomics in backward-filter) and whose workspace can be drawn — a non-deterministic one only
//!   where no deterministic one can run; chosen once per (device, shape, dtype, direction) and
//!   cached.
//! - **Workspace**: drawn from the device's pool for the call (candle's `alloc`: governed, no zero
//!   fill, out of memory an `Err`), freed stream-ordered after it. At the choice, an algorithm whose
//!   workspace cannot be drawn is passed over for the next, as PyTorch does.
//! - **Math**: f32 with TF32 tensor cores (PyTorch's `cudnn.allow_tf32 = True` default;
//!   [`set_tf32`] turns it off), f16/bf16 on tensor cores with f32 sums, f64 exact.

use std::collections::HashMap;
use std::ffi::{c_int, c_void};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, OnceLock};

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut};
use candle_core::cuda_backend::{CudaDevice, CudaStorage, DeviceId};
use candle_core::{DType, Layout, Result, Shape, Tensor, WithDType};

use super::super::conv::Geometry;
use super::cudnn::{self, Api, Desc, Handle};
use super::{by_cuda_elem, err, in_dtype, output, tensor, view, with_cuda};

static TF32: AtomicBool = AtomicBool::new(true);

/// Allows (the default, as PyTorch) or forbids TF32 tensor cores in f32 GPU convolutions.
pub fn set_tf32(allow: bool) {
    TF32.store(allow, Ordering::Relaxed);
}

/// A convolution as cuDNN takes it: the host op's geometry (the same checks on both devices) and
/// its group count (C for a depthwise convolution, 1 for a dense one).
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
struct Conv {
    g: Geometry,
    groups: usize,
}

impl Conv {
    /// The convolution of images `x` and filters `w` (dense when `depthwise` is false).
    fn new(x: &Shape, w: &Shape, stride: usize, pad: usize, depthwise: bool) -> Result<Self> {
        let g = Geometry::new(x, w, stride, pad, depthwise)?;
        Ok(Conv { g, groups: if depthwise { g.c_in } else { 1 } })
    }
}

/// Forward (x, w → y), backward data (w, dy → dx), backward filter (x, dy → dw).
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
enum Direction {
    Forward = 0,
    Data = 1,
    Filter = 2,
}

/// cuDNN's data type of a dtype.
fn data_type(dtype: DType) -> Result<c_int> {
    Ok(match dtype {
        DType::F32 => cudnn::DATA_FLOAT,
        DType::F64 => cudnn::DATA_DOUBLE,
        DType::F16 => cudnn::DATA_HALF,
        DType::BF16 => cudnn::DATA_BFLOAT16,
        other => return Err(err(format!("cuDNN convolutions take no {other:?} tensors"))),
    })
}

fn int(v: usize) -> Result<c_int> {
    c_int::try_from(v).map_err(|_| err(format!("conv2d: size {v} exceeds cuDNN's 32-bit sizes")))
}

/// One handle per device, set on candle's stream of it (used under the lock).
struct Handles(HashMap<DeviceId, Handle>);
// SAFETY: a cuDNN handle may move between threads; it is only used under the mutex.
unsafe impl Send for Handles {}

fn handles() -> &'static Mutex<Handles> {
    static HANDLES: OnceLock<Mutex<Handles>> = OnceLock::new();
    HANDLES.get_or_init(|| Mutex::new(Handles(HashMap::new())))
}

/// (algorithm, workspace bytes) chosen per device, geometry, dtype, direction and math.
type Choices = HashMap<(DeviceId, Conv, DType, Direction, bool), (c_int, usize)>;

fn choices() -> &'static Mutex<Choices> {
    static CHOICES: OnceLock<Mutex<Choices>> = OnceLock::new();
    CHOICES.get_or_init(|| Mutex::new(HashMap::new()))
}

/// The descriptors of one convolution (destroyed on drop).
struct Descriptors<'a> {
    api: &'a Api,
    x: Desc,
    w: Desc,
    y: Desc,
    conv: Desc,
}

impl Drop for Descriptors<'_> {
    fn drop(&mut self) {
        // SAFETY: each non-null descriptor was created by this table's create function and is
        // destroyed once; their statuses are of no use here.
        unsafe {
            if !self.x.is_null() {
                (self.api.destroy_tensor)(self.x);
            }
            if !self.y.is_null() {
                (self.api.destroy_tensor)(self.y);
            }
            if !self.w.is_null() {
                (self.api.destroy_filter)(self.w);
            }
            if !self.conv.is_null() {
                (self.api.destroy_conv)(self.conv);
            }
        }
    }
}

impl<'a> Descriptors<'a> {
    fn new(api: &'a Api, conv: &Conv, dtype: DType, tf32: bool) -> Result<Self> {
        let data = data_type(dtype)?;
        let mut d = Descriptors {
            api,
            x: std::ptr::null_mut(),
            w: std::ptr::null_mut(),
            y: std::ptr::null_mut(),
            conv: std::ptr::null_mut(),
        };
        let (compute, math) = match dtype {
            DType::F64 => (cudnn::DATA_DOUBLE, cudnn::DEFAULT_MATH),
            DType::F32 if tf32 => (cudnn::DATA_FLOAT, cudnn::DEFAULT_MATH),
            DType::F32 => (cudnn::DATA_FLOAT, cudnn::FMA_MATH),
            _ => (cudnn::DATA_FLOAT, cudnn::TENSOR_OP_MATH),
        };
        let (g, groups) = (&conv.g, conv.groups);
        let [n, c_in, h, w, c_out, k, oh, ow, stride, pad] =
            [g.n, g.c_in, g.h, g.w, g.c_out, g.k, g.oh, g.ow, g.stride, g.pad];
        let per_group = c_in / groups.max(1);
        // SAFETY: cuDNN's descriptor calls on descriptors this function creates (each stored in
        // `d` at once, so a failure later destroys it), with C ints of the geometry.
        unsafe {
            api.check((api.create_tensor)(&mut d.x), "create tensor descriptor")?;
            api.check((api.create_tensor)(&mut d.y), "create tensor descriptor")?;
            api.check((api.create_filter)(&mut d.w), "create filter descriptor")?;
            api.check((api.create_conv)(&mut d.conv), "create convolution descriptor")?;
            let nchw = cudnn::TENSOR_NCHW;
            api.check((api.set_tensor_4d)(d.x, nchw, data, int(n)?, int(c_in)?, int(h)?, int(w)?), "images")?;
            api.check((api.set_tensor_4d)(d.y, nchw, data, int(n)?, int(c_out)?, int(oh)?, int(ow)?), "outputs")?;
            api.check((api.set_filter_4d)(d.w, data, nchw, int(c_out)?, int(per_group)?, int(k)?, int(k)?), "filters")?;
            let (p, s) = (int(pad)?, int(stride)?);
            let mode = cudnn::CROSS_CORRELATION;
            api.check((api.set_conv_2d)(d.conv, p, p, s, s, 1, 1, mode, compute), "convolution")?;
            api.check((api.set_group_count)(d.conv, int(groups)?), "group count")?;
            api.check((api.set_math_type)(d.conv, math), "math type")?;
        }
        Ok(d)
    }

    /// The descriptors in the order `direction`'s query functions take them.
    fn order(&self, direction: Direction) -> [Desc; 4] {
        match direction {
            Direction::Forward => [self.x, self.w, self.conv, self.y],
            Direction::Data => [self.w, self.y, self.conv, self.x],
            Direction::Filter => [self.x, self.y, self.conv, self.w],
        }
    }
}

/// Runs `direction` of the convolution `g` in `dtype` on `dev`: `a` and `b` the inputs (device
/// addresses: x and w, w and dy, or x and dy), `out` the output's.
fn run(dev: &CudaDevice, conv: &Conv, dtype: DType, direction: Direction, (a, b, out): (u64, u64, u64)) -> Result<()> {
    let api = cudnn::api()?;
    let tf32 = dtype == DType::F32 && TF32.load(Ordering::Relaxed);
    let d = Descriptors::new(api, conv, dtype, tf32)?;
    let stream = dev.cuda_stream();
    // cuDNN runs in the calling thread's current context: the device's.
    stream.context().bind_to_thread().map_err(|e| err(format!("conv2d: binding the device's context: {e}")))?;
    let mut guard = handles().lock().unwrap_or_else(|p| p.into_inner());
    let handle = match guard.0.get(&dev.id()) {
        Some(h) => *h,
        None => {
            let mut h: Handle = std::ptr::null_mut();
            // SAFETY: cudnnCreate writes a new handle (in the device's context, current above);
            // cudnnSetStream binds it to candle's stream of this device.
            unsafe {
                api.check((api.create)(&mut h), "create handle")?;
                api.check((api.set_stream)(h, stream.cu_stream() as *mut c_void), "set stream")?;
            }
            guard.0.insert(dev.id(), h);
            h
        }
    };
    let key = (dev.id(), *conv, dtype, direction, tf32);
    let chosen = choices().lock().unwrap_or_else(|p| p.into_inner()).get(&key).copied();
    let order = d.order(direction);
    let (algo, workspace) = match chosen {
        Some((algo, bytes)) => (algo, workspace(dev, bytes)?),
        None => {
            let (algo, bytes, ws) = choose(api, handle, dev, order, direction)?;
            choices().lock().unwrap_or_else(|p| p.into_inner()).insert(key, (algo, bytes));
            (algo, ws)
        }
    };
    let (one_f, zero_f, one_d, zero_d) = (1.0f32, 0.0f32, 1.0f64, 0.0f64);
    let (alpha, beta): (*const c_void, *const c_void) = if dtype == DType::F64 {
        (&one_d as *const f64 as *const c_void, &zero_d as *const f64 as *const c_void)
    } else {
        (&one_f as *const f32 as *const c_void, &zero_f as *const f32 as *const c_void)
    };
    let ws_guard = workspace.as_ref().map(|ws| (ws.device_ptr(&stream), ws.len()));
    let (ws_ptr, ws_len) = match &ws_guard {
        Some(((ptr, _), len)) => (*ptr as *mut c_void, *len),
        None => (std::ptr::null_mut(), 0),
    };
    let [da, db, conv, dout] = order;
    // SAFETY: the addresses are live device buffers of the sizes the descriptors say (the
    // callers' views and output), on the stream the handle is bound to; the workspace is at least
    // the bytes cuDNN asked for this algorithm; alpha and beta are host scalars of the compute
    // type (double for f64 data, float otherwise).
    let status = unsafe {
        (api.run[direction as usize])(
            handle,
            alpha,
            da,
            a as *const c_void,
            db,
            b as *const c_void,
            conv,
            algo,
            ws_ptr,
            ws_len,
            beta,
            dout,
            out as *mut c_void,
        )
    };
    drop(guard);
    // The workspace is freed after the call, in stream order.
    drop(ws_guard);
    drop(workspace);
    api.check(status, &format!("{direction:?} convolution of {conv:?} in {dtype:?}"))?;
    Ok(())
}

/// A workspace of `bytes` from the device's pool (none for 0).
fn workspace(dev: &CudaDevice, bytes: usize) -> Result<Option<CudaSlice<u8>>> {
    if bytes == 0 {
        return Ok(None);
    }
    // SAFETY: cuDNN's scratch: written before it is read, never read by wick.
    Ok(Some(unsafe { dev.alloc::<u8>(bytes) }?))
}

/// The first deterministic algorithm of cuDNN's list whose workspace can be drawn (else the first
/// other one): (algorithm, workspace bytes, the workspace).
#[allow(clippy::type_complexity)]
fn choose(
    api: &Api,
    handle: Handle,
    dev: &CudaDevice,
    [d0, d1, d2, d3]: [Desc; 4],
    direction: Direction,
) -> Result<(c_int, usize, Option<CudaSlice<u8>>)> {
    let mut perf = [cudnn::AlgoPerf::default(); 16];
    let mut count: c_int = 0;
    // SAFETY: the query writes at most `requested` results into `perf` and their count.
    unsafe {
        let status = (api.algos[direction as usize])(handle, d0, d1, d2, d3, 16, &mut count, perf.as_mut_ptr());
        api.check(status, &format!("{direction:?} algorithm list"))?;
    }
    let listed = &perf[..count.clamp(0, 16) as usize];
    let mut why = Vec::new();
    // The deterministic algorithms first; only where none of them can run (none listed for the
    // shape, or none whose workspace fits), the others — a result whose last bits may then vary
    // from run to run, rather than no convolution.
    for deterministic in [true, false] {
        for p in listed {
            if p.status != cudnn::SUCCESS || (p.determinism == cudnn::DETERMINISTIC) != deterministic {
                continue;
            }
            let mut bytes = 0usize;
            // SAFETY: the size query for an algorithm cuDNN listed, writing one size.
            let status = unsafe { (api.workspace[direction as usize])(handle, d0, d1, d2, d3, p.algo, &mut bytes) };
            if status != cudnn::SUCCESS {
                continue;
            }
            match workspace(dev, bytes) {
                Ok(ws) => return Ok((p.algo, bytes, ws)),
                Err(e) => why.push(format!("algorithm {} ({bytes} bytes of workspace): {e}", p.algo)),
            }
        }
    }
    Err(err(format!(
        "cuDNN offers no {direction:?} algorithm that fits ({count} listed){}{}",
        if why.is_empty() { "" } else { ": " },
        why.join("; ")
    )))
}

/// The convolution's forward pass: (N, C_out, OH, OW) in `x`'s dtype (the filters converted to it
/// when they differ).
pub(crate) fn forward(
    (sx, lx): (&CudaStorage, &Layout),
    (sw, lw): (&CudaStorage, &Layout),
    stride: usize,
    pad: usize,
    depthwise: bool,
) -> Result<(CudaStorage, Shape)> {
    let conv = Conv::new(lx.shape(), lw.shape(), stride, pad, depthwise)?;
    let g = conv.g;
    let dev = sx.device();
    let (w_conv, lw) = in_dtype(sw, lw, sx.dtype())?;
    let sw = w_conv.as_ref().unwrap_or(sw);
    let len = g.n.checked_mul(g.c_out * g.oh * g.ow).ok_or_else(|| err("conv2d: output size overflows"))?;
    by_cuda_elem!(sx.dtype(), E => {
        let (x, w) = (view::<E>(sx, lx)?, view::<E>(sw, &lw)?);
        let mut y = output::<E>(dev, len)?;
        let stream = dev.cuda_stream();
        {
            let ((xp, _sx), (wp, _sw)) = (x.device_ptr(&stream), w.device_ptr(&stream));
            let (yp, _sy) = y.device_ptr_mut(&stream);
            run(dev, &conv, E::DTYPE, Direction::Forward, (xp, wp, yp))?;
        }
        Ok((CudaStorage::wrap_cuda_slice(y, dev.clone()), Shape::from((g.n, g.c_out, g.oh, g.ow))))
    })
}

/// The convolution's gradients from images `x`, filters `w` and output gradient `dy`: the input
/// gradient when `want_dx`, the filters' gradient (in `w`'s dtype) when `want_dw`.
pub(crate) fn backward(
    x: &Tensor,
    w: &Tensor,
    dy: &Tensor,
    (stride, pad, depthwise): (usize, usize, bool),
    (want_dx, want_dw): (bool, bool),
) -> Result<(Option<Tensor>, Option<Tensor>)> {
    let conv = Conv::new(x.shape(), w.shape(), stride, pad, depthwise)?;
    let g = conv.g;
    let wc = w.to_dtype(x.dtype())?;
    let dy = dy.to_dtype(x.dtype())?;
    if dy.dims() != [g.n, g.c_out, g.oh, g.ow] {
        return Err(err(format!("conv2d backward: gradient {:?} for outputs of {g:?}", dy.dims())));
    }
    let (dx, dw) = with_cuda("conv2d backward", &[x, &wc, &dy], |p| {
        let [(sx, lx), (sw, lw), (sd, ld)] = [p[0], p[1], p[2]];
        let dev = sx.device();
        by_cuda_elem!(x.dtype(), E => {
            let (xv, wv, dv) = (view::<E>(sx, lx)?, view::<E>(sw, lw)?, view::<E>(sd, ld)?);
            let stream = dev.cuda_stream();
            let dx = if want_dx {
                let mut dx = output::<E>(dev, xv.len())?;
                {
                    let ((wp, _a), (dp, _b)) = (wv.device_ptr(&stream), dv.device_ptr(&stream));
                    let (xp, _c) = dx.device_ptr_mut(&stream);
                    run(dev, &conv, E::DTYPE, Direction::Data, (wp, dp, xp))?;
                }
                Some(tensor(dx, dev, x.shape()))
            } else {
                None
            };
            if !want_dw {
                return Ok((dx, None));
            }
            let mut dw = output::<E>(dev, wv.len())?;
            {
                let ((xp, _a), (dp, _b)) = (xv.device_ptr(&stream), dv.device_ptr(&stream));
                let (wp, _c) = dw.device_ptr_mut(&stream);
                run(dev, &conv, E::DTYPE, Direction::Filter, (xp, dp, wp))?;
            }
            Ok((dx, Some(tensor(dw, dev, w.shape()))))
        })
    })?;
    Ok((dx, dw.map(|dw| dw.to_dtype(w.dtype())).transpose()?))
}

/// True when GPU convolutions go through cuDNN (unless `WICK_CUDNN=off`).
pub fn uses_cudnn() -> bool {
    cudnn::wanted()
}

/// cuDNN's version (e.g. 91002 for 9.10.2), or why it cannot be opened.
pub fn cudnn_version() -> Result<usize> {
    Ok(cudnn::api()?.version)
}
