//! Balancing by data: a map in which every member holds nearly the same bytes, reached by
//! moving as few bytes as possible.
//!
//! Joins, leaves and failures split the buckets by their bytes when the leader recorded them
//! ([`rebalance_by_size`]), else equally by count ([`super::rebalance()`]); a hot `{tag}` or a
//! few large values can still leave one member far fuller than the others. Given how many
//! bytes each bucket holds (the members report it), [`balance`] moves buckets from the
//! fullest members to the emptiest until every member is within [`BALANCE_TOLERANCE`] of the
//! average, and [`balance_node`] brings one member to the average.
//!
//! The planner is greedy and never overshoots: a bucket moves from a member above the average
//! to the emptiest member only if neither ends on the other side of the average, and the
//! largest such bucket goes first. So no member that receives ever gives, no bucket moves
//! twice, and the bytes moved never exceed what the members hold above the average. Buckets
//! too coarse for that (one bucket larger than the gap) get at most one move per member that
//! still narrows the spread. Every move narrows the spread between the member it leaves and
//! the one it reaches, so the fullest member never gets fuller and the emptiest never emptier.

use std::collections::BTreeMap;

use super::{BucketId, DistributionMap, NodeId, BUCKET_COUNT};

/// How far from the average a member may stay: 5%, so the fullest member holds at most
/// about 1.1 times what the emptiest holds when the buckets are fine enough.
pub const BALANCE_TOLERANCE: f64 = 0.05;

/// A bucket a balanced map moves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BalanceMove {
    /// The bucket.
    pub bucket: BucketId,
    /// Its owner now.
    pub from: NodeId,
    /// Its owner in the balanced map.
    pub to: NodeId,
    /// The bytes it holds.
    pub bytes: u64,
}

/// The bytes each member holds on `map`, given each bucket's bytes (`sizes[b]`, missing ones
/// count 0). Every member is present, with 0 if it owns nothing.
pub fn loads(map: &DistributionMap, members: &[NodeId], sizes: &[u64]) -> BTreeMap<NodeId, u64> {
    let mut loads: BTreeMap<NodeId, u64> = members.iter().map(|&m| (m, 0)).collect();
    for (b, owner) in map.owners.iter().enumerate() {
        if let Some(load) = loads.get_mut(owner) {
            *load += size_of(sizes, b);
        }
    }
    loads
}

/// The fullest member's bytes over the emptiest's: 1.0 when balanced (or when there is no
/// data), infinite when a member holds nothing while another holds data.
pub fn balance_ratio(loads: &BTreeMap<NodeId, u64>) -> f64 {
    let (Some(&max), Some(&min)) = (loads.values().max(), loads.values().min()) else { return 1.0 };
    match (max, min) {
        (0, _) => 1.0,
        (_, 0) => f64::INFINITY,
        (max, min) => max as f64 / min as f64,
    }
}

/// The least bytes any map must move away from `prev` to leave its fullest member no fuller
/// than `next` leaves it: every bucket of a non-member, and what each member holds above
/// that. A true lower bound of what `next` moves, also when buckets are too coarse for the
/// tolerance (one bucket larger than a member's share keeps its holder above the average).
pub fn balance_lower_bound(prev: &DistributionMap, next: &DistributionMap, members: &[NodeId], sizes: &[u64]) -> u64 {
    if members.is_empty() || prev.is_empty() {
        return 0;
    }
    let fullest = loads(next, members, sizes).values().copied().max().unwrap_or(0);
    let loads = loads(prev, members, sizes);
    let total: u64 = (0..BUCKET_COUNT).map(|b| size_of(sizes, b)).sum();
    let orphans = total - loads.values().sum::<u64>();
    orphans + loads.values().map(|&l| l.saturating_sub(fullest)).sum::<u64>()
}

