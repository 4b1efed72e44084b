//! The receiving side of every control-plane message: [`ControlPlane::serve_rpc`]. The node's
//! transport hands it what arrived (from an HTTP route, or from the simulated network) and
//! sends back what it returns.

use openraft::error::InstallSnapshotError;
use openraft::raft::{AppendEntriesRequest, AppendEntriesResponse, InstallSnapshotRequest, VoteRequest};
use serde::de::DeserializeOwned;
use serde::Serialize;

use super::admin::AdminRequest;
use super::ControlRpc;
use crate::control::ControlPlane;
use crate::distribution::NodeId;
use crate::error::ControlError;
use crate::types::{RaftError, TypeConfig};

/// Why a message was not handled.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ServeError {
    /// The message is for another node id than this node's (HTTP 421).
    #[error("{0}")]
    Misdirected(String),
    /// The body is not the message it should be (HTTP 400).
    #[error("{0}")]
    BadRequest(String),
}

fn decode<T: DeserializeOwned>(body: &[u8]) -> Result<T, ServeError> {
    serde_json::from_slice(body).map_err(|e| ServeError::BadRequest(e.to_string()))
}

fn encode<T: Serialize>(answer: &T) -> Vec<u8> {
    // Our own types serialize infallibly (no maps with non-string keys, no custom errors).
    serde_json::to_vec(answer).unwrap_or_default()
}

impl ControlPlane {
    /// Handles one message for `rpc` meant for node `target` (when the sender knew it) and
    /// answers the serialized result. Raft answers carry the whole `Result` so the sender can
    /// rebuild a remote Raft error.
    pub async fn serve_rpc(&self, target: Option<NodeId>, rpc: ControlRpc, body: &[u8]) -> Result<Vec<u8>, ServeError> {
        if let Some(t) = target.filter(|&t| t != self.node_id()) {
            return Err(ServeError::Misdirected(format!("this is node {}, not node {t}", self.node_id())));
        }
        Ok(match rpc {
            ControlRpc::Append => {
                let req: AppendEntriesRequest<TypeConfig> = decode(body)?;
                let answer = self.raft().append_entries(req).await;
                if matches!(answer, Ok(ref a) if !matches!(a, AppendEntriesResponse::HigherVote(_))) {
                    self.heard_leader();
                }
                encode(&answer)
            }
            ControlRpc::Vote => {
                let req: VoteRequest<NodeId> = decode(body)?;
                encode(&self.raft().vote(req).await)
            }
            ControlRpc::Snapshot => {
                let req: InstallSnapshotRequest<TypeConfig> = decode(body)?;
                let answer: Result<_, RaftError<InstallSnapshotError>> = self.raft().install_snapshot(req).await;
                encode(&answer)
            }
            ControlRpc::Admin { forwarded } => {
                let req: AdminRequest = decode(body)?;
                // A forwarded request is handled here or answered `NotLeader`, never forwarded
                // again, so requests cannot loop while leadership moves.
                let answer: Result<_, ControlError> =
                    if forwarded { self.admin_as_leader(req).await } else { self.admin(req).await };
                encode(&answer)
            }
            ControlRpc::MemberStatus { node_id } => encode(&self.member_status(node_id)),
        })
    }
}
