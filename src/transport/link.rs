//! Peer links: one long-lived connection to each peer, the only way replica writes and
//! forwarded reads and writes travel between nodes.
//!
//! An HTTP exchange costs both sides hyper's general machinery (the client's pool checkout,
//! request encoding and response parsing; the server's parsing and routing): about 25k
//! instructions per exchange, more than the work it carries. A link is opened once, by an HTTP
//! upgrade on the peer listener (so it passes the cluster secret check and TLS like every
//! other peer request), and then carries messages in both directions:
//!
//! ```text
//!  frame = id:u64 kind:u8 more:1 len:31 payload[len]      (big-endian; len <= 64 KiB)
//! ```
//!
//! A message whose payload is larger than one frame travels as several frames of the same id
//! and kind, each but the last with `more` set; the writer sends one frame of it at a time and
//! everything small that waits in between, so a replica snapshot of a whole bucket does not
//! hold up the small messages behind it. Each direction carries at most one message in
//! fragments at a time, so a reader keeps at most one partial message (at most
//! [`MAX_MESSAGE`]). A frame or message over its bound, or fragments of a second message while
//! one is open, are a protocol error: the link closes.
//!
//! The opener sends requests; the other side answers each with a message of the same id, in
//! whatever order its handlers finish (a small one that needs no wait is answered at once by
//! the reader; one that waits, or a large one, goes on in a task of its own). Many requests are
//! in flight at once, and the writer of each side puts every message that waits into one write.
//!
//! What a caller sees on failure is what an HTTP exchange would have given it:
//! - The first request to a peer opens the link (an HTTP upgrade through the node's one
//!   connector, so with its reconnect policy) and waits for it; requests that come meanwhile
//!   wait for the same attempt. A peer that cannot be reached, or refuses the upgrade, fails
//!   them as unreachable; the next request tries again.
//! - A link that breaks fails the requests in flight on it (`Broken`: the peer may or may not
//!   have handled them), as a broken connection fails an HTTP exchange.
//! - A request that gets no answer in time fails with `Timeout`. If nothing at all came back
//!   on the link since the request was sent, the connection has stalled (a frozen peer, a
//!   partition) and is closed, so it is never reused, as hyper's pool would not reuse it; the
//!   next request opens a new one once the peer answers again. A link that still answers other
//!   requests stays open: one slow request does not fail the others.
//! - A request of a kind with the [`CANCELLABLE`] bit lives only as long as its caller: a caller
//!   that gives up (or times out) sends [`CANCEL`] with the request's id, and the serving side
//!   stops handling it where it is; when the link ends, the serving side stops every such
//!   request it is still handling. A forwarded write must not land after its client gave up,
//!   as it would not over HTTP, whose connection closes with the caller.
//! - The serving side handles at most [`MAX_IN_FLIGHT`] requests of a link at once (it reads
//!   no more until one ends), of which at most [`FORWARDS_IN_FLIGHT`] forwarded ones (kinds with
//!   the [`FORWARD`] bit; the opener waits for a place before it sends one), so replica writes
//!   always find room. When its node shuts down it answers every request it had taken (for at
//!   most [`crate::http_server::DRAIN_TIMEOUT`]), and each one that comes meanwhile with
//!   [`GOING_AWAY`]: not handled, so the caller gets unreachable, as from a closed listener.

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use bytes::{Buf, Bytes, BytesMut};
// Keyed by peer addresses and request ids among authenticated members: a fast hash, no DoS-safe one.
use foldhash::HashMap;
use parking_lot::Mutex;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufWriter};
use tokio::sync::{mpsc, oneshot, watch};
use tokio::task::AbortHandle;

use super::Malformed;

/// The value of the `Upgrade` header that asks for a link.
pub const PROTOCOL: &str = "shoal-link/6";
/// The answer of a serving side that is stopping: the request was not handled.
pub const GOING_AWAY: u8 = 255;
/// A message from the opener: its caller gave up on the request of this id (one of a
/// [`CANCELLABLE`] kind); the serving side stops handling it, and answers nothing.
pub const CANCEL: u8 = 254;
/// The bit of a request kind whose requests may be cancelled ([`CANCEL`]), and are stopped when
/// the link ends.
pub const CANCELLABLE: u8 = 0x40;
/// Bytes before a frame's payload.
const HEADER_LEN: usize = 13;
/// The largest payload of one frame a writer sends; a larger message goes in fragments.
const MAX_FRAME: usize = 64 * 1024;
/// The bit of a frame's length that says more fragments of its message follow.
const MORE: u32 = 1 << 31;
/// The largest message (all its fragments together) a reader accepts: a replica snapshot of a
/// whole bucket is the largest there is (a bucket of 1 GiB is a cache of a terabyte).
pub const MAX_MESSAGE: usize = 1 << 30;
/// Requests of one link a serving side handles at once.
pub const MAX_IN_FLIGHT: usize = 64;
/// The bit of a request kind that is a forwarded operation (a client's read or write that
/// another node serves): an opener has at most [`FORWARDS_IN_FLIGHT`] of them in flight on a
/// link, so that they never take the places its replica writes need. A forwarded write waits
/// for its replica write on another link; without the bound, two links full of forwarded
/// writes waiting for replica writes on each other would wait for ever.
pub const FORWARD: u8 = 0x20;
/// Forwarded requests an opener has in flight on one link at most.
pub const FORWARDS_IN_FLIGHT: usize = MAX_IN_FLIGHT / 2;
/// Forwarded requests a serving side handles on one link at once: the opener's bound, and
/// room for those its callers gave up on that it has not seen end yet. One more is answered
/// [`BUSY`] at once.
const FORWARDS_SERVED: usize = FORWARDS_IN_FLIGHT + MAX_IN_FLIGHT / 4;
/// The answer to a forwarded request over [`FORWARDS_SERVED`]: not handled.
pub const BUSY: u8 = 253;
/// Read and write buffers of a link, per direction.
const BUFFER: usize = 64 * 1024;
/// Requests up to this size are first tried at once by the serving side's reader, without a
/// task of their own; larger ones always get one.
const INLINE_MOST: usize = 16 * 1024;

/// Why a request over a link got no answer.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LinkError {
    /// The request was not handled (the link was closed before it was sent, or the serving
    /// side is stopping): it may go another way.
    #[error("the link is closed")]
    NotSent,
    /// The link broke with the request in flight: the peer may or may not have handled it.
    #[error("the link to the peer broke")]
    Broken,
    /// No answer in time.
    #[error("no answer in time")]
    Timeout,
    /// The serving side handles as many forwarded requests of the link as it takes: this one
    /// was not handled.
    #[error("the peer serves as many forwarded requests as it takes")]
    Busy,
    /// The request is larger than a link message may be (its size).
    #[error("a request of {0} bytes, more than a link message may carry")]
    TooLarge(usize),
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

/// Builds a message in one buffer, header first: `payload` appends the payload. The writer
/// ([`write_messages`]) sends one larger than a frame in fragments.
pub fn encode(id: u64, kind: u8, payload: impl FnOnce(&mut Vec<u8>)) -> Bytes {
    let mut out = Vec::with_capacity(256);
    out.extend_from_slice(&[0; HEADER_LEN]);
    payload(&mut out);
    // A message over `MAX_MESSAGE` (and so any that would touch the `more` bit) is never sent.
    let len = (out.len() - HEADER_LEN) as u32;
    out[0..8].copy_from_slice(&id.to_be_bytes());
    out[8] = kind;
    out[9..13].copy_from_slice(&len.to_be_bytes());
    Bytes::from(out)
}

/// The header of one frame.
fn frame_header(id: u64, kind: u8, len: usize, more: bool) -> [u8; HEADER_LEN] {
    let mut header = [0; HEADER_LEN];
    header[0..8].copy_from_slice(&id.to_be_bytes());
    header[8] = kind;
    let len = len as u32 | if more { MORE } else { 0 };
    header[9..13].copy_from_slice(&len.to_be_bytes());
    header
}

