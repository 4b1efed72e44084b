//! The OpenAPI 3 description of the public API, served at `GET /openapi.json`.
//!
//! The functions below are documentation only (utoipa reads their attributes); the real
//! handlers are in `kv.rs` and `cluster.rs`. A test checks that every route of [`router`]
//! is described here, so the two cannot drift apart.
//!
//! [`router`]: crate::router

#![allow(dead_code)]

use serde_json::{json, Value};
use utoipa::OpenApi;

use crate::error::Problem;
use crate::types::*;

/// The document.
#[derive(OpenApi)]
#[openapi(
    info(
        title = "shoal",
        description = "A distributed in-memory cache. Values are raw bytes in and out; everything else is JSON; \
                       every error is an RFC 9457 application/problem+json document with a stable `code`.",
        license(name = "Apache-2.0")
    ),
    paths(
        get_key, put_key, delete_key, list_keys, bulk_get, bulk_put, bulk_delete, get_tag, delete_tag,
        cluster, cluster_health, cluster_map, cluster_events, cluster_transfer, cluster_agents, cluster_buckets, rebalance, leave, enter_maintenance, end_maintenance, config, set_config, clear_lost, node, livez, readyz, metrics, openapi
    ),
    components(schemas(
        Problem, PutOk, BulkKeys, BulkPut, BulkPutItem, BulkResults, KeyResult, KeyError, KeyList, FoundKey,
        NodeFailure, Removed, EventsView, ClusterView, MemberView, TransitionView, TransferSummary, TransferView, TransferStatus, MapView, MapNode, NodeStats, LeaveOk,
        HealthView, PeerHealth, PeerState, ReplicationView, ClusterConfig, ClearLost, LostCleared, MaintenanceRequest, MaintenanceView,
        AgentsView, AgentView, KarmaBlockView, AgentErrors, ReadFrom, BucketsView, NodeLoad, BucketFigures,
        RebalancePlan, PlannedMove, NodeBalance, BucketSort, Priority
    )),
    tags(
        (name = "keys", description = "Key operations, served by the owner of the key's bucket (any node forwards)"),
        (name = "cluster", description = "Membership and the distribution map"),
        (name = "operations", description = "Health, readiness, metrics")
    )
)]
pub struct ApiDoc;

/// The document as JSON.
pub fn document() -> String {
    let mut doc = serde_json::to_value(ApiDoc::openapi()).unwrap_or_default();
    complete(&mut doc);
    serde_json::to_string_pretty(&doc).unwrap_or_default()
}

/// Paths that answer whatever state the node is in (no 503 from the cluster).
const OPERATIONS_PATHS: [&str; 4] = ["/livez", "/readyz", "/metrics", "/openapi.json"];

fn problem_response(description: &str) -> Value {
    json!({
        "description": description,
        "content": {"application/problem+json": {"schema": {"$ref": "#/components/schemas/Problem"}}}
    })
}

/// What every operation shares, added once here rather than on each of them: the 400 of an
/// operation with input, the 503 (with `Retry-After`) of one that needs the cluster, the 401
/// and the admin token of cluster writes, the 413 of bodies over their limit; and the exact
/// grammar of the parameters the server checks by hand (durations, tags, numbers), so that a
/// value the description allows is one the server takes.
fn complete(doc: &mut Value) {
    doc["components"]["securitySchemes"] = json!({
        "admin_token": {"type": "http", "scheme": "bearer", "description": "`--admin-token`, when the node has one"},
        "client_token": {"type": "http", "scheme": "bearer", "description": "`--client-token` (or the admin token), when the node has one: the key API needs it"}
    });
    exact_schemas(doc);
    let Some(paths) = doc["paths"].as_object_mut() else { return };
    for (path, item) in paths.iter_mut() {
        let Some(item) = item.as_object_mut() else { continue };
        for (method, op) in item.iter_mut() {
            shared_responses(path, method, op);
            for p in op.get_mut("parameters").and_then(Value::as_array_mut).into_iter().flatten() {
                if let Some(schema) = parameter_schema(p, method) {
                    p["schema"] = schema;
                }
            }
        }
    }
}

