//! A header map that owns one byte arena and keeps well-known headers in
//! fixed slots.
//!
//! The head as read from the socket is copied once into `arena` (a memcpy of
//! a few hundred bytes into a buffer reused for every request on the
//! connection); names and values are spans into it, so parsing allocates
//! nothing per header. Values set later are appended to the same arena.
//! Removal leaves a tombstone: heads are short-lived, and compaction would
//! cost more than it saves.

use crate::known::{self, Known, UNKNOWN};

const NONE: u16 = u16::MAX;
const REMOVED: Known = UNKNOWN - 1;

#[derive(Clone, Copy, Debug)]
struct Entry {
    name_off: u32,
    val_off: u32,
    name_len: u16,
    known: Known,
    val_len: u32,
}

#[derive(Clone, Debug)]
pub struct Headers {
    arena: Vec<u8>,
    entries: Vec<Entry>,
    slots: [u16; known::COUNT],
    live: usize,
}

impl Default for Headers {
    fn default() -> Self {
        Self::new()
    }
}

impl Headers {
    /// Heap bytes this map holds (its storage's capacity).
    pub fn capacity_bytes(&self) -> usize {
        self.arena.capacity() + self.entries.capacity() * std::mem::size_of::<Entry>()
    }

    pub fn new() -> Self {
        Headers {
            arena: Vec::new(),
            entries: Vec::new(),
            slots: [NONE; known::COUNT],
            live: 0,
        }
    }

    /// Become a copy of `other`, reusing this map's storage (no allocation
    /// once it has grown to the usual size).
    pub fn copy_from(&mut self, other: &Headers) {
        self.arena.clear();
        self.arena.extend_from_slice(&other.arena);
        self.entries.clear();
        self.entries.extend_from_slice(&other.entries);
        self.slots = other.slots;
        self.live = other.live;
    }

    /// `copy_from` into storage sized for `other` plus `bytes` more bytes
    /// and `fields` more fields, allocated once (a stored head that gets
    /// one more field must not grow, and so copy, its storage).
    pub fn copy_from_with_room(&mut self, other: &Headers, bytes: usize, fields: usize) {
        self.arena.clear();
        self.arena.reserve_exact(other.arena.len() + bytes);
        self.entries.clear();
        self.entries.reserve_exact(other.entries.len() + fields);
        self.copy_from(other);
    }

    /// Forget every header but keep the allocations for the next request.
    pub fn clear(&mut self) {
        self.arena.clear();
        self.entries.clear();
        self.slots = [NONE; known::COUNT];
        self.live = 0;
    }

    /// The arena holds the raw head; parsers copy it in first and then add
    /// spans with `push_span`.
    pub(crate) fn arena_mut(&mut self) -> &mut Vec<u8> {
        &mut self.arena
    }

    pub fn arena(&self) -> &[u8] {
        &self.arena
    }

    pub(crate) fn push_span(
        &mut self,
        name_off: usize,
        name_len: usize,
        val_off: usize,
        val_len: usize,
    ) {
        let k = known::lookup(&self.arena[name_off..name_off + name_len]);
        self.push_entry(Entry {
            name_off: name_off as u32,
            name_len: name_len as u16,
            val_off: val_off as u32,
            val_len: val_len as u32,
            known: k,
        });
    }

    fn push_entry(&mut self, e: Entry) {
        if e.known != UNKNOWN && self.slots[e.known as usize] == NONE {
            self.slots[e.known as usize] = self.entries.len() as u16;
        }
        self.entries.push(e);
        self.live += 1;
    }

    /// Number of live headers.
    pub fn len(&self) -> usize {
        self.live
    }

    pub fn is_empty(&self) -> bool {
        self.live == 0
    }

    #[inline]
    fn name_of(&self, e: &Entry) -> &[u8] {
        &self.arena[e.name_off as usize..e.name_off as usize + e.name_len as usize]
    }

    #[inline]
    fn value_of(&self, e: &Entry) -> &[u8] {
        &self.arena[e.val_off as usize..e.val_off as usize + e.val_len as usize]
    }

    /// First value of a well-known header: O(1).
    #[inline]
    pub fn get_known(&self, k: Known) -> Option<&[u8]> {
        match self.slots[k as usize] {
            NONE => None,
            i => Some(self.value_of(&self.entries[i as usize])),
        }
    }

