//! Request and response bodies (JSON), and the options the handlers parse out of requests.

use std::time::Duration;

use serde::{Deserialize, Serialize};
use shoal_raft::NodeId;

/// How a key request was routed to this node.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RouteContext {
    /// Set when another node forwarded the request: the map version it routed by. The
    /// receiver serves only if it owns the bucket in its own map, and never forwards again.
    pub forwarded_map_version: Option<u64>,
    /// The request is another node's forward (it carries the forward deadline): a map version
    /// newer than this node's is waited for briefly (the sender applied it a moment earlier).
    /// A client's version this node has not applied is refused at once.
    pub from_peer: bool,
    /// `?redirect=true`: answer 307 with the owner's address instead of forwarding.
    pub redirect: bool,
    /// `?read=`: where the client lets a read be served (None: the node's `--read-from`).
    pub read: Option<ReadFrom>,
    /// `?max_staleness=`: how far behind its owner (async replication) a replica copy may be
    /// to serve the read (None: the node's `--max-staleness`).
    pub max_staleness: Option<Duration>,
    /// Set on another node's mirror read: serve it from this node's replica copy if that is
    /// fresh within this staleness, else refuse (`replica_not_fresh`); never forward it.
    pub mirror_read: Option<Duration>,
}

/// Where a read may be served: by the bucket's owner only, or by any of its mirrors (the
/// owner and the holder of its replica) that is fresh enough.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum ReadFrom {
    /// The owner (the default).
    #[default]
    Owner,
    /// Any mirror of the bucket, chosen by the node's `--ha-strategy`.
    Mirrors,
}

impl std::str::FromStr for ReadFrom {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "owner" => Ok(ReadFrom::Owner),
            "mirrors" => Ok(ReadFrom::Mirrors),
            other => Err(format!("read must be owner or mirrors, not {other:?}")),
        }
    }
}

/// Whether a keyless operation covers the whole cluster or only the answering node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scope {
    /// Broadcast to every member and merge (what clients get).
    Cluster,
    /// This node's buckets only (what the broadcast sends to each member).
    Local,
}

/// The precondition of a write, from `cas=` and `mode=`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum WriteCondition {
    /// Insert or replace.
    #[default]
    Always,
    /// Only if absent (`mode=add` or `cas=0`).
    Absent,
    /// Only if present (`mode=replace`).
    Present,
    /// Only if the current version is this (`cas=N`, N > 0).
    Version(u64),
}

/// Per-item options of a write.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PutOptions {
    /// Absolute expiration from now.
    pub ttl: Option<Duration>,
    /// Sliding expiration.
    pub sliding: Option<Duration>,
    /// Tags.
    pub tags: Vec<String>,
    /// Precondition.
    pub condition: WriteCondition,
    /// Eviction priority.
    pub priority: Priority,
}

/// An item's eviction priority (NCache's levels): with `--eviction priority` lower levels are
/// evicted first (least recently used first within a level); `not_removable` items are never
/// evicted under any policy, and a write that cannot fit beside them is refused (507).
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default, Serialize, Deserialize, utoipa::ToSchema,
)]
#[serde(rename_all = "snake_case")]
pub enum Priority {
    /// Evicted first.
    Low,
    /// Before normal items.
    BelowNormal,
    /// The default.
    #[default]
    Normal,
    /// After normal items.
    AboveNormal,
    /// Evicted last.
    High,
    /// Never evicted.
    NotRemovable,
}

impl Priority {
    /// Every level, lowest first.
    pub const ALL: [Priority; 6] = [
        Priority::Low,
        Priority::BelowNormal,
        Priority::Normal,
        Priority::AboveNormal,
        Priority::High,
        Priority::NotRemovable,
    ];

