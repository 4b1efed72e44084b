//! Shadows: the node that handed a bucket over keeps a copy until the transfer is complete,
//! and the new owner writes through to it before acknowledging a write. If the new owner
//! crashes before the transfer ends, it gets its buckets back from the shadows when it
//! restarts (`restore.rs`): nothing it acknowledged is lost.
//!
//! ```text
//!  client ── PUT k ──▶ new owner B: lock bucket, write locally ── POST /internal/shadow/b ──▶ A
//!         ◀── 200 ────  (after A applied it, or A could not be reached: logged)
//! ```
//!
//! Writes to a bucket with a shadow or a replica are serialized (a per-bucket lock around the
//! local write and the write-through), so the shadow and the replica apply them in the order
//! the owner did. The same guard carries the write to the replica (`crate::replication`).

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use bytes::{Bytes, BytesMut};
use http_body_util::{BodyExt, Full};
use hyper::Request;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use shoal_http_api::ApiError;
use shoal_raft::{BucketId, ClusterState, NodeId};
use tokio::sync::MutexGuard;

use super::export::Exporter;
use super::frame::{change_frames, end_frame, Decoded, Decoder, HEADER};
use crate::cache::Change;
use crate::replication::{Holder, Replicator};

/// How long a write-through may take before the owner gives up on the shadow.
const WRITE_THROUGH_TIMEOUT: Duration = Duration::from_secs(2);

/// The owner's side: the client that writes through to shadows, and the replicator whose
/// per-bucket locks serialize writes.
pub struct ShadowWriter {
    replicator: Arc<Replicator>,
    http: Client<HttpConnector, Full<Bytes>>,
}

/// A held bucket lock, the node shadowing the bucket and the one holding its replica.
pub struct ShadowGuard<'a> {
    _lock: MutexGuard<'a, ()>,
    /// The bucket.
    pub bucket: BucketId,
    /// The shadow's peer address.
    pub peer_addr: Option<String>,
    /// The replica holder.
    pub replica: Option<Holder>,
}

impl ShadowWriter {
    /// A writer whose guards also replicate through `replicator`.
    pub fn new(replicator: Arc<Replicator>) -> Self {
        let mut connector = HttpConnector::new();
        connector.set_local_address(shoal_raft::outgoing_ip());
        connector.set_nodelay(true);
        connector.set_connect_timeout(Some(WRITE_THROUGH_TIMEOUT));
        ShadowWriter { replicator, http: Client::builder(TokioExecutor::new()).build(connector) }
    }

    /// Locks `bucket` for a write if this node serves it and another node shadows it or holds
    /// its replica.
    pub async fn guard(&self, state: &ClusterState, me: NodeId, bucket: BucketId) -> Option<ShadowGuard<'_>> {
        if state.map.owner_of(bucket) != Some(me) {
            return None;
        }
        let peer_addr = state.shadow_of(bucket).and_then(|s| state.member_of(s)).map(|m| m.peer_addr.clone());
        let replica = self.replicator.holder_of(state, bucket);
        if peer_addr.is_none() && replica.is_none() {
            return None;
        }
        let lock = self.replicator.lock(bucket).await;
        Some(ShadowGuard { _lock: lock, bucket, peer_addr, replica })
    }

    /// Locks every bucket of `buckets` (ascending, so two bulk writes cannot deadlock) that has
    /// a shadow.
    pub async fn guards(&self, state: &ClusterState, me: NodeId, buckets: &[BucketId]) -> Vec<ShadowGuard<'_>> {
        let mut sorted = buckets.to_vec();
        sorted.sort();
        sorted.dedup();
        let mut guards = Vec::new();
        for b in sorted {
            if let Some(g) = self.guard(state, me, b).await {
                guards.push(g);
            }
        }
        guards
    }

    /// Writes `changes` of the guarded bucket through to its shadow and its replica. A shadow
    /// that cannot be reached is logged, not fatal: the owner keeps serving (the shadow only
    /// matters if the owner crashes too). A replica that did not apply a change (sync mode) is
    /// an error: the caller undoes the write.
    pub async fn write_through(&self, guard: &ShadowGuard<'_>, changes: &[Change]) -> Result<(), ApiError> {
        if changes.is_empty() {
            return Ok(());
        }
        if let Some(peer_addr) = &guard.peer_addr {
            self.write_shadow(guard.bucket, peer_addr, changes).await;
        }
        match &guard.replica {
            Some(holder) => self.replicator.replicate(guard.bucket, holder, changes).await,
            None => Ok(()),
        }
    }

    async fn write_shadow(&self, bucket: BucketId, peer_addr: &str, changes: &[Change]) {
        let mut body = BytesMut::from(&HEADER[..]);
        for c in changes {
            for f in change_frames(c) {
                body.extend_from_slice(&f);
            }
        }
        body.extend_from_slice(&end_frame(0, changes.len() as u64));
        let uri = format!("http://{peer_addr}/internal/shadow/{}", bucket.0);
        let Ok(request) = crate::peer::with_secret(Request::post(uri)).body(Full::new(body.freeze())) else { return };
        let sent = tokio::time::timeout(WRITE_THROUGH_TIMEOUT, self.http.request(request)).await;
        match sent {
            Ok(Ok(r)) if r.status().is_success() => {}
            Ok(Ok(r)) => {
                tracing::warn!(bucket = bucket.0, status = %r.status(), "shadow refused a write-through")
            }
            Ok(Err(e)) => tracing::warn!(bucket = bucket.0, error = %e, "shadow unreachable"),
            Err(_) => tracing::warn!(bucket = bucket.0, "shadow write-through timed out"),
        }
    }
}

/// `POST /internal/shadow/{bucket}`: applies the owner's writes to this node's shadow copy.
pub(super) async fn apply_shadow(State(exporter): State<Exporter>, Path(bucket): Path<u16>, body: Body) -> Response {
    let bucket = BucketId(bucket);
    let me = exporter.control.node_id();
    // The new owner may have applied the move a moment before this node.
    if exporter.control.state().shadow_of(bucket) != Some(me) {
        exporter.control.wait_for_state(Duration::from_secs(2), |s| s.shadow_of(bucket) == Some(me)).await;
    }
    if exporter.control.state().shadow_of(bucket) != Some(me) {
        return (StatusCode::CONFLICT, format!("node {me} holds no shadow of bucket {bucket}")).into_response();
    }
    let bytes = match body.collect().await {
        Ok(b) => b.to_bytes(),
        Err(e) => return (StatusCode::BAD_REQUEST, e.to_string()).into_response(),
    };
    let mut decoder = Decoder::default();
    decoder.feed(&bytes);
    loop {
        match decoder.next_decoded() {
            Ok(Some(Decoded::Change(change))) => {
                let _ = exporter.cache.apply_change(bucket, &change);
            }
            Ok(Some(Decoded::End { .. })) => return StatusCode::NO_CONTENT.into_response(),
            Ok(None) => return (StatusCode::BAD_REQUEST, "truncated").into_response(),
            Err(e) => return (StatusCode::BAD_REQUEST, e.to_string()).into_response(),
        }
    }
}
