//! Replicas and replication.
//!
//! Every member's writes reach the replica of its buckets on another member. The replica
//! lives in a store of its own ([`ReplicaHolder::replica`]), limited to `--cache-size` like the
//! active store.
//!
//! ```text
//!  owner A (active)                                  holder H (the write plan names it)
//!  PUT k ─ permit ─ apply ─┬─ sync:  H's lane ─ peer link (or HTTP) ─────▶ per write: fence, apply
//!                          │         ◀──────────── each write's answer ────────────┘
//!                          │  2xx to the client only now; on failure the write is taken back
//!                          │  and the client gets 503 replication_failed
//!                          └─ async: queue ─▶ per bucket in order ─▶ H's lane, the same endpoint
//! ```
//!
//! Sync writes of different buckets waiting for the same holder at once travel in one
//! exchange (`batch.rs`: a lone write goes at once, alone); the holder answers each as if it
//! came alone, so a batch may half fail and each writer sees its own answer. A bucket
//! snapshot goes alone. The exchanges travel on the transport's peer link to the holder when
//! one is open (`transport::link`: one long-lived connection, many exchanges in flight), else
//! as HTTP requests (`POST /internal/replicate`, `/internal/replicate/{bucket}`).
//!
//! # Which holder
//! The holder of a member's *complete* replica is recorded in Raft (`replica_holders`): it has
//! every write the member acknowledged, and inherits the member's buckets if it fails. When a
//! membership change makes join order name another holder, the member keeps writing to the
//! complete one (a write fails unless it got there) and also to the new one for every bucket
//! already sent to it whole; once the new one has every bucket, the member pauses its writes
//! for a moment and commits `ReplicaMoved`, and the new one is the complete one from then on
//! (the reconciler does this, `crate::reconcile`). Without a complete holder (right after the
//! first join, or after the holder left or failed), writes go to the holder join order names.
//!
//! # Attachment
//! A replica bucket is fed by changes only once it holds a snapshot of the active bucket. The
//! owner records per bucket the holders that acknowledged a snapshot, in the bucket's move
//! epoch and the holder's holding period (`LocalFacts::attached`; a holder that stopped
//! holding this node's replica dropped its copies, and is in a new period if it holds it
//! again); the holder records per bucket the owner whose snapshot it holds
//! (`LocalFacts::copies`). The owner sends a snapshot (under the bucket lock, so no write slips
//! between the snapshot and the next change) when the holder has none, when it answers `412`,
//! and from the reconciler for every bucket it serves.
//!
//! # Fencing
//! The holder applies a request only if, in its map at least as new as the sender's, the
//! sender owns the bucket and the holder is the sender's holder (complete, or named by join
//! order); otherwise `409`. So a node that lost a bucket (it was paused, partitioned, failed)
//! cannot get a write acknowledged in sync mode: its replica refuses, and the write is undone.
//!
//! # What travels
//! Deletes travel like writes; evictions go through the queue in both modes (the replica
//! store also evicts by itself at its own limit). The owner decides expirations and its
//! replica follows: items carry their absolute expiry and both stores sweep them, and the
//! owner's reads that move a sliding expiry into another tenth of its window reach the replica
//! through the queue too (`Change::Expire`, a tenth of the window ahead of the owner's, at
//! most once per item per tenth of its window), so an item its reads keep alive is alive on
//! the replica, which then serves it after a failover. Requests carry an increasing sequence number:
//! the holder refuses one older than the last it applied from the same sender.
//!
//! # Layout
//! - `mod.rs`: the [`Replicator`], this node's side as an owner: sending, attaching. What
//!   both sides know per bucket (the attachments, whose copy each replica bucket is) is the
//!   bucket core's (`crate::phase::LocalFacts`), where the reconciler and the write path read
//!   it too.
//! - `queue.rs`: the async queue, bounded, taken off in batches.
//! - `reports.rs`: what owners say of their replicas, for mirror reads.
//! - `batch.rs`: the lanes that batch writes per holder.
//! - `lanes.rs`: [`lanes::Lanes`], requests to one peer that wait at the same time sent in one
//!   exchange.
//! - `holder.rs`: the [`ReplicaHolder`], this node's side as a holder: the replica store,
//!   the requests applied to it, promotion, drops, mirror reads; its endpoints.
//! - `copy_back.rs`: the copy a restarted owner gets its buckets back from.

