//! Bulk operations: keys grouped by owner, one forwarded request per owner, all at once; the
//! keys this node serves grouped by bucket, each bucket written under one write permit.

use std::collections::BTreeMap;
use std::future::Future;
use std::time::Instant;

use futures::future::join_all;
use shoal_http_api::types::{GetOk, PutOk, RouteContext};
use shoal_http_api::{ApiError, PutItem};
use shoal_raft::{bucket_of, BucketId, ClusterState, NodeId};

use super::{
    addrs_of, is_moving, is_passing, is_passing_answer, routing, write_of, NodeApi, FROZEN_WAIT, PASSING_WAIT,
    ROUTE_ATTEMPTS,
};
use crate::error::DataError;
use crate::metrics::Op;
use crate::mirror::{outcome_of, Outcome};
use crate::phase::Route;
use crate::transport::Addrs;

/// The results of the keys of one bucket written here, by index into the request.
type LocalResults<T> = Vec<(usize, Result<T, DataError>)>;

/// The owners' answers of one round: each owner's keys (indices into the request) and its
/// results for them, or an error of its whole share.
type Answers<T> = Vec<(Vec<usize>, Result<Vec<Result<T, ApiError>>, ApiError>)>;

/// The keys of one round this node serves, by bucket, and the others, by owner.
/// The keys of one routing round, by where they go (their indexes in the request).
#[derive(Default)]
struct Routed {
    /// Keys this node serves, by bucket.
    here: BTreeMap<BucketId, Vec<usize>>,
    /// Keys other nodes own, by owner.
    owners: BTreeMap<NodeId, Vec<usize>>,
    /// Keys answered at once: a redirect, or this node's refusal.
    answered: Vec<(usize, ApiError)>,
    /// Keys whose bucket's ownership is passing: routed again next round.
    passing: Vec<usize>,
}

/// What one routing round of a bulk operation leaves to do.
#[derive(Default)]
struct Round {
    /// Keys to route again: refused `not_owner`, or frozen by a move.
    retry: Vec<usize>,
    /// Keys retried only because their bucket's ownership is passing: they use up no attempt.
    passing: Vec<usize>,
    /// How many of `retry` were frozen by a move.
    frozen: usize,
    /// The newest map version an owner's refusal named (0: none).
    newest: u64,
}

impl Round {
    /// Whether this round used up one of the request's attempts: not when the map moved on
    /// meanwhile (`moved_on`), nor when it only waits — for a bucket's ownership to pass, or
    /// for a frozen bucket while `frozen_waits` — rather than routes again. An owner that no
    /// longer owns one of the keys refuses its whole share, and during a join or leave buckets
    /// move one after another: a share spanning several of them was refused round after round
    /// (`map_changing` after three). Routing again on a newer map is progress, not a lost
    /// attempt, for as long as a write waits for a frozen bucket.
    fn used_an_attempt(&self, moved_on: bool, frozen_waits: bool) -> bool {
        let rerouted = self.newest > 0 || self.retry.len() > self.frozen;
        let waiting = !self.passing.is_empty() || (self.frozen > 0 && frozen_waits);
        !moved_on && (rerouted || !waiting)
    }

    /// Takes the results of the keys served here.
    fn local<T>(
        &mut self,
        done: impl IntoIterator<Item = (usize, Result<T, DataError>)>,
        may_wait: &impl Fn() -> bool,
        results: &mut [Option<Result<T, ApiError>>],
    ) {
        for (i, result) in done {
            match result {
                Err(e) if is_moving(&e) => {
                    self.frozen += 1;
                    self.retry.push(i);
                }
                Err(DataError::NotOwner { .. }) => self.retry.push(i),
                Err(e) if is_passing(&e) && may_wait() => self.passing.push(i),
                other => results[i] = Some(other.map_err(ApiError::from)),
            }
        }
    }

    /// Takes the answers of the owners asked on map `version`, each for the keys at its
    /// indices: one result per key, or an error of its whole share.
    fn remote<T>(
        &mut self,
        answers: Answers<T>,
        version: u64,
        may_wait: &impl Fn() -> bool,
        results: &mut [Option<Result<T, ApiError>>],
    ) {
        for (idx, answer) in answers {
            match answer {
                Ok(answers) if answers.len() == idx.len() => {
                    for (i, a) in idx.into_iter().zip(answers) {
                        match a {
                            Err(e) if is_passing_answer(&e) && may_wait() => self.passing.push(i),
                            a => results[i] = Some(a),
                        }
                    }
                }
                Ok(_) => {
                    let e = ApiError::Internal("a peer answered a bulk request with the wrong count".into());
                    idx.into_iter().for_each(|i| results[i] = Some(Err(e.clone())));
                }
                Err(ApiError::NotOwner { map_version, .. }) => {
                    self.newest = self.newest.max(map_version.max(version + 1));
                    self.retry.extend(idx);
                }
                Err(e) if is_passing_answer(&e) && may_wait() => self.passing.extend(idx),
                Err(e) => idx.into_iter().for_each(|i| results[i] = Some(Err(e.clone()))),
            }
        }
    }
}

