//! Stream-ordered reuse: blocks wait for record_stream events, and blocks cached on one stream
//! become usable on others once an event shows that stream's work is done.

use super::blocks::{BlockState, SHARED};
use super::state::State;
use crate::backend::Backend;
use crate::error::Result;
use crate::stream::{EventId, StreamId};

impl State {
    /// Makes a cached block usable on any stream, coalescing it with free neighbours that the
    /// old tag kept apart.
    pub(super) fn share(&mut self, slot: u32) {
        if self.table.blocks.get(slot).is_none_or(|b| b.state != BlockState::Free) {
            return;
        }
        self.table.pool_remove(slot, &mut self.stats);
        self.table.block_mut(slot).tag = SHARED;
        self.merge_neighbours(slot);
        self.table.pool_insert(slot, &mut self.stats);
    }

    /// Moves blocks whose record_stream events have completed into the free pools.
    pub(super) fn process_events(&mut self, backend: &dyn Backend) -> Result<()> {
        if self.pending.is_empty() {
            return Ok(());
        }
        let mut still_pending = Vec::new();
        for slot in std::mem::take(&mut self.pending) {
            let BlockState::PendingFree(events) = &self.table.block(slot).state else { continue };
            let mut done = true;
            for event in events {
                done &= backend.event_completed(*event)?;
            }
            if done {
                for event in events.clone() {
                    backend.destroy_event(event);
                }
                let pool = self.table.segment_pool(slot);
                self.free_block(slot, pool);
            } else {
                still_pending.push(slot);
            }
        }
        self.pending = still_pending;
        Ok(())
    }

    /// Makes blocks cached on other streams available to `stream` once an event shows the
    /// stream that freed them has finished. Records such events on a miss. True if any moved.
    pub(super) fn harvest_cross_stream(&mut self, backend: &dyn Backend, stream: StreamId) -> Result<bool> {
        let mut moved = false;
        let recorded: Vec<(u64, EventId, u64)> = self.harvest.iter().map(|(s, (e, n))| (*s, *e, *n)).collect();
        for (other, event, epoch) in recorded {
            if backend.event_completed(event)? {
                backend.destroy_event(event);
                self.harvest.remove(&other);
                for slot in self.table.free_with_tag(other) {
                    // Earlier iterations may have merged this block into a neighbour.
                    if self.table.blocks.get(slot).is_some_and(|b| b.free_epoch <= epoch && b.tag == other) {
                        self.share(slot);
                        moved = true;
                    }
                }
            }
        }
        let others: Vec<u64> = self.streams_seen.iter().copied().filter(|s| *s != stream.0).collect();
        for other in others {
            if !self.harvest.contains_key(&other) && self.table.has_free_with_tag(other) {
                let Ok(event) = backend.record_event(StreamId(other)) else { continue };
                // An idle stream's event is complete at once: its cached blocks can be shared now
                // rather than at the next miss.
                if backend.event_completed(event).unwrap_or(false) {
                    backend.destroy_event(event);
                    for slot in self.table.free_with_tag(other) {
                        if self.table.blocks.get(slot).is_some_and(|b| b.tag == other) {
                            self.share(slot);
                            moved = true;
                        }
                    }
                } else {
                    self.harvest.insert(other, (event, self.free_counter));
                }
            }
        }
        Ok(moved)
    }

    /// Marks a live block as used on another stream.
    pub fn record_stream(&mut self, slot: u32, stream: StreamId) {
        let block = self.table.block_mut(slot);
        if block.stream != stream && !block.extra_streams.contains(&stream) {
            block.extra_streams.push(stream);
        }
        self.streams_seen.insert(stream.0);
    }
}
