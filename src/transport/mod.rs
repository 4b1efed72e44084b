//! The seam for node-to-node traffic: every message one node sends another goes through a
//! [`Transport`], so the protocol code runs the same over real HTTP and in the deterministic
//! simulation (`crate::sim`). This module is the wire only: it imports none of the parts that
//! answer requests; the receiving dispatch is the node's (`crate::node::PeerService`).
//!
//! ```text
//!   sender                           Transport                          receiver
//!   Peers::ask(E) ──▶ call(addr, Outgoing{E::ID, body}) ──▶ peer link ──▶ Handlers: E's handler
//!   Puller        ──▶ open_stream(addr, ..)             ──▶ (or the simulated network) ──▶ open_stream
//!   shoal-raft    ──▶ control(addr, rpc, body)          ──▶ ...          ──▶ ControlPlane::serve_rpc
//! ```
//!
//! Each message is declared by the module that owns it, as an [`Endpoint`], and numbered in
//! the wire's registry (`wire::id`); that module registers its handler (`wire::Handlers`).
//!
//! Two kinds of destination: a peer address (the internal listener: its link carries replica
//! writes, forwarded and mirror key operations, single and bulk, shadows, pings, transfer
//! status, maintenance and bucket messages, broadcasts and node figures; bucket streams, Raft
//! and admin messages are HTTP) and an API address (only the cluster view a joiner asks its
//! seed for: an HTTP exchange that the receiver answers as it would answer a client).
//! Answers are typed; errors keep what the receiver said ([`CallError::Api`]) apart from what
//! the network did (unreachable, timed out, broken).
//!
//! # Layout
//! - `mod.rs`: the trait, [`Endpoint`], the errors.
//! - `http.rs`: [`HttpTransport`], the production implementation: one hyper client whose pool
//!   keeps connections per peer, the cluster secret, the source address.
//! - `frame.rs`: the wire format of bucket data (bucket streams, replica writes and snapshots,
//!   shadow writes).
//! - `link.rs`: [`link::Links`], one long-lived connection per peer (an HTTP upgrade), the only
//!   way every request to a peer listener travels but Raft's, admin messages and bucket streams:
//!   binary messages, many in flight at once, large ones in fragments.
//! - `wire.rs`: the format of every request and answer on links (serde's data model in bincode),
//!   the registry of endpoint numbers and the handlers.

pub mod frame;
pub mod http;
pub mod link;
#[cfg(test)]
pub mod testing;
pub mod wire;

use std::pin::Pin;
use std::time::Duration;

use bytes::Bytes;
use futures::Stream;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use shoal_http_api::types::ClusterView;
use shoal_http_api::ApiError;
use shoal_raft::{BoxFuture, BucketId, ControlTransport, NodeId};

pub use http::HttpTransport;

/// A request one node sends another, declared by the module that owns it (beside the handler
/// it registers, [`wire::Handlers::add`]) and numbered once in the wire's registry
/// ([`wire::id`]). Adding a message touches its module and that registry, nothing else.
pub trait Endpoint: Serialize + DeserializeOwned + Send + Sync + 'static {
    /// What the receiver answers.
    type Answer: Serialize + DeserializeOwned + Send + 'static;
    /// Its number on the wire ([`wire::id`]).
    const ID: u8;
    /// How a link treats it ([`wire::CALL`], [`wire::READ`], [`wire::WRITE`], [`wire::REPLICATE`]):
    /// a forward carries its sender's deadline, a write is cancelled when its sender gives up.
    const KIND: u8 = wire::CALL;
    /// Whether it carries bucket data, read as a slice of its message rather than copied.
    const CARRIES_DATA: bool = false;

    /// Why a request that decoded is refused whole all the same (a bucket that does not exist).
    fn check(&self) -> Result<(), Malformed> {
        Ok(())
    }

    /// Whether `answer` can be the answer to this request (a bulk request's has one result per
    /// key).
    fn fits(&self, _answer: &Self::Answer) -> bool {
        true
    }
}

/// A request on its way out: its endpoint's number and link kind, and how its body is written
/// (after the header the transport writes; see [`wire`]).
pub struct Outgoing<'a> {
    /// [`Endpoint::ID`].
    pub id: u8,
    /// [`Endpoint::KIND`].
    pub kind: u8,
    /// Writes the request's body; an error is the request's answer (it is not sent).
    pub body: &'a (dyn Fn(&mut Vec<u8>) -> Result<(), CallError> + Send + Sync),
}

