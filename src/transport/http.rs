//! [`HttpTransport`]: node-to-node messages over HTTP/1.1.
//!
//! One hyper-util client (its pool keeps idle keep-alive connections per peer, TCP_NODELAY)
//! for every short call, and one for bucket streams. Every connection either opens (Raft's
//! RPCs, forwards, replica writes, pings, links, bucket streams) follows the reconnect policy
//! ([`Reconnect`]: `--reconnect-timeout` to connect, then two more attempts two seconds
//! apart), in the connector itself, so no caller retries on its own. Both send from the node's
//! own address when it set one (a node on its
//! own loopback address, so firewall rules can tell nodes apart). Requests to a peer listener
//! carry the cluster secret; forwarded key operations go to the owner's public API, which
//! never sees the secret. A node with TLS speaks HTTPS to every peer (one scheme for every URL it
//! builds), verifying it against `--tls-ca`.

use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures::StreamExt;
use http_body_util::{BodyExt, BodyStream, Full};
use hyper::header::{HeaderMap, HeaderName, HeaderValue, CONNECTION, CONTENT_TYPE, UPGRADE};
use hyper::{Method, Request, StatusCode, Uri};
use hyper_rustls::{HttpsConnector, HttpsConnectorBuilder};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use serde::de::DeserializeOwned;
use shoal_http_api::types::ClusterView;
use shoal_http_api::{ApiError, Problem, Unavailable};
use shoal_raft::{BoxFuture, ControlRpc, ControlTransport, NodeId, TransportError};

use super::link::{self, LinkError, Links, OpenError};
use super::{wire, Addrs, CallError, FrameStream, Outgoing, StreamRequest, Transport};

/// The header that carries the cluster secret on every request to a peer listener.
pub const SECRET_HEADER: HeaderName = HeaderName::from_static("x-shoal-cluster-secret");
/// The header naming the Raft node a Raft message is meant for.
pub const HEADER_RAFT_TARGET: HeaderName = HeaderName::from_static("x-shoal-raft-target");
/// The media type of bucket streams and replication bodies.
pub const TRANSFER_MEDIA_TYPE: &str = "application/vnd.shoal.transfer";

/// How long a forwarded request may take before the caller gets `owner_unreachable`; the
/// owner refuses it once this has passed (the deadline a forward carries on the link).
pub const FORWARD_TIMEOUT: Duration = Duration::from_secs(10);
/// How a node connects to another: each attempt may take `timeout`; one that fails is
/// followed by `attempts` more, `pause` apart (the seed's socket reconnect policy).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Reconnect {
    /// How long one connect attempt may take (`--reconnect-timeout`, 5–30 s).
    pub timeout: Duration,
    /// Attempts after the first fails.
    pub attempts: u32,
    /// The pause before each of them.
    pub pause: Duration,
}

impl Reconnect {
    /// The policy with a connect timeout of `timeout`: 2 more attempts, 2 s apart.
    pub fn with_timeout(timeout: Duration) -> Self {
        Reconnect { timeout, attempts: 2, pause: Duration::from_secs(2) }
    }

    /// The longest connecting may take, every attempt and pause included.
    pub fn total(&self) -> Duration {
        self.timeout * (1 + self.attempts) + self.pause * self.attempts
    }
}

impl Default for Reconnect {
    fn default() -> Self {
        Reconnect::with_timeout(Duration::from_secs(10))
    }
}

/// A connector that connects as [`Reconnect`] says: an attempt that fails (refused, timed
/// out) is made again after the pause, up to the policy's count.
#[derive(Clone)]
struct Reconnecting {
    inner: HttpConnector,
    policy: Reconnect,
}

impl tower::Service<Uri> for Reconnecting {
    type Response = <HttpConnector as tower::Service<Uri>>::Response;
    type Error = <HttpConnector as tower::Service<Uri>>::Error;
    type Future = std::pin::Pin<Box<dyn std::future::Future<Output = Result<Self::Response, Self::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut std::task::Context<'_>) -> std::task::Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, uri: Uri) -> Self::Future {
        let (mut inner, policy) = (self.inner.clone(), self.policy);
        Box::pin(async move {
            let mut attempt = 0;
            loop {
                match tower::ServiceExt::oneshot(&mut inner, uri.clone()).await {
                    Ok(io) => return Ok(io),
                    Err(e) if attempt < policy.attempts => {
                        attempt += 1;
                        tracing::debug!(%uri, error = %e, attempt, "cannot connect to the peer; trying again");
                        tokio::time::sleep(policy.pause).await;
                    }
                    Err(e) => return Err(e),
                }
            }
        })
    }
}

