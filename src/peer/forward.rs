//! Forwarded reads to one owner that wait at the same time travel together, unless a peer link
//! to the owner carries them (there each is a message of its own).
//!
//! A node that receives a key operation for a bucket it does not own forwards it to the owner.
//! Under load many clients' reads wait for the same owner at once, and each would be an HTTP
//! exchange of its own; instead each owner has a lane (`transport::lanes`). A lone read goes as
//! the single-key request it always was; several go at once as one bulk get, whose per-key
//! answers are the answers a single request gets: a bulk answer carries each key's status,
//! code, retry-after, current version and map version. A failure of a whole bulk request (the
//! owner unreachable or refusing, a map that moved under it) is every read's failure, and each
//! read's router handles it as it would alone: route again at a newer map, wait for a bucket
//! that is passing, or answer the client.
//!
//! Writes and deletes go alone (see [`KeyOp::shared`]): a forwarded write must be dropped with
//! its caller. The exchange still sends bulk writes and deletes when given them together.
//!
//! Where a peer link to the owner is open and carries reads, reads go alone as well: on a link
//! each read is one small message, the link's writer puts whatever waits into one socket write,
//! and the owner answers it in its link reader, so the lane would only add its sender's task and
//! a bulk request to take apart (about a quarter less server work per forwarded read, counted with
//! callgrind). The lanes then carry what goes over HTTP, and the reads an owner sends back from
//! its link (they share one bulk request, which tries the link first).

use std::sync::Arc;

use shoal_http_api::types::{GetOk, PutOk};
use shoal_http_api::{ApiError, PutItem};
use shoal_raft::NodeId;

use super::api_error;
use crate::transport::http::FORWARD_TIMEOUT;
use crate::transport::lanes::{Exchange, LaneLimits, Lanes};
use crate::transport::{unexpected, Addrs, PeerAnswer, PeerRequest, Transport};

/// Lanes of forwarded operations, per owner API address.
pub(super) type Forwards = Lanes<KeyOps>;

/// Lanes sending through `transport`: two exchanges in flight per owner, 64 operations or
/// 256 KiB of keys and values each.
pub(super) fn forwards(transport: Arc<dyn Transport>) -> Forwards {
    Lanes::new(KeyOps(transport), LaneLimits { senders: 2, items: 64, bytes: 256 << 10 })
}

/// A forwarded operation.
#[derive(Debug, Clone)]
pub(super) enum KeyOp {
    /// Read a key.
    Get(String),
    /// Write an item.
    Put(PutItem),
    /// Delete a key, only at this version when one is given.
    Delete { key: String, cas: Option<u64> },
}

impl KeyOp {
    fn key(&self) -> &str {
        match self {
            KeyOp::Get(key) | KeyOp::Delete { key, .. } => key,
            KeyOp::Put(item) => &item.key,
        }
    }

    /// Whether it may share an exchange with others: only reads. A write or delete goes alone,
    /// as the single-key request, so that it lives only as long as its caller: when the client
    /// gives up (a split, a timeout) and its request is dropped, the forward is dropped with it
    /// and cannot land later, after the client wrote a newer value. In a shared exchange it
    /// travelled on with the others and was applied late (fault test
    /// `a_majorities_ring_loses_nothing_and_reads_never_go_back`: old values came back). On a
    /// peer link it is a message of its own, cancelled at the owner when its caller gives up.
    fn shared(&self) -> bool {
        match self {
            KeyOp::Get(_) => true,
            KeyOp::Put(_) | KeyOp::Delete { .. } => false,
        }
    }
}

/// A forwarded operation with where it goes: the owner the sender's map (at `map_version`)
/// names, whose peer listener is at `peer_addr` (reads go over the link to it when one is
/// open; the lane is the owner's API address).
#[derive(Debug, Clone)]
pub(super) struct Forwarded {
    pub op: KeyOp,
    pub owner: NodeId,
    pub map_version: u64,
    pub peer_addr: String,
}

