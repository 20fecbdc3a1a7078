//! Selection algorithms through the public API: distribution, skipping
//! unhealthy and tried peers, passive health and the retry budget.

mod common;

use common::upstream;
use pier_config::{Balance, HashKey};
use pier_lb::{clock_ms, extract_hash_key, Group};

fn counts(g: &Group, rounds: usize, tried: &[usize]) -> Vec<usize> {
    let mut c = vec![0; g.peers().len()];
    for _ in 0..rounds {
        c[g.select(None, tried).expect("a peer")] += 1;
    }
    c
}

/// Each count within 10% of the wanted one.
fn assert_near(got: &[usize], want: &[usize]) {
    for (&g, &w) in got.iter().zip(want) {
        let ok = if w == 0 {
            g == 0
        } else {
            g.abs_diff(w) * 10 <= w
        };
        assert!(ok, "got {got:?}, want ~{want:?}");
    }
}

fn hash_group(n: usize) -> Group {
    Group::new(&upstream(
        Balance::Hash(HashKey::Header("x-user".into())),
        &vec![1; n],
    ))
}

// === round robin ===

#[test]
fn round_robin_rotates_evenly() {
    let g = Group::new(&upstream(Balance::RoundRobin, &[1, 1, 1, 1]));
    let seq: Vec<_> = (0..8).map(|_| g.select(None, &[]).unwrap()).collect();
    assert_eq!(seq, [0, 1, 2, 3, 0, 1, 2, 3]);
    assert_eq!(counts(&g, 400, &[]), [100, 100, 100, 100]);
}

#[test]
fn round_robin_skips_unhealthy_and_tried() {
    let g = Group::new(&upstream(Balance::RoundRobin, &[1, 1, 1, 1]));
    g.peers()[1].set_healthy(false);
    // The down peer's share is spread evenly, not handed to its neighbour.
    assert_near(&counts(&g, 6_000, &[]), &[2_000, 0, 2_000, 2_000]);
    assert_near(&counts(&g, 6_000, &[2]), &[3_000, 0, 0, 3_000]);
    assert_eq!(g.select(None, &[0, 2, 3]), None);
    g.peers()[1].set_healthy(true);
    assert_eq!(g.select(None, &[0, 2, 3]), Some(1));
}

// === weighted round robin ===

#[test]
fn weighted_round_robin_is_smooth_and_exact() {
    let g = Group::new(&upstream(Balance::WeightedRoundRobin, &[5, 1, 1]));
    let seq: Vec<_> = (0..7).map(|_| g.select(None, &[]).unwrap()).collect();
    assert_eq!(seq, [0, 0, 1, 0, 2, 0, 0]);
    assert_eq!(counts(&g, 7_000, &[]), [5_000, 1_000, 1_000]);
}

#[test]
fn weighted_round_robin_keeps_proportions_without_a_peer() {
    let g = Group::new(&upstream(Balance::WeightedRoundRobin, &[1, 2, 3, 4]));
    g.peers()[3].set_healthy(false);
    let c = counts(&g, 60_000, &[]);
    assert_eq!(c[3], 0);
    // Remaining weights 1:2:3 -> 10k, 20k, 30k.
    for (got, want) in c.iter().zip([10_000, 20_000, 30_000]) {
        let err = (*got as f64 - want as f64).abs() / want as f64;
        assert!(err < 0.05, "{c:?}");
    }
    let c = counts(&g, 6_000, &[2]);
    assert_eq!(c[2] + c[3], 0);
    assert!(c[1] > c[0] * 3 / 2, "{c:?}");
    assert_eq!(g.select(None, &[0, 1, 2]), None);
}

// === least conn ===

#[test]
fn least_conn_prefers_fewest_active() {
    let g = Group::new(&upstream(Balance::LeastConn, &[1, 1, 1]));
    let _a = [g.begin(0), g.begin(0), g.begin(1)];
    for _ in 0..10 {
        assert_eq!(g.select(None, &[]), Some(2));
    }
    let _b = [g.begin(2), g.begin(2)];
    // active: 2, 1, 2
    assert_eq!(g.select(None, &[]), Some(1));
    assert_eq!(g.select(None, &[1]).map(|i| i != 1), Some(true));
    assert_eq!(g.peers()[0].active(), 2);
}