type HttpClient = Client<HttpsConnector<Reconnecting>, Full<Bytes>>;

/// The production transport (see the module docs).
pub struct HttpTransport {
    calls: HttpClient,
    streams: HttpClient,
    /// How connections open.
    reconnect: Reconnect,
    /// `https` when the node has TLS (every peer has it too), else `http`.
    scheme: &'static str,
    secret: Option<HeaderValue>,
    /// Long-lived connections to peer listeners for replica writes and forwarded reads
    /// (`transport::link`).
    links: Links,
}

/// An answer: status, headers, whole body.
struct Answer {
    status: StatusCode,
    headers: HeaderMap,
    body: Bytes,
}

fn client(local_ip: Option<IpAddr>, policy: Reconnect, tls: &Arc<rustls::ClientConfig>) -> HttpClient {
    let mut connector = HttpConnector::new();
    connector.set_local_address(local_ip);
    connector.set_nodelay(true);
    connector.set_connect_timeout(Some(policy.timeout));
    // `http://` addresses go as they are; `https://` ones (a node with TLS) verify the peer
    // against the configured CA.
    connector.enforce_http(false);
    let connector = HttpsConnectorBuilder::new()
        .with_tls_config((**tls).clone())
        .https_or_http()
        .enable_http1()
        .wrap_connector(Reconnecting { inner: connector, policy });
    Client::builder(TokioExecutor::new())
        .pool_timer(TokioTimer::new())
        .pool_max_idle_per_host(64)
        // Below the API port's default header-read timeout (10 s), which closes idle
        // connections: one given up here first is never picked as the server closes it.
        .pool_idle_timeout(Duration::from_secs(5))
        .build(connector)
}

impl HttpTransport {
    /// A transport sending from `local_ip` (when set), carrying `secret` to peer listeners,
    /// connecting as `reconnect` says; over HTTPS, verifying peers as `tls` says, when given.
    pub fn new(
        local_ip: Option<IpAddr>,
        secret: Option<&str>,
        reconnect: Reconnect,
        tls: Option<Arc<rustls::ClientConfig>>,
    ) -> Self {
        let scheme = if tls.is_some() { "https" } else { "http" };
        // Without TLS the connector is never asked for a TLS connection (every address is
        // `http://`); it still wants a configuration, one that trusts nothing.
        let tls = match tls {
            Some(tls) => tls,
            None => crate::tls::client_config(&[]).unwrap_or_else(|e| unreachable!("an empty trust store: {e}")),
        };
        let sensitive = |text: &str| {
            HeaderValue::from_str(text).ok().map(|mut v| {
                v.set_sensitive(true);
                v
            })
        };
        HttpTransport {
            calls: client(local_ip, reconnect, &tls),
            streams: client(local_ip, reconnect, &tls),
            reconnect,
            scheme,
            secret: secret.and_then(sensitive),
            links: Links::default(),
        }
    }

    /// The URL of `path` at `addr` (`host:port`).
    fn url(&self, addr: &str, path: &str) -> String {
        format!("{}://{addr}{path}", self.scheme)
    }

    fn builder(&self, method: Method, uri: String, peer: bool) -> Result<hyper::http::request::Builder, CallError> {
        let uri: Uri = uri.parse().map_err(|e| CallError::Unreachable(format!("bad address: {e}")))?;
        let mut builder = Request::builder().method(method).uri(uri);
        if let (true, Some(secret)) = (peer, &self.secret) {
            builder = builder.header(SECRET_HEADER, secret.clone());
        }
        Ok(builder)
    }

    /// Sends a request and reads the whole answer.
    async fn exchange(&self, request: Request<Full<Bytes>>, timeout: Duration) -> Result<Answer, CallError> {
        let exchange = async {
            let response = self.calls.request(request).await.map_err(|e| transport_error(&e))?;
            let (parts, body) = response.into_parts();
            let body = body.collect().await.map_err(|e| CallError::Broken(e.to_string()))?.to_bytes();
            Ok(Answer { status: parts.status, headers: parts.headers, body })
        };
        tokio::time::timeout(timeout, exchange).await.map_err(|_| CallError::Timeout)?
    }

    /// A request to a peer listener.
    async fn peer(
        &self,
        method: Method,
        uri: String,
        headers: &[(HeaderName, HeaderValue)],
        body: Bytes,
        timeout: Duration,
    ) -> Result<Answer, CallError> {
        let mut builder = self.builder(method, uri, true)?;
        for (name, value) in headers {
            builder = builder.header(name, value);
        }
        let request = builder.body(Full::new(body)).map_err(|e| CallError::Broken(e.to_string()))?;
        self.exchange(request, timeout).await
    }