/// The schemas the server checks by hand, as exactly as it checks them.
fn exact_schemas(doc: &mut Value) {
    // A bulk item's options are checked item by item: a bad one fails that key alone (in the
    // 200 answer), so the body's schema takes any string for them.
    let schemas = &mut doc["components"]["schemas"];
    schemas["BulkPutItem"]["properties"]["cas"] =
        json!({"type": ["integer", "null"], "minimum": 0, "maximum": u64::MAX});
    schemas["ClusterConfig"]["properties"]["replication"] = json!({"type": "string", "enum": ["sync", "async"]});
    schemas["ClusterConfig"]["minProperties"] = json!(1);
    schemas["ClusterConfig"]["additionalProperties"] = json!(false);
    schemas["ClearLost"]["properties"]["buckets"]["items"] = json!({"type": "integer", "minimum": 0, "maximum": 999});
    // The duration grammar within its range (10 s to 1 h; 400 outside), exactly.
    let (lo, hi) = (crate::MAINTENANCE_MIN.as_millis() as u64, crate::MAINTENANCE_MAX.as_millis() as u64);
    schemas["MaintenanceRequest"]["properties"]["for"] = json!({
        "type": ["string", "null"],
        "pattern": duration_range_pattern(lo, hi),
        "description": "How long the member may stay away: 10s to 1h (400 outside); default 10m"
    });
    // A followed event log: each server-sent event carries one event's JSON as its data, and
    // the last event of each Raft entry its index as id.
    doc["paths"]["/v1/cluster/events"]["get"]["responses"]["200"]["content"]["text/event-stream"]["schema"] = json!({
        "type": "object",
        "properties": {
            "event": {"type": "string", "enum": ["cluster_event"]},
            "data": {"type": "string", "contentMediaType": "application/json"},
            "id": {"type": "string", "pattern": "^[0-9]+$"}
        },
        "required": ["event", "data"]
    });
}

/// The answers and the security an operation shares with others of its kind.
fn shared_responses(path: &str, method: &str, op: &mut Value) {
    let input = op["parameters"].as_array().is_some_and(|p| !p.is_empty()) || op.get("requestBody").is_some();
    let cluster_write = method != "get" && path.starts_with("/v1/cluster");
    let key = path == "/v1/kv/{key}";
    let mut responses = op["responses"].take();
    let mut add = |status: &str, description: &str| {
        if responses.get(status).is_none() {
            responses[status] = problem_response(description);
        }
    };
    if input {
        add("400", "bad_request: a parameter or the body is not valid");
    }
    if !OPERATIONS_PATHS.contains(&path) {
        add("503", "The node cannot serve now (see the code); retry after Retry-After");
    }
    if cluster_write {
        add("401", "admin_token_required: the node has an admin token and the request did not carry it");
        add("409", "conflict or membership_change_in_progress");
        add("413", "value_too_large: the body is over 64 KiB");
    }
    if key || path.starts_with("/v1/bulk/") {
        add("413", "key_too_large, value_too_large (or a bulk body over its limit)");
    }
    let key_api = crate::is_key_path(path);
    if key_api {
        add("401", "client_token_required: the node has a client token and the request did not carry it");
    }
    if key && method != "get" {
        add("412", "precondition_failed");
        if responses.get("307").is_none() {
            responses["307"] = json!({"description": "redirect=true: the owner's URL in Location"});
        }
    }
    op["responses"] = responses;
    if cluster_write {
        // Optional: only a node started with --admin-token asks for it.
        op["security"] = json!([{}, {"admin_token": []}]);
    } else if key_api {
        // Optional: only a node started with --client-token asks for it.
        op["security"] = json!([{}, {"client_token": []}, {"admin_token": []}]);
    }
}

