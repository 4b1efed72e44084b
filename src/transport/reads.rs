//! Forwarded and mirror reads on peer links: their wire format.
//!
//! A node reads a key it does not own from the owner (or from a mirror), alone or several of
//! one owner as one bulk read: one small message each way on the peer link
//! (`transport::link`). The answer carries what a client of the owner would get: each found
//! value with its version, bucket, node and replica lag; an error of the whole read as its
//! problem document and retry-after; an error of one key of a bulk read as the [`KeyError`] a
//! bulk answer gives it. So a forwarded error keeps its status and code.
//!
//! ```text
//!  request  = deadline_ms:u64 map_version:u64 mirror_ms:u64 single:u8 count:u32 (len:u32 key)*
//!             (deadline_ms: Unix time after which the sender no longer waits;
//!             mirror_ms = u64::MAX: not a mirror read)
//!  answer   READ_DONE      (tag:u8 item)*   tag 0 absent; 1 found: version:u64 bucket:u16
//!                                           node:u64 lag_ms:u64 (u64::MAX: none) len:u32 value;
//!                                           2 failed: len:u32 KeyError JSON
//!           READ_FAILED    retry_after_s:u64 (0: none) Problem JSON
//! ```
//!
//! Everything is big-endian; every count and length is checked against what is left of the
//! payload before anything is taken.

use std::time::Duration;

use bytes::Bytes;
use shoal_http_api::types::{GetOk, KeyError};
use shoal_http_api::{ApiError, Problem, Unavailable};

use super::link::FORWARD;
use super::{CallError, PeerAnswer, PeerRequest};

/// A link request: a forwarded or mirror read ([`encode_request`]).
pub const LINK_READ: u8 = 4 | FORWARD;
/// A link answer: one result per key.
pub const LINK_READ_DONE: u8 = 5;
/// A link answer: the whole read (or forwarded write, `transport::writes`) failed.
pub const LINK_FAILED: u8 = 6;

/// Bytes of a request before its keys.
const REQUEST_HEADER: usize = 29;
/// Bytes of a found item before its value.
const FOUND_HEADER: usize = 1 + 8 + 2 + 8 + 8 + 4;
/// `mirror_ms` and `lag_ms` when absent.
const NONE: u64 = u64::MAX;

/// The bytes a read of `keys` takes on a link.
pub fn request_size(keys: &[String]) -> usize {
    REQUEST_HEADER + keys.iter().map(|k| 4 + k.len()).sum::<usize>()
}

/// A read request's payload, to be answered before `deadline_ms` (Unix time); false for any
/// other request (those do not go on links).
pub fn encode_request(request: &PeerRequest, deadline_ms: u64, out: &mut Vec<u8>) -> bool {
    let (keys, map_version, mirror, single) = match request {
        PeerRequest::Get { key, map_version, mirror } => (std::slice::from_ref(key), *map_version, *mirror, true),
        PeerRequest::BulkGet { keys, map_version, mirror } => (keys.as_slice(), *map_version, *mirror, false),
        _ => return false,
    };
    out.reserve(request_size(keys));
    out.extend_from_slice(&deadline_ms.to_be_bytes());
    out.extend_from_slice(&map_version.to_be_bytes());
    let mirror_ms = mirror.map_or(NONE, |m| (m.as_millis() as u64).min(NONE - 1));
    out.extend_from_slice(&mirror_ms.to_be_bytes());
    out.push(u8::from(single));
    out.extend_from_slice(&(keys.len() as u32).to_be_bytes());
    for key in keys {
        out.extend_from_slice(&(key.len() as u32).to_be_bytes());
        out.extend_from_slice(key.as_bytes());
    }
    true
}

