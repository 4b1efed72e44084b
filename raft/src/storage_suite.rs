//! openraft's storage conformance suite on the log store and state machine, on sled and on
//! the memory disk of the simulation, plus a reopen test: what was acknowledged survives
//! closing and reopening the database.

use openraft::storage::{RaftLogStorage, RaftStateMachine};
use openraft::testing::{StoreBuilder, Suite};
use tempfile::TempDir;

use crate::disk::{Disk, MemoryDisk};
use crate::log_store::DiskLogStore;
use crate::state_machine::DiskStateMachine;
use crate::types::{StorageError, TypeConfig};

struct SledBuilder;

fn open(disk: &Disk) -> (DiskLogStore, DiskStateMachine) {
    let log = DiskLogStore::open(disk).expect("log store");
    let sm = DiskStateMachine::open(disk).expect("state machine");
    (log, sm)
}

fn sled_at(dir: &std::path::Path) -> Disk {
    Disk::Sled(sled::Config::new().path(dir).cache_capacity(1 << 20).open().expect("open sled"))
}

impl StoreBuilder<TypeConfig, DiskLogStore, DiskStateMachine, TempDir> for SledBuilder {
    async fn build(&self) -> Result<(TempDir, DiskLogStore, DiskStateMachine), StorageError> {
        let dir = TempDir::new().expect("temp dir");
        let (log, sm) = open(&sled_at(dir.path()));
        Ok((dir, log, sm))
    }
}

struct MemoryBuilder;

impl StoreBuilder<TypeConfig, DiskLogStore, DiskStateMachine, ()> for MemoryBuilder {
    async fn build(&self) -> Result<((), DiskLogStore, DiskStateMachine), StorageError> {
        let (log, sm) = open(&Disk::Memory(MemoryDisk::default()));
        Ok(((), log, sm))
    }
}

#[test]
fn sled_storage_passes_the_openraft_suite() -> Result<(), StorageError> {
    Suite::test_all(SledBuilder)?;
    Ok(())
}

#[test]
fn memory_storage_passes_the_openraft_suite() -> Result<(), StorageError> {
    Suite::test_all(MemoryBuilder)?;
    Ok(())
}

async fn assert_vote_and_watermark_survive(first: Disk, reopen: impl Fn() -> Disk) {
    let vote = openraft::Vote::new(3, 7);
    let purged = openraft::LogId::new(openraft::CommittedLeaderId::new(3, 7), 42);
    {
        let (mut log, _sm) = open(&first);
        log.save_vote(&vote).await.expect("save vote");
        log.purge(purged).await.expect("purge");
        first.flush().await.expect("flush");
    }
    drop(first);
    let (mut log, mut sm) = open(&reopen());
    assert_eq!(log.read_vote().await.expect("read vote"), Some(vote));
    let state = log.get_log_state().await.expect("log state");
    assert_eq!(state.last_purged_log_id, Some(purged));
    assert_eq!(state.last_log_id, Some(purged));
    assert_eq!(sm.applied_state().await.expect("applied").0, None);
}

#[tokio::test]
async fn vote_and_purge_watermark_survive_a_reopen() {
    let dir = TempDir::new().expect("temp dir");
    assert_vote_and_watermark_survive(sled_at(dir.path()), || sled_at(dir.path())).await;
}

#[tokio::test]
async fn a_memory_disk_keeps_what_was_written_across_a_simulated_crash() {
    let memory = MemoryDisk::default();
    let crashed = memory.clone();
    assert_vote_and_watermark_survive(Disk::Memory(memory), || Disk::Memory(crashed.copy())).await;
}

fn entry(index: u64, command: crate::ClusterCommand) -> crate::types::Entry {
    openraft::Entry {
        log_id: openraft::LogId::new(openraft::CommittedLeaderId::new(1, 1), index),
        payload: openraft::EntryPayload::Normal(crate::Proposal { command, at_ms: Some(index * 10) }),
    }
}

