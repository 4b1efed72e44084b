//! Fault tests with real processes: kill -9, SIGSTOP/SIGCONT and nft partitions, under a
//! workload of writers whose history is checked for lost acknowledged writes and phantoms, and
//! (in the five-member splits) readers whose reads are checked for linearizability.
//!
//! The nodes listen on 127.0.0.2, .3, .4 (.5, .6 with five; and send from there); the test's own clients come
//! from 127.0.0.1. These tests add nft rules, so they run only inside a private network
//! namespace: `tests/run.sh` runs them under `unshare -n` with `SHOAL_FAULT_NETNS=1`; outside
//! one they are ignored (listed as such, never passed silently).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::harness::wait_for;
use crate::workload::{async_verdict, check_addr, linearizable, read_all, verdict, History, Workload};

const BIN: &str = env!("CARGO_BIN_EXE_shoal");
const API_PORT: u16 = 7000;
const PEER_PORT: u16 = 17000;

/// Panics unless this process runs in the private namespace `tests/run.sh` made.
fn require_private_netns() {
    assert_eq!(
        std::env::var("SHOAL_FAULT_NETNS").as_deref(),
        Ok("1"),
        "fault tests change firewall rules: run them through tests/run.sh (unshare -n)"
    );
}

/// A node process on its own loopback address.
struct FaultNode {
    child: Option<Child>,
    ip: String,
    args: Vec<String>,
    log: PathBuf,
}

impl Drop for FaultNode {
    fn drop(&mut self) {
        self.kill9();
        if std::thread::panicking() {
            let kept = std::env::temp_dir().join(format!("shoal-fault-{}.log", self.ip));
            let _ = std::fs::copy(&self.log, &kept);
            eprintln!("--- {} log (last lines; all of it in {})\n{}", self.ip, kept.display(), self.log_tail());
            // CI shows only the end of a failed test's output: say again why it failed.
            if let Some(why) = PANIC_MESSAGE.lock().as_deref() {
                eprintln!("--- the test failed: {why}");
            }
        }
    }
}

/// The message of this process's last panic, kept to be repeated after the nodes' logs.
static PANIC_MESSAGE: parking_lot::Mutex<Option<String>> = parking_lot::Mutex::new(None);

/// Keeps each panic's message (and still prints it as usual).
fn keep_panic_messages() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let print = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let message = info
                .payload()
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| info.payload().downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default();
            let at = info.location().map(|l| format!(" at {l}")).unwrap_or_default();
            *PANIC_MESSAGE.lock() = Some(format!("{message}{at}"));
            print(info);
        }));
    });
}

impl FaultNode {
    fn start(dir: &Path, n: u8, join: Option<&str>, extra: &[&str]) -> Self {
        keep_panic_messages();
        let ip = format!("127.0.0.{}", n + 1);
        let mut args: Vec<String> = vec![
            "serve".into(),
            "--listen".into(),
            format!("{ip}:{API_PORT}"),
            "--peer-listen".into(),
            format!("{ip}:{PEER_PORT}"),
            "--data-dir".into(),
            dir.join(format!("node{n}")).display().to_string(),
            "--cache-size".into(),
            "64MiB".into(),
            "--ping-interval".into(),
            "200ms".into(),
            "--node-timeout".into(),
            "1s".into(),
        ];
        if let Some(seed) = join {
            args.extend(["--join".to_string(), seed.to_string()]);
        }
        args.extend(extra.iter().map(|s| s.to_string()));
        let log = dir.join(format!("node{n}.log"));
        let mut node = FaultNode { child: None, ip, args, log };
        node.spawn(false);
        node
    }

    fn spawn(&mut self, append: bool) {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(append)
            .write(true)
            .truncate(!append)
            .open(&self.log)
            .expect("log");
        let child = Command::new(BIN)
            .args(&self.args)
            .env("RUST_LOG", "info,openraft=warn,shoal::transfer=debug")
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("spawn shoal");
        self.child = Some(child);
    }

    fn api(&self) -> String {
        format!("{}:{API_PORT}", self.ip)
    }

    fn pid(&self) -> u32 {
        self.child.as_ref().expect("running").id()
    }

