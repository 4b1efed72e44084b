//! Failure detection: ping/pong between every pair of members.
//!
//! ```text
//!  every --ping-interval:  A ── Ping {from: A, pfail: [ids A has not heard from]} ──▶ B
//!                          A ◀── {node_id: B, status: A's membership in B's view} ──────────────────┘
//!  no pong for --node-timeout: B is pfail in A's view
//!  the leader: pfail in the view of a majority of the members (its own view and the reports in
//!  the pings it received) ──▶ its reconciler's FailNode ──▶ Raft: NodeFailed(B)
//! ```
//!
//! This module keeps the contacts and tallies the reports ([`Health::to_fail`]); the leader's
//! reconciler plans the proposal, woken after every ping round ([`Health::round`]).
//!
//! A pong that says "you were failed" makes this node stop, discard its data and rejoin as
//! a new member. The same contacts give a *lease*: a node that has not heard from a
//! majority of the members within `--node-timeout` serves no read and acknowledges no write
//! (`503 no_quorum`), so a node paused or cut off long enough to be failed cannot answer for
//! buckets that were given to another node meanwhile.
//!
//! The lease runs out before the node can be failed. A node that answers B's ping promises not
//! to report B pfail within the node timeout of that answer; B counts the answer toward its lease
//! for the node timeout from when it sent the ping, which was earlier. So every member of a
//! majority that reports B pfail does so only after B's lease through it ran out, and a
//! majority of reports needs at least one member B's lease counted. A node that has reported B
//! pfail lends B no lease (`Pong::lease`) until that report can no longer count anywhere.
//!
//! Pings carry the sender's incarnation (random at every start). A ping from a new incarnation
//! of a member means it restarted: it counts as contact, and the pfail reports about it made
//! before are forgotten, so a member that comes back is never failed for its absence before.
//! A member away in maintenance is reported by nobody; once a node sees it no longer away (it
//! returned, or its maintenance ended), its silence counts from then and the reports about it
//! are forgotten: its return may commit at the leader before a ping of its new process arrives.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use shoal_http_api::types::{PeerHealth, PeerState};
use shoal_raft::{ClusterState, ControlPlane, MemberStatus, NodeId};
use tokio::sync::{watch, Notify};
use tokio::time::Instant;

use crate::mirror::{Mirrors, Outcome};
use crate::peer::Peers;
use crate::phase::{write_refusal, LocalFacts, NodeFacts};
use crate::replication::{ReplicaReport, Replicator};
use crate::transport::wire::{self, Handlers};
use crate::transport::Endpoint;

/// A failure-detection ping.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Ping {
    /// The sender.
    pub from: NodeId,
    /// The members the sender has not heard from within the node timeout.
    pub pfail: Vec<NodeId>,
    /// The sender's incarnation (random at every start): a new one tells the receiver that
    /// the sender restarted.
    pub incarnation: u64,
    /// What the sender says of its replica, for mirror reads: which member holds it (the one
    /// every write must reach), in which holding period, and how far behind that copy may be.
    /// Absent while one of its buckets is not attached there (the copy may lack writes). A
    /// holder serves mirror reads from its copy only while the sender's latest report names
    /// it, in its current period.
    pub replica: Option<ReplicaReport>,
}

/// The answer to a ping.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Pong {
    /// The answering node.
    pub node_id: NodeId,
    /// Random at every start of the answering process: a change means it restarted, and its
    /// replica store is empty.
    pub incarnation: u64,
    /// The sender's membership in the answering node's view.
    pub status: MemberStatus,
    /// Whether the answer renews the sender's lease: false while the answering node may still
    /// be counted as reporting the sender pfail (the sender may be failed on that report, so
    /// it must not serve on a lease meanwhile).
    pub lease: bool,
}

impl Endpoint for Ping {
    type Answer = Pong;
    const ID: u8 = wire::id::PING;
}

/// Registers the answer to pings.
pub fn register(handlers: &mut Handlers, health: &Arc<Health>) {
    handlers.add_with(health, |health, ping: Ping| async move { Ok(health.pong(ping)) });
}

