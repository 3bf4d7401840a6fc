//! The multi-tensor launches of [`AmpKernels`]: unscale, clipping's squares, the step's scalars
//! and the optimizer's update over every tensor of a dtype, the tensors passed by value in the
//! kernels' parameters (`wick_kernels::launch::Table`).

use candle_core::cuda_backend::cudarc::driver::{
    CudaFunction, CudaSlice, DevicePtr, DeviceRepr, LaunchConfig, PushKernelArg,
};
use candle_core::{DType, Tensor};
use wick_kernels::launch::{Table, N1, N4, N5};

use super::{address, blocks, check_scalar, dtype_index, err, AmpKernels, StepItem};
use crate::error::TrainError;
use crate::optim::Optimizer;

/// A multi-tensor launch's table (`wick_kernels::launch::Table`, C's `WickTable<K>`) as a kernel
/// argument passed by value.
#[repr(transparent)]
#[derive(Clone, Copy)]
struct Arg<T>(T);

// SAFETY: `Table` is plain data in C's layout — `WickTable<K>`'s two arrays of 8-byte integers
// and an int, padded to 8 bytes on both sides (sizes asserted below and in table.cuh) — with no
// pointers the host follows; `Arg` is transparent over it.
unsafe impl<const P: usize, const N: usize> DeviceRepr for Arg<Table<P, N>> {}

/// One address a tensor (unscale, squares).
type Table1 = Arg<Table<N1, N1>>;
/// SGD's four.
type Table4 = Arg<Table<{ 4 * N4 }, N4>>;
/// AdamW's five.
type Table5 = Arg<Table<{ 5 * N5 }, N5>>;

// The tables' sizes are C's (`table.cuh` asserts the same): K + 1 eight-byte values a tensor, and
// the count padded to eight bytes — within the budget.
const _: () = {
    assert!(std::mem::size_of::<Table1>() == 8 * 2 * N1 + 8);
    assert!(std::mem::size_of::<Table4>() == 8 * 5 * N4 + 8);
    assert!(std::mem::size_of::<Table5>() == 8 * 6 * N5 + 8);
    assert!(std::mem::size_of::<Table5>() <= wick_kernels::launch::TABLE_BUDGET + 8);
};

/// [`wick_kernels::launch::tables`] as kernel arguments.
fn tables<const P: usize, const N: usize>(tensors: &[(Vec<u64>, i64)]) -> Result<Vec<Arg<Table<P, N>>>, TrainError> {
    Ok(wick_kernels::launch::tables(tensors).map_err(err)?.into_iter().map(Arg).collect())
}

/// One dtype's tensors for [`AmpKernels::unscale_`] and [`AmpKernels::squares_partials`]: their
/// tables, and the grid's x (blocks within a tensor, from the longest; y is a table's count).
struct TensorList {
    tables: Vec<Table1>,
    grid_x: u32,
}

impl TensorList {
    /// The launch shape of table `t`.
    fn config(&self, t: &Table1) -> LaunchConfig {
        LaunchConfig { grid_dim: (self.grid_x, t.0.count as u32, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 }
    }

    /// The tensors it holds.
    fn count(&self) -> usize {
        self.tables.iter().map(|t| t.0.count as usize).sum()
    }
}

/// Clipping's partial sums of squares on the device ([`AmpKernels::squares_partials`]): one f64
/// per (block, tensor) of each gradient dtype's launch, the f32 section first, then f16's, then
/// bf16's, each ending at `ends[k]` (cumulative).
pub struct Partials {
    /// The sums.
    pub sums: CudaSlice<f64>,
    /// Where each dtype's section ends.
    pub ends: [i64; 3],
}

impl AmpKernels {
    /// `Σ g²` over every element of `grads` (f32, f16 or bf16, on this device), in f64: the
    /// partial sums of [`AmpKernels::squares_partials`] read back in one transfer and added up in
    /// order on the host (each dtype's section from zero, then the sections) — gradient
    /// clipping's squared norm without a per-parameter kernel, allocation or read, and the same
    /// bits every run (and the same order as the device's `wick_step_scalars`).
    pub fn squares_multi(&self, grads: &[&Tensor]) -> Result<f64, TrainError> {
        let Some(Partials { sums, ends }) = self.squares_partials(grads)? else { return Ok(0.0) };
        let sums = self.stream.clone_dtoh(&sums).map_err(|e| err(e.to_string()))?;
        let mut total = 0.0;
        let mut at = 0;
        for end in ends {
            let end = end as usize;
            total += sums[at..end].iter().sum::<f64>();
            at = end;
        }
        Ok(total)
    }

