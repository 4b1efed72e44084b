//! Memory the node spends besides its stores: request bodies in flight are bounded here.
//!
//! A body is admitted before it is read, for its `Content-Length` (or the largest body the
//! route takes, when it has none) times [`COPIES`]: the body itself, and the copy the store or
//! the parsed request keeps while the request runs. When bodies in flight already hold the
//! whole budget, the next one waits up to [`ADMIT_WAIT`], then is refused (503 `overloaded`)
//! instead of growing the process. A body larger than the whole budget is admitted alone.

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

    /// Admits a body of `bytes`: its permit, held until the request is answered.
    pub async fn admit(&self, bytes: usize) -> Result<BodyPermit, ApiError> {
        let kib = (bytes as u64 * COPIES).div_ceil(1024).min(u64::from(self.total_kib)) as u32;
        if kib == 0 {
            return Ok(BodyPermit::unbounded());
        }
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
    async fn bodies_wait_for_room_and_a_huge_one_runs_alone() {
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
        let huge = budget.admit(100 << 20).await.expect("a body over the whole budget runs alone");
        assert_eq!(budget.in_use(), 4 << 20);
        drop(huge);
        assert_eq!(budget.in_use(), 0);
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
