//! The command-line client: `shoal get|put|del|status|map|leave|node|lost`, talking to any node's API.

use std::io::{Read, Write};

use reqwest::{Method, Url};
use serde_json::Value;
use shoal_http_api::types::{
    AgentsView, BucketsView, ClusterView, EventsView, KeyList, MaintenanceView, MapView, ReadFrom, RebalancePlan,
    TransferView,
};
use shoal_http_api::Problem;

use crate::client::ClientError;
use crate::config::{ClientArgs, Command, ConfigCommand, LostCommand, NodeCommand, Output};

/// The exit status of a client command that failed otherwise.
pub const EXIT_OTHER: u8 = 1;
/// The exit status of a bad command line, or a request the node refused as malformed (400).
pub const EXIT_USAGE: u8 = 2;
/// The exit status when the key or member does not exist.
pub const EXIT_NOT_FOUND: u8 = 3;
/// The exit status when no node answered, the node answered 503, or the cluster is not
/// healthy (`status`).
pub const EXIT_UNAVAILABLE: u8 = 4;

/// Why a client command failed: the message to print and the exit status (see
/// [`crate::config::EXIT_CODES`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CliError {
    /// The exit status.
    pub exit: u8,
    /// What to print.
    pub message: String,
}

impl CliError {
    fn new(exit: u8, message: impl Into<String>) -> Self {
        CliError { exit, message: message.into() }
    }

    /// The exit status of an HTTP status.
    fn exit_of(status: u16) -> u8 {
        match status {
            400 => EXIT_USAGE,
            404 => EXIT_NOT_FOUND,
            503 => EXIT_UNAVAILABLE,
            _ => EXIT_OTHER,
        }
    }
}

impl std::fmt::Display for CliError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl From<String> for CliError {
    fn from(message: String) -> Self {
        CliError::new(EXIT_OTHER, message)
    }
}

impl From<ClientError> for CliError {
    fn from(e: ClientError) -> Self {
        let exit = match &e {
            ClientError::Connection { .. } | ClientError::Timeout { .. } => EXIT_UNAVAILABLE,
            other => other.status().map_or(EXIT_OTHER, CliError::exit_of),
        };
        CliError::new(exit, e.to_string())
    }
}

/// Runs a client command; the error is the message to print and the exit status.
pub async fn run(command: Command) -> Result<(), CliError> {
    match command {
        Command::Serve(_) | Command::Bench(_) | Command::Completions(_) => {
            Err("not a client command".to_string().into())
        }
        Command::Get(a) => get(&a).await,
        Command::Put(a) => put(&a).await,
        Command::Del(a) => del(&a).await,
        Command::Events(a) => events(&a).await,
        Command::Ls(a) => list(&a).await,
        Command::Config(ConfigCommand::Get(c)) => config_get(&c).await,
        Command::Config(ConfigCommand::Set(a)) => config_set(&a).await,
        Command::Status(a) => status(&a).await,
        Command::Lost(LostCommand::Clear(a)) => lost_clear(&a).await,
        Command::Map(c) => map(&c).await,
        Command::Agents(a) => agents(&a).await,
        Command::Node(NodeCommand::Maintenance(a)) => maintenance(&a).await,
        Command::Buckets(a) => buckets(&a).await,
        Command::Rebalance(a) => rebalance(&a).await,
        Command::Leave(a) | Command::Node(NodeCommand::Leave(a)) => leave(&a).await,
    }
}

/// Get a key: its value (raw bytes on a terminal, JSON with `-o json`).
async fn get(a: &crate::config::KeyArgs) -> Result<(), CliError> {
    let client = connect(&a.client).await?;
    let value = client.get(&a.key).await?;
    let Some(value) = value else {
        return Err(CliError::new(EXIT_NOT_FOUND, format!("no value for {:?} (not_found, HTTP 404)", a.key)));
    };
    match a.client.output {
        Output::Table => {
            // On a terminal the value ends its line, so the prompt does not follow it;
            // piped, the bytes go out as they are.
            use std::io::IsTerminal;
            let mut out = std::io::stdout();
            out.write_all(&value.bytes).map_err(|e| e.to_string())?;
            if out.is_terminal() && !value.bytes.ends_with(b"\n") {
                out.write_all(b"\n").map_err(|e| e.to_string())?;
            }
            Ok(())
        }
        Output::Json => {
            // Binary-safe, as the bulk API: text as `value`, anything else as `value_base64`.
            let mut out = serde_json::json!({
                "key": a.key, "version": value.version, "bucket": value.bucket, "node": value.node,
            });
            match std::str::from_utf8(&value.bytes) {
                Ok(text) => out["value"] = text.into(),
                Err(_) => {
                    use base64::Engine;
                    out["value_base64"] = base64::engine::general_purpose::STANDARD.encode(&value.bytes).into();
                }
            }
            print_json(&out)
        }
    }
}

/// Put a key, from the argument or standard input.
async fn put(a: &crate::config::PutArgs) -> Result<(), CliError> {
    let value = match a.value.as_deref() {
        Some(v) if v != "-" => v.as_bytes().to_vec(),
        _ => {
            let mut buf = Vec::new();
            std::io::stdin().read_to_end(&mut buf).map_err(|e| format!("reading stdin: {e}"))?;
            buf
        }
    };
    let duration = |flag: &str, text: Option<&str>| {
        text.map(|t| shoal_http_api::parse_duration(flag, t))
            .transpose()
            .map_err(|e| CliError::new(EXIT_USAGE, e.to_string()))
    };
    let priority = a
        .priority
        .as_deref()
        .map(|p| {
            shoal_http_api::types::Priority::from_name(p).ok_or_else(|| {
                CliError::new(
                    EXIT_USAGE,
                    format!(
                        "--priority must be low, below_normal, normal, above_normal, high or not_removable, not {p:?}"
                    ),
                )
            })
        })
        .transpose()?;
    let options = crate::client::PutOptions {
        ttl: duration("--ttl", a.ttl.as_deref())?,
        sliding: duration("--sliding", a.sliding.as_deref())?,
        cas: a.cas,
        mode: a.mode.as_deref().map(|m| {
            if m == "add" {
                crate::client::PutMode::Add
            } else {
                crate::client::PutMode::Replace
            }
        }),
        tags: a.tags.clone(),
        priority,
    };
    let client = connect(&a.client).await?;
    let ok = client.put_with(&a.key, value, &options).await?;
    match a.client.output {
        Output::Table => {
            println!("OK version={} bucket={} node={}", ok.version, ok.bucket, ok.node);
            Ok(())
        }
        Output::Json => print_json(&ok),
    }
}

