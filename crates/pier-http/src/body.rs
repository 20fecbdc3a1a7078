//! Decoding a whole message body, without I/O: for the clients and servers
//! around the proxy (health checker, demo origin, test origin and client)
//! that need the payload itself rather than forwarding framed bytes.
//!
//! The caller owns the socket, sync or async: it hands whatever bytes it has
//! to [`BodyDecoder::decode`], drops the bytes it says were consumed, reads
//! more while the body is not [done](BodyDecoder::is_done), and calls
//! [`BodyDecoder::eof`] when the peer closes. Chunked framing goes through
//! the same validating [`ChunkedScanner`] as the proxy's own relay, so there
//! is one chunked parser in the tree.

use crate::chunked::ChunkedScanner;
use crate::head::{BodyLen, MAX_HEADERS_HARD};
use pier_error::Kind;

/// Trailer fields as (name, value), borrowed from the decoder.
pub type Trailers<'a> = Vec<(&'a [u8], &'a [u8])>;

/// Decodes one body framed as `BodyLen` says.
#[derive(Debug, Clone)]
pub struct BodyDecoder {
    len: BodyLen,
    /// Bytes left of a Content-Length body.
    left: u64,
    chunked: ChunkedScanner,
    /// The raw trailer section of a chunked body (ends with the empty line).
    trailer: Vec<u8>,
    done: bool,
}

impl BodyDecoder {
    pub fn new(len: BodyLen) -> Self {
        let (left, done) = match len {
            BodyLen::None => (0, true),
            BodyLen::Length(n) => (n, n == 0),
            BodyLen::Chunked | BodyLen::UntilClose => (0, false),
        };
        BodyDecoder {
            len,
            left,
            chunked: ChunkedScanner::new(),
            trailer: Vec::new(),
            done,
        }
    }

    /// The framing this decoder follows.
    pub fn framing(&self) -> BodyLen {
        self.len
    }

    /// The whole body has been decoded (for `UntilClose`, only after `eof`).
    pub fn is_done(&self) -> bool {
        self.done
    }

    /// Decodes from the start of `buf`, passing each piece of payload to
    /// `on_data` in order. Returns how many bytes of `buf` belong to the body:
    /// all of them unless the body ends inside `buf` (the rest is the next
    /// message). Malformed chunked framing is `Kind::BadChunk`.
    pub fn decode(&mut self, buf: &[u8], mut on_data: impl FnMut(&[u8])) -> Result<usize, Kind> {
        if self.done {
            return Ok(0);
        }
        match self.len {
            BodyLen::None => Ok(0),
            BodyLen::Length(_) => {
                let n = (buf.len() as u64).min(self.left) as usize;
                if n > 0 {
                    on_data(&buf[..n]);
                }
                self.left -= n as u64;
                self.done = self.left == 0;
                Ok(n)
            }
            BodyLen::UntilClose => {
                if !buf.is_empty() {
                    on_data(buf);
                }
                Ok(buf.len())
            }
            BodyLen::Chunked => {
                let trailer = &mut self.trailer;
                let n = self.chunked.feed_parts(
                    buf,
                    |r| on_data(&buf[r]),
                    |r| trailer.extend_from_slice(&buf[r]),
                )?;
                self.done = self.chunked.is_done();
                Ok(n)
            }
        }
    }

    /// The peer closed the stream. Returns whether the body was complete:
    /// always for a close-delimited body (which this ends), otherwise only if
    /// it was already done.
    pub fn eof(&mut self) -> bool {
        if self.len == BodyLen::UntilClose {
            self.done = true;
        }
        self.done
    }

    /// Bytes still expected of a Content-Length body.
    pub fn remaining(&self) -> Option<u64> {
        match self.len {
            BodyLen::Length(_) => Some(self.left),
            _ => None,
        }
    }

