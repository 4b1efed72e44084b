//! Finding the cluster in a StatefulSet (R40): `--discover NAME:PORT` and the pod name.
//!
//! With an empty data dir a node asks every candidate (every address the headless Service
//! resolves to, ready or not, or the addresses listed) whether it is a member of a cluster:
//!
//! ```text
//!  a candidate knows a cluster? ──yes──▶ ordinal 0, or member "<set>-<k-1>" present? ──yes──▶ join it
//!            │ no                                         │ no: wait, ask again
//!            ▼                                            ▼
//!  ordinal 0 ──▶ bootstrap;  ordinal k > 0 (or none) ──▶ wait, ask again
//! ```
//!
//! So only ordinal 0 creates a cluster, and ordinal k joins after k-1 is a member: join
//! order — and with it replica placement — follows the ordinals even when every pod starts
//! at once (`podManagementPolicy: Parallel`). A node with a data dir restarts as the member it
//! was and does not discover at all.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use shoal_http_api::types::ClusterView;

/// What discovery decided.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// No candidate knows a cluster and this is ordinal 0: create one.
    Bootstrap,
    /// Join through these API addresses (members that answered).
    Join(Vec<String>),
}

/// How often the candidates are asked again.
const ASK_EVERY: Duration = Duration::from_secs(1);
/// How long one candidate may take to answer.
const ANSWER_TIMEOUT: Duration = Duration::from_secs(2);

/// The StatefulSet ordinal of a pod name: the number after its last `-` (`shoal-2` → 2).
pub fn ordinal_of(name: &str) -> Option<u32> {
    let (_, suffix) = name.rsplit_once('-')?;
    suffix.parse().ok()
}

/// The name of the pod with the ordinal before `name`'s (`shoal-2` → `shoal-1`).
pub fn predecessor_of(name: &str) -> Option<String> {
    let (set, _) = name.rsplit_once('-')?;
    let ordinal = ordinal_of(name)?;
    ordinal.checked_sub(1).map(|k| format!("{set}-{k}"))
}

/// This machine's host name (a pod's name, when `POD_NAME` is not set).
pub fn hostname() -> Option<String> {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .or_else(|| std::env::var("HOSTNAME").ok())
        .map(|h| h.trim().to_string())
        .filter(|h| !h.is_empty())
}

/// What the candidates said in one round.
#[derive(Debug, Default)]
struct Round {
    /// Candidates that are members of a cluster.
    members: Vec<String>,
    /// Names of the members those candidates list.
    names: BTreeSet<String>,
}

/// Decides how a node named `name` with an empty data dir gets into its cluster; gives up at
/// `timeout`.
pub async fn discover(targets: &[String], name: &str, timeout: Duration) -> Result<Decision, String> {
    let http = reqwest::Client::builder()
        .no_proxy()
        .local_address(shoal_raft::outgoing_ip())
        .timeout(ANSWER_TIMEOUT)
        .build()
        .map_err(|e| e.to_string())?;
    let ordinal = ordinal_of(name);
    let predecessor = predecessor_of(name);
    let deadline = Instant::now() + timeout;
    let mut last_said = Instant::now() - Duration::from_secs(60);
    loop {
        let candidates = resolve(targets).await;
        let round = ask(&http, &candidates).await;
        let waiting_for = match (&predecessor, round.members.is_empty()) {
            (_, false) if ordinal == Some(0) => return Ok(Decision::Join(round.members)),
            (Some(p), false) if round.names.contains(p) => return Ok(Decision::Join(round.members)),
            (Some(p), false) => format!("{p} to be a member"),
            (None, true) if ordinal == Some(0) => return Ok(Decision::Bootstrap),
            (None, false) => return Ok(Decision::Join(round.members)),
            (_, true) => "a candidate that knows the cluster (ordinal 0 creates it)".to_string(),
        };
        if Instant::now() >= deadline {
            return Err(format!(
                "discovery through {} gave up after {}: still waiting for {waiting_for} (candidates: {})",
                targets.join(","),
                humantime::format_duration(timeout),
                candidates.join(", ")
            ));
        }
        if last_said.elapsed() >= Duration::from_secs(10) {
            tracing::info!(name, candidates = candidates.len(), "discovery: waiting for {waiting_for}");
            last_said = Instant::now();
        }
        tokio::time::sleep(ASK_EVERY).await;
    }
}

/// Every address the targets resolve to, as `ip:port`, sorted.
async fn resolve(targets: &[String]) -> Vec<String> {
    let mut found = BTreeSet::new();
    for target in targets {
        match tokio::net::lookup_host(target.as_str()).await {
            Ok(addrs) => found.extend(addrs.map(|a| a.to_string())),
            Err(e) => tracing::debug!(target, error = %e, "discovery: cannot resolve"),
        }
    }
    found.into_iter().collect()
}

/// Asks every candidate for its view of the cluster.
async fn ask(http: &reqwest::Client, candidates: &[String]) -> Round {
    let answers = futures::future::join_all(candidates.iter().map(|c| async move {
        let view: ClusterView = http.get(format!("http://{c}/v1/cluster")).send().await.ok()?.json().await.ok()?;
        view.members.iter().any(|m| m.id == view.node_id).then_some((c.clone(), view))
    }))
    .await;
    let mut round = Round::default();
    for (candidate, view) in answers.into_iter().flatten() {
        round.names.extend(view.members.iter().filter_map(|m| m.name.clone()));
        round.members.push(candidate);
    }
    round
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ordinals_come_from_the_pod_name() {
        assert_eq!(ordinal_of("shoal-0"), Some(0));
        assert_eq!(ordinal_of("my-cache-12"), Some(12));
        assert_eq!(ordinal_of("shoal"), None);
        assert_eq!(ordinal_of("shoal-x"), None);
        assert_eq!(predecessor_of("my-cache-12").as_deref(), Some("my-cache-11"));
        assert_eq!(predecessor_of("shoal-0"), None);
    }
}
