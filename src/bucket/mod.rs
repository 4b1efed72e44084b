//! The bucket core: the one place that decides what this node does with a bucket, and the one
//! write path.
//!
//! - [`phase`]: pure functions from (the replicated state, this node's facts about the bucket
//!   and about itself) to the bucket's [`Phase`], where a key operation runs ([`route_of`]),
//!   and — the question every write asks — whether this node may write the bucket now and who
//!   must get a copy ([`write_plan`]).
//! - [`LocalFacts`]: what this node knows of its buckets that Raft does not say (being restored
//!   after a restart, a promoted copy installed) and the per-bucket write locks.
//! - [`BucketCore`]: asks the pure functions on the current state and hands out
//!   [`WritePermit`]s: a permit holds the bucket's lock while it writes, and its commit sends
//!   the writes to every copy the plan names, or takes them all back.
//!
//! ```text
//!  put k ─ route_of ─▶ Local ─ write_permit(b): plan on the state, lock b (when copies), plan again
//!                                 │ permit.put(k) ── the store (refused while b is frozen)
//!                                 │ permit.commit(): lease and plan still hold? ── shadow ── replica (sync: wait)
//!                                 └─ all good: 2xx │ any failure: every write taken back, 503
//! ```
//!
//! `DESIGN.md` beside this module draws the phases, the write path and the reconciler, with the
//! invariants and the tests that check them.

mod permit;
pub mod phase;
#[cfg(test)]
pub(crate) mod testing;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::{Mutex, RwLock};
use shoal_raft::{BucketId, ClusterState, ControlPlane, NodeId, BUCKET_COUNT};
use tokio::sync::{MutexGuard, RwLockReadGuard, RwLockWriteGuard};

pub use permit::WritePermit;
pub use phase::{
    holds_replica, keeps_replica, mirror_read, mirrors_of, phase_of, plan_holds, pull_lands, read_refusal, route_of,
    write_plan, write_refusal, BucketFacts, NodeFacts, Phase, Recipient, ReplicaFacts, Route, Routing, WritePlan,
};

use crate::cache::CacheStore;
use crate::error::DataError;
pub use crate::error::NotFresh;
use crate::health::Health;
use crate::peer::Peers;
use crate::replication::Replicator;

/// Reads and writes of each bucket served here, counted as they happen.
pub struct BucketActivity {
    reads: Box<[AtomicU64]>,
    writes: Box<[AtomicU64]>,
}

impl Default for BucketActivity {
    fn default() -> Self {
        let counters = || (0..BUCKET_COUNT).map(|_| AtomicU64::new(0)).collect();
        BucketActivity { reads: counters(), writes: counters() }
    }
}

impl BucketActivity {
    /// A read of `bucket` served here.
    pub fn read(&self, bucket: BucketId) {
        self.reads[bucket.index()].fetch_add(1, Ordering::Relaxed);
    }

    /// A write of `bucket` done here.
    pub fn wrote(&self, bucket: BucketId) {
        self.writes[bucket.index()].fetch_add(1, Ordering::Relaxed);
    }

    /// Reads and writes of every bucket since start.
    pub fn totals(&self) -> Totals {
        self.reads
            .iter()
            .zip(self.writes.iter())
            .map(|(r, w)| (r.load(Ordering::Relaxed), w.load(Ordering::Relaxed)))
            .collect()
    }
}

/// Reads and writes of every bucket since start.
pub type Totals = Vec<(u64, u64)>;

/// Sees what the simulation checks: every write a node acknowledges, with the ownership period
/// (the bucket's move epoch) it belongs to — no two nodes may acknowledge writes of one bucket
/// in one period — and every bucket a node serves again empty because no copy of it was left.
pub trait Probe: Send + Sync {
    /// Node `node` acknowledged a write of `bucket` in move epoch `epoch`.
    fn acknowledged(&self, node: NodeId, bucket: BucketId, epoch: u64);

    /// Node `node` serves `bucket` again, empty: every copy of it was lost.
    fn emptied(&self, node: NodeId, bucket: BucketId);

