//! The engine's cache steps (`Step::CacheLookup`, `Step::CacheStore`) over
//! `pier-cache`: a hit is one more `ResponseSource` (the relay does not
//! know it is not an origin), and a fill wraps the origin's source so that
//! what streams to the client is kept as it goes — and published to the
//! requests that follow the fill (`pier_cache::fill`), which stream it as
//! it arrives.

use crate::session::{CacheResult, Session};
use crate::state::State;
use bytes::BytesMut;
use pier_cache::fill::{FillBuf, FillHead, HeadWait, Piece};
use pier_cache::policy::{self, CacheControl, StorePolicy, Use};
use pier_cache::{Fill, FillGuard, Object, Zone};
use pier_error::Error;
use pier_http::{known, Headers, Method, ResponseHead};
use pier_session::{BodySize, ResponseSource};
use std::io::Write as _;
use std::sync::Arc;

/// A miss that may be stored: what the fill needs to know.
pub struct CacheFill {
    zone: Arc<Zone>,
    /// Shared with the fill table and, once stored, the zone's entry.
    key: Arc<[u8]>,
    guard: Option<FillGuard>,
    /// What is stored for the key, stale: revalidated with its validators,
    /// served instead of an origin's 5xx when `stale-if-error`/`grace` allow.
    stale: Option<Arc<Object>>,
    request_time: u64,
    /// When the origin's head came (`origin_head`); what `store` records.
    response_time: u64,
    req_cc: CacheControl,
    authorization: bool,
    policy: StorePolicy,
    hit_for_miss: u64,
    /// The route's `grace`, seconds.
    grace: u64,
    /// The request's fields, for answers from the stale object: a copy into
    /// a spare map (`pier_cache::recycle`), given back on drop; empty (no
    /// copy) when nothing is stored for the key.
    req_headers: Headers,
}

thread_local! {
    /// The buffer lookups build keys in: a hit allocates no key, a miss
    /// one (the `Arc` it shares with the fill table and the zone).
    static KEY_BUF: std::cell::Cell<Vec<u8>> = const { std::cell::Cell::new(Vec::new()) };
}

/// The thread's key buffer, taken for one lookup (which awaits, so it is
/// moved out rather than borrowed) and given back on drop.
struct KeyBuf(Vec<u8>);

impl KeyBuf {
    fn take() -> KeyBuf {
        KeyBuf(KEY_BUF.try_with(|b| b.take()).unwrap_or_default())
    }
}

impl Drop for KeyBuf {
    fn drop(&mut self) {
        let k = std::mem::take(&mut self.0);
        if k.capacity() <= crate::cache_key::MAX_KEY {
            let _ = KEY_BUF.try_with(|b| b.set(k));
        }
    }
}

/// A copy of `h` in a spare map (`pier_cache::recycle`): a miss allocates
/// none once warm.
fn pooled_copy(h: &Headers) -> Headers {
    let mut c = pier_cache::recycle::headers();
    c.copy_from(h);
    c
}

impl CacheFill {
    /// The cache key (the tiered cache hashes it to a parent).
    pub fn key(&self) -> &Arc<[u8]> {
        &self.key
    }
}

impl Drop for CacheFill {
    fn drop(&mut self) {
        pier_cache::recycle::give_headers(std::mem::take(&mut self.req_headers));
    }
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
    if !sess.req.headers.has_known(known::CACHE_CONTROL)
        && sess
            .req
            .headers
            .get_known(known::PRAGMA)
            .is_some_and(|p| p.eq_ignore_ascii_case(b"no-cache"))
    {
        cc.no_cache = true;
    }
    cc
}

/// The request header that marks Pier's own background refresh (set only
/// on the request the refresh task builds; a client's is removed by
/// `lookup`, so a client cannot force a revalidation through it).
/// It has a slot (`known::X_PIER_CACHE_REFRESH`): every lookup checks it.
const REFRESH_MARK: known::Known = known::X_PIER_CACHE_REFRESH;

