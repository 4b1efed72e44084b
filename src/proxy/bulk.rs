//! Bulk operations: keys grouped by owner, one forwarded request per owner, all at once.

use std::collections::BTreeMap;
use std::future::Future;
use std::time::Instant;

use base64::Engine;
use bytes::Bytes;
use futures::future::join_all;
use shoal_http_api::types::{BulkResults, GetOk, KeyError, KeyResult, PutOk, RouteContext};
use shoal_http_api::{ApiError, Problem, PutItem};
use shoal_raft::{bucket_of, BucketId, NodeId};

use super::{api_addr_of, NodeApi, Target, ROUTE_ATTEMPTS};
use crate::cache::Change;
use crate::metrics::Op;
use crate::transfer::shadow::ShadowGuard;

impl NodeApi {
    /// Runs a bulk operation: items grouped by owner, local ones here, each remote group in
    /// one forwarded request, all groups at once; groups refused with `not_owner` are routed
    /// again. Results come back in request order.
    async fn bulk<I, T, Fut>(
        &self,
        items: &[I],
        key_of: impl Fn(&I) -> &str,
        ctx: RouteContext,
        local: impl Fn(&I, BucketId) -> Result<T, ApiError>,
        remote: impl Fn(String, NodeId, Vec<I>, u64) -> Fut,
    ) -> Result<Vec<Result<T, ApiError>>, ApiError>
    where
        I: Clone,
        Fut: Future<Output = Result<Vec<Result<T, ApiError>>, ApiError>>,
    {
        let mut results: Vec<Option<Result<T, ApiError>>> = (0..items.len()).map(|_| None).collect();
        let mut pending: Vec<usize> = (0..items.len()).collect();
        for _ in 0..ROUTE_ATTEMPTS {
            if pending.is_empty() {
                break;
            }
            // Every key of this attempt is decided on the same state.
            let state = self.state_at_least(ctx.forwarded_map_version.unwrap_or(0)).await;
            let mut moving = Vec::new();
            let mut groups: BTreeMap<NodeId, (u64, Vec<usize>)> = BTreeMap::new();
            for &i in &pending {
                let bucket = bucket_of(key_of(&items[i]).as_bytes());
                match self.target_in(&state, bucket, ctx) {
                    Ok((Target::Local, _)) => match local(&items[i], bucket) {
                        // Frozen by a handover: try again once the flip (or abort) is settled.
                        Err(e) if super::is_moving(&e) => moving.push(i),
                        other => results[i] = Some(other),
                    },
                    Ok((Target::Remote { owner }, v)) => groups.entry(owner).or_insert((v, vec![])).1.push(i),
                    Err(e @ ApiError::NotOwner { .. }) if ctx.forwarded_map_version.is_some() => return Err(e),
                    Err(e) => results[i] = Some(Err(e)),
                }
            }
            let mut calls = Vec::new();
            for (owner, (version, idx)) in groups {
                let api_addr = match api_addr_of(&state, owner) {
                    Ok(a) => a,
                    Err(e) => {
                        idx.into_iter().for_each(|i| results[i] = Some(Err(e.clone())));
                        continue;
                    }
                };
                let batch: Vec<I> = idx.iter().map(|&i| items[i].clone()).collect();
                self.metrics.forwarded.increment(idx.len() as u64);
                let call = remote(api_addr, owner, batch, version);
                calls.push(async move { (idx, version, call.await) });
            }
            let mut retry = Vec::new();
            let mut newest = 0;
            for (idx, version, answer) in join_all(calls).await {
                match answer {
                    Ok(answers) if answers.len() == idx.len() => {
                        for (i, a) in idx.into_iter().zip(answers) {
                            results[i] = Some(a);
                        }
                    }
                    Ok(_) => {
                        let e = ApiError::Internal("a peer answered a bulk request with the wrong count".into());
                        idx.into_iter().for_each(|i| results[i] = Some(Err(e.clone())));
                    }
                    Err(ApiError::NotOwner { map_version, .. }) => {
                        newest = newest.max(map_version.max(version + 1));
                        retry.extend(idx);
                    }
                    Err(e) => idx.into_iter().for_each(|i| results[i] = Some(Err(e.clone()))),
                }
            }
            if !retry.is_empty() {
                self.state_at_least(newest).await;
            }
            if !moving.is_empty() {
                self.cache.wait_thawed().await;
                retry.extend(moving);
            }
            pending = retry;
        }
        let changing = || ApiError::unavailable("map_changing", "the key's bucket is changing owner; retry");
        Ok(results.into_iter().map(|r| r.unwrap_or_else(|| Err(changing()))).collect())
    }

