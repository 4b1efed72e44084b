//! Pure: from the replicated state and the members' reports, the leader's view of the
//! buckets and a balancing plan. No I/O; the clock is an argument (report ages).

use std::collections::BTreeMap;
use std::time::Duration;

use shoal_http_api::types::{
    BucketFigures, BucketSort, BucketsQuery, BucketsView, NodeBalance, NodeLoad, PlannedMove, RebalancePlan,
    RebalanceRequest,
};
use shoal_raft::{
    balance, balance_lower_bound, balance_node, balance_ratio, loads, moves_between, ClusterState, NodeId, BUCKET_COUNT,
};

use super::BucketReport;

/// A report as the leader holds it: the report and how long ago it came.
#[derive(Debug, Clone)]
pub struct Received {
    /// The report.
    pub report: BucketReport,
    /// Its age now.
    pub age: Duration,
}

/// How many intervals a report stays fresh: a plan needs one this young from every member.
pub const FRESH_INTERVALS: u32 = 3;

/// Why the map cannot be balanced now, if it cannot: a transition, transfer or maintenance
/// runs, or a member is stopping (a plan must not give it buckets).
pub fn busy(state: &ClusterState) -> Option<String> {
    state.balance_busy().or_else(|| state.draining.iter().next().map(|id| format!("node {id} is stopping")))
}

/// Why no plan can be made now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refusal {
    /// A transition, transfer or maintenance runs.
    Busy(String),
    /// These members have no fresh report.
    StatsPending(Vec<NodeId>),
    /// The member asked for is not one that stays.
    NotMember(NodeId),
}

/// Every bucket's figures from the report of its current owner, if that member reported it.
pub fn figures(state: &ClusterState, reports: &BTreeMap<NodeId, Received>) -> Vec<Option<BucketFigures>> {
    let mut out: Vec<Option<BucketFigures>> = vec![None; BUCKET_COUNT];
    for (&node, received) in reports {
        for b in &received.report.buckets {
            let i = usize::from(b.bucket);
            if i < BUCKET_COUNT && state.map.owners.get(i) == Some(&node) {
                out[i] = Some(BucketFigures {
                    bucket: b.bucket,
                    owner: node,
                    items: b.items,
                    bytes: b.bytes,
                    reads_per_sec: b.reads_per_sec,
                    writes_per_sec: b.writes_per_sec,
                });
            }
        }
    }
    out
}

/// Each bucket's bytes (0 when its owner did not report it).
pub fn sizes(figures: &[Option<BucketFigures>]) -> Vec<u64> {
    figures.iter().map(|f| f.as_ref().map_or(0, |f| f.bytes)).collect()
}

/// The members that stay and have no complete report younger than [`FRESH_INTERVALS`]
/// intervals made on the serving map (a report from before a bucket moved leaves the bucket
/// out, or counts it at its old owner; one made while buckets are still coming back leaves
/// them out).
pub fn missing(state: &ClusterState, reports: &BTreeMap<NodeId, Received>, interval: Duration) -> Vec<NodeId> {
    let fresh = interval * FRESH_INTERVALS;
    let stale = |r: &Received| r.age > fresh || r.report.map_version < state.map.version || r.report.pending > 0;
    state.active_ids().into_iter().filter(|id| reports.get(id).is_none_or(stale)).collect()
}

