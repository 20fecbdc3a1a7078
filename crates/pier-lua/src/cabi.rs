//! The SIGSEGV in an mlua userdata `__gc` (docs/lua.md, "Isolation").
//!
//! LuaJIT's x64 interpreter calls a `lua_CFunction` (every Rust function mlua
//! hands to Lua: `create_function`, async functions, userdata `__gc` and
//! methods) from `BC_FUNCC`, then computes the results' offset with
//! `lea RA, [BASE+RD*8]` where `RD` is all of `rax` (`vm_x64.dasc`): it
//! assumes the `int` the function returned was zero-extended to 64 bits.
//! The x86-64 System V ABI leaves the upper half of `rax` undefined for an
//! `int` result. C compilers always write `eax` (which zero-extends), but
//! LLVM need not: mlua's generic `destroy_userdata_storage::<T>`, compiled
//! at `opt-level = 1` in the crate naming `T`, returns `1` as
//! `(stack address & 0xffffffff00000000) + 1`. `RA` is then garbage and
//! `lj_vm_return` reads far outside the Lua stack (under
//! `gc_call_finalizer`). Not undefined behaviour in Rust or mlua: an ABI
//! assumption of the interpreter that any Rust `lua_CFunction` may break,
//! depending on optimisation level and compiler version.
//!
//! The fix is LuaJIT's own hook for this: in `LUAJIT_MODE_WRAPCFUNC` mode
//! the interpreter calls every external C function through a wrapper
//! (`BC_FUNCCW`), and [`wrap`] returns the count zero-extended to 64 bits
//! exactly as C would, whatever the wrapped function left in `rax`. Fast
//! paths are untouched: FFI calls (the `pier.*` API) read an `int` result as
//! 32 bits and do not go through `BC_FUNCC`.

use std::os::raw::{c_int, c_void};

use mlua::{ffi, Lua};

const LUAJIT_MODE_WRAPCFUNC: c_int = 0x10;
const LUAJIT_MODE_ON: c_int = 0x0100;

extern "C" {
    // From the statically linked LuaJIT (mlua-sys "vendored"), `luajit.h`.
    fn luaJIT_setmode(l: *mut ffi::lua_State, idx: c_int, mode: c_int) -> c_int;
}

/// LuaJIT's `wrapf`: calls `f` and returns its result zero-extended from
/// 32 bits, as a C `return n;` does. Errors raised by `f` (LuaJIT unwinds
/// with the system unwinder on x64) pass through this frame, which holds
/// nothing to drop: hence `C-unwind`.
unsafe extern "C-unwind" fn wrap(l: *mut ffi::lua_State, f: ffi::lua_CFunction) -> u64 {
    // SAFETY: LuaJIT calls the wrapper in place of `f`, with the same state
    // and stack `f` would have had.
    let n = unsafe { f(l) };
    u64::from(n as u32)
}

/// Routes every Rust `lua_CFunction` of `lua` through [`wrap`].
pub(crate) fn install(lua: &Lua) -> mlua::Result<()> {
    let mut ok = 0;
    // SAFETY: pushes one light userdata, hands it to `luaJIT_setmode` (which
    // copies the pointer into the global state) and pops it; `wrap` has the
    // `lua_CFunction`-wrapper signature LuaJIT calls it with, and lives for
    // the whole program.
    unsafe {
        lua.exec_raw::<()>((), |l| {
            ffi::lua_pushlightuserdata(l, wrap as *mut c_void);
            ok = luaJIT_setmode(l, -1, LUAJIT_MODE_WRAPCFUNC | LUAJIT_MODE_ON);
            ffi::lua_pop(l, 1);
        })?;
    }
    if ok == 0 {
        return Err(mlua::Error::runtime(
            "luaJIT_setmode(WRAPCFUNC) failed: Rust C functions would be unsafe to call",
        ));
    }
    Ok(())
}
