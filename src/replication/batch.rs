//! Replica writes to one holder that are in flight at once travel together.
//!
//! An owner writes each bucket under its lock, and a sync write answers the client only once
//! the holder applied it, so under load many writes of different buckets wait for the same
//! holder at once. Each holder has a lane: a write joins the lane's waiting list, and at most
//! [`SENDERS_PER_HOLDER`] exchanges are in flight per holder; a sender takes everything
//! waiting (up to [`MAX_BATCH`]) into one request and hands each write the holder's answer to
//! it. A lone write goes at once, alone (no added wait at low load); under load the batches
//! grow by themselves, one round trip for many writes.
//!
//! The holder applies or refuses each write of a batch as if it came alone (fence, sequence
//! number, snapshot), so a batch may half fail: each writer sees its own answer. A batch that
//! gets no answer (the holder died, the network broke) fails every write in it, and each
//! writer takes its write back, as it did alone.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;
use tokio::sync::oneshot;

use crate::peer::Peers;
use crate::transport::{CallError, ReplicaAnswer, Replicate};

/// Exchanges in flight per holder.
const SENDERS_PER_HOLDER: usize = 2;
/// Writes one exchange carries at most.
const MAX_BATCH: usize = 64;
/// Bytes of writes one exchange carries at most, unless its first write alone is larger
/// (values may be megabytes: a batch of them must not become one huge request).
pub(super) const MAX_BATCH_BYTES: usize = 1 << 20;

type Waiter = oneshot::Sender<Result<ReplicaAnswer, CallError>>;

/// The writes waiting for one holder, and how many exchanges are in flight to it.
#[derive(Default)]
struct Lane {
    waiting: Vec<(Replicate, Waiter)>,
    senders: usize,
}

/// Lanes by holder peer address.
type Lanes = Arc<Mutex<HashMap<String, Lane>>>;

/// Sends replica writes (not snapshots) in batches per holder.
pub(super) struct Batcher {
    peers: Peers,
    lanes: Lanes,
    exchanges: Arc<AtomicU64>,
}

impl Batcher {
    pub(super) fn new(peers: Peers) -> Self {
        Batcher { peers, lanes: Arc::default(), exchanges: Arc::default() }
    }

    /// Exchanges sent so far (a batch counts once).
    pub(super) fn exchanges(&self) -> u64 {
        self.exchanges.load(Ordering::Relaxed)
    }

    /// Sends `request` to the holder at `peer_addr`, with whatever else waits for it, and
    /// returns the holder's answer to this request.
    pub(super) async fn send(&self, peer_addr: &str, request: Replicate) -> Result<ReplicaAnswer, CallError> {
        let (tx, rx) = oneshot::channel();
        let start_sender = {
            let mut lanes = self.lanes.lock();
            let lane = lanes.entry(peer_addr.to_string()).or_default();
            lane.waiting.push((request, tx));
            let start = lane.senders < SENDERS_PER_HOLDER;
            if start {
                lane.senders += 1;
            }
            start
        };
        if start_sender {
            let (peers, lanes, exchanges) = (self.peers.clone(), self.lanes.clone(), self.exchanges.clone());
            tokio::spawn(drain(peers, lanes, exchanges, peer_addr.to_string()));
        }
        rx.await.unwrap_or_else(|_| Err(CallError::Broken("the replica batch was dropped".into())))
    }
}

/// Sends the lane's waiting writes, a batch at a time, until none waits.
async fn drain(peers: Peers, lanes: Lanes, exchanges: Arc<AtomicU64>, peer_addr: String) {
    while let Some(batch) = take(&lanes, &peer_addr) {
        exchanges.fetch_add(1, Ordering::Relaxed);
        let (mut requests, waiters): (Vec<Replicate>, Vec<Waiter>) = batch.into_iter().unzip();
        let answers = match requests.pop() {
            Some(only) if requests.is_empty() => peers.replicate(&peer_addr, only).await.map(|a| vec![a]),
            Some(last) => {
                requests.push(last);
                peers.replicate_batch(&peer_addr, requests).await
            }
            None => Ok(Vec::new()),
        };
        match answers {
            Ok(answers) => {
                for (waiter, answer) in waiters.into_iter().zip(answers) {
                    let _ = waiter.send(Ok(answer));
                }
            }
            Err(e) => {
                for waiter in waiters {
                    let _ = waiter.send(Err(e.clone()));
                }
            }
        }
    }
}

