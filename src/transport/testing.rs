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

    /// Whether reads go to it as on a link ([`Transport::reads_on_link`]); by default not.
    fn reads_on_link(&self) -> bool {
        false
    }

    /// Whether it sends back every read that comes on a link (as a member serving as many link
    /// requests as it takes at once); by default not.
    fn sends_link_reads_back(&self) -> bool {
        false
    }
}

/// A transport whose calls the fake peer answers; streams and control messages fail.
pub struct CallsOnly<A>(pub Arc<A>);

impl<A: Answers> Transport for CallsOnly<A> {
    fn call(&self, _: &str, request: PeerRequest, _: Duration) -> BoxFuture<'_, Result<PeerAnswer, CallError>> {
        self.0.answer(request)
    }

    fn reads_on_link(&self, _: &str) -> bool {
        self.0.reads_on_link()
    }

    fn get_on_link<'a>(
        &'a self,
        _: &'a str,
        key: String,
        map_version: u64,
        _: Duration,
    ) -> BoxFuture<'a, Result<Result<PeerAnswer, CallError>, String>> {
        Box::pin(async move {
            if !self.0.reads_on_link() || self.0.sends_link_reads_back() {
                return Err(key);
            }
            Ok(self.0.answer(PeerRequest::Get { key, map_version, mirror: None }).await)
        })
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
