//! The holder's endpoint: `POST /internal/replicate/{bucket}`, fenced by the map.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::Router;
use http_body_util::BodyExt;
use shoal_raft::{BucketId, NodeId, BUCKET_COUNT};

use super::{Replicator, HEADER_FROM, HEADER_MAP_VERSION, HEADER_SEQ, HEADER_SNAPSHOT};
use crate::transfer::frame::{Decoded, Decoder};

/// How long the holder waits to apply the sender's map version.
const MAP_CATCH_UP: Duration = Duration::from_secs(2);

pub(super) fn routes(replicator: Arc<Replicator>) -> Router {
    Router::new().route("/internal/replicate/{bucket}", post(replicate)).with_state(replicator)
}

fn header_u64(headers: &HeaderMap, name: &str) -> Option<u64> {
    headers.get(name)?.to_str().ok()?.parse().ok()
}

/// Applies a snapshot (replacing the replica bucket) or changes (only on top of a snapshot of
/// the same owner: else `412`, and the owner sends a snapshot). `409` when, in a map at least
/// as new as the sender's, the sender does not own the bucket or this node is not its replica.
async fn replicate(
    State(r): State<Arc<Replicator>>,
    Path(bucket): Path<u16>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    if usize::from(bucket) >= BUCKET_COUNT {
        return (StatusCode::BAD_REQUEST, format!("no bucket {bucket}")).into_response();
    }
    let bucket = BucketId(bucket);
    let (Some(from), Some(version)) = (header_u64(&headers, HEADER_FROM), header_u64(&headers, HEADER_MAP_VERSION))
    else {
        return (StatusCode::BAD_REQUEST, "missing sender or map version").into_response();
    };
    let from: NodeId = from;
    let snapshot = headers.get(HEADER_SNAPSHOT).is_some_and(|v| v == "1");
    let bytes = match body.collect().await {
        Ok(b) => b.to_bytes(),
        Err(e) => return (StatusCode::BAD_REQUEST, e.to_string()).into_response(),
    };
    let mut decoder = Decoder::default();
    decoder.feed(&bytes);
    let mut changes = Vec::new();
    let counter = loop {
        match decoder.next_decoded() {
            Ok(Some(Decoded::Change(change))) => changes.push(change),
            Ok(Some(Decoded::End { version_counter, .. })) => break version_counter,
            Ok(None) => return (StatusCode::BAD_REQUEST, "truncated").into_response(),
            Err(e) => return (StatusCode::BAD_REQUEST, e.to_string()).into_response(),
        }
    };
    if r.control.state().map.version < version {
        r.control.wait_for_state(MAP_CATCH_UP, |s| s.map.version >= version).await;
    }
    // Everything decoded: nothing is half-applied by a bad request. The fence is checked and
    // the request applied under the bucket's lock, which promotion and cleanup take too, on
    // the newest applied state: a request checked before a failover cannot land after it.
    let seq = header_u64(&headers, HEADER_SEQ).unwrap_or(0);
    let mut applied = r.applied[bucket.index()].lock();
    let state = r.control.state();
    if state.map.owner_of(bucket) != Some(from) || state.replica_of(from) != Some(r.me) {
        return (
            StatusCode::CONFLICT,
            [(HEADER_MAP_VERSION, state.map.version.to_string())],
            format!(
                "fenced: at map {} bucket {bucket} is owned by {:?} and node {} is not its replica holder",
                state.map.version,
                state.map.owner_of(bucket),
                r.me
            ),
        )
            .into_response();
    }
    let source = &r.sources[bucket.index()];
    if applied.0 == from && seq <= applied.1 {
        // A request held up in the network after a newer one: the sender re-sends the bucket.
        return (StatusCode::PRECONDITION_FAILED, "a newer request of this sender was applied already").into_response();
    }
    if !snapshot && source.load(Ordering::Acquire) != from {
        return (StatusCode::PRECONDITION_FAILED, "no snapshot of this bucket yet").into_response();
    }
    *applied = (from, seq);
    if snapshot {
        source.store(0, Ordering::Release);
        r.replica.take_bucket(bucket);
    }
    for change in &changes {
        let _ = r.replica.apply_change(bucket, change);
    }
    if snapshot {
        r.replica.raise_version_counter(bucket, counter);
        source.store(from, Ordering::Release);
    }
    drop(applied);
    StatusCode::NO_CONTENT.into_response()
}