/// The next map after `prev` for `members` (in join order) when each bucket's bytes are
/// known (`sizes`): the buckets of departed members go to the emptiest members, largest
/// first; then buckets move from the fullest members to the emptiest until every member holds
/// nearly the same bytes, as [`balance`] does; then empty buckets even out the counts (bucket
/// count is the tie-breaker: keys yet to be written hash uniformly). Without data, the equal
/// split by count ([`super::rebalance()`]). A join moves about a member's share of the bytes
/// to the joiner, a leave or failure the departed member's buckets and no more than the
/// balance needs.
pub fn rebalance_by_size(prev: &DistributionMap, members: &[NodeId], sizes: &[u64]) -> DistributionMap {
    let total: u64 = (0..BUCKET_COUNT).map(|b| size_of(sizes, b)).sum();
    if total == 0 || prev.is_empty() || members.is_empty() {
        return super::rebalance(prev, members);
    }
    let mut next = balance(prev, members, sizes);
    even_counts(&mut next, members, sizes);
    next
}

/// Moves empty buckets from the members owning the most buckets to those owning the fewest
/// until counts differ by at most one (or no member above the rest has an empty bucket left):
/// the bytes each member holds do not change.
fn even_counts(map: &mut DistributionMap, members: &[NodeId], sizes: &[u64]) {
    let mut counts: BTreeMap<NodeId, usize> = members.iter().map(|&m| (m, 0)).collect();
    for o in &map.owners {
        if let Some(c) = counts.get_mut(o) {
            *c += 1;
        }
    }
    // The earliest joined first among equals, so the result is deterministic.
    let pos = |m: NodeId| members.iter().position(|&x| x == m).unwrap_or(usize::MAX);
    loop {
        let most = members.iter().copied().max_by_key(|&m| (counts[&m], std::cmp::Reverse(pos(m))));
        let fewest = members.iter().copied().min_by_key(|&m| (counts[&m], pos(m)));
        let (Some(most), Some(fewest)) = (most, fewest) else { return };
        if counts[&most] <= counts[&fewest] + 1 {
            return;
        }
        // Its highest-numbered empty bucket, so that low buckets stay put, as an equal split keeps them.
        let Some(b) = (0..BUCKET_COUNT).rev().find(|&b| map.owners[b] == most && size_of(sizes, b) == 0) else {
            return;
        };
        map.owners[b] = fewest;
        *counts.get_mut(&most).expect("member") -= 1;
        *counts.get_mut(&fewest).expect("member") += 1;
    }
}

/// The moves that turn `prev` into `next`, in bucket order, with each bucket's bytes.
pub fn moves_between(prev: &DistributionMap, next: &DistributionMap, sizes: &[u64]) -> Vec<BalanceMove> {
    prev.moved_buckets(next)
        .into_iter()
        .filter_map(|b| {
            let (from, to) = (prev.owner_of(b)?, next.owner_of(b)?);
            Some(BalanceMove { bucket: b, from, to, bytes: size_of(sizes, b.index()) })
        })
        .collect()
}

/// A map after `prev` (version + 1) in which every member of `members` (in join order) holds
/// nearly the same bytes, moving as few as possible (see the module docs). Buckets of
/// non-members go to the emptiest members first, largest first.
pub fn balance(prev: &DistributionMap, members: &[NodeId], sizes: &[u64]) -> DistributionMap {
    let Some(mut plan) = Planner::new(prev, members, sizes) else {
        return DistributionMap { version: prev.version + 1, owners: prev.owners.clone() };
    };
    while !plan.within_tolerance() {
        let Some(to) = plan.emptiest() else { break };
        let donors = plan.by_load_descending();
        let found = donors.iter().find_map(|&from| plan.best_fit(from, to).map(|b| (b, from)));
        match found {
            Some((b, from)) => plan.give(b, from, to),
            None => {
                if !plan.coarse_move() {
                    break;
                }
            }
        }
    }
    plan.into_map(prev.version + 1)
}