/// What the owner did.
#[derive(Debug, Clone)]
pub(super) enum KeyDone {
    /// The value, or `None`: the key does not exist.
    Got(Option<GetOk>),
    /// The write done.
    Put(PutOk),
    /// Whether the key existed.
    Deleted(bool),
}

/// Sends forwarded operations to owners' API addresses.
pub(super) struct KeyOps(Arc<dyn Transport>);

type Answer = Result<KeyDone, ApiError>;

/// Sends `f` to the owner at `addr`: through its lane when it may share an exchange, else alone.
/// A read goes alone on the link to the owner when one carries reads: on a link each is one
/// small message, the link's writer puts whatever waits into one write, and the owner answers
/// it in its link reader; the lane would only add its sender's task and a bulk request to take
/// apart. A read the owner sends back from its link (it was serving as many forwarded link
/// requests as it takes, or the read is beyond its limits or a link's) goes through the lane
/// after all, where reads waiting together share one request, rather than over HTTP alone, the
/// costliest way.
pub(super) async fn forward(forwards: &Forwards, addr: &str, f: Forwarded) -> Answer {
    if !f.op.shared() {
        return forwards.exchange().alone(addr, f).await;
    }
    let f = if forwards.exchange().0.reads_on_link(&f.peer_addr) {
        match forwards.exchange().get_on_link(addr, f).await {
            Ok(answer) => return answer,
            Err(f) => f,
        }
    } else {
        f
    };
    forwards.send(addr, f).await
}

/// What a single read's answer says.
fn got(addr: &str, answer: Result<PeerAnswer, ApiError>) -> Answer {
    match answer {
        Ok(PeerAnswer::Got(ok)) => Ok(KeyDone::Got(Some(ok))),
        Err(ApiError::NotFound) => Ok(KeyDone::Got(None)),
        Ok(other) => Err(api_error(addr, unexpected(&other))),
        Err(e) => Err(e),
    }
}

impl KeyOps {
    async fn call(&self, addr: &str, request: PeerRequest) -> Result<PeerAnswer, ApiError> {
        self.0.call(addr, request, FORWARD_TIMEOUT).await.map_err(|e| api_error(addr, e))
    }

    /// A key operation (`Get`, `BulkGet`, `Put`, `Delete`) to the owner at API address `addr`
    /// and `peer_addr`: over the link to it when one is open.
    async fn send(&self, addr: &str, peer_addr: String, request: PeerRequest) -> Result<PeerAnswer, ApiError> {
        let to = Addrs { api: addr.to_string(), peer: peer_addr };
        self.0.key_op(to, request, FORWARD_TIMEOUT).await.map_err(|e| api_error(addr, e))
    }

    /// A read alone on the link to its owner ([`Transport::get_on_link`]); `Err(f)` when it
    /// did not go there or came back.
    async fn get_on_link(&self, addr: &str, f: Forwarded) -> Result<Answer, Forwarded> {
        let key = match f.op {
            KeyOp::Get(key) => key,
            op => return Err(Forwarded { op, ..f }),
        };
        match self.0.get_on_link(&f.peer_addr, key, f.map_version, FORWARD_TIMEOUT).await {
            Ok(answer) => Ok(got(addr, answer.map_err(|e| api_error(addr, e)))),
            Err(key) => Err(Forwarded { op: KeyOp::Get(key), ..f }),
        }
    }

    /// One operation alone, as the single-key request.
    async fn alone(&self, addr: &str, f: Forwarded) -> Answer {
        let map_version = f.map_version;
        let answer = match f.op {
            KeyOp::Get(key) => {
                return got(
                    addr,
                    self.send(addr, f.peer_addr, PeerRequest::Get { key, map_version, mirror: None }).await,
                );
            }
            KeyOp::Put(item) => match self.send(addr, f.peer_addr, PeerRequest::Put { item, map_version }).await {
                Ok(PeerAnswer::Put(ok)) => return Ok(KeyDone::Put(ok)),
                other => other,
            },
            KeyOp::Delete { key, cas } => {
                match self.send(addr, f.peer_addr, PeerRequest::Delete { key, cas, map_version }).await {
                    Ok(PeerAnswer::Deleted) => return Ok(KeyDone::Deleted(true)),
                    Err(ApiError::NotFound) => return Ok(KeyDone::Deleted(false)),
                    other => other,
                }
            }
        };
        Err(answer.map_or_else(|e| e, |other| api_error(addr, unexpected(&other))))
    }

