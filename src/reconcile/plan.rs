//! The reconciler's planner: a pure function from the replicated state and what this node
//! knows of itself ([`Facts`]) to what it should do now ([`Action`]s). It is level-triggered:
//! given the same state and facts it plans the same actions, and an action whose job is
//! still running is not planned again, so a lost wake-up or a failed job only delays the
//! next plan.

use std::collections::{BTreeMap, BTreeSet};

use shoal_raft::state::{MaintenancePhase, MaintenanceRefusal};
use shoal_raft::{BucketId, ClusterState, NodeId};

use crate::phase::{keeps_replica, phase_of, BucketFacts, Phase};

/// How many buckets one attach job sends to a replica holder before the loop plans again.
pub const ATTACH_BATCH: usize = 64;

/// The jobs running now (each kind is planned again only once its job is done).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Running {
    /// Acknowledging this pending map.
    pub ack: Option<u64>,
    /// Buckets being pulled.
    pub pulls: BTreeSet<BucketId>,
    /// Buckets being restored after a restart.
    pub restores: BTreeSet<BucketId>,
    /// Promoted buckets being fetched from a shadow.
    pub promotions: BTreeSet<BucketId>,
    /// Reporting promotions.
    pub report: bool,
    /// Sending snapshots to a replica holder.
    pub attach: bool,
    /// Making the holder join order names the holder of the complete replica.
    pub move_replica: bool,
    /// Handing the buckets over (leaving).
    pub handover: bool,
    /// Telling the cluster this node runs again.
    pub mark_running: bool,
    /// Standing for election (the leader is stopping and this node is its successor).
    pub elect: bool,
    /// Catching up with the leader before restoring.
    pub catch_up: bool,
    /// Checking the transfer for progress (leader).
    pub stuck: bool,
    /// Sending a batch of the async replication queue.
    pub send: bool,
    /// Giving lost buckets back before rejoining.
    pub give_back: bool,
    /// Ending a maintenance whose time ran out (leader).
    pub end_maintenance: bool,
    /// Handing the buckets to the heir to go into maintenance.
    pub go_away: bool,
    /// Failing a member (leader).
    pub fail: bool,
    /// Balancing by data by itself (leader).
    pub balance: bool,
}

/// Where this node's own entry into maintenance stands (see `maintenance::Entry`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Entering {
    /// Nobody drives one: a maintenance of this node still preparing is ended.
    #[default]
    No,
    /// Being proposed: nothing to do yet.
    Proposing,
    /// Committed as preparing: the node goes on once nobody's complete replica is on it, and
    /// is refused if one still is once `overdue`.
    Asked {
        /// The time to prepare ran out.
        overdue: bool,
    },
    /// Decided: the one who drives it answers (and ends it when refused).
    Decided,
}

