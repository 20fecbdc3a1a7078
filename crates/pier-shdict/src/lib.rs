//! Shared dictionaries: the storage behind Lua's `pier.shared.NAME`, with the
//! semantics of OpenResty's `lua_shared_dict` / `ngx.shared.DICT`, in pure
//! Rust and shared by all worker threads.
//!
//! # Design
//!
//! **Sharding.** A [`SharedDict`] is `N` shards (`N` a power of two), each a
//! `parking_lot::Mutex<Shard>` on its own cache line. A key's hash picks its
//! shard, so threads touching different keys rarely meet on a lock, and a
//! lock is held only for a table probe plus a few pointer updates. The
//! capacity is split evenly across shards, and each shard enforces its share
//! alone. Consequences, compared with one nginx zone:
//! - the largest storable entry is one shard's share
//!   ([`SharedDict::max_entry_size`]), not the whole capacity;
//! - a write can evict (or, with `safe_*`, fail with `NoMemory`) while other
//!   shards still have room, so the dictionary may be "full" below
//!   [`capacity`](SharedDict::capacity) — by at most one shard's worth when
//!   keys spread evenly;
//! - LRU order is per shard: the entry evicted is the least recently used of
//!   its shard, an approximation of the global LRU.
//!
//! [`SharedDict::new`] therefore uses few shards for small dictionaries (one
//! shard per 256 KiB, at most 16); [`SharedDict::with_shards`] overrides it.
//!
//! **Shard layout.** Entries live in a slab (`Vec<Entry>` with a free list);
//! a `hashbrown::HashTable<u32>` maps a key's hash to slab indices (the key is
//! stored once, in the entry); an intrusive doubly linked LRU list runs
//! through the slab by index (head = most recently used, tail = next victim).
//! Each entry holds its key and string value in one heap buffer, so an entry
//! costs one allocation, made before the lock is taken (except `incr`'s
//! initialising store), and a replaced buffer is freed after it is released.
//! The hasher is foldhash with a per-dictionary random seed.
//!
//! **Accounting.** An entry is charged `key.len() + value bytes +`
//! [`ENTRY_OVERHEAD`], where value bytes are the string's length, 8 for a
//! number and 1 for a boolean (as ngx.shared); a list entry is charged its
//! key plus [`ENTRY_OVERHEAD`] plus, per item, the item's bytes (as a value's)
//! plus [`LIST_ITEM_OVERHEAD`]. Every shard keeps
//! `used <= capacity share` at all times; an entry larger than a shard's share
//! fails with `NoMemory` and changes nothing. The charge approximates real
//! memory (slab slot, table slot, allocator header); the slab and table may
//! hold spare slots after growth or deletes (they never shrink, but never
//! exceed the most entries the capacity admits). Worst case (entries of a few
//! bytes) real heap use stays under about 2x the capacity; with values much
//! larger than the overhead it is close to the capacity.
//!
//! **Expiry.** Times are caller-supplied integer milliseconds (`now_ms`, from
//! the per-request clock), so tests inject time. An entry with a TTL lives
//! for `[set time, set time + ttl)`; a TTL of 0 means never. Expired entries
//! are invisible to `get`, `ttl`, `expire`, `replace` and `incr`, but stay
//! readable through `get_stale` until removed. They are removed lazily: every
//! store and `incr` first frees up to two expired entries at its shard's LRU
//! tail (as nginx does), a write that needs room frees expired tail entries before
//! anything live, an overwritten or deleted key frees its entry, and
//! [`flush_expired`](SharedDict::flush_expired) frees them all.
//! [`flush_all`](SharedDict::flush_all) only marks everything expired.
//!
//! **Hot paths.** A `get` hit copies the value into a caller-owned reusable
//! buffer; it grows the buffer (if ever needed) with the lock released, then
//! looks again (only if the value grew in between does the copy allocate
//! under the lock). An `incr` hit updates the number in place. Neither
//! allocates in steady state (`tests/no_alloc.rs` counts).
//!
//! # Example
//!
//! ```
//! use pier_shdict::{HitValue, Registry, SetResult, Value};
//!
//! // From the configuration: `[shared] limits = "1m"`.
//! let reg = Registry::new(&[("limits", 1 << 20)]).unwrap();
//! // The FFI layer resolves the name once and passes the index around.
//! let idx = reg.index_of("limits").unwrap();
//! let dict = reg.by_index(idx).unwrap();
//!
//! let now_ms = 1_700_000_000_000; // the request's clock snapshot
//! assert_eq!(dict.set(b"motd", Value::Str(b"hi"), 60_000, 0, now_ms), SetResult::Stored);
//! let mut buf = Vec::new(); // reused across calls
//! let hit = dict.get(b"motd", now_ms, &mut buf).unwrap();
//! assert_eq!((hit.value, buf.as_slice()), (HitValue::Str, &b"hi"[..]));
//!
//! // A per-client counter in a one-second window.
//! let n = dict.incr(b"req:10.0.0.1", 1.0, Some(0.0), 1_000, now_ms).unwrap();
//! assert_eq!(n.value, 1.0);
//! assert_eq!(dict.ttl(b"req:10.0.0.1", now_ms + 400), Some(Some(600)));
//! ```
//!
//! # Differences from ngx.shared
//!
//! - Capacity is split across shards (see Design above).
//! - A failed `safe_set` keeps the old value (nginx may already have freed it).
//! - The `forcible` result is set only when a *live* entry was evicted.
//! - `ttl`/`expire` treat an expired entry as not found (nginx can report a
//!   negative TTL or revive it).
//!
//! # Lists
//!
//! `lpush` / `rpush` / `lpop` / `rpop` / `llen` follow ngx.shared: a key may
//! hold a list of strings and numbers instead of a value. Pushing to a key
//! that holds no live value creates the list (without a TTL; `expire` sets
//! one), pushing to a live non-list fails with [`ListError::NotAList`],
//! popping the last item deletes the key, popping a missing key gives
//! `None`, and `get` reports [`HitValue::List`]. The items are charged to the
//! shard like values; a push never evicts a live entry (it frees expired
//! ones, then fails with [`ListError::NoMemory`]), but a list can be evicted
//! whole by other writes. `ttl`, `expire`, `delete`, `flush_all`,
//! `flush_expired` and `get_keys` treat a list key like any other; `set` /
//! `replace` overwrite it and `incr` reports it is not a number.

