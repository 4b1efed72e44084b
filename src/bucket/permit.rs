//! [`WritePermit`]: the one write path. Single and bulk puts and deletes, and removal by tag,
//! all write through a permit.
//!
//! A permit is taken per bucket ([`BucketCore::write_permit`]): the plan says this node may
//! write the bucket and which copies must get the writes; the bucket's lock (held when there
//! are copies) keeps the copies' order the store's. The writes go to the store at once,
//! recorded with what they replaced; [`WritePermit::commit`] then checks the lease again,
//! writes through to the shadow and to the replica, and only then counts the writes as done.
//! If anything fails, every write of the permit is taken back: the item as it was comes back
//! under a new version (so every copy orders it after the write), and the bucket is sent whole
//! to its replica before its next change, in case the replica applied the write after all. A
//! permit dropped before its commit ended (its caller went away) takes its writes back too.

use std::time::Duration;

use bytes::Bytes;
use tokio::sync::{MutexGuard, RwLockWriteGuard};

use super::BucketCore;
use crate::cache::{CacheError, Change, ExportedItem, Write};
use crate::error::{DataError, ReplicaError};
use crate::phase::{plan_holds, write_refusal, WritePlan};
use crate::replication::Holder;
use crate::transfer::shadow::ShadowWrites;
use crate::transport::frame::change_body;
use crate::transport::{CallError, PEER_CALL_TIMEOUT};

/// One write done under a permit, and how to take it back.
struct Done {
    key: Bytes,
    /// The item's version after the write (`None`: deleted).
    written: Option<u64>,
    /// The item it replaced.
    previous: Option<ExportedItem>,
    /// The write as its copies apply it.
    change: Change,
}

/// Permission to write one bucket now (see the module docs).
pub struct WritePermit<'a> {
    core: &'a BucketCore,
    plan: WritePlan,
    /// The bucket's write lock, and its mark that reads wait (writes in the store may still
    /// be taken back), both held until the permit is committed or dropped.
    _lock: Option<(MutexGuard<'a, ()>, RwLockWriteGuard<'a, ()>)>,
    done: Vec<Done>,
}

impl<'a> WritePermit<'a> {
    pub(super) fn new(
        core: &'a BucketCore,
        plan: WritePlan,
        lock: Option<(MutexGuard<'a, ()>, RwLockWriteGuard<'a, ()>)>,
    ) -> Self {
        WritePermit { core, plan, _lock: lock, done: Vec::new() }
    }

    /// What the permit was decided on.
    pub fn plan(&self) -> &WritePlan {
        &self.plan
    }

    /// Writes an item; answers its new version. Nothing is written when it fails.
    pub fn put(&mut self, write: &Write<'_>) -> Result<u64, DataError> {
        let store = &self.core.store;
        let bucket = self.plan.bucket;
        self.core.activity.wrote(bucket);
        if !self.plan.has_copies() {
            return store.put(bucket, write).map_err(DataError::from);
        }
        let previous = store.export_item(bucket, write.key);
        let version = store.put(bucket, write).map_err(|e| self.refused(e))?;
        if let Some(stored) = store.export_item(bucket, write.key) {
            let key = stored.key.clone();
            self.done.push(Done { key, written: Some(version), previous, change: Change::Put(stored) });
        }
        Ok(version)
    }

    /// Deletes `key` (with `expected`, only at that version); `Ok(false)` when absent.
    pub fn delete(&mut self, key: &[u8], expected: Option<u64>) -> Result<bool, DataError> {
        let store = &self.core.store;
        let bucket = self.plan.bucket;
        self.core.activity.wrote(bucket);
        if !self.plan.has_copies() {
            return store.delete(bucket, key, expected).map_err(DataError::from);
        }
        let previous = store.export_item(bucket, key);
        let deleted = store.delete(bucket, key, expected).map_err(|e| self.refused(e))?;
        if let (true, Some(gone)) = (deleted, previous) {
            let change = Change::Delete { key: gone.key.clone(), version: gone.version };
            self.done.push(Done { key: gone.key.clone(), written: None, previous: Some(gone), change });
        }
        Ok(deleted)
    }

