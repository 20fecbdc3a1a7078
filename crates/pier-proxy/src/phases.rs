//! The phase trait: what users (Rust code, or the Lua layer) plug into the
//! driver. One method per phase, grouped as a request's life is, each with a
//! do-nothing default, each returning a decision rather than a bool.
//!
//! Futures here need not be `Send`: every connection lives on one worker
//! thread (see pier-core), which is what lets a Lua coroutine yield inside a
//! hook.
#![allow(async_fn_in_trait)]

use crate::session::Session;
use crate::state::State;
use pier_error::Error;
use pier_http::ResponseHead;
use std::net::SocketAddr;

/// A response produced by Pier itself (a hook, a limit, an error).
#[derive(Debug, Clone, Default)]
pub struct LocalResponse {
    pub status: u16,
    pub headers: Vec<(Vec<u8>, Vec<u8>)>,
    pub body: Vec<u8>,
    /// Metrics/access-log reason; empty for hook-made answers.
    pub reason: &'static str,
    /// Counted under this error kind in `pier_local_responses_total`
    /// (limits); `None` counts as a hook-made answer.
    pub kind: Option<pier_error::Kind>,
}

/// What a phase decided.
#[derive(Debug)]
pub enum Flow {
    /// Go on to the next phase.
    Continue,
    /// Answer now with this response; skip the upstream.
    Respond(LocalResponse),
    /// After a failed attempt (`fail_to_connect`, `error_while_proxy`
    /// only): try again, on `peer` (None: the balancer's next pick), with
    /// the upstream request as the phase left it (`Session::up_req`).
    /// Within the request's retries and the group's retry budget, and only
    /// while nothing of the request body is lost (a streamed body that
    /// went is not replayed). Any other phase answering it fails the
    /// request (500 hook-error).
    Retry { peer: Option<SocketAddr> },
}

/// The steps of a request, in the order the driver takes them (as Varnish's
/// request state machine names its states). docs/phases.md draws this enum
/// box for box; `Session::step` holds the current one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// Waiting for and parsing a request head.
    ReadHead,
    /// Matching host and path to a route (and building the upstream request).
    Route,
    /// `Phases::request_filter`: limits, Lua `access`/`content`.
    RequestFilter,
    /// `Phases::cache_lookup`: a hit answers from here.
    CacheLookup,
    /// `Phases::upstream_peer`: the balancer (or a hook) picks a peer.
    UpstreamPeer,
    /// `Phases::upstream_request_filter`: the upstream request's last edits.
    UpstreamRequestFilter,
    /// A connection from the pool or the connector (per attempt).
    Connect,
    /// The upstream head and body go out; the response head comes back.
    Send,
    /// `Phases::upstream_response_filter`: the response as the origin sent it.
    UpstreamResponseFilter,
    /// `Phases::cache_store`: the response may be stored.
    CacheStore,
    /// `Phases::response_filter`: the response as the client will get it.
    ResponseFilter,
    /// The body, through `Phases::body_filter`, to the client.
    Write,
    /// An attempt failed: the phases decide (`fail_to_connect`,
    /// `error_while_proxy`): retry (another peer, a fresh connection, the
    /// request changed) or answer.
    Fail,
    /// `Phases::logging`, metrics and the access log.
    Logging,
}

impl Step {
    /// Every step, in the enum's (and docs/phases.md's) order.
    pub const ALL: [Step; 14] = [
        Step::ReadHead,
        Step::Route,
        Step::RequestFilter,
        Step::CacheLookup,
        Step::UpstreamPeer,
        Step::UpstreamRequestFilter,
        Step::Connect,
        Step::Send,
        Step::UpstreamResponseFilter,
        Step::CacheStore,
        Step::ResponseFilter,
        Step::Write,
        Step::Fail,
        Step::Logging,
    ];