#[test]
fn least_conn_is_weight_aware() {
    let g = Group::new(&upstream(Balance::LeastConn, &[1, 3]));
    let _a = [g.begin(0), g.begin(1), g.begin(1)];
    // 1/1 vs 2/3: the heavier peer still has room.
    assert_eq!(g.select(None, &[]), Some(1));
    let _b = g.begin(1);
    // 1/1 vs 3/3: a tie, broken at random by weight.
    assert_near(&counts(&g, 4_000, &[]), &[1_000, 3_000]);
}

#[test]
fn idle_least_conn_and_random_two_spread_by_weight() {
    for balance in [Balance::LeastConn, Balance::Random2] {
        let g = Group::new(&upstream(balance, &[1, 3]));
        assert_near(&counts(&g, 8_000, &[]), &[2_000, 6_000]);
    }
    let g = Group::new(&upstream(Balance::LeastConn, &[1, 1, 2]));
    assert_near(&counts(&g, 8_000, &[]), &[2_000, 2_000, 4_000]);
}

#[test]
fn least_conn_ties_spread_and_skip_unhealthy() {
    let g = Group::new(&upstream(Balance::LeastConn, &[1, 1, 1, 1]));
    assert_near(&counts(&g, 8_000, &[]), &[2_000; 4]);
    g.peers()[0].set_healthy(false);
    assert_near(&counts(&g, 6_000, &[3]), &[0, 3_000, 3_000, 0]);
    let _busy = g.begin(2);
    assert_eq!(counts(&g, 10, &[3]), [0, 10, 0, 0]);
}

#[test]
fn guards_count_in_flight() {
    let g = Group::new(&upstream(Balance::LeastConn, &[1, 1]));
    {
        let a = g.begin(1);
        let b = g.begin(1);
        assert_eq!((a.idx(), b.peer().active()), (1, 2));
    }
    assert_eq!(g.peers()[1].active(), 0);
}

// === random two choices ===

#[test]
fn random_two_spreads_when_idle() {
    let g = Group::new(&upstream(Balance::Random2, &[1, 1, 1, 1]));
    for c in counts(&g, 40_000, &[]) {
        assert!((9_000..11_000).contains(&c), "{c}");
    }
}

#[test]
fn random_two_avoids_the_loaded_peer() {
    let g = Group::new(&upstream(Balance::Random2, &[1, 1, 1]));
    let _busy: Vec<_> = (0..10).map(|_| g.begin(0)).collect();
    // Two distinct choices out of three always include a less loaded peer.
    let c = counts(&g, 3_000, &[]);
    assert_eq!(c[0], 0, "{c:?}");
    assert!(c[1] > 1_000 && c[2] > 1_000, "{c:?}");
}

#[test]
fn random_two_skips_unhealthy_and_tried() {
    let g = Group::new(&upstream(Balance::Random2, &[1, 1, 1, 1, 1]));
    g.peers()[1].set_healthy(false);
    g.peers()[3].set_healthy(false);
    let c = counts(&g, 3_000, &[4]);
    assert_eq!((c[1], c[3], c[4]), (0, 0, 0), "{c:?}");
    assert!(c[0] > 1_000 && c[2] > 1_000, "{c:?}");
    assert_eq!(g.select(None, &[0, 2, 4]), None);
    assert_eq!(g.select(None, &[0, 4]), Some(2));
}

// === consistent hash ===

#[test]
fn hash_is_sticky_and_spread() {
    let g = hash_group(5);
    let mut c = [0usize; 5];
    for k in 0..20_000u32 {
        let key = k.to_string();
        let p = g.select(Some(key.as_bytes()), &[]).unwrap();
        assert_eq!(g.select(Some(key.as_bytes()), &[]), Some(p));
        c[p] += 1;
    }
    for n in c {
        assert!((3_000..5_000).contains(&n), "{c:?}");
    }
    let default = g.select(None, &[]).unwrap();
    assert!((0..10).all(|_| g.select(None, &[]) == Some(default)));
    assert_eq!(g.hash_key(), Some(&HashKey::Header("x-user".into())));
}

