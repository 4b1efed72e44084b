//! `TestCluster`: starts, grows, shrinks and restarts in-process nodes; polls conditions
//! with deadlines instead of sleeping.

use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use serde_json::Value;
use shoal::config::ServeConfig;
use shoal::node::{self, Listeners, NodeHandle};
use tempfile::TempDir;
use tokio::net::TcpListener;

/// How long any condition may take to become true on two busy cores.
pub const DEADLINE: Duration = Duration::from_secs(60);

/// Polls `condition` until it returns `Some`, or panics with `what` after [`DEADLINE`].
pub async fn wait_for<T, F, Fut>(what: &str, mut condition: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let deadline = tokio::time::Instant::now() + DEADLINE;
    loop {
        if let Some(v) = condition().await {
            return v;
        }
        assert!(tokio::time::Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// One node slot: its addresses and data dir survive restarts.
struct Slot {
    config: ServeConfig,
    node: Option<NodeHandle>,
}

/// A cluster of in-process nodes.
pub struct TestCluster {
    _dir: TempDir,
    root: PathBuf,
    slots: Vec<Slot>,
    pub http: reqwest::Client,
    /// `http`, or `https` once [`Self::use_tls`] was called.
    scheme: &'static str,
    /// Applied to the configuration of every node this cluster starts.
    tweak: fn(&mut ServeConfig),
}

async fn bind(addr: SocketAddr) -> TcpListener {
    for _ in 0..50 {
        if let Ok(l) = TcpListener::bind(addr).await {
            return l;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("cannot bind {addr}");
}

impl TestCluster {
    /// A cluster of `n` nodes, joined one after the other (join order = slot order).
    pub async fn start(n: usize) -> Self {
        Self::start_with(n, |_| {}).await
    }

    /// A cluster of `n` nodes whose configuration `tweak` adjusts.
    pub async fn start_with(n: usize, tweak: fn(&mut ServeConfig)) -> Self {
        if std::env::var_os("RUST_LOG").is_some() {
            let _ = tracing_subscriber::fmt()
                .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
                .with_test_writer()
                .try_init();
        }
        let dir = tempfile::tempdir().expect("temp dir");
        let http = reqwest::Client::builder().no_proxy().timeout(Duration::from_secs(30)).build().expect("client");
        let mut cluster =
            TestCluster { root: dir.path().to_path_buf(), _dir: dir, slots: Vec::new(), http, scheme: "http", tweak };
        for _ in 0..n {
            cluster.add_node().await;
        }
        cluster
    }

    /// Starts a new node that joins through the first running node, and waits until the
    /// buckets it gets have moved; returns its slot.
    pub async fn add_node(&mut self) -> usize {
        let slot = self.add_node_no_wait().await;
        self.wait_settled().await;
        slot
    }

    /// Waits until no transition or state transfer is running, as every node sees it.
    pub async fn wait_settled(&self) {
        let slots: Vec<usize> = self.running().collect();
        wait_for("the cluster to settle", || async {
            for &s in &slots {
                let view = self.json(s, "/v1/cluster").await;
                if !view["transition"].is_null() || !view["transfer"].is_null() {
                    return None;
                }
            }
            Some(())
        })
        .await;
    }

    /// Waits until every running node owns buckets and has every one attached to its replica.
    pub async fn wait_all_attached(&self) {
        wait_for("every bucket attached to its replica", || async {
            for s in self.running() {
                let r = &self.json(s, "/v1/cluster").await["replication"];
                if r["attached_buckets"] != r["owned_buckets"] || r["owned_buckets"] == 0 {
                    return None;
                }
            }
            Some(())
        })
        .await;
    }

    /// Waits until every member's replica is held where join order places it (`replica_on` in
    /// the map), as the event log tells: the last `replica_moved` of each member names that
    /// holder. Until then a member's complete replica may still be at its previous holder,
    /// which is the one that inherits and serves mirror reads.
    pub async fn wait_replicas_placed(&self) {
        let slot = self.running().next().expect("a running node");
        wait_for("every replica at the holder join order names", || async {
            let map = self.json(slot, "/v1/cluster/map").await;
            let events = self.json(slot, "/v1/cluster/events?limit=100000").await;
            let events = events["events"].as_array()?;
            for node in map["nodes"].as_array()? {
                let last = events.iter().rev().find(|e| e["type"] == "replica_moved" && e["node"] == node["id"])?;
                if last["peer"] != node["replica_on"] {
                    return None;
                }
            }
            Some(())
        })
        .await;
    }

    /// Starts a new node that joins through the first running node; returns its slot as soon
    /// as it is a member (its buckets may still be moving).
    pub async fn add_node_no_wait(&mut self) -> usize {
        self.add_node_configured(|_| {}).await
    }

    /// Speaks HTTPS to the nodes from now on, trusting the CA certificate `ca_pem` only (the
    /// nodes added next run with TLS).
    pub fn use_tls(&mut self, ca_pem: &[u8]) {
        let ca = reqwest::Certificate::from_pem(ca_pem).expect("CA certificate");
        self.http = reqwest::Client::builder()
            .no_proxy()
            .timeout(Duration::from_secs(30))
            .tls_built_in_root_certs(false)
            .add_root_certificate(ca)
            .build()
            .expect("client");
        self.scheme = "https";
    }

    /// [`Self::add_node_no_wait`], with `extra` adjusting this node's configuration last.
    pub async fn add_node_configured(&mut self, extra: impl FnOnce(&mut ServeConfig)) -> usize {
        self.try_add_node_configured(extra).await.expect("node starts")
    }

    /// [`Self::add_node_configured`], answering why the node did not start instead of
    /// panicking.
    pub async fn try_add_node_configured(
        &mut self,
        extra: impl FnOnce(&mut ServeConfig),
    ) -> Result<usize, node::StartError> {
        let slot = self.slots.len();
        // Ports below the kernel's ephemeral range: a node restarted on its ports finds them
        // free (one the kernel handed out could meanwhile be the local port of another node's
        // connection, which connection retries make likelier).
        let port = || format!("127.0.0.1:{}", crate::process::free_port()).parse().expect("addr");
        let api = bind(port()).await;
        let peer = bind(port()).await;
        let mut config = ServeConfig::for_test(
            api.local_addr().expect("addr"),
            peer.local_addr().expect("addr"),
            self.root.join(format!("node{slot}")),
        );
        config.raft_heartbeat = Some(Duration::from_millis(150));
        config.raft_election_timeout = Some(Duration::from_millis(1000));
        config.max_value_bytes = 1024 * 1024;
        (self.tweak)(&mut config);
        extra(&mut config);
        // Every running node is a seed: the first may be on its way out (it left).
        config.join = self.running().map(|seed| self.api(seed)).collect();
        let node = node::start_with(config.clone(), Listeners { api, peer }).await?;
        self.slots.push(Slot { config, node: Some(node) });
        Ok(slot)
    }

    /// The slots whose node runs.
    pub fn running(&self) -> impl Iterator<Item = usize> + '_ {
        self.slots.iter().enumerate().filter(|(_, s)| s.node.is_some()).map(|(i, _)| i)
    }

    /// The node in `slot`.
    pub fn node(&self, slot: usize) -> &NodeHandle {
        self.slots[slot].node.as_ref().expect("node is running")
    }

    /// The API address (`host:port`) of `slot`.
    pub fn api(&self, slot: usize) -> String {
        self.slots[slot].config.listen.to_string()
    }

    /// The node id in `slot`.
    pub fn id(&self, slot: usize) -> u64 {
        self.node(slot).node_id()
    }

    /// `http://<api of slot><path>` (`https://` once [`Self::use_tls`] was called).
    pub fn url(&self, slot: usize, path: &str) -> String {
        format!("{}://{}{}", self.scheme, self.api(slot), path)
    }

    /// Stops the node in `slot` gracefully (its data dir stays).
    pub async fn stop(&mut self, slot: usize) {
        if let Some(node) = self.slots[slot].node.take() {
            node.shutdown().await;
        }
    }

    /// Waits until the node in `slot` stops by itself (after leaving), then releases it.
    pub async fn wait_stopped(&mut self, slot: usize) {
        let node = self.slots[slot].node.take().expect("running");
        tokio::time::timeout(DEADLINE, node.stopped()).await.expect("node stops by itself");
        node.shutdown().await;
    }

    /// Starts the node of `slot` again on its data dir and addresses.
    pub async fn restart(&mut self, slot: usize) -> Result<(), node::StartError> {
        self.stop(slot).await;
        let config = self.slots[slot].config.clone();
        let api = bind(config.listen).await;
        let peer = bind(config.peer_listen.expect("set")).await;
        let node = node::start_with(config, Listeners { api, peer }).await?;
        self.slots[slot].node = Some(node);
        Ok(())
    }

    /// GET a JSON document from `slot`.
    pub async fn json(&self, slot: usize, path: &str) -> Value {
        let r = self.http.get(self.url(slot, path)).send().await.expect("request");
        assert!(r.status().is_success(), "GET {path} on slot {slot}: {}", r.status());
        r.json().await.expect("json")
    }

    /// POST a JSON body to `slot` and read the JSON answer.
    pub async fn post_json(&self, slot: usize, path: &str, body: &Value) -> Value {
        let r = self.http.post(self.url(slot, path)).json(body).send().await.expect("request");
        r.json().await.expect("json")
    }

    /// The Raft leader (as slot 0 sees it, once it knows one) and its slot.
    pub async fn leader(&self) -> (u64, usize) {
        let leader = wait_for("a leader", || async { self.json(0, "/v1/cluster").await["leader"].as_u64() }).await;
        (leader, self.running().find(|&s| self.id(s) == leader).expect("the leader's slot"))
    }

    /// The bucket counts of the map as `slot` sees it, sorted, with the map version.
    pub async fn counts(&self, slot: usize) -> (u64, Vec<usize>) {
        let map = self.json(slot, "/v1/cluster/map").await;
        let owners = map["owners"].as_array().expect("owners");
        assert_eq!(owners.len(), 1000);
        let mut counts = std::collections::BTreeMap::<u64, usize>::new();
        for o in owners {
            *counts.entry(o.as_u64().expect("id")).or_default() += 1;
        }
        let mut c: Vec<usize> = counts.into_values().collect();
        c.sort();
        (map["version"].as_u64().expect("version"), c)
    }

    /// Waits until every running node has applied the same map with these sorted counts.
    pub async fn wait_for_counts(&self, expected: &[usize]) -> u64 {
        let slots: Vec<usize> = self.running().collect();
        self.wait_for_counts_among(expected, &slots).await
    }

    /// Like [`Self::wait_for_counts`], asking only the nodes in `slots`.
    pub async fn wait_for_counts_among(&self, expected: &[usize], slots: &[usize]) -> u64 {
        let deadline = tokio::time::Instant::now() + DEADLINE;
        loop {
            let mut seen = Vec::new();
            for &s in slots {
                seen.push(self.counts(s).await);
            }
            let versions: Vec<u64> = seen.iter().map(|(v, _)| *v).collect();
            if seen.iter().all(|(_, c)| c == expected) && versions.windows(2).all(|w| w[0] == w[1]) {
                return versions[0];
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "timed out waiting for every node to see counts {expected:?}; (map version, counts) seen: {seen:?}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// PUT `value` at `key` through `slot`; returns the status.
    pub async fn put(&self, slot: usize, key: &str, value: &str) -> reqwest::StatusCode {
        self.http
            .put(self.url(slot, &format!("/v1/kv/{key}")))
            .body(value.to_string())
            .send()
            .await
            .expect("put")
            .status()
    }

    /// GET `key` through `slot`: the value, or None on 404.
    pub async fn get(&self, slot: usize, key: &str) -> Option<String> {
        let r = self.http.get(self.url(slot, &format!("/v1/kv/{key}"))).send().await.expect("get");
        match r.status().as_u16() {
            200 => Some(r.text().await.expect("body")),
            404 => None,
            s => panic!("GET {key} through slot {slot}: {s} {}", r.text().await.unwrap_or_default()),
        }
    }

    /// Stops every node.
    pub async fn shutdown(mut self) {
        for slot in 0..self.slots.len() {
            self.stop(slot).await;
        }
    }
}
