//! A client for shoal clusters that routes every key operation to its owner.
//!
//! [`Client::connect`] fetches the distribution map from the first node that answers and
//! keeps following it with the map watch (`GET /v1/cluster/map?wait_version=N`): after every
//! transition, move or failover it learns the new owners within one round trip. Single-key
//! operations go straight to the owner, bulk operations are split per owner and sent in
//! parallel, keyless ones (prefix listing, tags) are broadcast to every member and merged, so
//! once the cluster has settled no operation costs a forward between nodes.
//!
//! When a node cannot be reached, an operation for it goes through another node, which
//! forwards it to the owner. If that does not get an answer either, the client queues the
//! operations for that node and keeps trying to reconnect for the grace window (60% of the
//! request timeout: 54 s of the default 90 s). When the node comes back, or a new map gives its
//! buckets to another member, the queued operations go through; when the window ends, they
//! fail with [`ClientError::Connection`] and later ones fail at once until a new map arrives.
//!
//! A write is sent again only when it certainly was not applied (the connection could not
//! be made, or the node answered 503): a write whose answer was lost fails with
//! `maybe_applied: true` rather than risk applying it twice. Reads are retried freely.
//!
//! ```no_run
//! # async fn demo() -> Result<(), shoal::client::ClientError> {
//! use shoal::client::{Client, PutOptions};
//!
//! let client = Client::connect(["127.0.0.1:7000"]).await?;
//! client.put("user:42", "Ada").await?;
//! let ttl = PutOptions { ttl: Some(std::time::Duration::from_secs(60)), ..Default::default() };
//! client.put_with("session:42", "token", &ttl).await?;
//! if let Some(value) = client.get("user:42").await? {
//!     println!("{} (version {})", String::from_utf8_lossy(&value.bytes), value.version);
//! }
//! client.delete("user:42").await?;
//! # Ok(()) }
//! ```

mod error;
mod routes;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use bytes::Bytes;
use futures::future::join_all;
use parking_lot::Mutex;
use reqwest::{Method, StatusCode};
use serde::Serialize;
use shoal_http_api::code;
use shoal_http_api::types::{
    BulkPutItem, EventsView, KeyError, KeyList, KeyResult, MapView, NodeFailure, Page, Removed,
};
use shoal_raft::NodeId;
use tokio::sync::watch;
use tokio::time::Instant;

pub use error::{error_chain, ClientError};
pub use routes::Routes;
pub use shoal_http_api::types::{BulkPutItem as PutItem, FoundKey, Priority, PutOk, ReadFrom};

/// The default request timeout: how long an operation may take in all, retries, queueing and
/// the grace window included.
pub const DEFAULT_REQUEST_TIMEOUT: Duration = Duration::from_secs(90);

/// The grace window's share of the request timeout.
pub const GRACE_SHARE: f64 = 0.6;

/// How often a lost node is tried again during its grace window.
const RECONNECT_EVERY: Duration = Duration::from_millis(200);

/// How often a node whose grace window ended is tried again (until a new map).
const DOWN_PROBE_EVERY: Duration = Duration::from_secs(2);

/// Less of the owner's window than this left: no use forwarding, wait in its queue.
const WINDOW_FLOOR: Duration = Duration::from_millis(100);

/// How long the map watch waits at a node for a newer map before asking again.
const WATCH_ROUND: Duration = Duration::from_secs(30);

/// How a [`Client`] behaves; [`Client::builder`] starts from the defaults.
#[derive(Debug, Clone)]
pub struct ClientBuilder {
    seeds: Vec<String>,
    request_timeout: Duration,
    grace_window: Option<Duration>,
    connect_timeout: Duration,
    read_attempt_timeout: Duration,
    admin_token: Option<String>,
    client_token: Option<String>,
    watch: bool,
    tls_ca: Option<Vec<u8>>,
}

impl ClientBuilder {
    /// The time an operation may take in all (default 90 s).
    pub fn request_timeout(mut self, timeout: Duration) -> Self {
        self.request_timeout = timeout;
        self
    }

    /// How long operations for a lost node wait for it to come back (default 60% of the
    /// request timeout).
    pub fn grace_window(mut self, window: Duration) -> Self {
        self.grace_window = Some(window);
        self
    }

