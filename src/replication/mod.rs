//! Replicas and replication (R10–R17, R44).
//!
//! Every member holds the replica of the member before it in join order (the Raft state's
//! `replica_of`). The replica lives in a store of its own ([`Replicator::replica`]), limited
//! to `--cache-size` like the active store.
//!
//! ```text
//!  owner A (active)                                  holder B = replica_of(A)
//!  PUT k ─ lock bucket ─ apply ─┬─ sync:  POST /internal/replicate/b ──▶ fence, apply ─┐
//!                               │         ◀──────────────── 204 ──────────────────────┘
//!                               │  2xx to the client only now; on failure the item is removed
//!                               │  again and the client gets 503 replication_failed
//!                               └─ async: queue ─▶ drainer, batches in order ─▶ the same endpoint
//! ```
//!
//! # Attachment
//! A replica bucket is fed by changes only once it holds a snapshot of the active bucket.
//! The owner records per bucket the holder that acknowledged a snapshot (`attached`); the
//! holder records per bucket the owner whose snapshot it holds (`sources`). The owner sends a
//! snapshot (under the bucket lock, so no write slips between the snapshot and the next change)
//! when the holder changed, when the holder answers `412` (it has no snapshot), and eagerly from
//! a background task for every bucket it owns ([`Replicator::attach_all`]).
//!
//! # Fencing
//! The holder applies a request only if, in its map at least as new as the sender's, the
//! sender owns the bucket and the holder is the sender's replica; otherwise `409`. So a node
//! that lost a bucket (it was paused, partitioned, failed) cannot get a write acknowledged in
//! sync mode: its replica refuses, and the write is undone.
//!
//! # What travels
//! Deletes travel like writes; evictions go through the queue in both modes (the replica
//! store also evicts by itself at its own limit); expirations need nothing: items carry their
//! absolute expiry and both stores sweep them. Requests carry an increasing sequence number:
//! the holder refuses one older than the last it applied from the same sender.
//!
//! # Invariants
//! - In sync mode, every acknowledged write of an attached bucket is in the replica before the
//!   client sees the 2xx.
//! - A replica bucket is promoted (`NodeFailed`, `HandOver`) only from a snapshot of the node
//!   the Raft state names; otherwise the bucket is reported lost, never served empty.
//!
//! # Layout
//! - `mod.rs`: the [`Replicator`], sending and the background tasks.
//! - `receive.rs`: the holder's endpoint.
//! - `follow.rs`: what the holder does when the map changes: promotion, cleanup.
//! - `handover.rs`: a leaving member hands its buckets to its replica holder (R18).

pub mod follow;
pub mod handover;
mod receive;

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use parking_lot::Mutex;
use shoal_raft::{BucketId, ClusterState, ControlPlane, NodeId, ReplicationMode, BUCKET_COUNT};
use tokio::sync::{MutexGuard, Notify};
use tokio::time::Instant;

use crate::bucket::{change_body, phase_of, LocalFacts, Phase, WritePlan};
use crate::cache::{CacheStore, Change, ExportedItem};
use crate::error::DataError;
use crate::peer::Peers;
use crate::transfer::frame::{end_frame, item_frames, HEADER};
use crate::transport::{CallError, ReplicaAnswer, Replicate};

/// How long a holder's newer map may take to reach this node before a refused write fails.
const CATCH_UP: Duration = Duration::from_secs(2);
/// How many queued changes the async drainer sends per round.
const BATCH: usize = 512;
/// The async queue's bound; past it the queue is dropped and the buckets re-attached.
const QUEUE_LIMIT: usize = 200_000;
/// How often the background attacher looks for buckets without a replica.
const ATTACH_EVERY: Duration = Duration::from_millis(500);

/// The member holding a bucket's replica, as the writer sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Holder {
    /// Its id.
    pub id: NodeId,
    /// Its peer address.
    pub peer_addr: String,
    /// The writer's map version.
    pub map_version: u64,
    /// The bucket's move epoch in that map: an attachment counts only for the ownership
    /// period it was made in (a bucket that left and came back is sent whole again).
    pub epoch: u64,
}