    fn kill9(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Sends `signal`; after `-STOP`, returns once every thread of the process has stopped.
    fn signal(&self, signal: &str) {
        let ok = Command::new("kill").args([signal, &self.pid().to_string()]).status().expect("kill");
        assert!(ok.success(), "kill {signal}");
        if signal == "-STOP" {
            crate::process::wait_stopped(self.pid());
        }
    }

    /// Starts the process again with the same flags (a failed node then rejoins by itself).
    fn restart(&mut self) {
        self.kill9();
        self.spawn(true);
    }

    fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().filter(|l| !l.contains(" DEBUG ")).rev().take(12).collect();
        lines.into_iter().rev().collect::<Vec<_>>().join("\n")
    }
}

fn client() -> reqwest::Client {
    reqwest::Client::builder().no_proxy().timeout(Duration::from_secs(5)).build().expect("client")
}

async fn view(http: &reqwest::Client, addr: &str) -> Option<Value> {
    http.get(format!("http://{addr}/v1/cluster")).send().await.ok()?.json().await.ok()
}

/// Waits until `addr` sees `members` members, no transition, no transfer, a leader.
async fn settled(http: &reqwest::Client, addr: &str, members: usize) -> Value {
    wait_for(&format!("{addr} to see {members} settled members"), || async {
        let v = view(http, addr).await?;
        let n = v["members"].as_array()?.len();
        (n == members && v["transition"].is_null() && v["transfer"].is_null() && v["leader"].is_u64()).then_some(v)
    })
    .await
}

/// Waits until every node at `addrs` has a replica snapshot of every bucket it owns (after a
/// membership change the replicas are rebuilt in the background; a failure before that loses
/// the buckets not rebuilt yet, and says so).
async fn fully_replicated(http: &reqwest::Client, addrs: &[String]) {
    wait_for("every bucket to have its replica", || async {
        for addr in addrs {
            let v = view(http, addr).await?;
            let r = &v["replication"];
            if r["attached_buckets"] != r["owned_buckets"] {
                return None;
            }
        }
        Some(())
    })
    .await;
}

/// Three nodes, joined in order, settled.
async fn three_nodes(dir: &Path, extra: &[&str]) -> Vec<FaultNode> {
    nodes(dir, 3, extra).await
}

/// `count` nodes, joined in order, settled.
async fn nodes(dir: &Path, count: u8, extra: &[&str]) -> Vec<FaultNode> {
    let http = client();
    let first = FaultNode::start(dir, 1, None, extra);
    settled(&http, &first.api(), 1).await;
    let seed = first.api();
    let mut nodes = vec![first];
    for n in 2..=count {
        nodes.push(FaultNode::start(dir, n, Some(&seed), extra));
        settled(&http, &seed, n as usize).await;
    }
    nodes
}

/// The member id and bucket count of the node at `api`, as `view` says.
fn member_of<'a>(view: &'a Value, api: &str) -> Option<&'a Value> {
    view["members"].as_array()?.iter().find(|m| m["api_addr"] == api)
}

async fn assert_no_loss(http: &reqwest::Client, nodes: &[FaultNode], history: &History) {
    for node in nodes {
        let problems = check_addr(http, &node.api(), history).await;
        if !problems.is_empty() {
            for n in nodes {
                eprintln!("--- {} log\n{}", n.ip, n.log_tail());
            }
        }
        assert!(
            problems.is_empty(),
            "via {}: {} problems, e.g. {:?}",
            node.ip,
            problems.len(),
            &problems[..problems.len().min(5)]
        );
    }
}

/// Lets the writers run until `n` more keys have an acknowledged value.
async fn let_writers_ack(w: &Workload, n: usize) {
    let start = w.acked();
    wait_for(&format!("{n} more acknowledged writes"), || async { (w.acked() >= start + n).then_some(()) }).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "changes firewall rules: runs through tests/run.sh in a private network namespace"]
