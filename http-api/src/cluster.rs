//! Cluster and health routes: `/v1/cluster`, `/v1/cluster/health`, `/v1/cluster/map`, `/v1/cluster/buckets`,
//! `/v1/cluster/rebalance`, `/v1/cluster/nodes/{id}/leave`, `/v1/cluster/nodes/{id}/maintenance`,
//! `/v1/node`, `/livez`, `/readyz`, `/metrics`.

use std::sync::Arc;
use std::time::Duration;

use axum::extract::rejection::{PathRejection, QueryRejection};
use axum::extract::{Path, Query, RawQuery, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use shoal_raft::NodeId;

use crate::api::{AdminApi, Probes};
use crate::error::{ApiError, Unavailable};
use crate::kv::{flag, query};
use crate::types::{
    BucketSort, BucketsQuery, ClearLost, ClusterConfig, EventsView, HealthView, MaintenanceRequest, RebalanceRequest,
};

pub(crate) async fn cluster<N: AdminApi>(State(node): State<Arc<N>>) -> Response {
    match node.cluster().await {
        Ok(view) => Json(view).into_response(),
        Err(e) => e.into_response(),
    }
}

/// `GET /v1/cluster/health`: 200 when the cluster is healthy (what `shoal status --wait`
/// waits for), else 503 `unhealthy` naming every reason, for deploy hooks.
pub(crate) async fn health<N: AdminApi>(State(node): State<Arc<N>>) -> Response {
    let view = match node.cluster().await {
        Ok(view) => view,
        Err(e) => return e.into_response(),
    };
    let reasons = view.unhealthy();
    if !reasons.is_empty() {
        let detail = format!("the cluster is not healthy: {}", reasons.join("; "));
        return ApiError::unavailable(Unavailable::Unhealthy, detail).into_response();
    }
    Json(HealthView {
        healthy: true,
        node_id: view.node_id,
        leader: view.leader,
        map_version: view.map_version,
        members: view.members.len(),
    })
    .into_response()
}

/// Query of `GET /v1/cluster/map`.
#[derive(Debug, Default, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct MapParams {
    wait_version: Option<String>,
    timeout: Option<String>,
}

/// Without `timeout`, how long `GET /v1/cluster/map?wait_version=N` waits for a newer map.
pub const MAP_WAIT_DEFAULT: Duration = Duration::from_secs(30);
/// The longest a map watch waits.
pub const MAP_WAIT_MAX: Duration = Duration::from_secs(300);

/// How long a watch waits: `timeout` (a duration up to 5 minutes), else 30 seconds.
fn wait_timeout(text: Option<&str>) -> Result<Duration, ApiError> {
    let Some(text) = text else { return Ok(MAP_WAIT_DEFAULT) };
    let timeout = crate::kv::parse_duration("timeout", text)?;
    if timeout > MAP_WAIT_MAX {
        return Err(ApiError::BadRequest(format!("timeout must be at most 5m, not {text:?}")));
    }
    Ok(timeout)
}

pub(crate) async fn map<N: AdminApi>(
    State(node): State<Arc<N>>,
    q: Result<Query<MapParams>, QueryRejection>,
) -> Response {
    let asked = query(q).and_then(|p| {
        let after = p.wait_version.as_deref().map(|v| crate::kv::number::<u64>("wait_version", v)).transpose()?;
        let timeout = wait_timeout(p.timeout.as_deref())?;
        if after.is_none() && p.timeout.is_some() {
            return Err(ApiError::BadRequest("timeout goes with wait_version".into()));
        }
        Ok((after, timeout))
    });
    let answer = match asked {
        Ok((None, _)) => node.map(),
        Ok((Some(after), timeout)) => node.watch_map(after, timeout).await,
        Err(e) => Err(e),
    };
    match answer {
        Ok(view) => Json(view).into_response(),
        Err(e) => e.into_response(),
    }
}

/// Query of `GET /v1/cluster/events`.
#[derive(Debug, Default, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct EventsParams {
    since: Option<String>,
    limit: Option<String>,
    follow: Option<String>,
}

/// Without `limit`, the most events one answer of `GET /v1/cluster/events` holds.
pub const EVENTS_DEFAULT_LIMIT: usize = 1000;
/// How long a followed stream waits for an event before it sends a keep-alive comment.
const FOLLOW_ROUND: Duration = Duration::from_secs(15);

