//! The closed-loop load: each connection sends a request, waits for the answer, records its
//! latency, and sends the next, until the deadline.
//!
//! Requests go over hyper's low-level HTTP/1.1 client (one TCP connection per worker and
//! node, no pool, no URL parsing per request), so the generator spends as little of the
//! shared cores as it can.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use bytes::Bytes;
use hdrhistogram::Histogram;
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http1::SendRequest;
use hyper::header::HeaderValue;
use hyper::{Method, Request};
use hyper_util::rt::TokioIo;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use tokio::net::TcpStream;

/// What the workers send.
#[derive(Debug, Clone)]
pub struct Workload {
    /// The nodes' API addresses.
    pub nodes: Vec<String>,
    /// For direct routing: the index in `nodes` of each key's owner.
    pub owner_of_key: Option<Vec<u16>>,
    /// For direct routing: the keys each node owns.
    pub keys_of_node: Vec<Vec<u32>>,
    /// Number of keys.
    pub keys: u32,
    /// The value written by puts.
    pub value: Bytes,
    /// Probability that an operation is a get.
    pub get_share: f64,
    /// Keys per request (1: single-key endpoints, more: bulk endpoints).
    pub batch: usize,
    /// Per-request timeout.
    pub timeout: Duration,
    /// Gets ask for `?read=mirrors`.
    pub mirrors: bool,
    /// `Bearer <client token>` for every request, when the nodes run with one.
    pub bearer: Option<HeaderValue>,
}

/// The text of key `i`: `key:` and 12 digits, 16 bytes (as redis-benchmark's keys).
pub fn key_name(i: u32) -> String {
    format!("key:{i:012}")
}

/// What one worker saw.
pub struct WorkerStats {
    /// Requests answered successfully.
    pub requests: u64,
    /// Keys in those requests.
    pub keys: u64,
    /// Latency of successful requests, in microseconds.
    pub latency_us: Histogram<u64>,
    /// Failures by kind.
    pub errors: BTreeMap<String, u64>,
}

impl WorkerStats {
    fn new() -> Self {
        WorkerStats {
            requests: 0,
            keys: 0,
            latency_us: Histogram::new_with_bounds(1, 60_000_000, 3).expect("valid histogram bounds"),
            errors: BTreeMap::new(),
        }
    }

    fn error(&mut self, kind: impl Into<String>) {
        *self.errors.entry(kind.into()).or_insert(0) += 1;
    }

    /// Adds another worker's figures.
    pub fn merge(&mut self, other: WorkerStats) {
        self.requests += other.requests;
        self.keys += other.keys;
        let _ = self.latency_us.add(&other.latency_us);
        for (k, v) in other.errors {
            *self.errors.entry(k).or_insert(0) += v;
        }
    }

    /// Empty figures.
    pub fn empty() -> Self {
        Self::new()
    }
}

/// An HTTP/1.1 connection to one node.
struct Conn {
    sender: SendRequest<Full<Bytes>>,
    host: String,
    /// `Bearer <client token>`, when the nodes run with one.
    bearer: Option<HeaderValue>,
}

async fn connect(addr: &str, bearer: Option<&HeaderValue>) -> Result<Conn, String> {
    let tcp = TcpStream::connect(addr).await.map_err(|e| format!("connect {addr}: {e}"))?;
    let _ = tcp.set_nodelay(true);
    let (sender, conn) =
        hyper::client::conn::http1::handshake(TokioIo::new(tcp)).await.map_err(|e| format!("handshake {addr}: {e}"))?;
    tokio::spawn(async move {
        let _ = conn.await;
    });
    Ok(Conn { sender, host: addr.to_string(), bearer: bearer.cloned() })
}

/// One request to build: method, path, body, how many keys it carries.
struct Op {
    node: usize,
    method: Method,
    path: String,
    body: Bytes,
    keys: u64,
}

impl Workload {
    fn pick_keys(&self, rng: &mut SmallRng) -> (usize, Vec<u32>) {
        let first = rng.random_range(0..self.keys);
        let node = match &self.owner_of_key {
            Some(owners) => owners[first as usize] as usize,
            None => rng.random_range(0..self.nodes.len()),
        };
        let mut keys = vec![first];
        for _ in 1..self.batch {
            let k = match &self.owner_of_key {
                Some(_) => {
                    let mine = &self.keys_of_node[node];
                    mine[rng.random_range(0..mine.len())]
                }
                None => rng.random_range(0..self.keys),
            };
            keys.push(k);
        }
        (node, keys)
    }

