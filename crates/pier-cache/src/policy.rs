//! RFC 9111 as a shared cache: what may be stored, for how long, how old a
//! stored response is, and whether a request may be served from it.
//! Times are integer Unix seconds.

use pier_http::{known, Headers};

/// Cache-Control directives Pier acts on (request or response).
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct CacheControl {
    pub no_store: bool,
    pub no_cache: bool,
    pub private: bool,
    pub public: bool,
    pub must_revalidate: bool,
    pub proxy_revalidate: bool,
    pub immutable: bool,
    pub only_if_cached: bool,
    pub max_age: Option<u64>,
    pub s_maxage: Option<u64>,
    pub min_fresh: Option<u64>,
    /// `max-stale` without a value: any staleness.
    pub max_stale: Option<u64>,
    pub stale_while_revalidate: Option<u64>,
    pub stale_if_error: Option<u64>,
    /// Read from an RFC 9213 targeted field (`targeted`): the response's
    /// Cache-Control, Expires and Surrogate-Control do not count.
    pub targeted: bool,
}

fn seconds(v: &str) -> Option<u64> {
    seconds_of(v.as_bytes())
}

/// A delta-seconds value (quotes tolerated), without a str round trip.
fn seconds_of(v: &[u8]) -> Option<u64> {
    let mut v = v.trim_ascii();
    while let [b'"', rest @ ..] = v {
        v = rest;
    }
    while let [rest @ .., b'"'] = v {
        v = rest;
    }
    if v.is_empty() || !v.iter().all(u8::is_ascii_digit) {
        return None;
    }
    // Overflow means "a very long time" (RFC 9111 §1.2.2).
    let n = v.iter().try_fold(0u64, |n, &d| {
        n.checked_mul(10)?.checked_add(u64::from(d - b'0'))
    });
    Some(n.unwrap_or(u64::MAX >> 2).min(1 << 40))
}

impl CacheControl {
    pub fn parse(h: &Headers) -> CacheControl {
        let mut c = CacheControl::default();
        for v in h.get_all_known(known::CACHE_CONTROL) {
            for d in v.split(|&b| b == b',') {
                let (k, val) = match d.iter().position(|&b| b == b'=') {
                    Some(i) => (d[..i].trim_ascii(), Some(&d[i + 1..])),
                    None => (d.trim_ascii(), None),
                };
                // Dispatched on the name's length first, then compared in
                // place: one or two case-insensitive compares a directive
                // (this runs on every lookup and every miss; a chain of
                // thirteen compares cost ~450 instructions a response).
                let is = |name: &[u8]| k.eq_ignore_ascii_case(name);
                match k.len() {
                    // A malformed max-age makes the response stale.
                    7 if is(b"max-age") => c.max_age = Some(val.and_then(seconds_of).unwrap_or(0)),
                    7 if is(b"private") => c.private = true,
                    6 if is(b"public") => c.public = true,
                    8 if is(b"no-store") => c.no_store = true,
                    // `no-cache="field"` only restricts fields: treat as no-cache.
                    8 if is(b"no-cache") => c.no_cache = true,
                    8 if is(b"s-maxage") => {
                        c.s_maxage = Some(val.and_then(seconds_of).unwrap_or(0))
                    }
                    15 if is(b"must-revalidate") => c.must_revalidate = true,
                    16 if is(b"proxy-revalidate") => c.proxy_revalidate = true,
                    9 if is(b"immutable") => c.immutable = true,
                    9 if is(b"min-fresh") => c.min_fresh = val.and_then(seconds_of),
                    9 if is(b"max-stale") => {
                        c.max_stale = Some(val.and_then(seconds_of).unwrap_or(u64::MAX >> 2))
                    }
                    14 if is(b"only-if-cached") => c.only_if_cached = true,
                    14 if is(b"stale-if-error") => c.stale_if_error = val.and_then(seconds_of),
                    22 if is(b"stale-while-revalidate") => {
                        c.stale_while_revalidate = val.and_then(seconds_of)
                    }
                    _ => {}
                }
            }
        }
        c
    }
}

/// The name Pier announces in `Surrogate-Capability` (sent to origins on
/// cached routes): `Surrogate-Control` directives targeted `;pier` are
/// Pier's too.
pub const SURROGATE_TARGET: &str = "pier";

/// `Surrogate-Control` directives for this cache: those without a
/// `;target`, or targeted at [`SURROGATE_TARGET`].
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Surrogate {
    pub no_store: bool,
    pub max_age: Option<u64>,
}

