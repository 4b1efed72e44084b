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
//! Writes to a bucket with a shadow are serialized (a per-bucket lock around the local write
//! and the write-through), so the shadow applies them in the order the owner did.

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
use shoal_raft::{BucketId, ClusterState, NodeId, BUCKET_COUNT};
use tokio::sync::{Mutex, MutexGuard};

use super::export::Exporter;
use super::frame::{change_frames, end_frame, Decoded, Decoder, HEADER};
use crate::cache::Change;

/// How long a write-through may take before the owner gives up on the shadow.
const WRITE_THROUGH_TIMEOUT: Duration = Duration::from_secs(2);

/// The new owner's side: per-bucket locks and the client that writes through.
pub struct ShadowWriter {
    locks: Vec<Mutex<()>>,
    http: Client<HttpConnector, Full<Bytes>>,
}

/// A held bucket lock and the node shadowing the bucket.
pub struct ShadowGuard<'a> {
    _lock: MutexGuard<'a, ()>,
    /// The bucket.
    pub bucket: BucketId,
    /// The shadow's peer address.
    pub peer_addr: String,
}

impl Default for ShadowWriter {
    fn default() -> Self {
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        connector.set_connect_timeout(Some(WRITE_THROUGH_TIMEOUT));
        ShadowWriter {
            locks: (0..BUCKET_COUNT).map(|_| Mutex::new(())).collect(),
            http: Client::builder(TokioExecutor::new()).build(connector),
        }
    }
}

impl ShadowWriter {
    /// Locks `bucket` for a write if this node serves it and another node shadows it.
    pub async fn guard(&self, state: &ClusterState, me: NodeId, bucket: BucketId) -> Option<ShadowGuard<'_>> {
        if state.map.owner_of(bucket) != Some(me) {
            return None;
        }
        let shadow = state.shadow_of(bucket)?;
        let peer_addr = state.member_of(shadow)?.peer_addr.clone();
        let lock = self.locks[bucket.index()].lock().await;
        Some(ShadowGuard { _lock: lock, bucket, peer_addr })
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

    /// Writes `changes` of the guarded bucket through to its shadow. A shadow that cannot be
    /// reached is logged, not fatal: the owner keeps serving (the shadow only matters if the
    /// owner crashes too).
    pub async fn write_through(&self, guard: &ShadowGuard<'_>, changes: &[Change]) {
        if changes.is_empty() {
            return;
        }
        let mut body = BytesMut::from(&HEADER[..]);
        for c in changes {
            for f in change_frames(c) {
                body.extend_from_slice(&f);
            }
        }
        body.extend_from_slice(&end_frame(0, changes.len() as u64));
        let uri = format!("http://{}/internal/shadow/{}", guard.peer_addr, guard.bucket.0);
        let Ok(request) = Request::post(uri).body(Full::new(body.freeze())) else { return };
        let sent = tokio::time::timeout(WRITE_THROUGH_TIMEOUT, self.http.request(request)).await;
        match sent {
            Ok(Ok(r)) if r.status().is_success() => {}
            Ok(Ok(r)) => {
                tracing::warn!(bucket = guard.bucket.0, status = %r.status(), "shadow refused a write-through")
            }
            Ok(Err(e)) => tracing::warn!(bucket = guard.bucket.0, error = %e, "shadow unreachable"),
            Err(_) => tracing::warn!(bucket = guard.bucket.0, "shadow write-through timed out"),
        }
    }
}

/// `POST /internal/shadow/{bucket}`: applies the owner's writes to this node's shadow copy.
pub(super) async fn apply_shadow(State(exporter): State<Exporter>, Path(bucket): Path<u16>, body: Body) -> Response {
    let bucket = BucketId(bucket);
    let me = exporter.control.node_id();
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