/// The cache step of a request on a route with `[route.cache]`.
pub async fn lookup(
    state: &State,
    sess: &mut Session,
    route: usize,
    ctl: Option<&crate::cache_key::CacheCtl>,
) -> Lookup {
    let Some(rc) = state.cfg.routes[route].cache.as_ref() else {
        return Lookup::Miss(None);
    };
    let zone = state.cache_zones[rc.zone].clone();
    let mut buf = KeyBuf::take();
    crate::cache_key::key_into(&mut buf.0, state, sess, route, ctl);
    let key = &buf.0[..];
    // Made at the first fill: the one allocation of a key on a miss.
    let mut shared: Option<Arc<[u8]>> = None;
    let method = sess.req.method_kind();
    // An Upgrade let through (WebSocket, over HTTP/1.1 or an HTTP/2
    // extended CONNECT) is a tunnel: never a stored answer, never a fill.
    if !matches!(method, Method::Get | Method::Head) || sess.upgrade {
        // Unsafe methods invalidate once answered (`after_response`).
        zone.stats.pass.add(1);
        sess.cache = CacheResult::Pass;
        return Lookup::Miss(None);
    }
    // Pier's own refresh (stale-while-revalidate) goes to the origin even
    // though a stale object may serve: `refresh` tells it apart.
    let marked = sess.req.headers.has_known(REFRESH_MARK);
    let refresh = marked && sess.conn.listener.is_none();
    if marked {
        sess.req.headers.remove_known(REFRESH_MARK);
        sess.up_req.headers.remove_known(REFRESH_MARK);
    }
    let cc = req_cc(sess);
    // The request's start read the clock: no read of its own.
    let now = pier_cache::recent();
    let plain = method == Method::Get
        && !sess.req.headers.has_known(known::IF_NONE_MATCH)
        && !sess.req.headers.has_known(known::IF_MODIFIED_SINCE)
        && !sess.req.headers.has_known(known::RANGE);
    let mut waited = false;
    let guard = loop {
        let mut stale = None;
        if let Some(obj) = zone.get(key, &sess.req.headers).await {
            let age = obj.age(now);
            match policy::usable(obj.lifetime, age, &obj.cc, &cc) {
                Use::Fresh if !refresh => {
                    zone.stats.hit.add(1);
                    sess.cache = CacheResult::Hit;
                    return Lookup::Hit(CacheSource::new(obj, sess, age, "hit"));
                }
                Use::StaleWhileRevalidate if !refresh => {
                    // Served stale now; one background refresh per key.
                    if start_refresh(&zone, key) {
                        zone.stats.updating.add(1);
                        sess.cache = CacheResult::Updating;
                        let mut src =
                            CacheSource::new(obj, sess, age, "hit; detail=stale-while-revalidate");
                        if let CacheSource::Stored(s) = &mut src {
                            s.refresh = Some(key.to_vec());
                        }
                        return Lookup::Hit(src);
                    }
                    zone.stats.stale.add(1);
                    sess.cache = CacheResult::Stale;
                    return Lookup::Hit(CacheSource::new(
                        obj,
                        sess,
                        age,
                        "hit; detail=stale-while-revalidate",
                    ));
                }
                _ => stale = Some(obj),
            }
        }
        if cc.only_if_cached && stale.is_none() {
            return Lookup::NotCached;
        }
        if sess.req.headers.has_known(known::RANGE) {
            // A partial answer is not stored: the range goes to the origin
            // without a fill (the next full GET fills the key).
            zone.stats.pass.add(1);
            sess.cache = CacheResult::Pass;
            return Lookup::Miss(None);
        }
        if method == Method::Head {
            // A HEAD is answered from a stored GET, but its own answer has
            // no body to store: it goes to the origin without a fill.
            zone.stats.pass.add(1);
            sess.cache = CacheResult::Pass;
            return Lookup::Miss(None);
        }
        let k = shared.get_or_insert_with(|| Arc::from(key));
        match zone.fill(k, now) {
            Fill::Leader(g) => break (Some(g), stale),
            Fill::Follower(buf) if !waited => {
                waited = true;
                match buf.wait_head(rc.lock_timeout).await {
                    // The fill's response does not answer this request
                    // (RFC 9111 §4.1: another variant): its own request
                    // to the origin, which stores its own variant.
                    HeadWait::Head(head)
                        if !pier_cache::vary_matches(&head.vary, &sess.req.headers) =>
                    {
                        break (None, stale);
                    }
                    // Readers follow the writer: the body as it arrives.
                    HeadWait::Head(head) if plain && !refresh => {
                        zone.stats.coalesced.add(1);
                        sess.cache = CacheResult::Coalesced;
                        return Lookup::Hit(CacheSource::Follow(Box::new(Follow {
                            rx: buf.subscribe(),
                            buf,
                            head,
                            index: 0,
                            cur: bytes::Bytes::new(),
                            idle: state.cfg.timeouts.upstream_response,
                        })));
                    }
                    // A conditional or partial request is answered from
                    // the stored object once the fill ends.
                    HeadWait::Head(_) => {
                        if buf.wait_end(rc.lock_timeout).await {
                            zone.stats.coalesced.add(1);
                            sess.cache = CacheResult::Coalesced;
                        } else {
                            zone.stats.lock_timeouts.add(1);
                            break (None, stale);
                        }
                    }
                    HeadWait::Again => {
                        zone.stats.coalesced.add(1);
                        sess.cache = CacheResult::Coalesced;
                    }
                    HeadWait::Timeout => {
                        zone.stats.lock_timeouts.add(1);
                        break (None, stale);
                    }
                }
            }
            Fill::Follower(_) => break (None, stale),
            Fill::Pass => {
                zone.stats.pass.add(1);
                sess.cache = CacheResult::Pass;
                return Lookup::Miss(None);
            }
        }
    };
    let (guard, stale) = guard;
    if stale.is_some() {
        zone.stats.expired.add(1);
        sess.cache = CacheResult::Expired;
    } else {
        zone.stats.miss.add(1);
        sess.cache = CacheResult::Miss;
    }
    // The origin gets an unconditional request (what comes back is stored
    // whole), or a conditional one with the stored validators.
    let up = &mut sess.up_req.headers;
    up.remove_known(known::IF_NONE_MATCH);
    up.remove_known(known::IF_MODIFIED_SINCE);
    // The origin sees the client's Accept-Encoding as its bucket (the
    // value Vary compares: `encoding_bucket`), so what it sends for one
    // spelling is right for every client that shares the variant.
    let ae = up.get_known(known::ACCEPT_ENCODING);
    match pier_cache::encoding_bucket(ae) {
        b"identity" => {
            up.remove_known(known::ACCEPT_ENCODING);
        }
        b if ae != Some(b) => {
            up.remove_known(known::ACCEPT_ENCODING);
            up.append_known(known::ACCEPT_ENCODING, b"Accept-Encoding", b)
        }
        _ => {}
    }
    // Origins may address Surrogate-Control directives to Pier.
    up.append_known(
        known::UNKNOWN,
        b"Surrogate-Capability",
        b"pier=\"Surrogate/1.0\"",
    );
    if let Some(o) = &stale {
        if let Some(e) = o.etag() {
            up.append_known(known::IF_NONE_MATCH, b"If-None-Match", e);
        } else if !o.last_modified().is_empty() {
            up.append_known(
                known::IF_MODIFIED_SINCE,
                b"If-Modified-Since",
                o.last_modified(),
            );
        }
    }
    let policy = StorePolicy {
        default_ttl: rc.ttl.iter().map(|(s, d)| (*s, d.as_secs())).collect(),
        override_origin: rc.override_origin,
        heuristic_fraction: 0.1,
        heuristic_max: 86_400,
        store_set_cookie: rc.store_set_cookie,
    };
    // Only answers from a stale object read the request's fields later.
    let req_headers = match stale {
        Some(_) => pooled_copy(&sess.req.headers),
        None => Headers::default(),
    };
    Lookup::Miss(Some(Box::new(CacheFill {
        zone,
        key: shared.unwrap_or_else(|| Arc::from(key)),
        guard,
        stale,
        request_time: now,
        response_time: now,
        req_cc: cc,
        authorization: sess.req.headers.has_known(known::AUTHORIZATION),
        policy,
        hit_for_miss: rc.hit_for_miss.as_secs(),
        grace: rc.grace.as_secs(),
        req_headers,
    })))
}

