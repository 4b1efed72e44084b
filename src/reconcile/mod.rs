//! One reconciler per node: the one loop that acts on the replicated state.
//!
//! ```text
//!   applied state ─┐                                  ┌─▶ quick actions, done inline
//!   job results  ──┼─▶ facts ─▶ plan(prev, state, facts) ─┤   (drop, install, limit, stop)
//!   queue, tick  ──┘     ▲                            └─▶ jobs, one per kind or bucket
//!                        └──────────── their results ─────┘   (pull, restore, attach, ...)
//! ```
//!
//! The planner (`plan.rs`) is a pure function, property-tested over random histories of the
//! state; this module gathers the facts it needs, carries its actions out, and feeds the jobs'
//! results back as facts. It wakes up when the applied state changes, when a job ends, when
//! changes are queued for a replica, and at least twice a second.
//!
//! # Layout
//! - `plan.rs`: [`plan::plan`], the facts and the actions.
//! - `jobs.rs`: what each long action does.
//! - `mod.rs`: [`Reconciler`], the loop.

mod jobs;
pub mod plan;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use shoal_raft::{AdminRequest, BucketId, ClusterState, ControlPlane, NodeId};
use tokio::sync::watch;
use tokio::task::JoinSet;
use tokio::time::Instant;

use crate::balance::Balancer;
use crate::bucket::{BucketCore, Probe};
use crate::cache::CacheStore;
use crate::health::Health;
use crate::identity::Identity;
use crate::maintenance::{EnterError, Entry};
use crate::metrics::NodeMetrics;
use crate::peer::Peers;
use crate::phase::{phase_of, LocalFacts};
use crate::replication::Replicator;
use crate::transfer::import::{backoff, Puller};
use crate::transfer::progress::Progress;
use crate::transfer::stuck::StuckDetector;
use crate::transfer::TransferConfig;
use plan::{plan, Action, Entering, Facts, Job, Running};

/// How long a node that left keeps serving before it stops: long enough for every member to
/// apply its retirement (and stop sending it replica and shadow writes) under load.
const LEFT_LINGER: std::time::Duration = std::time::Duration::from_secs(2);

/// How often the loop plans even when nothing woke it.
const TICK: Duration = Duration::from_millis(500);
/// How long the async queue's sender waits for more changes once the queue is empty before it
/// ends (the loop starts the next one).
const SEND_LINGER: Duration = Duration::from_millis(100);
/// How long a job that could not finish its work waits before the loop plans it again.
pub(crate) const RETRY: Duration = Duration::from_millis(500);

/// What a node's reconciler works with.
pub struct Reconciler {
    me: NodeId,
    control: ControlPlane,
    store: Arc<CacheStore>,
    facts: Arc<LocalFacts>,
    replicator: Arc<Replicator>,
    health: Arc<Health>,
    peers: Peers,
    puller: Puller,
    progress: Arc<Progress>,
    metrics: Arc<NodeMetrics>,
    transfer: TransferConfig,
    /// The store's size limit alone and with other members.
    limits: (u64, u64),
    identity: Identity,
    data_dir: PathBuf,
    shutdown: watch::Sender<bool>,
    rejoin: Arc<Mutex<Option<Vec<String>>>>,
    probe: Option<Arc<dyn Probe>>,
    entry: Arc<Entry>,
    balancer: Arc<Balancer>,
}

/// The parts a reconciler is built from.
pub struct Parts {
    /// The bucket core (its facts and the store it writes).
    pub core: Arc<BucketCore>,
    /// The active store.
    pub store: Arc<CacheStore>,
    /// The control plane.
    pub control: ControlPlane,
    /// Replication.
    pub replicator: Arc<Replicator>,
    /// Failure detection.
    pub health: Arc<Health>,
    /// Calls to other nodes.
    pub peers: Peers,
    /// Transfer counters.
    pub progress: Arc<Progress>,
    /// Metrics.
    pub metrics: Arc<NodeMetrics>,
    /// How transfers run.
    pub transfer: TransferConfig,
    /// The store's size limit alone and with other members.
    pub limits: (u64, u64),
    /// The node's identity and where it is kept (a node that left records it).
    pub identity: (Identity, PathBuf),
    /// Turned on to stop the node.
    pub shutdown: watch::Sender<bool>,
    /// Where to rejoin, when the cluster failed this node.
    pub rejoin: Arc<Mutex<Option<Vec<String>>>>,
    /// This node's own entry into maintenance.
    pub entry: Arc<Entry>,
    /// Balancing by data (the leader starts it by itself when due).
    pub balancer: Arc<Balancer>,
}