    /// Its name in a query or JSON.
    pub fn name(self) -> &'static str {
        match self {
            Priority::Low => "low",
            Priority::BelowNormal => "below_normal",
            Priority::Normal => "normal",
            Priority::AboveNormal => "above_normal",
            Priority::High => "high",
            Priority::NotRemovable => "not_removable",
        }
    }

    /// The level named `name`.
    pub fn from_name(name: &str) -> Option<Priority> {
        Priority::ALL.into_iter().find(|p| p.name() == name)
    }

    /// Its rank, 0 (low) to 5 (not removable).
    pub fn rank(self) -> u8 {
        self as u8
    }

    /// The level of rank `rank` (anything above 5 is not removable).
    pub fn of_rank(rank: u8) -> Priority {
        Priority::ALL[usize::from(rank.min(5))]
    }
}

/// A stored value and where it lives.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GetOk {
    /// The raw value.
    pub value: bytes::Bytes,
    /// The item's version (the `ETag`).
    pub version: u64,
    /// Its bucket.
    pub bucket: u16,
    /// The node that served it (its owner, or a mirror holding its replica).
    pub node: NodeId,
    /// Served from a replica copy (a mirror read): at most how far behind its owner it was, in
    /// milliseconds (0 with sync replication).
    pub lag_ms: Option<u64>,
}

/// The answer to a successful `PUT /v1/kv/{key}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct PutOk {
    /// The key written.
    pub key: String,
    /// Its new version.
    pub version: u64,
    /// Its bucket.
    pub bucket: u16,
    /// The node that holds it.
    pub node: NodeId,
}

/// `POST /v1/bulk/get` and `/v1/bulk/delete` request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct BulkKeys {
    /// The keys.
    #[schema(max_items = 10000)]
    pub keys: Vec<String>,
}

/// One item of `POST /v1/bulk/put`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct BulkPutItem {
    /// The key.
    pub key: String,
    /// The value as UTF-8 text (exactly one of `value` and `value_base64`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub value: Option<String>,
    /// The value as standard base64, for binary values.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub value_base64: Option<String>,
    /// Absolute expiration, as `ttl=` (`30s`, `5m`, or seconds).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttl: Option<String>,
    /// Sliding expiration, as `sliding=`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sliding: Option<String>,
    /// Tags.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tags: Vec<String>,
    /// `cas=`: 0 creates only, N replaces version N only.
    #[serde(default, skip_serializing_if = "Option::is_none", deserialize_with = "crate::de::whole_u64")]
    pub cas: Option<u64>,
    /// `mode=`: `add` or `replace`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mode: Option<String>,
    /// `priority=`: `low`, `below_normal`, `normal` (default), `above_normal`, `high` or
    /// `not_removable`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub priority: Option<String>,
}

/// `POST /v1/bulk/put` request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct BulkPut {
    /// The items.
    #[serde(deserialize_with = "crate::de::objects")]
    #[schema(max_items = 10000)]
    pub items: Vec<BulkPutItem>,
}

/// The error of one key in a bulk answer: what the problem document of the same operation
/// alone would have said.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct KeyError {
    /// The stable code, as in problem documents.
    pub code: String,
    /// What happened.
    pub detail: String,
    /// The HTTP status this error would have had alone.
    pub status: u16,
    /// Seconds to wait before retrying this key (every 503 has it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry_after: Option<u64>,
    /// The item's current version, for `precondition_failed` (absent: the key does not exist).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub current_version: Option<u64>,
    /// The map version of the node that answered, for `not_owner`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub map_version: Option<u64>,
}

impl KeyError {
    /// The error of one key, as a bulk answer carries it.
    pub fn of(e: &crate::ApiError) -> Self {
        let p = e.problem();
        KeyError {
            code: p.code,
            detail: p.detail,
            status: p.status,
            retry_after: e.retry_after().map(|d| d.as_secs().max(1)),
            current_version: p.current_version,
            map_version: p.map_version,
        }
    }