/// Keys with a background refresh running, per zone (by the zone's
/// address); bounded: past `MAX_REFRESHING` no new refresh starts (the
/// stale object is served, and a later request tries again).
static REFRESHING: std::sync::Mutex<Vec<(usize, Vec<u8>)>> = std::sync::Mutex::new(Vec::new());

fn refreshing() -> std::sync::MutexGuard<'static, Vec<(usize, Vec<u8>)>> {
    REFRESHING.lock().unwrap_or_else(|e| e.into_inner())
}
const MAX_REFRESHING: usize = 1024;

fn start_refresh(zone: &Arc<Zone>, key: &[u8]) -> bool {
    let id = Arc::as_ptr(zone) as usize;
    let mut r = refreshing();
    if r.len() >= MAX_REFRESHING || r.iter().any(|(z, k)| *z == id && k == key) {
        return false;
    }
    r.push((id, key.to_vec()));
    true
}

/// Marks a key's background refresh as ended when dropped.
pub struct RefreshGuard {
    zone: usize,
    key: Vec<u8>,
}

impl Drop for RefreshGuard {
    fn drop(&mut self) {
        refreshing().retain(|(z, k)| !(*z == self.zone && *k == self.key));
    }
}

/// For the driver: after a stale-while-revalidate hit, the request that
/// refreshes the key in the background (`None`: no refresh due). The
/// request is the client's, minus what would make it conditional or
/// partial, marked as Pier's own (see `lookup`).
pub fn refresh_request(
    state: &State,
    src: &mut CacheSource,
    sess: &Session,
) -> Option<(pier_http::RequestHead, RefreshGuard)> {
    let CacheSource::Stored(s) = src else {
        return None;
    };
    let key = s.refresh.take()?;
    let zone = sess
        .route
        .and_then(|r| state.cfg.routes[r].cache.as_ref())
        .map(|rc| Arc::as_ptr(&state.cache_zones[rc.zone]) as usize)?;
    let guard = RefreshGuard { zone, key };
    let mut req = pier_http::RequestHead::default();
    req.copy_from(&sess.req);
    req.headers.remove_known(known::IF_NONE_MATCH);
    req.headers.remove_known(known::IF_MODIFIED_SINCE);
    req.headers.remove(b"range");
    req.headers.remove(b"if-range");
    req.headers.append(b"X-Pier-Cache-Refresh", b"1");
    Some((req, guard))
}

/// A stored response's answer to a request's conditional fields.
struct SessionView<'a>(&'a Headers);

impl SessionView<'_> {
    fn not_modified(&self, obj: &Object) -> bool {
        if let Some(inm) = self.0.get_known(known::IF_NONE_MATCH) {
            return obj.etag().is_some_and(|e| policy::etag_matches(inm, e));
        }
        match (
            self.0
                .get_known(known::IF_MODIFIED_SINCE)
                .and_then(policy::http_date),
            policy::http_date(obj.last_modified()),
        ) {
            (Some(since), Some(lm)) => lm <= since,
            _ => false,
        }
    }
}

/// What a `Range` request gets from a stored full object.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Part {
    Whole,
    Range(usize, usize),
    Unsatisfiable,
}

/// RFC 9110 §14: one `bytes` range (`a-b`, `a-`, `-n`) is served as 206;
/// several ranges, another unit, a syntax error or an `If-Range` that does
/// not match get the whole object (200), which the RFC allows; a range
/// starting past the end is 416.
fn part_of(req: &Headers, obj: &Object) -> Part {
    let Some(r) = req.get(b"range") else {
        return Part::Whole;
    };
    if let Some(ir) = req.get(b"if-range") {
        let ir = ir.trim_ascii();
        let ok = if ir.starts_with(b"\"") {
            // A strong comparison: a weak stored tag never matches.
            obj.etag().is_some_and(|e| e.trim_ascii() == ir)
        } else {
            !ir.starts_with(b"W/") && ir == obj.last_modified().trim_ascii()
        };
        if !ok {
            return Part::Whole;
        }
    }
    let r = r.trim_ascii();
    if r.len() < 6 || !r[..6].eq_ignore_ascii_case(b"bytes=") || r.contains(&b',') {
        return Part::Whole;
    }
    let spec = r[6..].trim_ascii();
    let Some(dash) = spec.iter().position(|&c| c == b'-') else {
        return Part::Whole;
    };
    let num = |b: &[u8]| -> Option<u64> {
        let b = b.trim_ascii();
        if b.is_empty() || b.len() > 19 || !b.iter().all(u8::is_ascii_digit) {
            return None;
        }
        std::str::from_utf8(b).ok()?.parse().ok()
    };
    let len = obj.body.len() as u64;
    let (first, last) = (&spec[..dash], &spec[dash + 1..]);
    if first.trim_ascii().is_empty() {
        // A suffix: the last n bytes.
        return match num(last) {
            None => Part::Whole,
            Some(0) => Part::Unsatisfiable,
            Some(_) if len == 0 => Part::Unsatisfiable,
            Some(n) => Part::Range((len - n.min(len)) as usize, (len - 1) as usize),
        };
    }
    let Some(a) = num(first) else {
        return Part::Whole;
    };
    let b = if last.trim_ascii().is_empty() {
        u64::MAX
    } else {
        match num(last) {
            Some(b) if b >= a => b,
            _ => return Part::Whole,
        }
    };
    if a >= len {
        return Part::Unsatisfiable;
    }
    Part::Range(a as usize, b.min(len - 1) as usize)
}

/// What the cache answers with: a stored response, or a fill in flight
/// followed as it arrives.
pub enum CacheSource {
    Stored(Stored),
    Follow(Box<Follow>),
}

impl CacheSource {
    fn new(obj: Arc<Object>, sess: &Session, age: u64, detail: &'static str) -> Self {
        let head = sess.req.method_kind() == Method::Head;
        CacheSource::Stored(Stored::answer(obj, &sess.req.headers, head, age, detail))
    }
}

/// A stored response as a response source (or a 304 to a client whose
/// conditional request matches it, a 206 or 416 to a range request).
pub struct Stored {
    obj: Arc<Object>,
    status: u16,
    age: u64,
    head_only: bool,
    sent: bool,
    status_detail: &'static str,
    /// The byte range served (206), inclusive; None: the whole body.
    range: Option<(usize, usize)>,
    /// Stale-while-revalidate: the key the driver refreshes in the
    /// background (`refresh_request`).
    refresh: Option<Vec<u8>>,
}

