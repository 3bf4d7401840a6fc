//! The CUDA bodies of cross-entropy, embedding lookups and the broadcast sum of embeddings
//! (`kernels/src/cuda/nn_rows.cu`).
//!
//! Cross-entropy keeps one log-sum-exp per row on the device and no probability tensor; its
//! targets stay on the device (no copy to the host, so no synchronisation), and a target outside
//! the vocabulary gives a NaN loss instead of a read past its row. The embedding's ids are
//! checked on the host (the host op copies them there already), which also orders each table
//! row's gradient sum by position: the same bits as the host body, on every run.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{CudaSlice, DeviceRepr, LaunchConfig, PushKernelArg, ValidAsZeroBits};
use candle_core::cuda_backend::{CudaDType, CudaStorage};
use candle_core::{DType, Layout, Result, Shape, Tensor, WithDType};

use super::{by_cuda_elem, elementwise, err, function, output, per_row, suffix, tensor, view, with_cuda, THREADS};

const MODULE: &str = "nn_rows";

/// Integer ids or targets as a contiguous u32 tensor on `device` (where the table or the logits are).
pub(crate) fn ids_on_device(t: &Tensor, device: &candle_core::Device) -> Result<Tensor> {
    t.to_device(device)?.to_dtype(DType::U32)?.flatten_all()?.contiguous()
}

/// Cross-entropy's forward pass on logits (n, c): the mean loss (one element of the compute
/// type: f32, or f64 for f64 logits) and each row's log-sum-exp.
pub(crate) fn cross_entropy(
    (s, l): (&CudaStorage, &Layout),
    targets: &Tensor,
) -> Result<(CudaStorage, CudaSlice<f64>)> {
    let &[n, c] = l.shape().dims() else { return Err(err(format!("cross_entropy: logits {:?}", l.shape()))) };
    if targets.elem_count() != n {
        return Err(err(format!("cross_entropy: {} targets for {n} rows", targets.elem_count())));
    }
    let dev = s.device();
    with_cuda("cross_entropy", &[targets], |t| {
        let (ts, tl) = t[0];
        let tv = view::<u32>(ts, tl)?;
        let stream = dev.cuda_stream();
        let (mut lse, mut loss) = (output::<f64>(dev, n)?, output::<f64>(dev, n)?);
        let (nn, cc) = (n as i64, c as i64);
        by_cuda_elem!(s.dtype(), E => {
            let x = view::<E>(s, l)?;
            let f = function(dev, MODULE, &format!("wick_cross_entropy_rows_{}", suffix(E::DTYPE)?))?;
            let mut launch = stream.launch_builder(&f);
            launch.arg(&x).arg(&tv).arg(&mut lse).arg(&mut loss).arg(&nn).arg(&cc);
            // SAFETY: (x: n × c of E; targets: n u32; lse, loss: n f64; n, c), in order.
            unsafe { launch.launch(per_row(n)) }.map_err(|e| err(format!("cross_entropy: {e}")))?;
            Ok(())
        })?;
        let one = LaunchConfig { grid_dim: (1, 1, 1), block_dim: (THREADS, 1, 1), shared_mem_bytes: 0 };
        // The mean in the loss's dtype (f32, or f64 for f64 logits), summed by one block in order.
        macro_rules! mean {
            ($t:ty, $name:literal) => {{
                let mut out = output::<$t>(dev, 1)?;
                let f = function(dev, MODULE, $name)?;
                let mut launch = stream.launch_builder(&f);
                launch.arg(&loss).arg(&mut out).arg(&nn);
                // SAFETY: (loss: n f64; out: one element of the loss's type; n).
                unsafe { launch.launch(one) }.map_err(|e| err(format!("cross_entropy: {e}")))?;
                CudaStorage::wrap_cuda_slice(out, dev.clone())
            }};
        }
        let out = if s.dtype() == DType::F64 { mean!(f64, "wick_mean_f64") } else { mean!(f32, "wick_mean_f32") };
        Ok((out, lse))
    })
}

