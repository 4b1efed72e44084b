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
//!
//! The event log ([`crate::events`]) lives beside it in its own tree, one key per event
//! (Raft index, then position within the entry). An apply writes its events before the
//! value, so a crash between the two leaves events past the last applied entry: opening drops
//! them, and the replay derives them again. A snapshot carries the retained events (up to a few
//! MiB): they are stored under the snapshot's id in a tree of their own, written before the
//! value that names that snapshot, so the value an apply rewrites stays small.

use std::collections::VecDeque;
use std::io::Cursor;
use std::sync::Arc;

use arc_swap::ArcSwap;
use openraft::storage::{RaftStateMachine, Snapshot};
use openraft::{EntryPayload, ErrorSubject, ErrorVerb, RaftSnapshotBuilder, StorageIOError};
use serde::{Deserialize, Serialize};
use tokio::sync::watch;

use crate::command::CommandResponse;
use crate::disk::{Disk, Tree};
use crate::events::{Event, EventRecorder, EVENT_RETENTION};
use crate::state::ClusterState;
use crate::types::{Entry, LogId, SnapshotMeta, StorageError, StoredMembership, TypeConfig};

const KEY_STORED: &str = "stored";
const EVENTS_TREE: &str = "events";
const SNAPSHOT_EVENTS_TREE: &str = "snapshot_events";

/// What is persisted: the state plus the Raft positions that must survive with it.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
struct PersistedMachine {
    last_applied: Option<LogId>,
    last_membership: StoredMembership,
    state: ClusterState,
    /// The bucket moves gathered for the next `buckets_moved` event.
    #[serde(default)]
    events: EventRecorder,
}

/// What a snapshot holds: the machine and the retained events. Snapshots of earlier versions
/// are the machine alone.
#[derive(Serialize, Deserialize)]
struct SnapshotData {
    machine: PersistedMachine,
    events: Vec<Event>,
}

fn decode_snapshot(data: &[u8]) -> Result<SnapshotData, StorageError> {
    match serde_json::from_slice::<SnapshotData>(data) {
        Ok(s) => Ok(s),
        Err(e) => match serde_json::from_slice(data) {
            Ok(machine) => Ok(SnapshotData { machine, events: Vec::new() }),
            // Neither form: say what is wrong with the current one.
            Err(_) => Err(sm_err(ErrorVerb::Read, &e)),
        },
    }
}

/// An event and its position within its entry (its key is the index, then the position).
type Retained = VecDeque<(u16, Event)>;

fn event_key(index: u64, seq: u16) -> [u8; 10] {
    let mut key = [0u8; 10];
    key[..8].copy_from_slice(&index.to_be_bytes());
    key[8..].copy_from_slice(&seq.to_be_bytes());
    key
}

/// The retained events: in memory for readers, in their tree for restarts.
struct EventStore {
    tree: Tree,
    retained: Arc<parking_lot::RwLock<Retained>>,
}

impl EventStore {
    /// Loads the events of applied entries; drops any past `last_applied` (written by an
    /// apply that crashed before its state was).
    fn open(disk: &Disk, last_applied: u64) -> Result<Self, StorageError> {
        let tree = disk.tree(EVENTS_TREE).map_err(|e| sm_err(ErrorVerb::Read, &e))?;
        let mut retained = Retained::new();
        for (key, value) in tree.range(&[], None).map_err(|e| sm_err(ErrorVerb::Read, &e))? {
            let event: Event = serde_json::from_slice(&value).map_err(|e| sm_err(ErrorVerb::Read, &e))?;
            if event.index > last_applied {
                tree.remove(&key).map_err(|e| sm_err(ErrorVerb::Write, &e))?;
                continue;
            }
            let seq = key.get(8..10).map_or(0, |b| u16::from_be_bytes([b[0], b[1]]));
            retained.push_back((seq, event));
        }
        Ok(EventStore { tree, retained: Arc::new(parking_lot::RwLock::new(retained)) })
    }

    /// Appends the events of one apply batch and forgets the oldest beyond the retention.
    /// The caller flushes.
    fn append(&self, events: Vec<(u16, Event)>) -> Result<(), StorageError> {
        if events.is_empty() {
            return Ok(());
        }
        for (seq, event) in &events {
            let value = encode(event)?;
            self.tree.insert(&event_key(event.index, *seq), value).map_err(|e| sm_err(ErrorVerb::Write, &e))?;
        }
        let mut retained = self.retained.write();
        retained.extend(events);
        while retained.len() > EVENT_RETENTION {
            if let Some((seq, old)) = retained.pop_front() {
                self.tree.remove(&event_key(old.index, seq)).map_err(|e| sm_err(ErrorVerb::Write, &e))?;
            }
        }
        Ok(())
    }