    /// Several operations of one kind in one bulk request: one answer per operation, in order.
    /// A bulk request refused for being one (too many keys for the owner's limit, values too
    /// large to answer together) is sent again as single requests.
    async fn together(&self, addr: &str, ops: Vec<Forwarded>) -> Vec<Answer> {
        let n = ops.len();
        let map_version = ops.iter().map(|f| f.map_version).max().unwrap_or(0);
        let keys = || ops.iter().map(|f| f.op.key().to_string()).collect();
        let request = match &ops[0].op {
            KeyOp::Get(_) => PeerRequest::BulkGet { keys: keys(), map_version, mirror: None },
            KeyOp::Put(_) => {
                let items = ops
                    .iter()
                    .filter_map(|f| match &f.op {
                        KeyOp::Put(item) => Some(item.clone()),
                        _ => None,
                    })
                    .collect();
                PeerRequest::BulkPut { items, map_version }
            }
            KeyOp::Delete { .. } => PeerRequest::BulkDelete { keys: keys(), map_version },
        };
        let owner = |i: usize| ops[i].owner;
        let sent = match request {
            PeerRequest::BulkGet { .. } => self.send(addr, ops[0].peer_addr.clone(), request).await,
            other => self.call(addr, other).await,
        };
        let done: Vec<Answer> = match sent {
            Ok(PeerAnswer::BulkGot(results)) => results
                .into_iter()
                .enumerate()
                .map(|(i, r)| r.map(|found| KeyDone::Got(found.map(|ok| GetOk { node: owner(i), ..ok }))))
                .collect(),
            Ok(PeerAnswer::BulkPut(results)) => results
                .into_iter()
                .enumerate()
                .map(|(i, r)| r.map(|ok| KeyDone::Put(PutOk { node: owner(i), ..ok })))
                .collect(),
            Ok(PeerAnswer::BulkDeleted(results)) => results.into_iter().map(|r| r.map(KeyDone::Deleted)).collect(),
            Ok(other) => vec![Err(api_error(addr, unexpected(&other))); n],
            Err(ApiError::BadRequest(_) | ApiError::ValueTooLarge { .. } | ApiError::AnswerTooLarge { .. }) => {
                return futures::future::join_all(ops.into_iter().map(|f| self.alone(addr, f))).await;
            }
            Err(e) => vec![Err(e); n],
        };
        if done.len() == n {
            done
        } else {
            vec![Err(ApiError::Internal("a peer answered a bulk request with the wrong count".into())); n]
        }
    }
}

impl Exchange for KeyOps {
    type Item = Forwarded;
    type Answer = Answer;

    fn size(f: &Forwarded) -> usize {
        match &f.op {
            KeyOp::Get(key) | KeyOp::Delete { key, .. } => key.len(),
            KeyOp::Put(item) => item.key.len() + item.value.len(),
        }
    }

    /// A lone operation alone; several as one bulk request per kind (reads, writes, deletes),
    /// all at once.
    async fn send(&self, addr: &str, ops: Vec<Forwarded>) -> Vec<Answer> {
        let n = ops.len();
        let mut kinds: [(Vec<usize>, Vec<Forwarded>); 3] = Default::default();
        for (i, f) in ops.into_iter().enumerate() {
            let kind = match f.op {
                KeyOp::Get(_) => 0,
                KeyOp::Put(_) => 1,
                KeyOp::Delete { .. } => 2,
            };
            kinds[kind].0.push(i);
            kinds[kind].1.push(f);
        }
        let sends = kinds.into_iter().filter(|(idx, _)| !idx.is_empty()).map(|(idx, mut ops)| async move {
            let answers = match ops.pop() {
                Some(only) if ops.is_empty() => vec![self.alone(addr, only).await],
                Some(last) => {
                    ops.push(last);
                    self.together(addr, ops).await
                }
                None => Vec::new(),
            };
            (idx, answers)
        });
        let mut answers: Vec<Option<Answer>> = (0..n).map(|_| None).collect();
        for (idx, done) in futures::future::join_all(sends).await {
            for (i, a) in idx.into_iter().zip(done) {
                answers[i] = Some(a);
            }
        }
        answers.into_iter().map(|a| a.unwrap_or_else(Self::dropped)).collect()
    }

