//! [`NodeApi`]: the node behind the public API. Every key operation is served here if this
//! node owns the key's bucket, or forwarded to the owner in one hop.
//!
//! ```text
//!  client ──> any node ── owner_of(bucket_of(key)) == me ? ──yes──> CacheStore
//!                │                                    no
//!                └── forward (map version v, on the link) ──> owner ── owns it in its map ≥ v?
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
//! - `mod.rs`: routing (`target`, `route`), the single-key operations, the impls of the key API, cluster admin and probes.
//! - `bulk.rs`: bulk operations, grouped by owner.
//! - `keyless.rs`: broadcasts (prefix listing, tags).
//! - `admin.rs`: cluster views, leave, readiness, state gauges; the admin calls between members.
//! - `forward.rs`: key operations forwarded to their owner or a mirror, both ends.

pub mod admin;
mod bulk;
pub mod forward;
pub mod keyless;

/// Registers what the node API answers other nodes: forwarded key operations, its share of
/// broadcasts, and admin calls.
pub fn register(handlers: &mut crate::transport::wire::Handlers, api: &Arc<NodeApi>) {
    forward::register(handlers, api);
    keyless::register(handlers, api);
    admin::register(handlers, api);
}

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use shoal_http_api::types::{
    AgentsView, BucketsQuery, BucketsView, Check, ClearLost, ClusterConfig, ClusterView, EventsView, GetOk, KeyList,
    LeaveOk, LostCleared, MaintenanceView, MapView, NodeStats, Page, PutOk, ReadFrom, RebalancePlan, RebalanceRequest,
    Removed, RouteContext, Scope, TransferView, WriteCondition,
};
use shoal_http_api::{AdminApi, ApiError, KeyApi, Limits, Probes, PutItem};
use shoal_raft::{bucket_of, BucketId, ClusterState, ControlPlane, NodeId};

use crate::bucket::BucketCore;
use crate::cache::{CacheError, CacheStore, Condition, Write};
use crate::error::DataError;
use crate::health::Health;
use crate::metrics::{NodeMetrics, Op};
use crate::mirror::{outcome_of, Mirrors, Outcome};
use crate::peer::Peers;
use crate::phase::{mirror_read, mirrors_of, Phase, Route, Routing};
use crate::replication::Replicator;
use crate::transfer::progress::Progress;
use crate::transport::Addrs;

/// How long a node waits to catch up with a newer map version before answering.
const MAP_CATCH_UP: Duration = Duration::from_secs(2);
/// How long a mirror waits to apply the map version its sender routed by before it refuses
/// (the sender waits a second for a mirror).
const MIRROR_CATCH_UP: Duration = Duration::from_millis(300);
/// How many times a key operation is routed again after `not_owner`.
const ROUTE_ATTEMPTS: usize = 3;
/// How long a write waits for a bucket frozen by a handover before answering 503.
const FROZEN_WAIT: Duration = Duration::from_secs(10);
/// How long a key operation waits for ownership passing from one node to another (a leaver
/// handing its buckets over, the heir installing its copy) before answering 503.
const PASSING_WAIT: Duration = Duration::from_secs(3);
/// How long one wait for passing ownership watches for a newer map before looking again.
const PASSING_POLL: Duration = Duration::from_millis(100);

/// Where member `id` in `state` is reached.
fn addrs_of(state: &ClusterState, id: NodeId) -> Result<Addrs, ApiError> {
    state
        .member_of(id)
        .map(|m| Addrs { api: m.api_addr.clone(), peer: m.peer_addr.clone() })
        .ok_or_else(|| ApiError::Internal(format!("owner {id} not a member")))
}

/// The node's shared parts the API reads besides the store and the control plane.
pub struct NodeParts {
    /// Metrics.
    pub metrics: Arc<NodeMetrics>,
    /// Transfer progress.
    pub progress: Arc<Progress>,
    /// What the node does with each bucket, and the write path.
    pub core: Arc<BucketCore>,
    /// Replicas.
    pub replicator: Arc<Replicator>,
    /// Failure detection.
    pub health: Arc<Health>,
    /// Calls to other nodes.
    pub peers: Peers,
    /// Memory for request bodies in flight.
    pub bodies: Arc<crate::body_budget::BodyBudget>,
    /// Mirror choice and statistics.
    pub mirrors: Arc<Mirrors>,
    /// Bucket statistics and balancing by data.
    pub balancer: Arc<crate::balance::Balancer>,
    /// Whether the API is served over TLS: a redirect then names an `https://` URL.
    pub https: bool,
    /// This node's own entry into maintenance.
    pub entry: Arc<crate::maintenance::Entry>,
}

