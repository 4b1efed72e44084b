//! Getting buckets back when a node starts again as the same member.
//!
//! A node's cache is in memory: after a restart it holds nothing. Every bucket it owns has a
//! copy at the holder of its complete replica, or — for a bucket handed to it in the running
//! transfer — a shadow on the node that handed it over. The reconciler (`crate::reconcile`)
//! restores each from there before the node serves it (503 `bucket_restoring` meanwhile); a
//! bucket of which no copy is left (every copy died) serves again, empty, and the node says so
//! in its log. Before deciding
//! anything, the node catches up with the leader ([`catch_up`]): the state on its own disk may
//! be behind.

use std::time::Duration;

use shoal_raft::{ControlError, ControlPlane};

/// How long a restarted node asks the leader for its read index before it settles for what it
/// knows itself (a leader of an earlier version does not know the request, and says so at once).
const READ_INDEX_FOR: Duration = Duration::from_secs(30);
/// How long one read index request may take.
const READ_INDEX_WAIT: Duration = Duration::from_secs(5);

/// Waits until this node has applied everything the cluster committed before it asked: the
/// leader confirms with a majority that it still leads and answers its commit index (the
/// leader this node knew may have been replaced while it was down, and one that restarted as
/// leader from its stored vote knows no more than its own disk). The buckets it owns are then
/// the ones the cluster says. Until then every bucket answers `bucket_restoring` (a node that
/// cannot reach a leader could not acknowledge writes anyway), rather than one flipped here
/// before the restart being served empty. If no leader answers within `READ_INDEX_FOR`, it
/// waits for a leader it can commit through and for the commit index that leader's heartbeats
/// bring, as nodes of earlier versions did.
pub async fn catch_up(control: &ControlPlane) {
    let started = tokio::time::Instant::now();
    let mut said = tokio::time::Instant::now();
    let mut waiting = |what: &str| {
        if said.elapsed() >= Duration::from_secs(10) {
            tracing::info!(node_id = control.node_id(), waited = ?started.elapsed(), "restore waits for {what}");
            said = tokio::time::Instant::now();
        }
    };
    let mut target = None;
    while started.elapsed() < READ_INDEX_FOR {
        match tokio::time::timeout(READ_INDEX_WAIT, control.read_index()).await {
            Ok(Ok(index)) => {
                target = Some(index);
                break;
            }
            Ok(Err(e @ ControlError::Rejected { .. })) => {
                tracing::debug!(error = %e, "the leader does not know read index requests");
                break;
            }
            Ok(Err(e)) => tracing::debug!(error = %e, "asking the leader for its read index"),
            Err(_) => tracing::debug!("asking the leader for its read index: no answer in time"),
        }
        waiting("the leader's read index");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let target = match target {
        Some(index) => index,
        None => {
            while control.commit_refusal().is_some() {
                waiting("a Raft leader");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            // The leader's next heartbeats carry its commit index.
            tokio::time::sleep(Duration::from_millis(600)).await;
            control.commit_index()
        }
    };
    while control.raft_metrics().last_applied.map_or(0, |l| l.index) < target {
        waiting("the Raft log to be applied");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
