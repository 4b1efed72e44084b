//! [`Peers`]: the typed calls a node makes to other nodes, over its [`Transport`].
//!
//! A forwarded key request goes to the owner with the sender's map version, one message on
//! the peer link to it (`Transport::key_op`); a broadcast asks each member for its own keys
//! only. Answers come back as the same types and errors the local path produces, so a client
//! cannot tell a forwarded answer from a local one; what the network did (unreachable, no
//! answer in time) becomes `owner_unreachable`.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use shoal_http_api::types::{
    BucketsQuery, BucketsView, ClusterView, GetOk, KeyList, MaintenanceView, NodeStats, Page, PutOk, RebalancePlan,
    RebalanceRequest, Removed, TransferStatus,
};
use shoal_http_api::{ApiError, PutItem, Unavailable};
use shoal_raft::{BucketId, NodeId};

use crate::transport::http::FORWARD_TIMEOUT;
use crate::transport::BucketReport;
use crate::transport::{
    unexpected, Addrs, CallError, FrameStream, PeerAnswer, PeerRequest, Ping, Pong, ReplicaAnswer, Replicate,
    StreamRequest, Transport, PEER_CALL_TIMEOUT,
};

/// How long the figures of one member may take in `GET /v1/cluster`.
const STATS_TIMEOUT: Duration = Duration::from_secs(2);
/// A balancing commits through Raft at the leader: the change timeout (30 s) and a margin.
const REBALANCE_TIMEOUT: Duration = Duration::from_secs(35);
/// How long a mirror may take to answer a read before it goes to the owner instead.
const MIRROR_TIMEOUT: Duration = Duration::from_secs(1);
/// How long an owner may take to install a lost bucket given back and commit that it serves again.
const GIVE_BACK_TIMEOUT: Duration = Duration::from_secs(10);

/// Typed calls over a node's transport. Cheap to clone.
#[derive(Clone)]
pub struct Peers {
    transport: Arc<dyn Transport>,
}

/// A forwarded operation's failure as the client sees it.
fn api_error(addr: &str, e: CallError) -> ApiError {
    match e {
        CallError::Api(e) => e,
        CallError::Timeout => {
            ApiError::unavailable(Unavailable::OwnerUnreachable, format!("node at {addr} did not answer in time"))
        }
        other => {
            ApiError::unavailable(Unavailable::OwnerUnreachable, format!("node at {addr} did not answer: {other}"))
        }
    }
}

impl Peers {
    /// Typed calls over `transport`.
    pub fn new(transport: Arc<dyn Transport>) -> Self {
        Peers { transport }
    }

    /// The transport.
    pub fn transport(&self) -> &Arc<dyn Transport> {
        &self.transport
    }

    /// A call to the member at `peer_addr`, with the forwards' timeout.
    async fn forward(&self, peer_addr: &str, request: PeerRequest) -> Result<PeerAnswer, ApiError> {
        self.transport.call(peer_addr, request, FORWARD_TIMEOUT).await.map_err(|e| api_error(peer_addr, e))
    }

    /// A forwarded key operation to the owner at `to`.
    async fn key_op(&self, to: &Addrs, request: PeerRequest) -> Result<PeerAnswer, ApiError> {
        self.transport.key_op(to.clone(), request, FORWARD_TIMEOUT).await.map_err(|e| api_error(&to.api, e))
    }

    /// Forwards a GET to the owner at `to`; `None`: the key does not exist.
    pub async fn get(&self, to: &Addrs, key: &str, map_version: u64) -> Result<Option<GetOk>, ApiError> {
        match self.key_op(to, PeerRequest::Get { key: key.to_string(), map_version, mirror: None }).await {
            Ok(PeerAnswer::Got(ok)) => Ok(Some(ok)),
            Err(ApiError::NotFound) => Ok(None),
            Err(e) => Err(e),
            Ok(other) => Err(api_error(&to.api, unexpected(&other))),
        }
    }

