//! The wire format of bucket data: framed and checksummed, one bucket per stream or request
//! (state transfer's streams, replica writes and snapshots, shadow writes).
//!
//! ```text
//!  stream  = header frame*
//!  header  = "SHOALXF" version:u8            (version 1)
//!  frame   = kind:u8 len:u32 payload[len] crc32(kind, len, payload):u32      (big-endian)
//!  ITEM    = key_len:u16 key version:u64 expires_at_ms:u64 sliding_ms:u64
//!            tag_count:u16 (tag_len:u16 tag)* value_len:u64 value_head
//!  ITEM_P  = priority:u8 ITEM       (an item whose eviction priority is not normal: rank 0-5;
//!            a node of an older version refuses a stream that holds one)
//!  CHUNK   = the next bytes of the current item's value
//!  DELETE  = key_len:u16 key version:u64
//!  EXPIRE  = key_len:u16 key version:u64 expires_at_ms:u64   (the item at exactly that
//!            version lives at least until then: its owner's reads moved its sliding expiry;
//!            a node of an older version refuses it, and the owner sends the bucket whole)
//!  END     = version_counter:u64 items:u64
//!  ERROR   = utf-8 message
//! ```
//!
//! Values longer than [`CHUNK_BYTES`] continue in CHUNK frames, so a 16 MiB value goes out as
//! 256 frames with the sender yielding between them: no single write holds the connection
//! or the event loop for long. Every frame carries a CRC-32; a corrupt or truncated stream is
//! an error, and a bucket whose stream failed is never flipped (the partial copy is pulled
//! again or dropped).
//!
//! Copies are what a transfer costs, so each byte is copied as few times as it can be: an
//! item is encoded once, straight from the store into the bytes that travel (a snapshot as
//! the bucket's lock is held, [`SnapshotEncoder`]; a large value, which the store shares,
//! after the lock is released), and a frame that arrives whole in one piece is decoded in
//! place, its key and value being slices of the piece.

use bytes::{Buf, BufMut, Bytes, BytesMut};

use shoal_raft::BucketId;

use crate::cache::{CacheStore, Change, ExportedItem, ItemRef, Priority};

/// The stream's magic and format version.
pub const HEADER: &[u8; 8] = b"SHOALXF\x01";
/// Most value bytes per frame.
pub const CHUNK_BYTES: usize = 64 * 1024;
/// Largest frame payload accepted (a key, its tags and a value head, with room to spare).
const MAX_PAYLOAD: usize = 1024 * 1024;
/// The largest value any node accepts (`--max-value-bytes` is bounded by it).
const MAX_VALUE_LEN: usize = 512 * 1024 * 1024;
/// At most this much of an announced value is allocated before it arrives.
const PREALLOCATE: usize = 16 * 1024 * 1024;

const ITEM: u8 = 1;
const CHUNK: u8 = 2;
const DELETE: u8 = 3;
const END: u8 = 4;
const ERROR: u8 = 5;
/// An ITEM whose eviction priority is not `normal`: its rank, then an ITEM's payload.
/// (Normal items go as plain ITEMs, as before priorities existed.)
const ITEM_WITH_PRIORITY: u8 = 6;
/// A sliding expiry its owner's reads moved: key, version, expiry (`Change::Expire`).
const EXPIRE: u8 = 7;

/// Why a stream could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    /// Not a transfer stream, or another format version.
    #[error("not a shoal transfer stream (or an unknown format version)")]
    BadHeader,
    /// A frame's checksum does not match.
    #[error("frame checksum mismatch")]
    Checksum,
    /// A frame is malformed or out of place.
    #[error("malformed stream: {0}")]
    Malformed(&'static str),
    /// The sender reported a failure.
    #[error("the source failed: {0}")]
    Remote(String),
    /// The stream ended before its END frame.
    #[error("the stream ended early")]
    Truncated,
}

/// Appends a frame of `kind` whose payload `write` appends: the payload is written in place,
/// not built apart and copied.
fn put_frame(out: &mut BytesMut, kind: u8, write: impl FnOnce(&mut BytesMut)) {
    let start = out.len();
    out.put_u8(kind);
    out.put_u32(0);
    write(out);
    let len = (out.len() - start - 5) as u32;
    out[start + 1..start + 5].copy_from_slice(&len.to_be_bytes());
    let crc = crc32fast::hash(&out[start..]);
    out.put_u32(crc);
}

