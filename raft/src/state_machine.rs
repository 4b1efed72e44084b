//! The state machine on a [`Disk`]: [`DiskStateMachine`], and [`StateView`], the lock-free handle
//! through which the rest of the node reads the applied [`ClusterState`].
//!
//! The whole control-plane state is small (members and 1000 owners, a few KiB), so after every
//! `apply` batch it is written as one value together with the last applied log id and
//! membership, and flushed. The current snapshot lives in the same value, so the state and the
//! snapshot change together: every write replaces that one key, which the disk does
//! atomically, and a restart finds exactly the state of some applied prefix of the log. The
//! two parts of the value are kept encoded in memory, so an apply encodes only the state, not
//! the snapshot again. (No sled batches or transactions: they take sled's process-wide write
//! lock, which can deadlock against a concurrent flush in sled 0.34.)

use std::io::Cursor;
use std::sync::Arc;

use arc_swap::ArcSwap;
use openraft::storage::{RaftStateMachine, Snapshot};
use openraft::{EntryPayload, ErrorSubject, ErrorVerb, RaftSnapshotBuilder, StorageIOError};
use serde::{Deserialize, Serialize};
use tokio::sync::watch;

use crate::command::CommandResponse;
use crate::disk::{Disk, Tree};
use crate::state::ClusterState;
use crate::types::{Entry, LogId, SnapshotMeta, StorageError, StoredMembership, TypeConfig};

const KEY_STORED: &str = "stored";

/// What is persisted: the state plus the Raft positions that must survive with it.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
struct PersistedMachine {
    last_applied: Option<LogId>,
    last_membership: StoredMembership,
    state: ClusterState,
}

#[derive(Clone, Serialize, Deserialize)]
struct PersistedSnapshot {
    meta: SnapshotMeta,
    data: Vec<u8>,
}

/// The one stored value of the state machine.
#[derive(Default, Serialize, Deserialize)]
struct Stored {
    machine: PersistedMachine,
    snapshot: Option<PersistedSnapshot>,
}

fn decode_stored(bytes: Option<&[u8]>) -> Result<Stored, StorageError> {
    match bytes {
        Some(b) => serde_json::from_slice(b).map_err(|e| sm_err(ErrorVerb::Read, &e)),
        None => Ok(Stored::default()),
    }
}

/// The stored value, as the JSON of its two parts: what an apply writes is the new machine
/// next to the snapshot as it was encoded when it was taken.
struct Parts {
    machine: Vec<u8>,
    snapshot: Vec<u8>,
}

/// Writes the stored value; shared by the state machine and its snapshot builders, which
/// take turns through the lock.
#[derive(Clone)]
struct StoredValue {
    disk: Disk,
    tree: Tree,
    parts: Arc<tokio::sync::Mutex<Parts>>,
}

fn encode<T: Serialize>(value: &T) -> Result<Vec<u8>, StorageError> {
    serde_json::to_vec(value).map_err(|e| sm_err(ErrorVerb::Write, &e))
}

impl StoredValue {
    /// Replaces the machine and/or the snapshot part, writes the whole value (the same JSON as
    /// [`Stored`]) and flushes.
    async fn write(
        &self,
        machine: Option<&PersistedMachine>,
        snapshot: Option<&PersistedSnapshot>,
    ) -> Result<(), StorageError> {
        let mut parts = self.parts.lock().await;
        if let Some(m) = machine {
            parts.machine = encode(m)?;
        }
        if let Some(s) = snapshot {
            parts.snapshot = encode(s)?;
        }
        let mut value = Vec::with_capacity(parts.machine.len() + parts.snapshot.len() + 32);
        value.extend_from_slice(br#"{"machine":"#);
        value.extend_from_slice(&parts.machine);
        value.extend_from_slice(br#","snapshot":"#);
        value.extend_from_slice(&parts.snapshot);
        value.push(b'}');
        self.tree.insert(KEY_STORED.as_bytes(), value).map_err(|e| sm_err(ErrorVerb::Write, &e))?;
        self.disk.flush().await.map_err(|e| sm_err(ErrorVerb::Write, &e))
    }

    /// The snapshot last written.
    async fn snapshot(&self) -> Result<Option<PersistedSnapshot>, StorageError> {
        let parts = self.parts.lock().await;
        serde_json::from_slice(&parts.snapshot).map_err(|e| sm_err(ErrorVerb::Read, &e))
    }
}

/// A read handle on the applied state, shared by the whole node.
///
/// `current()` is a lock-free load (the request path calls it); `changed()` lets a task wait
/// for the next applied batch (for example "until map version ≥ v").
#[derive(Clone)]
pub struct StateView {
    current: Arc<ArcSwap<ClusterState>>,
    applied: watch::Sender<u64>,
}

impl StateView {
    fn new(state: ClusterState) -> Self {
        StateView { current: Arc::new(ArcSwap::from_pointee(state)), applied: watch::Sender::new(0) }
    }

    /// The last applied state.
    pub fn current(&self) -> Arc<ClusterState> {
        self.current.load_full()
    }

    /// A receiver that is notified after every applied batch.
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.applied.subscribe()
    }

    fn publish(&self, state: ClusterState, index: u64) {
        self.current.store(Arc::new(state));
        self.applied.send_replace(index);
    }
}

/// openraft's state machine for shoal's [`ClusterState`], persisted on a [`Disk`].
pub struct DiskStateMachine {
    stored: StoredValue,
    machine: PersistedMachine,
    view: StateView,
    snapshot_seq: u64,
}

impl DiskStateMachine {
    /// Opens the state machine on `disk`, loading the state persisted by the last run.
    pub fn open(disk: &Disk) -> Result<Self, StorageError> {
        let tree = disk.tree("state_machine").map_err(|e| sm_err(ErrorVerb::Read, &e))?;
        let bytes = tree.get(KEY_STORED.as_bytes()).map_err(|e| sm_err(ErrorVerb::Read, &e))?;
        let stored = decode_stored(bytes.as_deref())?;
        let parts = Parts { machine: encode(&stored.machine)?, snapshot: encode(&stored.snapshot)? };
        let stored_value = StoredValue { disk: disk.clone(), tree, parts: Arc::new(tokio::sync::Mutex::new(parts)) };
        let view = StateView::new(stored.machine.state.clone());
        Ok(DiskStateMachine { stored: stored_value, machine: stored.machine, view, snapshot_seq: 0 })
    }

