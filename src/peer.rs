//! [`PeerClient`]: the node-to-node HTTP client for data operations.
//!
//! One pooled keep-alive reqwest client per node (separate from Raft's), with TCP_NODELAY and
//! bounded timeouts. A forwarded key request goes to the owner's public API with the
//! [`HEADER_FORWARDED_MAP_VERSION`] header; a broadcast goes with `x-shoal-scope: local`.
//! Answers are decoded back into the same types and errors the local path produces, so a
//! client cannot tell a forwarded answer from a local one.

use std::time::Duration;

use bytes::Bytes;
use reqwest::{Method, RequestBuilder, Response, StatusCode, Url};
use serde::de::DeserializeOwned;
use shoal_http_api::types::{
    BulkKeys, BulkPut, BulkPutItem, BulkResults, GetOk, KeyList, NodeStats, PutOk, Removed, WriteCondition,
};
use shoal_http_api::{
    ApiError, Problem, PutItem, HEADER_BUCKET, HEADER_FORWARDED_MAP_VERSION, HEADER_NODE, HEADER_SCOPE,
};

/// The HTTP client a node uses to reach other nodes' APIs.
#[derive(Clone)]
pub struct PeerClient {
    http: reqwest::Client,
}

/// How long a forwarded request may take before the caller gets `owner_unreachable`.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);

impl PeerClient {
    /// A client with connection pooling and TCP_NODELAY.
    pub fn new() -> Self {
        let http = reqwest::Client::builder()
            .no_proxy()
            .tcp_nodelay(true)
            .connect_timeout(Duration::from_secs(2))
            .timeout(REQUEST_TIMEOUT)
            .pool_max_idle_per_host(64)
            .pool_idle_timeout(Duration::from_secs(60))
            .build()
            .unwrap_or_default();
        PeerClient { http }
    }

    fn url(api_addr: &str, path: &[&str]) -> Result<Url, ApiError> {
        let mut url = Url::parse(&format!("http://{api_addr}/"))
            .map_err(|e| ApiError::Internal(format!("bad peer address {api_addr:?}: {e}")))?;
        url.path_segments_mut().map_err(|_| ApiError::Internal("peer url cannot have a path".into()))?.extend(path);
        Ok(url)
    }

    fn forwarded(&self, method: Method, url: Url, map_version: u64) -> RequestBuilder {
        self.http.request(method, url).header(HEADER_FORWARDED_MAP_VERSION, map_version)
    }

    async fn send(request: RequestBuilder, api_addr: &str) -> Result<Response, ApiError> {
        let response = request.send().await.map_err(|e| unreachable(api_addr, &e))?;
        if response.status().is_success() {
            return Ok(response);
        }
        Err(error_of(response, api_addr).await)
    }

    async fn json<T: DeserializeOwned>(request: RequestBuilder, api_addr: &str) -> Result<T, ApiError> {
        let response = Self::send(request, api_addr).await?;
        response.json().await.map_err(|e| unreachable(api_addr, &e))
    }

    /// Forwards a GET to the owner.
    pub async fn get(&self, api_addr: &str, key: &str, map_version: u64) -> Result<GetOk, ApiError> {
        let url = Self::url(api_addr, &["v1", "kv", key])?;
        let response = Self::send(self.forwarded(Method::GET, url, map_version), api_addr).await?;
        let header = |name: &str| response.headers().get(name).and_then(|v| v.to_str().ok()).map(str::to_owned);
        let version = header("etag").and_then(|e| e.trim_matches('"').parse().ok()).unwrap_or(0);
        let bucket = header(HEADER_BUCKET).and_then(|b| b.parse().ok()).unwrap_or(0);
        let node = header(HEADER_NODE).and_then(|n| n.parse().ok()).unwrap_or(0);
        let value: Bytes = response.bytes().await.map_err(|e| unreachable(api_addr, &e))?;
        Ok(GetOk { value, version, bucket, node })
    }

    /// Forwards a PUT to the owner.
    pub async fn put(&self, api_addr: &str, item: &PutItem, map_version: u64) -> Result<PutOk, ApiError> {
        let url = Self::url(api_addr, &["v1", "kv", &item.key])?;
        let query = put_query(item);
        let request = self.forwarded(Method::PUT, url, map_version).query(&query).body(item.value.clone());
        Self::json(request, api_addr).await
    }

