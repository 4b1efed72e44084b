//! `shoal-raft`: shoal's control plane, and nothing of the cache data.
//!
//! Membership (in join order), the distribution map and the replica assignment derived from
//! them are the state of a Raft state machine (openraft 0.9; log, vote and snapshots in
//! sled). Every node applies the same commands in the same order, so every node agrees on who
//! owns which bucket. Bucket data never passes through here.
//!
//! # Layout
//! - [`distribution`]: pure code: buckets, the map, `bucket_of`, `rebalance`.
//! - [`command`]: the Raft commands ([`ClusterCommand`]) and their responses.
//! - [`state`]: [`ClusterState`], the replicated state, and the pure `apply`.
//! - [`log_store`], [`state_machine`]: openraft's storage traits on sled.
//! - [`network`]: Raft RPCs and the join/leave protocol over HTTP on the peer listener.
//! - [`control`]: [`ControlPlane`], a node's handle: bootstrap, admin requests, reconciling
//!   Raft's voters with the members.
//! - [`types`]: the openraft type configuration; openraft's generics stop there.
//!
//! `DESIGN.md` beside this crate states the invariants and the protocols.

// openraft's StorageError is large by design and is what its traits return.
#![allow(clippy::result_large_err)]

pub mod command;
pub mod control;
pub mod distribution;
pub mod error;
pub mod log_store;
pub mod network;
pub mod state;
pub mod state_machine;
pub mod types;

#[cfg(test)]
mod storage_suite;

pub use command::{ClusterCommand, CommandResponse};

/// Makes every earlier write of `db` durable.
///
/// sled's own `flush_async` runs the flush on sled's I/O thread pool, whose seven threads
/// also write the log buffers the flush waits for: with a few flushes at once (several nodes
/// in one process, or a busy node) every pool thread ends up waiting and nothing is left to
/// write (seen as a hang in our tests). The flush therefore runs on tokio's blocking pool.
pub(crate) async fn flush(db: &sled::Db) -> Result<usize, sled::Error> {
    let db = db.clone();
    tokio::task::spawn_blocking(move || db.flush())
        .await
        .unwrap_or_else(|e| Err(sled::Error::Io(std::io::Error::other(e))))
}
pub use control::{ControlConfig, ControlPlane};
pub use distribution::{bucket_of, BucketId, DistributionMap, NodeId, BUCKET_COUNT};
pub use error::ControlError;
pub use network::{
    cluster_secret, outgoing_ip, peer_router, secret_headers, set_cluster_secret, set_outgoing_ip, AdminClient,
    AdminRequest, AdminResponse, MemberStatus, SECRET_HEADER,
};
pub use state::{ClusterState, Member, ReplicationMode};
pub use state_machine::StateView;
