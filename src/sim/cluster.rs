//! [`SimCluster`]: real nodes (Raft included) on the [`SimNetwork`], each with a memory disk
//! that survives its crashes, started, killed, restarted, joined and removed by the
//! simulation.
//!
//! Every host has a supervisor task that does what `main` and the operating system do for a
//! real node: start it (bootstrap, join or restart, by what its data dir holds), and when it
//! stops by itself, either let it go (it left) or discard its data and join again as a new
//! member (the cluster failed it). A kill isolates the host on the network at once (nothing it
//! does from then on reaches anyone), keeps a copy of its disk as the crash left it, and stops
//! the old instance.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use shoal_raft::disk::MemoryDisk;
use shoal_raft::{NodeId, Storage};
use tokio::sync::{mpsc, watch};

use super::network::{HostId, SimNetwork};
use crate::bucket::Probe;
use crate::config::ServeConfig;
use crate::identity::Identity;
use crate::node::PeerService;
use crate::node::{self, Environment, StartError};

/// Where a host is in its life.
#[derive(Clone)]
pub enum HostPhase {
    /// Starting (bootstrapping, joining, restarting).
    Starting,
    /// Serving as member `node_id`.
    Running {
        /// Its member id.
        node_id: NodeId,
        /// What it answers.
        service: Arc<PeerService>,
    },
    /// Killed; waits to be restarted.
    Down,
    /// Left the cluster; never starts again.
    Retired,
}

/// One simulated machine.
pub struct SimHost {
    /// Its API address.
    pub api_addr: String,
    /// Its peer address.
    pub peer_addr: String,
    /// Where it is in its life.
    pub phase: HostPhase,
    data_dir: PathBuf,
    disk: MemoryDisk,
    join: Vec<String>,
    generation: u64,
    commands: mpsc::UnboundedSender<Command>,
}

enum Command {
    Kill,
    /// SIGTERM: the node stops as on a signal, then stays down until restarted.
    Stop,
    Restart,
}

/// The hosts, shared with their supervisors.
struct Shared {
    net: Arc<SimNetwork>,
    hosts: Mutex<Vec<SimHost>>,
    rng: Mutex<StdRng>,
    started: tokio::time::Instant,
    configure: fn(&mut ServeConfig),
    changed: watch::Sender<u64>,
    probe: Option<Arc<dyn Probe>>,
    /// How long a flush of a new host's disk takes (none: it returns at once).
    flush_latency: Mutex<Option<Duration>>,
}

/// A simulated cluster (see the module docs).
pub struct SimCluster {
    shared: Arc<Shared>,
    _dir: tempfile::TempDir,
    root: PathBuf,
}

/// How the nodes of a simulation are configured: fast failure detection and Raft timings, as
/// in the fault tests.
pub fn sim_config(config: &mut ServeConfig) {
    config.ping_interval = Duration::from_millis(200);
    config.node_timeout = Duration::from_secs(1);
    config.raft_heartbeat = Some(Duration::from_millis(150));
    config.raft_election_timeout = Some(Duration::from_millis(1000));
    config.reconnect_timeout = Duration::from_secs(5);
    config.cache_size = 64 * 1024 * 1024;
}

