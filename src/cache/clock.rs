//! The cache's clock: wall-clock milliseconds that follow tokio's (pausable) time.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Milliseconds since the Unix epoch, advancing with `tokio::time::Instant`, so tests that
/// pause and advance tokio's clock move expiry deterministically. Expiry times are absolute
/// (Unix ms) so they keep their meaning when items move between nodes.
#[derive(Debug, Clone, Copy)]
pub struct Clock {
    base_unix_ms: u64,
    base: tokio::time::Instant,
}

impl Default for Clock {
    fn default() -> Self {
        Self::new()
    }
}

impl Clock {
    /// A clock anchored at the current wall-clock time.
    pub fn new() -> Self {
        let base_unix_ms = SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default().as_millis() as u64;
        Clock { base_unix_ms, base: tokio::time::Instant::now() }
    }

    /// Now, in Unix milliseconds.
    pub fn now_ms(&self) -> u64 {
        self.base_unix_ms + tokio::time::Instant::now().saturating_duration_since(self.base).as_millis() as u64
    }

    /// `now + d` in Unix milliseconds (saturating).
    pub fn after_ms(&self, d: Duration) -> u64 {
        self.now_ms().saturating_add(d.as_millis().min(u128::from(u64::MAX)) as u64)
    }
}
