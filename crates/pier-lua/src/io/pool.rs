//! Per-thread keep-alive pools of idle connections.
//!
//! Two namespaces: `pier.http`'s plain TCP connections (`take` / `put`,
//! keyed by `host:port`), and the cosockets' pools ([`Spool`], keyed by
//! `host:port`, `unix:path` or the `pool` option), which follow ngx_lua:
//! a pool has a size (idle connections kept), counts the connections
//! opened under it, and with a `backlog` caps them at `size`, queueing
//! further connects.

use std::cell::{Cell, RefCell};
use std::collections::{HashMap, VecDeque};
use std::rc::Rc;
use std::time::{Duration, Instant};

use tokio::net::TcpStream;

use super::tcp::Conn;

struct Idle {
    stream: TcpStream,
    /// Times this connection has been taken from the pool before.
    reused: u32,
    deadline: Instant,
}

thread_local! {
    static POOL: RefCell<HashMap<String, VecDeque<Idle>>> = RefCell::new(HashMap::new());
}

/// An idle connection to `key` that is still open, most recent first, with
/// the number of times it was reused before.
pub(crate) fn take(key: &str) -> Option<(TcpStream, u32)> {
    POOL.with_borrow_mut(|pool| {
        let list = pool.get_mut(key)?;
        let now = Instant::now();
        while let Some(idle) = list.pop_back() {
            if idle.deadline > now && still_open(&idle.stream) {
                return Some((idle.stream, idle.reused));
            }
        }
        None
    })
}

/// A pooled connection must have nothing to read: data or EOF means the
/// peer closed it or broke the protocol.
fn still_open(s: &TcpStream) -> bool {
    let mut b = [0u8; 1];
    matches!(s.try_read(&mut b), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock)
}

/// Parks `stream` for reuse for `idle`, keeping at most `size` per key
/// (the oldest goes first).
pub(crate) fn put(key: String, stream: TcpStream, reused: u32, idle: Duration, size: usize) {
    if size == 0 {
        return;
    }
    POOL.with_borrow_mut(|pool| {
        let list = pool.entry(key).or_default();
        while list.len() >= size {
            list.pop_front();
        }
        list.push_back(Idle {
            stream,
            reused,
            deadline: Instant::now() + idle,
        });
    });
}

/// Idle connections pooled for `key`, both namespaces (tests).
pub(crate) fn idle_count(key: &str) -> usize {
    let http = POOL.with_borrow(|pool| pool.get(key).map_or(0, VecDeque::len));
    let cosock = SPOOLS.with_borrow(|m| m.get(key.as_bytes()).map_or(0, |s| s.idle.borrow().len()));
    http + cosock
}

// === cosocket pools ===

/// Most cosocket pools one thread keeps (pool names come from Lua): past
/// it, pools with no connection are dropped, and if none is, connects
/// go unpooled.
const MAX_POOLS: usize = 4096;
/// Most idle cosocket connections one thread keeps, all pools together
/// (pool sizes come from Lua): past it `setkeepalive` closes instead.
const MAX_IDLE: usize = 16384;
/// Longest pool name accepted (`pool` option, or `host:port`).
pub(crate) const MAX_KEY: usize = 1024;

/// One cosocket pool (ngx_lua's `ngx_http_lua_socket_pool_t`).
pub(crate) struct Spool {
    key: Rc<[u8]>,
    /// Idle connections kept (the least recently used goes first).
    size: usize,
    /// `Some(n)`: at most `size` connections open, `n` connects waiting.
    backlog: Option<usize>,
    /// Connections opened under this pool and still open (in use or idle).
    connections: Cell<usize>,
    /// Connects in the backlog queue.
    waiting: Cell<usize>,
    idle: RefCell<VecDeque<SpoolIdle>>,
    /// Connects waiting (bounded) for a connection to be given back or
    /// closed (queued in the backlog, or deferred: see `tcp/connect.rs`),
    /// each with its flag (false once it stopped waiting: skipped).
    released: RefCell<VecDeque<(Rc<Cell<bool>>, std::task::Waker)>>,
}

/// Most connects one pool keeps waiting for a connection given back.
const MAX_RELEASE_WAITERS: usize = 4096;

struct SpoolIdle {
    conn: Conn,
    slot: Counted,
    reused: u32,
    deadline: Instant,
}

/// A connection counted in its pool's `connections`: dropping it (the
/// connection closed) frees the place and wakes one waiting connect.
pub(crate) struct Counted(Rc<Spool>);

impl Drop for Counted {
    fn drop(&mut self) {
        let s = &self.0;
        s.connections.set(s.connections.get().saturating_sub(1));
        s.wake_released();
    }
}

