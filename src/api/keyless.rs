//! Keyless operations (prefix listing, tags): broadcast to every member and merged.

use std::future::Future;
use std::time::Instant;

use futures::future::join_all;
use shoal_http_api::types::{FoundKey, KeyList, NodeFailure, Page, Removed, Scope};
use shoal_http_api::ApiError;
use shoal_raft::{BucketId, NodeId};

use super::NodeApi;
use crate::metrics::Op;
use crate::transport::wire::{self, Handlers, Json};
use crate::transport::{CallError, Endpoint};

/// A broadcast: the receiver's own keys with a prefix.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct Keys {
    /// The prefix.
    pub prefix: String,
    /// Which of them.
    pub page: Page,
}

/// A broadcast: the receiver's own keys with a tag.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct Tagged {
    /// The tag.
    pub tag: String,
    /// Which of them.
    pub page: Page,
}

/// A broadcast: remove the receiver's own items with a tag.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct RemoveTagged {
    /// The tag.
    pub tag: String,
}

impl Endpoint for Keys {
    type Answer = Json<KeyList>;
    const ID: u8 = wire::id::KEYS;
}

impl Endpoint for Tagged {
    type Answer = Json<KeyList>;
    const ID: u8 = wire::id::TAGGED;
}

impl Endpoint for RemoveTagged {
    type Answer = Json<Removed>;
    const ID: u8 = wire::id::REMOVE_TAGGED;
}

/// Registers the answers to broadcasts: this node's own share.
pub fn register(handlers: &mut Handlers, api: &std::sync::Arc<NodeApi>) {
    use shoal_http_api::KeyApi;
    handlers.add_with(api, |a, Keys { prefix, page }| async move {
        a.keys(prefix, page, Scope::Local).await.map(Json).map_err(CallError::Api)
    });
    handlers.add_with(api, |a, Tagged { tag, page }| async move {
        a.tagged(tag, page, Scope::Local).await.map(Json).map_err(CallError::Api)
    });
    handlers.add_with(api, |a, RemoveTagged { tag }| async move {
        a.remove_tagged(tag, Scope::Local).await.map(Json).map_err(CallError::Api)
    });
}

/// Tagged items deleted per round trip to the replicas.
const REMOVE_BATCH: usize = 512;

impl NodeApi {
    /// Runs `local` here and `remote` at every other member, at once. Members that fail are
    /// reported, not fatal.
    async fn broadcast<T, Fut>(
        &self,
        local: impl FnOnce() -> T,
        remote: impl Fn(String) -> Fut,
    ) -> (Vec<(NodeId, T)>, Vec<NodeFailure>)
    where
        Fut: Future<Output = Result<T, ApiError>>,
    {
        let state = self.control.state();
        let calls = state.members.iter().filter(|m| m.id != self.node_id).map(|m| {
            let call = remote(m.peer_addr.clone());
            async move { (m.id, call.await) }
        });
        let mut answers = vec![(self.node_id, local())];
        let mut failures = Vec::new();
        for (node, answer) in join_all(calls).await {
            match answer {
                Ok(a) => answers.push((node, a)),
                Err(e) => failures.push(NodeFailure { node, detail: e.to_string() }),
            }
        }
        (answers, failures)
    }

    /// The buckets this node owns in its map.
    fn owned_buckets(&self) -> Vec<BucketId> {
        self.control.state().map.buckets_of(self.node_id)
    }

    fn found_keys(&self, keys: Vec<(Vec<u8>, BucketId, u64)>) -> Vec<FoundKey> {
        keys.into_iter()
            .map(|(k, bucket, version)| FoundKey {
                key: String::from_utf8_lossy(&k).into_owned(),
                bucket: bucket.0,
                version,
                node: self.node_id,
            })
            .collect()
    }

