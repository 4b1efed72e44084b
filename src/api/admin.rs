//! Cluster views, leave, readiness and the state gauges.

use std::sync::atomic::Ordering;
use std::time::Duration;

use futures::future::join_all;
use shoal_http_api::types::{
    BucketsQuery, BucketsView, Check, ClearLost, ClusterConfig, ClusterView, EventsView, LeaveOk, LostCleared,
    MaintenanceView, MapNode, MapView, MemberView, NodeFailure, NodeStats, RebalancePlan, RebalanceRequest,
    ReplicationView, TransferSummary, TransferView, TransitionView,
};
use shoal_http_api::{ApiError, Unavailable};
use shoal_raft::state::MaintenanceRefusal;
use shoal_raft::{AdminRequest, AdminResponse, ClusterState, ControlError, NodeId, ReplicationMode, StateView};

use super::NodeApi;
use crate::balance::plan::Refusal;
use crate::balance::{AskBuckets, BalanceError, BucketReport, Rebalance};
use crate::maintenance::EnterError;
use crate::transport::wire::{self, Handlers, Json};
use crate::transport::{CallError, Endpoint, PEER_CALL_TIMEOUT};

/// Asks a member for its own figures.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct AskNodeStats;

impl Endpoint for AskNodeStats {
    type Answer = Json<NodeStats>;
    const ID: u8 = wire::id::NODE_STATS;
}

/// The receiver goes into maintenance for this long (to its peer address: only it can check
/// that its replica is complete).
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct EnterMaintenance {
    /// How long it may stay away.
    pub period: Duration,
}

impl Endpoint for EnterMaintenance {
    type Answer = Json<MaintenanceView>;
    const ID: u8 = wire::id::ENTER_MAINTENANCE;
}

/// Registers the answers to other members' admin calls: figures, maintenance, and the
/// leader's side of bucket reports, views and balancing.
pub fn register(handlers: &mut Handlers, api: &std::sync::Arc<NodeApi>) {
    let failed = CallError::Api;
    handlers.add_with(api, |a, _: AskNodeStats| async move { Ok(Json(a.own_stats())) });
    handlers.add_with(api, move |a, EnterMaintenance { period }| async move {
        let wait = crate::maintenance::PREPARE_WAIT + crate::maintenance::SYNC_WAIT;
        a.maintenance_here(period, wait).await.map(Json).map_err(failed)
    });
    handlers.add_with(api, |a, report: BucketReport| async move {
        a.balancer.receive(report);
        Ok(())
    });
    handlers.add_with(api, move |a, AskBuckets(query)| async move { a.buckets_here(query).map(Json).map_err(failed) });
    handlers.add_with(api, move |a, Rebalance(request)| async move {
        a.rebalance_here(request).await.map(Json).map_err(failed)
    });
}

impl NodeApi {
    /// Every member's transfer status (this node's own from memory).
    pub(super) async fn transfer_view(&self) -> TransferView {
        let state = self.control.state();
        let calls = state.members.iter().map(|m| async move {
            if m.id == self.node_id {
                Ok(self.progress.status(self.node_id))
            } else {
                self.peers
                    .ask(&m.peer_addr, crate::transfer::progress::AskProgress, PEER_CALL_TIMEOUT)
                    .await
                    .map(|s| s.0)
                    .map_err(|e| NodeFailure { node: m.id, detail: e.to_string() })
            }
        });
        let (mut nodes, mut errors) = (Vec::new(), Vec::new());
        for answer in join_all(calls).await {
            match answer {
                Ok(s) => nodes.push(s),
                Err(f) => errors.push(f),
            }
        }
        TransferView {
            target_version: state.target.as_ref().map(|t| t.version),
            buckets_left: state.target.as_ref().map_or(0, |t| state.map.moved_buckets(t).len()),
            blocking: state.transfer_flag,
            nodes,
            errors,
        }
    }

