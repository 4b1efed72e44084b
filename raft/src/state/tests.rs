//! `ClusterState::apply`: membership, transitions, moves, and their invariants.

use std::collections::BTreeSet;

use super::*;
use crate::distribution::BUCKET_COUNT;

fn bootstrapped(voters: u8) -> ClusterState {
    let mut s = ClusterState::default();
    s.apply(&ClusterCommand::Bootstrap {
        cluster_id: "c".into(),
        node_id: 1,
        api_addr: "a1".into(),
        peer_addr: "p1".into(),
        name: None,
        voters,
        replication: ReplicationMode::Sync,
    });
    s
}

/// Acks the pending transition from every member and ends it.
fn settle_transition(s: &mut ClusterState) {
    let to_version = s.transition.as_ref().expect("a pending transition").to.version;
    for id in s.member_ids() {
        assert_eq!(s.apply(&ClusterCommand::AckTransition { node_id: id, to_version }), CommandResponse::Done);
    }
    assert!(s.transition_acked());
    assert!(matches!(s.apply(&ClusterCommand::EndTransition { to_version }), CommandResponse::MapChanged { .. }));
}

/// Moves every bucket the target gives away, as the receivers would.
fn move_everything(s: &mut ClusterState) {
    for id in s.member_ids() {
        for (bucket, from, epoch) in s.incoming_of(id) {
            let r = s.apply(&ClusterCommand::BucketMoved { bucket: bucket.0, from, to: id, epoch });
            assert!(matches!(r, CommandResponse::MapChanged { .. }), "{r:?}");
        }
    }
}

/// Registers and admits node `n`, and ends the transition: the transfer is to run.
fn admit(s: &mut ClusterState, n: u32) -> NodeId {
    let CommandResponse::Registered { node_id } =
        s.apply(&ClusterCommand::Register { api_addr: format!("a{n}"), peer_addr: format!("p{n}"), name: None })
    else {
        panic!("register failed")
    };
    assert!(matches!(s.apply(&ClusterCommand::Admit { node_id, force: false }), CommandResponse::MapChanged { .. }));
    settle_transition(s);
    node_id
}

fn join(s: &mut ClusterState, n: u32) -> NodeId {
    let node_id = admit(s, n);
    move_everything(s);
    node_id
}

fn leave(s: &mut ClusterState, node_id: NodeId) {
    assert!(matches!(s.apply(&ClusterCommand::Remove { node_id, force: false }), CommandResponse::MapChanged { .. }));
    settle_transition(s);
    move_everything(s);
}

fn counts(s: &ClusterState) -> Vec<usize> {
    let mut c: Vec<usize> = s.map.counts().into_values().collect();
    c.sort();
    c
}

#[test]
fn a_join_keeps_the_stable_map_until_every_member_acknowledged() {
    let mut s = bootstrapped(3);
    let CommandResponse::Registered { node_id } =
        s.apply(&ClusterCommand::Register { api_addr: "a2".into(), peer_addr: "p2".into(), name: None })
    else {
        panic!()
    };
    let before = s.map.clone();
    s.apply(&ClusterCommand::Admit { node_id, force: false });
    assert_eq!(s.map, before, "clients keep the stable map during the transition");
    assert!(s.target.is_none() && s.transfer_flag);
    let to_version = s.transition.as_ref().map(|t| t.to.version).unwrap_or_default();
    s.apply(&ClusterCommand::AckTransition { node_id: 1, to_version });
    assert!(!s.transition_acked(), "node 2 has not acknowledged yet");
    assert!(matches!(
        s.apply(&ClusterCommand::AckTransition { node_id: 1, to_version: 99 }),
        CommandResponse::Rejected { .. }
    ));
    s.apply(&ClusterCommand::AckTransition { node_id, to_version });
    s.apply(&ClusterCommand::EndTransition { to_version });
    assert_eq!(s.map, before, "ending the transition moves no bucket by itself");
    assert_eq!(s.incoming_of(node_id).len(), 500);
    move_everything(&mut s);
    assert_eq!(counts(&s), vec![500, 500]);
    assert!(s.target.is_none() && !s.transfer_flag && s.transition.is_none());
}

#[test]
fn every_move_bumps_the_serving_map_version() {
    let mut s = bootstrapped(3);
    let v = s.map.version;
    join(&mut s, 2);
    assert_eq!(s.map.version, v + 500);
}

#[test]
fn stale_and_aborted_moves_are_rejected() {
    let mut s = bootstrapped(3);
    let CommandResponse::Registered { node_id } =
        s.apply(&ClusterCommand::Register { api_addr: "a2".into(), peer_addr: "p2".into(), name: None })
    else {
        panic!()
    };
    s.apply(&ClusterCommand::Admit { node_id, force: false });
    let (bucket, from, epoch) = {
        let before_end = s.incoming_of(node_id);
        assert!(before_end.is_empty(), "nothing moves before the transition ends");
        settle_transition(&mut s);
        s.incoming_of(node_id)[0]
    };
    assert!(matches!(
        s.apply(&ClusterCommand::BucketMoved { bucket: bucket.0, from, to: node_id, epoch: epoch + 1 }),
        CommandResponse::Rejected { .. }
    ));
    assert_eq!(s.apply(&ClusterCommand::AbortMove { bucket: bucket.0, epoch }), CommandResponse::Done);
    let late = s.apply(&ClusterCommand::BucketMoved { bucket: bucket.0, from, to: node_id, epoch });
    assert!(matches!(late, CommandResponse::Rejected { .. }), "a move started before the abort is dead: {late:?}");
    assert_eq!(s.map.owner_of(bucket), Some(from));
    let retry = s.apply(&ClusterCommand::BucketMoved { bucket: bucket.0, from, to: node_id, epoch: epoch + 1 });
    assert!(matches!(retry, CommandResponse::MapChanged { .. }));
    assert!(
        matches!(
            s.apply(&ClusterCommand::BucketMoved { bucket: bucket.0, from, to: node_id, epoch: epoch + 2 }),
            CommandResponse::Rejected { .. }
        ),
        "a bucket moves once"
    );
}

