//! The replicated control-plane state and the pure function that applies commands to it.
//!
//! [`ClusterState`] is what every node agrees on through Raft: the cluster's identity and
//! settings, the members in join order, the ids that are retired, and the distribution map.
//! [`ClusterState::apply`] is deterministic, so every node that applies the same log reaches
//! the same state. The views (`replica_of`, `desired_voters`) are derived from it, never
//! stored, so they cannot disagree with it.

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

use crate::command::{ClusterCommand, CommandResponse};
use crate::distribution::{rebalance, DistributionMap, NodeId};

/// A member of the cluster.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Member {
    /// The member's id.
    pub id: NodeId,
    /// Its client API address.
    pub api_addr: String,
    /// Its internal (Raft and node-to-node) address.
    pub peer_addr: String,
    /// Its position in join order, counted over the whole life of the cluster (1 for the
    /// first member); increases with every admission, never reused.
    pub join_seq: u64,
}

/// A node that registered (has an id) but is not a member yet.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Registration {
    /// Its client API address.
    pub api_addr: String,
    /// Its internal address.
    pub peer_addr: String,
}

/// Settings fixed when the cluster is bootstrapped.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct ClusterSettings {
    /// How many members vote in Raft: the first `voters` members in join order.
    pub voters: u8,
}

/// The control-plane state replicated by Raft.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct ClusterState {
    /// The cluster's id; `None` until the `Bootstrap` entry is applied.
    pub cluster_id: Option<String>,
    /// Settings from the bootstrap.
    pub settings: ClusterSettings,
    /// The members, in join order.
    pub members: Vec<Member>,
    /// Nodes that registered and are waiting to be admitted.
    pub registered: BTreeMap<NodeId, Registration>,
    /// Ids of members that left; they are never reused and such a node may not come back.
    pub retired: BTreeSet<NodeId>,
    /// The id the next `Register` allocates.
    pub next_node_id: NodeId,
    /// The join sequence the next `Admit` assigns.
    pub next_join_seq: u64,
    /// The distribution map.
    pub map: DistributionMap,
}

impl ClusterState {
    /// Applies one command. Deterministic; a command that does not fit the state is
    /// answered with [`CommandResponse::Rejected`] and changes nothing.
    pub fn apply(&mut self, command: &ClusterCommand) -> CommandResponse {
        match command {
            ClusterCommand::Bootstrap { cluster_id, node_id, api_addr, peer_addr, voters } => {
                if self.cluster_id.is_some() {
                    return rejected("the cluster is already bootstrapped");
                }
                self.cluster_id = Some(cluster_id.clone());
                self.settings.voters = *voters;
                self.members = vec![Member {
                    id: *node_id,
                    api_addr: api_addr.clone(),
                    peer_addr: peer_addr.clone(),
                    join_seq: 1,
                }];
                self.next_node_id = node_id + 1;
                self.next_join_seq = 2;
                self.map = rebalance(&self.map, &[*node_id]);
                CommandResponse::MapChanged { map_version: self.map.version }
            }
            ClusterCommand::Register { api_addr, peer_addr } => {
                if self.cluster_id.is_none() {
                    return rejected("the cluster is not bootstrapped");
                }
                if let Some(m) = self.members.iter().find(|m| &m.api_addr == api_addr || &m.peer_addr == peer_addr) {
                    return rejected(&format!("address already used by member {}", m.id));
                }
                // A joiner that crashed and registers again gets a fresh id; drop its old one.
                self.registered.retain(|_, r| &r.api_addr != api_addr && &r.peer_addr != peer_addr);
                let node_id = self.next_node_id;
                self.next_node_id += 1;
                self.registered
                    .insert(node_id, Registration { api_addr: api_addr.clone(), peer_addr: peer_addr.clone() });
                CommandResponse::Registered { node_id }
            }
            ClusterCommand::Admit { node_id } => {
                if self.is_member(*node_id) {
                    return CommandResponse::MapChanged { map_version: self.map.version };
                }
                let Some(reg) = self.registered.remove(node_id) else {
                    return rejected(&format!("node {node_id} is not registered"));
                };
                self.members.push(Member {
                    id: *node_id,
                    api_addr: reg.api_addr,
                    peer_addr: reg.peer_addr,
                    join_seq: self.next_join_seq,
                });
                self.next_join_seq += 1;
                self.remap()
            }
            ClusterCommand::Remove { node_id } => {
                if !self.is_member(*node_id) {
                    self.registered.remove(node_id);
                    return rejected(&format!("node {node_id} is not a member"));
                }
                if self.members.len() == 1 {
                    return rejected("the last member cannot leave");
                }
                self.members.retain(|m| m.id != *node_id);
                self.retired.insert(*node_id);
                self.remap()
            }
        }
    }

