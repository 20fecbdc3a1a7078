//! The yielding side of the API (mlua async functions, not hot paths):
//! `pier.sleep`, `pier.timer`, and (in submodules) cosockets and the HTTP
//! client. All run on the engine's thread; nothing here blocks it.

use std::cell::{Cell, RefCell};
use std::ptr::NonNull;
use std::rc::{Rc, Weak};
use std::time::Duration;

use mlua::{Function, Lua, MultiValue, Table, Value};

use crate::current::{self, Current};
use crate::engine::{Hooked, Inner};
use crate::phase::Phase;

mod body;
mod http;
mod pool;
mod sema;
mod table;
mod tcp;
mod udp;

pub(crate) use pool::idle_count;
pub(crate) use tcp::sock_api_addr;
/// A request or timer run ended: its cosockets close, its semaphore waits end.
pub(crate) fn free_owner(owner: u64) {
    table::free_owner(owner);
    sema::free_owner(owner);
}

/// Timers alive at once per engine (as `lua_max_running_timers` + pending).
pub const MAX_TIMERS: usize = 4096;

/// The engine's timers: those created before the thread's `LocalSet` runs
/// (in `init_worker`) wait in `pending`.
#[derive(Default)]
pub(crate) struct Timers {
    pending: RefCell<Vec<TimerJob>>,
    /// Timers alive: waiting for their delay or running their callback.
    count: Rc<Cell<usize>>,
    /// Timers running their callback now (ngx_lua's `running_count`; the
    /// others are its `pending_count`).
    running: Rc<Cell<usize>>,
}

/// Counts one timer as running its callback while alive (also when the
/// run is dropped midway).
struct Running(Rc<Cell<usize>>);

impl Running {
    fn start(c: &Rc<Cell<usize>>) -> Self {
        c.set(c.get() + 1);
        Running(c.clone())
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        self.0.set(self.0.get().saturating_sub(1));
    }
}

impl Timers {
    pub fn start_pending(&self) {
        if self.pending.borrow().is_empty() {
            return;
        }
        for job in self.pending.take() {
            tokio::task::spawn_local(job.run());
        }
    }
}

struct TimerJob {
    engine: Weak<Inner>,
    delay: Duration,
    every: bool,
    func: Function,
    args: MultiValue,
    count: Rc<Cell<usize>>,
    running: Rc<Cell<usize>>,
}

impl TimerJob {
    async fn run(self) {
        loop {
            tokio::time::sleep(self.delay).await;
            // The engine was dropped (config reload): the timer ends.
            let Some(inner) = self.engine.upgrade() else {
                break;
            };
            let running = Running::start(&self.running);
            let r = self.fire(&inner).await;
            drop(running);
            if let Err(e) = r {
                tracing::error!(target: "pier::lua", "lua timer failed: {}", crate::error::describe(&e));
            }
            if !self.every {
                break;
            }
        }
        self.count.set(self.count.get() - 1);
    }

    async fn fire(&self, inner: &Rc<Inner>) -> mlua::Result<()> {
        // Through ngx.thread's entry: the run ends when the light threads
        // the callback spawned have.
        let entry: Function = inner.lua.named_registry_value(sema::THREAD_ENTRY)?;
        let thread = inner.lua.create_thread(entry)?;
        // OpenResty passes `premature` first; it is always false here.
        let mut args = MultiValue::with_capacity(self.args.len() + 2);
        args.push_back(Value::Function(self.func.clone()));
        args.push_back(Value::Boolean(false));
        args.extend(self.args.iter().cloned());
        let fut = thread.into_async::<()>(args)?;
        let cur = Current {
            phase: Some(Phase::Timer),
            engine: Some(NonNull::from(&**inner)),
            // Each run owns its cosockets, closed when it ends.
            owner: current::new_owner(),
            ..Current::NONE
        };
        let r = Hooked { fut, cur }.await;
        free_owner(cur.owner);
        r
    }
}

fn timer_native(
    lua: &Lua,
    engine: Rc<RefCell<Weak<Inner>>>,
    every: bool,
) -> mlua::Result<Function> {
    lua.create_function(move |_, (delay, func, args): (f64, Function, MultiValue)| {
        let what = if every {
            "bad argument #1 to pier.timer.every"
        } else {
            "bad argument #1 to pier.timer.at"
        };
        let delay = crate::limits::lua_secs(delay, what)?;
        if every && delay.is_zero() {
            return Err(mlua::Error::runtime(format!(
                "{what}: invalid duration 0 (an interval must be positive)"
            )));
        }
        let Some(inner) = engine.borrow().upgrade() else {
            return Ok((None, Some("engine gone")));
        };
        let count = inner.timers.count.clone();
        let running = inner.timers.running.clone();
        if count.get() >= MAX_TIMERS {
            return Ok((None, Some("too many pending timers")));
        }
        count.set(count.get() + 1);
        let job = TimerJob {
            engine: Rc::downgrade(&inner),
            delay,
            every,
            func,
            args,
            count,
            running,
        };
        if current::get().phase == Some(Phase::InitWorker) {
            inner.timers.pending.borrow_mut().push(job);
        } else {
            tokio::task::spawn_local(job.run());
        }
        Ok((Some(true), None))
    })
}

/// Adds the yielding natives to the `pier.native` table.
pub(crate) fn register(
    lua: &Lua,
    natives: &Table,
    engine: Rc<RefCell<Weak<Inner>>>,
) -> mlua::Result<()> {
    // Light threads: every async native below is created with ngx.thread's yield.
    let real_yield = sema::install_threads(lua, natives)?;
    natives.set(
        "sleep",
        lua.create_async_function(|_, secs: f64| async move {
            let d = crate::limits::lua_secs(secs, "bad argument #1 to pier.sleep")?;
            tokio::time::sleep(d).await;
            Ok(())
        })?,
    )?;
    tcp::register(lua, natives)?;
    body::register(lua, natives)?;
    sema::register(lua, natives)?;
    udp::register(lua, natives)?;
    natives.set(
        "http_request",
        lua.create_async_function(|lua, opts: Table| async move {
            let max_body = match current::get().engine {
                // SAFETY: the engine outlives every hook call it runs.
                Some(e) => unsafe { e.as_ref() }.limits.http_max_body,
                None => crate::limits::LuaLimits::DEFAULT.http_max_body,
            };
            http::request(&lua, opts, max_body).await
        })?,
    )?;
    natives.set(
        "pool_idle",
        lua.create_function(|_, key: String| Ok(idle_count(&key)))?,
    )?;
    natives.set("timer_at", timer_native(lua, engine.clone(), false)?)?;
    natives.set("timer_every", timer_native(lua, engine.clone(), true)?)?;
    natives.set(
        "timer_count",
        lua.create_function({
            let engine = engine.clone();
            move |_, ()| {
                Ok(engine
                    .borrow()
                    .upgrade()
                    .map_or(0, |i| i.timers.count.get()))
            }
        })?,
    )?;
    // ngx.timer.pending_count / running_count: waiting for the delay vs
    // running the callback now.
    natives.set(
        "timer_pending",
        lua.create_function({
            let engine = engine.clone();
            move |_, ()| {
                Ok(engine.borrow().upgrade().map_or(0, |i| {
                    let t = &i.timers;
                    t.count.get().saturating_sub(t.running.get())
                }))
            }
        })?,
    )?;
    natives.set(
        "timer_running",
        lua.create_function(move |_, ()| {
            Ok(engine
                .borrow()
                .upgrade()
                .map_or(0, |i| i.timers.running.get()))
        })?,
    )?;
    sema::restore_yield(lua, real_yield)?;
    Ok(())
}
