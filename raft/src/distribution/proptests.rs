//! Property tests of [`rebalance`] against a deliberately naive oracle, with the map
//! invariants checked after every step of random join/leave sequences.

use proptest::prelude::*;

use super::*;

/// The oracle: hand every orphaned bucket to the emptiest member, then move one bucket at a
/// time from the fullest member to the emptiest until counts differ by at most one. Slow and
/// obviously balanced; `rebalance` must never move more buckets than this does.
fn naive_rebalance(prev: &DistributionMap, members: &[NodeId]) -> DistributionMap {
    let mut owners = if prev.is_empty() { vec![members[0]; BUCKET_COUNT] } else { prev.owners.clone() };
    let mut counts: std::collections::HashMap<NodeId, usize> = members.iter().map(|&m| (m, 0)).collect();
    for o in &owners {
        if let Some(c) = counts.get_mut(o) {
            *c += 1;
        }
    }
    let emptiest =
        |counts: &std::collections::HashMap<NodeId, usize>| *members.iter().min_by_key(|m| counts[m]).expect("members");
    for owner in owners.iter_mut() {
        if !members.contains(owner) {
            let to = emptiest(&counts);
            *owner = to;
            *counts.get_mut(&to).expect("member") += 1;
        }
    }
    loop {
        let fullest = *members.iter().max_by_key(|m| counts[m]).expect("members");
        let to = emptiest(&counts);
        if counts[&fullest] <= counts[&to] + 1 {
            break;
        }
        let b = owners.iter().rposition(|&o| o == fullest).expect("fullest owns a bucket");
        owners[b] = to;
        *counts.get_mut(&fullest).expect("member") -= 1;
        *counts.get_mut(&to).expect("member") += 1;
    }
    DistributionMap { version: prev.version + 1, owners }
}

/// Checks every invariant of a rebalance step; `joined`/`left` describe the change.
fn check_step(
    prev: &DistributionMap,
    next: &DistributionMap,
    members: &[NodeId],
    joined: Option<NodeId>,
    left: Option<NodeId>,
) {
    next.check(members).expect("map invariants");
    assert_eq!(next.version, prev.version + 1);
    let counts = next.counts();
    assert_eq!(counts.len(), members.len(), "every member owns buckets: {counts:?}");
    let (min, max) = (counts.values().min().copied(), counts.values().max().copied());
    assert!(max.unwrap_or(0) - min.unwrap_or(0) <= 1, "equal split: {counts:?}");
    let moved = prev.moved_buckets(next);
    if !prev.is_empty() {
        assert_eq!(moved.len(), minimum_moves(prev, members), "moves are minimal");
        let naive = naive_rebalance(prev, members);
        assert!(moved.len() <= prev.moved_buckets(&naive).len(), "never more moves than the oracle");
    }
    if let (Some(new), false) = (joined, prev.is_empty()) {
        assert!(moved.iter().all(|&b| next.owner_of(b) == Some(new)), "a join moves buckets only to the newcomer");
        let n = members.len();
        assert!(moved.len() <= BUCKET_COUNT / n + 1, "a join moves about 1000/N buckets");
    }
    if let Some(gone) = left {
        assert!(moved.iter().all(|&b| prev.owner_of(b) == Some(gone)), "a leave moves only the leaver's buckets");
    }
}

#[test]
fn growing_one_to_three_splits_1000_500_333() {
    let m1 = rebalance(&DistributionMap::default(), &[1]);
    assert_eq!(m1.counts().into_values().collect::<Vec<_>>(), vec![1000]);
    let m2 = rebalance(&m1, &[1, 2]);
    assert_eq!(m2.counts().into_values().collect::<Vec<_>>(), vec![500, 500]);
    let m3 = rebalance(&m2, &[1, 2, 3]);
    let mut c3: Vec<usize> = m3.counts().into_values().collect();
    c3.sort();
    assert_eq!(c3, vec![333, 333, 334]);
    assert_eq!(m2.moved_buckets(&m3).len(), 333);
}

#[test]
fn a_join_moves_about_a_third_of_the_buckets_to_the_third_node() {
    let m2 = rebalance(&rebalance(&DistributionMap::default(), &[1]), &[1, 2]);
    let m3 = rebalance(&m2, &[1, 2, 3]);
    check_step(&m2, &m3, &[1, 2, 3], Some(3), None);
}

#[derive(Debug, Clone)]
enum Change {
    Join,
    Leave(usize),
}

fn change() -> impl Strategy<Value = Change> {
    prop_oneof![3 => Just(Change::Join), 2 => any::<usize>().prop_map(Change::Leave)]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    #[test]
    fn random_joins_and_leaves_keep_every_invariant(changes in proptest::collection::vec(change(), 1..40)) {
        let mut members: Vec<NodeId> = vec![1];
        let mut next_id: NodeId = 2;
        let mut map = rebalance(&DistributionMap::default(), &members);
        check_step(&DistributionMap::default(), &map, &members, Some(1), None);
        for c in changes {
            let (joined, left) = match c {
                Change::Join => {
                    members.push(next_id);
                    next_id += 1;
                    (members.last().copied(), None)
                }
                Change::Leave(i) if members.len() > 1 => (None, Some(members.remove(i % members.len()))),
                Change::Leave(_) => continue,
            };
            let next = rebalance(&map, &members);
            check_step(&map, &next, &members, joined, left);
            map = next;
        }
    }

    #[test]
    fn rebalancing_a_balanced_map_moves_nothing(n in 1usize..60) {
        let members: Vec<NodeId> = (1..=n as u64).collect();
        let map = rebalance(&DistributionMap::default(), &members);
        let again = rebalance(&map, &members);
        prop_assert!(map.moved_buckets(&again).is_empty());
    }

    #[test]
    fn bucket_of_is_always_in_range(key in proptest::collection::vec(any::<u8>(), 0..64)) {
        prop_assert!(bucket_of(&key).index() < BUCKET_COUNT);
    }
}
