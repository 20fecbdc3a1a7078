//! The semantics of each operation, with injected times.

use pier_shdict::{
    entry_size, validate_key, Hit, HitValue, Incr, IncrError, KeyError, SetResult, SharedDict,
    Value, ENTRY_OVERHEAD, MAX_KEY_LEN,
};

const T0: u64 = 1_000_000;

fn get_str(d: &SharedDict, key: &[u8], now: u64) -> Option<Vec<u8>> {
    let mut out = Vec::new();
    match d.get(key, now, &mut out)? {
        Hit {
            value: HitValue::Str,
            ..
        } => Some(out),
        other => panic!("not a string: {other:?}"),
    }
}

fn hit(d: &SharedDict, key: &[u8], now: u64) -> Option<Hit> {
    d.get(key, now, &mut Vec::new())
}

fn big() -> SharedDict {
    SharedDict::with_shards("t", 1 << 20, 1)
}

#[test]
fn set_get_all_types_and_flags() {
    let d = big();
    let mut out = Vec::with_capacity(64);
    assert_eq!(
        d.set(b"s", Value::Str(b"hello"), 0, 7, T0),
        SetResult::Stored
    );
    assert_eq!(
        d.set(b"n", Value::Number(-2.5), 0, 0, T0),
        SetResult::Stored
    );
    assert_eq!(d.set(b"t", Value::Bool(true), 0, 1, T0), SetResult::Stored);
    assert_eq!(d.set(b"f", Value::Bool(false), 0, 0, T0), SetResult::Stored);
    assert_eq!(d.set(b"e", Value::Str(b""), 0, 0, T0), SetResult::Stored);

    let h = d.get(b"s", T0, &mut out).unwrap();
    assert_eq!((h.value, h.flags, h.stale), (HitValue::Str, 7, false));
    assert_eq!(out, b"hello");
    let h = d.get(b"n", T0, &mut out).unwrap();
    assert_eq!(h.value, HitValue::Number(-2.5));
    assert!(out.is_empty(), "out is cleared for non-string hits");
    assert_eq!(hit(&d, b"t", T0).unwrap().value, HitValue::Bool(true));
    assert_eq!(hit(&d, b"t", T0).unwrap().flags, 1);
    assert_eq!(hit(&d, b"f", T0).unwrap().value, HitValue::Bool(false));
    assert_eq!(get_str(&d, b"e", T0).unwrap(), b"");
    assert_eq!(hit(&d, b"missing", T0), None);
    assert_eq!(d.len(), 5);

    // Overwrite changes type, value and flags.
    assert_eq!(d.set(b"s", Value::Number(1.0), 0, 0, T0), SetResult::Stored);
    let h = hit(&d, b"s", T0).unwrap();
    assert_eq!((h.value, h.flags), (HitValue::Number(1.0), 0));
    // Type codes are Lua's.
    assert_eq!(HitValue::Str.type_code(), 4);
    assert_eq!(Value::Number(1.0).type_code(), 3);
    assert_eq!(Value::Bool(true).type_code(), 1);
    assert_eq!(Value::Nil.type_code(), 0);
    d.check_invariants().unwrap();
}

#[test]
fn get_grows_small_buffer_and_reuses_large_one() {
    let d = big();
    let val = vec![b'x'; 5000];
    d.set(b"k", Value::Str(&val), 0, 0, T0);
    let mut out = Vec::new();
    d.get(b"k", T0, &mut out).unwrap();
    assert_eq!(out, val);
    let ptr = out.as_ptr();
    d.get(b"k", T0, &mut out).unwrap();
    assert_eq!(
        out.as_ptr(),
        ptr,
        "a hit into a large enough buffer does not reallocate"
    );
}

#[test]
fn set_nil_deletes_and_delete() {
    let d = big();
    d.set(b"a", Value::Str(b"1"), 0, 0, T0);
    assert_eq!(d.set(b"a", Value::Nil, 0, 0, T0), SetResult::Stored);
    assert_eq!(hit(&d, b"a", T0), None);
    assert_eq!(d.len(), 0);
    assert_eq!(d.free_space(), d.capacity());

    d.set(b"b", Value::Number(1.0), 0, 0, T0);
    assert!(d.delete(b"b", T0));
    assert!(!d.delete(b"b", T0));
    d.set(b"c", Value::Number(1.0), 10, 0, T0);
    assert!(
        !d.delete(b"c", T0 + 10),
        "deleting an expired entry reports no live value"
    );
    assert_eq!(d.len(), 0, "but frees it");
    d.check_invariants().unwrap();
}

