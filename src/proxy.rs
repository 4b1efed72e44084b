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
//! Not done here yet (next issue): data does not move when the map changes, so the buckets
//! that change owner lose their items.

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use base64::Engine;
use bytes::Bytes;
use futures::future::join_all;
use shoal_http_api::types::{
    BulkResults, Check, ClusterView, FoundKey, GetOk, KeyError, KeyList, KeyResult, LeaveOk, MapNode, MapView,
    MemberView, NodeFailure, NodeStats, PutOk, Removed, RouteContext, Scope, WriteCondition,
};
use shoal_http_api::{ApiError, Limits, Problem, PutItem, ShoalApi};
use shoal_raft::{bucket_of, AdminRequest, BucketId, ClusterState, ControlError, ControlPlane, NodeId};

use crate::cache::{CacheError, CacheStore, Condition, Write};
use crate::metrics::{NodeMetrics, Op};
use crate::peer::PeerClient;

/// How long a node waits to catch up with a newer map version before answering.
const MAP_CATCH_UP: Duration = Duration::from_secs(2);
/// How many times a key operation is routed again after `not_owner`.
const ROUTE_ATTEMPTS: usize = 3;

/// Where a key operation runs.
enum Target {
    Local,
    Remote { api_addr: String, owner: NodeId },
}

/// The node's implementation of the public API.
pub struct NodeApi {
    node_id: NodeId,
    control: ControlPlane,
    cache: Arc<CacheStore>,
    peers: PeerClient,
    limits: Limits,
    metrics: Arc<NodeMetrics>,
}

