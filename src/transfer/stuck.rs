//! The leader's stuck-transfer detector.
//!
//! Every `--transfer-check-interval` (the reconciler plans the check) the leader asks every
//! member that still has buckets to
//! receive for the time since its last transfer activity (`TransferStatus`, a call on the peer link). If one
//! has been idle longer than `--transfer-stuck-after` — or a transition has waited that long
//! for acknowledgements — the transfer is stuck: the leader logs it, counts it
//! (`shoal_transfer_stuck_total`) and clears the state-transfer flag, so membership may change
//! again. The buckets still to move stay in the target; a member that comes back resumes.

use std::collections::BTreeMap;
use std::time::Duration;

use tokio::time::Instant;

use shoal_raft::{AdminRequest, ControlPlane, NodeId};

use super::TransferConfig;
use crate::metrics::NodeMetrics;
use crate::peer::Peers;
use crate::transport::PEER_CALL_TIMEOUT;

/// The leader's memory between checks: when each pending map was first seen, and when each
/// member last answered or moved data.
#[derive(Debug, Default)]
pub struct StuckDetector {
    transition_seen: Option<(u64, Instant)>,
    last_heard: BTreeMap<NodeId, Instant>,
}

impl StuckDetector {
    /// Forgets everything (this node does not lead, or no transfer runs).
    pub fn reset(&mut self) {
        self.transition_seen = None;
        self.last_heard.clear();
    }

    /// One check, as leader of a running transfer: clears the state-transfer flag when it is
    /// stuck.
    pub async fn check(
        &mut self,
        control: &ControlPlane,
        peers: &Peers,
        config: TransferConfig,
        metrics: &NodeMetrics,
    ) {
        let state = control.state();
        let mut stuck: Option<String> = None;
        if let Some(t) = &state.transition {
            let since = match self.transition_seen {
                Some((v, since)) if v == t.to.version => since,
                _ => {
                    self.transition_seen = Some((t.to.version, Instant::now()));
                    Instant::now()
                }
            };
            if since.elapsed() > config.stuck_after {
                let missing: Vec<NodeId> = state.member_ids().into_iter().filter(|m| !t.acked.contains(m)).collect();
                stuck = Some(format!(
                    "the transition to map version {} has waited {:?} for members {missing:?}",
                    t.to.version,
                    since.elapsed()
                ));
            }
        }
        for member in state.members.iter().filter(|m| !state.incoming_of(m.id).is_empty()) {
            let idle = match peers
                .ask(&member.peer_addr, super::progress::AskProgress, PEER_CALL_TIMEOUT)
                .await
                .map(|s| s.0)
            {
                Ok(status) => {
                    let idle = Duration::from_secs_f64(status.idle_seconds.max(0.0));
                    self.last_heard.insert(member.id, Instant::now() - idle);
                    idle
                }
                // Unreachable: idle since it last answered (or since we started looking).
                Err(_) => self.last_heard.entry(member.id).or_insert_with(Instant::now).elapsed(),
            };
            if idle > config.stuck_after && stuck.is_none() {
                stuck = Some(format!("node {} has moved no transfer data for {idle:?}", member.id));
            }
        }
        if let Some(reason) = stuck {
            tracing::warn!(%reason, "state transfer stuck; clearing the state-transfer flag");
            metrics.transfer_stuck.increment(1);
            if let Err(e) = control.admin(AdminRequest::ClearTransferFlag { reason }).await {
                tracing::warn!(error = %e, "could not clear the state-transfer flag");
            }
        }
    }
}