    /// Replaces every event (a snapshot was installed).
    fn replace(&self, events: Vec<Event>) -> Result<(), StorageError> {
        for (key, _) in self.tree.range(&[], None).map_err(|e| sm_err(ErrorVerb::Read, &e))? {
            self.tree.remove(&key).map_err(|e| sm_err(ErrorVerb::Write, &e))?;
        }
        let mut numbered = Vec::with_capacity(events.len());
        let mut last: Option<(u64, u16)> = None;
        for event in events {
            let seq = match last {
                Some((index, seq)) if index == event.index => seq + 1,
                _ => 0,
            };
            last = Some((event.index, seq));
            numbered.push((seq, event));
        }
        for (seq, event) in &numbered {
            let value = encode(event)?;
            self.tree.insert(&event_key(event.index, *seq), value).map_err(|e| sm_err(ErrorVerb::Write, &e))?;
        }
        // Readers see the old log or the new one, never an empty one in between.
        *self.retained.write() = numbered.into_iter().collect();
        Ok(())
    }

    fn all(&self) -> Vec<Event> {
        self.retained.read().iter().map(|(_, e)| e.clone()).collect()
    }
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
    /// The events of the current snapshot, under its id, apart from the value an apply
    /// rewrites (they are up to a few MiB).
    snapshot_events: Tree,
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

    /// Stores the events of snapshot `id` (before the snapshot itself is written).
    fn put_snapshot_events(&self, id: &str, events: &[Event]) -> Result<(), StorageError> {
        let value = encode(&events)?;
        self.snapshot_events.insert(id.as_bytes(), value).map_err(|e| sm_err(ErrorVerb::Write, &e))
    }

    /// The events of snapshot `id` (none for snapshots of earlier versions).
    fn snapshot_events(&self, id: &str) -> Result<Vec<Event>, StorageError> {
        match self.snapshot_events.get(id.as_bytes()).map_err(|e| sm_err(ErrorVerb::Read, &e))? {
            Some(bytes) => serde_json::from_slice(&bytes).map_err(|e| sm_err(ErrorVerb::Read, &e)),
            None => Ok(Vec::new()),
        }
    }

    /// Forgets the events of every snapshot but `id` (once `id` is the stored snapshot).
    fn keep_snapshot_events(&self, id: &str) -> Result<(), StorageError> {
        for (key, _) in self.snapshot_events.range(&[], None).map_err(|e| sm_err(ErrorVerb::Read, &e))? {
            if key != id.as_bytes() {
                self.snapshot_events.remove(&key).map_err(|e| sm_err(ErrorVerb::Write, &e))?;
            }
        }
        Ok(())
    }

