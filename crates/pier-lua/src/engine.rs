//! One Lua state per worker thread and the running of hooks on it.

use std::cell::{Cell, RefCell};
use std::future::Future;
use std::pin::Pin;
use std::ptr::NonNull;
use std::rc::{Rc, Weak};
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::BytesMut;
use mlua::{Function, Lua};
use pier_shdict::Registry;

use crate::current::{self, Current, Scope};
use crate::error::LuaError;
use crate::limits::LuaLimits;
use crate::phase::Phase;
use crate::setup::LuaSetup;
use crate::view::HttpView;
use crate::{modules, BalancerChoice, Flow};

// === RequestCtx ===

/// Per-request Lua state kept by the proxy from `access` to `log`: the slot
/// of the `pier.ctx` table (created on first use, released on drop) and the
/// flow a hook asked for. `!Send`: it belongs to the engine's thread.
pub struct RequestCtx {
    /// Slot of this request's `pier.ctx` table in the Lua-side slot array (-1: none).
    pub(crate) ctx_ref: i32,
    pub(crate) slots: Option<Rc<CtxSlots>>,
    pub(crate) exit: Option<u16>,
    pub(crate) location: Option<Vec<u8>>,
    /// `pier.say` output, or the body given to `pier.exit`.
    pub(crate) body: Vec<u8>,
    pub(crate) peer: Option<std::net::SocketAddr>,
    pub(crate) retries: Option<u32>,
    /// The failed attempt the `balancer` hook runs again after (1: connect,
    /// 2: the origin failed the request; and its status).
    pub(crate) last_failure: Option<(u8, u16)>,
    /// `pier.resp.set_status` in access/content: the status of a local answer.
    pub(crate) status: Option<u16>,
    /// Set by the runner coroutine when the hook returned (see `Runners`).
    pub(crate) done: bool,
    /// Unique on this thread: owns the request's cosockets, which are
    /// closed when this is dropped.
    pub(crate) id: u64,
}

impl RequestCtx {
    /// Before the `balancer` hook runs again after a failed attempt: what
    /// `pier.balancer.get_last_failure()` tells it (`connect`: "failed",
    /// else "next"). A peer it set before is forgotten: it sets one again
    /// to retry there.
    pub fn set_last_failure(&mut self, connect: bool, status: u16) {
        self.last_failure = Some((if connect { 1 } else { 2 }, status));
        self.peer = None;
    }

    pub fn new() -> Self {
        RequestCtx {
            ctx_ref: -1,
            slots: None,
            exit: None,
            location: None,
            body: Vec::new(),
            peer: None,
            retries: None,
            last_failure: None,
            status: None,
            done: false,
            id: current::new_owner(),
        }
    }
}

impl Default for RequestCtx {
    fn default() -> Self {
        Self::new()
    }
}

impl Drop for RequestCtx {
    fn drop(&mut self) {
        if let Some(slots) = self.slots.take() {
            slots.release(self.ctx_ref);
        }
        // As OpenResty: a request's cosockets end with it.
        crate::io::free_owner(self.id);
    }
}

/// Allocator of `pier.ctx` slots. A released slot keeps its old table until
/// reused (it is then overwritten), so at most "peak concurrent requests"
/// tables are retained.
#[derive(Default)]
pub(crate) struct CtxSlots {
    free: RefCell<Vec<i32>>,
    next: Cell<i32>,
}

impl CtxSlots {
    pub fn alloc(&self) -> i32 {
        self.free.borrow_mut().pop().unwrap_or_else(|| {
            let n = self.next.get() + 1;
            self.next.set(n);
            n
        })
    }

    pub fn release(&self, r: i32) {
        if r > 0 {
            self.free.borrow_mut().push(r);
        }
    }

    /// Slots ever handed out (for tests and metrics).
    pub fn high_water(&self) -> i32 {
        self.next.get()
    }
}

// === engine ===

/// What the `extern "C"` functions and the natives reach through
/// [`Current::engine`].
pub(crate) struct Inner {
    pub lua: Lua,
    pub shared: Arc<Registry>,
    pub ctx_slots: Rc<CtxSlots>,
    /// `[route][phase slot]` compiled hooks.
    hooks: Vec<[Option<Function>; 7]>,
    pub timers: crate::io::Timers,
    memory_limit: usize,
    pub limits: LuaLimits,
    runners: Runners,
    /// Last: closes the state once every handle above is gone.
    heap: crate::heap::Heap,
}

/// Idle "runner" coroutines, reused across requests instead of creating a
/// coroutine per hook run. A runner loops `f = yield(); f()` (see
/// `lua/pier/runner.lua`); it goes back to the pool only when its hook
/// returned normally (after an error it is dead, after `pier.exit` it is
/// suspended inside user code: both are dropped).
struct Runners {
    runner: Function,
    idle: RefCell<Vec<mlua::Thread>>,
}

