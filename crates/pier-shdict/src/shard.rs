//! One shard: a hash table of slab indices, the slab of entries, and an
//! intrusive LRU list threaded through the slab (`prev`/`next` are indices).
//!
//! Everything here runs under the shard's mutex, so nothing here blocks,
//! and the hot paths (lookup, touch, in-place number update) never allocate.

use std::collections::VecDeque;

use hashbrown::HashTable;

/// Fixed bytes charged per entry on top of key and value: its slab slot
/// (`size_of::<Entry>()`, 64 bytes on 64-bit targets), its hash-table slot
/// (4-byte index + control byte, with load-factor headroom: 8) and its heap
/// buffer's allocator header and rounding (16). Charging it keeps a
/// dictionary of tiny entries bounded too.
pub const ENTRY_OVERHEAD: usize = 88;

/// Fixed bytes charged per list item on top of its value: its `VecDeque`
/// slot (`size_of::<ListItem>()`, 16 bytes) and a string's allocator header
/// and rounding (16). A list entry itself costs its key plus
/// [`ENTRY_OVERHEAD`], as any entry.
pub const LIST_ITEM_OVERHEAD: usize = 32;

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
/// A list (`lpush`...); 5 is ngx.shared's SHDICT_TLIST (and LUA_TTABLE).
pub(crate) const KIND_LIST: u8 = 5;

/// Bytes a value of `kind` with `str_len` string bytes is charged for
/// (as ngx.shared: a number is 8 bytes, a boolean 1).
#[inline]
pub(crate) fn value_bytes(kind: u8, str_len: usize) -> usize {
    match kind {
        KIND_BOOL => 1,
        KIND_NUMBER => 8,
        // A list's items are charged through its `List::bytes`.
        KIND_LIST => 0,
        _ => str_len,
    }
}

/// One item of a list: lists hold strings and numbers (as ngx.shared).
#[derive(Clone, Debug, PartialEq)]
pub enum ListItem {
    Number(f64),
    Str(Box<[u8]>),
}

impl ListItem {
    /// Bytes this item is charged for.
    #[inline]
    pub fn charge(&self) -> usize {
        LIST_ITEM_OVERHEAD
            + match self {
                ListItem::Number(_) => 8,
                ListItem::Str(s) => s.len(),
            }
    }
}

/// The items of one list entry, in `Shard::lists` at the entry's `flags`.
#[derive(Default)]
pub(crate) struct List {
    items: VecDeque<ListItem>,
    /// Sum of the items' charges.
    bytes: usize,
}

/// What removing or overwriting an entry freed, handed back so that the
/// caller can drop it after releasing the lock.
#[derive(Default)]
pub(crate) struct Garbage {
    _data: Box<[u8]>,
    _items: VecDeque<ListItem>,
}

