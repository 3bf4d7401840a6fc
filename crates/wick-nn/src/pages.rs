//! A CPU tensor's memory handed back to the operating system while the tensor lives, and
//! counted again before it is written: how a sharded block's gathered parameters
//! ([`crate::checkpoint`]) and ZeRO-3's released model copies (wick-train) give their memory
//! back while the graph or the model still holds the tensor.
//!
//! Why pages and not a smaller buffer: a tensor's storage cannot shrink under the shapes that
//! refer to it, and one that reads as zeros is never undefined behaviour for any kernel that
//! trusts its shape ([`wick::memory::release_pages`]).

use candle_core::{CpuStorage, InplaceOp1, Layout, Result, Tensor};

/// Hands the whole pages of a CPU tensor's storage back: it reads as zeros until written
/// again, and the caching heap no longer counts them. Other devices and dtypes are left as
/// they are.
pub fn release(t: &Tensor) -> Result<()> {
    t.inplace_op1(&Pages { release: true })
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
