//! A bucket's phase on this node: the pure decisions of the bucket core — from the replicated
//! state, this node's facts about a bucket and about itself, what the node does with the
//! bucket — and the facts they read ([`LocalFacts`]). No I/O, no locks, no clock in the
//! decisions: every function here is a function of its arguments, tested as such. Everything
//! that acts on a bucket (the bucket core, replication, transfer, failure detection) decides
//! here, and this module imports none of them.

mod copies;
mod facts;

pub use copies::Attachment;
pub use facts::LocalFacts;

use shoal_raft::{BucketId, ClusterState, NodeId};

use crate::error::{DataError, NotFresh};

/// What this node knows of one bucket that the replicated state does not say.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BucketFacts {
    /// It restarted and has not got the bucket back from a copy elsewhere yet.
    pub restoring: bool,
    /// A failover or hand-over gave it the bucket, and it has installed its copy (it serves
    /// it once the cluster knows: its report is committed).
    pub installed: bool,
}

/// What this node knows of itself that decides whether it may acknowledge a write.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct NodeFacts {
    /// A peer said the cluster failed this node.
    pub failed: bool,
    /// It pauses its writes to hand its buckets over (it leaves).
    pub handing_over: bool,
    /// It is stopping.
    pub draining: bool,
    /// It has not heard from a majority of the members within the node timeout: (heard,
    /// members).
    pub no_quorum: Option<(usize, usize)>,
}

/// A bucket's local phase on this node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// No map yet: the node is not a member of a cluster.
    NoMap,
    /// Both copies died together: nobody serves it until an operator clears it.
    Lost,
    /// This node owns it and holds its data: it serves it.
    Serving,
    /// This node owns it but lost its data in a restart: it gets it back from a copy first.
    Restoring,
    /// A failover or hand-over gave it to this node, which has not installed its copy yet.
    AwaitingPromotion,
    /// The target map gives it to this node; `from` serves it meanwhile (the data is pulled).
    Incoming {
        /// Who serves it now.
        from: NodeId,
    },
    /// This node is in maintenance and has not come back: `owner` (the holder of its replica)
    /// serves the bucket meanwhile; this node keeps nothing and pulls nothing until it returns.
    Away {
        /// Who serves it.
        owner: NodeId,
    },
    /// This node handed it to `owner` in the running transfer and keeps a shadow copy.
    Shadow {
        /// Who serves it now.
        owner: NodeId,
    },
    /// Another node serves it and this node holds the replica its writes must reach, while
    /// the bucket is not moving: it may serve reads from that copy when the copy is fresh
    /// (see [`mirror_read`]). Its active store keeps nothing of it.
    Mirror {
        /// Who serves it.
        owner: NodeId,
    },
    /// Another node serves it; this node keeps nothing of it in its active store.
    Foreign {
        /// Who serves it.
        owner: NodeId,
    },
}

/// The phase of `bucket` on node `me` (see [`Phase`]).
pub fn phase_of(state: &ClusterState, me: NodeId, bucket: BucketId, facts: BucketFacts) -> Phase {
    let Some(owner) = state.map.owner_of(bucket) else { return Phase::NoMap };
    if state.is_lost(bucket) {
        return Phase::Lost;
    }
    if owner == me {
        if facts.restoring {
            return Phase::Restoring;
        }
        // Until the heir's report is committed, even once it installed its copy: so Raft
        // knows who served the bucket last (`ClusterState::last_server`) if the heir fails
        // before.
        if !state.promoted.is_empty() && state.promoted.contains_key(&bucket.0) {
            return Phase::AwaitingPromotion;
        }
        return Phase::Serving;
    }
    if state.away() == Some(me) {
        return Phase::Away { owner };
    }
    if state.target.as_ref().and_then(|t| t.owner_of(bucket)) == Some(me) {
        return Phase::Incoming { from: owner };
    }
    if state.shadow_of(bucket) == Some(me) {
        return Phase::Shadow { owner };
    }
    if mirrors_of(state, bucket).1 == Some(me) {
        return Phase::Mirror { owner };
    }
    Phase::Foreign { owner }
}

