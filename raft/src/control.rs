//! [`ControlPlane`]: one node's handle on the Raft control plane.
//!
//! It owns the Raft instance, its sled storage and the [`StateView`] of the applied state,
//! and it runs the membership protocol of `raft/DESIGN.md`:
//!
//! ```text
//!  joiner                       any member                 leader
//!    | Register{addrs} ------------> | ----- forward -------> | commit Register -> id
//!    | <--------------------------------------------- id ----|
//!    | start Raft as `id`
//!    | Admit{id} ------------------> | ----- forward -------> | add_learner, wait caught up,
//!    |                               |                        | commit Admit (map rebalanced),
//!    |                               |                        | reconcile voters
//!    | <------------------------------------- map_version ----|
//! ```
//!
//! Membership changes run one at a time on the leader (a mutex); a background task on the
//! leader reconciles Raft's voter and learner sets with the members in join order, so a
//! change interrupted by a leader crash is finished by the next leader.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use openraft::error::{CheckIsLeaderError, ClientWriteError, InitializeError, RaftError as OpenRaftError};
use openraft::{ChangeMembers, ServerState};
use tokio::sync::Mutex;
use tokio::task::JoinHandle;

use crate::command::{ClusterCommand, CommandResponse, Proposal};
use crate::disk::{Disk, MemoryDisk};
use crate::distribution::{NodeId, BUCKET_COUNT};
use crate::error::ControlError;
use crate::log_store::DiskLogStore;
use crate::network::{
    AdminClient, AdminRequest, AdminResponse, ControlTransport, LostBucket, MemberStatus, RaftTransportNetwork,
};
use crate::state::ClusterState;
use crate::state_machine::{DiskStateMachine, StateView};
use crate::types::{MemberNode, Raft, RaftMetrics};

/// Where a node's Raft state lives.
#[derive(Clone)]
pub enum Storage {
    /// A sled database in this directory.
    Dir(PathBuf),
    /// Memory (the deterministic simulation).
    Memory(MemoryDisk),
}

/// How a node's control plane is set up.
#[derive(Clone)]
pub struct ControlConfig {
    /// This node's id.
    pub node_id: NodeId,
    /// The client API address others use to reach this node.
    pub api_addr: String,
    /// The internal address others use for Raft and node-to-node traffic.
    pub peer_addr: String,
    /// Where the Raft log, vote and state machine are kept.
    pub storage: Storage,
    /// How messages reach other nodes.
    pub transport: Arc<dyn ControlTransport>,
    /// Raft heartbeat interval.
    pub heartbeat: Duration,
    /// Raft election timeout: a random value in `[election_timeout, 4/3 × election_timeout)`.
    pub election_timeout: Duration,
    /// Bound on every wait of a membership change (learner catch-up, leader election).
    pub change_timeout: Duration,
    /// This node's name (recorded when it bootstraps a cluster).
    pub name: Option<String>,
}

impl ControlConfig {
    /// A config with shoal's default timings.
    pub fn new(
        node_id: NodeId,
        api_addr: String,
        peer_addr: String,
        storage: Storage,
        transport: Arc<dyn ControlTransport>,
    ) -> Self {
        ControlConfig {
            node_id,
            api_addr,
            peer_addr,
            storage,
            transport,
            heartbeat: Duration::from_millis(250),
            election_timeout: Duration::from_millis(1500),
            change_timeout: Duration::from_secs(30),
            name: None,
        }
    }
}

/// A node's handle on the control plane. Cheap to clone.
#[derive(Clone)]
pub struct ControlPlane {
    inner: Arc<Inner>,
}

struct Inner {
    config: ControlConfig,
    node: MemberNode,
    raft: Raft,
    view: StateView,
    disk: Disk,
    /// Reads the committed index the log store records.
    log_store: DiskLogStore,
    admin_client: AdminClient,
    /// Held for the whole of a membership change on the leader, so changes never interleave.
    membership_lock: Mutex<()>,
    /// Nodes the reconciler found in Raft's config but not among the members, and since when.
    /// On tokio's clock, not the wall clock: the simulation runs on it, and a grace counted
    /// on the wall clock never ran out there (a retired node stayed in the Raft config).
    stale_since: parking_lot::Mutex<HashMap<NodeId, tokio::time::Instant>>,
    reconciler: parking_lot::Mutex<Option<JoinHandle<()>>>,
    /// How many times this node saw the Raft leader change (to another node, or to none),
    /// and the leader it saw last (0: none).
    leader_changes: std::sync::atomic::AtomicU64,
    last_leader: std::sync::atomic::AtomicU64,
    /// Set on a leader that is about to stop: it proposes nothing more.
    closing: std::sync::atomic::AtomicBool,
    /// When a leader's entries were last taken here (on tokio's clock: the simulation's).
    leader_heard: parking_lot::Mutex<tokio::time::Instant>,
    /// Whether a member runs as this node's failure detection sees it (none: every member
    /// that is not away in maintenance counts as running).
    liveness: parking_lot::RwLock<Option<Liveness>>,
    /// Each bucket's bytes as this node, leading, knows them (none: unknown).
    bucket_sizes: parking_lot::RwLock<Option<BucketSizes>>,
}

/// Each bucket's bytes as the leader knows them from the members' reports, if it does.
pub type BucketSizes = Arc<dyn Fn() -> Option<Vec<u64>> + Send + Sync>;

/// Whether member `id` answers, as the node's failure detection sees it: the leader asks it
/// before it changes the voters, so that it never starts a change that cannot finish.
pub type Liveness = Arc<dyn Fn(NodeId) -> bool + Send + Sync>;

/// How long a retired or abandoned node stays in Raft's config before the leader drops it,
/// unless it has already caught up with the log (and so has seen its own removal).
const STALE_NODE_GRACE: Duration = Duration::from_secs(10);
/// How long a non-member that has every entry is kept in the Raft config, so that heartbeats
/// tell it the commit index (several heartbeat intervals).
const COMMIT_NEWS_GRACE: Duration = Duration::from_secs(2);

