//! Key operations one node forwards to another (to the owner, or to a mirror): their messages,
//! what the receiver does with them, and the sender's typed calls.
//!
//! The receiver meets each forward with its own limits (nodes may be configured differently: a
//! key, a value or a bulk request larger than it allows fails as its key route would fail it)
//! and admits its values into its body budget, as the key routes do; then it answers as its
//! public API would, so a client cannot tell a forwarded answer from a local one. A forward
//! that arrives after its sender's deadline is refused before any of this (`transport::wire`).

use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use shoal_http_api::types::{GetOk, PutOk, RouteContext};
use shoal_http_api::{ApiError, BodyPermit, KeyApi, Limits, PutItem};
use shoal_raft::NodeId;

use super::NodeApi;
use crate::peer::Peers;
use crate::transport::wire::{self, Handlers};
use crate::transport::{Addrs, CallError, Endpoint};

/// How long a mirror read may take before the reader turns to the owner.
const MIRROR_TIMEOUT: Duration = Duration::from_secs(1);

/// A forwarded read, to the owner (or, with `mirror`, to a mirror).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Get {
    /// The key.
    pub key: String,
    /// The sender's map version.
    pub map_version: u64,
    /// A mirror read: serve it from the receiver's replica copy if that is fresh within
    /// this staleness, else refuse (`replica_not_fresh`).
    pub mirror: Option<Duration>,
}

/// A forwarded write.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Put {
    /// The item.
    pub item: PutItem,
    /// The sender's map version.
    pub map_version: u64,
}

/// A forwarded delete.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Delete {
    /// The key.
    pub key: String,
    /// Only at this version.
    pub cas: Option<u64>,
    /// The sender's map version.
    pub map_version: u64,
}

/// Forwarded reads of keys one owner holds (or, with `mirror`, mirror reads).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct BulkGet {
    /// The keys.
    pub keys: Vec<String>,
    /// The sender's map version.
    pub map_version: u64,
    /// As for [`Get::mirror`].
    pub mirror: Option<Duration>,
}

/// Forwarded writes of items one owner holds.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct BulkPut {
    /// The items.
    pub items: Vec<PutItem>,
    /// The sender's map version.
    pub map_version: u64,
}

/// Forwarded deletes of keys one owner holds.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct BulkDelete {
    /// The keys.
    pub keys: Vec<String>,
    /// The sender's map version.
    pub map_version: u64,
}

/// A bulk read's results (one per key), with the share of the receiver's body budget their
/// values hold while they are encoded, as the bulk route admits them.
#[derive(Serialize, Deserialize)]
#[serde(transparent)]
pub struct BulkGot {
    /// One result per key.
    pub results: Vec<Result<Option<GetOk>, ApiError>>,
    #[serde(skip)]
    _admitted: Option<BodyPermit>,
}

#[cfg(test)]
impl BulkGot {
    /// Results that hold no share of the body budget.
    pub fn new(results: Vec<Result<Option<GetOk>, ApiError>>) -> Self {
        BulkGot { results, _admitted: None }
    }
}

impl Endpoint for Get {
    type Answer = GetOk;
    const ID: u8 = wire::id::GET;
    const KIND: u8 = wire::READ;
}

impl Endpoint for Put {
    type Answer = PutOk;
    const ID: u8 = wire::id::PUT;
    const KIND: u8 = wire::WRITE;
}

impl Endpoint for Delete {
    type Answer = ();
    const ID: u8 = wire::id::DELETE;
    const KIND: u8 = wire::WRITE;
}

impl Endpoint for BulkGet {
    type Answer = BulkGot;
    const ID: u8 = wire::id::BULK_GET;
    const KIND: u8 = wire::READ;

    fn fits(&self, answer: &BulkGot) -> bool {
        answer.results.len() == self.keys.len()
    }
}

impl Endpoint for BulkPut {
    type Answer = Vec<Result<PutOk, ApiError>>;
    const ID: u8 = wire::id::BULK_PUT;
    const KIND: u8 = wire::WRITE;

    fn fits(&self, answer: &Self::Answer) -> bool {
        answer.len() == self.items.len()
    }
}

impl Endpoint for BulkDelete {
    type Answer = Vec<Result<bool, ApiError>>;
    const ID: u8 = wire::id::BULK_DELETE;
    const KIND: u8 = wire::WRITE;

    fn fits(&self, answer: &Self::Answer) -> bool {
        answer.len() == self.keys.len()
    }
}

fn forwarded(map_version: u64) -> RouteContext {
    RouteContext { forwarded_map_version: Some(map_version), from_peer: true, ..RouteContext::default() }
}

/// [`forwarded`], and for a mirror read the staleness it allows.
fn read_context(map_version: u64, mirror: Option<Duration>) -> RouteContext {
    RouteContext { mirror_read: mirror, ..forwarded(map_version) }
}

/// The bytes of the values of a forward's keys and value sizes, or why this node's limits
/// refuse it: too many keys, a key or a value too large.
fn admissible<'a>(items: impl Iterator<Item = (&'a String, usize)>, limits: &Limits) -> Result<usize, ApiError> {
    let mut total = 0;
    for (n, (key, value)) in items.enumerate() {
        if n == limits.max_bulk_keys {
            return Err(ApiError::BadRequest(format!("at most {} keys per bulk request", limits.max_bulk_keys)));
        }
        shoal_http_api::check_key(key, limits)?;
        if value > limits.max_value_bytes {
            return Err(ApiError::ValueTooLarge { limit: limits.max_value_bytes });
        }
        total += value;
    }
    Ok(total)
}

