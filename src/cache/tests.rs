//! The store against a `HashMap` model, TTLs on paused tokio time, eviction under a limit.

use std::collections::HashMap;
use std::time::Duration;

use proptest::prelude::*;
use shoal_raft::{bucket_of, BucketId};

use super::*;

fn store(limit: u64) -> CacheStore {
    CacheStore::new(limit, Clock::new())
}

fn put(s: &CacheStore, key: &str, value: &str, condition: Condition) -> Result<u64, CacheError> {
    s.put(
        bucket_of(key.as_bytes()),
        &Write { key: key.as_bytes(), value: value.as_bytes(), condition, ..Default::default() },
    )
}

fn get(s: &CacheStore, key: &str) -> Option<(String, u64)> {
    s.get(bucket_of(key.as_bytes()), key.as_bytes())
        .map(|v| (String::from_utf8(v.value.to_vec()).expect("utf8"), v.version))
}

#[derive(Debug, Clone)]
enum Op {
    Put(u8, u8, u8), // key, value, condition kind
    Get(u8),
    Delete(u8, bool),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (any::<u8>(), any::<u8>(), 0u8..5).prop_map(|(k, v, c)| Op::Put(k % 16, v, c)),
        any::<u8>().prop_map(|k| Op::Get(k % 16)),
        (any::<u8>(), any::<bool>()).prop_map(|(k, cas)| Op::Delete(k % 16, cas)),
    ]
}

proptest! {
    /// Every operation answers exactly as a plain map with versions would.
    #[test]
    fn behaves_like_a_hashmap_with_versions(ops in proptest::collection::vec(op(), 1..200)) {
        let s = store(u64::MAX);
        let mut model: HashMap<String, (String, u64)> = HashMap::new();
        for op in ops {
            match op {
                Op::Put(k, v, c) => {
                    let (key, value) = (format!("k{k}"), format!("v{v}"));
                    let current = model.get(&key).map(|e| e.1);
                    let condition = match c {
                        0 | 1 => Condition::Always,
                        2 => Condition::Absent,
                        3 => Condition::Present,
                        _ => Condition::Version(current.unwrap_or(7)),
                    };
                    let holds = match condition {
                        Condition::Always => true,
                        Condition::Absent => current.is_none(),
                        Condition::Present => current.is_some(),
                        Condition::Version(v) => current == Some(v),
                    };
                    match put(&s, &key, &value, condition) {
                        Ok(version) => {
                            prop_assert!(holds);
                            prop_assert!(current.is_none_or(|c| version > c), "versions only increase");
                            model.insert(key, (value, version));
                        }
                        Err(CacheError::ConditionFailed { current: found }) => {
                            prop_assert!(!holds);
                            prop_assert_eq!(found, current);
                        }
                        Err(e) => prop_assert!(false, "unexpected {e}"),
                    }
                }
                Op::Get(k) => {
                    let key = format!("k{k}");
                    prop_assert_eq!(get(&s, &key), model.get(&key).cloned());
                }
                Op::Delete(k, cas) => {
                    let key = format!("k{k}");
                    let current = model.get(&key).map(|e| e.1);
                    let expected = cas.then_some(current.unwrap_or(3));
                    let result = s.delete(bucket_of(key.as_bytes()), key.as_bytes(), expected);
                    match (current, expected) {
                        (None, None) => prop_assert_eq!(result, Ok(false)),
                        (None, Some(_)) => prop_assert_eq!(result, Err(CacheError::ConditionFailed { current: None })),
                        (Some(_), _) => {
                            prop_assert_eq!(result, Ok(true));
                            model.remove(&key);
                        }
                    }
                }
            }
            prop_assert_eq!(s.stats().items, model.len() as u64);
        }
    }
}

#[test]
fn a_deleted_key_written_again_gets_a_higher_version() {
    let s = store(u64::MAX);
    let v1 = put(&s, "k", "a", Condition::Always).expect("put");
    s.delete(bucket_of(b"k"), b"k", None).expect("delete");
    let v2 = put(&s, "k", "b", Condition::Absent).expect("put");
    assert!(v2 > v1);
}

