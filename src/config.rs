//! The command line: `shoal serve` and the client subcommands, every flag also an
//! environment variable (`SHOAL_<FLAG>`).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Parser, Subcommand, ValueEnum};

/// shoal: a distributed in-memory cache with a REST API.
#[derive(Debug, Parser)]
#[command(name = "shoal", version, about, propagate_version = true, after_help = EXIT_CODES)]
pub struct Cli {
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// What the exit status of a client command means (shown by `shoal --help`).
pub const EXIT_CODES: &str = "Exit status: 0 success; 1 any other failure; 2 usage (a bad flag or argument, \
or a request the node refused as malformed); 3 not found (the key, or the member, does not exist; \
like grep finding nothing); 4 unavailable (no node answered, the node answered 503, or \
`status` found no leader or lost buckets, or `status --wait` timed out).";

/// The subcommands.
#[derive(Debug, Subcommand)]
// Parsed once at start-up: the size of the serve variant does not matter.
#[allow(clippy::large_enum_variant)]
pub enum Command {
    /// Run a node: bootstrap a new cluster, join one (--join), or restart from --data-dir.
    Serve(ServeConfig),
    /// Read a key and print its value.
    Get(KeyArgs),
    /// Write a key (VALUE, or standard input when VALUE is `-` or missing).
    Put(PutArgs),
    /// Delete a key.
    Del(KeyArgs),
    /// List keys by prefix (`--prefix`) or tag (`--tag`), sorted, from every member.
    Ls(LsArgs),
    /// Show the cluster's members, roles, buckets, items and bytes (and transfer progress).
    Status(StatusArgs),
    /// Show the distribution map.
    Map(ClientArgs),
    /// Show the cluster's event log (joins, leaves, moves, failovers...); `-f` follows it.
    Events(EventsArgs),
    /// Show the mirrors the node reads from: alive or dead, probability, and per karma block
    /// requests, errors, latency and pings (like Manticore's SHOW AGENT STATUS).
    Agents(AgentsArgs),
    /// Show the buckets with the most bytes (or items, reads, writes) as the leader last heard
    /// of them, and each member's share.
    Buckets(BucketsArgs),
    /// Balance the map by data: every member gets nearly the same bytes (or NAME the average);
    /// `--dry-run` shows the plan and changes nothing.
    Rebalance(RebalanceArgs),
    /// Make a member leave the cluster (its buckets are spread over the others).
    Leave(LeaveArgs),
    /// Member commands: `shoal node leave NAME|ID`, `shoal node maintenance NAME|ID [--for 10m] [--end]`.
    #[command(subcommand)]
    Node(NodeCommand),
    /// Lost buckets: `shoal lost clear [BUCKET...]`.
    #[command(subcommand)]
    Lost(LostCommand),
    /// Cluster settings: `shoal config get`, `shoal config set replication sync|async`,
    /// `shoal config set auto_balance true|false`.
    #[command(subcommand)]
    Config(ConfigCommand),
    /// Print a shell completion script: `shoal completions bash > /etc/bash_completion.d/shoal`.
    Completions(CompletionsArgs),
    /// Measure throughput, latency and server CPU per operation against a node or cluster.
    Bench(BenchArgs),
}

/// `shoal completions SHELL`.
#[derive(Debug, Clone, Args)]
pub struct CompletionsArgs {
    /// The shell: bash, zsh, fish, elvish or powershell.
    pub shell: clap_complete::Shell,
}

/// `shoal config ...`.
#[derive(Debug, Clone, Subcommand)]
pub enum ConfigCommand {
    /// Print every cluster setting.
    Get(ClientArgs),
    /// Change one cluster setting: `replication sync|async` or `auto_balance true|false`.
    Set(ConfigSetArgs),
}

/// `shoal config set SETTING VALUE`.
#[derive(Debug, Clone, Args)]
pub struct ConfigSetArgs {
    /// The setting: `replication` or `auto_balance`.
    pub setting: String,
    /// Its new value.
    pub value: String,
    /// Where to connect and how to print.
    #[command(flatten)]
    pub client: ClientArgs,
}

/// `shoal ls`.
#[derive(Debug, Clone, Args)]
pub struct LsArgs {
    /// Keys starting with this (default: every key).
    #[arg(long, conflicts_with = "tag")]
    pub prefix: Option<String>,
    /// Keys with this tag instead.
    #[arg(long)]
    pub tag: Option<String>,
    /// At most this many keys (1 to 100000); `--all` pages through every key instead.
    #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u32).range(1..=100_000))]
    pub limit: u32,
    /// Every matching key, page by page (`--limit` keys a page).
    #[arg(long)]
    pub all: bool,
    /// Only keys sorting after this one (the `next` of an earlier page).
    #[arg(long)]
    pub start_after: Option<String>,
    /// Where to connect and how to print.
    #[command(flatten)]
    pub client: ClientArgs,
}

/// `shoal events`.
#[derive(Debug, Clone, Args)]
pub struct EventsArgs {
    /// The client options.
    #[command(flatten)]
    pub client: ClientArgs,
    /// Only events after this Raft index.
    #[arg(long, default_value_t = 0)]
    pub since: u64,
    /// Without --since: only the last this many events.
    #[arg(long, default_value_t = 20)]
    pub last: usize,
    /// Keep printing new events as they happen, until Ctrl-C.
    #[arg(short = 'f', long)]
    pub follow: bool,
}

/// `shoal agents`.
#[derive(Debug, Clone, Args)]
pub struct AgentsArgs {
    /// The client options.
    #[command(flatten)]
    pub client: ClientArgs,
    /// How many karma blocks to show per mirror, newest first (at most 15 are kept).
    #[arg(long, default_value_t = 2)]
    pub blocks: usize,
}

/// `shoal buckets`.
#[derive(Debug, Clone, Args)]
pub struct BucketsArgs {
    /// The client options.
    #[command(flatten)]
    pub client: ClientArgs,
    /// How many buckets to show.
    #[arg(long, default_value_t = 20)]
    pub top: usize,
    /// The order: bytes, items, reads, writes or bucket.
    #[arg(long, default_value = "bytes")]
    pub sort: String,
    /// Only this member's buckets (its name or id).
    #[arg(long)]
    pub node: Option<String>,
}

/// `shoal rebalance`.
#[derive(Debug, Clone, Args)]
pub struct RebalanceArgs {
    /// Bring only this member (its name or id) to the average.
    pub node: Option<String>,
    /// Show the plan; change nothing.
    #[arg(long)]
    pub dry_run: bool,
    /// The client options.
    #[command(flatten)]
    pub client: ClientArgs,
}

/// How `shoal serve` runs a node.
#[derive(Debug, Clone, Args)]
pub struct ServeConfig {
    /// Client API address to listen on (`HOST:PORT`; a host name is resolved once, at start).
    #[arg(long, env = "SHOAL_LISTEN", default_value = "127.0.0.1:7000", value_parser = parse_listen)]
    pub listen: SocketAddr,

