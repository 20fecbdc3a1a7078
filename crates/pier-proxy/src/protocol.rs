//! The session interfaces the driver is written against: the four halves of
//! an exchange, each independent of the wire protocol.
//!
//! ```text
//!   client ──► RequestSource ──► driver ──► RequestSink  ──► origin
//!   client ◄── ResponseSink  ◄── driver ◄── ResponseSource ◄── origin
//! ```
//!
//! Bodies cross as decoded bytes (framing is each side's own), heads as
//! `RequestHead`/`ResponseHead`. HTTP/1 implements them in `h1`; an HTTP/2
//! stream is one more implementation, and a cache hit one more
//! `ResponseSource`. Futures need not be `Send` (thread-per-core).
#![allow(async_fn_in_trait)]

use pier_error::Error;
use pier_http::{Headers, ResponseHead};

/// How much body follows a response head, as far as the writer can tell.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BodySize {
    /// No body (HEAD, 204, 304, …).
    None,
    /// Exactly this many bytes.
    Length(u64),
    /// Unknown until it ends (chunked, close-delimited, or filtered).
    Stream,
}

/// The client's request body, decoded.
pub trait RequestSource {
    /// The next piece of the body; `Ok(None)` at its end.
    async fn read_body(&mut self) -> Result<Option<&[u8]>, Error>;
    /// Trailer fields, once the body ended (where the protocol has them).
    fn trailers(&self) -> Option<&Headers>;
}

/// Where the request goes: the upstream connection's writer.
pub trait RequestSink {
    /// A piece of the request body (already decoded).
    async fn write_body(&mut self, data: &[u8]) -> Result<(), Error>;
    /// The body ended (trailers, when the protocol carries them).
    async fn finish(&mut self, trailers: Option<&Headers>) -> Result<(), Error>;
}

/// The origin's response.
pub trait ResponseSource {
    /// The next response head into `head`: interim (1xx) heads come first,
    /// each returned on its own.
    async fn read_head(&mut self, head: &mut ResponseHead) -> Result<(), Error>;
    /// The body's size as the origin framed it (after `read_head`).
    fn body_size(&self) -> BodySize;
    /// The next piece of the body, decoded, and whether it is known to be
    /// the last (the origin's slot can then be released before it is
    /// written); `Ok(None)` at the end.
    async fn read_body(&mut self) -> Result<Option<(&[u8], bool)>, Error>;
    /// Trailer fields, once the body ended.
    fn trailers(&self) -> Option<&Headers>;
    /// Whether the connection can carry another request (the body was read
    /// to its end and nothing followed it).
    fn reusable(&self) -> bool;
}

/// Where the response goes: the client connection's writer.
pub trait ResponseSink {
    /// An interim (1xx) response; dropped where the client can't take one.
    async fn write_interim(&mut self, head: &ResponseHead) -> Result<(), Error>;
    /// The final head. The writer frames the body from `size`; a head may
    /// wait to go out with the first body bytes (one write).
    async fn write_head(&mut self, head: &ResponseHead, size: BodySize) -> Result<(), Error>;
    async fn write_body(&mut self, data: &[u8]) -> Result<(), Error>;
    /// The response ended; trailers where the protocol carries them.
    async fn finish(&mut self, trailers: Option<&Headers>) -> Result<(), Error>;
    /// Whether the client connection can take another request afterwards.
    fn keep_alive(&self) -> bool;
    /// Bytes written to the client so far (access log).
    fn bytes_sent(&self) -> u64;
}
