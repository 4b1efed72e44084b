//! Handler tests: requests through the real router against a fake node.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use self::parking_lot_free::Mutex;
use axum::body::Body;
use axum::http::{header, Method, Request, StatusCode};
use axum::response::Response;
use bytes::Bytes;
use serde_json::{json, Value};
use shoal_raft::{bucket_of, NodeId};
use tower::ServiceExt;

use super::*;
use crate::types::*;

/// A std mutex under a short name (no extra dependency for the fake).
mod parking_lot_free {
    pub struct Mutex<T>(std::sync::Mutex<T>);
    impl<T> Mutex<T> {
        pub fn new(t: T) -> Self {
            Mutex(std::sync::Mutex::new(t))
        }
        pub fn lock(&self) -> std::sync::MutexGuard<'_, T> {
            self.0.lock().unwrap_or_else(|e| e.into_inner())
        }
    }
}

/// A one-node "cluster": a map with versions. Keys starting with `remote:` belong to another
/// node at `10.0.0.9:7000`, to exercise redirects.
struct FakeNode {
    items: Mutex<HashMap<String, (Bytes, u64)>>,
    version: Mutex<u64>,
    seen: Mutex<Vec<PutItem>>,
}

impl FakeNode {
    fn new() -> Arc<Self> {
        Arc::new(FakeNode { items: Mutex::new(HashMap::new()), version: Mutex::new(0), seen: Mutex::new(Vec::new()) })
    }
}

const ME: NodeId = 1;

impl KeyApi for FakeNode {
    fn limits(&self) -> Limits {
        Limits { max_key_bytes: 16, max_value_bytes: 64, max_bulk_keys: 4, max_bulk_body_bytes: 64 << 20 }
    }

    async fn get(&self, key: String, ctx: RouteContext) -> Result<GetOk, ApiError> {
        if key.starts_with("remote:") && ctx.redirect {
            return Err(ApiError::Redirect { api_addr: "10.0.0.9:7000".into() });
        }
        let items = self.items.lock();
        let (value, version) = items.get(&key).cloned().ok_or(ApiError::NotFound)?;
        Ok(GetOk { value, version, bucket: bucket_of(key.as_bytes()).0, node: ME, lag_ms: None })
    }

    async fn put(&self, item: PutItem, _ctx: RouteContext) -> Result<PutOk, ApiError> {
        self.seen.lock().push(item.clone());
        let mut items = self.items.lock();
        let current = items.get(&item.key).map(|e| e.1);
        let holds = match item.options.condition {
            WriteCondition::Always => true,
            WriteCondition::Absent => current.is_none(),
            WriteCondition::Present => current.is_some(),
            WriteCondition::Version(v) => current == Some(v),
        };
        if !holds {
            return Err(ApiError::PreconditionFailed { current_version: current });
        }
        let mut v = self.version.lock();
        *v += 1;
        items.insert(item.key.clone(), (item.value, *v));
        Ok(PutOk { bucket: bucket_of(item.key.as_bytes()).0, key: item.key, version: *v, node: ME })
    }

    async fn delete(&self, key: String, _cas: Option<u64>, _ctx: RouteContext) -> Result<(), ApiError> {
        self.items.lock().remove(&key).map(|_| ()).ok_or(ApiError::NotFound)
    }

    async fn bulk_get(
        &self,
        keys: Vec<String>,
        ctx: RouteContext,
    ) -> Result<Vec<Result<Option<GetOk>, ApiError>>, ApiError> {
        let mut out = Vec::new();
        for k in keys {
            out.push(match self.get(k, ctx).await {
                Ok(ok) => Ok(Some(ok)),
                Err(ApiError::NotFound) => Ok(None),
                Err(e) => Err(e),
            });
        }
        Ok(out)
    }

    async fn bulk_put(&self, items: Vec<PutItem>, ctx: RouteContext) -> Result<Vec<Result<PutOk, ApiError>>, ApiError> {
        let mut out = Vec::new();
        for i in items {
            out.push(self.put(i, ctx).await);
        }
        Ok(out)
    }

    async fn bulk_delete(
        &self,
        keys: Vec<String>,
        _ctx: RouteContext,
    ) -> Result<Vec<Result<bool, ApiError>>, ApiError> {
        Ok(keys.into_iter().map(|k| Ok(self.items.lock().remove(&k).is_some())).collect())
    }

    async fn keys(&self, prefix: String, page: Page, _scope: Scope) -> Result<KeyList, ApiError> {
        let keys: Vec<FoundKey> = self
            .items
            .lock()
            .iter()
            .filter(|(k, _)| k.starts_with(&prefix) && page.after(k.as_bytes()))
            .map(|(k, (_, v))| FoundKey { key: k.clone(), bucket: bucket_of(k.as_bytes()).0, version: *v, node: ME })
            .collect();
        let (keys, more, next) = page.cut(keys);
        Ok(KeyList { keys, more, next, ..Default::default() })
    }

    async fn tagged(&self, _tag: String, _page: Page, _scope: Scope) -> Result<KeyList, ApiError> {
        Ok(KeyList::default())
    }

    async fn remove_tagged(&self, _tag: String, _scope: Scope) -> Result<Removed, ApiError> {
        Ok(Removed { removed: 1, incomplete: true, errors: vec![NodeFailure { node: 2, detail: "down".into() }] })
    }
}