    pub(super) async fn cluster_view(&self) -> Result<ClusterView, ApiError> {
        let state = self.control.state();
        let Some(cluster_id) = state.cluster_id.clone() else {
            return Err(ApiError::unavailable(Unavailable::NotReady, "this node has not joined a cluster yet"));
        };
        let raft = self.control.raft_metrics();
        let voters: Vec<NodeId> = raft.membership_config.membership().voter_ids().collect();
        let counts = state.map.counts();
        let stats = join_all(state.members.iter().map(|m| async move {
            if m.id == self.node_id {
                Some(self.own_stats())
            } else {
                self.peers.ask(&m.peer_addr, AskNodeStats, PEER_CALL_TIMEOUT).await.ok().map(|s| s.0)
            }
        }))
        .await;
        let members = state
            .members
            .iter()
            .zip(stats)
            .map(|(m, stats)| MemberView {
                id: m.id,
                name: m.name.clone(),
                api_addr: m.api_addr.clone(),
                peer_addr: m.peer_addr.clone(),
                join_seq: m.join_seq,
                role: if voters.contains(&m.id) { "voter" } else { "learner" }.to_string(),
                buckets: counts.get(&m.id).copied().unwrap_or(0),
                replica_on: state.replica_of(m.id),
                leaving: m.leaving,
                items: stats.as_ref().map(|s| s.items),
                bytes: stats.as_ref().map(|s| s.bytes),
                version: stats.as_ref().and_then(|s| s.version.clone()),
                revision: stats.as_ref().and_then(|s| s.revision.clone()),
            })
            .collect();
        Ok(ClusterView {
            cluster_id,
            node_id: self.node_id,
            leader: raft.current_leader,
            map_version: state.map.version,
            voters: state.settings.voters,
            members,
            transition: state.transition.as_ref().map(|t| TransitionView {
                from_version: t.from_version,
                to_version: t.to.version,
                acked: t.acked.iter().copied().collect(),
            }),
            transfer: state.target.as_ref().map(|t| TransferSummary {
                target_version: t.version,
                buckets_left: state.map.moved_buckets(t).len(),
                blocking: state.transfer_flag,
            }),
            peers: self.health.peers(),
            replication: Some(self.replication_view(&state)),
            failed: state.failed.iter().copied().collect(),
            lost_buckets: state.lost.iter().copied().collect(),
            maintenance: crate::maintenance::view(&state, crate::maintenance::now_ms()),
        })
    }

    /// Puts member `node_id` into maintenance: here if it is this node, else the member is
    /// asked (only it can check its replica).
    pub(super) async fn make_maintenance(
        &self,
        node_id: NodeId,
        period: Duration,
    ) -> Result<MaintenanceView, ApiError> {
        let state = self.control.state();
        let Some(member) = state.member_of(node_id) else {
            return Err(ApiError::UnknownResource(format!("node {node_id} is not a member")));
        };
        if node_id != self.node_id {
            let asked =
                self.peers.ask(&member.peer_addr, EnterMaintenance { period }, crate::maintenance::ENTER_TIMEOUT).await;
            return match asked {
                Ok(view) => Ok(view.0),
                Err(CallError::Api(e)) => Err(e),
                Err(e) => Err(ApiError::unavailable(
                    Unavailable::Unavailable,
                    format!(
                        "the member at {} did not answer ({e}): a member goes into maintenance itself, so it must run",
                        member.peer_addr
                    ),
                )),
            };
        }
        self.maintenance_here(period, crate::maintenance::PREPARE_WAIT + crate::maintenance::SYNC_WAIT).await
    }

    /// Puts this node into maintenance for `period`, within `wait` (see
    /// [`crate::maintenance::Entry::enter`]).
    pub async fn maintenance_here(&self, period: Duration, wait: Duration) -> Result<MaintenanceView, ApiError> {
        let suspected = self.health.pfail_members();
        let deadline = tokio::time::Instant::now() + wait;
        let entered = self.entry.enter(self.node_id, &self.control, period, deadline, &suspected).await;
        entered.map_err(|e| match e {
            EnterError::Refused(MaintenanceRefusal::NotMember(id)) => {
                ApiError::UnknownResource(format!("node {id} is not a member that stays"))
            }
            EnterError::Refused(refusal) => ApiError::MaintenanceRefused(refusal),
            EnterError::Control(e) => control_error(e),
        })?;
        let state = self.control.state();
        crate::maintenance::view(&state, crate::maintenance::now_ms())
            .ok_or_else(|| ApiError::Conflict("the maintenance ended at once".into()))
    }

