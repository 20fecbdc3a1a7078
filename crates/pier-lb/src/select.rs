//! The selection algorithms. Each takes an `avail` callback that says
//! whether a peer may take this attempt (healthy and not yet tried, or a
//! down peer whose passive-recovery probe has just been claimed).

use std::cell::Cell;
use std::collections::hash_map::RandomState;
use std::hash::BuildHasher;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use crate::peer::Peer;
use crate::ring::Ring;

/// Whether a peer can take the current attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Avail {
    No,
    Up,
    /// Down, but the passive-recovery probe slot was claimed for this
    /// attempt: the caller must use this peer (the slot is now spent).
    Probe,
}

#[derive(Debug)]
pub(crate) enum Selector {
    RoundRobin,
    /// Precomputed smooth-WRR schedule of peer indices.
    Weighted(Vec<u32>),
    LeastConn,
    /// With a weight schedule to draw from when weights differ.
    Random2(Option<Vec<u32>>),
    Hash(Ring),
}

/// Longest weighted schedule; larger weight sums are scaled down to it.
const MAX_SCHEDULE: u64 = 1 << 16;

/// nginx's smooth weighted round robin, run once: every peer gains its
/// weight, the richest is picked and pays the total. The result interleaves
/// peers (5,1,1 gives a a b a c a a, not a a a a a b c) and has each peer
/// exactly `weight` times per `sum(weights)` slots (weights reduced by their
/// gcd first, so 100/200 is a 3-slot schedule).
pub(crate) fn smooth_schedule(weights: &[u32]) -> Vec<u32> {
    if weights.is_empty() {
        return Vec::new();
    }
    let g = weights
        .iter()
        .fold(0u64, |g, &w| gcd(g, u64::from(w.max(1))));
    let mut w: Vec<u64> = weights.iter().map(|&x| u64::from(x.max(1)) / g).collect();
    let mut total: u64 = w.iter().sum();
    if total > MAX_SCHEDULE {
        for x in &mut w {
            *x = (*x * MAX_SCHEDULE / total).max(1);
        }
        total = w.iter().sum();
    }
    let mut current = vec![0i64; w.len()];
    let mut out = Vec::with_capacity(total as usize);
    for _ in 0..total {
        let mut best = 0;
        for i in 0..w.len() {
            current[i] += w[i] as i64;
            if current[i] > current[best] {
                best = i;
            }
        }
        current[best] -= total as i64;
        out.push(best as u32);
    }
    out
}

