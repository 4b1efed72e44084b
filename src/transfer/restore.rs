//! Restoring buckets when a node starts again as the same member.
//!
//! A node's cache is in memory: after a restart it holds nothing. Buckets it serves that were
//! handed to it during the running transfer still have a shadow on the node that handed them
//! over; every other bucket it serves has a copy in its replica (`crate::replication`). The
//! node pulls each back from there before serving it (R45: never serve a bucket before holding
//! it). Until then, operations on those buckets answer 503 `bucket_restoring`. A bucket of
//! which neither holds a copy serves again empty, said in the log.

use std::sync::Arc;

use shoal_raft::ControlPlane;

use super::import::{backoff, PullError, Puller};
use super::progress::Progress;
use crate::bucket::LocalFacts;
use crate::cache::CacheStore;

/// Waits until this node knows a leader and has applied everything it knows to be committed,
/// after a few heartbeats: the buckets it owns are then the ones the cluster says. No bound:
/// until then every bucket answers `bucket_restoring` (a node that cannot reach a leader could
/// not acknowledge writes anyway), rather than one flipped here before the restart being
/// served empty.
async fn catch_up(control: &ControlPlane) {
    let started = std::time::Instant::now();
    let mut said = std::time::Instant::now();
    let mut waiting = |what: &str| {
        if said.elapsed() >= std::time::Duration::from_secs(10) {
            tracing::info!(node_id = control.node_id(), waited = ?started.elapsed(), "restore waits for {what}");
            said = std::time::Instant::now();
        }
    };
    while control.leader().is_none() {
        waiting("a Raft leader");
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    // The leader's next heartbeats carry its commit index.
    tokio::time::sleep(std::time::Duration::from_millis(600)).await;
    while control.raft_metrics().last_applied.map_or(0, |l| l.index) < control.commit_index() {
        waiting("the Raft log to be applied");
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
}

/// Pulls every marked bucket back from its shadow, retrying until it succeeds or the shadow
/// is gone (then the bucket's data is lost, and said so in the log).
pub async fn restore(
    control: ControlPlane,
    cache: Arc<CacheStore>,
    puller: Puller,
    facts: Arc<LocalFacts>,
    progress: Arc<Progress>,
) {
    let me = control.node_id();
    if !facts.restoring().is_empty() {
        catch_up(&control).await;
    }
    let mut failures = 0;
    loop {
        let pending = facts.restoring();
        if pending.is_empty() {
            return;
        }
        tracing::info!(node_id = me, buckets = pending.len(), "restoring buckets from their shadows and replica");
        let mut failed = false;
        for bucket in pending {
            let state = control.state();
            let owned = state.map.owner_of(bucket) == Some(me);
            // The replica holder first (it also serves the shadow if it holds that instead).
            let source = state.replica_of(me).or_else(|| state.shadow_of(bucket)).filter(|_| owned);
            let Some(source) = source else {
                if owned {
                    tracing::error!(node_id = me, bucket = bucket.0, "no copy left: the bucket serves again, empty");
                }
                facts.restored(bucket);
                continue;
            };
            match puller.restore(&control, &cache, &progress, bucket, source).await {
                Ok(bytes) => {
                    tracing::debug!(node_id = me, bucket = bucket.0, from = source, bytes, "bucket restored");
                    facts.restored(bucket);
                }
                Err(PullError::Refused { status: 404, detail, .. }) => {
                    // The replica holder has no copy: the shadow, if another node holds it.
                    let shadow = state.shadow_of(bucket).filter(|&s| s != source);
                    let from_shadow = match shadow {
                        Some(s) => puller.restore(&control, &cache, &progress, bucket, s).await.ok(),
                        None => None,
                    };
                    if from_shadow.is_none() {
                        tracing::error!(node_id = me, bucket = bucket.0, from = source, %detail, "no copy left: the bucket serves again, empty");
                    }
                    facts.restored(bucket);
                }
                Err(e) => {
                    tracing::warn!(node_id = me, bucket = bucket.0, from = source, error = %e, "restore failed; will retry");
                    failed = true;
                    break;
                }
            }
        }
        if failed {
            failures += 1;
            tokio::time::sleep(backoff(failures)).await;
        } else {
            failures = 0;
        }
    }
}