impl Surrogate {
    pub fn parse(h: &Headers) -> Surrogate {
        let mut s = Surrogate::default();
        for v in h.get_all_known(known::SURROGATE_CONTROL) {
            let Ok(v) = std::str::from_utf8(v) else {
                continue;
            };
            for d in v.split(',') {
                let d = match d.trim().split_once(';') {
                    None => d.trim(),
                    Some((d, target)) if target.trim().eq_ignore_ascii_case(SURROGATE_TARGET) => d,
                    Some(_) => continue,
                };
                match d.split_once('=') {
                    // No spaces around '=' (a malformed directive is ignored).
                    Some((k, val)) if k.eq_ignore_ascii_case("max-age") => {
                        if let Some(n) = (!val.starts_with(' ')).then(|| seconds(val)).flatten() {
                            s.max_age = Some(n);
                        }
                    }
                    None if d.eq_ignore_ascii_case("no-store") => s.no_store = true,
                    _ => {}
                }
            }
        }
        s
    }
}

/// The `Age` header's value as RFC 9111 §5.1 reads it: a list (one line
/// with commas, or several lines) counts by its first member; a value that
/// is not a non-negative integer (`abc`, `-1`, `1.5`) is ignored (0). A
/// parameter after the number (`7200;x=y`) is dropped and the number kept:
/// a response is then taken as older rather than younger. Past 2^40 it is
/// 2^40 (§1.2.2: "a very long time").
pub fn age_field(h: &Headers) -> u64 {
    let Some(v) = h.get_known(known::AGE) else {
        return 0;
    };
    let first = v.split(|&c| c == b',').next().unwrap_or_default();
    let n = first.split(|&c| c == b';').next().unwrap_or_default();
    let n = n.trim_ascii();
    if n.is_empty() || !n.iter().all(u8::is_ascii_digit) {
        return 0;
    }
    seconds_of(n).unwrap_or(0)
}

/// The RFC 9213 targeted fields Pier obeys, most specific first: its own
/// (`Pier-Cache-Control`, removed from what clients get) and the one for
/// every CDN (`CDN-Cache-Control`, passed on for caches further down).
/// Both have slots (`pier_http::known`): a response is checked for them
/// by index, not by a scan of its names.
pub const TARGETED: [known::Known; 2] = [known::PIER_CACHE_CONTROL, known::CDN_CACHE_CONTROL];

/// The caching policy of a response: the first valid, non-empty targeted
/// field (RFC 9213 §2.2), with `targeted` set (Cache-Control, Expires and
/// Surrogate-Control are then ignored), else its Cache-Control.
pub fn response_cc(h: &Headers) -> CacheControl {
    targeted(h).unwrap_or_else(|| CacheControl::parse(h))
}

/// The first of `TARGETED` that the response carries as a valid, non-empty
/// Structured Fields dictionary (RFC 8941; lines joined by commas), as
/// directives. One that does not parse is ignored, as if absent (RFC 9213
/// §2.1); within one that does, a directive whose value has the wrong type
/// is ignored.
pub fn targeted(h: &Headers) -> Option<CacheControl> {
    for k in TARGETED {
        if !h.has_known(k) {
            continue;
        }
        let mut joined = Vec::new();
        for v in h.get_all_known(k) {
            if !joined.is_empty() {
                joined.extend_from_slice(b", ");
            }
            joined.extend_from_slice(v);
        }
        let Some(dict) = sf::dictionary(&joined) else {
            continue;
        };
        if dict.is_empty() {
            continue;
        }
        let mut c = CacheControl {
            targeted: true,
            ..CacheControl::default()
        };
        for (k, item) in dict {
            let flag = !matches!(item, sf::Item::Bool(false) | sf::Item::Int(_));
            let secs = match item {
                sf::Item::Int(n) if n >= 0 => Some((n as u64).min(1 << 40)),
                _ => None,
            };
            match k {
                b"max-age" => c.max_age = secs.or(c.max_age),
                b"s-maxage" => c.s_maxage = secs.or(c.s_maxage),
                b"stale-while-revalidate" => {
                    c.stale_while_revalidate = secs.or(c.stale_while_revalidate)
                }
                b"stale-if-error" => c.stale_if_error = secs.or(c.stale_if_error),
                b"no-store" => c.no_store |= flag,
                b"no-cache" => c.no_cache |= flag,
                b"private" => c.private |= flag,
                b"public" => c.public |= flag,
                b"must-revalidate" => c.must_revalidate |= flag,
                b"proxy-revalidate" => c.proxy_revalidate |= flag,
                b"immutable" => c.immutable |= flag,
                _ => {}
            }
        }
        return Some(c);
    }
    None
}

/// Just enough of RFC 8941 to tell a valid dictionary from an invalid one
/// and to read its members' integers and booleans.
mod sf {
    pub enum Item {
        Int(i64),
        Bool(bool),
        /// A decimal, string, token, byte sequence or inner list.
        Other,
    }

