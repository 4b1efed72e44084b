//! Key requests answered without hyper's connection machinery.
//!
//! Nearly every request a cache serves is a `GET`, `PUT` or `DELETE` of one key with a small
//! body. For those, hyper's general HTTP/1.1 connection (its state machine, the dispatcher
//! around the service, the body channel, the encoder for every kind of body) is most of the
//! server's own instructions per request. The client listener's connections therefore start
//! in a loop of their own: it parses what arrived with `httparse`, and a request it takes
//! (HTTP/1.1, a method and path the listener names, a `Content-Length` body of at most
//! [`MAX_BODY`], no `Transfer-Encoding`, `Expect` or `Upgrade` header, and a `Connection`
//! header only of `keep-alive` and `close`) goes to the same service hyper would call; its
//! answer is written with a `Content-Length` and a `Date`, as hyper writes it. A request that
//! says `Connection: close` gets its answer with `connection: close`, and the connection
//! closes after it, as hyper does. Answers to requests that arrived together are written together
//! (a pipelining client gets them without waiting for its next request).
//!
//! The first request the loop does not take hands the connection to hyper for good, with the
//! bytes already read in front of it: from then on hyper serves it as it serves every other
//! connection. So an unusual request is answered exactly as before, only the usual ones skip
//! hyper.
//!
//! Three things differ from hyper. Two are for a client that closes its side of the
//! connection (a half-close): a whole request read before the close is answered (hyper drops
//! it), and a request cut off in its body is not handed to the service (hyper runs the
//! handler, whose body read fails). The third is for a client that pipelines a request after
//! one that says `Connection: close`: the loop writes every answer up to the close's and ends
//! the connection; hyper (flushing pipelined answers only once no request is left to read)
//! ends it without writing the answers it held.
//!
//! A body is read before the service runs, so a connection holds at most one request head
//! ([`MAX_HEAD`]) and one [`MAX_BODY`] body (24 KiB) before the node's body admission counts it;
//! hyper's first read of a request takes up to 8 KiB of it the same way.

use std::convert::Infallible;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use axum::body::Body;
use axum::http::{header, HeaderMap, HeaderName, HeaderValue, Method, Request, StatusCode, Uri, Version};
use axum::response::Response;
use bytes::{Bytes, BytesMut};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::sync::watch;

/// Which requests a connection answers without hyper, by method and path (the path as sent,
/// query included).
pub type Takes = fn(&Method, &str) -> bool;

/// A service whose answers to the requests the loop takes can be awaited in place (not
/// boxed, as a tower service's future usually is).
pub trait Answers {
    /// The answer to `request`, or the request back for the service's `call`.
    #[allow(clippy::result_large_err)]
    fn answer(&self, request: Request<Body>) -> Result<impl Future<Output = Response> + Send + 'static, Request<Body>>;
}

/// The client API: its key routes' handlers.
impl<N: shoal_http_api::ShoalApi> Answers for shoal_http_api::ApiService<N> {
    fn answer(&self, request: Request<Body>) -> Result<impl Future<Output = Response> + Send + 'static, Request<Body>> {
        self.key_answer(request)
    }
}

/// A router answers through its `call`.
impl Answers for axum::Router {
    fn answer(&self, request: Request<Body>) -> Result<impl Future<Output = Response> + Send + 'static, Request<Body>> {
        Err::<std::future::Ready<Response>, _>(request)
    }
}

/// The largest request head the loop waits for; a longer one goes to hyper (which answers it,
/// or refuses it as too large).
pub const MAX_HEAD: usize = 8 * 1024;
/// The largest body the loop reads itself; a request with a longer one goes to hyper, whose
/// handler admits the body before reading it.
pub const MAX_BODY: usize = 16 * 1024;
/// The most headers a request the loop takes may have.
const MAX_HEADERS: usize = 32;
/// Answers gathered past this size are written before the next request is answered.
const WRITE_AT: usize = 64 * 1024;
/// How much room a read has at least.
const READ_AT_LEAST: usize = 8 * 1024;

/// What the start of a connection's buffer holds. (It lives on the stack for one request:
/// boxing the large variant would cost an allocation per request.)
#[allow(clippy::large_enum_variant)]
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Head {
    /// A request the loop takes, whole (see [`Taken`]).
    Taken(Taken),
    /// The head of a request the loop takes, whose body is still arriving: the length of the
    /// whole request.
    Waiting(usize),
    /// Not yet a whole head.
    Partial,
    /// A request the loop does not take (or not HTTP it understands): hyper's.
    Other,
}

/// Where a request [`head`] took lies in the buffer: the lengths of its head and body, and
/// the positions of its path and headers in the head (so the head is parsed once).
#[derive(Debug, PartialEq, Eq)]
pub(super) struct Taken {
    pub head: usize,
    pub body: usize,
    /// Whether the request asked to close the connection after its answer.
    close: bool,
    method: Method,
    path: Span,
    headers: [(Span, Span); MAX_HEADERS],
    count: usize,
}

/// A range of a request head (at most [`MAX_HEAD`] long).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
struct Span {
    start: u16,
    len: u16,
}

