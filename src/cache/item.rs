//! One cached item, laid out compactly.
//!
//! An item is a 40-byte record in its bucket's slab plus one allocation holding the key and
//! the value back to back (no reference count, no separate key allocation), so a 16-byte key
//! with a 100-byte value costs about 190 bytes in all (see `tests/perf/README.md`). Values
//! larger than [`LARGE_VALUE_BYTES`] live in a shared `Bytes` instead, so reading them never
//! copies megabytes while the bucket is locked; below that, a read copies the value, which
//! costs no more than sharing it would.

use std::sync::atomic::{AtomicU64, Ordering};

use bytes::Bytes;
pub use shoal_http_api::types::Priority;

/// Bytes charged per item on top of its key, value and tags: the slab record, its index slot
/// and allocator rounding, as measured (see `tests/perf/README.md`), so that `--cache-size`
/// bounds real memory, not payload.
pub const ITEM_OVERHEAD_BYTES: u64 = 80;

/// Values longer than this are kept in a shared buffer, read without copying.
pub const LARGE_VALUE_BYTES: usize = 4096;

/// Options that most items do not have, kept out of line so plain items stay small.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ItemMeta {
    /// Tags, for get/remove by tag.
    pub tags: Box<[Box<str>]>,
    /// Sliding expiration: every access pushes the expiry this far into the future.
    pub sliding_ms: u64,
    /// The value, when it is larger than [`LARGE_VALUE_BYTES`].
    pub large_value: Option<Bytes>,
}

/// Versions are 44-bit numbers (17.6 trillion writes per bucket); the bucket's counter
/// saturates there rather than wrap, so a version never goes back.
pub const MAX_VERSION: u64 = (1 << 44) - 1;

/// The LRU clock: seconds, 20 bits, wrapping every 12 days (Redis's ticks in seconds too,
/// with 24 bits). Idle times are computed modulo the wrap.
const CLOCK_BITS: u32 = 20;
const CLOCK_MASK: u64 = (1 << CLOCK_BITS) - 1;
/// Expiry is a 45-bit Unix millisecond time (good until the year 3084; later times are kept as
/// the largest one, never wrapped).
const EXPIRY_MASK: u64 = (1 << 45) - 1;
/// The eviction priority's rank sits in the 3 bits between the expiry and the key length.
const PRIORITY_SHIFT: u32 = 45;
const PRIORITY_MASK: u64 = 0b111 << PRIORITY_SHIFT;

/// With LFU eviction the 20 clock bits hold an 8-bit logarithmic access counter (Redis's) and
/// the minute it was last decayed (12 bits, wrapping every 68 hours).
const LFU_COUNTER_BITS: u32 = 8;
const LFU_COUNTER_MASK: u64 = (1 << LFU_COUNTER_BITS) - 1;
const LFU_MINUTES_MASK: u64 = (1 << (CLOCK_BITS - LFU_COUNTER_BITS)) - 1;
/// A new item's counter: it is not evicted before it had a chance to be read again.
pub const LFU_INIT: u8 = 5;
/// How much harder each increment gets as the counter grows (Redis's `lfu-log-factor`).
const LFU_LOG_FACTOR: f64 = 10.0;

/// A cached item: a 40-byte record.
///
/// Two words pack small fields: `version_clock` holds the version (44 high bits, immutable)
/// and the LRU clock (20 low bits; with LFU eviction the access counter and its minute);
/// `keylen_expiry` holds the key length (16 high bits, immutable), the eviction priority
/// (3 bits) and the expiry (45 low bits). Both are atomics so that a read under the
/// bucket's shared lock can record the access and extend a sliding expiry.
#[derive(Debug)]
pub struct Item {
    /// `key ++ value`, or only the key when the value is large.
    data: Box<[u8]>,
    /// Tags, sliding expiry, large value, if any.
    pub meta: Option<Box<ItemMeta>>,
    version_clock: AtomicU64,
    keylen_expiry: AtomicU64,
}