    /// Ends member `node_id`'s maintenance before it came back.
    pub(super) async fn stop_maintenance(&self, node_id: NodeId) -> Result<MaintenanceView, ApiError> {
        let state = self.control.state();
        let Some(mut view) =
            crate::maintenance::view(&state, crate::maintenance::now_ms()).filter(|m| m.node_id == node_id)
        else {
            return Err(ApiError::Conflict(format!("node {node_id} is not in maintenance")));
        };
        let reason = "ended by an operator".to_string();
        self.control.admin(AdminRequest::EndMaintenance { node_id, reason }).await.map_err(control_error)?;
        view.ended = true;
        Ok(view)
    }

    pub(super) fn map_view(&self) -> Result<MapView, ApiError> {
        let state = self.control.state();
        if state.map.is_empty() {
            return Err(ApiError::unavailable(Unavailable::NotReady, "this node has not joined a cluster yet"));
        }
        let nodes = state
            .members
            .iter()
            .map(|m| MapNode { id: m.id, api_addr: m.api_addr.clone(), replica_on: state.replica_of(m.id) })
            .collect();
        Ok(MapView { version: state.map.version, owners: state.map.owners.clone(), nodes })
    }

    /// The map once its version is above `after`, or as it is when `timeout` passes.
    pub(super) async fn wait_for_map(&self, after: u64, timeout: Duration) -> Result<MapView, ApiError> {
        let view = self.control.view().clone();
        let _ = tokio::time::timeout(timeout, wait_applied(&view, |s| s.map.version > after)).await;
        self.map_view()
    }

    /// Events after `since`; when there is none, waits up to `wait` for one.
    pub(super) async fn event_page(&self, since: u64, limit: usize, wait: Duration) -> EventsView {
        let view = self.control.view().clone();
        let page = |v: &StateView| {
            let p = v.events_since(since, limit);
            EventsView { events: p.events, next: p.next, oldest: p.oldest }
        };
        let first = page(&view);
        if !first.events.is_empty() || wait.is_zero() {
            return first;
        }
        let _ = tokio::time::timeout(wait, async {
            let mut applied = view.subscribe();
            while view.events_since(since, 1).events.is_empty() {
                if applied.changed().await.is_err() {
                    // The node is stopping: answer what there is.
                    std::future::pending::<()>().await;
                }
            }
        })
        .await;
        page(&view)
    }

    pub(super) fn own_stats(&self) -> NodeStats {
        let stats = self.cache.stats();
        NodeStats {
            node_id: self.node_id,
            items: stats.items,
            bytes: stats.bytes,
            limit_bytes: stats.limit_bytes,
            map_version: self.control.state().map.version,
            version: Some(crate::VERSION.to_string()),
            revision: Some(crate::REVISION.to_string()),
        }
    }

    pub(super) async fn make_leave(&self, node_id: NodeId, force: bool) -> Result<LeaveOk, ApiError> {
        let state = self.control.state();
        if !state.is_member(node_id) {
            let why = if state.retired.contains(&node_id) { "has already left" } else { "is not a member" };
            return Err(ApiError::UnknownResource(format!("node {node_id} {why}")));
        }
        // Forced through a running change: buckets still on their way (or whose replica is
        // being rebuilt) may have a single copy until the transfer ends.
        let warning = state.forced_warning(force);
        match self.control.admin(AdminRequest::Leave { node_id, force }).await.map_err(control_error)? {
            AdminResponse::Left { map_version } => Ok(LeaveOk { node_id, map_version, warning }),
            other => Err(ApiError::Internal(format!("unexpected answer to leave: {other:?}"))),
        }
    }