    /// Clipping's partial sums of squares of `grads`, left on the device: one launch per dtype
    /// writing each (block, tensor)'s f64 sum into one buffer, the f32 gradients' section first,
    /// then f16's, then bf16's, and where each section ends (cumulative) — what
    /// [`AmpKernels::step_scalars_`] adds up on the device. `None` for no gradients. Nothing is
    /// read back.
    pub fn squares_partials(&self, grads: &[&Tensor]) -> Result<Option<Partials>, TrainError> {
        let lists = self.tensor_lists(grads)?;
        let mut ends = [0i64; 3];
        let mut total = 0usize;
        for (end, list) in ends.iter_mut().zip(&lists) {
            if let Some(l) = list {
                total = (l.grid_x as usize)
                    .checked_mul(l.count())
                    .and_then(|n| n.checked_add(total))
                    .ok_or_else(|| err("too many gradients"))?;
            }
            *end = i64::try_from(total).map_err(|_| err("too many gradients"))?;
        }
        if total == 0 {
            return Ok(None);
        }
        let partials = self.stream.alloc_zeros::<f64>(total).map_err(|e| err(e.to_string()))?;
        let base = partials.device_ptr(&self.stream).0;
        let mut start = 0u64;
        for ((func, list), end) in self.squares_multi.iter().zip(lists).zip(ends) {
            if let Some(l) = list {
                // Each table's sums follow the previous table's: the order of one launch over all.
                let mut at = base + start * 8;
                for table in &l.tables {
                    let mut launch = self.stream.launch_builder(func);
                    launch.arg(table).arg(&at);
                    // SAFETY: `wick_squares_multi_*`'s arguments in order (a `WickTable<1>` by
                    // value, the partials' address); every address in the table a live device
                    // buffer of the stated length and dtype, kept alive by the caller's tensors;
                    // `at` is this table's part of this dtype's section of the partials buffer
                    // (alive until it is returned), grid_x doubles a tensor.
                    unsafe { launch.launch(l.config(table)) }.map_err(|e| err(e.to_string()))?;
                    at += table.0.count as u64 * l.grid_x as u64 * 8;
                }
            }
            start = end as u64;
        }
        Ok(Some(Partials { sums: partials, ends }))
    }

    /// One multi-tensor step's scalars computed on the device (`wick_step_scalars`) into `block`
    /// ([`wick_kernels::step_scalars::SLOTS`] f32) from `hyper` (the f64 hyper-parameters in
    /// `wick_kernels::step_scalars::Hyper`'s order), `counter` (the applied steps, advanced
    /// unless the step is skipped), the loss scaler's `found_inf` (one-element f32) and, for
    /// clipping, the partial sums of [`AmpKernels::squares_partials`] (the norm written to
    /// `norm`). One thread, nothing read back: a step that needs no host value while it runs.
    pub fn step_scalars_(
        &self,
        hyper: &CudaSlice<f64>,
        counter: &mut CudaSlice<i32>,
        found_inf: Option<&Tensor>,
        clip: Option<&Partials>,
        block: &mut CudaSlice<f32>,
        norm: &mut CudaSlice<f64>,
    ) -> Result<(), TrainError> {
        use wick_kernels::step_scalars::{HYPERS, SLOTS};
        if hyper.len() != HYPERS || counter.len() != 1 || block.len() != SLOTS || norm.len() != 1 {
            return Err(err(format!("step scalars: {HYPERS} hyper-parameters, one counter, {SLOTS} slots, one norm")));
        }
        let inf = match found_inf {
            Some(flag) => {
                check_scalar(flag, DType::F32, "found_inf")?;
                address(flag, &self.stream)?
            }
            None => 0,
        };
        let (partials, [e0, e1, e2]) = match clip {
            Some(p) => (p.sums.device_ptr(&self.stream).0, p.ends),
            None => (0, [0; 3]),
        };
        let mut launch = self.stream.launch_builder(&self.step_scalars);
        launch.arg(hyper).arg(counter).arg(&inf).arg(&partials).arg(&e0).arg(&e1).arg(&e2).arg(block).arg(norm);
        // SAFETY: `wick_step_scalars`'s arguments in order: the hyper-parameters (HYPERS f64), the
        // counter (one i32), the flag's address or 0, the partials' address (e2 doubles, alive in
        // the caller's buffer) or 0 with the three section ends, the block (SLOTS f32) and the
        // norm (one f64) — lengths checked above.
        unsafe { launch.launch(LaunchConfig::for_num_elems(1)) }.map_err(|e| err(e.to_string()))?;
        Ok(())
    }