    /// The trailer fields of a finished chunked body, as (name, value).
    /// Empty for other framings and for a chunked body without trailers.
    pub fn trailers(&self) -> Result<Trailers<'_>, Kind> {
        if !self.done || self.trailer.len() <= 2 {
            return Ok(Vec::new());
        }
        let mut raw = [httparse::EMPTY_HEADER; MAX_HEADERS_HARD];
        match httparse::parse_headers(&self.trailer, &mut raw) {
            Ok(httparse::Status::Complete((_, fields))) => Ok(fields
                .iter()
                .map(|h| (h.name.as_bytes(), h.value))
                .collect()),
            _ => Err(Kind::BadChunk),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Feeds `wire` in pieces of `step` bytes, as a socket might deliver it.
    fn decode_all(len: BodyLen, wire: &[u8], step: usize) -> (Vec<u8>, usize, BodyDecoder) {
        let mut d = BodyDecoder::new(len);
        let mut out = Vec::new();
        let mut used = 0;
        let mut buf: Vec<u8> = Vec::new();
        let mut pos = 0;
        while !d.is_done() && pos < wire.len() {
            let end = (pos + step).min(wire.len());
            buf.extend_from_slice(&wire[pos..end]);
            pos = end;
            let n = d.decode(&buf, |p| out.extend_from_slice(p)).unwrap();
            buf.drain(..n);
            used += n;
        }
        (out, used, d)
    }

    #[test]
    fn length_bodies() {
        for step in [1, 3, 100] {
            let (out, used, d) = decode_all(BodyLen::Length(5), b"helloNEXT", step);
            assert_eq!(out, b"hello");
            assert_eq!(used, 5);
            assert!(d.is_done());
            assert_eq!(d.remaining(), Some(0));
        }
        let mut d = BodyDecoder::new(BodyLen::Length(0));
        assert!(d.is_done());
        assert_eq!(d.decode(b"x", |_| panic!("no data")), Ok(0));
        let mut d = BodyDecoder::new(BodyLen::None);
        assert!(d.is_done());
        assert_eq!(d.decode(b"x", |_| panic!("no data")), Ok(0));
        // Truncated: eof reports the body incomplete.
        let mut d = BodyDecoder::new(BodyLen::Length(10));
        d.decode(b"abc", |_| {}).unwrap();
        assert_eq!(d.remaining(), Some(7));
        assert!(!d.eof());
    }

    #[test]
    fn chunked_bodies_with_trailers() {
        let wire = b"5\r\nhello\r\n3;ext\r\nabc\r\n0\r\nx-trailer: done\r\nx-b: 2\r\n\r\nNEXT";
        for step in [1, 2, 7, 1000] {
            let (out, used, d) = decode_all(BodyLen::Chunked, wire, step);
            assert_eq!(out, b"helloabc", "step {step}");
            assert_eq!(used, wire.len() - 4);
            assert!(d.is_done());
            assert_eq!(
                d.trailers().unwrap(),
                vec![(&b"x-trailer"[..], &b"done"[..]), (&b"x-b"[..], &b"2"[..])]
            );
        }
        let (out, _, d) = decode_all(BodyLen::Chunked, b"0\r\n\r\n", 1);
        assert!(out.is_empty() && d.is_done());
        assert!(d.trailers().unwrap().is_empty());
    }

    #[test]
    fn chunked_errors_and_truncation() {
        let mut d = BodyDecoder::new(BodyLen::Chunked);
        assert_eq!(d.decode(b"zz\r\n", |_| {}), Err(Kind::BadChunk));
        let mut d = BodyDecoder::new(BodyLen::Chunked);
        d.decode(b"5\r\nhel", |_| {}).unwrap();
        assert!(!d.eof());
    }

    #[test]
    fn until_close() {
        let mut d = BodyDecoder::new(BodyLen::UntilClose);
        let mut out = Vec::new();
        assert_eq!(d.decode(b"abc", |p| out.extend_from_slice(p)), Ok(3));
        assert_eq!(d.decode(b"de", |p| out.extend_from_slice(p)), Ok(2));
        assert!(!d.is_done());
        assert!(d.eof());
        assert!(d.is_done());
        assert_eq!(out, b"abcde");
    }
}
