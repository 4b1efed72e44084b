//! The pure decisions of the bucket core: examples, and properties over random histories of
//! the replicated state (`crate::bucket::testing`).

use proptest::prelude::*;
use shoal_raft::{BucketId, ClusterState, NodeId};

use super::*;
use crate::bucket::testing::{self, Step};

fn node(failed: bool, handing_over: bool, draining: bool, no_quorum: Option<(usize, usize)>) -> NodeFacts {
    NodeFacts { failed, handing_over, draining, no_quorum }
}

/// Every id the history ever used (members, failed, retired).
fn ids(s: &ClusterState) -> Vec<NodeId> {
    (1..s.next_node_id.max(2)).collect()
}

fn history(steps: &[Step]) -> ClusterState {
    testing::states(steps).pop().unwrap_or_else(testing::bootstrapped)
}

#[test]
fn a_one_node_cluster_serves_every_bucket_with_no_copy() {
    let s = testing::bootstrapped();
    for b in [BucketId(0), BucketId(999)] {
        assert_eq!(phase_of(&s, 1, b, BucketFacts::default()), Phase::Serving);
        let plan = write_plan(&s, 1, b, BucketFacts::default(), NodeFacts::default()).expect("writable");
        assert!(!plan.has_copies());
    }
    assert_eq!(phase_of(&ClusterState::default(), 1, BucketId(0), BucketFacts::default()), Phase::NoMap);
}

#[test]
fn writes_name_the_replica_holder_and_the_shadow_of_a_moved_bucket() {
    // Two members; the second pulls half the buckets: moved ones have a shadow on node 1.
    let s = history(&[Step::Join, Step::EndTransition, Step::Move(1)]);
    let moved = BucketId::all().find(|&b| s.shadow_of(b) == Some(1)).expect("a moved bucket");
    let plan = write_plan(&s, 2, moved, BucketFacts::default(), NodeFacts::default()).expect("node 2 writes it");
    assert_eq!(plan.replica.as_ref().map(|r| r.node), Some(1), "node 1 holds node 2's replica");
    assert_eq!(plan.shadow.as_ref().map(|r| r.node), Some(1));
    assert_eq!(plan.epoch, s.epoch_of(moved));
    assert_eq!(phase_of(&s, 1, moved, BucketFacts::default()), Phase::Shadow { owner: 2 });
    let still = BucketId::all().find(|&b| s.map.owner_of(b) == Some(1) && s.incoming_of(2).iter().any(|x| x.0 == b));
    let still = still.expect("a bucket still to move");
    assert_eq!(phase_of(&s, 2, still, BucketFacts::default()), Phase::Incoming { from: 1 });
    assert!(matches!(
        write_plan(&s, 2, still, BucketFacts::default(), NodeFacts::default()),
        Err(DataError::NotOwner { .. })
    ));
}

#[test]
fn a_node_refuses_writes_while_failed_leaving_draining_or_cut_off_in_that_order() {
    let s = testing::bootstrapped();
    let b = BucketId(3);
    let refusal = |n: NodeFacts| write_plan(&s, 1, b, BucketFacts::default(), n).err();
    assert_eq!(refusal(node(true, true, true, Some((1, 3)))), Some(DataError::NodeFailed));
    assert_eq!(refusal(node(false, true, true, Some((1, 3)))), Some(DataError::NodeLeaving));
    assert_eq!(refusal(node(false, false, true, Some((1, 3)))), Some(DataError::NodeDraining));
    assert_eq!(refusal(node(false, false, false, Some((1, 3)))), Some(DataError::NoQuorum { heard: 1, members: 3 }));
    assert_eq!(refusal(NodeFacts::default()), None);
}

#[test]
fn a_node_without_its_lease_serves_no_read_but_one_that_stops_or_hands_over_does() {
    let s = testing::bootstrapped();
    let b = BucketId(3);
    let read = |n: NodeFacts| route_of(&s, b, Phase::Serving, Routing::default(), n, false);
    assert_eq!(read(node(false, false, false, Some((2, 5)))), Err(DataError::NoQuorum { heard: 2, members: 5 }));
    assert_eq!(read(node(true, false, false, None)), Err(DataError::NodeFailed));
    assert_eq!(read(node(false, true, true, None)), Ok(Route::Local));
    // Without a lease, a bucket served elsewhere is still forwarded: the owner decides.
    let foreign = Phase::Foreign { owner: 2 };
    assert_eq!(
        route_of(&s, b, foreign, Routing::default(), node(false, false, false, Some((1, 3))), false),
        Ok(Route::Forward { owner: 2 })
    );
}