    /// A mirror read: `key` from the replica copy of the mirror at `to`, if that copy is fresh
    /// within `staleness`. The call's own error is kept (the caller counts it by kind).
    pub async fn mirror_get(
        &self,
        to: Addrs,
        key: &str,
        map_version: u64,
        staleness: Duration,
    ) -> Result<Option<GetOk>, CallError> {
        let request = PeerRequest::Get { key: key.to_string(), map_version, mirror: Some(staleness) };
        match self.transport.key_op(to, request, MIRROR_TIMEOUT).await {
            Ok(PeerAnswer::Got(ok)) => Ok(Some(ok)),
            Err(CallError::Api(ApiError::NotFound)) => Ok(None),
            Err(e) => Err(e),
            Ok(other) => Err(unexpected(&other)),
        }
    }

    /// Mirror reads of keys whose buckets the mirror at `to` holds replicas of.
    pub async fn mirror_bulk_get(
        &self,
        to: Addrs,
        mirror: NodeId,
        keys: Vec<String>,
        map_version: u64,
        staleness: Duration,
    ) -> Result<Vec<Result<Option<GetOk>, ApiError>>, CallError> {
        let request = PeerRequest::BulkGet { keys, map_version, mirror: Some(staleness) };
        match self.transport.key_op(to, request, MIRROR_TIMEOUT).await? {
            PeerAnswer::BulkGot(results) => {
                Ok(results.into_iter().map(|r| r.map(|found| found.map(|ok| GetOk { node: mirror, ..ok }))).collect())
            }
            other => Err(unexpected(&other)),
        }
    }

    /// Forwards a PUT to the owner at `to`.
    pub async fn put(&self, to: &Addrs, item: &PutItem, map_version: u64) -> Result<PutOk, ApiError> {
        match self.key_op(to, PeerRequest::Put { item: item.clone(), map_version }).await? {
            PeerAnswer::Put(ok) => Ok(ok),
            other => Err(api_error(&to.api, unexpected(&other))),
        }
    }

    /// Forwards a DELETE to the owner at `to`; `false`: the key did not exist.
    pub async fn delete(&self, to: &Addrs, key: &str, cas: Option<u64>, map_version: u64) -> Result<bool, ApiError> {
        match self.key_op(to, PeerRequest::Delete { key: key.to_string(), cas, map_version }).await {
            Ok(PeerAnswer::Deleted) => Ok(true),
            Err(ApiError::NotFound) => Ok(false),
            Err(e) => Err(e),
            Ok(other) => Err(api_error(&to.api, unexpected(&other))),
        }
    }

    /// Forwards a bulk GET of keys `owner` holds.
    pub async fn bulk_get(
        &self,
        to: &Addrs,
        owner: NodeId,
        keys: Vec<String>,
        map_version: u64,
    ) -> Result<Vec<Result<Option<GetOk>, ApiError>>, ApiError> {
        let request = PeerRequest::BulkGet { keys, map_version, mirror: None };
        match self.transport.key_op(to.clone(), request, FORWARD_TIMEOUT).await.map_err(|e| api_error(&to.api, e))? {
            PeerAnswer::BulkGot(results) => {
                Ok(results.into_iter().map(|r| r.map(|found| found.map(|ok| GetOk { node: owner, ..ok }))).collect())
            }
            other => Err(api_error(&to.api, unexpected(&other))),
        }
    }

    /// Forwards a bulk PUT of items `owner` holds.
    pub async fn bulk_put(
        &self,
        to: &Addrs,
        owner: NodeId,
        items: Vec<PutItem>,
        map_version: u64,
    ) -> Result<Vec<Result<PutOk, ApiError>>, ApiError> {
        match self.key_op(to, PeerRequest::BulkPut { items, map_version }).await? {
            PeerAnswer::BulkPut(results) => {
                Ok(results.into_iter().map(|r| r.map(|ok| PutOk { node: owner, ..ok })).collect())
            }
            other => Err(api_error(&to.api, unexpected(&other))),
        }
    }

