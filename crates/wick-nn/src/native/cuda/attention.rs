//! The CUDA body of scaled dot-product attention (`kernels/src/cuda/nn_attention.cu`), in the
//! manner of FlashAttention-2: tiles of q, k, v and dO in shared memory, forward in one launch
//! keeping the output and one log-sum-exp per query row on the device (never an s × s tensor);
//! backward in two launches (dq with each row's `dO·o`, then dk and dv), each result row summed
//! by one thread in a fixed order. A bias's row ends (the host body's rule: the keys after a
//! row's last one above the masked bound take no part) are found once, when the op is made, and
//! a tile of keys after every end of a block's rows is never loaded: a causal mask costs half the
//! work. Operands are addressed by the host op's layouts, so the packed (B, S, 3·H·D) form needs no
//! split copies.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{CudaSlice, DevicePtrMut, DeviceRepr, PushKernelArg};
use candle_core::cuda_backend::CudaStorage;
use candle_core::{DType, Layout, Result, Storage, Tensor, WithDType};

pub use super::attention_plan::set_tensor_cores;
use super::attention_plan::Plan;
use super::{by_cuda_elem, err, function, output, tensor, view, warp_per_row, with_cuda};
use wick_kernels::launch::AttentionKernel;

/// The largest head dimension the kernels take (32 lanes × 4 elements).
pub const MAX_HEAD_DIM: usize = 128;

/// Where an operand's rows lie, in elements: row `i` of head (b, h) starts at
/// `base + b·batch + h·head + i·row` (the kernels' `Lay`).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub(crate) struct Lay {
    base: i64,
    batch: i64,
    head: i64,
    row: i64,
}

impl Lay {
    pub(crate) fn new([base, batch, head, row]: [usize; 4]) -> Self {
        Lay { base: base as i64, batch: batch as i64, head: head as i64, row: row as i64 }
    }
}

#[repr(C)]
#[derive(Clone, Copy)]
struct Dims {
    b: i64,
    h: i64,
    sq: i64,
    sk: i64,
    d: i64,
}

/// The bias's strides over (B, H, Sq, Sk) and its row ends' over (B, H) (the query row's is 1).
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct BiasStrides {
    b: i64,
    h: i64,
    q: i64,
    k: i64,
    eb: i64,
    eh: i64,
}

// SAFETY: plain `repr(C)` structs of 64-bit integers, passed by value as the kernels declare them.
unsafe impl DeviceRepr for Lay {}
// SAFETY: as for `Lay`.
unsafe impl DeviceRepr for Dims {}
// SAFETY: as for `Lay`.
unsafe impl DeviceRepr for BiasStrides {}

/// An additive bias on the device: the compute type's values broadcast to (B, H, Sq, Sk) by
/// strides (0 along broadcast axes), never expanded, and the end of each of its distinct rows
/// (one per batch and head it varies over, and query row).
pub(crate) struct DeviceBias {
    values: Tensor,
    strides: BiasStrides,
    ends: CudaSlice<i32>,
}

impl DeviceBias {
    /// `bias` for attention of `dims` (B, H, Sq, Sk) over `input` (its device and dtype); finds
    /// its row ends on the device.
    pub(crate) fn new(bias: &Tensor, dims: [usize; 4], input: &Tensor) -> Result<Self> {
        let compute = super::compute(input.dtype());
        let values = bias.to_device(input.device())?.to_dtype(compute)?.broadcast_as(dims.to_vec())?;
        let [b, h, sq, sk] = dims;
        if i32::try_from(sk).is_err() {
            return Err(err(format!("attention: {sk} keys (the row ends are 32-bit)")));
        }
        let s = values.stride();
        let (nb, nh) = (if s[0] == 0 { 1 } else { b }, if s[1] == 0 { 1 } else { h });
        let strides = BiasStrides {
            b: s[0] as i64,
            h: s[1] as i64,
            q: s[2] as i64,
            k: s[3] as i64,
            eb: if nb == 1 { 0 } else { (nh * sq) as i64 },
            eh: if nh == 1 { 0 } else { sq as i64 },
        };
        let rows = nb * nh * sq;
        let (storage, layout) = values.storage_and_layout();
        let Storage::Cuda(cs) = &*storage else { return Err(err("attention: the bias is not on a CUDA device")) };
        let dev = cs.device();
        let n = Dims { b: b as i64, h: h as i64, sq: sq as i64, sk: sk as i64, d: 0 };
        let mut ends = output::<i32>(dev, rows)?;
        let (nb, nh) = (nb as i64, nh as i64);
        let stream = dev.cuda_stream();
        macro_rules! go {
            ($t:ty, $name:literal) => {{
                let f = function(dev, "nn_attention", $name)?;
                let slice = cs.as_cuda_slice::<$t>()?;
                let values = slice.slice(layout.start_offset()..);
                let mut launch = stream.launch_builder(&f);
                launch.arg(&values).arg(&mut ends).arg(&n).arg(&strides).arg(&nb).arg(&nh);
                let config = warp_per_row(rows);
                // SAFETY: (bias: the compute type, every address its strides name over `dims` in
                // the storage — `broadcast_as` checked the shape; ends: i32, `rows` of them; the
                // dims, strides and distinct batches and heads by value), the kernel's parameters.
                unsafe { launch.launch(config) }.map_err(|e| err(format!("attention row ends: {e}")))?;
            }};
        }
        if compute == DType::F64 {
            go!(f64, "wick_attention_ends_f64")
        } else {
            go!(f32, "wick_attention_ends_f32")
        }
        drop(storage);
        Ok(DeviceBias { values, strides, ends })
    }
}

