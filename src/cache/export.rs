//! Moving a bucket's items between stores: export (a snapshot, then the changes made since,
//! then a freeze) and import (items and changes applied by version).
//!
//! ```text
//!  source bucket:  begin_export ─ snapshot ─▶ drain_changes ─▶ … ─▶ freeze ─▶ (flip) ─▶ end_export
//!                  └── every put/delete from here on is also recorded ──┘   writes refused
//! ```
//!
//! Recording and freezing happen under the bucket's write lock, in the same critical section
//! as the writes themselves, so no write can fall between the snapshot and the log, or between
//! the last drain and the freeze.

use bytes::Bytes;
use shoal_raft::BucketId;

use super::item::{Item, ItemMeta, Priority};
use super::CacheStore;

/// An item as it travels between nodes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExportedItem {
    /// The key.
    pub key: Bytes,
    /// The value.
    pub value: Bytes,
    /// Its version at the source (kept as is: versions never go back).
    pub version: u64,
    /// Absolute expiry in Unix ms, 0 for none.
    pub expires_at_ms: u64,
    /// Sliding expiration, 0 for none.
    pub sliding_ms: u64,
    /// Tags.
    pub tags: Box<[Box<str>]>,
    /// Eviction priority.
    pub priority: Priority,
}

impl ExportedItem {
    pub(super) fn of(item: &Item) -> Self {
        ItemRef::of(item).to_owned()
    }

    /// The item seen in place.
    pub fn as_ref(&self) -> ItemRef<'_> {
        ItemRef {
            key: &self.key,
            value: &self.value,
            shared: Some(&self.value),
            version: self.version,
            expires_at_ms: self.expires_at_ms,
            sliding_ms: self.sliding_ms,
            tags: &self.tags,
            priority: self.priority,
        }
    }
}

/// An item seen in place, as it would travel: what a snapshot hands to its visitor while the
/// bucket is locked, so that it can be encoded without an intermediate copy.
#[derive(Debug, Clone, Copy)]
pub struct ItemRef<'a> {
    /// The key.
    pub key: &'a [u8],
    /// The value.
    pub value: &'a [u8],
    /// The value when it is kept in a shared buffer (values larger than
    /// [`super::item::LARGE_VALUE_BYTES`]): keeping it copies nothing, so a visitor can encode
    /// it after the lock is released instead of copying megabytes under it.
    pub shared: Option<&'a Bytes>,
    /// Its version.
    pub version: u64,
    /// Absolute expiry in Unix ms, 0 for none.
    pub expires_at_ms: u64,
    /// Sliding expiration, 0 for none.
    pub sliding_ms: u64,
    /// Tags.
    pub tags: &'a [Box<str>],
    /// Eviction priority.
    pub priority: Priority,
}

impl<'a> ItemRef<'a> {
    fn of(item: &'a Item) -> Self {
        ItemRef {
            key: item.key(),
            value: item.value(),
            shared: item.meta.as_ref().and_then(|m| m.large_value.as_ref()),
            version: item.version(),
            expires_at_ms: item.expires_at_ms(),
            sliding_ms: item.meta.as_ref().map_or(0, |m| m.sliding_ms),
            tags: item.tags(),
            priority: item.priority(),
        }
    }

    /// An owned copy (a shared value is shared, not copied).
    pub fn to_owned(&self) -> ExportedItem {
        ExportedItem {
            key: Bytes::copy_from_slice(self.key),
            value: self.shared.cloned().unwrap_or_else(|| Bytes::copy_from_slice(self.value)),
            version: self.version,
            expires_at_ms: self.expires_at_ms,
            sliding_ms: self.sliding_ms,
            tags: self.tags.into(),
            priority: self.priority,
        }
    }
}

/// A write to a bucket, as recorded for export or applied on import.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Change {
    /// The item now has this value and version.
    Put(ExportedItem),
    /// The item with this key, at this version or older, is gone.
    Delete {
        /// The key.
        key: Bytes,
        /// The version of the item deleted.
        version: u64,
    },
    /// The item with this key, at exactly this version, lives at least until then (its
    /// owner's reads moved its sliding expiry).
    Expire {
        /// The key.
        key: Bytes,
        /// The version of the item.
        version: u64,
        /// When it expires at the earliest, in Unix ms.
        expires_at_ms: u64,
    },
}

/// A bucket's export in progress.
#[derive(Debug, Default)]
pub(super) struct ExportLog {
    /// Identifies this export: a newer export of the bucket replaces it, and the calls of
    /// the older one (still winding down) must not touch the newer one.
    token: u64,
    changes: Vec<Change>,
    frozen: bool,
}

