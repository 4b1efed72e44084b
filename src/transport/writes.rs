//! Forwarded writes and deletes on peer links: their wire format.
//!
//! A node forwards a write or delete of a key it does not own to the owner: one small message
//! each way on the peer link (`transport::link`), of a cancellable kind: a caller that gives up
//! cancels it at the owner, and the owner stops every such request when the link ends (a
//! forwarded write must die with its caller). The message carries what a client's request
//! would: the map version the sender routed by, its deadline (Unix time; the owner refuses it
//! later, nothing done), the key and, for a write, the value and every option. The answer is
//! what a client of the owner would get, so a forwarded error keeps its status and code.
//!
//! ```text
//!  request = deadline_ms:u64 map_version:u64 op:u8 len:u32 key
//!            op 1 (write):  ttl_ms:u64 sliding_ms:u64 (u64::MAX: none) priority:u8
//!                           condition:u8 (0 always, 1 absent, 2 present, 3 version) version:u64
//!                           tags:u32 (len:u32 tag)* value (the rest)
//!            op 2 (delete): cas:u8 (0 none, 1 at version) version:u64
//!  answer  WRITE_DONE   write: version:u64 bucket:u16 node:u64; delete: empty (it existed)
//!          FAILED       as a read's (`transport::reads`): retry_after_s:u64 Problem JSON
//! ```
//!
//! Everything is big-endian. Durations travel in whole milliseconds, as they do over HTTP.

use std::time::Duration;

use bytes::Bytes;
use shoal_http_api::types::{Priority, PutOk, PutOptions, WriteCondition};
use shoal_http_api::{ApiError, PutItem};

use super::link::{CANCELLABLE, FORWARD};
use super::reads::{failure, Reader, LINK_FAILED};
use super::{CallError, PeerAnswer, PeerRequest};

/// A link request: a forwarded write or delete (cancellable).
pub const LINK_WRITE: u8 = 8 | CANCELLABLE | FORWARD;
/// A link answer: the write or delete done.
pub const LINK_WRITE_DONE: u8 = 9;

const PUT: u8 = 1;
const DELETE: u8 = 2;
/// Durations when absent.
const NONE: u64 = u64::MAX;

/// The bytes a forwarded write or delete takes on a link; `None` for any other request.
pub fn request_size(request: &PeerRequest) -> Option<usize> {
    let head = 8 + 8 + 1 + 4;
    Some(match request {
        PeerRequest::Put { item, .. } => {
            let tags: usize = item.options.tags.iter().map(|t| 4 + t.len()).sum();
            head + item.key.len() + 8 + 8 + 1 + 1 + 8 + 4 + tags + item.value.len()
        }
        PeerRequest::Delete { key, .. } => head + key.len() + 1 + 8,
        _ => return None,
    })
}

fn millis(d: Option<Duration>) -> u64 {
    d.map_or(NONE, |d| (d.as_millis() as u64).min(NONE - 1))
}

/// A forwarded write's or delete's payload, to be done before `deadline_ms` (Unix time);
/// false for any other request.
pub fn encode_request(request: &PeerRequest, deadline_ms: u64, out: &mut Vec<u8>) -> bool {
    let Some(size) = request_size(request) else { return false };
    out.reserve(size);
    out.extend_from_slice(&deadline_ms.to_be_bytes());
    let key = |out: &mut Vec<u8>, map_version: u64, op: u8, key: &str| {
        out.extend_from_slice(&map_version.to_be_bytes());
        out.push(op);
        out.extend_from_slice(&(key.len() as u32).to_be_bytes());
        out.extend_from_slice(key.as_bytes());
    };
    match request {
        PeerRequest::Put { item, map_version } => {
            key(out, *map_version, PUT, &item.key);
            let o = &item.options;
            out.extend_from_slice(&millis(o.ttl).to_be_bytes());
            out.extend_from_slice(&millis(o.sliding).to_be_bytes());
            out.push(o.priority.rank());
            let (condition, version) = match o.condition {
                WriteCondition::Always => (0, 0),
                WriteCondition::Absent => (1, 0),
                WriteCondition::Present => (2, 0),
                WriteCondition::Version(v) => (3, v),
            };
            out.push(condition);
            out.extend_from_slice(&version.to_be_bytes());
            out.extend_from_slice(&(o.tags.len() as u32).to_be_bytes());
            for tag in &o.tags {
                out.extend_from_slice(&(tag.len() as u32).to_be_bytes());
                out.extend_from_slice(tag.as_bytes());
            }
            out.extend_from_slice(&item.value);
        }
        PeerRequest::Delete { key: k, cas, map_version } => {
            key(out, *map_version, DELETE, k);
            out.push(u8::from(cas.is_some()));
            out.extend_from_slice(&cas.unwrap_or(0).to_be_bytes());
        }
        _ => return false,
    }
    true
}