impl Item {
    /// A new item. `expires_at_ms == 0` means no expiry. Keys are at most 65535 bytes (the
    /// configuration refuses a larger `--max-key-bytes`).
    pub fn new(
        key: &[u8],
        value: &[u8],
        version: u64,
        expires_at_ms: u64,
        now_ms: u64,
        meta: Option<ItemMeta>,
    ) -> Self {
        let key_len = key.len().min(usize::from(u16::MAX));
        let key = &key[..key_len];
        let (data, meta) = if value.len() > LARGE_VALUE_BYTES {
            let mut meta = meta.unwrap_or_default();
            meta.large_value = Some(Bytes::copy_from_slice(value));
            (Box::<[u8]>::from(key), Some(meta))
        } else {
            let mut data = Vec::with_capacity(key.len() + value.len());
            data.extend_from_slice(key);
            data.extend_from_slice(value);
            (data.into_boxed_slice(), meta)
        };
        let version = version.min(MAX_VERSION);
        Item {
            data,
            meta: meta.map(Box::new),
            version_clock: AtomicU64::new(version << CLOCK_BITS | clock(now_ms)),
            keylen_expiry: AtomicU64::new((key_len as u64) << 48 | expires_at_ms.min(EXPIRY_MASK)),
        }
    }

    fn key_len(&self) -> usize {
        (self.keylen_expiry.load(Ordering::Relaxed) >> 48) as usize
    }

    /// The item's version: increases with every write of the bucket (see `Bucket`).
    pub fn version(&self) -> u64 {
        self.version_clock.load(Ordering::Relaxed) >> CLOCK_BITS
    }

    /// Sets the version (only before the item is shared).
    pub fn set_version(&mut self, version: u64) {
        let clock = *self.version_clock.get_mut() & CLOCK_MASK;
        *self.version_clock.get_mut() = version.min(MAX_VERSION) << CLOCK_BITS | clock;
    }

    /// The key.
    pub fn key(&self) -> &[u8] {
        &self.data[..self.key_len()]
    }

    /// The value, as a slice.
    pub fn value(&self) -> &[u8] {
        match self.meta.as_ref().and_then(|m| m.large_value.as_ref()) {
            Some(large) => large,
            None => &self.data[self.key_len()..],
        }
    }

    /// The value as `Bytes`: shared for large values, a copy for small ones.
    pub fn value_bytes(&self) -> Bytes {
        match self.meta.as_ref().and_then(|m| m.large_value.as_ref()) {
            Some(large) => large.clone(),
            None => Bytes::copy_from_slice(&self.data[self.key_len()..]),
        }
    }

    /// The eviction priority.
    pub fn priority(&self) -> Priority {
        Priority::of_rank(((self.keylen_expiry.load(Ordering::Relaxed) & PRIORITY_MASK) >> PRIORITY_SHIFT) as u8)
    }

    /// Sets the eviction priority (only before the item is shared).
    pub fn set_priority(&mut self, priority: Priority) {
        let word = self.keylen_expiry.get_mut();
        *word = (*word & !PRIORITY_MASK) | (u64::from(priority.rank()) << PRIORITY_SHIFT);
    }

    /// Whether eviction must leave it alone.
    pub fn is_pinned(&self) -> bool {
        self.priority() == Priority::NotRemovable
    }

    /// Starts the LFU counter (a new item under LFU eviction; only before it is shared).
    pub fn start_lfu(&mut self, now_ms: u64) {
        let word = self.version_clock.get_mut();
        *word = (*word & !CLOCK_MASK) | lfu_word(minutes(now_ms), LFU_INIT);
    }

    /// The LFU counter now: what it was at the last access, less one per minute since.
    pub fn lfu_count(&self, now_ms: u64) -> u8 {
        let word = self.version_clock.load(Ordering::Relaxed) & CLOCK_MASK;
        decayed(word, now_ms)
    }

    /// Records an access under LFU eviction: the counter decays, then grows with a
    /// probability that falls as it grows (`chance` is a uniform draw in [0, 1)); sliding
    /// expiry moves as on any access (see [`Self::touch`] for what it answers).
    pub fn touch_lfu(&self, now_ms: u64, chance: f64) -> Option<u64> {
        let word = self.version_clock.load(Ordering::Relaxed);
        let mut count = decayed(word & CLOCK_MASK, now_ms);
        if count < u8::MAX {
            let base = f64::from(count.saturating_sub(LFU_INIT));
            if chance < 1.0 / (base * LFU_LOG_FACTOR + 1.0) {
                count += 1;
            }
        }
        let next = (word & !CLOCK_MASK) | lfu_word(minutes(now_ms), count);
        if next != word {
            self.version_clock.store(next, Ordering::Relaxed);
        }
        self.slide(now_ms)
    }

