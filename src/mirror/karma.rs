//! The pure part of mirror choice: statistics in karma blocks, latency-weighted
//! probabilities, and the strategies. No clock and no randomness of its own: the time since
//! the statistics began and the random draw are arguments, so every decision is a function
//! of its inputs and tested as such.

use std::collections::{BTreeMap, VecDeque};
use std::time::Duration;

use shoal_http_api::types::{AgentErrors, AgentView, KarmaBlockView};
use shoal_raft::NodeId;

/// How many karma blocks are kept for inspection.
pub const KEPT_BLOCKS: usize = 15;

/// How a mirror is chosen among a bucket's mirrors.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Strategy {
    /// Uniformly at random, whatever the mirrors' state.
    #[default]
    Random,
    /// Latency-weighted, never a mirror whose last answer failed.
    NoDeads,
    /// Latency-weighted, never a dead mirror nor one with errors in the blocks used for
    /// choosing.
    NoErrors,
    /// In turn.
    RoundRobin,
}

impl Strategy {
    /// Its name, as `--ha-strategy` takes it.
    pub fn as_str(self) -> &'static str {
        match self {
            Strategy::Random => "random",
            Strategy::NoDeads => "nodeads",
            Strategy::NoErrors => "noerrors",
            Strategy::RoundRobin => "roundrobin",
        }
    }
}

impl std::str::FromStr for Strategy {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "random" => Ok(Strategy::Random),
            "nodeads" => Ok(Strategy::NoDeads),
            "noerrors" => Ok(Strategy::NoErrors),
            "roundrobin" => Ok(Strategy::RoundRobin),
            other => Err(format!("--ha-strategy must be random, nodeads, noerrors or roundrobin, not {other:?}")),
        }
    }
}

/// How one read or ping sent to a mirror ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// It answered (a value, or not found).
    Answered,
    /// No connection.
    Connect,
    /// No answer in time.
    Timeout,
    /// It answered with a refusal (its copy was not fresh enough, it was stopping, ...).
    Refused,
    /// It answered something that was not an answer to the request.
    WrongAnswer,
}

impl Outcome {
    /// Whether the mirror answered at all (alive), whatever it said.
    fn answered(self) -> bool {
        !matches!(self, Outcome::Connect | Outcome::Timeout)
    }
}

/// What one karma block counted of one mirror.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Block {
    /// Reads sent.
    pub requests: u64,
    /// Reads answered.
    pub successes: u64,
    /// Reads and pings that failed.
    pub errors: AgentErrors,
    /// Sum of the answered reads' latencies.
    pub latency: Duration,
    /// Pings answered.
    pub pings: u64,
    /// Sum of the answered pings' latencies.
    pub ping_latency: Duration,
}

impl Block {
    fn error_count(&self) -> u64 {
        let e = self.errors;
        e.connect + e.timeout + e.refused + e.wrong_answer
    }

    /// The latency this block measured, in milliseconds: of reads, else of pings.
    pub fn latency_ms(&self) -> Option<f64> {
        let avg = |sum: Duration, n: u64| (n > 0).then(|| sum.as_secs_f64() * 1000.0 / n as f64);
        avg(self.latency, self.successes).or_else(|| avg(self.ping_latency, self.pings))
    }
}

/// One mirror's state.
#[derive(Debug, Clone, Default, PartialEq)]
struct Agent {
    /// Whether its last answer failed.
    dead: bool,
    /// When it last answered.
    last_answer: Option<Duration>,
}

