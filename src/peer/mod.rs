//! [`Peers`]: the calls a node makes to other nodes, over its [`Transport`]. Each message is
//! declared by the module that owns it (an [`Endpoint`]); this asks with any of them and reads
//! the answer as its type.
//!
//! A forwarded key request goes to the owner with the sender's map version, one message on
//! the peer link to it (`Transport::key_op`); a broadcast asks each member for its own keys
//! only. Answers come back as the same types and errors the local path produces, so a client
//! cannot tell a forwarded answer from a local one; what the network did (unreachable, no
//! answer in time) becomes `owner_unreachable` ([`api_error`]).

use std::sync::Arc;
use std::time::Duration;

use shoal_http_api::types::ClusterView;
use shoal_http_api::{ApiError, Unavailable};

use crate::transport::http::FORWARD_TIMEOUT;
use crate::transport::{wire, Addrs, CallError, Endpoint, FrameStream, Outgoing, StreamRequest, Transport};

/// The calls a node makes to others (cheap to clone).
#[derive(Clone)]
pub struct Peers {
    transport: Arc<dyn Transport>,
}

/// What a failed call to the node at `addr` becomes for a client: the receiver's own API error
/// as it gave it; anything the network did, `owner_unreachable`.
pub fn api_error(addr: &str, e: CallError) -> ApiError {
    match e {
        CallError::Api(e) => e,
        CallError::Timeout => {
            ApiError::unavailable(Unavailable::OwnerUnreachable, format!("node at {addr} did not answer in time"))
        }
        other => {
            ApiError::unavailable(Unavailable::OwnerUnreachable, format!("node at {addr} did not answer: {other}"))
        }
    }
}

impl Peers {
    /// Calls over `transport`.
    pub fn new(transport: Arc<dyn Transport>) -> Self {
        Peers { transport }
    }

    /// The transport.
    pub fn transport(&self) -> &Arc<dyn Transport> {
        &self.transport
    }

    /// Sends `request` to the node at the peer address `addr` and waits at most `timeout` for
    /// its answer.
    pub async fn ask<E: Endpoint>(&self, addr: &str, request: E, timeout: Duration) -> Result<E::Answer, CallError> {
        let body = |out: &mut Vec<u8>| wire::encode_body(&request, out);
        let answer = self.transport.call(addr, Outgoing { id: E::ID, kind: E::KIND, body: &body }, timeout).await?;
        wire::decode_answer(&request, &answer)
    }

    /// Sends a key operation (forwarded, or for a mirror) to the member at `to`
    /// (`Transport::key_op`).
    pub async fn ask_member<E: Endpoint>(
        &self,
        to: &Addrs,
        request: E,
        timeout: Duration,
    ) -> Result<E::Answer, CallError> {
        let body = |out: &mut Vec<u8>| wire::encode_body(&request, out);
        let answer = self.transport.key_op(to, Outgoing { id: E::ID, kind: E::KIND, body: &body }, timeout).await?;
        wire::decode_answer(&request, &answer)
    }

    /// Forwards a key operation to its owner at `to`; errors as a client sees them.
    pub async fn forward<E: Endpoint>(&self, to: &Addrs, request: E) -> Result<E::Answer, ApiError> {
        self.ask_member(to, request, FORWARD_TIMEOUT).await.map_err(|e| api_error(&to.api, e))
    }

    /// Asks the member at the peer address `addr` for its share of a request to the whole
    /// cluster; errors as a client sees them.
    pub async fn broadcast<E: Endpoint>(&self, addr: &str, request: E) -> Result<E::Answer, ApiError> {
        self.ask(addr, request, FORWARD_TIMEOUT).await.map_err(|e| api_error(addr, e))
    }

    /// The cluster as the node at the API address `api_addr` sees it.
    pub async fn cluster(&self, api_addr: &str, timeout: Duration) -> Result<ClusterView, CallError> {
        self.transport.cluster(api_addr, timeout).await
    }

    /// Opens a bucket stream at the node at `peer_addr`.
    pub async fn open_stream(
        &self,
        peer_addr: &str,
        request: StreamRequest,
        timeout: Duration,
    ) -> Result<FrameStream, CallError> {
        self.transport.open_stream(peer_addr, request, timeout).await
    }
}
