//! The Raft log and vote on a [`Disk`]: [`DiskLogStore`].
//!
//! One disk per node (sled, or memory in the simulation) holds two trees of this store
//! (`raft_log`: big-endian index → JSON entry; `raft_meta`: `vote`, `last_purged`,
//! `committed`) and the state machine's tree. The flush is global, so one flush makes every
//! earlier write of the whole disk durable; the vote and appended entries are flushed before
//! they are acknowledged, as openraft requires.

use std::fmt::Debug;
use std::ops::{Bound, RangeBounds};

use openraft::storage::{LogFlushed, LogState, RaftLogStorage};
use openraft::{ErrorSubject, ErrorVerb, OptionalSend, RaftLogReader, StorageIOError};
use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::disk::{Disk, DiskError, Tree};
use crate::types::{Entry, LogId, StorageError, TypeConfig, Vote};

const KEY_VOTE: &str = "vote";
const KEY_LAST_PURGED: &str = "last_purged";
const KEY_COMMITTED: &str = "committed";

/// openraft's log storage on a [`Disk`]. Cheap to clone (trees are shared handles).
#[derive(Clone)]
pub struct DiskLogStore {
    disk: Disk,
    log: Tree,
    meta: Tree,
    /// The last committed index openraft reported (for metrics).
    committed: std::sync::Arc<std::sync::atomic::AtomicU64>,
}

impl DiskLogStore {
    /// Opens (or creates) the log trees on `disk`.
    pub fn open(disk: &Disk) -> Result<Self, DiskError> {
        let store = DiskLogStore {
            disk: disk.clone(),
            log: disk.tree("raft_log")?,
            meta: disk.tree("raft_meta")?,
            committed: Default::default(),
        };
        // The metric starts from what was committed before a restart.
        let committed = store.read_meta::<Option<LogId>>(KEY_COMMITTED, ErrorSubject::Store).ok().flatten().flatten();
        store.committed.store(committed.map_or(0, |c| c.index), std::sync::atomic::Ordering::Relaxed);
        Ok(store)
    }

    /// The last committed log index this node knows of (0 before any).
    pub fn committed_index(&self) -> u64 {
        self.committed.load(std::sync::atomic::Ordering::Relaxed)
    }

    fn read_meta<T: DeserializeOwned>(&self, key: &str, subject: ErrorSubject<u64>) -> Result<Option<T>, StorageError> {
        let bytes = self.meta.get(key.as_bytes()).map_err(|e| io_err(subject.clone(), ErrorVerb::Read, &e))?;
        bytes.map(|b| serde_json::from_slice(&b).map_err(|e| io_err(subject, ErrorVerb::Read, &e))).transpose()
    }

    fn write_meta<T: Serialize>(&self, key: &str, value: &T, subject: ErrorSubject<u64>) -> Result<(), StorageError> {
        let bytes = serde_json::to_vec(value).map_err(|e| io_err(subject.clone(), ErrorVerb::Write, &e))?;
        self.meta.insert(key.as_bytes(), bytes).map_err(|e| io_err(subject, ErrorVerb::Write, &e))?;
        Ok(())
    }

    async fn flush(&self, subject: ErrorSubject<u64>) -> Result<(), StorageError> {
        self.disk.flush().await.map_err(|e| io_err(subject, ErrorVerb::Write, &e))
    }
}

/// Log keys are big-endian so that the trees' byte order is index order.
fn index_key(index: u64) -> [u8; 8] {
    index.to_be_bytes()
}

