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
//! - [`events`]: the cluster's event log, derived from the applied entries.
//! - [`state`]: [`ClusterState`], the replicated state, and the pure `apply`.
//! - [`disk`]: where the Raft state lives: sled, or memory for the simulation.
//! - [`log_store`], [`state_machine`]: openraft's storage traits on a [`disk::Disk`].
//! - [`network`]: Raft RPCs and the join/leave protocol, over the transport the node passes
//!   in ([`ControlTransport`]).
//! - [`runtime`]: openraft's async runtime, tokio with a generator the simulation seeds.
//! - [`control`]: [`ControlPlane`], a node's handle: bootstrap, admin requests, reconciling
//!   Raft's voters with the members.
//! - [`types`]: the openraft type configuration; openraft's generics stop there.
//!
//! `DESIGN.md` beside this crate states the invariants and the protocols.

// openraft's StorageError is large by design and is what its traits return.
#![allow(clippy::result_large_err)]

pub mod command;
pub mod control;
pub mod disk;
pub mod distribution;
pub mod error;
pub mod events;
pub mod log_store;
pub mod network;
pub mod runtime;
pub mod state;
pub mod state_machine;
pub mod types;

#[cfg(test)]
mod storage_suite;

pub use command::{ClusterCommand, CommandResponse, Proposal};
pub use control::{ControlConfig, ControlPlane, Storage};
pub use distribution::{
    balance, balance_lower_bound, balance_node, balance_ratio, bucket_of, loads, moves_between, BalanceMove, BucketId,
    DistributionMap, NodeId, BALANCE_TOLERANCE, BUCKET_COUNT,
};
pub use error::ControlError;
pub use events::{Event, EventKind, MoveGroup};
pub use network::{
    AdminClient, AdminRequest, AdminResponse, BoxFuture, ControlRpc, ControlTransport, LostBucket, MemberStatus,
    ServeError, TransportError,
};
pub use state::{ClusterState, Member, ReplicationMode};
pub use state_machine::{EventPage, StateView};