#[test]
fn membership_changes_wait_for_a_running_transfer_unless_forced() {
    let mut s = bootstrapped(3);
    let reg = |s: &mut ClusterState, n: u32| match s.apply(&ClusterCommand::Register {
        api_addr: format!("a{n}"),
        peer_addr: format!("p{n}"),
        name: None,
    }) {
        CommandResponse::Registered { node_id } => node_id,
        other => panic!("{other:?}"),
    };
    let two = reg(&mut s, 2);
    let three = reg(&mut s, 3);
    s.apply(&ClusterCommand::Admit { node_id: two, force: false });
    assert!(matches!(s.apply(&ClusterCommand::Admit { node_id: three, force: false }), CommandResponse::Busy { .. }));
    assert!(!s.is_member(three), "a refused change changes nothing");
    settle_transition(&mut s);
    assert!(matches!(s.apply(&ClusterCommand::Remove { node_id: 1, force: false }), CommandResponse::Busy { .. }));
    // Forced: the new pending map starts from the target, so moves in flight stay valid.
    assert!(matches!(
        s.apply(&ClusterCommand::Admit { node_id: three, force: true }),
        CommandResponse::MapChanged { .. }
    ));
    settle_transition(&mut s);
    move_everything(&mut s);
    assert_eq!(counts(&s), vec![333, 333, 334]);
    assert!(!s.transfer_flag);
    // The stuck detector can clear the flag while buckets remain to move.
    let four = reg(&mut s, 4);
    s.apply(&ClusterCommand::Admit { node_id: four, force: false });
    settle_transition(&mut s);
    assert!(s.membership_busy().is_some());
    s.apply(&ClusterCommand::ClearTransferFlag { reason: "stuck".into() });
    assert!(s.membership_busy().is_none());
    assert!(s.target.is_some(), "the target stays: transfer may still finish");
}

#[test]
fn a_leaving_member_serves_until_its_buckets_moved_then_is_retired() {
    let mut s = bootstrapped(3);
    join(&mut s, 2);
    join(&mut s, 3);
    s.apply(&ClusterCommand::Remove { node_id: 2, force: false });
    assert!(s.is_member(2) && s.member_of(2).is_some_and(|m| m.leaving));
    assert_eq!(s.replica_of(1), Some(2), "the leaver keeps its replica until it is retired");
    assert_eq!(s.replica_of(2), Some(3));
    settle_transition(&mut s);
    assert!(s.is_member(2), "still serving");
    let owned_by_2 = s.map.buckets_of(2).len();
    assert!(owned_by_2 > 0);
    move_everything(&mut s);
    assert!(!s.is_member(2) && s.retired.contains(&2));
    assert_eq!(counts(&s), vec![500, 500]);
    assert!(matches!(s.apply(&ClusterCommand::Admit { node_id: 2, force: true }), CommandResponse::Rejected { .. }));
}

#[test]
fn replica_on_follows_join_order_and_wraps_to_the_first() {
    let mut s = bootstrapped(3);
    assert_eq!(s.replica_of(1), None);
    join(&mut s, 2);
    join(&mut s, 3);
    assert_eq!((s.replica_of(1), s.replica_of(2), s.replica_of(3)), (Some(2), Some(3), Some(1)));
    leave(&mut s, 2);
    assert_eq!((s.replica_of(1), s.replica_of(3)), (Some(3), Some(1)));
}

#[test]
fn ids_are_never_reused_and_retired_ids_cannot_be_admitted() {
    let mut s = bootstrapped(3);
    let two = join(&mut s, 2);
    leave(&mut s, two);
    let three = join(&mut s, 3);
    assert!(three > two);
    assert!(matches!(s.apply(&ClusterCommand::Admit { node_id: two, force: false }), CommandResponse::Rejected { .. }));
    assert!(s.retired.contains(&two));
}

#[test]
fn the_oldest_learner_becomes_a_voter_when_a_voter_leaves() {
    let mut s = bootstrapped(3);
    for n in 2..=6 {
        join(&mut s, n);
    }
    assert_eq!(s.desired_voters(), BTreeSet::from([1, 2, 3]));
    s.apply(&ClusterCommand::Remove { node_id: 2, force: false });
    assert_eq!(s.desired_voters(), BTreeSet::from([1, 3, 4]), "demoted as soon as it starts leaving");
}

#[test]
fn the_last_member_cannot_leave_and_rejections_change_nothing() {
    let mut s = bootstrapped(3);
    let before = s.clone();
    assert!(matches!(s.apply(&ClusterCommand::Remove { node_id: 1, force: true }), CommandResponse::Rejected { .. }));
    assert!(matches!(s.apply(&ClusterCommand::Admit { node_id: 9, force: true }), CommandResponse::Rejected { .. }));
    assert!(matches!(s.apply(&ClusterCommand::EndTransition { to_version: 2 }), CommandResponse::Rejected { .. }));
    assert_eq!(s, before);
}

#[test]
fn maps_stay_valid_through_joins_and_leaves() {
    let mut s = bootstrapped(3);
    let mut ids = vec![1];
    for n in 2..=7 {
        ids.push(join(&mut s, n));
        s.map.check(&s.member_ids()).expect("valid");
        assert_eq!(s.map.owners.len(), BUCKET_COUNT);
    }
    for id in [3, 1, 6] {
        leave(&mut s, id);
        s.map.check(&s.member_ids()).expect("valid");
        let c = counts(&s);
        assert!(c[c.len() - 1] - c[0] <= 1, "{c:?}");
    }
}

#[test]
fn the_previous_owner_holds_a_shadow_until_the_transfer_is_complete() {
    let mut s = bootstrapped(3);
    let node_id = admit(&mut s, 2);
    let incoming = s.incoming_of(node_id);
    let (first, from, epoch) = incoming[0];
    s.apply(&ClusterCommand::BucketMoved { bucket: first.0, from, to: node_id, epoch });
    assert_eq!(s.shadow_of(first), Some(1), "node 1 shadows what it handed over");
    assert_eq!(s.shadow_of(incoming[1].0), None, "not moved yet: node 1 serves it");
    move_everything(&mut s);
    assert!(s.target.is_none());
    assert_eq!(s.shadow_of(first), None, "shadows end with the transfer");
    assert!(s.handoffs.is_empty());
}

fn three_nodes() -> ClusterState {
    let mut s = bootstrapped(3);
    join(&mut s, 2);
    join(&mut s, 3);
    s
}

