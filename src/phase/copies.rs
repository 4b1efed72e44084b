//! What this node knows of the copies of its buckets: the facts replication keeps per bucket,
//! held here with the bucket core's other facts ([`LocalFacts`]) so every decision about a
//! bucket reads them from one place, and replication only acts on them.
//!
//! - Owner side ([`Attached`]): per bucket, up to two holders that acknowledged a snapshot of
//!   it, in which move epoch of the bucket and in which of the holder's holding periods. A
//!   bucket that left this node and came back is in a new epoch, and a holder that stopped
//!   holding this node's replica dropped its copies (it is in a new period if it holds it
//!   again): either way the attachment no longer counts, and the bucket is sent whole again.
//! - Holder side ([`HeldCopies`]): per replica bucket, the owner whose snapshot it is, the
//!   bucket's move epoch when the snapshot arrived, and the last request applied to it, under
//!   the lock that applies requests and promotes, drops or mirror-reads the copy.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::{Mutex, MutexGuard};
use shoal_raft::{BucketId, ClusterState, NodeId, BUCKET_COUNT};

use super::{replica_holders, writable, LocalFacts};

/// A holder that acknowledged a snapshot of a bucket, in which move epoch of the bucket and
/// in which of its holding periods (holder 0: none).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Attachment {
    /// The holder.
    pub holder: NodeId,
    /// The bucket's move epoch then.
    pub epoch: u64,
    /// The holder's holding period then.
    pub period: u64,
}

impl Attachment {
    /// Whether it still holds: the bucket's move epoch and the holder's period are the same.
    pub fn current(&self, epoch: u64, period: u64) -> bool {
        self.holder != 0 && self.epoch == epoch && self.period == period
    }
}

/// Up to two holders that acknowledged a snapshot of a bucket: the one every write must reach
/// and the one join order names next, while they differ.
pub type Attachments = [Attachment; 2];

/// The owner side: per bucket, its [`Attachments`].
pub struct Attached(Vec<Mutex<Attachments>>);

impl Default for Attached {
    fn default() -> Self {
        Attached((0..BUCKET_COUNT).map(|_| Mutex::new(Attachments::default())).collect())
    }
}

impl Attached {
    /// `bucket`'s attachments, locked.
    pub fn slots(&self, bucket: BucketId) -> MutexGuard<'_, Attachments> {
        self.0[bucket.index()].lock()
    }

    /// Whether `attachment` is recorded for `bucket`.
    pub fn has(&self, bucket: BucketId, attachment: Attachment) -> bool {
        attachment.holder != 0 && self.slots(bucket).contains(&attachment)
    }

    /// Forgets that `holder` has a snapshot of `bucket`.
    pub fn detach_at(&self, bucket: BucketId, holder: NodeId) {
        for slot in self.slots(bucket).iter_mut().filter(|a| a.holder == holder) {
            *slot = Attachment::default();
        }
    }

    /// Forgets that `bucket`'s replicas hold a snapshot: the next change sends it whole.
    pub fn detach(&self, bucket: BucketId) {
        *self.slots(bucket) = Attachments::default();
    }

    /// Forgets every snapshot `holder` acknowledged (it restarted with an empty store).
    pub fn detach_holder(&self, holder: NodeId) {
        BucketId::all().for_each(|b| self.detach_at(b, holder));
    }

    /// Forgets every snapshot of every bucket.
    pub fn detach_all(&self) {
        BucketId::all().for_each(|b| self.detach(b));
    }

    /// Every (bucket, holder) whose snapshot the holder acknowledged in the bucket's current
    /// ownership period, among the buckets `me` owns on `state`.
    pub fn current(&self, state: &ClusterState, me: NodeId) -> BTreeSet<(BucketId, NodeId)> {
        let mut found = BTreeSet::new();
        for bucket in state.map.buckets_of(me) {
            let epoch = state.epoch_of(bucket);
            for a in self.slots(bucket).iter() {
                if a.current(epoch, state.replica_period(me, a.holder).unwrap_or(0)) {
                    found.insert((bucket, a.holder));
                }
            }
        }
        found
    }
}

/// The sender and sequence number of the last request applied to a replica bucket: one with
/// an older number from the same sender (held up in the network after its sender gave up) is
/// refused, so it cannot overwrite newer data.
pub type Applied = (NodeId, u64);

/// The holder side: whose copy each replica bucket is, since which move epoch, and the last
/// request applied to it.
pub struct HeldCopies {
    /// The owner whose snapshot each replica bucket holds (0: none).
    sources: Vec<AtomicU64>,
    /// The bucket's move epoch (in this node's map) when that snapshot arrived.
    epochs: Vec<AtomicU64>,
    /// Per bucket, under the lock that applies, promotes and drops it.
    applied: Vec<Mutex<Applied>>,
}

impl Default for HeldCopies {
    fn default() -> Self {
        HeldCopies {
            sources: (0..BUCKET_COUNT).map(|_| AtomicU64::new(0)).collect(),
            epochs: (0..BUCKET_COUNT).map(|_| AtomicU64::new(0)).collect(),
            applied: (0..BUCKET_COUNT).map(|_| Mutex::new((0, 0))).collect(),
        }
    }
}

impl HeldCopies {
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
}

impl LocalFacts {
    /// How many buckets `me` owns on `state` whose replica holds every write (the holder
    /// writes must reach has a snapshot), of how many it owns and may write.
    pub fn attached_count(&self, state: &ClusterState, me: NodeId) -> (usize, usize) {
        // What the write plan says bucket by bucket, with the holder found once: it is the same
        // for every bucket this node writes (this runs at every ping round).
        let (Some(holder), _) = replica_holders(state, me) else { return (0, 0) };
        let period = state.replica_period(me, holder).unwrap_or(0);
        let mut owned = 0;
        let mut attached = 0;
        for bucket in state.map.buckets_of(me) {
            if writable(state, me, bucket, self.of(state, bucket), Default::default()).is_err() {
                continue;
            }
            owned += 1;
            let wanted = Attachment { holder, epoch: state.epoch_of(bucket), period };
            attached += usize::from(self.attached().has(bucket, wanted));
        }
        (attached, owned)
    }

    /// Whether `me`'s replica is complete where join order wants it: no other holder waits
    /// to take over, and every owned bucket is attached there.
    pub fn replica_in_place(&self, state: &ClusterState, me: NodeId) -> bool {
        let (attached, owned) = self.attached_count(state, me);
        let moving = state.replica_of(me).is_some_and(|d| state.committed_holder_of(me) != Some(d));
        attached == owned && !(moving && owned > 0)
    }
}