#![forbid(unsafe_code)]

mod registry;
mod shard;

use std::hash::BuildHasher;

use hashbrown::DefaultHashBuilder;
use parking_lot::Mutex;

pub use registry::{Registry, RegistryError};
use shard::{
    is_expired, value_bytes, ListFail, NewEntry, Shard, StoreOp, Stored, KIND_BOOL, KIND_LIST,
    KIND_NUMBER, KIND_STR, NEVER, NIL,
};
pub use shard::{ListItem, ENTRY_OVERHEAD, LIST_ITEM_OVERHEAD};

/// Longest key accepted (as ngx.shared).
pub const MAX_KEY_LEN: usize = 65535;

/// One shard per this many bytes of capacity in [`SharedDict::new`].
const BYTES_PER_DEFAULT_SHARD: usize = 256 * 1024;
/// Upper bound on shards in [`SharedDict::new`].
const MAX_DEFAULT_SHARDS: usize = 16;
/// Upper bound on shards in [`SharedDict::with_shards`].
const MAX_SHARDS: usize = 256;

// === values and results ===

/// A value to store. The stored types are those of ngx.shared.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Value<'a> {
    /// Storing nil deletes the key.
    Nil,
    Bool(bool),
    Number(f64),
    Str(&'a [u8]),
}

impl Value<'_> {
    /// Lua's type number for this value (LUA_TNIL 0, LUA_TBOOLEAN 1,
    /// LUA_TNUMBER 3, LUA_TSTRING 4).
    pub fn type_code(&self) -> u8 {
        match self {
            Value::Nil => 0,
            Value::Bool(_) => KIND_BOOL,
            Value::Number(_) => KIND_NUMBER,
            Value::Str(_) => KIND_STR,
        }
    }
}

