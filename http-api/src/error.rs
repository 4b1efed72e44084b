//! [`ApiError`]: every failure a client can see, and its one mapping to HTTP
//! (RFC 9457 `application/problem+json` with a stable machine `code`).

use std::time::Duration;

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize};

/// The problem document of an error response.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Problem {
    /// `urn:shoal:problem:<code>`.
    #[serde(rename = "type")]
    pub type_uri: String,
    /// A short summary of the kind of problem.
    pub title: String,
    /// The HTTP status.
    pub status: u16,
    /// What happened in this case, for a human.
    pub detail: String,
    /// The stable, machine-readable code (see the http-api README).
    pub code: String,
    /// The item's current version, for `precondition_failed`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub current_version: Option<u64>,
    /// The map version of the node that answered, for `not_owner`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub map_version: Option<u64>,
    /// The bucket the node does not own, for `not_owner`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bucket: Option<u16>,
}

/// The stable codes of the errors that are not a 503 ([`Unavailable::code`] has those), as the
/// server answers them and as clients match them: one list, so the two cannot drift apart.
pub mod code {
    /// Malformed request.
    pub const BAD_REQUEST: &str = "bad_request";
    /// The key is over `--max-key-bytes`.
    pub const KEY_TOO_LARGE: &str = "key_too_large";
    /// The value is over `--max-value-bytes`.
    pub const VALUE_TOO_LARGE: &str = "value_too_large";
    /// The item alone would not fit in the node's cache.
    pub const ITEM_TOO_LARGE: &str = "item_too_large";
    /// The cache is too full of `not_removable` items.
    pub const INSUFFICIENT_STORAGE: &str = "insufficient_storage";
    /// A bulk read's answer would be too large.
    pub const ANSWER_TOO_LARGE: &str = "answer_too_large";
    /// No such key (or it expired): a miss, not a failure.
    pub const NOT_FOUND: &str = "not_found";
    /// No such route or member.
    pub const UNKNOWN_RESOURCE: &str = "unknown_resource";
    /// A condition (`cas`, `mode`, `If-Match`) did not hold.
    pub const PRECONDITION_FAILED: &str = "precondition_failed";
    /// A forwarded request reached a node that does not own the bucket.
    pub const NOT_OWNER: &str = "not_owner";
    /// The request conflicts with the cluster's state.
    pub const CONFLICT: &str = "conflict";
    /// A transition or state transfer runs; membership changes wait.
    pub const MEMBERSHIP_CHANGE_IN_PROGRESS: &str = "membership_change_in_progress";
    /// `?redirect=true`: the key is served elsewhere.
    pub const REDIRECT: &str = "redirect";
    /// The method is not served on this path.
    pub const METHOD_NOT_ALLOWED: &str = "method_not_allowed";
    /// A bug or a storage failure.
    pub const INTERNAL: &str = "internal";
}

/// Why a node cannot serve a request now: the stable `code` of a 503 answer, which always
/// carries `Retry-After`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Unavailable {
    /// No Raft leader is known (an election runs).
    NoLeader,
    /// This node has not joined a cluster yet.
    NotReady,
    /// This node is starting with its data dir (a member coming back).
    Starting,
    /// This node is starting with an empty data dir: it is not a member yet.
    NotMember,
    /// The key's owner does not answer (pings or this request) and is not failed yet.
    OwnerUnreachable,
    /// The cluster's control plane did not answer in time.
    Unavailable,
    /// The bucket's owner and its replica were lost together.
    BucketLost,
    /// A restarted node or a failover heir is getting the bucket back.
    BucketRestoring,
    /// The bucket is frozen while it moves to another node.
    BucketMoving,
    /// The bucket changed owner more often than a request routes again, or the request named
    /// a map version this node has not applied.
    MapChanging,
    /// The cluster failed this node; it rejoins.
    NodeFailed,
    /// This node is handing its buckets over (it leaves).
    NodeLeaving,
    /// This node is stopping.
    NodeDraining,
    /// This node cannot hear a majority of the members.
    NoQuorum,
    /// Sync replication: the replica did not apply the write; it was taken back, and stored
    /// nowhere.
    ReplicationFailed,
    /// Sync replication: the replica did not answer and could not be told to take the write
    /// back, so it may have stored it (it serves it if it takes the bucket over): read the key
    /// back, or write it again.
    OutcomeUnknown,
    /// A forwarded request arrived after its deadline; nothing was done.
    Expired,
    /// Request bodies in flight already take all the memory the node allows them.
    Overloaded,
    /// A mirror read reached a replica copy that is not fresh enough (not attached, moving,
    /// or further behind than the read allows); the sender reads at the owner instead.
    ReplicaNotFresh,
    /// The leader has no recent bucket statistics from every member yet (a new leader, or a
    /// member that has not reported); they arrive every `--stats-interval`.
    StatsPending,
    /// `GET /v1/cluster/health`: the cluster is not healthy (the detail says why).
    Unhealthy,
}