/// `GET /v1/cluster/buckets` as leader `me` answers it.
pub fn view(
    me: NodeId,
    state: &ClusterState,
    reports: &BTreeMap<NodeId, Received>,
    interval: Duration,
    query: BucketsQuery,
) -> BucketsView {
    let figures = figures(state, reports);
    let members = state.active_ids();
    let sizes = sizes(&figures);
    let nodes = state
        .members
        .iter()
        .map(|m| {
            let mine: Vec<&BucketFigures> = figures.iter().flatten().filter(|f| f.owner == m.id).collect();
            NodeLoad {
                node_id: m.id,
                buckets: state.map.owners.iter().filter(|&&o| o == m.id).count(),
                items: mine.iter().map(|f| f.items).sum(),
                bytes: mine.iter().map(|f| f.bytes).sum(),
                reads_per_sec: mine.iter().map(|f| f.reads_per_sec).sum(),
                writes_per_sec: mine.iter().map(|f| f.writes_per_sec).sum(),
                reported_ms_ago: reports.get(&m.id).map(|r| r.age.as_millis() as u64),
            }
        })
        .collect();
    let total_items = figures.iter().flatten().map(|f| f.items).sum();
    let mut buckets: Vec<BucketFigures> =
        figures.into_iter().flatten().filter(|f| query.node.is_none_or(|n| f.owner == n)).collect();
    let key = |f: &BucketFigures| -> f64 {
        match query.sort {
            BucketSort::Bytes => f.bytes as f64,
            BucketSort::Items => f.items as f64,
            BucketSort::Reads => f.reads_per_sec,
            BucketSort::Writes => f.writes_per_sec,
            BucketSort::Bucket => -f64::from(f.bucket),
        }
    };
    // Largest first; equal ones by bucket number.
    buckets.sort_by(|a, b| key(b).total_cmp(&key(a)).then(a.bucket.cmp(&b.bucket)));
    buckets.truncate(query.limit);
    BucketsView {
        leader: me,
        map_version: state.map.version,
        stats_interval_ms: interval.as_millis() as u64,
        balance_ratio: finite(balance_ratio(&loads(&state.map, &members, &sizes))),
        auto_balance: state.settings.auto_balance,
        total_items,
        total_bytes: sizes.iter().sum(),
        nodes,
        missing: missing(state, reports, interval),
        buckets,
    }
}

/// A ratio JSON can carry: an empty member next to a full one counts as a very large ratio.
pub fn finite(ratio: f64) -> f64 {
    if ratio.is_finite() {
        ratio
    } else {
        f64::MAX
    }
}

/// The plan `POST /v1/cluster/rebalance` asks for, on `state` with these reports, and the
/// owners it gives every bucket. `rate` is the transfer rate the estimate uses.
pub fn plan(
    state: &ClusterState,
    reports: &BTreeMap<NodeId, Received>,
    interval: Duration,
    request: RebalanceRequest,
    rate: Option<f64>,
) -> Result<(RebalancePlan, Vec<NodeId>), Refusal> {
    let members = state.active_ids();
    if let Some(node) = request.node.filter(|n| !members.contains(n)) {
        return Err(Refusal::NotMember(node));
    }
    if let Some(busy) = busy(state) {
        return Err(Refusal::Busy(busy));
    }
    let missing = missing(state, reports, interval);
    if !missing.is_empty() {
        return Err(Refusal::StatsPending(missing));
    }
    let sizes = sizes(&figures(state, reports));
    let next = match request.node {
        Some(node) => balance_node(&state.map, &members, &sizes, node),
        None => balance(&state.map, &members, &sizes),
    };
    let moves: Vec<PlannedMove> = moves_between(&state.map, &next, &sizes)
        .into_iter()
        .map(|m| PlannedMove { bucket: m.bucket.0, from: m.from, to: m.to, bytes: m.bytes })
        .collect();
    let (before, after) = (loads(&state.map, &members, &sizes), loads(&next, &members, &sizes));
    let count = |owners: &[NodeId], m: NodeId| owners.iter().filter(|&&o| o == m).count();
    let nodes = members
        .iter()
        .map(|&m| NodeBalance {
            node_id: m,
            bytes_before: before[&m],
            bytes_after: after[&m],
            buckets_before: count(&state.map.owners, m),
            buckets_after: count(&next.owners, m),
        })
        .collect();
    let bytes_moved: u64 = moves.iter().map(|m| m.bytes).sum();
    let plan = RebalancePlan {
        dry_run: request.dry_run,
        node_id: request.node,
        map_version: state.map.version,
        to_version: None,
        bytes_moved,
        lower_bound_bytes: balance_lower_bound(&state.map, &next, &members, &sizes),
        moves,
        nodes,
        ratio_before: finite(balance_ratio(&before)),
        ratio_after: finite(balance_ratio(&after)),
        transfer_rate_bytes_per_sec: rate,
        estimated_seconds: rate.filter(|&r| r > 0.0).map(|r| bytes_moved as f64 / r),
    };
    Ok((plan, next.owners))
}

