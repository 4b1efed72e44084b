//! Restarts: nodes come back from their data dirs as the same members with the same map; a
//! node that left refuses to start.

use serde_json::Value;

use crate::harness::{wait_for, TestCluster};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_leave_every_node_restarts_with_its_membership_and_map_version() {
    let mut c = TestCluster::start(3).await;
    c.wait_for_counts(&[333, 333, 334]).await;
    let r = c.http.post(c.url(0, "/v1/cluster/nodes/2/leave")).send().await.expect("leave");
    assert_eq!(r.status(), 200);
    c.wait_stopped(1).await;
    let version = c.wait_for_counts(&[500, 500]).await;

    for slot in [0, 2] {
        c.stop(slot).await;
    }
    for slot in [0, 2] {
        c.restart(slot).await.expect("restart from the data dir");
    }
    let after = c.wait_for_counts(&[500, 500]).await;
    assert_eq!(after, version, "the map version survives the restart");
    let ids = |v: Value| -> Vec<u64> {
        v["members"].as_array().expect("m").iter().map(|m| m["id"].as_u64().expect("id")).collect()
    };
    wait_for("a leader after the restart", || async { c.json(2, "/v1/cluster").await["leader"].as_u64() }).await;
    assert_eq!(ids(c.json(2, "/v1/cluster").await), vec![1, 3]);
    assert_eq!((c.id(0), c.id(2)), (1, 3), "same ids as before");
    // Each restarted node first asks its replica holder for its buckets (503 meanwhile).
    wait_for("writes after the restart", || async { (c.put(0, "k", "v").await == 200).then_some(()) }).await;
    assert_eq!(c.get(2, "k").await.as_deref(), Some("v"));

    // The node that left refuses its old data dir with a clear message.
    let err = c.restart(1).await.expect_err("a retired node must not start");
    assert!(err.to_string().contains("has left its cluster"), "{err}");
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_single_node_restarts_as_the_same_cluster() {
    let mut c = TestCluster::start(1).await;
    assert!(c.put(0, "kept-in-memory", "v").await.is_success());
    let before = c.json(0, "/v1/cluster").await;
    c.restart(0).await.expect("restart");
    wait_for("readiness after restart", || async {
        let r = c.http.get(c.url(0, "/readyz")).send().await.ok()?;
        (r.status() == 200).then_some(())
    })
    .await;
    let after = c.json(0, "/v1/cluster").await;
    assert_eq!(after["cluster_id"], before["cluster_id"]);
    assert_eq!(after["map_version"], before["map_version"]);
    // Its memory held the only copy: the buckets serve again, empty (a 404, after at most a
    // moment of 503 `bucket_restoring` while it catches up with its own log).
    wait_for("the key answers 404 after the restart", || async {
        let r = c.http.get(c.url(0, "/v1/kv/kept-in-memory")).send().await.ok()?;
        (r.status() == 404).then_some(())
    })
    .await;
    assert!(c.put(0, "kept-in-memory", "w").await.is_success());
    assert_eq!(c.get(0, "kept-in-memory").await.as_deref(), Some("w"));
    c.shutdown().await;
}

/// A restarted node catches up to the leader's read index before it restores its buckets:
/// whichever node asks, the index covers everything the leader had committed before. A
/// request a peer cannot read (a leader of an earlier version) is refused with a 400, which
/// the asker takes as final and does not retry.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_node_reads_an_index_that_covers_the_leaders_commits() {
    let c = TestCluster::start(3).await;
    c.wait_for_counts(&[333, 333, 334]).await;
    let leader = wait_for("a leader", || async { c.node(0).control().leader() }).await;
    let leader_slot = (0..3).find(|&s| c.id(s) == leader).expect("the leader is a member");
    for slot in 0..3 {
        let committed = c.node(leader_slot).control().commit_index();
        let index = c.node(slot).control().read_index().await.expect("a read index");
        assert!(index >= committed, "slot {slot}: read index {index} < the leader's commit index {committed}");
    }
    let peer = c.node(1).peer_addr();
    let r = c
        .http
        .post(format!("http://{peer}/internal/admin?forwarded=true"))
        .header("content-type", "application/json")
        .body(r#"{"type":"read_index_of_a_later_version"}"#)
        .send()
        .await
        .expect("an answer");
    assert_eq!(r.status(), 400);
    assert!(r.text().await.expect("body").contains("unknown variant"));
    c.shutdown().await;
}
