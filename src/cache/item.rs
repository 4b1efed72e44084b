//! One cached item, laid out compactly: key and value share one allocation.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use bytes::Bytes;

/// Bytes charged per item on top of its key, value and tags: the item record, its index
/// slot and allocator overhead, so that `--cache-size` bounds real memory, not payload.
pub const ITEM_OVERHEAD_BYTES: u64 = 96;

/// Options that most items do not have, kept out of line so plain items stay small.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ItemMeta {
    /// Tags, for get/remove by tag.
    pub tags: Box<[Box<str>]>,
    /// Sliding expiration: every access pushes the expiry this far into the future.
    pub sliding_ms: u64,
}

/// A cached item.
///
/// `expires_at_ms` and `last_access_ms` are atomics so that a read under the bucket's shared
/// lock can extend a sliding expiry and record the access for LRU.
#[derive(Debug)]
pub struct Item {
    /// `key ++ value` in one allocation; shared with readers without copying.
    data: Arc<[u8]>,
    key_len: u32,
    /// The item's version: increases with every write of the bucket (see `Bucket`).
    pub version: u64,
    /// Absolute expiry in Unix ms; 0 means never.
    expires_at_ms: AtomicU64,
    /// Last read or write in Unix ms, for approximate LRU eviction.
    last_access_ms: AtomicU64,
    /// Tags and sliding expiry, if any.
    pub meta: Option<Box<ItemMeta>>,
}

impl Item {
    /// A new item. `expires_at_ms == 0` means no expiry.
    pub fn new(
        key: &[u8],
        value: &[u8],
        version: u64,
        expires_at_ms: u64,
        now_ms: u64,
        meta: Option<ItemMeta>,
    ) -> Self {
        let mut data = Vec::with_capacity(key.len() + value.len());
        data.extend_from_slice(key);
        data.extend_from_slice(value);
        Item {
            data: data.into(),
            key_len: key.len() as u32,
            version,
            expires_at_ms: AtomicU64::new(expires_at_ms),
            last_access_ms: AtomicU64::new(now_ms),
            meta: meta.map(Box::new),
        }
    }

    /// The key.
    pub fn key(&self) -> &[u8] {
        &self.data[..self.key_len as usize]
    }

    /// The value, as a slice.
    pub fn value(&self) -> &[u8] {
        &self.data[self.key_len as usize..]
    }

    /// The value as `Bytes` that share the item's allocation (no copy).
    pub fn value_bytes(&self) -> Bytes {
        Bytes::from_owner(ValueSlice { data: self.data.clone(), start: self.key_len as usize })
    }

    /// Absolute expiry in Unix ms, 0 for none.
    pub fn expires_at_ms(&self) -> u64 {
        self.expires_at_ms.load(Ordering::Relaxed)
    }

    /// Last access in Unix ms.
    pub fn last_access_ms(&self) -> u64 {
        self.last_access_ms.load(Ordering::Relaxed)
    }

    /// Whether the item has expired at `now_ms`.
    pub fn is_expired(&self, now_ms: u64) -> bool {
        let at = self.expires_at_ms();
        at != 0 && at <= now_ms
    }

    /// Records an access: LRU time, and a sliding expiry pushed forward.
    pub fn touch(&self, now_ms: u64) {
        self.last_access_ms.store(now_ms, Ordering::Relaxed);
        if let Some(meta) = &self.meta {
            if meta.sliding_ms > 0 {
                self.expires_at_ms.store(now_ms.saturating_add(meta.sliding_ms), Ordering::Relaxed);
            }
        }
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
        self.data.len() as u64 + tags as u64 + ITEM_OVERHEAD_BYTES
    }
}

/// The value part of an item's allocation, owned by a `Bytes`.
struct ValueSlice {
    data: Arc<[u8]>,
    start: usize,
}

impl AsRef<[u8]> for ValueSlice {
    fn as_ref(&self) -> &[u8] {
        &self.data[self.start..]
    }
}
