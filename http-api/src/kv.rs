//! Key routes: `/v1/kv/{*key}`, `/v1/bulk/*`, `/v1/kv?prefix=`, `/v1/tags/{tag}`.
//!
//! Everything a request carries is validated here (key length, value size, query
//! parameters); the node sees only well-formed operations. Values are raw bytes in and out.

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::rejection::{PathRejection, QueryRejection};
use axum::extract::{Path, Query, Request, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::Json;
use base64::Engine;
use bytes::Bytes;
use serde::de::DeserializeOwned;
use serde::Deserialize;
use shoal_raft::bucket_of;

use crate::api::{KeyApi, Limits, PutItem};
use crate::error::ApiError;
use crate::json;
use crate::types::{
    BulkKeys, BulkPut, BulkPutItem, BulkResults, GetOk, KeyError, KeyResult, Page, Priority, PutOptions, ReadFrom,
    RouteContext, Scope, WriteCondition,
};
use crate::{HEADER_BUCKET, HEADER_NODE, HEADER_REPLICA_LAG, HEADER_SCOPE};

/// Query of `GET /v1/kv/{key}`.
#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(crate) struct GetQuery {
    redirect: Option<String>,
    read: Option<String>,
    max_staleness: Option<String>,
}

/// Query of `POST /v1/bulk/get`.
#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(crate) struct BulkGetQuery {
    read: Option<String>,
    max_staleness: Option<String>,
}

/// Query of `PUT /v1/kv/{key}`.
#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(crate) struct PutQuery {
    ttl: Option<String>,
    sliding: Option<String>,
    tags: Option<String>,
    cas: Option<String>,
    mode: Option<String>,
    priority: Option<String>,
    redirect: Option<String>,
}

/// Query of `DELETE /v1/kv/{key}`.
#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(crate) struct DeleteQuery {
    cas: Option<String>,
    redirect: Option<String>,
}

/// Query of `GET /v1/kv` and `GET /v1/tags/{tag}`.
#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(crate) struct ListQuery {
    prefix: Option<String>,
    limit: Option<String>,
    start_after: Option<String>,
}

impl ListQuery {
    /// The page asked for. A member asked for its own keys (`x-shoal-scope: local`) may be
    /// asked for one more than the largest page: the one that tells whether there are more.
    fn page(&self, scope: Scope) -> Result<Page, ApiError> {
        let limit = match (scope, self.limit.as_deref()) {
            (Scope::Local, Some(t)) if number::<usize>("limit", t).ok() == Some(MAX_LIST_LIMIT + 1) => {
                MAX_LIST_LIMIT + 1
            }
            (_, text) => list_limit(text)?,
        };
        Ok(Page { limit, start_after: self.start_after.clone() })
    }
}

/// Default and largest `limit` of a key listing.
const DEFAULT_LIST_LIMIT: usize = 1000;
const MAX_LIST_LIMIT: usize = 100_000;

/// A path parameter, or the 400 problem document for one that is not valid (for example, a
/// key that is not UTF-8 once percent-decoded).
pub(crate) fn path<T>(p: Result<Path<T>, PathRejection>) -> Result<T, ApiError> {
    p.map(|Path(v)| v).map_err(|e| ApiError::BadRequest(format!("invalid path: {}", e.body_text())))
}

pub(crate) fn query<T: Default>(q: Result<Query<T>, QueryRejection>) -> Result<T, ApiError> {
    q.map(|Query(q)| q).map_err(|e| ApiError::BadRequest(format!("invalid query: {}", e.body_text())))
}

pub(crate) fn flag(name: &str, value: Option<&str>) -> Result<bool, ApiError> {
    match value {
        None | Some("false") | Some("0") => Ok(false),
        Some("true") | Some("1") => Ok(true),
        Some(other) => Err(ApiError::BadRequest(format!("{name} must be true or false, not {other:?}"))),
    }
}

/// A whole number written as decimal digits only (no sign, no spaces).
pub(crate) fn number<T: std::str::FromStr>(name: &str, text: &str) -> Result<T, ApiError> {
    let digits = !text.is_empty() && text.bytes().all(|b| b.is_ascii_digit());
    digits
        .then(|| text.parse().ok())
        .flatten()
        .ok_or_else(|| ApiError::BadRequest(format!("{name} must be a whole number, not {text:?}")))
}

