//! The socket table: TCP and UDP cosockets live in a per-thread slab and
//! Lua holds only a handle (the slot index plus the slot's generation,
//! bumped whenever the slot is freed), so a handle to a freed socket never
//! reaches the socket that reuses its slot (`bad socket`). Each socket
//! records its owner (the request or timer run that created it, see
//! `Current::owner`): another one using it gets `bad request`, as OpenResty
//! answers. A request's sockets are freed when it ends (`RequestCtx` drop),
//! a timer run's when it returns, and (past a request's first
//! `UNANCHORED_PER_REQUEST`) earlier when Lua collects the object (an
//! `ffi.gc` anchor). Lua never holds a pointer to a socket, only this
//! checked handle.

use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;

use mlua::Lua;

use super::tcp::{self, TcpSock};
use super::udp::UdpSock;
use crate::current;
use crate::limits::LuaLimits;

/// Bits of the slot index in a handle: a handle is `gen << INDEX_BITS | index`,
/// below 2^53 so that Lua's doubles hold it exactly.
pub(super) const INDEX_BITS: u32 = 24;
pub(super) const GEN_MASK: u32 = (1 << 28) - 1;
/// No more slots than the index bits can name.
pub(super) const MAX_SLOTS: usize = (1 << INDEX_BITS) - 1;

thread_local! {
    static SOCKS: RefCell<Slab> = RefCell::new(Slab::default());
}

#[derive(Clone)]
pub(super) enum Sock {
    Tcp(Rc<RefCell<TcpSock>>),
    Udp(Rc<RefCell<UdpSock>>),
}

struct Slot {
    gen: u32,
    owner: u64,
    sock: Option<Sock>,
    /// The owner's other live sockets: a doubly linked list through the
    /// slots ([`NIL`] ends it), so a request's end frees its sockets
    /// without scanning the slab.
    prev: u32,
    next: u32,
}

/// No slot (list ends).
const NIL: u32 = u32::MAX;

/// An owner's live sockets: how many, and the first of its list.
#[derive(Clone, Copy)]
struct Owned {
    count: usize,
    head: u32,
}

/// Owner ids are a per-thread counter: one multiplication spreads them
/// (SipHash was a visible part of each request's socket bookkeeping).
#[derive(Default)]
struct OwnerHasher(u64);

impl std::hash::Hasher for OwnerHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(b)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        }
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = (self.0 ^ n).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
}

#[derive(Default)]
struct Slab {
    slots: Vec<Slot>,
    free: Vec<usize>,
    /// Live sockets, and live sockets per owner.
    live: usize,
    per_owner: HashMap<u64, Owned, std::hash::BuildHasherDefault<OwnerHasher>>,
}

fn split(handle: u64) -> (usize, u32) {
    (
        (handle & ((1 << INDEX_BITS) - 1)) as usize,
        (handle >> INDEX_BITS) as u32,
    )
}

/// Why a socket could not be created.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Full {
    Request,
    Worker,
}

impl Slab {
    fn alloc(
        &mut self,
        owner: u64,
        limits: &LuaLimits,
        make: &dyn Fn(&LuaLimits) -> Sock,
    ) -> Result<(u64, usize), Full> {
        if self.live >= limits.max_sockets_per_worker.min(MAX_SLOTS) {
            return Err(Full::Worker);
        }
        let mine = self.per_owner.get(&owner).map_or(0, |o| o.count);
        if mine >= limits.max_sockets_per_request {
            return Err(Full::Request);
        }
        let sock = Some(make(limits));
        let i = match self.free.pop() {
            Some(i) => i,
            None => {
                self.slots.push(Slot {
                    gen: 0,
                    owner: 0,
                    sock: None,
                    prev: NIL,
                    next: NIL,
                });
                self.slots.len() - 1
            }
        };
        // Below MAX_SLOTS < 2^24: fits the list links.
        let link = i as u32;
        let owned = self.per_owner.entry(owner).or_insert(Owned {
            count: 0,
            head: NIL,
        });
        let old_head = owned.head;
        owned.count += 1;
        owned.head = link;
        if old_head != NIL {
            self.slots[old_head as usize].prev = link;
        }
        let slot = &mut self.slots[i];
        slot.owner = owner;
        slot.sock = sock;
        slot.prev = NIL;
        slot.next = old_head;
        self.live += 1;
        Ok((u64::from(slot.gen) << INDEX_BITS | i as u64, mine))
    }

