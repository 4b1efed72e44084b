//! What the holder does when the applied state changes: promote the replica buckets the
//! state gives it (failover, hand-over), report them, and drop replica buckets it no longer
//! holds.

use std::sync::atomic::Ordering;

use shoal_raft::{AdminRequest, BucketId, ClusterState};

use super::Replicator;

impl Replicator {
    /// Brings the stores in line with `state`. Returns after the report of promoted buckets
    /// was committed (or failed: the next call reports again).
    pub async fn follow(&self, state: &ClusterState, single_member_limit: u64, limit: u64) {
        self.active.set_limit(if state.members.len() == 1 { single_member_limit } else { limit });
        let promotions = state.promotions_of(self.me);
        if !promotions.is_empty() {
            let (mut promoted, mut lost) = (Vec::new(), Vec::new());
            for (bucket, from) in promotions {
                let installed = self.installed.lock().contains(&bucket.0);
                // Under the holder's bucket lock: no replication request lands in between.
                let _applying = self.applied[bucket.index()].lock();
                let source = &self.sources[bucket.index()];
                if installed {
                    promoted.push(bucket.0);
                } else if source.load(Ordering::Acquire) == from {
                    source.store(0, Ordering::Release);
                    let items = self.replica.take_bucket(bucket);
                    self.active.install_bucket(bucket, items);
                    self.installed.lock().insert(bucket.0);
                    // Its replica (on the next holder) gets the installed data, whole.
                    self.detach(bucket);
                    promoted.push(bucket.0);
                } else {
                    lost.push(bucket.0);
                }
            }
            tracing::info!(
                node_id = self.me,
                promoted = promoted.len(),
                lost = lost.len(),
                "serving replica buckets of a member that failed or left"
            );
            if !lost.is_empty() {
                tracing::error!(buckets = ?lost, "no copy of these buckets is left: they are lost");
            }
            let report = AdminRequest::Promoted { node_id: self.me, buckets: promoted, lost };
            if let Err(e) = self.control.admin(report).await {
                tracing::warn!(error = %e, "could not report promoted buckets; retrying");
            }
        }
        self.installed.lock().retain(|b| state.promoted.contains_key(b));
        for bucket in BucketId::all() {
            let source = self.sources[bucket.index()].load(Ordering::Acquire);
            if source == 0 || state.promoted.contains_key(&bucket.0) {
                continue;
            }
            let still = state.map.owner_of(bucket) == Some(source) && state.replica_of(source) == Some(self.me);
            if !still {
                let _applying = self.applied[bucket.index()].lock();
                if self.sources[bucket.index()].load(Ordering::Acquire) == source {
                    self.sources[bucket.index()].store(0, Ordering::Release);
                    self.replica.take_bucket(bucket);
                }
            }
        }
    }
}