#[test]
fn ttl_expiry_and_get_stale() {
    let d = big();
    d.set(b"k", Value::Str(b"v"), 100, 3, T0);
    assert_eq!(d.ttl(b"k", T0), Some(Some(100)));
    assert_eq!(d.ttl(b"k", T0 + 99), Some(Some(1)));
    assert_eq!(get_str(&d, b"k", T0 + 99).unwrap(), b"v");
    // Lives for [T0, T0 + 100).
    assert_eq!(hit(&d, b"k", T0 + 100), None);
    assert_eq!(d.ttl(b"k", T0 + 100), None);
    let mut out = Vec::new();
    let h = d.get_stale(b"k", T0 + 100, &mut out).unwrap();
    assert_eq!((h.value, h.flags, h.stale), (HitValue::Str, 3, true));
    assert_eq!(out, b"v");
    let h = d.get_stale(b"k", T0 + 50, &mut out).unwrap();
    assert!(!h.stale);
    // TTL 0 never expires.
    d.set(b"forever", Value::Bool(true), 0, 0, T0);
    assert_eq!(d.ttl(b"forever", T0), Some(None));
    assert!(hit(&d, b"forever", u64::MAX - 1).is_some());
    assert_eq!(d.ttl(b"nope", T0), None);
    // A huge TTL saturates instead of wrapping.
    d.set(b"huge", Value::Bool(true), u64::MAX, 0, T0);
    assert!(hit(&d, b"huge", u64::MAX - 2).is_some());
}

#[test]
fn expire_changes_ttl_of_live_keys_only() {
    let d = big();
    d.set(b"k", Value::Number(1.0), 0, 0, T0);
    assert!(d.expire(b"k", 50, T0));
    assert_eq!(d.ttl(b"k", T0 + 10), Some(Some(40)));
    assert!(d.expire(b"k", 0, T0 + 10));
    assert_eq!(d.ttl(b"k", T0 + 10), Some(None));
    assert!(hit(&d, b"k", T0 + 1000).is_some());
    assert!(d.expire(b"k", 5, T0));
    assert!(!d.expire(b"k", 100, T0 + 5), "expired: not found");
    assert!(!d.expire(b"missing", 100, T0));
}

#[test]
fn add_only_if_absent_or_expired() {
    let d = big();
    assert_eq!(d.add(b"k", Value::Str(b"1"), 10, 0, T0), SetResult::Stored);
    assert_eq!(
        d.add(b"k", Value::Str(b"2"), 0, 0, T0 + 9),
        SetResult::Exists
    );
    assert_eq!(get_str(&d, b"k", T0).unwrap(), b"1");
    assert_eq!(
        d.add(b"k", Value::Str(b"3"), 0, 5, T0 + 10),
        SetResult::Stored
    );
    let mut out = Vec::new();
    let h = d.get(b"k", T0 + 1_000_000, &mut out).unwrap();
    assert_eq!(
        (out.as_slice(), h.flags),
        (&b"3"[..], 5),
        "add takes new ttl and flags"
    );
    assert_eq!(
        d.safe_add(b"k", Value::Str(b"4"), 0, 0, T0),
        SetResult::Exists
    );
    assert_eq!(
        d.safe_add(b"j", Value::Number(4.0), 0, 0, T0),
        SetResult::Stored
    );
    assert_eq!(SetResult::Exists.error_str(), Some("exists"));
    d.check_invariants().unwrap();
}

#[test]
fn replace_only_if_live() {
    let d = big();
    assert_eq!(
        d.replace(b"k", Value::Str(b"1"), 0, 0, T0),
        SetResult::NotFound
    );
    assert_eq!(hit(&d, b"k", T0), None);
    d.set(b"k", Value::Str(b"1"), 10, 0, T0);
    assert_eq!(
        d.replace(b"k", Value::Str(b"22"), 0, 9, T0 + 5),
        SetResult::Stored
    );
    let mut out = Vec::new();
    let h = d.get(b"k", T0 + 100, &mut out).unwrap();
    assert_eq!(
        (out.as_slice(), h.flags),
        (&b"22"[..], 9),
        "replace sets ttl and flags"
    );
    d.set(b"e", Value::Str(b"1"), 10, 0, T0);
    assert_eq!(
        d.replace(b"e", Value::Str(b"2"), 0, 0, T0 + 10),
        SetResult::NotFound
    );
    assert_eq!(d.replace(b"k", Value::Nil, 0, 0, T0), SetResult::Stored);
    assert_eq!(hit(&d, b"k", T0), None, "replace with nil deletes");
    assert_eq!(SetResult::NotFound.error_str(), Some("not found"));
    d.check_invariants().unwrap();
}