    /// Forwards a bulk DELETE of keys the owner at `to` holds.
    pub async fn bulk_delete(
        &self,
        to: &Addrs,
        keys: Vec<String>,
        map_version: u64,
    ) -> Result<Vec<Result<bool, ApiError>>, ApiError> {
        match self.key_op(to, PeerRequest::BulkDelete { keys, map_version }).await? {
            PeerAnswer::BulkDeleted(results) => Ok(results),
            other => Err(api_error(&to.api, unexpected(&other))),
        }
    }

    /// Asks the member at `peer_addr` for its own keys with `prefix`.
    pub async fn keys(&self, peer_addr: &str, prefix: &str, page: &Page) -> Result<KeyList, ApiError> {
        match self.forward(peer_addr, PeerRequest::Keys { prefix: prefix.to_string(), page: page.clone() }).await? {
            PeerAnswer::Keys(list) => Ok(list),
            other => Err(api_error(peer_addr, unexpected(&other))),
        }
    }

    /// Asks the member at `peer_addr` for its own keys tagged `tag`.
    pub async fn tagged(&self, peer_addr: &str, tag: &str, page: &Page) -> Result<KeyList, ApiError> {
        match self.forward(peer_addr, PeerRequest::Tagged { tag: tag.to_string(), page: page.clone() }).await? {
            PeerAnswer::Keys(list) => Ok(list),
            other => Err(api_error(peer_addr, unexpected(&other))),
        }
    }

    /// Asks the member at `peer_addr` to remove its own items tagged `tag`.
    pub async fn remove_tagged(&self, peer_addr: &str, tag: &str) -> Result<Removed, ApiError> {
        match self.forward(peer_addr, PeerRequest::RemoveTagged { tag: tag.to_string() }).await? {
            PeerAnswer::Removed(removed) => Ok(removed),
            other => Err(api_error(peer_addr, unexpected(&other))),
        }
    }

    /// The own figures of the member at `peer_addr`, with a short timeout (for `GET /v1/cluster`).
    pub async fn node_stats(&self, peer_addr: &str) -> Result<NodeStats, ApiError> {
        match self.transport.call(peer_addr, PeerRequest::NodeStats, STATS_TIMEOUT).await {
            Ok(PeerAnswer::NodeStats(stats)) => Ok(stats),
            Ok(other) => Err(api_error(peer_addr, unexpected(&other))),
            Err(e) => Err(api_error(peer_addr, e)),
        }
    }

    /// The cluster as the node at `api_addr` sees it.
    pub async fn cluster(&self, api_addr: &str, timeout: Duration) -> Result<ClusterView, CallError> {
        match self.transport.call(api_addr, PeerRequest::Cluster, timeout).await? {
            PeerAnswer::Cluster(view) => Ok(*view),
            other => Err(unexpected(&other)),
        }
    }

    /// Asks the member at `peer_addr` to go into maintenance for `period`, waiting at most
    /// `timeout` (entering takes Raft proposals and waits of its own); its refusal comes back as
    /// it answered it.
    pub async fn enter_maintenance(
        &self,
        peer_addr: &str,
        period: Duration,
        timeout: Duration,
    ) -> Result<MaintenanceView, ApiError> {
        match self.transport.call(peer_addr, PeerRequest::EnterMaintenance { period }, timeout).await {
            Ok(PeerAnswer::Maintenance(view)) => Ok(view),
            Ok(other) => Err(api_error(peer_addr, unexpected(&other))),
            Err(CallError::Api(e)) => Err(e),
            Err(e) => Err(ApiError::unavailable(
                Unavailable::Unavailable,
                format!("the member at {peer_addr} did not answer ({e}): a member goes into maintenance itself, so it must run"),
            )),
        }
    }

    /// This node's bucket statistics, to the leader's peer listener.
    pub async fn report_buckets(&self, peer_addr: &str, report: &BucketReport) -> Result<(), CallError> {
        let request = PeerRequest::ReportBuckets(Box::new(report.clone()));
        match self.transport.call(peer_addr, request, STATS_TIMEOUT).await? {
            PeerAnswer::Reported => Ok(()),
            other => Err(unexpected(&other)),
        }
    }

