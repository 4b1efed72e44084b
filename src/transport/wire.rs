//! The wire format of every request and answer on a peer link (`transport::link`), and the
//! registry of the messages that travel on it ([`id`]) and of their handlers ([`Handlers`]).
//!
//! One format for all of them: serde's data model written by `bincode` (fixed-width integers,
//! lengths before sequences and bytes, variants by index). A request travels as a header (its
//! endpoint's number, one byte, then its sender's deadline in Unix milliseconds, eight bytes
//! little-endian, 0 for none) and its body, in a link message whose kind says how the link
//! treats it ([`Endpoint::KIND`]); the answer as `Result<E::Answer, CallError>` in an
//! [`ANSWER`]. Bucket data inside a message (replica writes, shadows, give-backs) is framed
//! bytes (`transport::frame`) carried as one binary field; an API error travels as its problem
//! document (JSON) and retry-after, and the API's view types (listings, figures, maintenance,
//! buckets, balancing plans) as their JSON ([`Json`]), since those leave absent fields out. A
//! format without field names reads a field left out in the wrong place: a type that travels
//! here must not skip fields when it serializes (`skip_serializing_if`) unless it travels as
//! JSON.
//!
//! Bounds: the link bounds a message's size (`link::MAX_MESSAGE`); inside it, every length is
//! checked against what is left before anything is taken, a sequence's announced length never
//! sizes an allocation beyond what serde caps, and no type that travels nests itself. A message
//! that does not decode, names an endpoint nobody registered or a bucket that does not exist,
//! or came in a kind not its own is refused whole (nothing of it is done; the link closes).

use std::future::Future;

use bytes::Bytes;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use shoal_http_api::{ApiError, Unavailable};

use super::link::{Handling, CANCELLABLE, FORWARD};
use super::{CallError, Endpoint, Malformed, Outgoing};

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

/// The registry: every message between nodes by its number on the wire (its
/// [`Endpoint::ID`]); the type is declared by the module that owns it, named here.
pub mod id {
    /// `replication::Replicate`.
    pub const REPLICATE: u8 = 1;
    /// `replication::ReplicateBatch`.
    pub const REPLICATE_BATCH: u8 = 2;
    /// `transfer::shadow::ShadowWrites`.
    pub const SHADOW: u8 = 3;
    /// `transfer::found::GiveBack`.
    pub const GIVE_BACK: u8 = 4;
    /// `health::Ping`.
    pub const PING: u8 = 5;
    /// `transfer::progress::AskProgress`.
    pub const TRANSFER_STATUS: u8 = 6;
    /// `api::forward::Get`.
    pub const GET: u8 = 7;
    /// `api::forward::Put`.
    pub const PUT: u8 = 8;
    /// `api::forward::Delete`.
    pub const DELETE: u8 = 9;
    /// `api::forward::BulkGet`.
    pub const BULK_GET: u8 = 10;
    /// `api::forward::BulkPut`.
    pub const BULK_PUT: u8 = 11;
    /// `api::forward::BulkDelete`.
    pub const BULK_DELETE: u8 = 12;
    /// `api::keyless::Keys`.
    pub const KEYS: u8 = 13;
    /// `api::keyless::Tagged`.
    pub const TAGGED: u8 = 14;
    /// `api::keyless::RemoveTagged`.
    pub const REMOVE_TAGGED: u8 = 15;
    /// `api::admin::AskNodeStats`.
    pub const NODE_STATS: u8 = 16;
    /// `api::admin::EnterMaintenance`.
    pub const ENTER_MAINTENANCE: u8 = 17;
    /// `balance::ReportBuckets`.
    pub const REPORT_BUCKETS: u8 = 18;
    /// `balance::AskBuckets`.
    pub const BUCKETS: u8 = 19;
    /// `balance::Rebalance`.
    pub const REBALANCE: u8 = 20;
    /// `mirror::Probe`.
    pub const PROBE: u8 = 21;
}

