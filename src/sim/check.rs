//! What a simulation's history must satisfy.
//!
//! Every key belongs to one client, which works on it one operation at a time, so what a read
//! may see is well defined: the state left by the last acknowledged write before it, or the
//! effect of any write that got no definite answer (it may have landed, or may still land). A
//! write answered `replication_failed`, `expired`, `insufficient_storage` or any 4xx was stored
//! nowhere: no read may see it. A
//! read that sees anything else went back in time; a read that finds nothing where the last
//! acknowledged write stored a value was served by a bucket that lost its data. A bucket a node
//! served again empty because every copy of it died (it says so: [`Emptied`]) starts over from
//! nothing at that moment. While a link is cut, a node cut off from the majority may still
//! serve reads from its old copy (the read lease is not there yet), and so may a node that has
//! not yet learned that a bucket moved away (just after a heal, or between a move's commit and
//! its apply there): such reads are counted apart, not failed.
//!
//! A key every client writes has no such order: its history is checked by a linearizability
//! checker (`linear.rs`), with the same allowances (an answer that says nothing was stored is
//! definite, an emptying is a delete at its instant, a read by a node with an old map is left
//! out) and its final read as the last operation.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use shoal_raft::{bucket_of, BucketId};

use super::linear::{self, Action, Entry, Verdict};
use super::workload::{is_shared, Op, OpKind, Outcome};

/// The state a write leaves: a value, or nothing.
type State = Option<String>;

fn effect(kind: &OpKind) -> Option<State> {
    match kind {
        OpKind::Put(v) => Some(Some(v.clone())),
        OpKind::Delete => Some(None),
        OpKind::Get => None,
    }
}

/// When each bucket was served again empty (simulated time), sorted.
pub type Emptied = BTreeMap<BucketId, Vec<Duration>>;

/// What may be seen of a key after the operations `before`, up to time `until`, given when
/// its bucket was emptied: an emptying resets what acknowledged writes left, and a write that
/// ran while it happened may or may not have survived it.
fn allowed(before: &[&Op], emptied: &[Duration], until: Duration) -> BTreeSet<State> {
    let mut acked: State = None;
    let mut maybe = BTreeSet::new();
    let mut empties = emptied.iter().copied().filter(|&t| t <= until).peekable();
    for op in before {
        while empties.next_if(|&t| t < op.start).is_some() {
            acked = None;
        }
        let Some(state) = effect(&op.kind) else { continue };
        if empties.peek().is_some_and(|&t| t <= op.end) {
            maybe.insert(state);
            continue;
        }
        match &op.outcome {
            Outcome::Ok { .. } | Outcome::NotFound => acked = state,
            Outcome::Failed(e) if stored_nothing(e) => {}
            Outcome::Failed(_) | Outcome::Unknown(_) => {
                maybe.insert(state);
            }
        }
    }
    if empties.next().is_some() {
        acked = None;
    }
    maybe.insert(acked);
    maybe
}

/// Whether an error answer says the write was stored nowhere (so no read may ever see it), as
/// `http-api/README.md` promises of `replication_failed`, `expired` (a forwarded request that
/// came too late: nothing was done), `insufficient_storage` and every 4xx (a request refused
/// as it is, or by the cluster's state).
fn stored_nothing(e: &shoal_http_api::ApiError) -> bool {
    use shoal_http_api::{ApiError, Unavailable};
    let definite = [Unavailable::ReplicationFailed, Unavailable::Expired];
    e.unavailable_code().is_some_and(|c| definite.contains(&c))
        || matches!(e, ApiError::InsufficientStorage(_))
        || e.status().is_client_error()
}

/// The operations of each key, in the order their client ran them.
fn by_key(history: &[Op]) -> BTreeMap<&str, Vec<&Op>> {
    let mut keys: BTreeMap<&str, Vec<&Op>> = BTreeMap::new();
    for op in history {
        keys.entry(op.key.as_str()).or_default().push(op);
    }
    for ops in keys.values_mut() {
        ops.sort_by_key(|op| op.start);
    }
    keys
}