    struct P<'a>(&'a [u8]);

    impl<'a> P<'a> {
        fn peek(&self) -> Option<u8> {
            self.0.first().copied()
        }
        fn bump(&mut self) {
            self.0 = &self.0[1.min(self.0.len())..];
        }
        fn eat(&mut self, c: u8) -> bool {
            let hit = self.peek() == Some(c);
            if hit {
                self.bump();
            }
            hit
        }
        fn skip(&mut self, ows: bool) {
            while let Some(c) = self.peek() {
                if c == b' ' || (ows && c == b'\t') {
                    self.bump();
                } else {
                    break;
                }
            }
        }
        fn take_while(&mut self, f: impl Fn(u8) -> bool) -> &'a [u8] {
            let n = self.0.iter().position(|&c| !f(c)).unwrap_or(self.0.len());
            let (a, b) = self.0.split_at(n);
            self.0 = b;
            a
        }
        fn key(&mut self) -> Option<&'a [u8]> {
            if !matches!(self.peek(), Some(b'a'..=b'z' | b'*')) {
                return None;
            }
            Some(
                self.take_while(
                    |c| matches!(c, b'a'..=b'z' | b'0'..=b'9' | b'_' | b'-' | b'.' | b'*'),
                ),
            )
        }
        fn params(&mut self) -> Option<()> {
            while self.eat(b';') {
                self.skip(false);
                self.key()?;
                if self.eat(b'=') {
                    self.bare()?;
                }
            }
            Some(())
        }
        fn bare(&mut self) -> Option<Item> {
            match self.peek()? {
                b'-' | b'0'..=b'9' => self.number(),
                b'"' => {
                    self.bump();
                    loop {
                        match self.peek()? {
                            b'\\' => {
                                self.bump();
                                if !matches!(self.peek()?, b'"' | b'\\') {
                                    return None;
                                }
                                self.bump();
                            }
                            b'"' => {
                                self.bump();
                                return Some(Item::Other);
                            }
                            0x20..=0x7e => self.bump(),
                            _ => return None,
                        }
                    }
                }
                b':' => {
                    self.bump();
                    self.take_while(|c| {
                        c.is_ascii_alphanumeric() || matches!(c, b'+' | b'/' | b'=')
                    });
                    self.eat(b':').then_some(Item::Other)
                }
                b'?' => {
                    self.bump();
                    let b = match self.peek()? {
                        b'0' => false,
                        b'1' => true,
                        _ => return None,
                    };
                    self.bump();
                    Some(Item::Bool(b))
                }
                c if c.is_ascii_alphabetic() || c == b'*' => {
                    self.take_while(|c| {
                        c.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~:/".contains(&c)
                    });
                    Some(Item::Other)
                }
                _ => None,
            }
        }
        fn number(&mut self) -> Option<Item> {
            let neg = self.eat(b'-');
            let int = self.take_while(|c| c.is_ascii_digit());
            if int.is_empty() {
                return None;
            }
            if self.eat(b'.') {
                let frac = self.take_while(|c| c.is_ascii_digit());
                return (int.len() <= 12 && (1..=3).contains(&frac.len())).then_some(Item::Other);
            }
            if int.len() > 15 {
                return None;
            }
            // At most 15 digits: fits.
            let n = int.iter().fold(0i64, |n, &d| n * 10 + i64::from(d - b'0'));
            Some(Item::Int(if neg { -n } else { n }))
        }
        fn member(&mut self) -> Option<Item> {
            if self.eat(b'(') {
                loop {
                    self.skip(false);
                    if self.eat(b')') {
                        break;
                    }
                    self.bare()?;
                    self.params()?;
                    if !matches!(self.peek()?, b' ' | b')') {
                        return None;
                    }
                }
                self.params()?;
                return Some(Item::Other);
            }
            let item = self.bare()?;
            self.params()?;
            Some(item)
        }
    }

    /// The members of a dictionary field value (a later duplicate key
    /// wins); None when it is not valid.
    pub fn dictionary(v: &[u8]) -> Option<Vec<(&[u8], Item)>> {
        let mut p = P(v);
        let mut out: Vec<(&[u8], Item)> = Vec::new();
        p.skip(false);
        while p.peek().is_some() {
            let k = p.key()?;
            let item = if p.eat(b'=') {
                p.member()?
            } else {
                p.params()?;
                Item::Bool(true)
            };
            out.retain(|(o, _)| *o != k);
            out.push((k, item));
            p.skip(true);
            if p.peek().is_none() {
                break;
            }
            if !p.eat(b',') {
                return None;
            }
            p.skip(true);
            // A trailing comma is an error.
            p.peek()?;
        }
        Some(out)
    }
}

/// An HTTP date as Unix seconds.
pub fn http_date(v: &[u8]) -> Option<u64> {
    // Every stored miss parses its Date, which changes once a second: the
    // last value parsed on this thread answers again without a parse.
    thread_local! {
        static LAST: std::cell::Cell<([u8; 32], u8, Option<u64>)> =
            const { std::cell::Cell::new(([0; 32], u8::MAX, None)) };
    }
    let (buf, len, t) = LAST.get();
    if usize::from(len) == v.len() && buf[..v.len()] == *v {
        return t;
    }
    let t = parse_http_date(v);
    if v.len() <= 32 {
        let mut b = [0; 32];
        b[..v.len()].copy_from_slice(v);
        LAST.set((b, v.len() as u8, t));
    }
    t
}

