//! Fields a log hook adds to the request's analytics event
//! (`pier.analytics.field(name, value)` in Lua, docs/analytics.md).
//!
//! The log phase runs to its end without yielding, and the logging step
//! that reads the fields follows it on the same thread with no other
//! request in between, so a thread-local is the request's own for that
//! span: [`take`] clears it for the next request whatever happens. Bounded:
//! at most [`MAX_FIELDS`] fields, names of [`MAX_NAME`] bytes and values of
//! [`MAX_VALUE`] bytes.

use std::cell::RefCell;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};

pub const MAX_FIELDS: usize = 16;
pub const MAX_NAME: usize = 64;
pub const MAX_VALUE: usize = 256;

/// Set while analytics runs: without it, [`set`] keeps nothing (no request
/// would take the fields).
static ENABLED: AtomicBool = AtomicBool::new(false);

/// (name, value) pairs in one buffer: `(name_len, value_len)` and bytes.
type Fields = (Vec<(u16, u16)>, Vec<u8>);

thread_local! {
    static FIELDS: RefCell<Fields> = const { RefCell::new((Vec::new(), Vec::new())) };
}

pub fn enable(on: bool) {
    ENABLED.store(on, Relaxed);
}

/// Why a field was refused.
#[derive(Debug, PartialEq, Eq)]
pub enum Refused {
    Name,
    Value,
    TooMany,
}

/// Adds (or replaces) a field of the current request's event.
pub fn set(name: &[u8], value: &[u8]) -> Result<(), Refused> {
    if name.is_empty()
        || name.len() > MAX_NAME
        || !name
            .iter()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.'))
    {
        return Err(Refused::Name);
    }
    if value.len() > MAX_VALUE {
        return Err(Refused::Value);
    }
    if !ENABLED.load(Relaxed) {
        return Ok(());
    }
    FIELDS.with(|f| {
        let (index, bytes) = &mut *f.borrow_mut();
        // Replace: rebuild without the old pair (at most 16 small fields).
        let mut off = 0;
        let mut found = None;
        for (i, (n, v)) in index.iter().enumerate() {
            if &bytes[off..off + *n as usize] == name {
                found = Some((i, off, (*n + *v) as usize));
            }
            off += (*n + *v) as usize;
        }
        if let Some((i, at, len)) = found {
            index.remove(i);
            bytes.drain(at..at + len);
        } else if index.len() >= MAX_FIELDS {
            return Err(Refused::TooMany);
        }
        index.push((name.len() as u16, value.len() as u16));
        bytes.extend_from_slice(name);
        bytes.extend_from_slice(value);
        Ok(())
    })
}

/// Calls `f` with the fields set since the last call, then clears them.
pub fn take<R>(f: impl FnOnce(&[(&[u8], &[u8])]) -> R) -> R {
    FIELDS.with(|cell| {
        let (index, bytes) = &mut *cell.borrow_mut();
        if index.is_empty() {
            return f(&[]);
        }
        let mut pairs: [(&[u8], &[u8]); MAX_FIELDS] = [(&[], &[]); MAX_FIELDS];
        let mut off = 0;
        for (i, (n, v)) in index.iter().enumerate() {
            let (n, v) = (*n as usize, *v as usize);
            pairs[i] = (&bytes[off..off + n], &bytes[off + n..off + n + v]);
            off += n + v;
        }
        let r = f(&pairs[..index.len()]);
        index.clear();
        bytes.clear();
        r
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fields_are_bounded_replaced_and_taken_once() {
        enable(true);
        assert_eq!(set(b"", b"x"), Err(Refused::Name));
        assert_eq!(set(b"a b", b"x"), Err(Refused::Name));
        assert_eq!(set(&[b'n'; 65], b"x"), Err(Refused::Name));
        assert_eq!(set(b"n", &[b'v'; 257]), Err(Refused::Value));
        set(b"user", b"alice").unwrap();
        set(b"plan", b"free").unwrap();
        set(b"user", b"bob").unwrap();
        take(|f| {
            assert_eq!(
                f,
                &[(&b"plan"[..], &b"free"[..]), (&b"user"[..], &b"bob"[..])]
            )
        });
        take(|f| assert!(f.is_empty()));
        for i in 0..MAX_FIELDS {
            set(format!("f{i}").as_bytes(), b"").unwrap();
        }
        assert_eq!(set(b"one-more", b""), Err(Refused::TooMany));
        assert_eq!(take(|f| f.len()), MAX_FIELDS);
    }
}