#[test]
fn a_restoring_or_unpromoted_bucket_is_not_served_and_a_lost_one_nowhere() {
    let s = testing::bootstrapped();
    let b = BucketId(5);
    let restoring = BucketFacts { restoring: true, installed: false };
    assert_eq!(phase_of(&s, 1, b, restoring), Phase::Restoring);
    assert_eq!(
        route_of(&s, b, Phase::Restoring, Routing::default(), NodeFacts::default(), false),
        Err(DataError::Restoring(b))
    );
    // Node 2 fails: its buckets are promoted to node 1, which has not installed them yet.
    let s = history(&[
        Step::Join,
        Step::EndTransition,
        Step::Move(8),
        Step::Join,
        Step::EndTransition,
        Step::Move(8),
        Step::Fail(1),
    ]);
    let promoted = s.promotions_of(3);
    let (b, _) = *promoted.first().expect("node 3 inherits node 2's buckets");
    assert_eq!(phase_of(&s, 3, b, BucketFacts::default()), Phase::AwaitingPromotion);
    let installed = BucketFacts { restoring: false, installed: true };
    assert_eq!(phase_of(&s, 3, b, installed), Phase::AwaitingPromotion, "served once the report is committed");
    let mut reported = s.clone();
    reported.apply(&shoal_raft::ClusterCommand::Promoted { node_id: 3, buckets: vec![b.0], lost: vec![] });
    assert_eq!(phase_of(&reported, 3, b, installed), Phase::Serving);
    let mut lost = s.clone();
    testing::apply(&mut lost, &Step::Report(u64::MAX));
    assert!(lost.is_lost(b));
    for id in ids(&lost) {
        assert_eq!(phase_of(&lost, id, b, BucketFacts::default()), Phase::Lost);
    }
}

#[test]
fn forwarded_requests_are_never_forwarded_again_and_a_suspected_owner_answers_at_once() {
    let s = history(&[Step::Join, Step::EndTransition, Step::Move(8)]);
    let b = BucketId::all().find(|&b| s.map.owner_of(b) == Some(2)).expect("node 2 owns some");
    let phase = phase_of(&s, 1, b, BucketFacts::default());
    // Node 1 holds node 2's replica: a mirror, routed like any other node that does not own it.
    assert_eq!(phase, Phase::Mirror { owner: 2 });
    let forwarded = Routing { forwarded: true, redirect: false };
    assert!(matches!(route_of(&s, b, phase, forwarded, NodeFacts::default(), false), Err(DataError::NotOwner { .. })));
    assert_eq!(
        route_of(&s, b, phase, Routing::default(), NodeFacts::default(), false),
        Ok(Route::Forward { owner: 2 })
    );
    assert_eq!(
        route_of(&s, b, phase, Routing::default(), NodeFacts::default(), true),
        Err(DataError::OwnerUnreachable { owner: 2, bucket: b })
    );
    assert_eq!(
        route_of(&s, b, phase, Routing { forwarded: false, redirect: true }, NodeFacts::default(), false),
        Ok(Route::Redirect { owner: 2 })
    );
}

#[test]
fn a_buckets_mirrors_are_its_owner_and_heir_while_it_stays_put_and_a_copy_serves_only_when_fresh() {
    // Three members, settled: every bucket has two mirrors, its owner and the owner's heir.
    let s = history(&[Step::Join, Step::EndTransition, Step::Move(8), Step::Join, Step::EndTransition, Step::Move(8)]);
    assert!(s.target.is_none());
    for b in BucketId::all() {
        let (owner, holder) = mirrors_of(&s, b);
        let owner = owner.expect("owned");
        assert_eq!(holder, s.heir_of(owner));
        let holder = holder.expect("three members: a holder");
        assert_eq!(phase_of(&s, holder, b, BucketFacts::default()), Phase::Mirror { owner });
        let third = ids(&s).into_iter().find(|&n| n != owner && n != holder).expect("a third member");
        assert_eq!(phase_of(&s, third, b, BucketFacts::default()), Phase::Foreign { owner });
    }
    // Freshness of the holder's copy.
    let b = BucketId(0);
    let (Some(owner), Some(holder)) = mirrors_of(&s, b) else { panic!("mirrors") };
    let phase = phase_of(&s, holder, b, BucketFacts::default());
    let epoch = s.epoch_of(b);
    let fresh = ReplicaFacts { source: owner, epoch, lag_ms: Some(0) };
    assert_eq!(mirror_read(&s, b, phase, fresh, 0), Ok(0));
    let other_owner = ReplicaFacts { source: holder, ..fresh };
    assert_eq!(mirror_read(&s, b, phase, other_owner, 0), Err(NotFresh::NotAttached));
    let older_epoch = ReplicaFacts { epoch: epoch + 1, ..fresh };
    assert_eq!(mirror_read(&s, b, phase, older_epoch, 0), Err(NotFresh::NotAttached));
    let behind = ReplicaFacts { lag_ms: Some(300), ..fresh };
    assert_eq!(mirror_read(&s, b, phase, behind, 0), Err(NotFresh::Behind { lag_ms: Some(300) }));
    assert_eq!(mirror_read(&s, b, phase, behind, 500), Ok(300));
    let unknown = ReplicaFacts { lag_ms: None, ..fresh };
    assert_eq!(mirror_read(&s, b, phase, unknown, u64::MAX), Err(NotFresh::Behind { lag_ms: None }));
    assert_eq!(mirror_read(&s, b, Phase::Foreign { owner }, fresh, 0), Err(NotFresh::NotMirror));
    // A join starts a transition, then a state transfer: a bucket the target gives to another node has no second
    // mirror until it settles, so no read can go to a copy its new owner no longer feeds.
    let mut moving = s.clone();
    testing::apply(&mut moving, &Step::Join);
    testing::apply(&mut moving, &Step::EndTransition);
    let target = moving.target.clone().expect("a transition");
    for b in BucketId::all().filter(|&b| target.owner_of(b) != moving.map.owner_of(b)) {
        assert_eq!(mirrors_of(&moving, b).1, None, "bucket {b} moves");
        let holder = s.heir_of(s.map.owner_of(b).expect("owned")).expect("holder");
        assert!(!matches!(phase_of(&moving, holder, b, BucketFacts::default()), Phase::Mirror { .. }));
    }
}

