//! [`start`]: builds every part of a node, binds its listeners, bootstraps, joins or
//! restarts, and returns a [`NodeHandle`] to stop it.
//!
//! ```text
//!          ┌──────────────── shoal node ────────────────────────────┐
//!  client ─┤ API listener ── http-api router ── NodeApi (api) ──┐ │
//!          │                                     │   CacheStore <─┘ │
//!          │                                     └── Peers ─ Transport ─> other nodes
//!   peers ─┤ peer listener ── PeerService ── ControlPlane (openraft, sled), replication, ...
//!          └────────────────────────────────────────────────────────┘
//! ```
//!
//! Start-up, by what the data dir holds:
//! - nothing, no `--join`: a new one-node cluster (node id 1);
//! - nothing, `--join`: register with the cluster for a new id, start Raft under it, get
//!   admitted;
//! - an identity: the same member again (finishing an interrupted join if need be); a node
//!   that left refuses to start.

mod peers;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use shoal_http_api::Limits;
use shoal_raft::{BucketId, ClusterState, ControlConfig, ControlPlane, MemberStatus, NodeId, Storage};
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::api::{NodeApi, NodeParts};
use crate::bucket::{BucketCore, Probe};
use crate::cache::{CacheStore, Clock};
use crate::config::ServeConfig;
use crate::health::Health;
use crate::http_server;
use crate::identity::Identity;
use crate::join::Joiner;
use crate::metrics::NodeMetrics;
use crate::peer::Peers;
use crate::phase::LocalFacts;
use crate::reconcile::Reconciler;
use crate::replication::Replicator;
use crate::transfer::export::Exporter;
use crate::transfer::progress::Progress;
use crate::transport::{HttpTransport, Transport};
pub use peers::PeerService;

/// How long a stopping leader waits for its successor to take the lead.
pub const LEAD_HANDOFF_WAIT: Duration = Duration::from_secs(10);

