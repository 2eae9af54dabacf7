//! The rustls pieces every TLS user of the crate shares: the *ring* crypto provider, PEM
//! certificate and key files read with errors that name the file, and the HTTP/1.1 ALPN
//! id. Users: the native protocol's QUIC (`native::quic_tls`), the HTTPS edge
//! (`http::edge_tls`) and the client that dials `https://` workers (`outbound`).
//!
//! A leaf: it depends on [`crate::error`] alone, so the modules above can share it without
//! depending on each other.
//!
//! # Invariants
//! 1. One provider: every rustls configuration of the crate is built over *ring*'s.
//! 2. No input reaches a panic: a file that cannot be read is a [`TransportError::Io`], one
//!    without a usable PEM item a [`TransportError::Invalid`]; both name the file.

use crate::error::{Result, TransportError};
use quinn::rustls;
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::{self, PemObject};
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use std::path::Path;
use std::sync::Arc;

/// The ALPN protocol of HTTP/1.1: what the edge negotiates and what the client that talks to
/// workers offers (both speak HTTP/1 only).
pub const ALPN_HTTP11: &[u8] = b"http/1.1";

/// A TLS setting or file that is not usable, as [`TransportError::Invalid`].
pub(crate) fn tls_err(context: &str, e: impl std::fmt::Display) -> TransportError {
    TransportError::Invalid {
        name: "tls",
        reason: format!("{context}: {e}"),
    }
}

/// The *ring* crypto provider.
pub(crate) fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// A PEM certificate chain (end-entity first) from `cert` and a PEM private key (PKCS#8,
/// PKCS#1/RSA or SEC1) from `key`; shared by the QUIC server and the HTTPS edge. Every error
/// names the file: [`TransportError::Io`] when it cannot be read,
/// [`TransportError::Invalid`] when it holds no usable PEM item.
pub(crate) fn load_pem_files(
    cert: &Path,
    key: &Path,
) -> Result<(Vec<CertificateDer<'static>>, PrivateKeyDer<'static>)> {
    let chain = CertificateDer::pem_file_iter(cert)
        .map_err(|e| pem_err(cert, "certificate", e))?
        .collect::<std::result::Result<Vec<_>, _>>()
        .map_err(|e| pem_err(cert, "certificate", e))?;
    if chain.is_empty() {
        return Err(pem_err(cert, "certificate", pem::Error::NoItemsFound));
    }
    let key = PrivateKeyDer::from_pem_file(key)
        .map_err(|e| pem_err(key, "private key (PKCS#8, PKCS#1 or SEC1)", e))?;
    Ok((chain, key))
}

/// Keeps an I/O failure an I/O error (missing file, permissions) and makes anything else
/// (bad base64, an unterminated section, no item of the kind wanted) invalid input.
pub(crate) fn pem_err(path: &Path, what: &str, e: pem::Error) -> TransportError {
    match e {
        pem::Error::Io(source) => TransportError::Io {
            context: format!("reading {}", path.display()),
            source,
        },
        pem::Error::NoItemsFound => {
            tls_err(&path.display().to_string(), format!("no PEM {what} found"))
        }
        other => tls_err(&format!("parsing {}", path.display()), other),
    }
}
