//! State transfer: when the map changes, buckets move with their data (R20–R26, R34).
//!
//! This module runs a node's part of it:
//! - the **acker** acknowledges every pending map of a transition, so the leader can end it;
//! - the **puller** brings in, one bucket at a time, the buckets the target map gives this
//!   node, and asks the leader to flip each one to it once it holds the data.
//!
//! The protocol and its invariant (one writable owner per bucket at every moment, no lost
//! write) are in `raft/DESIGN.md`.

use std::sync::Arc;
use std::time::Duration;

use shoal_raft::{AdminRequest, AdminResponse, ControlError, ControlPlane, NodeId};
use tokio::task::JoinHandle;

use crate::cache::CacheStore;

/// A node's transfer tasks.
pub struct Transfers {
    tasks: Vec<JoinHandle<()>>,
}

impl Transfers {
    /// Starts the acker and the puller of this node.
    pub fn start(control: ControlPlane, cache: Arc<CacheStore>) -> Self {
        let tasks = vec![tokio::spawn(ack_transitions(control.clone())), tokio::spawn(pull_buckets(control, cache))];
        Transfers { tasks }
    }

    /// Stops the tasks.
    pub async fn stop(self) {
        for task in self.tasks {
            task.abort();
            let _ = task.await;
        }
    }
}

/// How long to wait before trying a failed step again.
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

/// Pulls the buckets the target gives this node, one at a time.
async fn pull_buckets(control: ControlPlane, cache: Arc<CacheStore>) {
    let me = control.node_id();
    let mut applied = control.view().subscribe();
    loop {
        let incoming = control.state().incoming_of(me);
        if incoming.is_empty() {
            if applied.changed().await.is_err() {
                return;
            }
            continue;
        }
        tracing::info!(node_id = me, buckets = incoming.len(), "state transfer: pulling buckets");
        for (bucket, from, epoch) in incoming {
            if let Err(e) = move_bucket(&control, &cache, bucket.0, from, me, epoch).await {
                tracing::warn!(node_id = me, bucket = bucket.0, from, error = %e, "bucket transfer failed; will retry");
                tokio::time::sleep(RETRY).await;
                break;
            }
        }
    }
}

/// Brings one bucket here and flips it to this node.
async fn move_bucket(
    control: &ControlPlane,
    _cache: &CacheStore,
    bucket: u16,
    from: NodeId,
    to: NodeId,
    epoch: u64,
) -> Result<(), ControlError> {
    match control.admin(AdminRequest::Moved { bucket, from, to, epoch }).await? {
        AdminResponse::Moved { map_version } => {
            tracing::debug!(bucket, from, to, map_version, "bucket moved");
            Ok(())
        }
        other => Err(ControlError::Fatal { detail: format!("unexpected answer {other:?}") }),
    }
}