/// (B, H, Sq, Sk, D) and each operand's layout: q, k, v, the output.
pub(crate) struct Geometry {
    pub(crate) dims: (usize, usize, usize, usize, usize),
    pub(crate) lays: [Lay; 4],
}

impl Geometry {
    fn dims(&self) -> Result<Dims> {
        let (b, h, sq, sk, d) = self.dims;
        if d == 0 || d > MAX_HEAD_DIM {
            return Err(err(format!("attention: head dimension {d} (the kernels take 1 to {MAX_HEAD_DIM})")));
        }
        Ok(Dims { b: b as i64, h: h as i64, sq: sq as i64, sk: sk as i64, d: d as i64 })
    }

    /// Batches × heads.
    fn heads(&self) -> usize {
        self.dims.0 * self.dims.1
    }

    /// Query rows over every head (one log-sum-exp each).
    fn rows(&self) -> usize {
        let (b, h, sq, _, _) = self.dims;
        b * h * sq
    }
}

/// The bias's strides (zeros without one: the kernels then read none).
fn bias_strides(bias: Option<&DeviceBias>) -> BiasStrides {
    bias.map_or(BiasStrides::default(), |b| b.strides)
}

/// Runs `f` with the bias's view and its row ends (or two null pointers) in compute type `T`.
macro_rules! with_bias {
    ($bias:expr, $t:ty, |$arg:ident, $ends:ident| $body:expr) => {{
        match $bias {
            Some(b) => {
                let (s, l) = b.values.storage_and_layout();
                let Storage::Cuda(s) = &*s else { return Err(err("attention: the bias is not on a CUDA device")) };
                let slice = s.as_cuda_slice::<$t>()?;
                let view = slice.slice(l.start_offset()..);
                let $arg = &view;
                let $ends = &b.ends;
                $body
            }
            None => {
                let null = 0u64;
                let ($arg, $ends) = (&null, &null);
                $body
            }
        }
    }};
}

/// Forward: q, k, v (the same storage thrice for the packed form) into an output of `out_len`
/// elements laid out as `geometry.lays[3]`, and each query row's log-sum-exp.
pub(crate) fn forward(
    [q, k, v]: [(&CudaStorage, &Layout); 3],
    geometry: &Geometry,
    out_len: usize,
    bias: Option<&DeviceBias>,
) -> Result<(CudaStorage, CudaSlice<f64>)> {
    let dev = q.0.device();
    let n = geometry.dims()?;
    let [lq, lk, lv, lo] = geometry.lays;
    let bs = bias_strides(bias);
    let rows = geometry.rows();
    by_cuda_elem!(q.0.dtype(), E => {
        let (qv, kv, vv) = (view::<E>(q.0, q.1)?, view::<E>(k.0, k.1)?, view::<E>(v.0, v.1)?);
        let plan = Plan::new(dev, E::DTYPE, geometry.dims.4)?;
        let f = plan.function(dev, AttentionKernel::Forward)?;
        let config = plan.launch(&f, AttentionKernel::Forward, geometry.heads(), geometry.dims.2)?;
        let mut out = output::<E>(dev, out_len)?;
        let mut lse = output::<f64>(dev, rows)?;
        let stream = dev.cuda_stream();
        macro_rules! go {
            ($t:ty) => {
                with_bias!(bias, $t, |b, ends| {
                    let mut launch = stream.launch_builder(&f);
                    launch.arg(&qv).arg(&kv).arg(&vv).arg(b).arg(ends).arg(&mut out).arg(&mut lse);
                    launch.arg(&lq).arg(&lk).arg(&lv).arg(&lo).arg(&n).arg(&bs);
                    // SAFETY: (q, k, v: E; bias: the compute type or null; ends: i32, one a
                    // distinct bias row, or null; out: E, `out_len`; lse: f64, one a query row; the
                    // four layouts, the dims, the bias strides by value), the kernel's parameters in
                    // order; every address the layouts name lies in its operand (the host op checked
                    // the shapes); the shared memory is what the kernel's tiles take.
                    unsafe { launch.launch(config) }.map_err(|e| err(format!("attention: {e}")))?;
                })
            };
        }
        if E::DTYPE == DType::F64 {
            go!(f64)
        } else {
            go!(f32)
        }
        Ok((CudaStorage::wrap_cuda_slice(out, dev.clone()), lse))
    })
}