/// Failure-detection settings.
#[derive(Debug, Clone, Copy)]
pub struct HealthConfig {
    /// How often every peer is pinged; zero disables failure detection.
    pub ping_interval: Duration,
    /// Silence after which a peer is pfail.
    pub node_timeout: Duration,
}

/// This node's view of its peers, and the leader's tally of pfail reports.
pub struct Health {
    me: NodeId,
    control: ControlPlane,
    config: HealthConfig,
    contacts: Mutex<BTreeMap<NodeId, Contact>>,
    reports: Mutex<Reports>,
    peers: Peers,
    /// How long one ping may wait for its pong.
    ping_timeout: Duration,
    incarnation: u64,
    incarnations: Mutex<BTreeMap<NodeId, u64>>,
    replicator: Arc<Replicator>,
    /// Mirror statistics: every ping's answer (or failure) counts as a mirror ping.
    mirrors: Arc<Mirrors>,
    /// What this node knows of itself: its gate (draining, handing over) decides, with the
    /// lease, whether it may write, and so whether it reports others.
    facts: Arc<LocalFacts>,
    /// `NodeFailed` commands this node proposed as leader.
    pub fails_proposed: AtomicU64,
    /// Notified after every ping round of a leader (its reconciler looks for members to fail).
    round: Notify,
    /// Peers with a ping in flight.
    in_flight: Mutex<BTreeSet<NodeId>>,
    /// The members this node holds pfail, as of the last ping round.
    pfail_now: watch::Sender<BTreeSet<NodeId>>,
    /// The member away in maintenance when this node last looked (see [`Self::note_away`]).
    away: Mutex<Option<NodeId>>,
}

impl Health {
    /// A detector for the node of `control`, pinging through `peers`; `incarnation` is random
    /// at every start of the process (peers see a restart by it).
    pub fn new(
        control: ControlPlane,
        config: HealthConfig,
        replicator: Arc<Replicator>,
        peers: Peers,
        incarnation: u64,
        mirrors: Arc<Mirrors>,
        facts: Arc<LocalFacts>,
    ) -> Arc<Self> {
        let ping_timeout = config.node_timeout.min(Duration::from_secs(2)).max(Duration::from_millis(200));
        Arc::new(Health {
            me: control.node_id(),
            control,
            config,
            contacts: Mutex::new(BTreeMap::new()),
            reports: Mutex::new(Reports::default()),
            peers,
            ping_timeout,
            incarnation,
            incarnations: Mutex::new(BTreeMap::new()),
            replicator,
            mirrors,
            facts,
            fails_proposed: AtomicU64::new(0),
            round: Notify::new(),
            in_flight: Mutex::new(BTreeSet::new()),
            pfail_now: watch::channel(BTreeSet::new()).0,
            away: Mutex::new(None),
        })
    }

    /// Whether failure detection runs.
    pub fn enabled(&self) -> bool {
        !self.config.ping_interval.is_zero()
    }

    /// Whether this node has not heard from `id` within the node timeout (no answer to a ping
    /// it sent since).
    pub fn is_pfail(&self, id: NodeId) -> bool {
        self.enabled()
            && id != self.me
            && self.contacts.lock().get(&id).is_some_and(|c| c.answered.elapsed() > self.config.node_timeout)
    }

    /// Whether `id` answered this node's pings lately (within three ping intervals, at most
    /// the node timeout): what the leader counts as running before it changes the voters. A
    /// member killed a moment ago is not pfail yet, but it no longer answers. Always true
    /// when failure detection is off.
    pub fn answers(&self, id: NodeId) -> bool {
        let within = (self.config.ping_interval * 3).min(self.config.node_timeout);
        !self.enabled() || id == self.me || self.contacts.lock().get(&id).is_none_or(|c| c.answered.elapsed() <= within)
    }

    /// Whether this node reports `id` pfail: it has not heard from it, and it promised it
    /// nothing (no ping from `id` arrived within the node timeout). A report is remembered in
    /// the same step (under the same lock as the promises), so this node lends `id` no lease
    /// while the report may count.
    fn reports(&self, id: NodeId) -> bool {
        if !self.enabled() || id == self.me {
            return false;
        }
        let now = Instant::now();
        let mut contacts = self.contacts.lock();
        let Some(c) = contacts.get_mut(&id) else { return false };
        let suspected = c.suspected(now, self.config.node_timeout);
        if suspected {
            c.reported = Some(now);
        }
        suspected
    }