    fn dropped() -> Answer {
        Err(ApiError::Internal("a forwarded operation was dropped".into()))
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    use std::time::Duration;

    use bytes::Bytes;
    use shoal_http_api::types::PutOptions;
    use shoal_raft::BoxFuture;

    use super::*;
    use crate::peer::Peers;
    use crate::transport::testing::{peers_of, Answers};
    use crate::transport::CallError;

    const OWNER: NodeId = 7;

    /// An owner whose answer depends on the key's number: a third of the keys are absent, a
    /// third present, a third refused with an error of their own. It answers single and bulk
    /// requests alike (a bulk request of more than `max_keys` is refused whole), after a
    /// millisecond, so that operations pile up meanwhile; or it died.
    #[derive(Default)]
    struct Owner {
        exchanges: AtomicUsize,
        bulk: AtomicUsize,
        largest: AtomicUsize,
        max_keys: AtomicUsize,
        dead: AtomicBool,
        /// Reached on a link that carries reads.
        linked: AtomicBool,
        /// Sends back every read that comes on the link.
        full: AtomicBool,
    }

    fn number(key: &str) -> usize {
        key.trim_start_matches('k').parse().expect("a numbered key")
    }

    fn refused(key: &str) -> ApiError {
        ApiError::ItemTooLarge(format!("{key} is refused"))
    }

    fn got(key: &str) -> Result<Option<GetOk>, ApiError> {
        match number(key) % 3 {
            0 => Ok(None),
            1 => Ok(Some(GetOk {
                value: Bytes::from(format!("value of {key}")),
                version: 5,
                bucket: 1,
                node: 0,
                lag_ms: None,
            })),
            _ => Err(refused(key)),
        }
    }

    fn put(item: &PutItem) -> Result<PutOk, ApiError> {
        match number(&item.key) % 3 {
            2 => Err(refused(&item.key)),
            n => Ok(PutOk { key: item.key.clone(), version: n as u64 + 10, bucket: 1, node: 0 }),
        }
    }

    fn deleted(key: &str) -> Result<bool, ApiError> {
        match number(key) % 3 {
            0 => Ok(false),
            1 => Ok(true),
            _ => Err(refused(key)),
        }
    }

    fn single<T>(r: Result<T, ApiError>, found: impl FnOnce(T) -> Option<PeerAnswer>) -> Result<PeerAnswer, CallError> {
        match r {
            Ok(t) => found(t).ok_or(CallError::Api(ApiError::NotFound)),
            Err(e) => Err(CallError::Api(e)),
        }
    }

    impl Answers for Owner {
        fn answer(&self, request: PeerRequest) -> BoxFuture<'_, Result<PeerAnswer, CallError>> {
            Box::pin(async move {
                self.exchanges.fetch_add(1, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(1)).await;
                if self.dead.load(Ordering::SeqCst) {
                    return Err(CallError::Unreachable("connection refused".into()));
                }
                let keys = match &request {
                    PeerRequest::BulkGet { keys, .. } | PeerRequest::BulkDelete { keys, .. } => keys.len(),
                    PeerRequest::BulkPut { items, .. } => items.len(),
                    _ => 0,
                };
                if keys > 0 {
                    self.bulk.fetch_add(1, Ordering::SeqCst);
                    self.largest.fetch_max(keys, Ordering::SeqCst);
                    let most = self.max_keys.load(Ordering::SeqCst);
                    if most > 0 && keys > most {
                        return Err(CallError::Api(ApiError::BadRequest(format!("more than {most} keys"))));
                    }
                }
                match request {
                    // A single answer names the node that answered (a bulk one does not).
                    PeerRequest::Get { key, .. } => {
                        single(got(&key), |found| found.map(|ok| PeerAnswer::Got(GetOk { node: OWNER, ..ok })))
                    }
                    PeerRequest::Put { item, .. } => {
                        single(put(&item), |ok| Some(PeerAnswer::Put(PutOk { node: OWNER, ..ok })))
                    }
                    PeerRequest::Delete { key, .. } => {
                        single(deleted(&key), |existed| existed.then_some(PeerAnswer::Deleted))
                    }
                    PeerRequest::BulkGet { keys, .. } => Ok(PeerAnswer::BulkGot(keys.iter().map(|k| got(k)).collect())),
                    PeerRequest::BulkPut { items, .. } => Ok(PeerAnswer::BulkPut(items.iter().map(put).collect())),
                    PeerRequest::BulkDelete { keys, .. } => {
                        Ok(PeerAnswer::BulkDeleted(keys.iter().map(|k| deleted(k)).collect()))
                    }
                    other => panic!("unexpected {other:?}"),
                }
            })
        }

        fn reads_on_link(&self) -> bool {
            self.linked.load(Ordering::SeqCst)
        }

        fn sends_link_reads_back(&self) -> bool {
            self.full.load(Ordering::SeqCst)
        }
    }