    /// Internal address for Raft and node-to-node traffic [default: the API host, port + 10000].
    #[arg(long, env = "SHOAL_PEER_LISTEN", value_parser = parse_listen)]
    pub peer_listen: Option<SocketAddr>,

    /// Client API address other nodes and clients use to reach this node [default: --listen].
    #[arg(long, env = "SHOAL_ADVERTISE")]
    pub advertise: Option<String>,

    /// Internal address other nodes use to reach this node [default: --peer-listen].
    #[arg(long, env = "SHOAL_PEER_ADVERTISE")]
    pub peer_advertise: Option<String>,

    /// Directory for the node's identity and its Raft log (no cache data is stored).
    #[arg(long, env = "SHOAL_DATA_DIR", default_value = "./shoal-data")]
    pub data_dir: PathBuf,

    /// API address(es) of any member(s) of the cluster to join, comma-separated; only used
    /// when the data dir is empty.
    #[arg(long, env = "SHOAL_JOIN", value_delimiter = ',')]
    pub join: Vec<String>,

    /// Join even while a state transfer runs, instead of waiting for it to end: the running
    /// transfer's target is replaced by one that includes this node.
    #[arg(long, env = "SHOAL_FORCE_JOIN")]
    pub force_join: bool,

    /// This node's name for people and tools (`shoal node leave NAME`, `shoal status`); in a
    /// StatefulSet the pod name, whose ordinal suffix orders joins under --discover
    /// [default with --discover: the hostname].
    #[arg(long, env = "POD_NAME")]
    pub name: Option<String>,

    /// Find the cluster through DNS (`NAME:PORT`, a headless Service: every address it
    /// resolves to is a candidate's API) or a comma-separated list of candidate API
    /// addresses. With an empty data dir: join the cluster a candidate knows; ordinal 0 of
    /// --name bootstraps when none does; ordinal k joins after k-1 is a member.
    #[arg(long, env = "SHOAL_DISCOVER", value_delimiter = ',')]
    pub discover: Vec<String>,

    /// How long to keep retrying --join before giving up.
    #[arg(long, env = "SHOAL_JOIN_TIMEOUT", default_value = "60s", value_parser = parse_duration)]
    pub join_timeout: Duration,

    /// Memory for items, accounting included (e.g. 512MiB, 4GiB): this node's own and the
    /// replica it holds for another member together (a lone node uses it all for its own; in a
    /// cluster each gets half); LRU eviction keeps each within its share [default: 45% of
    /// --memory-limit if given, else 1GiB].
    #[arg(long = "cache-size", env = "SHOAL_CACHE_SIZE", value_name = "SIZE", value_parser = parse_size)]
    pub cache_size_arg: Option<u64>,

    /// The memory this node may use in all (in Kubernetes: the container's memory limit,
    /// from the downward API); sizes the cache when --cache-size is not given, and is
    /// exported as `shoal_memory_limit_bytes`.
    #[arg(long, env = "SHOAL_MEMORY_LIMIT", value_name = "SIZE", value_parser = parse_size)]
    pub memory_limit: Option<u64>,

    /// The cache size in effect (see [`ServeConfig::resolved`]).
    #[arg(skip = DEFAULT_CACHE_SIZE)]
    pub cache_size: u64,

    /// Longest key accepted, in bytes.
    #[arg(long, env = "SHOAL_MAX_KEY_BYTES", default_value_t = 4096)]
    pub max_key_bytes: usize,

    /// Largest value accepted (e.g. 16MiB).
    #[arg(long, env = "SHOAL_MAX_VALUE_BYTES", default_value = "16MiB", value_parser = parse_size)]
    pub max_value_bytes: u64,

    /// Raft voters of a new cluster (3 or 5); later members are learners. Only read by the
    /// node that bootstraps.
    #[arg(long, env = "SHOAL_VOTERS", default_value = "3", value_parser = parse_voters)]
    pub voters: u8,

    /// How writes reach replicas: `sync` (the replica has the write before the client gets
    /// its answer) or `async` (queued, sent in batches). Only read by the node that
    /// bootstraps; change it later with `PUT /v1/cluster/config`.
    #[arg(long, env = "SHOAL_REPLICATION", default_value = "sync")]
    pub replication: shoal_raft::ReplicationMode,

    /// How often this node pings every other member (failure detection); `0` disables pings,
    /// and with them pfail, failover and the write lease.
    #[arg(long, env = "SHOAL_PING_INTERVAL", default_value = "1000ms", value_parser = parse_duration)]
    pub ping_interval: Duration,

