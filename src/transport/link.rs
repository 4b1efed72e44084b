//! Peer links: one long-lived connection to each peer for small requests that come often
//! (replica writes), instead of an HTTP exchange each.
//!
//! An HTTP exchange costs both sides hyper's general machinery (the client's pool checkout,
//! request encoding and response parsing; the server's parsing and routing): about 25k
//! instructions per exchange, more than the work it carries. A link is opened once, by an HTTP
//! upgrade on the peer listener (so it passes the cluster secret check and TLS like every
//! other peer request), and then carries messages in both directions:
//!
//! ```text
//!  message = id:u64 kind:u8 len:u32 payload[len]        (big-endian)
//! ```
//!
//! The opener sends requests; the other side answers each with a message of the same id, in
//! whatever order its handlers finish. Many requests are in flight at once, and the writer of
//! each side puts every message that waits into one write.
//!
//! A link only ever speeds up what HTTP would do; what a caller sees on failure is what the
//! HTTP exchange would have given it:
//! - While no link to a peer is open, requests go over HTTP and one is opened in the
//!   background. A peer that does not know links (an older version) answers the upgrade with
//!   something else than 101, and is asked again only after [`RETRY_UNSUPPORTED`].
//! - A link that breaks fails the requests in flight on it (`Broken`: the peer may or may not
//!   have handled them), as a broken connection fails an HTTP exchange.
//! - A request that gets no answer in time fails with `Timeout` and closes the link: a
//!   connection that stalled (a frozen peer, a partition) is not reused, and the next request
//!   opens a new one once the peer answers again, as hyper's pool would.
//! - The serving side stops reading when its node shuts down, lets the requests it took finish
//!   (at most [`crate::http_server::DRAIN_TIMEOUT`]), answers them and closes.

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use parking_lot::Mutex;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader, BufWriter};
use tokio::sync::{mpsc, oneshot, watch};
use tokio::task::AbortHandle;

/// The value of the `Upgrade` header that asks for a link.
pub const PROTOCOL: &str = "shoal-link/1";
/// Bytes before a message's payload.
const HEADER_LEN: usize = 13;
/// The largest payload a side accepts; a larger one is a protocol error and closes the link.
/// (The sender sends only requests much smaller than this over a link: [`MAX_REQUEST`].)
const MAX_PAYLOAD: usize = 64 << 20;
/// Requests larger than this go over HTTP: a link carries one message at a time in each
/// direction, and a large one would hold up every small one behind it.
pub const MAX_REQUEST: usize = 2 << 20;
/// How long after a failed attempt to open a link (the peer unreachable) the next one may start.
const RETRY_UNREACHABLE: Duration = Duration::from_secs(1);
/// How long a peer that refused the upgrade (an older version) is left on HTTP.
pub const RETRY_UNSUPPORTED: Duration = Duration::from_secs(60);
/// Read and write buffers of a link, per direction.
const BUFFER: usize = 64 * 1024;

/// Why a request over a link got no answer.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LinkError {
    /// The link was closed before the request was sent: it may go another way.
    #[error("the link is closed")]
    NotSent,
    /// The link broke with the request in flight: the peer may or may not have handled it.
    #[error("the link to the peer broke")]
    Broken,
    /// No answer in time (the link is closed).
    #[error("no answer in time")]
    Timeout,
}

/// A message: the request or answer id, its kind, its payload.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message {
    /// Matches an answer to its request.
    pub id: u64,
    /// What the payload is (the user of the link decides).
    pub kind: u8,
    /// The payload.
    pub payload: Bytes,
}

/// Builds a message in one buffer, header first: `payload` appends the payload.
pub fn encode(id: u64, kind: u8, payload: impl FnOnce(&mut Vec<u8>)) -> Bytes {
    let mut out = Vec::with_capacity(256);
    out.extend_from_slice(&[0; HEADER_LEN]);
    payload(&mut out);
    let len = (out.len() - HEADER_LEN) as u32;
    out[0..8].copy_from_slice(&id.to_be_bytes());
    out[8] = kind;
    out[9..13].copy_from_slice(&len.to_be_bytes());
    Bytes::from(out)
}

