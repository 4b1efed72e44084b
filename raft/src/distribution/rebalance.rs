//! Making the next map: an equal split by count that moves as few buckets as possible.
//!
//! With `n` members every member gets `1000 / n` buckets and `1000 % n` of them get one more,
//! so counts never differ by more than one. The members that keep the extra bucket are the
//! ones that already hold the most (they need not give any up); the buckets that move are the
//! buckets of departed owners plus each member's excess over its target, and they go to the
//! members below target. Joining the Nth node therefore moves about `1000 / N` buckets, all of
//! them to the new node, and removing a node moves only that node's buckets.

use std::collections::BTreeMap;

use super::{DistributionMap, NodeId, BUCKET_COUNT};

/// The bucket count each member should own after a rebalance from `prev`.
///
/// `members` is in join order; ties are broken by it so the result is deterministic.
pub fn target_counts(prev: &DistributionMap, members: &[NodeId]) -> BTreeMap<NodeId, usize> {
    let n = members.len();
    if n == 0 {
        return BTreeMap::new();
    }
    let base = BUCKET_COUNT / n;
    let extra = BUCKET_COUNT % n;
    let held = prev.counts();
    let held_by = |m: &NodeId| held.get(m).copied().unwrap_or(0);
    // Who keeps a "+1": first members already above base (most first) since each of them
    // saves a move; then the members that are receiving anyway (fewest first), so that a
    // join sends every moved bucket to the newcomer.
    let mut order: Vec<(usize, NodeId)> = members.iter().copied().enumerate().collect();
    order.sort_by_key(|&(join_pos, m)| {
        let c = held_by(&m);
        if c > base {
            (0, usize::MAX - c, join_pos)
        } else {
            (1, c, join_pos)
        }
    });
    order.iter().enumerate().map(|(rank, &(_, m))| (m, base + usize::from(rank < extra))).collect()
}

/// The least number of buckets any equal split of `members` must move away from `prev`:
/// the buckets of non-members, plus, for every member, what it holds above `base + 1`, plus
/// the members at `base + 1` or more beyond the `1000 % n` that may keep an extra bucket.
pub fn minimum_moves(prev: &DistributionMap, members: &[NodeId]) -> usize {
    let n = members.len();
    if n == 0 {
        return 0;
    }
    if prev.is_empty() {
        return BUCKET_COUNT;
    }
    let (base, extra) = (BUCKET_COUNT / n, BUCKET_COUNT % n);
    let held = prev.counts();
    let orphans: usize = held.iter().filter(|(m, _)| !members.contains(m)).map(|(_, c)| c).sum();
    let counts: Vec<usize> = members.iter().map(|m| held.get(m).copied().unwrap_or(0)).collect();
    let above: usize = counts.iter().map(|&c| c.saturating_sub(base + 1)).sum();
    let at_least_plus_one = counts.iter().filter(|&&c| c > base).count();
    orphans + above + at_least_plus_one.saturating_sub(extra)
}

/// The next map after `prev` for `members` (in join order), with `version = prev.version + 1`.
///
/// Each member ends with its [`target_counts`]; a bucket changes owner only if its owner left
/// or holds more than its target, so exactly [`minimum_moves`] buckets move. Which of an
/// over-full member's buckets move is deterministic (its highest-numbered ones), as is who
/// receives them (lowest-numbered free buckets to the earliest-joined member below target).
/// An empty `members` gives an empty map.
pub fn rebalance(prev: &DistributionMap, members: &[NodeId]) -> DistributionMap {
    let version = prev.version + 1;
    if members.is_empty() {
        return DistributionMap { version, owners: Vec::new() };
    }
    let targets = target_counts(prev, members);
    let mut owners: Vec<Option<NodeId>> = if prev.is_empty() {
        vec![None; BUCKET_COUNT]
    } else {
        prev.owners.iter().map(|o| targets.contains_key(o).then_some(*o)).collect()
    };
    // Keep each member's lowest-numbered buckets up to its target; free the rest, so the
    // highest-numbered ones move and a member's low buckets stay put across changes.
    let mut kept: BTreeMap<NodeId, usize> = BTreeMap::new();
    for owner in owners.iter_mut() {
        if let Some(m) = *owner {
            let k = kept.entry(m).or_insert(0);
            if *k < targets[&m] {
                *k += 1;
            } else {
                *owner = None;
            }
        }
    }
    // Fill the free buckets, in order, to members below target, in join order.
    let mut deficits: Vec<(NodeId, usize)> =
        members.iter().map(|m| (*m, targets[m] - kept.get(m).copied().unwrap_or(0))).filter(|&(_, d)| d > 0).collect();
    let mut next = 0;
    for owner in owners.iter_mut().filter(|o| o.is_none()) {
        while deficits[next].1 == 0 {
            next += 1;
        }
        *owner = Some(deficits[next].0);
        deficits[next].1 -= 1;
    }
    DistributionMap { version, owners: owners.into_iter().map(|o| o.unwrap_or_default()).collect() }
}