impl Unavailable {
    /// Every code, for documentation and tests.
    pub const ALL: [Unavailable; 21] = [
        Unavailable::NoLeader,
        Unavailable::NotReady,
        Unavailable::Starting,
        Unavailable::NotMember,
        Unavailable::OwnerUnreachable,
        Unavailable::Unavailable,
        Unavailable::BucketLost,
        Unavailable::BucketRestoring,
        Unavailable::BucketMoving,
        Unavailable::MapChanging,
        Unavailable::NodeFailed,
        Unavailable::NodeLeaving,
        Unavailable::NodeDraining,
        Unavailable::NoQuorum,
        Unavailable::ReplicationFailed,
        Unavailable::OutcomeUnknown,
        Unavailable::Expired,
        Unavailable::Overloaded,
        Unavailable::ReplicaNotFresh,
        Unavailable::StatsPending,
        Unavailable::Unhealthy,
    ];

    /// The reason whose code is `code`, if it is one.
    pub fn from_code(code: &str) -> Option<Self> {
        Unavailable::ALL.into_iter().find(|u| u.code() == code)
    }

    /// The stable machine code.
    pub fn code(self) -> &'static str {
        match self {
            Unavailable::NoLeader => "no_leader",
            Unavailable::NotReady => "not_ready",
            Unavailable::Starting => "starting",
            Unavailable::NotMember => "not_member",
            Unavailable::OwnerUnreachable => "owner_unreachable",
            Unavailable::Unavailable => "unavailable",
            Unavailable::BucketLost => "bucket_lost",
            Unavailable::BucketRestoring => "bucket_restoring",
            Unavailable::BucketMoving => "bucket_moving",
            Unavailable::MapChanging => "map_changing",
            Unavailable::NodeFailed => "node_failed",
            Unavailable::NodeLeaving => "node_leaving",
            Unavailable::NodeDraining => "node_draining",
            Unavailable::NoQuorum => "no_quorum",
            Unavailable::ReplicationFailed => "replication_failed",
            Unavailable::OutcomeUnknown => "outcome_unknown",
            Unavailable::Expired => "expired",
            Unavailable::Overloaded => "overloaded",
            Unavailable::ReplicaNotFresh => "replica_not_fresh",
            Unavailable::StatsPending => "stats_pending",
            Unavailable::Unhealthy => "unhealthy",
        }
    }
}

