//! [`ShoalApi`]: what the HTTP layer needs from a node. The node implements it; handler tests
//! implement it with a fake.

use std::future::Future;
use std::time::Duration;

use bytes::Bytes;
use shoal_raft::NodeId;

use crate::error::ApiError;
use crate::types::{
    AgentsView, BucketsQuery, BucketsView, Check, ClearLost, ClusterConfig, ClusterView, EventsView, GetOk, KeyList,
    LeaveOk, LostCleared, MaintenanceView, MapView, NodeStats, Page, PutOk, PutOptions, RebalancePlan,
    RebalanceRequest, Removed, RouteContext, Scope, TransferView,
};

/// A validated write of one item (from `PUT /v1/kv/{key}` or one entry of a bulk put).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct PutItem {
    /// The key.
    pub key: String,
    /// The raw value.
    pub value: Bytes,
    /// Its options.
    pub options: PutOptions,
}

/// Size limits the handlers enforce before the node sees a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Longest key, in bytes.
    pub max_key_bytes: usize,
    /// Longest value, in bytes.
    pub max_value_bytes: usize,
    /// Most keys in one bulk request.
    pub max_bulk_keys: usize,
    /// Longest bulk request body (and bulk answer), in bytes.
    pub max_bulk_body_bytes: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_key_bytes: 4096,
            max_value_bytes: 16 * 1024 * 1024,
            max_bulk_keys: 10_000,
            max_bulk_body_bytes: 64 * 1024 * 1024,
        }
    }
}

/// A request body's share of the memory a node lets bodies take while they are in flight,
/// held until the request is answered.
pub struct BodyPermit(#[allow(dead_code)] Option<Box<dyn std::any::Any + Send + Sync>>);

impl BodyPermit {
    /// A permit that holds `share` (for example a semaphore permit) until dropped.
    pub fn new(share: impl std::any::Any + Send + Sync) -> Self {
        BodyPermit(Some(Box::new(share)))
    }

    /// A permit that holds nothing (no bound on bodies in flight).
    pub fn unbounded() -> Self {
        BodyPermit(None)
    }
}

/// The operations behind the public API: the key operations ([`KeyApi`]), cluster admin
/// ([`AdminApi`]) and the probes ([`Probes`]). Each handler names the part it needs; the router
/// takes a node that has all three.
pub trait ShoalApi: KeyApi + AdminApi + Probes {}

impl<N: KeyApi + AdminApi + Probes> ShoalApi for N {}

/// The key operations.
///
/// Contract for every key operation: the key is already validated (non-empty, within
/// limits); the node serves it if it owns the key's bucket, otherwise forwards it to the owner
/// (or answers [`ApiError::NotOwner`] when `ctx.forwarded_map_version` is set, or a redirect
/// when `ctx.redirect` is set, see [`ApiError`]). A write either happens whole or not at all.
pub trait KeyApi: Send + Sync + 'static {
    /// The limits the handlers enforce.
    fn limits(&self) -> Limits;

    /// Admits a request body of at most `bytes` bytes into memory before it is read, or
    /// refuses it (503) when bodies in flight already take what the node allows them. The
    /// default admits every body.
    fn admit_body(&self, bytes: usize) -> impl Future<Output = Result<BodyPermit, ApiError>> + Send {
        let _ = bytes;
        std::future::ready(Ok(BodyPermit::unbounded()))
    }

    /// Reads a key.
    fn get(&self, key: String, ctx: RouteContext) -> impl Future<Output = Result<GetOk, ApiError>> + Send;

    /// Writes a key.
    fn put(&self, item: PutItem, ctx: RouteContext) -> impl Future<Output = Result<PutOk, ApiError>> + Send;

    /// Deletes a key (with `cas`, only at that version). `Err(NotFound)` when absent.
    fn delete(
        &self,
        key: String,
        cas: Option<u64>,
        ctx: RouteContext,
    ) -> impl Future<Output = Result<(), ApiError>> + Send;

    /// Reads many keys; one result per key, in order (`Ok(None)`: absent).
    fn bulk_get(
        &self,
        keys: Vec<String>,
        ctx: RouteContext,
    ) -> impl Future<Output = Result<Vec<Result<Option<GetOk>, ApiError>>, ApiError>> + Send;

    /// Writes many keys; one result per item, in order.
    fn bulk_put(
        &self,
        items: Vec<PutItem>,
        ctx: RouteContext,
    ) -> impl Future<Output = Result<Vec<Result<PutOk, ApiError>>, ApiError>> + Send;

    /// Deletes many keys; one result per key, in order (`Ok(false)`: absent).
    fn bulk_delete(
        &self,
        keys: Vec<String>,
        ctx: RouteContext,
    ) -> impl Future<Output = Result<Vec<Result<bool, ApiError>>, ApiError>> + Send;

    /// Keys starting with `prefix`, sorted, the `page` of them.
    fn keys(&self, prefix: String, page: Page, scope: Scope) -> impl Future<Output = Result<KeyList, ApiError>> + Send;

    /// Keys tagged `tag`, sorted, the `page` of them.
    fn tagged(&self, tag: String, page: Page, scope: Scope) -> impl Future<Output = Result<KeyList, ApiError>> + Send;

    /// Removes every item tagged `tag`.
    fn remove_tagged(&self, tag: String, scope: Scope) -> impl Future<Output = Result<Removed, ApiError>> + Send;
}