    /// Where the fake owner is reached (the fake transport answers wherever a call goes).
    fn owner_addrs() -> Addrs {
        Addrs { api: "owner".into(), peer: "owner-peer".into() }
    }

    fn item(key: &str, value_bytes: usize) -> PutItem {
        PutItem { key: key.to_string(), value: Bytes::from(vec![b'x'; value_bytes]), options: PutOptions::default() }
    }

    /// What a forwarded operation on key number `i` answered, in one comparable form: reads,
    /// writes and deletes in turn (`i / 3`), on keys whose own answer differs (`i % 3`).
    async fn operate(peers: &Peers, i: usize) -> Result<String, ApiError> {
        let key = format!("k{i}");
        match (i / 3) % 3 {
            0 => peers.get(&owner_addrs(), OWNER, &key, 4).await.map(|found| format!("{found:?}")),
            1 => peers.put(&owner_addrs(), OWNER, &item(&key, 100), 4).await.map(|ok| format!("{ok:?}")),
            _ => peers.delete(&owner_addrs(), OWNER, &key, None, 4).await.map(|existed| format!("{existed}")),
        }
    }

    fn expected(i: usize) -> Result<String, ApiError> {
        let key = format!("k{i}");
        match (i / 3) % 3 {
            0 => got(&key).map(|found| format!("{:?}", found.map(|ok| GetOk { node: OWNER, ..ok }))),
            1 => put(&item(&key, 100)).map(|ok| format!("{:?}", PutOk { node: OWNER, ..ok })),
            _ => deleted(&key).map(|existed| format!("{existed}")),
        }
    }

    async fn operate_all(peers: &Peers, n: usize) -> Vec<Result<String, ApiError>> {
        futures::future::join_all((0..n).map(|i| operate(peers, i))).await
    }

    /// Runs 450 operations at once through `peers` and checks each one's answer, and that the
    /// 150 reads among them shared a few exchanges (the 300 writes and deletes go alone).
    async fn operate_all_reads_shared(owner: &Owner, peers: &Peers) {
        for (i, got) in operate_all(peers, 450).await.into_iter().enumerate() {
            assert_eq!(got, expected(i), "operation {i}");
        }
        let exchanges = owner.exchanges.load(Ordering::SeqCst);
        assert!(exchanges < 300 + 30, "450 operations in flight at once took {exchanges} exchanges");
        assert!(owner.bulk.load(Ordering::SeqCst) > 0);
        assert!(owner.largest.load(Ordering::SeqCst) <= 64);
        assert!(peers.forwards.idle(), "no sender is left behind");
    }

