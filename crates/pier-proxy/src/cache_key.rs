//! The cache key a route asks for (`[route.cache.key]`), the cache
//! controls a phase implementation sets for one request ([`CacheCtl`], Lua's
//! `pier.cache`), and the tag fields kept from clients.
//!
//! A key is `scheme://host/path[?query]`, then, for each header or cookie
//! the route adds, a `\n`-separated part. No URL holds a raw `\n`, so every
//! key made from a URL starts with that URL's key followed by `\n` or
//! nothing: a purge by URL drops them all.

use crate::session::Session;
use crate::state::State;
use pier_config::{CacheKey, QueryKey};
use pier_http::{known, Headers};

/// Moved to pier-cache (the session interfaces carry it); named here still.
pub use pier_cache::CacheCtl;

/// Longest key a hook may set.
pub const MAX_KEY: usize = 4096;

/// The cache key of this request on `route` (a hook's key wins).
pub fn key(state: &State, sess: &Session, route: usize, ctl: Option<&CacheCtl>) -> Vec<u8> {
    let mut k = Vec::new();
    key_into(&mut k, state, sess, route, ctl);
    k
}

/// `key`, written into `k` (cleared first; a buffer reused from request
/// to request, so that a lookup allocates no key).
pub fn key_into(
    k: &mut Vec<u8>,
    state: &State,
    sess: &Session,
    route: usize,
    ctl: Option<&CacheCtl>,
) {
    k.clear();
    if let Some(hook) = ctl.and_then(|c| c.key.as_ref()) {
        k.extend_from_slice(hook);
        return;
    }
    let host = sess.req.host().unwrap_or(b"");
    // Canonical: origin-form, its authority the Host (pier_http::canon).
    let target = sess.req.uri();
    let spec = state.cfg.routes[route]
        .cache
        .as_ref()
        .and_then(|c| c.key.as_ref());
    match spec {
        None => pier_cache::key_into(k, sess.scheme(), host, target),
        Some(spec) => {
            url_key_into(k, sess.scheme(), host, target, Some(spec));
            extras(k, spec, &sess.req.headers);
        }
    }
}

/// The part of a key made from the URL: the default key, with the query
/// kept, sorted or dropped and its parameters filtered as `spec` says.
pub fn url_key(scheme: &str, host: &[u8], target: &[u8], spec: Option<&CacheKey>) -> Vec<u8> {
    let mut k = Vec::new();
    url_key_into(&mut k, scheme, host, target, spec);
    k
}

/// `url_key`, appended to `k`.
fn url_key_into(
    k: &mut Vec<u8>,
    scheme: &str,
    host: &[u8],
    target: &[u8],
    spec: Option<&CacheKey>,
) {
    let Some(spec) = spec else {
        return pier_cache::key_into(k, scheme, host, target);
    };
    let (path, query) = match target.iter().position(|&c| c == b'?') {
        Some(i) => (&target[..i], &target[i + 1..]),
        None => (target, &b""[..]),
    };
    let mut t = Vec::with_capacity(target.len());
    t.extend_from_slice(path);
    if spec.query != QueryKey::Drop && !query.is_empty() {
        let keep = |p: &&[u8]| {
            let name = p.split(|&c| c == b'=').next().unwrap_or(b"");
            !p.is_empty()
                && (spec.query_include.is_empty()
                    || spec.query_include.iter().any(|n| n.as_bytes() == name))
                && !spec.query_exclude.iter().any(|n| n.as_bytes() == name)
        };
        let mut params: Vec<&[u8]> = query.split(|&c| c == b'&').filter(keep).collect();
        if spec.query == QueryKey::Sort {
            params.sort_unstable();
        }
        for (i, p) in params.iter().enumerate() {
            t.push(if i == 0 { b'?' } else { b'&' });
            t.extend_from_slice(p);
        }
    }
    pier_cache::key_into(k, scheme, host, &t)
}

/// The header and cookie parts of a key.
fn extras(k: &mut Vec<u8>, spec: &CacheKey, req: &Headers) {
    for h in &spec.headers {
        k.push(b'\n');
        k.extend_from_slice(h.as_bytes());
        match req.get(h.as_bytes()) {
            Some(v) => {
                k.push(b':');
                k.extend_from_slice(v.trim_ascii());
            }
            // Absent differs from empty.
            None => k.push(b'!'),
        }
    }
    for c in &spec.cookies {
        k.extend_from_slice(b"\ncookie:");
        k.extend_from_slice(c.as_bytes());
        match cookie(req, c.as_bytes()) {
            Some(v) => {
                k.push(b'=');
                k.extend_from_slice(v);
            }
            None => k.push(b'!'),
        }
    }
}

