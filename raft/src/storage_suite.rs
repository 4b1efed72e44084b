//! openraft's storage conformance suite on the sled log store and state machine, plus a
//! reopen test: what was acknowledged survives closing and reopening the database.

use openraft::storage::{RaftLogStorage, RaftStateMachine};
use openraft::testing::{StoreBuilder, Suite};
use tempfile::TempDir;

use crate::log_store::SledLogStore;
use crate::state_machine::SledStateMachine;
use crate::types::{StorageError, TypeConfig};

struct SledBuilder;

fn open(dir: &std::path::Path) -> (sled::Db, SledLogStore, SledStateMachine) {
    let db = sled::Config::new().path(dir).cache_capacity(1 << 20).open().expect("open sled");
    let log = SledLogStore::open(&db).expect("log store");
    let sm = SledStateMachine::open(&db).expect("state machine");
    (db, log, sm)
}

impl StoreBuilder<TypeConfig, SledLogStore, SledStateMachine, TempDir> for SledBuilder {
    async fn build(&self) -> Result<(TempDir, SledLogStore, SledStateMachine), StorageError> {
        let dir = TempDir::new().expect("temp dir");
        let (_db, log, sm) = open(dir.path());
        Ok((dir, log, sm))
    }
}

#[test]
fn sled_storage_passes_the_openraft_suite() -> Result<(), StorageError> {
    Suite::test_all(SledBuilder)?;
    Ok(())
}

#[tokio::test]
async fn vote_and_purge_watermark_survive_a_reopen() {
    let dir = TempDir::new().expect("temp dir");
    let vote = openraft::Vote::new(3, 7);
    let purged = openraft::LogId::new(openraft::CommittedLeaderId::new(3, 7), 42);
    {
        let (db, mut log, _sm) = open(dir.path());
        log.save_vote(&vote).await.expect("save vote");
        log.purge(purged).await.expect("purge");
        crate::flush(&db).await.expect("flush");
    }
    let (_db, mut log, mut sm) = open(dir.path());
    assert_eq!(log.read_vote().await.expect("read vote"), Some(vote));
    let state = log.get_log_state().await.expect("log state");
    assert_eq!(state.last_purged_log_id, Some(purged));
    assert_eq!(state.last_log_id, Some(purged));
    assert_eq!(sm.applied_state().await.expect("applied").0, None);
}