    /// A request to a public API; a non-2xx answer becomes the error it describes.
    async fn api(
        &self,
        method: Method,
        api_addr: &str,
        path: &str,
        headers: &[(HeaderName, String)],
        body: Bytes,
        timeout: Duration,
    ) -> Result<Answer, CallError> {
        let mut builder = self.builder(method, self.url(api_addr, path), false)?;
        for (name, value) in headers {
            builder = builder.header(name, value);
        }
        let request = builder.body(Full::new(body)).map_err(|e| CallError::Broken(e.to_string()))?;
        let answer = self.exchange(request, timeout).await?;
        if answer.status.is_success() {
            Ok(answer)
        } else {
            Err(CallError::Api(error_of(&answer, api_addr)))
        }
    }

    async fn api_json<T: DeserializeOwned>(
        &self,
        method: Method,
        api_addr: &str,
        path: &str,
        headers: &[(HeaderName, String)],
        body: Bytes,
        timeout: Duration,
    ) -> Result<T, CallError> {
        let answer = self.api(method, api_addr, path, headers, body, timeout).await?;
        json(&answer.body)
    }

    /// Sends `request` on the link to the peer listener at `addr` (`transport::wire`); a
    /// forward carries a deadline: one that reaches the owner later is refused, nothing done.
    async fn over_link(&self, addr: &str, request: Outgoing<'_>, timeout: Duration) -> Result<Bytes, CallError> {
        let deadline_ms =
            wire::has_deadline(request.kind).then(|| shoal_http_api::unix_ms() + FORWARD_TIMEOUT.as_millis() as u64);
        // A request that cannot be encoded is not sent: its error is the answer.
        let mut unsendable = None;
        let kind = request.kind;
        let payload = |out: &mut Vec<u8>| match wire::write_request(out, &request, deadline_ms) {
            Ok(()) => true,
            Err(e) => {
                unsendable = Some(e);
                false
            }
        };
        let answer = self.on_link(addr, kind, payload, timeout).await;
        if let Some(e) = unsendable {
            return Err(e);
        }
        let answer = answer?;
        if answer.kind != wire::ANSWER {
            return Err(CallError::Broken("an answer of an unknown kind from a peer".into()));
        }
        Ok(answer.payload)
    }

    /// Sends a request of `kind` on the link to the peer listener at `addr` (opened first when
    /// there is none) and waits for its answer; all of it within `timeout`.
    async fn on_link(
        &self,
        addr: &str,
        kind: u8,
        payload: impl FnOnce(&mut Vec<u8>) -> bool,
        timeout: Duration,
    ) -> Result<link::Message, CallError> {
        let started = tokio::time::Instant::now();
        let link = tokio::time::timeout(timeout, self.links.get(addr, || self.connect_link(addr)))
            .await
            .map_err(|_| CallError::Timeout)?
            .map_err(|e| CallError::Unreachable(e.to_string()))?;
        let left = timeout.saturating_sub(started.elapsed());
        link.try_call(kind, payload, left).await.map_err(|e| match e {
            // Not sent, or refused unhandled by a peer that stops: it did nothing.
            LinkError::NotSent => CallError::Unreachable("the peer's link closed (it stops)".into()),
            LinkError::Broken => CallError::Broken("the link to the peer broke".into()),
            LinkError::Timeout => CallError::Timeout,
            LinkError::Busy => CallError::Api(ApiError::unavailable(
                Unavailable::Overloaded,
                "the owner serves as many forwarded requests from this node as it takes",
            )),
            LinkError::TooLarge(n) => CallError::Refused { status: 413, reason: e.to_string() + &format!(" ({n})") },
        })
    }