    /// How long a report this node sent may count at another node: the reports' freshness,
    /// plus the longest a ping carrying it may travel.
    fn report_life(&self) -> Duration {
        self.config.node_timeout * 2 + self.config.ping_interval + self.ping_timeout
    }

    /// Resolves once `id` turns pfail in this node's view (checked every ping round); never
    /// when failure detection is off. A forward to a member that falls silent is answered
    /// then, not when its request timeout runs out.
    pub async fn silent(&self, id: NodeId) {
        let mut rx = self.pfail_now.subscribe();
        if rx.wait_for(|now| now.contains(&id)).await.is_err() {
            std::future::pending::<()>().await;
        }
    }

    /// The members this node has not heard from.
    pub fn pfail_members(&self) -> Vec<NodeId> {
        self.control.state().members.iter().map(|m| m.id).filter(|&id| self.is_pfail(id)).collect()
    }

    /// The members this node reports pfail (see [`Self::reports`]); never one away in
    /// maintenance: it is silent on purpose.
    fn suspected_members(&self, state: &ClusterState) -> Vec<NodeId> {
        let away = state.away();
        state.members.iter().map(|m| m.id).filter(|&id| Some(id) != away && self.reports(id)).collect()
    }

    /// A member that was away in maintenance when this node last looked and is not any more
    /// (it returned, or its maintenance ended): its silence counts from now, and what was
    /// reported about it before no longer counts. Its silence while away was on purpose, and
    /// the leader may apply its return before any ping of its new process arrives. Called
    /// before this node reports anyone and before the leader tallies, with the state they use.
    fn note_away(&self, state: &ClusterState) {
        let away = state.away();
        let before = std::mem::replace(&mut *self.away.lock(), away);
        let Some(back) = before.filter(|&b| Some(b) != away) else { return };
        if let Some(c) = self.contacts.lock().get_mut(&back) {
            c.count_silence_from(Instant::now());
        }
        self.reports.lock().forget(back);
    }

    /// Every other member's state in this node's view.
    pub fn peers(&self) -> Vec<PeerHealth> {
        let state = self.control.state();
        state
            .members
            .iter()
            .filter(|m| m.id != self.me)
            .map(|m| {
                let since = self.contacts.lock().get(&m.id).map(|c| c.answered.elapsed());
                PeerHealth {
                    node_id: m.id,
                    state: if Some(m.id) == state.away() {
                        PeerState::Maintenance
                    } else if self.is_pfail(m.id) {
                        PeerState::Pfail
                    } else {
                        PeerState::Ok
                    },
                    last_contact_ms: since.map(|d| d.as_millis() as u64),
                }
            })
            .collect()
    }

    /// What this node knows of itself that decides whether it may acknowledge a write (see
    /// `crate::phase::write_refusal`): a peer said it was failed, it hands its buckets over,
    /// it stops, or it has not heard from a majority of the members within the node timeout.
    pub fn node_facts(&self) -> NodeFacts {
        let mut facts = NodeFacts {
            failed: self.facts.is_failed(),
            handing_over: self.facts.is_handing_over(),
            draining: self.facts.is_draining(),
            no_quorum: None,
        };
        if !self.enabled() {
            return facts;
        }
        let state = self.control.state();
        let n = state.members.len();
        if n <= 1 {
            return facts;
        }
        let now = Instant::now();
        let heard = {
            let contacts = self.contacts.lock();
            let timeout = self.config.node_timeout;
            let leases = |id| contacts.get(&id).is_some_and(|c: &Contact| c.leases(now, timeout));
            state.members.iter().filter(|m| m.id == self.me || leases(m.id)).count()
        };
        if heard * 2 <= n {
            facts.no_quorum = Some((heard, n));
        }
        facts
    }