/// Checks a forward against this node's limits and admits its values into the body budget.
async fn admit<'a>(api: &NodeApi, items: impl Iterator<Item = (&'a String, usize)>) -> Result<BodyPermit, ApiError> {
    let values = admissible(items, &api.limits())?;
    api.admit_body(values).await
}

/// Registers the answers to forwarded key operations.
pub fn register(handlers: &mut Handlers, api: &Arc<NodeApi>) {
    let failed = CallError::Api;
    handlers.add_with(api, move |a, Get { key, map_version, mirror }| async move {
        admissible(std::iter::once((&key, 0)), &a.limits()).map_err(failed)?;
        a.get(key, read_context(map_version, mirror)).await.map_err(failed)
    });
    handlers.add_with(api, move |a, BulkGet { keys, map_version, mirror }| async move {
        admissible(keys.iter().map(|k| (k, 0)), &a.limits()).map_err(failed)?;
        let results = a.bulk_get(keys, read_context(map_version, mirror)).await.map_err(failed)?;
        let values = results.iter().flatten().flatten().map(|ok| ok.value.len()).sum();
        let admitted = Some(a.admit_body(values).await.map_err(failed)?);
        Ok(BulkGot { results, _admitted: admitted })
    });
    handlers.add_with(api, move |a, Put { item, map_version }| async move {
        let _admitted = admit(&a, std::iter::once((&item.key, item.value.len()))).await.map_err(failed)?;
        a.put(item, forwarded(map_version)).await.map_err(failed)
    });
    handlers.add_with(api, move |a, Delete { key, cas, map_version }| async move {
        admissible(std::iter::once((&key, 0)), &a.limits()).map_err(failed)?;
        a.delete(key, cas, forwarded(map_version)).await.map_err(failed)
    });
    handlers.add_with(api, move |a, BulkPut { items, map_version }| async move {
        let _admitted = admit(&a, items.iter().map(|i| (&i.key, i.value.len()))).await.map_err(failed)?;
        a.bulk_put(items, forwarded(map_version)).await.map_err(failed)
    });
    handlers.add_with(api, move |a, BulkDelete { keys, map_version }| async move {
        admissible(keys.iter().map(|k| (k, 0)), &a.limits()).map_err(failed)?;
        a.bulk_delete(keys, forwarded(map_version)).await.map_err(failed)
    });
}

/// The sender's side: a forward to the owner at `to` (errors as a client sees them), or a
/// mirror read (errors as the network gave them: the reader then turns to the owner).
impl Peers {
    pub(super) async fn get(&self, to: &Addrs, key: &str, map_version: u64) -> Result<Option<GetOk>, ApiError> {
        match self.forward(to, Get { key: key.to_string(), map_version, mirror: None }).await {
            Ok(ok) => Ok(Some(ok)),
            Err(ApiError::NotFound) => Ok(None),
            Err(e) => Err(e),
        }
    }

    pub(super) async fn mirror_get(
        &self,
        to: Addrs,
        key: &str,
        map_version: u64,
        staleness: Duration,
    ) -> Result<Option<GetOk>, CallError> {
        let request = Get { key: key.to_string(), map_version, mirror: Some(staleness) };
        match self.ask_member(&to, request, MIRROR_TIMEOUT).await {
            Ok(ok) => Ok(Some(ok)),
            Err(CallError::Api(ApiError::NotFound)) => Ok(None),
            Err(e) => Err(e),
        }
    }

    pub(super) async fn mirror_bulk_get(
        &self,
        to: Addrs,
        mirror: NodeId,
        keys: Vec<String>,
        map_version: u64,
        staleness: Duration,
    ) -> Result<Vec<Result<Option<GetOk>, ApiError>>, CallError> {
        let request = BulkGet { keys, map_version, mirror: Some(staleness) };
        let got = self.ask_member(&to, request, MIRROR_TIMEOUT).await?;
        Ok(got.results.into_iter().map(|r| r.map(|found| found.map(|ok| GetOk { node: mirror, ..ok }))).collect())
    }

    pub(super) async fn put(&self, to: &Addrs, item: &PutItem, map_version: u64) -> Result<PutOk, ApiError> {
        self.forward(to, Put { item: item.clone(), map_version }).await
    }

    pub(super) async fn delete(
        &self,
        to: &Addrs,
        key: &str,
        cas: Option<u64>,
        map_version: u64,
    ) -> Result<bool, ApiError> {
        match self.forward(to, Delete { key: key.to_string(), cas, map_version }).await {
            Ok(()) => Ok(true),
            Err(ApiError::NotFound) => Ok(false),
            Err(e) => Err(e),
        }
    }

    pub(super) async fn bulk_get(
        &self,
        to: &Addrs,
        owner: NodeId,
        keys: Vec<String>,
        map_version: u64,
    ) -> Result<Vec<Result<Option<GetOk>, ApiError>>, ApiError> {
        let got = self.forward(to, BulkGet { keys, map_version, mirror: None }).await?;
        Ok(got.results.into_iter().map(|r| r.map(|found| found.map(|ok| GetOk { node: owner, ..ok }))).collect())
    }

    pub(super) async fn bulk_put(
        &self,
        to: &Addrs,
        owner: NodeId,
        items: Vec<PutItem>,
        map_version: u64,
    ) -> Result<Vec<Result<PutOk, ApiError>>, ApiError> {
        let results = self.forward(to, BulkPut { items, map_version }).await?;
        Ok(results.into_iter().map(|r| r.map(|ok| PutOk { node: owner, ..ok })).collect())
    }

    pub(super) async fn bulk_delete(
        &self,
        to: &Addrs,
        keys: Vec<String>,
        map_version: u64,
    ) -> Result<Vec<Result<bool, ApiError>>, ApiError> {
        self.forward(to, BulkDelete { keys, map_version }).await
    }
}
