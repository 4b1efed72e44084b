//! Concurrent writers with unique values that record a history, and a checker that finds
//! acknowledged writes that were lost (or values nobody wrote).
//!
//! Every writer owns its keys (`w<writer>-<n>`), so a key's last acknowledged value is well
//! defined. A write that failed or timed out may or may not have landed: its value is allowed
//! too, as long as it came after the last acknowledged one.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::{Mutex, RwLock};
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};
use tokio::task::JoinHandle;

use crate::harness::{wait_for, TestCluster};

/// What happened to one key.
#[derive(Debug, Default, Clone)]
pub struct KeyHistory {
    /// The last acknowledged value's sequence number.
    pub acked: Option<u64>,
    /// Sequence numbers attempted after it without an acknowledgement.
    pub uncertain: Vec<u64>,
    /// When the last acknowledged value was acknowledged.
    pub acked_at: Option<std::time::Instant>,
    /// Every sequence number ever sent for this key.
    pub written: Vec<u64>,
}

/// Every writer's keys.
pub type History = HashMap<String, KeyHistory>;

/// Running writers.
pub struct Workload {
    targets: Arc<RwLock<Vec<String>>>,
    paused: Arc<AtomicBool>,
    idle: Arc<AtomicUsize>,
    stop: Arc<AtomicBool>,
    history: Arc<Mutex<History>>,
    writers: Vec<JoinHandle<u64>>,
}

/// Upper bound on writes per writer, so a stuck test cannot write forever.
const MAX_WRITES: u64 = 200_000;

impl Workload {
    /// Starts `writers` writers against the API addresses `targets`.
    pub fn start(targets: Vec<String>, writers: usize) -> Self {
        let w = Workload {
            targets: Arc::new(RwLock::new(targets)),
            paused: Arc::new(AtomicBool::new(false)),
            idle: Arc::new(AtomicUsize::new(0)),
            stop: Arc::new(AtomicBool::new(false)),
            history: Arc::new(Mutex::new(HashMap::new())),
            writers: Vec::new(),
        };
        let handles = (0..writers).map(|id| tokio::spawn(w.writer(id))).collect();
        Workload { writers: handles, ..w }
    }

    fn writer(&self, id: usize) -> impl std::future::Future<Output = u64> + Send + 'static {
        let (targets, paused, idle, stop, history) =
            (self.targets.clone(), self.paused.clone(), self.idle.clone(), self.stop.clone(), self.history.clone());
        async move {
            let http = reqwest::Client::builder().no_proxy().timeout(Duration::from_secs(10)).build().expect("client");
            let mut rng = rand::rngs::SmallRng::seed_from_u64(id as u64);
            let (mut keys, mut seq) = (0u64, 0u64);
            while !stop.load(Ordering::Relaxed) && seq < MAX_WRITES {
                if paused.load(Ordering::Acquire) {
                    idle.fetch_add(1, Ordering::AcqRel);
                    while paused.load(Ordering::Acquire) && !stop.load(Ordering::Relaxed) {
                        tokio::time::sleep(Duration::from_millis(5)).await;
                    }
                    idle.fetch_sub(1, Ordering::AcqRel);
                    continue;
                }
                // Half new keys, half overwrites of this writer's older keys.
                let n = if keys == 0 || rng.random_bool(0.5) {
                    keys += 1;
                    keys - 1
                } else {
                    rng.random_range(0..keys)
                };
                let key = format!("w{id}-{n}");
                seq += 1;
                let target = {
                    let t = targets.read();
                    t[rng.random_range(0..t.len())].clone()
                };
                let ok = http
                    .put(format!("http://{target}/v1/kv/{key}"))
                    .body(format!("w{id}:{seq}"))
                    .send()
                    .await
                    .is_ok_and(|r| r.status() == 200);
                let mut h = history.lock();
                let entry = h.entry(key).or_default();
                entry.written.push(seq);
                if ok {
                    entry.acked = Some(seq);
                    entry.acked_at = Some(std::time::Instant::now());
                    entry.uncertain.clear();
                } else {
                    entry.uncertain.push(seq);
                }
            }
            seq
        }
    }

    /// How many keys have an acknowledged value so far.
    pub fn acked(&self) -> usize {
        self.history.lock().values().filter(|h| h.acked.is_some()).count()
    }

    /// Sets the nodes the writers send to.
    pub fn set_targets(&self, targets: Vec<String>) {
        *self.targets.write() = targets;
    }

    /// Stops every writer between two writes and returns the history so far.
    pub async fn pause(&self) -> History {
        self.paused.store(true, Ordering::Release);
        let n = self.writers.len();
        wait_for("the writers to pause", || async { (self.idle.load(Ordering::Acquire) == n).then_some(()) }).await;
        self.history.lock().clone()
    }

    /// Lets the writers go on.
    pub fn resume(&self) {
        self.paused.store(false, Ordering::Release);
    }

    /// Stops the writers; returns how many writes they sent.
    pub async fn stop(self) -> u64 {
        self.stop.store(true, Ordering::Relaxed);
        self.paused.store(false, Ordering::Release);
        let mut total = 0;
        for w in self.writers {
            total += w.await.unwrap_or(0);
        }
        total
    }
}