    /// Frees slot `i` if it holds a socket; its generation moves on. The
    /// socket is returned, to be dropped after the slab's borrow ends.
    fn release(&mut self, i: usize) -> Option<Sock> {
        let slot = self.slots.get_mut(i)?;
        let sock = slot.sock.take()?;
        slot.gen = (slot.gen + 1) & GEN_MASK;
        let owner = std::mem::take(&mut slot.owner);
        let (prev, next) = (slot.prev, slot.next);
        slot.prev = NIL;
        slot.next = NIL;
        if next != NIL {
            self.slots[next as usize].prev = prev;
        }
        if prev != NIL {
            self.slots[prev as usize].next = next;
        }
        self.live -= 1;
        if let Some(o) = self.per_owner.get_mut(&owner) {
            o.count -= 1;
            if o.count == 0 {
                self.per_owner.remove(&owner);
            } else if prev == NIL {
                o.head = next;
            }
        }
        self.free.push(i);
        Some(sock)
    }

    /// Frees the first socket of `owner`'s list, if it has one.
    fn release_first(&mut self, owner: u64) -> Option<Sock> {
        if self.live == 0 {
            // Every request end comes here: no hashing when no socket is alive.
            return None;
        }
        let head = self.per_owner.get(&owner)?.head;
        self.release(head as usize)
    }
}

/// Frees the socket `handle` names, unless its slot has moved on.
pub(super) fn free_sock(handle: u64) {
    let (i, gen) = split(handle);
    // `try_with`: finalizers may run while the thread is being torn down.
    // `try_borrow_mut`: never panic in a finalizer (nothing borrows the
    // slab while Lua runs, so this does not skip in practice).
    let freed = SOCKS.try_with(|s| {
        let Ok(mut s) = s.try_borrow_mut() else {
            return None;
        };
        if s.slots.get(i).is_some_and(|slot| slot.gen == gen) {
            s.release(i)
        } else {
            None
        }
    });
    // After the slab's borrow: closing a connection may wake a queued connect.
    if let Ok(Some(sock)) = freed {
        tcp::recycle(sock);
    }
}

/// Frees every socket of `owner` (a request ended, a timer run returned).
pub(crate) fn free_owner(owner: u64) {
    // One at a time, each dropped after the slab's borrow ends (closing a
    // connection may wake a queued connect); nothing is collected in a Vec.
    loop {
        // Never panic in a `Drop` (see `free_sock`).
        let freed = SOCKS.try_with(|s| {
            let Ok(mut s) = s.try_borrow_mut() else {
                return None;
            };
            s.release_first(owner)
        });
        match freed {
            Ok(Some(sock)) => tcp::recycle(sock),
            _ => break,
        }
    }
}

/// The socket `handle`, if it is still that socket and belongs to the
/// request (or timer run) now running.
pub(super) fn lookup(handle: u64) -> mlua::Result<Sock> {
    lookup_raw(handle).map_err(|bad| match bad {
        Bad::Request => mlua::Error::runtime("bad request"),
        Bad::Socket => bad_socket(),
    })
}

/// Why a handle does not name a usable socket.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Bad {
    /// Another request's (or timer run's) socket.
    Request,
    /// Freed: collected, closed with its request, or never a socket.
    Socket,
}