    /// Readiness: a member with a map and a leader it can commit through (a leader that no
    /// majority answers is not ready), not stopping, holding every bucket it
    /// owns (none incoming or being restored), and every owned bucket attached to its
    /// replica. The last two make a rolling restart wait until the data of the pod just
    /// restarted is safe again before the next pod goes.
    pub(super) fn checks(&self) -> Vec<Check> {
        let state = self.control.state();
        let check = |name: &str, ok: bool, detail: String| Check { name: name.into(), ok, detail };
        let incoming = state.incoming_of(self.node_id).len();
        // A lost bucket stays marked for restoring until it is found or cleared; nobody holds
        // it, and it does not make this node unready.
        let restoring = state
            .map
            .buckets_of(self.node_id)
            .into_iter()
            .filter(|&b| self.core.facts().is_restoring(b) && !state.is_lost(b))
            .count();
        let (attached, owned) = self.core.facts().attached_count(&state, self.node_id);
        let in_place = self.core.facts().replica_in_place(&state, self.node_id);
        let alone = state.members.len() <= 1;
        vec![
            check("member", state.is_member(self.node_id), "this node is not a member of a cluster (yet)".into()),
            {
                let refusal = self.control.commit_refusal();
                check("leader", refusal.is_none(), refusal.unwrap_or_default())
            },
            check("map", !state.map.is_empty(), "no distribution map applied".into()),
            check(
                "draining",
                !self.core.facts().is_draining() && (alone || !state.draining.contains(&self.node_id)),
                match self.core.facts().is_draining() {
                    true => "this node is stopping (SIGTERM)".into(),
                    false => "the cluster has not recorded yet that this node runs again after its stop".into(),
                },
            ),
            check(
                "maintenance",
                state.maintenance.as_ref().is_none_or(|m| m.node != self.node_id),
                "this node is in maintenance: its replica holder serves its buckets until it takes them back".into(),
            ),
            check(
                "buckets",
                incoming == 0 && restoring == 0,
                format!("{incoming} buckets still to pull here, {restoring} being restored"),
            ),
            check(
                "replicas",
                alone || in_place,
                format!("{attached} of {owned} owned buckets attached to their replica{}", {
                    let next = state.replica_of(self.node_id).filter(|_| attached == owned);
                    match next {
                        Some(next) if !crate::reconcile::plan::prepares_replica_now(&state, self.node_id, next) => {
                            format!(", which moves to node {next} once that node has pulled its buckets")
                        }
                        Some(next) => format!(", which moves to node {next}, the holder join order names"),
                        None => String::new(),
                    }
                }),
            ),
        ]
    }

