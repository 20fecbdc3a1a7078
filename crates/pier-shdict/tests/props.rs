//! Property tests: a model check with room to spare, and bounds and
//! eviction guarantees under memory pressure.

use std::collections::{BTreeSet, HashMap};

use pier_shdict::{HitValue, IncrError, SetResult, SharedDict, Value};
use proptest::prelude::*;

// === model ===

#[derive(Clone, Debug, PartialEq)]
enum MVal {
    Bool(bool),
    Num(f64),
    Str(Vec<u8>),
}

#[derive(Clone, Debug)]
struct MEntry {
    val: MVal,
    flags: u32,
    /// `u64::MAX` = never.
    expires: u64,
}

#[derive(Clone, Debug)]
enum V {
    Nil,
    Bool(bool),
    Num(i16),
    Str(Vec<u8>),
}

impl V {
    fn as_value(&self) -> Value<'_> {
        match self {
            V::Nil => Value::Nil,
            V::Bool(b) => Value::Bool(*b),
            V::Num(n) => Value::Number(f64::from(*n)),
            V::Str(s) => Value::Str(s),
        }
    }
    fn model(&self) -> Option<MVal> {
        match self {
            V::Nil => None,
            V::Bool(b) => Some(MVal::Bool(*b)),
            V::Num(n) => Some(MVal::Num(f64::from(*n))),
            V::Str(s) => Some(MVal::Str(s.clone())),
        }
    }
}

#[derive(Clone, Copy, Debug)]
enum Kind {
    Set,
    SafeSet,
    Add,
    SafeAdd,
    Replace,
}

#[derive(Clone, Debug)]
enum Op {
    Store(Kind, u8, V, u64, u32),
    Get(u8),
    GetStale(u8),
    Delete(u8),
    Incr(u8, i16, Option<i16>, u64),
    Ttl(u8),
    Expire(u8, u64),
    Keys,
    FlushAll,
    FlushExpired,
    Tick(u64),
}

fn value(max_str: usize) -> impl Strategy<Value = V> {
    prop_oneof![
        1 => Just(V::Nil),
        2 => any::<bool>().prop_map(V::Bool),
        4 => any::<i16>().prop_map(V::Num),
        4 => proptest::collection::vec(any::<u8>(), 0..max_str).prop_map(V::Str),
    ]
}

fn op(keys: u8, max_str: usize) -> impl Strategy<Value = Op> {
    let kind = prop_oneof![
        Just(Kind::Set),
        Just(Kind::SafeSet),
        Just(Kind::Add),
        Just(Kind::SafeAdd),
        Just(Kind::Replace)
    ];
    let ttl = prop_oneof![Just(0u64), 1u64..50];
    prop_oneof![
        8 => (kind, 0..keys, value(max_str), ttl.clone(), 0u32..4)
            .prop_map(|(k, key, v, t, f)| Op::Store(k, key, v, t, f)),
        4 => (0..keys).prop_map(Op::Get),
        2 => (0..keys).prop_map(Op::GetStale),
        2 => (0..keys).prop_map(Op::Delete),
        4 => (0..keys, -3i16..4, proptest::option::of(-5i16..5), ttl.clone())
            .prop_map(|(k, by, init, t)| Op::Incr(k, by, init, t)),
        1 => (0..keys).prop_map(Op::Ttl),
        1 => (0..keys, ttl).prop_map(|(k, t)| Op::Expire(k, t)),
        1 => Just(Op::Keys),
        1 => Just(Op::FlushAll),
        1 => Just(Op::FlushExpired),
        3 => (0u64..30).prop_map(Op::Tick),
    ]
}

fn key(k: u8) -> Vec<u8> {
    format!("key-{k}").into_bytes()
}

fn expiry(ttl: u64, now: u64) -> u64 {
    if ttl == 0 {
        u64::MAX
    } else {
        now + ttl
    }
}

fn hit_model(v: HitValue, out: &[u8]) -> MVal {
    match v {
        HitValue::Bool(b) => MVal::Bool(b),
        HitValue::Number(n) => MVal::Num(n),
        HitValue::Str => MVal::Str(out.to_vec()),
        HitValue::List => unreachable!("the model stores no lists"),
    }
}

