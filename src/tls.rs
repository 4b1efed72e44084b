//! TLS for both listeners and for every connection a node makes (`--tls-cert`, `--tls-key`,
//! `--tls-ca`).
//!
//! A node with TLS serves its client API and its peer listener over HTTPS with one
//! certificate, and speaks HTTPS to every peer, verifying the peer's certificate against the
//! CA of `--tls-ca` (and the address it dials: a DNS name or an IP address the certificate
//! must name). There is no plain-HTTP fallback: a cluster runs all TLS or none, and the cluster
//! secret still authenticates members (the certificates authenticate servers only).
//!
//! The certificate and key are read again when their files change (checked every
//! [`RELOAD_EVERY`]), so that a renewal (cert-manager writes the Secret's new files into the
//! pod) takes effect without a restart; a renewal that does not parse keeps the old one and
//! says so. rustls with its `ring` provider does the work; PEM is parsed by rustls's own types.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use arc_swap::ArcSwap;
use rustls::crypto::CryptoProvider;
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use rustls::{ClientConfig, RootCertStore, ServerConfig};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};

/// How often the certificate and key files are checked for a renewal.
pub const RELOAD_EVERY: Duration = Duration::from_secs(30);

/// How long a client may take to finish its TLS handshake before its connection is closed.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// The crypto provider of every TLS configuration here.
fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// Reads the CA certificates of a PEM file (one or more).
pub fn read_ca(path: &Path) -> Result<Vec<CertificateDer<'static>>, String> {
    let pem = std::fs::read(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    ca_from_pem(&pem).map_err(|e| format!("{}: {e}", path.display()))
}

/// The certificates of PEM text; at least one.
pub fn ca_from_pem(pem: &[u8]) -> Result<Vec<CertificateDer<'static>>, String> {
    let certs = CertificateDer::pem_slice_iter(pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("not PEM certificates: {e}"))?;
    if certs.is_empty() {
        return Err("holds no PEM certificate (-----BEGIN CERTIFICATE-----)".into());
    }
    Ok(certs)
}

/// A client configuration that trusts the CA certificates `ca` only.
pub fn client_config(ca: &[CertificateDer<'static>]) -> Result<Arc<ClientConfig>, String> {
    let mut roots = RootCertStore::empty();
    for cert in ca {
        roots.add(cert.clone()).map_err(|e| format!("not a usable CA certificate: {e}"))?;
    }
    let config = ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .with_root_certificates(roots)
        .with_no_client_auth();
    Ok(Arc::new(config))
}

/// What a node with TLS needs: how it serves and how it connects.
#[derive(Clone, Debug)]
pub struct NodeTls {
    /// The listeners' configuration (its certificate follows the files).
    pub server: Arc<ServerConfig>,
    /// The peers' CA, for every connection this node makes.
    pub client: Arc<ClientConfig>,
    /// The certificate that follows its files.
    pub cert: Arc<ReloadingCert>,
}

impl NodeTls {
    /// Loads the certificate chain, its key and the CA; any of them missing or unusable is an
    /// error naming the file.
    pub fn load(cert: &Path, key: &Path, ca: &Path) -> Result<Self, String> {
        let reloading = Arc::new(ReloadingCert::load(cert, key)?);
        let server = ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| e.to_string())?
            .with_no_client_auth()
            .with_cert_resolver(reloading.clone());
        Ok(NodeTls { server: Arc::new(server), client: client_config(&read_ca(ca)?)?, cert: reloading })
    }

    /// The acceptor the listeners wrap their connections in.
    pub fn acceptor(&self) -> tokio_rustls::TlsAcceptor {
        tokio_rustls::TlsAcceptor::from(self.server.clone())
    }
}

/// A certificate and key read from files, read again when the files change.
#[derive(Debug)]
pub struct ReloadingCert {
    cert_path: PathBuf,
    key_path: PathBuf,
    current: ArcSwap<CertifiedKey>,
    /// The files' modification times and lengths when last read.
    stamp: parking_lot::Mutex<Stamp>,
}

type Stamp = [Option<(SystemTime, u64)>; 2];

fn stamp_of(paths: [&Path; 2]) -> Stamp {
    paths.map(|p| std::fs::metadata(p).ok().and_then(|m| Some((m.modified().ok()?, m.len()))))
}

impl ReloadingCert {
    /// Reads the certificate chain and key.
    pub fn load(cert: &Path, key: &Path) -> Result<Self, String> {
        let stamp = stamp_of([cert, key]);
        let certified = certified_key(cert, key)?;
        Ok(ReloadingCert {
            cert_path: cert.to_path_buf(),
            key_path: key.to_path_buf(),
            current: ArcSwap::from_pointee(certified),
            stamp: parking_lot::Mutex::new(stamp),
        })
    }

    /// Reads the files again if they changed since the last read: `Ok(true)` when a new
    /// certificate is in use, an error (the old one stays) when the new files do not load.
    pub fn reload_if_changed(&self) -> Result<bool, String> {
        let stamp = stamp_of([&self.cert_path, &self.key_path]);
        if *self.stamp.lock() == stamp {
            return Ok(false);
        }
        // Marked read even when it fails: the error is said once per change of the files.
        *self.stamp.lock() = stamp;
        let certified = certified_key(&self.cert_path, &self.key_path)?;
        self.current.store(Arc::new(certified));
        Ok(true)
    }

