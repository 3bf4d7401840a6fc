//! Cross-entropy, embedding lookups and broadcast additions with closed-form backward passes,
//! every gradient sum accumulated in f32 (f64 for f64). With the `cuda` feature, cross-entropy and
//! the embedding have CUDA bodies too (`crate::native::cuda::loss`).

use std::sync::Mutex;

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp1, CustomOp3, DType, Layout, Result, Shape, Tensor};

use super::elem::{by_elem, elem_tensor, elems, into_plane, widened, with_elems, Elem};
use super::{par_ranges, read, tensor, with, Real, SharedMut};

fn err(msg: String) -> candle_core::Error {
    candle_core::Error::Msg(msg)
}

/// Integer ids of a CPU tensor as `usize`.
fn ids(t: &Tensor) -> Result<Vec<usize>> {
    Ok(t.to_dtype(DType::U32)?.flatten_all()?.to_vec1::<u32>()?.into_iter().map(|v| v as usize).collect())
}

/// Mean cross-entropy of logits (N, C) against integer targets, with each row's log-sum-exp kept.
struct CrossEntropy {
    targets: Vec<usize>,
    lse: Mutex<Vec<f64>>,
    /// The CUDA body's targets (u32, on the device; the host's are then empty) and log-sum-exps.
    #[cfg(feature = "cuda")]
    device: Option<(Tensor, Mutex<Option<candle_core::cuda_backend::cudarc::driver::CudaSlice<f64>>>)>,
}

impl CrossEntropy {
    fn fwd<T: Real, E: Elem<T>>(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let &[n, c] = l.shape().dims() else { return Err(err(format!("cross_entropy: logits {:?}", l.shape()))) };
        if self.targets.len() != n || self.targets.iter().any(|t| *t >= c) {
            return Err(err(format!("cross_entropy: {} targets in 0..{c} for {n} rows", self.targets.len())));
        }
        let x = elems::<T, E>(s, l)?;
        let lse = row_log_sum_exps::<T, E>(x, c, n);
        // Added in row order whatever the threads: the same loss on any machine.
        let total: f64 =
            lse.iter().zip(&self.targets).enumerate().map(|(i, (l, t))| l - T::wide(x[i * c + t].load())).sum();
        *self.lse.lock().unwrap_or_else(|p| p.into_inner()) = lse;
        // The loss is f32-class: f32 for f32/bf16/f16 logits, f64 for f64.
        let dtype = if super::is_f64(s.dtype()) { DType::F64 } else { DType::F32 };
        Ok((T::storage(vec![T::of(total / n.max(1) as f64)], dtype)?, Shape::from(())))
    }

    fn bwd<T: Real, E: Elem<T>>(&self, x: &Tensor, g: &Tensor) -> Result<Tensor> {
        let (n, c) = x.dims2()?;
        let lse = self.lse.lock().unwrap_or_else(|p| p.into_inner()).clone();
        if lse.len() != n || self.targets.len() != n {
            return Err(err("cross_entropy backward: no forward statistics for these logits".into()));
        }
        let scale = T::wide(with::<T, _>(g, |g| {
            g.first().copied().ok_or_else(|| err("cross_entropy: empty gradient".into()))
        })?) / n.max(1) as f64;
        let dx = with_elems::<T, E, _>(x, |x| Ok(probability_rows::<T, E>(x, c, &lse, &self.targets, scale)))?;
        elem_tensor::<T, E>(dx, x.shape())
    }
}

wide_kernel! {
    /// Each `c`-long row's log-sum-exp of `x` (`n` rows), rows in parallel, a bf16 row widened
    /// into a thread's scratch (never the whole tensor at once).
    fn row_log_sum_exps<T, E>(x: &[E], c: usize, n: usize) -> Vec<f64> {
        let mut lse = vec![0.0; n];
        let out = SharedMut::new(&mut lse);
        par_ranges(n, 1, |r| {
            let mut scratch = Vec::new();
            // SAFETY: each range's rows are written by this call only.
            let dst = unsafe { out.range(r.start, r.len()) };
            for (l, i) in dst.iter_mut().zip(r) {
                *l = log_sum_exp::<T>(widened::<T, E>(&x[i * c..(i + 1) * c], &mut scratch));
            }
        });
        lse
    }
}

/// A row's log-sum-exp: f32 on the vector kernel ([`wick_kernels::cpu::cross_entropy`]: f32
/// exponentials summed in f64 per block), f64 with the library's `exp`.
fn log_sum_exp<T: Real>(row: &[T]) -> f64 {
    if let Some(row) = T::as_f32(row) {
        return wick_kernels::cpu::cross_entropy::log_sum_exp_f32(row);
    }
    let max = row.iter().fold(f64::NEG_INFINITY, |m, v| m.max(T::wide(*v)));
    max + row.iter().map(|v| (T::wide(*v) - max).exp()).sum::<f64>().ln()
}