/// [`lookup`] without building an error (the FFI fast path).
pub(super) fn lookup_raw(handle: u64) -> Result<Sock, Bad> {
    let (i, gen) = split(handle);
    let owner = current::get().owner;
    SOCKS.with_borrow(|s| match s.slots.get(i) {
        Some(Slot {
            gen: g,
            owner: o,
            sock: Some(sock),
            ..
        }) if *g == gen => {
            if *o != owner || owner == 0 {
                Err(Bad::Request)
            } else {
                Ok(sock.clone())
            }
        }
        _ => Err(Bad::Socket),
    })
}

fn bad_socket() -> mlua::Error {
    mlua::Error::runtime("bad socket (closed: collected, or its request ended)")
}

/// A new socket for the current request or timer run.
pub(super) fn new_sock(lua: &Lua, make: &dyn Fn(&LuaLimits) -> Sock) -> mlua::Result<u64> {
    let cur = current::get();
    let Some(engine) = cur.engine else {
        return Err(mlua::Error::runtime("no request"));
    };
    // SAFETY: the engine outlives every hook call it runs (see `Current`).
    let limits = unsafe { engine.as_ref() }.limits;
    if cur.owner == 0 {
        return Err(mlua::Error::runtime("no request"));
    }
    let mut r = SOCKS.with_borrow_mut(|s| s.alloc(cur.owner, &limits, make));
    if r.is_err() {
        // Sockets Lua no longer references may just not be collected yet:
        // collect (their anchors free them) and try once more.
        lua.gc_collect()?;
        r = SOCKS.with_borrow_mut(|s| s.alloc(cur.owner, &limits, make));
    }
    r.map(|(h, _)| h).map_err(|full| {
        mlua::Error::runtime(match full {
            Full::Request => "too many sockets in this request (lua.max_sockets_per_request)",
            Full::Worker => "too many sockets in this worker (lua.max_sockets_per_worker)",
        })
    })
}

/// Why [`try_new_tcp`] made no socket.
pub(super) enum NoSock {
    NoRequest,
    Full(Full),
}

/// A request's first sockets that need no `ffi.gc` anchor: the request's
/// end frees them. Registering a finalizer and running it when the object
/// is collected cost about 2k instructions per `ngx.socket.tcp()` (the
/// finalizer table's insert, the collector's resurrection and its protected
/// call; callgrind, BENCHMARKS.md stop 27), for a socket that the request's
/// end frees anyway. Past these, a hook creating sockets in a loop gets
/// anchored ones that the collector frees, so a request holds at most this
/// many abandoned sockets beyond what Lua still references. Timer runs (which
/// may loop for the worker's life) always anchor.
pub(super) const UNANCHORED_PER_REQUEST: usize = 4;

/// A new TCP socket for the current request or timer run, without the
/// collection [`new_sock`] tries when full (the FFI caller collects and
/// asks again); and whether its Lua object needs an anchor
/// ([`UNANCHORED_PER_REQUEST`]).
pub(super) fn try_new_tcp() -> Result<(u64, bool), NoSock> {
    let cur = current::get();
    let Some(engine) = cur.engine else {
        return Err(NoSock::NoRequest);
    };
    if cur.owner == 0 {
        return Err(NoSock::NoRequest);
    }
    // SAFETY: the engine outlives every hook call it runs (see `Current`).
    let limits = unsafe { engine.as_ref() }.limits;
    let (h, before) = SOCKS
        .with_borrow_mut(|s| {
            s.alloc(cur.owner, &limits, &|l| {
                Sock::Tcp(tcp::new_tcp(l.socket_buffer, l.socket_pool_wait))
            })
        })
        .map_err(NoSock::Full)?;
    Ok((h, cur.ctx.is_none() || before >= UNANCHORED_PER_REQUEST))
}

/// Frees a socket (its Lua object was collected): UDP's finalizer (TCP's
/// is a C function, `tcp::ffi::l_free`).
pub(super) fn free_native(lua: &Lua) -> mlua::Result<mlua::Function> {
    lua.create_function(|_, id: u64| {
        free_sock(id);
        Ok(())
    })
}