    /// The error a bulk answer's key carried, rebuilt as [`crate::ApiError::from_problem`]
    /// rebuilds a whole answer's.
    pub fn error(&self) -> crate::ApiError {
        let problem = crate::Problem {
            type_uri: format!("urn:shoal:problem:{}", self.code),
            title: crate::error::title_of(self.status),
            status: self.status,
            detail: self.detail.clone(),
            code: self.code.clone(),
            current_version: self.current_version,
            map_version: self.map_version,
            bucket: None,
        };
        crate::ApiError::from_problem(&problem, self.retry_after.map(Duration::from_secs))
    }
}

/// One key's result in a bulk answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default, utoipa::ToSchema)]
pub struct KeyResult {
    /// The key.
    pub key: String,
    /// For get: whether the key was found.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub found: Option<bool>,
    /// For get: the value, when it is valid UTF-8.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub value: Option<String>,
    /// For get: the value in base64, when it is not valid UTF-8.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub value_base64: Option<String>,
    /// For get and put: the item's version.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub version: Option<u64>,
    /// For delete: whether the key existed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deleted: Option<bool>,
    /// The key's bucket.
    pub bucket: u16,
    /// The failure of this key, if it failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<KeyError>,
}

/// A bulk answer: one result per requested key, in request order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default, utoipa::ToSchema)]
pub struct BulkResults {
    /// The results.
    pub results: Vec<KeyResult>,
}

/// A key found by a keyless search.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, PartialOrd, Ord, utoipa::ToSchema)]
pub struct FoundKey {
    /// The key.
    pub key: String,
    /// Its bucket.
    pub bucket: u16,
    /// Its version.
    pub version: u64,
    /// The node that holds it.
    pub node: NodeId,
}

/// A member that a broadcast could not reach.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct NodeFailure {
    /// The member.
    pub node: NodeId,
    /// What went wrong.
    pub detail: String,
}

/// Which part of a key listing to answer: at most `limit` keys, those sorting after
/// `start_after` (the previous page's `next`).
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Page {
    /// At most this many keys.
    pub limit: usize,
    /// Only keys sorting after this one.
    pub start_after: Option<String>,
}

impl Page {
    /// The first `limit` keys.
    pub fn first(limit: usize) -> Self {
        Page { limit, start_after: None }
    }

    /// The page to ask each member for: one key more, so that merging the answers tells
    /// exactly whether more keys match than the page holds.
    pub fn with_one_more(&self) -> Self {
        Page { limit: self.limit.saturating_add(1), start_after: self.start_after.clone() }
    }

    /// Whether `key` sorts after the page's start.
    pub fn after(&self, key: &[u8]) -> bool {
        self.start_after.as_deref().is_none_or(|s| key > s.as_bytes())
    }

    /// Sorts `keys`, keeps the page's `limit` of them and says whether more were found (then
    /// `next` is the last key kept: the next page starts after it).
    pub fn cut(&self, mut keys: Vec<FoundKey>) -> (Vec<FoundKey>, bool, Option<String>) {
        // A key two members list (its bucket just moved) once, at its newest version.
        keys.sort_by(|a, b| a.key.cmp(&b.key).then(b.version.cmp(&a.version)));
        keys.dedup_by(|a, b| a.key == b.key);
        let more = keys.len() > self.limit;
        keys.truncate(self.limit);
        let next = if more { keys.last().map(|k| k.key.clone()) } else { None };
        (keys, more, next)
    }
}

/// The answer to `GET /v1/kv?prefix=` and `GET /v1/tags/{tag}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default, utoipa::ToSchema)]
pub struct KeyList {
    /// The keys, sorted, at most `limit`.
    pub keys: Vec<FoundKey>,
    /// True when the listing stopped at `limit` and more keys match: ask again with
    /// `start_after` set to `next`.
    #[serde(default)]
    pub more: bool,
    /// With `more`: the last key of this page, the `start_after` of the next one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub next: Option<String>,
    /// True when some member did not answer: the list may miss keys.
    pub incomplete: bool,
    /// The members that did not answer.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub errors: Vec<NodeFailure>,
}