/// A job's result, fed back as facts.
enum Done {
    /// A job that ended without a result (it panicked): its kind may be planned again.
    Gone(Kind),
    Acked,
    Pulled {
        bucket: BucketId,
        ok: bool,
        /// The pull's flip to this node committed: the bucket holds what this node pulled.
        flipped: bool,
    },
    Restored {
        bucket: BucketId,
        from: NodeId,
        outcome: Fetched,
    },
    Promoted {
        bucket: BucketId,
        from: NodeId,
        outcome: Fetched,
    },
    Reported,
    Attached,
    MovedReplica,
    HandedOver,
    MarkedRunning,
    Elected,
    CaughtUp,
    StuckChecked(Box<StuckDetector>),
    Sent,
    GaveBack,
    EndedMaintenance,
    WentAway,
    FailedNode,
    Balanced,
}

/// The planner's view of this node's own entry into maintenance.
fn entering(asked: Option<crate::maintenance::Asked>) -> Entering {
    match asked {
        None => Entering::No,
        Some(a) if a.outcome.is_some() => Entering::Decided,
        Some(a) => match a.prepare_by {
            None => Entering::Proposing,
            Some(by) => Entering::Asked { overdue: Instant::now() >= by },
        },
    }
}

/// Pulls paused after a failed one.
struct PullsWait {
    failed_at: Instant,
    until: Instant,
    map_version: u64,
}

/// A newer map ends a pause after a failed pull no sooner than this.
const PULL_RETRY_FLOOR: Duration = Duration::from_millis(250);

/// The kind of a job whose result never came.
enum Kind {
    MarkRunning,
    CatchUp,
    StuckCheck,
}

/// The running jobs, and what each one's result is taken to be if it never comes.
#[derive(Default)]
struct Jobs {
    set: JoinSet<Done>,
    if_gone: HashMap<tokio::task::Id, Done>,
}

impl Jobs {
    fn spawn(&mut self, job: impl std::future::Future<Output = Done> + Send + 'static, if_gone: Done) {
        let id = self.set.spawn(job).id();
        self.if_gone.insert(id, if_gone);
    }

    /// The next result; a job that panicked gives its `if_gone` result (and an error line).
    async fn next(&mut self) -> Option<Done> {
        match self.set.join_next_with_id().await? {
            Ok((id, done)) => {
                self.if_gone.remove(&id);
                Some(done)
            }
            Err(e) => {
                tracing::error!(error = %e, "a reconciler job failed; it is planned again");
                self.if_gone.remove(&e.id())
            }
        }
    }

    fn is_empty(&self) -> bool {
        self.set.is_empty()
    }
}

/// What asking a node for a copy of a bucket gave.
enum Fetched {
    /// The copy is installed.
    Installed,
    /// The node holds none.
    NoCopy,
    /// It could not be asked (retry later).
    Failed,
}

/// The loop's own memory between plans.
#[derive(Default)]
struct Memory {
    running: Running,
    no_copy: BTreeMap<BucketId, BTreeSet<NodeId>>,
    caught_up: bool,
    marked_running: bool,
    handover_tried: bool,
    pull_failures: u32,
    /// After a failed pull, new pulls wait until this time, or a newer map (but at least
    /// `PULL_RETRY_FLOOR`: while other buckets move the map changes every few milliseconds).
    pulls_wait: Option<PullsWait>,
    stuck: Option<Box<StuckDetector>>,
    stuck_checked: Option<Instant>,
    round_open: bool,
    limit: u64,
    /// Buckets served again empty since the restart began (reported once it is over).
    emptied: Vec<BucketId>,
    /// The cluster failed this node and it gave back the lost buckets it served last.
    gave_back: bool,
}

