//! The planner: examples of each decision, and properties over random histories of the
//! replicated state (`crate::bucket::testing`) and random local facts.

use std::collections::BTreeMap;

use proptest::prelude::*;
use shoal_raft::{BucketId, ClusterState, NodeId};

use super::*;
use crate::bucket::testing::{self, Step};

fn facts(me: NodeId) -> Facts {
    Facts { me, caught_up: true, parallelism: 1, limits: (1, 2, 1), marked_running: true, ..Facts::default() }
}

fn history(steps: &[Step]) -> ClusterState {
    testing::states(steps).pop().unwrap_or_else(testing::bootstrapped)
}

fn three_nodes() -> ClusterState {
    history(&[Step::Join, Step::EndTransition, Step::Move(8), Step::Join, Step::EndTransition, Step::Move(8)])
}

#[test]
fn a_failed_or_retired_node_does_nothing_but_leave() {
    let s = three_nodes();
    let mut f = facts(2);
    f.failed = true;
    f.active = BucketId::all().collect();
    assert_eq!(plan(&s, &s, &f), vec![Action::Job(Job::GiveBack)], "first the lost buckets it served last");
    f.running.give_back = true;
    assert_eq!(plan(&s, &s, &f), vec![], "it keeps everything meanwhile");
    f.running.give_back = false;
    f.gave_back = true;
    assert_eq!(plan(&s, &s, &f), vec![Action::Rejoin]);
    let mut left = s.clone();
    testing::apply(&mut left, &Step::Leave(1));
    testing::apply(&mut left, &Step::EndTransition);
    testing::apply(&mut left, &Step::Move(8));
    assert!(left.retired.contains(&2));
    let mut f = facts(2);
    f.voter = true;
    assert!(plan(&left, &left, &f).is_empty(), "a voter waits for its demotion");
    f.voter = false;
    assert_eq!(plan(&left, &left, &f), vec![Action::Stop]);
}

#[test]
fn the_successor_of_a_stopping_leader_stands_for_election_and_nobody_else() {
    let mut s = three_nodes();
    let elects = |s: &ClusterState, me: NodeId, draining: bool| {
        let mut f = facts(me);
        f.voter = true;
        f.leader_id = Some(1);
        f.draining = draining;
        plan(s, s, &f).contains(&Action::Job(Job::Elect))
    };
    assert!(!elects(&s, 2, false), "the leader runs: nobody stands");
    s.apply(&shoal_raft::ClusterCommand::SetDraining { node_id: 1, draining: true });
    assert!(elects(&s, 2, false), "node 2 succeeds node 1");
    assert!(!elects(&s, 3, false), "node 3 is not the successor");
    assert!(!elects(&s, 2, true), "a successor that stops too does not stand");
    s.apply(&shoal_raft::ClusterCommand::SetDraining { node_id: 2, draining: true });
    assert!(elects(&s, 3, false), "with node 2 stopping too, node 3 succeeds");
}

#[test]
fn a_stopping_node_stands_only_once_no_leader_is_heard() {
    let mut s = three_nodes();
    let elects = |s: &ClusterState, draining: bool, leader_lost: bool| {
        let mut f = facts(3);
        f.voter = true;
        f.leader_id = Some(1);
        f.draining = draining;
        f.leader_lost = leader_lost;
        plan(s, s, &f).contains(&Action::Job(Job::Elect))
    };
    assert!(!elects(&s, true, false), "a leader is heard");
    assert!(elects(&s, true, true), "nothing commits without a leader");
    assert!(!elects(&s, false, true), "a node that runs stands by its own timer");
    s.apply(&shoal_raft::ClusterCommand::SetDraining { node_id: 3, draining: true });
    assert!(elects(&s, true, true), "its stop is recorded, but another's may not be");
}