#[test]
fn a_failed_member_s_buckets_go_to_its_replica_holder_at_once() {
    let mut s = three_nodes();
    let of_2 = s.map.buckets_of(2);
    let version = s.map.version;
    let r = s.apply(&ClusterCommand::NodeFailed { node_id: 2 });
    assert!(matches!(r, CommandResponse::MapChanged { .. }), "{r:?}");
    assert!(!s.is_member(2) && s.failed.contains(&2));
    assert!(s.map.version > version);
    for b in &of_2 {
        assert_eq!(s.map.owner_of(*b), Some(3), "node 3 held node 2's replica");
        assert_eq!(s.promoted.get(&b.0), Some(&2));
    }
    assert_eq!(s.promotions_of(3).len(), of_2.len());
    assert!(s.transition.is_some(), "a rebalance without the failed node starts");
    assert_eq!(s.replica_of(3), Some(1));
    assert_eq!(
        s.apply(&ClusterCommand::NodeFailed { node_id: 2 }),
        CommandResponse::MapChanged { map_version: s.map.version }
    );
    settle_transition(&mut s);
    move_everything(&mut s);
    assert_eq!(counts(&s), vec![500, 500]);
    assert!(matches!(s.apply(&ClusterCommand::Admit { node_id: 2, force: true }), CommandResponse::Rejected { .. }));
}

#[test]
fn a_stale_move_of_a_promoted_bucket_is_rejected() {
    let mut s = three_nodes();
    s.apply(&ClusterCommand::Remove { node_id: 1, force: false });
    settle_transition(&mut s);
    let (bucket, from, epoch) = s.incoming_of(2).into_iter().find(|(_, f, _)| *f == 1).expect("2 receives from 1");
    s.apply(&ClusterCommand::NodeFailed { node_id: 1 });
    assert_eq!(s.map.owner_of(bucket), Some(2), "node 2 held node 1's replica");
    let r = s.apply(&ClusterCommand::BucketMoved { bucket: bucket.0, from, to: 2, epoch });
    assert!(matches!(r, CommandResponse::Rejected { .. }), "{r:?}");
}

#[test]
fn a_move_to_a_receiver_that_failed_meanwhile_is_rejected() {
    let mut s = bootstrapped(3);
    join(&mut s, 2);
    let node_id = admit(&mut s, 3);
    let (bucket, from, epoch) = s.incoming_of(node_id)[0];
    s.apply(&ClusterCommand::NodeFailed { node_id });
    let r = s.apply(&ClusterCommand::BucketMoved { bucket: bucket.0, from, to: node_id, epoch });
    assert!(matches!(r, CommandResponse::Rejected { .. }), "{r:?}");
    assert_eq!(s.map.owner_of(bucket), Some(from), "the sender keeps serving it");
}

#[test]
fn the_heir_reports_what_it_held_and_the_rest_is_lost_until_cleared() {
    let mut s = three_nodes();
    let of_1 = s.map.buckets_of(1);
    s.apply(&ClusterCommand::NodeFailed { node_id: 1 });
    let (kept, gone) = of_1.split_at(10);
    let kept: Vec<u16> = kept.iter().map(|b| b.0).collect();
    let gone: Vec<u16> = gone.iter().map(|b| b.0).collect();
    s.apply(&ClusterCommand::Promoted { node_id: 2, buckets: kept.clone(), lost: gone.clone() });
    assert!(s.promoted.is_empty());
    assert!(s.is_lost(BucketId(gone[0])) && !s.is_lost(BucketId(kept[0])));
    assert_eq!(s.lost.len(), gone.len());
    let cleared = s.apply(&ClusterCommand::ClearLost { buckets: vec![gone[0], kept[0]] });
    assert_eq!(cleared, CommandResponse::Cleared { buckets: vec![gone[0]] }, "only lost buckets are cleared");
    assert_eq!(s.lost.len(), gone.len() - 1);
    let cleared = s.apply(&ClusterCommand::ClearLost { buckets: vec![] });
    let mut rest = gone[1..].to_vec();
    rest.sort();
    assert_eq!(cleared, CommandResponse::Cleared { buckets: rest }, "an empty list clears every lost bucket");
    assert!(s.lost.is_empty());
}

#[test]
fn a_lost_bucket_s_last_server_is_the_member_that_served_it_and_only_its_copy_brings_it_back() {
    // Five members; node 1 and the holder of its replica, node 2, are cut off together.
    let mut s = bootstrapped(5);
    for n in 2..=5 {
        join(&mut s, n);
    }
    let of_1: Vec<u16> = s.map.buckets_of(1).iter().map(|b| b.0).collect();
    assert_eq!(s.replica_of(1), Some(2));
    // Node 1 fails first: its heir is node 2, which cannot install anything (it is cut off
    // too) and fails next; node 3, the holder of node 2's replica, inherits and has no copy.
    s.apply(&ClusterCommand::NodeFailed { node_id: 1 });
    assert!(of_1.iter().all(|b| s.last_server.get(b) == Some(&1)));
    s.apply(&ClusterCommand::NodeFailed { node_id: 2 });
    let heir = s.map.owner_of(BucketId(of_1[0])).expect("an owner");
    assert!(of_1.iter().all(|b| s.last_server.get(b) == Some(&1)), "node 2 never served them");
    s.apply(&ClusterCommand::Promoted { node_id: heir, buckets: vec![], lost: of_1.clone() });
    assert!(of_1.iter().all(|b| s.lost.contains(b)));
    // The failures began a transition: lost buckets move (empty) like the others, and keep
    // their last server, so it gives them back to their new owners.
    settle_transition(&mut s);
    move_everything(&mut s);
    assert!(of_1.iter().all(|b| s.lost.contains(b) && s.last_server.get(b) == Some(&1)));
    let lost_of_1 = s.lost_of(1);
    assert_eq!(lost_of_1.len(), of_1.len());
    assert!(lost_of_1.iter().any(|&(_, owner)| owner != heir), "some moved on");
    let heir = lost_of_1[0].1;
    assert!(s.lost_of(2).is_empty(), "node 2 holds no newest copy of them");
    // Another member's copy, or another owner's install, changes nothing.
    let first = &lost_of_1[0].0 .0;
    let rest: Vec<u16> = lost_of_1[1..].iter().map(|(b, _)| b.0).collect();
    s.apply(&ClusterCommand::Found { owner: heir, from: 2, buckets: vec![*first], heir: None });
    let other = s.member_ids().into_iter().find(|&m| m != heir).expect("another member");
    s.apply(&ClusterCommand::Found { owner: other, from: 1, buckets: vec![*first], heir: None });
    assert!(s.is_lost(BucketId(*first)));
    // The owner sent the copy to its heir first: a `Found` naming a heir that is no longer
    // the owner's (or in another holding period) changes nothing (that heir may have dropped
    // the copy).
    let owner_heir = s.heir_of(heir).expect("the owner has an heir");
    let period = s.replica_period(heir, owner_heir).expect("a holding period");
    let stale = Some((owner_heir, period + 1));
    s.apply(&ClusterCommand::Found { owner: heir, from: 1, buckets: vec![*first], heir: stale });
    assert!(s.is_lost(BucketId(*first)), "the heir's holding period changed");
    // Node 1 gives its copies back: they serve again, in a new ownership period.
    let epoch = s.epoch_of(BucketId(*first));
    let checked = Some((owner_heir, period));
    s.apply(&ClusterCommand::Found { owner: heir, from: 1, buckets: vec![*first], heir: checked });
    assert!(!s.is_lost(BucketId(*first)) && !s.last_server.contains_key(first));
    assert_eq!(s.epoch_of(BucketId(*first)), epoch + 1, "a move begun before cannot flip it");
    assert_eq!(s.lost_of(1).len(), rest.len());
    // A lost bucket promoted again (its owner fails) keeps its last server.
    let heir = s.map.owner_of(BucketId(rest[0])).expect("an owner");
    s.apply(&ClusterCommand::NodeFailed { node_id: heir });
    let rest: Vec<u16> = rest.into_iter().filter(|&b| s.promoted.contains_key(&b)).collect();
    assert!(!rest.is_empty());
    assert!(rest.iter().all(|b| s.last_server.get(b) == Some(&1) && s.lost.contains(b)));
    s.apply(&ClusterCommand::ClearLost { buckets: vec![] });
    assert!(s.lost.is_empty() && rest.iter().all(|b| !s.last_server.contains_key(b)));
}