pub(crate) async fn events<N: AdminApi>(
    State(node): State<Arc<N>>,
    headers: axum::http::HeaderMap,
    q: Result<Query<EventsParams>, QueryRejection>,
) -> Response {
    let asked = query(q).and_then(|p| {
        let mut since = p.since.as_deref().map(|v| crate::kv::number::<u64>("since", v)).transpose()?;
        let limit = match p.limit.as_deref() {
            None => EVENTS_DEFAULT_LIMIT,
            text => crate::kv::list_limit(text)?,
        };
        let follow = flag("follow", p.follow.as_deref())?;
        // A reconnecting event-stream client says where it was (it asks the same URL again,
        // `since` included).
        if let Some(last) = headers.get("last-event-id").filter(|_| follow) {
            let seen = crate::kv::number::<u64>("Last-Event-ID", last.to_str().unwrap_or(""))?;
            since = Some(since.unwrap_or(0).max(seen));
        }
        Ok((since.unwrap_or(0), limit, follow))
    });
    let (since, limit, follow) = match asked {
        Ok(a) => a,
        Err(e) => return e.into_response(),
    };
    if !follow {
        return match node.events(since, limit, Duration::ZERO).await {
            Ok(view) => Json(view).into_response(),
            Err(e) => e.into_response(),
        };
    }
    // The first page answers now, so that a node that cannot serve says so with its status.
    let first = match node.events(since, limit, Duration::ZERO).await {
        Ok(view) => view,
        Err(e) => return e.into_response(),
    };
    let stream = futures_stream(node, first, limit);
    Sse::new(stream).keep_alive(KeepAlive::new().interval(FOLLOW_ROUND)).into_response()
}

/// The events of `first`, then every later one as it is applied, as server-sent events (the
/// id is the event's Raft index, the data its JSON). Ends when the node cannot serve.
fn futures_stream<N: AdminApi>(
    node: Arc<N>,
    first: EventsView,
    limit: usize,
) -> impl futures_util::Stream<Item = Result<SseEvent, std::convert::Infallible>> + Send {
    let state = (node, Some(first), std::collections::VecDeque::<SseEvent>::new(), 0u64);
    futures_util::stream::unfold(state, move |(node, mut page, mut queue, mut next)| async move {
        loop {
            if let Some(event) = queue.pop_front() {
                return Some((Ok(event), (node, page, queue, next)));
            }
            let view = match page.take() {
                Some(view) => view,
                None => node.events(next, limit, FOLLOW_ROUND).await.ok()?,
            };
            next = view.next;
            // The id (what a reconnecting client resumes after) goes on an entry's last event
            // only: a page never splits an entry, so resuming never skips part of one.
            let mut events = view.events.into_iter().peekable();
            while let Some(e) = events.next() {
                let data = serde_json::to_string(&e).unwrap_or_default();
                let mut event = SseEvent::default().event("cluster_event").data(data);
                if events.peek().is_none_or(|n| n.index != e.index) {
                    event = event.id(e.index.to_string());
                }
                queue.push_back(event);
            }
        }
    })
}

pub(crate) async fn transfer<N: AdminApi>(State(node): State<Arc<N>>) -> Response {
    match node.transfer().await {
        Ok(view) => Json(view).into_response(),
        Err(e) => e.into_response(),
    }
}

pub(crate) async fn agents<N: AdminApi>(State(node): State<Arc<N>>) -> Response {
    Json(node.agents()).into_response()
}

/// Query of `GET /v1/cluster/buckets`.
#[derive(Debug, Default, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct BucketsParams {
    sort: Option<String>,
    limit: Option<String>,
    node: Option<String>,
}

/// The most buckets `GET /v1/cluster/buckets` lists without `limit`: all of them.
pub const BUCKETS_DEFAULT_LIMIT: usize = shoal_raft::BUCKET_COUNT;

fn buckets_query(p: BucketsParams) -> Result<BucketsQuery, ApiError> {
    let sort = match p.sort.as_deref() {
        None | Some("bytes") => BucketSort::Bytes,
        Some("items") => BucketSort::Items,
        Some("reads") => BucketSort::Reads,
        Some("writes") => BucketSort::Writes,
        Some("bucket") => BucketSort::Bucket,
        Some(other) => {
            return Err(ApiError::BadRequest(format!(
                "sort must be bytes, items, reads, writes or bucket, not {other:?}"
            )))
        }
    };
    // The same grammar as every `limit` (1 to 100,000); without one, every bucket.
    let limit = match p.limit.as_deref() {
        None => BUCKETS_DEFAULT_LIMIT,
        text => crate::kv::list_limit(text)?,
    };
    let node = p.node.as_deref().map(|n| crate::kv::number("node", n)).transpose()?;
    Ok(BucketsQuery { sort, limit, node })
}