const MAX_IDLE_RUNNERS: usize = 256;

/// A per-thread LuaJIT state running the hooks of one [`LuaSetup`].
/// `!Send`: create one on each worker thread.
pub struct LuaEngine {
    inner: Rc<Inner>,
}

impl LuaEngine {
    /// Creates the state: loads the standard libraries (with `ffi` and
    /// `jit`), the embedded `pier.*` modules, compiles every hook, then runs
    /// `init` and `init_worker`. Timers started there begin when the engine
    /// is first used inside the thread's `LocalSet` (or at
    /// [`start_timers`](Self::start_timers)).
    pub fn new(setup: Arc<LuaSetup>, shared: Arc<Registry>) -> Result<Self, LuaError> {
        Self::with_limits(setup, shared, LuaLimits::default())
    }

    /// [`new`](Self::new) with explicit bounds (the `[lua]` config keys;
    /// see [`LuaLimits`]).
    pub fn with_limits(
        setup: Arc<LuaSetup>,
        shared: Arc<Registry>,
        limits: LuaLimits,
    ) -> Result<Self, LuaError> {
        let err = |e| LuaError::lua(None, e);
        // With `ffi` and `debug` ("unsafe" libraries for mlua: Lua code can
        // corrupt memory with them). Hook code is the operator's own
        // configuration, trusted like nginx.conf, and FFI is the point.
        let (heap, lua) = crate::heap::Heap::new().map_err(err)?;
        // Before any Rust function is handed to Lua: see `cabi`.
        crate::cabi::install(&lua).map_err(err)?;
        let weak_slot: Rc<RefCell<Weak<Inner>>> = Rc::default();
        modules::bootstrap(&lua, &setup, weak_slot.clone()).map_err(err)?;

        let mut hooks = Vec::with_capacity(setup.routes.len());
        for (i, r) in setup.routes.iter().enumerate() {
            let mut slots: [Option<Function>; 7] = Default::default();
            for (slot, phase) in Phase::ROUTE.into_iter().enumerate() {
                if let Some(src) = r.get(phase) {
                    slots[slot] = Some(compile(&lua, src, Some(phase)).map_err(|e| {
                        LuaError::new(Some(phase), format!("route {i}: {}", e.message))
                    })?);
                }
            }
            hooks.push(slots);
        }
        let runner: Function = lua
            .load(include_str!("../lua/pier/runner.lua"))
            .set_name("@pier/runner.lua")
            .eval()
            .map_err(err)?;
        let inner = Rc::new(Inner {
            runners: Runners {
                runner,
                idle: RefCell::new(Vec::new()),
            },
            lua,
            shared,
            ctx_slots: Rc::default(),
            hooks,
            timers: crate::io::Timers::default(),
            memory_limit: setup.memory_limit,
            limits,
            heap,
        });
        *weak_slot.borrow_mut() = Rc::downgrade(&inner);
        let engine = LuaEngine { inner };

        for (phase, src) in [
            (Phase::Init, &setup.init),
            (Phase::InitWorker, &setup.init_worker),
        ] {
            if let Some(src) = src {
                let f = compile(&engine.inner.lua, src, Some(phase))?;
                engine.run_sync(phase, &f, Current::NONE)?;
            }
        }
        // Set after `init`, as before: the limit bounds what requests and
        // timers allocate ("not enough memory" in the hook; see `heap`).
        engine.inner.heap.set_limit(setup.memory_limit);
        Ok(engine)
    }

    /// The Lua state (for tests and embedding).
    ///
    /// # Safety
    /// No clone of the returned `Lua` may outlive the engine: the engine
    /// closes the state when dropped (`heap.rs`), whoever still holds a
    /// handle. Values taken from it (tables, functions) may outlive it: they
    /// hold weak references, and fail cleanly once the state is gone.
    pub unsafe fn lua(&self) -> &Lua {
        &self.inner.lua
    }

    /// Whether `route` has a hook for `phase`: the proxy skips all Lua work
    /// otherwise.
    #[inline]
    pub fn has_hook(&self, route: usize, phase: Phase) -> bool {
        self.hook(route, phase).is_some()
    }

    fn hook(&self, route: usize, phase: Phase) -> Option<&Function> {
        let slot = phase.route_slot()?;
        self.inner.hooks.get(route)?[slot].as_ref()
    }

    /// Spawns the timers created during `init_worker` (needs the thread's
    /// `LocalSet`). Also done at the start of every async hook.
    pub fn start_timers(&self) {
        self.inner.timers.start_pending();
    }

    /// Bytes of Lua heap in use.
    pub fn used_memory(&self) -> usize {
        self.inner.heap.used()
    }

