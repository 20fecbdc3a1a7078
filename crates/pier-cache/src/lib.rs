//! Pier's HTTP cache: a memory tier per zone bounded in bytes (S3-FIFO,
//! `memory.rs`), an optional disk tier behind transient admission
//! (`disk.rs`: objects are written only once promoted by hits), RFC 9111 storability and freshness
//! (`policy`), Vary secondary keys, and fill locks so that concurrent misses
//! for one key reach the origin once (the others wait for the fill, up to a
//! timeout, then are served from it; an uncacheable answer is remembered for
//! a while — Varnish's hit-for-miss — so later requests do not queue).
//! Bodies of 64 KiB or more are kept in read-only mappings of their own
//! (`mapped.rs`), whose pages a hit splices to the socket without a copy.
//!
//! Written here rather than taken from a crate (`foyer` was weighed; see
//! docs/cache.md): admission by HTTP semantics and by hits, fill locks,
//! Vary variants and files that outlive a restart are Pier's own.

mod counter;
mod disk;
pub mod fill;
pub mod mapped;
mod memory;
pub mod policy;
pub mod recycle;
pub mod tags;
mod verdict;

use bytes::Bytes;
pub use counter::Counter;
use disk::Disk;
pub use disk::{DiskConfig, DiskStats};
pub use mapped::MappedBody;
pub use memory::DEFAULT_MAX_VARIANTS;
use memory::{Memory, Slot};
use parking_lot::Mutex;
use pier_http::Headers;
use policy::CacheControl;
use std::collections::{HashMap, HashSet};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Duration;
pub use verdict::{CacheCtl, CacheResult};

/// A stored response.
#[derive(Debug, Clone)]
pub struct Object {
    pub status: u16,
    /// As the origin sent them, minus hop-by-hop fields.
    pub headers: Headers,
    pub body: Bytes,
    /// A large body's own read-only mapping (`mapped`): `body` is then a
    /// view of it, and a plain HTTP/1 hit splices its pages to the socket.
    pub mapped: Option<Arc<MappedBody>>,
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
    /// Its Last-Modified field is Pier's (the origin sent no validator):
    /// it answers clients' revalidations, but gives no heuristic freshness.
    pub synthetic_lm: bool,
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
    /// Its ETag (read from its fields: no copy of its own per object).
    pub fn etag(&self) -> Option<&[u8]> {
        self.headers.get_known(pier_http::known::ETAG)
    }
    /// Its Last-Modified: the origin's, or the synthetic one the fill
    /// added to its fields when it stored the response (`synthetic_lm`), so that
    /// clients' revalidations can become 304s without an origin validator.
    pub fn last_modified(&self) -> &[u8] {
        self.headers
            .get_known(pier_http::known::LAST_MODIFIED)
            .unwrap_or_default()
    }
    /// Bytes it holds in memory (body, fields, the rest).
    pub fn size(&self) -> usize {
        self.body.len() + self.headers.capacity_bytes() + 256
    }
    /// Does this variant answer a request with these headers?
    pub fn matches(&self, req: &Headers) -> bool {
        vary_matches(&self.vary, req)
    }
}

/// The request's values of the fields a response's Vary names, as `vary_of`
/// records them (lower-cased names; `None`: the field was absent).
pub type VaryValues = Vec<(Vec<u8>, Option<Vec<u8>>)>;

/// Does a request with `req` headers select a response recorded with
/// `vary` (RFC 9111 §4.1)? Compared in place: this runs for every variant
/// a lookup scans, under the zone's lock, so it allocates nothing.
pub fn vary_matches(vary: &[(Vec<u8>, Option<Vec<u8>>)], req: &Headers) -> bool {
    vary.iter().all(|(name, want)| {
        let got = req.get(name);
        if name == b"accept-encoding" {
            return want.as_deref() == Some(encoding_bucket(got));
        }
        match (got, want) {
            (None, None) => true,
            (Some(g), Some(w)) => list_eq(g, w, name == b"accept-language"),
            _ => false,
        }
    })
}