/// The probabilities of mirrors whose latencies (in milliseconds) are `latencies_ms`: each
/// inversely proportional to its latency, normalised to sum 1. A mirror without a
/// measurement weighs as much as the measured ones on average (as likely as an average
/// mirror); with no measurement at all, every mirror is equally likely.
///
/// Only the mirrors given take part: a read weighs the mirrors it can go to among
/// themselves, so a fast mirror elsewhere (this node itself, say) does not squeeze them.
pub fn weigh(latencies_ms: &[Option<f64>]) -> Vec<f64> {
    let inverse = |l: f64| 1.0 / l.max(1e-6);
    let measured: Vec<f64> = latencies_ms.iter().flatten().map(|&l| inverse(l)).collect();
    if measured.is_empty() {
        return normalise(&vec![1.0; latencies_ms.len()]);
    }
    let mean = measured.iter().sum::<f64>() / measured.len() as f64;
    let weights: Vec<f64> = latencies_ms.iter().map(|l| l.map_or(mean, inverse)).collect();
    normalise(&weights)
}

fn normalise(weights: &[f64]) -> Vec<f64> {
    let sum: f64 = weights.iter().sum();
    if sum <= 0.0 || !sum.is_finite() {
        return vec![1.0 / weights.len().max(1) as f64; weights.len()];
    }
    weights.iter().map(|w| w / sum).collect()
}

/// The statistics of every mirror, in blocks of `period`.
///
/// Probabilities come from one block's latencies (`weighing_block`): the block that ended
/// last, until the newest is half full; from then on the newest. Nothing carries over from
/// older blocks, so a mirror's past stops mattering after at most one and a half periods: a
/// mirror slow for an hour gets its fair share back at most 1.5 periods after it recovered.
#[derive(Debug, Clone)]
pub struct Karma {
    period: Duration,
    /// The index of the newest block (time since the statistics began / period).
    current: u64,
    /// Newest first; each maps a mirror to what the block counted of it.
    blocks: VecDeque<BTreeMap<NodeId, Block>>,
    agents: BTreeMap<NodeId, Agent>,
}

impl Karma {
    /// Empty statistics in blocks of `period` (at least a millisecond).
    pub fn new(period: Duration) -> Self {
        let mut blocks = VecDeque::new();
        blocks.push_front(BTreeMap::new());
        Karma { period: period.max(Duration::from_millis(1)), current: 0, blocks, agents: BTreeMap::new() }
    }

    fn index_at(&self, now: Duration) -> u64 {
        (now.as_nanos() / self.period.as_nanos()) as u64
    }

    /// When block `index` began (time since the statistics began).
    fn start_of(&self, index: u64) -> Duration {
        Duration::from_nanos((self.period.as_nanos() as u64).saturating_mul(index))
    }

    /// Starts the blocks that began by `now`.
    pub fn rotate(&mut self, now: Duration) {
        let index = self.index_at(now);
        if index <= self.current {
            return;
        }
        // At most KEPT_BLOCKS new ones matter: older ones would be dropped at once.
        let new = (index - self.current).min(KEPT_BLOCKS as u64);
        for _ in 0..new {
            self.blocks.push_front(BTreeMap::new());
        }
        self.blocks.truncate(KEPT_BLOCKS);
        self.current = index;
    }

    /// Records how a read (or, with `ping`, a ping) sent to `mirror` ended after `latency`.
    /// The dead flag follows every answer, pings included.
    pub fn record(&mut self, mirror: NodeId, now: Duration, outcome: Outcome, latency: Duration, ping: bool) {
        self.rotate(now);
        self.know(mirror);
        let Some(agent) = self.agents.get_mut(&mirror) else { return };
        agent.dead = !outcome.answered();
        if outcome.answered() {
            agent.last_answer = Some(now);
        }
        let Some(front) = self.blocks.front_mut() else { return };
        let block = front.entry(mirror).or_default();
        match (outcome, ping) {
            (Outcome::Answered, true) => {
                block.pings += 1;
                block.ping_latency += latency;
            }
            (Outcome::Answered, false) => {
                block.requests += 1;
                block.successes += 1;
                block.latency += latency;
            }
            (failed, ping) => {
                if !ping {
                    block.requests += 1;
                }
                let e = &mut block.errors;
                match failed {
                    Outcome::Connect => e.connect += 1,
                    Outcome::Timeout => e.timeout += 1,
                    Outcome::Refused => e.refused += 1,
                    _ => e.wrong_answer += 1,
                }
            }
        }
    }