impl AdminApi for FakeNode {
    async fn cluster(&self) -> Result<ClusterView, ApiError> {
        Err(ApiError::unavailable(Unavailable::NoLeader, "no leader"))
    }

    async fn transfer(&self) -> Result<TransferView, ApiError> {
        Ok(TransferView { target_version: None, buckets_left: 0, blocking: false, nodes: vec![], errors: vec![] })
    }

    fn map(&self) -> Result<MapView, ApiError> {
        Ok(MapView { version: 1, owners: vec![ME; 1000], nodes: vec![] })
    }

    async fn watch_map(&self, after: u64, timeout: Duration) -> Result<MapView, ApiError> {
        // The fake's map is version 1 for ever: a watch past it waits out its timeout.
        if after >= 1 {
            tokio::time::sleep(timeout).await;
        }
        self.map()
    }

    async fn events(&self, since: u64, limit: usize, _wait: Duration) -> Result<crate::types::EventsView, ApiError> {
        let event = |index: u64| shoal_raft::Event {
            index,
            time_ms: 1000 * index,
            map_version: 1,
            kind: shoal_raft::EventKind::NodeJoined,
            node: Some(index),
            peer: None,
            buckets: vec![],
            moves: vec![],
            first_index: None,
            message: format!("node {index} joined"),
        };
        let events: Vec<_> = (since + 1..=3).take(limit).map(event).collect();
        let next = events.last().map_or(since.max(3), |e| e.index);
        Ok(crate::types::EventsView { events, next, oldest: Some(1) })
    }

    fn node_stats(&self) -> NodeStats {
        NodeStats { node_id: ME, items: 0, bytes: 0, limit_bytes: 0, map_version: 1, version: None, revision: None }
    }

    async fn leave(&self, node_id: NodeId, _force: bool) -> Result<LeaveOk, ApiError> {
        Err(ApiError::UnknownResource(format!("node {node_id} is not a member")))
    }

    async fn enter_maintenance(&self, node_id: NodeId, period: Duration) -> Result<MaintenanceView, ApiError> {
        let until_ms = 1_000 + period.as_millis() as u64;
        Ok(MaintenanceView {
            node_id,
            served_by: 3,
            since_ms: 1_000,
            until_ms,
            seconds_left: period.as_secs_f64(),
            phase: "away".into(),
            returned: false,
            buckets_left: 333,
            ended: false,
        })
    }

    async fn end_maintenance(&self, node_id: NodeId) -> Result<MaintenanceView, ApiError> {
        Err(ApiError::Conflict(format!("node {node_id} is not in maintenance")))
    }

    async fn config(&self) -> Result<ClusterConfig, ApiError> {
        Ok(ClusterConfig { replication: Some("sync".into()), auto_balance: Some(false) })
    }

    async fn set_config(&self, config: ClusterConfig) -> Result<ClusterConfig, ApiError> {
        match config.replication.as_deref() {
            None | Some("sync") | Some("async") => Ok(config),
            Some(other) => Err(ApiError::BadRequest(format!("unknown replication mode {other:?}"))),
        }
    }

    async fn buckets(&self, query: BucketsQuery) -> Result<BucketsView, ApiError> {
        let figures = |b: u16| BucketFigures {
            bucket: b,
            owner: ME,
            items: 1,
            bytes: u64::from(b),
            reads_per_sec: 0.0,
            writes_per_sec: 0.0,
        };
        Ok(BucketsView {
            leader: ME,
            map_version: 1,
            stats_interval_ms: 10_000,
            balance_ratio: 1.0,
            auto_balance: false,
            total_items: 3,
            total_bytes: 3,
            nodes: Vec::new(),
            missing: Vec::new(),
            buckets: (0..3).map(figures).take(query.limit).collect(),
        })
    }

    async fn rebalance(&self, request: RebalanceRequest) -> Result<RebalancePlan, ApiError> {
        if request.node.is_some_and(|n| n != ME) {
            return Err(ApiError::UnknownResource("not a member".into()));
        }
        Ok(RebalancePlan {
            dry_run: request.dry_run,
            node_id: request.node,
            map_version: 1,
            to_version: None,
            moves: Vec::new(),
            bytes_moved: 0,
            lower_bound_bytes: 0,
            nodes: Vec::new(),
            ratio_before: 1.0,
            ratio_after: 1.0,
            transfer_rate_bytes_per_sec: None,
            estimated_seconds: None,
        })
    }

    async fn clear_lost(&self, clear: ClearLost) -> Result<LostCleared, ApiError> {
        Ok(LostCleared { cleared: clear.buckets })
    }

    fn agents(&self) -> AgentsView {
        AgentsView {
            node_id: ME,
            read_from: ReadFrom::Owner,
            strategy: "random".into(),
            period_karma_ms: 60_000,
            ping_interval_ms: 1000,
            max_staleness_ms: 0,
            agents: Vec::new(),
        }
    }
}

impl Probes for FakeNode {
    fn readiness(&self) -> Vec<Check> {
        vec![
            Check { name: "member".into(), ok: true, detail: String::new() },
            Check { name: "leader".into(), ok: false, detail: "no leader known".into() },
        ]
    }

    fn metrics(&self) -> String {
        "shoal_up 1\n".into()
    }
}