/// The exact grammar of a parameter `p` of an operation of `method` that the server checks by
/// hand (durations, tags, numbers), so that a value the description allows is one the server
/// takes; `None` for the others.
fn parameter_schema(p: &mut Value, method: &str) -> Option<Value> {
    let any_u64 = || json!({"type": "integer", "minimum": 0, "maximum": u64::MAX});
    Some(match (p["name"].as_str().unwrap_or(""), p["in"].as_str().unwrap_or("")) {
        ("ttl" | "sliding", "query") => json!({"type": "string", "pattern": duration_pattern()}),
        ("tags", "query") => json!({"type": "string", "pattern": "^[^,]{1,256}(,[^,]{1,256})*$"}),
        ("mode", "query") => json!({"type": "string", "enum": ["add", "replace"]}),
        ("If-Match", "header") => json!({"type": "string", "pattern": "^(\\*|\"[0-9]{1,19}\")$"}),
        ("If-None-Match", "header") if method != "get" => json!({"type": "string", "enum": ["*"]}),
        ("priority", "query") => json!({"type": "string", "enum": Priority::ALL.map(Priority::name)}),
        ("sort", "query") => json!({"type": "string", "enum": ["bytes", "items", "reads", "writes", "bucket"]}),
        ("max_staleness", "query") => {
            let p = duration_pattern();
            json!({"type": "string", "pattern": format!("^(?:0|{})$", &p[1..p.len() - 1])})
        }
        ("limit", "query") => json!({"type": "integer", "minimum": 1, "maximum": 100000}),
        ("timeout", "query") => {
            json!({"type": "string", "pattern": "^(?:(?:[1-9][0-9]?|[12][0-9]{2}|300)s?|(?:[1-9][0-9]{0,4}|[12][0-9]{5}|300000)ms|[1-5]m)$"})
        }
        ("follow", "query") => json!({"type": "boolean"}),
        ("since" | "wait_version", "query") | ("cas" | "node", "query") => any_u64(),
        ("id", "path") => {
            p["example"] = json!(1);
            any_u64()
        }
        ("verbose", "query") => json!({"type": "string", "enum": ["", "true", "false", "1", "0"]}),
        ("key" | "tag", "path") => {
            p["example"] = json!("users/42");
            json!({"type": "string", "minLength": 1})
        }
        _ => return None,
    })
}

/// The exact grammar of a `ttl` or `sliding` as a regular expression: a whole number without
/// leading zeros from 1 to the most the unit allows within [`crate::MAX_EXPIRY`], then the unit
/// (none: seconds).
pub fn duration_pattern() -> String {
    let max_ms = crate::MAX_EXPIRY.as_millis() as u64;
    let mut alternatives = vec![at_most(max_ms / 1000)];
    alternatives.extend(crate::kv::DURATION_UNITS.iter().map(|(unit, ms)| format!("{}{unit}", at_most(max_ms / ms))));
    format!("^(?:{})$", alternatives.join("|"))
}

/// The duration grammar (as [`duration_pattern`]) for durations from `lo_ms` to `hi_ms`: each
/// unit with the numbers that fall in the range.
pub fn duration_range_pattern(lo_ms: u64, hi_ms: u64) -> String {
    let units = std::iter::once(("", 1000)).chain(crate::kv::DURATION_UNITS.iter().copied());
    let alternatives: Vec<String> = units
        .filter_map(|(unit, ms)| {
            let (from, to) = (lo_ms.div_ceil(ms).max(1), hi_ms / ms);
            (from <= to).then(|| format!("{}{unit}", between(from, to)))
        })
        .collect();
    format!("^(?:{})$", alternatives.join("|"))
}

/// A regular expression (no anchors) for the whole numbers `lo` to `hi` (`lo` at least 1),
/// without leading zeros.
fn between(lo: u64, hi: u64) -> String {
    let mut alternatives = Vec::new();
    let mut from = lo;
    // One run of numbers of the same length at a time.
    while from <= hi {
        let len = from.to_string().len() as u32;
        let top = (10u64.saturating_pow(len) - 1).min(hi);
        alternatives.push(same_length(&from.to_string(), &top.to_string()));
        from = top + 1;
    }
    format!("(?:{})", alternatives.join("|"))
}