    #[inline]
    pub fn has_known(&self, k: Known) -> bool {
        self.slots[k as usize] != NONE
    }

    /// Every value of a well-known header, in order.
    pub fn get_all_known(&self, k: Known) -> impl Iterator<Item = &[u8]> {
        let start = match self.slots[k as usize] {
            NONE => self.entries.len(),
            i => i as usize,
        };
        self.entries[start..]
            .iter()
            .filter(move |e| e.known == k)
            .map(|e| self.value_of(e))
    }

    /// First value of any header, case-insensitive.
    pub fn get(&self, name: &[u8]) -> Option<&[u8]> {
        let k = known::lookup(name);
        if k != UNKNOWN {
            return self.get_known(k);
        }
        self.entries
            .iter()
            .find(|e| e.known == UNKNOWN && self.name_of(e).eq_ignore_ascii_case(name))
            .map(|e| self.value_of(e))
    }

    /// Every value of a header, case-insensitive.
    pub fn get_all<'a>(&'a self, name: &'a [u8]) -> impl Iterator<Item = &'a [u8]> + 'a {
        let k = known::lookup(name);
        self.entries
            .iter()
            .filter(move |e| {
                if k != UNKNOWN {
                    e.known == k
                } else {
                    e.known == UNKNOWN && self.name_of(e).eq_ignore_ascii_case(name)
                }
            })
            .map(|e| self.value_of(e))
    }

    /// Live headers in order as (name, value).
    pub fn iter(&self) -> impl Iterator<Item = (&[u8], &[u8])> {
        self.entries
            .iter()
            .filter(|e| e.known != REMOVED)
            .map(|e| (self.name_of(e), self.value_of(e)))
    }

    /// Live headers with their slot, for writers that skip hop-by-hop ones.
    pub fn iter_known(&self) -> impl Iterator<Item = (Known, &[u8], &[u8])> {
        self.entries
            .iter()
            .filter(|e| e.known != REMOVED)
            .map(|e| (e.known, self.name_of(e), self.value_of(e)))
    }

    /// Remove every header with this slot.
    pub fn remove_known(&mut self, k: Known) -> bool {
        let start = self.slots[k as usize];
        if start == NONE {
            return false;
        }
        for e in &mut self.entries[start as usize..] {
            if e.known == k {
                e.known = REMOVED;
                self.live -= 1;
            }
        }
        self.slots[k as usize] = NONE;
        true
    }

    /// Remove every header with this name (case-insensitive).
    pub fn remove(&mut self, name: &[u8]) -> bool {
        let k = known::lookup(name);
        if k != UNKNOWN {
            return self.remove_known(k);
        }
        let mut found = false;
        for i in 0..self.entries.len() {
            let e = self.entries[i];
            if e.known == UNKNOWN && self.name_of(&e).eq_ignore_ascii_case(name) {
                self.entries[i].known = REMOVED;
                self.live -= 1;
                found = true;
            }
        }
        found
    }

    /// Remove every unknown header named like the arena bytes at
    /// `off..off + len` (a token of this map's own Connection header), with
    /// no copy of the name.
    pub(crate) fn remove_arena_name(&mut self, off: usize, len: usize) {
        let Some(name) = self.arena.get(off..off + len) else {
            return;
        };
        for e in self.entries.iter_mut() {
            let (no, nl) = (e.name_off as usize, e.name_len as usize);
            if e.known == UNKNOWN && self.arena[no..no + nl].eq_ignore_ascii_case(name) {
                e.known = REMOVED;
                self.live -= 1;
            }
        }
    }

    /// Rewrite the first value of a well-known header in place: `f` gets
    /// its bytes and returns the new length (at most the old one).
    pub fn rewrite_known_value(&mut self, k: Known, f: impl FnOnce(&mut [u8]) -> usize) {
        let i = self.slots[k as usize];
        if i == NONE {
            return;
        }
        let e = self.entries[i as usize];
        let (off, len) = (e.val_off as usize, e.val_len as usize);
        let n = f(&mut self.arena[off..off + len]).min(len);
        self.entries[i as usize].val_len = n as u32;
    }

    /// Append a header (keeps existing ones of the same name).
    /// Room for `fields` more fields of `bytes` bytes of names and values
    /// in all (one growth instead of one per doubling).
    pub fn reserve(&mut self, fields: usize, bytes: usize) {
        self.arena.reserve(bytes);
        self.entries.reserve(fields);
    }

    pub fn append(&mut self, name: &[u8], value: &[u8]) {
        self.append_known(known::lookup(name), name, value);
    }

    /// `append` of a name whose slot the caller already knows (a constant
    /// name: `known::CACHE_STATUS` for `Cache-Status`, `UNKNOWN` for one
    /// without a slot), without the lookup: the cache adds such fields to
    /// every hit and miss. `k` must be `known::lookup(name)`.
    pub fn append_known(&mut self, k: Known, name: &[u8], value: &[u8]) {
        debug_assert_eq!(
            k,
            known::lookup(name),
            "{:?}",
            String::from_utf8_lossy(name)
        );
        let name_off = self.arena.len();
        self.arena.extend_from_slice(name);
        let val_off = self.arena.len();
        self.arena.extend_from_slice(value);
        self.push_entry(Entry {
            name_off: name_off as u32,
            name_len: name.len() as u16,
            val_off: val_off as u32,
            val_len: value.len() as u32,
            known: k,
        });
    }

    /// Replace every header of this name with one value.
    pub fn insert(&mut self, name: &[u8], value: &[u8]) {
        self.remove(name);
        self.append(name, value);
    }

    /// Append `value` to an existing header as `old, value` (X-Forwarded-For).
    pub fn append_list(&mut self, k: Known, value: &[u8]) {
        let name = known::NAMES[k as usize].as_bytes();
        match self.get_known(k) {
            None => self.append(name, value),
            Some(_) => {
                // Join all existing values into one, then the new one.
                let mut joined = Vec::with_capacity(64);
                for v in self.get_all_known(k) {
                    if !joined.is_empty() {
                        joined.extend_from_slice(b", ");
                    }
                    joined.extend_from_slice(v);
                }
                joined.extend_from_slice(b", ");
                joined.extend_from_slice(value);
                self.remove_known(k);
                self.append(name, &joined);
            }
        }
    }

    /// Does a comma-separated header contain `token` (case-insensitive)?
    pub fn has_token(&self, k: Known, token: &[u8]) -> bool {
        self.get_all_known(k).any(|v| {
            v.split(|&b| b == b',')
                .any(|t| trim(t).eq_ignore_ascii_case(token))
        })
    }
}