/// The header's size: the endpoint's number and the deadline.
const HEADER: usize = 9;

/// Writes `request` after its header, as a transport sends it: the deadline (Unix ms) only
/// on a forward ([`FORWARD`] in its kind).
pub fn write_request(out: &mut Vec<u8>, request: &Outgoing<'_>, deadline_ms: Option<u64>) -> Result<(), CallError> {
    let start = out.len();
    out.push(request.id);
    out.extend_from_slice(&deadline_ms.unwrap_or(0).to_le_bytes());
    (request.body)(out).inspect_err(|_| out.truncate(start))
}

/// Writes a request's body ([`Outgoing::body`]).
pub fn encode_body<E: Serialize>(request: &E, out: &mut Vec<u8>) -> Result<(), CallError> {
    write(out, request).map_err(|e| CallError::Broken(format!("a request that cannot be sent: {e}")))
}

/// Whether a request of `kind` carries its sender's deadline.
pub fn has_deadline(kind: u8) -> bool {
    kind & FORWARD != 0
}

type Serve = Box<dyn Fn(Bytes, bool) -> Result<Handling, Malformed> + Send + Sync>;

/// The handlers of the messages a node answers, each registered by the module that owns its
/// message ([`Self::add`]); [`Self::serve`] reads a message and starts its handler.
pub struct Handlers {
    table: Vec<Option<(u8, Serve)>>,
}

impl Default for Handlers {
    fn default() -> Self {
        Handlers { table: (0..=u8::MAX).map(|_| None).collect() }
    }
}

impl Handlers {
    /// Registers `handle` as the answer to `E`. It does its work in the future it returns,
    /// which runs only when the request is served (not for one that came too late).
    ///
    /// # Panics
    /// If `E`'s number is taken: two endpoints with one number are a bug of the registry.
    pub fn add<E, F, Fut>(&mut self, handle: F)
    where
        E: Endpoint,
        F: Fn(E) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<E::Answer, CallError>> + Send + 'static,
    {
        let slot = &mut self.table[usize::from(E::ID)];
        assert!(slot.is_none(), "two endpoints numbered {}", E::ID);
        let serve: Serve = Box::new(move |body, late| {
            let request = decode_body::<E>(&body)?;
            if late {
                let expired = ApiError::unavailable(
                    Unavailable::Expired,
                    "the forwarded request arrived after its deadline; nothing was done",
                );
                return Ok(Box::pin(async move { (ANSWER, encode_answer::<E::Answer>(Err(CallError::Api(expired)))) }));
            }
            let answer = handle(request);
            Ok(Box::pin(async move { (ANSWER, encode_answer(answer.await)) }))
        });
        *slot = Some((E::KIND, serve));
    }

    /// Registers `handle` as the answer to `E`, given a clone of `state` with each request.
    pub fn add_with<S, E, F, Fut>(&mut self, state: &S, handle: F)
    where
        S: Clone + Send + Sync + 'static,
        E: Endpoint,
        F: Fn(S, E) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<E::Answer, CallError>> + Send + 'static,
    {
        let state = state.clone();
        self.add(move |request| handle(state.clone(), request));
    }

    /// Reads a request that came in a link message of `kind` and starts its handler; a request
    /// whose deadline has passed by `now_ms` (Unix ms, by the receiver's clock) is answered
    /// `expired` and not handled. Why it does not read, otherwise: the link then closes.
    pub fn serve(&self, kind: u8, payload: &Bytes, now_ms: u64) -> Result<Handling, Malformed> {
        let (Some(&id), Some(deadline)) = (payload.first(), payload.get(1..HEADER)) else {
            return Err(Malformed::Unreadable("shorter than its header".into()));
        };
        let deadline = u64::from_le_bytes(deadline.try_into().unwrap_or_default());
        let Some((own, serve)) = &self.table[usize::from(id)] else { return Err(Malformed::Unknown(id)) };
        if *own != kind {
            return Err(Malformed::Kind(kind));
        }
        serve(payload.slice(HEADER..), deadline != 0 && now_ms > deadline)
    }
}

