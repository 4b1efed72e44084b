//! What the holder does when the applied state changes: promote the replica buckets the
//! state gives it (failover, hand-over), report them, and drop replica buckets it no longer
//! holds.

use std::sync::atomic::Ordering;

use std::sync::Arc;

use shoal_raft::{AdminRequest, BucketId, ClusterState};

use super::Replicator;
use crate::transfer::import::Puller;
use crate::transfer::progress::Progress;

/// How a promoted bucket the replica store does not hold is fetched from the shadow of the
/// previous owner instead (the state-transfer restore stream).
pub struct ShadowSource {
    /// The client of the transfer endpoint.
    pub puller: Puller,
    /// Transfer counters.
    pub progress: Arc<Progress>,
}

impl Replicator {
    /// Brings the stores in line with `state`. Returns after the report of promoted buckets
    /// was committed (or failed: the next call reports again).
    ///
    /// A promoted bucket whose replica this node does not hold (its owner failed before the
    /// replica was attached) may still have a shadow on the node that handed it to the failed
    /// owner in the running transfer: every write the failed owner acknowledged was written
    /// through to that shadow, so it is pulled from there. Only without either copy is the
    /// bucket reported lost.
    pub async fn follow(&self, state: &ClusterState, single_member_limit: u64, limit: u64, shadows: &ShadowSource) {
        self.active.set_limit(if state.members.len() == 1 { single_member_limit } else { limit });
        let promotions = state.promotions_of(self.me);
        if !promotions.is_empty() {
            let (mut promoted, mut lost) = (Vec::new(), Vec::new());
            for (bucket, from) in promotions {
                let installed = self.facts.is_installed(bucket);
                // Under the holder's bucket lock: no replication request lands in between.
                let _applying = self.applied[bucket.index()].lock();
                let source = &self.sources[bucket.index()];
                if installed {
                    promoted.push(bucket.0);
                } else if source.load(Ordering::Acquire) == from {
                    source.store(0, Ordering::Release);
                    let items = self.replica.take_bucket(bucket);
                    self.active.install_bucket(bucket, items);
                    self.facts.install(bucket);
                    // Its replica (on the next holder) gets the installed data, whole.
                    self.detach(bucket);
                    promoted.push(bucket.0);
                } else {
                    lost.push(bucket.0);
                }
            }
            let mut still_lost = Vec::new();
            for b in lost {
                let bucket = BucketId(b);
                let shadow = state.handoffs.get(&b).copied().filter(|&s| s == self.me || state.is_member(s));
                let restored = match shadow {
                    // This node handed the bucket over itself: the shadow is in its active store.
                    Some(s) if s == self.me => {
                        tracing::info!(bucket = b, "promoted bucket served from this node's own shadow");
                        self.facts.install(bucket);
                        self.detach(bucket);
                        true
                    }
                    Some(s) => {
                        let pulled = shadows.puller.restore(&self.control, &self.active, &shadows.progress, bucket, s);
                        match pulled.await {
                            Ok(bytes) => {
                                tracing::info!(bucket = b, from = s, bytes, "promoted bucket restored from its shadow");
                                self.facts.install(bucket);
                                self.detach(bucket);
                                true
                            }
                            Err(e) => {
                                tracing::warn!(bucket = b, from = s, error = %e, "restoring a promoted bucket from its shadow");
                                false
                            }
                        }
                    }
                    None => false,
                };
                if restored {
                    promoted.push(b);
                } else {
                    still_lost.push(b);
                }
            }
            let lost = still_lost;
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
        self.facts.forget_installed(state);
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