    /// Follows the files until `self` is dropped elsewhere (every [`RELOAD_EVERY`]).
    pub fn follow(self: &Arc<Self>) {
        let weak = Arc::downgrade(self);
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(RELOAD_EVERY).await;
                let Some(cert) = weak.upgrade() else { return };
                match cert.reload_if_changed() {
                    Ok(true) => {
                        tracing::info!(cert = %cert.cert_path.display(), "TLS certificate renewed: new connections use it")
                    }
                    Ok(false) => {}
                    Err(e) => {
                        tracing::warn!(error = %e, "the TLS certificate files changed but do not load; the old certificate stays in use")
                    }
                }
            }
        });
    }

    /// The certificate in use.
    pub fn current(&self) -> Arc<CertifiedKey> {
        self.current.load_full()
    }
}

impl ResolvesServerCert for ReloadingCert {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.current())
    }
}

/// The certificate chain of `cert` with the key of `key`, checked to belong together.
fn certified_key(cert: &Path, key: &Path) -> Result<CertifiedKey, String> {
    let chain_pem = std::fs::read(cert).map_err(|e| format!("--tls-cert: cannot read {}: {e}", cert.display()))?;
    let chain = CertificateDer::pem_slice_iter(&chain_pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("--tls-cert {}: not PEM certificates: {e}", cert.display()))?;
    if chain.is_empty() {
        return Err(format!("--tls-cert {}: holds no PEM certificate", cert.display()));
    }
    let key_pem = std::fs::read(key).map_err(|e| format!("--tls-key: cannot read {}: {e}", key.display()))?;
    let key_der = PrivateKeyDer::from_pem_slice(&key_pem)
        .map_err(|e| format!("--tls-key {}: not a PEM private key: {e}", key.display()))?;
    let signing = provider()
        .key_provider
        .load_private_key(key_der)
        .map_err(|e| format!("--tls-key {}: unusable key: {e}", key.display()))?;
    let certified = CertifiedKey::new(chain, signing);
    certified.keys_match().map_err(|e| {
        format!("--tls-key {} is not the key of the certificate in --tls-cert {}: {e}", key.display(), cert.display())
    })?;
    Ok(certified)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
        let path = dir.join(name);
        std::fs::write(&path, text).expect("write");
        path
    }

    struct Issued {
        cert: String,
        key: String,
    }

    fn ca() -> (rcgen::Issuer<'static, rcgen::KeyPair>, String) {
        let key = rcgen::KeyPair::generate().expect("key");
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).expect("params");
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        let cert = params.self_signed(&key).expect("CA");
        (rcgen::Issuer::new(params, key), cert.pem())
    }

    fn issue(issuer: &rcgen::Issuer<'static, rcgen::KeyPair>, name: &str) -> Issued {
        let key = rcgen::KeyPair::generate().expect("key");
        let params = rcgen::CertificateParams::new(vec![name.to_string()]).expect("params");
        let cert = params.signed_by(&key, issuer).expect("leaf");
        Issued { cert: cert.pem(), key: key.serialize_pem() }
    }

    #[test]
    fn a_node_loads_its_files_and_says_which_one_is_wrong() {
        let dir = tempfile::tempdir().expect("dir");
        let (issuer, ca_pem) = ca();
        let leaf = issue(&issuer, "127.0.0.1");
        let other = issue(&issuer, "127.0.0.1");
        let cert = write(dir.path(), "tls.crt", &leaf.cert);
        let key = write(dir.path(), "tls.key", &leaf.key);
        let ca = write(dir.path(), "ca.crt", &ca_pem);
        NodeTls::load(&cert, &key, &ca).expect("loads");

        let wrong_key = write(dir.path(), "other.key", &other.key);
        let e = NodeTls::load(&cert, &wrong_key, &ca).expect_err("a key of another certificate");
        assert!(e.contains("is not the key of the certificate"), "{e}");
        let e = NodeTls::load(&cert, &dir.path().join("missing.key"), &ca).expect_err("no key file");
        assert!(e.starts_with("--tls-key: cannot read"), "{e}");
        let e = NodeTls::load(&key, &key, &ca).expect_err("a key where the certificate should be");
        assert!(e.contains("holds no PEM certificate"), "{e}");
        let e = NodeTls::load(&cert, &key, &key).expect_err("a key where the CA should be");
        assert!(e.contains("holds no PEM certificate"), "{e}");
    }

    #[test]
    fn a_renewed_certificate_is_used_once_its_files_change_and_a_broken_one_is_not() {
        let dir = tempfile::tempdir().expect("dir");
        let (issuer, _) = ca();
        let first = issue(&issuer, "127.0.0.1");
        let (cert, key) = (write(dir.path(), "tls.crt", &first.cert), write(dir.path(), "tls.key", &first.key));
        let reloading = ReloadingCert::load(&cert, &key).expect("loads");
        let before = reloading.current();
        assert_eq!(reloading.reload_if_changed(), Ok(false), "nothing changed");

        // A renewal: new files (longer or not, the stamp includes the length and the time).
        let renewed = issue(&issuer, "127.0.0.1");
        std::fs::write(&cert, format!("{}\n", renewed.cert)).expect("write");
        std::fs::write(&key, format!("{}\n", renewed.key)).expect("write");
        assert_eq!(reloading.reload_if_changed(), Ok(true));
        assert_ne!(reloading.current().cert, before.cert, "the renewed certificate is in use");

        // Half a renewal (the certificate without its key): the old one stays.
        let in_use = reloading.current();
        let third = issue(&issuer, "127.0.0.1");
        std::fs::write(&cert, third.cert).expect("write");
        assert!(reloading.reload_if_changed().is_err());
        assert_eq!(reloading.current().cert, in_use.cert);
    }
}