/// A regular expression for the numbers from `a` to `b`, both written with the same number of
/// digits.
fn same_length(a: &str, b: &str) -> String {
    if a == b {
        return a.to_string();
    }
    let (x, y) = (a.as_bytes()[0] - b'0', b.as_bytes()[0] - b'0');
    let (ra, rb) = (&a[1..], &b[1..]);
    if x == y {
        return format!("{x}{}", same_length(ra, rb));
    }
    let any = |n: usize| match n {
        0 => String::new(),
        1 => "[0-9]".to_string(),
        n => format!("[0-9]{{{n}}}"),
    };
    let n = ra.len();
    let (low_full, high_full) = (ra.bytes().all(|d| d == b'0'), rb.bytes().all(|d| d == b'9'));
    let mut parts = Vec::new();
    let first = if low_full { x } else { x + 1 };
    let last = if high_full { y } else { y - 1 };
    if !low_full {
        parts.push(format!("{x}(?:{})", same_length(ra, &"9".repeat(n))));
    }
    if first <= last {
        let class = if first == last { first.to_string() } else { format!("[{first}-{last}]") };
        parts.push(format!("{class}{}", any(n)));
    }
    if !high_full {
        parts.push(format!("{y}(?:{})", same_length(&"0".repeat(n), rb)));
    }
    format!("(?:{})", parts.join("|"))
}

/// A regular expression (no anchors) for the whole numbers 1 to `n`, without leading zeros.
fn at_most(n: u64) -> String {
    let digits: Vec<u8> = n.to_string().bytes().map(|b| b - b'0').collect();
    let len = digits.len();
    let mut alternatives = Vec::new();
    // Every shorter number.
    match len {
        0 | 1 => {}
        2 => alternatives.push("[1-9]".to_string()),
        _ => alternatives.push(format!("[1-9][0-9]{{0,{}}}", len - 2)),
    }
    // Same length: equal to n up to position i, smaller at i, anything after.
    let prefix: String = n.to_string();
    for (i, &d) in digits.iter().enumerate() {
        let low = u8::from(i == 0);
        if d > low {
            let class = if d - 1 == low { low.to_string() } else { format!("[{low}-{}]", d - 1) };
            let rest = len - i - 1;
            let tail = match rest {
                0 => String::new(),
                1 => "[0-9]".to_string(),
                r => format!("[0-9]{{{r}}}"),
            };
            alternatives.push(format!("{}{class}{tail}", &prefix[..i]));
        }
    }
    alternatives.push(prefix);
    format!("(?:{})", alternatives.join("|"))
}

#[utoipa::path(get, path = "/v1/kv/{key}", tag = "keys",
    summary = "Read a key",
    params(
        ("key" = String, Path, description = "The key (everything after /v1/kv/, percent-decoded)"),
        ("redirect" = Option<bool>, Query, description = "Answer 307 to the owner instead of forwarding"),
        ("read" = Option<ReadFrom>, Query, description = "owner (the node's --read-from default) or mirrors: any fresh copy of the bucket may serve it"),
        ("max_staleness" = Option<String>, Query, description = "With read=mirrors and async replication: how far behind its owner a replica copy may be (0, or 500ms, 2s, ...; default --max-staleness)"),
        ("If-None-Match" = Option<String>, Header, description = "Entity tags (\"3\", W/\"3\", a list, or *): when one names the current version, the answer is 304 without the value"),
    ),
    responses(
        (status = 200, description = "The raw value", content_type = "application/octet-stream", body = String,
            headers(("etag" = String, description = "\"<version>\""),
                    ("x-shoal-bucket" = u16, description = "The key's bucket"),
                    ("x-shoal-node" = u64, description = "The node that served it (the owner, or a mirror)"),
                    ("x-shoal-replica-lag-ms" = u64, description = "Served from a replica copy: at most how far behind its owner it was"))),
        (status = 304, description = "If-None-Match named the current version: no value",
            headers(("etag" = String, description = "\"<version>\""))),
        (status = 307, description = "redirect=true: the owner's URL in Location"),
        (status = 404, description = "not_found", body = Problem, content_type = "application/problem+json"),
        (status = 413, description = "key_too_large", body = Problem, content_type = "application/problem+json"),
        (status = 503, description = "no_leader, not_ready, owner_unreachable, map_changing", body = Problem, content_type = "application/problem+json"),
    ))]