#[cfg(test)]
fn frame(kind: u8, payload: &[u8]) -> Bytes {
    let mut out = BytesMut::with_capacity(payload.len() + 9);
    put_frame(&mut out, kind, |o| o.put_slice(payload));
    out.freeze()
}

/// Appends an item's ITEM frame, which holds the head of its value; returns how many value
/// bytes it holds (the rest go in CHUNK frames, [`put_chunk`]).
pub fn put_item_head(out: &mut BytesMut, item: &ItemRef<'_>) -> usize {
    let first = item.value.len().min(CHUNK_BYTES);
    let tags: usize = item.tags.iter().map(|t| t.len() + 2).sum();
    out.reserve(9 + 1 + 2 + item.key.len() + 24 + 2 + tags + 8 + first);
    let kind = if item.priority == Priority::Normal { ITEM } else { ITEM_WITH_PRIORITY };
    put_frame(out, kind, |head| {
        if kind == ITEM_WITH_PRIORITY {
            head.put_u8(item.priority.rank());
        }
        head.put_u16(item.key.len() as u16);
        head.put_slice(item.key);
        head.put_u64(item.version);
        head.put_u64(item.expires_at_ms);
        head.put_u64(item.sliding_ms);
        head.put_u16(item.tags.len() as u16);
        for tag in item.tags {
            head.put_u16(tag.len() as u16);
            head.put_slice(tag.as_bytes());
        }
        head.put_u64(item.value.len() as u64);
        head.put_slice(&item.value[..first]);
    });
    first
}

/// Appends a CHUNK frame: the next bytes (at most [`CHUNK_BYTES`]) of the current item's value.
pub fn put_chunk(out: &mut BytesMut, chunk: &[u8]) {
    debug_assert!(chunk.len() <= CHUNK_BYTES);
    out.reserve(chunk.len() + 9);
    put_frame(out, CHUNK, |o| o.put_slice(chunk));
}

/// Appends every frame of an item: an ITEM frame with the value's head, then CHUNK frames.
pub fn put_item(out: &mut BytesMut, item: &ItemRef<'_>) {
    let first = put_item_head(out, item);
    for chunk in item.value[first..].chunks(CHUNK_BYTES) {
        put_chunk(out, chunk);
    }
}

/// Appends the frames of a change.
pub fn put_change(out: &mut BytesMut, change: &Change) {
    match change {
        Change::Put(item) => put_item(out, &item.as_ref()),
        Change::Delete { key, version } => put_frame(out, DELETE, |p| {
            p.put_u16(key.len() as u16);
            p.put_slice(key);
            p.put_u64(*version);
        }),
        Change::Expire { key, version, expires_at_ms } => put_frame(out, EXPIRE, |p| {
            p.put_u16(key.len() as u16);
            p.put_slice(key);
            p.put_u64(*version);
            p.put_u64(*expires_at_ms);
        }),
    }
}

/// Appends the END frame.
pub fn put_end(out: &mut BytesMut, version_counter: u64, items: u64) {
    put_frame(out, END, |p| {
        p.put_u64(version_counter);
        p.put_u64(items);
    });
}

/// An ERROR frame.
pub fn error_frame(message: &str) -> Bytes {
    let mut out = BytesMut::new();
    put_frame(&mut out, ERROR, |p| p.put_slice(message.as_bytes()));
    out.freeze()
}

/// A body of framed changes, as shadows and replicas take them.
pub fn change_body(changes: &[Change]) -> Bytes {
    let mut body = BytesMut::from(&HEADER[..]);
    for c in changes {
        put_change(&mut body, c);
    }
    put_end(&mut body, 0, changes.len() as u64);
    body.freeze()
}

/// Encodes a bucket snapshot while the bucket is locked: each item is written once, straight
/// into the stream's bytes (header first), which are cut into pieces of about `piece_bytes`.
/// An item whose value is shared (a large one) is only kept, which copies nothing, and is
/// encoded after the lock is released: a bucket of large values is not copied under its lock.
pub struct SnapshotEncoder {
    out: BytesMut,
    pieces: Vec<Bytes>,
    shared: Vec<ExportedItem>,
    piece_bytes: usize,
    /// Items visited.
    pub items: u64,
}

