//! The source side: `GET /internal/transfer/{bucket}?to=&epoch=` on the peer listener
//! streams a bucket to its new owner, then keeps it frozen until Raft settles the move.
//!
//! ```text
//!  new owner B                                source A (serves the bucket)
//!    GET /internal/transfer/b?to=B&epoch=e ─▶  check: A serves b, target gives b to B, epoch e
//!                                              begin_export: snapshot + record writes
//!    ◀── header, snapshot items ──────────────
//!    ◀── recorded writes (a few rounds) ───────
//!                                              freeze: writes to b now wait
//!    ◀── last writes, END ─────────────────────
//!    install, propose BucketMoved(b, A→B, e) ─▶ Raft
//!                                              applied: epoch(b) > e →
//!                                                moved: thaw (writes now go to B)
//!                                                aborted: thaw, keep serving
//!                                              no news for FREEZE_TIMEOUT: propose AbortMove(b, e)
//! ```

use std::sync::Arc;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use futures::StreamExt;
use shoal_raft::{AdminRequest, BucketId, ClusterState, ControlPlane, NodeId};
use tokio::sync::mpsc;
use tokio::time::Instant;

use super::progress::Progress;
use super::TransferConfig;
use crate::cache::CacheStore;
use crate::cache::{Change, ExportedItem};
use crate::phase::LocalFacts;
use crate::transport::frame::{
    error_frame, put_change, put_chunk, put_end, put_item_head, SnapshotEncoder, CHUNK_BYTES,
};
use crate::transport::FrameStream;

/// How long a frozen bucket waits for its move to be settled before the source aborts it.
pub const FREEZE_TIMEOUT: Duration = Duration::from_secs(10);
/// Rounds of recorded writes sent before freezing, at most.
const CATCH_UP_ROUNDS: usize = 8;
/// Freeze once a round has this few recorded writes or fewer.
const FREEZE_BELOW: usize = 64;

/// The source side of bucket streams and the holder of shadows.
#[derive(Clone)]
pub struct Exporter {
    /// The control plane.
    pub control: ControlPlane,
    /// The active store.
    pub cache: Arc<CacheStore>,
    /// How transfers run.
    pub config: TransferConfig,
    /// Transfer counters.
    pub progress: Arc<Progress>,
    /// What this node knows of its buckets (whether it holds their data yet).
    pub facts: Arc<LocalFacts>,
    /// Replication (a lost bucket given back is sent to this node's heir before it counts
    /// found).
    pub replicator: Arc<crate::replication::Replicator>,
}

/// Why a stream is refused: an HTTP status and the reason.
type Refusal = (u16, String);

/// Why the source will not stream the bucket (yet).
fn refusal(state: &ClusterState, me: NodeId, bucket: BucketId, to: NodeId, epoch: u64) -> Option<String> {
    if state.map.owner_of(bucket) != Some(me) {
        return Some(format!("node {me} does not serve bucket {bucket}"));
    }
    if state.target.as_ref().and_then(|t| t.owner_of(bucket)) != Some(to) {
        return Some(format!("the target does not give bucket {bucket} to node {to}"));
    }
    if state.epoch_of(bucket) != epoch {
        return Some(format!("bucket {bucket} is at move epoch {}, not {epoch}", state.epoch_of(bucket)));
    }
    None
}

impl Exporter {
    /// `GET /internal/transfer/{bucket}?to=&epoch=`: streams the bucket to its new owner `to`
    /// (see the module docs).
    pub async fn open(&self, bucket: BucketId, to: NodeId, epoch: u64) -> Result<FrameStream, Refusal> {
        let me = self.control.node_id();
        // The new owner may have applied the target a moment before us.
        self.control.wait_for_state(Duration::from_secs(2), |s| refusal(s, me, bucket, to, epoch).is_none()).await;
        if let Some(reason) = refusal(&self.control.state(), me, bucket, to, epoch) {
            return Err((409, reason));
        }
        if self.cache.is_frozen(bucket) {
            // An earlier pull of this move froze it and its flip is not settled (its answer may
            // have been lost): a new export would thaw it while that flip can still land.
            let reason =
                format!("bucket {bucket} is frozen by an earlier transfer whose flip is not settled yet; retry");
            return Err((409, reason));
        }
        if self.facts.not_held(&self.control.state(), me, bucket) {
            let reason = format!("node {me} is still getting bucket {bucket} back (restore or failover); retry");
            return Err((409, reason));
        }
        tracing::debug!(bucket = bucket.0, to, epoch, "exporting bucket");
        let (tx, rx) = mpsc::channel::<Bytes>(16);
        tokio::spawn(produce(self.clone(), bucket, epoch, tx));
        Ok(Box::pin(tokio_stream::wrappers::ReceiverStream::new(rx).map(Ok)))
    }
}

