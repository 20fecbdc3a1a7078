//! The memory tier: S3-FIFO (Yang et al., SOSP '23) bounded in bytes.
//!
//! New keys enter a small FIFO (10% of the bytes); a key hit at least once
//! while there moves to the main FIFO when it reaches the head, the others
//! leave and are remembered in a ghost FIFO of hashes (a ghost key that
//! comes back goes straight to main). Main is FIFO with reinsertion: a key
//! hit since it was last examined is put back with its count lowered. A
//! scan of one-hit keys therefore only churns the small FIFO and never
//! pushes out the working set that LRU would lose. A hit costs a hash
//! lookup and a counter bump: no list is relinked.
//!
//! Queues hold (hash, generation) and are cleaned lazily: an entry removed
//! or replaced leaves a stale item that is skipped when it reaches the head
//! (and the queues are compacted when stale items outnumber live ones).

use crate::Object;
use smallvec::SmallVec;
use std::collections::{HashMap, HashSet, VecDeque};
use std::hash::BuildHasher;
use std::sync::Arc;

/// Per-key bookkeeping beyond the objects themselves.
pub(crate) const ENTRY_OVERHEAD: usize = 128;

/// One stored variant, with what promotion to disk needs.
pub(crate) struct Slot {
    pub obj: Arc<Object>,
    /// Hits since stored (saturating).
    pub hits: u32,
    /// Written to disk, or queued for it (never queued twice).
    pub on_disk: bool,
}

pub(crate) struct Entry {
    /// Shared with the fill that stored it (one copy of the key).
    pub key: Arc<[u8]>,
    /// One variant inline: most keys have no Vary.
    pub slots: SmallVec<[Slot; 1]>,
    bytes: usize,
    /// S3-FIFO access count, 0..=3.
    freq: u8,
    in_main: bool,
    gen: u64,
}

impl Entry {
    fn size(key: &[u8], slots: &[Slot]) -> usize {
        ENTRY_OVERHEAD + key.len() + slots.iter().map(|s| s.obj.size()).sum::<usize>()
    }
}

/// The S3-FIFO store of one zone (held under the zone's lock).
pub(crate) struct Memory {
    hasher: foldhash::fast::FixedState,
    map: HashMap<u64, Entry, foldhash::fast::FixedState>,
    small: VecDeque<(u64, u64)>,
    main: VecDeque<(u64, u64)>,
    ghost: VecDeque<u64>,
    ghost_set: HashSet<u64, foldhash::fast::FixedState>,
    small_bytes: usize,
    main_bytes: usize,
    objects: usize,
    cap: usize,
    next_gen: u64,
    /// Variants kept per key (`max_variants`): a lookup scans them under
    /// the zone's lock, so a key cannot grow without bound.
    pub max_variants: usize,
}

/// Variants per key unless the zone says otherwise (`max_variants`).
pub const DEFAULT_MAX_VARIANTS: usize = 32;

/// What an insert pushed out: counted by the zone, and dropped by it
/// after the zone's lock is released (freeing an object touches memory
/// gone cold; the other workers need not wait for that).
#[derive(Default)]
pub(crate) struct Evicted {
    pub keys: u64,
    pub entries: SmallVec<[Entry; 2]>,
}

impl Memory {
    pub fn new(cap: usize) -> Memory {
        let hasher = || foldhash::fast::FixedState::with_seed(0x9e37_79b9_7f4a_7c15);
        Memory {
            hasher: hasher(),
            map: HashMap::with_hasher(hasher()),
            small: VecDeque::new(),
            main: VecDeque::new(),
            ghost: VecDeque::new(),
            ghost_set: HashSet::with_hasher(hasher()),
            small_bytes: 0,
            main_bytes: 0,
            objects: 0,
            cap,
            next_gen: 1,
            max_variants: DEFAULT_MAX_VARIANTS,
        }
    }

    pub fn hash(&self, key: &[u8]) -> u64 {
        self.hasher.hash_one(key)
    }

    /// Whether `key` is held, not counted as an access (tag index sweeps).
    pub fn contains(&self, key: &[u8]) -> bool {
        self.map
            .get(&self.hash(key))
            .is_some_and(|e| *e.key == *key)
    }

    /// The entry for `key`, counted as an access.
    pub fn get(&mut self, key: &[u8]) -> Option<&mut Entry> {
        let h = self.hash(key);
        let e = self.map.get_mut(&h)?;
        if *e.key != *key {
            return None;
        }
        e.freq = (e.freq + 1).min(3);
        Some(e)
    }