#[tokio::test(start_paused = true)]
async fn items_expire_on_read_and_in_the_sweep() {
    let s = store(u64::MAX);
    let w = |key: &'static str, ttl| Write { key: key.as_bytes(), value: b"v", ttl: Some(ttl), ..Default::default() };
    s.put(bucket_of(b"short"), &w("short", Duration::from_secs(30))).expect("put");
    s.put(bucket_of(b"swept"), &w("swept", Duration::from_secs(30))).expect("put");
    s.put(bucket_of(b"long"), &w("long", Duration::from_secs(120))).expect("put");
    tokio::time::advance(Duration::from_secs(29)).await;
    assert!(get(&s, "short").is_some());
    tokio::time::advance(Duration::from_secs(2)).await;
    assert!(get(&s, "short").is_none(), "expired on read");
    assert_eq!(s.stats().items, 2, "the read removed it");
    assert_eq!(s.sweep_expired(BucketId::all()), 1, "the sweep removes the other expired item");
    assert!(get(&s, "long").is_some());
    assert_eq!(s.stats().expirations, 2);
}

#[tokio::test(start_paused = true)]
async fn sliding_expiry_is_extended_by_every_read() {
    let s = store(u64::MAX);
    let write = Write { key: b"s", value: b"v", sliding: Some(Duration::from_secs(10)), ..Default::default() };
    s.put(bucket_of(b"s"), &write).expect("put");
    for _ in 0..5 {
        tokio::time::advance(Duration::from_secs(8)).await;
        assert!(get(&s, "s").is_some(), "each read within the window keeps it alive");
    }
    tokio::time::advance(Duration::from_secs(11)).await;
    assert!(get(&s, "s").is_none());
}

#[tokio::test(start_paused = true)]
async fn eviction_keeps_the_store_within_its_limit_and_spares_recent_items() {
    let per_item = ITEM_OVERHEAD_BYTES + 8 + 100;
    let s = store(per_item * 500);
    let value = [b'x'; 100];
    for i in 0..400 {
        let key = format!("old{i:05}");
        s.put(bucket_of(key.as_bytes()), &Write { key: key.as_bytes(), value: &value, ..Default::default() })
            .expect("put");
    }
    tokio::time::advance(Duration::from_secs(60)).await;
    // A hot set, read after the old items were written.
    for i in 0..50 {
        let key = format!("hot{i:05}");
        s.put(bucket_of(key.as_bytes()), &Write { key: key.as_bytes(), value: &value, ..Default::default() })
            .expect("put");
    }
    tokio::time::advance(Duration::from_secs(60)).await;
    for i in 0..1000 {
        let key = format!("new{i:05}");
        s.put(bucket_of(key.as_bytes()), &Write { key: key.as_bytes(), value: &value, ..Default::default() })
            .expect("put");
        for h in 0..50 {
            get(&s, &format!("hot{h:05}"));
        }
        tokio::time::advance(Duration::from_millis(10)).await;
        assert!(s.stats().bytes <= per_item * 500, "over the limit after put {i}");
    }
    let stats = s.stats();
    assert!(stats.evictions >= 900, "{stats:?}");
    let hot_alive = (0..50).filter(|h| get(&s, &format!("hot{h:05}")).is_some()).count();
    let old_alive = (0..400).filter(|i| get(&s, &format!("old{i:05}")).is_some()).count();
    assert!(hot_alive >= 40, "recently read items mostly survive: {hot_alive}/50");
    assert!(old_alive <= 40, "cold items go first: {old_alive}/400");
}

#[test]
fn an_item_larger_than_the_cache_is_refused_and_changes_nothing() {
    let s = store(1000);
    let big = vec![0u8; 2000];
    let err = s.put(bucket_of(b"big"), &Write { key: b"big", value: &big, ..Default::default() });
    assert!(matches!(err, Err(CacheError::TooLarge { .. })));
    assert_eq!(s.stats().items, 0);
    assert_eq!(s.stats().bytes, 0);
}

#[test]
fn a_bucket_can_be_taken_out_and_put_back_whole() {
    let s = store(u64::MAX);
    let keys: Vec<String> = (0..200).map(|i| format!("{{t}}:{i}")).collect();
    for k in &keys {
        put(&s, k, "v", Condition::Always).expect("put");
    }
    let bucket = bucket_of(b"t");
    let before = s.stats();
    let taken = s.take_bucket(bucket);
    assert_eq!(taken.len(), 200);
    assert_eq!(s.stats().items, 0);
    assert!(get(&s, &keys[0]).is_none());
    s.install_bucket(bucket, taken);
    assert_eq!(s.stats(), before);
    let (_, v) = get(&s, &keys[7]).expect("present again");
    let next = put(&s, &keys[7], "w", Condition::Version(v)).expect("cas on the moved item");
    assert!(next > v);
}