/// Sends the bucket into `tx`; a failed send means the receiver went away.
async fn produce(exporter: Exporter, bucket: BucketId, epoch: u64, tx: mpsc::Sender<Bytes>) {
    let cache = &exporter.cache;
    // The snapshot is encoded as the bucket's lock is held: each item is copied once, straight
    // into the stream's messages.
    let mut encoder = SnapshotEncoder::new(SEND_BYTES);
    let Some(token) = cache.begin_export(bucket, |item| encoder.visit(item)) else {
        let _ = tx.send(error_frame("the bucket is frozen by an earlier transfer that is not settled yet")).await;
        return;
    };
    let mut sent = encoder.items;
    let (messages, shared) = encoder.finish();
    let mut out = Outbox {
        tx: &tx,
        buf: BytesMut::new(),
        throttle: Throttle::new(exporter.config.rate_bytes_per_sec),
        progress: &exporter.progress,
    };
    let mut ok = true;
    for message in messages {
        ok = ok && out.send(message).await;
    }
    for item in &shared {
        ok = ok && out.push_item(item).await;
    }
    drop(shared);
    for _ in 0..CATCH_UP_ROUNDS {
        if !ok {
            break;
        }
        let changes = cache.drain_changes(bucket, token);
        let small = changes.len() <= FREEZE_BELOW;
        for c in &changes {
            ok = ok && out.push(c).await;
            sent += 1;
        }
        if small {
            break;
        }
    }
    // What is sent so far goes out before the wait for pending writes below.
    ok = ok && out.flush().await;
    if !ok {
        // Nothing was frozen: the bucket just stops recording.
        cache.end_export(bucket, token);
        return;
    }
    // A write whose changes are in the store but not committed (waiting for its replica or
    // shadow) may still be taken back: freezing now would send it to the new owner and leave
    // its take-back here. Wait until no write of the bucket is pending, and freeze before
    // the next one starts; the next ones wait for the thaw and route to the new owner.
    let settled = exporter.facts.committed(bucket).await;
    let frozen = cache.freeze(bucket, token);
    drop(settled);
    let Some((last, counter)) = frozen else {
        // A newer export of the bucket replaced this one.
        let _ = tx.send(error_frame("a newer transfer of this bucket started")).await;
        return;
    };
    for c in &last {
        ok = ok && out.push(c).await;
        sent += 1;
    }
    if ok {
        put_end(&mut out.buf, counter, sent);
        ok = out.flush().await;
    }
    if !ok {
        let _ = tx.send(error_frame("the source stopped sending")).await;
    }
    drop(tx);
    // Without END the new owner cannot flip the bucket: abort at once instead of holding
    // writes frozen for FREEZE_TIMEOUT.
    settle_freeze(&exporter, bucket, epoch, token, !ok).await;
}

/// Keeps `bucket` frozen until Raft has either moved it (its data stays as the shadow until
/// the reconciler drops it) or the move was aborted (it thaws and this node serves it on).
/// Aborts the move itself when the new owner does not settle it in time, or at once when the
/// stream broke before its END (`doomed`: the new owner flips only a bucket it received
/// whole).
async fn settle_freeze(exporter: &Exporter, bucket: BucketId, epoch: u64, token: u64, doomed: bool) {
    let control = &exporter.control;
    let settled = |s: &ClusterState| s.epoch_of(bucket) > epoch;
    let mut deadline = if doomed { Instant::now() } else { Instant::now() + FREEZE_TIMEOUT };
    loop {
        if control.wait_for_state(deadline.saturating_duration_since(Instant::now()), settled).await {
            break;
        }
        tracing::warn!(bucket = bucket.0, epoch, "the new owner did not take the bucket in time; aborting the move");
        match control.admin(AdminRequest::Abort { bucket: bucket.0, epoch }).await {
            Ok(_) => {}
            Err(e) => tracing::debug!(bucket = bucket.0, error = %e, "abort (a move may have won)"),
        }
        deadline = Instant::now() + FREEZE_TIMEOUT;
    }
    let state = control.state();
    let me = control.node_id();
    // The move committed if the state names this node as the one that handed the bucket
    // over (a failover or hand-over may have given it back since) or another node owns it.
    let moved = state.handoffs.get(&bucket.0) == Some(&me) || state.map.owner_of(bucket) != Some(me);
    if moved {
        // Its data stays until the reconciler drops it (at once, unless this node keeps a
        // shadow); writes waiting on the freeze route to the new owner now.
        exporter.facts.handed_over(bucket);
        tracing::debug!(bucket = bucket.0, to = ?state.map.owner_of(bucket), "bucket handed over");
    } else {
        tracing::info!(bucket = bucket.0, "move aborted; serving the bucket again");
    }
    exporter.cache.end_export(bucket, token);
}