/// Refuses a request for a bucket that does not exist ([`Endpoint::check`]).
pub fn check_bucket(bucket: shoal_raft::BucketId) -> Result<(), Malformed> {
    if usize::from(bucket.0) < shoal_raft::BUCKET_COUNT {
        Ok(())
    } else {
        Err(Malformed::NoSuchBucket(bucket.0))
    }
}

/// Reads a request's body, and checks it ([`Endpoint::check`]).
fn decode_body<E: Endpoint>(body: &Bytes) -> Result<E, Malformed> {
    // Only requests with bucket data (replica writes, shadows, give-backs) read it as a slice
    // of the message: the others do not pay for the message's handle.
    if E::CARRIES_DATA {
        MESSAGE.with_borrow_mut(|m| *m = Some(body.clone()));
    }
    let read = read::<E>(body);
    if E::CARRIES_DATA {
        MESSAGE.with_borrow_mut(|m| *m = None);
    }
    let request = read.map_err(|e| Malformed::Unreadable(e.to_string()))?;
    request.check()?;
    Ok(request)
}

/// The link options of bincode: fixed-width integers, and no length beyond a link message.
fn options() -> impl bincode::Options + Copy {
    use bincode::Options;
    bincode::DefaultOptions::new().with_fixint_encoding()
}

fn write<T: Serialize>(out: &mut Vec<u8>, value: &T) -> bincode::Result<()> {
    bincode::Options::serialize_into(options(), out, value)
}

fn read<'a, T: Deserialize<'a>>(bytes: &'a [u8]) -> bincode::Result<T> {
    use bincode::Options;
    options().with_limit(super::link::MAX_MESSAGE as u64).deserialize(bytes)
}

thread_local! {
    /// The message [`decode_body`] reads, while it reads it ([`shared`]).
    static MESSAGE: std::cell::RefCell<Option<Bytes>> = const { std::cell::RefCell::new(None) };
}

/// A field of bucket data (`#[serde(deserialize_with = "wire::shared::deserialize")]`): read
/// by [`Handlers::serve`], it is a slice of the link message it came in, so a replica
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

/// A value that travels as its JSON: the API's view types, which leave absent fields out.
#[derive(Debug, Clone, PartialEq)]
pub struct Json<T>(pub T);

impl<T: Serialize> Serialize for Json<T> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::Error as _;
        s.serialize_bytes(&serde_json::to_vec(&self.0).map_err(S::Error::custom)?)
    }
}

impl<'de, T: DeserializeOwned> Deserialize<'de> for Json<T> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        use serde::de::Error as _;
        serde_json::from_slice(<&[u8]>::deserialize(d)?).map(Json).map_err(D::Error::custom)
    }
}

/// An answer as it travels: what went wrong at the receiver's own calls (unreachable, timed
/// out, broken) as a refusal with 503, an internal error logged once; an answer that cannot be
/// sent (larger than a link message) as a refusal with 500.
pub fn encode_answer<A: Serialize>(answer: Result<A, CallError>) -> Vec<u8> {
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
        let refused: Result<(), _> =
            Err(CallError::Refused { status: 500, reason: format!("an answer that cannot be sent: {why}") });
        let _ = write(&mut out, &refused);
    }
    out
}

/// Reads the answer to `request`: what its handler answered, or broken when it does not read
/// or does not fit the request ([`Endpoint::fits`]).
pub fn decode_answer<E: Endpoint>(request: &E, payload: &[u8]) -> Result<E::Answer, CallError> {
    let broken = |why: &str| CallError::Broken(format!("{why} answer from a peer"));
    let answer = read::<Result<E::Answer, CallError>>(payload).map_err(|_| broken("an unreadable"))??;
    if request.fits(&answer) {
        Ok(answer)
    } else {
        Err(broken("a miscounted"))
    }
}