/// Reads every key of `history` through the node in `slot` (bulk gets) and returns the
/// problems: acknowledged writes lost or overwritten by an older value, and values nobody
/// wrote.
pub async fn check(cluster: &TestCluster, slot: usize, history: &History) -> Vec<String> {
    check_addr(&cluster.http, &cluster.api(slot), history)
        .await
        .into_iter()
        .map(|p| format!("{p} (slot {slot})"))
        .collect()
}

/// Every key of `history` read through `addr` (bulk gets): the sequence number found
/// (`None`: absent), or the error the node answered for that key.
pub async fn read_all(
    http: &reqwest::Client,
    addr: &str,
    history: &History,
) -> Vec<(String, Result<Option<u64>, Value>)> {
    let mut found = Vec::new();
    let keys: Vec<&String> = history.keys().collect();
    for chunk in keys.chunks(500) {
        let answer: Value = http
            .post(format!("http://{addr}/v1/bulk/get"))
            .json(&json!({ "keys": chunk }))
            .send()
            .await
            .expect("bulk get")
            .json()
            .await
            .expect("json");
        for r in answer["results"].as_array().expect("results") {
            let key = r["key"].as_str().expect("key");
            let writer = key.split('-').next().unwrap_or_default();
            let seq =
                r["value"].as_str().and_then(|v| v.strip_prefix(&format!("{writer}:"))).and_then(|s| s.parse().ok());
            let read = if r["error"].is_null() { Ok(seq) } else { Err(r["error"].clone()) };
            found.push((key.to_string(), read));
        }
    }
    found
}

/// [`check`] against the node at API address `addr`.
pub async fn check_addr(http: &reqwest::Client, addr: &str, history: &History) -> Vec<String> {
    let mut problems = Vec::new();
    for (key, read) in read_all(http, addr, history).await {
        let h = &history[&key];
        match read {
            Err(e) => problems.push(format!("{key}: error {e}")),
            Ok(found) => {
                if let Some(what) = verdict(h, found) {
                    problems.push(format!("{key}: {what} (found {found:?}, last acknowledged {:?})", h.acked));
                }
            }
        }
    }
    problems
}

#[test]
fn the_checker_finds_lost_and_phantom_writes() {
    // The checker's logic, on a history, without a cluster: see `verdict`.
    let h = KeyHistory { acked: Some(5), uncertain: vec![6, 7], ..Default::default() };
    assert_eq!(verdict(&h, None), Some("lost"));
    assert_eq!(verdict(&h, Some(4)), Some("phantom"), "an older value than the acknowledged one");
    assert_eq!(verdict(&h, Some(9)), Some("phantom"), "a value never written");
    assert_eq!(verdict(&h, Some(5)), None);
    assert_eq!(verdict(&h, Some(7)), None, "a write that timed out may have landed");
    let never = KeyHistory { acked: None, uncertain: vec![1], ..Default::default() };
    assert_eq!(verdict(&never, None), None);
    assert_eq!(verdict(&never, Some(1)), None);
}

/// The async-mode rule: what was found must have been written for this key (no phantom,
/// ever); a value other than the last acknowledged one (an older one, or none) is allowed only
/// if the last acknowledgement came after `cutoff` (within the replication lag before a kill).
pub fn async_verdict(h: &KeyHistory, found: Option<u64>, cutoff: std::time::Instant) -> Option<&'static str> {
    if found.is_some_and(|f| !h.written.contains(&f)) {
        return Some("phantom");
    }
    match verdict(h, found) {
        Some(_) if h.acked_at.is_some_and(|t| t >= cutoff) => None,
        other => other,
    }
}

#[test]
fn the_async_checker_allows_losses_only_within_the_lag() {
    let now = std::time::Instant::now();
    let early = now - std::time::Duration::from_secs(10);
    let h = |at| KeyHistory { acked: Some(5), acked_at: Some(at), written: vec![2, 5], ..Default::default() };
    assert_eq!(async_verdict(&h(now), Some(2), early), None, "an older value, acknowledged within the lag");
    assert_eq!(async_verdict(&h(now), None, early), None);
    assert_eq!(async_verdict(&h(early), None, now), Some("lost"), "acknowledged before the lag window");
    assert_eq!(async_verdict(&h(now), Some(3), early), Some("phantom"), "never written for this key");
}

/// The checker's rule for one key: `None` if what was found is allowed.
pub fn verdict(h: &KeyHistory, found: Option<u64>) -> Option<&'static str> {
    match (h.acked, found) {
        (Some(_), None) => Some("lost"),
        (_, Some(f)) if Some(f) != h.acked && !h.uncertain.contains(&f) => Some("phantom"),
        _ => None,
    }
}
