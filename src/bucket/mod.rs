//! The bucket core: the one place that decides what this node does with a bucket, and the one
//! write path.
//!
//! - `crate::phase` (a module of its own, below this one and below everything this one calls,
//!   so replication, transfer and failure detection decide there too without importing the
//!   bucket core): pure functions from (the replicated state, this node's facts about the
//!   bucket and about itself) to the bucket's [`Phase`], where a key operation runs
//!   ([`route_of`]), and — the question every write asks — whether this node may write the
//!   bucket now and who must get a copy ([`write_plan`]); and [`LocalFacts`], what this node
//!   knows of its buckets that Raft does not say (being restored after a restart, a promoted
//!   copy installed) and the per-bucket write locks.
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
#[cfg(test)]
pub(crate) mod testing;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use shoal_raft::{BucketId, ClusterState, ControlPlane, NodeId, BUCKET_COUNT};

use crate::phase::{
    phase_of, read_refusal, route_of, write_plan, write_refusal, LocalFacts, NodeFacts, Phase, Route, Routing,
};
pub use permit::WritePermit;

use crate::cache::CacheStore;
use crate::error::DataError;
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
