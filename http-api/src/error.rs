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
    /// A transition or state transfer is running; membership changes wait (or use
    /// `?force=true`).
    #[error("membership change in progress: {0}")]
    MembershipChangeInProgress(String),
    /// The node cannot serve now (no leader, not joined, owner unreachable, ...): retry.
    #[error("{detail}")]
    Unavailable {
        /// Stable code: `no_leader`, `not_ready`, `owner_unreachable`, `unavailable`.
        code: &'static str,
        /// What happened.
        detail: String,
        /// When to retry.
        retry_after: Duration,
    },
    /// `?redirect=true` and another node owns the key: the client should go to `api_addr`
    /// (the handler answers 307 with the request's path on that address).
    #[error("the key is served by {api_addr}")]
    Redirect {
        /// The owner's client API address.
        api_addr: String,
    },
    /// The HTTP method is not served on this path.
    #[error("method not allowed")]
    MethodNotAllowed,
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
    pub fn unavailable(code: &'static str, detail: impl Into<String>) -> Self {
        ApiError::Unavailable { code, detail: detail.into(), retry_after: Duration::from_secs(1) }
    }

    /// The HTTP status.
    pub fn status(&self) -> StatusCode {
        match self {
            ApiError::BadRequest(_) => StatusCode::BAD_REQUEST,
            ApiError::KeyTooLarge { .. } | ApiError::ValueTooLarge { .. } | ApiError::ItemTooLarge(_) => {
                StatusCode::PAYLOAD_TOO_LARGE
            }
            ApiError::NotFound | ApiError::UnknownResource(_) => StatusCode::NOT_FOUND,
            ApiError::PreconditionFailed { .. } => StatusCode::PRECONDITION_FAILED,
            ApiError::NotOwner { .. } => StatusCode::MISDIRECTED_REQUEST,
            ApiError::Conflict(_) | ApiError::MembershipChangeInProgress(_) => StatusCode::CONFLICT,
            ApiError::Unavailable { .. } => StatusCode::SERVICE_UNAVAILABLE,
            ApiError::Redirect { .. } => StatusCode::TEMPORARY_REDIRECT,
            ApiError::MethodNotAllowed => StatusCode::METHOD_NOT_ALLOWED,
            ApiError::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
            ApiError::Remote { problem, .. } => {
                StatusCode::from_u16(problem.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR)
            }
        }
    }

    /// The stable machine code.
    pub fn code(&self) -> &str {
        match self {
            ApiError::BadRequest(_) => "bad_request",
            ApiError::KeyTooLarge { .. } => "key_too_large",
            ApiError::ValueTooLarge { .. } => "value_too_large",
            ApiError::ItemTooLarge(_) => "item_too_large",
            ApiError::NotFound => "not_found",
            ApiError::UnknownResource(_) => "unknown_resource",
            ApiError::PreconditionFailed { .. } => "precondition_failed",
            ApiError::NotOwner { .. } => "not_owner",
            ApiError::Conflict(_) => "conflict",
            ApiError::MembershipChangeInProgress(_) => "membership_change_in_progress",
            ApiError::Unavailable { code, .. } => code,
            ApiError::Redirect { .. } => "redirect",
            ApiError::MethodNotAllowed => "method_not_allowed",
            ApiError::Internal(_) => "internal",
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
            title: status.canonical_reason().unwrap_or("error").to_string(),
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
        }
    }

    /// Rebuilds the error a peer answered with from its problem document (and its
    /// `Retry-After`), so a forwarded request fails exactly as it would have locally: the
    /// codes a node acts on become their own variants, every other error passes on intact
    /// ([`ApiError::Remote`]).
    pub fn from_problem(problem: &Problem, retry_after: Option<Duration>) -> Self {
        let remote = || ApiError::Remote { problem: Box::new(problem.clone()), retry_after };
        match problem.code.as_str() {
            "bad_request" => ApiError::BadRequest(problem.detail.clone()),
            "not_found" => ApiError::NotFound,
            "precondition_failed" => ApiError::PreconditionFailed { current_version: problem.current_version },
            "not_owner" => ApiError::NotOwner { bucket: 0, map_version: problem.map_version.unwrap_or(0) },
            "item_too_large" => ApiError::ItemTooLarge(problem.detail.clone()),
            "conflict" => ApiError::Conflict(problem.detail.clone()),
            "membership_change_in_progress" => ApiError::MembershipChangeInProgress(problem.detail.clone()),
            _ => remote(),
        }
    }
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
        let retry_after = match &self {
            ApiError::Unavailable { retry_after, .. } => Some(*retry_after),
            ApiError::Remote { retry_after, .. } => *retry_after,
            _ => None,
        };
        if let Some(retry_after) = retry_after {
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
            ApiError::BadRequest("bad".into()),
        ] {
            assert_eq!(ApiError::from_problem(&e.problem(), None), e);
        }
    }

    #[test]
    fn other_errors_of_a_peer_pass_on_with_status_code_and_retry_after() {
        for e in [
            ApiError::unavailable("no_leader", "x"),
            ApiError::unavailable("replication_failed", "the replica did not apply the write"),
            ApiError::unavailable("node_draining", "stopping"),
            ApiError::ItemTooLarge("too big".into()),
        ] {
            let retry_after = (e.status() == StatusCode::SERVICE_UNAVAILABLE).then_some(Duration::from_secs(1));
            let passed = ApiError::from_problem(&e.problem(), retry_after);
            assert_eq!((passed.status(), passed.code(), passed.problem()), (e.status(), e.code(), e.problem()));
            let response = passed.into_response();
            let retry = response.headers().get(header::RETRY_AFTER).map(|v| v.to_str().unwrap_or("").to_string());
            assert_eq!(retry.as_deref(), retry_after.map(|_| "1"), "{e:?}");
        }
    }

    #[test]
    fn internal_details_do_not_leak() {
        let p = ApiError::Internal("sled: disk on fire at /secret/path".into()).problem();
        assert!(!p.detail.contains("secret"));
        assert_eq!(p.status, 500);
    }
}