    /// Node `node` answered a read of `bucket` from its own copy, knowing the bucket's move
    /// epoch as `epoch` (a node with an old map may answer from a copy that is no longer the
    /// bucket's).
    fn served(&self, node: NodeId, bucket: BucketId, epoch: u64);

    /// Node `node` answered a read of `bucket` from its replica copy (a mirror read).
    fn served_replica(&self, node: NodeId, bucket: BucketId, epoch: u64) {
        self.served(node, bucket, epoch);
    }
}

/// What this node knows of its buckets that the replicated state does not say, and the lock
/// that serializes writes to each bucket (so its copies apply them in the order it did).
pub struct LocalFacts {
    restoring: RwLock<BTreeSet<u16>>,
    /// Promoted buckets whose copy is installed, with the move epoch of their promotion: a
    /// later promotion of the same bucket (a new epoch) is installed again.
    installed: Mutex<BTreeMap<u16, u64>>,
    /// Buckets this node handed over since it started and still holds the data of: the
    /// shadows it really has. The replicated state names the node that handed a bucket over,
    /// but a node that restarted since holds nothing of it.
    shadows: RwLock<BTreeSet<u16>>,
    locks: Vec<tokio::sync::Mutex<()>>,
    /// Per bucket: held for writing while a write permit's writes are in the store but not
    /// committed (they may still be taken back); reads of the bucket wait for it, so no read
    /// sees a write that is then taken back.
    pending: Vec<tokio::sync::RwLock<()>>,
}

impl Default for LocalFacts {
    fn default() -> Self {
        LocalFacts {
            restoring: RwLock::new(BTreeSet::new()),
            installed: Mutex::new(BTreeMap::new()),
            shadows: RwLock::new(BTreeSet::new()),
            locks: (0..BUCKET_COUNT).map(|_| tokio::sync::Mutex::new(())).collect(),
            pending: (0..BUCKET_COUNT).map(|_| tokio::sync::RwLock::new(())).collect(),
        }
    }
}

impl LocalFacts {
    /// This node handed `bucket` over and keeps its data as the shadow.
    pub fn handed_over(&self, bucket: BucketId) {
        self.shadows.write().insert(bucket.0);
    }

    /// This node dropped its active data of `bucket`.
    pub fn dropped(&self, bucket: BucketId) {
        self.shadows.write().remove(&bucket.0);
    }

    /// Whether this node holds a shadow copy of `bucket` (it handed it over since it started
    /// and has not dropped it).
    pub fn holds_shadow(&self, bucket: BucketId) -> bool {
        self.shadows.read().contains(&bucket.0)
    }

    /// The buckets this node holds a shadow copy of.
    pub fn shadows(&self) -> BTreeSet<BucketId> {
        self.shadows.read().iter().map(|&b| BucketId(b)).collect()
    }

    /// What this node knows of `bucket`, on `state`.
    pub fn of(&self, state: &ClusterState, bucket: BucketId) -> BucketFacts {
        BucketFacts { restoring: self.is_restoring(bucket), installed: self.is_installed(state, bucket) }
    }

    /// Whether node `me` owns `bucket` on `state` but does not hold its data yet (restoring
    /// after a restart, or promoted and not installed): it must not be exported or sent to a
    /// replica, which would spread an empty bucket.
    pub fn not_held(&self, state: &ClusterState, me: NodeId, bucket: BucketId) -> bool {
        matches!(phase_of(state, me, bucket, self.of(state, bucket)), Phase::Restoring | Phase::AwaitingPromotion)
    }