    /// Connects a link to the peer listener at `addr`: an HTTP upgrade, with the cluster
    /// secret, through the node's connector (its reconnect policy included).
    fn connect_link(
        &self,
        addr: &str,
    ) -> impl std::future::Future<Output = Result<TokioIo<hyper::upgrade::Upgraded>, OpenError>> + Send + 'static {
        let uri: Result<Uri, _> = self.url(addr, "/internal/link").parse();
        let (client, secret) = (self.calls.clone(), self.secret.clone());
        // Connecting (every attempt), then the upgrade's answer.
        let within = self.reconnect.total() + self.reconnect.timeout;
        async move {
            let unreachable = |e: &dyn std::fmt::Display| OpenError::Unreachable(e.to_string());
            let mut builder = Request::builder()
                .method(Method::GET)
                .uri(uri.map_err(|e| unreachable(&e))?)
                .header(CONNECTION, HeaderValue::from_static("upgrade"))
                .header(UPGRADE, HeaderValue::from_static(link::PROTOCOL));
            if let Some(secret) = secret {
                builder = builder.header(SECRET_HEADER, secret);
            }
            let request = builder.body(Full::new(Bytes::new())).map_err(|e| unreachable(&e))?;
            let response = tokio::time::timeout(within, client.request(request))
                .await
                .map_err(|_| unreachable(&"no answer in time"))?
                .map_err(|e| match transport_error(&e) {
                    CallError::Unreachable(reason) => OpenError::Unreachable(reason),
                    other => unreachable(&other),
                })?;
            if response.status() != StatusCode::SWITCHING_PROTOCOLS {
                return Err(OpenError::Refused(response.status().as_u16()));
            }
            let upgraded = tokio::time::timeout(within, hyper::upgrade::on(response))
                .await
                .map_err(|_| unreachable(&"no upgrade in time"))?
                .map_err(|e| unreachable(&e))?;
            Ok(TokioIo::new(upgraded))
        }
    }

    /// Whether a link to the peer listener at `addr` is open.
    #[cfg(test)]
    pub fn has_link(&self, addr: &str) -> bool {
        self.links.is_open(addr)
    }

    async fn stream(
        &self,
        peer_addr: &str,
        request: StreamRequest,
        timeout: Duration,
    ) -> Result<FrameStream, CallError> {
        let StreamRequest::Bucket { bucket, to, epoch, restore } = request;
        let mut uri = self.url(peer_addr, &format!("/internal/transfer/{}?to={to}&epoch={epoch}", bucket.0));
        if restore {
            uri.push_str("&restore=true");
        }
        let request = self
            .builder(Method::GET, uri, true)?
            .body(Full::new(Bytes::new()))
            .map_err(|e| CallError::Broken(e.to_string()))?;
        let response = tokio::time::timeout(timeout, self.streams.request(request))
            .await
            .map_err(|_| CallError::Timeout)?
            .map_err(|e| transport_error(&e))?;
        if response.status() != StatusCode::OK {
            let status = response.status().as_u16();
            let body = response.into_body().collect().await.map(|b| b.to_bytes()).unwrap_or_default();
            return Err(CallError::Refused { status, reason: String::from_utf8_lossy(&body).into_owned() });
        }
        let frames = BodyStream::new(response.into_body()).filter_map(|frame| async move {
            match frame {
                Ok(frame) => frame.into_data().ok().map(Ok),
                Err(e) => Some(Err(CallError::Broken(e.to_string()))),
            }
        });
        Ok(Box::pin(frames))
    }
}

impl ControlTransport for HttpTransport {
    fn control(
        &self,
        peer_addr: &str,
        target: Option<NodeId>,
        rpc: ControlRpc,
        body: Vec<u8>,
        timeout: Duration,
    ) -> BoxFuture<'_, Result<Vec<u8>, TransportError>> {
        let (method, path) = match rpc {
            ControlRpc::Append => (Method::POST, "/raft/append".to_string()),
            ControlRpc::Vote => (Method::POST, "/raft/vote".to_string()),
            ControlRpc::Snapshot => (Method::POST, "/raft/snapshot".to_string()),
            ControlRpc::Admin { forwarded } => (Method::POST, format!("/internal/admin?forwarded={forwarded}")),
            ControlRpc::MemberStatus { node_id } => (Method::GET, format!("/internal/members/{node_id}")),
        };
        let uri = self.url(peer_addr, &path);
        Box::pin(async move {
            let mut headers = vec![(CONTENT_TYPE, HeaderValue::from_static("application/json"))];
            if let Some(t) = target {
                headers.push((HEADER_RAFT_TARGET, HeaderValue::from(t)));
            }
            let answer = self.peer(method, uri, &headers, Bytes::from(body), timeout).await.map_err(|e| match e {
                CallError::Unreachable(d) => TransportError::Unreachable(d),
                other => TransportError::Failed(other.to_string()),
            })?;
            match answer.status {
                s if s.is_success() => Ok(answer.body.to_vec()),
                StatusCode::MISDIRECTED_REQUEST => {
                    Err(TransportError::Misdirected(String::from_utf8_lossy(&answer.body).into_owned()))
                }
                StatusCode::BAD_REQUEST => {
                    Err(TransportError::BadRequest(String::from_utf8_lossy(&answer.body).into_owned()))
                }
                s => Err(TransportError::Failed(format!("HTTP {s}: {}", String::from_utf8_lossy(&answer.body)))),
            }
        })
    }
}