impl Stored {
    /// The stored object as the answer to a request with `req` headers
    /// (`head`: a HEAD request).
    fn answer(obj: Arc<Object>, req: &Headers, head: bool, age: u64, detail: &'static str) -> Self {
        let mut status = if obj.status == 200 && SessionView(req).not_modified(&obj) {
            304
        } else {
            obj.status
        };
        let mut range = None;
        if status == 200 && !head {
            match part_of(req, &obj) {
                Part::Whole => {}
                Part::Range(a, b) => {
                    status = 206;
                    range = Some((a, b));
                }
                Part::Unsatisfiable => status = 416,
            }
        }
        Stored {
            head_only: head || status == 304 || status == 416,
            obj,
            status,
            age,
            sent: false,
            status_detail: detail,
            range,
            refresh: None,
        }
    }

    async fn read_head(&mut self, head: &mut ResponseHead) -> Result<(), Error> {
        stored_head(&self.obj, self.status, self.age, self.status_detail, head);
        let len = self.obj.body.len();
        match (self.status, self.range) {
            (206, Some((a, b))) => {
                head.headers.remove(b"content-length");
                head.headers
                    .append(b"Content-Range", format!("bytes {a}-{b}/{len}").as_bytes());
                head.headers.append(
                    b"Content-Length",
                    itoa::Buffer::new().format(b - a + 1).as_bytes(),
                );
            }
            (416, _) => {
                head.headers.remove(b"content-length");
                head.headers
                    .append(b"Content-Range", format!("bytes */{len}").as_bytes());
                head.headers.append(b"Content-Length", b"0");
            }
            _ => {}
        }
        Ok(())
    }

    fn body_size(&self) -> BodySize {
        match self.range {
            _ if self.status == 416 => BodySize::Length(0),
            _ if self.head_only => BodySize::None,
            Some((a, b)) => BodySize::Length((b - a + 1) as u64),
            None => BodySize::Length(self.obj.body.len() as u64),
        }
    }

    /// The bytes still to send (the body or its range), once: they then
    /// count as sent.
    fn take_span(&mut self) -> Option<(usize, usize)> {
        if self.sent || self.head_only || self.obj.body.is_empty() {
            return None;
        }
        self.sent = true;
        Some(self.range.unwrap_or((0, self.obj.body.len() - 1)))
    }

    fn read_body(&mut self) -> Option<(&[u8], bool)> {
        let (a, b) = self.take_span()?;
        Some((&self.obj.body[a..=b], true))
    }

    /// The body (or its range) as its mapping's pages, when it has one.
    fn take_spliceable(&mut self) -> Option<pier_session::SpliceBody> {
        self.obj.mapped.as_ref()?;
        let (a, b) = self.take_span()?;
        Some(pier_session::SpliceBody {
            mapped: self.obj.mapped.clone()?,
            offset: a as u64,
            bytes: self.obj.body.slice(a..=b),
        })
    }
}

/// A stored head as sent: the stored fields, Age, Cache-Status.
fn stored_head(obj: &Object, status: u16, age: u64, detail: &str, head: &mut ResponseHead) {
    // One copy of the stored fields into the head's own storage (reused
    // from request to request), not an append per field.
    head.headers.copy_from(&obj.headers);
    head.set_status(status);
    head.version = 1;
    if status == 304 {
        head.headers.remove_known(known::CONTENT_LENGTH);
    }
    head.headers.remove_known(known::AGE);
    head.headers.append_known(
        known::AGE,
        b"Age",
        itoa::Buffer::new().format(age).as_bytes(),
    );
    // Built on the stack: `detail` is one of this file's short constants.
    let mut buf = [0u8; 128];
    let mut w = &mut buf[..];
    let _ = write!(w, "pier; {detail}");
    if detail == "hit" {
        let ttl = obj.lifetime as i64 - age as i64;
        let _ = write!(w, "; ttl={ttl}");
    }
    let n = 128 - w.len();
    head.headers
        .append_known(known::CACHE_STATUS, b"Cache-Status", &buf[..n]);
}

impl ResponseSource for CacheSource {
    const STORED: bool = true;
    async fn read_head(&mut self, head: &mut ResponseHead) -> Result<(), Error> {
        match self {
            CacheSource::Stored(s) => s.read_head(head).await,
            CacheSource::Follow(f) => {
                f.read_head(head);
                Ok(())
            }
        }
    }
    fn body_size(&self) -> BodySize {
        match self {
            CacheSource::Stored(s) => s.body_size(),
            CacheSource::Follow(f) => f.body_size(),
        }
    }
    async fn read_body(&mut self) -> Result<Option<(&[u8], bool)>, Error> {
        match self {
            CacheSource::Stored(s) => Ok(s.read_body()),
            CacheSource::Follow(f) => f.read_body().await,
        }
    }
    fn trailers(&self) -> Option<&Headers> {
        None
    }
    fn reusable(&self) -> bool {
        true
    }
    fn take_spliceable(&mut self) -> Option<pier_session::SpliceBody> {
        match self {
            CacheSource::Stored(s) => s.take_spliceable(),
            CacheSource::Follow(_) => None,
        }
    }
}

/// A fill in flight, streamed to a follower as the leader gets it.
pub struct Follow {
    buf: Arc<FillBuf>,
    head: Box<FillHead>,
    rx: tokio::sync::watch::Receiver<u64>,
    index: usize,
    cur: bytes::Bytes,
    /// Longest wait for the next piece.
    idle: std::time::Duration,
}

impl Follow {
    fn read_head(&mut self, head: &mut ResponseHead) {
        head.headers.copy_from(&self.head.headers);
        head.set_status(self.head.status);
        head.version = 1;
        head.headers.remove_known(known::AGE);
        head.headers.append_known(known::AGE, b"Age", b"0");
        head.headers.append_known(
            known::CACHE_STATUS,
            b"Cache-Status",
            b"pier; hit; detail=coalesced",
        );
    }

    fn body_size(&self) -> BodySize {
        match self.head.length {
            Some(n) => BodySize::Length(n),
            None => BodySize::Stream,
        }
    }

