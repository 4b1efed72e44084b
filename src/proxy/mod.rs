//! [`NodeApi`]: the node behind the public API. Every key operation is served here if this
//! node owns the key's bucket, or forwarded to the owner in one hop.
//!
//! ```text
//!  client ──> any node ── owner_of(bucket_of(key)) == me ? ──yes──> CacheStore
//!                │                                    no
//!                └── forward (x-shoal-map-version: v) ──> owner ── owns it in its map ≥ v?
//!                         ^                                          yes: serve; no: 421 not_owner
//!                         └──── wait until our map ≥ theirs, route again (bounded) ────┘
//! ```
//!
//! A forwarded request is never forwarded again, so a request makes at most one hop; the
//! receiver first waits (briefly) until it has applied the sender's map version, so the two
//! nodes decide on the same or a newer map. Keyless operations (prefix listing, tags) are
//! broadcast to every member and merged.
//!
//! A write to a bucket this node owns reaches its replica before it is acknowledged (sync
//! replication) or through a queue (async): see `crate::replication`. A node that has not
//! heard from a majority of the members acknowledges no write (`crate::health`).
//!
//! # Layout
//! - `mod.rs`: routing (`target`, `route`), the single-key operations, the `ShoalApi` impl.
//! - `bulk.rs`: bulk operations, grouped by owner.
//! - `keyless.rs`: broadcasts (prefix listing, tags).
//! - `admin.rs`: cluster views, leave, readiness, state gauges.

mod admin;
mod bulk;
mod keyless;

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use shoal_http_api::types::{
    Check, ClearLost, ClusterConfig, ClusterView, GetOk, KeyList, LeaveOk, MapView, NodeStats, PutOk, Removed,
    RouteContext, Scope, TransferView, WriteCondition,
};
use shoal_http_api::{ApiError, Limits, PutItem, ShoalApi};
use shoal_raft::{bucket_of, BucketId, ClusterState, ControlPlane, NodeId};

use crate::cache::{CacheError, CacheStore, Condition, Write};
use crate::cache::{Change, ExportedItem};
use crate::health::Health;
use crate::metrics::{NodeMetrics, Op};
use crate::peer::PeerClient;
use crate::replication::Replicator;
use crate::transfer::progress::Progress;
use crate::transfer::restore::Restoring;
use crate::transfer::shadow::ShadowWriter;

/// How long a node waits to catch up with a newer map version before answering.
const MAP_CATCH_UP: Duration = Duration::from_secs(2);
/// How many times a key operation is routed again after `not_owner`.
const ROUTE_ATTEMPTS: usize = 3;
/// How long a write waits for a bucket frozen by a handover before answering 503.
const FROZEN_WAIT: Duration = Duration::from_secs(10);

/// Where a key operation runs.
enum Target {
    Local,
    Remote { owner: NodeId },
}

/// The API address of member `id` in `state`.
fn api_addr_of(state: &ClusterState, id: NodeId) -> Result<String, ApiError> {
    state
        .member_of(id)
        .map(|m| m.api_addr.clone())
        .ok_or_else(|| ApiError::Internal(format!("owner {id} not a member")))
}

/// The node's shared parts the API reads besides the store and the control plane.
pub struct NodeParts {
    /// Metrics.
    pub metrics: Arc<NodeMetrics>,
    /// Transfer progress.
    pub progress: Arc<Progress>,
    /// Write-through to shadows during a transfer.
    pub shadows: Arc<ShadowWriter>,
    /// Buckets not restored yet after a restart.
    pub restoring: Arc<Restoring>,
    /// Replicas.
    pub replicator: Arc<Replicator>,
    /// Failure detection.
    pub health: Arc<Health>,
}

/// The node's implementation of the public API.
pub struct NodeApi {
    node_id: NodeId,
    control: ControlPlane,
    cache: Arc<CacheStore>,
    peers: PeerClient,
    limits: Limits,
    metrics: Arc<NodeMetrics>,
    progress: Arc<Progress>,
    shadows: Arc<ShadowWriter>,
    restoring: Arc<Restoring>,
    replicator: Arc<Replicator>,
    health: Arc<Health>,
}

impl NodeApi {
    /// Wires the API over this node's parts.
    pub fn new(control: ControlPlane, cache: Arc<CacheStore>, limits: Limits, parts: NodeParts) -> Self {
        NodeApi {
            node_id: control.node_id(),
            control,
            cache,
            peers: PeerClient::new(),
            limits,
            metrics: parts.metrics,
            progress: parts.progress,
            shadows: parts.shadows,
            restoring: parts.restoring,
            replicator: parts.replicator,
            health: parts.health,
        }
    }

