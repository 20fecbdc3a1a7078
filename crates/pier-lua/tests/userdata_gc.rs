//! The SIGSEGV docs/lua.md recorded: mlua userdata with a Rust `__gc`,
//! collected. The finalizer (`destroy_userdata_storage::<U>`, monomorphized
//! here, at this crate's `opt-level`) returns its `int` with garbage in the
//! upper half of `rax`, which LuaJIT's x64 interpreter reads in full unless
//! the engine routes C functions through its zero-extending wrapper (see
//! `src/cabi.rs`). Before that wrapper this test died with SIGSEGV under
//! the dev profile.
#![allow(unsafe_code)] // `LuaEngine::lua`, whose handle must not outlive the engine; nothing else

mod support;

use mlua::UserData;
use support::*;

struct U(#[allow(dead_code)] Vec<u8>);
impl UserData for U {}

#[test]
fn userdata_finalizers_run_safely_in_an_engine() {
    let e = access_engine("pier.exit(0)");
    // SAFETY: `lua` is a borrow of `e`, used while `e` lives.
    let lua = unsafe { e.lua() };
    let mk = lua.create_function(|_, ()| Ok(U(vec![1; 10]))).unwrap();
    lua.globals().set("mk", mk).unwrap();
    lua.load(
        r#"
        for i = 1, 1000 do local u = mk() end
        collectgarbage()
        collectgarbage()
        -- Errors raised by Rust functions still unwind through the wrapper.
        local ok, err = pcall(mk, 1, 2, 3)
        assert(ok)
        local ok2 = pcall(error, "x")
        assert(not ok2)
        "#,
    )
    .exec()
    .unwrap();
    // Rust errors through the wrapper, caught by pcall in Lua.
    let fail = lua
        .create_function(|_, ()| -> mlua::Result<()> { Err(mlua::Error::runtime("boom")) })
        .unwrap();
    lua.globals().set("fail", fail).unwrap();
    lua.load("local ok, err = pcall(fail); assert(not ok and tostring(err):find('boom'))")
        .exec()
        .unwrap();
    // And uncaught, back in Rust.
    let err = lua.load("fail()").exec().unwrap_err();
    assert!(err.to_string().contains("boom"), "{err}");
}