/// The longest `ttl` or `sliding`: 100 years (36,525 days).
pub const MAX_EXPIRY: Duration = Duration::from_secs(36_525 * 86_400);

/// The units of a `ttl` or `sliding`, in milliseconds (no unit: seconds).
pub const DURATION_UNITS: [(&str, u64); 5] =
    [("ms", 1), ("s", 1000), ("m", 60_000), ("h", 3_600_000), ("d", 86_400_000)];

/// Parses a `ttl` or `sliding`: a whole number without leading zeros and an optional unit
/// (`ms`, `s`, `m`, `h`, `d`; none: seconds), from 1 ms to [`MAX_EXPIRY`]. Every accepted
/// value is a whole number of milliseconds, which [`format_duration`] writes back exactly.
pub fn parse_duration(name: &str, text: &str) -> Result<Duration, ApiError> {
    let split = text.find(|c: char| !c.is_ascii_digit()).unwrap_or(text.len());
    let (digits, unit) = text.split_at(split);
    let factor =
        if unit.is_empty() { Some(1000) } else { DURATION_UNITS.iter().find(|(u, _)| *u == unit).map(|u| u.1) };
    let (Some(factor), false, false) = (factor, digits.is_empty(), digits.starts_with('0')) else {
        return Err(ApiError::BadRequest(format!(
            "{name}={text:?} is not a duration: a positive whole number and a unit, ms, s, m, h or d (30s, 5m, 2h; no unit: seconds)"
        )));
    };
    let ms = digits.parse::<u64>().ok().and_then(|n| n.checked_mul(factor)).unwrap_or(u64::MAX);
    if ms > MAX_EXPIRY.as_millis() as u64 {
        return Err(ApiError::BadRequest(format!("{name}={text:?} is longer than 100 years")));
    }
    Ok(Duration::from_millis(ms))
}

/// A duration as [`parse_duration`] reads it back exactly (a forwarder passes the client's
/// options on in this form).
pub fn format_duration(d: Duration) -> String {
    format!("{}ms", d.as_millis())
}

/// Builds validated write options from the textual parameters (query or bulk item).
pub fn put_options(
    ttl: Option<&str>,
    sliding: Option<&str>,
    tags: Vec<String>,
    cas: Option<u64>,
    mode: Option<&str>,
) -> Result<PutOptions, ApiError> {
    let ttl = ttl.map(|t| parse_duration("ttl", t)).transpose()?;
    let sliding = sliding.map(|t| parse_duration("sliding", t)).transpose()?;
    if ttl.is_some() && sliding.is_some() {
        return Err(ApiError::BadRequest("ttl and sliding cannot be combined".into()));
    }
    if let Some(t) = tags.iter().find(|t| t.is_empty() || t.chars().count() > 256) {
        return Err(ApiError::BadRequest(format!("tag {t:?} must be 1 to 256 characters")));
    }
    let condition = match (cas, mode) {
        (Some(_), Some(_)) => return Err(ApiError::BadRequest("cas and mode cannot be combined".into())),
        (Some(0), None) => WriteCondition::Absent,
        (Some(v), None) => WriteCondition::Version(v),
        (None, Some("add")) => WriteCondition::Absent,
        (None, Some("replace")) => WriteCondition::Present,
        (None, Some(other)) => {
            return Err(ApiError::BadRequest(format!("mode must be add or replace, not {other:?}")));
        }
        (None, None) => WriteCondition::Always,
    };
    Ok(PutOptions { ttl, sliding, tags, condition, priority: Priority::Normal })
}

/// An eviction priority by name (`normal` when absent).
pub fn priority(text: Option<&str>) -> Result<Priority, ApiError> {
    match text {
        None => Ok(Priority::Normal),
        Some(name) => Priority::from_name(name).ok_or_else(|| {
            ApiError::BadRequest(format!(
                "priority must be low, below_normal, normal, above_normal, high or not_removable, not {name:?}"
            ))
        }),
    }
}

fn parse_cas(text: Option<&str>) -> Result<Option<u64>, ApiError> {
    text.map(|t| number("cas", t)).transpose()
}

/// A header's value as text, or 400.
fn header_text<'a>(headers: &'a HeaderMap, name: &header::HeaderName) -> Result<Option<&'a str>, ApiError> {
    headers
        .get(name)
        .map(|v| v.to_str().map(str::trim).map_err(|_| ApiError::BadRequest(format!("{name} is not text"))))
        .transpose()
}