    /// Silence after which a peer is pfail in this node's view; a member that a majority
    /// reports pfail is failed and its buckets go to its replica.
    #[arg(long, env = "SHOAL_NODE_TIMEOUT", default_value = "5s", value_parser = parse_duration)]
    pub node_timeout: Duration,

    /// Where a read goes when the request does not say (`?read=`): `owner`, or `mirrors` (any
    /// fresh copy of the bucket: its owner or the holder of its replica, chosen by
    /// `--ha-strategy`).
    #[arg(long, env = "SHOAL_READ_FROM", default_value = "owner", value_parser = parse_read_from)]
    pub read_from: shoal_http_api::types::ReadFrom,

    /// With async replication, how far behind its owner a replica copy may be to serve a mirror
    /// read when the request does not say (`?max_staleness=`); `0`: never behind (async reads
    /// stay with the owner).
    #[arg(long, env = "SHOAL_MAX_STALENESS", default_value = "0s", value_parser = parse_duration)]
    pub max_staleness: Duration,

    /// How a mirror is chosen for a read: `random` (ignores their state), `nodeads` and
    /// `noerrors` (latency-weighted probabilities, without dead mirrors, or also without
    /// mirrors with recent errors), `roundrobin`.
    #[arg(long, env = "SHOAL_HA_STRATEGY", default_value = "random")]
    pub ha_strategy: crate::mirror::Strategy,

    /// The length of a karma block: mirror statistics are kept in blocks this long (15 kept,
    /// the newest two used), and the latency-weighted probabilities recomputed once per block.
    #[arg(long, env = "SHOAL_HA_PERIOD_KARMA", default_value = "60s", value_parser = parse_duration)]
    pub ha_period_karma: Duration,

    /// How often members that answered nothing lately are pinged to keep their mirror
    /// statistics and dead flag current (failure-detection pings count too); `0` never.
    #[arg(long, env = "SHOAL_HA_PING_INTERVAL", default_value = "1000ms", value_parser = parse_duration)]
    pub ha_ping_interval: Duration,

    /// What the store evicts when it is full: `lru` (least recently used), `lfu` (least
    /// frequently used, a counter that decays by the minute) or `priority` (the items' eviction
    /// priority, lowest first, least recently used within a level). Under every policy,
    /// `priority=not_removable` items are never evicted.
    #[arg(long, env = "SHOAL_EVICTION", default_value = "lru", value_enum)]
    pub eviction: crate::cache::EvictionPolicy,

    /// How often every node reports its buckets' items, bytes, reads and writes per second to
    /// the leader (`GET /v1/cluster/buckets`, balancing by data).
    #[arg(long, env = "SHOAL_STATS_INTERVAL", default_value = "10s", value_parser = parse_duration)]
    pub stats_interval: Duration,

    /// The least time between two balancings the leader starts by itself (when
    /// `auto_balance` is on in `PUT /v1/cluster/config`).
    #[arg(long, env = "SHOAL_AUTO_BALANCE_INTERVAL", default_value = "10m", value_parser = parse_duration)]
    pub auto_balance_interval: Duration,

    /// Buckets pulled at once during state transfer.
    #[arg(long, env = "SHOAL_TRANSFER_PARALLELISM", default_value_t = 1)]
    pub transfer_parallelism: usize,

    /// Most bytes per second one bucket transfer sends (0: unlimited). The default keeps
    /// clients' latency low while buckets move on a node with few cores; raise it (or 0) to
    /// move faster where cores and network are to spare.
    #[arg(long, env = "SHOAL_TRANSFER_RATE", default_value = "100MB", value_parser = parse_size)]
    pub transfer_rate: u64,

    /// How long a client has to send a request's head on the API port, and how long a
    /// connection may stay idle between requests; `0` for no limit (a slow client that sends
    /// a head byte by byte holds its connection no longer than this).
    #[arg(long, env = "SHOAL_HEADER_READ_TIMEOUT", default_value = "10s", value_parser = parse_duration)]
    pub header_read_timeout: Duration,

    /// The most client connections the API port keeps open at once (as Redis's `maxclients`);
    /// one more is answered 503 and closed; `0` for no limit.
    #[arg(long, env = "SHOAL_MAX_CONNECTIONS", default_value_t = 10_000)]
    pub max_connections: usize,

    /// Connect timeout of every connection a node opens to another (Raft, forwards, replica
    /// writes, pings, bucket streams); a connect that fails is tried 2 more times, 2 s apart
    /// (5s–30s).
    #[arg(long, env = "SHOAL_RECONNECT_TIMEOUT", default_value = "10s", value_parser = parse_duration)]
    pub reconnect_timeout: Duration,

    /// How often the leader checks a running state transfer for progress.
    #[arg(long, env = "SHOAL_TRANSFER_CHECK_INTERVAL", default_value = "30s", value_parser = parse_duration)]
    pub transfer_check_interval: Duration,

    /// A transfer with no activity for this long is stuck: the leader clears the
    /// state-transfer flag so membership may change again.
    #[arg(long, env = "SHOAL_TRANSFER_STUCK_AFTER", default_value = "3m", value_parser = parse_duration)]
    pub transfer_stuck_after: Duration,

    /// The secret every node-to-node request must carry (Raft, join, replication, transfer,
    /// pings); give every node the same one. Without it the peer listener is open to anyone
    /// who can reach it.
    #[arg(long, env = "SHOAL_CLUSTER_SECRET", hide_env_values = true)]
    pub cluster_secret: Option<crate::auth::Secret>,

    /// Token the cluster's write endpoints (leave, config, lost/clear) require, as
    /// `Authorization: Bearer <token>`; without it they are open like the rest of the API.
    #[arg(long, env = "SHOAL_ADMIN_TOKEN", hide_env_values = true)]
    pub admin_token: Option<crate::auth::Secret>,