/// Reads a payload of [`encode_request`] back into its request and deadline, or says why it
/// is malformed.
pub fn decode_request(payload: &[u8]) -> Result<(PeerRequest, u64), super::Malformed> {
    let mut r = Reader(payload);
    let malformed = || super::Malformed::Message("read");
    let deadline_ms = r.u64().ok_or_else(malformed)?;
    let map_version = r.u64().ok_or_else(malformed)?;
    let mirror = match r.u64().ok_or_else(malformed)? {
        NONE => None,
        ms => Some(Duration::from_millis(ms)),
    };
    let single = r.take(1).ok_or_else(malformed)?[0] != 0;
    let count = r.u32().ok_or_else(malformed)? as usize;
    // Each key takes at least its length's four bytes: a count beyond that is a lie.
    if count > r.0.len() / 4 || (single && count != 1) {
        return Err(malformed());
    }
    let mut keys = Vec::with_capacity(count);
    for _ in 0..count {
        let len = r.u32().ok_or_else(malformed)? as usize;
        let key = std::str::from_utf8(r.take(len).ok_or_else(malformed)?).map_err(|_| super::Malformed::NotUtf8)?;
        keys.push(key.to_string());
    }
    if !r.0.is_empty() {
        return Err(malformed());
    }
    let request = match (single, keys.pop()) {
        (true, Some(key)) => PeerRequest::Get { key, map_version, mirror },
        (_, last) => {
            keys.extend(last);
            PeerRequest::BulkGet { keys, map_version, mirror }
        }
    };
    Ok((request, deadline_ms))
}

/// The link answer (kind and payload) to a read: what [`crate::node::PeerService::serve`] answered.
/// `None` when it would be larger than `most` bytes (the reader asks over HTTP).
pub fn encode_answer(answer: Result<PeerAnswer, CallError>) -> (u8, Vec<u8>) {
    let items = match answer {
        Ok(PeerAnswer::Got(ok)) => vec![Ok(Some(ok))],
        Ok(PeerAnswer::BulkGot(items)) => items,
        Ok(other) => return failed(&ApiError::Internal(format!("a read answered with {other:?}"))),
        Err(CallError::Api(e)) => return failed(&e),
        Err(other) => return failed(&ApiError::Internal(other.to_string())),
    };
    let values: usize = items.iter().map(|i| i.as_ref().map_or(0, |f| f.as_ref().map_or(0, |ok| ok.value.len()))).sum();
    let mut out = Vec::with_capacity(values + items.len() * FOUND_HEADER);
    for item in &items {
        match item {
            Ok(None) => out.push(0),
            Ok(Some(ok)) => {
                out.push(1);
                out.extend_from_slice(&ok.version.to_be_bytes());
                out.extend_from_slice(&ok.bucket.to_be_bytes());
                out.extend_from_slice(&ok.node.to_be_bytes());
                out.extend_from_slice(&ok.lag_ms.unwrap_or(NONE).to_be_bytes());
                out.extend_from_slice(&(ok.value.len() as u32).to_be_bytes());
                out.extend_from_slice(&ok.value);
            }
            Err(e) => {
                out.push(2);
                let error = serde_json::to_vec(&KeyError::of(e)).unwrap_or_default();
                out.extend_from_slice(&(error.len() as u32).to_be_bytes());
                out.extend_from_slice(&error);
            }
        }
    }
    (LINK_READ_DONE, out)
}

/// Whether a forwarded read or write that came over a link at `now_ms` is served: refused if
/// its deadline has passed (its sender no longer waits: nothing is done).
pub fn admit(deadline_ms: u64, now_ms: u64) -> Result<(), (u8, Vec<u8>)> {
    if now_ms > deadline_ms {
        let late = "the forwarded request arrived after its deadline; nothing was done";
        return Err(failed(&ApiError::unavailable(Unavailable::Expired, late)));
    }
    Ok(())
}