/// A request to the router a node serves.
async fn call(node: &Arc<FakeNode>, method: Method, uri: &str, body: impl Into<Body>) -> Response {
    let request = Request::builder().method(method).uri(uri).body(body.into()).expect("request");
    router(node.clone()).oneshot(request).await.expect("infallible")
}

async fn body_bytes(response: Response) -> Bytes {
    axum::body::to_bytes(response.into_body(), usize::MAX).await.expect("body")
}

async fn problem(response: Response) -> (StatusCode, Value) {
    let status = response.status();
    assert_eq!(response.headers()[header::CONTENT_TYPE], PROBLEM_JSON);
    (status, serde_json::from_slice(&body_bytes(response).await).expect("problem json"))
}

#[tokio::test]
async fn put_then_get_returns_the_raw_value_with_version_headers() {
    let node = FakeNode::new();
    let r = call(&node, Method::PUT, "/v1/kv/user:1?ttl=30s&tags=a,b", "hello").await;
    assert_eq!(r.status(), StatusCode::OK);
    let put: Value = serde_json::from_slice(&body_bytes(r).await).expect("json");
    assert_eq!(put["key"], "user:1");
    assert_eq!(put["version"], 1);
    assert_eq!(put["bucket"], bucket_of(b"user:1").0);
    let seen = node.seen.lock()[0].options.clone();
    assert_eq!(seen.ttl, Some(std::time::Duration::from_secs(30)));
    assert_eq!(seen.tags, vec!["a", "b"]);

    let r = call(&node, Method::GET, "/v1/kv/user:1", Body::empty()).await;
    assert_eq!(r.status(), StatusCode::OK);
    assert_eq!(r.headers()[header::ETAG], "\"1\"");
    assert_eq!(kv::quoted(u64::MAX), format!("\"{}\"", u64::MAX).as_str());
    assert_eq!(kv::quoted(0), "\"0\"");
    assert_eq!(r.headers()[HEADER_NODE], "1");
    assert_eq!(r.headers()[HEADER_BUCKET], bucket_of(b"user:1").0.to_string().as_str());
    assert_eq!(body_bytes(r).await, "hello");
}

#[tokio::test]
async fn keys_with_slashes_and_escapes_are_whole_keys() {
    let node = FakeNode::new();
    assert_eq!(call(&node, Method::PUT, "/v1/kv/a/b%20c", "v").await.status(), StatusCode::OK);
    assert!(node.items.lock().contains_key("a/b c"));
    // A key that is not UTF-8 once decoded is a problem document like every other error.
    for (method, uri) in [(Method::PUT, "/v1/kv/%FF"), (Method::GET, "/v1/kv/%FF"), (Method::GET, "/v1/tags/%C3")] {
        let r = call(&node, method.clone(), uri, "v").await;
        assert_eq!(r.headers()[header::CONTENT_TYPE], crate::PROBLEM_JSON, "{method} {uri}");
        let (status, p) = problem(r).await;
        assert_eq!((status, p["code"].as_str()), (StatusCode::BAD_REQUEST, Some("bad_request")), "{method} {uri}");
    }
}

#[tokio::test]
async fn malformed_requests_get_problem_json_and_change_nothing() {
    let node = FakeNode::new();
    for (uri, code) in [
        ("/v1/kv/k?ttl=soon", "bad_request"),
        ("/v1/kv/k?ttl=0", "bad_request"),
        ("/v1/kv/k?ttl=1ns", "bad_request"),
        ("/v1/kv/k?ttl=101years", "bad_request"),
        ("/v1/kv/k?sliding=9000years", "bad_request"),
        ("/v1/kv/k?ttl=281474976710656", "bad_request"),
        ("/v1/kv/k?ttl=1s&sliding=1s", "bad_request"),
        ("/v1/kv/k?redirect=", "bad_request"),
        ("/v1/kv/k?cas=%2B5", "bad_request"),
        ("/v1/kv/k?tags=a,,b", "bad_request"),
        ("/v1/kv/k?ttl=1s&ttl=2s", "bad_request"),
        ("/v1/kv/k?cas=x", "bad_request"),
        ("/v1/kv/k?mode=upsert", "bad_request"),
        ("/v1/kv/k?priority=urgent", "bad_request"),
        ("/v1/kv/k?priority=", "bad_request"),
        ("/v1/kv/k?cas=1&mode=add", "bad_request"),
        ("/v1/kv/k?tll=30s", "bad_request"),
        ("/v1/kv/k?redirect=maybe", "bad_request"),
        ("/v1/kv/a-key-longer-than-16-bytes", "key_too_large"),
    ] {
        let (status, p) = problem(call(&node, Method::PUT, uri, "v").await).await;
        assert_eq!(p["code"], code, "{uri}: {p}");
        assert_eq!(p["status"], status.as_u16());
        assert_eq!(p["type"], format!("urn:shoal:problem:{code}"));
    }
    let (status, p) = problem(call(&node, Method::PUT, "/v1/kv/k", vec![0u8; 65]).await).await;
    assert_eq!((status, p["code"].as_str()), (StatusCode::PAYLOAD_TOO_LARGE, Some("value_too_large")));
    assert!(node.seen.lock().is_empty(), "nothing reached the node");
}