/// The mirrors of `bucket` on `state`: its owner, and the member holding the replica every
/// write of the owner must reach (the heir), unless the bucket is moving (a transition gives
/// it to another node, a shadow is kept, a promotion runs), it is lost, or the owner is away
/// in maintenance. Reads with `read=mirrors` go to one of them.
pub fn mirrors_of(state: &ClusterState, bucket: BucketId) -> (Option<NodeId>, Option<NodeId>) {
    let Some(owner) = state.map.owner_of(bucket) else { return (None, None) };
    let moving = state.target.as_ref().is_some_and(|t| t.owner_of(bucket) != Some(owner))
        || state.shadow_of(bucket).is_some()
        || state.promoted.contains_key(&bucket.0)
        || state.is_lost(bucket)
        || state.away() == Some(owner);
    let holder = state.heir_of(owner).filter(|&h| h != owner && state.is_member(h) && !moving);
    (Some(owner), holder)
}

/// What a replica holder knows of its copy of a bucket that the replicated state does not say.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ReplicaFacts {
    /// The owner whose snapshot the copy started from (0: none), in the bucket's move epoch
    /// `epoch` of the holder's map then.
    pub source: NodeId,
    /// See `source`.
    pub epoch: u64,
    /// Async replication: at most how far behind its owner the copy is, in milliseconds, as
    /// the owner last said (its oldest change not yet applied here, plus the time since it
    /// said so); None when the owner said nothing lately or has buckets not attached here.
    /// With sync replication: Some(0) unless the owner still drains a queue.
    pub lag_ms: Option<u64>,
}

/// Whether this node's replica copy of a bucket in `phase` may serve a read that allows
/// `max_staleness_ms` (async replication), and if so how far behind it may be: the node is a
/// mirror, the copy started from the current owner's snapshot in the bucket's current move
/// epoch (so, sync, it has every write the owner acknowledged since), and it is not further
/// behind than allowed.
pub fn mirror_read(
    state: &ClusterState,
    bucket: BucketId,
    phase: Phase,
    replica: ReplicaFacts,
    max_staleness_ms: u64,
) -> Result<u64, NotFresh> {
    let Phase::Mirror { owner } = phase else { return Err(NotFresh::NotMirror) };
    if replica.source != owner || replica.epoch != state.epoch_of(bucket) {
        return Err(NotFresh::NotAttached);
    }
    match replica.lag_ms {
        Some(lag) if lag <= max_staleness_ms => Ok(lag),
        lag_ms => Err(NotFresh::Behind { lag_ms }),
    }
}

/// Whether what node `me` pulls of `bucket` from `from` for the move at `epoch` may still go
/// into its active store on `state`: the bucket is still incoming here from `from` in that
/// move (as the reconciler plans pulls: `ClusterState::incoming_of`). Once it is not, the pull's data is stale: the move was aborted, or its source failed
/// and the bucket was promoted (here or elsewhere) and written since. A source cut off from the
/// cluster, which has not learned that, answers a pull with its old copy when the link heals;
/// written into a bucket this node now serves, that copy would bring back values older than
/// writes it acknowledged.
pub fn pull_lands(state: &ClusterState, me: NodeId, bucket: BucketId, from: NodeId, epoch: u64) -> bool {
    state.epoch_of(bucket) == epoch && state.incoming_from(bucket, me) == Some(from)
}

impl Phase {
    /// Whether this node holds data of the bucket in its active store that must stay: it
    /// serves it, gets it, pulls it, or shadows it. (A restoring bucket is being refilled;
    /// a lost one may hold the newest copy there is.)
    pub fn keeps_active_data(self) -> bool {
        !matches!(self, Phase::Foreign { .. } | Phase::Mirror { .. } | Phase::Away { .. } | Phase::NoMap)
    }

    /// Whether the node serves the bucket's data (reads and, with a write plan, writes).
    pub fn serves(self) -> bool {
        self == Phase::Serving
    }
}

/// Whether node `me` may hold `source`'s replica copy of `bucket` on `state`: `source` is a
/// member that owns the bucket, and `me` holds its replica (the complete holder, or the one
/// join order names). The holder applies replication requests only then.
pub fn holds_replica(state: &ClusterState, me: NodeId, bucket: BucketId, source: NodeId) -> bool {
    let holder = state.replica_of(source) == Some(me) || state.committed_holder_of(source) == Some(me);
    holder && state.map.owner_of(bucket) == Some(source) && state.is_member(source)
}

