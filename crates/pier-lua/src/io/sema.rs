//! `ngx.semaphore` and the natives behind `ngx.thread` (the scheduler
//! itself is Lua: `lua/pier/ngx_thread.lua`).
//!
//! `ngx.semaphore` (lua-resty-core's API) for the hooks of one worker
//! thread, as OpenResty's are per worker process: `new(n)`, `post(n)`,
//! `count()` and the yielding `wait(timeout)`.
//!
//! A semaphore holds `resources` and a FIFO queue of waiters. `post` adds
//! resources and hands them to the longest-waiting waiters at once (the
//! waiter is marked granted and its task woken); `wait` takes a resource
//! without yielding only when nobody is queued (ngx_lua keeps that order
//! too). `count()` is `resources - queued waiters`, as ngx_lua.
//!
//! A post is never lost to a waiter that will not run again: a granted
//! waiter whose future is dropped before it saw the grant gives the
//! resource back (and it goes to the next waiter), and a queued waiter is
//! removed when its request (or timer run) ends ([`free_owner`], called
//! with the cosockets' cleanup) or when `ngx.thread.kill` kills its light
//! thread ([`cancel_thread`]): a hook's coroutine suspended in a wait is
//! only collected later by Lua's GC, so its future's drop cannot be relied
//! upon to leave the queue in time.

use std::cell::{Cell, RefCell};
use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::pin::Pin;
use std::rc::{Rc, Weak};
use std::task::{Context, Poll, Waker};

use mlua::{AnyUserData, Function, Lua, Table, Thread, UserData, Value};

use crate::current;
use crate::phase::mask;

/// Largest resource count given to `new` / `post` (ngx_lua takes a C `int`).
const MAX_N: f64 = i32::MAX as f64;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum State {
    /// In its semaphore's queue.
    Waiting,
    /// Handed a resource by `post`; its future has not taken it yet.
    Granted,
    /// Took its resource, timed out, or was cancelled.
    Done,
}

struct Waiter {
    /// The request (or timer run) waiting: see [`free_owner`].
    owner: u64,
    /// The coroutine waiting (its address): see [`cancel_thread`].
    co: usize,
    state: Cell<State>,
    waker: RefCell<Option<Waker>>,
    sema: Weak<Sema>,
}

/// One semaphore; Lua holds it as a userdata.
#[derive(Default)]
pub(crate) struct Sema {
    resources: Cell<i64>,
    queue: RefCell<VecDeque<Rc<Waiter>>>,
}

impl UserData for SemaRef {}

/// The userdata Lua holds (`{ sem = <SemaRef> }`).
struct SemaRef(Rc<Sema>);

thread_local! {
    /// Waiters not yet done, by owner, so that a request's end cancels its
    /// waits without scanning the others.
    static OWNED: RefCell<HashMap<u64, Vec<Rc<Waiter>>>> = RefCell::new(HashMap::new());
}

impl Sema {
    fn count(&self) -> i64 {
        self.resources.get() - self.queue.borrow().len() as i64
    }

    fn post(&self, n: i64) {
        self.resources.set(self.resources.get().saturating_add(n));
        self.dispatch();
    }

    /// Hands resources to the queued waiters, oldest first.
    fn dispatch(&self) {
        while self.resources.get() > 0 {
            let Some(w) = self.queue.borrow_mut().pop_front() else {
                break;
            };
            self.resources.set(self.resources.get() - 1);
            w.state.set(State::Granted);
            // Schedules the waiting task: nothing runs from here.
            let waker = w.waker.borrow_mut().take();
            if let Some(waker) = waker {
                waker.wake();
            }
        }
    }
}

/// Ends a wait: leaves the queue, or gives back a resource granted but not
/// taken (`taken` false), and forgets the waiter.
fn finish(w: &Rc<Waiter>, taken: bool) {
    let state = w.state.replace(State::Done);
    if let Some(sema) = w.sema.upgrade() {
        match state {
            State::Waiting => sema.queue.borrow_mut().retain(|q| !Rc::ptr_eq(q, w)),
            State::Granted if !taken => sema.post(1),
            State::Granted | State::Done => {}
        }
    }
    if state != State::Done {
        // `try_with`: may run while the thread-locals are torn down.
        let _ = OWNED.try_with(|m| {
            let Ok(mut m) = m.try_borrow_mut() else {
                return;
            };
            if let Some(list) = m.get_mut(&w.owner) {
                list.retain(|q| !Rc::ptr_eq(q, w));
                if list.is_empty() {
                    m.remove(&w.owner);
                }
            }
        });
    }
}

