//! The request body and head as ngx_lua gives them: `ngx.req.read_body`
//! (yields while the proxy reads the body into memory),
//! `ngx.req.get_body_data` and `ngx.req.raw_header`. Phase checks are made
//! in Lua (`ngx.lua`); here a call outside a request finds no view and
//! behaves as on a request without a body.

use mlua::{Lua, Table, Value};
use std::task::Poll;

use crate::current;
use crate::view::HttpView;

/// Runs `f` on the published request's view, if any.
fn on_view<R>(f: impl FnOnce(&mut dyn HttpView) -> R) -> Option<R> {
    let mut view = current::get().view?;
    // SAFETY: a view pointer is published (by a `current::Scope`) only while
    // the `&mut dyn HttpView` it came from is borrowed by the running hook
    // call, and nothing else touches the view during this call.
    Some(f(unsafe { view.as_mut() }))
}

pub(crate) fn register(lua: &Lua, natives: &Table) -> mlua::Result<()> {
    natives.set(
        "read_body",
        lua.create_async_function(|_, ()| async move {
            std::future::poll_fn(|cx| on_view(|v| v.poll_read_body(cx)).unwrap_or(Poll::Ready(())))
                .await;
            Ok(())
        })?,
    )?;
    natives.set(
        "body_data",
        lua.create_function(|lua, ()| {
            // An empty body is nil, as ngx_lua's.
            let body = on_view(|v| {
                v.req_body()
                    .filter(|b| !b.is_empty())
                    .map(|b| lua.create_string(b))
            });
            match body {
                Some(Some(s)) => Ok(Value::String(s?)),
                _ => Ok(Value::Nil),
            }
        })?,
    )?;
    natives.set(
        "raw_header",
        lua.create_function(|lua, no_request_line: bool| {
            let mut out = Vec::new();
            match on_view(|v| v.raw_header(no_request_line, &mut out)) {
                Some(()) => Ok(Value::String(lua.create_string(&out)?)),
                None => Ok(Value::Nil),
            }
        })?,
    )?;
    Ok(())
}