async fn sync_kill_9_of_the_busiest_node_three_times_loses_no_acknowledged_write() {
    require_private_netns();
    let dir = tempfile::tempdir().expect("temp dir");
    let http = client();
    let mut nodes = three_nodes(dir.path(), &["--replication", "sync"]).await;
    let w = Workload::start(nodes.iter().map(FaultNode::api).collect(), 4);
    let mut failover_times = Vec::new();
    for round in 0..3 {
        let_writers_ack(&w, 300).await;
        fully_replicated(&http, &nodes.iter().map(FaultNode::api).collect::<Vec<_>>()).await;
        let survivor_view = view(&http, &nodes[0].api()).await.expect("view");
        let busiest = (0..nodes.len())
            .max_by_key(|&i| member_of(&survivor_view, &nodes[i].api()).and_then(|m| m["buckets"].as_u64()))
            .expect("a node");
        let victim_id = member_of(&survivor_view, &nodes[busiest].api()).expect("member")["id"].as_u64();
        let killed = Instant::now();
        nodes[busiest].kill9();
        let live: Vec<String> = (0..nodes.len()).filter(|&i| i != busiest).map(|i| nodes[i].api()).collect();
        w.set_targets(live.clone());
        wait_for(&format!("round {round}: node {victim_id:?} failed and its buckets served"), || async {
            let v = view(&http, &live[0]).await?;
            let failed = v["failed"].as_array()?.iter().any(|id| id.as_u64() == victim_id);
            (failed && v["members"].as_array()?.len() == 2).then_some(())
        })
        .await;
        failover_times.push(killed.elapsed());
        // Every key is readable again: the checker reads them all through a survivor.
        let history = w.pause().await;
        let problems = check_addr(&http, &live[0], &history).await;
        assert!(problems.is_empty(), "round {round}, right after failover: {problems:?}");
        w.resume();
        // The killed node comes back as a new member (it discards its data by itself).
        nodes[busiest].restart();
        settled(&http, &live[0], 3).await;
        w.set_targets(nodes.iter().map(FaultNode::api).collect());
    }
    let_writers_ack(&w, 300).await;
    let history = w.pause().await;
    assert_no_loss(&http, &nodes, &history).await;
    let acked = history.values().filter(|h| h.acked.is_some()).count();
    assert!(acked > 1000, "only {acked} keys acknowledged");
    eprintln!("failover times (kill -9 to failed and promoted): {failover_times:?}");
    w.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "changes firewall rules: runs through tests/run.sh in a private network namespace"]
