//! The sending side of Raft RPCs: openraft's network factory over the [`ControlTransport`].

use std::sync::Arc;

use openraft::error::{InstallSnapshotError, NetworkError, RemoteError, Unreachable};
use openraft::network::{RPCOption, RaftNetwork, RaftNetworkFactory};
use openraft::raft::{
    AppendEntriesRequest, AppendEntriesResponse, InstallSnapshotRequest, InstallSnapshotResponse, VoteRequest,
    VoteResponse,
};
use serde::de::DeserializeOwned;
use serde::Serialize;

use super::{ControlRpc, ControlTransport, TransportError};
use crate::distribution::NodeId;
use crate::types::{MemberNode, RaftError, RpcError, TypeConfig};

/// openraft's network factory: every connection goes through the node's transport.
#[derive(Clone)]
pub struct RaftTransportNetwork {
    transport: Arc<dyn ControlTransport>,
}

impl RaftTransportNetwork {
    /// A network over `transport`.
    pub fn new(transport: Arc<dyn ControlTransport>) -> Self {
        RaftTransportNetwork { transport }
    }
}

impl RaftNetworkFactory<TypeConfig> for RaftTransportNetwork {
    type Network = PeerConnection;

    async fn new_client(&mut self, target: NodeId, node: &MemberNode) -> PeerConnection {
        PeerConnection { transport: self.transport.clone(), target, peer_addr: node.peer_addr.clone() }
    }
}

/// A connection to one peer's Raft endpoints.
pub struct PeerConnection {
    transport: Arc<dyn ControlTransport>,
    target: NodeId,
    peer_addr: String,
}

impl PeerConnection {
    async fn send<Req, Resp, E>(&self, rpc: ControlRpc, req: &Req, option: &RPCOption) -> Result<Resp, RpcError<E>>
    where
        Req: Serialize,
        Resp: DeserializeOwned,
        E: std::error::Error + DeserializeOwned,
    {
        let network =
            |e: &dyn std::error::Error| RpcError::Network(NetworkError::new(&std::io::Error::other(e.to_string())));
        let body = serde_json::to_vec(req).map_err(|e| network(&e))?;
        let answer = self
            .transport
            .control(&self.peer_addr, Some(self.target), rpc, body, option.hard_ttl())
            .await
            .map_err(|e| match e {
                // Nothing listens there, or another node does: openraft backs off.
                TransportError::Unreachable(_) | TransportError::Misdirected(_) => {
                    RpcError::Unreachable(Unreachable::new(&e))
                }
                TransportError::Failed(_) | TransportError::BadRequest(_) => RpcError::Network(NetworkError::new(&e)),
            })?;
        let result: Result<Resp, RaftError<E>> = serde_json::from_slice(&answer).map_err(|e| network(&e))?;
        result.map_err(|e| RpcError::RemoteError(RemoteError::new(self.target, e)))
    }
}

impl RaftNetwork<TypeConfig> for PeerConnection {
    async fn append_entries(
        &mut self,
        req: AppendEntriesRequest<TypeConfig>,
        option: RPCOption,
    ) -> Result<AppendEntriesResponse<NodeId>, RpcError> {
        self.send(ControlRpc::Append, &req, &option).await
    }

    async fn install_snapshot(
        &mut self,
        req: InstallSnapshotRequest<TypeConfig>,
        option: RPCOption,
    ) -> Result<InstallSnapshotResponse<NodeId>, RpcError<InstallSnapshotError>> {
        self.send(ControlRpc::Snapshot, &req, &option).await
    }

    async fn vote(&mut self, req: VoteRequest<NodeId>, option: RPCOption) -> Result<VoteResponse<NodeId>, RpcError> {
        self.send(ControlRpc::Vote, &req, &option).await
    }
}
