//! The holder's side of replication: the [`ReplicaHolder`] (the replica store, requests
//! applied to it fenced by the map, promotion, drops, mirror reads) and its messages
//! ([`Replicate`], [`ReplicateBatch`]).

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use serde::{Deserialize, Serialize};
use shoal_raft::{BucketId, NodeId};

use super::reports::OwnerReports;
use super::{reported_lag, ReplicaReport};
use crate::cache::CacheStore;
use crate::error::NotFresh;
use crate::phase::{holds_replica, keeps_replica, LocalFacts, ReplicaFacts};
use crate::transport::frame::{decode_body, snapshot_body};
use crate::transport::wire::{self, Handlers};
use crate::transport::{Endpoint, Malformed};
use shoal_raft::{ClusterState, ControlPlane};

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
pub fn register(handlers: &mut Handlers, holder: &Arc<ReplicaHolder>) {
    handlers.add_with(holder, |r, request: Replicate| async move { Ok(r.receive(request).await) });
    handlers.add_with(holder, |r, ReplicateBatch(requests)| async move {
        Ok(futures::future::join_all(requests.into_iter().map(|w| r.receive(w))).await)
    });
}

/// This node as the holder of other members' replicas: the replica store (limited like the
/// active one), what each owner last said of its replica, and the requests applied to it.
pub struct ReplicaHolder {
    pub(super) me: NodeId,
    pub(super) control: ControlPlane,
    pub(super) active: Arc<CacheStore>,
    replica: Arc<CacheStore>,
    pub(super) facts: Arc<LocalFacts>,
    reports: OwnerReports,
}

impl ReplicaHolder {
    /// A holder with a replica store of `limit_bytes`, beside `active`.
    pub fn new(control: ControlPlane, active: Arc<CacheStore>, limit_bytes: u64, facts: Arc<LocalFacts>) -> Arc<Self> {
        let replica = Arc::new(active.sibling(limit_bytes));
        Arc::new(ReplicaHolder {
            me: control.node_id(),
            control,
            active,
            replica,
            facts,
            reports: OwnerReports::default(),
        })
    }

    /// The replica store.
    pub fn replica(&self) -> &Arc<CacheStore> {
        &self.replica
    }

    /// The replica of `bucket` if it is a snapshot of `owner`'s (a restarted owner restores
    /// from it).
    pub(super) fn replica_snapshot(&self, bucket: BucketId, owner: NodeId) -> Option<Bytes> {
        (self.facts.copies().source(bucket) == owner).then(|| snapshot_body(&self.replica, bucket))
    }

    /// Drops the replica copy of `bucket` if it is still `source`'s and the newest state keeps
    /// it no longer (the reconciler planned the drop on a state read before its facts: a
    /// snapshot that landed in between, accepted on a newer state, must stay); answers whether
    /// it dropped it. Under the apply lock, like the fence of [`Self::receive`].
    pub fn drop_replica(&self, bucket: BucketId, source: NodeId) -> bool {
        let _applying = self.facts.copies().lock(bucket);
        if self.facts.copies().source(bucket) != source || keeps_replica(&self.control.state(), self.me, bucket, source)
        {
            return false;
        }
        self.facts.copies().forget(bucket);
        self.replica.take_bucket(bucket);
        true
    }

    /// Turns the replica copy of the promoted `bucket` into active data, if the copy came
    /// from `from` (the member whose bucket it was); answers whether it did. Under the
    /// holder's bucket lock: no replication request lands in between.
    pub fn install_promoted(&self, bucket: BucketId, from: NodeId) -> bool {
        let _applying = self.facts.copies().lock(bucket);
        if self.facts.copies().source(bucket) != from {
            return false;
        }
        self.facts.copies().forget(bucket);
        let items = self.replica.take_bucket(bucket);
        self.active.install_bucket(bucket, items);
        self.facts.install(&self.control.state(), bucket);
        // Its replica (on this node's holder) gets the installed data, whole.
        self.facts.attached().detach(bucket);
        true
    }

    /// Records what owner `from` said of its replica (None: nothing that lets a copy serve).
    pub fn note_lag(&self, from: NodeId, report: Option<ReplicaReport>) {
        self.reports.note(from, report);
    }

    /// What this node knows of its replica copy of `bucket` from `owner` (see
    /// [`crate::phase::ReplicaFacts`]). How far behind: unknown unless the owner's latest
    /// report names this node, in its current holding period, as the holder whose copy has
    /// every bucket; then, with sync replication, nothing unless the owner still drains a
    /// queue (writes from before a switch from async); with async replication, what the owner
    /// said plus the time since (rounded up, at least a millisecond: changes may have been
    /// queued since, so `max_staleness=0` keeps async reads with the owner).
    pub fn replica_facts(&self, state: &ClusterState, bucket: BucketId, owner: NodeId) -> ReplicaFacts {
        let said = self.reports.said(owner);
        let lag_ms = said.and_then(|(at, report)| {
            let since_ms = (at.elapsed().as_micros() as u64).div_ceil(1000);
            reported_lag(report?, self.me, state.replica_period(owner, self.me), state.settings.replication, since_ms)
        });
        ReplicaFacts { source: self.facts.copies().source(bucket), epoch: self.facts.copies().epoch(bucket), lag_ms }
    }

    /// Reads `key` from the replica copy of `bucket` if `fresh` says the copy may serve it
    /// (given what this node knows of the copy from `owner`), answering what it said. Under the
    /// bucket's apply lock: a snapshot being applied (the bucket emptied, then refilled) is
    /// never seen half-way.
    pub fn mirror_get<T>(
        &self,
        state: &ClusterState,
        bucket: BucketId,
        owner: NodeId,
        key: &[u8],
        fresh: impl FnOnce(ReplicaFacts) -> Result<T, NotFresh>,
    ) -> Result<(Option<crate::cache::ItemView>, T), NotFresh> {
        let _applying = self.facts.copies().lock(bucket);
        let said = fresh(self.replica_facts(state, bucket, owner))?;
        Ok((self.replica.get(bucket, key), said))
    }
}

/// How long the holder waits to apply the sender's map version.
const MAP_CATCH_UP: Duration = Duration::from_secs(2);

impl ReplicaHolder {
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