    /// The applied state, after waiting (bounded) until its map is at least `version`.
    async fn state_at_least(&self, version: u64) -> Arc<ClusterState> {
        let state = self.control.state();
        if state.map.version >= version {
            return state;
        }
        self.control.wait_for_state(MAP_CATCH_UP, |s| s.map.version >= version).await;
        self.control.state()
    }

    /// Decides where an operation on `bucket` runs, and under which map version.
    async fn target(&self, bucket: BucketId, ctx: RouteContext) -> Result<(Target, u64), ApiError> {
        let state = self.state_at_least(ctx.forwarded_map_version.unwrap_or(0)).await;
        self.target_in(&state, bucket, ctx)
    }

    /// [`Self::target`] on a given state (bulk operations decide every key on one state).
    fn target_in(&self, state: &ClusterState, bucket: BucketId, ctx: RouteContext) -> Result<(Target, u64), ApiError> {
        let map_version = state.map.version;
        let Some(owner) = state.map.owner_of(bucket) else {
            return Err(ApiError::unavailable("not_ready", "this node has not joined a cluster yet"));
        };
        if state.is_lost(bucket) {
            return Err(ApiError::unavailable(
                "bucket_lost",
                format!(
                    "bucket {bucket} was lost: its owner and its replica failed together; \
                     POST /v1/cluster/lost/clear acknowledges it and it serves again, empty"
                ),
            ));
        }
        if owner == self.node_id {
            if self.restoring.contains(bucket) || self.replicator.awaiting_promotion(state, bucket) {
                return Err(ApiError::unavailable(
                    "bucket_restoring",
                    format!("bucket {bucket} is being restored after a restart; retry"),
                ));
            }
            return Ok((Target::Local, map_version));
        }
        if ctx.forwarded_map_version.is_some() {
            return Err(ApiError::NotOwner { bucket: bucket.0, map_version });
        }
        if ctx.redirect {
            return Err(ApiError::Redirect { api_addr: api_addr_of(state, owner)? });
        }
        // Until the map reflects a failure, the dead owner's buckets answer at once.
        if self.health.is_pfail(owner) {
            return Err(ApiError::unavailable(
                "owner_unreachable",
                format!("node {owner}, which owns bucket {bucket}, does not answer pings; retry"),
            ));
        }
        Ok((Target::Remote { owner }, map_version))
    }

    /// Runs a key operation locally or at the owner, routing again when the owner's map
    /// disagrees with ours.
    async fn route<T, Fut>(
        &self,
        key: &str,
        ctx: RouteContext,
        local: impl Fn(BucketId) -> Result<T, ApiError>,
        remote: impl Fn(String, u64) -> Fut,
    ) -> Result<T, ApiError>
    where
        Fut: Future<Output = Result<T, ApiError>>,
    {
        let bucket = bucket_of(key.as_bytes());
        let frozen_until = Instant::now() + FROZEN_WAIT;
        let mut attempts = 0;
        while attempts < ROUTE_ATTEMPTS {
            match self.target(bucket, ctx).await? {
                (Target::Local, _) => match local(bucket) {
                    // The bucket is being handed over: wait for the flip (or the abort), then
                    // route again; the answer then comes from whoever serves it.
                    Err(e) if is_moving(&e) && Instant::now() < frozen_until => self.cache.wait_thawed().await,
                    other => return other,
                },
                (Target::Remote { owner }, version) => {
                    attempts += 1;
                    let api_addr = api_addr_of(&self.control.state(), owner)?;
                    self.metrics.forwarded.increment(1);
                    match remote(api_addr, version).await {
                        Err(ApiError::NotOwner { map_version, .. }) => {
                            self.state_at_least(map_version.max(version + 1)).await;
                        }
                        other => return other,
                    }
                }
            }
        }
        Err(ApiError::unavailable("map_changing", format!("bucket {bucket} is changing owner; retry")))
    }

    fn local_get(&self, key: &str, bucket: BucketId) -> Result<GetOk, ApiError> {
        match self.cache.get(bucket, key.as_bytes()) {
            Some(item) => {
                self.metrics.hits.increment(1);
                Ok(GetOk { value: item.value, version: item.version, bucket: bucket.0, node: self.node_id })
            }
            None => {
                self.metrics.misses.increment(1);
                Err(ApiError::NotFound)
            }
        }
    }

