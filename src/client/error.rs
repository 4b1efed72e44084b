//! [`ClientError`]: what an operation of the client can fail with, with the server's problem
//! code kept.

use std::time::Duration;

use reqwest::StatusCode;
use shoal_http_api::Problem;
use shoal_raft::NodeId;

/// Why an operation failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ClientError {
    /// A condition (`cas`, `mode`) did not hold; the item's current version when there is one.
    #[error("precondition failed: {}", match current_version {
        Some(v) => format!("the key's current version is {v}"),
        None => "the key does not exist".to_string(),
    })]
    PreconditionFailed {
        /// The item's current version (absent: it has none).
        current_version: Option<u64>,
        /// The server's words.
        detail: String,
    },
    /// The key or value is over its limit.
    #[error("too large: {detail} ({code})")]
    TooLarge {
        /// The server's code (`key_too_large`, `value_too_large`).
        code: String,
        /// The server's words.
        detail: String,
    },
    /// The request was refused as it stands (400, 401, 404 other than a missing key, 409, 507...).
    #[error("{detail} ({code}, HTTP {status})")]
    Refused {
        /// The HTTP status.
        status: u16,
        /// The server's code.
        code: String,
        /// The server's words.
        detail: String,
    },
    /// The cluster could not serve it within the request timeout; it was not applied, unless
    /// `code` is `outcome_unknown` (the replica may have stored a write the owner took back).
    #[error("unavailable: {detail} ({code})")]
    Unavailable {
        /// The server's code (`no_leader`, `bucket_moving`, `replication_failed`...).
        code: String,
        /// The server's words.
        detail: String,
        /// When the server said to try again.
        retry_after: Option<Duration>,
    },
    /// The server failed otherwise (5xx).
    #[error("server error: {detail} ({code}, HTTP {status})")]
    Server {
        /// The HTTP status.
        status: u16,
        /// The server's code.
        code: String,
        /// The server's words.
        detail: String,
    },
    /// A node could not be reached (through its grace window), or the connection broke.
    #[error("connection to {} failed: {detail}{}", node.map_or("the node".to_string(), |n| format!("node {n}")), if *maybe_applied { " (the write may have been applied)" } else { "" })]
    Connection {
        /// The node, when one is known.
        node: Option<NodeId>,
        /// What happened.
        detail: String,
        /// Whether a write may have reached the node before the connection broke.
        maybe_applied: bool,
    },
    /// The request timeout passed.
    #[error("timed out{}", if *maybe_applied { " (the write may have been applied)" } else { "" })]
    Timeout {
        /// Whether a write may have been applied.
        maybe_applied: bool,
    },
    /// An answer the client cannot read, or no map to route by.
    #[error("{0}")]
    Protocol(String),
}

impl ClientError {
    /// The server's problem code, if the server answered.
    pub fn code(&self) -> Option<&str> {
        match self {
            ClientError::PreconditionFailed { .. } => Some(shoal_http_api::code::PRECONDITION_FAILED),
            ClientError::TooLarge { code, .. }
            | ClientError::Refused { code, .. }
            | ClientError::Unavailable { code, .. }
            | ClientError::Server { code, .. } => Some(code),
            _ => None,
        }
    }

    /// The HTTP status, if the server answered.
    pub fn status(&self) -> Option<u16> {
        match self {
            ClientError::PreconditionFailed { .. } => Some(412),
            ClientError::TooLarge { .. } => Some(413),
            ClientError::Unavailable { .. } => Some(503),
            ClientError::Refused { status, .. } | ClientError::Server { status, .. } => Some(*status),
            _ => None,
        }
    }

    pub(super) fn connection(node: Option<NodeId>, e: &reqwest::Error, maybe_applied: bool) -> Self {
        if e.is_timeout() {
            return ClientError::Timeout { maybe_applied };
        }
        ClientError::Connection { node, detail: error_chain(e), maybe_applied }
    }
}

/// An error with every cause under it ("error sending request" alone hides why), and a hint
/// when the cause is the wrong scheme: TLS spoken to a node that answers plain HTTP.
pub fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut text = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        let more = c.to_string();
        if !text.contains(&more) {
            text.push_str(": ");
            text.push_str(&more);
        }
        cause = c.source();
    }
    if text.contains("InvalidContentType") {
        text.push_str(" (the node answered plain HTTP: use http:// and no --cacert)");
    }
    text
}

/// The `Retry-After` of an answer.
pub(super) fn retry_after(response: &reqwest::Response) -> Option<Duration> {
    let value = response.headers().get(reqwest::header::RETRY_AFTER)?;
    value.to_str().ok()?.trim().parse::<u64>().ok().map(Duration::from_secs)
}

/// The error an unsuccessful answer stands for.
pub(super) async fn problem(response: reqwest::Response) -> ClientError {
    let status = response.status();
    let retry = retry_after(&response);
    let text = response.text().await.unwrap_or_default();
    let (code, detail, current_version) = match serde_json::from_str::<Problem>(&text) {
        Ok(p) => (p.code, p.detail, p.current_version),
        Err(_) => (format!("http_{}", status.as_u16()), text.chars().take(200).collect(), None),
    };
    match status {
        StatusCode::PRECONDITION_FAILED => ClientError::PreconditionFailed { current_version, detail },
        StatusCode::PAYLOAD_TOO_LARGE => ClientError::TooLarge { code, detail },
        StatusCode::SERVICE_UNAVAILABLE => ClientError::Unavailable { code, detail, retry_after: retry },
        s if s.is_server_error() => ClientError::Server { status: s.as_u16(), code, detail },
        s => ClientError::Refused { status: s.as_u16(), code, detail },
    }
}

/// The answer if it is a success, else its error.
pub(super) async fn check(response: reqwest::Response) -> Result<reqwest::Response, ClientError> {
    if response.status().is_success() {
        Ok(response)
    } else {
        Err(problem(response).await)
    }
}
