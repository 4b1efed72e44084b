//! R18: a leaving member hands its buckets to the holder of its replica, which serves them
//! from its replica store at once (no copy) while state transfer moves them on.
//!
//! ```text
//!  leaver L (leaving, target set)                holder H = replica_of(L)            Raft
//!  refuse writes (503 node_leaving) ─▶ wait: every owned bucket attached to H,
//!                                       async queue empty (in-flight writes done)
//!  admin HandOver(L) ────────────────────────────────────────────────────────────▶ owners L→H,
//!                                                                                  epochs + 1,
//!                                                                                  promoted
//!  accept writes again (they route to H)         promote: replica → active, Promoted ─▶
//!                                                serves; transfer pulls from H
//! ```
//!
//! The pause is what makes the replica complete: a write that reached L before it is either
//! in H's replica (acknowledged) or refused by H's fence after the flip (undone, never
//! acknowledged). If the replicas cannot be confirmed in sync in time, or the holder is
//! suspected, L does not hand over and drains its buckets itself, as before.

use std::sync::Arc;
use std::time::Duration;

use shoal_raft::{AdminRequest, ClusterState, ControlPlane, NodeId};

use super::Replicator;
use crate::health::Health;

/// How long the leaver waits for its replicas to be in sync before it gives up handing over.
const SYNC_WAIT: Duration = Duration::from_secs(10);

/// The member `me` can hand its buckets to, if now is the time: `me` is leaving, the leave's
/// target is set (the transition is over), it still serves buckets, and their replica holder
/// is another member that is not suspected.
fn heir(state: &ClusterState, me: NodeId, health: &Health) -> Option<NodeId> {
    let leaving = state.member_of(me).is_some_and(|m| m.leaving);
    if !leaving || state.transition.is_some() || state.target.is_none() || state.map.buckets_of(me).is_empty() {
        return None;
    }
    state.replica_of(me).filter(|&h| h != me && state.is_member(h) && !health.is_pfail(h))
}

/// Watches the applied state; once this node is leaving, hands its buckets over (once per
/// leave).
pub async fn hand_over_when_leaving(control: ControlPlane, replicator: Arc<Replicator>, health: Arc<Health>) {
    let me = control.node_id();
    let mut applied = control.view().subscribe();
    let mut tried = false;
    loop {
        let state = control.state();
        if !state.member_of(me).is_some_and(|m| m.leaving) {
            tried = false;
        }
        if let (false, Some(heir)) = (tried, heir(&state, me, &health)) {
            tried = true;
            hand_over(&control, &replicator, &health, heir).await;
        }
        if applied.changed().await.is_err() {
            return;
        }
    }
}

async fn hand_over(control: &ControlPlane, replicator: &Replicator, health: &Health, heir: NodeId) {
    let me = control.node_id();
    health.set_handing_over(true);
    let deadline = tokio::time::Instant::now() + SYNC_WAIT;
    let in_sync = loop {
        let state = control.state();
        let (attached, owned) = replicator.attached_count(&state);
        let (queued, _) = replicator.queue_lag();
        if attached == owned && queued == 0 {
            break true;
        }
        if tokio::time::Instant::now() >= deadline || !state.member_of(me).is_some_and(|m| m.leaving) {
            tracing::warn!(node_id = me, attached, owned, queued, "replicas not in sync: draining the buckets instead");
            break false;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    if in_sync {
        let buckets = control.state().map.buckets_of(me).len();
        match control.admin(AdminRequest::HandOver { node_id: me }).await {
            Ok(_) => {
                control.wait_for_state(Duration::from_secs(10), |s| s.map.buckets_of(me).is_empty()).await;
                tracing::info!(node_id = me, heir, buckets, "handed the buckets over to their replica holder");
            }
            Err(e) => tracing::warn!(node_id = me, error = %e, "hand-over refused: draining the buckets instead"),
        }
    }
    health.set_handing_over(false);
}