impl SimCluster {
    /// An empty cluster on `net`; `seed` drives its own random choices (incarnations).
    /// `configure` adjusts every node's configuration; `probe` sees every acknowledged write.
    pub fn new(
        net: Arc<SimNetwork>,
        seed: u64,
        configure: fn(&mut ServeConfig),
        probe: Option<Arc<dyn Probe>>,
    ) -> Self {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("a temp dir for the simulation: {e}"));
        let root = dir.path().to_path_buf();
        let shared = Arc::new(Shared {
            net,
            hosts: Mutex::new(Vec::new()),
            rng: Mutex::new(StdRng::seed_from_u64(seed ^ 0x5eed)),
            started: tokio::time::Instant::now(),
            configure,
            changed: watch::channel(0).0,
            probe,
            flush_latency: Mutex::new(None),
        });
        SimCluster { shared, _dir: dir, root }
    }

    /// The network.
    pub fn net(&self) -> &Arc<SimNetwork> {
        &self.shared.net
    }

    /// Adds a host and starts it: the first one bootstraps the cluster, later ones join
    /// through the running hosts and then those that may come back. Returns its id; it is a
    /// member once [`Self::running`] lists it.
    pub fn add_host(&self) -> HostId {
        let (tx, rx) = mpsc::unbounded_channel();
        let h = {
            let mut hosts = self.shared.hosts.lock();
            let h = hosts.len();
            // The running hosts first, then those that may come back (as a discovery list
            // of every pod): a host added while few run (after a full stop) still finds the
            // cluster when those few leave. Only the very first host bootstraps one.
            let running = |x: &&SimHost| matches!(x.phase, HostPhase::Running { .. });
            let back = |x: &&SimHost| matches!(x.phase, HostPhase::Starting | HostPhase::Down);
            let join =
                hosts.iter().filter(running).chain(hosts.iter().filter(back)).map(|x| x.api_addr.clone()).collect();
            let ip = format!("10.0.{}.{}", h / 250, h % 250 + 1);
            let host = SimHost {
                api_addr: format!("{ip}:7000"),
                peer_addr: format!("{ip}:17000"),
                phase: HostPhase::Starting,
                data_dir: self.root.join(format!("host{h}")),
                disk: self.shared.new_disk(),
                join,
                generation: 0,
                commands: tx,
            };
            self.shared.net.name(h, &[&host.api_addr, &host.peer_addr]);
            hosts.push(host);
            h
        };
        tokio::spawn(supervise(self.shared.clone(), h, rx));
        h
    }

    /// Kills `h` (it must be running): it is cut off at once; its disk stays as the crash left
    /// it.
    pub fn kill(&self, h: HostId) {
        self.crash(h, usize::MAX);
    }

    /// Kills `h` as [`Self::kill`] does, its disk keeping only the first `kept` of the writes
    /// it had not flushed (see [`Self::unflushed`]).
    pub fn crash(&self, h: HostId, kept: usize) {
        self.shared.net.kill(h);
        let mut hosts = self.shared.hosts.lock();
        let host = &mut hosts[h];
        host.disk = host.disk.crash(kept);
        host.phase = HostPhase::Down;
        let _ = host.commands.send(Command::Kill);
    }

    /// Flushes of the disks of hosts added or emptied from now on take `latency` (a crash
    /// meanwhile may lose what they were making durable).
    pub fn set_flush_latency(&self, latency: Duration) {
        *self.shared.flush_latency.lock() = Some(latency);
    }

    /// How many writes host `h`'s disk has not flushed.
    pub fn unflushed(&self, h: HostId) -> usize {
        self.shared.hosts.lock()[h].disk.unflushed()
    }

    /// Stops host `h` as SIGTERM does (it records its stop, goes into maintenance for its
    /// restart window when it can, drains, closes), on a network that still reaches it; it
    /// counts as down from now on, and stays down until restarted.
    pub fn stop(&self, h: HostId) {
        let mut hosts = self.shared.hosts.lock();
        hosts[h].phase = HostPhase::Down;
        let _ = hosts[h].commands.send(Command::Stop);
    }

    /// Starts a killed or stopped host again on its data dir and disk.
    pub fn restart(&self, h: HostId) {
        let mut hosts = self.shared.hosts.lock();
        hosts[h].phase = HostPhase::Starting;
        let _ = hosts[h].commands.send(Command::Restart);
    }

    /// Every host's id and phase.
    pub fn phases(&self) -> Vec<(HostId, HostPhase)> {
        self.shared.hosts.lock().iter().enumerate().map(|(h, x)| (h, x.phase.clone())).collect()
    }

    /// The running hosts: id, member id, service.
    pub fn running(&self) -> Vec<(HostId, NodeId, Arc<PeerService>)> {
        self.phases()
            .into_iter()
            .filter_map(|(h, p)| match p {
                HostPhase::Running { node_id, service } => Some((h, node_id, service)),
                _ => None,
            })
            .collect()
    }

    /// The API address of host `h`.
    pub fn api_addr(&self, h: HostId) -> String {
        self.shared.hosts.lock()[h].api_addr.clone()
    }

    /// Waits until a host changes phase (or `timeout` passes).
    pub async fn changed(&self, timeout: Duration) {
        let mut rx = self.shared.changed.subscribe();
        rx.borrow_and_update();
        let _ = tokio::time::timeout(timeout, rx.changed()).await;
    }
}

impl Shared {
    /// An empty disk for a host.
    fn new_disk(&self) -> MemoryDisk {
        match *self.flush_latency.lock() {
            Some(latency) => MemoryDisk::default().with_flush_latency(latency),
            None => MemoryDisk::default(),
        }
    }

    fn set_phase(&self, h: HostId, phase: HostPhase) {
        self.hosts.lock()[h].phase = phase;
        self.changed.send_modify(|n| *n += 1);
    }

