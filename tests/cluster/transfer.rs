//! State transfer: buckets move with their data while writers run, and no acknowledged write
//! is lost.

use std::time::{Duration, Instant};

use shoal_raft::{bucket_of, BUCKET_COUNT};

use crate::harness::{wait_for, TestCluster};
use crate::workload::{check, Workload};

/// Every running node serves every acknowledged write with its last acknowledged value.
async fn assert_nothing_lost(c: &TestCluster, w: &Workload, step: &str) {
    let history = w.pause().await;
    let mut problems = Vec::new();
    for slot in c.running().collect::<Vec<_>>() {
        problems.extend(check(c, slot, &history).await);
    }
    let acked = history.values().filter(|h| h.acked.is_some()).count();
    if let Some(p) = problems.first() {
        let key = p.split(':').next().unwrap_or_default().to_string();
        let bucket = shoal_raft::bucket_of(key.as_bytes()).0;
        let map = c.json(0, "/v1/cluster/map").await;
        eprintln!(
            "lost write: {key} bucket {bucket} owner {} history {:?}",
            map["owners"][bucket as usize], history[&key]
        );
        for slot in c.running().collect::<Vec<_>>() {
            let r = c.http.get(c.url(slot, &format!("/v1/kv/{key}"))).send().await.expect("get");
            let node = r.headers().get("x-shoal-node").cloned();
            eprintln!("  read via slot {slot}: {} {:?} {}", r.status(), node, r.text().await.unwrap_or_default());
        }
    }
    assert!(
        problems.is_empty(),
        "after {step}: {} problems, e.g. {:?}",
        problems.len(),
        &problems[..problems.len().min(5)]
    );
    assert!(acked > 0, "after {step}: the writers got writes acknowledged");
    w.resume();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn growing_to_four_nodes_and_shrinking_to_two_under_writes_loses_nothing() {
    let mut c = TestCluster::start(1).await;
    let targets = |c: &TestCluster| c.running().map(|s| c.api(s)).collect::<Vec<_>>();
    let w = Workload::start(targets(&c), 4);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let splits: [&[usize]; 3] = [&[500, 500], &[333, 333, 334], &[250, 250, 250, 250]];
    for expected in splits {
        c.add_node().await;
        w.set_targets(targets(&c));
        c.wait_for_counts(expected).await;
        assert_nothing_lost(&c, &w, &format!("growing to {} nodes", expected.len())).await;
    }
    for (slot, expected) in [(3usize, &[333usize, 333, 334][..]), (2, &[500, 500][..])] {
        // The leaver stays in the writers' list: it serves (and then forwards) until it stops.
        let r = c.http.post(c.url(0, &format!("/v1/cluster/nodes/{}/leave", c.id(slot)))).send().await.expect("leave");
        assert_eq!(r.status(), 200, "{}", r.text().await.unwrap_or_default());
        c.wait_for_counts_among(expected, &[0, 1]).await;
        w.set_targets(vec![c.api(0), c.api(1)]);
        c.wait_stopped(slot).await;
        assert_nothing_lost(&c, &w, &format!("shrinking to {} nodes", expected.len())).await;
    }
    let writes = w.stop().await;
    assert!(writes > 100, "the writers kept writing through every step ({writes} writes)");
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_16_mib_value_moves_while_other_keys_keep_answering() {
    let mut c = TestCluster::start_with(1, |config| {
        config.max_value_bytes = 17 * 1024 * 1024;
        config.cache_size = 256 * 1024 * 1024;
    })
    .await;
    // Node 2 gets the upper half of the buckets; pick a key there for the big value.
    let big_key =
        (0..).map(|i| format!("big{i}")).find(|k| bucket_of(k.as_bytes()).index() >= BUCKET_COUNT / 2).expect("key");
    let big: Vec<u8> = (0..16 * 1024 * 1024).map(|i: u32| (i % 253) as u8).collect();
    let r = c.http.put(c.url(0, &format!("/v1/kv/{big_key}"))).body(big.clone()).send().await.expect("put big");
    assert_eq!(r.status(), 200);
    for i in 0..200 {
        assert_eq!(c.put(0, &format!("small{i}"), "v").await, 200);
    }

    c.add_node_no_wait().await;
    // While the transfer runs, other keys answer (through both nodes), each in bounded time.
    let started = Instant::now();
    let mut slowest = Duration::ZERO;
    let mut ops = 0;
    while started.elapsed() < Duration::from_secs(30) {
        let settled = c.json(0, "/v1/cluster").await["transfer"].is_null();
        for slot in 0..2 {
            let key = format!("small{}", ops % 200);
            let t = Instant::now();
            assert_eq!(c.put(slot, &key, "w").await, 200, "write of {key} during the transfer");
            assert_eq!(c.get(slot, &key).await.as_deref(), Some("w"));
            slowest = slowest.max(t.elapsed());
            ops += 1;
        }
        if settled && ops > 20 {
            break;
        }
    }
    assert!(slowest < Duration::from_secs(3), "an operation took {slowest:?} during the transfer");
    c.wait_settled().await;
    c.wait_for_counts(&[500, 500]).await;
    for slot in 0..2 {
        let r = c.http.get(c.url(slot, &format!("/v1/kv/{big_key}"))).send().await.expect("get big");
        assert_eq!(r.headers()["x-shoal-node"], c.id(1).to_string().as_str(), "the big value moved to node 2");
        let body = r.bytes().await.expect("body");
        assert!(body.len() == big.len() && body[..] == big[..], "the 16 MiB value arrived whole");
    }
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_transition_and_transfer_are_visible_and_guard_membership_changes() {
    // Slow transfers (1 MiB/s) with data in every bucket, so the transfer is observable.
    let mut c = TestCluster::start_with(1, |config| {
        config.transfer_rate = 64 * 1024;
        config.force_join = true;
    })
    .await;
    for i in 0..2000 {
        let r = c.http.put(c.url(0, &format!("/v1/kv/k{i}"))).body(vec![b'x'; 512]).send().await.expect("put");
        assert_eq!(r.status(), 200);
    }
    c.add_node_no_wait().await;
    let view = wait_for("the transfer to show", || async {
        let v = c.json(0, "/v1/cluster").await;
        (!v["transfer"].is_null()).then_some(v)
    })
    .await;
    assert_eq!(view["transfer"]["blocking"], true);
    assert!(view["transfer"]["buckets_left"].as_u64().unwrap_or(0) > 0);
    let transfer = c.json(1, "/v1/cluster/transfer").await;
    let node2 =
        transfer["nodes"].as_array().expect("nodes").iter().find(|n| n["node_id"] == c.id(1)).cloned().expect("node 2");
    assert_eq!(node2["active"], true, "{transfer}");
    assert_eq!(node2["buckets_total"], 500);

    // Membership changes wait (409) unless forced.
    let (http, leave_url) = (c.http.clone(), c.url(0, "/v1/cluster/nodes/1/leave"));
    let leave = |force: bool| http.post(format!("{leave_url}{}", if force { "?force=true" } else { "" })).send();
    let r = leave(false).await.expect("leave");
    assert_eq!(r.status(), 409);
    let problem: serde_json::Value = r.json().await.expect("problem");
    assert_eq!(problem["code"], "membership_change_in_progress");
    assert_eq!(c.json(0, "/v1/cluster").await["members"].as_array().map(Vec::len), Some(2), "nothing changed");
    // A node started with --force-join becomes a member while the transfer still runs.
    let slot = c.add_node_no_wait().await;
    let view = c.json(0, "/v1/cluster").await;
    let ids: Vec<u64> = view["members"].as_array().expect("members").iter().filter_map(|m| m["id"].as_u64()).collect();
    assert!(ids.contains(&c.id(slot)), "{view}");
    assert!(!view["transfer"].is_null(), "the transfer still runs: {view}");
    // Forced, the leave starts at once: the new pending map leaves node 1 out.
    let r = leave(true).await.expect("leave");
    assert_eq!(r.status(), 200);
    let left: serde_json::Value = r.json().await.expect("json");
    assert!(left["warning"].as_str().is_some_and(|w| w.contains("can lose")), "the answer warns: {left}");
    // (Asked of node 2: node 1 stops once it has handed its buckets over.)
    let view = c.json(1, "/v1/cluster").await;
    let leaving: Vec<bool> =
        view["members"].as_array().expect("members").iter().map(|m| m["leaving"] == true).collect();
    assert!(leaving == vec![true, false, false] || leaving == vec![false, false], "{view}");
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stuck_transfer_is_detected_and_its_flag_cleared() {
    let mut c = TestCluster::start_with(2, |config| {
        config.transfer_check_interval = Duration::from_millis(500);
        config.transfer_stuck_after = Duration::from_secs(2);
    })
    .await;
    // A third node joins and dies at once: its transition or its transfer cannot finish.
    let slot = c.add_node_no_wait().await;
    let dead = c.id(slot);
    c.stop(slot).await;
    wait_for("the stuck detector to fire", || async {
        for s in [0, 1] {
            let text = c.http.get(c.url(s, "/metrics")).send().await.ok()?.text().await.ok()?;
            let stuck = text
                .lines()
                .find_map(|l| l.strip_prefix("shoal_transfer_stuck_total "))
                .and_then(|v| v.parse::<f64>().ok());
            if stuck.unwrap_or(0.0) >= 1.0 {
                return Some(());
            }
        }
        None
    })
    .await;
    wait_for("the flag to be cleared", || async {
        let text = c.http.get(c.url(0, "/metrics")).send().await.ok()?.text().await.ok()?;
        text.contains("\nshoal_transfer_flag 0").then_some(())
    })
    .await;
    // Membership may change again, without force.
    let r = c.http.post(c.url(0, &format!("/v1/cluster/nodes/{dead}/leave"))).send().await.expect("leave");
    assert_eq!(r.status(), 200, "{}", r.text().await.unwrap_or_default());
    c.shutdown().await;
}

/// Writes single items and bulks of 16 through `api` until `stop`, counting the answers that
/// were not 200 (per status and code; bulk items per item).
async fn write_and_count(
    http: reqwest::Client,
    api: String,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
) -> (u64, std::collections::BTreeMap<String, u64>) {
    use std::sync::atomic::Ordering;
    let mut failures = std::collections::BTreeMap::new();
    let mut fail = |what: String| *failures.entry(what).or_insert(0u64) += 1;
    let mut written = 0u64;
    for round in 0..200_000u64 {
        if stop.load(Ordering::Relaxed) {
            break;
        }
        let r = http.put(format!("http://{api}/v1/kv/single-{}", round % 5000)).body("v").send().await;
        match r {
            Ok(r) if r.status() == 200 => written += 1,
            Ok(r) => {
                let status = r.status();
                let p: serde_json::Value = r.json().await.unwrap_or_default();
                fail(format!("single {status} {} ({})", p["code"], p["detail"]));
            }
            Err(e) => fail(format!("single {e}")),
        }
        let items: Vec<serde_json::Value> = (0..16)
            .map(|i| serde_json::json!({"key": format!("bulk-{}", (round * 16 + i) % 20_000), "value": "v"}))
            .collect();
        let r =
            http.post(format!("http://{api}/v1/bulk/put")).json(&serde_json::json!({ "items": items })).send().await;
        match r {
            Ok(r) if r.status() == 200 => {
                let body: serde_json::Value = r.json().await.unwrap_or_default();
                for item in body["results"].as_array().into_iter().flatten() {
                    match item.get("error") {
                        Some(e) if !e.is_null() => fail(format!("bulk item {} ({})", e["code"], e["detail"])),
                        _ => written += 1,
                    }
                }
            }
            Ok(r) => fail(format!("bulk {}", r.status())),
            Err(e) => fail(format!("bulk {e}")),
        }
    }
    (written, failures)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn joins_and_leaves_without_faults_fail_no_single_or_bulk_write() {
    let mut c = TestCluster::start(1).await;
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let writer = tokio::spawn(write_and_count(c.http.clone(), c.api(0), stop.clone()));
    let splits: [&[usize]; 3] = [&[500, 500], &[333, 333, 334], &[250, 250, 250, 250]];
    for expected in splits {
        c.add_node().await;
        c.wait_for_counts(expected).await;
        c.wait_settled().await;
    }
    for (slot, expected) in [(3usize, &[333usize, 333, 334][..]), (1, &[500, 500][..])] {
        let r = c.http.post(c.url(0, &format!("/v1/cluster/nodes/{}/leave", c.id(slot)))).send().await.expect("leave");
        assert_eq!(r.status(), 200, "{}", r.text().await.unwrap_or_default());
        let stays: Vec<usize> = c.running().filter(|&s| s != slot).collect();
        c.wait_for_counts_among(expected, &stays).await;
        c.wait_stopped(slot).await;
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let (written, failures) = writer.await.expect("writer");
    assert!(written > 1000, "the writer kept writing ({written} writes)");
    assert!(failures.is_empty(), "{written} writes acknowledged, and failures: {failures:?}");
    c.shutdown().await;
}
