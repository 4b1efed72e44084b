//! The events of scripted histories: a join, a leave, a failure, maintenance, settings.

use super::*;
use crate::state::ReplicationMode;

/// A state and a recorder, applying commands as the state machine does.
struct Log {
    state: ClusterState,
    recorder: EventRecorder,
    index: u64,
    events: Vec<Event>,
}

impl Log {
    fn new() -> Self {
        let mut log =
            Log { state: ClusterState::default(), recorder: EventRecorder::default(), index: 0, events: vec![] };
        log.apply(ClusterCommand::Bootstrap {
            cluster_id: "c".into(),
            node_id: 1,
            api_addr: "a1".into(),
            peer_addr: "p1".into(),
            name: Some("shoal-0".into()),
            voters: 3,
            replication: ReplicationMode::Sync,
        });
        log
    }

    fn apply(&mut self, command: ClusterCommand) -> CommandResponse {
        self.index += 1;
        let before = self.state.clone();
        let response = self.state.apply(&command);
        let events = self.recorder.record(self.index, 1000 + self.index, &before, &command, &response, &self.state);
        self.events.extend(events);
        response
    }

    fn kinds(&self) -> Vec<EventKind> {
        self.events.iter().map(|e| e.kind).collect()
    }

    fn settle_transition(&mut self) {
        let to_version = self.state.transition.as_ref().map(|t| t.to.version).expect("a transition");
        for id in self.state.member_ids() {
            self.apply(ClusterCommand::AckTransition { node_id: id, to_version });
        }
        self.apply(ClusterCommand::EndTransition { to_version });
    }

    fn move_everything(&mut self) {
        for id in self.state.member_ids() {
            for (bucket, from, epoch) in self.state.incoming_of(id) {
                self.apply(ClusterCommand::BucketMoved { bucket: bucket.0, from, to: id, epoch });
            }
        }
    }

    fn join(&mut self, n: u32) -> NodeId {
        let CommandResponse::Registered { node_id } =
            self.apply(ClusterCommand::Register { api_addr: format!("a{n}"), peer_addr: format!("p{n}"), name: None })
        else {
            panic!("register refused")
        };
        self.apply(ClusterCommand::Admit { node_id, force: false });
        self.settle_transition();
        self.move_everything();
        node_id
    }

    fn moved(&self) -> usize {
        self.events.iter().flat_map(|e| &e.moves).map(|g| g.buckets.len()).sum()
    }
}

use EventKind as K;

#[test]
fn a_join_is_joined_transition_moves_in_batches_and_transfer_end() {
    let mut log = Log::new();
    assert_eq!(log.kinds(), vec![K::ClusterCreated]);
    assert!(log.events[0].message.contains("node 1 (shoal-0)"), "{}", log.events[0].message);
    log.events.clear();
    let node = log.join(2);
    // 500 buckets move to the joiner: five full batches, the last closed with the transfer.
    let expected =
        [vec![K::NodeJoined, K::TransitionBegun, K::TransitionEnded], vec![K::BucketsMoved; 5], vec![K::TransferEnded]]
            .concat();
    assert_eq!(log.kinds(), expected);
    assert_eq!(log.events[0].node, Some(node));
    assert_eq!(log.moved(), 500);
    for e in log.events.iter().filter(|e| e.kind == K::BucketsMoved) {
        assert_eq!(e.moves.len(), 1);
        assert_eq!((e.moves[0].from, e.moves[0].to), (1, node));
        assert_eq!(e.moves[0].buckets.len(), MOVE_BATCH);
        assert!(e.first_index.is_some_and(|f| f < e.index));
    }
    // Indices never decrease; the transfer's end is the last move's entry.
    assert!(log.events.windows(2).all(|w| w[0].index <= w[1].index));
    let last = log.events.last().expect("events");
    assert_eq!(last.map_version, log.state.map.version);
    assert_eq!(last.time_ms, 1000 + last.index);
}

