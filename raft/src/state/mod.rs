//! The replicated control-plane state and the pure function that applies commands to it.
//!
//! [`ClusterState`] is what every node agrees on through Raft: the cluster's identity and
//! settings, the members in join order, the ids that are retired, the map of who serves each
//! bucket now, and — while membership changes — the pending map of a transition and the
//! target map that state transfer is moving buckets towards. [`ClusterState::apply`] is
//! deterministic, so every node that applies the same log reaches the same state. The views
//! (`replica_of`, `desired_voters`, `incoming_of`) are derived from it, never stored, so they
//! cannot disagree with it.
//!
//! # Layout
//! - `membership.rs`: bootstrap, register, admit, remove.
//! - `transfer.rs`: the transition (acks, end), bucket moves, completion.
//! - `failover.rs`: failed members, hand-over of a leaver, promotion of replicas, lost buckets.
//! - `maintenance.rs`: a member away for a while, its buckets served by its replica holder.

mod epochs;
mod failover;
mod maintenance;
mod membership;
#[cfg(test)]
mod tests;
mod transfer;

pub use epochs::BucketEpochs;

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

pub use crate::command::ReplicationMode;
use crate::command::{ClusterCommand, CommandResponse};
use crate::distribution::{BucketId, DistributionMap, NodeId, BUCKET_COUNT};

pub use maintenance::{Maintenance, MaintenancePhase, MaintenanceRefusal};

/// A member of the cluster.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Member {
    /// The member's id.
    pub id: NodeId,
    /// Its client API address.
    pub api_addr: String,
    /// Its internal (Raft and node-to-node) address.
    pub peer_addr: String,
    /// Its name for people and tools (the pod name in a StatefulSet), if it gave one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// Its position in join order, counted over the whole life of the cluster (1 for the
    /// first member); increases with every admission, never reused.
    pub join_seq: u64,
    /// Leaving: it owns nothing in the pending or target map, serves its buckets until they
    /// have moved, and is retired once it serves none.
    #[serde(default)]
    pub leaving: bool,
}

/// A node that registered (has an id) but is not a member yet.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Registration {
    /// Its client API address.
    pub api_addr: String,
    /// Its internal address.
    pub peer_addr: String,
    /// Its name, if it gave one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

/// Cluster-wide settings: fixed at bootstrap, some changed later through Raft.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct ClusterSettings {
    /// How many members vote in Raft: the first `voters` members in join order.
    pub voters: u8,
    /// How writes reach replicas.
    #[serde(default)]
    pub replication: ReplicationMode,
    /// Whether the leader balances the map by data by itself when the fullest member holds
    /// more than 1.5 times what the emptiest holds. Off unless turned on.
    #[serde(default)]
    pub auto_balance: bool,
}

/// A membership change waiting for every member to apply its pending map.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Transition {
    /// The serving map's version when the transition started.
    pub from_version: u64,
    /// The pending map.
    pub to: DistributionMap,
    /// The members that have applied it.
    pub acked: BTreeSet<NodeId>,
}

