//! Finding the cluster in a StatefulSet: `--discover NAME:PORT` and the pod name.
//!
//! With an empty data dir a node asks every candidate (every address the headless Service
//! resolves to, ready or not, or the addresses listed) whether it is a member of a cluster:
//!
//! ```text
//!  a candidate is a member? ──yes──▶ ordinal 0, or member "<set>-<k-1>" present? ──yes──▶ join
//!            │ no                                       │ no: wait, ask again
//!            ▼
//!  ordinal 0, and every candidate said "no data, not a member" 3 rounds in a row ──▶ bootstrap
//!  otherwise ──▶ wait, ask again
//! ```
//!
//! So only ordinal 0 creates a cluster, and ordinal k joins after k-1 is a member: join
//! order — and with it replica placement — follows the ordinals even when every pod starts
//! at once (`podManagementPolicy: Parallel`). A node with a data dir restarts as the member it
//! was and does not discover at all.
//!
//! **No second cluster.** Ordinal 0 bootstraps only on definite answers: a node that is
//! still starting serves [`starting_router`], which says whether it has a data dir (a member
//! coming back: `starting`) or not (`not_member`). Silence, a refused connection or a
//! `starting` answer never count as "no cluster", so a pod that lost its volume does not start
//! a second cluster while the members restart; and candidates that name different clusters
//! stop discovery until an operator looks.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use axum::http::StatusCode;
use axum::response::IntoResponse;
use shoal_http_api::types::{ClusterView, MemberView};
use shoal_http_api::{ApiError, Unavailable};

use crate::join::JoinError;
use crate::peer::Peers;
use crate::transport::CallError;

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
/// How long one candidate may take to answer (its `/v1/cluster` asks every member for its
/// stats with a 2 s bound).
const ANSWER_TIMEOUT: Duration = Duration::from_secs(5);
/// Rounds in a row in which every candidate must say "no data, not a member" before ordinal 0
/// bootstraps.
const EMPTY_ROUNDS: u32 = 3;

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

/// A member's name: the one it gave, else the first DNS label of its API address when that is
/// a host name (`shoal-1.shoal-headless...:7000` → `shoal-1`; members that joined without a
/// name).
pub fn name_of(member: &MemberView) -> Option<String> {
    if let Some(name) = &member.name {
        return Some(name.clone());
    }
    let host = member.api_addr.rsplit_once(':').map_or(member.api_addr.as_str(), |(h, _)| h);
    if host.parse::<std::net::IpAddr>().is_ok() || host.starts_with('[') {
        return None;
    }
    host.split('.').next().filter(|l| !l.is_empty()).map(str::to_string)
}

/// This machine's host name (a pod's name, when `POD_NAME` is not set).
pub fn hostname() -> Option<String> {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .or_else(|| std::env::var("HOSTNAME").ok())
        .map(|h| h.trim().to_string())
        .filter(|h| !h.is_empty())
}

/// What the API listener answers while the node starts (discovery, joining, opening Raft):
/// `/livez` 200; `/readyz` and everything else 503, with code `starting` when this node has
/// a data dir (it is a member coming back) and `not_member` when it has none.
pub fn starting_router(has_data: bool) -> axum::Router {
    let code = if has_data { Unavailable::Starting } else { Unavailable::NotMember };
    let detail = if has_data {
        "this node is starting with its data dir (a member coming back); retry"
    } else {
        "this node is starting with an empty data dir: it is not a member of a cluster yet"
    };
    axum::Router::new()
        .route("/livez", axum::routing::get(|| async { "ok\n" }))
        .route(
            "/readyz",
            axum::routing::get(move || async move {
                (StatusCode::SERVICE_UNAVAILABLE, format!("[-] member failed: {detail}\nnot ready\n"))
            }),
        )
        .fallback(move || async move { ApiError::unavailable(code, detail).into_response() })
}

