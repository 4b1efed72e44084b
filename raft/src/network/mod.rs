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

static CLUSTER_SECRET: OnceLock<String> = OnceLock::new();

/// The header that carries the cluster secret on every request to a peer listener (R62).
pub const SECRET_HEADER: &str = "x-shoal-cluster-secret";

/// Makes every node-to-node request this process sends from now on carry `secret` in
/// [`SECRET_HEADER`]. One secret per process (from `--cluster-secret`): returns false if a
/// different one was set before.
pub fn set_cluster_secret(secret: String) -> bool {
    CLUSTER_SECRET.get_or_init(|| secret.clone()) == &secret
}

/// The cluster secret this process sends, if one was set.
pub fn cluster_secret() -> Option<&'static str> {
    CLUSTER_SECRET.get().map(String::as_str)
}

/// Default headers of the reqwest clients that call peer listeners: the secret, if any.
pub fn secret_headers() -> reqwest::header::HeaderMap {
    let mut headers = reqwest::header::HeaderMap::new();
    if let Some(value) = cluster_secret().and_then(|s| reqwest::header::HeaderValue::from_str(s).ok()) {
        let mut value = value;
        value.set_sensitive(true);
        headers.insert(SECRET_HEADER, value);
    }
    headers
}