    /// Token the key API (`/v1/kv`, `/v1/bulk`, `/v1/tags`) requires, as `Authorization: Bearer
    /// <token>` (the admin token works too); give every node the same one. Without it the key
    /// API is open.
    #[arg(long, env = "SHOAL_CLIENT_TOKEN", hide_env_values = true)]
    pub client_token: Option<crate::auth::Secret>,

    /// PEM certificate chain: with `--tls-key` and `--tls-ca`, both listeners serve HTTPS and
    /// the node speaks HTTPS to its peers. It must name every address others dial (the
    /// advertised API and peer addresses: DNS names or IP addresses). Read again when the file
    /// changes (a renewal needs no restart). Give every node TLS, or none.
    #[arg(long, env = "SHOAL_TLS_CERT", requires_all = ["tls_key", "tls_ca"])]
    pub tls_cert: Option<PathBuf>,

    /// PEM private key of `--tls-cert`.
    #[arg(long, env = "SHOAL_TLS_KEY", requires_all = ["tls_cert", "tls_ca"])]
    pub tls_key: Option<PathBuf>,

    /// PEM certificate(s) of the CA that signed the members' certificates: what this node
    /// verifies its peers against (the CLI takes it as `--cacert`).
    #[arg(long, env = "SHOAL_TLS_CA", requires_all = ["tls_cert", "tls_key"])]
    pub tls_ca: Option<PathBuf>,

    /// On SIGTERM of a member that does not leave (a restart, an upgrade): go into maintenance
    /// for this long first. The holder of its replica serves its buckets meanwhile, and the
    /// node, back with the same data dir, takes them back: no failover, no rebalance. Not back
    /// in time: the cluster fails it. `0s` turns it off (a stop longer than `--node-timeout`
    /// is then a failover). 10s to 1h.
    #[arg(long, env = "SHOAL_RESTART_WINDOW", default_value = "5m", value_parser = parse_duration)]
    pub restart_window: Duration,

    /// On SIGTERM, the most the whole stop takes, from the signal to the exit: the node records
    /// that it stops, goes into maintenance (`--restart-window`; at most two thirds of this),
    /// stops being ready and acknowledging writes, hands Raft leadership to another member,
    /// and waits until the replica of every bucket it owns is in sync (a stop is not a leave:
    /// it comes back as the same member and gets its vote back).
    #[arg(long, env = "SHOAL_DRAIN_TIMEOUT", default_value = "60s", value_parser = parse_duration)]
    pub drain_timeout: Duration,

    /// Log lines as `text` (colour only on a terminal) or `json` (one object per line). The
    /// level comes from RUST_LOG (default `info,openraft=error,openraft::replication=off`).
    #[arg(long, env = "SHOAL_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,

    /// Threads serving requests [default: one per core].
    #[arg(long, env = "SHOAL_WORKER_THREADS")]
    pub worker_threads: Option<usize>,

    /// Raft heartbeat interval [default: a quarter of the election timeout, at most 250ms].
    #[arg(long, env = "SHOAL_RAFT_HEARTBEAT", value_parser = parse_duration, hide = true)]
    pub raft_heartbeat: Option<Duration>,

    /// Raft election timeout: the actual one is random in [t, 4t/3), and a follower refuses
    /// other candidates until 4t/3 after its leader's last heartbeat [default: 40% of
    /// --node-timeout, between 300ms and 1500ms].
    #[arg(long, env = "SHOAL_RAFT_ELECTION_TIMEOUT", value_parser = parse_duration, hide = true)]
    pub raft_election_timeout: Option<Duration>,
}

/// The cache size when neither --cache-size nor --memory-limit is given.
pub const DEFAULT_CACHE_SIZE: u64 = 1 << 30;

/// Share of --memory-limit given to the stores (this node's items and the replica it holds)
/// when --cache-size is not set. The rest is for what items cost beyond their accounting
/// (allocator rounding and fragmentation), request bodies in flight (an eighth, see
/// [`ServeConfig::body_budget`]), connections and the runtime: `tests/perf/memory.py` measures
/// that peak resident memory stays below the limit with this share.
pub const CACHE_SHARE_OF_MEMORY: f64 = 0.45;

/// How log lines look.
#[derive(Debug, Clone, Copy, ValueEnum, PartialEq, Eq)]
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line.
    Json,
}

impl ServeConfig {
    /// Fills in what depends on several flags: the cache size (from --cache-size, else
    /// from --memory-limit, else the default).
    pub fn resolved(mut self) -> Self {
        self.cache_size = match (self.cache_size_arg, self.memory_limit) {
            (Some(size), _) => size,
            (None, Some(limit)) => (limit as f64 * CACHE_SHARE_OF_MEMORY) as u64,
            (None, None) => DEFAULT_CACHE_SIZE,
        };
        self
    }

    /// A config with every default, listening on the given addresses (tests use port 0).
    pub fn for_test(listen: SocketAddr, peer_listen: SocketAddr, data_dir: PathBuf) -> Self {
        let cli = Cli::parse_from(["shoal", "serve"]);
        let Command::Serve(config) = cli.command else { unreachable!("parsed serve") };
        let mut config = config.resolved();
        config.listen = listen;
        config.peer_listen = Some(peer_listen);
        config.data_dir = data_dir;
        config.cache_size = 64 * 1024 * 1024;
        // Tests that stop nodes on purpose must not see them failed; failure tests turn pings on.
        config.ping_interval = Duration::ZERO;
        config
    }