/// The control-plane state replicated by Raft.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct ClusterState {
    /// The cluster's id; `None` until the `Bootstrap` entry is applied.
    pub cluster_id: Option<String>,
    /// Settings from the bootstrap.
    pub settings: ClusterSettings,
    /// The members, in join order (leaving ones included until retired).
    pub members: Vec<Member>,
    /// Nodes that registered and are waiting to be admitted.
    pub registered: BTreeMap<NodeId, Registration>,
    /// Ids of members that left; they are never reused and such a node may not come back.
    pub retired: BTreeSet<NodeId>,
    /// The id the next `Register` allocates.
    pub next_node_id: NodeId,
    /// The join sequence the next `Admit` assigns.
    pub next_join_seq: u64,
    /// Who serves each bucket now. Its version increases with every change, including each
    /// bucket that moves.
    pub map: DistributionMap,
    /// The membership change whose pending map members are acknowledging, if any.
    #[serde(default)]
    pub transition: Option<Transition>,
    /// Where state transfer is moving buckets, if it is not done.
    #[serde(default)]
    pub target: Option<DistributionMap>,
    /// The state-transfer flag: set from the start of a transition until the transfer is
    /// complete (or the stuck detector clears it); membership changes wait while it is set.
    #[serde(default)]
    pub transfer_flag: bool,
    /// Per bucket, how many moves or aborts it has seen: a move proposed against an older
    /// epoch is stale and rejected. Missing means 0.
    #[serde(default)]
    pub bucket_epochs: BucketEpochs,
    /// Buckets moved during the running transfer, and the node that handed each over. That
    /// node keeps a shadow copy, which the new owner writes through to before acknowledging,
    /// so a new owner that crashes before the transfer ends recovers its buckets from it.
    /// Cleared when the transfer is complete.
    #[serde(default)]
    pub handoffs: BTreeMap<u16, NodeId>,
    /// Ids of members declared failed (a majority could not reach them). Like retired ids
    /// they never come back; such a node rejoins as a new member with a new id.
    #[serde(default)]
    pub failed: BTreeSet<NodeId>,
    /// Buckets just given to the member that held their replica (failover or hand-over), and
    /// the member that served them before. The heir turns its replica copy into active data
    /// and reports it (`Promoted`); until then it is the only one that knows whether it
    /// holds a copy.
    #[serde(default)]
    pub promoted: BTreeMap<u16, NodeId>,
    /// Buckets whose active and replica copies are both gone: reads and writes answer
    /// `bucket_lost` until an operator clears them.
    #[serde(default)]
    pub lost: BTreeSet<u16>,
    /// Per promoted or lost bucket, the member that last served it (acknowledged its writes):
    /// a promotion to a heir that never installed it, or of a lost bucket, keeps the one
    /// before. A lost bucket's last server, failed while it was cut off, returns with the
    /// newest copy there is and gives it back (`Found`).
    #[serde(default)]
    pub last_server: BTreeMap<u16, NodeId>,
    /// Members that are stopping (SIGTERM), until they run again. They keep their Raft vote; a
    /// stopping leader's successor (`successor_of`) takes the lead.
    #[serde(default)]
    pub draining: BTreeSet<NodeId>,
    /// Failed members that were stopping (SIGTERM) when they were failed: their process ended,
    /// so their data died with it. A promoted bucket of theirs of which the heir holds no copy
    /// had every copy die (the heir restarted too: a full stop) and serves again, empty,
    /// instead of being lost until an operator clears it.
    #[serde(default)]
    pub failed_stopped: BTreeSet<NodeId>,
    /// Buckets a maintenance handed to the member's heir that the heir has not reported
    /// installed yet: the member keeps nothing while away, so if the heir restarted meanwhile
    /// no copy is left, and they serve again, empty (not lost).
    #[serde(default)]
    pub away_promotions: BTreeSet<u16>,
    /// Each bucket's bytes as the leader last recorded them before a membership change
    /// (`RecordSizes`; empty: never): the maps of joins, leaves and failures balance them.
    #[serde(default)]
    pub bucket_sizes: Vec<u64>,
    /// Per member, the member that holds its replica: it has every write the member
    /// acknowledged, and inherits the member's buckets if it fails. It changes only when the
    /// member has attached all its buckets at the holder join order names (`ReplicaMoved`), so
    /// a change of membership never leaves a member without a complete replica. Missing: the
    /// member has no such holder yet (it just joined a one-node cluster, or its holder left or
    /// failed); its writes go to the holder join order names, which inherits its buckets.
    #[serde(default)]
    pub replica_holders: BTreeMap<NodeId, NodeId>,
    /// Per member, each member holding its replica now (the complete holder and the one join
    /// order names) and the holding period it is in: a number that changes whenever the
    /// holder starts holding again after it stopped (and so dropped its copy). An owner counts
    /// a bucket sent to a holder only within the period it was sent in. Derived after every
    /// command from the views above and stored, because a node may skip states between two
    /// looks and must still see that a holder stopped and started again.
    #[serde(default)]
    pub replica_periods: BTreeMap<NodeId, BTreeMap<NodeId, u64>>,
    /// The number the next holding period gets; only increases.
    #[serde(default)]
    pub next_replica_period: u64,
    /// The member in maintenance, if any (one at a time): the holder of its replica serves its
    /// buckets and the target map gives them back to it when it returns.
    #[serde(default)]
    pub maintenance: Option<Maintenance>,
}