    /// Absolute expiry in Unix ms, 0 for none.
    pub fn expires_at_ms(&self) -> u64 {
        self.keylen_expiry.load(Ordering::Relaxed) & EXPIRY_MASK
    }

    /// Seconds since the last access (modulo the 12-day wrap of the LRU clock).
    pub fn idle_seconds(&self, now_ms: u64) -> u64 {
        let last = self.version_clock.load(Ordering::Relaxed) & CLOCK_MASK;
        clock(now_ms).wrapping_sub(last) & CLOCK_MASK
    }

    /// Whether the item has expired at `now_ms`.
    pub fn is_expired(&self, now_ms: u64) -> bool {
        let at = self.expires_at_ms();
        at != 0 && at <= now_ms
    }

    /// Records an access: LRU time, and a sliding expiry pushed forward. Answers the new
    /// expiry when the replica must hear of it (`slide`).
    pub fn touch(&self, now_ms: u64) -> Option<u64> {
        let now = clock(now_ms);
        let word = self.version_clock.load(Ordering::Relaxed);
        // Skip the store when nothing changes: most reads of a hot key land in the same
        // second, and a write to a shared cache line is what slows concurrent readers. The
        // version bits never change after the item is shared, so a plain store is safe.
        if word & CLOCK_MASK != now {
            self.version_clock.store(word & !CLOCK_MASK | now, Ordering::Relaxed);
        }
        self.slide(now_ms)
    }

    /// The window of a sliding expiry (0: none).
    pub fn sliding_ms(&self) -> u64 {
        self.meta.as_ref().map_or(0, |m| m.sliding_ms)
    }

    /// Pushes a sliding expiry forward (never back, however readers race). Answers the new
    /// expiry when it entered another tenth of the window than where it was: the owner tells
    /// its replica then, so at most once per tenth of the window, whatever the reads.
    fn slide(&self, now_ms: u64) -> Option<u64> {
        let sliding = self.sliding_ms();
        if sliding == 0 {
            return None;
        }
        let at = now_ms.saturating_add(sliding).min(EXPIRY_MASK);
        let before = self
            .keylen_expiry
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |w| {
                (w & EXPIRY_MASK < at).then_some((w & !EXPIRY_MASK) | at)
            })
            .ok()?;
        let step = (sliding / 10).max(1);
        ((before & EXPIRY_MASK) / step != at / step).then_some(at)
    }

    /// Moves the expiry to `at_ms` if that is later (a replica follows its owner's sliding
    /// expiry); an item that never expires stays so.
    pub fn extend_expiry(&self, at_ms: u64) {
        let at = at_ms.min(EXPIRY_MASK);
        let _ = self.keylen_expiry.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |w| {
            let current = w & EXPIRY_MASK;
            (current != 0 && current < at).then_some((w & !EXPIRY_MASK) | at)
        });
    }

    /// Whether the item carries `tag`.
    pub fn has_tag(&self, tag: &str) -> bool {
        self.meta.as_ref().is_some_and(|m| m.tags.iter().any(|t| &**t == tag))
    }

    /// The tags, empty if none.
    pub fn tags(&self) -> &[Box<str>] {
        self.meta.as_ref().map(|m| &*m.tags).unwrap_or(&[])
    }

    /// The bytes this item is charged against the cache size.
    pub fn charged_bytes(&self) -> u64 {
        let tags: usize = self.tags().iter().map(|t| t.len() + 16).sum();
        let large = self.meta.as_ref().and_then(|m| m.large_value.as_ref()).map_or(0, Bytes::len);
        (self.data.len() + large + tags) as u64 + ITEM_OVERHEAD_BYTES
    }
}

/// The LRU clock at `ms`.
fn clock(ms: u64) -> u64 {
    (ms / 1000) & CLOCK_MASK
}

/// The LFU minute at `ms`.
fn minutes(ms: u64) -> u64 {
    (ms / 60_000) & LFU_MINUTES_MASK
}

