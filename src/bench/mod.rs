//! `shoal bench`: a closed-loop load generator for one node or a cluster.
//!
//! It writes every key once (the fill), then runs `--connections` workers for `--duration`,
//! each sending one request at a time (single-key endpoints, or the bulk endpoints with
//! `--batch N`), routed to the key's owner (`--routing direct`, from the map) or to a random
//! node that forwards (`--routing any`). It reports requests and keys per second, latency
//! percentiles from an HdrHistogram, errors by kind, and — with `--server-pid` — the servers'
//! CPU time per operation, which is the figure to compare on a machine where client and
//! server share the cores. It also reports the CPU other processes used during the run
//! ("foreign"): a run with more than 0.1 core of it should be repeated.
//!
//! # Layout
//! - `load.rs`: the workers, the fill, the HTTP/1.1 connections.
//! - `cpu.rs`: CPU accounting from `/proc`.

mod cpu;
mod load;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use serde::Serialize;
use shoal_http_api::types::MapView;

pub use cpu::{process_cpu_seconds, CpuSample, CpuUse};
pub use load::key_name;
use load::{WorkerStats, Workload};

use shoal_http_api::types::ReadFrom;

pub use crate::config::{BenchArgs, Routing};

/// Latency percentiles in milliseconds.
#[derive(Debug, Clone, Serialize)]
pub struct Latency {
    /// Median.
    pub p50_ms: f64,
    /// 90th percentile.
    pub p90_ms: f64,
    /// 99th percentile.
    pub p99_ms: f64,
    /// 99.9th percentile.
    pub p999_ms: f64,
    /// Slowest.
    pub max_ms: f64,
}

/// What a run measured.
#[derive(Debug, Clone, Serialize)]
pub struct BenchReport {
    /// `get:put`.
    pub ratio: String,
    /// Keys per request.
    pub batch: usize,
    /// Routing.
    pub routing: Routing,
    /// Where gets were served.
    pub read: ReadFrom,
    /// Connections.
    pub connections: usize,
    /// Nodes.
    pub nodes: usize,
    /// Measured seconds.
    pub seconds: f64,
    /// Successful requests.
    pub requests: u64,
    /// Keys in them.
    pub keys: u64,
    /// Requests per second.
    pub requests_per_sec: f64,
    /// Keys per second (= requests per second without batching).
    pub keys_per_sec: f64,
    /// Latency of successful requests.
    pub latency: Latency,
    /// Failures by kind.
    pub errors: BTreeMap<String, u64>,
    /// CPU use during the measurement.
    pub cpu: CpuUse,
    /// Server CPU microseconds per request (needs `--server-pid`).
    pub server_us_per_request: Option<f64>,
    /// Server CPU microseconds per key.
    pub server_us_per_key: Option<f64>,
    /// Seconds the fill took.
    pub fill_seconds: Option<f64>,
    /// Keys the fill sent again because they answered 503 the first time (a bucket moving, a
    /// replica attaching).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fill_retries: Option<u64>,
}

/// Runs the benchmark (blocking: it builds its own runtime).
pub fn run(args: BenchArgs) -> Result<BenchReport, String> {
    let runtime = if args.threads <= 1 {
        tokio::runtime::Builder::new_current_thread().enable_all().build()
    } else {
        tokio::runtime::Builder::new_multi_thread().worker_threads(args.threads).enable_all().build()
    }
    .map_err(|e| e.to_string())?;
    runtime.block_on(run_async(args))
}

async fn workload(args: &BenchArgs) -> Result<Workload, String> {
    if let Some(tls) = args.addr.iter().find(|a| a.starts_with("https://")) {
        return Err(format!(
            "--addr {tls}: shoal bench speaks plain HTTP only (its load is the server's, not TLS's); bench nodes without --tls-cert"
        ));
    }
    let mut nodes = args.addr.clone();
    let mut owner_of_key = None;
    let mut keys_of_node = Vec::new();
    if args.routing == Routing::Direct {
        let map: MapView = reqwest::Client::builder()
            .no_proxy()
            .build()
            .map_err(|e| e.to_string())?
            .get(format!("http://{}/v1/cluster/map", args.addr[0]))
            .send()
            .await
            .map_err(|e| format!("cannot fetch the map from {}: {e}", args.addr[0]))?
            .json()
            .await
            .map_err(|e| format!("bad map from {}: {e}", args.addr[0]))?;
        nodes = map.nodes.iter().map(|n| n.api_addr.clone()).collect();
        let index: BTreeMap<u64, usize> = map.nodes.iter().enumerate().map(|(i, n)| (n.id, i)).collect();
        let owners: Vec<u16> = (0..args.keys)
            .map(|k| {
                let bucket = shoal_raft::bucket_of(key_name(k).as_bytes());
                index.get(&map.owners[bucket.index()]).copied().unwrap_or(0) as u16
            })
            .collect();
        keys_of_node = vec![Vec::new(); nodes.len()];
        for (k, &n) in owners.iter().enumerate() {
            keys_of_node[n as usize].push(k as u32);
        }
        owner_of_key = Some(owners);
    }
    let (g, p) = args.ratio;
    Ok(Workload {
        nodes,
        owner_of_key,
        keys_of_node,
        keys: args.keys.max(1),
        value: Bytes::from(vec![b'x'; args.value_size]),
        get_share: f64::from(g) / f64::from(g + p),
        batch: args.batch.max(1),
        timeout: Duration::from_secs(5),
        mirrors: args.read == ReadFrom::Mirrors,
        bearer: match &args.client_token {
            Some(token) => Some(
                hyper::header::HeaderValue::from_str(&format!("Bearer {}", token.expose()))
                    .map_err(|_| "--client-token: not a valid header value".to_string())?,
            ),
            None => None,
        },
    })
}