/// The node's implementation of the public API.
pub struct NodeApi {
    node_id: NodeId,
    control: ControlPlane,
    cache: Arc<CacheStore>,
    peers: Peers,
    limits: Limits,
    metrics: Arc<NodeMetrics>,
    progress: Arc<Progress>,
    core: Arc<BucketCore>,
    replicator: Arc<Replicator>,
    health: Arc<Health>,
    bodies: Arc<crate::body_budget::BodyBudget>,
    mirrors: Arc<Mirrors>,
    balancer: Arc<crate::balance::Balancer>,
    https: bool,
    entry: Arc<crate::maintenance::Entry>,
}

/// How a request reached this node, as the bucket core sees it.
fn routing(ctx: RouteContext) -> Routing {
    Routing { forwarded: ctx.forwarded_map_version.is_some(), redirect: ctx.redirect }
}

/// Whether a local attempt found the bucket frozen by a move (wait, then route again).
fn is_moving(e: &DataError) -> bool {
    matches!(e, DataError::Moving(_) | DataError::Store(CacheError::Frozen))
}

/// Whether an attempt found the bucket's ownership passing to another node: its owner hands
/// its buckets over (it leaves), or the heir has not installed its copy yet. Both end within
/// moments when nothing fails: wait, then route again.
fn is_passing(e: &DataError) -> bool {
    matches!(e, DataError::NodeLeaving | DataError::Restoring(_))
}

/// [`is_passing`] for an owner's answer to a forwarded operation.
fn is_passing_answer(e: &ApiError) -> bool {
    matches!(
        e,
        ApiError::Unavailable {
            code: shoal_http_api::Unavailable::NodeLeaving | shoal_http_api::Unavailable::BucketRestoring,
            ..
        }
    )
}

/// The store's write of a validated item.
fn write_of(item: &PutItem) -> Write<'_> {
    let o = &item.options;
    Write {
        key: item.key.as_bytes(),
        value: &item.value,
        ttl: o.ttl,
        sliding: o.sliding,
        tags: &o.tags,
        priority: o.priority,
        condition: match o.condition {
            WriteCondition::Always => Condition::Always,
            WriteCondition::Absent => Condition::Absent,
            WriteCondition::Present => Condition::Present,
            WriteCondition::Version(v) => Condition::Version(v),
        },
    }
}

impl NodeApi {
    /// The node's metrics.
    pub fn metrics(&self) -> &Arc<NodeMetrics> {
        &self.metrics
    }

    /// Wires the API over this node's parts.
    pub fn new(control: ControlPlane, cache: Arc<CacheStore>, limits: Limits, parts: NodeParts) -> Self {
        NodeApi {
            node_id: control.node_id(),
            control,
            cache,
            peers: parts.peers,
            limits,
            metrics: parts.metrics,
            progress: parts.progress,
            core: parts.core,
            replicator: parts.replicator,
            health: parts.health,
            bodies: parts.bodies,
            mirrors: parts.mirrors,
            balancer: parts.balancer,
            https: parts.https,
            entry: parts.entry,
        }
    }

    /// A redirect to `owner`'s API (`https://` when this cluster serves TLS).
    fn redirect_to(&self, state: &ClusterState, owner: NodeId) -> ApiError {
        match addrs_of(state, owner) {
            Ok(to) if self.https => ApiError::Redirect { api_addr: format!("https://{}", to.api) },
            Ok(to) => ApiError::Redirect { api_addr: to.api },
            Err(e) => e,
        }
    }

    /// The applied state to route a request by: for another node's forward, after waiting
    /// (bounded) until its map is at least the sender's; a client's version this node has not
    /// applied is refused at once.
    async fn state_for(&self, ctx: RouteContext) -> Result<Arc<ClusterState>, DataError> {
        let want = ctx.forwarded_map_version.unwrap_or(0);
        let state = self.control.state();
        if state.map.version >= want {
            return Ok(state);
        }
        if !ctx.from_peer {
            return Err(DataError::MapBehind { have: state.map.version, want });
        }
        Ok(self.state_at_least(want).await)
    }

