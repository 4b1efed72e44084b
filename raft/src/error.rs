//! The control plane's error type.

use serde::{Deserialize, Serialize};

use crate::distribution::NodeId;

/// Why a control-plane operation failed. Serializable, so a node that forwarded a request to
/// the leader hands the leader's answer back unchanged.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum ControlError {
    /// This node is not the leader; `leader` is a hint where to go.
    #[error("not the leader (leader: {leader:?})")]
    NotLeader {
        /// The leader's id, if known.
        leader: Option<NodeId>,
        /// The leader's internal address, if known.
        leader_peer_addr: Option<String>,
    },
    /// No leader is known, even after waiting; the cluster may have lost its quorum.
    #[error("no Raft leader is known: {detail}")]
    NoLeader {
        /// What was being attempted.
        detail: String,
    },
    /// The command does not fit the current state (for example: admit a node that never
    /// registered, or remove the last member). Nothing changed.
    #[error("{reason}")]
    Rejected {
        /// Why, for the operator.
        reason: String,
    },
    /// Raft is busy with another membership change (its joint consensus); try again soon.
    #[error("another membership change is in progress")]
    ChangeInProgress,
    /// A transition or a state transfer is running; membership may change again when it is
    /// done (or with `force`).
    #[error("membership change in progress: {reason}")]
    MembershipChangeInProgress {
        /// What is running.
        reason: String,
    },
    /// A bounded wait ran out.
    #[error("timed out: {what}")]
    Timeout {
        /// What was waited for.
        what: String,
    },
    /// A peer could not be reached or answered garbage.
    #[error("peer {peer}: {detail}")]
    Network {
        /// The peer's address.
        peer: String,
        /// What went wrong.
        detail: String,
    },
    /// Raft or its storage failed; the node cannot go on (fatal).
    #[error("raft failure: {detail}")]
    Fatal {
        /// What failed.
        detail: String,
    },
}

impl ControlError {
    /// Whether trying again later (possibly at another node) may succeed.
    pub fn is_retryable(&self) -> bool {
        matches!(
            self,
            ControlError::NotLeader { .. }
                | ControlError::NoLeader { .. }
                | ControlError::ChangeInProgress
                | ControlError::Timeout { .. }
                | ControlError::Network { .. }
        )
    }
}