#[test]
fn hash_down_peer_moves_only_its_keys() {
    let n = 8;
    let g = hash_group(n);
    let keys: Vec<String> = (0..8_000).map(|k| format!("user-{k}")).collect();
    let before: Vec<usize> = keys
        .iter()
        .map(|k| g.select(Some(k.as_bytes()), &[]).unwrap())
        .collect();
    g.peers()[3].set_healthy(false);
    let mut moved = 0;
    let mut spread = vec![0usize; n];
    for (k, &b) in keys.iter().zip(&before) {
        let a = g.select(Some(k.as_bytes()), &[]).unwrap();
        if b == 3 {
            assert_ne!(a, 3);
            moved += 1;
            spread[a] += 1;
        } else {
            assert_eq!(a, b, "a key of a healthy peer moved");
        }
    }
    let frac = moved as f64 / keys.len() as f64;
    assert!((0.08..0.18).contains(&frac), "{frac}");
    // The orphaned keys spread over the others rather than all landing on
    // the ring neighbour.
    assert!(spread.iter().filter(|&&s| s > 0).count() >= 4, "{spread:?}");
}

#[test]
fn hash_removed_peer_remaps_about_one_nth() {
    let n = 10;
    let full = hash_group(n);
    let mut cfg = upstream(Balance::Hash(HashKey::Header("x-user".into())), &vec![1; n]);
    cfg.servers.remove(6);
    let less = Group::new(&cfg);
    let mut moved = 0;
    for k in 0..10_000u32 {
        let key = k.to_le_bytes();
        let a = full.peers()[full.select(Some(&key), &[]).unwrap()].addr;
        let b = less.peers()[less.select(Some(&key), &[]).unwrap()].addr;
        if a != b {
            assert_eq!(a, common::addr(6));
            moved += 1;
        }
    }
    assert!((600..1_400).contains(&moved), "{moved}");
}

#[test]
fn hash_tried_walks_to_next_distinct_peer() {
    let g = hash_group(4);
    let key = Some(&b"abc"[..]);
    let first = g.select(key, &[]).unwrap();
    let second = g.select(key, &[first]).unwrap();
    assert_ne!(first, second);
    let third = g.select(key, &[first, second]).unwrap();
    assert!(third != first && third != second);
    // Deterministic: the same walk every time.
    assert_eq!(g.select(key, &[first]), Some(second));
    let fourth = g.select(key, &[first, second, third]).unwrap();
    assert_eq!(g.select(key, &[first, second, third, fourth]), None);
}

#[test]
fn hash_key_from_cookie() {
    let g = Group::new(&upstream(
        Balance::Hash(HashKey::Cookie("sid".into())),
        &[1, 1, 1],
    ));
    let cookie: &[u8] = b"theme=dark; sid=u-77";
    let key = extract_hash_key(
        g.hash_key().unwrap(),
        |h| (h == "cookie").then_some(cookie),
        b"127.0.0.1",
        b"/",
    );
    assert_eq!(key, Some(&b"u-77"[..]));
    assert_eq!(g.select(key, &[]), g.select(Some(b"u-77"), &[]));
}

// === edge cases ===

#[test]
fn empty_and_all_down_give_none() {
    for balance in [
        Balance::RoundRobin,
        Balance::WeightedRoundRobin,
        Balance::LeastConn,
        Balance::Random2,
        Balance::Hash(HashKey::Path),
    ] {
        let g = Group::new(&upstream(balance.clone(), &[]));
        assert_eq!(g.select(Some(b"k"), &[]), None, "{balance:?}");
        let g = Group::new(&upstream(balance.clone(), &[1, 2, 3]));
        for p in g.peers() {
            p.set_healthy(false);
        }
        assert_eq!(g.select(Some(b"k"), &[]), None, "{balance:?}");
        for p in g.peers() {
            p.set_healthy(true);
        }
        assert_eq!(g.select(Some(b"k"), &[0, 1, 2]), None, "{balance:?}");
        assert!(g.select(Some(b"k"), &[0, 2]) == Some(1), "{balance:?}");
    }
}

