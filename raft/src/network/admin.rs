//! The admin protocol between nodes: join (register, then admit) and leave.
//!
//! Any member accepts an [`AdminRequest`] on its peer listener and forwards it to the Raft
//! leader, which serializes membership changes (see `raft/DESIGN.md`).

use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::{ControlRpc, ControlTransport, TransportError};

use crate::distribution::NodeId;
use crate::error::ControlError;
use crate::state::ReplicationMode;

/// A membership request, handled by the leader.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum AdminRequest {
    /// Step 1 of a join: allocate an id for a node at these addresses.
    Register {
        /// The joiner's client API address.
        api_addr: String,
        /// The joiner's internal address.
        peer_addr: String,
        /// A name for people and tools (the pod name in a StatefulSet); optional.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        name: Option<String>,
    },
    /// Step 2 of a join: the registered node now runs Raft under its id; make it a learner,
    /// wait until it has caught up, then make it a member (and a voter if there is room).
    Admit {
        /// The id from step 1.
        node_id: NodeId,
        /// Even while a transition or transfer runs.
        #[serde(default)]
        force: bool,
    },
    /// Start a member's leave: its buckets move to the others, then its id is retired.
    Leave {
        /// The member that leaves.
        node_id: NodeId,
        /// Even while a transition or transfer runs.
        #[serde(default)]
        force: bool,
    },
    /// A member applied the pending map of a transition.
    Ack {
        /// The member.
        node_id: NodeId,
        /// The pending map's version.
        to_version: u64,
    },
    /// A bucket's new owner holds its data: flip the bucket to it.
    Moved {
        /// The bucket.
        bucket: u16,
        /// Its server so far.
        from: NodeId,
        /// Its new server.
        to: NodeId,
        /// Its move epoch when the transfer started.
        epoch: u64,
    },
    /// Cancel the move of a bucket started at `epoch`.
    Abort {
        /// The bucket.
        bucket: u16,
        /// The move's epoch.
        epoch: u64,
    },
    /// Clear the state-transfer flag (the stuck detector).
    ClearTransferFlag {
        /// Why.
        reason: String,
    },
    /// Change the cluster's replication mode.
    SetReplication {
        /// The new mode.
        mode: ReplicationMode,
    },
    /// Turns automatic balancing by data on or off.
    SetAutoBalance {
        /// On or off.
        enabled: bool,
    },
    /// Starts a transition to a map balanced by data (see `ClusterCommand::Rebalance`).
    Rebalance {
        /// The serving map's version the plan was made on.
        from_version: u64,
        /// The new owner of every bucket.
        owners: Vec<NodeId>,
    },
    /// A leaving member's replica is in sync: its replica holder serves its buckets now.
    HandOver {
        /// The leaving member.
        node_id: NodeId,
        /// The heir it checked its replica at, and the heir's holding period then.
        #[serde(default)]
        heir: Option<(NodeId, u64)>,
    },
    /// The heir of promoted buckets reports which it held a copy of.
    Promoted {
        /// The heir.
        node_id: NodeId,
        /// Buckets now served from the promoted copy.
        buckets: Vec<u16>,
        /// Buckets of which it held no copy.
        lost: Vec<u16>,
    },
    /// Every bucket `owner` serves is attached at the holder join order names for it: that
    /// holder holds its replica from now on.
    ReplicaMoved {
        /// The owner.
        owner: NodeId,
        /// Its new replica holder.
        holder: NodeId,
    },
    /// Which lost buckets did `node_id` serve last, and who owns them? (A failed node that
    /// returns asks, to give them back before it rejoins.) Answered from the leader's state.
    LostOf {
        /// The returned node.
        node_id: NodeId,
    },
    /// The leader's read index: it confirms with a majority that it still leads and answers
    /// the higher of its term's first entry and its commit index. A node that applied the log
    /// up to it has seen everything committed before the leader's term (a restarted node
    /// catches up to it before it restores its buckets).
    ReadIndex,
    /// `owner` installed the copies `from` gave back of these lost buckets.
    Found {
        /// The owner.
        owner: NodeId,
        /// The returned last server.
        from: NodeId,
        /// The buckets.
        buckets: Vec<u16>,
        /// The heir the owner sent the copies to, and its holding period then.
        #[serde(default)]
        heir: Option<(NodeId, u64)>,
    },
    /// An operator acknowledges lost buckets (all when empty).
    ClearLost {
        /// The buckets.
        buckets: Vec<u16>,
    },
    /// A member stops (SIGTERM) and gives up its Raft vote, so that leadership and the
    /// quorum move to members that stay while it is away; it asks for its vote back when it
    /// restarts as the same member (`draining: false`).
    SetDraining {
        /// The member.
        node_id: NodeId,
        /// Whether it is stopping.
        draining: bool,
    },
    /// A member prepares for maintenance until `until_ms`.
    EnterMaintenance {
        /// The member.
        node_id: NodeId,
        /// Now, in ms since the Unix epoch.
        since_ms: u64,
        /// The end of the period, in ms since the Unix epoch.
        until_ms: u64,
    },
    /// The member preparing for maintenance, its replica in sync at `heir`, goes away.
    MaintenanceReady {
        /// The member.
        node_id: NodeId,
        /// The heir it checked and the heir's holding period.
        heir: (NodeId, u64),
    },
    /// End the maintenance of `node_id` (early, or because its time ran out).
    EndMaintenance {
        /// The member.
        node_id: NodeId,
        /// Why, for the log.
        reason: String,
    },
}

