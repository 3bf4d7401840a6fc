//! The CUDA body of rotary position embeddings (`kernels/src/cuda/nn_rows.cu`): one launch each
//! way, the tables kept on the device in the compute type.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::PushKernelArg;
use candle_core::cuda_backend::CudaStorage;
use candle_core::{DType, Layout, Result, Storage, Tensor, WithDType};

use super::{by_cuda_elem, elementwise, err, function, output, suffix, view, with_cuda};

/// The cos and sin tables (seq × head_dim/2) on the input's device, in its compute type.
pub(crate) struct Tables {
    cos: Tensor,
    sin: Tensor,
}

impl Tables {
    pub(crate) fn new(cos: &Tensor, sin: &Tensor, input: &Tensor) -> Result<Self> {
        let compute = if input.dtype() == DType::F64 { DType::F64 } else { DType::F32 };
        let on = |t: &Tensor| t.to_device(input.device())?.to_dtype(compute)?.contiguous();
        Ok(Tables { cos: on(cos)?, sin: on(sin)? })
    }

    pub(crate) fn len(&self) -> usize {
        self.cos.elem_count()
    }
}

/// Rotates the first `rotated` heads (of `d` elements) of each `width`-long row of `x` (position
/// `row % seq`) by the tables, `sign` −1 by their inverse; the rest of each row is copied.
pub(crate) fn rotate(
    (s, l): (&CudaStorage, &Layout),
    tables: &Tables,
    (d, seq, width, rotated): (usize, usize, usize, usize),
    sign: f64,
) -> Result<CudaStorage> {
    let dev = s.device();
    if tables.len() != seq * (d / 2) {
        return Err(err(format!("rope: tables of {} values for {seq} positions of {d}", tables.len())));
    }
    with_cuda("rope", &[&tables.cos, &tables.sin], |t| {
        let [(cs, lc), (ss, ls)] = [t[0], t[1]];
        by_cuda_elem!(s.dtype(), E => {
            let x = view::<E>(s, l)?;
            let rows = x.len() / width.max(1);
            let f = function(dev, "nn_rows", &format!("wick_rope_{}", suffix(E::DTYPE)?))?;
            let mut y = output::<E>(dev, x.len())?;
            let (r, q, w, dd, rot) = (rows as i64, seq as i64, width as i64, d as i64, rotated as i64);
            let stream = dev.cuda_stream();
            macro_rules! go {
                ($t:ty) => {{
                    let (c, sn) = (view::<$t>(cs, lc)?, view::<$t>(ss, ls)?);
                    let mut launch = stream.launch_builder(&f);
                    launch.arg(&x).arg(&mut y).arg(&c).arg(&sn).arg(&r).arg(&q).arg(&w).arg(&dd).arg(&rot).arg(&sign);
                    // SAFETY: (x, y: rows × width of E; cos, sin: seq × d/2 of the compute type; rows,
                    // seq, width, d, rotated; sign), the kernel's parameters in order.
                    unsafe { launch.launch(elementwise(x.len())) }.map_err(|e| err(format!("rope: {e}")))?;
                }};
            }
            if E::DTYPE == DType::F64 {
                go!(f64)
            } else {
                go!(f32)
            }
            Ok(CudaStorage::wrap_cuda_slice(y, dev.clone()))
        })
    })
}

/// [`rotate`] of a tensor (the backward pass: the output gradient by the inverse angles).
pub(crate) fn rotate_tensor(
    g: &Tensor,
    tables: &Tables,
    geometry: (usize, usize, usize, usize),
    sign: f64,
) -> Result<Tensor> {
    let y = with_cuda("rope backward", &[g], |p| rotate(p[0], tables, geometry, sign))?;
    Ok(Tensor::from_storage(Storage::Cuda(y), g.shape().clone(), candle_core::op::BackpropOp::none(), false))
}