    /// Refreshes the state gauges from the store and the control plane.
    pub(super) fn refresh_gauges(&self) {
        let g = &self.metrics.state;
        let t = self.progress.status(self.node_id);
        let state = self.control.state();
        g.transfer_in_progress.set(if t.active { 1.0 } else { 0.0 });
        g.transfer_buckets_pending.set(state.incoming_of(self.node_id).len() as f64);
        g.transfer_buckets_round.set(t.buckets_total as f64);
        g.transfer_buckets_round_done.set(t.buckets_done as f64);
        g.transfer_buckets.absolute(t.buckets_pulled_total);
        g.transfer_bytes_received.absolute(t.bytes_received_total);
        g.transfer_bytes_sent.absolute(t.bytes_sent_total);
        g.transfer_idle.set(t.idle_seconds);
        g.transfer_flag.set(if state.transfer_flag { 1.0 } else { 0.0 });
        let stats = self.cache.stats();
        g.items.set(stats.items as f64);
        g.bytes.set(stats.bytes as f64);
        g.limit_bytes.set(stats.limit_bytes as f64);
        g.evictions.absolute(stats.evictions);
        g.expirations.absolute(stats.expirations);
        let state = self.control.state();
        g.map_version.set(state.map.version as f64);
        g.buckets_owned.set(state.map.buckets_of(self.node_id).len() as f64);
        g.members.set(state.members.len() as f64);
        let raft = self.control.raft_metrics();
        g.is_leader.set(if raft.current_leader == Some(self.node_id) { 1.0 } else { 0.0 });
        g.leader_id.set(raft.current_leader.unwrap_or(0) as f64);
        let voters: Vec<NodeId> = raft.membership_config.membership().voter_ids().collect();
        g.raft_voters.set(voters.len() as f64);
        g.raft_is_voter.set(if voters.contains(&self.node_id) { 1.0 } else { 0.0 });
        g.leader_changes.absolute(self.control.leader_changes());
        g.raft_term.set(raft.current_term as f64);
        g.raft_last_log_index.set(raft.last_log_index.unwrap_or(0) as f64);
        g.raft_applied_index.set(raft.last_applied.map(|l| l.index).unwrap_or(0) as f64);
        g.raft_commit_index.set(self.control.commit_index() as f64);
        g.balance_ratio.set(self.balancer.balance_ratio());
        g.raft_storage_bytes.set(self.control.storage_bytes() as f64);
        let replica = self.replicator.holder.replica().stats();
        g.replica_items.set(replica.items as f64);
        g.replica_bytes.set(replica.bytes as f64);
        g.replication_sync.set(if state.settings.replication == ReplicationMode::Sync { 1.0 } else { 0.0 });
        let (depth, lag) = self.replicator.queue_lag();
        g.replication_queue_depth.set(depth as f64);
        g.replication_lag.set(lag.as_secs_f64());
        let (attached, owned) = self.core.facts().attached_count(&state, self.node_id);
        g.replication_attached.set(attached as f64);
        g.replication_owned.set(owned as f64);
        let r = &self.replicator.stats;
        g.replication_sent.absolute(r.sent.load(Ordering::Relaxed));
        g.replication_failures.absolute(r.failures.load(Ordering::Relaxed));
        g.replication_exchanges.absolute(self.replicator.exchanges());
        g.replication_snapshots.absolute(r.snapshots.load(Ordering::Relaxed));
        g.replication_snapshot_bytes.absolute(r.snapshot_bytes.load(Ordering::Relaxed));
        g.replication_undone.absolute(r.undone.load(Ordering::Relaxed));
        g.peers_pfail.set(self.health.pfail_members().len() as f64);
        g.nodes_failed.set(state.failed.len() as f64);
        g.buckets_lost.set(state.lost.len() as f64);
        let maintenance = crate::maintenance::view(&state, crate::maintenance::now_ms());
        g.maintenance.set(maintenance.as_ref().map_or(0.0, |m| m.node_id as f64));
        g.maintenance_seconds_left.set(maintenance.as_ref().map_or(0.0, |m| m.seconds_left));
        g.fails_proposed.absolute(self.health.fails_proposed.load(Ordering::Relaxed));
    }

    /// What `GET /v1/cluster` shows of replication from this node.
    fn replication_view(&self, state: &ClusterState) -> ReplicationView {
        let (queue_depth, lag) = self.replicator.queue_lag();
        let (attached_buckets, owned_buckets) = self.core.facts().attached_count(state, self.node_id);
        let replica = self.replicator.holder.replica().stats();
        ReplicationView {
            mode: state.settings.replication.to_string(),
            replica_on: state.replica_of(self.node_id),
            attached_buckets,
            owned_buckets,
            queue_depth: queue_depth as u64,
            lag_seconds: lag.as_secs_f64(),
            replica_items: replica.items,
            replica_bytes: replica.bytes,
        }
    }

    pub(super) async fn change_config(&self, config: ClusterConfig) -> Result<ClusterConfig, ApiError> {
        let mode: Option<ReplicationMode> = config
            .replication
            .as_deref()
            .map(|r| {
                r.parse().map_err(|_| ApiError::BadRequest(format!("replication must be sync or async, not {r:?}")))
            })
            .transpose()?;
        if let Some(mode) = mode {
            self.control.admin(AdminRequest::SetReplication { mode }).await.map_err(control_error)?;
        }
        if let Some(enabled) = config.auto_balance {
            self.control.admin(AdminRequest::SetAutoBalance { enabled }).await.map_err(control_error)?;
        }
        self.control
            .wait_for_state(Duration::from_secs(5), |s| {
                mode.is_none_or(|m| s.settings.replication == m)
                    && config.auto_balance.is_none_or(|a| s.settings.auto_balance == a)
            })
            .await;
        let settings = self.control.state().settings.clone();
        Ok(ClusterConfig {
            replication: Some(settings.replication.to_string()),
            auto_balance: Some(settings.auto_balance),
        })
    }

