//! The HTTP/1.1 server loop both listeners use.
//!
//! `axum::serve` is not used because it cannot turn on hyper's `pipeline_flush`: a client that
//! pipelines requests would see each answer wait for the next read. Every connection gets
//! TCP_NODELAY (Nagle would add 40 ms stalls to pipelined answers). On shutdown the listener
//! closes at once, idle connections close, and in-flight requests get [`DRAIN_TIMEOUT`] to
//! finish.

use std::time::Duration;

use hyper::server::conn::http1;
use hyper_util::rt::TokioIo;
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// How long in-flight requests may run after shutdown starts.
pub const DRAIN_TIMEOUT: Duration = Duration::from_secs(10);

/// Serves `router` on `listener` until `shutdown` turns true.
pub fn serve(listener: TcpListener, router: axum::Router, mut shutdown: watch::Receiver<bool>) -> JoinHandle<()> {
    tokio::spawn(async move {
        let graceful = GracefulShutdown::new();
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
                    let service = TowerToHyperService::new(router.clone());
                    let connection = graceful.watch(builder.serve_connection(TokioIo::new(tcp), service));
                    tokio::spawn(async move {
                        let _ = connection.await;
                    });
                }
                () = stopped(&mut shutdown) => break,
            }
        }
        drop(listener);
        if tokio::time::timeout(DRAIN_TIMEOUT, graceful.shutdown()).await.is_err() {
            tracing::warn!("requests still running after {DRAIN_TIMEOUT:?}; closing their connections");
        }
    })
}

/// Resolves once `shutdown` is true (or its sender is gone).
async fn stopped(shutdown: &mut watch::Receiver<bool>) {
    let _ = shutdown.wait_for(|stop| *stop).await;
}
