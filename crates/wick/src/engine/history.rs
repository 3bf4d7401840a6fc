//! The allocation history of the engine's own run (PyTorch's `torch.cuda.memory._record_memory_history`):
//! on the CPU, every allocation and free of candle's buffers that the process's counting global
//! allocator serves, with size, address, time and label stack ([`Engine::label`], steps, the
//! trainer's phases, the zoo's layers); on CUDA, candle's allocations from the wick pool, seen
//! through CUPTI (`cuda_history.rs`). Read with [`Engine::memory_history`].

use wick_memory::{
    heap_history, label_path, push_label, start_heap_history, stop_heap_history, LabelGuard, MemoryError,
    DEFAULT_MIN_EVENT_SIZE, LARGE_REQUEST,
};

use super::{Engine, Kind};
use crate::memory_history::MemoryHistory;

impl Engine {
    /// Pushes `name` onto this thread's label stack until the guard is dropped: what is
    /// allocated meanwhile is recorded under it (the same as [`wick_memory::push_label`]; steps
    /// push their label themselves).
    pub fn label(&self, name: &str) -> LabelGuard {
        push_label(name)
    }

    /// Starts recording the allocation history, keeping the last `max_entries` events, of
    /// allocations of [`DEFAULT_MIN_EVENT_SIZE`] bytes or more (`Some`), or stops it (`None`;
    /// what was recorded stays readable). See [`Engine::record_memory_history_with`].
    pub fn record_memory_history(&self, max_entries: Option<usize>) -> Result<(), MemoryError> {
        match max_entries {
            Some(n) => self.record_memory_history_with(n, DEFAULT_MIN_EVENT_SIZE),
            None => {
                match &self.kind {
                    Kind::Cuda(g) => g.stop_history(),
                    Kind::Cpu => stop_heap_history(),
                }
                Ok(())
            }
        }
    }

    /// Starts recording allocations of at least `min_size` bytes into a ring of `max_entries`
    /// events (the oldest are overwritten when it is full). The history is the process heap's,
    /// so the process's global allocator must count: [`wick_memory::CachingHeap`] or
    /// [`crate::CountingAllocator`] (`Unsupported` otherwise, saying so). On CUDA the history
    /// is candle's allocations from the wick pool, seen through CUPTI's callbacks on the driver's
    /// allocation calls (`Unsupported` when libcupti cannot be opened, saying where to put it).
    pub fn record_memory_history_with(&self, max_entries: usize, min_size: usize) -> Result<(), MemoryError> {
        if let Kind::Cuda(g) = &self.kind {
            return g.record_history(max_entries, min_size);
        }
        // A large request makes an installed caching heap known (it registers on its first one).
        drop(std::hint::black_box(Vec::<u8>::with_capacity(LARGE_REQUEST)));
        if crate::host_memory::exact_heap().is_none() {
            return Err(MemoryError::Unsupported(
                "record_memory_history needs a global allocator that sees every allocation: install \
                 `#[global_allocator] static HEAP: wick_memory::CachingHeap = wick_memory::CachingHeap::new();` \
                 (or wick::CountingAllocator) in the binary"
                    .into(),
            ));
        }
        start_heap_history(max_entries, min_size, || crate::host_memory::exact_heap().map_or(0, |(b, _)| b))
    }

    /// What has been recorded so far (recording goes on), with every label stack resolved.
    pub fn memory_history(&self) -> MemoryHistory {
        let heap = match &self.kind {
            Kind::Cuda(g) => g.history(),
            Kind::Cpu => heap_history(),
        };
        let labels = heap.events.iter().map(|e| e.label).collect::<std::collections::BTreeSet<_>>();
        let labels = labels.into_iter().map(|id| (id.0, label_path(id))).collect();
        MemoryHistory { device: self.name(), heap, labels }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recording_without_a_counting_allocator_says_what_to_install() {
        // The library's tests run on the system allocator: nothing sees candle's buffers.
        let engine = Engine::cpu();
        let err = engine.record_memory_history(Some(1000)).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(err.contains("CachingHeap") && err.contains("global_allocator"), "{err}");
        assert!(!wick_memory::heap_history_recording());
    }
}
