//! A CA made in the test and one leaf certificate it signed, and a rustls acceptor presenting that
//! leaf: for the HTTPS backends and gateways the tests stand in for GPU nodes and SaladCloud's
//! Container Gateway.

use std::sync::Arc;

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};
use tokio_rustls::TlsAcceptor;
use tokio_rustls::rustls;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};

/// A CA (its PEM, for `upstream.extra_ca_file`) and one leaf it signed.
pub struct TestPki {
    pub ca_pem: String,
    pub leaf: CertificateDer<'static>,
    pub leaf_key: PrivatePkcs8KeyDer<'static>,
}

impl TestPki {
    /// A new CA and a leaf for `names` (DNS names or IP addresses; the first is also its common name).
    pub fn new(names: &[&str]) -> TestPki {
        let mut ca = CertificateParams::new(Vec::<String>::new()).unwrap();
        ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        ca.distinguished_name
            .push(DnType::CommonName, "tongs test CA");
        let ca_key = KeyPair::generate().unwrap();
        let ca_cert = ca.self_signed(&ca_key).unwrap();
        let issuer = Issuer::new(ca, ca_key);

        let names: Vec<String> = names.iter().map(|n| (*n).to_owned()).collect();
        let mut leaf = CertificateParams::new(names.clone()).unwrap();
        leaf.distinguished_name
            .push(DnType::CommonName, names[0].as_str());
        leaf.use_authority_key_identifier_extension = true;
        leaf.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        leaf.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        let leaf_key = KeyPair::generate().unwrap();
        let leaf_cert = leaf.signed_by(&leaf_key, &issuer).unwrap();
        TestPki {
            ca_pem: ca_cert.pem(),
            leaf: leaf_cert.der().clone(),
            leaf_key: PrivatePkcs8KeyDer::from(leaf_key.serialize_der()),
        }
    }

    /// A TLS acceptor presenting the leaf and offering `alpn` (e.g. `[b"h2", b"http/1.1"]`).
    pub fn acceptor(&self, alpn: &[&[u8]]) -> TlsAcceptor {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut config = rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_no_client_auth()
            .with_single_cert(
                vec![self.leaf.clone()],
                PrivateKeyDer::Pkcs8(self.leaf_key.clone_key()),
            )
            .unwrap();
        config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
        TlsAcceptor::from(Arc::new(config))
    }
}
