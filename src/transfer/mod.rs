//! State transfer: when the map changes, buckets move with their data (R20–R26, R34).
//!
//! A node's part of it:
//! - the **acker** acknowledges every pending map of a transition, so the leader can end it;
//! - the **puller** brings in the buckets the target map gives this node, one at a time
//!   (or `--transfer-parallelism` at a time), from whoever serves each now, and asks the
//!   leader to flip each one here once it holds the data;
//! - the **exporter** (`GET /internal/transfer/{bucket}` on the peer listener) streams a
//!   bucket this node serves to its new owner, and freezes it until the flip is settled.
//!
//! The protocol and its invariant (one writable owner per bucket at every moment, no lost
//! write) are in `raft/DESIGN.md`.
//!
//! # Layout
//! - `frame.rs`: the stream format (framed, checksummed, values in chunks).
//! - `export.rs`: the source side.
//! - `import.rs`: the receiving side.
//! - `progress.rs`: counters for `/v1/cluster/transfer`, metrics and the stuck detector.
//! - `shadow.rs`: the previous owner's shadow copy and the new owner's write-through.
//! - `restore.rs`: getting buckets back from shadows after a restart.
//! - `stuck.rs`: the leader's stuck-transfer detector.

pub mod export;
pub mod frame;
pub mod import;
pub mod progress;
pub mod restore;
pub mod shadow;
pub mod stuck;

use std::sync::Arc;
use std::time::Duration;

use futures::stream::{self, StreamExt};
use shoal_raft::{AdminRequest, ControlPlane};
use tokio::task::JoinHandle;

use crate::cache::CacheStore;
use crate::metrics::NodeMetrics;
use crate::peer::Peers;
use import::{backoff, Puller};
use progress::Progress;

/// How transfers run (from the command line).
#[derive(Debug, Clone, Copy)]
pub struct TransferConfig {
    /// Buckets pulled at once (default 1).
    pub parallelism: usize,
    /// Most bytes per second one export sends (0: unlimited).
    pub rate_bytes_per_sec: u64,
    /// Connect timeout of node-to-node connections (R35: 10 s, within 5–30 s).
    pub reconnect_timeout: Duration,
    /// Extra connection attempts after the first fails (R35: 2).
    pub reconnect_attempts: u32,
    /// Pause between connection attempts (R35: 2 s).
    pub reconnect_pause: Duration,
    /// How often the leader checks transfers for progress (R25: 30 s).
    pub check_interval: Duration,
    /// No transfer activity for this long means stuck (R25: 3 min).
    pub stuck_after: Duration,
}

impl Default for TransferConfig {
    fn default() -> Self {
        TransferConfig {
            parallelism: 1,
            rate_bytes_per_sec: 0,
            reconnect_timeout: Duration::from_secs(10),
            reconnect_attempts: 2,
            reconnect_pause: Duration::from_secs(2),
            check_interval: Duration::from_secs(30),
            stuck_after: Duration::from_secs(180),
        }
    }
}

/// A node's transfer tasks and the state its endpoints share.
pub struct Transfers {
    tasks: Vec<JoinHandle<()>>,
    progress: Arc<Progress>,
}

impl Transfers {
    /// Starts the acker, the puller and the stuck detector of this node.
    pub fn start(
        control: ControlPlane,
        cache: Arc<CacheStore>,
        peers: Peers,
        config: TransferConfig,
        progress: Arc<Progress>,
        metrics: Arc<NodeMetrics>,
    ) -> Self {
        let puller = Puller::new(peers.clone(), config);
        let tasks = vec![
            tokio::spawn(ack_transitions(control.clone())),
            tokio::spawn(stuck::detect_stuck(control.clone(), peers, config, metrics.clone())),
            tokio::spawn(pull_buckets(control, cache, puller, config, progress.clone(), metrics)),
        ];
        Transfers { tasks, progress }
    }

    /// The progress counters.
    pub fn progress(&self) -> &Arc<Progress> {
        &self.progress
    }

    /// Stops the tasks.
    pub async fn stop(self) {
        for task in self.tasks {
            task.abort();
            let _ = task.await;
        }
    }
}

/// How long to wait before trying a failed acknowledgement again.
const RETRY: Duration = Duration::from_millis(500);

/// Acknowledges each pending map once, as soon as this node has applied it.
async fn ack_transitions(control: ControlPlane) {
    let me = control.node_id();
    let mut applied = control.view().subscribe();
    loop {
        let state = control.state();
        let pending = state.transition.as_ref().filter(|t| state.is_member(me) && !t.acked.contains(&me));
        if let Some(t) = pending {
            let to_version = t.to.version;
            match control.admin(AdminRequest::Ack { node_id: me, to_version }).await {
                Ok(_) => tracing::debug!(node_id = me, to_version, "acknowledged the pending map"),
                Err(e) => {
                    tracing::debug!(node_id = me, to_version, error = %e, "acknowledging the pending map");
                    tokio::time::sleep(RETRY).await;
                }
            }
            continue;
        }
        if applied.changed().await.is_err() {
            return;
        }
    }
}

/// Pulls the buckets the target gives this node, `parallelism` at a time, until there are
/// none; then waits for the next change.
async fn pull_buckets(
    control: ControlPlane,
    cache: Arc<CacheStore>,
    puller: Puller,
    config: TransferConfig,
    progress: Arc<Progress>,
    metrics: Arc<NodeMetrics>,
) {
    let me = control.node_id();
    let mut applied = control.view().subscribe();
    let mut failures = 0u32;
    let mut round_open = false;
    loop {
        let incoming = control.state().incoming_of(me);
        if incoming.is_empty() {
            if round_open {
                round_open = false;
                progress.end_round();
                tracing::info!(node_id = me, "state transfer: all buckets received");
            }
            if applied.changed().await.is_err() {
                return;
            }
            continue;
        }
        if !round_open {
            round_open = true;
            progress.start_round(incoming.len());
            tracing::info!(node_id = me, buckets = incoming.len(), "state transfer: pulling buckets");
        }
        let stop = std::sync::atomic::AtomicBool::new(false);
        let results: Vec<_> = stream::iter(incoming)
            .map(|(bucket, from, epoch)| {
                let (puller, control, cache, progress, metrics) = (&puller, &control, &cache, &progress, &metrics);
                let stop = &stop;
                async move {
                    // After a failure no new pull starts this round.
                    if stop.load(std::sync::atomic::Ordering::Relaxed) {
                        return false;
                    }
                    let started = std::time::Instant::now();
                    let result = puller.pull(control, cache, progress, bucket, from, epoch).await;
                    match &result {
                        Ok(_) => {
                            progress.bucket_done();
                            metrics.transfer_bucket_duration.record(started.elapsed().as_secs_f64());
                        }
                        Err(e) => {
                            stop.store(true, std::sync::atomic::Ordering::Relaxed);
                            tracing::warn!(node_id = me, bucket = bucket.0, from, error = %e, "bucket transfer failed")
                        }
                    }
                    result.is_ok()
                }
            })
            // Every pull started runs to its end (none is dropped half-way, between its
            // flip and the local apply); failures are retried in the next round.
            .buffer_unordered(config.parallelism.max(1))
            .collect()
            .await;
        if results.iter().all(|ok| *ok) && !results.is_empty() {
            failures = 0;
        } else {
            failures += 1;
            let _ = tokio::time::timeout(backoff(failures), applied.changed()).await;
        }
    }
}
