//! Pier's HTTP cache (first part of issue 11): a memory tier per zone,
//! bounded in bytes (LRU eviction), RFC 9111 storability and freshness
//! (`policy`), Vary secondary keys, and fill locks so that concurrent misses
//! for one key reach the origin once (the others wait for the fill, up to a
//! timeout, then are served from it; an uncacheable answer is remembered for
//! a while — Varnish's hit-for-miss — so later requests do not queue).
//!
//! Written here rather than taken from a crate: the storage is small, and
//! what matters — admission by HTTP semantics, fill locks, Vary — is
//! Pier's own. The LRU list is the `lru` crate's.

pub mod policy;

use bytes::Bytes;
use parking_lot::Mutex;
use pier_http::Headers;
use policy::CacheControl;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;

/// A stored response.
#[derive(Debug, Clone)]
pub struct Object {
    pub status: u16,
    /// As the origin sent them, minus hop-by-hop fields.
    pub headers: Headers,
    pub body: Bytes,
    /// Freshness lifetime, seconds.
    pub lifetime: u64,
    /// When the request went and the response came (Unix seconds).
    pub request_time: u64,
    pub response_time: u64,
    /// The response's Date (or `response_time`) and Age header.
    pub date: u64,
    pub age_header: u64,
    pub cc: CacheControl,
    /// The request's values of the fields named by Vary (lower-cased names).
    pub vary: Vec<(Vec<u8>, Option<Vec<u8>>)>,
    pub etag: Option<Vec<u8>>,
    /// The origin's Last-Modified, or a synthetic one (the response time)
    /// so that clients' revalidations can still become 304s.
    pub last_modified: Vec<u8>,
}

impl Object {
    /// Its age now.
    pub fn age(&self, now: u64) -> u64 {
        policy::current_age(
            self.age_header,
            self.date,
            self.request_time,
            self.response_time,
            now,
        )
    }
    fn size(&self) -> usize {
        self.body.len() + self.headers.capacity_bytes() + 256
    }
    /// Does this variant answer a request with these headers?
    pub fn matches(&self, req: &Headers) -> bool {
        self.vary
            .iter()
            .all(|(name, want)| normalize(name, req.get(name)) == *want)
    }
}

/// A request field's value as Vary compares it (Accept-Encoding tokens
/// sorted, case and spaces ignored).
fn normalize(name: &[u8], v: Option<&[u8]>) -> Option<Vec<u8>> {
    let v = v?;
    if name == b"accept-encoding" {
        let mut toks: Vec<Vec<u8>> = v
            .split(|&c| c == b',')
            .map(|t| t.trim_ascii().to_ascii_lowercase())
            .filter(|t| !t.is_empty())
            .collect();
        toks.sort();
        return Some(toks.join(&b","[..]));
    }
    Some(v.trim_ascii().to_vec())
}

/// The request values for a response's Vary fields.
pub fn vary_of(resp: &Headers, req: &Headers) -> Vec<(Vec<u8>, Option<Vec<u8>>)> {
    let mut out = Vec::new();
    for v in resp.get_all(b"vary") {
        for name in v.split(|&c| c == b',') {
            let name = name.trim_ascii().to_ascii_lowercase();
            if !name.is_empty() && !out.iter().any(|(n, _)| *n == name) {
                let val = normalize(&name, req.get(&name));
                out.push((name, val));
            }
        }
    }
    out
}

/// Lookups by result, and storage counters.
#[derive(Debug, Default)]
pub struct Stats {
    pub hit: AtomicU64,
    pub miss: AtomicU64,
    pub stale: AtomicU64,
    pub revalidated: AtomicU64,
    pub coalesced: AtomicU64,
    pub pass: AtomicU64,
    pub stored: AtomicU64,
    pub evicted: AtomicU64,
    pub lock_timeouts: AtomicU64,
}

struct Inner {
    lru: lru::LruCache<Vec<u8>, Vec<Arc<Object>>>,
    bytes: usize,
}

/// Who fills a key: the first miss leads; the others wait on its watch.
pub enum Fill {
    Leader(FillGuard),
    /// Wait for the leader (`wait`), then look again.
    Follower(tokio::sync::watch::Receiver<()>),
    /// The key was found uncacheable lately: go to the origin, no lock.
    Pass,
}

/// Held by the request filling a key; dropping it wakes the waiters.
pub struct FillGuard {
    zone: Arc<Zone>,
    key: Vec<u8>,
    _tx: tokio::sync::watch::Sender<()>,
}