    /// Waits a moment for ownership that is passing (see [`is_passing`]): until the map is
    /// newer than `version`, or a short poll (an install changes no map).
    async fn wait_passing(&self, version: u64) {
        self.control.wait_for_state(PASSING_POLL, |s| s.map.version > version).await;
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

    /// Runs a key operation on `bucket` here, when the bucket core says this node serves it,
    /// or at its owner, routing again when the owner's map disagrees with ours (`not_owner`),
    /// the bucket is frozen while it moves (its flip or abort is waited for, then the
    /// operation goes to whoever serves it), or its ownership is passing to another node (a
    /// hand-over, an install: waited for, bounded).
    async fn route<T, L, LF, R, RF>(
        &self,
        bucket: BucketId,
        ctx: RouteContext,
        local: L,
        remote: R,
    ) -> Result<T, ApiError>
    where
        L: Fn() -> LF,
        LF: Future<Output = Result<T, DataError>>,
        R: Fn(NodeId, Addrs, u64) -> RF,
        RF: Future<Output = Result<T, ApiError>>,
    {
        let now = tokio::time::Instant::now();
        let (frozen_until, passing_until) = (now + FROZEN_WAIT, now + PASSING_WAIT);
        let may_wait = || tokio::time::Instant::now() < passing_until;
        let mut attempts = 0;
        while attempts < ROUTE_ATTEMPTS {
            let state = self.state_for(ctx).await?;
            let route = match self.core.route(&state, bucket, routing(ctx)) {
                Err(e) if is_passing(&e) && may_wait() => {
                    self.wait_passing(state.map.version).await;
                    continue;
                }
                other => other?,
            };
            match route {
                Route::Local => match local().await {
                    Err(e) if is_moving(&e) && tokio::time::Instant::now() < frozen_until => {
                        self.cache.wait_thawed().await
                    }
                    Err(e) if is_passing(&e) && may_wait() => self.wait_passing(state.map.version).await,
                    // The map moved between the routing and the write: route again.
                    Err(DataError::NotOwner { .. }) => attempts += 1,
                    other => return other.map_err(ApiError::from),
                },
                Route::Redirect { owner } => return Err(self.redirect_to(&state, owner)),
                Route::Forward { owner } => {
                    attempts += 1;
                    let version = state.map.version;
                    let to = addrs_of(&state, owner)?;
                    self.metrics.forwarded.increment(1);
                    let answer = tokio::select! {
                        answer = remote(owner, to, version) => answer,
                        () = self.health.silent(owner) => Err(DataError::OwnerUnreachable { owner, bucket }.into()),
                    };
                    match answer {
                        Err(ApiError::NotOwner { map_version, .. }) => {
                            self.state_at_least(map_version.max(version + 1)).await;
                        }
                        Err(e) if is_passing_answer(&e) && may_wait() => {
                            // Not an attempt lost to a map that moved: the deadline bounds it.
                            attempts -= 1;
                            self.wait_passing(version).await;
                        }
                        other => return other,
                    }
                }
            }
        }
        Err(DataError::MapChanging(bucket).into())
    }

    /// Reads `key` here, once no write of its bucket may still be taken back, if the node
    /// still holds its lease then (the wait may be a replication round trip).
    async fn local_get(&self, key: &str, bucket: BucketId) -> Result<Option<GetOk>, DataError> {
        let _committed = self.core.facts().committed(bucket).await;
        if let Some(refusal) = self.core.read_refusal() {
            return Err(refusal);
        }
        if let Some(probe) = self.core.probe() {
            probe.served(self.node_id, bucket, self.control.state().epoch_of(bucket));
        }
        self.core.activity().read(bucket);
        match self.cache.get(bucket, key.as_bytes()) {
            Some(item) => {
                self.metrics.hits.increment(1);
                Ok(Some(GetOk {
                    value: item.value,
                    version: item.version,
                    bucket: bucket.0,
                    node: self.node_id,
                    lag_ms: None,
                }))
            }
            None => {
                self.metrics.misses.increment(1);
                Ok(None)
            }
        }
    }

    /// Waits (bounded) until this node has applied the map the sender of a mirror read routed
    /// by; a node still behind refuses (`replica_not_fresh`): its copy may be one the sender
    /// already knows is no mirror.
    async fn mirror_state(&self, ctx: RouteContext, bucket: BucketId) -> Result<(), DataError> {
        let want = ctx.forwarded_map_version.unwrap_or(0);
        if self.control.state().map.version < want {
            // Well within the sender's wait for a mirror: a refusal, not a timeout, tells it
            // to ask the owner (a timeout would count this node dead).
            self.control.wait_for_state(MIRROR_CATCH_UP, |s| s.map.version >= want).await;
        }
        if self.control.state().map.version < want {
            return Err(DataError::ReplicaNotFresh { bucket, why: crate::error::NotFresh::NotMirror });
        }
        Ok(())
    }

    /// Whether a client's read may go to any mirror of its bucket: it asked for it (or the
    /// node's default says so) and it is not routed by another node or a map version.
    fn reads_from_mirrors(&self, ctx: RouteContext) -> bool {
        ctx.forwarded_map_version.is_none()
            && !ctx.redirect
            && ctx.read.unwrap_or(self.mirrors.config().read_from) == ReadFrom::Mirrors
    }

    /// The staleness a client's mirror read allows.
    fn staleness(&self, ctx: RouteContext) -> Duration {
        ctx.max_staleness.unwrap_or(self.mirrors.config().max_staleness)
    }

    /// Reads `key` from this node's replica copy of `bucket`, if this node is a mirror of it
    /// whose copy is fresh within `staleness` (else `replica_not_fresh`), and it holds its
    /// lease (a node cut off long enough to be failed serves no read).
    fn local_mirror_get(&self, key: &str, bucket: BucketId, staleness: Duration) -> Result<Option<GetOk>, DataError> {
        if let Some(refusal) = self.core.read_refusal() {
            return Err(refusal);
        }
        let state = self.control.state();
        let phase = self.core.phase(&state, bucket);
        let Phase::Mirror { owner } = phase else {
            return Err(DataError::ReplicaNotFresh { bucket, why: crate::error::NotFresh::NotMirror });
        };
        let allowed = staleness.as_millis() as u64;
        let (found, lag) = self
            .replicator
            .holder
            .mirror_get(&state, bucket, owner, key.as_bytes(), |facts| {
                mirror_read(&state, bucket, phase, facts, allowed)
            })
            .map_err(|why| DataError::ReplicaNotFresh { bucket, why })?;
        // None: the copy does not hold the key; the sender asks the owner, since the replica
        // store evicts on its own and only the owner can say the key is absent.
        let Some(item) = found else { return Ok(None) };
        if let Some(probe) = self.core.probe() {
            probe.served_replica(self.node_id, bucket, state.epoch_of(bucket));
        }
        Ok(Some(GetOk {
            value: item.value,
            version: item.version,
            bucket: bucket.0,
            node: self.node_id,
            lag_ms: Some(lag),
        }))
    }

    /// A client's read balanced over the mirrors of `bucket`: the chosen mirror's answer, or
    /// `Err(chosen)` when the read goes the usual way to the owner (the owner was chosen, the
    /// bucket has no other mirror now, or the chosen copy refused or did not answer).
    async fn mirror_get(
        &self,
        key: &str,
        bucket: BucketId,
        ctx: RouteContext,
    ) -> Result<Result<GetOk, ApiError>, Option<NodeId>> {
        let state = self.control.state();
        let (Some(owner), Some(holder)) = mirrors_of(&state, bucket) else { return Err(None) };
        let chosen = self.mirrors.choose(&[owner, holder]).ok_or(None)?;
        if chosen == owner {
            return Err(Some(owner));
        }
        let staleness = self.staleness(ctx);
        let sent = Instant::now();
        let answer = if holder == self.node_id {
            self.local_mirror_get(key, bucket, staleness).map_err(|e| {
                tracing::trace!(bucket = bucket.0, error = %e, "mirror read at the owner instead");
                Outcome::Refused
            })
        } else {
            let to = addrs_of(&state, holder).map_err(|_| None)?;
            self.peers.mirror_get(to, key, state.map.version, staleness).await.map_err(|e| outcome_of(&e))
        };
        match answer {
            Ok(Some(found)) => {
                self.mirrors.record_read(holder, Outcome::Answered, sent.elapsed());
                self.mirrors.served_by(holder);
                Ok(Ok(found))
            }
            Ok(None) => {
                // The copy does not hold the key: only the owner can say it is absent.
                self.mirrors.record_read(holder, Outcome::Answered, sent.elapsed());
                Err(None)
            }
            Err(outcome) => {
                self.mirrors.record_read(holder, outcome, sent.elapsed());
                Err(None)
            }
        }
    }

    /// Writes `item` here, through a write permit.
    async fn local_put(&self, item: &PutItem, bucket: BucketId) -> Result<PutOk, DataError> {
        let mut permit = self.core.write_permit(bucket).await?;
        let version = permit.put(&write_of(item))?;
        permit.commit().await?;
        Ok(PutOk { key: item.key.clone(), version, bucket: bucket.0, node: self.node_id })
    }

    /// Deletes `key` here, through a write permit; `Ok(false)` when absent.
    async fn local_delete(&self, key: &str, cas: Option<u64>, bucket: BucketId) -> Result<bool, DataError> {
        let mut permit = self.core.write_permit(bucket).await?;
        let deleted = permit.delete(key.as_bytes(), cas)?;
        permit.commit().await?;
        Ok(deleted)
    }

    /// Why this node takes no write now, even one it would only forward (it is stopping,
    /// failed, or cut off from a majority). A node handing its buckets over (leaving) still
    /// takes writes: those of its own buckets wait for the hand-over and go to the heir.
    /// Another node's forward is not refused here: this node writes it only if it owns the
    /// bucket (where the write permit refuses it), and otherwise answers `not_owner`, so that
    /// the sender routes it again (a node that left, and stops, owns nothing).
    fn write_refusal(&self, ctx: RouteContext) -> Option<ApiError> {
        if ctx.forwarded_map_version.is_some() {
            return None;
        }
        self.core.write_refusal().filter(|e| !matches!(e, DataError::NodeLeaving)).map(ApiError::from)
    }

    fn timed<T>(&self, op: Op, started: Instant, result: Result<T, ApiError>) -> Result<T, ApiError> {
        self.metrics.record(op, started, &result);
        result
    }
}

impl KeyApi for NodeApi {
    fn limits(&self) -> Limits {
        self.limits
    }