/// A whole read's (or forwarded write's) failure, as its HTTP answer would carry it: the
/// problem document and `Retry-After` in whole seconds.
pub fn failed(e: &ApiError) -> (u8, Vec<u8>) {
    if let ApiError::Internal(detail) = e {
        tracing::error!(%detail, "internal error");
    }
    let retry_after = e.retry_after().map_or(0, |d| d.as_secs().max(1));
    let mut out = retry_after.to_be_bytes().to_vec();
    out.extend_from_slice(&serde_json::to_vec(&e.problem()).unwrap_or_default());
    (LINK_FAILED, out)
}

/// What a read request sent on a link gets: `request`'s answer, rebuilt from the link answer
/// of `kind` and `payload`; `None` for an answer of another kind (a refusal).
pub fn decode_answer(request: &PeerRequest, kind: u8, payload: &Bytes) -> Option<Result<PeerAnswer, CallError>> {
    let broken = || CallError::Broken("an unreadable answer to a read on a peer link".into());
    match kind {
        LINK_READ_DONE => {}
        LINK_FAILED => return Some(Err(failure(payload))),
        _ => return None,
    }
    let Some(items) = decode_items(payload) else { return Some(Err(broken())) };
    Some(match request {
        PeerRequest::Get { .. } => match <[_; 1]>::try_from(items) {
            Ok([Ok(Some(ok))]) => Ok(PeerAnswer::Got(ok)),
            Ok([Ok(None)]) => Err(CallError::Api(ApiError::NotFound)),
            Ok([Err(e)]) => Err(CallError::Api(e)),
            Err(_) => Err(broken()),
        },
        PeerRequest::BulkGet { keys, .. } if keys.len() == items.len() => Ok(PeerAnswer::BulkGot(items)),
        _ => Err(broken()),
    })
}

/// The error a [`LINK_FAILED`] answer carries ([`failed`]), as HTTP would have given it.
pub fn failure(payload: &[u8]) -> CallError {
    let retry_after = payload.get(..8).and_then(|b| b.try_into().ok()).map(u64::from_be_bytes);
    let problem = payload.get(8..).and_then(|p| serde_json::from_slice::<Problem>(p).ok());
    match (retry_after, problem) {
        (Some(secs), Some(problem)) => {
            let retry_after = (secs > 0).then(|| Duration::from_secs(secs));
            CallError::Api(ApiError::from_problem(&problem, retry_after))
        }
        _ => CallError::Broken("an unreadable failure on a peer link".into()),
    }
}

/// The items of a [`LINK_READ_DONE`] payload; `None` if it is malformed. Values are slices of
/// the payload, not copies.
fn decode_items(payload: &Bytes) -> Option<Vec<Result<Option<GetOk>, ApiError>>> {
    let mut items = Vec::new();
    let mut r = Reader(payload);
    while let Some(tag) = r.take(1) {
        items.push(match tag[0] {
            0 => Ok(None),
            1 => {
                let (version, bucket, node, lag_ms) = (r.u64()?, r.u16()?, r.u64()?, r.u64()?);
                let len = r.u32()? as usize;
                let start = payload.len() - r.0.len();
                r.take(len)?;
                let value = payload.slice(start..start + len);
                Ok(Some(GetOk { value, version, bucket, node, lag_ms: (lag_ms != NONE).then_some(lag_ms) }))
            }
            2 => {
                let len = r.u32()? as usize;
                let error: KeyError = serde_json::from_slice(r.take(len)?).ok()?;
                Err(error.error())
            }
            _ => return None,
        });
    }
    Some(items)
}

/// Reads big-endian numbers and byte runs off the front of a slice.
pub(super) struct Reader<'a>(pub(super) &'a [u8]);