/// The version in a strong entity tag, `"N"` (shoal's ETag is the item's version).
fn strong_tag(name: &header::HeaderName, text: &str) -> Result<u64, ApiError> {
    text.strip_prefix('"')
        .and_then(|t| t.strip_suffix('"'))
        .and_then(|digits| number::<u64>("version", digits).ok())
        .ok_or_else(|| {
            ApiError::BadRequest(format!(
                "{name} must be * or one entity tag of a version, like \"42\" (weak tags and lists are not supported), not {text:?}"
            ))
        })
}

/// A write's condition given as HTTP headers, in the `cas`/`mode` terms of the query:
/// `If-Match: "N"` is `cas=N`, `If-Match: *` is `mode=replace`, `If-None-Match: *` is
/// `mode=add`. Given both ways, or both headers, the request is refused.
fn header_condition<'a>(
    headers: &HeaderMap,
    cas: Option<u64>,
    mode: Option<&'a str>,
) -> Result<(Option<u64>, Option<&'a str>), ApiError> {
    let if_match = header_text(headers, &header::IF_MATCH)?;
    let if_none_match = header_text(headers, &header::IF_NONE_MATCH)?;
    let from_headers = match (if_match, if_none_match) {
        (None, None) => return Ok((cas, mode)),
        (Some(_), Some(_)) => {
            return Err(ApiError::BadRequest("give If-Match or If-None-Match, not both".into()));
        }
        (Some("*"), None) => (None, Some("replace")),
        (Some(tag), None) => match strong_tag(&header::IF_MATCH, tag)? {
            // Versions start at 1: "0" names no item (and cas=0 would mean "absent").
            0 => return Err(ApiError::BadRequest("If-Match: \"0\" names no version (versions start at 1)".into())),
            version => (Some(version), None),
        },
        (None, Some("*")) => (None, Some("add")),
        (None, Some(other)) => {
            return Err(ApiError::BadRequest(format!(
                "on a write, If-None-Match can only be * (write only if absent), not {other:?}"
            )));
        }
    };
    if cas.is_some() || mode.is_some() {
        return Err(ApiError::BadRequest("give the condition once: as If-Match/If-None-Match or as cas/mode".into()));
    }
    Ok(from_headers)
}

/// Whether a GET's `If-None-Match` names the version found (`*`, or a list of tags, weak or
/// strong, compared weakly as RFC 9110 says): then the answer is 304 without the value.
fn not_modified(headers: &HeaderMap, version: u64) -> bool {
    let Some(text) = headers.get(header::IF_NONE_MATCH).and_then(|v| v.to_str().ok()) else {
        return false;
    };
    text.split(',').map(str::trim).any(|tag| {
        tag == "*"
            || tag
                .trim_start_matches("W/")
                .strip_prefix('"')
                .and_then(|t| t.strip_suffix('"'))
                .and_then(|d| d.parse::<u64>().ok())
                == Some(version)
    })
}

/// The tags of `tags=a,b`, each exactly as written between the commas.
fn split_tags(text: Option<&str>) -> Vec<String> {
    text.map(|t| t.split(',').map(str::to_string).collect()).unwrap_or_default()
}

/// Refuses an empty key, or one longer than `limits` allow.
pub fn check_key(key: &str, limits: &Limits) -> Result<(), ApiError> {
    if key.is_empty() {
        return Err(ApiError::BadRequest("the key is empty".into()));
    }
    if key.len() > limits.max_key_bytes {
        return Err(ApiError::KeyTooLarge { len: key.len(), limit: limits.max_key_bytes });
    }
    Ok(())
}

/// A 200 answer of JSON written by hand: the response is built once with its one header
/// (a tuple's `into_response` sets `application/octet-stream` first, then replaces it).
fn json_response(body: Vec<u8>) -> Response {
    let mut response = Response::new(Body::from(body));
    response.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
    response
}

/// How to route a client's key operation: its `?redirect=`. (Another node's forwards come
/// over the peer link, never through this API.)
fn route_context(redirect: Option<&str>) -> Result<RouteContext, ApiError> {
    Ok(RouteContext { redirect: flag("redirect", redirect)?, ..RouteContext::default() })
}