    /// A failed node's data dir and disk are discarded; it joins again through `join`.
    fn discard(&self, h: HostId, join: Vec<String>) {
        let mut hosts = self.hosts.lock();
        let host = &mut hosts[h];
        if let Err(e) = node::discard_data_dir(&host.data_dir) {
            tracing::error!(host = h, error = %e, "cannot discard the data dir");
        }
        host.disk = self.new_disk();
        host.join = join;
    }

    /// Everything `start_in` needs for the next instance of `h`.
    fn prepare(self: &Arc<Self>, h: HostId) -> Result<(ServeConfig, Environment, Option<Identity>, u64), String> {
        let mut hosts = self.hosts.lock();
        let host = &mut hosts[h];
        host.generation += 1;
        let generation = host.generation;
        std::fs::create_dir_all(&host.data_dir).map_err(|e| e.to_string())?;
        let api: std::net::SocketAddr = host.api_addr.parse().map_err(|e| format!("{e}"))?;
        let peer: std::net::SocketAddr = host.peer_addr.parse().map_err(|e| format!("{e}"))?;
        let mut config = ServeConfig::for_test(api, peer, host.data_dir.clone());
        sim_config(&mut config);
        (self.configure)(&mut config);
        config.join = host.join.clone();
        self.net.boot(h, generation);
        let transport = self.net.transport(h, generation);
        let mut rng = self.rng.lock();
        let env = Environment {
            transport: transport.clone(),
            control_transport: transport,
            storage: Storage::Memory(host.disk.clone()),
            api_addr: host.api_addr.clone(),
            peer_addr: host.peer_addr.clone(),
            incarnation: rng.random(),
            // Increases across restarts: microseconds of simulated time.
            first_seq: self.started.elapsed().as_micros() as u64 + 1,
            new_cluster_id: format!("sim{:016x}", rng.random::<u64>()),
            probe: self.probe.clone(),
        };
        let identity = Identity::load(&host.data_dir).map_err(|e| e.to_string())?;
        Ok((config, env, identity, generation))
    }
}

/// Runs host `h` for its whole life (see the module docs).
async fn supervise(shared: Arc<Shared>, h: HostId, mut commands: mpsc::UnboundedReceiver<Command>) {
    loop {
        let (config, env, identity, generation) = match shared.prepare(h) {
            Ok(p) => p,
            Err(e) => {
                tracing::error!(host = h, error = %e, "cannot prepare the host");
                return;
            }
        };
        let net = shared.net.clone();
        let served = Arc::new(Mutex::new(None));
        let keep = served.clone();
        let serve = move |service: Arc<PeerService>, _: &watch::Sender<bool>| {
            net.serve(h, generation, service.clone());
            *keep.lock() = Some(service);
            Vec::new()
        };
        let (window, drain) = (config.restart_window, config.drain_timeout);
        match node::start_in(config, env, identity, serve).await {
            Ok(node) => {
                let Some(service) = served.lock().take() else { return };
                shared.set_phase(h, HostPhase::Running { node_id: node.node_id(), service });
                tokio::select! {
                    biased;
                    command = commands.recv() => {
                        match command {
                            Some(Command::Stop) => {
                                node.stop_on_signal(window, drain).await;
                                shared.net.kill(h);
                                // The process exited: nothing of it writes to its disk again.
                                let mut hosts = shared.hosts.lock();
                                hosts[h].disk = hosts[h].disk.copy();
                            }
                            // Killed (the network has cut it off already): the old instance stops.
                            Some(Command::Kill | Command::Restart) => node.shutdown().await,
                            None => {
                                node.shutdown().await;
                                return;
                            }
                        }
                        loop {
                            match commands.recv().await {
                                Some(Command::Restart) => break,
                                Some(Command::Kill | Command::Stop) => {}
                                None => return,
                            }
                        }
                    }
                    () = node.stopped() => {
                        let rejoin = node.rejoin();
                        shared.net.kill(h);
                        node.shutdown().await;
                        match rejoin {
                            Some(join) => shared.discard(h, join),
                            None => {
                                shared.set_phase(h, HostPhase::Retired);
                                return;
                            }
                        }
                    }
                }
            }
            Err(StartError::Failed { join, .. }) => {
                shared.net.kill(h);
                shared.discard(h, join);
            }
            Err(StartError::Retired(_)) => {
                shared.net.kill(h);
                shared.set_phase(h, HostPhase::Retired);
                return;
            }
            Err(e) => {
                tracing::warn!(host = h, error = %e, "start failed; trying again");
                shared.net.kill(h);
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        }
        shared.set_phase(h, HostPhase::Starting);
    }
}