/// The value found by a `get`. A string's bytes are in the caller's buffer.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum HitValue {
    Bool(bool),
    Number(f64),
    /// The bytes were copied into the `out` buffer passed to `get`.
    Str,
    /// The key holds a list (ngx.shared's `get` fails with "value is a
    /// list"); nothing was copied.
    List,
}

impl HitValue {
    /// Lua's type number for this value (see [`Value::type_code`]; 5 for a
    /// list, ngx.shared's SHDICT_TLIST).
    pub fn type_code(&self) -> u8 {
        match self {
            HitValue::Bool(_) => KIND_BOOL,
            HitValue::Number(_) => KIND_NUMBER,
            HitValue::Str => KIND_STR,
            HitValue::List => KIND_LIST,
        }
    }
}

/// A successful `get` / `get_stale`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Hit {
    pub value: HitValue,
    /// The user flags given when the value was stored (0 by default).
    pub flags: u32,
    /// The entry has expired (only `get_stale` returns such entries).
    pub stale: bool,
}

/// Outcome of `set` / `safe_set` / `add` / `safe_add` / `replace`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SetResult {
    /// Stored (or, for a nil value, deleted) without evicting a live entry.
    Stored,
    /// Stored after evicting at least one live entry (ngx.shared's `forcible`).
    StoredEvicted,
    /// `add`: the key already holds a live value.
    Exists,
    /// `replace`: the key holds no live value.
    NotFound,
    /// No room: the entry exceeds [`SharedDict::max_entry_size`], or a
    /// `safe_*` store would have had to evict a live entry.
    NoMemory,
    /// The key is empty or longer than [`MAX_KEY_LEN`].
    InvalidKey,
}

impl SetResult {
    /// Whether the store took effect.
    pub fn is_ok(self) -> bool {
        matches!(self, SetResult::Stored | SetResult::StoredEvicted)
    }

    /// ngx.shared's `forcible` return value.
    pub fn forcible(self) -> bool {
        self == SetResult::StoredEvicted
    }

    /// ngx.shared's error string, `None` on success.
    pub fn error_str(self) -> Option<&'static str> {
        match self {
            SetResult::Stored | SetResult::StoredEvicted => None,
            SetResult::Exists => Some("exists"),
            SetResult::NotFound => Some("not found"),
            SetResult::NoMemory => Some("no memory"),
            SetResult::InvalidKey => Some("invalid key"),
        }
    }
}

/// A successful `incr`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Incr {
    /// The new value.
    pub value: f64,
    /// Storing the initial value evicted a live entry.
    pub forcible: bool,
}

/// Why an `incr` failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IncrError {
    /// No live value and no `init` given.
    NotFound,
    /// The value is not a number.
    NotANumber,
    /// No room for the initial value.
    NoMemory,
    /// The key is empty or longer than [`MAX_KEY_LEN`].
    InvalidKey,
}

impl IncrError {
    /// ngx.shared's error string.
    pub fn as_str(self) -> &'static str {
        match self {
            IncrError::NotFound => "not found",
            IncrError::NotANumber => "not a number",
            IncrError::NoMemory => "no memory",
            IncrError::InvalidKey => "invalid key",
        }
    }
}

/// Why a list operation (`lpush`, `lpop`, `llen`...) failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ListError {
    /// The key holds a live value that is not a list.
    NotAList,
    /// No room for the item: list writes never evict live entries.
    NoMemory,
    /// Only strings and numbers can be pushed.
    BadValue,
    /// The key is empty or longer than [`MAX_KEY_LEN`].
    InvalidKey,
}

impl ListError {
    /// ngx.shared's error string.
    pub fn as_str(self) -> &'static str {
        match self {
            ListError::NotAList => "value not a list",
            ListError::NoMemory => "no memory",
            ListError::BadValue => "bad value type",
            ListError::InvalidKey => "invalid key",
        }
    }
}

impl From<ListFail> for ListError {
    fn from(f: ListFail) -> Self {
        match f {
            ListFail::NotAList => ListError::NotAList,
            ListFail::NoMemory => ListError::NoMemory,
        }
    }
}

/// Why a key is rejected.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KeyError {
    Empty,
    TooLong,
}

