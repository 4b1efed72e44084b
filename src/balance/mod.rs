//! Balancing by data: bucket statistics, the leader's view of them, manual and automatic
//! rebalancing.
//!
//! ```text
//!  every node, every --stats-interval: its buckets' items, bytes, reads/s, writes/s ─▶ leader
//!     (POST /internal/stats on the peer listener; kept in the leader's memory, not in Raft)
//!  leader: GET /v1/cluster/buckets (any member asks the leader)
//!          POST /v1/cluster/rebalance[?node=][&dry_run=]: plan::plan ─▶ Raft Rebalance ─▶ a
//!            transition and state transfer like a join
//!          auto_balance on, fullest > 1.5 × emptiest on two rounds in a row, nothing
//!            running, the interval passed: due, and the reconciler's `Balance` job does
//!            the same by itself
//! ```
//!
//! Statistics become a Raft entry only when they change a decision: the balanced map itself
//! (`ClusterCommand::Rebalance`, made on the serving map of a given version, refused if the
//! map moved on meanwhile). A new leader has no reports until the members' next round; until
//! every member reported, a plan answers `stats_pending`.
//!
//! - `plan.rs` (pure): the view, the plan, when automatic balancing is due.

pub mod plan;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use shoal_http_api::types::{BucketsQuery, BucketsView, RebalancePlan, RebalanceRequest};
use shoal_raft::{AdminRequest, AdminResponse, BucketId, ControlError, ControlPlane, NodeId};
use tokio::time::Instant;

use crate::bucket::{BucketCore, Totals};
use crate::cache::CacheStore;
use crate::peer::Peers;
use crate::phase::Phase;
use crate::transfer::progress::Progress;
use crate::transport::wire::{self, Json};
use crate::transport::{CallError, Endpoint, PEER_CALL_TIMEOUT};
use plan::{Received, Refusal};

/// How long the leader may take to plan (and start) a balancing asked by another member.
const REBALANCE_TIMEOUT: Duration = Duration::from_secs(35);

/// One node's report of the buckets it serves, to the leader's peer address.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BucketReport {
    /// The reporting node.
    pub node: NodeId,
    /// Its map version when it measured.
    pub map_version: u64,
    /// The buckets it serves.
    pub buckets: Vec<ReportedBucket>,
    /// The receive rate of its last transfer that moved enough to tell, bytes per second.
    pub transfer_rate: Option<f64>,
    /// Buckets it owns but does not hold yet (being restored after a restart, or promoted
    /// and not installed): its figures are incomplete until they are back.
    pub pending: u32,
}

/// One bucket in a [`BucketReport`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ReportedBucket {
    /// The bucket.
    pub bucket: u16,
    /// Items.
    pub items: u64,
    /// Charged bytes.
    pub bytes: u64,
    /// Reads per second since the node's previous report.
    pub reads_per_sec: f64,
    /// Writes per second.
    pub writes_per_sec: f64,
}

impl Endpoint for BucketReport {
    type Answer = ();
    const ID: u8 = wire::id::REPORT_BUCKETS;
}

/// The leader's view of the buckets (a member asks the leader for `GET /v1/cluster/buckets`).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct AskBuckets(pub BucketsQuery);

impl Endpoint for AskBuckets {
    type Answer = Json<BucketsView>;
    const ID: u8 = wire::id::BUCKETS;
}

/// A balancing planned (and started) by the leader (`POST /v1/cluster/rebalance`).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Rebalance(pub RebalanceRequest);

impl Endpoint for Rebalance {
    type Answer = Json<RebalancePlan>;
    const ID: u8 = wire::id::REBALANCE;
}

/// The settings of balancing.
#[derive(Debug, Clone, Copy)]
pub struct BalanceConfig {
    /// How often every node reports its buckets to the leader (`--stats-interval`).
    pub stats_interval: Duration,
    /// The least time between two balancings the leader starts by itself
    /// (`--auto-balance-interval`).
    pub auto_interval: Duration,
    /// The transfer rate limit (`--transfer-rate`, 0: none): caps a plan's estimate.
    pub transfer_rate: u64,
}

/// Why a view or plan could not be had (mapped to HTTP at the edge, `api/admin.rs`).
#[derive(Debug)]
pub enum BalanceError {
    /// No plan now.
    Refused(Refusal),
    /// A request forwarded to this node, which is not (or no longer) the leader.
    NotLeader,
    /// No leader is known.
    NoLeader,
    /// The control plane refused or failed.
    Control(ControlError),
    /// The leader did not answer, or answered an error (kept as it came).
    Call(CallError),
}

/// Statistics, the leader's view, rebalancing (see the module docs).
pub struct Balancer {
    me: NodeId,
    control: ControlPlane,
    core: Arc<BucketCore>,
    store: Arc<CacheStore>,
    progress: Arc<Progress>,
    peers: Peers,
    config: BalanceConfig,
    /// On the leader: every member's latest report and when it came.
    reports: Mutex<BTreeMap<NodeId, (Instant, BucketReport)>>,
    /// The activity totals at this node's previous report.
    previous: Mutex<Option<(Instant, Totals)>>,
    /// When this node, as leader, last started a balancing by itself.
    last_auto: Mutex<Option<Instant>>,
    /// Whether the previous round found the data past 60/40: the leader acts only on two
    /// rounds in a row (one round's reports are not one moment's: a burst of writes can
    /// look like skew).
    over_before: Mutex<bool>,
    /// On the leader: a balancing by itself is due (the reconciler's `Balance` starts it).
    due: AtomicBool,
}

