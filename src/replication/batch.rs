//! Replica writes to one holder that are in flight at once travel together.
//!
//! An owner writes each bucket under its lock, and a sync write answers the client only once
//! the holder applied it, so under load many writes of different buckets wait for the same
//! holder at once. Each holder has a lane (`lanes.rs`): a write joins the lane's
//! waiting list, and at most two exchanges are in flight per holder; a sender takes everything
//! waiting (up to [`MAX_BATCH`]) into one request and hands each write the holder's answer to
//! it. A lone write goes at once, alone (no added wait at low load); under load the batches
//! grow by themselves, one round trip for many writes.
//!
//! The holder applies or refuses each write of a batch as if it came alone (fence, sequence
//! number, snapshot), so a batch may half fail: each writer sees its own answer. A batch that
//! gets no answer (the holder died, the network broke) fails every write in it, and each
//! writer takes its write back, as it did alone.

use super::lanes::{Exchange, LaneLimits, Lanes};
use super::{ReplicaAnswer, Replicate, ReplicateBatch};
use crate::peer::Peers;
use crate::transport::{CallError, PEER_CALL_TIMEOUT};

/// Writes one exchange carries at most.
const MAX_BATCH: usize = 64;
/// Bytes of writes one exchange carries at most, unless its first write alone is larger
/// (values may be megabytes: a batch of them must not become one huge request).
const MAX_BATCH_BYTES: usize = 1 << 20;

/// Replica writes (not snapshots) in lanes per holder: sync writes, and the async queue's,
/// whose buckets it hands over all at once.
pub(super) type Batcher = Lanes<ReplicaWrites>;

/// A batcher sending through `peers`, two exchanges in flight per holder.
pub(super) fn batcher(peers: Peers) -> Batcher {
    Lanes::new(ReplicaWrites(peers), LaneLimits { senders: 2, items: MAX_BATCH, bytes: MAX_BATCH_BYTES })
}

/// One write alone goes as `Replicate`, several as `ReplicateBatch`; an exchange that gets no
/// answer fails every write in it.
pub(super) struct ReplicaWrites(Peers);

impl Exchange for ReplicaWrites {
    type Item = Replicate;
    type Answer = Result<ReplicaAnswer, CallError>;

    fn size(item: &Replicate) -> usize {
        item.body.len()
    }

    async fn send(&self, addr: &str, mut items: Vec<Replicate>) -> Vec<Self::Answer> {
        let n = items.len();
        let answers = match items.pop() {
            Some(only) if items.is_empty() => self.0.ask(addr, only, PEER_CALL_TIMEOUT).await.map(|a| vec![a]),
            Some(last) => {
                items.push(last);
                self.0.ask(addr, ReplicateBatch(items), PEER_CALL_TIMEOUT).await
            }
            None => Ok(Vec::new()),
        };
        match answers {
            Ok(answers) => answers.into_iter().map(Ok).collect(),
            Err(e) => vec![Err(e); n],
        }
    }