pub(crate) async fn buckets<N: AdminApi>(
    State(node): State<Arc<N>>,
    q: Result<Query<BucketsParams>, QueryRejection>,
) -> Response {
    let asked = match query(q).and_then(buckets_query) {
        Ok(a) => a,
        Err(e) => return e.into_response(),
    };
    match node.buckets(asked).await {
        Ok(view) => Json(view).into_response(),
        Err(e) => e.into_response(),
    }
}

/// Query of `POST /v1/cluster/rebalance`.
#[derive(Debug, Default, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RebalanceParams {
    node: Option<String>,
    dry_run: Option<String>,
}

pub(crate) async fn rebalance<N: AdminApi>(
    State(node): State<Arc<N>>,
    q: Result<Query<RebalanceParams>, QueryRejection>,
) -> Response {
    let asked = query(q).and_then(|p| {
        let dry_run = flag("dry_run", p.dry_run.as_deref())?;
        let node = p.node.as_deref().map(|n| crate::kv::number("node", n)).transpose()?;
        Ok(RebalanceRequest { node, dry_run })
    });
    let asked = match asked {
        Ok(a) => a,
        Err(e) => return e.into_response(),
    };
    match node.rebalance(asked).await {
        Ok(plan) => Json(plan).into_response(),
        Err(e) => e.into_response(),
    }
}

pub(crate) async fn node_stats<N: AdminApi>(State(node): State<Arc<N>>) -> Response {
    Json(node.node_stats()).into_response()
}

/// Query of `POST /v1/cluster/nodes/{id}/leave`.
#[derive(Debug, Default, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct LeaveQuery {
    force: Option<String>,
}

pub(crate) async fn leave<N: AdminApi>(
    State(node): State<Arc<N>>,
    id: Result<Path<String>, PathRejection>,
    q: Result<Query<LeaveQuery>, QueryRejection>,
) -> Response {
    let id = match crate::kv::path(id) {
        Ok(id) => id,
        Err(e) => return e.into_response(),
    };
    let id: NodeId = match crate::kv::number("node id", &id) {
        Ok(id) => id,
        Err(e) => return e.into_response(),
    };
    let force = match query(q).and_then(|q| flag("force", q.force.as_deref())) {
        Ok(f) => f,
        Err(e) => return e.into_response(),
    };
    match node.leave(id, force).await {
        Ok(ok) => Json(ok).into_response(),
        Err(e) => e.into_response(),
    }
}

/// The shortest maintenance a member may ask for.
pub const MAINTENANCE_MIN: Duration = Duration::from_secs(10);
/// The longest.
pub const MAINTENANCE_MAX: Duration = Duration::from_secs(3600);
/// Without `for`.
pub const MAINTENANCE_DEFAULT: Duration = Duration::from_secs(600);

/// The period of a maintenance, from its text (`10m`), checked against the bounds.
pub fn maintenance_period(text: Option<&str>) -> Result<Duration, ApiError> {
    let Some(text) = text else { return Ok(MAINTENANCE_DEFAULT) };
    let period = crate::kv::parse_duration("for", text)?;
    if !(MAINTENANCE_MIN..=MAINTENANCE_MAX).contains(&period) {
        return Err(ApiError::BadRequest(format!("for must be from 10s to 1h, not {text:?}")));
    }
    Ok(period)
}

fn node_id_of(id: Result<Path<String>, PathRejection>) -> Result<NodeId, ApiError> {
    let id = crate::kv::path(id)?;
    crate::kv::number("node id", &id)
}

pub(crate) async fn enter_maintenance<N: AdminApi>(
    State(node): State<Arc<N>>,
    id: Result<Path<String>, PathRejection>,
    body: axum::body::Body,
) -> Response {
    let id = match node_id_of(id) {
        Ok(id) => id,
        Err(e) => return e.into_response(),
    };
    let body = match crate::kv::read_body(body, CLUSTER_BODY_LIMIT).await {
        Ok(b) => b,
        Err(e) => return e.into_response(),
    };
    // No body (or `null`) means the default period, as `{}` does.
    let empty = body.iter().all(u8::is_ascii_whitespace) || body.trim_ascii() == b"null";
    let body: &[u8] = if empty { b"{}" } else { &body };
    let period = match json_body::<MaintenanceRequest>(body).and_then(|r| maintenance_period(r.period.as_deref())) {
        Ok(p) => p,
        Err(e) => return e.into_response(),
    };
    match node.enter_maintenance(id, period).await {
        Ok(ok) => Json(ok).into_response(),
        Err(e) => e.into_response(),
    }
}

