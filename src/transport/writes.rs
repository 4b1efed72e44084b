//! Forwarded writes and deletes on peer links: their wire format.
//!
//! A node forwards a write or delete of a key it does not own to the owner, alone or several
//! of one owner as one bulk write or delete: one message each way on the peer link
//! (`transport::link`), of a cancellable kind: a caller that gives up cancels it at the owner,
//! and the owner stops every such request when the link ends (a forwarded write must die with
//! its caller). The message carries what a client's request would: the map version the sender
//! routed by, its deadline (Unix time; the owner refuses it later, nothing done), the keys and,
//! for writes, the values and every option. The answer is what a client of the owner would
//! get, so a forwarded error keeps its status and code.
//!
//! ```text
//!  request = deadline_ms:u64 map_version:u64 op:u8 body
//!            op 1 (write):       len:u32 key options value (the rest)
//!            op 2 (delete):      len:u32 key cas:u8 (0 none, 1 at version) version:u64
//!            op 3 (bulk write):  count:u32 (len:u32 key options len:u32 value)*
//!            op 4 (bulk delete): count:u32 (len:u32 key)*
//!  options = ttl_ms:u64 sliding_ms:u64 (u64::MAX: none) priority:u8
//!            condition:u8 (0 always, 1 absent, 2 present, 3 version) version:u64
//!            tags:u32 (len:u32 tag)*
//!  answer  WRITE_DONE   write: version:u64 bucket:u16 node:u64; delete: empty (it existed);
//!                       bulk: one result per key, in order: tag:u8 0 written (version:u64
//!                       bucket:u16 node:u64), 1 deleted, 2 absent, 3 failed (len:u32 KeyError JSON)
//!          FAILED       as a read's (`transport::reads`): retry_after_s:u64 Problem JSON
//! ```
//!
//! Everything is big-endian; every count and length is checked against what is left of the
//! payload before anything is taken. Durations travel in whole milliseconds, as over HTTP.

use std::time::Duration;

use bytes::Bytes;
use shoal_http_api::types::{KeyError, Priority, PutOk, PutOptions, WriteCondition};
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
const BULK_PUT: u8 = 3;
const BULK_DELETE: u8 = 4;
/// Durations when absent.
const NONE: u64 = u64::MAX;
/// Bytes of a write's options before its tags.
const OPTIONS: usize = 8 + 8 + 1 + 1 + 8 + 4;

/// Bytes of a write done: version, bucket, node.
const DONE: usize = 8 + 2 + 8;

/// Answer tags of a bulk write or delete.
const WRITTEN: u8 = 0;
const DELETED: u8 = 1;
const ABSENT: u8 = 2;
const FAILED: u8 = 3;

fn options_size(o: &PutOptions) -> usize {
    OPTIONS + o.tags.iter().map(|t| 4 + t.len()).sum::<usize>()
}

/// The bytes a forwarded write or delete takes on a link; `None` for any other request.
pub fn request_size(request: &PeerRequest) -> Option<usize> {
    let head = 8 + 8 + 1 + 4;
    Some(match request {
        PeerRequest::Put { item, .. } => head + item.key.len() + options_size(&item.options) + item.value.len(),
        PeerRequest::Delete { key, .. } => head + key.len() + 1 + 8,
        PeerRequest::BulkPut { items, .. } => {
            head + items.iter().map(|i| 4 + i.key.len() + options_size(&i.options) + 4 + i.value.len()).sum::<usize>()
        }
        PeerRequest::BulkDelete { keys, .. } => head + keys.iter().map(|k| 4 + k.len()).sum::<usize>(),
        _ => return None,
    })
}

fn millis(d: Option<Duration>) -> u64 {
    d.map_or(NONE, |d| (d.as_millis() as u64).min(NONE - 1))
}

fn put_len(out: &mut Vec<u8>, bytes: &[u8]) {
    out.extend_from_slice(&(bytes.len() as u32).to_be_bytes());
    out.extend_from_slice(bytes);
}

fn put_options(out: &mut Vec<u8>, o: &PutOptions) {
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
        put_len(out, tag.as_bytes());
    }
}