    async fn admit_body(&self, bytes: usize) -> Result<shoal_http_api::BodyPermit, ApiError> {
        self.bodies.admit(bytes).await
    }

    async fn get(&self, key: String, ctx: RouteContext) -> Result<GetOk, ApiError> {
        let started = Instant::now();
        let bucket = bucket_of(key.as_bytes());
        if let Some(staleness) = ctx.mirror_read {
            // Another node's mirror read: this node's replica copy or a refusal, never a forward.
            let result = match self.mirror_state(ctx, bucket).await {
                Ok(()) => self.local_mirror_get(&key, bucket, staleness),
                Err(e) => Err(e),
            };
            let result = result.map_err(ApiError::from).and_then(|found| found.ok_or(ApiError::NotFound));
            return self.timed(Op::Get, started, result);
        }
        let mut to_owner = None;
        if self.reads_from_mirrors(ctx) {
            match self.mirror_get(&key, bucket, ctx).await {
                Ok(result) => return self.timed(Op::Get, started, result),
                Err(owner) => to_owner = owner,
            }
        }
        let local = || self.local_get(&key, bucket);
        let remote = |_: NodeId, to: Addrs, v: u64| {
            let (peers, key) = (&self.peers, &key);
            async move { peers.get(&to, key, v).await }
        };
        let result = self.route(bucket, ctx, local, remote).await.and_then(|found| found.ok_or(ApiError::NotFound));
        if let Some(owner) = to_owner {
            // The owner was the chosen mirror: its answer counts in its statistics.
            let outcome = match &result {
                Ok(_) | Err(ApiError::NotFound) => Outcome::Answered,
                Err(_) => Outcome::Refused,
            };
            self.mirrors.record_read(owner, outcome, started.elapsed());
            if outcome == Outcome::Answered {
                self.mirrors.served_by(owner);
            }
        }
        self.timed(Op::Get, started, result)
    }