    fn local_put(&self, item: &PutItem, bucket: BucketId) -> Result<PutOk, ApiError> {
        let o = &item.options;
        let write = Write {
            key: item.key.as_bytes(),
            value: &item.value,
            ttl: o.ttl,
            sliding: o.sliding,
            tags: &o.tags,
            condition: match o.condition {
                WriteCondition::Always => Condition::Always,
                WriteCondition::Absent => Condition::Absent,
                WriteCondition::Present => Condition::Present,
                WriteCondition::Version(v) => Condition::Version(v),
            },
        };
        let version = self.cache.put(bucket, &write).map_err(cache_error)?;
        Ok(PutOk { key: item.key.clone(), version, bucket: bucket.0, node: self.node_id })
    }

    fn local_delete(&self, key: &str, cas: Option<u64>, bucket: BucketId) -> Result<bool, ApiError> {
        self.cache.delete(bucket, key.as_bytes(), cas).map_err(cache_error)
    }

    /// Takes back a write its replica did not apply (R16): the item as it was before comes
    /// back (or goes, if there was none), unless a newer write replaced it meanwhile. The
    /// bucket is re-sent whole to the replica before its next change, in case the replica
    /// applied the write after all.
    fn undo(&self, bucket: BucketId, key: &str, written: Option<u64>, previous: Option<&ExportedItem>) {
        self.cache.restore(bucket, key.as_bytes(), written, previous);
        self.replicator.detach(bucket);
        self.replicator.count_undone(1);
    }

    fn timed<T>(&self, op: Op, started: Instant, result: Result<T, ApiError>) -> Result<T, ApiError> {
        self.metrics.record(op, started, &result);
        result
    }
}

fn cache_error(e: CacheError) -> ApiError {
    match e {
        CacheError::ConditionFailed { current } => ApiError::PreconditionFailed { current_version: current },
        CacheError::TooLarge { .. } => ApiError::ItemTooLarge(e.to_string()),
        CacheError::Frozen => {
            ApiError::unavailable("bucket_moving", "the key's bucket is moving to another node; retry")
        }
    }
}

/// Whether `e` says the bucket is frozen for a handover.
fn is_moving(e: &ApiError) -> bool {
    matches!(e, ApiError::Unavailable { code: "bucket_moving", .. })
}

impl ShoalApi for NodeApi {
    fn limits(&self) -> Limits {
        self.limits
    }

    async fn get(&self, key: String, ctx: RouteContext) -> Result<GetOk, ApiError> {
        let started = Instant::now();
        let result = self
            .route(
                &key,
                ctx,
                |bucket| self.local_get(&key, bucket),
                |api, v| {
                    let (peers, key) = (&self.peers, &key);
                    async move { peers.get(&api, key, v).await }
                },
            )
            .await;
        self.timed(Op::Get, started, result)
    }

    async fn put(&self, item: PutItem, ctx: RouteContext) -> Result<PutOk, ApiError> {
        let started = Instant::now();
        if let Some(e) = self.health.write_refusal() {
            return self.timed(Op::Put, started, Err(e));
        }
        let bucket = bucket_of(item.key.as_bytes());
        // The guard is decided on a map at least as new as the one the request is routed on.
        let state = self.state_at_least(ctx.forwarded_map_version.unwrap_or(0)).await;
        let shadow = self.shadows.guard(&state, self.node_id, bucket).await;
        let previous = shadow.as_ref().and_then(|_| self.cache.export_item(bucket, item.key.as_bytes()));
        let mut result = self
            .route(
                &item.key,
                ctx,
                |bucket| self.local_put(&item, bucket),
                |api, v| {
                    let (peers, item) = (&self.peers, &item);
                    async move { peers.put(&api, item, v).await }
                },
            )
            .await;
        // The lease again, after the write: a node paused between the check and the write
        // must not acknowledge it.
        if let (Ok(ok), Some(e)) = (&result, self.health.write_refusal()) {
            if ok.node == self.node_id {
                self.undo(bucket, &item.key, Some(ok.version), previous.as_ref());
                result = Err(e);
            }
        }
        if let (Some(guard), Ok(ok)) = (&shadow, &result) {
            if ok.node == self.node_id {
                if let Some(stored) = self.cache.export_item(bucket, item.key.as_bytes()) {
                    if let Err(e) = self.shadows.write_through(guard, &[Change::Put(stored)]).await {
                        self.undo(bucket, &item.key, Some(ok.version), previous.as_ref());
                        result = Err(e);
                    }
                }
            }
        }
        self.timed(Op::Put, started, result)
    }

