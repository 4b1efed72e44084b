//! [`Disk`]: where a node keeps its Raft log, vote and state machine — sled on a real disk,
//! or memory in the deterministic simulation (sled's background threads and flushes would
//! make a run depend on the machine's timing).
//!
//! The log store and the state machine are written once, against the few operations both
//! backends offer: named trees of byte keys in order, single-key writes, compare-and-swap of
//! one key, and a flush that makes every earlier write durable. A memory disk survives a
//! simulated crash because the simulation keeps the [`MemoryDisk`] and opens the node again on
//! it; it remembers the writes since the last flush, so a crash may lose them
//! ([`MemoryDisk::crash`]) as a real disk may.

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

/// The writes of a memory disk not yet flushed.
type Unflushed = Arc<Mutex<Journal>>;

/// One write not yet flushed: its sequence number, the tree, the key, and what the key held
/// before.
type Write = (u64, String, Vec<u8>, Option<Vec<u8>>);

/// Writes not yet flushed, oldest first.
#[derive(Default)]
pub struct Journal {
    next: u64,
    entries: std::collections::VecDeque<Write>,
}

impl Journal {
    fn record(&mut self, tree: &str, key: &[u8], before: Option<Vec<u8>>) {
        self.entries.push_back((self.next, tree.to_string(), key.to_vec(), before));
        self.next += 1;
    }
}

/// A disk in memory: named trees that live as long as someone holds the handle.
#[derive(Clone, Default)]
pub struct MemoryDisk {
    trees: Arc<Mutex<BTreeMap<String, MemoryTree>>>,
    unflushed: Unflushed,
    /// How long a flush takes (of the runtime's clock); none: it returns at once.
    flush_latency: Option<std::time::Duration>,
}

impl MemoryDisk {
    /// A deep copy with every write: what a clean exit leaves behind. The simulation restarts
    /// a node on the copy, so nothing its old instance still does can reach the new one.
    pub fn copy(&self) -> MemoryDisk {
        self.crash(usize::MAX)
    }

    /// What a crash leaves behind: a deep copy with every flushed write and the first `kept`
    /// of those since the last flush (the disk wrote them in order and stopped).
    pub fn crash(&self, kept: usize) -> MemoryDisk {
        let trees = self.trees.lock();
        let mut copied: BTreeMap<String, BTreeMap<Vec<u8>, Vec<u8>>> =
            trees.iter().map(|(name, tree)| (name.clone(), tree.lock().clone())).collect();
        let unflushed = self.unflushed.lock();
        for (_, name, key, before) in unflushed.entries.iter().skip(kept).rev() {
            let tree = copied.entry(name.clone()).or_default();
            match before {
                Some(v) => tree.insert(key.clone(), v.clone()),
                None => tree.remove(key),
            };
        }
        let trees = copied.into_iter().map(|(name, tree)| (name, Arc::new(Mutex::new(tree)))).collect();
        MemoryDisk { trees: Arc::new(Mutex::new(trees)), unflushed: Unflushed::default(), ..*self }
    }

    /// The same disk with flushes that take `latency`: a crash meanwhile may lose the writes
    /// the flush was making durable.
    pub fn with_flush_latency(self, latency: std::time::Duration) -> MemoryDisk {
        MemoryDisk { flush_latency: Some(latency), ..self }
    }

    /// How many writes were made since the last flush.
    pub fn unflushed(&self) -> usize {
        self.unflushed.lock().entries.len()
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
    /// A memory tree: its map, its name, and its disk's unflushed writes.
    Memory(MemoryTree, String, Unflushed),
}

impl Disk {
    /// Opens (or creates) the tree `name`.
    pub fn tree(&self, name: &str) -> Result<Tree, DiskError> {
        match self {
            Disk::Sled(db) => Ok(Tree::Sled(db.open_tree(name)?)),
            Disk::Memory(m) => {
                let tree = m.trees.lock().entry(name.to_string()).or_default().clone();
                Ok(Tree::Memory(tree, name.to_string(), m.unflushed.clone()))
            }
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
            Disk::Memory(m) => {
                // What is written by now; later writes wait for a later flush.
                let written = m.unflushed.lock().next;
                if let Some(latency) = m.flush_latency {
                    tokio::time::sleep(latency).await;
                }
                let mut unflushed = m.unflushed.lock();
                while unflushed.entries.front().is_some_and(|(seq, ..)| *seq < written) {
                    unflushed.entries.pop_front();
                }
                Ok(())
            }
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
            Tree::Memory(t, ..) => Ok(t.lock().get(key).cloned()),
        }
    }

