//! The cluster's event log: what happened to the cluster (joins, leaves, transitions, bucket
//! moves, failures and promotions, lost buckets, maintenance, settings), derived from the Raft
//! log.
//!
//! [`EventRecorder::record`] is a pure function of one applied entry — the command, its
//! response, the state before and after, the entry's index and the time its proposer stamped
//! on it — so every node derives the same events, and a node that replays its log after a
//! restart derives them again. Bucket moves come one entry each; they are gathered into one
//! `buckets_moved` event of at most [`MOVE_BATCH`] buckets, closed by the entry that fills it,
//! by the next other event, or by the end of the transfer. The batch being gathered is part of
//! the persisted state machine, so a restart does not lose it.
//!
//! The log keeps the last [`EVENT_RETENTION`] events; a snapshot carries them, so a node that
//! catches up from a snapshot answers the same history as the others.

use serde::{Deserialize, Serialize};

use crate::command::{ClusterCommand, CommandResponse};
use crate::distribution::NodeId;
use crate::state::{ClusterState, MaintenancePhase};

/// How many events the log keeps (the oldest go first).
pub const EVENT_RETENTION: usize = 10_000;

/// The most buckets one `buckets_moved` event lists.
pub const MOVE_BATCH: usize = 100;

/// What kind of thing happened.
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EventKind {
    /// The first member created the cluster.
    ClusterCreated,
    /// A node became a member.
    NodeJoined,
    /// A member started leaving.
    NodeLeaving,
    /// A leaving member handed everything over and is gone.
    NodeLeft,
    /// A majority could not reach a member: it is failed.
    NodeFailed,
    /// A member is stopping (SIGTERM).
    NodeStopping,
    /// A stopping member runs again.
    NodeRunning,
    /// A leaving member's buckets are served by its replica holder.
    HandedOver,
    /// A member turned its replica copies of another's buckets into active data.
    Promoted,
    /// Buckets lost both copies.
    BucketsLost,
    /// Lost buckets serve again with the copy their last server gave back.
    BucketsFound,
    /// An operator cleared lost buckets: they serve again, empty.
    LostCleared,
    /// A member's replica is now held by another member.
    ReplicaMoved,
    /// A transition to a new map began.
    TransitionBegun,
    /// Every member applied the pending map: state transfer starts.
    TransitionEnded,
    /// Buckets moved to their new owners.
    BucketsMoved,
    /// A bucket's move was given up (it is retried).
    MoveAborted,
    /// Every bucket reached the target map.
    TransferEnded,
    /// The stuck-transfer detector let membership change again.
    TransferUnblocked,
    /// A map balanced by data was planned.
    RebalanceBegun,
    /// A cluster setting changed.
    ConfigChanged,
    /// A member prepares for maintenance.
    MaintenanceEntered,
    /// The member in maintenance is away; its replica holder serves its buckets.
    MaintenanceAway,
    /// The member in maintenance runs again and takes its buckets back.
    MaintenanceReturned,
    /// The maintenance is over.
    MaintenanceEnded,
}

/// Buckets that moved from one member to another.
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MoveGroup {
    /// The member that served them.
    pub from: NodeId,
    /// The member that serves them now.
    pub to: NodeId,
    /// The buckets, in the order they moved.
    pub buckets: Vec<u16>,
}

/// One event of the log.
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Event {
    /// The Raft index of the entry that produced it (for a batch of moves: the entry that
    /// closed the batch; its moves are `first_index` up to here).
    pub index: u64,
    /// When the entry was proposed, in milliseconds since the Unix epoch (the proposer's clock;
    /// 0 for entries written by versions that did not stamp them).
    pub time_ms: u64,
    /// The serving map's version after the entry.
    pub map_version: u64,
    /// What happened.
    #[serde(rename = "type")]
    pub kind: EventKind,
    /// The member concerned, if one is.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node: Option<NodeId>,
    /// The other member concerned (the heir, the new replica holder, the returned server).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub peer: Option<NodeId>,
    /// The buckets concerned (lost, found, cleared, aborted, promoted).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub buckets: Vec<u16>,
    /// For `buckets_moved`: the moves, grouped by members.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub moves: Vec<MoveGroup>,
    /// For `buckets_moved`: the index of the first move of the batch.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub first_index: Option<u64>,
    /// What happened, in words.
    pub message: String,
}