    async fn delete(&self, key: String, cas: Option<u64>, ctx: RouteContext) -> Result<(), ApiError> {
        let started = Instant::now();
        if let Some(e) = self.health.write_refusal() {
            return self.timed(Op::Delete, started, Err(e));
        }
        let bucket = bucket_of(key.as_bytes());
        let state = self.state_at_least(ctx.forwarded_map_version.unwrap_or(0)).await;
        let shadow = self.shadows.guard(&state, self.node_id, bucket).await;
        let before = shadow.as_ref().and_then(|_| self.cache.export_item(bucket, key.as_bytes()));
        let local = |bucket| match self.local_delete(&key, cas, bucket)? {
            true => Ok(()),
            false => Err(ApiError::NotFound),
        };
        let mut result = self
            .route(&key, ctx, local, |api, v| {
                let (peers, key) = (&self.peers, &key);
                async move { peers.delete(&api, key, cas, v).await }
            })
            .await;
        if let (Some(gone), Ok(()), Some(e)) = (&before, &result, self.health.write_refusal()) {
            if self.cache.export_item(bucket, key.as_bytes()).is_none() {
                self.undo(bucket, &key, None, Some(gone));
                result = Err(e);
            }
        }
        if let (Some(guard), Some(gone), Ok(())) = (&shadow, before, &result) {
            if self.cache.export_item(bucket, key.as_bytes()).is_none() {
                let change = Change::Delete { key: gone.key.clone(), version: gone.version };
                if let Err(e) = self.shadows.write_through(guard, &[change]).await {
                    self.undo(bucket, &key, None, Some(&gone));
                    result = Err(e);
                }
            }
        }
        self.timed(Op::Delete, started, result)
    }

    async fn bulk_get(
        &self,
        keys: Vec<String>,
        ctx: RouteContext,
    ) -> Result<Vec<Result<Option<GetOk>, ApiError>>, ApiError> {
        self.bulk_get_routed(keys, ctx).await
    }

    async fn bulk_put(&self, items: Vec<PutItem>, ctx: RouteContext) -> Result<Vec<Result<PutOk, ApiError>>, ApiError> {
        self.bulk_put_routed(items, ctx).await
    }

    async fn bulk_delete(&self, keys: Vec<String>, ctx: RouteContext) -> Result<Vec<Result<bool, ApiError>>, ApiError> {
        self.bulk_delete_routed(keys, ctx).await
    }

    async fn keys(&self, prefix: String, limit: usize, scope: Scope) -> Result<KeyList, ApiError> {
        self.keys_everywhere(prefix, limit, scope).await
    }

    async fn tagged(&self, tag: String, limit: usize, scope: Scope) -> Result<KeyList, ApiError> {
        self.tagged_everywhere(tag, limit, scope).await
    }

    async fn remove_tagged(&self, tag: String, scope: Scope) -> Result<Removed, ApiError> {
        self.remove_tagged_everywhere(tag, scope).await
    }

    async fn cluster(&self) -> Result<ClusterView, ApiError> {
        self.cluster_view().await
    }

    fn map(&self) -> Result<MapView, ApiError> {
        self.map_view()
    }

    async fn transfer(&self) -> Result<TransferView, ApiError> {
        Ok(self.transfer_view().await)
    }

    fn node_stats(&self) -> NodeStats {
        self.own_stats()
    }

    async fn leave(&self, node_id: NodeId, force: bool) -> Result<LeaveOk, ApiError> {
        self.make_leave(node_id, force).await
    }

    async fn set_config(&self, config: ClusterConfig) -> Result<ClusterConfig, ApiError> {
        self.change_config(config).await
    }

    async fn clear_lost(&self, clear: ClearLost) -> Result<ClearLost, ApiError> {
        self.acknowledge_lost(clear).await
    }

    fn readiness(&self) -> Vec<Check> {
        self.checks()
    }

    fn liveness(&self) -> Option<String> {
        self.control.raft_metrics().running_state.as_ref().err().map(|fatal| format!("the Raft core stopped: {fatal}"))
    }

    fn metrics(&self) -> String {
        self.refresh_gauges();
        let peers: Vec<(u64, bool, Option<f64>)> = self
            .health
            .peers()
            .into_iter()
            .map(|p| (p.node_id, p.state == "pfail", p.last_contact_ms.map(|ms| ms as f64 / 1000.0)))
            .collect();
        let mut text = self.metrics.render();
        text.push_str(&crate::metrics::render_peers(&peers));
        text
    }
}