impl SnapshotEncoder {
    /// An encoder that cuts its output every `piece_bytes` or so.
    pub fn new(piece_bytes: usize) -> Self {
        let out = BytesMut::from(&HEADER[..]);
        SnapshotEncoder { out, pieces: Vec::new(), shared: Vec::new(), piece_bytes, items: 0 }
    }

    /// Encodes (or keeps) one item.
    pub fn visit(&mut self, item: ItemRef<'_>) {
        self.items += 1;
        if item.shared.is_some() {
            self.shared.push(item.to_owned());
            return;
        }
        put_item(&mut self.out, &item);
        if self.out.len() >= self.piece_bytes {
            self.pieces.push(self.out.split().freeze());
        }
    }

    /// The stream's bytes so far, in pieces, and the items kept to be encoded now.
    pub fn finish(mut self) -> (Vec<Bytes>, Vec<ExportedItem>) {
        if !self.out.is_empty() {
            self.pieces.push(self.out.split().freeze());
        }
        (self.pieces, self.shared)
    }
}

/// `bucket` of `store` as one body: the header, every live item, END with the bucket's version
/// counter.
pub fn snapshot_body(store: &CacheStore, bucket: BucketId) -> Bytes {
    let mut encoder = SnapshotEncoder::new(usize::MAX);
    let counter = store.visit_items(bucket, |item| encoder.visit(item));
    let items = encoder.items;
    let (pieces, shared) = encoder.finish();
    let mut body = match <[Bytes; 1]>::try_from(pieces) {
        // The one piece is the body so far: no copy unless large items follow.
        Ok([only]) => BytesMut::from(only),
        Err(pieces) => pieces.iter().fold(BytesMut::new(), |mut b, p| {
            b.extend_from_slice(p);
            b
        }),
    };
    for item in &shared {
        put_item(&mut body, &item.as_ref());
    }
    put_end(&mut body, counter, items);
    body.freeze()
}

/// Decodes a whole body: its changes and the version counter its END carries.
pub fn decode_body(body: Bytes) -> Result<(Vec<Change>, u64), FrameError> {
    let mut decoder = Decoder::default();
    decoder.feed(body);
    let mut changes = Vec::new();
    loop {
        match decoder.next_decoded()? {
            Some(Decoded::Change(change)) => changes.push(change),
            Some(Decoded::End { version_counter, .. }) => return Ok((changes, version_counter)),
            None => return Err(FrameError::Truncated),
        }
    }
}

/// What the decoder found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decoded {
    /// A complete change (an item with its whole value, or a delete).
    Change(Change),
    /// The end: the bucket's version counter and how many items the sender counted.
    End {
        /// The source bucket's version counter.
        version_counter: u64,
        /// Items and changes sent.
        items: u64,
    },
}

/// An incremental decoder: feed it the pieces of a stream as they arrive, take out what is
/// complete. A frame that lies whole in a piece is decoded in place (its key and a value that
/// fits in it are slices of the piece, not copies); only a frame cut between two pieces is
/// gathered.
#[derive(Debug, Default)]
pub struct Decoder {
    /// What is left of the pieces fed and not decoded yet.
    data: Bytes,
    /// The start of a frame (or of the header) that the piece fed last cut off: the next
    /// pieces complete it.
    carry: BytesMut,
    header_seen: bool,
    /// An item whose value is still arriving: the item, its value so far, bytes missing.
    partial: Option<(ExportedItem, BytesMut, usize)>,
    /// Payload bytes decoded so far.
    pub bytes: u64,
}

fn need(p: &Bytes, n: usize) -> Result<(), FrameError> {
    if p.len() < n {
        return Err(FrameError::Malformed("short frame"));
    }
    Ok(())
}

fn take(p: &mut Bytes, n: usize) -> Result<Bytes, FrameError> {
    need(p, n)?;
    Ok(p.split_to(n))
}

fn u8_of(p: &mut Bytes) -> Result<u8, FrameError> {
    need(p, 1)?;
    Ok(p.get_u8())
}

fn u16_of(p: &mut Bytes) -> Result<u16, FrameError> {
    need(p, 2)?;
    Ok(p.get_u16())
}

fn u64_of(p: &mut Bytes) -> Result<u64, FrameError> {
    need(p, 8)?;
    Ok(p.get_u64())
}

