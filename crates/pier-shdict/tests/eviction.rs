//! LRU eviction, the forcible flag, safe_* and capacity bounds.

use pier_shdict::{entry_size, HitValue, IncrError, SetResult, SharedDict, Value, ENTRY_OVERHEAD};

const T0: u64 = 5_000;

fn key(i: u32) -> Vec<u8> {
    format!("k{i}").into_bytes()
}

/// A one-shard dict holding exactly `n` number entries with 2-byte keys.
fn dict_for(n: usize) -> SharedDict {
    let one = entry_size(b"k0", &Value::Number(0.0));
    assert_eq!(one, 2 + 8 + ENTRY_OVERHEAD);
    SharedDict::with_shards("lru", one * n, 1)
}

fn live(d: &SharedDict, k: &[u8], now: u64) -> bool {
    d.get(k, now, &mut Vec::new()).is_some()
}

#[test]
fn evicts_least_recently_used_and_reports_forcible() {
    let d = dict_for(5);
    for i in 0..5 {
        assert_eq!(
            d.set(&key(i), Value::Number(f64::from(i)), 0, 0, T0),
            SetResult::Stored
        );
    }
    assert_eq!(d.free_space(), 0);
    // Reads, incr and replace all refresh recency (order shown newest first).
    assert!(live(&d, b"k0", T0)); // order (new..old): k0 k4 k3 k2 k1
    d.incr(b"k2", 1.0, None, 0, T0).unwrap(); // k2 k0 k4 k3 k1
    assert_eq!(
        d.replace(b"k3", Value::Number(9.0), 0, 0, T0),
        SetResult::Stored
    ); // k3 k2 k0 k4 k1

    assert_eq!(
        d.set(b"k5", Value::Number(5.0), 0, 0, T0),
        SetResult::StoredEvicted
    );
    assert!(!live(&d, b"k1", T0), "k1 was least recently used");
    assert_eq!(
        d.set(b"k6", Value::Number(6.0), 0, 0, T0),
        SetResult::StoredEvicted
    );
    assert!(!live(&d, b"k4", T0), "then k4");
    for k in ["k0", "k2", "k3", "k5", "k6"] {
        assert!(live(&d, k.as_bytes(), T0), "{k} survives");
    }
    assert!(SetResult::StoredEvicted.forcible());
    assert!(SetResult::StoredEvicted.is_ok());
    d.check_invariants().unwrap();
}

#[test]
fn ttl_ms_and_get_keys_do_not_refresh_recency() {
    let d = dict_for(3);
    for i in 0..3 {
        d.set(&key(i), Value::Number(0.0), 0, 0, T0);
    }
    // Neither touches k0: it stays the victim.
    assert_eq!(d.get_keys(0, T0).len(), 3);
    assert_eq!(d.ttl(b"k0", T0), Some(None));
    d.set(b"k3", Value::Number(0.0), 0, 0, T0);
    assert!(!live(&d, b"k0", T0));
}

#[test]
fn one_big_entry_evicts_as_many_as_needed() {
    let d = dict_for(5);
    for i in 0..5 {
        d.set(&key(i), Value::Number(0.0), 0, 0, T0);
    }
    // Needs the room of three small entries.
    let v = vec![b'v'; 3 * (2 + 8 + ENTRY_OVERHEAD) - ENTRY_OVERHEAD - 2];
    assert_eq!(
        d.set(b"kb", Value::Str(&v), 0, 0, T0),
        SetResult::StoredEvicted
    );
    let alive: Vec<bool> = (0..5).map(|i| live(&d, &key(i), T0)).collect();
    assert_eq!(alive, [false, false, false, true, true]);
    assert_eq!(d.free_space(), 0);
    d.check_invariants().unwrap();
}

#[test]
fn growing_an_existing_value_evicts_others_not_itself() {
    let d = dict_for(4);
    for i in 0..4 {
        d.set(&key(i), Value::Number(0.0), 0, 0, T0);
    }
    // k0 is the LRU tail and is being replaced by a bigger value.
    let v = vec![b'v'; 2 * (2 + 8 + ENTRY_OVERHEAD) - ENTRY_OVERHEAD - 2];
    assert_eq!(
        d.set(b"k0", Value::Str(&v), 0, 0, T0),
        SetResult::StoredEvicted
    );
    let mut out = Vec::new();
    assert_eq!(d.get(b"k0", T0, &mut out).unwrap().value, HitValue::Str);
    assert_eq!(out, v);
    assert!(!live(&d, b"k1", T0));
    assert!(live(&d, b"k2", T0) && live(&d, b"k3", T0));
    d.check_invariants().unwrap();
}