#[test]
fn zero_weight_counts_as_one() {
    let g = Group::new(&upstream(Balance::WeightedRoundRobin, &[0, 1]));
    assert_eq!(g.peers()[0].weight, 1);
    assert_eq!(counts(&g, 100, &[]), [50, 50]);
}

// === passive health ===

#[test]
fn passive_marks_down_after_max_fails_then_probes() {
    let g = Group::new(&upstream(Balance::RoundRobin, &[1, 1])); // max_fails 3, recover 10 s
    let t = clock_ms();
    g.report(0, false, t);
    g.report(0, false, t);
    assert!(g.peers()[0].is_healthy());
    g.report(0, true, t); // a success resets the streak
    assert_eq!(g.peers()[0].consecutive_fails(), 0);
    for _ in 0..3 {
        g.report(0, false, t);
    }
    assert!(!g.peers()[0].is_healthy());
    assert_eq!(g.peers()[0].fails_total(), 5);
    for _ in 0..10 {
        assert_eq!(g.select_at(None, &[], t + 9_999), Some(1));
    }
    // After passive_recover exactly one request is let through...
    assert_eq!(g.select_at(None, &[1], t + 10_000), Some(0));
    assert_eq!(g.select_at(None, &[1], t + 10_001), None);
    // ...and its failure keeps the peer down for another period.
    g.report(0, false, t + 10_050);
    assert!(!g.peers()[0].is_healthy());
    assert_eq!(g.select_at(None, &[1], t + 20_000), None);
    assert_eq!(g.select_at(None, &[1], t + 20_050), Some(0));
    g.report(0, true, t + 20_060);
    assert!(g.peers()[0].is_healthy());
    assert_eq!(g.peers()[0].consecutive_fails(), 0);
    assert_eq!(counts(&g, 10, &[]), [5, 5]);
}

#[test]
fn passive_probe_is_taken_first_by_scanning_algorithms() {
    let g = Group::new(&upstream(Balance::LeastConn, &[1, 1, 1]));
    let t = clock_ms();
    for _ in 0..3 {
        g.report(2, false, t);
    }
    // The probe goes first: least_conn returns it as soon as its scan meets
    // the peer whose recovery deadline passed...
    assert_eq!(g.select_at(None, &[], t + 10_000), Some(2));
    // ...and only once per period.
    for _ in 0..20 {
        assert_ne!(g.select_at(None, &[], t + 10_001), Some(2));
    }
}

#[test]
fn passive_without_probe_when_active_check_configured() {
    let mut cfg = upstream(Balance::RoundRobin, &[1, 1]);
    cfg.health_check = Some(pier_config::HealthCheck {
        kind: pier_config::HealthKind::Tcp,
        interval: std::time::Duration::from_secs(5),
        timeout: std::time::Duration::from_secs(1),
        rise: 2,
        fall: 3,
    });
    let g = Group::new(&cfg);
    let t = clock_ms();
    for _ in 0..3 {
        g.report(1, false, t);
    }
    assert!(!g.peers()[1].is_healthy());
    assert_eq!(g.select_at(None, &[0], t + 1_000_000), None);
    g.report(1, true, t);
    assert!(
        !g.peers()[1].is_healthy(),
        "only the active check brings it back"
    );
}

#[test]
fn passive_off_with_zero_max_fails() {
    let mut cfg = upstream(Balance::RoundRobin, &[1]);
    cfg.max_fails = 0;
    let g = Group::new(&cfg);
    for _ in 0..100 {
        g.report(0, false, clock_ms());
    }
    assert!(g.peers()[0].is_healthy());
    assert_eq!(g.peers()[0].fails_total(), 100);
    g.report(7, false, 0); // unknown index: ignored
}

#[test]
fn forced_down_peer_is_not_probed() {
    let g = Group::new(&upstream(Balance::RoundRobin, &[1, 1]));
    g.peers()[0].set_healthy(false);
    assert_eq!(g.select_at(None, &[1], u64::MAX - 1), None);
}

// === retry budget ===

