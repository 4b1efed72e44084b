//! What the reconciler's long actions do. Each job ends with a [`Done`] the loop learns from;
//! none decides what to do next (the planner does).

use std::time::Duration;

use futures::StreamExt;
use shoal_raft::{AdminRequest, AdminResponse, BucketId, ControlError, LostBucket, NodeId};
use tokio::time::Instant;

use super::{Done, Fetched, Reconciler, RETRY};
use crate::maintenance::{HandOff, NotInSync, WritePause};
use crate::transfer::found::GiveBack;
use crate::transfer::import::PullError;
use crate::transport::frame::snapshot_body;
use crate::transport::CallError;

/// How long an owner may take to install a lost bucket's copy given back.
const GIVE_BACK_TIMEOUT: Duration = Duration::from_secs(10);

/// How long acknowledging a pending map waits before the loop tries again.
const ACK_RETRY: Duration = Duration::from_millis(500);
/// How long a leaver waits for its replica to hold every write before it gives up handing
/// over (it then drains its buckets itself).
const HANDOVER_SYNC_WAIT: Duration = Duration::from_secs(10);
/// How long a member waits to see its committed replica holder in its own state.
const APPLY_WAIT: Duration = Duration::from_secs(5);
/// How long a successor waits between two attempts to take the lead from a stopping leader.
const ELECT_RETRY: Duration = Duration::from_millis(500);
/// How long a failed node waits for a member to say which lost buckets it served last.
const LOST_OF_TIMEOUT: Duration = Duration::from_secs(5);
/// How long a restarted node waits for one way of telling the cluster it runs.
const MARK_RUNNING_TIMEOUT: Duration = Duration::from_secs(5);
/// How long a failed node tries to give back the lost buckets it served last before it
/// rejoins anyway.
const GIVE_BACK_FOR: Duration = Duration::from_secs(60);
/// Buckets given back at once.
const GIVE_BACK_PARALLELISM: usize = 8;

/// One way of asking something, by its name for errors.
type Ask<'a, T> = futures::future::BoxFuture<'a, Result<T, ControlError>>;

/// Why no way of asking got an answer: the last failure, by its way's name.
#[derive(Debug, PartialEq, thiserror::Error)]
enum Unanswered {
    /// There was no one to ask.
    #[error("no one to ask")]
    NoOne,
    /// The last way failed so.
    #[error("{name}: {error}")]
    Failed { name: String, error: ControlError },
    /// The last way did not answer in time.
    #[error("{name}: no answer within {timeout:?}")]
    Timeout { name: String, timeout: Duration },
}