/// Delete a key; a missing key exits as not found.
async fn del(a: &crate::config::KeyArgs) -> Result<(), CliError> {
    let client = connect(&a.client).await?;
    if !client.delete(&a.key).await? {
        return Err(CliError::new(EXIT_NOT_FOUND, format!("no value for {:?} (not_found, HTTP 404)", a.key)));
    }
    if a.client.output == Output::Table {
        println!("deleted");
    }
    Ok(())
}

/// Show the cluster configuration.
async fn config_get(c: &ClientArgs) -> Result<(), CliError> {
    let config: shoal_http_api::types::ClusterConfig =
        json(send(c, Method::GET, &["v1", "cluster", "config"], &[], None).await?).await?;
    show(c.output, &config, config_table)
}

/// Change one cluster setting.
async fn config_set(a: &crate::config::ConfigSetArgs) -> Result<(), CliError> {
    let value: Value = match a.setting.as_str() {
        "replication" => a.value.clone().into(),
        "auto_balance" => match a.value.as_str() {
            "true" | "on" => true.into(),
            "false" | "off" => false.into(),
            other => {
                return Err(CliError::new(EXIT_USAGE, format!("auto_balance is true or false, not {other:?}")));
            }
        },
        other => {
            return Err(CliError::new(
                EXIT_USAGE,
                format!("no setting {other:?}: the settings are replication and auto_balance"),
            ));
        }
    };
    let body = serde_json::to_vec(&serde_json::json!({ a.setting.as_str(): value })).map_err(|e| e.to_string())?;
    let config: shoal_http_api::types::ClusterConfig =
        json(send(&a.client, Method::PUT, &["v1", "cluster", "config"], &[], Some(body)).await?).await?;
    show(a.client.output, &config, config_table)
}

/// Show the cluster (once, waiting until it is healthy, or every second).
async fn status(a: &crate::config::StatusArgs) -> Result<(), CliError> {
    let c = &a.client;
    let deadline = tokio::time::Instant::now() + a.timeout;
    // While it waits, a spinner on standard error says for what (drawn in place on a
    // terminal only, so scripts see nothing of it).
    let waiting = a.wait.then(waiting_spinner);
    loop {
        let view: ClusterView = match send(c, Method::GET, &["v1", "cluster"], &[], None).await {
            Ok(r) => json(r).await?,
            // Waiting, a node that does not answer yet (or answers 503) is a cluster
            // that is not healthy yet; any other refusal (a missing token, a bad
            // address) will not change by waiting and fails at once.
            Err(e) if a.wait && e.exit == EXIT_UNAVAILABLE && tokio::time::Instant::now() < deadline => {
                tracing::debug!(error = %e, "waiting for the node");
                if let Some(spinner) = &waiting {
                    spinner.set_message(format!("waiting for the node to answer: {e}"));
                }
                tokio::time::sleep(std::time::Duration::from_millis(500)).await;
                continue;
            }
            Err(e) => return Err(e),
        };
        let reasons = view.unhealthy();
        let unhealthy = (!reasons.is_empty()).then(|| reasons.join("; "));
        if let (Some(spinner), Some(why)) = (&waiting, &unhealthy) {
            spinner.set_message(format!("waiting: {why}"));
        }
        if a.wait && unhealthy.is_some() {
            if tokio::time::Instant::now() >= deadline {
                if let Some(spinner) = &waiting {
                    spinner.finish_and_clear();
                }
                return Err(CliError::new(
                    EXIT_UNAVAILABLE,
                    format!(
                        "the cluster is not healthy after {}: {}",
                        humantime::format_duration(a.timeout),
                        unhealthy.unwrap_or_default()
                    ),
                ));
            }
            tokio::time::sleep(std::time::Duration::from_millis(500)).await;
            continue;
        }
        if let Some(spinner) = &waiting {
            spinner.finish_and_clear();
        }
        let moving = view.transition.is_some() || view.transfer.is_some();
        let transfer: Option<TransferView> = if moving {
            Some(json(send(c, Method::GET, &["v1", "cluster", "transfer"], &[], None).await?).await?)
        } else {
            None
        };
        let frame = match c.output {
            Output::Table => format!("{}{}", status_table(&view), transfer_bars(&view, transfer.as_ref())),
            Output::Json => {
                serde_json::to_string_pretty(&serde_json::json!({ "cluster": view, "transfer": transfer }))
                    .map_err(|e| e.to_string())?
                    + "\n"
            }
        };
        if !a.watch {
            print!("{frame}");
            // Scripts can trust the status: no leader, or lost buckets, is a failure.
            return match view.unavailable() {
                Some(why) => Err(CliError::new(EXIT_UNAVAILABLE, why)),
                None => Ok(()),
            };
        }
        // On a terminal each frame replaces the last (cursor home, clear screen);
        // into a pipe frames follow each other, one per second, until Ctrl-C.
        let mut out = std::io::stdout().lock();
        if std::io::IsTerminal::is_terminal(&out) {
            write!(out, "\x1b[H\x1b[2J").map_err(|e| e.to_string())?;
        }
        write!(out, "{frame}").and_then(|_| out.flush()).map_err(|e| e.to_string())?;
        drop(out);
        tokio::time::sleep(std::time::Duration::from_secs(1)).await;
    }
}