/// Moves applied since the last `buckets_moved` event.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PendingMoves {
    first_index: u64,
    count: usize,
    groups: Vec<MoveGroup>,
}

impl PendingMoves {
    fn add(&mut self, index: u64, bucket: u16, from: NodeId, to: NodeId) {
        if self.count == 0 {
            self.first_index = index;
        }
        self.count += 1;
        match self.groups.iter_mut().find(|g| g.from == from && g.to == to) {
            Some(g) => g.buckets.push(bucket),
            None => self.groups.push(MoveGroup { from, to, buckets: vec![bucket] }),
        }
    }
}

/// Derives events from applied entries; holds the batch of moves being gathered.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct EventRecorder {
    /// The moves not yet in an event.
    #[serde(default)]
    pending: PendingMoves,
}

/// An event before it gets its entry's index, time and map version.
struct Draft {
    kind: EventKind,
    node: Option<NodeId>,
    peer: Option<NodeId>,
    buckets: Vec<u16>,
    message: String,
}

fn draft(kind: EventKind, node: Option<NodeId>, message: String) -> Draft {
    Draft { kind, node, peer: None, buckets: Vec::new(), message }
}

impl Draft {
    fn peer(mut self, peer: Option<NodeId>) -> Self {
        self.peer = peer;
        self
    }

    fn buckets(mut self, buckets: Vec<u16>) -> Self {
        self.buckets = buckets;
        self
    }
}

fn name_of(state: &ClusterState, id: NodeId) -> String {
    match state.member_of(id).and_then(|m| m.name.as_deref()) {
        Some(name) => format!("node {id} ({name})"),
        None => format!("node {id}"),
    }
}

fn list(buckets: &[u16]) -> String {
    const SHOWN: usize = 10;
    let mut text = buckets.iter().take(SHOWN).map(u16::to_string).collect::<Vec<_>>().join(", ");
    if buckets.len() > SHOWN {
        text.push_str(&format!(" and {} more", buckets.len() - SHOWN));
    }
    text
}

impl EventRecorder {
    /// The events of one applied entry: `command` took `before` to `after` and answered
    /// `response`; the entry has Raft index `index` and was proposed at `time_ms`.
    pub fn record(
        &mut self,
        index: u64,
        time_ms: u64,
        before: &ClusterState,
        command: &ClusterCommand,
        response: &CommandResponse,
        after: &ClusterState,
    ) -> Vec<Event> {
        let refused = matches!(response, CommandResponse::Rejected { .. } | CommandResponse::Busy { .. });
        if refused {
            return Vec::new();
        }
        let mut drafts = Vec::new();
        if let ClusterCommand::BucketMoved { bucket, from, to, .. } = command {
            self.pending.add(index, *bucket, *from, *to);
        } else {
            drafts.extend(command_event(before, command, response, after));
        }
        drafts.extend(state_events(before, command, after));
        let mut events = Vec::new();
        let close = self.pending.count >= MOVE_BATCH || (self.pending.count > 0 && !drafts.is_empty());
        if close {
            let pending = std::mem::take(&mut self.pending);
            let message = format!(
                "{} buckets moved: {}",
                pending.count,
                pending
                    .groups
                    .iter()
                    .map(|g| format!("{} from node {} to node {}", g.buckets.len(), g.from, g.to))
                    .collect::<Vec<_>>()
                    .join(", ")
            );
            events.push(Event {
                index,
                time_ms,
                map_version: after.map.version,
                kind: EventKind::BucketsMoved,
                node: None,
                peer: None,
                buckets: Vec::new(),
                moves: pending.groups,
                first_index: Some(pending.first_index),
                message,
            });
        }
        events.extend(drafts.into_iter().map(|d| Event {
            index,
            time_ms,
            map_version: after.map.version,
            kind: d.kind,
            node: d.node,
            peer: d.peer,
            buckets: d.buckets,
            moves: Vec::new(),
            first_index: None,
            message: d.message,
        }));
        events
    }
}

