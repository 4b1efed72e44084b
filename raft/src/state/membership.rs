//! Membership commands: bootstrap, register, admit, remove.

use super::{rejected, ClusterState, Member, Registration, ReplicationMode, Transition};
use crate::command::CommandResponse;
use crate::distribution::{rebalance_by_size, DistributionMap, NodeId, BUCKET_COUNT};

impl ClusterState {
    pub(super) fn bootstrap(
        &mut self,
        cluster_id: &str,
        first: Member,
        voters: u8,
        replication: ReplicationMode,
    ) -> CommandResponse {
        if self.cluster_id.is_some() {
            return rejected("the cluster is already bootstrapped");
        }
        self.cluster_id = Some(cluster_id.to_string());
        self.settings.voters = voters;
        self.settings.replication = replication;
        let node_id = first.id;
        self.members = vec![Member { join_seq: 1, leaving: false, ..first }];
        self.next_node_id = node_id + 1;
        self.next_join_seq = 2;
        self.map = DistributionMap::single(node_id);
        CommandResponse::MapChanged { map_version: self.map.version }
    }

    pub(super) fn register(&mut self, joiner: Registration) -> CommandResponse {
        if self.cluster_id.is_none() {
            return rejected("the cluster is not bootstrapped");
        }
        let (api_addr, peer_addr) = (&joiner.api_addr, &joiner.peer_addr);
        if let Some(m) = self.members.iter().find(|m| &m.api_addr == api_addr || &m.peer_addr == peer_addr) {
            return rejected(&format!("address already used by member {}", m.id));
        }
        // A joiner that crashed and registers again gets a fresh id; drop its old one.
        self.registered.retain(|_, r| &r.api_addr != api_addr && &r.peer_addr != peer_addr);
        let node_id = self.next_node_id;
        self.next_node_id += 1;
        self.registered.insert(node_id, joiner);
        CommandResponse::Registered { node_id }
    }

    pub(super) fn admit(&mut self, node_id: NodeId, force: bool) -> CommandResponse {
        if self.is_member(node_id) {
            return CommandResponse::MapChanged { map_version: self.map.version };
        }
        if !self.registered.contains_key(&node_id) {
            return rejected(&format!("node {node_id} is not registered"));
        }
        if let Some(reason) = self.membership_busy().filter(|_| !force) {
            return CommandResponse::Busy { reason };
        }
        let Some(reg) = self.registered.remove(&node_id) else { return rejected("unreachable") };
        self.members.push(Member {
            id: node_id,
            api_addr: reg.api_addr,
            peer_addr: reg.peer_addr,
            name: reg.name,
            join_seq: self.next_join_seq,
            leaving: false,
        });
        self.next_join_seq += 1;
        self.begin_transition()
    }

    pub(super) fn remove(&mut self, node_id: NodeId, force: bool) -> CommandResponse {
        let Some(member) = self.member_of(node_id) else {
            self.registered.remove(&node_id);
            return rejected(&format!("node {node_id} is not a member"));
        };
        if member.leaving {
            return CommandResponse::MapChanged { map_version: self.map.version };
        }
        if self.active_ids().len() == 1 {
            return rejected("the last member cannot leave");
        }
        if let Some(reason) = self.membership_busy().filter(|_| !force) {
            return CommandResponse::Busy { reason };
        }
        if let Some(m) = self.members.iter_mut().find(|m| m.id == node_id) {
            m.leaving = true;
        }
        self.begin_transition()
    }

    /// Starts a transition to a map for the active members, made from the newest map
    /// there is (pending, target, or serving) so that buckets already on their way keep
    /// going where they were going. A maintenance ends: the map is made anew for the members
    /// (one that is still away is no longer spared by failure detection).
    pub(super) fn begin_transition(&mut self) -> CommandResponse {
        self.maintenance = None;
        let base = self.transition.as_ref().map(|t| &t.to).or(self.target.as_ref()).unwrap_or(&self.map);
        // By bytes when the leader recorded them, with bucket count as the tie-breaker; by
        // count alone otherwise.
        let to = rebalance_by_size(base, &self.active_ids(), &self.bucket_sizes);
        // Pending maps get versions above every map seen, so a version names one map.
        let version = self.map.version.max(base.version) + 1;
        self.transition_to(DistributionMap { version, owners: to.owners })
    }

    fn transition_to(&mut self, to: DistributionMap) -> CommandResponse {
        let map_version = to.version;
        self.transition = Some(Transition { from_version: self.map.version, to, acked: Default::default() });
        self.transfer_flag = true;
        CommandResponse::MapChanged { map_version }
    }

    /// Starts a transition to a map balanced by data (planned by the leader on the serving
    /// map of `from_version`).
    pub(super) fn rebalance_to(&mut self, from_version: u64, owners: &[NodeId]) -> CommandResponse {
        if self.cluster_id.is_none() {
            return rejected("the cluster is not bootstrapped");
        }
        if let Some(reason) = self.balance_busy() {
            return CommandResponse::Busy { reason };
        }
        if from_version != self.map.version {
            return rejected(&format!(
                "the plan was made on map version {from_version}; the map is at version {} now",
                self.map.version
            ));
        }
        if owners.len() != BUCKET_COUNT {
            return rejected(&format!("a map names {BUCKET_COUNT} owners, not {}", owners.len()));
        }
        let active = self.active_ids();
        if let Some(o) = owners.iter().find(|o| !active.contains(o)) {
            return rejected(&format!("node {o} is not a member that stays"));
        }
        if owners == self.map.owners.as_slice() {
            return rejected("the plan moves nothing");
        }
        self.transition_to(DistributionMap { version: self.map.version + 1, owners: owners.to_vec() })
    }
}
