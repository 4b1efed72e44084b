//! The data plane's store: [`CacheStore`], the items of every bucket this node holds.
//!
//! One `hashbrown` table per bucket (1000 of them), each behind its own `RwLock`, so requests
//! for different buckets never contend and a whole bucket can be taken out or put back at
//! once (state transfer moves buckets). The store knows nothing of ownership or routing: the
//! node API (`crate::api`) decides which node serves a key; the store keeps whatever it is given.
//!
//! Memory: every item is charged its key, value and tag bytes plus a fixed
//! [`ITEM_OVERHEAD_BYTES`]; when the total exceeds the limit, writes evict by sampling, as
//! Redis does: five random items, the expired one goes, else the one the [`EvictionPolicy`]
//! picks — least recently used (LRU), least frequently used (LFU: a logarithmic counter in the
//! item's clock bits that decays by the minute), or, under priority eviction, the least
//! recently used of the lowest eviction priority any item has (the store counts items per
//! level; a rare level is found by a scan). `not_removable` items are never evicted, under
//! any policy; a write that cannot fit beside them is refused ([`CacheError::Full`]).
//! Expired items vanish on read and through [`CacheStore::sweep_expired`].
//!
//! # Layout
//! - `item.rs`: [`Item`], key and value in one allocation, version, expiry, tags.
//! - `bucket.rs`: [`Bucket`], a slab of items with a hash index; the version counter.
//! - `slab.rs`: the slab, item records in fixed-size chunks (no reallocation as it grows).
//! - `clock.rs`: [`Clock`], Unix milliseconds that follow tokio's pausable time.

mod bucket;
mod clock;
mod export;
mod item;
mod slab;
#[cfg(test)]
mod tests;

use std::hash::BuildHasher;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use parking_lot::RwLock;
use rand::Rng;
use shoal_http_api::types::Page;
use shoal_raft::{BucketId, BUCKET_COUNT};

pub use bucket::{Bucket, IndexHasher};
pub use clock::Clock;
pub use export::{Change, ExportedItem, ItemRef};
pub use item::{Item, ItemMeta, Priority, ITEM_OVERHEAD_BYTES, LARGE_VALUE_BYTES, MAX_VERSION};

/// How the store picks what to evict when it is over its size.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum EvictionPolicy {
    /// The least recently used of a few sampled items (as Redis's `allkeys-lru`).
    #[default]
    Lru,
    /// The least frequently used of a few sampled items: a logarithmic access counter that
    /// decays by one per idle minute (as Redis's `allkeys-lfu`).
    Lfu,
    /// The lowest eviction priority first, the least recently used within it (NCache's
    /// priority eviction).
    Priority,
}

/// A write's precondition.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Condition {
    /// Always write (insert or replace).
    #[default]
    Always,
    /// Only if the key is absent (`mode=add`, `cas=0`).
    Absent,
    /// Only if the key is present (`mode=replace`).
    Present,
    /// Only if the current version is exactly this (`cas=N`).
    Version(u64),
}

/// A write to the store.
#[derive(Debug, Clone, Default)]
pub struct Write<'a> {
    /// The key.
    pub key: &'a [u8],
    /// The value.
    pub value: &'a [u8],
    /// Absolute expiration, from now.
    pub ttl: Option<Duration>,
    /// Sliding expiration: every access extends the item's life by this much.
    pub sliding: Option<Duration>,
    /// Tags.
    pub tags: &'a [String],
    /// Precondition.
    pub condition: Condition,
    /// Eviction priority.
    pub priority: Priority,
}

/// What a read returns.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ItemView {
    /// The value (shares the item's memory).
    pub value: Bytes,
    /// The item's version.
    pub version: u64,
    /// Absolute expiry in Unix ms, 0 for none.
    pub expires_at_ms: u64,
}

/// Why a write or delete did not happen. Nothing changed in either case.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CacheError {
    /// The precondition did not hold; `current` is the version found (None: absent).
    #[error("precondition failed (current version: {current:?})")]
    ConditionFailed {
        /// The version found, if the key exists.
        current: Option<u64>,
    },
    /// The bucket is frozen while it moves to another node; retry once the move is settled.
    #[error("the bucket is moving to another node")]
    Frozen,
    /// The item alone is larger than the whole cache.
    #[error("item of {charged} bytes exceeds the cache size of {limit} bytes")]
    TooLarge {
        /// What the item would be charged.
        charged: u64,
        /// The cache size.
        limit: u64,
    },
    /// The item does not fit beside the `not_removable` items, which eviction leaves alone.
    #[error("the cache holds {pinned} bytes of not_removable items of its {limit}: an item of {charged} bytes does not fit; remove some or lower their priority")]
    Full {
        /// What the item would be charged.
        charged: u64,
        /// Bytes of `not_removable` items held (the one it would replace not counted).
        pinned: u64,
        /// The cache size.
        limit: u64,
    },
}