/// The value of cookie `name` in the request's Cookie fields.
fn cookie<'a>(req: &'a Headers, name: &[u8]) -> Option<&'a [u8]> {
    req.get_all(b"cookie").find_map(|v| {
        v.split(|&c| c == b';').find_map(|kv| {
            let kv = kv.trim_ascii();
            let i = kv.iter().position(|&c| c == b'=')?;
            (kv[..i].trim_ascii() == name).then(|| kv[i + 1..].trim_ascii())
        })
    })
}

/// Keys stored from `url` (`scheme://host/target`) on this config: the
/// URL's key as the route it matches makes it, and every key that extends
/// it with header or cookie parts. Err: not an absolute http(s) URL.
pub fn url_keys(state: &State, url: &str) -> Result<Vec<u8>, &'static str> {
    let (scheme, rest) = url
        .split_once("://")
        .ok_or("url: expected scheme://host/path")?;
    let scheme = match scheme.to_ascii_lowercase().as_str() {
        "http" => "http",
        "https" => "https",
        _ => return Err("url: the scheme must be http or https"),
    };
    let (host, target) = match rest.find('/') {
        Some(i) => rest.split_at(i),
        None => (rest, "/"),
    };
    if host.is_empty() {
        return Err("url: no host");
    }
    let path = target.split('?').next().unwrap_or("/");
    let spec = state
        .match_route(Some(host.as_bytes()), path.as_bytes())
        .and_then(|r| state.cfg.routes[r].cache.as_ref())
        .and_then(|c| c.key.as_ref());
    Ok(url_key(scheme, host.as_bytes(), target.as_bytes(), spec))
}

/// Drop what is stored for a URL (`target` on `scheme://host`) on a route
/// with key options `spec`: its key, and the keys extending it with header
/// or cookie parts (a scan, only when the route's key has such parts).
pub fn invalidate_url(
    zone: &pier_cache::Zone,
    spec: Option<&CacheKey>,
    scheme: &str,
    host: &[u8],
    target: &[u8],
) -> usize {
    let mut k = url_key(scheme, host, target, spec);
    let mut n = usize::from(zone.invalidate(&k));
    if spec.is_some_and(|s| !s.headers.is_empty() || !s.cookies.is_empty()) {
        k.push(b'\n');
        n += zone.purge_prefix(&k);
    }
    n
}

/// Drop the tag fields from a client's response on routes that keep them
/// to themselves (`[route.cache] strip_tags`, the default).
pub fn strip_tags(state: &State, sess: &Session, resp: &mut pier_http::ResponseHead) {
    let Some(r) = sess.route else { return };
    if state.cfg.routes[r]
        .cache
        .as_ref()
        .is_some_and(|c| c.strip_tags)
    {
        for k in [known::SURROGATE_KEY, known::CACHE_TAG] {
            resp.headers.remove_known(k);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn query_options_and_extras() {
        let mut spec = CacheKey {
            query: QueryKey::Sort,
            ..Default::default()
        };
        let k = |spec: &CacheKey, t: &str| {
            String::from_utf8(url_key("http", b"Ex.com:80", t.as_bytes(), Some(spec))).unwrap()
        };
        assert_eq!(k(&spec, "/a?b=2&a=1&&c"), "http://ex.com/a?a=1&b=2&c");
        spec.query_exclude = vec!["utm_source".into()];
        assert_eq!(k(&spec, "/a?utm_source=x&z=1"), "http://ex.com/a?z=1");
        assert_eq!(k(&spec, "/a?utm_source=x"), "http://ex.com/a");
        spec.query_include = vec!["id".into()];
        assert_eq!(k(&spec, "/a?x=1&id=7&idx=2"), "http://ex.com/a?id=7");
        spec.query = QueryKey::Drop;
        assert_eq!(k(&spec, "/a?id=7"), "http://ex.com/a");
        spec.query = QueryKey::Keep;
        spec.query_include.clear();
        spec.query_exclude.clear();
        assert_eq!(k(&spec, "/a?b=2&a=1"), "http://ex.com/a?b=2&a=1");

        spec.headers = vec!["accept-language".into()];
        spec.cookies = vec!["v".into()];
        let mut h = Headers::default();
        h.append(b"Accept-Language", b" fr ");
        h.append(b"Cookie", b"a=1; v=blue");
        let mut key = url_key("http", b"ex.com", b"/", Some(&spec));
        extras(&mut key, &spec, &h);
        assert_eq!(
            key,
            b"http://ex.com/\naccept-language:fr\ncookie:v=blue".to_vec()
        );
        let mut key = url_key("http", b"ex.com", b"/", Some(&spec));
        extras(&mut key, &spec, &Headers::default());
        assert_eq!(key, b"http://ex.com/\naccept-language!\ncookie:v!".to_vec());
    }
}
