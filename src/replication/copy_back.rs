//! The holder's side of a restore: a member that restarted gets each bucket it owns back from
//! the copy another node holds of it — the replica (every write it acknowledged in sync mode
//! reached it), else the shadow kept from a transfer's hand-over.

use std::time::Duration;

use bytes::Bytes;
use shoal_raft::{BucketId, ClusterState, NodeId};

use super::ReplicaHolder;
use crate::transport::frame::snapshot_body;

/// How long a holder waits for the state that gave the bucket to the asker (it may have
/// applied the change, a failover say, a moment before this node).
const SETTLE: Duration = Duration::from_secs(2);

/// Why a copy is not sent: an HTTP status and the reason.
pub type Refusal = (u16, String);

impl ReplicaHolder {
    /// The frames of the copy of `bucket` this node holds for its owner `to`: the replica
    /// copy when it came from `to`, else the shadow when this node handed the bucket to `to`
    /// in the running transfer; `404` when it holds neither.
    ///
    /// Only to the owner of `bucket` at move `epoch` (the asker's view): `409` when this
    /// node's state, after waiting a moment for it to catch up, says otherwise. A `404` tells the
    /// asker that no copy is left and it serves the bucket again empty, so it must come from a
    /// holder that agrees the asker serves the bucket: an asker cut off while the cluster
    /// failed it still believes it owns its buckets, and the heir that serves them now holds
    /// no replica of them any more.
    pub async fn copy_back(&self, bucket: BucketId, to: NodeId, epoch: u64) -> Result<Vec<Bytes>, Refusal> {
        let me = self.me;
        let agreed = |s: &ClusterState| owner_refusal(s, bucket, to, epoch).is_none();
        self.control.wait_for_state(SETTLE, agreed).await;
        if let Some(reason) = owner_refusal(&self.control.state(), bucket, to, epoch) {
            return Err((409, reason));
        }
        // A node that restarted since it handed the bucket over is still named as its shadow,
        // but holds nothing of it.
        let snapshot = self.replica_snapshot(bucket, to).or_else(|| {
            let shadow = self.facts.holds_shadow(bucket) && self.control.state().shadow_of(bucket) == Some(me);
            shadow.then(|| snapshot_body(&self.active, bucket))
        });
        let Some(body) = snapshot else {
            return Err((
                404,
                format!("node {me} holds neither a shadow nor a replica of bucket {bucket} for node {to}"),
            ));
        };
        Ok(vec![body])
    }
}

/// Why this node's state does not let `to` get a copy of `bucket` back at move `epoch`.
fn owner_refusal(state: &ClusterState, bucket: BucketId, to: NodeId, epoch: u64) -> Option<String> {
    if state.map.owner_of(bucket) != Some(to) {
        return Some(format!("node {to} does not serve bucket {bucket} (map version {})", state.map.version));
    }
    if state.epoch_of(bucket) != epoch {
        return Some(format!("bucket {bucket} is at move epoch {}, not {epoch}", state.epoch_of(bucket)));
    }
    None
}

#[cfg(test)]
mod tests {
    use shoal_raft::BucketId;

    use super::owner_refusal;
    use crate::bucket::testing::{self, Step};

    #[test]
    fn a_copy_goes_back_only_to_the_owner_the_holder_agrees_on() {
        // Two members; then node 1 fails and node 2, its heir, serves its buckets: node 1, cut
        // off and still believing it owns them, gets no "no copy" answer for them (a 409).
        let before = testing::states(&[Step::Join, Step::EndTransition]).pop().expect("a state");
        let b = BucketId::all().find(|&b| before.map.owner_of(b) == Some(1)).expect("a bucket of node 1");
        let epoch = before.epoch_of(b);
        assert_eq!(owner_refusal(&before, b, 1, epoch), None);
        assert!(owner_refusal(&before, b, 1, epoch + 1).is_some(), "the asker is at another move of it");
        assert!(owner_refusal(&before, b, 2, epoch).is_some(), "node 2 does not serve it");
        let after = testing::states(&[Step::Join, Step::EndTransition, Step::Fail(0)]).pop().expect("a state");
        assert_eq!(after.map.owner_of(b), Some(2), "the heir serves the failed member's bucket");
        assert!(owner_refusal(&after, b, 1, epoch).is_some());
        assert_eq!(owner_refusal(&after, b, 2, after.epoch_of(b)), None);
    }
}