/// A sliding expiry a read moved, for the replica: the item of `key` at `version` lives at
/// least until `expires_at_ms`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refresh {
    /// The item's bucket.
    pub bucket: BucketId,
    /// Its key.
    pub key: Bytes,
    /// Its version.
    pub version: u64,
    /// When it expires at the earliest.
    pub expires_at_ms: u64,
}

/// Counters and gauges of the store.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// Items held (expired ones not yet swept included).
    pub items: u64,
    /// Charged bytes held.
    pub bytes: u64,
    /// The size limit.
    pub limit_bytes: u64,
    /// Items evicted to make room, since start.
    pub evictions: u64,
    /// Items removed because they expired, since start.
    pub expirations: u64,
}

/// The items of every bucket this node holds. See the module docs.
pub struct CacheStore {
    buckets: Box<[RwLock<Bucket>]>,
    hasher: IndexHasher,
    clock: Clock,
    limit_bytes: AtomicU64,
    used_bytes: AtomicU64,
    items: AtomicU64,
    evictions: AtomicU64,
    expirations: AtomicU64,
    /// Woken when a frozen bucket thaws.
    thawed: tokio::sync::Notify,
    /// Evicted items (bucket, key, version), kept for the replica when enabled.
    evicted: parking_lot::Mutex<Option<Vec<(BucketId, Bytes, u64)>>>,
    /// Sliding expiries reads moved into another tenth of their window (bucket, key,
    /// version, expiry to tell the replica), kept for the replica when enabled.
    refreshed: parking_lot::Mutex<Option<Vec<Refresh>>>,
    /// How victims are chosen.
    policy: EvictionPolicy,
    /// Items per eviction priority (by rank), over all buckets.
    levels: [AtomicU64; 6],
    /// Charged bytes of `not_removable` items.
    pinned_bytes: AtomicU64,
    /// Held by a `not_removable` write from its check to its count in `pinned_bytes`: two
    /// such writes to different buckets must not both fit on the same total (eviction never
    /// takes them back, so the store would stay over its limit).
    pinning: parking_lot::Mutex<()>,
}

/// How many evictions wait for the replica at most; beyond, the oldest are dropped (the
/// replica store then evicts by itself).
const EVICTION_LOG_LIMIT: usize = 100_000;

/// How many random items one eviction round compares.
const EVICTION_SAMPLES: usize = 5;

impl CacheStore {
    /// An empty store limited to `limit_bytes` charged bytes.
    pub fn new(limit_bytes: u64, clock: Clock) -> Self {
        CacheStore {
            buckets: (0..BUCKET_COUNT).map(|_| RwLock::new(Bucket::default())).collect(),
            hasher: IndexHasher::default(),
            clock,
            limit_bytes: AtomicU64::new(limit_bytes),
            used_bytes: AtomicU64::new(0),
            items: AtomicU64::new(0),
            evictions: AtomicU64::new(0),
            expirations: AtomicU64::new(0),
            thawed: tokio::sync::Notify::new(),
            evicted: parking_lot::Mutex::new(None),
            refreshed: parking_lot::Mutex::new(None),
            policy: EvictionPolicy::Lru,
            levels: Default::default(),
            pinned_bytes: AtomicU64::new(0),
            pinning: parking_lot::Mutex::new(()),
        }
    }

    /// The store with `policy` choosing what to evict.
    pub fn with_policy(mut self, policy: EvictionPolicy) -> Self {
        self.policy = policy;
        self
    }

    /// The eviction policy.
    pub fn policy(&self) -> EvictionPolicy {
        self.policy
    }

    /// `item`, with its priority, and its access counter started under LFU eviction.
    fn new_item(&self, mut item: Item, priority: Priority, now: u64) -> Item {
        item.set_priority(priority);
        if self.policy == EvictionPolicy::Lfu {
            item.start_lfu(now);
        }
        item
    }