/// What the reads of a history say.
#[derive(Debug, Default)]
pub struct ReadVerdict {
    /// Reads that saw what no acknowledged write left there, outside any split.
    pub violations: Vec<String>,
    /// How many of the violations ran while a link was cut (a node cut off from the majority
    /// that served without its lease).
    pub stale_during_split: usize,
    /// Such reads at other times while a node answered a read of that bucket from its own
    /// copy with an old map (it did not know yet that the bucket had moved away).
    pub stale_old_map: usize,
    /// Reads checked.
    pub reads: usize,
}

/// Checks every read of `history`; `old_map` says when a node answered a read of a bucket from
/// its own copy while another node knew of a later move of it.
pub fn check_reads(history: &[Op], emptied: &Emptied, old_map: &Emptied) -> ReadVerdict {
    let mut verdict = ReadVerdict::default();
    for (key, ops) in by_key(history).into_iter().filter(|(k, _)| !is_shared(k)) {
        let bucket = bucket_of(key.as_bytes());
        let empties = emptied.get(&bucket).map_or(&[][..], Vec::as_slice);
        let old = old_map.get(&bucket).map_or(&[][..], Vec::as_slice);
        for (i, op) in ops.iter().enumerate() {
            let seen: State = match (&op.kind, &op.outcome) {
                (OpKind::Get, Outcome::Ok { value, .. }) => value.clone(),
                (OpKind::Get, Outcome::NotFound) => None,
                _ => continue,
            };
            verdict.reads += 1;
            // A read that ran while its bucket was emptied may see it before or after.
            let mut ok = allowed(&ops[..i], empties, op.start);
            ok.extend(allowed(&ops[..i], empties, op.end));
            if ok.contains(&seen) {
                continue;
            }
            if old.iter().any(|t| (op.start..=op.end).contains(t)) {
                verdict.stale_old_map += 1;
            } else {
                // A split is no excuse: a node cut off from the majority serves no read once it
                // may have been failed (its lease runs out first).
                verdict.stale_during_split += usize::from(op.during_split);
                let before: Vec<String> = ops[..i]
                    .iter()
                    .rev()
                    .take(3)
                    .map(|o| format!("{:?} {:?}..{:?} {:?}", o.kind, o.start, o.end, o.outcome))
                    .collect();
                verdict.violations.push(format!(
                    "read of {key} (bucket {bucket}) at {:?} through host {} saw {seen:?}, allowed {ok:?} ({:?}); before: {}",
                    op.start,
                    op.host,
                    op.outcome,
                    before.join("; ")
                ));
            }
        }
    }
    verdict
}

/// What a key holds at the end.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Final {
    /// This value (or nothing).
    Read(State),
    /// Its bucket is reported lost: owner and replica died together.
    Lost,
    /// The final read failed.
    Unreadable(String),
}

/// What the end state says.
#[derive(Debug, Default)]
pub struct FinalVerdict {
    /// Keys whose acknowledged write is gone (or that hold a value nobody wrote).
    pub violations: Vec<String>,
    /// Keys whose bucket is reported lost.
    pub lost_buckets: usize,
    /// Keys checked.
    pub keys: usize,
    /// Writes acknowledged in all.
    pub acknowledged: usize,
}

/// Checks the final state of every key against `history`.
pub fn check_final(history: &[Op], emptied: &Emptied, finals: &BTreeMap<String, Final>) -> FinalVerdict {
    let mut verdict = FinalVerdict {
        acknowledged: history.iter().filter(|op| op.acknowledged_write()).count(),
        ..FinalVerdict::default()
    };
    let keys = by_key(history);
    for (key, end) in finals.iter().filter(|(k, _)| !is_shared(k)) {
        verdict.keys += 1;
        let ops = keys.get(key.as_str()).cloned().unwrap_or_default();
        let empties = emptied.get(&bucket_of(key.as_bytes())).map_or(&[][..], Vec::as_slice);
        let ok = allowed(&ops, empties, Duration::MAX);
        match end {
            Final::Read(state) if ok.contains(state) => {}
            Final::Read(state) => {
                let bucket = bucket_of(key.as_bytes());
                verdict.violations.push(format!("{key} (bucket {bucket}) ends as {state:?}, allowed {ok:?}"));
            }
            Final::Lost => verdict.lost_buckets += 1,
            Final::Unreadable(e) => verdict.violations.push(format!("{key} cannot be read at the end: {e}")),
        }
    }
    verdict
}