    /// Locks `bucket` for a write (or anything that must not interleave with one).
    pub async fn lock(&self, bucket: BucketId) -> MutexGuard<'_, ()> {
        self.locks[bucket.index()].lock().await
    }

    /// Waits until no write of `bucket` may still be taken back, and keeps it so while the
    /// guard lives: a read holds it while it reads the store.
    pub async fn committed(&self, bucket: BucketId) -> RwLockReadGuard<'_, ()> {
        let pending = &self.pending[bucket.index()];
        match pending.try_read() {
            Ok(guard) => guard,
            Err(_) => pending.read().await,
        }
    }

    /// Marks `bucket` as having writes that may be taken back, until the guard is dropped.
    async fn uncommitted(&self, bucket: BucketId) -> RwLockWriteGuard<'_, ()> {
        self.pending[bucket.index()].write().await
    }

    /// Whether `bucket` waits to be restored.
    pub fn is_restoring(&self, bucket: BucketId) -> bool {
        let set = self.restoring.read();
        !set.is_empty() && set.contains(&bucket.0)
    }

    /// The buckets waiting to be restored.
    pub fn restoring(&self) -> Vec<BucketId> {
        self.restoring.read().iter().map(|&b| BucketId(b)).collect()
    }

    /// Marks the buckets to get back before serving them, at start (before serving). After a
    /// restart: every bucket, because the state this node read from its own disk may be behind
    /// (a bucket flipped to it just before it went down is not in it yet); the reconciler
    /// unmarks the ones it does not own once it has caught up with the leader, and the owned
    /// ones of which no copy is left serve again empty, said once. That includes the only
    /// member's restart: its memory held the only copy of everything, and the loss is reported,
    /// not silent. Otherwise: every bucket `me` serves that has a shadow or a replica elsewhere.
    pub fn mark_restoring(&self, state: &ClusterState, me: NodeId, restarted: bool) {
        let mut set = self.restoring.write();
        let replica = state.replica_of(me).is_some();
        for b in BucketId::all() {
            let owned = state.map.owner_of(b) == Some(me);
            if restarted || (owned && (replica || state.shadow_of(b).is_some())) {
                set.insert(b.0);
            }
        }
    }

    /// `bucket` is back (or has no copy to come back from).
    pub fn restored(&self, bucket: BucketId) {
        self.restoring.write().remove(&bucket.0);
    }

    /// Whether this node installed its copy of `bucket`, promoted to it on `state`.
    pub fn is_installed(&self, state: &ClusterState, bucket: BucketId) -> bool {
        if state.promoted.is_empty() || !state.promoted.contains_key(&bucket.0) {
            return false;
        }
        self.installed.lock().get(&bucket.0) == Some(&state.epoch_of(bucket))
    }

    /// This node installed its copy of `bucket`, promoted to it on `state`.
    pub fn install(&self, state: &ClusterState, bucket: BucketId) {
        let mut installed = self.installed.lock();
        installed.retain(|b, _| state.promoted.contains_key(b));
        installed.insert(bucket.0, state.epoch_of(bucket));
    }
}

/// The bucket core of one node (see the module docs).
pub struct BucketCore {
    me: NodeId,
    control: ControlPlane,
    store: Arc<CacheStore>,
    facts: Arc<LocalFacts>,
    health: Arc<Health>,
    replicator: Arc<Replicator>,
    peers: Peers,
    probe: Option<Arc<dyn Probe>>,
    activity: BucketActivity,
}

impl BucketCore {
    /// The core over this node's parts.
    pub fn new(
        control: ControlPlane,
        store: Arc<CacheStore>,
        facts: Arc<LocalFacts>,
        health: Arc<Health>,
        replicator: Arc<Replicator>,
        peers: Peers,
        probe: Option<Arc<dyn Probe>>,
    ) -> Self {
        let activity = BucketActivity::default();
        BucketCore { me: control.node_id(), control, store, facts, health, replicator, peers, probe, activity }
    }

    /// This node's facts about its buckets.
    pub fn facts(&self) -> &Arc<LocalFacts> {
        &self.facts
    }

    /// Reads and writes of each bucket served here, for the bucket statistics.
    pub fn activity(&self) -> &BucketActivity {
        &self.activity
    }

    /// What sees acknowledged writes and emptied buckets (the simulation).
    pub fn probe(&self) -> Option<&Arc<dyn Probe>> {
        self.probe.as_ref()
    }