    /// A store's refusal as the caller gets it: `NotOwner` when the plan no longer holds (a move
    /// applied here since thawed the bucket, and the refusal, a failed condition say, comes
    /// from the copy kept here as the shadow: routed again, the write meets the new owner's).
    fn refused(&self, e: CacheError) -> DataError {
        match plan_holds(&self.core.control.state(), self.core.me, &self.plan) {
            Err(moved) => moved,
            Ok(()) => DataError::from(e),
        }
    }

    /// Makes the writes count: the node still holds its lease, the shadow has them, and the
    /// replica has them (sync) or they are queued for it (async). Otherwise every write is
    /// taken back and the error says why.
    ///
    /// The shadow matters when the new owner dies before its replica holder has the bucket:
    /// the bucket is then restored from the shadow, which must have every write acknowledged.
    /// A shadow that did not take a write is excused only once this node's map no longer
    /// names it (the transfer ended, or the cluster failed that node).
    pub async fn commit(mut self) -> Result<(), DataError> {
        self.still_holds()?;
        // A bucket with no copy elsewhere (a single node) has nothing to send.
        if !self.done.is_empty() && self.plan.has_copies() {
            let changes: Vec<Change> = self.done.iter().map(|d| d.change.clone()).collect();
            self.through_shadow(&changes).await?;
            self.through_replica(&changes).await?;
        }
        let core = self.core;
        if let Some(probe) = &core.probe {
            probe.acknowledged(core.me, self.plan.bucket, self.plan.epoch);
        }
        // They count: nothing to take back when the permit is dropped.
        self.done.clear();
        Ok(())
    }

    /// Whether the writes may still count, checked after them: the lease (a node paused
    /// between the decision and the write must not acknowledge it), and the map (a move
    /// applied here since the plan thaws the bucket, and what was written or found after that
    /// is in no copy the new owner has, a delete that found nothing too: routed again). Taken
    /// back if not, but not in the copy kept here as the shadow: a take-back there would give
    /// the items versions the new owner hands out too, and the shadow would then skip the new
    /// owner's later writes of those keys (the write routed again reaches the shadow as well).
    fn still_holds(&mut self) -> Result<(), DataError> {
        let core = self.core;
        if let Some(refusal) = write_refusal(core.health.node_facts()) {
            self.undo();
            return Err(refusal);
        }
        if self.plan.has_copies() {
            let state = core.control.state();
            if let Err(moved) = plan_holds(&state, core.me, &self.plan) {
                if state.shadow_of(self.plan.bucket) == Some(core.me) {
                    self.done.clear();
                } else {
                    self.undo();
                }
                return Err(moved);
            }
        }
        Ok(())
    }

    /// Writes `changes` through to the shadow, if the bucket moves and has one; taken back if
    /// it does not take them while it is still the shadow.
    async fn through_shadow(&mut self, changes: &[Change]) -> Result<(), DataError> {
        let (core, bucket) = (self.core, self.plan.bucket);
        let Some(shadow) = self.plan.shadow.clone() else { return Ok(()) };
        let Err(cause) = core
            .peers
            .ask(&shadow.peer_addr, ShadowWrites { bucket, body: change_body(changes) }, PEER_CALL_TIMEOUT)
            .await
        else {
            return Ok(());
        };
        let gone = |s: &shoal_raft::ClusterState| s.shadow_of(bucket) != Some(shadow.node);
        if core.control.wait_for_state(SHADOW_SETTLE, gone).await {
            tracing::debug!(node_id = core.me, bucket = bucket.0, shadow = shadow.node, error = %cause, "shadow write-through failed after the shadow was dropped");
            return Ok(());
        }
        tracing::warn!(node_id = core.me, bucket = bucket.0, shadow = shadow.node, error = %cause, "shadow write-through failed; the write is taken back");
        let taken_back = self.undo();
        // No answer is not no write: the shadow may have applied them. It takes them back as
        // far as it can be reached, in the background (changes apply by version, so later
        // writes cannot be undone by it).
        drop(take_back_at(&tokio::runtime::Handle::current(), core, &shadow.peer_addr, bucket, &taken_back));
        Err(DataError::ShadowFailed { bucket, shadow: shadow.node, cause })
    }