    fn next_op(&self, rng: &mut SmallRng) -> Op {
        let get = rng.random_bool(self.get_share.clamp(0.0, 1.0));
        let (node, keys) = self.pick_keys(rng);
        let n = keys.len() as u64;
        let read = if self.mirrors { "?read=mirrors" } else { "" };
        if self.batch <= 1 {
            let path = format!("/v1/kv/{}", key_name(keys[0]));
            return if get {
                Op { node, method: Method::GET, path: format!("{path}{read}"), body: Bytes::new(), keys: n }
            } else {
                Op { node, method: Method::PUT, path, body: self.value.clone(), keys: n }
            };
        }
        let body = if get {
            let names: Vec<String> = keys.iter().map(|&k| key_name(k)).collect();
            serde_json::json!({ "keys": names })
        } else {
            let value = String::from_utf8_lossy(&self.value);
            let items: Vec<_> = keys.iter().map(|&k| serde_json::json!({"key": key_name(k), "value": value})).collect();
            serde_json::json!({ "items": items })
        };
        let path = if get { format!("/v1/bulk/get{read}") } else { "/v1/bulk/put".to_string() };
        Op { node, method: Method::POST, path, body: Bytes::from(body.to_string()), keys: n }
    }
}

/// Runs one worker until `deadline`.
pub async fn worker(work: std::sync::Arc<Workload>, seed: u64, deadline: Instant) -> WorkerStats {
    let mut stats = WorkerStats::new();
    let mut rng = SmallRng::seed_from_u64(seed);
    let mut conns: Vec<Option<Conn>> = work.nodes.iter().map(|_| None).collect();
    while Instant::now() < deadline {
        let op = work.next_op(&mut rng);
        if conns[op.node].is_none() {
            match connect(&work.nodes[op.node], work.bearer.as_ref()).await {
                Ok(c) => conns[op.node] = Some(c),
                Err(_) => {
                    stats.error("connect");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            }
        }
        let Some(conn) = conns[op.node].as_mut() else { continue };
        let started = Instant::now();
        match send(conn, &op, work.timeout).await {
            Ok(()) => {
                stats.requests += 1;
                stats.keys += op.keys;
                let _ = stats.latency_us.record(started.elapsed().as_micros().max(1) as u64);
            }
            Err(kind) => {
                if kind == "timeout" || kind == "connection" {
                    conns[op.node] = None;
                }
                stats.error(kind);
            }
        }
    }
    stats
}

/// Runs one worker through the client library until `deadline`.
pub async fn client_worker(
    client: crate::client::Client,
    work: std::sync::Arc<Workload>,
    seed: u64,
    deadline: Instant,
) -> WorkerStats {
    let mut stats = WorkerStats::new();
    let mut rng = SmallRng::seed_from_u64(seed);
    while Instant::now() < deadline {
        let get = rng.random_bool(work.get_share.clamp(0.0, 1.0));
        let names: Vec<String> = (0..work.batch).map(|_| key_name(rng.random_range(0..work.keys))).collect();
        let started = Instant::now();
        let outcome = if work.batch <= 1 {
            if get {
                client.get(&names[0]).await.map(|v| v.is_some())
            } else {
                client.put(&names[0], work.value.clone()).await.map(|_| true)
            }
        } else {
            let keys: Vec<&str> = names.iter().map(String::as_str).collect();
            let results = if get {
                client.get_many(&keys).await
            } else {
                let value = String::from_utf8_lossy(&work.value).into_owned();
                let items: Vec<_> = names
                    .iter()
                    .map(|k| shoal_http_api::types::BulkPutItem {
                        key: k.clone(),
                        value: Some(value.clone()),
                        ..Default::default()
                    })
                    .collect();
                client.put_many(&items).await
            };
            Ok(results.iter().all(|r| r.error.is_none() && r.found != Some(false)))
        };
        match outcome {
            Ok(true) => {
                stats.requests += 1;
                stats.keys += work.batch as u64;
                let _ = stats.latency_us.record(started.elapsed().as_micros().max(1) as u64);
            }
            Ok(false) => stats.error("bulk_miss_or_error"),
            Err(e) => stats.error(e.code().unwrap_or("connection").to_string()),
        }
    }
    stats
}

/// Sends one request and reads the whole answer; `Err` names the kind of failure.
async fn send(conn: &mut Conn, op: &Op, timeout: Duration) -> Result<(), String> {
    let (status, body) = exchange(conn, op.method.clone(), &op.path, op.body.clone(), timeout).await?;
    if !status.is_success() {
        return Err(format!("http_{}", status.as_u16()));
    }
    if op.method == Method::POST && memchr_error(&body) {
        return Err("bulk_miss_or_error".to_string());
    }
    Ok(())
}

/// Whether a bulk answer reports a per-key error (or a missing key).
fn memchr_error(body: &[u8]) -> bool {
    let needle = b"\"error\"";
    let missing = b"\"found\":false";
    body.windows(needle.len()).any(|w| w == needle) || body.windows(missing.len()).any(|w| w == missing)
}

/// How long the fill keeps sending a chunk whose keys answer retryably (503: a bucket moving,
/// a replica not attached yet, no quorum for a moment) before it gives up.
const FILL_PATIENCE: Duration = Duration::from_secs(60);

/// What the fill did.
pub struct Filled {
    /// How long it took.
    pub took: Duration,
    /// Keys sent again because their first answer was retryable.
    pub retries: u64,
}

/// Writes every key once (bulk puts of 100 through the first node), with `parallel` requests
/// at a time. Keys answered retryably (503) are sent again, for at most [`FILL_PATIENCE`] per
/// chunk, and counted; any other failure ends the fill.
pub async fn fill(work: &Workload, parallel: usize) -> Result<Filled, String> {
    let started = Instant::now();
    let chunks: Vec<(u32, u32)> = (0..work.keys).step_by(100).map(|s| (s, (s + 100).min(work.keys))).collect();
    let value = String::from_utf8_lossy(&work.value).into_owned();
    let per_task = chunks.len().div_ceil(parallel.max(1));
    let mut tasks = tokio::task::JoinSet::new();
    for part in chunks.chunks(per_task.max(1)) {
        let part = part.to_vec();
        let value = value.clone();
        let addr = work.nodes[0].clone();
        let bearer = work.bearer.clone();
        tasks.spawn(async move {
            let mut conn = connect(&addr, bearer.as_ref()).await?;
            let mut retries = 0u64;
            for (start, end) in part {
                let mut keys: Vec<u32> = (start..end).collect();
                let give_up = Instant::now() + FILL_PATIENCE;
                loop {
                    let items: Vec<_> =
                        keys.iter().map(|&k| serde_json::json!({"key": key_name(k), "value": value})).collect();
                    let body = Bytes::from(serde_json::json!({ "items": items }).to_string());
                    let again =
                        match exchange(&mut conn, Method::POST, "/v1/bulk/put", body, Duration::from_secs(30)).await {
                            Ok((status, body)) if status.is_success() => retryable_items(&keys, &body)?,
                            Ok((status, _)) if status == hyper::StatusCode::SERVICE_UNAVAILABLE => keys.clone(),
                            Ok((status, body)) => {
                                return Err(format!("fill: {status}: {}", String::from_utf8_lossy(&body)));
                            }
                            Err(kind) if kind == "connection" || kind == "timeout" => {
                                conn = connect(&addr, bearer.as_ref()).await?;
                                keys.clone()
                            }
                            Err(kind) => return Err(format!("fill: {kind}")),
                        };
                    if again.is_empty() {
                        break;
                    }
                    if Instant::now() >= give_up {
                        return Err(format!("fill: {} keys still answered 503 after {FILL_PATIENCE:?}", again.len()));
                    }
                    retries += again.len() as u64;
                    keys = again;
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
            Ok::<u64, String>(retries)
        });
    }
    let mut retries = 0;
    while let Some(done) = tasks.join_next().await {
        retries += done.map_err(|e| e.to_string())??;
    }
    Ok(Filled { took: started.elapsed(), retries })
}

/// The keys of a bulk put's answer that failed retryably (status 503); an item that failed
/// otherwise is an error.
fn retryable_items(keys: &[u32], body: &[u8]) -> Result<Vec<u32>, String> {
    let answer: serde_json::Value = serde_json::from_slice(body).map_err(|e| format!("fill: the answer: {e}"))?;
    let results = answer["results"].as_array().ok_or("fill: the answer has no results")?;
    if results.len() != keys.len() {
        return Err(format!("fill: {} results for {} keys", results.len(), keys.len()));
    }
    let mut again = Vec::new();
    for (&key, result) in keys.iter().zip(results) {
        match result.get("error").filter(|e| !e.is_null()) {
            None => {}
            Some(e) if e["status"] == 503 => again.push(key),
            Some(e) => return Err(format!("fill: {}: {e}", key_name(key))),
        }
    }
    Ok(again)
}

/// Sends one request and reads the whole answer, whatever its status; `Err` names the kind of
/// failure ("connection", "timeout").
async fn exchange(
    conn: &mut Conn,
    method: Method,
    path: &str,
    body: Bytes,
    timeout: Duration,
) -> Result<(hyper::StatusCode, Bytes), String> {
    let mut request = Request::builder().method(method).uri(path).header(hyper::header::HOST, &conn.host);
    if let Some(bearer) = &conn.bearer {
        request = request.header(hyper::header::AUTHORIZATION, bearer);
    }
    let request = request.body(Full::new(body)).map_err(|e| format!("request: {e}"))?;
    let exchange = async {
        conn.sender.ready().await.map_err(|_| "connection".to_string())?;
        let response = conn.sender.send_request(request).await.map_err(|_| "connection".to_string())?;
        let status = response.status();
        let body = response.into_body().collect().await.map_err(|_| "connection".to_string())?.to_bytes();
        Ok((status, body))
    };
    match tokio::time::timeout(timeout, exchange).await {
        Ok(result) => result,
        Err(_) => Err("timeout".to_string()),
    }
}
