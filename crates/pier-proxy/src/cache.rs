//! The engine's cache steps (`Step::CacheLookup`, `Step::CacheStore`) over
//! `pier-cache`: a hit is one more `ResponseSource` (the relay does not
//! know it is not an origin), and a fill wraps the origin's source so that
//! what streams to the client is kept as it goes.

use crate::protocol::{BodySize, ResponseSource};
use crate::session::Session;
use crate::state::State;
use bytes::BytesMut;
use pier_cache::policy::{self, CacheControl, StorePolicy, Use};
use pier_cache::{Fill, FillGuard, Object, Zone};
use pier_error::Error;
use pier_http::{known, Headers, Method, ResponseHead};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

/// A miss that may be stored: what the fill needs to know.
pub struct CacheFill {
    zone: Arc<Zone>,
    key: Vec<u8>,
    guard: Option<FillGuard>,
    /// A stale object being revalidated with its validators.
    stale: Option<Arc<Object>>,
    request_time: u64,
    req_cc: CacheControl,
    authorization: bool,
    policy: StorePolicy,
    hit_for_miss: u64,
    req_headers: Headers,
}

/// What the lookup decided.
pub enum Lookup {
    /// Serve from the cache.
    Hit(CacheSource),
    /// Go to the origin; store what comes back when `Some`.
    Miss(Option<Box<CacheFill>>),
    /// `only-if-cached` and nothing stored: 504.
    NotCached,
}

fn req_cc(sess: &Session) -> CacheControl {
    let mut cc = CacheControl::parse(&sess.req.headers);
    // Pragma: no-cache counts when there is no Cache-Control (RFC 9111 §5.4).
    if sess.req.headers.get(b"cache-control").is_none()
        && sess
            .req
            .headers
            .get(b"pragma")
            .is_some_and(|p| p.eq_ignore_ascii_case(b"no-cache"))
    {
        cc.no_cache = true;
    }
    cc
}

/// The cache step of a request on a route with `[route.cache]`.
pub async fn lookup(state: &State, sess: &mut Session, route: usize) -> Lookup {
    let Some(rc) = state.cfg.routes[route].cache.as_ref() else {
        return Lookup::Miss(None);
    };
    let zone = state.cache_zones[rc.zone].clone();
    let host = sess.req.host().unwrap_or(b"");
    let target = sess
        .req
        .absolute_form()
        .map(|(_, t)| t)
        .unwrap_or(sess.req.uri());
    let key = pier_cache::key(sess.scheme(), host, target);
    let method = sess.req.method_kind();
    if !matches!(method, Method::Get | Method::Head) {
        // Unsafe methods invalidate what is stored for the URL (RFC 9111 §4.4).
        if !matches!(method, Method::Options) {
            zone.invalidate(&key);
        }
        zone.stats.pass.fetch_add(1, Relaxed);
        return Lookup::Miss(None);
    }
    let cc = req_cc(sess);
    let now = pier_cache::now();
    let mut waited = false;
    let guard = loop {
        let mut stale = None;
        if let Some(obj) = zone.lookup(&key, &sess.req.headers) {
            let age = obj.age(now);
            match policy::usable(obj.lifetime, age, &obj.cc, &cc) {
                // Stale-while-revalidate is served as stale would be after
                // a refresh: this first part revalidates in the request.
                Use::Fresh => {
                    zone.stats.hit.fetch_add(1, Relaxed);
                    return Lookup::Hit(CacheSource::new(obj, sess, age, "hit"));
                }
                Use::StaleWhileRevalidate | Use::Revalidate => {
                    if obj.etag.is_some() || !obj.last_modified.is_empty() {
                        stale = Some(obj);
                    }
                }
            }
        }
        if cc.only_if_cached && stale.is_none() {
            return Lookup::NotCached;
        }
        if method == Method::Head {
            // A HEAD is answered from a stored GET, but its own answer has
            // no body to store: it goes to the origin without a fill.
            zone.stats.pass.fetch_add(1, Relaxed);
            return Lookup::Miss(None);
        }
        match zone.fill(&key, now) {
            Fill::Leader(g) => break (Some(g), stale),
            Fill::Follower(rx) if !waited => {
                waited = true;
                if pier_cache::wait_fill(rx, rc.lock_timeout).await {
                    zone.stats.coalesced.fetch_add(1, Relaxed);
                } else {
                    zone.stats.lock_timeouts.fetch_add(1, Relaxed);
                    break (None, stale);
                }
            }
            Fill::Follower(_) => break (None, stale),
            Fill::Pass => {
                zone.stats.pass.fetch_add(1, Relaxed);
                return Lookup::Miss(None);
            }
        }
    };
    let (guard, stale) = guard;
    zone.stats.miss.fetch_add(1, Relaxed);
    // The origin gets an unconditional request (what comes back is stored
    // whole), or a conditional one with the stored validators.
    let up = &mut sess.up_req.headers;
    up.remove_known(known::IF_NONE_MATCH);
    up.remove_known(known::IF_MODIFIED_SINCE);
    if let Some(o) = &stale {
        if let Some(e) = &o.etag {
            up.append(b"If-None-Match", e);
        } else {
            up.append(b"If-Modified-Since", &o.last_modified);
        }
    }
    let policy = StorePolicy {
        default_ttl: rc.ttl.iter().map(|(s, d)| (*s, d.as_secs())).collect(),
        override_origin: rc.override_origin,
        heuristic_fraction: 0.1,
        heuristic_max: 86_400,
    };
    Lookup::Miss(Some(Box::new(CacheFill {
        zone,
        key,
        guard,
        stale,
        request_time: now,
        req_cc: cc,
        authorization: sess.req.headers.has_known(known::AUTHORIZATION),
        policy,
        hit_for_miss: rc.hit_for_miss.as_secs(),
        req_headers: sess.req.headers.clone(),
    })))
}