impl ClusterState {
    /// Applies one command. Deterministic; a command that does not fit the state is
    /// answered with [`CommandResponse::Rejected`] (or `Busy`) and changes nothing.
    pub fn apply(&mut self, command: &ClusterCommand) -> CommandResponse {
        let response = self.apply_command(command);
        self.track_replica_periods();
        response
    }

    fn apply_command(&mut self, command: &ClusterCommand) -> CommandResponse {
        match command {
            ClusterCommand::Bootstrap { cluster_id, node_id, api_addr, peer_addr, name, voters, replication } => {
                let first = Member {
                    id: *node_id,
                    api_addr: api_addr.clone(),
                    peer_addr: peer_addr.clone(),
                    name: name.clone(),
                    join_seq: 1,
                    leaving: false,
                };
                self.bootstrap(cluster_id, first, *voters, *replication)
            }
            ClusterCommand::SetReplication { mode } => {
                if self.cluster_id.is_none() {
                    return rejected("the cluster is not bootstrapped");
                }
                self.settings.replication = *mode;
                CommandResponse::Done
            }
            ClusterCommand::SetAutoBalance { enabled } => {
                if self.cluster_id.is_none() {
                    return rejected("the cluster is not bootstrapped");
                }
                self.settings.auto_balance = *enabled;
                CommandResponse::Done
            }
            ClusterCommand::Rebalance { from_version, owners } => self.rebalance_to(*from_version, owners),
            ClusterCommand::RecordSizes { sizes } => {
                if sizes.len() != BUCKET_COUNT {
                    return rejected(&format!("sizes of {BUCKET_COUNT} buckets, not {}", sizes.len()));
                }
                self.bucket_sizes = sizes.clone();
                CommandResponse::Done
            }
            ClusterCommand::NodeFailed { node_id } => self.node_failed(*node_id),
            ClusterCommand::HandOver { node_id, heir } => self.hand_over(*node_id, *heir),
            ClusterCommand::Promoted { node_id, buckets, lost } => self.promoted(*node_id, buckets, lost),
            ClusterCommand::ClearLost { buckets } => self.clear_lost(buckets),
            ClusterCommand::Found { owner, from, buckets, heir } => self.found(*owner, *from, buckets, *heir),
            ClusterCommand::ReplicaMoved { owner, holder } => self.replica_moved(*owner, *holder),
            ClusterCommand::BucketsLost { node_id, buckets } => self.buckets_lost(*node_id, buckets),
            ClusterCommand::SetDraining { node_id, draining } => {
                if !self.is_member(*node_id) {
                    return rejected(&format!("node {node_id} is not a member"));
                }
                if *draining {
                    self.draining.insert(*node_id);
                } else {
                    self.draining.remove(node_id);
                    self.maintenance_returned(*node_id);
                }
                CommandResponse::Done
            }
            ClusterCommand::Register { api_addr, peer_addr, name } => {
                let registration =
                    Registration { api_addr: api_addr.clone(), peer_addr: peer_addr.clone(), name: name.clone() };
                self.register(registration)
            }
            ClusterCommand::Admit { node_id, force } => self.admit(*node_id, *force),
            ClusterCommand::Remove { node_id, force } => self.remove(*node_id, *force),
            ClusterCommand::AckTransition { node_id, to_version } => self.ack_transition(*node_id, *to_version),
            ClusterCommand::EndTransition { to_version } => self.end_transition(*to_version),
            ClusterCommand::BucketMoved { bucket, from, to, epoch } => self.bucket_moved(*bucket, *from, *to, *epoch),
            ClusterCommand::AbortMove { bucket, epoch } => self.abort_move(*bucket, *epoch),
            ClusterCommand::EnterMaintenance { node_id, since_ms, until_ms } => {
                self.enter_maintenance(*node_id, *since_ms, *until_ms)
            }
            ClusterCommand::MaintenanceReady { node_id, heir } => self.maintenance_ready(*node_id, *heir),
            ClusterCommand::EndMaintenance { node_id, .. } => self.end_maintenance(*node_id),
            ClusterCommand::ClearTransferFlag { .. } => {
                self.transfer_flag = false;
                CommandResponse::Done
            }
        }
    }