    /// The Raft heartbeat interval and election timeout: as given, else derived from
    /// `--node-timeout`, so that a dead Raft leader is replaced within about the time a dead
    /// member is noticed (its failure can only be committed once there is a leader again).
    /// openraft lets a follower vote for nobody else until the longest election timeout after
    /// its leader's last heartbeat, so the election that replaces a dead leader ends about
    /// twice the election timeout after it: 40% of the node timeout keeps that within it.
    pub fn raft_timing(&self) -> (Duration, Duration) {
        let election = self.raft_election_timeout.unwrap_or_else(|| {
            (self.node_timeout * 2 / 5).clamp(Duration::from_millis(300), Duration::from_millis(1500))
        });
        let heartbeat = self.raft_heartbeat.unwrap_or_else(|| (election / 4).min(Duration::from_millis(250)));
        (heartbeat, election)
    }

    /// TLS, when `--tls-cert`, `--tls-key` and `--tls-ca` are given (all three or none).
    pub fn tls(&self) -> Result<Option<crate::tls::NodeTls>, String> {
        match (&self.tls_cert, &self.tls_key, &self.tls_ca) {
            (None, None, None) => Ok(None),
            (Some(cert), Some(key), Some(ca)) => crate::tls::NodeTls::load(cert, key, ca).map(Some),
            _ => Err("--tls-cert, --tls-key and --tls-ca go together: give all three, or none".into()),
        }
    }

    /// What the API port bounds (the peer port's clients are the nodes: it bounds nothing).
    pub fn client_limits(&self) -> crate::http_server::Limits {
        crate::http_server::Limits {
            header_read_timeout: Some(self.header_read_timeout).filter(|t| !t.is_zero()),
            max_connections: Some(self.max_connections).filter(|&n| n > 0),
        }
    }

    /// How state transfer runs.
    pub fn transfer_config(&self) -> crate::transfer::TransferConfig {
        crate::transfer::TransferConfig {
            parallelism: self.transfer_parallelism,
            rate_bytes_per_sec: self.transfer_rate,
            open_timeout: crate::transport::http::Reconnect::with_timeout(self.reconnect_timeout).total(),
            check_interval: self.transfer_check_interval,
            stuck_after: self.transfer_stuck_after,
        }
    }

    /// How reads are balanced over mirrors.
    pub fn mirror_config(&self) -> crate::mirror::MirrorConfig {
        crate::mirror::MirrorConfig {
            read_from: self.read_from,
            max_staleness: self.max_staleness,
            strategy: self.ha_strategy,
            period_karma: self.ha_period_karma,
            ping_interval: self.ha_ping_interval,
        }
    }

    /// How statistics and balancing run.
    pub fn balance_config(&self) -> crate::balance::BalanceConfig {
        crate::balance::BalanceConfig {
            stats_interval: self.stats_interval,
            auto_interval: self.auto_balance_interval,
            transfer_rate: self.transfer_rate,
        }
    }

    /// How failure detection runs.
    pub fn health_config(&self) -> crate::health::HealthConfig {
        crate::health::HealthConfig { ping_interval: self.ping_interval, node_timeout: self.node_timeout }
    }

    /// The memory request bodies in flight may take: an eighth of `--memory-limit`, or
    /// 256 MiB without one.
    pub fn body_budget(&self) -> u64 {
        self.memory_limit.map_or(256 << 20, |m| m / 8)
    }

    /// The peer listen address: as given, or the API host with port + 10000.
    pub fn peer_listen_addr(&self) -> Result<SocketAddr, String> {
        match self.peer_listen {
            Some(addr) => Ok(addr),
            None if self.listen.port() == 0 => Ok(SocketAddr::new(self.listen.ip(), 0)),
            None => {
                let port = self.listen.port().checked_add(10_000).ok_or_else(|| {
                    format!("--listen port {} + 10000 is not a port; set --peer-listen", self.listen.port())
                })?;
                Ok(SocketAddr::new(self.listen.ip(), port))
            }
        }
    }

    /// Checks what clap cannot; the message says which flag to fix.
    pub fn validate(&self) -> Result<(), String> {
        if self.max_key_bytes == 0 || self.max_key_bytes > 65_535 {
            return Err("--max-key-bytes must be between 1 and 65535".into());
        }
        if self.max_value_bytes == 0 || self.max_value_bytes > 512 * 1024 * 1024 {
            return Err("--max-value-bytes must be between 1 byte and 512MiB".into());
        }
        if self.cache_size < 1024 * 1024 {
            return Err("--cache-size must be at least 1MiB (or --memory-limit at least 3MiB)".into());
        }
        if let Some(limit) = self.memory_limit {
            if self.cache_size > limit / 2 {
                return Err(format!(
                    "--cache-size {} leaves no room within --memory-limit {} for request bodies, \
                     connections and allocator overhead: give at most half of the limit (the default, 45%, \
                     keeps peak resident memory below the limit under the write patterns of tests/perf/memory.py)",
                    bytesize::ByteSize(self.cache_size),
                    bytesize::ByteSize(limit)
                ));
            }
        }
        for (flag, secret) in [
            ("--cluster-secret", &self.cluster_secret),
            ("--admin-token", &self.admin_token),
            ("--client-token", &self.client_token),
        ] {
            if let Some(problem) = secret.as_ref().and_then(|s| s.problem()) {
                return Err(format!("{flag} {problem}"));
            }
        }
        if self.stats_interval < Duration::from_millis(100) {
            return Err("--stats-interval must be at least 100ms".into());
        }
        if self.ha_period_karma < Duration::from_secs(1) {
            return Err("--ha-period-karma must be at least 1s".into());
        }
        if !self.restart_window.is_zero()
            && !(shoal_http_api::MAINTENANCE_MIN..=shoal_http_api::MAINTENANCE_MAX).contains(&self.restart_window)
        {
            return Err(format!(
                "--restart-window must be 0s (off) or from 10s to 1h, not {}",
                humantime::format_duration(self.restart_window)
            ));
        }
        if self.drain_timeout.is_zero() {
            return Err("--drain-timeout must be positive".into());
        }
        if !(Duration::from_secs(5)..=Duration::from_secs(30)).contains(&self.reconnect_timeout) {
            return Err(format!(
                "--reconnect-timeout must be between 5s and 30s, not {}",
                humantime::format_duration(self.reconnect_timeout)
            ));
        }
        if self.transfer_check_interval.is_zero() || self.transfer_stuck_after.is_zero() {
            return Err("--transfer-check-interval and --transfer-stuck-after must be positive".into());
        }
        if self.transfer_parallelism == 0 || self.transfer_parallelism > 64 {
            return Err("--transfer-parallelism must be between 1 and 64".into());
        }
        if !self.ping_interval.is_zero() && self.node_timeout < self.ping_interval * 2 {
            return Err("--node-timeout must be at least twice --ping-interval".into());
        }
        if self.worker_threads == Some(0) {
            return Err("--worker-threads must be at least 1".into());
        }
        let (heartbeat, election) = self.raft_timing();
        if election <= heartbeat * 2 {
            return Err("the Raft election timeout must be more than twice the heartbeat".into());
        }
        for (flag, listen, advertise) in [
            ("--advertise", self.listen, &self.advertise),
            ("--peer-advertise", self.peer_listen_addr()?, &self.peer_advertise),
        ] {
            if advertise.is_none() && listen.ip().is_unspecified() {
                return Err(format!("{flag} is required when listening on {}", listen.ip()));
            }
        }
        Ok(())
    }
}

