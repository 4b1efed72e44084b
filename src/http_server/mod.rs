//! The HTTP/1.1 server loop both listeners use.
//!
//! `axum::serve` is not used because it cannot turn on hyper's `pipeline_flush`: a client that
//! pipelines requests would see each answer wait for the next read (the client listener's own
//! loop for key requests, [`simple`], writes answers the same way). Every connection gets
//! TCP_NODELAY (Nagle would add 40 ms stalls to pipelined answers). On shutdown the listener
//! closes at once, idle connections close, and in-flight requests get [`DRAIN_TIMEOUT`] to
//! finish. A connection upgraded to a peer link (`transport::link`) leaves the server, and
//! the link drains itself; the node's shutdown waits for both. Each listener counts its open connections and the bytes its connections read and
//! write (one atomic add per read or write call, none per byte). The client listener's
//! connections answer single-key requests without hyper's connection machinery ([`simple`]).

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use hyper::server::conn::http1;
use hyper_util::rt::TokioIo;
use hyper_util::service::TowerToHyperService;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_rustls::TlsAcceptor;

use crate::metrics::ListenerMetrics;

pub mod simple;

/// How long in-flight requests may run after shutdown starts.
pub const DRAIN_TIMEOUT: Duration = Duration::from_secs(10);

/// What a listener serves: a service for hyper's requests and for the simple loop's (the axum
/// router, or the client API's service).
pub trait Served:
    tower::Service<
        hyper::Request<hyper::body::Incoming>,
        Response = axum::response::Response,
        Error = std::convert::Infallible,
        Future: Send + 'static,
    > + tower::Service<
        hyper::Request<axum::body::Body>,
        Response = axum::response::Response,
        Error = std::convert::Infallible,
        Future: Send + 'static,
    > + simple::Answers
    + Clone
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
        > + tower::Service<
            hyper::Request<axum::body::Body>,
            Response = axum::response::Response,
            Error = std::convert::Infallible,
            Future: Send + 'static,
        > + simple::Answers
        + Clone
        + Send
        + 'static
{
}

/// Serves `router` (the axum router, or the client API's service) on `listener` until `shutdown` turns true, counting into `metrics`; over
/// TLS when `tls` is given (the handshake runs in the connection's own task, bounded by
/// [`crate::tls::HANDSHAKE_TIMEOUT`]; the byte counts are of the encrypted stream). With
/// `simple`, the requests it names are answered without hyper ([`simple`]).
pub fn serve<S>(
    listener: TcpListener,
    router: S,
    metrics: ListenerMetrics,
    tls: Option<TlsAcceptor>,
    simple: Option<simple::Takes>,
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
        // No timer, hence no header-read timeout: hyper would arm one for every request (a
        // measurable share of a GET's CPU), and idle clients are harmless here, as with
        // Redis's default `timeout 0`.
        builder.pipeline_flush(true);
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
                    let io = Counted { tcp, metrics: metrics.clone() };
                    let service = router.clone();
                    let (open, builder, stop, held) = (metrics.open.clone(), builder.clone(), shutdown.clone(), open_tx.clone());
                    let tls = tls.clone();
                    tokio::spawn(async move {
                        match tls {
                            None => serve_connection(&builder, io, service, simple, stop).await,
                            Some(acceptor) => {
                                if speaks_plain_http(&io.tcp).await {
                                    refuse_plain_http(io).await;
                                    open.decrement(1.0);
                                    drop(held);
                                    return;
                                }
                                match tokio::time::timeout(crate::tls::HANDSHAKE_TIMEOUT, acceptor.accept(io)).await {
                                    Ok(Ok(stream)) => serve_connection(&builder, stream, service, simple, stop).await,
                                    Ok(Err(e)) => tracing::debug!(error = %e, "TLS handshake failed"),
                                    Err(_) => tracing::debug!("TLS handshake timed out"),
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

/// Whether a client on a TLS listener opened with plain HTTP (its first byte is not a TLS
/// handshake record's, 0x16, but a letter, as a request line starts), peeked within the
/// handshake timeout.
async fn speaks_plain_http(tcp: &TcpStream) -> bool {
    let mut first = [0u8; 1];
    let peeked = tokio::time::timeout(crate::tls::HANDSHAKE_TIMEOUT, tcp.peek(&mut first)).await;
    matches!(peeked, Ok(Ok(1))) && first[0].is_ascii_alphabetic()
}

/// Answers a plain HTTP request on a TLS listener with 400, as nginx and Go's servers do,
/// saying how to reach it, and closes the connection.
async fn refuse_plain_http(mut io: Counted) {
    use tokio::io::AsyncWriteExt;
    let problem = shoal_http_api::ApiError::BadRequest(
        "this node speaks HTTPS: use https:// (and the CA that signed its certificate: curl --cacert, shoal --cacert)"
            .into(),
    )
    .problem();
    let body = serde_json::to_vec(&problem).unwrap_or_default();
    let head = format!(
        "HTTP/1.1 400 Bad Request\r\ncontent-type: {}\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
        shoal_http_api::PROBLEM_JSON,
        body.len()
    );
    let _ = io.write_all(head.as_bytes()).await;
    let _ = io.write_all(&body).await;
    let _ = io.shutdown().await;
}

/// Serves one connection until it ends: first the requests `simple` names without hyper, then,
/// from the first it does not name, with hyper. Once `shutdown` turns true it finishes the
/// request in flight and closes. A connection may be upgraded (a peer link,
/// `transport::link`): it then leaves hyper, and its new owner watches the shutdown itself.
async fn serve_connection<I, S>(
    builder: &http1::Builder,
    io: I,
    service: S,
    simple: Option<simple::Takes>,
    mut shutdown: watch::Receiver<bool>,
) where
    I: AsyncRead + AsyncWrite + Send + Unpin + 'static,
    S: Served,
{
    match simple {
        None => serve_hyper(builder, io, service, shutdown).await,
        Some(takes) => match simple::serve(io, service.clone(), takes, &mut shutdown).await {
            simple::Ended::Closed => {}
            simple::Ended::Hyper(io) => serve_hyper(builder, io, service, shutdown).await,
        },
    }
}

/// Serves one connection with hyper until it ends (see [`serve_connection`]).
async fn serve_hyper<I, S>(builder: &http1::Builder, io: I, service: S, mut shutdown: watch::Receiver<bool>)
where
    I: AsyncRead + AsyncWrite + Send + Unpin + 'static,
    S: tower::Service<
            hyper::Request<hyper::body::Incoming>,
            Response = axum::response::Response,
            Error = std::convert::Infallible,
        > + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
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
