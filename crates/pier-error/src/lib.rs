//! One error type for the whole proxy (the `pingora-error` shape): what went
//! wrong (`Kind`), on which side (`Source`), and whether another attempt may
//! succeed (`retryable`). `Kind::status` is the only place errors become HTTP
//! status codes, and `Kind::reason` the only place they get the short reason
//! that every locally generated response carries (`x-pier-reason`) and that
//! metrics count.
#![forbid(unsafe_code)]

use std::fmt;

/// Which side of the proxy an error came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    Downstream,
    Upstream,
    Internal,
}

/// Every failure Pier can answer for. Each variant has one status and one
/// reason string; the reason set is closed so metrics have fixed slots.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Kind {
    // --- downstream: the client sent something we refuse ---
    InvalidRequestLine,
    InvalidHeader,
    InvalidHost,
    ConflictingLength,
    InvalidContentLength,
    UnsupportedTransferEncoding,
    BadChunk,
    HeaderTimeout,
    BodyTimeout,
    BodyTooLarge,
    UriTooLong,
    HeadersTooLarge,
    NoRoute,
    ClientClosed,
    /// A `[[limit]]` rate rule (429) or concurrency rule (503) refused it.
    RateLimited,
    ConcurrencyLimited,
    // --- upstream: the origin failed us ---
    UpstreamConnect,
    UpstreamProtocol,
    UpstreamClosed,
    UpstreamTimeout,
    NoHealthyUpstream,
    OriginDenied,
    /// The chosen server already has `max_inflight_per_server` requests.
    UpstreamLimited,
    // --- ours ---
    HookError,
    Internal,
}

impl Kind {
    pub const ALL: [Kind; 25] = [
        Kind::InvalidRequestLine,
        Kind::InvalidHeader,
        Kind::InvalidHost,
        Kind::ConflictingLength,
        Kind::InvalidContentLength,
        Kind::UnsupportedTransferEncoding,
        Kind::BadChunk,
        Kind::HeaderTimeout,
        Kind::BodyTimeout,
        Kind::BodyTooLarge,
        Kind::UriTooLong,
        Kind::HeadersTooLarge,
        Kind::NoRoute,
        Kind::ClientClosed,
        Kind::RateLimited,
        Kind::ConcurrencyLimited,
        Kind::UpstreamConnect,
        Kind::UpstreamProtocol,
        Kind::UpstreamClosed,
        Kind::UpstreamTimeout,
        Kind::NoHealthyUpstream,
        Kind::OriginDenied,
        Kind::UpstreamLimited,
        Kind::HookError,
        Kind::Internal,
    ];

    /// The HTTP status a locally generated response uses for this error.
    pub const fn status(self) -> u16 {
        match self {
            Kind::InvalidRequestLine
            | Kind::InvalidHeader
            | Kind::InvalidHost
            | Kind::ConflictingLength
            | Kind::InvalidContentLength
            | Kind::BadChunk => 400,
            Kind::UnsupportedTransferEncoding => 501,
            Kind::HeaderTimeout | Kind::BodyTimeout => 408,
            Kind::BodyTooLarge => 413,
            Kind::UriTooLong => 414,
            Kind::HeadersTooLarge => 431,
            Kind::NoRoute => 404,
            // Nobody is left to read it; 499 is nginx's convention for logs.
            Kind::ClientClosed => 499,
            Kind::UpstreamConnect | Kind::UpstreamProtocol | Kind::UpstreamClosed => 502,
            Kind::UpstreamTimeout => 504,
            Kind::RateLimited => 429,
            Kind::NoHealthyUpstream
            | Kind::OriginDenied
            | Kind::UpstreamLimited
            | Kind::ConcurrencyLimited => 503,
            Kind::HookError | Kind::Internal => 500,
        }
    }