    /// Starts keeping evicted items for [`Self::take_evicted`] (the active store does, so
    /// that evictions reach the replica).
    pub fn keep_evictions(&self) {
        self.evicted.lock().get_or_insert_with(Vec::new);
        self.refreshed.lock().get_or_insert_with(Vec::new);
    }

    /// The sliding expiries reads moved since the last call (kept with the evictions).
    pub fn take_refreshed(&self) -> Vec<Refresh> {
        self.refreshed.lock().as_mut().map(std::mem::take).unwrap_or_default()
    }

    /// The items evicted since the last call.
    pub fn take_evicted(&self) -> Vec<(BucketId, Bytes, u64)> {
        self.evicted.lock().as_mut().map(std::mem::take).unwrap_or_default()
    }

    /// An empty store with the same clock and index hasher, so that whole buckets can move
    /// between the two ([`Self::take_bucket`], [`Self::install_bucket`]): the replica store.
    pub fn sibling(&self, limit_bytes: u64) -> Self {
        let mut store = CacheStore::new(limit_bytes, self.clock).with_policy(self.policy);
        store.hasher = self.hasher.clone();
        store
    }

    /// Changes the size limit (a lone node's store takes all of `--cache-size`: it holds no
    /// replica; in a cluster it takes half); evicts down to a lower one.
    pub fn set_limit(&self, limit_bytes: u64) {
        if self.limit_bytes.swap(limit_bytes, Ordering::Relaxed) != limit_bytes {
            self.evict_to_limit();
        }
    }

    /// The store's clock.
    pub fn clock(&self) -> &Clock {
        &self.clock
    }

    fn bucket(&self, bucket: BucketId) -> &RwLock<Bucket> {
        &self.buckets[bucket.index() % BUCKET_COUNT]
    }

    /// Applies a bucket mutation and keeps the store-wide item and byte totals in step.
    fn mutate<R>(&self, bucket: BucketId, f: impl FnOnce(&mut Bucket, &IndexHasher) -> R) -> R {
        let mut b = self.bucket(bucket).write();
        let (items, bytes, levels, pinned) = (b.len() as i64, b.bytes() as i64, b.levels(), b.pinned_bytes() as i64);
        let r = f(&mut b, &self.hasher);
        let (d_items, d_bytes) = (b.len() as i64 - items, b.bytes() as i64 - bytes);
        let (after, d_pinned) = (b.levels(), b.pinned_bytes() as i64 - pinned);
        drop(b);
        add_signed(&self.items, d_items);
        add_signed(&self.used_bytes, d_bytes);
        if levels != after {
            for (counter, (a, b)) in self.levels.iter().zip(after.iter().zip(levels.iter())) {
                add_signed(counter, i64::from(*a) - i64::from(*b));
            }
        }
        if d_pinned != 0 {
            add_signed(&self.pinned_bytes, d_pinned);
        }
        r
    }

    /// Reads `key`; `None` if absent or expired (an expired item is removed on the way).
    pub fn get(&self, bucket: BucketId, key: &[u8]) -> Option<ItemView> {
        let hash = self.hasher.hash_one(key);
        let now = self.clock.now_ms();
        {
            let b = self.bucket(bucket).read();
            let item = b.get(hash, key)?;
            if !item.is_expired(now) {
                let moved = match self.policy {
                    EvictionPolicy::Lfu => item.touch_lfu(now, rand::rng().random::<f64>()),
                    _ => item.touch(now),
                };
                if let Some(at) = moved {
                    self.note_refresh(bucket, item, at);
                }
                return Some(view_of(item));
            }
        }
        self.remove_if_expired(bucket, hash, key, now);
        None
    }

    /// Keeps a sliding expiry a read moved to `at` for the replica (if this store keeps them),
    /// a tenth of the window later: the replica's copy then outlives the owner's until the
    /// owner's next report, so an item live on the owner is live on its replica.
    fn note_refresh(&self, bucket: BucketId, item: &Item, at: u64) {
        let mut log = self.refreshed.lock();
        let Some(log) = log.as_mut() else { return };
        if log.len() >= EVICTION_LOG_LIMIT {
            // The replica has not been told for long (no holder): it gets a snapshot when one
            // attaches, which carries the expiries as they are.
            return;
        }
        let step = (item.sliding_ms() / 10).max(1);
        log.push(Refresh {
            bucket,
            key: Bytes::copy_from_slice(item.key()),
            version: item.version(),
            expires_at_ms: at + step,
        });
    }

