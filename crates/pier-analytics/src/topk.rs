//! Space-Saving heavy hitters (Metwally, Agrawal and El Abbadi, 2005) over
//! byte strings: top paths, clients and user agents.
//!
//! A summary keeps at most `capacity` counters. A monitored item's counter is
//! incremented; a new item takes over the smallest counter `min`, starting
//! at `min + n` with error `min`. Every count overestimates by at most its
//! error, the error is at most `total / capacity`, and any item whose true
//! count exceeds `total / capacity` is monitored.
//!
//! Merge (Cafaro, Pulimeno and Tempesta 2016, "parallel Space Saving"): an
//! item's merged count is its count in each summary, or that summary's
//! smallest counter if it is full and does not monitor the item (0 if not
//! full); the largest `capacity` counters are kept. The same guarantees then
//! hold for the combined stream, so an hour's summary merged from minutes
//! bounds its errors by the hour's total over capacity.

use crate::codec::{put_bytes, put_u64, DecodeError, Reader};
use std::collections::HashMap;

/// Items longer than this are truncated (bytes).
pub const MAX_ITEM_LEN: usize = 256;
/// Largest capacity [`TopK::from_bytes`] accepts.
pub const MAX_CAPACITY: usize = 4096;
const FORMAT: u8 = 1;

#[derive(Clone, Debug, PartialEq, Eq)]
struct Counter {
    item: Box<[u8]>,
    count: u64,
    error: u64,
}

/// A Space-Saving summary with a fixed number of counters.
#[derive(Clone, Debug)]
pub struct TopK {
    capacity: usize,
    total: u64,
    counters: Vec<Counter>,
    /// Item -> position in `counters`.
    /// At most `capacity` entries, so even colliding keys cost a bounded scan.
    index: HashMap<Box<[u8]>, usize, foldhash::fast::RandomState>,
}

impl PartialEq for TopK {
    fn eq(&self, other: &Self) -> bool {
        self.capacity == other.capacity
            && self.total == other.total
            && self.sorted() == other.sorted()
    }
}

impl Eq for TopK {}

impl TopK {
    /// A summary keeping `capacity` counters (at least 1).
    pub fn new(capacity: usize) -> Self {
        Self {
            capacity: capacity.max(1),
            total: 0,
            counters: Vec::new(),
            index: HashMap::default(),
        }
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Sum of all `n` added (the stream length the error bound refers to).
    pub fn total(&self) -> u64 {
        self.total
    }

    /// Counts `n` occurrences of `item` (truncated to [`MAX_ITEM_LEN`]).
    pub fn add(&mut self, item: &[u8], n: u64) {
        let item = &item[..item.len().min(MAX_ITEM_LEN)];
        self.total = self.total.saturating_add(n);
        if let Some(&i) = self.index.get(item) {
            let c = &mut self.counters[i].count;
            *c = c.saturating_add(n);
        } else if self.counters.len() < self.capacity {
            self.push(item.into(), n, 0);
        } else if let Some(i) = self.min_position() {
            // Evict the smallest counter: the new item inherits its count as
            // possible overcount.
            let min = self.counters[i].count;
            let old = std::mem::replace(&mut self.counters[i].item, item.into());
            self.index.remove(&old);
            self.index.insert(item.into(), i);
            self.counters[i].count = min.saturating_add(n);
            self.counters[i].error = min;
        }
    }

    fn push(&mut self, item: Box<[u8]>, count: u64, error: u64) {
        self.index.insert(item.clone(), self.counters.len());
        self.counters.push(Counter { item, count, error });
    }

    /// First counter with the smallest count (deterministic on ties).
    fn min_position(&self) -> Option<usize> {
        self.counters
            .iter()
            .enumerate()
            .min_by_key(|(_, c)| c.count)
            .map(|(i, _)| i)
    }

    /// The count an unmonitored item may have had: the smallest counter if
    /// the summary is full, else 0 (every item seen is monitored).
    fn floor(&self) -> u64 {
        if self.counters.len() < self.capacity {
            0
        } else {
            self.counters.iter().map(|c| c.count).min().unwrap_or(0)
        }
    }

    /// Merges `other` into this summary, keeping this one's capacity.
    pub fn merge(&mut self, other: &TopK) {
        if other.counters.is_empty() {
            self.total = self.total.saturating_add(other.total);
            return;
        }
        let (floor_a, floor_b) = (self.floor(), other.floor());
        let mut merged: Vec<Counter> =
            Vec::with_capacity(self.counters.len() + other.counters.len());
        for c in &self.counters {
            let (count, error) = match other.index.get(&c.item) {
                Some(&j) => (other.counters[j].count, other.counters[j].error),
                None => (floor_b, floor_b),
            };
            merged.push(Counter {
                item: c.item.clone(),
                count: c.count.saturating_add(count),
                error: c.error.saturating_add(error),
            });
        }
        for c in &other.counters {
            if !self.index.contains_key(&c.item) {
                merged.push(Counter {
                    item: c.item.clone(),
                    count: c.count.saturating_add(floor_a),
                    error: c.error.saturating_add(floor_a),
                });
            }
        }
        sort_counters(&mut merged);
        merged.truncate(self.capacity);
        self.total = self.total.saturating_add(other.total);
        self.counters.clear();
        self.index.clear();
        for c in merged {
            self.push(c.item, c.count, c.error);
        }
    }

    fn sorted(&self) -> Vec<Counter> {
        let mut v = self.counters.clone();
        sort_counters(&mut v);
        v
    }

    /// The `n` largest counters as (item, count), largest first (ties by
    /// item). Items are decoded as UTF-8, invalid bytes replaced. Counts are
    /// upper bounds; see [`TopK::top_with_error`].
    pub fn top(&self, n: usize) -> Vec<(String, u64)> {
        self.top_with_error(n)
            .into_iter()
            .map(|(item, count, _)| (item, count))
            .collect()
    }

    /// As [`TopK::top`], with each count's maximum overestimate: the true
    /// count is in `[count - error, count]`.
    pub fn top_with_error(&self, n: usize) -> Vec<(String, u64, u64)> {
        let mut v = self.sorted();
        v.truncate(n);
        v.into_iter()
            .map(|c| {
                (
                    String::from_utf8_lossy(&c.item).into_owned(),
                    c.count,
                    c.error,
                )
            })
            .collect()
    }

    /// `[format, capacity, total, n, (item, count, error)...]`, varints and
    /// length-prefixed items, counters sorted so equal summaries encode
    /// equally.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(8 + self.counters.len() * 24);
        out.push(FORMAT);
        put_u64(&mut out, self.capacity as u64);
        put_u64(&mut out, self.total);
        put_u64(&mut out, self.counters.len() as u64);
        for c in self.sorted() {
            put_bytes(&mut out, &c.item);
            put_u64(&mut out, c.count);
            put_u64(&mut out, c.error);
        }
        out
    }