/// Cross-entropy's input gradient for the loss gradient `g` (one element).
pub(crate) fn cross_entropy_grad(x: &Tensor, targets: &Tensor, lse: &CudaSlice<f64>, g: &Tensor) -> Result<Tensor> {
    let (n, c) = x.dims2()?;
    if lse.len() != n || targets.elem_count() != n || g.elem_count() != 1 {
        return Err(err("cross_entropy backward: no forward statistics for these logits"));
    }
    let compute = if x.dtype() == DType::F64 { DType::F64 } else { DType::F32 };
    let g = g.to_dtype(compute)?;
    with_cuda("cross_entropy backward", &[x, &g, targets], |p| {
        let [(xs, xl), (gs, gl), (ts, tl)] = [p[0], p[1], p[2]];
        let dev = xs.device();
        let stream = dev.cuda_stream();
        let tv = view::<u32>(ts, tl)?;
        let (nn, cc) = (n as i64, c as i64);
        by_cuda_elem!(x.dtype(), E => {
                let xv = view::<E>(xs, xl)?;
                let f = function(dev, MODULE, &format!("wick_cross_entropy_grad_{}", suffix(E::DTYPE)?))?;
                let mut dx = output::<E>(dev, n * c)?;
                macro_rules! go {
                    ($t:ty) => {{
                        let gv = view::<$t>(gs, gl)?;
                        let mut launch = stream.launch_builder(&f);
                        launch.arg(&xv).arg(&tv).arg(lse).arg(&gv).arg(&mut dx).arg(&nn).arg(&cc);
                        // SAFETY: (x: n × c of E; targets: n u32; lse: n f64; g: one of the compute type;
                        // dx: n × c of E; n, c), in order.
                        unsafe { launch.launch(elementwise(n * c)) }.map_err(|e| err(format!("cross_entropy backward: {e}")))?;
                    }};
                }
                if compute == DType::F64 {
                    go!(f64)
                } else {
                    go!(f32)
                }
            Ok(tensor(dx, dev, x.shape()))
        })
    })
}

/// Rows `ids` (a u32 tensor on the device, checked on the host) of a table (v, d).
pub(crate) fn embedding((s, l): (&CudaStorage, &Layout), ids: &Tensor) -> Result<(CudaStorage, Shape)> {
    let &[_, d] = l.shape().dims() else { return Err(err(format!("embedding: table {:?}", l.shape()))) };
    let n = ids.elem_count();
    let dev = s.device();
    let storage = with_cuda("embedding", &[ids], |i| {
        let iv = view::<u32>(i[0].0, i[0].1)?;
        by_cuda_elem!(s.dtype(), E => {
            let table = view::<E>(s, l)?;
            let f = function(dev, MODULE, &format!("wick_embedding_{}", suffix(E::DTYPE)?))?;
            let mut y = output::<E>(dev, n * d)?;
            let (nn, dd) = (n as i64, d as i64);
            let stream = dev.cuda_stream();
            let mut launch = stream.launch_builder(&f);
            launch.arg(&table).arg(&iv).arg(&mut y).arg(&nn).arg(&dd);
            // SAFETY: (table: v × d of E; ids: n u32, each below v (checked by the caller); y: n × d
            // of E; n, d), in order.
            unsafe { launch.launch(elementwise(n * d)) }.map_err(|e| err(format!("embedding: {e}")))?;
            Ok(CudaStorage::wrap_cuda_slice(y, dev.clone()))
        })
    })?;
    Ok((storage, Shape::from((n, d))))
}

/// A zeroed buffer of `len` elements.
fn zeros<E: CudaDType + DeviceRepr + ValidAsZeroBits>(
    dev: &candle_core::cuda_backend::CudaDevice,
    len: usize,
) -> Result<CudaSlice<E>> {
    dev.alloc_zeros::<E>(len.max(1))
}