    fn remap(&mut self) -> CommandResponse {
        self.map = rebalance(&self.map, &self.member_ids());
        CommandResponse::MapChanged { map_version: self.map.version }
    }

    /// Whether `id` is a current member.
    pub fn is_member(&self, id: NodeId) -> bool {
        self.members.iter().any(|m| m.id == id)
    }

    /// The member with id `id`.
    pub fn member_of(&self, id: NodeId) -> Option<&Member> {
        self.members.iter().find(|m| m.id == id)
    }

    /// The member ids in join order.
    pub fn member_ids(&self) -> Vec<NodeId> {
        self.members.iter().map(|m| m.id).collect()
    }

    /// The member that holds `id`'s replica: the next member in join order, the first member
    /// for the last one (R13). `None` in a one-node cluster or for a non-member.
    pub fn replica_of(&self, id: NodeId) -> Option<NodeId> {
        if self.members.len() < 2 {
            return None;
        }
        let pos = self.members.iter().position(|m| m.id == id)?;
        Some(self.members[(pos + 1) % self.members.len()].id)
    }

    /// The members that should vote in Raft: the first `settings.voters` in join order.
    pub fn desired_voters(&self) -> BTreeSet<NodeId> {
        self.members.iter().take(usize::from(self.settings.voters.max(1))).map(|m| m.id).collect()
    }
}

fn rejected(reason: &str) -> CommandResponse {
    CommandResponse::Rejected { reason: reason.to_string() }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bootstrapped(voters: u8) -> ClusterState {
        let mut s = ClusterState::default();
        s.apply(&ClusterCommand::Bootstrap {
            cluster_id: "c".into(),
            node_id: 1,
            api_addr: "a1".into(),
            peer_addr: "p1".into(),
            voters,
        });
        s
    }

    fn join(s: &mut ClusterState, n: u32) -> NodeId {
        let CommandResponse::Registered { node_id } =
            s.apply(&ClusterCommand::Register { api_addr: format!("a{n}"), peer_addr: format!("p{n}") })
        else {
            panic!("register failed")
        };
        assert!(matches!(s.apply(&ClusterCommand::Admit { node_id }), CommandResponse::MapChanged { .. }));
        node_id
    }

    #[test]
    fn replica_on_follows_join_order_and_wraps_to_the_first() {
        let mut s = bootstrapped(3);
        assert_eq!(s.replica_of(1), None);
        join(&mut s, 2);
        join(&mut s, 3);
        assert_eq!((s.replica_of(1), s.replica_of(2), s.replica_of(3)), (Some(2), Some(3), Some(1)));
        s.apply(&ClusterCommand::Remove { node_id: 2 });
        assert_eq!((s.replica_of(1), s.replica_of(3)), (Some(3), Some(1)));
    }

    #[test]
    fn ids_are_never_reused_and_retired_ids_cannot_be_admitted() {
        let mut s = bootstrapped(3);
        let two = join(&mut s, 2);
        s.apply(&ClusterCommand::Remove { node_id: two });
        let three = join(&mut s, 3);
        assert!(three > two);
        assert!(matches!(s.apply(&ClusterCommand::Admit { node_id: two }), CommandResponse::Rejected { .. }));
        assert!(s.retired.contains(&two));
    }

    #[test]
    fn the_oldest_learner_becomes_a_voter_when_a_voter_leaves() {
        let mut s = bootstrapped(3);
        for n in 2..=6 {
            join(&mut s, n);
        }
        assert_eq!(s.desired_voters(), BTreeSet::from([1, 2, 3]));
        s.apply(&ClusterCommand::Remove { node_id: 2 });
        assert_eq!(s.desired_voters(), BTreeSet::from([1, 3, 4]));
    }

    #[test]
    fn the_last_member_cannot_leave_and_rejections_change_nothing() {
        let mut s = bootstrapped(3);
        let before = s.clone();
        assert!(matches!(s.apply(&ClusterCommand::Remove { node_id: 1 }), CommandResponse::Rejected { .. }));
        assert!(matches!(s.apply(&ClusterCommand::Admit { node_id: 9 }), CommandResponse::Rejected { .. }));
        assert_eq!(s, before);
    }

    #[test]
    fn every_membership_change_bumps_the_map_version_and_keeps_it_valid() {
        let mut s = bootstrapped(3);
        assert_eq!(s.map.version, 1);
        join(&mut s, 2);
        assert_eq!(s.map.version, 2);
        s.map.check(&s.member_ids()).expect("valid");
        s.apply(&ClusterCommand::Remove { node_id: 1 });
        assert_eq!(s.map.version, 3);
        s.map.check(&s.member_ids()).expect("valid");
        assert_eq!(s.map.counts().get(&2), Some(&1000));
    }
}