mod batch;
mod copy_back;
mod holder;
mod lanes;
mod queue;
mod reports;

pub use holder::{register, ReplicaAnswer, ReplicaHolder, Replicate, ReplicateBatch};
pub use reports::ReplicaReport;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use shoal_raft::{BucketId, ClusterState, ControlPlane, NodeId, ReplicationMode};
use tokio::sync::{MutexGuard, Notify};

use crate::cache::{CacheStore, Change};
use crate::error::{DataError, ReplicaError};
use crate::peer::Peers;
use crate::phase::{Attachment, LocalFacts, Recipient, WritePlan};
use crate::transport::frame::{change_body, snapshot_body};
use crate::transport::{CallError, PEER_CALL_TIMEOUT};
use queue::Queue;

/// How long a holder's newer map may take to reach this node before a refused write fails.
const CATCH_UP: Duration = Duration::from_secs(2);
/// A member holding a bucket's replica, as the writer sees it.
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
    /// The holding period the holder is in: an attachment counts only within it (a holder
    /// that stopped holding this node's replica dropped its copies).
    pub period: u64,
}

impl Holder {
    fn of(recipient: &Recipient, plan: &WritePlan) -> Self {
        Holder {
            id: recipient.node,
            peer_addr: recipient.peer_addr.clone(),
            map_version: plan.map_version,
            epoch: plan.epoch,
            period: recipient.period,
        }
    }
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
    /// Bytes of the bucket snapshots sent.
    pub snapshot_bytes: AtomicU64,
    /// Writes undone because the replica did not apply them (sync).
    pub undone: AtomicU64,
}

/// The attachment a snapshot acknowledged by `holder` records.
fn attachment(holder: &Holder) -> Attachment {
    Attachment { holder: holder.id, epoch: holder.epoch, period: holder.period }
}

/// How many bucket snapshots an attach job has in flight at once.
const ATTACH_IN_FLIGHT: usize = 8;

/// This node's side of replication as an owner: it sends its writes to the holders of its
/// replica (the holder's side is [`ReplicaHolder`]).
pub struct Replicator {
    me: NodeId,
    control: ControlPlane,
    active: Arc<CacheStore>,
    facts: Arc<LocalFacts>,
    peers: Peers,
    /// Owner side: writes in flight to one holder at once travel together.
    batcher: batch::Batcher,
    /// Sender side: numbers every request, increasing across restarts (starts at the clock).
    seq: AtomicU64,
    /// Sender side: the async queue.
    queue: Queue,
    /// The holder a `ReplicaMoved` of this node was proposed for, while it may still commit
    /// (0: none): a write that misses that holder fails instead of only detaching there.
    moving_to: AtomicU64,
    /// Counters.
    pub stats: ReplicationStats,
    /// This node's side as a holder of other members' replicas.
    pub holder: Arc<ReplicaHolder>,
}

impl Replicator {
    /// A replicator of `active`'s writes, sending through `peers`, with a holder whose
    /// replica store takes `limit_bytes`; its request numbers start at `first_seq` (they must
    /// increase across restarts: the clock in microseconds).
    pub fn new(
        control: ControlPlane,
        active: Arc<CacheStore>,
        limit_bytes: u64,
        facts: Arc<LocalFacts>,
        peers: Peers,
        first_seq: u64,
    ) -> Arc<Self> {
        Arc::new(Replicator {
            me: control.node_id(),
            holder: ReplicaHolder::new(control.clone(), active.clone(), limit_bytes, facts.clone()),
            control,
            active,
            facts,
            batcher: batch::batcher(peers.clone()),
            peers,
            seq: AtomicU64::new(first_seq.max(1)),
            queue: Queue::default(),
            moving_to: AtomicU64::new(0),
            stats: ReplicationStats::default(),
        })
    }