#[test]
fn a_restarted_node_catches_up_then_restores_from_the_complete_replica_and_serves_empty_what_has_no_copy() {
    let s = three_nodes();
    let b = s.map.buckets_of(2)[0];
    let foreign = s.map.buckets_of(1)[0];
    let mut f = facts(2);
    f.restoring = [b, foreign].into();
    f.caught_up = false;
    assert_eq!(plan(&s, &s, &f).into_iter().filter(|a| matches!(a, Action::Job(Job::CatchUp))).count(), 1);
    assert!(!plan(&s, &s, &f).iter().any(|a| matches!(a, Action::Job(Job::Restore { .. }) | Action::Unmark { .. })));
    f.caught_up = true;
    let actions = plan(&s, &s, &f);
    let heir = s.heir_of(2).expect("an heir");
    assert!(actions.contains(&Action::Job(Job::Restore { bucket: b, from: heir })), "{actions:?}");
    assert!(actions.contains(&Action::Unmark { bucket: foreign }));
    f.no_copy = [(b, [heir].into())].into();
    let actions = plan(&s, &s, &f);
    assert!(actions.contains(&Action::ServeEmpty { buckets: vec![b] }), "no copy anywhere: every copy died");
}

/// A restarted node owns a lost bucket: it holds nothing of it, and a `Found` an earlier life
/// of the node proposed may commit later (simulation seed 3048). The bucket stays marked while
/// it is lost, and is restored from the heir (which got the copy before `Found` was proposed)
/// once it is found; it is never served from what this process holds.
#[test]
fn a_restarted_node_keeps_an_owned_lost_bucket_marked_until_it_is_found() {
    let mut s = three_nodes();
    let b = s.map.buckets_of(2)[0];
    let mut f = facts(2);
    f.restoring = [b].into();
    s.lost.insert(b.0);
    s.last_server.insert(b.0, 3);
    let actions = plan(&s, &s, &f);
    assert!(
        !actions
            .iter()
            .any(|a| matches!(a, Action::Unmark { .. } | Action::Job(Job::Restore { .. }) | Action::ServeEmpty { .. })),
        "lost: nothing to restore yet, and it stays marked: {actions:?}"
    );
    assert_eq!(crate::phase::phase_of(&s, 2, b, f.of(b)), Phase::Lost);
    let before = s.clone();
    s.apply(&shoal_raft::ClusterCommand::Found { owner: 2, from: 3, buckets: vec![b.0], heir: None });
    assert!(!s.is_lost(b), "found");
    assert_eq!(crate::phase::phase_of(&s, 2, b, f.of(b)), Phase::Restoring, "not served empty");
    let heir = s.heir_of(2).expect("an heir");
    assert!(plan(&before, &s, &f).contains(&Action::Job(Job::Restore { bucket: b, from: heir })));
}
/// A member back from maintenance pulls its buckets back while it still catches up after its
/// restart: a bucket whose pull is flipping to it is not restored from the heir (which, now its
/// shadow, holds no replica of it: restoring would drop the pulled copy and serve it empty).
#[test]
fn a_restarted_node_does_not_restore_a_bucket_it_is_pulling() {
    let s = three_nodes();
    let b = s.map.buckets_of(2)[0];
    let mut f = facts(2);
    f.restoring = [b].into();
    f.running.pulls = [b].into();
    let heir = s.heir_of(2).expect("an heir");
    f.no_copy = [(b, [heir].into())].into();
    let actions = plan(&s, &s, &f);
    assert!(
        !actions.iter().any(|a| matches!(a, Action::Job(Job::Restore { .. }) | Action::ServeEmpty { .. })),
        "the pull brings it: {actions:?}"
    );
    f.running.pulls.clear();
    assert!(plan(&s, &s, &f).contains(&Action::ServeEmpty { buckets: vec![b] }), "without the pull it has no copy");
}

