//! Maintenance, this node's side: it goes into maintenance itself, because only it knows
//! whether its replica is complete. First it prepares: replica placement skips it, and it waits
//! until the member whose replica it holds has sent every bucket to the next member and made it
//! its complete holder (so no bucket is left with one copy). Then it pauses its writes, waits
//! until every bucket it owns is attached at the holder of its own replica and its async queue
//! is empty, and proposes `MaintenanceReady` with that holder and the holder's period, which
//! Raft refuses if either changed. The holder then serves its buckets (a promotion, as on
//! hand-over); a write that reached this node before the pause is in the replica or refused by
//! the holder's fence after the flip, never acknowledged and lost.
//!
//! ```text
//!  member M (asked directly, or through any node)     P (M held its replica)   heir H      Raft
//!  checks: a member of three or more, nothing running, every peer answers
//!  admin EnterMaintenance(M, since, until) ──────────────────────────────────────────────▶ preparing
//!                                                     attach at H, ReplicaMoved(P, H) ───▶
//!  wait: nobody's complete replica on M (≤ 60 s)
//!  refuse writes (503 node_leaving: forwarders wait for the new owner)
//!  wait: every owned bucket attached at H, async queue empty (≤ 10 s)
//!  admin MaintenanceReady(M, (H, period)) ───────────────────────────────────────────────▶ away: owners M→H
//!  accept writes again (they route to H)                                    installs, reports
//!  ... M stops, restarts, says it runs again ────────────────────────────────────────────▶ returned
//!  pulls its buckets back from H (state transfer) ──────────────────────────────────────▶ target reached:
//!                                                                                          maintenance over
//! ```
//!
//! Any step that fails ends the maintenance again (`EndMaintenance`) and answers why. Every
//! step, the Raft proposals included, ends by the deadline the caller gives (a stop has its
//! `--drain-timeout`), and the clean-up takes at most [`END_WAIT`] more. A maintenance being
//! prepared goes no further once another member starts to stop: the heir, or the majority that
//! keeps it, may be gone next.
//!
//! The leader ends a maintenance whose time ran out before the member came back (the
//! reconciler's `EndMaintenance`); failure detection then fails it like any silent member.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use shoal_raft::state::{MaintenancePhase, MaintenanceRefusal};
use shoal_raft::{AdminRequest, ClusterState, ControlError, ControlPlane, NodeId};

use crate::phase::LocalFacts;
use crate::replication::Replicator;

/// How long a member waits for its replica to be complete before it refuses.
pub const SYNC_WAIT: Duration = Duration::from_secs(10);
/// How long a member preparing for maintenance waits for the replica it holds to move on.
pub const PREPARE_WAIT: Duration = Duration::from_secs(60);
/// The most entering maintenance may take, the Raft proposals included.
pub const ENTER_TIMEOUT: Duration = Duration::from_secs(90);
/// The most ending a maintenance that could not begin may take (it needs a Raft commit; if
/// none comes, a member that restarts ends it by saying it runs again, and one that stays
/// down is failed like any other).
pub const END_WAIT: Duration = Duration::from_secs(5);

/// The wall clock in ms since the Unix epoch (a maintenance's period is dated by it, so it
/// means the same on every node and survives a change of leader).
pub fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

/// Why this node did not go into maintenance.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EnterError {
    /// The cluster's state or this node's replica does not allow it now.
    #[error("{0}")]
    Refused(MaintenanceRefusal),
    /// The control plane did not take it.
    #[error("{0}")]
    Control(ControlError),
}

/// Refuses this node's new writes while it lives (503 `node_leaving`: a forwarder waits for
/// the new owner instead of answering it).
pub struct WritePause<'a>(&'a LocalFacts);

impl<'a> WritePause<'a> {
    /// Starts refusing writes.
    pub fn new(facts: &'a LocalFacts) -> Self {
        facts.set_handing_over(true);
        WritePause(facts)
    }
}

impl Drop for WritePause<'_> {
    fn drop(&mut self) {
        self.0.set_handing_over(false);
    }
}