/// Reads the next message; `None` at a clean end (the other side closed between messages).
pub async fn read_message<R: AsyncRead + Unpin>(reader: &mut R) -> std::io::Result<Option<Message>> {
    let mut header = [0u8; HEADER_LEN];
    match reader.read_exact(&mut header[..1]).await {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e),
    }
    reader.read_exact(&mut header[1..]).await?;
    let id = u64::from_be_bytes(header[0..8].try_into().unwrap_or_default());
    let len = u32::from_be_bytes(header[9..13].try_into().unwrap_or_default()) as usize;
    if len > MAX_PAYLOAD {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("a link message of {len} bytes (at most {MAX_PAYLOAD})"),
        ));
    }
    let mut payload = BytesMut::zeroed(len);
    reader.read_exact(&mut payload).await?;
    Ok(Some(Message { id, kind: header[8], payload: payload.freeze() }))
}

/// Writes what `messages` brings, everything that waits in one write, until it closes.
async fn write_messages<W: AsyncWrite + Unpin>(writer: W, mut messages: mpsc::UnboundedReceiver<Bytes>) {
    let mut writer = BufWriter::with_capacity(BUFFER, writer);
    while let Some(first) = messages.recv().await {
        if writer.write_all(&first).await.is_err() {
            return;
        }
        while let Ok(next) = messages.try_recv() {
            if writer.write_all(&next).await.is_err() {
                return;
            }
        }
        if writer.flush().await.is_err() {
            return;
        }
    }
    let _ = writer.shutdown().await;
}

type Waiter = oneshot::Sender<Message>;

/// One open link (the requesting side).
struct Link {
    /// Messages to write.
    out: mpsc::UnboundedSender<Bytes>,
    /// Requests sent and not answered yet; `None` once the link is closed.
    pending: Mutex<Option<HashMap<u64, Waiter>>>,
    next_id: AtomicU64,
    /// The reader's and the writer's tasks.
    tasks: Mutex<Vec<AbortHandle>>,
}

impl Link {
    /// Stops both tasks (the connection closes) and fails every request in flight.
    fn close(&self) {
        for task in self.tasks.lock().drain(..) {
            task.abort();
        }
        // The tasks stop at their next turn: a request sent meanwhile is never answered, so
        // none may wait from now on.
        self.pending.lock().take();
    }
}

/// Whether a link to a peer is open, being opened, or not to be tried before some time.
enum Slot {
    Opening,
    Open(Arc<Link>),
    Closed { until: Instant },
}

/// The links of one node to its peers, by peer address. Dropping it closes them.
#[derive(Default)]
pub struct Links {
    slots: Slots,
}

/// What [`Links::get`] says about a peer.
pub enum Route {
    /// Send over this link.
    Link(LinkRef),
    /// Send another way; when `open` is true, the caller should open a link meanwhile
    /// ([`Links::open`]).
    Other {
        /// Whether this caller is the one to open it.
        open: bool,
    },
}

/// A handle on an open link.
pub struct LinkRef {
    link: Arc<Link>,
    slots: Weak<Mutex<HashMap<String, Slot>>>,
    addr: String,
}

impl Links {
    /// How a request to `addr` goes now.
    pub fn get(&self, addr: &str) -> Route {
        let mut slots = self.slots.lock();
        match slots.get(addr) {
            Some(Slot::Open(link)) => {
                Route::Link(LinkRef { link: link.clone(), slots: Arc::downgrade(&self.slots), addr: addr.to_string() })
            }
            Some(Slot::Opening) => Route::Other { open: false },
            Some(Slot::Closed { until }) if Instant::now() < *until => Route::Other { open: false },
            _ => {
                slots.insert(addr.to_string(), Slot::Opening);
                Route::Other { open: true }
            }
        }
    }

