//! The hot paths do not allocate: `get` hits into a grown buffer, `get`
//! misses and `incr` hits; an overwriting `set` allocates only its entry.
//!
//! Counted with a global allocator that forwards to `System` and counts
//! allocations made by the current thread while counting is on.

#![allow(unsafe_code)] // the counting allocator below; nothing else

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

use pier_shdict::{HitValue, SharedDict, Value};

thread_local! {
    // Const-initialised `Cell`s: no lazy init, no destructor, so using them
    // inside the allocator cannot recurse into it.
    static COUNTING: Cell<bool> = const { Cell::new(false) };
    static ALLOCS: Cell<u64> = const { Cell::new(0) };
}

fn note_alloc() {
    let _ = COUNTING.try_with(|on| {
        if on.get() {
            let _ = ALLOCS.try_with(|n| n.set(n.get() + 1));
        }
    });
}

struct Counting;

// SAFETY: every method forwards its arguments unchanged to `System`, which
// upholds the `GlobalAlloc` contract; counting touches only thread-locals.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        note_alloc();
        // SAFETY: the caller's contract for `alloc` is passed on as is.
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        note_alloc();
        // SAFETY: as above.
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        note_alloc();
        // SAFETY: `ptr`/`layout` came from this allocator, i.e. from `System`.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr`/`layout` came from this allocator, i.e. from `System`.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

fn allocs_during(f: impl FnOnce()) -> u64 {
    ALLOCS.with(|n| n.set(0));
    COUNTING.with(|c| c.set(true));
    f();
    COUNTING.with(|c| c.set(false));
    ALLOCS.with(|n| n.get())
}

#[test]
fn hot_paths_do_not_allocate() {
    let d = SharedDict::with_shards("h", 1 << 20, 4);
    let big = vec![b'x'; 3000];
    d.set(b"small", Value::Str(b"value"), 0, 0, 1);
    d.set(b"big", Value::Str(&big), 0, 0, 1);
    d.set(b"n", Value::Number(1.0), 0, 0, 1);
    d.set(b"b", Value::Bool(true), 0, 0, 1);

    let mut out = Vec::new();
    // The first read grows the buffer (outside the lock).
    assert_eq!(
        allocs_during(|| assert!(d.get(b"big", 1, &mut out).is_some())),
        1
    );

    let n = allocs_during(|| {
        for _ in 0..1000 {
            assert_eq!(d.get(b"big", 1, &mut out).unwrap().value, HitValue::Str);
            assert_eq!(d.get(b"small", 1, &mut out).unwrap().value, HitValue::Str);
            assert!(d.get_stale(b"n", 1, &mut out).is_some());
            assert!(d.get(b"b", 1, &mut out).is_some());
            assert!(d.get(b"missing", 1, &mut out).is_none());
            d.incr(b"n", 1.0, Some(0.0), 0, 1).unwrap();
            assert!(d.ttl(b"n", 1).is_some());
        }
    });
    assert_eq!(n, 0, "get/incr/ttl hits and misses allocate nothing");
    assert_eq!(out.len(), 0, "a miss leaves the buffer empty");

    // Overwriting a key in steady state: exactly the new entry's buffer.
    d.set(b"small", Value::Str(b"other"), 0, 0, 1);
    assert_eq!(
        allocs_during(|| assert!(d.set(b"small", Value::Str(b"again"), 0, 0, 1).is_ok())),
        1
    );
    assert_eq!(
        allocs_during(|| assert!(d.set(b"n", Value::Number(5.0), 0, 0, 1).is_ok())),
        1
    );
}