    async fn read_body(&mut self) -> Result<Option<(&[u8], bool)>, Error> {
        loop {
            match self.buf.piece(self.index) {
                Piece::Data(b) => {
                    self.index += 1;
                    self.cur = b;
                    return Ok(Some((&self.cur[..], false)));
                }
                Piece::End => return Ok(None),
                // The fill stopped: the rest cannot be had from here.
                Piece::Cut => return Err(Error::answered(pier_error::Kind::UpstreamClosed)),
                Piece::Wait => match tokio::time::timeout(self.idle, self.rx.changed()).await {
                    Ok(Ok(())) => {}
                    // No writer left and nothing more: cut.
                    Ok(Err(_)) => {
                        if matches!(self.buf.piece(self.index), Piece::Wait) {
                            return Err(Error::answered(pier_error::Kind::UpstreamClosed));
                        }
                    }
                    Err(_) => return Err(Error::answered(pier_error::Kind::UpstreamTimeout)),
                },
            }
        }
    }
}

/// The origin's answer on a cacheable miss: relayed as it comes, published
/// to the fill's followers and stored when complete (within `max_object`).
/// A 304 to a revalidation becomes the stored object, refreshed; a 5xx may
/// be replaced by the stale object (`stale-if-error`, `grace`).
pub struct TeeSource<S> {
    inner: S,
    fill: Box<CacheFill>,
    /// Some while the response is to be stored (the bytes themselves are
    /// kept in `buf`).
    body: Option<BytesMut>,
    /// The head to store; its fields move into `buf` when published (and
    /// come back at the end unless a follower still holds them).
    head: Option<(u16, Headers)>,
    /// The origin's head when the RFC rules said not to store it, for a
    /// phase that says store it after all.
    spare: Option<(u16, Headers)>,
    /// The response's Cache-Control, parsed once for `storable` and the
    /// stored object.
    cc: CacheControl,
    /// Serving the stored object after a 304, or instead of a 5xx.
    from_stale: Option<CacheSource>,
    /// Which of the two (`Revalidated`, `Stale`), for the request's log.
    result: Option<CacheResult>,
    lifetime: u64,
    /// The fill's pieces: shared with its followers when this request
    /// leads it, private otherwise.
    buf: Arc<FillBuf>,
    /// The head went to the followers (at the first body read: by then
    /// every phase has had its say on storing).
    published: bool,
    /// The origin's body ended.
    done: bool,
    /// The origin's Content-Length, for followers.
    length: Option<u64>,
    /// The request's values of the fields the response's Vary names
    /// (`origin_head`): which requests the stored object answers.
    vary: pier_cache::VaryValues,
}

impl<S> TeeSource<S> {
    pub fn new(inner: S, fill: Box<CacheFill>) -> Self {
        let buf = match &fill.guard {
            Some(g) => g.buf.clone(),
            None => FillBuf::new(fill.zone.max_object),
        };
        TeeSource {
            inner,
            fill,
            body: None,
            head: None,
            spare: None,
            cc: CacheControl::default(),
            from_stale: None,
            result: None,
            lifetime: 0,
            buf,
            published: false,
            done: false,
            length: None,
            vary: Vec::new(),
        }
    }
}

/// Store a complete fill (its key moves into the zone: the fill is over).
fn store(
    status: u16,
    headers: Headers,
    vary: pier_cache::VaryValues,
    cc: CacheControl,
    body: bytes::Bytes,
    fill: &mut CacheFill,
    lifetime: u64,
) {
    let now = fill.response_time;
    let mut headers = headers;
    let synthetic_lm = !headers.has_known(known::LAST_MODIFIED);
    if synthetic_lm {
        // Synthetic Last-Modified (Smart Edge Revalidation): clients'
        // revalidations can become 304s without an origin validator. It is
        // one of the stored fields (`stored_fields` left room for it), so
        // every hit sends it and revalidations with the origin use it.
        pier_http::date::with_date(now.saturating_mul(1_000_000_000), |d| {
            headers.append_known(known::LAST_MODIFIED, b"Last-Modified", d)
        });
    }
    let date = headers
        .get_known(known::DATE)
        .and_then(policy::http_date)
        .unwrap_or(now);
    let age_header = policy::age_field(&headers);
    let obj = Object {
        status,
        cc,
        headers,
        body,
        mapped: None,
        lifetime,
        request_time: fill.request_time,
        response_time: now,
        date,
        age_header,
        vary,
        synthetic_lm,
    };
    fill.zone.insert(fill.key.clone(), obj);
}

/// The fields a stored response keeps: the origin's, minus hop-by-hop ones
/// (and those its `Connection` names), `Surrogate-Control` (meant for
/// Pier) and `Cache-Status`. One copy of the parsed head, no per-field
/// appends: this runs on every stored miss.
fn stored_fields(resp: &Headers) -> Headers {
    // A map an eviction left, when there is one (`pier_cache::recycle`).
    let mut h = pier_cache::recycle::headers();
    if resp.has_known(known::LAST_MODIFIED) {
        h.copy_from(resp);
    } else {
        // Room for the synthetic Last-Modified `store` adds.
        h.copy_from_with_room(resp, LAST_MODIFIED_FIELD, 1);
    }
    pier_http::remove_hop_by_hop(&mut h);
    h.remove_known(known::TRANSFER_ENCODING);
    h.remove_known(known::SURROGATE_CONTROL);
    h.remove_known(known::CACHE_STATUS);
    h
}

/// Bytes of a `Last-Modified: <IMF-fixdate>` field in a `Headers` arena.
const LAST_MODIFIED_FIELD: usize = b"Last-Modified".len() + 29;

/// Fields a stored response does not keep: hop-by-hop ones, those the
/// origin's `Connection` names, and `Surrogate-Control` (meant for Pier).
fn keep_stored(name: &[u8], resp: &Headers) -> bool {
    if resp.get_all(b"connection").any(|v| {
        v.split(|&c| c == b',')
            .any(|t| t.trim_ascii().eq_ignore_ascii_case(name))
    }) {
        return false;
    }
    !(name.eq_ignore_ascii_case(b"connection")
        || name.eq_ignore_ascii_case(b"surrogate-control")
        || name.eq_ignore_ascii_case(b"keep-alive")
        || name.eq_ignore_ascii_case(b"transfer-encoding")
        || name.eq_ignore_ascii_case(b"proxy-connection")
        || name.eq_ignore_ascii_case(b"upgrade")
        || name.eq_ignore_ascii_case(b"te")
        || name.eq_ignore_ascii_case(b"cache-status"))
}