/// `Accept-Encoding` as the cache compares it and as a fill sends it to the
/// origin: one of three buckets, as Varnish and Fastly normalise it, so that
/// the hundreds of spellings browsers send make at most three variants.
/// `br` when brotli is accepted, else `gzip` when gzip is (or `*` is and
/// gzip is not refused), else `identity` (absent, or nothing known).
pub fn encoding_bucket(ae: Option<&[u8]>) -> &'static [u8] {
    let Some(ae) = ae else {
        return b"identity";
    };
    let (mut br, mut gzip, mut star, mut gzip_refused) = (false, false, false, false);
    for item in ae.split(|&c| c == b',') {
        let mut parts = item.split(|&c| c == b';');
        let tok = parts.next().unwrap_or_default().trim_ascii();
        // A q of 0 (or a malformed q) refuses the coding (RFC 9110 §12.4.2).
        let ok = parts.all(|p| {
            let p = p.trim_ascii();
            !(p.len() >= 2 && p[..2].eq_ignore_ascii_case(b"q=")) || qvalue_positive(&p[2..])
        });
        if tok.eq_ignore_ascii_case(b"br") {
            br |= ok;
        } else if tok.eq_ignore_ascii_case(b"gzip") || tok.eq_ignore_ascii_case(b"x-gzip") {
            gzip |= ok;
            gzip_refused |= !ok;
        } else if tok == b"*" {
            star |= ok;
        }
    }
    if br {
        b"br"
    } else if gzip || (star && !gzip_refused) {
        b"gzip"
    } else {
        b"identity"
    }
}

/// A qvalue (`0`, `0.5`, `1.000`…) that is well formed and above 0.
fn qvalue_positive(v: &[u8]) -> bool {
    let v = v.trim_ascii();
    let (int, frac) = match v.iter().position(|&c| c == b'.') {
        Some(i) => (&v[..i], &v[i + 1..]),
        None => (v, &b""[..]),
    };
    if frac.len() > 3 || !frac.iter().all(u8::is_ascii_digit) {
        return false;
    }
    match int {
        b"1" => frac.iter().all(|&d| d == b'0'),
        b"0" => frac.iter().any(|&d| d != b'0'),
        _ => false,
    }
}

/// Move a large body into a mapping of its own (one copy, at store time)
/// so that hits can splice it; true when its body is in one.
fn to_mapped(obj: &mut Object) -> bool {
    if obj.mapped.is_some() {
        return true;
    }
    if obj.body.len() < mapped::MIN_MAPPED_BODY {
        return false;
    }
    match MappedBody::new(&obj.body) {
        Some(f) => {
            obj.body = f.bytes();
            obj.mapped = Some(f);
            true
        }
        None => false,
    }
}

/// A request field's value as Vary records it (`vary_matches` compares
/// the same way): as a list, its members trimmed (`1,2` is ` 1, 2 `, RFC
/// 9110 §5.6.1); Accept-Encoding as its bucket.
fn normalize(name: &[u8], v: Option<&[u8]>) -> Option<Vec<u8>> {
    if name == b"accept-encoding" {
        return Some(encoding_bucket(v).to_vec());
    }
    let mut out = Vec::with_capacity(v?.len());
    for (i, item) in list_items(v?).enumerate() {
        if i > 0 {
            out.push(b',');
        }
        out.extend_from_slice(item);
    }
    if name == b"accept-language" {
        out.make_ascii_lowercase();
    }
    Some(out)
}

/// Two field values as the same list (members compared without case when
/// `ci`: language tags are case-insensitive, RFC 4647 §2).
fn list_eq(a: &[u8], b: &[u8], ci: bool) -> bool {
    let (mut x, mut y) = (list_items(a), list_items(b));
    loop {
        match (x.next(), y.next()) {
            (None, None) => return true,
            (Some(p), Some(q)) if p == q || (ci && p.eq_ignore_ascii_case(q)) => {}
            _ => return false,
        }
    }
}