/// An error answered to a client.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ApiError {
    /// Malformed request (bad query parameter, bad JSON, empty key, ...).
    #[error("{0}")]
    BadRequest(String),
    /// The key is longer than `--max-key-bytes`.
    #[error("key of {len} bytes exceeds the limit of {limit} bytes")]
    KeyTooLarge {
        /// The key's length.
        len: usize,
        /// The limit.
        limit: usize,
    },
    /// The value (or request body) is longer than allowed.
    #[error("value exceeds the limit of {limit} bytes")]
    ValueTooLarge {
        /// The limit.
        limit: usize,
    },
    /// The item alone would not fit in the node's cache.
    #[error("{0}")]
    ItemTooLarge(String),
    /// The cache is too full of `not_removable` items for this write to fit (nothing evictable
    /// is left to make room).
    #[error("{0}")]
    InsufficientStorage(String),
    /// A bulk read's values would make an answer larger than one may be.
    #[error("the values asked for take {bytes} bytes, over the {limit} one answer may carry; ask for fewer keys")]
    AnswerTooLarge {
        /// The values' size.
        bytes: usize,
        /// The most one answer carries.
        limit: usize,
    },
    /// No such key (or it expired).
    #[error("key not found")]
    NotFound,
    /// No such resource (route, node).
    #[error("{0}")]
    UnknownResource(String),
    /// A `cas`, `mode=add` or `mode=replace` condition did not hold.
    #[error("precondition failed")]
    PreconditionFailed {
        /// The version found (None: the key is absent).
        current_version: Option<u64>,
    },
    /// A forwarded request reached a node that does not own the bucket in its map.
    #[error("node does not own bucket {bucket} in map version {map_version}")]
    NotOwner {
        /// The bucket.
        bucket: u16,
        /// The map version of the refusing node.
        map_version: u64,
    },
    /// The request conflicts with the cluster's state (for example: the last member leaves).
    #[error("{0}")]
    Conflict(String),
    /// A member may not enter maintenance now (see the code: `maintenance_in_progress`,
    /// `too_few_members`, `replica_not_attached`, `peer_unreachable`, ...).
    #[error("{0}")]
    MaintenanceRefused(shoal_raft::state::MaintenanceRefusal),
    /// A transition or state transfer is running; membership changes wait (or use
    /// `?force=true`).
    #[error("membership change in progress: {0}")]
    MembershipChangeInProgress(String),
    /// The node cannot serve now (no leader, not joined, owner unreachable, ...): retry.
    #[error("{detail}")]
    Unavailable {
        /// Why.
        code: Unavailable,
        /// What happened.
        detail: String,
        /// When to retry.
        retry_after: Duration,
    },
    /// `?redirect=true` and another node owns the key: the client should go to `api_addr`
    /// (the handler answers 307 with the request's path on that address).
    #[error("the key is served by {api_addr}")]
    Redirect {
        /// The owner's client API address (`host:port`, plain HTTP), or its base URL
        /// (`https://host:port`).
        api_addr: String,
    },
    /// The HTTP method is not served on this path.
    #[error("method not allowed")]
    MethodNotAllowed,
    /// A credential the endpoint needs is missing or wrong.
    #[error("{detail}")]
    Unauthorized {
        /// `admin_token_required`, `client_token_required` or `cluster_secret_required`.
        code: &'static str,
        /// Which credential, and how to give it.
        detail: String,
    },
    /// A bug or a storage failure; details are logged, not returned.
    #[error("internal error")]
    Internal(String),
    /// An error another node answered to a forwarded request, passed on as it came: its
    /// status, code, detail and `Retry-After` (codes this node acts on are rebuilt as their
    /// own variants instead, see [`ApiError::from_problem`]).
    #[error("{}", .problem.detail)]
    Remote {
        /// The problem document the other node answered.
        problem: Box<Problem>,
        /// Its `Retry-After`, if it had one.
        retry_after: Option<Duration>,
    },
}

impl ApiError {
    /// A 503 with `code` and a one-second `Retry-After`.
    pub fn unavailable(code: Unavailable, detail: impl Into<String>) -> Self {
        ApiError::Unavailable { code, detail: detail.into(), retry_after: Duration::from_secs(1) }
    }

    /// Why the node is unavailable, for a 503.
    pub fn unavailable_code(&self) -> Option<Unavailable> {
        match self {
            ApiError::Unavailable { code, .. } => Some(*code),
            _ => None,
        }
    }