/// A message being read in fragments.
struct Partial {
    id: u64,
    kind: u8,
    payload: BytesMut,
}

/// Reads messages from a connection. Cancel-safe: what was read of a message stays in the
/// buffer, so [`Self::next`] may race other futures in a `select!`. A message that arrived
/// in one frame is a slice of the buffer, not a copy.
pub struct MessageReader<R> {
    io: R,
    buf: BytesMut,
    partial: Option<Partial>,
}

impl<R: AsyncRead + Unpin> MessageReader<R> {
    /// A reader of `io`.
    pub fn new(io: R) -> Self {
        MessageReader { io, buf: BytesMut::with_capacity(BUFFER), partial: None }
    }

    /// The next message; `None` at a clean end (the other side closed between messages).
    pub async fn next(&mut self) -> std::io::Result<Option<Message>> {
        loop {
            let wanted = match self.parse()? {
                Ok(message) => return Ok(Some(message)),
                Err(wanted) => wanted,
            };
            self.buf.reserve(wanted.max(BUFFER));
            if self.io.read_buf(&mut self.buf).await? == 0 {
                if self.buf.is_empty() && self.partial.is_none() {
                    return Ok(None);
                }
                return Err(std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "a link message was cut"));
            }
        }
    }

    /// The first whole message in the buffer, or how many more bytes the next frame needs.
    fn parse(&mut self) -> std::io::Result<Result<Message, usize>> {
        loop {
            if self.buf.len() < HEADER_LEN {
                return Ok(Err(HEADER_LEN - self.buf.len()));
            }
            let raw = u32::from_be_bytes(self.buf[9..13].try_into().unwrap_or_default());
            let (more, len) = (raw & MORE != 0, (raw & !MORE) as usize);
            if len > MAX_FRAME {
                return Err(malformed(format!("a link frame of {len} bytes (at most {MAX_FRAME})")));
            }
            if self.buf.len() < HEADER_LEN + len {
                return Ok(Err(HEADER_LEN + len - self.buf.len()));
            }
            let id = self.buf.get_u64();
            let kind = self.buf.get_u8();
            self.buf.advance(4);
            let payload = self.buf.split_to(len);
            match self.partial.take() {
                // A message in one frame (small ones may come between the fragments of another).
                partial if !more && partial.as_ref().is_none_or(|p| p.id != id) => {
                    self.partial = partial;
                    return Ok(Ok(Message { id, kind, payload: payload.freeze() }));
                }
                None => self.partial = Some(Partial { id, kind, payload }),
                Some(mut open) if open.id == id && open.kind == kind => {
                    if open.payload.len() + len > MAX_MESSAGE {
                        return Err(malformed(format!("a link message over {MAX_MESSAGE} bytes")));
                    }
                    open.payload.extend_from_slice(&payload);
                    if !more {
                        return Ok(Ok(Message { id, kind, payload: open.payload.freeze() }));
                    }
                    self.partial = Some(open);
                }
                Some(_) => return Err(malformed("fragments of two link messages at once".into())),
            }
        }
    }
}

fn malformed(what: String) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::InvalidData, what)
}

/// Writes what `messages` brings, everything that waits in one write, until it closes (then
/// shuts the connection's sending side) or a write fails (the error).
/// A message larger than a frame is written a frame at a time, with whatever small message
/// waits in between; large messages take their turns one after the other.
async fn write_messages<W: AsyncWrite + Unpin>(
    writer: W,
    mut messages: mpsc::UnboundedReceiver<Bytes>,
) -> std::io::Result<()> {
    let mut writer = BufWriter::with_capacity(BUFFER, writer);
    // Messages to send in fragments, in order; the front one is under way.
    let mut large: VecDeque<Fragments> = VecDeque::new();
    loop {
        if large.is_empty() {
            let Some(first) = messages.recv().await else { break };
            // The tasks already waiting to run go first, so that what they send goes out in
            // the same write. Without this turn, each message went out in a write of its own:
            // each sender is a task of its own (a client's request forwarded to its owner), and
            // tokio's multi-threaded runtime runs the task a wake-up is for (this one) right
            // after the task that woke it, on the same worker. So the peer also read and
            // answered them one by one.
            behind_ready_tasks().await;
            write_or_queue(&mut writer, first, &mut large).await?;
        }
        while let Ok(next) = messages.try_recv() {
            write_or_queue(&mut writer, next, &mut large).await?;
        }
        if let Some(message) = large.front_mut() {
            if write_fragment(&mut writer, message).await? {
                large.pop_front();
            }
        }
        writer.flush().await?;
    }
    writer.shutdown().await
}

/// A message to send in fragments: its id, its kind, and what is left of its payload.
struct Fragments {
    id: u64,
    kind: u8,
    left: Bytes,
}

/// Writes a message that fits one frame; queues a larger one for [`write_fragment`].
async fn write_or_queue<W: AsyncWrite + Unpin>(
    writer: &mut W,
    message: Bytes,
    large: &mut VecDeque<Fragments>,
) -> std::io::Result<()> {
    if message.len() - HEADER_LEN <= MAX_FRAME {
        return writer.write_all(&message).await;
    }
    let id = u64::from_be_bytes(message[0..8].try_into().unwrap_or_default());
    large.push_back(Fragments { id, kind: message[8], left: message.slice(HEADER_LEN..) });
    Ok(())
}

/// Writes the next fragment of `message`; whether it was the last.
async fn write_fragment<W: AsyncWrite + Unpin>(writer: &mut W, message: &mut Fragments) -> std::io::Result<bool> {
    let len = message.left.len().min(MAX_FRAME);
    let last = len == message.left.len();
    writer.write_all(&frame_header(message.id, message.kind, len, !last)).await?;
    writer.write_all(&message.left.split_to(len)).await?;
    Ok(last)
}

/// Resolves once the tasks waiting in this worker's queue have usually had their turn: it wakes
/// itself and waits, and tokio queues a task that woke itself behind the others on its worker
/// (another worker may take it first). Tokio's `yield_now` waits longer: until the runtime next
/// polls for I/O, which also costs a system call whenever the worker has nothing else to do.
async fn behind_ready_tasks() {
    let mut waited = false;
    std::future::poll_fn(|cx| {
        if waited {
            return std::task::Poll::Ready(());
        }
        waited = true;
        cx.waker().wake_by_ref();
        std::task::Poll::Pending
    })
    .await;
}

type Waiter = oneshot::Sender<Message>;

/// One open link (the requesting side).
struct Link {
    /// Messages to write.
    out: mpsc::UnboundedSender<Bytes>,
    /// Requests sent and not answered yet; `None` once the link is closed.
    pending: Mutex<Option<HashMap<u64, Waiter>>>,
    next_id: AtomicU64,
    /// When the link was opened: the clock of `last_read`.
    opened: Instant,
    /// When a message last came in, in microseconds since `opened`.
    last_read: AtomicU64,
    /// The reader's and the writer's tasks.
    tasks: Mutex<Vec<AbortHandle>>,
    /// Places for forwarded requests in flight ([`FORWARD`]).
    forwards: Arc<tokio::sync::Semaphore>,
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

    /// Microseconds since the link opened.
    fn now(&self) -> u64 {
        self.opened.elapsed().as_micros() as u64
    }
}

/// Whether a link to a peer is open or being opened (by the attempt of this number, whose
/// outcome the receiver tells).
enum Slot {
    Opening(u64, watch::Receiver<Option<Result<(), OpenError>>>),
    Open(Arc<Link>),
}

type Slots = Arc<Mutex<HashMap<String, Slot>>>;