fn lfu_word(minute: u64, count: u8) -> u64 {
    minute << LFU_COUNTER_BITS | u64::from(count)
}

/// An LFU word's counter at `now_ms`: one less per minute since it was last decayed.
fn decayed(word: u64, now_ms: u64) -> u8 {
    let count = (word & LFU_COUNTER_MASK) as u8;
    let last = word >> LFU_COUNTER_BITS;
    let elapsed = minutes(now_ms).wrapping_sub(last) & LFU_MINUTES_MASK;
    count.saturating_sub(u8::try_from(elapsed).unwrap_or(u8::MAX))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_item_record_stays_small() {
        assert!(std::mem::size_of::<Item>() <= 40, "{}", std::mem::size_of::<Item>());
    }

    #[test]
    fn small_and_large_values_read_back_whole() {
        let small = Item::new(b"k", b"value", 1, 0, 0, None);
        assert_eq!((small.key(), small.value()), (&b"k"[..], &b"value"[..]));
        let big = vec![7u8; LARGE_VALUE_BYTES + 1];
        let large = Item::new(b"key", &big, 1, 0, 0, None);
        assert_eq!(large.key(), b"key");
        assert_eq!(large.value_bytes(), big);
        assert_eq!(large.charged_bytes(), (3 + big.len()) as u64 + ITEM_OVERHEAD_BYTES);
    }
}

#[cfg(test)]
mod packing_tests {
    use super::*;

    #[test]
    fn packed_fields_keep_their_values() {
        let now = 1_700_000_123_456;
        let mut item = Item::new(b"key", b"v", 42, now + 5_000, now, None);
        assert_eq!((item.version(), item.expires_at_ms(), item.key()), (42, now + 5_000, &b"key"[..]));
        item.set_version(MAX_VERSION + 10);
        assert_eq!(item.version(), MAX_VERSION, "versions saturate, never wrap");
        assert_eq!(item.idle_seconds(now + 7_000), 7);
        item.touch(now + 7_000);
        assert_eq!(item.idle_seconds(now + 7_500), 0);
        assert_eq!(item.version(), MAX_VERSION, "touching keeps the version");
        assert_eq!(item.expires_at_ms(), now + 5_000, "and the expiry of a non-sliding item");
    }

    #[test]
    fn the_priority_sits_beside_the_key_length_and_the_expiry() {
        let now = 1_700_000_123_456;
        for p in Priority::ALL {
            let mut item = Item::new(b"some key", b"v", 7, now + 5_000, now, None);
            item.set_priority(p);
            assert_eq!((item.priority(), item.key(), item.expires_at_ms()), (p, &b"some key"[..], now + 5_000));
            assert_eq!(item.is_pinned(), p == Priority::NotRemovable);
        }
    }

    #[test]
    fn the_lfu_counter_grows_ever_slower_and_decays_by_the_minute() {
        let now = 1_700_000_000_000;
        let mut item = Item::new(b"k", b"v", 3, 0, now, None);
        item.start_lfu(now);
        assert_eq!(item.lfu_count(now), LFU_INIT);
        item.touch_lfu(now, 0.0);
        assert_eq!(item.lfu_count(now), LFU_INIT + 1, "a sure draw counts");
        item.touch_lfu(now, 0.5);
        assert_eq!(item.lfu_count(now), LFU_INIT + 1, "at 6 an access counts with probability 1/11");
        for _ in 0..300 {
            item.touch_lfu(now, 0.0);
        }
        assert_eq!(item.lfu_count(now), u8::MAX, "it saturates");
        assert_eq!(item.version(), 3, "the version stays");
        assert_eq!(item.lfu_count(now + 10 * 60_000), u8::MAX - 10, "one less per idle minute");
        assert_eq!(item.lfu_count(now + 600 * 60_000), 0);
    }

    #[test]
    fn idle_time_survives_the_clock_wrap() {
        let wrap_ms = (CLOCK_MASK + 1) * 1000;
        let item = Item::new(b"k", b"v", 1, 0, wrap_ms - 2_000, None);
        assert_eq!(item.idle_seconds(wrap_ms + 3_000), 5);
    }
}
