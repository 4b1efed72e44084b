//! What this node answers to other nodes: [`PeerService`] hands every [`PeerRequest`] a node can
//! get to the part of the node that owns it (replication, transfer, failure detection, the node
//! API, the control plane), and [`peer_routes`] turns the peer listener's requests into the same
//! calls. It sits above everything it dispatches to, so `transport/` (the wire) imports none of
//! them. The simulated network calls [`PeerService`] directly, so both run the same handlers.

use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::{Path, Query, Request, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use futures::StreamExt;
use shoal_http_api::types::RouteContext;
use shoal_http_api::{AdminApi, ApiError, KeyApi};
use shoal_raft::{BucketId, ControlError, ControlPlane, ControlRpc, NodeId, ServeError, BUCKET_COUNT};

use crate::api::NodeApi;
use crate::health::Health;
use crate::replication::Replicator;
use crate::transfer::export::Exporter;
use crate::transport::http::{HEADER_RAFT_TARGET, TRANSFER_MEDIA_TYPE};
use crate::transport::{link, wire};
use crate::transport::{CallError, FrameStream, Malformed, PeerAnswer, PeerRequest, StreamRequest};

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
}

fn forwarded(map_version: u64) -> RouteContext {
    RouteContext { forwarded_map_version: Some(map_version), from_peer: true, ..RouteContext::default() }
}

/// [`forwarded`], and for a mirror read the staleness it allows.
fn read_context(map_version: u64, mirror: Option<Duration>) -> RouteContext {
    RouteContext { mirror_read: mirror, ..forwarded(map_version) }
}

impl PeerService {
    /// A read from another node, forwarded or for a mirror (`Get`, `BulkGet`; any other request
    /// is refused). A function of its own, whose future is only as large as a read's: a link
    /// moves a request's future into a box for every request it serves, and [`Self::serve`]'s
    /// holds whatever any request needs (the whole write path among them).
    async fn serve_read(&self, request: PeerRequest) -> Result<PeerAnswer, CallError> {
        let failed = CallError::Api;
        Ok(match request {
            PeerRequest::Get { key, map_version, mirror } => {
                PeerAnswer::Got(self.api.get(key, read_context(map_version, mirror)).await.map_err(failed)?)
            }
            PeerRequest::BulkGet { keys, map_version, mirror } => {
                PeerAnswer::BulkGot(self.api.bulk_get(keys, read_context(map_version, mirror)).await.map_err(failed)?)
            }
            _ => return Err(CallError::Api(ApiError::Internal("a read of another kind".into()))),
        })
    }

    /// A write or delete forwarded from another node, alone or bulk (any other request is
    /// refused), in a function of its own for the same reason as [`Self::serve_read`].
    async fn serve_write(&self, request: PeerRequest) -> Result<PeerAnswer, CallError> {
        let failed = CallError::Api;
        Ok(match request {
            PeerRequest::Put { item, map_version } => {
                PeerAnswer::Put(self.api.put(item, forwarded(map_version)).await.map_err(failed)?)
            }
            PeerRequest::Delete { key, cas, map_version } => {
                self.api.delete(key, cas, forwarded(map_version)).await.map_err(failed)?;
                PeerAnswer::Deleted
            }
            PeerRequest::BulkPut { items, map_version } => {
                PeerAnswer::BulkPut(self.api.bulk_put(items, forwarded(map_version)).await.map_err(failed)?)
            }
            PeerRequest::BulkDelete { keys, map_version } => {
                PeerAnswer::BulkDeleted(self.api.bulk_delete(keys, forwarded(map_version)).await.map_err(failed)?)
            }
            _ => return Err(CallError::Api(ApiError::Internal("a write of another kind".into()))),
        })
    }