/// [`route_context`] of a read, with the client's `?read=` and `?max_staleness=`.
fn read_context(
    redirect: Option<&str>,
    read: Option<&str>,
    max_staleness: Option<&str>,
) -> Result<RouteContext, ApiError> {
    let mut ctx = route_context(redirect)?;
    ctx.read = read.map(|r| r.parse::<ReadFrom>().map_err(ApiError::BadRequest)).transpose()?;
    ctx.max_staleness = max_staleness.map(staleness).transpose()?;
    Ok(ctx)
}

/// A `max_staleness`: `0` (never stale) or a duration as [`parse_duration`] reads it.
fn staleness(text: &str) -> Result<Duration, ApiError> {
    if text == "0" {
        return Ok(Duration::ZERO);
    }
    parse_duration("max_staleness", text)
}

/// Milliseconds since the Unix epoch.
pub fn unix_ms() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}

fn scope(headers: &HeaderMap) -> Scope {
    match headers.get(HEADER_SCOPE).and_then(|v| v.to_str().ok()) {
        Some("local") => Scope::Local,
        _ => Scope::Cluster,
    }
}

/// Turns a node's redirect into a 307 to the same path and query on the owner.
fn with_redirect(result: Result<Response, ApiError>, uri: &Uri) -> Response {
    match result {
        Ok(r) => r,
        Err(ApiError::Redirect { api_addr }) => {
            let query: Vec<&str> =
                uri.query().unwrap_or("").split('&').filter(|p| !p.is_empty() && !p.starts_with("redirect")).collect();
            let base = if api_addr.contains("://") { api_addr } else { format!("http://{api_addr}") };
            let mut location = format!("{base}{}", uri.path());
            if !query.is_empty() {
                location.push('?');
                location.push_str(&query.join("&"));
            }
            let mut response = StatusCode::TEMPORARY_REDIRECT.into_response();
            if let Ok(v) = HeaderValue::from_str(&location) {
                response.headers_mut().insert(header::LOCATION, v);
            }
            response
        }
        Err(e) => e.into_response(),
    }
}

