//! Many threads on one dictionary: no lost increments, bounds hold.

use std::sync::{Arc, Barrier};
use std::thread;

use pier_shdict::{HitValue, SharedDict, Value};

const TOTAL_INCRS: u32 = 100_000;

fn assert_send_sync<T: Send + Sync>() {}

#[test]
fn dict_and_registry_are_send_and_sync() {
    assert_send_sync::<SharedDict>();
    assert_send_sync::<pier_shdict::Registry>();
}

fn hammer_incr(threads: u32, dict: &Arc<SharedDict>) {
    let keys: [&[u8]; 4] = [b"a", b"b", b"c", b"d"];
    let per_thread = TOTAL_INCRS / threads;
    let barrier = Arc::new(Barrier::new(threads as usize));
    let handles: Vec<_> = (0..threads)
        .map(|t| {
            let d = Arc::clone(dict);
            let barrier = Arc::clone(&barrier);
            thread::spawn(move || {
                barrier.wait();
                for i in 0..per_thread {
                    // Offset by thread so threads collide on every key.
                    let k = keys[((i + t) % 4) as usize];
                    d.incr(k, 1.0, Some(0.0), 0, 1).expect("incr");
                }
            })
        })
        .collect();
    for h in handles {
        h.join().expect("worker panicked");
    }
    let mut sum = 0.0;
    let mut out = Vec::new();
    for k in keys {
        match dict.get(k, 1, &mut out).expect("key present").value {
            HitValue::Number(n) => sum += n,
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(
        sum,
        f64::from(per_thread * threads),
        "{threads} threads lost increments"
    );
    dict.check_invariants().unwrap();
}

#[test]
fn concurrent_incr_loses_nothing() {
    for threads in [2, 4, 8] {
        // Several shards, and a single shard (all threads on one lock).
        hammer_incr(threads, &Arc::new(SharedDict::with_shards("c", 1 << 20, 4)));
        hammer_incr(
            threads,
            &Arc::new(SharedDict::with_shards("c1", 1 << 20, 1)),
        );
    }
}

#[test]
fn concurrent_mixed_writes_stay_bounded() {
    let d = Arc::new(SharedDict::with_shards("m", 16 * 1024, 4));
    let threads = 4u32;
    let handles: Vec<_> = (0..threads)
        .map(|t| {
            let d = Arc::clone(&d);
            thread::spawn(move || {
                let mut out = Vec::new();
                let val = vec![b'v'; 700];
                for i in 0..20_000u32 {
                    let k = format!("k{}", (i * 7 + t) % 300);
                    let now = u64::from(i);
                    match i % 5 {
                        0 => {
                            d.set(
                                k.as_bytes(),
                                Value::Str(&val[..(i % 700) as usize]),
                                50,
                                t,
                                now,
                            );
                        }
                        1 => {
                            d.safe_add(k.as_bytes(), Value::Number(1.0), 0, 0, now);
                        }
                        2 => {
                            let _ = d.incr(k.as_bytes(), 1.0, Some(0.0), 20, now);
                        }
                        3 => {
                            d.get(k.as_bytes(), now, &mut out);
                        }
                        _ => {
                            if i % 1000 == 4 {
                                d.flush_expired(10, now);
                            } else {
                                d.delete(k.as_bytes(), now);
                            }
                        }
                    }
                    assert!(d.used_bytes() <= d.capacity());
                }
            })
        })
        .collect();
    for h in handles {
        h.join().expect("worker panicked");
    }
    d.check_invariants().unwrap();
    assert_eq!(d.used_bytes() + d.free_space(), d.capacity());
}