    /// The phase of `bucket` on `state`.
    pub fn phase(&self, state: &ClusterState, bucket: BucketId) -> Phase {
        phase_of(state, self.me, bucket, self.facts.of(state, bucket))
    }

    /// Where a key operation on `bucket` runs, decided on `state`.
    pub fn route(&self, state: &ClusterState, bucket: BucketId, routing: Routing) -> Result<Route, DataError> {
        let phase = self.phase(state, bucket);
        let suspected = match phase {
            Phase::Incoming { from: owner }
            | Phase::Shadow { owner }
            | Phase::Foreign { owner }
            | Phase::Mirror { owner }
            | Phase::Away { owner } => !routing.forwarded && !routing.redirect && self.health.is_pfail(owner),
            _ => false,
        };
        route_of(state, bucket, phase, routing, self.health.node_facts(), suspected)
    }

    /// Why this node may serve no read now, if it may not (see [`read_refusal`]).
    pub fn read_refusal(&self) -> Option<DataError> {
        read_refusal(self.health.node_facts())
    }

    /// Why this node may acknowledge no write now, if it may not.
    pub fn write_refusal(&self) -> Option<DataError> {
        write_refusal(self.health.node_facts())
    }

    /// A permit to write `bucket`: on the current state this node may write it (else why
    /// not), and it holds the bucket's lock when the writes must reach other nodes.
    pub async fn write_permit(&self, bucket: BucketId) -> Result<WritePermit<'_>, DataError> {
        let decide = || {
            let state = self.control.state();
            write_plan(&state, self.me, bucket, self.facts.of(&state, bucket), self.health.node_facts())
        };
        let plan = decide()?;
        if !plan.has_copies() {
            return Ok(WritePermit::new(self, plan, None));
        }
        let lock = self.facts.lock(bucket).await;
        let pending = self.facts.uncommitted(bucket).await;
        // Decided again once both are held: the map may have moved while this write waited,
        // and from now on no export of the bucket can freeze it until the permit ends.
        let plan = decide()?;
        Ok(WritePermit::new(self, plan, Some((lock, pending))))
    }

    /// Permits for several buckets, taken in ascending bucket order (so two bulk writes cannot
    /// wait for each other's locks).
    pub async fn write_permits(&self, buckets: &[BucketId]) -> Vec<(BucketId, Result<WritePermit<'_>, DataError>)> {
        let mut sorted = buckets.to_vec();
        sorted.sort();
        sorted.dedup();
        let mut permits = Vec::with_capacity(sorted.len());
        for b in sorted {
            permits.push((b, self.write_permit(b).await));
        }
        permits
    }

    /// Makes the store keep its evictions for [`Self::replicate_evictions`].
    pub fn store_keeps_evictions(&self) {
        self.store.keep_evictions();
    }

    /// Sends the store's evictions, and the sliding expiries its reads moved, of buckets this
    /// node serves to their replica, through the queue in either mode (neither acknowledges
    /// anything to a client): the owner decides expirations, and its replica follows, so an
    /// item its reads keep alive is alive on the replica too.
    pub fn replicate_evictions(&self) {
        use crate::cache::Change;
        let evicted = self.store.take_evicted();
        let refreshed = self.store.take_refreshed();
        if evicted.is_empty() && refreshed.is_empty() {
            return;
        }
        let changes = evicted
            .into_iter()
            .map(|(bucket, key, version)| (bucket, Change::Delete { key, version }))
            .chain(refreshed.into_iter().map(|r| {
                (r.bucket, Change::Expire { key: r.key, version: r.version, expires_at_ms: r.expires_at_ms })
            }));
        let state = self.control.state();
        for (bucket, change) in changes {
            let Ok(plan) = write_plan(&state, self.me, bucket, self.facts.of(&state, bucket), NodeFacts::default())
            else {
                continue;
            };
            let change = [change];
            for holder in
                [self.replicator.holder_for(&plan), self.replicator.next_holder_for(&plan)].into_iter().flatten()
            {
                self.replicator.enqueue(bucket, &holder, &change);
            }
        }
    }
}