    /// The variant's name (logs, the chart).
    pub fn name(self) -> &'static str {
        match self {
            Step::ReadHead => "ReadHead",
            Step::Route => "Route",
            Step::RequestFilter => "RequestFilter",
            Step::CacheLookup => "CacheLookup",
            Step::UpstreamPeer => "UpstreamPeer",
            Step::UpstreamRequestFilter => "UpstreamRequestFilter",
            Step::Connect => "Connect",
            Step::Send => "Send",
            Step::UpstreamResponseFilter => "UpstreamResponseFilter",
            Step::CacheStore => "CacheStore",
            Step::ResponseFilter => "ResponseFilter",
            Step::Write => "Write",
            Step::Fail => "Fail",
            Step::Logging => "Logging",
        }
    }
}

/// Upstream choice a `upstream_peer` hook may make.
#[derive(Debug, Default, Clone, Copy)]
pub struct PeerChoice {
    /// Send to this address instead of the balancer's pick.
    pub addr: Option<SocketAddr>,
    /// Override the route's retry count.
    pub retries: Option<u32>,
}

pub trait Phases: 'static {
    /// Per-request state carried across phases (`pier.ctx` for Lua).
    type Ctx: Default;

    // === worker ===

    /// Once per worker thread at start, inside its runtime (Lua `init_worker`, timers).
    fn init_worker(&self, _st: &State) {}

    // === request ===

    /// After routing, before anything goes upstream: auth, limits, rewrites,
    /// or a whole response (Lua `access` and `content`).
    async fn request_filter(
        &self,
        _st: &State,
        _s: &mut Session,
        _ctx: &mut Self::Ctx,
    ) -> Result<Flow, Error> {
        Ok(Flow::Continue)
    }

    // === upstream ===

    // === cache ===

    /// Before the route's cache (`[route.cache]`, cache.rs) looks the
    /// request up: `Flow::Respond` answers instead (a cache of the phase's
    /// own), and `cache_ctl` may bypass the route's cache or set its key.
    async fn cache_lookup(
        &self,
        _st: &State,
        _s: &mut Session,
        _ctx: &mut Self::Ctx,
    ) -> Result<Flow, Error> {
        Ok(Flow::Continue)
    }

    /// The origin's response head, after `upstream_response_filter` and
    /// before `response_filter`. Edits made here are stored: the route's
    /// cache decides on (and keeps) the head as this step leaves it. Not run
    /// on a hit (it ran when the hit was stored).
    fn cache_store(
        &self,
        _st: &State,
        _s: &mut Session,
        _resp: &ResponseHead,
        _ctx: &mut Self::Ctx,
    ) {
    }

    /// This request's cache controls (Lua `pier.cache`), kept in the
    /// phase context: read before the cache lookup (bypass, key) and after
    /// `response_filter` (cacheable, TTL).
    fn cache_ctl<'a>(&self, _ctx: &'a mut Self::Ctx) -> Option<&'a mut crate::cache_key::CacheCtl> {
        None
    }

    /// Where this request's body goes when a phase reads it in full
    /// (Lua `ngx.req.read_body`), kept in the phase context; None: phases
    /// never read bodies, which then stream to the origin.
    fn req_body<'a>(
        &self,
        _st: &State,
        _s: &Session,
        _ctx: &'a mut Self::Ctx,
    ) -> Option<&'a mut crate::ReqBody> {
        None
    }

    /// Choose or override the peer (Lua `balancer`).
    async fn upstream_peer(
        &self,
        _st: &State,
        _s: &mut Session,
        _ctx: &mut Self::Ctx,
    ) -> Result<PeerChoice, Error> {
        Ok(PeerChoice::default())
    }

    /// A peer was chosen for an attempt: per-server limits.
    fn peer_selected(
        &self,
        _st: &State,
        _s: &mut Session,
        _ctx: &mut Self::Ctx,
        _peer: SocketAddr,
    ) -> Result<Flow, Error> {
        Ok(Flow::Continue)
    }

    /// An attempt on `peer` failed before the request reached it (connect,
    /// TLS: `e.kind`), and nothing went to the client: `Flow::Retry`,
    /// `Flow::Respond`, or `Flow::Continue` for the driver's own policy
    /// (another peer for any method, within the retries). As Pingora's
    /// `fail_to_connect`; Lua: the `balancer` hook runs again, with
    /// `pier.balancer.get_last_failure()` saying `"failed"`.
    async fn fail_to_connect(
        &self,
        _st: &State,
        _s: &mut Session,
        _ctx: &mut Self::Ctx,
        _peer: SocketAddr,
        _e: &Error,
    ) -> Result<Flow, Error> {
        Ok(Flow::Continue)
    }

    /// An attempt on `peer` failed after the request went (the origin
    /// closed, timed out, answered what can't be relayed) before anything
    /// went to the client: as `fail_to_connect`, but the driver's own policy
    /// retries only idempotent requests. As Pingora's `error_while_proxy`;
    /// Lua: the `balancer` hook again, `get_last_failure()` saying `"next"`.
    async fn error_while_proxy(
        &self,
        _st: &State,
        _s: &mut Session,
        _ctx: &mut Self::Ctx,
        _peer: SocketAddr,
        _e: &Error,
    ) -> Result<Flow, Error> {
        Ok(Flow::Continue)
    }

    /// Edit the request about to be sent upstream (Lua `upstream_request`).
    async fn upstream_request_filter(
        &self,
        _st: &State,
        _s: &mut Session,
        _ctx: &mut Self::Ctx,
    ) -> Result<Flow, Error> {
        Ok(Flow::Continue)
    }

    // === response ===

    /// Edit the origin's response head as it arrived, before the cache sees
    /// it (what a cache stores); `response_filter` then edits what this
    /// client gets. Not run on a hit, whose stored head it already edited.
    fn upstream_response_filter(
        &self,
        _st: &State,
        _s: &mut Session,
        _resp: &mut ResponseHead,
        _ctx: &mut Self::Ctx,
    ) -> Result<(), Error> {
        Ok(())
    }

    /// Edit the response head before it goes to the client (Lua `header_filter`).
    fn response_filter(
        &self,
        _st: &State,
        _s: &mut Session,
        _resp: &mut ResponseHead,
        _ctx: &mut Self::Ctx,
    ) -> Result<(), Error> {
        Ok(())
    }

    /// Does this request's route filter response bodies? (Then the driver
    /// decodes the body and calls `body_filter` per piece.)
    fn has_body_filter(&self, _st: &State, _s: &Session) -> bool {
        false
    }

    /// Edit a piece of the response body (Lua `body_filter`); `eof` on the last call.
    fn body_filter(
        &self,
        _st: &State,
        _s: &mut Session,
        _ctx: &mut Self::Ctx,
        _chunk: &mut bytes::BytesMut,
        _eof: bool,
    ) -> Result<(), Error> {
        Ok(())
    }

    // === logging ===

    /// After the response is sent; must not block the client (Lua `log`).
    fn logging(&self, _st: &State, _s: &mut Session, _ctx: &mut Self::Ctx) {}
}