async fn run_async(args: BenchArgs) -> Result<BenchReport, String> {
    let work = Arc::new(workload(&args).await?);
    let filled = if args.no_fill { None } else { Some(load::fill(&work, 16).await?) };
    let start_cpu = CpuSample::take(&args.server_pid);
    let started = Instant::now();
    let deadline = started + args.duration;
    let mut tasks = tokio::task::JoinSet::new();
    let client = match args.routing {
        Routing::Client => Some(
            match &args.client_token {
                Some(token) => crate::client::Client::builder(args.addr.iter().cloned()).client_token(token.expose()),
                None => crate::client::Client::builder(args.addr.iter().cloned()),
            }
            .connect()
            .await
            .map_err(|e| format!("the client cannot connect: {e}"))?,
        ),
        _ => None,
    };
    for i in 0..args.connections.max(1) {
        let seed = 0x5eed + i as u64;
        match &client {
            Some(c) => tasks.spawn(load::client_worker(c.clone(), work.clone(), seed, deadline)),
            None => tasks.spawn(load::worker(work.clone(), seed, deadline)),
        };
    }
    let mut stats = WorkerStats::empty();
    while let Some(done) = tasks.join_next().await {
        stats.merge(done.map_err(|e| e.to_string())?);
    }
    let seconds = started.elapsed().as_secs_f64();
    let cpu = CpuUse::between(&start_cpu, &CpuSample::take(&args.server_pid));
    let ms = |q: f64| stats.latency_us.value_at_quantile(q) as f64 / 1000.0;
    let per = |n: u64| (!args.server_pid.is_empty() && n > 0).then(|| cpu.server_seconds * 1e6 / n as f64);
    Ok(BenchReport {
        ratio: format!("{}:{}", args.ratio.0, args.ratio.1),
        batch: work.batch,
        routing: args.routing,
        read: args.read,
        connections: args.connections,
        nodes: work.nodes.len(),
        seconds,
        requests: stats.requests,
        keys: stats.keys,
        requests_per_sec: stats.requests as f64 / seconds,
        keys_per_sec: stats.keys as f64 / seconds,
        latency: Latency {
            p50_ms: ms(0.5),
            p90_ms: ms(0.9),
            p99_ms: ms(0.99),
            p999_ms: ms(0.999),
            max_ms: stats.latency_us.max() as f64 / 1000.0,
        },
        errors: stats.errors,
        cpu,
        server_us_per_request: per(stats.requests),
        server_us_per_key: per(stats.keys),
        fill_seconds: filled.as_ref().map(|f| f.took.as_secs_f64()),
        fill_retries: filled.map(|f| f.retries),
    })
}

/// The report for people.
pub fn table(r: &BenchReport) -> String {
    let errors = if r.errors.is_empty() {
        "none".to_string()
    } else {
        r.errors.iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>().join(" ")
    };
    let server = match (r.server_us_per_request, r.server_us_per_key) {
        (Some(req), Some(key)) => {
            format!("server {req:.2} µs/request, {key:.2} µs/key ({:.2} cores)", r.cpu.server_cores)
        }
        _ => "server ? (give --server-pid)".to_string(),
    };
    let fill = match (r.fill_seconds, r.fill_retries) {
        (Some(s), Some(0)) => format!("fill        {s:.1}s\n"),
        (Some(s), Some(n)) => format!("fill        {s:.1}s, {n} keys sent again after a 503\n"),
        _ => String::new(),
    };
    let table = format!(
        "shoal bench: {} nodes, {} connections, {:.1}s, get:put {}, batch {}, routing {:?}, read {:?}\n\
         throughput  {:.0} requests/s, {:.0} keys/s ({} requests)\n\
         latency     p50 {:.3} ms  p90 {:.3} ms  p99 {:.3} ms  p99.9 {:.3} ms  max {:.3} ms\n\
         errors      {}\n\
         cpu         {}; client {:.2} cores; foreign {:.2} cores\n",
        r.nodes,
        r.connections,
        r.seconds,
        r.ratio,
        r.batch,
        r.routing,
        r.read,
        r.requests_per_sec,
        r.keys_per_sec,
        r.requests,
        r.latency.p50_ms,
        r.latency.p90_ms,
        r.latency.p99_ms,
        r.latency.p999_ms,
        r.latency.max_ms,
        errors,
        server,
        r.cpu.client_cores,
        r.cpu.foreign_cores,
    );
    fill + &table
}