    /// The leader's view of the buckets, asked by another member.
    pub fn buckets_here(&self, query: BucketsQuery) -> Result<BucketsView, ApiError> {
        self.balancer.buckets_here(query).map_err(balance_error)
    }

    /// A balancing asked of the leader by another member.
    pub async fn rebalance_here(&self, request: RebalanceRequest) -> Result<RebalancePlan, ApiError> {
        self.balancer.rebalance_here(request).await.map_err(balance_error)
    }

    pub(super) async fn acknowledge_lost(&self, clear: ClearLost) -> Result<LostCleared, ApiError> {
        if let Some(b) = clear.buckets.iter().find(|&&b| usize::from(b) >= shoal_raft::BUCKET_COUNT) {
            return Err(ApiError::BadRequest(format!("no bucket {b}: buckets are 0-999")));
        }
        match self.control.admin(AdminRequest::ClearLost { buckets: clear.buckets }).await.map_err(control_error)? {
            AdminResponse::Cleared { buckets } => {
                if !buckets.is_empty() {
                    tracing::warn!(
                        count = buckets.len(),
                        ?buckets,
                        "lost buckets acknowledged: they serve again, empty"
                    );
                }
                Ok(LostCleared { cleared: buckets })
            }
            other => Err(ApiError::Internal(format!("unexpected answer to clear lost: {other:?}"))),
        }
    }
}

/// Why a bucket view or a balancing was not had, as the client sees it; a leader's answer
/// keeps its status and code.
pub(super) fn balance_error(e: BalanceError) -> ApiError {
    match e {
        BalanceError::Refused(Refusal::Busy(reason)) => ApiError::MembershipChangeInProgress(reason),
        BalanceError::Refused(Refusal::NotMember(id)) => {
            ApiError::UnknownResource(format!("node {id} is not a member that stays"))
        }
        BalanceError::Refused(Refusal::StatsPending(missing)) => ApiError::unavailable(
            Unavailable::StatsPending,
            format!("no recent bucket statistics from members {missing:?} yet: they report every --stats-interval"),
        ),
        BalanceError::NotLeader => ApiError::unavailable(Unavailable::NoLeader, "this node is no longer the leader"),
        BalanceError::NoLeader => ApiError::unavailable(Unavailable::NoLeader, "no leader is known"),
        BalanceError::Control(e) => control_error(e),
        BalanceError::Call(CallError::Api(e)) => e,
        BalanceError::Call(e) => {
            ApiError::unavailable(Unavailable::Unavailable, format!("the leader did not answer: {e}"))
        }
    }
}

fn control_error(e: ControlError) -> ApiError {
    match e {
        ControlError::Rejected { reason } => ApiError::Conflict(reason),
        ControlError::MembershipChangeInProgress { reason } => ApiError::MembershipChangeInProgress(reason),
        ControlError::NoLeader { detail } => ApiError::unavailable(Unavailable::NoLeader, detail),
        ControlError::NotLeader { .. } | ControlError::ChangeInProgress | ControlError::Network { .. } => {
            ApiError::unavailable(Unavailable::Unavailable, e.to_string())
        }
        ControlError::Timeout { what } => ApiError::unavailable(Unavailable::Unavailable, format!("timed out: {what}")),
        ControlError::Fatal { detail } => ApiError::Internal(detail),
    }
}

/// Waits until the applied state satisfies `done`.
async fn wait_applied(view: &StateView, done: impl Fn(&shoal_raft::ClusterState) -> bool) {
    let mut applied = view.subscribe();
    while !done(&view.current()) {
        if applied.changed().await.is_err() {
            std::future::pending::<()>().await;
        }
    }
}