    /// Idle pooled hook coroutines (a metric; see `Runners`).
    pub fn idle_runners(&self) -> usize {
        self.inner.runners.idle.borrow().len()
    }

    /// `pier.ctx` slots handed out so far (bounded by peak concurrency).
    pub fn ctx_slots_high_water(&self) -> i32 {
        self.inner.ctx_slots.high_water()
    }

    fn cur(&self, phase: Phase, view: &mut dyn HttpView, ctx: &mut RequestCtx) -> Current {
        let owner = ctx.id;
        Current {
            phase: Some(phase),
            view: Some(current::view_ptr(view)),
            ctx: Some(NonNull::from(ctx)),
            engine: Some(NonNull::from(&*self.inner)),
            chunk: None,
            eof: false,
            owner,
        }
    }

    /// Runs `f` to completion on the main thread (no yielding), with `cur` published.
    fn run_sync(&self, phase: Phase, f: &Function, mut cur: Current) -> Result<(), LuaError> {
        cur.phase = Some(phase);
        cur.engine = Some(NonNull::from(&*self.inner));
        let r = {
            let _scope = Scope::enter(cur);
            f.call::<()>(())
        };
        self.after_hook(r.is_err());
        r.map_err(|e| LuaError::lua(Some(phase), e))
    }

    /// Runs the hook in a new coroutine, publishing the request around every
    /// resume; stops early when the hook called `pier.exit`/`pier.redirect`.
    async fn run_async(
        &self,
        route: usize,
        phase: Phase,
        view: &mut dyn HttpView,
        ctx: &mut RequestCtx,
    ) -> Result<bool, LuaError> {
        let Some(f) = self.hook(route, phase) else {
            return Ok(false);
        };
        self.inner.timers.start_pending();
        let err = |e| LuaError::lua(Some(phase), e);
        let runners = &self.inner.runners;
        let thread = match runners.idle.borrow_mut().pop() {
            Some(t) => t,
            None => self
                .inner
                .lua
                .create_thread(runners.runner.clone())
                .map_err(err)?,
        };
        let handle = thread.clone();
        let fut = thread.into_async::<()>(f).map_err(err)?;
        ctx.done = false;
        let cur = self.cur(phase, view, ctx);
        let r = Hooked { fut, cur }.await;
        if ctx.done {
            ctx.done = false;
            let mut idle = runners.idle.borrow_mut();
            if idle.len() < MAX_IDLE_RUNNERS {
                idle.push(handle);
            }
        } else {
            // A failed or exited hook's coroutine still references everything
            // on its stack: let go of it before `after_hook` collects (after
            // a memory-limit error that is what frees the memory).
            drop(handle);
        }
        self.after_hook(r.is_err());
        r.map_err(err)?;
        Ok(true)
    }

    /// With a memory limit, collects after a failed hook (it may have hit
    /// the limit: LuaJIT raises "not enough memory" without an emergency
    /// collection, so its garbage would fail the next hooks too) and when
    /// close to the limit.
    fn after_hook(&self, failed: bool) {
        let limit = self.inner.memory_limit;
        if limit > 0 && (failed || self.inner.heap.used() > limit / 10 * 9) {
            // Unbounded while it runs: mlua makes the call protected, which
            // allocates, and at the limit that would fail the collection.
            self.inner.heap.set_limit(0);
            let _ = self.inner.lua.gc_collect();
            self.inner.heap.set_limit(limit);
        }
    }

    // === phases ===

    /// `access`: may rewrite the request, respond or redirect.
    pub async fn access(
        &self,
        route: usize,
        req: &mut dyn HttpView,
        ctx: &mut RequestCtx,
    ) -> Result<Flow, LuaError> {
        if !self.run_async(route, Phase::Access, req, ctx).await? {
            return Ok(Flow::Continue);
        }
        Ok(take_flow(Phase::Access, req, ctx))
    }

    /// `content`: the hook produces the response (`pier.say`, `pier.exit`).
    /// Without a content hook, `Flow::Continue` (proxy as usual).
    pub async fn content(
        &self,
        route: usize,
        req: &mut dyn HttpView,
        ctx: &mut RequestCtx,
    ) -> Result<Flow, LuaError> {
        if !self.run_async(route, Phase::Content, req, ctx).await? {
            return Ok(Flow::Continue);
        }
        Ok(take_flow(Phase::Content, req, ctx))
    }

    /// `balancer`: `pier.balancer.set_peer` / `set_retries`.
    pub async fn balancer(
        &self,
        route: usize,
        req: &mut dyn HttpView,
        ctx: &mut RequestCtx,
    ) -> Result<BalancerChoice, LuaError> {
        self.run_async(route, Phase::Balancer, req, ctx).await?;
        Ok(BalancerChoice {
            peer: ctx.peer.take(),
            retries: ctx.retries.take(),
        })
    }

