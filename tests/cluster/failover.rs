//! Replicas, replication and failover with in-process nodes: a stopped node loses its memory
//! like a crashed one, so what the cluster still serves afterwards came from replicas.

use std::time::Duration;

use serde_json::Value;
use shoal::config::ServeConfig;

use crate::harness::{wait_for, TestCluster};

/// Pings every 200 ms, pfail after 1 s of silence.
fn fast_detection(config: &mut ServeConfig) {
    config.ping_interval = Duration::from_millis(200);
    config.node_timeout = Duration::from_secs(1);
}

/// Items in every running node's replica store.
async fn replica_items(c: &TestCluster) -> u64 {
    let mut total = 0;
    for s in c.running() {
        total += c.json(s, "/v1/cluster").await["replication"]["replica_items"].as_u64().expect("replica_items");
    }
    total
}

async fn put_all(c: &TestCluster, slot: usize, keys: &[String], value: &str) {
    for k in keys {
        assert_eq!(c.put(slot, k, &format!("{value}-{k}")).await, 200, "PUT {k}");
    }
}

async fn assert_all_readable(c: &TestCluster, slot: usize, keys: &[String], value: &str) {
    for k in keys {
        assert_eq!(c.get(slot, k).await, Some(format!("{value}-{k}")), "GET {k} through slot {slot}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sync_writes_are_in_the_replica_before_the_answer_and_deletes_follow() {
    let c = TestCluster::start(3).await;
    c.wait_for_counts(&[333, 333, 334]).await;
    // While a replica moves to the holder join order names, writes reach both holders.
    c.wait_replicas_placed().await;
    let keys: Vec<String> = (0..300).map(|i| format!("r{i}")).collect();
    put_all(&c, 0, &keys, "v1").await;
    // Sync mode: every acknowledged item is in exactly one replica store, now.
    assert_eq!(replica_items(&c).await, 300);
    for k in &keys[..100] {
        let r = c.http.delete(c.url(1, &format!("/v1/kv/{k}"))).send().await.expect("delete");
        assert_eq!(r.status(), 204, "DELETE {k}");
    }
    assert_eq!(replica_items(&c).await, 200, "deletes reach the replica too");
    // Removal by tag deletes through the replicas as well (a removed item must not come
    // back after a failover).
    for k in &keys[100..150] {
        let r = c.http.put(c.url(2, &format!("/v1/kv/{k}?tags=red"))).body("tagged").send().await.expect("put");
        assert_eq!(r.status(), 200, "PUT {k}");
    }
    let r = c.http.delete(c.url(0, "/v1/tags/red")).send().await.expect("remove tagged");
    assert_eq!(r.status(), 200);
    let removed: Value = r.json().await.expect("json");
    assert_eq!(removed["removed"], 50, "{removed}");
    assert_eq!(removed["incomplete"], false, "{removed}");
    assert_eq!(replica_items(&c).await, 150, "removal by tag reaches the replicas");
    assert_eq!(c.get(1, &keys[120]).await, None);
    // The background attacher gives every owned bucket a replica.
    c.wait_all_attached().await;
    let metrics = c.http.get(c.url(0, "/metrics")).send().await.expect("metrics").text().await.expect("text");
    for name in ["shoal_replica_items", "shoal_replication_queue_depth", "shoal_peers_pfail", "shoal_buckets_lost"] {
        assert!(metrics.contains(name), "{name} in /metrics");
    }
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn values_and_buckets_larger_than_two_megabytes_reach_the_replica() {
    let mut c = TestCluster::start_with(1, |config| config.max_value_bytes = 4 << 20).await;
    // One bucket (a shared tag) of about 9 MiB, written before the replica holder exists:
    // it is sent whole, as a snapshot.
    let big = "b".repeat(3 << 20);
    for i in 0..3 {
        let r = c.http.put(c.url(0, &format!("/v1/kv/{{huge}}{i}"))).body(big.clone()).send().await.expect("put");
        assert_eq!(r.status(), 200);
    }
    c.add_node().await;
    c.wait_for_counts(&[500, 500]).await;
    c.wait_all_attached().await;
    // A sync write of a 3 MiB value, whoever owns its bucket.
    let r = c.http.put(c.url(1, "/v1/kv/one-big-value")).body(big.clone()).send().await.expect("put");
    assert_eq!(r.status(), 200, "{}", r.text().await.unwrap_or_default());
    assert_eq!(replica_items(&c).await, 4, "every item is in a replica");
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn async_mode_is_a_runtime_setting_and_replicas_catch_up() {
    let c = TestCluster::start(2).await;
    let r = c.http.put(c.url(1, "/v1/cluster/config")).body(r#"{"replication":"async"}"#).send().await.expect("put");
    assert_eq!(r.status(), 200);
    let r = c.http.put(c.url(1, "/v1/cluster/config")).body(r#"{"replication":"quorum"}"#).send().await.expect("put");
    assert_eq!(r.status(), 400, "an unknown mode is refused");
    wait_for("async mode everywhere", || async {
        for s in c.running() {
            if c.json(s, "/v1/cluster").await["replication"]["mode"] != "async" {
                return None;
            }
        }
        Some(())
    })
    .await;
    let keys: Vec<String> = (0..200).map(|i| format!("a{i}")).collect();
    put_all(&c, 0, &keys, "v").await;
    wait_for("the async queue to drain into the replicas", || async { (replica_items(&c).await == 200).then_some(()) })
        .await;
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_node_s_buckets_are_served_from_its_replica_with_every_write() {
    let mut c = TestCluster::start_with(3, fast_detection).await;
    c.wait_for_counts(&[333, 333, 334]).await;
    let keys: Vec<String> = (0..600).map(|i| format!("f{i}")).collect();
    put_all(&c, 0, &keys, "v1").await;
    put_all(&c, 2, &keys[..200], "v2").await;
    let victim = c.id(1);
    c.stop(1).await;

    // Until the failure is committed, its buckets answer 503 quickly, never hang.
    let failed = wait_for("the cluster to fail the stopped node", || async {
        let view: Value = c.json(0, "/v1/cluster").await;
        let failed = view["failed"].as_array()?.iter().any(|id| id.as_u64() == Some(victim));
        failed.then_some(view)
    })
    .await;
    assert!(failed["members"].as_array().expect("members").iter().all(|m| m["id"].as_u64() != Some(victim)));
    c.wait_settled().await;
    c.wait_for_counts(&[500, 500]).await;
    assert_all_readable(&c, 0, &keys[..200], "v2").await;
    assert_all_readable(&c, 2, &keys[200..], "v1").await;
    assert!(c.json(0, "/v1/cluster").await["lost_buckets"].as_array().expect("lost").is_empty());
    // Writable again, and the survivors replicate to each other.
    put_all(&c, 2, &keys, "v3").await;
    assert_eq!(replica_items(&c).await, 600);
    // Healthy again, with the failed member in the past: the health endpoint and the CLI's
    // gate look at the current members only.
    c.wait_all_attached().await;
    wait_for("healthy after the failover", || async {
        let r = c.http.get(c.url(0, "/v1/cluster/health")).send().await.ok()?;
        (r.status() == 200).then_some(())
    })
    .await;
    let health = c.json(2, "/v1/cluster/health").await;
    assert_eq!((&health["healthy"], &health["members"]), (&Value::Bool(true), &Value::from(2)), "{health}");
    let addr = c.api(0);
    let status =
        tokio::task::spawn_blocking(move || crate::process::client(&addr, &["status", "--wait", "--timeout", "60s"]))
            .await
            .expect("status --wait");
    assert_eq!(status.status.code(), Some(0), "{}", String::from_utf8_lossy(&status.stderr));

    // The failed node comes back only as a new member.
    let err = c.restart(1).await.expect_err("a failed node must not start as its old self");
    assert!(matches!(err, shoal::node::StartError::Failed { .. }), "{err}");
    c.shutdown().await;
}

/// A sliding item kept alive only by reads through another node survives its owner's
/// failure: the owner decides expirations and its reads reach the replica, so the heir serves
/// it (it answered 404 from a second after the kill: the replica's copy had expired with the
/// write's window).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sliding_item_kept_alive_by_reads_survives_its_owner_s_failure() {
    let mut c = TestCluster::start_with(3, fast_detection).await;
    c.wait_for_counts(&[333, 333, 334]).await;
    c.wait_all_attached().await;
    let key = "sliding-kept-alive";
    let map = c.json(0, "/v1/cluster/map").await;
    let owner = map["owners"][usize::from(shoal_raft::bucket_of(key.as_bytes()).0)].as_u64().expect("owner");
    let owner_slot = c.running().find(|&s| c.id(s) == owner).expect("the owner's slot");
    let reader = c.running().find(|&s| s != owner_slot).expect("another node");
    let r = c.http.put(c.url(reader, &format!("/v1/kv/{key}?sliding=5s"))).body("alive").send().await.expect("put");
    assert_eq!(r.status(), 200);
    let read = |c: &TestCluster| {
        let (http, url) = (c.http.clone(), c.url(reader, &format!("/v1/kv/{key}")));
        async move { http.get(url).send().await.map_or(0, |r| r.status().as_u16()) }
    };
    // Read through another node every 300 ms for longer than the window: only the reads keep
    // it alive (the copy the write sent to the replica would have expired by the end).
    for _ in 0..25 {
        assert_eq!(read(&c).await, 200);
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    c.stop(owner_slot).await;
    let stopped = tokio::time::Instant::now();
    let mut served = 0;
    while stopped.elapsed() < Duration::from_secs(12) {
        match read(&c).await {
            200 => served += 1,
            404 => panic!("404 {:?} after the owner stopped: the replica's copy had expired", stopped.elapsed()),
            _ => {} // 503 while the failure is detected and the bucket promoted
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    assert!(served >= 10, "the heir serves it, and the reads keep it alive there: {served}");
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_restarted_as_the_same_member_gets_its_buckets_back_from_its_replica() {
    // Pings on (the owners notice the restart and re-send the replica it holds), but a node
    // timeout long enough that the quick restart is not a failure.
    let mut c = TestCluster::start_with(3, |config| {
        config.ping_interval = Duration::from_millis(200);
        config.node_timeout = Duration::from_secs(20);
    })
    .await;
    c.wait_for_counts(&[333, 333, 334]).await;
    let keys: Vec<String> = (0..600).map(|i| format!("s{i}")).collect();
    put_all(&c, 0, &keys, "v1").await;
    // Its memory is gone after the restart; its replica holder still has every item.
    c.restart(1).await.expect("restart as the same member");
    assert_eq!(c.id(1), 2);
    for k in &keys {
        let url = c.url(0, &format!("/v1/kv/{k}"));
        let value = wait_for(&format!("{k} readable after the restart"), || async {
            let r = c.http.get(&url).send().await.ok()?;
            match r.status().as_u16() {
                200 => Some(Some(r.text().await.ok()?)),
                404 => Some(None),
                _ => None, // 503 bucket_restoring meanwhile
            }
        })
        .await;
        assert_eq!(value, Some(format!("v1-{k}")), "{k}");
    }
    // And its own replica of the next member is rebuilt too.
    wait_for("the replicas rebuilt", || async { (replica_items(&c).await == 600).then_some(()) }).await;
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leaver_hands_its_buckets_to_its_replica_holder_which_serves_them_during_the_transfer() {
    // A slow transfer (20 KB/s per bucket), so that the hand-over is seen before it ends.
    let mut c = TestCluster::start_with(3, |config| config.transfer_rate = 20_000).await;
    c.wait_for_counts(&[333, 333, 334]).await;
    let keys: Vec<String> = (0..600).map(|i| format!("h{i}")).collect();
    let big = "x".repeat(1000);
    put_all(&c, 0, &keys, &big).await;
    c.wait_all_attached().await;
    let leaver = c.id(2);
    let r = c.http.post(c.url(0, &format!("/v1/cluster/nodes/{leaver}/leave"))).send().await.expect("leave");
    assert_eq!(r.status(), 200);
    // The leaver owns nothing (and is retired) at once: its replica holder serves its buckets
    // while state transfer is still moving them to their new owners.
    let view = wait_for("the leaver's buckets handed over", || async {
        let view: Value = c.json(0, "/v1/cluster").await;
        let gone = view["members"].as_array()?.iter().all(|m| m["id"].as_u64() != Some(leaver));
        gone.then_some(view)
    })
    .await;
    assert!(!view["transfer"].is_null(), "handed over before the transfer ended: {view}");
    assert_all_readable(&c, 0, &keys, &big).await;
    c.wait_stopped(2).await;
    c.wait_settled().await;
    c.wait_for_counts_among(&[500, 500], &[0, 1]).await;
    assert_all_readable(&c, 1, &keys, &big).await;
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_draining_node_is_unready_and_acknowledges_no_write() {
    let mut c = TestCluster::start(2).await;
    c.wait_for_counts(&[500, 500]).await;
    wait_for("ready", || async {
        let r = c.http.get(c.url(1, "/readyz")).send().await.ok()?;
        (r.status() == 200).then_some(())
    })
    .await;
    assert!(c.node(1).drain(Duration::from_secs(10)).await, "replicas in sync");
    let r = c.http.get(c.url(1, "/readyz?verbose")).send().await.expect("readyz");
    assert_eq!(r.status(), 503);
    assert!(r.text().await.expect("text").contains("[-] draining"));
    let r = c.http.put(c.url(1, "/v1/kv/during-drain")).body("v").send().await.expect("put");
    assert_eq!(r.status(), 503);
    let problem: Value = r.json().await.expect("json");
    assert_eq!(problem["code"], "node_draining", "{problem}");
    // Through the other node, its refusal reaches the client unchanged, alone and in a bulk.
    let map = c.json(0, "/v1/cluster/map").await;
    let key = (0..)
        .map(|i| format!("drained-{i}"))
        .find(|k| map["owners"][shoal_raft::bucket_of(k.as_bytes()).0 as usize].as_u64() == Some(c.id(1)))
        .expect("a key of node 1");
    let r = c.http.put(c.url(0, &format!("/v1/kv/{key}"))).body("v").send().await.expect("put");
    assert_eq!(
        (r.status().as_u16(), r.headers().get("retry-after").map(|v| v.as_bytes().to_vec())),
        (503, Some(b"1".to_vec()))
    );
    assert_eq!(r.headers().get("content-type").map(|v| v.as_bytes()), Some(&b"application/problem+json"[..]));
    let forwarded: Value = r.json().await.expect("json");
    assert_eq!((&forwarded["code"], &forwarded["detail"]), (&problem["code"], &problem["detail"]), "{forwarded}");
    let bulk = serde_json::json!({"items": [{"key": key, "value": "v"}]});
    let r = c.http.post(c.url(0, "/v1/bulk/put")).json(&bulk).send().await.expect("bulk");
    let answer: Value = r.json().await.expect("json");
    let e = &answer["results"][0]["error"];
    assert_eq!(
        (&e["status"], &e["code"], &e["retry_after"]),
        (&Value::from(503), &problem["code"], &Value::from(1)),
        "{answer}"
    );
    c.stop(1).await;
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopping_leader_hands_the_lead_to_its_successor_and_keeps_its_vote() {
    let mut c = TestCluster::start(3).await;
    c.wait_for_counts(&[333, 333, 334]).await;
    let (leader, slot) = c.leader().await;
    let other = (slot + 1) % 3;
    let role_of = |view: &Value, id: u64| {
        view["members"]
            .as_array()
            .and_then(|m| m.iter().find(|m| m["id"].as_u64() == Some(id)).cloned())
            .map(|m| m["role"].as_str().unwrap_or_default().to_string())
    };
    assert!(c.node(slot).drain(Duration::from_secs(20)).await, "drained in time");
    // Before it stops, its successor leads; the voters stay as they were.
    let view = wait_for("the lead handed over", || async {
        let view: Value = c.json(other, "/v1/cluster").await;
        let new_leader = view["leader"].as_u64()?;
        (new_leader != leader).then_some(view)
    })
    .await;
    // The next voter in join order stands for election; when its log was a moment behind the
    // leader's, the leader refuses it (while stepping down) and the third voter wins later.
    let new_leader = view["leader"].as_u64();
    assert!((0..3).any(|s| s != slot && new_leader == Some(c.id(s))), "a member that does not stop leads: {view}");
    assert_eq!(role_of(&view, leader).as_deref(), Some("voter"), "the stopping member keeps its vote: {view}");
    c.restart(slot).await.expect("restart as the same member");
    wait_for("every member ready after the restart", || async {
        let view: Value = c.json(other, "/v1/cluster").await;
        (role_of(&view, leader).as_deref() == Some("voter") && view["leader"].as_u64().is_some()).then_some(())
    })
    .await;
    c.shutdown().await;
}

/// Members that stop stand by no timer of their own, but once no leader has been heard for the
/// longest election timeout they stand: with the leader gone and the two others stopping at
/// once, one of them leads and both stops are recorded. Before, neither stood, nothing could
/// be recorded, and the cluster started again without them would have failed them as not
/// stopped and called their buckets lost (a whole-cluster stop, when the leader stepped down
/// for a successor that lost the election and then got SIGTERM itself, and the member with the
/// newest log was one whose stop was recorded).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn members_that_stop_with_no_leader_left_elect_one_to_record_their_stops() {
    let mut c = TestCluster::start(3).await;
    c.wait_for_counts(&[333, 333, 334]).await;
    let (_, slot) = c.leader().await;
    let others: Vec<usize> = (0..3).filter(|&s| s != slot).collect();
    c.stop(slot).await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
    let stops = others.iter().map(|&s| c.node(s).stop_for_restart(Duration::ZERO, deadline));
    futures::future::join_all(stops).await;
    let ids: Vec<u64> = others.iter().map(|&s| c.id(s)).collect();
    for &s in &others {
        wait_for("both stops recorded", || async {
            let draining = c.node(s).control().state().draining.clone();
            ids.iter().all(|id| draining.contains(id)).then_some(())
        })
        .await;
    }
    c.shutdown().await;
}

fn fast_detection_five_voters(config: &mut ServeConfig) {
    fast_detection(config);
    config.voters = 5;
}

/// Every member of a cluster `c` of settled members stops at once (SIGTERM, as on a shutdown
/// of the whole cluster); the members in `back` start again. They elect a leader, fail the
/// others, and serve every bucket again — the absent members' buckets empty (every copy died in
/// the stop), not lost. The time it took is printed (about 10 to 30 s); the bound is a liveness
/// bound, loose enough for a busy 2-core machine (it once took 32 s in CI), not a speed claim.
async fn full_stop_then(mut c: TestCluster, back: &[usize]) {
    let n = c.running().count();
    let away: Vec<usize> = (0..n).filter(|s| !back.contains(s)).collect();
    let away_ids: Vec<u64> = away.iter().map(|&s| c.id(s)).collect();
    // A key in a bucket of each member that will not come back.
    let map = c.json(0, "/v1/cluster/map").await;
    let owner_of = |k: &str| map["owners"][shoal_raft::bucket_of(k.as_bytes()).0 as usize].as_u64();
    let keys: Vec<String> = away_ids
        .iter()
        .map(|&id| (0..).map(|i| format!("full-stop-{id}-{i}")).find(|k| owner_of(k) == Some(id)).expect("a key"))
        .collect();
    for key in &keys {
        assert!(c.put(back[0], key, "v").await.is_success());
    }
    let drains = (0..n).map(|slot| c.node(slot).drain(Duration::from_secs(10)));
    futures::future::join_all(drains).await;
    let view: Value = c.json(0, "/v1/cluster").await;
    let voters =
        |view: &Value| view["members"].as_array().map_or(0, |m| m.iter().filter(|m| m["role"] == "voter").count());
    assert_eq!(
        voters(&view),
        n.min(view["voters"].as_u64().unwrap_or(3) as usize),
        "stopping members keep their votes: {view}"
    );
    for slot in 0..n {
        c.stop(slot).await;
    }
    for &slot in back {
        c.restart(slot).await.expect("restart");
    }
    let started = std::time::Instant::now();
    for key in &keys {
        wait_for("the absent members' buckets served again", || async {
            let r = c.http.get(c.url(back[0], &format!("/v1/kv/{key}"))).send().await.ok()?;
            (r.status() == 404).then_some(())
        })
        .await;
    }
    let took = started.elapsed();
    let view: Value = c.json(back[0], "/v1/cluster").await;
    let failed: Vec<u64> = view["failed"].as_array().expect("failed").iter().filter_map(Value::as_u64).collect();
    assert!(away_ids.iter().all(|id| failed.contains(id)), "{view}");
    assert!(view["lost_buckets"].as_array().is_some_and(Vec::is_empty), "{view}");
    eprintln!("members {back:?} of {n} serve every bucket {took:?} after the last of them started");
    assert!(took < Duration::from_secs(60), "served again after {took:?}");
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_full_stop_nodes_2_and_3_serve_every_bucket_again() {
    let c = TestCluster::start_with(3, fast_detection).await;
    c.wait_for_counts(&[333, 333, 334]).await;
    full_stop_then(c, &[1, 2]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_full_stop_nodes_1_and_2_serve_every_bucket_again() {
    let c = TestCluster::start_with(3, fast_detection).await;
    c.wait_for_counts(&[333, 333, 334]).await;
    full_stop_then(c, &[0, 1]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_full_stop_nodes_1_and_3_serve_every_bucket_again() {
    let c = TestCluster::start_with(3, fast_detection).await;
    c.wait_for_counts(&[333, 333, 334]).await;
    full_stop_then(c, &[0, 2]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_full_stop_of_five_three_serve_every_bucket_again() {
    let c = TestCluster::start_with(5, fast_detection_five_voters).await;
    c.wait_for_counts(&[200, 200, 200, 200, 200]).await;
    full_stop_then(c, &[1, 3, 4]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_that_cannot_commit_through_raft_is_not_ready() {
    let mut c = TestCluster::start(3).await;
    c.wait_for_counts(&[333, 333, 334]).await;
    async fn ready(c: &TestCluster, slot: usize) -> Option<(bool, String)> {
        let r = c.http.get(c.url(slot, "/readyz?verbose")).send().await.ok()?;
        Some((r.status() == 200, r.text().await.ok()?))
    }
    for slot in 0..3 {
        wait_for("every member ready", || async { ready(&c, slot).await.filter(|(ok, _)| *ok) }).await;
    }
    // Two of the three stop: the last one, leader or not, cannot commit any more.
    c.stop(1).await;
    c.stop(2).await;
    let (_, text) = wait_for("the last member unready", || async { ready(&c, 0).await.filter(|(ok, _)| !*ok) }).await;
    assert!(text.contains("[-] leader"), "{text}");
    c.shutdown().await;
}