    fn dropped() -> Self::Answer {
        Err(CallError::Broken("the replica batch was dropped".into()))
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    use std::sync::Arc;
    use std::time::Duration;

    use bytes::Bytes;
    use shoal_raft::BucketId;

    use super::*;
    use crate::peer::Peers;
    use crate::transport::testing::peers_of;
    use crate::transport::wire::Handlers;

    /// A holder that applies writes of even buckets and fences odd ones, answers after a
    /// millisecond (so writes pile up meanwhile), and counts its exchanges; or one that died.
    #[derive(Default)]
    struct Holder {
        exchanges: AtomicUsize,
        largest: AtomicUsize,
        dead: AtomicBool,
        /// The buckets of every write that arrived.
        arrived: parking_lot::Mutex<Vec<u16>>,
    }

    fn answer(r: &Replicate) -> ReplicaAnswer {
        if r.bucket.0 % 2 == 0 {
            ReplicaAnswer::Applied
        } else {
            ReplicaAnswer::Fenced { map_version: 9, reason: format!("bucket {}", r.bucket.0) }
        }
    }

    impl Holder {
        /// Takes the writes of one exchange: their answers.
        async fn take(&self, writes: &[Replicate]) -> Vec<ReplicaAnswer> {
            self.exchanges.fetch_add(1, Ordering::SeqCst);
            tokio::time::sleep(Duration::from_millis(1)).await;
            self.largest.fetch_max(writes.len(), Ordering::SeqCst);
            self.arrived.lock().extend(writes.iter().map(|r| r.bucket.0));
            writes.iter().map(answer).collect()
        }
    }

    /// Calls that reach `holder`.
    fn peers_of_holder(holder: &Arc<Holder>) -> Peers {
        let mut handlers = Handlers::default();
        let h = holder.clone();
        handlers.add(move |w: Replicate| {
            let h = h.clone();
            async move { Ok(h.take(std::slice::from_ref(&w)).await.remove(0)) }
        });
        let h = holder.clone();
        handlers.add(move |ReplicateBatch(ws)| {
            let h = h.clone();
            async move { Ok(h.take(&ws).await) }
        });
        let h = holder.clone();
        peers_of(handlers, move || h.dead.load(Ordering::SeqCst))
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
        let batcher = batcher(peers_of_holder(&holder));
        let answers = send_all(&batcher, 200).await;
        for (b, got) in answers.iter().enumerate() {
            let want = answer(&write(b as u16));
            assert_eq!(got.as_ref().ok(), Some(&want), "bucket {b}: half the batch is fenced, half applied");
        }
        let exchanges = holder.exchanges.load(Ordering::SeqCst);
        assert_eq!(batcher.exchanges(), exchanges as u64);
        assert!(exchanges < 20, "200 writes in flight at once took {exchanges} exchanges");
        assert!(holder.largest.load(Ordering::SeqCst) <= MAX_BATCH);
        assert!(batcher.idle(), "no sender is left behind");
        // A lone write goes alone, and at once.
        let before = holder.exchanges.load(Ordering::SeqCst);
        assert_eq!(batcher.send("holder", write(4)).await, Ok(ReplicaAnswer::Applied));
        assert_eq!(holder.exchanges.load(Ordering::SeqCst), before + 1);
    }

    #[tokio::test]
    async fn large_writes_travel_in_batches_of_at_most_a_mebibyte() {
        let holder = Arc::new(Holder::default());
        let batcher = batcher(peers_of_holder(&holder));
        let big = |b: u16| Replicate { body: Bytes::from(vec![0u8; 300 << 10]), ..write(b) };
        let answers = futures::future::join_all((0..40).map(|b| batcher.send("holder", big(b * 2)))).await;
        assert!(answers.iter().all(|a| a == &Ok(ReplicaAnswer::Applied)));
        assert!(holder.largest.load(Ordering::SeqCst) <= 3, "300 KiB writes: at most 3 per exchange");
        let huge = Replicate { body: Bytes::from(vec![0u8; 3 << 20]), ..write(0) };
        assert_eq!(batcher.send("holder", huge).await, Ok(ReplicaAnswer::Applied), "a larger write goes alone");
    }

    #[tokio::test]
    async fn a_write_whose_writer_went_away_before_it_was_sent_is_not_sent() {
        use futures::FutureExt;
        let holder = Arc::new(Holder::default());
        let batcher = batcher(peers_of_holder(&holder));
        // Polled once: the write waits in the lane, its sender not started yet; then its
        // writer goes away (as a write taken back when its client left).
        assert!(batcher.send("holder", write(6)).now_or_never().is_none());
        assert_eq!(batcher.send("holder", write(4)).await, Ok(ReplicaAnswer::Applied));
        assert_eq!(*holder.arrived.lock(), vec![4], "only the write still wanted reached the holder");
        tokio::time::timeout(Duration::from_secs(5), async {
            while !batcher.idle() {
                tokio::task::yield_now().await;
            }
        })
        .await
        .expect("no sender is left behind");
    }

    #[tokio::test]
    async fn a_holder_that_dies_fails_every_write_of_its_batches() {
        let holder = Arc::new(Holder::default());
        let batcher = batcher(peers_of_holder(&holder));
        holder.dead.store(true, Ordering::SeqCst);
        let answers = send_all(&batcher, 100).await;
        assert!(answers.iter().all(|a| matches!(a, Err(CallError::Unreachable(_)))), "{answers:?}");
        holder.dead.store(false, Ordering::SeqCst);
        assert_eq!(batcher.send("holder", write(2)).await, Ok(ReplicaAnswer::Applied), "the lane works again");
    }
}