/// A request that answers with a stream of frames.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StreamRequest {
    /// Stream a bucket to its new owner `to` (move `epoch`), or with `restore` send the copy
    /// this node holds (replica or shadow) back to the bucket's owner after its restart.
    Bucket {
        /// The bucket.
        bucket: BucketId,
        /// The receiver.
        to: NodeId,
        /// The move epoch the receiver saw.
        epoch: u64,
        /// A plain copy back to the owner (no freeze, no flip).
        restore: bool,
    },
}

/// A stream of frames (`transport::frame`).
pub type FrameStream = Pin<Box<dyn Stream<Item = Result<Bytes, CallError>> + Send>>;

/// Why a message from another node could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Malformed {
    /// Not a message of the wire format: cut short, a length beyond what is left, a field
    /// out of its range, text that is not UTF-8.
    #[error("an unreadable message: {0}")]
    Unreadable(String),
    /// A request for an endpoint nobody registered.
    #[error("a request for endpoint {0}, which this node does not know")]
    Unknown(u8),
    /// A request in a link message of another kind than its own.
    #[error("a request in a link message of kind {0}, not its own")]
    Kind(u8),
    /// A request for a bucket that does not exist.
    #[error("no bucket {0}")]
    NoSuchBucket(u16),
}

/// Why a call got no answer it could use.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error, Serialize, Deserialize)]
pub enum CallError {
    /// No connection could be made: the request was certainly not delivered.
    #[error("unreachable: {0}")]
    Unreachable(String),
    /// No answer in time: the receiver may or may not have handled the request.
    #[error("no answer in time")]
    Timeout,
    /// Sent, but the answer was broken or unreadable.
    #[error("{0}")]
    Broken(String),
    /// The receiver answered with an error of the public API (a forwarded operation).
    #[error("{0}")]
    Api(ApiError),
    /// The receiver refused an internal request (HTTP status and its reason).
    #[error("{status}: {reason}")]
    Refused {
        /// The HTTP status it would have.
        status: u16,
        /// Why.
        reason: String,
    },
}

/// Where a member is reached: its public API and its peer listener.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Addrs {
    /// The public API address (`host:port`).
    pub api: String,
    /// The peer listener's address.
    pub peer: String,
}

/// Carries every node-to-node message (see the module docs). Implementations: HTTP
/// ([`HttpTransport`]) and the simulated network (`crate::sim`).
pub trait Transport: ControlTransport {
    /// Sends `request` to the node at `addr` and waits at most `timeout` for its answer (the
    /// answer's bytes, [`wire::decode_answer`]).
    fn call<'a>(
        &'a self,
        addr: &'a str,
        request: Outgoing<'a>,
        timeout: Duration,
    ) -> BoxFuture<'a, Result<Bytes, CallError>>;

    /// Sends a forwarded or mirror key operation (single or bulk) to the member at `to`: on the
    /// peer link to it ([`HttpTransport`]; a forwarded write there is cancelled when its caller
    /// gives up). By default, a [`Self::call`] to the API address (the simulation's hosts are
    /// named by it).
    fn key_op<'a>(
        &'a self,
        to: &'a Addrs,
        request: Outgoing<'a>,
        timeout: Duration,
    ) -> BoxFuture<'a, Result<Bytes, CallError>> {
        self.call(&to.api, request, timeout)
    }

    /// The cluster as the node at the API address `api_addr` sees it (a joiner asks its seed,
    /// which it knows by its public address only).
    fn cluster(&self, api_addr: &str, timeout: Duration) -> BoxFuture<'_, Result<ClusterView, CallError>>;

    /// Opens a stream at the node at `peer_addr`; waits at most `timeout` for it to start.
    fn open_stream(
        &self,
        peer_addr: &str,
        request: StreamRequest,
        timeout: Duration,
    ) -> BoxFuture<'_, Result<FrameStream, CallError>>;
}

/// How long an internal call (replication, shadows, status) may take by default.
pub const PEER_CALL_TIMEOUT: Duration = Duration::from_secs(2);