/// Changes applied under one hold of a bucket's lock, at most.
const APPLY_GROUP: usize = 256;

/// Hands out export tokens.
static NEXT_TOKEN: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

impl ExportLog {
    pub(super) fn record(&mut self, change: Change) {
        self.changes.push(change);
    }

    pub(super) fn frozen(&self) -> bool {
        self.frozen
    }
}

impl CacheStore {
    /// Starts exporting `bucket`: passes each of its live items to `visit` (a snapshot taken
    /// under the bucket's lock: the visitor should be quick), and records every write to it
    /// from now on until [`Self::end_export`]. Returns the export's token. A previous export of
    /// the bucket that is still recording is cancelled; a frozen one is not (its move may still
    /// be flipped, and thawing it would let writes land here after the new owner's copy):
    /// `None`, and nothing is visited.
    pub fn begin_export(&self, bucket: BucketId, visit: impl FnMut(ItemRef<'_>)) -> Option<u64> {
        let now = self.clock.now_ms();
        let mut b = self.bucket(bucket).write();
        if b.export.as_ref().is_some_and(|e| e.frozen) {
            return None;
        }
        let token = NEXT_TOKEN.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        b.export = Some(ExportLog { token, ..ExportLog::default() });
        b.iter().filter(|i| !i.is_expired(now)).map(ItemRef::of).for_each(visit);
        Some(token)
    }

    /// Passes each of `bucket`'s live items to `visit` (under the bucket's read lock), without
    /// recording; returns the bucket's version counter.
    pub fn visit_items(&self, bucket: BucketId, visit: impl FnMut(ItemRef<'_>)) -> u64 {
        let now = self.clock.now_ms();
        let b = self.bucket(bucket).read();
        b.iter().filter(|i| !i.is_expired(now)).map(ItemRef::of).for_each(visit);
        b.version_counter()
    }

    /// A snapshot of `bucket`'s live items and its version counter, without recording.
    pub fn snapshot(&self, bucket: BucketId) -> (Vec<ExportedItem>, u64) {
        let mut items = Vec::new();
        let counter = self.visit_items(bucket, |i| items.push(i.to_owned()));
        (items, counter)
    }

    /// The item stored under `key`, as it would travel.
    pub fn export_item(&self, bucket: BucketId, key: &[u8]) -> Option<ExportedItem> {
        use std::hash::BuildHasher;
        let hash = self.hasher.hash_one(key);
        let b = self.bucket(bucket).read();
        b.get(hash, key).map(ExportedItem::of)
    }

    /// The writes recorded since the snapshot or the previous drain (of export `token`).
    pub fn drain_changes(&self, bucket: BucketId, token: u64) -> Vec<Change> {
        let mut b = self.bucket(bucket).write();
        match b.export.as_mut() {
            Some(e) if e.token == token => std::mem::take(&mut e.changes),
            _ => Vec::new(),
        }
    }

    /// Freezes `bucket`: from now on writes to it are refused with [`super::CacheError::Frozen`]
    /// (reads go on). Returns the last recorded writes and the bucket's version counter, or
    /// `None` if export `token` was replaced by a newer one.
    pub fn freeze(&self, bucket: BucketId, token: u64) -> Option<(Vec<Change>, u64)> {
        let mut b = self.bucket(bucket).write();
        let counter = b.version_counter();
        match b.export.as_mut() {
            Some(e) if e.token == token => {
                e.frozen = true;
                Some((std::mem::take(&mut e.changes), counter))
            }
            _ => None,
        }
    }

    /// Whether `bucket` is frozen.
    pub fn is_frozen(&self, bucket: BucketId) -> bool {
        self.bucket(bucket).read().export.as_ref().is_some_and(|e| e.frozen)
    }

    /// Ends export `token`: stops recording and thaws the bucket (a newer export is left
    /// alone).
    pub fn end_export(&self, bucket: BucketId, token: u64) {
        let mut b = self.bucket(bucket).write();
        if b.export.as_ref().is_some_and(|e| e.token == token) {
            b.export = None;
        }
        drop(b);
        self.thawed.notify_waiters();
    }

    /// Waits until some bucket is thawed (or a moment passes).
    pub async fn wait_thawed(&self) {
        let _ = tokio::time::timeout(std::time::Duration::from_millis(100), self.thawed.notified()).await;
    }

    /// A new item (version 0) holding what `e` says.
    fn item_of(&self, e: &ExportedItem, now: u64) -> Item {
        let meta = (!e.tags.is_empty() || e.sliding_ms > 0).then(|| ItemMeta {
            tags: e.tags.clone(),
            sliding_ms: e.sliding_ms,
            large_value: None,
        });
        self.new_item(Item::new(&e.key, &e.value, 0, e.expires_at_ms, now, meta), e.priority, now)
    }

    /// Applies an imported change: a put lands unless the bucket holds a newer version of
    /// the key; a delete removes the key unless the bucket holds a newer version. Applying the
    /// same change twice is harmless.
    pub fn apply_change(&self, bucket: BucketId, change: &Change) {
        self.apply_changes(bucket, std::slice::from_ref(change));
    }

    /// Applies imported changes in order, as [`Self::apply_change`] does one: their items
    /// are built before the bucket is locked, and the lock is taken once per
    /// `APPLY_GROUP` changes rather than once per change.
    pub fn apply_changes(&self, bucket: BucketId, changes: &[Change]) {
        self.apply_changes_while(bucket, changes, || true);
    }

    /// [`Self::apply_changes`] as long as `still()` holds, asked under the bucket's lock before
    /// each group of changes: none lands after it turned false (whatever turned it false and
    /// was written since stays as it is). Answers whether every change was applied.
    pub fn apply_changes_while(&self, bucket: BucketId, changes: &[Change], still: impl Fn() -> bool) -> bool {
        use std::hash::BuildHasher;
        if changes.is_empty() {
            return still();
        }
        let now = self.clock.now_ms();
        for group in changes.chunks(APPLY_GROUP) {
            // Items and hashes are made before the lock is taken.
            let mut built: Vec<(u64, Option<Item>)> = group
                .iter()
                .map(|change| match change {
                    Change::Put(item) => {
                        let mut new = self.item_of(item, now);
                        new.set_version(item.version);
                        (self.hasher.hash_one(&item.key[..]), Some(new))
                    }
                    Change::Delete { key, .. } | Change::Expire { key, .. } => (self.hasher.hash_one(&key[..]), None),
                })
                .collect();
            let applied = self.mutate(bucket, |b, hasher| {
                if !still() {
                    return false;
                }
                for (change, (hash, new)) in group.iter().zip(built.iter_mut()) {
                    let hash = *hash;
                    match change {
                        Change::Put(item) => {
                            if b.get(hash, &item.key).is_some_and(|old| old.version() > item.version) {
                                continue;
                            }
                            b.raise_version_counter(item.version + 1);
                            b.insert(hasher, hash, new.take().expect("built above"));
                        }
                        Change::Delete { key, version } => {
                            if b.get(hash, key).is_some_and(|old| old.version() <= *version) {
                                b.remove(hasher, hash, key);
                            }
                        }
                        // A newer version carries its own expiry; an older one or none means
                        // the write has not arrived, was taken back, or the item is gone.
                        Change::Expire { key, version, expires_at_ms } => {
                            if let Some(item) = b.get(hash, key).filter(|i| i.version() == *version) {
                                item.extend_expiry(*expires_at_ms);
                            }
                        }
                    }
                }
                true
            });
            if !applied {
                return false;
            }
            self.evict_to_limit();
        }
        true
    }

    /// Takes back a write of `key` that its replica did not apply: if the key still
    /// holds version `written` (`None`: is still absent, after a delete), `previous` (the item
    /// before the write, or nothing) comes back, under a new version so that every copy orders
    /// it after the write. Returns whether anything changed.
    pub fn restore(&self, bucket: BucketId, key: &[u8], written: Option<u64>, previous: Option<&ExportedItem>) -> bool {
        use std::hash::BuildHasher;
        let now = self.clock.now_ms();
        let hash = self.hasher.hash_one(key);
        self.mutate(bucket, |b, hasher| {
            if b.get(hash, key).map(Item::version) != written {
                return false;
            }
            match previous {
                Some(p) => {
                    let mut item = self.item_of(p, now);
                    item.set_version(b.next_version());
                    if let Some(export) = b.export.as_mut() {
                        export.record(Change::Put(ExportedItem::of(&item)));
                    }
                    b.insert(hasher, hash, item);
                }
                None => {
                    let Some(version) = written else { return false };
                    if let Some(export) = b.export.as_mut() {
                        export.record(Change::Delete { key: Bytes::copy_from_slice(key), version });
                    }
                    b.remove(hasher, hash, key);
                }
            }
            true
        })
    }

    /// Raises `bucket`'s version counter to at least `counter` (after an import).
    pub fn raise_version_counter(&self, bucket: BucketId, counter: u64) {
        self.bucket(bucket).write().raise_version_counter(counter);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache::{CacheError, Clock, Condition, Write};
    use shoal_raft::bucket_of;

    fn put(s: &CacheStore, key: &str, value: &str) -> Result<u64, CacheError> {
        s.put(bucket_of(key.as_bytes()), &Write { key: key.as_bytes(), value: value.as_bytes(), ..Default::default() })
    }

    #[test]
    fn a_bucket_moves_with_every_write_made_during_the_export() {
        let source = CacheStore::new(u64::MAX, Clock::new());
        let target = CacheStore::new(u64::MAX, Clock::new());
        let b = bucket_of(b"t");
        let keys: Vec<String> = (0..50).map(|i| format!("{{t}}{i}")).collect();
        for k in &keys {
            put(&source, k, "old").expect("put");
        }
        let mut snapshot = Vec::new();
        let token = source.begin_export(b, |i| snapshot.push(i.to_owned())).expect("not frozen");
        // Writes during the export: overwrite, new key, delete.
        put(&source, &keys[0], "new").expect("put");
        put(&source, "{t}fresh", "x").expect("put");
        source.delete(b, keys[1].as_bytes(), None).expect("delete");
        let changes = source.drain_changes(b, token);
        assert_eq!(changes.len(), 3);
        put(&source, &keys[2], "late").expect("put");
        assert!(source.freeze(b, token + 1).is_none(), "another export's token does nothing");
        let (last, counter) = source.freeze(b, token).expect("our export");
        assert_eq!(last.len(), 1);
        assert_eq!(put(&source, &keys[3], "refused"), Err(CacheError::Frozen), "frozen buckets refuse writes");
        assert!(source.get(b, keys[3].as_bytes()).is_some(), "reads go on");
        assert!(source.begin_export(b, |_| {}).is_none(), "a retried pull does not thaw a frozen bucket");
        assert_eq!(put(&source, &keys[3], "refused"), Err(CacheError::Frozen));

        // Applied in any order the import may see them, twice, the result is the same.
        for change in snapshot.iter().cloned().map(Change::Put).chain(changes).chain(last.clone()).chain(last) {
            target.apply_change(b, &change);
        }
        target.raise_version_counter(b, counter);
        let read = |s: &CacheStore, k: &str| s.get(b, k.as_bytes()).map(|v| (v.value, v.version));
        for k in keys.iter().map(String::as_str).chain(["{t}fresh"]) {
            assert_eq!(read(&target, k), read(&source, k), "{k}");
        }
        assert!(read(&target, &keys[1]).is_none());
        let next = put(&target, &keys[0], "after").expect("put");
        assert!(next > read(&source, &keys[2]).map_or(0, |v| v.1), "versions keep increasing after the move");

        source.end_export(b, token + 1);
        assert_eq!(put(&source, &keys[3], "still frozen"), Err(CacheError::Frozen));
        source.end_export(b, token);
        assert!(put(&source, &keys[3], "thawed").is_ok());
        let _ = Condition::Always;
    }

    #[test]
    fn imported_changes_stop_landing_once_their_condition_fails_and_what_was_written_since_stays() {
        let source = CacheStore::new(u64::MAX, Clock::new());
        let b = bucket_of(b"t");
        let keys: Vec<String> = (0..2 * APPLY_GROUP + 1).map(|i| format!("{{t}}{i}")).collect();
        for k in &keys {
            put(&source, k, "old").expect("put");
        }
        let mut snapshot = Vec::new();
        source.begin_export(b, |i| snapshot.push(Change::Put(i.to_owned()))).expect("not frozen");

        let target = CacheStore::new(u64::MAX, Clock::new());
        put(&target, &keys[0], "served here").expect("put");
        assert!(target.take_bucket_while(b, || false).is_none());
        assert_eq!(target.bucket_stats(b).0, 1, "a take that may not happen leaves the bucket");
        assert!(target.take_bucket_while(b, || true).is_some());
        // The condition holds for the first group only.
        let asked = std::cell::Cell::new(0);
        let still = || {
            asked.set(asked.get() + 1);
            asked.get() == 1
        };
        assert!(!target.apply_changes_while(b, &snapshot, still), "not every change landed");
        assert_eq!(target.bucket_stats(b).0, APPLY_GROUP, "one group landed, then none");
        assert!(target.apply_changes_while(b, &snapshot, || true));
        assert_eq!(target.bucket_stats(b).0, keys.len());
    }
}