impl Reconciler {
    /// A reconciler over `parts`.
    pub fn new(parts: Parts) -> Arc<Self> {
        let Parts {
            core,
            store,
            control,
            replicator,
            health,
            peers,
            progress,
            metrics,
            transfer,
            limits,
            identity: (identity, data_dir),
            shutdown,
            rejoin,
            entry,
            balancer,
        } = parts;
        Arc::new(Reconciler {
            me: control.node_id(),
            probe: core.probe().cloned(),
            puller: Puller::new(peers.clone(), transfer),
            control,
            store,
            facts: core.facts().clone(),
            replicator,
            health,
            peers,
            progress,
            metrics,
            transfer,
            limits,
            identity,
            data_dir,
            shutdown,
            rejoin,
            entry,
            balancer,
        })
    }

    /// Runs the loop until the node stops.
    pub async fn run(self: Arc<Self>) {
        let mut applied = self.control.view().subscribe();
        let mut entry = self.entry.subscribe();
        let mut jobs = Jobs::default();
        let mut memory =
            Memory { stuck: Some(Box::default()), limit: self.store.stats().limit_bytes, ..Memory::default() };
        let mut previous = self.control.state();
        loop {
            let state = self.control.state();
            let facts = self.facts_now(&state, &mut memory);
            let actions = plan(&previous, &state, &facts);
            if !actions.is_empty() {
                tracing::trace!(node_id = self.me, map_version = state.map.version, ?actions, "plan");
            }
            self.log_maintenance(&previous, &state);
            previous = state.clone();
            for action in actions {
                if self.act(action, &state, &mut memory, &mut jobs) {
                    return;
                }
            }
            self.follow_progress(&state, &mut memory);
            // Lost buckets stay marked until found or cleared: they do not hold the line back.
            if !memory.emptied.is_empty() && self.facts.restoring().iter().all(|&b| state.is_lost(b)) {
                let emptied = std::mem::take(&mut memory.emptied);
                tracing::warn!(
                    node_id = self.me,
                    buckets = emptied.len(),
                    first = ?emptied.first(),
                    "restart: no copy was left of some buckets this node owns (every copy died): they serve again, empty"
                );
            }
            tokio::select! {
                biased;
                done = jobs.next(), if !jobs.is_empty() => {
                    if let Some(done) = done {
                        self.learn(done, &mut memory);
                    }
                }
                changed = applied.changed() => {
                    if changed.is_err() {
                        return;
                    }
                }
                _ = entry.changed() => {}
                // A leader looks for members to fail after every ping round.
                () = self.health.round() => {}
                () = self.replicator.queued().notified(), if !memory.running.send => {}
                // Once: after that the node only gives its lost buckets back and rejoins.
                () = self.facts.failed(), if !memory.running.give_back && !memory.gave_back => {}
                () = tokio::time::sleep(TICK) => {}
            }
        }
    }

