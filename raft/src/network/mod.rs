//! Raft's transport and the control plane's internal endpoints, over HTTP on the peer
//! listener.
//!
//! - `client.rs`: [`HttpRaftNetwork`], openraft's network factory: one shared reqwest client,
//!   JSON bodies, connect errors reported as `Unreachable` so openraft backs off.
//! - `server.rs`: [`peer_router`], the axum routes that receive Raft RPCs and admin requests.
//! - `admin.rs`: [`AdminRequest`]/[`AdminResponse`], the join/leave protocol, and
//!   [`AdminClient`] that sends them to a member's peer address.

mod admin;
mod client;
mod server;

pub use admin::{AdminClient, AdminRequest, AdminResponse, MemberStatus};
pub use client::HttpRaftNetwork;
pub use server::peer_router;

use std::net::IpAddr;
use std::sync::OnceLock;

static OUTGOING_IP: OnceLock<IpAddr> = OnceLock::new();

/// Makes every node-to-node connection this process opens from now on leave from `ip`.
/// A node listening on its own loopback address (127.0.0.x) sets it at start-up, so that
/// firewall rules can tell nodes apart by source address (fault tests cut links that way).
/// Set once per process; later calls are ignored.
pub fn set_outgoing_ip(ip: IpAddr) {
    let _ = OUTGOING_IP.set(ip);
}

/// The source address of node-to-node connections, if one was set.
pub fn outgoing_ip() -> Option<IpAddr> {
    OUTGOING_IP.get().copied()
}
