//! A transport for unit tests of code that only makes calls: a fake peer implements
//! [`Answers`], and [`CallsOnly`] turns it into a [`Transport`] with no streams and no control
//! plane.

use std::sync::Arc;
use std::time::Duration;

use shoal_raft::{BoxFuture, ControlRpc, ControlTransport, NodeId, TransportError};

use super::{CallError, FrameStream, PeerAnswer, PeerRequest, StreamRequest, Transport};

/// A fake peer: answers every call, wherever it is addressed.
pub trait Answers: Send + Sync + 'static {
    /// The answer to `request`.
    fn answer(&self, request: PeerRequest) -> BoxFuture<'_, Result<PeerAnswer, CallError>>;
}

/// A transport whose calls the fake peer answers; streams and control messages fail.
pub struct CallsOnly<A>(pub Arc<A>);

impl<A: Answers> Transport for CallsOnly<A> {
    fn call(&self, _: &str, request: PeerRequest, _: Duration) -> BoxFuture<'_, Result<PeerAnswer, CallError>> {
        self.0.answer(request)
    }

    fn open_stream(&self, _: &str, _: StreamRequest, _: Duration) -> BoxFuture<'_, Result<FrameStream, CallError>> {
        Box::pin(async { Err(CallError::Unreachable("no streams here".into())) })
    }
}

impl<A: Answers> ControlTransport for CallsOnly<A> {
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

/// [`crate::peer::Peers`] over the fake peer.
pub fn peers_of<A: Answers>(fake: &Arc<A>) -> crate::peer::Peers {
    crate::peer::Peers::new(Arc::new(CallsOnly(fake.clone())))
}