    /// The facts the planner needs, from this node's parts and the loop's memory.
    fn facts_now(&self, state: &ClusterState, memory: &mut Memory) -> Facts {
        if let Some(w) = &memory.pulls_wait {
            let now = Instant::now();
            if now >= w.until || (state.map.version > w.map_version && now >= w.failed_at + PULL_RETRY_FLOOR) {
                memory.pulls_wait = None;
            }
        }
        if !state.transfer_flag || !self.control.is_leader() {
            if let Some(stuck) = memory.stuck.as_mut() {
                stuck.reset();
            }
            memory.stuck_checked = None;
        }
        let stuck_check_due =
            memory.stuck.is_some() && memory.stuck_checked.is_none_or(|t| t.elapsed() >= self.transfer.check_interval);
        if !state.member_of(self.me).is_some_and(|m| m.leaving) {
            memory.handover_tried = false;
        }
        let node = self.health.node_facts();
        let restoring: BTreeSet<BucketId> = self.facts.restoring().into_iter().collect();
        // What a node answered about a copy counts for the restore or promotion it was asked
        // for, not for a later one.
        memory.no_copy.retain(|b, _| restoring.contains(b) || state.promoted.contains_key(&b.0));
        Facts {
            me: self.me,
            caught_up: memory.caught_up,
            voter: self.control.is_voter(),
            leader: self.control.is_leader(),
            failed: node.failed,
            draining: self.facts.is_stopping(),
            active: BucketId::all().filter(|&b| self.store.bucket_stats(b).0 > 0).collect(),
            replicas: self.facts.copies().sources(),
            restoring,
            shadows: self.facts.shadows(),
            installed: state
                .promoted
                .keys()
                .map(|&b| BucketId(b))
                .filter(|&b| self.facts.is_installed(state, b))
                .collect(),
            attached: self.facts.attached().current(state, self.me),
            no_copy: memory.no_copy.clone(),
            suspected: self.health.pfail_members().into_iter().collect(),
            running: memory.running.clone(),
            pulls_paused: memory.pulls_wait.is_some(),
            parallelism: self.transfer.parallelism,
            marked_running: memory.marked_running,
            leader_id: self.control.leader(),
            leader_lost: self.control.leader_lost(),
            handover_tried: memory.handover_tried,
            queue_waiting: self.replicator.queue_waiting(),
            stuck_check_due,
            limits: (memory.limit, self.limits.0, self.limits.1),
            gave_back: memory.gave_back,
            // Read only while a maintenance runs: the simulation never reads the wall clock.
            now_ms: if state.maintenance.is_some() { crate::maintenance::now_ms() } else { 0 },
            entering: entering(self.entry.asked()),
            to_fail: if self.control.is_leader() { self.health.to_fail() } else { None },
            balance_due: self.balancer.balance_due(),
        }
    }

    /// Carries out one action; answers whether the node stops. An action that waits on
    /// anything (another node, Raft) is a job ([`Self::start`]); the rest is done here at once.
    fn act(self: &Arc<Self>, action: Action, state: &Arc<ClusterState>, memory: &mut Memory, jobs: &mut Jobs) -> bool {
        match action {
            Action::Rejoin => {
                self.rejoin(state);
                return true;
            }
            Action::Stop => {
                self.stop_as_retired();
                return true;
            }
            Action::SetLimit { bytes } => {
                self.store.set_limit(bytes);
                memory.limit = bytes;
            }
            Action::Unmark { bucket } => self.facts.restored(bucket),
            Action::ServeEmpty { buckets } => self.serve_empty(buckets, memory),
            Action::Install { bucket, from } => {
                if self.replicator.holder.install_promoted(bucket, from) {
                    tracing::debug!(bucket = bucket.0, from, "promoted bucket installed from the replica");
                }
            }
            Action::AdoptShadow { bucket } => {
                tracing::info!(bucket = bucket.0, "promoted bucket served from this node's own shadow");
                self.facts.install(state, bucket);
                self.facts.attached().detach(bucket);
            }
            Action::DropActive { bucket } => self.drop_active(bucket),
            Action::DropReplica { bucket, source } => {
                if !self.replicator.holder.drop_replica(bucket, source) {
                    tracing::debug!(
                        node_id = self.me,
                        bucket = bucket.0,
                        source,
                        "kept a replica copy the plan would drop: it changed after the plan's state"
                    );
                }
            }
            Action::RefuseMaintenance { refusal } => self.entry.decide(Err(EnterError::Refused(refusal))),
            Action::Job(job) => self.start(job, memory, jobs),
        }
        false
    }