/// The plain proxy: every phase at its default.
pub struct NoPhases;

impl Phases for NoPhases {
    type Ctx = ();
}

#[cfg(test)]
mod tests {
    use super::Step;

    /// docs/phases.md's chart names every step, in the enum's order: the
    /// first mention of each `Step::X` in the chart comes after the one
    /// before it, and the chart names no step the enum lacks.
    #[test]
    fn the_chart_lists_the_steps_in_order() {
        let doc = include_str!("../../../docs/phases.md");
        let chart = doc
            .split("```")
            .nth(1)
            .expect("docs/phases.md has its chart");
        let mut at = 0;
        for s in Step::ALL {
            let needle = format!("Step::{}", s.name());
            let i = chart[at..]
                .find(&needle)
                .unwrap_or_else(|| panic!("the chart lacks {needle} after the step before it"));
            at += i + needle.len();
        }
        let named: Vec<&str> = Step::ALL.iter().map(|s| s.name()).collect();
        for part in chart.split("Step::").skip(1) {
            let name: String = part
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric())
                .collect();
            assert!(
                named.contains(&name.as_str()),
                "the chart names Step::{name}"
            );
        }
        // `ALL` is the enum: `name` is an exhaustive match, and each variant once.
        let mut dedup = named.clone();
        dedup.sort();
        dedup.dedup();
        assert_eq!(dedup.len(), Step::ALL.len());
    }
}
