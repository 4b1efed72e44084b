//! Mirrors: reads balanced over a bucket's owner and the holder of its replica, only from a
//! copy that is fresh enough, with the agent status of what each node measured.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use serde_json::{json, Value};
use shoal::config::ServeConfig;
use shoal::mirror::Strategy;

use crate::harness::{wait_for, TestCluster};

/// Failure-detection pings: they carry what an owner says of its replica (a copy serves
/// mirror reads only while its owner's latest report names it) and count as mirror pings.
fn pings(config: &mut ServeConfig) {
    config.ping_interval = Duration::from_millis(200);
    config.node_timeout = Duration::from_secs(3);
}

/// Mirrors chosen without dead ones, in short karma blocks; a node timeout long enough for a
/// member to restart without being failed. Pings at `shoal serve`'s defaults (test nodes turn
/// failure detection off unless asked): failure detection's every second, and the idle
/// mirrors' every second too.
fn nodeads(config: &mut ServeConfig) {
    let defaults = ServeConfig::for_test(config.listen, config.listen, config.data_dir.clone());
    assert_eq!(defaults.ha_ping_interval, Duration::from_secs(1));
    config.ping_interval = Duration::from_secs(1);
    config.ha_ping_interval = defaults.ha_ping_interval;
    config.node_timeout = Duration::from_secs(30);
    config.ha_strategy = Strategy::NoDeads;
    config.ha_period_karma = Duration::from_secs(1);
}

/// A read through `slot` with `query`: status, value, the node that served it and the lag it
/// says.
async fn read(c: &TestCluster, slot: usize, key: &str, query: &str) -> (u16, String, u64, Option<u64>) {
    let r = c.http.get(c.url(slot, &format!("/v1/kv/{key}?{query}"))).send().await.expect("get");
    let header = |name: &str| r.headers().get(name).and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
    let (node, lag) = (header("x-shoal-node").unwrap_or(0), header("x-shoal-replica-lag-ms"));
    (r.status().as_u16(), r.text().await.expect("body"), node, lag)
}