#[cfg(test)]
mod tests {
    use std::fmt::Debug;
    use std::time::Duration;

    use bytes::Bytes;
    use futures::executor::block_on;
    use proptest::prelude::*;
    use shoal_http_api::types::{
        BucketSort, BucketsQuery, GetOk, KeyList, Page, PutOk, PutOptions, RebalanceRequest, WriteCondition,
    };
    use shoal_http_api::PutItem;
    use shoal_raft::BucketId;

    use super::*;
    use crate::api::admin::{AskNodeStats, EnterMaintenance};
    use crate::api::forward::{BulkDelete, BulkGet, BulkPut, Delete, Get, Put};
    use crate::api::keyless::{Keys, RemoveTagged, Tagged};
    use crate::balance::{AskBuckets, BucketReport, Rebalance, ReportedBucket};
    use crate::health::Ping;
    use crate::replication::{ReplicaAnswer, Replicate, ReplicateBatch};
    use crate::transfer::found::GiveBack;
    use crate::transfer::progress::AskProgress;
    use crate::transfer::shadow::ShadowWrites;

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

    /// A request as it travels: its kind, its message (header and body), how it shows.
    struct Sample {
        kind: u8,
        message: Vec<u8>,
        shown: String,
    }

    fn message<E: Endpoint>(request: &E, deadline_ms: Option<u64>) -> Vec<u8> {
        let body = |out: &mut Vec<u8>| encode_body(request, out);
        let mut out = Vec::new();
        write_request(&mut out, &Outgoing { id: E::ID, kind: E::KIND, body: &body }, deadline_ms).expect("encodes");
        out
    }

    fn sample<E: Endpoint + Debug>(request: E) -> Sample {
        Sample { kind: E::KIND, message: message(&request, None), shown: format!("{request:?}") }
    }

    /// One request of every endpoint.
    fn samples() -> Vec<Sample> {
        let page = Page { limit: 10, start_after: Some("x".into()) };
        let report = BucketReport {
            node: 2,
            map_version: 9,
            buckets: vec![ReportedBucket { bucket: 3, items: 4, bytes: 5, reads_per_sec: 0.5, writes_per_sec: 1.5 }],
            transfer_rate: Some(1e6),
            pending: 1,
        };
        vec![
            sample(replicate(999, b"\0framed\xff")),
            sample(ReplicateBatch(vec![replicate(0, b"a"), replicate(12, &[0u8; 300])])),
            sample(ShadowWrites { bucket: BucketId(5), body: Bytes::from_static(b"framed") }),
            sample(GiveBack { from: 3, bucket: BucketId(6), body: Bytes::new() }),
            sample(Ping { from: 3, pfail: vec![1, 2], incarnation: 77, replica: None }),
            sample(AskProgress),
            sample(Get { key: "k".into(), map_version: 4, mirror: Some(Duration::from_millis(250)) }),
            sample(Put { item: item("k", b"v\0"), map_version: 4 }),
            sample(Delete { key: "k".into(), cas: Some(0), map_version: 4 }),
            sample(BulkGet { keys: vec!["a".into(), String::new()], map_version: 4, mirror: None }),
            sample(BulkPut { items: vec![item("a", b""), item("b", &[1u8; 70_000])], map_version: 4 }),
            sample(BulkDelete { keys: vec!["a".into()], map_version: 4 }),
            sample(Keys { prefix: "p".into(), page: page.clone() }),
            sample(Tagged { tag: "t".into(), page }),
            sample(RemoveTagged { tag: "t".into() }),
            sample(AskNodeStats),
            sample(EnterMaintenance { period: Duration::from_secs(90) }),
            sample(report),
            sample(AskBuckets(BucketsQuery { sort: BucketSort::Bytes, limit: 20, node: Some(3) })),
            sample(Rebalance(RebalanceRequest { node: None, dry_run: true })),
            sample(crate::mirror::Probe),
        ]
    }