    /// Sends `changes` to the replica (sync) or queues them for it (async); taken back, here
    /// and at the shadow, if the replica did not take them.
    async fn through_replica(&mut self, changes: &[Change]) -> Result<(), DataError> {
        let (core, bucket, started) = (self.core, self.plan.bucket, std::time::Instant::now());
        let Some(holder) = core.replicator.holder_for(&self.plan) else { return Ok(()) };
        let next = core.replicator.next_sent_to(bucket, &holder, &self.plan);
        let Err(e) = core.replicator.replicate(bucket, &holder, next.as_ref(), changes).await else { return Ok(()) };
        let replica_error = e.to_string();
        let taken_back = self.undo();
        // Every holder the writes went to may keep them but one that refused them (any answer
        // says it did not apply them; no answer is not no write): the one that failed, and the
        // other, which may have applied them all. They get the bucket as it is now; if one
        // cannot be reached (or is known silent: no wait for it), the answer says the writes
        // may be stored (a failover would serve them).
        let e = match e {
            DataError::ReplicationFailed { holder: failed, cause } => {
                let sent_to: Vec<&Holder> = std::iter::once(&holder).chain(next.as_ref()).collect();
                let keeping = crate::replication::may_keep(&sent_to, failed, &cause);
                let at_replicas = match keeping.iter().find(|h| core.health.is_pfail(h.id)) {
                    Some(silent) => Err(silent.id),
                    None => core.replicator.take_back(bucket, &keeping).await,
                };
                match at_replicas {
                    Ok(()) => DataError::ReplicationFailed { holder: failed, cause },
                    Err(holder) => DataError::ReplicationUnconfirmed { holder, cause },
                }
            }
            other => other,
        };
        let mut refused_by = None;
        if let Some(shadow) = &self.plan.shadow {
            // The shadow has the writes: it takes them back too, as far as it can be reached
            // (its copy only counts if this node dies before the transfer ends).
            let told = take_back_at(&tokio::runtime::Handle::current(), core, &shadow.peer_addr, bucket, &taken_back);
            let told = told.await.unwrap_or_else(|e| Err(CallError::Broken(e.to_string())));
            if let Err(e) = told {
                tracing::warn!(node_id = core.me, bucket = bucket.0, shadow = shadow.node, error = %e, %replica_error, plan_version = self.plan.map_version, map_version = core.control.state().map.version, elapsed_ms = started.elapsed().as_millis() as u64, "the shadow keeps writes that were taken back");
                refused_by = Some(shadow.node);
            }
        }
        // A shadow that may keep the writes can serve them (a restore or a promotion from it):
        // the answer cannot say they were stored nowhere.
        let e = match (e, refused_by) {
            (DataError::ReplicationFailed { cause, .. }, Some(shadow)) => {
                DataError::ReplicationUnconfirmed { holder: shadow, cause }
            }
            (e, _) => e,
        };
        // Routed again only when the map moved the bucket from this node to another and
        // nothing of the write remains anywhere: a shadow that did not take it back keeps it
        // while it is still the shadow, or the owner again (an aborted move); one the finished
        // transfer dropped keeps nothing.
        let state = core.control.state();
        let moved = self.plan.owner_in_map && state.map.owner_of(bucket) != Some(core.me);
        let kept =
            refused_by.is_some_and(|s| state.shadow_of(bucket) == Some(s) || state.map.owner_of(bucket) == Some(s));
        Err(if moved && !kept { no_longer_owner(e, state.map.version) } else { e })
    }