/// The owner of a lost bucket took it back and sent it to its heir, then failed before `Found`
/// committed: the heir holds a copy, but the bucket is still lost and its last server waits to
/// give it back. The heir reports it lost (installing it would end the last server's wait while
/// the bucket stays lost).
#[test]
fn a_promoted_bucket_that_is_lost_is_reported_lost_even_with_a_copy_here() {
    let mut s = three_nodes();
    let b = s.map.buckets_of(2)[0];
    s.lost.insert(b.0);
    s.last_server.insert(b.0, 3);
    testing::apply(&mut s, &Step::Fail(1));
    let heir = s.map.owner_of(b).expect("an heir");
    assert_eq!(s.last_server.get(&b.0), Some(&3), "a lost bucket keeps its last server");
    let mut f = facts(heir);
    f.replicas = [(b, 2)].into();
    let actions = plan(&s, &s, &f);
    assert!(!actions.contains(&Action::Install { bucket: b, from: 2 }), "{actions:?}");
    let lost = actions.iter().find_map(|x| match x {
        Action::Job(Job::ReportPromoted { lost, .. }) => Some(lost.clone()),
        _ => None,
    });
    assert!(lost.is_some_and(|l| l.contains(&b)), "{actions:?}");
}

#[test]
fn a_promoted_bucket_comes_from_the_replica_else_the_shadow_else_it_is_lost() {
    let mut s = three_nodes();
    let of_2 = s.map.buckets_of(2);
    testing::apply(&mut s, &Step::Fail(1));
    let heir = s.map.owner_of(of_2[0]).expect("an heir");
    let (a, b, c) = (of_2[0], of_2[1], of_2[2]);
    let mut f = facts(heir);
    f.replicas = [(a, 2)].into();
    let actions = plan(&s, &s, &f);
    assert!(actions.contains(&Action::Install { bucket: a, from: 2 }), "{actions:?}");
    let reported = actions.iter().find_map(|x| match x {
        Action::Job(Job::ReportPromoted { installed, lost }) => Some((installed.clone(), lost.clone())),
        _ => None,
    });
    let (installed, lost) = reported.expect("what is decided is reported at once");
    assert!(installed.is_empty() && !lost.contains(&a) && lost.contains(&b), "{actions:?}");
    // Every copy installed except b and c, of which no copy is left: reported.
    f.replicas.clear();
    f.installed = of_2.iter().copied().filter(|&x| x != b && x != c).collect();
    let actions = plan(&s, &s, &f);
    let report = actions.iter().find_map(|x| match x {
        Action::Job(Job::ReportPromoted { installed, lost }) => Some((installed.len(), lost.clone())),
        _ => None,
    });
    assert_eq!(report, Some((of_2.len() - 2, vec![b, c])));
}

#[test]
fn a_promoted_bucket_is_taken_from_this_node_s_shadow_only_if_it_still_holds_it() {
    let mut s = three_nodes();
    for step in [Step::Join, Step::EndTransition, Step::Move(4)] {
        testing::apply(&mut s, &step);
    }
    let joiner = *s.member_ids().last().expect("members");
    let moved: Vec<BucketId> = s.map.buckets_of(joiner);
    assert!(!moved.is_empty() && s.transfer_flag, "the transfer still runs");
    let last = s.member_ids().len() - 1;
    testing::apply(&mut s, &Step::Fail(last));
    let heir = s.map.owner_of(moved[0]).expect("an heir");
    let own = moved.iter().copied().find(|b| s.handoffs.get(&b.0) == Some(&heir));
    let Some(b) = own else { panic!("the heir handed none of {moved:?} over") };
    let mut f = facts(heir);
    f.shadows = [b].into();
    assert!(plan(&s, &s, &f).contains(&Action::AdoptShadow { bucket: b }));
    // Restarted since it handed the bucket over: the state still names it, but it holds
    // nothing, so the bucket is lost rather than served empty.
    f.shadows.clear();
    let actions = plan(&s, &s, &f);
    assert!(!actions.contains(&Action::AdoptShadow { bucket: b }), "{actions:?}");
    f.installed = s.promotions_of(heir).into_iter().map(|(x, _)| x).filter(|&x| x != b).collect();
    let lost = plan(&s, &s, &f).into_iter().find_map(|x| match x {
        Action::Job(Job::ReportPromoted { lost, .. }) => Some(lost),
        _ => None,
    });
    assert_eq!(lost, Some(vec![b]));
}