    /// The tensors of `grads` by dtype (f32, f16, bf16) as a multi-tensor launch takes them — in
    /// tables of their addresses and lengths, with the grid's x — or `None` for a dtype none of
    /// them has.
    fn tensor_lists(&self, grads: &[&Tensor]) -> Result<[Option<TensorList>; 3], TrainError> {
        let mut lists: [Option<TensorList>; 3] = Default::default();
        for (index, list) in lists.iter_mut().enumerate() {
            let mut tensors = Vec::new();
            for g in grads {
                if dtype_index(g.dtype())? == index {
                    tensors.push((vec![address(g, &self.stream)?], g.elem_count() as i64));
                }
            }
            if tensors.is_empty() {
                continue;
            }
            let longest = tensors.iter().map(|(_, n)| *n).max().unwrap_or(1) as usize;
            *list = Some(TensorList { tables: tables(&tensors)?, grid_x: blocks(longest).min(64) });
        }
        Ok(lists)
    }

    /// Multiplies every gradient by `inv_scale` (a one-element f32 tensor on the device) in
    /// place and sets `found_inf` (one-element f32, not cleared here) to 1 if any result is inf
    /// or NaN: one launch per dtype, covering all tensors of that dtype.
    pub fn unscale_(&self, grads: &[&Tensor], inv_scale: &Tensor, found_inf: &Tensor) -> Result<(), TrainError> {
        check_scalar(inv_scale, DType::F32, "inv_scale")?;
        check_scalar(found_inf, DType::F32, "found_inf")?;
        let (inv, flag) = (address(inv_scale, &self.stream)?, address(found_inf, &self.stream)?);
        for (func, list) in self.unscale.iter().zip(self.tensor_lists(grads)?) {
            let Some(l) = list else { continue };
            for table in &l.tables {
                let mut launch = self.stream.launch_builder(func);
                launch.arg(table).arg(&flag).arg(&inv);
                // SAFETY: the arguments match the kernel's signature (a `WickTable<1>` by value,
                // the flag, the scale); every address in the table is a live device buffer of
                // the stated length and dtype, kept alive by the caller's tensors.
                unsafe { launch.launch(l.config(table)) }.map_err(|e| err(e.to_string()))?;
            }
        }
        Ok(())
    }

    /// [`AmpKernels::unscale_`] with a flag of its own, read back: whether any gradient is inf or
    /// NaN once multiplied by `inv_scale` (`false`, with nothing launched, for no gradients). The
    /// one host read of a step that decides on the host.
    pub fn unscale_checked(&self, grads: &[&Tensor], inv_scale: f32) -> Result<bool, TrainError> {
        if grads.is_empty() {
            return Ok(false);
        }
        let inv = Tensor::new(&[inv_scale], self.device()).map_err(|e| err(e.to_string()))?;
        let found = Tensor::zeros(1, DType::F32, self.device()).map_err(|e| err(e.to_string()))?;
        self.unscale_(grads, &inv, &found)?;
        let flag = found.to_vec1::<f32>().map_err(|e| err(e.to_string()))?;
        Ok(flag.first().is_some_and(|f| *f != 0.0))
    }