/// A connect in a pool's backlog queue, counted in its `waiting` while it
/// lives (however its wait ends: a connection, a timeout, a close).
pub(crate) struct Queued(Rc<Spool>);

impl Drop for Queued {
    fn drop(&mut self) {
        let s = &self.0;
        s.waiting.set(s.waiting.get().saturating_sub(1));
    }
}

impl Queued {
    /// Queues a connect that [`Spool::try_acquire`] found no room for;
    /// `None` when `backlog` connects already wait (ngx_lua's "too many
    /// waiting connect operations").
    pub(crate) fn enter(s: &Rc<Spool>) -> Option<Queued> {
        if s.waiting.get() >= s.backlog.unwrap_or(0) {
            return None;
        }
        s.waiting.set(s.waiting.get() + 1);
        Some(Queued(s.clone()))
    }

    /// An idle connection, else room for a new one, if either is there now.
    pub(crate) fn try_acquire(&self) -> Option<Acquired> {
        let s = &self.0;
        if let Some((c, slot, reused)) = s.take_idle() {
            return Some(Acquired::Reused(c, slot, reused));
        }
        (s.connections.get() < s.size).then(|| Acquired::Open(s.count()))
    }

    /// Wakes `w` when a connection is given back or closed (while `flag`
    /// holds); a full wait list wakes it at once (it polls again).
    pub(crate) fn wait(&self, flag: &Rc<Cell<bool>>, w: &std::task::Waker) {
        if !self.0.wait_release(flag, w) {
            w.wake_by_ref();
        }
    }

    pub(crate) fn spool(&self) -> &Rc<Spool> {
        &self.0
    }
}

thread_local! {
    static SPOOLS: RefCell<HashMap<Rc<[u8]>, Rc<Spool>>> = RefCell::new(HashMap::new());
    /// Idle cosocket connections on this thread (all pools).
    static IDLE: Cell<usize> = const { Cell::new(0) };
    /// Whether this thread's idle sweeper task is running.
    static SWEEPER: Cell<bool> = const { Cell::new(false) };
}

/// The pool for `key`, if one exists (no allocation).
pub(crate) fn find(key: &[u8]) -> Option<Rc<Spool>> {
    SPOOLS.with_borrow(|m| m.get(key).cloned())
}

/// The pool for `key`, created with `size` / `backlog` if there is none
/// (an existing pool keeps its size, as in ngx_lua). `None` when the
/// thread already has [`MAX_POOLS`] pools in use.
pub(crate) fn find_or_create(key: &[u8], size: usize, backlog: Option<usize>) -> Option<Rc<Spool>> {
    if let Some(s) = find(key) {
        return Some(s);
    }
    SPOOLS.with_borrow_mut(|m| {
        if m.len() >= MAX_POOLS {
            m.retain(|_, s| s.connections.get() > 0 || s.waiting.get() > 0);
            if m.len() >= MAX_POOLS {
                return None;
            }
        }
        let key: Rc<[u8]> = Rc::from(key);
        let s = Rc::new(Spool {
            key: key.clone(),
            size: size.max(1),
            backlog,
            connections: Cell::new(0),
            waiting: Cell::new(0),
            idle: RefCell::new(VecDeque::new()),
            released: RefCell::new(VecDeque::new()),
        });
        m.insert(key, s.clone());
        Some(s)
    })
}

/// A connect's place in its pool.
pub(crate) enum Acquired {
    /// An idle connection, with its reuse count before this use.
    Reused(Conn, Counted, u32),
    /// Room for a new connection (counted now).
    Open(Counted),
}

impl Spool {
    pub fn key(&self) -> &Rc<[u8]> {
        &self.key
    }

    /// An idle connection still open, most recent first.
    pub(super) fn take_idle(&self) -> Option<(Conn, Counted, u32)> {
        let now = Instant::now();
        loop {
            // Pop under the borrow, drop a dead one after it.
            let mut idle = self.idle.borrow_mut().pop_back()?;
            IDLE.set(IDLE.get() - 1);
            if idle.deadline > now && idle.conn.still_open() {
                return Some((idle.conn, idle.slot, idle.reused));
            }
        }
    }

    /// Connections of this pool open and not idle (held by hooks).
    pub(super) fn in_use(&self) -> usize {
        self.connections
            .get()
            .saturating_sub(self.idle.borrow().len())
    }

    /// Idle connections kept.
    pub(super) fn size(&self) -> usize {
        self.size
    }