/// Runs `ops` against a dict with ample room and a simple model.
fn check_model(d: &SharedDict, ops: &[Op]) -> Result<(), TestCaseError> {
    let mut model: HashMap<Vec<u8>, MEntry> = HashMap::new();
    let mut now = 1_000u64;
    let mut out = Vec::new();
    let is_live = |m: &HashMap<Vec<u8>, MEntry>, k: &[u8], now: u64| {
        m.get(k).filter(|e| now < e.expires).cloned()
    };
    for op in ops {
        match op {
            Op::Store(kind, k, v, ttl, flags) => {
                let k = key(*k);
                let live = is_live(&model, &k, now).is_some();
                let (res, want) = match kind {
                    Kind::Set => (
                        d.set(&k, v.as_value(), *ttl, *flags, now),
                        SetResult::Stored,
                    ),
                    Kind::SafeSet => (
                        d.safe_set(&k, v.as_value(), *ttl, *flags, now),
                        SetResult::Stored,
                    ),
                    Kind::Add => (
                        d.add(&k, v.as_value(), *ttl, *flags, now),
                        if live {
                            SetResult::Exists
                        } else {
                            SetResult::Stored
                        },
                    ),
                    Kind::SafeAdd => (
                        d.safe_add(&k, v.as_value(), *ttl, *flags, now),
                        if live {
                            SetResult::Exists
                        } else {
                            SetResult::Stored
                        },
                    ),
                    Kind::Replace => (
                        d.replace(&k, v.as_value(), *ttl, *flags, now),
                        if live {
                            SetResult::Stored
                        } else {
                            SetResult::NotFound
                        },
                    ),
                };
                prop_assert_eq!(res, want, "{:?}", op);
                if res == SetResult::Stored {
                    match v.model() {
                        None => {
                            model.remove(&k);
                        }
                        Some(val) => {
                            let e = MEntry {
                                val,
                                flags: *flags,
                                expires: expiry(*ttl, now),
                            };
                            model.insert(k, e);
                        }
                    }
                }
            }
            Op::Get(k) => {
                let k = key(*k);
                let got = d
                    .get(&k, now, &mut out)
                    .map(|h| (hit_model(h.value, &out), h.flags, h.stale));
                let want = is_live(&model, &k, now).map(|e| (e.val, e.flags, false));
                prop_assert_eq!(got, want, "{:?}", op);
            }
            Op::GetStale(k) => {
                let k = key(*k);
                let got = d
                    .get_stale(&k, now, &mut out)
                    .map(|h| (hit_model(h.value, &out), h.flags, h.stale));
                match model.get(&k) {
                    Some(e) if now < e.expires => {
                        prop_assert_eq!(got, Some((e.val.clone(), e.flags, false)))
                    }
                    // An expired value may or may not have been reclaimed yet.
                    Some(e) => prop_assert!(
                        got.is_none() || got == Some((e.val.clone(), e.flags, true)),
                        "{:?}: {:?}",
                        op,
                        got
                    ),
                    None => prop_assert_eq!(got, None),
                }
            }
            Op::Delete(k) => {
                let k = key(*k);
                let live = is_live(&model, &k, now).is_some();
                prop_assert_eq!(d.delete(&k, now), live);
                model.remove(&k);
            }
            Op::Incr(k, by, init, ttl) => {
                let k = key(*k);
                let got = d.incr(&k, f64::from(*by), init.map(f64::from), *ttl, now);
                match is_live(&model, &k, now) {
                    Some(MEntry {
                        val: MVal::Num(n),
                        flags,
                        expires,
                    }) => {
                        let v = n + f64::from(*by);
                        prop_assert_eq!(got.map(|r| r.value), Ok(v));
                        model.insert(
                            k,
                            MEntry {
                                val: MVal::Num(v),
                                flags,
                                expires,
                            },
                        );
                    }
                    Some(_) => prop_assert_eq!(got, Err(IncrError::NotANumber)),
                    None => match init {
                        None => prop_assert_eq!(got, Err(IncrError::NotFound)),
                        Some(i) => {
                            let v = f64::from(*i) + f64::from(*by);
                            prop_assert_eq!(got.map(|r| r.value), Ok(v));
                            let e = MEntry {
                                val: MVal::Num(v),
                                flags: 0,
                                expires: expiry(*ttl, now),
                            };
                            model.insert(k, e);
                        }
                    },
                }
            }
            Op::Ttl(k) => {
                let k = key(*k);
                let want = is_live(&model, &k, now).map(|e| {
                    if e.expires == u64::MAX {
                        None
                    } else {
                        Some(e.expires - now)
                    }
                });
                prop_assert_eq!(d.ttl(&k, now), want);
            }
            Op::Expire(k, ttl) => {
                let k = key(*k);
                let live = is_live(&model, &k, now).is_some();
                prop_assert_eq!(d.expire(&k, *ttl, now), live);
                if live {
                    model.get_mut(&k).unwrap().expires = expiry(*ttl, now);
                }
            }
            Op::Keys => {
                let got: BTreeSet<Vec<u8>> = d.get_keys(0, now).into_iter().collect();
                let want: BTreeSet<Vec<u8>> = model
                    .iter()
                    .filter(|(_, e)| now < e.expires)
                    .map(|(k, _)| k.clone())
                    .collect();
                prop_assert_eq!(got, want);
            }
            Op::FlushAll => {
                d.flush_all();
                for e in model.values_mut() {
                    e.expires = 0;
                }
            }
            Op::FlushExpired => {
                let expired = model.values().filter(|e| now >= e.expires).count();
                let freed = d.flush_expired(0, now);
                prop_assert!(freed <= expired, "freed {} > {} expired", freed, expired);
                model.retain(|_, e| now < e.expires);
                prop_assert_eq!(d.len(), model.len());
            }
            Op::Tick(ms) => now += ms,
        }
        d.check_invariants().map_err(TestCaseError::fail)?;
        prop_assert_eq!(d.used_bytes() + d.free_space(), d.capacity());
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    #[test]
    fn matches_model_one_shard(ops in proptest::collection::vec(op(6, 24), 1..120)) {
        check_model(&SharedDict::with_shards("m", 1 << 20, 1), &ops)?;
    }

    #[test]
    fn matches_model_many_shards(ops in proptest::collection::vec(op(12, 24), 1..120)) {
        check_model(&SharedDict::with_shards("m", 1 << 20, 8), &ops)?;
    }

    /// Under pressure: capacity is never exceeded, a plain `Stored` or any
    /// safe store never loses a live key, `StoredEvicted` always does, and a
    /// stored value is readable right after.
    #[test]
    fn bounded_under_pressure(
        cap in 200usize..3000,
        shards in 1usize..5,
        ops in proptest::collection::vec(op(20, 300), 1..150),
    ) {
        let d = SharedDict::with_shards("p", cap, shards);
        let mut now = 1_000u64;
        let mut out = Vec::new();
        for op in &ops {
            let before: BTreeSet<Vec<u8>> = d.get_keys(0, now).into_iter().collect();
            match op {
                Op::Store(kind, k, v, ttl, flags) => {
                    let k = key(*k);
                    let old = d.get(&k, now, &mut out).map(|h| (hit_model(h.value, &out), h.flags));
                    let res = match kind {
                        Kind::Set => d.set(&k, v.as_value(), *ttl, *flags, now),
                        Kind::SafeSet => d.safe_set(&k, v.as_value(), *ttl, *flags, now),
                        Kind::Add => d.add(&k, v.as_value(), *ttl, *flags, now),
                        Kind::SafeAdd => d.safe_add(&k, v.as_value(), *ttl, *flags, now),
                        Kind::Replace => d.replace(&k, v.as_value(), *ttl, *flags, now),
                    };
                    let after: BTreeSet<Vec<u8>> = d.get_keys(0, now).into_iter().collect();
                    let lost: Vec<_> = before.iter().filter(|x| **x != k && !after.contains(*x)).collect();
                    match res {
                        SetResult::Stored => {
                            prop_assert!(lost.is_empty(), "Stored lost {:?}", lost);
                            let got = d.get(&k, now, &mut out).map(|h| (hit_model(h.value, &out), h.flags));
                            prop_assert_eq!(got, v.model().map(|m| (m, *flags)));
                        }
                        SetResult::StoredEvicted => {
                            prop_assert!(matches!(kind, Kind::Set | Kind::Add | Kind::Replace));
                            prop_assert!(!lost.is_empty(), "StoredEvicted lost nothing");
                            let got = d.get(&k, now, &mut out).map(|h| (hit_model(h.value, &out), h.flags));
                            prop_assert_eq!(got, v.model().map(|m| (m, *flags)));
                        }
                        SetResult::NoMemory => {
                            prop_assert!(lost.is_empty(), "NoMemory lost {:?}", lost);
                            let now_val = d.get(&k, now, &mut out).map(|h| (hit_model(h.value, &out), h.flags));
                            prop_assert_eq!(now_val, old, "a failed store changes nothing");
                        }
                        SetResult::Exists | SetResult::NotFound => {
                            prop_assert!(lost.is_empty());
                        }
                        SetResult::InvalidKey => prop_assert!(false, "valid keys only"),
                    }
                }
                Op::Incr(k, by, init, ttl) => {
                    let r = d.incr(&key(*k), f64::from(*by), init.map(f64::from), *ttl, now);
                    let after: BTreeSet<Vec<u8>> = d.get_keys(0, now).into_iter().collect();
                    let lost = before.iter().filter(|x| !after.contains(*x)).count();
                    let forcible = matches!(r, Ok(i) if i.forcible);
                    prop_assert_eq!(lost > 0, forcible);
                }
                Op::Get(k) => { d.get(&key(*k), now, &mut out); }
                Op::GetStale(k) => { d.get_stale(&key(*k), now, &mut out); }
                Op::Delete(k) => { d.delete(&key(*k), now); }
                Op::Ttl(k) => { d.ttl(&key(*k), now); }
                Op::Expire(k, t) => { d.expire(&key(*k), *t, now); }
                Op::Keys => {}
                Op::FlushAll => d.flush_all(),
                Op::FlushExpired => { d.flush_expired(0, now); }
                Op::Tick(ms) => now += ms,
            }
            d.check_invariants().map_err(TestCaseError::fail)?;
            prop_assert!(d.used_bytes() <= d.capacity());
            prop_assert_eq!(d.used_bytes() + d.free_space(), d.capacity());
        }
    }
}