/// Does the client's conditional request match the stored object?
fn not_modified(sess: &Session, obj: &Object) -> bool {
    let h = &sess.req.headers;
    if let Some(inm) = h.get_known(known::IF_NONE_MATCH) {
        return obj
            .etag
            .as_deref()
            .is_some_and(|e| policy::etag_matches(inm, e));
    }
    match (
        h.get_known(known::IF_MODIFIED_SINCE)
            .and_then(policy::http_date),
        policy::http_date(&obj.last_modified),
    ) {
        (Some(since), Some(lm)) => lm <= since,
        _ => false,
    }
}

/// A stored response as a response source (or a 304 to a client whose
/// conditional request matches it).
pub struct CacheSource {
    obj: Arc<Object>,
    status: u16,
    age: u64,
    head_only: bool,
    sent: bool,
    status_detail: &'static str,
}

impl CacheSource {
    fn new(obj: Arc<Object>, sess: &Session, age: u64, detail: &'static str) -> Self {
        let status = if obj.status == 200 && not_modified(sess, &obj) {
            304
        } else {
            obj.status
        };
        CacheSource {
            head_only: sess.req.method_kind() == Method::Head || status == 304,
            obj,
            status,
            age,
            sent: false,
            status_detail: detail,
        }
    }
}

/// A stored head as sent: the stored fields, Age, Cache-Status.
fn stored_head(obj: &Object, status: u16, age: u64, detail: &str, head: &mut ResponseHead) {
    head.headers.clear();
    head.set_status(status);
    head.version = 1;
    for (k, v) in obj.headers.iter() {
        if status == 304 && k.eq_ignore_ascii_case(b"content-length") {
            continue;
        }
        head.headers.append(k, v);
    }
    if obj.headers.get(b"last-modified").is_none() {
        head.headers.append(b"Last-Modified", &obj.last_modified);
    }
    head.headers.remove(b"age");
    head.headers
        .append(b"Age", itoa::Buffer::new().format(age).as_bytes());
    let ttl = obj.lifetime as i64 - age as i64;
    let mut cs = format!("pier; {detail}").into_bytes();
    if detail == "hit" {
        cs.extend_from_slice(format!("; ttl={ttl}").as_bytes());
    }
    head.headers.append(b"Cache-Status", &cs);
}

