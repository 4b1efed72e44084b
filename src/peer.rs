//! [`PeerClient`]: the node-to-node HTTP client for data operations.
//!
//! One pooled keep-alive HTTP/1.1 client per node (hyper-util's, separate from Raft's), with
//! TCP_NODELAY and bounded timeouts. A forwarded key request goes to the owner's public API with the
//! [`HEADER_FORWARDED_MAP_VERSION`] header; a broadcast goes with `x-shoal-scope: local`.
//! Answers are decoded back into the same types and errors the local path produces, so a
//! client cannot tell a forwarded answer from a local one.

use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::header::{HeaderMap, HeaderName, HeaderValue, CONTENT_TYPE};
use hyper::{Method, Request, StatusCode, Uri};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioTimer};
use percent_encoding::{utf8_percent_encode, AsciiSet, NON_ALPHANUMERIC};
use serde::de::DeserializeOwned;
use serde::Serialize;
use shoal_http_api::types::{
    BulkKeys, BulkPut, BulkPutItem, BulkResults, GetOk, KeyList, NodeStats, PutOk, Removed, TransferStatus,
    WriteCondition,
};
use shoal_http_api::{
    ApiError, Problem, PutItem, HEADER_BUCKET, HEADER_FORWARDED_MAP_VERSION, HEADER_FORWARD_DEADLINE, HEADER_NODE,
    HEADER_SCOPE,
};

/// The HTTP client a node uses to reach other nodes' APIs.
///
/// hyper-util's pooled client rather than reqwest: forwarding is on the request path, and
/// reqwest's conveniences (URL objects, redirects, middleware) cost CPU on every call.
#[derive(Clone)]
pub struct PeerClient {
    http: Client<HttpConnector, Full<Bytes>>,
}

/// How long a forwarded request may take before the caller gets `owner_unreachable`; the
/// owner refuses it once this has passed (`HEADER_FORWARD_DEADLINE`).
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
/// How long the figures of one member may take in `GET /v1/cluster`.
const STATS_TIMEOUT: Duration = Duration::from_secs(2);

/// Characters escaped in a key's path segment: all but unreserved ones.
const SEGMENT: &AsciiSet = &NON_ALPHANUMERIC.remove(b'-').remove(b'.').remove(b'_').remove(b'~');

/// An answer: status, headers, whole body.
struct Answer {
    status: StatusCode,
    headers: HeaderMap,
    body: Bytes,
}

impl PeerClient {
    /// A client with connection pooling and TCP_NODELAY.
    pub fn new() -> Self {
        let mut connector = HttpConnector::new();
        connector.set_local_address(shoal_raft::outgoing_ip());
        connector.set_nodelay(true);
        connector.set_connect_timeout(Some(Duration::from_secs(2)));
        let http = Client::builder(TokioExecutor::new())
            .pool_timer(TokioTimer::new())
            .pool_max_idle_per_host(64)
            .pool_idle_timeout(Duration::from_secs(60))
            .build(connector);
        PeerClient { http }
    }

    /// `/v1/kv/<key, percent-encoded>`.
    fn key_path(key: &str) -> String {
        format!("/v1/kv/{}", utf8_percent_encode(key, SEGMENT))
    }

    /// Sends a request and reads the whole answer. Transport failures are `owner_unreachable`.
    async fn call(
        &self,
        method: Method,
        api_addr: &str,
        path_and_query: &str,
        headers: &[(HeaderName, String)],
        body: Bytes,
        timeout: Duration,
    ) -> Result<Answer, ApiError> {
        let uri: Uri = format!("http://{api_addr}{path_and_query}")
            .parse()
            .map_err(|e| ApiError::Internal(format!("bad peer address {api_addr:?}: {e}")))?;
        let mut request = Request::builder().method(method).uri(uri);
        for (name, value) in headers {
            request = request.header(name, value);
        }
        let request = request.body(Full::new(body)).map_err(|e| ApiError::Internal(e.to_string()))?;
        let exchange = async {
            let response = self.http.request(request).await.map_err(|e| unreachable(api_addr, &e))?;
            let (parts, body) = response.into_parts();
            let body = body.collect().await.map_err(|e| unreachable(api_addr, &e))?.to_bytes();
            Ok(Answer { status: parts.status, headers: parts.headers, body })
        };
        tokio::time::timeout(timeout, exchange).await.map_err(|_| {
            ApiError::unavailable("owner_unreachable", format!("node at {api_addr} did not answer in time"))
        })?
    }

    /// Like [`Self::call`], but a non-2xx answer becomes the error it describes.
    async fn call_ok(
        &self,
        method: Method,
        api_addr: &str,
        path_and_query: &str,
        headers: &[(HeaderName, String)],
        body: Bytes,
        timeout: Duration,
    ) -> Result<Answer, ApiError> {
        let answer = self.call(method, api_addr, path_and_query, headers, body, timeout).await?;
        if answer.status.is_success() {
            Ok(answer)
        } else {
            Err(error_of(&answer, api_addr))
        }
    }

