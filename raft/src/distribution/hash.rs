//! Which bucket a key belongs to.
//!
//! The hash is xxh3-64 with a fixed seed, so every node, process, platform and release puts
//! a key in the same bucket (hashbrown's per-process random seed must never be used here).

use super::{BucketId, BUCKET_COUNT};

/// Seed of the routing hash. Changing it moves every key: never change it.
const ROUTING_SEED: u64 = 0x5348_4f41_4c00_0001; // "SHOAL" + format 1

/// The part of `key` that decides its bucket (Redis-style hash tags).
///
/// When the key contains `{...}` with at least one byte between the first `{` and the next
/// `}`, only those bytes are hashed, so `user:{42}:name` and `user:{42}:mail` share a bucket.
/// Otherwise (no braces, `{}` empty, or no closing brace) the whole key is hashed.
pub fn routing_key_of(key: &[u8]) -> &[u8] {
    if let Some(open) = key.iter().position(|&b| b == b'{') {
        let rest = &key[open + 1..];
        if let Some(close) = rest.iter().position(|&b| b == b'}') {
            if close > 0 {
                return &rest[..close];
            }
        }
    }
    key
}

/// The bucket of `key`: `xxh3(routing_key_of(key)) mod 1000`.
pub fn bucket_of(key: &[u8]) -> BucketId {
    let hash = xxhash_rust::xxh3::xxh3_64_with_seed(routing_key_of(key), ROUTING_SEED);
    BucketId((hash % BUCKET_COUNT as u64) as u16)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hash_tags_select_the_text_inside_the_first_braces() {
        assert_eq!(routing_key_of(b"user:{42}:name"), b"42");
        assert_eq!(routing_key_of(b"{a}{b}"), b"a");
        assert_eq!(routing_key_of(b"x{}y{z}"), b"x{}y{z}");
        assert_eq!(routing_key_of(b"no-tag"), b"no-tag");
        assert_eq!(routing_key_of(b"open{only"), b"open{only");
        assert_eq!(routing_key_of(b"}{x}"), b"x");
    }

    #[test]
    fn keys_with_the_same_tag_share_a_bucket() {
        assert_eq!(bucket_of(b"user:{42}:name"), bucket_of(b"user:{42}:mail"));
        assert_eq!(bucket_of(b"{42}"), bucket_of(b"42"));
    }

    #[test]
    fn buckets_are_stable_across_releases() {
        // Pinned values: if this test fails, the routing hash changed and every existing
        // cluster would lose track of its keys.
        let pinned: Vec<u16> = ["", "a", "hello", "user:{42}:name", "key:000000000001"]
            .iter()
            .map(|k| bucket_of(k.as_bytes()).0)
            .collect();
        assert_eq!(pinned, PINNED);
    }

    const PINNED: [u16; 5] = [697, 292, 15, 812, 406];

    #[test]
    fn keys_spread_over_every_bucket() {
        let mut counts = vec![0u32; BUCKET_COUNT];
        for i in 0..200_000 {
            counts[bucket_of(format!("key:{i}").as_bytes()).index()] += 1;
        }
        let (min, max) = (counts.iter().min().copied(), counts.iter().max().copied());
        assert!(min.unwrap_or(0) > 120, "min {min:?}");
        assert!(max.unwrap_or(u32::MAX) < 290, "max {max:?}");
    }
}
