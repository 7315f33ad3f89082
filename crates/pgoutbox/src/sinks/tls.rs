//! TLS settings shared by the sinks: which certificate authorities a destination's server
//! certificate must chain to, and the client certificate to present (mutual TLS).
//!
//! Every sink that speaks TLS takes the same `tls` table:
//!
//! ```toml
//! tls = { ca_file = "/etc/pgoutbox/ca.pem", cert_file = "/etc/pgoutbox/relay.pem", key_file = "/run/credentials/relay.key" }
//! ```
//!
//! The files are read and parsed when the configuration loads, so a missing file or a PEM with no
//! certificate in it stops the relay before it starts, naming the key. Encryption itself is
//! switched on by the URL's scheme (`https://`, `rediss://`, `mqtts://`, `amqps://`, `tls://`);
//! `tls` only says whom to trust and who we are. Certificates are verified against `ca_file`
//! alone when it is set, else against the system's trust store; the host name is always checked.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use serde::Deserialize;

/// Selects ring as the process's rustls crypto provider. The database driver, the HTTP client
/// and the sinks' clients all use rustls, and with two providers compiled in (the dependency
/// graph holds both) rustls cannot pick one itself: the first TLS handshake would panic. The
/// binary calls this before anything else; a program embedding the library calls it before its
/// first connection. Calling it again does nothing.
pub fn install_crypto_provider() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}

/// The `tls` table of a destination.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TlsConfig {
    /// PEM file of the certificate authorities to trust instead of the system's.
    pub ca_file: Option<PathBuf>,
    /// PEM file of the client certificate (its chain may follow it), for mutual TLS.
    pub cert_file: Option<PathBuf>,
    /// PEM file of the client certificate's private key (PKCS#8, PKCS#1 or SEC1, unencrypted).
    pub key_file: Option<PathBuf>,
}

/// What a [`TlsConfig`] named, read and checked.
#[derive(Clone)]
pub struct TlsFiles {
    /// The CA bundle as written (PEM), when one was given.
    pub ca_pem: Option<Vec<u8>>,
    /// The client certificate chain and key (PEM), when given.
    pub identity: Option<Identity>,
}

/// A client certificate chain and its key, as PEM.
#[derive(Clone)]
pub struct Identity {
    /// The certificate chain, leaf first.
    pub cert_pem: Vec<u8>,
    /// The private key.
    pub key_pem: Vec<u8>,
}

impl std::fmt::Debug for TlsFiles {
    // The key is a secret; the rest is noise in a log.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TlsFiles")
            .field("ca_file", &self.ca_pem.is_some())
            .field("client_certificate", &self.identity.is_some())
            .finish()
    }
}

impl TlsConfig {
    /// True when the table sets nothing.
    pub fn is_empty(&self) -> bool {
        self.ca_file.is_none() && self.cert_file.is_none() && self.key_file.is_none()
    }

    /// Reads and checks the files; `None` when the table sets nothing. Errors name the key.
    pub fn load(&self) -> Result<Option<TlsFiles>, String> {
        if self.is_empty() {
            return Ok(None);
        }
        let ca_pem = match &self.ca_file {
            Some(path) => {
                let pem = read("tls.ca_file", path)?;
                certificates("tls.ca_file", path, &pem)?;
                Some(pem)
            }
            None => None,
        };
        let identity = match (&self.cert_file, &self.key_file) {
            (Some(cert), Some(key)) => {
                let cert_pem = read("tls.cert_file", cert)?;
                certificates("tls.cert_file", cert, &cert_pem)?;
                let key_pem = read("tls.key_file", key)?;
                PrivateKeyDer::from_pem_slice(&key_pem).map_err(|e| {
                    format!(
                        "key `tls.key_file`: no private key in {} ({e}); an unencrypted PKCS#8, PKCS#1 or SEC1 PEM key is needed",
                        key.display()
                    )
                })?;
                Some(Identity { cert_pem, key_pem })
            }
            (None, None) => None,
            _ => {
                return Err(
                    "key `tls`: `cert_file` and `key_file` go together (a client certificate needs its key)"
                        .into(),
                )
            }
        };
        Ok(Some(TlsFiles { ca_pem, identity }))
    }

