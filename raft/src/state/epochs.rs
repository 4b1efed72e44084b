//! Each bucket's move epoch, one number per bucket: read on every write a node plans, so a read
//! is an index; stored (Raft log, snapshots) as it always was, a map of the buckets whose epoch
//! is not 0.

use std::collections::BTreeMap;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::distribution::{BucketId, BUCKET_COUNT};

/// Per bucket, how many moves or aborts it has seen (see `ClusterState::bucket_epochs`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BucketEpochs(Box<[u64]>);

impl Default for BucketEpochs {
    fn default() -> Self {
        BucketEpochs(vec![0; BUCKET_COUNT].into_boxed_slice())
    }
}

impl BucketEpochs {
    /// The epoch of `bucket` (0 for one that does not exist).
    pub fn get(&self, bucket: BucketId) -> u64 {
        self.0.get(bucket.index()).copied().unwrap_or(0)
    }

    /// Starts a new epoch of `bucket`, which exists.
    pub(super) fn bump(&mut self, bucket: BucketId) {
        if let Some(epoch) = self.0.get_mut(bucket.index()) {
            *epoch += 1;
        }
    }
}

impl Serialize for BucketEpochs {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let moved = self.0.iter().enumerate().filter(|(_, &e)| e != 0);
        serializer.collect_map(moved.map(|(b, e)| (b as u16, *e)))
    }
}

impl<'de> Deserialize<'de> for BucketEpochs {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        // A bucket that does not exist has no epoch to keep (a state stored by a build that
        // let an abort name one must still load).
        let mut epochs = BucketEpochs::default();
        for (bucket, epoch) in BTreeMap::<u16, u64>::deserialize(deserializer)? {
            if let Some(slot) = epochs.0.get_mut(usize::from(bucket)) {
                *slot = epoch;
            }
        }
        Ok(epochs)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn epochs_are_stored_as_the_map_of_the_buckets_that_moved() {
        let mut epochs = BucketEpochs::default();
        epochs.bump(BucketId(7));
        epochs.bump(BucketId(7));
        epochs.bump(BucketId(999));
        let json = serde_json::to_string(&epochs).expect("serializes");
        assert_eq!(json, serde_json::to_string(&BTreeMap::from([(7u16, 2u64), (999, 1)])).expect("a map"));
        let read: BucketEpochs = serde_json::from_str(&json).expect("reads back");
        assert_eq!(read, epochs);
        assert_eq!((read.get(BucketId(7)), read.get(BucketId(8)), read.get(BucketId(5000))), (2, 0, 0));
        let beyond: BucketEpochs = serde_json::from_str(r#"{"7": 2, "999": 1, "1000": 3}"#).expect("loads");
        assert_eq!(beyond, epochs, "an epoch of a bucket that does not exist is left out");
    }
}
