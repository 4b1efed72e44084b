//! The holder's side of replication: [`Replicator::receive`], fenced by the map.

use std::time::Duration;

use super::Replicator;
use crate::phase::holds_replica;
use crate::transport::frame::decode_body;
use crate::transport::{ReplicaAnswer, Replicate};

/// How long the holder waits to apply the sender's map version.
const MAP_CATCH_UP: Duration = Duration::from_secs(2);

impl Replicator {
    /// Applies a snapshot (replacing the replica bucket) or changes (only on top of a snapshot
    /// of the same owner: else [`ReplicaAnswer::NeedSnapshot`], and the owner sends a
    /// snapshot). [`ReplicaAnswer::Fenced`] when, in a map at least as new as the sender's, the
    /// sender does not own the bucket or this node is not its replica.
    pub async fn receive(&self, r: Replicate) -> ReplicaAnswer {
        let bucket = r.bucket;
        let (changes, counter) = match decode_body(r.body.clone()) {
            Ok(decoded) => decoded,
            Err(e) => return ReplicaAnswer::Refused(e.to_string()),
        };
        if self.control.state().map.version < r.map_version {
            self.control.wait_for_state(MAP_CATCH_UP, |s| s.map.version >= r.map_version).await;
        }
        // Everything decoded: nothing is half-applied by a bad request. The fence is checked and
        // the request applied under the replica bucket's apply lock, which promotion and drops take too, on
        // the newest applied state: a request checked before a failover cannot land after it.
        let from = r.from;
        let mut applied = self.copies.lock(bucket);
        let state = self.control.state();
        if !holds_replica(&state, self.me, bucket, from) {
            return ReplicaAnswer::Fenced {
                map_version: state.map.version,
                reason: format!(
                    "fenced: at map {} bucket {bucket} is owned by {:?} and node {} is not its replica holder",
                    state.map.version,
                    state.map.owner_of(bucket),
                    self.me
                ),
            };
        }
        if applied.0 == from && r.seq <= applied.1 {
            // A request held up in the network after a newer one: the sender re-sends the bucket.
            return ReplicaAnswer::NeedSnapshot("a newer request of this sender was applied already".into());
        }
        if !r.snapshot && self.copies.source(bucket) != from {
            return ReplicaAnswer::NeedSnapshot("no snapshot of this bucket yet".into());
        }
        *applied = (from, r.seq);
        if r.snapshot {
            self.copies.forget(bucket);
            self.replica.take_bucket(bucket);
        }
        self.replica.apply_changes(bucket, &changes);
        if r.snapshot {
            self.replica.raise_version_counter(bucket, counter);
            self.copies.keep(bucket, from, state.epoch_of(bucket));
        }
        ReplicaAnswer::Applied
    }
}