    fn remove_if_expired(&self, bucket: BucketId, hash: u64, key: &[u8], now: u64) {
        let removed = self.mutate(bucket, |b, hasher| {
            let expired = b.get(hash, key).is_some_and(|i| i.is_expired(now));
            expired.then(|| b.remove(hasher, hash, key)).flatten()
        });
        if removed.is_some() {
            self.expirations.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Writes an item if its condition holds; returns the new version. Evicts other items
    /// afterwards if the store is over its limit.
    pub fn put(&self, bucket: BucketId, write: &Write<'_>) -> Result<u64, CacheError> {
        let now = self.clock.now_ms();
        let meta = (!write.tags.is_empty() || write.sliding.is_some()).then(|| ItemMeta {
            tags: write.tags.iter().map(|t| t.as_str().into()).collect(),
            sliding_ms: write.sliding.map(|d| d.as_millis() as u64).unwrap_or(0),
            large_value: None,
        });
        let expires_at_ms = match (write.ttl, write.sliding) {
            (Some(ttl), _) => self.clock.after_ms(ttl),
            (None, Some(sliding)) => self.clock.after_ms(sliding),
            (None, None) => 0,
        };
        let hash = self.hasher.hash_one(write.key);
        let _pinning = (write.priority == Priority::NotRemovable).then(|| self.pinning.lock());
        let version = self.mutate(bucket, |b, hasher| {
            if b.export.as_ref().is_some_and(|e| e.frozen()) {
                return Err(CacheError::Frozen);
            }
            let current = b.get(hash, write.key).filter(|i| !i.is_expired(now)).map(Item::version);
            let holds = match write.condition {
                Condition::Always => true,
                Condition::Absent => current.is_none(),
                Condition::Present => current.is_some(),
                Condition::Version(v) => current == Some(v),
            };
            if !holds {
                return Err(CacheError::ConditionFailed { current });
            }
            let mut item =
                self.new_item(Item::new(write.key, write.value, 0, expires_at_ms, now, meta), write.priority, now);
            let limit = self.limit_bytes.load(Ordering::Relaxed);
            let charged = item.charged_bytes();
            if charged > limit {
                return Err(CacheError::TooLarge { charged, limit });
            }
            // Everything but the not_removable items can be evicted to make room: the write
            // fits if they and it do.
            let replaced = b.get(hash, write.key).filter(|i| i.is_pinned()).map_or(0, Item::charged_bytes);
            let pinned = self.pinned_bytes.load(Ordering::Relaxed).saturating_sub(replaced);
            if pinned + charged > limit {
                return Err(CacheError::Full { charged, pinned, limit });
            }
            let version = b.next_version();
            item.set_version(version);
            if let Some(export) = b.export.as_mut() {
                export.record(Change::Put(ExportedItem::of(&item)));
            }
            b.insert(hasher, hash, item);
            Ok(version)
        })?;
        self.evict_to_limit();
        Ok(version)
    }

    /// Deletes `key` if present (and, with `expected`, only at that version). `Ok(false)`
    /// when absent.
    pub fn delete(&self, bucket: BucketId, key: &[u8], expected: Option<u64>) -> Result<bool, CacheError> {
        let now = self.clock.now_ms();
        let hash = self.hasher.hash_one(key);
        self.mutate(bucket, |b, hasher| {
            if b.export.as_ref().is_some_and(|e| e.frozen()) {
                return Err(CacheError::Frozen);
            }
            let current = b.get(hash, key).filter(|i| !i.is_expired(now)).map(Item::version);
            match (current, expected) {
                (None, None) => Ok(false),
                (None, Some(_)) => Err(CacheError::ConditionFailed { current: None }),
                (Some(v), Some(e)) if v != e => Err(CacheError::ConditionFailed { current: Some(v) }),
                (Some(version), _) => {
                    if let Some(export) = b.export.as_mut() {
                        export.record(Change::Delete { key: Bytes::copy_from_slice(key), version });
                    }
                    Ok(b.remove(hasher, hash, key).is_some())
                }
            }
        })
    }

    /// Keys (with bucket and version) of live items whose key starts with `prefix`, in the
    /// given buckets, at most `limit`, sorted by key.
    pub fn keys_with_prefix(&self, prefix: &[u8], buckets: &[BucketId], page: &Page) -> Vec<(Vec<u8>, BucketId, u64)> {
        self.collect(buckets, page, |i| i.key().starts_with(prefix))
    }

    /// Keys (with bucket and version) of live items tagged `tag`, in the given buckets.
    pub fn keys_with_tag(&self, tag: &str, buckets: &[BucketId], page: &Page) -> Vec<(Vec<u8>, BucketId, u64)> {
        self.collect(buckets, page, |i| i.has_tag(tag))
    }

    fn collect(
        &self,
        buckets: &[BucketId],
        page: &Page,
        matches: impl Fn(&Item) -> bool,
    ) -> Vec<(Vec<u8>, BucketId, u64)> {
        let now = self.clock.now_ms();
        let mut found = Vec::new();
        for &bucket in buckets {
            let b = self.bucket(bucket).read();
            found.extend(
                b.iter()
                    .filter(|i| !i.is_expired(now) && page.after(i.key()) && matches(i))
                    .map(|i| (i.key().to_vec(), bucket, i.version())),
            );
        }
        found.sort();
        found.truncate(page.limit);
        found
    }

    /// Removes every item tagged `tag` in the given buckets; returns how many.
    pub fn remove_tagged(&self, tag: &str, buckets: &[BucketId]) -> usize {
        buckets
            .iter()
            .map(|&bucket| {
                self.mutate(bucket, |b, hasher| {
                    if b.export.as_ref().is_some_and(|e| e.frozen()) {
                        return 0;
                    }
                    let removed = b.remove_where(hasher, |i| i.has_tag(tag));
                    if let Some(export) = b.export.as_mut() {
                        for item in &removed {
                            export.record(Change::Delete {
                                key: Bytes::copy_from_slice(item.key()),
                                version: item.version(),
                            });
                        }
                    }
                    removed.len()
                })
            })
            .sum()
    }

    /// Removes expired items from the given buckets; returns how many.
    pub fn sweep_expired(&self, buckets: impl IntoIterator<Item = BucketId>) -> usize {
        let now = self.clock.now_ms();
        let mut removed = 0;
        for bucket in buckets {
            let has_expired = self.bucket(bucket).read().iter().any(|i| i.is_expired(now));
            if has_expired {
                removed += self.mutate(bucket, |b, hasher| b.remove_where(hasher, |i| i.is_expired(now)).len());
            }
        }
        self.expirations.fetch_add(removed as u64, Ordering::Relaxed);
        removed
    }

    /// Takes every item of `bucket` out of the store (to move it), leaving it empty; the
    /// version counter goes with the items.
    pub fn take_bucket(&self, bucket: BucketId) -> Bucket {
        self.take_bucket_while(bucket, || true).unwrap_or_default()
    }

    /// [`Self::take_bucket`], if `still()` holds when asked under the bucket's lock: whatever
    /// made it false, and anything written after, stays. `None` when it did not hold.
    pub fn take_bucket_while(&self, bucket: BucketId, still: impl FnOnce() -> bool) -> Option<Bucket> {
        let taken = self.mutate(bucket, |b, _| still().then(|| std::mem::take(b)));
        // Writes waiting on a frozen bucket re-route now.
        self.thawed.notify_waiters();
        taken
    }

    /// Puts a whole bucket in place of whatever `bucket` held. The bucket must come from this
    /// store or a [`Self::sibling`] (its index is hashed with the store's hasher).
    pub fn install_bucket(&self, bucket: BucketId, mut items: Bucket) {
        self.mutate(bucket, |b, _| {
            items.raise_version_counter(b.version_counter());
            *b = items;
        });
        self.evict_to_limit();
    }

    /// Items and charged bytes of `bucket`.
    pub fn bucket_stats(&self, bucket: BucketId) -> (usize, u64) {
        let b = self.bucket(bucket).read();
        (b.len(), b.bytes())
    }

    /// The store's counters.
    pub fn stats(&self) -> CacheStats {
        CacheStats {
            items: self.items.load(Ordering::Relaxed),
            bytes: self.used_bytes.load(Ordering::Relaxed),
            limit_bytes: self.limit_bytes.load(Ordering::Relaxed),
            evictions: self.evictions.load(Ordering::Relaxed),
            expirations: self.expirations.load(Ordering::Relaxed),
        }
    }

    /// Evicts until the store is within its limit (or empty).
    fn evict_to_limit(&self) {
        let limit = self.limit_bytes.load(Ordering::Relaxed);
        while self.used_bytes.load(Ordering::Relaxed) > limit {
            if !self.evict_one() {
                break;
            }
        }
    }

    /// One eviction round: the victim the policy picks (an expired item always goes first)
    /// is removed. Returns false if nothing can be evicted (the store is empty, or holds
    /// only `not_removable` items).
    fn evict_one(&self) -> bool {
        if self.items.load(Ordering::Relaxed) == 0 {
            return false;
        }
        let evictable: u64 = self.levels[..5].iter().map(|l| l.load(Ordering::Relaxed)).sum();
        if evictable == 0 {
            return false;
        }
        let now = self.clock.now_ms();
        // Under priority eviction only the lowest level that has items is sampled.
        let level = match self.policy {
            EvictionPolicy::Priority => {
                let lowest = Priority::ALL[..5]
                    .iter()
                    .copied()
                    .find(|p| self.levels[usize::from(p.rank())].load(Ordering::Relaxed) > 0);
                match lowest {
                    Some(p) => Some(p),
                    None => return false,
                }
            }
            _ => None,
        };
        let Some((bucket, key, version, expired)) = self.pick_victim(now, level) else { return false };
        let hash = self.hasher.hash_one(&key);
        let removed = self.mutate(bucket, |b, hasher| {
            let same = b.get(hash, &key).is_some_and(|i| i.version() == version);
            same.then(|| b.remove(hasher, hash, &key)).flatten()
        });
        if removed.is_some() {
            let counter = if expired { &self.expirations } else { &self.evictions };
            counter.fetch_add(1, Ordering::Relaxed);
            if let Some(log) = self.evicted.lock().as_mut() {
                if log.len() >= EVICTION_LOG_LIMIT {
                    log.remove(0);
                }
                log.push((bucket, Bytes::from(key), version));
            }
        }
        true
    }

    /// Among a few random evictable items (of `level` only, when given), the one the policy
    /// evicts first: expired, else the longest idle (LRU, priority) or least used (LFU).
    /// A rare level may not turn up by chance: then the buckets are scanned for it.
    fn pick_victim(&self, now: u64, level: Option<Priority>) -> Option<(BucketId, Vec<u8>, u64, bool)> {
        let mut rng = rand::rng();
        let mut victim: Option<(BucketId, Vec<u8>, u64, u64)> = None; // bucket, key, version, score
        let score = |item: &Item| -> u64 {
            if item.is_expired(now) {
                u64::MAX
            } else if self.policy == EvictionPolicy::Lfu {
                u64::from(u8::MAX - item.lfu_count(now))
            } else {
                item.idle_seconds(now)
            }
        };
        let wanted = |item: &Item| !item.is_pinned() && level.is_none_or(|l| item.priority() == l);
        let mut consider = |bucket: BucketId, item: &Item| {
            let s = score(item);
            if victim.as_ref().is_none_or(|v| s > v.3) {
                victim = Some((bucket, item.key().to_vec(), item.version(), s));
            }
        };
        let (mut tries, mut sampled) = (0, 0);
        while sampled < EVICTION_SAMPLES && tries < BUCKET_COUNT * 2 {
            tries += 1;
            let bucket = BucketId(rng.random_range(0..BUCKET_COUNT as u16));
            let b = self.bucket(bucket).read();
            if b.is_empty() {
                continue;
            }
            let Some(item) = b.at(rng.random_range(0..b.len())).filter(|i| wanted(i)) else { continue };
            sampled += 1;
            consider(bucket, item);
        }
        if sampled == 0 {
            let start = rng.random_range(0..BUCKET_COUNT);
            for i in 0..BUCKET_COUNT {
                let bucket = BucketId(((start + i) % BUCKET_COUNT) as u16);
                let b = self.bucket(bucket).read();
                if let Some(item) = b.iter().filter(|i| wanted(i)).max_by_key(|i| score(i)) {
                    consider(bucket, item);
                    break;
                }
            }
        }
        victim.map(|(bucket, key, version, score)| (bucket, key, version, score == u64::MAX))
    }
}

fn view_of(item: &Item) -> ItemView {
    ItemView { value: item.value_bytes(), version: item.version(), expires_at_ms: item.expires_at_ms() }
}

fn add_signed(counter: &AtomicU64, delta: i64) {
    if delta >= 0 {
        counter.fetch_add(delta as u64, Ordering::Relaxed);
    } else {
        counter.fetch_sub(delta.unsigned_abs(), Ordering::Relaxed);
    }
}
