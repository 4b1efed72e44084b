//! Random histories of the replicated state, for the property tests of the bucket core and
//! the reconciler: every state is reached by `ClusterState::apply` from a bootstrap, through
//! joins, leaves, transitions, bucket moves and aborts, failures, hand-overs, promotion
//! reports, replica moves, maintenance and balancing by data, as the control plane would
//! commit them (commands the state refuses change nothing, as in Raft).

use proptest::prelude::*;
use shoal_raft::{BucketId, ClusterCommand, ClusterState, NodeId, ReplicationMode};

/// One step of a history, chosen by the strategy and made to fit the state when applied.
#[derive(Debug, Clone)]
pub enum Step {
    /// A new node registers and is admitted.
    Join,
    /// The member at this index (modulo) leaves.
    Leave(usize),
    /// Every member acknowledges the pending map; the transition ends.
    EndTransition,
    /// This share (of 8) of the incoming buckets move.
    Move(u8),
    /// The move of this bucket is aborted.
    Abort(u16),
    /// The member at this index fails.
    Fail(usize),
    /// The leaving member at this index hands its buckets over.
    HandOver(usize),
    /// Every heir reports: each promoted bucket installed, or lost when the bit is set.
    Report(u64),
    /// The member at this index says the holder join order names has its complete replica.
    ReplicaMoved(usize),
    /// The member at this index prepares for maintenance.
    Maintenance(usize),
    /// The member preparing for maintenance goes away (checked at its heir now).
    Away,
    /// The member in maintenance comes back (it says it runs again).
    Return,
    /// The maintenance ends before the member is back (an operator, or its time ran out).
    EndMaintenance,
    /// A map balanced by data: every bucket whose number this picks (modulo 7) goes to
    /// another member that stays.
    Rebalance(u64),
}

/// A strategy for steps.
pub fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        3 => Just(Step::Join),
        1 => any::<usize>().prop_map(Step::Leave),
        3 => Just(Step::EndTransition),
        4 => (1u8..=8).prop_map(Step::Move),
        1 => (0u16..1000).prop_map(Step::Abort),
        1 => any::<usize>().prop_map(Step::Fail),
        1 => any::<usize>().prop_map(Step::HandOver),
        2 => any::<u64>().prop_map(Step::Report),
        2 => any::<usize>().prop_map(Step::ReplicaMoved),
        1 => any::<usize>().prop_map(Step::Maintenance),
        1 => Just(Step::Away),
        1 => Just(Step::Return),
        1 => Just(Step::EndMaintenance),
        1 => any::<u64>().prop_map(Step::Rebalance),
    ]
}

/// A one-node cluster.
pub fn bootstrapped() -> ClusterState {
    let mut s = ClusterState::default();
    s.apply(&ClusterCommand::Bootstrap {
        cluster_id: "c".into(),
        node_id: 1,
        api_addr: "a1".into(),
        peer_addr: "p1".into(),
        name: None,
        voters: 3,
        replication: ReplicationMode::Sync,
    });
    s
}