/// A request or timer run ended: its waits end with it, so that posts go
/// to waiters that can still run.
pub(crate) fn free_owner(owner: u64) {
    let waiters = OWNED.try_with(|m| {
        let mut m = m.try_borrow_mut().ok()?;
        // Every request end comes here: no hashing when nobody waits.
        if m.is_empty() {
            return None;
        }
        m.remove(&owner)
    });
    for w in waiters.ok().flatten().into_iter().flatten() {
        finish(&w, false);
    }
}

/// `ngx.thread.kill`: ends the waits of light thread `co` of the current
/// request.
fn cancel_thread(co: usize) {
    let owner = current::get().owner;
    let mine: Vec<Rc<Waiter>> = OWNED.with_borrow(|m| {
        m.get(&owner)
            .map(|l| l.iter().filter(|w| w.co == co).cloned().collect())
            .unwrap_or_default()
    });
    for w in mine {
        finish(&w, false);
    }
}

/// The future of a `wait` that had to queue.
struct Wait {
    waiter: Rc<Waiter>,
    timeout: Pin<Box<tokio::time::Sleep>>,
}

impl Future for Wait {
    /// Whether the resource was taken (false: timed out).
    type Output = mlua::Result<bool>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.waiter.state.get() {
            State::Granted => {
                finish(&self.waiter, true);
                return Poll::Ready(Ok(true));
            }
            State::Done => {
                // Cancelled (its request ended or its thread was killed)
                // but polled anyway.
                return Poll::Ready(Err(mlua::Error::runtime("semaphore wait cancelled")));
            }
            State::Waiting => {}
        }
        if self.timeout.as_mut().poll(cx).is_ready() {
            finish(&self.waiter, false);
            return Poll::Ready(Ok(false));
        }
        let mut slot = self.waiter.waker.borrow_mut();
        match slot.as_ref() {
            Some(w) if w.will_wake(cx.waker()) => {}
            _ => *slot = Some(cx.waker().clone()),
        }
        Poll::Pending
    }
}

impl Drop for Wait {
    fn drop(&mut self) {
        if self.waiter.state.get() != State::Done {
            finish(&self.waiter, false);
        }
    }
}

fn sema_of(ud: &AnyUserData) -> mlua::Result<Rc<Sema>> {
    ud.borrow::<SemaRef>()
        .map(|s| s.0.clone())
        .map_err(|_| mlua::Error::runtime("not a semaphore instance"))
}

/// A resource count from Lua: a whole number from `min` to `i32::MAX`.
fn count_arg(n: f64, min: f64) -> Option<i64> {
    (n.is_finite() && n >= min && n <= MAX_N).then(|| n.floor() as i64)
}

/// Adds the semaphore natives to `pier.native`.
pub(crate) fn register(lua: &Lua, natives: &Table) -> mlua::Result<()> {
    natives.set(
        "sema_new",
        lua.create_function(|lua, n: f64| {
            let n = count_arg(n, 0.0).ok_or_else(|| mlua::Error::runtime("no negative number"))?;
            let sema = Sema::default();
            sema.resources.set(n);
            lua.create_userdata(SemaRef(Rc::new(sema)))
        })?,
    )?;
    natives.set(
        "sema_post",
        lua.create_function(|_, (ud, n): (AnyUserData, f64)| {
            let n = count_arg(n, 1.0).ok_or_else(|| mlua::Error::runtime("no negative number"))?;
            sema_of(&ud)?.post(n);
            Ok(true)
        })?,
    )?;
    natives.set(
        "sema_count",
        lua.create_function(|_, ud: AnyUserData| Ok(sema_of(&ud)?.count()))?,
    )?;
    natives.set(
        "sema_cancel_thread",
        lua.create_function(|_, co: Thread| {
            cancel_thread(co.to_pointer() as usize);
            Ok(())
        })?,
    )?;
    // wait(sema, seconds): true; nil, "timeout" at once when nothing is
    // free and `seconds` is 0 (under 1 ms, as ngx_lua's integer ms); else
    // queues and yields: true, or false, "timeout". The Lua wrapper checks
    // the phase and the arguments first.
    natives.set(
        "sema_wait",
        lua.create_async_function(|lua, (ud, secs): (AnyUserData, f64)| {
            let start = start_wait(&lua, &ud, secs);
            async move {
                let timeout =
                    || -> mlua::Result<Value> { Ok(Value::String(lua.create_string("timeout")?)) };
                match start? {
                    Start::Taken => Ok((Value::Boolean(true), Value::Nil)),
                    Start::Busy => Ok((Value::Nil, timeout()?)),
                    Start::Queued(w) => Ok(if w.await? {
                        (Value::Boolean(true), Value::Nil)
                    } else {
                        (Value::Boolean(false), timeout()?)
                    }),
                }
            }
        })?,
    )?;
    Ok(())
}