    /// Answers one request.
    pub async fn serve(&self, request: PeerRequest) -> Result<PeerAnswer, CallError> {
        let api = &self.api;
        let failed = CallError::Api;
        Ok(match request {
            request @ (PeerRequest::Replicate(_) | PeerRequest::ReplicateBatch(_)) => {
                return self.receive_replicas(request).await
            }
            PeerRequest::Shadow { bucket, body } => {
                self.exporter
                    .apply_shadow(bucket, body)
                    .await
                    .map_err(|(status, reason)| CallError::Refused { status, reason })?;
                PeerAnswer::ShadowApplied
            }
            PeerRequest::GiveBack { from, bucket, body } => {
                self.exporter
                    .take_back(from, bucket, body)
                    .await
                    .map_err(|(status, reason)| CallError::Refused { status, reason })?;
                PeerAnswer::Found
            }
            PeerRequest::Ping(ping) => PeerAnswer::Pong(self.health.pong(ping)),
            PeerRequest::TransferStatus => {
                PeerAnswer::TransferStatus(self.exporter.progress.status(self.control.node_id()))
            }
            request @ (PeerRequest::Get { .. } | PeerRequest::BulkGet { .. }) => return self.serve_read(request).await,
            request @ (PeerRequest::Put { .. }
            | PeerRequest::Delete { .. }
            | PeerRequest::BulkPut { .. }
            | PeerRequest::BulkDelete { .. }) => return self.serve_write(request).await,
            PeerRequest::Keys { prefix, page } => {
                PeerAnswer::Keys(api.keys(prefix, page, shoal_http_api::types::Scope::Local).await.map_err(failed)?)
            }
            PeerRequest::Tagged { tag, page } => {
                PeerAnswer::Keys(api.tagged(tag, page, shoal_http_api::types::Scope::Local).await.map_err(failed)?)
            }
            PeerRequest::RemoveTagged { tag } => {
                PeerAnswer::Removed(api.remove_tagged(tag, shoal_http_api::types::Scope::Local).await.map_err(failed)?)
            }
            PeerRequest::NodeStats => PeerAnswer::NodeStats(api.node_stats()),
            PeerRequest::Cluster => PeerAnswer::Cluster(Box::new(api.cluster().await.map_err(failed)?)),
            PeerRequest::EnterMaintenance { period } => {
                let wait = crate::maintenance::PREPARE_WAIT + crate::maintenance::SYNC_WAIT;
                PeerAnswer::Maintenance(api.maintenance_here(period, wait).await.map_err(failed)?)
            }
            PeerRequest::ReportBuckets(report) => {
                api.receive_bucket_report(*report);
                PeerAnswer::Reported
            }
            PeerRequest::Buckets(query) => PeerAnswer::Buckets(Box::new(api.buckets_here(query).map_err(failed)?)),
            PeerRequest::Rebalance(request) => {
                PeerAnswer::Rebalance(Box::new(api.rebalance_here(request).await.map_err(failed)?))
            }
        })
    }

    /// Opens a stream.
    pub async fn open_stream(&self, request: StreamRequest) -> Result<FrameStream, CallError> {
        let StreamRequest::Bucket { bucket, to, epoch, restore } = request;
        let refused = |(status, reason)| CallError::Refused { status, reason };
        if restore {
            // A restarted owner gets the copy this node holds back: a plain snapshot.
            let frames = self.replicator.copy_back(bucket, to, epoch).await.map_err(refused)?;
            self.exporter.progress.sent(frames.iter().map(|f| f.len() as u64).sum());
            return Ok(Box::pin(futures::stream::iter(frames.into_iter().map(Ok))));
        }
        self.exporter.open(bucket, to, epoch).await.map_err(refused)
    }

    /// Applies (or refuses) replica writes, each of a batch as if it came alone: they are of
    /// distinct buckets, since an owner has one replica write per bucket in flight. A function
    /// of its own for the same reason as [`Self::serve_read`].
    async fn receive_replicas(&self, request: PeerRequest) -> Result<PeerAnswer, CallError> {
        Ok(match request {
            PeerRequest::Replicate(r) => PeerAnswer::Replicated(self.replicator.receive(r).await),
            PeerRequest::ReplicateBatch(requests) => PeerAnswer::ReplicatedBatch(
                futures::future::join_all(requests.into_iter().map(|r| self.replicator.receive(r))).await,
            ),
            _ => return Err(CallError::Api(ApiError::Internal("a replica write of another kind".into()))),
        })
    }

    /// Takes a request that came over a peer link (`transport::link`): its kind and payload
    /// in; out, the handling that answers it (`transport::wire`), or why it does not read (the
    /// link then closes).
    pub fn serve_link_request(self: &Arc<Self>, kind: u8, payload: &Bytes) -> Result<link::Handling, Malformed> {
        let (request, deadline_ms) = wire::decode_request(kind, payload)?;
        let service = self.clone();
        Ok(Box::pin(async move { service.answer_link_request(kind, request, deadline_ms).await }))
    }

    /// Answers a request that came over a peer link, by its kind.
    async fn answer_link_request(&self, kind: u8, request: PeerRequest, deadline_ms: Option<u64>) -> (u8, Vec<u8>) {
        // Every request but a read is boxed: their futures are large (the whole write path),
        // and this one is moved into a box for every request the link serves, a read too; so
        // it stays as small as a read's.
        let counted = &self.api.metrics().link_requests;
        let answer = match kind {
            wire::READ => self.serve_link_read(request, deadline_ms).await,
            wire::WRITE => Box::pin(self.serve_link_write(request, deadline_ms)).await,
            wire::REPLICATE => {
                counted.replica_writes.increment(1);
                wire::encode_answer(Box::pin(self.receive_replicas(request)).await)
            }
            _ => {
                counted.calls.increment(1);
                wire::encode_answer(Box::pin(self.serve(request)).await)
            }
        };
        (wire::ANSWER, answer)
    }

