//! The node's identity in its data dir: `node.json`.
//!
//! Written once when the node gets its id (bootstrap or registration), and again when it
//! leaves. It is what makes a restart "the same member": the id and cluster it belongs to,
//! and where it first joined (to finish a join interrupted by a crash).

use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use shoal_raft::NodeId;

/// The version of the `node.json` format this release writes and reads.
const FORMAT: u32 = 1;

/// Why `node.json` could not be read or written.
#[derive(Debug, thiserror::Error)]
pub enum IdentityError {
    /// The file system refused.
    #[error("cannot {action} {path}: {error}")]
    Io {
        /// `read` or `write`.
        action: &'static str,
        /// The file.
        path: String,
        /// What happened.
        error: std::io::Error,
    },
    /// The file is not an identity.
    #[error("{path} is corrupt: {error}")]
    Corrupt {
        /// The file.
        path: String,
        /// What the parser said.
        error: serde_json::Error,
    },
    /// The file is of a format this release does not read.
    #[error("{path} has format {found}; this release reads {FORMAT}")]
    Format {
        /// The file.
        path: String,
        /// Its format.
        found: u32,
    },
}

/// The contents of `node.json`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Identity {
    /// Format version, for future migrations.
    pub format: u32,
    /// The id the cluster assigned.
    pub node_id: NodeId,
    /// The cluster this node belongs to.
    pub cluster_id: String,
    /// The API addresses it joined through (empty for the bootstrap node).
    #[serde(default)]
    pub join: Vec<String>,
    /// Set when the node left the cluster: it must never start on this data dir again.
    #[serde(default)]
    pub retired: bool,
}

impl Identity {
    /// A new identity.
    pub fn new(node_id: NodeId, cluster_id: String, join: Vec<String>) -> Self {
        Identity { format: FORMAT, node_id, cluster_id, join, retired: false }
    }

    fn path(data_dir: &Path) -> PathBuf {
        data_dir.join("node.json")
    }

    /// Reads the identity; `Ok(None)` when the data dir has none (a new node).
    pub fn load(data_dir: &Path) -> Result<Option<Self>, IdentityError> {
        let path = Self::path(data_dir);
        let shown = || path.display().to_string();
        let bytes = match std::fs::read(&path) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(error) => return Err(IdentityError::Io { action: "read", path: shown(), error }),
        };
        let identity: Identity =
            serde_json::from_slice(&bytes).map_err(|error| IdentityError::Corrupt { path: shown(), error })?;
        // The one migration point of `node.json`: a step from each older format to the next
        // goes here (none is older yet); a newer format is refused, as this release would
        // misread it.
        if identity.format != FORMAT {
            return Err(IdentityError::Format { path: shown(), found: identity.format });
        }
        Ok(Some(identity))
    }

    /// Writes the identity atomically (temp file, fsync, rename).
    pub fn store(&self, data_dir: &Path) -> Result<(), IdentityError> {
        let path = Self::path(data_dir);
        let tmp = data_dir.join("node.json.tmp");
        let write = || -> std::io::Result<()> {
            let mut f = std::fs::File::create(&tmp)?;
            f.write_all(&serde_json::to_vec_pretty(self).map_err(std::io::Error::other)?)?;
            f.sync_all()?;
            std::fs::rename(&tmp, &path)?;
            if let Ok(dir) = std::fs::File::open(data_dir) {
                let _ = dir.sync_all();
            }
            Ok(())
        };
        write().map_err(|error| IdentityError::Io { action: "write", path: path.display().to_string(), error })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identity_round_trips_and_absence_is_none() {
        let dir = tempfile::tempdir().expect("temp dir");
        assert!(matches!(Identity::load(dir.path()), Ok(None)));
        let id = Identity::new(3, "c".into(), vec!["a:1".into()]);
        id.store(dir.path()).expect("store");
        assert_eq!(Identity::load(dir.path()).expect("readable"), Some(id));
        std::fs::write(dir.path().join("node.json"), "{").expect("write");
        assert!(matches!(Identity::load(dir.path()), Err(IdentityError::Corrupt { .. })));
    }
}
