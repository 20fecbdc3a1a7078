//! Many threads selecting from one shared group at once: no lost or
//! duplicated picks, exact shares where the algorithm promises them, and
//! in-flight counts back to zero.

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Barrier};
use std::thread;

use common::upstream;
use pier_config::{Balance, HashKey};
use pier_lb::{clock_ms, Group};

const THREADS: usize = 8;
const PER_THREAD: usize = 20_000;

/// Run `THREADS` threads doing `PER_THREAD` selections each; returns the
/// per-peer totals.
fn hammer(g: &Arc<Group>, key_of: fn(usize, usize) -> u64, hold: bool) -> Vec<usize> {
    let n = g.peers().len();
    let totals: Arc<Vec<AtomicUsize>> = Arc::new((0..n).map(|_| AtomicUsize::new(0)).collect());
    let start = Arc::new(Barrier::new(THREADS));
    let handles: Vec<_> = (0..THREADS)
        .map(|t| {
            let (g, totals, start) = (g.clone(), totals.clone(), start.clone());
            thread::spawn(move || {
                let mut local = vec![0usize; n];
                start.wait();
                for i in 0..PER_THREAD {
                    let key = key_of(t, i).to_le_bytes();
                    let idx = g.select(Some(&key), &[]).expect("all peers up");
                    let guard = hold.then(|| g.begin(idx));
                    local[idx] += 1;
                    drop(guard);
                }
                for (total, l) in totals.iter().zip(local) {
                    total.fetch_add(l, Ordering::Relaxed);
                }
            })
        })
        .collect();
    for h in handles {
        h.join().unwrap();
    }
    totals.iter().map(|t| t.load(Ordering::Relaxed)).collect()
}

fn no_key(_: usize, _: usize) -> u64 {
    0
}

#[test]
fn round_robin_exact_under_contention() {
    let g = Arc::new(Group::new(&upstream(Balance::RoundRobin, &[1, 1, 1, 1])));
    let c = hammer(&g, no_key, false);
    // Every counter value is handed out once, so shares are exact.
    assert_eq!(c, vec![THREADS * PER_THREAD / 4; 4]);
}

#[test]
fn weighted_exact_under_contention() {
    let g = Arc::new(Group::new(&upstream(
        Balance::WeightedRoundRobin,
        &[1, 3, 4],
    )));
    let c = hammer(&g, no_key, false);
    let unit = THREADS * PER_THREAD / 8;
    assert_eq!(c, vec![unit, 3 * unit, 4 * unit]);
}

#[test]
fn least_conn_and_random_two_balance_and_release() {
    for balance in [Balance::LeastConn, Balance::Random2] {
        let g = Arc::new(Group::new(&upstream(balance.clone(), &[1, 1, 1])));
        let c = hammer(&g, no_key, true);
        assert_eq!(c.iter().sum::<usize>(), THREADS * PER_THREAD);
        // Shares are not tested for evenness here: a thread descheduled
        // while holding a guard really does make its peer the busiest one
        // (select.rs tests the distributions deterministically).
        let fair = THREADS * PER_THREAD / 3;
        for &n in &c {
            assert!(n > fair / 10, "{balance:?} starved a peer: {c:?}");
        }
        for p in g.peers() {
            assert_eq!(p.active(), 0, "{balance:?}: every guard released");
        }
    }
}

#[test]
fn hash_consistent_across_threads() {
    let g = Arc::new(Group::new(&upstream(
        Balance::Hash(HashKey::ClientIp),
        &[1, 1, 1, 1, 1],
    )));
    // Every thread hashes the same key sequence: each key must land on the
    // same peer everywhere, so each total is a multiple of THREADS.
    let c = hammer(&g, |_, i| i as u64, false);
    assert_eq!(c.iter().sum::<usize>(), THREADS * PER_THREAD);
    for n in &c {
        assert_eq!(n % THREADS, 0, "{c:?}");
    }
}

#[test]
fn passive_probe_granted_once_across_threads() {
    let g = Arc::new(Group::new(&upstream(Balance::RoundRobin, &[1, 1])));
    let t0 = clock_ms();
    for _ in 0..3 {
        g.report(0, false, t0);
    }
    assert!(!g.peers()[0].is_healthy());
    let due = t0 + 10_000;
    let start = Arc::new(Barrier::new(THREADS));
    let probes: usize = (0..THREADS)
        .map(|_| {
            let (g, start) = (g.clone(), start.clone());
            thread::spawn(move || {
                start.wait();
                (0..1_000)
                    .filter(|_| g.select_at(None, &[], due) == Some(0))
                    .count()
            })
        })
        .collect::<Vec<_>>()
        .into_iter()
        .map(|h| h.join().unwrap())
        .sum();
    assert_eq!(probes, 1, "exactly one request probes the down peer");
}

/// `try_begin` is an exact cap: threads racing for the last slots of a peer
/// never hold more than the cap at once.
#[test]
fn try_begin_never_exceeds_the_cap() {
    let mut cfg = upstream(Balance::RoundRobin, &[1]);
    cfg.max_connections_per_server = 3;
    let g = Arc::new(Group::new(&cfg));
    let held = Arc::new(AtomicUsize::new(0));
    let peak = Arc::new(AtomicUsize::new(0));
    let start = Arc::new(Barrier::new(THREADS));
    let handles: Vec<_> = (0..THREADS)
        .map(|_| {
            let (g, held, peak, start) = (g.clone(), held.clone(), peak.clone(), start.clone());
            thread::spawn(move || {
                start.wait();
                let mut got = 0;
                for _ in 0..PER_THREAD {
                    // The smaller of the two caps applies (here the group's 3).
                    if let Some(guard) = g.try_begin(0, 5) {
                        let now = held.fetch_add(1, Ordering::SeqCst) + 1;
                        peak.fetch_max(now, Ordering::SeqCst);
                        held.fetch_sub(1, Ordering::SeqCst);
                        drop(guard);
                        got += 1;
                    }
                }
                got
            })
        })
        .collect();
    let got: usize = handles.into_iter().map(|h| h.join().unwrap()).sum();
    assert!(got > 0);
    assert!(peak.load(Ordering::SeqCst) <= 3, "peak {peak:?}");
    assert_eq!(g.peers()[0].active(), 0);
    // Uncapped: always granted; extra cap alone applies when the group has none.
    let mut cfg = upstream(Balance::RoundRobin, &[1]);
    cfg.max_connections_per_server = 0;
    let g = Group::new(&cfg);
    let a = g.try_begin(0, 1).expect("first");
    assert!(g.try_begin(0, 1).is_none(), "extra cap of 1");
    let b = g.try_begin(0, 0).expect("no cap");
    drop((a, b));
    assert_eq!(g.peers()[0].active(), 0);
}