    #[tokio::test]
    async fn reads_in_flight_together_share_exchanges_and_each_gets_its_own_answer() {
        let owner = Arc::new(Owner::default());
        let peers = peers_of(&owner);
        operate_all_reads_shared(&owner, &peers).await;
        // A lone read goes alone, at once, as the single-key request.
        let (before, bulk) = (owner.exchanges.load(Ordering::SeqCst), owner.bulk.load(Ordering::SeqCst));
        assert_eq!(operate(&peers, 1).await, expected(1));
        assert_eq!(owner.exchanges.load(Ordering::SeqCst), before + 1);
        assert_eq!(owner.bulk.load(Ordering::SeqCst), bulk);
    }

    #[tokio::test]
    async fn reads_to_an_owner_on_a_link_go_alone_and_each_gets_its_own_answer() {
        let owner = Arc::new(Owner { linked: AtomicBool::new(true), ..Owner::default() });
        let peers = peers_of(&owner);
        let answers = operate_all(&peers, 450).await;
        for (i, got) in answers.into_iter().enumerate() {
            assert_eq!(got, expected(i), "operation {i}");
        }
        // On a link each read is a message of its own: no lane, no bulk request.
        assert_eq!(owner.exchanges.load(Ordering::SeqCst), 450);
        assert_eq!(owner.bulk.load(Ordering::SeqCst), 0);
        assert_eq!(peers.forward_exchanges(), 0, "no lane exchange");
    }

    #[tokio::test]
    async fn reads_an_owner_sends_back_from_its_link_share_exchanges_in_the_lane() {
        let owner = Arc::new(Owner { linked: AtomicBool::new(true), full: AtomicBool::new(true), ..Owner::default() });
        let peers = peers_of(&owner);
        // Not 150 reads over HTTP one by one: they share the lane's exchanges.
        operate_all_reads_shared(&owner, &peers).await;
        assert!(peers.forward_exchanges() > 0, "the lane carried them");
    }

    #[tokio::test]
    async fn an_owner_that_dies_fails_every_operation_as_unreachable() {
        let owner = Arc::new(Owner::default());
        let peers = peers_of(&owner);
        owner.dead.store(true, Ordering::SeqCst);
        for (i, answer) in operate_all(&peers, 120).await.into_iter().enumerate() {
            let code = answer.expect_err("the owner is dead").problem().code;
            assert_eq!(code, "owner_unreachable", "operation {i}");
        }
        owner.dead.store(false, Ordering::SeqCst);
        assert_eq!(operate(&peers, 1).await, expected(1), "the lane works again");
    }

    #[tokio::test]
    async fn a_bulk_request_refused_for_its_size_is_sent_again_one_by_one() {
        let owner = Arc::new(Owner::default());
        owner.max_keys.store(3, Ordering::SeqCst);
        let peers = peers_of(&owner);
        for (i, got) in operate_all(&peers, 300).await.into_iter().enumerate() {
            assert_eq!(got, expected(i), "operation {i}");
        }
        assert!(owner.largest.load(Ordering::SeqCst) > 3, "some bulk requests were refused");
    }

    #[tokio::test]
    async fn writes_and_deletes_go_alone_whatever_their_size() {
        let owner = Arc::new(Owner::default());
        let peers = peers_of(&owner);
        let (small, big) = (item("k1", 100), item("k1", 1 << 20));
        let to = owner_addrs();
        let puts = futures::future::join_all(
            (0..20).map(|i| peers.put(&to, OWNER, if i % 2 == 0 { &small } else { &big }, 4)),
        )
        .await;
        assert!(puts.iter().all(|p| p.is_ok()), "{puts:?}");
        let deletes =
            futures::future::join_all((0..20).map(|i| peers.delete(&to, OWNER, "k4", (i % 2 == 0).then_some(3), 4)))
                .await;
        assert!(deletes.iter().all(|d| d == &Ok(true)), "{deletes:?}");
        assert_eq!(owner.bulk.load(Ordering::SeqCst), 0);
        assert_eq!(owner.exchanges.load(Ordering::SeqCst), 40);
    }
}
