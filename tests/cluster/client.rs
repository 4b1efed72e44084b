//! The client library against real clusters: it routes to owners and follows joins and
//! leaves (no forwards once settled), takes another way round a killed node without losing
//! or repeating a write, and holds operations for a paused node through its grace window.
//! Also the event log, which must tell every node the same history, across restarts.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::Value;
use shoal::client::{Client, ClientError};

use crate::answers::{id_of, settled};
use crate::harness::{wait_for, TestCluster};
use crate::process::NodeProcess;

/// The sum of `shoal_forwarded_operations_total` over `addrs`.
async fn forwarded(http: &reqwest::Client, addrs: &[String]) -> f64 {
    let mut total = 0.0;
    for addr in addrs {
        let text =
            http.get(format!("http://{addr}/metrics")).send().await.expect("metrics").text().await.expect("text");
        total += text
            .lines()
            .filter(|l| l.starts_with("shoal_forwarded_operations_total"))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum::<f64>();
    }
    total
}

/// Writes and reads `n` keys through the client; every write is acknowledged and read back.
async fn round(client: &Client, tag: &str, n: usize) {
    for i in 0..n {
        let key = format!("{tag}-{i}");
        client.put(&key, format!("v{i}")).await.expect("put");
        let value = client.get(&key).await.expect("get").expect("a value");
        assert_eq!(value.bytes, format!("v{i}").as_bytes());
    }
}

/// The keys a writer had acknowledged (with their versions), and its failures.
type Written = (Vec<(String, u64)>, Vec<ClientError>);

/// Keeps writing `w-N` keys through the client until told to stop: what was acknowledged,
/// and every failure.
struct Writer {
    stop: Arc<AtomicBool>,
    task: tokio::task::JoinHandle<Written>,
}