impl NodeApi {
    /// Runs a bulk operation: the keys of each bucket this node serves by `local` (once per
    /// bucket), every other owner's keys in one forwarded request, all owners at once. Keys
    /// refused with `not_owner`, whose bucket is frozen by a move, or whose bucket's ownership
    /// is passing to another node (bounded), are routed again. Results come back in request
    /// order.
    async fn bulk<I, T, LF, RF>(
        &self,
        items: &[I],
        key_of: impl Fn(&I) -> &str,
        ctx: RouteContext,
        local: impl Fn(BucketId, Vec<usize>) -> LF,
        remote: impl Fn(Addrs, NodeId, Vec<I>, u64) -> RF,
    ) -> Result<Vec<Result<T, ApiError>>, ApiError>
    where
        I: Clone,
        LF: Future<Output = LocalResults<T>>,
        RF: Future<Output = Result<Vec<Result<T, ApiError>>, ApiError>>,
    {
        let mut results: Vec<Option<Result<T, ApiError>>> = (0..items.len()).map(|_| None).collect();
        let mut pending: Vec<usize> = (0..items.len()).collect();
        let passing_until = tokio::time::Instant::now() + PASSING_WAIT;
        let may_wait = || tokio::time::Instant::now() < passing_until;
        // A bucket frozen by a move thaws within moments; several moves in a row (joins) are
        // waited out for as long as a single write would wait, without using up attempts.
        let frozen_until = tokio::time::Instant::now() + FROZEN_WAIT;
        let mut attempts = 0;
        while !pending.is_empty() && attempts < ROUTE_ATTEMPTS {
            // Every key of this attempt is decided on the same state.
            let state = self.state_for(ctx).await?;
            let routed = self.route_keys(&state, &pending, |i| key_of(&items[i]), ctx, may_wait())?;
            routed.answered.into_iter().for_each(|(i, e)| results[i] = Some(Err(e)));
            let mut round = Round { passing: routed.passing, ..Round::default() };
            let version = state.map.version;
            let mut calls = Vec::new();
            for (owner, idx) in routed.owners {
                let to = match addrs_of(&state, owner) {
                    Ok(a) => a,
                    Err(e) => {
                        idx.into_iter().for_each(|i| results[i] = Some(Err(e.clone())));
                        continue;
                    }
                };
                let batch: Vec<I> = idx.iter().map(|&i| items[i].clone()).collect();
                self.metrics.forwarded.increment(idx.len() as u64);
                let call = remote(to, owner, batch, version);
                calls.push(async move { (idx, call.await) });
            }
            // Buckets here at once: each waits for its own replica, not for the others'.
            let locals = async {
                let local = &local;
                join_all(routed.here.into_iter().map(|(bucket, idx)| local(bucket, idx))).await.into_iter().flatten()
            };
            let (done_here, answers) = futures::join!(locals, join_all(calls));
            round.local(done_here, &may_wait, &mut results);
            round.remote(answers, version, &may_wait, &mut results);
            if round.newest > 0 {
                self.state_at_least(round.newest).await;
            }
            if round.frozen > 0 {
                // Frozen by a handover: try again once the flip (or abort) is settled.
                self.cache.wait_thawed().await;
            }
            let frozen_waits = tokio::time::Instant::now() < frozen_until;
            let moved_on = round.newest > 0 && self.control.state().map.version > version && frozen_waits;
            if round.used_an_attempt(moved_on, frozen_waits) {
                attempts += 1;
            }
            if !round.passing.is_empty() {
                self.wait_passing(version).await;
            }
            round.retry.extend(round.passing);
            pending = round.retry;
        }
        Ok(results
            .into_iter()
            .zip(items)
            .map(|(r, item)| {
                r.unwrap_or_else(|| Err(DataError::MapChanging(bucket_of(key_of(item).as_bytes())).into()))
            })
            .collect())
    }