fn get_key() {}

#[utoipa::path(put, path = "/v1/kv/{key}", tag = "keys",
    summary = "Write a key",
    params(
        ("key" = String, Path, description = "The key"),
        ("ttl" = Option<String>, Query, description = "Absolute expiration: 30s, 5m, 1h30m or seconds"),
        ("sliding" = Option<String>, Query, description = "Sliding expiration: every read extends it (400 with ttl)"),
        ("tags" = Option<String>, Query, description = "Comma-separated tags"),
        ("cas" = Option<u64>, Query, description = "Only if the current version is this; 0: only if absent (400 with mode, If-Match or If-None-Match: one condition at a time)"),
        ("mode" = Option<String>, Query, description = "add (only if absent) or replace (only if present) (400 with cas, If-Match or If-None-Match)"),
        ("priority" = Option<String>, Query, description = "Eviction priority: low, below_normal, normal (default), above_normal, high, not_removable"),
        ("redirect" = Option<bool>, Query, description = "Answer 307 to the owner instead of forwarding"),
        ("If-Match" = Option<String>, Header, description = "\"N\" (N at least 1): as cas=N; *: as mode=replace (400 with cas, mode or If-None-Match, or empty)"),
        ("If-None-Match" = Option<String>, Header, description = "*: as mode=add (400 with cas, mode or If-Match)"),
    ),
    request_body(content = String, content_type = "application/octet-stream", description = "The raw value"),
    responses(
        (status = 200, description = "Written", body = PutOk),
        (status = 400, description = "bad_request", body = Problem, content_type = "application/problem+json"),
        (status = 412, description = "precondition_failed, with current_version", body = Problem, content_type = "application/problem+json"),
        (status = 413, description = "key_too_large, value_too_large, item_too_large", body = Problem, content_type = "application/problem+json"),
        (status = 507, description = "insufficient_storage: the cache is full of not_removable items", body = Problem, content_type = "application/problem+json"),
        (status = 503, description = "Retry after Retry-After", body = Problem, content_type = "application/problem+json"),
    ))]
fn put_key() {}

#[utoipa::path(delete, path = "/v1/kv/{key}", tag = "keys",
    summary = "Delete a key",
    params(
        ("key" = String, Path, description = "The key"),
        ("cas" = Option<u64>, Query, description = "Only if the current version is this (400 with If-Match: one condition at a time)"),
        ("redirect" = Option<bool>, Query, description = "Answer 307 to the owner instead of forwarding"),
        ("If-Match" = Option<String>, Header, description = "\"N\" (N at least 1): as cas=N; *: only if it exists (a missing key is 404 either way) (400 with cas, or empty)"),
    ),
    responses(
        (status = 204, description = "Deleted"),
        (status = 404, description = "not_found", body = Problem, content_type = "application/problem+json"),
        (status = 412, description = "precondition_failed", body = Problem, content_type = "application/problem+json"),
    ))]
fn delete_key() {}

#[utoipa::path(get, path = "/v1/kv", tag = "keys",
    summary = "List keys by prefix (all members)",
    params(
        ("prefix" = Option<String>, Query, description = "Key prefix (default: every key)"),
        ("limit" = Option<usize>, Query, description = "1 to 100000, default 1000"),
        ("start_after" = Option<String>, Query, description = "Only keys sorting after this one: the previous page's next"),
    ),
    responses((status = 200, description = "Sorted keys; more and next when it stopped at limit; incomplete when a member did not answer", body = KeyList)))]
fn list_keys() {}