/// Acknowledge lost buckets, which then serve again, empty.
async fn lost_clear(a: &crate::config::LostClearArgs) -> Result<(), CliError> {
    let body = serde_json::to_vec(&serde_json::json!({ "buckets": a.buckets })).map_err(|e| e.to_string())?;
    let response = send(&a.client, Method::POST, &["v1", "cluster", "lost", "clear"], &[], Some(body)).await?;
    let cleared: shoal_http_api::types::LostCleared = json(response).await?;
    match a.client.output {
        Output::Table if cleared.cleared.is_empty() => {
            println!("no bucket was lost");
            Ok(())
        }
        Output::Table => {
            let ids: Vec<usize> = cleared.cleared.iter().map(|&b| usize::from(b)).collect();
            println!("{} lost buckets acknowledged; they serve again, empty: {}", ids.len(), ranges(&ids));
            Ok(())
        }
        Output::Json => print_json(&cleared),
    }
}

/// Show the distribution map.
async fn map(c: &ClientArgs) -> Result<(), CliError> {
    let map: MapView = json(send(c, Method::GET, &["v1", "cluster", "map"], &[], None).await?).await?;
    match c.output {
        Output::Table => {
            print!("{}", map_table(&map));
            Ok(())
        }
        Output::Json => print_json(&map),
    }
}

/// Show the members' agents.
async fn agents(a: &crate::config::AgentsArgs) -> Result<(), CliError> {
    let view: AgentsView = json(send(&a.client, Method::GET, &["v1", "cluster", "agents"], &[], None).await?).await?;
    match a.client.output {
        Output::Table => {
            print!("{}", agents_table(&view, a.blocks));
            Ok(())
        }
        Output::Json => print_json(&view),
    }
}

/// Put a member into maintenance, or end it.
async fn maintenance(a: &crate::config::MaintenanceArgs) -> Result<(), CliError> {
    let view: ClusterView = json(send(&a.client, Method::GET, &["v1", "cluster"], &[], None).await?).await?;
    let id = member_id(&view, &a.node)?.to_string();
    let path = ["v1", "cluster", "nodes", &id, "maintenance"];
    let response = if a.end {
        send(&a.client, Method::DELETE, &path, &[], None).await?
    } else {
        let body = serde_json::to_vec(&serde_json::json!({ "for": a.period })).map_err(|e| e.to_string())?;
        send(&a.client, Method::POST, &path, &[], Some(body)).await?
    };
    let m: MaintenanceView = json(response).await?;
    match a.client.output {
        Output::Table if m.ended => {
            println!("node {} is no longer in maintenance; if it is not back, the cluster fails it", m.node_id);
            Ok(())
        }
        Output::Table => {
            print!("{}", maintenance_line(&m));
            Ok(())
        }
        Output::Json => print_json(&m),
    }
}

/// Show bucket statistics.
async fn buckets(a: &crate::config::BucketsArgs) -> Result<(), CliError> {
    let mut query = vec![("sort", a.sort.clone()), ("limit", a.top.to_string())];
    query.extend(node_param(&a.client, a.node.as_deref()).await?);
    let query: Vec<(&str, &str)> = query.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let view: BucketsView =
        json(send(&a.client, Method::GET, &["v1", "cluster", "buckets"], &query, None).await?).await?;
    show(a.client.output, &view, buckets_table)
}

/// Rebalance the map by data (or show the plan).
async fn rebalance(a: &crate::config::RebalanceArgs) -> Result<(), CliError> {
    let mut query: Vec<(&str, String)> = node_param(&a.client, a.node.as_deref()).await?.into_iter().collect();
    if a.dry_run {
        query.push(("dry_run", "true".to_string()));
    }
    let query: Vec<(&str, &str)> = query.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let plan: RebalancePlan =
        json(send(&a.client, Method::POST, &["v1", "cluster", "rebalance"], &query, None).await?).await?;
    show(a.client.output, &plan, plan_table)
}

/// Make a member leave the cluster.
async fn leave(a: &crate::config::LeaveArgs) -> Result<(), CliError> {
    let view: ClusterView = json(send(&a.client, Method::GET, &["v1", "cluster"], &[], None).await?).await?;
    let id = member_id(&view, &a.node)?.to_string();
    let response = send(&a.client, Method::POST, &["v1", "cluster", "nodes", &id, "leave"], &[], None).await?;
    let body: Value = response.json().await.map_err(|e| e.to_string())?;
    match a.client.output {
        Output::Table => {
            println!(
                "node {} is leaving: its buckets move to the other members, then it stops (map version {}; `shoal status --watch` shows the progress)",
                body["node_id"], body["map_version"]
            );
            if let Some(warning) = body["warning"].as_str() {
                eprintln!("warning: {warning}");
            }
            Ok(())
        }
        Output::Json => print_json(&body),
    }
}

async fn send(
    client: &ClientArgs,
    method: Method,
    path: &[&str],
    query: &[(&str, &str)],
    body: Option<Vec<u8>>,
) -> Result<reqwest::Response, CliError> {
    let ca = ca_pem(client)?;
    let usage = |m: String| CliError::new(EXIT_USAGE, m);
    let mut http = reqwest::Client::builder().no_proxy();
    if let Some(pem) = &ca {
        // Only the given CA: nodes' certificates come from the cluster's own CA.
        http = http.tls_built_in_root_certs(false);
        for cert in reqwest::Certificate::from_pem_bundle(pem).map_err(|e| usage(format!("--cacert: {e}")))? {
            http = http.add_root_certificate(cert);
        }
    }
    let http = http.build().map_err(|e| e.to_string())?;
    // The nodes of --addr in turn, as etcdctl --endpoints: the next one when a node cannot be
    // reached; any answer (an error too) is the answer.
    let mut unreachable = Vec::new();
    let mut answered = None;
    for addr in client.addrs() {
        let base = match (addr.contains("://"), &ca) {
            (true, _) => addr.to_string(),
            (false, Some(_)) => format!("https://{addr}"),
            (false, None) => format!("http://{addr}"),
        };
        let mut url = Url::parse(&base).map_err(|e| usage(format!("--addr {addr:?}: {e}")))?;
        url.path_segments_mut().map_err(|_| usage(format!("--addr {addr:?} cannot have a path")))?.clear().extend(path);
        let token = shoal_http_api::token_for(url.path(), client.client_token.as_ref(), client.admin_token.as_ref());
        let mut request = http.request(method.clone(), url).query(query);
        if let Some(token) = token {
            request = request.bearer_auth(token.expose());
        }
        if let Some(body) = &body {
            request = request.body(body.clone());
        }
        match request.send().await {
            Ok(response) => {
                answered = Some(response);
                break;
            }
            Err(e) => unreachable.push(format!("{addr}: {}", crate::client::error_chain(&e))),
        }
    }
    let Some(response) = answered else {
        return Err(CliError::new(EXIT_UNAVAILABLE, format!("cannot reach {}", unreachable.join("; "))));
    };
    if response.status().is_success() {
        return Ok(response);
    }
    let status = response.status();
    let exit = CliError::exit_of(status.as_u16());
    match response.json::<Problem>().await {
        Ok(p) => Err(CliError::new(exit, format!("{} ({}, HTTP {})", p.detail, p.code, p.status))),
        Err(_) => Err(CliError::new(exit, format!("HTTP {status}"))),
    }
}

