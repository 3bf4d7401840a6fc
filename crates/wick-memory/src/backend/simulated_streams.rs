//! The stream/event model of the CPU backends. Work is explicit: a test `launch`es work on a
//! stream and later `finish`es it, so stream-ordered reuse can be observed deterministically.

use std::collections::HashMap;
use std::sync::Mutex;

use super::BackendError;
use crate::stream::{EventId, StreamId};

#[derive(Debug, Default)]
struct State {
    /// Per stream: (work items launched, work items finished).
    streams: HashMap<StreamId, (u64, u64)>,
    /// Per event: the stream and how many items had been launched when it was recorded.
    events: HashMap<EventId, (StreamId, u64)>,
    next_event: u64,
}

/// Streams whose work completes only when told to. Stream 0 exists from the start.
#[derive(Debug)]
pub struct SimulatedStreams {
    state: Mutex<State>,
}

impl Default for SimulatedStreams {
    fn default() -> Self {
        let mut state = State::default();
        state.streams.insert(StreamId::DEFAULT, (0, 0));
        SimulatedStreams { state: Mutex::new(state) }
    }
}

impl SimulatedStreams {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Creates a new stream and returns its id.
    pub fn create_stream(&self) -> StreamId {
        let mut state = self.lock();
        let id = StreamId(state.streams.keys().map(|s| s.0).max().unwrap_or(0) + 1);
        state.streams.insert(id, (0, 0));
        id
    }

    /// Makes sure stream `id` exists (replays name their streams by number).
    pub fn ensure_stream(&self, id: StreamId) {
        self.lock().streams.entry(id).or_insert((0, 0));
    }

    /// Enqueues one unit of (pretend) device work on `stream`; it stays pending until finished.
    pub fn launch(&self, stream: StreamId) -> Result<(), BackendError> {
        let mut state = self.lock();
        let entry = state.streams.get_mut(&stream).ok_or(BackendError::UnknownStream(stream))?;
        entry.0 += 1;
        Ok(())
    }

    /// Completes all work launched so far on `stream`.
    pub fn finish(&self, stream: StreamId) -> Result<(), BackendError> {
        let mut state = self.lock();
        let entry = state.streams.get_mut(&stream).ok_or(BackendError::UnknownStream(stream))?;
        entry.1 = entry.0;
        Ok(())
    }

    /// Completes all work on every stream.
    pub fn finish_all(&self) {
        for entry in self.lock().streams.values_mut() {
            entry.1 = entry.0;
        }
    }

    pub(crate) fn check(&self, stream: StreamId) -> Result<(), BackendError> {
        if self.lock().streams.contains_key(&stream) {
            Ok(())
        } else {
            Err(BackendError::UnknownStream(stream))
        }
    }

    pub(crate) fn record(&self, stream: StreamId) -> Result<EventId, BackendError> {
        let mut state = self.lock();
        let launched = state.streams.get(&stream).ok_or(BackendError::UnknownStream(stream))?.0;
        state.next_event += 1;
        let id = EventId(state.next_event);
        state.events.insert(id, (stream, launched));
        Ok(id)
    }

    pub(crate) fn completed(&self, event: EventId) -> Result<bool, BackendError> {
        let state = self.lock();
        let (stream, ticket) =
            *state.events.get(&event).ok_or_else(|| BackendError::Other(format!("unknown event {}", event.0)))?;
        let finished = state.streams.get(&stream).map(|s| s.1).unwrap_or(u64::MAX);
        Ok(finished >= ticket)
    }

    pub(crate) fn destroy(&self, event: EventId) {
        self.lock().events.remove(&event);
    }

    /// Number of live events (for leak checks in tests).
    pub fn live_events(&self) -> usize {
        self.lock().events.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn event_completes_only_after_finish() {
        let s = SimulatedStreams::default();
        let a = s.create_stream();
        s.launch(a).unwrap();
        let e = s.record(a).unwrap();
        assert!(!s.completed(e).unwrap());
        s.launch(a).unwrap();
        s.finish(a).unwrap();
        assert!(s.completed(e).unwrap());
        let idle = s.record(StreamId::DEFAULT).unwrap();
        assert!(s.completed(idle).unwrap(), "an event on an idle stream is complete");
        assert!(matches!(s.launch(StreamId(99)), Err(BackendError::UnknownStream(_))));
    }
}
