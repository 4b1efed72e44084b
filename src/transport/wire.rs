//! The wire format of every request and answer on a peer link (`transport::link`): replica
//! writes, forwarded and mirror key operations, and every other call between nodes.
//!
//! One format for all of them: serde's data model written by `bincode` (fixed-width integers,
//! lengths before sequences and bytes, variants by index). A request travels as
//! `(deadline_ms, request)` in a link message whose kind says how the link treats it
//! ([`kind_of`]); the answer as `Result<PeerAnswer, CallError>` in an [`ANSWER`]. Bucket data
//! inside a message (replica writes, shadows, give-backs) is framed bytes (`transport::frame`)
//! carried as one binary field; an API error travels as its problem document (JSON) and
//! retry-after, and the answers of calls that carry the API's view types (listings, figures,
//! the cluster, maintenance, buckets, balancing plans) as their JSON, since those leave absent
//! fields out ([`json`]). A format without field names reads a field left out in the wrong
//! place: a type that travels here must not skip fields when it serializes
//! (`skip_serializing_if`) unless it travels as JSON.
//!
//! Bounds: the link bounds a message's size (`link::MAX_MESSAGE`); inside it, every length is
//! checked against what is left before anything is taken, a sequence's announced length never
//! sizes an allocation beyond what serde caps, and no type that travels nests itself. A message
//! that does not decode, names a bucket that does not exist, or came in a kind not its own is
//! refused whole (nothing of it is done).

use bytes::Bytes;
use serde::{Deserialize, Serialize};
use shoal_http_api::ApiError;
use shoal_raft::BUCKET_COUNT;

use super::link::{CANCELLABLE, FORWARD};
use super::{CallError, Malformed, PeerAnswer, PeerRequest};

/// A link request: replica writes, alone or batched.
pub const REPLICATE: u8 = 1;
/// A link request: a forwarded or mirror read (counted among forwards).
pub const READ: u8 = 4 | FORWARD;
/// A link request: a forwarded write or delete (counted among forwards, and cancelled when its
/// caller gives up or the link ends: it must die with its caller, as over HTTP).
pub const WRITE: u8 = 8 | CANCELLABLE | FORWARD;
/// A link request: any other call.
pub const CALL: u8 = 10;
/// A link answer.
pub const ANSWER: u8 = 2;

/// The kind of link message `request` travels in.
pub fn kind_of(request: &PeerRequest) -> u8 {
    match request {
        PeerRequest::Replicate(_) | PeerRequest::ReplicateBatch(_) => REPLICATE,
        PeerRequest::Get { .. } | PeerRequest::BulkGet { .. } => READ,
        PeerRequest::Put { .. }
        | PeerRequest::Delete { .. }
        | PeerRequest::BulkPut { .. }
        | PeerRequest::BulkDelete { .. } => WRITE,
        _ => CALL,
    }
}

#[derive(Serialize)]
struct Outgoing<'a> {
    deadline_ms: Option<u64>,
    request: &'a PeerRequest,
}

#[derive(Deserialize)]
struct Incoming {
    deadline_ms: Option<u64>,
    request: PeerRequest,
}

/// Appends `request` to `out`, with the Unix time after which its sender no longer waits
/// (a forwarded operation's: the receiver then refuses it, and does nothing). On failure
/// nothing is appended.
pub fn encode_request(request: &PeerRequest, deadline_ms: Option<u64>, out: &mut Vec<u8>) -> Result<(), CallError> {
    let start = out.len();
    write(out, &Outgoing { deadline_ms, request }).map_err(|e| {
        out.truncate(start);
        CallError::Broken(format!("a request that cannot be sent: {e}"))
    })
}

/// Reads a request and its deadline out of a link message of `kind`, or says why not. Bucket
/// data in it ([`shared`]) is taken as slices of `payload`, not copied.
pub fn decode_request(kind: u8, payload: &Bytes) -> Result<(PeerRequest, Option<u64>), Malformed> {
    // Only replica writes and calls (shadows, give-backs) carry bucket data: a forwarded key
    // operation does not pay for the message's handle.
    let carries_data = kind == REPLICATE || kind == CALL;
    if carries_data {
        MESSAGE.with_borrow_mut(|m| *m = Some(payload.clone()));
    }
    let read = read::<Incoming>(payload);
    if carries_data {
        MESSAGE.with_borrow_mut(|m| *m = None);
    }
    let Incoming { deadline_ms, request } = read.map_err(|e| Malformed::Unreadable(e.to_string()))?;
    if kind != kind_of(&request) {
        return Err(Malformed::Kind(kind));
    }
    let bucket = |b: u16| if usize::from(b) < BUCKET_COUNT { Ok(()) } else { Err(Malformed::NoSuchBucket(b)) };
    match &request {
        PeerRequest::Replicate(r) => bucket(r.bucket.0)?,
        PeerRequest::ReplicateBatch(batch) => batch.iter().try_for_each(|r| bucket(r.bucket.0))?,
        PeerRequest::Shadow { bucket: b, .. } | PeerRequest::GiveBack { bucket: b, .. } => bucket(b.0)?,
        _ => {}
    }
    Ok((request, deadline_ms))
}

