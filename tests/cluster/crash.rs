//! Crashes during state transfer, with real processes: kill -9 and restart.

use std::time::Duration;

use serde_json::Value;

use crate::harness::wait_for;
use crate::process::NodeProcess;
use crate::workload::{check_addr, Workload};

async fn json(http: &reqwest::Client, addr: &str, path: &str) -> Option<Value> {
    http.get(format!("http://{addr}{path}")).send().await.ok()?.json().await.ok()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_joiner_killed_mid_transfer_restarts_converges_and_loses_nothing() {
    let dir = tempfile::tempdir().expect("temp dir");
    let http = reqwest::Client::builder().no_proxy().timeout(Duration::from_secs(10)).build().expect("client");
    // Slow transfers, so that the kill lands in the middle of one.
    let slow = ["--transfer-rate", "200KB"];
    let first = NodeProcess::start_with(&dir.path().join("a"), &slow);
    let seed = first.addr.clone();
    // Data in every bucket, then writers that keep going through the whole test.
    let status = std::process::Command::new(env!("CARGO_BIN_EXE_shoal"))
        .args(["bench", "--addr", &seed, "--keys", "20000", "--value-size", "200", "--duration", "0s"])
        .stdout(std::process::Stdio::null())
        .status()
        .expect("fill");
    assert!(status.success());
    let w = Workload::start(vec![seed.clone()], 3);

    let mut joiner = NodeProcess::start_with(&dir.path().join("b"), &[&slow[..], &["--join", &seed]].concat());
    w.set_targets(vec![seed.clone(), joiner.addr.clone()]);
    wait_for("the joiner to have taken some buckets", || async {
        let t = json(&http, &seed, "/v1/cluster/transfer").await?;
        let done = t["nodes"].as_array()?.iter().filter_map(|n| n["buckets_done"].as_u64()).max()?;
        (done >= 50).then_some(())
    })
    .await;
    joiner.kill9();
    tokio::time::sleep(Duration::from_millis(500)).await;
    joiner.restart();

    wait_for("the transfer to finish after the restart", || async {
        let v = json(&http, &seed, "/v1/cluster").await?;
        let counts: Vec<u64> = v["members"].as_array()?.iter().filter_map(|m| m["buckets"].as_u64()).collect();
        (v["transition"].is_null() && v["transfer"].is_null() && counts == [500, 500]).then_some(())
    })
    .await;
    let history = w.pause().await;
    for addr in [&seed, &joiner.addr] {
        let problems = check_addr(&http, addr, &history).await;
        if !problems.is_empty() {
            for log in ["a.log", "b.log"] {
                let _ = std::fs::copy(dir.path().join(log), std::env::temp_dir().join(format!("shoal-crash-{log}")));
                let text = std::fs::read_to_string(dir.path().join(log)).unwrap_or_default();
                let tail: Vec<&str> = text.lines().filter(|l| !l.contains("DEBUG")).rev().take(25).collect();
                eprintln!("--- {log} (last lines)\n{}", tail.into_iter().rev().collect::<Vec<_>>().join("\n"));
            }
        }
        assert!(
            problems.is_empty(),
            "via {addr}: {} problems, e.g. {:?}",
            problems.len(),
            &problems[..problems.len().min(5)]
        );
    }
    let acked = history.values().filter(|h| h.acked.is_some()).count();
    assert!(acked > 100, "the writers got {acked} keys acknowledged");
    w.stop().await;
}