    /// Registers a connect waiting for a connection to be given back (or
    /// closed), woken then while `flag` holds; false when too many wait.
    pub(super) fn wait_release(&self, flag: &Rc<Cell<bool>>, w: &std::task::Waker) -> bool {
        let mut q = self.released.borrow_mut();
        if q.len() >= MAX_RELEASE_WAITERS {
            // Entries of connects that stopped waiting go first.
            q.retain(|(f, _)| f.get());
            if q.len() >= MAX_RELEASE_WAITERS {
                return false;
            }
        }
        q.push_back((flag.clone(), w.clone()));
        true
    }

    /// Wakes the first connect still waiting for a connection.
    fn wake_released(&self) {
        loop {
            let Some((flag, w)) = self.released.borrow_mut().pop_front() else {
                return;
            };
            if flag.get() {
                w.wake();
                return;
            }
        }
    }

    /// Whether connects queue in a backlog when the pool is full.
    pub(super) fn queues(&self) -> bool {
        self.backlog.is_some()
    }

    /// An idle connection or a place for a new one, else None (the
    /// connect queues in the backlog, or is refused: [`Queued::enter`]).
    pub(super) fn try_acquire(self: &Rc<Self>) -> Option<Acquired> {
        if let Some((c, slot, reused)) = self.take_idle() {
            return Some(Acquired::Reused(c, slot, reused));
        }
        // Without a backlog the pool bounds only idle connections (ngx_lua);
        // with one, queued connects go first: a new one opens only with
        // none waiting.
        if self.backlog.is_none() || (self.connections.get() < self.size && self.waiting.get() == 0)
        {
            return Some(Acquired::Open(self.count()));
        }
        None
    }

    fn count(self: &Rc<Self>) -> Counted {
        self.connections.set(self.connections.get() + 1);
        Counted(self.clone())
    }

    /// Parks `conn` for `idle`, evicting the least recently used idle
    /// connection when `size` are already idle, and wakes a queued connect.
    pub fn put(self: &Rc<Self>, conn: Conn, slot: Option<Counted>, reused: u32, idle: Duration) {
        if IDLE.get() >= MAX_IDLE {
            return;
        }
        let slot = slot.unwrap_or_else(|| self.count());
        let evicted = {
            let mut list = self.idle.borrow_mut();
            let evicted = if list.len() >= self.size {
                list.pop_front()
            } else {
                None
            };
            list.push_back(SpoolIdle {
                conn,
                slot,
                reused,
                deadline: Instant::now() + idle,
            });
            IDLE.set(IDLE.get() + 1 - usize::from(evicted.is_some()));
            evicted
        };
        drop(evicted);
        self.wake_released();
        start_sweeper();
    }
}

/// Closes idle connections past their idle timeout (ngx_lua closes them
/// on a timer): one task per thread, running while any connection idles.
fn start_sweeper() {
    if SWEEPER.get() {
        return;
    }
    SWEEPER.set(true);
    tokio::task::spawn_local(async {
        // Cleared however the task ends (its runtime may shut down).
        let _running = SweeperFlag;
        loop {
            let next = sweep();
            let Some(next) = next else {
                return;
            };
            // Wake at the earliest deadline, at most a second from now (a
            // closed peer's connection is dropped then too).
            let now = Instant::now();
            let wait = next
                .saturating_duration_since(now)
                .min(Duration::from_secs(1));
            tokio::time::sleep(wait.max(Duration::from_millis(1))).await;
        }
    });
}

struct SweeperFlag;

impl Drop for SweeperFlag {
    fn drop(&mut self) {
        let _ = SWEEPER.try_with(|s| s.set(false));
    }
}

/// Drops expired or dead idle connections; the earliest remaining deadline.
fn sweep() -> Option<Instant> {
    let spools: Vec<Rc<Spool>> = SPOOLS
        .try_with(|m| {
            m.try_borrow()
                .map(|m| m.values().cloned().collect())
                .unwrap_or_default()
        })
        .unwrap_or_default();
    let now = Instant::now();
    let mut next: Option<Instant> = None;
    for s in spools {
        let dead: Vec<SpoolIdle> = {
            let mut list = s.idle.borrow_mut();
            let mut dead = Vec::new();
            let mut i = 0;
            while i < list.len() {
                if list[i].deadline <= now || !list[i].conn.still_open() {
                    if let Some(d) = list.remove(i) {
                        IDLE.set(IDLE.get() - 1);
                        dead.push(d);
                    }
                } else {
                    next = Some(next.map_or(list[i].deadline, |n| n.min(list[i].deadline)));
                    i += 1;
                }
            }
            dead
        };
        drop(dead);
    }
    next
}
