//! Lists (`lpush` / `rpush` / `lpop` / `rpop` / `llen`): ngx.shared's
//! semantics, accounting and interplay with the other operations.

use pier_shdict::{
    HitValue, IncrError, ListError, ListItem, SetResult, SharedDict, Value, ENTRY_OVERHEAD,
    LIST_ITEM_OVERHEAD, MAX_KEY_LEN,
};

const T0: u64 = 1_000_000;

fn dict() -> SharedDict {
    SharedDict::with_shards("t", 1 << 20, 1)
}

fn s(v: &[u8]) -> Option<ListItem> {
    Some(ListItem::Str(v.into()))
}

fn check(d: &SharedDict) {
    d.check_invariants().unwrap();
}

#[test]
fn push_pop_both_ends() {
    let d = dict();
    assert_eq!(d.lpush(b"l", Value::Str(b"b"), T0), Ok(1));
    assert_eq!(d.lpush(b"l", Value::Str(b"a"), T0), Ok(2));
    assert_eq!(d.rpush(b"l", Value::Number(3.5), T0), Ok(3));
    assert_eq!(d.rpush(b"l", Value::Str(b""), T0), Ok(4));
    assert_eq!(d.llen(b"l", T0), Ok(4));
    check(&d);
    // a, b, 3.5, ""
    assert_eq!(d.lpop(b"l", T0), Ok(s(b"a")));
    assert_eq!(d.rpop(b"l", T0), Ok(s(b"")));
    assert_eq!(d.rpop(b"l", T0), Ok(Some(ListItem::Number(3.5))));
    assert_eq!(d.llen(b"l", T0), Ok(1));
    assert_eq!(d.lpop(b"l", T0), Ok(s(b"b")));
    // Popping the last item deletes the key.
    assert_eq!(d.len(), 0);
    assert_eq!(d.used_bytes(), 0);
    assert_eq!(d.lpop(b"l", T0), Ok(None));
    assert_eq!(d.rpop(b"missing", T0), Ok(None));
    assert_eq!(d.llen(b"l", T0), Ok(0));
    check(&d);
}

#[test]
fn type_errors_both_ways() {
    let d = dict();
    d.set(b"v", Value::Str(b"x"), 0, 0, T0);
    assert_eq!(
        d.lpush(b"v", Value::Str(b"y"), T0),
        Err(ListError::NotAList)
    );
    assert_eq!(
        d.rpush(b"v", Value::Number(1.0), T0),
        Err(ListError::NotAList)
    );
    assert_eq!(d.lpop(b"v", T0), Err(ListError::NotAList));
    assert_eq!(d.rpop(b"v", T0), Err(ListError::NotAList));
    assert_eq!(d.llen(b"v", T0), Err(ListError::NotAList));
    assert_eq!(ListError::NotAList.as_str(), "value not a list");
    // The value is untouched.
    let mut out = Vec::new();
    assert_eq!(d.get(b"v", T0, &mut out).unwrap().value, HitValue::Str);
    assert_eq!(out, b"x");

    // A list key: get reports a list (with no flags), incr is "not a number".
    d.rpush(b"l", Value::Str(b"1"), T0).unwrap();
    let h = d.get(b"l", T0, &mut out).unwrap();
    assert_eq!(
        (h.value, h.flags, h.value.type_code()),
        (HitValue::List, 0, 5)
    );
    assert!(out.is_empty());
    assert_eq!(
        d.get_stale(b"l", T0, &mut out).unwrap().value,
        HitValue::List
    );
    assert_eq!(
        d.incr(b"l", 1.0, Some(0.0), 0, T0),
        Err(IncrError::NotANumber)
    );
    // add sees it as existing; set and replace overwrite it.
    assert_eq!(d.add(b"l", Value::Number(1.0), 0, 0, T0), SetResult::Exists);
    assert_eq!(
        d.replace(b"l", Value::Number(2.0), 0, 0, T0),
        SetResult::Stored
    );
    assert_eq!(
        d.get(b"l", T0, &mut out).unwrap().value,
        HitValue::Number(2.0)
    );
    d.rpush(b"m", Value::Str(b"1"), T0).unwrap();
    assert_eq!(d.set(b"m", Value::Str(b"s"), 0, 0, T0), SetResult::Stored);
    assert_eq!(d.llen(b"m", T0), Err(ListError::NotAList));
    check(&d);
}