    /// How long a TCP connection may take to open (default 2 s).
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }

    /// How long a read waits for one node's answer before trying another way (default 5 s).
    /// Writes wait for the answer for the whole request timeout instead.
    pub fn read_attempt_timeout(mut self, timeout: Duration) -> Self {
        self.read_attempt_timeout = timeout;
        self
    }

    /// The admin token, for the cluster operations that need one.
    pub fn admin_token(mut self, token: impl Into<String>) -> Self {
        self.admin_token = Some(token.into());
        self
    }

    /// The client token, for the key operations of a cluster whose nodes run with
    /// `--client-token`.
    pub fn client_token(mut self, token: impl Into<String>) -> Self {
        self.client_token = Some(token.into());
        self
    }

    /// Speak HTTPS to every node, trusting only the CA certificates of this PEM text (what
    /// nodes run with as `--tls-ca`). A seed given as `https://host:port` asks for HTTPS too;
    /// without a CA it then trusts the usual public CAs.
    pub fn tls_ca(mut self, pem: impl Into<Vec<u8>>) -> Self {
        self.tls_ca = Some(pem.into());
        self
    }

    /// Whether to follow the map with the map watch (default on). Without it the map is the
    /// one fetched at connect, refreshed only by [`Client::refresh_map`].
    pub fn watch_map(mut self, watch: bool) -> Self {
        self.watch = watch;
        self
    }

    /// Connects: fetches the map from the first seed that answers.
    pub async fn connect(mut self) -> Result<Client, ClientError> {
        let mut https = self.tls_ca.is_some();
        for seed in &mut self.seeds {
            if let Some(rest) = seed.strip_prefix("https://") {
                https = true;
                *seed = rest.trim_end_matches('/').to_string();
            } else if let Some(rest) = seed.strip_prefix("http://") {
                *seed = rest.trim_end_matches('/').to_string();
            }
        }
        let mut http = reqwest::Client::builder()
            .no_proxy()
            .connect_timeout(self.connect_timeout)
            .tcp_nodelay(true)
            // Below a node's default header-read timeout (10 s), which closes idle connections.
            .pool_idle_timeout(Duration::from_secs(5));
        if let Some(pem) = &self.tls_ca {
            let bad = |e: String| ClientError::Protocol(format!("the TLS CA: {e}"));
            crate::tls::ca_from_pem(pem).map_err(bad)?;
            let certs = reqwest::Certificate::from_pem_bundle(pem).map_err(|e| bad(e.to_string()))?;
            http = http.tls_built_in_root_certs(false);
            for cert in certs {
                http = http.add_root_certificate(cert);
            }
        }
        let http = http.build().map_err(|e| ClientError::Protocol(format!("building the HTTP client: {e}")))?;
        let grace = self.grace_window.unwrap_or_else(|| self.request_timeout.mul_f64(GRACE_SHARE));
        let (epoch, _) = watch::channel(0u64);
        let inner = Arc::new(Inner {
            http,
            config: Config {
                request_timeout: self.request_timeout,
                grace,
                read_attempt_timeout: self.read_attempt_timeout,
                admin_token: self.admin_token,
                client_token: self.client_token,
                scheme: if https { "https" } else { "http" },
            },
            routes: ArcSwap::from_pointee(Routes::default()),
            links: Mutex::new(HashMap::new()),
            epoch,
            next_other: AtomicUsize::new(0),
            stats: Counters::default(),
            installing: Mutex::new(()),
        });
        let mut last = None;
        for seed in &self.seeds {
            match inner.fetch_map(seed, None).await {
                Ok(map) => {
                    inner.install(map);
                    last = None;
                    break;
                }
                Err(e) => last = Some(e),
            }
        }
        if let Some(e) = last {
            return Err(e);
        }
        if inner.routes.load().version == 0 {
            return Err(ClientError::Protocol("no seed address given".into()));
        }
        let watcher =
            if self.watch { Some(tokio::spawn(follow_map(Arc::downgrade(&inner), self.seeds.clone()))) } else { None };
        Ok(Client { inner, _watcher: Arc::new(Watcher(watcher)) })
    }
}

#[derive(Debug)]
struct Config {
    request_timeout: Duration,
    grace: Duration,
    read_attempt_timeout: Duration,
    admin_token: Option<String>,
    client_token: Option<String>,
    /// `https` or `http`, for every node.
    scheme: &'static str,
}

/// What the client knows of one node's connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Link {
    /// Reachable as far as the client knows.
    Up,
    /// Unreachable: being reconnected until the grace window ends at this instant.
    Lost(Instant),
    /// The grace window ended without it: operations for it fail at once until a new map.
    Down,
}

/// What one operation does, for choosing how to retry it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Read,
    Write,
}

/// How often the client took each way; [`Client::stats`].
#[derive(Debug, Default)]
struct Counters {
    direct: AtomicU64,
    through_other: AtomicU64,
    queued: AtomicU64,
    connection_failures: AtomicU64,
    map_updates: AtomicU64,
}

/// Counts of what a [`Client`] did since it connected.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct ClientStats {
    /// Requests sent straight to the node the map names.
    pub direct: u64,
    /// Requests sent through another node because that one could not be reached.
    pub through_other: u64,
    /// Times an operation waited in a lost node's queue.
    pub queued: u64,
    /// Operations that failed with a connection error.
    pub connection_failures: u64,
    /// New maps received after the first.
    pub map_updates: u64,
}

struct Inner {
    http: reqwest::Client,
    config: Config,
    routes: ArcSwap<Routes>,
    links: Mutex<HashMap<NodeId, Link>>,
    /// Bumped whenever the map changes or a lost node comes back: queued operations look again.
    epoch: watch::Sender<u64>,
    next_other: AtomicUsize,
    stats: Counters,
    installing: Mutex<()>,
}

/// Stops the map watch when the last handle of a client is dropped.
struct Watcher(Option<tokio::task::JoinHandle<()>>);

impl Drop for Watcher {
    fn drop(&mut self) {
        if let Some(task) = self.0.take() {
            task.abort();
        }
    }
}

/// A connected client; cheap to clone (clones share the map and connections).
#[derive(Clone)]
pub struct Client {
    inner: Arc<Inner>,
    _watcher: Arc<Watcher>,
}

