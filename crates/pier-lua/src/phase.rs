//! Hook phases and the sets of phases an API call is allowed in.

use std::fmt;

/// The phase a hook runs in (OpenResty's `*_by_lua` phases).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Phase {
    /// Once per Lua state, when it is created (per worker thread, per config load).
    Init = 0,
    /// Once per worker thread, after `Init`.
    InitWorker = 1,
    /// Before proxying: may rewrite the request, respond, redirect.
    Access = 2,
    /// Responds entirely from Lua.
    Content = 3,
    /// Chooses the upstream peer and retries.
    Balancer = 4,
    /// Edits the request about to be sent to the origin.
    UpstreamRequest = 5,
    /// Response status and headers (no yielding).
    HeaderFilter = 6,
    /// Each response body chunk (no yielding).
    BodyFilter = 7,
    /// After the response (no yielding).
    Log = 8,
    /// A `pier.timer` callback.
    Timer = 9,
}

impl Phase {
    /// All phases, in id order.
    pub const ALL: [Phase; 10] = [
        Phase::Init,
        Phase::InitWorker,
        Phase::Access,
        Phase::Content,
        Phase::Balancer,
        Phase::UpstreamRequest,
        Phase::HeaderFilter,
        Phase::BodyFilter,
        Phase::Log,
        Phase::Timer,
    ];

    /// The phases a route can hook (index into [`crate::RouteHooks`]).
    pub const ROUTE: [Phase; 7] = [
        Phase::Access,
        Phase::Content,
        Phase::Balancer,
        Phase::UpstreamRequest,
        Phase::HeaderFilter,
        Phase::BodyFilter,
        Phase::Log,
    ];

    /// The name used in config and error messages.
    pub fn name(self) -> &'static str {
        match self {
            Phase::Init => "init",
            Phase::InitWorker => "init_worker",
            Phase::Access => "access",
            Phase::Content => "content",
            Phase::Balancer => "balancer",
            Phase::UpstreamRequest => "upstream_request",
            Phase::HeaderFilter => "header_filter",
            Phase::BodyFilter => "body_filter",
            Phase::Log => "log",
            Phase::Timer => "timer",
        }
    }

    /// Index in [`Phase::ROUTE`], for the route phases.
    pub(crate) fn route_slot(self) -> Option<usize> {
        Phase::ROUTE.iter().position(|p| *p == self)
    }

    pub(crate) const fn bit(self) -> u32 {
        1 << self as u32
    }
}

impl fmt::Display for Phase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Bit sets of phases (bit `1 << phase id`), one per API group. The table in
/// docs/lua.md is this module written out.
pub(crate) mod mask {
    use super::Phase::*;

    const fn set(phases: &[super::Phase]) -> u32 {
        let mut m = 0;
        let mut i = 0;
        while i < phases.len() {
            m |= phases[i].bit();
            i += 1;
        }
        m
    }

    /// Reading the request: headers, URI, method, args, `pier.var`.
    pub const REQ_READ: u32 = set(&[
        Access,
        Content,
        Balancer,
        UpstreamRequest,
        HeaderFilter,
        BodyFilter,
        Log,
    ]);
    /// Changing the request.
    /// (The balancer: the request has not gone yet, and a retry after a
    /// failed attempt may go changed.)
    pub const REQ_WRITE: u32 = set(&[Access, Content, Balancer, UpstreamRequest]);
    /// Reading the response status and headers (recorded ones before it exists).
    pub const RESP_READ: u32 = set(&[Access, Content, HeaderFilter, BodyFilter, Log]);
    /// Changing the response status and headers.
    pub const RESP_WRITE: u32 = set(&[Access, Content, HeaderFilter]);
    /// `pier.exit`, `pier.redirect`.
    pub const EXIT: u32 = set(&[Access, Content, UpstreamRequest]);
    /// `pier.say`, `pier.print`.
    pub const SAY: u32 = set(&[Access, Content]);
    /// `pier.ctx`.
    pub const CTX: u32 = REQ_READ;
    /// `pier.arg` (body chunk).
    pub const BODY: u32 = set(&[BodyFilter]);
    /// `pier.balancer.*`.
    pub const BALANCER: u32 = set(&[Balancer]);
    /// `pier.cache.bypass`, `pier.cache.set_key`: before the cache lookup.
    pub const CACHE_REQ: u32 = set(&[Access]);
    /// `pier.cache.set_ttl`.
    pub const CACHE_TTL: u32 = set(&[Access, HeaderFilter]);
    /// `pier.cache.set_cacheable`: once the response head is known.
    pub const CACHE_RESP: u32 = set(&[HeaderFilter]);
    /// `pier.analytics.field`: the log phase only (docs/analytics.md).
    pub const LOG: u32 = set(&[Log]);
    /// Calls that yield: `pier.sleep`, cosockets, `pier.http`.
    pub const YIELD: u32 = set(&[Access, Content, Balancer, UpstreamRequest, Timer]);
    /// Any phase.
    pub const ANY: u32 = (1 << 10) - 1;
    /// `pier.timer.*`.
    pub const TIMER: u32 = set(&[
        InitWorker,
        Access,
        Content,
        Balancer,
        UpstreamRequest,
        HeaderFilter,
        BodyFilter,
        Log,
        Timer,
    ]);
}
