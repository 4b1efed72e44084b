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

use shoal_raft::ControlPlane;

/// Waits until this node knows a leader it can commit through and has applied everything it
/// knows to be committed, after a few heartbeats: the buckets it owns are then the ones the
/// cluster says. No bound:
/// until then every bucket answers `bucket_restoring` (a node that cannot reach a leader could
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
    // A leader this node can commit through: one that restarted as leader (Raft restores the
    // lead from its own stored vote) counts only once a majority answered it, else it would
    // trust the commit index on its own disk, which may be behind.
    while control.commit_refusal().is_some() {
        waiting("a Raft leader");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // The leader's next heartbeats carry its commit index.
    tokio::time::sleep(Duration::from_millis(600)).await;
    while control.raft_metrics().last_applied.map_or(0, |l| l.index) < control.commit_index() {
        waiting("the Raft log to be applied");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