fn parse_http_date(v: &[u8]) -> Option<u64> {
    let s = std::str::from_utf8(v).ok()?.trim();
    let t = match httpdate::parse_http_date(s) {
        Ok(t) => t,
        // RFC 9111 §4.2: a cache matches day, month and zone names without
        // case (`THU`, `AUG`, `gmt`): recased, then parsed again.
        Err(_) if s.len() <= 64 && s.bytes().any(|c| c.is_ascii_alphabetic()) => {
            httpdate::parse_http_date(&recase(s)).ok()?
        }
        Err(_) => return None,
    };
    t.duration_since(std::time::UNIX_EPOCH)
        .ok()
        .map(|d| d.as_secs())
}

/// A date's names as HTTP-date spells them: `Thu`, `Aug`, `GMT`.
fn recase(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut word = String::new();
    let flush = |word: &mut String, out: &mut String| {
        if word.eq_ignore_ascii_case("gmt") {
            out.push_str("GMT");
        } else {
            for (i, c) in word.chars().enumerate() {
                out.push(if i == 0 {
                    c.to_ascii_uppercase()
                } else {
                    c.to_ascii_lowercase()
                });
            }
        }
        word.clear();
    };
    for c in s.chars() {
        if c.is_ascii_alphabetic() {
            word.push(c);
        } else {
            flush(&mut word, &mut out);
            out.push(c);
        }
    }
    flush(&mut word, &mut out);
    out
}

/// Statuses cacheable by default, heuristically (RFC 9110 §15.1).
pub fn heuristically_cacheable(status: u16) -> bool {
    matches!(
        status,
        200 | 203 | 204 | 206 | 300 | 301 | 308 | 404 | 405 | 410 | 414 | 501
    )
}

/// Statuses Pier understands well enough to store (RFC 9111 §3: never one
/// it does not). Beyond the heuristically cacheable ones, the errors whose
/// meaning does not depend on who asked are stored too, but only with
/// explicit freshness (as nginx does): an origin that says `max-age` on a
/// 503 asks to be shielded. 401, 407 and 429 are per client and never are.
fn understood(status: u16) -> bool {
    matches!(
        status,
        200 | 203
            | 204
            | 300
            | 301
            | 302
            | 303
            | 307
            | 308
            | 400
            | 403
            | 404
            | 405
            | 410
            | 414
            | 500
            | 501
            | 502
            | 503
            | 504
    )
}

/// Route settings that bear on storing.
#[derive(Debug, Clone, Default)]
pub struct StorePolicy {
    /// TTL by status for responses that carry no freshness of their own
    /// (built per miss: a few statuses inline, no allocation).
    pub default_ttl: smallvec::SmallVec<[(u16, u64); 4]>,
    /// Use `default_ttl` even when the origin says otherwise.
    pub override_origin: bool,
    /// Heuristic freshness: this fraction of the Last-Modified age...
    pub heuristic_fraction: f64,
    /// ...capped at this many seconds.
    pub heuristic_max: u64,
    /// Store responses that carry `Set-Cookie` (`set_cookie = "store"`).
    pub store_set_cookie: bool,
}

impl StorePolicy {
    fn ttl_for(&self, status: u16) -> Option<u64> {
        self.default_ttl
            .iter()
            .find(|(s, _)| *s == status)
            .map(|(_, t)| *t)
    }
}

/// Why a response was not stored (Cache-Status `fwd`/`detail`, metrics).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NotStored {
    Method,
    Status,
    NoStore,
    Private,
    Authorization,
    SetCookie,
    VaryStar,
    NoFreshness,
    Partial,
}

/// The freshness lifetime (seconds) a response may be stored with, or why
/// not. `req_*` describe the request it answers.
pub fn storable(
    req_method_get_or_head: bool,
    req_cc: &CacheControl,
    req_has_authorization: bool,
    status: u16,
    resp: &Headers,
    now: u64,
    policy: &StorePolicy,
) -> Result<u64, NotStored> {
    let cc = response_cc(resp);
    storable_with(
        req_method_get_or_head,
        req_cc,
        req_has_authorization,
        status,
        resp,
        &cc,
        now,
        policy,
    )
}