    /// `upstream_request`: edit the request to the origin; may respond.
    pub async fn upstream_request(
        &self,
        route: usize,
        req: &mut dyn HttpView,
        ctx: &mut RequestCtx,
    ) -> Result<Flow, LuaError> {
        if !self
            .run_async(route, Phase::UpstreamRequest, req, ctx)
            .await?
        {
            return Ok(Flow::Continue);
        }
        Ok(take_flow(Phase::UpstreamRequest, req, ctx))
    }

    /// `header_filter`: response status and headers. Does not yield.
    pub fn header_filter(
        &self,
        route: usize,
        req: &mut dyn HttpView,
        ctx: &mut RequestCtx,
    ) -> Result<(), LuaError> {
        let Some(f) = self.hook(route, Phase::HeaderFilter) else {
            return Ok(());
        };
        let cur = self.cur(Phase::HeaderFilter, req, ctx);
        self.run_sync(Phase::HeaderFilter, f, cur)
    }

    /// `body_filter`: `pier.arg[1]` is `chunk` (assign to replace it),
    /// `pier.arg[2]` is `eof`. Does not yield.
    pub fn body_filter(
        &self,
        route: usize,
        req: &mut dyn HttpView,
        ctx: &mut RequestCtx,
        chunk: &mut BytesMut,
        eof: bool,
    ) -> Result<(), LuaError> {
        let Some(f) = self.hook(route, Phase::BodyFilter) else {
            return Ok(());
        };
        let mut cur = self.cur(Phase::BodyFilter, req, ctx);
        cur.chunk = Some(NonNull::from(chunk));
        cur.eof = eof;
        self.run_sync(Phase::BodyFilter, f, cur)
    }

    /// `log`: after the response. Errors are logged, not returned; do I/O
    /// from here with `pier.timer.at(0, ...)`.
    pub fn log(&self, route: usize, req: &mut dyn HttpView, ctx: &mut RequestCtx) {
        let Some(f) = self.hook(route, Phase::Log) else {
            return;
        };
        let cur = self.cur(Phase::Log, req, ctx);
        if let Err(e) = self.run_sync(Phase::Log, f, cur) {
            tracing::error!(target: "pier::lua", route, "{e}");
        }
    }
}

fn take_flow(phase: Phase, view: &mut dyn HttpView, ctx: &mut RequestCtx) -> Flow {
    let exit = ctx.exit.take();
    let location = ctx.location.take();
    let respond =
        matches!(exit, Some(s) if s >= 100) || phase == Phase::Content || !ctx.body.is_empty();
    if !respond {
        return Flow::Continue;
    }
    // pier.exit's status, else pier.resp.set_status's (recorded here, as the
    // proxy's view may have no response to hold it yet), else 200.
    let status = match (exit, ctx.status.take()) {
        (Some(s), _) if s >= 100 => s,
        (_, Some(s)) => s,
        _ => match view.status() {
            s @ 100..=599 => s,
            _ => 200,
        },
    };
    let headers = location
        .map(|l| vec![(b"location".to_vec(), l)])
        .unwrap_or_default();
    Flow::Respond {
        status,
        headers,
        body: std::mem::take(&mut ctx.body),
    }
}

/// Compiles a source into a function (errors carry the chunk name).
pub(crate) fn compile(
    lua: &Lua,
    src: &crate::Source,
    phase: Option<Phase>,
) -> Result<Function, LuaError> {
    let (code, name) = src.load().map_err(|e| LuaError::new(phase, e))?;
    lua.load(code)
        .set_name(name)
        .into_function()
        .map_err(|e| LuaError::lua(phase, e))
}

/// Publishes `cur` around every poll of a hook's coroutine, and ends the
/// hook once it asked to exit (the coroutine stays suspended and is
/// collected, as OpenResty's `ngx.exit`).
pub(crate) struct Hooked<F> {
    pub fut: F,
    pub cur: Current,
}

impl<F: Future<Output = mlua::Result<()>> + Unpin> Future for Hooked<F> {
    type Output = mlua::Result<()>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let _scope = Scope::enter(self.cur);
        let _waker = crate::current::WakerScope::enter(cx.waker());
        match Pin::new(&mut self.fut).poll(cx) {
            Poll::Ready(r) => Poll::Ready(r),
            Poll::Pending => {
                let ended = self.cur.ctx.is_some_and(|ctx| {
                    // SAFETY: published only while the hook call holds the `&mut`.
                    let ctx = unsafe { ctx.as_ref() };
                    ctx.exit.is_some() || ctx.done
                });
                if ended {
                    Poll::Ready(Ok(()))
                } else {
                    Poll::Pending
                }
            }
        }
    }
}
