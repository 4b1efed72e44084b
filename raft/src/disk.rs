//! [`Disk`]: where a node keeps its Raft log, vote and state machine — sled on a real disk,
//! or memory in the deterministic simulation (sled's background threads and flushes would
//! make a run depend on the machine's timing).
//!
//! The log store and the state machine are written once, against the few operations both
//! backends offer: named trees of byte keys in order, single-key writes, compare-and-swap of
//! one key, and a flush that makes every earlier write durable. A memory disk is durable by
//! definition (a write is "on disk" once it returns); it survives a simulated crash because
//! the simulation keeps the [`MemoryDisk`] and opens the node again on it.

use std::collections::BTreeMap;
use std::ops::Bound;
use std::sync::Arc;

use parking_lot::Mutex;

/// A failed disk operation.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct DiskError(pub String);

impl From<sled::Error> for DiskError {
    fn from(e: sled::Error) -> Self {
        DiskError(e.to_string())
    }
}

/// A key and its value.
pub type Entry = (Vec<u8>, Vec<u8>);

/// The layout of the Raft storage this release writes and reads (the trees, keys and values of
/// `DESIGN.md`, "Persisted formats"). A change that an older release could not read raises it
/// and adds its step to [`Disk::migrate`].
pub const FORMAT: u32 = 1;

/// Why the Raft storage cannot be used by this release.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FormatError {
    /// A newer release wrote it.
    #[error("the Raft storage has format {found}; this release reads up to {FORMAT}: run a newer release")]
    Newer {
        /// The format on disk.
        found: u32,
    },
    /// The recorded format is not a number.
    #[error("the Raft storage's format record is unreadable ({0:?})")]
    Unreadable(Vec<u8>),
    /// The disk failed.
    #[error(transparent)]
    Disk(#[from] DiskError),
}

/// The ordered byte map of one memory tree.
type MemoryTree = Arc<Mutex<BTreeMap<Vec<u8>, Vec<u8>>>>;

/// A disk in memory: named trees that live as long as someone holds the handle.
#[derive(Clone, Default)]
pub struct MemoryDisk {
    trees: Arc<Mutex<BTreeMap<String, MemoryTree>>>,
}

impl MemoryDisk {
    /// A deep copy: what a crash leaves behind. The simulation restarts a killed node on the
    /// copy, so nothing its old instance still does can reach the new one.
    pub fn copy(&self) -> MemoryDisk {
        let trees = self.trees.lock();
        let copied = trees.iter().map(|(name, tree)| (name.clone(), Arc::new(Mutex::new(tree.lock().clone()))));
        MemoryDisk { trees: Arc::new(Mutex::new(copied.collect())) }
    }
}

/// A node's Raft storage.
#[derive(Clone)]
pub enum Disk {
    /// sled on a real disk.
    Sled(sled::Db),
    /// Memory (the simulation).
    Memory(MemoryDisk),
}

/// One ordered tree of a [`Disk`].
#[derive(Clone)]
pub enum Tree {
    /// A sled tree.
    Sled(sled::Tree),
    /// A memory tree.
    Memory(MemoryTree),
}

impl Disk {
    /// Opens (or creates) the tree `name`.
    pub fn tree(&self, name: &str) -> Result<Tree, DiskError> {
        match self {
            Disk::Sled(db) => Ok(Tree::Sled(db.open_tree(name)?)),
            Disk::Memory(m) => Ok(Tree::Memory(m.trees.lock().entry(name.to_string()).or_default().clone())),
        }
    }

    /// The one migration point of the Raft storage, run before anything reads it: records
    /// [`FORMAT`] on a new disk (or one written before formats were recorded, whose layout is
    /// format 1), brings an older format up to this one step by step (none is older yet), and
    /// refuses a newer one, which this release would misread.
    pub fn migrate(&self) -> Result<(), FormatError> {
        let meta = self.tree("format")?;
        let found = match meta.get(b"format")? {
            None => 1,
            Some(bytes) => match <[u8; 4]>::try_from(bytes.as_slice()) {
                Ok(be) => u32::from_be_bytes(be),
                Err(_) => return Err(FormatError::Unreadable(bytes)),
            },
        };
        if found > FORMAT {
            return Err(FormatError::Newer { found });
        }
        // Steps from `found` up to `FORMAT` go here, each from one format to the next.
        meta.insert(b"format", FORMAT.to_be_bytes().to_vec())?;
        Ok(())
    }