    /// Starts the job of an action that waits on something, marked as running until its
    /// result comes back ([`Self::learn`]); the second future's result is what a job that
    /// panicked gives.
    fn start(self: &Arc<Self>, job: Job, memory: &mut Memory, jobs: &mut Jobs) {
        let r = &mut memory.running;
        let me = self.clone();
        match job {
            Job::GiveBack => {
                r.give_back = true;
                jobs.spawn(async move { me.give_back().await }, Done::GaveBack);
            }
            Job::Ack { to_version } => {
                r.ack = Some(to_version);
                jobs.spawn(async move { me.ack(to_version).await }, Done::Acked);
            }
            Job::Elect => {
                r.elect = true;
                jobs.spawn(async move { me.elect().await }, Done::Elected);
            }
            Job::MarkRunning => {
                r.mark_running = true;
                jobs.spawn(async move { me.mark_running().await }, Done::Gone(Kind::MarkRunning));
            }
            Job::CatchUp => {
                r.catch_up = true;
                jobs.spawn(async move { me.caught_up().await }, Done::Gone(Kind::CatchUp));
            }
            Job::Restore { bucket, from } => {
                r.restores.insert(bucket);
                let failed = Done::Restored { bucket, from, outcome: Fetched::Failed };
                jobs.spawn(async move { me.restore(bucket, from).await }, failed);
            }
            Job::RestoreShadow { bucket, from } => {
                r.promotions.insert(bucket);
                let failed = Done::Promoted { bucket, from, outcome: Fetched::Failed };
                jobs.spawn(async move { me.restore_shadow(bucket, from).await }, failed);
            }
            Job::ReportPromoted { installed, lost } => {
                r.report = true;
                jobs.spawn(async move { me.report_promoted(installed, lost).await }, Done::Reported);
            }
            Job::Pull { bucket, from, epoch } => {
                r.pulls.insert(bucket);
                let failed = Done::Pulled { bucket, ok: false, flipped: false };
                jobs.spawn(async move { me.pull(bucket, from, epoch).await }, failed);
            }
            Job::Attach { holder, buckets } => {
                r.attach = true;
                jobs.spawn(async move { me.attach(holder, buckets).await }, Done::Attached);
            }
            Job::MoveReplica { holder } => {
                r.move_replica = true;
                jobs.spawn(async move { me.move_replica(holder).await }, Done::MovedReplica);
            }
            Job::HandOver { heir } => {
                r.handover = true;
                memory.handover_tried = true;
                jobs.spawn(async move { me.hand_over(heir).await }, Done::HandedOver);
            }
            Job::CheckStuck => {
                if let Some(detector) = memory.stuck.take() {
                    r.stuck = true;
                    memory.stuck_checked = Some(Instant::now());
                    jobs.spawn(async move { me.check_stuck(detector).await }, Done::Gone(Kind::StuckCheck));
                }
            }
            Job::EndMaintenance { node, reason } => {
                r.end_maintenance = true;
                jobs.spawn(async move { me.end_maintenance(node, reason).await }, Done::EndedMaintenance);
            }
            Job::FailNode { node, votes, members } => {
                r.fail = true;
                jobs.spawn(async move { me.fail_node(node, votes, members).await }, Done::FailedNode);
            }
            Job::Balance => {
                r.balance = true;
                let job = async move {
                    me.balancer.balance_by_itself().await;
                    Done::Balanced
                };
                jobs.spawn(job, Done::Balanced);
            }
            Job::GoAway { heir } => {
                r.go_away = true;
                jobs.spawn(async move { me.go_away(heir).await }, Done::WentAway);
            }
            Job::SendQueued => {
                r.send = true;
                jobs.spawn(async move { me.send_queued().await }, Done::Sent);
            }
        }
    }

    /// The cluster failed this node: it stops, and the node rejoins through the other members.
    fn rejoin(&self, state: &ClusterState) {
        let join: Vec<String> = state.members.iter().filter(|m| m.id != self.me).map(|m| m.api_addr.clone()).collect();
        tracing::error!(node_id = self.me, "the cluster failed this node: it stops, discards its data and rejoins");
        *self.rejoin.lock() = Some(join);
        self.shutdown.send_replace(true);
    }

    /// This node left the cluster: it records so and stops, after a linger.
    fn stop_as_retired(&self) {
        let mut retired = self.identity.clone();
        retired.retired = true;
        if let Err(e) = retired.store(&self.data_dir) {
            tracing::error!(error = %e, "could not record that this node left");
        }
        tracing::info!(node_id = self.me, "this node has left the cluster; stopping");
        // Not ready any more, and its refusals say that it stops (`node_draining`).
        self.facts.start_draining();
        // Members that have not applied the retirement yet still send this node their
        // replica and shadow writes for a moment: it keeps answering them a little
        // while, so that a leave fails no write.
        let shutdown = self.shutdown.clone();
        let control = self.control.clone();
        tokio::spawn(async move {
            tokio::time::sleep(LEFT_LINGER).await;
            control.close_as_leader(LEFT_LINGER).await;
            shutdown.send_replace(true);
        });
    }

