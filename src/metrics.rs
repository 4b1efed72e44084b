//! The node's Prometheus metrics.
//!
//! Each node owns its own recorder (not the process-global one), so several nodes in one
//! process — as in the tests — keep separate figures. Every series is registered at startup,
//! so it is present in `/metrics` from the first scrape; the request path only bumps
//! pre-registered handles (no name lookup per request). Gauges that mirror state (items,
//! bytes, map version, Raft positions) are refreshed when `/metrics` is rendered.

use std::time::Instant;

use metrics::{Counter, Gauge, Histogram, Key, KeyName, Label, Level, Metadata, Recorder, SharedString};
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle, PrometheusRecorder};
use shoal_http_api::ApiError;

/// The operations counted by type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    /// `GET /v1/kv/{key}`.
    Get,
    /// `PUT /v1/kv/{key}`.
    Put,
    /// `DELETE /v1/kv/{key}`.
    Delete,
    /// `POST /v1/bulk/get`.
    BulkGet,
    /// `POST /v1/bulk/put`.
    BulkPut,
    /// `POST /v1/bulk/delete`.
    BulkDelete,
    /// `GET /v1/kv?prefix=`.
    List,
    /// `GET /v1/tags/{tag}`.
    Tagged,
    /// `DELETE /v1/tags/{tag}`.
    RemoveTagged,
}

const OPS: [(Op, &str); 9] = [
    (Op::Get, "get"),
    (Op::Put, "put"),
    (Op::Delete, "delete"),
    (Op::BulkGet, "bulk_get"),
    (Op::BulkPut, "bulk_put"),
    (Op::BulkDelete, "bulk_delete"),
    (Op::List, "list"),
    (Op::Tagged, "tagged"),
    (Op::RemoveTagged, "remove_tagged"),
];

/// How an operation ended.
const OUTCOMES: [&str; 7] =
    ["ok", "not_found", "precondition_failed", "rejected", "unavailable", "redirected", "error"];

fn outcome_of(result: Result<(), &ApiError>) -> usize {
    match result {
        Ok(()) => 0,
        Err(ApiError::NotFound) => 1,
        Err(ApiError::PreconditionFailed { .. }) => 2,
        Err(
            ApiError::BadRequest(_)
            | ApiError::KeyTooLarge { .. }
            | ApiError::ValueTooLarge { .. }
            | ApiError::ItemTooLarge(_)
            | ApiError::InsufficientStorage(_)
            | ApiError::AnswerTooLarge { .. }
            | ApiError::Conflict(_)
            | ApiError::MembershipChangeInProgress(_)
            | ApiError::MaintenanceRefused(_)
            | ApiError::UnknownResource(_)
            | ApiError::MethodNotAllowed
            | ApiError::Unauthorized { .. },
        ) => 3,
        Err(ApiError::Unavailable { .. } | ApiError::NotOwner { .. }) => 4,
        Err(ApiError::Redirect { .. }) => 5,
        Err(ApiError::Internal(_)) => 6,
        Err(ApiError::Remote { problem, .. }) => match problem.status {
            404 => 1,
            412 => 2,
            400..=499 => 3,
            503 => 4,
            _ => 6,
        },
    }
}

/// Latency buckets of the operation histograms, in seconds (50 µs .. 5 s).
const LATENCY_BUCKETS: [f64; 16] =
    [0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0];