    /// When the client should retry: every 503 says it (the owner's own value when the
    /// error was forwarded).
    pub fn retry_after(&self) -> Option<Duration> {
        match self {
            ApiError::Unavailable { retry_after, .. } => Some(*retry_after),
            ApiError::Remote { retry_after, .. } => *retry_after,
            _ => None,
        }
    }

    /// The HTTP status.
    pub fn status(&self) -> StatusCode {
        match self {
            ApiError::BadRequest(_) => StatusCode::BAD_REQUEST,
            ApiError::KeyTooLarge { .. }
            | ApiError::ValueTooLarge { .. }
            | ApiError::ItemTooLarge(_)
            | ApiError::AnswerTooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            ApiError::InsufficientStorage(_) => StatusCode::INSUFFICIENT_STORAGE,
            ApiError::NotFound | ApiError::UnknownResource(_) => StatusCode::NOT_FOUND,
            ApiError::PreconditionFailed { .. } => StatusCode::PRECONDITION_FAILED,
            ApiError::NotOwner { .. } => StatusCode::MISDIRECTED_REQUEST,
            ApiError::Conflict(_) | ApiError::MembershipChangeInProgress(_) | ApiError::MaintenanceRefused(_) => {
                StatusCode::CONFLICT
            }
            ApiError::Unavailable { .. } => StatusCode::SERVICE_UNAVAILABLE,
            ApiError::Redirect { .. } => StatusCode::TEMPORARY_REDIRECT,
            ApiError::MethodNotAllowed => StatusCode::METHOD_NOT_ALLOWED,
            ApiError::Unauthorized { .. } => StatusCode::UNAUTHORIZED,
            ApiError::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
            ApiError::Remote { problem, .. } => {
                StatusCode::from_u16(problem.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR)
            }
        }
    }

    /// The stable machine code.
    pub fn code(&self) -> &str {
        match self {
            ApiError::BadRequest(_) => code::BAD_REQUEST,
            ApiError::KeyTooLarge { .. } => code::KEY_TOO_LARGE,
            ApiError::ValueTooLarge { .. } => code::VALUE_TOO_LARGE,
            ApiError::ItemTooLarge(_) => code::ITEM_TOO_LARGE,
            ApiError::InsufficientStorage(_) => code::INSUFFICIENT_STORAGE,
            ApiError::AnswerTooLarge { .. } => code::ANSWER_TOO_LARGE,
            ApiError::NotFound => code::NOT_FOUND,
            ApiError::UnknownResource(_) => code::UNKNOWN_RESOURCE,
            ApiError::PreconditionFailed { .. } => code::PRECONDITION_FAILED,
            ApiError::NotOwner { .. } => code::NOT_OWNER,
            ApiError::Conflict(_) => code::CONFLICT,
            ApiError::MembershipChangeInProgress(_) => code::MEMBERSHIP_CHANGE_IN_PROGRESS,
            ApiError::MaintenanceRefused(r) => r.code(),
            ApiError::Unavailable { code, .. } => code.code(),
            ApiError::Redirect { .. } => code::REDIRECT,
            ApiError::MethodNotAllowed => code::METHOD_NOT_ALLOWED,
            ApiError::Unauthorized { code, .. } => code,
            ApiError::Internal(_) => code::INTERNAL,
            ApiError::Remote { problem, .. } => &problem.code,
        }
    }

    /// The problem document.
    pub fn problem(&self) -> Problem {
        if let ApiError::Remote { problem, .. } = self {
            return Problem::clone(problem);
        }
        let status = self.status();
        let detail = match self {
            ApiError::Internal(_) => "internal error; see the node's log".to_string(),
            other => other.to_string(),
        };
        Problem {
            type_uri: format!("urn:shoal:problem:{}", self.code()),
            title: title_of(status.as_u16()),
            status: status.as_u16(),
            detail,
            code: self.code().to_string(),
            current_version: match self {
                ApiError::PreconditionFailed { current_version } => *current_version,
                _ => None,
            },
            map_version: match self {
                ApiError::NotOwner { map_version, .. } => Some(*map_version),
                _ => None,
            },
            bucket: match self {
                ApiError::NotOwner { bucket, .. } => Some(*bucket),
                _ => None,
            },
        }
    }

