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
//!  END     = version_counter:u64 items:u64
//!  ERROR   = utf-8 message
//! ```
//!
//! Values longer than [`CHUNK_BYTES`] continue in CHUNK frames, so a 16 MiB value goes out as
//! 256 frames with the sender yielding between them: no single write holds the connection
//! or the event loop for long. Every frame carries a CRC-32; a corrupt or truncated stream is
//! an error, and a bucket whose stream failed is never flipped (the partial copy is pulled
//! again or dropped).

use bytes::{Buf, BufMut, Bytes, BytesMut};

use crate::cache::{Change, ExportedItem, Priority};

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

fn frame(kind: u8, payload: &[u8]) -> Bytes {
    let mut out = BytesMut::with_capacity(payload.len() + 9);
    out.put_u8(kind);
    out.put_u32(payload.len() as u32);
    out.put_slice(payload);
    let crc = crc32fast::hash(&out);
    out.put_u32(crc);
    out.freeze()
}

/// The frames of one item: an ITEM frame with the value's head, then CHUNK frames.
pub fn item_frames(item: &ExportedItem) -> Vec<Bytes> {
    let mut head = BytesMut::new();
    let kind = if item.priority == Priority::Normal {
        ITEM
    } else {
        head.put_u8(item.priority.rank());
        ITEM_WITH_PRIORITY
    };
    head.put_u16(item.key.len() as u16);
    head.put_slice(&item.key);
    head.put_u64(item.version);
    head.put_u64(item.expires_at_ms);
    head.put_u64(item.sliding_ms);
    head.put_u16(item.tags.len() as u16);
    for tag in &item.tags {
        head.put_u16(tag.len() as u16);
        head.put_slice(tag.as_bytes());
    }
    head.put_u64(item.value.len() as u64);
    let first = item.value.len().min(CHUNK_BYTES);
    head.put_slice(&item.value[..first]);
    let mut frames = vec![frame(kind, &head)];
    frames.extend(item.value[first..].chunks(CHUNK_BYTES).map(|c| frame(CHUNK, c)));
    frames
}

/// The frames of a change.
pub fn change_frames(change: &Change) -> Vec<Bytes> {
    match change {
        Change::Put(item) => item_frames(item),
        Change::Delete { key, version } => {
            let mut p = BytesMut::new();
            p.put_u16(key.len() as u16);
            p.put_slice(key);
            p.put_u64(*version);
            vec![frame(DELETE, &p)]
        }
    }
}

/// The END frame.
pub fn end_frame(version_counter: u64, items: u64) -> Bytes {
    let mut p = BytesMut::new();
    p.put_u64(version_counter);
    p.put_u64(items);
    frame(END, &p)
}

/// An ERROR frame.
pub fn error_frame(message: &str) -> Bytes {
    frame(ERROR, message.as_bytes())
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

/// An incremental decoder: feed it bytes as they arrive, take out what is complete.
#[derive(Debug, Default)]
pub struct Decoder {
    buf: BytesMut,
    header_seen: bool,
    /// An item whose value is still arriving: the item, its value so far, bytes missing.
    partial: Option<(ExportedItem, BytesMut, usize)>,
    /// Payload bytes decoded so far.
    pub bytes: u64,
}

fn take<'a>(p: &mut &'a [u8], n: usize) -> Result<&'a [u8], FrameError> {
    if p.len() < n {
        return Err(FrameError::Malformed("short frame"));
    }
    let (head, rest) = p.split_at(n);
    *p = rest;
    Ok(head)
}

fn u8_of(p: &mut &[u8]) -> Result<u8, FrameError> {
    Ok(take(p, 1)?.get_u8())
}

fn u16_of(p: &mut &[u8]) -> Result<u16, FrameError> {
    Ok(take(p, 2)?.get_u16())
}

fn u64_of(p: &mut &[u8]) -> Result<u64, FrameError> {
    Ok(take(p, 8)?.get_u64())
}

impl Decoder {
    /// Adds bytes received.
    pub fn feed(&mut self, bytes: &[u8]) {
        self.buf.extend_from_slice(bytes);
    }