#[utoipa::path(post, path = "/v1/bulk/get", tag = "keys", summary = "Read many keys",
    params(
        ("read" = Option<ReadFrom>, Query, description = "owner or mirrors, as for a single read"),
        ("max_staleness" = Option<String>, Query, description = "As for a single read"),
    ),
    request_body = BulkKeys,
    responses((status = 200, description = "One result per key, in order", body = BulkResults),
              (status = 400, description = "bad_request", body = Problem, content_type = "application/problem+json")))]
fn bulk_get() {}

#[utoipa::path(post, path = "/v1/bulk/put", tag = "keys", summary = "Write many keys",
    request_body = BulkPut,
    responses((status = 200, description = "One result per item, in order", body = BulkResults),
              (status = 400, description = "bad_request", body = Problem, content_type = "application/problem+json")))]
fn bulk_put() {}

#[utoipa::path(post, path = "/v1/bulk/delete", tag = "keys", summary = "Delete many keys",
    request_body = BulkKeys,
    responses((status = 200, description = "One result per key, in order", body = BulkResults),
              (status = 400, description = "bad_request", body = Problem, content_type = "application/problem+json")))]
fn bulk_delete() {}

#[utoipa::path(get, path = "/v1/tags/{tag}", tag = "keys", summary = "List keys by tag (all members)",
    params(("tag" = String, Path, description = "The tag"),
           ("limit" = Option<usize>, Query, description = "1 to 100000, default 1000"),
           ("start_after" = Option<String>, Query, description = "Only keys sorting after this one: the previous page's next")),
    responses((status = 200, description = "Sorted keys; more and next when it stopped at limit", body = KeyList)))]
fn get_tag() {}

#[utoipa::path(delete, path = "/v1/tags/{tag}", tag = "keys", summary = "Remove every item with a tag (all members)",
    params(("tag" = String, Path, description = "The tag")),
    responses((status = 200, description = "Removed", body = Removed),
              (status = 502, description = "Some member did not answer; its items may remain", body = Removed)))]
fn delete_tag() {}

#[utoipa::path(get, path = "/v1/cluster", tag = "cluster", summary = "Members, roles, buckets, items",
    responses((status = 200, description = "The cluster", body = ClusterView),
              (status = 503, description = "not_ready", body = Problem, content_type = "application/problem+json")))]
fn cluster() {}

#[utoipa::path(get, path = "/v1/cluster/health", tag = "cluster", summary = "Whether the cluster is healthy (a gate for deploy hooks)",
    description = "Healthy: a leader is known, no bucket is lost, every current member answers the answering node's pings and none is in \
                   maintenance, no transition or state transfer runs, and the answering node's buckets have their replica attached. \
                   Members failed in the past do not count: they are not members any more. `shoal status --wait` waits for the same.",
    responses((status = 200, description = "Healthy", body = HealthView),
              (status = 503, description = "unhealthy (the detail names every reason), or the node cannot answer (not_ready, no_leader, ...)",
               body = Problem, content_type = "application/problem+json")))]
fn cluster_health() {}

#[utoipa::path(get, path = "/v1/cluster/map", tag = "cluster", summary = "The distribution map (or a watch for the next one)",
    description = "With `wait_version=N` the answer waits until the map's version is above N (a transition, a move, a failover) \
                   or `timeout` passes (then it is the map as it is): a client learns of every change without polling.",
    params(("wait_version" = Option<u64>, Query, description = "Answer once the map's version is above this"),
           ("timeout" = Option<String>, Query, description = "With wait_version only (400 without it): how long to wait at most, up to 5m (default 30s)")),
    responses((status = 200, description = "owners[b] owns bucket b", body = MapView)))]
fn cluster_map() {}