/// About how many bytes of frames go out in one message of the stream.
const SEND_BYTES: usize = 64 * 1024;

/// Gathers frames into messages of about [`SEND_BYTES`]: a message per frame (one per small
/// item) cost the channel, the HTTP body and the receiver more than the item itself. Frames
/// are encoded straight into the message being gathered.
struct Outbox<'a> {
    tx: &'a mpsc::Sender<Bytes>,
    buf: BytesMut,
    throttle: Throttle,
    progress: &'a Progress,
}

impl Outbox<'_> {
    /// Adds a change's frames, sending once enough gathered; false when the receiver went
    /// away.
    async fn push(&mut self, change: &Change) -> bool {
        match change {
            Change::Put(item) => self.push_item(item).await,
            Change::Delete { .. } | Change::Expire { .. } => {
                put_change(&mut self.buf, change);
                self.buf.len() < SEND_BYTES || self.flush().await
            }
        }
    }

    /// Adds an item's frames; a large value's chunks go out as they come, not gathered whole.
    async fn push_item(&mut self, item: &ExportedItem) -> bool {
        let item = item.as_ref();
        let first = put_item_head(&mut self.buf, &item);
        for chunk in item.value[first..].chunks(CHUNK_BYTES) {
            if self.buf.len() >= SEND_BYTES && !self.flush().await {
                return false;
            }
            put_chunk(&mut self.buf, chunk);
        }
        self.buf.len() < SEND_BYTES || self.flush().await
    }

    /// Sends what gathered; false when the receiver went away.
    async fn flush(&mut self) -> bool {
        if self.buf.is_empty() {
            return true;
        }
        let message = self.buf.split().freeze();
        self.send_now(message).await
    }

    /// Sends what gathered, then `message`; false when the receiver went away.
    async fn send(&mut self, message: Bytes) -> bool {
        self.flush().await && self.send_now(message).await
    }

    async fn send_now(&mut self, message: Bytes) -> bool {
        let n = message.len();
        if self.tx.send(message).await.is_err() {
            return false;
        }
        self.progress.sent(n as u64);
        self.throttle.pause(n).await;
        true
    }
}

/// Spaces out sends to stay under a byte rate (0: unlimited).
struct Throttle {
    rate: u64,
    started: Instant,
    bytes: u64,
}

impl Throttle {
    fn new(rate: u64) -> Self {
        Throttle { rate, started: Instant::now(), bytes: 0 }
    }

    async fn pause(&mut self, n: usize) {
        if self.rate == 0 {
            return;
        }
        self.bytes += n as u64;
        let due = Duration::from_secs_f64(self.bytes as f64 / self.rate as f64);
        let elapsed = self.started.elapsed();
        if due > elapsed {
            tokio::time::sleep(due - elapsed).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn change(i: u32) -> Change {
        let key = Bytes::from(format!("key{i}"));
        if i % 7 == 3 {
            return Change::Delete { key, version: u64::from(i) };
        }
        // One value of 200 KiB: it goes out in chunks.
        let len = if i == 500 { 200 * 1024 } else { 100 + i as usize % 300 };
        Change::Put(ExportedItem {
            key,
            value: Bytes::from(vec![(i % 251) as u8; len]),
            version: u64::from(i),
            expires_at_ms: 0,
            sliding_ms: 0,
            tags: Box::default(),
            priority: crate::cache::Priority::Normal,
        })
    }

    #[tokio::test]
    async fn frames_go_out_gathered_whole_and_in_order() {
        let (tx, mut rx) = mpsc::channel(1024);
        let progress = Progress::default();
        let mut out = Outbox { tx: &tx, buf: BytesMut::new(), throttle: Throttle::new(0), progress: &progress };
        let changes: Vec<Change> = (0..1000).map(change).collect();
        let mut expected = BytesMut::new();
        for c in &changes {
            assert!(out.push(c).await);
            put_change(&mut expected, c);
        }
        assert!(out.flush().await);
        drop(out);
        drop(tx);
        let mut messages = Vec::new();
        while let Some(m) = rx.recv().await {
            messages.push(m);
        }
        let total = expected.len();
        assert!(messages.len() <= total / SEND_BYTES + 1, "{} messages for {total} bytes", messages.len());
        assert!(messages[..messages.len() - 1].iter().all(|m| m.len() >= SEND_BYTES), "only the last is short");
        assert!(
            messages.iter().all(|m| m.len() < SEND_BYTES + CHUNK_BYTES + 200),
            "a large value is not gathered whole"
        );
        assert_eq!(messages.concat(), expected.to_vec(), "every byte, in order");
        assert_eq!(progress.status(1).bytes_sent_total, total as u64);
    }
}