/// A value read by [`Client::get`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Value {
    /// The bytes.
    pub bytes: Bytes,
    /// Its version.
    pub version: u64,
    /// Its bucket.
    pub bucket: u16,
    /// The node that answered.
    pub node: NodeId,
}

/// How [`Client::put_with`] writes.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PutOptions {
    /// Expire this long after the write.
    pub ttl: Option<Duration>,
    /// Expire after this long without a read or write.
    pub sliding: Option<Duration>,
    /// Only if the current version is this one (0: only if absent).
    pub cas: Option<u64>,
    /// Only if the key is absent (`Add`) or present (`Replace`).
    pub mode: Option<PutMode>,
    /// Tags, for `tagged` and `remove_tagged`.
    pub tags: Vec<String>,
    /// The eviction priority.
    pub priority: Option<Priority>,
}

/// How [`Client::get_with`] reads.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ReadOptions {
    /// Where the value may come from (default: the node's `--read-from`).
    pub read: Option<ReadFrom>,
    /// With async replication, how far behind its owner a replica copy may be.
    pub max_staleness: Option<Duration>,
}

impl ReadOptions {
    fn query(&self) -> Vec<(&'static str, String)> {
        let mut q = Vec::new();
        match self.read {
            Some(ReadFrom::Mirrors) => q.push(("read", "mirrors".to_string())),
            Some(ReadFrom::Owner) => q.push(("read", "owner".to_string())),
            None => {}
        }
        if let Some(s) = self.max_staleness {
            q.push(("max_staleness", if s.is_zero() { "0".to_string() } else { millis(s) }));
        }
        q
    }
}

/// A conditional write's mode.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PutMode {
    /// Only if the key is absent.
    Add,
    /// Only if the key is present.
    Replace,
}

fn millis(d: Duration) -> String {
    format!("{}ms", d.as_millis().max(1))
}

impl PutOptions {
    fn query(&self) -> Vec<(&'static str, String)> {
        let mut q = Vec::new();
        if let Some(t) = self.ttl {
            q.push(("ttl", millis(t)));
        }
        if let Some(s) = self.sliding {
            q.push(("sliding", millis(s)));
        }
        if let Some(c) = self.cas {
            q.push(("cas", c.to_string()));
        }
        if let Some(m) = self.mode {
            q.push(("mode", if m == PutMode::Add { "add" } else { "replace" }.to_string()));
        }
        if !self.tags.is_empty() {
            q.push(("tags", self.tags.join(",")));
        }
        if let Some(p) = self.priority {
            q.push(("priority", p.name().to_string()));
        }
        q
    }
}

/// One try at one node.
enum Attempt {
    /// The node answered.
    Answer(reqwest::Response),
    /// The request never reached it (the connection could not be made).
    NotSent(String),
    /// The request may have reached it, but no answer came.
    MaybeSent(String),
}

impl Inner {
    /// `scheme://addr`, the base of every URL of the node at `addr`.
    fn base(&self, addr: &str) -> String {
        format!("{}://{addr}", self.config.scheme)
    }

    async fn fetch_map(&self, addr: &str, wait: Option<(u64, Duration)>) -> Result<MapView, ClientError> {
        let mut request = self.http.get(format!("{}/v1/cluster/map", self.base(addr)));
        let timeout = match wait {
            Some((version, round)) => {
                request = request.query(&[("wait_version", version.to_string()), ("timeout", millis(round))]);
                round + Duration::from_secs(10)
            }
            None => Duration::from_secs(10),
        };
        let response = request.timeout(timeout).send().await.map_err(|e| ClientError::connection(None, &e, false))?;
        let response = error::check(response).await?;
        response.json::<MapView>().await.map_err(|e| ClientError::Protocol(format!("the map from {addr}: {e}")))
    }

    /// Takes `map` if it is newer than the one held.
    fn install(&self, map: MapView) {
        // One install at a time: the watch and `refresh_map` never put an older map back.
        let _installing = self.installing.lock();
        let current = self.routes.load();
        if map.version <= current.version {
            return;
        }
        if current.version > 0 {
            self.stats.map_updates.fetch_add(1, Ordering::Relaxed);
        }
        let routes = Routes::from(map);
        {
            // A new map is a fresh start for nodes whose grace window ended; nodes no longer
            // in it are forgotten.
            let mut links = self.links.lock();
            links.retain(|id, _| routes.addr_of(*id).is_some());
            for link in links.values_mut() {
                if *link == Link::Down {
                    *link = Link::Up;
                }
            }
        }
        self.routes.store(Arc::new(routes));
        self.epoch.send_modify(|e| *e += 1);
    }

    fn link(&self, node: NodeId) -> Link {
        match self.links.lock().get(&node).copied() {
            // The window has passed: down, even before the reconnect task says so.
            Some(Link::Lost(until)) if Instant::now() >= until => Link::Down,
            Some(link) => link,
            None => Link::Up,
        }
    }

    /// `node` could not be reached: starts its grace window (once).
    fn lose(self: &Arc<Self>, node: NodeId) {
        let until = Instant::now() + self.config.grace;
        {
            let mut links = self.links.lock();
            let link = links.entry(node).or_insert(Link::Up);
            if *link != Link::Up {
                return;
            }
            *link = Link::Lost(until);
        }
        tracing::debug!(node, "node unreachable: reconnecting during the grace window");
        tokio::spawn(reconnect(Arc::downgrade(self), node, until));
    }