/// Declares a struct of series, one field per series with its kind (`Gauge` or `Counter`),
/// Prometheus name and help text (the field's documentation too), and its `register`, which
/// describes and registers each.
macro_rules! series {
    ($(#[$meta:meta])* pub struct $name:ident { $($field:ident: $kind:ident = $metric:literal, $help:literal;)* }) => {
        $(#[$meta])*
        pub struct $name {
            $(#[doc = $help] pub $field: $kind,)*
        }

        impl $name {
            fn register(r: &PrometheusRecorder) -> Self {
                $name {
                    $($field: series(r, $metric, $help),)*
                }
            }
        }
    };
}

/// Describes and registers the series `name`.
fn series<T: Registered>(r: &PrometheusRecorder, name: &'static str, help: &'static str) -> T {
    describe(r, name, help);
    T::register(r, name)
}

/// A kind of series registered by its name alone.
trait Registered {
    fn register(r: &PrometheusRecorder, name: &'static str) -> Self;
}

impl Registered for Gauge {
    fn register(r: &PrometheusRecorder, name: &'static str) -> Self {
        r.register_gauge(&Key::from_name(name), &METADATA)
    }
}

impl Registered for Counter {
    fn register(r: &PrometheusRecorder, name: &'static str) -> Self {
        r.register_counter(&Key::from_name(name), &METADATA)
    }
}

impl Registered for Histogram {
    fn register(r: &PrometheusRecorder, name: &'static str) -> Self {
        r.register_histogram(&Key::from_name(name), &METADATA)
    }
}

series! {
    /// Gauges (and counters set from a count kept elsewhere) mirroring the node's state,
    /// refreshed at render time.
    pub struct StateGauges {
        items: Gauge = "shoal_items", "Items held in the active store.";
        bytes: Gauge = "shoal_bytes", "Bytes charged to the active store (accounting included).";
        limit_bytes: Gauge = "shoal_cache_limit_bytes", "The configured cache size.";
        evictions: Counter = "shoal_evictions_total", "Items evicted to stay within the cache size.";
        expirations: Counter = "shoal_expirations_total", "Items removed because they expired.";
        map_version: Gauge = "shoal_map_version", "Version of the applied distribution map.";
        buckets_owned: Gauge = "shoal_buckets_owned", "Buckets this node owns.";
        members: Gauge = "shoal_members", "Members of the cluster.";
        is_leader: Gauge = "shoal_is_leader", "1 if this node is the Raft leader.";
        leader_id: Gauge = "shoal_raft_leader_id", "Id of the Raft leader, 0 if none is known.";
        raft_voters: Gauge = "shoal_raft_voters", "Voters in the Raft membership (a majority of them must be up).";
        raft_is_voter: Gauge = "shoal_raft_is_voter", "1 if this node votes in Raft, 0 if it is a learner.";
        leader_changes: Counter = "shoal_raft_leader_changes_total",
            "Times this node saw the Raft leader change (a new leader, or none known), since it started.";
        raft_term: Gauge = "shoal_raft_term", "Current Raft term.";
        raft_last_log_index: Gauge = "shoal_raft_last_log_index", "Last Raft log index.";
        raft_applied_index: Gauge = "shoal_raft_applied_index", "Last applied Raft log index.";
        raft_commit_index: Gauge = "shoal_raft_commit_index", "Last committed Raft log index this node knows of.";
        balance_ratio: Gauge = "shoal_balance_ratio",
            "Bytes of the fullest member over the emptiest's, from the members' bucket statistics (1: balanced or no data); the Raft leader reports it, other members 0.";
        memory_limit_bytes: Gauge = "shoal_memory_limit_bytes",
            "The memory limit given with --memory-limit (0: none given).";
        raft_storage_bytes: Gauge = "shoal_raft_storage_bytes", "Size of the Raft storage on disk.";
        transfer_in_progress: Gauge = "shoal_transfer_in_progress", "1 while this node pulls buckets.";
        transfer_buckets_pending: Gauge = "shoal_transfer_buckets_pending",
            "Buckets the target map gives this node that it does not serve yet.";
        transfer_buckets_round: Gauge = "shoal_transfer_round_buckets",
            "Buckets in this node's current round of pulls.";
        transfer_buckets_round_done: Gauge = "shoal_transfer_round_buckets_done",
            "Buckets of the current round already pulled.";
        transfer_buckets: Counter = "shoal_transfer_buckets_total", "Buckets pulled by this node.";
        transfer_bytes_received: Counter = "shoal_transfer_received_bytes_total", "State-transfer bytes received.";
        transfer_bytes_sent: Counter = "shoal_transfer_sent_bytes_total", "State-transfer bytes sent.";
        transfer_idle: Gauge = "shoal_transfer_idle_seconds", "Seconds since this node last moved transfer data.";
        transfer_flag: Gauge = "shoal_transfer_flag", "1 while the state-transfer flag holds membership changes.";
        replica_items: Gauge = "shoal_replica_items", "Items held in the replica store.";
        replica_bytes: Gauge = "shoal_replica_bytes", "Bytes charged to the replica store.";
        replication_sync: Gauge = "shoal_replication_sync", "1 in sync replication mode, 0 in async.";
        replication_queue_depth: Gauge = "shoal_replication_queue_depth",
            "Changes waiting in the async replication queue.";
        replication_lag: Gauge = "shoal_replication_lag_seconds", "Age of the oldest change in the async queue.";
        replication_attached: Gauge = "shoal_replication_attached_buckets",
            "Owned buckets whose replica holds a snapshot.";
        replication_owned: Gauge = "shoal_replication_owned_buckets", "Owned buckets that have a replica holder.";
        replication_sent: Counter = "shoal_replication_changes_total", "Changes the replica acknowledged.";
        replication_failures: Counter = "shoal_replication_failures_total", "Replication requests that failed.";
        replication_exchanges: Counter = "shoal_replication_exchanges_total",
            "Exchanges with replica holders that carried changes: writes in flight to one holder at once travel together, so changes per exchange is the batch size.";
        replication_snapshot_bytes: Counter = "shoal_replication_snapshot_bytes_total",
            "Bytes of the bucket snapshots sent to the replica (whole buckets: after a restart, a move or a change of holder).";
        replication_snapshots: Counter = "shoal_replication_snapshots_total", "Bucket snapshots sent to the replica.";
        replication_undone: Counter = "shoal_replication_undone_total",
            "Writes taken back because the replica did not apply them (answered replication_failed, or outcome_unknown when it may hold them).";
        peers_pfail: Gauge = "shoal_peers_pfail", "Peers that have not answered a ping within the node timeout.";
        nodes_failed: Gauge = "shoal_nodes_failed", "Members the cluster failed so far.";
        buckets_lost: Gauge = "shoal_buckets_lost", "Buckets of which no copy is left (bucket_lost).";
        maintenance: Gauge = "shoal_maintenance",
            "The id of the member in maintenance (its replica holder serves its buckets); 0 when none is.";
        maintenance_seconds_left: Gauge = "shoal_maintenance_seconds_left",
            "Seconds until the maintenance runs out (the member is failed if it is not back); 0 when none runs.";
        fails_proposed: Counter = "shoal_node_fail_proposals_total", "NodeFailed commands this node proposed.";
    }
}

/// The node's metrics. See the module docs.
pub struct NodeMetrics {
    handle: PrometheusHandle,
    recorder: PrometheusRecorder,
    process: metrics_process::Collector,
    operations: Vec<Vec<Counter>>,
    latency: Vec<Histogram>,
    /// Reads that found their key.
    pub hits: Counter,
    /// Reads that did not.
    pub misses: Counter,
    /// Key operations this node forwarded to the owner.
    pub forwarded: Counter,
    /// State mirrors.
    pub state: StateGauges,
    /// Time to pull one bucket (stream, install, flip).
    pub transfer_bucket_duration: Histogram,
    /// Transfers the leader found stuck (and cleared the flag of).
    pub transfer_stuck: Counter,
    /// Time a mirror took to answer a balanced read.
    pub mirror_latency: Histogram,
    /// The client API listener's connections and bytes.
    pub client_listener: ListenerMetrics,
    /// The peer listener's connections and bytes.
    pub peer_listener: ListenerMetrics,
    /// Requests served over peer links: replica writes (one per batch), reads (forwarded and
    /// mirror reads, single or bulk).
    pub link_requests: LinkRequests,
}

/// Connections and bytes of one listener (`listener="client"` or `"peer"`).
#[derive(Clone)]
pub struct ListenerMetrics {
    /// Connections open now.
    pub open: Gauge,
    /// Connections accepted since start.
    pub accepted: Counter,
    /// Bytes read from its connections.
    pub received: Counter,
    /// Bytes written to its connections.
    pub sent: Counter,
}

impl ListenerMetrics {
    /// Handles that count nothing (a listener nobody scrapes, like the one serving while a
    /// node starts).
    pub fn none() -> Self {
        ListenerMetrics {
            open: Gauge::noop(),
            accepted: Counter::noop(),
            received: Counter::noop(),
            sent: Counter::noop(),
        }
    }

    fn register(r: &PrometheusRecorder, listener: &'static str) -> Self {
        let key = |name: &'static str| Key::from_parts(name, vec![Label::new("listener", listener)]);
        ListenerMetrics {
            open: r.register_gauge(&key("shoal_connections"), &METADATA),
            accepted: r.register_counter(&key("shoal_connections_accepted_total"), &METADATA),
            received: r.register_counter(&key("shoal_network_received_bytes_total"), &METADATA),
            sent: r.register_counter(&key("shoal_network_sent_bytes_total"), &METADATA),
        }
    }
}

/// See [`NodeMetrics::link_requests`].
pub struct LinkRequests {
    /// Batches of replica writes.
    pub replica_writes: Counter,
    /// Forwarded and mirror reads.
    pub reads: Counter,
    /// Forwarded writes and deletes.
    pub writes: Counter,
    /// Every other request to the peer listener (pings, shadow writes, maintenance...).
    pub calls: Counter,
}

static METADATA: Metadata<'static> = Metadata::new("shoal", Level::INFO, Some(module_path!()));

impl Default for NodeMetrics {
    fn default() -> Self {
        Self::new()
    }
}

impl NodeMetrics {
    /// Registers every series.
    pub fn new() -> Self {
        let recorder = PrometheusBuilder::new()
            .set_buckets(&LATENCY_BUCKETS)
            .map(|b| b.build_recorder())
            .unwrap_or_else(|_| PrometheusBuilder::new().build_recorder());
        let handle = recorder.handle();
        let r = &recorder;
        describe(r, "shoal_build_info", "Always 1; its labels say which release and source revision run.");
        let build = vec![Label::new("version", crate::VERSION), Label::new("revision", crate::REVISION)];
        r.register_gauge(&Key::from_parts("shoal_build_info", build), &METADATA).set(1.0);
        describe(r, "shoal_operations_total", "Key operations by type and outcome.");
        describe(r, "shoal_operation_duration_seconds", "Time to answer a key operation.");
        let operations = OPS
            .iter()
            .map(|(_, op)| {
                OUTCOMES
                    .iter()
                    .map(|outcome| {
                        let labels = vec![Label::new("op", *op), Label::new("outcome", *outcome)];
                        r.register_counter(&Key::from_parts("shoal_operations_total", labels), &METADATA)
                    })
                    .collect()
            })
            .collect();
        let latency = OPS
            .iter()
            .map(|(_, op)| {
                let key = Key::from_parts("shoal_operation_duration_seconds", vec![Label::new("op", *op)]);
                r.register_histogram(&key, &METADATA)
            })
            .collect();
        let state = StateGauges::register(r);
        describe(r, "shoal_connections", "Connections open now, by listener (client API or peer).");
        describe(r, "shoal_connections_accepted_total", "Connections accepted, by listener.");
        describe(r, "shoal_network_received_bytes_total", "Bytes read from connections, by listener (HTTP included).");
        describe(r, "shoal_network_sent_bytes_total", "Bytes written to connections, by listener (HTTP included).");
        NodeMetrics {
            transfer_bucket_duration: series(
                r,
                "shoal_transfer_bucket_duration_seconds",
                "Time to pull one bucket: stream, install, flip.",
            ),
            transfer_stuck: series(r, "shoal_transfer_stuck_total", "State transfers found stuck by the leader."),
            mirror_latency: series(
                r,
                "shoal_mirror_latency_seconds",
                "Time a mirror took to answer a read balanced over mirrors.",
            ),
            client_listener: ListenerMetrics::register(r, "client"),
            peer_listener: ListenerMetrics::register(r, "peer"),
            link_requests: {
                describe(
                    r,
                    "shoal_peer_link_requests_total",
                    "Requests this node served over peer links, by kind (replica_writes: one per batch; reads: forwarded and mirror reads; writes: forwarded writes and deletes, single and bulk; calls: pings, shadow writes, give-backs, transfer status, maintenance and bucket messages, broadcasts, node figures). Raft, admin messages, bucket streams and a joiner's request for the cluster view are HTTP exchanges.",
                );
                let kind = |kind: &'static str| {
                    let key = Key::from_parts("shoal_peer_link_requests_total", vec![Label::new("kind", kind)]);
                    r.register_counter(&key, &METADATA)
                };
                LinkRequests {
                    replica_writes: kind("replica_writes"),
                    reads: kind("reads"),
                    writes: kind("writes"),
                    calls: kind("calls"),
                }
            },
            hits: series(r, "shoal_cache_hits_total", "Reads that found their key."),
            misses: series(r, "shoal_cache_misses_total", "Reads that did not find their key."),
            forwarded: series(r, "shoal_forwarded_operations_total", "Key operations forwarded to their owner."),
            operations,
            latency,
            state,
            handle,
            process: process_metrics(&recorder),
            recorder,
        }
    }

    /// Counts one operation and its latency.
    pub fn record<T>(&self, op: Op, started: Instant, result: &Result<T, ApiError>) {
        let i = OPS.iter().position(|(o, _)| *o == op).unwrap_or(0);
        self.operations[i][outcome_of(result.as_ref().map(|_| ()))].increment(1);
        self.latency[i].record(started.elapsed().as_secs_f64());
    }

    /// Folds recorded latency samples into the histograms. The exporter buffers every sample
    /// until this runs, so the node calls it periodically (and `render` does too): without it
    /// memory grows with every request while nobody scrapes.
    pub fn upkeep(&self) {
        self.handle.run_upkeep();
    }

    /// The Prometheus text exposition.
    pub fn render(&self) -> String {
        metrics::with_local_recorder(&self.recorder, || self.process.collect());
        self.handle.run_upkeep();
        self.handle.render()
    }
}

/// The process metrics (`process_cpu_seconds_total`, `process_resident_memory_bytes`, open
/// file descriptors, start time…), described and collected once so they exist from startup.
fn process_metrics(recorder: &PrometheusRecorder) -> metrics_process::Collector {
    let collector = metrics_process::Collector::default();
    metrics::with_local_recorder(recorder, || {
        collector.describe();
        collector.collect();
    });
    collector
}

/// Per-peer failure detection, appended to the exposition by hand: the set of peers changes,
/// and a registered series would outlive a peer that left. The families are always declared;
/// a node alone has no samples in them.
pub fn render_peers(peers: &[(u64, bool, Option<f64>)]) -> String {
    use std::fmt::Write;
    let mut out = String::new();
    out.push_str("# HELP shoal_peer_pfail 1 while the peer has not answered a ping within the node timeout.\n");
    out.push_str("# TYPE shoal_peer_pfail gauge\n");
    for (peer, pfail, _) in peers {
        let _ = writeln!(out, "shoal_peer_pfail{{peer=\"{peer}\"}} {}", u8::from(*pfail));
    }
    out.push_str("# HELP shoal_peer_last_contact_seconds Seconds since the peer last answered a ping.\n");
    out.push_str("# TYPE shoal_peer_last_contact_seconds gauge\n");
    for (peer, _, since) in peers {
        if let Some(since) = since {
            let _ = writeln!(out, "shoal_peer_last_contact_seconds{{peer=\"{peer}\"}} {since}");
        }
    }
    out
}

/// Sets the `# HELP` text of a metric (the exporter keeps one description per name, whatever
/// its kind; units stay in the names, as Prometheus wants).
fn describe(recorder: &PrometheusRecorder, name: &'static str, help: &'static str) {
    recorder.describe_counter(KeyName::from_const_str(name), None, SharedString::const_str(help));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_series_is_present_before_any_traffic() {
        let m = NodeMetrics::new();
        let text = m.render();
        for needle in [
            "shoal_operations_total{op=\"get\",outcome=\"ok\"} 0",
            "shoal_cache_hits_total 0",
            "shoal_items 0",
            "shoal_map_version 0",
            "# TYPE shoal_operation_duration_seconds histogram",
            "shoal_raft_commit_index 0",
            "shoal_balance_ratio 0",
            "shoal_connections{listener=\"client\"} 0",
            "shoal_network_sent_bytes_total{listener=\"peer\"} 0",
            "process_resident_memory_bytes",
            "process_start_time_seconds",
        ] {
            assert!(text.contains(needle), "missing {needle:?} in\n{text}");
        }
    }

    #[test]
    fn peers_are_rendered_one_series_each() {
        let text = render_peers(&[(2, false, Some(0.25)), (3, true, None)]);
        assert!(text.contains("shoal_peer_pfail{peer=\"2\"} 0\n"), "{text}");
        assert!(text.contains("shoal_peer_pfail{peer=\"3\"} 1\n"), "{text}");
        assert!(text.contains("shoal_peer_last_contact_seconds{peer=\"2\"} 0.25\n"), "{text}");
        assert!(!text.contains("last_contact_seconds{peer=\"3\"}"), "never heard from: no sample");
        assert_eq!(render_peers(&[]).lines().count(), 4, "the families are declared even without peers");
    }

    #[test]
    fn operations_are_counted_by_outcome_with_latency_buckets() {
        let m = NodeMetrics::new();
        m.record::<()>(Op::Get, Instant::now(), &Err(ApiError::NotFound));
        m.record(Op::Put, Instant::now(), &Ok(()));
        let text = m.render();
        assert!(text.contains("shoal_operations_total{op=\"get\",outcome=\"not_found\"} 1"), "{text}");
        assert!(text.contains("shoal_operations_total{op=\"put\",outcome=\"ok\"} 1"));
        assert!(text.contains("shoal_operation_duration_seconds_bucket{op=\"put\",le=\"0.001\"} 1"), "{text}");
    }
}
