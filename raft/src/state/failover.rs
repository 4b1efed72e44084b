//! Failover and hand-over: the buckets of a failed member, or of a leaver whose replica is in
//! sync, go at once to the member holding their replica; that member reports
//! whether it held a copy of each (`Promoted`), and buckets of which no copy is left are
//! marked lost.

use super::{rejected, ClusterState};
use crate::command::CommandResponse;
use crate::distribution::{BucketId, NodeId, BUCKET_COUNT};

impl ClusterState {
    pub(super) fn node_failed(&mut self, node: NodeId) -> CommandResponse {
        if self.failed.contains(&node) {
            return CommandResponse::MapChanged { map_version: self.map.version };
        }
        if !self.is_member(node) {
            return rejected(&format!("node {node} is not a member"));
        }
        if self.members.len() < 2 {
            return rejected("the last member cannot be failed");
        }
        // A leader that counted reports before it applied the maintenance: the member is
        // away on purpose.
        if self.away() == Some(node) {
            return rejected(&format!("node {node} is in maintenance"));
        }
        let Some(heir) = self.heir_of(node) else { return rejected("no member holds the replica") };
        self.promote_all(node, heir);
        self.members.retain(|m| m.id != node);
        self.forget_holdings_of(node);
        if self.draining.remove(&node) {
            self.failed_stopped.insert(node);
        }
        self.failed.insert(node);
        self.handoffs.retain(|_, n| *n != node);
        if let Some(t) = self.transition.as_mut() {
            t.acked.remove(&node);
        }
        // Members that were all leaving stay: someone has to serve.
        if self.active_ids().is_empty() {
            for m in &mut self.members {
                m.leaving = false;
            }
        }
        let response = self.begin_transition();
        self.settle();
        response
    }

    pub(super) fn hand_over(&mut self, node: NodeId, checked: Option<(NodeId, u64)>) -> CommandResponse {
        let Some(member) = self.member_of(node) else { return rejected(&format!("node {node} is not a member")) };
        if !member.leaving {
            return rejected(&format!("node {node} is not leaving"));
        }
        let Some(heir) = self.heir_of(node) else { return rejected("no member holds the replica") };
        if let Some((checked_heir, period)) = checked {
            if checked_heir != heir || self.replica_period(node, heir) != Some(period) {
                return rejected(&format!(
                    "the holder of node {node}'s replica changed since it was checked (node {checked_heir} in period {period})"
                ));
            }
        }
        self.promote_all(node, heir);
        self.settle();
        CommandResponse::MapChanged { map_version: self.map.version }
    }

    pub(super) fn replica_moved(&mut self, owner: NodeId, holder: NodeId) -> CommandResponse {
        if !self.is_member(owner) || !self.is_member(holder) {
            return rejected(&format!("nodes {owner} and {holder} must both be members"));
        }
        if self.replica_of(owner) != Some(holder) {
            return rejected(&format!("join order no longer names node {holder} to hold node {owner}'s replica"));
        }
        self.replica_holders.insert(owner, holder);
        CommandResponse::Done
    }

    /// Applies an entry of earlier versions: the buckets `node` owns go to `lost`.
    pub(super) fn buckets_lost(&mut self, node: NodeId, buckets: &[u16]) -> CommandResponse {
        if !self.is_member(node) {
            return rejected(&format!("node {node} is not a member"));
        }
        for &b in buckets {
            if usize::from(b) < BUCKET_COUNT && self.map.owner_of(BucketId(b)) == Some(node) {
                self.lost.insert(b);
            }
        }
        CommandResponse::Done
    }

    /// Gives every bucket `from` serves to `heir`, which holds their replica.
    pub(super) fn promote_all(&mut self, from: NodeId, heir: NodeId) {
        let mut changed = false;
        for i in 0..BUCKET_COUNT {
            if self.map.owners[i] != from {
                continue;
            }
            let bucket = i as u16;
            // Who served it last: `from`, unless `from` never did (it was promoted to it and not
            // installed yet, or it is lost).
            let server = match self.last_server.get(&bucket) {
                Some(&earlier) if self.promoted.contains_key(&bucket) || self.lost.contains(&bucket) => earlier,
                _ => from,
            };
            self.last_server.insert(bucket, server);
            self.map.owners[i] = heir;
            self.bucket_epochs.bump(BucketId(bucket));
            self.promoted.insert(bucket, from);
            self.away_promotions.remove(&bucket);
            // A shadow from the running transfer stays: if the heir holds no replica of the
            // bucket (not attached yet), the shadow has every write `from` acknowledged.
            changed = true;
        }
        if changed {
            self.map.version += 1;
        }
    }