impl Balancer {
    /// The balancer of this node.
    pub fn new(
        control: ControlPlane,
        core: Arc<BucketCore>,
        store: Arc<CacheStore>,
        progress: Arc<Progress>,
        peers: Peers,
        config: BalanceConfig,
    ) -> Arc<Self> {
        Arc::new(Balancer {
            me: control.node_id(),
            control,
            core,
            store,
            progress,
            peers,
            config,
            reports: Mutex::new(BTreeMap::new()),
            previous: Mutex::new(None),
            last_auto: Mutex::new(None),
            over_before: Mutex::new(false),
            due: AtomicBool::new(false),
        })
    }

    /// Reports every interval; on the leader, notes whether a balancing by itself is due.
    pub async fn run(self: Arc<Self>) {
        let mut tick = tokio::time::interval(self.config.stats_interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let report = self.measure();
            match self.control.leader() {
                Some(leader) if leader == self.me => {
                    self.receive(report);
                    self.note_round();
                }
                Some(leader) => {
                    if let Some(addr) = self.control.state().member_of(leader).map(|m| m.peer_addr.clone()) {
                        if let Err(e) = self.peers.ask(&addr, report, PEER_CALL_TIMEOUT).await {
                            tracing::debug!(leader, error = %e, "bucket statistics did not reach the leader");
                        }
                    }
                }
                None => {}
            }
        }
    }

    /// This node's report now: every bucket it serves, with reads and writes per second
    /// since the previous report.
    fn measure(&self) -> BucketReport {
        let state = self.control.state();
        let totals = self.core.activity().totals();
        let now = Instant::now();
        let previous = self.previous.lock().replace((now, totals.clone()));
        let per_sec = |now_total: u64, before: Option<u64>, elapsed: f64| match before {
            Some(before) if elapsed > 0.0 => now_total.saturating_sub(before) as f64 / elapsed,
            _ => 0.0,
        };
        let pending = BucketId::all()
            .filter(|&b| matches!(self.core.phase(&state, b), Phase::Restoring | Phase::AwaitingPromotion))
            .count() as u32;
        let buckets = BucketId::all()
            .filter(|&b| self.core.phase(&state, b) == Phase::Serving)
            .map(|b| {
                let (items, bytes) = self.store.bucket_stats(b);
                let items = items as u64;
                let (reads, writes) = totals[b.index()];
                let (before, elapsed) = match &previous {
                    Some((at, t)) => (Some(t[b.index()]), now.duration_since(*at).as_secs_f64()),
                    None => (None, 0.0),
                };
                ReportedBucket {
                    bucket: b.0,
                    items,
                    bytes,
                    reads_per_sec: per_sec(reads, before.map(|t| t.0), elapsed),
                    writes_per_sec: per_sec(writes, before.map(|t| t.1), elapsed),
                }
            })
            .collect();
        BucketReport {
            node: self.me,
            map_version: state.map.version,
            buckets,
            transfer_rate: self.progress.measured_rate(),
            pending,
        }
    }

    /// Keeps a member's report (on the leader; a member's report to a node that is not the
    /// leader is kept too, and forgotten once it is old).
    pub fn receive(&self, report: BucketReport) {
        let state = self.control.state();
        let mut reports = self.reports.lock();
        reports.retain(|id, _| state.is_member(*id));
        if state.is_member(report.node) {
            reports.insert(report.node, (Instant::now(), report));
        }
    }

    fn received(&self) -> BTreeMap<NodeId, Received> {
        let now = Instant::now();
        self.reports
            .lock()
            .iter()
            .map(|(&id, (at, report))| (id, Received { report: report.clone(), age: now.duration_since(*at) }))
            .collect()
    }

    fn leader_addr(&self) -> Result<Option<String>, BalanceError> {
        match self.control.leader() {
            Some(leader) if leader == self.me => Ok(None),
            Some(leader) => {
                let state = self.control.state();
                let addr = state.member_of(leader).map(|m| m.peer_addr.clone()).ok_or(BalanceError::NoLeader)?;
                Ok(Some(addr))
            }
            None => Err(BalanceError::NoLeader),
        }
    }

    /// `GET /v1/cluster/buckets`: here on the leader, else asked of the leader.
    pub async fn buckets(&self, query: BucketsQuery) -> Result<BucketsView, BalanceError> {
        match self.leader_addr()? {
            None => self.buckets_here(query),
            Some(addr) => self
                .peers
                .ask(&addr, AskBuckets(query), PEER_CALL_TIMEOUT)
                .await
                .map(|v| v.0)
                .map_err(BalanceError::Call),
        }
    }