#[test]
fn evictions_are_kept_for_the_replica_once_asked() {
    let per_item = ITEM_OVERHEAD_BYTES + 8 + 100;
    let s = store(per_item * 50);
    let value = [b'x'; 100];
    let write = |i: usize| {
        let key = format!("e{i:07}");
        s.put(bucket_of(key.as_bytes()), &Write { key: key.as_bytes(), value: &value, ..Default::default() })
            .expect("put");
    };
    (0..100).for_each(write);
    assert!(s.take_evicted().is_empty(), "nothing kept unless asked");
    s.keep_evictions();
    (100..300).for_each(write);
    let evicted = s.take_evicted();
    assert!(evicted.len() >= 150, "{} evictions kept", evicted.len());
    for (bucket, key, version) in &evicted {
        assert_eq!(*bucket, bucket_of(key));
        assert!(*version > 0);
        assert!(get(&s, std::str::from_utf8(key).expect("utf8")).is_none(), "an evicted key is gone");
    }
    assert!(s.take_evicted().is_empty(), "taken once");
}

#[test]
fn a_bucket_moves_whole_between_sibling_stores() {
    // The replica store hands a bucket to the active store on promotion: both must index
    // keys the same way, or the promoted items could not be found.
    let replica = store(u64::MAX);
    let active = replica.sibling(u64::MAX);
    let keys: Vec<String> = (0..50).map(|i| format!("{{p}}:{i}")).collect();
    for k in &keys {
        put(&replica, k, "v", Condition::Always).expect("put");
    }
    let bucket = bucket_of(b"p");
    active.install_bucket(bucket, replica.take_bucket(bucket));
    for k in &keys {
        assert!(get(&active, k).is_some(), "{k} found after the move");
    }
    assert_eq!(active.stats().items, 50);
    assert_eq!(replica.stats().items, 0);
}

#[test]
fn tags_and_prefixes_find_live_items() {
    let s = store(u64::MAX);
    let tags = vec!["red".to_string()];
    for k in ["a1", "a2", "b1"] {
        s.put(bucket_of(k.as_bytes()), &Write { key: k.as_bytes(), value: b"v", tags: &tags, ..Default::default() })
            .expect("put");
    }
    put(&s, "a3", "v", Condition::Always).expect("put");
    let all: Vec<BucketId> = BucketId::all().collect();
    let keys = |v: Vec<(Vec<u8>, BucketId, u64)>| {
        v.into_iter().map(|(k, _, _)| String::from_utf8(k).expect("utf8")).collect::<Vec<_>>()
    };
    assert_eq!(keys(s.keys_with_prefix(b"a", &all, &Page::first(10))), ["a1", "a2", "a3"]);
    assert_eq!(keys(s.keys_with_prefix(b"a", &all, &Page::first(2))), ["a1", "a2"]);
    let after_a1 = Page { limit: 10, start_after: Some("a1".into()) };
    assert_eq!(keys(s.keys_with_prefix(b"a", &all, &after_a1)), ["a2", "a3"]);
    assert_eq!(keys(s.keys_with_tag("red", &all, &after_a1)), ["a2", "b1"]);
    assert_eq!(keys(s.keys_with_tag("red", &all, &Page::first(10))), ["a1", "a2", "b1"]);
    assert_eq!(s.remove_tagged("red", &all), 3);
    assert_eq!(keys(s.keys_with_prefix(b"", &all, &Page::first(10))), ["a3"]);
}

fn put_with(s: &CacheStore, key: &str, value: &[u8], priority: Priority) -> Result<u64, CacheError> {
    s.put(bucket_of(key.as_bytes()), &Write { key: key.as_bytes(), value, priority, ..Default::default() })
}