#[test]
fn expired_entries_are_reclaimed_before_live_ones_without_forcible() {
    let d = dict_for(4);
    d.set(b"k0", Value::Number(0.0), 10, 0, T0);
    d.set(b"k1", Value::Number(0.0), 10, 0, T0);
    d.set(b"k2", Value::Number(0.0), 0, 0, T0);
    d.set(b"k3", Value::Number(0.0), 0, 0, T0);
    assert_eq!(d.free_space(), 0);
    let later = T0 + 10;
    assert_eq!(
        d.safe_set(b"k4", Value::Number(0.0), 0, 0, later),
        SetResult::Stored
    );
    assert_eq!(
        d.set(b"k5", Value::Number(0.0), 0, 0, later),
        SetResult::Stored
    );
    for k in ["k2", "k3", "k4", "k5"] {
        assert!(live(&d, k.as_bytes(), later));
    }
    assert_eq!(d.len(), 4);
    d.check_invariants().unwrap();
}

#[test]
fn writes_reclaim_expired_tail_entries_even_with_room() {
    let d = SharedDict::with_shards("r", 1 << 20, 1);
    for i in 0..4 {
        d.set(&key(i), Value::Number(0.0), 10, 0, T0);
    }
    assert_eq!(d.len(), 4);
    // Like nginx, each write frees up to two expired entries at the tail.
    d.set(b"x", Value::Number(0.0), 0, 0, T0 + 10);
    assert_eq!(d.len(), 3);
    // get never removes: get_stale keeps working.
    assert!(d.get_stale(b"k3", T0 + 10, &mut Vec::new()).unwrap().stale);
    assert_eq!(d.len(), 3);
}

#[test]
fn safe_ops_never_evict_live_entries() {
    let d = dict_for(3);
    for i in 0..3 {
        assert_eq!(
            d.safe_set(&key(i), Value::Number(0.0), 0, 0, T0),
            SetResult::Stored
        );
    }
    assert_eq!(
        d.safe_set(b"k3", Value::Number(0.0), 0, 0, T0),
        SetResult::NoMemory
    );
    assert_eq!(
        d.safe_add(b"k3", Value::Number(0.0), 0, 0, T0),
        SetResult::NoMemory
    );
    assert_eq!(SetResult::NoMemory.error_str(), Some("no memory"));
    // Same-size overwrite needs no room.
    assert_eq!(
        d.safe_set(b"k1", Value::Number(7.0), 0, 3, T0),
        SetResult::Stored
    );
    // Growing an existing value without room fails and keeps the old value.
    assert_eq!(
        d.safe_set(b"k1", Value::Str(b"a longer string value"), 0, 0, T0),
        SetResult::NoMemory
    );
    let h = d.get(b"k1", T0, &mut Vec::new()).unwrap();
    assert_eq!((h.value, h.flags), (HitValue::Number(7.0), 3));
    // Shrinking always fits.
    assert_eq!(
        d.safe_set(b"k1", Value::Bool(true), 0, 0, T0),
        SetResult::Stored
    );
    for i in 0..3 {
        assert!(live(&d, &key(i), T0));
    }
    // After a delete there is room again.
    assert!(d.delete(b"k0", T0));
    assert_eq!(
        d.safe_add(b"k3", Value::Number(0.0), 0, 0, T0),
        SetResult::Stored
    );
    d.check_invariants().unwrap();
}

#[test]
fn incr_init_evicts_and_reports_forcible() {
    let d = dict_for(2);
    d.set(b"k0", Value::Number(0.0), 0, 0, T0);
    d.set(b"k1", Value::Number(0.0), 0, 0, T0);
    let r = d.incr(b"k2", 1.0, Some(0.0), 0, T0).unwrap();
    assert_eq!((r.value, r.forcible), (1.0, true));
    assert!(!live(&d, b"k0", T0));
    // Too small for any entry.
    let tiny = SharedDict::with_shards("tiny", ENTRY_OVERHEAD, 1);
    assert_eq!(
        tiny.incr(b"k", 1.0, Some(0.0), 0, T0),
        Err(IncrError::NoMemory)
    );
    assert_eq!(
        tiny.set(b"k", Value::Bool(true), 0, 0, T0),
        SetResult::NoMemory
    );
    assert_eq!(tiny.free_space(), ENTRY_OVERHEAD);
}

#[test]
fn shards_evict_independently() {
    let d = SharedDict::with_shards("s", 4 * (3 + 8 + ENTRY_OVERHEAD) * 4, 4);
    assert_eq!(d.shard_count(), 4);
    // Fill far beyond capacity: every shard stays within its share.
    for i in 0..200u32 {
        let k = format!("{i:03}");
        assert!(d.set(k.as_bytes(), Value::Number(0.0), 0, 0, T0).is_ok());
        assert!(d.used_bytes() <= d.capacity());
        d.check_invariants().unwrap();
    }
    // Each shard is full (all entries are the same size), 4 per shard.
    assert_eq!(d.len(), 16);
    assert_eq!(d.free_space(), 0);
}