#[test]
fn bad_values_and_keys() {
    let d = dict();
    assert_eq!(
        d.lpush(b"l", Value::Bool(true), T0),
        Err(ListError::BadValue)
    );
    assert_eq!(d.rpush(b"l", Value::Nil, T0), Err(ListError::BadValue));
    assert_eq!(
        d.lpush(b"", Value::Number(1.0), T0),
        Err(ListError::InvalidKey)
    );
    let long = vec![b'k'; MAX_KEY_LEN + 1];
    assert_eq!(
        d.rpush(&long, Value::Number(1.0), T0),
        Err(ListError::InvalidKey)
    );
    assert_eq!(d.lpop(b"", T0), Err(ListError::InvalidKey));
    assert_eq!(d.llen(&long, T0), Err(ListError::InvalidKey));
    assert_eq!(d.len(), 0);
    check(&d);
}

#[test]
fn accounting_and_no_memory() {
    // One shard of 1000 bytes.
    let d = SharedDict::with_shards("t", 1000, 1);
    d.rpush(b"k", Value::Str(b"abc"), T0).unwrap();
    let entry = 1 + ENTRY_OVERHEAD;
    assert_eq!(d.used_bytes(), entry + 3 + LIST_ITEM_OVERHEAD);
    d.rpush(b"k", Value::Number(1.0), T0).unwrap();
    assert_eq!(
        d.used_bytes(),
        entry + 3 + LIST_ITEM_OVERHEAD + 8 + LIST_ITEM_OVERHEAD
    );
    check(&d);

    // Fill up with items: a push that does not fit fails, changing nothing.
    let item = 8 + LIST_ITEM_OVERHEAD;
    let mut n = d.llen(b"k", T0).unwrap();
    while d.free_space() >= item {
        n = d.rpush(b"k", Value::Number(n as f64), T0).unwrap();
    }
    let used = d.used_bytes();
    assert_eq!(
        d.rpush(b"k", Value::Number(0.0), T0),
        Err(ListError::NoMemory)
    );
    assert_eq!(
        d.lpush(b"other", Value::Number(0.0), T0),
        Err(ListError::NoMemory)
    );
    assert_eq!((d.used_bytes(), d.llen(b"k", T0)), (used, Ok(n)));
    assert_eq!(
        d.llen(b"other", T0),
        Ok(0),
        "a failed first push leaves no key"
    );
    check(&d);

    // A push never evicts a live value; a set evicts the whole list.
    assert_eq!(
        d.set(b"s", Value::Str(&[b'x'; 600]), 0, 0, T0),
        SetResult::StoredEvicted
    );
    assert_eq!(d.llen(b"k", T0), Ok(0));
    assert_eq!(d.used_bytes(), 1 + 600 + ENTRY_OVERHEAD);
    check(&d);

    // An item larger than the shard fails before allocating.
    let huge = vec![0u8; 2000];
    assert_eq!(
        d.rpush(b"h", Value::Str(&huge), T0),
        Err(ListError::NoMemory)
    );
    check(&d);
}

#[test]
fn push_reclaims_expired_entries() {
    let d = SharedDict::with_shards("t", 1000, 1);
    // An entry expiring at T0 + 10 takes most of the room.
    d.set(b"old", Value::Str(&[b'x'; 700]), 10, 0, T0);
    assert_eq!(
        d.rpush(b"l", Value::Str(&[b'y'; 100]), T0),
        Err(ListError::NoMemory)
    );
    // Once it has expired, the push may free it.
    assert_eq!(d.rpush(b"l", Value::Str(&[b'y'; 100]), T0 + 10), Ok(1));
    let mut out = Vec::new();
    assert_eq!(d.get_stale(b"old", T0 + 10, &mut out), None);
    check(&d);
}