/// What this node knows of itself that the replicated state does not say.
#[derive(Debug, Clone, Default)]
pub struct Facts {
    /// This node.
    pub me: NodeId,
    /// It knows a leader and has applied what the leader committed: it may trust its map.
    pub caught_up: bool,
    /// Raft counts it as a voter.
    pub voter: bool,
    /// It leads.
    pub leader: bool,
    /// A peer said the cluster failed it.
    pub failed: bool,
    /// It is stopping (SIGTERM), whether it drains yet or not.
    pub draining: bool,
    /// Buckets with items in the active store.
    pub active: BTreeSet<BucketId>,
    /// Replica buckets held, and the owner each copy came from.
    pub replicas: BTreeMap<BucketId, NodeId>,
    /// Buckets to get back after a restart.
    pub restoring: BTreeSet<BucketId>,
    /// Buckets this node handed over since it started and still keeps the data of.
    pub shadows: BTreeSet<BucketId>,
    /// Promoted buckets whose copy is installed.
    pub installed: BTreeSet<BucketId>,
    /// (bucket, holder): snapshots the holder acknowledged in the bucket's current ownership
    /// period.
    pub attached: BTreeSet<(BucketId, NodeId)>,
    /// Where a copy was asked for and none was there (restores and promotions try the next
    /// source).
    pub no_copy: BTreeMap<BucketId, BTreeSet<NodeId>>,
    /// Peers this node does not hear from.
    pub suspected: BTreeSet<NodeId>,
    /// Jobs running.
    pub running: Running,
    /// Pulls wait after a failure (backoff), until the state changes.
    pub pulls_paused: bool,
    /// Buckets pulled at once.
    pub parallelism: usize,
    /// It told the cluster it runs again since it started.
    pub marked_running: bool,
    /// The Raft leader it knows.
    pub leader_id: Option<NodeId>,
    /// It has heard no leader for longer than an election timeout (whatever `leader_id` says).
    pub leader_lost: bool,
    /// It tried to hand its buckets over in this leave.
    pub handover_tried: bool,
    /// The async replication queue has changes to send.
    pub queue_waiting: bool,
    /// The leader's transfer check is due.
    pub stuck_check_due: bool,
    /// The store's size limit now; the limit alone and with others.
    pub limits: (u64, u64, u64),
    /// Since the cluster failed it, it gave back the lost buckets it served last (or tried).
    pub gave_back: bool,
    /// The wall clock, in ms since the Unix epoch (a maintenance runs out by it).
    pub now_ms: u64,
    /// Its own entry into maintenance.
    pub entering: Entering,
    /// As leader: a member a majority of the members reports pfail (failure detection's
    /// tally, with the votes and the members counted).
    pub to_fail: Option<(NodeId, usize, usize)>,
    /// As leader: balancing by data is turned on and due (`balance::Balancer::note_round`).
    pub balance_due: bool,
}

impl Facts {
    fn of(&self, bucket: BucketId) -> BucketFacts {
        BucketFacts { restoring: self.restoring.contains(&bucket), installed: self.installed.contains(&bucket) }
    }

    fn busy(&self, bucket: BucketId) -> bool {
        let r = &self.running;
        r.pulls.contains(&bucket) || r.restores.contains(&bucket) || r.promotions.contains(&bucket)
    }
}

/// Something to do: at once, in the loop, or as a [`Job`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// The cluster failed this node and it gave back what it could: stop, discard the data
    /// dir, join again as a new member.
    Rejoin,
    /// This node left and is no voter any more: record it and stop.
    Stop,
    /// The store's size limit (a one-node cluster may use twice `--cache-size`).
    SetLimit {
        /// Bytes.
        bytes: u64,
    },
    /// A bucket marked for restoring that this node does not own (or that a promotion
    /// covers): nothing to restore.
    Unmark {
        /// The bucket.
        bucket: BucketId,
    },
    /// Buckets this node owns of which no copy is left anywhere (every copy died, as in a
    /// full stop): they serve again, empty.
    ServeEmpty {
        /// The buckets.
        buckets: Vec<BucketId>,
    },
    /// Turn the replica copy of a promoted bucket into active data.
    Install {
        /// The bucket.
        bucket: BucketId,
        /// The member it came from.
        from: NodeId,
    },
    /// A promoted bucket whose shadow is in this node's own active store: serve it.
    AdoptShadow {
        /// The bucket.
        bucket: BucketId,
    },
    /// Drop the active store's copy of a bucket this node keeps no data of.
    DropActive {
        /// The bucket.
        bucket: BucketId,
    },
    /// Drop a replica copy this node no longer holds for its owner.
    DropReplica {
        /// The bucket.
        bucket: BucketId,
        /// The owner the copy came from (a newer owner's copy is not dropped).
        source: NodeId,
    },
    /// This node's entry into maintenance cannot go on: answer why.
    RefuseMaintenance {
        /// Why.
        refusal: MaintenanceRefusal,
    },
    /// Start a job, which runs until its result comes back.
    Job(Job),
}