    /// A handler that answers every request with a refusal that shows it.
    fn echo<E: Endpoint + Debug>(handlers: &mut Handlers) {
        handlers.add(|request: E| async move {
            Err::<E::Answer, _>(CallError::Refused { status: 418, reason: format!("{request:?}") })
        });
    }

    /// Every endpoint, echoed.
    fn echoing() -> Handlers {
        let mut h = Handlers::default();
        echo::<Replicate>(&mut h);
        echo::<ReplicateBatch>(&mut h);
        echo::<ShadowWrites>(&mut h);
        echo::<GiveBack>(&mut h);
        echo::<Ping>(&mut h);
        echo::<AskProgress>(&mut h);
        echo::<Get>(&mut h);
        echo::<Put>(&mut h);
        echo::<Delete>(&mut h);
        echo::<BulkGet>(&mut h);
        echo::<BulkPut>(&mut h);
        echo::<BulkDelete>(&mut h);
        echo::<Keys>(&mut h);
        echo::<Tagged>(&mut h);
        echo::<RemoveTagged>(&mut h);
        echo::<AskNodeStats>(&mut h);
        echo::<EnterMaintenance>(&mut h);
        echo::<BucketReport>(&mut h);
        echo::<AskBuckets>(&mut h);
        echo::<Rebalance>(&mut h);
        echo::<crate::mirror::Probe>(&mut h);
        h
    }

    /// What `handlers` answer a message (as the refusal's reason, or the error's code), or why
    /// it does not read.
    fn served(handlers: &Handlers, kind: u8, message: &[u8], now_ms: u64) -> Result<String, Malformed> {
        let (answer_kind, answer) = block_on(handlers.serve(kind, &Bytes::copy_from_slice(message), now_ms)?);
        assert_eq!(answer_kind, ANSWER);
        Ok(match read::<Result<(), CallError>>(&answer).expect("an answer reads") {
            Err(CallError::Refused { reason, .. }) => reason,
            Err(CallError::Api(e)) => e.code().to_string(),
            other => format!("{other:?}"),
        })
    }

    #[test]
    fn every_request_reads_back_as_sent_in_the_kind_of_its_own_and_only_there() {
        let handlers = echoing();
        let all = samples();
        let ids: std::collections::BTreeSet<u8> = all.iter().map(|s| s.message[0]).collect();
        assert_eq!(ids.len(), all.len(), "one sample per endpoint");
        for s in &all {
            assert_eq!(served(&handlers, s.kind, &s.message, 0), Ok(s.shown.clone()));
            for other in [REPLICATE, READ, WRITE, CALL].into_iter().filter(|k| *k != s.kind) {
                assert_eq!(served(&handlers, other, &s.message, 0).err(), Some(Malformed::Kind(other)));
            }
        }
        let forwards: Vec<u8> = all.iter().map(|s| s.kind).filter(|k| has_deadline(*k)).collect();
        assert_eq!(forwards, [READ, WRITE, WRITE, READ, WRITE, WRITE]);
        let mut unknown = all[0].message.clone();
        unknown[0] = 200;
        assert_eq!(served(&handlers, REPLICATE, &unknown, 0).err(), Some(Malformed::Unknown(200)));
    }

    #[test]
    fn a_forward_that_arrives_after_its_deadline_is_answered_expired_and_not_handled() {
        let handlers = echoing();
        let get = Get { key: "k".into(), map_version: 4, mirror: None };
        let late = message(&get, Some(1_000));
        assert_eq!(served(&handlers, READ, &late, 1_000), Ok(format!("{get:?}")), "at its deadline: handled");
        assert_eq!(served(&handlers, READ, &late, 1_001), Ok("expired".into()));
        assert_eq!(served(&handlers, READ, &message(&get, None), u64::MAX), Ok(format!("{get:?}")), "no deadline");
    }