    fn set_link(&self, node: NodeId, link: Link) {
        self.links.lock().insert(node, link);
        self.epoch.send_modify(|e| *e += 1);
    }

    /// A member other than `not`, reachable as far as the client knows, taken in turn.
    fn other_node(&self, routes: &Routes, not: NodeId) -> Option<NodeId> {
        let links = self.links.lock();
        let candidates: Vec<NodeId> = routes
            .node_ids()
            .filter(|&id| id != not && links.get(&id).copied().unwrap_or(Link::Up) == Link::Up)
            .collect();
        if candidates.is_empty() {
            return None;
        }
        Some(candidates[self.next_other.fetch_add(1, Ordering::Relaxed) % candidates.len()])
    }

    /// Sends one request to `addr`, waiting for the answer at most `timeout` (and never past
    /// `deadline`); `build` makes it from the node's base URL (`scheme://host:port`).
    async fn attempt(
        &self,
        addr: &str,
        build: &(dyn Fn(&reqwest::Client, &str) -> reqwest::RequestBuilder + Send + Sync),
        deadline: Instant,
        timeout: Duration,
    ) -> Attempt {
        let timeout = deadline.saturating_duration_since(Instant::now()).min(timeout);
        let request = build(&self.http, &self.base(addr)).timeout(timeout.max(Duration::from_millis(1)));
        let mut request = match request.build() {
            Ok(r) => r,
            Err(e) => return Attempt::NotSent(e.to_string()),
        };
        let (client, admin) = (self.config.client_token.as_deref(), self.config.admin_token.as_deref());
        let token = shoal_http_api::token_for(request.url().path(), client, admin);
        if let Some(value) = token.and_then(|t| reqwest::header::HeaderValue::from_str(&format!("Bearer {t}")).ok()) {
            request.headers_mut().insert(reqwest::header::AUTHORIZATION, value);
        }
        match self.http.execute(request).await {
            Ok(response) => Attempt::Answer(response),
            Err(e) if e.is_connect() => Attempt::NotSent(e.to_string()),
            Err(e) => Attempt::MaybeSent(e.to_string()),
        }
    }

    /// Runs one operation for the node `route` names in the current map, with the retries,
    /// the forwarding and the queueing described in the module docs.
    async fn execute(
        self: &Arc<Self>,
        kind: Kind,
        route: &(dyn Fn(&Routes) -> Option<NodeId> + Send + Sync),
        build: &(dyn Fn(&reqwest::Client, &str) -> reqwest::RequestBuilder + Send + Sync),
    ) -> Result<reqwest::Response, ClientError> {
        let deadline = Instant::now() + self.config.request_timeout;
        let mut epoch = self.epoch.subscribe();
        let mut backoff = Duration::from_millis(50);
        let mut last_unavailable = None;
        loop {
            if Instant::now() >= deadline {
                return Err(last_unavailable.unwrap_or(ClientError::Timeout { maybe_applied: false }));
            }
            epoch.borrow_and_update();
            let routes = self.routes.load_full();
            let target = route(&routes).ok_or_else(|| ClientError::Protocol("the map names no owner".into()))?;
            let (node, via_other, attempt) = self.attempt_for(kind, &routes, target, build, deadline).await;
            match attempt {
                Attempt::Answer(response) if response.status() == StatusCode::SERVICE_UNAVAILABLE => {
                    // Not applied (`outcome_unknown`: maybe, and writing again is what the
                    // node asks); the node says when to retry (an election, a move, a
                    // failover, or a forward to an owner it cannot reach either).
                    let retry = error::retry_after(&response);
                    last_unavailable = Some(error::problem(response).await);
                    if via_other {
                        self.wait_for(target, &mut epoch, deadline).await?;
                        continue;
                    }
                    let pause = retry.unwrap_or(backoff).min(backoff);
                    backoff = (backoff * 2).min(Duration::from_secs(1));
                    let wake = (Instant::now() + pause).min(deadline);
                    tokio::select! {
                        _ = epoch.changed() => {}
                        _ = tokio::time::sleep_until(wake) => {}
                    }
                }
                Attempt::Answer(response) => return Ok(response),
                Attempt::MaybeSent(detail) if kind == Kind::Write => {
                    if !via_other {
                        self.lose(node);
                    }
                    self.stats.connection_failures.fetch_add(1, Ordering::Relaxed);
                    return Err(ClientError::Connection { node: Some(node), detail, maybe_applied: true });
                }
                Attempt::NotSent(detail) => {
                    tracing::debug!(node, detail, "cannot connect");
                    self.lose(node);
                    // The owner (or the forwarder) is lost now: go round it (through the next
                    // other node), or wait in its queue when there is none.
                    if node != target || !via_other {
                        continue;
                    }
                    self.wait_for(target, &mut epoch, deadline).await?;
                }
                Attempt::MaybeSent(detail) => {
                    tracing::debug!(node, detail, "no answer");
                    // A forwarder that ran out of the owner's window is not lost itself.
                    if !via_other {
                        self.lose(node);
                        continue;
                    }
                    self.wait_for(target, &mut epoch, deadline).await?;
                }
            }
        }
    }