#[test]
fn retry_budget_through_group() {
    let g = Group::new(&upstream(Balance::RoundRobin, &[1, 1])); // 0.2, 10/s
    assert_eq!(g.retries(), 2);
    let t = 1_000_000;
    for _ in 0..1_000 {
        g.on_request_at(t);
    }
    // 0.2 * 1000 + 10 * 10 s reserve.
    assert_eq!((0..1_000).filter(|_| g.try_retry_at(t)).count(), 300);
    g.on_request();
    let _ = g.try_retry();
}

// === max connections, reload ===

#[test]
fn full_peers_are_skipped() {
    for balance in [
        Balance::RoundRobin,
        Balance::WeightedRoundRobin,
        Balance::LeastConn,
        Balance::Random2,
        Balance::Hash(HashKey::ClientIp),
    ] {
        let mut cfg = upstream(balance.clone(), &[1, 1, 1]);
        cfg.max_connections_per_server = 2;
        let g = Group::new(&cfg);
        let _full = [g.begin(1), g.begin(1)];
        for k in 0..300u32 {
            let p = g.select(Some(&k.to_le_bytes()), &[]).unwrap();
            assert_ne!(p, 1, "{balance:?}");
        }
        let _more = [g.begin(0), g.begin(0), g.begin(2), g.begin(2)];
        assert_eq!(g.select(Some(b"k"), &[]), None, "{balance:?}");
        drop(_more);
        assert!(g.select(Some(b"k"), &[]).is_some(), "{balance:?}");
    }
}

#[test]
fn reload_keeps_state_of_unchanged_servers() {
    let old = Group::new(&upstream(Balance::RoundRobin, &[1, 1, 1]));
    let t = clock_ms();
    for _ in 0..3 {
        old.report(0, false, t);
    }
    old.peers()[2].set_healthy(false);
    let in_flight = old.begin(1);

    // Server 2 changes weight, server 3 is new.
    let mut cfg = upstream(Balance::WeightedRoundRobin, &[1, 1, 5, 1]);
    cfg.name = "app".into();
    let new = Group::reload(&cfg, &old);
    assert!(std::sync::Arc::ptr_eq(&old.peers()[0], &new.peers()[0]));
    assert!(!new.peers()[0].is_healthy());
    assert_eq!(new.peers()[1].active(), 1, "in-flight count carried over");
    drop(in_flight);
    assert_eq!(new.peers()[1].active(), 0);
    assert_eq!(new.peers()[2].weight, 5);
    assert!(
        !new.peers()[2].is_healthy(),
        "down state kept across a weight change"
    );
    assert!(new.peers()[3].is_healthy());
    for _ in 0..20 {
        let p = new.select_at(None, &[], t).unwrap();
        assert!(p == 1 || p == 3, "{p}");
    }
}

#[test]
fn bounded_loads_pass_an_overloaded_owner_over_and_keep_keys_below_the_bound() {
    let g = Group::new(&upstream(Balance::Hash(HashKey::Path), &[1, 1, 1, 1]));
    let now = clock_ms();
    let key: &[u8] = b"http://shop.example/hot";
    let owner = g.select_at(Some(key), &[], now).unwrap();
    // Below the bound (the floor here), the owner takes every request.
    let mut held = Vec::new();
    for _ in 0..4 {
        assert_eq!(g.select_bounded(Some(key), &[], now, 1.25, 4), Some(owner));
        held.push(g.begin(owner));
    }
    // At 4 in flight on the owner and none elsewhere: the average with
    // this request is 5/4, the bound max(ceil(1.25 x 1.25), 4) = 4, so the
    // next goes to the next peer on the ring, the one a failure would move
    // the key to.
    let next = g.select_at(Some(key), &[owner], now).unwrap();
    assert_eq!(g.select_bounded(Some(key), &[], now, 1.25, 4), Some(next));
    // Load spread out again: back to the owner.
    held.clear();
    assert_eq!(g.select_bounded(Some(key), &[], now, 1.25, 4), Some(owner));
    // Other keys keep their owners while the bound is not reached.
    for i in 0..200u32 {
        let k = format!("/k/{i}");
        assert_eq!(
            g.select_bounded(Some(k.as_bytes()), &[], now, 1.25, 4),
            g.select_at(Some(k.as_bytes()), &[], now)
        );
    }
}