#[test]
fn pulls_follow_the_target_up_to_the_parallelism_and_wait_after_a_failure() {
    let s = history(&[Step::Join, Step::EndTransition]);
    let mut f = facts(2);
    f.parallelism = 3;
    let pulls = |f: &Facts| plan(&s, &s, f).into_iter().filter(|a| matches!(a, Action::Job(Job::Pull { .. }))).count();
    assert_eq!(pulls(&f), 3);
    f.running.pulls = s.incoming_of(2).into_iter().take(2).map(|(b, _, _)| b).collect();
    assert_eq!(pulls(&f), 1);
    f.pulls_paused = true;
    assert_eq!(pulls(&f), 0);
}

#[test]
fn the_replica_moves_to_the_new_holder_only_once_it_has_every_bucket() {
    let mut s = three_nodes();
    // Node 3's complete replica is on node 1; a fourth member makes join order name node 4.
    s.apply(&shoal_raft::ClusterCommand::ReplicaMoved { owner: 3, holder: 1 });
    testing::apply(&mut s, &Step::Join);
    testing::apply(&mut s, &Step::EndTransition);
    testing::apply(&mut s, &Step::Move(8));
    assert_eq!((s.committed_holder_of(3), s.replica_of(3)), (Some(1), Some(4)));
    let owned = s.map.buckets_of(3);
    let mut f = facts(3);
    f.attached = owned.iter().map(|&b| (b, 1)).collect();
    let actions = plan(&s, &s, &f);
    assert!(actions.iter().any(|a| matches!(a, Action::Job(Job::Attach { holder: 4, .. }))), "{actions:?}");
    assert!(!actions.iter().any(|a| matches!(a, Action::Job(Job::MoveReplica { .. }))));
    f.attached.extend(owned.iter().map(|&b| (b, 4)));
    let actions = plan(&s, &s, &f);
    assert!(actions.contains(&Action::Job(Job::MoveReplica { holder: 4 })), "{actions:?}");
    // Node 1 keeps its copies of node 3's buckets until node 4 is the complete holder.
    let mut holder = facts(1);
    holder.replicas = owned.iter().map(|&b| (b, 3)).collect();
    assert!(!plan(&s, &s, &holder).iter().any(|a| matches!(a, Action::DropReplica { .. })));
    s.apply(&shoal_raft::ClusterCommand::ReplicaMoved { owner: 3, holder: 4 });
    let drops = plan(&s, &s, &holder).into_iter().filter(|a| matches!(a, Action::DropReplica { .. })).count();
    assert_eq!(drops, owned.len());
}

#[test]
fn a_joiner_gets_its_share_before_replica_copies_it_only_prepares_to_hold() {
    let mut s = three_nodes();
    s.apply(&shoal_raft::ClusterCommand::ReplicaMoved { owner: 3, holder: 1 });
    testing::apply(&mut s, &Step::Join);
    let attaches = |s: &ClusterState, f: &Facts| -> Vec<NodeId> {
        plan(s, s, f)
            .into_iter()
            .filter_map(|a| match a {
                Action::Job(Job::Attach { holder, .. }) => Some(holder),
                _ => None,
            })
            .collect()
    };
    let mut f = facts(3);
    f.attached = s.map.buckets_of(3).into_iter().map(|b| (b, 1)).collect();
    assert!(s.transition.is_some() && s.target.is_none());
    assert_eq!(attaches(&s, &f), Vec::<NodeId>::new(), "the pending map gives node 4 buckets to pull already");
    testing::apply(&mut s, &Step::EndTransition);
    // Half of node 4's share has moved; node 3's replica is to move from node 1 to node 4.
    testing::apply(&mut s, &Step::Move(4));
    assert!(!s.incoming_of(4).is_empty());
    assert_eq!((s.committed_holder_of(3), s.replica_of(3)), (Some(1), Some(4)));
    f.attached.clear();
    assert_eq!(attaches(&s, &f), vec![1], "the complete holder is kept complete meanwhile");
    f.attached = s.map.buckets_of(3).into_iter().map(|b| (b, 1)).collect();
    assert_eq!(attaches(&s, &f), Vec::<NodeId>::new(), "nothing goes to node 4 while it pulls");
    assert!(!plan(&s, &s, &f).iter().any(|a| matches!(a, Action::Job(Job::MoveReplica { .. }))));
    // The complete holder stops (or leaves): the copies go to node 4 at once.
    let mut stopping = s.clone();
    stopping.draining.insert(1);
    assert_eq!(attaches(&stopping, &f), vec![4]);
    let mut leaving = s.clone();
    leaving.members.iter_mut().filter(|m| m.id == 1).for_each(|m| m.leaving = true);
    assert_eq!(attaches(&leaving, &f), vec![4]);
    // Node 4 pulls none of node 3's buckets any more: only what node 3 keeps goes to it.
    testing::apply(&mut s, &Step::Move(8));
    assert!(s.incoming_of(4).is_empty());
    f.attached = s.map.buckets_of(3).into_iter().map(|b| (b, 1)).collect();
    let sent: Vec<BucketId> = plan(&s, &s, &f)
        .into_iter()
        .flat_map(|a| match a {
            Action::Job(Job::Attach { holder: 4, buckets }) => buckets,
            _ => Vec::new(),
        })
        .collect();
    assert!(!sent.is_empty());
    assert!(sent.iter().all(|&b| s.map.owner_of(b) == Some(3)), "{sent:?}");
}