    async fn call_json<T: DeserializeOwned>(
        &self,
        method: Method,
        api_addr: &str,
        path_and_query: &str,
        headers: &[(HeaderName, String)],
        body: Bytes,
    ) -> Result<T, ApiError> {
        let answer = self.call_ok(method, api_addr, path_and_query, headers, body, REQUEST_TIMEOUT).await?;
        serde_json::from_slice(&answer.body)
            .map_err(|e| ApiError::Internal(format!("node at {api_addr} answered unreadable JSON: {e}")))
    }

    fn forwarded(map_version: u64) -> [(HeaderName, String); 2] {
        let deadline = shoal_http_api::unix_ms() + REQUEST_TIMEOUT.as_millis() as u64;
        [(HEADER_FORWARDED_MAP_VERSION, map_version.to_string()), (HEADER_FORWARD_DEADLINE, deadline.to_string())]
    }

    /// Forwards a GET to the owner.
    pub async fn get(&self, api_addr: &str, key: &str, map_version: u64) -> Result<GetOk, ApiError> {
        let path = Self::key_path(key);
        let answer = self
            .call_ok(Method::GET, api_addr, &path, &Self::forwarded(map_version), Bytes::new(), REQUEST_TIMEOUT)
            .await?;
        let header = |name: HeaderName| answer.headers.get(name).and_then(|v| v.to_str().ok());
        let version = header(hyper::header::ETAG).and_then(|e| e.trim_matches('"').parse().ok()).unwrap_or(0);
        let bucket = header(HEADER_BUCKET).and_then(|b| b.parse().ok()).unwrap_or(0);
        let node = header(HEADER_NODE).and_then(|n| n.parse().ok()).unwrap_or(0);
        Ok(GetOk { value: answer.body, version, bucket, node })
    }

    /// Forwards a PUT to the owner.
    pub async fn put(&self, api_addr: &str, item: &PutItem, map_version: u64) -> Result<PutOk, ApiError> {
        let mut path = Self::key_path(&item.key);
        let query = put_query(item);
        if !query.is_empty() {
            path.push('?');
            path.push_str(&serde_urlencoded::to_string(&query).map_err(|e| ApiError::Internal(e.to_string()))?);
        }
        self.call_json(Method::PUT, api_addr, &path, &Self::forwarded(map_version), item.value.clone()).await
    }

    /// Forwards a DELETE to the owner.
    pub async fn delete(&self, api_addr: &str, key: &str, cas: Option<u64>, map_version: u64) -> Result<(), ApiError> {
        let mut path = Self::key_path(key);
        if let Some(cas) = cas {
            path.push_str(&format!("?cas={cas}"));
        }
        self.call_ok(Method::DELETE, api_addr, &path, &Self::forwarded(map_version), Bytes::new(), REQUEST_TIMEOUT)
            .await
            .map(|_| ())
    }

    async fn post_json<T: Serialize, R: DeserializeOwned>(
        &self,
        api_addr: &str,
        path: &str,
        headers: &[(HeaderName, String)],
        body: &T,
    ) -> Result<R, ApiError> {
        let body = serde_json::to_vec(body).map_err(|e| ApiError::Internal(e.to_string()))?;
        self.call_json(Method::POST, api_addr, path, headers, Bytes::from(body)).await
    }

    /// Forwards a bulk GET of keys the owner holds.
    pub async fn bulk_get(&self, api_addr: &str, keys: Vec<String>, map_version: u64) -> Result<BulkResults, ApiError> {
        self.post_json(api_addr, "/v1/bulk/get", &Self::forwarded(map_version), &BulkKeys { keys }).await
    }

    /// Forwards a bulk PUT of items the owner holds.
    pub async fn bulk_put(&self, api_addr: &str, items: &[PutItem], map_version: u64) -> Result<BulkResults, ApiError> {
        let body = BulkPut { items: items.iter().map(bulk_item).collect() };
        self.post_json(api_addr, "/v1/bulk/put", &Self::forwarded(map_version), &body).await
    }

    /// Forwards a bulk DELETE of keys the owner holds.
    pub async fn bulk_delete(
        &self,
        api_addr: &str,
        keys: Vec<String>,
        map_version: u64,
    ) -> Result<BulkResults, ApiError> {
        self.post_json(api_addr, "/v1/bulk/delete", &Self::forwarded(map_version), &BulkKeys { keys }).await
    }

    fn local_scope() -> [(HeaderName, String); 1] {
        [(HEADER_SCOPE, "local".to_string())]
    }

    /// Asks one member for its local keys with `prefix`.
    pub async fn keys(&self, api_addr: &str, prefix: &str, limit: usize) -> Result<KeyList, ApiError> {
        let query = serde_urlencoded::to_string([("prefix", prefix), ("limit", &limit.to_string())])
            .map_err(|e| ApiError::Internal(e.to_string()))?;
        self.call_json(Method::GET, api_addr, &format!("/v1/kv?{query}"), &Self::local_scope(), Bytes::new()).await
    }

