//! A StatefulSet on loopback: three `shoal serve` processes started at once with
//! `POD_NAME=shoal-0..2`, `--discover` listing their API addresses (standing in for the
//! headless Service's A records), a cluster secret and an admin token.

use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::process::{client, free_port, NodeProcess};

const SECRET: &str = "s3cret-for-the-test";
const TOKEN: &str = "admin-token-for-the-test";

/// `GET http://addr/path` as JSON, blocking (these tests drive processes, not a runtime).
fn get_json(addr: &str, path: &str) -> Option<Value> {
    let out = Command::new("curl").args(["-sf", "--max-time", "5", &format!("http://{addr}{path}")]).output().ok()?;
    serde_json::from_slice(&out.stdout).ok()
}

/// The HTTP status of a request to `url` with extra curl arguments.
fn status_of(method: &str, url: &str, extra: &[&str]) -> u16 {
    let out = Command::new("curl")
        .args(["-s", "-o", "/dev/null", "-w", "%{http_code}", "--max-time", "5", "-X", method])
        .args(extra)
        .arg(url)
        .output()
        .expect("curl");
    String::from_utf8_lossy(&out.stdout).parse().unwrap_or(0)
}

/// Polls `probe` every 200 ms until it gives a value, at most `secs` seconds.
fn poll<T>(what: &str, secs: u64, mut probe: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + Duration::from_secs(secs);
    loop {
        if let Some(v) = probe() {
            return v;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// A metric's value in a node's `/metrics`.
fn metric(addr: &str, name: &str) -> f64 {
    let out = Command::new("curl").args(["-sf", "--max-time", "5", &format!("http://{addr}/metrics")]).output();
    let text = String::from_utf8_lossy(&out.expect("curl").stdout).into_owned();
    text.lines()
        .find_map(|l| l.strip_prefix(name).and_then(|rest| rest.strip_prefix(' ')))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("{name} not in /metrics of {addr}"))
}

/// Settled: `n` members, no transition or transfer, every member owning its share.
fn settled(view: &Value, n: usize) -> bool {
    let members = view["members"].as_array().map(Vec::as_slice).unwrap_or_default();
    members.len() == n
        && view["transition"].is_null()
        && view["transfer"].is_null()
        && members.iter().all(|m| m["buckets"].as_u64().unwrap_or(0) >= (1000 / n) as u64)
}

#[test]
fn a_statefulset_forms_one_cluster_in_ordinal_order_drains_on_sigterm_and_scales_down_by_leave() {
    let dir = tempfile::tempdir().expect("temp dir");
    let ports: Vec<(u16, u16)> = (0..3).map(|_| (free_port(), free_port())).collect();
    let discover = ports.iter().map(|(api, _)| format!("127.0.0.1:{api}")).collect::<Vec<_>>().join(",");
    let pods: Vec<String> = (0..3).map(|k| format!("shoal-{k}")).collect();
    // A node timeout well above a restart on busy cores: shoal-2 must come back as itself.
    let flags =
        ["--discover", &discover, "--ping-interval", "300ms", "--node-timeout", "60s", "--drain-timeout", "20s"];
    // All three at once, as `podManagementPolicy: Parallel` starts them, in reverse order.
    let mut nodes: Vec<NodeProcess> = (0..3)
        .rev()
        .map(|k| {
            let envs = [("POD_NAME", pods[k].as_str()), ("SHOAL_CLUSTER_SECRET", SECRET), ("SHOAL_ADMIN_TOKEN", TOKEN)];
            NodeProcess::launch(&dir.path().join(&pods[k]), ports[k], &flags, &envs)
        })
        .collect();
    nodes.reverse();
    let addrs: Vec<String> = nodes.iter().map(|n| n.addr.clone()).collect();
    let view = poll("three members, settled", 120, || get_json(&addrs[0], "/v1/cluster").filter(|v| settled(v, 3)));
    let mut members: Vec<&Value> = view["members"].as_array().expect("members").iter().collect();
    members.sort_by_key(|m| m["join_seq"].as_u64());
    let order: Vec<&str> = members.iter().map(|m| m["name"].as_str().unwrap_or("-")).collect();
    assert_eq!(order, ["shoal-0", "shoal-1", "shoal-2"], "join order follows the ordinals");
    let id_of_2 = members[2]["id"].as_u64().expect("id");

    // The peer listener: no secret or a wrong one gets 401 and changes nothing.
    let peer0 = format!("127.0.0.1:{}", ports[0].1);
    let map_version = view["map_version"].clone();
    assert!(metric(&addrs[0], "shoal_raft_commit_index") > 0.0);
    let endpoints = [
        ("POST", "/raft/append"),
        ("POST", "/raft/vote"),
        ("POST", "/raft/snapshot"),
        ("POST", "/internal/admin"),
        ("GET", "/internal/members/1"),
        ("GET", "/internal/transfer/7?to=1&epoch=0"),
        ("GET", "/internal/link"),
    ];
    let register = r#"{"type":"register","api_addr":"127.0.0.1:1","peer_addr":"127.0.0.1:2"}"#;
    for (method, path) in endpoints {
        let url = format!("http://{peer0}{path}");
        let body = ["-H", "content-type: application/json", "-d", register];
        assert_eq!(status_of(method, &url, &body), 401, "{method} {path} without the secret");
        let wrong = ["-H", "x-shoal-cluster-secret: not-it", "-H", "content-type: application/json", "-d", register];
        assert_eq!(status_of(method, &url, &wrong), 401, "{method} {path} with a wrong secret");
    }
    let right = format!("x-shoal-cluster-secret: {SECRET}");
    assert_eq!(status_of("GET", &format!("http://{peer0}/internal/members/1"), &["-H", &right]), 200);
    // Nothing changed: the register request above was never applied (id 4 is unknown), the
    // map and the members are as they were.
    let status = Command::new("curl")
        .args(["-sf", "--max-time", "5", "-H", &right, &format!("http://{peer0}/internal/members/4")])
        .output()
        .expect("curl");
    let status = String::from_utf8_lossy(&status.stdout).to_lowercase();
    assert!(status.contains("unknown"), "id 4 was never registered: {status}");
    let after = get_json(&addrs[0], "/v1/cluster").expect("view");
    assert_eq!(after["map_version"], map_version);
    assert_eq!(after["members"].as_array().map(Vec::len), Some(3));

    // Writes, then SIGTERM of shoal-2: it goes into maintenance, drains and exits 0; back as
    // the same member.
    let keys: Vec<String> = (0..300).map(|i| format!("sts{i}")).collect();
    for k in &keys {
        let put = client(&addrs[0], &["put", k, &format!("v-{k}")]);
        assert!(put.status.success(), "{}", String::from_utf8_lossy(&put.stderr));
    }
    let status = nodes[2].stop();
    assert!(status.success(), "exit status after SIGTERM: {status}");
    assert!(nodes[2].log().contains("drained"), "{}", nodes[2].log());
    nodes[2].restart();
    let back = poll("shoal-2 back as the same member", 60, || {
        let v = get_json(&addrs[2], "/v1/cluster")?;
        (v["node_id"].as_u64() == Some(id_of_2)).then_some(v)
    });
    assert_eq!(back["members"].as_array().map(Vec::len), Some(3));
    for k in &keys {
        let value = poll(&format!("{k} readable after the restart"), 60, || {
            let out = client(&addrs[2], &["get", k]);
            let err = String::from_utf8_lossy(&out.stderr).into_owned();
            match out.status.code() {
                Some(0) => Some(Some(String::from_utf8_lossy(&out.stdout).into_owned())),
                _ if err.contains("not_found") => Some(None),
                _ => None, // bucket_restoring meanwhile
            }
        });
        assert_eq!(value, Some(format!("v-{k}")), "{k} after shoal-2's restart");
    }

    // SIGTERM put it into maintenance: it took its buckets back, and the maintenance is over.
    assert!(nodes[2].log().contains("in maintenance"), "{}", nodes[2].log());
    poll("shoal-2's maintenance over", 60, || {
        get_json(&addrs[0], "/v1/cluster").filter(|v| settled(v, 3) && v["maintenance"].is_null())
    });

    // Scale down: leave first (the admin token is required), then the pod stops.
    let refused = Command::new(env!("CARGO_BIN_EXE_shoal"))
        .args(["node", "leave", "shoal-2", "--addr", &addrs[0]])
        .env_remove("SHOAL_ADMIN_TOKEN")
        .output()
        .expect("run");
    assert!(!refused.status.success());
    assert!(String::from_utf8_lossy(&refused.stderr).contains("admin_token_required"));
    let left = Command::new(env!("CARGO_BIN_EXE_shoal"))
        .args(["node", "leave", "shoal-2", "--addr", &addrs[0]])
        .env("SHOAL_ADMIN_TOKEN", TOKEN)
        .output()
        .expect("run");
    assert!(left.status.success(), "{}", String::from_utf8_lossy(&left.stderr));
    let view = poll("two members, 500/500", 120, || get_json(&addrs[0], "/v1/cluster").filter(|v| settled(v, 2)));
    let counts: Vec<u64> =
        view["members"].as_array().expect("members").iter().map(|m| m["buckets"].as_u64().unwrap_or(0)).collect();
    assert_eq!(counts, [500, 500]);
    let status = nodes[2].wait_exit(Duration::from_secs(30));
    assert!(status.success(), "the node that left stops by itself: {status}");
    for k in &keys {
        let out = client(&addrs[1], &["get", k]);
        assert_eq!(String::from_utf8_lossy(&out.stdout), format!("v-{k}"), "{k} after the leave");
    }
    for node in &mut nodes[..2] {
        assert!(node.stop().success());
    }
}