    async fn put(&self, item: PutItem, ctx: RouteContext) -> Result<PutOk, ApiError> {
        let started = Instant::now();
        if let Some(e) = self.write_refusal(ctx) {
            return self.timed(Op::Put, started, Err(e));
        }
        let bucket = bucket_of(item.key.as_bytes());
        let local = || self.local_put(&item, bucket);
        let remote = |_: NodeId, to: Addrs, v: u64| {
            let (peers, item) = (&self.peers, &item);
            async move { peers.put(&to, item, v).await }
        };
        let result = self.route(bucket, ctx, local, remote).await;
        self.timed(Op::Put, started, result)
    }

    async fn delete(&self, key: String, cas: Option<u64>, ctx: RouteContext) -> Result<(), ApiError> {
        let started = Instant::now();
        if let Some(e) = self.write_refusal(ctx) {
            return self.timed(Op::Delete, started, Err(e));
        }
        let bucket = bucket_of(key.as_bytes());
        let local = || self.local_delete(&key, cas, bucket);
        let remote = |_: NodeId, to: Addrs, v: u64| {
            let (peers, key) = (&self.peers, &key);
            async move { peers.delete(&to, key, cas, v).await }
        };
        let result = self.route(bucket, ctx, local, remote).await.and_then(|deleted| {
            if deleted {
                Ok(())
            } else {
                Err(ApiError::NotFound)
            }
        });
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

    async fn keys(&self, prefix: String, page: Page, scope: Scope) -> Result<KeyList, ApiError> {
        self.keys_everywhere(prefix, page, scope).await
    }

    async fn tagged(&self, tag: String, page: Page, scope: Scope) -> Result<KeyList, ApiError> {
        self.tagged_everywhere(tag, page, scope).await
    }

    async fn remove_tagged(&self, tag: String, scope: Scope) -> Result<Removed, ApiError> {
        self.remove_tagged_everywhere(tag, scope).await
    }
}

impl AdminApi for NodeApi {
    async fn cluster(&self) -> Result<ClusterView, ApiError> {
        self.cluster_view().await
    }