    /// The leader's view of the buckets.
    pub async fn buckets(&self, peer_addr: &str, query: BucketsQuery) -> Result<BucketsView, CallError> {
        match self.transport.call(peer_addr, PeerRequest::Buckets(query), STATS_TIMEOUT).await? {
            PeerAnswer::Buckets(view) => Ok(*view),
            other => Err(unexpected(&other)),
        }
    }

    /// A balancing, planned (and unless a dry run, started) by the leader: it commits
    /// through Raft, so it may take the control plane's change timeout.
    pub async fn rebalance(&self, peer_addr: &str, request: RebalanceRequest) -> Result<RebalancePlan, CallError> {
        match self.transport.call(peer_addr, PeerRequest::Rebalance(request), REBALANCE_TIMEOUT).await? {
            PeerAnswer::Rebalance(plan) => Ok(*plan),
            other => Err(unexpected(&other)),
        }
    }

    /// One member's transfer status, from its peer listener.
    pub async fn transfer_status(&self, peer_addr: &str) -> Result<TransferStatus, CallError> {
        match self.transport.call(peer_addr, PeerRequest::TransferStatus, STATS_TIMEOUT).await? {
            PeerAnswer::TransferStatus(status) => Ok(status),
            other => Err(unexpected(&other)),
        }
    }

    /// Sends changes (or a snapshot) of a bucket to its replica holder.
    pub async fn replicate(&self, peer_addr: &str, request: Replicate) -> Result<ReplicaAnswer, CallError> {
        match self.transport.call(peer_addr, PeerRequest::Replicate(request), PEER_CALL_TIMEOUT).await? {
            PeerAnswer::Replicated(answer) => Ok(answer),
            other => Err(unexpected(&other)),
        }
    }

    /// Sends changes of several buckets to their replica holder in one exchange; the answers
    /// come in the requests' order.
    pub async fn replicate_batch(
        &self,
        peer_addr: &str,
        requests: Vec<Replicate>,
    ) -> Result<Vec<ReplicaAnswer>, CallError> {
        let n = requests.len();
        match self.transport.call(peer_addr, PeerRequest::ReplicateBatch(requests), PEER_CALL_TIMEOUT).await? {
            PeerAnswer::ReplicatedBatch(answers) if answers.len() == n => Ok(answers),
            PeerAnswer::ReplicatedBatch(answers) => {
                Err(CallError::Broken(format!("{} answers to a batch of {n} replica requests", answers.len())))
            }
            other => Err(unexpected(&other)),
        }
    }

    /// Writes changes of `bucket` through to its shadow.
    pub async fn shadow(&self, peer_addr: &str, bucket: BucketId, body: Bytes) -> Result<(), CallError> {
        match self.transport.call(peer_addr, PeerRequest::Shadow { bucket, body }, PEER_CALL_TIMEOUT).await? {
            PeerAnswer::ShadowApplied => Ok(()),
            other => Err(unexpected(&other)),
        }
    }

    /// Gives the copy of lost `bucket` this node served last back to its owner.
    pub async fn give_back(
        &self,
        peer_addr: &str,
        from: NodeId,
        bucket: BucketId,
        body: Bytes,
    ) -> Result<(), CallError> {
        let request = PeerRequest::GiveBack { from, bucket, body };
        match self.transport.call(peer_addr, request, GIVE_BACK_TIMEOUT).await? {
            PeerAnswer::Found => Ok(()),
            other => Err(unexpected(&other)),
        }
    }

    /// Pings a member.
    pub async fn ping(&self, peer_addr: &str, ping: Ping, timeout: Duration) -> Result<Pong, CallError> {
        match self.transport.call(peer_addr, PeerRequest::Ping(ping), timeout).await? {
            PeerAnswer::Pong(pong) => Ok(pong),
            other => Err(unexpected(&other)),
        }
    }

    /// Opens a bucket stream.
    pub async fn open_stream(
        &self,
        peer_addr: &str,
        request: StreamRequest,
        timeout: Duration,
    ) -> Result<FrameStream, CallError> {
        self.transport.open_stream(peer_addr, request, timeout).await
    }
}
