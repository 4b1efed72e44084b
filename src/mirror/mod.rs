//! Mirrors: reads balanced over a bucket's copies.
//!
//! A bucket's *mirrors* are its owner and the member holding the owner's replica (the holder
//! every write of the owner must reach). Writes always go to the owner. A read asked for with
//! `read=mirrors` (or on a node started with `--read-from mirrors`) goes to one mirror chosen
//! by `--ha-strategy`; the replica holder serves it from its replica copy only when that copy
//! is fresh (`crate::replication::Replicator::mirror_read`), else it refuses and the read goes
//! to the owner, as it does when the chosen mirror does not answer.
//!
//! ```text
//!  client ─ GET ?read=mirrors ─▶ any node ── choose(owner, holder) ──▶ owner: the usual route
//!                                   │                                └▶ holder: replica copy
//!                                   │                                     fresh? ─yes─▶ value
//!                                   └───────── refused / no answer ◀──────────no──┘ ─▶ owner
//! ```
//!
//! Choosing follows Manticore's mirrors: statistics per mirror in karma blocks of
//! `--ha-period-karma` (15 kept, at most the newest two used), probabilities inversely
//! proportional to the latency each mirror showed in one block (the last that ended, until the
//! newest is half full; nothing older), weighed among the mirrors a read can go to, a dead
//! flag updated on every answer, pings included (the failure detector's pings count;
//! `--ha-ping-interval` pings members nothing else reached lately). The pure part is in
//! `karma.rs`; this file holds the clock, the randomness, the pinger and the metrics.

pub mod karma;

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use metrics::Histogram;
use parking_lot::Mutex;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use shoal_http_api::types::{AgentsView, ReadFrom};
use shoal_raft::{ControlPlane, NodeId};
use tokio::time::Instant;

pub use karma::{Karma, Outcome, Strategy};

use crate::peer::Peers;
use crate::transport::wire::{self, Handlers};
use crate::transport::{CallError, Endpoint};

/// A mirror's ping: it asks nothing, and its answer (or its failure, and how long it took) is
/// what the reader learns of the member.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct Probe;

impl Endpoint for Probe {
    type Answer = ();
    const ID: u8 = wire::id::PROBE;
}

/// Registers the answer to mirrors' pings.
pub fn register(handlers: &mut Handlers) {
    handlers.add(|_: Probe| async { Ok(()) });
}

/// How reads are balanced over mirrors (the node's flags).
#[derive(Debug, Clone, Copy)]
pub struct MirrorConfig {
    /// Where a read goes when the request does not say (`--read-from`).
    pub read_from: ReadFrom,
    /// How far behind its owner an async replica copy may be by default (`--max-staleness`).
    pub max_staleness: Duration,
    /// How a mirror is chosen (`--ha-strategy`).
    pub strategy: Strategy,
    /// The length of a karma block (`--ha-period-karma`).
    pub period_karma: Duration,
    /// How often members nothing else reached lately are pinged (`--ha-ping-interval`; zero:
    /// never).
    pub ping_interval: Duration,
}

impl Default for MirrorConfig {
    fn default() -> Self {
        MirrorConfig {
            read_from: ReadFrom::Owner,
            max_staleness: Duration::ZERO,
            strategy: Strategy::Random,
            period_karma: Duration::from_secs(60),
            ping_interval: Duration::from_secs(1),
        }
    }
}

/// The outcome of a call, for the statistics.
pub fn outcome_of(e: &CallError) -> Outcome {
    match e {
        CallError::Unreachable(_) => Outcome::Connect,
        CallError::Timeout => Outcome::Timeout,
        CallError::Broken(_) => Outcome::WrongAnswer,
        CallError::Api(_) | CallError::Refused { .. } => Outcome::Refused,
    }
}

/// This node's view of the mirrors it reads from.
pub struct Mirrors {
    me: NodeId,
    config: MirrorConfig,
    began: Instant,
    karma: Mutex<Karma>,
    turn: AtomicU64,
    /// The draws of the random choices (seeded: the simulation replays them exactly).
    rng: Mutex<StdRng>,
    /// Reads this node balanced, by the node that served them.
    served: Mutex<BTreeMap<NodeId, u64>>,
    latency: Option<Histogram>,
}

impl Mirrors {
    /// Statistics from now on; `latency` observes every mirror read's time; `seed` seeds the
    /// random choices.
    pub fn new(me: NodeId, config: MirrorConfig, latency: Option<Histogram>, seed: u64) -> Arc<Self> {
        Arc::new(Mirrors {
            me,
            config,
            began: Instant::now(),
            karma: Mutex::new(Karma::new(config.period_karma)),
            turn: AtomicU64::new(0),
            rng: Mutex::new(StdRng::seed_from_u64(seed)),
            served: Mutex::new(BTreeMap::new()),
            latency,
        })
    }

    /// The flags.
    pub fn config(&self) -> &MirrorConfig {
        &self.config
    }

