//! Ketama-style consistent-hash ring, built once per group.
//!
//! Each peer owns `160 * weight` points placed by hashing `"<addr>-<n>"`, so
//! a peer's points depend only on its own address: adding or removing one of
//! N peers moves only the keys that land on its points (~1/N of them), and
//! every Pier instance with the same upstream list maps a key the same way.

use std::net::SocketAddr;

/// Virtual nodes per unit of weight (ketama uses 160 too).
pub(crate) const POINTS_PER_WEIGHT: u64 = 160;
/// Bound on ring size (8 bytes a point: 8 MiB) whatever the weights are.
const MAX_POINTS: u64 = 1 << 20;

/// A stable 64-bit hash: FNV-1a for the bytes, murmur3's fmix64 finalizer
/// for avalanche. Stable across builds and Rust versions (unlike std's
/// `DefaultHasher`), which a consistent-hash ring shared by several proxy
/// instances requires.
pub(crate) fn hash64(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in bytes {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    fmix64(h)
}

pub(crate) fn fmix64(mut h: u64) -> u64 {
    h ^= h >> 33;
    h = h.wrapping_mul(0xff51_afd7_ed55_8ccd);
    h ^= h >> 33;
    h = h.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    h ^= h >> 33;
    h
}

/// The ring position of a request key.
pub(crate) fn key_point(key: Option<&[u8]>) -> u32 {
    (hash64(key.unwrap_or(b"")) >> 32) as u32
}

#[derive(Debug)]
pub(crate) struct Ring {
    /// (point, peer index), sorted by point.
    points: Vec<(u32, u32)>,
    peers: usize,
}

impl Ring {
    pub(crate) fn new(peers: &[(SocketAddr, u32)]) -> Ring {
        let total: u64 = peers
            .iter()
            .map(|&(_, w)| u64::from(w.max(1)) * POINTS_PER_WEIGHT)
            .sum();
        let mut points = Vec::with_capacity(total.min(MAX_POINTS) as usize + peers.len());
        let mut buf = Vec::with_capacity(64);
        for (idx, &(addr, w)) in peers.iter().enumerate() {
            let mut n = u64::from(w.max(1)) * POINTS_PER_WEIGHT;
            if total > MAX_POINTS {
                n = (n * MAX_POINTS / total).max(1);
            }
            buf.clear();
            // Build time only: formatting here is fine.
            buf.extend_from_slice(addr.to_string().as_bytes());
            buf.push(b'-');
            let base = buf.len();
            for v in 0..n {
                buf.truncate(base);
                buf.extend_from_slice(v.to_string().as_bytes());
                points.push(((hash64(&buf) >> 32) as u32, idx as u32));
            }
        }
        points.sort_unstable();
        Ring {
            points,
            peers: peers.len(),
        }
    }

    /// Walk clockwise from `point` and return the first peer for which
    /// `eligible` is true, checking each distinct peer at most once when the
    /// group is small enough for a bitmask (and stopping once all were seen).
    pub(crate) fn walk(
        &self,
        point: u32,
        mut eligible: impl FnMut(usize) -> bool,
    ) -> Option<usize> {
        let len = self.points.len();
        if len == 0 {
            return None;
        }
        let start = self.points.partition_point(|&(p, _)| p < point);
        let track = self.peers <= 64;
        let mut seen: u64 = 0;
        let mut seen_count = 0;
        let mut last = u32::MAX;
        for i in 0..len {
            let idx = self.points[(start + i) % len].1;
            if idx == last {
                continue;
            }
            last = idx;
            if track {
                let bit = 1u64 << idx;
                if seen & bit != 0 {
                    continue;
                }
                seen |= bit;
                seen_count += 1;
            }
            if eligible(idx as usize) {
                return Some(idx as usize);
            }
            if track && seen_count == self.peers {
                return None;
            }
        }
        None
    }

    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.points.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addrs(n: usize) -> Vec<(SocketAddr, u32)> {
        (0..n)
            .map(|i| (SocketAddr::from(([10, 0, 0, i as u8 + 1], 8080)), 1))
            .collect()
    }

    fn lookup(ring: &Ring, key: &[u8]) -> usize {
        ring.walk(key_point(Some(key)), |_| true).unwrap()
    }

    #[test]
    fn hash_is_stable() {
        // Pinned values: a change here silently remaps every user's keys.
        assert_eq!(hash64(b""), fmix64(0xcbf2_9ce4_8422_2325));
        assert_eq!(hash64(b"a"), hash64(b"a"));
        assert_ne!(hash64(b"a"), hash64(b"b"));
    }

    #[test]
    fn points_follow_weight() {
        let mut a = addrs(3);
        a[1].1 = 3;
        let ring = Ring::new(&a);
        assert_eq!(ring.len() as u64, 5 * POINTS_PER_WEIGHT);
        let mut counts = [0usize; 3];
        for &(_, idx) in &ring.points {
            counts[idx as usize] += 1;
        }
        assert_eq!(counts, [160, 480, 160]);
    }

    #[test]
    fn ring_is_capped() {
        let a: Vec<_> = (0..10)
            .map(|i| (SocketAddr::from(([10, 0, 1, i as u8], 80)), 100_000))
            .collect();
        let ring = Ring::new(&a);
        assert!(ring.len() as u64 <= MAX_POINTS + 10);
    }

    #[test]
    fn keys_spread_evenly() {
        let ring = Ring::new(&addrs(5));
        let mut counts = [0usize; 5];
        for k in 0..50_000u32 {
            counts[lookup(&ring, &k.to_le_bytes())] += 1;
        }
        for c in counts {
            // 10_000 expected; 160 points per peer keeps the spread within ~15%.
            assert!((8_000..12_000).contains(&c), "{counts:?}");
        }
    }

    #[test]
    fn removing_a_peer_remaps_about_one_nth() {
        let n = 10;
        let full = addrs(n);
        let ring_full = Ring::new(&full);
        let removed = 4;
        let less: Vec<_> = full
            .iter()
            .enumerate()
            .filter(|&(i, _)| i != removed)
            .map(|(_, a)| *a)
            .collect();
        let ring_less = Ring::new(&less);
        let keys = 20_000u32;
        let mut moved = 0;
        for k in 0..keys {
            let key = k.to_be_bytes();
            let before = full[lookup(&ring_full, &key)].0;
            let after = less[lookup(&ring_less, &key)].0;
            if before != after {
                // Only keys of the removed peer may move.
                assert_eq!(before, full[removed].0);
                moved += 1;
            }
        }
        let frac = moved as f64 / f64::from(keys);
        assert!((0.06..0.14).contains(&frac), "moved {frac}");
    }

    #[test]
    fn walk_skips_ineligible_and_stops() {
        let ring = Ring::new(&addrs(4));
        let first = lookup(&ring, b"k");
        let mut checked = Vec::new();
        let got = ring.walk(key_point(Some(b"k")), |i| {
            checked.push(i);
            i != first
        });
        assert!(got.is_some() && got != Some(first));
        assert_eq!(checked[0], first);
        let mut calls = 0;
        assert_eq!(
            ring.walk(key_point(Some(b"k")), |_| {
                calls += 1;
                false
            }),
            None
        );
        assert_eq!(calls, 4, "each peer checked once");
    }
}
