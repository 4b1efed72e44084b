//! The HTTP/1.1 server loop both listeners use: hyper serves every connection.
//!
//! `axum::serve` is not used because it cannot turn on hyper's `pipeline_flush`: a client that
//! pipelines requests would see each answer wait for the next read. Every connection gets
//! TCP_NODELAY (Nagle would add 40 ms stalls to pipelined answers). On shutdown the listener
//! closes at once, idle connections close, and in-flight requests get [`DRAIN_TIMEOUT`] to
//! finish. A connection upgraded to a peer link (`transport::link`) leaves the server, and
//! the link drains itself; the node's shutdown waits for both. Each listener counts its open
//! connections and the bytes its connections read and write (one atomic add per read or write
//! call, none per byte).
//!
//! A listener may bound its connections ([`Limits`]): a request head must arrive whole within
//! the header-read timeout (hyper's, which also closes a connection idle that long between
//! requests: a slow-loris client holds nothing for long), and past the connection cap a new
//! connection is answered 503 problem+json and closed.

use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, OwnedSemaphorePermit, Semaphore};
use tokio::task::JoinHandle;
use tokio_rustls::TlsAcceptor;

use shoal_http_api::ApiError;

use crate::metrics::ListenerMetrics;

/// How long in-flight requests may run after shutdown starts.
pub const DRAIN_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a refused connection may take to send its request and read the refusal.
const REFUSAL_TIMEOUT: Duration = Duration::from_secs(10);

/// What a listener serves: the axum router (with its layers).
pub trait Served:
    tower::Service<
        hyper::Request<hyper::body::Incoming>,
        Response = axum::response::Response,
        Error = std::convert::Infallible,
        Future: Send + 'static,
    > + Clone
    + Send
    + 'static
{
}

impl<S> Served for S where
    S: tower::Service<
            hyper::Request<hyper::body::Incoming>,
            Response = axum::response::Response,
            Error = std::convert::Infallible,
            Future: Send + 'static,
        > + Clone
        + Send
        + 'static
{
}

/// What a listener bounds (none by default: the peer listener, whose clients are the nodes).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Limits {
    /// How long a request head may take to arrive, and a connection may stay idle.
    pub header_read_timeout: Option<Duration>,
    /// The most connections open at once.
    pub max_connections: Option<usize>,
}

/// Serves `router` on `listener` until `shutdown` turns true, counting into `metrics`, bounded
/// by `limits`; over TLS when `tls` is given (the handshake runs in the connection's own task,
/// bounded by [`crate::tls::HANDSHAKE_TIMEOUT`]; the byte counts are of the encrypted stream).
pub fn serve<S>(
    listener: TcpListener,
    router: S,
    metrics: ListenerMetrics,
    tls: Option<TlsAcceptor>,
    limits: Limits,
    mut shutdown: watch::Receiver<bool>,
) -> JoinHandle<()>
where
    S: Served + Sync,
{
    tokio::spawn(async move {
        // Every connection's task holds a clone of `open_tx`; once they all ended, `open_rx`
        // reads `None`: that is how the drain below knows the connections are done.
        let (open_tx, mut open_rx) = tokio::sync::mpsc::channel::<()>(1);
        let mut builder = http1::Builder::new();
        builder.pipeline_flush(true);
        if let Some(timeout) = limits.header_read_timeout {
            builder.timer(TokioTimer::new()).header_read_timeout(timeout);
        }
        let cap = limits.max_connections.map(Cap::new);
        loop {
            tokio::select! {
                accepted = listener.accept() => {
                    let tcp = match accepted {
                        Ok((tcp, _)) => tcp,
                        Err(e) => {
                            // Out of file descriptors and the like: back off instead of spinning.
                            tracing::warn!(error = %e, "accept failed");
                            tokio::time::sleep(Duration::from_millis(100)).await;
                            continue;
                        }
                    };
                    let _ = tcp.set_nodelay(true);
                    metrics.accepted.increment(1);
                    metrics.open.increment(1.0);
                    let admitted = cap.as_ref().map(Cap::admit).transpose();
                    let io = Counted { tcp, metrics: metrics.clone() };
                    let service = router.clone();
                    let (open, builder, stop, held) = (metrics.open.clone(), builder.clone(), shutdown.clone(), open_tx.clone());
                    let tls = tls.clone();
                    tokio::spawn(async move {
                        match tls {
                            None => answer(&builder, io, service, admitted, stop).await,
                            Some(acceptor) => {
                                if speaks_plain_http(&io.tcp).await {
                                    refuse(&builder, io, plain_http_refusal()).await;
                                } else {
                                    match tokio::time::timeout(crate::tls::HANDSHAKE_TIMEOUT, acceptor.accept(io)).await {
                                        Ok(Ok(stream)) => answer(&builder, stream, service, admitted, stop).await,
                                        Ok(Err(e)) => tracing::debug!(error = %e, "TLS handshake failed"),
                                        Err(_) => tracing::debug!("TLS handshake timed out"),
                                    }
                                }
                            }
                        }
                        open.decrement(1.0);
                        drop(held);
                    });
                }
                () = stopped(&mut shutdown) => break,
            }
        }
        drop(listener);
        drop(open_tx);
        if tokio::time::timeout(DRAIN_TIMEOUT, open_rx.recv()).await.is_err() {
            tracing::warn!("requests still running after {DRAIN_TIMEOUT:?}; closing their connections");
        }
    })
}

/// The most connections a listener keeps at once.
struct Cap {
    permits: Arc<Semaphore>,
    max: usize,
    /// Whether the log already says the cap is reached (once, until a connection fits again).
    reached: AtomicBool,
}

