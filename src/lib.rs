//! shoal: a distributed in-memory cache.
//!
//! Keys are hashed into 1000 buckets; a distribution map, agreed through Raft (the
//! `shoal-raft` crate), gives every bucket one owner; any node accepts any request and serves
//! it from its own store or forwards it to the owner. The public HTTP surface lives in the
//! `shoal-http-api` crate; this crate wires the parts into a node and holds the data plane.
//!
//! # Layout
//! - [`config`]: the command line (`shoal serve` flags, client commands).
//! - [`node`]: [`node::start`] builds a node and returns a [`node::NodeHandle`].
//! - [`proxy`]: [`proxy::NodeApi`], one key operation: local if we own the bucket, else forward.
//! - [`transport`]: the seam for node-to-node traffic (HTTP, or the simulated network), and
//!   the receiving side of every request.
//! - [`peer`]: [`peer::Peers`], the typed calls a node makes to others over its transport.
//! - [`http_server`]: the HTTP/1.1 accept loop (hyper; pipelining, TCP_NODELAY, graceful drain,
//!   the public port's header-read timeout and connection cap).
//! - [`bucket`]: the bucket core: what this node does with each bucket, and the write path.
//! - [`error`]: [`error::DataError`], why the data plane did not serve an operation.
//! - [`cache`]: the store of the buckets this node holds.
//! - [`reconcile`]: the one loop that acts on the replicated state (pulls, restores,
//!   promotions, replicas, hand-over, drops), planned by a pure function.
//! - [`replication`]: replicas, sync and async replication, promotion on failover.
//! - [`health`]: ping/pong failure detection (pfail, fail by majority).
//! - [`balance`]: bucket statistics, the leader's view of them, balancing the map by data.
//! - [`transfer`]: state transfer: acknowledging transitions, moving buckets with their data.
//! - [`identity`]: the node's id in its data dir.
//! - [`join`]: the joiner's side of the join protocol.
//! - [`metrics`]: the node's Prometheus metrics.
//! - `sim` (feature `sim`, on in the tests): the deterministic simulation: whole clusters on a
//!   simulated network and clock.
//! - [`client`]: [`client::Client`], the client library: routes each key to its owner, follows
//!   the map, forwards and queues around unreachable nodes (the CLI and `shoal bench` use it).
//! - [`cli`]: the command-line client.
//! - [`bench`]: `shoal bench`, the load generator.

/// The release (`Cargo.toml`'s version).
pub const VERSION: &str = env!("CARGO_PKG_VERSION");
/// The source revision the binary was built from (`git rev-parse --short=12 HEAD` at build
/// time, `SHOAL_REVISION` when the builder set it, else `unknown`).
pub const REVISION: &str = env!("SHOAL_REVISION");

pub mod auth;
pub mod balance;
pub mod bench;
pub mod bucket;
pub mod cache;
pub mod cli;
pub mod client;
pub mod config;
pub mod discover;
pub mod error;
pub mod health;
pub mod http_server;
pub mod identity;
pub mod join;
#[cfg(test)]
mod layers;
pub mod maintenance;
pub mod memory;
pub mod metrics;
pub mod mirror;
pub mod node;
pub mod peer;
pub mod phase;
pub mod proxy;
pub mod reconcile;
pub mod replication;
#[cfg(feature = "sim")]
pub mod sim;
pub mod tls;
pub mod transfer;
pub mod transport;