/// Random local facts of node `me` on `state`.
fn facts_of(state: &ClusterState, me: NodeId, bits: &[u64; 4]) -> Facts {
    let pick = |k: usize, b: BucketId| bits[k] >> (b.0 % 64) & 1 == 1;
    let ids: Vec<NodeId> = (1..state.next_node_id.max(2)).collect();
    let mut f = facts(me);
    f.active = BucketId::all().filter(|&b| pick(0, b)).collect();
    f.replicas = BucketId::all().filter(|&b| pick(1, b)).map(|b| (b, ids[b.index() % ids.len()])).collect();
    f.restoring = BucketId::all().filter(|&b| pick(2, b) && b.0 % 7 == 0).collect();
    f.installed = BucketId::all().filter(|&b| pick(3, b)).collect();
    f.caught_up = bits[0] & 1 == 1;
    f.attached = BucketId::all().filter(|&b| pick(3, b)).flat_map(|b| ids.iter().map(move |&h| (b, h))).collect();
    f
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    /// Whatever happened, no plan drops a copy that may be the last one of an acknowledged
    /// write, gets data for a bucket this node has no business with, or does two things to
    /// one bucket at once.
    #[test]
    fn no_plan_drops_a_copy_that_is_still_needed(
        steps in prop::collection::vec(testing::step(), 0..30),
        bits in any::<[u64; 4]>(),
    ) {
        let states = testing::states(&steps);
        for pair in states.windows(2) {
            let (previous, state) = (&pair[0], &pair[1]);
            for me in 1..state.next_node_id.max(2) {
                let f = facts_of(state, me, &bits);
                let actions = plan(previous, state, &f);
                let mut touched: BTreeMap<BucketId, &Action> = BTreeMap::new();
                for action in &actions {
                    let bucket = match action {
                        Action::DropActive { bucket } => {
                            let phase = phase_of(state, me, *bucket, f.of(*bucket));
                            prop_assert!(matches!(phase, Phase::Foreign { .. } | Phase::Mirror { .. } | Phase::Away { .. }), "node {me} drops {bucket} in {phase:?}");
                            Some(*bucket)
                        }
                        Action::DropReplica { bucket, .. } => {
                            let source = f.replicas[bucket];
                            let needed = state.map.owner_of(*bucket) == Some(source)
                                && (state.heir_of(source) == Some(me) || state.replica_of(source) == Some(me));
                            prop_assert!(!needed, "node {me} drops the replica of {bucket} it holds for {source}");
                            prop_assert!(!state.promoted.contains_key(&bucket.0));
                            None
                        }
                        Action::Job(Job::Pull { bucket, from, .. }) => {
                            prop_assert_eq!(state.target.as_ref().and_then(|t| t.owner_of(*bucket)), Some(me));
                            prop_assert_eq!(state.map.owner_of(*bucket), Some(*from));
                            Some(*bucket)
                        }
                        Action::Job(Job::Restore { bucket, from }) => {
                            prop_assert_eq!(state.map.owner_of(*bucket), Some(me));
                            prop_assert!(*from != me && state.is_member(*from));
                            Some(*bucket)
                        }
                        Action::Install { bucket, from } => {
                            prop_assert_eq!(state.promoted.get(&bucket.0), Some(from));
                            prop_assert_eq!(f.replicas.get(bucket), Some(from));
                            Some(*bucket)
                        }
                        Action::Job(Job::HandOver { heir }) => {
                            prop_assert!(state.member_of(me).is_some_and(|m| m.leaving));
                            prop_assert_eq!(state.heir_of(me), Some(*heir));
                            None
                        }
                        Action::Job(Job::MoveReplica { holder }) => {
                            prop_assert_eq!(state.replica_of(me), Some(*holder));
                            None
                        }
                        _ => None,
                    };
                    if let Some(b) = bucket {
                        prop_assert!(touched.insert(b, action).is_none(), "two actions on {b}: {actions:?}");
                    }
                }
                if f.failed || state.failed.contains(&me) {
                    prop_assert!(actions.len() <= 1, "{actions:?}");
                    prop_assert!(actions.iter().all(|a| matches!(a, Action::Rejoin | Action::Job(Job::GiveBack))));
                }
            }
        }
    }
}

