//! Pier's runtime.
//!
//! Thread-per-core, like nginx's workers and Pingora's no-steal runtimes:
//! each worker thread runs its own tokio current-thread runtime and accepts
//! on its own `SO_REUSEPORT` socket, so a connection lives on one thread and
//! nothing on the request path needs `Send` (Lua states are per thread). What
//! must be shared is: the upstream connection pool (`pool`), so reuse does not
//! collapse the way it does with per-worker pools, metrics, and config.
#![forbid(unsafe_code)]

pub mod evict;
pub mod handover;
pub mod lifecycle;
pub mod pool;
pub mod server;
pub mod stream;

/// io_uring for cleartext TCP (`[server] io_uring`).
pub use pier_uring as uring;
pub use pool::{Pool, PoolConfig};
pub use server::{
    bind_all, bind_reuseport, bind_udp_all, bind_udp_reuseport, spawn_workers, WorkerContext,
};
pub use stream::{Alpn, Conn, Connector, PeerKey, RawSocket, SpliceOut, Stream};