/// What the candidates said in one round.
#[derive(Debug, Default)]
struct Round {
    /// Candidates that are members of a cluster.
    members: Vec<String>,
    /// Names of the members those candidates list.
    names: BTreeSet<String>,
    /// The clusters they belong to.
    clusters: BTreeSet<String>,
    /// Candidates that said they have no data and are no member.
    empty: usize,
}

/// Decides how a node named `name` with an empty data dir gets into its cluster; gives up at
/// `timeout`.
pub async fn discover(peers: &Peers, targets: &[String], name: &str, timeout: Duration) -> Result<Decision, JoinError> {
    let ordinal = ordinal_of(name);
    let predecessor = predecessor_of(name);
    let deadline = Instant::now() + timeout;
    let mut last_said = Instant::now() - Duration::from_secs(60);
    let mut empty_rounds = 0;
    loop {
        let candidates = resolve(targets).await;
        let round = ask(peers, &candidates).await;
        let all_empty = !candidates.is_empty() && round.empty == candidates.len();
        empty_rounds = if all_empty { empty_rounds + 1 } else { 0 };
        let waiting_for = if round.clusters.len() > 1 {
            format!("an operator: the candidates belong to different clusters {:?}", round.clusters)
        } else if !round.members.is_empty() {
            match &predecessor {
                _ if ordinal == Some(0) => return Ok(Decision::Join(round.members)),
                Some(p) if round.names.contains(p) => return Ok(Decision::Join(round.members)),
                Some(p) => format!("{p} to be a member"),
                None => return Ok(Decision::Join(round.members)),
            }
        } else if ordinal == Some(0) && empty_rounds >= EMPTY_ROUNDS {
            return Ok(Decision::Bootstrap);
        } else if ordinal == Some(0) {
            "every candidate to answer that it has no data (then ordinal 0 creates the cluster)".to_string()
        } else {
            "a candidate that is a member (ordinal 0 creates the cluster)".to_string()
        };
        if Instant::now() >= deadline {
            return Err(JoinError::Undiscovered {
                targets: targets.join(","),
                after: humantime::format_duration(timeout).to_string(),
                waiting_for,
                candidates: candidates.join(", "),
            });
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

/// One candidate's answer.
enum Answer {
    Member(Box<ClusterView>),
    Empty,
    Unknown,
}

/// Asks every candidate for its view of the cluster.
async fn ask(peers: &Peers, candidates: &[String]) -> Round {
    let answers = futures::future::join_all(candidates.iter().map(|c| async move {
        let answer = match peers.cluster(c, ANSWER_TIMEOUT).await {
            Ok(view) if view.members.iter().any(|m| m.id == view.node_id) => Answer::Member(Box::new(view)),
            Err(CallError::Api(e)) if e.unavailable_code() == Some(Unavailable::NotMember) => Answer::Empty,
            _ => Answer::Unknown,
        };
        (c.clone(), answer)
    }))
    .await;
    let mut round = Round::default();
    for (candidate, answer) in answers {
        match answer {
            Answer::Member(view) => {
                round.names.extend(view.members.iter().filter_map(name_of));
                round.clusters.insert(view.cluster_id.clone());
                round.members.push(candidate);
            }
            Answer::Empty => round.empty += 1,
            Answer::Unknown => {}
        }
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

    #[test]
    fn members_without_a_name_are_named_by_their_host() {
        let member = |name: Option<&str>, api: &str| MemberView {
            id: 1,
            name: name.map(str::to_string),
            api_addr: api.into(),
            peer_addr: String::new(),
            join_seq: 1,
            role: "voter".into(),
            buckets: 0,
            replica_on: None,
            leaving: false,
            items: None,
            bytes: None,
            version: None,
            revision: None,
        };
        assert_eq!(name_of(&member(Some("a-1"), "10.0.0.1:7000")).as_deref(), Some("a-1"));
        assert_eq!(name_of(&member(None, "shoal-1.shoal-headless.ns.svc:7000")).as_deref(), Some("shoal-1"));
        assert_eq!(name_of(&member(None, "10.0.0.1:7000")), None);
        assert_eq!(name_of(&member(None, "[::1]:7000")), None);
    }
}
