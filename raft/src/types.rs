//! The openraft type configuration and concrete aliases; openraft's generics stop here.

use std::fmt;
use std::io::Cursor;

use serde::{Deserialize, Serialize};

use crate::command::{CommandResponse, Proposal};
use crate::distribution::NodeId;

/// What Raft knows of a node: where to reach it. Kept in openraft's membership config.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct MemberNode {
    /// The client API address (`host:port`) that clients and forwarding use.
    pub api_addr: String,
    /// The internal address (`host:port`) for Raft and node-to-node traffic.
    pub peer_addr: String,
}

impl fmt::Display for MemberNode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "api={} peer={}", self.api_addr, self.peer_addr)
    }
}

openraft::declare_raft_types!(
    /// shoal's Raft type configuration: entries carry [`Proposal`]s (a command and its time),
    /// nodes are [`MemberNode`]s, ids are [`NodeId`]s.
    pub TypeConfig:
        D = Proposal,
        R = CommandResponse,
        NodeId = NodeId,
        Node = MemberNode,
        SnapshotData = Cursor<Vec<u8>>,
        AsyncRuntime = crate::runtime::ShoalRuntime,
);

/// The Raft instance of a shoal node.
pub type Raft = openraft::Raft<TypeConfig>;
/// A log entry.
pub type Entry = openraft::Entry<TypeConfig>;
/// A log id.
pub type LogId = openraft::LogId<NodeId>;
/// The vote.
pub type Vote = openraft::Vote<NodeId>;
/// A membership config with its log id.
pub type StoredMembership = openraft::StoredMembership<NodeId, MemberNode>;
/// Metadata of a state-machine snapshot.
pub type SnapshotMeta = openraft::SnapshotMeta<NodeId, MemberNode>;
/// A storage error.
pub type StorageError = openraft::StorageError<NodeId>;
/// Raft's own API error.
pub type RaftError<E = openraft::error::Infallible> = openraft::error::RaftError<NodeId, E>;
/// The error of a Raft RPC as seen by the sender.
pub type RpcError<E = openraft::error::Infallible> = openraft::error::RPCError<NodeId, MemberNode, RaftError<E>>;
/// The error of a client write.
pub type ClientWriteError = openraft::error::ClientWriteError<NodeId, MemberNode>;
/// Raft metrics.
pub type RaftMetrics = openraft::RaftMetrics<NodeId, MemberNode>;
