//! The commands of the replicated control-plane state, and their responses.
//!
//! Every change to membership or to the distribution map is one of these, committed through
//! Raft and applied by [`ClusterState::apply`](crate::state::ClusterState::apply) on every
//! node in the same order. `raft/DESIGN.md` describes each with the invariants it keeps.

use serde::{Deserialize, Serialize};

use crate::distribution::NodeId;

/// What a log entry carries: a command, and when its proposer made it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Proposal {
    /// The command.
    #[serde(flatten)]
    pub command: ClusterCommand,
    /// The proposer's wall-clock time, in milliseconds since the Unix epoch: the time of the
    /// events the entry produces. Entries of earlier versions have none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub at_ms: Option<u64>,
}

impl Proposal {
    /// `command`, stamped with the time now.
    pub fn now(command: ClusterCommand) -> Self {
        let at_ms =
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64);
        Proposal { command, at_ms: Some(at_ms) }
    }
}

/// A change to the control-plane state.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ClusterCommand {
    /// The first entry of a cluster: its id, its settings, and its first member, which owns
    /// every bucket. Ignored if the cluster already exists.
    Bootstrap {
        /// A random id naming the cluster; a node of one cluster cannot join another.
        cluster_id: String,
        /// The first member's id (always 1).
        node_id: NodeId,
        /// The first member's client API address.
        api_addr: String,
        /// The first member's internal address.
        peer_addr: String,
        /// The first member's name for people and tools (the pod name in a StatefulSet); optional.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        name: Option<String>,
        /// How many members vote in Raft (3 or 5).
        voters: u8,
        /// How writes reach replicas (older logs have no such field: sync).
        #[serde(default)]
        replication: ReplicationMode,
    },
    /// Changes the replication mode of the whole cluster.
    SetReplication {
        /// The new mode.
        mode: ReplicationMode,
    },
    /// Turns automatic balancing by data on or off.
    SetAutoBalance {
        /// On or off.
        enabled: bool,
    },
    /// Starts a transition to a map balanced by data, planned by the leader from the
    /// members' bucket statistics on the serving map of `from_version`. Refused unless that
    /// is still the serving map, no transition, transfer or maintenance runs, and every
    /// owner is a member that stays.
    Rebalance {
        /// The serving map's version the plan was made on.
        from_version: u64,
        /// The new owner of every bucket.
        owners: Vec<NodeId>,
    },
    /// The leader's latest figures of each bucket's bytes, recorded before a membership change
    /// it proposes (a join, a leave, a failure), so that the map that change makes balances
    /// the bytes, not only the bucket counts. Nodes of older versions refuse it (the change
    /// then splits by count).
    RecordSizes {
        /// Bytes per bucket, by bucket number.
        sizes: Vec<u64>,
    },
    /// A majority of the members reported `node_id` unreachable: it is failed. Its buckets are
    /// served at once by the member holding its replica (promotion), its id is never used
    /// again, and a transition rebalances the map without it.
    NodeFailed {
        /// The failed member.
        node_id: NodeId,
    },
    /// A leaving member's replica is in sync: its buckets are served by the member holding
    /// that replica from now on, and state transfer spreads them from there.
    HandOver {
        /// The leaving member.
        node_id: NodeId,
        /// The heir the member checked its replica at, and that heir's holding period then:
        /// refused if the heir or its period changed since (the heir may have dropped the
        /// copies). Entries of earlier versions have none and are not checked.
        #[serde(default)]
        heir: Option<(NodeId, u64)>,
    },
    /// The heir of promoted buckets has turned its replica copies into active data, or found
    /// it holds no copy of some (they are lost: both copies are gone).
    Promoted {
        /// The heir.
        node_id: NodeId,
        /// Buckets whose replica copy became active data.
        buckets: Vec<u16>,
        /// Buckets of which the heir held no copy.
        lost: Vec<u16>,
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
    /// Every bucket `owner` serves is attached at the holder join order names for it
    /// (`replica_of`): that holder holds its replica from now on — it has every write the owner
    /// acknowledged, and inherits the owner's buckets if the owner fails — and the previous
    /// holder may drop its copy.
    ReplicaMoved {
        /// The owner.
        owner: NodeId,
        /// Its new replica holder.
        holder: NodeId,
    },
    /// A member that restarted found no copy left of buckets it owns. No longer proposed (a
    /// restarted owner now serves such buckets empty and says so in its log); kept so that
    /// logs written by earlier versions replay to the same state.
    BucketsLost {
        /// The member.
        node_id: NodeId,
        /// The buckets.
        buckets: Vec<u16>,
    },
    /// Lost buckets' last server returned after it was failed and gave its copy (the newest
    /// there is) to their owner, which installed it: they serve again. Only buckets still
    /// lost, last served by `from` and owned by `owner` change.
    Found {
        /// The owner that installed the copies.
        owner: NodeId,
        /// The returned last server.
        from: NodeId,
        /// The buckets.
        buckets: Vec<u16>,
        /// The heir the owner sent the copies to before, and that heir's holding period then:
        /// refused if the heir or its period changed since (the entry may commit after the
        /// owner's process died, and then the heir's copy is the only one). None: the owner
        /// had no heir, or an entry of an earlier version (not checked).
        #[serde(default)]
        heir: Option<(NodeId, u64)>,
    },
    /// An operator acknowledges lost buckets: they serve again, empty.
    ClearLost {
        /// The buckets (all lost buckets when empty).
        buckets: Vec<u16>,
    },
    /// A node asks to join: allocate it the next never-used id. It is not a member yet.
    Register {
        /// The joiner's client API address.
        api_addr: String,
        /// The joiner's internal address.
        peer_addr: String,
        /// A name for people and tools (the pod name in a StatefulSet); optional.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        name: Option<String>,
    },
    /// A registered node, now a Raft learner that has caught up, becomes a member: it is
    /// appended to the join order and a transition to a map that gives it its share starts.
    Admit {
        /// The id allocated by `Register`.
        node_id: NodeId,
        /// Start even while another membership change or a transfer runs.
        #[serde(default)]
        force: bool,
    },
    /// A member starts leaving: a transition to a map without it starts; it keeps serving
    /// its buckets until they have moved, then it is retired (its id never comes back).
    Remove {
        /// The member that leaves.
        node_id: NodeId,
        /// Start even while another membership change or a transfer runs.
        #[serde(default)]
        force: bool,
    },
    /// A member has applied the pending map of the transition to `to_version`.
    AckTransition {
        /// The member.
        node_id: NodeId,
        /// The version of the pending map it applied.
        to_version: u64,
    },
    /// Every member acknowledged: the pending map becomes the target and state transfer
    /// starts (the leader commits this).
    EndTransition {
        /// The version of the pending map.
        to_version: u64,
    },
    /// A bucket's data is now held by its new owner, which serves it from now on.
    BucketMoved {
        /// The bucket.
        bucket: u16,
        /// The node that served it.
        from: NodeId,
        /// The node that serves it now.
        to: NodeId,
        /// The bucket's move epoch when the transfer started; a move whose epoch is stale
        /// (another move or an abort came first) is rejected.
        epoch: u64,
    },
    /// Cancels whatever move of `bucket` started at `epoch` (its source gives up waiting).
    AbortMove {
        /// The bucket.
        bucket: u16,
        /// The epoch of the move to cancel.
        epoch: u64,
    },
    /// A member prepares for maintenance: replica placement skips it, so the replica it holds
    /// moves to the next member.
    EnterMaintenance {
        /// The member.
        node_id: NodeId,
        /// When the maintenance began (ms since the Unix epoch, the member's clock).
        since_ms: u64,
        /// When it runs out (ms since the Unix epoch).
        until_ms: u64,
    },
    /// The member preparing for maintenance goes away: the holder of its complete replica
    /// serves its buckets until it comes back (and says it runs again); the target map keeps
    /// giving them to it.
    MaintenanceReady {
        /// The member.
        node_id: NodeId,
        /// The heir it checked its replica at, and the heir's holding period then: refused if
        /// either changed since.
        heir: (NodeId, u64),
    },
    /// The maintenance of `node_id` ends before the member is back: an operator ends it, or
    /// its time ran out (the leader proposes it). The member is no longer spared.
    EndMaintenance {
        /// The member.
        node_id: NodeId,
        /// Why, for the log.
        reason: String,
    },
    /// The stuck-transfer detector clears the state-transfer flag so that membership may
    /// change again; the buckets still to move stay in the target.
    ClearTransferFlag {
        /// Why, for the log.
        reason: String,
    },
}

