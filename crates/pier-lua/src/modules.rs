//! The embedded Lua side of the API and the state's bootstrap.

use std::cell::RefCell;
use std::rc::Weak;

use mlua::{Lua, Table};

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
    let masks = lua.create_table()?;
    for (k, v) in [
        ("yield", mask::YIELD),
        ("timer", mask::TIMER),
        ("exit", mask::EXIT),
        ("say", mask::SAY),
    ] {
        masks.set(k, v)?;
    }
    natives.set("masks", masks)?;
    crate::io::register(lua, &natives, engine)?;
    let loaded: Table = package.get("loaded")?;
    loaded.set("pier.native", natives)?;

    let preload: Table = package.get("preload")?;
    for (name, src) in MODULES {
        let file = format!("@pier/{}.lua", name.strip_prefix("pier.").unwrap_or("init"));
        preload.set(*name, lua.load(*src).set_name(file).into_function()?)?;
    }
    let pier: Table = lua
        .load("return require('pier')")
        .set_name("=pier bootstrap")
        .eval()?;
    globals.set("pier", pier)?;
    Ok(())
}