    /// Parses [`TopK::to_bytes`] output; rejects anything malformed.
    pub fn from_bytes(bytes: &[u8]) -> Result<TopK, DecodeError> {
        let mut r = Reader::new(bytes);
        if r.u8()? != FORMAT {
            return Err(DecodeError("topk: unknown format"));
        }
        let capacity = r.len(MAX_CAPACITY)?;
        if capacity == 0 {
            return Err(DecodeError("topk: zero capacity"));
        }
        let mut t = TopK::new(capacity);
        t.total = r.u64()?;
        let n = r.len(capacity)?;
        for _ in 0..n {
            let item = r.bytes()?;
            let count = r.u64()?;
            let error = r.u64()?;
            if item.len() > MAX_ITEM_LEN || error > count || t.index.contains_key(item) {
                return Err(DecodeError("topk: bad counter"));
            }
            t.push(item.into(), count, error);
        }
        r.finish()?;
        Ok(t)
    }
}

fn sort_counters(v: &mut [Counter]) {
    v.sort_by(|a, b| b.count.cmp(&a.count).then_with(|| a.item.cmp(&b.item)));
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rng(seed: u64) -> impl FnMut() -> u64 {
        let mut s = seed;
        move || {
            s ^= s >> 12;
            s ^= s << 25;
            s ^= s >> 27;
            s.wrapping_mul(0x2545_f491_4f6c_dd1d)
        }
    }

    /// A Zipf(1.1) stream over `items` distinct items, by inverse CDF.
    fn zipf_stream(len: usize, items: usize, seed: u64) -> Vec<u32> {
        let weights: Vec<f64> = (1..=items).map(|k| 1.0 / (k as f64).powf(1.1)).collect();
        let sum: f64 = weights.iter().sum();
        let mut cdf = Vec::with_capacity(items);
        let mut acc = 0.0;
        for w in weights {
            acc += w / sum;
            cdf.push(acc);
        }
        let mut next = rng(seed);
        (0..len)
            .map(|_| {
                let u = (next() >> 11) as f64 / (1u64 << 53) as f64;
                cdf.partition_point(|&c| c < u).min(items - 1) as u32
            })
            .collect()
    }

    fn item(i: u32) -> Vec<u8> {
        format!("/item/{i}").into_bytes()
    }

    /// Checks the Space-Saving guarantees of `t` against exact counts.
    fn check(t: &TopK, exact: &HashMap<u32, u64>, total: u64) {
        let bound = total / t.capacity() as u64;
        let top = t.top_with_error(t.capacity());
        let found: HashMap<String, (u64, u64)> =
            top.into_iter().map(|(s, c, e)| (s, (c, e))).collect();
        let mut heavy = 0;
        for (&i, &true_count) in exact {
            let name = String::from_utf8(item(i)).unwrap();
            if let Some(&(count, error)) = found.get(&name) {
                assert!(count >= true_count, "{name}: {count} < {true_count}");
                assert!(count - error <= true_count, "{name}: error too small");
                assert!(error <= bound, "{name}: error {error} > {bound}");
            }
            if true_count > bound {
                heavy += 1;
                assert!(
                    found.contains_key(&name),
                    "heavy hitter {name} ({true_count}) missing"
                );
            }
        }
        assert!(heavy >= 5, "test stream should have heavy hitters");
    }

    #[test]
    fn finds_zipf_heavy_hitters_within_bound() {
        let stream = zipf_stream(200_000, 5_000, 11);
        let mut exact = HashMap::new();
        let mut t = TopK::new(64);
        for &i in &stream {
            *exact.entry(i).or_insert(0u64) += 1;
            t.add(&item(i), 1);
        }
        assert_eq!(t.total(), stream.len() as u64);
        check(&t, &exact, stream.len() as u64);
        // The top few are in the true order.
        let top3: Vec<String> = t.top(3).into_iter().map(|(s, _)| s).collect();
        assert_eq!(top3, ["/item/0", "/item/1", "/item/2"]);
    }

    #[test]
    fn merged_summaries_keep_the_guarantees() {
        let stream = zipf_stream(120_000, 5_000, 23);
        let mut exact = HashMap::new();
        let mut parts: Vec<TopK> = (0..6).map(|_| TopK::new(64)).collect();
        for (n, &i) in stream.iter().enumerate() {
            *exact.entry(i).or_insert(0u64) += 1;
            // Uneven split: most of the stream in the first part.
            let p = if n % 4 == 0 { n % 6 } else { 0 };
            parts[p].add(&item(i), 1);
        }
        let mut all = TopK::new(64);
        for p in &parts {
            all.merge(p);
        }
        assert_eq!(all.total(), stream.len() as u64);
        check(&all, &exact, stream.len() as u64);
        // And through serialization.
        let back = TopK::from_bytes(&all.to_bytes()).unwrap();
        assert_eq!(back, all);
    }

    #[test]
    fn exact_while_under_capacity_and_merge_of_small() {
        let mut a = TopK::new(8);
        let mut b = TopK::new(8);
        a.add(b"/a", 5);
        a.add(b"/b", 2);
        b.add(b"/a", 1);
        b.add(b"/c", 7);
        a.merge(&b);
        assert_eq!(
            a.top(10),
            [
                ("/c".to_string(), 7),
                ("/a".to_string(), 6),
                ("/b".to_string(), 2)
            ]
        );
        let long = vec![b'x'; 1000];
        a.add(&long, 1);
        a.add(&long[..MAX_ITEM_LEN], 1);
        assert!(a
            .top(10)
            .iter()
            .any(|(s, c)| s.len() == MAX_ITEM_LEN && *c == 2));
        // Lossy UTF-8.
        a.add(b"\xff/x", 1);
        assert!(a.top(10).iter().any(|(s, _)| s == "\u{fffd}/x"));
    }

    #[test]
    fn malformed_input_is_an_error() {
        let mut t = TopK::new(4);
        t.add(b"/a", 3);
        t.add(b"/b", 1);
        let good = t.to_bytes();
        assert_eq!(TopK::from_bytes(&good).unwrap(), t);
        for bad in [
            &[][..],
            &[2, 4, 0, 0],                               // unknown format
            &[1, 0, 0, 0],                               // zero capacity
            &[1, 1, 0, 2, 0, 0, 0, 0, 0, 0],             // more counters than capacity
            &[1, 4, 1, 1, 1, b'a', 1, 2],                // error > count
            &[1, 4, 2, 2, 1, b'a', 1, 0, 1, b'a', 1, 0], // duplicate item
            &[1, 4, 1, 1, 5, b'a', 1, 0],                // item length past the end
            &good[..good.len() - 1],
        ] {
            assert!(TopK::from_bytes(bad).is_err(), "{bad:?}");
        }
        for i in 0..good.len() {
            let mut c = good.clone();
            c[i] ^= 0x3c;
            let _ = TopK::from_bytes(&c);
        }
    }
}