impl Cap {
    fn new(max: usize) -> Self {
        Cap { permits: Arc::new(Semaphore::new(max)), max, reached: AtomicBool::new(false) }
    }

    /// A connection's place under the cap, held while it is served; `Err(max)` over it.
    fn admit(&self) -> Result<OwnedSemaphorePermit, usize> {
        match self.permits.clone().try_acquire_owned() {
            Ok(permit) => {
                self.reached.store(false, Ordering::Relaxed);
                Ok(permit)
            }
            Err(_) => {
                if !self.reached.swap(true, Ordering::Relaxed) {
                    tracing::warn!(
                        max = self.max,
                        "client connections at their cap (--max-connections): new ones are refused with 503"
                    );
                }
                Err(self.max)
            }
        }
    }
}

/// Serves an admitted connection, or refuses one over the cap.
async fn answer<I, S>(
    builder: &http1::Builder,
    io: I,
    service: S,
    admitted: Result<Option<OwnedSemaphorePermit>, usize>,
    shutdown: watch::Receiver<bool>,
) where
    I: AsyncRead + AsyncWrite + Send + Unpin + 'static,
    S: Served,
{
    match admitted {
        Ok(_permit) => serve_connection(builder, io, service, shutdown).await,
        Err(max) => refuse(builder, io, over_cap(max)).await,
    }
}

/// The answer to a connection over the cap.
fn over_cap(max: usize) -> ApiError {
    ApiError::unavailable(
        shoal_http_api::Unavailable::Overloaded,
        format!(
            "this node serves at most {max} client connections at once (--max-connections); retry, or use another node"
        ),
    )
}

/// The answer to plain HTTP on a TLS listener: 400, as nginx and Go's servers do, saying how to
/// reach it.
fn plain_http_refusal() -> ApiError {
    ApiError::BadRequest(
        "this node speaks HTTPS: use https:// (and the CA that signed its certificate: curl --cacert, shoal --cacert)"
            .into(),
    )
}

/// Whether a client on a TLS listener opened with plain HTTP (its first byte is not a TLS
/// handshake record's, 0x16, but a letter, as a request line starts), peeked within the
/// handshake timeout.
async fn speaks_plain_http(tcp: &TcpStream) -> bool {
    let mut first = [0u8; 1];
    let peeked = tokio::time::timeout(crate::tls::HANDSHAKE_TIMEOUT, tcp.peek(&mut first)).await;
    matches!(peeked, Ok(Ok(1))) && first[0].is_ascii_alphabetic()
}

/// Answers the connection's first request with `refusal` (problem+json, `Retry-After` for a
/// 503) and closes it, through hyper like every answer (it reads the request first, so the
/// client gets the answer, not a reset), within [`REFUSAL_TIMEOUT`].
async fn refuse<I>(builder: &http1::Builder, io: I, refusal: ApiError)
where
    I: AsyncRead + AsyncWrite + Send + Unpin + 'static,
{
    let service = hyper::service::service_fn(move |_: hyper::Request<hyper::body::Incoming>| {
        let answer = axum::response::IntoResponse::into_response(refusal.clone());
        async move { Ok::<_, std::convert::Infallible>(answer) }
    });
    let mut builder = builder.clone();
    builder.keep_alive(false);
    let _ = tokio::time::timeout(REFUSAL_TIMEOUT, builder.serve_connection(TokioIo::new(io), service)).await;
}

/// Serves one connection with hyper until it ends. Once `shutdown` turns true it finishes the
/// request in flight and closes. A connection may be upgraded (a peer link,
/// `transport::link`): it then leaves hyper, and its new owner watches the shutdown itself.
async fn serve_connection<I, S>(builder: &http1::Builder, io: I, service: S, mut shutdown: watch::Receiver<bool>)
where
    I: AsyncRead + AsyncWrite + Send + Unpin + 'static,
    S: Served,
{
    let service = TowerToHyperService::new(service);
    let connection = builder.serve_connection(TokioIo::new(io), service).with_upgrades();
    tokio::pin!(connection);
    tokio::select! {
        _ = connection.as_mut() => return,
        () = stopped(&mut shutdown) => {}
    }
    connection.as_mut().graceful_shutdown();
    let _ = connection.await;
}

/// Resolves once `shutdown` is true (or its sender is gone).
async fn stopped(shutdown: &mut watch::Receiver<bool>) {
    let _ = shutdown.wait_for(|stop| *stop).await;
}

/// A connection that counts the bytes it reads and writes.
struct Counted {
    tcp: TcpStream,
    metrics: ListenerMetrics,
}

impl AsyncRead for Counted {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let polled = Pin::new(&mut self.tcp).poll_read(cx, buf);
        let read = buf.filled().len() - before;
        if read > 0 {
            self.metrics.received.increment(read as u64);
        }
        polled
    }
}

impl AsyncWrite for Counted {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, data: &[u8]) -> Poll<io::Result<usize>> {
        let polled = Pin::new(&mut self.tcp).poll_write(cx, data);
        if let Poll::Ready(Ok(n)) = polled {
            self.metrics.sent.increment(n as u64);
        }
        polled
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let polled = Pin::new(&mut self.tcp).poll_write_vectored(cx, data);
        if let Poll::Ready(Ok(n)) = polled {
            self.metrics.sent.increment(n as u64);
        }
        polled
    }

    fn is_write_vectored(&self) -> bool {
        self.tcp.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.tcp).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.tcp).poll_shutdown(cx)
    }
}