#[test]
fn a_batch_of_moves_is_closed_by_the_next_other_event() {
    let mut log = Log::new();
    let two = log.join(2);
    let r = log.apply(ClusterCommand::Register { api_addr: "a3".into(), peer_addr: "p3".into(), name: None });
    let CommandResponse::Registered { node_id: three } = r else { panic!("{r:?}") };
    log.apply(ClusterCommand::Admit { node_id: three, force: false });
    log.settle_transition();
    log.events.clear();
    // Three moves, then a setting changes: the batch of three comes first, at that entry.
    let mut moved = 0;
    for (bucket, from, epoch) in log.state.incoming_of(three).into_iter().take(3) {
        log.apply(ClusterCommand::BucketMoved { bucket: bucket.0, from, to: three, epoch });
        moved += 1;
    }
    assert!(log.events.is_empty(), "the batch is still open");
    log.apply(ClusterCommand::SetReplication { mode: ReplicationMode::Async });
    assert_eq!(log.kinds(), vec![K::BucketsMoved, K::ConfigChanged]);
    assert_eq!(log.events[0].index, log.events[1].index);
    assert_eq!(log.moved(), moved);
    let _ = two;
}

#[test]
fn a_leave_ends_with_the_member_gone() {
    let mut log = Log::new();
    let two = log.join(2);
    log.join(3);
    log.events.clear();
    log.apply(ClusterCommand::Remove { node_id: two, force: false });
    log.settle_transition();
    log.move_everything();
    let kinds = log.kinds();
    assert_eq!(kinds[..3], [K::NodeLeaving, K::TransitionBegun, K::TransitionEnded]);
    assert_eq!(kinds[kinds.len() - 2..], [K::NodeLeft, K::TransferEnded]);
    assert!(kinds[3..kinds.len() - 2].iter().all(|k| *k == K::BucketsMoved));
    assert_eq!(log.events[kinds.len() - 2].node, Some(two));
}

#[test]
fn a_failure_names_the_heir_and_its_promotion() {
    let mut log = Log::new();
    let two = log.join(2);
    let three = log.join(3);
    log.events.clear();
    let heir = log.state.heir_of(two).expect("an heir");
    log.apply(ClusterCommand::NodeFailed { node_id: two });
    assert_eq!(log.kinds()[..2], [K::NodeFailed, K::TransitionBegun]);
    assert_eq!((log.events[0].node, log.events[0].peer), (Some(two), Some(heir)));
    let promoted: Vec<u16> = log.state.promoted.keys().copied().collect();
    let (held, lost) = promoted.split_at(promoted.len() - 2);
    log.apply(ClusterCommand::Promoted { node_id: heir, buckets: held.to_vec(), lost: lost.to_vec() });
    let tail: Vec<EventKind> = log.kinds()[2..].to_vec();
    assert_eq!(tail, vec![K::Promoted, K::BucketsLost]);
    assert_eq!(log.events[3].buckets, lost.to_vec());
    // A refused command says nothing.
    let before = log.events.len();
    log.apply(ClusterCommand::NodeFailed { node_id: 99 });
    log.apply(ClusterCommand::ClearLost { buckets: vec![] });
    assert_eq!(log.kinds()[before], K::LostCleared);
    assert_eq!(log.events.len(), before + 1);
    let _ = three;
}

#[test]
fn settings_and_draining_only_when_they_change() {
    let mut log = Log::new();
    log.events.clear();
    log.apply(ClusterCommand::SetReplication { mode: ReplicationMode::Sync });
    log.apply(ClusterCommand::SetAutoBalance { enabled: true });
    log.apply(ClusterCommand::SetAutoBalance { enabled: true });
    log.apply(ClusterCommand::SetDraining { node_id: 1, draining: true });
    log.apply(ClusterCommand::SetDraining { node_id: 1, draining: true });
    log.apply(ClusterCommand::SetDraining { node_id: 1, draining: false });
    assert_eq!(log.kinds(), vec![K::ConfigChanged, K::NodeStopping, K::NodeRunning]);
}