#[tokio::test]
async fn failed_conditions_are_412_with_the_current_version() {
    let node = FakeNode::new();
    call(&node, Method::PUT, "/v1/kv/k", "a").await;
    let (status, p) = problem(call(&node, Method::PUT, "/v1/kv/k?cas=0", "b").await).await;
    assert_eq!(status, StatusCode::PRECONDITION_FAILED);
    assert_eq!(p["current_version"], 1);
    let (status, _) = problem(call(&node, Method::PUT, "/v1/kv/new?mode=replace", "b").await).await;
    assert_eq!(status, StatusCode::PRECONDITION_FAILED);
    assert_eq!(call(&node, Method::PUT, "/v1/kv/k?cas=1", "c").await.status(), StatusCode::OK);
}

async fn call_with(node: &Arc<FakeNode>, method: Method, uri: &str, headers: &[(&str, &str)], body: &str) -> Response {
    let mut request = Request::builder().method(method).uri(uri);
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    router(node.clone())
        .oneshot(request.body(Body::from(body.to_string())).expect("request"))
        .await
        .expect("infallible")
}

#[tokio::test]
async fn if_match_and_if_none_match_are_cas_and_add_and_a_current_etag_is_304() {
    let node = FakeNode::new();
    // If-None-Match: * writes only what is absent.
    let r = call_with(&node, Method::PUT, "/v1/kv/k", &[("if-none-match", "*")], "a").await;
    assert_eq!(r.status(), StatusCode::OK);
    let (status, p) = problem(call_with(&node, Method::PUT, "/v1/kv/k", &[("if-none-match", "*")], "b").await).await;
    assert_eq!((status, &p["current_version"]), (StatusCode::PRECONDITION_FAILED, &json!(1)));
    // If-Match: "N" is cas=N; If-Match: * needs the key to exist.
    let (status, p) = problem(call_with(&node, Method::PUT, "/v1/kv/k", &[("if-match", "\"7\"")], "b").await).await;
    assert_eq!((status, &p["current_version"]), (StatusCode::PRECONDITION_FAILED, &json!(1)));
    assert_eq!(call_with(&node, Method::PUT, "/v1/kv/k", &[("if-match", "\"1\"")], "b").await.status(), StatusCode::OK);
    let (status, _) = problem(call_with(&node, Method::PUT, "/v1/kv/new", &[("if-match", "*")], "b").await).await;
    assert_eq!(status, StatusCode::PRECONDITION_FAILED);
    assert_eq!(call_with(&node, Method::PUT, "/v1/kv/k", &[("if-match", "*")], "c").await.status(), StatusCode::OK);
    assert_eq!(node.items.lock()["k"], (Bytes::from("c"), 3));
    // Conditions given twice, weak or listed tags on a write: 400, nothing written.
    for headers in [
        &[("if-match", "\"3\""), ("if-none-match", "*")][..],
        &[("if-match", "W/\"3\"")],
        &[("if-match", "\"3\", \"4\"")],
        &[("if-match", "3")],
        &[("if-none-match", "\"3\"")],
    ] {
        let (status, p) = problem(call_with(&node, Method::PUT, "/v1/kv/k", headers, "x").await).await;
        assert_eq!((status, p["code"].as_str()), (StatusCode::BAD_REQUEST, Some("bad_request")), "{headers:?}");
    }
    let (status, _) =
        problem(call_with(&node, Method::PUT, "/v1/kv/k?cas=3", &[("if-match", "\"3\"")], "x").await).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(node.items.lock()["k"].1, 3, "nothing was written");
    // A GET with the current ETag answers 304 with the ETag and no value; another tag, 200.
    for tag in ["\"3\"", "W/\"3\"", "\"1\", \"3\"", "*"] {
        let r = call_with(&node, Method::GET, "/v1/kv/k", &[("if-none-match", tag)], "").await;
        assert_eq!(r.status(), StatusCode::NOT_MODIFIED, "{tag}");
        assert_eq!(r.headers()[header::ETAG], "\"3\"");
        assert!(body_bytes(r).await.is_empty());
    }
    let r = call_with(&node, Method::GET, "/v1/kv/k", &[("if-none-match", "\"2\"")], "").await;
    assert_eq!(r.status(), StatusCode::OK);
    assert_eq!(body_bytes(r).await, "c");
    let (status, _) = problem(call_with(&node, Method::GET, "/v1/kv/gone", &[("if-none-match", "*")], "").await).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
}