    /// Short machine-readable reason (header `x-pier-reason`, metrics label).
    pub const fn reason(self) -> &'static str {
        match self {
            Kind::InvalidRequestLine => "invalid-request-line",
            Kind::InvalidHeader => "invalid-header",
            Kind::InvalidHost => "invalid-host",
            Kind::ConflictingLength => "conflicting-length",
            Kind::InvalidContentLength => "invalid-content-length",
            Kind::UnsupportedTransferEncoding => "unsupported-transfer-encoding",
            Kind::BadChunk => "bad-chunk",
            Kind::HeaderTimeout => "header-timeout",
            Kind::BodyTimeout => "body-timeout",
            Kind::BodyTooLarge => "body-too-large",
            Kind::UriTooLong => "uri-too-long",
            Kind::HeadersTooLarge => "headers-too-large",
            Kind::NoRoute => "no-route",
            Kind::ClientClosed => "client-closed",
            Kind::RateLimited => "rate-limited",
            Kind::ConcurrencyLimited => "concurrency-limited",
            Kind::UpstreamLimited => "upstream-limited",
            Kind::UpstreamConnect => "upstream-connect",
            Kind::UpstreamProtocol => "upstream-protocol",
            Kind::UpstreamClosed => "upstream-closed",
            Kind::UpstreamTimeout => "upstream-timeout",
            Kind::NoHealthyUpstream => "no-healthy-upstream",
            Kind::OriginDenied => "origin-denied",
            Kind::HookError => "hook-error",
            Kind::Internal => "internal",
        }
    }

    pub const fn source(self) -> Source {
        match self {
            Kind::InvalidRequestLine
            | Kind::InvalidHeader
            | Kind::InvalidHost
            | Kind::ConflictingLength
            | Kind::InvalidContentLength
            | Kind::UnsupportedTransferEncoding
            | Kind::BadChunk
            | Kind::HeaderTimeout
            | Kind::BodyTimeout
            | Kind::BodyTooLarge
            | Kind::UriTooLong
            | Kind::HeadersTooLarge
            | Kind::NoRoute
            | Kind::ClientClosed
            | Kind::RateLimited
            | Kind::ConcurrencyLimited => Source::Downstream,
            Kind::UpstreamConnect
            | Kind::UpstreamProtocol
            | Kind::UpstreamClosed
            | Kind::UpstreamTimeout
            | Kind::NoHealthyUpstream
            | Kind::OriginDenied
            | Kind::UpstreamLimited => Source::Upstream,
            Kind::HookError | Kind::Internal => Source::Internal,
        }
    }

    /// Index into fixed metric slots.
    pub const fn index(self) -> usize {
        self as usize
    }
}

/// An error with its context. `retryable` says whether another upstream
/// attempt may succeed (connect failures always; others only before any
/// response byte reached the client and for idempotent requests).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Error {
    pub kind: Kind,
    pub retryable: bool,
    /// Optional detail for logs (never sent to clients).
    pub detail: Option<String>,
}

impl Error {
    pub fn new(kind: Kind) -> Self {
        Error {
            kind,
            retryable: matches!(kind, Kind::UpstreamConnect),
            detail: None,
        }
    }
    pub fn with_detail(kind: Kind, detail: impl fmt::Display) -> Self {
        let mut e = Error::new(kind);
        e.detail = Some(detail.to_string());
        e
    }
    pub fn retryable(mut self, yes: bool) -> Self {
        self.retryable = yes;
        self
    }
    pub fn status(&self) -> u16 {
        self.kind.status()
    }
    pub fn source(&self) -> Source {
        self.kind.source()
    }
}

impl From<Kind> for Error {
    fn from(k: Kind) -> Self {
        Error::new(k)
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({})", self.kind.reason(), self.kind.status())?;
        if let Some(d) = &self.detail {
            write!(f, ": {d}")?;
        }
        Ok(())
    }
}

impl std::error::Error for Error {}

pub type Result<T, E = Error> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses_by_side() {
        for k in Kind::ALL {
            let s = k.status();
            match k.source() {
                // 503 for a downstream cause: a client over its concurrency limit.
                Source::Downstream => {
                    assert!((400..500).contains(&s) || s == 501 || s == 503, "{k:?}")
                }
                Source::Upstream => assert!((502..=504).contains(&s), "{k:?}"),
                Source::Internal => assert_eq!(s, 500),
            }
        }
    }

    #[test]
    fn all_is_complete_and_indexed() {
        for (i, k) in Kind::ALL.iter().enumerate() {
            assert_eq!(k.index(), i);
        }
        let mut reasons: Vec<_> = Kind::ALL.iter().map(|k| k.reason()).collect();
        reasons.sort();
        reasons.dedup();
        assert_eq!(reasons.len(), Kind::ALL.len());
    }

    #[test]
    fn connect_failures_retry_by_default() {
        assert!(Error::new(Kind::UpstreamConnect).retryable);
        assert!(!Error::new(Kind::UpstreamTimeout).retryable);
    }
}