    #[test]
    #[should_panic(expected = "two endpoints numbered")]
    fn two_endpoints_with_one_number_are_refused_at_registration() {
        let mut handlers = echoing();
        echo::<Ping>(&mut handlers);
    }

    #[test]
    fn answers_and_errors_read_back_as_the_receiver_gave_them() {
        fn round<E: Endpoint>(request: &E, answer: Result<E::Answer, CallError>) -> String
        where
            E::Answer: Debug,
        {
            format!("{:?}", decode_answer(request, &encode_answer(answer)))
        }
        let found = GetOk { value: Bytes::from_static(b"v"), version: 9, bucket: 321, node: 2, lag_ms: Some(0) };
        let moving = ApiError::Unavailable {
            code: Unavailable::BucketMoving,
            detail: "bucket 321 is moving".into(),
            retry_after: Duration::from_secs(3),
        };
        let stale = ApiError::PreconditionFailed { current_version: Some(3) };
        let put_ok = |key: &str| PutOk { key: key.into(), version: 4, bucket: 1, node: 2 };
        let get = Get { key: "k".into(), map_version: 1, mirror: None };
        for answer in [Ok(found.clone()), Ok(GetOk { lag_ms: None, ..found.clone() })] {
            assert_eq!(round(&get, answer.clone()), format!("{answer:?}"));
        }
        for e in [moving.clone(), stale.clone(), ApiError::NotFound] {
            let answer: Result<GetOk, _> = Err(CallError::Api(e));
            assert_eq!(round(&get, answer.clone()), format!("{answer:?}"));
        }
        let refused: Result<GetOk, _> = Err(CallError::Refused { status: 409, reason: "busy".into() });
        assert_eq!(round(&get, refused.clone()), format!("{refused:?}"));
        let bulk_put = BulkPut { items: vec![item("a", b""), item("b", b"")], map_version: 1 };
        let results = vec![Ok(put_ok("a")), Err(stale)];
        assert_eq!(round(&bulk_put, Ok(results.clone())), format!("{:?}", Ok::<_, CallError>(results)));
        let batch = ReplicateBatch(vec![replicate(1, b""), replicate(2, b"")]);
        let answers =
            vec![ReplicaAnswer::Applied, ReplicaAnswer::Fenced { map_version: 77, reason: "not the owner".into() }];
        assert_eq!(round(&batch, Ok(answers.clone())), format!("{:?}", Ok::<_, CallError>(answers)));
        // A bulk read's results, one per key, whatever each is.
        let bulk_get = BulkGet { keys: vec!["a".into(), "b".into(), "c".into()], map_version: 1, mirror: None };
        let got = vec![Ok(Some(found)), Ok(None), Err(moving)];
        let read = decode_answer(&bulk_get, &encode_answer(Ok(crate::api::forward::BulkGot::new(got.clone()))));
        assert_eq!(format!("{:?}", read.map(|g| g.results)), format!("{:?}", Ok::<_, CallError>(got)));
        // The API's view types travel as JSON, absent fields left out.
        let listing = KeyList { keys: Vec::new(), more: false, next: None, incomplete: false, errors: Vec::new() };
        let keys = Keys { prefix: String::new(), page: Page::default() };
        let read = decode_answer(&keys, &encode_answer(Ok(Json(listing))));
        assert!(matches!(&read, Ok(Json(k)) if k.next.is_none() && !k.more), "{read:?}");
    }

    #[test]
    fn what_went_wrong_at_the_receivers_own_calls_comes_back_as_a_refusal() {
        for e in [CallError::Unreachable("node 3".into()), CallError::Timeout, CallError::Broken("cut".into())] {
            let read = decode_answer(&AskNodeStats, &encode_answer::<Json<shoal_http_api::types::NodeStats>>(Err(e)));
            assert!(matches!(read, Err(CallError::Refused { status: 503, .. })), "{read:?}");
        }
    }

