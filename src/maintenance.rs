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
//! Who does what: whoever asks (the API, a stop) checks, proposes `EnterMaintenance` and waits
//! for the answer in the node's [`Entry`]; the reconciler decides from the replicated state
//! when the node may go on (nobody's complete replica on it) or must refuse (another member
//! stops, the replica it holds did not move on in time, no heir), and hands the buckets over
//! as its `GoAway` job ([`HandOff::go_away`]), as it does a leaver's.
//!
//! ```text
//!  member M (asked directly, or through any node)     P (M held its replica)   heir H      Raft
//!  checks: a member of three or more, nothing running, every peer answers
//!  admin EnterMaintenance(M, since, until) ──────────────────────────────────────────────▶ preparing
//!                                                     attach at H, ReplicaMoved(P, H) ───▶
//!  reconciler waits: nobody's complete replica on M (≤ 60 s), then runs GoAway:
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
use tokio::sync::watch;
use tokio::time::Instant;

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

    /// Hands this node's buckets to `heir` once it prepares for maintenance and nobody's
    /// complete replica is on it (the reconciler's `GoAway`): with writes paused, waits until
    /// the heir holds every write, proposes `MaintenanceReady`, and answers once the heir
    /// serves the buckets. Every step ends by `deadline`.
    pub async fn go_away(&self, heir: NodeId, deadline: Instant) -> Result<(), EnterError> {
        let me = self.me;
        let left = |cap: Duration| deadline.saturating_duration_since(Instant::now()).min(cap);
        // Once another member starts to stop, the maintenance goes no further.
        let preparing = |s: &ClusterState| preparing(s, me) && s.stopping_peer(me).is_none();
        let pause = WritePause::new(self.facts);
        let checked = match self.in_sync(heir, left(SYNC_WAIT), preparing).await {
            Ok(checked) => checked,
            Err(NotInSync { attached, owned, .. }) => {
                let refusal = match self.control.state().stopping_peer(me) {
                    Some(peer) => MaintenanceRefusal::PeerStopping(peer),
                    None => MaintenanceRefusal::ReplicaNotAttached { node: me, attached, owned },
                };
                return Err(EnterError::Refused(refusal));
            }
        };
        bounded(self.control, deadline, AdminRequest::MaintenanceReady { node_id: me, heir: checked })
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

/// Whether `me` prepares for maintenance in `state`.
fn preparing(state: &ClusterState, me: NodeId) -> bool {
    state.maintenance.as_ref().is_some_and(|m| m.node == me && m.phase == MaintenancePhase::Preparing)
}

/// Proposes `request`, giving up at `deadline` (the entry may still commit then).
async fn bounded(control: &ControlPlane, deadline: Instant, request: AdminRequest) -> Result<(), ControlError> {
    match tokio::time::timeout_at(deadline, control.admin(request)).await {
        Ok(answer) => answer.map(|_| ()),
        Err(_) => Err(ControlError::Timeout { what: "the Raft log to commit in time".into() }),
    }
}

/// This node's own entry into maintenance: asked for by whoever puts it into maintenance (the
/// API, a stop), carried out by the reconciler (which refuses it, or hands the buckets over
/// as its `GoAway` job), and answered back here. One at a time.
#[derive(Debug, Default)]
pub struct Entry(watch::Sender<Option<Asked>>);

/// An entry being driven.
#[derive(Debug, Clone)]
pub struct Asked {
    /// Every step ends by then.
    pub deadline: Instant,
    /// Set once the maintenance is committed as preparing: the reconciler goes on from there,
    /// and refuses it if nobody's complete replica left this node by then.
    pub prepare_by: Option<Instant>,
    /// What came of it; the first decision counts.
    pub outcome: Option<Result<(), EnterError>>,
}

/// Ends the entry when the one who drives it goes (answered, or cancelled): a maintenance
/// still preparing then is ended by the reconciler.
struct Driving<'a>(&'a Entry);

