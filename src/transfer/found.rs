//! Lost buckets found again: a member failed while it was cut off from the majority together
//! with the holder of its replica comes back holding the newest copy of the buckets it served
//! (their heir had no copy, so they are `bucket_lost`). Before it discards its data and
//! rejoins, it gives each of them back to the bucket's owner, which installs the copy and has
//! Raft mark the bucket found (`Found`): it serves again, nothing lost.
//!
//! ```text
//!  returned node R (failed)                          owner H of lost bucket b
//!    LostOf { R } ──▶ leader: [(b, H, addr)]   (the lost buckets R served last)
//!    GiveBack b  (R's items of b) ───────────▶   lock b; still lost, last served by R, owned by H?
//!                                                   install the items
//!                                                   send b whole to H's heir (its replica)
//!                                                   Found { H, R, [b] } ──▶ Raft
//!    ◀── Found ─────────────────────────────────   (b serves again)
//!    then: discard the data, rejoin as a new member
//! ```
//!
//! Why the heir gets the copy first: `Found` is a Raft entry, and an entry H appended may commit
//! after H's process died (H restarts with the entry in its log and commits it as the next
//! leader, say). The bucket then counts found while H's memory, which held the copy, is gone,
//! and R lets go of its copy. So H sends the copy to its heir before proposing `Found`: a
//! restarted H restores it from there (it keeps an owned lost bucket marked for restoring
//! until the bucket is found or cleared), and a failover of H after it is found installs it
//! there (before, the heir reports it lost and R gives it again). `Found` names
//! that heir and its holding period, and Raft refuses it if they changed (the old heir may drop
//! the copy).
//!
//! Why R's copy is the newest there is: R acknowledged every write of b (it served b until it
//! was failed, and nobody else did: a heir serves a promoted bucket only once its report is
//! committed, and b's heir reported no copy), and it acknowledged none after the cluster could
//! have failed it (its lease ran out first, `crate::health`); a lost bucket takes no write at
//! all. So R's copy holds every acknowledged write of b.

use std::time::Duration;

use bytes::Bytes;
use shoal_raft::{AdminRequest, BucketId, ClusterState, NodeId};

use serde::{Deserialize, Serialize};

use super::export::Exporter;
use crate::transport::frame::decode_body;
use crate::transport::{wire, Endpoint, Malformed};

/// A lost bucket's copy, from the node that served it last (failed while cut off, back now),
/// to the bucket's owner.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct GiveBack {
    /// The returned node.
    pub from: NodeId,
    /// The bucket.
    pub bucket: BucketId,
    /// Its items, framed (`transport::frame`).
    #[serde(deserialize_with = "wire::shared::deserialize")]
    pub body: Bytes,
}

impl Endpoint for GiveBack {
    type Answer = ();
    const ID: u8 = wire::id::GIVE_BACK;
    const CARRIES_DATA: bool = true;

    fn check(&self) -> Result<(), Malformed> {
        wire::check_bucket(self.bucket)
    }
}

/// How long the owner waits to apply the change that marks a bucket found.
const APPLY_WAIT: Duration = Duration::from_secs(5);

/// Why a copy given back is refused: an HTTP status and the reason.
type Refusal = (u16, String);

/// Whether node `me` may install `from`'s copy of `bucket` on `state`: the bucket is lost, `from`
/// served it last, and `me` owns it.
fn take_back_refusal(state: &ClusterState, me: NodeId, from: NodeId, bucket: BucketId) -> Option<String> {
    if !state.is_lost(bucket) {
        return Some(format!("bucket {bucket} is not lost"));
    }
    if state.last_server.get(&bucket.0) != Some(&from) {
        return Some(format!("node {from} did not serve bucket {bucket} last"));
    }
    if state.map.owner_of(bucket) != Some(me) {
        return Some(format!("node {me} does not own bucket {bucket}"));
    }
    None
}

impl Exporter {
    /// `GiveBack` (a call on the peer link): installs the copy of lost `bucket` its last server
    /// `from` gives back, and has Raft mark the bucket found. 409 when the bucket is not lost
    /// (any more), `from` did not serve it last, or this node does not own it; 400 for a bad
    /// body; 503 when the change could not be committed (the copy stays installed; the next
    /// attempt commits it).
    pub async fn take_back(&self, from: NodeId, bucket: BucketId, body: Bytes) -> Result<(), Refusal> {
        let me = self.control.node_id();
        // Nothing else writes a lost bucket; the lock keeps two attempts apart.
        let _lock = self.facts.lock(bucket).await;
        if let Some(reason) = take_back_refusal(&self.control.state(), me, from, bucket) {
            return Err((409, reason));
        }
        if self.cache.is_frozen(bucket) {
            // An export of the (empty) lost bucket is waiting for its flip; `Found` voids it.
            return Err((503, format!("bucket {bucket} is being exported; retry")));
        }
        let (changes, counter) = decode_body(body).map_err(|e| (400, e.to_string()))?;
        self.cache.take_bucket(bucket);
        self.cache.apply_changes(bucket, &changes);
        self.cache.raise_version_counter(bucket, counter);
        // This process holds the bucket now: after a restart it was marked to be restored,
        // and it must not be once it is found (restoring would drop the copy just installed).
        self.facts.restored(bucket);
        // The heir gets the copy before Raft may count it found: `Found` can commit after this
        // process died (it stays in the log, and this node may commit it once it restarts),
        // and the copy must not die with the process while its last server lets go of it.
        // Raft refuses `Found` if the heir changed since (it may have dropped the copy).
        let heir = match self.replicator.seed_heir(bucket).await {
            Ok(heir) => heir,
            Err(e) => return Err((503, format!("could not send bucket {bucket} to this node's heir: {e}"))),
        };
        let request = AdminRequest::Found { owner: me, from, buckets: vec![bucket.0], heir };
        if let Err(e) = self.control.admin(request).await {
            return Err((503, format!("could not mark bucket {bucket} found: {e}")));
        }
        // Committed at the leader; applied here a moment later.
        if !self.control.wait_for_state(APPLY_WAIT, |s| !s.is_lost(bucket)).await {
            return Err((409, format!("bucket {bucket} changed while it was given back")));
        }
        tracing::info!(bucket = bucket.0, from, items = changes.len(), "lost bucket given back by its last server");
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_owner_of_a_bucket_still_lost_takes_back_the_copy_of_its_last_server() {
        let mut s = crate::bucket::testing::bootstrapped();
        let b = BucketId(7);
        assert!(take_back_refusal(&s, 1, 2, b).is_some_and(|r| r.contains("not lost")));
        s.lost.insert(b.0);
        s.last_server.insert(b.0, 2);
        assert_eq!(take_back_refusal(&s, 1, 2, b), None);
        assert!(take_back_refusal(&s, 1, 3, b).is_some_and(|r| r.contains("did not serve")));
        assert!(take_back_refusal(&s, 4, 2, b).is_some_and(|r| r.contains("does not own")));
    }
}