/// What the histories of the keys every client writes say.
#[derive(Debug, Default)]
pub struct SharedVerdict {
    /// Keys whose history is not linearizable (or could not be decided).
    pub violations: Vec<String>,
    /// Keys checked.
    pub keys: usize,
    /// Their operations checked.
    pub operations: usize,
}

/// Checks the history of every key every client writes, with its final read, for
/// linearizability.
pub fn check_shared(
    history: &[Op],
    emptied: &Emptied,
    old_map: &Emptied,
    finals: &BTreeMap<String, Final>,
) -> SharedVerdict {
    let mut verdict = SharedVerdict::default();
    let keys = by_key(history);
    for (key, end) in finals.iter().filter(|(k, _)| is_shared(k)) {
        verdict.keys += 1;
        let bucket = bucket_of(key.as_bytes());
        let ops = keys.get(key.as_str()).cloned().unwrap_or_default();
        let old = old_map.get(&bucket).map_or(&[][..], Vec::as_slice);
        let mut entries: Vec<Entry> = ops.iter().filter_map(|op| entry(op, old)).collect();
        let empties = emptied.get(&bucket).map_or(&[][..], Vec::as_slice);
        entries.extend(empties.iter().map(|&t| Entry { call: t, answer: Some(t), action: Action::Write(None) }));
        match end {
            Final::Read(state) => {
                let last = Some(Duration::MAX);
                entries.push(Entry { call: Duration::MAX, answer: last, action: Action::Read(state.clone()) });
            }
            Final::Lost => {}
            Final::Unreadable(e) => verdict.violations.push(format!("{key} cannot be read at the end: {e}")),
        }
        verdict.operations += entries.len();
        let found = match linear::check(&entries, linear::BUDGET) {
            Verdict::Linearizable => continue,
            Verdict::Not => format!("is not linearizable: {}", first_contradiction(&mut entries)),
            Verdict::Undecided(n) => format!("could not be decided in {n} configurations"),
        };
        let tail: Vec<String> = ops
            .iter()
            .rev()
            .take(6)
            .map(|o| format!("c{} {:?} {:?}..{:?} {:?}", o.client, o.kind, o.start, o.end, o.outcome))
            .collect();
        verdict.violations.push(format!(
            "history of {key} (bucket {bucket}, {} operations, ends as {end:?}) {found}; last: {}",
            entries.len(),
            tail.join("; ")
        ));
    }
    verdict
}

/// The operations, by call, up to the first one with which the history stops being
/// linearizable (found by bisection), the last few of them.
fn first_contradiction(entries: &mut [Entry]) -> String {
    entries.sort_by_key(|e| e.call);
    let (mut good, mut bad) = (0, entries.len());
    while bad - good > 1 {
        let mid = (good + bad) / 2;
        match linear::check(&entries[..mid], linear::BUDGET) {
            Verdict::Linearizable => good = mid,
            _ => bad = mid,
        }
    }
    let shown: Vec<String> = entries[bad.saturating_sub(8)..bad].iter().map(|e| format!("{e:?}")).collect();
    format!("with its first {bad} operations by call, the last: {}", shown.join(", "))
}

