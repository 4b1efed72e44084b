//! [`ApiService`]: the client API as one service. `GET`, `PUT` and `DELETE` of
//! `/v1/kv/{key}` — nearly every request a cache serves — go straight to their handlers;
//! everything else goes through the router.
//!
//! The router is general: it matches the path against every route, stores the path
//! parameters in the request's extensions, and runs each handler behind boxed services and
//! futures. For the key routes that is about a fifth of a request's server instructions
//! (callgrind, one node: ~4k of ~22k per PUT). The fast path decodes the key the way the
//! router's `{*key}` does (percent-decoded, UTF-8) and calls the same handler, so both answer
//! alike (the key route tests run through this service; `the_fast_path_answers_as_the_router`
//! compares the two).

use std::convert::Infallible;
use std::future::Future;
use std::sync::Arc;
use std::task::{Context, Poll};

use axum::body::{Body, HttpBody};
use axum::extract::Request;
use axum::http::Method;
use axum::response::Response;
use axum::Router;
use bytes::Bytes;
use futures_util::future::{BoxFuture, Either};
use tower_service::Service;

use crate::api::ShoalApi;
use crate::error::ApiError;
use crate::kv;

/// The client API over `node`: the key routes' fast path, when `fast`, ahead of `router`
/// (which answers everything else; a node with tokens layers their checks on the router and
/// turns the fast path off, so every request passes the checks).
pub fn service<N: ShoalApi>(node: Arc<N>, router: Router, fast: bool) -> ApiService<N> {
    ApiService { node, router, fast }
}

/// See [`service`].
pub struct ApiService<N> {
    node: Arc<N>,
    router: Router,
    fast: bool,
}

impl<N> Clone for ApiService<N> {
    fn clone(&self) -> Self {
        ApiService { node: self.node.clone(), router: self.router.clone(), fast: self.fast }
    }
}

/// Whether a request of `method` to `path` (as sent, query included) is one of the key
/// routes': `GET`, `PUT` or `DELETE` of `/v1/kv/...`. The client listener answers these
/// without hyper's connection machinery (`http_server::simple` in the node).
pub fn is_key_request(method: &Method, path: &str) -> bool {
    (method == Method::GET || method == Method::PUT || method == Method::DELETE) && path.starts_with("/v1/kv/")
}

/// The decoded key of a `/v1/kv/{key}` path, or `None` for any other path (and for an empty
/// key, which the router answers as an unknown route).
fn key_of(path: &str) -> Option<Result<String, ApiError>> {
    let raw = path.strip_prefix("/v1/kv/").filter(|k| !k.is_empty())?;
    Some(
        percent_encoding::percent_decode_str(raw)
            .decode_utf8()
            .map(|k| k.into_owned())
            .map_err(|_| ApiError::BadRequest("invalid path: Invalid URL: Invalid UTF-8 in `key`".into())),
    )
}

type Answer = BoxFuture<'static, Result<Response, Infallible>>;

impl<N: ShoalApi> ApiService<N> {
    /// The answer to a key request (see [`is_key_request`]) straight from its handler, as a
    /// future of its own type (not boxed, as [`Service::call`]'s must be): for a connection
    /// that awaits it in place. Any other request, and every request when the fast path is
    /// off, comes back for [`Service::call`].
    #[allow(clippy::result_large_err)]
    pub fn key_answer(&self, request: Request) -> Result<impl Future<Output = Response> + Send + 'static, Request> {
        if !self.fast || !is_key_request(request.method(), request.uri().path()) {
            return Err(request);
        }
        let Some(key) = key_of(request.uri().path()) else { return Err(request) };
        let node = self.node.clone();
        Ok(match *request.method() {
            Method::GET => Either::Left(Either::Left(kv::get_key_at(node, key, request))),
            Method::PUT => Either::Left(Either::Right(kv::put_key_at(node, key, request))),
            _ => Either::Right(kv::delete_key_at(node, key, request)),
        })
    }
}

impl<N, B> Service<Request<B>> for ApiService<N>
where
    N: ShoalApi,
    B: HttpBody<Data = Bytes> + Send + 'static,
    B::Error: Into<axum::BoxError>,
{
    type Response = Response;
    type Error = Infallible;
    type Future = Either<Answer, <Router as Service<Request>>::Future>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: Request<B>) -> Self::Future {
        // The same choice as `key_answer`, the handler's future boxed.
        match self.key_answer(request.map(Body::new)) {
            Ok(answer) => Either::Left(Box::pin(async move { Ok(answer.await) })),
            Err(request) => Either::Right(self.router.call(request)),
        }
    }
}