    /// No copy is left of `buckets`: they serve again, empty.
    fn serve_empty(&self, buckets: Vec<BucketId>, memory: &mut Memory) {
        tracing::debug!(
            node_id = self.me,
            ?buckets,
            map_version = self.control.state().map.version,
            "no copy is left of these buckets: they serve again, empty"
        );
        memory.emptied.extend(buckets.iter().copied());
        for b in buckets {
            self.facts.restored(b);
            memory.no_copy.remove(&b);
            if let Some(probe) = &self.probe {
                probe.emptied(self.me, b);
            }
        }
    }

    /// Drops this node's active data of `bucket`, unless the newest state says it keeps it
    /// (the action was planned on the loop's state).
    fn drop_active(&self, bucket: BucketId) {
        let now = self.control.state();
        if phase_of(&now, self.me, bucket, self.facts.of(&now, bucket)).keeps_active_data() {
            return;
        }
        let dropped = self.store.take_bucket(bucket).len();
        self.facts.dropped(bucket);
        tracing::debug!(node_id = self.me, bucket = bucket.0, dropped, "dropped a bucket this node keeps nothing of");
    }

    /// Waits until this node applied what the cluster committed before it asked.
    async fn caught_up(&self) -> Done {
        self.control.catch_up().await;
        Done::CaughtUp
    }

    /// Looks for a stuck state transfer (the detector keeps what it saw between checks).
    async fn check_stuck(&self, mut detector: Box<StuckDetector>) -> Done {
        detector.check(&self.control, &self.peers, self.transfer, &self.metrics).await;
        Done::StuckChecked(detector)
    }

    /// Attaches `holder` as the replica of `buckets`; when it is not ready (or a bucket moved
    /// on), waits before the plan may try again.
    async fn attach(&self, holder: NodeId, buckets: Vec<BucketId>) -> Done {
        if self.replicator.attach(holder, &buckets).await < buckets.len() {
            tokio::time::sleep(RETRY).await;
        }
        Done::Attached
    }