/// The rate a plan's estimate uses: the slowest rate a member measured in its last transfer,
/// capped by the configured limit (0: none); `None` before any member measured one.
pub fn transfer_rate(reports: &BTreeMap<NodeId, Received>, limit: u64) -> Option<f64> {
    let slowest = reports.values().filter_map(|r| r.report.transfer_rate).min_by(f64::total_cmp)?;
    Some(if limit > 0 { slowest.min(limit as f64) } else { slowest })
}

/// Whether the leader balances by itself now: it is turned on, nothing runs, every member
/// reported, and the fullest member holds more than 1.5 times what the emptiest holds, and
/// at least [`AUTO_BALANCE_MIN_GAP`] more (a nearly empty cluster is not worth moving).
pub fn auto_balance_due(state: &ClusterState, reports: &BTreeMap<NodeId, Received>, interval: Duration) -> bool {
    if !state.settings.auto_balance || busy(state).is_some() || !missing(state, reports, interval).is_empty() {
        return false;
    }
    let sizes = sizes(&figures(state, reports));
    let loads = loads(&state.map, &state.active_ids(), &sizes);
    let (Some(&max), Some(&min)) = (loads.values().max(), loads.values().min()) else { return false };
    max - min >= AUTO_BALANCE_MIN_GAP && balance_ratio(&loads) > AUTO_BALANCE_RATIO
}

/// The fullest member over the emptiest beyond which the leader balances by itself (60/40).
pub const AUTO_BALANCE_RATIO: f64 = 1.5;

/// The least gap between the fullest and the emptiest member for which the leader balances
/// by itself: 1 MiB.
pub const AUTO_BALANCE_MIN_GAP: u64 = 1 << 20;

#[cfg(test)]
mod tests {
    use shoal_raft::ClusterCommand;

    use super::super::ReportedBucket;
    use super::*;

    fn three_nodes() -> ClusterState {
        use crate::bucket::testing::{states, Step};
        let steps = [Step::Join, Step::EndTransition, Step::Move(8), Step::Join, Step::EndTransition, Step::Move(8)];
        let s = states(&steps).pop().expect("a state");
        assert_eq!(s.member_ids(), vec![1, 2, 3]);
        assert!(s.target.is_none() && s.transition.is_none(), "settled");
        s
    }

    /// Every member reports its buckets, each holding `bytes(b)`.
    fn reports(state: &ClusterState, bytes: impl Fn(u16) -> u64, age: Duration) -> BTreeMap<NodeId, Received> {
        state
            .member_ids()
            .into_iter()
            .map(|id| {
                let buckets = state
                    .map
                    .buckets_of(id)
                    .into_iter()
                    .map(|b| ReportedBucket {
                        bucket: b.0,
                        items: 1,
                        bytes: bytes(b.0),
                        reads_per_sec: f64::from(b.0 % 3),
                        writes_per_sec: 0.0,
                    })
                    .collect();
                let report = BucketReport {
                    node: id,
                    map_version: state.map.version,
                    buckets,
                    transfer_rate: Some(1e6 * id as f64),
                    pending: 0,
                };
                (id, Received { report, age })
            })
            .collect()
    }

    const INTERVAL: Duration = Duration::from_secs(10);

    #[test]
    fn the_view_sorts_and_limits_and_sums_per_member() {
        let s = three_nodes();
        let r = reports(&s, u64::from, Duration::from_secs(1));
        let v = view(1, &s, &r, INTERVAL, BucketsQuery { sort: BucketSort::Bytes, limit: 5, node: None });
        let top: Vec<u16> = v.buckets.iter().map(|b| b.bucket).collect();
        assert_eq!(top, vec![999, 998, 997, 996, 995]);
        assert_eq!(v.total_bytes, (0..1000u64).sum::<u64>());
        assert_eq!(v.nodes.iter().map(|n| n.bytes).sum::<u64>(), v.total_bytes);
        assert!(v.missing.is_empty());
        let v = view(1, &s, &r, INTERVAL, BucketsQuery { sort: BucketSort::Bucket, limit: 2, node: Some(2) });
        assert!(v.buckets.iter().all(|b| b.owner == 2));
        assert!(v.buckets[0].bucket < v.buckets[1].bucket);
    }