/// Whether node `me` keeps `source`'s replica copy of `bucket` on `state`: it holds it for
/// `source` (see [`holds_replica`]), or a promotion of the bucket still needs it. A copy is
/// dropped only when this is false on the newest state, checked where the drop happens: the
/// copy may have arrived after the state the reconciler planned on.
pub fn keeps_replica(state: &ClusterState, me: NodeId, bucket: BucketId, source: NodeId) -> bool {
    state.promoted.contains_key(&bucket.0) || holds_replica(state, me, bucket, source)
}

/// How a key request that reached this node is routed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Routing {
    /// Another node forwarded it, routing by this map version: serve it here or refuse.
    pub forwarded: bool,
    /// The client asked to be redirected instead of forwarded.
    pub redirect: bool,
}

/// Where a key operation on a bucket runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Route {
    /// Here.
    Local,
    /// At the owner, in one hop.
    Forward {
        /// The owner.
        owner: NodeId,
    },
    /// The client goes to the owner itself.
    Redirect {
        /// The owner.
        owner: NodeId,
    },
}

/// Where a key operation on `bucket` in `phase` runs, given how it reached this node, what
/// the node knows of itself (a bucket is served here only while the node holds its lease) and
/// whether this node suspects the owner (a fast 503 instead of a forward that would wait).
pub fn route_of(
    state: &ClusterState,
    bucket: BucketId,
    phase: Phase,
    routing: Routing,
    node: NodeFacts,
    owner_suspected: bool,
) -> Result<Route, DataError> {
    match phase {
        Phase::NoMap => Err(DataError::NotReady),
        Phase::Lost => Err(DataError::Lost(bucket)),
        Phase::Serving => match read_refusal(node) {
            Some(refusal) => Err(refusal),
            None => Ok(Route::Local),
        },
        Phase::Restoring | Phase::AwaitingPromotion => Err(DataError::Restoring(bucket)),
        Phase::Incoming { from: owner }
        | Phase::Shadow { owner }
        | Phase::Foreign { owner }
        | Phase::Mirror { owner }
        | Phase::Away { owner } => {
            if routing.forwarded {
                return Err(DataError::NotOwner { bucket, map_version: state.map.version });
            }
            if routing.redirect {
                return Ok(Route::Redirect { owner });
            }
            if owner_suspected {
                return Err(DataError::OwnerUnreachable { owner, bucket });
            }
            Ok(Route::Forward { owner })
        }
    }
}

/// Why this node may serve no read now, whatever the bucket: the cluster failed it, or it has
/// not heard from a majority within the node timeout, so its buckets may have been given to
/// others and written there meanwhile (a read here could go back in time). A node that stops
/// or hands over still owns its buckets until they flip, and reads them. A stopping node that
/// no longer hears a majority (one that left the cluster hears nobody in its last moments)
/// says that it stops: the client's answer is to go to another node.
pub fn read_refusal(node: NodeFacts) -> Option<DataError> {
    if node.failed {
        return Some(DataError::NodeFailed);
    }
    if node.draining && node.no_quorum.is_some() {
        return Some(DataError::NodeDraining);
    }
    node.no_quorum.map(|(heard, members)| DataError::NoQuorum { heard, members })
}

/// Why this node may acknowledge no write now, whatever the bucket.
pub fn write_refusal(node: NodeFacts) -> Option<DataError> {
    if node.failed {
        return Some(DataError::NodeFailed);
    }
    if node.handing_over {
        return Some(DataError::NodeLeaving);
    }
    if node.draining {
        return Some(DataError::NodeDraining);
    }
    node.no_quorum.map(|(heard, members)| DataError::NoQuorum { heard, members })
}

/// A node a write must reach (a copy of the bucket) before it is acknowledged.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Recipient {
    /// The node.
    pub node: NodeId,
    /// Its peer address.
    pub peer_addr: String,
    /// For a replica holder, the holding period it is in (`ClusterState::replica_periods`):
    /// a bucket it was sent in an earlier period is gone there (it stopped holding and
    /// dropped it). 0 for a shadow.
    pub period: u64,
}

/// Who gets a write to a bucket, as decided on one map.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WritePlan {
    /// The bucket.
    pub bucket: BucketId,
    /// The map version it was decided on.
    pub map_version: u64,
    /// The bucket's move epoch then: the ownership period the write belongs to.
    pub epoch: u64,
    /// The holder of the owner's complete replica (else the one join order names): every
    /// write must reach it (sync: before the answer; async: queued).
    pub replica: Option<Recipient>,
    /// The holder join order names, while it is not yet the complete one: it gets the writes
    /// of buckets already sent to it whole, and a failure there fails no write.
    pub next_replica: Option<Recipient>,
    /// The node that handed the bucket over in the running transfer and keeps a shadow.
    pub shadow: Option<Recipient>,
    /// Whether the map gives this node the bucket (not only a phase that serves it, as the
    /// holder serving a member away in maintenance).
    pub owner_in_map: bool,
}

