//! Concurrent writers with unique values that record a history, and a checker that finds
//! acknowledged writes that were lost (or values nobody wrote).
//!
//! Every writer owns its keys (`w<writer>-<n>`), so a key's last acknowledged value is well
//! defined. A write that failed or timed out may or may not have landed: its value is allowed
//! too, as long as it came after the last acknowledged one.
//!
//! Readers may run beside the writers ([`Workload::start_with_readers`]); their reads are
//! checked for linearizability ([`linearizable`]): each key is a register written by one
//! writer at a time, so a read must return the newest value acknowledged before it began or a
//! newer one written since, never a value older than one a read that ended before it began
//! returned.

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
    reads: Arc<Mutex<Vec<ReadOp>>>,
    readers: Vec<JoinHandle<()>>,
    outages: Arc<Mutex<Outages>>,
}

/// What the writers saw of the cluster's availability.
#[derive(Debug, Clone, Default)]
pub struct Outages {
    /// Writes acknowledged.
    pub acked: u64,
    /// Writes that failed (any error or timeout).
    pub failed: u64,
    /// The longest time one writer went from its first failed write to its next success.
    pub longest: Duration,
    /// Refusals that were not honest: a 500, a 503 without `Retry-After`, or an error that is
    /// not a problem document (the first few, then only counted).
    pub dishonest: Vec<String>,
    /// Refusals by status and code (`503 no_quorum`).
    pub refusals: std::collections::BTreeMap<String, u64>,
}

/// Why an error answer is not one a client can act on, if it is not: every error is a
/// problem document with a code, a 500 is a bug, and every 503 says when to retry.
pub fn dishonesty(status: u16, content_type: Option<&str>, retry_after: bool, body: &[u8]) -> Option<String> {
    let problem: Option<Value> =
        (content_type == Some("application/problem+json")).then(|| serde_json::from_slice(body).ok()).flatten();
    let code = problem.as_ref().and_then(|p| p["code"].as_str().map(str::to_string));
    match (status, code) {
        (_, None) => Some(format!("{status} without a problem document: {}", String::from_utf8_lossy(body))),
        (500, Some(code)) => Some(format!("500 {code}")),
        (503, Some(code)) if !retry_after => Some(format!("503 {code} without Retry-After")),
        _ => None,
    }
}

/// The status and code of an error answer, and whether it was honest; reads the body.
pub async fn refusal_of(r: reqwest::Response) -> (String, Option<String>) {
    let status = r.status().as_u16();
    let content_type = r.headers().get("content-type").and_then(|v| v.to_str().ok()).map(str::to_string);
    let retry_after = r.headers().contains_key("retry-after");
    let body = r.bytes().await.unwrap_or_default();
    let code = serde_json::from_slice::<Value>(&body).ok().and_then(|p| p["code"].as_str().map(str::to_string));
    (format!("{status} {}", code.unwrap_or_default()), dishonesty(status, content_type.as_deref(), retry_after, &body))
}

/// One read a reader made, with what the writers had acknowledged when it began.
#[derive(Debug, Clone)]
pub struct ReadOp {
    /// The key.
    pub key: String,
    /// When the read was sent.
    pub start: std::time::Instant,
    /// When its answer came.
    pub end: std::time::Instant,
    /// The key's last acknowledged sequence number when the read was sent.
    pub floor: Option<u64>,
    /// What it found (`None`: not found).
    pub seen: Option<u64>,
    /// The node it asked.
    pub via: String,
}

/// Upper bound on reads per reader.
const MAX_READS: u64 = 500_000;

/// Upper bound on writes per writer, so a stuck test cannot write forever.
const MAX_WRITES: u64 = 200_000;

impl Workload {
    /// Starts `writers` writers against the API addresses `targets`.
    pub fn start(targets: Vec<String>, writers: usize) -> Self {
        Self::start_with_readers(targets, writers, 0)
    }