    /// Pings every peer every interval, and as leader fails the members a majority reports.
    pub async fn run(self: Arc<Self>) {
        if !self.enabled() {
            return;
        }
        let mut tick = tokio::time::interval(self.config.ping_interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let state = self.control.state();
            {
                // A member's silence counts from when this node first saw it, not from start.
                let mut contacts = self.contacts.lock();
                for m in state.members.iter().filter(|m| m.id != self.me) {
                    contacts.entry(m.id).or_insert_with(|| Contact::new(Instant::now()));
                }
            }
            // A node that cannot hear a majority (paused, cut off) reports nobody: its view is
            // stale, and its reports must not help fail healthy members.
            // Every node it ever heard from, members or not: a member failed meanwhile (the
            // leader may fail it before this round) stays silent for the forwards to it.
            let silent: BTreeSet<NodeId> = {
                let contacts = self.contacts.lock();
                let timeout = self.config.node_timeout;
                contacts.iter().filter(|(_, c)| c.answered.elapsed() > timeout).map(|(&id, _)| id).collect()
            };
            self.pfail_now.send_if_modified(|now| {
                let changed = *now != silent;
                if changed {
                    *now = silent;
                }
                changed
            });
            self.note_away(&state);
            let pfail =
                if write_refusal(self.node_facts()).is_some() { Vec::new() } else { self.suspected_members(&state) };
            let replica = self.replicator.lag_report(&state);
            let ping = Ping { from: self.me, pfail, incarnation: self.incarnation, replica };
            // Every peer on its own: a peer that does not answer must not hold up (and age)
            // the contacts of the others. One ping in flight per peer.
            for m in state.members.iter().filter(|m| m.id != self.me) {
                if !self.in_flight.lock().insert(m.id) {
                    continue;
                }
                let (health, id, ping) = (self.clone(), m.id, ping.clone());
                let peer_addr = m.peer_addr.clone();
                tokio::spawn(async move {
                    // A pong proves the peer alive when the ping left, not when the answer is
                    // read: a node paused with answers in its socket buffer must not renew its
                    // lease with them.
                    let sent = Instant::now();
                    let pong = health.peers.ask(&peer_addr, ping, health.ping_timeout).await;
                    health.in_flight.lock().remove(&id);
                    let outcome = pong.as_ref().map_or_else(crate::mirror::outcome_of, |_| Outcome::Answered);
                    health.mirrors.record_ping(id, outcome, sent.elapsed());
                    if let Ok(pong) = pong {
                        health.on_pong(id, sent, pong);
                    }
                });
            }
            if self.control.is_leader() {
                self.round.notify_one();
            }
        }
    }

    fn on_pong(&self, id: NodeId, sent: Instant, pong: Pong) {
        if pong.status == MemberStatus::Failed {
            if self.facts.mark_failed() {
                tracing::error!(by = id, "the cluster failed this node; it stops serving and rejoins");
            }
            return;
        }
        self.contacts.lock().entry(id).or_insert_with(|| Contact::new(sent)).answered_at(sent, pong.lease);
        self.seen_incarnation(id, pong.incarnation);
    }

    /// Records `id`'s incarnation; a new one means it restarted: its replica store came back
    /// empty (every bucket is sent again), and the pfail reports about it made before it
    /// restarted no longer count.
    /// Answers whether it restarted.
    fn seen_incarnation(&self, id: NodeId, incarnation: u64) -> bool {
        if incarnation == 0 {
            return false;
        }
        let before = self.incarnations.lock().insert(id, incarnation);
        let restarted = before.is_some_and(|b| b != incarnation);
        if restarted {
            tracing::info!(node_id = id, "peer restarted; re-sending the replica it holds");
            self.reports.lock().forget(id);
            self.facts.attached().detach_holder(id);
        }
        restarted
    }

    /// Resolves after a ping round of this node as leader (one round's notice is kept until
    /// someone waits).
    pub async fn round(&self) {
        self.round.notified().await;
    }