/// A forwarded write's or delete's payload, to be done before `deadline_ms` (Unix time);
/// false for any other request.
pub fn encode_request(request: &PeerRequest, deadline_ms: u64, out: &mut Vec<u8>) -> bool {
    let Some(size) = request_size(request) else { return false };
    out.reserve(size);
    out.extend_from_slice(&deadline_ms.to_be_bytes());
    let head = |out: &mut Vec<u8>, map_version: u64, op: u8| {
        out.extend_from_slice(&map_version.to_be_bytes());
        out.push(op);
    };
    match request {
        PeerRequest::Put { item, map_version } => {
            head(out, *map_version, PUT);
            put_len(out, item.key.as_bytes());
            put_options(out, &item.options);
            out.extend_from_slice(&item.value);
        }
        PeerRequest::Delete { key, cas, map_version } => {
            head(out, *map_version, DELETE);
            put_len(out, key.as_bytes());
            out.push(u8::from(cas.is_some()));
            out.extend_from_slice(&cas.unwrap_or(0).to_be_bytes());
        }
        PeerRequest::BulkPut { items, map_version } => {
            head(out, *map_version, BULK_PUT);
            out.extend_from_slice(&(items.len() as u32).to_be_bytes());
            for item in items {
                put_len(out, item.key.as_bytes());
                put_options(out, &item.options);
                put_len(out, &item.value);
            }
        }
        PeerRequest::BulkDelete { keys, map_version } => {
            head(out, *map_version, BULK_DELETE);
            out.extend_from_slice(&(keys.len() as u32).to_be_bytes());
            for key in keys {
                put_len(out, key.as_bytes());
            }
        }
        _ => return false,
    }
    true
}

/// Reads a payload of [`encode_request`] back into its request and deadline, or says why it
/// is malformed. Written values are slices of `payload`, not copies.
pub fn decode_request(payload: &Bytes) -> Result<(PeerRequest, u64), super::Malformed> {
    let malformed = || super::Malformed::Message("forwarded write");
    let mut r = Reader(payload);
    let deadline_ms = r.u64().ok_or_else(malformed)?;
    let map_version = r.u64().ok_or_else(malformed)?;
    let op = r.take(1).ok_or_else(malformed)?[0];
    let request = match op {
        PUT => {
            let key = text(r.len_prefixed().ok_or_else(malformed)?)?;
            let options = options(&mut r)?;
            let value = payload.slice(payload.len() - r.0.len()..);
            PeerRequest::Put { item: PutItem { key, value, options }, map_version }
        }
        DELETE => {
            let key = text(r.len_prefixed().ok_or_else(malformed)?)?;
            let has_cas = r.take(1).ok_or_else(malformed)?[0];
            let version = r.u64().ok_or_else(malformed)?;
            if has_cas > 1 || !r.0.is_empty() {
                return Err(malformed());
            }
            PeerRequest::Delete { key, cas: (has_cas == 1).then_some(version), map_version }
        }
        BULK_PUT => {
            // Each item takes at least its key's length, its options and its value's length.
            let count = r.count(4 + OPTIONS + 4).ok_or_else(malformed)?;
            let mut items = Vec::with_capacity(count);
            for _ in 0..count {
                let key = text(r.len_prefixed().ok_or_else(malformed)?)?;
                let options = options(&mut r)?;
                let len = r.u32().ok_or_else(malformed)? as usize;
                let start = payload.len() - r.0.len();
                r.take(len).ok_or_else(malformed)?;
                items.push(PutItem { key, value: payload.slice(start..start + len), options });
            }
            if !r.0.is_empty() {
                return Err(malformed());
            }
            PeerRequest::BulkPut { items, map_version }
        }
        BULK_DELETE => {
            let count = r.count(4).ok_or_else(malformed)?;
            let mut keys = Vec::with_capacity(count);
            for _ in 0..count {
                keys.push(text(r.len_prefixed().ok_or_else(malformed)?)?);
            }
            if !r.0.is_empty() {
                return Err(malformed());
            }
            PeerRequest::BulkDelete { keys, map_version }
        }
        _ => return Err(malformed()),
    };
    Ok((request, deadline_ms))
}

/// A write's options off the front of `r`.
fn options(r: &mut Reader<'_>) -> Result<PutOptions, super::Malformed> {
    let malformed = || super::Malformed::Message("forwarded write");
    let duration = |ms: u64| (ms != NONE).then(|| Duration::from_millis(ms));
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
    if priority > Priority::NotRemovable.rank() {
        return Err(malformed());
    }
    // Each tag takes at least its length's four bytes.
    let count = r.count(4).ok_or_else(malformed)?;
    let mut tags = Vec::with_capacity(count);
    for _ in 0..count {
        tags.push(text(r.len_prefixed().ok_or_else(malformed)?)?);
    }
    Ok(PutOptions {
        ttl: duration(ttl),
        sliding: duration(sliding),
        tags,
        condition,
        priority: Priority::of_rank(priority),
    })
}

fn text(bytes: &[u8]) -> Result<String, super::Malformed> {
    std::str::from_utf8(bytes).map(str::to_string).map_err(|_| super::Malformed::NotUtf8)
}

