//! One bucket's items: a slab of items and a hash index into it.
//!
//! The slab ([`Slab`], records in fixed chunks) makes random sampling (for eviction) O(1)
//! and scans cache-friendly; the index is
//! a `hashbrown::HashTable` of slab positions, hashed with the store's per-process seed
//! (this hash never leaves the process; routing uses the stable hash of `shoal-raft`).

use std::hash::BuildHasher;

use hashbrown::HashTable;

use super::export::ExportLog;
use super::item::Item;
use super::slab::Slab;

/// The hasher of the per-bucket indexes.
pub type IndexHasher = foldhash::fast::RandomState;

/// The items of one bucket.
#[derive(Debug, Default)]
pub struct Bucket {
    slab: Slab,
    index: HashTable<u32>,
    /// Sum of the items' charged bytes.
    bytes: u64,
    /// Items per eviction priority (by rank).
    levels: [u32; 6],
    /// Charged bytes of the `not_removable` items.
    pinned: u64,
    /// The version the next write in this bucket gets. Versions increase across all keys of
    /// the bucket, so a key deleted and written again never reuses an old version, and the
    /// counter travels with the bucket when it moves.
    next_version: u64,
    /// Set while the bucket is being exported: the writes to record, and whether it is frozen.
    pub(super) export: Option<ExportLog>,
}

impl Bucket {
    /// Number of items (expired ones not yet removed included).
    pub fn len(&self) -> usize {
        self.slab.len()
    }

    /// Whether the bucket holds no item.
    pub fn is_empty(&self) -> bool {
        self.slab.is_empty()
    }

    /// Charged bytes of all items.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Items per eviction priority, by rank.
    pub fn levels(&self) -> [u32; 6] {
        self.levels
    }

    /// Charged bytes of the items eviction must leave alone.
    pub fn pinned_bytes(&self) -> u64 {
        self.pinned
    }

    fn count_in(&mut self, item: &Item) {
        self.bytes += item.charged_bytes();
        self.levels[usize::from(item.priority().rank())] += 1;
        if item.is_pinned() {
            self.pinned += item.charged_bytes();
        }
    }

    fn count_out(&mut self, item: &Item) {
        self.bytes -= item.charged_bytes();
        self.levels[usize::from(item.priority().rank())] -= 1;
        if item.is_pinned() {
            self.pinned -= item.charged_bytes();
        }
    }

    /// Allocates the next version of this bucket.
    pub fn next_version(&mut self) -> u64 {
        self.next_version = self.next_version.clamp(1, super::MAX_VERSION);
        let v = self.next_version;
        self.next_version = (self.next_version + 1).min(super::MAX_VERSION);
        v
    }

    /// The version counter, for moving the bucket.
    pub fn version_counter(&self) -> u64 {
        self.next_version
    }

    /// Raises the version counter to at least `v` (when a moved bucket is installed).
    pub fn raise_version_counter(&mut self, v: u64) {
        self.next_version = self.next_version.max(v);
    }

    fn position(&self, hash: u64, key: &[u8]) -> Option<usize> {
        let slab = &self.slab;
        self.index.find(hash, |&i| slab.get(i as usize).is_some_and(|item| item.key() == key)).map(|&i| i as usize)
    }

    /// The item stored under `key` (whose index hash is `hash`).
    pub fn get(&self, hash: u64, key: &[u8]) -> Option<&Item> {
        self.position(hash, key).and_then(|i| self.slab.get(i))
    }

    /// Stores `item`, returning the item it replaced.
    pub fn insert(&mut self, hasher: &IndexHasher, hash: u64, item: Item) -> Option<Item> {
        self.count_in(&item);
        if let Some(i) = self.position(hash, item.key()) {
            let old = self.slab.replace(i, item);
            self.count_out(&old);
            return Some(old);
        }
        let pos = self.slab.len() as u32;
        self.slab.push(item);
        let slab = &self.slab;
        self.index.insert_unique(hash, pos, |&i| hasher.hash_one(key_at(slab, i)));
        None
    }

    /// Removes and returns the item under `key`.
    pub fn remove(&mut self, hasher: &IndexHasher, hash: u64, key: &[u8]) -> Option<Item> {
        let pos = self.position(hash, key)?;
        Some(self.remove_at(hasher, hash, pos))
    }

    /// Removes the item at slab position `pos` (its key hashes to `hash`): the last item
    /// takes its place and its index slot is updated.
    fn remove_at(&mut self, hasher: &IndexHasher, hash: u64, pos: usize) -> Item {
        if let Ok(entry) = self.index.find_entry(hash, |&i| i as usize == pos) {
            entry.remove();
        }
        let last = self.slab.len() - 1;
        if pos != last {
            let moved_hash = hasher.hash_one(key_at(&self.slab, last as u32));
            if let Some(slot) = self.index.find_mut(moved_hash, |&i| i as usize == last) {
                *slot = pos as u32;
            }
        }
        let item = self.slab.swap_remove(pos);
        self.count_out(&item);
        if self.index.capacity() > 64 && self.slab.len() < self.index.capacity() / 4 {
            let slab = &self.slab;
            self.index.shrink_to(slab.len() * 2, |&i| hasher.hash_one(key_at(slab, i)));
        }
        item
    }

    /// The item at slab position `pos` (for sampling).
    pub fn at(&self, pos: usize) -> Option<&Item> {
        self.slab.get(pos)
    }

    /// All items, in slab order.
    pub fn iter(&self) -> impl Iterator<Item = &Item> {
        self.slab.iter()
    }

    /// Removes every item for which `remove` is true; returns them.
    pub fn remove_where(&mut self, hasher: &IndexHasher, mut remove: impl FnMut(&Item) -> bool) -> Vec<Item> {
        let mut removed = Vec::new();
        let mut pos = 0;
        while let Some(item) = self.slab.get(pos) {
            if remove(item) {
                let hash = hasher.hash_one(item.key());
                removed.push(self.remove_at(hasher, hash, pos));
            } else {
                pos += 1;
            }
        }
        removed
    }
}

/// The key of the item at index position `i` (empty if out of range, which the index never
/// holds).
fn key_at(slab: &Slab, i: u32) -> &[u8] {
    slab.get(i as usize).map_or(&[], Item::key)
}
