//! TLS 1.3's and QUIC's key schedule on a keyed HMAC.
//!
//! rustls's aws-lc-rs suites run every HKDF-Expand through aws-lc's
//! `HKDF_expand`, which keys a new HMAC from the PRK each time (two more
//! SHA compression blocks for the padded key, per label). A full handshake
//! expands dozens of labels from a handful of secrets; QUIC more (a key,
//! an IV and a header-protection key per direction and packet space).
//! rustls's own `HkdfUsingHmac` keys the HMAC once per secret and expands
//! each label from a copy of that keyed state: the same bytes (RFC 5869 is
//! HMAC all the way down) for fewer blocks. Measured with callgrind:
//! bench/history/00-2026-12-02-issue-34-tls-handshakes.md.

use rustls::crypto::hmac::{Hmac, Key, Tag};
use rustls::crypto::tls13::HkdfUsingHmac;
use rustls::crypto::CryptoProvider;
use rustls::{CipherSuiteCommon, SupportedCipherSuite, Tls13CipherSuite};

/// HMAC by aws-lc-rs, keyed once ([`aws_lc_rs::hmac::Key`] holds the
/// padded key's hash states; each signature starts from a copy of them).
struct AwsHmac(&'static aws_lc_rs::hmac::Algorithm);

static SHA256: AwsHmac = AwsHmac(&aws_lc_rs::hmac::HMAC_SHA256);
static SHA384: AwsHmac = AwsHmac(&aws_lc_rs::hmac::HMAC_SHA384);
static HKDF_SHA256: HkdfUsingHmac<'static> = HkdfUsingHmac(&SHA256);
static HKDF_SHA384: HkdfUsingHmac<'static> = HkdfUsingHmac(&SHA384);

impl Hmac for AwsHmac {
    fn with_key(&self, key: &[u8]) -> Box<dyn Key> {
        Box::new(AwsKey(aws_lc_rs::hmac::Key::new(*self.0, key)))
    }
    fn hash_output_len(&self) -> usize {
        self.0.digest_algorithm().output_len()
    }
}

struct AwsKey(aws_lc_rs::hmac::Key);

impl Key for AwsKey {
    fn sign_concat(&self, first: &[u8], middle: &[&[u8]], last: &[u8]) -> Tag {
        let mut c = aws_lc_rs::hmac::Context::with_key(&self.0);
        c.update(first);
        for m in middle {
            c.update(m);
        }
        c.update(last);
        Tag::new(c.sign().as_ref())
    }
    fn tag_len(&self) -> usize {
        self.0.algorithm().digest_algorithm().output_len()
    }
}

/// `p` with each TLS 1.3 suite's HKDF replaced by [`HkdfUsingHmac`] over
/// [`AwsHmac`] (its AEAD, QUIC algorithms and hash kept). The suites are
/// made once per process (the provider is).
pub(crate) fn keyed(mut p: CryptoProvider) -> CryptoProvider {
    use rustls::crypto::hash::HashAlgorithm;
    for s in p.cipher_suites.iter_mut() {
        let SupportedCipherSuite::Tls13(t) = s else {
            continue;
        };
        let hkdf = match t.common.hash_provider.algorithm() {
            HashAlgorithm::SHA256 => &HKDF_SHA256,
            HashAlgorithm::SHA384 => &HKDF_SHA384,
            _ => continue,
        };
        let suite: &'static Tls13CipherSuite = Box::leak(Box::new(Tls13CipherSuite {
            common: CipherSuiteCommon {
                suite: t.common.suite,
                hash_provider: t.common.hash_provider,
                confidentiality_limit: t.common.confidentiality_limit,
            },
            hkdf_provider: hkdf,
            aead_alg: t.aead_alg,
            quic: t.quic,
        }));
        *s = SupportedCipherSuite::Tls13(suite);
    }
    p
}

#[cfg(test)]
mod tests {
    use super::*;

    /// RFC 5869 test case 1 (SHA-256): the keyed expander gives the RFC's
    /// OKM, and the same bytes as aws-lc's own HKDF.
    #[test]
    fn keyed_hkdf_matches_rfc5869_and_aws_lc() {
        use rustls::crypto::tls13::Hkdf;
        let ikm = [0x0bu8; 22];
        let salt: Vec<u8> = (0x00..=0x0c).collect();
        let info: Vec<u8> = (0xf0..=0xf9).collect();
        let mut okm = [0u8; 42];
        HKDF_SHA256
            .extract_from_secret(Some(&salt), &ikm)
            .expand_slice(&[&info], &mut okm)
            .unwrap();
        let want =
            "3cb25f25faacd57a90434f64d0362f2a2d2d0a90cf1a5a4c5db02d56ecc4c5bf34007208d5b887185865";
        let hex: String = okm.iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(hex, want);
        // And aws-lc's HKDF for a longer label set (two output blocks, SHA-384).
        let aws = rustls::crypto::aws_lc_rs::default_provider();
        let SupportedCipherSuite::Tls13(theirs) = aws
            .cipher_suites
            .iter()
            .find(|s| s.suite() == rustls::CipherSuite::TLS13_AES_256_GCM_SHA384)
            .unwrap()
        else {
            panic!("a TLS 1.3 suite")
        };
        let (mut a, mut b) = ([0u8; 80], [0u8; 80]);
        theirs
            .hkdf_provider
            .extract_from_secret(Some(b"salt"), b"secret")
            .expand_slice(&[b"label", b"context"], &mut a)
            .unwrap();
        HKDF_SHA384
            .extract_from_secret(Some(b"salt"), b"secret")
            .expand_slice(&[b"label", b"context"], &mut b)
            .unwrap();
        assert_eq!(a, b);
    }

    #[test]
    fn every_tls13_suite_is_keyed() {
        let p = keyed(rustls::crypto::aws_lc_rs::default_provider());
        let n = p
            .cipher_suites
            .iter()
            .filter(|s| matches!(s, SupportedCipherSuite::Tls13(_)))
            .count();
        assert!(n >= 3);
        for s in &p.cipher_suites {
            if let SupportedCipherSuite::Tls13(t) = s {
                let ours: *const () =
                    (t.hkdf_provider as *const dyn rustls::crypto::tls13::Hkdf).cast();
                let mine = [
                    (&HKDF_SHA256 as *const HkdfUsingHmac<'static>).cast::<()>(),
                    (&HKDF_SHA384 as *const HkdfUsingHmac<'static>).cast::<()>(),
                ];
                assert!(mine.contains(&ours), "{:?}", t.common.suite);
            }
        }
    }
}