wide_kernel! {
    /// The logits' gradient, `(p − onehot)·scale` a row, rows in parallel: each row's
    /// probabilities from its log-sum-exp, the target's `p − 1` from its score again in f64; a
    /// bf16 row widened and its gradient rounded through a thread's scratch.
    fn probability_rows<T, E>(x: &[E], c: usize, lse: &[f64], targets: &[usize], scale: f64) -> Vec<E> {
        let n = lse.len();
        let mut dx = vec![E::store(T::zero()); n * c];
        let out = SharedMut::new(&mut dx);
        par_ranges(n, 1, |r| {
            let (mut wide, mut plane) = (Vec::new(), Vec::new());
            for i in r {
                // SAFETY: one row per index.
                let dst = unsafe { out.range(i * c, c) };
                let row = widened::<T, E>(&x[i * c..(i + 1) * c], &mut wide);
                let (t, l) = (targets[i], lse[i]);
                into_plane::<T, E>(dst, &mut plane, |p| {
                    probabilities_scaled::<T>(row, p, l, scale);
                    p[t] = T::of(((T::wide(row[t]) - l).exp() - 1.0) * scale);
                });
            }
        });
        dx
    }
}

/// `dst = exp(row − lse)·scale`, a row's probabilities times the loss's gradient over the rows:
/// f32 on the vector kernel, f64 with the library's `exp`.
fn probabilities_scaled<T: Real>(row: &[T], dst: &mut [T], lse: f64, scale: f64) {
    if let (Some(row), Some(dst)) = (T::as_f32(row), T::as_f32_mut(dst)) {
        return wick_kernels::cpu::cross_entropy::exp_shifted_scaled_f32(row, dst, lse as f32, scale as f32);
    }
    for (d, v) in dst.iter_mut().zip(row) {
        *d = T::of((T::wide(*v) - lse).exp() * scale);
    }
}

impl CustomOp1 for CrossEntropy {
    fn name(&self) -> &'static str {
        "cross_entropy"
    }
    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        by_elem!(s.dtype(), T, E => self.fwd::<T, E>(s, l))
    }
    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s: &candle_core::CudaStorage, l: &Layout) -> Result<(candle_core::CudaStorage, Shape)> {
        let (targets, lse) =
            self.device.as_ref().ok_or_else(|| err("cross_entropy: no targets on the device".into()))?;
        let (loss, rows) = crate::native::cuda::loss::cross_entropy((s, l), targets)?;
        *lse.lock().unwrap_or_else(|p| p.into_inner()) = Some(rows);
        Ok((loss, Shape::from(())))
    }
    fn bwd(&self, x: &Tensor, _res: &Tensor, g: &Tensor) -> Result<Option<Tensor>> {
        #[cfg(feature = "cuda")]
        if let (Some((targets, lse)), true) = (&self.device, x.device().is_cuda()) {
            let guard = lse.lock().unwrap_or_else(|p| p.into_inner());
            let lse = guard.as_ref().ok_or_else(|| err("cross_entropy backward: no forward statistics".into()))?;
            return crate::native::cuda::loss::cross_entropy_grad(x, targets, lse, g).map(Some);
        }
        by_elem!(x.dtype(), T, E => self.bwd::<T, E>(x, g).map(Some))
    }
}

/// Mean cross-entropy of `logits` (N, C) against integer `targets` (N) on the CPU (see
/// [`crate::ops::cross_entropy`]): f32 (f64 for f64 logits) whatever the logits' dtype.
pub fn cross_entropy(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if logits.device().is_cuda() {
        let device = Some((crate::native::cuda::loss::ids_on_device(targets, logits.device())?, Mutex::new(None)));
        let op = CrossEntropy { targets: Vec::new(), lse: Mutex::new(Vec::new()), device };
        return super::apply1(&logits.contiguous()?, op);
    }
    let op = CrossEntropy {
        targets: ids(targets)?,
        lse: Mutex::new(Vec::new()),
        #[cfg(feature = "cuda")]
        device: None,
    };
    super::apply1(&logits.contiguous()?, op)
}

/// Rows of a table (V, D) picked by ids; the gradient of a row sums the gradients of its uses,
/// except the `padding` row's, which gets none.
struct Embedding {
    ids: Vec<usize>,
    padding: Option<usize>,
    /// The CUDA body's ids (u32, on the device), besides the host's copy above.
    #[cfg(feature = "cuda")]
    device_ids: Option<Tensor>,
}