    /// Starts `writers` writers and `readers` readers against the API addresses `targets`.
    pub fn start_with_readers(targets: Vec<String>, writers: usize, readers: usize) -> Self {
        let w = Workload {
            targets: Arc::new(RwLock::new(targets)),
            paused: Arc::new(AtomicBool::new(false)),
            idle: Arc::new(AtomicUsize::new(0)),
            stop: Arc::new(AtomicBool::new(false)),
            history: Arc::new(Mutex::new(HashMap::new())),
            writers: Vec::new(),
            reads: Arc::new(Mutex::new(Vec::new())),
            readers: Vec::new(),
            outages: Arc::new(Mutex::new(Outages::default())),
        };
        let handles = (0..writers).map(|id| tokio::spawn(w.writer(id))).collect();
        let readers = (0..readers).map(|id| tokio::spawn(w.reader(id))).collect();
        Workload { writers: handles, readers, ..w }
    }

    fn reader(&self, id: usize) -> impl std::future::Future<Output = ()> + Send + 'static {
        let (targets, stop, history, reads) =
            (self.targets.clone(), self.stop.clone(), self.history.clone(), self.reads.clone());
        let outages = self.outages.clone();
        async move {
            let http = reqwest::Client::builder().no_proxy().timeout(Duration::from_secs(5)).build().expect("client");
            let mut rng = rand::rngs::SmallRng::seed_from_u64(1000 + id as u64);
            for _ in 0..MAX_READS {
                if stop.load(Ordering::Relaxed) {
                    break;
                }
                let picked = {
                    let h = history.lock();
                    let n = h.len();
                    (n > 0).then(|| {
                        let (key, kh) = h.iter().nth(rng.random_range(0..n)).expect("a key");
                        (key.clone(), kh.acked)
                    })
                };
                let Some((key, floor)) = picked else {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    continue;
                };
                let via = {
                    let t = targets.read();
                    t[rng.random_range(0..t.len())].clone()
                };
                let start = std::time::Instant::now();
                let answer = match http.get(format!("http://{via}/v1/kv/{key}")).send().await {
                    Ok(r) if r.status().as_u16() == 200 => {
                        r.text().await.ok().map(|body| body.rsplit(':').next().and_then(|s| s.parse().ok()))
                    }
                    Ok(r) if r.status().as_u16() == 404 => Some(None),
                    Ok(r) => {
                        let (what, dishonest) = refusal_of(r).await;
                        let mut o = outages.lock();
                        *o.refusals.entry(format!("read {what}")).or_default() += 1;
                        if let Some(d) = dishonest.filter(|_| o.dishonest.len() < 20) {
                            o.dishonest.push(format!("read via {via}: {d}"));
                        }
                        None
                    }
                    Err(_) => None,
                };
                let Some(seen) = answer else {
                    // Refused or unreachable: not a read; a moment before the next.
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    continue;
                };
                reads.lock().push(ReadOp { key, start, end: std::time::Instant::now(), floor, seen, via });
            }
        }
    }

    /// What the writers saw of availability so far.
    pub fn outages(&self) -> Outages {
        self.outages.lock().clone()
    }

    /// The reads made so far.
    pub fn reads(&self) -> Vec<ReadOp> {
        self.reads.lock().clone()
    }

    fn writer(&self, id: usize) -> impl std::future::Future<Output = u64> + Send + 'static {
        let (targets, paused, idle, stop, history) =
            (self.targets.clone(), self.paused.clone(), self.idle.clone(), self.stop.clone(), self.history.clone());
        let outages = self.outages.clone();
        async move {
            let mut failing_since: Option<std::time::Instant> = None;
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
                // Recorded before it is sent: a reader may see it land before the answer.
                history.lock().entry(key.clone()).or_default().written.push(seq);
                let sent = std::time::Instant::now();
                let answer = http.put(format!("http://{target}/v1/kv/{key}")).body(format!("w{id}:{seq}")).send().await;
                let ok = answer.as_ref().is_ok_and(|r| r.status() == 200);
                let refusal = match answer {
                    Ok(r) if !ok => Some(refusal_of(r).await),
                    _ => None,
                };
                {
                    let mut o = outages.lock();
                    if let Some((what, dishonest)) = refusal {
                        *o.refusals.entry(what).or_default() += 1;
                        if let Some(d) = dishonest.filter(|_| o.dishonest.len() < 20) {
                            o.dishonest.push(format!("via {target}: {d}"));
                        }
                    }
                    if ok {
                        o.acked += 1;
                        if let Some(since) = failing_since.take() {
                            o.longest = o.longest.max(since.elapsed());
                        }
                    } else {
                        o.failed += 1;
                        failing_since.get_or_insert(sent);
                    }
                }
                let mut h = history.lock();
                let entry = h.entry(key).or_default();
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

    /// Stops the writers; returns how many writes they sent. Panics if any refusal was not
    /// honest (see [`dishonesty`]).
    pub async fn stop(self) -> u64 {
        self.stop.store(true, Ordering::Relaxed);
        self.paused.store(false, Ordering::Release);
        let mut total = 0;
        for w in self.writers {
            total += w.await.unwrap_or(0);
        }
        for r in self.readers {
            let _ = r.await;
        }
        let o = self.outages.lock().clone();
        assert!(
            o.dishonest.is_empty(),
            "refusals a client cannot act on: {:?} (all refusals: {:?})",
            o.dishonest,
            o.refusals
        );
        eprintln!("refusals the writers saw: {:?}", o.refusals);
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
                    let bucket = shoal_raft::bucket_of(key.as_bytes()).0;
                    problems.push(format!(
                        "{key}: {what} (found {found:?}, last acknowledged {:?}, bucket {bucket})",
                        h.acked
                    ));
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

/// The reads of `reads` that are not linearizable with the writes of `history`, described. Per
/// key (one writer, one write at a time, increasing sequence numbers), a read must see:
/// a value that was written for the key; at least the value acknowledged before it began
/// (`floor`; not found only if nothing was); and nothing older than what a read that ended
/// before it began saw.
pub fn linearizable(reads: &[ReadOp], history: &History) -> Vec<String> {
    let mut problems = Vec::new();
    let mut by_key: HashMap<&str, Vec<&ReadOp>> = HashMap::new();
    for r in reads {
        by_key.entry(r.key.as_str()).or_default().push(r);
        let written = history.get(&r.key).map_or(&[][..], |h| h.written.as_slice());
        if let Some(s) = r.seen {
            if !written.contains(&s) {
                problems.push(format!("{}: read {s} via {}, never written", r.key, r.via));
            }
        }
        if r.seen < r.floor {
            problems.push(format!(
                "{}: read {:?} via {}, older than {:?} acknowledged before",
                r.key, r.seen, r.via, r.floor
            ));
        }
    }
    for (key, mut rs) in by_key {
        rs.sort_by_key(|r| r.start);
        for (i, r) in rs.iter().enumerate() {
            // Reads that ended before this one began, newest value first.
            if let Some(q) = rs[..i].iter().filter(|q| q.end < r.start).max_by_key(|q| q.seen) {
                if q.seen > r.seen {
                    problems.push(format!(
                        "{key}: read {:?} via {} after a read via {} had seen {:?}: back in time",
                        r.seen, r.via, q.via, q.seen
                    ));
                }
            }
        }
    }
    problems
}

#[test]
fn the_linearizability_checker_finds_reads_that_go_back_in_time() {
    use std::time::Instant;
    let t0 = Instant::now();
    let at = |ms: u64| t0 + Duration::from_millis(ms);
    let read = |start: u64, end: u64, floor: Option<u64>, seen: Option<u64>| ReadOp {
        key: "k".into(),
        start: at(start),
        end: at(end),
        floor,
        seen,
        via: "n".into(),
    };
    let history: History =
        [("k".to_string(), KeyHistory { acked: Some(3), written: vec![1, 2, 3, 4], ..Default::default() })].into();
    let good = [
        read(0, 10, None, None),
        read(20, 30, Some(1), Some(2)),
        read(25, 40, Some(2), Some(4)),
        read(35, 50, Some(2), Some(2)),
    ];
    // The last two overlap: either order is a linearization.
    assert!(linearizable(&good, &history).is_empty(), "{:?}", linearizable(&good, &history));
    let stale = [read(0, 10, Some(3), Some(2))];
    assert_eq!(linearizable(&stale, &history).len(), 1, "older than acknowledged");
    let gone = [read(0, 10, Some(3), None)];
    assert_eq!(linearizable(&gone, &history).len(), 1, "an acknowledged value vanished");
    let phantom = [read(0, 10, None, Some(9))];
    assert_eq!(linearizable(&phantom, &history).len(), 1, "never written");
    let back = [read(0, 10, Some(2), Some(4)), read(20, 30, Some(3), Some(3))];
    let found = linearizable(&back, &history);
    assert_eq!(found.len(), 1, "{found:?}");
    assert!(found[0].contains("back in time"));
}
