//! Optional TLS for client connections (rustls): for traffic that crosses a network the
//! operator does not trust. The key handshake still runs inside TLS, so TLS adds privacy
//! and integrity of the traffic, not another way in.

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use std::io::{self, ErrorKind};
use std::path::Path;
use std::sync::Arc;

/// Builds the acceptor from a PEM certificate chain and a PEM private key.
pub fn acceptor(cert: &Path, key: &Path) -> io::Result<tokio_rustls::TlsAcceptor> {
    let bad = |what: &Path, e: String| {
        io::Error::new(ErrorKind::InvalidData, format!("{}: {e}", what.display()))
    };
    let cert_pem = std::fs::read(cert)?;
    let chain = CertificateDer::pem_slice_iter(&cert_pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| bad(cert, e.to_string()))?;
    if chain.is_empty() {
        return Err(bad(cert, "no certificate".into()));
    }
    let key_pem = std::fs::read(key)?;
    let private = PrivateKeyDer::from_pem_slice(&key_pem).map_err(|e| bad(key, e.to_string()))?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| io::Error::other(e.to_string()))?
        .with_no_client_auth()
        .with_single_cert(chain, private)
        .map_err(|e| bad(cert, e.to_string()))?;
    Ok(tokio_rustls::TlsAcceptor::from(Arc::new(config)))
}
