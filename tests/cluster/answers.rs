//! What clients are told when a node cannot serve: the owner's refusal reaches them unchanged
//! through any node, single and bulk, with `Retry-After` on every 503 and never a 500.
//! Real processes, because kill -9 and restarts are the point.

use std::collections::BTreeMap;
use std::time::Duration;

use serde_json::{json, Value};

use crate::harness::wait_for;
use crate::process::NodeProcess;
use crate::workload::{dishonesty, refusal_of};

const FAST: [&str; 6] = ["--replication", "sync", "--ping-interval", "200ms", "--node-timeout", "1s"];

fn client() -> reqwest::Client {
    reqwest::Client::builder().no_proxy().timeout(Duration::from_secs(15)).build().expect("client")
}

pub(crate) async fn view(http: &reqwest::Client, addr: &str) -> Option<Value> {
    http.get(format!("http://{addr}/v1/cluster")).send().await.ok()?.json().await.ok()
}

/// The member id of the node at `api`.
pub(crate) async fn id_of(http: &reqwest::Client, via: &str, api: &str) -> u64 {
    let v = view(http, via).await.expect("view");
    v["members"].as_array().expect("members").iter().find(|m| m["api_addr"] == api).expect("a member")["id"]
        .as_u64()
        .expect("id")
}

/// `n` keys whose bucket `owner` owns in the map `via` answers.
async fn keys_of(http: &reqwest::Client, via: &str, owner: u64, n: usize) -> Vec<String> {
    let map: Value =
        http.get(format!("http://{via}/v1/cluster/map")).send().await.expect("map").json().await.expect("json");
    let keys: Vec<String> = (0..100_000)
        .map(|i| format!("k{i}"))
        .filter(|k| map["owners"][shoal_raft::bucket_of(k.as_bytes()).0 as usize].as_u64() == Some(owner))
        .take(n)
        .collect();
    assert_eq!(keys.len(), n, "keys of node {owner}");
    keys
}

/// Waits until the node at `addr` sees `members` members, settled, every replica attached.
pub(crate) async fn settled(http: &reqwest::Client, addr: &str, members: usize) {
    wait_for(&format!("{addr} to see {members} settled members"), || async {
        let v = view(http, addr).await?;
        let n = v["members"].as_array()?.len();
        let r = &v["replication"];
        let calm = v["transition"].is_null() && v["transfer"].is_null() && v["leader"].is_u64();
        (n == members && calm && r["attached_buckets"] == r["owned_buckets"]).then_some(())
    })
    .await;
}

/// One refusal as the client saw it: status, code and `Retry-After` seconds.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Seen {
    status: u16,
    code: String,
    retry_after: Option<u64>,
}

/// An error answer as the client saw it; panics if a client could not act on it.
async fn seen_of(r: reqwest::Response, what: &str) -> Seen {
    let status = r.status().as_u16();
    let retry_after = r.headers().get("retry-after").and_then(|v| v.to_str().ok()?.parse().ok());
    let content_type = r.headers().get("content-type").and_then(|v| v.to_str().ok()).map(str::to_string);
    let body = r.bytes().await.expect("body");
    assert_eq!(dishonesty(status, content_type.as_deref(), retry_after.is_some(), &body), None, "{what}");
    let p: Value = serde_json::from_slice(&body).expect("problem");
    Seen { status, code: p["code"].as_str().expect("code").to_string(), retry_after }
}

/// A single PUT of `key` through `via`: `None` when it was acknowledged.
async fn put_one(http: &reqwest::Client, via: &str, key: &str) -> Option<Seen> {
    let r = http.put(format!("http://{via}/v1/kv/{key}")).body("v").send().await.expect("an answer");
    if r.status() == 200 {
        return None;
    }
    Some(seen_of(r, &format!("{key} via {via}")).await)
}

/// A bulk PUT of `keys` through `via`: each key's refusal (`None`: acknowledged). A node
/// that takes no write at all refuses the whole request: that refusal is every key's.
async fn put_bulk(http: &reqwest::Client, via: &str, keys: &[String]) -> Vec<Option<Seen>> {
    let items: Vec<Value> = keys.iter().map(|k| json!({"key": k, "value": "v"})).collect();
    let r =
        http.post(format!("http://{via}/v1/bulk/put")).json(&json!({ "items": items })).send().await.expect("answer");
    if r.status() != 200 {
        let seen = seen_of(r, &format!("bulk via {via}")).await;
        return vec![Some(seen); keys.len()];
    }
    let body: Value = r.json().await.expect("json");
    let results = body["results"].as_array().expect("results");
    assert_eq!(results.len(), keys.len());
    results
        .iter()
        .map(|item| {
            let e = item.get("error").filter(|e| !e.is_null())?;
            Some(Seen {
                status: e["status"].as_u64().expect("status") as u16,
                code: e["code"].as_str().expect("code").to_string(),
                retry_after: e["retry_after"].as_u64(),
            })
        })
        .collect()
}