impl Decoder {
    /// Adds a piece of the stream.
    pub fn feed(&mut self, bytes: Bytes) {
        if self.data.is_empty() {
            self.data = bytes;
        } else {
            // The caller did not take out everything decodable first: join the two.
            let mut joined = BytesMut::with_capacity(self.data.len() + bytes.len());
            joined.extend_from_slice(&self.data);
            joined.extend_from_slice(&bytes);
            self.data = joined.freeze();
        }
    }

    fn available(&self) -> usize {
        self.carry.len() + self.data.len()
    }

    /// Keeps what is left of the piece until the next one completes it.
    fn stash(&mut self) {
        self.carry.extend_from_slice(&self.data);
        self.data.clear();
    }

    /// The first `N` bytes not decoded yet, if there are that many.
    fn peek<const N: usize>(&self) -> Option<[u8; N]> {
        if self.available() < N {
            return None;
        }
        let mut head = [0u8; N];
        let from_carry = self.carry.len().min(N);
        head[..from_carry].copy_from_slice(&self.carry[..from_carry]);
        head[from_carry..].copy_from_slice(&self.data[..N - from_carry]);
        Some(head)
    }

    /// The next `n` bytes, without a copy when the piece fed last holds them all; `None`
    /// (and the rest stashed) when fewer have arrived.
    fn take_next(&mut self, n: usize) -> Option<Bytes> {
        if self.available() < n {
            self.stash();
            return None;
        }
        if self.carry.is_empty() {
            return Some(self.data.split_to(n));
        }
        let rest = self.data.split_to(n - self.carry.len());
        self.carry.extend_from_slice(&rest);
        Some(self.carry.split().freeze())
    }

    /// The next complete change or end, `Ok(None)` if more bytes are needed.
    pub fn next_decoded(&mut self) -> Result<Option<Decoded>, FrameError> {
        loop {
            if !self.header_seen {
                let Some(header) = self.take_next(HEADER.len()) else { return Ok(None) };
                if header[..] != HEADER[..] {
                    return Err(FrameError::BadHeader);
                }
                self.header_seen = true;
            }
            let Some(head) = self.peek::<5>() else {
                self.stash();
                return Ok(None);
            };
            let len = u32::from_be_bytes([head[1], head[2], head[3], head[4]]) as usize;
            if len > MAX_PAYLOAD {
                return Err(FrameError::Malformed("frame too large"));
            }
            let Some(whole) = self.take_next(5 + len + 4) else { return Ok(None) };
            let crc = u32::from_be_bytes([whole[5 + len], whole[6 + len], whole[7 + len], whole[8 + len]]);
            if crc32fast::hash(&whole[..5 + len]) != crc {
                return Err(FrameError::Checksum);
            }
            self.bytes += len as u64;
            let mut payload = whole.slice(5..5 + len);
            if let Some(decoded) = self.frame(head[0], &mut payload)? {
                return Ok(Some(decoded));
            }
        }
    }

