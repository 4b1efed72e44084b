//! What owners say of their replicas in their pings, kept by the holder for mirror reads.

use std::collections::BTreeMap;

use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use shoal_raft::NodeId;
use tokio::time::Instant;

/// What an owner says of its replica in its pings (`health::Ping::replica`), for mirror reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReplicaReport {
    /// The member holding the sender's replica.
    pub holder: NodeId,
    /// Its holding period (`ClusterState::replica_period`).
    pub period: u64,
    /// The age of the sender's oldest change not yet acknowledged there, in milliseconds.
    pub lag_ms: u64,
    /// Whether the sender replicates synchronously (its own applied setting: a holder that
    /// applied a switch to sync before its owner must not take the owner's writes for sync).
    pub sync: bool,
}

/// Per owner, when it last said how far behind its replica copies may be, and what it said
/// (None: nothing that lets a copy serve).
#[derive(Default)]
pub(super) struct OwnerReports(Mutex<BTreeMap<NodeId, (Instant, Option<ReplicaReport>)>>);

impl OwnerReports {
    /// Records what owner `from` said of its replica.
    pub fn note(&self, from: NodeId, report: Option<ReplicaReport>) {
        self.0.lock().insert(from, (Instant::now(), report));
    }

    /// What `owner` said last of its replica, and when.
    pub fn said(&self, owner: NodeId) -> Option<(Instant, Option<ReplicaReport>)> {
        self.0.lock().get(&owner).copied()
    }
}