    /// Makes `mirror` known (it shows in the agent status; until it is measured it counts
    /// as an average mirror).
    pub fn know(&mut self, mirror: NodeId) {
        self.agents.entry(mirror).or_default();
    }

    /// Forgets the mirrors not in `members`.
    pub fn retain(&mut self, members: impl Fn(NodeId) -> bool) {
        self.agents.retain(|&id, _| members(id));
    }

    /// The blocks a choice looks at, at `now`: the newest, and the one before it until the
    /// newest is half full (so history stops mattering after at most one and a half periods).
    fn used_blocks(&self, now: Duration) -> impl Iterator<Item = &BTreeMap<NodeId, Block>> {
        let into_current = now.saturating_sub(self.start_of(self.current));
        let take = if into_current * 2 >= self.period { 1 } else { 2 };
        self.blocks.iter().take(take)
    }

    /// Whether `mirror` answered nothing (a read or a ping) within `interval` before `now`.
    pub fn idle(&self, mirror: NodeId, now: Duration, interval: Duration) -> bool {
        self.agents.get(&mirror).and_then(|a| a.last_answer).is_none_or(|t| now.saturating_sub(t) >= interval)
    }

    /// Whether `mirror`'s last answer failed.
    pub fn is_dead(&self, mirror: NodeId) -> bool {
        self.agents.get(&mirror).is_some_and(|a| a.dead)
    }

    /// Whether `mirror` had errors in the blocks used for choosing at `now`.
    pub fn has_errors(&self, mirror: NodeId, now: Duration) -> bool {
        self.used_blocks(now).any(|b| b.get(&mirror).is_some_and(|b| b.error_count() > 0))
    }

    /// The block whose latencies weigh the mirrors at `now`: the one that ended last until
    /// the newest is half full, then the newest (the probabilities are recomputed once per
    /// block from that block's statistics, and the previous block counts until the new one is
    /// half full).
    fn weighing_block(&self, now: Duration) -> Option<&BTreeMap<NodeId, Block>> {
        let into_current = now.saturating_sub(self.start_of(self.current));
        self.blocks.get(if into_current * 2 >= self.period { 0 } else { 1 })
    }

    /// The latency of `mirror` that weighs it at `now`, in milliseconds: of its reads, else
    /// of its pings, in the weighing block; None when neither was measured there.
    pub fn latency_ms(&self, mirror: NodeId, now: Duration) -> Option<f64> {
        self.weighing_block(now)?.get(&mirror)?.latency_ms()
    }

    /// The latency-weighted probabilities of `mirrors` among themselves at `now`.
    pub fn probabilities(&self, mirrors: &[NodeId], now: Duration) -> Vec<f64> {
        let latencies: Vec<Option<f64>> = mirrors.iter().map(|&m| self.latency_ms(m, now)).collect();
        weigh(&latencies)
    }

    /// Chooses one of `candidates` by `strategy` at `now`, with `draw` uniform in [0, 1) and
    /// `turn` the round-robin counter. None when the strategy excludes every candidate.
    pub fn choose(
        &self,
        strategy: Strategy,
        candidates: &[NodeId],
        now: Duration,
        draw: f64,
        turn: u64,
    ) -> Option<NodeId> {
        if candidates.is_empty() {
            return None;
        }
        let pick = |n: usize| ((draw * n as f64) as usize).min(n - 1);
        match strategy {
            Strategy::Random => Some(candidates[pick(candidates.len())]),
            Strategy::RoundRobin => Some(candidates[(turn % candidates.len() as u64) as usize]),
            Strategy::NoDeads | Strategy::NoErrors => {
                let eligible: Vec<NodeId> = candidates
                    .iter()
                    .copied()
                    .filter(|&m| !self.is_dead(m))
                    .filter(|&m| strategy != Strategy::NoErrors || !self.has_errors(m, now))
                    .collect();
                let probabilities = self.probabilities(&eligible, now);
                let mut acc = 0.0;
                for (m, p) in eligible.iter().zip(&probabilities) {
                    acc += p;
                    if draw < acc {
                        return Some(*m);
                    }
                }
                eligible.last().copied()
            }
        }
    }

