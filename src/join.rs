//! The joiner's side of the join protocol (see `raft/DESIGN.md`): find a member's peer
//! address from its API address, register to get an id, and later ask to be admitted.
//! Every step is retried with backoff until it succeeds or the deadline passes.

use std::time::Duration;

use shoal_raft::{AdminClient, AdminRequest, AdminResponse, ControlError, NodeId};
use tokio::time::Instant;

use crate::peer::Peers;

/// How long a seed may take to describe its cluster.
const SEED_TIMEOUT: Duration = Duration::from_secs(5);

/// Registration's answer: the new id and the cluster's id.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Registered {
    /// The id the cluster assigned.
    pub node_id: NodeId,
    /// The cluster's id.
    pub cluster_id: String,
}

/// Talks to the members listed in `--join`.
pub struct Joiner {
    seeds: Vec<String>,
    peers: Peers,
    admin: AdminClient,
    deadline: Instant,
    force: bool,
}

impl Joiner {
    /// A joiner that gives up at `now + timeout`.
    pub fn new(seeds: Vec<String>, timeout: Duration, peers: Peers, admin: AdminClient) -> Self {
        Joiner { seeds, peers, admin, deadline: Instant::now() + timeout, force: false }
    }

    /// Joins even while a transition or a state transfer runs (`--force-join`).
    pub fn forced(mut self, force: bool) -> Self {
        self.force = force;
        self
    }

    /// The peer address of the member answering at API address `seed`.
    async fn peer_of(&self, seed: &str) -> Result<String, String> {
        let view = self.peers.cluster(seed, SEED_TIMEOUT).await.map_err(|e| format!("{seed}: {e}"))?;
        view.members
            .iter()
            .find(|m| m.id == view.node_id)
            .map(|m| m.peer_addr.clone())
            .ok_or_else(|| format!("{seed} is not a member of its cluster yet"))
    }

    /// Sends `request` through the seeds until one accepts it, with backoff, until the
    /// deadline. A rejection (for example: this id was retired) ends the attempt at once.
    async fn send(&self, request: &AdminRequest) -> Result<AdminResponse, String> {
        let mut backoff = Duration::from_millis(200);
        let mut last_error = String::from("no seed given");
        loop {
            for seed in &self.seeds {
                let result = match self.peer_of(seed).await {
                    // A running transfer is worth waiting for; a rejection is final.
                    Ok(peer) => self.admin.call(&peer, request).await.map_err(|e| match e {
                        ControlError::Rejected { reason } => Err(reason),
                        other => Ok(format!("{seed}: {other}")),
                    }),
                    Err(e) => Err(Ok(e)),
                };
                match result {
                    Ok(response) => return Ok(response),
                    Err(Err(rejected)) => return Err(format!("the cluster refused: {rejected}")),
                    Err(Ok(retryable)) => {
                        tracing::info!(error = %retryable, retry_in = ?backoff, "join attempt failed; retrying");
                        last_error = retryable;
                    }
                }
            }
            if Instant::now() + backoff > self.deadline {
                return Err(format!(
                    "could not join through {} before the deadline; last error: {last_error}",
                    self.seeds.join(", ")
                ));
            }
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(Duration::from_secs(2));
        }
    }

    /// Step 1: get an id for a node reachable at these addresses.
    pub async fn register(&self, api_addr: &str, peer_addr: &str, name: Option<&str>) -> Result<Registered, String> {
        let request = AdminRequest::Register {
            api_addr: api_addr.into(),
            peer_addr: peer_addr.into(),
            name: name.map(str::to_string),
        };
        match self.send(&request).await? {
            AdminResponse::Registered { node_id, cluster_id } => Ok(Registered { node_id, cluster_id }),
            other => Err(format!("unexpected answer to register: {other:?}")),
        }
    }

    /// Step 2: become a member (this node's Raft must be serving by now). Returns the map
    /// version that includes it.
    pub async fn admit(&self, node_id: NodeId) -> Result<u64, String> {
        match self.send(&AdminRequest::Admit { node_id, force: self.force }).await? {
            AdminResponse::Admitted { map_version } => Ok(map_version),
            other => Err(format!("unexpected answer to admit: {other:?}")),
        }
    }
}