/// Why a list operation failed (mapped to `ListError` by the caller).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum ListFail {
    NotAList,
    NoMemory,
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
    /// The user flags; on a list entry (which has none), the index of its
    /// items in `Shard::lists` (keeps `Entry` at 64 bytes).
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
    /// Items of the list entries (slab indexed by a list entry's `flags`).
    lists: Vec<List>,
    free_lists: Vec<u32>,
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
            lists: Vec::new(),
            free_lists: Vec::new(),
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

    /// Bytes entry `i` is charged for, a list's items included.
    #[inline]
    pub fn size_of(&self, i: u32) -> usize {
        let e = &self.slots[i as usize];
        let base = e.size();
        if e.kind == KIND_LIST {
            base + self.lists[e.flags as usize].bytes
        } else {
            base
        }
    }

    /// Number of items of list entry `i`.
    pub fn list_len(&self, i: u32) -> usize {
        self.lists[self.slots[i as usize].flags as usize]
            .items
            .len()
    }

    /// Frees the list slot of list entry `i` (the entry itself stays).
    fn free_list(&mut self, i: u32) -> VecDeque<ListItem> {
        let slot = self.slots[i as usize].flags;
        let list = std::mem::take(&mut self.lists[slot as usize]);
        self.used -= list.bytes;
        self.free_lists.push(slot);
        list.items
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

    /// Unlinks and frees slot `i`, returning its buffers so the caller may
    /// drop them after releasing the lock.
    pub fn remove(&mut self, i: u32) -> Garbage {
        let hash = self.slots[i as usize].hash;
        if let Ok(found) = self.table.find_entry(hash, |&j| j == i) {
            found.remove();
        }
        self.unlink(i);
        let items = if self.slots[i as usize].kind == KIND_LIST {
            self.free_list(i)
        } else {
            VecDeque::new()
        };
        let size = self.slots[i as usize].size();
        self.used -= size;
        self.len -= 1;
        let free_head = self.free_head;
        let e = &mut self.slots[i as usize];
        e.kind = KIND_FREE;
        e.next = free_head;
        e.prev = NIL;
        self.free_head = i;
        Garbage {
            _data: std::mem::take(&mut e.data),
            _items: items,
        }
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
    /// buffers. The caller has checked that the size change fits.
    fn overwrite(&mut self, i: u32, new: NewEntry) -> Garbage {
        let items = if self.slots[i as usize].kind == KIND_LIST {
            self.free_list(i)
        } else {
            VecDeque::new()
        };
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
        Garbage {
            _data: old,
            _items: items,
        }
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
    ) -> (Stored, Option<Garbage>) {
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

        let old_size = |s: &Shard, found: Option<u32>| found.map_or(0, |i| s.size_of(i));
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

    // === lists ===

    /// Frees expired entries from the LRU tail until `need` more bytes fit;
    /// whether they do. Never evicts a live entry (list writes do not, as
    /// in ngx.shared: they fail with "no memory" instead).
    fn reclaim_for(&mut self, need: usize, now: u64) -> bool {
        while self.used + need > self.cap {
            let t = self.tail;
            if t == NIL || !is_expired(self.slots[t as usize].expires_at, now) {
                return false;
            }
            drop(self.remove(t));
        }
        true
    }

    /// `lpush` (`front`) / `rpush`: appends `item` to the list at `key`,
    /// creating it (with no TTL) when the key holds no live value; returns
    /// the list's new length. An expired value at `key` is replaced.
    pub fn push(
        &mut self,
        hash: u64,
        key: &[u8],
        item: ListItem,
        front: bool,
        now: u64,
    ) -> Result<usize, ListFail> {
        self.reclaim_expired_tail(now, 2);
        let charge = item.charge();
        let mut found = self.find(hash, key);
        if let Some(i) = found {
            if is_expired(self.slots[i as usize].expires_at, now) {
                drop(self.remove(i));
                found = None;
            } else if self.slots[i as usize].kind != KIND_LIST {
                return Err(ListFail::NotAList);
            }
        }
        let i = match found {
            Some(i) => {
                if !self.reclaim_for(charge, now) {
                    return Err(ListFail::NoMemory);
                }
                i
            }
            None => {
                let entry = key.len() + ENTRY_OVERHEAD;
                if entry + charge > self.cap || !self.reclaim_for(entry + charge, now) {
                    return Err(ListFail::NoMemory);
                }
                let slot = match self.free_lists.pop() {
                    Some(slot) => slot,
                    None => {
                        // As slab indices (see `insert`): bounded by the capacity.
                        let slot = u32::try_from(self.lists.len()).expect("list slot overflow");
                        self.lists.push(List::default());
                        slot
                    }
                };
                self.insert(
                    hash,
                    NewEntry {
                        data: key.into(),
                        key_len: key.len() as u32, // <= MAX_KEY_LEN
                        kind: KIND_LIST,
                        num: 0.0,
                        flags: slot,
                        expires_at: NEVER,
                    },
                )
            }
        };
        let slot = self.slots[i as usize].flags as usize;
        let list = &mut self.lists[slot];
        if front {
            list.items.push_front(item);
        } else {
            list.items.push_back(item);
        }
        list.bytes += charge;
        let len = list.items.len();
        self.used += charge;
        self.touch(i);
        Ok(len)
    }

    /// `lpop` (`front`) / `rpop`: takes an item off the live list at `key`
    /// (`None` if the key holds no live value). Popping the last item
    /// deletes the key.
    pub fn pop(
        &mut self,
        hash: u64,
        key: &[u8],
        front: bool,
        now: u64,
    ) -> Result<(Option<ListItem>, Option<Garbage>), ListFail> {
        let Some(i) = self.find(hash, key) else {
            return Ok((None, None));
        };
        let e = &self.slots[i as usize];
        if is_expired(e.expires_at, now) {
            return Ok((None, None));
        }
        if e.kind != KIND_LIST {
            return Err(ListFail::NotAList);
        }
        let list = &mut self.lists[e.flags as usize];
        let item = if front {
            list.items.pop_front()
        } else {
            list.items.pop_back()
        };
        // A list entry is never empty (its last pop removes it).
        let Some(item) = item else {
            return Ok((None, None));
        };
        let charge = item.charge();
        list.bytes -= charge;
        self.used -= charge;
        if list.items.is_empty() {
            return Ok((Some(item), Some(self.remove(i))));
        }
        // Spare slots are not charged: keep them proportionate to the items.
        if list.items.capacity() > 64 && list.items.len() < list.items.capacity() / 4 {
            let keep = list.items.len() * 2;
            list.items.shrink_to(keep);
        }
        self.touch(i);
        Ok((Some(item), None))
    }

    /// `llen`: the number of items of the live list at `key`, 0 if the key
    /// holds no live value.
    pub fn llen(&mut self, hash: u64, key: &[u8], now: u64) -> Result<usize, ListFail> {
        self.reclaim_expired_tail(now, 2);
        let Some(i) = self.find(hash, key) else {
            return Ok(0);
        };
        let e = &self.slots[i as usize];
        if is_expired(e.expires_at, now) {
            return Ok(0);
        }
        if e.kind != KIND_LIST {
            return Err(ListFail::NotAList);
        }
        let n = self.list_len(i);
        self.touch(i);
        Ok(n)
    }

    /// Verifies the shard's internal invariants (tests only; O(n)).
    pub fn check(&self) -> Result<(), String> {
        let mut count = 0;
        let mut lists = 0;
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
            bytes += self.size_of(i);
            if e.kind == KIND_LIST {
                let l = self
                    .lists
                    .get(e.flags as usize)
                    .ok_or_else(|| format!("slot {i}: list slot {} out of range", e.flags))?;
                if self.free_lists.contains(&e.flags) {
                    return Err(format!("slot {i}: list slot {} is free", e.flags));
                }
                if l.items.is_empty() {
                    return Err(format!("slot {i}: empty list kept"));
                }
                if l.bytes != l.items.iter().map(ListItem::charge).sum::<usize>() {
                    return Err(format!("slot {i}: list bytes {} wrong", l.bytes));
                }
                lists += 1;
            }
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
        if lists + self.free_lists.len() != self.lists.len() {
            return Err(format!(
                "{lists} lists + {} free != {} list slots",
                self.free_lists.len(),
                self.lists.len()
            ));
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
        // LIST_ITEM_OVERHEAD's doc, likewise.
        assert_eq!(std::mem::size_of::<ListItem>(), 16);
        assert_eq!(LIST_ITEM_OVERHEAD, 16 + 16);
    }
}
