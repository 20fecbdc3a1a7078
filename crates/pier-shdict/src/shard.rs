//! One shard: a hash table of slab indices, the slab of entries, and an
//! intrusive LRU list threaded through the slab (`prev`/`next` are indices).
//!
//! Everything here runs under the shard's mutex, so nothing here blocks,
//! and the hot paths (lookup, touch, in-place number update) never allocate.

use hashbrown::HashTable;

/// Fixed bytes charged per entry on top of key and value: its slab slot
/// (`size_of::<Entry>()`, 64 bytes on 64-bit targets), its hash-table slot
/// (4-byte index + control byte, with load-factor headroom: 8) and its heap
/// buffer's allocator header and rounding (16). Charging it keeps a
/// dictionary of tiny entries bounded too.
pub const ENTRY_OVERHEAD: usize = 88;

/// "No slot": list ends and the empty free list.
pub(crate) const NIL: u32 = u32::MAX;
/// `expires_at` of an entry that never expires.
pub(crate) const NEVER: u64 = u64::MAX;
/// `expires_at` set by `flush_all`: expired at any `now`.
pub(crate) const FLUSHED: u64 = 0;

// Stored kinds use Lua's type numbers (LUA_TBOOLEAN, LUA_TNUMBER, LUA_TSTRING)
// so the FFI layer can hand them to Lua unchanged; 0 (LUA_TNIL) marks a free slot.
pub(crate) const KIND_FREE: u8 = 0;
pub(crate) const KIND_BOOL: u8 = 1;
pub(crate) const KIND_NUMBER: u8 = 3;
pub(crate) const KIND_STR: u8 = 4;

/// Bytes a value of `kind` with `str_len` string bytes is charged for
/// (as ngx.shared: a number is 8 bytes, a boolean 1).
#[inline]
pub(crate) fn value_bytes(kind: u8, str_len: usize) -> usize {
    match kind {
        KIND_BOOL => 1,
        KIND_NUMBER => 8,
        _ => str_len,
    }
}

/// Whether an entry expiring at `expires_at` is expired at `now`. An entry
/// lives for `[set time, set time + ttl)`.
#[inline]
pub(crate) fn is_expired(expires_at: u64, now: u64) -> bool {
    now >= expires_at
}

/// A fully built entry, prepared outside the lock so that a store holds it
/// only to link the entry in.
pub(crate) struct NewEntry {
    /// Key bytes followed by the string value's bytes.
    pub data: Box<[u8]>,
    pub key_len: u32,
    pub kind: u8,
    /// The number, or 0/1 for a boolean.
    pub num: f64,
    pub flags: u32,
    pub expires_at: u64,
}

impl NewEntry {
    pub fn size(&self) -> usize {
        let key_len = self.key_len as usize;
        key_len + value_bytes(self.kind, self.data.len() - key_len) + ENTRY_OVERHEAD
    }
}

pub(crate) struct Entry {
    pub hash: u64,
    pub expires_at: u64,
    pub num: f64,
    /// Key bytes followed by the string value's bytes: one allocation per entry.
    pub data: Box<[u8]>,
    pub key_len: u32,
    pub flags: u32,
    /// Towards the most recently used end; NIL at the head.
    pub prev: u32,
    /// Towards the least recently used end; NIL at the tail. On a free slot:
    /// the next free slot.
    pub next: u32,
    pub kind: u8,
}

impl Entry {
    #[inline]
    pub fn key(&self) -> &[u8] {
        &self.data[..self.key_len as usize]
    }

    #[inline]
    pub fn str_value(&self) -> &[u8] {
        &self.data[self.key_len as usize..]
    }

    #[inline]
    pub fn size(&self) -> usize {
        let key_len = self.key_len as usize;
        key_len + value_bytes(self.kind, self.data.len() - key_len) + ENTRY_OVERHEAD
    }
}

/// How a store treats an existing key (the ngx.shared `set`/`add`/`replace` family).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum StoreOp {
    Set,
    Add,
    Replace,
}

/// Outcome of `Shard::store`, mapped to `SetResult` by the caller.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Stored {
    Ok { evicted_valid: bool },
    Exists,
    NotFound,
    NoMemory,
}

pub(crate) struct Shard {
    table: HashTable<u32>,
    pub slots: Vec<Entry>,
    free_head: u32,
    /// Most recently used.
    head: u32,
    /// Least recently used: the next eviction victim.
    tail: u32,
    len: usize,
    used: usize,
    cap: usize,
}

impl Shard {
    pub fn new(cap: usize) -> Self {
        Shard {
            table: HashTable::new(),
            slots: Vec::new(),
            free_head: NIL,
            head: NIL,
            tail: NIL,
            len: 0,
            used: 0,
            cap,
        }
    }

    pub fn cap(&self) -> usize {
        self.cap
    }

