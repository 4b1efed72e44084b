//! The wire format of the requests between nodes on a peer link that are neither replica
//! writes nor forwarded key operations: shadow writes, give-backs, pings, transfer status,
//! maintenance, bucket reports and views, rebalancing, the broadcasts of key and tag listings
//! and tag removals, node figures. One kind, [`LINK_CALL`]: the request as
//! JSON (its length first, u32), then the framed body that shadow writes and give-backs carry.
//! The answer is [`LINK_CALLED`] with the answer as JSON, or an error: [`reads::LINK_FAILED`]
//! (an API error, as a problem document) or [`super::http::LINK_REFUSED`] (a status and a
//! reason).
//!
//! They are few and small (but for the bodies, which are framed bytes, not JSON), so their
//! encoding is serde's, not one of its own per request.

use bytes::Bytes;
use shoal_http_api::ApiError;
use shoal_raft::BUCKET_COUNT;

use super::http::{encode_refusal, LINK_REFUSED};
use super::{reads, CallError, Malformed, PeerAnswer, PeerRequest};

/// A link request: a call ([`encode_request`]).
pub const LINK_CALL: u8 = 10;
/// A link answer: the answer to a call, as JSON.
pub const LINK_CALLED: u8 = 11;

/// The body a request carries besides its JSON.
fn body_of(request: &mut PeerRequest) -> Option<&mut Bytes> {
    match request {
        PeerRequest::Shadow { body, .. } | PeerRequest::GiveBack { body, .. } => Some(body),
        _ => None,
    }
}

/// Writes `request` as a call payload into `out`; fails for the requests that travel in their
/// own kinds (replica writes, forwarded key operations) or not on links.
pub fn encode_request(request: &PeerRequest, out: &mut Vec<u8>) -> Result<(), CallError> {
    let json = serde_json::to_vec(request).map_err(|e| CallError::Broken(format!("not a call: {e}")))?;
    out.extend_from_slice(&(json.len() as u32).to_be_bytes());
    out.extend_from_slice(&json);
    if let PeerRequest::Shadow { body, .. } | PeerRequest::GiveBack { body, .. } = request {
        out.extend_from_slice(body);
    }
    Ok(())
}

/// Reads a call payload; why not, for one that is not a call. The JSON's length is bounded by
/// the payload's, the body is what follows it, and a bucket must exist.
pub fn decode_request(payload: Bytes) -> Result<PeerRequest, Malformed> {
    let malformed = || Malformed::Message("call");
    let len = payload.get(..4).and_then(|b| b.try_into().ok()).map(u32::from_be_bytes).ok_or_else(malformed)?;
    let end = 4usize.checked_add(len as usize).filter(|&end| end <= payload.len()).ok_or_else(malformed)?;
    let mut request: PeerRequest = serde_json::from_slice(&payload[4..end]).map_err(|_| malformed())?;
    if let PeerRequest::Shadow { bucket, .. } | PeerRequest::GiveBack { bucket, .. } = &request {
        if usize::from(bucket.0) >= BUCKET_COUNT {
            return Err(Malformed::NoSuchBucket(bucket.0));
        }
    }
    match body_of(&mut request) {
        Some(body) => *body = payload.slice(end..),
        // A body after a call that takes none.
        None if end < payload.len() => return Err(malformed()),
        None => {}
    }
    Ok(request)
}

/// The link answer to a call.
pub fn encode_answer(answer: Result<PeerAnswer, CallError>) -> (u8, Vec<u8>) {
    match answer {
        Ok(answer) => match serde_json::to_vec(&answer) {
            Ok(json) => (LINK_CALLED, json),
            Err(e) => reads::failed(&ApiError::Internal(format!("an answer that is not a call's: {e}"))),
        },
        Err(CallError::Api(e)) => reads::failed(&e),
        Err(CallError::Refused { status, reason }) => (LINK_REFUSED, encode_refusal(status, &reason)),
        Err(other) => (LINK_REFUSED, encode_refusal(503, &other.to_string())),
    }
}

/// What a call gets from the link answer of `kind` and `payload`; `None` for an answer of
/// another kind (a refusal).
pub fn decode_answer(kind: u8, payload: &[u8]) -> Option<Result<PeerAnswer, CallError>> {
    match kind {
        LINK_CALLED => Some(
            serde_json::from_slice(payload)
                .map_err(|e| CallError::Broken(format!("an unreadable answer to a call on a peer link: {e}"))),
        ),
        reads::LINK_FAILED => Some(Err(reads::failure(payload))),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use proptest::prelude::*;
    use shoal_raft::BucketId;

    use super::*;
    use crate::transport::Ping;

    fn round_trip(request: &PeerRequest) -> PeerRequest {
        let mut out = Vec::new();
        encode_request(request, &mut out).expect("a call");
        decode_request(Bytes::from(out)).expect("reads back")
    }

    #[test]
    fn calls_and_their_bodies_read_back_as_sent() {
        let shadow = PeerRequest::Shadow { bucket: BucketId(999), body: Bytes::from_static(b"\0framed\xff") };
        match round_trip(&shadow) {
            PeerRequest::Shadow { bucket, body } => {
                assert_eq!((bucket, &body[..]), (BucketId(999), &b"\0framed\xff"[..]))
            }
            other => panic!("{other:?}"),
        }
        let ping = PeerRequest::Ping(Ping { from: 3, pfail: vec![1, 2], incarnation: 77, replica: None });
        match round_trip(&ping) {
            PeerRequest::Ping(p) => assert_eq!((p.from, p.pfail, p.incarnation), (3, vec![1, 2], 77)),
            other => panic!("{other:?}"),
        }
        let maintenance = PeerRequest::EnterMaintenance { period: Duration::from_millis(1500) };
        assert!(matches!(
            round_trip(&maintenance),
            PeerRequest::EnterMaintenance { period } if period == Duration::from_millis(1500)
        ));
    }

    #[test]
    fn requests_with_kinds_of_their_own_are_no_calls() {
        let get = PeerRequest::Get { key: "k".into(), map_version: 1, mirror: None };
        assert!(encode_request(&get, &mut Vec::new()).is_err());
        let got = PeerAnswer::Deleted;
        assert_eq!(encode_answer(Ok(got)).0, reads::LINK_FAILED);
    }

    #[test]
    fn a_call_that_names_no_bucket_or_carries_a_stray_body_is_refused() {
        let mut out = Vec::new();
        encode_request(&PeerRequest::Shadow { bucket: BucketId(1000), body: Bytes::new() }, &mut out).expect("a call");
        assert_eq!(decode_request(Bytes::from(out)).expect_err("no bucket 1000"), Malformed::NoSuchBucket(1000));
        let mut out = Vec::new();
        encode_request(&PeerRequest::TransferStatus, &mut out).expect("a call");
        out.push(0);
        assert!(decode_request(Bytes::from(out)).is_err());
    }

    proptest! {
        /// Garbage is refused, never a panic, whatever its length says.
        #[test]
        fn any_bytes_are_a_call_or_refused(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
            let _ = decode_request(Bytes::from(bytes.clone()));
            let _ = decode_answer(LINK_CALLED, &bytes);
            let _ = decode_answer(reads::LINK_FAILED, &bytes);
        }
    }
}