enum Start {
    /// A free resource was taken: true.
    Taken,
    /// None free and a zero timeout: nil, "timeout".
    Busy,
    /// Queued: true, or false, "timeout" (ngx_lua's results after a wait).
    Queued(Wait),
}

/// The synchronous part of `wait`, run when it is called: takes a free
/// resource or queues the waiter (so the queue order is the call order).
fn start_wait(lua: &Lua, ud: &AnyUserData, secs: f64) -> mlua::Result<Start> {
    let cur = current::get();
    if !cur.allows(mask::YIELD) {
        return Err(mlua::Error::runtime("API disabled in this phase"));
    }
    let timeout = crate::limits::lua_secs(secs, "bad argument #1 to wait")?;
    let sema = sema_of(ud)?;
    if sema.queue.borrow().is_empty() && sema.resources.get() > 0 {
        sema.resources.set(sema.resources.get() - 1);
        return Ok(Start::Taken);
    }
    if timeout.as_millis() == 0 {
        return Ok(Start::Busy);
    }
    let waiter = Rc::new(Waiter {
        owner: cur.owner,
        co: lua.current_thread().to_pointer() as usize,
        state: Cell::new(State::Waiting),
        waker: RefCell::new(None),
        sema: Rc::downgrade(&sema),
    });
    sema.queue.borrow_mut().push_back(waiter.clone());
    OWNED.with_borrow_mut(|m| m.entry(cur.owner).or_default().push(waiter.clone()));
    Ok(Start::Queued(Wait {
        waiter,
        timeout: Box::pin(tokio::time::sleep(timeout)),
    }))
}

/// Registry key of `ngx_thread._entry` (runs a timer's function, then waits
/// for the light threads it left running).
pub(crate) const THREAD_ENTRY: &str = "pier.ngx_thread.entry";

/// Loads the light-thread scheduler and makes its `_yield` the global
/// `coroutine.yield` while the async natives are created (mlua's wrapper of
/// an async function captures `coroutine.yield` then): their pending yields
/// then schedule the yielding coroutine's light threads. Returns the real
/// `coroutine.yield`, for [`restore_yield`] once the natives exist.
pub(crate) fn install_threads(lua: &Lua, natives: &Table) -> mlua::Result<Function> {
    // The value mlua's async wrappers yield while their future is pending
    // (public, if doc-hidden, in mlua 0.12).
    natives.set("poll_pending", Value::LightUserData(Lua::poll_pending()))?;
    // The running request's (or timer run's) id: light threads belong to it.
    natives.set(
        "owner",
        lua.create_function(|_, ()| Ok(current::get().owner as f64))?,
    )?;
    let m: Table = lua
        .load(include_str!("../../lua/pier/ngx_thread.lua"))
        .set_name("@pier/ngx_thread.lua")
        .call(natives.clone())?;
    natives.set("ngx_thread", &m)?;
    lua.set_named_registry_value(THREAD_ENTRY, m.get::<Function>("_entry")?)?;
    let coroutine: Table = lua.globals().get("coroutine")?;
    let real: Function = coroutine.get("yield")?;
    coroutine.set("yield", m.get::<Function>("_yield")?)?;
    Ok(real)
}

/// Puts the real `coroutine.yield` back (see [`install_threads`]).
pub(crate) fn restore_yield(lua: &Lua, real: Function) -> mlua::Result<()> {
    lua.globals().get::<Table>("coroutine")?.set("yield", real)
}