/// `storable` with the response's Cache-Control already parsed (`cc`, of
/// `resp`): the fill keeps it for the stored object instead of parsing twice.
#[allow(clippy::too_many_arguments)]
pub fn storable_with(
    req_method_get_or_head: bool,
    req_cc: &CacheControl,
    req_has_authorization: bool,
    status: u16,
    resp: &Headers,
    cc: &CacheControl,
    now: u64,
    policy: &StorePolicy,
) -> Result<u64, NotStored> {
    if !req_method_get_or_head {
        return Err(NotStored::Method);
    }
    // A 200 may carry Content-Range (it is then just a field); only a
    // 206 is partial content.
    if status == 206 {
        return Err(NotStored::Partial);
    }
    if !understood(status) {
        return Err(NotStored::Status);
    }
    if req_cc.no_store {
        return Err(NotStored::NoStore);
    }
    // Surrogate-Control (Edge Architecture 1.0, RFC 9213's forerunner) is
    // addressed to this cache and takes precedence over Cache-Control; a
    // targeted field (RFC 9213, `cc.targeted`) over both.
    let sc = if cc.targeted {
        Surrogate::default()
    } else {
        Surrogate::parse(resp)
    };
    if sc.no_store {
        return Err(NotStored::NoStore);
    }
    if cc.no_store && sc.max_age.is_none() {
        return Err(NotStored::NoStore);
    }
    if cc.private && sc.max_age.is_none() {
        return Err(NotStored::Private);
    }
    if resp
        .get_all_known(known::VARY)
        .any(|v| v.split(|&c| c == b',').any(|t| t.trim_ascii() == b"*"))
    {
        return Err(NotStored::VaryStar);
    }
    // A response to an authorized request: only when the origin says so
    // (RFC 9111 §3.5).
    if req_has_authorization && !(cc.public || cc.s_maxage.is_some() || cc.must_revalidate) {
        return Err(NotStored::Authorization);
    }
    // A Set-Cookie would hand one client's cookie to every client: stored
    // only when the origin says `public` or the route says so (RFC 9111
    // allows it; Varnish and nginx do not by default).
    if resp.has_known(known::SET_COOKIE) && !cc.public && !policy.store_set_cookie {
        return Err(NotStored::SetCookie);
    }
    if policy.override_origin {
        if let Some(t) = policy.ttl_for(status) {
            return Ok(t);
        }
    }
    if let Some(s) = sc.max_age {
        return Ok(s);
    }
    if let Some(s) = cc.s_maxage.or(cc.max_age) {
        return Ok(s);
    }
    if let Some(exp) = resp.get_known(known::EXPIRES).filter(|_| !cc.targeted) {
        // An invalid Expires (e.g. "0") means already expired.
        let date = resp
            .get_known(known::DATE)
            .and_then(http_date)
            .unwrap_or(now);
        return Ok(http_date(exp).map(|e| e.saturating_sub(date)).unwrap_or(0));
    }
    if let Some(t) = policy.ttl_for(status) {
        return Ok(t);
    }
    if cc.no_cache || cc.public || heuristically_cacheable(status) {
        if let Some(lm) = resp.get_known(known::LAST_MODIFIED).and_then(http_date) {
            let date = resp
                .get_known(known::DATE)
                .and_then(http_date)
                .unwrap_or(now);
            let age = date.saturating_sub(lm) as f64;
            return Ok(((age * policy.heuristic_fraction) as u64).min(policy.heuristic_max));
        }
        if cc.no_cache || cc.public {
            // Storable, but stale at once: every use revalidates.
            return Ok(0);
        }
    }
    Err(NotStored::NoFreshness)
}

/// A stored response's age now (RFC 9111 §4.2.3), in seconds.
pub fn current_age(
    age_header: u64,
    date: u64,
    request_time: u64,
    response_time: u64,
    now: u64,
) -> u64 {
    let apparent = response_time.saturating_sub(date);
    let response_delay = response_time.saturating_sub(request_time);
    let corrected = age_header.saturating_add(response_delay);
    apparent
        .max(corrected)
        .saturating_add(now.saturating_sub(response_time))
}

/// How a stored response may serve a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Use {
    Fresh,
    /// Stale, but within `stale-while-revalidate`: serve and refresh.
    StaleWhileRevalidate,
    /// Must go to the origin (revalidate when it has validators).
    Revalidate,
}

/// Whether a stored response (with `lifetime`, `age` and its own
/// directives) may answer a request with `req` directives.
pub fn usable(lifetime: u64, age: u64, stored: &CacheControl, req: &CacheControl) -> Use {
    if req.no_cache || stored.no_cache {
        return Use::Revalidate;
    }
    let mut fresh = lifetime;
    if let Some(m) = req.max_age {
        fresh = fresh.min(m);
    }
    let need = age.saturating_add(req.min_fresh.unwrap_or(0));
    if need < fresh {
        return Use::Fresh;
    }
    let stale_by = age.saturating_sub(lifetime);
    if !(stored.must_revalidate || stored.proxy_revalidate || stored.s_maxage.is_some()) {
        if let Some(ms) = req.max_stale {
            if stale_by <= ms && req.max_age.is_none() {
                return Use::Fresh;
            }
        }
        if let Some(swr) = stored.stale_while_revalidate {
            if stale_by <= swr {
                return Use::StaleWhileRevalidate;
            }
        }
    }
    Use::Revalidate
}

/// May a stored response answer when the origin failed (a connect error,
/// a timeout, a 5xx)? Within `stale-if-error` (the response's or the
/// request's, RFC 5861 §4) or the route's `grace`, unless the response
/// forbids serving it stale (`must-revalidate`, `proxy-revalidate`,
/// `s-maxage`, `no-cache`).
pub fn usable_on_error(
    lifetime: u64,
    age: u64,
    stored: &CacheControl,
    req: &CacheControl,
    grace: u64,
) -> bool {
    if stored.must_revalidate
        || stored.proxy_revalidate
        || stored.s_maxage.is_some()
        || stored.no_cache
    {
        return false;
    }
    let stale_by = age.saturating_sub(lifetime);
    let allowed = grace
        .max(stored.stale_if_error.unwrap_or(0))
        .max(req.stale_if_error.unwrap_or(0));
    stale_by <= allowed
}