impl WritePlan {
    /// Whether the write reaches another node (and so must be serialized per bucket).
    pub fn has_copies(&self) -> bool {
        self.replica.is_some() || self.next_replica.is_some() || self.shadow.is_some()
    }
}

/// May node `me` write `bucket` now, and who must get a copy of the write?
///
/// Yes only if the node may acknowledge writes at all ([`write_refusal`]) and the bucket is
/// [`Phase::Serving`] here; the copies are the holder of the node's complete replica (or,
/// without one, the member after it in join order), the member join order names while it is
/// not the complete one yet, and, during a transfer, the shadow the previous owner keeps. A
/// bucket this node does not serve is refused with why; the caller routes it.
pub fn write_plan(
    state: &ClusterState,
    me: NodeId,
    bucket: BucketId,
    facts: BucketFacts,
    node: NodeFacts,
) -> Result<WritePlan, DataError> {
    writable(state, me, bucket, facts, node)?;
    let copy_of = |node: NodeId| {
        let period = state.replica_period(me, node).unwrap_or(0);
        state.member_of(node).map(|m| Recipient { node, peer_addr: m.peer_addr.clone(), period })
    };
    let (required, next) = replica_holders(state, me);
    let shadow = state.shadow_of(bucket).filter(|&s| s != me).and_then(copy_of);
    Ok(WritePlan {
        bucket,
        map_version: state.map.version,
        epoch: state.epoch_of(bucket),
        replica: required.and_then(copy_of),
        next_replica: next.and_then(copy_of),
        shadow,
        owner_in_map: state.map.owner_of(bucket) == Some(me),
    })
}

/// Whether node `me` may write `bucket` now (the first half of [`write_plan`]): it may
/// acknowledge writes at all and serves the bucket; if not, why.
pub fn writable(
    state: &ClusterState,
    me: NodeId,
    bucket: BucketId,
    facts: BucketFacts,
    node: NodeFacts,
) -> Result<(), DataError> {
    if let Some(refusal) = write_refusal(node) {
        return Err(refusal);
    }
    let phase = phase_of(state, me, bucket, facts);
    match route_of(state, bucket, phase, Routing { forwarded: true, redirect: false }, node, false)? {
        Route::Local => Ok(()),
        // Unreachable with `forwarded`: route_of refuses instead.
        Route::Forward { .. } | Route::Redirect { .. } => {
            Err(DataError::NotOwner { bucket, map_version: state.map.version })
        }
    }
}

/// The replica holders every write of `me`'s buckets goes to (the same for all of them): the
/// holder of its complete replica (else the member join order names), and the one join order
/// names while it is not the complete one yet. Members only.
pub fn replica_holders(state: &ClusterState, me: NodeId) -> (Option<NodeId>, Option<NodeId>) {
    let desired = state.replica_of(me).filter(|&h| h != me);
    let required = state.committed_holder_of(me).or(desired);
    let next = desired.filter(|&d| Some(d) != required);
    let member = |h: &NodeId| state.member_of(*h).is_some();
    (required.filter(member), next.filter(member))
}

/// Whether writes done under `plan` (decided by node `me` on an earlier state) may still count
/// on `state`, a state seen after they went into the store: the bucket is still served here.
/// If not, `NotOwner` (the writes are routed again): a move of the bucket was applied here
/// between the plan and the writes, and once applied the bucket thaws here, so the writes
/// landed in the copy this node keeps as the shadow, while the new owner's copy, streamed
/// before, does not have them. (A move aborted meanwhile changes the epoch, not the server: the
/// writes count, and the next pull takes a new snapshot.)
pub fn plan_holds(state: &ClusterState, me: NodeId, plan: &WritePlan) -> Result<(), DataError> {
    let bucket = plan.bucket;
    if phase_of(state, me, bucket, BucketFacts::default()) == Phase::Serving {
        return Ok(());
    }
    Err(DataError::NotOwner { bucket, map_version: state.map.version })
}

#[cfg(test)]
mod tests;