    /// Takes every write of this permit back: each key gets the item it held before the
    /// permit's first write of it (under a new version). Answers the changes that bring a copy
    /// which had the writes to the same items.
    fn undo(&mut self) -> Vec<Change> {
        let core = self.core;
        let bucket = self.plan.bucket;
        // Per key, in the order first written: what it held before the permit, what the
        // permit's last write left, and the highest version the permit wrote.
        let mut keys: Vec<KeyUndo> = Vec::new();
        let mut at: std::collections::HashMap<Bytes, usize> = std::collections::HashMap::new();
        for d in self.done.drain(..) {
            match at.get(&d.key) {
                Some(&i) => {
                    keys[i].2 = d.written;
                    keys[i].3 = keys[i].3.max(d.written);
                }
                None => {
                    at.insert(d.key.clone(), keys.len());
                    keys.push((d.key, d.previous, d.written, d.written));
                }
            }
            core.replicator.count_undone(1);
        }
        let mut taken_back = Vec::with_capacity(keys.len());
        for (key, previous, last, highest) in keys {
            core.store.restore(bucket, &key, last, previous.as_ref());
            let change = match (core.store.export_item(bucket, &key), highest) {
                (Some(item), _) => Some(Change::Put(item)),
                (None, Some(version)) => Some(Change::Delete { key, version }),
                (None, None) => None,
            };
            taken_back.extend(change);
        }
        core.facts.attached().detach(bucket);
        taken_back
    }
}

impl Drop for WritePermit<'_> {
    /// A permit dropped with writes that neither counted nor were taken back takes them back,
    /// as a failed commit does: its caller went away before the end of the commit (a client's
    /// request dropped, a forwarded write its sender cancelled, a timeout). Otherwise the store
    /// would keep and serve a write that may never reach the replica, and a failover would
    /// take it away again: a read would go back in time. A shadow that may have the writes
    /// takes them back in the background.
    fn drop(&mut self) {
        if self.done.is_empty() {
            return;
        }
        let taken_back = self.undo();
        tracing::debug!(
            node_id = self.core.me,
            bucket = self.plan.bucket.0,
            "a write whose caller went away before it counted is taken back"
        );
        let Some(shadow) = &self.plan.shadow else { return };
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            tracing::warn!(
                node_id = self.core.me,
                bucket = self.plan.bucket.0,
                shadow = shadow.node,
                "the shadow keeps writes that were taken back: no runtime to tell it"
            );
            return;
        };
        drop(take_back_at(&runtime, self.core, &shadow.peer_addr, self.plan.bucket, &taken_back));
    }
}

/// Sends the shadow at `addr` the changes that take a permit's writes back, in a task of its own
/// on `runtime`: a caller that goes away meanwhile does not stop it half way. Its handle answers
/// whether the shadow took them (dropped, the task goes on).
fn take_back_at(
    runtime: &tokio::runtime::Handle,
    core: &BucketCore,
    addr: &str,
    bucket: shoal_raft::BucketId,
    taken_back: &[Change],
) -> tokio::task::JoinHandle<Result<(), CallError>> {
    let (peers, addr, body) = (core.peers.clone(), addr.to_string(), change_body(taken_back));
    runtime.spawn(async move { peers.ask(&addr, ShadowWrites { bucket, body }, PEER_CALL_TIMEOUT).await })
}

/// A write the replica refused because this node's map, caught up, no longer gives it the
/// bucket (it moved on while the write was on its way) is `NotOwner`: every write of the permit
/// was taken back here and at the shadow if there is one (the caller checks), so the
/// caller routes it again to the new owner, as it does when the map moved before the write. A
/// join or leave then fails no write.
fn no_longer_owner(e: DataError, map_version: u64) -> DataError {
    match e {
        DataError::ReplicationFailed { cause: ReplicaError::NoLongerOwner { bucket, .. }, .. } => {
            DataError::NotOwner { bucket, map_version }
        }
        other => other,
    }
}

/// One key of a permit taken back: the key, what it held before the permit, the version the
/// permit's last write of it left (`None`: deleted), the highest version the permit wrote.
type KeyUndo = (Bytes, Option<ExportedItem>, Option<u64>, Option<u64>);

/// How long a write whose shadow did not answer waits for this node's map to drop that
/// shadow (the transfer just ended, or the cluster failed the node) before it is taken back.
const SHADOW_SETTLE: Duration = Duration::from_millis(500);
