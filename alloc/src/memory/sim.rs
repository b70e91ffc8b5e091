//! Simulated streams for the host and virtual backends.
//!
//! Host work is synchronous, so every event completes at once unless a test *holds* a
//! stream: then events recorded on it stay pending until the stream is released (or an event
//! is synchronised, which stands for waiting on the device). This lets tests prove that the
//! cache never hands out a block while another stream may still use it.

use super::Stream;
use std::collections::HashMap;
use std::sync::Mutex;

/// An event on a simulated stream: the stream and the work count it waits for.
#[derive(Debug)]
pub struct SimEvent {
    stream: Stream,
    ticket: u64,
}

#[derive(Default, Debug)]
struct StreamState {
    submitted: u64,
    completed: u64,
    held: bool,
}

/// Simulated stream progress. Cheap when no stream is held.
#[derive(Default, Debug)]
pub struct SimStreams {
    streams: Mutex<HashMap<Stream, StreamState>>,
}

impl SimStreams {
    /// Keeps events recorded on `stream` from now on pending, as if it had work queued.
    pub fn hold(&self, stream: Stream) {
        self.streams.lock().unwrap_or_else(|e| e.into_inner()).entry(stream).or_default().held =
            true;
    }

    /// Completes all work on `stream` and stops holding it.
    pub fn release(&self, stream: Stream) {
        let mut map = self.streams.lock().unwrap_or_else(|e| e.into_inner());
        let s = map.entry(stream).or_default();
        s.held = false;
        s.completed = s.submitted;
    }

    pub(crate) fn record(&self, stream: Stream) -> SimEvent {
        let mut map = self.streams.lock().unwrap_or_else(|e| e.into_inner());
        let s = map.entry(stream).or_default();
        s.submitted += 1;
        if !s.held {
            s.completed = s.submitted;
        }
        SimEvent { stream, ticket: s.submitted }
    }

    pub(crate) fn completed(&self, event: &SimEvent) -> bool {
        let map = self.streams.lock().unwrap_or_else(|e| e.into_inner());
        map.get(&event.stream).is_none_or(|s| s.completed >= event.ticket)
    }

    pub(crate) fn synchronize(&self, event: &SimEvent) {
        let mut map = self.streams.lock().unwrap_or_else(|e| e.into_inner());
        let s = map.entry(event.stream).or_default();
        s.completed = s.completed.max(event.ticket);
    }
}