/// A change waiting in the async queue.
struct Queued {
    bucket: BucketId,
    holder: Holder,
    change: Change,
    at: Instant,
}

/// Counters shown in `GET /v1/cluster` and the metrics.
#[derive(Debug, Default)]
pub struct ReplicationStats {
    /// Changes the replica acknowledged.
    pub sent: AtomicU64,
    /// Requests that failed.
    pub failures: AtomicU64,
    /// Bucket snapshots sent.
    pub snapshots: AtomicU64,
    /// Writes undone because the replica did not apply them (sync).
    pub undone: AtomicU64,
}

/// This node's side of replication: as an active (sending) and as a holder (receiving).
pub struct Replicator {
    me: NodeId,
    control: ControlPlane,
    active: Arc<CacheStore>,
    replica: Arc<CacheStore>,
    facts: Arc<LocalFacts>,
    peers: Peers,
    /// Owner side: the holder that acknowledged a snapshot of each bucket (0: none).
    attached: Vec<AtomicU64>,
    /// The move epoch each attachment was made in (see [`Holder::epoch`]).
    attached_epoch: Vec<AtomicU64>,
    /// Holder side: the owner whose snapshot each replica bucket holds (0: none).
    sources: Vec<AtomicU64>,
    /// Holder side, per bucket: the sender and sequence number of the last request applied;
    /// a request with an older number from the same sender (held up in the network after
    /// its sender gave up) is refused, so it cannot overwrite newer data.
    applied: Vec<Mutex<(NodeId, u64)>>,
    /// Sender side: numbers every request, increasing across restarts (starts at the clock).
    seq: AtomicU64,
    queue: Mutex<VecDeque<Queued>>,
    /// Changes taken off the queue by the drainer and not acknowledged yet.
    sending: AtomicU64,
    wake: Notify,
    /// Counters.
    pub stats: ReplicationStats,
}

impl Replicator {
    /// A replicator over `active`, with a replica store of `limit_bytes`, sending through
    /// `peers`; its request numbers start at `first_seq` (they must increase across restarts:
    /// the clock in microseconds).
    pub fn new(
        control: ControlPlane,
        active: Arc<CacheStore>,
        limit_bytes: u64,
        facts: Arc<LocalFacts>,
        peers: Peers,
        first_seq: u64,
    ) -> Arc<Self> {
        let replica = Arc::new(active.sibling(limit_bytes));
        Arc::new(Replicator {
            me: control.node_id(),
            control,
            active,
            replica,
            facts,
            peers,
            attached: (0..BUCKET_COUNT).map(|_| AtomicU64::new(0)).collect(),
            attached_epoch: (0..BUCKET_COUNT).map(|_| AtomicU64::new(0)).collect(),
            sources: (0..BUCKET_COUNT).map(|_| AtomicU64::new(0)).collect(),
            applied: (0..BUCKET_COUNT).map(|_| Mutex::new((0, 0))).collect(),
            seq: AtomicU64::new(first_seq.max(1)),
            queue: Mutex::new(VecDeque::new()),
            sending: AtomicU64::new(0),
            wake: Notify::new(),
            stats: ReplicationStats::default(),
        })
    }

    /// The replica store.
    pub fn replica(&self) -> &Arc<CacheStore> {
        &self.replica
    }