/// The PEM text of `--cacert`, checked to hold certificates (a usage error otherwise).
fn ca_pem(client: &ClientArgs) -> Result<Option<Vec<u8>>, CliError> {
    let Some(path) = &client.cacert else { return Ok(None) };
    let usage = |m: String| CliError::new(EXIT_USAGE, format!("--cacert {}: {m}", path.display()));
    let pem = std::fs::read(path).map_err(|e| usage(e.to_string()))?;
    crate::tls::ca_from_pem(&pem).map_err(usage)?;
    Ok(Some(pem))
}

/// A client of the cluster `--addr` belongs to, for one command (no map watch).
async fn connect(client: &ClientArgs) -> Result<crate::client::Client, CliError> {
    let addrs: Vec<&str> = client.addrs().into_iter().map(|a| a.trim_end_matches('/')).collect();
    let mut builder = crate::client::Client::builder(addrs).watch_map(false);
    if let Some(pem) = ca_pem(client)? {
        builder = builder.tls_ca(pem);
    }
    if let Some(token) = &client.admin_token {
        builder = builder.admin_token(token.expose());
    }
    if let Some(token) = &client.client_token {
        builder = builder.client_token(token.expose());
    }
    builder.connect().await.map_err(|e| CliError::new(EXIT_UNAVAILABLE, format!("cannot reach {}: {e}", client.addr)))
}

/// `shoal events`: the last events (or those after `--since`), then, with `-f`, each new
/// one as the cluster applies it.
async fn events(a: &crate::config::EventsArgs) -> Result<(), CliError> {
    let c = &a.client;
    let mut since = a.since;
    if since == 0 {
        // The last `--last` events: find where they start.
        let mut page: EventsView = json(send(c, Method::GET, &["v1", "cluster", "events"], &[], None).await?).await?;
        let mut all = Vec::new();
        loop {
            let next = page.next;
            let done = page.events.is_empty();
            all.extend(page.events);
            if done {
                break;
            }
            let query = [("since", next.to_string())];
            let query: Vec<(&str, &str)> = query.iter().map(|(k, v)| (*k, v.as_str())).collect();
            page = json(send(c, Method::GET, &["v1", "cluster", "events"], &query, None).await?).await?;
        }
        let skip = all.len().saturating_sub(a.last);
        for event in &all[skip..] {
            print_event(c.output, event)?;
        }
        since = page.next;
    }
    let since_text = since.to_string();
    if !a.follow {
        let page: EventsView =
            json(send(c, Method::GET, &["v1", "cluster", "events"], &[("since", &since_text)], None).await?).await?;
        for event in &page.events {
            print_event(c.output, event)?;
        }
        return Ok(());
    }
    // Followed: the node streams server-sent events, one `data:` line of JSON each.
    let query = [("since", since_text.as_str()), ("follow", "true")];
    let mut response = send(c, Method::GET, &["v1", "cluster", "events"], &query, None).await?;
    let mut pending = String::new();
    while let Some(chunk) = response.chunk().await.map_err(|e| format!("the event stream broke: {e}"))? {
        pending.push_str(&String::from_utf8_lossy(&chunk));
        while let Some(end) = pending.find("\n\n") {
            let message: String = pending.drain(..end + 2).collect();
            for data in message.lines().filter_map(|l| l.strip_prefix("data:")) {
                let event: shoal_raft::Event =
                    serde_json::from_str(data.trim_start()).map_err(|e| format!("a bad event: {e}"))?;
                print_event(c.output, &event)?;
            }
        }
    }
    Err(CliError::new(EXIT_UNAVAILABLE, "the node closed the event stream"))
}

fn print_event(output: Output, e: &shoal_raft::Event) -> Result<(), String> {
    match output {
        Output::Json => println!("{}", serde_json::to_string(e).map_err(|e| e.to_string())?),
        Output::Table => {
            let when =
                humantime::format_rfc3339_seconds(std::time::UNIX_EPOCH + std::time::Duration::from_millis(e.time_ms));
            println!("{when}  #{:<7} map {:<6} {}", e.index, e.map_version, e.message);
        }
    }
    std::io::stdout().flush().map_err(|e| e.to_string())
}

/// The id of the member named `node` (its name, or its id).
/// `node=ID` for a member given by name or id, if one is given.
async fn node_param(client: &ClientArgs, node: Option<&str>) -> Result<Option<(&'static str, String)>, CliError> {
    let Some(node) = node else { return Ok(None) };
    let view: ClusterView = json(send(client, Method::GET, &["v1", "cluster"], &[], None).await?).await?;
    Ok(Some(("node", member_id(&view, node)?.to_string())))
}

/// Prints `value` as the table `table` makes of it, or as JSON.
fn show<T: serde::Serialize>(output: Output, value: &T, table: fn(&T) -> String) -> Result<(), CliError> {
    match output {
        Output::Table => {
            print!("{}", table(value));
            Ok(())
        }
        Output::Json => print_json(value),
    }
}

