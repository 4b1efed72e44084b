//! Shadows: the node that handed a bucket over keeps a copy until the transfer is complete,
//! and the new owner writes through to it before acknowledging a write (the write plan names
//! it, `crate::bucket`). If the new owner crashes before the transfer ends, it gets its buckets
//! back from the shadows when it restarts (the reconciler's restore, served by replication's
//! `copy_back`): nothing it acknowledged is lost.
//!
//! ```text
//!  client ── PUT k ──▶ new owner B: permit, write locally ── Shadow b (link) ──▶ A
//!         ◀── 200 ────  (after A applied it, or A could not be reached: logged)
//! ```

use std::time::Duration;

use bytes::Bytes;
use serde::{Deserialize, Serialize};
use shoal_raft::BucketId;

use super::export::Exporter;
use crate::transport::frame::decode_body;
use crate::transport::{wire, Endpoint, Malformed};

/// Writes of a bucket for the shadow the previous owner keeps during a transfer.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ShadowWrites {
    /// The bucket.
    pub bucket: BucketId,
    /// Framed changes (`transport::frame`).
    #[serde(deserialize_with = "wire::shared::deserialize")]
    pub body: Bytes,
}

impl Endpoint for ShadowWrites {
    type Answer = ();
    const ID: u8 = wire::id::SHADOW;
    const CARRIES_DATA: bool = true;

    fn check(&self) -> Result<(), Malformed> {
        wire::check_bucket(self.bucket)
    }
}

/// How long a shadow waits for the move that makes it one, before refusing a write-through.
const SHADOW_WAIT: Duration = Duration::from_secs(2);

impl Exporter {
    /// [`ShadowWrites`]: applies the owner's writes to this node's shadow
    /// copy. Refused (409) when this node holds no shadow of the bucket, 400 for a bad body.
    pub async fn apply_shadow(&self, bucket: BucketId, body: Bytes) -> Result<(), (u16, String)> {
        let me = self.control.node_id();
        // The new owner may have applied the move a moment before this node.
        if self.control.state().shadow_of(bucket) != Some(me) {
            self.control.wait_for_state(SHADOW_WAIT, |s| s.shadow_of(bucket) == Some(me)).await;
        }
        if self.control.state().shadow_of(bucket) != Some(me) {
            return Err((409, format!("node {me} holds no shadow of bucket {bucket}")));
        }
        let (changes, _) = decode_body(body).map_err(|e| (400, e.to_string()))?;
        // Asked again under the bucket's lock: a write-through that arrives as the transfer
        // ends must not land in a copy this node no longer keeps as the shadow (it may own the
        // bucket again by then, and a put would bring back a key it deleted since).
        let still_shadow = || self.control.state().shadow_of(bucket) == Some(me);
        if !self.cache.apply_changes_while(bucket, &changes, still_shadow) {
            return Err((409, format!("node {me} no longer holds the shadow of bucket {bucket}")));
        }
        Ok(())
    }
}