/// Reads a payload of [`encode_request`] back into its request and deadline, or says why it
/// is malformed. A written value is a slice of `payload`, not a copy.
pub fn decode_request(payload: &Bytes) -> Result<(PeerRequest, u64), super::Malformed> {
    let malformed = || super::Malformed::Message("forwarded write");
    let mut r = Reader(payload);
    let deadline_ms = r.u64().ok_or_else(malformed)?;
    let map_version = r.u64().ok_or_else(malformed)?;
    let op = r.take(1).ok_or_else(malformed)?[0];
    let len = r.u32().ok_or_else(malformed)? as usize;
    let key = text(r.take(len).ok_or_else(malformed)?)?;
    let duration = |ms: u64| (ms != NONE).then(|| Duration::from_millis(ms));
    let request = match op {
        PUT => {
            let (ttl, sliding) = (r.u64().ok_or_else(malformed)?, r.u64().ok_or_else(malformed)?);
            let priority = r.take(1).ok_or_else(malformed)?[0];
            let condition = r.take(1).ok_or_else(malformed)?[0];
            let version = r.u64().ok_or_else(malformed)?;
            let condition = match condition {
                0 => WriteCondition::Always,
                1 => WriteCondition::Absent,
                2 => WriteCondition::Present,
                3 => WriteCondition::Version(version),
                _ => return Err(malformed()),
            };
            let count = r.u32().ok_or_else(malformed)? as usize;
            // Each tag takes at least its length's four bytes: a count beyond that is a lie.
            if count > r.0.len() / 4 || priority > Priority::NotRemovable.rank() {
                return Err(malformed());
            }
            let mut tags = Vec::with_capacity(count);
            for _ in 0..count {
                let len = r.u32().ok_or_else(malformed)? as usize;
                tags.push(text(r.take(len).ok_or_else(malformed)?)?);
            }
            let value = payload.slice(payload.len() - r.0.len()..);
            let options = PutOptions {
                ttl: duration(ttl),
                sliding: duration(sliding),
                tags,
                condition,
                priority: Priority::of_rank(priority),
            };
            PeerRequest::Put { item: PutItem { key, value, options }, map_version }
        }
        DELETE => {
            let has_cas = r.take(1).ok_or_else(malformed)?[0];
            let version = r.u64().ok_or_else(malformed)?;
            if has_cas > 1 || !r.0.is_empty() {
                return Err(malformed());
            }
            PeerRequest::Delete { key, cas: (has_cas == 1).then_some(version), map_version }
        }
        _ => return Err(malformed()),
    };
    Ok((request, deadline_ms))
}

fn text(bytes: &[u8]) -> Result<String, super::Malformed> {
    std::str::from_utf8(bytes).map(str::to_string).map_err(|_| super::Malformed::NotUtf8)
}

/// The link answer (kind and payload) to a forwarded write or delete: what
/// [`super::PeerService::serve`] answered.
pub fn encode_answer(answer: Result<PeerAnswer, CallError>) -> (u8, Vec<u8>) {
    match answer {
        Ok(PeerAnswer::Put(ok)) => {
            let mut out = Vec::with_capacity(18);
            out.extend_from_slice(&ok.version.to_be_bytes());
            out.extend_from_slice(&ok.bucket.to_be_bytes());
            out.extend_from_slice(&ok.node.to_be_bytes());
            (LINK_WRITE_DONE, out)
        }
        Ok(PeerAnswer::Deleted) => (LINK_WRITE_DONE, Vec::new()),
        Ok(other) => super::reads::failed(&ApiError::Internal(format!("a write answered with {other:?}"))),
        Err(CallError::Api(e)) => super::reads::failed(&e),
        Err(other) => super::reads::failed(&ApiError::Internal(other.to_string())),
    }
}

