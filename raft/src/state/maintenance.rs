//! Maintenance: a member goes away for a bounded time without a state transfer, in three
//! phases:
//!
//! 1. **Preparing** (`EnterMaintenance`): replica placement skips the member, so the member
//!    whose replica it holds sends its buckets to the next member; it stays the complete holder
//!    until that one has them all (`ReplicaMoved`), so no bucket is left with one copy.
//! 2. **Away** (`MaintenanceReady`, once no member's complete replica is on it): the holder of
//!    its own complete replica serves its buckets (a promotion, as on hand-over); the target
//!    map keeps giving the member its buckets, so nothing is rebalanced. It is not failed for
//!    its silence.
//! 3. **Returned** (it says it runs again): it pulls its buckets back like a joiner; once the
//!    serving map is the target again, the maintenance is over.
//!
//! A maintenance ends early when an operator ends it or its time runs out
//! (`EndMaintenance`), and at once when membership changes (a failure, a forced join or
//! leave): the member is then an ordinary one again, failed if it is silent.

use serde::{Deserialize, Serialize};

use super::{rejected, ClusterState};
use crate::command::CommandResponse;
use crate::distribution::{DistributionMap, NodeId};

/// The member in maintenance.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Maintenance {
    /// The member.
    pub node: NodeId,
    /// The member serving its buckets meanwhile (the holder of its complete replica).
    pub heir: NodeId,
    /// When it began, in milliseconds since the Unix epoch (the proposer's clock).
    pub since_ms: u64,
    /// When it runs out: if the member has not come back by then, the cluster stops sparing
    /// it (failure detection fails it, and the map is rebalanced without it).
    pub until_ms: u64,
    /// Where it is.
    pub phase: MaintenancePhase,
}

/// The phases of a maintenance (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MaintenancePhase {
    /// It still serves its buckets; the replica it holds moves to the next member.
    Preparing,
    /// Its replica holder serves its buckets; it may stop.
    Away,
    /// It runs again and takes its buckets back.
    Returned,
}

/// Why a member may not enter maintenance now. Checked by the member before it proposes, and
/// again by [`ClusterState::apply`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MaintenanceRefusal {
    /// It is not a member (or it leaves).
    #[error("node {0} is not a member that stays")]
    NotMember(NodeId),
    /// Another member (or this one) is in maintenance already: one at a time.
    #[error("node {0} is in maintenance already; one member at a time")]
    InProgress(NodeId),
    /// With fewer than three members, the others cannot keep a majority while it is away.
    #[error("maintenance needs at least three members (there are {0}): two cannot keep a majority while one is away")]
    TooFewMembers(usize),
    /// A transition, a state transfer or a failover runs.
    #[error("{0}")]
    Busy(String),
    /// Some of its buckets are not attached at the holder of its replica yet.
    #[error(
        "{attached} of {owned} buckets of node {node} are attached at its replica holder; retry once they all are"
    )]
    ReplicaNotAttached {
        /// The member.
        node: NodeId,
        /// Buckets attached.
        attached: usize,
        /// Buckets owned.
        owned: usize,
    },
    /// A member does not answer: it may be failing, and maintenance must not make it two.
    #[error("node {0} does not answer; maintenance waits until every other member does")]
    PeerDown(NodeId),
    /// Another member is stopping (SIGTERM): with it gone too, the heir or the majority that
    /// keeps the maintenance may be missing (a whole cluster stopping, say).
    #[error("node {0} is stopping; maintenance waits until every other member runs")]
    PeerStopping(NodeId),
    /// The holder of its replica changed since the member checked it.
    #[error("the holder of node {0}'s replica changed since it was checked; retry")]
    HolderChanged(NodeId),
    /// The replica it holds for another member did not move to the next member in time.
    #[error("node {holder} still holds node {owner}'s only complete replica; retry once it moved (GET /v1/cluster shows the attachments)")]
    StillHolding {
        /// The member in maintenance.
        holder: NodeId,
        /// The member whose replica it holds.
        owner: NodeId,
    },
}

impl MaintenanceRefusal {
    /// The stable machine code.
    pub fn code(&self) -> &'static str {
        match self {
            MaintenanceRefusal::NotMember(_) => "unknown_resource",
            MaintenanceRefusal::InProgress(_) => "maintenance_in_progress",
            MaintenanceRefusal::TooFewMembers(_) => "too_few_members",
            MaintenanceRefusal::Busy(_) => "membership_change_in_progress",
            MaintenanceRefusal::ReplicaNotAttached { .. } => "replica_not_attached",
            MaintenanceRefusal::PeerDown(_) => "peer_unreachable",
            MaintenanceRefusal::PeerStopping(_) => "peer_stopping",
            MaintenanceRefusal::HolderChanged(_) => "replica_holder_changed",
            MaintenanceRefusal::StillHolding { .. } => "replica_not_moved",
        }
    }
}

impl ClusterState {
    /// The member in maintenance that has not come back yet: it serves nothing, is not failed
    /// for its silence, and holds no replica.
    pub fn away(&self) -> Option<NodeId> {
        self.maintenance.as_ref().filter(|m| m.phase == MaintenancePhase::Away).map(|m| m.node)
    }