/// Output format of client commands.
#[derive(Debug, Clone, Copy, ValueEnum, PartialEq, Eq)]
pub enum Output {
    /// Human-readable.
    Table,
    /// JSON as the API returns it.
    Json,
}

/// Options of every client command.
#[derive(Debug, Clone, Args)]
pub struct ClientArgs {
    /// API address of any node, or several, comma-separated: the next is tried when a node
    /// cannot be reached.
    #[arg(long, env = "SHOAL_ADDR", default_value = "127.0.0.1:7000", global = true)]
    pub addr: String,
    /// Output format.
    #[arg(short = 'o', long, value_enum, default_value_t = Output::Table, global = true)]
    pub output: Output,
    /// The admin token, for commands that change the cluster (when nodes run with one).
    #[arg(long, env = "SHOAL_ADMIN_TOKEN", hide_env_values = true, global = true)]
    pub admin_token: Option<crate::auth::Secret>,
    /// The client token, for the key commands (when nodes run with one).
    #[arg(long, env = "SHOAL_CLIENT_TOKEN", hide_env_values = true, global = true)]
    pub client_token: Option<crate::auth::Secret>,
    /// PEM certificate(s) of the CA the nodes' certificates come from (what they run with as
    /// `--tls-ca`): the CLI then speaks HTTPS and trusts that CA only. An `https://` address
    /// speaks HTTPS too.
    #[arg(long, env = "SHOAL_CACERT", global = true)]
    pub cacert: Option<PathBuf>,
}

/// `shoal get|del KEY`.
#[derive(Debug, Clone, Args)]
pub struct KeyArgs {
    /// The key.
    pub key: String,
    /// Where to connect and how to print.
    #[command(flatten)]
    pub client: ClientArgs,
}

/// `shoal put KEY [VALUE]`.
#[derive(Debug, Clone, Args)]
pub struct PutArgs {
    /// The key.
    pub key: String,
    /// The value; `-` or missing reads standard input.
    pub value: Option<String>,
    /// Expire after this long (30s, 5m, 2h).
    #[arg(long, conflicts_with = "sliding")]
    pub ttl: Option<String>,
    /// Expire after this long without a read (every read extends it).
    #[arg(long)]
    pub sliding: Option<String>,
    /// Write only if the current version is N (0: only if absent).
    #[arg(long, conflicts_with = "mode")]
    pub cas: Option<u64>,
    /// Write only if absent (`add`) or only if present (`replace`).
    #[arg(long, value_parser = ["add", "replace"])]
    pub mode: Option<String>,
    /// Tags, comma-separated (for `shoal ls --tag` and removal by tag).
    #[arg(long, value_delimiter = ',')]
    pub tags: Vec<String>,
    /// Eviction priority: low, below_normal, normal, above_normal, high, not_removable.
    #[arg(long)]
    pub priority: Option<String>,
    /// Where to connect and how to print.
    #[command(flatten)]
    pub client: ClientArgs,
}

/// `shoal status`.
#[derive(Debug, Clone, Args)]
pub struct StatusArgs {
    /// Redraw every second, in place on a terminal, until Ctrl-C.
    #[arg(long, conflicts_with = "wait")]
    pub watch: bool,
    /// Wait until the cluster is healthy (a leader, every member up, no lost bucket, no
    /// transition or transfer running, every replica attached), then print it; exit 4 if it
    /// is not by `--timeout`.
    #[arg(long)]
    pub wait: bool,
    /// How long `--wait` waits (30s, 5m).
    #[arg(long, default_value = "60s", value_parser = humantime::parse_duration)]
    pub timeout: std::time::Duration,
    /// Where to connect and how to print.
    #[command(flatten)]
    pub client: ClientArgs,
}

impl ClientArgs {
    /// The nodes of `--addr`, in order.
    pub fn addrs(&self) -> Vec<&str> {
        self.addr.split(',').map(str::trim).filter(|a| !a.is_empty()).collect()
    }
}

/// `shoal node ...`.
#[derive(Debug, Clone, Subcommand)]
pub enum NodeCommand {
    /// Make a member leave the cluster (its buckets are spread over the others); scaling a
    /// StatefulSet down is this, then `kubectl scale`.
    Leave(LeaveArgs),
    /// Put a member into maintenance (its replica holder serves its buckets while it is away;
    /// no failover, no rebalance), or end a maintenance early (`--end`).
    Maintenance(MaintenanceArgs),
}