/// Applies `step` to `s`, as the control plane would commit it.
pub fn apply(s: &mut ClusterState, step: &Step) {
    let members = s.member_ids();
    let pick = |i: usize| members.get(i % members.len().max(1)).copied();
    match step {
        Step::Join => {
            let n = s.next_node_id;
            let register =
                ClusterCommand::Register { api_addr: format!("a{n}"), peer_addr: format!("p{n}"), name: None };
            if let shoal_raft::CommandResponse::Registered { node_id } = s.apply(&register) {
                s.apply(&ClusterCommand::Admit { node_id, force: true });
            }
        }
        Step::Leave(i) => {
            if let Some(id) = pick(*i) {
                s.apply(&ClusterCommand::Remove { node_id: id, force: true });
            }
        }
        Step::EndTransition => {
            if let Some(t) = s.transition.clone() {
                for id in members {
                    s.apply(&ClusterCommand::AckTransition { node_id: id, to_version: t.to.version });
                }
                s.apply(&ClusterCommand::EndTransition { to_version: t.to.version });
            }
        }
        Step::Move(share) => {
            // Receivers the running target names, a member that failed since included: it
            // may not know yet and still pull.
            let mut receivers: Vec<NodeId> =
                s.target.as_ref().map(|t| t.owners.clone()).unwrap_or_default().into_iter().collect();
            receivers.sort_unstable();
            receivers.dedup();
            for id in receivers {
                for (k, (bucket, from, epoch)) in s.incoming_of(id).into_iter().enumerate() {
                    if k % 8 < usize::from(*share) {
                        s.apply(&ClusterCommand::BucketMoved { bucket: bucket.0, from, to: id, epoch });
                    }
                }
            }
        }
        Step::Abort(b) => {
            let epoch = s.epoch_of(BucketId(*b));
            s.apply(&ClusterCommand::AbortMove { bucket: *b, epoch });
        }
        Step::Fail(i) => {
            if let Some(id) = pick(*i) {
                s.apply(&ClusterCommand::NodeFailed { node_id: id });
            }
        }
        Step::HandOver(i) => {
            let leaving: Vec<NodeId> = s.members.iter().filter(|m| m.leaving).map(|m| m.id).collect();
            if let Some(&id) = leaving.get(i % leaving.len().max(1)) {
                s.apply(&ClusterCommand::HandOver { node_id: id, heir: None });
            }
        }
        Step::Report(bits) => {
            for id in members {
                let promoted = s.promotions_of(id);
                let (lost, held): (Vec<_>, Vec<_>) =
                    promoted.into_iter().map(|(b, _)| b.0).partition(|b| bits >> (b % 64) & 1 == 1);
                s.apply(&ClusterCommand::Promoted { node_id: id, buckets: held, lost });
            }
        }
        Step::ReplicaMoved(i) => {
            if let Some(owner) = pick(*i) {
                if let Some(holder) = s.replica_of(owner) {
                    s.apply(&ClusterCommand::ReplicaMoved { owner, holder });
                }
            }
        }
        Step::Maintenance(i) => {
            if let Some(node_id) = pick(*i) {
                s.apply(&ClusterCommand::EnterMaintenance { node_id, since_ms: 0, until_ms: 60_000 });
            }
        }
        Step::Away => {
            if let Some(node_id) = s.maintenance.as_ref().map(|m| m.node) {
                if let Some(heir) = s.heir_of(node_id) {
                    let period = s.replica_period(node_id, heir).unwrap_or(0);
                    s.apply(&ClusterCommand::MaintenanceReady { node_id, heir: (heir, period) });
                }
            }
        }
        Step::Return => {
            if let Some(m) = s.maintenance.clone() {
                s.apply(&ClusterCommand::SetDraining { node_id: m.node, draining: false });
            }
        }
        Step::EndMaintenance => {
            if let Some(m) = s.maintenance.clone() {
                s.apply(&ClusterCommand::EndMaintenance { node_id: m.node, reason: "test".into() });
            }
        }
        Step::Rebalance(seed) => {
            let stay = s.active_ids();
            if stay.len() > 1 && !s.map.is_empty() {
                let mut owners = s.map.owners.clone();
                for (b, owner) in owners.iter_mut().enumerate() {
                    if (b as u64 ^ seed) % 7 == 0 {
                        *owner = stay[(b + *seed as usize % stay.len()) % stay.len()];
                    }
                }
                s.apply(&ClusterCommand::Rebalance { from_version: s.map.version, owners });
            }
        }
    }
}

/// The states a history goes through, the bootstrap included.
pub fn states(steps: &[Step]) -> Vec<ClusterState> {
    let mut s = bootstrapped();
    let mut all = vec![s.clone()];
    for step in steps {
        apply(&mut s, step);
        all.push(s.clone());
    }
    all
}
