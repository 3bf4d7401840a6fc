//! The CUDA bodies of wick-nn's ops (feature `cuda`): the second body of the same candle custom
//! ops whose host bodies are [`super`]'s, so a model's graph — its nodes, what each keeps
//! for backward, the structure of its backward pass — is the same on both devices.
//!
//! The kernels are `wick-kernels`' CUDA C (`kernels/src/cuda/nn_*.cu`), compiled by the real nvcc
//! into the fatbins that crate embeds; this module loads them once per device and module
//! (`function`), launches them on candle's stream of the device (so they are ordered after the
//! ops that produced their inputs), and wraps their outputs as candle storage. Every output is
//! drawn from the device's current memory pool through candle's `alloc` (`cuMemAllocAsync`: wick's
//! governed pool under an engine; out of memory is an `Err`), and written whole by its kernel
//! (no zero fill).
//!
//! - `act`: the element-wise activations (ReLU, ReLU6, GELU, SiLU·mul, packed SiLU·mul, the
//!   residual `relu(a + b)`) forward and backward;
//! - [`attention`]: scaled dot-product attention (heads apart or packed, with an additive bias),
//!   forward keeping one log-sum-exp per query row on the device, never an s × s tensor, on tensor
//!   cores for f16/bf16 (`attention_plan`: which kernels, their blocks and shared memory);
//! - `loss`: cross-entropy over a vocabulary (one log-sum-exp a row kept, no probabilities) and
//!   embedding lookups (each table row's gradient summed in position order);
//! - `pool`: max pooling (PyTorch's first-maximum rule, backward as a gather in the host's order)
//!   and global average pooling;
//! - `rope`: rotary position embeddings (heads apart or the q and k of a packed projection);
//! - `norm`: layer norm and RMS norm, forward keeping one (mean, inverse deviation) pair per row
//!   on the device, backward from them;
//! - [`conv`]: the dense and depthwise convolutions through cuDNN (`cudnn`: opened at run time,
//!   so a machine without it still builds and runs; a GPU convolution then says how to install it);
//! - `linear`: the linear layer's products on cuBLAS (the bias added inside the forward product's
//!   sums; three products a step, nothing recomputed) and its bias gradient;
//! - `batch_norm`: batch norm with its fused ReLU/ReLU6, the statistics and the running estimates
//!   computed on the device, one (mean, inverse deviation) pair per channel kept for backward.
//!
//! Where the kernels were not compiled in (a build without `WICK_KERNELS_NVCC`), [`serves`]
//! answers false and the callers keep the composed form of candle's ops, as without the feature.

pub(crate) mod act;
pub mod attention;
mod attention_plan;
pub(crate) mod batch_norm;
pub mod conv;
pub(crate) mod cudnn;
pub(crate) mod linear;
pub(crate) mod loss;
pub(crate) mod norm;
pub(crate) mod pool;
pub(crate) mod rope;

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{CudaFunction, CudaModule, CudaSlice, CudaView, LaunchConfig};
use candle_core::cuda_backend::{CudaDType, CudaDevice, CudaStorage, DeviceId};
use candle_core::op::BackpropOp;
use candle_core::{DType, Device, Layout, Result, Shape, Storage, Tensor};

/// Threads per block of the element-wise kernels.
pub(crate) const THREADS: u32 = 256;

/// True when the CUDA bodies serve tensors like `t`: on a CUDA device, in a float dtype, with the
/// kernels compiled into this build (and not inside [`super::with_composed`]).
pub fn serves(t: &Tensor) -> bool {
    wick_kernels::COMPILED
        && !super::composed_only()
        && matches!(t.device(), Device::Cuda(_))
        && matches!(t.dtype(), DType::F32 | DType::F64 | DType::BF16 | DType::F16)
}

pub(crate) fn err(message: impl std::fmt::Display) -> candle_core::Error {
    candle_core::Error::Msg(format!("wick CUDA kernels: {message}"))
}

/// The kernel name suffix of a dtype (`wick_gelu_bf16` …).
pub(crate) fn suffix(dtype: DType) -> Result<&'static str> {
    Ok(match dtype {
        DType::F32 => "f32",
        DType::F16 => "f16",
        DType::BF16 => "bf16",
        DType::F64 => "f64",
        other => return Err(err(format!("no kernel takes {other:?} tensors"))),
    })
}

type Modules = HashMap<(DeviceId, &'static str), Arc<CudaModule>>;
/// Per device, by name: looked up with the name as it is (no key built on the launch path).
type Functions = HashMap<DeviceId, HashMap<String, CudaFunction>>;

/// Loaded modules and functions, per device (a device's context owns them: a module loaded on one
/// device cannot launch on another).
fn cache() -> &'static Mutex<(Modules, Functions)> {
    static CACHE: OnceLock<Mutex<(Modules, Functions)>> = OnceLock::new();
    CACHE.get_or_init(|| Mutex::new((HashMap::new(), HashMap::new())))
}

/// Kernel `name` of module `module` (a fatbin of `wick_kernels::KERNELS`) on `dev`, loaded on
/// first use.
pub(crate) fn function(dev: &CudaDevice, module: &'static str, name: &str) -> Result<CudaFunction> {
    let mut guard = cache().lock().unwrap_or_else(|p| p.into_inner());
    let (modules, functions) = &mut *guard;
    if let Some(f) = functions.get(&dev.id()).and_then(|by_name| by_name.get(name)) {
        return Ok(f.clone());
    }
    let m = match modules.get(&(dev.id(), module)) {
        Some(m) => m.clone(),
        None => {
            let bytes = wick_kernels::fatbin(module).ok_or_else(|| {
                err("wick-kernels was built without its CUDA kernels: build with WICK_KERNELS_NVCC=<path to nvcc>")
            })?;
            let m = dev
                .cuda_stream()
                .context()
                .load_module(candle_core::cuda_backend::cudarc::nvrtc::Ptx::from_binary(bytes.to_vec()))
                .map_err(|e| err(format!("loading {module}: {e}")))?;
            modules.insert((dev.id(), module), m.clone());
            m
        }
    };
    let f = m.load_function(name).map_err(|e| err(format!("{name}: {e}")))?;
    functions.entry(dev.id()).or_default().insert(name.to_string(), f.clone());
    Ok(f)
}