impl KeyError {
    /// ngx.shared's error string.
    pub fn as_str(self) -> &'static str {
        match self {
            KeyError::Empty => "empty key",
            KeyError::TooLong => "key too long",
        }
    }
}

/// Checks a key as ngx.shared does: 1 to [`MAX_KEY_LEN`] bytes. Operations
/// given a bad key report `InvalidKey` (or a miss, for lookups); call this
/// first to report the precise error.
#[inline]
pub fn validate_key(key: &[u8]) -> Result<(), KeyError> {
    if key.is_empty() {
        Err(KeyError::Empty)
    } else if key.len() > MAX_KEY_LEN {
        Err(KeyError::TooLong)
    } else {
        Ok(())
    }
}

/// Bytes an entry is charged for (see the crate docs' accounting).
pub fn entry_size(key: &[u8], value: &Value<'_>) -> usize {
    let str_len = match value {
        Value::Str(s) => s.len(),
        _ => 0,
    };
    key.len() + value_bytes(value.type_code(), str_len) + ENTRY_OVERHEAD
}

#[inline]
fn expiry(ttl_ms: u64, now_ms: u64) -> u64 {
    if ttl_ms == 0 {
        NEVER
    } else {
        // NEVER stays reserved for "no TTL".
        now_ms.saturating_add(ttl_ms).min(NEVER - 1)
    }
}

// === the dictionary ===

/// Keeps each shard's lock on its own cache line, so threads working on
/// different shards do not bounce one line between cores.
#[repr(align(128))]
struct PaddedShard(Mutex<Shard>);

/// One shared dictionary. `Send + Sync`: share it as `Arc<SharedDict>`.
pub struct SharedDict {
    name: Box<str>,
    capacity: usize,
    hasher: DefaultHashBuilder,
    shards: Box<[PaddedShard]>,
    shard_mask: usize,
}

impl std::fmt::Debug for SharedDict {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedDict")
            .field("name", &self.name)
            .field("capacity", &self.capacity)
            .field("shards", &self.shards.len())
            .finish_non_exhaustive()
    }
}

impl SharedDict {
    /// A dictionary bounded to `capacity_bytes`, with a shard count suited to
    /// its size (one per 256 KiB, a power of two, 1 to 16).
    pub fn new(name: &str, capacity_bytes: usize) -> Self {
        let shards = (capacity_bytes / BYTES_PER_DEFAULT_SHARD).clamp(1, MAX_DEFAULT_SHARDS);
        Self::with_shards(name, capacity_bytes, shards)
    }

    /// A dictionary with `shards` shards (rounded down to a power of two,
    /// 1 to 256, and at most `capacity_bytes`).
    pub fn with_shards(name: &str, capacity_bytes: usize, shards: usize) -> Self {
        let limit = shards.clamp(1, MAX_SHARDS).min(capacity_bytes.max(1));
        let n = 1usize << (usize::BITS - 1 - limit.leading_zeros());
        // Split evenly; the first `capacity % n` shards take one byte more,
        // so the shares sum to exactly `capacity_bytes`.
        let (share, extra) = (capacity_bytes / n, capacity_bytes % n);
        let shards = (0..n)
            .map(|i| PaddedShard(Mutex::new(Shard::new(share + usize::from(i < extra)))))
            .collect();
        SharedDict {
            name: name.into(),
            capacity: capacity_bytes,
            hasher: DefaultHashBuilder::default(),
            shards,
            shard_mask: n - 1,
        }
    }

    /// The dictionary's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Total capacity in bytes (ngx.shared `capacity`).
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Number of shards.
    pub fn shard_count(&self) -> usize {
        self.shards.len()
    }

    /// The largest entry (as [`entry_size`]) that can be stored: one shard's
    /// capacity share.
    pub fn max_entry_size(&self) -> usize {
        self.capacity / self.shards.len()
    }

    #[inline]
    fn hash(&self, key: &[u8]) -> u64 {
        self.hasher.hash_one(key)
    }

    #[inline]
    fn shard(&self, hash: u64) -> &Mutex<Shard> {
        // hashbrown uses the hash's low bits (bucket) and top 7 bits (tag);
        // take the shard from the middle so each shard's table keeps both.
        &self.shards[(hash >> 32) as usize & self.shard_mask].0
    }