/// A field value's list members, trimmed, empty ones left out.
fn list_items(v: &[u8]) -> impl Iterator<Item = &[u8]> {
    v.split(|&c| c == b',')
        .map(<[u8]>::trim_ascii)
        .filter(|t| !t.is_empty())
}

/// The request values for a response's Vary fields.
pub fn vary_of(resp: &Headers, req: &Headers) -> VaryValues {
    let mut out = Vec::new();
    for v in resp.get_all_known(pier_http::known::VARY) {
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

/// Lookups by result, and storage counters (sharded per thread: `counter`).
#[derive(Debug, Default)]
pub struct Stats {
    pub hit: Counter,
    pub miss: Counter,
    pub stale: Counter,
    /// A stored response was found stale and went to the origin.
    pub expired: Counter,
    /// A stale response was served while a background refresh ran
    /// (stale-while-revalidate).
    pub updating: Counter,
    pub revalidated: Counter,
    pub coalesced: Counter,
    pub pass: Counter,
    pub stored: Counter,
    /// Keys evicted from the memory tier.
    pub evicted: Counter,
    pub lock_timeouts: Counter,
    /// The disk tier's counters (zero without one).
    pub disk: DiskStats,
}

/// Who fills a key: the first miss leads; the others wait on its watch.
pub enum Fill {
    Leader(FillGuard),
    /// Wait for the leader (`wait`), then look again.
    Follower(Arc<fill::FillBuf>),
    /// The key was found uncacheable lately: go to the origin, no lock.
    Pass,
}

/// Held by the request filling a key; dropping it wakes the waiters.
pub struct FillGuard {
    zone: Arc<Zone>,
    /// What the fill publishes for its followers (`fill.rs`); holds the key.
    pub buf: Arc<fill::FillBuf>,
}

/// A zone's fills in flight, and the keys found uncacheable lately
/// (hit-for-miss: key → until, Unix seconds). Both are looked up on every
/// miss: foldhash (randomly seeded), not SipHash.
#[derive(Default)]
struct Fills {
    table: HashSet<FillEntry, foldhash::fast::RandomState>,
    hit_for_miss: HashMap<Vec<u8>, u64, foldhash::fast::RandomState>,
}

/// A zone's fill in flight, found in the zone's table by its key (which
/// the `FillBuf` holds: no second copy per miss).
struct FillEntry(Arc<fill::FillBuf>);

impl std::borrow::Borrow<[u8]> for FillEntry {
    fn borrow(&self) -> &[u8] {
        self.0.key()
    }
}

impl std::hash::Hash for FillEntry {
    fn hash<H: std::hash::Hasher>(&self, h: &mut H) {
        // As `[u8]` hashes: `Borrow` requires it.
        self.0.key().hash(h)
    }
}

impl PartialEq for FillEntry {
    fn eq(&self, other: &Self) -> bool {
        self.0.key() == other.0.key()
    }
}

impl Eq for FillEntry {}

impl Drop for FillGuard {
    fn drop(&mut self) {
        self.zone.fills.lock().table.remove(self.buf.key());
        // Followers still waiting look again.
        self.buf.close();
    }
}

impl FillGuard {
    /// The response is not cacheable: remember it for `for_secs`, so the
    /// next requests for the key skip the lock.
    pub fn uncacheable(&self, now: u64, for_secs: u64) {
        let mut f = self.zone.fills.lock();
        let h = &mut f.hit_for_miss;
        if h.len() >= 10_000 {
            h.retain(|_, until| *until > now);
            if h.len() >= 10_000 {
                h.clear();
            }
        }
        h.insert(self.buf.key().to_vec(), now + for_secs);
    }
}

/// A cache zone (`[cache.NAME]`), shared by every worker: a memory tier
/// (S3-FIFO, `memory.rs`) and, optionally, a disk tier behind it
/// (`disk.rs`) that objects reach only once promoted by hits.
pub struct Zone {
    pub name: String,
    max_bytes: usize,
    pub max_object: usize,
    mem: Mutex<Memory>,
    disk: Option<Disk>,
    /// Fills in flight and hit-for-miss keys, under one lock: a miss
    /// takes it once to start its fill and once to end it.
    fills: Mutex<Fills>,
    pub stats: Arc<Stats>,
    /// Tag → keys (`Surrogate-Key`, `Cache-Tag`), for purges by tag.
    pub tags: tags::TagIndex,
}

impl Zone {
    /// A memory-only zone.
    pub fn new(name: &str, max_bytes: usize, max_object: usize) -> Arc<Zone> {
        Self::open(name, max_bytes, max_object, None).expect("a memory zone needs no I/O")
    }

    /// A zone with an optional disk tier (its directory is created and its
    /// index rebuilt in the background from what an earlier run left).
    pub fn open(
        name: &str,
        max_bytes: usize,
        max_object: usize,
        disk: Option<DiskConfig>,
    ) -> std::io::Result<Arc<Zone>> {
        let stats = Arc::new(Stats::default());
        let disk = match disk {
            Some(cfg) => Some(Disk::open(cfg, stats.clone())?),
            None => None,
        };
        Ok(Arc::new(Zone {
            name: name.to_string(),
            max_bytes,
            max_object: max_object.min(max_bytes),
            mem: Mutex::new(Memory::new(max_bytes)),
            disk,
            fills: Mutex::new(Fills::default()),
            stats,
            // About 100 bytes a pair: bounded to ~1/8 of the zone's bytes.
            tags: tags::TagIndex::new((max_bytes / 800).clamp(1024, 4_000_000)),
        }))
    }

    /// The stored variant of `key` that answers a request with `req`
    /// headers, from memory only (see `get` for both tiers). A hit counts
    /// toward promotion to the disk tier.
    pub fn lookup(&self, key: &[u8], req: &Headers) -> Option<Arc<Object>> {
        let mut m = self.mem.lock();
        let e = m.get(key)?;
        let slot = e.slots.iter_mut().find(|s| s.obj.matches(req))?;
        let obj = slot.obj.clone();
        let Some(d) = &self.disk else {
            return Some(obj);
        };
        slot.hits = slot.hits.saturating_add(1);
        if slot.on_disk || slot.hits < d.config().promote_hits {
            return Some(obj);
        }
        // Promoted: written once, if enough freshness is left to be worth it.
        let now = now();
        let left = obj.lifetime.saturating_sub(obj.age(now));
        if left < d.config().min_ttl {
            return Some(obj);
        }
        slot.on_disk = true;
        drop(m);
        if !d.write(key, obj.clone(), now) {
            // Not queued (queue or disk full): a later hit tries again.
            let mut m = self.mem.lock();
            if let Some(e) = m.get(key) {
                for s in e.slots.iter_mut().filter(|s| Arc::ptr_eq(&s.obj, &obj)) {
                    s.on_disk = false;
                }
            }
        }
        Some(obj)
    }

    /// `lookup`, then the disk tier: a disk hit is read by the I/O threads
    /// (the worker waits without blocking) and put back in memory.
    pub async fn get(&self, key: &[u8], req: &Headers) -> Option<Arc<Object>> {
        if let Some(o) = self.lookup(key, req) {
            return Some(o);
        }
        let d = self.disk.as_ref()?;
        let mut obj = d.lookup(key, req).await?;
        to_mapped(&mut obj);
        let obj = Arc::new(obj);
        let evicted = self.mem.lock().insert(
            Arc::from(key),
            Slot {
                obj: obj.clone(),
                hits: 0,
                on_disk: true,
            },
        );
        self.stats.evicted.add(evicted.keys);
        // Outside the zone's lock: what the evicted objects leave behind
        // serves this thread's next stores.
        recycle::recycle(evicted.entries);
        Some(obj)
    }

    /// Store a response (replacing the variant with the same Vary values);
    /// the memory tier evicts until the zone fits. With `promote_hits = 0`
    /// it is queued for the disk at once (write every store).
    /// The key is shared with the entry (a fill's key is already an `Arc`).
    pub fn insert(&self, key: impl Into<Arc<[u8]>>, mut obj: Object) {
        let key: Arc<[u8]> = key.into();
        let size = obj.size();
        if size > self.max_object {
            return;
        }
        if !to_mapped(&mut obj) {
            // A body grown by doubling may hold twice its length: keep an
            // exact copy so that the zone's bytes are what memory holds.
            obj.body = match std::mem::take(&mut obj.body).try_into_mut() {
                Ok(b) if !recycle::tight(b.capacity(), b.len()) => Bytes::copy_from_slice(&b),
                Ok(b) => b.freeze(),
                Err(shared) => shared,
            };
        }
        let obj = Arc::new(obj);
        let mut write_now = false;
        if let Some(d) = &self.disk {
            // What the disk holds for this variant is older: it goes.
            d.remove_variant(&key, &obj.vary);
            write_now = d.config().promote_hits == 0
                && obj.lifetime.saturating_sub(obj.age(now())) >= d.config().min_ttl;
        }
        let evicted = self.mem.lock().insert(
            key.clone(),
            Slot {
                obj: obj.clone(),
                hits: 0,
                on_disk: write_now,
            },
        );
        self.stats.evicted.add(evicted.keys);
        // Outside the zone's lock: what the evicted objects leave behind
        // serves this thread's next stores.
        recycle::recycle(evicted.entries);
        self.stats.stored.add(1);
        self.record_tags(&key, &obj.headers);
        if write_now {
            if let Some(d) = &self.disk {
                d.write(&key, obj, now());
            }
        }
    }

    /// Drop every variant of `key` (unsafe methods, purge), in both tiers.
    pub fn invalidate(&self, key: &[u8]) -> bool {
        self.tags.forget(key);
        let mem = self.mem.lock().remove(key).is_some();
        let disk = self.disk.as_ref().is_some_and(|d| d.remove_key(key));
        mem || disk
    }

    /// Drop every key starting with `prefix`, in both tiers; how many keys
    /// went (a key in both tiers counts once per tier).
    pub fn purge_prefix(&self, prefix: &[u8]) -> usize {
        self.purge_where(|k| k.starts_with(prefix))
    }

    /// Drop every key for which `pred` holds, in both tiers; how many went
    /// (a key in both tiers counts once per tier).
    pub fn purge_where(&self, mut pred: impl FnMut(&[u8]) -> bool) -> usize {
        let n = self.mem.lock().remove_where(&mut pred).len();
        n + self.disk.as_ref().map_or(0, |d| d.remove_where(pred))
    }

    /// Record the tags of a stored response (outside the memory lock).
    fn record_tags(&self, key: &[u8], headers: &Headers) {
        let tags = tags::tags_of(headers);
        if !tags.is_empty() {
            self.tags
                .record(key, &tags, |k| self.mem.lock().contains(k));
        }
    }

    /// Drop every key recorded with `tag` (both tiers); how many were stored.
    pub fn purge_tag(&self, tag: &[u8]) -> usize {
        let keys = self.tags.take(tag);
        keys.iter().filter(|k| self.invalidate(k)).count()
    }

    /// Who fills `key` now.
    pub fn fill(self: &Arc<Self>, key: &Arc<[u8]>, now: u64) -> Fill {
        let mut f = self.fills.lock();
        let h = &mut f.hit_for_miss;
        if !h.is_empty() {
            match h.get(&key[..]) {
                Some(&until) if until > now => return Fill::Pass,
                Some(_) => {
                    h.remove(&key[..]);
                }
                None => {}
            }
        }
        if let Some(FillEntry(buf)) = f.table.get(&key[..]) {
            return Fill::Follower(buf.clone());
        }
        let buf = fill::FillBuf::keyed(key.clone(), self.max_object);
        f.table.insert(FillEntry(buf.clone()));
        Fill::Leader(FillGuard {
            zone: self.clone(),
            buf,
        })
    }

    /// Bound the Vary variants kept per key, in both tiers (the oldest
    /// goes first); at least 1.
    pub fn set_max_variants(&self, n: usize) {
        let n = n.max(1);
        self.mem.lock().max_variants = n;
        if let Some(d) = &self.disk {
            d.set_max_variants(n);
        }
    }

    /// Keys and bytes in the memory tier now.
    pub fn usage(&self) -> (usize, usize) {
        let (_, keys, bytes) = self.mem.lock().usage();
        (keys, bytes)
    }

    /// Objects (variants) and bytes per tier: (memory, disk); the disk's
    /// is None without a disk tier.
    pub fn tiers(&self) -> ((u64, u64), Option<(u64, u64)>) {
        let (objects, _, bytes) = self.mem.lock().usage();
        let disk = self.disk.as_ref().map(|_| {
            (
                self.stats.disk.objects.load(Relaxed),
                self.stats.disk.bytes.load(Relaxed),
            )
        });
        ((objects as u64, bytes as u64), disk)
    }

    /// The disk tier's capacity, if it has one.
    pub fn disk_capacity(&self) -> Option<u64> {
        self.disk.as_ref().map(|d| d.config().max_bytes)
    }

    /// The disk tier has finished reading what an earlier run left (always
    /// true without one).
    pub fn disk_ready(&self) -> bool {
        self.disk.as_ref().is_none_or(|d| d.ready())
    }

    pub fn capacity(&self) -> usize {
        self.max_bytes
    }
}

/// Wait for a fill to end (its leader's guard dropped), at most `limit`.
/// `false`: timed out (the caller goes to the origin itself).
pub async fn wait_fill(buf: Arc<fill::FillBuf>, limit: Duration) -> bool {
    buf.wait_end(limit).await
}

/// The default cache key: scheme, host (lower-cased, without a default
/// port) and target.
pub fn key(scheme: &str, host: &[u8], target: &[u8]) -> Vec<u8> {
    let mut k = Vec::with_capacity(scheme.len() + host.len() + target.len() + 3);
    key_into(&mut k, scheme, host, target);
    k
}

/// `key`, appended to `k` (a buffer reused from request to request).
pub fn key_into(k: &mut Vec<u8>, scheme: &str, host: &[u8], target: &[u8]) {
    k.extend_from_slice(scheme.as_bytes());
    k.extend_from_slice(b"://");
    let host = match scheme {
        "http" => host.strip_suffix(b":80").unwrap_or(host),
        "https" => host.strip_suffix(b":443").unwrap_or(host),
        _ => host,
    };
    let at = k.len();
    k.extend_from_slice(host);
    k[at..].make_ascii_lowercase();
    k.extend_from_slice(target);
}

/// Unix seconds now: [`pier_clock::unix_secs`], which a test can move
/// forward (`PIER_TEST_CLOCK`, docs/testing.md).
pub fn now() -> u64 {
    pier_clock::unix_secs()
}

/// [`now`] without a clock read, for a worker's request path
/// (`pier_clock::recent_unix_secs`): a lookup and a fill's response time.
pub fn recent() -> u64 {
    pier_clock::recent_unix_secs()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn obj(body: usize, vary: Vec<(Vec<u8>, Option<Vec<u8>>)>) -> Object {
        Object {
            status: 200,
            headers: Headers::default(),
            body: Bytes::from(vec![b'x'; body]),
            mapped: None,
            lifetime: 60,
            request_time: 0,
            response_time: 0,
            date: 0,
            age_header: 0,
            cc: CacheControl::default(),
            vary,
            synthetic_lm: false,
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
        let k: Arc<[u8]> = Arc::from(&b"k"[..]);
        let Fill::Leader(g) = z.fill(&k, 100) else {
            panic!("first is the leader")
        };
        let Fill::Follower(rx) = z.fill(&k, 100) else {
            panic!("second follows")
        };
        let waiter = tokio::spawn(wait_fill(rx, Duration::from_secs(10)));
        g.uncacheable(100, 30);
        drop(g);
        assert!(waiter.await.unwrap());
        assert!(matches!(z.fill(&k, 110), Fill::Pass));
        assert!(matches!(z.fill(&k, 200), Fill::Leader(_)));
    }

    /// Issue 31, item 11: a key's variants are bounded (the oldest goes),
    /// and Accept-Encoding is compared as one of three buckets.
    #[test]
    fn variants_are_bounded_and_accept_encoding_bucketed() {
        let z = Zone::new("t", 1 << 20, 1 << 16);
        let mut resp = Headers::default();
        resp.append(b"vary", b"X-V");
        let req = |v: &str| {
            let mut h = Headers::default();
            h.append(b"x-v", v.as_bytes());
            h
        };
        for i in 0..100 {
            z.insert(b"k".to_vec(), obj(10, vary_of(&resp, &req(&i.to_string()))));
        }
        assert_eq!(z.tiers().0 .0, DEFAULT_MAX_VARIANTS as u64);
        assert!(z.lookup(b"k", &req("99")).is_some());
        assert!(z.lookup(b"k", &req("0")).is_none(), "the oldest went");
        z.set_max_variants(3);
        z.insert(b"k".to_vec(), obj(10, vary_of(&resp, &req("new"))));
        assert_eq!(z.tiers().0 .0, 3);
        assert!(z.lookup(b"k", &req("new")).is_some());
        assert!(z.lookup(b"k", &req("98")).is_some());
        assert!(z.lookup(b"k", &req("97")).is_none());

        let b = |v: Option<&str>| encoding_bucket(v.map(str::as_bytes));
        assert_eq!(b(None), b"identity");
        assert_eq!(b(Some("")), b"identity");
        assert_eq!(b(Some("deflate, compress")), b"identity");
        assert_eq!(b(Some("gzip")), b"gzip");
        assert_eq!(b(Some("GZIP;q=0.5, deflate")), b"gzip");
        assert_eq!(b(Some("gzip, deflate, br, zstd")), b"br");
        assert_eq!(b(Some("br;q=0, gzip")), b"gzip");
        assert_eq!(b(Some("br;q=0.000, gzip;q=0")), b"identity");
        assert_eq!(b(Some("br;q=2")), b"identity", "a malformed q refuses");
        assert_eq!(b(Some("*")), b"gzip");
        assert_eq!(b(Some("gzip;q=0, *")), b"identity");
        // Two spellings of one bucket share a variant.
        let mut ae = Headers::default();
        ae.append(b"vary", b"Accept-Encoding");
        let with = |v: &str| {
            let mut h = Headers::default();
            h.append(b"accept-encoding", v.as_bytes());
            h
        };
        z.insert(b"e".to_vec(), obj(10, vary_of(&ae, &with("gzip, deflate"))));
        z.insert(b"e".to_vec(), obj(20, vary_of(&ae, &with("x-gzip"))));
        z.insert(b"e".to_vec(), obj(30, vary_of(&ae, &Headers::default())));
        assert_eq!(
            z.lookup(b"e", &with("deflate, gzip;q=0.8"))
                .unwrap()
                .body
                .len(),
            20
        );
        assert_eq!(z.lookup(b"e", &with("identity")).unwrap().body.len(), 30);
        assert!(z.lookup(b"e", &with("br")).is_none());
        // Other fields compare as lists: spaces around members do not count.
        z.insert(b"s".to_vec(), obj(10, vary_of(&resp, &req("1,2"))));
        assert!(z.lookup(b"s", &req(" 1, 2 ")).is_some());
        assert!(z.lookup(b"s", &req("1,,2")).is_some());
        assert!(z.lookup(b"s", &req("1 2")).is_none());
        assert!(z.lookup(b"s", &req("2,1")).is_none());
        let mut al = Headers::default();
        al.append(b"vary", b"Accept-Language");
        let lang = |v: &str| {
            let mut h = Headers::default();
            h.append(b"accept-language", v.as_bytes());
            h
        };
        z.insert(b"l".to_vec(), obj(10, vary_of(&al, &lang("en, DE"))));
        assert!(z.lookup(b"l", &lang("eN ,de")).is_some());
        assert!(z.lookup(b"l", &lang("de, en")).is_none(), "order is kept");
    }
}