#[test]
fn incr_semantics() {
    let d = big();
    assert_eq!(d.incr(b"c", 1.0, None, 0, T0), Err(IncrError::NotFound));
    assert_eq!(
        d.incr(b"c", 2.0, Some(10.0), 0, T0),
        Ok(Incr {
            value: 12.0,
            forcible: false
        })
    );
    assert_eq!(
        d.incr(b"c", -0.5, Some(100.0), 0, T0).unwrap().value,
        11.5,
        "init ignored when present"
    );
    assert_eq!(d.ttl(b"c", T0), Some(None));

    // init_ttl applies only when initialising, and incr keeps the TTL.
    assert_eq!(d.incr(b"r", 1.0, Some(0.0), 100, T0).unwrap().value, 1.0);
    assert_eq!(d.ttl(b"r", T0), Some(Some(100)));
    assert_eq!(
        d.incr(b"r", 1.0, Some(0.0), 5000, T0 + 50).unwrap().value,
        2.0
    );
    assert_eq!(d.ttl(b"r", T0 + 50), Some(Some(50)));
    // Once expired, it is re-initialised with a fresh init_ttl.
    assert_eq!(
        d.incr(b"r", 1.0, None, 0, T0 + 100),
        Err(IncrError::NotFound)
    );
    assert_eq!(
        d.incr(b"r", 1.0, Some(0.0), 30, T0 + 100).unwrap().value,
        1.0
    );
    assert_eq!(d.ttl(b"r", T0 + 100), Some(Some(30)));

    // Incr keeps flags; initialising sets flags 0.
    d.set(b"f", Value::Number(1.0), 0, 42, T0);
    d.incr(b"f", 1.0, None, 0, T0).unwrap();
    assert_eq!(hit(&d, b"f", T0).unwrap().flags, 42);
    assert_eq!(hit(&d, b"f", T0).unwrap().value, HitValue::Number(2.0));

    // Type errors.
    d.set(b"s", Value::Str(b"12"), 0, 0, T0);
    d.set(b"b", Value::Bool(true), 0, 0, T0);
    assert_eq!(d.incr(b"s", 1.0, None, 0, T0), Err(IncrError::NotANumber));
    assert_eq!(
        d.incr(b"b", 1.0, Some(0.0), 0, T0),
        Err(IncrError::NotANumber)
    );
    assert_eq!(IncrError::NotANumber.as_str(), "not a number");
    // An expired non-number is replaced by init.
    d.set(b"x", Value::Str(b"old string"), 10, 0, T0);
    assert_eq!(d.incr(b"x", 1.0, Some(1.0), 0, T0 + 10).unwrap().value, 2.0);
    d.check_invariants().unwrap();
}

#[test]
fn key_validation() {
    let d = big();
    let long = vec![b'k'; MAX_KEY_LEN + 1];
    let max = vec![b'k'; MAX_KEY_LEN];
    assert_eq!(validate_key(b""), Err(KeyError::Empty));
    assert_eq!(validate_key(&long), Err(KeyError::TooLong));
    assert_eq!(KeyError::TooLong.as_str(), "key too long");
    assert_eq!(
        d.set(b"", Value::Number(1.0), 0, 0, T0),
        SetResult::InvalidKey
    );
    assert_eq!(
        d.set(&long, Value::Number(1.0), 0, 0, T0),
        SetResult::InvalidKey
    );
    assert_eq!(
        d.incr(b"", 1.0, Some(1.0), 0, T0),
        Err(IncrError::InvalidKey)
    );
    assert_eq!(hit(&d, b"", T0), None);
    assert_eq!(d.set(&max, Value::Number(1.0), 0, 0, T0), SetResult::Stored);
    assert!(hit(&d, &max, T0).is_some());
}

#[test]
fn get_keys_skips_expired_and_honours_max() {
    let d = big();
    for i in 0..10u32 {
        let ttl = if i % 2 == 0 { 0 } else { 10 };
        d.set(
            format!("k{i}").as_bytes(),
            Value::Number(f64::from(i)),
            ttl,
            0,
            T0,
        );
    }
    let mut all = d.get_keys(0, T0);
    all.sort();
    assert_eq!(all.len(), 10);
    let mut live = d.get_keys(0, T0 + 10);
    live.sort();
    let want: Vec<Vec<u8>> = (0..10)
        .step_by(2)
        .map(|i| format!("k{i}").into_bytes())
        .collect();
    assert_eq!(live, want);
    assert_eq!(d.get_keys(3, T0 + 10).len(), 3);
    let mut seen = Vec::new();
    assert_eq!(d.for_each_key(0, T0 + 10, |k| seen.push(k.to_vec())), 5);
    seen.sort();
    assert_eq!(seen, want);
    assert_eq!(d.for_each_key(2, T0, |_| {}), 2);
    // Most recently used first (one shard).
    assert_eq!(d.get_keys(1, T0)[0], b"k9");
}