impl NodeApi {
    /// Wires the API over this node's parts.
    pub fn new(control: ControlPlane, cache: Arc<CacheStore>, limits: Limits, metrics: Arc<NodeMetrics>) -> Self {
        NodeApi { node_id: control.node_id(), control, cache, peers: PeerClient::new(), limits, metrics }
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
        let map_version = state.map.version;
        let Some(owner) = state.map.owner_of(bucket) else {
            return Err(ApiError::unavailable("not_ready", "this node has not joined a cluster yet"));
        };
        if owner == self.node_id {
            return Ok((Target::Local, map_version));
        }
        if ctx.forwarded_map_version.is_some() {
            return Err(ApiError::NotOwner { bucket: bucket.0, map_version });
        }
        let member = state.member_of(owner).ok_or_else(|| ApiError::Internal(format!("owner {owner} not a member")))?;
        if ctx.redirect {
            return Err(ApiError::Redirect { api_addr: member.api_addr.clone() });
        }
        Ok((Target::Remote { api_addr: member.api_addr.clone(), owner }, map_version))
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
        for _ in 0..ROUTE_ATTEMPTS {
            match self.target(bucket, ctx).await? {
                (Target::Local, _) => return local(bucket),
                (Target::Remote { api_addr, .. }, version) => {
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

    /// Runs a bulk operation: items grouped by owner, local ones here, each remote group in
    /// one forwarded request, all groups at once; groups refused with `not_owner` are routed
    /// again. Results come back in request order.
    async fn bulk<I, T, Fut>(
        &self,
        items: &[I],
        key_of: impl Fn(&I) -> &str,
        ctx: RouteContext,
        local: impl Fn(&I, BucketId) -> Result<T, ApiError>,
        remote: impl Fn(String, NodeId, Vec<I>, u64) -> Fut,
    ) -> Result<Vec<Result<T, ApiError>>, ApiError>
    where
        I: Clone,
        Fut: Future<Output = Result<Vec<Result<T, ApiError>>, ApiError>>,
    {
        let mut results: Vec<Option<Result<T, ApiError>>> = (0..items.len()).map(|_| None).collect();
        let mut pending: Vec<usize> = (0..items.len()).collect();
        for _ in 0..ROUTE_ATTEMPTS {
            if pending.is_empty() {
                break;
            }
            let mut groups: BTreeMap<NodeId, (String, u64, Vec<usize>)> = BTreeMap::new();
            for &i in &pending {
                let bucket = bucket_of(key_of(&items[i]).as_bytes());
                match self.target(bucket, ctx).await {
                    Ok((Target::Local, _)) => results[i] = Some(local(&items[i], bucket)),
                    Ok((Target::Remote { api_addr, owner }, v)) => {
                        groups.entry(owner).or_insert((api_addr, v, vec![])).2.push(i)
                    }
                    Err(e @ ApiError::NotOwner { .. }) if ctx.forwarded_map_version.is_some() => return Err(e),
                    Err(e) => results[i] = Some(Err(e)),
                }
            }
            let calls = groups.into_iter().map(|(owner, (api_addr, version, idx))| {
                let batch: Vec<I> = idx.iter().map(|&i| items[i].clone()).collect();
                self.metrics.forwarded.increment(idx.len() as u64);
                let call = remote(api_addr, owner, batch, version);
                async move { (idx, version, call.await) }
            });
            let mut retry = Vec::new();
            let mut newest = 0;
            for (idx, version, answer) in join_all(calls).await {
                match answer {
                    Ok(answers) if answers.len() == idx.len() => {
                        for (i, a) in idx.into_iter().zip(answers) {
                            results[i] = Some(a);
                        }
                    }
                    Ok(_) => {
                        let e = ApiError::Internal("a peer answered a bulk request with the wrong count".into());
                        idx.into_iter().for_each(|i| results[i] = Some(Err(e.clone())));
                    }
                    Err(ApiError::NotOwner { map_version, .. }) => {
                        newest = newest.max(map_version.max(version + 1));
                        retry.extend(idx);
                    }
                    Err(e) => idx.into_iter().for_each(|i| results[i] = Some(Err(e.clone()))),
                }
            }
            if !retry.is_empty() {
                self.state_at_least(newest).await;
            }
            pending = retry;
        }
        let changing = || ApiError::unavailable("map_changing", "the key's bucket is changing owner; retry");
        Ok(results.into_iter().map(|r| r.unwrap_or_else(|| Err(changing()))).collect())
    }

    /// Runs `local` here and `remote` at every other member, at once. Members that fail are
    /// reported, not fatal.
    async fn broadcast<T, Fut>(
        &self,
        local: impl FnOnce() -> T,
        remote: impl Fn(String) -> Fut,
    ) -> (Vec<(NodeId, T)>, Vec<NodeFailure>)
    where
        Fut: Future<Output = Result<T, ApiError>>,
    {
        let state = self.control.state();
        let calls = state.members.iter().filter(|m| m.id != self.node_id).map(|m| {
            let call = remote(m.api_addr.clone());
            async move { (m.id, call.await) }
        });
        let mut answers = vec![(self.node_id, local())];
        let mut failures = Vec::new();
        for (node, answer) in join_all(calls).await {
            match answer {
                Ok(a) => answers.push((node, a)),
                Err(e) => failures.push(NodeFailure { node, detail: e.to_string() }),
            }
        }
        (answers, failures)
    }

    /// The buckets this node owns in its map.
    fn owned_buckets(&self) -> Vec<BucketId> {
        self.control.state().map.buckets_of(self.node_id)
    }

    fn found_keys(&self, keys: Vec<(Vec<u8>, BucketId, u64)>) -> Vec<FoundKey> {
        keys.into_iter()
            .map(|(k, bucket, version)| FoundKey {
                key: String::from_utf8_lossy(&k).into_owned(),
                bucket: bucket.0,
                version,
                node: self.node_id,
            })
            .collect()
    }

    async fn list<Fut>(
        &self,
        limit: usize,
        scope: Scope,
        local: impl FnOnce(&[BucketId]) -> Vec<(Vec<u8>, BucketId, u64)>,
        remote: impl Fn(String) -> Fut,
    ) -> KeyList
    where
        Fut: Future<Output = Result<KeyList, ApiError>>,
    {
        let local_list = || KeyList { keys: self.found_keys(local(&self.owned_buckets())), ..Default::default() };
        if scope == Scope::Local {
            return local_list();
        }
        let (answers, errors) = self.broadcast(local_list, remote).await;
        let mut keys: Vec<FoundKey> = answers.into_iter().flat_map(|(_, list)| list.keys).collect();
        keys.sort();
        keys.truncate(limit);
        KeyList { keys, incomplete: !errors.is_empty(), errors }
    }

    fn timed<T>(&self, op: Op, started: Instant, result: Result<T, ApiError>) -> Result<T, ApiError> {
        self.metrics.record(op, started, &result);
        result
    }

    /// Refreshes the state gauges from the store and the control plane.
    fn refresh_gauges(&self) {
        let g = &self.metrics.state;
        let stats = self.cache.stats();
        g.items.set(stats.items as f64);
        g.bytes.set(stats.bytes as f64);
        g.limit_bytes.set(stats.limit_bytes as f64);
        g.evictions.absolute(stats.evictions);
        g.expirations.absolute(stats.expirations);
        let state = self.control.state();
        g.map_version.set(state.map.version as f64);
        g.buckets_owned.set(state.map.buckets_of(self.node_id).len() as f64);
        g.members.set(state.members.len() as f64);
        let raft = self.control.raft_metrics();
        g.is_leader.set(if raft.current_leader == Some(self.node_id) { 1.0 } else { 0.0 });
        g.leader_id.set(raft.current_leader.unwrap_or(0) as f64);
        g.raft_term.set(raft.current_term as f64);
        g.raft_last_log_index.set(raft.last_log_index.unwrap_or(0) as f64);
        g.raft_applied_index.set(raft.last_applied.map(|l| l.index).unwrap_or(0) as f64);
        g.raft_storage_bytes.set(self.control.storage_bytes() as f64);
    }
}

fn cache_error(e: CacheError) -> ApiError {
    match e {
        CacheError::ConditionFailed { current } => ApiError::PreconditionFailed { current_version: current },
        CacheError::TooLarge { .. } => ApiError::ItemTooLarge(e.to_string()),
    }
}

fn key_error(e: &KeyError) -> ApiError {
    ApiError::from_problem(&Problem {
        type_uri: String::new(),
        title: String::new(),
        status: e.status,
        detail: e.detail.clone(),
        code: e.code.clone(),
        current_version: None,
        map_version: None,
    })
}

fn value_of(r: &KeyResult) -> Result<Bytes, ApiError> {
    match (&r.value, &r.value_base64) {
        (Some(text), _) => Ok(Bytes::from(text.clone())),
        (None, Some(b64)) => base64::engine::general_purpose::STANDARD
            .decode(b64)
            .map(Bytes::from)
            .map_err(|e| ApiError::Internal(format!("peer sent bad base64: {e}"))),
        (None, None) => Ok(Bytes::new()),
    }
}

fn control_error(e: ControlError) -> ApiError {
    match e {
        ControlError::Rejected { reason } => ApiError::Conflict(reason),
        ControlError::NoLeader { detail } => ApiError::unavailable("no_leader", detail),
        ControlError::NotLeader { .. } | ControlError::ChangeInProgress | ControlError::Network { .. } => {
            ApiError::unavailable("unavailable", e.to_string())
        }
        ControlError::Timeout { what } => ApiError::unavailable("unavailable", format!("timed out: {what}")),
        ControlError::Fatal { detail } => ApiError::Internal(detail),
    }
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
        let result = self
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
        self.timed(Op::Put, started, result)
    }

    async fn delete(&self, key: String, cas: Option<u64>, ctx: RouteContext) -> Result<(), ApiError> {
        let started = Instant::now();
        let local = |bucket| match self.local_delete(&key, cas, bucket)? {
            true => Ok(()),
            false => Err(ApiError::NotFound),
        };
        let result = self
            .route(&key, ctx, local, |api, v| {
                let (peers, key) = (&self.peers, &key);
                async move { peers.delete(&api, key, cas, v).await }
            })
            .await;
        self.timed(Op::Delete, started, result)
    }

    async fn bulk_get(
        &self,
        keys: Vec<String>,
        ctx: RouteContext,
    ) -> Result<Vec<Result<Option<GetOk>, ApiError>>, ApiError> {
        let started = Instant::now();
        let local = |key: &String, bucket| match self.local_get(key, bucket) {
            Ok(ok) => Ok(Some(ok)),
            Err(ApiError::NotFound) => Ok(None),
            Err(e) => Err(e),
        };
        let remote = |api: String, owner: NodeId, batch: Vec<String>, v: u64| {
            let peers = &self.peers;
            async move {
                let answer: BulkResults = peers.bulk_get(&api, batch, v).await?;
                Ok(answer
                    .results
                    .iter()
                    .map(|r| match (&r.error, r.found) {
                        (Some(e), _) => Err(key_error(e)),
                        (None, Some(true)) => Ok(Some(GetOk {
                            value: value_of(r)?,
                            version: r.version.unwrap_or(0),
                            bucket: r.bucket,
                            node: owner,
                        })),
                        (None, _) => Ok(None),
                    })
                    .collect())
            }
        };
        let result = self.bulk(&keys, |k| k.as_str(), ctx, local, remote).await;
        self.timed(Op::BulkGet, started, result)
    }

    async fn bulk_put(&self, items: Vec<PutItem>, ctx: RouteContext) -> Result<Vec<Result<PutOk, ApiError>>, ApiError> {
        let started = Instant::now();
        let remote = |api: String, owner: NodeId, batch: Vec<PutItem>, v: u64| {
            let peers = &self.peers;
            async move {
                let answer = peers.bulk_put(&api, &batch, v).await?;
                Ok(answer
                    .results
                    .into_iter()
                    .map(|r| match r.error {
                        Some(e) => Err(key_error(&e)),
                        None => {
                            Ok(PutOk { version: r.version.unwrap_or(0), bucket: r.bucket, node: owner, key: r.key })
                        }
                    })
                    .collect())
            }
        };
        let result =
            self.bulk(&items, |i| i.key.as_str(), ctx, |item, bucket| self.local_put(item, bucket), remote).await;
        self.timed(Op::BulkPut, started, result)
    }

    async fn bulk_delete(&self, keys: Vec<String>, ctx: RouteContext) -> Result<Vec<Result<bool, ApiError>>, ApiError> {
        let started = Instant::now();
        let remote = |api: String, _owner: NodeId, batch: Vec<String>, v: u64| {
            let peers = &self.peers;
            async move {
                let answer = peers.bulk_delete(&api, batch, v).await?;
                Ok(answer
                    .results
                    .iter()
                    .map(|r| match &r.error {
                        Some(e) => Err(key_error(e)),
                        None => Ok(r.deleted.unwrap_or(false)),
                    })
                    .collect())
            }
        };
        let local = |key: &String, bucket| self.local_delete(key, None, bucket);
        let result = self.bulk(&keys, |k| k.as_str(), ctx, local, remote).await;
        self.timed(Op::BulkDelete, started, result)
    }

    async fn keys(&self, prefix: String, limit: usize, scope: Scope) -> Result<KeyList, ApiError> {
        let started = Instant::now();
        let list = self
            .list(
                limit,
                scope,
                |buckets| self.cache.keys_with_prefix(prefix.as_bytes(), buckets, limit),
                |api| {
                    let (peers, prefix) = (&self.peers, &prefix);
                    async move { peers.keys(&api, prefix, limit).await }
                },
            )
            .await;
        self.timed(Op::List, started, Ok(list))
    }

    async fn tagged(&self, tag: String, limit: usize, scope: Scope) -> Result<KeyList, ApiError> {
        let started = Instant::now();
        let list = self
            .list(
                limit,
                scope,
                |buckets| self.cache.keys_with_tag(&tag, buckets, limit),
                |api| {
                    let (peers, tag) = (&self.peers, &tag);
                    async move { peers.tagged(&api, tag, limit).await }
                },
            )
            .await;
        self.timed(Op::Tagged, started, Ok(list))
    }

    async fn remove_tagged(&self, tag: String, scope: Scope) -> Result<Removed, ApiError> {
        let started = Instant::now();
        let local =
            || Removed { removed: self.cache.remove_tagged(&tag, &self.owned_buckets()) as u64, ..Default::default() };
        let removed = if scope == Scope::Local {
            local()
        } else {
            let (answers, errors) = self
                .broadcast(local, |api| {
                    let (peers, tag) = (&self.peers, &tag);
                    async move { peers.remove_tagged(&api, tag).await }
                })
                .await;
            let removed = answers.iter().map(|(_, r)| r.removed).sum();
            Removed { removed, incomplete: !errors.is_empty(), errors }
        };
        self.timed(Op::RemoveTagged, started, Ok(removed))
    }

    async fn cluster(&self) -> Result<ClusterView, ApiError> {
        let state = self.control.state();
        let Some(cluster_id) = state.cluster_id.clone() else {
            return Err(ApiError::unavailable("not_ready", "this node has not joined a cluster yet"));
        };
        let raft = self.control.raft_metrics();
        let voters: Vec<NodeId> = raft.membership_config.membership().voter_ids().collect();
        let counts = state.map.counts();
        let stats = join_all(state.members.iter().map(|m| async move {
            if m.id == self.node_id {
                Some(self.node_stats())
            } else {
                self.peers.node_stats(&m.api_addr).await.ok()
            }
        }))
        .await;
        let members = state
            .members
            .iter()
            .zip(stats)
            .map(|(m, stats)| MemberView {
                id: m.id,
                api_addr: m.api_addr.clone(),
                peer_addr: m.peer_addr.clone(),
                join_seq: m.join_seq,
                role: if voters.contains(&m.id) { "voter" } else { "learner" }.to_string(),
                buckets: counts.get(&m.id).copied().unwrap_or(0),
                replica_on: state.replica_of(m.id),
                items: stats.as_ref().map(|s| s.items),
                bytes: stats.as_ref().map(|s| s.bytes),
            })
            .collect();
        Ok(ClusterView {
            cluster_id,
            node_id: self.node_id,
            leader: raft.current_leader,
            map_version: state.map.version,
            voters: state.settings.voters,
            members,
        })
    }

    fn map(&self) -> Result<MapView, ApiError> {
        let state = self.control.state();
        if state.map.is_empty() {
            return Err(ApiError::unavailable("not_ready", "this node has not joined a cluster yet"));
        }
        let nodes = state
            .members
            .iter()
            .map(|m| MapNode { id: m.id, api_addr: m.api_addr.clone(), replica_on: state.replica_of(m.id) })
            .collect();
        Ok(MapView { version: state.map.version, owners: state.map.owners.clone(), nodes })
    }

    fn node_stats(&self) -> NodeStats {
        let stats = self.cache.stats();
        NodeStats {
            node_id: self.node_id,
            items: stats.items,
            bytes: stats.bytes,
            limit_bytes: stats.limit_bytes,
            map_version: self.control.state().map.version,
        }
    }

    async fn leave(&self, node_id: NodeId) -> Result<LeaveOk, ApiError> {
        let state = self.control.state();
        if !state.is_member(node_id) {
            let why = if state.retired.contains(&node_id) { "has already left" } else { "is not a member" };
            return Err(ApiError::UnknownResource(format!("node {node_id} {why}")));
        }
        match self.control.admin(AdminRequest::Leave { node_id }).await.map_err(control_error)? {
            shoal_raft::AdminResponse::Left { map_version } => Ok(LeaveOk { node_id, map_version }),
            other => Err(ApiError::Internal(format!("unexpected answer to leave: {other:?}"))),
        }
    }

    fn readiness(&self) -> Vec<Check> {
        let state = self.control.state();
        let check = |name: &str, ok: bool, detail: &str| Check { name: name.into(), ok, detail: detail.into() };
        vec![
            check("member", state.is_member(self.node_id), "this node is not a member of a cluster (yet)"),
            check("leader", self.control.leader().is_some(), "no Raft leader is known"),
            check("map", !state.map.is_empty(), "no distribution map applied"),
        ]
    }

    fn metrics(&self) -> String {
        self.refresh_gauges();
        self.metrics.render()
    }
}