    /// A forwarded or mirror read that came over a peer link: served as any read from another
    /// node ([`Self::serve_read`]), unless it arrived after its sender's deadline (refused: nothing
    /// is done) or names keys this node's own limits refuse (nodes configured differently: the
    /// read fails as the key route would fail it); a bulk read's values are admitted into the
    /// node's budget for answer bodies while they are encoded, as the bulk route admits them.
    async fn serve_link_read(&self, request: PeerRequest, deadline_ms: Option<u64>) -> Vec<u8> {
        let failed = |e| wire::encode_answer(Err(CallError::Api(e)));
        let keys = match &request {
            PeerRequest::Get { key, .. } => std::slice::from_ref(key),
            PeerRequest::BulkGet { keys, .. } => keys.as_slice(),
            _ => &[],
        };
        if let Err(e) = admissible(keys.iter().map(|k| (k, 0)), &self.api.limits()).and_then(|_| in_time(deadline_ms)) {
            return failed(e);
        }
        self.api.metrics().link_requests.reads.increment(1);
        let bulk = matches!(request, PeerRequest::BulkGet { .. });
        let answer = self.serve_read(request).await;
        let _admitted = match &answer {
            Ok(PeerAnswer::BulkGot(items)) if bulk => {
                let values = items.iter().flatten().flatten().map(|ok| ok.value.len()).sum();
                match self.api.admit_body(values).await {
                    Ok(permit) => Some(permit),
                    Err(e) => return failed(e),
                }
            }
            _ => None,
        };
        wire::encode_answer(answer)
    }

    /// A forwarded write or delete, alone or bulk, that came over a peer link: checked against
    /// this node's limits (nodes configured differently: it fails whole, as a forwarded read
    /// does) and its values admitted into the node's body budget, as the key routes do, then
    /// served as any forward from another node ([`Self::serve_write`]), unless it arrived after its
    /// sender's deadline (refused, nothing done). The link cancels it when its sender gives up,
    /// and bounds how many a sender has in flight (`transport::link`).
    async fn serve_link_write(&self, request: PeerRequest, deadline_ms: Option<u64>) -> Vec<u8> {
        let failed = |e| wire::encode_answer(Err(CallError::Api(e)));
        if let Err(e) = in_time(deadline_ms) {
            return failed(e);
        }
        self.api.metrics().link_requests.writes.increment(1);
        let limits = self.api.limits();
        let items = match &request {
            PeerRequest::Put { item, .. } => admissible([(&item.key, item.value.len())].into_iter(), &limits),
            PeerRequest::Delete { key, .. } => admissible([(key, 0)].into_iter(), &limits),
            PeerRequest::BulkPut { items, .. } => admissible(items.iter().map(|i| (&i.key, i.value.len())), &limits),
            PeerRequest::BulkDelete { keys, .. } => admissible(keys.iter().map(|k| (k, 0)), &limits),
            _ => Err(ApiError::Internal("a link write of another kind".into())),
        };
        let values = match items {
            Ok(values) => values,
            Err(e) => return failed(e),
        };
        let _admitted = match self.api.admit_body(values).await {
            Ok(permit) => permit,
            Err(e) => return failed(e),
        };
        wire::encode_answer(self.serve_write(request).await)
    }

    /// A control-plane message.
    pub async fn control(&self, target: Option<NodeId>, rpc: ControlRpc, body: &[u8]) -> Result<Vec<u8>, ServeError> {
        // A node the cluster failed no longer hears from the leader: the leader it would
        // forward to is the one it knew before, perhaps itself cut off, or gone. The asker
        // (a joiner, say) turns to another member at once instead.
        if matches!(rpc, ControlRpc::Admin { forwarded: false }) && self.health.is_removed() {
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

/// Whether a forward that came with its sender's deadline (Unix time) is served: refused once
/// it has passed (its sender no longer waits: nothing is done).
fn in_time(deadline_ms: Option<u64>) -> Result<(), ApiError> {
    match deadline_ms {
        Some(deadline) if shoal_http_api::unix_ms() > deadline => Err(ApiError::unavailable(
            shoal_http_api::Unavailable::Expired,
            "the forwarded request arrived after its deadline; nothing was done",
        )),
        _ => Ok(()),
    }
}

/// The bytes of the values of a forward's keys and value sizes, or why this node's
/// limits refuse it: too many keys, a key or a value too large.
fn admissible<'a>(
    items: impl Iterator<Item = (&'a String, usize)>,
    limits: &shoal_http_api::Limits,
) -> Result<usize, ApiError> {
    let mut total = 0;
    for (n, (key, value)) in items.enumerate() {
        if n == limits.max_bulk_keys {
            return Err(ApiError::BadRequest(format!("at most {} keys per bulk request", limits.max_bulk_keys)));
        }
        shoal_http_api::check_key(key, limits)?;
        if value > limits.max_value_bytes {
            return Err(ApiError::ValueTooLarge { limit: limits.max_value_bytes });
        }
        total += value;
    }
    Ok(total)
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
                let handler: link::Handler = Arc::new(move |kind, payload| s.serve_link_request(kind, &payload));
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