    /// The agent-status view of every known mirror at `now`; each probability is among all
    /// known mirrors (a read weighs only the mirrors of its bucket).
    pub fn view(&self, now: Duration) -> Vec<AgentView> {
        let ids: Vec<NodeId> = self.agents.keys().copied().collect();
        let probabilities = self.probabilities(&ids, now);
        self.agents
            .iter()
            .zip(probabilities)
            .map(|((&id, a), probability)| AgentView {
                node_id: id,
                alive: !a.dead,
                probability,
                last_answer_ms_ago: a.last_answer.map(|t| now.saturating_sub(t).as_millis() as u64),
                blocks: self
                    .blocks
                    .iter()
                    .enumerate()
                    .map(|(age, b)| {
                        let began = self.start_of(self.current.saturating_sub(age as u64));
                        let b = b.get(&id).copied().unwrap_or_default();
                        let avg = |sum: Duration, n: u64| (n > 0).then(|| sum.as_secs_f64() * 1000.0 / n as f64);
                        KarmaBlockView {
                            began_ms_ago: now.saturating_sub(began).as_millis() as u64,
                            requests: b.requests,
                            successes: b.successes,
                            errors: b.errors,
                            avg_latency_ms: avg(b.latency, b.successes),
                            pings: b.pings,
                            ping_avg_latency_ms: avg(b.ping_latency, b.pings),
                        }
                    })
                    .collect(),
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::{prop_assert, proptest};

    const MS: Duration = Duration::from_millis(1);

    fn close(a: &[f64], b: &[f64]) -> bool {
        a.len() == b.len() && a.iter().zip(b).all(|(x, y)| (x - y).abs() < 0.005)
    }

    #[test]
    fn the_seeds_example_latencies_10_5_30_3_give_15_30_5_50_percent() {
        let p = weigh(&[Some(10.0), Some(5.0), Some(30.0), Some(3.0)]);
        assert!(close(&p, &[0.15, 0.30, 0.05, 0.50]), "{p:?}");
    }

    #[test]
    fn the_example_holds_through_the_karma_blocks() {
        let period = Duration::from_secs(60);
        let mut k = Karma::new(period);
        let all = [1, 2, 3, 4];
        for (id, ms) in [(1, 10), (2, 5), (3, 30), (4, 3)] {
            k.record(id, Duration::from_secs(10), Outcome::Answered, MS * ms, false);
        }
        // Equal while the first block is less than half full (no block weighs yet).
        assert!(close(&k.probabilities(&all, Duration::from_secs(20)), &[0.25; 4]));
        // The next block: the first one weighs until the new one is half full.
        k.rotate(period);
        let p = k.probabilities(&all, period);
        assert!(close(&p, &[0.15, 0.30, 0.05, 0.50]), "{p:?}");
        assert!(close(&k.probabilities(&all, period + Duration::from_secs(29)), &p));
        // Half full, the new block weighs: it measured nothing, so nothing of the first one
        // is left.
        let later = k.probabilities(&all, period + Duration::from_secs(30));
        assert!(close(&later, &[0.25; 4]), "{later:?}");
    }

    #[test]
    fn mirrors_are_weighed_among_themselves_not_against_a_faster_one_elsewhere() {
        let period = Duration::from_secs(1);
        let mut k = Karma::new(period);
        // This node reads from itself in microseconds; two remote mirrors take 1 and 10 ms.
        for _ in 0..100 {
            k.record(1, MS, Outcome::Answered, Duration::from_micros(5), false);
            k.record(2, MS, Outcome::Answered, MS, false);
            k.record(3, MS, Outcome::Answered, MS * 10, false);
        }
        let now = period;
        let p = k.probabilities(&[2, 3], now);
        assert!(close(&p, &[10.0 / 11.0, 1.0 / 11.0]), "{p:?}");
        let slow = (0..1000).filter(|i| k.choose(Strategy::NoDeads, &[2, 3], now, *i as f64 / 1000.0, 0) == Some(3));
        assert_eq!(slow.count(), 90);
    }

    #[test]
    fn blocks_rotate_keep_fifteen_and_count_by_kind() {
        let period = Duration::from_secs(1);
        let mut k = Karma::new(period);
        for s in 0..20u64 {
            k.record(7, Duration::from_secs(s), Outcome::Answered, MS, false);
            k.record(7, Duration::from_secs(s), Outcome::Timeout, MS, false);
            k.record(7, Duration::from_secs(s), Outcome::Answered, MS * 2, true);
        }
        let view = k.view(Duration::from_millis(19_500));
        let blocks = &view[0].blocks;
        assert_eq!(blocks.len(), KEPT_BLOCKS);
        assert_eq!(blocks[0].began_ms_ago, 500);
        assert_eq!(blocks[1].began_ms_ago, 1500);
        assert!(blocks.iter().all(|b| b.requests == 2 && b.successes == 1 && b.errors.timeout == 1 && b.pings == 1));
        assert_eq!(blocks[0].avg_latency_ms, Some(1.0));
        assert_eq!(blocks[0].ping_avg_latency_ms, Some(2.0));
        // The last answer was a ping's: alive.
        assert!(view[0].alive);
        // A long silence starts afresh: the kept blocks are empty, the newest at `now`.
        k.rotate(Duration::from_secs(100));
        let view = k.view(Duration::from_secs(100));
        assert_eq!(view[0].blocks.len(), KEPT_BLOCKS);
        assert!(view[0].blocks.iter().all(|b| b.requests == 0 && b.pings == 0));
    }

    #[test]
    fn the_previous_block_counts_until_the_new_one_is_half_full() {
        let period = Duration::from_secs(10);
        let mut k = Karma::new(period);
        k.record(2, Duration::from_secs(8), Outcome::Refused, MS, false);
        k.record(2, Duration::from_secs(9), Outcome::Answered, MS, false);
        assert!(k.has_errors(2, Duration::from_secs(9)));
        k.rotate(Duration::from_secs(11));
        assert!(k.has_errors(2, Duration::from_secs(14)), "the new block is not half full yet");
        assert!(!k.has_errors(2, Duration::from_secs(15)), "at half full only the new block counts");
    }

    #[test]
    fn each_strategy_chooses_as_it_says() {
        let mut k = Karma::new(Duration::from_secs(60));
        let now = Duration::from_secs(1);
        for id in [1, 2, 3] {
            k.know(id);
        }
        let all = [1, 2, 3];
        // Random: uniform by the draw, whatever the state.
        k.record(2, now, Outcome::Connect, MS, false);
        assert_eq!(k.choose(Strategy::Random, &all, now, 0.0, 0), Some(1));
        assert_eq!(k.choose(Strategy::Random, &all, now, 0.5, 0), Some(2));
        assert_eq!(k.choose(Strategy::Random, &all, now, 0.99, 0), Some(3));
        // Round robin: in turn.
        assert_eq!([0, 1, 2, 3].map(|t| k.choose(Strategy::RoundRobin, &all, now, 0.5, t)), [1, 2, 3, 1].map(Some));
        // No deads: node 2 is dead, so the draw spreads over 1 and 3 only.
        assert_eq!(k.choose(Strategy::NoDeads, &all, now, 0.49, 0), Some(1));
        assert_eq!(k.choose(Strategy::NoDeads, &all, now, 0.51, 0), Some(3));
        assert_eq!(k.choose(Strategy::NoDeads, &[2], now, 0.5, 0), None);
        // Node 2 answers again (a ping): alive, but it had an error in the used blocks.
        k.record(2, now, Outcome::Answered, MS, true);
        assert!(!k.is_dead(2));
        assert_eq!(k.choose(Strategy::NoDeads, &[2], now, 0.5, 0), Some(2));
        assert_eq!(k.choose(Strategy::NoErrors, &[2, 3], now, 0.1, 0), Some(3));
        assert_eq!(k.choose(Strategy::NoErrors, &[2], now, 0.1, 0), None);
    }

    #[test]
    fn an_unmeasured_mirror_is_as_likely_as_an_average_one_and_a_slow_one_never_reaches_zero() {
        let period = Duration::from_secs(1);
        let mut k = Karma::new(period);
        k.record(1, MS, Outcome::Answered, MS, false);
        k.record(2, MS, Outcome::Answered, MS * 1000, false);
        let p = k.probabilities(&[1, 2, 3], period);
        assert!(p[1] > 0.0 && p[1] < 0.001, "{p:?}");
        assert!((p[2] - 1.0 / 3.0).abs() < 1e-9, "{p:?}");
    }

    #[test]
    fn latency_weights_make_the_fast_mirror_likelier() {
        let period = Duration::from_secs(1);
        let mut k = Karma::new(period);
        k.record(1, MS, Outcome::Answered, MS, false);
        k.record(2, MS, Outcome::Answered, MS * 4, false);
        k.rotate(period);
        let p = k.probabilities(&[1, 2], period);
        assert!((p[0] - 0.8).abs() < 1e-9 && (p[1] - 0.2).abs() < 1e-9, "{p:?}");
        let share = (0..1000)
            .filter(|i| k.choose(Strategy::NoDeads, &[1, 2], period, *i as f64 / 1000.0, 0) == Some(2))
            .count();
        assert_eq!(share, 200);
    }

    #[test]
    fn a_mirror_is_idle_once_it_answered_nothing_for_an_interval() {
        let mut k = Karma::new(Duration::from_secs(60));
        let second = Duration::from_secs(1);
        assert!(k.idle(1, Duration::ZERO, second), "never heard from");
        k.record(1, second, Outcome::Answered, MS, true);
        assert!(!k.idle(1, second + 999 * MS, second));
        assert!(k.idle(1, second * 2, second));
        // A failed answer is no answer.
        k.record(1, second * 2, Outcome::Timeout, MS, false);
        assert!(k.idle(1, second * 2, second));
    }

    proptest! {
        /// Three mirrors read in turn, every `step`; the last one is `slow_factor` times slower
        /// for a while, then as fast as the others again. From one and a half blocks after it
        /// recovered, it is as likely as the others, however long it was slow.
        #[test]
        fn a_mirror_back_to_normal_latency_gets_its_fair_share_within_one_and_a_half_blocks(
            period_ms in 100u64..5_000,
            steps_per_period in 4u64..40,
            slow_from in 0u64..4_000,
            slow_blocks in 0.1f64..20.0,
            slow_factor in 2.0f64..1000.0,
            normal_ms in 0.01f64..50.0,
            jitter in 0.0f64..0.02,
        ) {
            let period = Duration::from_millis(period_ms);
            let step = period / steps_per_period as u32;
            let slow_from = Duration::from_millis(slow_from);
            let recovered = slow_from + period.mul_f64(slow_blocks);
            let settled = recovered + period.mul_f64(1.5);
            let mut k = Karma::new(period);
            let mut now = Duration::ZERO;
            let mut checked = 0;
            while now < settled + period * 3 {
                for (i, id) in [1u64, 2, 3].into_iter().enumerate() {
                    // Equal latencies but for a little deterministic jitter.
                    let mut ms = normal_ms * (1.0 + jitter * i as f64);
                    if id == 3 && now >= slow_from && now < recovered {
                        ms *= slow_factor;
                    }
                    k.record(id, now, Outcome::Answered, Duration::from_secs_f64(ms / 1000.0), false);
                }
                now += step;
                if now >= settled {
                    let p = k.probabilities(&[1, 2, 3], now);
                    prop_assert!(p[2] > 0.3, "at {now:?} (recovered at {recovered:?}): {p:?}");
                    checked += 1;
                }
            }
            prop_assert!(checked > 0);
        }
    }
}