    /// As leader: a member that a majority of the members (this node included) reports pfail,
    /// with the votes and the members counted. (This node's own view counts as a report, and
    /// is remembered as one: see [`Self::reports`].)
    pub fn to_fail(&self) -> Option<(NodeId, usize, usize)> {
        if !self.enabled() {
            return None;
        }
        let state = self.control.state();
        self.note_away(&state);
        // A member away in maintenance cannot report: the majority is of the others. (Still
        // safe against the lease: a node's lease needs a majority of all the members, none of
        // them the away one, so it meets every majority of the others.)
        let n = state.members.len() - usize::from(state.away().is_some());
        let fresh = self.config.node_timeout * 2 + self.config.ping_interval;
        let reports = {
            let mut reports = self.reports.lock();
            reports.expire(fresh);
            reports.clone()
        };
        // A member away in maintenance is silent on purpose: it is not failed for it.
        for m in state.members.iter().filter(|m| m.id != self.me && Some(m.id) != state.away()) {
            // The leader's own view is a report like any other: remembered.
            let votes = usize::from(self.reports(m.id))
                + reports.votes_against(m.id, |r| state.is_member(r) && Some(r) != state.away());
            if votes * 2 > n {
                return Some((m.id, votes, n));
            }
        }
        None
    }
}

impl Health {
    /// Answers a ping (a call on the peer link): the sender's pfail list is a report, and the
    /// answer promises not to report the sender pfail within the node timeout. (It does not
    /// count as contact for this node's own lease: a ping may have waited in a socket buffer;
    /// only this node's own pings, timed from their sending, do — and a ping from a new
    /// incarnation.)
    pub fn pong(&self, ping: Ping) -> Pong {
        let status = self.control.member_status(ping.from);
        let mut lease = false;
        if status == MemberStatus::Member {
            let now = Instant::now();
            // A new incarnation restarted since it was last seen: it was alive when it sent
            // this (a paused process does not restart), so it counts as contact; and what was
            // reported about it before is void everywhere (see `Reports::forget`).
            let restarted = self.seen_incarnation(ping.from, ping.incarnation);
            {
                let mut contacts = self.contacts.lock();
                let contact = contacts.entry(ping.from).or_insert_with(|| Contact::new(now));
                if restarted {
                    contact.answered = now;
                    contact.reported = None;
                }
                lease = contact.pinged_at(now, self.report_life());
            }
            self.reports.lock().record(ping.from, now, ping.pfail);
            self.replicator.holder.note_lag(ping.from, ping.replica);
        }
        Pong { node_id: self.me, incarnation: self.incarnation, status, lease }
    }
}

/// What this node knows of its contact with one peer.
#[derive(Debug, Clone, Copy)]
struct Contact {
    /// When the newest ping this node sent that the peer answered left (or when this node
    /// first saw the peer): the peer was alive then.
    answered: Instant,
    /// The same, among the answers that lend a lease.
    leased: Instant,
    /// When a ping from the peer last arrived here; this node promised not to report it pfail
    /// within the node timeout of that.
    pinged: Option<Instant>,
    /// When this node last reported the peer pfail.
    reported: Option<Instant>,
    /// Silence before this does not count (the peer was away in maintenance until then).
    silence_from: Instant,
}

impl Contact {
    fn new(at: Instant) -> Self {
        Contact { answered: at, leased: at, pinged: None, reported: None, silence_from: at }
    }

    /// The peer answered a ping sent at `sent`; the answer lends a lease or not.
    fn answered_at(&mut self, sent: Instant, lease: bool) {
        self.answered = self.answered.max(sent);
        if lease {
            self.leased = self.leased.max(sent);
        }
    }

    /// The peer's lease through this node is renewed at `now` (its ping arrived): answers
    /// whether this node lends it, which it does not while its last report of the peer may
    /// still count somewhere (`report_life`).
    fn pinged_at(&mut self, now: Instant, report_life: Duration) -> bool {
        self.pinged = Some(now);
        self.reported.is_none_or(|r| now.saturating_duration_since(r) > report_life)
    }

    /// Whether the peer counts toward this node's lease at `now`.
    fn leases(&self, now: Instant, timeout: Duration) -> bool {
        now.saturating_duration_since(self.leased) <= timeout
    }

    /// The peer's silence counts from `at` on (its maintenance ended then), not before.
    fn count_silence_from(&mut self, at: Instant) {
        self.silence_from = self.silence_from.max(at);
    }

    /// Whether this node reports the peer pfail at `now`: no answer for the node timeout (of
    /// the silence that counts), and no ping from it within the node timeout either (its
    /// lease through this node may run).
    fn suspected(&self, now: Instant, timeout: Duration) -> bool {
        now.saturating_duration_since(self.answered.max(self.silence_from)) > timeout
            && self.pinged.is_none_or(|p| now.saturating_duration_since(p) > timeout)
    }
}