    /// Locks `bucket`: a snapshot sent under the lock falls between two writes.
    async fn lock(&self, bucket: BucketId) -> MutexGuard<'_, ()> {
        self.facts.lock(bucket).await
    }

    /// The holder every write of `plan` must reach.
    pub fn holder_for(&self, plan: &WritePlan) -> Option<Holder> {
        plan.replica.as_ref().map(|r| Holder::of(r, plan))
    }

    /// The holder join order names, when it is not yet the complete one: writes of buckets
    /// already sent to it whole reach it too.
    pub fn next_holder_for(&self, plan: &WritePlan) -> Option<Holder> {
        plan.next_replica.as_ref().map(|r| Holder::of(r, plan))
    }

    /// Which next holder `plan`'s writes of `bucket` go to besides `holder`: the one join
    /// order names, once it has the bucket whole.
    pub fn next_sent_to(&self, bucket: BucketId, holder: &Holder, plan: &WritePlan) -> Option<Holder> {
        self.next_holder_for(plan).filter(|n| n.id != holder.id && self.is_attached(bucket, n))
    }

    /// Sends `changes` of `bucket` (applied locally, bucket lock held) to its replica: to
    /// `holder` (at once in sync mode, failing if it did not apply them; through the queue in
    /// async mode), and to `next` ([`Self::next_sent_to`]; a failure there only detaches it,
    /// unless it may become the complete holder any moment).
    pub async fn replicate(
        &self,
        bucket: BucketId,
        holder: &Holder,
        next: Option<&Holder>,
        changes: &[Change],
    ) -> Result<(), DataError> {
        if changes.is_empty() {
            return Ok(());
        }
        match self.control.state().settings.replication {
            ReplicationMode::Async => {
                self.enqueue(bucket, holder, changes);
                if let Some(next) = next {
                    self.enqueue(bucket, next, changes);
                }
                Ok(())
            }
            ReplicationMode::Sync => {
                let also = async {
                    let next = next?;
                    let e = self.send_changes(bucket, next, changes).await.err()?;
                    tracing::debug!(bucket = bucket.0, holder = next.id, error = %e, "the next holder missed a write; it gets the bucket whole again");
                    self.facts.attached().detach_at(bucket, next.id);
                    // It may become the complete holder any moment: the write must not count.
                    (self.moving_to.load(Ordering::Acquire) == next.id).then_some((next.id, e))
                };
                let (sent, missed) = tokio::join!(self.send_sync(bucket, holder, changes), also);
                let failed = match (sent, missed) {
                    (Err(cause), _) => Some((holder.id, cause)),
                    (Ok(()), missed) => missed,
                };
                match failed {
                    None => Ok(()),
                    Some((holder, cause)) => {
                        self.stats.failures.fetch_add(1, Ordering::Relaxed);
                        tracing::debug!(bucket = bucket.0, holder, error = %cause, "replication failed");
                        Err(DataError::ReplicationFailed { holder, cause })
                    }
                }
            }
        }
    }

    /// After a sync write that failed was taken back here, brings the `holders` that may have
    /// applied it to the bucket as it is now, with a snapshot (the caller holds the bucket
    /// lock). A request of the write still on its way is refused once the snapshot is there
    /// (it is older). Answers the first holder that may still keep the write: its snapshot did
    /// not land.
    pub async fn take_back(&self, bucket: BucketId, holders: &[&Holder]) -> Result<(), NodeId> {
        for h in holders {
            if let Err(e) = self.send_snapshot(bucket, h).await {
                tracing::debug!(bucket = bucket.0, holder = h.id, error = %e, "a write taken back may stay at the replica");
                return Err(h.id);
            }
        }
        Ok(())
    }

    /// Exchanges with holders that carried changes (not snapshots) so far; a batch of many
    /// writes counts once.
    pub fn exchanges(&self) -> u64 {
        self.batcher.exchanges()
    }

    /// Records that `ReplicaMoved { holder }` is proposed (0: no proposal may commit any more).
    pub fn set_moving_to(&self, holder: NodeId) {
        self.moving_to.store(holder, Ordering::Release);
    }

    /// Counts a write undone after a failed replication.
    pub fn count_undone(&self, n: u64) {
        self.stats.undone.fetch_add(n, Ordering::Relaxed);
    }

    /// Sends `changes` to a holder that has the bucket; any answer but "applied" is a failure.
    async fn send_changes(&self, bucket: BucketId, holder: &Holder, changes: &[Change]) -> Result<(), ReplicaError> {
        match self.send(bucket, holder, change_body(changes), false).await? {
            ReplicaAnswer::Applied => {
                self.stats.sent.fetch_add(changes.len() as u64, Ordering::Relaxed);
                Ok(())
            }
            other => Err(refusal(other)),
        }
    }

    async fn send_sync(&self, bucket: BucketId, holder: &Holder, changes: &[Change]) -> Result<(), ReplicaError> {
        if self.is_attached(bucket, holder) {
            match self.send(bucket, holder, change_body(changes), false).await? {
                ReplicaAnswer::Applied => {
                    self.stats.sent.fetch_add(changes.len() as u64, Ordering::Relaxed);
                    return Ok(());
                }
                ReplicaAnswer::NeedSnapshot(_) => {}
                ReplicaAnswer::Fenced { map_version, .. } => return self.refenced(bucket, holder, map_version).await,
                ReplicaAnswer::Refused(reason) => return Err(ReplicaError::Refused(reason)),
            }
        }
        // The snapshot includes the changes: they are applied locally already.
        match self.send_snapshot(bucket, holder).await {
            Err(ReplicaError::Fenced(their_version)) => self.refenced(bucket, holder, their_version).await,
            other => other,
        }
    }

    /// The holder refused because its map is newer: catch up and, if this node still owns the
    /// bucket, send it whole to the holder the new map names (the write is in it).
    async fn refenced(&self, bucket: BucketId, holder: &Holder, their_version: u64) -> Result<(), ReplicaError> {
        let version = their_version.max(holder.map_version + 1);
        self.control.wait_for_state(CATCH_UP, |s| s.map.version >= version).await;
        let state = self.control.state();
        let (required, _) = self.holders_of(&state, bucket);
        match required {
            Some(next) if next.id != holder.id || next.map_version > holder.map_version => {
                self.send_snapshot(bucket, &next).await
            }
            None if state.map.owner_of(bucket) == Some(self.me) => Ok(()),
            // Caught up, and the map gives the bucket to another node: it moved on.
            _ if state.map.version >= version && state.map.owner_of(bucket) != Some(self.me) => {
                Err(ReplicaError::NoLongerOwner { holder: holder.id, bucket })
            }
            // The holder's newer map did not arrive in time: no verdict on the bucket.
            _ => Err(ReplicaError::Fenced(their_version)),
        }
    }

    /// Sends `bucket` whole to `holder`, under the bucket lock (the caller holds it).
    async fn send_snapshot(&self, bucket: BucketId, holder: &Holder) -> Result<(), ReplicaError> {
        let body = snapshot_body(&self.active, bucket);
        let bytes = body.len() as u64;
        match self.send(bucket, holder, body, true).await? {
            ReplicaAnswer::Applied => {
                self.attach_at(bucket, holder);
                self.stats.snapshots.fetch_add(1, Ordering::Relaxed);
                self.stats.snapshot_bytes.fetch_add(bytes, Ordering::Relaxed);
                Ok(())
            }
            other => Err(refusal(other)),
        }
    }

    /// Sends `bucket` whole to the member that inherits this node's buckets (the holder of
    /// its complete replica, else the one join order names), under the bucket lock (the
    /// caller holds it); nothing to do when there is no other member. A lost bucket given
    /// back is sent there before the cluster counts it found: if this process dies before
    /// its last server has let go of it, the copy outlives it (a restart restores it from
    /// there, a failover installs it). Answers the heir and its holding period then.
    pub async fn seed_heir(&self, bucket: BucketId) -> Result<Option<(NodeId, u64)>, ReplicaError> {
        let state = self.control.state();
        let Some(heir) = state.heir_of(self.me).filter(|&h| h != self.me) else { return Ok(None) };
        let Some(member) = state.member_of(heir) else { return Ok(None) };
        let period = state.replica_period(self.me, heir).unwrap_or(0);
        let holder = Holder {
            id: heir,
            peer_addr: member.peer_addr.clone(),
            map_version: state.map.version,
            epoch: state.epoch_of(bucket),
            period,
        };
        self.send_snapshot(bucket, &holder).await?;
        Ok(Some((heir, period)))
    }

    /// Sends one request to `holder`: a snapshot alone, changes with the other writes in
    /// flight to the same holder (`batch`).
    async fn send(
        &self,
        bucket: BucketId,
        holder: &Holder,
        body: Bytes,
        snapshot: bool,
    ) -> Result<ReplicaAnswer, CallError> {
        let request = self.request(bucket, holder, body, snapshot);
        if snapshot {
            self.peers.ask(&holder.peer_addr, request, PEER_CALL_TIMEOUT).await
        } else {
            self.batcher.send(&holder.peer_addr, request).await
        }
    }

    /// A request to `holder`, numbered.
    fn request(&self, bucket: BucketId, holder: &Holder, body: Bytes, snapshot: bool) -> Replicate {
        Replicate {
            bucket,
            from: self.me,
            map_version: holder.map_version,
            snapshot,
            seq: self.seq.fetch_add(1, Ordering::Relaxed),
            body,
        }
    }

    /// Queues `changes` of `bucket` for `holder` (async replication and evictions).
    pub fn enqueue(&self, bucket: BucketId, holder: &Holder, changes: &[Change]) {
        // Not attached yet: the snapshot that attaches it (taken under the bucket lock) will
        // carry the changes.
        if !self.is_attached(bucket, holder) {
            return;
        }
        if !self.queue.push(bucket, holder, changes) {
            tracing::warn!(holder = holder.id, "replication queue full; replicas are rebuilt from snapshots");
            self.facts.attached().detach_all();
        }
    }

    /// Woken when changes are queued.
    pub fn queued(&self) -> &Notify {
        self.queue.notified()
    }

    /// Whether the queue has changes to send.
    pub fn queue_waiting(&self) -> bool {
        self.queue.waiting()
    }

    /// Sends one batch of the async queue: per bucket its changes in the order they were
    /// queued (buckets are independent, so only the order within a bucket matters), all at
    /// once, through the holders' lanes. A bucket the holder did not apply is detached at that
    /// holder (it is re-sent whole).
    pub async fn send_queued(&self) {
        let batch = self.queue.take();
        // Per holder, per bucket, the changes in queue order; every bucket's changes go to the
        // holder's lane at once, which batches them (`batch.rs`).
        let mut by_holder: Vec<(Holder, BTreeMap<BucketId, Vec<Change>>)> = Vec::new();
        for q in batch {
            let at = match by_holder.iter().position(|(h, _)| *h == q.holder) {
                Some(at) => at,
                None => {
                    by_holder.push((q.holder.clone(), BTreeMap::new()));
                    by_holder.len() - 1
                }
            };
            by_holder[at].1.entry(q.bucket).or_default().push(q.change);
        }
        let sends = by_holder.iter().flat_map(|(holder, buckets)| {
            buckets.iter().map(move |(&bucket, changes)| async move {
                if let Err(e) = self.send_changes(bucket, holder, changes).await {
                    self.stats.failures.fetch_add(1, Ordering::Relaxed);
                    tracing::debug!(bucket = bucket.0, holder = holder.id, error = %e, "async replication failed");
                    self.facts.attached().detach_at(bucket, holder.id);
                }
            })
        });
        futures::future::join_all(sends).await;
        self.queue.sent();
    }

    fn is_attached(&self, bucket: BucketId, holder: &Holder) -> bool {
        self.facts.attached().has(bucket, attachment(holder))
    }

    /// Records that `holder` has a snapshot of `bucket`, in the slot of a holder the bucket's
    /// writes no longer go to (or an empty one): the other current holder keeps its slot.
    fn attach_at(&self, bucket: BucketId, holder: &Holder) {
        let state = self.control.state();
        let (required, next) = self.holders_of(&state, bucket);
        let current = |h: NodeId| [&required, &next].into_iter().flatten().any(|x| x.id == h);
        let period_of = |h: NodeId| state.replica_period(self.me, h).unwrap_or(0);
        let mut slots = self.facts.attached().slots(bucket);
        let slot = slots.iter().position(|a| a.holder == holder.id).unwrap_or_else(|| {
            slots.iter().position(|a| !a.current(holder.epoch, period_of(a.holder)) || !current(a.holder)).unwrap_or(1)
        });
        slots[slot] = attachment(holder);
    }

    /// Depth of the async queue (changes in flight to the holder included) and the age of its
    /// oldest queued change.
    pub fn queue_lag(&self) -> (usize, Duration) {
        self.queue.lag()
    }

    /// What this node tells in its pings of its replica (see `Ping::replica`): the holder
    /// every write must reach, its holding period, and the age of the oldest change queued or
    /// in flight, in milliseconds; None while one of its buckets is not attached there.
    pub fn lag_report(&self, state: &ClusterState) -> Option<ReplicaReport> {
        let holder = state.heir_of(self.me).filter(|&h| h != self.me)?;
        let period = state.replica_period(self.me, holder)?;
        let (attached, owned) = self.facts.attached_count(state, self.me);
        if attached < owned {
            return None;
        }
        let lag_ms = self.queue.oldest().map_or(0, |at| at.elapsed().as_millis() as u64);
        let sync = state.settings.replication == ReplicationMode::Sync;
        Some(ReplicaReport { holder, period, lag_ms, sync })
    }

    /// The holders a write of `bucket` goes to on `state`, if this node owns it: the one it
    /// must reach, and the one join order names when that is not the same.
    pub fn holders_of(&self, state: &ClusterState, bucket: BucketId) -> (Option<Holder>, Option<Holder>) {
        let plan = crate::phase::write_plan(state, self.me, bucket, self.facts.of(state, bucket), Default::default());
        match plan {
            Ok(plan) => (self.holder_for(&plan), self.next_holder_for(&plan)),
            Err(_) => (None, None),
        }
    }

    /// Sends `buckets` whole to holder `holder` when it has no snapshot of them in their
    /// current ownership period, a few at a time (a rebuild after a failure is bound by round
    /// trips, not bytes); stops after the first failure. The reconciler's attach job: answers
    /// how many it attached.
    pub async fn attach(&self, holder: NodeId, buckets: &[BucketId]) -> usize {
        let mut sent = 0;
        for group in buckets.chunks(ATTACH_IN_FLIGHT) {
            let results = futures::future::join_all(group.iter().map(|&b| self.attach_one(holder, b))).await;
            sent += results.iter().filter(|r| matches!(r, Ok(true))).count();
            if results.iter().any(Result::is_err) {
                break;
            }
        }
        sent
    }

    /// Sends `bucket` whole to `holder` unless it has it; answers whether it sent it.
    async fn attach_one(&self, holder: NodeId, bucket: BucketId) -> Result<bool, ()> {
        let state = self.control.state();
        let holder_on = |s: &ClusterState| {
            let (required, next) = self.holders_of(s, bucket);
            [required, next].into_iter().flatten().find(|h| h.id == holder)
        };
        let Some(target) = holder_on(&state) else { return Ok(false) };
        if self.is_attached(bucket, &target) || self.facts.not_held(&state, self.me, bucket) {
            return Ok(false);
        }
        let _lock = self.lock(bucket).await;
        // Re-check under the lock: the map may have moved on.
        if holder_on(&self.control.state()).as_ref() != Some(&target) {
            return Ok(false);
        }
        match self.send_snapshot(bucket, &target).await {
            Ok(()) => Ok(true),
            Err(e) => {
                self.stats.failures.fetch_add(1, Ordering::Relaxed);
                tracing::debug!(bucket = bucket.0, holder, error = %e, "cannot attach the replica yet");
                Err(())
            }
        }
    }
}

