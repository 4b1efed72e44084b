//! The distribution map: which node owns each bucket, under a version.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::{BucketId, NodeId, BUCKET_COUNT};

/// A broken invariant of a distribution map.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MapFault {
    /// It does not give every bucket an owner.
    #[error("map has {0} buckets")]
    BucketCount(usize),
    /// A bucket's owner is not a member.
    #[error("bucket {} is owned by non-member {owner}", bucket.0)]
    NotAMember {
        /// The bucket.
        bucket: BucketId,
        /// Its owner.
        owner: NodeId,
    },
}

/// The owner of every bucket, as committed through Raft.
///
/// Invariants (checked by [`DistributionMap::check`] and by the property tests):
/// - `owners.len() == BUCKET_COUNT`, or the map is empty (`version == 0`, no cluster yet);
/// - every owner is a current member when the map is committed;
/// - `version` increases by one with every committed change and is never reused, so two maps
///   with the same version are the same map.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct DistributionMap {
    /// The epoch of this map: 0 before the cluster exists, then 1, 2, ...
    pub version: u64,
    /// `owners[b]` is the node that owns bucket `b`.
    pub owners: Vec<NodeId>,
}

impl DistributionMap {
    /// The first map of a cluster: `node` owns every bucket, version 1.
    pub fn single(node: NodeId) -> Self {
        DistributionMap { version: 1, owners: vec![node; BUCKET_COUNT] }
    }

    /// Whether this is the empty map of a node that has not joined a cluster yet.
    pub fn is_empty(&self) -> bool {
        self.owners.is_empty()
    }

    /// The owner of `bucket`, or `None` on the empty map.
    pub fn owner_of(&self, bucket: BucketId) -> Option<NodeId> {
        self.owners.get(bucket.index()).copied()
    }

    /// The buckets owned by `node`, in increasing order.
    pub fn buckets_of(&self, node: NodeId) -> Vec<BucketId> {
        self.owners.iter().enumerate().filter(|(_, &owner)| owner == node).map(|(b, _)| BucketId(b as u16)).collect()
    }

    /// How many buckets each owner has.
    pub fn counts(&self) -> BTreeMap<NodeId, usize> {
        let mut counts = BTreeMap::new();
        for &owner in &self.owners {
            *counts.entry(owner).or_insert(0) += 1;
        }
        counts
    }

    /// The buckets whose owner differs between `self` and `other`.
    pub fn moved_buckets(&self, other: &DistributionMap) -> Vec<BucketId> {
        (0..BUCKET_COUNT).filter(|&b| self.owners.get(b) != other.owners.get(b)).map(|b| BucketId(b as u16)).collect()
    }

    /// Checks the invariants against the member list; `Err` names the first one broken.
    pub fn check(&self, members: &[NodeId]) -> Result<(), MapFault> {
        if self.is_empty() {
            return Ok(());
        }
        if self.owners.len() != BUCKET_COUNT {
            return Err(MapFault::BucketCount(self.owners.len()));
        }
        if let Some(b) = self.owners.iter().position(|o| !members.contains(o)) {
            return Err(MapFault::NotAMember { bucket: BucketId(b as u16), owner: self.owners[b] });
        }
        Ok(())
    }
}