async fn async_kill_9_loses_only_writes_within_the_replication_lag_and_invents_none() {
    require_private_netns();
    let dir = tempfile::tempdir().expect("temp dir");
    let http = client();
    let mut nodes = three_nodes(dir.path(), &["--replication", "async"]).await;
    let addrs: Vec<String> = nodes.iter().map(FaultNode::api).collect();
    let w = Workload::start(addrs.clone(), 4);
    let_writers_ack(&w, 300).await;
    fully_replicated(&http, &addrs).await;
    let v = view(&http, &addrs[0]).await.expect("view");
    let victim =
        (0..nodes.len()).max_by_key(|&i| member_of(&v, &addrs[i]).and_then(|m| m["buckets"].as_u64())).expect("a node");
    let victim_id = member_of(&v, &addrs[victim]).expect("member")["id"].as_u64();
    // The replication lag of the node to be killed, sampled for a second under load.
    let mut lag = Duration::ZERO;
    for _ in 0..10 {
        if let Some(l) = view(&http, &addrs[victim]).await.and_then(|v| v["replication"]["lag_seconds"].as_f64()) {
            lag = lag.max(Duration::from_secs_f64(l));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let killed = Instant::now();
    nodes[victim].kill9();
    let live: Vec<String> = (0..nodes.len()).filter(|&i| i != victim).map(|i| addrs[i].clone()).collect();
    w.set_targets(live.clone());
    wait_for("the killed node to be failed", || async {
        let v = view(&http, &live[0]).await?;
        v["failed"].as_array()?.iter().any(|id| id.as_u64() == victim_id).then_some(())
    })
    .await;
    let history = w.pause().await;
    // What was acknowledged within the lag (plus one drain round and a request) may be lost.
    let window = lag + Duration::from_millis(700);
    let cutoff = killed - window;
    let mut lost_in_window = 0;
    for (key, read) in read_all(&http, &live[0], &history).await {
        let found = read.unwrap_or_else(|e| panic!("{key}: {e}"));
        let h = &history[&key];
        if let Some(problem) = async_verdict(h, found, cutoff) {
            panic!("{key}: {problem} (found {found:?}, acknowledged {:?}, window {window:?})", h.acked);
        }
        if verdict(h, found).is_some() {
            lost_in_window += 1;
        }
    }
    eprintln!("async: measured lag {lag:?}; {lost_in_window} keys lost within the window");
    w.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "changes firewall rules: runs through tests/run.sh in a private network namespace"]
async fn a_paused_owner_acknowledges_nothing_for_buckets_it_lost() {
    require_private_netns();
    let dir = tempfile::tempdir().expect("temp dir");
    let http = client();
    for mode in ["sync", "async"] {
        let dir = dir.path().join(mode);
        std::fs::create_dir_all(&dir).expect("dir");
        let mut nodes = three_nodes(&dir, &["--replication", mode]).await;
        fully_replicated(&http, &nodes.iter().map(FaultNode::api).collect::<Vec<_>>()).await;
        let before = view(&http, &nodes[0].api()).await.expect("view");
        let victim_id = member_of(&before, &nodes[2].api()).expect("member")["id"].as_u64().expect("id");
        // A key of the node about to be paused, read through another node.
        let map: Value = http
            .get(format!("http://{}/v1/cluster/map", nodes[0].api()))
            .send()
            .await
            .expect("map")
            .json()
            .await
            .expect("json");
        let key = (0..)
            .map(|i| format!("paused-{i}"))
            .find(|k| map["owners"][shoal_raft::bucket_of(k.as_bytes()).0 as usize].as_u64() == Some(victim_id))
            .expect("a key of the victim");
        nodes[2].signal("-STOP");
        let stopped = Instant::now();
        // A forward already on its way to the paused owner is answered once the forwarder
        // holds it pfail (1 s node timeout), not when the request times out.
        let forwarded = {
            let (http, url) = (reqwest::Client::new(), format!("http://{}/v1/kv/{key}", nodes[0].api()));
            tokio::spawn(async move {
                let sent = Instant::now();
                let status = http.get(url).send().await.map(|r| r.status());
                (sent.elapsed(), status)
            })
        };
        wait_for("the paused node to be failed", || async {
            let v = view(&http, &nodes[0].api()).await?;
            v["failed"].as_array()?.iter().any(|id| id.as_u64() == Some(victim_id)).then_some(())
        })
        .await;
        let (took, status) = forwarded.await.expect("forward task");
        assert!(took < Duration::from_secs(4), "{mode}: the forward was answered after {took:?} ({status:?})");
        // 3× the node timeout in all.
        if let Some(rest) = Duration::from_secs(3).checked_sub(stopped.elapsed()) {
            tokio::time::sleep(rest).await;
        }
        nodes[2].signal("-CONT");
        // Straight after it resumes, every write sent to it: none may be acknowledged by it.
        let stale = http.clone();
        let mut own_acks = Vec::new();
        for i in 0..200 {
            let r = stale.put(format!("http://{}/v1/kv/stale-{i}", nodes[2].api())).body("stale").send().await;
            let Ok(r) = r else { continue };
            if r.status() == 200 {
                let body: Value = r.json().await.expect("json");
                if body["node"].as_u64() == Some(victim_id) {
                    own_acks.push(body);
                }
            }
        }
        assert!(
            own_acks.is_empty(),
            "{mode}: the resumed node acknowledged {} writes itself: {:?}",
            own_acks.len(),
            &own_acks[..own_acks.len().min(3)]
        );
        // It notices it was failed and comes back as a new member by itself.
        settled(&http, &nodes[0].api(), 3).await;
        let after = view(&http, &nodes[0].api()).await.expect("view");
        let rejoined = member_of(&after, &nodes[2].api()).expect("rejoined")["id"].as_u64();
        assert!(rejoined > Some(victim_id), "{mode}: it rejoined with a new id, not {victim_id}");
        for n in &mut nodes {
            n.kill9();
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "changes firewall rules: runs through tests/run.sh in a private network namespace"]
async fn an_isolated_node_is_failed_by_the_majority_and_the_cluster_converges_after_the_heal() {
    require_private_netns();
    let dir = tempfile::tempdir().expect("temp dir");
    let http = client();
    let nodes = three_nodes(dir.path(), &["--replication", "sync"]).await;
    let w = Workload::start(nodes.iter().map(FaultNode::api).collect(), 3);
    let_writers_ack(&w, 200).await;
    fully_replicated(&http, &nodes.iter().map(FaultNode::api).collect::<Vec<_>>()).await;
    let before = view(&http, &nodes[0].api()).await.expect("view");
    let ids: Vec<u64> =
        nodes.iter().map(|n| member_of(&before, &n.api()).expect("member")["id"].as_u64().expect("id")).collect();
    // Cut node 3 from its peers in both directions; the test's clients (127.0.0.1) still reach it.
    cut(&[(&nodes[2].ip, &nodes[0].ip), (&nodes[2].ip, &nodes[1].ip)]);
    let cut = Instant::now();
    let failed_view = wait_for("the majority to fail the isolated node", || async {
        let v = view(&http, &nodes[0].api()).await?;
        v["failed"].as_array()?.iter().any(|id| id.as_u64() == Some(ids[2])).then_some(v)
    })
    .await;
    let took = cut.elapsed();
    assert!(took >= Duration::from_secs(1), "failed after {took:?}, before the node timeout");
    let failed: Vec<u64> = failed_view["failed"].as_array().expect("failed").iter().filter_map(Value::as_u64).collect();
    assert_eq!(failed, vec![ids[2]], "the isolated node's own reports (a minority) fail nobody");
    // The isolated node acknowledges no write of its own while cut off.
    let r = http.put(format!("http://{}/v1/kv/isolated", nodes[2].api())).body("x").send().await.expect("put");
    assert_ne!(r.status(), 200, "an isolated node must not acknowledge a write");
    // Keep the cut for 20 s in all, then heal.
    if let Some(rest) = Duration::from_secs(20).checked_sub(cut.elapsed()) {
        tokio::time::sleep(rest).await;
    }
    heal();
    settled(&http, &nodes[0].api(), 3).await;
    let after = view(&http, &nodes[2].api()).await;
    assert!(
        after.is_some_and(|v| v["members"].as_array().map(Vec::len) == Some(3)),
        "the healed node sees the cluster"
    );
    let_writers_ack(&w, 200).await;
    let history = w.pause().await;
    assert_no_loss(&http, &nodes, &history).await;
    w.stop().await;
}

fn nft(args: &[&str]) {
    let out = Command::new("nft").args(args).output().expect("nft (tests/run.sh installs nftables)");
    assert!(out.status.success(), "nft {args:?}: {}", String::from_utf8_lossy(&out.stderr));
}

/// Drops every packet between the two addresses of each pair, both ways (table `chaos`).
fn cut(pairs: &[(&str, &str)]) {
    nft(&["add", "table", "inet", "chaos"]);
    nft(&["add", "chain", "inet", "chaos", "in", "{ type filter hook input priority 0; policy accept; }"]);
    for (a, b) in pairs {
        nft(&["add", "rule", "inet", "chaos", "in", "ip", "saddr", a, "ip", "daddr", b, "drop"]);
        nft(&["add", "rule", "inet", "chaos", "in", "ip", "saddr", b, "ip", "daddr", a, "drop"]);
    }
}

fn heal() {
    nft(&["delete", "table", "inet", "chaos"]);
}

/// How five members are split.
#[derive(Debug, Clone, Copy)]
enum Split {
    /// The Raft leader and the holder of its replica on the small side of a 3|2 split.
    LeaderAndHolderAlone,
    /// Another member and the holder of its replica on the small side; the leader stays with
    /// the majority.
    OwnerAndHolderAlone,
    /// Every member reaches only its two neighbours in a ring: each sees a different majority.
    MajoritiesRing,
}

/// Five members (all Raft voters) with sync replication under writers and readers; `split` for 12 s, then
/// heal. Every acknowledged write is there afterwards through every node, every read was
/// linearizable, and no bucket is left lost: the members the majority failed give back the
/// buckets they served last before they rejoin.
async fn five_members_split(split: Split) {
    require_private_netns();
    let dir = tempfile::tempdir().expect("temp dir");
    let http = client();
    // Five voters: with three, a small side holding two of them would leave the majority of
    // the members without a Raft majority (it could fail nobody until the heal).
    let nodes = nodes(dir.path(), 5, &["--replication", "sync", "--voters", "5"]).await;
    let apis: Vec<String> = nodes.iter().map(FaultNode::api).collect();
    let w = Workload::start_with_readers(apis.clone(), 3, 2);
    let_writers_ack(&w, 300).await;
    fully_replicated(&http, &apis).await;
    let before = settled(&http, &apis[0], 5).await;
    let id_of = |api: &str| member_of(&before, api).and_then(|m| m["id"].as_u64()).expect("member id");
    let ids: Vec<u64> = apis.iter().map(|a| id_of(a)).collect();
    let slot_of = |id: u64| ids.iter().position(|&i| i == id).expect("a member's slot");
    let holder_of = |slot: usize| {
        let m = member_of(&before, &apis[slot]).expect("member");
        slot_of(m["replica_on"].as_u64().expect("a replica holder"))
    };
    let leader = slot_of(before["leader"].as_u64().expect("a leader"));
    let ips: Vec<&str> = nodes.iter().map(|n| n.ip.as_str()).collect();
    let mut pairs = Vec::new();
    let small: Vec<usize> = match split {
        Split::LeaderAndHolderAlone => vec![leader, holder_of(leader)],
        Split::OwnerAndHolderAlone => {
            let owner =
                (0..5).find(|&s| s != leader && holder_of(s) != leader).expect("an owner apart from the leader");
            vec![owner, holder_of(owner)]
        }
        Split::MajoritiesRing => {
            for a in 0..5 {
                pairs.push((ips[a], ips[(a + 2) % 5]));
            }
            Vec::new()
        }
    };
    for &a in &small {
        for b in (0..5).filter(|b| !small.contains(b)) {
            pairs.push((ips[a], ips[b]));
        }
    }
    eprintln!("{split:?}: leader in slot {leader}, small side {small:?}, cut {pairs:?}");
    cut(&pairs);
    let cut_at = Instant::now();
    if !small.is_empty() {
        let big = (0..5).find(|s| !small.contains(s)).expect("a majority member");
        wait_for("the majority to fail the small side", || async {
            let v = view(&http, &apis[big]).await?;
            let failed: Vec<u64> = v["failed"].as_array()?.iter().filter_map(Value::as_u64).collect();
            small.iter().all(|&s| failed.contains(&ids[s])).then_some(())
        })
        .await;
        eprintln!("failed after {:?}", cut_at.elapsed());
    }
    let_writers_ack(&w, 100).await;
    if let Some(rest) = Duration::from_secs(12).checked_sub(cut_at.elapsed()) {
        tokio::time::sleep(rest).await;
    }
    heal();
    // The failed members give their buckets back and rejoin as new members by themselves.
    let last_lost = parking_lot::Mutex::new(String::new());
    let after = wait_for("five members again, settled, with no bucket lost", || async {
        let v = view(&http, &apis[(leader + 2) % 5]).await?;
        let lost = v["lost_buckets"].to_string();
        if *last_lost.lock() != lost {
            eprintln!("{:?} after the cut: lost buckets {lost}, failed {}", cut_at.elapsed(), v["failed"]);
            *last_lost.lock() = lost;
        }
        let n = v["members"].as_array()?.len();
        let settled = n == 5 && v["transition"].is_null() && v["transfer"].is_null() && v["leader"].is_u64();
        (settled && v["lost_buckets"].as_array()?.is_empty()).then_some(v)
    })
    .await;
    eprintln!("healed and settled {:?} after the cut; failed: {}", cut_at.elapsed(), after["failed"]);
    // Every node hears every other again (before that, a forward to a member it still holds
    // pfail answers 503 `owner_unreachable` at once; in the ring nobody was failed).
    for api in &apis {
        wait_for("every node to hear every member again", || async {
            let v = view(&http, api).await?;
            v["peers"].as_array()?.iter().all(|p| p["state"] == "ok").then_some(())
        })
        .await;
    }
    let_writers_ack(&w, 100).await;
    let history = w.pause().await;
    let reads = w.reads();
    assert_no_loss(&http, &nodes, &history).await;
    let problems = linearizable(&reads, &history);
    assert!(
        problems.is_empty(),
        "{} of {} reads not linearizable, e.g. {:?}",
        problems.len(),
        reads.len(),
        &problems[..problems.len().min(5)]
    );
    let o = w.outages();
    eprintln!(
        "{split:?}: {} writes acknowledged, {} failed, longest a writer saw failures {:?}; {} keys, {} reads checked",
        o.acked,
        o.failed,
        o.longest,
        history.len(),
        reads.len()
    );
    w.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "changes firewall rules: runs through tests/run.sh in a private network namespace"]
async fn a_split_that_cuts_the_leader_and_its_replica_holder_off_loses_nothing_and_reads_never_go_back() {
    five_members_split(Split::LeaderAndHolderAlone).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "changes firewall rules: runs through tests/run.sh in a private network namespace"]
async fn a_split_that_cuts_an_owner_and_its_replica_holder_off_loses_nothing_and_reads_never_go_back() {
    five_members_split(Split::OwnerAndHolderAlone).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "changes firewall rules: runs through tests/run.sh in a private network namespace"]
async fn a_majorities_ring_loses_nothing_and_reads_never_go_back() {
    five_members_split(Split::MajoritiesRing).await;
}