#[test]
fn maintenance_goes_through_its_phases() {
    let mut log = Log::new();
    let two = log.join(2);
    log.join(3);
    log.events.clear();
    log.apply(ClusterCommand::EnterMaintenance { node_id: two, since_ms: 0, until_ms: 60_000 });
    let heir = log.state.heir_of(two).expect("an heir");
    let period = log.state.replica_period(two, heir).expect("a period");
    log.apply(ClusterCommand::MaintenanceReady { node_id: two, heir: (heir, period) });
    log.apply(ClusterCommand::EndMaintenance { node_id: two, reason: "operator".into() });
    let kinds = log.kinds();
    assert_eq!(kinds[0], K::MaintenanceEntered);
    assert!(kinds.contains(&K::MaintenanceAway), "{kinds:?}");
    let ended = log.events.iter().find(|e| e.kind == K::MaintenanceEnded).expect("ended");
    assert!(ended.message.contains("operator"), "{}", ended.message);
}

#[test]
fn events_serialize_with_their_type_and_without_empty_fields() {
    let mut log = Log::new();
    log.join(2);
    let json = serde_json::to_value(&log.events[0]).expect("json");
    assert_eq!(json["type"], "cluster_created");
    assert!(json.get("moves").is_none() && json.get("peer").is_none());
    let back: Event = serde_json::from_value(json).expect("parse");
    assert_eq!(back, log.events[0]);
}

#[test]
fn a_maintenance_ended_by_a_forced_leave_says_so_and_forced_changes_carry_their_warning() {
    let mut log = Log::new();
    let two = log.join(2);
    let three = log.join(3);
    let four = log.join(4);
    log.events.clear();
    log.apply(ClusterCommand::EnterMaintenance { node_id: two, since_ms: 0, until_ms: 60_000 });
    let heir = log.state.heir_of(two).expect("an heir");
    let period = log.state.replica_period(two, heir).expect("a period");
    log.apply(ClusterCommand::MaintenanceReady { node_id: two, heir: (heir, period) });
    log.events.clear();
    // A leave forced through the maintenance ends it while the member is still away.
    log.apply(ClusterCommand::Remove { node_id: four, force: true });
    let leaving = log.events.iter().find(|e| e.kind == K::NodeLeaving).expect("leaving");
    assert!(leaving.message.contains("forced while node 2 is in maintenance"), "{}", leaving.message);
    let ended = log.events.iter().find(|e| e.kind == K::MaintenanceEnded).expect("ended");
    assert!(!ended.message.contains("took its buckets back"), "{}", ended.message);
    assert!(ended.message.contains(&format!("the forced leave of node {four}")), "{}", ended.message);
    assert!(ended.message.contains("still away"), "{}", ended.message);
    // A forced join says the same of what it was forced through.
    log.events.clear();
    let CommandResponse::Registered { node_id: five } =
        log.apply(ClusterCommand::Register { api_addr: "a5".into(), peer_addr: "p5".into(), name: None })
    else {
        panic!("register refused")
    };
    log.apply(ClusterCommand::Admit { node_id: five, force: true });
    let joined = log.events.iter().find(|e| e.kind == K::NodeJoined).expect("joined");
    assert!(joined.message.contains("forced while a transition"), "{}", joined.message);
    // A maintenance that ends as planned took the buckets back.
    let _ = three;
}

#[test]
fn a_maintenance_that_ends_with_its_member_back_took_its_buckets_back() {
    let mut log = Log::new();
    let two = log.join(2);
    log.join(3);
    log.apply(ClusterCommand::EnterMaintenance { node_id: two, since_ms: 0, until_ms: 60_000 });
    let heir = log.state.heir_of(two).expect("an heir");
    let period = log.state.replica_period(two, heir).expect("a period");
    log.apply(ClusterCommand::MaintenanceReady { node_id: two, heir: (heir, period) });
    log.apply(ClusterCommand::SetDraining { node_id: two, draining: false });
    log.events.clear();
    log.move_everything();
    let ended = log.events.iter().find(|e| e.kind == K::MaintenanceEnded);
    assert!(ended.is_some_and(|e| e.message.contains("took its buckets back")), "{:?}", log.events);
}
