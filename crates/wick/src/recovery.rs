//! Out-of-memory recovery a user can call: retry after freeing the cache, and find the largest
//! batch that fits (accelerate's `find_executable_batch_size`, as a binary search) together with
//! the gradient-accumulation steps that keep the effective batch.

use crate::engine::Engine;
use crate::error::Error;

/// The batch that fits and how to keep the effective batch with it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct BatchPlan {
    /// Largest batch size that ran.
    pub batch_size: usize,
    /// Micro-batches per optimiser step so that `batch_size * steps >= effective batch`.
    pub accumulation_steps: usize,
    /// Every batch size tried, in order, and whether it fit.
    pub tried: Vec<(usize, bool)>,
}

impl Engine {
    /// Runs `op`; on out-of-memory, empties the cache and runs it once more.
    pub fn retry_on_oom<T>(&self, mut op: impl FnMut(&Engine) -> Result<T, Error>) -> Result<T, Error> {
        match op(self) {
            Err(e) if e.is_out_of_memory() => {
                self.empty_cache()?;
                self.retries.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                op(self)
            }
            other => other,
        }
    }

    /// Finds the largest batch size in `1..=effective_batch` for which `run(batch)` succeeds,
    /// by binary search; out-of-memory means "too big", any other error is returned at once. The
    /// closure should do one real step at that batch size (pre-flight checks included).
    pub fn find_executable_batch_size(
        &self,
        effective_batch: usize,
        mut run: impl FnMut(&Engine, usize) -> Result<(), Error>,
    ) -> Result<BatchPlan, Error> {
        if effective_batch == 0 {
            return Err(
                wick_memory::MemoryError::InvalidConfig("effective batch size must be at least 1".into()).into()
            );
        }
        let (mut lo, mut hi) = (0usize, effective_batch); // lo fits (0 = nothing yet), answer in lo..=hi
        let mut tried = Vec::new();
        // Try the full batch first: the common case needs one run.
        let mut candidate = effective_batch;
        while lo < hi {
            let outcome = run(self, candidate);
            let fits = match outcome {
                Ok(()) => true,
                Err(e) if e.is_out_of_memory() => false,
                Err(e) => return Err(e),
            };
            tried.push((candidate, fits));
            if fits {
                lo = candidate;
            } else {
                hi = candidate - 1;
                // Free what the failed attempt left cached before the next try.
                self.empty_cache()?;
            }
            candidate = lo + (hi - lo).div_ceil(2);
        }
        if lo == 0 {
            return Err(self
                .with_usage(wick_memory::OutOfMemory::refused(format!("{} (a step at batch 1)", self.name()), 0))
                .with_device(self.budget().bytes, self.available())
                .into_error()
                .into());
        }
        Ok(BatchPlan { batch_size: lo, accumulation_steps: effective_batch.div_ceil(lo), tried })
    }
}