    fn frame(&mut self, kind: u8, p: &mut Bytes) -> Result<Option<Decoded>, FrameError> {
        if kind != CHUNK && self.partial.is_some() {
            return Err(FrameError::Malformed("value cut short"));
        }
        match kind {
            ITEM | ITEM_WITH_PRIORITY => {
                let priority = match kind {
                    ITEM => Priority::Normal,
                    _ => match u8_of(p)? {
                        rank @ 0..=5 => Priority::of_rank(rank),
                        _ => return Err(FrameError::Malformed("priority")),
                    },
                };
                let key_len = usize::from(u16_of(p)?);
                let key = take(p, key_len)?;
                let version = u64_of(p)?;
                let expires_at_ms = u64_of(p)?;
                let sliding_ms = u64_of(p)?;
                let tag_count = u16_of(p)?;
                let mut tags = Vec::with_capacity(usize::from(tag_count));
                for _ in 0..tag_count {
                    let n = usize::from(u16_of(p)?);
                    let tag = take(p, n)?;
                    let tag = std::str::from_utf8(&tag).map_err(|_| FrameError::Malformed("tag"))?;
                    tags.push(Box::<str>::from(tag));
                }
                let value_len = usize::try_from(u64_of(p)?).unwrap_or(usize::MAX);
                if value_len > MAX_VALUE_LEN {
                    return Err(FrameError::Malformed("value larger than any node accepts"));
                }
                if p.len() > value_len {
                    return Err(FrameError::Malformed("value longer than announced"));
                }
                let item = ExportedItem {
                    key,
                    value: Bytes::new(),
                    version,
                    expires_at_ms,
                    sliding_ms,
                    tags: tags.into(),
                    priority,
                };
                if p.len() == value_len {
                    // The whole value is in this frame: it stays where it arrived.
                    let item = ExportedItem { value: std::mem::take(p), ..item };
                    return Ok(Some(Decoded::Change(Change::Put(item))));
                }
                // The announced length is the peer's word: memory grows with what arrives.
                let mut value = BytesMut::with_capacity(value_len.min(PREALLOCATE));
                value.put_slice(p);
                let missing = value_len - p.len();
                self.complete_or_wait(item, value, missing)
            }
            CHUNK => {
                let Some((item, mut value, missing)) = self.partial.take() else {
                    return Err(FrameError::Malformed("chunk without item"));
                };
                if p.len() > missing {
                    return Err(FrameError::Malformed("value longer than announced"));
                }
                value.put_slice(p);
                self.complete_or_wait(item, value, missing - p.len())
            }
            DELETE => {
                let key_len = usize::from(u16_of(p)?);
                let key = take(p, key_len)?;
                let version = u64_of(p)?;
                Ok(Some(Decoded::Change(Change::Delete { key, version })))
            }
            EXPIRE => {
                let key_len = usize::from(u16_of(p)?);
                let key = take(p, key_len)?;
                let (version, expires_at_ms) = (u64_of(p)?, u64_of(p)?);
                Ok(Some(Decoded::Change(Change::Expire { key, version, expires_at_ms })))
            }
            END => Ok(Some(Decoded::End { version_counter: u64_of(p)?, items: u64_of(p)? })),
            ERROR => Err(FrameError::Remote(String::from_utf8_lossy(p).into_owned())),
            _ => Err(FrameError::Malformed("unknown frame kind")),
        }
    }