#[tokio::test]
async fn a_listing_that_stops_at_its_limit_says_more_and_where_to_go_on() {
    let node = FakeNode::new();
    for k in ["a1", "a2", "a3", "a4", "a5", "b1"] {
        call(&node, Method::PUT, &format!("/v1/kv/{k}"), "v").await;
    }
    let mut seen = Vec::new();
    let mut uri = "/v1/kv?prefix=a&limit=2".to_string();
    for _ in 0..5 {
        let list: Value =
            serde_json::from_slice(&body_bytes(call(&node, Method::GET, &uri, Body::empty()).await).await)
                .expect("json");
        seen.extend(list["keys"].as_array().expect("keys").iter().map(|k| k["key"].as_str().expect("key").to_string()));
        if list["more"] != true {
            assert!(list.get("next").is_none(), "{list}");
            break;
        }
        assert_eq!(list["next"].as_str(), seen.last().map(String::as_str), "{list}");
        uri = format!("/v1/kv?prefix=a&limit=2&start_after={}", list["next"].as_str().expect("next"));
    }
    assert_eq!(seen, ["a1", "a2", "a3", "a4", "a5"]);
    // Exactly `limit` keys left: no `more`.
    let list: Value = serde_json::from_slice(
        &body_bytes(call(&node, Method::GET, "/v1/kv?prefix=a&limit=5", Body::empty()).await).await,
    )
    .expect("json");
    assert_eq!((list["keys"].as_array().map(Vec::len), &list["more"]), (Some(5), &json!(false)));
    // A member asked for its own keys takes one more than the largest page (the one that
    // tells whether there are more); a client does not.
    let local = call_with(&node, Method::GET, "/v1/kv?limit=100001", &[("x-shoal-scope", "local")], "").await;
    assert_eq!(local.status(), StatusCode::OK);
    let (status, _) = problem(call(&node, Method::GET, "/v1/kv?limit=100001", Body::empty()).await).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    let (status, _) = problem(call_with(&node, Method::PUT, "/v1/kv/k0", &[("if-match", "\"0\"")], "x").await).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "versions start at 1");
}

#[tokio::test]
async fn missing_keys_routes_and_methods_are_problems() {
    let node = FakeNode::new();
    assert_eq!(problem(call(&node, Method::GET, "/v1/kv/nope", Body::empty()).await).await.1["code"], "not_found");
    assert_eq!(
        problem(call(&node, Method::GET, "/v2/whatever", Body::empty()).await).await.1["code"],
        "unknown_resource"
    );
    assert_eq!(
        problem(call(&node, Method::POST, "/v1/kv/k", Body::empty()).await).await.1["code"],
        "method_not_allowed"
    );
    call(&node, Method::PUT, "/v1/kv/k", "a").await;
    assert_eq!(call(&node, Method::DELETE, "/v1/kv/k", Body::empty()).await.status(), StatusCode::NO_CONTENT);
    assert_eq!(call(&node, Method::DELETE, "/v1/kv/k", Body::empty()).await.status(), StatusCode::NOT_FOUND);
}

