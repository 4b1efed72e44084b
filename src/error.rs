//! [`DataError`]: why the data plane did not serve a key operation, typed; it becomes the
//! public API's [`ApiError`] in one place ([`From<DataError> for ApiError`]), at the edge.

use shoal_http_api::{ApiError, Unavailable};
use shoal_raft::{BucketId, NodeId};

use crate::cache::CacheError;
use crate::transport::CallError;

/// Why a replica holder did not apply a write or a bucket sent whole.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ReplicaError {
    /// The request got no usable answer.
    #[error(transparent)]
    Call(#[from] CallError),
    /// The holder has no snapshot of the bucket from this node: it must be sent whole.
    #[error("the replica needs the bucket whole: {0}")]
    NeedsSnapshot(String),
    /// In the holder's map (this version), this node does not own the bucket or the holder
    /// is not its replica.
    #[error("fenced by the replica's map (version {0})")]
    Fenced(u64),
    /// The holder refused the request as malformed.
    #[error("the replica refused: {0}")]
    Refused(String),
    /// Fenced, and this node's newer map agrees: the bucket is no longer this node's.
    #[error("node {holder} refused the write: this node no longer owns bucket {bucket}")]
    NoLongerOwner {
        /// The holder.
        holder: NodeId,
        /// The bucket.
        bucket: BucketId,
    },
}

impl ReplicaError {
    /// Whether the holder may have applied the request all the same: it got it, or may have,
    /// and gave no answer (any answer, a refusal included, says it did not).
    pub fn may_have_applied(&self) -> bool {
        matches!(self, ReplicaError::Call(CallError::Timeout | CallError::Broken(_)))
    }
}

/// Why a key operation was not served here (nothing was changed unless said).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DataError {
    /// The node is not a member of a cluster with a map yet.
    #[error("this node has not joined a cluster yet")]
    NotReady,
    /// A forwarded request reached a node that does not own the bucket in its map.
    #[error("node does not own bucket {bucket} in map version {map_version}")]
    NotOwner {
        /// The bucket.
        bucket: BucketId,
        /// This node's map version.
        map_version: u64,
    },
    /// The client asked for a redirect and another node owns the key.
    #[error("the key is served by {api_addr}")]
    Redirect {
        /// The owner's API address.
        api_addr: String,
    },
    /// The bucket's owner and its replica failed together: no copy is left.
    #[error(
        "bucket {0} was lost: its owner and its replica failed together; POST /v1/cluster/lost/clear \
         acknowledges it and it serves again, empty"
    )]
    Lost(BucketId),
    /// This node owns the bucket but is still getting its data (after a restart or a failover).
    #[error("bucket {0} is being restored (after a restart or a failover); retry")]
    Restoring(BucketId),
    /// The bucket is frozen while it moves to another node.
    #[error("the key's bucket is moving to another node; retry")]
    Moving(BucketId),
    /// The bucket changed owner more often than a request routes again.
    #[error("bucket {0} is changing owner; retry")]
    MapChanging(BucketId),
    /// A client named a map version this node has not applied (it may not exist at all).
    #[error("this node's map is at version {have}, older than version {want} the request names; retry, or send it to another node")]
    MapBehind {
        /// This node's map version.
        have: u64,
        /// The version the request named.
        want: u64,
    },
    /// The owner does not answer pings.
    #[error("node {owner}, which owns bucket {bucket}, does not answer pings; retry")]
    OwnerUnreachable {
        /// The owner.
        owner: NodeId,
        /// The bucket.
        bucket: BucketId,
    },
    /// The cluster failed this node; it acknowledges nothing and rejoins.
    #[error("this node was failed by the cluster; it is rejoining")]
    NodeFailed,
    /// This node is handing its buckets over to their replica (it leaves).
    #[error("this node is handing its buckets over to their replica; retry in a moment")]
    NodeLeaving,
    /// This node is stopping.
    #[error("this node is stopping: it acknowledges no new write; its buckets serve again after its restart")]
    NodeDraining,
    /// This node has not heard from a majority of the members within the node timeout.
    #[error("this node has heard from {heard} of {members} members recently; it acknowledges no write")]
    NoQuorum {
        /// Members heard from (itself included).
        heard: usize,
        /// Members.
        members: usize,
    },
    /// The replica did not apply a write; the write was taken back.
    #[error("the replica (node {holder}) did not apply the write: {cause}; nothing was stored")]
    ReplicationFailed {
        /// The replica holder.
        holder: NodeId,
        /// What happened.
        cause: ReplicaError,
    },
    /// A write failed at the replica and was taken back here, but a node holding a copy of
    /// the bucket (a replica holder, or the previous owner during a transfer) could not be told
    /// to take it back too: it may hold the write, and serve it if it takes the bucket over.
    #[error("the write failed ({cause}) and node {holder}, which holds a copy of the bucket, could not be told to take it back: it may have stored it; read the key back or write it again")]
    ReplicationUnconfirmed {
        /// The node that may hold the write.
        holder: NodeId,
        /// What happened.
        cause: ReplicaError,
    },
    /// The previous owner, which keeps a copy of the bucket until the running transfer ends,
    /// did not take the write; the write was taken back.
    #[error("node {shadow}, which keeps a copy of bucket {bucket} until the running transfer ends, did not take the write: {cause}; nothing was stored")]
    ShadowFailed {
        /// The bucket.
        bucket: BucketId,
        /// The node keeping the shadow copy.
        shadow: NodeId,
        /// What happened.
        cause: CallError,
    },
    /// A mirror read reached a replica copy that may not serve it.
    #[error("{}", not_fresh(*bucket, *why))]
    ReplicaNotFresh {
        /// The bucket.
        bucket: BucketId,
        /// Why.
        why: NotFresh,
    },
    /// The store refused the write.
    #[error(transparent)]
    Store(#[from] CacheError),
}