    /// Add (or replace, by Vary values) a variant of `key`.
    pub fn insert(&mut self, key: Arc<[u8]>, slot: Slot) -> Evicted {
        let h = self.hash(&key);
        let existing = match self.map.get(&h) {
            Some(e) if *e.key == *key => true,
            Some(_) => {
                // A different key with the same 64-bit hash is replaced.
                self.remove_hash(h);
                false
            }
            None => false,
        };
        if existing {
            let max_variants = self.max_variants.max(1);
            if let Some(e) = self.map.get_mut(&h) {
                let before = e.slots.len();
                e.slots.retain(|s| s.obj.vary != slot.obj.vary);
                // Full: the oldest variant makes room for the new one.
                while e.slots.len() >= max_variants {
                    e.slots.remove(0);
                }
                let removed = before - e.slots.len();
                e.slots.push(slot);
                let old = e.bytes;
                e.bytes = Entry::size(&e.key, &e.slots);
                let (new, in_main) = (e.bytes, e.in_main);
                self.objects = self.objects + 1 - removed;
                let q = if in_main {
                    &mut self.main_bytes
                } else {
                    &mut self.small_bytes
                };
                *q = *q + new - old;
            }
        } else {
            let mut slots = SmallVec::new();
            slots.push(slot);
            let bytes = Entry::size(&key, &slots);
            let in_main = self.ghost_set.contains(&h);
            let gen = self.next_gen;
            self.next_gen += 1;
            self.map.insert(
                h,
                Entry {
                    key,
                    slots,
                    bytes,
                    freq: 0,
                    in_main,
                    gen,
                },
            );
            self.objects += 1;
            if in_main {
                self.main.push_back((h, gen));
                self.main_bytes += bytes;
            } else {
                self.small.push_back((h, gen));
                self.small_bytes += bytes;
            }
        }
        self.evict()
    }

    fn remove_hash(&mut self, h: u64) -> Option<Entry> {
        let e = self.map.remove(&h)?;
        if e.in_main {
            self.main_bytes -= e.bytes;
        } else {
            self.small_bytes -= e.bytes;
        }
        self.objects -= e.slots.len();
        self.compact();
        Some(e)
    }

    /// Drop `key` (every variant).
    pub fn remove(&mut self, key: &[u8]) -> Option<Entry> {
        let h = self.hash(key);
        if self.map.get(&h).is_some_and(|e| *e.key == *key) {
            self.remove_hash(h)
        } else {
            None
        }
    }

    /// Drop every key for which `pred` holds; the removed entries.
    pub fn remove_where(&mut self, mut pred: impl FnMut(&[u8]) -> bool) -> Vec<Entry> {
        let hs: Vec<u64> = self
            .map
            .iter()
            .filter(|(_, e)| pred(&e.key))
            .map(|(h, _)| *h)
            .collect();
        hs.into_iter().filter_map(|h| self.remove_hash(h)).collect()
    }

    /// Stale queue items (removed or replaced entries) are dropped once
    /// they outnumber the live ones, so the queues stay bounded by the
    /// number of entries.
    fn compact(&mut self) {
        let live = self.map.len();
        if self.small.len() + self.main.len() > 2 * live + 1024 {
            let map = &self.map;
            let ok = |&(h, g): &(u64, u64)| map.get(&h).is_some_and(|e| e.gen == g);
            self.small.retain(ok);
            self.main.retain(ok);
        }
    }

    fn remember_ghost(&mut self, h: u64) {
        // About as many ghosts as live keys (the paper sizes G like M).
        let cap = self.map.len().max(1024);
        while self.ghost.len() >= cap {
            if let Some(old) = self.ghost.pop_front() {
                self.ghost_set.remove(&old);
            }
        }
        if self.ghost_set.insert(h) {
            self.ghost.push_back(h);
        }
    }

    fn evict(&mut self) -> Evicted {
        let mut out = Evicted::default();
        let small_target = self.cap / 10;
        while self.small_bytes + self.main_bytes > self.cap {
            let from_small = self.small_bytes > small_target || self.main.is_empty();
            if from_small {
                let Some((h, g)) = self.small.pop_front() else {
                    if self.main.is_empty() {
                        break;
                    }
                    self.evict_main(&mut out);
                    continue;
                };
                let Some(e) = self.map.get_mut(&h).filter(|e| e.gen == g && !e.in_main) else {
                    continue;
                };
                if e.freq >= 1 {
                    // Hit while on probation: into main.
                    e.in_main = true;
                    e.freq = 0;
                    let b = e.bytes;
                    self.small_bytes -= b;
                    self.main_bytes += b;
                    self.main.push_back((h, g));
                } else {
                    out.entries.extend(self.remove_hash(h));
                    self.remember_ghost(h);
                    out.keys += 1;
                }
            } else {
                self.evict_main(&mut out);
            }
        }
        out
    }

    fn evict_main(&mut self, out: &mut Evicted) {
        while let Some((h, g)) = self.main.pop_front() {
            let Some(e) = self.map.get_mut(&h).filter(|e| e.gen == g && e.in_main) else {
                continue;
            };
            if e.freq > 0 {
                e.freq -= 1;
                self.main.push_back((h, g));
                continue;
            }
            out.entries.extend(self.remove_hash(h));
            out.keys += 1;
            return;
        }
    }