/// The event named by the command itself, if it changed anything.
fn command_event(
    before: &ClusterState,
    command: &ClusterCommand,
    response: &CommandResponse,
    after: &ClusterState,
) -> Option<Draft> {
    use ClusterCommand as C;
    use EventKind as K;
    Some(match command {
        C::Bootstrap { cluster_id, node_id, .. } if before.cluster_id.is_none() => draft(
            K::ClusterCreated,
            Some(*node_id),
            format!("cluster {cluster_id} created by {}", name_of(after, *node_id)),
        ),
        C::SetReplication { mode } if before.settings.replication != *mode => {
            draft(K::ConfigChanged, None, format!("replication set to {mode}"))
        }
        C::SetAutoBalance { enabled } if before.settings.auto_balance != *enabled => {
            draft(K::ConfigChanged, None, format!("automatic balancing turned {}", if *enabled { "on" } else { "off" }))
        }
        C::Rebalance { from_version, .. } => {
            let moving = after.transition.as_ref().map_or(0, |t| after.map.moved_buckets(&t.to).len());
            let message = format!("balancing by data planned on map {from_version}: {moving} buckets to move");
            draft(K::RebalanceBegun, None, message)
        }
        C::Found { owner, from, buckets, .. } => {
            let found: Vec<u16> =
                buckets.iter().copied().filter(|b| before.lost.contains(b) && !after.lost.contains(b)).collect();
            if found.is_empty() {
                return None;
            }
            let message = format!("buckets {} serve again with the copy node {from} gave back", list(&found));
            draft(K::BucketsFound, Some(*owner), message).peer(Some(*from)).buckets(found)
        }
        C::ClearLost { .. } => {
            let CommandResponse::Cleared { buckets } = response else { return None };
            if buckets.is_empty() {
                return None;
            }
            let message = format!("lost buckets {} cleared: they serve again, empty", list(buckets));
            draft(K::LostCleared, None, message).buckets(buckets.clone())
        }
        C::AbortMove { bucket, .. } => {
            let message = format!("the move of bucket {bucket} was given up; it is retried");
            draft(K::MoveAborted, None, message).buckets(vec![*bucket])
        }
        C::ClearTransferFlag { reason } if before.transfer_flag => draft(
            K::TransferUnblocked,
            None,
            format!("membership may change again while the transfer goes on: {reason}"),
        ),
        _ => return member_event(before, command, after),
    })
}

/// The event of a command about one member, if it changed anything.
fn member_event(before: &ClusterState, command: &ClusterCommand, after: &ClusterState) -> Option<Draft> {
    use ClusterCommand as C;
    use EventKind as K;
    Some(match command {
        C::NodeFailed { node_id } if !before.failed.contains(node_id) => {
            let heir = before.heir_of(*node_id);
            let message = match heir {
                Some(h) => format!("{} failed; node {h} serves its buckets", name_of(before, *node_id)),
                None => format!("{} failed", name_of(before, *node_id)),
            };
            draft(K::NodeFailed, Some(*node_id), message).peer(heir)
        }
        C::HandOver { node_id, .. } => {
            let heir = after.heir_of(*node_id).or_else(|| before.heir_of(*node_id));
            let message = format!("{} handed its buckets over to its replica holder", name_of(before, *node_id));
            draft(K::HandedOver, Some(*node_id), message).peer(heir)
        }
        C::Promoted { node_id, buckets, .. } if !buckets.is_empty() => {
            let message = format!("node {node_id} serves {} buckets from its replica copies", buckets.len());
            draft(K::Promoted, Some(*node_id), message).buckets(buckets.clone())
        }
        C::ReplicaMoved { owner, holder } if before.replica_holders.get(owner) != Some(holder) => {
            draft(K::ReplicaMoved, Some(*owner), format!("node {holder} holds node {owner}'s replica"))
                .peer(Some(*holder))
        }
        C::SetDraining { node_id, draining: true } if !before.draining.contains(node_id) => {
            draft(K::NodeStopping, Some(*node_id), format!("{} is stopping", name_of(before, *node_id)))
        }
        C::SetDraining { node_id, draining: false } if before.draining.contains(node_id) => {
            draft(K::NodeRunning, Some(*node_id), format!("{} runs again", name_of(before, *node_id)))
        }
        C::Admit { node_id, force } if !before.is_member(*node_id) => {
            let warning = before.forced_warning(*force).map_or(String::new(), |w| format!(" ({w})"));
            draft(K::NodeJoined, Some(*node_id), format!("{} joined{warning}", name_of(after, *node_id)))
        }
        C::Remove { node_id, force } if before.member_of(*node_id).is_some_and(|m| !m.leaving) => {
            let warning = before.forced_warning(*force).map_or(String::new(), |w| format!(" ({w})"));
            draft(K::NodeLeaving, Some(*node_id), format!("{} is leaving{warning}", name_of(before, *node_id)))
        }
        _ => return None,
    })
}