    /// Rebuilds the error a peer answered with from its problem document (and its
    /// `Retry-After`), so a forwarded request fails exactly as it would have locally: the
    /// codes a node acts on (`not_found`, `precondition_failed`, `not_owner`, and every 503's)
    /// become their own variants, every other error passes on intact
    /// ([`ApiError::Remote`]).
    pub fn from_problem(problem: &Problem, retry_after: Option<Duration>) -> Self {
        let remote = || ApiError::Remote { problem: Box::new(problem.clone()), retry_after };
        match problem.code.as_str() {
            code::NOT_FOUND => ApiError::NotFound,
            code::PRECONDITION_FAILED => ApiError::PreconditionFailed { current_version: problem.current_version },
            code::NOT_OWNER => ApiError::NotOwner {
                bucket: problem.bucket.unwrap_or(0),
                map_version: problem.map_version.unwrap_or(0),
            },
            other => match Unavailable::from_code(other) {
                Some(code) if problem.status == 503 => ApiError::Unavailable {
                    code,
                    detail: problem.detail.clone(),
                    retry_after: retry_after.unwrap_or(Duration::from_secs(1)),
                },
                _ => remote(),
            },
        }
    }
}

/// Between nodes an error travels as what HTTP would carry, its problem document (JSON, whose
/// absent fields are left out) and its `Retry-After` in whole seconds, and is rebuilt by
/// [`ApiError::from_problem`], so a forwarded error keeps its status and code.
impl Serialize for ApiError {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let problem = bytes::Bytes::from(serde_json::to_vec(&self.problem()).map_err(serde::ser::Error::custom)?);
        (problem, self.retry_after().map(|d| d.as_secs().max(1))).serialize(s)
    }
}

impl<'de> Deserialize<'de> for ApiError {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let (problem, retry_after) = <(bytes::Bytes, Option<u64>)>::deserialize(d)?;
        let problem: Problem = serde_json::from_slice(&problem).map_err(serde::de::Error::custom)?;
        Ok(ApiError::from_problem(&problem, retry_after.map(Duration::from_secs)))
    }
}

/// The problem title of an HTTP status: its reason phrase.
pub(crate) fn title_of(status: u16) -> String {
    StatusCode::from_u16(status).ok().and_then(|s| s.canonical_reason()).unwrap_or("error").to_string()
}