/// An action that waits on something: it runs as a job of the loop, marked as running (in
/// [`Running`]) until its result comes back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Job {
    /// The cluster failed this node: give the lost buckets it served last back to their
    /// owners (it holds their newest copy), before it discards anything.
    GiveBack,
    /// Acknowledge the pending map.
    Ack {
        /// Its version.
        to_version: u64,
    },
    /// Tell the cluster this node runs again (it may have been stopping before a restart).
    MarkRunning,
    /// The leader is stopping and this node is its successor: stand for election, so that
    /// leadership moves while the leader still runs. Also a stopping node that has heard no
    /// leader for the longest election timeout.
    Elect,
    /// Wait until the map can be trusted (a leader known, the committed log applied).
    CatchUp,
    /// Get a bucket back after a restart from a node holding a copy.
    Restore {
        /// The bucket.
        bucket: BucketId,
        /// Its replica holder or its shadow.
        from: NodeId,
    },
    /// Fetch a promoted bucket this node holds no replica of from its shadow.
    RestoreShadow {
        /// The bucket.
        bucket: BucketId,
        /// The node holding the shadow.
        from: NodeId,
    },
    /// Tell the cluster which promoted buckets this node serves and which are lost.
    ReportPromoted {
        /// Served from a copy.
        installed: Vec<BucketId>,
        /// No copy was left.
        lost: Vec<BucketId>,
    },
    /// Pull a bucket the target gives this node.
    Pull {
        /// The bucket.
        bucket: BucketId,
        /// Who serves it now.
        from: NodeId,
        /// Its move epoch.
        epoch: u64,
    },
    /// Send these owned buckets whole to a replica holder.
    Attach {
        /// The holder.
        holder: NodeId,
        /// The buckets.
        buckets: Vec<BucketId>,
    },
    /// Every owned bucket is attached at the holder join order names: make it the holder of
    /// the complete replica.
    MoveReplica {
        /// The holder.
        holder: NodeId,
    },
    /// Leaving: hand the buckets to the holder of the complete replica.
    HandOver {
        /// The heir.
        heir: NodeId,
    },
    /// Going into maintenance: hand the buckets to the holder of the complete replica.
    GoAway {
        /// The heir.
        heir: NodeId,
    },
    /// As leader: fail a member a majority reports pfail.
    FailNode {
        /// The member.
        node: NodeId,
        /// Members that report it.
        votes: usize,
        /// Members counted.
        members: usize,
    },
    /// As leader: balance by data, if a plan improves the balance.
    Balance,
    /// As leader: check a running transfer for progress.
    CheckStuck,
    /// End a maintenance before the member came back: as leader, its time ran out; as the
    /// member, it prepares for it but nothing drives it any more (the request was cancelled).
    EndMaintenance {
        /// The member.
        node: NodeId,
        /// Why, for the log.
        reason: &'static str,
    },
    /// Send a batch of the async replication queue.
    SendQueued,
}