#[test]
fn flush_all_and_flush_expired() {
    let d = big();
    for i in 0..20u32 {
        d.set(format!("k{i}").as_bytes(), Value::Number(1.0), 0, 0, T0);
    }
    let used = d.capacity() - d.free_space();
    d.flush_all();
    assert_eq!(hit(&d, b"k1", T0), None);
    assert!(d.get_stale(b"k1", T0, &mut Vec::new()).unwrap().stale);
    assert_eq!(d.get_keys(0, T0).len(), 0);
    assert_eq!(
        d.capacity() - d.free_space(),
        used,
        "flush_all frees no memory"
    );
    assert_eq!(d.len(), 20);
    assert_eq!(d.flush_expired(5, T0), 5);
    assert_eq!(d.len(), 15);
    assert_eq!(d.flush_expired(0, T0), 15);
    assert_eq!(d.free_space(), d.capacity());

    d.set(b"a", Value::Number(1.0), 10, 0, T0);
    d.set(b"b", Value::Number(1.0), 0, 0, T0);
    d.set(b"c", Value::Number(1.0), 10, 0, T0);
    assert_eq!(d.flush_expired(0, T0 + 9), 0);
    assert_eq!(
        d.flush_expired(0, T0 + 10),
        2,
        "expired entries anywhere in the LRU list"
    );
    assert_eq!(d.get_keys(0, T0 + 10), vec![b"b".to_vec()]);
    d.check_invariants().unwrap();
}

#[test]
fn accounting_matches_entry_size() {
    let d = big();
    assert_eq!(d.free_space(), 1 << 20);
    d.set(b"key", Value::Str(b"value"), 0, 0, T0);
    assert_eq!(d.used_bytes(), 3 + 5 + ENTRY_OVERHEAD);
    d.set(b"n", Value::Number(1.0), 0, 0, T0);
    assert_eq!(
        d.used_bytes(),
        3 + 5 + ENTRY_OVERHEAD + 1 + 8 + ENTRY_OVERHEAD
    );
    d.set(b"key", Value::Bool(true), 0, 0, T0);
    assert_eq!(
        d.used_bytes(),
        entry_size(b"key", &Value::Bool(true)) + entry_size(b"n", &Value::Number(0.0))
    );
    assert_eq!(d.used_bytes() + d.free_space(), d.capacity());
}

#[test]
fn shard_split_and_max_entry_size() {
    let d = SharedDict::with_shards("s", 1000, 3); // rounds down to 2
    assert_eq!(d.shard_count(), 2);
    assert_eq!(d.capacity(), 1000);
    assert_eq!(d.max_entry_size(), 500);
    assert_eq!(d.free_space(), 1000);
    d.check_invariants().unwrap();
    let odd = SharedDict::with_shards("o", 1001, 4);
    assert_eq!(odd.free_space(), 1001, "shares sum to the capacity");
    odd.check_invariants().unwrap();
    assert_eq!(SharedDict::new("small", 100_000).shard_count(), 1);
    assert_eq!(SharedDict::new("mid", 1 << 20).shard_count(), 4);
    assert_eq!(SharedDict::new("big", 100 << 20).shard_count(), 16);
    assert_eq!(SharedDict::with_shards("tiny", 2, 64).shard_count(), 2);
}

#[test]
fn entry_larger_than_shard_is_no_memory() {
    let d = SharedDict::with_shards("s", 4000, 2);
    let v = vec![0u8; 2000];
    assert_eq!(d.set(b"k", Value::Str(&v), 0, 0, T0), SetResult::NoMemory);
    let fits = vec![0u8; 2000 - ENTRY_OVERHEAD - 1];
    assert_eq!(entry_size(b"k", &Value::Str(&fits)), d.max_entry_size());
    // Hash might pick either shard; both are exactly 2000 bytes.
    assert_eq!(d.set(b"k", Value::Str(&fits), 0, 0, T0), SetResult::Stored);
    assert_eq!(d.set(b"k", Value::Str(&v), 0, 0, T0), SetResult::NoMemory);
    assert_eq!(
        get_str(&d, b"k", T0).unwrap(),
        fits,
        "a failed store keeps the old value"
    );
    d.check_invariants().unwrap();
}