/// A map after `prev` (version + 1) in which member `node` holds about the average bytes:
/// its buckets go to the emptiest members while it holds more, or the fullest members'
/// buckets come to it while it holds less. Other members change only by what it gives or
/// takes.
pub fn balance_node(prev: &DistributionMap, members: &[NodeId], sizes: &[u64], node: NodeId) -> DistributionMap {
    let Some(mut plan) = Planner::new(prev, members, sizes).filter(|_| members.contains(&node)) else {
        return DistributionMap { version: prev.version + 1, owners: prev.owners.clone() };
    };
    let mut coarse = 0;
    while (plan.load(node) as f64 - plan.avg).abs() > plan.avg * BALANCE_TOLERANCE {
        let above = plan.load(node) as f64 > plan.avg;
        let pair = if above {
            plan.emptiest_except(node).map(|to| (node, to))
        } else {
            plan.by_load_descending().into_iter().find(|&m| m != node).map(|from| (from, node))
        };
        let Some((from, to)) = pair else { break };
        match plan.best_fit(from, to) {
            Some(b) => plan.give(b, from, to),
            None if coarse < 1 => match plan.closer(from, to, node) {
                Some(b) => {
                    coarse += 1;
                    plan.give(b, from, to);
                }
                None => break,
            },
            None => break,
        }
    }
    plan.into_map(prev.version + 1)
}

fn size_of(sizes: &[u64], bucket: usize) -> u64 {
    sizes.get(bucket).copied().unwrap_or(0)
}

/// The working state of a plan: owners, each member's bytes, the average.
struct Planner<'a> {
    members: &'a [NodeId],
    sizes: &'a [u64],
    owners: Vec<NodeId>,
    loads: BTreeMap<NodeId, u64>,
    avg: f64,
    /// Moves allowed to overshoot the average (one bucket larger than the gap), used so far.
    coarse: usize,
}

impl<'a> Planner<'a> {
    fn new(prev: &DistributionMap, members: &'a [NodeId], sizes: &'a [u64]) -> Option<Self> {
        if members.is_empty() || prev.is_empty() {
            return None;
        }
        let total: u64 = (0..BUCKET_COUNT).map(|b| size_of(sizes, b)).sum();
        let mut plan = Planner {
            members,
            sizes,
            owners: prev.owners.clone(),
            loads: loads(prev, members, sizes),
            avg: total as f64 / members.len() as f64,
            coarse: 0,
        };
        // Buckets of non-members (none, unless the map is behind a membership change) go to
        // the emptiest members, largest first.
        let mut orphans: Vec<usize> = (0..BUCKET_COUNT).filter(|&b| !members.contains(&plan.owners[b])).collect();
        orphans.sort_by_key(|&b| (std::cmp::Reverse(size_of(sizes, b)), b));
        for b in orphans {
            let to = plan.emptiest().expect("members");
            plan.owners[b] = to;
            *plan.loads.get_mut(&to).expect("member") += size_of(sizes, b);
        }
        Some(plan)
    }

    fn load(&self, m: NodeId) -> u64 {
        self.loads.get(&m).copied().unwrap_or(0)
    }

    fn within_tolerance(&self) -> bool {
        let high = self.avg * (1.0 + BALANCE_TOLERANCE);
        let low = self.avg * (1.0 - BALANCE_TOLERANCE);
        self.loads.values().all(|&l| (l as f64) <= high && (l as f64) >= low)
    }

    /// The member holding the least bytes (the one owning the fewest buckets, then the
    /// earliest joined, among equals).
    fn emptiest(&self) -> Option<NodeId> {
        self.members.iter().copied().min_by_key(|&m| (self.load(m), self.owners.iter().filter(|&&o| o == m).count()))
    }

    fn emptiest_except(&self, node: NodeId) -> Option<NodeId> {
        self.members.iter().copied().filter(|&m| m != node).min_by_key(|&m| self.load(m))
    }

    /// Members, fullest first (earlier joined first among equals).
    fn by_load_descending(&self) -> Vec<NodeId> {
        let mut order: Vec<(usize, NodeId)> = self.members.iter().copied().enumerate().collect();
        order.sort_by_key(|&(pos, m)| (std::cmp::Reverse(self.load(m)), pos));
        order.into_iter().map(|(_, m)| m).collect()
    }

    /// The largest bucket of `from` that `to` can take with neither crossing the average
    /// (the lowest-numbered among equals), if any.
    fn best_fit(&self, from: NodeId, to: NodeId) -> Option<usize> {
        let room = (self.load(from) as f64 - self.avg).min(self.avg - self.load(to) as f64);
        if room < 1.0 {
            return None;
        }
        let room = room.floor() as u64;
        (0..BUCKET_COUNT)
            .filter(|&b| self.owners[b] == from)
            .map(|b| (size_of(self.sizes, b), b))
            .filter(|&(s, _)| s > 0 && s <= room)
            .max_by_key(|&(s, b)| (s, std::cmp::Reverse(b)))
            .map(|(_, b)| b)
    }

