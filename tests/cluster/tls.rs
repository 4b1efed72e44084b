//! TLS: a cluster whose nodes run with `--tls-cert`, `--tls-key` and `--tls-ca` from a CA made
//! here serves HTTPS on both listeners, its members talk HTTPS to each other (they join,
//! replicate and forward), and clients that trust the CA reach it while plain HTTP and other
//! CAs do not; a node whose certificate and trust come from another CA cannot join.

use std::path::{Path, PathBuf};
use std::time::Duration;

use shoal::client::Client;
use shoal::config::ServeConfig;

use crate::harness::TestCluster;
use crate::process::{client_with_env, NodeProcess};

/// A throwaway certificate authority.
pub struct Ca {
    issuer: rcgen::Issuer<'static, rcgen::KeyPair>,
    /// Its certificate, PEM.
    pub pem: String,
}

impl Ca {
    pub fn new(name: &str) -> Self {
        let key = rcgen::KeyPair::generate().expect("key");
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).expect("params");
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        params.distinguished_name.push(rcgen::DnType::CommonName, name);
        let cert = params.self_signed(&key).expect("CA certificate");
        Ca { issuer: rcgen::Issuer::new(params, key), pem: cert.pem() }
    }

    /// Writes a certificate for 127.0.0.1 and localhost and its key into `dir`, and this CA's
    /// certificate beside them: the three files a node runs with.
    pub fn node_files(&self, dir: &Path, name: &str) -> TlsFiles {
        let key = rcgen::KeyPair::generate().expect("key");
        let params =
            rcgen::CertificateParams::new(vec!["127.0.0.1".to_string(), "localhost".to_string()]).expect("params");
        let cert = params.signed_by(&key, &self.issuer).expect("certificate");
        let files = TlsFiles {
            cert: dir.join(format!("{name}.crt")),
            key: dir.join(format!("{name}.key")),
            ca: dir.join(format!("{name}-ca.crt")),
        };
        std::fs::write(&files.cert, cert.pem()).expect("write");
        std::fs::write(&files.key, key.serialize_pem()).expect("write");
        std::fs::write(&files.ca, &self.pem).expect("write");
        files
    }
}

/// A node's `--tls-cert`, `--tls-key` and `--tls-ca`.
#[derive(Clone)]
pub struct TlsFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
    pub ca: PathBuf,
}

impl TlsFiles {
    fn apply(&self, config: &mut ServeConfig) {
        config.tls_cert = Some(self.cert.clone());
        config.tls_key = Some(self.key.clone());
        config.tls_ca = Some(self.ca.clone());
    }
}

