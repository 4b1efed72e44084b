//! The seam for node-to-node traffic: every message one node sends another goes through a
//! [`Transport`], so the protocol code runs the same over real HTTP and in the deterministic
//! simulation (`crate::sim`). This module is the wire only: it imports none of the parts that
//! answer requests; the receiving dispatch is the node's (`crate::node::PeerService`).
//!
//! ```text
//!   sender                         Transport                          receiver
//!   Peers (typed calls) ──▶ call(addr, PeerRequest) ──▶ peer link ──▶ PeerService::serve
//!   Puller              ──▶ open_stream(addr, ..)   ──▶ (or the simulated network) ──▶ open_stream
//!   shoal-raft          ──▶ control(addr, rpc, body)──▶ ...                ──▶ ControlPlane::serve_rpc
//! ```
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
//! - `mod.rs`: the trait, the requests and answers.
//! - `http.rs`: [`HttpTransport`], the production implementation: one hyper client whose pool
//!   keeps connections per peer, the cluster secret, the source address.
//! - `frame.rs`: the wire format of bucket data (bucket streams, replica writes and snapshots,
//!   shadow writes).
//! - `link.rs`: [`link::Links`], one long-lived connection per peer (an HTTP upgrade), the only
//!   way every request to a peer listener travels but Raft's, admin messages and bucket streams:
//!   binary messages, many in flight at once, large ones in fragments.
//! - `wire.rs`: the format of every request and answer on links (serde's data model in bincode).

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
use serde::{Deserialize, Serialize};
use shoal_http_api::types::{
    BucketsQuery, BucketsView, ClusterView, GetOk, KeyList, MaintenanceView, NodeStats, Page, PutOk, RebalancePlan,
    RebalanceRequest, Removed, TransferStatus,
};
use shoal_http_api::{ApiError, PutItem};
use shoal_raft::{BoxFuture, BucketId, ControlTransport, MemberStatus, NodeId};

pub use http::HttpTransport;

/// One node's report of the buckets it serves.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BucketReport {
    /// The reporting node.
    pub node: NodeId,
    /// Its map version when it measured.
    pub map_version: u64,
    /// The buckets it serves.
    pub buckets: Vec<ReportedBucket>,
    /// The receive rate of its last transfer that moved enough to tell, bytes per second.
    #[serde(default)]
    pub transfer_rate: Option<f64>,
    /// Buckets it owns but does not hold yet (being restored after a restart, or promoted
    /// and not installed): its figures are incomplete until they are back.
    #[serde(default)]
    pub pending: u32,
}

/// One bucket in a [`BucketReport`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ReportedBucket {
    /// The bucket.
    pub bucket: u16,
    /// Items.
    pub items: u64,
    /// Charged bytes.
    pub bytes: u64,
    /// Reads per second since the node's previous report.
    pub reads_per_sec: f64,
    /// Writes per second.
    pub writes_per_sec: f64,
}