#[test]
fn a_maintenance_is_ended_by_the_leader_when_its_time_ran_out_and_by_the_member_when_nothing_drives_it() {
    let mut s = three_nodes();
    s.apply(&shoal_raft::ClusterCommand::EnterMaintenance { node_id: 2, since_ms: 1_000, until_ms: 61_000 });
    let ends = |s: &ClusterState, f: &Facts| {
        plan(s, s, f).into_iter().filter(|a| matches!(a, Action::Job(Job::EndMaintenance { node: 2, .. }))).count()
    };
    // The member runs the procedure: nobody ends it before its time.
    let member = Facts { entering: Entering::Proposing, now_ms: 2_000, ..facts(2) };
    let leader = Facts { leader: true, now_ms: 2_000, ..facts(1) };
    assert_eq!((ends(&s, &member), ends(&s, &leader)), (0, 0));
    // The request was cancelled: the member ends what it prepared.
    assert_eq!(ends(&s, &Facts { entering: Entering::No, ..member.clone() }), 1);
    // The time ran out: the leader ends it, another follower does not.
    assert_eq!(ends(&s, &Facts { now_ms: 61_000, ..leader.clone() }), 1);
    assert_eq!(ends(&s, &Facts { now_ms: 61_000, ..facts(3) }), 0);
    // Once the member is back, its time no longer matters.
    let heir = s.heir_of(2).expect("an heir");
    let period = s.replica_period(2, heir).expect("a period");
    s.apply(&shoal_raft::ClusterCommand::MaintenanceReady { node_id: 2, heir: (heir, period) });
    s.apply(&shoal_raft::ClusterCommand::SetDraining { node_id: 2, draining: false });
    assert_eq!(ends(&s, &Facts { now_ms: 99_000, ..leader }), 0);
}