    /// The bucket of `from` whose move to `to` leaves the two closest together, if it
    /// narrows their gap at all (it is smaller than the gap).
    fn narrowing(&self, from: NodeId, to: NodeId) -> Option<usize> {
        let (f, t) = (self.load(from), self.load(to));
        let gap = f.checked_sub(t)?;
        (0..BUCKET_COUNT)
            .filter(|&b| self.owners[b] == from)
            .map(|b| (size_of(self.sizes, b), b))
            .filter(|&(s, _)| s > 0 && s < gap)
            .min_by_key(|&(s, b)| ((gap as i128 - 2 * s as i128).unsigned_abs(), b))
            .map(|(_, b)| b)
    }

    /// The bucket of `from` whose move to `to` brings `node` (one of the two) closest to the
    /// average, if it brings it closer at all and narrows the gap between the two.
    fn closer(&self, from: NodeId, to: NodeId, node: NodeId) -> Option<usize> {
        let gap = self.load(from).checked_sub(self.load(to))?;
        let distance = |load: f64| (load - self.avg).abs();
        let now = distance(self.load(node) as f64);
        let after = |s: u64| {
            let l = self.load(node) as f64;
            distance(if node == from { l - s as f64 } else { l + s as f64 })
        };
        (0..BUCKET_COUNT)
            .filter(|&b| self.owners[b] == from)
            .map(|b| (size_of(self.sizes, b), b))
            .filter(|&(s, _)| s > 0 && s < gap && after(s) < now)
            .min_by(|&(a, x), &(b, y)| after(a).total_cmp(&after(b)).then(x.cmp(&y)))
            .map(|(_, b)| b)
    }

    /// One move allowed to overshoot the average, from the fullest member to the emptiest,
    /// at most once per member; false when none is left or none narrows the spread.
    fn coarse_move(&mut self) -> bool {
        if self.coarse >= self.members.len() {
            return false;
        }
        let (Some(&from), Some(to)) = (self.by_load_descending().first(), self.emptiest()) else { return false };
        match self.narrowing(from, to) {
            Some(b) => {
                self.coarse += 1;
                self.give(b, from, to);
                true
            }
            None => false,
        }
    }

    fn give(&mut self, bucket: usize, from: NodeId, to: NodeId) {
        let s = size_of(self.sizes, bucket);
        self.owners[bucket] = to;
        *self.loads.get_mut(&from).expect("member") -= s;
        *self.loads.get_mut(&to).expect("member") += s;
    }

