//! Surrogate keys (tags): which stored keys carry which tag, so that an
//! admin can purge every object of a tag at once (Fastly's `Surrogate-Key`,
//! space-separated; Cloudflare's `Cache-Tag`, comma-separated).
//!
//! The index is recorded when a response is stored and forgotten when a key
//! is dropped by invalidation or purge. Evictions don't call in: entries of
//! evicted keys are swept when the index grows past its bound (a purge of
//! such a tag then finds keys that are already gone, which costs nothing).

use parking_lot::Mutex;
use pier_http::Headers;
use std::collections::{HashMap, HashSet};

/// Tags one object may carry; more are ignored.
pub const MAX_TAGS_PER_OBJECT: usize = 64;
/// Longest tag kept (longer ones are ignored).
pub const MAX_TAG_LEN: usize = 256;

/// The tags a response carries (`Surrogate-Key` and `Cache-Tag`), in order,
/// without duplicates, bounded by [`MAX_TAGS_PER_OBJECT`].
pub fn tags_of(headers: &Headers) -> Vec<Vec<u8>> {
    let mut out: Vec<Vec<u8>> = Vec::new();
    let mut add = |t: &[u8]| {
        let t = t.trim_ascii();
        if !t.is_empty()
            && t.len() <= MAX_TAG_LEN
            && out.len() < MAX_TAGS_PER_OBJECT
            && !out.iter().any(|o| o == t)
        {
            out.push(t.to_vec());
        }
    };
    for v in headers.get_all_known(pier_http::known::SURROGATE_KEY) {
        v.split(|c| c.is_ascii_whitespace()).for_each(&mut add);
    }
    for v in headers.get_all_known(pier_http::known::CACHE_TAG) {
        v.split(|&c| c == b',').for_each(&mut add);
    }
    out
}

#[derive(Default)]
struct Inner {
    by_tag: HashMap<Vec<u8>, HashSet<Vec<u8>>>,
    by_key: HashMap<Vec<u8>, Vec<Vec<u8>>>,
    /// (tag, key) pairs held.
    pairs: usize,
}

impl Inner {
    fn forget(&mut self, key: &[u8]) {
        let Some(tags) = self.by_key.remove(key) else {
            return;
        };
        for t in tags {
            if let Some(keys) = self.by_tag.get_mut(&t) {
                if keys.remove(key) {
                    self.pairs -= 1;
                }
                if keys.is_empty() {
                    self.by_tag.remove(&t);
                }
            }
        }
    }
}

/// Tag → keys, bounded in (tag, key) pairs.
pub struct TagIndex {
    inner: Mutex<Inner>,
    max_pairs: usize,
}

impl TagIndex {
    pub fn new(max_pairs: usize) -> TagIndex {
        TagIndex {
            inner: Mutex::new(Inner::default()),
            max_pairs: max_pairs.max(1),
        }
    }

    /// Key `key` was stored with `tags` (added to the tags its other
    /// variants carry). When the index is full, `live` tells which keys are
    /// still stored: the others' entries go; if it is still full, the new
    /// tags are not recorded (the object can still go by key or prefix).
    pub fn record(&self, key: &[u8], tags: &[Vec<u8>], live: impl Fn(&[u8]) -> bool) {
        if tags.is_empty() {
            return;
        }
        let mut g = self.inner.lock();
        if g.pairs + tags.len() > self.max_pairs {
            let dead: Vec<Vec<u8>> = g.by_key.keys().filter(|k| !live(k)).cloned().collect();
            for k in dead {
                g.forget(&k);
            }
            if g.pairs + tags.len() > self.max_pairs {
                return;
            }
        }
        let g = &mut *g;
        let have = g.by_key.entry(key.to_vec()).or_default();
        for t in tags {
            if have.contains(t) {
                continue;
            }
            have.push(t.clone());
            if g.by_tag.entry(t.clone()).or_default().insert(key.to_vec()) {
                g.pairs += 1;
            }
        }
    }

    /// The key is gone (invalidated, purged).
    pub fn forget(&self, key: &[u8]) {
        self.inner.lock().forget(key);
    }

    /// Every key recorded with `tag`; the tag's entries are dropped (the
    /// caller drops the keys).
    pub fn take(&self, tag: &[u8]) -> Vec<Vec<u8>> {
        let mut g = self.inner.lock();
        let Some(keys) = g.by_tag.get(tag) else {
            return Vec::new();
        };
        let keys: Vec<Vec<u8>> = keys.iter().cloned().collect();
        for k in &keys {
            g.forget(k);
        }
        keys
    }

    /// (tags, keys, pairs) held.
    pub fn len(&self) -> (usize, usize, usize) {
        let g = self.inner.lock();
        (g.by_tag.len(), g.by_key.len(), g.pairs)
    }

    pub fn is_empty(&self) -> bool {
        self.inner.lock().pairs == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_both_headers_bounded() {
        let mut h = Headers::default();
        h.append(b"Surrogate-Key", b"  a b\tc  a ");
        h.append(b"Cache-Tag", b"d, e ,, a");
        let t = tags_of(&h);
        assert_eq!(
            t,
            vec![
                b"a".to_vec(),
                b"b".to_vec(),
                b"c".to_vec(),
                b"d".to_vec(),
                b"e".to_vec()
            ]
        );
        let mut h = Headers::default();
        let many: Vec<String> = (0..200).map(|i| format!("t{i}")).collect();
        h.append(b"Surrogate-Key", many.join(" ").as_bytes());
        h.append(b"Cache-Tag", "x".repeat(MAX_TAG_LEN + 1).as_bytes());
        assert_eq!(tags_of(&h).len(), MAX_TAGS_PER_OBJECT);
    }

    #[test]
    fn record_take_forget_and_bound() {
        let ix = TagIndex::new(4);
        let t = |s: &str| s.as_bytes().to_vec();
        ix.record(b"k1", &[t("a"), t("b")], |_| true);
        ix.record(b"k2", &[t("a")], |_| true);
        ix.record(b"k2", &[t("a")], |_| true);
        assert_eq!(ix.len(), (2, 2, 3));
        ix.forget(b"k1");
        assert_eq!(ix.len(), (1, 1, 1));
        ix.record(b"k1", &[t("b")], |_| true);
        let mut keys = ix.take(b"a");
        keys.sort();
        assert_eq!(keys, vec![t("k2")]);
        assert_eq!(ix.len(), (1, 1, 1));
        // Full: keys no longer stored are swept to make room.
        ix.record(b"k3", &[t("c"), t("d"), t("e")], |_| true);
        assert_eq!(ix.len().2, 4);
        ix.record(b"k4", &[t("f")], |k| k != b"k1");
        assert_eq!(ix.take(b"b"), Vec::<Vec<u8>>::new());
        assert_eq!(ix.take(b"f"), vec![t("k4")]);
        // Still full after a sweep: not recorded, nothing grows.
        ix.record(b"k5", &[t("g"), t("h")], |_| true);
        ix.record(b"k6", &[t("i"), t("j")], |_| true);
        assert!(ix.len().2 <= 4);
    }
}