/// The links of one node to its peers, by peer address. Dropping it closes them.
#[derive(Default)]
pub struct Links {
    slots: Slots,
    attempts: AtomicU64,
}

/// A handle on an open link.
pub struct LinkRef {
    link: Arc<Link>,
    slots: Weak<Mutex<HashMap<String, Slot>>>,
    addr: String,
}

impl Links {
    /// The link to `addr`: the open one, or one opened now with `connect` (which upgrades a
    /// connection to the peer). Callers that come while a link opens wait for the same
    /// attempt, and share its failure; the next caller after a failure tries again.
    pub async fn get<F, S>(&self, addr: &str, connect: impl FnOnce() -> F) -> Result<LinkRef, OpenError>
    where
        F: Future<Output = Result<S, OpenError>> + Send + 'static,
        S: AsyncRead + AsyncWrite + Send + 'static,
    {
        let mut connect = Some(connect);
        loop {
            let mut outcome = {
                let mut slots = self.slots.lock();
                match slots.get(addr) {
                    Some(Slot::Open(link)) => return Ok(self.handle(addr, link.clone())),
                    Some(Slot::Opening(_, outcome)) => outcome.clone(),
                    None => {
                        // A link that closed as soon as it opened: this caller opens it again,
                        // once; a second time is the attempt's failure.
                        let Some(connect) = connect.take() else {
                            return Err(OpenError::Unreachable("the link closed as it opened".into()));
                        };
                        let attempt = self.attempts.fetch_add(1, Ordering::Relaxed);
                        let (told, outcome) = watch::channel(None);
                        slots.insert(addr.to_string(), Slot::Opening(attempt, outcome.clone()));
                        self.open(addr, attempt, connect(), told);
                        outcome
                    }
                }
            };
            let told = outcome.wait_for(Option::is_some).await.map(|outcome| outcome.clone());
            match told {
                Ok(Some(Ok(()))) => {}
                Ok(Some(Err(e))) => return Err(e),
                // The attempt's task ended without telling (its runtime stops).
                Ok(None) | Err(_) => return Err(OpenError::Unreachable("the attempt to open a link ended".into())),
            }
        }
    }

    fn handle(&self, addr: &str, link: Arc<Link>) -> LinkRef {
        LinkRef { link, slots: Arc::downgrade(&self.slots), addr: addr.to_string() }
    }

    /// Whether a link to `addr` is open.
    #[cfg(test)]
    pub fn is_open(&self, addr: &str) -> bool {
        matches!(self.slots.lock().get(addr), Some(Slot::Open(_)))
    }