    /// Asks one member for its local keys tagged `tag`.
    pub async fn tagged(&self, api_addr: &str, tag: &str, limit: usize) -> Result<KeyList, ApiError> {
        let path = format!("/v1/tags/{}?limit={limit}", utf8_percent_encode(tag, SEGMENT));
        self.call_json(Method::GET, api_addr, &path, &Self::local_scope(), Bytes::new()).await
    }

    /// Asks one member to remove its local items tagged `tag`.
    pub async fn remove_tagged(&self, api_addr: &str, tag: &str) -> Result<Removed, ApiError> {
        let path = format!("/v1/tags/{}", utf8_percent_encode(tag, SEGMENT));
        self.call_json(Method::DELETE, api_addr, &path, &Self::local_scope(), Bytes::new()).await
    }

    /// One member's transfer status, from its peer listener.
    pub async fn transfer_status(&self, peer_addr: &str) -> Result<TransferStatus, ApiError> {
        // The one call of this client to a peer listener: it carries the cluster secret (the
        // others go to API ports, which must never see it).
        let secret: Vec<(HeaderName, String)> = shoal_raft::cluster_secret()
            .map(|s| (HeaderName::from_static(shoal_raft::SECRET_HEADER), s.to_string()))
            .into_iter()
            .collect();
        let path = "/internal/transfer/status";
        let answer = self.call_ok(Method::GET, peer_addr, path, &secret, Bytes::new(), STATS_TIMEOUT).await?;
        serde_json::from_slice(&answer.body).map_err(|e| ApiError::Internal(e.to_string()))
    }

    /// One member's own figures, with a short timeout (for `GET /v1/cluster`).
    pub async fn node_stats(&self, api_addr: &str) -> Result<NodeStats, ApiError> {
        let answer = self.call_ok(Method::GET, api_addr, "/v1/node", &[], Bytes::new(), STATS_TIMEOUT).await?;
        serde_json::from_slice(&answer.body).map_err(|e| ApiError::Internal(e.to_string()))
    }
}

impl Default for PeerClient {
    fn default() -> Self {
        Self::new()
    }
}

/// `request` with the cluster secret this process sends, if any (R62).
pub fn with_secret(request: hyper::http::request::Builder) -> hyper::http::request::Builder {
    match shoal_raft::cluster_secret() {
        Some(secret) => request.header(shoal_raft::SECRET_HEADER, secret),
        None => request,
    }
}

fn unreachable(api_addr: &str, e: &dyn std::fmt::Display) -> ApiError {
    ApiError::unavailable("owner_unreachable", format!("node at {api_addr} did not answer: {e}"))
}

/// Rebuilds the error a peer answered with.
fn error_of(answer: &Answer, api_addr: &str) -> ApiError {
    let is_problem = answer.headers.get(CONTENT_TYPE) == Some(&HeaderValue::from_static(shoal_http_api::PROBLEM_JSON));
    match serde_json::from_slice::<Problem>(&answer.body) {
        Ok(problem) if is_problem => ApiError::from_problem(&problem),
        _ if answer.status == StatusCode::NOT_FOUND => ApiError::NotFound,
        _ => ApiError::unavailable("owner_unreachable", format!("node at {api_addr} answered {}", answer.status)),
    }
}

/// The query of a forwarded PUT: the item's options in the public API's syntax.
fn put_query(item: &PutItem) -> Vec<(&'static str, String)> {
    let o = &item.options;
    let mut q = Vec::new();
    if let Some(ttl) = o.ttl {
        q.push(("ttl", format!("{}ms", ttl.as_millis())));
    }
    if let Some(sliding) = o.sliding {
        q.push(("sliding", format!("{}ms", sliding.as_millis())));
    }
    if !o.tags.is_empty() {
        q.push(("tags", o.tags.join(",")));
    }
    match o.condition {
        WriteCondition::Always => {}
        WriteCondition::Absent => q.push(("mode", "add".into())),
        WriteCondition::Present => q.push(("mode", "replace".into())),
        WriteCondition::Version(v) => q.push(("cas", v.to_string())),
    }
    q
}

/// An item in the bulk-put syntax (values that are not UTF-8 go as base64).
fn bulk_item(item: &PutItem) -> BulkPutItem {
    use base64::Engine;
    let o = &item.options;
    let (value, value_base64) = match std::str::from_utf8(&item.value) {
        Ok(text) => (Some(text.to_string()), None),
        Err(_) => (None, Some(base64::engine::general_purpose::STANDARD.encode(&item.value))),
    };
    let (cas, mode) = match o.condition {
        WriteCondition::Always => (None, None),
        WriteCondition::Absent => (None, Some("add".to_string())),
        WriteCondition::Present => (None, Some("replace".to_string())),
        WriteCondition::Version(v) => (Some(v), None),
    };
    BulkPutItem {
        key: item.key.clone(),
        value,
        value_base64,
        ttl: o.ttl.map(|d| format!("{}ms", d.as_millis())),
        sliding: o.sliding.map(|d| format!("{}ms", d.as_millis())),
        tags: o.tags.clone(),
        cas,
        mode,
    }
}