    /// Forwards a DELETE to the owner.
    pub async fn delete(&self, api_addr: &str, key: &str, cas: Option<u64>, map_version: u64) -> Result<(), ApiError> {
        let url = Self::url(api_addr, &["v1", "kv", key])?;
        let mut request = self.forwarded(Method::DELETE, url, map_version);
        if let Some(cas) = cas {
            request = request.query(&[("cas", cas)]);
        }
        Self::send(request, api_addr).await.map(|_| ())
    }

    /// Forwards a bulk GET of keys the owner holds.
    pub async fn bulk_get(&self, api_addr: &str, keys: Vec<String>, map_version: u64) -> Result<BulkResults, ApiError> {
        let url = Self::url(api_addr, &["v1", "bulk", "get"])?;
        Self::json(self.forwarded(Method::POST, url, map_version).json(&BulkKeys { keys }), api_addr).await
    }

    /// Forwards a bulk PUT of items the owner holds.
    pub async fn bulk_put(&self, api_addr: &str, items: &[PutItem], map_version: u64) -> Result<BulkResults, ApiError> {
        let url = Self::url(api_addr, &["v1", "bulk", "put"])?;
        let body = BulkPut { items: items.iter().map(bulk_item).collect() };
        Self::json(self.forwarded(Method::POST, url, map_version).json(&body), api_addr).await
    }

    /// Forwards a bulk DELETE of keys the owner holds.
    pub async fn bulk_delete(
        &self,
        api_addr: &str,
        keys: Vec<String>,
        map_version: u64,
    ) -> Result<BulkResults, ApiError> {
        let url = Self::url(api_addr, &["v1", "bulk", "delete"])?;
        Self::json(self.forwarded(Method::POST, url, map_version).json(&BulkKeys { keys }), api_addr).await
    }

    /// Asks one member for its local keys with `prefix`.
    pub async fn keys(&self, api_addr: &str, prefix: &str, limit: usize) -> Result<KeyList, ApiError> {
        let url = Self::url(api_addr, &["v1", "kv"])?;
        let limit = limit.to_string();
        let request =
            self.http.get(url).header(HEADER_SCOPE, "local").query(&[("prefix", prefix), ("limit", limit.as_str())]);
        Self::json(request, api_addr).await
    }

    /// Asks one member for its local keys tagged `tag`.
    pub async fn tagged(&self, api_addr: &str, tag: &str, limit: usize) -> Result<KeyList, ApiError> {
        let url = Self::url(api_addr, &["v1", "tags", tag])?;
        let request = self.http.get(url).header(HEADER_SCOPE, "local").query(&[("limit", limit)]);
        Self::json(request, api_addr).await
    }

    /// Asks one member to remove its local items tagged `tag`.
    pub async fn remove_tagged(&self, api_addr: &str, tag: &str) -> Result<Removed, ApiError> {
        let url = Self::url(api_addr, &["v1", "tags", tag])?;
        Self::json(self.http.delete(url).header(HEADER_SCOPE, "local"), api_addr).await
    }

    /// One member's own figures, with a short timeout (for `GET /v1/cluster`).
    pub async fn node_stats(&self, api_addr: &str) -> Result<NodeStats, ApiError> {
        let url = Self::url(api_addr, &["v1", "node"])?;
        Self::json(self.http.get(url).timeout(Duration::from_secs(2)), api_addr).await
    }
}

impl Default for PeerClient {
    fn default() -> Self {
        Self::new()
    }
}

fn unreachable(api_addr: &str, e: &reqwest::Error) -> ApiError {
    ApiError::unavailable("owner_unreachable", format!("node at {api_addr} did not answer: {e}"))
}

/// Rebuilds the error a peer answered with.
async fn error_of(response: Response, api_addr: &str) -> ApiError {
    let status = response.status();
    match response.json::<Problem>().await {
        Ok(problem) => ApiError::from_problem(&problem),
        Err(_) if status == StatusCode::NOT_FOUND => ApiError::NotFound,
        Err(_) => ApiError::unavailable("owner_unreachable", format!("node at {api_addr} answered {status}")),
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