impl Drop for Driving<'_> {
    fn drop(&mut self) {
        self.0 .0.send_replace(None);
    }
}

impl Entry {
    /// The entry being driven, if any.
    pub fn asked(&self) -> Option<Asked> {
        self.0.borrow().clone()
    }

    /// Changes of the entry (the reconciler plans again on each).
    pub fn subscribe(&self) -> watch::Receiver<Option<Asked>> {
        self.0.subscribe()
    }

    /// Decides the entry being driven, unless it is decided already.
    pub fn decide(&self, outcome: Result<(), EnterError>) {
        self.0.send_if_modified(|asked| match asked {
            Some(asked) if asked.outcome.is_none() => {
                asked.outcome = Some(outcome);
                true
            }
            _ => false,
        });
    }

    /// Puts node `me` into maintenance for `period` (see the module docs), by `deadline` (and
    /// [`END_WAIT`] more to end it again when it cannot); answers once the heir serves its
    /// buckets in this node's applied state. `suspected` are the peers it does not hear from.
    pub async fn enter(
        &self,
        me: NodeId,
        control: &ControlPlane,
        period: Duration,
        deadline: Instant,
        suspected: &[NodeId],
    ) -> Result<(), EnterError> {
        let state = control.state();
        if let Some(refusal) = state.maintenance_refusal(me) {
            return Err(EnterError::Refused(refusal));
        }
        if let Some(&peer) = suspected.first() {
            return Err(EnterError::Refused(MaintenanceRefusal::PeerDown(peer)));
        }
        let fresh = Asked { deadline, prepare_by: None, outcome: None };
        let free = self.0.send_if_modified(|asked| asked.is_none() && asked.replace(fresh).is_none());
        if !free {
            return Err(EnterError::Refused(MaintenanceRefusal::Busy(
                "this node is entering maintenance already".into(),
            )));
        }
        let _driving = Driving(self);
        let since_ms = now_ms();
        let until_ms = since_ms + period.as_millis() as u64;
        let request = AdminRequest::EnterMaintenance { node_id: me, since_ms, until_ms };
        // An error may come after the entry committed (a timeout, a change of leader): the
        // maintenance is then ended below like any that could not begin.
        let outcome = match bounded(control, deadline, request).await {
            Ok(()) => self.outcome(me, control, deadline).await,
            Err(e) => Err(EnterError::Control(e)),
        };
        if outcome.is_err() {
            let reason = "it could not go away: see the refusal".to_string();
            let end = AdminRequest::EndMaintenance { node_id: me, reason };
            if let Err(e) = bounded(control, Instant::now() + END_WAIT, end).await {
                tracing::warn!(node_id = me, error = %e, "could not end the maintenance that failed to begin");
            }
        }
        outcome
    }

    /// Once the maintenance is committed: lets the reconciler go on, and waits (until
    /// `deadline`) for what came of it.
    async fn outcome(&self, me: NodeId, control: &ControlPlane, deadline: Instant) -> Result<(), EnterError> {
        let left = |cap: Duration| deadline.saturating_duration_since(Instant::now()).min(cap);
        // The leader committed it; this node may apply it a moment later.
        control.wait_for_state(left(Duration::from_secs(5)), |s| preparing(s, me)).await;
        let prepare_by = Instant::now() + left(PREPARE_WAIT);
        self.0.send_modify(|asked| {
            if let Some(asked) = asked {
                asked.prepare_by = Some(prepare_by);
            }
        });
        let mut changes = self.0.subscribe();
        let decided = changes.wait_for(|a| a.as_ref().is_some_and(|a| a.outcome.is_some()));
        if tokio::time::timeout_at(deadline, decided).await.is_err() {
            let what = "this node to hand its buckets over in time".into();
            self.decide(Err(EnterError::Control(ControlError::Timeout { what })));
        }
        let asked = self.asked();
        asked.and_then(|a| a.outcome).unwrap_or(Err(EnterError::Refused(MaintenanceRefusal::Busy(
            "the entry ended before it was decided".into(),
        ))))
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