    /// The page of keys `local` finds here and `remote` at every other member (asked for one
    /// more than the page holds, so that `more` is known).
    async fn list<Fut>(
        &self,
        page: &Page,
        scope: Scope,
        local: impl FnOnce(&[BucketId]) -> Vec<(Vec<u8>, BucketId, u64)>,
        remote: impl Fn(String) -> Fut,
    ) -> Result<KeyList, ApiError>
    where
        Fut: Future<Output = Result<KeyList, ApiError>>,
    {
        // Without its lease this node lists nothing of its own: its buckets may be served
        // elsewhere by now.
        let refusal = self.core.read_refusal();
        if scope == Scope::Local {
            if let Some(e) = refusal {
                return Err(e.into());
            }
            let (keys, more, next) = page.cut(self.found_keys(local(&self.owned_buckets())));
            return Ok(KeyList { keys, more, next, ..Default::default() });
        }
        let local_list = || match &refusal {
            Some(_) => KeyList::default(),
            None => KeyList { keys: self.found_keys(local(&self.owned_buckets())), ..Default::default() },
        };
        let (answers, mut errors) = self.broadcast(local_list, remote).await;
        if let Some(e) = refusal {
            errors.push(NodeFailure { node: self.node_id, detail: ApiError::from(e).to_string() });
        }
        let keys: Vec<FoundKey> = answers.into_iter().flat_map(|(_, list)| list.keys).collect();
        let (keys, more, next) = page.cut(keys);
        Ok(KeyList { keys, more, next, incomplete: !errors.is_empty(), errors })
    }

    pub(super) async fn keys_everywhere(&self, prefix: String, page: Page, scope: Scope) -> Result<KeyList, ApiError> {
        let started = Instant::now();
        let ask = page.with_one_more();
        let list = self
            .list(
                &page,
                scope,
                |buckets| self.cache.keys_with_prefix(prefix.as_bytes(), buckets, &ask),
                |peer| {
                    let request = Keys { prefix: prefix.clone(), page: ask.clone() };
                    let peers = &self.peers;
                    async move { peers.broadcast(&peer, request).await.map(|l| l.0) }
                },
            )
            .await;
        self.timed(Op::List, started, list)
    }

    pub(super) async fn tagged_everywhere(&self, tag: String, page: Page, scope: Scope) -> Result<KeyList, ApiError> {
        let started = Instant::now();
        let ask = page.with_one_more();
        let list = self
            .list(
                &page,
                scope,
                |buckets| self.cache.keys_with_tag(&tag, buckets, &ask),
                |peer| {
                    let request = Tagged { tag: tag.clone(), page: ask.clone() };
                    let peers = &self.peers;
                    async move { peers.broadcast(&peer, request).await.map(|l| l.0) }
                },
            )
            .await;
        self.timed(Op::Tagged, started, list)
    }

    pub(super) async fn remove_tagged_everywhere(&self, tag: String, scope: Scope) -> Result<Removed, ApiError> {
        let started = Instant::now();
        let result = self.remove_tagged_in_all(tag, scope).await;
        self.timed(Op::RemoveTagged, started, result)
    }

    async fn remove_tagged_in_all(&self, tag: String, scope: Scope) -> Result<Removed, ApiError> {
        let here = self.remove_tagged_here(&tag).await?;
        if scope == Scope::Local {
            return Ok(here);
        }
        let (answers, errors) = self
            .broadcast(
                || here,
                |peer| {
                    let (peers, request) = (&self.peers, RemoveTagged { tag: tag.clone() });
                    async move { peers.broadcast(&peer, request).await.map(|r| r.0) }
                },
            )
            .await;
        let removed = answers.iter().map(|(_, r)| r.removed).sum();
        // A member that answered may still have failed some deletes (it says so).
        let mut errors = errors;
        errors.extend(answers.into_iter().flat_map(|(_, r)| r.errors));
        Ok(Removed { removed, incomplete: !errors.is_empty(), errors })
    }

    /// Removes the items tagged `tag` in the buckets this node owns, as deletes at the
    /// version found (an item rewritten meanwhile stays): like any delete they wait for a
    /// frozen bucket and reach its replica and shadow, so a removed item does not come back
    /// after a failover or a move.
    async fn remove_tagged_here(&self, tag: &str) -> Result<Removed, ApiError> {
        let found = self.cache.keys_with_tag(tag, &self.owned_buckets(), &Page::first(usize::MAX));
        let mut removed = 0;
        let mut failures = Vec::new();
        let keys: Vec<(String, Option<u64>)> = found
            .into_iter()
            .map(|(k, _, version)| (String::from_utf8_lossy(&k).into_owned(), Some(version)))
            .collect();
        for chunk in keys.chunks(REMOVE_BATCH) {
            let results = self.delete_many(chunk.to_vec(), Default::default()).await?;
            for r in results {
                match r {
                    Ok(true) => removed += 1,
                    Ok(false) | Err(ApiError::NotFound | ApiError::PreconditionFailed { .. }) => {}
                    Err(e) => failures.push(NodeFailure { node: self.node_id, detail: e.to_string() }),
                }
            }
        }
        failures.truncate(1);
        Ok(Removed { removed, incomplete: !failures.is_empty(), errors: failures })
    }
}
