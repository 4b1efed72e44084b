//! The commands of the replicated control-plane state, and their responses.
//!
//! Every change to membership or to the distribution map is one of these, committed through
//! Raft and applied by [`ClusterState::apply`](crate::state::ClusterState::apply) on every
//! node in the same order. `raft/DESIGN.md` describes each with the invariants it keeps.

use serde::{Deserialize, Serialize};

use crate::distribution::NodeId;

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
        /// How many members vote in Raft (3 or 5).
        voters: u8,
    },
    /// A node asks to join: allocate it the next never-used id. It is not a member yet.
    Register {
        /// The joiner's client API address.
        api_addr: String,
        /// The joiner's internal address.
        peer_addr: String,
    },
    /// A registered node, now a Raft learner that has caught up, becomes a member: it is
    /// appended to the join order and the map is rebalanced to give it its share.
    Admit {
        /// The id allocated by `Register`.
        node_id: NodeId,
    },
    /// A member leaves: it is removed from the join order, its id is retired for good, and
    /// the map is rebalanced over the remaining members.
    Remove {
        /// The member that leaves.
        node_id: NodeId,
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
}
