//! The receiving side: pull one bucket from its current server, install it, and ask the
//! leader to flip it here.

use std::time::Duration;

use futures::StreamExt;
use shoal_raft::{AdminRequest, AdminResponse, BucketId, ControlError, ControlPlane, NodeId};

use super::progress::Progress;
use super::TransferConfig;
use crate::cache::CacheStore;
use crate::peer::Peers;
use crate::phase::pull_lands;
use crate::transport::frame::{Decoded, Decoder, FrameError};
use crate::transport::{CallError, FrameStream, StreamRequest};

/// How long a puller waits to apply the flip it asked for.
const FLIP_WAIT: Duration = Duration::from_secs(10);

/// Why pulling a bucket failed (it is retried).
#[derive(Debug, thiserror::Error)]
pub enum PullError {
    /// The source could not be reached (after the configured reconnect attempts).
    #[error("cannot reach node {node} at {addr}: {detail}")]
    Unreachable {
        /// The source.
        node: NodeId,
        /// Its peer address.
        addr: String,
        /// What happened.
        detail: String,
    },
    /// The source refused (not ready yet, or the move is stale).
    #[error("node {node} refused ({status}): {detail}")]
    Refused {
        /// The source.
        node: NodeId,
        /// The HTTP status of the refusal (404: it holds no copy).
        status: u16,
        /// Why.
        detail: String,
    },
    /// The stream was broken or corrupt.
    #[error("stream from node {node}: {error}")]
    Stream {
        /// The source.
        node: NodeId,
        /// What was wrong.
        error: FrameError,
    },
    /// The leader did not flip the bucket.
    #[error("flip: {0}")]
    Flip(#[from] ControlError),
}

/// Pulls buckets from other nodes.
#[derive(Clone)]
pub struct Puller {
    peers: Peers,
    config: TransferConfig,
}

impl Puller {
    /// A puller over `peers`, whose streams give up opening after `config.open_timeout`.
    pub fn new(peers: Peers, config: TransferConfig) -> Self {
        Puller { peers, config }
    }

    /// Opens the stream `request` at `peer_addr` (the transport makes the reconnect attempts
    /// when the connection itself fails).
    async fn open(&self, from: NodeId, peer_addr: &str, request: StreamRequest) -> Result<FrameStream, PullError> {
        match self.peers.open_stream(peer_addr, request, self.config.open_timeout).await {
            Ok(frames) => Ok(frames),
            Err(CallError::Refused { status, reason }) => {
                Err(PullError::Refused { node: from, status, detail: reason })
            }
            Err(e) => Err(PullError::Unreachable { node: from, addr: peer_addr.into(), detail: e.to_string() }),
        }
    }

    /// Pulls `bucket` from `from` into `cache` (replacing whatever partial copy an earlier
    /// attempt left), then has the leader flip it to `to`. Answers the bytes received when the
    /// flip to this node committed, `None` when there was nothing to pull (the bucket moved
    /// since the list was made, or while it was pulled).
    ///
    /// What it receives goes into `cache` only while the bucket is still incoming here from
    /// `from` in this move (`pull_lands`), asked under the bucket's lock each time: the pull
    /// may outlive the move (its source was failed meanwhile and the bucket promoted here), and
    /// a source that was cut off answers with its old copy once it can be reached again.
    pub async fn pull(
        &self,
        control: &ControlPlane,
        cache: &CacheStore,
        progress: &Progress,
        bucket: BucketId,
        from: NodeId,
        epoch: u64,
    ) -> Result<Option<u64>, PullError> {
        let to = control.node_id();
        let lands = || pull_lands(&control.state(), to, bucket, from, epoch);
        // The list of buckets to pull may be older than the state: skip what has moved since.
        if !lands() {
            return Ok(None);
        }
        let state = control.state();
        let peer_addr = state.member_of(from).map(|m| m.peer_addr.clone()).ok_or_else(|| PullError::Refused {
            node: from,
            status: 409,
            detail: "not a member".into(),
        })?;
        if cache.take_bucket_while(bucket, lands).is_none() {
            return Ok(None);
        }
        let request = StreamRequest::Bucket { bucket, to, epoch, restore: false };
        let result = self.receive(cache, progress, from, &peer_addr, request, &lands).await;
        let flipped = match result {
            Ok(None) => {
                tracing::debug!(
                    bucket = bucket.0,
                    from,
                    epoch,
                    "the bucket moved on while it was pulled; the rest is not kept"
                );
                Ok(None)
            }
            Ok(Some(bytes)) => match control.admin(AdminRequest::Moved { bucket: bucket.0, from, to, epoch }).await {
                Ok(AdminResponse::Moved { map_version }) => {
                    tracing::debug!(bucket = bucket.0, from, map_version, bytes, "bucket moved here");
                    // The flip is committed: wait until this node applied it, however long
                    // that takes (a later round must not pull the bucket again and wipe the
                    // copy the flip serves).
                    while !control.wait_for_state(FLIP_WAIT, |s| s.epoch_of(bucket) != epoch).await {
                        tracing::debug!(bucket = bucket.0, "waiting to apply the committed flip");
                    }
                    Ok(Some(bytes))
                }
                Ok(other) => Err(PullError::Flip(ControlError::Fatal { detail: format!("unexpected {other:?}") })),
                // Refused by the state machine: definitely not moved.
                Err(e @ ControlError::Rejected { .. }) => Err(PullError::Flip(e)),
                Err(e) => {
                    // The flip may still commit (a lost answer, a leader change): settle the
                    // move's epoch before deciding what the copy is worth.
                    settle_epoch(control, bucket, epoch).await;
                    if control.state().map.owner_of(bucket) == Some(to) {
                        tracing::debug!(
                            bucket = bucket.0,
                            from,
                            bytes,
                            "bucket moved here (the flip's answer was lost)"
                        );
                        Ok(Some(bytes))
                    } else {
                        Err(PullError::Flip(e))
                    }
                }
            },
            Err(e) => Err(e),
        };
        // A failed pull leaves its partial copy: the bucket is still incoming (the next pull
        // starts it over), or the reconciler drops it once nothing here keeps it.
        flipped
    }

