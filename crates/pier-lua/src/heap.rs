//! The Lua heap: LuaJIT's own allocator, counted and bounded by
//! `[lua] memory_limit`.
//!
//! Why not mlua's allocator (what `Lua::new` installs): it sends every Lua
//! allocation to Rust's global allocator, glibc malloc, whose per-thread
//! cache misses for most of them. In the cosocket benchmark (issue 13) that
//! was ~6k of Pier's ~33k instructions per request, against ~1.7k in
//! OpenResty, whose LuaJIT uses its own allocator (`lj_alloc.c`, a dlmalloc
//! in its own mappings). Here the state is made by `luaL_newstate`, so it has
//! LuaJIT's allocator, and [`counted`] is put in front of it to keep the
//! memory limit: an allocation that would pass it fails, and LuaJIT raises
//! "not enough memory" in the hook, as with mlua's limit before.
//!
//! mlua then wraps the state as an external one ("module mode"), so it does
//! not close it: [`Heap`]'s drop does, after the engine's mlua handles are
//! gone (it is the engine's last field). In that mode mlua runs its own
//! allocating calls protected, as it did with a limit set.
//!
//! The invariant this needs: no strong `Lua` handle outlives its engine.
//! Values (tables, functions, threads) hold weak references and are safe
//! to drop or use after the close (they fail cleanly); a `Lua` clone is
//! not. Inside this crate, handles mlua passes to callbacks are used during
//! the call or moved into futures that the state owns; outside it,
//! `LuaEngine::lua` is `unsafe` for this reason.

use std::os::raw::c_void;
use std::ptr::{self, NonNull};

use mlua::{ffi, Lua, StdLib};

/// The counter in front of LuaJIT's allocator (the `ud` [`counted`] gets).
struct Budget {
    inner: ffi::lua_Alloc,
    inner_ud: *mut c_void,
    used: usize,
    /// 0: unlimited.
    limit: usize,
}

/// `lua_Alloc` with Lua's contract: `nsize == 0` frees, a `NULL` `ptr`
/// allocates (`osize` is then not a size), and a failed reallocation leaves
/// the block as it was. Only growth can fail the limit.
unsafe extern "C" fn counted(
    ud: *mut c_void,
    ptr: *mut c_void,
    osize: usize,
    nsize: usize,
) -> *mut c_void {
    // SAFETY: `ud` is the `Budget` that `Heap` boxed and installed with this
    // function; it lives until `Heap`'s drop puts LuaJIT's allocator back,
    // and a Lua state is used by one thread at a time.
    let b = unsafe { &mut *ud.cast::<Budget>() };
    let old = if ptr.is_null() { 0 } else { osize };
    if nsize > old && b.limit != 0 && b.used.saturating_add(nsize - old) > b.limit {
        return ptr::null_mut();
    }
    // SAFETY: LuaJIT's allocator with its own `ud`, called as LuaJIT calls it.
    let p = unsafe { (b.inner)(b.inner_ud, ptr, osize, nsize) };
    if nsize == 0 {
        b.used = b.used.saturating_sub(old);
    } else if !p.is_null() {
        b.used = (b.used + nsize).saturating_sub(old);
    }
    p
}

/// Owns the state: made in [`Heap::new`], closed on drop.
pub(crate) struct Heap {
    state: NonNull<ffi::lua_State>,
    budget: NonNull<Budget>,
}

impl Heap {
    /// A state with LuaJIT's allocator behind the counter, the standard
    /// libraries (with `ffi`, `jit` and `debug`) open, and the `Lua` handle
    /// mlua gives for it.
    pub(crate) fn new() -> Result<(Heap, Lua), mlua::Error> {
        // SAFETY: a fresh state; nothing else knows it yet.
        let state = NonNull::new(unsafe { ffi::luaL_newstate() })
            .ok_or_else(|| mlua::Error::runtime("luaL_newstate failed (out of memory)"))?;
        let mut inner_ud = ptr::null_mut();
        // SAFETY: reads the allocator `luaL_newstate` installed.
        let inner = unsafe { ffi::lua_getallocf(state.as_ptr(), &mut inner_ud) };
        let budget = NonNull::from(Box::leak(Box::new(Budget {
            inner,
            inner_ud,
            used: 0,
            limit: 0,
        })));
        // SAFETY: counts what the state already holds (its global state and
        // first tables: LuaJIT's own count), then installs `counted`, which
        // forwards to the same allocator, so blocks made before and after
        // are freed by the one allocator that made them.
        unsafe {
            (*budget.as_ptr()).used = ffi::lua_gc(state.as_ptr(), ffi::LUA_GCCOUNT, 0) as usize
                * 1024
                + ffi::lua_gc(state.as_ptr(), ffi::LUA_GCCOUNTB, 0) as usize;
            ffi::lua_setallocf(state.as_ptr(), counted, budget.as_ptr().cast());
        }
        let heap = Heap { state, budget };
        // SAFETY: `_G` opened as mlua's own states have it, then mlua's
        // wrapper for the state (it stays valid until `heap` is dropped,
        // which the caller orders after every handle of it).
        let lua = unsafe {
            ffi::luaL_requiref(state.as_ptr(), c"_G".as_ptr(), ffi::luaopen_base, 1);
            ffi::lua_pop(state.as_ptr(), 1);
            Lua::get_or_init_from_ptr(state.as_ptr()).clone()
        };
        lua.load_std_libs(StdLib::ALL)?;
        Ok((heap, lua))
    }

    /// Bytes the Lua heap holds now.
    pub(crate) fn used(&self) -> usize {
        // SAFETY: only the state's own thread reads or writes the budget.
        unsafe { self.budget.as_ref().used }
    }

    /// Sets the bound (0: none) that allocations beyond fail.
    pub(crate) fn set_limit(&self, limit: usize) {
        // SAFETY: as `used`; the state is not running (it is single-threaded
        // and this is not called from Lua).
        unsafe { (*self.budget.as_ptr()).limit = limit }
    }
}

impl Drop for Heap {
    fn drop(&mut self) {
        // SAFETY: the engine's mlua handles were dropped before this (see the
        // module doc); mlua does not close a state it did not make. LuaJIT's
        // allocator goes back in first so that `lua_close` destroys its
        // arena (it only does for its own allocator), then the budget is
        // freed: nothing calls `counted` any more.
        unsafe {
            let b = self.budget.as_ptr();
            ffi::lua_setallocf(self.state.as_ptr(), (*b).inner, (*b).inner_ud);
            ffi::lua_close(self.state.as_ptr());
            drop(Box::from_raw(b));
        }
    }
}
