//! What an evicted object leaves behind, taken over by the next store on the
//! same worker thread (issue 34: a stored miss should cost about what a plain
//! proxied request costs).
//!
//! A full zone evicts, in its steady state, about one object per stored miss,
//! usually one like it. Its body's buffer and its field map then serve the
//! next miss instead of going back to glibc and being asked for again: for a
//! 4 KiB body the free alone was ~540 instructions (it is past glibc's
//! per-thread caches and coalesces), the malloc ~300, and the field map two
//! more of each. This is the slab of the issue without a slab allocator: the
//! zone's memory is still counted by `Object::size`, and what waits here is
//! bounded per thread (`MAX_BODIES` buffers of at most `MAX_BODY` bytes each;
//! `MAX_HEADERS` maps of at most `MAX_HEADER_BYTES`).
//!
//! Only what nobody else holds is kept: an object a hit still serves, or a
//! body a follower still streams, is freed as before when the last one lets
//! go of it.

use crate::memory::Entry;
use bytes::{Bytes, BytesMut};
use pier_http::Headers;
use std::cell::RefCell;

const MAX_BODIES: usize = 16;
const MAX_BODY: usize = 64 << 10;
const MAX_HEADERS: usize = 64;
const MAX_HEADER_BYTES: usize = 8 << 10;

thread_local! {
    static BODIES: RefCell<Vec<BytesMut>> = const { RefCell::new(Vec::new()) };
    static HEADERS: RefCell<Vec<Headers>> = const { RefCell::new(Vec::new()) };
}

/// Whether a buffer of `cap` bytes holding `len` is close enough to its
/// length to be stored as it is (the zone counts `len`; what is past it is
/// memory the zone does not see).
pub fn tight(cap: usize, len: usize) -> bool {
    cap >= len && cap <= len + len / 8 + 64
}

/// An empty field map: a spare one when there is one (its storage grown to
/// a head's usual size already).
pub fn headers() -> Headers {
    HEADERS
        .try_with(|h| h.borrow_mut().pop())
        .ok()
        .flatten()
        .unwrap_or_default()
}

/// Keep `h`'s storage for a later `headers()` (dropped when it is large or
/// the thread keeps enough).
pub fn give_headers(mut h: Headers) {
    if h.capacity_bytes() > MAX_HEADER_BYTES || h.capacity_bytes() == 0 {
        return;
    }
    h.clear();
    // `try_with`: a map dropped while its thread ends just frees.
    let _ = HEADERS.try_with(|l| {
        let mut l = l.borrow_mut();
        if l.len() < MAX_HEADERS {
            l.push(h);
        }
    });
}

/// `data` in a buffer of its own that `tight` accepts: a spare one when one
/// fits, else a new one.
pub fn body_copy(data: &[u8]) -> Bytes {
    let n = data.len();
    let spare = BODIES
        .try_with(|b| {
            let mut b = b.borrow_mut();
            let i = b.iter().position(|m| tight(m.capacity(), n))?;
            Some(b.swap_remove(i))
        })
        .ok()
        .flatten();
    match spare {
        Some(mut m) => {
            m.clear();
            m.extend_from_slice(data);
            m.freeze()
        }
        None => Bytes::copy_from_slice(data),
    }
}

fn give_body(body: Bytes) {
    if body.is_empty() || body.len() > MAX_BODY {
        return;
    }
    // Unique and vector-backed (not a mapping, not a slice of a larger
    // buffer): its whole buffer comes back.
    let Ok(m) = body.try_into_mut() else {
        return;
    };
    if m.capacity() > MAX_BODY {
        return;
    }
    let _ = BODIES.try_with(|l| {
        let mut l = l.borrow_mut();
        if l.len() < MAX_BODIES {
            l.push(m);
        }
    });
}

/// The evicted entries' bodies and field maps that nobody else holds, kept
/// for the next stores; the rest is dropped as usual.
pub(crate) fn recycle(entries: impl IntoIterator<Item = Entry>) {
    for e in entries {
        for slot in e.slots {
            let Ok(obj) = std::sync::Arc::try_unwrap(slot.obj) else {
                continue;
            };
            if obj.mapped.is_none() {
                give_body(obj.body);
            }
            give_headers(obj.headers);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_evicted_body_serves_the_next_copy_of_its_size() {
        // Other tests on this thread may have left spares: start clean.
        BODIES.with(|b| b.borrow_mut().clear());
        let first = body_copy(&[1u8; 4096]);
        let ptr = first.as_ptr();
        give_body(first);
        let again = body_copy(&[2u8; 4000]);
        assert_eq!(again.as_ptr(), ptr, "the spare buffer was reused");
        assert_eq!(&again[..], &[2u8; 4000][..]);
        // Too small for it (not tight): a buffer of its own.
        give_body(again);
        let small = body_copy(&[3u8; 100]);
        assert_ne!(small.as_ptr(), ptr);
        assert_eq!(&small[..], &[3u8; 100][..]);
        // A body still held elsewhere is not taken.
        let held = body_copy(&[4u8; 2048]);
        let other = held.clone();
        give_body(held);
        assert_eq!(&other[..], &[4u8; 2048][..]);
        assert!(BODIES.with(|b| b.borrow().iter().all(|m| m.capacity() != 2048)));
    }

    #[test]
    fn the_spares_are_bounded() {
        BODIES.with(|b| b.borrow_mut().clear());
        for _ in 0..MAX_BODIES * 2 {
            give_body(Bytes::from(vec![0u8; 1024]));
        }
        give_body(Bytes::from(vec![0u8; MAX_BODY + 1]));
        BODIES.with(|b| {
            let b = b.borrow();
            assert_eq!(b.len(), MAX_BODIES);
            assert!(b.iter().all(|m| m.capacity() <= MAX_BODY));
        });
        for _ in 0..MAX_HEADERS * 2 {
            let mut h = Headers::default();
            h.append(b"x-a", b"1");
            give_headers(h);
        }
        HEADERS.with(|h| assert_eq!(h.borrow().len(), MAX_HEADERS));
        let h = headers();
        assert!(h.is_empty() && h.capacity_bytes() > 0);
    }
}
