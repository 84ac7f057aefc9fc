//! Optional TLS to the servers (rustls), trusting the certificate authorities of one PEM
//! file. The server's certificate must name the address the client connects to (an IP
//! address subject-alternative name for a numeric address).

use rustls::pki_types::CertificateDer;
use rustls::pki_types::pem::PemObject;
use std::io::{self, ErrorKind};
use std::path::Path;
use std::sync::Arc;

/// A TLS client configuration.
#[derive(Clone)]
pub struct TlsClient(pub(crate) tokio_rustls::TlsConnector);

impl std::fmt::Debug for TlsClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TlsClient")
    }
}

impl TlsClient {
    /// Trusts the certificate authorities in the PEM file `ca`.
    pub fn from_ca_file(ca: &Path) -> io::Result<TlsClient> {
        let bad =
            |e: String| io::Error::new(ErrorKind::InvalidData, format!("{}: {e}", ca.display()));
        let pem = std::fs::read(ca)?;
        let mut roots = rustls::RootCertStore::empty();
        for cert in CertificateDer::pem_slice_iter(&pem) {
            roots
                .add(cert.map_err(|e| bad(e.to_string()))?)
                .map_err(|e| bad(e.to_string()))?;
        }
        if roots.is_empty() {
            return Err(bad("no certificate".into()));
        }
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let config = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| io::Error::other(e.to_string()))?
            .with_root_certificates(roots)
            .with_no_client_auth();
        Ok(TlsClient(tokio_rustls::TlsConnector::from(Arc::new(
            config,
        ))))
    }
}
