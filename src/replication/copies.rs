//! The holder's side: per replica bucket, whose copy this node holds and since which move
//! epoch, the last request applied to it, and what each owner last said of its replica.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::{Mutex, MutexGuard};
use shoal_raft::{BucketId, NodeId, BUCKET_COUNT};
use tokio::time::Instant;

use serde::{Deserialize, Serialize};

/// What an owner says of its replica in its pings (`health::Ping::replica`), for mirror reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReplicaReport {
    /// The member holding the sender's replica.
    pub holder: NodeId,
    /// Its holding period (`ClusterState::replica_period`).
    pub period: u64,
    /// The age of the sender's oldest change not yet acknowledged there, in milliseconds.
    pub lag_ms: u64,
    /// Whether the sender replicates synchronously (its own applied setting: a holder that
    /// applied a switch to sync before its owner must not take the owner's writes for sync).
    pub sync: bool,
}

/// The sender and sequence number of the last request applied to a replica bucket: one with
/// an older number from the same sender (held up in the network after its sender gave up) is
/// refused, so it cannot overwrite newer data.
pub(super) type Applied = (NodeId, u64);

pub(super) struct Copies {
    /// The owner whose snapshot each replica bucket holds (0: none).
    sources: Vec<AtomicU64>,
    /// The bucket's move epoch (in this node's map) when that snapshot arrived.
    epochs: Vec<AtomicU64>,
    /// Per bucket, under the lock that applies, promotes and drops it.
    applied: Vec<Mutex<Applied>>,
    /// Per owner, when it last said how far behind its replica copies may be, and what it
    /// said (see `Ping::replica_lag_ms`).
    owner_lag: Mutex<BTreeMap<NodeId, (Instant, Option<ReplicaReport>)>>,
}

impl Default for Copies {
    fn default() -> Self {
        Copies {
            sources: (0..BUCKET_COUNT).map(|_| AtomicU64::new(0)).collect(),
            epochs: (0..BUCKET_COUNT).map(|_| AtomicU64::new(0)).collect(),
            applied: (0..BUCKET_COUNT).map(|_| Mutex::new((0, 0))).collect(),
            owner_lag: Mutex::new(BTreeMap::new()),
        }
    }
}

impl Copies {
    /// Locks `bucket`'s copy: requests are applied, and the copy promoted, dropped or read by
    /// a mirror read, one at a time.
    pub fn lock(&self, bucket: BucketId) -> MutexGuard<'_, Applied> {
        self.applied[bucket.index()].lock()
    }

    /// The owner whose snapshot `bucket`'s copy is (0: none).
    pub fn source(&self, bucket: BucketId) -> NodeId {
        self.sources.get(bucket.index()).map_or(0, |s| s.load(Ordering::Acquire))
    }

    /// The move epoch `bucket` had when its snapshot arrived.
    pub fn epoch(&self, bucket: BucketId) -> u64 {
        self.epochs[bucket.index()].load(Ordering::Acquire)
    }

    /// `bucket`'s copy is nobody's any more (under its lock).
    pub fn forget(&self, bucket: BucketId) {
        self.sources[bucket.index()].store(0, Ordering::Release);
    }

    /// `bucket`'s copy is a snapshot of `source`'s, taken at move epoch `epoch` (under its lock).
    pub fn keep(&self, bucket: BucketId, source: NodeId, epoch: u64) {
        self.epochs[bucket.index()].store(epoch, Ordering::Release);
        self.sources[bucket.index()].store(source, Ordering::Release);
    }

    /// Every bucket of which a copy is held, and whose it is.
    pub fn sources(&self) -> BTreeMap<BucketId, NodeId> {
        BucketId::all().map(|b| (b, self.source(b))).filter(|&(_, source)| source != 0).collect()
    }

    /// Records what owner `from` said of its replica.
    pub fn note_lag(&self, from: NodeId, report: Option<ReplicaReport>) {
        self.owner_lag.lock().insert(from, (Instant::now(), report));
    }

    /// What `owner` said last of its replica, and when.
    pub fn said(&self, owner: NodeId) -> Option<(Instant, Option<ReplicaReport>)> {
        self.owner_lag.lock().get(&owner).copied()
    }
}
