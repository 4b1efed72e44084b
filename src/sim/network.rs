//! [`SimNetwork`]: the simulated network every node of a simulation talks through, and
//! [`SimTransport`], one host's end of it.
//!
//! A message from host A to host B waits a random latency, then runs B's handler as a task of
//! B (it goes on if A stops waiting, as a real server does), and its answer waits another
//! latency before A sees it. The network decides, with its seeded generator, each latency and
//! whether a message is dropped; the simulation cuts links (partitions), kills hosts and brings
//! them back. What each failure looks like to the sender follows TCP:
//!
//! | situation | the sender sees |
//! |---|---|
//! | B is down (nothing listens) | `Unreachable` at once (connection refused) |
//! | the link is cut when A sends | `Unreachable` after the connect timeout |
//! | the link is cut, or the message dropped, on the way | nothing: its own timeout |
//! | B dies while handling | `Broken` (connection reset) |
//!
//! Requests and answers travel encoded as on a peer link (`transport::wire`), through the
//! receiver's handlers, its deadline check by its own clock included: the simulation sees
//! what a forwarder really sees.

use std::collections::{BTreeMap, BTreeSet};
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures::StreamExt;
use parking_lot::Mutex;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use shoal_http_api::types::ClusterView;
use shoal_raft::{BoxFuture, ControlRpc, ControlTransport, NodeId, ServeError, TransportError};
use tokio::task::AbortHandle;
use tokio::time::Instant;

use crate::node::PeerService;
use crate::transport::http::FORWARD_TIMEOUT;
use crate::transport::{link, wire, CallError, FrameStream, Outgoing, StreamRequest, Transport};

/// A simulated host: an index into the simulation's hosts.
pub type HostId = usize;

/// The host the simulation's clients send from: never cut off, never killed.
pub const CLIENTS: HostId = usize::MAX;

/// How long connecting over a cut link takes to fail.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

/// A running host: the instance (generation) that serves, and its handlers.
struct Live {
    generation: u64,
    service: Arc<PeerService>,
}

struct NetState {
    rng: StdRng,
    /// Addresses (API and peer) to hosts.
    hosts: BTreeMap<String, HostId>,
    /// The instance each host runs now (from its start, before it serves).
    booted: BTreeMap<HostId, u64>,
    /// Hosts that serve now.
    live: BTreeMap<HostId, Live>,
    /// Cut links, as (smaller, larger) host pairs.
    cut: BTreeSet<(HostId, HostId)>,
    /// Lowest and highest one-way latency.
    latency: (Duration, Duration),
    /// Chance that a message (or its answer) is lost.
    drop_rate: f64,
    /// Handler tasks per running instance, aborted when it is killed.
    tasks: BTreeMap<(HostId, u64), Vec<AbortHandle>>,
}

/// The simulated network (see the module docs).
pub struct SimNetwork {
    state: Mutex<NetState>,
    started: Instant,
}

fn pair(a: HostId, b: HostId) -> (HostId, HostId) {
    (a.min(b), a.max(b))
}

/// The two ends of one message.
#[derive(Debug, Clone, Copy)]
struct Route {
    from: HostId,
    from_generation: u64,
    to: HostId,
    to_generation: u64,
}

impl SimNetwork {
    /// The simulated hosts' clock in Unix milliseconds: the runtime's (paused, advanced by the
    /// simulation) since the network was made, from a fixed date.
    fn now_ms(&self) -> u64 {
        const UNIX_AT_START: u64 = 1_800_000_000_000;
        UNIX_AT_START + self.started.elapsed().as_millis() as u64
    }

    /// A network whose random choices follow `seed`.
    pub fn new(seed: u64) -> Arc<Self> {
        Arc::new(SimNetwork {
            state: Mutex::new(NetState {
                rng: StdRng::seed_from_u64(seed),
                hosts: BTreeMap::new(),
                booted: BTreeMap::new(),
                live: BTreeMap::new(),
                cut: BTreeSet::new(),
                latency: (Duration::from_micros(200), Duration::from_millis(3)),
                drop_rate: 0.0,
                tasks: BTreeMap::new(),
            }),
            started: Instant::now(),
        })
    }