    /// Routes the keys at `pending` on `state`: the keys this node serves by bucket, the
    /// others by owner; a redirect or a refusal is their answer at once, and a key whose
    /// bucket's ownership is passing waits for the next round (if `may_wait`). A `not_owner`
    /// refusal of this node's own routing fails the whole request.
    fn route_keys<'k>(
        &self,
        state: &ClusterState,
        pending: &[usize],
        key_at: impl Fn(usize) -> &'k str,
        ctx: RouteContext,
        may_wait: bool,
    ) -> Result<Routed, ApiError> {
        let mut routed = Routed::default();
        for &i in pending {
            let bucket = bucket_of(key_at(i).as_bytes());
            match self.core.route(state, bucket, routing(ctx)) {
                Ok(Route::Local) => routed.here.entry(bucket).or_default().push(i),
                Ok(Route::Forward { owner }) => routed.owners.entry(owner).or_default().push(i),
                Ok(Route::Redirect { owner }) => routed.answered.push((i, self.redirect_to(state, owner))),
                Err(e @ DataError::NotOwner { .. }) => return Err(e.into()),
                Err(e) if is_passing(&e) && may_wait => routed.passing.push(i),
                Err(e) => routed.answered.push((i, e.into())),
            }
        }
        Ok(routed)
    }

    pub(super) async fn bulk_get_routed(
        &self,
        keys: Vec<String>,
        ctx: RouteContext,
    ) -> Result<Vec<Result<Option<GetOk>, ApiError>>, ApiError> {
        let started = Instant::now();
        if let Some(staleness) = ctx.mirror_read {
            // Another node's mirror reads: this node's replica copies or refusals, key by key.
            let behind = self.mirror_state(ctx, BucketId(0)).await.err();
            let results = keys
                .iter()
                .map(|k| {
                    let bucket = bucket_of(k.as_bytes());
                    match &behind {
                        Some(DataError::ReplicaNotFresh { why, .. }) => {
                            Err(DataError::ReplicaNotFresh { bucket, why: *why })
                        }
                        Some(e) => Err(e.clone()),
                        None => self.local_mirror_get(k, bucket, staleness),
                    }
                    .map_err(ApiError::from)
                })
                .collect();
            return self.timed(Op::BulkGet, started, Ok(results));
        }
        let mut done: Vec<Option<Result<Option<GetOk>, ApiError>>> = vec![None; keys.len()];
        if self.reads_from_mirrors(ctx) {
            self.bulk_mirror_get(&keys, ctx, &mut done).await;
        }
        let left: Vec<usize> = (0..keys.len()).filter(|&i| done[i].is_none()).collect();
        if left.is_empty() {
            return self.timed(Op::BulkGet, started, Ok(done.into_iter().flatten().collect()));
        }
        let keys: Vec<String> = left.iter().map(|&i| keys[i].clone()).collect();
        let local = |bucket: BucketId, idx: Vec<usize>| {
            let keys = &keys;
            async move {
                let mut found = Vec::with_capacity(idx.len());
                for i in idx {
                    found.push((i, self.local_get(&keys[i], bucket).await));
                }
                found
            }
        };
        let remote = |to: Addrs, owner: NodeId, batch: Vec<String>, v: u64| {
            let peers = &self.peers;
            async move { peers.bulk_get(&to, owner, batch, v).await }
        };
        let result = self.bulk(&keys, |k| k.as_str(), ctx, local, remote).await.map(|results| {
            for (i, r) in left.into_iter().zip(results) {
                done[i] = Some(r);
            }
            done.into_iter().flatten().collect()
        });
        self.timed(Op::BulkGet, started, result)
    }

    /// Bulk reads balanced over mirrors: per owner, its keys go to one mirror chosen by the
    /// strategy; what a replica holder answers fills `done`, and the keys it refused (or all of
    /// them, when it did not answer) are left for the owner.
    async fn bulk_mirror_get(
        &self,
        keys: &[String],
        ctx: RouteContext,
        done: &mut [Option<Result<Option<GetOk>, ApiError>>],
    ) {
        let state = self.control.state();
        let mut by_holder: BTreeMap<NodeId, Vec<usize>> = BTreeMap::new();
        let mut chosen: BTreeMap<NodeId, Option<NodeId>> = BTreeMap::new();
        for (i, k) in keys.iter().enumerate() {
            let (Some(owner), Some(holder)) = crate::phase::mirrors_of(&state, bucket_of(k.as_bytes())) else {
                continue;
            };
            let pick = *chosen.entry(owner).or_insert_with(|| self.mirrors.choose(&[owner, holder]));
            if pick == Some(holder) {
                by_holder.entry(holder).or_default().push(i);
            }
        }
        let staleness = self.staleness(ctx);
        let asks = by_holder.into_iter().map(|(holder, idx)| {
            let state = &state;
            async move {
                let sent = Instant::now();
                let answer = if holder == self.node_id {
                    Ok(idx
                        .iter()
                        .map(|&i| {
                            self.local_mirror_get(&keys[i], bucket_of(keys[i].as_bytes()), staleness)
                                .map_err(ApiError::from)
                        })
                        .collect())
                } else {
                    match addrs_of(state, holder) {
                        Ok(to) => {
                            let batch = idx.iter().map(|&i| keys[i].clone()).collect();
                            self.peers.mirror_bulk_get(to, holder, batch, state.map.version, staleness).await
                        }
                        Err(_) => Err(crate::transport::CallError::Broken("not a member".into())),
                    }
                };
                (holder, idx, sent.elapsed(), answer)
            }
        });
        for (holder, idx, took, answer) in join_all(asks).await {
            match answer {
                Ok(results) => {
                    let refused = results.iter().any(|r| r.is_err());
                    let outcome = if refused { Outcome::Refused } else { Outcome::Answered };
                    self.mirrors.record_read(holder, outcome, took);
                    for (i, r) in idx.into_iter().zip(results) {
                        // Only values: an absent key is for the owner to say.
                        if matches!(r, Ok(Some(_))) {
                            self.mirrors.served_by(holder);
                            done[i] = Some(r);
                        }
                    }
                }
                Err(e) => self.mirrors.record_read(holder, outcome_of(&e), took),
            }
        }
    }

    pub(super) async fn bulk_put_routed(
        &self,
        items: Vec<PutItem>,
        ctx: RouteContext,
    ) -> Result<Vec<Result<PutOk, ApiError>>, ApiError> {
        let started = Instant::now();
        if let Some(e) = self.write_refusal(ctx) {
            return self.timed(Op::BulkPut, started, Err(e));
        }
        let local = |bucket: BucketId, idx: Vec<usize>| {
            let items = &items;
            async move {
                let mut permit = match self.core.write_permit(bucket).await {
                    Ok(p) => p,
                    Err(e) => return idx.into_iter().map(|i| (i, Err(e.clone()))).collect(),
                };
                let mut done: LocalResults<PutOk> = idx
                    .into_iter()
                    .map(|i| {
                        let item = &items[i];
                        let put = permit.put(&write_of(item));
                        (
                            i,
                            put.map(|version| PutOk {
                                key: item.key.clone(),
                                version,
                                bucket: bucket.0,
                                node: self.node_id,
                            }),
                        )
                    })
                    .collect();
                if let Err(e) = permit.commit().await {
                    done.iter_mut().filter(|(_, r)| r.is_ok()).for_each(|(_, r)| *r = Err(e.clone()));
                }
                done
            }
        };
        let remote = |to: Addrs, owner: NodeId, batch: Vec<PutItem>, v: u64| {
            let peers = &self.peers;
            async move { peers.bulk_put(&to, owner, batch, v).await }
        };
        let result = self.bulk(&items, |i| i.key.as_str(), ctx, local, remote).await;
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
        if let Some(e) = self.write_refusal(ctx) {
            return Err(e);
        }
        let local = |bucket: BucketId, idx: Vec<usize>| {
            let keys = &keys;
            async move {
                let mut permit = match self.core.write_permit(bucket).await {
                    Ok(p) => p,
                    Err(e) => return idx.into_iter().map(|i| (i, Err(e.clone()))).collect(),
                };
                let mut done: LocalResults<bool> = idx
                    .into_iter()
                    .map(|i| {
                        let (key, cas) = &keys[i];
                        (i, permit.delete(key.as_bytes(), *cas))
                    })
                    .collect();
                if let Err(e) = permit.commit().await {
                    done.iter_mut().filter(|(_, r)| matches!(r, Ok(true))).for_each(|(_, r)| *r = Err(e.clone()));
                }
                done
            }
        };
        let remote = |to: Addrs, _: NodeId, batch: Vec<(String, Option<u64>)>, v: u64| {
            let peers = &self.peers;
            async move {
                if batch.iter().all(|(_, cas)| cas.is_none()) {
                    let keys = batch.into_iter().map(|(k, _)| k).collect();
                    return peers.bulk_delete(&to, keys, v).await;
                }
                // Versioned deletes (rare: a bucket that moved away meanwhile) go one by one.
                let mut results = Vec::with_capacity(batch.len());
                for (key, cas) in &batch {
                    results.push(match peers.delete(&to, key, *cas, v).await {
                        Ok(existed) => Ok(existed),
                        Err(e @ ApiError::NotOwner { .. }) => return Err(e),
                        Err(e) => Err(e),
                    });
                }
                Ok(results)
            }
        };
        self.bulk(&keys, |(k, _)| k.as_str(), ctx, local, remote).await
    }
}