/// A bootstrap, a registration and an admission: the events the state machine derives.
fn joining() -> Vec<crate::types::Entry> {
    use crate::ClusterCommand as C;
    vec![
        entry(
            1,
            C::Bootstrap {
                cluster_id: "c".into(),
                node_id: 1,
                api_addr: "a1".into(),
                peer_addr: "p1".into(),
                name: None,
                voters: 3,
                replication: crate::ReplicationMode::Sync,
            },
        ),
        entry(2, C::Register { api_addr: "a2".into(), peer_addr: "p2".into(), name: None }),
        entry(3, C::Admit { node_id: 2, force: false }),
    ]
}

#[tokio::test]
async fn events_survive_a_reopen_and_travel_in_snapshots() {
    use crate::EventKind as K;
    use openraft::storage::RaftStateMachine;
    use openraft::RaftSnapshotBuilder;

    let memory = MemoryDisk::default();
    let (_log, mut sm) = open(&Disk::Memory(memory.clone()));
    sm.apply(joining()).await.expect("apply");
    let page = sm.view().events_since(0, 100);
    let kinds: Vec<K> = page.events.iter().map(|e| e.kind).collect();
    assert_eq!(kinds, vec![K::ClusterCreated, K::NodeJoined, K::TransitionBegun]);
    assert_eq!(page.events[1].time_ms, 30);
    assert_eq!(page.oldest, Some(1));
    // Asking from the admission's index: nothing newer; with a limit of one, `next` says where
    // to go on from, and never splits an entry's events.
    assert!(sm.view().events_since(3, 100).events.is_empty());
    let first = sm.view().events_since(0, 1);
    assert_eq!(first.events.len(), 1);
    assert_eq!(first.next, 1);
    let second = sm.view().events_since(first.next, 1);
    assert_eq!(second.events.len(), 2, "both events of the admission");

    // A crash and a restart on what the disk kept: the same events.
    let copy = memory.copy();
    let (_log, mut reopened) = open(&Disk::Memory(copy.clone()));
    assert_eq!(reopened.view().events_since(0, 100).events, page.events);

    // A snapshot carries them to a node that has none.
    let mut builder = reopened.get_snapshot_builder().await;
    let snapshot = builder.build_snapshot().await.expect("snapshot");
    // ... but they are not in the value every apply rewrites.
    let value = Disk::Memory(copy).tree("state_machine").expect("tree").get(b"stored").expect("get").expect("stored");
    assert!(!String::from_utf8_lossy(&value).contains("node_joined"), "events stored apart from the state");
    let (_log, mut fresh) = open(&Disk::Memory(MemoryDisk::default()));
    fresh.install_snapshot(&snapshot.meta, snapshot.snapshot).await.expect("install");
    assert_eq!(fresh.view().events_since(0, 100).events, page.events);
}

#[tokio::test]
async fn events_written_past_the_applied_state_are_dropped_at_open() {
    let memory = MemoryDisk::default();
    {
        let (_log, mut sm) = open(&Disk::Memory(memory.clone()));
        use openraft::storage::RaftStateMachine;
        sm.apply(joining()).await.expect("apply");
    }
    // An event of entry 9, which the state never reached (a crash between the two writes).
    let tree = Disk::Memory(memory.clone()).tree("events").expect("tree");
    let late = serde_json::to_value(crate::Event {
        index: 9,
        time_ms: 0,
        map_version: 0,
        kind: crate::EventKind::NodeLeft,
        node: Some(2),
        peer: None,
        buckets: vec![],
        moves: vec![],
        first_index: None,
        message: "late".into(),
    })
    .expect("json");
    let mut key = 9u64.to_be_bytes().to_vec();
    key.extend_from_slice(&0u16.to_be_bytes());
    tree.insert(&key, serde_json::to_vec(&late).expect("encode")).expect("insert");
    let (_log, sm) = open(&Disk::Memory(memory.copy()));
    let events = sm.view().events_since(0, 100).events;
    assert_eq!(events.len(), 3);
    assert!(events.iter().all(|e| e.index <= 3));
}