/// `"<n>"` as a header value, without going through `format!`.
pub(crate) fn quoted(n: u64) -> HeaderValue {
    let mut digits = [0u8; 22];
    let mut i = digits.len() - 1;
    digits[i] = b'"';
    let mut n = n;
    loop {
        i -= 1;
        digits[i] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    i -= 1;
    digits[i] = b'"';
    HeaderValue::from_bytes(&digits[i..]).unwrap_or(HeaderValue::from_static("\"0\""))
}

/// The raw-value answer of a GET, with its version and location in headers.
pub fn value_response(ok: GetOk) -> Response {
    let mut response = (StatusCode::OK, Body::from(ok.value)).into_response();
    let headers = response.headers_mut();
    headers.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/octet-stream"));
    headers.insert(header::ETAG, quoted(ok.version));
    headers.insert(HEADER_BUCKET, HeaderValue::from(ok.bucket));
    headers.insert(HEADER_NODE, HeaderValue::from(ok.node));
    if let Some(lag) = ok.lag_ms {
        headers.insert(HEADER_REPLICA_LAG, HeaderValue::from(lag));
    }
    response
}

/// Parses the query of `uri` into `T` (all defaults when there is none, without touching
/// the parser: the hot GET path usually has no query).
fn query_of<T: Default + serde::de::DeserializeOwned>(uri: &Uri) -> Result<T, ApiError> {
    if uri.query().is_none() {
        return Ok(T::default());
    }
    query(Query::try_from_uri(uri))
}

// The key handlers take the whole request instead of `HeaderMap`/`Uri`/`Query` extractors,
// which would clone the headers and URI of every request on the hottest path.

/// `GET /v1/kv/{key}`.
pub(crate) async fn get_key<N: KeyApi>(
    State(node): State<Arc<N>>,
    key: Result<Path<String>, PathRejection>,
    request: Request,
) -> Response {
    let key = path(key);
    // Parts, not the request: the body type is not Sync, so a borrowed request cannot be
    // held across an await.
    let (parts, _) = request.into_parts();
    let result = async {
        let key = key?;
        let q: GetQuery = query_of(&parts.uri)?;
        check_key(&key, &node.limits())?;
        let ctx = read_context(q.redirect.as_deref(), q.read.as_deref(), q.max_staleness.as_deref())?;
        let ok = node.get(key, ctx).await?;
        if not_modified(&parts.headers, ok.version) {
            let mut response = value_response(GetOk { value: Bytes::new(), ..ok }).into_response();
            *response.status_mut() = StatusCode::NOT_MODIFIED;
            response.headers_mut().remove(header::CONTENT_TYPE);
            return Ok(response);
        }
        Ok(value_response(ok))
    }
    .await;
    with_redirect(result, &parts.uri)
}

/// `PUT /v1/kv/{key}`.
pub(crate) async fn put_key<N: KeyApi>(
    State(node): State<Arc<N>>,
    key: Result<Path<String>, PathRejection>,
    request: Request,
) -> Response {
    let key = path(key);
    let (parts, body) = request.into_parts();
    let result = async {
        let key = key?;
        let q: PutQuery = query_of(&parts.uri)?;
        let limits = node.limits();
        check_key(&key, &limits)?;
        let (cas, mode) = header_condition(&parts.headers, parse_cas(q.cas.as_deref())?, q.mode.as_deref())?;
        let mut options =
            put_options(q.ttl.as_deref(), q.sliding.as_deref(), split_tags(q.tags.as_deref()), cas, mode)?;
        options.priority = priority(q.priority.as_deref())?;
        let ctx = route_context(q.redirect.as_deref())?;
        let (value, _admitted) = admitted_body(&*node, &parts.headers, body, limits.max_value_bytes, 1).await?;
        let ok = node.put(PutItem { key, value, options }, ctx).await?;
        let mut out = Vec::with_capacity(64 + ok.key.len());
        json::write_put_ok(&mut out, &ok);
        Ok(json_response(out))
    }
    .await;
    with_redirect(result, &parts.uri)
}

/// `DELETE /v1/kv/{key}`.
pub(crate) async fn delete_key<N: KeyApi>(
    State(node): State<Arc<N>>,
    key: Result<Path<String>, PathRejection>,
    request: Request,
) -> Response {
    let key = path(key);
    // Parts, not the request: the body type is not Sync, so a borrowed request cannot be
    // held across an await.
    let (parts, _) = request.into_parts();
    let result = async {
        let key = key?;
        let q: DeleteQuery = query_of(&parts.uri)?;
        check_key(&key, &node.limits())?;
        let cas = match header_condition(&parts.headers, parse_cas(q.cas.as_deref())?, None)? {
            (cas, None) => cas,
            // `If-Match: *` (only if it exists): a delete of a missing key is 404 anyway.
            (_, Some("replace")) => None,
            (_, Some(_)) => {
                return Err(ApiError::BadRequest("a delete takes If-Match (\"N\" or *), not If-None-Match".into()));
            }
        };
        let ctx = route_context(q.redirect.as_deref())?;
        node.delete(key, cas, ctx).await?;
        Ok(StatusCode::NO_CONTENT.into_response())
    }
    .await;
    with_redirect(result, &parts.uri)
}

/// Reads a body of at most `limit` bytes once the node admitted it (its `Content-Length`, or
/// `limit` when it has none or a larger one): the permit is held until the request is
/// answered. A longer body is refused with 413 once what the client sends of it was dropped
/// (see [`discard`]).
pub(crate) async fn admitted_body<N: KeyApi>(
    node: &N,
    headers: &HeaderMap,
    body: Body,
    limit: usize,
    copies: usize,
) -> Result<(Bytes, crate::api::BodyPermit), ApiError> {
    let length = headers.get(header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()?.parse::<usize>().ok());
    // A body announced over the limit, or refused for room, is refused without keeping a byte
    // of it. A client that asked `Expect: 100-continue` sends none of it; any other one is
    // sending it already, and gets the answer only once it was read (and dropped): answered
    // first, it would see its connection reset while it writes.
    let admitted = match length {
        Some(length) if length > limit => Err(ApiError::ValueTooLarge { limit }),
        _ => node.admit_body(length.unwrap_or(limit).min(limit) * copies).await,
    };
    match admitted {
        Ok(permit) => Ok((read_body(body, limit).await?, permit)),
        Err(refused) => {
            let waits = headers.get(header::EXPECT).is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"100-continue"));
            if !waits {
                discard(body, length.unwrap_or(DISCARDED_AT_MOST)).await;
            }
            Err(refused)
        }
    }
}