    #[test]
    fn a_plan_waits_for_every_member_s_fresh_report() {
        let s = three_nodes();
        let mut r = reports(&s, |_| 10, Duration::from_secs(1));
        r.get_mut(&2).expect("present").age = INTERVAL * 4;
        let asked = RebalanceRequest { node: None, dry_run: true };
        assert_eq!(plan(&s, &r, INTERVAL, asked, None).expect_err("a refusal"), Refusal::StatsPending(vec![2]));
        r.remove(&3);
        assert_eq!(plan(&s, &r, INTERVAL, asked, None).expect_err("a refusal"), Refusal::StatsPending(vec![2, 3]));
        let mut r = reports(&s, |_| 10, Duration::from_secs(1));
        r.get_mut(&1).expect("present").report.map_version -= 1;
        assert_eq!(
            plan(&s, &r, INTERVAL, asked, None).expect_err("a refusal"),
            Refusal::StatsPending(vec![1]),
            "made before a move"
        );
        let mut r = reports(&s, |_| 10, Duration::from_secs(1));
        r.get_mut(&3).expect("present").report.pending = 7;
        let refusal = plan(&s, &r, INTERVAL, asked, None).expect_err("a refusal");
        assert_eq!(refusal, Refusal::StatsPending(vec![3]), "buckets still coming back after a restart");
        let r = reports(&s, |_| 10, Duration::from_secs(1));
        let not_member = RebalanceRequest { node: Some(9), dry_run: true };
        assert_eq!(plan(&s, &r, INTERVAL, not_member, None).expect_err("a refusal"), Refusal::NotMember(9));
    }

    #[test]
    fn a_skewed_cluster_gets_a_plan_with_its_figures_and_auto_balance_triggers_past_60_40() {
        let mut s = three_nodes();
        // Node 1's buckets hold twice as much as the others'.
        let owners = s.map.owners.clone();
        let bytes = move |b: u16| if owners[usize::from(b)] == 1 { 20_000 } else { 10_000 };
        let r = reports(&s, &bytes, Duration::from_secs(1));
        let (p, owners) =
            plan(&s, &r, INTERVAL, RebalanceRequest { node: None, dry_run: true }, Some(1e6)).expect("present");
        assert!(p.ratio_before > 1.9 && p.ratio_after <= 1.15, "{p:?}");
        assert_eq!(p.bytes_moved, p.moves.iter().map(|m| m.bytes).sum::<u64>());
        assert!(p.bytes_moved >= p.lower_bound_bytes);
        assert_eq!(p.estimated_seconds, Some(p.bytes_moved as f64 / 1e6));
        assert_eq!(owners.len(), BUCKET_COUNT);
        assert_eq!(
            p.nodes.iter().map(|n| n.bytes_after).sum::<u64>(),
            p.nodes.iter().map(|n| n.bytes_before).sum::<u64>()
        );
        assert_eq!(transfer_rate(&r, 0), Some(1e6));
        assert_eq!(transfer_rate(&r, 1000), Some(1000.0));

        assert!(!auto_balance_due(&s, &r, INTERVAL), "off by default");
        s.apply(&ClusterCommand::SetAutoBalance { enabled: true });
        assert!(auto_balance_due(&s, &r, INTERVAL), "2:1 is past 60/40");
        let owners = s.map.owners.clone();
        let mild = move |b: u16| if owners[usize::from(b)] == 1 { 14_000 } else { 10_000 };
        assert!(!auto_balance_due(&s, &reports(&s, mild, Duration::from_secs(1)), INTERVAL), "1.4:1 is not");
        let tiny = |b: u16| u64::from(b % 2);
        assert!(
            !auto_balance_due(&s, &reports(&s, tiny, Duration::from_secs(1)), INTERVAL),
            "nor a nearly empty cluster"
        );
    }
}