/// How far behind its owner this node's (`me`'s) replica copy may be, from the owner's latest
/// `report` received `since_ms` ago: None unless the report names `me` in its current holding
/// `period`; with sync replication on both sides 0 unless the owner still drained a queue;
/// otherwise what the owner said plus the time since, at least a millisecond more.
pub fn reported_lag(
    report: ReplicaReport,
    me: NodeId,
    period: Option<u64>,
    mode: ReplicationMode,
    since_ms: u64,
) -> Option<u64> {
    if report.holder != me || Some(report.period) != period {
        return None;
    }
    match mode {
        ReplicationMode::Sync if report.sync && report.lag_ms == 0 => Some(0),
        _ => Some(report.lag_ms.saturating_add(since_ms.max(1))),
    }
}

/// The error of an answer other than "applied".
fn refusal(answer: ReplicaAnswer) -> ReplicaError {
    match answer {
        ReplicaAnswer::Applied => ReplicaError::Refused("applied".into()),
        ReplicaAnswer::NeedSnapshot(reason) => ReplicaError::NeedsSnapshot(reason),
        ReplicaAnswer::Fenced { map_version, .. } => ReplicaError::Fenced(map_version),
        ReplicaAnswer::Refused(reason) => ReplicaError::Refused(reason),
    }
}