/// What this node should do now (see the module docs). `previous` is the state the last plan
/// saw: a bucket that left this node's ownership since is dropped only once the new state
/// says so.
pub fn plan(previous: &ClusterState, state: &ClusterState, f: &Facts) -> Vec<Action> {
    let me = f.me;
    let mut out = Vec::new();
    if f.failed || state.failed.contains(&me) {
        return match (f.gave_back, f.running.give_back) {
            (true, _) => vec![Action::Rejoin],
            (false, true) => Vec::new(),
            (false, false) => vec![Action::Job(Job::GiveBack)],
        };
    }
    if state.retired.contains(&me) {
        // It serves nothing any more; it stops once it is no voter (so that a two-voter
        // cluster can still commit the change of voters).
        return if f.voter { Vec::new() } else { vec![Action::Stop] };
    }
    if !state.is_member(me) || state.map.is_empty() {
        return out;
    }
    let (limit, alone, shared) = f.limits;
    let bytes = if state.members.len() == 1 { alone } else { shared };
    if bytes != limit {
        out.push(Action::SetLimit { bytes });
    }
    if let Some(t) = state.transition.as_ref().filter(|t| !t.acked.contains(&me)) {
        if f.running.ack != Some(t.to.version) {
            out.push(Action::Job(Job::Ack { to_version: t.to.version }));
        }
    }
    if !f.marked_running && !f.running.mark_running && state.members.len() > 1 && !f.draining {
        out.push(Action::Job(Job::MarkRunning));
    }
    if let Some((node, votes, members)) = f.to_fail.filter(|_| f.leader && !f.running.fail) {
        out.push(Action::Job(Job::FailNode { node, votes, members }));
    }
    if f.leader && f.balance_due && !f.running.balance {
        out.push(Action::Job(Job::Balance));
    }
    let leader_stopping = f.leader_id.filter(|&l| l != me && state.draining.contains(&l));
    let succeeds = leader_stopping.is_some_and(|l| !f.draining && state.successor_of(l) == Some(me));
    // A stopping member stands by no timer of its own (so that a running member takes the
    // lead first), but once no leader has been heard for the longest election timeout it
    // stands: the member with the newest log may be one that stops, and if it never stood,
    // nothing would commit again (no stop recorded, no hand-off).
    let stranded = f.draining && f.leader_lost;
    if f.voter && !f.running.elect && (succeeds || stranded) {
        out.push(Action::Job(Job::Elect));
    }
    plan_restores(state, f, &mut out);
    plan_promotions(state, f, &mut out);
    if !f.pulls_paused {
        let free = f.parallelism.max(1).saturating_sub(f.running.pulls.len());
        let incoming = state.incoming_of(me).into_iter().filter(|(b, _, _)| !f.running.pulls.contains(b));
        out.extend(incoming.take(free).map(|(bucket, from, epoch)| Action::Job(Job::Pull { bucket, from, epoch })));
    }
    plan_replicas(state, f, &mut out);
    plan_handover(state, f, &mut out);
    plan_drops(previous, state, f, &mut out);
    // While a member is away in maintenance nothing is stuck: it pulls once it returns.
    if f.leader && state.transfer_flag && state.away().is_none() && f.stuck_check_due && !f.running.stuck {
        out.push(Action::Job(Job::CheckStuck));
    }
    if let Some(m) = state.maintenance.as_ref().filter(|m| m.phase != MaintenancePhase::Returned) {
        let reason = if f.leader && f.now_ms >= m.until_ms {
            Some("its time ran out before it came back")
        } else if m.node == me && m.phase == MaintenancePhase::Preparing && f.entering == Entering::No {
            Some("it prepared for it, but nothing drives it any more")
        } else {
            None
        };
        if let Some(reason) = reason.filter(|_| !f.running.end_maintenance) {
            out.push(Action::Job(Job::EndMaintenance { node: m.node, reason }));
        }
    }
    plan_entry(state, f, &mut out);
    if f.queue_waiting && !f.running.send {
        out.push(Action::Job(Job::SendQueued));
    }
    out
}

/// After a restart: every bucket this node owns comes back from the holder of its complete
/// replica, else from a shadow; one of which no source holds a copy serves again, empty (its
/// every copy died: a full stop, or the holder restarted too). Buckets it does not own, or
/// that a promotion covers, are unmarked; lost ones wait until they are found or cleared. Nothing is decided before the node has caught up
/// with the leader: its own disk may be behind.
fn plan_restores(state: &ClusterState, f: &Facts, out: &mut Vec<Action>) {
    if f.restoring.is_empty() {
        return;
    }
    if !f.caught_up {
        if !f.running.catch_up {
            out.push(Action::Job(Job::CatchUp));
        }
        return;
    }
    let me = f.me;
    let mut empty = Vec::new();
    let mut free = f.parallelism.max(1).saturating_sub(f.running.restores.len());
    for &bucket in &f.restoring {
        // A bucket being pulled comes back by the pull (its flip unmarks it).
        if f.running.restores.contains(&bucket) || f.running.pulls.contains(&bucket) {
            continue;
        }
        let owned = state.map.owner_of(bucket) == Some(me);
        if !owned || state.promoted.contains_key(&bucket.0) {
            out.push(Action::Unmark { bucket });
            continue;
        }
        // A lost bucket stays marked until it is found or cleared: this process holds nothing
        // of it, and a `Found` an earlier life of this node proposed may still commit (its
        // copy is then at the heir). One given back to this process is unmarked as it is
        // installed.
        if state.is_lost(bucket) {
            continue;
        }
        let tried = f.no_copy.get(&bucket);
        let sources = [state.heir_of(me), state.shadow_of(bucket)];
        let source = sources
            .into_iter()
            .flatten()
            .find(|&s| s != me && state.is_member(s) && !tried.is_some_and(|t| t.contains(&s)));
        match source {
            Some(from) if free > 0 => {
                free -= 1;
                out.push(Action::Job(Job::Restore { bucket, from }));
            }
            Some(_) => {}
            None => empty.push(bucket),
        }
    }
    if !empty.is_empty() {
        out.push(Action::ServeEmpty { buckets: empty });
    }
}