    /// Whether `id` is a current member (leaving ones included).
    pub fn is_member(&self, id: NodeId) -> bool {
        self.members.iter().any(|m| m.id == id)
    }

    /// The member with id `id`.
    pub fn member_of(&self, id: NodeId) -> Option<&Member> {
        self.members.iter().find(|m| m.id == id)
    }

    /// The member ids in join order (leaving ones included).
    pub fn member_ids(&self) -> Vec<NodeId> {
        self.members.iter().map(|m| m.id).collect()
    }

    /// The members that are not leaving, in join order: the ones maps are made for.
    pub fn active_ids(&self) -> Vec<NodeId> {
        self.members.iter().filter(|m| !m.leaving).map(|m| m.id).collect()
    }

    /// The member that holds `id`'s replica: the next member in join order, the first for
    /// the last one. `None` in a one-node cluster or for a non-member. A leaving member
    /// keeps its place in the ring until it is retired, so replicas stay where they are
    /// while it drains. A member preparing for maintenance or away is skipped: it will hold
    /// nothing.
    pub fn replica_of(&self, id: NodeId) -> Option<NodeId> {
        let n = self.members.len();
        if n < 2 {
            return None;
        }
        let pos = self.members.iter().position(|m| m.id == id)?;
        let skipped = self.skipped();
        (1..n).map(|k| self.members[(pos + k) % n].id).find(|&h| Some(h) != skipped)
    }

    /// The member that holds `id`'s complete replica now (see `replica_holders`), if any.
    pub fn committed_holder_of(&self, id: NodeId) -> Option<NodeId> {
        let away = self.away();
        self.replica_holders.get(&id).copied().filter(|&h| h != id && self.is_member(h) && Some(h) != away)
    }

    /// The member that inherits `id`'s buckets if it fails or hands them over: the holder of
    /// its complete replica, else the one join order names.
    pub fn heir_of(&self, id: NodeId) -> Option<NodeId> {
        self.committed_holder_of(id).or_else(|| self.replica_of(id))
    }

    /// The holding period in which `holder` holds `owner`'s replica now (see
    /// `replica_periods`); `None` when it holds none.
    pub fn replica_period(&self, owner: NodeId, holder: NodeId) -> Option<u64> {
        self.replica_periods.get(&owner)?.get(&holder).copied()
    }

    /// Brings `replica_periods` up to date with the holders of every member: a holder that
    /// kept holding keeps its period, a new one gets a new period, and one that stopped is
    /// forgotten.
    fn track_replica_periods(&mut self) {
        let mut periods = BTreeMap::new();
        for owner in self.member_ids() {
            let mut held = BTreeMap::new();
            for holder in [self.committed_holder_of(owner), self.replica_of(owner)].into_iter().flatten() {
                let period = match self.replica_period(owner, holder) {
                    Some(p) => p,
                    None => {
                        self.next_replica_period += 1;
                        self.next_replica_period
                    }
                };
                held.insert(holder, period);
            }
            if !held.is_empty() {
                periods.insert(owner, held);
            }
        }
        self.replica_periods = periods;
    }

    /// Forgets the replica holdings of a member that is gone (failed or retired): as owner
    /// and as holder.
    pub(crate) fn forget_holdings_of(&mut self, id: NodeId) {
        self.replica_holders.remove(&id);
        self.replica_holders.retain(|_, h| *h != id);
    }

    /// The members that should vote in Raft: the first `settings.voters` active members in
    /// join order. A stopping member keeps its vote: taking it away would shrink the voters as
    /// members stop, and after a full stop the ones that come back could not form a majority.
    pub fn desired_voters(&self) -> BTreeSet<NodeId> {
        let n = usize::from(self.settings.voters.max(1));
        self.active_ids().into_iter().take(n).collect()
    }

    /// The voters `desired_voters` names once `command` is applied, if it changes them (and
    /// the command is not refused).
    pub fn voters_after(&self, command: &ClusterCommand) -> Option<BTreeSet<NodeId>> {
        let mut next = self.clone();
        if matches!(next.apply(command), CommandResponse::Rejected { .. } | CommandResponse::Busy { .. }) {
            return None;
        }
        let voters = next.desired_voters();
        (voters != self.desired_voters()).then_some(voters)
    }