/// The README's openssl commands make a CA and a node certificate that a node serves with, and
/// that curl and the CLI trust.
#[test]
fn the_readme_s_openssl_commands_make_certificates_a_node_serves_with() {
    let readme = include_str!("../../README.md");
    let start = readme.find("<!-- readme-tls:begin -->").expect("begin marker");
    let end = readme.find("<!-- readme-tls:end -->").expect("end marker");
    let script: String = readme[start..end]
        .lines()
        .filter(|l| !l.starts_with("```") && !l.starts_with("<!--"))
        .map(|l| format!("{l}\n"))
        .collect();
    let dir = tempfile::tempdir().expect("dir");
    let made = std::process::Command::new("sh").arg("-ec").arg(&script).current_dir(dir.path()).output().expect("sh");
    assert!(made.status.success(), "the README's openssl commands: {}", String::from_utf8_lossy(&made.stderr));
    let path = |name: &str| dir.path().join(name).display().to_string();
    let (cert, key, ca) = (path("node1.crt"), path("node1.key"), path("ca.crt"));
    let node = NodeProcess::start_tls(
        &dir.path().join("data"),
        &["--tls-cert", &cert, "--tls-key", &key, "--tls-ca", &ca],
        &ca,
    );
    let curl = std::process::Command::new("curl")
        .args(["-sf", "--cacert", &ca, &format!("https://{}/v1/cluster/health", node.addr)])
        .output()
        .expect("curl");
    assert!(curl.status.success(), "curl --cacert: {}", String::from_utf8_lossy(&curl.stderr));
    let status = client_with_env(&node.addr, &["status", "--cacert", &ca], &[]);
    assert!(status.status.success(), "shoal status --cacert: {}", String::from_utf8_lossy(&status.stderr));
    node.terminate();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_with_tls_serves_https_on_both_listeners_and_only_clients_that_trust_its_ca_reach_it() {
    let dir = tempfile::tempdir().expect("dir");
    let ca = Ca::new("shoal test CA");
    let mut cluster = TestCluster::start_with(0, |_| {}).await;
    cluster.use_tls(ca.pem.as_bytes());
    for i in 0..3 {
        let files = ca.node_files(dir.path(), &format!("node{i}"));
        cluster.add_node_configured(|c| files.apply(c)).await;
        cluster.wait_settled().await;
    }
    let view = cluster.json(0, "/v1/cluster").await;
    assert_eq!(view["members"].as_array().map(Vec::len), Some(3), "three members joined over TLS: {view}");
    cluster.wait_all_attached().await;

    // The client library, trusting the CA: writes through owners (replicated over TLS, sync),
    // reads back through a client that knows only another node.
    let seed = |slot: usize| format!("https://{}", cluster.api(slot));
    let writer = Client::builder([seed(0)]).tls_ca(ca.pem.clone()).connect().await.expect("connects over TLS");
    for i in 0..200 {
        writer.put(&format!("k{i}"), format!("v{i}")).await.expect("put over TLS");
    }
    let reader = Client::builder([cluster.api(2)]).tls_ca(ca.pem.clone()).connect().await.expect("connects");
    for i in 0..200 {
        let value = reader.get(&format!("k{i}")).await.expect("get").expect("a value");
        assert_eq!(value.bytes, format!("v{i}").as_bytes());
    }
    // Through any node: a key another node owns is forwarded to it over TLS.
    for i in 0..50 {
        assert_eq!(cluster.get(1, &format!("k{i}")).await.as_deref(), Some(format!("v{i}").as_str()));
    }

    // A redirect names the owner's https:// URL.
    let no_follow = reqwest::Client::builder()
        .no_proxy()
        .redirect(reqwest::redirect::Policy::none())
        .tls_built_in_root_certs(false)
        .add_root_certificate(reqwest::Certificate::from_pem(ca.pem.as_bytes()).expect("CA"))
        .build()
        .expect("client");
    let owner_api = |key: &str| {
        let routes = writer.routes();
        routes.addr_of(routes.owner_of(shoal_raft::bucket_of(key.as_bytes()))?).map(str::to_string)
    };
    let key =
        (0..200).map(|i| format!("k{i}")).find(|k| owner_api(k) != Some(cluster.api(0))).expect("a key elsewhere");
    let r = no_follow.get(cluster.url(0, &format!("/v1/kv/{key}?redirect=true"))).send().await.expect("redirect");
    assert_eq!(r.status(), 307);
    let location = r.headers()["location"].to_str().expect("text");
    assert!(location.starts_with(&format!("https://{}/v1/kv/", owner_api(&key).expect("owner"))), "{location}");

    // Plain HTTP reaches neither listener; the peer listener speaks TLS with the same
    // certificate.
    let plain = reqwest::Client::builder().no_proxy().timeout(Duration::from_secs(10)).build().expect("client");
    let api = cluster.api(0);
    let peer = cluster.node(0).peer_addr();
    // Plain HTTP to either listener is answered 400, saying to use HTTPS (as nginx does).
    for url in [format!("http://{api}/v1/cluster"), format!("http://{peer}/internal/members/1")] {
        let r = plain.get(&url).send().await.expect("an answer");
        assert_eq!(r.status().as_u16(), 400, "{url}");
        let problem: serde_json::Value = r.json().await.expect("a problem document");
        assert!(problem["detail"].as_str().is_some_and(|d| d.contains("speaks HTTPS")), "{url}: {problem}");
    }
    let peer_answer = cluster.http.get(format!("https://{peer}/internal/members/1")).send().await;
    assert!(peer_answer.expect("the peer listener over TLS").status().is_success());

    // A client that trusts another CA, or none given for this private CA, is refused.
    let stranger = Ca::new("another CA");
    let refused = Client::builder([seed(0)]).tls_ca(stranger.pem.clone()).connect().await;
    assert!(refused.is_err(), "a client trusting another CA connected");
    assert!(Client::builder([seed(0)]).connect().await.is_err(), "the public CAs do not vouch for this one");
    cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_whose_certificate_and_trust_come_from_another_ca_cannot_join() {
    let dir = tempfile::tempdir().expect("dir");
    let ca = Ca::new("the cluster's CA");
    let mut cluster = TestCluster::start_with(0, |_| {}).await;
    cluster.use_tls(ca.pem.as_bytes());
    let files = ca.node_files(dir.path(), "node0");
    cluster.add_node_configured(|c| files.apply(c)).await;

    let stranger = Ca::new("another CA").node_files(dir.path(), "stranger");
    let refused = cluster
        .try_add_node_configured(|c| {
            stranger.apply(c);
            c.join_timeout = Duration::from_secs(5);
        })
        .await;
    let error = refused.err().map(|e| e.to_string()).unwrap_or_default();
    assert!(error.contains("certificate"), "the join failed, naming the certificate: {error:?}");
    let view = cluster.json(0, "/v1/cluster").await;
    assert_eq!(view["members"].as_array().map(Vec::len), Some(1), "nobody joined: {view}");
    cluster.shutdown().await;
}

/// The CLI with `--cacert` (or `SHOAL_CACERT`) speaks HTTPS to a node that runs with TLS and
/// trusts that CA only; without it, it cannot reach the node.
#[test]
fn the_cli_reaches_a_tls_node_with_its_ca_and_not_without() {
    let dir = tempfile::tempdir().expect("dir");
    let ca = Ca::new("shoal test CA");
    let files = ca.node_files(dir.path(), "node");
    let (cert, key, ca_path) =
        (files.cert.display().to_string(), files.key.display().to_string(), files.ca.display().to_string());
    let node = NodeProcess::start_tls(
        &dir.path().join("data"),
        &["--tls-cert", &cert, "--tls-key", &key, "--tls-ca", &ca_path],
        &ca_path,
    );
    let with_ca = |args: &[&str]| client_with_env(&node.addr, args, &[("SHOAL_CACERT", &ca_path)]);
    let put = with_ca(&["put", "greeting", "hello"]);
    assert!(put.status.success(), "put: {}", String::from_utf8_lossy(&put.stderr));
    let get = with_ca(&["get", "greeting"]);
    assert_eq!(String::from_utf8_lossy(&get.stdout).trim(), "hello");
    let status = client_with_env(&node.addr, &["status", "--cacert", &ca_path], &[]);
    assert!(status.status.success(), "status: {}", String::from_utf8_lossy(&status.stderr));

    let without = client_with_env(&node.addr, &["status"], &[]);
    let said = String::from_utf8_lossy(&without.stderr).to_string();
    assert_eq!(without.status.code(), Some(2), "plain HTTP to a TLS node is refused: {said}");
    assert!(said.contains("this node speaks HTTPS"), "{said}");
    let stranger = Ca::new("another CA").node_files(dir.path(), "stranger");
    let other = client_with_env(&node.addr, &["get", "greeting", "--cacert", &stranger.ca.display().to_string()], &[]);
    assert_eq!(other.status.code(), Some(4), "a CLI trusting another CA");
    let said = String::from_utf8_lossy(&other.stderr).to_string();
    assert!(said.contains("certificate") && !said.contains("node None"), "the error says why: {said}");
    // Several nodes in --addr: one that does not answer is passed over.
    let listed = client_with_env(&format!("127.0.0.1:1,{}", node.addr), &["status", "--cacert", &ca_path], &[]);
    assert!(listed.status.success(), "the next node of --addr: {}", String::from_utf8_lossy(&listed.stderr));
    let junk = client_with_env(&node.addr, &["status", "--cacert", &key], &[]);
    assert_eq!(junk.status.code(), Some(2), "a key given as the CA is a usage error");
    assert!(String::from_utf8_lossy(&junk.stderr).contains("--cacert"), "{}", String::from_utf8_lossy(&junk.stderr));
    node.terminate();
}
