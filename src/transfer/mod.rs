//! State transfer: when the map changes, buckets move with their data.
//!
//! A node's part of it (the reconciler, `crate::reconcile`, decides when):
//! - it acknowledges every pending map of a transition, so the leader can end it;
//! - the **puller** brings in the buckets the target map gives this node, one at a time
//!   (or `--transfer-parallelism` at a time), from whoever serves each now, and asks the
//!   leader to flip each one here once it holds the data;
//! - the **exporter** (`GET /internal/transfer/{bucket}` on the peer listener) streams a
//!   bucket this node serves to its new owner, and freezes it until the flip is settled.
//!
//! The protocol and its invariant (one writable owner per bucket at every moment, no lost
//! write) are in `raft/DESIGN.md`.
//!
//! # Layout
//! - `export.rs`: the source side.
//! - `import.rs`: the receiving side.
//! - `progress.rs`: counters for `/v1/cluster/transfer`, metrics and the stuck detector.
//! - `shadow.rs`: the previous owner's shadow copy and the new owner's write-through.
//! - `found.rs`: a lost bucket's last server, back after it was failed, gives its copy back.
//! - `stuck.rs`: the leader's stuck-transfer detector.

pub mod export;
pub mod found;
pub mod import;
pub mod progress;
pub mod shadow;
pub mod stuck;

use std::time::Duration;

use crate::transport::wire::{Handlers, Json};
use crate::transport::CallError;

/// How transfers run (from the command line).
#[derive(Debug, Clone, Copy)]
pub struct TransferConfig {
    /// Buckets pulled at once (default 1).
    pub parallelism: usize,
    /// Most bytes per second one export sends (0: unlimited).
    pub rate_bytes_per_sec: u64,
    /// How long opening a bucket stream may take, every connect attempt the reconnect policy
    /// makes included (`Reconnect::total`: 34 s with the default 10 s connect timeout).
    pub open_timeout: Duration,
    /// How often the leader checks transfers for progress (30 s).
    pub check_interval: Duration,
    /// No transfer activity for this long means stuck (3 min).
    pub stuck_after: Duration,
}

impl Default for TransferConfig {
    fn default() -> Self {
        TransferConfig {
            parallelism: 1,
            rate_bytes_per_sec: 0,
            open_timeout: crate::transport::http::Reconnect::default().total(),
            check_interval: Duration::from_secs(30),
            stuck_after: Duration::from_secs(180),
        }
    }
}

/// Registers what the exporter answers: shadow writes, copies given back, and its progress.
pub fn register(handlers: &mut Handlers, exporter: &export::Exporter) {
    let refused = |(status, reason)| CallError::Refused { status, reason };
    handlers.add_with(exporter, move |e, w: shadow::ShadowWrites| async move {
        e.apply_shadow(w.bucket, w.body).await.map_err(refused)
    });
    handlers.add_with(exporter, move |e, g: found::GiveBack| async move {
        e.take_back(g.from, g.bucket, g.body).await.map_err(refused)
    });
    handlers.add_with(exporter, |e, _: progress::AskProgress| async move {
        Ok(Json(e.progress.status(e.control.node_id())))
    });
}