/// Cluster admin: what the cluster is and does, and the operator's requests.
pub trait AdminApi: Send + Sync + 'static {
    /// The cluster as this node sees it, with every member's figures.
    fn cluster(&self) -> impl Future<Output = Result<ClusterView, ApiError>> + Send;

    /// The distribution map.
    fn map(&self) -> Result<MapView, ApiError>;

    /// The map once its version is above `after`, or the map as it is when `timeout` passes
    /// first.
    fn watch_map(&self, after: u64, timeout: Duration) -> impl Future<Output = Result<MapView, ApiError>> + Send;

    /// At most `limit` events of the cluster's event log after Raft index `since`; when there
    /// is none yet, waits up to `wait` for one.
    fn events(
        &self,
        since: u64,
        limit: usize,
        wait: Duration,
    ) -> impl Future<Output = Result<EventsView, ApiError>> + Send;

    /// The state transfer as every member reports it.
    fn transfer(&self) -> impl Future<Output = Result<TransferView, ApiError>> + Send;

    /// This node's own figures.
    fn node_stats(&self) -> NodeStats;

    /// Starts member `node_id`'s leave (with `force`, even while a transfer runs).
    fn leave(&self, node_id: NodeId, force: bool) -> impl Future<Output = Result<LeaveOk, ApiError>> + Send;

    /// Puts member `node_id` into maintenance for `period`: its replica holder serves its
    /// buckets until it comes back (the member itself checks and proposes it).
    fn enter_maintenance(
        &self,
        node_id: NodeId,
        period: Duration,
    ) -> impl Future<Output = Result<MaintenanceView, ApiError>> + Send;

    /// Ends member `node_id`'s maintenance before it is back.
    fn end_maintenance(&self, node_id: NodeId) -> impl Future<Output = Result<MaintenanceView, ApiError>> + Send;

    /// The cluster settings in force (as this node applied them).
    fn config(&self) -> impl Future<Output = Result<ClusterConfig, ApiError>> + Send;

    /// Changes the cluster settings (`replication`); answers the settings now in force.
    fn set_config(&self, config: ClusterConfig) -> impl Future<Output = Result<ClusterConfig, ApiError>> + Send;

    /// Acknowledges lost buckets: they serve (empty) again.
    fn clear_lost(&self, clear: ClearLost) -> impl Future<Output = Result<LostCleared, ApiError>> + Send;

    /// `GET /v1/cluster/buckets`: the leader's view of the buckets (a member asks the leader).
    fn buckets(&self, query: BucketsQuery) -> impl Future<Output = Result<BucketsView, ApiError>> + Send;

    /// `POST /v1/cluster/rebalance`: a map balanced by data, planned (and unless a dry run,
    /// started) by the leader.
    fn rebalance(&self, request: RebalanceRequest) -> impl Future<Output = Result<RebalancePlan, ApiError>> + Send;

    /// `GET /v1/cluster/agents`: the mirrors this node reads from.
    fn agents(&self) -> AgentsView;
}

/// The probes: readiness, liveness and metrics.
pub trait Probes: Send + Sync + 'static {
    /// The readiness checks; ready when all pass.
    fn readiness(&self) -> Vec<Check>;

    /// Why the process is not alive (its Raft core stopped), if it is not. Never checks
    /// peers: a liveness probe must not restart a node because others are down.
    fn liveness(&self) -> Option<String> {
        None
    }

    /// The Prometheus text exposition.
    fn metrics(&self) -> String;
}
