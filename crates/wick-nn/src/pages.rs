//! A tensor's memory handed back while the tensor lives, and given back to it: how a sharded
//! block's gathered parameters ([`crate::checkpoint`]) and ZeRO-3's released model copies
//! (wick-train) give their memory back while the graph or the model still holds the tensor.
//!
//! On the CPU, the storage's whole pages go back to the operating system and are counted again
//! before they are written. Why pages and not a smaller buffer: a tensor's storage cannot
//! shrink under the shapes that refer to it, and one that reads as zeros is never undefined
//! behaviour for any kernel that trusts its shape ([`wick::memory::release_pages`]).
//!
//! On a GPU there are no pages to hand back inside a buffer candle allocated, so the storage
//! itself is exchanged (`Tensor::swap_storage`, this repository's patch of candle): a released
//! CUDA tensor's storage becomes host memory of the same dtype and length whose pages are
//! handed back at once — it reads as zeros, holds no device memory, and a GPU op that reads it
//! is a device-mismatch error rather than a read past a buffer — and [`refill`] gives it device
//! memory holding new values by exchanging storages with a fresh tensor of them (no copy).

use candle_core::{CpuStorage, DType, Device, InplaceOp1, Layout, Result, Storage, Tensor};

/// Hands a tensor's memory back while it lives: it reads as zeros until written again
/// ([`refill`] on a GPU). A CPU tensor's whole pages go back (the caching heap no longer counts
/// them); a CUDA tensor's device memory goes back at once (see the module's documentation), and
/// one released before is left as it is. Integer dtypes on the CPU are left as they are.
pub fn release(t: &Tensor) -> Result<()> {
    if t.device().is_cuda() {
        return release_device(t);
    }
    t.inplace_op1(&Pages { release: true })
}

/// A CUDA tensor's storage exchanged for zeros in host memory whose pages are handed back.
fn release_device(t: &Tensor) -> Result<()> {
    let len = {
        let (storage, _) = t.storage_and_layout();
        match &*storage {
            Storage::Cuda(_) => storage.stored_len(),
            // Released already (or never on the device): nothing to give back.
            _ => return Ok(()),
        }
    };
    let len = len.ok_or_else(|| candle_core::Error::Msg("a CUDA storage of unknown length".into()))?;
    let host = host_zeros(t.dtype(), len)?;
    t.swap_storage(&host)?;
    // `host` now holds the device memory, given back to the pool as it drops.
    Ok(())
}

/// `len` zeros of `dtype` on the host with their pages handed back (read as zeros, not counted).
fn host_zeros(dtype: DType, len: usize) -> Result<Tensor> {
    let t = Tensor::zeros(len, dtype, &Device::Cpu)?;
    t.inplace_op1(&Pages { release: true })?;
    Ok(t)
}

/// Gives `t` — a CUDA tensor released by [`release`] — device memory holding `values`, by
/// exchanging storages with `values`: a fresh contiguous tensor of `t`'s dtype, element count
/// and device whose storage is its own and holds exactly its values (made for this; it reads
/// as zeros afterwards). No copy is made. A CUDA tensor that was not released is refused.
pub fn refill(t: &Tensor, values: &Tensor) -> Result<()> {
    let fits = values.dtype() == t.dtype()
        && values.elem_count() == t.elem_count()
        && values.device().same_device(t.device())
        && values.is_contiguous()
        && values.layout().start_offset() == 0;
    if !fits {
        return Err(candle_core::Error::Msg(format!(
            "refill: {:?} {:?} values on {:?} cannot fill a {:?} {:?} tensor on {:?}",
            values.dims(),
            values.dtype(),
            values.device(),
            t.dims(),
            t.dtype(),
            t.device()
        )));
    }
    if matches!(&*t.storage_and_layout().0, Storage::Cuda(_)) {
        return Err(candle_core::Error::Msg("refill: the tensor holds device memory (release it first)".into()));
    }
    t.swap_storage(values)
}

/// Counts the pages [`release`] handed back from a tensor's storage as live again (before it
/// is written again; writing does not need it, the caching heap's count does).
pub fn reclaim(t: &Tensor) -> Result<()> {
    t.inplace_op1(&Pages { release: false })
}

/// [`reclaim`] on a storage in hand (an in-place op about to write it).
pub fn reclaim_storage(storage: &mut CpuStorage) {
    pages(storage, false);
}

struct Pages {
    release: bool,
}

impl InplaceOp1 for Pages {
    fn name(&self) -> &'static str {
        if self.release {
            "release-pages"
        } else {
            "reclaim-pages"
        }
    }

    fn cpu_fwd(&self, storage: &mut CpuStorage, _: &Layout) -> Result<()> {
        pages(storage, self.release);
        Ok(())
    }
}

fn pages(storage: &mut CpuStorage, release: bool) {
    fn on<T>(v: &mut Vec<T>, release: bool) {
        let (start, bytes) = (v.as_mut_ptr().cast::<u8>(), v.capacity() * std::mem::size_of::<T>());
        // SAFETY: the vector's buffer is one live global-allocator request of its capacity in
        // bytes, held exclusively (the storage's write lock, or `&mut`) during this call, and
        // holds plain numbers, for which all-zero bytes are a valid value.
        unsafe {
            if release {
                wick::memory::release_pages(start, bytes);
            } else {
                wick::memory::reclaim_pages(start, bytes);
            }
        }
    }
    match storage {
        CpuStorage::F32(v) => on(v, release),
        CpuStorage::BF16(v) => on(v, release),
        CpuStorage::F16(v) => on(v, release),
        CpuStorage::F64(v) => on(v, release),
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `refill`'s refusals (checked before anything is exchanged, so both tensors keep their
    /// values): another dtype, another element count, a view that is not its storage's start or
    /// not contiguous. The CUDA cases run in `scripts/gpu-check.sh` (`nccl_check`'s `pages`).
    #[test]
    fn refill_refuses_values_that_do_not_fit_and_changes_nothing() -> Result<()> {
        let t = Tensor::arange(0f32, 12.0, &Device::Cpu)?.reshape((3, 4))?;
        let wide = Tensor::arange(0f32, 24.0, &Device::Cpu)?.reshape((4, 6))?;
        let bad = [
            Tensor::zeros((3, 4), DType::BF16, &Device::Cpu)?,
            Tensor::zeros((3, 5), DType::F32, &Device::Cpu)?,
            wide.narrow(0, 1, 2)?.reshape((3, 4))?,
            Tensor::arange(0f32, 12.0, &Device::Cpu)?.reshape((4, 3))?.t()?,
        ];
        for values in &bad {
            let before = values.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?;
            let e = refill(&t, values).expect_err("refused");
            assert!(e.to_string().contains("refill"), "{e}");
            assert_eq!(t.flatten_all()?.to_vec1::<f32>()?, (0..12).map(|v| v as f32).collect::<Vec<_>>());
            assert_eq!(values.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?, before);
        }
        Ok(())
    }
}
