//! Who may call what: the cluster secret on the peer listener, the optional admin token
//! on the cluster's write endpoints.
//!
//! - Every request to the peer listener (Raft, join, replication, transfer, shadows, pings)
//!   must carry the cluster secret in `x-shoal-cluster-secret` when the node has one; a
//!   missing or wrong secret gets 401 before any handler runs, so it changes nothing.
//! - With `--admin-token`, the write endpoints under `/v1/cluster` (leave, config, clearing
//!   lost buckets) need `Authorization: Bearer <token>`; reads stay open.
//! - With `--client-token`, the key API (`/v1/kv`, `/v1/bulk`, `/v1/tags`) needs it (or the
//!   admin token) the same way; a node forwarding a key operation to another sends it.
//!
//! Secrets are compared in constant time (`subtle`), are never logged, and print as `***` in
//! the configuration's debug output.

use std::sync::Arc;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{header, Method};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use shoal_http_api::ApiError;
use subtle::ConstantTimeEq;

/// A secret from the command line: compared in constant time, printed as `***`.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(Arc<str>);

impl Secret {
    /// The secret's text (to send it).
    pub fn expose(&self) -> &str {
        &self.0
    }

    /// Whether `given` is this secret, in time independent of where they differ.
    pub fn matches(&self, given: &[u8]) -> bool {
        self.0.as_bytes().ct_eq(given).into()
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("***")
    }
}

/// Parsing never fails, so that a bad value is never echoed in an error message (clap prints
/// refused values); [`Secret::problem`] says what is wrong without repeating it. Surrounding
/// whitespace (the newline of a secret file) is dropped.
impl std::str::FromStr for Secret {
    type Err = std::convert::Infallible;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Ok(Secret(s.trim().into()))
    }
}

impl Secret {
    /// Why this secret cannot be used, if it cannot.
    pub fn problem(&self) -> Option<&'static str> {
        if self.0.is_empty() {
            return Some("is empty");
        }
        if self.0.chars().any(|c| !c.is_ascii_graphic()) {
            return Some("must be printable ASCII without spaces (it travels in an HTTP header)");
        }
        if self.0.to_ascii_lowercase().contains("replace-me") {
            return Some("is the placeholder shipped in deploy/secret.yaml: make a real one (the file says how)");
        }
        None
    }
}

fn unauthorized(code: &'static str, detail: &str) -> Response {
    ApiError::Unauthorized { code, detail: detail.to_string() }.into_response()
}

/// Middleware of the peer listener: the cluster secret, when the node has one.
pub async fn require_secret(State(secret): State<Option<Secret>>, request: Request<Body>, next: Next) -> Response {
    if let Some(secret) = &secret {
        let given = request.headers().get(crate::transport::http::SECRET_HEADER).map(|v| v.as_bytes());
        if !given.is_some_and(|g| secret.matches(g)) {
            let what = if given.is_some() { "a wrong" } else { "no" };
            tracing::debug!(path = %request.uri().path(), "peer request with {what} cluster secret refused");
            return unauthorized(
                "cluster_secret_required",
                &format!(
                    "this endpoint needs the cluster secret (header {}); {what} secret was given",
                    crate::transport::http::SECRET_HEADER
                ),
            );
        }
    }
    next.run(request).await
}

/// The token of an `Authorization: Bearer <token>` header, if the request has one.
fn bearer(request: &Request<Body>) -> Option<&[u8]> {
    request
        .headers()
        .get(header::AUTHORIZATION)
        .map(|v| v.as_bytes())
        .filter(|v| v.len() > 7 && v[..7].eq_ignore_ascii_case(b"bearer "))
        .map(|v| &v[7..])
}

/// The tokens of the client API, when the node has them.
#[derive(Debug, Clone, Default)]
pub struct Tokens {
    /// `--admin-token`: the cluster's write endpoints (and the key API).
    pub admin: Option<Secret>,
    /// `--client-token`: the key API.
    pub client: Option<Secret>,
}

impl Tokens {
    /// Whether the node has a token at all (else the client API has no token check).
    pub fn any(&self) -> bool {
        self.admin.is_some() || self.client.is_some()
    }

    /// Why `request` is refused, if it is: with `--client-token`, the key API (`/v1/kv`,
    /// `/v1/bulk`, `/v1/tags`) needs it, or the admin token, as `Authorization: Bearer <token>`
    /// (other nodes forwarding a key operation carry the same client token); with
    /// `--admin-token`, so do the cluster's write endpoints (`/v1/cluster`, not GET or HEAD).
    fn refusal(&self, request: &Request<Body>) -> Option<Response> {
        let given = bearer(request);
        let is_admin = |g: &[u8]| self.admin.as_ref().is_some_and(|a| a.matches(g));
        if let Some(token) = &self.client {
            if shoal_http_api::is_key_path(request.uri().path())
                && !given.is_some_and(|g| is_admin(g) || token.matches(g))
            {
                return Some(unauthorized(
                    "client_token_required",
                    "the key API of this cluster needs the client token: Authorization: Bearer <token>",
                ));
            }
        }
        let guarded = request.method() != Method::GET
            && request.method() != Method::HEAD
            && request.uri().path().starts_with("/v1/cluster");
        if guarded && self.admin.is_some() && !given.is_some_and(is_admin) {
            return Some(unauthorized(
                "admin_token_required",
                "changing the cluster needs the admin token: Authorization: Bearer <token>",
            ));
        }
        None
    }
}

/// Middleware of the client API, layered only when the node has a token (see
/// [`Tokens::refusal`]): one layer for both tokens, since every layer costs each request a
/// boxed future and a clone of the service behind it.
pub async fn require_tokens(State(tokens): State<Tokens>, request: Request<Body>, next: Next) -> Response {
    match tokens.refusal(&request) {
        Some(refusal) => refusal,
        None => next.run(request).await,
    }
}

#[cfg(test)]
mod tests {
    use super::Secret;

    #[test]
    fn secrets_match_exactly_and_never_print() {
        let s: Secret = "s3cret\n".parse().expect("parses");
        assert_eq!(s.problem(), None);
        assert!(s.matches(b"s3cret"), "the newline of a secret file is dropped");
        assert!(!s.matches(b"s3cre"));
        assert!(!s.matches(b"s3cret!"));
        assert!(!s.matches(b""));
        assert_eq!(format!("{s:?}"), "***");
        assert!("".parse::<Secret>().expect("parses").problem().is_some());
        assert!("has space".parse::<Secret>().expect("parses").problem().is_some());
        let shipped = "REPLACE-ME-this-placeholder-is-not-a-secret".parse::<Secret>().expect("parses");
        assert!(shipped.problem().is_some_and(|p| p.contains("placeholder")), "the shipped placeholder is refused");
    }
}