/// Fields a 304 does not update in the stored response (RFC 9111 §3.2:
/// they describe the stored representation itself).
fn updatable(name: &[u8]) -> bool {
    ![
        &b"content-length"[..],
        b"content-encoding",
        b"content-md5",
        b"content-range",
        b"etag",
    ]
    .iter()
    .any(|n| name.eq_ignore_ascii_case(n))
}

impl<S: ResponseSource> TeeSource<S> {
    /// After the exchange: if the client went away mid-body while the
    /// response is being stored, read the rest from the origin anyway, so
    /// that the fill completes for the requests following it (bounded by
    /// the origin's timeouts and `max_object`).
    pub async fn finish_detached(&mut self) {
        if self.done || self.from_stale.is_some() || self.head.is_none() || self.body.is_none() {
            return;
        }
        while let Ok(Some(_)) = self.read_body().await {}
    }

    /// The stored object, refreshed by a 304's fields, and whether the
    /// result may be stored (RFC 9111 §3 applied to the merged fields: a
    /// 304 that adds one client's Set-Cookie, or `no-store`, may not).
    fn revalidated(&self, stale: &Object, head: &ResponseHead, now: u64) -> (Object, bool) {
        let f = &self.fill;
        let mut headers = Headers::default();
        // A synthetic Last-Modified stays Pier's unless the origin now sends
        // one; it is left out while freshness is worked out (it must not
        // give heuristic freshness) and put back after.
        let synthetic_lm = stale.synthetic_lm && !head.headers.has_known(known::LAST_MODIFIED);
        for (k, v) in stale.headers.iter() {
            if synthetic_lm && k.eq_ignore_ascii_case(b"last-modified") {
                continue;
            }
            if head.headers.get(k).is_none() || !updatable(k) {
                headers.append(k, v);
            }
        }
        for (k, v) in head.headers.iter() {
            if keep_stored(k, &head.headers) && updatable(k) {
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
        );
        // A cookie set by the 304 answers this request: the stored
        // response's `public` does not make it everyone's (only the 304's
        // own, or the route's `set_cookie = "store"`, does).
        let own_cookie = head.headers.has_known(known::SET_COOKIE)
            && !f.policy.store_set_cookie
            && !CacheControl::parse(&head.headers).public;
        let storable = lifetime.is_ok() && !own_cookie;
        let lifetime = lifetime.unwrap_or(0);
        if synthetic_lm {
            headers.append(b"Last-Modified", stale.last_modified());
        }
        let obj = Object {
            status: stale.status,
            cc: policy::response_cc(&headers),
            headers,
            body: stale.body.clone(),
            mapped: stale.mapped.clone(),
            lifetime,
            request_time: f.request_time,
            response_time: now,
            date: now,
            age_header: 0,
            vary: stale.vary.clone(),
            synthetic_lm,
        };
        (obj, storable)
    }
}

impl<S: ResponseSource> ResponseSource for TeeSource<S> {
    async fn read_head(&mut self, head: &mut ResponseHead) -> Result<(), Error> {
        self.inner.read_head(head).await?;
        if head.status < 200 {
            return Ok(());
        }
        let f = &self.fill;
        if matches!(head.status, 500 | 502 | 503 | 504) {
            if let Some(stale) = f.stale.clone() {
                let age = stale.age(pier_cache::now());
                if policy::usable_on_error(stale.lifetime, age, &stale.cc, &f.req_cc, f.grace) {
                    // The origin failed: the stored response instead.
                    f.zone.stats.stale.add(1);
                    self.result = Some(CacheResult::Stale);
                    self.buf.pass();
                    let mut src = Stored::answer(
                        stale,
                        &f.req_headers,
                        false,
                        age,
                        "hit; detail=stale-on-error",
                    );
                    src.read_head(head).await?;
                    self.from_stale = Some(CacheSource::Stored(src));
                    return Ok(());
                }
            }
        }
        if head.status == 304 {
            if let Some(stale) = f.stale.clone() {
                // Revalidated: the stored object, its fields updated.
                f.zone.stats.revalidated.add(1);
                self.result = Some(CacheResult::Revalidated);
                let (obj, storable) = self.revalidated(&stale, head, pier_cache::now());
                if storable {
                    self.fill.zone.insert(self.fill.key.clone(), obj.clone());
                }
                // Else the 304 made it unstorable (a Set-Cookie, `private`,
                // `no-store`…): the merged response answers this client
                // only, and the stored object stays as it was.
                // Followers find the refreshed object when they look again.
                self.buf.pass();
                let mut src = Stored::answer(
                    Arc::new(obj),
                    &self.fill.req_headers,
                    false,
                    0,
                    "fwd=stale; fwd-status=304",
                );
                src.range = None;
                if src.status == 206 || src.status == 416 {
                    src.status = src.obj.status;
                    src.head_only = false;
                }
                src.read_head(head).await?;
                self.from_stale = Some(CacheSource::Stored(src));
                return Ok(());
            }
        }
        // The rest waits for `origin_head`: what is stored is the head as
        // `upstream_response_filter` and the cache-store step leave it.
        Ok(())
    }