/// The result of applying a [`ClusterCommand`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum CommandResponse {
    /// Applied; nothing to report (also the response to Raft's own entries).
    Done,
    /// `Register` allocated this id.
    Registered {
        /// The new node's id.
        node_id: NodeId,
    },
    /// The command changed the distribution map to this version.
    MapChanged {
        /// The version of the new map.
        map_version: u64,
    },
    /// The command was not applicable to the current state, which is unchanged.
    Rejected {
        /// Why, for the operator.
        reason: String,
    },
    /// `ClearLost` acknowledged these buckets (they serve again, empty).
    Cleared {
        /// The buckets that were lost and are no longer.
        buckets: Vec<u16>,
    },
    /// A membership change was refused because another one, or a state transfer, is
    /// running (retry later, or force it).
    Busy {
        /// What is running.
        reason: String,
    },
}

/// How an active node's writes reach the replica of their bucket.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum ReplicationMode {
    /// The replica has applied a write before the client gets its answer.
    #[default]
    Sync,
    /// Writes are queued and sent in batches; the client does not wait.
    Async,
}

impl std::fmt::Display for ReplicationMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            ReplicationMode::Sync => "sync",
            ReplicationMode::Async => "async",
        })
    }
}

impl std::str::FromStr for ReplicationMode {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "sync" => Ok(ReplicationMode::Sync),
            "async" => Ok(ReplicationMode::Async),
            other => Err(format!("{other:?} is not a replication mode (sync or async)")),
        }
    }
}