    /// The bytes a snapshot is sent as: its machine with the snapshot's events.
    fn snapshot_bytes(&self, stored: &PersistedSnapshot) -> Result<Vec<u8>, StorageError> {
        // A stored snapshot holds the machine alone; its events are kept apart.
        let events = self.snapshot_events(&stored.meta.snapshot_id)?;
        let events = encode(&events)?;
        let mut data = Vec::with_capacity(stored.data.len() + events.len() + 32);
        data.extend_from_slice(br#"{"machine":"#);
        data.extend_from_slice(&stored.data);
        data.extend_from_slice(br#","events":"#);
        data.extend_from_slice(&events);
        data.push(b'}');
        Ok(data)
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
    events: Arc<parking_lot::RwLock<Retained>>,
}

/// Events after some index, as [`StateView::events_since`] finds them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EventPage {
    /// The events, oldest first.
    pub events: Vec<Event>,
    /// The index to ask from next: the last event's, or the last applied index when every
    /// event after `since` was returned (a batch of moves being gathered takes the index of
    /// the entry that closes it, which is later).
    pub next: u64,
    /// The oldest index still retained (`None` while the log is empty): a `since` below it
    /// may have missed events that were dropped.
    pub oldest: Option<u64>,
}

impl StateView {
    fn new(state: ClusterState, events: Arc<parking_lot::RwLock<Retained>>) -> Self {
        StateView { current: Arc::new(ArcSwap::from_pointee(state)), applied: watch::Sender::new(0), events }
    }

    /// At most `limit` events with an index above `since`, oldest first.
    pub fn events_since(&self, since: u64, limit: usize) -> EventPage {
        let applied = *self.applied.borrow();
        let retained = self.events.read();
        let start = retained.partition_point(|(_, e)| e.index <= since);
        let mut events: Vec<Event> = retained.iter().skip(start).take(limit).map(|(_, e)| e.clone()).collect();
        // Never stop within an entry's events: `next` is an index.
        if let Some(last) = events.last().map(|e| e.index) {
            let more = retained.iter().skip(start + events.len()).take_while(|(_, e)| e.index == last);
            let more: Vec<Event> = more.map(|(_, e)| e.clone()).collect();
            events.extend(more);
        }
        let complete = start + events.len() == retained.len();
        let last = events.last().map_or(since, |e| e.index);
        let next = if complete { applied.max(last).max(since) } else { last };
        EventPage { events, next, oldest: retained.front().map(|(_, e)| e.index) }
    }

    /// The last applied index.
    pub fn applied_index(&self) -> u64 {
        *self.applied.borrow()
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
    events: EventStore,
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
        let snapshot_events = disk.tree(SNAPSHOT_EVENTS_TREE).map_err(|e| sm_err(ErrorVerb::Read, &e))?;
        let stored_value =
            StoredValue { disk: disk.clone(), tree, parts: Arc::new(tokio::sync::Mutex::new(parts)), snapshot_events };
        let last_applied = stored.machine.last_applied.map_or(0, |l| l.index);
        let events = EventStore::open(disk, last_applied)?;
        let view = StateView::new(stored.machine.state.clone(), events.retained.clone());
        Ok(DiskStateMachine { stored: stored_value, machine: stored.machine, events, view, snapshot_seq: 0 })
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
    events: Vec<Event>,
    seq: u64,
}

impl RaftSnapshotBuilder<TypeConfig> for SnapshotBuilder {
    async fn build_snapshot(&mut self) -> Result<Snapshot<TypeConfig>, StorageError> {
        let machine = serde_json::to_vec(&self.machine).map_err(|e| sm_err(ErrorVerb::Read, &e))?;
        let snapshot_id = match self.machine.last_applied {
            Some(l) => format!("{}-{}-{}", l.leader_id, l.index, self.seq),
            None => format!("--{}", self.seq),
        };
        let meta = SnapshotMeta {
            last_log_id: self.machine.last_applied,
            last_membership: self.machine.last_membership.clone(),
            snapshot_id,
        };
        self.stored.put_snapshot_events(&meta.snapshot_id, &self.events)?;
        let stored = PersistedSnapshot { meta: meta.clone(), data: machine };
        self.stored.write(None, Some(&stored)).await?;
        self.stored.keep_snapshot_events(&meta.snapshot_id)?;
        let data = self.stored.snapshot_bytes(&stored)?;
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
        let mut events = Vec::new();
        for entry in entries {
            self.machine.last_applied = Some(entry.log_id);
            let response = match entry.payload {
                EntryPayload::Blank => CommandResponse::Done,
                EntryPayload::Normal(ref proposal) => {
                    let before = self.machine.state.clone();
                    let command = &proposal.command;
                    let response = self.machine.state.apply(command);
                    tracing::debug!(log_index = entry.log_id.index, ?command, ?response, "applied");
                    let index = entry.log_id.index;
                    let time_ms = proposal.at_ms.unwrap_or(0);
                    let derived =
                        self.machine.events.record(index, time_ms, &before, command, &response, &self.machine.state);
                    events.extend(derived.into_iter().enumerate().map(|(seq, e)| (seq as u16, e)));
                    response
                }
                EntryPayload::Membership(ref membership) => {
                    self.machine.last_membership = StoredMembership::new(Some(entry.log_id), membership.clone());
                    CommandResponse::Done
                }
            };
            responses.push(response);
        }
        self.events.append(events)?;
        self.persist(None).await?;
        self.publish();
        Ok(responses)
    }

    async fn get_snapshot_builder(&mut self) -> Self::SnapshotBuilder {
        self.snapshot_seq += 1;
        SnapshotBuilder {
            stored: self.stored.clone(),
            machine: self.machine.clone(),
            events: self.events.all(),
            seq: self.snapshot_seq,
        }
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
        let SnapshotData { machine, events } = decode_snapshot(&data)?;
        // Replace, never merge: the snapshot is the whole state.
        self.machine = PersistedMachine {
            last_applied: meta.last_log_id,
            last_membership: meta.last_membership.clone(),
            state: machine.state,
            events: machine.events,
        };
        self.stored.put_snapshot_events(&meta.snapshot_id, &events)?;
        self.events.replace(events)?;
        let stored = PersistedSnapshot { meta: meta.clone(), data: encode(&self.machine)? };
        self.persist(Some(&stored)).await?;
        self.stored.keep_snapshot_events(&meta.snapshot_id)?;
        self.publish();
        Ok(())
    }

    async fn get_current_snapshot(&mut self) -> Result<Option<Snapshot<TypeConfig>>, StorageError> {
        let Some(stored) = self.stored.snapshot().await? else {
            return Ok(None);
        };
        let data = self.stored.snapshot_bytes(&stored)?;
        Ok(Some(Snapshot { meta: stored.meta, snapshot: Box::new(Cursor::new(data)) }))
    }
}