/// Asserts that every key written through `via`, alone and in a bulk, is refused with `code`,
/// 503 and a `Retry-After`.
async fn assert_refused(http: &reqwest::Client, via: &str, keys: &[String], code: &str) {
    let want = Seen { status: 503, code: code.to_string(), retry_after: Some(1) };
    for key in keys {
        assert_eq!(put_one(http, via, key).await, Some(want.clone()), "{key} via {via}");
    }
    for (key, seen) in keys.iter().zip(put_bulk(http, via, keys).await) {
        assert_eq!(seen, Some(want.clone()), "{key} in a bulk via {via}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refusals_reach_the_client_unchanged_through_any_node_single_and_bulk() {
    let dir = tempfile::tempdir().expect("temp dir");
    let http = client();
    // Five members, joined in order: b holds a's replica, c b's, d c's, e d's, a e's. a, b
    // and c vote; failing a member takes reports from a majority of the five.
    let a = NodeProcess::start_with(&dir.path().join("a"), &FAST);
    let seed = a.addr.clone();
    let join = [&FAST[..], &["--join", &seed]].concat();
    let mut nodes = vec![a];
    for (i, name) in ["b", "c", "d", "e"].iter().enumerate() {
        nodes.push(NodeProcess::start_with(&dir.path().join(name), &join));
        settled(&http, &nodes[0].addr, i + 2).await;
    }
    let addrs: Vec<String> = nodes.iter().map(|n| n.addr.clone()).collect();
    let mut ids = Vec::new();
    for addr in &addrs {
        ids.push(id_of(&http, &addrs[0], addr).await);
    }

    // A restart of b: what a forwarder tells about b's keys meanwhile (node_draining,
    // starting, owner_unreachable, bucket_restoring, ...) is honest, and b serves again.
    let b_keys = keys_of(&http, &addrs[0], ids[1], 4).await;
    let seen = {
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let prober = tokio::spawn(probe(http.clone(), addrs[0].clone(), b_keys.clone(), stop.clone()));
        tokio::task::block_in_place(|| {
            nodes[1].stop();
            nodes[1].restart();
        });
        settled(&http, &addrs[0], 5).await;
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        prober.await.expect("prober")
    };
    eprintln!("through a during b's restart: {seen:?}");
    assert!(seen.keys().all(|what| !what.starts_with("dishonest")), "{seen:?}");
    // c may not have heard b's first pongs yet when a has settled: until then it says
    // honestly that b does not answer (503, retry), and then b serves through it.
    for key in &b_keys {
        wait_for(&format!("b to serve {key} through c"), || async {
            match put_one(&http, &addrs[2], key).await {
                None => Some(()),
                Some(seen) => {
                    assert!(seen.status == 503 && seen.retry_after.is_some(), "{key} through c: {seen:?}");
                    None
                }
            }
        })
        .await;
    }

    // c and d die together: c's buckets have no copy left. Every node says bucket_lost for
    // them, alone and in a bulk, whoever is asked (a, b and e report: a majority of five).
    let c_keys = keys_of(&http, &addrs[0], ids[2], 4).await;
    tokio::task::block_in_place(|| {
        nodes[2].kill9();
        nodes[3].kill9();
    });
    wait_for("c and d failed", || async {
        let v = view(&http, &addrs[0]).await?;
        let failed: Vec<u64> = v["failed"].as_array()?.iter().filter_map(Value::as_u64).collect();
        (failed.contains(&ids[2]) && failed.contains(&ids[3])).then_some(())
    })
    .await;
    wait_for("c's buckets lost", || async {
        let v = view(&http, &addrs[0]).await?;
        (!v["lost_buckets"].as_array()?.is_empty()).then_some(())
    })
    .await;
    for via in [&addrs[0], &addrs[1], &addrs[4]] {
        assert_refused(&http, via, &c_keys, "bucket_lost").await;
    }

    // b and e die too: a hears one member of three, so it acknowledges nothing: its own keys
    // are no_quorum, and so are b's (a refuses before it would find b unreachable).
    let a_keys = keys_of(&http, &addrs[0], ids[0], 4).await;
    let b_keys = keys_of(&http, &addrs[0], ids[1], 4).await;
    tokio::task::block_in_place(|| {
        nodes[1].kill9();
        nodes[4].kill9();
    });
    wait_for("a without a quorum", || async {
        (put_one(&http, &addrs[0], &a_keys[0]).await?.code == "no_quorum").then_some(())
    })
    .await;
    assert_refused(&http, &addrs[0], &a_keys, "no_quorum").await;
    assert_refused(&http, &addrs[0], &b_keys, "no_quorum").await;

    for node in &mut nodes {
        node.kill9();
    }
}

/// Writes `keys` through `via`, one at a time and in bulks, until `stop`; counts refusals by
/// status and code (`dishonest ...` for any a client cannot act on).
async fn probe(
    http: reqwest::Client,
    via: String,
    keys: Vec<String>,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
) -> BTreeMap<String, u64> {
    let mut seen = BTreeMap::new();
    for _ in 0..100_000 {
        if stop.load(std::sync::atomic::Ordering::Relaxed) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
        for key in &keys {
            match http.put(format!("http://{via}/v1/kv/{key}")).body("v").send().await {
                Ok(r) if r.status() == 200 => {}
                Ok(r) => {
                    let (what, dishonest) = refusal_of(r).await;
                    *seen.entry(dishonest.map(|d| format!("dishonest {d}")).unwrap_or(what)).or_default() += 1;
                }
                Err(e) => *seen.entry(format!("no answer: {e}")).or_default() += 1,
            }
        }
        let items: Vec<Value> = keys.iter().map(|k| json!({"key": k, "value": "v"})).collect();
        if let Ok(r) = http.post(format!("http://{via}/v1/bulk/put")).json(&json!({ "items": items })).send().await {
            if r.status() != 200 {
                let (what, dishonest) = refusal_of(r).await;
                *seen
                    .entry(dishonest.map(|d| format!("dishonest bulk {d}")).unwrap_or(format!("bulk {what}")))
                    .or_default() += 1;
                continue;
            }
            let body: Value = r.json().await.unwrap_or_default();
            for e in body["results"].as_array().into_iter().flatten().filter_map(|i| i.get("error")) {
                let honest = e["status"] != 500 && (e["status"] != 503 || e["retry_after"].is_u64());
                let what = format!("bulk {} {}", e["status"], e["code"].as_str().unwrap_or_default());
                *seen.entry(if honest { what } else { format!("dishonest {what}") }).or_default() += 1;
            }
        }
    }
    seen
}

/// A node that is still joining answers on both of its ports at once: 503, not a member yet.
/// A member that still takes the address for the node it knew there (its Raft leader, when
/// that node was failed and now rejoins as a new member) turns to another member instead of
/// waiting for its timeout; a bound port that accepts nothing held such a join for 35 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_still_joining_answers_on_both_ports_at_once() {
    let dir = tempfile::tempdir().expect("temp dir");
    // Nothing listens at the seed: the node keeps trying to join.
    let seed = format!("127.0.0.1:{}", crate::process::free_port());
    let (api, peer) = (crate::process::free_port(), crate::process::free_port());
    let mut node = NodeProcess::launch(&dir.path().join("n"), (api, peer), &["--join", &seed], &[]);
    let http = reqwest::Client::builder().no_proxy().timeout(Duration::from_secs(5)).build().expect("client");
    let livez = format!("http://127.0.0.1:{api}/livez");
    wait_for("the starting node's /livez", || async {
        http.get(&livez).send().await.ok().filter(|r| r.status() == 200)
    })
    .await;
    for (port, path) in [(api, "/v1/cluster"), (peer, "/internal/admin")] {
        let answer = http
            .post(format!("http://127.0.0.1:{port}{path}"))
            .body("{}")
            .send()
            .await
            .unwrap_or_else(|e| panic!("no answer from port {port} within 5 s: {e}\n{}", node.log()));
        assert_eq!(answer.status(), 503, "port {port}");
        let problem: Value = answer.json().await.expect("problem+json");
        assert_eq!(problem["code"], "not_member", "port {port}: {problem}");
    }
    // The first failed attempt may be logged a moment after the node answers.
    let log = &node;
    wait_for("the node's log of a failed join attempt", || async move {
        log.log().contains("join attempt failed").then_some(())
    })
    .await;
    node.stop();
}