/// `shoal node maintenance NAME|ID [--for 10m] [--end]`.
#[derive(Debug, Clone, Args)]
pub struct MaintenanceArgs {
    /// The member: its name (the pod name in a StatefulSet) or its id.
    pub node: String,
    /// How long it may stay away (10s to 1h); not back by then, it is failed.
    #[arg(long = "for", default_value = "10m", conflicts_with = "end")]
    pub period: String,
    /// End the member's maintenance now (if it is not back, the cluster fails it).
    #[arg(long)]
    pub end: bool,
    /// Where to connect and how to print.
    #[command(flatten)]
    pub client: ClientArgs,
}

/// `shoal lost ...`.
#[derive(Debug, Clone, Subcommand)]
pub enum LostCommand {
    /// Acknowledge lost buckets (all, or the ones named): they serve again, empty.
    Clear(LostClearArgs),
}

/// `shoal lost clear [BUCKET...]`.
#[derive(Debug, Clone, Args)]
pub struct LostClearArgs {
    /// The buckets to acknowledge (0-999); all lost buckets when none is named.
    pub buckets: Vec<u16>,
    /// Where to connect and how to print.
    #[command(flatten)]
    pub client: ClientArgs,
}

/// `shoal leave NAME|ID`.
#[derive(Debug, Clone, Args)]
pub struct LeaveArgs {
    /// The member that leaves: its name (the pod name in a StatefulSet) or its id.
    pub node: String,
    /// Where to connect and how to print.
    #[command(flatten)]
    pub client: ClientArgs,
}

/// A listen address: `IP:PORT`, or `HOST:PORT` with a host name that resolves (its first
/// IPv4 address, else its first address).
pub fn parse_listen(text: &str) -> Result<SocketAddr, String> {
    if let Ok(addr) = text.parse() {
        return Ok(addr);
    }
    let addrs: Vec<SocketAddr> = std::net::ToSocketAddrs::to_socket_addrs(text)
        .map_err(|e| format!("{text:?} is not HOST:PORT that resolves: {e}"))?
        .collect();
    addrs
        .iter()
        .find(|a| a.is_ipv4())
        .or(addrs.first())
        .copied()
        .ok_or_else(|| format!("{text:?} resolves to no address"))
}

/// Parses `512MiB`, `1GiB`, `100MB` or a number of bytes.
pub fn parse_size(text: &str) -> Result<u64, String> {
    text.trim().parse::<bytesize::ByteSize>().map(|b| b.as_u64()).map_err(|e| format!("{text:?} is not a size: {e}"))
}

fn parse_voters(text: &str) -> Result<u8, String> {
    match text {
        "3" => Ok(3),
        "5" => Ok(5),
        _ => Err(format!("{text:?}: a cluster has 3 or 5 voters")),
    }
}

/// Parses `owner` or `mirrors`.
fn parse_read_from(text: &str) -> Result<shoal_http_api::types::ReadFrom, String> {
    text.parse()
}

/// `shoal bench` options.
#[derive(Debug, Clone, Args)]
pub struct BenchArgs {
    /// API address(es) of the node(s), comma-separated (with direct routing, the map names
    /// the rest). Plain HTTP only: bench nodes that run without TLS.
    #[arg(long, env = "SHOAL_ADDR", value_delimiter = ',', default_value = "127.0.0.1:7000")]
    pub addr: Vec<String>,
    /// Concurrent connections (each with one request in flight).
    #[arg(long, default_value_t = 50)]
    pub connections: usize,
    /// How long to measure.
    #[arg(long, default_value = "10s", value_parser = parse_duration)]
    pub duration: Duration,
    /// Size of the key space (keys `key:000000000000` ...).
    #[arg(long, default_value_t = 100_000)]
    pub keys: u32,
    /// Value size in bytes.
    #[arg(long, default_value_t = 100)]
    pub value_size: usize,
    /// Share of gets and puts, `get:put`.
    #[arg(long, default_value = "1:0", value_parser = parse_ratio)]
    pub ratio: (u32, u32),
    /// Keys per request: 1 uses the single-key endpoints, more the bulk endpoints.
    #[arg(long, default_value_t = 1)]
    pub batch: usize,
    /// Send each key to its owner (direct), to a random node that forwards it (any), or through
    /// shoal's client library (client: follows the map, splits bulk requests per owner).
    #[arg(long, value_enum, default_value = "direct")]
    pub routing: Routing,
    /// Where gets may be served: `owner`, or `mirrors` (`?read=mirrors`: the owner or the
    /// holder of its replica, whichever the node's --ha-strategy picks).
    #[arg(long, default_value = "owner", value_parser = parse_read)]
    pub read: shoal_http_api::types::ReadFrom,
    /// PIDs of the server processes whose CPU time to report, comma-separated.
    #[arg(long, value_delimiter = ',')]
    pub server_pid: Vec<u32>,
    /// Skip writing every key before measuring.
    #[arg(long)]
    pub no_fill: bool,
    /// Threads of the load generator (1: one event loop, like redis-benchmark).
    #[arg(long, default_value_t = 1)]
    pub threads: usize,
    /// The client token, when the nodes run with one (sent on every key operation).
    #[arg(long, env = "SHOAL_CLIENT_TOKEN", hide_env_values = true)]
    pub client_token: Option<crate::auth::Secret>,
    /// Output format.
    #[arg(short = 'o', long, value_enum, default_value_t = Output::Table)]
    pub output: Output,
}

fn parse_read(text: &str) -> Result<shoal_http_api::types::ReadFrom, String> {
    text.parse()
}

fn parse_ratio(text: &str) -> Result<(u32, u32), String> {
    let (g, p) = text.split_once(':').ok_or_else(|| format!("{text:?}: expected get:put, e.g. 9:1"))?;
    let parse = |s: &str| s.trim().parse::<u32>().map_err(|_| format!("{text:?}: expected get:put, e.g. 9:1"));
    let (g, p) = (parse(g)?, parse(p)?);
    if g + p == 0 {
        return Err("the ratio cannot be 0:0".into());
    }
    Ok((g, p))
}