/// The answer to `DELETE /v1/tags/{tag}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default, utoipa::ToSchema)]
pub struct Removed {
    /// How many items were removed.
    pub removed: u64,
    /// True when some member did not answer: its items may remain.
    pub incomplete: bool,
    /// The members that did not answer.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub errors: Vec<NodeFailure>,
}

/// A member as `GET /v1/cluster` shows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct MemberView {
    /// Its id.
    pub id: NodeId,
    /// Its name (the pod name in a StatefulSet), if it gave one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// Client API address.
    pub api_addr: String,
    /// Internal address.
    pub peer_addr: String,
    /// Position in join order.
    pub join_seq: u64,
    /// `voter` or `learner` in Raft.
    pub role: String,
    /// Buckets it owns in the current map.
    pub buckets: usize,
    /// The member that holds its replica (none in a one-node cluster).
    pub replica_on: Option<NodeId>,
    /// Leaving: it serves its buckets until they have moved, then it stops.
    #[serde(default)]
    pub leaving: bool,
    /// Items it holds (None when it did not answer).
    pub items: Option<u64>,
    /// Charged bytes it holds (None when it did not answer).
    pub bytes: Option<u64>,
    /// Its release, as it answered (None when it did not answer): a rolling upgrade shows
    /// here member by member.
    #[serde(default)]
    pub version: Option<String>,
    /// The source revision it was built from.
    #[serde(default)]
    pub revision: Option<String>,
}

/// `GET /v1/cluster`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct ClusterView {
    /// The cluster's id.
    pub cluster_id: String,
    /// The node that answered.
    pub node_id: NodeId,
    /// The Raft leader, if known.
    pub leader: Option<NodeId>,
    /// The distribution map's version.
    pub map_version: u64,
    /// How many members vote in Raft.
    pub voters: u8,
    /// The members, in join order.
    pub members: Vec<MemberView>,
    /// The membership change waiting for acknowledgements, if any.
    pub transition: Option<TransitionView>,
    /// The state transfer moving buckets, if any.
    pub transfer: Option<TransferSummary>,
    /// Every other member as the answering node's failure detector sees it.
    #[serde(default)]
    pub peers: Vec<PeerHealth>,
    /// Replication from the answering node to its replica holder.
    #[serde(default)]
    pub replication: Option<ReplicationView>,
    /// Members the cluster failed (their ids are never reused).
    #[serde(default)]
    pub failed: Vec<NodeId>,
    /// Buckets of which no copy is left (both the owner and its replica were lost).
    #[serde(default)]
    pub lost_buckets: Vec<u16>,
    /// The member in maintenance, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub maintenance: Option<MaintenanceView>,
}

impl ClusterView {
    /// Why the cluster cannot serve every key now, if it cannot: no leader is known, or
    /// buckets are lost.
    pub fn unavailable(&self) -> Option<String> {
        if self.leader.is_none() {
            return Some(format!("node {} knows no leader", self.node_id));
        }
        if !self.lost_buckets.is_empty() {
            return Some(format!("{} buckets are lost", self.lost_buckets.len()));
        }
        None
    }

    /// Why the cluster is not healthy yet, every reason (none: healthy): it is unavailable, a
    /// current member is suspected or in maintenance, a transition or transfer runs, or the
    /// answering node's replicas are not all attached. Members failed in the past are no
    /// reason: they are not members any more (a failed node rejoins under a new id).
    pub fn unhealthy(&self) -> Vec<String> {
        let mut reasons: Vec<String> = self.unavailable().into_iter().collect();
        for p in self.peers.iter().filter(|p| p.state != PeerState::Ok) {
            reasons.push(format!("node {} is {} in node {}'s view", p.node_id, p.state, self.node_id));
        }
        if let Some(m) = &self.maintenance {
            reasons.push(format!("node {} is in maintenance", m.node_id));
        }
        if self.transition.is_some() || self.transfer.is_some() {
            reasons.push("buckets are moving".into());
        }
        if let Some(r) = self.replication.as_ref().filter(|r| r.attached_buckets < r.owned_buckets) {
            reasons.push(format!(
                "{} of node {}'s {} buckets have their replica attached",
                r.attached_buckets, self.node_id, r.owned_buckets
            ));
        }
        reasons
    }
}