    /// Whether a link to `addr` is open.
    pub fn is_open(&self, addr: &str) -> bool {
        matches!(self.slots.lock().get(addr), Some(Slot::Open(_)))
    }

    /// Opens a link to `addr` in the background with `connect` (which upgrades a connection
    /// to the peer), after [`Links::get`] told this caller to.
    pub fn open<F, S>(&self, addr: &str, connect: F)
    where
        F: Future<Output = Result<S, OpenError>> + Send + 'static,
        S: AsyncRead + AsyncWrite + Send + 'static,
    {
        let slots = Arc::downgrade(&self.slots);
        let addr = addr.to_string();
        tokio::spawn(async move {
            let connected = connect.await;
            let Some(slots) = slots.upgrade() else { return };
            match connected {
                Ok(io) => install(&slots, &addr, io),
                Err(e) => {
                    let retry = match e {
                        OpenError::Unreachable => RETRY_UNREACHABLE,
                        OpenError::Unsupported => RETRY_UNSUPPORTED,
                    };
                    slots.lock().insert(addr, Slot::Closed { until: Instant::now() + retry });
                }
            }
        });
    }

    /// Opening a link to `addr` failed: none is tried again for `retry`.
    #[cfg(test)]
    fn failed(&self, addr: &str, retry: Duration) {
        self.slots.lock().insert(addr.to_string(), Slot::Closed { until: Instant::now() + retry });
    }

    /// `io`, a connection to `addr` already upgraded, becomes the link to `addr`.
    #[cfg(test)]
    fn opened<S>(&self, addr: &str, io: S)
    where
        S: AsyncRead + AsyncWrite + Send + 'static,
    {
        install(&self.slots, addr, io);
    }
}

/// Why a link could not be opened.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OpenError {
    /// The peer could not be reached, or did not answer in time.
    Unreachable,
    /// The peer answered the upgrade with something else than 101 (an older version).
    Unsupported,
}

type Slots = Arc<Mutex<HashMap<String, Slot>>>;

/// Starts the tasks of a link over `io` and makes it the link to `addr`.
fn install<S>(slots: &Slots, addr: &str, io: S)
where
    S: AsyncRead + AsyncWrite + Send + 'static,
{
    let (read, write) = tokio::io::split(io);
    let (out, messages) = mpsc::unbounded_channel();
    let link = Arc::new(Link {
        out,
        pending: Mutex::new(Some(HashMap::new())),
        next_id: AtomicU64::new(1),
        tasks: Mutex::default(),
    });
    let writer = tokio::spawn(write_messages(write, messages));
    let reader = tokio::spawn(read_answers(
        BufReader::with_capacity(BUFFER, read),
        Arc::downgrade(&link),
        Arc::downgrade(slots),
        addr.to_string(),
    ));
    link.tasks.lock().extend([writer.abort_handle(), reader.abort_handle()]);
    slots.lock().insert(addr.to_string(), Slot::Open(link));
}

impl Drop for Links {
    fn drop(&mut self) {
        for slot in self.slots.lock().values() {
            if let Slot::Open(link) = slot {
                link.close();
            }
        }
    }
}

/// Closes `link` and forgets it, if it is still the link to `addr` (the next request may open
/// a new one at once).
fn forget(slots: &Weak<Mutex<HashMap<String, Slot>>>, addr: &str, link: &Arc<Link>) {
    if let Some(slots) = slots.upgrade() {
        let mut slots = slots.lock();
        if matches!(slots.get(addr), Some(Slot::Open(open)) if Arc::ptr_eq(open, link)) {
            slots.insert(addr.to_string(), Slot::Closed { until: Instant::now() });
        }
    }
    link.close();
}