/// The media type of error bodies.
pub const PROBLEM_JSON: &str = "application/problem+json";

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        if let ApiError::Internal(detail) = &self {
            tracing::error!(%detail, "internal error");
        }
        let status = self.status();
        let body = serde_json::to_vec(&self.problem()).unwrap_or_default();
        let mut response = (status, body).into_response();
        let headers = response.headers_mut();
        headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(PROBLEM_JSON));
        if let Some(retry_after) = self.retry_after() {
            headers.insert(header::RETRY_AFTER, HeaderValue::from(retry_after.as_secs().max(1)));
        }
        response
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn problems_round_trip_through_their_code() {
        for e in [
            ApiError::NotFound,
            ApiError::PreconditionFailed { current_version: Some(4) },
            ApiError::NotOwner { bucket: 0, map_version: 9 },
            ApiError::unavailable(Unavailable::NodeLeaving, "leaving"),
        ] {
            assert_eq!(ApiError::from_problem(&e.problem(), e.retry_after()), e);
        }
    }

    /// Every error a node answers, once per code.
    fn every_error() -> Vec<ApiError> {
        let mut all: Vec<ApiError> =
            Unavailable::ALL.iter().map(|&code| ApiError::unavailable(code, format!("{code:?} happened"))).collect();
        all.extend([
            ApiError::BadRequest("bad".into()),
            ApiError::KeyTooLarge { len: 5000, limit: 4096 },
            ApiError::ValueTooLarge { limit: 10 },
            ApiError::ItemTooLarge("too big".into()),
            ApiError::InsufficientStorage("full of not_removable items".into()),
            ApiError::AnswerTooLarge { bytes: 100, limit: 10 },
            ApiError::NotFound,
            ApiError::UnknownResource("no such node".into()),
            ApiError::PreconditionFailed { current_version: Some(4) },
            ApiError::PreconditionFailed { current_version: None },
            ApiError::NotOwner { bucket: 3, map_version: 9 },
            ApiError::Conflict("last member".into()),
            ApiError::MembershipChangeInProgress("transfer".into()),
            ApiError::MethodNotAllowed,
        ]);
        use shoal_raft::state::MaintenanceRefusal as R;
        all.extend(
            [
                R::InProgress(2),
                R::TooFewMembers(2),
                R::ReplicaNotAttached { node: 2, attached: 1, owned: 2 },
                R::PeerDown(3),
                R::PeerStopping(3),
                R::HolderChanged(2),
                R::StillHolding { holder: 2, owner: 1 },
            ]
            .map(ApiError::MaintenanceRefused),
        );
        all.extend([
            ApiError::Unauthorized { code: "admin_token_required", detail: "token".into() },
            ApiError::Unauthorized { code: "client_token_required", detail: "token".into() },
            ApiError::Internal("bug".into()),
        ]);
        all
    }

    fn wire(e: ApiError) -> (StatusCode, Option<String>, Vec<u8>) {
        let response = e.into_response();
        let retry = response.headers().get(header::RETRY_AFTER).map(|v| v.to_str().unwrap_or("").to_string());
        let (parts, body) = response.into_parts();
        let body = futures_executor(axum::body::to_bytes(body, usize::MAX)).expect("body");
        (parts.status, retry, body.to_vec())
    }

    fn futures_executor<F: std::future::Future>(f: F) -> F::Output {
        tokio::runtime::Builder::new_current_thread().build().expect("runtime").block_on(f)
    }

    #[test]
    fn every_error_of_a_peer_passes_on_unchanged_alone_and_in_a_bulk_answer() {
        for e in every_error() {
            let original = wire(e.clone());
            // Alone: the forwarder rebuilds it from the problem document and its Retry-After.
            let problem: Problem = serde_json::from_slice(&original.2).expect("a problem document");
            let retry_after = original.1.as_deref().map(|s| Duration::from_secs(s.parse().expect("seconds")));
            let forwarded = wire(ApiError::from_problem(&problem, retry_after));
            assert_eq!(forwarded, original, "{e:?}");
            // In a bulk answer: the key's error says the same (a key's `not_owner` names its
            // bucket in the key's result, and the forwarder routes again on it).
            if matches!(e, ApiError::NotOwner { .. }) {
                continue;
            }
            let item = crate::types::KeyError::of(&e);
            let through = crate::types::KeyError::of(&item.error());
            assert_eq!(through, item, "{e:?}");
            assert_eq!(wire(item.error()), original, "{e:?}");
            assert_eq!(original.1.is_some(), original.0 == StatusCode::SERVICE_UNAVAILABLE, "{e:?}");
        }
    }

    #[test]
    fn the_readme_lists_every_code() {
        let readme = include_str!("../README.md");
        let table = &readme[readme.find("## Error codes").expect("an error table")..];
        for e in every_error() {
            assert!(table.contains(&format!("`{}`", e.code())), "http-api/README.md's table lacks {}", e.code());
        }
    }

    #[test]
    fn internal_details_do_not_leak() {
        let p = ApiError::Internal("sled: disk on fire at /secret/path".into()).problem();
        assert!(!p.detail.contains("secret"));
        assert_eq!(p.status, 500);
    }
}