    fn map(&self) -> Result<MapView, ApiError> {
        self.map_view()
    }

    async fn watch_map(&self, after: u64, timeout: Duration) -> Result<MapView, ApiError> {
        self.wait_for_map(after, timeout).await
    }

    async fn events(&self, since: u64, limit: usize, wait: Duration) -> Result<EventsView, ApiError> {
        Ok(self.event_page(since, limit, wait).await)
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

    async fn enter_maintenance(&self, node_id: NodeId, period: Duration) -> Result<MaintenanceView, ApiError> {
        self.make_maintenance(node_id, period).await
    }

    async fn end_maintenance(&self, node_id: NodeId) -> Result<MaintenanceView, ApiError> {
        self.stop_maintenance(node_id).await
    }

    async fn config(&self) -> Result<ClusterConfig, ApiError> {
        let settings = self.control.state().settings.clone();
        Ok(ClusterConfig {
            replication: Some(settings.replication.to_string()),
            auto_balance: Some(settings.auto_balance),
        })
    }

    async fn set_config(&self, config: ClusterConfig) -> Result<ClusterConfig, ApiError> {
        self.change_config(config).await
    }

    async fn clear_lost(&self, clear: ClearLost) -> Result<LostCleared, ApiError> {
        self.acknowledge_lost(clear).await
    }

    async fn buckets(&self, query: BucketsQuery) -> Result<BucketsView, ApiError> {
        self.balancer.buckets(query).await.map_err(admin::balance_error)
    }

    async fn rebalance(&self, request: RebalanceRequest) -> Result<RebalancePlan, ApiError> {
        self.balancer.rebalance(request).await.map_err(admin::balance_error)
    }

    fn agents(&self) -> AgentsView {
        let members: Vec<NodeId> = self.control.state().members.iter().map(|m| m.id).collect();
        self.mirrors.view(&members)
    }
}

impl Probes for NodeApi {
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
            .map(|p| {
                (
                    p.node_id,
                    p.state == shoal_http_api::types::PeerState::Pfail,
                    p.last_contact_ms.map(|ms| ms as f64 / 1000.0),
                )
            })
            .collect();
        let mut text = self.metrics.render();
        text.push_str(&crate::metrics::render_peers(&peers));
        let members: Vec<NodeId> = self.control.state().members.iter().map(|m| m.id).collect();
        text.push_str(&self.mirrors.render(&members));
        text
    }
}
