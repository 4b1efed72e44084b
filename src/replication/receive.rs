//! The holder's side of replication: its messages ([`Replicate`], [`ReplicateBatch`]) and
//! [`Replicator::receive`], fenced by the map.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use serde::{Deserialize, Serialize};
use shoal_raft::{BucketId, NodeId};

use super::Replicator;
use crate::phase::holds_replica;
use crate::transport::frame::decode_body;
use crate::transport::wire::{self, Handlers};
use crate::transport::{Endpoint, Malformed};

/// Changes (or a snapshot) of one bucket for its replica, to the holder's peer address.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Replicate {
    /// The bucket.
    pub bucket: BucketId,
    /// The owner that sends them.
    pub from: NodeId,
    /// The sender's map version (the holder fences by it).
    pub map_version: u64,
    /// A whole bucket (replaces the replica bucket) rather than changes on top of one.
    pub snapshot: bool,
    /// Increases with every request of the sender: one held up in the network is refused.
    pub seq: u64,
    /// Framed changes or items, then END (`transport::frame`).
    #[serde(deserialize_with = "wire::shared::deserialize")]
    pub body: Bytes,
}

/// What the replica holder did with a [`Replicate`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum ReplicaAnswer {
    /// Applied.
    Applied,
    /// Not applied: the holder has no snapshot of the bucket from this sender (or applied a
    /// newer request already); the sender sends the bucket whole.
    NeedSnapshot(String),
    /// Not applied: in the holder's map, at least as new as the sender's, the sender does
    /// not own the bucket or the holder is not its replica.
    Fenced {
        /// The holder's map version.
        map_version: u64,
        /// Why.
        reason: String,
    },
    /// Not applied: the request is malformed.
    Refused(String),
}

/// Changes of several buckets of one sender for their replica, in one exchange: each is
/// applied (or refused) as if it came alone.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ReplicateBatch(pub Vec<Replicate>);

impl Endpoint for Replicate {
    type Answer = ReplicaAnswer;
    const ID: u8 = wire::id::REPLICATE;
    const KIND: u8 = wire::REPLICATE;
    const CARRIES_DATA: bool = true;

    fn check(&self) -> Result<(), Malformed> {
        wire::check_bucket(self.bucket)
    }
}

impl Endpoint for ReplicateBatch {
    type Answer = Vec<ReplicaAnswer>;
    const ID: u8 = wire::id::REPLICATE_BATCH;
    const KIND: u8 = wire::REPLICATE;
    const CARRIES_DATA: bool = true;

    fn check(&self) -> Result<(), Malformed> {
        self.0.iter().try_for_each(|r| wire::check_bucket(r.bucket))
    }

    fn fits(&self, answer: &Vec<ReplicaAnswer>) -> bool {
        answer.len() == self.0.len()
    }
}

/// Registers the holder's handlers: replica writes, alone or batched (each of a batch applied
/// or refused as if it came alone: they are of distinct buckets, since an owner has one replica
/// write per bucket in flight).
pub fn register(handlers: &mut Handlers, replicator: &Arc<Replicator>) {
    handlers.add_with(replicator, |r, request: Replicate| async move { Ok(r.receive(request).await) });
    handlers.add_with(replicator, |r, ReplicateBatch(requests)| async move {
        Ok(futures::future::join_all(requests.into_iter().map(|w| r.receive(w))).await)
    });
}

/// How long the holder waits to apply the sender's map version.
const MAP_CATCH_UP: Duration = Duration::from_secs(2);

impl Replicator {
    /// Applies a snapshot (replacing the replica bucket) or changes (only on top of a snapshot
    /// of the same owner: else [`ReplicaAnswer::NeedSnapshot`], and the owner sends a
    /// snapshot). [`ReplicaAnswer::Fenced`] when, in a map at least as new as the sender's, the
    /// sender does not own the bucket or this node is not its replica.
    pub async fn receive(&self, r: Replicate) -> ReplicaAnswer {
        let bucket = r.bucket;
        let (changes, counter) = match decode_body(r.body.clone()) {
            Ok(decoded) => decoded,
            Err(e) => return ReplicaAnswer::Refused(e.to_string()),
        };
        if self.control.state().map.version < r.map_version {
            self.control.wait_for_state(MAP_CATCH_UP, |s| s.map.version >= r.map_version).await;
        }
        // Everything decoded: nothing is half-applied by a bad request. The fence is checked and
        // the request applied under the replica bucket's apply lock, which promotion and drops take too, on
        // the newest applied state: a request checked before a failover cannot land after it.
        let from = r.from;
        let copies = self.facts.copies();
        let mut applied = copies.lock(bucket);
        let state = self.control.state();
        if !holds_replica(&state, self.me, bucket, from) {
            return ReplicaAnswer::Fenced {
                map_version: state.map.version,
                reason: format!(
                    "fenced: at map {} bucket {bucket} is owned by {:?} and node {} is not its replica holder",
                    state.map.version,
                    state.map.owner_of(bucket),
                    self.me
                ),
            };
        }
        if applied.0 == from && r.seq <= applied.1 {
            // A request held up in the network after a newer one: the sender re-sends the bucket.
            return ReplicaAnswer::NeedSnapshot("a newer request of this sender was applied already".into());
        }
        if !r.snapshot && copies.source(bucket) != from {
            return ReplicaAnswer::NeedSnapshot("no snapshot of this bucket yet".into());
        }
        *applied = (from, r.seq);
        if r.snapshot {
            copies.forget(bucket);
            self.replica.take_bucket(bucket);
        }
        self.replica.apply_changes(bucket, &changes);
        if r.snapshot {
            self.replica.raise_version_counter(bucket, counter);
            copies.keep(bucket, from, state.epoch_of(bucket));
        }
        ReplicaAnswer::Applied
    }
}
