//! HTTP/2 on both sides of the engine, behind the session interfaces
//! (pier-session): [`server`] serves a client connection and hands each
//! stream to the engine; [`client`] keeps multiplexed connections to origins
//! and carries one attempt as a stream on one of them. The `h2` crate does
//! the framing, HPACK and flow control on both sides; what this crate adds
//! is bounded buffering and the connection's lifecycle (idle, GOAWAY,
//! eviction); the mapping between `http` types and Pier's heads is
//! pier-session's `http_types`, shared with HTTP/3.
//!
//! No policy lives here: which fields go upstream and the authority come
//! from the engine's [`UpstreamRequest`](pier_session::UpstreamRequest),
//! which fields a response never carries from the one hop-by-hop table.

pub mod client;
pub mod server;

#[cfg(test)]
mod hpack_tests;