impl Transport for HttpTransport {
    fn call<'a>(
        &'a self,
        addr: &'a str,
        request: Outgoing<'a>,
        timeout: Duration,
    ) -> BoxFuture<'a, Result<Bytes, CallError>> {
        Box::pin(self.over_link(addr, request, timeout))
    }

    fn key_op<'a>(
        &'a self,
        to: &'a Addrs,
        request: Outgoing<'a>,
        timeout: Duration,
    ) -> BoxFuture<'a, Result<Bytes, CallError>> {
        Box::pin(self.over_link(&to.peer, request, timeout))
    }

    fn cluster(&self, api_addr: &str, timeout: Duration) -> BoxFuture<'_, Result<ClusterView, CallError>> {
        let api_addr = api_addr.to_string();
        Box::pin(async move { self.api_json(Method::GET, &api_addr, "/v1/cluster", &[], Bytes::new(), timeout).await })
    }

    fn open_stream(
        &self,
        peer_addr: &str,
        request: StreamRequest,
        timeout: Duration,
    ) -> BoxFuture<'_, Result<FrameStream, CallError>> {
        let peer_addr = peer_addr.to_string();
        Box::pin(async move { self.stream(&peer_addr, request, timeout).await })
    }
}

/// A failed exchange, saying why with the whole chain of causes (hyper-util's own text is
/// only "client error (Connect)": the refused connection or the certificate that did not
/// verify is in its sources).
fn transport_error(e: &hyper_util::client::legacy::Error) -> CallError {
    let mut text = e.to_string();
    let mut source = std::error::Error::source(e);
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    if e.is_connect() {
        CallError::Unreachable(text)
    } else {
        CallError::Broken(text)
    }
}

fn json<T: DeserializeOwned>(body: &[u8]) -> Result<T, CallError> {
    serde_json::from_slice(body).map_err(|e| CallError::Broken(format!("unreadable JSON: {e}")))
}

