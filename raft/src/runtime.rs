//! [`ShoalRuntime`]: openraft's async runtime — tokio, with a random number generator that the
//! deterministic simulation can seed.
//!
//! openraft draws its election timeouts from the runtime's thread-local generator. In
//! production that is seeded from the operating system; the simulation runs every node on one
//! thread and calls [`seed_thread_rng`] first, so that a run is a function of its seed.

use std::cell::RefCell;
use std::future::Future;
use std::time::Duration;

use openraft::{AsyncRuntime, OptionalSend, TokioRuntime};
use rand08::rngs::StdRng;
use rand08::{RngCore, SeedableRng};

thread_local! {
    static RNG: RefCell<Option<StdRng>> = const { RefCell::new(None) };
}

/// Seeds this thread's generator (the simulation does, before it starts any node).
pub fn seed_thread_rng(seed: u64) {
    RNG.with(|r| *r.borrow_mut() = Some(StdRng::seed_from_u64(seed)));
}

/// A handle on this thread's generator.
#[derive(Debug, Default, Clone, Copy)]
pub struct ThreadRng;

impl ThreadRng {
    fn with<T>(f: impl FnOnce(&mut StdRng) -> T) -> T {
        RNG.with(|r| f(r.borrow_mut().get_or_insert_with(StdRng::from_entropy)))
    }
}

impl RngCore for ThreadRng {
    fn next_u32(&mut self) -> u32 {
        Self::with(|r| r.next_u32())
    }

    fn next_u64(&mut self) -> u64 {
        Self::with(|r| r.next_u64())
    }

    fn fill_bytes(&mut self, dest: &mut [u8]) {
        Self::with(|r| r.fill_bytes(dest))
    }

    fn try_fill_bytes(&mut self, dest: &mut [u8]) -> Result<(), rand08::Error> {
        Self::with(|r| r.try_fill_bytes(dest))
    }
}

/// tokio, as openraft's [`TokioRuntime`], with [`ThreadRng`] as its generator.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct ShoalRuntime;

type Tokio = TokioRuntime;

impl AsyncRuntime for ShoalRuntime {
    type JoinError = <Tokio as AsyncRuntime>::JoinError;
    type JoinHandle<T: OptionalSend + 'static> = <Tokio as AsyncRuntime>::JoinHandle<T>;
    type Sleep = <Tokio as AsyncRuntime>::Sleep;
    type Instant = <Tokio as AsyncRuntime>::Instant;
    type TimeoutError = <Tokio as AsyncRuntime>::TimeoutError;
    type Timeout<R, T: Future<Output = R> + OptionalSend> = <Tokio as AsyncRuntime>::Timeout<R, T>;
    type ThreadLocalRng = ThreadRng;
    type OneshotSender<T: OptionalSend> = <Tokio as AsyncRuntime>::OneshotSender<T>;
    type OneshotReceiverError = <Tokio as AsyncRuntime>::OneshotReceiverError;
    type OneshotReceiver<T: OptionalSend> = <Tokio as AsyncRuntime>::OneshotReceiver<T>;

    fn spawn<T>(future: T) -> Self::JoinHandle<T::Output>
    where
        T: Future + OptionalSend + 'static,
        T::Output: OptionalSend + 'static,
    {
        Tokio::spawn(future)
    }

    fn sleep(duration: Duration) -> Self::Sleep {
        Tokio::sleep(duration)
    }

    fn sleep_until(deadline: Self::Instant) -> Self::Sleep {
        Tokio::sleep_until(deadline)
    }

    fn timeout<R, F: Future<Output = R> + OptionalSend>(duration: Duration, future: F) -> Self::Timeout<R, F> {
        Tokio::timeout(duration, future)
    }

    fn timeout_at<R, F: Future<Output = R> + OptionalSend>(deadline: Self::Instant, future: F) -> Self::Timeout<R, F> {
        Tokio::timeout_at(deadline, future)
    }

    fn is_panic(join_error: &Self::JoinError) -> bool {
        Tokio::is_panic(join_error)
    }

    fn thread_rng() -> Self::ThreadLocalRng {
        ThreadRng
    }

    fn oneshot<T>() -> (Self::OneshotSender<T>, Self::OneshotReceiver<T>)
    where
        T: OptionalSend,
    {
        Tokio::oneshot()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand08::Rng;

    #[test]
    fn a_seeded_thread_draws_the_same_numbers_again() {
        let draw = || (0..8).map(|_| ShoalRuntime::thread_rng().gen_range(0..1_000_000u64)).collect::<Vec<_>>();
        seed_thread_rng(7);
        let first = draw();
        seed_thread_rng(7);
        assert_eq!(draw(), first);
        seed_thread_rng(8);
        assert_ne!(draw(), first);
    }
}
