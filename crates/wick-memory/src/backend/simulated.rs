//! Address space only: no real memory behind the addresses. A simulated 80 GiB device replays a
//! GPU-scale workload on a laptop, and fragmentation is measured exactly.

use std::sync::Mutex;

use super::{Backend, BackendError, SimulatedStreams};
use crate::stream::{EventId, StreamId};

#[derive(Debug)]
struct State {
    used: usize,
    next_addr: u64,
}

impl State {
    /// The next `size` bytes of address space, rounded up to the alignment; out of memory when the
    /// 64-bit space is used up (checked, so a huge request can never wrap onto earlier blocks).
    fn take_addresses(&mut self, size: usize) -> Result<u64, BackendError> {
        let align = SIM_ALIGNMENT as u64;
        let span = (size as u64).div_ceil(align).checked_mul(align).ok_or(BackendError::OutOfMemory)?;
        let addr = self.next_addr;
        self.next_addr = addr.checked_add(span).ok_or(BackendError::OutOfMemory)?;
        Ok(addr)
    }
}

/// A device with `capacity` bytes and no memory behind its addresses.
#[derive(Debug)]
pub struct SimulatedBackend {
    capacity: usize,
    /// Memory taken by "other processes", so `free_memory` can be below capacity minus use.
    external: usize,
    state: Mutex<State>,
    streams: SimulatedStreams,
}

/// Simulated segments are 2 MiB aligned, like CUDA's large allocations.
const SIM_ALIGNMENT: usize = 2 << 20;
/// Addresses start well above zero so they look like device pointers and never collide with 0.
const SIM_BASE: u64 = 0x7f00_0000_0000;

impl SimulatedBackend {
    /// A simulated device of `capacity` bytes.
    pub fn new(capacity: usize) -> Self {
        SimulatedBackend {
            capacity,
            external: 0,
            state: Mutex::new(State { used: 0, next_addr: SIM_BASE }),
            streams: SimulatedStreams::default(),
        }
    }

    /// Pretends another process holds `bytes` of the device.
    pub fn with_external_usage(mut self, bytes: usize) -> Self {
        self.external = bytes.min(self.capacity);
        self
    }

    /// The stream model (launch/finish work) of this backend.
    pub fn streams(&self) -> &SimulatedStreams {
        &self.streams
    }

    /// Bytes currently held in segments.
    pub fn bytes_in_segments(&self) -> usize {
        self.lock().used
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

impl Backend for SimulatedBackend {
    fn device_name(&self) -> String {
        "sim:0".to_string()
    }

    fn capacity(&self) -> usize {
        self.capacity
    }

    fn free_memory(&self) -> usize {
        self.capacity.saturating_sub(self.external + self.lock().used)
    }

    fn segment_alignment(&self) -> usize {
        SIM_ALIGNMENT
    }

    fn is_host_accessible(&self) -> bool {
        false
    }

    fn allocate_segment(&self, size: usize, stream: StreamId) -> Result<u64, BackendError> {
        self.streams.check(stream)?;
        let mut state = self.lock();
        let total = state.used.checked_add(size).and_then(|t| t.checked_add(self.external));
        if size == 0 || total.is_none_or(|t| t > self.capacity) {
            return Err(BackendError::OutOfMemory);
        }
        // Addresses are never reused: a 64-bit space outlasts any replay, and a stale address
        // can then never alias a live one.
        let addr = state.take_addresses(size)?;
        state.used += size;
        Ok(addr)
    }

    unsafe fn free_segment(&self, _addr: u64, size: usize) -> Result<(), BackendError> {
        let mut state = self.lock();
        state.used =
            state.used.checked_sub(size).ok_or_else(|| BackendError::Other("freed more than was allocated".into()))?;
        Ok(())
    }

    fn supports_expandable(&self) -> bool {
        true
    }

    fn reserve_address_space(&self, size: usize) -> Result<u64, BackendError> {
        let mut state = self.lock();
        state.take_addresses(size)
    }

    unsafe fn map_range(&self, _addr: u64, size: usize) -> Result<(), BackendError> {
        let mut state = self.lock();
        let total = state.used.checked_add(size).and_then(|t| t.checked_add(self.external));
        if total.is_none_or(|t| t > self.capacity) {
            return Err(BackendError::OutOfMemory);
        }
        state.used += size;
        Ok(())
    }

    unsafe fn unmap_range(&self, _addr: u64, size: usize) -> Result<(), BackendError> {
        let mut state = self.lock();
        state.used =
            state.used.checked_sub(size).ok_or_else(|| BackendError::Other("unmapped more than was mapped".into()))?;
        Ok(())
    }

    fn check_stream(&self, stream: StreamId) -> Result<(), BackendError> {
        self.streams.check(stream)
    }

    fn record_event(&self, stream: StreamId) -> Result<EventId, BackendError> {
        self.streams.record(stream)
    }

    fn event_completed(&self, event: EventId) -> Result<bool, BackendError> {
        self.streams.completed(event)
    }

    fn destroy_event(&self, event: EventId) {
        self.streams.destroy(event)
    }

    fn synchronize(&self) -> Result<(), BackendError> {
        self.streams.finish_all();
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn capacity_and_external_usage_are_enforced() {
        let b = SimulatedBackend::new(100 << 20).with_external_usage(20 << 20);
        assert_eq!(b.free_memory(), 80 << 20);
        let a = b.allocate_segment(60 << 20, StreamId::DEFAULT).unwrap();
        assert_eq!(a % SIM_ALIGNMENT as u64, 0);
        assert_eq!(b.allocate_segment(30 << 20, StreamId::DEFAULT), Err(BackendError::OutOfMemory));
        // SAFETY: simulated memory; freeing the one segment once.
        unsafe { b.free_segment(a, 60 << 20).unwrap() };
        assert!(b.allocate_segment(30 << 20, StreamId::DEFAULT).is_ok());
        assert_eq!(b.allocate_segment(usize::MAX, StreamId::DEFAULT), Err(BackendError::OutOfMemory));
    }
}