/// Reads a body of at most `limit` bytes; a longer one is refused whole with 413, once the rest
/// of it was dropped. A body that arrives in one piece (the usual small value) is kept as it
/// came, without a copy or the bookkeeping of a general collector.
pub(crate) async fn read_body(mut body: Body, limit: usize) -> Result<Bytes, ApiError> {
    use http_body_util::BodyExt;
    let mut first = Bytes::new();
    // Only when the body comes in several pieces: they are gathered.
    let mut gathered: Option<bytes::BytesMut> = None;
    let mut len = 0usize;
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|e| {
            // A limit a layer put on the body (a `Limited` body), however deep in the chain.
            let too_large = std::iter::successors(std::error::Error::source(&e), |s| s.source())
                .any(|s| s.is::<http_body_util::LengthLimitError>());
            if too_large {
                ApiError::ValueTooLarge { limit }
            } else {
                ApiError::BadRequest(format!("could not read the request body: {e}"))
            }
        })?;
        // Trailers carry no value bytes.
        let Ok(data) = frame.into_data() else { continue };
        len += data.len();
        if len > limit {
            discard(body, DISCARDED_AT_MOST).await;
            return Err(ApiError::ValueTooLarge { limit });
        }
        match &mut gathered {
            Some(buf) => buf.extend_from_slice(&data),
            None if first.is_empty() => first = data,
            None if data.is_empty() => {}
            None => {
                // The announced length (Content-Length), when there is one, is allocated once.
                let announced = usize::try_from(axum::body::HttpBody::size_hint(&body).lower()).unwrap_or(limit);
                let mut buf = bytes::BytesMut::with_capacity(announced.min(limit).saturating_add(len).max(len));
                buf.extend_from_slice(&first);
                buf.extend_from_slice(&data);
                gathered = Some(buf);
            }
        }
    }
    Ok(gathered.map_or(first, bytes::BytesMut::freeze))
}

/// The most of a refused body read and dropped, and for how long: a client that sends more, or
/// more slowly, sees its connection close instead of the answer.
const DISCARDED_AT_MOST: usize = 64 << 20;
const DISCARD_TIME: Duration = Duration::from_secs(10);

/// Reads up to `length` more bytes of a refused body (at most [`DISCARDED_AT_MOST`], within
/// [`DISCARD_TIME`]) and drops them, so that its client, still sending, gets to read the answer
/// and may keep its connection.
async fn discard(mut body: Body, length: usize) {
    use http_body_util::BodyExt;
    if length > DISCARDED_AT_MOST {
        return;
    }
    let _ = tokio::time::timeout(DISCARD_TIME, async {
        let mut read = 0usize;
        while let Some(Ok(frame)) = body.frame().await {
            read += frame.data_ref().map_or(0, Bytes::len);
            if read > DISCARDED_AT_MOST {
                return;
            }
        }
    })
    .await;
}

async fn read_json<N: KeyApi, T: DeserializeOwned>(
    node: &N,
    headers: &HeaderMap,
    body: Body,
    limit: usize,
) -> Result<(T, crate::api::BodyPermit), ApiError> {
    let (bytes, permit) = admitted_body(node, headers, body, limit, PARSED_COPIES).await?;
    Ok((json_object(&bytes)?, permit))
}

/// A JSON object body (whatever its content type says: curl users forget it); an array, even
/// one serde could read as the same struct, is refused.
pub(crate) fn json_object<T: DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    serde_json::from_slice::<crate::de::Object<T>>(body)
        .map(|o| o.0)
        .map_err(|e| ApiError::BadRequest(format!("invalid JSON body: {e}")))
}

/// What a JSON request keeps alive for each byte of its body: the body as it came and, parsed,
/// an owned copy of every value (its admission counts both).
pub const PARSED_COPIES: usize = 2;

fn key_error(e: &ApiError) -> KeyError {
    KeyError::of(e)
}

fn result_of(key: String, error: Option<KeyError>) -> KeyResult {
    let bucket = bucket_of(key.as_bytes()).0;
    KeyResult { key, bucket, error, ..Default::default() }
}

fn check_bulk_keys<'a>(keys: impl ExactSizeIterator<Item = &'a String>, limits: &Limits) -> Result<(), ApiError> {
    if keys.len() > limits.max_bulk_keys {
        return Err(ApiError::BadRequest(format!("at most {} keys per bulk request", limits.max_bulk_keys)));
    }
    Ok(())
}