impl Writer {
    fn start(client: Client, prefix: &'static str) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let task = tokio::spawn(async move {
            let (mut acked, mut failed) = (Vec::new(), Vec::new());
            // Bounded: at most 20,000 writes.
            for i in 0..20_000u32 {
                if flag.load(Ordering::Relaxed) {
                    break;
                }
                let key = format!("{prefix}-{i}");
                match client.put(&key, key.clone()).await {
                    Ok(ok) => acked.push((key, ok.version)),
                    Err(e) => failed.push(e),
                }
            }
            (acked, failed)
        });
        Writer { stop, task }
    }

    async fn finish(self) -> Written {
        self.stop.store(true, Ordering::Relaxed);
        self.task.await.expect("writer")
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_client_follows_a_join_and_a_leave_and_needs_no_forward_once_settled() {
    let mut cluster = TestCluster::start(3).await;
    cluster.wait_all_attached().await;
    let client = Client::connect([cluster.api(0)]).await.expect("connect");
    let addrs = |c: &TestCluster| c.running().map(|s| c.api(s)).collect::<Vec<_>>();

    let before = forwarded(&cluster.http, &addrs(&cluster)).await;
    round(&client, "settled", 200).await;
    assert_eq!(forwarded(&cluster.http, &addrs(&cluster)).await, before, "a settled client forwards nothing");
    assert_eq!(client.stats().through_other, 0);
    // A miss is no error: `get` answers None and `delete` false, through any owner.
    for i in 0..20 {
        let key = format!("missing-{i}");
        assert_eq!(client.get(&key).await, Ok(None), "{key}");
        assert_eq!(client.delete(&key).await, Ok(false), "{key}");
    }
    assert!(client.delete("settled-0").await.expect("delete"));
    assert_eq!(client.get("settled-0").await, Ok(None));

    // A join and a leave while it writes.
    let writer = Writer::start(client.clone(), "w");
    let joined = cluster.add_node_no_wait().await;
    cluster.wait_settled().await;
    let leaver = cluster.id(1);
    let left = cluster.http.post(cluster.url(0, &format!("/v1/cluster/nodes/{leaver}/leave"))).send().await;
    assert!(left.expect("leave").status().is_success());
    cluster.wait_stopped(1).await;
    cluster.wait_settled().await;
    let (acked, failed) = writer.finish().await;
    assert!(failed.is_empty(), "writes failed through a join and a leave: {failed:?}");
    assert!(acked.len() > 10, "the writer kept writing ({} writes)", acked.len());

    // The client holds the cluster's map: the joiner in it, the leaver not.
    let map: Value = cluster.json(0, "/v1/cluster/map").await;
    let version = map["version"].as_u64().expect("version");
    wait_for("the client to follow the map", || async { (client.routes().version == version).then_some(()) }).await;
    let routes = client.routes();
    assert!(routes.addr_of(cluster.id(joined)).is_some() && routes.addr_of(leaver).is_none());
    assert!(client.stats().map_updates >= 2, "{:?}", client.stats());

    // Settled again: no forwards, and every write acknowledged during the changes is there.
    let before = forwarded(&cluster.http, &addrs(&cluster)).await;
    round(&client, "after", 200).await;
    for (key, version) in &acked {
        let value = client.get(key).await.expect("get").expect("an acknowledged write");
        assert_eq!((value.bytes.as_ref(), value.version), (key.as_bytes(), *version), "{key}");
    }
    assert_eq!(forwarded(&cluster.http, &addrs(&cluster)).await, before, "a settled client forwards nothing");
    cluster.shutdown().await;
}

const FAST: [&str; 4] = ["--ping-interval", "200ms", "--node-timeout", "1s"];

fn http() -> reqwest::Client {
    reqwest::Client::builder().no_proxy().timeout(Duration::from_secs(15)).build().expect("client")
}

/// `n` process nodes with `extra` flags, joined in order and settled.
async fn processes(dir: &std::path::Path, n: usize, extra: &[&str]) -> Vec<NodeProcess> {
    let http = http();
    let mut nodes: Vec<NodeProcess> = vec![NodeProcess::start_with(&dir.join("n1"), extra)];
    let seed = nodes[0].addr.clone();
    for i in 2..=n {
        let flags = [extra, &["--join", &seed]].concat();
        nodes.push(NodeProcess::start_with(&dir.join(format!("n{i}")), &flags));
        settled(&http, &seed, i).await;
    }
    nodes
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_nodes_operations_go_round_it_and_none_is_lost_or_repeated() {
    let dir = tempfile::tempdir().expect("temp dir");
    let http = http();
    let mut nodes = processes(dir.path(), 3, &FAST).await;
    let client = Client::builder([nodes[0].addr.clone()]).request_timeout(Duration::from_secs(30)).connect().await;
    let client = client.expect("connect");
    let victim = id_of(&http, &nodes[0].addr, &nodes[2].addr).await;
    // Keys of the node to be killed, to read right after the kill.
    let theirs: Vec<String> = (0..100_000)
        .map(|i| format!("theirs-{i}"))
        .filter(|k| client.routes().owner_of_key(k.as_bytes()) == Some(victim))
        .take(20)
        .collect();
    for key in &theirs {
        client.put(key, key.clone()).await.expect("put");
    }

    let writers: Vec<Writer> = ["a", "b", "c", "d"].into_iter().map(|p| Writer::start(client.clone(), p)).collect();
    wait_for("some writes", || async { (client.stats().direct > 200).then_some(()) }).await;
    nodes[2].kill9();
    // Reads of its keys go through another node, or wait for the new map, and find them all.
    for key in &theirs {
        let value = client.get(key).await.expect("a read of the killed node's key").expect("its value");
        assert_eq!(value.bytes.as_ref(), key.as_bytes());
    }
    // Writes go on until the client routes by a map without the killed node, and a little
    // longer (bounded by the writers' own limit).
    wait_for("the client to drop the killed node", || async {
        client.routes().addr_of(victim).is_none().then_some(())
    })
    .await;
    let after = client.stats().direct;
    wait_for("writes on the new map", || async { (client.stats().direct > after + 200).then_some(()) }).await;
    let mut acked = Vec::new();
    let mut failed = Vec::new();
    for w in writers {
        let (a, f) = w.finish().await;
        acked.extend(a);
        failed.extend(f);
    }
    // Only writes in flight at the kill may fail, and they say they may have been applied.
    assert!(failed.len() <= 4, "at most one in-flight write per writer fails: {failed:?}");
    for e in &failed {
        assert!(matches!(e, ClientError::Connection { maybe_applied: true, .. }), "{e:?}");
    }
    let stats = client.stats();
    assert!(stats.through_other + stats.queued > 0, "the killed node's operations went round it: {stats:?}");
    // Every acknowledged write is there, at the version its acknowledgement named: nothing
    // applied it again later.
    for (key, version) in &acked {
        let value = client.get(key).await.expect("get").expect("an acknowledged write");
        assert_eq!((value.bytes.as_ref(), value.version), (key.as_bytes(), *version), "{key}");
    }
    eprintln!("{} writes acknowledged, {} failed in flight; {stats:?}", acked.len(), failed.len());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_grace_window_holds_a_paused_nodes_operations_and_fails_them_when_it_ends() {
    let dir = tempfile::tempdir().expect("temp dir");
    let http = http();
    // The cluster does not fail a node for a minute: only the client's window is at play.
    let nodes = processes(dir.path(), 3, &["--ping-interval", "1s", "--node-timeout", "60s"]).await;
    let paused = id_of(&http, &nodes[0].addr, &nodes[2].addr).await;
    let connect = || async {
        Client::builder([nodes[0].addr.clone()])
            .request_timeout(Duration::from_secs(10))
            .read_attempt_timeout(Duration::from_secs(1))
            .connect()
            .await
            .expect("connect")
    };
    let client = connect().await;
    let key = (0..10_000)
        .map(|i| format!("held-{i}"))
        .find(|k| client.routes().owner_of_key(k.as_bytes()) == Some(paused))
        .expect("a key of the paused node");
    client.put(&key, "kept").await.expect("put");

    // Paused for two seconds: the read waits, and completes once the node answers again.
    nodes[2].signal("-STOP");
    let read = tokio::spawn({
        let (client, key) = (client.clone(), key.clone());
        async move { client.get(&key).await }
    });
    tokio::time::sleep(Duration::from_secs(2)).await;
    if read.is_finished() {
        // (Under CI load the node once answered: `signal` returned before the stop took
        // effect. It now waits until every thread of the node is stopped.)
        let outcome = read.await.expect("task");
        panic!("the read waits for the paused node, but it ended: {outcome:?} {:?}", client.stats());
    }
    nodes[2].signal("-CONT");
    let value = read.await.expect("task");
    let value = value.unwrap_or_else(|e| panic!("the read completes: {e:?} {:?}", client.stats())).expect("a value");
    assert_eq!(value.bytes.as_ref(), b"kept");
    let stats = client.stats();
    assert!(stats.through_other + stats.queued > 0, "{stats:?}");

    // Paused past the window (60% of the 10 s request timeout): the read fails with a
    // connection error once the window has passed, before the request timeout.
    let client = connect().await;
    nodes[2].signal("-STOP");
    let started = Instant::now();
    let outcome = client.get(&key).await;
    let took = started.elapsed();
    nodes[2].signal("-CONT");
    assert!(
        matches!(outcome, Err(ClientError::Connection { maybe_applied: false, .. })),
        "a connection error after the window: {outcome:?}"
    );
    assert!(took >= Duration::from_secs(6), "not before the 6 s window ended: {took:?}");
    // Back, but the client waits for a new map before it talks to it directly: the read
    // goes through another node meanwhile.
    let value = client.get(&key).await.expect("get through another node").expect("a value");
    assert_eq!(value.bytes.as_ref(), b"kept");
}

/// The events a node answers, all of them.
async fn events(http: &reqwest::Client, addr: &str) -> Vec<Value> {
    let page: Value = http
        .get(format!("http://{addr}/v1/cluster/events?limit=100000"))
        .send()
        .await
        .expect("events")
        .json()
        .await
        .expect("json");
    page["events"].as_array().expect("events").clone()
}

/// The membership story of `events`: kind and member, without the bucket-level detail
/// (moves, replica placement) whose number depends on timing.
fn story(events: &[Value]) -> Vec<String> {
    const DETAIL: [&str; 4] = ["buckets_moved", "replica_moved", "move_aborted", "promoted"];
    events
        .iter()
        .filter(|e| !DETAIL.contains(&e["type"].as_str().unwrap_or("")))
        .map(|e| match e["node"].as_u64() {
            Some(n) => format!("{}({n})", e["type"].as_str().unwrap_or("?")),
            None => e["type"].as_str().unwrap_or("?").to_string(),
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_event_log_tells_every_node_the_same_history_also_after_a_restart() {
    let dir = tempfile::tempdir().expect("temp dir");
    let http = http();
    let mut nodes = processes(dir.path(), 4, &FAST).await;
    let seed = nodes[0].addr.clone();
    // Node 4 leaves; node 3 is killed and failed by the other two.
    let left = http.post(format!("http://{seed}/v1/cluster/nodes/4/leave")).send().await.expect("leave");
    assert!(left.status().is_success());
    nodes[3].wait_exit(Duration::from_secs(60));
    settled(&http, &seed, 3).await;
    nodes[2].kill9();
    settled(&http, &seed, 2).await;

    let first = events(&http, &seed).await;
    let second = events(&http, &nodes[1].addr).await;
    let last = |e: &[Value]| e.last().and_then(|e| e["index"].as_u64()).unwrap_or(0);
    let common = last(&first).min(last(&second));
    let upto = |e: &[Value]| e.iter().filter(|e| e["index"].as_u64() <= Some(common)).cloned().collect::<Vec<_>>();
    assert_eq!(upto(&first), upto(&second), "every node tells the same history");

    let join = |n: u64| {
        vec![format!("node_joined({n})"), "transition_begun".into(), "transition_ended".into(), "transfer_ended".into()]
    };
    let expected: Vec<String> = [
        vec!["cluster_created(1)".to_string()],
        join(2),
        join(3),
        join(4),
        vec!["node_leaving(4)".into(), "transition_begun".into(), "transition_ended".into()],
        vec!["handed_over(4)".into(), "node_left(4)".into(), "transfer_ended".into()],
        vec!["node_failed(3)".into(), "transition_begun".into(), "transition_ended".into(), "transfer_ended".into()],
    ]
    .concat();
    assert_eq!(story(&first), expected, "{first:#?}");
    // Every bucket that moved is in a batch; the moves of each join add up to its share.
    let moved: BTreeMap<u64, usize> = first
        .iter()
        .filter(|e| e["type"] == "buckets_moved")
        .flat_map(|e| e["moves"].as_array().cloned().unwrap_or_default())
        .fold(BTreeMap::new(), |mut m, g| {
            *m.entry(g["to"].as_u64().unwrap_or(0)).or_insert(0) += g["buckets"].as_array().map_or(0, Vec::len);
            m
        });
    assert!(moved.get(&2).is_some_and(|&n| n >= 500), "{moved:?}");
    assert!(first.iter().all(|e| e["time_ms"].as_u64().is_some_and(|t| t > 1_700_000_000_000)), "stamped times");

    // Killed and restarted, the first node answers the same history from its disk.
    nodes[0].kill9();
    nodes[0].restart();
    wait_for("the restarted node to answer its history", || async {
        let again = events(&http, &seed).await;
        (upto(&again) == upto(&first)).then_some(())
    })
    .await;
}