    /// The next complete change or end, `Ok(None)` if more bytes are needed.
    pub fn next_decoded(&mut self) -> Result<Option<Decoded>, FrameError> {
        loop {
            if !self.header_seen {
                if self.buf.len() < HEADER.len() {
                    return Ok(None);
                }
                if &self.buf[..HEADER.len()] != HEADER {
                    return Err(FrameError::BadHeader);
                }
                self.buf.advance(HEADER.len());
                self.header_seen = true;
            }
            if self.buf.len() < 5 {
                return Ok(None);
            }
            let len = u32::from_be_bytes([self.buf[1], self.buf[2], self.buf[3], self.buf[4]]) as usize;
            if len > MAX_PAYLOAD {
                return Err(FrameError::Malformed("frame too large"));
            }
            if self.buf.len() < 5 + len + 4 {
                return Ok(None);
            }
            let whole = self.buf.split_to(5 + len + 4);
            let crc = u32::from_be_bytes([whole[5 + len], whole[6 + len], whole[7 + len], whole[8 + len]]);
            if crc32fast::hash(&whole[..5 + len]) != crc {
                return Err(FrameError::Checksum);
            }
            self.bytes += len as u64;
            let kind = whole[0];
            let mut p = &whole[5..5 + len];
            if let Some(decoded) = self.frame(kind, &mut p)? {
                return Ok(Some(decoded));
            }
        }
    }

    fn frame(&mut self, kind: u8, p: &mut &[u8]) -> Result<Option<Decoded>, FrameError> {
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
                let key = Bytes::copy_from_slice(take(p, key_len)?);
                let version = u64_of(p)?;
                let expires_at_ms = u64_of(p)?;
                let sliding_ms = u64_of(p)?;
                let tag_count = u16_of(p)?;
                let mut tags = Vec::with_capacity(usize::from(tag_count));
                for _ in 0..tag_count {
                    let n = usize::from(u16_of(p)?);
                    let tag = std::str::from_utf8(take(p, n)?).map_err(|_| FrameError::Malformed("tag"))?;
                    tags.push(tag.to_string());
                }
                let value_len = usize::try_from(u64_of(p)?).unwrap_or(usize::MAX);
                if value_len > MAX_VALUE_LEN {
                    return Err(FrameError::Malformed("value larger than any node accepts"));
                }
                if p.len() > value_len {
                    return Err(FrameError::Malformed("value longer than announced"));
                }
                // The announced length is the peer's word: memory grows with what arrives.
                let mut value = BytesMut::with_capacity(value_len.min(PREALLOCATE));
                value.put_slice(p);
                let missing = value_len - p.len();
                let item =
                    ExportedItem { key, value: Bytes::new(), version, expires_at_ms, sliding_ms, tags, priority };
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
                let key = Bytes::copy_from_slice(take(p, key_len)?);
                let version = u64_of(p)?;
                Ok(Some(Decoded::Change(Change::Delete { key, version })))
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
            tags: vec!["a".into(), "bé".into()],
            // Both item frames: plain for normal items, with the rank for the others.
            priority: if key.len() % 2 == 0 { Priority::Normal } else { Priority::NotRemovable },
        }
    }

    fn stream(changes: &[Change]) -> Vec<u8> {
        let mut out = HEADER.to_vec();
        for c in changes {
            for f in change_frames(c) {
                out.extend_from_slice(&f);
            }
        }
        out.extend_from_slice(&end_frame(42, changes.len() as u64));
        out
    }

    fn decode_all(bytes: &[u8], step: usize) -> Result<Vec<Decoded>, FrameError> {
        let mut d = Decoder::default();
        let mut out = Vec::new();
        for piece in bytes.chunks(step) {
            d.feed(piece);
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
            Change::Put(item("empty", 0)),
        ];
        let bytes = stream(&changes);
        for step in [1, 7, 4096, bytes.len()] {
            let decoded = decode_all(&bytes, step).expect("decodes");
            let mut expected: Vec<Decoded> = changes.iter().cloned().map(Decoded::Change).collect();
            expected.push(Decoded::End { version_counter: 42, items: 4 });
            assert_eq!(decoded, expected, "read {step} bytes at a time");
        }
    }

    #[test]
    fn a_16_mib_value_is_cut_into_chunks() {
        let frames = item_frames(&item("huge", 16 * 1024 * 1024));
        assert_eq!(frames.len(), 256);
        assert!(frames.iter().all(|f| f.len() <= CHUNK_BYTES + 200));
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
