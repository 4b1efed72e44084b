//! What this node answers to other nodes: [`PeerService`] holds the handlers every part of the
//! node registers for its own messages (replication, transfer, failure detection, the node
//! API; `transport::wire::Handlers`), and [`peer_routes`] turns the peer listener's requests
//! into calls of them: links, bucket streams, and the control plane's messages. It sits above
//! everything it serves, so `transport/` (the wire) imports none of them. The simulated network
//! hands its messages to the same handlers.

use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::extract::{Path, Query, Request, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use futures::StreamExt;
use shoal_raft::{BucketId, ControlError, ControlPlane, ControlRpc, NodeId, ServeError, BUCKET_COUNT};

use crate::api::NodeApi;
use crate::health::Health;
use crate::replication::Replicator;
use crate::transfer::export::Exporter;
use crate::transport::http::{HEADER_RAFT_TARGET, TRANSFER_MEDIA_TYPE};
use crate::transport::wire::{self, Handlers};
use crate::transport::{link, CallError, FrameStream, Malformed, StreamRequest};

/// Everything a node answers to other nodes.
pub struct PeerService {
    /// The control plane (Raft and admin messages).
    pub control: ControlPlane,
    /// The public API (forwarded key operations, broadcasts).
    pub api: Arc<NodeApi>,
    /// The replica holder's side.
    pub replicator: Arc<Replicator>,
    /// Bucket streams and shadows.
    pub exporter: Exporter,
    /// Pings.
    pub health: Arc<Health>,
    /// The handler of every message another node sends here, registered by the part that owns it.
    handlers: Handlers,
}

impl PeerService {
    /// The service of these parts, each of which registers the handlers of its messages.
    pub fn new(
        control: ControlPlane,
        api: Arc<NodeApi>,
        replicator: Arc<Replicator>,
        exporter: Exporter,
        health: Arc<Health>,
    ) -> Self {
        let mut handlers = Handlers::default();
        crate::replication::register(&mut handlers, &replicator.holder);
        crate::transfer::register(&mut handlers, &exporter);
        crate::health::register(&mut handlers, &health);
        crate::mirror::register(&mut handlers);
        crate::api::register(&mut handlers, &api);
        PeerService { control, api, replicator, exporter, health, handlers }
    }

    /// Takes a request that came over a peer link (`transport::link`), or over the simulated
    /// network: its kind and payload in; out, the handling that answers it, or why it does not
    /// read (the link then closes). `now_ms` is this node's clock (Unix ms), which a forward's
    /// deadline is held against.
    pub fn serve_message(&self, kind: u8, payload: &Bytes, now_ms: u64) -> Result<link::Handling, Malformed> {
        let handling = self.handlers.serve(kind, payload, now_ms)?;
        let counted = &self.api.metrics().link_requests;
        match kind {
            wire::READ => counted.reads.increment(1),
            wire::WRITE => counted.writes.increment(1),
            wire::REPLICATE => counted.replica_writes.increment(1),
            _ => counted.calls.increment(1),
        }
        Ok(handling)
    }

    /// Opens a stream.
    pub async fn open_stream(&self, request: StreamRequest) -> Result<FrameStream, CallError> {
        let StreamRequest::Bucket { bucket, to, epoch, restore } = request;
        let refused = |(status, reason)| CallError::Refused { status, reason };
        if restore {
            // A restarted owner gets the copy this node holds back: a plain snapshot.
            let frames = self.replicator.holder.copy_back(bucket, to, epoch).await.map_err(refused)?;
            self.exporter.progress.sent(frames.iter().map(|f| f.len() as u64).sum());
            return Ok(Box::pin(futures::stream::iter(frames.into_iter().map(Ok))));
        }
        self.exporter.open(bucket, to, epoch).await.map_err(refused)
    }

    /// A control-plane message.
    pub async fn control(&self, target: Option<NodeId>, rpc: ControlRpc, body: &[u8]) -> Result<Vec<u8>, ServeError> {
        // A node the cluster failed no longer hears from the leader: the leader it would
        // forward to is the one it knew before, perhaps itself cut off, or gone. The asker
        // (a joiner, say) turns to another member at once instead.
        if matches!(rpc, ControlRpc::Admin { forwarded: false }) && self.exporter.facts.is_failed() {
            let refusal: Result<(), ControlError> = Err(ControlError::NoLeader {
                detail: format!(
                    "the cluster failed node {}: it rejoins as a new member; ask another member",
                    self.control.node_id()
                ),
            });
            return Ok(serde_json::to_vec(&refusal).unwrap_or_default());
        }
        self.control.serve_rpc(target, rpc, body).await
    }
}

/// The peer listener's routes (the cluster secret is checked in front of them, `crate::auth`):
/// Raft (`/raft/{append,vote,snapshot}`), admin (`/internal/admin`, `/internal/members/{id}`),
/// bucket streams (`/internal/transfer/{bucket}`), and peer links (`/internal/link`, an
/// upgrade, which carry every other request; the links it opens end when `shutdown` turns
/// true, and `served` counts them while they run).
///
/// Bodies have no size limit here: a replica snapshot carries a whole bucket and a
/// replicated write a whole value (up to `--max-value-bytes`), and only members that know
/// the cluster secret send them. (axum's default of 2 MB refused every bucket snapshot
/// larger than that, so such buckets never got their replica.)
pub fn peer_routes(
    service: Arc<PeerService>,
    shutdown: tokio::sync::watch::Receiver<bool>,
    served: link::Served,
) -> Router {
    Router::new()
        .route(
            "/internal/link",
            get(move |State(s): State<Arc<PeerService>>, request: Request| {
                let handler: link::Handler =
                    Arc::new(move |kind, payload| s.serve_message(kind, &payload, shoal_http_api::unix_ms()));
                link::accept(request, handler, shutdown.clone(), served.clone())
            }),
        )
        .route("/raft/append", post(raft_append))
        .route("/raft/vote", post(raft_vote))
        .route("/raft/snapshot", post(raft_snapshot))
        .route("/internal/admin", post(admin))
        .route("/internal/members/{id}", get(member_status))
        .route("/internal/transfer/{bucket}", get(stream_bucket))
        .layer(axum::extract::DefaultBodyLimit::disable())
        .with_state(service)
}

fn control_answer(result: Result<Vec<u8>, ServeError>) -> Response {
    match result {
        Ok(body) => ([(axum::http::header::CONTENT_TYPE, "application/json")], body).into_response(),
        Err(ServeError::Misdirected(reason)) => (StatusCode::MISDIRECTED_REQUEST, reason).into_response(),
        Err(ServeError::BadRequest(reason)) => (StatusCode::BAD_REQUEST, reason).into_response(),
    }
}

fn raft_target(headers: &HeaderMap) -> Option<NodeId> {
    headers.get(HEADER_RAFT_TARGET).and_then(|v| v.to_str().ok()?.parse().ok())
}

async fn raft_append(State(s): State<Arc<PeerService>>, headers: HeaderMap, body: Bytes) -> Response {
    control_answer(s.control(raft_target(&headers), ControlRpc::Append, &body).await)
}

async fn raft_vote(State(s): State<Arc<PeerService>>, headers: HeaderMap, body: Bytes) -> Response {
    control_answer(s.control(raft_target(&headers), ControlRpc::Vote, &body).await)
}

async fn raft_snapshot(State(s): State<Arc<PeerService>>, headers: HeaderMap, body: Bytes) -> Response {
    control_answer(s.control(raft_target(&headers), ControlRpc::Snapshot, &body).await)
}

#[derive(serde::Deserialize)]
struct AdminQuery {
    #[serde(default)]
    forwarded: bool,
}

async fn admin(State(s): State<Arc<PeerService>>, Query(q): Query<AdminQuery>, body: Bytes) -> Response {
    control_answer(s.control(None, ControlRpc::Admin { forwarded: q.forwarded }, &body).await)
}

async fn member_status(State(s): State<Arc<PeerService>>, Path(node_id): Path<NodeId>) -> Response {
    control_answer(s.control(None, ControlRpc::MemberStatus { node_id }, &[]).await)
}

/// The bucket of a path, or the 400 to answer.
fn bucket_of_path(bucket: u16) -> Result<BucketId, (StatusCode, String)> {
    if usize::from(bucket) >= BUCKET_COUNT {
        return Err((StatusCode::BAD_REQUEST, format!("no bucket {bucket}")));
    }
    Ok(BucketId(bucket))
}

/// Query of the bucket stream.
#[derive(serde::Deserialize)]
struct StreamQuery {
    to: NodeId,
    epoch: u64,
    #[serde(default)]
    restore: bool,
}

async fn stream_bucket(
    State(s): State<Arc<PeerService>>,
    Path(bucket): Path<u16>,
    Query(q): Query<StreamQuery>,
) -> Response {
    let bucket = match bucket_of_path(bucket) {
        Ok(b) => b,
        Err(refusal) => return refusal.into_response(),
    };
    let request = StreamRequest::Bucket { bucket, to: q.to, epoch: q.epoch, restore: q.restore };
    match s.open_stream(request).await {
        Ok(frames) => {
            let body = Body::from_stream(frames.map(|f| f.map_err(|e| std::io::Error::other(e.to_string()))));
            (StatusCode::OK, [(axum::http::header::CONTENT_TYPE, TRANSFER_MEDIA_TYPE)], body).into_response()
        }
        Err(CallError::Refused { status, reason }) => {
            (StatusCode::from_u16(status).unwrap_or(StatusCode::CONFLICT), reason).into_response()
        }
        Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response(),
    }
}
