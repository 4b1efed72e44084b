//! The partitioning of the key space: pure code, no I/O.
//!
//! Every key lives in one of [`BUCKET_COUNT`] buckets ([`bucket_of`]); the
//! [`DistributionMap`] says which node owns each bucket; [`rebalance()`] makes the next map
//! when membership changes, [`balance()`] when the data is uneven. Nothing here knows about
//! Raft, sockets or the cache: the control plane commits maps made by these functions, and
//! the data plane looks owners up in them.
//!
//! # Layout
//! - `hash.rs`: [`bucket_of`] and the `{tag}` affinity rule.
//! - `map.rs`: [`DistributionMap`], owners by bucket, counts by node.
//! - `rebalance.rs`: [`rebalance()`], the equal split that moves as few buckets as possible.
//! - `balance.rs`: [`balance()`] and [`balance_node`], maps balanced by the bytes each bucket
//!   holds (the members report them), moving as few bytes as possible.

mod balance;
mod hash;
mod map;
mod rebalance;

pub use balance::{
    balance, balance_lower_bound, balance_node, balance_ratio, loads, moves_between, rebalance_by_size, BalanceMove,
    BALANCE_TOLERANCE,
};
pub use hash::{bucket_of, routing_key_of};
pub use map::{DistributionMap, MapFault};
pub use rebalance::{minimum_moves, rebalance, target_counts};

use serde::{Deserialize, Serialize};

/// The number of buckets the key space is cut into. Fixed for the life of a cluster.
pub const BUCKET_COUNT: usize = 1000;

/// A node's identity in the cluster: assigned by the cluster when the node joins, never
/// reused, and increasing in join order.
pub type NodeId = u64;

/// One of the [`BUCKET_COUNT`] buckets; always `< BUCKET_COUNT`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct BucketId(pub u16);

impl BucketId {
    /// The bucket as an index into per-bucket arrays.
    pub fn index(self) -> usize {
        usize::from(self.0)
    }

    /// Every bucket, in order.
    pub fn all() -> impl Iterator<Item = BucketId> {
        (0..BUCKET_COUNT as u16).map(BucketId)
    }
}

impl std::fmt::Display for BucketId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

#[cfg(test)]
mod proptests;