/// The oldest waiting writes of the lane, up to [`MAX_BATCH`] and [`MAX_BATCH_BYTES`] (at
/// least one), or `None` (and this sender stops) when none waits.
fn take(lanes: &Lanes, peer_addr: &str) -> Option<Vec<(Replicate, Waiter)>> {
    let mut lanes = lanes.lock();
    let lane = lanes.get_mut(peer_addr)?;
    if lane.waiting.is_empty() {
        lane.senders -= 1;
        if lane.senders == 0 {
            lanes.remove(peer_addr);
        }
        return None;
    }
    let (mut n, mut bytes) = (0, 0);
    for (request, _) in lane.waiting.iter().take(MAX_BATCH) {
        if n > 0 && bytes + request.body.len() > MAX_BATCH_BYTES {
            break;
        }
        n += 1;
        bytes += request.body.len();
    }
    Some(lane.waiting.drain(..n).collect())
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, AtomicUsize};
    use std::time::Duration;

    use bytes::Bytes;
    use shoal_raft::{BoxFuture, BucketId, ControlRpc, ControlTransport, NodeId, TransportError};

    use super::*;
    use crate::transport::{FrameStream, PeerAnswer, PeerRequest, StreamRequest, Transport};

    /// A holder that applies writes of even buckets and fences odd ones, answers after a
    /// millisecond (so writes pile up meanwhile), and counts its exchanges; or one that died.
    #[derive(Default)]
    struct Holder {
        exchanges: AtomicUsize,
        largest: AtomicUsize,
        dead: AtomicBool,
    }

    fn answer(r: &Replicate) -> ReplicaAnswer {
        if r.bucket.0 % 2 == 0 {
            ReplicaAnswer::Applied
        } else {
            ReplicaAnswer::Fenced { map_version: 9, reason: format!("bucket {}", r.bucket.0) }
        }
    }

    impl Transport for Holder {
        fn call(&self, _: &str, request: PeerRequest, _: Duration) -> BoxFuture<'_, Result<PeerAnswer, CallError>> {
            Box::pin(async move {
                self.exchanges.fetch_add(1, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(1)).await;
                if self.dead.load(Ordering::SeqCst) {
                    return Err(CallError::Unreachable("connection refused".into()));
                }
                Ok(match request {
                    PeerRequest::Replicate(r) => {
                        self.largest.fetch_max(1, Ordering::SeqCst);
                        PeerAnswer::Replicated(answer(&r))
                    }
                    PeerRequest::ReplicateBatch(rs) => {
                        self.largest.fetch_max(rs.len(), Ordering::SeqCst);
                        PeerAnswer::ReplicatedBatch(rs.iter().map(answer).collect())
                    }
                    other => panic!("unexpected {other:?}"),
                })
            })
        }

        fn open_stream(&self, _: &str, _: StreamRequest, _: Duration) -> BoxFuture<'_, Result<FrameStream, CallError>> {
            Box::pin(async { Err(CallError::Unreachable("no streams here".into())) })
        }
    }

    impl ControlTransport for Holder {
        fn control(
            &self,
            _: &str,
            _: Option<NodeId>,
            _: ControlRpc,
            _: Vec<u8>,
            _: Duration,
        ) -> BoxFuture<'_, Result<Vec<u8>, TransportError>> {
            Box::pin(async { Err(TransportError::Unreachable("no control here".into())) })
        }
    }

    fn write(bucket: u16) -> Replicate {
        Replicate {
            bucket: BucketId(bucket),
            from: 1,
            map_version: 3,
            snapshot: false,
            seq: u64::from(bucket),
            body: Bytes::new(),
        }
    }

    async fn send_all(batcher: &Batcher, n: u16) -> Vec<Result<ReplicaAnswer, CallError>> {
        futures::future::join_all((0..n).map(|b| batcher.send("holder", write(b)))).await
    }

    #[tokio::test]
    async fn writes_in_flight_together_share_exchanges_and_each_gets_its_own_answer() {
        let holder = Arc::new(Holder::default());
        let batcher = Batcher::new(Peers::new(holder.clone()));
        let answers = send_all(&batcher, 200).await;
        for (b, got) in answers.iter().enumerate() {
            let want = answer(&write(b as u16));
            assert_eq!(got.as_ref().ok(), Some(&want), "bucket {b}: half the batch is fenced, half applied");
        }
        let exchanges = holder.exchanges.load(Ordering::SeqCst);
        assert_eq!(batcher.exchanges(), exchanges as u64);
        assert!(exchanges < 20, "200 writes in flight at once took {exchanges} exchanges");
        assert!(holder.largest.load(Ordering::SeqCst) <= MAX_BATCH);
        assert!(batcher.lanes.lock().is_empty(), "no sender is left behind");
        // A lone write goes alone, and at once.
        let before = holder.exchanges.load(Ordering::SeqCst);
        assert_eq!(batcher.send("holder", write(4)).await, Ok(ReplicaAnswer::Applied));
        assert_eq!(holder.exchanges.load(Ordering::SeqCst), before + 1);
    }

    #[tokio::test]
    async fn large_writes_travel_in_batches_of_at_most_a_mebibyte() {
        let holder = Arc::new(Holder::default());
        let batcher = Batcher::new(Peers::new(holder.clone()));
        let big = |b: u16| Replicate { body: Bytes::from(vec![0u8; 300 << 10]), ..write(b) };
        let answers = futures::future::join_all((0..40).map(|b| batcher.send("holder", big(b * 2)))).await;
        assert!(answers.iter().all(|a| a == &Ok(ReplicaAnswer::Applied)));
        assert!(holder.largest.load(Ordering::SeqCst) <= 3, "300 KiB writes: at most 3 per exchange");
        let huge = Replicate { body: Bytes::from(vec![0u8; 3 << 20]), ..write(0) };
        assert_eq!(batcher.send("holder", huge).await, Ok(ReplicaAnswer::Applied), "a larger write goes alone");
    }

    #[tokio::test]
    async fn a_holder_that_dies_fails_every_write_of_its_batches() {
        let holder = Arc::new(Holder::default());
        let batcher = Batcher::new(Peers::new(holder.clone()));
        holder.dead.store(true, Ordering::SeqCst);
        let answers = send_all(&batcher, 100).await;
        assert!(answers.iter().all(|a| matches!(a, Err(CallError::Unreachable(_)))), "{answers:?}");
        holder.dead.store(false, Ordering::SeqCst);
        assert_eq!(batcher.send("holder", write(2)).await, Ok(ReplicaAnswer::Applied), "the lane works again");
    }
}