pub(crate) async fn bulk_get<N: KeyApi>(
    State(node): State<Arc<N>>,
    uri: Uri,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let result = async {
        let q: BulkGetQuery = query_of(&uri)?;
        let limits = node.limits();
        let (req, _admitted): (BulkKeys, _) = read_json(&*node, &headers, body, limits.max_bulk_body_bytes).await?;
        check_bulk_keys(req.keys.iter(), &limits)?;
        let ctx = read_context(None, q.read.as_deref(), q.max_staleness.as_deref())?;
        // Invalid keys fail alone; the others are asked of the node.
        let valid: Vec<usize> = (0..req.keys.len()).filter(|&i| check_key(&req.keys[i], &limits).is_ok()).collect();
        let answers = node.bulk_get(valid.iter().map(|&i| req.keys[i].clone()).collect(), ctx).await?;
        let mut by_position: Vec<Option<Result<Option<GetOk>, ApiError>>> = (0..req.keys.len()).map(|_| None).collect();
        let mut value_bytes = 0;
        for (i, answer) in valid.into_iter().zip(answers) {
            if let Ok(Some(ok)) = &answer {
                value_bytes += ok.value.len();
            }
            by_position[i] = Some(answer);
        }
        // The answer is built in memory: it is bounded like a request body, and admitted.
        let most = limits.max_bulk_body_bytes;
        if value_bytes > most {
            return Err(ApiError::AnswerTooLarge { bytes: value_bytes, limit: most });
        }
        let _answer_admitted = node.admit_body(value_bytes).await?;
        let mut out = Vec::with_capacity(16 + req.keys.len() * 96 + value_bytes * 4 / 3);
        out.extend_from_slice(b"{\"results\":[");
        for (i, (key, answer)) in req.keys.iter().zip(by_position).enumerate() {
            if i > 0 {
                out.push(b',');
            }
            match answer {
                Some(Ok(Some(ok))) => json::write_found(&mut out, key, &ok),
                Some(Ok(None)) => {
                    let mut r = result_of(key.clone(), None);
                    r.found = Some(false);
                    json::write_result(&mut out, &r);
                }
                Some(Err(e)) => json::write_result(&mut out, &result_of(key.clone(), Some(key_error(&e)))),
                None => {
                    let e = check_key(key, &limits).err().map(|e| key_error(&e));
                    json::write_result(&mut out, &result_of(key.clone(), e));
                }
            }
        }
        out.extend_from_slice(b"]}");
        Ok(json_response(out))
    }
    .await;
    result.unwrap_or_else(|e: ApiError| e.into_response())
}

/// Validates one bulk item into a write.
fn put_item(item: BulkPutItem, limits: &Limits) -> Result<PutItem, (String, ApiError)> {
    let key = item.key;
    let fail = |e| (key.clone(), e);
    check_key(&key, limits).map_err(fail)?;
    let value = match (item.value, item.value_base64) {
        (Some(text), None) => Bytes::from(text),
        (None, Some(b64)) => Bytes::from(
            base64::engine::general_purpose::STANDARD
                .decode(b64)
                .map_err(|e| fail(ApiError::BadRequest(format!("value_base64 is not base64: {e}"))))?,
        ),
        _ => return Err(fail(ApiError::BadRequest("give exactly one of value and value_base64".into()))),
    };
    if value.len() > limits.max_value_bytes {
        return Err(fail(ApiError::ValueTooLarge { limit: limits.max_value_bytes }));
    }
    let mut options =
        put_options(item.ttl.as_deref(), item.sliding.as_deref(), item.tags, item.cas, item.mode.as_deref())
            .map_err(fail)?;
    options.priority = priority(item.priority.as_deref()).map_err(fail)?;
    Ok(PutItem { key, value, options })
}

pub(crate) async fn bulk_put<N: KeyApi>(State(node): State<Arc<N>>, headers: HeaderMap, body: Body) -> Response {
    let result = async {
        let limits = node.limits();
        let (req, _admitted): (BulkPut, _) = read_json(&*node, &headers, body, limits.max_bulk_body_bytes).await?;
        check_bulk_keys(req.items.iter().map(|i| &i.key), &limits)?;
        let ctx = route_context(None)?;
        let n = req.items.len();
        let mut results: Vec<Option<KeyResult>> = vec![None; n];
        let mut valid = Vec::new();
        for (i, item) in req.items.into_iter().enumerate() {
            match put_item(item, &limits) {
                Ok(item) => valid.push((i, item)),
                Err((key, e)) => results[i] = Some(result_of(key, Some(key_error(&e)))),
            }
        }
        let (positions, items): (Vec<usize>, Vec<PutItem>) = valid.into_iter().unzip();
        let keys: Vec<String> = items.iter().map(|i| i.key.clone()).collect();
        let answers = node.bulk_put(items, ctx).await?;
        for ((i, key), answer) in positions.into_iter().zip(keys).zip(answers) {
            let mut r = result_of(key, None);
            match answer {
                Ok(ok) => r.version = Some(ok.version),
                Err(e) => r.error = Some(key_error(&e)),
            }
            results[i] = Some(r);
        }
        Ok(Json(BulkResults { results: results.into_iter().flatten().collect() }).into_response())
    }
    .await;
    result.unwrap_or_else(|e: ApiError| e.into_response())
}

