//! The LuaJIT host for Pier's Lua hooks, built the lua-resty-core way.
//!
//! * One [`LuaEngine`] (one LuaJIT state) per worker thread; it is `!Send`,
//!   as the proxy runs one current-thread runtime per core. Each request's
//!   hook runs in its own Lua coroutine on that state, so hooks can wait on
//!   I/O (`pier.sleep`, cosockets, `pier.http`) without blocking the thread.
//! * The hot `pier.*` calls (headers, URI, status, ctx, shared dicts, now)
//!   are LuaJIT FFI calls into the `extern "C"` functions of [`ffi`], which
//!   the JIT compiles into the trace of the user's code. Lua never holds a
//!   request pointer: Rust publishes the current request in a thread-local
//!   around every resume of the hook's coroutine ([`current`]).
//! * The Lua side of the API is plain `.lua` files under `lua/pier/`,
//!   embedded in the binary.
//!
//! See `docs/lua.md` for the API, the phase table and measurements.
//!
//! The `extern "C"` API is not reachable from safe Rust: the table and its
//! `unsafe extern "C"` functions are private to this crate.
//!
//! ```compile_fail
//! // The FFI table is private: safe code cannot pass it pointers.
//! let _ = &pier_lua::ffi::API;
//! ```
// This crate is the FFI boundary: `unsafe` is allowed here, and every
// block says why it is sound.
#![allow(unsafe_code)]
#![deny(unsafe_op_in_unsafe_fn, clippy::undocumented_unsafe_blocks)]

#[doc(hidden)]
pub mod bench_support;
mod cabi;
mod current;
mod engine;
mod error;
mod ffi;
mod heap;
mod io;
mod limits;
mod modules;
mod phase;
mod setup;
mod view;

pub use engine::{LuaEngine, RequestCtx};
pub use error::LuaError;
pub use ffi::cache::{set_purger, Purger};
pub use limits::{LuaLimits, MAX_DURATION_SECS};
pub use phase::Phase;
pub use setup::{LuaSetup, RouteHooks, Source};
pub use view::{CacheOp, HttpView};

/// Tells the Lua layer which worker this thread is (`ngx.worker.id()`,
/// `ngx.worker.count()`); call it on each worker thread before its engine
/// is built. Threads that never call it are worker 0 of 1.
pub fn set_worker(id: usize, count: usize) {
    ffi::set_worker(id, count);
}

/// What the proxy does after a hook.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Flow {
    /// Go on with the request.
    Continue,
    /// Answer the client with this response now (`pier.exit`,
    /// `pier.redirect`, `pier.say` in `content`). Response headers set by
    /// the hook through [`HttpView::set_resp_header`] apply as well;
    /// `headers` only carries what the flow itself adds (`Location`).
    Respond {
        status: u16,
        headers: Vec<(Vec<u8>, Vec<u8>)>,
        /// A `Vec`, not `Bytes`: it becomes the local response's body as it
        /// is (a `Bytes` made of a `Vec` with spare room allocates).
        body: Vec<u8>,
    },
}

/// The `balancer` hook's decision (`pier.balancer.set_peer` / `set_retries`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BalancerChoice {
    pub peer: Option<std::net::SocketAddr>,
    pub retries: Option<u32>,
}