/// `GET /v1/cluster/health` when the cluster is healthy (else 503 `unhealthy` with the
/// reasons).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct HealthView {
    /// Always true (an unhealthy cluster answers 503).
    pub healthy: bool,
    /// The node that answered.
    pub node_id: NodeId,
    /// The Raft leader.
    pub leader: Option<NodeId>,
    /// The distribution map's version.
    pub map_version: u64,
    /// How many members the cluster has.
    pub members: usize,
}

/// Body of `POST /v1/cluster/nodes/{id}/maintenance`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct MaintenanceRequest {
    /// How long the member may stay away (`90s`, `10m`, `1h`; from 10 s to 1 h; default 10 m).
    #[serde(default, rename = "for")]
    pub period: Option<String>,
}

/// A member in maintenance (`GET /v1/cluster`, and the answer to entering or ending it).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct MaintenanceView {
    /// The member.
    pub node_id: NodeId,
    /// The member serving its buckets meanwhile (the holder of its replica).
    pub served_by: NodeId,
    /// When it began (ms since the Unix epoch).
    pub since_ms: u64,
    /// When it runs out (ms since the Unix epoch): if the member is not back by then, it is
    /// failed and the map is rebalanced without it.
    pub until_ms: u64,
    /// Seconds left until then (0 once it ran out).
    pub seconds_left: f64,
    /// `preparing` (it still serves; the replica it holds moves to the next member), `away`
    /// (its replica holder serves its buckets) or `returned` (it takes them back).
    pub phase: String,
    /// Whether the member is back and taking its buckets back.
    pub returned: bool,
    /// Buckets still to go back to it.
    pub buckets_left: usize,
    /// Whether it is over (the answer to ending it, or to a member that came back).
    #[serde(default)]
    pub ended: bool,
}

/// A peer in `GET /v1/cluster`: `ok`, or `pfail` when it has not answered a ping within the
/// node timeout.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct PeerHealth {
    /// The peer.
    pub node_id: NodeId,
    /// What the answering node makes of it.
    pub state: PeerState,
    /// Milliseconds since its last pong (or ping), if it ever answered.
    pub last_contact_ms: Option<u64>,
}

/// A peer's state in one node's view.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum PeerState {
    /// It answered within the node timeout.
    Ok,
    /// It has not (possibly failed: a majority of such reports fails it).
    Pfail,
    /// Away on purpose: not failed for its silence.
    Maintenance,
}

impl std::fmt::Display for PeerState {
    /// As it is on the wire.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            PeerState::Ok => "ok",
            PeerState::Pfail => "pfail",
            PeerState::Maintenance => "maintenance",
        })
    }
}

/// Replication in `GET /v1/cluster`, from the answering node's side.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct ReplicationView {
    /// `sync` or `async`.
    pub mode: String,
    /// The member holding this node's replica.
    pub replica_on: Option<NodeId>,
    /// Owned buckets whose replica holds a snapshot.
    pub attached_buckets: usize,
    /// Owned buckets that have a replica holder.
    pub owned_buckets: usize,
    /// Changes waiting in the async queue.
    pub queue_depth: u64,
    /// Age of the oldest change in the async queue, in seconds.
    pub lag_seconds: f64,
    /// Items in this node's replica store (of the member before it).
    pub replica_items: u64,
    /// Bytes in this node's replica store.
    pub replica_bytes: u64,
}

/// Body of `PUT /v1/cluster/config`: the settings to change (at least one); the answer has
/// every setting as it is now.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ClusterConfig {
    /// `sync` or `async`.
    #[schema(pattern = "^(sync|async)$")]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replication: Option<String>,
    /// Whether the leader balances the map by data by itself when the fullest member holds
    /// more than 1.5 times what the emptiest holds (at most once per
    /// `--auto-balance-interval`, never during a transfer). Off by default.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub auto_balance: Option<bool>,
}