fn member_id(view: &ClusterView, node: &str) -> Result<u64, CliError> {
    if let Some(m) = view.members.iter().find(|m| crate::discover::name_of(m).as_deref() == Some(node)) {
        return Ok(m.id);
    }
    match node.parse::<u64>() {
        Ok(id) => Ok(id),
        Err(_) => {
            let known: Vec<String> =
                view.members.iter().map(|m| format!("{} ({})", m.name.as_deref().unwrap_or("-"), m.id)).collect();
            Err(CliError::new(EXIT_NOT_FOUND, format!("no member is named {node:?}; members: {}", known.join(", "))))
        }
    }
}

async fn json<T: serde::de::DeserializeOwned>(response: reqwest::Response) -> Result<T, CliError> {
    response.json().await.map_err(|e| CliError::from(format!("unexpected answer: {e}")))
}

/// `shoal ls`: one page of keys, or with `--all` every page.
async fn list(a: &crate::config::LsArgs) -> Result<(), CliError> {
    let path: Vec<&str> = match &a.tag {
        Some(tag) => vec!["v1", "tags", tag],
        None => vec!["v1", "kv"],
    };
    let mut after = a.start_after.clone();
    let mut all = KeyList::default();
    loop {
        let mut query = vec![("limit", a.limit.to_string())];
        query.extend(a.prefix.clone().map(|p| ("prefix", p)));
        query.extend(after.clone().map(|s| ("start_after", s)));
        let query: Vec<(&str, &str)> = query.iter().map(|(k, v)| (*k, v.as_str())).collect();
        let page: KeyList = json(send(&a.client, Method::GET, &path, &query, None).await?).await?;
        all.keys.extend(page.keys);
        all.incomplete |= page.incomplete;
        all.errors.extend(page.errors);
        (all.more, all.next) = (page.more, page.next);
        match (&all.next, a.all && all.more) {
            (Some(next), true) => after = Some(next.clone()),
            _ => break,
        }
    }
    show(a.client.output, &all, keys_table)?;
    if all.incomplete {
        return Err(CliError::new(EXIT_UNAVAILABLE, "some members did not answer: the list may miss keys"));
    }
    Ok(())
}

/// `shoal ls` as a table.
fn keys_table(list: &KeyList) -> String {
    let rows =
        list.keys.iter().map(|k| vec![k.key.clone(), k.bucket.to_string(), k.version.to_string(), k.node.to_string()]);
    let mut out = table(&["KEY", "BUCKET", "VERSION", "NODE"], &[1, 2, 3], rows);
    for e in &list.errors {
        out.push_str(&format!("member {} did not answer: {}\n", e.node, e.detail));
    }
    if let Some(next) = list.next.as_ref().filter(|_| list.more) {
        out.push_str(&format!("(more: shoal ls --start-after {next:?})\n"));
    }
    out
}

/// `shoal config get` as a table.
fn config_table(config: &shoal_http_api::types::ClusterConfig) -> String {
    format!(
        "replication   {}\nauto_balance  {}\n",
        config.replication.as_deref().unwrap_or("-"),
        config.auto_balance.map_or("-".to_string(), |a| a.to_string())
    )
}

fn print_json(value: &impl serde::Serialize) -> Result<(), CliError> {
    println!("{}", serde_json::to_string_pretty(value).map_err(|e| e.to_string())?);
    Ok(())
}

fn or_dash<T: ToString>(v: Option<T>) -> String {
    v.map(|v| v.to_string()).unwrap_or_else(|| "-".into())
}

/// The spinner `shoal status --wait` shows on standard error while the cluster is not healthy.
fn waiting_spinner() -> indicatif::ProgressBar {
    let spinner = indicatif::ProgressBar::new_spinner();
    spinner.set_message("waiting for the cluster");
    spinner.enable_steady_tick(std::time::Duration::from_millis(120));
    spinner
}

/// A plain table, as kubectl prints them: no borders, each column as wide as its widest cell
/// (long pod DNS names fit), never wrapped; the columns in `right` hold figures and are
/// right-aligned.
fn table(header: &[&str], right: &[usize], rows: impl IntoIterator<Item = Vec<String>>) -> String {
    let mut t = comfy_table::Table::new();
    t.load_preset(comfy_table::presets::NOTHING)
        .set_content_arrangement(comfy_table::ContentArrangement::Disabled)
        .set_header(header.to_vec());
    for row in rows {
        t.add_row(row);
    }
    for &i in right {
        if let Some(column) = t.column_mut(i) {
            column.set_cell_alignment(comfy_table::CellAlignment::Right);
        }
    }
    let mut out = String::new();
    for line in t.lines() {
        out.push_str(line.trim_end());
        out.push('\n');
    }
    out
}

/// `shoal status` as a table.
pub fn status_table(view: &ClusterView) -> String {
    let mut out = format!(
        "cluster {}  leader {}  map version {}  voters {}\n",
        view.cluster_id,
        or_dash(view.leader),
        view.map_version,
        view.voters
    );
    let members = view.members.iter().map(|m| {
        vec![
            m.id.to_string(),
            m.name.as_deref().unwrap_or("-").to_string(),
            m.api_addr.clone(),
            m.peer_addr.clone(),
            m.role.to_string(),
            m.buckets.to_string(),
            or_dash(m.items),
            or_dash(m.bytes),
            or_dash(m.replica_on),
            match (&m.version, &m.revision) {
                (Some(v), Some(r)) => format!("{v} ({r})"),
                (v, _) => or_dash(v.as_deref()),
            },
        ]
    });
    out.push_str(&table(
        &["ID", "NAME", "API", "PEER", "ROLE", "BUCKETS", "ITEMS", "BYTES", "REPLICA_ON", "VERSION"],
        &[0, 5, 6, 7, 8],
        members,
    ));
    if let Some(r) = &view.replication {
        out.push_str(&format!(
            "replication {}: {}/{} buckets attached, queue {} ({:.1}s behind), replica store {} items\n",
            r.mode, r.attached_buckets, r.owned_buckets, r.queue_depth, r.lag_seconds, r.replica_items
        ));
    }
    let pfail: Vec<String> = view
        .peers
        .iter()
        .filter(|p| p.state == shoal_http_api::types::PeerState::Pfail)
        .map(|p| p.node_id.to_string())
        .collect();
    if !pfail.is_empty() {
        out.push_str(&format!("pfail in node {}'s view: {}\n", view.node_id, pfail.join(", ")));
    }
    if !view.failed.is_empty() {
        out.push_str(&format!("failed members: {:?}\n", view.failed));
    }
    if let Some(m) = &view.maintenance {
        out.push_str(&maintenance_line(m));
    }
    if !view.lost_buckets.is_empty() {
        out.push_str(&format!(
            "LOST buckets (no copy left; POST /v1/cluster/lost/clear to serve them again): {}\n",
            ranges(&view.lost_buckets.iter().map(|&b| usize::from(b)).collect::<Vec<_>>())
        ));
    }
    out
}