    /// The optimizer's step for many parameters at once, in place (the trainer's use): one launch
    /// per gradient dtype over every item of that dtype, the same arithmetic as
    /// [`AmpKernels::optimizer_step_`] element for element (the host's to the bit). Every item is
    /// checked before anything launches; an error leaves every tensor as it was. With `skip` (a
    /// one-element f32 device flag: the loss scaler's `found_inf`), the launches change nothing
    /// when the flag is non-zero — the step is skipped on the device, without a host read. Every
    /// gradient element is multiplied by `factor` as it is read (gradient clipping's coefficient,
    /// 1 for none, which changes no bit). The step's scalars are computed here
    /// (`wick_kernels::step_scalars::host`) and copied to the device with the tensor lists.
    pub fn optimizer_step_multi_(
        &self,
        items: &[StepItem<'_>],
        rule: Optimizer,
        step: i32,
        skip: Option<&Tensor>,
        factor: f32,
    ) -> Result<(), TrainError> {
        let block = wick_kernels::step_scalars::host(&rule.hyper(), step, factor);
        let block = self.stream.clone_htod(&block).map_err(|e| err(e.to_string()))?;
        self.optimizer_step_multi_with_(items, rule, &block, skip)
    }

    /// [`AmpKernels::optimizer_step_multi_`] with the step's scalars already on the device in
    /// `block` (written by [`AmpKernels::step_scalars_`]: its constants, clipping's factor and its
    /// skip flag, which skips the step like `skip` does).
    pub fn optimizer_step_multi_with_(
        &self,
        items: &[StepItem<'_>],
        rule: Optimizer,
        block: &CudaSlice<f32>,
        skip: Option<&Tensor>,
    ) -> Result<(), TrainError> {
        if block.len() != wick_kernels::step_scalars::SLOTS {
            return Err(err("the step's scalars must be one block of wick_kernels::step_scalars::SLOTS values"));
        }
        let skip = match skip {
            Some(flag) => {
                check_scalar(flag, DType::F32, "skip")?;
                address(flag, &self.stream)?
            }
            None => 0,
        };
        let mut groups: [Vec<(Vec<u64>, i64)>; 3] = Default::default();
        for item in items {
            item.check(rule)?;
            let p = |t: &Tensor| address(t, &self.stream);
            let mut ptrs = vec![p(item.target)?];
            for s in item.state {
                ptrs.push(p(s)?);
            }
            ptrs.push(p(item.grad)?);
            ptrs.push(item.model.map(p).transpose()?.unwrap_or(0));
            groups[dtype_index(item.grad.dtype())?].push((ptrs, item.grad.elem_count() as i64));
        }
        for (index, group) in groups.iter().enumerate() {
            if group.is_empty() {
                continue;
            }
            let longest = group.iter().map(|(_, n)| *n).max().unwrap_or(1) as usize;
            let grid_x = blocks(longest).min(64);
            match rule {
                Optimizer::SgdMomentum { .. } => {
                    let list: Vec<Table4> = tables(group)?;
                    self.launch_step(&self.sgd_multi[index], &list, grid_x, block, skip)?;
                }
                Optimizer::AdamW(_) => {
                    let list: Vec<Table5> = tables(group)?;
                    self.launch_step(&self.adamw_multi[index], &list, grid_x, block, skip)?;
                }
            }
        }
        Ok(())
    }

    /// One multi-tensor update launch a table: `func` (`wick_sgd_momentum_multi_*` with SGD's
    /// tables, `wick_adamw_multi_*` with AdamW's) with the table by value, the step's block and
    /// the skip flag's address (or 0).
    fn launch_step<const P: usize, const N: usize>(
        &self,
        func: &CudaFunction,
        list: &[Arg<Table<P, N>>],
        grid_x: u32,
        block: &CudaSlice<f32>,
        skip: u64,
    ) -> Result<(), TrainError> {
        for table in list {
            let config = LaunchConfig {
                grid_dim: (grid_x, table.0.count as u32, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            };
            let mut launch = self.stream.launch_builder(func);
            launch.arg(table).arg(block).arg(&skip);
            // SAFETY: the kernel's arguments in order: a `WickTable<P / N>` by value (the caller
            // pairs SGD's kernels with 4-address tables, AdamW's with 5) whose addresses —
            // parameter, state, gradient, model copy or 0 — are live device buffers of the
            // item's length and stated type, kept alive by the caller's tensors; the block of
            // SLOTS f32 (length checked by the caller); the skip flag's address (a live
            // one-element f32) or 0.
            unsafe { launch.launch(config) }.map_err(|e| err(e.to_string()))?;
        }
        Ok(())
    }
}
