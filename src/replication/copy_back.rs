//! The holder's side of a restore: a member that restarted gets each bucket it owns back from
//! the copy another node holds of it — the replica (every write it acknowledged in sync mode
//! reached it), else the shadow kept from a transfer's hand-over.

use std::time::Duration;

use bytes::Bytes;
use shoal_raft::{BucketId, ClusterState, NodeId};

use super::Replicator;
use crate::transport::frame::{end_frame, item_frames, HEADER};

/// How long a holder of a shadow waits for the state that gave the bucket to the asker.
const SETTLE: Duration = Duration::from_secs(2);

/// Why a copy is not sent: an HTTP status and the reason.
pub type Refusal = (u16, String);

impl Replicator {
    /// The frames of the copy of `bucket` this node holds for its owner `to`: the replica
    /// copy when it came from `to`, else the shadow when this node handed the bucket to `to`
    /// in the running transfer; `404` when it holds neither.
    pub async fn copy_back(&self, bucket: BucketId, to: NodeId) -> Result<Vec<Bytes>, Refusal> {
        let me = self.me;
        let shadow_here = self.control.state().handoffs.get(&bucket.0) == Some(&me);
        if shadow_here && self.replica_snapshot(bucket, to).is_none() {
            // The owner may have applied the change that gave it the bucket (a failover) a
            // moment before this node.
            let ready = |s: &ClusterState| shadow_refusal(s, me, bucket, to).is_none();
            self.control.wait_for_state(SETTLE, ready).await;
        }
        // A node that restarted since it handed the bucket over is still named as its shadow,
        // but holds nothing of it.
        let snapshot = self.replica_snapshot(bucket, to).or_else(|| {
            let shadow =
                self.facts.holds_shadow(bucket) && shadow_refusal(&self.control.state(), me, bucket, to).is_none();
            shadow.then(|| self.active.snapshot(bucket))
        });
        let Some((items, counter)) = snapshot else {
            return Err((
                404,
                format!("node {me} holds neither a shadow nor a replica of bucket {bucket} for node {to}"),
            ));
        };
        let mut frames = vec![Bytes::from_static(HEADER)];
        frames.extend(items.iter().flat_map(item_frames));
        frames.push(end_frame(counter, items.len() as u64));
        Ok(frames)
    }
}

/// Why this node will not send its shadow of `bucket` to `to`.
fn shadow_refusal(state: &ClusterState, me: NodeId, bucket: BucketId, to: NodeId) -> Option<String> {
    if state.shadow_of(bucket) != Some(me) {
        return Some(format!("node {me} holds no shadow of bucket {bucket}"));
    }
    if state.map.owner_of(bucket) != Some(to) {
        return Some(format!("node {to} does not serve bucket {bucket}"));
    }
    None
}
