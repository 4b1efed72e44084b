//! Restoring buckets from shadows when a node starts.
//!
//! A node's cache is in memory: after a restart it holds nothing. Buckets it serves that were
//! handed to it during the running transfer still have a shadow on the node that handed them
//! over; the node pulls them back from there before serving them. Until then, operations on
//! those buckets answer 503 `bucket_restoring`.

use std::collections::BTreeSet;
use std::sync::Arc;

use parking_lot::RwLock;
use shoal_raft::{BucketId, ClusterState, ControlPlane, NodeId};

use super::import::{backoff, Puller};
use super::progress::Progress;
use crate::cache::CacheStore;

/// The buckets this node serves but has not got back yet.
#[derive(Debug, Default)]
pub struct Restoring {
    buckets: RwLock<BTreeSet<u16>>,
}

impl Restoring {
    /// Marks every bucket `me` serves that has a shadow elsewhere (call before serving).
    pub fn mark(&self, state: &ClusterState, me: NodeId) {
        let mut set = self.buckets.write();
        for b in BucketId::all() {
            if state.map.owner_of(b) == Some(me) && state.shadow_of(b).is_some() {
                set.insert(b.0);
            }
        }
    }

    /// Whether `bucket` is waiting to be restored.
    pub fn contains(&self, bucket: BucketId) -> bool {
        let set = self.buckets.read();
        !set.is_empty() && set.contains(&bucket.0)
    }

    fn remove(&self, bucket: BucketId) {
        self.buckets.write().remove(&bucket.0);
    }

    fn pending(&self) -> Vec<BucketId> {
        self.buckets.read().iter().map(|&b| BucketId(b)).collect()
    }
}

/// Pulls every marked bucket back from its shadow, retrying until it succeeds or the shadow
/// is gone (then the bucket's data is lost, and said so in the log).
pub async fn restore(
    control: ControlPlane,
    cache: Arc<CacheStore>,
    puller: Puller,
    restoring: Arc<Restoring>,
    progress: Arc<Progress>,
) {
    let me = control.node_id();
    let mut failures = 0;
    loop {
        let pending = restoring.pending();
        if pending.is_empty() {
            return;
        }
        tracing::info!(node_id = me, buckets = pending.len(), "restoring buckets from their shadows");
        let mut failed = false;
        for bucket in pending {
            let state = control.state();
            let shadow = state.shadow_of(bucket).filter(|_| state.map.owner_of(bucket) == Some(me));
            let Some(shadow) = shadow else {
                tracing::error!(node_id = me, bucket = bucket.0, "no shadow left: the bucket's data is lost");
                restoring.remove(bucket);
                continue;
            };
            match puller.restore(&control, &cache, &progress, bucket, shadow).await {
                Ok(bytes) => {
                    tracing::info!(node_id = me, bucket = bucket.0, from = shadow, bytes, "bucket restored");
                    restoring.remove(bucket);
                }
                Err(e) => {
                    tracing::warn!(node_id = me, bucket = bucket.0, from = shadow, error = %e, "restore failed; will retry");
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