/// Hands each answer to its request, until the link ends; then forgets the link.
async fn read_answers<R: AsyncRead + Unpin>(
    mut reader: R,
    link: Weak<Link>,
    slots: Weak<Mutex<HashMap<String, Slot>>>,
    addr: String,
) {
    loop {
        let message = read_message(&mut reader).await;
        let Some(link) = link.upgrade() else { return };
        match message {
            Ok(Some(answer)) => {
                // An answer nobody waits for any more (its request timed out) is dropped.
                if let Some(waiter) = link.pending.lock().as_mut().and_then(|p| p.remove(&answer.id)) {
                    let _ = waiter.send(answer);
                }
            }
            Ok(None) | Err(_) => {
                forget(&slots, &addr, &link);
                return;
            }
        }
    }
}

impl LinkRef {
    /// Sends a request of `kind` (its payload appended by `payload`) and waits at most
    /// `timeout` for the answer.
    pub async fn call(
        &self,
        kind: u8,
        payload: impl FnOnce(&mut Vec<u8>),
        timeout: Duration,
    ) -> Result<Message, LinkError> {
        let link = &self.link;
        let id = link.next_id.fetch_add(1, Ordering::Relaxed);
        let (waiter, answer) = oneshot::channel();
        match link.pending.lock().as_mut() {
            Some(pending) => pending.insert(id, waiter),
            None => return Err(LinkError::NotSent),
        };
        if link.out.send(encode(id, kind, payload)).is_err() {
            link.pending.lock().as_mut().map(|p| p.remove(&id));
            return Err(LinkError::NotSent);
        }
        match tokio::time::timeout(timeout, answer).await {
            Ok(Ok(answer)) => Ok(answer),
            Ok(Err(_)) => Err(LinkError::Broken),
            Err(_) => {
                link.pending.lock().as_mut().map(|p| p.remove(&id));
                forget(&self.slots, &self.addr, link);
                Err(LinkError::Timeout)
            }
        }
    }
}

/// What answers the requests that come over a link: a request's kind and payload in, the
/// answer's kind and payload out.
pub type Handler = Arc<dyn Fn(u8, Bytes) -> Pin<Box<dyn Future<Output = (u8, Vec<u8>)> + Send>> + Send + Sync>;

/// Serves a link opened by a peer: each request is handled in a task of its own and answered
/// when it is done. Ends when the peer closes the link, or when `shutdown` turns true: then
/// no further request is read, and the ones taken are answered first (within
/// [`crate::http_server::DRAIN_TIMEOUT`]).
pub async fn serve<S>(io: S, handler: Handler, mut shutdown: watch::Receiver<bool>)
where
    S: AsyncRead + AsyncWrite + Send + 'static,
{
    let (read, write) = tokio::io::split(io);
    let mut reader = BufReader::with_capacity(BUFFER, read);
    let (out, messages) = mpsc::unbounded_channel();
    let mut writer = tokio::spawn(write_messages(write, messages));
    loop {
        let request = tokio::select! {
            request = read_message(&mut reader) => request,
            _ = shutdown.wait_for(|stop| *stop) => break,
        };
        match request {
            Ok(Some(request)) => {
                let (handler, out) = (handler.clone(), out.clone());
                tokio::spawn(async move {
                    let (kind, payload) = handler(request.kind, request.payload).await;
                    let _ = out.send(encode(request.id, kind, |buf| buf.extend_from_slice(&payload)));
                });
            }
            Ok(None) => break,
            Err(e) => {
                tracing::debug!(error = %e, "a peer link broke");
                break;
            }
        }
    }
    // The writer ends once every request taken is answered (each holds a sender).
    drop(out);
    if tokio::time::timeout(crate::http_server::DRAIN_TIMEOUT, &mut writer).await.is_err() {
        writer.abort();
    }
}

