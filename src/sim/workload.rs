//! Clients of a simulation and what they saw: each client owns its keys and works on them one
//! operation at a time, through a random running node, and records every operation with its
//! outcome and the simulated time it started and ended. In a scenario with shared keys, half
//! of each client's operations go to keys every client writes (`s-k0`, `s-k1`, ...).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use parking_lot::Mutex;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use shoal_http_api::types::{PutOptions, RouteContext};
use shoal_http_api::{ApiError, KeyApi, PutItem};
use shoal_raft::NodeId;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use super::cluster::SimCluster;
use crate::transport::CallError;

/// How long a client waits for an answer: longer than a forwarded request may take, so that a
/// write the client gave up on cannot land long after it.
pub const CLIENT_TIMEOUT: Duration = Duration::from_secs(15);

/// What a client asked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OpKind {
    /// Write this value.
    Put(String),
    /// Read.
    Get,
    /// Delete.
    Delete,
}

/// What came back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// Done: for a read, the value and version found.
    Ok {
        /// The value read (reads only).
        value: Option<String>,
        /// The version written or read.
        version: u64,
        /// The node that served it.
        node: NodeId,
    },
    /// The key is absent (a read or a delete).
    NotFound,
    /// The node answered an error: a write may still have happened.
    Failed(ApiError),
    /// No answer: anything may have happened.
    Unknown(String),
}

/// One operation.
#[derive(Debug, Clone)]
pub struct Op {
    /// The client.
    pub client: usize,
    /// The key.
    pub key: String,
    /// What was asked.
    pub kind: OpKind,
    /// When it was sent (simulated time since the run began).
    pub start: Duration,
    /// When its answer came (or the client gave up).
    pub end: Duration,
    /// What came back.
    pub outcome: Outcome,
    /// Whether a link was cut while it ran.
    pub during_split: bool,
    /// The host it was sent to.
    pub host: usize,
}

impl Op {
    /// Whether this is a write the cluster acknowledged.
    pub fn acknowledged_write(&self) -> bool {
        matches!(self.kind, OpKind::Put(_) | OpKind::Delete)
            && matches!(self.outcome, Outcome::Ok { .. } | Outcome::NotFound)
    }
}

/// Running clients.
pub struct Clients {
    stop: Arc<AtomicBool>,
    history: Arc<Mutex<Vec<Op>>>,
    tasks: Vec<JoinHandle<()>>,
}

/// The key a client uses.
pub fn key_of(client: usize, n: usize) -> String {
    format!("c{client}-k{n}")
}

/// A key every client writes.
pub fn shared_key(n: usize) -> String {
    format!("s-k{n}")
}

/// Whether `key` is one every client writes.
pub fn is_shared(key: &str) -> bool {
    key.starts_with("s-")
}

impl Clients {
    /// Starts `n` clients with `keys` keys each (and `shared` keys they all write) against
    /// `cluster`; times are counted from `t0`.
    pub fn start(cluster: &Arc<SimCluster>, n: usize, keys: (usize, usize), seed: u64, t0: Instant) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let history = Arc::new(Mutex::new(Vec::new()));
        let tasks = (0..n)
            .map(|c| {
                let rng = StdRng::seed_from_u64(seed.wrapping_mul(31).wrapping_add(c as u64));
                tokio::spawn(client(cluster.clone(), c, keys, rng, stop.clone(), history.clone(), t0))
            })
            .collect();
        Clients { stop, history, tasks }
    }

    /// Stops the clients (each finishes its operation) and answers the history.
    pub async fn stop(self) -> Vec<Op> {
        self.stop.store(true, Ordering::Relaxed);
        for task in self.tasks {
            let _ = task.await;
        }
        let history = self.history.lock().clone();
        history
    }
}

async fn client(
    cluster: Arc<SimCluster>,
    c: usize,
    (keys, shared): (usize, usize),
    mut rng: StdRng,
    stop: Arc<AtomicBool>,
    history: Arc<Mutex<Vec<Op>>>,
    t0: Instant,
) {
    let mut seq = 0u64;
    while !stop.load(Ordering::Relaxed) {
        tokio::time::sleep(Duration::from_millis(rng.random_range(5..50))).await;
        let running = cluster.running();
        if running.is_empty() {
            continue;
        }
        let (host, _, _) = running[rng.random_range(0..running.len())];
        // Without shared keys no draw is made for them: the other scenarios keep their seeds.
        let key = if shared > 0 && rng.random_bool(0.5) {
            shared_key(rng.random_range(0..shared))
        } else {
            key_of(c, rng.random_range(0..keys))
        };
        let kind = match rng.random_range(0..10) {
            0..6 => {
                seq += 1;
                OpKind::Put(format!("c{c}-v{seq}"))
            }
            6..9 => OpKind::Get,
            _ => OpKind::Delete,
        };
        let split_before = cluster.net().is_split();
        let start = t0.elapsed();
        let outcome = run(&cluster, host, &key, &kind).await;
        let during_split = split_before || cluster.net().is_split();
        history.lock().push(Op { client: c, key, kind, start, end: t0.elapsed(), outcome, during_split, host });
    }
}

fn outcome_of<T>(result: Result<Result<T, ApiError>, CallError>, ok: impl FnOnce(T) -> Outcome) -> Outcome {
    match result {
        Ok(Ok(t)) => ok(t),
        Ok(Err(ApiError::NotFound)) => Outcome::NotFound,
        Ok(Err(e)) => Outcome::Failed(e),
        Err(e) => Outcome::Unknown(e.to_string()),
    }
}

/// Runs one operation against host `host`.
pub async fn run(cluster: &SimCluster, host: usize, key: &str, kind: &OpKind) -> Outcome {
    let addr = cluster.api_addr(host);
    let net = cluster.net();
    let key = key.to_string();
    match kind {
        OpKind::Put(value) => {
            let item = PutItem { key, value: Bytes::from(value.clone()), options: PutOptions::default() };
            let answer =
                net.client_call(&addr, CLIENT_TIMEOUT, move |s| async move {
                    s.api.put(item, RouteContext::default()).await
                })
                .await;
            outcome_of(answer, |ok| Outcome::Ok { value: None, version: ok.version, node: ok.node })
        }
        OpKind::Get => {
            let answer =
                net.client_call(&addr, CLIENT_TIMEOUT, move |s| async move {
                    s.api.get(key, RouteContext::default()).await
                })
                .await;
            outcome_of(answer, |ok| Outcome::Ok {
                value: Some(String::from_utf8_lossy(&ok.value).into_owned()),
                version: ok.version,
                node: ok.node,
            })
        }
        OpKind::Delete => {
            let answer = net
                .client_call(&addr, CLIENT_TIMEOUT, move |s| async move {
                    s.api.delete(key, None, RouteContext::default()).await
                })
                .await;
            outcome_of(answer, |()| Outcome::Ok { value: None, version: 0, node: 0 })
        }
    }
}
