//! [`LocalFacts`]: what this node knows of its buckets and of itself that the replicated state
//! does not say — its gate (failed, draining, stopping, handing over) and the
//! copies of its buckets (`copies.rs`) among them — and the per-bucket locks of the write path.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, Ordering};

use parking_lot::{Mutex, RwLock};
use shoal_raft::{BucketId, ClusterState, NodeId, BUCKET_COUNT};
use tokio::sync::{MutexGuard, RwLockReadGuard, RwLockWriteGuard};

use super::copies::{Attached, HeldCopies};
use super::{phase_of, BucketFacts, Phase};

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
    /// The node's own gate: set once it drains (not ready, no new writes; see
    /// `NodeHandle::drain`).
    draining: AtomicBool,
    /// Set on SIGTERM, before any maintenance or drain (see `NodeHandle::stop_for_restart`).
    stopping: AtomicBool,
    /// Set while a leaving node waits for its replicas before handing over.
    handing_over: AtomicBool,
    /// Set once a peer said the cluster failed this node: it acknowledges no write any more,
    /// gives back the lost buckets it served last and rejoins.
    failed: tokio::sync::watch::Sender<bool>,
    /// Owner side: which holders have a snapshot of each bucket.
    attached: Attached,
    /// Holder side: whose copy each replica bucket is.
    copies: HeldCopies,
}

impl Default for LocalFacts {
    fn default() -> Self {
        LocalFacts {
            restoring: RwLock::new(BTreeSet::new()),
            installed: Mutex::new(BTreeMap::new()),
            shadows: RwLock::new(BTreeSet::new()),
            locks: (0..BUCKET_COUNT).map(|_| tokio::sync::Mutex::new(())).collect(),
            pending: (0..BUCKET_COUNT).map(|_| tokio::sync::RwLock::new(())).collect(),
            draining: AtomicBool::new(false),
            stopping: AtomicBool::new(false),
            handing_over: AtomicBool::new(false),
            failed: tokio::sync::watch::channel(false).0,
            attached: Attached::default(),
            copies: HeldCopies::default(),
        }
    }
}

impl LocalFacts {
    /// Which holders have a snapshot of each bucket this node owns.
    pub fn attached(&self) -> &Attached {
        &self.attached
    }

    /// Whose copy each replica bucket held here is.
    pub fn copies(&self) -> &HeldCopies {
        &self.copies
    }

    /// Marks the node as stopping: `/readyz` fails and writes are refused from now on.
    pub fn start_draining(&self) {
        self.draining.store(true, Ordering::Relaxed);
    }

    /// Marks the node as stopping (SIGTERM) while it still serves: it no longer stands for
    /// election or marks itself running. A stopping leader's successor that stops too would
    /// otherwise take the lead just as the others exit, and then could not commit that it
    /// stops (a whole cluster stopped at once).
    pub fn start_stopping(&self) {
        self.stopping.store(true, Ordering::Relaxed);
    }

    /// Whether the node stops: it got SIGTERM, or drains.
    pub fn is_stopping(&self) -> bool {
        self.stopping.load(Ordering::Relaxed) || self.is_draining()
    }

    /// A peer said the cluster failed this node; answers whether it was news.
    pub fn mark_failed(&self) -> bool {
        !self.failed.send_replace(true)
    }

    /// Whether a peer said the cluster failed this node.
    pub fn is_failed(&self) -> bool {
        *self.failed.borrow()
    }

    /// Resolves once a peer said the cluster failed this node.
    pub async fn failed(&self) {
        let _ = self.failed.subscribe().wait_for(|f| *f).await;
    }

    /// Pauses (or resumes) this node's writes while it hands its buckets over.
    pub fn set_handing_over(&self, on: bool) {
        self.handing_over.store(on, Ordering::Relaxed);
    }

    /// Whether the node is stopping.
    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::Relaxed)
    }

    /// Whether the node pauses its writes to hand its buckets over.
    pub fn is_handing_over(&self) -> bool {
        self.handing_over.load(Ordering::Relaxed)
    }

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
    pub(crate) async fn uncommitted(&self, bucket: BucketId) -> RwLockWriteGuard<'_, ()> {
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