    /// Locks `bucket`: a snapshot sent under the lock falls between two writes.
    async fn lock(&self, bucket: BucketId) -> MutexGuard<'_, ()> {
        self.facts.lock(bucket).await
    }

    /// The holder a write of `plan` goes to, as this replicator tracks it.
    pub fn holder_for(&self, plan: &WritePlan) -> Option<Holder> {
        let replica = plan.replica.as_ref()?;
        Some(Holder {
            id: replica.node,
            peer_addr: replica.peer_addr.clone(),
            map_version: plan.map_version,
            epoch: plan.epoch,
        })
    }

    /// The holder of `bucket`'s replica if this node owns the bucket and one exists.
    pub fn holder_of(&self, state: &ClusterState, bucket: BucketId) -> Option<Holder> {
        if state.map.owner_of(bucket) != Some(self.me) {
            return None;
        }
        let id = state.replica_holder_of(bucket).filter(|&h| h != self.me)?;
        let peer_addr = state.member_of(id)?.peer_addr.clone();
        Some(Holder { id, peer_addr, map_version: state.map.version, epoch: state.epoch_of(bucket) })
    }

    /// Whether this node owns `bucket` but does not hold its data yet (restoring after a
    /// restart, or promoted and not installed): it must not be exported or sent to a replica,
    /// which would spread an empty bucket.
    pub fn not_held(&self, state: &ClusterState, bucket: BucketId) -> bool {
        matches!(phase_of(state, self.me, bucket, self.facts.of(bucket)), Phase::Restoring | Phase::AwaitingPromotion)
    }

    /// Sends `changes` of `bucket` (applied locally, bucket lock held) to its replica: at once
    /// in sync mode, through the queue in async mode.
    pub async fn replicate(&self, bucket: BucketId, holder: &Holder, changes: &[Change]) -> Result<(), DataError> {
        if changes.is_empty() {
            return Ok(());
        }
        match self.control.state().settings.replication {
            ReplicationMode::Async => {
                self.enqueue(bucket, holder, changes);
                Ok(())
            }
            ReplicationMode::Sync => self.send_sync(bucket, holder, changes).await.map_err(|e| {
                self.stats.failures.fetch_add(1, Ordering::Relaxed);
                tracing::debug!(bucket = bucket.0, holder = holder.id, error = %e, "replication failed");
                DataError::ReplicationFailed { holder: holder.id, detail: e }
            }),
        }
    }

    /// Counts a write undone after a failed replication.
    pub fn count_undone(&self, n: u64) {
        self.stats.undone.fetch_add(n, Ordering::Relaxed);
    }

    async fn send_sync(&self, bucket: BucketId, holder: &Holder, changes: &[Change]) -> Result<(), String> {
        if self.is_attached(bucket, holder) {
            match self.send(bucket, holder, change_body(changes), false).await.map_err(|e| e.to_string())? {
                ReplicaAnswer::Applied => {
                    self.stats.sent.fetch_add(changes.len() as u64, Ordering::Relaxed);
                    return Ok(());
                }
                ReplicaAnswer::NeedSnapshot(_) => {}
                ReplicaAnswer::Fenced { map_version, .. } => return self.refenced(bucket, holder, map_version).await,
                ReplicaAnswer::Refused(reason) => return Err(format!("the replica refused: {reason}")),
            }
        }
        // The snapshot includes the changes: they are applied locally already.
        match self.send_snapshot(bucket, holder).await {
            Err(Fenced(their_version)) => self.refenced(bucket, holder, their_version).await,
            other => other.map_err(String::from),
        }
    }

    /// The holder refused because its map is newer: catch up and, if this node still owns the
    /// bucket, send it whole to the holder the new map names (the write is in it).
    async fn refenced(&self, bucket: BucketId, holder: &Holder, their_version: u64) -> Result<(), String> {
        let version = their_version.max(holder.map_version + 1);
        self.control.wait_for_state(CATCH_UP, |s| s.map.version >= version).await;
        let state = self.control.state();
        match self.holder_of(&state, bucket) {
            Some(next) if next.id != holder.id || next.map_version > holder.map_version => {
                self.send_snapshot(bucket, &next).await.map_err(String::from)
            }
            None if state.map.owner_of(bucket) == Some(self.me) => Ok(()),
            _ => Err(format!("node {} refused the write: this node no longer owns bucket {bucket}", holder.id)),
        }
    }

    /// Sends the whole of `bucket` (its lock held by the caller) and records the attachment.
    async fn send_snapshot(&self, bucket: BucketId, holder: &Holder) -> Result<(), SnapshotError> {
        let (items, counter) = self.active.snapshot(bucket);
        let mut body = BytesMut::from(&HEADER[..]);
        for item in &items {
            for f in item_frames(item) {
                body.extend_from_slice(&f);
            }
        }
        body.extend_from_slice(&end_frame(counter, items.len() as u64));
        match self.send(bucket, holder, body.freeze(), true).await.map_err(|e| SnapshotError::Failed(e.to_string()))? {
            ReplicaAnswer::Applied => {
                // The epoch first: whoever sees the id sees its epoch.
                self.attached_epoch[bucket.index()].store(holder.epoch, Ordering::Release);
                self.attached[bucket.index()].store(holder.id, Ordering::Release);
                self.stats.snapshots.fetch_add(1, Ordering::Relaxed);
                Ok(())
            }
            ReplicaAnswer::Fenced { map_version, .. } => Err(Fenced(map_version)),
            ReplicaAnswer::NeedSnapshot(reason) | ReplicaAnswer::Refused(reason) => {
                Err(SnapshotError::Failed(format!("the replica refused the bucket snapshot: {reason}")))
            }
        }
    }

    /// Sends one request to `holder`.
    async fn send(
        &self,
        bucket: BucketId,
        holder: &Holder,
        body: Bytes,
        snapshot: bool,
    ) -> Result<ReplicaAnswer, CallError> {
        let request = Replicate {
            bucket,
            from: self.me,
            map_version: holder.map_version,
            snapshot,
            seq: self.seq.fetch_add(1, Ordering::Relaxed),
            body,
        };
        self.peers.replicate(&holder.peer_addr, request).await
    }

    /// Queues `changes` of `bucket` for its holder (async replication and evictions).
    pub fn enqueue(&self, bucket: BucketId, holder: &Holder, changes: &[Change]) {
        // Not attached yet: the attacher's snapshot (taken under the bucket lock) will carry it.
        if !self.is_attached(bucket, holder) {
            return;
        }
        let mut queue = self.queue.lock();
        if queue.len() + changes.len() > QUEUE_LIMIT {
            tracing::warn!(holder = holder.id, "replication queue full; replicas are rebuilt from snapshots");
            queue.clear();
            drop(queue);
            self.detach_all();
            return;
        }
        let at = Instant::now();
        for c in changes {
            queue.push_back(Queued { bucket, holder: holder.clone(), change: c.clone(), at });
        }
        drop(queue);
        self.wake.notify_one();
    }

    /// The replica of `bucket` if it is a snapshot of `owner`'s (a restarted owner restores
    /// from it).
    pub fn replica_snapshot(&self, bucket: BucketId, owner: NodeId) -> Option<(Vec<ExportedItem>, u64)> {
        let source = self.sources.get(bucket.index())?;
        (source.load(Ordering::Acquire) == owner).then(|| self.replica.snapshot(bucket))
    }

    /// Whether `holder` acknowledged a snapshot of `bucket` in the current ownership period.
    fn is_attached(&self, bucket: BucketId, holder: &Holder) -> bool {
        self.attached[bucket.index()].load(Ordering::Acquire) == holder.id
            && self.attached_epoch[bucket.index()].load(Ordering::Acquire) == holder.epoch
    }

    /// Forgets that `bucket`'s replica holds a snapshot: the next change sends it whole.
    pub fn detach(&self, bucket: BucketId) {
        self.attached[bucket.index()].store(0, Ordering::Release);
    }

    /// Forgets every snapshot `holder` acknowledged (it restarted with an empty store).
    pub fn detach_holder(&self, holder: NodeId) {
        for a in &self.attached {
            let _ = a.compare_exchange(holder, 0, Ordering::AcqRel, Ordering::Acquire);
        }
    }

    fn detach_all(&self) {
        for a in &self.attached {
            a.store(0, Ordering::Release);
        }
    }

    /// Depth of the async queue (changes in flight to the holder included) and the age of its
    /// oldest queued change.
    pub fn queue_lag(&self) -> (usize, Duration) {
        let queue = self.queue.lock();
        let depth = queue.len() + self.sending.load(Ordering::Acquire) as usize;
        (depth, queue.front().map(|q| q.at.elapsed()).unwrap_or_default())
    }

    /// Drains the async queue forever: batches of changes, in order, one request per run of
    /// one bucket. A failed request detaches the buckets (they are re-sent as snapshots).
    pub async fn drain_queue(self: Arc<Self>) {
        loop {
            let batch: Vec<Queued> = {
                let mut queue = self.queue.lock();
                let n = queue.len().min(BATCH);
                self.sending.store(n as u64, Ordering::Release);
                queue.drain(..n).collect()
            };
            if batch.is_empty() {
                let _ = tokio::time::timeout(Duration::from_millis(200), self.wake.notified()).await;
                continue;
            }
            let mut i = 0;
            while i < batch.len() {
                let (bucket, holder) = (batch[i].bucket, &batch[i].holder);
                let mut j = i;
                while j < batch.len() && batch[j].bucket == bucket && batch[j].holder == *holder {
                    j += 1;
                }
                let changes: Vec<Change> = batch[i..j].iter().map(|q| q.change.clone()).collect();
                match self.send(bucket, holder, change_body(&changes), false).await {
                    Ok(ReplicaAnswer::Applied) => {
                        self.stats.sent.fetch_add(changes.len() as u64, Ordering::Relaxed);
                    }
                    other => {
                        self.stats.failures.fetch_add(1, Ordering::Relaxed);
                        tracing::debug!(bucket = bucket.0, holder = holder.id, answer = ?other, "async replication failed");
                        let _ = self.attached[bucket.index()].compare_exchange(
                            holder.id,
                            0,
                            Ordering::AcqRel,
                            Ordering::Acquire,
                        );
                    }
                }
                i = j;
            }
            self.sending.store(0, Ordering::Release);
        }
    }

    /// Attaches, forever, every bucket this node owns whose replica holder has no snapshot.
    pub async fn attach_all(self: Arc<Self>) {
        loop {
            tokio::time::sleep(ATTACH_EVERY).await;
            let state = self.control.state();
            for bucket in BucketId::all() {
                let Some(holder) = self.holder_of(&state, bucket) else { continue };
                if self.is_attached(bucket, &holder) || self.not_held(&state, bucket) {
                    continue;
                }
                let _lock = self.lock(bucket).await;
                // Re-check under the lock: the map may have moved on.
                if self.holder_of(&self.control.state(), bucket).as_ref() != Some(&holder) {
                    continue;
                }
                if let Err(e) = self.send_snapshot(bucket, &holder).await.map_err(String::from) {
                    self.stats.failures.fetch_add(1, Ordering::Relaxed);
                    tracing::debug!(bucket = bucket.0, holder = holder.id, error = %e, "cannot attach the replica yet");
                    break;
                }
            }
        }
    }

    /// How many buckets this node owns whose replica holds a snapshot, of how many it owns.
    pub fn attached_count(&self, state: &ClusterState) -> (usize, usize) {
        let mut owned = 0;
        let mut attached = 0;
        for bucket in BucketId::all() {
            if let Some(holder) = self.holder_of(state, bucket) {
                owned += 1;
                if self.is_attached(bucket, &holder) {
                    attached += 1;
                }
            }
        }
        (attached, owned)
    }
}

/// Why a snapshot did not land.
enum SnapshotError {
    /// The holder's map (this version) says the sender does not own the bucket or it is not
    /// the replica.
    Fenced(u64),
    /// Anything else.
    Failed(String),
}
use SnapshotError::Fenced;

impl From<SnapshotError> for String {
    fn from(e: SnapshotError) -> String {
        match e {
            Fenced(v) => format!("fenced by the replica's map (version {v})"),
            SnapshotError::Failed(e) => e,
        }
    }
}