/// How long a restarted node asks the leader for its read index before it settles for what it
/// knows itself (a leader of an earlier version does not know the request, and says so at once).
const READ_INDEX_FOR: Duration = Duration::from_secs(30);
/// How long one read index request may take.
const READ_INDEX_WAIT: Duration = Duration::from_secs(5);

impl ControlPlane {
    /// Opens the Raft storage `config.storage` names and starts Raft. Does not bootstrap or
    /// join.
    pub async fn open(config: ControlConfig) -> Result<Self, ControlError> {
        let disk = match &config.storage {
            Storage::Dir(dir) => Disk::Sled(open_db(dir).await?),
            Storage::Memory(memory) => Disk::Memory(memory.clone()),
        };
        disk.migrate().map_err(fatal)?;
        let log_store = DiskLogStore::open(&disk).map_err(fatal)?;
        let state_machine = DiskStateMachine::open(&disk).map_err(fatal)?;
        let view = state_machine.view();
        let heartbeat = config.heartbeat.as_millis() as u64;
        let election = config.election_timeout.as_millis() as u64;
        let raft_config = openraft::Config {
            cluster_name: "shoal".into(),
            heartbeat_interval: heartbeat,
            // openraft's followers refuse other candidates for `election_timeout_max` after
            // the last heartbeat (the leader lease), so a dead leader is replaced about twice
            // that after it died: a narrow range keeps it short (the node's config derives
            // the timeout from its failure-detection timeout).
            election_timeout_min: election,
            election_timeout_max: election * 4 / 3,
            install_snapshot_timeout: 5_000,
            snapshot_policy: openraft::SnapshotPolicy::LogsSinceLast(500),
            max_in_snapshot_log_to_keep: 500,
            ..Default::default()
        }
        .validate()
        .map_err(fatal)?;
        let network = RaftTransportNetwork::new(config.transport.clone());
        let commit_reader = log_store.clone();
        let raft =
            Raft::new(config.node_id, Arc::new(raft_config), network, log_store, state_machine).await.map_err(fatal)?;
        let node = MemberNode { api_addr: config.api_addr.clone(), peer_addr: config.peer_addr.clone() };
        let admin_client = AdminClient::new(config.transport.clone(), config.change_timeout + Duration::from_secs(5));
        let control = ControlPlane {
            inner: Arc::new(Inner {
                config,
                node,
                raft,
                view,
                disk,
                log_store: commit_reader,
                admin_client,
                membership_lock: Mutex::new(()),
                stale_since: parking_lot::Mutex::new(HashMap::new()),
                reconciler: parking_lot::Mutex::new(None),
                leader_changes: Default::default(),
                last_leader: Default::default(),
                closing: Default::default(),
                leader_heard: parking_lot::Mutex::new(tokio::time::Instant::now()),
                liveness: parking_lot::RwLock::new(None),
                bucket_sizes: parking_lot::RwLock::new(None),
            }),
        };
        let task = tokio::spawn(reconcile_loop(Arc::downgrade(&control.inner)));
        *control.inner.reconciler.lock() = Some(task);
        Ok(control)
    }

    /// Tells the control plane how to see whether a member runs (failure detection's view).
    pub fn set_liveness(&self, liveness: Liveness) {
        *self.inner.liveness.write() = Some(liveness);
    }

    /// Tells the control plane where the leader finds each bucket's bytes.
    pub fn set_bucket_sizes(&self, sizes: BucketSizes) {
        *self.inner.bucket_sizes.write() = Some(sizes);
    }

    /// Records each bucket's bytes (the members' latest reports) before a membership change,
    /// so that the map it makes balances them; without figures, or when recording fails, the
    /// map splits by count or by the figures recorded earlier.
    async fn record_sizes(&self) {
        let source = self.inner.bucket_sizes.read().clone();
        let Some(sizes) = source.and_then(|f| f()) else { return };
        if sizes.len() != BUCKET_COUNT || sizes == self.state().bucket_sizes {
            return;
        }
        if let Err(e) = self.write(ClusterCommand::RecordSizes { sizes }).await {
            tracing::warn!(error = %e, "could not record the buckets' sizes; the next map splits by count");
        }
    }

    /// Whether member `id` runs as this node sees it: itself, or a member not away in
    /// maintenance that failure detection does not hold silent.
    fn runs(&self, state: &ClusterState, id: NodeId) -> bool {
        id == self.node_id()
            || (state.away() != Some(id) && self.inner.liveness.read().as_ref().is_none_or(|answers| answers(id)))
    }

    /// Why a change through the voter sets `configs` could not finish now: one of them has no
    /// majority of members that run (Raft could then commit nothing until they come back,
    /// this change included). None when each has one.
    fn voter_refusal(&self, state: &ClusterState, configs: &[BTreeSet<NodeId>]) -> Option<String> {
        for voters in configs {
            let down: Vec<NodeId> = voters.iter().copied().filter(|&id| !self.runs(state, id)).collect();
            if (voters.len() - down.len()) * 2 > voters.len() {
                continue;
            }
            let why = down
                .iter()
                .map(|&id| match state.away() == Some(id) {
                    true => format!("node {id} is away in maintenance"),
                    false => format!("node {id} does not answer"),
                })
                .collect::<Vec<_>>()
                .join(", ");
            return Some(format!(
                "the Raft voters would be {voters:?}, and {} of them do not run ({why}): Raft could commit nothing \
                 until they are back; let them return (or end the maintenance) first",
                down.len()
            ));
        }
        None
    }

    /// Why failing `node_id` now would leave a voter configuration in force without a
    /// majority of members: a failed member stops and comes back as a new member, never as
    /// that voter, so such a configuration could commit nothing ever again (the voter change
    /// away from it included). Happens when a second voter of three is failed before the voter
    /// change that replaced the first one committed. The node stays a member; the voters move
    /// around the first failed one once it answers, and it can be failed after.
    fn failure_strands_voters(&self, state: &ClusterState, node_id: NodeId) -> Option<String> {
        let membership = self.raft_metrics().membership_config.membership().clone();
        membership.get_joint_config().iter().filter(|voters| voters.contains(&node_id)).find_map(|voters| {
            let staying = voters.iter().filter(|&&id| id != node_id && state.is_member(id)).count();
            (staying * 2 <= voters.len()).then(|| {
                format!(
                    "failing node {node_id} would leave the Raft voters {voters:?} with {staying} members: \
                     the voters must move away from the failed ones first"
                )
            })
        })
    }

