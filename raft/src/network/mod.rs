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
