//! Handshake counters, process-wide (every listener, every worker), rendered
//! into `/metrics`.

use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

/// Why a handshake did not finish.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Failure {
    /// No cipher suite, key exchange group, signature scheme or protocol
    /// version in common.
    NoSharedCipher,
    /// SNI names no certificate and `unknown_sni = "refuse"`.
    UnknownSni,
    /// A client certificate missing (when required), unverifiable or bad.
    BadClientCert,
    /// The first bytes were not a TLS record (plain HTTP gets a 400).
    NotTls,
    /// `handshake_timeout` passed.
    Timeout,
    /// `max_handshakes` were already in progress.
    Overload,
    /// The client closed or reset before finishing.
    Closed,
    /// Closed to make room (the worker at `max_connections`, or the
    /// listener at `max_pending_hellos`) while still waiting for the
    /// client.
    Evicted,
    /// Anything else (a malformed message, an internal error).
    Other,
    /// Not a failure: an ACME CA's TLS-ALPN-01 validation (RFC 8737), answered
    /// with the challenge certificate, after which the connection closes.
    AcmeChallenge,
    /// A name outside the certificates, with `on_demand = true`, that was
    /// not approved (the ask URL, the rate, `on_demand_max`) or whose
    /// certificate could not be obtained.
    AcmeRefused,
}

impl Failure {
    pub const ALL: [Failure; 11] = [
        Failure::NoSharedCipher,
        Failure::UnknownSni,
        Failure::BadClientCert,
        Failure::NotTls,
        Failure::Timeout,
        Failure::Overload,
        Failure::Closed,
        Failure::Evicted,
        Failure::Other,
        Failure::AcmeChallenge,
        Failure::AcmeRefused,
    ];
    pub fn label(self) -> &'static str {
        match self {
            Failure::NoSharedCipher => "no_shared_cipher",
            Failure::UnknownSni => "unknown_sni",
            Failure::BadClientCert => "bad_client_cert",
            Failure::NotTls => "not_tls",
            Failure::Timeout => "timeout",
            Failure::Overload => "overload",
            Failure::Closed => "closed",
            Failure::Evicted => "evicted",
            Failure::Other => "other",
            Failure::AcmeChallenge => "acme_challenge",
            Failure::AcmeRefused => "acme_refused",
        }
    }

    /// Classify a rustls error (as tokio-rustls hands it back inside an
    /// `io::Error`).
    pub fn of(e: &std::io::Error) -> Failure {
        use rustls::Error as E;
        let Some(re) = e.get_ref().and_then(|i| i.downcast_ref::<rustls::Error>()) else {
            return match e.kind() {
                std::io::ErrorKind::UnexpectedEof
                | std::io::ErrorKind::ConnectionReset
                | std::io::ErrorKind::BrokenPipe => Failure::Closed,
                _ => Failure::Other,
            };
        };
        match re {
            E::PeerIncompatible(_) => Failure::NoSharedCipher,
            E::NoCertificatesPresented | E::InvalidCertificate(_) => Failure::BadClientCert,
            E::InvalidMessage(_) => Failure::NotTls,
            _ => Failure::Other,
        }
    }
}

const VERSIONS: [&str; 2] = ["TLSv1.2", "TLSv1.3"];
const ALPNS: [&str; 3] = ["none", "http/1.1", "h2"];

pub struct Stats {
    /// [version][alpn][resumed]
    ok: [[[AtomicU64; 2]; 3]; 2],
    failed: [AtomicU64; Failure::ALL.len()],
    /// Upstream handshakes: [ok, failed, resumed].
    upstream: [AtomicU64; 3],
}

#[allow(clippy::declare_interior_mutable_const)]
const Z: AtomicU64 = AtomicU64::new(0);
#[allow(clippy::declare_interior_mutable_const)]
const Z2: [AtomicU64; 2] = [Z; 2];
#[allow(clippy::declare_interior_mutable_const)]
const Z32: [[AtomicU64; 2]; 3] = [Z2; 3];

static STATS: Stats = Stats {
    ok: [Z32; 2],
    failed: [Z; Failure::ALL.len()],
    upstream: [Z; 3],
};

pub fn stats() -> &'static Stats {
    &STATS
}

impl Stats {
    pub fn handshake(&self, info: &crate::TlsInfo) {
        let v = (info.version == "TLSv1.3") as usize;
        let a = match info.alpn.as_deref() {
            None => 0,
            Some("h2") => 2,
            Some(_) => 1,
        };
        self.ok[v][a][info.resumed as usize].fetch_add(1, Relaxed);
    }
    pub fn failure(&self, f: Failure) {
        self.failed[f as usize].fetch_add(1, Relaxed);
    }
    pub fn failures(&self, f: Failure) -> u64 {
        self.failed[f as usize].load(Relaxed)
    }
    /// Finished handshakes, all versions and ALPNs; `resumed` picks which.
    pub fn handshakes(&self, resumed: bool) -> u64 {
        self.ok
            .iter()
            .flatten()
            .map(|r| r[resumed as usize].load(Relaxed))
            .sum()
    }
    pub fn upstream(&self, ok: bool, resumed: bool) {
        self.upstream[if ok { 0 } else { 1 }].fetch_add(1, Relaxed);
        if resumed {
            self.upstream[2].fetch_add(1, Relaxed);
        }
    }

    /// Prometheus text.
    pub fn render(&self, out: &mut String) {
        out.push_str("# TYPE pier_tls_handshakes_total counter\n");
        for (v, ver) in VERSIONS.iter().enumerate() {
            for (a, alpn) in ALPNS.iter().enumerate() {
                for (r, kind) in ["full", "resumed"].iter().enumerate() {
                    let n = self.ok[v][a][r].load(Relaxed);
                    if n > 0 {
                        let _ = writeln!(
                            out,
                            "pier_tls_handshakes_total{{version=\"{ver}\",alpn=\"{alpn}\",result=\"{kind}\"}} {n}"
                        );
                    }
                }
            }
        }
        out.push_str("# TYPE pier_tls_handshake_failures_total counter\n");
        for f in Failure::ALL {
            let _ = writeln!(
                out,
                "pier_tls_handshake_failures_total{{reason=\"{}\"}} {}",
                f.label(),
                self.failures(f)
            );
        }
        let _ = writeln!(
            out,
            "# TYPE pier_tls_upstream_handshakes_total counter\npier_tls_upstream_handshakes_total{{result=\"ok\"}} {}\npier_tls_upstream_handshakes_total{{result=\"failed\"}} {}\npier_tls_upstream_handshakes_total{{result=\"resumed\"}} {}",
            self.upstream[0].load(Relaxed),
            self.upstream[1].load(Relaxed),
            self.upstream[2].load(Relaxed)
        );
        crate::ocsp::render(out);
        crate::managed::render(out);
    }
}