/// Does `If-None-Match` (a list of entity tags, weak comparison) match?
pub fn etag_matches(if_none_match: &[u8], etag: &[u8]) -> bool {
    let strip = |t: &[u8]| -> Vec<u8> {
        let t = t.trim_ascii();
        t.strip_prefix(b"W/").unwrap_or(t).to_vec()
    };
    let want = strip(etag);
    if_none_match
        .split(|&c| c == b',')
        .any(|t| t.trim_ascii() == b"*" || strip(t) == want)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(pairs: &[(&str, &str)]) -> Headers {
        let mut x = Headers::default();
        for (k, v) in pairs {
            x.append(k.as_bytes(), v.as_bytes());
        }
        x
    }

    fn store(resp: &[(&str, &str)], status: u16) -> Result<u64, NotStored> {
        let p = StorePolicy {
            heuristic_fraction: 0.1,
            heuristic_max: 86_400,
            ..Default::default()
        };
        storable(
            true,
            &CacheControl::default(),
            false,
            status,
            &h(resp),
            1_000_000,
            &p,
        )
    }

    #[test]
    fn freshness_sources_in_order() {
        assert_eq!(store(&[("cache-control", "max-age=60")], 200), Ok(60));
        assert_eq!(
            store(&[("cache-control", "max-age=60, s-maxage=5")], 200),
            Ok(5)
        );
        assert_eq!(store(&[("cache-control", "max-age=abc")], 200), Ok(0));
        assert_eq!(
            store(
                &[
                    ("date", "Sun, 06 Nov 1994 08:49:37 GMT"),
                    ("expires", "Sun, 06 Nov 1994 08:50:37 GMT")
                ],
                200
            ),
            Ok(60)
        );
        assert_eq!(store(&[("expires", "0")], 200), Ok(0));
        assert_eq!(
            store(
                &[
                    ("date", "Sun, 06 Nov 1994 08:49:37 GMT"),
                    ("last-modified", "Sun, 06 Nov 1994 06:09:37 GMT")
                ],
                200
            ),
            Ok(960)
        );
        assert_eq!(store(&[], 200), Err(NotStored::NoFreshness));
        // Errors with explicit freshness only; unknown statuses never.
        assert_eq!(store(&[("cache-control", "max-age=60")], 500), Ok(60));
        assert_eq!(store(&[("cache-control", "max-age=60")], 503), Ok(60));
        assert_eq!(
            store(&[("last-modified", "Sun, 06 Nov 1994 06:09:37 GMT")], 503),
            Err(NotStored::NoFreshness)
        );
        for status in [299, 401, 429, 599] {
            assert_eq!(
                store(&[("cache-control", "max-age=60")], status),
                Err(NotStored::Status)
            );
        }
        assert_eq!(
            store(&[("cache-control", "no-store, max-age=60")], 200),
            Err(NotStored::NoStore)
        );
        assert_eq!(
            store(&[("cache-control", "private, max-age=60")], 200),
            Err(NotStored::Private)
        );
        assert_eq!(
            store(
                &[("cache-control", "max-age=60"), ("set-cookie", "a=1")],
                200
            ),
            Err(NotStored::SetCookie)
        );
        assert_eq!(
            store(
                &[
                    ("cache-control", "public, max-age=60"),
                    ("set-cookie", "a=1")
                ],
                200
            ),
            Ok(60)
        );
        // `set_cookie = "store"`: as RFC 9111 allows.
        let storing = StorePolicy {
            store_set_cookie: true,
            ..Default::default()
        };
        assert_eq!(
            storable(
                true,
                &CacheControl::default(),
                false,
                200,
                &h(&[("cache-control", "max-age=60"), ("set-cookie", "a=1")]),
                1_000_000,
                &storing,
            ),
            Ok(60)
        );
        assert_eq!(
            store(&[("cache-control", "max-age=60"), ("vary", "*")], 200),
            Err(NotStored::VaryStar)
        );
        assert_eq!(
            store(&[("cache-control", "max-age=60")], 206),
            Err(NotStored::Partial)
        );
    }

    #[test]
    fn surrogate_age_field_and_stale_on_error() {
        let sc = |v: &str| Surrogate::parse(&h(&[("surrogate-control", v)]));
        assert_eq!(sc("max-age=60").max_age, Some(60));
        assert_eq!(sc("MaX-aGe=60, foo").max_age, Some(60));
        assert_eq!(sc("max-age=60;pier").max_age, Some(60));
        assert_eq!(sc("max-age=60;other").max_age, None);
        assert_eq!(sc("max-age =60").max_age, None);
        assert_eq!(sc("max-age= 60").max_age, None);
        assert!(sc("no-store").no_store);
        // Surrogate-Control wins over Cache-Control both ways.
        assert_eq!(
            store(
                &[
                    ("cache-control", "no-store"),
                    ("surrogate-control", "max-age=30")
                ],
                200
            ),
            Ok(30)
        );
        assert_eq!(
            store(
                &[
                    ("cache-control", "max-age=30"),
                    ("surrogate-control", "no-store")
                ],
                200
            ),
            Err(NotStored::NoStore)
        );
        // A 200 with Content-Range is not partial.
        assert_eq!(
            store(
                &[("cache-control", "max-age=5"), ("content-range", "x")],
                200
            ),
            Ok(5)
        );
        let age = |vs: &[&str]| {
            let pairs: Vec<(&str, &str)> = vs.iter().map(|v| ("age", *v)).collect();
            age_field(&h(&pairs))
        };
        assert_eq!(age(&[]), 0);
        assert_eq!(age(&["30"]), 30);
        // RFC 9111 §5.1: the first member of a list; an invalid value is
        // ignored; a parameter is dropped, the number kept.
        for (v, want) in [
            (&["abc"][..], 0),
            (&["-7200"], 0),
            (&["7200.0"], 0),
            (&[""], 0),
            (&["7200, 0"], 7200),
            (&["0, 7200"], 0),
            (&["0,7200"], 0),
            (&["7200", "0"], 7200),
            (&["0", "7200"], 0),
            (&["3600", "3600"], 3600),
            (&["7200;foo=bar"], 7200),
            (&["99999999999999999999999"], 1 << 40),
        ] {
            assert_eq!(age(v), want, "{v:?}");
        }
        let none = CacheControl::default();
        let sie = CacheControl::parse(&h(&[("cache-control", "max-age=10, stale-if-error=60")]));
        assert!(usable_on_error(10, 60, &sie, &none, 0));
        assert!(!usable_on_error(10, 80, &sie, &none, 0));
        assert!(usable_on_error(10, 80, &none, &none, 70));
        assert!(!usable_on_error(10, 11, &none, &none, 0));
        let mr = CacheControl::parse(&h(&[("cache-control", "max-age=10, must-revalidate")]));
        assert!(!usable_on_error(10, 11, &mr, &none, 1000));
    }

    /// Every directive, in any case and with the spaces RFC 9110 lets
    /// through; names past the stack buffer, unknown ones and empty ones are
    /// ignored without harm.
    #[test]
    fn cache_control_directives_in_any_case() {
        let c = CacheControl::parse(&h(&[
            (
                "cache-control",
                "MAX-AGE=60, No-Store , no-CACHE=\"set-cookie\", Private",
            ),
            (
                "Cache-Control",
                "public,must-revalidate,PROXY-REVALIDATE,Immutable",
            ),
            (
                "cache-control",
                " only-if-cached ,s-maxage=\"7\",Min-Fresh=3, max-stale",
            ),
            (
                "cache-control",
                "Stale-While-Revalidate=9, stale-if-error=11, ,=",
            ),
            (
                "cache-control",
                "a-directive-name-longer-than-the-buffer=1, x-unknown",
            ),
        ]));
        let want = CacheControl {
            no_store: true,
            no_cache: true,
            private: true,
            public: true,
            must_revalidate: true,
            proxy_revalidate: true,
            immutable: true,
            only_if_cached: true,
            max_age: Some(60),
            s_maxage: Some(7),
            min_fresh: Some(3),
            max_stale: Some(u64::MAX >> 2),
            stale_while_revalidate: Some(9),
            stale_if_error: Some(11),
            targeted: false,
        };
        assert_eq!(c, want);
        // A malformed max-age makes the response stale; `max-age =5` is
        // the directive with spaces around its name.
        let bad = CacheControl::parse(&h(&[("cache-control", "max-age=soon")]));
        assert_eq!(bad.max_age, Some(0));
        let spaced = CacheControl::parse(&h(&[("cache-control", "max-age =5")]));
        assert_eq!(spaced.max_age, Some(5));
    }

    #[test]
    fn dates_without_case() {
        let want = http_date(b"Thu, 18 Aug 2050 02:01:18 GMT");
        assert!(want.is_some());
        for v in [
            "THU, 18 Aug 2050 02:01:18 GMT",
            "Thu, 18 AUG 2050 02:01:18 GMT",
            "Thu, 18 Aug 2050 02:01:18 gMT",
        ] {
            assert_eq!(http_date(v.as_bytes()), want, "{v}");
        }
        assert_eq!(http_date(b"Thu, 18 Aug 2050 02:01:18 AEST"), None);
        assert_eq!(http_date(b"0"), None);
    }

    #[test]
    fn age_and_use() {
        assert_eq!(current_age(0, 100, 100, 100, 130), 30);
        assert_eq!(current_age(50, 100, 100, 101, 101), 51);
        let none = CacheControl::default();
        assert_eq!(usable(60, 10, &none, &none), Use::Fresh);
        assert_eq!(usable(60, 60, &none, &none), Use::Revalidate);
        let swr = CacheControl::parse(&h(&[(
            "cache-control",
            "max-age=60, stale-while-revalidate=30",
        )]));
        assert_eq!(usable(60, 80, &swr, &none), Use::StaleWhileRevalidate);
        assert_eq!(usable(60, 100, &swr, &none), Use::Revalidate);
        let req = CacheControl::parse(&h(&[("cache-control", "max-age=5")]));
        assert_eq!(usable(60, 10, &none, &req), Use::Revalidate);
        let req = CacheControl::parse(&h(&[("cache-control", "no-cache")]));
        assert_eq!(usable(60, 1, &none, &req), Use::Revalidate);
        assert!(etag_matches(b"\"a\", W/\"b\"", b"\"b\""));
        assert!(etag_matches(b"*", b"\"x\""));
        assert!(!etag_matches(b"\"a\"", b"\"b\""));
    }

    /// RFC 9213: the first valid, non-empty targeted field is the policy
    /// (Cache-Control, Expires, Surrogate-Control ignored); one that is not
    /// a valid Structured Fields dictionary is ignored as if absent.
    #[test]
    fn targeted_cache_control() {
        let t = |pairs: &[(&str, &str)]| store(pairs, 200);
        assert_eq!(t(&[("cdn-cache-control", "max-age=3600")]), Ok(3600));
        assert_eq!(
            t(&[
                ("cache-control", "max-age=1"),
                ("cdn-cache-control", "max-age=3600")
            ]),
            Ok(3600)
        );
        assert_eq!(
            t(&[
                ("cache-control", "no-store"),
                ("cdn-cache-control", "max-age=60")
            ]),
            Ok(60)
        );
        assert_eq!(
            t(&[
                ("cache-control", "max-age=60"),
                ("cdn-cache-control", "no-store")
            ]),
            Err(NotStored::NoStore)
        );
        assert_eq!(
            t(&[
                ("cache-control", "max-age=60"),
                ("cdn-cache-control", "private")
            ]),
            Err(NotStored::Private)
        );
        assert_eq!(
            t(&[
                ("cdn-cache-control", "max-age=0"),
                ("expires", "Sun, 06 Nov 2094 08:49:37 GMT")
            ]),
            Ok(0)
        );
        assert_eq!(
            t(&[("cdn-cache-control", "max-age=99999999999")]),
            Ok(99_999_999_999)
        );
        assert_eq!(
            t(&[("cdn-cache-control", "foobar, max-age=3600")]),
            Ok(3600)
        );
        // Pier's own field first; then the CDN one.
        assert_eq!(
            t(&[
                ("cdn-cache-control", "max-age=10"),
                ("pier-cache-control", "max-age=20")
            ]),
            Ok(20)
        );
        // Not a valid dictionary: ignored, Cache-Control applies.
        for bad in [
            "max-age =100",
            "max-age= 100",
            "max-age=10000, &&&&&",
            "MaX-aGe=3600",
            "max-age=1,",
            "",
        ] {
            assert_eq!(
                t(&[("cache-control", "max-age=5"), ("cdn-cache-control", bad)]),
                Ok(5),
                "{bad}"
            );
        }
        // Valid, but max-age of the wrong type is ignored: no freshness.
        assert_eq!(
            t(&[
                ("cache-control", "no-store"),
                ("cdn-cache-control", "max-age=\"10000\"")
            ]),
            Err(NotStored::NoFreshness)
        );
        // Two lines are one dictionary; parameters, strings, inner lists parse.
        let cc = response_cc(&h(&[
            ("cdn-cache-control", "max-age=60;a=1, x=(1 \"s\" tok);b"),
            (
                "cdn-cache-control",
                "must-revalidate, stale-if-error=30, no-cache=?0",
            ),
        ]));
        assert!(cc.targeted && cc.must_revalidate && !cc.no_cache);
        assert_eq!((cc.max_age, cc.stale_if_error), (Some(60), Some(30)));
        assert!(!response_cc(&h(&[("cache-control", "max-age=5")])).targeted);
    }

    /// Hostile field values never panic the parsers.
    #[test]
    fn hostile_fields_never_panic() {
        let mut x: u64 = 0x2545_f491_4f6c_dd1d;
        let alphabet = b"max-age=0123456789,;\"\\()?:*-. \tABCxyz&=";
        for _ in 0..20_000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let n = (x % 40) as usize;
            let v: Vec<u8> = (0..n)
                .map(|i| alphabet[((x >> (i % 60)) as usize + i) % alphabet.len()])
                .collect();
            let v = String::from_utf8_lossy(&v).to_string();
            let _ = response_cc(&h(&[("cdn-cache-control", &v)]));
            let _ = age_field(&h(&[("age", &v)]));
            let _ = http_date(v.as_bytes());
            let _ = CacheControl::parse(&h(&[("cache-control", &v)]));
        }
    }
}