    /// Makes `addresses` reach `host`.
    pub fn name(&self, host: HostId, addresses: &[&str]) {
        let mut state = self.state.lock();
        for a in addresses {
            state.hosts.insert(a.to_string(), host);
        }
    }

    /// `host` starts as instance `generation`: it may send from now on.
    pub fn boot(&self, host: HostId, generation: u64) {
        self.state.lock().booted.insert(host, generation);
    }

    /// `host` serves `service` from now on, as instance `generation` (if that is the instance
    /// it runs).
    pub fn serve(&self, host: HostId, generation: u64, service: Arc<PeerService>) {
        let mut state = self.state.lock();
        if state.booted.get(&host) == Some(&generation) {
            state.live.insert(host, Live { generation, service });
        }
    }

    /// `host` is down: nothing reaches it, nothing it sent is answered, its handlers stop.
    pub fn kill(&self, host: HostId) {
        let tasks: Vec<AbortHandle> = {
            let mut state = self.state.lock();
            state.live.remove(&host);
            let Some(generation) = state.booted.remove(&host) else { return };
            state.tasks.remove(&(host, generation)).unwrap_or_default()
        };
        for task in tasks {
            task.abort();
        }
    }

    /// Cuts every link between `a` and `b` (both ways).
    pub fn cut(&self, a: HostId, b: HostId) {
        self.state.lock().cut.insert(pair(a, b));
    }

    /// Cuts the links between the two groups.
    pub fn partition(&self, left: &[HostId], right: &[HostId]) {
        for &a in left {
            for &b in right {
                self.cut(a, b);
            }
        }
    }

    /// Restores every link.
    pub fn heal(&self) {
        self.state.lock().cut.clear();
    }

    /// Whether any link is cut.
    pub fn is_split(&self) -> bool {
        !self.state.lock().cut.is_empty()
    }

    /// Sets the share of messages lost on the way (0 to 1).
    pub fn set_drop_rate(&self, rate: f64) {
        self.state.lock().drop_rate = rate.clamp(0.0, 1.0);
    }

    /// Sets the range of one-way latencies.
    pub fn set_latency(&self, low: Duration, high: Duration) {
        self.state.lock().latency = (low, high.max(low));
    }

    /// The current instance of `host`, if it runs.
    pub fn generation_of(&self, host: HostId) -> Option<u64> {
        self.state.lock().booted.get(&host).copied()
    }

    fn link_up(state: &NetState, route: &Route) -> bool {
        !state.cut.contains(&pair(route.from, route.to))
    }

    fn alive(state: &NetState, host: HostId, generation: u64) -> bool {
        host == CLIENTS || state.booted.get(&host) == Some(&generation)
    }

    /// A latency, and whether the message is lost.
    fn draw(&self) -> (Duration, bool) {
        let mut state = self.state.lock();
        let (low, high) = state.latency;
        let latency = if high > low { state.rng.random_range(low..=high) } else { low };
        let drop_rate = state.drop_rate;
        let dropped = drop_rate > 0.0 && state.rng.random_bool(drop_rate);
        (latency, dropped)
    }

    /// Where a message from `from` (instance `from_generation`) to `addr` goes, or what the
    /// sender sees at once.
    async fn connect(&self, from: HostId, from_generation: u64, addr: &str) -> Result<Route, CallError> {
        let (to, live, cut) = {
            let state = self.state.lock();
            let Some(&to) = state.hosts.get(addr) else {
                return Err(CallError::Unreachable(format!("no host at {addr}")));
            };
            if !Self::alive(&state, from, from_generation) {
                return Err(CallError::Unreachable("this host is down".into()));
            }
            (to, state.live.get(&to).map(|l| l.generation), state.cut.contains(&pair(from, to)))
        };
        if cut {
            tokio::time::sleep(CONNECT_TIMEOUT).await;
            return Err(CallError::Unreachable(format!("connecting to {addr} timed out")));
        }
        match live {
            Some(to_generation) => Ok(Route { from, from_generation, to, to_generation }),
            None => Err(CallError::Unreachable(format!("connection to {addr} refused"))),
        }
    }