impl<'a> Reader<'a> {
    pub(super) fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        let (head, rest) = (self.0.get(..n)?, self.0.get(n..)?);
        self.0 = rest;
        Some(head)
    }

    /// A `len:u32` and that many bytes.
    pub(super) fn len_prefixed(&mut self) -> Option<&'a [u8]> {
        let len = self.u32()? as usize;
        self.take(len)
    }

    /// A `count:u32` of things that take at least `least` bytes each: `None` when what is
    /// left cannot hold them (a count beyond that is a lie, and must not size an allocation).
    pub(super) fn count(&mut self, least: usize) -> Option<usize> {
        let count = self.u32()? as usize;
        (count <= self.0.len() / least.max(1)).then_some(count)
    }

    pub(super) fn u16(&mut self) -> Option<u16> {
        Some(u16::from_be_bytes(self.take(2)?.try_into().ok()?))
    }

    pub(super) fn u32(&mut self) -> Option<u32> {
        Some(u32::from_be_bytes(self.take(4)?.try_into().ok()?))
    }

    pub(super) fn u64(&mut self) -> Option<u64> {
        Some(u64::from_be_bytes(self.take(8)?.try_into().ok()?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn found(value: &str, lag_ms: Option<u64>) -> GetOk {
        GetOk { value: Bytes::from(value.to_string()), version: 42, bucket: 999, node: 3, lag_ms }
    }

    fn round_trip(
        request: &PeerRequest,
        answer: Result<PeerAnswer, CallError>,
    ) -> Option<Result<PeerAnswer, CallError>> {
        let mut payload = Vec::new();
        assert!(encode_request(request, 1_234_567, &mut payload));
        assert_eq!(payload.len(), request_size(&keys_of(request)));
        let (decoded, deadline) = decode_request(&payload).expect("a well-formed read");
        assert_eq!(deadline, 1_234_567);
        assert_eq!(format!("{decoded:?}"), format!("{request:?}"), "the request reads back as sent");
        let (kind, answer) = encode_answer(answer);
        decode_answer(request, kind, &Bytes::from(answer))
    }

    fn keys_of(request: &PeerRequest) -> Vec<String> {
        match request {
            PeerRequest::Get { key, .. } => vec![key.clone()],
            PeerRequest::BulkGet { keys, .. } => keys.clone(),
            _ => Vec::new(),
        }
    }

    fn get(key: &str, mirror: Option<Duration>) -> PeerRequest {
        PeerRequest::Get { key: key.into(), map_version: 17, mirror }
    }

    #[test]
    fn a_single_read_comes_back_as_http_would_give_it() {
        let request = get("ключ/with spaces", None);
        let answer = round_trip(&request, Ok(PeerAnswer::Got(found("value", None)))).expect("on the link");
        assert!(matches!(answer, Ok(PeerAnswer::Got(ok)) if ok == found("value", None)));
        let mirror = get("k", Some(Duration::from_millis(250)));
        let answer = round_trip(&mirror, Ok(PeerAnswer::Got(found("", Some(7))))).expect("on the link");
        assert!(matches!(answer, Ok(PeerAnswer::Got(ok)) if ok == found("", Some(7))));
    }

    #[test]
    fn errors_keep_their_status_code_and_retry_after() {
        let errors = [
            ApiError::NotFound,
            ApiError::NotOwner { bucket: 12, map_version: 99 },
            ApiError::unavailable(Unavailable::ReplicaNotFresh, "behind by 3 s"),
            ApiError::Unavailable {
                code: Unavailable::BucketMoving,
                detail: "moving".into(),
                retry_after: Duration::from_secs(4),
            },
            ApiError::Internal("a bug".into()),
        ];
        for e in errors {
            let answer = round_trip(&get("k", None), Err(CallError::Api(e.clone()))).expect("on the link");
            let Err(CallError::Api(back)) = answer else { panic!("{e:?} came back as {answer:?}") };
            assert_eq!((back.status(), back.code(), back.retry_after()), (e.status(), e.code(), e.retry_after()));
            assert_eq!(back.problem(), e.problem());
        }
    }

    #[test]
    fn a_bulk_read_keeps_each_keys_result_in_order() {
        let keys: Vec<String> = (0..4).map(|i| format!("k{i}")).collect();
        let request = PeerRequest::BulkGet { keys, map_version: 3, mirror: None };
        let moving = ApiError::unavailable(Unavailable::BucketMoving, "bucket 7 is moving");
        let items = vec![
            Ok(Some(found("one", None))),
            Ok(None),
            Err(moving.clone()),
            Err(ApiError::PreconditionFailed { current_version: Some(5) }),
        ];
        let Some(Ok(PeerAnswer::BulkGot(back))) = round_trip(&request, Ok(PeerAnswer::BulkGot(items.clone()))) else {
            panic!("a bulk answer");
        };
        // Each key's error is what a bulk answer over HTTP carries (its `KeyError`).
        let expected: Vec<_> = items.into_iter().map(|i| i.map_err(|e| KeyError::of(&e).error())).collect();
        assert_eq!(back, expected);
        let whole = round_trip(&request, Err(CallError::Api(ApiError::NotOwner { bucket: 1, map_version: 8 })));
        assert!(matches!(whole, Some(Err(CallError::Api(ApiError::NotOwner { bucket: 1, map_version: 8 })))));
    }

    #[test]
    fn large_answers_travel_whole_and_a_late_read_is_refused() {
        let big = GetOk { value: Bytes::from(vec![1u8; 3 << 20]), ..found("", None) };
        let back = round_trip(&get("k", None), Ok(PeerAnswer::Got(big.clone())));
        assert!(matches!(back, Some(Ok(PeerAnswer::Got(ok))) if ok.value == big.value));
        // A refusal is no read answer.
        assert!(decode_answer(&get("k", None), super::super::http::LINK_REFUSED, &Bytes::new()).is_none());
        let late = admit(1_000, 1_001).expect_err("late");
        let refused = decode_answer(&get("k", None), late.0, &Bytes::from(late.1));
        let Some(Err(CallError::Api(e))) = refused else { panic!("{refused:?}") };
        assert_eq!((e.status().as_u16(), e.code()), (503, "expired"));
        assert!(admit(1_000, 1_000).is_ok());
    }

    #[test]
    fn malformed_payloads_are_refused_not_trusted() {
        let mut payload = Vec::new();
        encode_request(
            &PeerRequest::BulkGet { keys: vec!["a".into(), "bc".into()], map_version: 1, mirror: None },
            0,
            &mut payload,
        );
        for cut in 0..payload.len() {
            assert!(decode_request(&payload[..cut]).is_err(), "cut at {cut}");
        }
        let mut lying = payload.clone();
        lying[25..29].copy_from_slice(&u32::MAX.to_be_bytes());
        assert!(decode_request(&lying).is_err());
        assert!(!encode_request(&PeerRequest::NodeStats, 0, &mut Vec::new()));
        let (kind, answer) = encode_answer(Ok(PeerAnswer::BulkGot(vec![Ok(Some(found("v", None)))])));
        for cut in 0..answer.len() {
            let request = get("k", None);
            let decoded = decode_answer(&request, kind, &Bytes::copy_from_slice(&answer[..cut]));
            assert!(matches!(decoded, Some(Err(CallError::Broken(_)))), "cut at {cut}: {decoded:?}");
        }
    }

    proptest::proptest! {
        /// Garbage is refused, never a panic, whatever its counts and lengths say.
        #[test]
        fn any_bytes_are_a_read_or_refused(bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..512)) {
            let _ = decode_request(&bytes);
            let get = PeerRequest::Get { key: "k".into(), map_version: 1, mirror: None };
            let bulk = PeerRequest::BulkGet { keys: vec!["a".into(), "b".into()], map_version: 1, mirror: None };
            for request in [&get, &bulk] {
                let _ = decode_answer(request, LINK_READ_DONE, &Bytes::from(bytes.clone()));
                let _ = decode_answer(request, LINK_FAILED, &Bytes::from(bytes.clone()));
            }
        }
    }
}