    /// Opens a link to `addr` with `connect`, in a task of its own (a caller that gives up
    /// does not stop it for the others), and tells how it went through `told`.
    fn open<F, S>(&self, addr: &str, attempt: u64, connect: F, told: watch::Sender<Option<Result<(), OpenError>>>)
    where
        F: Future<Output = Result<S, OpenError>> + Send + 'static,
        S: AsyncRead + AsyncWrite + Send + 'static,
    {
        // Whatever ends the attempt (a panic, a runtime shutting down), the slot does not stay
        // `Opening`: the guard takes it out unless the link was installed.
        let guard = Opening { slots: Arc::downgrade(&self.slots), addr: addr.to_string(), attempt };
        tokio::spawn(async move {
            let connected = connect.await;
            let Some(slots) = guard.slots.upgrade() else { return };
            let outcome = match connected {
                Ok(io) => {
                    install(&slots, &guard.addr, io);
                    Ok(())
                }
                Err(e) => Err(e),
            };
            drop(guard);
            told.send_replace(Some(outcome));
        });
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

/// An attempt to open a link: when it ends with its slot still `Opening` (no link installed),
/// the slot is taken out.
struct Opening {
    slots: Weak<Mutex<HashMap<String, Slot>>>,
    addr: String,
    attempt: u64,
}

impl Drop for Opening {
    fn drop(&mut self) {
        let Some(slots) = self.slots.upgrade() else { return };
        let mut slots = slots.lock();
        if matches!(slots.get(&self.addr), Some(Slot::Opening(attempt, _)) if *attempt == self.attempt) {
            slots.remove(&self.addr);
        }
    }
}

/// Why a link could not be opened: the peer could not be reached, did not answer in time, or
/// refused the upgrade (the reason).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum OpenError {
    /// No connection, or no answer to the upgrade.
    #[error("{0}")]
    Unreachable(String),
    /// The peer answered the upgrade with something else than 101 (its status).
    #[error("the peer refused a link ({0})")]
    Refused(u16),
}

/// Starts the tasks of a link over `io` and makes it the link to `addr`.
fn install<S>(slots: &Slots, addr: &str, io: S)
where
    S: AsyncRead + AsyncWrite + Send + 'static,
{
    let (read, write) = tokio::io::split(io);
    let (out, messages) = mpsc::unbounded_channel();
    let link = Arc::new(Link {
        out,
        pending: Mutex::new(Some(HashMap::default())),
        next_id: AtomicU64::new(1),
        opened: Instant::now(),
        last_read: AtomicU64::new(0),
        tasks: Mutex::default(),
        forwards: Arc::new(tokio::sync::Semaphore::new(FORWARDS_IN_FLIGHT)),
    });
    let (weak, weak_slots, at) = (Arc::downgrade(&link), Arc::downgrade(slots), addr.to_string());
    let writer = tokio::spawn(async move {
        // A write that fails leaves the requests queued unsent: the link is done.
        if write_messages(write, messages).await.is_err() {
            if let Some(link) = weak.upgrade() {
                forget(&weak_slots, &at, &link);
            }
        }
    });
    let reader = tokio::spawn(read_answers(
        MessageReader::new(read),
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

/// Closes `link` and forgets it, if it is still the link to `addr` (the next request opens
/// a new one).
fn forget(slots: &Weak<Mutex<HashMap<String, Slot>>>, addr: &str, link: &Arc<Link>) {
    retire(slots, addr, link);
    link.close();
}

/// Stops sending new requests over `link` (if it is still the link to `addr`), without
/// closing it: the requests in flight get their answers until the peer closes it.
fn retire(slots: &Weak<Mutex<HashMap<String, Slot>>>, addr: &str, link: &Arc<Link>) {
    if let Some(slots) = slots.upgrade() {
        let mut slots = slots.lock();
        if matches!(slots.get(addr), Some(Slot::Open(open)) if Arc::ptr_eq(open, link)) {
            slots.remove(addr);
        }
    }
}

/// Hands each answer to its request, until the link ends; then forgets the link.
async fn read_answers<R: AsyncRead + Unpin>(
    mut reader: MessageReader<R>,
    link: Weak<Link>,
    slots: Weak<Mutex<HashMap<String, Slot>>>,
    addr: String,
) {
    loop {
        let message = reader.next().await;
        let Some(link) = link.upgrade() else { return };
        match message {
            Ok(Some(answer)) => {
                link.last_read.store(link.now(), Ordering::Relaxed);
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
    /// [`Self::try_call`] with a payload that is always there.
    #[cfg(test)]
    pub async fn call(
        &self,
        kind: u8,
        payload: impl FnOnce(&mut Vec<u8>),
        timeout: Duration,
    ) -> Result<Message, LinkError> {
        self.try_call(
            kind,
            |out| {
                payload(out);
                true
            },
            timeout,
        )
        .await
    }

    /// Sends a request of `kind` (its payload appended by `payload`, which answers whether
    /// there is one: if not, nothing is sent and the call is [`LinkError::NotSent`]) and waits
    /// at most `timeout` for the answer. A request of a [`CANCELLABLE`] kind that gets no
    /// answer (it timed out, or the caller dropped this future) is cancelled at the peer.
    pub async fn try_call(
        &self,
        kind: u8,
        payload: impl FnOnce(&mut Vec<u8>) -> bool,
        timeout: Duration,
    ) -> Result<Message, LinkError> {
        let link = &self.link;
        let started = tokio::time::Instant::now();
        let _place = if kind & FORWARD != 0 {
            match tokio::time::timeout(timeout, link.forwards.clone().acquire_owned()).await {
                Ok(Ok(place)) => Some(place),
                Ok(Err(_)) => return Err(LinkError::NotSent),
                Err(_) => return Err(LinkError::Timeout),
            }
        } else {
            None
        };
        let timeout = timeout.saturating_sub(started.elapsed());
        let id = link.next_id.fetch_add(1, Ordering::Relaxed);
        let (waiter, answer) = oneshot::channel();
        match link.pending.lock().as_mut() {
            Some(pending) => pending.insert(id, waiter),
            None => return Err(LinkError::NotSent),
        };
        // A caller that gives up (a forwarded read whose client went away) leaves no waiter
        // behind: the guard takes it out unless the answer came.
        let mut waiting = Waiting { link, id, answered: false, cancel: kind & CANCELLABLE != 0 };
        let sent_at = link.now();
        let mut written = true;
        let message = encode(id, kind, |out| written = payload(out));
        if !written {
            waiting.cancel = false;
            return Err(LinkError::NotSent);
        }
        if message.len() - HEADER_LEN > MAX_MESSAGE {
            waiting.cancel = false;
            return Err(LinkError::TooLarge(message.len() - HEADER_LEN));
        }
        if link.out.send(message).is_err() {
            return Err(LinkError::NotSent);
        }
        let answer = tokio::time::timeout(timeout, answer).await;
        waiting.answered = matches!(answer, Ok(Ok(_)));
        drop(waiting);
        match answer {
            Ok(Ok(answer)) if answer.kind == GOING_AWAY => {
                // The peer is stopping: no new request goes over this link, and the ones in
                // flight still get their answers until the peer closes it.
                retire(&self.slots, &self.addr, link);
                Err(LinkError::NotSent)
            }
            Ok(Ok(answer)) if answer.kind == BUSY => Err(LinkError::Busy),
            Ok(Ok(answer)) => Ok(answer),
            Ok(Err(_)) => Err(LinkError::Broken),
            Err(_) => {
                if link.last_read.load(Ordering::Relaxed) < sent_at {
                    // Nothing came back since this request went out: the connection stalled.
                    forget(&self.slots, &self.addr, link);
                }
                Err(LinkError::Timeout)
            }
        }
    }
}

/// A request sent on a link whose answer has not come: dropping it takes its waiter out, and
/// cancels a request of a [`CANCELLABLE`] kind at the peer.
struct Waiting<'a> {
    link: &'a Link,
    id: u64,
    answered: bool,
    cancel: bool,
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        if self.answered {
            return;
        }
        let waited = self.link.pending.lock().as_mut().and_then(|p| p.remove(&self.id)).is_some();
        // Not when the answer came meanwhile (the waiter is gone), nor on a closed link (its
        // serving side stops such requests when the connection ends).
        if waited && self.cancel {
            let _ = self.link.out.send(encode(self.id, CANCEL, |_| {}));
        }
    }
}

/// What answers the requests that come over a link: a request's kind and payload in; out,
/// the handling that gives the answer's kind and payload, or why the request does not read
/// (the link then closes: its peer speaks another format, or garbage).
pub type Handler = Arc<dyn Fn(u8, Bytes) -> Result<Handling, Malformed> + Send + Sync>;

/// The handling of one request: its answer's kind and payload once done.
pub type Handling = Pin<Box<dyn Future<Output = (u8, Vec<u8>)> + Send>>;

/// Counts the links a listener serves (and their requests being handled), so that its node's
/// shutdown can wait for them: an upgraded connection leaves the HTTP server, whose drain no
/// longer sees it. Each link served also counts in `open`, the listener's gauge of open
/// connections, until it ends: the connection is still open after it left the HTTP server.
#[derive(Clone)]
pub struct Served {
    _held: mpsc::Sender<()>,
    open: metrics::Gauge,
}

/// Resolves once every [`Served`] is gone.
pub struct AllServed(mpsc::Receiver<()>);

/// A counter of served links and its waiter; the links count in `open` while they run.
pub fn served(open: metrics::Gauge) -> (Served, AllServed) {
    let (tx, rx) = mpsc::channel(1);
    (Served { _held: tx, open }, AllServed(rx))
}

/// Counts one served link in its listener's open connections while it lives.
struct OpenLink(metrics::Gauge);

impl OpenLink {
    fn new(open: &metrics::Gauge) -> Self {
        open.increment(1.0);
        OpenLink(open.clone())
    }
}

impl Drop for OpenLink {
    fn drop(&mut self) {
        self.0.decrement(1.0);
    }
}

impl AllServed {
    /// Waits until every link and every request of one ended.
    pub async fn wait(mut self) {
        let _ = self.0.recv().await;
    }
}

/// Serves a link opened by a peer: each request is handled in a task of its own (at most
/// [`MAX_IN_FLIGHT`] at once) and answered when it is done. Ends when the peer closes the
/// link; or at once when it sends a request that does not read (one line is logged, and the
/// connection closes as if it broke: the peer speaks another format, or garbage); or when
/// `shutdown` turns true and the requests taken are answered (those that come meanwhile get
/// [`GOING_AWAY`]), at most [`crate::http_server::DRAIN_TIMEOUT`] later.
pub async fn serve<S>(io: S, handler: Handler, mut shutdown: watch::Receiver<bool>, served: Served)
where
    S: AsyncRead + AsyncWrite + Send + 'static,
{
    let _open = OpenLink::new(&served.open);
    let (read, write) = tokio::io::split(io);
    let mut reader = MessageReader::new(read);
    let (out, messages) = mpsc::unbounded_channel();
    let mut writer = tokio::spawn(write_messages(write, messages));
    let serving = Serving { handler, out, served, cancellable: Arc::default(), forwards: Arc::default() };
    // A permit per request being handled: at most `MAX_IN_FLIGHT` (no further request is read
    // meanwhile), and all of them back once every handler ended.
    let permits = Arc::new(tokio::sync::Semaphore::new(MAX_IN_FLIGHT));
    // Made once, not at every turn of the loop: a watch's `wait_for` registers a waiter each
    // time it is created (a measurable share of a message's cost).
    let stop = shutdown.wait_for(|stop| *stop);
    tokio::pin!(stop);
    let (mut stopping, mut unreadable) = (false, false);
    loop {
        let Ok(permit) = permits.clone().acquire_owned().await else { break };
        // Biased: a shutdown is seen before any request that came after it.
        let request = tokio::select! {
            biased;
            _ = &mut stop => {
                stopping = true;
                break;
            }
            request = reader.next() => request,
        };
        match request {
            Ok(Some(cancel)) if cancel.kind == CANCEL => stop_request(&serving.cancellable, cancel.id),
            Ok(Some(request)) => {
                if let Err(e) = serving.take(request, permit) {
                    tracing::warn!(error = %e, "closed a peer link that sent an unreadable request");
                    unreadable = true;
                    break;
                }
            }
            Ok(None) => break,
            Err(e) => {
                tracing::debug!(error = %e, "a peer link broke");
                break;
            }
        }
    }
    // Whether the opener's side of the link ended (it closed it, or the connection broke).
    let ended = !stopping || serving.drain(&mut reader, &permits).await;
    if ended {
        // Nobody waits for the answers of cancellable requests any more: they stop.
        let stopped: Vec<AbortHandle> = serving.cancellable.lock().drain().map(|(_, task)| task).collect();
        for task in stopped {
            task.abort();
        }
    }
    // Requests still being handled (the peer left, or the drain ran out) finish on their own;
    // the writer ends once their answers are out (each holds a sender), at most the drain later
    // (at once after garbage: the connection closes now, so the peer fails what it has in
    // flight as broken rather than waiting).
    drop(serving);
    if !unreadable {
        let _ = tokio::time::timeout(crate::http_server::DRAIN_TIMEOUT, &mut writer).await;
    }
    writer.abort();
}

/// The serving side of one link: what its loop shares with the requests being handled.
struct Serving {
    handler: Handler,
    /// The answers to write.
    out: mpsc::UnboundedSender<Bytes>,
    served: Served,
    /// Requests of cancellable kinds being handled, by id.
    cancellable: Running,
    /// Forwarded requests being handled in tasks.
    forwards: Arc<std::sync::atomic::AtomicUsize>,
}

impl Serving {
    /// Handles one request, holding `permit` until it is answered; a forwarded one over the
    /// link's bound is answered [`BUSY`] at once. One that does not read is not answered.
    fn take(&self, request: Message, permit: tokio::sync::OwnedSemaphorePermit) -> Result<(), Malformed> {
        let (id, kind) = (request.id, request.kind);
        if kind & FORWARD != 0 && self.forwards.load(Ordering::Relaxed) >= FORWARDS_SERVED {
            let _ = self.out.send(encode(id, BUSY, |_| {}));
            return Ok(());
        }
        let small = request.payload.len() <= INLINE_MOST;
        let mut handling = (self.handler)(kind, request.payload)?;
        // Most requests are small and need no wait (a read of a key, a replica write applied):
        // served at once, here, they cost no task and no wake-up. One that must wait goes on in
        // a task of its own, which polls it again with its own waker; a large one (a replica
        // snapshot to apply) goes to a task at once, so that it does not hold up the requests
        // behind it on the link. A handler that panics loses its request only, as in a task.
        if small {
            let mut now = std::task::Context::from_waker(std::task::Waker::noop());
            let polled = std::panic::AssertUnwindSafe(|| handling.as_mut().poll(&mut now));
            match std::panic::catch_unwind(polled) {
                Ok(std::task::Poll::Ready((kind, payload))) => {
                    let _ = self.out.send(encode(id, kind, |buf| buf.extend_from_slice(&payload)));
                    return Ok(());
                }
                Ok(std::task::Poll::Pending) => {}
                Err(_) => return Ok(()),
            }
        }
        let (out, served) = (self.out.clone(), self.served.clone());
        let forwarded = (kind & FORWARD != 0).then(|| InFlight::new(&self.forwards));
        let running = (kind & CANCELLABLE != 0).then(|| self.cancellable.clone());
        // Held while the task is spawned and recorded: it cannot take itself out first.
        let mut recorded = running.is_some().then(|| self.cancellable.lock());
        let task = tokio::spawn(async move {
            let record = Recorded(running.map(|running| (running, id)));
            let (kind, payload) = handling.await;
            drop(record);
            let _ = out.send(encode(id, kind, |buf| buf.extend_from_slice(&payload)));
            drop((permit, served, forwarded));
        });
        if let Some(recorded) = recorded.as_mut() {
            recorded.insert(id, task.abort_handle());
        }
        Ok(())
    }

    /// While the node stops: until every request taken is answered (or the drain runs out),
    /// requests that come are answered [`GOING_AWAY`], not handled. Whether the opener's side
    /// of the link ended meanwhile.
    async fn drain<R: AsyncRead + Unpin>(
        &self,
        reader: &mut MessageReader<R>,
        permits: &tokio::sync::Semaphore,
    ) -> bool {
        let all_answered = permits.acquire_many(MAX_IN_FLIGHT as u32);
        tokio::pin!(all_answered);
        let drained = tokio::time::sleep(crate::http_server::DRAIN_TIMEOUT);
        tokio::pin!(drained);
        loop {
            tokio::select! {
                biased;
                _ = &mut all_answered => return false,
                () = &mut drained => return false,
                request = reader.next() => match request {
                    Ok(Some(cancel)) if cancel.kind == CANCEL => stop_request(&self.cancellable, cancel.id),
                    Ok(Some(request)) => {
                        let _ = self.out.send(encode(request.id, GOING_AWAY, |_| {}));
                    }
                    _ => return true,
                },
            }
        }
    }
}

/// One request counted while it is handled (a forwarded one, in its link's count).
struct InFlight(Arc<std::sync::atomic::AtomicUsize>);

impl InFlight {
    fn new(count: &Arc<std::sync::atomic::AtomicUsize>) -> Self {
        count.fetch_add(1, Ordering::Relaxed);
        InFlight(count.clone())
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// A cancellable request's place in its link's record of them: taken out when its handling
/// ends, however it ends (a handler that panics included).
struct Recorded(Option<(Running, u64)>);

/// A link's cancellable requests being handled, by id.
type Running = Arc<Mutex<HashMap<u64, AbortHandle>>>;

impl Drop for Recorded {
    fn drop(&mut self) {
        if let Some((running, id)) = self.0.take() {
            running.lock().remove(&id);
        }
    }
}

/// Stops handling the request `id`, if it is a cancellable one still being handled.
fn stop_request(running: &Mutex<HashMap<u64, AbortHandle>>, id: u64) {
    // Not under the lock: a task that stops takes itself out of it.
    let task = running.lock().remove(&id);
    if let Some(task) = task {
        task.abort();
    }
}

/// Answers an HTTP request for a link (`Upgrade:` [`PROTOCOL`]) with 101 and serves the link
/// that the connection becomes (see [`serve`]); anything else gets a 400.
pub async fn accept(
    mut request: axum::extract::Request,
    handler: Handler,
    shutdown: watch::Receiver<bool>,
    served: Served,
) -> axum::response::Response {
    use axum::http::{header, StatusCode};
    use axum::response::IntoResponse;
    if request.headers().get(header::UPGRADE).is_none_or(|v| v != PROTOCOL) {
        return (StatusCode::BAD_REQUEST, format!("expected an upgrade to {PROTOCOL}")).into_response();
    }
    let upgraded = hyper::upgrade::on(&mut request);
    tokio::spawn(async move {
        match upgraded.await {
            Ok(io) => serve(hyper_util::rt::TokioIo::new(io), handler, shutdown, served).await,
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
            Message { id: 3, kind: 255, payload: Bytes::from(vec![9u8; MAX_FRAME]) },
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
            let mut rx = MessageReader::new(rx);
            for m in &sent {
                assert_eq!(rx.next().await.expect("read").as_ref(), Some(m));
            }
            write.await.expect("writer");
            assert_eq!(rx.next().await.expect("a clean end"), None);
        }
    }

    #[tokio::test]
    async fn a_cut_message_or_an_oversized_one_is_an_error() {
        let whole = encode(5, 1, |out| out.extend_from_slice(b"abcdef"));
        for cut in [3, HEADER_LEN, whole.len() - 1] {
            assert!(MessageReader::new(&whole[..cut]).next().await.is_err(), "cut at {cut}");
        }
        let mut huge = encode(5, 1, |_| {}).to_vec();
        huge[9..13].copy_from_slice(&((MAX_FRAME + 1) as u32).to_be_bytes());
        let error = MessageReader::new(&huge[..]).next().await.expect_err("too large");
        assert_eq!(error.kind(), std::io::ErrorKind::InvalidData);
    }

    /// A handler that echoes the payload reversed, after waiting ten times as many
    /// milliseconds as its first byte says (so answers come back out of order), with the kind
    /// plus one.
    fn echo() -> Handler {
        Arc::new(|kind, payload: Bytes| {
            Ok(Box::pin(async move {
                let wait = payload.first().copied().unwrap_or(0);
                tokio::time::sleep(Duration::from_millis(10 * u64::from(wait))).await;
                (kind + 1, payload.iter().rev().copied().collect())
            }))
        })
    }

    /// A link over an in-memory pipe served by `handler`, and the serving side's shutdown switch.
    fn linked(handler: Handler) -> (Links, watch::Sender<bool>, tokio::task::JoinHandle<()>) {
        let (near, far) = tokio::io::duplex(64 * 1024);
        let (stop, stopped) = watch::channel(false);
        let server = tokio::spawn(serve(far, handler, stopped, served(metrics::Gauge::noop()).0));
        let links = Links::default();
        links.opened("peer", near);
        (links, stop, server)
    }

    /// Yields until `condition` holds, for at most five seconds.
    async fn until(what: &str, condition: impl Fn() -> bool) {
        let wait = async {
            while !condition() {
                tokio::task::yield_now().await;
            }
        };
        tokio::time::timeout(Duration::from_secs(5), wait).await.expect(what);
    }

    fn open(links: &Links) -> LinkRef {
        match links.slots.lock().get("peer") {
            Some(Slot::Open(link)) => links.handle("peer", link.clone()),
            _ => panic!("no open link"),
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

    /// A connection that counts the writes made on it.
    struct Counted<S> {
        io: S,
        writes: Arc<AtomicU64>,
    }

    impl<S: AsyncRead + Unpin> AsyncRead for Counted<S> {
        fn poll_read(
            mut self: Pin<&mut Self>,
            cx: &mut std::task::Context<'_>,
            buf: &mut tokio::io::ReadBuf<'_>,
        ) -> std::task::Poll<std::io::Result<()>> {
            Pin::new(&mut self.io).poll_read(cx, buf)
        }
    }

    impl<S: AsyncWrite + Unpin> AsyncWrite for Counted<S> {
        fn poll_write(
            mut self: Pin<&mut Self>,
            cx: &mut std::task::Context<'_>,
            buf: &[u8],
        ) -> std::task::Poll<std::io::Result<usize>> {
            let written = Pin::new(&mut self.io).poll_write(cx, buf);
            if matches!(written, std::task::Poll::Ready(Ok(n)) if n > 0) {
                self.writes.fetch_add(1, Ordering::Relaxed);
            }
            written
        }

        fn poll_flush(
            mut self: Pin<&mut Self>,
            cx: &mut std::task::Context<'_>,
        ) -> std::task::Poll<std::io::Result<()>> {
            Pin::new(&mut self.io).poll_flush(cx)
        }

        fn poll_shutdown(
            mut self: Pin<&mut Self>,
            cx: &mut std::task::Context<'_>,
        ) -> std::task::Poll<std::io::Result<()>> {
            Pin::new(&mut self.io).poll_shutdown(cx)
        }
    }

    // One worker thread, as the runtime runs a task woken by another right after it: the
    // case where each request used to go out in a write of its own.
    #[tokio::test(flavor = "multi_thread", worker_threads = 1)]
    async fn requests_sent_by_many_tasks_at_once_go_out_in_a_few_writes() {
        let (near, far) = tokio::io::duplex(64 * 1024);
        let (near_writes, far_writes) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
        let near = Counted { io: near, writes: near_writes.clone() };
        let far = Counted { io: far, writes: far_writes.clone() };
        let (_stop, stopped) = watch::channel(false);
        let _server = tokio::spawn(serve(far, echo(), stopped, served(metrics::Gauge::noop()).0));
        let links = Links::default();
        links.opened("peer", near);
        let link = Arc::new(open(&links));
        const CALLS: u8 = 40;
        // Spawned by a task on the worker, so that they all wait to run when it yields.
        let calls = tokio::spawn(async move {
            let calls: Vec<_> = (0..CALLS)
                .map(|i| {
                    let link = link.clone();
                    tokio::spawn(async move {
                        link.call(i, |out| out.extend_from_slice(&[0, i]), Duration::from_secs(10)).await
                    })
                })
                .collect();
            futures::future::join_all(calls).await
        });
        for (i, answer) in calls.await.expect("callers").into_iter().enumerate() {
            let answer = answer.expect("a caller").expect("answered");
            assert_eq!((answer.kind, answer.payload.to_vec()), (i as u8 + 1, vec![i as u8, 0]));
        }
        let (requests, answers) = (near_writes.load(Ordering::Relaxed), far_writes.load(Ordering::Relaxed));
        assert!(requests <= u64::from(CALLS) / 4, "{CALLS} requests went out in {requests} writes");
        assert!(answers <= u64::from(CALLS) / 4, "{CALLS} answers went out in {answers} writes");
    }

    #[tokio::test]
    async fn a_request_without_an_answer_in_time_closes_the_link() {
        let (links, _stop, _server) = linked(echo());
        let link = open(&links);
        let late = link.call(1, |out| out.push(200), Duration::from_millis(50)).await;
        assert_eq!(late, Err(LinkError::Timeout));
        assert!(!links.is_open("peer"));
        assert_eq!(link.call(1, |out| out.push(0), Duration::from_secs(5)).await, Err(LinkError::NotSent));
        // The next request opens a new link.
        assert!(links.slots.lock().get("peer").is_none());
    }

    #[tokio::test]
    async fn a_request_that_does_not_read_closes_the_link() {
        let echo = echo();
        let refusing: Handler = Arc::new(move |kind, payload| match kind {
            9 => Err(Malformed::Kind(9)),
            _ => echo(kind, payload),
        });
        let (links, _stop, server) = linked(refusing);
        let link = open(&links);
        assert!(link.call(1, |out| out.push(0), Duration::from_secs(5)).await.is_ok());
        assert_eq!(link.call(9, |out| out.push(0), Duration::from_secs(5)).await, Err(LinkError::Broken));
        tokio::time::timeout(Duration::from_secs(5), server).await.expect("the serving side ends").expect("task");
        until("the link is forgotten", || !links.is_open("peer")).await;
    }

    #[tokio::test]
    async fn a_request_whose_payload_could_not_be_written_is_not_sent() {
        let (release, done) = (Arc::new(tokio::sync::Notify::new()), Arc::new(AtomicU64::new(0)));
        let (handler, mut taken) = held(release.clone(), done);
        let (links, _stop, _server) = linked(handler);
        let link = open(&links);
        let unwritten = link.try_call(CANCELLABLE | 1, |_| false, Duration::from_secs(5)).await;
        assert_eq!(unwritten, Err(LinkError::NotSent));
        release.notify_one();
        assert!(link.call(1, |out| out.push(0), Duration::from_secs(5)).await.is_ok());
        assert_eq!(taken.recv().await, Some(1), "the peer got only the request that was written");
        assert_eq!(link.link.pending.lock().as_ref().map_or(0, HashMap::len), 0, "no waiter is left");
    }

    #[tokio::test]
    async fn a_caller_that_gives_up_leaves_no_waiter_behind() {
        let (links, _stop, _server) = linked(echo());
        let link = open(&links);
        let call = link.call(1, |out| out.push(100), Duration::from_secs(30));
        // The request goes out, then its caller is dropped before the answer (a second) comes.
        assert!(tokio::time::timeout(Duration::from_millis(50), call).await.is_err());
        let pending = || link.link.pending.lock().as_ref().map_or(0, HashMap::len);
        assert_eq!(pending(), 0);
        assert!(link.call(1, |out| out.push(0), Duration::from_secs(10)).await.is_ok());
        assert_eq!(pending(), 0);
    }

    /// A handler that waits for `release` before answering, and counts in `done` the requests
    /// it finished (an aborted one never does): it tells through `taken` when it has one.
    fn held(release: Arc<tokio::sync::Notify>, done: Arc<AtomicU64>) -> (Handler, mpsc::UnboundedReceiver<u8>) {
        let (taken, has_taken) = mpsc::unbounded_channel();
        let handler: Handler = Arc::new(move |kind, payload| {
            let (taken, release, done) = (taken.clone(), release.clone(), done.clone());
            Ok(Box::pin(async move {
                let _ = taken.send(kind);
                release.notified().await;
                done.fetch_add(1, Ordering::SeqCst);
                (kind, payload.to_vec())
            }))
        });
        (handler, has_taken)
    }

    #[tokio::test]
    async fn a_cancellable_request_whose_caller_gives_up_is_stopped_at_the_peer_and_others_are_not() {
        let (release, done) = (Arc::new(tokio::sync::Notify::new()), Arc::new(AtomicU64::new(0)));
        let (handler, mut taken) = held(release.clone(), done.clone());
        let (links, _stop, _server) = linked(handler);
        let link = open(&links);
        for kind in [CANCELLABLE | 1, 1] {
            let call = link.call(kind, |out| out.push(0), Duration::from_secs(30));
            // The request reaches the handler, then its caller goes away.
            tokio::select! {
                _ = call => panic!("answered before it was released"),
                taken = taken.recv() => assert_eq!(taken, Some(kind)),
            }
        }
        // Released, only the plain request finishes: the cancellable one was stopped.
        until("the plain request finishes", || {
            release.notify_waiters();
            done.load(Ordering::SeqCst) == 1
        })
        .await;
        // A cancellable request that is answered is not stopped, and the link stays open.
        let answered = tokio::join!(link.call(CANCELLABLE | 2, |out| out.push(5), Duration::from_secs(30)), async {
            assert_eq!(taken.recv().await, Some(CANCELLABLE | 2));
            release.notify_waiters();
        });
        assert_eq!(answered.0.expect("answered").payload.as_ref(), &[5]);
        assert_eq!(done.load(Ordering::SeqCst), 2);
        assert!(links.is_open("peer"));
    }

    #[tokio::test]
    async fn cancellable_requests_in_flight_when_the_link_ends_are_stopped() {
        let (release, done) = (Arc::new(tokio::sync::Notify::new()), Arc::new(AtomicU64::new(0)));
        let (handler, mut taken) = held(release.clone(), done.clone());
        let (links, _stop, server) = linked(handler);
        let link = open(&links);
        let calls = [CANCELLABLE | 1, 1].map(|kind| {
            let link = LinkRef { link: link.link.clone(), slots: link.slots.clone(), addr: link.addr.clone() };
            tokio::spawn(async move { link.call(kind, |out| out.push(0), Duration::from_secs(30)).await })
        });
        for _ in 0..2 {
            taken.recv().await.expect("the requests reach the handler");
        }
        // The opener goes away (its node stops): both callers see the link broken.
        drop(links);
        link.link.close();
        for call in calls {
            assert_eq!(call.await.expect("task"), Err(LinkError::Broken));
        }
        until("the plain request finishes", || {
            release.notify_waiters();
            done.load(Ordering::SeqCst) >= 1
        })
        .await;
        // The serving side ends once the plain one (which it let finish) is done; the
        // cancellable one was stopped and never finishes.
        tokio::time::timeout(Duration::from_secs(5), server).await.expect("the server ends").expect("task");
        for _ in 0..100 {
            release.notify_waiters();
            tokio::task::yield_now().await;
        }
        assert_eq!(done.load(Ordering::SeqCst), 1);
    }

    #[tokio::test]
    async fn a_slow_request_does_not_close_a_link_that_answers_others() {
        let (links, _stop, _server) = linked(echo());
        let link = open(&links);
        // `join!` polls in order: the slow request goes out first, the quick one after it, and
        // the quick one's answer comes back while the slow one waits.
        let (slow, quick) = tokio::join!(
            link.call(1, |out| out.push(250), Duration::from_secs(1)),
            link.call(1, |out| out.push(0), Duration::from_secs(10)),
        );
        assert_eq!(slow, Err(LinkError::Timeout));
        assert_eq!(quick.expect("answered").payload.as_ref(), &[0]);
        assert!(links.is_open("peer"), "the link answered since the slow request went out");
        assert!(link.call(1, |out| out.push(0), Duration::from_secs(10)).await.is_ok());
    }

    #[tokio::test]
    async fn a_served_link_counts_as_an_open_connection_until_it_ends() {
        let count = Arc::new(AtomicU64::new(0f64.to_bits()));
        let gauge = || f64::from_bits(count.load(Ordering::SeqCst));
        let (served, all_served) = served(metrics::Gauge::from_arc(count.clone()));
        let (near, far) = tokio::io::duplex(1024);
        let (_stop, stopped) = watch::channel(false);
        let server = tokio::spawn(serve(far, echo(), stopped, served));
        let links = Links::default();
        links.opened("peer", near);
        let answer = open(&links).call(1, |out| out.push(0), Duration::from_secs(10)).await;
        assert_eq!(answer.expect("answered").kind, 2);
        assert_eq!(gauge(), 1.0);
        drop(links);
        server.await.expect("served");
        assert_eq!(gauge(), 0.0);
        tokio::time::timeout(Duration::from_secs(5), all_served.wait()).await.expect("every link ended");
    }

    #[tokio::test]
    async fn requests_in_flight_when_the_peer_goes_away_fail_as_broken() {
        let (near, far) = tokio::io::duplex(1024);
        let links = Links::default();
        links.opened("peer", near);
        let link = open(&links);
        let call = tokio::spawn(async move { link.call(1, |out| out.push(0), Duration::from_secs(30)).await });
        // The peer reads the request, then dies without answering.
        let mut far = MessageReader::new(far);
        assert!(far.next().await.expect("request").is_some());
        drop(far);
        assert_eq!(call.await.expect("task"), Err(LinkError::Broken));
        until("the link is forgotten", || !links.is_open("peer")).await;
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
                Ok(Box::pin(async move {
                    let _ = taken.send(());
                    release.notified().await;
                    (kind, payload.to_vec())
                }))
            })
        };
        let (links, stop, server) = linked(handler);
        let link = open(&links);
        let call = tokio::spawn(async move { link.call(1, |out| out.push(100), Duration::from_secs(30)).await });
        has_taken.recv().await.expect("the request reaches the handler");
        stop.send_replace(true);
        // A request that comes while the serving side stops is not handled, and no further
        // one goes over the link; the one taken still gets its answer.
        let late = open(&links);
        assert_eq!(late.call(1, |out| out.push(7), Duration::from_secs(30)).await, Err(LinkError::NotSent));
        assert!(!links.is_open("peer"));
        release.notify_one();
        let answer = call.await.expect("task").expect("answered before the link closed");
        assert_eq!(answer.payload.as_ref(), &[100]);
        tokio::time::timeout(Duration::from_secs(5), server).await.expect("the server ends").expect("task");
        until("the link closes", || !links.is_open("peer")).await;
    }

    #[tokio::test]
    async fn an_attempt_to_open_that_dies_does_not_leave_the_peer_opening() {
        let links = Links::default();
        let opened = links.get::<_, tokio::io::DuplexStream>("peer", || async { panic!("the opener dies") }).await;
        assert!(opened.is_err());
        assert!(links.slots.lock().get("peer").is_none(), "the next caller tries again");
    }

    #[tokio::test]
    async fn callers_that_come_while_a_link_opens_wait_for_it_and_share_its_failure() {
        let links = Links::default();
        let attempts = Arc::new(AtomicU64::new(0));
        let release = Arc::new(tokio::sync::Notify::new());
        let (near, far) = tokio::io::duplex(64 * 1024);
        let (_stop, stopped) = watch::channel(false);
        let _server = tokio::spawn(serve(far, echo(), stopped, served(metrics::Gauge::noop()).0));
        let near = Arc::new(Mutex::new(Some(near)));
        let connect = || {
            let (attempts, release, near) = (attempts.clone(), release.clone(), near.clone());
            move || async move {
                attempts.fetch_add(1, Ordering::SeqCst);
                release.notified().await;
                near.lock().take().ok_or(OpenError::Unreachable("refused".into()))
            }
        };
        // Two callers at once: one attempt, and both get the link it opened.
        let both = futures::future::join(links.get("peer", connect()), links.get("peer", connect()));
        let released = async {
            until("the attempt starts", || attempts.load(Ordering::SeqCst) == 1).await;
            release.notify_waiters();
        };
        let ((first, second), ()) = tokio::join!(both, released);
        assert_eq!(attempts.load(Ordering::SeqCst), 1);
        for link in [first.expect("opened"), second.expect("opened")] {
            assert_eq!(link.call(1, |out| out.push(0), Duration::from_secs(10)).await.expect("answered").kind, 2);
        }
        // Once it is gone, the next callers wait for a new attempt, and share its failure.
        open(&links).link.close();
        links.slots.lock().clear();
        let both = futures::future::join(links.get("peer", connect()), links.get("peer", connect()));
        let released = async {
            until("the second attempt starts", || attempts.load(Ordering::SeqCst) == 2).await;
            release.notify_waiters();
        };
        let ((first, second), ()) = tokio::join!(both, released);
        assert_eq!(attempts.load(Ordering::SeqCst), 2);
        assert_eq!(first.err(), Some(OpenError::Unreachable("refused".into())));
        assert_eq!(second.err(), Some(OpenError::Unreachable("refused".into())));
    }

    #[tokio::test]
    async fn a_message_larger_than_a_frame_goes_in_fragments_with_small_ones_between() {
        let (links, _stop, _server) = linked(echo());
        let link = open(&links);
        // The large one first (its first byte asks for no wait), then small ones: they are all
        // answered, the large one reversed whole.
        let large: Vec<u8> = (0..5 * MAX_FRAME + 17).map(|i| if i == 0 { 0 } else { (i % 251) as u8 }).collect();
        let big = link.call(1, |out| out.extend_from_slice(&large), Duration::from_secs(30));
        let small = futures::future::join_all(
            (0..20u8).map(|i| link.call(3, move |out| out.extend_from_slice(&[0, i]), Duration::from_secs(30))),
        );
        let (big, small) = tokio::join!(big, small);
        assert_eq!(big.expect("answered").payload.to_vec(), large.iter().rev().copied().collect::<Vec<_>>());
        for (i, answer) in small.into_iter().enumerate() {
            assert_eq!(answer.expect("answered").payload.to_vec(), vec![i as u8, 0]);
        }
    }

    /// The frames `write_messages` puts on the wire for `messages`.
    async fn written(messages: &[Message]) -> Vec<u8> {
        let (tx, rx) = mpsc::unbounded_channel();
        for m in messages {
            tx.send(encode(m.id, m.kind, |out| out.extend_from_slice(&m.payload))).expect("queued");
        }
        drop(tx);
        let mut wire = Vec::new();
        write_messages(&mut wire, rx).await.expect("written");
        wire
    }

    #[tokio::test]
    async fn fragments_of_two_messages_at_once_or_of_two_kinds_are_refused() {
        let mut frames = Vec::new();
        frames.extend_from_slice(&frame_header(1, 1, 2, true));
        frames.extend_from_slice(b"ab");
        let mut second = frames.clone();
        second.extend_from_slice(&frame_header(2, 1, 2, true));
        second.extend_from_slice(b"cd");
        assert!(MessageReader::new(&second[..]).next().await.is_err(), "two messages in fragments");
        let mut kinds = frames.clone();
        kinds.extend_from_slice(&frame_header(1, 2, 2, false));
        kinds.extend_from_slice(b"cd");
        assert!(MessageReader::new(&kinds[..]).next().await.is_err(), "a fragment of another kind");
        // A small message between two fragments is read at once, then the whole one.
        let mut between = frames.clone();
        between.extend_from_slice(&frame_header(9, 3, 1, false));
        between.push(b'x');
        between.extend_from_slice(&frame_header(1, 1, 2, false));
        between.extend_from_slice(b"cd");
        let mut reader = MessageReader::new(&between[..]);
        assert_eq!(
            reader.next().await.expect("read"),
            Some(Message { id: 9, kind: 3, payload: Bytes::from_static(b"x") })
        );
        assert_eq!(
            reader.next().await.expect("read"),
            Some(Message { id: 1, kind: 1, payload: Bytes::from_static(b"abcd") })
        );
        // The end of the connection in the middle of a message is not a clean end.
        assert!(MessageReader::new(&frames[..]).next().await.is_err());
    }

    #[tokio::test]
    async fn forwarded_requests_beyond_what_a_link_serves_are_answered_busy() {
        let (release, done) = (Arc::new(tokio::sync::Notify::new()), Arc::new(AtomicU64::new(0)));
        let (handler, mut taken) = held(release.clone(), done.clone());
        let (near, far) = tokio::io::duplex(64 * 1024);
        let (_stop, stopped) = watch::channel(false);
        let _server = tokio::spawn(serve(far, handler, stopped, served(metrics::Gauge::noop()).0));
        // A raw opener that does not keep to its bound.
        let (read, mut write) = tokio::io::split(near);
        for id in 0..=FORWARDS_SERVED as u64 {
            write.write_all(&encode(id, FORWARD | 1, |out| out.push(0))).await.expect("sent");
        }
        for _ in 0..FORWARDS_SERVED {
            taken.recv().await.expect("taken");
        }
        let mut answers = MessageReader::new(read);
        let busy = answers.next().await.expect("read").expect("an answer");
        assert_eq!((busy.id, busy.kind), (FORWARDS_SERVED as u64, BUSY));
        // A replica write still finds room.
        write.write_all(&encode(999, 1, |out| out.push(0))).await.expect("sent");
        assert_eq!(taken.recv().await, Some(1));
    }

    /// Runs `f` on a runtime of its own (a property's case is a plain function).
    fn block_on<F: Future>(f: F) -> F::Output {
        tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime").block_on(f)
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(64))]

        /// Whatever bytes arrive, in whatever pieces, the reader reads messages or fails: it
        /// never panics, and never holds more than its bounds.
        #[test]
        fn the_reader_survives_any_bytes_in_any_pieces(
            bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..4096),
            piece in 1usize..64,
        ) {
            block_on(async {
                let (mut tx, rx) = tokio::io::duplex(piece);
                let write = tokio::spawn(async move {
                    let _ = tx.write_all(&bytes).await;
                });
                let mut reader = MessageReader::new(rx);
                while let Ok(Some(message)) = reader.next().await {
                    proptest::prop_assert!(message.payload.len() <= MAX_MESSAGE);
                }
                // The writer may wait for room the reader no longer makes: its end goes first.
                drop(reader);
                let _ = write.await;
                Ok(())
            })?;
        }

        /// Messages of any size, written as the writer writes them (large ones in fragments)
        /// and read in pieces of any size, read back as sent.
        #[test]
        fn messages_of_any_size_read_back_as_written(
            sizes in proptest::collection::vec(0usize..3 * MAX_FRAME, 1..6),
            piece in 1usize..100_000,
        ) {
            block_on(async {
                let sent: Vec<Message> = sizes
                    .iter()
                    .enumerate()
                    .map(|(i, &n)| Message { id: i as u64, kind: 7, payload: Bytes::from(vec![i as u8; n]) })
                    .collect();
                let wire = written(&sent).await;
                let (mut tx, rx) = tokio::io::duplex(piece);
                let write = tokio::spawn(async move { tx.write_all(&wire).await });
                let mut reader = MessageReader::new(rx);
                let mut read = Vec::new();
                while let Some(message) = reader.next().await.expect("well-formed") {
                    read.push(message);
                }
                write.await.expect("writer").expect("written");
                read.sort_by_key(|m| m.id);
                proptest::prop_assert_eq!(read, sent);
                Ok(())
            })?;
        }
    }
}