/// The pfail reports the leader received: per reporter, when and whom it reported.
#[derive(Debug, Clone, Default)]
struct Reports(BTreeMap<NodeId, (Instant, Vec<NodeId>)>);

impl Reports {
    /// `reporter` reported `pfail` at `at` (its newest report replaces the one before).
    fn record(&mut self, reporter: NodeId, at: Instant, pfail: Vec<NodeId>) {
        self.0.insert(reporter, (at, pfail));
    }

    /// Forgets the reports older than `fresh`.
    fn expire(&mut self, fresh: Duration) {
        self.0.retain(|_, (at, _)| at.elapsed() <= fresh);
    }

    /// `id` restarted: what was reported about it before no longer counts.
    fn forget(&mut self, id: NodeId) {
        for (_, pfail) in self.0.values_mut() {
            pfail.retain(|&p| p != id);
        }
    }

    /// How many reporters that `counts` accepts (members) report `id` pfail; `id` itself not.
    fn votes_against(&self, id: NodeId, counts: impl Fn(NodeId) -> bool) -> usize {
        self.0.iter().filter(|(&r, (_, pfail))| r != id && counts(r) && pfail.contains(&id)).count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_peer_lease_runs_out_before_this_node_reports_it_and_no_lease_is_lent_while_a_report_counts() {
        let timeout = Duration::from_secs(5);
        let life = Duration::from_secs(13);
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        // This node's view of peer B: B answered a ping sent at 0 and pinged this node at 100.
        let mut b = Contact::new(t0);
        assert!(b.pinged_at(at(100), life), "nothing reported: the answer lends a lease");
        // B's lease through this node counts from B's ping, sent before 100: until 5_100 at most.
        // This node reports B only once both its answers and its promise ran out.
        assert!(!b.suspected(at(5_050), timeout), "no answer for 5 s, but the promise of 100 runs");
        assert!(b.suspected(at(5_101), timeout));
        // Reported at 5_200: the report may count somewhere until 18_200; no lease before then.
        b.reported = Some(at(5_200));
        assert!(!b.pinged_at(at(6_000), life), "a peer reported pfail gets no lease");
        assert!(!b.suspected(at(6_500), timeout), "but its ping is a promise: no new report");
        assert!(b.pinged_at(at(18_300), life), "the report expired everywhere");
        // This node's own lease through B: only answers that lend one count.
        let mut c = Contact::new(t0);
        c.answered_at(at(4_000), false);
        assert!(!c.leases(at(6_000), timeout), "an answer without a lease does not renew it");
        assert!(!c.suspected(at(6_000), timeout), "but it proves the peer alive");
        c.answered_at(at(5_000), true);
        assert!(c.leases(at(6_000), timeout));
        assert!(!c.leases(at(10_001), timeout), "a lease lasts the node timeout from the ping's sending");
        // A peer back from maintenance at 20_000, silent since 5_000: its silence counts from
        // its return.
        c.count_silence_from(at(20_000));
        assert!(!c.suspected(at(24_000), timeout), "silent for 4 s since it came back");
        assert!(c.suspected(at(25_001), timeout), "silent for the node timeout since it came back");
        assert!(!c.leases(at(24_000), timeout), "its return lends this node no lease");
    }

    #[test]
    fn reports_about_a_member_made_before_it_restarted_do_not_count() {
        let now = Instant::now();
        let mut reports = Reports::default();
        reports.record(2, now, vec![3]);
        reports.record(4, now, vec![3, 5]);
        reports.record(3, now, vec![3]);
        assert_eq!(reports.votes_against(3, |_| true), 2, "a member's report about itself does not count");
        assert_eq!(reports.votes_against(3, |r| r != 4), 1, "only members' reports count");
        reports.forget(3);
        assert_eq!(reports.votes_against(3, |_| true), 0, "node 3 restarted");
        assert_eq!(reports.votes_against(5, |_| true), 1, "reports about others stay");
        reports.record(2, now, vec![3]);
        assert_eq!(reports.votes_against(3, |_| true), 1, "a report made after the restart counts");
    }
}