    /// One attempt of an operation for `target`: at it while the client reaches it, else
    /// through another node for what is left of its grace window. The node asked, whether it
    /// was another one, and what came of it.
    async fn attempt_for(
        &self,
        kind: Kind,
        routes: &Routes,
        target: NodeId,
        build: &(dyn Fn(&reqwest::Client, &str) -> reqwest::RequestBuilder + Send + Sync),
        deadline: Instant,
    ) -> (NodeId, bool, Attempt) {
        let link = self.link(target);
        if link == Link::Up {
            self.stats.direct.fetch_add(1, Ordering::Relaxed);
            let timeout = match kind {
                Kind::Read => self.config.read_attempt_timeout,
                Kind::Write => self.config.request_timeout,
            };
            let addr = routes.addr_of(target).unwrap_or_default().to_string();
            return (target, false, self.attempt(&addr, build, deadline, timeout).await);
        }
        let Some(other) = self.other_node(routes, target).filter(|_| self.window_left(link)) else {
            return (target, true, Attempt::NotSent("no other node is reachable".into()));
        };
        // The owner is lost: another node forwards the operation, for at most what is left of
        // the owner's grace window (the forwarder may wait on it too).
        self.stats.through_other.fetch_add(1, Ordering::Relaxed);
        let other_addr = routes.addr_of(other).unwrap_or_default().to_string();
        let window = match link {
            Link::Lost(until) => until.saturating_duration_since(Instant::now()),
            _ => self.config.request_timeout,
        };
        (other, true, self.attempt(&other_addr, build, deadline, window).await)
    }

    /// Runs an operation at `node` itself, never through another node (a keyless request's
    /// part, which only that node can answer): a node the client cannot reach is an error.
    async fn at_node(
        self: &Arc<Self>,
        node: NodeId,
        kind: Kind,
        build: &(dyn Fn(&reqwest::Client, &str) -> reqwest::RequestBuilder + Send + Sync),
    ) -> Result<reqwest::Response, ClientError> {
        let unreachable =
            |detail: String, maybe_applied| ClientError::Connection { node: Some(node), detail, maybe_applied };
        if self.link(node) != Link::Up {
            return Err(unreachable(format!("node {node} is unreachable; its part is missing"), false));
        }
        let routes = self.routes.load_full();
        let addr = routes.addr_of(node).unwrap_or_default().to_string();
        let deadline = Instant::now() + self.config.request_timeout;
        let timeout = match kind {
            Kind::Read => self.config.read_attempt_timeout,
            Kind::Write => self.config.request_timeout,
        };
        self.stats.direct.fetch_add(1, Ordering::Relaxed);
        match self.attempt(&addr, build, deadline, timeout).await {
            Attempt::Answer(response) => Ok(response),
            Attempt::NotSent(detail) => {
                self.lose(node);
                Err(unreachable(detail, false))
            }
            Attempt::MaybeSent(detail) => {
                self.lose(node);
                Err(unreachable(detail, kind == Kind::Write))
            }
        }
    }

    /// Whether enough of a lost owner's window is left to try another node.
    fn window_left(&self, link: Link) -> bool {
        match link {
            Link::Lost(until) => until.saturating_duration_since(Instant::now()) >= WINDOW_FLOOR,
            _ => true,
        }
    }

    /// The owner is lost and no other node got the operation through: waits in its queue,
    /// or fails at once when its grace window has already ended.
    async fn wait_for(
        &self,
        target: NodeId,
        epoch: &mut watch::Receiver<u64>,
        deadline: Instant,
    ) -> Result<(), ClientError> {
        if self.link(target) == Link::Down {
            self.stats.connection_failures.fetch_add(1, Ordering::Relaxed);
            return Err(ClientError::Connection {
                node: Some(target),
                detail: format!("node {target} stayed unreachable through its grace window; waiting for a new map"),
                maybe_applied: false,
            });
        }
        self.queue(target, epoch, deadline).await
    }

    /// Waits in `target`'s queue: until it comes back, a new map arrives, or its grace window
    /// ends (then the operation fails with a connection error).
    async fn queue(
        &self,
        target: NodeId,
        epoch: &mut watch::Receiver<u64>,
        deadline: Instant,
    ) -> Result<(), ClientError> {
        let Link::Lost(until) = self.link(target) else { return Ok(()) };
        self.stats.queued.fetch_add(1, Ordering::Relaxed);
        tokio::select! {
            _ = epoch.changed() => return Ok(()),
            _ = tokio::time::sleep_until(until.min(deadline)) => {}
        }
        if Instant::now() >= deadline && until > deadline {
            return Err(ClientError::Timeout { maybe_applied: false });
        }
        self.stats.connection_failures.fetch_add(1, Ordering::Relaxed);
        Err(ClientError::Connection {
            node: Some(target),
            detail: format!("node {target} did not come back within the grace window"),
            maybe_applied: false,
        })
    }
}