/// The case the property below once shrank to: the joiner fails while its buckets move to it.
#[test]
fn a_move_to_a_joiner_that_failed_meanwhile_leaves_every_bucket_with_a_member() {
    use testing::Step::{EndTransition, Fail, Join, Move};
    for s in testing::states(&[Join, EndTransition, Fail(0), Move(1)]) {
        for b in BucketId::all() {
            let owner = s.map.owner_of(b).expect("every bucket has an owner");
            assert!(s.is_member(owner), "bucket {b} is owned by {owner}, not a member");
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    /// One writer per bucket in every state (so per move epoch), never a lost bucket; every
    /// owner is a member; the copies are other members; whoever must keep data keeps it.
    #[test]
    fn every_state_has_at_most_one_writer_per_bucket(steps in prop::collection::vec(testing::step(), 0..40)) {
        for s in testing::states(&steps) {
            let installed = BucketFacts { restoring: false, installed: true };
            for b in BucketId::all() {
                let writers: Vec<NodeId> = ids(&s)
                    .into_iter()
                    .filter(|&id| write_plan(&s, id, b, installed, NodeFacts::default()).is_ok())
                    .collect();
                prop_assert!(writers.len() <= 1, "bucket {b} has writers {writers:?}");
                let owner = s.map.owner_of(b).expect("every bucket has an owner");
                prop_assert!(s.is_member(owner), "bucket {b} is owned by {owner}, not a member");
                if s.is_lost(b) {
                    prop_assert!(writers.is_empty(), "lost bucket {b} is written by {writers:?}");
                }
                for &w in &writers {
                    prop_assert_eq!(s.map.owner_of(b), Some(w));
                    let plan = write_plan(&s, w, b, installed, NodeFacts::default()).expect("writable");
                    for copy in plan.replica.iter().chain(plan.shadow.iter()) {
                        prop_assert!(copy.node != w && s.is_member(copy.node), "copy {copy:?} of {b} written by {w}");
                    }
                    // Not restored yet: not written.
                    let restoring = BucketFacts { restoring: true, installed: true };
                    prop_assert!(write_plan(&s, w, b, restoring, NodeFacts::default()).is_err());
                }
                // A member away in maintenance is stopped: it keeps nothing and pulls what the
                // target gives it once it returns.
                if let Some(to) = s.target.as_ref().and_then(|t| t.owner_of(b)).filter(|&to| s.away() != Some(to)) {
                    prop_assert!(phase_of(&s, to, b, installed).keeps_active_data(), "target owner of {b} keeps it");
                }
                if let Some(shadow) = s.shadow_of(b) {
                    prop_assert!(phase_of(&s, shadow, b, installed).keeps_active_data(), "shadow of {b} keeps it");
                }
            }
        }
    }

    /// What a pull receives goes into the puller's store only while the move it pulls for
    /// runs: once a later state let the puller write the bucket (a failover promoted it there,
    /// say), no state after that lets the pull's data land.
    #[test]
    fn a_pull_lands_only_until_its_puller_may_write_the_bucket(steps in prop::collection::vec(testing::step(), 0..40)) {
        let states = testing::states(&steps);
        let installed = BucketFacts { restoring: false, installed: true };
        for (i, start) in states.iter().enumerate() {
            for b in BucketId::all().step_by(7) {
                for me in ids(start) {
                    let Some(from) = start.incoming_from(b, me) else { continue };
                    let epoch = start.epoch_of(b);
                    prop_assert!(pull_lands(start, me, b, from, epoch));
                    let mut wrote = false;
                    for later in &states[i + 1..] {
                        wrote |= write_plan(later, me, b, installed, NodeFacts::default()).is_ok();
                        prop_assert!(
                            !(wrote && pull_lands(later, me, b, from, epoch)),
                            "a pull of {} from {} by {} lands after {} could write it", b, from, me, me
                        );
                    }
                }
            }
        }
    }

    /// Writes done under a plan count on a later state only while no other node may write
    /// the bucket there: once it moved, the plan no longer holds (its writes are routed again).
    #[test]
    fn a_plan_holds_only_while_no_other_node_may_write_its_bucket(steps in prop::collection::vec(testing::step(), 0..40)) {
        let states = testing::states(&steps);
        let installed = BucketFacts { restoring: false, installed: true };
        let writes = |s: &ClusterState, id: NodeId, b: BucketId| write_plan(s, id, b, installed, NodeFacts::default()).is_ok();
        for (i, start) in states.iter().enumerate() {
            for b in BucketId::all().step_by(37) {
                for me in ids(start) {
                    let Ok(plan) = write_plan(start, me, b, installed, NodeFacts::default()) else { continue };
                    prop_assert!(plan_holds(start, me, &plan).is_ok());
                    for later in &states[i + 1..] {
                        if ids(later).into_iter().any(|o| o != me && writes(later, o, b)) {
                            prop_assert!(plan_holds(later, me, &plan).is_err(), "{}'s plan for {} holds where another writes it", me, b);
                        }
                    }
                }
            }
        }
    }

    /// A holder's period stays while it holds an owner's replica and is new when it holds it
    /// again after it stopped (it dropped its copies): an owner never counts a copy that is
    /// gone. Every current holder, and only those, has a period.
    #[test]
    fn a_holder_that_stopped_holding_is_in_a_new_period(steps in prop::collection::vec(testing::step(), 0..40)) {
        let states = testing::states(&steps);
        for pair in states.windows(2) {
            let (before, after) = (&pair[0], &pair[1]);
            for owner in after.member_ids() {
                let holders: Vec<NodeId> =
                    [after.committed_holder_of(owner), after.replica_of(owner)].into_iter().flatten().collect();
                for &h in &holders {
                    let now = after.replica_period(owner, h);
                    prop_assert!(now.is_some(), "holder {h} of {owner} has no period");
                    match before.replica_period(owner, h) {
                        Some(p) => prop_assert_eq!(now, Some(p), "holder {} of {} kept holding", h, owner),
                        None => prop_assert!(now > Some(before.next_replica_period), "a new period for {h} of {owner}"),
                    }
                }
                let with_period = after.replica_periods.get(&owner).map_or(0, |p| p.len());
                let mut distinct = holders.clone();
                distinct.dedup();
                prop_assert_eq!(with_period, distinct.len(), "only current holders of {} have a period", owner);
            }
        }
    }
}

#[test]
fn a_stopping_node_that_hears_no_majority_says_it_stops() {
    // A node that left the cluster hears nobody in its last moments: its clients should go
    // to another node, not wait for a majority.
    assert_eq!(read_refusal(node(false, false, true, Some((1, 3)))), Some(DataError::NodeDraining));
    assert_eq!(read_refusal(node(false, false, true, None)), None, "a stopping node reads while it has its lease");
    assert_eq!(
        read_refusal(node(false, false, false, Some((1, 3)))),
        Some(DataError::NoQuorum { heard: 1, members: 3 })
    );
    assert_eq!(read_refusal(node(true, false, true, Some((1, 3)))), Some(DataError::NodeFailed));
}

/// Found by the property above: during a transfer a member went into maintenance and away;
/// the target still gives it buckets, which it pulls once it returns. Meanwhile it is away,
/// keeps nothing, and every bucket it will get is served by somebody.
#[test]
fn a_target_owner_away_in_maintenance_keeps_nothing_until_it_returns() {
    use Step::*;
    let s = history(&[Join, Join, EndTransition, Move(8), Maintenance(0), Away]);
    let away = s.away().expect("a member is away");
    let target = s.target.as_ref().expect("the transfer runs");
    let installed = BucketFacts { restoring: false, installed: true };
    let given: Vec<BucketId> = BucketId::all().filter(|&b| target.owner_of(b) == Some(away)).collect();
    assert!(!given.is_empty(), "the target gives the away member buckets");
    assert!(given.iter().any(|&b| matches!(phase_of(&s, away, b, installed), Phase::Away { .. })));
    for b in given {
        assert!(matches!(phase_of(&s, away, b, installed), Phase::Away { .. } | Phase::Serving));
        let owner = s.map.owner_of(b).expect("an owner");
        assert!(
            owner == away || phase_of(&s, owner, b, installed).keeps_active_data(),
            "bucket {b} is kept by {owner}"
        );
    }
}