/// How to route requests.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Routing {
    /// Fetch the map and send each key to its owner.
    Direct,
    /// Send each request to a random node, which forwards it.
    Any,
    /// Use shoal's client library (`shoal::client`): owners from the map it follows, bulk
    /// requests split per owner.
    Client,
}

/// Parses `250ms`, `30s`, `5m`.
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    humantime::parse_duration(text).map_err(|e| format!("{text:?} is not a duration: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn serve(args: &[&str]) -> Result<ServeConfig, clap::Error> {
        let mut all = vec!["shoal", "serve"];
        all.extend_from_slice(args);
        Cli::try_parse_from(all).map(|c| match c.command {
            Command::Serve(s) => s.resolved(),
            _ => unreachable!("serve"),
        })
    }

    #[test]
    fn defaults_match_the_documentation() {
        let c = serve(&[]).expect("defaults parse");
        assert_eq!(c.listen, "127.0.0.1:7000".parse().expect("addr"));
        assert_eq!(c.peer_listen_addr(), Ok("127.0.0.1:17000".parse().expect("addr")));
        assert_eq!(c.cache_size, 1 << 30);
        assert_eq!(c.max_value_bytes, 16 << 20);
        assert_eq!(c.transfer_rate, 100_000_000);
        assert_eq!(c.max_key_bytes, 4096);
        assert_eq!(c.voters, 3);
        assert!(c.validate().is_ok());
    }

    #[test]
    fn raft_timing_follows_the_node_timeout_unless_given() {
        let ms = Duration::from_millis;
        let timing = |args: &[&str]| serve(args).expect("parses").raft_timing();
        assert_eq!(timing(&[]), (ms(250), ms(1500)), "5 s node timeout: the longest election timeout");
        assert_eq!(timing(&["--node-timeout", "1s", "--ping-interval", "200ms"]), (ms(100), ms(400)));
        assert_eq!(
            timing(&["--node-timeout", "500ms", "--ping-interval", "100ms"]),
            (ms(75), ms(300)),
            "at least 300 ms"
        );
        let given = ["--node-timeout", "1s", "--raft-election-timeout", "1s", "--raft-heartbeat", "150ms"];
        assert_eq!(timing(&given), (ms(150), ms(1000)), "explicit values win");
        let e = serve(&["--raft-election-timeout", "400ms", "--raft-heartbeat", "250ms"]).expect("parses").validate();
        assert!(e.is_err_and(|e| e.contains("twice the heartbeat")));
    }

    #[test]
    fn listen_addresses_may_name_a_host() {
        let c = serve(&["--listen", "localhost:7005"]).expect("a host name resolves");
        assert_eq!(c.listen.port(), 7005);
        assert!(c.listen.ip().is_loopback());
        assert_eq!(c.peer_listen_addr().map(|a| a.port()), Ok(17005));
        assert!(serve(&["--listen", "no-such-host.invalid:7000"]).is_err());
    }

    #[test]
    fn sizes_and_lists_parse() {
        let c = serve(&["--cache-size", "512MiB", "--join", "a:1,b:2", "--voters", "5"]).expect("parse");
        assert_eq!(c.cache_size, 512 << 20);
        assert_eq!(c.join, vec!["a:1", "b:2"]);
        assert_eq!(c.voters, 5);
    }

    #[test]
    fn the_cache_size_follows_the_memory_limit_unless_given() {
        let c = serve(&["--memory-limit", "1GiB"]).expect("parse");
        assert_eq!(c.cache_size, ((1u64 << 30) as f64 * CACHE_SHARE_OF_MEMORY) as u64);
        let c = serve(&["--memory-limit", "1GiB", "--cache-size", "100MiB"]).expect("parse");
        assert_eq!(c.cache_size, 100 << 20, "an explicit size wins");
        assert_eq!(c.memory_limit, Some(1 << 30));
        // Kubernetes' downward API gives the limit as a plain number of bytes.
        assert_eq!(serve(&["--memory-limit", "536870912"]).expect("parse").memory_limit, Some(512 << 20));
    }

    #[test]
    fn secrets_never_show_in_debug_output() {
        let c = serve(&["--cluster-secret", "hunter2", "--admin-token", "tok3n"]).expect("parse");
        let printed = format!("{c:?}");
        assert!(!printed.contains("hunter2") && !printed.contains("tok3n"), "{printed}");
        assert!(c.cluster_secret.expect("secret").matches(b"hunter2"));
        let bad = serve(&["--cluster-secret", "not a secret"]).expect("parse");
        let err = bad.validate().expect_err("refused");
        assert!(err.contains("--cluster-secret") && !err.contains("not a secret"), "{err}");
    }

    #[test]
    fn bad_values_are_refused_with_the_flag_named() {
        assert!(serve(&["--voters", "4"]).is_err());
        assert!(serve(&["--cache-size", "lots"]).is_err());
        let c = serve(&["--listen", "0.0.0.0:7000"]).expect("parse");
        assert_eq!(c.validate(), Err("--advertise is required when listening on 0.0.0.0".into()));
        let c = serve(&["--listen", "127.0.0.1:60000"]).expect("parse");
        assert!(c.validate().expect_err("port overflow").contains("--peer-listen"));
        for bad in ["4s", "31s"] {
            let c = serve(&["--reconnect-timeout", bad]).expect("parse");
            assert!(c.validate().expect_err("out of range").contains("between 5s and 30s"), "{bad}");
        }
        assert!(serve(&["--reconnect-timeout", "30s"]).expect("parse").validate().is_ok());
    }
}