/// Tries `node` every [`RECONNECT_EVERY`] until it answers or `until` passes (then it is
/// down), and after that every [`DOWN_PROBE_EVERY`], until it answers, a new map names it
/// afresh, or it leaves the map.
async fn reconnect(inner: std::sync::Weak<Inner>, node: NodeId, until: Instant) {
    loop {
        let Some(client) = inner.upgrade() else { return };
        let Some(addr) = client.routes.load().addr_of(node).map(str::to_string) else {
            client.links.lock().remove(&node);
            return;
        };
        if client.links.lock().get(&node).is_none_or(|l| *l == Link::Up) {
            // A new map gave it a fresh start; a new loss starts a new task.
            return;
        }
        let probe = client
            .http
            .get(format!("{}/livez", client.base(&addr)))
            .timeout(RECONNECT_EVERY.max(Duration::from_secs(1)));
        if probe.send().await.is_ok_and(|r| r.status().is_success()) {
            tracing::debug!(node, "node reachable again");
            client.set_link(node, Link::Up);
            return;
        }
        let pause = if Instant::now() >= until {
            if client.links.lock().get(&node).is_some_and(|l| matches!(l, Link::Lost(_))) {
                client.set_link(node, Link::Down);
            }
            DOWN_PROBE_EVERY
        } else {
            RECONNECT_EVERY
        };
        drop(client);
        tokio::time::sleep(pause).await;
    }
}

