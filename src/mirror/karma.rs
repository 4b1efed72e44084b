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
#[derive(Debug, Clone, PartialEq)]
struct Agent {
    /// Whether its last answer came.
    alive: bool,
    /// Its latency weight (before normalising over the mirrors a choice is among).
    weight: f64,
    /// When it last answered.
    last_answer: Option<Duration>,
}

impl Default for Agent {
    fn default() -> Self {
        Agent { alive: true, weight: 1.0, last_answer: None }
    }
}

/// Rescales `weights` by the inverse of each mirror's latency over the last period and
/// normalises them to sum 1. A mirror without a measurement keeps its place: it is scaled by
/// the inverse of the mean latency of the measured ones.
pub fn reweigh(weights: &[f64], latencies_ms: &[Option<f64>]) -> Vec<f64> {
    let measured: Vec<f64> = latencies_ms.iter().flatten().map(|l| l.max(1e-6)).collect();
    if measured.is_empty() {
        return normalise(weights);
    }
    let mean = measured.iter().sum::<f64>() / measured.len() as f64;
    let scaled: Vec<f64> = weights.iter().zip(latencies_ms).map(|(w, l)| w / l.map_or(mean, |l| l.max(1e-6))).collect();
    normalise(&scaled)
}

fn normalise(weights: &[f64]) -> Vec<f64> {
    let sum: f64 = weights.iter().sum();
    if sum <= 0.0 || !sum.is_finite() {
        return vec![1.0 / weights.len().max(1) as f64; weights.len()];
    }
    weights.iter().map(|w| w / sum).collect()
}

/// The least weight a mirror keeps, relative to the sum: weights compound from period to
/// period, and one that reached zero could never come back.
const LEAST_WEIGHT: f64 = 1e-4;