/// Buckets a failover or hand-over gave this node: each is served from the replica copy of
/// the member it came from, else from the shadow of the running transfer (every write the
/// failed owner acknowledged was written through to it), else it is lost. The decided ones are
/// reported at once: the heir serves a promoted bucket only once its report is committed.
fn plan_promotions(state: &ClusterState, f: &Facts, out: &mut Vec<Action>) {
    let promotions = state.promotions_of(f.me);
    if promotions.is_empty() || f.running.report {
        return;
    }
    let (mut installed, mut lost) = (Vec::new(), Vec::new());
    for (bucket, from) in promotions {
        // A lost bucket stays lost, whatever copy is here: its last server may still give it
        // back, and only `Found` ends its wait (a copy here may come from an owner that took
        // the bucket back and failed before `Found` committed).
        if state.is_lost(bucket) {
            lost.push(bucket);
            continue;
        }
        if f.installed.contains(&bucket) {
            installed.push(bucket);
        } else if f.replicas.get(&bucket) == Some(&from) {
            out.push(Action::Install { bucket, from });
        } else {
            let shadow = state.handoffs.get(&bucket.0).copied().filter(|&s| s == f.me || state.is_member(s));
            match shadow {
                // Named as the shadow but restarted since: it holds nothing of the bucket.
                Some(s) if s == f.me && !f.shadows.contains(&bucket) => lost.push(bucket),
                Some(s) if s == f.me => out.push(Action::AdoptShadow { bucket }),
                Some(_) if f.running.promotions.contains(&bucket) => {}
                Some(s) if !f.no_copy.get(&bucket).is_some_and(|t| t.contains(&s)) => {
                    out.push(Action::Job(Job::RestoreShadow { bucket, from: s }));
                }
                _ => lost.push(bucket),
            }
        }
    }
    if !installed.is_empty() || !lost.is_empty() {
        out.push(Action::Job(Job::ReportPromoted { installed, lost }));
    }
}

/// Keeps the replica of what this node owns complete: every bucket it serves is sent whole
/// to the holder of its complete replica (or, without one, the holder join order names) and
/// to the holder join order names; once that one has them all, it becomes the holder of the
/// complete replica. The holder join order names is sent nothing while it still has buckets
/// to pull (see [`prepares_replica_now`]).
fn plan_replicas(state: &ClusterState, f: &Facts, out: &mut Vec<Action>) {
    let me = f.me;
    let Some(desired) = state.replica_of(me) else { return };
    let committed = state.committed_holder_of(me);
    let required = committed.unwrap_or(desired);
    let owned = state.map.buckets_of(me);
    let serving: Vec<BucketId> =
        owned.iter().copied().filter(|&b| phase_of(state, me, b, f.of(b)) == Phase::Serving).collect();
    if !f.running.attach {
        let holders = [Some(required), Some(desired).filter(|&d| d == required || prepares_replica_now(state, me, d))];
        for holder in holders.into_iter().flatten() {
            let missing: Vec<BucketId> =
                serving.iter().copied().filter(|&b| !f.attached.contains(&(b, holder))).take(ATTACH_BATCH).collect();
            if !missing.is_empty() {
                out.push(Action::Job(Job::Attach { holder, buckets: missing }));
                break;
            }
        }
    }
    let leaving = state.member_of(me).is_some_and(|m| m.leaving);
    // A lost bucket has no data to replicate; any other bucket not served yet (being
    // restored or promoted) must be sent first.
    let pending = owned.iter().filter(|&&b| !state.is_lost(b)).count() != serving.len();
    let complete = !pending && serving.iter().all(|&b| f.attached.contains(&(b, desired)));
    if committed != Some(desired) && complete && !leaving && !f.running.move_replica {
        out.push(Action::Job(Job::MoveReplica { holder: desired }));
    }
}