    /// Stores `value` under `key`.
    pub fn insert(&self, key: &[u8], value: Vec<u8>) -> Result<(), DiskError> {
        match self {
            Tree::Sled(t) => t.insert(key, value).map(|_| ()).map_err(DiskError::from),
            Tree::Memory(t, name, unflushed) => {
                let before = t.lock().insert(key.to_vec(), value);
                unflushed.lock().record(name, key, before);
                Ok(())
            }
        }
    }

    /// Removes `key`.
    pub fn remove(&self, key: &[u8]) -> Result<(), DiskError> {
        match self {
            Tree::Sled(t) => t.remove(key).map(|_| ()).map_err(DiskError::from),
            Tree::Memory(t, name, unflushed) => {
                if let Some(before) = t.lock().remove(key) {
                    unflushed.lock().record(name, key, Some(before));
                }
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
            Tree::Memory(t, ..) => Ok(t
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
            Tree::Memory(t, ..) => Ok(t.lock().iter().next_back().map(|(k, v)| (k.clone(), v.clone()))),
        }
    }

    /// Replaces the value under `key` by `new` if it is still `old` (`None`: absent);
    /// returns whether it did. Atomic.
    pub fn compare_and_swap(&self, key: &[u8], old: Option<&[u8]>, new: Vec<u8>) -> Result<bool, DiskError> {
        match self {
            Tree::Sled(t) => Ok(t.compare_and_swap(key, old, Some(new))?.is_ok()),
            Tree::Memory(t, name, unflushed) => {
                let mut t = t.lock();
                if t.get(key).map(Vec::as_slice) != old {
                    return Ok(false);
                }
                let before = t.insert(key.to_vec(), new);
                unflushed.lock().record(name, key, before);
                Ok(true)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_crash_keeps_the_flushed_writes_and_a_prefix_of_the_others() {
        let memory = MemoryDisk::default();
        let disk = Disk::Memory(memory.clone());
        let (a, b) = (disk.tree("a").expect("tree"), disk.tree("b").expect("tree"));
        a.insert(b"k", b"1".to_vec()).expect("insert");
        tokio::runtime::Builder::new_current_thread().build().expect("runtime").block_on(disk.flush()).expect("flush");
        assert_eq!(memory.unflushed(), 0);
        a.insert(b"k", b"2".to_vec()).expect("insert");
        b.insert(b"x", b"y".to_vec()).expect("insert");
        a.remove(b"k").expect("remove");
        assert!(b.compare_and_swap(b"x", Some(b"y"), b"z".to_vec()).expect("cas"));
        let read =
            |m: MemoryDisk, tree: &str, key: &[u8]| Disk::Memory(m).tree(tree).expect("tree").get(key).expect("get");
        let none = memory.crash(0);
        assert_eq!(read(none.clone(), "a", b"k"), Some(b"1".to_vec()), "the flushed value");
        assert_eq!(read(none, "b", b"x"), None);
        let two = memory.crash(2);
        assert_eq!(read(two.clone(), "a", b"k"), Some(b"2".to_vec()));
        assert_eq!(read(two, "b", b"x"), Some(b"y".to_vec()));
        let all = memory.copy();
        assert_eq!(read(all.clone(), "a", b"k"), None);
        assert_eq!(read(all.clone(), "b", b"x"), Some(b"z".to_vec()));
        assert_eq!(all.unflushed(), 0, "a copy starts with nothing unflushed");
        assert_eq!(read(memory, "b", b"x"), Some(b"z".to_vec()), "the disk itself keeps every write");
    }

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