/// What a forwarded write or delete sent on a link gets: `request`'s answer, rebuilt from the
/// link answer of `kind` and `payload` as it would have been from HTTP; `None` when it must
/// be sent over HTTP instead (not handled: no slot was free, or the peer does not know link
/// writes).
pub fn decode_answer(request: &PeerRequest, kind: u8, payload: &[u8]) -> Option<Result<PeerAnswer, CallError>> {
    let broken = || CallError::Broken("an unreadable answer to a write on a peer link".into());
    match kind {
        LINK_WRITE_DONE => {}
        LINK_FAILED => return Some(Err(failure(payload))),
        _ => return None,
    }
    let mut r = Reader(payload);
    Some(match request {
        PeerRequest::Put { item, .. } => match (r.u64(), r.u16(), r.u64()) {
            (Some(version), Some(bucket), Some(node)) if r.0.is_empty() => {
                Ok(PeerAnswer::Put(PutOk { key: item.key.clone(), version, bucket, node }))
            }
            _ => Err(broken()),
        },
        PeerRequest::Delete { .. } if payload.is_empty() => Ok(PeerAnswer::Deleted),
        _ => Err(broken()),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::reads::LINK_READ;

    fn item(key: &str, value: &[u8], options: PutOptions) -> PeerRequest {
        let item = PutItem { key: key.into(), value: Bytes::copy_from_slice(value), options };
        PeerRequest::Put { item, map_version: 41 }
    }

    fn round_trip(request: &PeerRequest) -> PeerRequest {
        let mut payload = Vec::new();
        assert!(encode_request(request, 1_234_567, &mut payload));
        assert_eq!(Some(payload.len()), request_size(request));
        let (decoded, deadline) = decode_request(&Bytes::from(payload)).expect("well-formed");
        assert_eq!(deadline, 1_234_567);
        decoded
    }

    #[test]
    fn writes_and_deletes_read_back_as_sent_with_every_option() {
        let requests = [
            item("plain", b"value", PutOptions::default()),
            item("", b"", PutOptions::default()),
            item(
                "ключ/with spaces",
                &[0, 159, 146, 150, 255],
                PutOptions {
                    ttl: Some(Duration::from_millis(1500)),
                    sliding: Some(Duration::from_secs(3600)),
                    tags: vec!["a".into(), String::new(), "ü,b".into()],
                    condition: WriteCondition::Version(u64::MAX),
                    priority: Priority::NotRemovable,
                },
            ),
            item("k", b"v", PutOptions { condition: WriteCondition::Absent, ..PutOptions::default() }),
            item(
                "k",
                b"v",
                PutOptions { condition: WriteCondition::Present, priority: Priority::Low, ..PutOptions::default() },
            ),
            PeerRequest::Delete { key: "gone".into(), cas: None, map_version: 3 },
            PeerRequest::Delete { key: "gone".into(), cas: Some(0), map_version: u64::MAX },
        ];
        for request in requests {
            assert_eq!(format!("{:?}", round_trip(&request)), format!("{request:?}"));
        }
    }

    #[test]
    fn other_requests_are_not_written_and_malformed_ones_are_refused() {
        let get = PeerRequest::Get { key: "k".into(), map_version: 1, mirror: None };
        assert!(!encode_request(&get, 0, &mut Vec::new()));
        assert_eq!(request_size(&get), None);
        let mut whole = Vec::new();
        encode_request(&PeerRequest::Delete { key: "k".into(), cas: Some(4), map_version: 1 }, 9, &mut whole);
        for cut in 0..whole.len() {
            assert!(decode_request(&Bytes::copy_from_slice(&whole[..cut])).is_err(), "cut at {cut}");
        }
        let mut longer = whole.clone();
        longer.push(0);
        assert!(decode_request(&Bytes::from(longer)).is_err(), "a delete with bytes after it");
        let mut unknown = whole.clone();
        unknown[16] = 7;
        assert!(decode_request(&Bytes::from(unknown)).is_err(), "an unknown operation");
        let mut put = Vec::new();
        encode_request(&item("k", b"v", PutOptions::default()), 9, &mut put);
        let tags_count = put.len() - 1 - 4;
        put[tags_count..tags_count + 4].copy_from_slice(&u32::MAX.to_be_bytes());
        assert!(decode_request(&Bytes::from(put)).is_err(), "a tag count beyond the payload");
    }

    #[test]
    fn answers_come_back_as_http_would_give_them() {
        let put = item("k", b"v", PutOptions::default());
        let ok = PutOk { key: "k".into(), version: 7, bucket: 999, node: 3 };
        let (kind, payload) = encode_answer(Ok(PeerAnswer::Put(ok.clone())));
        match decode_answer(&put, kind, &payload) {
            Some(Ok(PeerAnswer::Put(back))) => assert_eq!(back, ok),
            other => panic!("{other:?}"),
        }
        let delete = PeerRequest::Delete { key: "k".into(), cas: None, map_version: 1 };
        let (kind, payload) = encode_answer(Ok(PeerAnswer::Deleted));
        assert!(matches!(decode_answer(&delete, kind, &payload), Some(Ok(PeerAnswer::Deleted))));
        // Errors keep their status, code, retry-after and current version.
        let errors = [
            ApiError::NotFound,
            ApiError::PreconditionFailed { current_version: Some(12) },
            ApiError::unavailable(shoal_http_api::Unavailable::NoQuorum, "cut off"),
            ApiError::NotOwner { bucket: 5, map_version: 9 },
        ];
        for error in errors {
            let (kind, payload) = encode_answer(Err(CallError::Api(error.clone())));
            match decode_answer(&put, kind, &payload) {
                Some(Err(CallError::Api(back))) => {
                    assert_eq!((back.status(), back.code()), (error.status(), error.code()));
                    assert_eq!(
                        back.retry_after().map(|d| d.as_secs().max(1)),
                        error.retry_after().map(|d| d.as_secs().max(1))
                    );
                    assert_eq!(format!("{:?}", back.problem()), format!("{:?}", error.problem()));
                }
                other => panic!("{error:?}: {other:?}"),
            }
        }
        // An answer of another kind is no write answer.
        assert!(decode_answer(&put, LINK_READ, &[]).is_none());
        assert!(matches!(decode_answer(&put, LINK_WRITE_DONE, &[1, 2]), Some(Err(CallError::Broken(_)))));
    }
}
