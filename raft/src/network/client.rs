//! The sending side of Raft RPCs.

use std::time::Duration;

use openraft::error::{InstallSnapshotError, NetworkError, RemoteError, Unreachable};
use openraft::network::{RPCOption, RaftNetwork, RaftNetworkFactory};
use openraft::raft::{
    AppendEntriesRequest, AppendEntriesResponse, InstallSnapshotRequest, InstallSnapshotResponse, VoteRequest,
    VoteResponse,
};
use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::distribution::NodeId;
use crate::types::{MemberNode, RaftError, RpcError, TypeConfig};

/// openraft's network factory: every connection shares one pooled HTTP client.
#[derive(Clone)]
pub struct HttpRaftNetwork {
    client: reqwest::Client,
}

impl HttpRaftNetwork {
    /// A network whose requests give up after `connect_timeout` when a peer is unreachable.
    pub fn new(connect_timeout: Duration) -> Self {
        let client = reqwest::Client::builder()
            .no_proxy()
            .local_address(super::outgoing_ip())
            .default_headers(super::secret_headers())
            .tcp_nodelay(true)
            .connect_timeout(connect_timeout)
            .pool_idle_timeout(Duration::from_secs(30))
            .build()
            .unwrap_or_default();
        HttpRaftNetwork { client }
    }
}

impl RaftNetworkFactory<TypeConfig> for HttpRaftNetwork {
    type Network = PeerConnection;

    async fn new_client(&mut self, target: NodeId, node: &MemberNode) -> PeerConnection {
        PeerConnection { client: self.client.clone(), target, base: format!("http://{}", node.peer_addr) }
    }
}

/// A connection to one peer's Raft endpoints.
pub struct PeerConnection {
    client: reqwest::Client,
    target: NodeId,
    base: String,
}

impl PeerConnection {
    async fn send<Req, Resp, E>(&self, path: &str, req: &Req, option: &RPCOption) -> Result<Resp, RpcError<E>>
    where
        Req: Serialize,
        Resp: DeserializeOwned,
        E: std::error::Error + DeserializeOwned,
    {
        let response = self
            .client
            .post(format!("{}{}", self.base, path))
            .header(super::server::HEADER_RAFT_TARGET, self.target)
            .timeout(option.hard_ttl())
            .json(req)
            .send()
            .await
            .map_err(|e| {
                if e.is_connect() {
                    RpcError::Unreachable(Unreachable::new(&e))
                } else {
                    RpcError::Network(NetworkError::new(&e))
                }
            })?;
        if !response.status().is_success() {
            let status = response.status();
            let body = response.text().await.unwrap_or_default();
            let err = std::io::Error::other(format!("HTTP {status}: {body}"));
            // Another node now listens at the address: as good as unreachable.
            if status == reqwest::StatusCode::MISDIRECTED_REQUEST {
                return Err(RpcError::Unreachable(Unreachable::new(&err)));
            }
            return Err(RpcError::Network(NetworkError::new(&err)));
        }
        let result: Result<Resp, RaftError<E>> =
            response.json().await.map_err(|e| RpcError::Network(NetworkError::new(&e)))?;
        result.map_err(|e| RpcError::RemoteError(RemoteError::new(self.target, e)))
    }
}

impl RaftNetwork<TypeConfig> for PeerConnection {
    async fn append_entries(
        &mut self,
        req: AppendEntriesRequest<TypeConfig>,
        option: RPCOption,
    ) -> Result<AppendEntriesResponse<NodeId>, RpcError> {
        self.send("/raft/append", &req, &option).await
    }

    async fn install_snapshot(
        &mut self,
        req: InstallSnapshotRequest<TypeConfig>,
        option: RPCOption,
    ) -> Result<InstallSnapshotResponse<NodeId>, RpcError<InstallSnapshotError>> {
        self.send("/raft/snapshot", &req, &option).await
    }

    async fn vote(&mut self, req: VoteRequest<NodeId>, option: RPCOption) -> Result<VoteResponse<NodeId>, RpcError> {
        self.send("/raft/vote", &req, &option).await
    }
}