/// The keys the store holds, with their priority.
fn held(s: &CacheStore, keys: &[(String, Priority)]) -> Vec<(String, Priority)> {
    keys.iter()
        .filter(|(k, _)| s.bucket(bucket_of(k.as_bytes())).read().iter().any(|i| i.key() == k.as_bytes()))
        .cloned()
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    /// Priority eviction against its model: an evicted item never had an item of a lower
    /// level beside it, and not_removable items are never evicted; a write that cannot fit
    /// beside them is refused and changes nothing.
    #[test]
    fn priority_eviction_takes_lower_levels_first_and_never_a_not_removable_item(
        levels in proptest::collection::vec(0u8..6, 50..300),
    ) {
        let per_item = ITEM_OVERHEAD_BYTES + 6 + 100;
        let s = store(per_item * 40).with_policy(EvictionPolicy::Priority);
        let mut written: Vec<(String, Priority)> = Vec::new();
        for (i, &rank) in levels.iter().enumerate() {
            let (key, priority) = (format!("k{i:05}"), Priority::of_rank(rank));
            let before = held(&s, &written);
            match put_with(&s, &key, &[b'v'; 100], priority) {
                Ok(_) => written.push((key, priority)),
                Err(CacheError::Full { .. }) => {
                    prop_assert_eq!(&held(&s, &written), &before, "a refused write changes nothing");
                    let pinned = before.iter().filter(|(_, p)| *p == Priority::NotRemovable).count() as u64;
                    prop_assert!((pinned + 1) * per_item > per_item * 40, "refused only when it cannot fit");
                    continue;
                }
                Err(e) => return Err(TestCaseError::fail(format!("{e}"))),
            }
            let after = held(&s, &written);
            let evicted: Vec<Priority> =
                before.iter().filter(|b| !after.contains(b)).map(|(_, p)| *p).collect();
            let lowest_left = after.iter().map(|(_, p)| *p).filter(|p| *p != Priority::NotRemovable).min();
            for p in &evicted {
                prop_assert!(*p != Priority::NotRemovable, "a not_removable item was evicted");
                prop_assert!(lowest_left.is_none_or(|l| *p <= l), "evicted {:?} while {:?} was left", p, lowest_left);
            }
            prop_assert!(s.stats().bytes <= per_item * 40);
        }
    }
}

#[tokio::test(start_paused = true)]
async fn lfu_keeps_the_often_read_items_through_a_scan_that_lru_lets_evict_them() {
    let per_item = ITEM_OVERHEAD_BYTES + 8 + 100;
    let value = [b'x'; 100];
    let mut survivors = Vec::new();
    for policy in [EvictionPolicy::Lfu, EvictionPolicy::Lru] {
        let s = store(per_item * 300).with_policy(policy);
        for i in 0..100 {
            put_with(&s, &format!("hot{i:05}"), &value, Priority::Normal).expect("put");
        }
        for _ in 0..50 {
            for i in 0..100 {
                get(&s, &format!("hot{i:05}"));
            }
        }
        tokio::time::advance(Duration::from_secs(30)).await;
        // A scan: one-off items, each more recent than every read of the hot ones.
        for i in 0..1000 {
            put_with(&s, &format!("scan{i:05}"), &value, Priority::Normal).expect("put");
            tokio::time::advance(Duration::from_millis(10)).await;
        }
        survivors.push((0..100).filter(|i| get(&s, &format!("hot{i:05}")).is_some()).count());
    }
    let (lfu, lru) = (survivors[0], survivors[1]);
    assert!(lfu >= 80, "LFU keeps what is read often: {lfu}/100");
    assert!(lru <= 20, "LRU lets the scan push it out: {lru}/100");
}

#[test]
fn a_write_that_does_not_fit_beside_not_removable_items_is_refused_under_every_policy() {
    let per_item = ITEM_OVERHEAD_BYTES + 5 + 100;
    for policy in [EvictionPolicy::Lru, EvictionPolicy::Lfu, EvictionPolicy::Priority] {
        let s = store(per_item * 10).with_policy(policy);
        for i in 0..10 {
            put_with(&s, &format!("p{i:04}"), &[b'v'; 100], Priority::NotRemovable).expect("fits");
        }
        let err = put_with(&s, "n0000", &[b'v'; 100], Priority::High).expect_err("no room");
        assert!(matches!(err, CacheError::Full { .. }), "{policy:?}: {err}");
        assert_eq!(s.stats().items, 10);
        // Replacing a pinned item by one as large fits; lowering its priority frees its room.
        put_with(&s, "p0000", &[b'w'; 100], Priority::NotRemovable).expect("a replacement fits");
        put_with(&s, "p0001", &[b'w'; 100], Priority::Low).expect("lowered");
        put_with(&s, "n0000", &[b'v'; 100], Priority::Normal).expect("now it fits");
        assert!(get(&s, "p0001").is_none() || get(&s, "n0000").is_none(), "one of the two made room");
        assert!((2..10).all(|i| get(&s, &format!("p{i:04}")).is_some()), "{policy:?}: pinned items stay");
    }
}

