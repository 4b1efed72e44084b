//! The joiner's side of the join protocol (see `raft/DESIGN.md`): find a member's peer
//! address from its API address, register to get an id, and later ask to be admitted.
//! Every step is retried with backoff until it succeeds or the deadline passes.

use std::time::Duration;

use shoal_raft::{AdminClient, AdminRequest, AdminResponse, ControlError, NodeId};
use tokio::time::Instant;

use crate::peer::Peers;
use crate::transport::CallError;

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

/// Why a node could not get into its cluster.
#[derive(Debug, thiserror::Error)]
pub enum JoinError {
    /// The cluster refused it (for example: its id was retired); trying again cannot help.
    #[error("the cluster refused: {0}")]
    Refused(String),
    /// No seed took the request before the deadline.
    #[error("could not join through {seeds} before the deadline; last error: {last}")]
    Deadline {
        /// The seeds tried.
        seeds: String,
        /// What the last attempt met.
        last: Attempt,
    },
    /// A seed answered a step with something else.
    #[error("unexpected answer to {step}: {answer}")]
    Unexpected {
        /// The step.
        step: &'static str,
        /// The answer, as debug text.
        answer: String,
    },
    /// Admitted, but the membership did not reach this node in time.
    #[error("admitted, but the membership did not reach this node within {0:?}")]
    NotApplied(Duration),
    /// The data dir belongs to another cluster than the one the node joined.
    #[error("this data dir belongs to cluster {data_dir} but the node joined {joined:?}")]
    OtherCluster {
        /// The data dir's cluster.
        data_dir: String,
        /// The cluster joined, if it has an id.
        joined: Option<String>,
    },
    /// Discovery found no way in before its deadline.
    #[error(
        "discovery through {targets} gave up after {after}: still waiting for {waiting_for} (candidates: {candidates})"
    )]
    Undiscovered {
        /// The discovery targets.
        targets: String,
        /// How long it tried.
        after: String,
        /// What it was waiting for.
        waiting_for: String,
        /// The candidates of its last round.
        candidates: String,
    },
}

/// Why one attempt through one seed failed (the next is tried, with backoff).
#[derive(Debug, thiserror::Error)]
pub enum Attempt {
    /// No seed was given.
    #[error("no seed given")]
    NoSeed,
    /// The seed did not describe its cluster.
    #[error("{seed}: {error}")]
    Unreachable {
        /// The seed's API address.
        seed: String,
        /// What happened.
        error: CallError,
    },
    /// The seed is not a member yet.
    #[error("{0} is not a member of its cluster yet")]
    NotMember(String),
    /// The request through the seed failed.
    #[error("{seed}: {error}")]
    Control {
        /// The seed's API address.
        seed: String,
        /// What happened.
        error: ControlError,
    },
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
    async fn peer_of(&self, seed: &str) -> Result<String, Attempt> {
        let view = self
            .peers
            .cluster(seed, SEED_TIMEOUT)
            .await
            .map_err(|error| Attempt::Unreachable { seed: seed.to_string(), error })?;
        view.members
            .iter()
            .find(|m| m.id == view.node_id)
            .map(|m| m.peer_addr.clone())
            .ok_or_else(|| Attempt::NotMember(seed.to_string()))
    }

    /// Sends `request` through the seeds until one accepts it, with backoff, until the
    /// deadline. A rejection (for example: this id was retired) ends the attempt at once.
    async fn send(&self, request: &AdminRequest) -> Result<AdminResponse, JoinError> {
        let mut backoff = Duration::from_millis(200);
        let mut last = Attempt::NoSeed;
        loop {
            for seed in &self.seeds {
                let attempt = match self.peer_of(seed).await {
                    Ok(peer) => match self.admin.call(&peer, request).await {
                        Ok(response) => return Ok(response),
                        // A rejection is final; a running transfer (and the rest) is waited for.
                        Err(ControlError::Rejected { reason }) => return Err(JoinError::Refused(reason)),
                        Err(error) => Attempt::Control { seed: seed.clone(), error },
                    },
                    Err(attempt) => attempt,
                };
                tracing::info!(error = %attempt, retry_in = ?backoff, "join attempt failed; retrying");
                last = attempt;
            }
            if Instant::now() + backoff > self.deadline {
                return Err(JoinError::Deadline { seeds: self.seeds.join(", "), last });
            }
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(Duration::from_secs(2));
        }
    }

    /// Step 1: get an id for a node reachable at these addresses.
    pub async fn register(&self, api_addr: &str, peer_addr: &str, name: Option<&str>) -> Result<Registered, JoinError> {
        let request = AdminRequest::Register {
            api_addr: api_addr.into(),
            peer_addr: peer_addr.into(),
            name: name.map(str::to_string),
        };
        match self.send(&request).await? {
            AdminResponse::Registered { node_id, cluster_id } => Ok(Registered { node_id, cluster_id }),
            other => Err(JoinError::Unexpected { step: "register", answer: format!("{other:?}") }),
        }
    }

    /// Step 2: become a member (this node's Raft must be serving by now). Returns the map
    /// version that includes it.
    pub async fn admit(&self, node_id: NodeId) -> Result<u64, JoinError> {
        match self.send(&AdminRequest::Admit { node_id, force: self.force }).await? {
            AdminResponse::Admitted { map_version } => Ok(map_version),
            other => Err(JoinError::Unexpected { step: "admit", answer: format!("{other:?}") }),
        }
    }
}
