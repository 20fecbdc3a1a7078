//! The "classic" Lua C API equivalent of `pier.req.get_header`, for the FFI
//! benchmark only (`benches/ffi.rs`): an mlua `create_function` that builds
//! a Lua string per call, as a non-FFI binding would.

use mlua::{Lua, LuaString};

use crate::current;

/// Sets global `classic_get_header(name)`.
pub fn register_classic_get_header(lua: &Lua) -> mlua::Result<()> {
    let f = lua.create_function(|lua, name: LuaString| {
        let cur = current::get();
        let Some(view) = cur.view else {
            return Err(mlua::Error::runtime("no request"));
        };
        // SAFETY: published by the running hook's scope (see `ffi::with_view`).
        match unsafe { view.as_ref() }.req_header(&name.as_bytes()) {
            Some(v) => Ok(Some(lua.create_string(v)?)),
            None => Ok(None),
        }
    })?;
    lua.globals().set("classic_get_header", f)
}