#[test]
fn a_refused_write_says_what_the_not_removable_items_hold_without_it() {
    let per_item = ITEM_OVERHEAD_BYTES + 5 + 100;
    let s = store(per_item * 10 + per_item / 2);
    for i in 0..10 {
        put_with(&s, &format!("p{i:04}"), &[b'v'; 100], Priority::NotRemovable).expect("fits");
    }
    let err = put_with(&s, "p0010", &[b'v'; 100], Priority::NotRemovable).expect_err("no room");
    assert_eq!(err, CacheError::Full { charged: per_item, pinned: per_item * 10, limit: per_item * 10 + per_item / 2 });
    assert!(err.to_string().starts_with(&format!("the cache holds {} bytes", per_item * 10)), "{err}");
    assert_eq!(s.stats().bytes, per_item * 10);
}

#[test]
fn not_removable_writes_in_parallel_never_take_the_store_past_its_limit() {
    let per_item = ITEM_OVERHEAD_BYTES + 6 + 1000;
    for round in 0..20 {
        let s = std::sync::Arc::new(store(per_item * 100));
        let writers: Vec<_> = (0..4)
            .map(|w| {
                let s = s.clone();
                std::thread::spawn(move || {
                    for i in 0..60 {
                        let _ = put_with(&s, &format!("{w}{i:05}"), &[b'v'; 1000], Priority::NotRemovable);
                    }
                })
            })
            .collect();
        for w in writers {
            w.join().expect("writer");
        }
        assert!(s.stats().bytes <= per_item * 100, "round {round}: {} > {}", s.stats().bytes, per_item * 100);
        assert_eq!(s.stats().items, 100, "round {round}: the store fills to its limit exactly");
    }
}

/// The owner's reads keep the replica's copy of a sliding item alive: each read that moves
/// its expiry into another tenth of the window is kept for the replica (at most once per tenth
/// of the window, however many reads), a tenth later than the owner's, and the replica that
/// applies them holds the item as long as the owner does; a copy at another version is left
/// alone.
#[tokio::test(start_paused = true)]
async fn the_owner_s_reads_keep_the_replica_copy_of_a_sliding_item_alive_at_bounded_cost() {
    let clock = Clock::new();
    let (owner, replica) = (CacheStore::new(u64::MAX, clock), CacheStore::new(u64::MAX, clock));
    owner.keep_evictions();
    let bucket = bucket_of(b"s");
    let write = Write { key: b"s", value: b"v", sliding: Some(Duration::from_secs(3)), ..Default::default() };
    owner.put(bucket, &write).expect("put");
    let sent = owner.export_item(bucket, b"s").expect("the item");
    replica.apply_changes(bucket, &[Change::Put(sent.clone())]);
    // Reads every 30 ms for 9 s: three windows, 300 reads.
    let mut refreshes = Vec::new();
    for _ in 0..300 {
        tokio::time::advance(Duration::from_millis(30)).await;
        assert!(get(&owner, "s").is_some());
        refreshes.extend(owner.take_refreshed());
    }
    assert!((25..=31).contains(&refreshes.len()), "one per tenth of the window: {}", refreshes.len());
    let changes: Vec<Change> = refreshes
        .iter()
        .map(|r| Change::Expire { key: r.key.clone(), version: r.version, expires_at_ms: r.expires_at_ms })
        .collect();
    replica.apply_changes(bucket, &changes);
    // Its last expiry on the owner is 3 s after the last read; the replica's a tenth later.
    tokio::time::advance(Duration::from_millis(2900)).await;
    let live = |s: &CacheStore| s.export_item(bucket, b"s").is_some_and(|i| i.expires_at_ms > clock.now_ms());
    assert!(live(&replica) && live(&owner), "the replica's copy lives as long as the owner's");
    tokio::time::advance(Duration::from_millis(500)).await;
    assert!(replica.sweep_expired(BucketId::all()) == 1, "it expires on the replica too, a tenth later at most");
    // An expiry for another version changes nothing.
    let stale = CacheStore::new(u64::MAX, clock);
    stale.apply_changes(bucket, &[Change::Put(ExportedItem { version: sent.version + 1, ..sent.clone() })]);
    let before = stale.export_item(bucket, b"s").expect("the item").expires_at_ms;
    stale.apply_changes(
        bucket,
        &[Change::Expire { key: sent.key.clone(), version: sent.version, expires_at_ms: u64::MAX / 2 }],
    );
    assert_eq!(stale.export_item(bucket, b"s").expect("the item").expires_at_ms, before);
}