    /// Objects (variants), keys and bytes stored.
    pub fn usage(&self) -> (usize, usize, usize) {
        (
            self.objects,
            self.map.len(),
            self.small_bytes + self.main_bytes,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;
    use pier_http::Headers;

    fn slot(body: usize) -> Slot {
        Slot {
            obj: Arc::new(Object {
                status: 200,
                headers: Headers::default(),
                body: Bytes::from(vec![b'x'; body]),
                mapped: None,
                lifetime: 60,
                request_time: 0,
                response_time: 0,
                date: 0,
                age_header: 0,
                cc: Default::default(),
                vary: Vec::new(),
                synthetic_lm: false,
            }),
            hits: 0,
            on_disk: false,
        }
    }

    /// Hit ratio of a hot set under a scan of one-hit keys, for S3-FIFO and
    /// (as a reference) for LRU on the same trace and the same bytes.
    #[test]
    fn a_scan_does_not_flush_the_working_set() {
        let cap = 200 * 1_500;
        let mut m = Memory::new(cap);
        let mut lru: lru_ref::Lru = lru_ref::Lru::new(cap);
        let (mut hits, mut lru_hits, mut lookups) = (0, 0, 0);
        let mut scan = 0u64;
        for round in 0..200 {
            // The working set: 100 keys (half the capacity), each read.
            for k in 0..100u64 {
                let key = format!("hot{k}");
                lookups += 1;
                if m.get(key.as_bytes()).is_some() {
                    hits += 1;
                } else {
                    m.insert(Arc::from(key.as_bytes()), slot(1_000));
                }
                if lru.get(&key) {
                    lru_hits += 1;
                } else {
                    lru.insert(key, 1_000 + 128 + 256 + 5);
                }
            }
            // Then a scan: 300 keys never seen again (more than the zone).
            if round % 2 == 1 {
                for _ in 0..300 {
                    scan += 1;
                    let key = format!("scan{scan}");
                    m.insert(Arc::from(key.as_bytes()), slot(1_000));
                    lru.insert(key, 1_000 + 128 + 256 + 5);
                }
            }
            let (_, _, bytes) = m.usage();
            assert!(bytes <= cap, "{bytes} > {cap}");
        }
        let ratio = hits as f64 / lookups as f64;
        let lru_ratio = lru_hits as f64 / lookups as f64;
        assert!(ratio > 0.9, "S3-FIFO hit ratio {ratio}");
        assert!(
            lru_ratio < 0.6,
            "LRU hit ratio {lru_ratio} (the trace must hurt LRU)"
        );
    }

    #[test]
    fn bounded_by_bytes_and_replaced_in_place() {
        let mut m = Memory::new(10_000);
        for i in 0..100 {
            m.insert(Arc::from(format!("k{i}").as_bytes()), slot(500 + i * 7));
            let (n, keys, bytes) = m.usage();
            assert!(bytes <= 10_000, "{bytes}");
            assert_eq!(n, keys);
        }
        // Replacing a variant keeps one object under the key.
        m.insert(Arc::from(&b"r"[..]), slot(100));
        m.insert(Arc::from(&b"r"[..]), slot(200));
        assert_eq!(m.get(b"r").unwrap().slots.len(), 1);
        assert_eq!(m.get(b"r").unwrap().slots[0].obj.body.len(), 200);
        assert!(m.remove(b"r").is_some());
        assert!(m.get(b"r").is_none());
        // Queues stay bounded under churn of one key.
        for _ in 0..10_000 {
            m.insert(Arc::from(&b"churn"[..]), slot(10));
            m.remove(b"churn");
        }
        assert!(m.small.len() + m.main.len() < 2 * m.map.len() + 1100);
    }

    /// A plain LRU of sizes, for comparison only.
    mod lru_ref {
        use std::collections::{BTreeMap, HashMap};
        pub struct Lru {
            cap: usize,
            bytes: usize,
            tick: u64,
            by_key: HashMap<String, (u64, usize)>,
            by_tick: BTreeMap<u64, String>,
        }
        impl Lru {
            pub fn new(cap: usize) -> Lru {
                Lru {
                    cap,
                    bytes: 0,
                    tick: 0,
                    by_key: HashMap::new(),
                    by_tick: BTreeMap::new(),
                }
            }
            pub fn get(&mut self, k: &str) -> bool {
                self.tick += 1;
                let Some((t, _)) = self.by_key.get_mut(k) else {
                    return false;
                };
                self.by_tick.remove(t);
                *t = self.tick;
                self.by_tick.insert(self.tick, k.to_string());
                true
            }
            pub fn insert(&mut self, k: String, size: usize) {
                self.tick += 1;
                self.by_tick.insert(self.tick, k.clone());
                self.by_key.insert(k, (self.tick, size));
                self.bytes += size;
                while self.bytes > self.cap {
                    let Some((_, k)) = self.by_tick.pop_first() else {
                        break;
                    };
                    if let Some((_, s)) = self.by_key.remove(&k) {
                        self.bytes -= s;
                    }
                }
            }
        }
    }
}
