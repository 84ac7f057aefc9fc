//! Optional TLS to the servers (rustls), trusting the certificate authorities of one PEM
//! file. The server's certificate must name the host the client was given for it (a DNS
//! subject-alternative name for a host name, an IP address one for a numeric address).

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName};
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

/// The name a server's certificate must carry when the client dials `addr` ("host:port"
/// as the user or the cluster map gave it, "[v6]:port" too): its host, a DNS name or an IP
/// address. `None` if it is neither (the caller then checks the resolved address).
pub(crate) fn server_name(addr: &str) -> Option<ServerName<'static>> {
    let host = match addr.strip_prefix('[') {
        Some(rest) => rest.split_once(']')?.0,
        None => addr.rsplit_once(':').map_or(addr, |(host, _)| host),
    };
    ServerName::try_from(host).ok().map(|n| n.to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_name_checked_is_the_host_as_given() {
        let name = |a: &str| server_name(a).map(|n| n.to_str().into_owned());
        assert_eq!(name("localhost:7420").as_deref(), Some("localhost"));
        assert_eq!(
            name("mds1.example.org:1").as_deref(),
            Some("mds1.example.org")
        );
        assert!(matches!(
            server_name("127.0.0.1:7420"),
            Some(ServerName::IpAddress(_))
        ));
        assert!(matches!(
            server_name("[::1]:7420"),
            Some(ServerName::IpAddress(_))
        ));
        assert_eq!(name("not a name:1"), None);
        assert_eq!(name("[::1"), None);
    }
}