/// Why a node could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// A flag is wrong.
    #[error("invalid configuration: {0}")]
    Config(String),
    /// A listener or the data dir failed.
    #[error("{0}")]
    Io(String),
    /// The node left its cluster; its data dir cannot be used again.
    #[error("{0}")]
    Retired(String),
    /// The cluster failed this node while it was down: it must discard its data dir and join
    /// again as a new member, through these API addresses.
    #[error("the cluster failed node {node_id} while it was down; it must rejoin as a new member")]
    Failed {
        /// The old id.
        node_id: NodeId,
        /// The API addresses of the members.
        join: Vec<String>,
    },
    /// The data dir's identity could not be read or written.
    #[error("{0}")]
    Identity(#[from] crate::identity::IdentityError),
    /// Joining failed.
    #[error("join failed: {0}")]
    Join(#[from] crate::join::JoinError),
    /// The control plane failed.
    #[error("control plane: {0}")]
    Control(#[from] shoal_raft::ControlError),
}

/// The two listeners of a node.
pub struct Listeners {
    /// Client API.
    pub api: TcpListener,
    /// Raft and node-to-node.
    pub peer: TcpListener,
}

impl Listeners {
    /// Binds the addresses of `config`.
    pub async fn bind(config: &ServeConfig) -> Result<Self, StartError> {
        let peer_addr = config.peer_listen_addr().map_err(StartError::Config)?;
        let api = TcpListener::bind(config.listen)
            .await
            .map_err(|e| StartError::Io(format!("cannot listen on {} (--listen): {e}", config.listen)))?;
        let peer = TcpListener::bind(peer_addr)
            .await
            .map_err(|e| StartError::Io(format!("cannot listen on {peer_addr} (--peer-listen): {e}")))?;
        Ok(Listeners { api, peer })
    }
}

/// A running node.
pub struct NodeHandle {
    node_id: NodeId,
    api_addr: SocketAddr,
    peer_addr: SocketAddr,
    control: ControlPlane,
    cache: Arc<CacheStore>,
    shutdown: watch::Sender<bool>,
    servers: Vec<JoinHandle<()>>,
    tasks: Vec<JoinHandle<()>>,
    rejoin: Arc<parking_lot::Mutex<Option<Vec<String>>>>,
    facts: Arc<LocalFacts>,
    replicator: Arc<Replicator>,
    api: Arc<NodeApi>,
}

impl NodeHandle {
    /// The node's id.
    pub fn node_id(&self) -> NodeId {
        self.node_id
    }

    /// The bound client API address.
    pub fn api_addr(&self) -> SocketAddr {
        self.api_addr
    }

    /// The bound peer address.
    pub fn peer_addr(&self) -> SocketAddr {
        self.peer_addr
    }

    /// The node's control plane.
    pub fn control(&self) -> &ControlPlane {
        &self.control
    }

    /// The node's store.
    pub fn cache(&self) -> &Arc<CacheStore> {
        &self.cache
    }

    /// After the node stopped by itself: `Some(API addresses)` if it stopped because the
    /// cluster failed it; it must then discard its data dir and join as a new member.
    pub fn rejoin(&self) -> Option<Vec<String>> {
        self.rejoin.lock().clone()
    }

    /// Resolves when the node stops by itself (it left the cluster) or was asked to stop.
    pub async fn stopped(&self) {
        let mut rx = self.shutdown.subscribe();
        let _ = rx.wait_for(|stop| *stop).await;
    }

    /// Stops as on a signal (SIGTERM, Ctrl-C), the whole stop taking at most `drain_timeout`:
    /// [`Self::stop_for_restart`] with `restart_window`, then [`Self::shutdown`], for which the
    /// last quarter of the time (at most 5 s) is kept (closing connections and Raft).
    pub async fn stop_on_signal(self, restart_window: Duration, drain_timeout: Duration) {
        let stop_at = tokio::time::Instant::now() + drain_timeout;
        let closing = (drain_timeout / 4).min(Duration::from_secs(5));
        self.stop_for_restart(restart_window, stop_at - closing).await;
        tracing::info!(node_id = self.node_id, "shutting down");
        if tokio::time::timeout_at(stop_at, self.shutdown()).await.is_err() {
            tracing::warn!("--drain-timeout reached while closing: exiting with connections still open");
        }
    }

    /// Stops for a restart (SIGTERM), by `deadline`: first it records that it stops
    /// (`SetDraining`: should it stay down, the cluster knows its copy died with its process,
    /// and no other member goes into maintenance meanwhile); then a member that does not leave
    /// goes into maintenance for `window`, so the holder of its replica serves its buckets
    /// until it is back (instead of the cluster failing it after the node timeout), unless the
    /// maintenance could not be kept (another member stops too, as in a stop of the whole
    /// cluster; no majority answers; fewer than three members; a peer down; the replica not
    /// complete in time) or the node is in maintenance already; then it drains (see
    /// [`Self::drain_until`]). The maintenance takes at most two thirds of the time there is.
    /// `window` zero: no maintenance. Returns whether the replicas were confirmed in sync.
    pub async fn stop_for_restart(&self, window: Duration, deadline: tokio::time::Instant) -> bool {
        self.facts.start_stopping();
        self.control.stop_standing();
        let now = tokio::time::Instant::now();
        let maintenance_by = now + deadline.saturating_duration_since(now) * 2 / 3;
        let state = self.control.state();
        let stays = state.member_of(self.node_id).is_some_and(|m| !m.leaving);
        let several = state.members.len() > 1;
        let recorded = several && self.record_stopping(maintenance_by.min(now + RECORD_STOP_WAIT)).await;
        if !window.is_zero() && stays && several {
            self.maintenance_for_stop(window, maintenance_by, recorded).await;
        }
        self.drain_until(deadline).await
    }

    /// Records in the cluster that this node stops (`SetDraining`), by `deadline`; whether it
    /// was.
    async fn record_stopping(&self, deadline: tokio::time::Instant) -> bool {
        if self.control.state().draining.contains(&self.node_id) {
            return true;
        }
        let request = shoal_raft::AdminRequest::SetDraining { node_id: self.node_id, draining: true };
        match tokio::time::timeout_at(deadline, self.control.admin(request)).await {
            Ok(Ok(_)) => true,
            Ok(Err(e)) => {
                tracing::warn!(node_id = self.node_id, error = %e, "could not record that this node stops");
                false
            }
            Err(_) => {
                tracing::warn!(node_id = self.node_id, "could not record that this node stops in time");
                false
            }
        }
    }

    /// The maintenance part of [`Self::stop_for_restart`], by `deadline`; `recorded`: this
    /// node's stop is recorded (else no majority answers, and no maintenance could be kept).
    async fn maintenance_for_stop(&self, window: Duration, deadline: tokio::time::Instant, recorded: bool) {
        use shoal_http_api::ApiError;
        use shoal_raft::state::{MaintenancePhase, MaintenanceRefusal};
        let me = self.node_id;
        let phase = |s: &shoal_raft::ClusterState| s.maintenance.as_ref().filter(|m| m.node == me).map(|m| m.phase);
        let mut state = self.control.state();
        if phase(&state) == Some(MaintenancePhase::Preparing) {
            // A request being served here drives it: it goes away or ends by itself.
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            self.control.wait_for_state(left, |s| phase(s) != Some(MaintenancePhase::Preparing)).await;
            state = self.control.state();
        }
        match (phase(&state), state.maintenance.as_ref()) {
            (Some(MaintenancePhase::Away), Some(m)) => {
                tracing::warn!(
                    node_id = me,
                    served_by = m.heir,
                    seconds_left = m.until_ms.saturating_sub(crate::maintenance::now_ms()) / 1000,
                    "stopping for a restart: already in maintenance; come back with the same data dir before it runs out"
                );
                return;
            }
            (Some(p), _) => {
                tracing::warn!(
                    node_id = me,
                    phase = ?p,
                    "stopping during a maintenance that is not away: no new maintenance; if this node is not back within the node timeout, the cluster fails it"
                );
                return;
            }
            (None, _) => {}
        }
        let stopping_with = state.stopping_peer(me);
        if !recorded || stopping_with.is_some() {
            tracing::info!(
                node_id = me,
                stopping_with = ?stopping_with,
                recorded,
                "stopping with the cluster (another member stops too, or no majority answers): no maintenance; if this node stays down, it is failed as stopped and its buckets serve again, empty"
            );
            return;
        }
        let wait = deadline.saturating_duration_since(tokio::time::Instant::now());
        match self.api.maintenance_here(window, wait).await {
            Ok(m) => tracing::warn!(
                node_id = me,
                served_by = m.served_by,
                window = ?window,
                "stopping for a restart: in maintenance; come back with the same data dir before the window ends"
            ),
            Err(ApiError::MaintenanceRefused(MaintenanceRefusal::PeerStopping(peer))) => tracing::info!(
                node_id = me,
                stopping_with = peer,
                "stopping with the cluster (another member stops too): no maintenance; if this node stays down, it is failed as stopped and its buckets serve again, empty"
            ),
            Err(e) => tracing::warn!(
                node_id = me,
                code = e.code(),
                error = %e,
                "stopping without maintenance: if this node is not back within the node timeout, the cluster fails it"
            ),
        }
    }

    /// [`Self::drain_until`] now plus `timeout`.
    pub async fn drain(&self, timeout: Duration) -> bool {
        self.drain_until(tokio::time::Instant::now() + timeout).await
    }

    /// Gets ready to stop (SIGTERM; a stop is not a leave): `/readyz` fails at once, writes
    /// are refused (503 `node_draining`), the cluster records that this node is stopping
    /// (`SetDraining`; it keeps its Raft vote, so the voters never shrink), and it waits — until
    /// `deadline` at most — until every bucket it owns is attached to its replica and the async
    /// queue is empty, so that the node restarting as the same member gets every acknowledged
    /// write back from its replica. A leader also waits (at most [`LEAD_HANDOFF_WAIT`]) until its
    /// successor took the lead, so that the cluster has a leader while it stops. Returns whether
    /// the replicas were confirmed in sync in time.
    pub async fn drain_until(&self, deadline: tokio::time::Instant) -> bool {
        self.facts.start_draining();
        self.control.stop_standing();
        let leader = self.control.leader() == Some(self.node_id);
        let timeout = deadline.saturating_duration_since(tokio::time::Instant::now());
        tracing::info!(node_id = self.node_id, leader, timeout = ?timeout, "draining: replicas first, then stop");
        if self.control.state().members.len() > 1 {
            self.record_stopping(deadline).await;
        }
        let handoff_deadline = tokio::time::Instant::now() + LEAD_HANDOFF_WAIT;
        loop {
            let state = self.control.state();
            let (attached, owned) = self.facts.attached_count(&state, self.node_id);
            let (queued, _) = self.replicator.queue_lag();
            let alone = state.members.len() <= 1;
            // Leadership moves once a successor stands for election (see the reconciler); with
            // none (every other voter stops too) or after a while, this node stops as it is.
            let leads = self.control.is_leader()
                && state.successor_of(self.node_id).is_some()
                && tokio::time::Instant::now() < handoff_deadline;
            if alone || (attached == owned && queued == 0 && !leads) {
                tracing::info!(node_id = self.node_id, owned, leader = ?self.control.leader(), "drained: every owned bucket's replica is in sync");
                return true;
            }
            if tokio::time::Instant::now() >= deadline {
                tracing::warn!(
                    node_id = self.node_id,
                    attached,
                    owned,
                    queued,
                    leads,
                    "drain timeout: stopping with replicas not confirmed in sync or the lead not handed on"
                );
                return attached == owned && queued == 0;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Stops the node gracefully: no new connections, in-flight requests finish, Raft stops,
    /// the Raft storage is flushed and closed.
    pub async fn shutdown(self) {
        self.shutdown.send_replace(true);
        tracing::debug!(node_id = self.node_id, "stopping servers");
        for server in self.servers {
            let _ = server.await;
        }
        tracing::debug!(node_id = self.node_id, "servers stopped; stopping tasks");
        for task in self.tasks {
            task.abort();
            let _ = task.await;
        }
        tracing::debug!(node_id = self.node_id, "tasks stopped; stopping raft");
        self.control.shutdown().await;
        tracing::info!(node_id = self.node_id, "node stopped");
    }
}

/// The routes' limits: as configured, and never more than the body budget holds, so that a
/// body within them is always admitted (a value counts twice in the budget, itself and the
/// store's copy; a bulk body four times, as it came and parsed, and their copies).
fn limits_of(config: &ServeConfig) -> Limits {
    let largest = (config.body_budget() / crate::body_budget::COPIES) as usize;
    let max_value_bytes = (config.max_value_bytes as usize).min(largest);
    if max_value_bytes < config.max_value_bytes as usize {
        tracing::warn!(
            max_value_bytes,
            memory_limit = ?config.memory_limit,
            "--max-value-bytes is more than this node's --memory-limit lets bodies take (an eighth of it, each twice): values above this are refused"
        );
    }
    let bulk = (max_value_bytes * 4 / 3 + (64 << 10)).max(64 << 20);
    Limits {
        max_key_bytes: config.max_key_bytes,
        max_value_bytes,
        max_bulk_body_bytes: bulk.min(largest / shoal_http_api::PARSED_COPIES),
        ..Limits::default()
    }
}

/// The most recording that a node stops may take before its maintenance (a Raft commit; one
/// that does not come means no majority answers).
const RECORD_STOP_WAIT: Duration = Duration::from_secs(5);

/// Starts a node on the listeners `config` names.
pub async fn start(config: ServeConfig) -> Result<NodeHandle, StartError> {
    let listeners = Listeners::bind(&config).await?;
    start_with(config, listeners).await
}

/// What a node runs on besides its configuration: how it reaches other nodes, where its Raft
/// state lives, the addresses others use to reach it, and the values that must differ per
/// process start. Production builds one from the command line ([`start_with`]); the
/// simulation builds one per simulated host.
pub struct Environment {
    /// Node-to-node messages.
    pub transport: Arc<dyn Transport>,
    /// The same transport, as the control plane sees it.
    pub control_transport: Arc<dyn shoal_raft::ControlTransport>,
    /// Where the Raft state lives.
    pub storage: Storage,
    /// The API address others use.
    pub api_addr: String,
    /// The peer address others use.
    pub peer_addr: String,
    /// Random at every process start (peers notice a restart by it).
    pub incarnation: u64,
    /// Where replication request numbers start; must increase across restarts.
    pub first_seq: u64,
    /// The id of a new cluster, if this node bootstraps one.
    pub new_cluster_id: String,
    /// Sees every acknowledged write (the simulation's checks).
    pub probe: Option<Arc<dyn Probe>>,
}

/// Starts a node on listeners bound by the caller (tests bind port 0).
pub async fn start_with(config: ServeConfig, listeners: Listeners) -> Result<NodeHandle, StartError> {
    config.validate().map_err(StartError::Config)?;
    std::fs::create_dir_all(&config.data_dir)
        .map_err(|e| StartError::Io(format!("cannot create --data-dir {}: {e}", config.data_dir.display())))?;
    let local = |l: &TcpListener| l.local_addr().map_err(|e| StartError::Io(e.to_string()));
    let (api_bound, peer_bound) = (local(&listeners.api)?, local(&listeners.peer)?);
    let tls = config.tls().map_err(StartError::Config)?;
    if let Some(tls) = &tls {
        tls.cert.follow();
    }
    let acceptor = tls.as_ref().map(crate::tls::NodeTls::acceptor);
    let env = environment(&config, api_bound, peer_bound, tls.as_ref());
    let identity = Identity::load(&config.data_dir)?;
    if let Some(id) = identity.as_ref().filter(|id| id.retired) {
        return Err(retired(&config, id.node_id));
    }
    let io = |e: std::io::Error| StartError::Io(e.to_string());
    let (api_socket, peer_socket) = (listeners.api.into_std().map_err(io)?, listeners.peer.into_std().map_err(io)?);
    let (starting_stop, starting) =
        serve_while_starting([&api_socket, &peer_socket], identity.is_some(), acceptor.clone())?;
    let listeners = Listeners {
        api: TcpListener::from_std(api_socket).map_err(io)?,
        peer: TcpListener::from_std(peer_socket).map_err(io)?,
    };
    let mut config = config;
    if config.name.is_none() && !config.discover.is_empty() {
        config.name = crate::discover::hostname();
    }
    // A node rejoining after it was failed (main's loop) already knows where its cluster is.
    if identity.is_none() && !config.discover.is_empty() && config.join.is_empty() {
        discover_cluster(&mut config, &env).await?;
    }
    let serve = serving(&config, listeners, acceptor, starting_stop);
    let mut handle = start_in(config, env, identity, serve).await?;
    handle.api_addr = api_bound;
    handle.peer_addr = peer_bound;
    for server in starting {
        let _ = server.await;
    }
    Ok(handle)
}

/// A node's environment on real sockets: its transport (from its own loopback address when it
/// listens on one, so that firewall rules can tell nodes apart), its Raft storage in the data
/// dir, its advertised addresses, a random incarnation.
fn environment(
    config: &ServeConfig,
    api_bound: SocketAddr,
    peer_bound: SocketAddr,
    tls: Option<&crate::tls::NodeTls>,
) -> Environment {
    let ip = config.listen.ip();
    let local_ip = (ip.is_loopback() && !ip.is_unspecified()).then_some(ip);
    let secret = config.cluster_secret.as_ref().map(|s| s.expose().to_string());
    let transport = Arc::new(HttpTransport::new(
        local_ip,
        secret.as_deref(),
        crate::transport::http::Reconnect::with_timeout(config.reconnect_timeout),
        tls.map(|t| t.client.clone()),
    ));
    Environment {
        transport: transport.clone(),
        control_transport: transport,
        storage: Storage::Dir(config.data_dir.join("raft")),
        api_addr: config.advertise.clone().unwrap_or_else(|| api_bound.to_string()),
        peer_addr: config.peer_advertise.clone().unwrap_or_else(|| peer_bound.to_string()),
        incarnation: rand::random(),
        first_seq: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_micros() as u64)
            .unwrap_or(1),
        new_cluster_id: new_cluster_id(),
        probe: None,
    }
}

/// Until the node serves, both its ports answer at once: /livez, and 503 saying whether it
/// has data (see `discover::starting_router`). A bound port that accepted nothing would hold
/// every caller until its timeout: a member that still takes this address for the node it
/// knew (its Raft leader, say) while the node rejoins as a new member would wait half a minute
/// instead of asking another member. The starting servers stop when the sender turns true (the
/// real servers start) or is dropped (the start failed).
fn serve_while_starting(
    sockets: [&std::net::TcpListener; 2],
    has_data: bool,
    acceptor: Option<tokio_rustls::TlsAcceptor>,
) -> Result<(watch::Sender<bool>, Vec<JoinHandle<()>>), StartError> {
    let (stop, stopped) = watch::channel(false);
    let mut starting = Vec::new();
    for socket in sockets {
        let listener = socket.try_clone().and_then(TcpListener::from_std).map_err(|e| StartError::Io(e.to_string()))?;
        starting.push(http_server::serve(
            listener,
            crate::discover::starting_router(has_data),
            crate::metrics::ListenerMetrics::none(),
            acceptor.clone(),
            http_server::Limits::default(),
            stopped.clone(),
        ));
    }
    Ok((stop, starting))
}

/// Finds the cluster through `--discover`: this node bootstraps it (no cluster found, and it
/// is ordinal 0) or joins the members found.
async fn discover_cluster(config: &mut ServeConfig, env: &Environment) -> Result<(), StartError> {
    let name = config.name.clone().unwrap_or_default();
    let peers = Peers::new(env.transport.clone());
    let decision = crate::discover::discover(&peers, &config.discover, &name, config.join_timeout).await;
    match decision.map_err(StartError::Join)? {
        crate::discover::Decision::Bootstrap => {
            tracing::info!(name, "discovery: no cluster found; ordinal 0 creates one");
            config.join.clear();
        }
        crate::discover::Decision::Join(seeds) => {
            tracing::info!(name, seeds = ?seeds, "discovery: joining the cluster");
            config.join = seeds;
        }
    }
    Ok(())
}

/// What starts the node's servers on `listeners` once its parts are built: the peer listener
/// (behind the cluster secret) and the client API (behind the tokens); the checks are layered
/// only when there is something to check, as a layer costs every request a boxed future and a
/// clone of the service behind it. Peer links leave the HTTP server once upgraded: the node's
/// shutdown waits for them (and the requests they are handling) separately. The starting
/// servers stop as these start.
fn serving(
    config: &ServeConfig,
    listeners: Listeners,
    acceptor: Option<tokio_rustls::TlsAcceptor>,
    starting_stop: watch::Sender<bool>,
) -> impl FnOnce(Arc<PeerService>, &watch::Sender<bool>) -> Vec<JoinHandle<()>> {
    let tokens = crate::auth::Tokens { admin: config.admin_token.clone(), client: config.client_token.clone() };
    let cluster_secret = config.cluster_secret.clone();
    let client_limits = config.client_limits();
    move |service: Arc<PeerService>, shutdown: &watch::Sender<bool>| {
        let metrics = service.api.metrics();
        let (served, all_served) = crate::transport::link::served(metrics.peer_listener.open.clone());
        let mut links_stop = shutdown.subscribe();
        let links_done = tokio::spawn(async move {
            let _ = links_stop.wait_for(|stop| *stop).await;
            let _ = tokio::time::timeout(2 * http_server::DRAIN_TIMEOUT, all_served.wait()).await;
        });
        let mut peer_router = peers::peer_routes(service.clone(), shutdown.subscribe(), served);
        if cluster_secret.is_some() {
            peer_router = peer_router
                .layer(axum::middleware::from_fn_with_state(cluster_secret.clone(), crate::auth::require_secret));
        }
        let mut api_router = shoal_http_api::router(service.api.clone());
        if tokens.any() {
            api_router =
                api_router.layer(axum::middleware::from_fn_with_state(tokens.clone(), crate::auth::require_tokens));
        }
        let peer_limits = http_server::Limits::default();
        let servers = vec![
            http_server::serve(
                listeners.peer,
                peer_router,
                metrics.peer_listener.clone(),
                acceptor.clone(),
                peer_limits,
                shutdown.subscribe(),
            ),
            http_server::serve(
                listeners.api,
                api_router,
                metrics.client_listener.clone(),
                acceptor,
                client_limits,
                shutdown.subscribe(),
            ),
            links_done,
        ];
        starting_stop.send_replace(true);
        servers
    }
}

/// Starts a node in `env` with the identity its data dir held (if any). `serve` starts serving
/// the node's [`PeerService`] (and its public API) to others, once it is built and before the
/// node joins; it returns the tasks that serve, which stop when the shutdown signal turns
/// true.
pub async fn start_in(
    config: ServeConfig,
    env: Environment,
    identity: Option<Identity>,
    serve: impl FnOnce(Arc<PeerService>, &watch::Sender<bool>) -> Vec<JoinHandle<()>>,
) -> Result<NodeHandle, StartError> {
    let peers = Peers::new(env.transport.clone());
    let admin = shoal_raft::AdminClient::new(env.control_transport.clone(), Duration::from_secs(40));
    let joiner = Joiner::new(config.join.clone(), config.join_timeout, peers.clone(), admin).forced(config.force_join);
    let restarted = identity.is_some();
    let identity = identity_of(&config, &env, identity, &joiner).await?;
    let mut control_config = ControlConfig::new(
        identity.node_id,
        env.api_addr.clone(),
        env.peer_addr.clone(),
        env.storage.clone(),
        env.control_transport.clone(),
    );
    let (heartbeat, election_timeout) = config.raft_timing();
    control_config.heartbeat = heartbeat;
    control_config.name = config.name.clone();
    control_config.election_timeout = election_timeout;
    let control = ControlPlane::open(control_config).await?;
    let parts = Parts::build(&config, &env, control, peers, restarted);
    let (shutdown, _) = watch::channel(false);
    let servers = serve(parts.peer_service(&config), &shutdown);
    let mut handle = NodeHandle {
        node_id: identity.node_id,
        api_addr: env.api_addr.parse().unwrap_or_else(|_| SocketAddr::from(([0, 0, 0, 0], 0))),
        peer_addr: env.peer_addr.parse().unwrap_or_else(|_| SocketAddr::from(([0, 0, 0, 0], 0))),
        control: parts.control.clone(),
        cache: parts.cache.clone(),
        shutdown,
        servers,
        tasks: Vec::new(),
        rejoin: Arc::new(parking_lot::Mutex::new(None)),
        facts: parts.core.facts().clone(),
        replicator: parts.replicator.clone(),
        api: parts.api.clone(),
    };
    if let Err(e) = join_or_resume(&config, &identity, &parts.control, &joiner).await {
        handle.shutdown().await;
        return Err(e);
    }
    let node_id = identity.node_id;
    handle.tasks = parts.run(&config, identity, &handle);
    tracing::info!(node_id, api = %env.api_addr, peer = %env.peer_addr, "node ready");
    Ok(handle)
}

/// The node's identity: the one its data dir held, or a new one — node 1 of a new cluster
/// without `--join`, else the id the cluster gives it on registration — stored before it is
/// used.
async fn identity_of(
    config: &ServeConfig,
    env: &Environment,
    identity: Option<Identity>,
    joiner: &Joiner,
) -> Result<Identity, StartError> {
    let identity = match identity {
        Some(id) => {
            if !config.join.is_empty() {
                tracing::warn!(
                    node_id = id.node_id,
                    cluster_id = %id.cluster_id,
                    data_dir = %config.data_dir.display(),
                    "the data dir already holds a member of a cluster: --join is ignored and the node restarts as \
                     that member (to join as a new member, start with an empty --data-dir)"
                );
            }
            return Ok(id);
        }
        None if config.join.is_empty() => Identity::new(1, env.new_cluster_id.clone(), Vec::new()),
        None => {
            let registered = joiner
                .register(&env.api_addr, &env.peer_addr, config.name.as_deref())
                .await
                .map_err(StartError::Join)?;
            let id = Identity::new(registered.node_id, registered.cluster_id, config.join.clone());
            tracing::info!(node_id = id.node_id, cluster_id = %id.cluster_id, "registered with the cluster");
            id
        }
    };
    identity.store(&config.data_dir)?;
    Ok(identity)
}

/// Every part of a running node, built once its control plane is open.
struct Parts {
    control: ControlPlane,
    cache: Arc<CacheStore>,
    metrics: Arc<NodeMetrics>,
    progress: Arc<Progress>,
    replicator: Arc<Replicator>,
    mirrors: Arc<crate::mirror::Mirrors>,
    health: Arc<Health>,
    core: Arc<BucketCore>,
    balancer: Arc<crate::balance::Balancer>,
    api: Arc<NodeApi>,
    peers: Peers,
    entry: Arc<crate::maintenance::Entry>,
}

impl Parts {
    /// Builds the data plane on `control`, bottom up: the store and what this node knows of
    /// its buckets, replication, failure detection, the bucket core, balancing, the node API.
    fn build(config: &ServeConfig, env: &Environment, control: ControlPlane, peers: Peers, restarted: bool) -> Self {
        let node_id = control.node_id();
        let cache = Arc::new(CacheStore::new(config.cache_size, Clock::new()).with_policy(config.eviction));
        let metrics = Arc::new(NodeMetrics::new());
        metrics.state.memory_limit_bytes.set(config.memory_limit.unwrap_or(0) as f64);
        let progress = Arc::new(Progress::default());
        // Buckets handed to this node in a transfer that is still running come back from their
        // shadows before this node serves them (its memory is empty after a restart).
        let facts = Arc::new(LocalFacts::default());
        facts.mark_restoring(&control.state(), node_id, restarted);
        let half = config.cache_size / 2;
        let replicator =
            Replicator::new(control.clone(), cache.clone(), half, facts.clone(), peers.clone(), env.first_seq);
        let latency = Some(metrics.mirror_latency.clone());
        let mirrors = crate::mirror::Mirrors::new(node_id, config.mirror_config(), latency, env.incarnation);
        let health = Health::new(
            control.clone(),
            config.health_config(),
            replicator.clone(),
            peers.clone(),
            env.incarnation,
            mirrors.clone(),
            facts.clone(),
        );
        let weak = Arc::downgrade(&health);
        control.set_liveness(Arc::new(move |id| weak.upgrade().is_none_or(|h| h.answers(id))));
        let core = Arc::new(BucketCore::new(
            control.clone(),
            cache.clone(),
            facts,
            health.clone(),
            replicator.clone(),
            peers.clone(),
            env.probe.clone(),
        ));
        let balancer = crate::balance::Balancer::new(
            control.clone(),
            core.clone(),
            cache.clone(),
            progress.clone(),
            peers.clone(),
            config.balance_config(),
        );
        let weak = Arc::downgrade(&balancer);
        control.set_bucket_sizes(Arc::new(move || weak.upgrade().and_then(|b| b.bucket_sizes())));
        let entry = Arc::new(crate::maintenance::Entry::default());
        let node_parts = NodeParts {
            metrics: metrics.clone(),
            progress: progress.clone(),
            core: core.clone(),
            replicator: replicator.clone(),
            health: health.clone(),
            peers: peers.clone(),
            bodies: Arc::new(crate::body_budget::BodyBudget::new(config.body_budget())),
            mirrors: mirrors.clone(),
            balancer: balancer.clone(),
            https: config.tls_cert.is_some(),
            entry: entry.clone(),
        };
        let api = Arc::new(NodeApi::new(control.clone(), cache.clone(), limits_of(config), node_parts));
        Parts { control, cache, metrics, progress, replicator, mirrors, health, core, balancer, api, peers, entry }
    }

    /// What answers other nodes.
    fn peer_service(&self, config: &ServeConfig) -> Arc<PeerService> {
        let exporter = Exporter {
            control: self.control.clone(),
            cache: self.cache.clone(),
            config: config.transfer_config(),
            progress: self.progress.clone(),
            facts: self.core.facts().clone(),
            replicator: self.replicator.clone(),
        };
        Arc::new(PeerService::new(
            self.control.clone(),
            self.api.clone(),
            self.replicator.clone(),
            exporter,
            self.health.clone(),
        ))
    }

    /// Starts the node's background tasks, the reconciler last, once it is a member.
    fn run(self, config: &ServeConfig, identity: Identity, handle: &NodeHandle) -> Vec<JoinHandle<()>> {
        let Parts {
            control, cache, metrics, progress, replicator, mirrors, health, core, balancer, peers, entry, ..
        } = self;
        let reconciler = Reconciler::new(crate::reconcile::Parts {
            core: core.clone(),
            store: cache.clone(),
            control: control.clone(),
            replicator: replicator.clone(),
            health: health.clone(),
            peers: peers.clone(),
            progress,
            metrics: metrics.clone(),
            transfer: config.transfer_config(),
            limits: (config.cache_size, config.cache_size / 2),
            identity: (identity, config.data_dir.clone()),
            shutdown: handle.shutdown.clone(),
            rejoin: handle.rejoin.clone(),
            entry,
            balancer: balancer.clone(),
        });
        vec![
            tokio::spawn(sweep_expired(cache)),
            tokio::spawn(sweep_expired(replicator.holder.replica().clone())),
            tokio::spawn(metrics_upkeep(metrics)),
            tokio::spawn(replicate_evictions(core)),
            tokio::spawn(health.run()),
            tokio::spawn(balancer.run()),
            tokio::spawn(mirrors.ping_idle(control, peers)),
            tokio::spawn(reconciler.run()),
        ]
    }
}

/// Brings the control plane to "this node is a member with a map": bootstrap, admission, or
/// a restart check.
async fn join_or_resume(
    config: &ServeConfig,
    identity: &Identity,
    control: &ControlPlane,
    joiner: &Joiner,
) -> Result<(), StartError> {
    let node_id = identity.node_id;
    let state = control.state();
    if state.retired.contains(&node_id) {
        return Err(retired(config, node_id));
    }
    if state.failed.contains(&node_id) {
        return Err(failed(&state, node_id));
    }
    if state.is_member(node_id) {
        // A restart: unless another member says we were removed meanwhile, carry on; Raft
        // catches up by itself.
        match removed_while_down(control, node_id).await {
            Some(MemberStatus::Retired) => return Err(retired(config, node_id)),
            Some(MemberStatus::Failed) => return Err(failed(&state, node_id)),
            _ => return Ok(()),
        }
    }
    if identity.join.is_empty() {
        tracing::info!(cluster_id = %identity.cluster_id, "bootstrapping a new cluster");
        control.bootstrap(&identity.cluster_id, config.voters, config.replication).await?;
    } else {
        let map_version = joiner.admit(node_id).await.map_err(StartError::Join)?;
        tracing::info!(node_id, map_version, "admitted to the cluster");
    }
    let member = control.wait_for_state(Duration::from_secs(30), |s| s.is_member(node_id)).await;
    if !member {
        return Err(crate::join::JoinError::NotApplied(Duration::from_secs(30)).into());
    }
    match control.state().cluster_id.as_deref() {
        Some(id) if id == identity.cluster_id => Ok(()),
        other => Err(crate::join::JoinError::OtherCluster {
            data_dir: identity.cluster_id.clone(),
            joined: other.map(str::to_string),
        }
        .into()),
    }
}

/// Asks the other members (briefly) whether `node_id` was removed (left or failed) while it
/// was down.
async fn removed_while_down(control: &ControlPlane, node_id: NodeId) -> Option<MemberStatus> {
    let state = control.state();
    for member in state.members.iter().filter(|m| m.id != node_id) {
        let status = control.admin_client().member_status(&member.peer_addr, node_id);
        if let Ok(Ok(status)) = tokio::time::timeout(Duration::from_secs(2), status).await {
            return Some(status);
        }
    }
    None
}

/// The error of a node the cluster failed: where to join again.
fn failed(state: &ClusterState, node_id: NodeId) -> StartError {
    let join = state.members.iter().filter(|m| m.id != node_id).map(|m| m.api_addr.clone()).collect();
    StartError::Failed { node_id, join }
}

/// A file of the data dir that could not be removed.
#[derive(Debug, thiserror::Error)]
#[error("cannot remove {}: {source}", path.display())]
pub struct DiscardError {
    /// The file or directory.
    pub path: std::path::PathBuf,
    /// Why.
    pub source: std::io::Error,
}

/// Discards what a failed node holds in its data dir (its identity and Raft state), so that
/// it can join again as a new member.
pub fn discard_data_dir(data_dir: &std::path::Path) -> Result<(), DiscardError> {
    let remove = |p: &std::path::Path| match std::fs::metadata(p) {
        Ok(m) if m.is_dir() => std::fs::remove_dir_all(p),
        Ok(_) => std::fs::remove_file(p),
        Err(_) => Ok(()),
    };
    for name in ["node.json", "raft"] {
        let path = data_dir.join(name);
        remove(&path).map_err(|source| DiscardError { path, source })?;
    }
    Ok(())
}

fn retired(config: &ServeConfig, node_id: NodeId) -> StartError {
    StartError::Retired(format!(
        "node {node_id} has left its cluster and cannot start again on {}; \
         remove that directory (or use another --data-dir) to join as a new member",
        config.data_dir.display()
    ))
}

fn new_cluster_id() -> String {
    use rand::Rng;
    let bytes: [u8; 16] = rand::rng().random();
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Sends the store's evictions to the replicas, forever (see
/// [`BucketCore::replicate_evictions`]).
async fn replicate_evictions(core: Arc<BucketCore>) {
    core.store_keeps_evictions();
    loop {
        tokio::time::sleep(Duration::from_millis(200)).await;
        core.replicate_evictions();
    }
}

/// Folds buffered latency samples into the histograms every few seconds.
async fn metrics_upkeep(metrics: Arc<NodeMetrics>) {
    let mut tick = tokio::time::interval(Duration::from_secs(5));
    loop {
        tick.tick().await;
        metrics.upkeep();
    }
}

/// Removes expired items in the background: a tenth of the buckets per second, so every
/// bucket is swept every ten seconds (reads remove expired items on the spot anyway).
async fn sweep_expired(cache: Arc<CacheStore>) {
    let mut tick = tokio::time::interval(Duration::from_millis(100));
    let mut next = 0u16;
    loop {
        tick.tick().await;
        let buckets: Vec<BucketId> = (0..10).map(|i| BucketId((next + i) % shoal_raft::BUCKET_COUNT as u16)).collect();
        next = (next + 10) % shoal_raft::BUCKET_COUNT as u16;
        cache.sweep_expired(buckets);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The routes' limits come from the body budget: at `--memory-limit 256MiB` a bulk body
    /// is at most 8 MiB (four times in a 32 MiB budget); without a limit they are as before;
    /// a value larger than a small budget holds is cut to what it holds.
    #[test]
    fn the_routes_limits_fit_the_body_budget() {
        let addr: SocketAddr = "127.0.0.1:0".parse().expect("an address");
        let mut config = ServeConfig::for_test(addr, addr, "unused".into());
        let limits = limits_of(&config);
        assert_eq!((limits.max_value_bytes, limits.max_bulk_body_bytes), (16 << 20, 64 << 20));
        config.memory_limit = Some(256 << 20);
        let limits = limits_of(&config);
        assert_eq!((limits.max_value_bytes, limits.max_bulk_body_bytes), (16 << 20, 8 << 20));
        config.memory_limit = Some(64 << 20);
        let limits = limits_of(&config);
        assert_eq!((limits.max_value_bytes, limits.max_bulk_body_bytes), (4 << 20, 2 << 20));
    }
}