/// The compute type of a tensor dtype: f64 for f64, f32 otherwise (the kernels' weights).
pub(crate) fn compute(dtype: DType) -> DType {
    if dtype == DType::F64 {
        DType::F64
    } else {
        DType::F32
    }
}

/// `s` in dtype `to` (a converted copy only when it differs).
pub(crate) fn in_dtype(s: &CudaStorage, l: &Layout, to: DType) -> Result<(Option<CudaStorage>, Layout)> {
    if s.dtype() == to {
        Ok((None, l.clone()))
    } else {
        Ok((Some(s.to_dtype(l, to)?), Layout::contiguous(l.shape())))
    }
}

/// Rows a chunk of a column sum's partial sums takes (more when there would be over 65 535 chunks,
/// a grid's limit in y), and the chunks for `rows` rows: (rows a chunk, chunks).
pub(crate) fn row_chunks(rows: usize) -> (usize, usize) {
    let chunk = 64usize.max(rows.div_ceil(65_535));
    (chunk, rows.div_ceil(chunk).max(1))
}

/// A launch of `n` independent elements, grid-stride (at most 65 535 blocks).
pub(crate) fn elementwise(n: usize) -> LaunchConfig {
    let blocks = n.div_ceil(THREADS as usize).clamp(1, 65_535) as u32;
    LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (THREADS, 1, 1), shared_mem_bytes: 0 }
}

/// One block of [`THREADS`] a row, at most 65 535 blocks (the kernels loop over the rest).
pub(crate) fn per_row(rows: usize) -> LaunchConfig {
    LaunchConfig { grid_dim: (rows.clamp(1, 65_535) as u32, 1, 1), block_dim: (THREADS, 1, 1), shared_mem_bytes: 0 }
}

/// One warp a row, 8 warps (a block of [`THREADS`]) a block, at most 65 535 blocks (the kernels
/// loop over the rest).
pub(crate) fn warp_per_row(rows: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (rows.div_ceil((THREADS / 32) as usize).clamp(1, 65_535) as u32, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// The elements of a contiguous CUDA storage under `layout`, as a view for a launch.
pub(crate) fn view<'a, E: CudaDType>(s: &'a CudaStorage, layout: &Layout) -> Result<CudaView<'a, E>> {
    let (start, end) = layout.contiguous_offsets().ok_or_else(|| err("input is not contiguous"))?;
    let slice = s.as_cuda_slice::<E>()?;
    if end > slice.len() {
        return Err(err(format!("{} elements at {start} exceed the storage", end - start)));
    }
    Ok(slice.slice(start..end))
}

/// An output of `len` elements on `dev`, left for its kernel to write whole.
pub(crate) fn output<E: CudaDType + candle_core::cuda_backend::cudarc::driver::DeviceRepr>(
    dev: &CudaDevice,
    len: usize,
) -> Result<CudaSlice<E>> {
    // SAFETY: every caller launches a kernel that writes all `len` elements before the slice is
    // read (the launch is on the same stream as any later read).
    unsafe { dev.alloc::<E>(len.max(1)) }
}

/// A tensor without a graph from a kernel's output.
pub(crate) fn tensor<E: CudaDType>(slice: CudaSlice<E>, dev: &CudaDevice, shape: impl Into<Shape>) -> Tensor {
    let storage = Storage::Cuda(CudaStorage::wrap_cuda_slice(slice, dev.clone()));
    Tensor::from_storage(storage, shape, BackpropOp::none(), false)
}

/// Runs `f` over the CUDA storages and layouts of `ts`, each made contiguous first (a backward
/// pass's inputs, ids, tables); `what` names the op in the error when one is not on a CUDA device.
pub(crate) fn with_cuda<R>(
    what: &str,
    ts: &[&Tensor],
    f: impl FnOnce(&[(&CudaStorage, &Layout)]) -> Result<R>,
) -> Result<R> {
    let owned = ts.iter().map(|t| t.contiguous()).collect::<Result<Vec<_>>>()?;
    let guards = owned.iter().map(|t| t.storage_and_layout()).collect::<Vec<_>>();
    let mut pairs = Vec::with_capacity(guards.len());
    for (s, l) in &guards {
        match &**s {
            Storage::Cuda(c) => pairs.push((c, *l)),
            _ => return Err(err(format!("{what}: tensor is not on a CUDA device"))),
        }
    }
    f(&pairs)
}

/// Runs `$body` with `$e` the storage type of `$dtype` (f32, f16, bf16, f64).
macro_rules! by_cuda_elem {
    ($dtype:expr, $e:ident => $body:expr) => {
        match $dtype {
            candle_core::DType::F32 => {
                type $e = f32;
                $body
            }
            candle_core::DType::F16 => {
                type $e = half::f16;
                $body
            }
            candle_core::DType::BF16 => {
                type $e = half::bf16;
                $body
            }
            candle_core::DType::F64 => {
                type $e = f64;
                $body
            }
            other => Err($crate::native::cuda::err(format!("no kernel takes {other:?} tensors"))),
        }
    };
}
pub(crate) use by_cuda_elem;
