//! A node's transfer progress: what it has pulled, what it has sent, and when it last did
//! anything (the leader's stuck detector asks for that).

use tokio::time::Instant;

use parking_lot::Mutex;
use shoal_http_api::types::TransferStatus;

/// A round that received less than this says little about the transfer rate.
const MEASURABLE_BYTES: u64 = 1 << 20;

/// Asks a node for its transfer progress (the leader's stuck detector, and mirrors, ask).
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct AskProgress;

impl crate::transport::Endpoint for AskProgress {
    type Answer = crate::transport::wire::Json<TransferStatus>;
    const ID: u8 = crate::transport::wire::id::TRANSFER_STATUS;
}

/// Progress counters, shared by the puller, the exporter and the status endpoint.
#[derive(Debug)]
pub struct Progress {
    inner: Mutex<Counters>,
}

#[derive(Debug, Clone)]
struct Counters {
    /// Buckets planned in the current round of pulls.
    total: u64,
    /// Of those, done.
    done: u64,
    /// Bytes received in the current round.
    bytes_in: u64,
    /// Bytes sent, ever.
    bytes_out: u64,
    /// Bytes received, ever.
    bytes_in_total: u64,
    /// Buckets pulled, ever.
    buckets_in_total: u64,
    /// When the current round started.
    round_started: Option<Instant>,
    /// The last time a byte moved in either direction.
    last_activity: Instant,
    /// Whether a round of pulls is running.
    active: bool,
    /// Bytes per second of the last round that moved enough to tell (a mebibyte or more).
    last_rate: Option<f64>,
}

impl Default for Progress {
    fn default() -> Self {
        Progress {
            inner: Mutex::new(Counters {
                total: 0,
                done: 0,
                bytes_in: 0,
                bytes_out: 0,
                bytes_in_total: 0,
                buckets_in_total: 0,
                round_started: None,
                last_activity: Instant::now(),
                active: false,
                last_rate: None,
            }),
        }
    }
}

impl Progress {
    /// A round of `buckets` pulls starts.
    pub fn start_round(&self, buckets: usize) {
        let mut c = self.inner.lock();
        c.total = buckets as u64;
        c.done = 0;
        c.bytes_in = 0;
        c.round_started = Some(Instant::now());
        c.last_activity = Instant::now();
        c.active = true;
    }

    /// The round is over (nothing left to pull).
    pub fn end_round(&self) {
        let mut c = self.inner.lock();
        c.active = false;
        let elapsed = c.round_started.map(|s| s.elapsed().as_secs_f64()).unwrap_or(0.0);
        if c.bytes_in >= MEASURABLE_BYTES && elapsed > 0.0 {
            c.last_rate = Some(c.bytes_in as f64 / elapsed);
        }
    }

    /// The receive rate of the last round of pulls that moved a mebibyte or more.
    pub fn measured_rate(&self) -> Option<f64> {
        self.inner.lock().last_rate
    }

    /// Bytes received.
    pub fn received(&self, n: u64) {
        let mut c = self.inner.lock();
        c.bytes_in += n;
        c.bytes_in_total += n;
        c.last_activity = Instant::now();
    }

    /// Bytes sent.
    pub fn sent(&self, n: u64) {
        let mut c = self.inner.lock();
        c.bytes_out += n;
        c.last_activity = Instant::now();
    }

    /// A bucket was pulled and flipped.
    pub fn bucket_done(&self) {
        let mut c = self.inner.lock();
        c.done += 1;
        c.buckets_in_total += 1;
        c.last_activity = Instant::now();
    }

    /// The status of `node_id`.
    pub fn status(&self, node_id: u64) -> TransferStatus {
        let c = self.inner.lock().clone();
        let elapsed = c.round_started.map(|s| s.elapsed().as_secs_f64()).unwrap_or(0.0);
        TransferStatus {
            node_id,
            active: c.active,
            buckets_done: c.done,
            buckets_total: c.total,
            bytes: c.bytes_in,
            rate_bytes_per_sec: if elapsed > 0.0 { c.bytes_in as f64 / elapsed } else { 0.0 },
            idle_seconds: c.last_activity.elapsed().as_secs_f64(),
            buckets_pulled_total: c.buckets_in_total,
            bytes_sent_total: c.bytes_out,
            bytes_received_total: c.bytes_in_total,
        }
    }
}