impl Span {
    /// Where `part`, a slice of `buf`, lies in it.
    fn of(buf: &[u8], part: &[u8]) -> Span {
        let start = part.as_ptr() as usize - buf.as_ptr() as usize;
        Span { start: start as u16, len: part.len() as u16 }
    }

    fn range(self) -> std::ops::Range<usize> {
        usize::from(self.start)..usize::from(self.start) + usize::from(self.len)
    }
}

/// Looks at the start of `buf` (see [`Head`]).
pub(super) fn head(buf: &[u8], takes: Takes) -> Head {
    // Left uninitialised: httparse fills what it parses (a zeroed array costs a fifth of the
    // parse).
    let mut headers = [const { std::mem::MaybeUninit::<httparse::Header<'_>>::uninit() }; MAX_HEADERS];
    let mut request = httparse::Request::new(&mut []);
    let head = match request.parse_with_uninit_headers(buf, &mut headers) {
        Ok(httparse::Status::Complete(n)) => n,
        Ok(httparse::Status::Partial) if buf.len() <= MAX_HEAD => return Head::Partial,
        _ => return Head::Other,
    };
    if head > MAX_HEAD || request.version != Some(1) {
        return Head::Other;
    }
    let (Some(method), Some(path)) = (method_of(request.method), request.path) else { return Head::Other };
    if !takes(&method, path) {
        return Head::Other;
    }
    let (mut body, mut close) = (None, false);
    let mut spans = [(Span::default(), Span::default()); MAX_HEADERS];
    for (h, span) in request.headers.iter().zip(spans.iter_mut()) {
        let name = h.name.as_bytes();
        if name.eq_ignore_ascii_case(b"content-length") {
            match (body, length_of(h.value)) {
                (None, Some(n)) if n <= MAX_BODY => body = Some(n),
                _ => return Head::Other,
            }
        } else if name.eq_ignore_ascii_case(b"connection") {
            match closes(h.value) {
                Some(closes) => close |= closes,
                None => return Head::Other,
            }
        } else if [&b"transfer-encoding"[..], b"expect", b"upgrade"]
            .iter()
            .any(|other| name.eq_ignore_ascii_case(other))
        {
            return Head::Other;
        }
        *span = (Span::of(buf, name), Span::of(buf, h.value));
    }
    let body = body.unwrap_or(0);
    if buf.len() < head + body {
        return Head::Waiting(head + body);
    }
    let count = request.headers.len();
    Head::Taken(Taken { head, body, close, method, path: Span::of(buf, path.as_bytes()), headers: spans, count })
}

/// The options of a `Connection` value: comma-separated, spaces around them trimmed.
fn options(value: &[u8]) -> impl Iterator<Item = &[u8]> {
    value.split(|&b| b == b',').map(<[u8]>::trim_ascii)
}

/// Whether a `Connection` value asks to close the connection; `None` if it names anything
/// but `keep-alive` and `close` (an upgrade, or other headers to drop on the way: hyper's).
fn closes(value: &[u8]) -> Option<bool> {
    let mut close = false;
    for option in options(value) {
        if option.eq_ignore_ascii_case(b"close") {
            close = true;
        } else if !option.eq_ignore_ascii_case(b"keep-alive") {
            return None;
        }
    }
    Some(close)
}

fn method_of(method: Option<&str>) -> Option<Method> {
    match method? {
        "GET" => Some(Method::GET),
        "PUT" => Some(Method::PUT),
        "DELETE" => Some(Method::DELETE),
        _ => None,
    }
}

/// A `Content-Length` value: digits only, as RFC 9110 has it.
fn length_of(value: &[u8]) -> Option<usize> {
    if value.is_empty() || value.len() > 12 || !value.iter().all(u8::is_ascii_digit) {
        return None;
    }
    value.iter().try_fold(0usize, |n, d| n.checked_mul(10)?.checked_add(usize::from(d - b'0')))
}

/// The request `taken` describes, from its `head` (the bytes [`head`] looked at, up to the
/// body) and `body`; `None` if a header or the path is not valid HTTP.
pub(super) fn request(taken: &Taken, head: &Bytes, body: &Bytes) -> Option<Request<Body>> {
    let uri = Uri::from_maybe_shared(head.slice(taken.path.range())).ok()?;
    let mut map = HeaderMap::with_capacity(taken.count);
    for (name, value) in &taken.headers[..taken.count] {
        let name = HeaderName::from_bytes(&head[name.range()]).ok()?;
        let value = HeaderValue::from_maybe_shared(head.slice(value.range())).ok()?;
        map.append(name, value);
    }
    let mut request = Request::new(if body.is_empty() { Body::empty() } else { Body::from(body.clone()) });
    *request.method_mut() = taken.method.clone();
    *request.uri_mut() = uri;
    *request.version_mut() = Version::HTTP_11;
    *request.headers_mut() = map;
    Some(request)
}

/// Appends `response` to `out`: its head, with a `Content-Length` and a `Date` where the
/// response has none and `connection: close` when `closing` and the response has no
/// `connection` header (the client API's handlers set none), and `body` if it is small.
/// Returns whether the connection is to close after it (`closing`, or a `connection` header
/// of the response names `close`) and whether `body` is still to be written after
/// `out` (a body over [`WRITE_AT`] is not copied; a status without a body writes none).
pub(super) fn encode(
    out: &mut Vec<u8>,
    response: &axum::http::response::Parts,
    body: &[u8],
    closing: bool,
) -> (bool, bool) {
    let status = response.status;
    out.extend_from_slice(b"HTTP/1.1 ");
    out.extend_from_slice(status.as_str().as_bytes());
    out.push(b' ');
    out.extend_from_slice(status.canonical_reason().unwrap_or("<none>").as_bytes());
    out.extend_from_slice(b"\r\n");
    // As hyper: no body, and no length, for 1xx, 204 and 304.
    let bodyless = status.is_informational() || status == StatusCode::NO_CONTENT || status == StatusCode::NOT_MODIFIED;
    // One pass over the headers notes the three the answer adds when missing (comparing
    // standard names is cheap; looking each up would hash it).
    let (mut length, mut date_given, mut connection) = (false, false, None);
    for (name, value) in &response.headers {
        if name == header::CONTENT_LENGTH {
            length = true;
            if bodyless {
                continue;
            }
        } else if name == header::DATE {
            date_given = true;
        } else if name == header::CONNECTION {
            let named = options(value.as_bytes()).any(|o| o.eq_ignore_ascii_case(b"close"));
            connection = Some(connection == Some(true) || named);
        }
        out.extend_from_slice(name.as_str().as_bytes());
        out.extend_from_slice(b": ");
        out.extend_from_slice(value.as_bytes());
        out.extend_from_slice(b"\r\n");
    }
    if closing && connection.is_none() {
        out.extend_from_slice(b"connection: close\r\n");
    }
    if !bodyless && !length {
        out.extend_from_slice(b"content-length: ");
        out.extend_from_slice(itoa::Buffer::new().format(body.len()).as_bytes());
        out.extend_from_slice(b"\r\n");
    }
    if !date_given {
        out.extend_from_slice(b"date: ");
        date(|d| out.extend_from_slice(d));
        out.extend_from_slice(b"\r\n");
    }
    out.extend_from_slice(b"\r\n");
    let apart = !bodyless && body.len() > WRITE_AT;
    if !bodyless && !apart {
        out.extend_from_slice(body);
    }
    (closing || connection == Some(true), apart)
}

/// Calls `f` with the current `Date` value (formatted once a second per thread).
fn date(f: impl FnOnce(&[u8])) {
    use std::cell::RefCell;
    use std::time::{SystemTime, UNIX_EPOCH};
    thread_local! {
        static DATE: RefCell<(u64, String)> = const { RefCell::new((u64::MAX, String::new())) };
    }
    let now = SystemTime::now();
    let second = now.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
    DATE.with(|cached| {
        let mut cached = cached.borrow_mut();
        if cached.0 != second {
            *cached = (second, httpdate::fmt_http_date(now));
        }
        f(cached.1.as_bytes());
    });
}

/// A body's bytes: a body in one piece as it is, several pieces gathered. `None` if it failed.
async fn body_bytes(mut body: Body) -> Option<Bytes> {
    use http_body_util::BodyExt;
    let mut whole: Option<BytesMut> = None;
    let mut first = Bytes::new();
    while let Some(frame) = body.frame().await {
        let Ok(data) = frame.ok()?.into_data() else { continue };
        match &mut whole {
            Some(w) => w.extend_from_slice(&data),
            None if first.is_empty() => first = data,
            None => {
                let mut w = BytesMut::with_capacity(first.len() + data.len());
                w.extend_from_slice(&first);
                w.extend_from_slice(&data);
                whole = Some(w);
            }
        }
    }
    Some(whole.map_or(first, BytesMut::freeze))
}

/// How a connection's loop ended.
pub(super) enum Ended<I> {
    /// The connection is done (closed by the client, an error, or the node's shutdown).
    Closed,
    /// A request the loop does not take: hyper serves the connection from here, reading the
    /// bytes already read first.
    Hyper(Rewind<I>),
}

/// Serves `io`'s requests that `takes` names with `service`, until one it does not take (see
/// the module docs) or the connection ends. Once `shutdown` turns true, the request being
/// answered gets its answer with `connection: close` (as hyper's graceful shutdown gives it),
/// and the connection closes; an idle one closes at once.
pub(super) async fn serve<I, S>(
    mut io: I,
    mut service: S,
    takes: Takes,
    shutdown: &mut watch::Receiver<bool>,
) -> Ended<I>
where
    I: AsyncRead + AsyncWrite + Unpin,
    S: tower::Service<Request<Body>, Response = Response, Error = Infallible> + Answers,
{
    use futures::future::Either;
    let stopping = shutdown.clone();
    let mut buf = BytesMut::with_capacity(READ_AT_LEAST);
    let mut out = Vec::with_capacity(1024);
    // The length of the request at the start of `buf` whose body is still arriving: its head
    // is not parsed again until it is all there.
    let mut waiting = 0;
    // One wait for the shutdown for the whole connection (not one per read).
    let mut stop = std::pin::pin!(super::stopped(shutdown));
    loop {
        // Every whole request already read is answered before the answers are written, but
        // answers made go out before one that has to wait.
        while buf.len() >= waiting {
            let taken = match head(&buf, takes) {
                Head::Taken(taken) => taken,
                Head::Waiting(len) => {
                    waiting = len;
                    break;
                }
                Head::Partial => break,
                Head::Other => return hyper(io, &mut out, buf).await,
            };
            waiting = 0;
            let asked_close = taken.close;
            let head = buf.split_to(taken.head).freeze();
            let body = buf.split_to(taken.body).freeze();
            let Some(request) = request(&taken, &head, &body) else {
                // Not valid HTTP after all (a path `Uri` refuses): hyper answers it as it would.
                let mut all = BytesMut::with_capacity(head.len() + body.len() + buf.len());
                all.extend_from_slice(&head);
                all.extend_from_slice(&body);
                all.extend_from_slice(&buf);
                return hyper(io, &mut out, all).await;
            };
            drop((head, body));
            let answer = match service.answer(request) {
                Ok(answer) => Either::Left(answer),
                Err(request) => {
                    if std::future::poll_fn(|cx| service.poll_ready(cx)).await.is_err() {
                        return Ended::Closed;
                    }
                    let call = service.call(request);
                    Either::Right(async move {
                        let Ok(response) = call.await;
                        response
                    })
                }
            };
            let mut answer = std::pin::pin!(answer);
            let response = match futures::poll!(answer.as_mut()) {
                Poll::Ready(response) => response,
                Poll::Pending => {
                    if write_out(&mut io, &mut out).await.is_err() {
                        return Ended::Closed;
                    }
                    answer.await
                }
            };
            let (parts, body) = response.into_parts();
            let Some(body) = body_bytes(body).await else {
                let _ = write_out(&mut io, &mut out).await;
                return close(io).await;
            };
            let (closes, apart) = encode(&mut out, &parts, &body, asked_close || *stopping.borrow());
            if apart {
                // A large value is written from where it is, not copied after the head.
                let written = async {
                    write_out(&mut io, &mut out).await?;
                    io.write_all(&body).await?;
                    io.flush().await
                };
                if written.await.is_err() {
                    return Ended::Closed;
                }
            }
            if closes {
                let _ = write_out(&mut io, &mut out).await;
                return close(io).await;
            }
            if out.len() >= WRITE_AT && write_out(&mut io, &mut out).await.is_err() {
                return Ended::Closed;
            }
        }
        if write_out(&mut io, &mut out).await.is_err() {
            return Ended::Closed;
        }
        buf.reserve(READ_AT_LEAST);
        // The read first: a connection that has bytes waiting does not poll the shutdown.
        tokio::select! {
            biased;
            read = io.read_buf(&mut buf) => match read {
                Ok(0) => return close(io).await,
                Err(_) => return Ended::Closed,
                Ok(_) => {}
            },
            () = stop.as_mut() => return close(io).await,
        }
    }
}

/// Hands `io` to hyper once the answers in `out` are written, with `read` (the bytes read and
/// not answered) in front.
async fn hyper<I: AsyncWrite + Unpin>(mut io: I, out: &mut Vec<u8>, read: BytesMut) -> Ended<I> {
    if write_out(&mut io, out).await.is_err() {
        return Ended::Closed;
    }
    Ended::Hyper(Rewind { read: read.freeze(), io })
}

/// Shuts the connection down (over TLS: says so to the peer), as hyper does when a connection
/// ends; a peer that does not take it within a second is left.
async fn close<I: AsyncWrite + Unpin>(mut io: I) -> Ended<I> {
    let _ = tokio::time::timeout(std::time::Duration::from_secs(1), io.shutdown()).await;
    Ended::Closed
}

/// Writes and flushes `out` if it holds anything, and empties it.
async fn write_out<I: AsyncWrite + Unpin>(io: &mut I, out: &mut Vec<u8>) -> io::Result<()> {
    if out.is_empty() {
        return Ok(());
    }
    io.write_all(out).await?;
    out.clear();
    // Many pipelined answers may have grown it: a connection does not keep that much.
    if out.capacity() > 4 * WRITE_AT {
        *out = Vec::with_capacity(1024);
    }
    io.flush().await
}

/// A connection with bytes already read from it in front: what hyper is given when it takes
/// a connection over.
pub(super) struct Rewind<I> {
    read: Bytes,
    io: I,
}

impl<I: AsyncRead + Unpin> AsyncRead for Rewind<I> {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        if !self.read.is_empty() {
            let n = self.read.len().min(buf.remaining());
            buf.put_slice(&self.read.split_to(n));
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl<I: AsyncWrite + Unpin> AsyncWrite for Rewind<I> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, data: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, data)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write_vectored(cx, data)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use tokio::io::AsyncReadExt;
    use tokio::sync::Notify;

    fn key_requests(method: &Method, path: &str) -> bool {
        shoal_http_api::is_key_request(method, path)
    }

    fn taken(buf: &[u8]) -> Option<(usize, usize)> {
        match head(buf, key_requests) {
            Head::Taken(t) => Some((t.head, t.body)),
            _ => None,
        }
    }

    #[test]
    fn only_whole_simple_key_requests_are_taken() {
        let put = b"PUT /v1/kv/a?ttl=5s HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello";
        assert_eq!(taken(put), Some((put.len() - 5, 5)));
        assert_eq!(taken(b"GET /v1/kv/a HTTP/1.1\r\nhost: x\r\n\r\nGET /next"), Some((34, 0)));
        assert_eq!(taken(b"DELETE /v1/kv/a HTTP/1.1\r\n\r\n"), Some((28, 0)));
        // A `Connection` header of `keep-alive` and `close` only; `close` closes after the answer.
        let closing = |buf: &[u8]| match head(buf, key_requests) {
            Head::Taken(t) => Some(t.close),
            _ => None,
        };
        assert_eq!(closing(b"GET /v1/kv/a HTTP/1.1\r\nConnection: Keep-Alive\r\n\r\n"), Some(false));
        assert_eq!(closing(b"GET /v1/kv/a HTTP/1.1\r\nConnection: close\r\n\r\n"), Some(true));
        assert_eq!(closing(b"GET /v1/kv/a HTTP/1.1\r\nconnection: keep-alive ,CLOSE\r\n\r\n"), Some(true));
        assert_eq!(
            closing(b"GET /v1/kv/a HTTP/1.1\r\nConnection: keep-alive\r\nConnection: close\r\n\r\n"),
            Some(true)
        );
        assert_eq!(
            closing(b"GET /v1/kv/a HTTP/1.1\r\nConnection: close\r\nConnection: keep-alive\r\n\r\n"),
            Some(true)
        );
        assert_eq!(closing(b"GET /v1/kv/a HTTP/1.1\r\n\r\n"), Some(false));
        // Every prefix of a whole request waits for more; once the head is whole, for the
        // length of the whole request.
        for n in 0..put.len() {
            let waits = match head(&put[..n], key_requests) {
                Head::Partial => n < put.len() - 5,
                Head::Waiting(len) => len == put.len() && n >= put.len() - 5,
                _ => false,
            };
            assert!(waits, "{n} bytes");
        }
        let others: &[&[u8]] = &[
            b"POST /v1/kv/a HTTP/1.1\r\n\r\n",
            b"HEAD /v1/kv/a HTTP/1.1\r\n\r\n",
            b"GET /v1/status HTTP/1.1\r\n\r\n",
            b"GET http://x/v1/kv/a HTTP/1.1\r\n\r\n",
            b"GET /v1/kv/a HTTP/1.0\r\n\r\n",
            b"PUT /v1/kv/a HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n",
            b"PUT /v1/kv/a HTTP/1.1\r\nExpect: 100-continue\r\nContent-Length: 1\r\n\r\n",
            b"GET /v1/kv/a HTTP/1.1\r\nConnection: upgrade\r\n\r\n",
            b"GET /v1/kv/a HTTP/1.1\r\nConnection: keep-alive, te\r\nTE: trailers\r\n\r\n",
            b"GET /v1/kv/a HTTP/1.1\r\nConnection: close,\r\n\r\n",
            b"GET /v1/kv/a HTTP/1.1\r\nConnection:\r\n\r\n",
            b"GET /v1/kv/a HTTP/1.1\r\nUpgrade: websocket\r\n\r\n",
            b"PUT /v1/kv/a HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 1\r\n\r\nx",
            b"PUT /v1/kv/a HTTP/1.1\r\nContent-Length: +1\r\n\r\nx",
            b"PUT /v1/kv/a HTTP/1.1\r\nContent-Length: 16385\r\n\r\n",
            b"GET /v1/kv/a HTTP/1.1\r\nbad header\r\n\r\n",
            b"\x16\x03\x01 not http at all",
        ];
        for other in others {
            assert_eq!(head(other, key_requests), Head::Other, "{}", String::from_utf8_lossy(other));
        }
        let many: String = (0..MAX_HEADERS + 1).map(|i| format!("x-{i}: y\r\n")).collect();
        assert_eq!(head(format!("GET /v1/kv/a HTTP/1.1\r\n{many}\r\n").as_bytes(), key_requests), Head::Other);
        // A head that never ends is not waited for past the limit.
        let long = format!("GET /v1/kv/a HTTP/1.1\r\nx: {}", "y".repeat(MAX_HEAD));
        assert_eq!(head(long.as_bytes(), key_requests), Head::Other);
    }

    #[test]
    fn an_answer_that_names_close_in_its_connection_header_closes_the_connection() {
        let parts = |value: Option<&'static str>| {
            let mut response = Response::new(());
            if let Some(value) = value {
                response.headers_mut().insert(header::CONNECTION, HeaderValue::from_static(value));
            }
            response.into_parts().0
        };
        let encoded = |value, closing| {
            let mut out = Vec::new();
            let (closes, _) = encode(&mut out, &parts(value), b"", closing);
            (closes, String::from_utf8(out).expect("ascii").matches("connection").count())
        };
        assert_eq!(encoded(None, false), (false, 0));
        assert_eq!(encoded(None, true), (true, 1));
        assert_eq!(encoded(Some("Keep-Alive"), false), (false, 1));
        assert_eq!(encoded(Some("keep-alive, Close"), false), (true, 1));
        assert_eq!(encoded(Some("close"), true), (true, 1));
    }

    /// A service like the client API: it answers key requests in place (but keys starting
    /// with `routed`, which go through its `call`), with responses that carry no
    /// `Content-Length` (as the key handlers' do), echoing what it was given; a few keys give
    /// the other statuses the key routes use, `large` a value larger than the loop copies,
    /// `slow` waits until it is let go. It counts the requests it answered in place and
    /// through its `call`.
    #[derive(Clone, Default)]
    struct Direct {
        slow_started: Arc<Notify>,
        slow_go: Arc<Notify>,
        in_place: Arc<std::sync::atomic::AtomicUsize>,
        called: Arc<std::sync::atomic::AtomicUsize>,
    }

    impl Direct {
        async fn respond(self, request: Request<Body>) -> Response {
            let (parts, body) = request.into_parts();
            let body = axum::body::to_bytes(body, usize::MAX).await.unwrap_or_default();
            let key = parts.uri.path().rsplit('/').next().unwrap_or_default().to_string();
            let mut response = Response::new(Body::empty());
            match key.as_str() {
                "gone" => *response.status_mut() = StatusCode::NO_CONTENT,
                "same" => {
                    *response.status_mut() = StatusCode::NOT_MODIFIED;
                    response.headers_mut().insert(header::ETAG, HeaderValue::from_static("\"3\""));
                    response.headers_mut().insert(header::CONTENT_LENGTH, HeaderValue::from_static("0"));
                }
                "large" => *response.body_mut() = Body::from(vec![b'L'; 3 * WRITE_AT]),
                "missing" => {
                    *response.status_mut() = StatusCode::NOT_FOUND;
                    response
                        .headers_mut()
                        .insert(header::CONTENT_TYPE, HeaderValue::from_static("application/problem+json"));
                    *response.body_mut() = Body::from("{}");
                }
                _ => {
                    if key == "slow" {
                        self.slow_started.notify_one();
                        self.slow_go.notified().await;
                    }
                    response.headers_mut().insert(header::ETAG, HeaderValue::from_static("\"1\""));
                    *response.body_mut() = Body::from(format!(
                        "{} {} {:?} x-test={:?} body={}",
                        parts.method,
                        key,
                        parts.uri.query(),
                        parts.headers.get("x-test"),
                        String::from_utf8_lossy(&body)
                    ));
                }
            }
            response
        }
    }

    impl<B> tower::Service<Request<B>> for Direct
    where
        B: axum::body::HttpBody<Data = Bytes> + Send + 'static,
        B::Error: Into<axum::BoxError>,
    {
        type Response = Response;
        type Error = Infallible;
        type Future = futures::future::BoxFuture<'static, Result<Response, Infallible>>;

        fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
            Poll::Ready(Ok(()))
        }

        fn call(&mut self, request: Request<B>) -> Self::Future {
            let this = self.clone();
            this.called.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            Box::pin(async move { Ok(this.respond(request.map(Body::new)).await) })
        }
    }

    impl Answers for Direct {
        fn answer(
            &self,
            request: Request<Body>,
        ) -> Result<impl Future<Output = Response> + Send + 'static, Request<Body>> {
            if request.uri().path().contains("routed") {
                return Err(request);
            }
            self.in_place.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            Ok(self.clone().respond(request))
        }
    }

    /// Everything one connection answers to `requests`, written and read at most `piece`
    /// bytes at a time, the `Date`s' values blanked, and how many requests the service
    /// answered in place: served by the loop first (`simple`) or by hyper alone. With
    /// `hold_open` the client's side stays open until the server closes.
    async fn answers(simple: bool, requests: &[u8], piece: usize, hold_open: bool) -> (String, usize) {
        let (client, server) = tokio::io::duplex(piece);
        let (_stop, stopped) = watch::channel(false);
        let takes = simple.then_some(key_requests as Takes);
        let service = Direct::default();
        let in_place = service.in_place.clone();
        let serving = tokio::spawn(async move {
            let mut builder = hyper::server::conn::http1::Builder::new();
            builder.pipeline_flush(true);
            super::super::serve_connection(&builder, server, service, takes, stopped).await;
        });
        let (mut reader, mut writer) = tokio::io::split(client);
        let requests = requests.to_vec();
        let writing = tokio::spawn(async move {
            // A server that closes early (hyper after a request it refuses) breaks the pipe.
            if writer.write_all(&requests).await.is_ok() && !hold_open {
                let _ = writer.shutdown().await;
            }
            writer
        });
        let mut got = Vec::new();
        tokio::time::timeout(std::time::Duration::from_secs(10), reader.read_to_end(&mut got))
            .await
            .expect("the server closes the connection")
            .expect("read");
        drop(writing.await.expect("writer"));
        serving.await.expect("server");
        let got = String::from_utf8_lossy(&got).into_owned();
        let got = got.split("\r\n").map(|l| if l.starts_with("date: ") { "date: -" } else { l }).collect::<Vec<_>>();
        (got.join("\r\n"), in_place.load(std::sync::atomic::Ordering::Relaxed))
    }

    /// `requests` get the same answers from the loop as from hyper, sent whole and in pieces,
    /// and the loop answers the first `in_place` of them itself either way.
    async fn same_as_hyper(requests: &[u8], hold_open: bool, in_place: usize) -> String {
        let (hyper, none) = answers(false, requests, 1 << 20, hold_open).await;
        assert_eq!(none, 0);
        for piece in [1 << 20, 7] {
            let (simple, answered) = answers(true, requests, piece, hold_open).await;
            assert_eq!(answered, in_place, "in pieces of {piece}");
            let differ = simple.bytes().zip(hyper.bytes()).position(|(a, b)| a != b);
            if let Some(at) = differ.or((simple.len() != hyper.len()).then_some(simple.len().min(hyper.len()))) {
                let around = |s: &str| s[at.saturating_sub(200)..(at + 100).min(s.len())].to_string();
                panic!("in pieces of {piece}, at byte {at}:\n{}\n--- hyper:\n{}", around(&simple), around(&hyper));
            }
        }
        hyper
    }

    #[tokio::test]
    async fn a_connection_answers_byte_for_byte_as_hyper_does() {
        let big = "v".repeat(MAX_BODY + 1);
        let session = [
            "PUT /v1/kv/a?ttl=5s HTTP/1.1\r\nHost: x\r\nX-Test: 1\r\nContent-Length: 5\r\n\r\nhello".to_string(),
            "GET /v1/kv/a%20b HTTP/1.1\r\nhost: x\r\n\r\n".into(),
            "DELETE /v1/kv/gone HTTP/1.1\r\n\r\n".into(),
            "GET /v1/kv/same HTTP/1.1\r\nIf-None-Match: \"3\"\r\n\r\n".into(),
            "GET /v1/kv/missing HTTP/1.1\r\n\r\n".into(),
            "GET /v1/kv/large HTTP/1.1\r\n\r\n".into(),
            "PUT /v1/kv/empty HTTP/1.1\r\nContent-Length: 0\r\n\r\n".into(),
            "PUT /v1/kv/routed HTTP/1.1\r\nContent-Length: 2\r\n\r\nhi".into(),
            // From here hyper answers (the loop hands the connection over).
            "POST /v1/other HTTP/1.1\r\nContent-Length: 2\r\n\r\nhi".into(),
            "PUT /v1/kv/c HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n".into(),
            format!("PUT /v1/kv/big HTTP/1.1\r\nContent-Length: {}\r\n\r\n{big}", big.len()),
            "GET /v1/kv/a HTTP/1.1\r\nConnection: close\r\n\r\n".into(),
        ]
        .concat();
        // The first seven in place (`routed` goes through the service's call).
        let hyper = same_as_hyper(session.as_bytes(), true, 7).await;
        assert_eq!(hyper.matches("HTTP/1.1 200 OK").count(), 9, "{}", &hyper[..600.min(hyper.len())]);
        assert!(hyper.contains("body=abc") && hyper.contains("connection: close"));
        // Bytes over 0x7F in the path, answered in place.
        let odd = "GET /v1/kv/\u{e9} HTTP/1.1\r\n\r\nGET /v1/kv/a HTTP/1.1\r\nConnection: close\r\n\r\n";
        let hyper = same_as_hyper(odd.as_bytes(), true, 2).await;
        assert!(hyper.starts_with("HTTP/1.1 200 OK"), "{hyper}");
        // `Connection: keep-alive` and `close` stay in the loop, and the connection closes
        // after the `close`'s answer.
        let closing = [
            "GET /v1/kv/a HTTP/1.1\r\nConnection: keep-alive\r\n\r\n",
            "PUT /v1/kv/b HTTP/1.1\r\nConnection: Keep-Alive\r\nContent-Length: 1\r\n\r\nx",
            "GET /v1/kv/c HTTP/1.1\r\nConnection: close\r\n\r\n",
        ]
        .concat();
        let hyper = same_as_hyper(closing.as_bytes(), true, 3).await;
        assert_eq!(hyper.matches("HTTP/1.1 200 OK").count(), 3, "{hyper}");
        assert!(hyper.contains("connection: close\r\n") && hyper.contains("GET c None"), "{hyper}");
        // A request pipelined after the `close` is not answered. (hyper, given one, drops
        // the answers it has not written yet.)
        let (got, handed) = simple_loop(format!("{closing}GET /v1/kv/d HTTP/1.1\r\n\r\n").as_bytes()).await;
        assert!(!handed && got.matches("HTTP/1.1 200 OK").count() == 3 && !got.contains("GET d"), "{got}");
        // A path httparse takes and `Uri` refuses: hyper answers it from its bytes.
        let refused = ["/v1/kv/a<b>", "/v1/kv/a\\b", "/v1/kv/a^b", "/v1/kv/a`b", "/v1/kv/a|b"]
            .into_iter()
            .find(|path| {
                let request = format!("GET {path} HTTP/1.1\r\n\r\n");
                Uri::try_from(*path).is_err() && matches!(head(request.as_bytes(), key_requests), Head::Taken(_))
            })
            .expect("a path httparse takes and Uri refuses");
        let odd = format!("GET {refused} HTTP/1.1\r\n\r\nGET /v1/kv/a HTTP/1.1\r\nConnection: close\r\n\r\n");
        // (Compared at one piece size: hyper alone, given it all at once, closes without the 400.)
        let (hyper, _) = answers(false, odd.as_bytes(), 7, true).await;
        assert!(hyper.starts_with("HTTP/1.1 400"), "{hyper}");
        assert_eq!(answers(true, odd.as_bytes(), 7, true).await, (hyper, 0));
        // The two differences, both with a client that closes its side: one that does so
        // after a whole request gets its answer (hyper drops the request), one that does so in
        // the middle of a body gets none (hyper runs the handler, whose body read fails).
        let (whole, _) = answers(true, b"GET /v1/kv/a HTTP/1.1\r\n\r\n", 7, false).await;
        assert!(whole.starts_with("HTTP/1.1 200 OK") && whole.ends_with("GET a None x-test=None body="), "{whole}");
        let cut = b"PUT /v1/kv/a HTTP/1.1\r\nContent-Length: 10\r\n\r\nabc";
        assert_eq!(answers(true, cut, 7, false).await, (String::new(), 0));
    }

    /// Runs the loop alone over an in-memory connection carrying `requests`: what it answered,
    /// and whether it handed the connection to hyper.
    async fn simple_loop(requests: &[u8]) -> (String, bool) {
        let (mut client, server) = tokio::io::duplex(1 << 20);
        let (_stop, mut stopped) = watch::channel(false);
        client.write_all(requests).await.expect("write");
        client.shutdown().await.expect("shutdown");
        let handed = matches!(serve(server, Direct::default(), key_requests, &mut stopped).await, Ended::Hyper(_));
        let mut got = Vec::new();
        client.read_to_end(&mut got).await.expect("read");
        (String::from_utf8_lossy(&got).into_owned(), handed)
    }

    #[tokio::test]
    async fn key_requests_stay_in_the_loop_and_another_goes_to_hyper() {
        let keys = b"PUT /v1/kv/a HTTP/1.1\r\nContent-Length: 1\r\n\r\nxGET /v1/kv/b HTTP/1.1\r\n\r\n";
        let (got, handed) = simple_loop(keys).await;
        assert!(!handed);
        assert!(got.contains("PUT a None x-test=None body=x") && got.contains("GET b None"), "{got}");
        let mixed = b"GET /v1/kv/a HTTP/1.1\r\n\r\nPOST /v1/other HTTP/1.1\r\nContent-Length: 0\r\n\r\n";
        let (got, handed) = simple_loop(mixed).await;
        assert!(handed);
        assert_eq!(got.matches("HTTP/1.1 200 OK").count(), 1, "{got}");
    }

    #[tokio::test]
    async fn an_idle_connection_closes_at_shutdown() {
        let (_client, server) = tokio::io::duplex(1024);
        let (stop, mut stopped) = watch::channel(false);
        let serving = tokio::spawn(async move {
            matches!(serve(server, Direct::default(), key_requests, &mut stopped).await, Ended::Closed)
        });
        stop.send_replace(true);
        assert!(tokio::time::timeout(std::time::Duration::from_secs(10), serving)
            .await
            .expect("closes")
            .expect("task"));
    }

    #[tokio::test]
    async fn at_shutdown_the_request_in_flight_is_answered_with_close_and_no_other() {
        let service = Direct::default();
        let (started, go) = (service.slow_started.clone(), service.slow_go.clone());
        let (mut client, server) = tokio::io::duplex(1 << 20);
        let (stop, mut stopped) = watch::channel(false);
        let serving = tokio::spawn(async move { serve(server, service, key_requests, &mut stopped).await });
        // An answer made before, one in flight at the shutdown, and one pipelined after it.
        client
            .write_all(b"GET /v1/kv/a HTTP/1.1\r\n\r\nGET /v1/kv/slow HTTP/1.1\r\n\r\nGET /v1/kv/b HTTP/1.1\r\n\r\n")
            .await
            .expect("write");
        started.notified().await;
        stop.send_replace(true);
        go.notify_one();
        let mut got = Vec::new();
        tokio::time::timeout(std::time::Duration::from_secs(10), client.read_to_end(&mut got))
            .await
            .expect("the connection closes")
            .expect("read");
        assert!(matches!(serving.await.expect("task"), Ended::Closed));
        let got = String::from_utf8_lossy(&got);
        assert!(got.contains("GET a None"), "{got}");
        let slow = got.find("HTTP/1.1 200 OK\r\netag: \"1\"\r\nconnection: close\r\n").expect("the slow answer closes");
        assert!(got[slow..].contains("GET slow None") && !got.contains("GET b None"), "{got}");
    }
}