/// The maintenance line of `shoal status`.
fn maintenance_line(m: &MaintenanceView) -> String {
    match m.phase.as_str() {
        "preparing" => format!(
            "MAINTENANCE: node {} prepares (the replica it holds moves to the next member); it still serves its buckets and must not stop yet\n",
            m.node_id
        ),
        "returned" => format!(
            "MAINTENANCE: node {} is back and takes its buckets back from node {}: {} left\n",
            m.node_id, m.served_by, m.buckets_left
        ),
        _ => format!(
            "MAINTENANCE: node {} may be stopped: node {} serves its {} buckets; {:.0}s left for it to come back before it is failed\n",
            m.node_id, m.served_by, m.buckets_left, m.seconds_left
        ),
    }
}

/// The transition and transfer lines of `shoal status`: one progress bar per receiving node.
pub fn transfer_bars(view: &ClusterView, transfer: Option<&TransferView>) -> String {
    let mut out = String::new();
    if let Some(t) = &view.transition {
        out.push_str(&format!(
            "transition to map version {}: {} of {} members acknowledged\n",
            t.to_version,
            t.acked.len(),
            view.members.len()
        ));
    }
    let Some(transfer) = transfer else { return out };
    let away = view.maintenance.as_ref().filter(|m| m.phase != "returned");
    match (&view.transfer, away) {
        // The map a maintenance keeps: nothing moves until the member returns.
        (Some(summary), Some(m)) => out.push_str(&format!(
            "state transfer to map version {}: {} buckets go back to node {} when it returns from maintenance\n",
            summary.target_version, summary.buckets_left, m.node_id
        )),
        (Some(summary), None) => out.push_str(&format!(
            "state transfer to map version {}: {} buckets left{}\n",
            summary.target_version,
            summary.buckets_left,
            if summary.blocking { "" } else { " (flag cleared: membership may change)" }
        )),
        (None, _) => {}
    }
    // Only nodes pulling now: a node whose round ended (or was replaced by a newer target)
    // keeps its last counts, which would read as a stuck bar.
    for n in transfer.nodes.iter().filter(|n| n.active && n.buckets_total > 0) {
        const WIDTH: u64 = 30;
        let filled = (n.buckets_done * WIDTH).checked_div(n.buckets_total).unwrap_or(0).min(WIDTH) as usize;
        out.push_str(&format!(
            "  node {:>3} [{}{}] {:>4}/{:<4} buckets  {:>10}  {:>8}/s  idle {:.0}s\n",
            n.node_id,
            "#".repeat(filled),
            "-".repeat(WIDTH as usize - filled),
            n.buckets_done,
            n.buckets_total,
            bytesize::ByteSize(n.bytes).to_string(),
            bytesize::ByteSize(n.rate_bytes_per_sec as u64).to_string(),
            n.idle_seconds
        ));
    }
    for f in &transfer.errors {
        out.push_str(&format!("  node {:>3} did not answer: {}\n", f.node, f.detail));
    }
    out
}

/// `shoal map` as a table: each node's bucket count and bucket ranges.
pub fn map_table(map: &MapView) -> String {
    let rows = map.nodes.iter().map(|node| {
        let mine: Vec<usize> = (0..map.owners.len()).filter(|&b| map.owners[b] == node.id).collect();
        vec![node.id.to_string(), mine.len().to_string(), ranges(&mine)]
    });
    format!("map version {}\n{}", map.version, table(&["NODE", "COUNT", "BUCKETS"], &[0, 1], rows))
}

/// Bytes in the largest unit that keeps a whole number in front (1.5 MiB).
fn human_bytes(bytes: u64) -> String {
    let units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < units.len() {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} B")
    } else {
        format!("{value:.1} {}", units[unit])
    }
}

/// A balance ratio as text: "none" when a member holds nothing while another holds data (the
/// ratio has no finite value).
fn ratio_text(ratio: f64) -> String {
    if ratio >= 1e9 {
        "none (a member holds no data)".to_string()
    } else {
        format!("{ratio:.2}")
    }
}

/// A rate per second as text, one decimal; never "-0.0" (a rate measured over a bucket that
/// moved may come out a hair below zero).
fn rate(per_sec: f64) -> String {
    format!("{:.1}", if per_sec > 0.0 { per_sec } else { 0.0 })
}

/// `shoal buckets` as a table: each member's share, then the buckets asked for.
pub fn buckets_table(view: &BucketsView) -> String {
    let ratio = ratio_text(view.balance_ratio);
    let mut out = format!(
        "leader {}, map version {}, {} in {} items, fullest/emptiest {ratio}, auto balance {}\n",
        view.leader,
        view.map_version,
        human_bytes(view.total_bytes),
        view.total_items,
        if view.auto_balance { "on" } else { "off" }
    );
    if !view.missing.is_empty() {
        out.push_str(&format!("no recent report from members {:?}\n", view.missing));
    }
    let nodes = view.nodes.iter().map(|n| {
        let ago = n.reported_ms_ago.map_or_else(|| "never".to_string(), |ms| format!("{:.1}s ago", ms as f64 / 1000.0));
        vec![
            n.node_id.to_string(),
            n.buckets.to_string(),
            n.items.to_string(),
            human_bytes(n.bytes),
            rate(n.reads_per_sec),
            rate(n.writes_per_sec),
            ago,
        ]
    });
    out.push_str(&table(
        &["NODE", "BUCKETS", "ITEMS", "BYTES", "READS/S", "WRITES/S", "REPORTED"],
        &[0, 1, 2, 3, 4, 5, 6],
        nodes,
    ));
    let buckets = view.buckets.iter().map(|b| {
        vec![
            b.bucket.to_string(),
            b.owner.to_string(),
            b.items.to_string(),
            human_bytes(b.bytes),
            rate(b.reads_per_sec),
            rate(b.writes_per_sec),
        ]
    });
    out.push('\n');
    out.push_str(&table(&["BUCKET", "OWNER", "ITEMS", "BYTES", "READS/S", "WRITES/S"], &[0, 1, 2, 3, 4, 5], buckets));
    out
}