/// Owner and replica holder of `key`, from `slot`'s view.
async fn mirrors_of(c: &TestCluster, slot: usize, key: &str) -> (u64, u64) {
    let map = c.json(slot, "/v1/cluster/map").await;
    let owner = map["owners"][shoal_raft::bucket_of(key.as_bytes()).0 as usize].as_u64().expect("owner");
    let holder = map["nodes"]
        .as_array()
        .expect("nodes")
        .iter()
        .find(|n| n["id"] == owner)
        .and_then(|n| n["replica_on"].as_u64())
        .expect("holder");
    (owner, holder)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mirror_reads_are_served_by_the_owner_and_the_replica_and_never_older_than_an_acknowledged_write() {
    let c = TestCluster::start_with(3, pings).await;
    c.wait_for_counts(&[333, 333, 334]).await;
    c.wait_all_attached().await;
    c.wait_replicas_placed().await;
    let mut served_by: BTreeMap<&str, usize> = BTreeMap::new();
    for i in 0..300 {
        let key = format!("mirror-{i}");
        let (owner, holder) = mirrors_of(&c, 0, &key).await;
        // Every round overwrites the key, then reads it back through every node: a mirror
        // read never answers a value older than the one just acknowledged.
        for round in 0..2 {
            let value = format!("v{round}-{i}");
            assert!(c.put(i % 3, &key, &value).await.is_success());
            for slot in 0..3 {
                let (status, got, node, lag) = read(&c, slot, &key, "read=mirrors").await;
                assert_eq!((status, got.as_str()), (200, value.as_str()), "{key} through slot {slot}");
                let who = if node == owner {
                    assert_eq!(lag, None, "the owner serves from its own data");
                    "owner"
                } else {
                    assert_eq!(node, holder, "{key}: only its owner or replica holder serves it");
                    assert_eq!(lag, Some(0), "sync replication: the copy holds every acknowledged write");
                    "replica"
                };
                *served_by.entry(who).or_default() += 1;
            }
        }
        // Without read=mirrors (the default --read-from owner), the owner serves.
        let (_, _, node, _) = read(&c, i % 3, &key, "").await;
        assert_eq!(node, owner);
    }
    eprintln!("served by {served_by:?}");
    // Random between two mirrors: each serves about half of 1800 reads.
    assert!(served_by["owner"] > 600 && served_by["replica"] > 600, "{served_by:?}");

    // A missing key is a 404 through a mirror too.
    let (status, ..) = read(&c, 0, "mirror-missing", "read=mirrors").await;
    assert_eq!(status, 404);
    // Bulk reads balance the same way, and keep request order.
    let keys: Vec<String> = (0..200).map(|i| format!("mirror-{i}")).collect();
    let r =
        c.http.post(c.url(1, "/v1/bulk/get?read=mirrors")).json(&json!({ "keys": keys })).send().await.expect("bulk");
    assert_eq!(r.status(), 200);
    let body: Value = r.json().await.expect("json");
    for (i, result) in body["results"].as_array().expect("results").iter().enumerate() {
        assert_eq!(result["value"], format!("v1-{i}"), "{result}");
    }
    // Bad input is a 400.
    let (status, ..) = read(&c, 0, "mirror-1", "read=nearest").await;
    assert_eq!(status, 400);
    let (status, ..) = read(&c, 0, "mirror-1", "read=mirrors&max_staleness=soon").await;
    assert_eq!(status, 400);

    // The agent status of the node that balanced the reads, and its metrics.
    let agents = c.json(0, "/v1/cluster/agents").await;
    assert_eq!(agents["strategy"], "random");
    let rows = agents["agents"].as_array().expect("agents");
    assert_eq!(rows.len(), 3, "{agents}");
    let requests: u64 = rows.iter().map(|a| a["blocks"][0]["requests"].as_u64().unwrap_or(0)).sum();
    assert!(requests >= 600, "{agents}");
    assert!(rows.iter().all(|a| a["alive"] == true));
    let metrics = c.http.get(c.url(0, "/metrics")).send().await.expect("metrics").text().await.expect("text");
    for series in ["shoal_mirror_reads_total{node=", "shoal_mirror_probability{peer=", "shoal_mirror_latency_seconds"] {
        assert!(metrics.contains(series), "{series} missing");
    }
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_async_replication_a_replica_serves_only_within_the_staleness_the_read_allows() {
    let c = TestCluster::start_with(3, pings).await;
    c.wait_for_counts(&[333, 333, 334]).await;
    let r = c.http.put(c.url(0, "/v1/cluster/config")).json(&json!({"replication": "async"})).send().await;
    assert_eq!(r.expect("config").status(), 200);
    c.wait_all_attached().await;
    c.wait_replicas_placed().await;
    let keys: Vec<String> = (0..100).map(|i| format!("stale-{i}")).collect();
    for k in &keys {
        assert!(c.put(0, k, "v").await.is_success());
    }
    // max_staleness 0 (the default): an async copy is never known to be that fresh.
    for k in &keys {
        let (owner, _) = mirrors_of(&c, 0, k).await;
        for slot in 0..3 {
            let (status, _, node, lag) = read(&c, slot, k, "read=mirrors").await;
            assert_eq!((status, node, lag), (200, owner, None), "{k}");
        }
    }
    // Allowing 30 s: the holders serve too, each saying how far behind it may be, never more.
    wait_for("replica copies serve reads within 30 s of staleness", || async {
        let mut replica_reads = 0;
        for k in &keys {
            let (owner, holder) = mirrors_of(&c, 0, k).await;
            let (status, got, node, lag) = read(&c, 1, k, "read=mirrors&max_staleness=30s").await;
            assert_eq!((status, got.as_str()), (200, "v"));
            if node != owner {
                assert_eq!(node, holder);
                let lag = lag.expect("a replica read says its lag");
                assert!(lag <= 30_000, "{lag} ms");
                replica_reads += 1;
            }
        }
        (replica_reads >= 20).then_some(())
    })
    .await;
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_nodeads_a_stopped_mirror_gets_no_reads_and_serves_again_after_it_returns() {
    let mut c = TestCluster::start_with(3, nodeads).await;
    c.wait_for_counts(&[333, 333, 334]).await;
    c.wait_all_attached().await;
    c.wait_replicas_placed().await;
    let down = c.id(2);
    // Keys whose replica node 3 holds: their owner (node 2) and node 3 are their mirrors.
    let mut keys = Vec::new();
    for i in 0.. {
        let key = format!("dead-{i}");
        if mirrors_of(&c, 0, &key).await.1 == down {
            assert!(c.put(0, &key, "v").await.is_success());
            keys.push(key);
        }
        if keys.len() == 50 {
            break;
        }
    }
    async fn served_by(c: &TestCluster, keys: &[String], down: u64) -> usize {
        let mut n = 0;
        for k in keys {
            let (status, _, node, _) = read(c, 0, k, "read=mirrors").await;
            assert_eq!(status, 200, "{k}");
            n += usize::from(node == down);
        }
        n
    }
    // Both mirrors serve once the owner's next ping names node 3 as its complete holder (the
    // attachment alone is not enough for a replica copy to serve).
    wait_for("before: both mirrors serve", || async { (served_by(&c, &keys, down).await > 0).then_some(()) }).await;
    c.stop(2).await;
    // Within about a ping interval node 1 holds it dead (no answer to a read or a ping).
    wait_for("node 3 dead in node 1's agent status", || async {
        let agents = c.json(0, "/v1/cluster/agents").await;
        agents["agents"].as_array()?.iter().find(|a| a["node_id"] == down).filter(|a| a["alive"] == false).map(|_| ())
    })
    .await;
    // Every read still answers, from the owner.
    assert_eq!(served_by(&c, &keys, down).await, 0);
    c.restart(2).await.expect("restart");
    // Back: alive again once it answers a ping, and its copy, sent again whole, serves reads.
    c.wait_all_attached().await;
    c.wait_replicas_placed().await;
    wait_for("node 3 serves mirror reads again", || async { (served_by(&c, &keys, down).await > 0).then_some(()) })
        .await;
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_nodeads_a_slow_mirror_gets_reads_by_its_latency_among_the_mirrors_and_its_share_back_once_fast() {
    use std::sync::atomic::Ordering;
    let mut c = TestCluster::start_with(2, nodeads).await;
    // The third member: the others reach its API, and the peer links that carry reads to it
    // once open, through connections that hold every chunk 1 ms each way (a read from it takes
    // some milliseconds, tens of times a read from the other) until the test makes them fast
    // again. The rest of its peer traffic (Raft, pings, transfers) passes at once.
    let (api, peer) = (Arc::new(OnceLock::new()), Arc::new(OnceLock::new()));
    let delay_ms = Arc::new(AtomicU64::new(1));
    let api_proxy = delaying_proxy(api.clone(), delay_ms.clone(), None).await;
    let peer_proxy = delaying_proxy(peer.clone(), delay_ms.clone(), Some("shoal-link")).await;
    c.add_node_configured(|config| {
        let _ = api.set(config.listen);
        let _ = peer.set(config.peer_listen.expect("a peer listener"));
        config.advertise = Some(api_proxy.to_string());
        config.peer_advertise = Some(peer_proxy.to_string());
    })
    .await;
    c.wait_all_attached().await;
    c.wait_replicas_placed().await;
    let (me, fast, slow) = (c.id(0), c.id(1), c.id(2));
    // Keys of every pair of mirrors, all read through node 1: (node 2, node 3) are both remote
    // from it; node 1 mirrors the others itself, and answers its own reads in microseconds,
    // which must not squeeze the two remote mirrors of node 2's keys to the same weight.
    let mut keys: BTreeMap<(u64, u64), Vec<String>> = BTreeMap::new();
    for i in 0.. {
        let key = format!("slow-{i}");
        let pair = mirrors_of(&c, 0, &key).await;
        let of_pair = keys.entry(pair).or_default();
        if of_pair.len() < 30 {
            assert!(c.put(0, &key, "v").await.is_success());
            of_pair.push(key);
        }
        if keys.len() == 3 && keys.values().all(|k| k.len() == 30) {
            break;
        }
    }
    assert!(keys.contains_key(&(me, fast)) && keys.contains_key(&(slow, me)), "{:?}", keys.keys());
    let remote = keys[&(fast, slow)].clone();
    // Reads of every key through node 1; the share of the remote pair's reads node 3 served.
    let read_all = || async {
        let mut from_slow = 0;
        for (pair, of_pair) in &keys {
            for k in of_pair {
                let (status, _, node, _) = read(&c, 0, k, "read=mirrors").await;
                assert_eq!(status, 200, "{k}");
                assert!(node == pair.0 || node == pair.1, "{k} served by {node}, not one of its mirrors {pair:?}");
                from_slow += usize::from(*pair == (fast, slow) && node == slow);
            }
        }
        from_slow as f64 / remote.len() as f64
    };
    let first = read_all().await;
    // The karma blocks (1 s) measure the slow link and weigh it down among the remote pair.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(90);
    let mut weighed = Vec::new();
    while weighed.len() < 3 || !weighed.iter().rev().take(3).all(|&s| s < 0.3) {
        assert!(tokio::time::Instant::now() < deadline, "the slow mirror was not weighed down: {weighed:.2?}");
        weighed.push(read_all().await);
    }
    // ... and it stays down, block after block (weights that compounded from block to block
    // squeezed both remote mirrors to the same floor once this node's own microsecond reads
    // were counted, and the slow one got half the reads again).
    let held = tokio::time::Instant::now();
    let mut holding = Vec::new();
    while held.elapsed() < Duration::from_secs(10) {
        holding.push(read_all().await);
    }
    let mean = holding.iter().sum::<f64>() / holding.len() as f64;
    assert!(mean < 0.15, "the slow mirror got {mean:.2} of the reads over ten blocks: {holding:.2?}");
    let agents = c.json(0, "/v1/cluster/agents").await;
    eprintln!("share of the slow mirror: {first:.2} at first, then {weighed:.2?}, held {holding:.2?}; {agents}");
    let latency = |id: u64| {
        agents["agents"].as_array().expect("agents").iter().find(|a| a["node_id"] == id).expect("agent")["blocks"]
            .as_array()
            .expect("blocks")
            .iter()
            .find_map(|b| b["avg_latency_ms"].as_f64())
    };
    assert!(latency(slow).expect("measured") > 3.0 * latency(fast).expect("measured"), "{agents}");
    // Fast again: within a block and a half of karma its old slowness stops mattering, and it
    // serves about half of the remote pair's reads again.
    delay_ms.store(0, Ordering::SeqCst);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(90);
    let mut back = Vec::new();
    while back.len() < 3 || !back.iter().rev().take(3).all(|&s| s > 0.3) {
        assert!(tokio::time::Instant::now() < deadline, "the mirror did not get its share back: {back:.2?}");
        back.push(read_all().await);
    }
    eprintln!("after it recovered: {back:.2?}");
    c.shutdown().await;
}

/// A TCP proxy to `target` that holds every chunk for `delay_ms` (as it is when the chunk
/// arrives) in each direction: a slow link to one node (the kernel here has no netem). With `only`, a connection is slow only from the
/// first chunk from the client that contains it on (an HTTP connection may be upgraded to a
/// peer link after other requests); before that it passes at once. Runs until the test ends.
async fn delaying_proxy(
    target: Arc<OnceLock<SocketAddr>>,
    delay_ms: Arc<AtomicU64>,
    only: Option<&'static str>,
) -> SocketAddr {
    use std::sync::atomic::{AtomicBool, Ordering};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        while let Ok((client, _)) = listener.accept().await {
            let Some(&target) = target.get() else { continue };
            let Ok(server) = tokio::net::TcpStream::connect(target).await else { continue };
            let _ = client.set_nodelay(true);
            let _ = server.set_nodelay(true);
            let (cr, cw) = client.into_split();
            let (sr, sw) = server.into_split();
            let slow = Arc::new(AtomicBool::new(only.is_none()));
            let pipe = |mut from: tokio::net::tcp::OwnedReadHalf, mut to: tokio::net::tcp::OwnedWriteHalf, client| {
                let (slow, delay_ms) = (slow.clone(), delay_ms.clone());
                async move {
                    let mut buf = vec![0u8; 64 * 1024];
                    loop {
                        let n = match from.read(&mut buf).await {
                            Ok(0) | Err(_) => break,
                            Ok(n) => n,
                        };
                        if let (true, Some(what)) = (client, only) {
                            if buf[..n].windows(what.len()).any(|w| w == what.as_bytes()) {
                                slow.store(true, Ordering::SeqCst);
                            }
                        }
                        let delay = Duration::from_millis(delay_ms.load(Ordering::SeqCst));
                        if slow.load(Ordering::SeqCst) && !delay.is_zero() {
                            tokio::time::sleep(delay).await;
                        }
                        if to.write_all(&buf[..n]).await.is_err() {
                            break;
                        }
                    }
                    let _ = to.shutdown().await;
                }
            };
            tokio::spawn(pipe(cr, sw, true));
            tokio::spawn(pipe(sr, cw, false));
        }
    });
    addr
}