    /// The voter that takes the lead from `leader` when it stops: the next voter after it in
    /// join order (wrapping) that is not stopping itself; `None` if every other one is.
    pub fn successor_of(&self, leader: NodeId) -> Option<NodeId> {
        let voters = self.desired_voters();
        let ring: Vec<NodeId> = self.member_ids().into_iter().filter(|id| voters.contains(id)).collect();
        let pos = ring.iter().position(|&id| id == leader).unwrap_or(ring.len());
        (1..=ring.len()).map(|k| ring[(pos + k) % ring.len()]).find(|&id| id != leader && !self.draining.contains(&id))
    }

    /// Why the map cannot be balanced now, if it cannot: a membership change, a transfer
    /// (even one whose flag the stuck detector cleared) or a maintenance runs.
    pub fn balance_busy(&self) -> Option<String> {
        if let Some(busy) = self.membership_busy() {
            return Some(busy);
        }
        if self.transition.is_some() || self.target.is_some() {
            let left = self.target.as_ref().map_or(0, |t| self.map.moved_buckets(t).len());
            return Some(format!("state transfer is moving {left} buckets"));
        }
        None
    }

    /// Whether a membership change must wait: the state-transfer flag is set (a transition
    /// or a transfer runs, and the stuck detector has not cleared the flag).
    pub fn membership_busy(&self) -> Option<String> {
        if let Some(m) = &self.maintenance {
            return Some(format!("node {} is in maintenance", m.node));
        }
        if !self.transfer_flag {
            return None;
        }
        if let Some(t) = &self.transition {
            return Some(format!(
                "a transition to map version {} is waiting for {} of {} members",
                t.to.version,
                self.members.len() - t.acked.len(),
                self.members.len()
            ));
        }
        let left = self.target.as_ref().map_or(0, |t| self.map.moved_buckets(t).len());
        Some(format!("state transfer is moving {left} buckets"))
    }

    /// The warning a membership change forced through a running one carries (None unless
    /// `force` and something runs): what it was forced through and what that risks.
    pub fn forced_warning(&self, force: bool) -> Option<String> {
        let busy = self.membership_busy().filter(|_| force)?;
        Some(match &self.maintenance {
            Some(m) => format!(
                "forced while {busy}: the maintenance ends, and node {} is failed if it does not answer",
                m.node
            ),
            None => format!(
                "forced while {busy}: until the transfer ends, a failure of a node holding buckets in flight can lose their data"
            ),
        })
    }

    /// The buckets `node` should receive: the target gives them to it, another node serves
    /// them now. Each comes with its current server and move epoch.
    /// A member in maintenance gets nothing until it returns.
    pub fn incoming_of(&self, node: NodeId) -> Vec<(BucketId, NodeId, u64)> {
        if self.target.is_none() {
            return Vec::new();
        }
        BucketId::all().filter_map(|b| self.incoming_from(b, node).map(|from| (b, from, self.epoch_of(b)))).collect()
    }

    /// The node `node` pulls `bucket` from, if the target gives it `bucket` (and it is not away
    /// in maintenance): the bucket's owner in the serving map.
    pub fn incoming_from(&self, bucket: BucketId, node: NodeId) -> Option<NodeId> {
        let target = self.target.as_ref().filter(|_| self.away() != Some(node))?;
        let from = self.map.owner_of(bucket)?;
        (target.owner_of(bucket)? == node && from != node).then_some(from)
    }

    /// The node holding the shadow copy of `bucket`, if it moved during the running transfer
    /// (and is not served by that node again).
    pub fn shadow_of(&self, bucket: BucketId) -> Option<NodeId> {
        self.handoffs.get(&bucket.0).copied().filter(|&n| self.map.owner_of(bucket) != Some(n))
    }

    /// The move epoch of `bucket`.
    pub fn epoch_of(&self, bucket: BucketId) -> u64 {
        self.bucket_epochs.get(bucket)
    }
}

fn rejected(reason: &str) -> CommandResponse {
    CommandResponse::Rejected { reason: reason.to_string() }
}