/// What operation `op` was to the key's register; `None` when it tells nothing (a read that
/// failed, or served by a node with an old map while the read ran (`old`), a write that
/// stored nothing).
fn entry(op: &Op, old: &[Duration]) -> Option<Entry> {
    let answered = |action| Some(Entry { call: op.start, answer: Some(op.end), action });
    match (&op.kind, &op.outcome) {
        (OpKind::Get, _) if old.iter().any(|t| (op.start..=op.end).contains(t)) => None,
        (OpKind::Get, Outcome::Ok { value, .. }) => answered(Action::Read(value.clone())),
        (OpKind::Get, Outcome::NotFound) => answered(Action::Read(None)),
        (OpKind::Get, _) => None,
        (kind, outcome) => {
            let state = effect(kind)?;
            match outcome {
                Outcome::Ok { .. } | Outcome::NotFound => answered(Action::Write(state)),
                Outcome::Failed(e) if stored_nothing(e) => None,
                Outcome::Failed(_) | Outcome::Unknown(_) => {
                    Some(Entry { call: op.start, answer: None, action: Action::Write(state) })
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use shoal_http_api::{ApiError, Unavailable};
    use std::time::Duration;

    fn op(n: usize, key: &str, kind: OpKind, outcome: Outcome, during_split: bool) -> Op {
        let t = Duration::from_millis(n as u64);
        Op { client: 0, key: key.into(), kind, start: t, end: t, outcome, during_split, host: 0 }
    }

    fn ok() -> Outcome {
        Outcome::Ok { value: None, version: 1, node: 1 }
    }

    fn read(v: &str) -> Outcome {
        Outcome::Ok { value: Some(v.into()), version: 1, node: 1 }
    }

    #[test]
    fn a_read_that_goes_back_in_time_is_found_even_while_a_link_was_cut() {
        let mut history = Vec::new();
        for (kind, outcome, split) in [
            (OpKind::Put("a".into()), ok(), false),
            (OpKind::Get, read("a"), false),
            (OpKind::Put("b".into()), ok(), false),
            (OpKind::Get, read("a"), false),
            (OpKind::Get, read("a"), true),
            (OpKind::Put("c".into()), Outcome::Unknown("timeout".into()), false),
            (OpKind::Get, read("c"), false),
            (OpKind::Get, read("b"), false),
            (OpKind::Delete, ok(), false),
            (OpKind::Get, Outcome::NotFound, false),
            (OpKind::Get, read("c"), false),
            (OpKind::Get, read("zzz"), false),
        ] {
            history.push(op(history.len(), "k", kind, outcome, split));
        }
        let verdict = check_reads(&history, &Emptied::new(), &Emptied::new());
        assert_eq!(verdict.reads, 8);
        assert_eq!(verdict.stale_during_split, 1);
        assert_eq!(verdict.violations.len(), 3, "{:?}", verdict.violations);
        assert!(verdict.violations[0].contains("Some(\"a\")"), "{:?}", verdict.violations);
        assert!(verdict.violations[1].contains("Some(\"a\")"), "a split is no excuse: {:?}", verdict.violations);
        assert!(verdict.violations[2].contains("zzz"), "{:?}", verdict.violations);
    }

    #[test]
    fn a_read_that_runs_while_its_bucket_is_emptied_may_see_either_side() {
        let key = "k";
        let mut read_during = op(10, key, OpKind::Get, Outcome::NotFound, false);
        read_during.end = Duration::from_millis(20);
        let history = vec![op(0, key, OpKind::Put("a".into()), ok(), false), read_during];
        let emptied: Emptied = [(bucket_of(key.as_bytes()), vec![Duration::from_millis(15)])].into();
        assert!(check_reads(&history, &emptied, &Emptied::new()).violations.is_empty());
        let mut old_value = history.clone();
        old_value[1].outcome = read("a");
        assert!(check_reads(&old_value, &emptied, &Emptied::new()).violations.is_empty());
        let after: Emptied = [(bucket_of(key.as_bytes()), vec![Duration::from_millis(25)])].into();
        assert_eq!(check_reads(&history, &after, &Emptied::new()).violations.len(), 1, "emptied after the read");
    }

    #[test]
    fn a_bucket_served_again_empty_starts_over_from_nothing() {
        let key = "k";
        let history: Vec<Op> = vec![
            op(0, key, OpKind::Put("a".into()), ok(), false),
            op(10, key, OpKind::Get, Outcome::NotFound, false),
            op(20, key, OpKind::Put("b".into()), ok(), false),
            op(30, key, OpKind::Get, read("b"), false),
        ];
        let emptied: Emptied = [(bucket_of(key.as_bytes()), vec![Duration::from_millis(5)])].into();
        let verdict = check_reads(&history, &emptied, &Emptied::new());
        assert!(verdict.violations.is_empty(), "{:?}", verdict.violations);
        assert_eq!(
            check_reads(&history, &Emptied::new(), &Emptied::new()).violations.len(),
            1,
            "without the emptying: a loss"
        );
        let finals = [(key.to_string(), Final::Read(None))].into();
        let late: Emptied = [(bucket_of(key.as_bytes()), vec![Duration::from_millis(40)])].into();
        assert!(check_final(&history, &late, &finals).violations.is_empty());
        assert_eq!(check_final(&history, &emptied, &finals).violations.len(), 1, "b was written after");
    }

    #[test]
    fn a_stale_read_while_a_node_served_with_an_old_map_is_counted_apart() {
        let key = "k";
        let history: Vec<Op> = vec![
            op(0, key, OpKind::Put("a".into()), ok(), false),
            op(10, key, OpKind::Put("b".into()), ok(), false),
            op(20, key, OpKind::Get, read("a"), false),
        ];
        let bucket = bucket_of(key.as_bytes());
        let during: Emptied = [(bucket, vec![Duration::from_millis(20)])].into();
        let verdict = check_reads(&history, &Emptied::new(), &during);
        assert!(verdict.violations.is_empty(), "{:?}", verdict.violations);
        assert_eq!(verdict.stale_old_map, 1);
        let before: Emptied = [(bucket, vec![Duration::from_millis(15)])].into();
        assert_eq!(check_reads(&history, &Emptied::new(), &before).violations.len(), 1, "not while the read ran");
    }

    #[test]
    fn a_lost_acknowledged_write_and_a_phantom_are_found_at_the_end() {
        let mut history = Vec::new();
        for (key, kind, outcome) in [
            ("lost", OpKind::Put("a".into()), ok()),
            ("lost", OpKind::Put("b".into()), ok()),
            ("fine", OpKind::Put("a".into()), ok()),
            (
                "fine",
                OpKind::Put("b".into()),
                Outcome::Failed(ApiError::unavailable(Unavailable::OutcomeUnknown, "a test")),
            ),
            ("refused", OpKind::Put("a".into()), ok()),
            (
                "refused",
                OpKind::Put("b".into()),
                Outcome::Failed(ApiError::unavailable(Unavailable::ReplicationFailed, "a test")),
            ),
            ("gone", OpKind::Put("a".into()), ok()),
            ("gone", OpKind::Delete, ok()),
        ] {
            history.push(op(history.len(), key, kind, outcome, false));
        }
        let finals: BTreeMap<String, Final> = [
            ("lost".to_string(), Final::Read(Some("a".into()))),
            ("fine".to_string(), Final::Read(Some("b".into()))),
            ("refused".to_string(), Final::Read(Some("b".into()))),
            ("gone".to_string(), Final::Read(None)),
            ("phantom".to_string(), Final::Read(Some("x".into()))),
            ("reported".to_string(), Final::Lost),
        ]
        .into_iter()
        .collect();
        let verdict = check_final(&history, &Emptied::new(), &finals);
        assert_eq!(verdict.acknowledged, 6);
        assert_eq!(verdict.lost_buckets, 1);
        assert_eq!(verdict.violations.len(), 3, "{:?}", verdict.violations);
        assert!(verdict.violations.iter().any(|v| v.starts_with("lost ")));
        assert!(verdict.violations.iter().any(|v| v.starts_with("refused ")), "replication_failed stored nothing");
        assert!(verdict.violations.iter().any(|v| v.starts_with("phantom ")));
    }

    #[test]
    fn every_answer_that_says_nothing_was_stored_is_definite_and_no_other() {
        let definite = [
            ApiError::unavailable(Unavailable::ReplicationFailed, "a test"),
            ApiError::unavailable(Unavailable::Expired, "a test"),
            ApiError::Conflict("a test".into()),
            ApiError::PreconditionFailed { current_version: None },
            ApiError::BadRequest("a test".into()),
            ApiError::InsufficientStorage("a test".into()),
        ];
        let maybe = [
            ApiError::unavailable(Unavailable::OutcomeUnknown, "a test"),
            ApiError::unavailable(Unavailable::OwnerUnreachable, "a test"),
            ApiError::unavailable(Unavailable::Unavailable, "a test"),
            ApiError::Internal("a test".into()),
        ];
        for e in &definite {
            assert!(stored_nothing(e), "{e:?}");
        }
        for e in &maybe {
            assert!(!stored_nothing(e), "{e:?}");
        }
    }
}