#[utoipa::path(get, path = "/v1/cluster/events", tag = "cluster", summary = "The cluster's event log (or a stream of it)",
    description = "What happened to the cluster, derived from the Raft log, so every member answers the same: joins, leaves, \
                   transitions, bucket moves (in batches), failures and promotions, lost buckets, maintenance, settings, rebalances. \
                   Each event has the Raft index of its entry, the time its proposer stamped, and the map version after it. \
                   The last 10,000 events are kept. With `follow=true` the answer is a `text/event-stream`: the events after \
                   `since` (or after `Last-Event-ID`), then every new one as it is applied, each with its index as id.",
    params(("since" = Option<u64>, Query, description = "Only events with a Raft index above this (default 0: all kept)"),
           ("limit" = Option<usize>, Query, description = "At most this many events per answer, 1 to 100000 (default 1000); an entry's events are never split"),
           ("follow" = Option<bool>, Query, description = "Stream the events as server-sent events")),
    responses((status = 200, description = "The events, and the `since` to ask with next (with follow=true: a text/event-stream of them)",
               content((EventsView = "application/json"), (String = "text/event-stream")))))]
fn cluster_events() {}

#[utoipa::path(get, path = "/v1/cluster/transfer", tag = "cluster", summary = "State transfer progress, per node",
    responses((status = 200, description = "Buckets done and total, bytes, rate, idle time of every member", body = TransferView)))]
fn cluster_transfer() {}

#[utoipa::path(get, path = "/v1/cluster/agents", tag = "cluster", summary = "The mirrors this node reads from (agent status)",
    responses((status = 200, description = "Per member: alive or dead, probability, and the counters of the kept karma blocks", body = AgentsView)))]
fn cluster_agents() {}

#[utoipa::path(get, path = "/v1/cluster/buckets", tag = "cluster", summary = "Every bucket's items, bytes, reads and writes (the leader's view)",
    description = "Members report their buckets' figures to the leader every `--stats-interval`; any member answers by asking the leader.",
    params(("sort" = Option<BucketSort>, Query, description = "bytes (default), items, reads, writes or bucket"),
           ("limit" = Option<usize>, Query, description = "At most this many buckets, 1 to 100000 (default: all)"),
           ("node" = Option<u64>, Query, description = "Only this member's buckets")),
    responses((status = 200, description = "Per member and per bucket", body = BucketsView),
              (status = 400, description = "bad_request: unknown sort, bad limit or node", body = Problem, content_type = "application/problem+json"),
              (status = 503, description = "no_leader or unavailable", body = Problem, content_type = "application/problem+json")))]
fn cluster_buckets() {}

#[utoipa::path(post, path = "/v1/cluster/rebalance", tag = "cluster", summary = "Balance the map by data (or plan it)",
    description = "The leader plans a map in which every member holds nearly the same bytes (or, with `node`, in which that member holds the average), \
                   moving as few bytes as possible, from the members' last bucket statistics. With `dry_run=true` it answers the plan and changes nothing; \
                   otherwise the plan goes through a transition and state transfer like a join.",
    params(("node" = Option<u64>, Query, description = "Bring only this member to the average"),
           ("dry_run" = Option<bool>, Query, description = "Plan only")),
    responses((status = 200, description = "The plan (and the map version it goes to)", body = RebalancePlan),
              (status = 400, description = "bad_request", body = Problem, content_type = "application/problem+json"),
              (status = 404, description = "unknown_resource: not a member", body = Problem, content_type = "application/problem+json"),
              (status = 409, description = "membership_change_in_progress (a transition, transfer or maintenance runs) or conflict (the map changed meanwhile)", body = Problem, content_type = "application/problem+json"),
              (status = 503, description = "stats_pending: a member has not reported yet; no_leader", body = Problem, content_type = "application/problem+json")))]
fn rebalance() {}

#[utoipa::path(post, path = "/v1/cluster/nodes/{id}/leave", tag = "cluster", summary = "Make a member leave",
    params(("id" = u64, Path, description = "The member's id"),
           ("force" = Option<bool>, Query, description = "Even while a transition or state transfer runs")),
    responses((status = 200, description = "Leaving: its buckets move, then it stops", body = LeaveOk),
              (status = 404, description = "unknown_resource: not a member", body = Problem, content_type = "application/problem+json"),
              (status = 409, description = "conflict (the last member) or membership_change_in_progress", body = Problem, content_type = "application/problem+json")))]