fn gcd(a: u64, b: u64) -> u64 {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

// === thread-local xorshift ===

thread_local! {
    // Seeded from std's per-thread random hasher keys: no lock, no syscall
    // after the first use on a thread.
    static RNG: Cell<u64> = Cell::new(RandomState::new().hash_one(0x5eed_u64) | 1);
}

/// xorshift64: a few cycles, good enough to spread load.
fn xorshift(mut x: u64) -> u64 {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    x
}

pub(crate) fn rand_u64() -> u64 {
    RNG.with(|c| {
        let x = xorshift(c.get());
        c.set(x);
        x
    })
}

/// Map a random value to `0..n` (n < 2^32) without a division.
fn scale(r: u64, n: usize) -> usize {
    (((r >> 32) * n as u64) >> 32) as usize
}

/// Uniform-enough value in `0..n` (n < 2^32).
pub(crate) fn rand_below(n: usize) -> usize {
    scale(rand_u64(), n)
}

// === algorithms ===

/// `a` carries less load than `b` (active / weight, compared without division).
fn lighter(a: &Peer, b: &Peer) -> bool {
    (a.active() as u64) * u64::from(b.weight) < (b.active() as u64) * u64::from(a.weight)
}

pub(crate) fn round_robin(
    n: usize,
    counter: &AtomicUsize,
    mut avail: impl FnMut(usize) -> Avail,
) -> Option<usize> {
    let idx = counter.fetch_add(1, Ordering::Relaxed) % n;
    if avail(idx) != Avail::No {
        return Some(idx);
    }
    // Not "the next one": that would hand a down peer's whole share to its
    // neighbour. Random re-draws spread it evenly over the rest.
    for _ in 0..2 * n {
        let idx = rand_below(n);
        if avail(idx) != Avail::No {
            return Some(idx);
        }
    }
    (0..n)
        .map(|i| (idx + 1 + i) % n)
        .find(|&i| avail(i) != Avail::No)
}

pub(crate) fn weighted(
    schedule: &[u32],
    n: usize,
    counter: &AtomicUsize,
    mut avail: impl FnMut(usize) -> Avail,
) -> Option<usize> {
    let len = schedule.len();
    let pos = counter.fetch_add(1, Ordering::Relaxed) % len;
    let idx = schedule[pos] as usize;
    if avail(idx) != Avail::No {
        return Some(idx);
    }
    // Rejection sampling over the schedule keeps the remaining peers in
    // proportion to their weights (walking on to the next slot would hand
    // the skipped peer's share to whichever peer follows it).
    for _ in 0..2 * n {
        let idx = schedule[rand_below(len)] as usize;
        if avail(idx) != Avail::No {
            return Some(idx);
        }
    }
    // Most peers are out: a bounded plain scan decides.
    (0..n)
        .map(|i| (idx + 1 + i) % n)
        .find(|&i| avail(i) != Avail::No)
}

/// Least `active / weight`. Ties (an idle group has nothing but ties) are
/// broken by weighted reservoir sampling, so an idle group still spreads by
/// weight (as nginx breaks ties by weighted round robin). A rotating start
/// instead would give a skipped peer's share to the one after it, and need
/// a counter every core writes to.
pub(crate) fn least_conn(
    peers: &[Arc<Peer>],
    mut avail: impl FnMut(usize) -> Avail,
) -> Option<usize> {
    let mut best: Option<usize> = None;
    // The best peer's load, kept in registers: active / weight.
    let (mut best_active, mut best_weight) = (0u64, 1u64);
    let mut tie_weight = 0u64;
    // One thread-local read per selection; ties step a local xorshift.
    let mut rng = rand_u64();
    for (idx, p) in peers.iter().enumerate() {
        match avail(idx) {
            Avail::No => continue,
            Avail::Probe => return Some(idx),
            Avail::Up => {}
        }
        let active = p.active() as u64;
        let weight = u64::from(p.weight);
        // active/weight vs best_active/best_weight without dividing.
        let (lhs, rhs) = (active * best_weight, best_active * weight);
        if best.is_none() || lhs < rhs {
            best = Some(idx);
            (best_active, best_weight, tie_weight) = (active, weight, weight);
        } else if lhs == rhs {
            // Equal load: after k ties each is kept with probability
            // weight / (sum of their weights).
            tie_weight += weight;
            rng = xorshift(rng);
            if (scale(rng, tie_weight as usize) as u64) < weight {
                best = Some(idx);
                (best_active, best_weight) = (active, weight);
            }
        }
    }
    best
}

/// Power of two random choices: draw two distinct peers (in proportion to
/// weight when the group has a `schedule`, i.e. unequal weights) and keep
/// the one with less `active / weight`. Falls back to a least-conn scan
/// when neither can take the attempt.
pub(crate) fn random_two(
    peers: &[Arc<Peer>],
    schedule: Option<&[u32]>,
    mut avail: impl FnMut(usize) -> Avail,
) -> Option<usize> {
    let n = peers.len();
    if n == 1 {
        return (avail(0) != Avail::No).then_some(0);
    }
    let draw = || match schedule {
        Some(s) => s[rand_below(s.len())] as usize,
        None => rand_below(n),
    };
    let a = draw();
    let mut b = draw();
    // A heavy peer is often drawn twice; a few re-draws, then any other.
    for _ in 0..3 {
        if b != a {
            break;
        }
        b = draw();
    }
    if b == a {
        b = rand_below(n - 1);
        if b >= a {
            b += 1;
        }
    }
    let av = avail(a);
    if av == Avail::Probe {
        return Some(a);
    }
    let bv = avail(b);
    match (av, bv) {
        (_, Avail::Probe) => Some(b),
        (Avail::Up, Avail::Up) => Some(if lighter(&peers[b], &peers[a]) { b } else { a }),
        (Avail::Up, _) => Some(a),
        (_, Avail::Up) => Some(b),
        _ => least_conn(peers, avail),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn smooth_schedule_interleaves() {
        let s = smooth_schedule(&[5, 1, 1]);
        assert_eq!(s, vec![0, 0, 1, 0, 2, 0, 0]);
    }

    #[test]
    fn smooth_schedule_reduces_by_gcd_and_counts_weights() {
        let s = smooth_schedule(&[100, 200, 300]);
        assert_eq!(s.len(), 6);
        let s = smooth_schedule(&[3, 7, 1, 4]);
        assert_eq!(s.len(), 15);
        for (i, w) in [3, 7, 1, 4].into_iter().enumerate() {
            assert_eq!(s.iter().filter(|&&x| x as usize == i).count(), w);
        }
        // No peer with weight < total/2 appears twice in a row.
        for win in s.windows(2) {
            assert!(!(win[0] == win[1] && win[0] != 1), "{s:?}");
        }
    }

    #[test]
    fn smooth_schedule_is_bounded() {
        let s = smooth_schedule(&[1_000_000, 999_999, 3]);
        assert!(s.len() as u64 <= MAX_SCHEDULE + 3);
        assert!(s.contains(&2), "small weight still gets a slot");
    }

    #[test]
    fn rand_below_covers_range() {
        let mut seen = [0usize; 7];
        for _ in 0..7_000 {
            seen[rand_below(7)] += 1;
        }
        for c in seen {
            assert!((700..1300).contains(&c), "{seen:?}");
        }
    }
}