    /// Runs `handler` on the receiving host of `route` after the trip there, and brings its
    /// answer back; waits forever when the message or its answer is lost (the caller's
    /// timeout ends the wait).
    async fn deliver<T, F, Fut>(self: &Arc<Self>, route: Route, handler: F) -> Result<T, CallError>
    where
        F: FnOnce(Arc<PeerService>) -> Fut + Send + 'static,
        Fut: Future<Output = T> + Send + 'static,
        T: Send + 'static,
    {
        let (latency, dropped) = self.draw();
        tokio::time::sleep(latency).await;
        let service = {
            let state = self.state.lock();
            let up = Self::link_up(&state, &route) && Self::alive(&state, route.from, route.from_generation);
            match state.live.get(&route.to) {
                Some(l) if up && !dropped && l.generation == route.to_generation => Some(l.service.clone()),
                _ => None,
            }
        };
        let Some(service) = service else { return std::future::pending().await };
        let (tx, rx) = tokio::sync::oneshot::channel();
        let task = tokio::spawn(async move {
            let _ = tx.send(handler(service).await);
        });
        self.track(route.to, route.to_generation, task.abort_handle());
        let answer = rx.await.map_err(|_| CallError::Broken("connection reset".into()))?;
        let (latency, dropped) = self.draw();
        tokio::time::sleep(latency).await;
        let delivered = {
            let state = self.state.lock();
            Self::link_up(&state, &route)
                && Self::alive(&state, route.from, route.from_generation)
                && Self::alive(&state, route.to, route.to_generation)
        };
        if dropped || !delivered {
            return std::future::pending().await;
        }
        Ok(answer)
    }

    fn track(&self, host: HostId, generation: u64, task: AbortHandle) {
        let mut state = self.state.lock();
        if state.booted.get(&host) != Some(&generation) {
            task.abort();
            return;
        }
        let tasks = state.tasks.entry((host, generation)).or_default();
        tasks.retain(|t| !t.is_finished());
        tasks.push(task);
    }

    /// One exchange from `from` to the host at `addr`, bounded by `timeout`.
    async fn exchange<T, F, Fut>(
        self: &Arc<Self>,
        from: HostId,
        from_generation: u64,
        addr: &str,
        timeout: Duration,
        handler: F,
    ) -> Result<T, CallError>
    where
        F: FnOnce(Arc<PeerService>) -> Fut + Send + 'static,
        Fut: Future<Output = T> + Send + 'static,
        T: Send + 'static,
    {
        let trip = async {
            let route = self.connect(from, from_generation, addr).await?;
            self.deliver(route, handler).await
        };
        tokio::time::timeout(timeout, trip).await.map_err(|_| CallError::Timeout)?
    }

    /// A client's request to the node at `api_addr`: `handler` runs on that node.
    pub async fn client_call<T, F, Fut>(
        self: &Arc<Self>,
        api_addr: &str,
        timeout: Duration,
        handler: F,
    ) -> Result<T, CallError>
    where
        F: FnOnce(Arc<PeerService>) -> Fut + Send + 'static,
        Fut: Future<Output = T> + Send + 'static,
        T: Send + 'static,
    {
        self.exchange(CLIENTS, 0, api_addr, timeout, handler).await
    }

    /// Host `host`'s end of the network, as instance `generation`.
    pub fn transport(self: &Arc<Self>, host: HostId, generation: u64) -> Arc<SimTransport> {
        Arc::new(SimTransport { net: self.clone(), host, generation })
    }
}

/// One host's end of the [`SimNetwork`]: its [`Transport`].
pub struct SimTransport {
    net: Arc<SimNetwork>,
    host: HostId,
    generation: u64,
}

