//! `shoal-http-api`: the public HTTP surface of a shoal node.
//!
//! [`router`] builds the axum routes over any [`ShoalApi`] (the node implements it; tests use
//! a fake). This crate parses and validates requests, renders answers, and maps every
//! [`ApiError`] to one RFC 9457 problem document; it decides nothing about where a key lives.
//! JSON everywhere except values, which are raw bytes in and out so curl prints them.
//! `README.md` beside this crate lists every endpoint with its codes.
//!
//! # Layout
//! - `api.rs`: the contract with the node in three parts — [`KeyApi`], [`AdminApi`], [`Probes`]
//!   ([`ShoalApi`] is all three) — and [`Limits`].
//! - `kv.rs`: key, bulk, listing and tag routes.
//! - `json.rs`: the bulk-get answer written straight into a buffer.
//! - `cluster.rs`: cluster, map, leave, health and metrics routes.
//! - `types.rs`: request and response bodies.
//! - `error.rs`: [`ApiError`] and [`Problem`].
//! - [`openapi`]: the OpenAPI description served at `/openapi.json`.

mod api;
mod cluster;
mod de;
mod error;
mod json;
mod kv;
pub mod openapi;
pub mod types;

#[cfg(test)]
mod tests;

use std::sync::Arc;

use axum::routing::{get, post};
use axum::Router;

pub use api::{AdminApi, BodyPermit, KeyApi, Limits, Probes, PutItem, ShoalApi};
pub use cluster::{
    maintenance_period, EVENTS_DEFAULT_LIMIT, MAINTENANCE_DEFAULT, MAINTENANCE_MAX, MAINTENANCE_MIN, MAP_WAIT_DEFAULT,
    MAP_WAIT_MAX,
};
pub use error::{code, ApiError, Problem, Unavailable, PROBLEM_JSON};
pub use kv::{
    check_key, format_duration, parse_duration, put_options, unix_ms, value_response, MAX_EXPIRY, PARSED_COPIES,
};

use axum::http::HeaderName;

// Header names are constants (`from_static` is evaluated at compile time), so the hot path
// never parses or hashes a name string.

/// `local` on a keyless request: answer from this node's buckets only (the client library
/// asks every member so).
pub const HEADER_SCOPE: HeaderName = HeaderName::from_static("x-shoal-scope");
/// The bucket of the key in a GET answer.
pub const HEADER_BUCKET: HeaderName = HeaderName::from_static("x-shoal-bucket");
/// The node that served the key in a GET answer (its owner, or a mirror holding its replica).
pub const HEADER_NODE: HeaderName = HeaderName::from_static("x-shoal-node");
/// In a GET answer served from a replica copy: at most how far behind its owner that copy was,
/// in milliseconds.
pub const HEADER_REPLICA_LAG: HeaderName = HeaderName::from_static("x-shoal-replica-lag-ms");

async fn openapi_json() -> impl axum::response::IntoResponse {
    ([(axum::http::header::CONTENT_TYPE, "application/json")], openapi::document())
}

/// Whether `path` belongs to the key API (`/v1/kv`, `/v1/bulk/...`, `/v1/tags/...`): the
/// routes a `--client-token` guards.
pub fn is_key_path(path: &str) -> bool {
    let path = path.split_once('?').map_or(path, |(p, _)| p);
    path == "/v1/kv" || path.starts_with("/v1/kv/") || path.starts_with("/v1/bulk/") || path.starts_with("/v1/tags/")
}

/// The token a client sends to `path`: the client token to the key API (when it has one), the
/// admin token everywhere else (it opens the key API too).
pub fn token_for<'a, T: ?Sized>(path: &str, client: Option<&'a T>, admin: Option<&'a T>) -> Option<&'a T> {
    match client {
        Some(t) if is_key_path(path) => Some(t),
        _ => admin,
    }
}

/// The public routes over `node`.
pub fn router<N: ShoalApi>(node: Arc<N>) -> Router {
    Router::new()
        .route("/v1/kv/{*key}", get(kv::get_key::<N>).put(kv::put_key::<N>).delete(kv::delete_key::<N>))
        .route("/v1/kv", get(kv::list_keys::<N>))
        .route("/v1/bulk/get", post(kv::bulk_get::<N>))
        .route("/v1/bulk/put", post(kv::bulk_put::<N>))
        .route("/v1/bulk/delete", post(kv::bulk_delete::<N>))
        .route("/v1/tags/{tag}", get(kv::get_tag::<N>).delete(kv::delete_tag::<N>))
        .route("/v1/cluster", get(cluster::cluster::<N>))
        .route("/v1/cluster/health", get(cluster::health::<N>))
        .route("/v1/cluster/map", get(cluster::map::<N>))
        .route("/v1/cluster/events", get(cluster::events::<N>))
        .route("/v1/cluster/transfer", get(cluster::transfer::<N>))
        .route("/v1/cluster/agents", get(cluster::agents::<N>))
        .route("/v1/cluster/buckets", get(cluster::buckets::<N>))
        .route("/v1/cluster/rebalance", post(cluster::rebalance::<N>))
        .route("/v1/cluster/nodes/{id}/leave", post(cluster::leave::<N>))
        .route(
            "/v1/cluster/nodes/{id}/maintenance",
            post(cluster::enter_maintenance::<N>).delete(cluster::end_maintenance::<N>),
        )
        .route("/v1/cluster/config", get(cluster::config::<N>).put(cluster::set_config::<N>))
        .route("/v1/cluster/lost/clear", post(cluster::clear_lost::<N>))
        .route("/v1/node", get(cluster::node_stats::<N>))
        .route("/livez", get(cluster::livez::<N>))
        .route("/readyz", get(cluster::readyz::<N>))
        .route("/metrics", get(cluster::metrics::<N>))
        .route("/openapi.json", get(openapi_json))
        .fallback(|| async { ApiError::UnknownResource("no such route".into()) })
        .method_not_allowed_fallback(|| async { ApiError::MethodNotAllowed })
        .with_state(node)
}
