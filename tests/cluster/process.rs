//! The `shoal` binary as a process: start-up errors, the client commands, SIGTERM.

use std::net::TcpListener;
use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_shoal");

/// A node process, killed by its PID if the test ends early.
pub struct NodeProcess {
    child: Child,
    pub addr: String,
    /// Everything needed to start it again on the same ports and data dir.
    args: Vec<String>,
    envs: Vec<(String, String)>,
    log: std::path::PathBuf,
}

impl Drop for NodeProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A port nobody listens on right now, for a node started later as a separate process.
///
/// Taken below the kernel's ephemeral range (32768 and up), so that no outgoing connection of
/// any process can take it as its local port between this check and the node's bind; a port the
/// kernel handed out (`:0`) could be, and the node then failed with "Address already in use".
/// Each call in this process tries the next port of a run that starts at a place drawn at random.
pub fn free_port() -> u16 {
    use std::sync::atomic::{AtomicU32, Ordering};
    const FIRST: u32 = 20_000;
    const COUNT: u32 = 12_000;
    static NEXT: AtomicU32 = AtomicU32::new(u32::MAX);
    let _ = NEXT.compare_exchange(u32::MAX, rand::random_range(0..COUNT), Ordering::SeqCst, Ordering::SeqCst);
    for _ in 0..COUNT {
        let port = (FIRST + NEXT.fetch_add(1, Ordering::SeqCst) % COUNT) as u16;
        if TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    panic!("no free port between {FIRST} and {}", FIRST + COUNT)
}

impl NodeProcess {
    /// Starts `shoal serve` on fresh ports in `data_dir` and waits until it is ready.
    pub fn start(data_dir: &Path) -> Self {
        Self::start_with(data_dir, &[])
    }

    /// Like [`Self::start`], with more `shoal serve` flags.
    pub fn start_with(data_dir: &Path, extra: &[&str]) -> Self {
        let node = Self::launch(data_dir, (free_port(), free_port()), extra, &[]);
        node.wait_ready();
        node
    }

    /// Like [`Self::start_with`] for a node serving TLS: waits until it answers a CLI that
    /// trusts the CA certificate in `ca`.
    pub fn start_tls(data_dir: &Path, extra: &[&str], ca: &str) -> Self {
        let node = Self::launch(data_dir, (free_port(), free_port()), extra, &[]);
        let deadline = Instant::now() + Duration::from_secs(60);
        while client(&node.addr, &["status", "--cacert", ca]).status.code() != Some(0) {
            assert!(Instant::now() < deadline, "node at {} did not become ready:\n{}", node.addr, node.log());
            std::thread::sleep(Duration::from_millis(100));
        }
        node
    }

    /// Starts `shoal serve` on the given API and peer ports with more flags and environment
    /// variables, without waiting for it.
    pub fn launch(data_dir: &Path, (api, peer): (u16, u16), extra: &[&str], envs: &[(&str, &str)]) -> Self {
        let addr = format!("127.0.0.1:{api}");
        let mut args: Vec<String> =
            ["serve", "--listen", &addr, "--peer-listen", &format!("127.0.0.1:{peer}"), "--cache-size", "64MiB"]
                .iter()
                .map(|s| s.to_string())
                .collect();
        args.push("--data-dir".into());
        args.push(data_dir.display().to_string());
        args.extend(extra.iter().map(|s| s.to_string()));
        let envs: Vec<(String, String)> = envs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        let log = data_dir.with_extension("log");
        let child = spawn(&args, &envs, &log, false);
        NodeProcess { child, addr, args, envs, log }
    }

    /// The node's log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Waits (bounded) until the node answers `shoal status`.
    pub fn wait_ready(&self) {
        let deadline = Instant::now() + Duration::from_secs(60);
        while client(&self.addr, &["status"]).status.code() != Some(0) {
            assert!(Instant::now() < deadline, "node at {} did not become ready; its log:\n{}", self.addr, self.log());
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Sends `signal` (`-STOP`, `-CONT`...) to the process; after `-STOP`, returns once every
    /// thread of it has stopped.
    pub fn signal(&self, signal: &str) {
        let sent = Command::new("kill").args([signal, &self.pid().to_string()]).status().expect("kill");
        assert!(sent.success(), "kill {signal}");
        if signal == "-STOP" {
            wait_stopped(self.pid());
        }
    }

    /// Kills the process with SIGKILL and reaps it.
    pub fn kill9(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Starts the process again with the same flags (ports, data dir), appending to its log.
    pub fn restart(&mut self) {
        self.relaunch();
        self.wait_ready();
    }

    /// [`Self::restart`] without waiting until it is ready (a member that needs others back
    /// first to have a leader).
    pub fn relaunch(&mut self) {
        self.child = spawn(&self.args, &self.envs, &self.log, true);
    }

    /// Sends SIGTERM and waits (bounded) for the exit status.
    pub fn terminate(mut self) -> std::process::ExitStatus {
        self.stop()
    }

    /// Sends SIGTERM and waits (bounded) for the exit status; the process can be restarted.
    pub fn stop(&mut self) -> std::process::ExitStatus {
        let pid = self.child.id();
        let sent = Command::new("sh").arg("-c").arg(format!("kill -TERM {pid}")).status().expect("kill");
        assert!(sent.success());
        self.wait_exit(Duration::from_secs(60))
    }

    /// Waits (bounded) until the process exits by itself.
    pub fn wait_exit(&mut self, timeout: Duration) -> std::process::ExitStatus {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.child.try_wait().expect("wait") {
                return status;
            }
            assert!(Instant::now() < deadline, "node at {} did not stop", self.addr);
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

/// Waits (bounded) until every thread of process `pid` has stopped. A stop signal takes
/// effect only once one of the process's threads runs to take it; until then the others go
/// on, and under load a node went on answering requests for a while after `kill -STOP` had
/// returned.
pub fn wait_stopped(pid: u32) {
    let stopped = || {
        let Ok(threads) = std::fs::read_dir(format!("/proc/{pid}/task")) else { return false };
        threads.flatten().all(|thread| {
            // The state is the first field after the command name's closing parenthesis.
            let stat = std::fs::read_to_string(thread.path().join("stat")).unwrap_or_default();
            let state = stat.rsplit_once(')').and_then(|(_, rest)| rest.split_whitespace().next());
            matches!(state, Some("T" | "t"))
        })
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    while !stopped() {
        assert!(Instant::now() < deadline, "process {pid} did not stop");
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn spawn(args: &[String], envs: &[(String, String)], log: &Path, append: bool) -> Child {
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(append)
        .write(true)
        .truncate(!append)
        .open(log)
        .expect("log file");
    Command::new(BIN)
        .args(args)
        .envs(envs.iter().map(|(k, v)| (k.as_str(), v.as_str())))
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .expect("spawn shoal")
}

/// Runs a client command against `addr`.
pub fn client(addr: &str, args: &[&str]) -> Output {
    client_with_env(addr, args, &[])
}

/// [`client`] with more environment variables.
pub fn client_with_env(addr: &str, args: &[&str], envs: &[(&str, &str)]) -> Output {
    Command::new(BIN).args(args).args(["--addr", addr]).envs(envs.iter().copied()).output().expect("run client")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// Runs a client command against `addr` with `stdin` as its standard input.
fn client_with_input(addr: &str, args: &[&str], stdin: &[u8]) -> Output {
    use std::io::Write;
    let mut child = Command::new(BIN)
        .args(args)
        .args(["--addr", addr])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("run client");
    child.stdin.take().expect("stdin").write_all(stdin).expect("write stdin");
    child.wait_with_output().expect("client output")
}

#[test]
fn the_cli_gives_scripts_exit_codes_conditions_pages_settings_and_completions() {
    let dir = tempfile::tempdir().expect("temp dir");
    let node = NodeProcess::start(&dir.path().join("node"));
    let addr = node.addr.clone();
    let code = |args: &[&str]| {
        let out = client(&addr, args);
        (out.status.code(), text(&out.stdout), text(&out.stderr))
    };
    // A healthy one-node cluster: `status --wait` returns at once.
    let (status, out, err) = code(&["status", "--wait", "--timeout", "30s"]);
    assert_eq!(status, Some(0), "{out}{err}");
    // Conditions: add, then replace at a version; a failed one is exit 1 and names the code.
    assert_eq!(code(&["put", "k1", "a", "--mode", "add", "--tags", "red,blue", "--sliding", "5m"]).0, Some(0));
    let (status, _, err) = code(&["put", "k1", "b", "--mode", "add"]);
    assert_eq!(status, Some(1), "{err}");
    assert!(err.contains("precondition"), "{err}");
    assert_eq!(code(&["put", "k1", "b", "--cas", "1"]).0, Some(0));
    // (A write replaces the whole item, its tags too: k1 has none now.)
    assert_eq!(code(&["put", "k2", "c", "--tags", "red,blue"]).0, Some(0));
    // Usage: a bad flag value, or flags that exclude each other, is exit 2.
    for args in
        [&["put", "k3", "v", "--ttl", "soon"][..], &["put", "k3", "v", "--cas", "1", "--mode", "add"], &["nosuch"]]
    {
        assert_eq!(code(args).0, Some(2), "{args:?}");
    }
    // Not found: a key or a member that does not exist is exit 3.
    assert_eq!(code(&["get", "nothing"]).0, Some(3));
    assert_eq!(code(&["del", "nothing"]).0, Some(3));
    assert_eq!(code(&["leave", "nobody"]).0, Some(3));
    // Listing: one page says where the next starts; --all pages through every key.
    let (status, out, err) = code(&["ls", "--prefix", "k", "--limit", "1", "-o", "json"]);
    assert_eq!(status, Some(0), "{err}");
    let page: serde_json::Value = serde_json::from_str(&out).expect("json");
    assert_eq!((&page["more"], &page["next"]), (&serde_json::json!(true), &serde_json::json!("k1")), "{page}");
    let all: serde_json::Value =
        serde_json::from_str(&code(&["ls", "--prefix", "k", "--limit", "1", "--all", "-o", "json"]).1).expect("json");
    let keys: Vec<&str> = all["keys"].as_array().expect("keys").iter().filter_map(|k| k["key"].as_str()).collect();
    assert_eq!((keys, &all["more"]), (vec!["k1", "k2"], &serde_json::json!(false)));
    let tagged = code(&["ls", "--tag", "blue"]).1;
    assert!(tagged.contains("k2") && !tagged.contains("k1"), "{tagged}");
    // -o json is binary-safe: a value that is not UTF-8 comes back as base64.
    let put = client_with_input(&addr, &["put", "bin", "-"], &[0xff, 0x00, 0xfe]);
    assert!(put.status.success(), "{}", text(&put.stderr));
    let got: serde_json::Value =
        serde_json::from_slice(&client(&addr, &["get", "bin", "-o", "json"]).stdout).expect("json");
    assert_eq!((got.get("value"), &got["value_base64"]), (None, &serde_json::json!("/wD+")), "{got}");
    // Settings.
    let (status, out, _) = code(&["config", "set", "replication", "async", "-o", "json"]);
    assert_eq!(status, Some(0));
    assert_eq!(serde_json::from_str::<serde_json::Value>(&out).expect("json")["replication"], "async");
    assert!(code(&["config", "get"]).1.contains("async"));
    assert_eq!(code(&["config", "set", "colour", "blue"]).0, Some(2));
    // Completions for the shells.
    for shell in ["bash", "zsh", "fish"] {
        let done = Command::new(BIN).args(["completions", shell]).output().expect("completions");
        let out = text(&done.stdout);
        assert!(done.status.success() && out.contains("status") && out.contains("--prefix"), "{shell}: {out}");
    }
    // Waiting does not retry what waiting cannot change: a usage error ends at once, with 2
    // (bounded here at a minute, far below the --timeout it would otherwise sit out).
    let mut wait = Command::new(BIN)
        .args(["status", "--wait", "--timeout", "1h", "--addr", "http://[::1"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("status --wait");
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    let ended = loop {
        if let Some(status) = wait.try_wait().expect("try_wait") {
            break Some(status);
        }
        if std::time::Instant::now() > deadline {
            let _ = wait.kill();
            let _ = wait.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_eq!(ended.and_then(|s| s.code()), Some(2), "status --wait with a bad address kept waiting");
    // Unavailable: nothing answers at the address.
    let out = Command::new(BIN).args(["status", "--addr", "127.0.0.1:1"]).output().expect("status");
    assert_eq!(out.status.code(), Some(4), "{}", text(&out.stderr));
    let help = text(&Command::new(BIN).arg("--help").output().expect("help").stdout);
    assert!(help.contains("Exit status") && help.contains("4 unavailable"), "{help}");
}

#[test]
fn the_client_commands_work_against_a_node_and_sigterm_stops_it_cleanly() {
    let dir = tempfile::tempdir().expect("temp dir");
    let data = dir.path().join("node");
    let node = NodeProcess::start(&data);
    let addr = node.addr.clone();

    let put = client(&addr, &["put", "greeting", "hello", "--ttl", "1h"]);
    assert!(put.status.success(), "{}", text(&put.stderr));
    assert!(text(&put.stdout).starts_with("OK version=1 bucket="), "{}", text(&put.stdout));
    assert_eq!(text(&client(&addr, &["get", "greeting"]).stdout), "hello");
    let status = text(&client(&addr, &["status"]).stdout);
    assert!(status.contains("voter") && status.contains("1000"), "{status}");
    let json: serde_json::Value = serde_json::from_slice(&client(&addr, &["map", "-o", "json"]).stdout).expect("json");
    assert_eq!(json["owners"].as_array().map(Vec::len), Some(1000));
    assert!(client(&addr, &["del", "greeting"]).status.success());
    // A missing key is the CLI's own message (the library answered a miss, not an error).
    for command in ["get", "del"] {
        let missing = client(&addr, &[command, "greeting"]);
        assert_eq!(missing.status.code(), Some(3), "not found is exit status 3");
        let err = text(&missing.stderr);
        assert!(err.contains("no value for \"greeting\" (not_found, HTTP 404)"), "{command}: {err}");
    }

    // The load generator runs against it and reports server CPU per operation.
    let pid = node.child.id().to_string();
    let bench = Command::new(BIN)
        .args(["bench", "--addr", &addr, "--duration", "1s", "--keys", "2000", "--connections", "4"])
        .args(["--ratio", "3:1", "--server-pid", &pid, "-o", "json"])
        .output()
        .expect("bench");
    assert!(bench.status.success(), "{}", text(&bench.stderr));
    let report: serde_json::Value = serde_json::from_slice(&bench.stdout).expect("bench json");
    assert!(report["requests"].as_u64().unwrap_or(0) > 100, "{report}");
    assert_eq!(report["errors"], serde_json::json!({}), "{report}");
    assert!(report["server_us_per_request"].as_f64().is_some_and(|us| us > 0.0), "{report}");
    let batched = Command::new(BIN)
        .args([
            "bench",
            "--addr",
            &addr,
            "--duration",
            "1s",
            "--keys",
            "2000",
            "--batch",
            "8",
            "--no-fill",
            "-o",
            "json",
        ])
        .output()
        .expect("bench");
    let report: serde_json::Value = serde_json::from_slice(&batched.stdout).expect("bench json");
    assert_eq!(report["keys"].as_u64(), report["requests"].as_u64().map(|r| r * 8), "{report}");

    let status = node.terminate();
    assert!(status.success(), "exit status after SIGTERM: {status}");
    let log = std::fs::read_to_string(data.with_extension("log")).expect("log");
    assert!(log.contains("node stopped"), "{log}");
}

#[test]
fn bad_flags_are_refused_at_startup_with_a_clear_message() {
    let dir = tempfile::tempdir().expect("temp dir");
    for (args, needle) in [
        (vec!["--voters", "4"], "3 or 5 voters"),
        (vec!["--cache-size", "lots"], "is not a size"),
        (vec!["--listen", "0.0.0.0:0"], "--advertise is required"),
    ] {
        let out = Command::new(BIN).arg("serve").args(&args).arg("--data-dir").arg(dir.path()).output().expect("run");
        assert!(!out.status.success(), "{args:?} should fail");
        assert!(text(&out.stderr).contains(needle), "{args:?}: {}", text(&out.stderr));
    }
    let help = Command::new(BIN).args(["serve", "--help"]).output().expect("help");
    for flag in [
        "--listen",
        "--peer-listen",
        "--advertise",
        "--peer-advertise",
        "--data-dir",
        "--join",
        "--cache-size",
        "--max-key-bytes",
        "--max-value-bytes",
        "--voters",
        "SHOAL_CACHE_SIZE",
    ] {
        assert!(text(&help.stdout).contains(flag), "serve --help documents {flag}");
    }
}

#[test]
fn a_join_that_cannot_reach_the_cluster_gives_up_at_its_deadline_with_a_clear_error() {
    let dir = tempfile::tempdir().expect("temp dir");
    let nobody = format!("127.0.0.1:{}", free_port());
    let started = Instant::now();
    let out = Command::new(BIN)
        .args([
            "serve",
            "--listen",
            &format!("127.0.0.1:{}", free_port()),
            "--peer-listen",
            &format!("127.0.0.1:{}", free_port()),
        ])
        .args(["--join", &nobody, "--join-timeout", "2s"])
        .arg("--data-dir")
        .arg(dir.path())
        .output()
        .expect("run");
    assert!(!out.status.success());
    let err = text(&out.stderr);
    assert!(err.contains("could not join through") && err.contains(&nobody), "{err}");
    assert!(started.elapsed() < Duration::from_secs(30), "bounded by --join-timeout");
    assert!(!dir.path().join("node.json").exists(), "no identity was written");
}

#[test]
fn json_logs_never_show_the_secrets() {
    let dir = tempfile::tempdir().expect("temp dir");
    let data = dir.path().join("node");
    let flags = ["--log-format", "json", "--cluster-secret", "topsecret-1234", "--admin-token", "admintoken-5678"];
    let node = NodeProcess::start_with(&data, &flags);
    assert!(client(&node.addr, &["put", "k", "v"]).status.success());
    let status = node.terminate();
    assert!(status.success(), "{status}");
    let log = std::fs::read_to_string(data.with_extension("log")).expect("log");
    let lines: Vec<&str> = log.lines().filter(|l| !l.trim().is_empty()).collect();
    assert!(lines.len() >= 3, "{log}");
    for line in &lines {
        let entry: serde_json::Value = serde_json::from_str(line).unwrap_or_else(|e| panic!("{e}: {line}"));
        assert!(entry["level"].is_string() && entry["fields"].is_object(), "{line}");
    }
    assert!(log.contains("drained") && log.contains("node stopped"), "{log}");
    assert!(!log.contains("topsecret-1234") && !log.contains("admintoken-5678"), "a secret was logged:\n{log}");
    assert!(!log.contains("\u{1b}["), "no colour codes when not on a terminal");

    // A refused secret is not echoed either.
    let out = Command::new(BIN)
        .args(["serve", "--cluster-secret", "has a space-9876", "--data-dir"])
        .arg(dir.path().join("other"))
        .output()
        .expect("run");
    assert!(!out.status.success());
    let err = text(&out.stderr);
    assert!(err.contains("--cluster-secret") && !err.contains("space-9876"), "{err}");
}

/// The API port keeps at most `--max-connections` connections: one more is answered 503
/// problem+json with `Retry-After` and closed, while those admitted are served on; a client
/// that does not finish a request head within `--header-read-timeout`, or idles that long, is
/// closed; then the port serves new connections again.
#[test]
fn the_api_port_caps_its_connections_and_closes_slow_and_idle_ones() {
    use std::io::{Read, Write};
    use std::net::TcpStream;
    let dir = tempfile::tempdir().expect("temp dir");
    let node =
        NodeProcess::start_with(&dir.path().join("node"), &["--max-connections", "2", "--header-read-timeout", "3s"]);
    let connect = || {
        let tcp = TcpStream::connect(&node.addr).expect("connect");
        tcp.set_read_timeout(Some(Duration::from_secs(15))).expect("timeout");
        tcp
    };
    let livez = b"GET /livez HTTP/1.1\r\nhost: shoal\r\n\r\n";
    let mut idle = connect();
    let mut slow = connect();
    slow.write_all(b"GET /livez HTTP/1.1\r\nhost: sh").expect("half a head");
    // The third is refused (the CLI's connections that waited for readiness may still be
    // closing: then a later one is).
    let deadline = Instant::now() + Duration::from_secs(30);
    let refusal = loop {
        let mut third = connect();
        third.write_all(b"GET /livez HTTP/1.1\r\nhost: shoal\r\nconnection: close\r\n\r\n").expect("request");
        let mut answer = String::new();
        let _ = third.read_to_string(&mut answer);
        if answer.starts_with("HTTP/1.1 503") {
            break answer;
        }
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
        assert!(Instant::now() < deadline, "a third connection was never refused");
        std::thread::sleep(Duration::from_millis(20));
    };
    let lower = refusal.to_ascii_lowercase();
    assert!(lower.contains("retry-after: 1") && lower.contains("application/problem+json"), "{refusal}");
    assert!(refusal.contains("\"code\":\"overloaded\"") && refusal.contains("--max-connections"), "{refusal}");
    // An admitted connection is served.
    idle.write_all(livez).expect("request");
    let mut answer = [0u8; 512];
    let n = idle.read(&mut answer).expect("an answer");
    assert!(answer[..n].starts_with(b"HTTP/1.1 200"), "{}", String::from_utf8_lossy(&answer[..n]));
    // Both are closed at the timeout: the slow head unanswered, the idle one after its answer.
    let started = Instant::now();
    for (what, tcp) in [("slow", &mut slow), ("idle", &mut idle)] {
        let mut rest = Vec::new();
        let read = tcp.read_to_end(&mut rest);
        assert!(
            read.is_ok() || read.as_ref().is_err_and(|e| e.kind() == std::io::ErrorKind::ConnectionReset),
            "{what}: {read:?}"
        );
        assert!(rest.is_empty(), "{what}: {}", String::from_utf8_lossy(&rest));
    }
    assert!(started.elapsed() < Duration::from_secs(12), "closed at the timeout: {:?}", started.elapsed());
    // Room again.
    let mut again = connect();
    again.write_all(livez).expect("request");
    let n = again.read(&mut answer).expect("an answer");
    assert!(answer[..n].starts_with(b"HTTP/1.1 200"), "{}", String::from_utf8_lossy(&answer[..n]));
}