#[tokio::test]
async fn cluster_config_takes_a_json_body_and_refuses_unknown_fields() {
    let node = FakeNode::new();
    let r = call(&node, Method::PUT, "/v1/cluster/config", Body::from(r#"{"replication":"async"}"#)).await;
    assert_eq!(r.status(), StatusCode::OK);
    let r = call(&node, Method::PUT, "/v1/cluster/config", Body::from(r#"{"replication":"async","x":1}"#)).await;
    assert_eq!(r.status(), StatusCode::BAD_REQUEST);
    let r = call(&node, Method::PUT, "/v1/cluster/config", Body::from(r#"{"replication":"maybe"}"#)).await;
    assert_eq!(r.status(), StatusCode::BAD_REQUEST);
    let r = call(&node, Method::POST, "/v1/cluster/lost/clear", Body::from("{}")).await;
    assert_eq!(r.status(), StatusCode::OK);
    let r = call(&node, Method::POST, "/v1/cluster/lost/clear", Body::empty()).await;
    assert_eq!(r.status(), StatusCode::OK, "no body clears every lost bucket");
}

proptest::proptest! {
    /// The description's pattern for a maintenance period and the server's check agree on
    /// every string: numbers around each unit's bounds, and any short string.
    #[test]
    fn the_maintenance_period_pattern_is_the_server_s_check(n in 0u64..8_000_000, unit in 0usize..6, noise in "[0-9a-z]{0,6}") {
        let pattern = regex::Regex::new(&crate::openapi::duration_range_pattern(10_000, 3_600_000)).expect("a regex");
        let units = ["", "ms", "s", "m", "h", "d"];
        let bounds = [(10, 3600), (10_000, 3_600_000), (10, 3600), (1, 60), (1, 1), (1, 1)];
        let (lo, hi) = bounds[unit];
        let near = [n, n % 100, lo, lo.saturating_sub(1), hi, hi + 1, hi.saturating_sub(n % 7), lo + n % 7];
        for text in near.iter().map(|m| format!("{m}{}", units[unit])).chain([noise.clone()]) {
            let accepted = crate::maintenance_period(Some(&text)).is_ok();
            proptest::prop_assert_eq!(pattern.is_match(&text), accepted, "{}", text);
        }
    }

    /// The description's pattern for a duration and the server's parser agree on every
    /// string: numbers around each unit's bound, and any short string of digits and letters.
    #[test]
    fn the_duration_pattern_is_the_parser(n in 0u64..4_000_000_000_000, unit in 0usize..7, noise in "[0-9a-z+ .]{0,8}") {
        let pattern = regex::Regex::new(&crate::openapi::duration_pattern()).expect("a regex");
        let units = ["", "ms", "s", "m", "h", "d", "y"];
        let limits = [3_155_760_000u64, 3_155_760_000_000, 3_155_760_000, 52_596_000, 876_600, 36_525, 100];
        let near = [n, n % 100, limits[unit].saturating_sub(n % 3), limits[unit] + n % 3];
        for text in near.iter().map(|m| format!("{m}{}", units[unit])).chain([noise.clone(), format!("0{n}s")]) {
            let parsed = crate::parse_duration("ttl", &text).is_ok();
            proptest::prop_assert_eq!(pattern.is_match(&text), parsed, "{}", text);
        }
    }
}

#[test]
fn durations_are_bounded_and_pass_through_a_forwarder_exactly() {
    use crate::{format_duration, parse_duration, MAX_EXPIRY};
    use std::time::Duration;
    for text in ["1ms", "1500ms", "30s", "90m", "2h", "36525d", "86400"] {
        let d = parse_duration("ttl", text).expect(text);
        assert_eq!(parse_duration("ttl", &format_duration(d)), Ok(d), "{text}");
    }
    assert_eq!(parse_duration("ttl", "36525d"), Ok(MAX_EXPIRY));
    assert_eq!(parse_duration("ttl", "90m"), Ok(Duration::from_secs(5400)));
    assert!(parse_duration("ttl", &format_duration(MAX_EXPIRY + Duration::from_millis(1))).is_err());
    for bad in ["", "0", "0s", "05s", "1h30m", "1.5s", "+5", "5 s", "1w", "1ns", "36526d", "99999999999999999999999"] {
        assert!(parse_duration("ttl", bad).is_err(), "{bad:?} is refused");
    }
}

#[tokio::test]
async fn unavailable_answers_carry_retry_after() {
    let node = FakeNode::new();
    let r = call(&node, Method::GET, "/v1/cluster", Body::empty()).await;
    assert_eq!(r.headers()[header::RETRY_AFTER], "1");
    assert_eq!(problem(r).await, (StatusCode::SERVICE_UNAVAILABLE, problem_json("no_leader", 503, "no leader")));
}

fn problem_json(code: &str, status: u16, detail: &str) -> Value {
    json!({"type": format!("urn:shoal:problem:{code}"), "title": "Service Unavailable", "status": status, "detail": detail, "code": code})
}

#[tokio::test]
async fn redirect_answers_307_to_the_same_path_on_the_owner() {
    let node = FakeNode::new();
    let r = call(&node, Method::GET, "/v1/kv/remote:x?redirect=true", Body::empty()).await;
    assert_eq!(r.status(), StatusCode::TEMPORARY_REDIRECT);
    assert_eq!(r.headers()[header::LOCATION], "http://10.0.0.9:7000/v1/kv/remote:x");
}

#[tokio::test]
async fn bulk_requests_answer_per_key_in_order() {
    let node = FakeNode::new();
    let body = json!({"items": [
        {"key": "a", "value": "text"},
        {"key": "b", "value_base64": "AP8="},
        {"key": "a-key-longer-than-16-bytes", "value": "x"},
        {"key": "c", "value": "x", "ttl": "never"},
    ]});
    let r = call(&node, Method::POST, "/v1/bulk/put", body.to_string()).await;
    assert_eq!(r.status(), StatusCode::OK);
    let put: Value = serde_json::from_slice(&body_bytes(r).await).expect("json");
    let codes: Vec<Value> =
        put["results"].as_array().expect("results").iter().map(|r| r["error"]["code"].clone()).collect();
    assert_eq!(codes, vec![Value::Null, Value::Null, json!("key_too_large"), json!("bad_request")]);

    let r = call(&node, Method::POST, "/v1/bulk/get", json!({"keys": ["b", "a", "zz"]}).to_string()).await;
    let got: Value = serde_json::from_slice(&body_bytes(r).await).expect("json");
    let results = got["results"].as_array().expect("results");
    assert_eq!(results[0]["value_base64"], "AP8=");
    assert_eq!(results[1]["value"], "text");
    assert_eq!(results[2]["found"], false);

    let too_many = json!({"keys": ["a", "b", "c", "d", "e"]}).to_string();
    assert_eq!(problem(call(&node, Method::POST, "/v1/bulk/get", too_many).await).await.0, StatusCode::BAD_REQUEST);
    let not_json = problem(call(&node, Method::POST, "/v1/bulk/delete", "{").await).await;
    assert_eq!(not_json.1["code"], "bad_request");
}

#[tokio::test]
async fn an_incomplete_tag_removal_is_a_502_that_says_what_was_done() {
    let node = FakeNode::new();
    let r = call(&node, Method::DELETE, "/v1/tags/red", Body::empty()).await;
    assert_eq!(r.status(), StatusCode::BAD_GATEWAY);
    let body: Value = serde_json::from_slice(&body_bytes(r).await).expect("json");
    assert_eq!(body["removed"], 1);
    assert_eq!(body["errors"][0]["node"], 2);
}

#[tokio::test]
async fn readyz_lists_checks_when_verbose() {
    let node = FakeNode::new();
    let r = call(&node, Method::GET, "/readyz?verbose", Body::empty()).await;
    assert_eq!(r.status(), StatusCode::SERVICE_UNAVAILABLE);
    let text = String::from_utf8(body_bytes(r).await.to_vec()).expect("utf8");
    assert_eq!(text, "[+] member ok\n[-] leader failed: no leader known\nnot ready\n");
    assert_eq!(call(&node, Method::GET, "/livez", Body::empty()).await.status(), StatusCode::OK);
}

#[tokio::test]
async fn the_openapi_document_describes_every_route() {
    let node = FakeNode::new();
    let r = call(&node, Method::GET, "/openapi.json", Body::empty()).await;
    assert_eq!(r.status(), StatusCode::OK);
    let doc: Value = serde_json::from_slice(&body_bytes(r).await).expect("json");
    assert!(doc["openapi"].as_str().is_some_and(|v| v.starts_with("3.")));
    let documented: Vec<String> = doc["paths"].as_object().expect("paths").keys().cloned().collect();
    // Every route of the router, as written in lib.rs (wildcards as OpenAPI parameters).
    let routes = include_str!("lib.rs")
        .lines()
        .filter_map(|l| l.trim().strip_prefix(".route(\"").and_then(|r| r.split('"').next()))
        .map(|r| r.replace("{*key}", "{key}"))
        .collect::<Vec<_>>();
    assert!(routes.len() >= 14, "{routes:?}");
    for route in routes {
        assert!(documented.contains(&route), "{route} is not in the OpenAPI document");
    }
    // Every operation with input describes its 400; every error of the API is a problem
    // document; no `default` answer hides an undescribed status.
    for (path, item) in doc["paths"].as_object().expect("paths") {
        for (method, op) in item.as_object().expect("operations") {
            let what = format!("{method} {path}");
            assert!(op.get("parameters").is_none_or(Value::is_array), "{what}: parameters");
            let responses = op["responses"].as_object().expect("responses");
            assert!(!responses.contains_key("default"), "{what}");
            if op.get("parameters").is_some_and(|p| p.as_array().is_some_and(|p| !p.is_empty()))
                || op.get("requestBody").is_some()
            {
                assert!(responses.contains_key("400"), "{what} describes no 400");
            }
            for (status, r) in responses.iter().filter(|(s, _)| s.starts_with('4') || s.starts_with('5')) {
                // Readiness and liveness are text for probes; an incomplete tag removal says
                // what it did.
                if (matches!(path.as_str(), "/readyz" | "/livez") && status == "503")
                    || (path == "/v1/tags/{tag}" && status == "502")
                {
                    continue;
                }
                assert!(
                    r["content"].get("application/problem+json").is_some(),
                    "{what} {status} is not a problem document"
                );
            }
        }
    }
}

#[tokio::test]
async fn maintenance_takes_a_bounded_period_and_defaults_to_ten_minutes() {
    let node = FakeNode::new();
    let path = "/v1/cluster/nodes/2/maintenance";
    for (body, seconds) in
        [("", 600.0), ("null", 600.0), ("{}", 600.0), (r#"{"for": "90s"}"#, 90.0), (r#"{"for": "1h"}"#, 3600.0)]
    {
        let response = call(&node, Method::POST, path, body).await;
        assert_eq!(response.status(), StatusCode::OK, "{body}");
        let view: MaintenanceView = serde_json::from_slice(&body_bytes(response).await).expect("json");
        assert_eq!((view.node_id, view.seconds_left), (2, seconds), "{body}");
    }
    for body in [r#"{"for": "5s"}"#, r#"{"for": "2h"}"#, r#"{"for": "soon"}"#, r#"{"until": "1h"}"#, "[]"] {
        let (status, p) = problem(call(&node, Method::POST, path, body).await).await;
        assert_eq!((status, p["code"].as_str()), (StatusCode::BAD_REQUEST, Some("bad_request")), "{body}");
    }
    let (status, _) = problem(call(&node, Method::POST, "/v1/cluster/nodes/x/maintenance", "").await).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    let (status, p) = problem(call(&node, Method::DELETE, path, "").await).await;
    assert_eq!((status, p["code"].as_str()), (StatusCode::CONFLICT, Some("conflict")));
}

#[tokio::test]
async fn the_event_log_pages_by_index_and_follows_as_server_sent_events() {
    let node = FakeNode::new();
    let page: Value =
        serde_json::from_slice(&body_bytes(call(&node, Method::GET, "/v1/cluster/events", Body::empty()).await).await)
            .expect("json");
    assert_eq!(page["events"].as_array().map(Vec::len), Some(3));
    assert_eq!(page["events"][0]["type"], "node_joined");
    assert_eq!(page["next"], 3);
    let page: Value = serde_json::from_slice(
        &body_bytes(call(&node, Method::GET, "/v1/cluster/events?since=1&limit=1", Body::empty()).await).await,
    )
    .expect("json");
    assert_eq!(page["events"][0]["index"], 2);
    assert_eq!(page["next"], 2);
    for bad in ["since=-1", "limit=0", "follow=maybe", "since=x", "other=1"] {
        let (status, _) =
            problem(call(&node, Method::GET, &format!("/v1/cluster/events?{bad}"), Body::empty()).await).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{bad}");
    }
    // Followed: an event stream, each event with its index as id, from Last-Event-ID on.
    let request = Request::builder()
        .uri("/v1/cluster/events?follow=true")
        .header("last-event-id", "1")
        .body(Body::empty())
        .expect("request");
    let response = router(node.clone()).oneshot(request).await.expect("infallible");
    assert_eq!(response.headers()[header::CONTENT_TYPE], "text/event-stream");
    let mut body = response.into_body().into_data_stream();
    let mut text = String::new();
    while !text.contains("id: 3") {
        use futures_util::StreamExt;
        let chunk = tokio::time::timeout(Duration::from_secs(5), body.next()).await.expect("an event").expect("more");
        text.push_str(&String::from_utf8_lossy(&chunk.expect("chunk")));
    }
    assert!(text.contains("id: 2") && !text.contains("id: 1\n"), "{text}");
    assert!(text.contains("event: cluster_event"), "{text}");
}

#[tokio::test(start_paused = true)]
async fn a_map_watch_answers_a_newer_map_at_once_and_the_current_one_after_its_timeout() {
    let node = FakeNode::new();
    let map = call(&node, Method::GET, "/v1/cluster/map?wait_version=0", Body::empty()).await;
    assert_eq!(map.status(), StatusCode::OK);
    let started = tokio::time::Instant::now();
    let map = call(&node, Method::GET, "/v1/cluster/map?wait_version=1&timeout=2s", Body::empty()).await;
    assert_eq!(map.status(), StatusCode::OK);
    assert!(started.elapsed() >= Duration::from_secs(2));
    for bad in ["wait_version=x", "wait_version=1&timeout=6m", "timeout=1s", "wait_version=1&timeout=0s"] {
        let (status, _) =
            problem(call(&node, Method::GET, &format!("/v1/cluster/map?{bad}"), Body::empty()).await).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{bad}");
    }
}

#[tokio::test]
async fn a_body_in_one_piece_or_many_reads_whole_and_one_over_the_limit_is_refused() {
    let pieces = |n: usize| {
        let chunks: Vec<Result<Bytes, std::io::Error>> =
            (0..n).map(|i| Ok(Bytes::from(vec![b'a' + i as u8; 10]))).collect();
        Body::from_stream(futures_util::stream::iter(chunks))
    };
    let one = crate::kv::read_body(Body::from("hello"), 5).await.expect("fits");
    assert_eq!(&one[..], b"hello");
    let many = crate::kv::read_body(pieces(3), 30).await.expect("fits");
    assert_eq!(&many[..], &[&[b'a'; 10][..], &[b'b'; 10], &[b'c'; 10]].concat()[..]);
    let refused = crate::kv::read_body(pieces(4), 30).await;
    assert!(matches!(refused, Err(ApiError::ValueTooLarge { limit: 30 })), "{refused:?}");
    assert!(crate::kv::read_body(Body::empty(), 0).await.expect("empty").is_empty());
    // A limit a layer put on the body is told by the error's type, not its text.
    let limited = Body::new(http_body_util::Limited::new(http_body_util::Full::new(Bytes::from(vec![0u8; 50])), 10));
    let refused = crate::kv::read_body(limited, 100).await;
    assert!(matches!(refused, Err(ApiError::ValueTooLarge { limit: 100 })), "{refused:?}");
}

/// A bulk body announced over the limit is refused at once: nothing of it is read (the body
/// below never sends a byte), so a client that asked `Expect: 100-continue` sends none.
#[tokio::test]
async fn a_bulk_body_announced_over_the_limit_is_refused_before_it_is_read() {
    let node = FakeNode::new();
    let never = Body::from_stream(futures_util::stream::pending::<Result<Bytes, std::io::Error>>());
    let request = Request::builder()
        .method(Method::POST)
        .uri("/v1/bulk/put")
        .header(header::CONTENT_LENGTH, (64 << 20) + 1)
        .header(header::EXPECT, "100-continue")
        .body(never)
        .expect("request");
    let answer = tokio::time::timeout(Duration::from_secs(10), router(node.clone()).oneshot(request)).await;
    let (status, p) = problem(answer.expect("answered without the body").expect("infallible")).await;
    assert_eq!((status, p["code"].as_str()), (StatusCode::PAYLOAD_TOO_LARGE, Some("value_too_large")));
}

/// A body announced over the limit by a client that did not ask `Expect: 100-continue` is read
/// to its end (and dropped) before the 413: that client is sending it already, and answered
/// first it would see its connection reset while it writes.
#[tokio::test]
async fn a_body_announced_over_the_limit_is_read_and_dropped_before_the_refusal() {
    let read = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counted = read.clone();
    let chunks = (0..20).map(move |_| {
        counted.fetch_add(1 << 20, std::sync::atomic::Ordering::SeqCst);
        Ok::<_, std::io::Error>(Bytes::from(vec![b'x'; 1 << 20]))
    });
    let limit = Limits::default().max_value_bytes;
    let request = Request::builder()
        .method(Method::PUT)
        .uri("/v1/kv/big")
        .header(header::CONTENT_LENGTH, 20 * (1 << 20))
        .body(Body::from_stream(futures_util::stream::iter(chunks)))
        .expect("request");
    assert!(20 * (1 << 20) > limit, "the body is over the limit");
    let (status, p) = problem(router(FakeNode::new()).oneshot(request).await.expect("infallible")).await;
    assert_eq!((status, p["code"].as_str()), (StatusCode::PAYLOAD_TOO_LARGE, Some("value_too_large")));
    assert_eq!(read.load(std::sync::atomic::Ordering::SeqCst), 20 * (1 << 20));
}

/// A peer's state reads on the wire as it did when it was a string, and as it prints.
#[test]
fn peer_states_keep_their_wire_names() {
    for (state, name) in [(PeerState::Ok, "ok"), (PeerState::Pfail, "pfail"), (PeerState::Maintenance, "maintenance")] {
        assert_eq!(serde_json::to_value(state).expect("json"), json!(name));
        assert_eq!(state.to_string(), name);
    }
}