impl ResponseSource for CacheSource {
    async fn read_head(&mut self, head: &mut ResponseHead) -> Result<(), Error> {
        stored_head(&self.obj, self.status, self.age, self.status_detail, head);
        Ok(())
    }
    fn body_size(&self) -> BodySize {
        if self.head_only {
            BodySize::None
        } else {
            BodySize::Length(self.obj.body.len() as u64)
        }
    }
    async fn read_body(&mut self) -> Result<Option<(&[u8], bool)>, Error> {
        if self.sent || self.head_only || self.obj.body.is_empty() {
            return Ok(None);
        }
        self.sent = true;
        Ok(Some((&self.obj.body[..], true)))
    }
    fn trailers(&self) -> Option<&Headers> {
        None
    }
    fn reusable(&self) -> bool {
        true
    }
}

/// The origin's answer on a cacheable miss: relayed as it comes, kept on
/// the side, stored when complete (within `max_object`). A 304 to a
/// revalidation becomes the stored object, refreshed.
pub struct TeeSource<S> {
    inner: S,
    fill: Box<CacheFill>,
    /// Body kept so far; None once it can't be stored.
    body: Option<BytesMut>,
    head: Option<(u16, Headers)>,
    /// Serving the stored object after a 304.
    from_stale: Option<CacheSource>,
    lifetime: u64,
}

impl<S> TeeSource<S> {
    pub fn new(inner: S, fill: Box<CacheFill>) -> Self {
        TeeSource {
            inner,
            fill,
            body: None,
            head: None,
            from_stale: None,
            lifetime: 0,
        }
    }
}

/// Store a complete fill (fields of a `TeeSource`, apart from its source).
fn store(
    head: &mut Option<(u16, Headers)>,
    body: &mut Option<BytesMut>,
    fill: &CacheFill,
    lifetime: u64,
) {
    {
        let (Some((status, headers)), Some(body)) = (head.take(), body.take()) else {
            return;
        };
        let now = pier_cache::now();
        let etag = headers.get(b"etag").map(|e| e.to_vec());
        let last_modified = headers
            .get(b"last-modified")
            .map(|l| l.to_vec())
            // Synthetic Last-Modified (Smart Edge Revalidation): clients'
            // revalidations can become 304s without an origin validator.
            .unwrap_or_else(|| {
                pier_http::date::with_date(now.saturating_mul(1_000_000_000), |d| d.to_vec())
            });
        let date = headers
            .get(b"date")
            .and_then(policy::http_date)
            .unwrap_or(now);
        let age_header = headers
            .get(b"age")
            .and_then(|a| std::str::from_utf8(a).ok()?.trim().parse().ok())
            .unwrap_or(0);
        let vary = pier_cache::vary_of(&headers, &fill.req_headers);
        let obj = Object {
            status,
            cc: CacheControl::parse(&headers),
            headers,
            body: body.freeze(),
            lifetime,
            request_time: fill.request_time,
            response_time: now,
            date,
            age_header,
            vary,
            etag,
            last_modified,
        };
        fill.zone.insert(fill.key.clone(), obj);
    }
}

/// Fields a stored response does not keep.
fn keep_stored(name: &[u8]) -> bool {
    !(name.eq_ignore_ascii_case(b"connection")
        || name.eq_ignore_ascii_case(b"keep-alive")
        || name.eq_ignore_ascii_case(b"transfer-encoding")
        || name.eq_ignore_ascii_case(b"proxy-connection")
        || name.eq_ignore_ascii_case(b"upgrade")
        || name.eq_ignore_ascii_case(b"te")
        || name.eq_ignore_ascii_case(b"cache-status"))
}