    /// [`TlsConfig::load`] for a connection that is `encrypted` or not: a `tls` table where TLS
    /// is off is refused before any file is read, the error naming what turns it off (`plain`:
    /// "a URL that is not mqtts://", say).
    pub fn load_for(&self, encrypted: bool, plain: &str) -> Result<Option<TlsFiles>, String> {
        if !self.is_empty() && !encrypted {
            return Err(format!("key `tls`: set for {plain}"));
        }
        self.load()
    }
}

impl TlsFiles {
    /// No CA and no client certificate: the system's trust store, for a TLS URL with no `tls`.
    pub fn system() -> Self {
        Self {
            ca_pem: None,
            identity: None,
        }
    }

    /// A rustls client configuration: trusts `ca_file` (else the system's roots) and presents
    /// the client certificate when there is one.
    pub fn client_config(&self) -> Result<rustls::ClientConfig, String> {
        let mut roots = rustls::RootCertStore::empty();
        match &self.ca_pem {
            None => {
                let native = rustls_native_certs::load_native_certs();
                roots.add_parsable_certificates(native.certs);
            }
            Some(pem) => {
                for cert in CertificateDer::pem_slice_iter(pem) {
                    let cert = cert.map_err(|e| format!("key `tls.ca_file`: {e}"))?;
                    roots
                        .add(cert)
                        .map_err(|e| format!("key `tls.ca_file`: unusable certificate: {e}"))?;
                }
            }
        }
        let builder = rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .map_err(|e| format!("TLS set-up failed: {e}"))?
        .with_root_certificates(roots);
        match &self.identity {
            Some(id) => {
                let chain = CertificateDer::pem_slice_iter(&id.cert_pem)
                    .collect::<Result<Vec<_>, _>>()
                    .map_err(|e| format!("key `tls.cert_file`: {e}"))?;
                let key = PrivateKeyDer::from_pem_slice(&id.key_pem)
                    .map_err(|e| format!("key `tls.key_file`: {e}"))?;
                builder
                    .with_client_auth_cert(chain, key)
                    .map_err(|e| format!("key `tls.cert_file`: the certificate and key do not make a client identity: {e}"))
            }
            None => Ok(builder.with_no_client_auth()),
        }
    }
}

fn read(key: &str, path: &Path) -> Result<Vec<u8>, String> {
    std::fs::read(path).map_err(|e| format!("key `{key}`: cannot read {}: {e}", path.display()))
}

fn certificates(
    key: &str,
    path: &Path,
    pem: &[u8],
) -> Result<Vec<CertificateDer<'static>>, String> {
    let certs = CertificateDer::pem_slice_iter(pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("key `{key}`: {} is not PEM: {e}", path.display()))?;
    if certs.is_empty() {
        return Err(format!(
            "key `{key}`: no certificate in {} (a PEM file with `-----BEGIN CERTIFICATE-----` is needed)",
            path.display()
        ));
    }
    Ok(certs)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_empty_table_is_no_tls_and_half_an_identity_is_an_error() {
        assert!(TlsConfig::default().load().expect("empty").is_none());
        let e = TlsConfig {
            cert_file: Some("/x.pem".into()),
            ..Default::default()
        }
        .load()
        .expect_err("cert without key");
        assert!(e.contains("go together"), "{e}");
        let e = TlsConfig {
            ca_file: Some("/nonexistent/ca.pem".into()),
            ..Default::default()
        }
        .load()
        .expect_err("missing file");
        assert!(
            e.contains("tls.ca_file") && e.contains("/nonexistent/ca.pem"),
            "{e}"
        );
        let dir = std::env::temp_dir().join(format!("pgoutbox-tls-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let not_pem = dir.join("ca.pem");
        std::fs::write(&not_pem, "hello").expect("write");
        let e = TlsConfig {
            ca_file: Some(not_pem),
            ..Default::default()
        }
        .load()
        .expect_err("no certificate");
        assert!(e.contains("no certificate"), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
