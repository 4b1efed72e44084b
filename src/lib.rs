//! shoal: a distributed in-memory cache.
//!
//! Keys are hashed into 1000 buckets; a distribution map, agreed through Raft (the
//! `shoal-raft` crate), gives every bucket one owner; any node accepts any request and serves
//! it from its own store or forwards it to the owner. The public HTTP surface lives in the
//! `shoal-http-api` crate; this crate wires the parts into a node and holds the data plane.
//!
//! # Layout
//! The public modules are what the binary and the tests use; the rest are the crate's own,
//! layered one way (`src/DESIGN.md`, "Layers"; a unit test fails on any import cycle).
//! - [`config`]: the command line (`shoal serve` flags, client commands, `shoal bench`).
//! - [`node`]: [`node::start`] builds a node and returns a [`node::NodeHandle`]; its
//!   `PeerService` answers other nodes, handing each request to the part that owns it.
//! - `api`: `NodeApi`, the node's API: one key operation, local if this node owns the
//!   bucket, else forwarded; cluster admin.
//! - `transport`: the wire between nodes (peer links, bucket streams, Raft's RPCs over HTTP, or
//!   the simulated network); `peer`: `Peers`, the typed calls a node makes to others over it.
//! - `http_server`: the HTTP/1.1 accept loop (hyper; pipelining, TCP_NODELAY, graceful drain,
//!   the public port's header-read timeout and connection cap).
//! - `bucket`: the bucket core (write permits, routes); `phase`: a bucket's phase on this node,
//!   the pure decisions every part asks and the local facts they read.
//! - `error`: `DataError`, why the data plane did not serve an operation.
//! - [`cache`]: the store of the buckets this node holds.
//! - `reconcile`: the one loop that acts on the replicated state (pulls, restores,
//!   promotions, replicas, hand-over, drops), planned by a pure function.
//! - `replication`: replicas, sync and async replication, promotion on failover.
//! - `health`: ping/pong failure detection (pfail, fail by majority), the lease, the write gate.
//! - `balance`: bucket statistics, the leader's view of them, balancing the map by data.
//! - [`transfer`]: state transfer: acknowledging transitions, moving buckets with their data.
//! - `identity`: the node's id in its data dir; `join`: the joiner's side of the join protocol.
//! - `metrics`: the node's Prometheus metrics.
//! - `sim` (feature `sim`, on in the tests): the deterministic simulation: whole clusters on a
//!   simulated network and clock.
//! - [`client`]: [`client::Client`], the client library: routes each key to its owner, follows
//!   the map, forwards and queues around unreachable nodes (the CLI and `shoal bench` use it).
//! - [`cli`]: the command-line client.
//! - [`bench`](mod@bench): `shoal bench`, the load generator.

/// The release (`Cargo.toml`'s version).
pub const VERSION: &str = env!("CARGO_PKG_VERSION");
/// The source revision the binary was built from (`git rev-parse --short=12 HEAD` at build
/// time, `SHOAL_REVISION` when the builder set it, else `unknown`).
pub const REVISION: &str = env!("SHOAL_REVISION");

pub(crate) mod api;
pub(crate) mod auth;
pub(crate) mod balance;
pub mod bench;
pub(crate) mod body_budget;
pub(crate) mod bucket;
pub mod cache;
pub mod cli;
pub mod client;
pub mod config;
pub(crate) mod discover;
pub(crate) mod error;
pub(crate) mod health;
pub(crate) mod http_server;
pub(crate) mod identity;
pub(crate) mod join;
#[cfg(test)]
mod layers;
pub(crate) mod maintenance;
pub(crate) mod metrics;
pub mod mirror;
pub mod node;
pub(crate) mod peer;
pub(crate) mod phase;
pub(crate) mod reconcile;
pub(crate) mod replication;
#[cfg(feature = "sim")]
pub mod sim;
pub(crate) mod tls;
pub mod transfer;
pub(crate) mod transport;