fn put_done(out: &mut Vec<u8>, ok: &PutOk) {
    out.extend_from_slice(&ok.version.to_be_bytes());
    out.extend_from_slice(&ok.bucket.to_be_bytes());
    out.extend_from_slice(&ok.node.to_be_bytes());
}

fn key_failed(out: &mut Vec<u8>, e: &ApiError) {
    out.push(FAILED);
    put_len(out, &serde_json::to_vec(&KeyError::of(e)).unwrap_or_default());
}

/// The link answer (kind and payload) to a forwarded write or delete: what
/// [`crate::node::PeerService::serve`] answered.
pub fn encode_answer(answer: Result<PeerAnswer, CallError>) -> (u8, Vec<u8>) {
    // Sized up front: a forwarded write's answer is on the hot path.
    let mut out = Vec::with_capacity(match &answer {
        Ok(PeerAnswer::BulkPut(results)) => results.len() * (1 + DONE),
        Ok(PeerAnswer::BulkDeleted(results)) => results.len(),
        _ => DONE,
    });
    match answer {
        Ok(PeerAnswer::Put(ok)) => put_done(&mut out, &ok),
        Ok(PeerAnswer::Deleted) => {}
        Ok(PeerAnswer::BulkPut(results)) => {
            for result in &results {
                match result {
                    Ok(ok) => {
                        out.push(WRITTEN);
                        put_done(&mut out, ok);
                    }
                    Err(e) => key_failed(&mut out, e),
                }
            }
        }
        Ok(PeerAnswer::BulkDeleted(results)) => {
            for result in &results {
                match result {
                    Ok(true) => out.push(DELETED),
                    Ok(false) => out.push(ABSENT),
                    Err(e) => key_failed(&mut out, e),
                }
            }
        }
        Ok(other) => return super::reads::failed(&ApiError::Internal(format!("a write answered with {other:?}"))),
        Err(CallError::Api(e)) => return super::reads::failed(&e),
        Err(other) => return super::reads::failed(&ApiError::Internal(other.to_string())),
    }
    (LINK_WRITE_DONE, out)
}