    #[test]
    fn a_bucket_that_does_not_exist_or_a_miscounted_answer_is_refused() {
        let handlers = echoing();
        for s in [
            sample(replicate(1000, b"")),
            sample(ReplicateBatch(vec![replicate(1, b""), replicate(1000, b"")])),
            sample(ShadowWrites { bucket: BucketId(1000), body: Bytes::new() }),
            sample(GiveBack { from: 1, bucket: BucketId(1000), body: Bytes::new() }),
        ] {
            assert_eq!(served(&handlers, s.kind, &s.message, 0).err(), Some(Malformed::NoSuchBucket(1000)));
        }
        let bulk = BulkDelete { keys: vec!["a".into(), "b".into()], map_version: 1 };
        let short = encode_answer::<Vec<Result<bool, ApiError>>>(Ok(vec![Ok(true)]));
        assert!(matches!(decode_answer(&bulk, &short), Err(CallError::Broken(_))));
    }

    #[test]
    fn bucket_data_is_read_as_a_slice_of_its_message_and_copied_out_of_anything_else() {
        fn within(body: &Bytes, message: &Bytes) -> bool {
            let start = message.as_ptr() as usize;
            (start..start + message.len()).contains(&(body.as_ptr() as usize))
        }
        type Seen = std::sync::Arc<parking_lot::Mutex<Vec<Bytes>>>;
        let seen: Seen = Default::default();
        let mut handlers = Handlers::default();
        let s = seen.clone();
        handlers.add(move |batch: ReplicateBatch| {
            s.lock().extend(batch.0.iter().map(|r| r.body.clone()));
            async { Ok(Vec::new()) }
        });
        let s = seen.clone();
        handlers.add(move |w: ShadowWrites| {
            s.lock().push(w.body);
            async { Ok(()) }
        });
        let batch = ReplicateBatch(vec![replicate(1, b"first"), replicate(2, b"second")]);
        let shadow = ShadowWrites { bucket: BucketId(5), body: Bytes::from_static(b"framed") };
        for (kind, m) in [(REPLICATE, message(&batch, None)), (CALL, message(&shadow, None))] {
            let m = Bytes::from(m);
            drop(handlers.serve(kind, &m, 0).expect("reads"));
            let bodies = std::mem::take(&mut *seen.lock());
            assert!(!bodies.is_empty() && bodies.iter().all(|b| within(b, &m)), "{bodies:?}");
        }
        let give_back = GiveBack { from: 3, bucket: BucketId(6), body: Bytes::from_static(b"items") };
        let m = message(&give_back, None);
        let read: GiveBack = read(&m[HEADER..]).expect("reads");
        assert_eq!(format!("{read:?}"), format!("{give_back:?}"), "read outside a registry: copied");
    }

    #[test]
    fn every_cut_of_a_message_is_refused() {
        let handlers = echoing();
        for s in samples() {
            for cut in 0..s.message.len() {
                assert!(served(&handlers, s.kind, &s.message[..cut], 0).is_err(), "{} cut at {cut}", s.shown);
            }
        }
    }

    proptest! {
        #[test]
        fn any_bytes_are_a_message_or_refused(kind in any::<u8>(), bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
            let _ = served(&echoing(), kind, &bytes, 0);
            let _ = decode_answer(&BulkGet { keys: Vec::new(), map_version: 0, mirror: None }, &bytes);
            let _ = decode_answer(&Keys { prefix: String::new(), page: Page::default() }, &bytes);
        }

        #[test]
        fn a_changed_message_is_read_or_refused(which in 0usize..21, at in any::<prop::sample::Index>(), byte in any::<u8>()) {
            let s = &samples()[which];
            let mut bytes = s.message.clone();
            let at = at.index(bytes.len());
            bytes[at] = byte;
            let _ = served(&echoing(), s.kind, &bytes, 0);
        }

    }
}