/// `GET /v1/cluster/buckets`: the leader's view of every bucket's figures, as the members
/// last reported them (every `--stats-interval`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct BucketsView {
    /// The leader that answered.
    pub leader: NodeId,
    /// The serving map's version.
    pub map_version: u64,
    /// How often members report, in milliseconds.
    pub stats_interval_ms: u64,
    /// Bytes of the fullest member over the emptiest's (1.0: balanced or no data).
    pub balance_ratio: f64,
    /// Whether the leader balances by itself (`auto_balance`).
    pub auto_balance: bool,
    /// Items and bytes of all reported buckets.
    pub total_items: u64,
    /// Bytes of all reported buckets.
    pub total_bytes: u64,
    /// Per member: what it owns and when it last reported.
    pub nodes: Vec<NodeLoad>,
    /// Members without a report younger than three intervals (a plan waits for them).
    pub missing: Vec<NodeId>,
    /// The buckets, in the order asked for (`sort`), at most `limit` of them.
    pub buckets: Vec<BucketFigures>,
}

/// One member in [`BucketsView`] and [`RebalancePlan`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct NodeLoad {
    /// The member.
    pub node_id: NodeId,
    /// Buckets it owns.
    pub buckets: usize,
    /// Items in them.
    pub items: u64,
    /// Bytes in them.
    pub bytes: u64,
    /// Reads per second of its buckets, over the last interval.
    pub reads_per_sec: f64,
    /// Writes per second.
    pub writes_per_sec: f64,
    /// Milliseconds since its last report; absent if none came.
    pub reported_ms_ago: Option<u64>,
}

/// One bucket's figures, as its owner reported them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct BucketFigures {
    /// The bucket.
    pub bucket: u16,
    /// Its owner.
    pub owner: NodeId,
    /// Items.
    pub items: u64,
    /// Charged bytes (keys, values, tags and per-item overhead).
    pub bytes: u64,
    /// Reads per second, over the owner's last interval.
    pub reads_per_sec: f64,
    /// Writes per second.
    pub writes_per_sec: f64,
}

/// `POST /v1/cluster/rebalance`: the plan, and with `dry_run` nothing else.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct RebalancePlan {
    /// Only planned (`dry_run=true`): nothing changed.
    pub dry_run: bool,
    /// The member brought to the average (`node=`); absent: every member.
    pub node_id: Option<NodeId>,
    /// The serving map the plan was made on.
    pub map_version: u64,
    /// The map the transition goes to (absent for a dry run, or when nothing moves).
    pub to_version: Option<u64>,
    /// Buckets that move, with their bytes.
    pub moves: Vec<PlannedMove>,
    /// Bytes that move.
    pub bytes_moved: u64,
    /// The least bytes any plan reaching the tolerance (5% of the average) must move.
    pub lower_bound_bytes: u64,
    /// Each member before and after.
    pub nodes: Vec<NodeBalance>,
    /// Fullest over emptiest member, in bytes, before.
    pub ratio_before: f64,
    /// And after.
    pub ratio_after: f64,
    /// The transfer rate the estimate uses: the slowest rate members measured in their
    /// last transfer, capped by `--transfer-rate`; absent when none was measured yet.
    pub transfer_rate_bytes_per_sec: Option<f64>,
    /// `bytes_moved` at that rate, in seconds.
    pub estimated_seconds: Option<f64>,
}

/// A bucket a [`RebalancePlan`] moves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct PlannedMove {
    /// The bucket.
    pub bucket: u16,
    /// Its owner now.
    pub from: NodeId,
    /// Its owner after.
    pub to: NodeId,
    /// Its bytes.
    pub bytes: u64,
}

