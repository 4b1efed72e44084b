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
