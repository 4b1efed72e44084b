//! Eviction priorities through the API: `not_removable` items survive any amount of other
//! writes, forwarded or not, and a write that cannot fit beside them is refused with 507.

use shoal::cache::EvictionPolicy;
use shoal::config::ServeConfig;

use crate::harness::TestCluster;

/// A small cache (each member's own share: 512 KiB) that evicts by priority.
fn small_by_priority(config: &mut ServeConfig) {
    config.cache_size = 1024 * 1024;
    config.eviction = EvictionPolicy::Priority;
}

async fn put(c: &TestCluster, slot: usize, key: &str, priority: &str) -> (u16, String) {
    let url = c.url(slot, &format!("/v1/kv/{key}?priority={priority}"));
    let r = c.http.put(url).body("v".repeat(1000)).send().await.expect("put");
    let status = r.status().as_u16();
    (status, r.text().await.expect("body"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn not_removable_items_outlive_every_other_write_and_a_write_that_cannot_fit_is_refused_with_507() {
    let c = TestCluster::start_with(3, small_by_priority).await;
    c.wait_for_counts(&[333, 333, 334]).await;
    c.wait_all_attached().await;
    let (status, body) = put(&c, 0, "k", "urgent").await;
    assert_eq!(status, 400, "{body}");
    // Pinned items in one bucket ({pin}), written through every node, until the owner is full.
    let mut pinned = Vec::new();
    let refusal = loop {
        let key = format!("{{pin}}:{}", pinned.len());
        let (status, body) = put(&c, pinned.len() % 3, &key, "not_removable").await;
        match status {
            200 => pinned.push(key),
            507 => break body,
            other => panic!("{key}: {other} {body}"),
        }
        assert!(pinned.len() < 2000, "the cache never filled");
    };
    assert!(refusal.contains("insufficient_storage") && refusal.contains("not_removable"), "{refusal}");
    assert!(pinned.len() > 300, "most of the owner's share took pinned items: {}", pinned.len());
    // Other writes, far more than fits, of every other priority: they evict each other only.
    let levels = ["low", "below_normal", "normal", "above_normal", "high"];
    for i in 0..3000 {
        let key = format!("other-{i}");
        let (status, body) = put(&c, i % 3, &key, levels[i % levels.len()]).await;
        // The pinned bucket's owner has no room left for items of its own buckets either.
        assert!(status == 200 || status == 507, "{key}: {status} {body}");
    }
    for key in &pinned {
        assert!(c.get(1, key).await.is_some(), "pinned {key} was evicted");
    }
    c.shutdown().await;
}