/// A member in a [`RebalancePlan`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct NodeBalance {
    /// The member.
    pub node_id: NodeId,
    /// Bytes it owns now.
    pub bytes_before: u64,
    /// After the plan.
    pub bytes_after: u64,
    /// Buckets it owns now.
    pub buckets_before: usize,
    /// After the plan.
    pub buckets_after: usize,
}

/// How `GET /v1/cluster/buckets` orders buckets.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum BucketSort {
    /// Largest first.
    #[default]
    Bytes,
    /// Most items first.
    Items,
    /// Most reads per second first.
    Reads,
    /// Most writes per second first.
    Writes,
    /// By bucket number.
    Bucket,
}

/// What `GET /v1/cluster/buckets` asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct BucketsQuery {
    /// The order.
    pub sort: BucketSort,
    /// At most this many buckets.
    pub limit: usize,
    /// Only this member's buckets.
    pub node: Option<NodeId>,
}

/// What `POST /v1/cluster/rebalance` asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct RebalanceRequest {
    /// Bring only this member to the average.
    pub node: Option<NodeId>,
    /// Plan only.
    pub dry_run: bool,
}

/// Body of `POST /v1/cluster/lost/clear`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ClearLost {
    /// The buckets to acknowledge; all when absent or empty (an empty request body clears
    /// all too).
    #[serde(default, deserialize_with = "crate::de::whole_u16s")]
    pub buckets: Vec<u16>,
}

/// Answer of `POST /v1/cluster/lost/clear`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct LostCleared {
    /// The buckets that were lost and now serve again, empty (ascending; empty when none
    /// of the named buckets was lost).
    pub cleared: Vec<u16>,
}

/// A transition in `GET /v1/cluster`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct TransitionView {
    /// The serving map's version when it started.
    pub from_version: u64,
    /// The pending map's version.
    pub to_version: u64,
    /// The members that have applied the pending map.
    pub acked: Vec<NodeId>,
}

/// A state transfer in `GET /v1/cluster`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct TransferSummary {
    /// The target map's version.
    pub target_version: u64,
    /// Buckets still to move.
    pub buckets_left: usize,
    /// Whether membership changes wait for it (cleared by the stuck detector).
    pub blocking: bool,
}

/// A node in `GET /v1/cluster/map`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct MapNode {
    /// Its id.
    pub id: NodeId,
    /// Client API address.
    pub api_addr: String,
    /// The member holding its replica.
    pub replica_on: Option<NodeId>,
}

/// `GET /v1/cluster/map`: what a client needs to route keys itself.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct MapView {
    /// The map's version.
    pub version: u64,
    /// `owners[b]` owns bucket `b`; 1000 entries.
    pub owners: Vec<NodeId>,
    /// The members.
    pub nodes: Vec<MapNode>,
}

/// `GET /v1/cluster/events`: a page of the cluster's event log, oldest first.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct EventsView {
    /// The events after `since`, oldest first.
    pub events: Vec<shoal_raft::Event>,
    /// The `since` to ask with next: nothing up to it is left unseen.
    pub next: u64,
    /// The oldest Raft index the log still holds (older events were dropped; absent while
    /// the log is empty).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub oldest: Option<u64>,
}

/// `GET /v1/node`: the answering node's own figures.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct NodeStats {
    /// Its id.
    pub node_id: NodeId,
    /// Items held.
    pub items: u64,
    /// Charged bytes held.
    pub bytes: u64,
    /// The cache size.
    pub limit_bytes: u64,
    /// The map version it has applied.
    pub map_version: u64,
    /// Its release (absent from nodes older than this field).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub version: Option<String>,
    /// The source revision it was built from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub revision: Option<String>,
}

/// The answer to `POST /v1/cluster/nodes/{id}/leave`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct LeaveOk {
    /// The member that left.
    pub node_id: NodeId,
    /// The map version without it.
    pub map_version: u64,
    /// Set when the leave was forced while another change ran: what may be lost.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub warning: Option<String>,
}