/// Why a replica copy may not serve a read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NotFresh {
    /// This node is not a mirror of the bucket now (see `crate::phase::Phase::Mirror`).
    NotMirror,
    /// Its copy does not hold every write of the owner's current ownership period.
    NotAttached,
    /// Its copy may be further behind than the read allows.
    Behind {
        /// How far behind it may be (None: unknown).
        lag_ms: Option<u64>,
    },
}

fn not_fresh(bucket: BucketId, why: NotFresh) -> String {
    match why {
        NotFresh::NotMirror => format!("this node is not a mirror of bucket {bucket} now"),
        NotFresh::NotAttached => {
            format!("this node's replica copy of bucket {bucket} does not hold every write of its owner yet")
        }
        NotFresh::Behind { lag_ms: Some(lag) } => {
            format!("this node's replica copy of bucket {bucket} may be {lag} ms behind its owner, more than allowed")
        }
        NotFresh::Behind { lag_ms: None } => {
            format!("how far this node's replica copy of bucket {bucket} is behind its owner is not known")
        }
    }
}

impl From<DataError> for ApiError {
    fn from(e: DataError) -> Self {
        let unavailable = |code: Unavailable, e: &DataError| ApiError::unavailable(code, e.to_string());
        match e {
            DataError::NotReady => unavailable(Unavailable::NotReady, &e),
            DataError::NotOwner { bucket, map_version } => ApiError::NotOwner { bucket: bucket.0, map_version },
            DataError::Redirect { api_addr } => ApiError::Redirect { api_addr },
            DataError::Lost(_) => unavailable(Unavailable::BucketLost, &e),
            DataError::Restoring(_) => unavailable(Unavailable::BucketRestoring, &e),
            DataError::Moving(_) => unavailable(Unavailable::BucketMoving, &e),
            DataError::MapChanging(_) | DataError::MapBehind { .. } => unavailable(Unavailable::MapChanging, &e),
            DataError::OwnerUnreachable { .. } => unavailable(Unavailable::OwnerUnreachable, &e),
            DataError::NodeFailed => unavailable(Unavailable::NodeFailed, &e),
            DataError::NodeLeaving => unavailable(Unavailable::NodeLeaving, &e),
            DataError::NodeDraining => unavailable(Unavailable::NodeDraining, &e),
            DataError::NoQuorum { .. } => unavailable(Unavailable::NoQuorum, &e),
            DataError::ReplicationFailed { .. } | DataError::ShadowFailed { .. } => {
                unavailable(Unavailable::ReplicationFailed, &e)
            }
            DataError::ReplicationUnconfirmed { .. } => unavailable(Unavailable::OutcomeUnknown, &e),
            DataError::ReplicaNotFresh { .. } => unavailable(Unavailable::ReplicaNotFresh, &e),
            DataError::Store(CacheError::ConditionFailed { current }) => {
                ApiError::PreconditionFailed { current_version: current }
            }
            DataError::Store(CacheError::TooLarge { .. }) => ApiError::ItemTooLarge(e.to_string()),
            DataError::Store(CacheError::Full { .. }) => ApiError::InsufficientStorage(e.to_string()),
            DataError::Store(CacheError::Frozen) => unavailable(Unavailable::BucketMoving, &e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_refusal_keeps_its_code_and_a_retry_hint() {
        let b = BucketId(7);
        for (e, code) in [
            (DataError::Lost(b), "bucket_lost"),
            (DataError::Restoring(b), "bucket_restoring"),
            (DataError::Moving(b), "bucket_moving"),
            (DataError::NoQuorum { heard: 1, members: 3 }, "no_quorum"),
            (
                DataError::ReplicationFailed {
                    holder: 2,
                    cause: ReplicaError::Call(crate::transport::CallError::Timeout),
                },
                "replication_failed",
            ),
            (
                DataError::ReplicationUnconfirmed {
                    holder: 2,
                    cause: ReplicaError::Call(crate::transport::CallError::Timeout),
                },
                "outcome_unknown",
            ),
            (
                DataError::ShadowFailed { bucket: b, shadow: 2, cause: crate::transport::CallError::Timeout },
                "replication_failed",
            ),
            (DataError::NodeDraining, "node_draining"),
            (DataError::OwnerUnreachable { owner: 3, bucket: b }, "owner_unreachable"),
            (DataError::ReplicaNotFresh { bucket: b, why: NotFresh::NotAttached }, "replica_not_fresh"),
        ] {
            let api = ApiError::from(e);
            assert_eq!((api.code(), api.status().as_u16()), (code, 503));
        }
        let no_answer = [CallError::Timeout, CallError::Broken("reset".into())].map(ReplicaError::Call);
        assert!(no_answer.iter().all(ReplicaError::may_have_applied), "no answer is not no write");
        let answered = [
            ReplicaError::Call(CallError::Unreachable("refused".into())),
            ReplicaError::Fenced(3),
            ReplicaError::NeedsSnapshot("none".into()),
            ReplicaError::Refused("bad".into()),
        ];
        assert!(!answered.iter().any(ReplicaError::may_have_applied), "never sent, or refused: not applied");
        let api = ApiError::from(DataError::Store(CacheError::ConditionFailed { current: Some(4) }));
        assert_eq!(api, ApiError::PreconditionFailed { current_version: Some(4) });
    }
}
