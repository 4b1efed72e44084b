//! Membership: the map as nodes join, replica placement, voters and learners, leaving.

use serde_json::Value;

use crate::harness::{wait_for, TestCluster};

fn members(view: &Value) -> Vec<Value> {
    view["members"].as_array().expect("members").clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn map_splits_1000_then_500_500_then_333_333_334_as_nodes_join() {
    let mut c = TestCluster::start(1).await;
    let v1 = c.wait_for_counts(&[1000]).await;
    c.add_node().await;
    let v2 = c.wait_for_counts(&[500, 500]).await;
    c.add_node().await;
    let v3 = c.wait_for_counts(&[333, 333, 334]).await;
    assert!(v1 < v2 && v2 < v3, "every change bumps the version: {v1} {v2} {v3}");
    // Node ids are assigned in join order and never reused.
    assert_eq!((c.id(0), c.id(1), c.id(2)), (1, 2, 3));
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replica_on_follows_join_order_and_wraps_to_the_first() {
    let c = TestCluster::start(3).await;
    for slot in 0..3 {
        let view = c.json(slot, "/v1/cluster").await;
        let placement: Vec<(u64, u64)> = members(&view)
            .iter()
            .map(|m| (m["id"].as_u64().expect("id"), m["replica_on"].as_u64().expect("replica")))
            .collect();
        assert_eq!(placement, vec![(1, 2), (2, 3), (3, 1)], "as seen by slot {slot}");
        let map = c.json(slot, "/v1/cluster/map").await;
        assert_eq!(map["nodes"][2]["replica_on"], 1);
        assert_eq!(map["nodes"][0]["api_addr"], c.api(0));
    }
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_six_node_cluster_has_three_voters_and_keeps_a_quorum_when_a_voter_leaves() {
    let mut c = TestCluster::start(6).await;
    let roles = |view: Value| -> Vec<(u64, String)> {
        members(&view)
            .iter()
            .map(|m| (m["id"].as_u64().expect("id"), m["role"].as_str().expect("role").into()))
            .collect()
    };
    let expected: Vec<(u64, String)> =
        (1..=6).map(|id| (id, if id <= 3 { "voter" } else { "learner" }.to_string())).collect();
    wait_for("3 voters and 3 learners", || async { (roles(c.json(5, "/v1/cluster").await) == expected).then_some(()) })
        .await;
    c.wait_for_counts(&[166, 166, 167, 167, 167, 167]).await;

    // Voter 2 leaves: the oldest learner (4) is promoted, and the cluster still commits.
    let r = c.http.post(c.url(3, "/v1/cluster/nodes/2/leave")).send().await.expect("leave");
    assert_eq!(r.status(), 200, "{}", r.text().await.unwrap_or_default());
    c.wait_stopped(1).await;
    let expected: Vec<(u64, String)> =
        [1, 3, 4, 5, 6].into_iter().map(|id| (id, if id <= 4 { "voter" } else { "learner" }.to_string())).collect();
    wait_for("voter 4 to replace voter 2", || async {
        (roles(c.json(0, "/v1/cluster").await) == expected).then_some(())
    })
    .await;
    c.wait_for_counts(&[200, 200, 200, 200, 200]).await;
    assert_eq!(c.put(4, "after-leave", "v").await, 200);
    assert_eq!(c.get(0, "after-leave").await.as_deref(), Some("v"));
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leaving_errors_are_clear() {
    let mut c = TestCluster::start(2).await;
    let status = |r: reqwest::Response| async move {
        let s = r.status().as_u16();
        (s, r.json::<Value>().await.expect("problem")["code"].as_str().unwrap_or_default().to_string())
    };
    let r = c.http.post(c.url(0, "/v1/cluster/nodes/9/leave")).send().await.expect("leave");
    assert_eq!(status(r).await, (404, "unknown_resource".to_string()));
    let r = c.http.post(c.url(0, "/v1/cluster/nodes/x/leave")).send().await.expect("leave");
    assert_eq!(status(r).await.0, 400);
    // The leader can leave too; the other node takes over everything.
    let r = c.http.post(c.url(1, "/v1/cluster/nodes/1/leave")).send().await.expect("leave");
    assert_eq!(r.status(), 200);
    c.wait_stopped(0).await;
    c.wait_for_counts(&[1000]).await;
    let r = c.http.post(c.url(1, "/v1/cluster/nodes/2/leave")).send().await.expect("leave");
    assert_eq!(status(r).await, (409, "conflict".to_string()), "the last member cannot leave");
    c.shutdown().await;
}