    pub(super) fn promoted(&mut self, heir: NodeId, buckets: &[u16], lost: &[u16]) -> CommandResponse {
        // Only the current owner's report counts: a late report of a heir that failed since
        // must not clear the next heir's promotion.
        if !self.is_member(heir) {
            return rejected(&format!("node {heir} is not a member"));
        }
        for b in buckets {
            if self.map.owner_of(BucketId(*b)) == Some(heir) {
                self.promoted.remove(b);
                self.last_server.remove(b);
                self.away_promotions.remove(b);
            }
        }
        for &b in lost {
            let died = self.copies_died_with_their_process(b);
            let from = self.promoted.remove(&b);
            self.away_promotions.remove(&b);
            if from.is_some() && !died && self.map.owner_of(BucketId(b)) == Some(heir) {
                self.lost.insert(b);
            } else if !self.lost.contains(&b) {
                self.last_server.remove(&b);
            }
        }
        CommandResponse::Done
    }

    /// Whether promoted bucket `b`, reported without a copy by its heir, had every copy die
    /// with a process that stopped: its last server stopped and was failed (its copy died in
    /// the stop, see `failed_stopped`), or it was handed over by a maintenance (the member
    /// keeps nothing while away) and its heir restarted before it installed it. Such a bucket
    /// serves again, empty; any other is lost. A bucket lost before, whose newest copy is with
    /// another last server (which gives it back once it returns), lost no copy in the stop: it
    /// stays lost.
    pub fn copies_died_with_their_process(&self, b: u16) -> bool {
        let from = self.promoted.get(&b);
        let lost_elsewhere = self.lost.contains(&b) && self.last_server.get(&b).is_some_and(|s| Some(s) != from);
        !lost_elsewhere && (self.away_promotions.contains(&b) || from.is_some_and(|f| self.failed_stopped.contains(f)))
    }

    pub(super) fn found(
        &mut self,
        owner: NodeId,
        from: NodeId,
        buckets: &[u16],
        heir: Option<(NodeId, u64)>,
    ) -> CommandResponse {
        if !self.is_member(owner) {
            return rejected(&format!("node {owner} is not a member"));
        }
        if let Some((heir, period)) = heir {
            if self.heir_of(owner) != Some(heir) || self.replica_period(owner, heir) != Some(period) {
                return rejected(&format!(
                    "the holder of node {owner}'s replica changed since it got the copies (node {heir} in period {period})"
                ));
            }
        }
        for b in buckets {
            let still = self.lost.contains(b)
                && self.last_server.get(b) == Some(&from)
                && self.map.owner_of(BucketId(*b)) == Some(owner);
            if still {
                self.lost.remove(b);
                self.last_server.remove(b);
                // The shadow of a transfer that moved the bucket before it was lost never got
                // the items found again: it is no complete copy any more, and a failover of the
                // owner must not serve it (the bucket is lost again instead).
                self.handoffs.remove(b);
                // A new ownership period: a move of the (empty) lost bucket that was under way
                // can no longer flip it.
                self.bucket_epochs.bump(BucketId(*b));
            }
        }
        CommandResponse::Done
    }

    /// The lost buckets `node` served last (it may return with their newest copy), with
    /// their owners.
    pub fn lost_of(&self, node: NodeId) -> Vec<(BucketId, NodeId)> {
        self.lost
            .iter()
            .filter(|b| self.last_server.get(b) == Some(&node))
            .filter_map(|&b| Some((BucketId(b), self.map.owner_of(BucketId(b))?)))
            .collect()
    }

    pub(super) fn clear_lost(&mut self, buckets: &[u16]) -> CommandResponse {
        let cleared: Vec<u16> = if buckets.is_empty() {
            std::mem::take(&mut self.lost).into_iter().collect()
        } else {
            buckets.iter().copied().filter(|b| self.lost.remove(b)).collect()
        };
        for b in &cleared {
            self.last_server.remove(b);
        }
        CommandResponse::Cleared { buckets: cleared }
    }

    /// The buckets `me` serves that it got from a replica and has not reported on yet.
    pub fn promotions_of(&self, me: NodeId) -> Vec<(BucketId, NodeId)> {
        self.promoted
            .iter()
            .map(|(&b, &from)| (BucketId(b), from))
            .filter(|(b, _)| self.map.owner_of(*b) == Some(me))
            .collect()
    }

    /// Whether `bucket` is lost.
    pub fn is_lost(&self, bucket: BucketId) -> bool {
        !self.lost.is_empty() && self.lost.contains(&bucket.0)
    }
}
