//! A limit on log lines that any peer can provoke: the log must not become the attack.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Warnings about malformed frames logged per `BAD_FRAME_LOG_WINDOW` (any peer can send
/// them; the log must not become the attack).
const BAD_FRAME_LOGS_PER_WINDOW: u64 = 10;
const BAD_FRAME_LOG_WINDOW: Duration = Duration::from_secs(60);

/// Allows a few log lines per window and counts the ones it suppressed.
#[derive(Default)]
pub struct LogLimiter {
    window: parking_lot::Mutex<Option<Instant>>,
    in_window: AtomicU64,
    suppressed: AtomicU64,
}

impl LogLimiter {
    /// True if a line may be logged now; otherwise it is counted as suppressed. Returns
    /// how many were suppressed before this one when a new window opens.
    pub fn allow(&self, now: Instant) -> Option<u64> {
        let mut w = self.window.lock();
        if w.is_none_or(|t| now.duration_since(t) >= BAD_FRAME_LOG_WINDOW) {
            *w = Some(now);
            self.in_window.store(1, Ordering::Relaxed);
            return Some(self.suppressed.swap(0, Ordering::Relaxed));
        }
        if self.in_window.fetch_add(1, Ordering::Relaxed) < BAD_FRAME_LOGS_PER_WINDOW {
            Some(0)
        } else {
            self.suppressed.fetch_add(1, Ordering::Relaxed);
            None
        }
    }
}
