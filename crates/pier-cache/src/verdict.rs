//! The cache's vocabulary shared with the engine and its phases: what a
//! phase decided about caching a request, and what the cache step did.

/// What a phase decided about caching this request (set in `access` and
/// `header_filter`; the driver reads it through `Phases::cache_ctl`).
#[derive(Debug, Default, Clone, PartialEq)]
pub struct CacheCtl {
    /// Neither look up nor store.
    pub bypass: bool,
    /// The key to use instead of the route's.
    pub key: Option<Vec<u8>>,
    /// Freshness lifetime for what is stored, seconds (overrides the
    /// origin's and the route's); 0 means do not store.
    pub ttl: Option<u64>,
    /// `header_filter`'s verdict: store (with `ttl`, or the route's TTL for
    /// the status) or don't, whatever the RFC rules said.
    pub cacheable: Option<bool>,
}

/// The cache step's outcome for one request, as analytics events carry it
/// (the `result` label of `pier_cache_lookups_total`, in nginx's
/// `$upstream_cache_status` spelling). One byte: `Session` is per connection.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum CacheResult {
    /// No cache on the route (or a phase bypassed it).
    #[default]
    None,
    Hit,
    Miss,
    /// A stored object was stale: the origin was asked (see `Revalidated`).
    Expired,
    /// The origin answered 304 to the stored validators.
    Revalidated,
    /// Served stale (stale-while-revalidate taken by another, or the origin
    /// failed: stale-if-error, grace).
    Stale,
    /// Served stale while this request's background refresh runs.
    Updating,
    /// Waited for another request's fill of the same key.
    Coalesced,
    /// Not cacheable as asked (unsafe method, Range, HEAD miss, hit-for-miss).
    Pass,
}

impl CacheResult {
    pub fn as_str(self) -> &'static str {
        match self {
            CacheResult::None => "",
            CacheResult::Hit => "HIT",
            CacheResult::Miss => "MISS",
            CacheResult::Expired => "EXPIRED",
            CacheResult::Revalidated => "REVALIDATED",
            CacheResult::Stale => "STALE",
            CacheResult::Updating => "UPDATING",
            CacheResult::Coalesced => "COALESCED",
            CacheResult::Pass => "PASS",
        }
    }
}