#[test]
fn a_member_entering_maintenance_goes_away_once_it_holds_no_complete_replica_and_is_refused_otherwise() {
    let mut s = three_nodes();
    let owner = s.members.iter().map(|m| m.id).find(|&id| s.replica_of(id) == Some(2)).expect("node 2 holds a replica");
    let done = shoal_raft::CommandResponse::Done;
    assert_eq!(s.apply(&shoal_raft::ClusterCommand::ReplicaMoved { owner, holder: 2 }), done);
    s.apply(&shoal_raft::ClusterCommand::EnterMaintenance { node_id: 2, since_ms: 1_000, until_ms: 61_000 });
    let entry = |s: &ClusterState, entering: Entering| -> Vec<Action> {
        let f = Facts { entering, now_ms: 2_000, ..facts(2) };
        let entry = |a: &Action| matches!(a, Action::RefuseMaintenance { .. } | Action::Job(Job::GoAway { .. }));
        plan(s, s, &f).into_iter().filter(entry).collect()
    };
    let waiting = Entering::Asked { overdue: false };
    let overdue = Entering::Asked { overdue: true };
    // Nothing before the entry is committed, nor once it is decided.
    assert!(entry(&s, Entering::Proposing).is_empty());
    assert!(entry(&s, Entering::Decided).is_empty());
    // It holds another member's complete replica: it waits for it to move on, then is refused.
    assert_eq!(s.held_by(2), Some(owner));
    assert!(entry(&s, waiting).is_empty(), "waits while the replica it holds moves on");
    let refused = Action::RefuseMaintenance { refusal: MaintenanceRefusal::StillHolding { holder: 2, owner } };
    assert_eq!(entry(&s, overdue), vec![refused]);
    // Moved on: it hands its buckets to its heir (once: not while the job runs).
    let next = s.members.iter().map(|m| m.id).find(|&id| id != 2 && id != owner).expect("a third member");
    assert_eq!(s.apply(&shoal_raft::ClusterCommand::ReplicaMoved { owner, holder: next }), done);
    assert_eq!(s.held_by(2), None);
    let heir = s.heir_of(2).expect("an heir");
    assert_eq!(entry(&s, waiting), vec![Action::Job(Job::GoAway { heir })]);
    assert_eq!(entry(&s, overdue), vec![Action::Job(Job::GoAway { heir })]);
    let running = Facts { entering: waiting, running: Running { go_away: true, ..Running::default() }, ..facts(2) };
    assert!(plan(&s, &s, &running).iter().all(|a| !matches!(a, Action::Job(Job::GoAway { .. }))));
    // Another member stops: the heir or the majority may be gone next.
    let mut stopping = s.clone();
    stopping.apply(&shoal_raft::ClusterCommand::SetDraining { node_id: heir, draining: true });
    let refused = Action::RefuseMaintenance { refusal: MaintenanceRefusal::PeerStopping(heir) };
    assert_eq!(entry(&stopping, waiting), vec![refused]);
    // The maintenance ended meanwhile (an operator, the leader).
    let mut ended = s.clone();
    ended.apply(&shoal_raft::ClusterCommand::EndMaintenance { node_id: 2, reason: "test".into() });
    assert!(matches!(
        entry(&ended, waiting).as_slice(),
        [Action::RefuseMaintenance { refusal: MaintenanceRefusal::Busy(_) }]
    ));
}

#[test]
fn the_leader_fails_a_member_a_majority_reports_once_at_a_time_and_nobody_else_does() {
    let s = three_nodes();
    let fails =
        |f: &Facts| plan(&s, &s, f).into_iter().filter(|a| matches!(a, Action::Job(Job::FailNode { .. }))).count();
    let leader = Facts { leader: true, to_fail: Some((3, 2, 3)), ..facts(1) };
    assert_eq!(fails(&leader), 1);
    assert_eq!(fails(&Facts { leader: false, ..leader.clone() }), 0, "only the leader proposes");
    let running = Running { fail: true, ..Running::default() };
    assert_eq!(fails(&Facts { running, ..leader.clone() }), 0, "one proposal at a time");
    assert_eq!(fails(&Facts { to_fail: None, ..leader }), 0);
}

#[test]
fn the_leader_balances_by_data_when_due_once_at_a_time() {
    let s = three_nodes();
    let balances = |f: &Facts| plan(&s, &s, f).contains(&Action::Job(Job::Balance));
    let leader = Facts { leader: true, balance_due: true, ..facts(1) };
    assert!(balances(&leader));
    assert!(!balances(&Facts { leader: false, ..leader.clone() }));
    assert!(!balances(&Facts { running: Running { balance: true, ..Running::default() }, ..leader.clone() }));
    assert!(!balances(&Facts { balance_due: false, ..leader }));
}