    /// The member that replica placement skips: preparing for maintenance, or away.
    pub fn skipped(&self) -> Option<NodeId> {
        self.maintenance.as_ref().filter(|m| m.phase != MaintenancePhase::Returned).map(|m| m.node)
    }

    /// A member whose only complete replica `node` holds, if any: `node` may not go away yet.
    pub fn held_by(&self, node: NodeId) -> Option<NodeId> {
        self.member_ids().into_iter().find(|&owner| owner != node && self.committed_holder_of(owner) == Some(node))
    }

    /// Why `node` may not enter maintenance on this state (the checks Raft can make; the
    /// member also checks its replica and its peers).
    pub fn maintenance_refusal(&self, node: NodeId) -> Option<MaintenanceRefusal> {
        if self.member_of(node).is_none_or(|m| m.leaving) {
            return Some(MaintenanceRefusal::NotMember(node));
        }
        if let Some(m) = &self.maintenance {
            return Some(MaintenanceRefusal::InProgress(m.node));
        }
        if self.members.len() < 3 {
            return Some(MaintenanceRefusal::TooFewMembers(self.members.len()));
        }
        if let Some(peer) = self.stopping_peer(node) {
            return Some(MaintenanceRefusal::PeerStopping(peer));
        }
        if let Some(busy) = self.membership_busy() {
            return Some(MaintenanceRefusal::Busy(busy));
        }
        // The stuck detector may have cleared the flag: buckets still on their way wait.
        if self.transition.is_some() || self.target.is_some() {
            return Some(MaintenanceRefusal::Busy("a transfer has buckets still to move".into()));
        }
        if !self.promoted.is_empty() {
            return Some(MaintenanceRefusal::Busy(format!("a failover is installing {} buckets", self.promoted.len())));
        }
        None
    }

    /// Another member than `node` that is stopping (SIGTERM), if any.
    pub fn stopping_peer(&self, node: NodeId) -> Option<NodeId> {
        self.draining.iter().copied().find(|&id| id != node && self.is_member(id))
    }

    pub(super) fn enter_maintenance(&mut self, node: NodeId, since_ms: u64, until_ms: u64) -> CommandResponse {
        if let Some(refusal) = self.maintenance_refusal(node) {
            return rejected(&refusal.to_string());
        }
        self.maintenance = Some(Maintenance { node, heir: 0, since_ms, until_ms, phase: MaintenancePhase::Preparing });
        CommandResponse::Done
    }

    /// The member preparing for maintenance holds nobody's only complete replica any more and
    /// its own is complete at `checked` (the heir and its holding period): it goes away.
    pub(super) fn maintenance_ready(&mut self, node: NodeId, checked: (NodeId, u64)) -> CommandResponse {
        match &self.maintenance {
            Some(m) if m.node == node && m.phase == MaintenancePhase::Preparing => {}
            _ => return rejected(&format!("node {node} is not preparing for maintenance")),
        }
        if let Some(owner) = self.held_by(node) {
            return rejected(&MaintenanceRefusal::StillHolding { holder: node, owner }.to_string());
        }
        if let Some(peer) = self.stopping_peer(node) {
            return rejected(&MaintenanceRefusal::PeerStopping(peer).to_string());
        }
        if self.heir_of(node) != Some(checked.0) || self.replica_period(node, checked.0) != Some(checked.1) {
            return rejected(&MaintenanceRefusal::HolderChanged(node).to_string());
        }
        // The map it owns now stays the target: nothing is rebalanced, and when it comes back
        // it pulls its buckets back from the heir like a joiner.
        let mut home = DistributionMap { version: 0, owners: self.map.owners.clone() };
        let handed: Vec<u16> = self.map.buckets_of(node).iter().map(|b| b.0).collect();
        self.promote_all(node, checked.0);
        self.away_promotions.extend(handed);
        // A version names one map: the target's is above the serving map's.
        home.version = self.map.version + 1;
        self.target = Some(home);
        self.transfer_flag = true;
        // Its memory goes with its process: it holds no replica when it comes back.
        self.forget_holdings_of(node);
        if let Some(m) = self.maintenance.as_mut() {
            m.heir = checked.0;
            m.phase = MaintenancePhase::Away;
        }
        CommandResponse::MapChanged { map_version: self.map.version }
    }

    /// Ends the maintenance of `node` (an operator ends it early, or its time ran out): if it
    /// is still away, the cluster no longer spares it.
    pub(super) fn end_maintenance(&mut self, node: NodeId) -> CommandResponse {
        match &self.maintenance {
            Some(m) if m.node == node => {
                self.maintenance = None;
                CommandResponse::Done
            }
            _ => rejected(&format!("node {node} is not in maintenance")),
        }
    }

    /// The member in maintenance says it runs again: it takes its buckets back. (Said while
    /// it prepares, it restarted before it went away: the maintenance ends.)
    pub(super) fn maintenance_returned(&mut self, node: NodeId) {
        let phase = self.maintenance.as_ref().filter(|m| m.node == node).map(|m| m.phase);
        match phase {
            Some(MaintenancePhase::Away) => {
                if let Some(m) = self.maintenance.as_mut() {
                    m.phase = MaintenancePhase::Returned;
                }
            }
            Some(MaintenancePhase::Preparing) => self.maintenance = None,
            _ => {}
        }
    }
}