impl Transport for SimTransport {
    fn call<'a>(
        &'a self,
        addr: &'a str,
        request: Outgoing<'a>,
        timeout: Duration,
    ) -> BoxFuture<'a, Result<Bytes, CallError>> {
        Box::pin(async move {
            // As on a link: the sender's deadline by its clock, a message no larger than a link's.
            let deadline =
                wire::has_deadline(request.kind).then(|| self.net.now_ms() + FORWARD_TIMEOUT.as_millis() as u64);
            let mut message = Vec::new();
            wire::write_request(&mut message, &request, deadline)?;
            if message.len() > link::MAX_MESSAGE {
                return Err(CallError::Refused { status: 413, reason: format!("{} bytes", message.len()) });
            }
            let (kind, message, net) = (request.kind, Bytes::from(message), self.net.clone());
            let handler = move |service: Arc<PeerService>| async move {
                match service.serve_message(kind, &message, net.now_ms()) {
                    Ok(handling) => Ok(Bytes::from(handling.await.1)),
                    // The link would close: the sender sees it broken.
                    Err(malformed) => Err(CallError::Broken(malformed.to_string())),
                }
            };
            self.net.exchange(self.host, self.generation, addr, timeout, handler).await?
        })
    }

    fn cluster(&self, api_addr: &str, timeout: Duration) -> BoxFuture<'_, Result<ClusterView, CallError>> {
        let api_addr = api_addr.to_string();
        Box::pin(async move {
            let handler = |service: Arc<PeerService>| async move {
                shoal_http_api::AdminApi::cluster(&*service.api).await.map_err(CallError::Api)
            };
            self.net.exchange(self.host, self.generation, &api_addr, timeout, handler).await?
        })
    }

    fn open_stream(
        &self,
        peer_addr: &str,
        request: StreamRequest,
        timeout: Duration,
    ) -> BoxFuture<'_, Result<FrameStream, CallError>> {
        let peer_addr = peer_addr.to_string();
        Box::pin(async move {
            let handler = move |service: Arc<PeerService>| async move { service.open_stream(request).await };
            let opened = self.net.exchange(self.host, self.generation, &peer_addr, timeout, handler).await??;
            let route = {
                let state = self.net.state.lock();
                state.hosts.get(&peer_addr).copied()
            };
            let (net, from, from_generation) = (self.net.clone(), self.host, self.generation);
            let Some(to) = route else { return Err(CallError::Unreachable(format!("no host at {peer_addr}"))) };
            let to_generation = self.net.generation_of(to);
            // Every frame crosses the link; a cut link or a dead end breaks the stream.
            let frames = opened.then(move |frame| {
                let net = net.clone();
                async move {
                    let (latency, _) = net.draw();
                    tokio::time::sleep(latency / 4).await;
                    let state = net.state.lock();
                    let up = !state.cut.contains(&pair(from, to))
                        && SimNetwork::alive(&state, from, from_generation)
                        && to_generation.is_some_and(|g| SimNetwork::alive(&state, to, g));
                    if up {
                        frame
                    } else {
                        Err(CallError::Broken("connection lost".into()))
                    }
                }
            });
            Ok(Box::pin(frames) as FrameStream)
        })
    }
}

impl ControlTransport for SimTransport {
    fn control(
        &self,
        peer_addr: &str,
        target: Option<NodeId>,
        rpc: ControlRpc,
        body: Vec<u8>,
        timeout: Duration,
    ) -> BoxFuture<'_, Result<Vec<u8>, TransportError>> {
        let peer_addr = peer_addr.to_string();
        Box::pin(async move {
            let handler = move |service: Arc<PeerService>| async move { service.control(target, rpc, &body).await };
            match self.net.exchange(self.host, self.generation, &peer_addr, timeout, handler).await {
                Ok(Ok(answer)) => Ok(answer),
                Ok(Err(ServeError::Misdirected(reason))) => Err(TransportError::Misdirected(reason)),
                Ok(Err(ServeError::BadRequest(reason))) => Err(TransportError::BadRequest(reason)),
                Err(CallError::Unreachable(reason)) => Err(TransportError::Unreachable(reason)),
                Err(e) => Err(TransportError::Failed(e.to_string())),
            }
        })
    }
}
