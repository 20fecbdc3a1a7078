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
    /// `Connection` names a header the proxy decides itself (framing,
    /// Host, a pseudo-header): a smuggling attempt (docs/security.md).
    ConnectionNamesFraming,
    /// A path that is not a safe origin-form path once normalised (a
    /// dot-segment above the root, an encoded slash where refused).
    InvalidPath,
    /// CONNECT, TRACE, or a method a route does not allow.
    MethodNotAllowed,
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
    /// The TLS handshake with the origin failed (an unknown CA, a wrong
    /// name, no shared protocol): nothing was sent.
    UpstreamTls,
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
    pub const ALL: [Kind; 29] = [
        Kind::InvalidRequestLine,
        Kind::InvalidHeader,
        Kind::InvalidHost,
        Kind::ConnectionNamesFraming,
        Kind::InvalidPath,
        Kind::MethodNotAllowed,
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
        Kind::UpstreamTls,
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
            | Kind::ConnectionNamesFraming
            | Kind::InvalidPath
            | Kind::ConflictingLength
            | Kind::InvalidContentLength
            | Kind::BadChunk => 400,
            Kind::MethodNotAllowed => 405,
            Kind::UnsupportedTransferEncoding => 501,
            Kind::HeaderTimeout | Kind::BodyTimeout => 408,
            Kind::BodyTooLarge => 413,
            Kind::UriTooLong => 414,
            Kind::HeadersTooLarge => 431,
            Kind::NoRoute => 404,
            // Nobody is left to read it; 499 is nginx's convention for logs.
            Kind::ClientClosed => 499,
            Kind::UpstreamConnect
            | Kind::UpstreamTls
            | Kind::UpstreamProtocol
            | Kind::UpstreamClosed => 502,
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
            Kind::ConnectionNamesFraming => "connection-names-framing",
            Kind::InvalidPath => "invalid-path",
            Kind::MethodNotAllowed => "method-not-allowed",
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
            Kind::UpstreamTls => "upstream-tls",
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
            | Kind::ConnectionNamesFraming
            | Kind::InvalidPath
            | Kind::MethodNotAllowed
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
            | Kind::UpstreamTls
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

/// An error with its context and what it allows: the one error and decision
/// model of the engine (the retry rule in the driver reads only this).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Error {
    pub kind: Kind,
    /// The request may be sent again (to another peer or on a fresh
    /// connection): nothing of it was consumed that can't be replayed, and
    /// nothing of a response reached the client. Whether it *will* be also
    /// depends on the method: see [`Error::may_retry`].
    pub retryable: bool,
    /// Bytes of a response already went to the client: nothing to answer,
    /// nothing to retry; the connection must close.
    pub answered: bool,
    /// A reused pooled connection failed before any response byte: the
    /// origin closed it while idle. Retried once on a fresh connection, and
    /// not the origin's fault.
    pub stale: bool,
    /// Optional detail for logs (never sent to clients).
    pub detail: Option<String>,
}

impl Error {
    /// An error that ends the request (no retry).
    pub fn new(kind: Kind) -> Self {
        Error {
            kind,
            retryable: matches!(kind, Kind::UpstreamConnect | Kind::UpstreamTls),
            answered: false,
            stale: false,
            detail: None,
        }
    }
    /// An upstream failure before anything was consumed: retryable.
    pub fn upstream(kind: Kind) -> Self {
        Error {
            retryable: true,
            ..Error::new(kind)
        }
    }
    /// A failure after the client got bytes of the response.
    pub fn answered(kind: Kind) -> Self {
        Error {
            retryable: false,
            answered: true,
            ..Error::new(kind)
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
    /// The retry rule: a retryable error may be retried for an idempotent
    /// request, and a connect failure (timeouts included: nothing was sent)
    /// for any request.
    pub fn may_retry(&self, idempotent: bool) -> bool {
        self.retryable
            && !self.answered
            && (idempotent || matches!(self.kind, Kind::UpstreamConnect | Kind::UpstreamTls))
    }
    /// Counts against the peer (passive health): the origin failed, and not
    /// merely by closing an idle pooled connection.
    pub fn blames_upstream(&self) -> bool {
        self.kind.source() == Source::Upstream && !self.stale
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

    #[test]
    fn retry_rule() {
        // A connect failure (a timeout too) is retried whatever the method.
        let c = Error::upstream(Kind::UpstreamConnect);
        assert!(c.may_retry(false) && c.may_retry(true));
        // Others only for idempotent requests, and never once answered.
        let r = Error::upstream(Kind::UpstreamClosed);
        assert!(r.may_retry(true) && !r.may_retry(false));
        assert!(!Error::answered(Kind::UpstreamClosed).may_retry(true));
        assert!(!Error::upstream(Kind::UpstreamClosed)
            .retryable(false)
            .may_retry(true));
        // Stale pooled connections are not the origin's fault.
        let mut s = Error::upstream(Kind::UpstreamClosed);
        assert!(s.blames_upstream());
        s.stale = true;
        assert!(!s.blames_upstream());
        assert!(!Error::new(Kind::ClientClosed).blames_upstream());
    }
}