    // === reads ===

    /// The live value of `key`, copying a string into `out` (cleared first;
    /// reuse it across calls and a hit allocates nothing). ngx.shared `get`.
    #[inline]
    pub fn get(&self, key: &[u8], now_ms: u64, out: &mut Vec<u8>) -> Option<Hit> {
        self.lookup(key, now_ms, out, false)
    }

    /// Like [`get`](Self::get), but also returns an expired value that has
    /// not been removed yet, with `stale` set. ngx.shared `get_stale`.
    #[inline]
    pub fn get_stale(&self, key: &[u8], now_ms: u64, out: &mut Vec<u8>) -> Option<Hit> {
        self.lookup(key, now_ms, out, true)
    }

    fn lookup(&self, key: &[u8], now: u64, out: &mut Vec<u8>, stale_ok: bool) -> Option<Hit> {
        out.clear();
        if validate_key(key).is_err() {
            return None;
        }
        let hash = self.hash(key);
        let shard = self.shard(hash);
        let mut grown = false;
        loop {
            let mut s = shard.lock();
            let i = s.find(hash, key)?;
            let e = s.entry(i);
            let stale = is_expired(e.expires_at, now);
            if stale && !stale_ok {
                return None;
            }
            let value = match e.kind {
                KIND_BOOL => HitValue::Bool(e.num != 0.0),
                KIND_NUMBER => HitValue::Number(e.num),
                KIND_LIST => HitValue::List,
                _ => {
                    let v = e.str_value();
                    if v.len() > out.capacity() && !grown {
                        // Grow with the lock released, then look again (the
                        // entry may change meanwhile; the second pass copies
                        // whatever it finds).
                        let need = v.len();
                        drop(s);
                        out.reserve(need);
                        grown = true;
                        continue;
                    }
                    out.extend_from_slice(v);
                    HitValue::Str
                }
            };
            // A list entry's `flags` field holds its list slot, not user flags.
            let flags = if e.kind == KIND_LIST { 0 } else { e.flags };
            s.touch(i);
            return Some(Hit {
                value,
                flags,
                stale,
            });
        }
    }

    /// Remaining time to live of a live `key`: `None` if absent or expired,
    /// `Some(None)` if it never expires, else `Some(Some(ms))` (always >= 1).
    /// ngx.shared `ttl`.
    pub fn ttl(&self, key: &[u8], now_ms: u64) -> Option<Option<u64>> {
        validate_key(key).ok()?;
        let hash = self.hash(key);
        let s = self.shard(hash).lock();
        let e = s.entry(s.find(hash, key)?);
        if is_expired(e.expires_at, now_ms) {
            None
        } else if e.expires_at == NEVER {
            Some(None)
        } else {
            Some(Some(e.expires_at - now_ms))
        }
    }

    /// Up to `max` live keys (0 = all), most recently used first within each
    /// shard. ngx.shared `get_keys`. Locks one shard at a time.
    pub fn get_keys(&self, max: usize, now_ms: u64) -> Vec<Vec<u8>> {
        let mut keys = Vec::new();
        self.for_each_key(max, now_ms, |k| keys.push(k.to_vec()));
        keys
    }

    /// Calls `f` on up to `max` live keys (0 = all), in `get_keys` order, and
    /// returns how many; lets the FFI layer copy keys straight into its own
    /// buffer. `f` runs under a shard lock: it must not call this dictionary.
    pub fn for_each_key(&self, max: usize, now_ms: u64, mut f: impl FnMut(&[u8])) -> usize {
        let max = if max == 0 { usize::MAX } else { max };
        let mut n = 0;
        for shard in self.shards.iter() {
            let s = shard.0.lock();
            let mut i = s.head();
            while i != NIL {
                if n >= max {
                    return n;
                }
                let e = s.entry(i);
                if !is_expired(e.expires_at, now_ms) {
                    f(e.key());
                    n += 1;
                }
                i = e.next;
            }
        }
        n
    }

