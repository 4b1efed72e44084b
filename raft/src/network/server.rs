//! The receiving side: Raft RPCs and admin requests on the peer listener.

use axum::extract::{Path, Query, State};
use axum::routing::{get, post};
use axum::{Json, Router};
use openraft::error::InstallSnapshotError;
use openraft::raft::{
    AppendEntriesRequest, AppendEntriesResponse, InstallSnapshotRequest, InstallSnapshotResponse, VoteRequest,
    VoteResponse,
};

use super::admin::{AdminRequest, AdminResponse, MemberStatus};
use crate::control::ControlPlane;
use crate::distribution::NodeId;
use crate::error::ControlError;
use crate::types::{RaftError, TypeConfig};

/// The control plane's routes, to be served on the peer listener:
/// `POST /raft/{append,vote,snapshot}`, `POST /internal/admin`, `GET /internal/members/{id}`.
///
/// Raft handlers answer with the whole `Result` as JSON so the sender can rebuild a remote
/// Raft error; transport failures are HTTP errors.
pub fn peer_router(control: ControlPlane) -> Router {
    Router::new()
        .route("/raft/append", post(append))
        .route("/raft/vote", post(vote))
        .route("/raft/snapshot", post(snapshot))
        .route("/internal/admin", post(admin))
        .route("/internal/members/{id}", get(member_status))
        .with_state(control)
}

async fn append(
    State(control): State<ControlPlane>,
    Json(req): Json<AppendEntriesRequest<TypeConfig>>,
) -> Json<Result<AppendEntriesResponse<NodeId>, RaftError>> {
    Json(control.raft().append_entries(req).await)
}

async fn vote(
    State(control): State<ControlPlane>,
    Json(req): Json<VoteRequest<NodeId>>,
) -> Json<Result<VoteResponse<NodeId>, RaftError>> {
    Json(control.raft().vote(req).await)
}

async fn snapshot(
    State(control): State<ControlPlane>,
    Json(req): Json<InstallSnapshotRequest<TypeConfig>>,
) -> Json<Result<InstallSnapshotResponse<NodeId>, RaftError<InstallSnapshotError>>> {
    Json(control.raft().install_snapshot(req).await)
}

/// `?forwarded=true` marks a request another member already forwarded to us as the leader:
/// we handle it or answer `NotLeader`, never forward again, so requests cannot loop while
/// leadership moves.
#[derive(serde::Deserialize)]
struct AdminQuery {
    #[serde(default)]
    forwarded: bool,
}

async fn admin(
    State(control): State<ControlPlane>,
    Query(query): Query<AdminQuery>,
    Json(req): Json<AdminRequest>,
) -> Json<Result<AdminResponse, ControlError>> {
    if query.forwarded {
        Json(control.admin_as_leader(req).await)
    } else {
        Json(control.admin(req).await)
    }
}

async fn member_status(State(control): State<ControlPlane>, Path(id): Path<NodeId>) -> Json<MemberStatus> {
    Json(control.member_status(id))
}
