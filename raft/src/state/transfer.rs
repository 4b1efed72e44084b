//! The transition (every member applies the pending map, then it becomes the target) and
//! the moves that bring the serving map to the target, one bucket at a time.

use super::{rejected, ClusterState};
use crate::command::CommandResponse;
use crate::distribution::{BucketId, NodeId, BUCKET_COUNT};

impl ClusterState {
    pub(super) fn ack_transition(&mut self, node_id: NodeId, to_version: u64) -> CommandResponse {
        let Some(t) = self.transition.as_mut() else { return rejected("no transition is pending") };
        if t.to.version != to_version {
            return rejected(&format!("the pending map is version {}, not {to_version}", t.to.version));
        }
        if !self.members.iter().any(|m| m.id == node_id) {
            return rejected(&format!("node {node_id} is not a member"));
        }
        t.acked.insert(node_id);
        CommandResponse::Done
    }

    /// Whether every member has acknowledged the pending map.
    pub fn transition_acked(&self) -> bool {
        self.transition.as_ref().is_some_and(|t| self.members.iter().all(|m| t.acked.contains(&m.id)))
    }

    pub(super) fn end_transition(&mut self, to_version: u64) -> CommandResponse {
        match &self.transition {
            Some(t) if t.to.version == to_version => {}
            Some(t) => return rejected(&format!("the pending map is version {}, not {to_version}", t.to.version)),
            None => return rejected("no transition is pending"),
        }
        let Some(t) = self.transition.take() else { return rejected("no transition is pending") };
        self.target = Some(t.to);
        self.settle();
        CommandResponse::MapChanged { map_version: to_version }
    }

    pub(super) fn bucket_moved(&mut self, bucket: u16, from: NodeId, to: NodeId, epoch: u64) -> CommandResponse {
        let b = BucketId(bucket);
        if usize::from(bucket) >= BUCKET_COUNT {
            return rejected(&format!("no bucket {bucket}"));
        }
        let Some(target) = &self.target else { return rejected("no state transfer is running") };
        // The running target may still name a member that failed since (the next transition
        // takes it out): a move to it would give the bucket to a node that no longer serves.
        if !self.is_member(to) {
            return rejected(&format!("node {to} is not a member"));
        }
        if target.owner_of(b) != Some(to) {
            return rejected(&format!("the target does not give bucket {bucket} to node {to}"));
        }
        if self.map.owner_of(b) != Some(from) {
            return rejected(&format!("bucket {bucket} is not served by node {from}"));
        }
        if self.epoch_of(b) != epoch {
            return rejected(&format!("stale move of bucket {bucket} (epoch {epoch}, now {})", self.epoch_of(b)));
        }
        self.map.owners[b.index()] = to;
        self.map.version += 1;
        self.bucket_epochs.bump(b);
        self.handoffs.insert(bucket, from);
        self.promoted.remove(&bucket);
        // A lost bucket moves empty and stays lost: its last server may still give it back,
        // to its new owner.
        if !self.lost.contains(&bucket) {
            self.last_server.remove(&bucket);
        }
        self.settle();
        CommandResponse::MapChanged { map_version: self.map.version }
    }

    pub(super) fn abort_move(&mut self, bucket: u16, epoch: u64) -> CommandResponse {
        if usize::from(bucket) >= BUCKET_COUNT {
            return rejected(&format!("no bucket {bucket}"));
        }
        let b = BucketId(bucket);
        if self.epoch_of(b) != epoch {
            return rejected(&format!("stale abort of bucket {bucket} (epoch {epoch}, now {})", self.epoch_of(b)));
        }
        self.bucket_epochs.bump(b);
        CommandResponse::Done
    }

    /// After a map change: ends the transfer when the serving map has reached the target,
    /// and retires leaving members that serve nothing any more.
    pub(super) fn settle(&mut self) {
        if self.target.as_ref().is_some_and(|t| t.owners == self.map.owners) {
            self.target = None;
        }
        if self.target.is_none() && self.transition.is_none() {
            self.transfer_flag = false;
        }
        if self.target.is_none() {
            self.handoffs.clear();
            // A member in maintenance took every bucket back: the maintenance is over.
            self.maintenance = None;
        }
        let pending = |id: NodeId| {
            self.transition.as_ref().is_some_and(|t| t.to.owners.contains(&id))
                || self.target.as_ref().is_some_and(|t| t.owners.contains(&id))
        };
        // A leaver is retired once it serves nothing; the shadows it holds go with it (a
        // leaver's shadows only matter while its buckets' new owners could still crash).
        let done: Vec<NodeId> = self
            .members
            .iter()
            .filter(|m| m.leaving && !self.map.owners.contains(&m.id) && !pending(m.id))
            .map(|m| m.id)
            .collect();
        for id in done {
            self.members.retain(|m| m.id != id);
            self.forget_holdings_of(id);
            self.draining.remove(&id);
            self.retired.insert(id);
            self.handoffs.retain(|_, n| *n != id);
            if let Some(t) = self.transition.as_mut() {
                t.acked.remove(&id);
            }
        }
    }
}