    /// Bytes not charged to any entry (expired entries not yet removed are
    /// still charged). ngx.shared `free_space`.
    pub fn free_space(&self) -> usize {
        self.shards
            .iter()
            .map(|s| {
                let s = s.0.lock();
                s.cap() - s.used()
            })
            .sum()
    }

    /// Bytes charged to entries (`capacity() - free_space()`).
    pub fn used_bytes(&self) -> usize {
        self.shards.iter().map(|s| s.0.lock().used()).sum()
    }

    /// Number of entries held, including expired ones not yet removed.
    pub fn len(&self) -> usize {
        self.shards.iter().map(|s| s.0.lock().len()).sum()
    }

    /// Whether no entry is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    // === writes ===

    /// Stores `value` (nil deletes), evicting least recently used entries of
    /// the key's shard if needed. ngx.shared `set`.
    pub fn set(
        &self,
        key: &[u8],
        value: Value<'_>,
        ttl_ms: u64,
        flags: u32,
        now_ms: u64,
    ) -> SetResult {
        self.store(key, value, ttl_ms, flags, now_ms, StoreOp::Set, true)
    }

    /// Like [`set`](Self::set), but never evicts a live entry: `NoMemory`
    /// instead (the old value, if any, is kept). ngx.shared `safe_set`.
    pub fn safe_set(
        &self,
        key: &[u8],
        value: Value<'_>,
        ttl_ms: u64,
        flags: u32,
        now_ms: u64,
    ) -> SetResult {
        self.store(key, value, ttl_ms, flags, now_ms, StoreOp::Set, false)
    }

    /// Stores only if `key` holds no live value (`Exists` otherwise).
    /// ngx.shared `add`.
    pub fn add(
        &self,
        key: &[u8],
        value: Value<'_>,
        ttl_ms: u64,
        flags: u32,
        now_ms: u64,
    ) -> SetResult {
        self.store(key, value, ttl_ms, flags, now_ms, StoreOp::Add, true)
    }

    /// [`add`](Self::add) without evicting live entries. ngx.shared `safe_add`.
    pub fn safe_add(
        &self,
        key: &[u8],
        value: Value<'_>,
        ttl_ms: u64,
        flags: u32,
        now_ms: u64,
    ) -> SetResult {
        self.store(key, value, ttl_ms, flags, now_ms, StoreOp::Add, false)
    }

    /// Stores only if `key` holds a live value (`NotFound` otherwise).
    /// ngx.shared `replace`.
    pub fn replace(
        &self,
        key: &[u8],
        value: Value<'_>,
        ttl_ms: u64,
        flags: u32,
        now_ms: u64,
    ) -> SetResult {
        self.store(key, value, ttl_ms, flags, now_ms, StoreOp::Replace, true)
    }

    /// Removes `key`; true if it held a live value. ngx.shared `delete`.
    pub fn delete(&self, key: &[u8], now_ms: u64) -> bool {
        if validate_key(key).is_err() {
            return false;
        }
        let hash = self.hash(key);
        let mut s = self.shard(hash).lock();
        let Some(i) = s.find(hash, key) else {
            return false;
        };
        let live = !is_expired(s.entry(i).expires_at, now_ms);
        let buf = s.remove(i);
        drop(s);
        drop(buf);
        live
    }

    #[allow(clippy::too_many_arguments)] // the ngx.shared store signature plus op/forcible
    fn store(
        &self,
        key: &[u8],
        value: Value<'_>,
        ttl_ms: u64,
        flags: u32,
        now_ms: u64,
        op: StoreOp,
        forcible: bool,
    ) -> SetResult {
        if validate_key(key).is_err() {
            return SetResult::InvalidKey;
        }
        let new = match value {
            Value::Nil => None,
            _ => {
                // Checked before building, so a huge value costs no allocation.
                if entry_size(key, &value) > self.max_entry_size() {
                    return SetResult::NoMemory;
                }
                let (kind, num, s): (u8, f64, &[u8]) = match value {
                    Value::Bool(b) => (KIND_BOOL, f64::from(u8::from(b)), &[]),
                    Value::Number(n) => (KIND_NUMBER, n, &[]),
                    Value::Str(s) => (KIND_STR, 0.0, s),
                    Value::Nil => unreachable!("handled above"),
                };
                let mut data = Vec::with_capacity(key.len() + s.len());
                data.extend_from_slice(key);
                data.extend_from_slice(s);
                Some(NewEntry {
                    data: data.into_boxed_slice(),
                    key_len: key.len() as u32, // <= MAX_KEY_LEN
                    kind,
                    num,
                    flags,
                    expires_at: expiry(ttl_ms, now_ms),
                })
            }
        };
        let hash = self.hash(key);
        let (stored, garbage) = self
            .shard(hash)
            .lock()
            .store(hash, key, new, op, forcible, now_ms);
        // The lock is released: free the replaced buffer outside it.
        drop(garbage);
        match stored {
            Stored::Ok {
                evicted_valid: false,
            } => SetResult::Stored,
            Stored::Ok {
                evicted_valid: true,
            } => SetResult::StoredEvicted,
            Stored::Exists => SetResult::Exists,
            Stored::NotFound => SetResult::NotFound,
            Stored::NoMemory => SetResult::NoMemory,
        }
    }