#[test]
fn lists_expire_like_other_keys() {
    let d = dict();
    d.rpush(b"l", Value::Str(b"a"), T0).unwrap();
    // No TTL at creation.
    assert_eq!(d.ttl(b"l", T0), Some(None));
    assert!(d.expire(b"l", 100, T0));
    assert_eq!(d.ttl(b"l", T0 + 40), Some(Some(60)));
    // A push keeps the TTL.
    assert_eq!(d.rpush(b"l", Value::Str(b"b"), T0 + 50), Ok(2));
    assert_eq!(d.ttl(b"l", T0 + 50), Some(Some(50)));
    // Expired: invisible to llen/pop; a push starts a new list with no TTL.
    assert_eq!(d.llen(b"l", T0 + 100), Ok(0));
    assert_eq!(d.lpop(b"l", T0 + 100), Ok(None));
    assert_eq!(d.rpush(b"l", Value::Str(b"c"), T0 + 100), Ok(1));
    assert_eq!(d.ttl(b"l", T0 + 100), Some(None));
    assert_eq!(d.lpop(b"l", T0 + 100), Ok(s(b"c")));
    check(&d);

    // An expired non-list value is replaced by a new list.
    d.set(b"v", Value::Number(1.0), 10, 0, T0);
    assert_eq!(
        d.lpush(b"v", Value::Number(2.0), T0),
        Err(ListError::NotAList)
    );
    assert_eq!(d.lpush(b"v", Value::Number(2.0), T0 + 10), Ok(1));
    check(&d);
}

#[test]
fn delete_flush_and_keys() {
    let d = dict();
    for i in 0..10u8 {
        d.rpush(b"a", Value::Str(&[i; 10]), T0).unwrap();
    }
    d.rpush(b"b", Value::Number(1.0), T0).unwrap();
    d.set(b"c", Value::Number(1.0), 0, 0, T0);
    let mut keys = d.get_keys(0, T0);
    keys.sort();
    assert_eq!(keys, vec![b"a".to_vec(), b"b".to_vec(), b"c".to_vec()]);

    assert!(d.delete(b"a", T0));
    assert_eq!(d.llen(b"a", T0), Ok(0));
    check(&d);

    d.flush_all();
    // Marked expired, still held until removed.
    assert_eq!(d.len(), 2);
    assert!(d.get_keys(0, T0).is_empty());
    assert_eq!(d.rpop(b"b", T0), Ok(None));
    assert_eq!(d.flush_expired(0, T0), 2);
    assert_eq!(d.llen(b"b", T0), Ok(0));
    assert_eq!((d.len(), d.used_bytes()), (0, 0));
    check(&d);
}

#[test]
fn list_slots_are_reused() {
    let d = dict();
    for round in 0..50 {
        for k in 0..20u8 {
            d.rpush(&[k], Value::Number(f64::from(round)), T0).unwrap();
        }
        for k in 0..20u8 {
            assert!(d.lpop(&[k], T0).unwrap().is_some());
        }
        check(&d);
    }
    assert_eq!((d.len(), d.used_bytes()), (0, 0));
}

#[test]
fn long_list_pops_in_order_and_shrinks_accounting() {
    let d = dict();
    for i in 0..5000 {
        d.rpush(b"q", Value::Number(f64::from(i)), T0).unwrap();
    }
    let full = d.used_bytes();
    for i in 0..4990 {
        assert_eq!(d.lpop(b"q", T0), Ok(Some(ListItem::Number(f64::from(i)))));
    }
    assert_eq!(d.llen(b"q", T0), Ok(10));
    assert_eq!(
        full - d.used_bytes(),
        4990 * (8 + LIST_ITEM_OVERHEAD),
        "each pop gives its charge back"
    );
    check(&d);
}

#[test]
fn concurrent_pushes_and_pops_lose_nothing() {
    let d = std::sync::Arc::new(SharedDict::with_shards("t", 8 << 20, 4));
    let threads: Vec<_> = (0..4)
        .map(|t| {
            let d = d.clone();
            std::thread::spawn(move || {
                for i in 0..2000 {
                    d.rpush(b"q", Value::Number(f64::from(t * 10_000 + i)), T0)
                        .unwrap();
                }
            })
        })
        .collect();
    let mut got = Vec::new();
    let popper = {
        let d = d.clone();
        std::thread::spawn(move || {
            let mut got = Vec::new();
            for _ in 0..2000 {
                if let Ok(Some(ListItem::Number(n))) = d.lpop(b"q", T0) {
                    got.push(n as u32);
                }
            }
            got
        })
    };
    for t in threads {
        t.join().unwrap();
    }
    got.extend(popper.join().unwrap());
    while let Ok(Some(ListItem::Number(n))) = d.rpop(b"q", T0) {
        got.push(n as u32);
    }
    got.sort_unstable();
    let mut want: Vec<u32> = (0..4)
        .flat_map(|t| (0..2000).map(move |i| t * 10_000 + i))
        .collect();
    want.sort_unstable();
    assert_eq!(got, want);
    assert_eq!(d.used_bytes(), 0);
    d.check_invariants().unwrap();
}