/// Rebuilds the error a peer's API answered with.
fn error_of(answer: &Answer, api_addr: &str) -> ApiError {
    let is_problem = answer.headers.get(CONTENT_TYPE) == Some(&HeaderValue::from_static(shoal_http_api::PROBLEM_JSON));
    match serde_json::from_slice::<Problem>(&answer.body) {
        Ok(problem) if is_problem => {
            let retry_after =
                answer.headers.get(hyper::header::RETRY_AFTER).and_then(|v| v.to_str().ok()?.parse().ok());
            ApiError::from_problem(&problem, retry_after.map(Duration::from_secs))
        }
        _ if answer.status == StatusCode::NOT_FOUND => ApiError::NotFound,
        _ => ApiError::unavailable(
            Unavailable::OwnerUnreachable,
            format!("node at {api_addr} answered {}", answer.status),
        ),
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    use std::time::Duration;

    use axum::extract::Request;
    use axum::routing::get;
    use bytes::Bytes;
    use shoal_raft::BucketId;

    use super::*;
    use crate::api::forward::{Get, Put};
    use crate::replication::{ReplicaAnswer, Replicate, ReplicateBatch};
    use crate::transport::wire::Handlers;
    use crate::transport::{link, Endpoint};

    /// Asks the peer listener at `addr` with `request`, as `Peers::ask` does.
    async fn ask<E: Endpoint>(transport: &HttpTransport, addr: &str, request: E) -> Result<E::Answer, CallError> {
        let body = |out: &mut Vec<u8>| wire::encode_body(&request, out);
        let outgoing = Outgoing { id: E::ID, kind: E::KIND, body: &body };
        let answer = transport.call(addr, outgoing, Duration::from_secs(20)).await?;
        wire::decode_answer(&request, &answer)
    }

    /// Sends a key operation to the member at `to`, as `Peers::ask_member` does.
    async fn ask_member<E: Endpoint>(
        transport: &HttpTransport,
        to: &Addrs,
        request: E,
    ) -> Result<E::Answer, CallError> {
        let body = |out: &mut Vec<u8>| wire::encode_body(&request, out);
        let outgoing = Outgoing { id: E::ID, kind: E::KIND, body: &body };
        let answer = transport.key_op(to, outgoing, Duration::from_secs(5)).await?;
        wire::decode_answer(&request, &answer)
    }

    /// Serves `router` on a fresh loopback port until `stopped` turns true: its address.
    async fn serve_on_loopback(router: axum::Router, stopped: tokio::sync::watch::Receiver<bool>) -> String {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("address").to_string();
        let none = crate::metrics::ListenerMetrics::none();
        crate::http_server::serve(listener, router, none, None, crate::http_server::Limits::default(), stopped);
        addr
    }

    fn request(bucket: u16, body: &'static [u8]) -> Replicate {
        Replicate {
            bucket: BucketId(bucket),
            from: 7,
            map_version: 41,
            snapshot: false,
            seq: 1000 + u64::from(bucket),
            body: Bytes::from_static(body),
        }
    }

    /// What a test peer listener saw: requests on links, upgrades asked for.
    #[derive(Default)]
    struct Seen {
        link: AtomicUsize,
        upgrades: AtomicUsize,
    }

    /// A peer listener on loopback whose links (when `links`; else it refuses the upgrade)
    /// answer each request with `handlers`, counting in `seen`, checking the cluster secret;
    /// its address, what it saw, and its stop.
    async fn listener(links: bool, handlers: Handlers) -> (String, Arc<Seen>, tokio::sync::watch::Sender<bool>) {
        let seen = Arc::new(Seen::default());
        let (stop, stopped) = tokio::sync::watch::channel(false);
        let handler: link::Handler = {
            let seen = seen.clone();
            Arc::new(move |kind, payload| {
                seen.link.fetch_add(1, Ordering::SeqCst);
                handlers.serve(kind, &payload, shoal_http_api::unix_ms())
            })
        };
        let secret = |request: &Request| request.headers().get(SECRET_HEADER).is_some_and(|v| v == "s3cret");
        let upgrades = seen.clone();
        let router = axum::Router::new().route(
            "/internal/link",
            get(move |request: Request| {
                upgrades.upgrades.fetch_add(1, Ordering::SeqCst);
                assert!(secret(&request));
                let (handler, stopped) = (handler.clone(), stopped.clone());
                async move {
                    if !links {
                        return axum::response::IntoResponse::into_response(axum::http::StatusCode::NOT_FOUND);
                    }
                    link::accept(request, handler, stopped, link::served(metrics::Gauge::noop()).0).await
                }
            }),
        );
        (serve_on_loopback(router, stop.subscribe()).await, seen, stop)
    }

    /// A peer listener that applies every replica write.
    async fn peer(links: bool) -> (String, Arc<Seen>, tokio::sync::watch::Sender<bool>) {
        let mut handlers = Handlers::default();
        handlers.add(|_: Replicate| async { Ok(ReplicaAnswer::Applied) });
        handlers.add(|b: ReplicateBatch| async move { Ok(vec![ReplicaAnswer::Applied; b.0.len()]) });
        listener(links, handlers).await
    }

    fn transport() -> HttpTransport {
        HttpTransport::new(None, Some("s3cret"), Reconnect::with_timeout(Duration::from_secs(2)), None)
    }

    async fn write_bodies(transport: &HttpTransport, addr: &str, bodies: Vec<Bytes>) -> Result<(), CallError> {
        let n = bodies.len();
        let mut requests: Vec<Replicate> =
            bodies.into_iter().enumerate().map(|(b, body)| Replicate { body, ..request(b as u16, b"") }).collect();
        if n == 1 {
            assert_eq!(ask(transport, addr, requests.remove(0)).await?, ReplicaAnswer::Applied);
        } else {
            assert_eq!(ask(transport, addr, ReplicateBatch(requests)).await?, vec![ReplicaAnswer::Applied; n]);
        }
        Ok(())
    }

    async fn write(transport: &HttpTransport, addr: &str, writes: usize) -> Result<(), CallError> {
        write_bodies(transport, addr, vec![Bytes::from_static(b"change"); writes]).await
    }

    /// Polls `condition` until it holds, for at most ten seconds.
    async fn eventually(what: &str, condition: impl Fn() -> bool) {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while !condition() {
            assert!(tokio::time::Instant::now() < deadline, "{what}");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    #[tokio::test]
    async fn replica_writes_of_any_size_travel_on_the_link_which_the_first_one_opens() {
        let (addr, seen, stop) = peer(true).await;
        let transport = transport();
        // Writes at once, before any link: they wait for the one link the first opens.
        let first = futures::future::join_all((0..4).map(|_| write(&transport, &addr, 1))).await;
        assert!(first.iter().all(Result::is_ok), "{first:?}");
        assert_eq!(seen.upgrades.load(Ordering::SeqCst), 1);
        write(&transport, &addr, 3).await.expect("a batch");
        // Three megabytes, and a batch with a large body among small ones: in fragments.
        write_bodies(&transport, &addr, vec![Bytes::from(vec![1u8; 3 << 20])]).await.expect("large");
        let bodies = vec![Bytes::from_static(b"a"), Bytes::from(vec![2u8; 300_000]), Bytes::from_static(b"b")];
        write_bodies(&transport, &addr, bodies).await.expect("a mixed batch");
        assert_eq!((seen.link.load(Ordering::SeqCst), seen.upgrades.load(Ordering::SeqCst)), (7, 1));

        // The peer stops: its link closes, and the next write finds nobody.
        stop.send_replace(true);
        eventually("the link closes", || !transport.has_link(&addr)).await;
        let after = write(&transport, &addr, 1).await;
        assert!(matches!(after, Err(CallError::Unreachable(_))), "{after:?}");
    }

    #[tokio::test]
    async fn a_peer_that_refuses_links_is_unreachable_and_asked_again_by_the_next_request() {
        let (addr, seen, _stop) = peer(false).await;
        let transport = transport();
        for attempt in 1..=3 {
            let refused = write(&transport, &addr, 1).await;
            assert!(matches!(&refused, Err(CallError::Unreachable(why)) if why.contains("404")), "{refused:?}");
            assert_eq!(seen.upgrades.load(Ordering::SeqCst), attempt);
        }
        assert!(!transport.has_link(&addr));
        assert_eq!(seen.link.load(Ordering::SeqCst), 0);
    }

    /// What the test owner answers a read of `key`: found, absent, refused with a 503 and its
    /// retry-after, or a value larger than a link frame.
    fn read_of(key: &str) -> Result<shoal_http_api::types::GetOk, ApiError> {
        let found =
            |value: Bytes| shoal_http_api::types::GetOk { value, version: 9, bucket: 321, node: 2, lag_ms: None };
        match key {
            "found" => Ok(found(Bytes::from_static(b"the value"))),
            "moving" => Err(ApiError::Unavailable {
                code: Unavailable::BucketMoving,
                detail: "bucket 321 is moving".into(),
                retry_after: Duration::from_secs(3),
            }),
            "large" => Ok(found(Bytes::from(vec![7u8; 3 << 20]))),
            _ => Err(ApiError::NotFound),
        }
    }

    /// What the test owner answers a write of `key`: done at version 4, or refused as a stale
    /// conditional write.
    fn write_of(key: &str) -> Result<shoal_http_api::types::PutOk, ApiError> {
        match key {
            "stale" => Err(ApiError::PreconditionFailed { current_version: Some(3) }),
            _ => Ok(shoal_http_api::types::PutOk { key: key.into(), version: 4, bucket: 321, node: 2 }),
        }
    }

    /// An owner on loopback whose links answer forwarded reads as `read_of` says and writes as
    /// `write_of` says; its addresses (nobody listens at its API address: key operations do
    /// not go there), what it saw, and its stop.
    async fn owner() -> (Addrs, Arc<Seen>, tokio::sync::watch::Sender<bool>) {
        let mut handlers = Handlers::default();
        handlers.add(|Put { item, map_version }| async move {
            assert_eq!(map_version, 5);
            write_of(&item.key).map_err(CallError::Api)
        });
        handlers.add(|Get { key, map_version, mirror }| async move {
            assert_eq!((map_version, mirror), (5, None));
            read_of(&key).map_err(CallError::Api)
        });
        let (peer, seen, stop) = listener(true, handlers).await;
        (Addrs { api: "127.0.0.1:9".into(), peer }, seen, stop)
    }

    async fn read(transport: &HttpTransport, to: &Addrs, key: &str) -> String {
        let answer = ask_member(transport, to, Get { key: key.into(), map_version: 5, mirror: None }).await;
        shown(answer.map(|ok| format!("{} bytes at version {}", ok.value.len(), ok.version)))
    }

    async fn put(transport: &HttpTransport, to: &Addrs, key: &str) -> String {
        let item =
            shoal_http_api::PutItem { key: key.into(), value: Bytes::from_static(b"v"), options: Default::default() };
        shown(ask_member(transport, to, Put { item, map_version: 5 }).await.map(|ok| format!("{ok:?}")))
    }

    /// A read's or write's answer in one comparable form.
    fn shown(answer: Result<String, CallError>) -> String {
        match answer {
            Ok(shown) => shown,
            Err(CallError::Api(e)) => format!("{:?} {:?}", e.problem(), e.retry_after()),
            other => panic!("{other:?}"),
        }
    }

    #[tokio::test]
    async fn forwarded_reads_and_writes_go_on_the_link_and_answer_as_the_owner_does() {
        let (to, seen, _stop) = owner().await;
        let transport = transport();
        assert_eq!(read(&transport, &to, "found").await, "9 bytes at version 9");
        assert!(read(&transport, &to, "absent").await.contains("not_found"));
        let moving = read(&transport, &to, "moving").await;
        assert!(moving.contains("bucket_moving") && moving.contains("3s"), "{moving}");
        assert_eq!(read(&transport, &to, "large").await, format!("{} bytes at version 9", 3 << 20));
        assert!(put(&transport, &to, "k").await.contains("version: 4"));
        let stale = put(&transport, &to, "stale").await;
        assert!(stale.contains("precondition_failed") && stale.contains("current_version: Some(3)"), "{stale}");
        assert_eq!((seen.link.load(Ordering::SeqCst), seen.upgrades.load(Ordering::SeqCst)), (6, 1));
    }

    /// Pings, shadow writes and the other calls go on the link as well, and come back as their
    /// handler answered: a value, a refusal with its status, an API error with its code.
    #[tokio::test]
    async fn calls_go_on_the_link_and_answer_as_their_handler_did() {
        use crate::health::{Ping, Pong};
        use crate::transfer::shadow::ShadowWrites;
        let mut handlers = Handlers::default();
        handlers.add(|ping: Ping| async move {
            Ok(Pong {
                node_id: 2,
                incarnation: ping.incarnation + 1,
                status: shoal_raft::MemberStatus::Member,
                lease: true,
            })
        });
        handlers.add(|w: ShadowWrites| async move {
            Err::<(), _>(CallError::Refused {
                status: 409,
                reason: format!("{} bytes for bucket {}", w.body.len(), w.bucket.0),
            })
        });
        handlers.add(|_: crate::api::admin::EnterMaintenance| async {
            Err(CallError::Api(ApiError::Conflict("busy".into())))
        });
        let (to, seen, _stop) = listener(true, handlers).await;
        let transport = transport();
        let pong = ask(&transport, &to, Ping { from: 1, pfail: vec![], incarnation: 41, replica: None }).await;
        assert!(matches!(pong, Ok(Pong { node_id: 2, incarnation: 42, .. })), "{pong:?}");
        let shadow = ShadowWrites { bucket: BucketId(5), body: Bytes::from(vec![7u8; 100_000]) };
        let refused = ask(&transport, &to, shadow).await;
        assert!(
            matches!(&refused, Err(CallError::Refused { status: 409, reason }) if reason == "100000 bytes for bucket 5"),
            "{refused:?}"
        );
        let maintenance = crate::api::admin::EnterMaintenance { period: Duration::from_secs(60) };
        let conflict = ask(&transport, &to, maintenance).await;
        assert!(matches!(&conflict, Err(CallError::Api(e)) if e.code() == "conflict"), "{conflict:?}");
        assert_eq!((seen.link.load(Ordering::SeqCst), seen.upgrades.load(Ordering::SeqCst)), (3, 1));
    }

    /// A port nobody listens on until `after`, then a proxy to `target` there.
    async fn listening_after(target: String, after: Duration) -> String {
        let port = std::net::TcpListener::bind("127.0.0.1:0").expect("bind").local_addr().expect("address").port();
        let addr = format!("127.0.0.1:{port}");
        let bind = addr.clone();
        tokio::spawn(async move {
            tokio::time::sleep(after).await;
            let listener = tokio::net::TcpListener::bind(&bind).await.expect("bind again");
            while let Ok((mut client, _)) = listener.accept().await {
                let target = target.clone();
                tokio::spawn(async move {
                    if let Ok(mut server) = tokio::net::TcpStream::connect(&target).await {
                        let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
                    }
                });
            }
        });
        addr
    }

    /// A peer that refuses the first two connects is reached on the third, two seconds
    /// after the second (the reconnect policy, for every connection a node opens); one that
    /// refuses the third too is unreachable.
    #[tokio::test]
    async fn a_peer_that_refuses_the_first_two_connects_is_reached_on_the_third() {
        let (target, seen, _stop) = peer(true).await;
        let transport = transport();
        // Connects at 0, 2 and 4 s: the first two are refused.
        let addr = listening_after(target.clone(), Duration::from_millis(3000)).await;
        let started = tokio::time::Instant::now();
        let answer = ask(&transport, &addr, request(1, b"x")).await;
        assert_eq!(answer, Ok(ReplicaAnswer::Applied));
        assert!(started.elapsed() >= Duration::from_secs(4), "two attempts were refused: {:?}", started.elapsed());
        assert_eq!(seen.link.load(Ordering::SeqCst), 1);
        // Listening only after the third attempt: unreachable, after the two pauses.
        let late = listening_after(target, Duration::from_secs(6)).await;
        let started = tokio::time::Instant::now();
        let answer = ask(&transport, &late, request(1, b"x")).await;
        assert!(matches!(answer, Err(CallError::Unreachable(_))), "{answer:?}");
        assert!(started.elapsed() >= Duration::from_secs(4), "{:?}", started.elapsed());
    }
}