    /// Adds `by` to the number at `key` (keeping its TTL and flags). If `key`
    /// holds no live value and `init` is given, stores `init + by` with TTL
    /// `init_ttl_ms` (0 = never) and flags 0, evicting if needed.
    /// ngx.shared `incr(key, value, init?, init_ttl?)`.
    pub fn incr(
        &self,
        key: &[u8],
        by: f64,
        init: Option<f64>,
        init_ttl_ms: u64,
        now_ms: u64,
    ) -> Result<Incr, IncrError> {
        if validate_key(key).is_err() {
            return Err(IncrError::InvalidKey);
        }
        let hash = self.hash(key);
        let mut s = self.shard(hash).lock();
        s.reclaim_expired_tail(now_ms, 2);
        let found = s.find(hash, key);
        if let Some(i) = found {
            if !is_expired(s.entry(i).expires_at, now_ms) {
                let e = s.entry_mut(i);
                if e.kind != KIND_NUMBER {
                    return Err(IncrError::NotANumber);
                }
                e.num += by;
                let value = e.num;
                s.touch(i);
                return Ok(Incr {
                    value,
                    forcible: false,
                });
            }
        }
        let Some(init) = init else {
            return Err(IncrError::NotFound);
        };
        let value = init + by;
        // The rare initialising path allocates under the lock; building the
        // entry first would cost every hit an allocation or a second lookup.
        let new = NewEntry {
            data: key.into(),
            key_len: key.len() as u32, // <= MAX_KEY_LEN
            kind: KIND_NUMBER,
            num: value,
            flags: 0,
            expires_at: expiry(init_ttl_ms, now_ms),
        };
        let (stored, garbage) = s.store(hash, key, Some(new), StoreOp::Set, true, now_ms);
        drop(s);
        drop(garbage);
        match stored {
            Stored::Ok { evicted_valid } => Ok(Incr {
                value,
                forcible: evicted_valid,
            }),
            // A `Set` reports only success or NoMemory.
            Stored::NoMemory | Stored::Exists | Stored::NotFound => Err(IncrError::NoMemory),
        }
    }

    /// Sets the TTL of a live `key` (0 = never expires); false if absent or
    /// expired. ngx.shared `expire`.
    pub fn expire(&self, key: &[u8], ttl_ms: u64, now_ms: u64) -> bool {
        if validate_key(key).is_err() {
            return false;
        }
        let hash = self.hash(key);
        let mut s = self.shard(hash).lock();
        let Some(i) = s.find(hash, key) else {
            return false;
        };
        let e = s.entry_mut(i);
        if is_expired(e.expires_at, now_ms) {
            return false;
        }
        e.expires_at = expiry(ttl_ms, now_ms);
        true
    }

    /// Marks every entry expired without freeing memory (ngx.shared
    /// `flush_all`): `get_stale` still sees values until they are removed.
    pub fn flush_all(&self) {
        for shard in self.shards.iter() {
            shard.0.lock().flush_all();
        }
    }