#[test]
fn a_bucket_found_again_no_longer_counts_its_transfer_shadow_as_a_copy() {
    // A bucket moved in the running transfer (its old owner keeps a shadow), then lost, then
    // given back by its last server: the shadow never got the items given back, so a
    // failover of the owner must find no shadow to serve (simulation seed 6082, with one more
    // task per node, lost an acknowledged write through it).
    let mut s = three_nodes();
    let bucket = BucketId(350);
    let owner = s.map.owner_of(bucket).expect("an owner");
    let shadow = s.member_ids().into_iter().find(|&m| m != owner).expect("another member");
    let last = s.member_ids().into_iter().find(|&m| m != owner && m != shadow).expect("a third member");
    s.handoffs.insert(bucket.0, shadow);
    s.lost.insert(bucket.0);
    s.last_server.insert(bucket.0, last);
    assert_eq!(s.shadow_of(bucket), Some(shadow));
    s.apply(&ClusterCommand::Found { owner, from: last, buckets: vec![bucket.0], heir: None });
    assert!(!s.is_lost(bucket));
    assert_eq!(s.shadow_of(bucket), None, "the shadow is no complete copy any more");
}

#[test]
fn a_leaver_hands_its_buckets_to_its_replica_holder_and_retires() {
    let mut s = three_nodes();
    assert!(matches!(s.apply(&ClusterCommand::HandOver { node_id: 2, heir: None }), CommandResponse::Rejected { .. }));
    s.apply(&ClusterCommand::Remove { node_id: 2, force: false });
    settle_transition(&mut s);
    let of_2 = s.map.buckets_of(2);
    assert!(!of_2.is_empty());
    s.apply(&ClusterCommand::HandOver { node_id: 2, heir: None });
    assert!(of_2.iter().all(|b| s.map.owner_of(*b) == Some(3)));
    assert!(s.retired.contains(&2) && !s.is_member(2), "it serves nothing: retired");
    move_everything(&mut s);
    assert_eq!(counts(&s), vec![500, 500]);
}

#[test]
fn the_replication_mode_is_set_at_bootstrap_and_changed_later() {
    let mut s = bootstrapped(3);
    assert_eq!(s.settings.replication, ReplicationMode::Sync);
    s.apply(&ClusterCommand::SetReplication { mode: ReplicationMode::Async });
    assert_eq!(s.settings.replication, ReplicationMode::Async);
    let mut fresh = ClusterState::default();
    assert!(matches!(
        fresh.apply(&ClusterCommand::SetReplication { mode: ReplicationMode::Async }),
        CommandResponse::Rejected { .. }
    ));
}