impl Replicator {
    /// `LocalFacts::attached_count` on `state`, and the same count bucket by bucket from each
    /// bucket's write plan: what it must agree with.
    #[cfg(test)]
    pub(crate) fn attached_counts(&self, state: &ClusterState) -> [(usize, usize); 2] {
        let holders = state.map.buckets_of(self.me).into_iter().filter_map(|b| Some((b, self.holders_of(state, b).0?)));
        let by_plan = holders.fold((0, 0), |(attached, owned), (b, holder)| {
            (attached + usize::from(self.is_attached(b, &holder)), owned + 1)
        });
        [self.facts.attached_count(state, self.me), by_plan]
    }
}

/// The holders a sync write sent to `sent_to` may have stayed at when it failed at `failed`
/// with `cause`: every one but one that answered it did not apply it (any answer, a refusal
/// included, says so; no answer does not). One holder may refuse while the other applied.
pub fn may_keep<'a>(sent_to: &[&'a Holder], failed: NodeId, cause: &ReplicaError) -> Vec<&'a Holder> {
    let refused = |h: &Holder| h.id == failed && !cause.may_have_applied();
    sent_to.iter().copied().filter(|h| !refused(h)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failed_write_may_stay_at_every_holder_but_one_that_answered_it_did_not_apply_it() {
        let holder = |id| Holder { id, peer_addr: String::new(), map_version: 1, epoch: 0, period: 1 };
        let (complete, next) = (holder(2), holder(3));
        let refused = ReplicaError::Call(CallError::Unreachable("connection refused".into()));
        let silent = ReplicaError::Call(CallError::Timeout);
        let ids = |kept: Vec<&Holder>| kept.iter().map(|h| h.id).collect::<Vec<_>>();
        // The complete holder refused; the next one, which has the bucket whole, applied it.
        assert_eq!(ids(may_keep(&[&complete, &next], 2, &refused)), vec![3]);
        assert_eq!(ids(may_keep(&[&complete], 2, &refused)), Vec::<NodeId>::new());
        // No answer is not no write.
        assert_eq!(ids(may_keep(&[&complete, &next], 2, &silent)), vec![2, 3]);
        // The next holder missed it (it may become the complete holder any moment); the
        // complete one applied it.
        assert_eq!(ids(may_keep(&[&complete, &next], 3, &refused)), vec![2]);
        assert_eq!(ids(may_keep(&[&complete, &next], 3, &silent)), vec![2, 3]);
    }

    #[test]
    fn a_copy_is_as_fresh_as_its_owner_says_only_when_the_owner_names_it_in_its_period() {
        let report = ReplicaReport { holder: 3, period: 7, lag_ms: 0, sync: true };
        let sync = ReplicationMode::Sync;
        let asynchronous = ReplicationMode::Async;
        assert_eq!(reported_lag(report, 3, Some(7), sync, 500), Some(0), "sync: nothing behind");
        assert_eq!(reported_lag(report, 2, Some(7), sync, 0), None, "another holder is named");
        assert_eq!(reported_lag(report, 3, Some(8), sync, 0), None, "an earlier holding period");
        assert_eq!(reported_lag(report, 3, None, sync, 0), None, "no longer a holder");
        assert_eq!(reported_lag(report, 3, Some(7), asynchronous, 0), Some(1), "async: never exactly current");
        assert_eq!(reported_lag(report, 3, Some(7), asynchronous, 40), Some(40));
        let draining = ReplicaReport { lag_ms: 25, ..report };
        assert_eq!(reported_lag(draining, 3, Some(7), sync, 10), Some(35), "sync, a queue still drains");
        assert_eq!(reported_lag(draining, 3, Some(7), asynchronous, 10), Some(35));
        let owner_still_async = ReplicaReport { sync: false, ..report };
        assert_eq!(reported_lag(owner_still_async, 3, Some(7), sync, 5), Some(5), "the owner's own mode counts");
    }
}