fn leave() {}

#[utoipa::path(post, path = "/v1/cluster/nodes/{id}/maintenance", tag = "cluster", summary = "Put a member into maintenance",
    description = "The member's replica holder serves its buckets until it comes back (same data dir) and takes them back; \
                   nothing is rebalanced and the member is not failed for its silence. Not back within the period, it is failed. \
                   The member itself checks that its replica is complete, so it must run. One member at a time, three members or more.",
    params(("id" = u64, Path, description = "The member's id")),
    request_body(content = Option<MaintenanceRequest>, description = "The period; no body or `{}`: 10 minutes"),
    responses((status = 200, description = "In maintenance: who serves its buckets, until when", body = MaintenanceView),
              (status = 404, description = "unknown_resource: not a member", body = Problem, content_type = "application/problem+json"),
              (status = 409, description = "maintenance_in_progress, too_few_members, replica_not_attached, replica_not_moved, peer_unreachable, replica_holder_changed or membership_change_in_progress", body = Problem, content_type = "application/problem+json")))]
fn enter_maintenance() {}

#[utoipa::path(delete, path = "/v1/cluster/nodes/{id}/maintenance", tag = "cluster", summary = "End a maintenance early",
    description = "The member is no longer spared: if it is not back, failure detection fails it and the map is rebalanced.",
    params(("id" = u64, Path, description = "The member's id")),
    responses((status = 200, description = "The maintenance as it was, `ended` set", body = MaintenanceView),
              (status = 409, description = "conflict: the member is not in maintenance", body = Problem, content_type = "application/problem+json")))]
fn end_maintenance() {}

#[utoipa::path(get, path = "/v1/cluster/config", tag = "cluster", summary = "The cluster settings in force",
    responses((status = 200, description = "Every setting", body = ClusterConfig)))]
fn config() {}

#[utoipa::path(put, path = "/v1/cluster/config", tag = "cluster", summary = "Change the cluster settings",
    request_body = ClusterConfig,
    responses((status = 200, description = "The settings now in force", body = ClusterConfig),
              (status = 400, description = "bad_request: unknown setting or value", body = Problem, content_type = "application/problem+json")))]
fn set_config() {}

#[utoipa::path(post, path = "/v1/cluster/lost/clear", tag = "cluster", summary = "Acknowledge lost buckets",
    description = "Buckets whose owner and replica were lost together answer `bucket_lost` until acknowledged here; then they serve again, empty.",
    request_body(content = Option<ClearLost>, description = "The buckets to acknowledge; no body, `{}` or an empty list: all"),
    responses((status = 200, description = "The buckets that were lost and now serve again", body = LostCleared)))]
fn clear_lost() {}

#[utoipa::path(get, path = "/v1/node", tag = "cluster", summary = "This node's own figures",
    responses((status = 200, description = "Figures", body = NodeStats)))]
fn node() {}

#[utoipa::path(get, path = "/livez", tag = "operations", summary = "Liveness",
    responses((status = 200, description = "The process serves", body = String, content_type = "text/plain"),
              (status = 503, description = "Not alive (the node's loops are stuck): restart it", body = String, content_type = "text/plain")))]
fn livez() {}

#[utoipa::path(get, path = "/readyz", tag = "operations", summary = "Readiness",
    params(("verbose" = Option<bool>, Query, description = "List each check")),
    responses((status = 200, description = "Ready", body = String, content_type = "text/plain"),
              (status = 503, description = "Not ready", body = String, content_type = "text/plain")))]
fn readyz() {}

#[utoipa::path(get, path = "/metrics", tag = "operations", summary = "Prometheus metrics",
    responses((status = 200, description = "Prometheus text format", body = String, content_type = "text/plain")))]
fn metrics() {}

#[utoipa::path(get, path = "/openapi.json", tag = "operations", summary = "This document",
    responses((status = 200, description = "OpenAPI 3", content_type = "application/json")))]
fn openapi() {}