    fn now(&self) -> Duration {
        self.began.elapsed()
    }

    /// One of `candidates` by the strategy, or None when it excludes them all.
    pub fn choose(&self, candidates: &[NodeId]) -> Option<NodeId> {
        let now = self.now();
        let mut karma = self.karma.lock();
        karma.rotate(now);
        for &c in candidates {
            karma.know(c);
        }
        let draw = self.rng.lock().random::<f64>();
        let turn = self.turn.fetch_add(1, Ordering::Relaxed);
        karma.choose(self.config.strategy, candidates, now, draw, turn)
    }

    /// Records how a read sent to `mirror` ended after `latency`.
    pub fn record_read(&self, mirror: NodeId, outcome: Outcome, latency: Duration) {
        self.karma.lock().record(mirror, self.now(), outcome, latency, false);
        if outcome == Outcome::Answered {
            if let Some(h) = &self.latency {
                h.record(latency.as_secs_f64());
            }
        }
    }

    /// Records a ping's answer (or its failure) from `mirror` after `latency`.
    pub fn record_ping(&self, mirror: NodeId, outcome: Outcome, latency: Duration) {
        self.karma.lock().record(mirror, self.now(), outcome, latency, true);
    }

    /// Counts a balanced read served by `node`.
    pub fn served_by(&self, node: NodeId) {
        *self.served.lock().entry(node).or_default() += 1;
    }

    /// The members of `members` that answered nothing within `interval` at `now`.
    fn idle(&self, members: impl Iterator<Item = NodeId>, interval: Duration) -> Vec<NodeId> {
        let now = self.now();
        let karma = self.karma.lock();
        members.filter(|&m| karma.idle(m, now, interval)).collect()
    }

    /// The agent-status view; `members` are the nodes that may serve reads.
    pub fn view(&self, members: &[NodeId]) -> AgentsView {
        let now = self.now();
        let mut karma = self.karma.lock();
        karma.rotate(now);
        karma.retain(|id| members.contains(&id));
        for &m in members {
            karma.know(m);
        }
        AgentsView {
            node_id: self.me,
            read_from: self.config.read_from,
            strategy: self.config.strategy.as_str().to_string(),
            period_karma_ms: self.config.period_karma.as_millis() as u64,
            ping_interval_ms: self.config.ping_interval.as_millis() as u64,
            max_staleness_ms: self.config.max_staleness.as_millis() as u64,
            agents: karma.view(now),
        }
    }

    /// `shoal_mirror_reads_total` and `shoal_mirror_probability`, as Prometheus text.
    pub fn render(&self, members: &[NodeId]) -> String {
        let view = self.view(members);
        let mut out = String::new();
        out.push_str(
            "# HELP shoal_mirror_reads_total Reads this node balanced over mirrors, by the node that served them.\n",
        );
        out.push_str("# TYPE shoal_mirror_reads_total counter\n");
        let served = self.served.lock().clone();
        for m in members {
            let n = served.get(m).copied().unwrap_or(0);
            let _ = writeln!(out, "shoal_mirror_reads_total{{node=\"{m}\",strategy=\"{}\"}} {n}", view.strategy);
        }
        out.push_str(
            "# HELP shoal_mirror_probability The latency-weighted probability of each mirror (adaptive strategies).\n",
        );
        out.push_str("# TYPE shoal_mirror_probability gauge\n");
        for a in &view.agents {
            let _ = writeln!(out, "shoal_mirror_probability{{peer=\"{}\"}} {}", a.node_id, a.probability);
        }
        out
    }

    /// Pings, every `--ha-ping-interval`, the members that answered nothing (no read, no
    /// failure-detection ping) within it, so that their statistics and dead flag stay current
    /// while they are idle. Runs until the node stops; not at all with an interval of zero.
    pub async fn ping_idle(self: Arc<Self>, control: ControlPlane, peers: Peers) {
        let interval = self.config.ping_interval;
        if interval.is_zero() {
            return;
        }
        let mut tick = tokio::time::interval(interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            if self.config.read_from == ReadFrom::Owner && self.served.lock().is_empty() {
                // Nobody reads through mirrors here (yet): nothing to keep current.
                continue;
            }
            let state = control.state();
            let others = state.members.iter().map(|m| m.id).filter(|&id| id != self.me);
            for id in self.idle(others, interval) {
                let Some(addr) = state.members.iter().find(|m| m.id == id).map(|m| m.peer_addr.clone()) else {
                    continue;
                };
                let (mirrors, peers) = (self.clone(), peers.clone());
                tokio::spawn(async move {
                    let sent = Instant::now();
                    let outcome = match peers.ask(&addr, Probe, crate::transport::PEER_CALL_TIMEOUT).await {
                        Ok(_) => Outcome::Answered,
                        Err(e) => outcome_of(&e),
                    };
                    mirrors.record_ping(id, outcome, sent.elapsed());
                });
            }
        }
    }
}