/// Answers an HTTP request for a link (`Upgrade: shoal-link/1`) with 101 and serves the link
/// that the connection becomes (see [`serve`]); anything else gets a 400.
pub async fn accept(
    mut request: axum::extract::Request,
    handler: Handler,
    shutdown: watch::Receiver<bool>,
) -> axum::response::Response {
    use axum::http::{header, StatusCode};
    use axum::response::IntoResponse;
    if request.headers().get(header::UPGRADE).is_none_or(|v| v != PROTOCOL) {
        return (StatusCode::BAD_REQUEST, format!("expected an upgrade to {PROTOCOL}")).into_response();
    }
    let upgraded = hyper::upgrade::on(&mut request);
    tokio::spawn(async move {
        match upgraded.await {
            Ok(io) => serve(hyper_util::rt::TokioIo::new(io), handler, shutdown).await,
            Err(e) => tracing::debug!(error = %e, "a peer link did not open"),
        }
    });
    axum::response::Response::builder()
        .status(StatusCode::SWITCHING_PROTOCOLS)
        .header(header::CONNECTION, "upgrade")
        .header(header::UPGRADE, PROTOCOL)
        .body(axum::body::Body::empty())
        .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn messages_read_back_as_written_whatever_pieces_they_arrive_in() {
        let sent = [
            Message { id: 1, kind: 7, payload: Bytes::from_static(b"hello") },
            Message { id: u64::MAX, kind: 0, payload: Bytes::new() },
            Message { id: 3, kind: 255, payload: Bytes::from(vec![9u8; 100_000]) },
        ];
        let mut wire = Vec::new();
        for m in &sent {
            wire.extend_from_slice(&encode(m.id, m.kind, |out| out.extend_from_slice(&m.payload)));
        }
        for piece in [1, 5, 4096] {
            let (mut tx, rx) = tokio::io::duplex(piece);
            let bytes = wire.clone();
            let write = tokio::spawn(async move {
                tx.write_all(&bytes).await.expect("write");
            });
            let mut rx = BufReader::new(rx);
            for m in &sent {
                assert_eq!(read_message(&mut rx).await.expect("read").as_ref(), Some(m));
            }
            write.await.expect("writer");
            assert_eq!(read_message(&mut rx).await.expect("a clean end"), None);
        }
    }

    #[tokio::test]
    async fn a_cut_message_or_an_oversized_one_is_an_error() {
        let whole = encode(5, 1, |out| out.extend_from_slice(b"abcdef"));
        for cut in [3, HEADER_LEN, whole.len() - 1] {
            let mut reader = &whole[..cut];
            assert!(read_message(&mut reader).await.is_err(), "cut at {cut}");
        }
        let mut huge = encode(5, 1, |_| {}).to_vec();
        huge[9..13].copy_from_slice(&((MAX_PAYLOAD + 1) as u32).to_be_bytes());
        let mut reader = &huge[..];
        let error = read_message(&mut reader).await.expect_err("too large");
        assert_eq!(error.kind(), std::io::ErrorKind::InvalidData);
    }

    /// A handler that echoes the payload reversed, after waiting as many milliseconds as its
    /// first byte says (so answers come back out of order), with the kind plus one.
    fn echo() -> Handler {
        Arc::new(|kind, payload: Bytes| {
            Box::pin(async move {
                let wait = payload.first().copied().unwrap_or(0);
                tokio::time::sleep(Duration::from_millis(u64::from(wait))).await;
                (kind + 1, payload.iter().rev().copied().collect())
            })
        })
    }

    /// A link over an in-memory pipe served by `handler`, and the serving side's shutdown switch.
    fn linked(handler: Handler) -> (Links, watch::Sender<bool>, tokio::task::JoinHandle<()>) {
        let (near, far) = tokio::io::duplex(64 * 1024);
        let (stop, stopped) = watch::channel(false);
        let server = tokio::spawn(serve(far, handler, stopped));
        let links = Links::default();
        assert!(matches!(links.get("peer"), Route::Other { open: true }));
        assert!(matches!(links.get("peer"), Route::Other { open: false }), "one opener at a time");
        links.opened("peer", near);
        (links, stop, server)
    }

    fn open(links: &Links) -> LinkRef {
        match links.get("peer") {
            Route::Link(link) => link,
            Route::Other { .. } => panic!("no open link"),
        }
    }

    #[tokio::test]
    async fn many_requests_in_flight_each_get_their_own_answer() {
        let (links, _stop, _server) = linked(echo());
        let link = open(&links);
        let calls = (0..50u8).map(|i| {
            let link = &link;
            async move {
                let payload = [50 - i, i, 1, 2];
                let answer = link.call(i, |out| out.extend_from_slice(&payload), Duration::from_secs(10)).await;
                (i, payload, answer)
            }
        });
        for (i, payload, answer) in futures::future::join_all(calls).await {
            let answer = answer.expect("answered");
            assert_eq!(answer.kind, i + 1);
            assert_eq!(answer.payload.to_vec(), payload.iter().rev().copied().collect::<Vec<_>>());
        }
    }

    #[tokio::test]
    async fn a_request_without_an_answer_in_time_closes_the_link() {
        let (links, _stop, _server) = linked(echo());
        let link = open(&links);
        let late = link.call(1, |out| out.push(200), Duration::from_millis(20)).await;
        assert_eq!(late, Err(LinkError::Timeout));
        assert!(!links.is_open("peer"));
        assert_eq!(link.call(1, |out| out.push(0), Duration::from_secs(5)).await, Err(LinkError::NotSent));
        // The next request may open a new link at once.
        assert!(matches!(links.get("peer"), Route::Other { open: true }));
    }

    #[tokio::test]
    async fn requests_in_flight_when_the_peer_goes_away_fail_as_broken() {
        let (near, far) = tokio::io::duplex(1024);
        let links = Links::default();
        let _ = links.get("peer");
        links.opened("peer", near);
        let link = open(&links);
        let call = tokio::spawn(async move { link.call(1, |out| out.push(0), Duration::from_secs(30)).await });
        // The peer reads the request, then dies without answering.
        let mut far = BufReader::new(far);
        assert!(read_message(&mut far).await.expect("request").is_some());
        drop(far);
        assert_eq!(call.await.expect("task"), Err(LinkError::Broken));
        tokio::time::timeout(Duration::from_secs(5), async {
            while links.is_open("peer") {
                tokio::task::yield_now().await;
            }
        })
        .await
        .expect("the link is forgotten");
    }

    #[tokio::test]
    async fn a_serving_side_that_stops_answers_what_it_took_first() {
        // The handler tells when it has the request, and answers only when released.
        let (taken, mut has_taken) = mpsc::unbounded_channel::<()>();
        let release = Arc::new(tokio::sync::Notify::new());
        let handler: Handler = {
            let release = release.clone();
            Arc::new(move |kind, payload| {
                let (taken, release) = (taken.clone(), release.clone());
                Box::pin(async move {
                    let _ = taken.send(());
                    release.notified().await;
                    (kind, payload.to_vec())
                })
            })
        };
        let (links, stop, server) = linked(handler);
        let link = open(&links);
        let call = tokio::spawn(async move { link.call(1, |out| out.push(100), Duration::from_secs(30)).await });
        has_taken.recv().await.expect("the request reaches the handler");
        stop.send_replace(true);
        release.notify_one();
        let answer = call.await.expect("task").expect("answered before the link closed");
        assert_eq!(answer.payload.as_ref(), &[100]);
        tokio::time::timeout(Duration::from_secs(5), server).await.expect("the server ends").expect("task");
        tokio::time::timeout(Duration::from_secs(5), async {
            while links.is_open("peer") {
                tokio::task::yield_now().await;
            }
        })
        .await
        .expect("the link closes");
    }

    #[test]
    fn a_peer_that_refused_is_not_asked_again_before_its_time() {
        let links = Links::default();
        assert!(matches!(links.get("old"), Route::Other { open: true }));
        links.failed("old", RETRY_UNSUPPORTED);
        assert!(matches!(links.get("old"), Route::Other { open: false }));
        links.failed("old", Duration::ZERO);
        assert!(matches!(links.get("old"), Route::Other { open: true }));
    }
}
