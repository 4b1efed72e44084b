//! Requests to one peer that wait at the same time travel together.
//!
//! Each peer address has a lane: a request joins the lane's waiting list, and at most
//! [`LaneLimits::senders`] exchanges are in flight per peer; a sender takes what waits (up to
//! [`LaneLimits::items`] and [`LaneLimits::bytes`], at least one) into one exchange and hands
//! each request its own answer. A lone request goes at once, alone (no added wait at low
//! load); under load the batches grow by themselves, one round trip for many requests.
//!
//! What an exchange is (one request or many, which endpoint, what a failure of the whole
//! exchange means for each request) is the [`Exchange`]'s: replica writes and forwarded key
//! operations each have one.

use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

// Keyed by peer addresses from the map: a fast hash, no DoS-safe one.
use foldhash::HashMap;
use parking_lot::Mutex;
use tokio::sync::oneshot;

/// How one kind of request travels to a peer.
pub trait Exchange: Send + Sync + 'static {
    /// One request.
    type Item: Send + 'static;
    /// Its answer.
    type Answer: Send + 'static;
    /// Bytes the request adds to an exchange.
    fn size(item: &Self::Item) -> usize;
    /// Sends `items` (one or more) to `addr` in one exchange: one answer per item, in order.
    fn send(&self, addr: &str, items: Vec<Self::Item>) -> impl Future<Output = Vec<Self::Answer>> + Send;
    /// The answer of a request whose exchange ended without one for it.
    fn dropped() -> Self::Answer;
}

/// How much one lane carries.
#[derive(Debug, Clone, Copy)]
pub struct LaneLimits {
    /// Exchanges in flight per peer.
    pub senders: usize,
    /// Requests one exchange carries at most.
    pub items: usize,
    /// Bytes one exchange carries at most, unless its first request alone is larger.
    pub bytes: usize,
}

type Waiter<E> = oneshot::Sender<<E as Exchange>::Answer>;

/// The requests waiting for one peer, and how many exchanges are in flight to it.
struct Lane<E: Exchange> {
    waiting: Vec<(E::Item, Waiter<E>)>,
    senders: usize,
}

impl<E: Exchange> Lane<E> {
    /// Adds a request; whether a sender must start for it (fewer than `senders` run).
    fn push(&mut self, item: E::Item, waiter: Waiter<E>, senders: usize) -> bool {
        self.waiting.push((item, waiter));
        let start = self.senders < senders;
        if start {
            self.senders += 1;
        }
        start
    }
}

struct Shared<E: Exchange> {
    exchange: E,
    limits: LaneLimits,
    lanes: Mutex<HashMap<String, Lane<E>>>,
    exchanges: AtomicU64,
}

/// Lanes by peer address, for one kind of request. Cheap to clone.
pub struct Lanes<E: Exchange> {
    shared: Arc<Shared<E>>,
}

impl<E: Exchange> Clone for Lanes<E> {
    fn clone(&self) -> Self {
        Lanes { shared: self.shared.clone() }
    }
}

impl<E: Exchange> Lanes<E> {
    /// Lanes that send through `exchange`.
    pub fn new(exchange: E, limits: LaneLimits) -> Self {
        Lanes { shared: Arc::new(Shared { exchange, limits, lanes: Mutex::default(), exchanges: AtomicU64::new(0) }) }
    }

    /// Exchanges sent so far (a batch counts once).
    pub fn exchanges(&self) -> u64 {
        self.shared.exchanges.load(Ordering::Relaxed)
    }

    /// Whether no lane is open (no request waits, no sender runs).
    #[cfg(test)]
    pub fn idle(&self) -> bool {
        self.shared.lanes.lock().is_empty()
    }

    /// Sends `item` to `addr`, with whatever else waits for it, and returns the answer to it.
    pub async fn send(&self, addr: &str, item: E::Item) -> E::Answer {
        let (tx, rx) = oneshot::channel();
        let senders = self.shared.limits.senders;
        let start_sender = {
            let mut lanes = self.shared.lanes.lock();
            // The lane exists under load: the address is copied only when one is made.
            match lanes.get_mut(addr) {
                Some(lane) => lane.push(item, tx, senders),
                None => {
                    let mut lane = Lane { waiting: Vec::new(), senders: 0 };
                    let start = lane.push(item, tx, senders);
                    lanes.insert(addr.to_string(), lane);
                    start
                }
            }
        };
        if start_sender {
            tokio::spawn(drain(self.shared.clone(), addr.to_string()));
        }
        rx.await.unwrap_or_else(|_| E::dropped())
    }
}

/// Sends the lane's waiting requests, a batch at a time, until none waits.
async fn drain<E: Exchange>(shared: Arc<Shared<E>>, addr: String) {
    while let Some(batch) = take(&shared, &addr) {
        shared.exchanges.fetch_add(1, Ordering::Relaxed);
        let (items, waiters): (Vec<E::Item>, Vec<Waiter<E>>) = batch.into_iter().unzip();
        let answers = shared.exchange.send(&addr, items).await;
        // A waiter left without an answer (a wrong count) gets `dropped` when its sender drops.
        for (waiter, answer) in waiters.into_iter().zip(answers) {
            let _ = waiter.send(answer);
        }
    }
}

/// The oldest waiting requests of the lane, within the limits (at least one), or `None` (and
/// this sender stops) when none waits. A request whose caller went away before it was taken is
/// not sent: nobody waits for its answer, and a write that is not wanted any more must not land
/// (its writer took it back; sent late, it would put on a copy a value the owner no longer has).
fn take<E: Exchange>(shared: &Shared<E>, addr: &str) -> Option<Vec<(E::Item, Waiter<E>)>> {
    let mut lanes = shared.lanes.lock();
    let lane = lanes.get_mut(addr)?;
    lane.waiting.retain(|(_, waiter)| !waiter.is_closed());
    if lane.waiting.is_empty() {
        lane.senders -= 1;
        if lane.senders == 0 {
            lanes.remove(addr);
        }
        return None;
    }
    let (mut n, mut bytes) = (0, 0);
    for (item, _) in lane.waiting.iter().take(shared.limits.items) {
        let size = E::size(item);
        if n > 0 && bytes + size > shared.limits.bytes {
            break;
        }
        n += 1;
        bytes += size;
    }
    Some(lane.waiting.drain(..n).collect())
}