    /// Gets `bucket` back from `from`, which holds its replica or a shadow (after a restart);
    /// no flip: this node serves it already.
    pub async fn restore(
        &self,
        control: &ControlPlane,
        cache: &CacheStore,
        progress: &Progress,
        bucket: BucketId,
        from: NodeId,
    ) -> Result<u64, PullError> {
        let state = control.state();
        let peer_addr = state.member_of(from).map(|m| m.peer_addr.clone()).ok_or_else(|| PullError::Refused {
            node: from,
            status: 409,
            detail: "not a member".into(),
        })?;
        cache.take_bucket(bucket);
        let request =
            StreamRequest::Bucket { bucket, to: control.node_id(), epoch: state.epoch_of(bucket), restore: true };
        let result = self.receive(cache, progress, from, &peer_addr, request, &|| true).await;
        if result.is_err() {
            cache.take_bucket(bucket);
        }
        result.map(|bytes| bytes.unwrap_or_default())
    }

    async fn receive(
        &self,
        cache: &CacheStore,
        progress: &Progress,
        from: NodeId,
        peer_addr: &str,
        request: StreamRequest,
        lands: &(dyn Fn() -> bool + Sync),
    ) -> Result<Option<u64>, PullError> {
        let StreamRequest::Bucket { bucket, .. } = request;
        let mut frames = self.open(from, peer_addr, request).await?;
        let mut decoder = Decoder::default();
        let broken = |error| PullError::Stream { node: from, error };
        loop {
            let Some(data) = frames.next().await else { return Err(broken(FrameError::Truncated)) };
            let data = data.map_err(|_| broken(FrameError::Truncated))?;
            progress.received(data.len() as u64);
            decoder.feed(data);
            // What one message holds is applied together.
            let mut changes = Vec::new();
            while let Some(decoded) = decoder.next_decoded().map_err(broken)? {
                match decoded {
                    Decoded::Change(change) => changes.push(change),
                    Decoded::End { version_counter, .. } => {
                        if !cache.apply_changes_while(bucket, &changes, lands) {
                            return Ok(None);
                        }
                        cache.raise_version_counter(bucket, version_counter);
                        return Ok(Some(decoder.bytes));
                    }
                }
            }
            if !cache.apply_changes_while(bucket, &changes, lands) {
                return Ok(None);
            }
        }
    }
}

/// Waits until move `epoch` of `bucket` is settled in this node's applied state: the flip
/// committed or the move was aborted (either bumps the epoch). Every [`FLIP_WAIT`] without
/// news it proposes the abort itself: an abort is ordered after any flip of the same epoch
/// still in the log, so once either is applied the outcome is final. A pull whose flip
/// answer was lost must not drop its copy while the flip can still land (the bucket would be
/// served empty), nor keep it when the flip never will.
async fn settle_epoch(control: &ControlPlane, bucket: BucketId, epoch: u64) {
    let settled = |s: &shoal_raft::ClusterState| s.epoch_of(bucket) != epoch;
    while !control.wait_for_state(FLIP_WAIT, settled).await {
        if let Err(e) = control.admin(AdminRequest::Abort { bucket: bucket.0, epoch }).await {
            tracing::debug!(bucket = bucket.0, epoch, error = %e, "settling a move whose flip answer was lost");
        }
    }
}

/// How long to wait before pulling again after a failure: doubling from half a second, at
/// most five seconds.
pub fn backoff(failures: u32) -> Duration {
    Duration::from_millis(500u64.saturating_mul(1 << failures.min(4))).min(Duration::from_secs(5))
}