/// Events read from the change of state, whatever command caused it.
fn state_events(before: &ClusterState, command: &ClusterCommand, after: &ClusterState) -> Vec<Draft> {
    use EventKind as K;
    let mut drafts = Vec::new();
    if before.transition.is_none() {
        if let Some(t) = &after.transition {
            drafts.push(draft(
                K::TransitionBegun,
                None,
                format!(
                    "transition from map {} to map {} begun: {} buckets change owner",
                    before.map.version,
                    t.to.version,
                    after.map.moved_buckets(&t.to).len()
                ),
            ));
        }
    }
    if before.transition.is_some() && after.transition.is_none() {
        let moving = after.target.as_ref().map_or(0, |t| after.map.moved_buckets(t).len());
        drafts.push(draft(
            K::TransitionEnded,
            None,
            format!("every member applied the new map: state transfer moves {moving} buckets"),
        ));
    }
    for m in &before.members {
        if !after.is_member(m.id) && after.retired.contains(&m.id) {
            drafts.push(draft(K::NodeLeft, Some(m.id), format!("{} left", name_of(before, m.id))));
        }
    }
    let lost: Vec<u16> = after.lost.difference(&before.lost).copied().collect();
    if !lost.is_empty() {
        let mut d =
            draft(K::BucketsLost, None, format!("buckets {} lost both copies: they answer bucket_lost", list(&lost)));
        d.buckets = lost;
        drafts.push(d);
    }
    if before.target.is_some() && after.target.is_none() {
        drafts.push(draft(K::TransferEnded, None, format!("state transfer done at map {}", after.map.version)));
    }
    let phase = |s: &ClusterState| s.maintenance.as_ref().map(|m| (m.node, m.phase));
    match (phase(before), phase(after)) {
        (b, Some((node, p))) if b != Some((node, p)) => {
            let (kind, what) = match p {
                MaintenancePhase::Preparing => (K::MaintenanceEntered, "prepares for maintenance"),
                MaintenancePhase::Away => (K::MaintenanceAway, "is away for maintenance; its replica holder serves"),
                MaintenancePhase::Returned => (K::MaintenanceReturned, "is back from maintenance"),
            };
            let mut d = draft(kind, Some(node), format!("{} {what}", name_of(after, node)));
            d.peer = after.maintenance.as_ref().map(|m| m.heir).filter(|&h| h != node);
            drafts.push(d);
        }
        (Some((node, was)), None) => {
            let why = maintenance_end(node, was, command);
            drafts.push(draft(K::MaintenanceEnded, Some(node), format!("the maintenance of node {node} ended: {why}")));
        }
        _ => {}
    }
    drafts
}

/// Why the maintenance of `node`, in phase `was`, ended with `command`.
fn maintenance_end(node: NodeId, was: MaintenancePhase, command: &ClusterCommand) -> String {
    let forced = |force: bool| if force { "forced " } else { "" };
    let why = match command {
        ClusterCommand::EndMaintenance { reason, .. } => reason.clone(),
        _ if was == MaintenancePhase::Returned => return "it took its buckets back".into(),
        ClusterCommand::SetDraining { node_id, draining: false } if *node_id == node => {
            return "called off: it runs again".into();
        }
        ClusterCommand::NodeFailed { node_id } if *node_id == node => return "it was failed".into(),
        ClusterCommand::NodeFailed { node_id } => format!("the failure of node {node_id}"),
        ClusterCommand::Remove { node_id, force } => format!("the {}leave of node {node_id}", forced(*force)),
        ClusterCommand::Admit { node_id, force } => format!("the {}join of node {node_id}", forced(*force)),
        _ => "a change of the map".to_string(),
    };
    match was {
        MaintenancePhase::Away => format!("{why}; it is still away, and failure detection no longer spares it"),
        _ => why,
    }
}

#[cfg(test)]
mod tests;