/// What a forwarded write or delete sent on a link gets: `request`'s answer, rebuilt from the
/// link answer of `kind` and `payload`; `None` for an answer of another kind (a refusal).
pub fn decode_answer(request: &PeerRequest, kind: u8, payload: &[u8]) -> Option<Result<PeerAnswer, CallError>> {
    let broken = || CallError::Broken("an unreadable answer to a write on a peer link".into());
    match kind {
        LINK_WRITE_DONE => {}
        LINK_FAILED => return Some(Err(failure(payload))),
        _ => return None,
    }
    let mut r = Reader(payload);
    let done = |r: &mut Reader<'_>, key: &str| {
        Some(PutOk { key: key.to_string(), version: r.u64()?, bucket: r.u16()?, node: r.u64()? })
    };
    let failed = |r: &mut Reader<'_>| {
        let error: KeyError = serde_json::from_slice(r.len_prefixed()?).ok()?;
        Some(error.error())
    };
    let answer = match request {
        PeerRequest::Put { item, .. } => done(&mut r, &item.key).map(PeerAnswer::Put),
        PeerRequest::Delete { .. } => Some(PeerAnswer::Deleted),
        PeerRequest::BulkPut { items, .. } => items
            .iter()
            .map(|item| match r.take(1)?[0] {
                WRITTEN => done(&mut r, &item.key).map(Ok),
                FAILED => failed(&mut r).map(Err),
                _ => None,
            })
            .collect::<Option<Vec<_>>>()
            .map(PeerAnswer::BulkPut),
        PeerRequest::BulkDelete { keys, .. } => keys
            .iter()
            .map(|_| match r.take(1)?[0] {
                DELETED => Some(Ok(true)),
                ABSENT => Some(Ok(false)),
                FAILED => failed(&mut r).map(Err),
                _ => None,
            })
            .collect::<Option<Vec<_>>>()
            .map(PeerAnswer::BulkDeleted),
        _ => None,
    };
    Some(answer.filter(|_| r.0.is_empty()).ok_or_else(broken))
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

    fn bulk_put(items: &[(&str, &[u8], PutOptions)]) -> PeerRequest {
        let items = items
            .iter()
            .map(|(k, v, o)| PutItem { key: (*k).into(), value: Bytes::copy_from_slice(v), options: o.clone() })
            .collect();
        PeerRequest::BulkPut { items, map_version: 17 }
    }

    #[test]
    fn bulk_writes_and_deletes_read_back_as_sent() {
        let tagged = PutOptions {
            ttl: Some(Duration::from_secs(5)),
            tags: vec!["t".into(), "ü".into()],
            condition: WriteCondition::Version(9),
            ..PutOptions::default()
        };
        let requests = [
            bulk_put(&[]),
            bulk_put(&[("a", b"1", PutOptions::default()), ("", b"", tagged.clone()), ("c", &[0, 255, 7], tagged)]),
            PeerRequest::BulkDelete { keys: vec![], map_version: 0 },
            PeerRequest::BulkDelete { keys: vec!["x".into(), String::new(), "ключ".into()], map_version: 5 },
        ];
        for request in requests {
            assert_eq!(format!("{:?}", round_trip(&request)), format!("{request:?}"));
            // Cut anywhere, it is refused; with a byte more, too.
            let mut whole = Vec::new();
            encode_request(&request, 1, &mut whole);
            for cut in 0..whole.len() {
                assert!(decode_request(&Bytes::copy_from_slice(&whole[..cut])).is_err(), "{request:?} cut at {cut}");
            }
            whole.push(0);
            assert!(decode_request(&Bytes::from(whole)).is_err(), "{request:?} with a byte after it");
        }
    }

    #[test]
    fn bulk_answers_come_back_in_order_with_each_key_s_error() {
        let put = bulk_put(&[("a", b"1", PutOptions::default()), ("b", b"2", PutOptions::default())]);
        let ok = PutOk { key: "a".into(), version: 3, bucket: 12, node: 4 };
        let refused = ApiError::PreconditionFailed { current_version: Some(8) };
        let (kind, payload) = encode_answer(Ok(PeerAnswer::BulkPut(vec![Ok(ok.clone()), Err(refused.clone())])));
        match decode_answer(&put, kind, &payload) {
            Some(Ok(PeerAnswer::BulkPut(results))) => {
                assert_eq!(results[0].as_ref().ok(), Some(&ok));
                let e = results[1].as_ref().expect_err("refused");
                assert_eq!((e.code(), e.status()), (refused.code(), refused.status()));
            }
            other => panic!("{other:?}"),
        }
        // Fewer results than items, or more, is no answer.
        let (kind, payload) = encode_answer(Ok(PeerAnswer::BulkPut(vec![Ok(ok.clone())])));
        assert!(matches!(decode_answer(&put, kind, &payload), Some(Err(CallError::Broken(_)))));
        let delete = PeerRequest::BulkDelete { keys: vec!["a".into(), "b".into(), "c".into()], map_version: 1 };
        let answer = vec![Ok(true), Ok(false), Err(ApiError::NotOwner { bucket: 2, map_version: 3 })];
        let (kind, payload) = encode_answer(Ok(PeerAnswer::BulkDeleted(answer)));
        match decode_answer(&delete, kind, &payload) {
            Some(Ok(PeerAnswer::BulkDeleted(results))) => {
                assert_eq!(results[..2].iter().map(|r| *r.as_ref().expect("done")).collect::<Vec<_>>(), [true, false]);
                assert_eq!(results[2].as_ref().expect_err("not owner").code(), "not_owner");
            }
            other => panic!("{other:?}"),
        }
        let (kind, payload) = encode_answer(Err(CallError::Api(ApiError::NotFound)));
        assert!(matches!(decode_answer(&delete, kind, &payload), Some(Err(CallError::Api(ApiError::NotFound)))));
    }

    proptest::proptest! {
        /// Garbage is refused, never a panic, whatever its counts and lengths say.
        #[test]
        fn any_bytes_are_a_write_or_refused(bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..512)) {
            let _ = decode_request(&Bytes::from(bytes.clone()));
            let requests = [
                item("k", b"v", PutOptions::default()),
                PeerRequest::Delete { key: "k".into(), cas: None, map_version: 1 },
                bulk_put(&[("a", b"1", PutOptions::default())]),
                PeerRequest::BulkDelete { keys: vec!["a".into(), "b".into()], map_version: 1 },
            ];
            for request in &requests {
                let _ = decode_answer(request, LINK_WRITE_DONE, &bytes);
                let _ = decode_answer(request, LINK_FAILED, &bytes);
            }
        }

        /// A valid header followed by any bytes: still refused or read, never a panic.
        #[test]
        fn any_body_after_a_bulk_header_is_a_write_or_refused(
            op in 1u8..=4,
            body in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..512),
        ) {
            let mut bytes = vec![0u8; 16];
            bytes.push(op);
            bytes.extend_from_slice(&body);
            let _ = decode_request(&Bytes::from(bytes));
        }
    }
}
