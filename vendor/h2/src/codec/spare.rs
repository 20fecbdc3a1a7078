//! Pier: per-thread lists of buffers that connections gave back while they
//! wait, for the next connection that reads or writes (one list per kind:
//! `framed_read`'s 8 KiB read buffers, `framed_write`'s 16 KiB write
//! buffers). Bounded, so the buffers of connections that stay idle are
//! freed rather than held for them.

use bytes::BytesMut;
use std::cell::RefCell;
use std::thread::LocalKey;

pub(super) type List = RefCell<Vec<BytesMut>>;

/// A buffer from `list`, if it has one.
pub(super) fn take(list: &'static LocalKey<List>) -> Option<BytesMut> {
    list.with(|s| s.borrow_mut().pop())
}

/// Keep `b` in `list` (at most `max` there) when it is whole at its usual
/// `size`: nothing split off it still held (`try_reclaim` then brings its
/// room back to the front) and not grown past four times the size for a
/// large frame. A buffer whose room cannot be seen could pin a frame's worth.
pub(super) fn give(list: &'static LocalKey<List>, mut b: BytesMut, size: usize, max: usize) {
    b.clear();
    if !b.try_reclaim(size) || b.capacity() > 4 * size {
        return;
    }
    list.with(|s| {
        let mut s = s.borrow_mut();
        if s.len() < max {
            s.push(b);
        }
    });
}
