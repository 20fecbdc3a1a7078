//! The embedded Lua side of the API and the state's bootstrap.

use std::cell::RefCell;
use std::rc::Weak;

use mlua::{LightUserData, Lua, Table, Value};

use crate::engine::Inner;
use crate::phase::mask;
use crate::setup::LuaSetup;

/// `(module name, source)`, loaded into `package.preload`.
pub(crate) const MODULES: &[(&str, &str)] = &[
    ("pier", include_str!("../lua/pier/init.lua")),
    ("pier.base", include_str!("../lua/pier/base.lua")),
    ("pier.req", include_str!("../lua/pier/req.lua")),
    ("pier.resp", include_str!("../lua/pier/resp.lua")),
    ("pier.var", include_str!("../lua/pier/var.lua")),
    ("pier.shared", include_str!("../lua/pier/shared.lua")),
    ("pier.socket", include_str!("../lua/pier/socket.lua")),
    ("pier.after", include_str!("../lua/pier/after.lua")),
    (
        "ngx.semaphore",
        include_str!("../lua/pier/ngx_semaphore.lua"),
    ),
    (
        "pier.ngx_thread",
        "return require('pier.native').ngx_thread",
    ),
    (
        "pier.ngx_socket",
        include_str!("../lua/pier/ngx_socket.lua"),
    ),
    ("pier.ngx_str", include_str!("../lua/pier/ngx_str.lua")),
    ("ngx.re", "return require('pier.ngx_str').ngx_re"),
    ("pier.ngx", include_str!("../lua/pier/ngx.lua")),
    // `require "resty.core"` (common in init code): ngx.* is FFI-based
    // already, there is nothing more to load.
    ("resty.core", "return { version = 'pier' }"),
];

pub(crate) fn bootstrap(
    lua: &Lua,
    setup: &LuaSetup,
    engine: std::rc::Rc<RefCell<Weak<Inner>>>,
) -> mlua::Result<()> {
    let globals = lua.globals();
    let package: Table = globals.get("package")?;
    if !setup.package_path.is_empty() {
        let path: String = package.get("path")?;
        package.set("path", format!("{};{path}", setup.package_path.join(";")))?;
    }

    let natives = lua.create_table()?;
    // A user-space address is below 2^47: exact as a double.
    natives.set("api_addr", crate::ffi::api_addr() as f64)?;
    natives.set("str_api_addr", crate::ffi::strings::str_api_addr() as f64)?;
    natives.set("pid", std::process::id())?;
    natives.set("ngx_api_addr", crate::ffi::ngx_api_addr() as f64)?;
    // SAFETY: a `lua_CFunction` that reads its arguments with the C API's
    // checked accessors and pushes one result (see `l_say` on errors).
    natives.set("say_c", unsafe {
        lua.create_c_function(crate::ffi::l_say)?
    })?;
    natives.set("sock_api_addr", crate::io::sock_api_addr() as f64)?;
    // ngx.null: a NULL light userdata, as ngx_lua's (and cjson's) null.
    natives.set(
        "null",
        Value::LightUserData(LightUserData(std::ptr::null_mut())),
    )?;
    let masks = lua.create_table()?;
    for (k, v) in [
        ("yield", mask::YIELD),
        ("timer", mask::TIMER),
        ("exit", mask::EXIT),
        ("say", mask::SAY),
        ("req_read", mask::REQ_READ),
        ("req_write", mask::REQ_WRITE),
        ("resp_read", mask::RESP_READ),
        ("resp_write", mask::RESP_WRITE),
        ("ctx", mask::CTX),
        ("body", mask::BODY),
        ("balancer", mask::BALANCER),
    ] {
        masks.set(k, v)?;
    }
    natives.set("masks", masks)?;
    crate::io::register(lua, &natives, engine)?;
    let loaded: Table = package.get("loaded")?;
    loaded.set("pier.native", natives)?;

    let preload: Table = package.get("preload")?;
    for (name, src) in MODULES {
        let file = match name.strip_prefix("pier.") {
            Some(rest) => format!("@pier/{rest}.lua"),
            None if *name == "pier" => "@pier/init.lua".to_owned(),
            // Modules under their OpenResty names (`ngx.re`, `ngx.semaphore`).
            None => format!("@{}.lua", name.replace('.', "/")),
        };
        preload.set(*name, lua.load(*src).set_name(file).into_function()?)?;
    }
    let pier: Table = lua
        .load("return require('pier')")
        .set_name("=pier bootstrap")
        .eval()?;
    globals.set("pier", pier)?;
    // OpenResty compatibility: `ngx` over the same FFI functions.
    let ngx: Table = lua
        .load("return require('pier.ngx')")
        .set_name("=ngx bootstrap")
        .eval()?;
    globals.set("ngx", ngx)?;
    fast_require(lua)
}

/// `require` answering a loaded module in Lua, the rest through LuaJIT's own.
/// Code written for ngx_lua requires its libraries inside the handler, once
/// per request; LuaJIT's C `require` interns the name and the registry key on
/// every call (about 600 instructions, callgrind, BENCHMARKS.md stop 27),
/// where a Lua table lookup of an already interned name costs a tenth of it.
/// Same results: the table is the one the C function reads (the registry's
/// `_LOADED`, even if `package.loaded` is replaced), and only a table or a
/// function is answered here; anything else goes to the C function: a name
/// that is not a string (numbers are coerced there), a module not loaded,
/// `true`, `false`, and a module being loaded, whose sentinel is a light
/// userdata that Lua's `type` sees as a number in LuaJIT's GC64 mode.
fn fast_require(lua: &Lua) -> mlua::Result<()> {
    let loaded: Table = lua.named_registry_value("_LOADED")?;
    let globals = lua.globals();
    let c_require: mlua::Function = globals.get("require")?;
    let fast: mlua::Function = lua
        .load(
            r#"
            local LOADED, c_require, type, after = ...
            return function(name, ...)
              if type(name) == "string" then
                local m = LOADED[name]
                local t = type(m)
                if t == "table" or t == "function" then return m end
                local f = after[name]
                if f then return f(c_require(name, ...)) end
              end
              return c_require(name, ...)
            end
            "#,
        )
        .set_name("=pier require")
        .call((
            loaded,
            c_require,
            globals.get::<mlua::Function>("type")?,
            lua.load("return require('pier.after')")
                .set_name("=pier after")
                .eval::<Table>()?,
        ))?;
    globals.set("require", fast)
}