fn io_err(subject: ErrorSubject<u64>, verb: ErrorVerb, e: &(impl std::error::Error + 'static)) -> StorageError {
    StorageError::IO { source: StorageIOError::new(subject, verb, openraft::AnyError::new(e)) }
}

impl RaftLogReader<TypeConfig> for DiskLogStore {
    async fn try_get_log_entries<RB: RangeBounds<u64> + Clone + Debug + OptionalSend>(
        &mut self,
        range: RB,
    ) -> Result<Vec<Entry>, StorageError> {
        let start = match range.start_bound() {
            Bound::Included(&i) => i,
            Bound::Excluded(&i) => i + 1,
            Bound::Unbounded => 0,
        };
        let mut entries = Vec::new();
        let stored =
            self.log.range(&index_key(start), None).map_err(|e| io_err(ErrorSubject::Logs, ErrorVerb::Read, &e))?;
        for (key, value) in stored {
            let index = u64::from_be_bytes(key.as_slice().try_into().unwrap_or_default());
            if !range.contains(&index) {
                break;
            }
            let entry: Entry =
                serde_json::from_slice(&value).map_err(|e| io_err(ErrorSubject::Logs, ErrorVerb::Read, &e))?;
            entries.push(entry);
        }
        Ok(entries)
    }
}

impl RaftLogStorage<TypeConfig> for DiskLogStore {
    type LogReader = Self;

    async fn get_log_state(&mut self) -> Result<LogState<TypeConfig>, StorageError> {
        let last_purged: Option<LogId> = self.read_meta(KEY_LAST_PURGED, ErrorSubject::Store)?;
        let last = match self.log.last().map_err(|e| io_err(ErrorSubject::Logs, ErrorVerb::Read, &e))? {
            Some((_, value)) => {
                let entry: Entry =
                    serde_json::from_slice(&value).map_err(|e| io_err(ErrorSubject::Logs, ErrorVerb::Read, &e))?;
                Some(entry.log_id)
            }
            None => last_purged,
        };
        Ok(LogState { last_purged_log_id: last_purged, last_log_id: last })
    }

    async fn get_log_reader(&mut self) -> Self::LogReader {
        self.clone()
    }

    async fn save_vote(&mut self, vote: &Vote) -> Result<(), StorageError> {
        self.write_meta(KEY_VOTE, vote, ErrorSubject::Vote)?;
        self.flush(ErrorSubject::Vote).await
    }

    async fn read_vote(&mut self) -> Result<Option<Vote>, StorageError> {
        self.read_meta(KEY_VOTE, ErrorSubject::Vote)
    }

    async fn save_committed(&mut self, committed: Option<LogId>) -> Result<(), StorageError> {
        // No flush: losing the last committed id only means re-applying from the persisted
        // state machine, which records its own last-applied id.
        let index = committed.map(|c| c.index).unwrap_or(0);
        self.committed.store(index, std::sync::atomic::Ordering::Relaxed);
        self.write_meta(KEY_COMMITTED, &committed, ErrorSubject::Store)
    }

    async fn read_committed(&mut self) -> Result<Option<LogId>, StorageError> {
        Ok(self.read_meta::<Option<LogId>>(KEY_COMMITTED, ErrorSubject::Store)?.flatten())
    }

    async fn append<I>(&mut self, entries: I, callback: LogFlushed<TypeConfig>) -> Result<(), StorageError>
    where
        I: IntoIterator<Item = Entry> + OptionalSend,
        I::IntoIter: OptionalSend,
    {
        // One insert per entry, in index order: a crash part-way leaves a shorter log, never
        // a hole. (No sled batch: batches take sled's process-wide write lock, which can
        // deadlock against a concurrent flush in sled 0.34.)
        for entry in entries {
            let bytes = serde_json::to_vec(&entry).map_err(|e| io_err(ErrorSubject::Logs, ErrorVerb::Write, &e))?;
            self.log
                .insert(&index_key(entry.log_id.index), bytes)
                .map_err(|e| io_err(ErrorSubject::Logs, ErrorVerb::Write, &e))?;
        }
        let flushed = self.disk.flush().await.map_err(std::io::Error::other);
        callback.log_io_completed(flushed);
        Ok(())
    }

    async fn truncate(&mut self, log_id: LogId) -> Result<(), StorageError> {
        self.remove_range(log_id.index, None)?;
        self.flush(ErrorSubject::Logs).await
    }

    async fn purge(&mut self, log_id: LogId) -> Result<(), StorageError> {
        // The watermark first: a crash between the two leaves purged entries that openraft
        // ignores, never a log that claims entries it no longer has.
        self.write_meta(KEY_LAST_PURGED, &log_id, ErrorSubject::Store)?;
        self.remove_range(0, Some(log_id.index))
    }
}

impl DiskLogStore {
    /// Removes the entries from index `from` up to `to` (inclusive; `None`: to the end).
    ///
    /// A tail (`to == None`) is removed from the last entry backwards and a head from the
    /// first entry forwards, so the entries left are contiguous at every moment and a crash
    /// part-way leaves no hole. Single-key removes only: sled batches take a process-wide
    /// write lock that can deadlock against a concurrent flush in sled 0.34.
    fn remove_range(&self, from: u64, to: Option<u64>) -> Result<(), StorageError> {
        let read_err = |e: DiskError| io_err(ErrorSubject::Logs, ErrorVerb::Read, &e);
        let to_key = to.map(index_key);
        let mut keys: Vec<Vec<u8>> = self
            .log
            .range(&index_key(from), to_key.as_ref().map(|k| &k[..]))
            .map_err(read_err)?
            .into_iter()
            .map(|(k, _)| k)
            .collect();
        if to.is_none() {
            keys.reverse();
        }
        for key in keys {
            self.log.remove(&key).map_err(|e| io_err(ErrorSubject::Logs, ErrorVerb::Write, &e))?;
        }
        Ok(())
    }
}