    /// Makes every earlier write of every tree durable.
    ///
    /// sled's own `flush_async` runs the flush on sled's I/O thread pool, whose seven threads
    /// also write the log buffers the flush waits for: with a few flushes at once (several
    /// nodes in one process, or a busy node) every pool thread ends up waiting and nothing is
    /// left to write (seen as a hang in our tests). The flush therefore runs on tokio's
    /// blocking pool.
    pub async fn flush(&self) -> Result<(), DiskError> {
        match self {
            Disk::Sled(db) => {
                let db = db.clone();
                tokio::task::spawn_blocking(move || db.flush())
                    .await
                    .map_err(|e| DiskError(e.to_string()))?
                    .map(|_| ())
                    .map_err(DiskError::from)
            }
            Disk::Memory(_) => Ok(()),
        }
    }

    /// Bytes on disk (0 for memory).
    pub fn size_on_disk(&self) -> u64 {
        match self {
            Disk::Sled(db) => db.size_on_disk().unwrap_or(0),
            Disk::Memory(_) => 0,
        }
    }
}

impl Tree {
    /// The value under `key`.
    pub fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>, DiskError> {
        match self {
            Tree::Sled(t) => Ok(t.get(key)?.map(|v| v.to_vec())),
            Tree::Memory(t) => Ok(t.lock().get(key).cloned()),
        }
    }

    /// Stores `value` under `key`.
    pub fn insert(&self, key: &[u8], value: Vec<u8>) -> Result<(), DiskError> {
        match self {
            Tree::Sled(t) => t.insert(key, value).map(|_| ()).map_err(DiskError::from),
            Tree::Memory(t) => {
                t.lock().insert(key.to_vec(), value);
                Ok(())
            }
        }
    }

    /// Removes `key`.
    pub fn remove(&self, key: &[u8]) -> Result<(), DiskError> {
        match self {
            Tree::Sled(t) => t.remove(key).map(|_| ()).map_err(DiskError::from),
            Tree::Memory(t) => {
                t.lock().remove(key);
                Ok(())
            }
        }
    }

    /// The entries from `from` (inclusive) to `to` (inclusive; `None`: to the end), in key
    /// order.
    pub fn range(&self, from: &[u8], to: Option<&[u8]>) -> Result<Vec<Entry>, DiskError> {
        let end = to.map_or(Bound::Unbounded, Bound::Included);
        match self {
            Tree::Sled(t) => t
                .range::<&[u8], _>((Bound::Included(from), end))
                .map(|r| r.map(|(k, v)| (k.to_vec(), v.to_vec())).map_err(DiskError::from))
                .collect(),
            Tree::Memory(t) => Ok(t
                .lock()
                .range::<[u8], _>((Bound::Included(from), end))
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect()),
        }
    }

    /// The last entry in key order.
    pub fn last(&self) -> Result<Option<Entry>, DiskError> {
        match self {
            Tree::Sled(t) => Ok(t.last()?.map(|(k, v)| (k.to_vec(), v.to_vec()))),
            Tree::Memory(t) => Ok(t.lock().iter().next_back().map(|(k, v)| (k.clone(), v.clone()))),
        }
    }

    /// Replaces the value under `key` by `new` if it is still `old` (`None`: absent);
    /// returns whether it did. Atomic.
    pub fn compare_and_swap(&self, key: &[u8], old: Option<&[u8]>, new: Vec<u8>) -> Result<bool, DiskError> {
        match self {
            Tree::Sled(t) => Ok(t.compare_and_swap(key, old, Some(new))?.is_ok()),
            Tree::Memory(t) => {
                let mut t = t.lock();
                if t.get(key).map(Vec::as_slice) != old {
                    return Ok(false);
                }
                t.insert(key.to_vec(), new);
                Ok(true)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_new_disk_gets_this_format_and_a_newer_or_unreadable_one_is_refused() {
        let memory = MemoryDisk::default();
        let disk = Disk::Memory(memory.clone());
        assert_eq!(disk.migrate(), Ok(()));
        let meta = disk.tree("format").expect("tree");
        assert_eq!(meta.get(b"format").expect("get"), Some(FORMAT.to_be_bytes().to_vec()));
        assert_eq!(disk.migrate(), Ok(()), "a disk of this format opens again");
        meta.insert(b"format", (FORMAT + 1).to_be_bytes().to_vec()).expect("insert");
        assert_eq!(disk.migrate(), Err(FormatError::Newer { found: FORMAT + 1 }));
        assert_eq!(meta.get(b"format").expect("get"), Some((FORMAT + 1).to_be_bytes().to_vec()), "left as it was");
        meta.insert(b"format", b"x".to_vec()).expect("insert");
        assert_eq!(disk.migrate(), Err(FormatError::Unreadable(b"x".to_vec())));
    }
}