/// The table's gradient (v, d): row `r` the sum, in position order, of the gradient rows of the
/// positions whose id is `r` (`ids` on the host, the `padding` id left out), every other row zero.
pub(crate) fn embedding_grad(table: &Tensor, ids: &[usize], padding: Option<usize>, g: &Tensor) -> Result<Tensor> {
    let (v, d) = table.dims2()?;
    if g.elem_count() != ids.len() * d {
        return Err(err(format!("embedding backward: {} gradients for {} rows", g.elem_count(), ids.len())));
    }
    // The positions of each id, in order (a stable sort keeps each row's sum in position order).
    let mut order: Vec<usize> = (0..ids.len()).filter(|k| Some(ids[*k]) != padding).collect();
    order.sort_by_key(|k| ids[*k]);
    let (mut start, mut run_id) = (Vec::new(), Vec::new());
    for (i, k) in order.iter().enumerate() {
        if i == 0 || ids[order[i - 1]] != ids[*k] {
            start.push(i as u32);
            run_id.push(ids[*k] as u32);
        }
    }
    let runs = run_id.len();
    start.push(order.len() as u32);
    let order: Vec<u32> = order.into_iter().map(|k| k as u32).collect();
    let device = table.device();
    let upload = |v: Vec<u32>| -> Result<Tensor> {
        let n = v.len();
        Tensor::from_vec(v, n, device)
    };
    let (order, start, run_id) = (upload(order)?, upload(start)?, upload(run_id)?);
    with_cuda("embedding backward", &[g, &order, &start, &run_id], |p| {
        let [(gs, gl), (os, ol), (ss, sl), (rs, rl)] = [p[0], p[1], p[2], p[3]];
        let dev = gs.device();
        let (ov, sv, rv) = (view::<u32>(os, ol)?, view::<u32>(ss, sl)?, view::<u32>(rs, rl)?);
        by_cuda_elem!(table.dtype(), E => {
            let gv = view::<E>(gs, gl)?;
            let mut dt = zeros::<E>(dev, v * d)?;
            if runs > 0 {
                let f = function(dev, MODULE, &format!("wick_embedding_grad_{}", suffix(E::DTYPE)?))?;
                let (r, dd) = (runs as i64, d as i64);
                let stream = dev.cuda_stream();
                let mut launch = stream.launch_builder(&f);
                launch.arg(&gv).arg(&ov).arg(&sv).arg(&rv).arg(&r).arg(&mut dt).arg(&dd);
                // SAFETY: (g: n × d of E; order: the kept positions; start: runs + 1 offsets into
                // order; run_id: runs ids below v; runs; dt: v × d of E; d), in order.
                unsafe { launch.launch(per_row(runs)) }.map_err(|e| err(format!("embedding backward: {e}")))?;
            }
            Ok(tensor(dt, dev, table.shape()))
        })
    })
}

/// `x + a + b` with `a` and `b` repeated over `x`'s elements (contiguous, one dtype; their element
/// counts divide x's, checked by the caller), summed in the compute type and rounded once.
pub(crate) fn add_broadcast(
    (sx, lx): (&CudaStorage, &Layout),
    (sa, la): (&CudaStorage, &Layout),
    (sb, lb): (&CudaStorage, &Layout),
) -> Result<CudaStorage> {
    if sa.dtype() != sx.dtype() || sb.dtype() != sx.dtype() {
        return Err(err(format!("add_broadcast: {:?}, {:?} and {:?}", sx.dtype(), sa.dtype(), sb.dtype())));
    }
    let (n, na, nb) = (lx.shape().elem_count(), la.shape().elem_count(), lb.shape().elem_count());
    if na == 0 || nb == 0 || !n.is_multiple_of(na) || !n.is_multiple_of(nb) {
        return Err(err(format!("add_broadcast: {n} elements with {na} and {nb}")));
    }
    let dev = sx.device();
    by_cuda_elem!(sx.dtype(), E => {
        let (x, a, b) = (view::<E>(sx, lx)?, view::<E>(sa, la)?, view::<E>(sb, lb)?);
        let f = function(dev, MODULE, &format!("wick_add_broadcast_{}", suffix(E::DTYPE)?))?;
        let mut y = output::<E>(dev, n)?;
        let (n64, na64, nb64) = (n as i64, na as i64, nb as i64);
        let stream = dev.cuda_stream();
        let mut launch = stream.launch_builder(&f);
        launch.arg(&x).arg(&a).arg(&b).arg(&mut y).arg(&n64).arg(&na64).arg(&nb64);
        // SAFETY: (x: n of E; a: na of E; b: nb of E; y: n of E; n, na, nb), in order; na and nb
        // are non-zero.
        unsafe { launch.launch(elementwise(n)) }.map_err(|e| err(format!("add_broadcast: {e}")))?;
        Ok(CudaStorage::wrap_cuda_slice(y, dev.clone()))
    })
}

/// The gradients of `a` (`na` elements) and `b` (`nb`) from `x + a + b`'s output gradient `g`:
/// column sums of `g` seen as rows of `na` (and of `nb`) elements, in `g`'s compute type (f32, or
/// f64 for f64).
pub(crate) fn add_broadcast_grads(g: &Tensor, na: usize, nb: usize) -> Result<(Tensor, Tensor)> {
    let n = g.elem_count();
    if na == 0 || nb == 0 || !n.is_multiple_of(na) || !n.is_multiple_of(nb) {
        return Err(err(format!("add_broadcast backward: {n} gradients for {na} and {nb}")));
    }
    let t = super::compute(g.dtype());
    with_cuda("add_broadcast backward", &[g], |p| {
        let (gs, gl) = p[0];
        let dev = gs.device();
        by_cuda_elem!(g.dtype(), E => {
            let gv = view::<E>(gs, gl)?;
            let da = super::linear::column_sums(dev, &gv, n / na, na, t)?;
            let db = super::linear::column_sums(dev, &gv, n / nb, nb, t)?;
            Ok((da, db))
        })
    })
}