/// A request to another node.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum PeerRequest {
    /// Changes (or a whole snapshot) of a bucket for its replica, to the holder's peer address.
    Replicate(Replicate),
    /// Changes of several buckets of one sender for their replica, in one exchange: each is
    /// applied (or refused) as if it came alone.
    ReplicateBatch(Vec<Replicate>),
    /// Writes of a bucket for the shadow the previous owner keeps during a transfer.
    Shadow {
        /// The bucket.
        bucket: BucketId,
        /// Framed changes (`transport::frame`).
        #[serde(deserialize_with = "wire::shared::deserialize")]
        body: Bytes,
    },
    /// A lost bucket's copy, from the node that served it last (failed while cut off, back
    /// now), to the bucket's owner.
    GiveBack {
        /// The returned node.
        from: NodeId,
        /// The bucket.
        bucket: BucketId,
        /// Its items, framed (`transport::frame`).
        #[serde(deserialize_with = "wire::shared::deserialize")]
        body: Bytes,
    },
    /// A failure-detection ping.
    Ping(Ping),
    /// The receiver's transfer progress (the leader's stuck detector asks).
    TransferStatus,
    /// A forwarded read, to the owner (or, with `mirror`, to a mirror).
    Get {
        /// The key.
        key: String,
        /// The sender's map version.
        map_version: u64,
        /// A mirror read: serve it from the receiver's replica copy if that is fresh within
        /// this staleness, else refuse (`replica_not_fresh`).
        mirror: Option<Duration>,
    },
    /// A forwarded write.
    Put {
        /// The item.
        item: PutItem,
        /// The sender's map version.
        map_version: u64,
    },
    /// A forwarded delete.
    Delete {
        /// The key.
        key: String,
        /// Only at this version.
        cas: Option<u64>,
        /// The sender's map version.
        map_version: u64,
    },
    /// Forwarded reads of keys one owner holds (or, with `mirror`, mirror reads).
    BulkGet {
        /// The keys.
        keys: Vec<String>,
        /// The sender's map version.
        map_version: u64,
        /// As for [`PeerRequest::Get`].
        mirror: Option<Duration>,
    },
    /// Forwarded writes of items one owner holds.
    BulkPut {
        /// The items.
        items: Vec<PutItem>,
        /// The sender's map version.
        map_version: u64,
    },
    /// Forwarded deletes of keys one owner holds.
    BulkDelete {
        /// The keys.
        keys: Vec<String>,
        /// The sender's map version.
        map_version: u64,
    },
    /// A broadcast: the receiver's own keys with a prefix.
    Keys {
        /// The prefix.
        prefix: String,
        /// Which of them.
        page: Page,
    },
    /// A broadcast: the receiver's own keys with a tag.
    Tagged {
        /// The tag.
        tag: String,
        /// Which of them.
        page: Page,
    },
    /// A broadcast: remove the receiver's own items with a tag.
    RemoveTagged {
        /// The tag.
        tag: String,
    },
    /// The receiver's own figures.
    NodeStats,
    /// The cluster as the receiver sees it (a joiner asks its seed).
    Cluster,
    /// The receiver goes into maintenance for this long (to its peer address: only it can
    /// check that its replica is complete).
    EnterMaintenance {
        /// How long it may stay away.
        period: Duration,
    },
    /// A member's bucket statistics, to the leader's peer address.
    ReportBuckets(Box<BucketReport>),
    /// The leader's view of the buckets (a member asks the leader for `GET /v1/cluster/buckets`).
    Buckets(BucketsQuery),
    /// A balancing planned (and started) by the leader (`POST /v1/cluster/rebalance`).
    Rebalance(RebalanceRequest),
}