/// The leader's answer to an [`AdminRequest`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum AdminResponse {
    /// The joiner's new id and the cluster it belongs to.
    Registered {
        /// The allocated id.
        node_id: NodeId,
        /// The cluster's id.
        cluster_id: String,
    },
    /// The node is a member; the map now has this version.
    Admitted {
        /// The map version that includes the new member.
        map_version: u64,
    },
    /// The node is leaving: the pending map without it has this version; the node stops
    /// once its buckets have moved.
    Left {
        /// The version of the pending map without the member.
        map_version: u64,
    },
    /// The request was applied; nothing to report.
    Done,
    /// The bucket moved; the serving map has this version.
    Moved {
        /// The serving map's version.
        map_version: u64,
    },
    /// These lost buckets were acknowledged (they serve again, empty).
    Cleared {
        /// The buckets, ascending.
        buckets: Vec<u16>,
    },
    /// The lost buckets a node served last.
    LostOf {
        /// Each bucket, its owner and the owner's internal address.
        buckets: Vec<LostBucket>,
        /// Buckets it served last whose heir has not said yet whether it holds a copy (they
        /// may still turn lost).
        #[serde(default)]
        pending: usize,
    },
    /// See [`AdminRequest::ReadIndex`].
    ReadIndex {
        /// The log index.
        index: u64,
    },
}

/// A lost bucket and where to give its copy back.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LostBucket {
    /// The bucket.
    pub bucket: u16,
    /// Its owner.
    pub owner: NodeId,
    /// The owner's internal address.
    pub peer_addr: String,
}

/// What the cluster says about a node id (asked by a node that restarts).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MemberStatus {
    /// A current member.
    Member,
    /// Registered, not yet admitted.
    Registered,
    /// Left or was removed; the id may never be used again.
    Retired,
    /// Declared failed by a majority; the node must rejoin as a new member.
    Failed,
    /// Never seen by this cluster.
    Unknown,
}

/// Sends admin requests to a member's peer address, through the node's transport.
#[derive(Clone)]
pub struct AdminClient {
    transport: Arc<dyn ControlTransport>,
    timeout: Duration,
}

/// How long a member may take to say what it knows of a node id.
const STATUS_TIMEOUT: Duration = Duration::from_secs(2);

impl AdminClient {
    /// A client whose requests give up after `timeout`.
    pub fn new(transport: Arc<dyn ControlTransport>, timeout: Duration) -> Self {
        AdminClient { transport, timeout }
    }

    /// Sends `request` to the node at `peer_addr`, which handles it or forwards it to the
    /// leader.
    pub async fn call(&self, peer_addr: &str, request: &AdminRequest) -> Result<AdminResponse, ControlError> {
        self.post(peer_addr, request, false).await
    }

    /// Sends `request` to the node at `peer_addr`, believed to be the leader: it handles the
    /// request or answers `NotLeader`, but never forwards it again.
    pub async fn call_leader(&self, peer_addr: &str, request: &AdminRequest) -> Result<AdminResponse, ControlError> {
        self.post(peer_addr, request, true).await
    }

    async fn post(
        &self,
        peer_addr: &str,
        request: &AdminRequest,
        forwarded: bool,
    ) -> Result<AdminResponse, ControlError> {
        let body = serde_json::to_vec(request).map_err(|e| network(peer_addr, &e))?;
        let rpc = ControlRpc::Admin { forwarded };
        let answer = self.transport.control(peer_addr, None, rpc, body, self.timeout).await.map_err(|e| match e {
            // Asking again (or another node of the same version) would be refused again.
            TransportError::BadRequest(reason) => {
                ControlError::Rejected { reason: format!("peer {peer_addr} could not read the request: {reason}") }
            }
            e => network(peer_addr, &e),
        })?;
        let result: Result<AdminResponse, ControlError> =
            serde_json::from_slice(&answer).map_err(|e| network(peer_addr, &e))?;
        result
    }

    /// Asks the node at `peer_addr` what its cluster knows of `node_id`.
    pub async fn member_status(&self, peer_addr: &str, node_id: NodeId) -> Result<MemberStatus, ControlError> {
        let rpc = ControlRpc::MemberStatus { node_id };
        let answer = self
            .transport
            .control(peer_addr, None, rpc, Vec::new(), STATUS_TIMEOUT)
            .await
            .map_err(|e| network(peer_addr, &e))?;
        serde_json::from_slice(&answer).map_err(|e| network(peer_addr, &e))
    }
}

fn network(peer: &str, e: &dyn std::error::Error) -> ControlError {
    ControlError::Network { peer: peer.to_string(), detail: e.to_string() }
}
