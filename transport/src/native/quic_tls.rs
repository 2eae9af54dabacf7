//! TLS for the native protocol: the server's certificate (PEM files or self-signed), its
//! SHA-256 fingerprint, and the publisher's trust (a pinned fingerprint or a CA bundle).
//! rustls with the *ring* provider only, TLS 1.3 only, ALPN [`ALPN`]. The provider and the
//! PEM file loading are the crate's shared ones ([`crate::tls`], also the HTTPS edge's).

use super::frame::{LEN_BYTES, MAX_HELLO_BYTES};
use super::schema::ALPN;
use crate::error::{Result, TransportError};
use crate::tls::{load_pem_files, pem_err, provider, tls_err};
use quinn::rustls;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer, ServerName, UnixTime};
use rustls::{DigitallySignedStruct, SignatureScheme};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

/// Where the server's certificate comes from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TlsSource {
    /// A PEM certificate chain (end-entity first) and a PEM private key.
    Files {
        /// Certificate chain file.
        cert: PathBuf,
        /// Private key file (PKCS#8, PKCS#1 or SEC1).
        key: PathBuf,
    },
    /// A fresh self-signed certificate for these DNS names / IP addresses; publishers pin
    /// its fingerprint.
    SelfSigned {
        /// Subject alternative names.
        names: Vec<String>,
    },
}

/// How a publisher trusts the server.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Trust {
    /// The SHA-256 of the server's end-entity certificate (hex; colons and case ignored).
    /// Name and validity dates are not checked: the pin is the identity.
    Fingerprint(String),
    /// A PEM bundle of CA certificates; the usual WebPKI checks, including the name.
    CaPem(PathBuf),
}

/// Lowercase hex SHA-256 of a DER certificate.
pub fn fingerprint(cert_der: &[u8]) -> String {
    let digest = ring::digest::digest(&ring::digest::SHA256, cert_der);
    hex(digest.as_ref())
}

fn hex(bytes: &[u8]) -> String {
    use std::fmt::Write;
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        let _ = write!(s, "{b:02x}");
    }
    s
}

/// Parses a hex fingerprint (colons, spaces and case ignored) into 32 bytes.
pub fn parse_fingerprint(text: &str) -> Result<[u8; 32]> {
    let digits: Vec<u8> = text.bytes().filter(|b| !matches!(b, b':' | b' ')).collect();
    let bad = || TransportError::Invalid {
        name: "fingerprint",
        reason: format!("{text:?} is not 64 hex digits"),
    };
    if digits.len() != 64 {
        return Err(bad());
    }
    let mut out = [0u8; 32];
    for (o, pair) in out.iter_mut().zip(digits.chunks_exact(2)) {
        let s = std::str::from_utf8(pair).map_err(|_| bad())?;
        *o = u8::from_str_radix(s, 16).map_err(|_| bad())?;
    }
    Ok(out)
}

/// The certificate chain and key of `source`.
pub(crate) fn load(
    source: &TlsSource,
) -> Result<(Vec<CertificateDer<'static>>, PrivateKeyDer<'static>)> {
    match source {
        TlsSource::Files { cert, key } => load_pem_files(cert, key),
        TlsSource::SelfSigned { names } => {
            let ck = rcgen::generate_simple_self_signed(names.clone())
                .map_err(|e| tls_err("generating a self-signed certificate", e))?;
            let key = PrivatePkcs8KeyDer::from(ck.signing_key.serialize_der());
            Ok((vec![ck.cert.der().clone()], PrivateKeyDer::Pkcs8(key)))
        }
    }
}

/// Bytes a connection may have in flight to its receiver once authenticated (the
/// connection-level flow-control window).
pub(crate) const RECEIVE_WINDOW: u32 = 64 << 20;

/// The server's connection-level receive window until the hello is accepted: the largest
/// hello and its length prefix. Data a peer sends but the server has not read (out of
/// order, or past the hello) is bounded by it, so an unauthenticated connection pins at
/// most this much, not [`RECEIVE_WINDOW`]; the server widens it after the hello.
pub(crate) const PRE_HELLO_WINDOW: u32 = (MAX_HELLO_BYTES + LEN_BYTES) as u32;

/// Flow-control windows sized for bulk ingest over one stream.
pub(crate) fn transport_config() -> quinn::TransportConfig {
    let mut t = quinn::TransportConfig::default();
    t.stream_receive_window(quinn::VarInt::from_u32(32 << 20))
        .receive_window(quinn::VarInt::from_u32(RECEIVE_WINDOW))
        .send_window(64 << 20)
        .max_concurrent_bidi_streams(quinn::VarInt::from_u32(1))
        .max_concurrent_uni_streams(quinn::VarInt::from_u32(0))
        .keep_alive_interval(Some(Duration::from_secs(10)));
    t
}