impl<S: ResponseSource> ResponseSource for TeeSource<S> {
    async fn read_head(&mut self, head: &mut ResponseHead) -> Result<(), Error> {
        self.inner.read_head(head).await?;
        if head.status < 200 {
            return Ok(());
        }
        let now = pier_cache::now();
        let f = &self.fill;
        if head.status == 304 {
            if let Some(stale) = f.stale.clone() {
                // Revalidated: the stored object, its fields updated.
                f.zone.stats.revalidated.fetch_add(1, Relaxed);
                let mut headers = Headers::default();
                for (k, v) in stale.headers.iter() {
                    if head.headers.get(k).is_none() || k.eq_ignore_ascii_case(b"content-length") {
                        headers.append(k, v);
                    }
                }
                for (k, v) in head.headers.iter() {
                    if keep_stored(k) && !k.eq_ignore_ascii_case(b"content-length") {
                        headers.append(k, v);
                    }
                }
                let lifetime = policy::storable(
                    true,
                    &f.req_cc,
                    f.authorization,
                    stale.status,
                    &headers,
                    now,
                    &f.policy,
                )
                .unwrap_or(0);
                let obj = Object {
                    status: stale.status,
                    cc: CacheControl::parse(&headers),
                    headers,
                    body: stale.body.clone(),
                    lifetime,
                    request_time: f.request_time,
                    response_time: now,
                    date: now,
                    age_header: 0,
                    vary: stale.vary.clone(),
                    etag: stale.etag.clone(),
                    last_modified: stale.last_modified.clone(),
                };
                f.zone.insert(f.key.clone(), obj.clone());
                let obj = Arc::new(obj);
                let req_like = SessionView(&f.req_headers);
                let mut src = CacheSource {
                    head_only: false,
                    status: obj.status,
                    obj,
                    age: 0,
                    sent: false,
                    status_detail: "fwd=stale; fwd-status=304",
                };
                if req_like.not_modified(&src.obj) {
                    src.status = 304;
                    src.head_only = true;
                }
                src.read_head(head).await?;
                self.from_stale = Some(src);
                return Ok(());
            }
        }
        match policy::storable(
            true,
            &f.req_cc,
            f.authorization,
            head.status,
            &head.headers,
            now,
            &f.policy,
        ) {
            Ok(lifetime) => {
                self.lifetime = lifetime;
                let mut h = Headers::default();
                for (k, v) in head.headers.iter() {
                    if keep_stored(k) {
                        h.append(k, v);
                    }
                }
                self.head = Some((head.status, h));
                self.body = Some(BytesMut::new());
                head.headers
                    .append(b"Cache-Status", b"pier; fwd=miss; stored");
            }
            Err(_) => {
                if let Some(g) = &f.guard {
                    g.uncacheable(now, f.hit_for_miss);
                }
                head.headers.append(b"Cache-Status", b"pier; fwd=miss");
            }
        }
        Ok(())
    }

    fn body_size(&self) -> BodySize {
        match &self.from_stale {
            Some(s) => s.body_size(),
            None => self.inner.body_size(),
        }
    }

    async fn read_body(&mut self) -> Result<Option<(&[u8], bool)>, Error> {
        if self.from_stale.is_some() {
            return match self.from_stale.as_mut() {
                Some(s) => s.read_body().await,
                None => Ok(None),
            };
        }
        let max = self.fill.zone.max_object;
        match self.inner.read_body().await? {
            Some((data, last)) => {
                if let Some(b) = self.body.as_mut() {
                    if b.len() + data.len() > max {
                        // Too big: streams through, not stored.
                        self.body = None;
                        self.head = None;
                    } else {
                        b.extend_from_slice(data);
                    }
                }
                Ok(Some((data, last)))
            }
            None => {
                store(&mut self.head, &mut self.body, &self.fill, self.lifetime);
                // The fill is done: waiters look again.
                self.fill.guard = None;
                Ok(None)
            }
        }
    }

    fn trailers(&self) -> Option<&Headers> {
        self.inner.trailers()
    }

    fn reusable(&self) -> bool {
        self.inner.reusable()
    }
}

/// The client's conditional fields, for a revalidated object.
struct SessionView<'a>(&'a Headers);

impl SessionView<'_> {
    fn not_modified(&self, obj: &Object) -> bool {
        if let Some(inm) = self.0.get_known(known::IF_NONE_MATCH) {
            return obj
                .etag
                .as_deref()
                .is_some_and(|e| policy::etag_matches(inm, e));
        }
        match (
            self.0
                .get_known(known::IF_MODIFIED_SINCE)
                .and_then(policy::http_date),
            policy::http_date(&obj.last_modified),
        ) {
            (Some(since), Some(lm)) => lm <= since,
            _ => false,
        }
    }
}
