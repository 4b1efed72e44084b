//! The async queue: changes waiting to be sent to their holder (async replication, evictions),
//! bounded in changes and in bytes, taken off in batches.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use parking_lot::Mutex;
use shoal_raft::BucketId;
use tokio::sync::Notify;
use tokio::time::Instant;

use super::Holder;
use crate::cache::Change;

/// How many queued changes one batch takes.
const BATCH: usize = 512;
/// The bound in changes; past it the queue is dropped and the buckets re-attached.
const LIMIT: usize = 200_000;
/// The bound in bytes (keys and values), likewise: a queue of large values must not take the
/// process past its memory limit.
const LIMIT_BYTES: u64 = 32 << 20;

/// A change waiting in the queue.
pub(super) struct Queued {
    pub bucket: BucketId,
    pub holder: Holder,
    pub change: Change,
    pub at: Instant,
}

/// The queue, and what is in flight from it.
#[derive(Default)]
pub(super) struct Queue {
    items: Mutex<VecDeque<Queued>>,
    /// The bytes the queued changes hold (changed under the items' lock).
    bytes: AtomicU64,
    /// Changes taken off and not acknowledged yet.
    sending: AtomicU64,
    /// When the oldest change of the batch being sent was queued.
    sending_since: Mutex<Option<Instant>>,
    queued: Notify,
}

/// The bytes a queued change holds.
fn change_bytes(change: &Change) -> u64 {
    match change {
        Change::Put(item) => (item.key.len() + item.value.len()) as u64,
        Change::Delete { key, .. } | Change::Expire { key, .. } => key.len() as u64 + 16,
    }
}

impl Queue {
    /// Queues `changes` of `bucket` for `holder` and wakes the sender; when they would take
    /// the queue past a bound, empties it instead and answers false (every bucket must then
    /// be sent whole again).
    pub fn push(&self, bucket: BucketId, holder: &Holder, changes: &[Change]) -> bool {
        let mut items = self.items.lock();
        let bytes: u64 = changes.iter().map(change_bytes).sum();
        let queued = self.bytes.load(Ordering::Acquire);
        if items.len() + changes.len() > LIMIT || queued + bytes > LIMIT_BYTES {
            items.clear();
            self.bytes.store(0, Ordering::Release);
            return false;
        }
        self.bytes.fetch_add(bytes, Ordering::AcqRel);
        let at = Instant::now();
        for c in changes {
            items.push_back(Queued { bucket, holder: holder.clone(), change: c.clone(), at });
        }
        drop(items);
        self.queued.notify_one();
        true
    }

    /// Woken when changes are queued.
    pub fn notified(&self) -> &Notify {
        &self.queued
    }

    /// Whether changes wait.
    pub fn waiting(&self) -> bool {
        !self.items.lock().is_empty()
    }

    /// Takes the next batch off, in queue order, as in flight until [`Self::sent`].
    pub fn take(&self) -> Vec<Queued> {
        let mut items = self.items.lock();
        let n = items.len().min(BATCH);
        self.sending.store(n as u64, Ordering::Release);
        *self.sending_since.lock() = items.front().map(|q| q.at);
        let batch: Vec<Queued> = items.drain(..n).collect();
        let bytes: u64 = batch.iter().map(|q| change_bytes(&q.change)).sum();
        let _ = self.bytes.fetch_update(Ordering::AcqRel, Ordering::Acquire, |b| Some(b.saturating_sub(bytes)));
        batch
    }

    /// The batch taken last is sent (or failed).
    pub fn sent(&self) {
        self.sending.store(0, Ordering::Release);
        *self.sending_since.lock() = None;
    }

    /// The changes queued or in flight, and the age of the oldest queued one.
    pub fn lag(&self) -> (usize, Duration) {
        let items = self.items.lock();
        let depth = items.len() + self.sending.load(Ordering::Acquire) as usize;
        (depth, items.front().map(|q| q.at.elapsed()).unwrap_or_default())
    }

    /// When the oldest change queued or in flight was queued.
    pub fn oldest(&self) -> Option<Instant> {
        let queued = self.items.lock().front().map(|q| q.at);
        let sending = *self.sending_since.lock();
        [queued, sending].into_iter().flatten().min()
    }
}