/// Backward: the gradients of q, k and v, laid out as `grads` (the same layouts as the inputs':
/// three tensors shaped like q, k and v, or — `packed` — one shaped like the packed input), from
/// the inputs, the forward output `out`, its gradient `g` and forward's log-sum-exps.
#[allow(clippy::too_many_arguments)]
pub(crate) fn backward(
    [q, k, v]: [&Tensor; 3],
    out: &Tensor,
    g: &Tensor,
    lse: &CudaSlice<f64>,
    geometry: &Geometry,
    bias: Option<&DeviceBias>,
    packed: bool,
) -> Result<Vec<Tensor>> {
    let n = geometry.dims()?;
    let [lq, lk, lv, lo] = geometry.lays;
    let bs = bias_strides(bias);
    let rows_q = geometry.rows();
    if lse.len() != rows_q {
        return Err(err("attention backward: no forward statistics for these inputs"));
    }
    if g.shape() != out.shape() || g.dtype() != out.dtype() {
        return Err(err(format!("attention backward: gradient {:?} for output {:?}", g.shape(), out.shape())));
    }
    with_cuda("attention backward", &[q, k, v, out, g], |cs| {
        let dev = cs[0].0.device();
        let stream = dev.cuda_stream();
        by_cuda_elem!(q.dtype(), E => {
            let views = cs.iter().map(|(s, l)| view::<E>(s, l)).collect::<Result<Vec<_>>>()?;
            let (qv, kv, vv, ov, gv) = (&views[0], &views[1], &views[2], &views[3], &views[4]);
            let mut dsum = output::<f64>(dev, rows_q)?;
            // One buffer for the packed form (its three parts interleave row by row), three apart.
            let mut buffers = if packed {
                vec![output::<E>(dev, q.elem_count())?]
            } else {
                vec![output::<E>(dev, q.elem_count())?, output::<E>(dev, k.elem_count())?, output::<E>(dev, v.elem_count())?]
            };
            {
                let mut ptrs = Vec::with_capacity(3);
                let mut syncs = Vec::with_capacity(3);
                for b in buffers.iter_mut() {
                    let (p, sync) = b.device_ptr_mut(&stream);
                    ptrs.push(p);
                    syncs.push(sync);
                }
                let (pdq, pdk, pdv) = if packed { (ptrs[0], ptrs[0], ptrs[0]) } else { (ptrs[0], ptrs[1], ptrs[2]) };
                let (ldq, ldk, ldv) = (lq, lk, lv);
                let plan = Plan::new(dev, E::DTYPE, geometry.dims.4)?;
                let (fdq, fdkdv) = (plan.function(dev, AttentionKernel::Dq)?, plan.function(dev, AttentionKernel::DkDv)?);
                let cdq = plan.launch(&fdq, AttentionKernel::Dq, geometry.heads(), geometry.dims.2)?;
                let cdkdv = plan.launch(&fdkdv, AttentionKernel::DkDv, geometry.heads(), geometry.dims.3)?;
                macro_rules! go {
                    ($t:ty) => {
                        with_bias!(bias, $t, |b, ends| {
                            let mut launch = stream.launch_builder(&fdq);
                            launch.arg(qv).arg(kv).arg(vv).arg(b).arg(ends).arg(ov).arg(gv).arg(lse).arg(&mut dsum).arg(&pdq);
                            launch.arg(&lq).arg(&lk).arg(&lv).arg(&lo).arg(&ldq).arg(&n).arg(&bs);
                            // SAFETY: (q, k, v: E; bias: compute type or null; ends: i32 or null;
                            // out, dout: E; lse: f64; dsum: f64, one a query row; dq: a device address
                            // of E with room for every row `ldq` names; layouts, dims, strides by
                            // value), in order; the shared memory is what the kernel's tiles take.
                            unsafe { launch.launch(cdq) }.map_err(|e| err(format!("attention backward: {e}")))?;
                            let mut launch = stream.launch_builder(&fdkdv);
                            launch.arg(qv).arg(kv).arg(vv).arg(b).arg(ends).arg(gv).arg(lse).arg(&dsum).arg(&pdk).arg(&pdv);
                            launch.arg(&lq).arg(&lk).arg(&lv).arg(&lo).arg(&ldk).arg(&ldv).arg(&n).arg(&bs);
                            // SAFETY: as above, dk and dv addresses with room for every row their
                            // layouts name; ordered after the dq kernel (one stream), which wrote dsum.
                            unsafe { launch.launch(cdkdv) }.map_err(|e| err(format!("attention backward: {e}")))?;
                        })
                    };
                }
                if E::DTYPE == DType::F64 {
                    go!(f64)
                } else {
                    go!(f32)
                }
                drop(syncs);
            }
            let shapes = if packed { vec![q.shape().clone()] } else { vec![q.shape().clone(), k.shape().clone(), v.shape().clone()] };
            Ok(buffers.into_iter().zip(shapes).map(|(b, s)| tensor(b, dev, s)).collect())
        })
    })
}