/// One readiness check.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Check {
    /// Its name.
    pub name: String,
    /// Whether it passes.
    pub ok: bool,
    /// Why not, when it fails.
    pub detail: String,
}

/// One node's part of a state transfer (`GET /v1/cluster/transfer`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct TransferStatus {
    /// The node.
    pub node_id: NodeId,
    /// Whether it is pulling buckets.
    pub active: bool,
    /// Buckets it has pulled in the current round.
    pub buckets_done: u64,
    /// Buckets in the current round.
    pub buckets_total: u64,
    /// Bytes received in the current round.
    pub bytes: u64,
    /// Bytes per second over the current round.
    pub rate_bytes_per_sec: f64,
    /// Seconds since it last sent or received transfer data.
    pub idle_seconds: f64,
    /// Buckets pulled since the node started.
    pub buckets_pulled_total: u64,
    /// Bytes sent to other nodes since the node started.
    pub bytes_sent_total: u64,
    /// Bytes received from other nodes since the node started.
    #[serde(default)]
    pub bytes_received_total: u64,
}

/// `GET /v1/cluster/transfer`: the transfer as every member reports it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct TransferView {
    /// The target map's version, if a transfer runs.
    pub target_version: Option<u64>,
    /// Buckets still to move.
    pub buckets_left: usize,
    /// Whether membership changes wait for it.
    pub blocking: bool,
    /// Each member's part (members that did not answer are missing).
    pub nodes: Vec<TransferStatus>,
    /// The members that did not answer.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub errors: Vec<NodeFailure>,
}

/// `GET /v1/cluster/agents`: the mirrors this node reads from and what it measured of them,
/// per karma block (like Manticore's SHOW AGENT STATUS).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct AgentsView {
    /// The answering node.
    pub node_id: NodeId,
    /// Where reads go by default (`--read-from`).
    pub read_from: ReadFrom,
    /// How a mirror is chosen (`--ha-strategy`).
    pub strategy: String,
    /// The length of a karma block (`--ha-period-karma`), in milliseconds.
    pub period_karma_ms: u64,
    /// How often idle mirrors are pinged (`--ha-ping-interval`), in milliseconds; 0: never.
    pub ping_interval_ms: u64,
    /// How far behind a replica copy may be by default (`--max-staleness`), in milliseconds.
    pub max_staleness_ms: u64,
    /// One entry per member this node may read from, itself included.
    pub agents: Vec<AgentView>,
}

/// One mirror as the answering node sees it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct AgentView {
    /// The member.
    pub node_id: NodeId,
    /// Whether its last answer (to a read or a ping) came; false once one failed.
    pub alive: bool,
    /// Its weight among the mirrors (the latency-weighted probability of the adaptive
    /// strategies), normalised over every member.
    pub probability: f64,
    /// How long ago it last answered, in milliseconds.
    pub last_answer_ms_ago: Option<u64>,
    /// The kept karma blocks, newest first.
    pub blocks: Vec<KarmaBlockView>,
}

/// What one karma block counted of one mirror.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct KarmaBlockView {
    /// How long ago the block began, in milliseconds.
    pub began_ms_ago: u64,
    /// Reads sent to it.
    pub requests: u64,
    /// Reads it answered (a value or not found).
    pub successes: u64,
    /// Reads and pings that failed, by kind.
    pub errors: AgentErrors,
    /// The average latency of its answers to reads, in milliseconds.
    pub avg_latency_ms: Option<f64>,
    /// Pings answered.
    pub pings: u64,
    /// The average latency of its answers to pings, in milliseconds.
    pub ping_avg_latency_ms: Option<f64>,
}

/// Failed reads and pings by kind.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct AgentErrors {
    /// No connection.
    pub connect: u64,
    /// No answer in time.
    pub timeout: u64,
    /// It answered with a refusal (its copy was not fresh enough, it was stopping, ...).
    pub refused: u64,
    /// It answered something that was not an answer to the request.
    pub wrong_answer: u64,
}
