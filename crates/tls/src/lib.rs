//! Kochab's one TLS setup (rustls on ring), for traffic that crosses a network the
//! operator does not trust: clients to metadata servers, the coordinator to them, servers
//! and admin commands to the coordinator replicas, and the replicas to each other. The
//! key handshakes still run inside TLS, so TLS adds privacy and integrity of the traffic,
//! not another way in.
//!
//! Whoever dials trusts the certificate authorities of one PEM file, and the certificate
//! must name the host it was given for the peer (a DNS subject-alternative name for a host
//! name, an IP address one for a numeric address): one whose name does not match is
//! refused.

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use std::io::{self, ErrorKind};
use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use tokio::net::TcpStream;

pub use tokio_rustls::TlsAcceptor;
pub use tokio_rustls::client::TlsStream as ClientStream;

/// The acceptor of a listener, from a PEM certificate chain and its PEM private key.
pub fn acceptor(cert: &Path, key: &Path) -> io::Result<TlsAcceptor> {
    let bad = |what: &Path, e: String| {
        io::Error::new(ErrorKind::InvalidData, format!("{}: {e}", what.display()))
    };
    let cert_pem = std::fs::read(cert).map_err(|e| bad(cert, e.to_string()))?;
    let chain = CertificateDer::pem_slice_iter(&cert_pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| bad(cert, e.to_string()))?;
    if chain.is_empty() {
        return Err(bad(cert, "no certificate".into()));
    }
    let key_pem = std::fs::read(key).map_err(|e| bad(key, e.to_string()))?;
    let private = PrivateKeyDer::from_pem_slice(&key_pem).map_err(|e| bad(key, e.to_string()))?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| io::Error::other(e.to_string()))?
        .with_no_client_auth()
        .with_single_cert(chain, private)
        .map_err(|e| bad(cert, e.to_string()))?;
    Ok(TlsAcceptor::from(Arc::new(config)))
}

/// A TLS client configuration.
#[derive(Clone)]
pub struct TlsClient(tokio_rustls::TlsConnector);

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
        let pem = std::fs::read(ca).map_err(|e| bad(e.to_string()))?;
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

    /// TLS over `sock`, connected to `addr`, which was given as `given` ("host:port" as
    /// the user or the cluster map named it): the certificate must name that host, or the
    /// address dialed when `given` names none. A certificate for another name, or from
    /// another authority, fails here with rustls's reason in the message.
    pub async fn connect(
        &self,
        given: &str,
        addr: SocketAddr,
        sock: TcpStream,
    ) -> io::Result<ClientStream<TcpStream>> {
        let name = server_name(given).unwrap_or_else(|| ServerName::IpAddress(addr.ip().into()));
        self.0.connect(name, sock).await.map_err(|e| {
            io::Error::new(
                ErrorKind::PermissionDenied,
                format!("{given} ({addr}): TLS handshake failed: {e}"),
            )
        })
    }
}

/// The name a server's certificate must carry when the client dials `addr` ("host:port"
/// as the user or the cluster map gave it, "[v6]:port" too): its host, a DNS name or an IP
/// address. `None` if it is neither (the caller then checks the resolved address).
pub fn server_name(addr: &str) -> Option<ServerName<'static>> {
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
