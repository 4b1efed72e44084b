//! The receiving side: Raft RPCs and admin requests on the peer listener.

use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
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

/// The header naming the Raft node a request is meant for.
pub(crate) const HEADER_RAFT_TARGET: &str = "x-shoal-raft-target";

/// Refuses a Raft RPC meant for another node id: a node that rejoined under a new id on the
/// same address must not receive the old id's log (openraft would see a follower whose log
/// went backwards).
fn addressed_to_me(control: &ControlPlane, headers: &HeaderMap) -> Result<(), (StatusCode, String)> {
    let target = headers.get(HEADER_RAFT_TARGET).and_then(|v| v.to_str().ok()?.parse::<NodeId>().ok());
    match target {
        Some(t) if t != control.node_id() => {
            Err((StatusCode::MISDIRECTED_REQUEST, format!("this is node {}, not node {t}", control.node_id())))
        }
        _ => Ok(()),
    }
}

async fn append(
    State(control): State<ControlPlane>,
    headers: HeaderMap,
    Json(req): Json<AppendEntriesRequest<TypeConfig>>,
) -> Result<Json<Result<AppendEntriesResponse<NodeId>, RaftError>>, (StatusCode, String)> {
    addressed_to_me(&control, &headers)?;
    Ok(Json(control.raft().append_entries(req).await))
}

async fn vote(
    State(control): State<ControlPlane>,
    headers: HeaderMap,
    Json(req): Json<VoteRequest<NodeId>>,
) -> Result<Json<Result<VoteResponse<NodeId>, RaftError>>, (StatusCode, String)> {
    addressed_to_me(&control, &headers)?;
    Ok(Json(control.raft().vote(req).await))
}

async fn snapshot(
    State(control): State<ControlPlane>,
    headers: HeaderMap,
    Json(req): Json<InstallSnapshotRequest<TypeConfig>>,
) -> Result<Json<Result<InstallSnapshotResponse<NodeId>, RaftError<InstallSnapshotError>>>, (StatusCode, String)> {
    addressed_to_me(&control, &headers)?;
    Ok(Json(control.raft().install_snapshot(req).await))
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