/// The options of every encoding and decoding: fixed-width integers; bytes left over after
/// a value are an error.
fn options() -> impl bincode::Options + Copy {
    use bincode::Options;
    bincode::DefaultOptions::new().with_fixint_encoding()
}

/// Writes without a limit of its own (with one, bincode measures every value once before it
/// writes it): the link refuses to send a request over its bound (`LinkError::TooLarge`), and
/// [`encode_answer`] turns an answer over it into a refusal.
fn write<T: Serialize>(out: &mut Vec<u8>, value: &T) -> bincode::Result<()> {
    bincode::Options::serialize_into(options(), out, value)
}

/// Reads within the link's bound of one message: no announced length sizes an allocation
/// beyond what is left.
fn read<'a, T: Deserialize<'a>>(bytes: &'a [u8]) -> bincode::Result<T> {
    use bincode::Options;
    options().with_limit(super::link::MAX_MESSAGE as u64).deserialize(bytes)
}

thread_local! {
    /// The link message [`decode_request`] is reading on this thread, if any.
    static MESSAGE: std::cell::RefCell<Option<Bytes>> = const { std::cell::RefCell::new(None) };
}

/// A field of bucket data (`#[serde(deserialize_with = "wire::shared::deserialize")]`): read
/// by [`decode_request`], it is a slice of the link message it came in, so a replica
/// snapshot is not copied on the link's reading loop (which holds up the messages behind it);
/// read out of anything else, it is copied.
pub mod shared {
    use bytes::Bytes;
    use serde::de::{Deserializer, Error, Visitor};

    /// Reads the bytes, as a slice of the message being read when they lie within it.
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Bytes, D::Error> {
        d.deserialize_bytes(Shared)
    }

    struct Shared;

    impl<'de> Visitor<'de> for Shared {
        type Value = Bytes;

        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("bytes")
        }

        fn visit_borrowed_bytes<E: Error>(self, v: &'de [u8]) -> Result<Bytes, E> {
            let within = super::MESSAGE.with_borrow(|m| {
                let m = m.as_ref()?;
                let start = (v.as_ptr() as usize).checked_sub(m.as_ptr() as usize)?;
                (start.checked_add(v.len())? <= m.len()).then(|| m.slice(start..start + v.len()))
            });
            Ok(within.unwrap_or_else(|| Bytes::copy_from_slice(v)))
        }

        fn visit_bytes<E: Error>(self, v: &[u8]) -> Result<Bytes, E> {
            Ok(Bytes::copy_from_slice(v))
        }

        fn visit_byte_buf<E: Error>(self, v: Vec<u8>) -> Result<Bytes, E> {
            Ok(Bytes::from(v))
        }
    }
}

/// A field that travels as its JSON (`#[serde(with = "json")]`): the API's view types, which
/// leave absent fields out.
pub mod json {
    use serde::de::{DeserializeOwned, Error as _};
    use serde::ser::Error as _;
    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    /// Writes `value` as JSON bytes.
    pub fn serialize<T: Serialize, S: Serializer>(value: &T, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_bytes(&serde_json::to_vec(value).map_err(S::Error::custom)?)
    }

    /// Reads a value out of JSON bytes.
    pub fn deserialize<'de, T: DeserializeOwned, D: Deserializer<'de>>(d: D) -> Result<T, D::Error> {
        serde_json::from_slice(<&[u8]>::deserialize(d)?).map_err(D::Error::custom)
    }
}