    fn complete_or_wait(
        &mut self,
        mut item: ExportedItem,
        value: BytesMut,
        missing: usize,
    ) -> Result<Option<Decoded>, FrameError> {
        if missing == 0 {
            item.value = value.freeze();
            Ok(Some(Decoded::Change(Change::Put(item))))
        } else {
            self.partial = Some((item, value, missing));
            Ok(None)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn item(key: &str, value_len: usize) -> ExportedItem {
        ExportedItem {
            key: Bytes::copy_from_slice(key.as_bytes()),
            value: Bytes::from((0..value_len).map(|i| (i % 251) as u8).collect::<Vec<u8>>()),
            version: 7,
            expires_at_ms: 123,
            sliding_ms: 0,
            tags: vec!["a".into(), "bé".into()].into(),
            // Both item frames: plain for normal items, with the rank for the others.
            priority: if key.len() % 2 == 0 { Priority::Normal } else { Priority::NotRemovable },
        }
    }

    fn stream(changes: &[Change]) -> Vec<u8> {
        let mut out = BytesMut::from(&HEADER[..]);
        for c in changes {
            put_change(&mut out, c);
        }
        put_end(&mut out, 42, changes.len() as u64);
        out.to_vec()
    }

    fn decode_all(bytes: &[u8], step: usize) -> Result<Vec<Decoded>, FrameError> {
        let mut d = Decoder::default();
        let mut out = Vec::new();
        for piece in bytes.chunks(step) {
            d.feed(Bytes::copy_from_slice(piece));
            while let Some(x) = d.next_decoded()? {
                out.push(x);
            }
        }
        Ok(out)
    }

    #[test]
    fn items_and_deletes_round_trip_whatever_the_read_sizes() {
        let changes = vec![
            Change::Put(item("small", 100)),
            Change::Put(item("big", 3 * CHUNK_BYTES + 17)),
            Change::Delete { key: Bytes::from_static(b"gone"), version: 9 },
            Change::Expire { key: Bytes::from_static(b"small"), version: 1, expires_at_ms: 1_700_000_000_000 },
            Change::Put(item("empty", 0)),
        ];
        let bytes = stream(&changes);
        for step in [1, 7, 4096, bytes.len()] {
            let decoded = decode_all(&bytes, step).expect("decodes");
            let mut expected: Vec<Decoded> = changes.iter().cloned().map(Decoded::Change).collect();
            expected.push(Decoded::End { version_counter: 42, items: changes.len() as u64 });
            assert_eq!(decoded, expected, "read {step} bytes at a time");
        }
    }

    #[test]
    fn a_snapshot_body_holds_every_live_item_and_the_version_counter() {
        use crate::cache::{Clock, Write};
        let store = CacheStore::new(u64::MAX, Clock::new());
        let bucket = shoal_raft::bucket_of(b"{s}");
        let tags = ["t".to_string()];
        for i in 0..200usize {
            let key = format!("{{s}}{i}");
            // Small values are encoded under the lock, large ones (shared) after it.
            let value = vec![i as u8; if i % 10 == 0 { 3 * CHUNK_BYTES + i } else { i }];
            let tags = if i % 3 == 0 { &tags[..] } else { &[] };
            let write = Write { key: key.as_bytes(), value: &value, tags, ..Default::default() };
            store.put(bucket, &write).expect("put");
        }
        let (changes, counter) = decode_body(snapshot_body(&store, bucket)).expect("decodes");
        let (items, expected_counter) = store.snapshot(bucket);
        assert_eq!(counter, expected_counter);
        let sorted = |mut v: Vec<Change>| {
            v.sort_by_key(|c| match c {
                Change::Put(i) => i.key.clone(),
                Change::Delete { key, .. } | Change::Expire { key, .. } => key.clone(),
            });
            v
        };
        assert_eq!(sorted(changes), sorted(items.into_iter().map(Change::Put).collect()));
    }

    #[test]
    fn pieces_fed_before_the_last_one_was_decoded_are_joined() {
        let changes = vec![Change::Put(item("a", 100)), Change::Put(item("b", 2 * CHUNK_BYTES))];
        let bytes = Bytes::from(stream(&changes));
        let mut d = Decoder::default();
        let cut = bytes.len() / 3;
        d.feed(bytes.slice(..cut));
        d.feed(bytes.slice(cut..));
        let mut out = Vec::new();
        while let Some(x) = d.next_decoded().expect("decodes") {
            out.push(x);
        }
        assert_eq!(out.len(), 3, "two items and the end");
    }

    #[test]
    fn a_16_mib_value_is_cut_into_chunks() {
        let huge = item("huge", 16 * 1024 * 1024);
        let mut out = BytesMut::new();
        assert_eq!(put_item_head(&mut out, &huge.as_ref()), CHUNK_BYTES);
        assert!(out.len() <= CHUNK_BYTES + 200);
        let mut all = BytesMut::new();
        put_item(&mut all, &huge.as_ref());
        let chunk_frame = CHUNK_BYTES + 9;
        assert_eq!(all.len(), out.len() + 255 * chunk_frame, "the head, then 255 full chunks");
        assert!(all[out.len()..].chunks(chunk_frame).all(|f| f[0] == CHUNK && f.len() == chunk_frame));
    }

    #[test]
    fn an_announced_value_larger_than_any_node_accepts_is_refused_before_allocating() {
        let mut head = BytesMut::new();
        head.put_u16(1);
        head.put_slice(b"k");
        head.put_slice(&[0; 24]); // version, expiry, sliding
        head.put_u16(0);
        head.put_u64(u64::MAX);
        let mut bytes = HEADER.to_vec();
        bytes.extend_from_slice(&frame(ITEM, &head));
        assert_eq!(decode_all(&bytes, 64), Err(FrameError::Malformed("value larger than any node accepts")));
    }

    #[test]
    fn corruption_and_truncation_are_errors() {
        let bytes = stream(&[Change::Put(item("k", 1000))]);
        let mut corrupt = bytes.clone();
        corrupt[HEADER.len() + 20] ^= 0xff;
        assert_eq!(decode_all(&corrupt, 64), Err(FrameError::Checksum));
        let mut bad = bytes.clone();
        bad[0] = b'X';
        assert_eq!(decode_all(&bad, 64), Err(FrameError::BadHeader));
        let cut = &bytes[..bytes.len() - 30];
        let decoded = decode_all(cut, 64).expect("a prefix decodes");
        assert!(!decoded.iter().any(|d| matches!(d, Decoded::End { .. })), "no END, so the reader must fail");
        let mut remote = HEADER.to_vec();
        remote.extend_from_slice(&error_frame("disk on fire"));
        assert_eq!(decode_all(&remote, 64), Err(FrameError::Remote("disk on fire".into())));
    }
}