    pub fn used(&self) -> usize {
        self.used
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn head(&self) -> u32 {
        self.head
    }

    #[inline]
    pub fn find(&self, hash: u64, key: &[u8]) -> Option<u32> {
        let slots = &self.slots;
        self.table
            .find(hash, |&i| slots[i as usize].key() == key)
            .copied()
    }

    #[inline]
    pub fn entry(&self, i: u32) -> &Entry {
        &self.slots[i as usize]
    }

    #[inline]
    pub fn entry_mut(&mut self, i: u32) -> &mut Entry {
        &mut self.slots[i as usize]
    }

    // === LRU list ===

    fn unlink(&mut self, i: u32) {
        let (prev, next) = {
            let e = &self.slots[i as usize];
            (e.prev, e.next)
        };
        if prev == NIL {
            self.head = next;
        } else {
            self.slots[prev as usize].next = next;
        }
        if next == NIL {
            self.tail = prev;
        } else {
            self.slots[next as usize].prev = prev;
        }
    }

    fn push_front(&mut self, i: u32) {
        let old_head = self.head;
        {
            let e = &mut self.slots[i as usize];
            e.prev = NIL;
            e.next = old_head;
        }
        if old_head == NIL {
            self.tail = i;
        } else {
            self.slots[old_head as usize].prev = i;
        }
        self.head = i;
    }

    /// Marks `i` most recently used.
    #[inline]
    pub fn touch(&mut self, i: u32) {
        if self.head != i {
            self.unlink(i);
            self.push_front(i);
        }
    }

    // === insert / remove ===

    /// Unlinks and frees slot `i`, returning its buffer so the caller may drop
    /// it after releasing the lock.
    pub fn remove(&mut self, i: u32) -> Box<[u8]> {
        let hash = self.slots[i as usize].hash;
        if let Ok(found) = self.table.find_entry(hash, |&j| j == i) {
            found.remove();
        }
        self.unlink(i);
        let size = self.slots[i as usize].size();
        self.used -= size;
        self.len -= 1;
        let free_head = self.free_head;
        let e = &mut self.slots[i as usize];
        e.kind = KIND_FREE;
        e.next = free_head;
        e.prev = NIL;
        self.free_head = i;
        std::mem::take(&mut e.data)
    }

    /// Links a new entry in as most recently used. The caller has made room.
    fn insert(&mut self, hash: u64, new: NewEntry) -> u32 {
        self.used += new.size();
        self.len += 1;
        let entry = Entry {
            hash,
            expires_at: new.expires_at,
            num: new.num,
            data: new.data,
            key_len: new.key_len,
            flags: new.flags,
            prev: NIL,
            next: NIL,
            kind: new.kind,
        };
        let i = if self.free_head != NIL {
            let i = self.free_head;
            self.free_head = self.slots[i as usize].next;
            self.slots[i as usize] = entry;
            i
        } else {
            // Slot indices are u32 to keep entries small; 4 billion entries of
            // at least ENTRY_OVERHEAD bytes cannot fit in any sane capacity.
            let i = u32::try_from(self.slots.len()).expect("shard slot index overflow");
            self.slots.push(entry);
            i
        };
        let slots = &self.slots;
        self.table
            .insert_unique(hash, i, |&j| slots[j as usize].hash);
        self.push_front(i);
        i
    }

    /// Overwrites entry `i` in place with `new` (same key), returning the old
    /// buffer. The caller has checked that the size change fits.
    fn overwrite(&mut self, i: u32, new: NewEntry) -> Box<[u8]> {
        let old_size = self.slots[i as usize].size();
        self.used = self.used - old_size + new.size();
        let e = &mut self.slots[i as usize];
        e.expires_at = new.expires_at;
        e.num = new.num;
        e.flags = new.flags;
        e.kind = new.kind;
        e.key_len = new.key_len;
        let old = std::mem::replace(&mut e.data, new.data);
        self.touch(i);
        old
    }

    // === expiry and eviction ===

    /// Frees up to `max` expired entries from the LRU tail, stopping at the
    /// first live one (ngx.shared does this before every write, so expired
    /// entries do not linger where writes happen).
    pub fn reclaim_expired_tail(&mut self, now: u64, max: usize) {
        for _ in 0..max {
            let t = self.tail;
            if t == NIL || !is_expired(self.slots[t as usize].expires_at, now) {
                return;
            }
            drop(self.remove(t));
        }
    }

    /// The `set`/`add`/`replace` family. `new == None` deletes (storing nil).
    /// `forcible` allows evicting live entries from the LRU tail to make room.
    /// Also returns the buffer the store freed, if any, for the caller to
    /// drop outside the lock.
    pub fn store(
        &mut self,
        hash: u64,
        key: &[u8],
        new: Option<NewEntry>,
        op: StoreOp,
        forcible: bool,
        now: u64,
    ) -> (Stored, Option<Box<[u8]>>) {
        self.reclaim_expired_tail(now, 2);
        let mut found = self.find(hash, key);
        let live = found.is_some_and(|i| !is_expired(self.slots[i as usize].expires_at, now));
        match op {
            StoreOp::Add if live => return (Stored::Exists, None),
            StoreOp::Replace if !live => return (Stored::NotFound, None),
            _ => {}
        }
        let ok = Stored::Ok {
            evicted_valid: false,
        };
        let Some(new) = new else {
            return (ok, found.map(|i| self.remove(i)));
        };
        let need = new.size();
        if need > self.cap {
            return (Stored::NoMemory, None);
        }

        let old_size =
            |s: &Shard, found: Option<u32>| found.map_or(0, |i| s.slots[i as usize].size());
        let fits = |s: &Shard, found: Option<u32>| s.used - old_size(s, found) + need <= s.cap;

        // Expired entries at the tail are free to take: reclaim them first.
        while !fits(self, found) {
            let t = self.tail;
            if t == NIL || !is_expired(self.slots[t as usize].expires_at, now) {
                break;
            }
            if found == Some(t) {
                found = None;
            }
            drop(self.remove(t));
        }

        let mut evicted_valid = false;
        let mut garbage = None;
        if !fits(self, found) {
            if !forcible {
                // The old value (if any) stays: a failed safe store changes nothing.
                return (Stored::NoMemory, None);
            }
            // Replacing: the old entry goes first, so it is never counted as
            // a forcible eviction and never blocks the tail.
            garbage = found.take().map(|i| self.remove(i));
            // Terminates: `need <= cap`, so an empty shard always fits.
            while self.used + need > self.cap {
                let t = self.tail;
                evicted_valid |= !is_expired(self.slots[t as usize].expires_at, now);
                drop(self.remove(t));
            }
        }

        match found {
            Some(i) => garbage = Some(self.overwrite(i, new)),
            None => {
                self.insert(hash, new);
            }
        }
        (Stored::Ok { evicted_valid }, garbage)
    }

    /// Marks every entry expired (ngx.shared `flush_all`: memory is reclaimed
    /// lazily, and `get_stale` still sees the values until then).
    pub fn flush_all(&mut self) {
        let mut i = self.head;
        while i != NIL {
            let e = &mut self.slots[i as usize];
            e.expires_at = FLUSHED;
            i = e.next;
        }
    }

    /// Frees expired entries, walking from the LRU tail, at most `max`.
    pub fn flush_expired(&mut self, now: u64, max: usize) -> usize {
        let mut freed = 0;
        let mut i = self.tail;
        while i != NIL && freed < max {
            let prev = self.slots[i as usize].prev;
            if is_expired(self.slots[i as usize].expires_at, now) {
                drop(self.remove(i));
                freed += 1;
            }
            i = prev;
        }
        freed
    }

    /// Verifies the shard's internal invariants (tests only; O(n)).
    pub fn check(&self) -> Result<(), String> {
        let mut count = 0;
        let mut bytes = 0;
        let mut prev = NIL;
        let mut i = self.head;
        while i != NIL {
            let e = &self.slots[i as usize];
            if e.kind == KIND_FREE {
                return Err(format!("free slot {i} on the LRU list"));
            }
            if e.prev != prev {
                return Err(format!("slot {i}: prev {} != {prev}", e.prev));
            }
            if self.find(e.hash, e.key()) != Some(i) {
                return Err(format!("slot {i} not found by its key"));
            }
            count += 1;
            bytes += e.size();
            if count > self.slots.len() {
                return Err("LRU list has a cycle".into());
            }
            prev = i;
            i = e.next;
        }
        if prev != self.tail {
            return Err(format!("tail {} != last list slot {prev}", self.tail));
        }
        if count != self.len || count != self.table.len() {
            return Err(format!(
                "list has {count} entries, len {}, table {}",
                self.len,
                self.table.len()
            ));
        }
        if bytes != self.used {
            return Err(format!(
                "entries sum to {bytes} bytes, used says {}",
                self.used
            ));
        }
        if self.used > self.cap {
            return Err(format!("used {} > capacity {}", self.used, self.cap));
        }
        let mut free = 0;
        let mut f = self.free_head;
        while f != NIL {
            if self.slots[f as usize].kind != KIND_FREE {
                return Err(format!("live slot {f} on the free list"));
            }
            free += 1;
            if free > self.slots.len() {
                return Err("free list has a cycle".into());
            }
            f = self.slots[f as usize].next;
        }
        if free + count != self.slots.len() {
            return Err(format!(
                "{free} free + {count} live != {} slots",
                self.slots.len()
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[cfg(target_pointer_width = "64")]
    fn overhead_covers_the_slot() {
        // ENTRY_OVERHEAD's doc adds up from this size: keep them in step.
        assert_eq!(std::mem::size_of::<Entry>(), 64);
        assert_eq!(ENTRY_OVERHEAD, 64 + 8 + 16);
    }
}
