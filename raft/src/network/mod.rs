//! The control plane's messages between nodes, and the transport they travel on.
//!
//! This crate does not open sockets. It declares what it needs from the node-to-node
//! transport — [`ControlTransport`], one call that carries a serialized message to a peer
//! and brings its serialized answer back — and the node passes an implementation in: HTTP
//! between real processes, an in-memory network in the deterministic simulation. The cluster
//! secret and the source address of connections belong to that implementation, not to this
//! crate.
//!
//! - `client.rs`: [`RaftTransportNetwork`], openraft's network factory over the transport.
//! - `server.rs`: [`ControlPlane::serve_rpc`](crate::ControlPlane::serve_rpc), the receiving
//!   side of every message.
//! - `admin.rs`: [`AdminRequest`]/[`AdminResponse`], the join/leave protocol, and
//!   [`AdminClient`] that sends them to a member.

mod admin;
mod client;
mod server;

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

pub use admin::{AdminClient, AdminRequest, AdminResponse, LostBucket, MemberStatus};
pub use client::RaftTransportNetwork;
pub use server::ServeError;

use crate::distribution::NodeId;

/// A boxed future, as trait objects return them.
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// Which control-plane endpoint a message is for. Bodies are JSON made and read by this crate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ControlRpc {
    /// Raft `AppendEntries`.
    Append,
    /// Raft `Vote`.
    Vote,
    /// Raft `InstallSnapshot`.
    Snapshot,
    /// An [`AdminRequest`]; `forwarded` marks one a member already forwarded to the node it
    /// believes leads (handled there or answered `NotLeader`, never forwarded again).
    Admin {
        /// Whether a member forwarded it.
        forwarded: bool,
    },
    /// What the receiver's cluster knows of a node id.
    MemberStatus {
        /// The id asked about.
        node_id: NodeId,
    },
}

/// Why a message got no answer from the receiver's control plane.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TransportError {
    /// No connection could be made: the message was certainly not delivered.
    #[error("unreachable: {0}")]
    Unreachable(String),
    /// Sent, but no usable answer came back (timeout, broken connection, garbage): the
    /// receiver may or may not have handled it.
    #[error("{0}")]
    Failed(String),
    /// Another node now listens at the address (it asked for another node id).
    #[error("misdirected: {0}")]
    Misdirected(String),
    /// The receiver could not read the message (a node of another version, say): sending it
    /// again will not help.
    #[error("refused: {0}")]
    BadRequest(String),
}

/// Carries control-plane messages to peers (see the module docs).
pub trait ControlTransport: Send + Sync + 'static {
    /// Sends `body` for `rpc` to the node at `peer_addr`, meant for node `target` when the
    /// sender knows its id (the receiver refuses a message meant for another id: a node that
    /// rejoined under a new id on the same address must not receive the old id's log), and
    /// waits at most `timeout` for the answer's body.
    fn control(
        &self,
        peer_addr: &str,
        target: Option<NodeId>,
        rpc: ControlRpc,
        body: Vec<u8>,
        timeout: Duration,
    ) -> BoxFuture<'_, Result<Vec<u8>, TransportError>>;
}