    /// Frees up to `max` expired entries (0 = all) and returns how many.
    /// ngx.shared `flush_expired`. Locks one shard at a time.
    pub fn flush_expired(&self, max: usize, now_ms: u64) -> usize {
        let max = if max == 0 { usize::MAX } else { max };
        let mut freed = 0;
        for shard in self.shards.iter() {
            if freed >= max {
                break;
            }
            freed += shard.0.lock().flush_expired(now_ms, max - freed);
        }
        freed
    }

    // === lists ===

    /// Inserts `value` (a string or a number) at the head of the list at
    /// `key`, creating the list if the key holds no live value; returns the
    /// list's length. ngx.shared `lpush`.
    pub fn lpush(&self, key: &[u8], value: Value<'_>, now_ms: u64) -> Result<usize, ListError> {
        self.push(key, value, true, now_ms)
    }

    /// Like [`lpush`](Self::lpush), at the tail. ngx.shared `rpush`.
    pub fn rpush(&self, key: &[u8], value: Value<'_>, now_ms: u64) -> Result<usize, ListError> {
        self.push(key, value, false, now_ms)
    }

    fn push(
        &self,
        key: &[u8],
        value: Value<'_>,
        front: bool,
        now_ms: u64,
    ) -> Result<usize, ListError> {
        if validate_key(key).is_err() {
            return Err(ListError::InvalidKey);
        }
        let str_len = match value {
            Value::Str(s) => s.len(),
            Value::Number(_) => 0,
            Value::Nil | Value::Bool(_) => return Err(ListError::BadValue),
        };
        // Checked before building, so a huge value costs no allocation.
        let charge = LIST_ITEM_OVERHEAD + value_bytes(value.type_code(), str_len);
        if key.len() + ENTRY_OVERHEAD + charge > self.max_entry_size() {
            return Err(ListError::NoMemory);
        }
        let item = match value {
            Value::Str(s) => ListItem::Str(s.into()),
            Value::Number(n) => ListItem::Number(n),
            Value::Nil | Value::Bool(_) => return Err(ListError::BadValue),
        };
        let hash = self.hash(key);
        let r = self.shard(hash).lock().push(hash, key, item, front, now_ms);
        r.map_err(ListError::from)
    }

    /// Removes and returns the head item of the list at `key`; `None` if the
    /// key holds no live value. Popping the last item deletes the key.
    /// ngx.shared `lpop`.
    pub fn lpop(&self, key: &[u8], now_ms: u64) -> Result<Option<ListItem>, ListError> {
        self.pop(key, true, now_ms)
    }

    /// Like [`lpop`](Self::lpop), at the tail. ngx.shared `rpop`.
    pub fn rpop(&self, key: &[u8], now_ms: u64) -> Result<Option<ListItem>, ListError> {
        self.pop(key, false, now_ms)
    }

    fn pop(&self, key: &[u8], front: bool, now_ms: u64) -> Result<Option<ListItem>, ListError> {
        if validate_key(key).is_err() {
            return Err(ListError::InvalidKey);
        }
        let hash = self.hash(key);
        let r = self.shard(hash).lock().pop(hash, key, front, now_ms);
        // The lock is released: the emptied entry (if any) is freed here.
        let (item, garbage) = r?;
        drop(garbage);
        Ok(item)
    }

    /// The number of items of the list at `key`, 0 if the key holds no live
    /// value. ngx.shared `llen`.
    pub fn llen(&self, key: &[u8], now_ms: u64) -> Result<usize, ListError> {
        if validate_key(key).is_err() {
            return Err(ListError::InvalidKey);
        }
        let hash = self.hash(key);
        let r = self.shard(hash).lock().llen(hash, key, now_ms);
        r.map_err(ListError::from)
    }

    /// Checks internal invariants (accounting, table, LRU and free lists);
    /// O(n), for tests.
    #[doc(hidden)]
    pub fn check_invariants(&self) -> Result<(), String> {
        let mut cap = 0;
        for (n, shard) in self.shards.iter().enumerate() {
            let s = shard.0.lock();
            s.check().map_err(|e| format!("shard {n}: {e}"))?;
            cap += s.cap();
        }
        if cap != self.capacity {
            return Err(format!(
                "shard shares sum to {cap}, capacity {}",
                self.capacity
            ));
        }
        Ok(())
    }
}