    /// Refuses `command` when the voters it leads to have no majority that runs.
    fn refuse_stuck_voters(&self, state: &ClusterState, command: &ClusterCommand) -> Result<(), ControlError> {
        let Some(voters) = state.voters_after(command) else { return Ok(()) };
        match self.voter_refusal(state, &[voters]) {
            Some(reason) => Err(ControlError::Rejected { reason }),
            None => Ok(()),
        }
    }

    /// How many times this node saw the Raft leader change since it started (a new leader, or
    /// none known any more). Counted whenever the node looks at Raft's metrics (its pings,
    /// every request that needs the leader, each scrape), not by a task of its own: a task
    /// would change the schedule of the deterministic simulation. A leader that came and went
    /// between two looks is not counted.
    pub fn leader_changes(&self) -> u64 {
        self.observe_leader(self.inner.raft.metrics().borrow().current_leader);
        self.inner.leader_changes.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Counts a change of the leader this node sees.
    fn observe_leader(&self, leader: Option<NodeId>) {
        use std::sync::atomic::Ordering::Relaxed;
        let now = leader.unwrap_or(0);
        if self.inner.last_leader.swap(now, Relaxed) != now {
            self.inner.leader_changes.fetch_add(1, Relaxed);
        }
    }

    /// This node's id.
    pub fn node_id(&self) -> NodeId {
        self.inner.config.node_id
    }

    /// The Raft instance (for the RPC handlers).
    pub fn raft(&self) -> &Raft {
        &self.inner.raft
    }

    /// The applied control-plane state.
    pub fn state(&self) -> Arc<ClusterState> {
        self.inner.view.current()
    }

    /// The read handle on the applied state (to wait for changes).
    pub fn view(&self) -> &StateView {
        &self.inner.view
    }

    /// A copy of Raft's metrics (never hold the watch borrow: it blocks openraft).
    pub fn raft_metrics(&self) -> RaftMetrics {
        let m = self.inner.raft.metrics().borrow().clone();
        self.observe_leader(m.current_leader);
        m
    }

    /// The current leader as this node sees it.
    pub fn leader(&self) -> Option<NodeId> {
        let leader = self.inner.raft.metrics().borrow().current_leader;
        self.observe_leader(leader);
        leader
    }

    /// This node no longer stands for election on its own (it stops): a stopping leader that
    /// stepped down for its successor's election, then lost it (the successor's log was a
    /// moment behind), would otherwise win the next election itself, ahead of the successor's
    /// retry, and keep the lead until it exits. It still votes.
    pub fn stop_standing(&self) {
        self.inner.raft.runtime_config().elect(false);
    }

    /// A leader's entries (or heartbeat) were taken here.
    pub(crate) fn heard_leader(&self) {
        *self.inner.leader_heard.lock() = tokio::time::Instant::now();
    }

    /// Whether this node has heard no leader for longer than the longest election timeout and
    /// does not lead itself: a member that stands by its own timer would have stood by now.
    /// Its metrics may still name the old leader: a member that stopped standing never
    /// notices by itself that the leader is gone.
    pub fn leader_lost(&self) -> bool {
        let silent = self.inner.leader_heard.lock().elapsed();
        silent > self.inner.config.election_timeout * 4 / 3 && !self.is_leader()
    }

    /// Starts a Raft election on this node at once (a stopping leader's successor takes the
    /// lead); answers without waiting for its outcome.
    pub async fn elect(&self) -> Result<(), ControlError> {
        self.inner.raft.trigger().elect().await.map_err(|e| ControlError::Fatal { detail: e.to_string() })
    }

    /// Why this node may not be able to commit through Raft now, if so: no leader is known,
    /// or it leads but no majority of the voters acknowledged it within twice the election
    /// timeout (it is cut off, or the others are down).
    pub fn commit_refusal(&self) -> Option<String> {
        let m = self.inner.raft.metrics().borrow().clone();
        self.observe_leader(m.current_leader);
        let Some(leader) = m.current_leader else { return Some("no Raft leader is known".into()) };
        if leader != self.node_id() {
            return None;
        }
        let limit = (self.inner.config.election_timeout * 2).as_millis() as u64;
        match m.millis_since_quorum_ack {
            Some(ms) if ms <= limit => None,
            Some(ms) => Some(format!("this node leads but no majority of the voters answered for {ms} ms")),
            None => Some("this node leads but no majority of the voters answered yet".into()),
        }
    }

    /// Whether this node is the leader as far as its own metrics say.
    pub fn is_leader(&self) -> bool {
        let m = self.inner.raft.metrics().borrow().clone();
        self.observe_leader(m.current_leader);
        m.state == ServerState::Leader && m.current_leader == Some(self.node_id())
    }

    /// Whether Raft currently counts this node as a voter.
    pub fn is_voter(&self) -> bool {
        let metrics = self.inner.raft.metrics().borrow().clone();
        let is_voter = metrics.membership_config.membership().voter_ids().any(|id| id == self.node_id());
        is_voter
    }

    /// Waits until this node has applied everything the cluster committed before it asked; the
    /// buckets it owns are then the ones the cluster says. It takes two bounds and waits for the
    /// higher:
    /// - the leader's read index: the leader confirms with a majority that it still leads and
    ///   answers at least the index of its term's first entry, which covers everything committed
    ///   before its term. This covers a leader this node knew from its stored vote that was
    ///   replaced while the node was down. Asked for up to `READ_INDEX_FOR`; a leader that cannot
    ///   read the request (an earlier version) refuses it at once.
    /// - the commit index this node knows once a leader it can commit through is known (one that
    ///   restarted as leader from its stored vote counts only once a majority answered it) and a
    ///   few of its heartbeats went by. This covers a leader that restarted within its own term:
    ///   its read index comes from the commit index on its disk, which may be behind entries of
    ///   that term committed before the restart.
    ///
    /// Until then every bucket answers `bucket_restoring` (a node that cannot reach a leader could
    /// not acknowledge writes anyway), rather than one flipped here before the restart being
    /// served empty.
    pub async fn catch_up(&self) {
        let started = tokio::time::Instant::now();
        let mut said = tokio::time::Instant::now();
        let mut waiting = |what: &str| {
            if said.elapsed() >= Duration::from_secs(10) {
                tracing::info!(node_id = self.node_id(), waited = ?started.elapsed(), "catching up waits for {what}");
                said = tokio::time::Instant::now();
            }
        };
        let mut read_index = 0;
        while started.elapsed() < READ_INDEX_FOR {
            match tokio::time::timeout(READ_INDEX_WAIT, self.read_index()).await {
                Ok(Ok(index)) => {
                    read_index = index;
                    break;
                }
                Ok(Err(e @ ControlError::Rejected { .. })) => {
                    tracing::debug!(error = %e, "the leader does not know read index requests");
                    break;
                }
                Ok(Err(e)) => tracing::debug!(error = %e, "asking the leader for its read index"),
                Err(_) => tracing::debug!("asking the leader for its read index: no answer in time"),
            }
            waiting("the leader's read index");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        while self.commit_refusal().is_some() {
            waiting("a Raft leader");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        // The leader's next heartbeats carry its commit index.
        tokio::time::sleep(Duration::from_millis(600)).await;
        let target = read_index.max(self.commit_index());
        while self.raft_metrics().last_applied.map_or(0, |l| l.index) < target {
            waiting("the Raft log to be applied");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// The leader's read index (see [`AdminRequest::ReadIndex`]), asked through the leader.
    pub async fn read_index(&self) -> Result<u64, ControlError> {
        match self.admin(AdminRequest::ReadIndex).await? {
            AdminResponse::ReadIndex { index } => Ok(index),
            other => Err(ControlError::Fatal { detail: format!("unexpected answer to a read index: {other:?}") }),
        }
    }

    /// The last committed Raft log index this node knows of.
    pub fn commit_index(&self) -> u64 {
        self.inner.log_store.committed_index()
    }

    /// The size of the Raft storage on disk, in bytes.
    pub fn storage_bytes(&self) -> u64 {
        self.inner.disk.size_on_disk()
    }

    /// What the applied state says of `node_id`.
    pub fn member_status(&self, node_id: NodeId) -> MemberStatus {
        let state = self.state();
        if state.is_member(node_id) {
            MemberStatus::Member
        } else if state.failed.contains(&node_id) {
            MemberStatus::Failed
        } else if state.retired.contains(&node_id) {
            MemberStatus::Retired
        } else if state.registered.contains_key(&node_id) {
            MemberStatus::Registered
        } else {
            MemberStatus::Unknown
        }
    }

    /// The admin client this node uses to reach other members.
    pub fn admin_client(&self) -> &AdminClient {
        &self.inner.admin_client
    }

    /// Makes this pristine node a one-node cluster with id `cluster_id` and `voters` voters.
    /// Idempotent: on a node that is already initialized it only finishes what is missing.
    pub async fn bootstrap(
        &self,
        cluster_id: &str,
        voters: u8,
        replication: crate::ReplicationMode,
    ) -> Result<(), ControlError> {
        let nodes = BTreeMap::from([(self.node_id(), self.inner.node.clone())]);
        match self.inner.raft.initialize(nodes).await {
            Ok(()) | Err(OpenRaftError::APIError(InitializeError::NotAllowed(_))) => {}
            Err(e) => return Err(fatal(e)),
        }
        self.wait_for_leader(self.inner.config.change_timeout).await?;
        if self.state().cluster_id.is_some() {
            return Ok(());
        }
        let command = ClusterCommand::Bootstrap {
            cluster_id: cluster_id.to_string(),
            node_id: self.node_id(),
            api_addr: self.inner.node.api_addr.clone(),
            peer_addr: self.inner.node.peer_addr.clone(),
            name: self.inner.config.name.clone(),
            voters,
            replication,
        };
        match self.write(command).await {
            Ok(_) => Ok(()),
            // A second bootstrap attempt after a crash: the first one was applied.
            Err(ControlError::Rejected { .. }) if self.state().cluster_id.is_some() => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// Waits until some leader is known, for at most `timeout`.
    pub async fn wait_for_leader(&self, timeout: Duration) -> Result<NodeId, ControlError> {
        let mut rx = self.inner.raft.metrics();
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            if let Some(leader) = rx.borrow_and_update().current_leader {
                return Ok(leader);
            }
            match tokio::time::timeout_at(deadline, rx.changed()).await {
                Ok(Ok(())) => {}
                // Raft stopped: its metrics will not change again (waiting on a closed channel
                // would answer at once, and the loop would spin).
                Ok(Err(_)) => return Err(ControlError::NoLeader { detail: "Raft has stopped".into() }),
                Err(_) => {
                    return Err(ControlError::NoLeader { detail: format!("no leader elected within {timeout:?}") })
                }
            }
        }
    }

    /// Waits until the applied state satisfies `done`, for at most `timeout`; returns whether
    /// it did.
    pub async fn wait_for_state(&self, timeout: Duration, done: impl Fn(&ClusterState) -> bool) -> bool {
        let mut rx = self.inner.view.subscribe();
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            rx.borrow_and_update();
            if done(&self.state()) {
                return true;
            }
            if tokio::time::timeout_at(deadline, rx.changed()).await.is_err() {
                return done(&self.state());
            }
        }
    }

    /// Runs an admin request at the leader: here if this node leads, otherwise forwarded to
    /// the leader, retrying while leadership moves, for at most the change timeout.
    pub async fn admin(&self, request: AdminRequest) -> Result<AdminResponse, ControlError> {
        let deadline = tokio::time::Instant::now() + self.inner.config.change_timeout;
        let mut last_error;
        loop {
            let result = match self.leader() {
                Some(leader) if leader == self.node_id() => self.admin_as_leader(request.clone()).await,
                Some(leader) => match self.peer_addr_of(leader) {
                    Some(addr) => self.inner.admin_client.call_leader(&addr, &request).await,
                    None => Err(ControlError::NoLeader { detail: format!("leader {leader} has no known address") }),
                },
                None => Err(ControlError::NoLeader { detail: "no leader known".into() }),
            };
            match result {
                Err(e) if e.is_retryable() && !matches!(e, ControlError::Timeout { .. }) => last_error = e,
                other => return other,
            }
            if tokio::time::Instant::now() >= deadline {
                return Err(last_error);
            }
            // Until Raft's metrics change (a leader is known, or another one), at most 200 ms
            // and at least 20 ms. A receiver cloned from openraft's has not seen the current
            // value: mark it seen, or `changed` would answer at once and the loop would spin.
            let mut rx = self.inner.raft.metrics();
            rx.borrow_and_update();
            let _ = tokio::time::timeout(Duration::from_millis(200), rx.changed()).await;
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Runs an admin request on this node, which must be the leader (otherwise `NotLeader`).
    pub async fn admin_as_leader(&self, request: AdminRequest) -> Result<AdminResponse, ControlError> {
        match request {
            AdminRequest::Register { api_addr, peer_addr, name } => self.register(api_addr, peer_addr, name).await,
            AdminRequest::Admit { node_id, force } => self.admit(node_id, force).await,
            AdminRequest::Leave { node_id, force } => self.remove(node_id, force).await,
            AdminRequest::Ack { node_id, to_version } => {
                self.write(ClusterCommand::AckTransition { node_id, to_version }).await?;
                self.end_transition_if_acked().await;
                Ok(AdminResponse::Done)
            }
            AdminRequest::Moved { bucket, from, to, epoch } => {
                self.moved(ClusterCommand::BucketMoved { bucket, from, to, epoch }).await
            }
            AdminRequest::Abort { bucket, epoch } => self.done(ClusterCommand::AbortMove { bucket, epoch }).await,
            AdminRequest::ClearTransferFlag { reason } => self.done(ClusterCommand::ClearTransferFlag { reason }).await,
            AdminRequest::SetReplication { mode } => self.done(ClusterCommand::SetReplication { mode }).await,
            AdminRequest::SetAutoBalance { enabled } => self.done(ClusterCommand::SetAutoBalance { enabled }).await,
            AdminRequest::Rebalance { from_version, owners } => {
                // One membership change at a time: a join, leave or failure does not interleave.
                let _guard = self.lock_membership().await?;
                let moved = self.moved(ClusterCommand::Rebalance { from_version, owners }).await;
                if let Ok(AdminResponse::Moved { map_version }) = &moved {
                    tracing::info!(from_version, map_version, "balancing by data: a transition starts");
                }
                moved
            }
            AdminRequest::HandOver { node_id, heir } => self.moved(ClusterCommand::HandOver { node_id, heir }).await,
            AdminRequest::Promoted { node_id, buckets, lost } => {
                self.done(ClusterCommand::Promoted { node_id, buckets, lost }).await
            }
            AdminRequest::ReadIndex => self.confirm_read_index().await,
            AdminRequest::LostOf { node_id } => self.lost_of(node_id),
            AdminRequest::Found { owner, from, buckets, heir } => {
                self.done(ClusterCommand::Found { owner, from, buckets, heir }).await
            }
            AdminRequest::ClearLost { buckets } => match self.write(ClusterCommand::ClearLost { buckets }).await? {
                CommandResponse::Cleared { buckets } => Ok(AdminResponse::Cleared { buckets }),
                other => Err(unexpected(other)),
            },
            AdminRequest::ReplicaMoved { owner, holder } => {
                self.done(ClusterCommand::ReplicaMoved { owner, holder }).await
            }
            AdminRequest::SetDraining { node_id, draining } => {
                self.done(ClusterCommand::SetDraining { node_id, draining }).await
            }
            AdminRequest::EnterMaintenance { node_id, since_ms, until_ms } => {
                // One membership change at a time: a join, leave or failure does not interleave.
                let _guard = self.lock_membership().await?;
                self.write(ClusterCommand::EnterMaintenance { node_id, since_ms, until_ms }).await?;
                tracing::info!(node_id, until_ms, "node prepares for maintenance: the replica it holds moves on");
                Ok(AdminResponse::Done)
            }
            AdminRequest::MaintenanceReady { node_id, heir } => {
                let _guard = self.lock_membership().await?;
                let moved = self.moved(ClusterCommand::MaintenanceReady { node_id, heir }).await;
                if moved.is_ok() {
                    tracing::warn!(
                        node_id,
                        heir = heir.0,
                        "node in maintenance: its replica holder serves its buckets"
                    );
                }
                moved
            }
            AdminRequest::EndMaintenance { node_id, reason } => {
                let _guard = self.lock_membership().await?;
                self.write(ClusterCommand::EndMaintenance { node_id, reason: reason.clone() }).await?;
                tracing::warn!(node_id, reason, "maintenance ended before the node came back");
                Ok(AdminResponse::Done)
            }
        }
    }

    /// Commits `command`, which answers nothing.
    async fn done(&self, command: ClusterCommand) -> Result<AdminResponse, ControlError> {
        self.write(command).await?;
        Ok(AdminResponse::Done)
    }

    /// Commits `command`, which changes the map: its new version.
    async fn moved(&self, command: ClusterCommand) -> Result<AdminResponse, ControlError> {
        match self.write(command).await? {
            CommandResponse::MapChanged { map_version } => Ok(AdminResponse::Moved { map_version }),
            other => Err(unexpected(other)),
        }
    }

    /// Registers a joiner: its id and the cluster's.
    async fn register(
        &self,
        api_addr: String,
        peer_addr: String,
        name: Option<String>,
    ) -> Result<AdminResponse, ControlError> {
        // Checked here, before the proposal, not in the state machine: nodes of an older
        // version apply `Register` without looking at names.
        if let Some(m) = self.state().members.iter().find(|m| name.is_some() && m.name == name) {
            let reason = format!("name {:?} already used by member {}", name.as_deref().unwrap_or(""), m.id);
            return Err(ControlError::Rejected { reason });
        }
        match self.write(ClusterCommand::Register { api_addr, peer_addr, name }).await? {
            CommandResponse::Registered { node_id } => Ok(AdminResponse::Registered {
                node_id,
                cluster_id: self.state().cluster_id.clone().unwrap_or_default(),
            }),
            other => Err(unexpected(other)),
        }
    }

    /// The log index a read must wait for, once a majority confirmed this node leads.
    async fn confirm_read_index(&self) -> Result<AdminResponse, ControlError> {
        let confirm = self.inner.raft.get_read_log_id();
        let (read, _) = tokio::time::timeout(self.inner.config.change_timeout, confirm)
            .await
            .map_err(|_| ControlError::Timeout { what: "a majority to confirm the leader".into() })?
            .map_err(read_index_error)?;
        Ok(AdminResponse::ReadIndex { index: read.map_or(0, |l| l.index) })
    }

    /// What a failed node left behind: the buckets it served last that are lost, and how many
    /// promoted ones still wait to be installed.
    fn lost_of(&self, node_id: NodeId) -> Result<AdminResponse, ControlError> {
        let state = self.state();
        // A leader cut off with the asker may still think it leads: only a state that knows
        // the asker failed can say what it left behind.
        if !state.failed.contains(&node_id) {
            return Err(ControlError::Rejected {
                reason: format!("node {} does not know that node {node_id} failed", self.node_id()),
            });
        }
        let buckets: Vec<LostBucket> = state
            .lost_of(node_id)
            .into_iter()
            .filter_map(|(b, owner)| {
                let peer_addr = state.member_of(owner)?.peer_addr.clone();
                Some(LostBucket { bucket: b.0, owner, peer_addr })
            })
            .collect();
        let pending = state.promoted.keys().filter(|b| state.last_server.get(b) == Some(&node_id)).count();
        Ok(AdminResponse::LostOf { buckets, pending })
    }

    /// On the leader: declares `node_id` failed (a majority reported it unreachable), then
    /// brings Raft's voters in line.
    pub async fn fail_node(&self, node_id: NodeId) -> Result<u64, ControlError> {
        let _guard = self.lock_membership().await?;
        if !self.state().is_member(node_id) {
            return Ok(self.state().map.version);
        }
        // Not behind a voter change that has not committed: it could commit only with the
        // members that change waits for, perhaps the failed one back, which it would then
        // fail for a silence long over. The next round of reports decides again.
        let membership_at = self.raft_metrics().membership_config.log_id().map_or(0, |l| l.index);
        if membership_at > self.commit_index() {
            return Err(ControlError::ChangeInProgress);
        }
        if let Some(reason) = self.failure_strands_voters(&self.state(), node_id) {
            return Err(ControlError::Rejected { reason });
        }
        self.record_sizes().await;
        let map_version = match self.write(ClusterCommand::NodeFailed { node_id }).await? {
            CommandResponse::MapChanged { map_version } => map_version,
            other => return Err(unexpected(other)),
        };
        tracing::warn!(node_id, map_version, "node failed: its replica serves its buckets");
        if let Err(e) = self.reconcile_locked().await {
            tracing::warn!(error = %e, "voter reconcile after a failure failed; the reconciler will retry");
        }
        Ok(map_version)
    }

    fn peer_addr_of(&self, id: NodeId) -> Option<String> {
        let metrics = self.inner.raft.metrics().borrow().clone();
        let addr = metrics.membership_config.membership().get_node(&id).map(|n| n.peer_addr.clone());
        addr
    }

    async fn lock_membership(&self) -> Result<tokio::sync::MutexGuard<'_, ()>, ControlError> {
        tokio::time::timeout(self.inner.config.change_timeout, self.inner.membership_lock.lock())
            .await
            .map_err(|_| ControlError::ChangeInProgress)
    }

    async fn admit(&self, node_id: NodeId, force: bool) -> Result<AdminResponse, ControlError> {
        let _guard = self.lock_membership().await?;
        let state = self.state();
        if state.is_member(node_id) {
            return Ok(AdminResponse::Admitted { map_version: state.map.version });
        }
        if let Some(reason) = state.membership_busy().filter(|_| !force) {
            return Err(ControlError::MembershipChangeInProgress { reason });
        }
        self.refuse_stuck_voters(&state, &ClusterCommand::Admit { node_id, force })?;
        self.record_sizes().await;
        let Some(registration) = state.registered.get(&node_id) else {
            return Err(ControlError::Rejected {
                reason: format!("node {node_id} is not registered (retired ids cannot rejoin)"),
            });
        };
        let node = MemberNode { api_addr: registration.api_addr.clone(), peer_addr: registration.peer_addr.clone() };
        self.bounded("adding the node to Raft", self.inner.raft.add_learner(node_id, node, false)).await?;
        self.wait_caught_up(node_id).await?;
        let map_version = match self.write(ClusterCommand::Admit { node_id, force }).await? {
            CommandResponse::MapChanged { map_version } => map_version,
            other => return Err(unexpected(other)),
        };
        tracing::info!(node_id, map_version, "node joined");
        if let Err(e) = self.reconcile_locked().await {
            tracing::warn!(error = %e, "voter reconcile after join failed; the reconciler will retry");
        }
        Ok(AdminResponse::Admitted { map_version })
    }

    async fn remove(&self, node_id: NodeId, force: bool) -> Result<AdminResponse, ControlError> {
        let _guard = self.lock_membership().await?;
        let state = self.state();
        if !state.is_member(node_id) && state.retired.contains(&node_id) {
            return Ok(AdminResponse::Left { map_version: state.map.version });
        }
        self.refuse_stuck_voters(&state, &ClusterCommand::Remove { node_id, force })?;
        self.record_sizes().await;
        let map_version = match self.write(ClusterCommand::Remove { node_id, force }).await? {
            CommandResponse::MapChanged { map_version } => map_version,
            other => return Err(unexpected(other)),
        };
        tracing::info!(node_id, map_version, "node left");
        // Demote it (and promote the oldest learner); the Raft node itself is dropped by the
        // reconciler once the leaver has seen its removal.
        if let Err(e) = self.reconcile_locked().await {
            tracing::warn!(error = %e, "voter reconcile after leave failed; the reconciler will retry");
        }
        Ok(AdminResponse::Left { map_version })
    }

    /// Waits until learner `node_id` has replicated everything the leader had when asked.
    async fn wait_caught_up(&self, node_id: NodeId) -> Result<(), ControlError> {
        let target = self.raft_metrics().last_log_index.unwrap_or(0);
        self.inner
            .raft
            .wait(Some(self.inner.config.change_timeout))
            .metrics(
                |m| {
                    m.replication
                        .as_ref()
                        .and_then(|r| r.get(&node_id).copied().flatten())
                        .is_some_and(|matched| matched.index >= target)
                },
                "learner caught up",
            )
            .await
            .map(|_| ())
            .map_err(|_| ControlError::Timeout { what: format!("node {node_id} to catch up with the Raft log") })
    }

    /// Waits for a Raft write, at most `change_timeout`: a leader cut off from its majority
    /// never commits, and openraft does not give up by itself. After the timeout the outcome
    /// is unknown (the entry may still commit).
    async fn bounded<T>(
        &self,
        what: &str,
        write: impl std::future::Future<Output = Result<T, OpenRaftError<NodeId, ClientWriteError<NodeId, MemberNode>>>>,
    ) -> Result<T, ControlError> {
        match tokio::time::timeout(self.inner.config.change_timeout, write).await {
            Ok(result) => result.map_err(write_error),
            Err(_) => Err(ControlError::Timeout { what: what.into() }),
        }
    }

    /// Commits `command` (this node must be the leader) and returns its response; a
    /// `Rejected` response becomes an error.
    pub async fn write(&self, command: ClusterCommand) -> Result<CommandResponse, ControlError> {
        if self.inner.closing.load(std::sync::atomic::Ordering::Acquire) {
            return Err(ControlError::NoLeader { detail: "the leader is stopping".into() });
        }
        let response =
            self.bounded("the Raft log to commit", self.inner.raft.client_write(Proposal::now(command))).await?;
        match response.data {
            CommandResponse::Rejected { reason } => Err(ControlError::Rejected { reason }),
            CommandResponse::Busy { reason } => Err(ControlError::MembershipChangeInProgress { reason }),
            other => Ok(other),
        }
    }

    /// On the leader: ends the pending transition once every member acknowledged it.
    async fn end_transition_if_acked(&self) {
        let state = self.state();
        let Some(t) = state.transition.as_ref().filter(|_| state.transition_acked()) else { return };
        let to_version = t.to.version;
        match self.write(ClusterCommand::EndTransition { to_version }).await {
            Ok(_) => tracing::info!(to_version, "transition ended; state transfer starts"),
            Err(e) => tracing::debug!(error = %e, "ending the transition"),
        }
    }

    /// Brings Raft's membership in line with the members (the lock must be held):
    /// 1. every member is a Raft node;
    /// 2. the voters are the first `voters` members in join order;
    /// 3. Raft nodes that are not members (nor registered joiners) are dropped once they have
    ///    caught up or after a grace period (a retired node learns of its removal first).
    async fn reconcile_locked(&self) -> Result<(), ControlError> {
        let state = self.state();
        if state.cluster_id.is_none() || !self.is_leader() {
            return Ok(());
        }
        let metrics = self.raft_metrics();
        let membership = metrics.membership_config.membership().clone();
        let desired = state.desired_voters();
        for member in &state.members {
            if membership.get_node(&member.id).is_none() {
                let node = MemberNode { api_addr: member.api_addr.clone(), peer_addr: member.peer_addr.clone() };
                self.bounded("adding a member to Raft", self.inner.raft.add_learner(member.id, node, false)).await?;
            }
        }
        let voters: BTreeSet<NodeId> = membership.voter_ids().collect();
        // The configurations the change goes through: openraft joins the newest one in force
        // with the desired one, and each must commit. One without a majority that runs would
        // hold up every later entry until its members return, so the change waits for them
        // (or for their failure, which commits under the voters in force).
        let joint = membership.get_joint_config();
        let newest = joint.last().cloned().unwrap_or_default();
        let through = if newest == desired { vec![desired.clone()] } else { vec![newest, desired.clone()] };
        let waits = (desired != voters).then(|| self.voter_refusal(&state, &through)).flatten();
        if let Some(reason) = &waits {
            tracing::debug!(reason, "the voter change waits");
        }
        if !desired.is_empty() && desired != voters && waits.is_none() {
            tracing::info!(?voters, ?desired, "changing Raft voters");
            self.bounded(
                "changing the Raft voters",
                self.inner.raft.change_membership(ChangeMembers::ReplaceAllVoters(desired.clone()), true),
            )
            .await?;
        }
        let applied = metrics.last_applied.map(|l| l.index).unwrap_or(0);
        let stale: BTreeSet<NodeId> = {
            let mut since = self.inner.stale_since.lock();
            let now = tokio::time::Instant::now();
            let non_members: Vec<NodeId> = membership
                .nodes()
                .map(|(id, _)| *id)
                // A registered node is a learner on its way in, not a leftover.
                .filter(|id| !state.is_member(*id) && !desired.contains(id) && !state.registered.contains_key(id))
                .collect();
            since.retain(|id, _| non_members.contains(id));
            non_members
                .into_iter()
                .filter(|id| {
                    let first_seen = *since.entry(*id).or_insert(now);
                    let caught_up = metrics
                        .replication
                        .as_ref()
                        .and_then(|r| r.get(id).copied().flatten())
                        .is_some_and(|m| m.index >= applied);
                    // Caught up is not enough at once: the node has the entries but learns that
                    // they are committed (and applies its own removal) only with the next
                    // heartbeats; dropped before, it would never see that it left.
                    let waited = now.duration_since(first_seen);
                    (caught_up && waited >= COMMIT_NEWS_GRACE) || waited >= STALE_NODE_GRACE
                })
                .collect()
        };
        if !stale.is_empty() {
            tracing::info!(?stale, "dropping non-members from the Raft config");
            self.bounded(
                "dropping non-members from Raft",
                self.inner.raft.change_membership(ChangeMembers::RemoveNodes(stale), false),
            )
            .await?;
        }
        Ok(())
    }

    /// Before a leader that left the cluster stops: it takes no more proposals (they fail
    /// with `NoLeader`, and their senders try again with the next leader), waits until every
    /// member has its last entry, then two heartbeats more, so that they learn that it is
    /// committed. A member that has not learnt it when the leader stops applies it only after
    /// an election (seconds), and a write replicated to it at that map version waits as long.
    /// Returns at once on a node that does not lead, and after `within` at the latest.
    pub async fn close_as_leader(&self, within: Duration) {
        let me = self.node_id();
        if !self.is_leader() {
            return;
        }
        self.inner.closing.store(true, std::sync::atomic::Ordering::Release);
        let deadline = tokio::time::Instant::now() + within;
        let mut rx = self.inner.raft.metrics();
        loop {
            let m = rx.borrow_and_update().clone();
            if m.current_leader != Some(me) {
                return;
            }
            let last = m.last_log_index;
            let committed = m.last_applied.map(|l| l.index) >= last;
            let has_all = |id: &NodeId| {
                m.replication.as_ref().and_then(|r| r.get(id)).and_then(|l| l.as_ref()).map(|l| l.index) >= last
            };
            if committed && self.state().members.iter().filter(|n| n.id != me).all(|n| has_all(&n.id)) {
                tokio::time::sleep(self.inner.config.heartbeat * 2).await;
                return;
            }
            match tokio::time::timeout_at(deadline, rx.changed()).await {
                Ok(Ok(())) => {}
                // Raft stopped: nothing more is replicated (and a closed channel answers at
                // once: the loop spun, and the node never stopped; simulation seed 60262).
                Ok(Err(_)) => return,
                Err(_) => {
                    tracing::debug!(node_id = me, "stopping before every member had the last entry");
                    return;
                }
            }
        }
    }

    /// Stops Raft and the reconciler. The sled database closes when the last handle drops.
    pub async fn shutdown(&self) {
        let reconciler = self.inner.reconciler.lock().take();
        if let Some(task) = reconciler {
            task.abort();
            let _ = task.await;
        }
        if let Err(e) = self.inner.raft.shutdown().await {
            tracing::warn!(error = %e, "raft shutdown");
        }
        let _ = self.inner.disk.flush().await;
    }
}

/// On the leader, after every applied change and at least every second: end a transition
/// every member acknowledged, and finish whatever a membership change left undone.
async fn reconcile_loop(inner: std::sync::Weak<Inner>) {
    let mut applied = match inner.upgrade() {
        Some(inner) => inner.view.subscribe(),
        None => return,
    };
    loop {
        let _ = tokio::time::timeout(Duration::from_secs(1), applied.changed()).await;
        let Some(inner) = inner.upgrade() else { return };
        let control = ControlPlane { inner };
        if !control.is_leader() {
            continue;
        }
        control.end_transition_if_acked().await;
        let Ok(_guard) = control.inner.membership_lock.try_lock() else {
            continue;
        };
        if let Err(e) = control.reconcile_locked().await {
            tracing::debug!(error = %e, "reconcile");
        }
    }
}

/// Opens sled with a small page cache; retries briefly while a previous instance of this
/// node in the same process still holds the directory lock.
async fn open_db(dir: &std::path::Path) -> Result<sled::Db, ControlError> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let result = sled::Config::new().path(dir).cache_capacity(16 * 1024 * 1024).flush_every_ms(Some(1000)).open();
        match result {
            Ok(db) => return Ok(db),
            // A previous instance of this node in the same process may still be closing.
            Err(e) if e.to_string().contains("could not acquire lock") && Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => {
                return Err(ControlError::Fatal {
                    detail: format!("cannot open the Raft storage in {}: {e}", dir.display()),
                })
            }
        }
    }
}

fn fatal(e: impl std::fmt::Display) -> ControlError {
    ControlError::Fatal { detail: e.to_string() }
}

fn unexpected(response: CommandResponse) -> ControlError {
    ControlError::Fatal { detail: format!("unexpected command response {response:?}") }
}

fn read_index_error(e: OpenRaftError<NodeId, CheckIsLeaderError<NodeId, MemberNode>>) -> ControlError {
    match e {
        OpenRaftError::APIError(CheckIsLeaderError::ForwardToLeader(f)) => {
            ControlError::NotLeader { leader: f.leader_id, leader_peer_addr: f.leader_node.map(|n| n.peer_addr) }
        }
        OpenRaftError::APIError(CheckIsLeaderError::QuorumNotEnough(e)) => {
            ControlError::NoLeader { detail: format!("this node may no longer lead: {e}") }
        }
        OpenRaftError::Fatal(e) => ControlError::Fatal { detail: e.to_string() },
    }
}

fn write_error(e: OpenRaftError<NodeId, ClientWriteError<NodeId, MemberNode>>) -> ControlError {
    match e {
        OpenRaftError::APIError(ClientWriteError::ForwardToLeader(f)) => {
            ControlError::NotLeader { leader: f.leader_id, leader_peer_addr: f.leader_node.map(|n| n.peer_addr) }
        }
        OpenRaftError::APIError(ClientWriteError::ChangeMembershipError(e)) => {
            tracing::debug!(error = %e, "membership change refused");
            ControlError::ChangeInProgress
        }
        OpenRaftError::Fatal(e) => ControlError::Fatal { detail: e.to_string() },
    }
}