    pub(super) async fn bulk_get_routed(
        &self,
        keys: Vec<String>,
        ctx: RouteContext,
    ) -> Result<Vec<Result<Option<GetOk>, ApiError>>, ApiError> {
        let started = Instant::now();
        let local = |key: &String, bucket| match self.local_get(key, bucket) {
            Ok(ok) => Ok(Some(ok)),
            Err(ApiError::NotFound) => Ok(None),
            Err(e) => Err(e),
        };
        let remote = |api: String, owner: NodeId, batch: Vec<String>, v: u64| {
            let peers = &self.peers;
            async move {
                let answer: BulkResults = peers.bulk_get(&api, batch, v).await?;
                Ok(answer
                    .results
                    .iter()
                    .map(|r| match (&r.error, r.found) {
                        (Some(e), _) => Err(key_error(e)),
                        (None, Some(true)) => Ok(Some(GetOk {
                            value: value_of(r)?,
                            version: r.version.unwrap_or(0),
                            bucket: r.bucket,
                            node: owner,
                        })),
                        (None, _) => Ok(None),
                    })
                    .collect())
            }
        };
        let result = self.bulk(&keys, |k| k.as_str(), ctx, local, remote).await;
        self.timed(Op::BulkGet, started, result)
    }

    /// Locks the buckets of `keys` that have shadows (see `transfer::shadow`).
    async fn shadow_guards<'a>(
        &'a self,
        keys: impl Iterator<Item = &'a str>,
        ctx: RouteContext,
    ) -> Vec<ShadowGuard<'a>> {
        let buckets: Vec<BucketId> = keys.map(|k| bucket_of(k.as_bytes())).collect();
        let state = self.state_at_least(ctx.forwarded_map_version.unwrap_or(0)).await;
        self.shadows.guards(&state, self.node_id, &buckets).await
    }

    /// Writes the local results of a bulk write through to the shadows and replicas of
    /// `guards`; returns the buckets whose replica did not apply them, with the error.
    async fn write_through_all(
        &self,
        guards: &[ShadowGuard<'_>],
        changes: Vec<(BucketId, Change)>,
    ) -> BTreeMap<BucketId, ApiError> {
        let mut failed = BTreeMap::new();
        for guard in guards {
            let mine: Vec<Change> =
                changes.iter().filter(|(b, _)| *b == guard.bucket).map(|(_, c)| c.clone()).collect();
            if let Err(e) = self.shadows.write_through(guard, &mine).await {
                failed.insert(guard.bucket, e);
            }
        }
        failed
    }

    pub(super) async fn bulk_put_routed(
        &self,
        items: Vec<PutItem>,
        ctx: RouteContext,
    ) -> Result<Vec<Result<PutOk, ApiError>>, ApiError> {
        let started = Instant::now();
        let remote = |api: String, owner: NodeId, batch: Vec<PutItem>, v: u64| {
            let peers = &self.peers;
            async move {
                let answer = peers.bulk_put(&api, &batch, v).await?;
                Ok(answer
                    .results
                    .into_iter()
                    .map(|r| match r.error {
                        Some(e) => Err(key_error(&e)),
                        None => {
                            Ok(PutOk { version: r.version.unwrap_or(0), bucket: r.bucket, node: owner, key: r.key })
                        }
                    })
                    .collect())
            }
        };
        if let Some(e) = self.health.write_refusal() {
            return self.timed(Op::BulkPut, started, Err(e));
        }
        let guards = self.shadow_guards(items.iter().map(|i| i.key.as_str()), ctx).await;
        let previous: Vec<Option<crate::cache::ExportedItem>> = items
            .iter()
            .map(|i| {
                (!guards.is_empty())
                    .then(|| self.cache.export_item(bucket_of(i.key.as_bytes()), i.key.as_bytes()))
                    .flatten()
            })
            .collect();
        let mut result =
            self.bulk(&items, |i| i.key.as_str(), ctx, |item, bucket| self.local_put(item, bucket), remote).await;
        // The lease again, after the writes (see `put`).
        if let (Ok(results), Some(e)) = (&mut result, self.health.write_refusal()) {
            for ((item, r), previous) in items.iter().zip(results.iter_mut()).zip(&previous) {
                if r.as_ref().is_ok_and(|ok| ok.node == self.node_id) {
                    let written = r.as_ref().ok().map(|ok| ok.version);
                    self.undo(bucket_of(item.key.as_bytes()), &item.key, written, previous.as_ref());
                    *r = Err(e.clone());
                }
            }
        }
        if let (false, Ok(results)) = (guards.is_empty(), &mut result) {
            let changes = items
                .iter()
                .zip(results.iter())
                .filter(|(_, r)| r.as_ref().is_ok_and(|ok| ok.node == self.node_id))
                .filter_map(|(item, _)| {
                    let b = bucket_of(item.key.as_bytes());
                    self.cache.export_item(b, item.key.as_bytes()).map(|stored| (b, Change::Put(stored)))
                })
                .collect();
            let failed = self.write_through_all(&guards, changes).await;
            for ((item, r), previous) in items.iter().zip(results.iter_mut()).zip(&previous) {
                let b = bucket_of(item.key.as_bytes());
                if let (Some(e), Ok(ok)) = (failed.get(&b), &*r) {
                    if ok.node == self.node_id {
                        self.undo(b, &item.key, Some(ok.version), previous.as_ref());
                        *r = Err(e.clone());
                    }
                }
            }
        }
        self.timed(Op::BulkPut, started, result)
    }

    pub(super) async fn bulk_delete_routed(
        &self,
        keys: Vec<String>,
        ctx: RouteContext,
    ) -> Result<Vec<Result<bool, ApiError>>, ApiError> {
        let started = Instant::now();
        let result = self.delete_many(keys.into_iter().map(|k| (k, None)).collect(), ctx).await;
        self.timed(Op::BulkDelete, started, result)
    }

    /// Deletes keys, each only at its expected version when one is given, with the same
    /// guarantees as a single delete: frozen buckets are waited for, and every delete done
    /// here reaches the bucket's replica and shadow before it counts, or is taken back.
    pub(super) async fn delete_many(
        &self,
        keys: Vec<(String, Option<u64>)>,
        ctx: RouteContext,
    ) -> Result<Vec<Result<bool, ApiError>>, ApiError> {
        let remote = |api: String, _owner: NodeId, batch: Vec<(String, Option<u64>)>, v: u64| {
            let peers = &self.peers;
            async move {
                if batch.iter().all(|(_, cas)| cas.is_none()) {
                    let keys = batch.into_iter().map(|(k, _)| k).collect();
                    let answer = peers.bulk_delete(&api, keys, v).await?;
                    return Ok(answer
                        .results
                        .iter()
                        .map(|r| match &r.error {
                            Some(e) => Err(key_error(e)),
                            None => Ok(r.deleted.unwrap_or(false)),
                        })
                        .collect());
                }
                // Versioned deletes (rare: a bucket that moved away meanwhile) go one by one.
                let mut results = Vec::with_capacity(batch.len());
                for (key, cas) in &batch {
                    results.push(match peers.delete(&api, key, *cas, v).await {
                        Ok(()) => Ok(true),
                        Err(ApiError::NotFound) => Ok(false),
                        Err(e @ ApiError::NotOwner { .. }) => return Err(e),
                        Err(e) => Err(e),
                    });
                }
                Ok(results)
            }
        };
        if let Some(e) = self.health.write_refusal() {
            return Err(e);
        }
        let local = |(key, cas): &(String, Option<u64>), bucket| self.local_delete(key, *cas, bucket);
        let guards = self.shadow_guards(keys.iter().map(|(k, _)| k.as_str()), ctx).await;
        let before: Vec<Option<crate::cache::ExportedItem>> = keys
            .iter()
            .map(|(k, _)| {
                (!guards.is_empty()).then(|| self.cache.export_item(bucket_of(k.as_bytes()), k.as_bytes())).flatten()
            })
            .collect();
        let mut result = self.bulk(&keys, |(k, _)| k.as_str(), ctx, local, remote).await;
        let Ok(results) = &mut result else { return result };
        let deleted_here = |key: &str, r: &Result<bool, ApiError>| {
            matches!(r, Ok(true)) && self.cache.export_item(bucket_of(key.as_bytes()), key.as_bytes()).is_none()
        };
        // The lease again, after the deletes (see `put`).
        if let Some(e) = self.health.write_refusal() {
            for (((key, _), r), gone) in keys.iter().zip(results.iter_mut()).zip(&before) {
                if gone.is_some() && deleted_here(key, r) {
                    self.undo(bucket_of(key.as_bytes()), key, None, gone.as_ref());
                    *r = Err(e.clone());
                }
            }
        }
        if !guards.is_empty() {
            let changes = before
                .iter()
                .cloned()
                .zip(results.iter())
                .filter(|(_, r)| matches!(r, Ok(true)))
                .filter_map(|(gone, _)| gone)
                .map(|gone| (bucket_of(&gone.key), Change::Delete { key: gone.key, version: gone.version }))
                .collect();
            let failed = self.write_through_all(&guards, changes).await;
            for (((key, _), r), gone) in keys.iter().zip(results.iter_mut()).zip(&before) {
                let b = bucket_of(key.as_bytes());
                if let (Some(e), Ok(true)) = (failed.get(&b), &*r) {
                    self.undo(b, key, None, gone.as_ref());
                    *r = Err(e.clone());
                }
            }
        }
        result
    }
}

fn key_error(e: &KeyError) -> ApiError {
    ApiError::from_problem(&Problem {
        type_uri: String::new(),
        title: String::new(),
        status: e.status,
        detail: e.detail.clone(),
        code: e.code.clone(),
        current_version: None,
        map_version: None,
    })
}

fn value_of(r: &KeyResult) -> Result<Bytes, ApiError> {
    match (&r.value, &r.value_base64) {
        (Some(text), _) => Ok(Bytes::from(text.clone())),
        (None, Some(b64)) => base64::engine::general_purpose::STANDARD
            .decode(b64)
            .map(Bytes::from)
            .map_err(|e| ApiError::Internal(format!("peer sent bad base64: {e}"))),
        (None, None) => Ok(Bytes::new()),
    }
}