/// The payload of the [`ANSWER`] to a request. An error of the receiver's own calls (a peer it
/// could not reach, say) becomes a refusal: the caller must not take it for its own.
pub fn encode_answer(answer: Result<PeerAnswer, CallError>) -> Vec<u8> {
    let answer = match answer {
        Err(CallError::Api(ApiError::Internal(detail))) => {
            tracing::error!(%detail, "internal error");
            Err(CallError::Api(ApiError::Internal(detail)))
        }
        Err(e @ (CallError::Unreachable(_) | CallError::Timeout | CallError::Broken(_))) => {
            Err(CallError::Refused { status: 503, reason: e.to_string() })
        }
        other => other,
    };
    let mut out = Vec::with_capacity(64);
    let unsendable = match write(&mut out, &answer) {
        Err(e) => Some(e.to_string()),
        Ok(()) if out.len() > super::link::MAX_MESSAGE => Some(format!("{} bytes, over a link message", out.len())),
        Ok(()) => None,
    };
    if let Some(why) = unsendable {
        out.clear();
        let refused: Result<PeerAnswer, _> =
            Err(CallError::Refused { status: 500, reason: format!("an answer that cannot be sent: {why}") });
        let _ = write(&mut out, &refused);
    }
    out
}

/// What a caller of `request` gets from the answer of `kind` and `payload`: the answer, if it
/// reads and fits the request (one result per key of a bulk operation, one per replica write
/// of a batch).
pub fn decode_answer(request: &PeerRequest, kind: u8, payload: &[u8]) -> Result<PeerAnswer, CallError> {
    let broken = |why: &str| CallError::Broken(format!("{why} answer on a peer link"));
    if kind != ANSWER {
        return Err(broken("an unknown"));
    }
    let answer = read::<Result<PeerAnswer, CallError>>(payload).map_err(|_| broken("an unreadable"))??;
    let fits = match (request, &answer) {
        (PeerRequest::BulkGet { keys, .. }, PeerAnswer::BulkGot(items)) => keys.len() == items.len(),
        (PeerRequest::BulkPut { items, .. }, PeerAnswer::BulkPut(results)) => items.len() == results.len(),
        (PeerRequest::BulkDelete { keys, .. }, PeerAnswer::BulkDeleted(results)) => keys.len() == results.len(),
        (PeerRequest::ReplicateBatch(batch), PeerAnswer::ReplicatedBatch(answers)) => batch.len() == answers.len(),
        _ => true,
    };
    if fits {
        Ok(answer)
    } else {
        Err(broken("a miscounted"))
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use bytes::Bytes;
    use proptest::prelude::*;
    use shoal_http_api::types::{GetOk, Page, PutOk, PutOptions, WriteCondition};
    use shoal_http_api::{PutItem, Unavailable};
    use shoal_raft::BucketId;

    use super::*;
    use crate::transport::{Ping, ReplicaAnswer, Replicate};

    fn replicate(bucket: u16, body: &'static [u8]) -> Replicate {
        Replicate {
            bucket: BucketId(bucket),
            from: 7,
            map_version: 41,
            snapshot: bucket % 2 == 0,
            seq: 9,
            body: body.into(),
        }
    }

    fn item(key: &str, value: &'static [u8]) -> PutItem {
        let options = PutOptions {
            ttl: Some(Duration::from_millis(1500)),
            sliding: None,
            tags: vec!["a".into(), "ü".into()],
            condition: WriteCondition::Version(3),
            priority: shoal_http_api::types::Priority::High,
        };
        PutItem { key: key.into(), value: Bytes::from_static(value), options }
    }

    /// One request of every kind that travels on links, with the fields that can be odd.
    fn requests() -> Vec<PeerRequest> {
        vec![
            PeerRequest::Replicate(replicate(999, b"\0framed\xff")),
            PeerRequest::ReplicateBatch(vec![replicate(0, b"a"), replicate(12, &[0u8; 300])]),
            PeerRequest::Shadow { bucket: BucketId(5), body: Bytes::from_static(b"framed") },
            PeerRequest::GiveBack { from: 3, bucket: BucketId(6), body: Bytes::new() },
            PeerRequest::Ping(Ping { from: 3, pfail: vec![1, 2], incarnation: 77, replica: None }),
            PeerRequest::TransferStatus,
            PeerRequest::Get { key: "k".into(), map_version: 4, mirror: Some(Duration::from_millis(250)) },
            PeerRequest::Put { item: item("k", b"v\0"), map_version: 4 },
            PeerRequest::Delete { key: "k".into(), cas: Some(0), map_version: 4 },
            PeerRequest::BulkGet { keys: vec!["a".into(), String::new()], map_version: 4, mirror: None },
            PeerRequest::BulkPut { items: vec![item("a", b""), item("b", &[1u8; 70_000])], map_version: 4 },
            PeerRequest::BulkDelete { keys: vec!["a".into()], map_version: 4 },
            PeerRequest::Keys { prefix: "p".into(), page: Page { limit: 10, start_after: Some("x".into()) } },
            PeerRequest::RemoveTagged { tag: "t".into() },
            PeerRequest::NodeStats,
            PeerRequest::EnterMaintenance { period: Duration::from_secs(90) },
        ]
    }

    fn decode_bytes(kind: u8, bytes: &[u8]) -> Result<(PeerRequest, Option<u64>), Malformed> {
        decode_request(kind, &Bytes::copy_from_slice(bytes))
    }

    fn encoded(request: &PeerRequest, deadline_ms: Option<u64>) -> Vec<u8> {
        let mut out = Vec::new();
        encode_request(request, deadline_ms, &mut out).expect("encodes");
        out
    }

    #[test]
    fn every_request_reads_back_as_sent_in_the_kind_of_its_own() {
        for request in requests() {
            let kind = kind_of(&request);
            let (read, deadline) = decode_bytes(kind, &encoded(&request, Some(12))).expect("reads back");
            assert_eq!((format!("{read:?}"), deadline), (format!("{request:?}"), Some(12)));
            for other in [REPLICATE, READ, WRITE, CALL].into_iter().filter(|k| *k != kind) {
                assert_eq!(decode_bytes(other, &encoded(&request, None)).err(), Some(Malformed::Kind(other)));
            }
        }
        let forwards: Vec<u8> = requests().iter().map(kind_of).filter(|k| k & FORWARD != 0).collect();
        assert_eq!(forwards, [READ, WRITE, WRITE, READ, WRITE, WRITE]);
    }

    #[test]
    fn answers_and_errors_read_back_as_the_receiver_gave_them() {
        let found = GetOk { value: Bytes::from_static(b"v"), version: 9, bucket: 321, node: 2, lag_ms: Some(0) };
        let moving = ApiError::Unavailable {
            code: Unavailable::BucketMoving,
            detail: "bucket 321 is moving".into(),
            retry_after: Duration::from_secs(3),
        };
        let stale = ApiError::PreconditionFailed { current_version: Some(3) };
        let keys = |n: usize| (0..n).map(|i| format!("k{i}")).collect::<Vec<_>>();
        let bulk_get = PeerRequest::BulkGet { keys: keys(3), map_version: 1, mirror: None };
        let bulk_put = PeerRequest::BulkPut { items: vec![item("a", b""), item("b", b"")], map_version: 1 };
        let batch = PeerRequest::ReplicateBatch(vec![replicate(1, b""), replicate(2, b"")]);
        let put_ok = |key: &str| PutOk { key: key.into(), version: 4, bucket: 1, node: 2 };
        let answers: Vec<(PeerRequest, Result<PeerAnswer, CallError>)> = vec![
            (bulk_get, Ok(PeerAnswer::BulkGot(vec![Ok(Some(found.clone())), Ok(None), Err(moving.clone())]))),
            (PeerRequest::NodeStats, Ok(PeerAnswer::Got(GetOk { lag_ms: None, ..found }))),
            (PeerRequest::NodeStats, Ok(PeerAnswer::Put(put_ok("k")))),
            (bulk_put, Ok(PeerAnswer::BulkPut(vec![Ok(put_ok("a")), Err(stale.clone())]))),
            (
                batch,
                Ok(PeerAnswer::ReplicatedBatch(vec![
                    ReplicaAnswer::Applied,
                    ReplicaAnswer::Fenced { map_version: 77, reason: "not the owner".into() },
                ])),
            ),
            (PeerRequest::NodeStats, Err(CallError::Api(moving))),
            (PeerRequest::NodeStats, Err(CallError::Api(stale))),
            (PeerRequest::NodeStats, Err(CallError::Api(ApiError::NotFound))),
            (PeerRequest::NodeStats, Err(CallError::Refused { status: 409, reason: "busy".into() })),
        ];
        for (request, answer) in answers {
            let read = decode_answer(&request, ANSWER, &encode_answer(answer.clone()));
            assert_eq!(format!("{read:?}"), format!("{answer:?}"));
        }
        // The answers of calls carry the API's view types, absent fields left out (as JSON).
        let listing = shoal_http_api::types::KeyList {
            keys: Vec::new(),
            more: false,
            next: None,
            incomplete: false,
            errors: Vec::new(),
        };
        let read = decode_answer(&PeerRequest::NodeStats, ANSWER, &encode_answer(Ok(PeerAnswer::Keys(listing))));
        assert!(matches!(&read, Ok(PeerAnswer::Keys(k)) if k.next.is_none() && !k.more), "{read:?}");
    }

    #[test]
    fn what_went_wrong_at_the_receivers_own_calls_comes_back_as_a_refusal() {
        for e in [CallError::Unreachable("node 3".into()), CallError::Timeout, CallError::Broken("cut".into())] {
            let read = decode_answer(&PeerRequest::NodeStats, ANSWER, &encode_answer(Err(e)));
            assert!(matches!(read, Err(CallError::Refused { status: 503, .. })), "{read:?}");
        }
    }

    #[test]
    fn a_bucket_that_does_not_exist_or_a_miscounted_answer_is_refused() {
        for request in [
            PeerRequest::Replicate(replicate(1000, b"")),
            PeerRequest::ReplicateBatch(vec![replicate(1, b""), replicate(1000, b"")]),
            PeerRequest::Shadow { bucket: BucketId(1000), body: Bytes::new() },
        ] {
            let read = decode_bytes(kind_of(&request), &encoded(&request, None));
            assert_eq!(read.err(), Some(Malformed::NoSuchBucket(1000)));
        }
        let bulk = PeerRequest::BulkDelete { keys: vec!["a".into(), "b".into()], map_version: 1 };
        let short = encode_answer(Ok(PeerAnswer::BulkDeleted(vec![Ok(true)])));
        assert!(matches!(decode_answer(&bulk, ANSWER, &short), Err(CallError::Broken(_))));
        assert!(matches!(decode_answer(&bulk, CALL, &short), Err(CallError::Broken(_))));
    }

    #[test]
    fn bucket_data_is_read_as_a_slice_of_its_message_and_copied_out_of_anything_else() {
        let within = |body: &Bytes, message: &Bytes| {
            let start = message.as_ptr() as usize;
            (start..start + message.len()).contains(&(body.as_ptr() as usize))
        };
        let batch = PeerRequest::ReplicateBatch(vec![replicate(1, b"first"), replicate(2, b"second")]);
        for request in [batch, PeerRequest::Shadow { bucket: BucketId(5), body: Bytes::from_static(b"framed") }] {
            let message = Bytes::from(encoded(&request, None));
            let (read, _) = decode_request(kind_of(&request), &message).expect("reads");
            assert_eq!(format!("{read:?}"), format!("{request:?}"));
            let bodies = match &read {
                PeerRequest::ReplicateBatch(batch) => batch.iter().map(|r| r.body.clone()).collect(),
                PeerRequest::Shadow { body, .. } => vec![body.clone()],
                _ => vec![],
            };
            assert!(!bodies.is_empty() && bodies.iter().all(|b| within(b, &message)), "{read:?}");
        }
        let request = PeerRequest::GiveBack { from: 3, bucket: BucketId(6), body: Bytes::from_static(b"items") };
        let read: (Option<u64>, PeerRequest) = read_plain(&encoded(&request, None));
        assert_eq!(format!("{:?}", read.1), format!("{request:?}"), "read outside decode_request: copied");
    }

    fn read_plain(bytes: &[u8]) -> (Option<u64>, PeerRequest) {
        let Incoming { deadline_ms, request } = read(bytes).expect("reads");
        (deadline_ms, request)
    }

    #[test]
    fn every_cut_of_a_message_is_refused() {
        for request in requests() {
            let whole = encoded(&request, Some(1));
            for cut in 0..whole.len() {
                assert!(decode_bytes(kind_of(&request), &whole[..cut]).is_err(), "{request:?} cut at {cut}");
            }
        }
    }

    proptest! {
        /// Garbage is refused, never a panic, whatever its lengths and counts say.
        #[test]
        fn any_bytes_are_a_message_or_refused(kind in any::<u8>(), bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
            let _ = decode_bytes(kind, &bytes);
            let _ = decode_answer(&PeerRequest::NodeStats, ANSWER, &bytes);
        }

        /// A valid message with bytes changed is still only read or refused.
        #[test]
        fn a_changed_message_is_read_or_refused(which in 0usize..16, at in any::<prop::sample::Index>(), byte in any::<u8>()) {
            let request = &requests()[which];
            let mut bytes = encoded(request, Some(5));
            let at = at.index(bytes.len());
            bytes[at] = byte;
            let _ = decode_bytes(kind_of(request), &bytes);
        }
    }
}