    /// The view, on the leader only (a request forwarded to a former leader is refused).
    pub fn buckets_here(&self, query: BucketsQuery) -> Result<BucketsView, BalanceError> {
        if self.control.leader() != Some(self.me) {
            return Err(BalanceError::NotLeader);
        }
        let state = self.control.state();
        Ok(plan::view(self.me, &state, &self.received(), self.config.stats_interval, query))
    }

    /// `POST /v1/cluster/rebalance`: here on the leader, else asked of the leader.
    pub async fn rebalance(&self, request: RebalanceRequest) -> Result<RebalancePlan, BalanceError> {
        match self.leader_addr()? {
            None => self.rebalance_here(request).await,
            Some(addr) => self
                .peers
                .ask(&addr, Rebalance(request), REBALANCE_TIMEOUT)
                .await
                .map(|p| p.0)
                .map_err(BalanceError::Call),
        }
    }

    /// Plans, and unless a dry run starts, a balancing, on the leader only.
    pub async fn rebalance_here(&self, request: RebalanceRequest) -> Result<RebalancePlan, BalanceError> {
        if self.control.leader() != Some(self.me) {
            return Err(BalanceError::NotLeader);
        }
        let state = self.control.state();
        let reports = self.received();
        let rate = plan::transfer_rate(&reports, self.config.transfer_rate);
        let (mut plan, owners) =
            plan::plan(&state, &reports, self.config.stats_interval, request, rate).map_err(BalanceError::Refused)?;
        if request.dry_run || plan.moves.is_empty() {
            return Ok(plan);
        }
        let asked = AdminRequest::Rebalance { from_version: plan.map_version, owners };
        match self.control.admin(asked).await.map_err(BalanceError::Control)? {
            AdminResponse::Moved { map_version } => plan.to_version = Some(map_version),
            other => {
                return Err(BalanceError::Control(ControlError::Fatal {
                    detail: format!("unexpected answer {other:?}"),
                }))
            }
        }
        tracing::info!(
            node = ?plan.node_id,
            buckets = plan.moves.len(),
            bytes = plan.bytes_moved,
            ratio_before = plan.ratio_before,
            ratio_after = plan.ratio_after,
            "balancing by data"
        );
        Ok(plan)
    }

    /// On the leader, after a round of reports: a balancing by itself is due when it is turned
    /// on, this round and the one before found the data out of balance, and the last one it
    /// started is at least `--auto-balance-interval` ago.
    fn note_round(&self) {
        let state = self.control.state();
        let over = plan::auto_balance_due(&state, &self.received(), self.config.stats_interval);
        let twice = std::mem::replace(&mut *self.over_before.lock(), over) && over;
        let waited = self.last_auto.lock().is_none_or(|at| at.elapsed() >= self.config.auto_interval);
        self.due.store(twice && waited, Ordering::Relaxed);
    }

    /// On the leader: whether a balancing by itself is due (see [`Self::note_round`]).
    pub fn balance_due(&self) -> bool {
        self.control.is_leader() && self.due.load(Ordering::Relaxed)
    }

    /// On the leader, when due: starts a balancing if a plan would improve the balance.
    pub async fn balance_by_itself(&self) {
        if !self.due.swap(false, Ordering::Relaxed) {
            return;
        }
        let state = self.control.state();
        let reports = self.received();
        let rate = plan::transfer_rate(&reports, self.config.transfer_rate);
        let request = RebalanceRequest { node: None, dry_run: true };
        let Ok((plan, _)) = plan::plan(&state, &reports, self.config.stats_interval, request, rate) else { return };
        if plan.moves.is_empty() || plan.ratio_after >= plan.ratio_before {
            return;
        }
        *self.last_auto.lock() = Some(Instant::now());
        tracing::info!(ratio = plan.ratio_before, "data is out of balance (over 60/40): balancing by itself");
        if let Err(e) = self.rebalance_here(RebalanceRequest { node: None, dry_run: false }).await {
            tracing::warn!(error = ?e, "automatic balancing did not start");
        }
    }

    /// Each bucket's bytes as the leader's latest reports say (a bucket its owner did not
    /// report counts 0); None on a node that is not the leader, or without any report. The
    /// control plane records them before a membership change, whose map then balances them.
    pub fn bucket_sizes(&self) -> Option<Vec<u64>> {
        if self.control.leader() != Some(self.me) {
            return None;
        }
        let reports = self.received();
        if reports.is_empty() {
            return None;
        }
        Some(plan::sizes(&plan::figures(&self.control.state(), &reports)))
    }

    /// Bytes of the fullest member over the emptiest's, as the leader's latest reports say;
    /// 0 on a node that is not the leader (only the leader has every report), and until
    /// every member reported on the current map.
    pub fn balance_ratio(&self) -> f64 {
        if self.control.leader() != Some(self.me) {
            return 0.0;
        }
        let state = self.control.state();
        let reports = self.received();
        if !plan::missing(&state, &reports, self.config.stats_interval).is_empty() {
            return 0.0;
        }
        let sizes = plan::sizes(&plan::figures(&state, &reports));
        plan::finite(shoal_raft::balance_ratio(&shoal_raft::loads(&state.map, &state.active_ids(), &sizes)))
    }
}