    /// Ends `node`'s maintenance through Raft (a failure waits a second before the plan may
    /// try again).
    async fn end_maintenance(&self, node: NodeId, reason: impl ToString) -> Done {
        let reason = reason.to_string();
        if let Err(e) = self.control.admin(AdminRequest::EndMaintenance { node_id: node, reason }).await {
            tracing::warn!(node_id = node, error = %e, "could not end the maintenance");
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
        Done::EndedMaintenance
    }

    /// Sends the async replication queue, batch after batch until it stays empty for a while:
    /// under a steady load the loop is not woken (and does not plan) once per batch, nor once
    /// per lull between two batches (planning each time took 7% of a node's CPU). A change
    /// queued as the job ends wakes the loop (the notification is kept for it).
    async fn send_queued(&self) -> Done {
        loop {
            while self.replicator.queue_waiting() {
                self.replicator.send_queued().await;
            }
            let queued = self.replicator.queued().notified();
            if tokio::time::timeout(SEND_LINGER, queued).await.is_err() {
                return Done::Sent;
            }
        }
    }

    /// Feeds a job's result back.
    fn learn(&self, done: Done, memory: &mut Memory) {
        let r = &mut memory.running;
        match done {
            Done::Gone(Kind::MarkRunning) => r.mark_running = false,
            Done::Gone(Kind::CatchUp) => r.catch_up = false,
            Done::Gone(Kind::StuckCheck) => {
                r.stuck = false;
                memory.stuck = Some(Box::default());
            }
            Done::Acked => r.ack = None,
            Done::Pulled { bucket, ok, flipped } => {
                r.pulls.remove(&bucket);
                if flipped {
                    // Pulled in this life: nothing to restore, even if it was marked at a
                    // restart and this node has not caught up yet (restoring it would drop the
                    // copy just pulled, and its source, now the shadow, holds no replica).
                    self.facts.restored(bucket);
                }
                if ok {
                    memory.pull_failures = 0;
                } else {
                    memory.pull_failures += 1;
                    let wait = backoff(memory.pull_failures);
                    let now = Instant::now();
                    let map_version = self.control.state().map.version;
                    memory.pulls_wait = Some(PullsWait { failed_at: now, until: now + wait, map_version });
                }
            }
            Done::Restored { bucket, from, outcome } => {
                r.restores.remove(&bucket);
                self.fetched(bucket, from, outcome, memory);
            }
            Done::Promoted { bucket, from, outcome } => {
                r.promotions.remove(&bucket);
                self.fetched(bucket, from, outcome, memory);
            }
            Done::Reported => r.report = false,
            Done::Attached => r.attach = false,
            Done::MovedReplica => r.move_replica = false,
            Done::HandedOver => r.handover = false,
            Done::Elected => r.elect = false,
            Done::MarkedRunning => {
                r.mark_running = false;
                memory.marked_running = true;
            }
            Done::CaughtUp => {
                tracing::debug!(
                    node_id = self.me,
                    map_version = self.control.state().map.version,
                    "caught up with the leader: restoring"
                );
                r.catch_up = false;
                memory.caught_up = true;
            }
            Done::StuckChecked(detector) => {
                r.stuck = false;
                memory.stuck = Some(detector);
            }
            Done::Sent => r.send = false,
            Done::GaveBack => {
                r.give_back = false;
                memory.gave_back = true;
            }
            Done::EndedMaintenance => r.end_maintenance = false,
            Done::WentAway => r.go_away = false,
            Done::FailedNode => r.fail = false,
            Done::Balanced => r.balance = false,
        }
    }

    fn fetched(&self, bucket: BucketId, from: NodeId, outcome: Fetched, memory: &mut Memory) {
        match outcome {
            Fetched::Installed => {
                memory.no_copy.remove(&bucket);
            }
            Fetched::NoCopy => {
                memory.no_copy.entry(bucket).or_default().insert(from);
            }
            Fetched::Failed => {}
        }
    }

    /// Logs a maintenance's changes of phase as this node applies them (the member itself
    /// logs its own at `WARN`).
    fn log_maintenance(&self, previous: &ClusterState, state: &ClusterState) {
        use shoal_raft::state::MaintenancePhase;
        let phase = |s: &ClusterState| s.maintenance.as_ref().map(|m| (m.node, m.phase));
        let (before, now) = (phase(previous), phase(state));
        if before == now || self.control.leader() != Some(self.me) {
            return;
        }
        match (before, now) {
            (_, Some((node, MaintenancePhase::Preparing))) => {
                tracing::info!(node_id = node, "maintenance: the node prepares (the replica it holds moves on)")
            }
            (_, Some((node, MaintenancePhase::Away))) => {
                tracing::info!(node_id = node, "maintenance: the node is away; its replica holder serves its buckets")
            }
            (_, Some((node, MaintenancePhase::Returned))) => {
                tracing::info!(node_id = node, "maintenance: the node is back and takes its buckets back")
            }
            (Some((node, MaintenancePhase::Returned)), None) => {
                tracing::info!(node_id = node, "maintenance over: the node is back")
            }
            (Some((node, MaintenancePhase::Preparing)), None) => {
                tracing::info!(node_id = node, "maintenance called off before the node went away")
            }
            (Some((node, _)), None) => tracing::warn!(
                node_id = node,
                failed = state.failed.contains(&node),
                "maintenance ended before the node came back: failure detection no longer spares it"
            ),
            (None, None) => {}
        }
    }

    /// Opens and closes rounds of pulls for the transfer's progress figures.
    fn follow_progress(&self, state: &ClusterState, memory: &mut Memory) {
        let incoming = state.incoming_of(self.me).len();
        if incoming > 0 && !memory.round_open {
            memory.round_open = true;
            self.progress.start_round(incoming);
            tracing::info!(node_id = self.me, buckets = incoming, "state transfer: pulling buckets");
        } else if incoming == 0 && memory.round_open && memory.running.pulls.is_empty() {
            memory.round_open = false;
            self.progress.end_round();
            tracing::info!(node_id = self.me, "state transfer: all buckets received");
        }
    }
}