/// The statistics of every mirror, in blocks of `period`.
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

    /// Starts the blocks that began by `now`; at the end of each block the weights are
    /// recomputed from the latencies it measured (once per period).
    pub fn rotate(&mut self, now: Duration) {
        let index = self.index_at(now);
        while self.current < index {
            let ended = self.blocks.front().cloned().unwrap_or_default();
            self.reweigh_from(&ended);
            self.current += 1;
            self.blocks.push_front(BTreeMap::new());
            self.blocks.truncate(KEPT_BLOCKS);
            // Skip the empty periods in between at once: they change no weight.
            if index - self.current > KEPT_BLOCKS as u64 {
                self.current = index - KEPT_BLOCKS as u64;
            }
        }
    }

    fn reweigh_from(&mut self, block: &BTreeMap<NodeId, Block>) {
        let ids: Vec<NodeId> = self.agents.keys().copied().collect();
        if ids.is_empty() {
            return;
        }
        let weights: Vec<f64> = ids.iter().map(|id| self.agents[id].weight).collect();
        let latencies: Vec<Option<f64>> = ids.iter().map(|id| block.get(id).and_then(Block::latency_ms)).collect();
        let floored: Vec<f64> = reweigh(&weights, &latencies).into_iter().map(|w| w.max(LEAST_WEIGHT)).collect();
        for (id, w) in ids.iter().zip(normalise(&floored)) {
            if let Some(a) = self.agents.get_mut(id) {
                a.weight = w;
            }
        }
    }

    /// Records how a read (or, with `ping`, a ping) sent to `mirror` ended after `latency`.
    /// The dead flag follows every answer, pings included.
    pub fn record(&mut self, mirror: NodeId, now: Duration, outcome: Outcome, latency: Duration, ping: bool) {
        self.rotate(now);
        self.know(mirror);
        let Some(agent) = self.agents.get_mut(&mirror) else { return };
        agent.alive = outcome.answered();
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

    /// Makes `mirror` known (it takes part in the weights from now on, starting at the mean
    /// weight of the others: as likely as an average mirror).
    pub fn know(&mut self, mirror: NodeId) {
        if self.agents.contains_key(&mirror) {
            return;
        }
        let mean = if self.agents.is_empty() {
            1.0
        } else {
            self.agents.values().map(|a| a.weight).sum::<f64>() / self.agents.len() as f64
        };
        self.agents.insert(mirror, Agent { weight: mean, ..Agent::default() });
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

    /// Whether `mirror`'s last answer failed.
    pub fn is_dead(&self, mirror: NodeId) -> bool {
        self.agents.get(&mirror).is_some_and(|a| !a.alive)
    }

    /// Whether `mirror` had errors in the blocks used for choosing at `now`.
    pub fn has_errors(&self, mirror: NodeId, now: Duration) -> bool {
        self.used_blocks(now).any(|b| b.get(&mirror).is_some_and(|b| b.error_count() > 0))
    }

    /// `mirror`'s weight, normalised over every known mirror.
    pub fn probability(&self, mirror: NodeId) -> f64 {
        let sum: f64 = self.agents.values().map(|a| a.weight).sum();
        match self.agents.get(&mirror) {
            Some(a) if sum > 0.0 => a.weight / sum,
            _ => 0.0,
        }
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
                let weights: Vec<f64> = eligible.iter().map(|m| self.agents.get(m).map_or(1.0, |a| a.weight)).collect();
                let probabilities = normalise(&weights);
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

    /// The agent-status view of every known mirror at `now`.
    pub fn view(&self, now: Duration) -> Vec<AgentView> {
        self.agents
            .iter()
            .map(|(&id, a)| AgentView {
                node_id: id,
                alive: a.alive,
                probability: self.probability(id),
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

    const MS: Duration = Duration::from_millis(1);

    fn close(a: &[f64], b: &[f64]) -> bool {
        a.len() == b.len() && a.iter().zip(b).all(|(x, y)| (x - y).abs() < 0.005)
    }

    #[test]
    fn the_seeds_example_latencies_10_5_30_3_give_15_30_5_50_percent() {
        let weights = [0.25; 4];
        let latencies = [Some(10.0), Some(5.0), Some(30.0), Some(3.0)];
        let p = reweigh(&weights, &latencies);
        assert!(close(&p, &[0.15, 0.30, 0.05, 0.50]), "{p:?}");
    }

    #[test]
    fn the_example_holds_through_the_karma_blocks() {
        let period = Duration::from_secs(60);
        let mut k = Karma::new(period);
        for (id, ms) in [(1, 10), (2, 5), (3, 30), (4, 3)] {
            k.record(id, Duration::from_secs(10), Outcome::Answered, MS * ms, false);
        }
        // Equal until the first period ends.
        assert!(close(&[1, 2, 3, 4].map(|id| k.probability(id)), &[0.25; 4]));
        k.rotate(period);
        let p = [1, 2, 3, 4].map(|id| k.probability(id));
        assert!(close(&p, &[0.15, 0.30, 0.05, 0.50]), "{p:?}");
        // A period without measurements changes nothing.
        k.rotate(period * 2);
        let again = [1, 2, 3, 4].map(|id| k.probability(id));
        assert!(close(&again, &p), "{again:?}");
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
    fn a_new_mirror_starts_as_likely_as_an_average_one_and_a_slow_one_never_reaches_zero() {
        let period = Duration::from_secs(1);
        let mut k = Karma::new(period);
        k.record(1, MS, Outcome::Answered, MS, false);
        k.record(2, MS, Outcome::Answered, MS * 1000, false);
        for n in 1..40u32 {
            k.record(1, period * n, Outcome::Answered, MS, false);
            k.record(2, period * n, Outcome::Answered, MS * 1000, false);
        }
        k.rotate(period * 40);
        assert!(k.probability(2) > 0.0 && k.probability(2) < 0.001, "{}", k.probability(2));
        k.know(3);
        let (p1, p2, p3) = (k.probability(1), k.probability(2), k.probability(3));
        assert!((p3 - (p1 + p2 + p3) / 3.0).abs() < 1e-9, "{p1} {p2} {p3}");
    }

    #[test]
    fn latency_weights_make_the_fast_mirror_likelier() {
        let period = Duration::from_secs(1);
        let mut k = Karma::new(period);
        k.record(1, MS, Outcome::Answered, MS, false);
        k.record(2, MS, Outcome::Answered, MS * 4, false);
        k.rotate(period);
        assert!((k.probability(1) - 0.8).abs() < 1e-9 && (k.probability(2) - 0.2).abs() < 1e-9);
        let share = (0..1000)
            .filter(|i| k.choose(Strategy::NoDeads, &[1, 2], period, *i as f64 / 1000.0, 0) == Some(2))
            .count();
        assert_eq!(share, 200);
    }
}