/// The first of `asks` to succeed, each run at once and given at most `timeout`; when every one
/// failed, the last failure, by its name.
async fn first_answer<T>(asks: Vec<(String, Ask<'_, T>)>, timeout: Duration) -> Result<T, Unanswered> {
    if asks.is_empty() {
        return Err(Unanswered::NoOne);
    }
    let bounded = asks.into_iter().map(|(name, ask)| {
        Box::pin(async move {
            match tokio::time::timeout(timeout, ask).await {
                Ok(Ok(answer)) => Ok(answer),
                Ok(Err(error)) => Err(Unanswered::Failed { name, error }),
                Err(_) => Err(Unanswered::Timeout { name, timeout }),
            }
        })
    });
    futures::future::select_ok(bounded).await.map(|(answer, _)| answer)
}

impl Reconciler {
    /// The cluster failed this node. The buckets it served last that their heir had no copy
    /// of are lost, and this node holds their newest copy (`crate::transfer::found`): it gives
    /// each to its owner, until none is left or pending, or `GIVE_BACK_FOR` has passed. A
    /// bucket it is still restoring after a restart is not its to give (it holds nothing).
    pub(super) async fn give_back(&self) -> Done {
        let deadline = Instant::now() + GIVE_BACK_FOR;
        let (mut given, mut refused) = (0usize, 0usize);
        while Instant::now() < deadline {
            let Some((lost, pending)) = self.lost_of_me().await else {
                tokio::time::sleep(RETRY).await;
                continue;
            };
            let lost: Vec<LostBucket> =
                lost.into_iter().filter(|l| !self.facts.is_restoring(BucketId(l.bucket))).collect();
            if lost.is_empty() && pending == 0 {
                break;
            }
            tracing::info!(
                node_id = self.me,
                lost = lost.len(),
                pending,
                "giving back the lost buckets this node served last"
            );
            let results: Vec<Result<(), CallError>> = futures::stream::iter(lost)
                .map(|l| async move {
                    let bucket = BucketId(l.bucket);
                    let body = snapshot_body(&self.store, bucket);
                    let result =
                        self.peers.ask(&l.peer_addr, GiveBack { from: self.me, bucket, body }, GIVE_BACK_TIMEOUT).await;
                    if let Err(e) = &result {
                        tracing::warn!(bucket = l.bucket, owner = l.owner, error = %e, "giving a lost bucket back");
                    }
                    result
                })
                .buffer_unordered(GIVE_BACK_PARALLELISM)
                .collect()
                .await;
            given += results.iter().filter(|r| r.is_ok()).count();
            // Refused for good: the bucket is no longer lost, or not this node's to give.
            refused += results.iter().filter(|r| matches!(r, Err(CallError::Refused { status: 409, .. }))).count();
            if results.iter().any(|r| r.is_err()) || pending > 0 {
                tokio::time::sleep(RETRY).await;
            }
        }
        let left = self.lost_of_me().await.map(|(lost, pending)| lost.len() + pending);
        if given > 0 || refused > 0 || left.unwrap_or(0) > 0 {
            tracing::warn!(node_id = self.me, given, refused, left = ?left, "gave back the lost buckets this node served last");
        }
        Done::GaveBack
    }

    /// The lost buckets this node served last and how many may still turn lost, as the leader
    /// sees them (asked through the other members at once, the first answer counts: this
    /// node's own state stopped when it was failed, and a member cut off with it may hang or
    /// be restarting).
    async fn lost_of_me(&self) -> Option<(Vec<LostBucket>, usize)> {
        let state = self.control.state();
        let request = &AdminRequest::LostOf { node_id: self.me };
        let asks = state
            .members
            .iter()
            .filter(|m| m.id != self.me)
            .map(|member| {
                let ask: Ask<'_, _> = Box::pin(async move {
                    match self.control.admin_client().call(&member.peer_addr, request).await {
                        Ok(AdminResponse::LostOf { buckets, pending }) => Ok((buckets, pending)),
                        Ok(other) => Err(ControlError::Network {
                            peer: member.peer_addr.clone(),
                            detail: format!("an unexpected answer {other:?}"),
                        }),
                        Err(e) => Err(e),
                    }
                });
                (format!("via {}", member.id), ask)
            })
            .collect();
        match first_answer(asks, LOST_OF_TIMEOUT).await {
            Ok(answer) => Some(answer),
            Err(e) => {
                tracing::debug!(error = %e, "asking for lost buckets");
                None
            }
        }
    }

    /// Acknowledges the pending map `to_version`.
    pub(super) async fn ack(&self, to_version: u64) -> Done {
        let request = AdminRequest::Ack { node_id: self.me, to_version };
        match self.control.admin(request).await {
            Ok(_) => tracing::debug!(node_id = self.me, to_version, "acknowledged the pending map"),
            Err(e) => {
                tracing::debug!(node_id = self.me, to_version, error = %e, "acknowledging the pending map");
                tokio::time::sleep(ACK_RETRY).await;
            }
        }
        Done::Acked
    }

    /// Stands for election once, then waits a moment before the loop may plan it again. The
    /// other voters refuse while they still hear the stopping leader (its lease); the leader
    /// itself grants the vote and steps down, or, once it stopped, the lease runs out.
    pub(super) async fn elect(&self) -> Done {
        if self.facts.is_stopping() {
            tracing::info!(
                node_id = self.me,
                "stopping, and no leader heard: standing for election (nothing commits without one)"
            );
        } else {
            tracing::info!(node_id = self.me, leader = ?self.control.leader(), "the leader is stopping: standing for election");
        }
        if let Err(e) = self.control.elect().await {
            tracing::warn!(node_id = self.me, error = %e, "could not stand for election");
        }
        tokio::time::sleep(ELECT_RETRY).await;
        Done::Elected
    }

    /// Tells the cluster this node runs (it may have been marked stopping before a restart),
    /// so that it counts as its leader's successor again; asked on every start, harmless when
    /// it was not stopping. Through its own control plane (it may lead) and through every
    /// other member at once (its own state may not show that it was stopping): the first that
    /// gets it committed counts; retried with backoff until one does. One at a time, a dead member's connect
    /// attempts came first, and a leader still marked stopping for those seconds had its
    /// successor stand for election again and again, which kept the commit from happening
    /// (a full stop where the restarted leader stayed marked stopping for 30 s and more).
    pub(super) async fn mark_running(&self) -> Done {
        let request = AdminRequest::SetDraining { node_id: self.me, draining: false };
        let mut pause = Duration::from_millis(500);
        loop {
            let state = self.control.state();
            if !state.is_member(self.me) || state.members.len() <= 1 {
                return Done::MarkedRunning;
            }
            let request = &request;
            let mut asks: Vec<(String, Ask<'_, ()>)> = state
                .members
                .iter()
                .filter(|m| m.id != self.me)
                .map(|member| {
                    let ask: Ask<'_, ()> = Box::pin(async move {
                        self.control.admin_client().call(&member.peer_addr, request).await.map(drop)
                    });
                    (format!("via {}", member.id), ask)
                })
                .collect();
            asks.push(("here".into(), Box::pin(async move { self.control.admin(request.clone()).await.map(drop) })));
            match first_answer(asks, MARK_RUNNING_TIMEOUT).await {
                Ok(()) => {
                    tracing::debug!(node_id = self.me, "told the cluster this node runs");
                    return Done::MarkedRunning;
                }
                Err(e) => tracing::debug!(node_id = self.me, error = %e, "telling the cluster this node runs"),
            }
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(Duration::from_secs(5));
        }
    }

    /// Gets `bucket` back from `from` (its replica holder or its shadow) after a restart. Under
    /// the bucket's lock, and only while it is still marked: a lost bucket given back to this
    /// process meanwhile (`crate::transfer::found`) is installed and unmarked under the same
    /// lock, and must not be emptied for a restore.
    pub(super) async fn restore(&self, bucket: BucketId, from: NodeId) -> Done {
        let lock = self.facts.lock(bucket).await;
        if !self.facts.is_restoring(bucket) {
            return Done::Restored { bucket, from, outcome: Fetched::Installed };
        }
        let result = self.puller.restore(&self.control, &self.store, &self.progress, bucket, from).await;
        if result.is_ok() {
            self.facts.restored(bucket);
        }
        drop(lock);
        let outcome = match result {
            Ok(bytes) => {
                tracing::debug!(node_id = self.me, bucket = bucket.0, from, bytes, "bucket restored");
                Fetched::Installed
            }
            Err(PullError::Refused { status: 404, .. }) => Fetched::NoCopy,
            Err(e) => {
                tracing::warn!(node_id = self.me, bucket = bucket.0, from, error = %e, "restore failed; will retry");
                tokio::time::sleep(RETRY).await;
                Fetched::Failed
            }
        };
        Done::Restored { bucket, from, outcome }
    }

    /// Fetches the promoted `bucket` from the shadow `from` keeps (the failed owner got it in
    /// the running transfer and its replica had no copy yet).
    pub(super) async fn restore_shadow(&self, bucket: BucketId, from: NodeId) -> Done {
        let outcome = match self.puller.restore(&self.control, &self.store, &self.progress, bucket, from).await {
            Ok(bytes) => {
                tracing::info!(bucket = bucket.0, from, bytes, "promoted bucket restored from its shadow");
                self.facts.install(&self.control.state(), bucket);
                self.facts.attached().detach(bucket);
                Fetched::Installed
            }
            Err(PullError::Refused { status: 404, .. }) => Fetched::NoCopy,
            Err(e) => {
                tracing::warn!(bucket = bucket.0, from, error = %e, "restoring a promoted bucket from its shadow");
                tokio::time::sleep(RETRY).await;
                Fetched::Failed
            }
        };
        Done::Promoted { bucket, from, outcome }
    }

    /// Tells the cluster which promoted buckets this node serves and which are lost.
    pub(super) async fn report_promoted(&self, installed: Vec<BucketId>, lost: Vec<BucketId>) -> Done {
        tracing::info!(
            node_id = self.me,
            promoted = installed.len(),
            lost = lost.len(),
            "serving replica buckets of a member that failed or left"
        );
        let state = self.control.state();
        let stopped = |b: &BucketId| state.copies_died_with_their_process(b.0);
        let (emptied, lost_now): (Vec<BucketId>, Vec<BucketId>) = lost.iter().copied().partition(stopped);
        if !lost_now.is_empty() {
            tracing::error!(buckets = lost_now.len(), first = ?lost_now.first(), "no copy of these buckets is left: they are lost");
        }
        if !emptied.is_empty() {
            tracing::warn!(
                buckets = emptied.len(),
                first = ?emptied.first(),
                "buckets of a member that stopped and was failed, or handed over by a maintenance: every copy died in the stop (this node restarted too); they serve again, empty"
            );
            if let Some(probe) = &self.probe {
                for &b in &emptied {
                    probe.emptied(self.me, b);
                }
            }
        }
        let report = AdminRequest::Promoted {
            node_id: self.me,
            buckets: installed.iter().map(|b| b.0).collect(),
            lost: lost.iter().map(|b| b.0).collect(),
        };
        match self.control.admin(report).await {
            Ok(_) => {
                // Applied here before the loop plans again: it would report them twice.
                let reported: Vec<u16> = installed.iter().chain(&lost).map(|b| b.0).collect();
                self.control.wait_for_state(APPLY_WAIT, |s| reported.iter().all(|b| !s.promoted.contains_key(b))).await;
            }
            Err(e) => {
                tracing::warn!(error = %e, "could not report promoted buckets; retrying");
                tokio::time::sleep(RETRY).await;
            }
        }
        Done::Reported
    }

    /// Pulls `bucket` from `from` for the move at `epoch`.
    pub(super) async fn pull(&self, bucket: BucketId, from: NodeId, epoch: u64) -> Done {
        let started = std::time::Instant::now();
        let result = self.puller.pull(&self.control, &self.store, &self.progress, bucket, from, epoch).await;
        match &result {
            Ok(_) => {
                self.progress.bucket_done();
                self.metrics.transfer_bucket_duration.record(started.elapsed().as_secs_f64());
            }
            // The map moved on while the bucket was pulled (its source handed it over, a newer
            // move won): routine, the next plan starts from the newest state.
            Err(e @ crate::transfer::import::PullError::Flip(shoal_raft::ControlError::Rejected { .. })) => {
                tracing::info!(node_id = self.me, bucket = bucket.0, from, error = %e, "bucket transfer superseded")
            }
            Err(e) => tracing::warn!(node_id = self.me, bucket = bucket.0, from, error = %e, "bucket transfer failed"),
        }
        Done::Pulled { bucket, ok: result.is_ok(), flipped: matches!(result, Ok(Some(_))) }
    }

    /// Makes `holder` (named by join order, every owned bucket attached there) the holder of
    /// this node's complete replica: writes pause (every bucket lock held) while it checks that
    /// nothing was detached meanwhile and commits `ReplicaMoved`.
    pub(super) async fn move_replica(&self, holder: NodeId) -> Done {
        let owned = self.control.state().map.buckets_of(self.me);
        let mut locks = Vec::with_capacity(owned.len());
        for &b in &owned {
            locks.push(self.facts.lock(b).await);
        }
        let state = self.control.state();
        let attached = self.facts.attached().current(&state, self.me);
        let complete = state.map.buckets_of(self.me) == owned
            && owned.iter().all(|&b| state.is_lost(b) || attached.contains(&(b, holder)));
        let mut moved = false;
        if complete && state.replica_of(self.me) == Some(holder) {
            // If the outcome stays unknown (no answer in time), the change may still commit
            // after the writes resume: until then a write that misses this holder fails.
            self.replicator.set_moving_to(holder);
            // Writes wait meanwhile: bounded, whatever Raft does.
            let proposal = self.control.admin(AdminRequest::ReplicaMoved { owner: self.me, holder });
            match tokio::time::timeout(APPLY_WAIT, proposal)
                .await
                .unwrap_or_else(|_| Err(shoal_raft::ControlError::Timeout { what: "the replica holder change".into() }))
            {
                Ok(_) => {
                    moved = self
                        .control
                        .wait_for_state(APPLY_WAIT, |s| s.committed_holder_of(self.me) == Some(holder))
                        .await;
                    if moved {
                        // Every write must reach it now anyway: it is the complete holder.
                        self.replicator.set_moving_to(0);
                    }
                    tracing::info!(
                        node_id = self.me,
                        holder,
                        buckets = owned.len(),
                        "replica complete at its new holder"
                    );
                }
                Err(e) => tracing::debug!(node_id = self.me, holder, error = %e, "moving the replica"),
            }
        }
        drop(locks);
        if !moved {
            tokio::time::sleep(RETRY).await;
        }
        Done::MovedReplica
    }

    /// As leader: proposes `NodeFailed` for `node`, which `votes` of `members` report pfail (a
    /// failure waits before the plan may try again).
    pub(super) async fn fail_node(&self, node: NodeId, votes: usize, members: usize) -> Done {
        tracing::warn!(node_id = node, votes, members, "a majority reports the node unreachable; failing it");
        self.health.fails_proposed.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        if let Err(e) = self.control.fail_node(node).await {
            tracing::warn!(node_id = node, error = %e, "could not fail the node");
            tokio::time::sleep(RETRY).await;
        }
        Done::FailedNode
    }

    /// Goes into maintenance: hands the buckets to `heir` (see [`HandOff::go_away`]) and
    /// answers whoever asked.
    pub(super) async fn go_away(&self, heir: NodeId) -> Done {
        if let Some(asked) = self.entry.asked() {
            let handoff =
                HandOff { me: self.me, control: &self.control, replicator: &self.replicator, facts: &self.facts };
            self.entry.decide(handoff.go_away(heir, asked.deadline).await);
        }
        Done::WentAway
    }

    /// A leaving member hands its buckets to `heir`, the holder of its complete replica, which
    /// serves them at once (no copy) while state transfer moves them on.
    ///
    /// ```text
    ///  leaver L (leaving, target set)                 heir H (complete replica of L)       Raft
    ///  refuse writes (503 node_leaving) ─▶ wait: every owned bucket attached at H,
    ///                                       async queue empty (in-flight writes done)
    ///  admin HandOver(L) ────────────────────────────────────────────────────────────▶ owners
    ///                                                                                  L→H
    ///  accept writes again (they route to H)          installs the copies, reports ───▶
    /// ```
    ///
    /// The pause is what makes the replica complete: a write that reached L before it is
    /// either in H's replica (acknowledged) or refused by H's fence after the flip (undone,
    /// never acknowledged). If the replica cannot be confirmed complete in time, L does not
    /// hand over and drains its buckets itself.
    pub(super) async fn hand_over(&self, heir: NodeId) -> Done {
        let handoff = HandOff { me: self.me, control: &self.control, replicator: &self.replicator, facts: &self.facts };
        let pause = WritePause::new(&self.facts);
        let leaving = |s: &shoal_raft::ClusterState| s.member_of(self.me).is_some_and(|m| m.leaving);
        let in_sync = match handoff.in_sync(heir, HANDOVER_SYNC_WAIT, leaving).await {
            Ok(checked) => Some(checked),
            Err(NotInSync { attached, owned, queued }) => {
                tracing::warn!(
                    node_id = self.me,
                    attached,
                    owned,
                    queued,
                    "replicas not in sync: draining the buckets instead"
                );
                None
            }
        };
        if let Some(checked) = in_sync {
            let buckets = self.control.state().map.buckets_of(self.me).len();
            match self.control.admin(AdminRequest::HandOver { node_id: self.me, heir: Some(checked) }).await {
                Ok(_) => {
                    let me = self.me;
                    self.control.wait_for_state(Duration::from_secs(10), |s| s.map.buckets_of(me).is_empty()).await;
                    tracing::info!(node_id = me, heir, buckets, "handed the buckets over to their replica holder");
                }
                Err(e) => {
                    tracing::warn!(node_id = self.me, error = %e, "hand-over refused: draining the buckets instead")
                }
            }
        }
        drop(pause);
        Done::HandedOver
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ask<T: Send + 'static>(after: Duration, answer: Result<T, &'static str>) -> Ask<'static, T> {
        Box::pin(async move {
            tokio::time::sleep(after).await;
            answer.map_err(|reason| ControlError::Rejected { reason: reason.into() })
        })
    }

    #[tokio::test(start_paused = true)]
    async fn the_first_success_counts_whatever_hangs_or_fails_before_it() {
        let asks = vec![
            ("via 2".to_string(), ask(Duration::from_secs(3600), Ok(2))),
            ("via 3".to_string(), ask(Duration::from_millis(10), Err("refused"))),
            ("here".to_string(), ask(Duration::from_millis(20), Ok(1))),
        ];
        let started = tokio::time::Instant::now();
        assert_eq!(first_answer(asks, Duration::from_secs(5)).await, Ok(1));
        assert_eq!(started.elapsed(), Duration::from_millis(20), "the hanging ask was not waited for");
    }

    #[tokio::test(start_paused = true)]
    async fn when_every_ask_fails_the_error_names_the_last_and_why() {
        let asks = vec![
            ("via 2".to_string(), ask(Duration::from_secs(3600), Ok(()))),
            ("via 3".to_string(), ask(Duration::from_millis(10), Err("refused"))),
        ];
        let e = first_answer(asks, Duration::from_secs(5)).await.expect_err("no answer");
        assert_eq!(e.to_string(), "via 2: no answer within 5s");
        let asks = vec![("via 3".to_string(), ask(Duration::ZERO, Err::<(), _>("refused")))];
        let e = first_answer(asks, Duration::from_secs(5)).await.expect_err("refused");
        assert_eq!(e.to_string(), "via 3: refused");
        assert_eq!(first_answer::<()>(Vec::new(), Duration::from_secs(5)).await, Err(Unanswered::NoOne));
    }
}
