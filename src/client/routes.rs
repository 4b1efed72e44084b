//! [`Routes`]: the map a client routes by.

use std::collections::BTreeMap;

use shoal_http_api::types::MapView;
use shoal_raft::{BucketId, NodeId};

/// A distribution map, ready to route keys: who owns each bucket, and where each member is.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Routes {
    /// The map's version (0: none yet).
    pub version: u64,
    owners: Vec<NodeId>,
    addrs: BTreeMap<NodeId, String>,
}

impl From<MapView> for Routes {
    fn from(map: MapView) -> Self {
        Routes {
            version: map.version,
            owners: map.owners,
            addrs: map.nodes.into_iter().map(|n| (n.id, n.api_addr)).collect(),
        }
    }
}

impl Routes {
    /// The owner of `bucket`.
    pub fn owner_of(&self, bucket: BucketId) -> Option<NodeId> {
        self.owners.get(bucket.index()).copied()
    }

    /// The owner of `key`'s bucket.
    pub fn owner_of_key(&self, key: &[u8]) -> Option<NodeId> {
        self.owner_of(shoal_raft::bucket_of(key))
    }

    /// The API address of `node`.
    pub fn addr_of(&self, node: NodeId) -> Option<&str> {
        self.addrs.get(&node).map(String::as_str)
    }

    /// The members' ids.
    pub fn node_ids(&self) -> impl Iterator<Item = NodeId> + '_ {
        self.addrs.keys().copied()
    }

    /// The members' API addresses.
    pub fn addrs(&self) -> impl Iterator<Item = &str> + '_ {
        self.addrs.values().map(String::as_str)
    }
}