/// The answer to a [`PeerRequest`], in the same order of variants.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum PeerAnswer {
    /// What the replica holder did.
    Replicated(ReplicaAnswer),
    /// What the replica holder did with each request of a batch, in its order.
    ReplicatedBatch(Vec<ReplicaAnswer>),
    /// The shadow applied the writes.
    ShadowApplied,
    /// The owner installed the copy given back, and the bucket serves again.
    Found,
    /// The pong.
    Pong(Pong),
    /// Transfer progress.
    TransferStatus(#[serde(with = "wire::json")] TransferStatus),
    /// The value read.
    Got(GetOk),
    /// The write done.
    Put(PutOk),
    /// The key was deleted.
    Deleted,
    /// One result per key.
    BulkGot(Vec<Result<Option<GetOk>, ApiError>>),
    /// One result per item.
    BulkPut(Vec<Result<PutOk, ApiError>>),
    /// One result per key (`Ok(false)`: absent).
    BulkDeleted(Vec<Result<bool, ApiError>>),
    /// Keys found.
    Keys(#[serde(with = "wire::json")] KeyList),
    /// Items removed.
    Removed(#[serde(with = "wire::json")] Removed),
    /// The figures.
    NodeStats(#[serde(with = "wire::json")] NodeStats),
    /// The cluster view.
    Cluster(#[serde(with = "wire::json")] Box<ClusterView>),
    /// The receiver is in maintenance.
    Maintenance(#[serde(with = "wire::json")] MaintenanceView),
    /// The leader kept the report.
    Reported,
    /// The leader's view of the buckets.
    Buckets(#[serde(with = "wire::json")] Box<BucketsView>),
    /// The leader's plan.
    Rebalance(#[serde(with = "wire::json")] Box<RebalancePlan>),
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

/// Changes (or a snapshot) of one bucket for its replica.
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
    /// newer request already); the sender sends the bucket whole (HTTP 412).
    NeedSnapshot(String),
    /// Not applied: in the holder's map, at least as new as the sender's, the sender does
    /// not own the bucket or the holder is not its replica (HTTP 409).
    Fenced {
        /// The holder's map version.
        map_version: u64,
        /// Why.
        reason: String,
    },
    /// Not applied: the request is malformed (HTTP 400).
    Refused(String),
}

/// A ping.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Ping {
    /// The sender.
    pub from: NodeId,
    /// The members the sender has not heard from within the node timeout.
    pub pfail: Vec<NodeId>,
    /// The sender's incarnation (random at every start; 0 from versions that did not send it):
    /// a new one tells the receiver that the sender restarted.
    #[serde(default)]
    pub incarnation: u64,
    /// What the sender says of its replica, for mirror reads: which member holds it (the one
    /// every write must reach), in which holding period, and how far behind that copy may be.
    /// Absent while one of its buckets is not attached there (the copy may lack writes), and
    /// from older versions. A holder serves mirror reads from its copy only while the
    /// sender's latest report names it, in its current period.
    pub replica: Option<ReplicaReport>,
}

/// See [`Ping::replica`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReplicaReport {
    /// The member holding the sender's replica.
    pub holder: NodeId,
    /// Its holding period (`ClusterState::replica_period`).
    pub period: u64,
    /// The age of the sender's oldest change not yet acknowledged there, in milliseconds.
    pub lag_ms: u64,
    /// Whether the sender replicates synchronously (its own applied setting: a holder that
    /// applied a switch to sync before its owner must not take the owner's writes for sync).
    pub sync: bool,
}

/// The answer to a ping.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Pong {
    /// The answering node.
    pub node_id: NodeId,
    /// Random at every start of the answering process: a change means it restarted, and its
    /// replica store is empty.
    #[serde(default)]
    pub incarnation: u64,
    /// The sender's membership in the answering node's view.
    pub status: MemberStatus,
    /// Whether the answer renews the sender's lease: false while the answering node may still
    /// be counted as reporting the sender pfail (the sender may be failed on that report, so
    /// it must not serve on a lease meanwhile). Absent (older versions): true.
    #[serde(default = "lease_default")]
    pub lease: bool,
}

fn lease_default() -> bool {
    true
}

/// Why a message from another node could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Malformed {
    /// Not a message of the wire format: cut short, a length beyond what is left, a field
    /// out of its range, text that is not UTF-8.
    #[error("an unreadable message: {0}")]
    Unreadable(String),
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
    /// Sends `request` to the node at `addr` and waits at most `timeout` for its answer.
    fn call(&self, addr: &str, request: PeerRequest, timeout: Duration)
        -> BoxFuture<'_, Result<PeerAnswer, CallError>>;

    /// Sends a forwarded or mirror key operation (single or bulk) to the member at `to`, which
    /// answers it as its public API would: on the peer link to it ([`HttpTransport`]; a
    /// forwarded write there is cancelled when its caller gives up). By default, a
    /// [`Self::call`] to the API address (the simulation's hosts are named by it).
    fn key_op(
        &self,
        to: Addrs,
        request: PeerRequest,
        timeout: Duration,
    ) -> BoxFuture<'_, Result<PeerAnswer, CallError>> {
        self.call(&to.api, request, timeout)
    }

    /// Opens a stream at the node at `peer_addr`; waits at most `timeout` for it to start.
    fn open_stream(
        &self,
        peer_addr: &str,
        request: StreamRequest,
        timeout: Duration,
    ) -> BoxFuture<'_, Result<FrameStream, CallError>>;
}

/// What an answer of the wrong kind becomes (a bug on one side).
pub fn unexpected(answer: &PeerAnswer) -> CallError {
    CallError::Broken(format!("unexpected answer {}", answer_name(answer)))
}

fn answer_name(answer: &PeerAnswer) -> &'static str {
    match answer {
        PeerAnswer::Replicated(_) => "replicated",
        PeerAnswer::ReplicatedBatch(_) => "replicated batch",
        PeerAnswer::ShadowApplied => "shadow applied",
        PeerAnswer::Found => "found",
        PeerAnswer::Pong(_) => "pong",
        PeerAnswer::TransferStatus(_) => "transfer status",
        PeerAnswer::Got(_) => "got",
        PeerAnswer::Put(_) => "put",
        PeerAnswer::Deleted => "deleted",
        PeerAnswer::BulkGot(_) => "bulk got",
        PeerAnswer::BulkPut(_) => "bulk put",
        PeerAnswer::BulkDeleted(_) => "bulk deleted",
        PeerAnswer::Keys(_) => "keys",
        PeerAnswer::Removed(_) => "removed",
        PeerAnswer::NodeStats(_) => "node stats",
        PeerAnswer::Cluster(_) => "cluster",
        PeerAnswer::Maintenance(_) => "maintenance",
        PeerAnswer::Reported => "reported",
        PeerAnswer::Buckets(_) => "buckets",
        PeerAnswer::Rebalance(_) => "rebalance",
    }
}

/// How long an internal call (replication, shadows, status) may take by default.
pub const PEER_CALL_TIMEOUT: Duration = Duration::from_secs(2);