impl Embedding {
    /// The rows, copied as stored (a bf16 table is not widened: the rows are its values).
    fn fwd<T: Real, E: Elem<T>>(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let &[v, d] = l.shape().dims() else { return Err(err(format!("embedding: table {:?}", l.shape()))) };
        if let Some(bad) = self.ids.iter().find(|i| **i >= v) {
            return Err(err(format!("embedding: id {bad} outside a table of {v} rows")));
        }
        let table = elems::<T, E>(s, l)?;
        // Row copies into memory sized once (a `flat_map` collect copied element by element,
        // checking the capacity at each: 3.4 ms a pass of MiniLM at 32 sentences).
        let mut y: Vec<E> = Vec::with_capacity(self.ids.len().saturating_mul(d));
        for i in &self.ids {
            y.extend_from_slice(&table[i * d..(i + 1) * d]);
        }
        Ok((E::into_storage(y), Shape::from((self.ids.len(), d))))
    }

    /// The table's gradient: each used row the f32 sum of its rows of `g` (in their order),
    /// rounded once; every other row zero (written as stored: a bf16 table's gradient is never
    /// a whole f32 table narrowed).
    fn bwd<T: Real, E: Elem<T>>(&self, table: &Tensor, g: &Tensor) -> Result<Tensor> {
        let (v, d) = table.dims2()?;
        let dt = with_elems::<T, E, _>(g, |g| {
            if g.len() != self.ids.len() * d {
                return Err(err(format!("embedding backward: {} gradients for {} rows", g.len(), self.ids.len())));
            }
            let mut dt = vec![E::store(T::zero()); v * d];
            // The positions of each id, in order (a stable sort keeps each row's sum in order).
            let mut order: Vec<usize> = (0..self.ids.len()).filter(|k| Some(self.ids[*k]) != self.padding).collect();
            order.sort_by_key(|k| self.ids[*k]);
            let mut acc = vec![T::zero(); d];
            for run in order.chunk_by(|a, b| self.ids[*a] == self.ids[*b]) {
                acc.fill(T::zero());
                for k in run {
                    acc.iter_mut().zip(&g[k * d..(k + 1) * d]).for_each(|(a, b)| *a = *a + b.load());
                }
                let id = self.ids[run[0]];
                dt[id * d..(id + 1) * d].iter_mut().zip(&acc).for_each(|(o, a)| *o = E::store(*a));
            }
            Ok(dt)
        })?;
        elem_tensor::<T, E>(dt, table.shape())
    }
}

impl CustomOp1 for Embedding {
    fn name(&self) -> &'static str {
        "embedding"
    }
    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        by_elem!(s.dtype(), T, E => self.fwd::<T, E>(s, l))
    }
    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s: &candle_core::CudaStorage, l: &Layout) -> Result<(candle_core::CudaStorage, Shape)> {
        let &[v, _] = l.shape().dims() else { return Err(err(format!("embedding: table {:?}", l.shape()))) };
        if let Some(bad) = self.ids.iter().find(|i| **i >= v) {
            return Err(err(format!("embedding: id {bad} outside a table of {v} rows")));
        }
        let ids = self.device_ids.as_ref().ok_or_else(|| err("embedding: no ids on the device".into()))?;
        crate::native::cuda::loss::embedding((s, l), ids)
    }
    fn bwd(&self, table: &Tensor, _res: &Tensor, g: &Tensor) -> Result<Option<Tensor>> {
        #[cfg(feature = "cuda")]
        if table.device().is_cuda() {
            return crate::native::cuda::loss::embedding_grad(table, &self.ids, self.padding, g).map(Some);
        }
        by_elem!(table.dtype(), T, E => self.bwd::<T, E>(table, g).map(Some))
    }
}

/// Rows `ids` (1-D, integer) of `table` (V, D) on the CPU, the `padding` row getting no gradient
/// (see [`crate::ops::embedding_with_padding`]).
pub fn embedding(table: &Tensor, ids_: &Tensor, padding: Option<u32>) -> Result<Tensor> {
    let op = Embedding {
        ids: ids(ids_)?,
        padding: padding.map(|p| p as usize),
        #[cfg(feature = "cuda")]
        device_ids: if table.device().is_cuda() {
            Some(crate::native::cuda::loss::ids_on_device(ids_, table.device())?)
        } else {
            None
        },
    };
    super::apply1(&table.contiguous()?, op)
}

/// `x + a + b`, `a` and `b` repeated over `x`'s leading elements (each a suffix of `x`'s shape).
struct AddBroadcast;