pub(crate) async fn bulk_delete<N: KeyApi>(State(node): State<Arc<N>>, headers: HeaderMap, body: Body) -> Response {
    let result = async {
        let limits = node.limits();
        let (req, _admitted): (BulkKeys, _) = read_json(&*node, &headers, body, limits.max_bulk_body_bytes).await?;
        check_bulk_keys(req.keys.iter(), &limits)?;
        let ctx = route_context(None)?;
        let (valid, invalid): (Vec<_>, Vec<_>) =
            req.keys.iter().cloned().enumerate().partition(|(_, k)| check_key(k, &limits).is_ok());
        let answers = node.bulk_delete(valid.iter().map(|(_, k)| k.clone()).collect(), ctx).await?;
        let mut results: Vec<Option<KeyResult>> = vec![None; req.keys.len()];
        for ((i, key), answer) in valid.into_iter().zip(answers) {
            let mut r = result_of(key, None);
            match answer {
                Ok(deleted) => r.deleted = Some(deleted),
                Err(e) => r.error = Some(key_error(&e)),
            }
            results[i] = Some(r);
        }
        for (i, key) in invalid {
            let e = check_key(&key, &limits).err().map(|e| key_error(&e));
            results[i] = Some(result_of(key, e));
        }
        Ok(Json(BulkResults { results: results.into_iter().flatten().collect() }).into_response())
    }
    .await;
    result.unwrap_or_else(|e: ApiError| e.into_response())
}

pub(crate) fn list_limit(text: Option<&str>) -> Result<usize, ApiError> {
    match text {
        None => Ok(DEFAULT_LIST_LIMIT),
        Some(t) => match number::<usize>("limit", t) {
            Ok(n) if (1..=MAX_LIST_LIMIT).contains(&n) => Ok(n),
            _ => Err(ApiError::BadRequest(format!("limit must be 1 to {MAX_LIST_LIMIT}, not {t:?}"))),
        },
    }
}

pub(crate) async fn list_keys<N: KeyApi>(
    State(node): State<Arc<N>>,
    q: Result<Query<ListQuery>, QueryRejection>,
    headers: HeaderMap,
) -> Response {
    let result = async {
        let q = query(q)?;
        let page = q.page(scope(&headers))?;
        Ok(Json(node.keys(q.prefix.unwrap_or_default(), page, scope(&headers)).await?).into_response())
    }
    .await;
    result.unwrap_or_else(|e: ApiError| e.into_response())
}

pub(crate) async fn get_tag<N: KeyApi>(
    State(node): State<Arc<N>>,
    tag: Result<Path<String>, PathRejection>,
    q: Result<Query<ListQuery>, QueryRejection>,
    headers: HeaderMap,
) -> Response {
    let result = async {
        let tag = path(tag)?;
        let q = query(q)?;
        if q.prefix.is_some() {
            return Err(ApiError::BadRequest("prefix is not a parameter of tag queries".into()));
        }
        Ok(Json(node.tagged(tag, q.page(scope(&headers))?, scope(&headers)).await?).into_response())
    }
    .await;
    result.unwrap_or_else(|e: ApiError| e.into_response())
}

pub(crate) async fn delete_tag<N: KeyApi>(
    State(node): State<Arc<N>>,
    tag: Result<Path<String>, PathRejection>,
    headers: HeaderMap,
) -> Response {
    let tag = match path(tag) {
        Ok(tag) => tag,
        Err(e) => return e.into_response(),
    };
    match node.remove_tagged(tag, scope(&headers)).await {
        Ok(removed) if removed.incomplete => (StatusCode::BAD_GATEWAY, Json(removed)).into_response(),
        Ok(removed) => Json(removed).into_response(),
        Err(e) => e.into_response(),
    }
}