    /// Whether the response may be stored (RFC 9111 with the route's
    /// policy), decided on the head the origin's steps left, which is the
    /// head that is stored: never one `response_filter` edited for this
    /// client.
    fn origin_head(&mut self, head: &mut ResponseHead, req: &Headers) {
        if self.from_stale.is_some() || head.status < 200 {
            return;
        }
        // Which requests this response answers: followers check theirs
        // against it, and the stored object keeps it.
        self.vary = pier_cache::vary_of(&head.headers, req);
        // The response's time (RFC 9111 §4.2.3 `response_time`): taken once,
        // here, and kept for `store` when the body ends. The worker read the
        // clock when it woke for the response: no read of its own.
        let now = pier_cache::recent();
        self.fill.response_time = now;
        let f = &self.fill;
        self.cc = policy::response_cc(&head.headers);
        match policy::storable_with(
            true,
            &f.req_cc,
            f.authorization,
            head.status,
            &head.headers,
            &self.cc,
            now,
            &f.policy,
        ) {
            Ok(lifetime) => {
                self.lifetime = lifetime;
                self.length = head
                    .headers
                    .get_known(known::CONTENT_LENGTH)
                    .and_then(|v| pier_http::head::parse_u64(v.trim_ascii()));
                if self.length.is_some_and(|n| n > f.zone.max_object as u64) {
                    // Too big to store, known now: followers need not wait.
                    head.headers.append_known(
                        known::CACHE_STATUS,
                        b"Cache-Status",
                        b"pier; fwd=miss",
                    );
                    return;
                }
                self.head = Some((head.status, stored_fields(&head.headers)));
                self.body = Some(BytesMut::new());
                head.headers.append_known(
                    known::CACHE_STATUS,
                    b"Cache-Status",
                    b"pier; fwd=miss; stored",
                );
            }
            Err(why) => {
                // A partial answer says nothing about the full object.
                if let (Some(g), false) = (&f.guard, why == policy::NotStored::Partial) {
                    g.uncacheable(now, f.hit_for_miss);
                }
                head.headers
                    .append_known(known::CACHE_STATUS, b"Cache-Status", b"pier; fwd=miss");
                // Kept in case a phase stores it after all (`cache_override`).
                self.spare = Some((head.status, stored_fields(&head.headers)));
            }
        }
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
        if !self.published {
            self.published = true;
            match (&mut self.head, &self.body) {
                // The fields move to the followers; `finish` gives them back.
                (Some((status, h)), Some(_)) => self.buf.publish_head(FillHead {
                    status: *status,
                    headers: std::mem::take(h),
                    length: self.length,
                    vary: std::mem::take(&mut self.vary),
                }),
                _ => self.buf.pass(),
            }
        }
        match self.inner.read_body().await? {
            Some((data, last)) => {
                if self.body.is_some() && !self.buf.push(data) {
                    // Too big (or fills hold too much): streams through,
                    // not stored.
                    self.body = None;
                    self.head = None;
                }
                Ok(Some((data, last)))
            }
            None => {
                self.done = true;
                if let (Some((status, _)), Some(_)) = (self.head.take(), self.body.take()) {
                    let (body, head) = self.buf.finish();
                    // Published at the first body read, so here unless the
                    // fill was cut (then nothing is stored).
                    if let Some(head) = head {
                        let cc = std::mem::take(&mut self.cc);
                        store(
                            status,
                            head.headers,
                            head.vary,
                            cc,
                            body,
                            &mut self.fill,
                            self.lifetime,
                        );
                    }
                } else {
                    self.buf.close();
                }
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

    /// A phase's verdict (Lua `pier.cache` in header_filter): don't store,
    /// store after all (with its TTL, else the route's for the status), or
    /// another TTL.
    fn cache_result(&self) -> Option<CacheResult> {
        self.result
    }

    fn cache_override(&mut self, head: &mut ResponseHead, ctl: &crate::cache_key::CacheCtl) {
        if self.from_stale.is_some() || (ctl.cacheable.is_none() && ctl.ttl.is_none()) {
            return;
        }
        let now = pier_cache::now();
        let status = head.status;
        let ttl = ctl.ttl.or_else(|| {
            let t = &self.fill.policy.default_ttl;
            t.iter().find(|(s, _)| *s == status).map(|(_, d)| *d)
        });
        let store = match ctl.cacheable {
            Some(false) => false,
            Some(true) => ttl.is_some_and(|t| t > 0) && status >= 200 && status != 206,
            None => self.head.is_some() && ttl != Some(0),
        };
        if !store {
            if self.head.take().is_some() {
                self.body = None;
                if let Some(g) = &self.fill.guard {
                    g.uncacheable(now, self.fill.hit_for_miss);
                }
            }
        } else if self.head.is_none() {
            // The origin's head (as its steps left it), not this client's.
            match self.spare.take() {
                Some(h) => {
                    self.head = Some(h);
                    self.body = Some(BytesMut::new());
                }
                None => return,
            }
        }
        if let (true, Some(t)) = (store, ttl) {
            self.lifetime = t;
        }
        let cs: &[u8] = if store {
            b"pier; fwd=miss; stored"
        } else {
            b"pier; fwd=miss"
        };
        let others: Vec<Vec<u8>> = head
            .headers
            .get_all_known(known::CACHE_STATUS)
            .filter(|v| !v.starts_with(b"pier;"))
            .map(|v| v.to_vec())
            .collect();
        head.headers.remove_known(known::CACHE_STATUS);
        for v in &others {
            head.headers.append(b"Cache-Status", v);
        }
        head.headers.append(b"Cache-Status", cs);
    }
}

/// A stored response for a request whose origin failed (`kind`: a connect
/// error, a timeout, a closed connection, no healthy server), when
/// `stale-if-error` or the route's `grace` allows it.
pub async fn stale_on_error(
    state: &State,
    sess: &mut Session,
    kind: pier_error::Kind,
) -> Option<CacheSource> {
    use pier_error::Kind as K;
    if !matches!(
        kind,
        K::UpstreamConnect
            | K::UpstreamTls
            | K::UpstreamProtocol
            | K::UpstreamClosed
            | K::UpstreamTimeout
            | K::NoHealthyUpstream
            | K::UpstreamLimited
    ) {
        return None;
    }
    let route = sess.route?;
    let rc = state.cfg.routes[route].cache.as_ref()?;
    let method = sess.req.method_kind();
    if !matches!(method, Method::Get | Method::Head) {
        return None;
    }
    let zone = &state.cache_zones[rc.zone];
    let key = crate::cache_key::key(state, sess, route, None);
    let obj = zone.get(&key, &sess.req.headers).await?;
    let age = obj.age(pier_cache::now());
    let cc = req_cc(sess);
    if !policy::usable_on_error(obj.lifetime, age, &obj.cc, &cc, rc.grace.as_secs()) {
        return None;
    }
    zone.stats.stale.add(1);
    sess.cache = CacheResult::Stale;
    let sess = &*sess;
    Some(CacheSource::new(
        obj,
        sess,
        age,
        "hit; detail=stale-on-error",
    ))
}

/// After the response head of a request on a cached route (the driver's
/// cache-store step): an unsafe method answered with success (2xx/3xx)
/// drops what is stored for its URL and for the same-origin URLs in
/// `Location` and `Content-Location` (RFC 9111 §4.4); `Surrogate-Control`
/// and `Pier-Cache-Control`, addressed to Pier, are not passed on (the
/// stored object keeps the latter: it is its policy).
pub fn after_response(state: &State, sess: &Session, resp: &mut ResponseHead) {
    resp.headers.remove_known(known::SURROGATE_CONTROL);
    resp.headers.remove_known(known::PIER_CACHE_CONTROL);
    let method = sess.req.method_kind();
    if matches!(method, Method::Get | Method::Head | Method::Options)
        || !(200..400).contains(&resp.status)
    {
        return;
    }
    let Some(rc) = sess.route.and_then(|r| state.cfg.routes[r].cache.as_ref()) else {
        return;
    };
    let zone = &state.cache_zones[rc.zone];
    let scheme = sess.scheme();
    let host = sess.req.host().unwrap_or(b"");
    // Canonical: origin-form, its authority the Host (pier_http::canon).
    let target = sess.req.uri();
    let spec = rc.key.as_ref();
    let drop_url = |t: &[u8]| {
        let url = crate::cache_key::url_key(scheme, host, t, spec);
        if spec.is_some_and(|s| !s.headers.is_empty() || !s.cookies.is_empty()) {
            // Keys with header or cookie parts start with the URL's key
            // and a `\n` (cache_key.rs): every one of them goes.
            zone.purge_where(|k| {
                k.starts_with(&url) && (k.len() == url.len() || k[url.len()] == b'\n')
            });
        } else {
            zone.invalidate(&url);
        }
    };
    drop_url(target);
    for name in [&b"location"[..], b"content-location"] {
        if let Some(t) = resp
            .headers
            .get(name)
            .and_then(|v| same_origin(scheme, host, target, v))
        {
            drop_url(&t);
        }
    }
}

/// A `Location`-like reference resolved against the request's URL: its
/// target when it is on the same origin (scheme and host), else None.
fn same_origin(scheme: &str, host: &[u8], base: &[u8], v: &[u8]) -> Option<Vec<u8>> {
    let v = v.trim_ascii();
    if v.is_empty() {
        return None;
    }
    if let Some(rest) = v
        .strip_prefix(scheme.as_bytes())
        .and_then(|r| r.strip_prefix(b"://"))
    {
        let end = rest.iter().position(|&c| c == b'/').unwrap_or(rest.len());
        let (auth, path) = rest.split_at(end);
        let default = if scheme == "https" {
            &b":443"[..]
        } else {
            b":80"
        };
        let norm = |h: &[u8]| h.strip_suffix(default).unwrap_or(h).to_ascii_lowercase();
        if norm(auth) != norm(host) {
            return None;
        }
        return Some(if path.is_empty() {
            b"/".to_vec()
        } else {
            path.to_vec()
        });
    }
    if v.starts_with(b"//") || v.iter().take_while(|&&c| c != b'/').any(|&c| c == b':') {
        // Another authority, or another scheme.
        return None;
    }
    if v[0] == b'/' {
        return Some(v.to_vec());
    }
    // Relative to the request path's directory.
    let path = base.split(|&c| c == b'?').next().unwrap_or(b"/");
    let dir = &path[..path.iter().rposition(|&c| c == b'/').map_or(0, |i| i + 1)];
    let mut t = if dir.is_empty() {
        b"/".to_vec()
    } else {
        dir.to_vec()
    };
    t.extend_from_slice(v);
    Some(t)
}

/// The downstream of a background refresh: no request body, and a
/// response that goes nowhere (the cache step has kept it).
#[derive(Default)]
pub struct NullDownstream {
    sink: NullSink,
}

/// Takes a response and drops it.
#[derive(Default)]
pub struct NullSink;

/// An empty request body.
pub struct NoBody;

impl pier_session::RequestSource for NoBody {
    async fn read_body(&mut self) -> Result<Option<&[u8]>, Error> {
        Ok(None)
    }
    fn trailers(&self) -> Option<&Headers> {
        None
    }
}

impl pier_session::ResponseSink for &mut NullSink {
    async fn write_interim(&mut self, _: &ResponseHead) -> Result<(), Error> {
        Ok(())
    }
    async fn write_head(&mut self, _: &ResponseHead, _: BodySize) -> Result<(), Error> {
        Ok(())
    }
    async fn write_body(&mut self, _: &[u8]) -> Result<(), Error> {
        Ok(())
    }
    async fn finish(&mut self, _: Option<&Headers>) -> Result<(), Error> {
        Ok(())
    }
    fn keep_alive(&self) -> bool {
        false
    }
    fn bytes_sent(&self) -> u64 {
        0
    }
}

impl pier_session::Downstream for NullDownstream {
    type Source<'a> = NoBody;
    type Sink<'a> = &'a mut NullSink;

    async fn vet_body(
        &mut self,
        _: pier_http::BodyLen,
        _: bool,
        _: std::time::Duration,
    ) -> Result<(), pier_error::Kind> {
        Ok(())
    }

    fn open(&mut self, _: &pier_session::DownstreamOpts) -> (NoBody, &mut NullSink) {
        (NoBody, &mut self.sink)
    }

    async fn tunnel<R: tokio::io::AsyncRead + Unpin, W: tokio::io::AsyncWrite + Unpin>(
        &mut self,
        _: &ResponseHead,
        _: &[u8],
        _: &mut R,
        _: &mut W,
        _: std::time::Duration,
    ) -> Result<u64, Error> {
        Err(Error::new(pier_error::Kind::UpstreamProtocol))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_origin_references() {
        let s = |v: &str| same_origin("http", b"a.example", b"/x/y?q", v.as_bytes());
        assert_eq!(s("/p"), Some(b"/p".to_vec()));
        assert_eq!(s("z"), Some(b"/x/z".to_vec()));
        assert_eq!(s("http://A.example:80/q"), Some(b"/q".to_vec()));
        assert_eq!(s("http://b.example/q"), None);
        assert_eq!(s("https://a.example/q"), None);
        assert_eq!(s("//b.example/q"), None);
    }
}