    fn into_map(self, version: u64) -> DistributionMap {
        DistributionMap { version, owners: self.owners }
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn split(members: &[NodeId]) -> DistributionMap {
        super::super::rebalance(&DistributionMap::default(), members)
    }

    fn sizes_strategy() -> impl Strategy<Value = Vec<u64>> {
        prop_oneof![
            // Even-ish data.
            proptest::collection::vec(0u64..2_000, BUCKET_COUNT),
            // Skewed: a few buckets hold most of it.
            proptest::collection::vec(prop_oneof![9 => 0u64..100, 1 => 10_000u64..1_000_000], BUCKET_COUNT),
        ]
    }

    #[test]
    fn a_hot_bucket_is_balanced_by_moving_small_ones_away_from_its_owner() {
        let members = [1, 2, 3];
        let map = split(&members);
        let mut sizes = vec![100u64; BUCKET_COUNT];
        sizes[0] = 42_000; // one hot {tag}: 30% of the data, on node 1
        let before = loads(&map, &members, &sizes);
        assert!(balance_ratio(&before) > 1.5, "{before:?}");
        let next = balance(&map, &members, &sizes);
        let after = loads(&next, &members, &sizes);
        assert!(balance_ratio(&after) <= 1.15, "{after:?}");
        assert_eq!(next.owner_of(BucketId(0)), Some(1), "the hot bucket stays where it is");
        let moved: u64 = moves_between(&map, &next, &sizes).iter().map(|m| m.bytes).sum();
        assert!(moved >= balance_lower_bound(&map, &next, &members, &sizes));
        assert!(moves_between(&map, &next, &sizes).iter().all(|m| m.from == 1), "only the full node gives");
    }

    #[test]
    fn one_node_is_brought_to_the_average_and_the_others_only_take() {
        let members = [1, 2, 3, 4];
        let map = split(&members);
        let mut sizes = vec![10u64; BUCKET_COUNT];
        for s in sizes.iter_mut().take(250) {
            *s = 50; // node 1 holds five times the others
        }
        let next = balance_node(&map, &members, &sizes, 1);
        let after = loads(&next, &members, &sizes);
        let avg = sizes.iter().sum::<u64>() as f64 / 4.0;
        assert!((after[&1] as f64 - avg).abs() <= avg * BALANCE_TOLERANCE, "{after:?}");
        assert!(moves_between(&map, &next, &sizes).iter().all(|m| m.from == 1));
        // A node below the average takes from the fullest.
        let next = balance_node(&map, &members, &sizes, 3);
        assert!(moves_between(&map, &next, &sizes).iter().all(|m| m.to == 3 && m.from == 1));
    }

    #[test]
    fn a_balanced_cluster_or_an_empty_one_moves_nothing() {
        let members = [1, 2, 3];
        let map = split(&members);
        assert_eq!(balance(&map, &members, &vec![7; BUCKET_COUNT]).owners, map.owners);
        assert_eq!(balance(&map, &members, &[]).owners, map.owners);
        assert_eq!(balance_node(&map, &members, &[], 2).owners, map.owners);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        /// Never worse than before, bounded movement, deterministic, a valid map.
        #[test]
        fn balancing_never_makes_it_worse_and_moves_little(n in 2usize..8, sizes in sizes_strategy(), skew in 0usize..4) {
            let members: Vec<NodeId> = (1..=n as u64).collect();
            let mut map = split(&members);
            // Skew the starting map: the first member takes a share of another's buckets.
            for b in 0..BUCKET_COUNT {
                if b % 4 < skew && map.owners[b] == members[1] {
                    map.owners[b] = members[0];
                }
            }
            let before = loads(&map, &members, &sizes);
            let next = balance(&map, &members, &sizes);
            next.check(&members).expect("a valid map");
            prop_assert_eq!(next.version, map.version + 1);
            prop_assert_eq!(&next, &balance(&map, &members, &sizes), "deterministic");
            let after = loads(&next, &members, &sizes);
            prop_assert!(after.values().max() <= before.values().max(), "the fullest never gets fuller");
            prop_assert!(after.values().min() >= before.values().min(), "the emptiest never gets emptier");
            prop_assert!(balance_ratio(&after) <= balance_ratio(&before));
            let total: u64 = sizes.iter().sum();
            let avg = total as f64 / n as f64;
            let excess: f64 = before.values().map(|&l| (l as f64 - avg).max(0.0)).sum();
            let largest = sizes.iter().copied().max().unwrap_or(0);
            let moved: u64 = moves_between(&map, &next, &sizes).iter().map(|m| m.bytes).sum();
            prop_assert!(moved as f64 <= excess + (n as u64 * largest) as f64, "moved {moved}, excess {excess}");
            prop_assert!(moved >= balance_lower_bound(&map, &next, &members, &sizes), "a true lower bound");
            // Fine-grained data always ends within the tolerance.
            if (largest as f64) <= avg * BALANCE_TOLERANCE / n as f64 {
                for &l in after.values() {
                    prop_assert!((l as f64 - avg).abs() <= avg * BALANCE_TOLERANCE + 1.0, "{after:?} avg {avg}");
                }
            }
            // A balanced map stays as it is.
            prop_assert_eq!(balance(&next, &members, &sizes).owners, next.owners.clone());
        }

        /// The maps of joins, leaves and failures balance the bytes when they are known:
        /// a valid map, within the tolerance for fine-grained data, counts within one where
        /// empty buckets allow it, a join moving about the joiner's share, a failure no more
        /// than the failed member's buckets and what the balance needs.
        #[test]
        fn membership_maps_balance_the_bytes_and_move_about_a_share(n in 2usize..7, sizes in sizes_strategy(), gone in 0usize..7) {
            let members: Vec<NodeId> = (1..=n as u64).collect();
            let balanced = rebalance_by_size(&split(&members), &members, &sizes);
            balanced.check(&members).expect("a valid map");
            let total: u64 = sizes.iter().sum();
            let largest = sizes.iter().copied().max().unwrap_or(0);
            // A join.
            let mut joined = members.clone();
            joined.push(100);
            let next = rebalance_by_size(&balanced, &joined, &sizes);
            next.check(&joined).expect("a valid map");
            prop_assert_eq!(&next, &rebalance_by_size(&balanced, &joined, &sizes), "deterministic");
            let moved: u64 = moves_between(&balanced, &next, &sizes).iter().map(|m| m.bytes).sum();
            let share = total as f64 / joined.len() as f64;
            prop_assert!(moved as f64 <= share * (1.0 + BALANCE_TOLERANCE) + (joined.len() as u64 * largest) as f64, "a join moved {moved} of {total}");
            prop_assert!(moves_between(&balanced, &next, &sizes).iter().all(|m| m.to == 100 || m.bytes == 0), "bytes go to the joiner only");
            let after = loads(&next, &joined, &sizes);
            let fine = (largest as f64) <= share * BALANCE_TOLERANCE / joined.len() as f64;
            if fine && total > 0 {
                for &l in after.values() {
                    prop_assert!((l as f64 - share).abs() <= share * BALANCE_TOLERANCE + 1.0, "{after:?} share {share}");
                }
            }
            let counts = |map: &DistributionMap, of: &[NodeId]| of.iter().map(|m| map.owners.iter().filter(|&o| o == m).count()).collect::<Vec<_>>();
            let empty = sizes.iter().filter(|&&s| s == 0).count();
            if empty >= BUCKET_COUNT / 2 {
                let c = counts(&next, &joined);
                prop_assert!(c.iter().max().unwrap_or(&0) - c.iter().min().unwrap_or(&0) <= 1, "{c:?}");
            }
            // A failure (or leave): the departed member's buckets move, and what the balance needs.
            let failed = members[gone % n];
            let rest: Vec<NodeId> = members.iter().copied().filter(|&m| m != failed).collect();
            let next = rebalance_by_size(&balanced, &rest, &sizes);
            next.check(&rest).expect("a valid map");
            let orphans: u64 = (0..BUCKET_COUNT).filter(|&b| balanced.owners[b] == failed).map(|b| size_of(&sizes, b)).sum();
            let moved: u64 = moves_between(&balanced, &next, &sizes).iter().map(|m| m.bytes).sum();
            let excess: f64 = loads(&balanced, &rest, &sizes).values().map(|&l| (l as f64 - total as f64 / rest.len() as f64).max(0.0)).sum();
            prop_assert!(moved >= orphans, "every bucket of the departed member moves");
            prop_assert!(moved as f64 <= orphans as f64 + excess + (rest.len() as u64 * largest) as f64, "moved {moved}, orphans {orphans}");
            // Without data, an equal split by count as before.
            prop_assert_eq!(rebalance_by_size(&balanced, &rest, &[]), super::super::rebalance(&balanced, &rest));
        }

        #[test]
        fn balancing_one_node_touches_only_that_node(n in 2usize..8, sizes in sizes_strategy(), pick in 0usize..8) {
            let members: Vec<NodeId> = (1..=n as u64).collect();
            let map = split(&members);
            let node = members[pick % n];
            let next = balance_node(&map, &members, &sizes, node);
            next.check(&members).expect("a valid map");
            let before = loads(&map, &members, &sizes);
            let after = loads(&next, &members, &sizes);
            let avg = sizes.iter().sum::<u64>() as f64 / n as f64;
            prop_assert!((after[&node] as f64 - avg).abs() <= (before[&node] as f64 - avg).abs());
            for m in moves_between(&map, &next, &sizes) {
                prop_assert!(m.from == node || m.to == node, "{m:?}");
            }
        }
    }
}