/// Marks this node as running the procedure that puts it into maintenance while it lives: a
/// maintenance that prepares with nobody driving it (the request was cancelled, an answer
/// lost) is ended by the reconciler.
struct Entering<'a>(&'a LocalFacts);

impl Drop for Entering<'_> {
    fn drop(&mut self) {
        self.0.set_entering_maintenance(false);
    }
}

/// What a member needs to hand its buckets to its heir: its state, its writes, its replica.
pub struct HandOff<'a> {
    /// This node.
    pub me: NodeId,
    /// The control plane.
    pub control: &'a ControlPlane,
    /// Its replica's attachments and the async queue.
    pub replicator: &'a Replicator,
    /// The bucket locks.
    pub facts: &'a LocalFacts,
}

/// Buckets attached, owned, and changes still queued, when the replica was not complete.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NotInSync {
    /// Owned buckets attached at the heir.
    pub attached: usize,
    /// Owned buckets.
    pub owned: usize,
    /// Async changes not sent yet.
    pub queued: usize,
}

impl HandOff<'_> {
    /// With writes paused (the caller holds a [`WritePause`]), waits until every bucket this
    /// node owns is attached at `heir` and the async queue is empty, at most `wait` and while
    /// `go_on` holds; answers the heir's holding period then (Raft refuses a hand-over or a
    /// maintenance checked in a period that ended: the heir dropped the copies counted here).
    pub async fn in_sync(
        &self,
        heir: NodeId,
        wait: Duration,
        go_on: impl Fn(&ClusterState) -> bool,
    ) -> Result<(NodeId, u64), NotInSync> {
        // A write that passed the refusal check before the pause holds its bucket lock until
        // it reached the replica or its queue: taking every lock once waits for those, so the
        // queue count below includes them.
        for b in self.control.state().map.buckets_of(self.me) {
            drop(self.facts.lock(b).await);
        }
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            let state = self.control.state();
            let (attached, owned) = self.facts.attached_count(&state, self.me);
            let (queued, _) = self.replicator.queue_lag();
            if attached == owned && queued == 0 && state.heir_of(self.me) == Some(heir) {
                if let Some(period) = state.replica_period(self.me, heir) {
                    return Ok((heir, period));
                }
            }
            if tokio::time::Instant::now() >= deadline || !go_on(&state) {
                return Err(NotInSync { attached, owned, queued });
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Puts this node into maintenance for `period` (see the module docs), by `deadline`
    /// (and [`END_WAIT`] more to end it again when it cannot); answers once the heir serves
    /// its buckets in this node's applied state.
    pub async fn enter_maintenance(
        &self,
        period: Duration,
        deadline: tokio::time::Instant,
        suspected: &[NodeId],
    ) -> Result<(), EnterError> {
        let state = self.control.state();
        if let Some(refusal) = state.maintenance_refusal(self.me) {
            return Err(EnterError::Refused(refusal));
        }
        if let Some(&peer) = suspected.first() {
            return Err(EnterError::Refused(MaintenanceRefusal::PeerDown(peer)));
        }
        self.facts.set_entering_maintenance(true);
        let _entering = Entering(self.facts);
        let since_ms = now_ms();
        let until_ms = since_ms + period.as_millis() as u64;
        let request = AdminRequest::EnterMaintenance { node_id: self.me, since_ms, until_ms };
        // An error may come after the entry committed (a timeout, a change of leader): the
        // maintenance is then ended below like any that could not begin.
        let outcome = match self.bounded(deadline, request).await {
            Ok(()) => self.go_away(deadline).await,
            Err(e) => Err(EnterError::Control(e)),
        };
        if outcome.is_err() {
            let reason = "it could not go away: see the refusal".to_string();
            let end = AdminRequest::EndMaintenance { node_id: self.me, reason };
            let by = tokio::time::Instant::now() + END_WAIT;
            if let Err(e) = self.bounded(by, end).await {
                tracing::warn!(node_id = self.me, error = %e, "could not end the maintenance that failed to begin");
            }
        }
        outcome
    }

    /// Proposes `request`, giving up at `deadline` (the entry may still commit then).
    async fn bounded(&self, deadline: tokio::time::Instant, request: AdminRequest) -> Result<(), ControlError> {
        match tokio::time::timeout_at(deadline, self.control.admin(request)).await {
            Ok(answer) => answer.map(|_| ()),
            Err(_) => Err(ControlError::Timeout { what: "the Raft log to commit in time".into() }),
        }
    }

    /// Preparing: waits until nobody's complete replica is on this node, then hands its buckets
    /// to its heir with writes paused.
    async fn go_away(&self, deadline: tokio::time::Instant) -> Result<(), EnterError> {
        let me = self.me;
        let preparing = |s: &ClusterState| {
            s.maintenance.as_ref().is_some_and(|m| m.node == me && m.phase == MaintenancePhase::Preparing)
        };
        let left = |cap: Duration| deadline.saturating_duration_since(tokio::time::Instant::now()).min(cap);
        // The leader committed it; this node may apply it a moment later.
        self.control.wait_for_state(left(Duration::from_secs(5)), preparing).await;
        // Once another member starts to stop, the maintenance goes no further.
        let preparing = |s: &ClusterState| preparing(s) && s.stopping_peer(me).is_none();
        let moved = self.control.wait_for_state(left(PREPARE_WAIT), |s| !preparing(s) || s.held_by(me).is_none()).await;
        let state = self.control.state();
        if let Some(peer) = state.stopping_peer(me) {
            return Err(EnterError::Refused(MaintenanceRefusal::PeerStopping(peer)));
        }
        if !preparing(&state) {
            return Err(EnterError::Refused(MaintenanceRefusal::Busy(
                "the maintenance ended while it prepared".into(),
            )));
        }
        if let Some(owner) = state.held_by(me).filter(|_| !moved) {
            return Err(EnterError::Refused(MaintenanceRefusal::StillHolding { holder: me, owner }));
        }
        let Some(heir) = state.heir_of(me) else {
            return Err(EnterError::Refused(MaintenanceRefusal::TooFewMembers(state.members.len())));
        };
        let pause = WritePause::new(self.facts);
        let checked = match self.in_sync(heir, left(SYNC_WAIT), preparing).await {
            Ok(checked) => checked,
            Err(_) if self.control.state().stopping_peer(me).is_some() => {
                let peer = self.control.state().stopping_peer(me).unwrap_or_default();
                return Err(EnterError::Refused(MaintenanceRefusal::PeerStopping(peer)));
            }
            Err(NotInSync { attached, owned, .. }) => {
                return Err(EnterError::Refused(MaintenanceRefusal::ReplicaNotAttached { node: me, attached, owned }));
            }
        };
        self.bounded(deadline, AdminRequest::MaintenanceReady { node_id: me, heir: checked })
            .await
            .map_err(EnterError::Control)?;
        self.control.wait_for_state(left(Duration::from_secs(10)), |s| s.map.buckets_of(me).is_empty()).await;
        drop(pause);
        tracing::warn!(
            node_id = me,
            heir,
            "in maintenance: the replica holder serves this node's buckets until it comes back"
        );
        Ok(())
    }
}

/// `GET /v1/cluster`'s view of a maintenance on `state`.
pub fn view(state: &ClusterState, now_ms: u64) -> Option<shoal_http_api::types::MaintenanceView> {
    let m = state.maintenance.as_ref()?;
    Some(shoal_http_api::types::MaintenanceView {
        node_id: m.node,
        served_by: m.heir,
        since_ms: m.since_ms,
        until_ms: m.until_ms,
        seconds_left: m.until_ms.saturating_sub(now_ms) as f64 / 1000.0,
        phase: match m.phase {
            MaintenancePhase::Preparing => "preparing",
            MaintenancePhase::Away => "away",
            MaintenancePhase::Returned => "returned",
        }
        .to_string(),
        returned: m.phase == MaintenancePhase::Returned,
        buckets_left: state.target.as_ref().map_or(0, |t| state.map.moved_buckets(t).len()),
        ended: false,
    })
}