/// The greatest common divisor (`gcd(n, 0) = n`).
fn gcd(mut a: usize, mut b: usize) -> usize {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

/// Sums `g` (R repeats of `len` elements) into `len` values.
fn fold<T: Real>(g: &[T], len: usize) -> Vec<T> {
    let mut out = vec![T::zero(); len];
    for chunk in g.chunks(len) {
        out.iter_mut().zip(chunk).for_each(|(o, v)| *o = *o + *v);
    }
    out
}

impl AddBroadcast {
    /// `a`'s and `b`'s gradients from a CUDA gradient `g` (column sums on the device), shaped and
    /// typed as `a` and `b`.
    #[cfg(feature = "cuda")]
    fn cuda_grads(a: &Tensor, b: &Tensor, g: &Tensor) -> Result<(Tensor, Tensor)> {
        let (da, db) = crate::native::cuda::loss::add_broadcast_grads(g, a.elem_count(), b.elem_count())?;
        Ok((da.reshape(a.shape())?.to_dtype(a.dtype())?, db.reshape(b.shape())?.to_dtype(b.dtype())?))
    }
    #[cfg(not(feature = "cuda"))]
    fn cuda_grads(_: &Tensor, _: &Tensor, _: &Tensor) -> Result<(Tensor, Tensor)> {
        Err(err("add_broadcast: a CUDA gradient in a build without the `cuda` feature".into()))
    }

    fn fwd<T: Real>(x: &[T], a: &[T], b: &[T]) -> Result<Vec<T>> {
        if a.is_empty() || b.is_empty() || !x.len().is_multiple_of(a.len()) || !x.len().is_multiple_of(b.len()) {
            return Err(err(format!("add_broadcast: {} elements with {} and {}", x.len(), a.len(), b.len())));
        }
        // Runs of g elements (g divides both lengths, so each run lies within one repeat of a
        // and of b): two remainders a run instead of two an element, and loops that vectorise
        // (5.7 ms a pass of MiniLM at 32 sentences before, element by element). The same sums,
        // (x + a) + b.
        let g = gcd(a.len(), b.len());
        let mut y = Vec::with_capacity(x.len());
        for (run, xs) in x.chunks_exact(g).enumerate() {
            let (ia, ib) = (run * g % a.len(), run * g % b.len());
            y.extend(xs.iter().zip(&a[ia..ia + g]).zip(&b[ib..ib + g]).map(|((v, p), q)| *v + *p + *q));
        }
        Ok(y)
    }
}

impl CustomOp3 for AddBroadcast {
    fn name(&self) -> &'static str {
        "add_broadcast"
    }
    fn cpu_fwd(
        &self,
        sx: &CpuStorage,
        lx: &Layout,
        sa: &CpuStorage,
        la: &Layout,
        sb: &CpuStorage,
        lb: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let y = by_real!(sx.dtype(), T => {
            let y = AddBroadcast::fwd(&read::<T>(sx, lx)?, &read::<T>(sa, la)?, &read::<T>(sb, lb)?)?;
            T::storage(y, sx.dtype())?
        });
        Ok((y, lx.shape().clone()))
    }
    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        sx: &candle_core::CudaStorage,
        lx: &Layout,
        sa: &candle_core::CudaStorage,
        la: &Layout,
        sb: &candle_core::CudaStorage,
        lb: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let y = crate::native::cuda::loss::add_broadcast((sx, lx), (sa, la), (sb, lb))?;
        Ok((y, lx.shape().clone()))
    }
    fn bwd(
        &self,
        x: &Tensor,
        a: &Tensor,
        b: &Tensor,
        _res: &Tensor,
        g: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (da, db) = if g.device().is_cuda() {
            Self::cuda_grads(a, b, g)?
        } else {
            by_real!(x.dtype(), T => {
                let (da, db) = with::<T, _>(g, |g| Ok((fold(g, a.elem_count()), fold(g, b.elem_count()))))?;
                (tensor(da, a.shape(), a.dtype())?, tensor(db, b.shape(), b.dtype())?)
            })
        };
        let dx = g.to_dtype(x.dtype())?;
        Ok((x.track_op().then_some(dx), a.track_op().then_some(da), b.track_op().then_some(db)))
    }
}

/// `x + a + b` on the CPU (or, feature `cuda`, a CUDA device) with `a` and `b` broadcast along
/// `x`'s leading dimensions (see [`crate::ops::add_broadcast`]).
pub fn add_broadcast(x: &Tensor, a: &Tensor, b: &Tensor) -> Result<Tensor> {
    let suffix = |t: &Tensor| {
        x.dims().ends_with(t.dims().iter().skip_while(|d| **d == 1).copied().collect::<Vec<_>>().as_slice())
    };
    if !suffix(a) || !suffix(b) {
        return Err(err(format!(
            "add_broadcast: {:?} and {:?} are not suffixes of {:?}",
            a.dims(),
            b.dims(),
            x.dims()
        )));
    }
    // The CUDA kernel takes one dtype (the host body reads each in its compute type).
    let (a, b) =
        if x.device().is_cuda() { (a.to_dtype(x.dtype())?, b.to_dtype(x.dtype())?) } else { (a.clone(), b.clone()) };
    super::apply3(&x.contiguous()?, &a.contiguous()?, &b.contiguous()?, AddBroadcast)
}
