//! shoal: a distributed in-memory cache.
//!
//! # Layout
//! - [`cache`]: the store of the buckets this node holds.

pub mod cache;