/// The map watch: asks a reachable node for a map newer than the one held, for ever.
async fn follow_map(inner: std::sync::Weak<Inner>, seeds: Vec<String>) {
    let mut turn = 0usize;
    loop {
        let Some(client) = inner.upgrade() else { return };
        let routes = client.routes.load_full();
        let mut addrs: Vec<String> = routes.addrs().map(str::to_string).collect();
        addrs.extend(seeds.iter().cloned());
        let addr = addrs[turn % addrs.len()].clone();
        match client.fetch_map(&addr, Some((routes.version, WATCH_ROUND))).await {
            Ok(map) if map.version > routes.version => client.install(map),
            // A round with nothing new: ask another node next, so that a node cut off from
            // the cluster (answering its old map) cannot keep the client on it.
            Ok(_) => turn += 1,
            Err(e) => {
                tracing::debug!(addr, error = %e, "map watch: trying another node");
                turn += 1;
                drop(client);
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
        }
    }
}

/// The URL of a path made of `segments` (each escaped) at `base` (`scheme://host:port`).
fn path_url(base: &str, segments: &[&str]) -> reqwest::Url {
    let mut url = reqwest::Url::parse(&format!("{base}/")).unwrap_or_else(|_| {
        reqwest::Url::parse("http://invalid.invalid/").unwrap_or_else(|_| unreachable!("a constant URL"))
    });
    if let Ok(mut path) = url.path_segments_mut() {
        path.clear().extend(segments);
    }
    url
}

impl Client {
    /// Connects with the default settings to the first of `seeds` (API addresses,
    /// `host:port`) that answers.
    pub async fn connect<I, S>(seeds: I) -> Result<Client, ClientError>
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        Client::builder(seeds).connect().await
    }

    /// A builder with the default settings, to connect to `seeds`.
    pub fn builder<I, S>(seeds: I) -> ClientBuilder
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        ClientBuilder {
            seeds: seeds.into_iter().map(Into::into).collect(),
            request_timeout: DEFAULT_REQUEST_TIMEOUT,
            grace_window: None,
            connect_timeout: Duration::from_secs(2),
            read_attempt_timeout: Duration::from_secs(5),
            admin_token: None,
            client_token: None,
            watch: true,
            tls_ca: None,
        }
    }

    /// The map the client routes by.
    pub fn routes(&self) -> Arc<Routes> {
        self.inner.routes.load_full()
    }

    /// What the client did since it connected.
    pub fn stats(&self) -> ClientStats {
        let s = &self.inner.stats;
        ClientStats {
            direct: s.direct.load(Ordering::Relaxed),
            through_other: s.through_other.load(Ordering::Relaxed),
            queued: s.queued.load(Ordering::Relaxed),
            connection_failures: s.connection_failures.load(Ordering::Relaxed),
            map_updates: s.map_updates.load(Ordering::Relaxed),
        }
    }

    /// Fetches the map now from any node (the watch does this by itself).
    pub async fn refresh_map(&self) -> Result<u64, ClientError> {
        let routes = self.routes();
        let mut last = ClientError::Protocol("the map names no node".into());
        for addr in routes.addrs() {
            match self.inner.fetch_map(addr, None).await {
                Ok(map) => {
                    self.inner.install(map);
                    return Ok(self.routes().version);
                }
                Err(e) => last = e,
            }
        }
        Err(last)
    }

    async fn key_op(
        &self,
        kind: Kind,
        key: &str,
        build: impl Fn(&reqwest::Client, &str) -> reqwest::RequestBuilder + Send + Sync,
    ) -> Result<reqwest::Response, ClientError> {
        let bucket = shoal_raft::bucket_of(key.as_bytes());
        self.inner.execute(kind, &move |r: &Routes| r.owner_of(bucket), &build).await
    }

    /// The value of `key`, or `None` if it has none.
    pub async fn get(&self, key: &str) -> Result<Option<Value>, ClientError> {
        self.get_with(key, &ReadOptions::default()).await
    }

    /// The value of `key` read as `options` allow: from its owner, or from either of its
    /// mirrors (the owner, or the holder of its replica when that copy is fresh enough; the
    /// owner's node picks by its `--ha-strategy`).
    pub async fn get_with(&self, key: &str, options: &ReadOptions) -> Result<Option<Value>, ClientError> {
        let query = options.query();
        let response = self
            .key_op(Kind::Read, key, |http, addr| http.get(path_url(addr, &["v1", "kv", key])).query(&query))
            .await?;
        if response.status() == StatusCode::NOT_FOUND {
            let problem = error::problem(response).await;
            return match problem.code() {
                Some(code::NOT_FOUND) => Ok(None),
                _ => Err(problem),
            };
        }
        let response = error::check(response).await?;
        let header = |name: &str| response.headers().get(name).and_then(|v| v.to_str().ok()).map(str::to_string);
        let version = header("etag").and_then(|v| v.trim_matches('"').parse().ok()).unwrap_or(0);
        let bucket = header("x-shoal-bucket").and_then(|v| v.parse().ok()).unwrap_or(0);
        let node = header("x-shoal-node").and_then(|v| v.parse().ok()).unwrap_or(0);
        let bytes = response.bytes().await.map_err(|e| ClientError::connection(None, &e, false))?;
        Ok(Some(Value { bytes, version, bucket, node }))
    }

    /// Writes `value` under `key`.
    pub async fn put(&self, key: &str, value: impl Into<Bytes>) -> Result<PutOk, ClientError> {
        self.put_with(key, value, &PutOptions::default()).await
    }

    /// Writes `value` under `key` with `options` (expiry, condition, tags, priority).
    pub async fn put_with(
        &self,
        key: &str,
        value: impl Into<Bytes>,
        options: &PutOptions,
    ) -> Result<PutOk, ClientError> {
        let value: Bytes = value.into();
        let query = options.query();
        let response = self
            .key_op(Kind::Write, key, |http, addr| {
                http.put(path_url(addr, &["v1", "kv", key])).query(&query).body(value.clone())
            })
            .await?;
        let response = error::check(response).await?;
        response.json::<PutOk>().await.map_err(|e| ClientError::Protocol(format!("a put's answer: {e}")))
    }

    /// Deletes `key`; `false` if it had no value.
    pub async fn delete(&self, key: &str) -> Result<bool, ClientError> {
        let response =
            self.key_op(Kind::Write, key, |http, addr| http.delete(path_url(addr, &["v1", "kv", key]))).await?;
        if response.status() == StatusCode::NOT_FOUND {
            let problem = error::problem(response).await;
            return match problem.code() {
                Some(code::NOT_FOUND) => Ok(false),
                _ => Err(problem),
            };
        }
        error::check(response).await.map(|_| true)
    }

    /// Runs a bulk operation: the keys are split by owner, each owner's share is sent to it
    /// at once, and the answers come back in the order of `keys`. A share that fails as a
    /// whole gives each of its keys that error.
    async fn bulk<T: Serialize + Sync>(
        &self,
        kind: Kind,
        path: &'static str,
        keys: &[&str],
        body: impl Fn(&[usize]) -> T + Sync,
    ) -> Vec<KeyResult> {
        let routes = self.routes();
        let mut shares: HashMap<NodeId, Vec<usize>> = HashMap::new();
        for (i, key) in keys.iter().enumerate() {
            let owner = routes.owner_of(shoal_raft::bucket_of(key.as_bytes())).unwrap_or(0);
            shares.entry(owner).or_default().push(i);
        }
        let calls = shares.into_values().map(|indices| {
            let body = body(&indices);
            let first = shoal_raft::bucket_of(keys[indices[0]].as_bytes());
            async move {
                let answer = self
                    .inner
                    .execute(kind, &move |r: &Routes| r.owner_of(first), &|http, addr| {
                        http.post(format!("{addr}{path}")).json(&body)
                    })
                    .await;
                let results = match answer {
                    Ok(response) => match error::check(response).await {
                        Ok(r) => r
                            .json::<shoal_http_api::types::BulkResults>()
                            .await
                            .map(|b| b.results)
                            .map_err(|e| ClientError::Protocol(format!("a bulk answer: {e}"))),
                        Err(e) => Err(e),
                    },
                    Err(e) => Err(e),
                };
                (indices, results)
            }
        });
        let mut out: Vec<Option<KeyResult>> = vec![None; keys.len()];
        for (indices, results) in join_all(calls).await {
            match results {
                Ok(results) if results.len() == indices.len() => {
                    for (i, r) in indices.into_iter().zip(results) {
                        out[i] = Some(r);
                    }
                }
                other => {
                    let e = other
                        .err()
                        .unwrap_or_else(|| ClientError::Protocol("a bulk answer of the wrong length".into()));
                    for i in indices {
                        out[i] = Some(error_result(keys[i], &e));
                    }
                }
            }
        }
        out.into_iter()
            .enumerate()
            .map(|(i, r)| r.unwrap_or_else(|| error_result(keys[i], &ClientError::Protocol("no answer".into()))))
            .collect()
    }

    /// The values of `keys`, in their order (per key: found or not, or its error).
    pub async fn get_many(&self, keys: &[&str]) -> Vec<KeyResult> {
        self.bulk(
            Kind::Read,
            "/v1/bulk/get",
            keys,
            |indices| serde_json::json!({ "keys": indices.iter().map(|&i| keys[i]).collect::<Vec<_>>() }),
        )
        .await
    }

    /// Writes every item (per item: its new version, or its error), in their order.
    pub async fn put_many(&self, items: &[BulkPutItem]) -> Vec<KeyResult> {
        let keys: Vec<&str> = items.iter().map(|i| i.key.as_str()).collect();
        self.bulk(
            Kind::Write,
            "/v1/bulk/put",
            &keys,
            |indices| serde_json::json!({ "items": indices.iter().map(|&i| &items[i]).collect::<Vec<_>>() }),
        )
        .await
    }

    /// Deletes every key (per key: whether it had a value, or its error), in their order.
    pub async fn delete_many(&self, keys: &[&str]) -> Vec<KeyResult> {
        self.bulk(
            Kind::Write,
            "/v1/bulk/delete",
            keys,
            |indices| serde_json::json!({ "keys": indices.iter().map(|&i| keys[i]).collect::<Vec<_>>() }),
        )
        .await
    }

    /// Asks every member for its own part (`x-shoal-scope: local`) at once.
    async fn broadcast(
        &self,
        method: Method,
        segments: &[&str],
        query: &[(&str, String)],
    ) -> Vec<(NodeId, Result<reqwest::Response, ClientError>)> {
        let routes = self.routes();
        let calls = routes.node_ids().map(|node| {
            let method = method.clone();
            let kind = if method == Method::GET { Kind::Read } else { Kind::Write };
            async move {
                let answer = self
                    .inner
                    .at_node(node, kind, &|http, addr| {
                        http.request(method.clone(), path_url(addr, segments))
                            .query(query)
                            .header("x-shoal-scope", "local")
                    })
                    .await;
                let answer = match answer {
                    Ok(r) => error::check(r).await,
                    Err(e) => Err(e),
                };
                (node, answer)
            }
        });
        join_all(calls).await
    }

    /// The `page` of keys every member lists under `segments` with `query` (each is asked for
    /// one more key than the page holds, so that `more` is exact).
    async fn list(&self, segments: &[&str], query: &[(&str, String)], page: &Page) -> KeyList {
        let ask = page.with_one_more();
        let mut query = query.to_vec();
        query.push(("limit", ask.limit.to_string()));
        query.extend(ask.start_after.map(|s| ("start_after", s)));
        let mut list = KeyList::default();
        let mut keys = Vec::new();
        for (node, answer) in self.broadcast(Method::GET, segments, &query).await {
            let part = match answer {
                Ok(r) => r.json::<KeyList>().await.map_err(|e| ClientError::Protocol(e.to_string())),
                Err(e) => Err(e),
            };
            match part {
                Ok(part) => {
                    keys.extend(part.keys);
                    list.incomplete |= part.incomplete;
                    list.errors.extend(part.errors);
                }
                Err(e) => list.errors.push(NodeFailure { node, detail: e.to_string() }),
            }
        }
        (list.keys, list.more, list.next) = page.cut(keys);
        list.incomplete |= !list.errors.is_empty();
        list
    }

    /// The keys starting with `prefix`, sorted, the `page` of them (`Page::first(100)`, then
    /// `start_after` the answer's `next` while it says `more`), from every member.
    pub async fn keys(&self, prefix: &str, page: &Page) -> KeyList {
        self.list(&["v1", "kv"], &[("prefix", prefix.to_string())], page).await
    }

    /// The keys tagged `tag`, sorted, the `page` of them, from every member.
    pub async fn tagged(&self, tag: &str, page: &Page) -> KeyList {
        self.list(&["v1", "tags", tag], &[], page).await
    }

    /// Removes every item tagged `tag`, at every member.
    pub async fn remove_tagged(&self, tag: &str) -> Removed {
        let mut removed = Removed::default();
        for (node, answer) in self.broadcast(Method::DELETE, &["v1", "tags", tag], &[]).await {
            let part = match answer {
                Ok(r) => r.json::<Removed>().await.map_err(|e| ClientError::Protocol(e.to_string())),
                Err(e) => Err(e),
            };
            match part {
                Ok(part) => {
                    removed.removed += part.removed;
                    removed.errors.extend(part.errors);
                }
                Err(e) => removed.errors.push(NodeFailure { node, detail: e.to_string() }),
            }
        }
        removed.incomplete = !removed.errors.is_empty();
        removed
    }

    /// The cluster's events after Raft index `since` (at most `limit`), from any member.
    pub async fn events(&self, since: u64, limit: usize) -> Result<EventsView, ClientError> {
        let query = [("since", since.to_string()), ("limit", limit.to_string())];
        let any = |r: &Routes| r.node_ids().next();
        let response = self
            .inner
            .execute(Kind::Read, &any, &|http, addr| http.get(format!("{addr}/v1/cluster/events")).query(&query))
            .await?;
        let response = error::check(response).await?;
        response.json().await.map_err(|e| ClientError::Protocol(format!("the events: {e}")))
    }
}

fn error_result(key: &str, e: &ClientError) -> KeyResult {
    KeyResult {
        key: key.to_string(),
        found: None,
        value: None,
        value_base64: None,
        version: None,
        deleted: None,
        bucket: shoal_raft::bucket_of(key.as_bytes()).0,
        error: Some(KeyError {
            code: e.code().unwrap_or("connection").to_string(),
            detail: e.to_string(),
            status: e.status().unwrap_or(0),
            retry_after: None,
            current_version: None,
            map_version: None,
        }),
    }
}

#[cfg(test)]
mod tests;
