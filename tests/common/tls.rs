//! A throwaway PKI for the TLS tests, made fresh by each test with rcgen: a CA, a server
//! certificate for 127.0.0.1 and localhost, the same server certificate expired, a client
//! certificate, and a second CA nobody trusts. Plus an HTTPS receiver that requires a client
//! certificate from the CA.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use rcgen::{
    date_time_ymd, BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair,
};

/// The certificates of one test, as PEM files in a scratch directory.
pub struct Pki {
    dir: tempfile::TempDir,
}

impl Pki {
    /// Makes every file: `ca.pem`, `server.pem`/`server.key`, `expired.pem`/`expired.key`,
    /// `client.pem`/`client.key`, `other-ca.pem` (and `other-ca.key`, unused).
    pub fn new() -> Self {
        let dir = super::scratch();
        let write = |name: &str, text: &str| {
            std::fs::write(dir.path().join(name), text).expect("write PEM");
        };
        let (ca_params, ca_key) = authority("pgoutbox test CA");
        write("ca.pem", &ca_params.self_signed(&ca_key).expect("CA").pem());
        let issuer = Issuer::new(ca_params, ca_key);

        let server_params = || {
            let mut p =
                CertificateParams::new(vec!["127.0.0.1".to_owned(), "localhost".to_owned()])
                    .expect("server params");
            p.distinguished_name.push(DnType::CommonName, "localhost");
            p.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
            p
        };
        let key = KeyPair::generate().expect("key");
        let cert = server_params().signed_by(&key, &issuer).expect("server");
        write("server.pem", &cert.pem());
        write("server.key", &key.serialize_pem());

        let mut expired = server_params();
        expired.not_before = date_time_ymd(2020, 1, 1);
        expired.not_after = date_time_ymd(2021, 1, 1);
        let key = KeyPair::generate().expect("key");
        write(
            "expired.pem",
            &expired.signed_by(&key, &issuer).expect("expired").pem(),
        );
        write("expired.key", &key.serialize_pem());

        let mut client = CertificateParams::new(Vec::<String>::new()).expect("client params");
        client.distinguished_name.push(DnType::CommonName, "relay");
        client.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        let key = KeyPair::generate().expect("key");
        write(
            "client.pem",
            &client.signed_by(&key, &issuer).expect("client").pem(),
        );
        write("client.key", &key.serialize_pem());

        let (other, other_key) = authority("somebody else's CA");
        write(
            "other-ca.pem",
            &other.self_signed(&other_key).expect("other CA").pem(),
        );
        write("other-ca.key", &other_key.serialize_pem());
        Self { dir }
    }

    /// The path of one of the files.
    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// The directory holding the files (a server's working directory may go there too).
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// A destination's `tls` line trusting `ca` (a file name here) with the client certificate.
    pub fn tls_line(&self, ca: &str) -> String {
        format!(
            "tls = {{ ca_file = {:?}, cert_file = {:?}, key_file = {:?} }}",
            self.path(ca).display().to_string(),
            self.path("client.pem").display().to_string(),
            self.path("client.key").display().to_string()
        )
    }

    /// A rustls server configuration from `cert`/`key` (file stems), requiring a client
    /// certificate from the CA.
    pub fn server_config(&self, stem: &str) -> rustls::ServerConfig {
        use rustls::pki_types::pem::PemObject;
        use rustls::pki_types::{CertificateDer, PrivateKeyDer};
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut roots = rustls::RootCertStore::empty();
        for cert in CertificateDer::pem_file_iter(self.path("ca.pem")).expect("ca") {
            roots.add(cert.expect("ca cert")).expect("add ca");
        }
        let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
            Arc::new(roots),
            provider.clone(),
        )
        .build()
        .expect("client verifier");
        let chain = CertificateDer::pem_file_iter(self.path(&format!("{stem}.pem")))
            .expect("chain")
            .collect::<Result<Vec<_>, _>>()
            .expect("certs");
        let key = PrivateKeyDer::from_pem_file(self.path(&format!("{stem}.key"))).expect("key");
        rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .expect("versions")
            .with_client_cert_verifier(verifier)
            .with_single_cert(chain, key)
            .expect("server config")
    }
}

fn authority(name: &str) -> (CertificateParams, KeyPair) {
    let mut params = CertificateParams::new(Vec::<String>::new()).expect("CA params");
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.distinguished_name.push(DnType::CommonName, name);
    (params, KeyPair::generate().expect("CA key"))
}

/// An HTTPS webhook receiver on 127.0.0.1 that answers 200 to every request from a client with a
/// certificate of the test CA, counting them.
pub struct HttpsReceiver {
    /// `https://127.0.0.1:PORT/events`.
    pub url: String,
    requests: Arc<AtomicUsize>,
    _server: tokio::task::JoinHandle<()>,
}

impl HttpsReceiver {
    /// Serves with the certificate `stem` (`server` or `expired`) of `pki`.
    pub async fn start(pki: &Pki, stem: &str) -> Self {
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(pki.server_config(stem)));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let url = format!(
            "https://127.0.0.1:{}/events",
            listener.local_addr().expect("addr").port()
        );
        let requests = Arc::new(AtomicUsize::new(0));
        let counter = requests.clone();
        let server = tokio::spawn(async move {
            loop {
                let Ok((tcp, _)) = listener.accept().await else {
                    return;
                };
                let acceptor = acceptor.clone();
                let counter = counter.clone();
                tokio::spawn(async move {
                    // A failed handshake is the client's problem to report.
                    let Ok(tls) = acceptor.accept(tcp).await else {
                        return;
                    };
                    let service = hyper::service::service_fn(move |_req| {
                        counter.fetch_add(1, Ordering::SeqCst);
                        async {
                            Ok::<_, std::convert::Infallible>(hyper::Response::new(String::new()))
                        }
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(hyper_util::rt::TokioIo::new(tls), service)
                        .await;
                });
            }
        });
        Self {
            url,
            requests,
            _server: server,
        }
    }

    /// Requests answered so far.
    pub fn count(&self) -> usize {
        self.requests.load(Ordering::SeqCst)
    }
}

/// A TLS front for a plaintext server (Tansu, which has no TLS listener of its own): accepts TLS
/// with the certificate `stem` of `pki`, requires a client certificate from the CA, and relays
/// the decrypted bytes to `127.0.0.1:backend`.
pub struct TlsFront {
    /// The port the front listens on.
    pub port: u16,
    _server: tokio::task::JoinHandle<()>,
}

impl TlsFront {
    /// Binds a free port now (so a server can advertise it before it starts); relays to
    /// `backend` once connections come.
    pub async fn start(pki: &Pki, stem: &str, backend: u16) -> Self {
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(pki.server_config(stem)));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let port = listener.local_addr().expect("addr").port();
        let server = tokio::spawn(async move {
            loop {
                let Ok((tcp, _)) = listener.accept().await else {
                    return;
                };
                let acceptor = acceptor.clone();
                tokio::spawn(async move {
                    let Ok(mut tls) = acceptor.accept(tcp).await else {
                        return;
                    };
                    let Ok(mut plain) =
                        tokio::net::TcpStream::connect(("127.0.0.1", backend)).await
                    else {
                        return;
                    };
                    let _ = tokio::io::copy_bidirectional(&mut tls, &mut plain).await;
                });
            }
        });
        Self {
            port,
            _server: server,
        }
    }
}