/// `shoal rebalance` as text: what moves, each member before and after, how long.
pub fn plan_table(plan: &RebalancePlan) -> String {
    let ratio = ratio_text;
    let what = match plan.node_id {
        Some(n) => format!("node {n} to the average"),
        None => "every member".to_string(),
    };
    let mut out = if plan.moves.is_empty() {
        format!("balancing {what}: nothing to move (fullest/emptiest {})\n", ratio(plan.ratio_before))
    } else {
        format!(
            "balancing {what}{}: {} buckets, {} (at least {} must move), fullest/emptiest {} -> {}\n",
            if plan.dry_run { " (dry run: nothing changed)" } else { "" },
            plan.moves.len(),
            human_bytes(plan.bytes_moved),
            human_bytes(plan.lower_bound_bytes),
            ratio(plan.ratio_before),
            ratio(plan.ratio_after)
        )
    };
    match (plan.estimated_seconds, plan.transfer_rate_bytes_per_sec) {
        (Some(s), Some(r)) => out.push_str(&format!("about {s:.0} s at {}/s\n", human_bytes(r as u64))),
        _ if !plan.moves.is_empty() => out.push_str("no transfer rate measured yet: no estimate\n"),
        _ => {}
    }
    if let Some(v) = plan.to_version {
        out.push_str(&format!("started: map version {v}; follow it with `shoal status`\n"));
    }
    let nodes = plan.nodes.iter().map(|n| {
        vec![
            n.node_id.to_string(),
            human_bytes(n.bytes_before),
            human_bytes(n.bytes_after),
            n.buckets_before.to_string(),
            n.buckets_after.to_string(),
        ]
    });
    out.push_str(&table(&["NODE", "BYTES NOW", "BYTES AFTER", "BUCKETS", "AFTER"], &[0, 1, 2, 3, 4], nodes));
    out
}

/// The agent status as a table: one line per mirror and karma block, newest first.
pub fn agents_table(view: &AgentsView, blocks: usize) -> String {
    let ms = |v: Option<f64>| v.map_or_else(|| "-".to_string(), |v| format!("{v:.2}"));
    let mut out = format!(
        "node {} reads from {}, strategy {}, karma {} s, pings every {} ms\n",
        view.node_id,
        match view.read_from {
            ReadFrom::Owner => "owners (unless a read asks for mirrors)",
            ReadFrom::Mirrors => "mirrors",
        },
        view.strategy,
        view.period_karma_ms / 1000,
        view.ping_interval_ms
    );
    let mut rows = Vec::new();
    for a in &view.agents {
        let state = if a.alive { "alive" } else { "dead" };
        for (i, b) in a.blocks.iter().take(blocks.max(1)).enumerate() {
            let (node, state, prob) = if i == 0 {
                (a.node_id.to_string(), state.to_string(), format!("{:.3}", a.probability))
            } else {
                (String::new(), String::new(), String::new())
            };
            rows.push(vec![
                node,
                state,
                prob,
                format!("{}s", b.began_ms_ago / 1000),
                b.requests.to_string(),
                b.successes.to_string(),
                b.errors.connect.to_string(),
                b.errors.timeout.to_string(),
                b.errors.refused.to_string(),
                b.errors.wrong_answer.to_string(),
                format!("{}ms", ms(b.avg_latency_ms.or(b.ping_avg_latency_ms))),
                b.pings.to_string(),
            ]);
        }
    }
    let header = [
        "NODE",
        "STATE",
        "PROB",
        "BLOCK AGO",
        "REQUESTS",
        "SUCCESS",
        "CONNECT",
        "TIMEOUT",
        "REFUSED",
        "WRONG",
        "LATENCY",
        "PINGS",
    ];
    out.push_str(&table(&header, &[0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], rows));
    out
}

/// `[0,1,2,5,7,8]` → `0-2,5,7-8`.
fn ranges(sorted: &[usize]) -> String {
    let mut parts = Vec::new();
    let mut i = 0;
    while i < sorted.len() {
        let start = sorted[i];
        while i + 1 < sorted.len() && sorted[i + 1] == sorted[i] + 1 {
            i += 1;
        }
        parts.push(if sorted[i] == start { start.to_string() } else { format!("{start}-{}", sorted[i]) });
        i += 1;
    }
    parts.join(",")
}

#[cfg(test)]
mod tests {
    use shoal_http_api::types::{
        AgentErrors, AgentView, AgentsView, ClusterView, KarmaBlockView, ReadFrom, TransferStatus, TransferSummary,
        TransferView,
    };

    #[test]
    fn the_agent_status_shows_each_mirror_and_its_newest_blocks() {
        let block = |requests, timeout| KarmaBlockView {
            began_ms_ago: 1500,
            requests,
            successes: requests - timeout,
            errors: AgentErrors { timeout, ..AgentErrors::default() },
            avg_latency_ms: Some(0.25),
            pings: 3,
            ping_avg_latency_ms: None,
        };
        let view = AgentsView {
            node_id: 1,
            read_from: ReadFrom::Mirrors,
            strategy: "nodeads".into(),
            period_karma_ms: 60_000,
            ping_interval_ms: 1000,
            max_staleness_ms: 0,
            agents: vec![
                AgentView {
                    node_id: 2,
                    alive: true,
                    probability: 0.75,
                    last_answer_ms_ago: Some(10),
                    blocks: vec![block(40, 0), block(30, 0), block(20, 0)],
                },
                AgentView {
                    node_id: 3,
                    alive: false,
                    probability: 0.25,
                    last_answer_ms_ago: None,
                    blocks: vec![block(9, 4)],
                },
            ],
        };
        let table = super::agents_table(&view, 2);
        let lines: Vec<&str> = table.lines().collect();
        assert_eq!(lines.len(), 2 + 2 + 1, "{table}");
        assert!(lines[0].contains("strategy nodeads"), "{table}");
        assert!(lines[2].contains("alive") && lines[2].contains("0.750") && lines[2].contains("40"), "{table}");
        assert!(lines[4].contains("dead") && lines[4].contains("0.250"), "{table}");
        assert!(lines[4].split_whitespace().any(|w| w == "4"), "the timeouts: {table}");
    }