/// The QUIC server configuration for `chain`/`key`.
pub(crate) fn server_config(
    chain: Vec<CertificateDer<'static>>,
    key: PrivateKeyDer<'static>,
) -> Result<quinn::ServerConfig> {
    let mut tls = rustls::ServerConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(|e| tls_err("TLS 1.3", e))?
        .with_no_client_auth()
        .with_single_cert(chain, key)
        .map_err(|e| tls_err("certificate", e))?;
    tls.alpn_protocols = vec![ALPN.to_vec()];
    let crypto = quinn::crypto::rustls::QuicServerConfig::try_from(tls)
        .map_err(|e| tls_err("QUIC TLS", e))?;
    let mut cfg = quinn::ServerConfig::with_crypto(Arc::new(crypto));
    let mut transport = transport_config();
    transport.receive_window(quinn::VarInt::from_u32(PRE_HELLO_WINDOW));
    cfg.transport_config(Arc::new(transport));
    Ok(cfg)
}

/// The QUIC client configuration for `trust` (what [`crate::native::Publisher`] uses; public
/// for tools that speak the protocol themselves).
pub fn client_config(trust: &Trust) -> Result<quinn::ClientConfig> {
    let builder = rustls::ClientConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(|e| tls_err("TLS 1.3", e))?;
    let mut tls = match trust {
        Trust::Fingerprint(hex) => {
            let pin = parse_fingerprint(hex)?;
            builder
                .dangerous()
                .with_custom_certificate_verifier(Arc::new(PinnedCert {
                    pin,
                    provider: provider(),
                }))
                .with_no_client_auth()
        }
        Trust::CaPem(path) => {
            let mut roots = rustls::RootCertStore::empty();
            for cert in
                CertificateDer::pem_file_iter(path).map_err(|e| pem_err(path, "CA bundle", e))?
            {
                let cert = cert.map_err(|e| pem_err(path, "CA bundle", e))?;
                roots
                    .add(cert)
                    .map_err(|e| tls_err(&format!("CA in {}", path.display()), e))?;
            }
            builder.with_root_certificates(roots).with_no_client_auth()
        }
    };
    tls.alpn_protocols = vec![ALPN.to_vec()];
    let crypto = quinn::crypto::rustls::QuicClientConfig::try_from(tls)
        .map_err(|e| tls_err("QUIC TLS", e))?;
    let mut cfg = quinn::ClientConfig::new(Arc::new(crypto));
    cfg.transport_config(Arc::new(transport_config()));
    Ok(cfg)
}

/// Accepts exactly the certificate whose SHA-256 is `pin`, and still checks the handshake
/// signature with the provider's algorithms (so the peer holds the pinned key).
#[derive(Debug)]
struct PinnedCert {
    pin: [u8; 32],
    provider: Arc<CryptoProvider>,
}

impl ServerCertVerifier for PinnedCert {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> std::result::Result<ServerCertVerified, rustls::Error> {
        let digest = ring::digest::digest(&ring::digest::SHA256, end_entity.as_ref());
        if constant_time_eq(digest.as_ref(), &self.pin) {
            Ok(ServerCertVerified::assertion())
        } else {
            Err(rustls::Error::InvalidCertificate(
                rustls::CertificateError::ApplicationVerificationFailure,
            ))
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> std::result::Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> std::result::Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.provider
            .signature_verification_algorithms
            .supported_schemes()
    }
}

/// Equality whose time does not depend on where the inputs differ (lengths may leak).
pub(crate) fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    let diff = a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y));
    std::hint::black_box(diff) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fingerprints_round_trip_through_hex() {
        let fp = fingerprint(b"cert");
        assert_eq!(fp.len(), 64);
        let bytes = parse_fingerprint(&fp.to_uppercase()).unwrap();
        assert_eq!(hex(&bytes), fp);
        let colons: Vec<String> = bytes.iter().map(|b| format!("{b:02X}")).collect();
        assert_eq!(parse_fingerprint(&colons.join(":")).unwrap(), bytes);
        assert!(parse_fingerprint("abc").is_err());
        assert!(parse_fingerprint(&"zz".repeat(32)).is_err());
    }

    #[test]
    fn bytes_compare_exactly() {
        assert!(constant_time_eq(b"s3cret", b"s3cret"));
        assert!(!constant_time_eq(b"s3cret", b"s3cres"));
        assert!(!constant_time_eq(b"", b"x"));
    }
}