#[test]
fn commands_and_state_written_before_names_existed_still_read() {
    let old: ClusterCommand =
        serde_json::from_str(r#"{"type":"register","api_addr":"a","peer_addr":"p"}"#).expect("old register");
    assert_eq!(old, ClusterCommand::Register { api_addr: "a".into(), peer_addr: "p".into(), name: None });
    let old: ClusterCommand = serde_json::from_str(
        r#"{"type":"bootstrap","cluster_id":"c","node_id":1,"api_addr":"a","peer_addr":"p","voters":3}"#,
    )
    .expect("old bootstrap");
    assert!(matches!(old, ClusterCommand::Bootstrap { name: None, .. }));
    let member: Member =
        serde_json::from_str(r#"{"id":1,"api_addr":"a","peer_addr":"p","join_seq":1}"#).expect("old member");
    assert_eq!(member.name, None);
}

#[test]
fn a_new_owner_that_fails_leaves_the_shadow_of_its_pulled_buckets_to_its_heir() {
    let mut s = bootstrapped(3);
    join(&mut s, 2);
    let node_id = admit(&mut s, 3);
    let (bucket, from, epoch) = s.incoming_of(node_id)[0];
    s.apply(&ClusterCommand::BucketMoved { bucket: bucket.0, from, to: node_id, epoch });
    let heir = s.replica_of(node_id).expect("heir");
    s.apply(&ClusterCommand::NodeFailed { node_id });
    assert_eq!(s.map.owner_of(bucket), Some(heir), "the heir serves the failed owner's bucket");
    assert_eq!(s.handoffs.get(&bucket.0), Some(&from), "the shadow of the running transfer is kept");
    assert!(s.promoted.contains_key(&bucket.0));
}

#[test]
fn a_stopping_member_keeps_its_vote_and_the_next_voter_succeeds_it() {
    let mut s = bootstrapped(3);
    for n in 2..=4 {
        join(&mut s, n);
    }
    assert_eq!(s.desired_voters(), BTreeSet::from([1, 2, 3]));
    assert_eq!(s.successor_of(1), Some(2));
    assert_eq!(s.successor_of(3), Some(1), "the ring of voters wraps");
    assert_eq!(s.apply(&ClusterCommand::SetDraining { node_id: 1, draining: true }), CommandResponse::Done);
    assert_eq!(s.desired_voters(), BTreeSet::from([1, 2, 3]), "a stopping member keeps its vote");
    assert_eq!(s.successor_of(3), Some(2), "a stopping voter succeeds nobody");
    // Every voter stops (a full stop): the voters stay, so any two of them form a majority
    // when they come back; nobody is left to succeed a leader.
    for id in 1..=3 {
        s.apply(&ClusterCommand::SetDraining { node_id: id, draining: true });
    }
    assert_eq!(s.desired_voters(), BTreeSet::from([1, 2, 3]));
    assert_eq!(s.successor_of(1), None);
    s.apply(&ClusterCommand::SetDraining { node_id: 2, draining: false });
    assert_eq!(s.successor_of(1), Some(2), "a member that runs again succeeds");
    assert!(matches!(
        s.apply(&ClusterCommand::SetDraining { node_id: 9, draining: true }),
        CommandResponse::Rejected { .. }
    ));
}

#[test]
fn a_member_failed_while_stopping_leaves_buckets_without_a_copy_empty_not_lost() {
    let mut s = three_nodes();
    let of_3: Vec<u16> = s.map.buckets_of(3).iter().map(|b| b.0).collect();
    s.apply(&ClusterCommand::SetDraining { node_id: 3, draining: true });
    s.apply(&ClusterCommand::NodeFailed { node_id: 3 });
    assert!(s.failed_stopped.contains(&3) && !s.draining.contains(&3));
    let heir = s.map.owner_of(BucketId(of_3[0])).expect("an owner");
    s.apply(&ClusterCommand::Promoted { node_id: heir, buckets: vec![], lost: of_3.clone() });
    assert!(s.lost.is_empty(), "its process ended: every copy died, the buckets serve again, empty");
    assert!(of_3.iter().all(|b| !s.promoted.contains_key(b)));
    // A member failed while it ran may still hold its copy: what its heir lacks is lost.
    settle_transition(&mut s);
    move_everything(&mut s);
    let victim = s.member_ids()[0];
    let of_victim: Vec<u16> = s.map.buckets_of(victim).iter().map(|b| b.0).collect();
    assert!(!of_victim.is_empty());
    s.apply(&ClusterCommand::NodeFailed { node_id: victim });
    let heir = s.map.owner_of(BucketId(of_victim[0])).expect("an owner");
    s.apply(&ClusterCommand::Promoted { node_id: heir, buckets: vec![], lost: of_victim.clone() });
    assert!(of_victim.iter().all(|b| s.lost.contains(b)), "lost until cleared");
}

/// A bucket lost before (its newest copy is with its last server, which will give it back)
/// stays lost when the member it went to stops and is failed: no copy of it died in that stop.
#[test]
fn a_bucket_lost_before_a_member_stops_stays_lost_with_its_last_server() {
    let mut s = three_nodes();
    join(&mut s, 4);
    let victim = s.member_ids()[0];
    let of_victim: Vec<u16> = s.map.buckets_of(victim).iter().map(|b| b.0).collect();
    s.apply(&ClusterCommand::NodeFailed { node_id: victim });
    let heir = s.map.owner_of(BucketId(of_victim[0])).expect("an owner");
    s.apply(&ClusterCommand::Promoted { node_id: heir, buckets: vec![], lost: of_victim.clone() });
    assert!(of_victim.iter().all(|b| s.lost.contains(b) && s.last_server.get(b) == Some(&victim)));
    // The member that got them stops and is failed; the next one has no copy of them either.
    s.apply(&ClusterCommand::SetDraining { node_id: heir, draining: true });
    s.apply(&ClusterCommand::NodeFailed { node_id: heir });
    assert!(s.failed_stopped.contains(&heir));
    let next = s.map.owner_of(BucketId(of_victim[0])).expect("an owner");
    assert_ne!(next, heir);
    assert!(of_victim.iter().all(|&b| !s.copies_died_with_their_process(b)), "their copy is with node {victim}");
    s.apply(&ClusterCommand::Promoted { node_id: next, buckets: vec![], lost: of_victim.clone() });
    assert!(of_victim.iter().all(|b| s.lost.contains(b) && s.last_server.get(b) == Some(&victim)), "still lost");
}

#[test]
fn a_replica_holder_changes_only_when_the_owner_says_the_new_one_is_complete() {
    let mut s = three_nodes();
    for (owner, holder) in [(1, 2), (2, 3), (3, 1)] {
        assert_eq!(s.apply(&ClusterCommand::ReplicaMoved { owner, holder }), CommandResponse::Done);
        assert_eq!(s.committed_holder_of(owner), Some(holder));
    }
    // Node 4 joins after node 3: join order now names node 4 for node 3's replica, but node 1
    // keeps it (and inherits node 3's buckets) until node 3 says node 4 is complete.
    join(&mut s, 4);
    assert_eq!(s.replica_of(3), Some(4));
    assert_eq!(s.committed_holder_of(3), Some(1));
    assert_eq!(s.heir_of(3), Some(1));
    let r = s.apply(&ClusterCommand::ReplicaMoved { owner: 3, holder: 1 });
    assert!(matches!(r, CommandResponse::Rejected { .. }), "join order does not name node 1 any more: {r:?}");
    assert_eq!(s.apply(&ClusterCommand::ReplicaMoved { owner: 3, holder: 4 }), CommandResponse::Done);
    assert_eq!(s.heir_of(3), Some(4));
    // A member with no complete holder yet (node 4) is inherited by the one join order names.
    assert_eq!((s.committed_holder_of(4), s.heir_of(4)), (None, Some(1)));
}

#[test]
fn a_failed_member_s_buckets_go_to_the_holder_of_its_complete_replica() {
    let mut s = three_nodes();
    s.apply(&ClusterCommand::ReplicaMoved { owner: 3, holder: 1 });
    join(&mut s, 4);
    let of_3 = s.map.buckets_of(3);
    s.apply(&ClusterCommand::NodeFailed { node_id: 3 });
    for b in &of_3 {
        assert_eq!(s.map.owner_of(*b), Some(1), "node 1 held node 3's complete replica, not node 4");
    }
    assert!(!s.replica_holders.contains_key(&3), "a failed member's holdings are forgotten");
    // The holder fails: its owners have no complete holder until they say so again.
    s.apply(&ClusterCommand::ReplicaMoved { owner: 2, holder: 4 });
    assert_eq!(s.replica_of(2), Some(4));
    s.apply(&ClusterCommand::NodeFailed { node_id: 4 });
    assert_eq!(s.committed_holder_of(2), None);
}

#[test]
fn a_holder_that_stops_and_starts_again_holding_a_replica_is_in_a_new_period() {
    // The case a cluster test found: node 1 holds node 3's replica, node 4 joins and takes it
    // over (node 1 drops its copies), node 4 leaves and join order names node 1 again. The
    // copies node 3 once sent node 1 are gone: node 1 is in a new period, so node 3 does not
    // count them any more.
    let mut s = three_nodes();
    let first = s.replica_period(3, 1).expect("node 1 holds node 3's replica");
    s.apply(&ClusterCommand::ReplicaMoved { owner: 3, holder: 1 });
    assert_eq!(s.replica_period(3, 1), Some(first), "committing the same holder keeps its period");
    join(&mut s, 4);
    assert_eq!(s.replica_period(3, 1), Some(first), "still the complete holder while node 4 fills up");
    let of_4 = s.replica_period(3, 4).expect("join order names node 4");
    assert_ne!(of_4, first);
    s.apply(&ClusterCommand::ReplicaMoved { owner: 3, holder: 4 });
    assert_eq!(s.replica_period(3, 1), None, "node 1 holds node 3's replica no more");
    leave(&mut s, 4);
    let again = s.replica_period(3, 1).expect("join order names node 1 again");
    assert!(again > of_4, "a new period: {again} after {of_4}");
    // Every current holder of every member, and only those, has a period.
    for owner in s.member_ids() {
        let holders: BTreeSet<NodeId> =
            [s.committed_holder_of(owner), s.replica_of(owner)].into_iter().flatten().collect();
        let periods: BTreeSet<NodeId> = s.replica_periods.get(&owner).into_iter().flatten().map(|(&h, _)| h).collect();
        assert_eq!(holders, periods, "owner {owner}");
    }
}

#[test]
fn a_hand_over_checked_at_a_holder_that_changed_since_is_refused() {
    let mut s = three_nodes();
    s.apply(&ClusterCommand::ReplicaMoved { owner: 3, holder: 1 });
    let period = s.replica_period(3, 1).expect("node 1 holds node 3's replica");
    assert!(matches!(
        s.apply(&ClusterCommand::Remove { node_id: 3, force: false }),
        CommandResponse::MapChanged { .. }
    ));
    settle_transition(&mut s);
    let before = s.clone();
    for checked in [(2, period), (1, period + 100)] {
        let r = s.apply(&ClusterCommand::HandOver { node_id: 3, heir: Some(checked) });
        assert!(matches!(r, CommandResponse::Rejected { .. }), "{checked:?}: {r:?}");
        assert_eq!(s, before, "a refused hand-over changes nothing");
    }
    let r = s.apply(&ClusterCommand::HandOver { node_id: 3, heir: Some((1, period)) });
    assert!(matches!(r, CommandResponse::MapChanged { .. }), "{r:?}");
    assert!(s.map.buckets_of(3).is_empty());
}

#[test]
fn an_entry_of_earlier_versions_marking_lost_buckets_replays_as_before() {
    let mut s = three_nodes();
    let of_2: Vec<u16> = s.map.buckets_of(2).iter().map(|b| b.0).collect();
    let of_1 = s.map.buckets_of(1)[0].0;
    assert_eq!(
        s.apply(&ClusterCommand::BucketsLost { node_id: 2, buckets: vec![of_2[0], of_1] }),
        CommandResponse::Done
    );
    assert!(s.is_lost(BucketId(of_2[0])));
    assert!(!s.is_lost(BucketId(of_1)), "only the reporter's own buckets");
    let r = s.apply(&ClusterCommand::BucketsLost { node_id: 9, buckets: vec![of_2[1]] });
    assert!(matches!(r, CommandResponse::Rejected { .. }));
}

/// Node `node` of `s` prepares for maintenance; the member whose replica it holds moves it to
/// the next member; then it goes away, checked at its heir now.
fn enter_maintenance(s: &mut ClusterState, node: NodeId) -> CommandResponse {
    let r = s.apply(&ClusterCommand::EnterMaintenance { node_id: node, since_ms: 1_000, until_ms: 61_000 });
    if r != CommandResponse::Done {
        return r;
    }
    while let Some(owner) = s.held_by(node) {
        let holder = s.replica_of(owner).expect("a holder");
        assert_ne!(holder, node, "placement skips the member preparing for maintenance");
        assert_eq!(s.apply(&ClusterCommand::ReplicaMoved { owner, holder }), CommandResponse::Done);
    }
    let heir = s.heir_of(node).expect("an heir");
    let period = s.replica_period(node, heir).expect("a holding period");
    s.apply(&ClusterCommand::MaintenanceReady { node_id: node, heir: (heir, period) })
}

#[test]
fn a_member_in_maintenance_has_its_buckets_served_by_its_heir_and_takes_them_back_when_it_returns() {
    let mut s = three_nodes();
    s.apply(&ClusterCommand::ReplicaMoved { owner: 1, holder: 2 });
    let before = s.map.clone();
    let of_2 = s.map.buckets_of(2);
    assert_eq!(s.replica_of(1), Some(2));
    // Preparing: it serves on, and stays node 1's complete holder until node 3 has it all.
    s.apply(&ClusterCommand::EnterMaintenance { node_id: 2, since_ms: 0, until_ms: 60_000 });
    assert_eq!((s.away(), s.replica_of(1), s.committed_holder_of(1)), (None, Some(3), Some(2)));
    assert_eq!(s.map.buckets_of(2), of_2);
    let period = s.replica_period(2, 3).expect("node 3 holds node 2's replica");
    let r = s.apply(&ClusterCommand::MaintenanceReady { node_id: 2, heir: (3, period) });
    assert!(matches!(r, CommandResponse::Rejected { .. }), "node 1's only complete replica is on node 2: {r:?}");
    s.apply(&ClusterCommand::ReplicaMoved { owner: 1, holder: 3 });
    let r = s.apply(&ClusterCommand::MaintenanceReady { node_id: 2, heir: (3, period) });
    assert!(matches!(r, CommandResponse::MapChanged { .. }), "{r:?}");
    assert_eq!(s.away(), Some(2));
    assert!(s.map.buckets_of(2).is_empty(), "its heir serves its buckets");
    assert!(of_2.iter().all(|&b| s.map.owner_of(b) == Some(3) && s.promoted.contains_key(&b.0)));
    assert_eq!(s.target.as_ref().map(|t| &t.owners), Some(&before.owners), "the distribution stays");
    assert_eq!(s.replica_of(1), Some(3), "the replica it held moved to the next member");
    assert_eq!(s.committed_holder_of(1), Some(3));
    assert!(s.incoming_of(2).is_empty(), "away: it pulls nothing");
    let r = s.apply(&ClusterCommand::NodeFailed { node_id: 2 });
    assert!(matches!(r, CommandResponse::Rejected { .. }), "away on purpose, not failed: {r:?}");
    assert!(s.membership_busy().is_some(), "joins and leaves wait");
    assert!(matches!(enter_maintenance(&mut s, 1), CommandResponse::Rejected { .. }), "one at a time");
    s.apply(&ClusterCommand::Promoted { node_id: 3, buckets: of_2.iter().map(|b| b.0).collect(), lost: vec![] });
    // It comes back: it says it runs again, and pulls its buckets back from the heir.
    s.apply(&ClusterCommand::SetDraining { node_id: 2, draining: false });
    assert_eq!(s.away(), None);
    assert_eq!((s.replica_of(1), s.committed_holder_of(1)), (Some(2), Some(3)), "it takes the replica back later");
    assert_eq!(s.incoming_of(2).len(), of_2.len());
    move_everything(&mut s);
    assert_eq!(s.map.owners, before.owners);
    assert_eq!(s.maintenance, None, "over once every bucket is back");
    assert!(!s.transfer_flag && s.target.is_none());
    assert!(s.failed.is_empty());
}

#[test]
fn maintenance_is_refused_with_a_reason_while_it_cannot_be_kept() {
    let mut s = bootstrapped(3);
    join(&mut s, 2);
    assert_eq!(s.maintenance_refusal(2).map(|r| r.code()), Some("too_few_members"));
    join(&mut s, 3);
    assert_eq!(s.maintenance_refusal(9).map(|r| r.code()), Some("unknown_resource"));
    let mut joining = s.clone();
    admit(&mut joining, 4);
    assert_eq!(joining.maintenance_refusal(2).map(|r| r.code()), Some("membership_change_in_progress"));
    // The stuck detector cleared the flag: buckets are still on their way.
    joining.apply(&ClusterCommand::ClearTransferFlag { reason: "test".into() });
    assert_eq!(joining.maintenance_refusal(2).map(|r| r.code()), Some("membership_change_in_progress"));
    let mut preparing = s.clone();
    preparing.apply(&ClusterCommand::EnterMaintenance { node_id: 2, since_ms: 0, until_ms: 1 });
    let before = preparing.clone();
    let heir = preparing.heir_of(2).expect("an heir");
    let r = preparing.apply(&ClusterCommand::MaintenanceReady { node_id: 2, heir: (heir, 999) });
    assert!(matches!(r, CommandResponse::Rejected { .. }), "a holder period that changed: {r:?}");
    assert_eq!(preparing, before, "a refused entry changes nothing");
    // It restarted before it went away: the maintenance ends.
    preparing.apply(&ClusterCommand::SetDraining { node_id: 2, draining: false });
    assert_eq!(preparing.maintenance, None);
    assert!(matches!(enter_maintenance(&mut s, 2), CommandResponse::MapChanged { .. }));
    assert_eq!(s.maintenance_refusal(1).map(|r| r.code()), Some("maintenance_in_progress"));
}

#[test]
fn a_failure_or_an_end_before_the_member_returns_ends_the_maintenance_and_spares_it_no_more() {
    // Ended by an operator or by its time: the member is an ordinary one again, still owed
    // its buckets by the target.
    let mut s = three_nodes();
    enter_maintenance(&mut s, 2);
    let r = s.apply(&ClusterCommand::EndMaintenance { node_id: 1, reason: "test".into() });
    assert!(matches!(r, CommandResponse::Rejected { .. }), "node 1 is not in maintenance");
    assert_eq!(
        s.apply(&ClusterCommand::EndMaintenance { node_id: 2, reason: "expired".into() }),
        CommandResponse::Done
    );
    assert_eq!((s.away(), s.maintenance.clone()), (None, None));
    assert!(!s.incoming_of(2).is_empty(), "if it runs, it takes its buckets back");
    // Failed then: a rebalance without it; its buckets stay with the heir until they move.
    assert!(matches!(s.apply(&ClusterCommand::NodeFailed { node_id: 2 }), CommandResponse::MapChanged { .. }));
    assert!(s.transition.as_ref().is_some_and(|t| !t.to.owners.contains(&2)));

    // Another member fails while it is away (five members): the maintenance ends at once.
    let mut s = bootstrapped(5);
    for n in 2..=5 {
        join(&mut s, n);
    }
    enter_maintenance(&mut s, 2);
    s.apply(&ClusterCommand::NodeFailed { node_id: 4 });
    assert_eq!(s.maintenance, None);
    assert_eq!(s.replica_of(1), Some(2), "no longer skipped");

    // A forced leave of another member ends it too: the new map is for the members as they are.
    let mut s = three_nodes();
    admit(&mut s, 4);
    move_everything(&mut s);
    enter_maintenance(&mut s, 2);
    let r = s.apply(&ClusterCommand::Remove { node_id: 3, force: false });
    assert!(matches!(r, CommandResponse::Busy { .. }), "membership waits: {r:?}");
    assert!(matches!(s.apply(&ClusterCommand::Remove { node_id: 3, force: true }), CommandResponse::MapChanged { .. }));
    assert_eq!(s.maintenance, None);
}

#[test]
fn a_balanced_map_moves_through_a_transition_and_a_transfer_like_a_join() {
    let mut s = three_nodes();
    let from_version = s.map.version;
    // Node 1 gives its first 100 buckets to node 2.
    let mut owners = s.map.owners.clone();
    let given: Vec<usize> = (0..BUCKET_COUNT).filter(|&b| owners[b] == 1).take(100).collect();
    for &b in &given {
        owners[b] = 2;
    }
    let stale = ClusterCommand::Rebalance { from_version: from_version - 1, owners: owners.clone() };
    assert!(matches!(s.apply(&stale), CommandResponse::Rejected { .. }), "a plan made on an older map");
    let short = ClusterCommand::Rebalance { from_version, owners: owners[..10].to_vec() };
    assert!(matches!(s.apply(&short), CommandResponse::Rejected { .. }));
    let mut stranger = owners.clone();
    stranger[0] = 99;
    assert!(matches!(
        s.apply(&ClusterCommand::Rebalance { from_version, owners: stranger }),
        CommandResponse::Rejected { .. }
    ));
    let same = ClusterCommand::Rebalance { from_version, owners: s.map.owners.clone() };
    assert!(matches!(s.apply(&same), CommandResponse::Rejected { .. }), "nothing to move");
    let before = s.clone();
    let r = s.apply(&ClusterCommand::Rebalance { from_version, owners: owners.clone() });
    assert_eq!(r, CommandResponse::MapChanged { map_version: from_version + 1 });
    assert_eq!(s.map, before.map, "the serving map waits for the transition");
    assert!(s.transfer_flag);
    // A second plan, or a join, waits for it.
    let again = ClusterCommand::Rebalance { from_version, owners: owners.clone() };
    assert!(matches!(s.apply(&again), CommandResponse::Busy { .. }));
    settle_transition(&mut s);
    assert_eq!(s.incoming_of(2).len(), 100);
    assert!(matches!(s.apply(&again), CommandResponse::Busy { .. }), "never during a transfer");
    move_everything(&mut s);
    assert_eq!(s.map.owners, owners);
    assert!(s.target.is_none() && !s.transfer_flag);
    assert_eq!(s.map.version, from_version + 100, "one version per bucket moved");
    // The next join splits by count again.
    join(&mut s, 4);
    assert!(counts(&s).iter().all(|&c| c == 250), "{:?}", counts(&s));
}

#[test]
fn automatic_balancing_is_off_until_turned_on() {
    let mut s = three_nodes();
    assert!(!s.settings.auto_balance);
    assert_eq!(s.apply(&ClusterCommand::SetAutoBalance { enabled: true }), CommandResponse::Done);
    assert!(s.settings.auto_balance);
    let fresh = ClusterState::default();
    assert!(!fresh.clone().settings.auto_balance);
}

/// In a full stop every member records that it stops first: none then enters maintenance
/// (its heir and the majority would be gone), and one that prepared goes no further.
#[test]
fn maintenance_is_refused_while_another_member_stops_and_goes_no_further_once_one_starts() {
    let mut s = three_nodes();
    s.apply(&ClusterCommand::SetDraining { node_id: 3, draining: true });
    assert_eq!(s.maintenance_refusal(2).map(|r| r.code()), Some("peer_stopping"));
    let entered = s.apply(&ClusterCommand::EnterMaintenance { node_id: 2, since_ms: 0, until_ms: 60_000 });
    assert!(matches!(entered, CommandResponse::Rejected { .. }), "{entered:?}");
    // Its own stop recorded first refuses nothing.
    let mut s = three_nodes();
    s.apply(&ClusterCommand::SetDraining { node_id: 2, draining: true });
    assert_eq!(s.maintenance_refusal(2), None);
    assert_eq!(
        s.apply(&ClusterCommand::EnterMaintenance { node_id: 2, since_ms: 0, until_ms: 60_000 }),
        CommandResponse::Done
    );
    while let Some(owner) = s.held_by(2) {
        let holder = s.replica_of(owner).expect("a holder");
        s.apply(&ClusterCommand::ReplicaMoved { owner, holder });
    }
    // Preparing, when another member starts to stop: it does not go away.
    s.apply(&ClusterCommand::SetDraining { node_id: 1, draining: true });
    let heir = s.heir_of(2).expect("an heir");
    let period = s.replica_period(2, heir).expect("a period");
    let ready = s.apply(&ClusterCommand::MaintenanceReady { node_id: 2, heir: (heir, period) });
    assert!(matches!(ready, CommandResponse::Rejected { .. }), "{ready:?}");
}

/// A maintenance hands the member's buckets to its heir; if the heir restarts before it
/// reported them installed (a full stop), no copy is left anywhere (the member keeps nothing
/// while away): they serve again, empty, and are not lost — also when the maintenance ended
/// before the report.
#[test]
fn a_heir_that_restarted_before_reporting_a_maintenance_hand_over_serves_the_buckets_empty_not_lost() {
    for ended_first in [false, true] {
        let mut s = three_nodes();
        let of_2: Vec<u16> = s.map.buckets_of(2).iter().map(|b| b.0).collect();
        assert!(matches!(enter_maintenance(&mut s, 2), CommandResponse::MapChanged { .. }));
        let heir = s.maintenance.as_ref().expect("a maintenance").heir;
        if ended_first {
            s.apply(&ClusterCommand::EndMaintenance { node_id: 2, reason: "its time ran out".into() });
        }
        s.apply(&ClusterCommand::Promoted { node_id: heir, buckets: vec![], lost: of_2.clone() });
        assert!(s.lost.is_empty(), "ended first: {ended_first}: {:?}", s.lost.len());
        assert!(of_2.iter().all(|b| !s.promoted.contains_key(b) && s.map.owner_of(BucketId(*b)) == Some(heir)));
    }
    // A heir that fails before it reports: its buckets go on to the next holder as usual.
    let mut s = three_nodes();
    enter_maintenance(&mut s, 2);
    let heir = s.maintenance.as_ref().expect("a maintenance").heir;
    assert!(s.away_promotions.iter().all(|&b| s.map.owner_of(BucketId(b)) == Some(heir)));
    assert!(!s.away_promotions.is_empty());
}
