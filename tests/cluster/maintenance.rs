//! Maintenance: a member goes away for a while; its replica holder serves its buckets, nobody
//! fails it, and it takes its buckets back when it returns — or, not back in time, it is
//! failed like any silent member.

use std::time::Duration;

use serde_json::{json, Value};
use shoal::config::ServeConfig;

use crate::harness::{wait_for, TestCluster};
use crate::workload::{check, Workload};

/// Pings every 200 ms, pfail after 1 s of silence: a member away for longer would be failed
/// were it not in maintenance.
fn fast_detection(config: &mut ServeConfig) {
    config.ping_interval = Duration::from_millis(200);
    config.node_timeout = Duration::from_secs(1);
}

/// Five voters; a node timeout long enough for the leader to restart without being failed.
fn five_voters(config: &mut ServeConfig) {
    config.ping_interval = Duration::from_millis(200);
    config.node_timeout = Duration::from_secs(8);
    config.voters = 5;
}

/// POSTs `{"for": period}` to member `id`'s maintenance through `slot`: status and body.
async fn enter(c: &TestCluster, slot: usize, id: u64, period: &str) -> (u16, Value) {
    let url = c.url(slot, &format!("/v1/cluster/nodes/{id}/maintenance"));
    let r = c.http.post(url).json(&json!({ "for": period })).send().await.expect("request");
    (r.status().as_u16(), r.json().await.expect("json"))
}

/// DELETEs member `id`'s maintenance through `slot`.
async fn end(c: &TestCluster, slot: usize, id: u64) -> (u16, Value) {
    let url = c.url(slot, &format!("/v1/cluster/nodes/{id}/maintenance"));
    let r = c.http.delete(url).send().await.expect("request");
    (r.status().as_u16(), r.json().await.expect("json"))
}

fn member_ids(view: &Value) -> Vec<u64> {
    view["members"].as_array().expect("members").iter().filter_map(|m| m["id"].as_u64()).collect()
}