impl Drop for FillGuard {
    fn drop(&mut self) {
        self.zone.fills.lock().remove(&self.key);
    }
}

impl FillGuard {
    /// The response is not cacheable: remember it for `for_secs`, so the
    /// next requests for the key skip the lock.
    pub fn uncacheable(&self, now: u64, for_secs: u64) {
        let mut h = self.zone.hit_for_miss.lock();
        if h.len() >= 10_000 {
            h.retain(|_, until| *until > now);
            if h.len() >= 10_000 {
                h.clear();
            }
        }
        h.insert(self.key.clone(), now + for_secs);
    }
}

/// A cache zone (`[cache.NAME]`), shared by every worker.
pub struct Zone {
    pub name: String,
    max_bytes: usize,
    pub max_object: usize,
    inner: Mutex<Inner>,
    fills: Mutex<HashMap<Vec<u8>, tokio::sync::watch::Receiver<()>>>,
    hit_for_miss: Mutex<HashMap<Vec<u8>, u64>>,
    pub stats: Stats,
}

impl Zone {
    pub fn new(name: &str, max_bytes: usize, max_object: usize) -> Arc<Zone> {
        Arc::new(Zone {
            name: name.to_string(),
            max_bytes,
            max_object: max_object.min(max_bytes),
            inner: Mutex::new(Inner {
                lru: lru::LruCache::unbounded(),
                bytes: 0,
            }),
            fills: Mutex::new(HashMap::new()),
            hit_for_miss: Mutex::new(HashMap::new()),
            stats: Stats::default(),
        })
    }

    /// The stored variant of `key` that answers a request with `req` headers.
    pub fn lookup(&self, key: &[u8], req: &Headers) -> Option<Arc<Object>> {
        let mut g = self.inner.lock();
        let list = g.lru.get(key)?;
        list.iter().find(|o| o.matches(req)).cloned()
    }

    /// Store a response (replacing the variant with the same Vary values);
    /// least recently used keys go until the zone fits.
    pub fn insert(&self, key: Vec<u8>, obj: Object) {
        let size = obj.size();
        if size > self.max_object {
            return;
        }
        let obj = Arc::new(obj);
        let mut g = self.inner.lock();
        let mut freed = 0;
        let list = g.lru.get_or_insert_mut(key, Vec::new);
        list.retain(|o| {
            let same = o.vary == obj.vary;
            if same {
                freed += o.size();
            }
            !same
        });
        list.push(obj);
        g.bytes = g.bytes + size - freed;
        while g.bytes > self.max_bytes {
            match g.lru.pop_lru() {
                Some((_, list)) => {
                    g.bytes -= list.iter().map(|o| o.size()).sum::<usize>();
                    self.stats.evicted.fetch_add(1, Relaxed);
                }
                None => break,
            }
        }
        self.stats.stored.fetch_add(1, Relaxed);
    }

    /// Drop every variant of `key` (unsafe methods, purge).
    pub fn invalidate(&self, key: &[u8]) -> bool {
        let mut g = self.inner.lock();
        match g.lru.pop(key) {
            Some(list) => {
                g.bytes -= list.iter().map(|o| o.size()).sum::<usize>();
                true
            }
            None => false,
        }
    }

    /// Drop every key starting with `prefix`; how many went.
    pub fn purge_prefix(&self, prefix: &[u8]) -> usize {
        let mut g = self.inner.lock();
        let keys: Vec<Vec<u8>> = g
            .lru
            .iter()
            .filter(|(k, _)| k.starts_with(prefix))
            .map(|(k, _)| k.clone())
            .collect();
        for k in &keys {
            if let Some(list) = g.lru.pop(k) {
                g.bytes -= list.iter().map(|o| o.size()).sum::<usize>();
            }
        }
        keys.len()
    }

    /// Who fills `key` now.
    pub fn fill(self: &Arc<Self>, key: &[u8], now: u64) -> Fill {
        {
            let mut h = self.hit_for_miss.lock();
            match h.get(key) {
                Some(&until) if until > now => return Fill::Pass,
                Some(_) => {
                    h.remove(key);
                }
                None => {}
            }
        }
        let mut fills = self.fills.lock();
        if let Some(rx) = fills.get(key) {
            return Fill::Follower(rx.clone());
        }
        let (tx, rx) = tokio::sync::watch::channel(());
        fills.insert(key.to_vec(), rx);
        Fill::Leader(FillGuard {
            zone: self.clone(),
            key: key.to_vec(),
            _tx: tx,
        })
    }

