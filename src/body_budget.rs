//! Memory the node spends besides its stores: request bodies in flight are bounded here.
//!
//! A body is admitted before it is read, for what its request keeps alive (its
//! `Content-Length`, or the largest body the route takes when it has none; a bulk body twice,
//! as it came and parsed) times [`COPIES`]: that, and the copy the store, the replica's frames
//! or a forward keep while the request runs. When bodies in flight already hold the whole
//! budget, the next one waits up to [`ADMIT_WAIT`], then is refused (503 `overloaded`, with
//! `Retry-After`) instead of growing the process. A body the whole budget could never hold is
//! refused at once (413): waiting would not help, and run alone it took the process past its
//! limit (a 57 MiB bulk body in a 256 MiB node). The routes' limits are made from the budget so
//! that a body within them always fits (`node.rs`).

use std::sync::Arc;
use std::time::Duration;

use shoal_http_api::{ApiError, BodyPermit, Unavailable};
use tokio::sync::Semaphore;

/// Copies of a body alive while its request runs.
pub const COPIES: u64 = 2;

/// How long a body waits for room before it is refused.
pub const ADMIT_WAIT: Duration = Duration::from_secs(2);

/// The bytes request bodies may take at once, counted in KiB.
pub struct BodyBudget {
    kib: Arc<Semaphore>,
    total_kib: u32,
}

impl BodyBudget {
    /// A budget of `bytes` (at least 1 MiB).
    pub fn new(bytes: u64) -> Self {
        let total_kib = u32::try_from((bytes / 1024).max(1024)).unwrap_or(u32::MAX >> 4);
        BodyBudget { kib: Arc::new(Semaphore::new(total_kib as usize)), total_kib }
    }

    /// The budget's size in bytes.
    pub fn bytes(&self) -> u64 {
        u64::from(self.total_kib) * 1024
    }

    /// Bytes held by bodies in flight now.
    pub fn in_use(&self) -> u64 {
        (u64::from(self.total_kib) - self.kib.available_permits() as u64) * 1024
    }

    /// The most a request may keep alive and still be admitted (the budget, over [`COPIES`]).
    pub fn largest(&self) -> u64 {
        self.bytes() / COPIES
    }

    /// Admits a body whose request keeps `bytes` alive: its permit, held until the request is
    /// answered.
    pub async fn admit(&self, bytes: usize) -> Result<BodyPermit, ApiError> {
        let kib = (bytes as u64 * COPIES).div_ceil(1024);
        if kib == 0 {
            return Ok(BodyPermit::unbounded());
        }
        if kib > u64::from(self.total_kib) {
            return Err(ApiError::ValueTooLarge { limit: self.largest() as usize });
        }
        let kib = kib as u32;
        // Room at once (the usual case) needs no timer.
        if let Ok(permit) = self.kib.clone().try_acquire_many_owned(kib) {
            return Ok(BodyPermit::new(permit));
        }
        match tokio::time::timeout(ADMIT_WAIT, self.kib.clone().acquire_many_owned(kib)).await {
            Ok(Ok(permit)) => Ok(BodyPermit::new(permit)),
            _ => Err(ApiError::unavailable(
                Unavailable::Overloaded,
                format!(
                    "request bodies in flight already take the {} this node allows them; retry",
                    bytesize::ByteSize(self.bytes())
                ),
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn bodies_wait_for_room_and_one_the_budget_could_never_hold_is_refused_at_once() {
        let budget = BodyBudget::new(4 << 20);
        let a = budget.admit(1 << 20).await.expect("room for 2 MiB");
        let b = budget.admit(1 << 20).await.expect("room for 2 more");
        assert_eq!(budget.in_use(), 4 << 20);
        let started = tokio::time::Instant::now();
        tokio::time::pause();
        let refused = budget.admit(10).await;
        assert!(refused.is_err_and(|e| e.code() == "overloaded"), "no room: refused after the wait");
        assert!(started.elapsed() >= ADMIT_WAIT);
        drop((a, b));
        // Over the whole budget: refused at once, naming the largest request it takes.
        let started = tokio::time::Instant::now();
        let huge = budget.admit((2 << 20) + 1).await;
        assert!(huge.is_err_and(|e| e.code() == "value_too_large" && e.to_string().contains("2097152")));
        assert!(started.elapsed() < ADMIT_WAIT, "at once: waiting cannot help");
        assert_eq!(budget.in_use(), 0);
        let whole = budget.admit(2 << 20).await.expect("the whole budget fits");
        assert_eq!(budget.in_use(), 4 << 20);
        drop(whole);
    }

    /// Small bodies that find room at once do not overtake a large one already waiting: the
    /// room freed goes to the waiter first.
    #[tokio::test]
    async fn a_waiting_body_is_not_overtaken_by_small_ones() {
        let budget = Arc::new(BodyBudget::new(4 << 20));
        let small = budget.admit(1 << 20).await.expect("room for 2 MiB");
        let first = budget.admit(512 << 10).await.expect("room for 1 MiB more");
        let waiting = tokio::spawn({
            let budget = budget.clone();
            async move { budget.admit(3 << 19).await.map(|_| ()) }
        });
        // The large body (3 MiB with its copy) waits for room: 1 MiB is free.
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
        assert!(!waiting.is_finished(), "3 MiB do not fit in the 1 MiB left");
        drop(first);
        // The 1 MiB freed goes to the waiter (which still needs 1 MiB more): a small body
        // finds no room until the waiter is in.
        let meanwhile = futures::FutureExt::now_or_never(budget.admit(10));
        assert!(meanwhile.is_none(), "a small body did not wait behind the large one");
        drop(small);
        waiting.await.expect("task").expect("the waiting body is admitted once there is room");
    }
}