/// Whether `owner` may send replica copies to `holder`, which only prepares to hold them (it
/// is the holder join order names, not yet the complete one): not while the running or the
/// pending map still gives `holder` buckets to pull. A joiner gets its share first: the replica
/// copies would compete with its pulls for the same links and cores, and a copy of a bucket
/// the joiner is about to own would be thrown away as the bucket arrives. The complete holder
/// keeps every write meanwhile, so no bucket has fewer copies for the wait; only the
/// replica's move to the new holder comes later. Unless the complete holder is on its way out
/// (leaving, or stopping): then the copies go at once, so that the owner's replica is whole
/// elsewhere as early as it can be.
pub fn prepares_replica_now(state: &ClusterState, owner: NodeId, holder: NodeId) -> bool {
    let complete_goes = state
        .committed_holder_of(owner)
        .is_some_and(|h| state.draining.contains(&h) || state.member_of(h).is_some_and(|m| m.leaving));
    let pending_gives = state.transition.as_ref().is_some_and(|t| {
        BucketId::all().any(|b| t.to.owner_of(b) == Some(holder) && state.map.owner_of(b) != Some(holder))
    });
    complete_goes || (state.incoming_of(holder).is_empty() && !pending_gives)
}

/// This node's own entry into maintenance, once committed as preparing: refused when it ended
/// meanwhile, when another member stops (the heir, or the majority that keeps the maintenance,
/// may be gone next), when the replica it holds for another member did not move on in time, or
/// when it has no heir; otherwise, once nobody's complete replica is on it, it hands its
/// buckets to its heir.
fn plan_entry(state: &ClusterState, f: &Facts, out: &mut Vec<Action>) {
    let Entering::Asked { overdue } = f.entering else { return };
    if f.running.go_away {
        return;
    }
    let me = f.me;
    let preparing = state.maintenance.as_ref().is_some_and(|m| m.node == me && m.phase == MaintenancePhase::Preparing);
    let refusal = if !preparing {
        MaintenanceRefusal::Busy("the maintenance ended while it prepared".into())
    } else if let Some(peer) = state.stopping_peer(me) {
        MaintenanceRefusal::PeerStopping(peer)
    } else if let Some(owner) = state.held_by(me) {
        if !overdue {
            return;
        }
        MaintenanceRefusal::StillHolding { holder: me, owner }
    } else if let Some(heir) = state.heir_of(me) {
        out.push(Action::Job(Job::GoAway { heir }));
        return;
    } else {
        MaintenanceRefusal::TooFewMembers(state.members.len())
    };
    out.push(Action::RefuseMaintenance { refusal });
}

/// A leaving member, once its leave's target is set and it still serves buckets, hands them
/// to the holder of its complete replica, once per leave.
fn plan_handover(state: &ClusterState, f: &Facts, out: &mut Vec<Action>) {
    let me = f.me;
    let leaving = state.member_of(me).is_some_and(|m| m.leaving);
    if !leaving || f.handover_tried || f.running.handover || f.draining {
        return;
    }
    if state.transition.is_some() || state.target.is_none() || state.map.buckets_of(me).is_empty() {
        return;
    }
    let heir = state.heir_of(me).filter(|&h| h != me && state.is_member(h) && !f.suspected.contains(&h));
    if let Some(heir) = heir {
        out.push(Action::Job(Job::HandOver { heir }));
    }
}

/// The one place bucket data is dropped: an active copy when the bucket's phase here keeps
/// nothing (another node serves it, and this node neither gets it nor shadows it), once the
/// state says so twice in a row; a replica copy when its owner no longer owns the bucket, is
/// gone, or no longer names this node as a holder — except while a promotion still needs it.
fn plan_drops(previous: &ClusterState, state: &ClusterState, f: &Facts, out: &mut Vec<Action>) {
    let me = f.me;
    for &bucket in &f.active {
        if f.busy(bucket) {
            continue;
        }
        let keeps = |s: &ClusterState| phase_of(s, me, bucket, f.of(bucket)).keeps_active_data();
        if !keeps(state) && !keeps(previous) {
            out.push(Action::DropActive { bucket });
        }
    }
    for (&bucket, &source) in &f.replicas {
        if !keeps_replica(state, me, bucket, source) {
            out.push(Action::DropReplica { bucket, source });
        }
    }
}

#[cfg(test)]
mod tests;