    /// Objects and bytes stored now.
    pub fn usage(&self) -> (usize, usize) {
        let g = self.inner.lock();
        (g.lru.len(), g.bytes)
    }

    pub fn capacity(&self) -> usize {
        self.max_bytes
    }
}

/// Wait for a fill to end (its leader's guard dropped), at most `limit`.
/// `false`: timed out (the caller goes to the origin itself).
pub async fn wait_fill(mut rx: tokio::sync::watch::Receiver<()>, limit: Duration) -> bool {
    tokio::time::timeout(limit, async {
        // Ends when the sender (the leader's guard) is dropped.
        while rx.changed().await.is_ok() {}
    })
    .await
    .is_ok()
}

/// The default cache key: scheme, host (lower-cased, without a default
/// port) and target.
pub fn key(scheme: &str, host: &[u8], target: &[u8]) -> Vec<u8> {
    let mut k = Vec::with_capacity(scheme.len() + host.len() + target.len() + 3);
    k.extend_from_slice(scheme.as_bytes());
    k.extend_from_slice(b"://");
    let host = match scheme {
        "http" => host.strip_suffix(b":80").unwrap_or(host),
        "https" => host.strip_suffix(b":443").unwrap_or(host),
        _ => host,
    };
    k.extend(host.iter().map(|c| c.to_ascii_lowercase()));
    k.extend_from_slice(target);
    k
}

/// Unix seconds now.
pub fn now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn obj(body: usize, vary: Vec<(Vec<u8>, Option<Vec<u8>>)>) -> Object {
        Object {
            status: 200,
            headers: Headers::default(),
            body: Bytes::from(vec![b'x'; body]),
            lifetime: 60,
            request_time: 0,
            response_time: 0,
            date: 0,
            age_header: 0,
            cc: CacheControl::default(),
            vary,
            etag: None,
            last_modified: Vec::new(),
        }
    }

    #[test]
    fn lru_bounded_by_bytes_and_vary_variants() {
        let z = Zone::new("t", 10_000, 5_000);
        for i in 0..10 {
            z.insert(format!("k{i}").into_bytes(), obj(2_000, vec![]));
        }
        let (n, bytes) = z.usage();
        assert!(bytes <= 10_000 && n < 10, "{n} {bytes}");
        assert!(z.lookup(b"k9", &Headers::default()).is_some());
        assert!(z.lookup(b"k0", &Headers::default()).is_none());
        // Too big for one object: not stored.
        z.insert(b"big".to_vec(), obj(6_000, vec![]));
        assert!(z.lookup(b"big", &Headers::default()).is_none());
        // Two variants by Accept-Encoding, normalised.
        let mut gz = Headers::default();
        gz.append(b"accept-encoding", b"gzip, br");
        let mut id = Headers::default();
        id.append(b"accept-encoding", b"identity");
        let mut resp = Headers::default();
        resp.append(b"vary", b"Accept-Encoding");
        z.insert(b"v".to_vec(), obj(10, vary_of(&resp, &gz)));
        z.insert(b"v".to_vec(), obj(20, vary_of(&resp, &id)));
        let mut gz2 = Headers::default();
        gz2.append(b"accept-encoding", b"br,gzip");
        assert_eq!(z.lookup(b"v", &gz2).unwrap().body.len(), 10);
        assert_eq!(z.lookup(b"v", &id).unwrap().body.len(), 20);
        assert!(z.invalidate(b"v"));
        assert!(z.lookup(b"v", &id).is_none());
        assert_eq!(
            key("http", b"Example.COM:80", b"/a?b"),
            b"http://example.com/a?b".to_vec()
        );
    }

    #[tokio::test]
    async fn one_leader_per_key_and_hit_for_miss() {
        let z = Zone::new("t", 10_000, 5_000);
        let Fill::Leader(g) = z.fill(b"k", 100) else {
            panic!("first is the leader")
        };
        let Fill::Follower(rx) = z.fill(b"k", 100) else {
            panic!("second follows")
        };
        let waiter = tokio::spawn(wait_fill(rx, Duration::from_secs(10)));
        g.uncacheable(100, 30);
        drop(g);
        assert!(waiter.await.unwrap());
        assert!(matches!(z.fill(b"k", 110), Fill::Pass));
        assert!(matches!(z.fill(b"k", 200), Fill::Leader(_)));
    }
}
