//! A transport for unit tests of code that only makes calls: a fake peer registers the
//! handlers of the messages it answers, and [`CallsOnly`] hands every call to them, encoded as
//! on a link, wherever it is addressed; no streams, no control plane.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use shoal_http_api::types::ClusterView;
use shoal_raft::{BoxFuture, ControlRpc, ControlTransport, NodeId, TransportError};

use super::wire::{self, Handlers};
use super::{CallError, FrameStream, Outgoing, StreamRequest, Transport};

/// A transport whose calls the fake peer's handlers answer (unreachable while `down` says so);
/// streams and control messages fail.
pub struct CallsOnly {
    handlers: Handlers,
    down: Box<dyn Fn() -> bool + Send + Sync>,
}

impl Transport for CallsOnly {
    fn call<'a>(&'a self, _: &'a str, request: Outgoing<'a>, _: Duration) -> BoxFuture<'a, Result<Bytes, CallError>> {
        Box::pin(async move {
            if (self.down)() {
                return Err(CallError::Unreachable("connection refused".into()));
            }
            let mut message = Vec::new();
            wire::write_request(&mut message, &request, None)?;
            let handling = self
                .handlers
                .serve(request.kind, &Bytes::from(message), 0)
                .map_err(|e| CallError::Broken(e.to_string()))?;
            Ok(Bytes::from(handling.await.1))
        })
    }

    fn cluster(&self, _: &str, _: Duration) -> BoxFuture<'_, Result<ClusterView, CallError>> {
        Box::pin(async { Err(CallError::Unreachable("no API here".into())) })
    }

    fn open_stream(&self, _: &str, _: StreamRequest, _: Duration) -> BoxFuture<'_, Result<FrameStream, CallError>> {
        Box::pin(async { Err(CallError::Unreachable("no streams here".into())) })
    }
}

impl ControlTransport for CallsOnly {
    fn control(
        &self,
        _: &str,
        _: Option<NodeId>,
        _: ControlRpc,
        _: Vec<u8>,
        _: Duration,
    ) -> BoxFuture<'_, Result<Vec<u8>, TransportError>> {
        Box::pin(async { Err(TransportError::Unreachable("no control here".into())) })
    }
}

/// [`crate::peer::Peers`] over a fake peer that answers with `handlers`, unreachable while
/// `down` says so.
pub fn peers_of(handlers: Handlers, down: impl Fn() -> bool + Send + Sync + 'static) -> crate::peer::Peers {
    crate::peer::Peers::new(Arc::new(CallsOnly { handlers, down: Box::new(down) }))
}