/// Waits until the maintenance is over and every member is ready again (its buckets back and
/// its replica complete) as `slot` sees it.
async fn wait_over(c: &TestCluster, slot: usize) {
    wait_for("the maintenance to end", || async {
        let v = c.json(slot, "/v1/cluster").await;
        (v["maintenance"].is_null() && v["transfer"].is_null() && v["transition"].is_null()).then_some(())
    })
    .await;
    let slots: Vec<usize> = c.running().collect();
    for s in slots {
        let deadline = tokio::time::Instant::now() + crate::harness::DEADLINE;
        loop {
            let r = c.http.get(c.url(s, "/readyz?verbose")).send().await.expect("readyz");
            let ready = r.status() == 200;
            let body = r.text().await.unwrap_or_default();
            if ready {
                break;
            }
            assert!(tokio::time::Instant::now() < deadline, "slot {s} not ready: {body}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_in_maintenance_is_served_by_its_replica_holder_and_takes_its_buckets_back() {
    let mut c = TestCluster::start_with(3, fast_detection).await;
    c.wait_for_counts(&[333, 333, 334]).await;
    let w = Workload::start(vec![c.api(0), c.api(2)], 4);
    wait_for("some writes", || async { (w.acked() > 200).then_some(()) }).await;

    // Asked through another member: the member itself checks its replica and goes.
    let (status, m) = enter(&c, 0, 2, "2m").await;
    assert_eq!(status, 200, "{m}");
    assert_eq!(
        (m["node_id"].as_u64(), m["served_by"].as_u64(), m["returned"].as_bool()),
        (Some(2), Some(3), Some(false))
    );
    assert!(m["seconds_left"].as_f64().is_some_and(|s| s > 100.0 && s <= 120.0), "{m}");
    let view = c.json(0, "/v1/cluster").await;
    assert_eq!(view["maintenance"]["node_id"], 2, "{view}");
    let buckets: Vec<u64> =
        view["members"].as_array().expect("members").iter().map(|m| m["buckets"].as_u64().unwrap_or(0)).collect();
    assert_eq!((buckets.len(), buckets[1], buckets[0] + buckets[2]), (3, 0, 1000), "node 3 serves node 2's buckets");
    let left = view["transfer"]["buckets_left"].as_u64();
    assert!(left == Some(333) || left == Some(334), "the target gives them back: {view}");

    // Away for several node timeouts: not failed, every bucket readable and writable.
    c.stop(1).await;
    let acked = w.acked();
    tokio::time::sleep(Duration::from_secs(4)).await;
    wait_for("writes while it is away", || async { (w.acked() > acked + 200).then_some(()) }).await;
    let view = c.json(0, "/v1/cluster").await;
    assert_eq!(view["failed"], json!([]), "{view}");
    assert_eq!(member_ids(&view), vec![1, 2, 3]);
    assert!(view["peers"].as_array().expect("peers").iter().any(|p| p["node_id"] == 2 && p["state"] == "maintenance"));
    let metrics = c.http.get(c.url(0, "/metrics")).send().await.expect("metrics").text().await.expect("text");
    assert!(metrics.lines().any(|l| l == "shoal_maintenance 2"), "{metrics}");
    // Not healthy while a member is away: the health gate says why.
    let r = c.http.get(c.url(0, "/v1/cluster/health")).send().await.expect("health");
    assert_eq!(r.status(), 503);
    let problem: Value = r.json().await.expect("problem");
    assert_eq!(problem["code"], "unhealthy", "{problem}");
    assert!(problem["detail"].as_str().is_some_and(|d| d.contains("node 2 is in maintenance")), "{problem}");

    // Back with its data dir: the same member, its buckets back, the maintenance over.
    c.restart(1).await.expect("restart");
    assert_eq!(c.id(1), 2);
    wait_over(&c, 0).await;
    c.wait_for_counts(&[333, 333, 334]).await;
    let history = w.pause().await;
    let lost = check(&c, 1, &history).await;
    assert!(lost.is_empty(), "{} problems, first: {:?}", lost.len(), &lost[..lost.len().min(5)]);
    let view = c.json(1, "/v1/cluster").await;
    assert_eq!((view["failed"].clone(), member_ids(&view)), (json!([]), vec![1, 2, 3]));
    w.stop().await;
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn maintenance_is_refused_with_a_code_while_it_cannot_be_kept_and_ends_early_on_request() {
    let mut c = TestCluster::start_with(2, fast_detection).await;
    c.wait_for_counts(&[500, 500]).await;
    let (status, p) = enter(&c, 0, 2, "1m").await;
    assert_eq!((status, p["code"].as_str()), (409, Some("too_few_members")), "{p}");
    c.add_node().await;
    c.wait_for_counts(&[333, 333, 334]).await;
    let (status, p) = enter(&c, 0, 9, "1m").await;
    assert_eq!((status, p["code"].as_str()), (404, Some("unknown_resource")), "{p}");
    let (status, p) = enter(&c, 0, 2, "1s").await;
    assert_eq!((status, p["code"].as_str()), (400, Some("bad_request")), "{p}");

    let (status, m) = enter(&c, 2, 2, "1m").await;
    assert_eq!(status, 200, "{m}");
    // One at a time; membership waits while a member is away.
    let (status, p) = enter(&c, 0, 1, "1m").await;
    assert_eq!((status, p["code"].as_str()), (409, Some("maintenance_in_progress")), "{p}");
    let r = c.http.post(c.url(0, "/v1/cluster/nodes/3/leave")).send().await.expect("leave");
    let p: Value = r.json().await.expect("json");
    assert_eq!(p["code"], "membership_change_in_progress", "{p}");
    let (status, p) = end(&c, 0, 1).await;
    assert_eq!((status, p["code"].as_str()), (409, Some("conflict")), "{p}");

    // Ended early while it still runs: it takes its buckets back at once.
    let (status, m) = end(&c, 0, 2).await;
    assert_eq!((status, m["ended"].as_bool()), (200, Some(true)), "{m}");
    wait_over(&c, 0).await;
    c.wait_for_counts(&[333, 333, 334]).await;
    assert_eq!(c.json(0, "/v1/cluster").await["failed"], json!([]));
    c.shutdown().await;
}

/// A leave forced while another voter of three is away: the voters after it would be the
/// leader and the away member, and Raft could commit nothing more until it returned (then a
/// failure of it queued meanwhile committed, and the control plane was stuck for good). It is
/// refused; the cluster keeps committing, and the member returns as itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forced_leave_while_a_voter_is_away_is_refused_and_the_control_plane_keeps_committing() {
    let mut c = TestCluster::start_with(3, fast_detection).await;
    c.wait_for_counts(&[333, 333, 334]).await;
    let (status, m) = enter(&c, 0, 3, "5m").await;
    assert_eq!(status, 200, "{m}");
    c.stop(2).await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let r = c.http.post(c.url(0, "/v1/cluster/nodes/2/leave?force=true")).send().await.expect("leave");
    let status = r.status();
    let p: Value = r.json().await.expect("json");
    assert_eq!((status.as_u16(), p["code"].as_str()), (409, Some("conflict")), "{p}");
    assert!(p["detail"].as_str().is_some_and(|d| d.contains("node 3 is away in maintenance")), "{p}");
    let r = c.http.put(c.url(0, "/v1/cluster/config")).json(&json!({"replication": "async"})).send().await;
    assert_eq!(r.expect("config").status(), 200, "the control plane commits");
    c.restart(2).await.expect("node 3 back as itself");
    wait_over(&c, 0).await;
    let view = c.json(0, "/v1/cluster").await;
    assert_eq!((view["failed"].clone(), member_ids(&view)), (json!([]), vec![1, 2, 3]));
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_not_back_when_its_maintenance_runs_out_is_failed_and_the_map_rebalanced() {
    let mut c = TestCluster::start_with(3, fast_detection).await;
    c.wait_for_counts(&[333, 333, 334]).await;
    let keys: Vec<String> = (0..200).map(|i| format!("m{i}")).collect();
    for k in &keys {
        assert_eq!(c.put(0, k, k).await, 200);
    }
    let (status, m) = enter(&c, 0, 2, "10s").await;
    assert_eq!(status, 200, "{m}");
    c.stop(1).await;
    wait_for("node 2 failed after its maintenance ran out", || async {
        let v = c.json(0, "/v1/cluster").await;
        (v["failed"] == json!([2]) && v["maintenance"].is_null()).then_some(())
    })
    .await;
    c.wait_for_counts_among(&[500, 500], &[0, 2]).await;
    for k in &keys {
        assert_eq!(c.get(2, k).await.as_deref(), Some(k.as_str()), "{k}");
    }
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn maintenance_survives_a_new_leader_and_ends_at_once_when_another_member_fails() {
    let mut c = TestCluster::start_with(5, five_voters).await;
    c.wait_for_counts(&[200, 200, 200, 200, 200]).await;
    let w = Workload::start(vec![c.api(2), c.api(3), c.api(4)], 3);
    wait_for("some writes", || async { (w.acked() > 200).then_some(()) }).await;

    // The leader (node 1) restarts while node 2 is in maintenance: a new leader keeps it.
    let leader = c.json(0, "/v1/cluster").await["leader"].as_u64();
    assert_eq!(leader, Some(1), "the first member leads");
    let (status, m) = enter(&c, 0, 2, "5m").await;
    assert_eq!(status, 200, "{m}");
    c.stop(1).await;
    c.stop(0).await;
    wait_for("a new leader that keeps the maintenance", || async {
        let v = c.json(2, "/v1/cluster").await;
        (v["leader"].as_u64().is_some_and(|l| l > 2) && v["maintenance"]["node_id"] == 2).then_some(())
    })
    .await;
    c.restart(0).await.expect("node 1 back within the node timeout");
    c.restart(1).await.expect("node 2 back");
    wait_over(&c, 2).await;
    c.wait_for_counts(&[200, 200, 200, 200, 200]).await;
    assert_eq!(c.json(2, "/v1/cluster").await["failed"], json!([]));

    // Node 2 in maintenance again; then node 4 fails: the cluster leaves maintenance at once
    // and, node 2 being away, fails it too (once it was silent for the node timeout since).
    // Nothing acknowledged is lost.
    let (status, m) = enter(&c, 2, 2, "5m").await;
    assert_eq!(status, 200, "{m}");
    c.stop(1).await;
    w.set_targets(vec![c.api(0), c.api(2), c.api(4)]);
    c.stop(3).await;
    wait_for("nodes 2 and 4 failed, maintenance over", || async {
        let v = c.json(0, "/v1/cluster").await;
        (v["failed"] == json!([2, 4]) && v["maintenance"].is_null()).then_some(())
    })
    .await;
    // Split over the three left by count, or by bytes when the leader had the buckets' sizes
    // (then the counts differ): every node sees one map of the three.
    wait_for("one map of the three members left", || async {
        let mut seen = Vec::new();
        for s in [0, 2, 4] {
            seen.push(c.counts(s).await);
        }
        let one = seen.windows(2).all(|w| w[0] == w[1]);
        (one && seen[0].1.len() == 3).then_some(())
    })
    .await;
    let history = w.pause().await;
    let lost = check(&c, 0, &history).await;
    assert!(lost.is_empty(), "{} problems, first: {:?}", lost.len(), &lost[..lost.len().min(5)]);
    w.stop().await;
    c.shutdown().await;
}

/// `GET http://addr/path` as JSON.
async fn view_of(http: &reqwest::Client, addr: &str, path: &str) -> Option<Value> {
    http.get(format!("http://{addr}{path}")).send().await.ok()?.json().await.ok()
}

/// `kubectl rollout restart` of a three-pod StatefulSet, on processes: highest ordinal first,
/// each pod SIGTERMed (it goes into maintenance), down for longer than the node timeout, back
/// on its volume, and ready before the next goes; the Service sends clients only to the pods
/// that run. No write acknowledged is lost, no node is failed, every pod keeps its member id.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rolling_restart_of_a_statefulset_under_writes_fails_no_node_and_loses_no_write() {
    use crate::process::{free_port, NodeProcess};
    let dir = tempfile::tempdir().expect("temp dir");
    let ports: Vec<(u16, u16)> = (0..3).map(|_| (free_port(), free_port())).collect();
    let discover = ports.iter().map(|(api, _)| format!("127.0.0.1:{api}")).collect::<Vec<_>>().join(",");
    // A node timeout shorter than a pod's restart: without maintenance every restart would be
    // a failover.
    let flags = [
        "--discover",
        &discover,
        "--ping-interval",
        "300ms",
        "--node-timeout",
        "2s",
        "--restart-window",
        "2m",
        "--drain-timeout",
        "40s",
    ];
    let pods: Vec<String> = (0..3).map(|k| format!("shoal-{k}")).collect();
    let mut nodes: Vec<NodeProcess> = (0..3)
        .map(|k| NodeProcess::launch(&dir.path().join(&pods[k]), ports[k], &flags, &[("POD_NAME", pods[k].as_str())]))
        .collect();
    let addrs: Vec<String> = nodes.iter().map(|n| n.addr.clone()).collect();
    let http = reqwest::Client::builder().no_proxy().timeout(Duration::from_secs(10)).build().expect("client");
    let settled = |v: &Value| {
        v["members"].as_array().is_some_and(|m| m.len() == 3)
            && v["transition"].is_null()
            && v["transfer"].is_null()
            && v["maintenance"].is_null()
    };
    let ids_before = wait_for("three members, settled", || async {
        let v = view_of(&http, &addrs[0], "/v1/cluster").await?;
        settled(&v).then(|| member_ids(&v))
    })
    .await;

    let w = Workload::start_with_readers(addrs.clone(), 4, 2);
    wait_for("some writes", || async { (w.acked() > 300).then_some(()) }).await;
    for k in [2, 1, 0] {
        wait_for("every pod ready", || async {
            for a in &addrs {
                if http.get(format!("http://{a}/readyz")).send().await.ok()?.status() != 200 {
                    return None;
                }
            }
            Some(())
        })
        .await;
        let others: Vec<String> = (0..3).filter(|&j| j != k).map(|j| addrs[j].clone()).collect();
        w.set_targets(others);
        let status = tokio::task::block_in_place(|| nodes[k].stop());
        assert!(status.success(), "exit status after SIGTERM: {status}");
        assert!(
            nodes[k].log().contains("in maintenance"),
            "{} did not go into maintenance: {}",
            pods[k],
            nodes[k].log()
        );
        // Down for longer than the node timeout, as a pod being replaced is.
        tokio::time::sleep(Duration::from_secs(3)).await;
        tokio::task::block_in_place(|| nodes[k].restart());
        wait_for("the restarted pod ready, the maintenance over", || async {
            let ready = http.get(format!("http://{}/readyz", addrs[k])).send().await.ok()?.status() == 200;
            let v = view_of(&http, &addrs[k], "/v1/cluster").await?;
            (ready && v["maintenance"].is_null()).then_some(())
        })
        .await;
        w.set_targets(addrs.clone());
    }
    let view = view_of(&http, &addrs[0], "/v1/cluster").await.expect("view");
    if view["failed"] != json!([]) || member_ids(&view) != ids_before {
        eprintln!("the nodes' logs and data dirs are kept in {}", dir.keep().display());
        panic!("a node failed or came back as another member: {view}");
    }
    let history = w.pause().await;
    let outages = w.outages();
    let reads = w.reads();
    eprintln!(
        "rolling restart: {} writes acknowledged, {} failed, longest pause one writer saw {:?}; refusals {:?}",
        outages.acked, outages.failed, outages.longest, outages.refusals
    );
    let lost = crate::workload::check_addr(&http, &addrs[0], &history).await;
    if !lost.is_empty() {
        // The nodes' logs and data dirs stay for whoever looks into it.
        eprintln!("the nodes' logs and data dirs are kept in {}", dir.keep().display());
    }
    assert!(lost.is_empty(), "{} problems, first: {:?}", lost.len(), &lost[..lost.len().min(5)]);
    let stale = crate::workload::linearizable(&reads, &history);
    assert!(stale.is_empty(), "{} reads went back in time, first: {:?}", stale.len(), &stale[..stale.len().min(5)]);
    w.stop().await;
    for node in &mut nodes {
        tokio::task::block_in_place(|| node.stop());
    }
}

/// Three member processes whose stops have `--drain-timeout 15s` (and the default restart
/// window), settled: the processes, their addresses and their member ids, and a client.
async fn three_stopping_processes(
    dir: &std::path::Path,
) -> (Vec<crate::process::NodeProcess>, Vec<String>, Vec<u64>, reqwest::Client) {
    use crate::process::{free_port, NodeProcess};
    let ports: Vec<(u16, u16)> = (0..3).map(|_| (free_port(), free_port())).collect();
    let discover = ports.iter().map(|(api, _)| format!("127.0.0.1:{api}")).collect::<Vec<_>>().join(",");
    let flags = ["--discover", &discover, "--ping-interval", "300ms", "--node-timeout", "2s", "--drain-timeout", "15s"];
    let pods: Vec<String> = (0..3).map(|k| format!("shoal-{k}")).collect();
    let nodes: Vec<NodeProcess> = (0..3)
        .map(|k| NodeProcess::launch(&dir.join(&pods[k]), ports[k], &flags, &[("POD_NAME", pods[k].as_str())]))
        .collect();
    let addrs: Vec<String> = nodes.iter().map(|n| n.addr.clone()).collect();
    let http = reqwest::Client::builder().no_proxy().timeout(Duration::from_secs(10)).build().expect("client");
    let mut ids = Vec::new();
    for a in &addrs {
        let id = wait_for("three members, settled and ready", || async {
            let v = view_of(&http, a, "/v1/cluster").await?;
            let settled = v["members"].as_array().is_some_and(|m| m.len() == 3)
                && v["transition"].is_null()
                && v["transfer"].is_null();
            let ready = http.get(format!("http://{a}/readyz")).send().await.ok()?.status() == 200;
            (settled && ready).then(|| v["node_id"].as_u64()).flatten()
        })
        .await;
        ids.push(id);
    }
    (nodes, addrs, ids, http)
}

/// SIGTERM to every member at once (a whole cluster shut down): each stops within its
/// `--drain-timeout` (it waited 70 s of a 60 s bound, entering a maintenance the stopping
/// cluster could not keep); none goes into maintenance; two of them started again serve every
/// bucket, empty (the data was in memory), none lost (the member that had entered maintenance
/// left its buckets lost until an operator cleared them).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_whole_cluster_stopped_at_once_stops_within_its_bound_and_any_two_serve_every_bucket_again() {
    let dir = tempfile::tempdir().expect("temp dir");
    let (mut nodes, addrs, ids, http) = three_stopping_processes(dir.path()).await;
    let map = view_of(&http, &addrs[0], "/v1/cluster/map").await.expect("map");
    let owner_of = |k: &str| map["owners"][shoal_raft::bucket_of(k.as_bytes()).0 as usize].as_u64();
    let keys: Vec<String> = ids
        .iter()
        .map(|&id| (0..).map(|i| format!("whole-{id}-{i}")).find(|k| owner_of(k) == Some(id)).expect("a key"))
        .collect();
    for key in &keys {
        let r = http.put(format!("http://{}/v1/kv/{key}", addrs[0])).body("v").send().await.expect("put");
        assert!(r.status().is_success(), "{key}");
    }
    let signalled = std::time::Instant::now();
    for n in &nodes {
        n.signal("-TERM");
    }
    for (k, n) in nodes.iter_mut().enumerate() {
        let status = tokio::task::block_in_place(|| n.wait_exit(Duration::from_secs(120)));
        let took = signalled.elapsed();
        let log = n.log();
        assert!(status.success(), "slot {k}: {status}\n{log}");
        assert!(took < Duration::from_secs(18), "slot {k} stopped after {took:?}, its bound is 15 s\n{log}");
        assert!(!log.contains("stopping for a restart: in maintenance"), "slot {k} went into maintenance\n{log}");
    }
    // The member that stays down: the one that had the most to lose (its buckets handed over
    // by a maintenance), else the last.
    let missing = (0..3).find(|&k| nodes[k].log().contains("in maintenance:")).unwrap_or(2);
    // Both at once: neither has a leader before the other is back.
    for k in (0..3).filter(|&k| k != missing) {
        nodes[k].relaunch();
    }
    for k in (0..3).filter(|&k| k != missing) {
        tokio::task::block_in_place(|| nodes[k].wait_ready());
    }
    let back = (missing + 1) % 3;
    let deadline = tokio::time::Instant::now() + crate::harness::DEADLINE;
    loop {
        let v = view_of(&http, &addrs[back], "/v1/cluster").await;
        let lost = v.as_ref().and_then(|v| v["lost_buckets"].as_array().map(Vec::len));
        let failed = v.as_ref().and_then(|v| v["failed"].as_array().cloned()).unwrap_or_default();
        if lost == Some(0) && failed.iter().any(|f| f.as_u64() == Some(ids[missing])) {
            break;
        }
        if tokio::time::Instant::now() > deadline {
            let logs: Vec<String> = (0..3).map(|k| format!("slot {k}:\n{}", nodes[k].log())).collect();
            panic!(
                "not every bucket served again ({lost:?} lost, failed {failed:?}): {v:?}\n{}",
                logs.join("\n----\n")
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // A bucket still being taken over answers 503 with Retry-After meanwhile; then each
    // serves again, empty.
    for key in &keys {
        crate::harness::wait_for(&format!("{key} served again, empty"), || async {
            let r = http.get(format!("http://{}/v1/kv/{key}", addrs[back])).send().await.ok()?;
            let status = r.status().as_u16();
            assert!(status == 404 || (status == 503 && r.headers().contains_key("retry-after")), "{key}: {status}");
            (status == 404).then_some(())
        })
        .await;
    }
    let v = view_of(&http, &addrs[back], "/v1/cluster").await.expect("view");
    assert_eq!(v["lost_buckets"], json!([]), "{v}");
}

/// A member already away in maintenance that gets SIGTERM stops as planned: it says so, not
/// that the cluster will fail it, and returns as itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_already_in_maintenance_stops_without_a_false_warning_and_returns_as_itself() {
    let dir = tempfile::tempdir().expect("temp dir");
    let (mut nodes, addrs, ids, http) = three_stopping_processes(dir.path()).await;
    let url = format!("http://{}/v1/cluster/nodes/{}/maintenance", addrs[0], ids[1]);
    let r = http.post(url).json(&json!({ "for": "5m" })).send().await.expect("maintenance");
    assert_eq!(r.status(), 200, "{:?}", r.text().await);
    let status = tokio::task::block_in_place(|| nodes[1].stop());
    assert!(status.success(), "{status}");
    let log = nodes[1].log();
    assert!(!log.contains("stopping without maintenance"), "{log}");
    assert!(log.contains("already in maintenance"), "{log}");
    tokio::task::block_in_place(|| nodes[1].restart());
    wait_for("the maintenance over, nobody failed", || async {
        let v = view_of(&http, &addrs[0], "/v1/cluster").await?;
        (v["maintenance"].is_null() && v["transfer"].is_null()).then_some(v)
    })
    .await;
    let v = view_of(&http, &addrs[0], "/v1/cluster").await.expect("view");
    assert_eq!((v["failed"].clone(), member_ids(&v)), (json!([]), ids.clone()));
}

/// The stop of a member whose peers are gone (no majority answers, but none is held silent
/// yet) ends by its deadline: nothing it asks of Raft can commit, and it does not wait for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stop_ends_by_its_deadline_when_no_majority_answers() {
    let mut c = TestCluster::start_with(3, |config| {
        config.ping_interval = Duration::from_millis(500);
        config.node_timeout = Duration::from_secs(20);
    })
    .await;
    c.wait_for_counts(&[333, 333, 334]).await;
    c.wait_all_attached().await;
    c.stop(1).await;
    c.stop(2).await;
    let started = std::time::Instant::now();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(6);
    c.node(0).stop_for_restart(Duration::from_secs(120), deadline).await;
    let took = started.elapsed();
    assert!(took < Duration::from_secs(7), "the stop took {took:?} of its 6 s");
    c.shutdown().await;
}