/// Trim optional whitespace (SP / HTAB) from both ends.
pub fn trim(mut s: &[u8]) -> &[u8] {
    while let [b' ' | b'\t', rest @ ..] = s {
        s = rest;
    }
    while let [rest @ .., b' ' | b'\t'] = s {
        s = rest;
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::known::*;

    #[test]
    fn slots_and_removal() {
        let mut h = Headers::new();
        h.append(b"Host", b"a");
        h.append(b"X-Thing", b"1");
        h.append(b"x-forwarded-for", b"1.1.1.1");
        h.append(b"X-Thing", b"2");
        assert_eq!(h.get_known(HOST), Some(&b"a"[..]));
        assert_eq!(h.get(b"x-thing"), Some(&b"1"[..]));
        assert_eq!(h.get_all(b"X-THING").count(), 2);
        h.append_list(X_FORWARDED_FOR, b"2.2.2.2");
        assert_eq!(h.get_known(X_FORWARDED_FOR), Some(&b"1.1.1.1, 2.2.2.2"[..]));
        assert!(h.remove(b"x-thing"));
        assert_eq!(h.get(b"x-thing"), None);
        assert_eq!(h.len(), 2);
        h.insert(b"Host", b"b");
        assert_eq!(h.get(b"host"), Some(&b"b"[..]));
        assert_eq!(h.iter().count(), 2);
    }

    #[test]
    fn tokens() {
        let mut h = Headers::new();
        h.append(b"Connection", b"keep-alive, Upgrade");
        assert!(h.has_token(CONNECTION, b"upgrade"));
        assert!(!h.has_token(CONNECTION, b"close"));
        assert_eq!(trim(b" \tx \t"), b"x");
    }
}