    #[test]
    fn a_running_transfer_is_drawn_as_progress_bars() {
        let view = ClusterView {
            cluster_id: "c".into(),
            node_id: 1,
            leader: Some(1),
            map_version: 7,
            voters: 3,
            members: vec![],
            transition: None,
            transfer: Some(TransferSummary { target_version: 3, buckets_left: 250, blocking: true }),
            peers: vec![],
            replication: None,
            failed: vec![],
            lost_buckets: vec![],
            maintenance: None,
        };
        let status = TransferStatus {
            node_id: 2,
            active: true,
            buckets_done: 250,
            buckets_total: 500,
            bytes: 2_000_000,
            rate_bytes_per_sec: 1_000_000.0,
            idle_seconds: 0.0,
            buckets_pulled_total: 250,
            bytes_sent_total: 0,
            bytes_received_total: 2_000_000,
        };
        let transfer = TransferView {
            target_version: Some(3),
            buckets_left: 250,
            blocking: true,
            nodes: vec![status.clone()],
            errors: vec![],
        };
        let text = super::transfer_bars(&view, Some(&transfer));
        assert!(text.contains("state transfer to map version 3: 250 buckets left"), "{text}");
        assert!(text.contains("[###############---------------]  250/500"), "{text}");
        // A node whose round ended draws no bar (it would look stuck at its last count).
        let ended = TransferStatus { node_id: 3, active: false, buckets_done: 0, buckets_total: 84, ..status };
        let transfer = TransferView { nodes: vec![ended], ..transfer };
        let text = super::transfer_bars(&view, Some(&transfer));
        assert!(!text.contains("/84"), "{text}");
        // During a maintenance the map it keeps is no transfer that runs: its buckets wait for
        // the member; and a member that only prepares is not said to be away.
        let maintenance = |phase: &str| shoal_http_api::types::MaintenanceView {
            node_id: 2,
            served_by: 3,
            since_ms: 0,
            until_ms: 600_000,
            seconds_left: 600.0,
            phase: phase.into(),
            returned: phase == "returned",
            buckets_left: 333,
            ended: false,
        };
        let away = ClusterView { maintenance: Some(maintenance("away")), ..view.clone() };
        let text = super::transfer_bars(&away, Some(&transfer));
        assert!(text.contains("250 buckets go back to node 2 when it returns from maintenance"), "{text}");
        let preparing = super::maintenance_line(&maintenance("preparing"));
        assert!(preparing.contains("prepares") && !preparing.contains("may be stopped"), "{preparing}");
        assert!(super::maintenance_line(&maintenance("away")).contains("may be stopped"));
    }

    #[test]
    fn bucket_figures_print_no_inf_and_no_negative_zero() {
        assert_eq!(super::rate(-0.0), "0.0");
        assert_eq!(super::rate(-0.01), "0.0");
        assert_eq!(super::rate(2.25), "2.2");
        assert!(!super::ratio_text(f64::INFINITY).contains("inf"));
        assert!(!super::ratio_text(1e12).contains("inf"));
        assert_eq!(super::ratio_text(1.5), "1.50");
    }

    #[test]
    fn a_failed_condition_says_what_the_key_holds() {
        let e = crate::client::ClientError::PreconditionFailed {
            current_version: Some(2),
            detail: "precondition failed".into(),
        };
        assert_eq!(e.to_string(), "precondition failed: the key's current version is 2");
        let e = crate::client::ClientError::PreconditionFailed { current_version: None, detail: "x".into() };
        assert_eq!(e.to_string(), "precondition failed: the key does not exist");
    }

    #[test]
    fn status_columns_fit_long_pod_names() {
        let member = |id: u64, name: &str| shoal_http_api::types::MemberView {
            id,
            name: Some(name.to_string()),
            api_addr: format!("{name}.shoal-headless.a-long-namespace.svc.cluster.local:7000"),
            peer_addr: format!("{name}.shoal-headless.a-long-namespace.svc.cluster.local:17000"),
            join_seq: id,
            role: "voter".into(),
            buckets: 500,
            replica_on: Some(3 - id),
            leaving: false,
            items: Some(12_345),
            bytes: None,
            version: Some("0.1.0".into()),
            revision: None,
        };
        let view = ClusterView {
            cluster_id: "c".into(),
            node_id: 1,
            leader: Some(1),
            map_version: 7,
            voters: 2,
            members: vec![member(1, "shoal-0"), member(2, "second-cluster-shoal-1")],
            transition: None,
            transfer: None,
            peers: vec![],
            replication: None,
            failed: vec![],
            lost_buckets: vec![],
            maintenance: None,
        };
        let text = super::status_table(&view);
        let lines: Vec<&str> = text.lines().skip(1).collect();
        // Every column starts where its header does, however long the names before it.
        let role = lines[0].find("ROLE").expect("a ROLE column");
        let version = lines[0].find("VERSION").expect("a VERSION column");
        for row in &lines[1..3] {
            assert_eq!(row[role..].split_whitespace().next(), Some("voter"), "{text}");
            assert_eq!(row[version..].trim(), "0.1.0", "{text}");
            assert!(row.contains(".svc.cluster.local:17000"), "not cut: {text}");
        }
    }

    #[test]
    fn ranges_compress_runs() {
        assert_eq!(super::ranges(&[0, 1, 2, 5, 7, 8]), "0-2,5,7-8");
        assert_eq!(super::ranges(&[]), "");
    }
}
