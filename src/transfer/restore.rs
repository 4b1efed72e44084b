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

/// Waits until this node has applied everything the cluster committed before it asked; the
/// buckets it owns are then the ones the cluster says. It takes two bounds and waits for the
/// higher:
/// - the leader's read index: the leader confirms with a majority that it still leads and
///   answers at least the index of its term's first entry, which covers everything committed
///   before its term. This covers a leader this node knew from its stored vote that was
///   replaced while the node was down. Asked for up to `READ_INDEX_FOR`; a leader that cannot
///   read the request (an earlier version) refuses it at once.
/// - the commit index this node knows once a leader it can commit through is known (one that
///   restarted as leader from its stored vote counts only once a majority answered it) and a
///   few of its heartbeats went by. This covers a leader that restarted within its own term:
///   its read index comes from the commit index on its disk, which may be behind entries of
///   that term committed before the restart.
///
/// Until then every bucket answers `bucket_restoring` (a node that cannot reach a leader could
/// not acknowledge writes anyway), rather than one flipped here before the restart being
/// served empty.
pub async fn catch_up(control: &ControlPlane) {
    let started = tokio::time::Instant::now();
    let mut said = tokio::time::Instant::now();
    let mut waiting = |what: &str| {
        if said.elapsed() >= Duration::from_secs(10) {
            tracing::info!(node_id = control.node_id(), waited = ?started.elapsed(), "restore waits for {what}");
            said = tokio::time::Instant::now();
        }
    };
    let mut read_index = 0;
    while started.elapsed() < READ_INDEX_FOR {
        match tokio::time::timeout(READ_INDEX_WAIT, control.read_index()).await {
            Ok(Ok(index)) => {
                read_index = index;
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
    while control.commit_refusal().is_some() {
        waiting("a Raft leader");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // The leader's next heartbeats carry its commit index.
    tokio::time::sleep(Duration::from_millis(600)).await;
    let target = read_index.max(control.commit_index());
    while control.raft_metrics().last_applied.map_or(0, |l| l.index) < target {
        waiting("the Raft log to be applied");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