pub(crate) async fn end_maintenance<N: AdminApi>(
    State(node): State<Arc<N>>,
    id: Result<Path<String>, PathRejection>,
) -> Response {
    let id = match node_id_of(id) {
        Ok(id) => id,
        Err(e) => return e.into_response(),
    };
    match node.end_maintenance(id).await {
        Ok(ok) => Json(ok).into_response(),
        Err(e) => e.into_response(),
    }
}

/// A JSON object body, whatever its content type says (curl users forget it).
fn json_body<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    crate::kv::json_object(body)
}

/// The largest body of a cluster write.
const CLUSTER_BODY_LIMIT: usize = 64 * 1024;

pub(crate) async fn config<N: AdminApi>(State(node): State<Arc<N>>) -> Response {
    match node.config().await {
        Ok(config) => Json(config).into_response(),
        Err(e) => e.into_response(),
    }
}

pub(crate) async fn set_config<N: AdminApi>(State(node): State<Arc<N>>, body: axum::body::Body) -> Response {
    let body = match crate::kv::read_body(body, CLUSTER_BODY_LIMIT).await {
        Ok(b) => b,
        Err(e) => return e.into_response(),
    };
    let config: ClusterConfig = match json_body(&body) {
        Ok(b) => b,
        Err(e) => return e.into_response(),
    };
    if config == ClusterConfig::default() {
        return ApiError::BadRequest("name a setting to change: replication or auto_balance".into()).into_response();
    }
    match node.set_config(config).await {
        Ok(ok) => Json(ok).into_response(),
        Err(e) => e.into_response(),
    }
}

pub(crate) async fn clear_lost<N: AdminApi>(State(node): State<Arc<N>>, body: axum::body::Body) -> Response {
    let body = match crate::kv::read_body(body, CLUSTER_BODY_LIMIT).await {
        Ok(b) => b,
        Err(e) => return e.into_response(),
    };
    // No body at all (or `null`) means "every lost bucket", as `{}` does.
    let empty = body.iter().all(u8::is_ascii_whitespace) || body.trim_ascii() == b"null";
    let body: &[u8] = if empty { b"{}" } else { &body };
    let clear: ClearLost = match json_body(body) {
        Ok(b) => b,
        Err(e) => return e.into_response(),
    };
    match node.clear_lost(clear).await {
        Ok(ok) => Json(ok).into_response(),
        Err(e) => e.into_response(),
    }
}

/// 200 while the process and its Raft core run; 503 once the Raft core stopped.
pub(crate) async fn livez<N: Probes>(State(node): State<Arc<N>>) -> Response {
    match node.liveness() {
        None => "ok\n".into_response(),
        Some(why) => (StatusCode::SERVICE_UNAVAILABLE, format!("not alive: {why}\n")).into_response(),
    }
}

/// 200 when every readiness check passes, 503 otherwise; `?verbose` lists the checks.
pub(crate) async fn readyz<N: Probes>(State(node): State<Arc<N>>, RawQuery(q): RawQuery) -> Response {
    // `?verbose` (Kubernetes' spelling), `?verbose=`, `=true` or `=1` list the checks.
    let mut verbose = false;
    for p in q.as_deref().unwrap_or("").split('&').filter(|p| *p == "verbose" || p.starts_with("verbose=")) {
        verbose = match p.strip_prefix("verbose").unwrap_or("").trim_start_matches('=') {
            "" | "true" | "1" => true,
            "false" | "0" => false,
            other => {
                return ApiError::BadRequest(format!("verbose must be true or false, not {other:?}")).into_response();
            }
        };
    }
    let checks = node.readiness();
    let ready = checks.iter().all(|c| c.ok);
    let mut body = String::new();
    if verbose {
        for c in &checks {
            if c.ok {
                body.push_str(&format!("[+] {} ok\n", c.name));
            } else {
                body.push_str(&format!("[-] {} failed: {}\n", c.name, c.detail));
            }
        }
    }
    body.push_str(if ready { "ready\n" } else { "not ready\n" });
    let status = if ready { StatusCode::OK } else { StatusCode::SERVICE_UNAVAILABLE };
    let mut response = (status, body).into_response();
    if !ready {
        response.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
    }
    response
}

pub(crate) async fn metrics<N: Probes>(State(node): State<Arc<N>>) -> Response {
    let mut response = node.metrics().into_response();
    response
        .headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"));
    response
}