    /// The read handle on the applied state.
    pub fn view(&self) -> StateView {
        self.view.clone()
    }

    /// Persists the machine (and, when installing one, the snapshot) in one atomic write.
    async fn persist(&self, snapshot: Option<&PersistedSnapshot>) -> Result<(), StorageError> {
        self.stored.write(Some(&self.machine), snapshot).await
    }

    fn publish(&self) {
        let index = self.machine.last_applied.map(|l| l.index).unwrap_or(0);
        self.view.publish(self.machine.state.clone(), index);
    }
}

fn sm_err(verb: ErrorVerb, e: &(impl std::error::Error + 'static)) -> StorageError {
    StorageError::IO { source: StorageIOError::new(ErrorSubject::StateMachine, verb, openraft::AnyError::new(e)) }
}

/// Builds a snapshot from a copy of the state taken when the builder was made, so that
/// applies running meanwhile cannot tear it.
pub struct SnapshotBuilder {
    stored: StoredValue,
    machine: PersistedMachine,
    seq: u64,
}

impl RaftSnapshotBuilder<TypeConfig> for SnapshotBuilder {
    async fn build_snapshot(&mut self) -> Result<Snapshot<TypeConfig>, StorageError> {
        let data = serde_json::to_vec(&self.machine).map_err(|e| sm_err(ErrorVerb::Read, &e))?;
        let snapshot_id = match self.machine.last_applied {
            Some(l) => format!("{}-{}-{}", l.leader_id, l.index, self.seq),
            None => format!("--{}", self.seq),
        };
        let meta = SnapshotMeta {
            last_log_id: self.machine.last_applied,
            last_membership: self.machine.last_membership.clone(),
            snapshot_id,
        };
        let stored = PersistedSnapshot { meta: meta.clone(), data: data.clone() };
        self.stored.write(None, Some(&stored)).await?;
        Ok(Snapshot { meta, snapshot: Box::new(Cursor::new(data)) })
    }
}

impl RaftStateMachine<TypeConfig> for DiskStateMachine {
    type SnapshotBuilder = SnapshotBuilder;

    async fn applied_state(&mut self) -> Result<(Option<LogId>, StoredMembership), StorageError> {
        Ok((self.machine.last_applied, self.machine.last_membership.clone()))
    }

    async fn apply<I>(&mut self, entries: I) -> Result<Vec<CommandResponse>, StorageError>
    where
        I: IntoIterator<Item = Entry> + openraft::OptionalSend,
        I::IntoIter: openraft::OptionalSend,
    {
        let mut responses = Vec::new();
        for entry in entries {
            self.machine.last_applied = Some(entry.log_id);
            let response = match entry.payload {
                EntryPayload::Blank => CommandResponse::Done,
                EntryPayload::Normal(ref command) => {
                    let response = self.machine.state.apply(command);
                    tracing::debug!(log_index = entry.log_id.index, ?command, ?response, "applied");
                    response
                }
                EntryPayload::Membership(ref membership) => {
                    self.machine.last_membership = StoredMembership::new(Some(entry.log_id), membership.clone());
                    CommandResponse::Done
                }
            };
            responses.push(response);
        }
        self.persist(None).await?;
        self.publish();
        Ok(responses)
    }

    async fn get_snapshot_builder(&mut self) -> Self::SnapshotBuilder {
        self.snapshot_seq += 1;
        SnapshotBuilder { stored: self.stored.clone(), machine: self.machine.clone(), seq: self.snapshot_seq }
    }

    async fn begin_receiving_snapshot(&mut self) -> Result<Box<Cursor<Vec<u8>>>, StorageError> {
        Ok(Box::new(Cursor::new(Vec::new())))
    }

    async fn install_snapshot(
        &mut self,
        meta: &SnapshotMeta,
        snapshot: Box<Cursor<Vec<u8>>>,
    ) -> Result<(), StorageError> {
        let data = snapshot.into_inner();
        let machine: PersistedMachine = serde_json::from_slice(&data).map_err(|e| sm_err(ErrorVerb::Read, &e))?;
        // Replace, never merge: the snapshot is the whole state.
        self.machine = PersistedMachine {
            last_applied: meta.last_log_id,
            last_membership: meta.last_membership.clone(),
            state: machine.state,
        };
        let stored = PersistedSnapshot { meta: meta.clone(), data };
        self.persist(Some(&stored)).await?;
        self.publish();
        Ok(())
    }

    async fn get_current_snapshot(&mut self) -> Result<Option<Snapshot<TypeConfig>>, StorageError> {
        let Some(stored) = self.stored.snapshot().await? else {
            return Ok(None);
        };
        Ok(Some(Snapshot { meta: stored.meta, snapshot: Box::new(Cursor::new(stored.data)) }))
    }
}
