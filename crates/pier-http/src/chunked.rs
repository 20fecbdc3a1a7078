//! A validating scanner for chunked bodies (RFC 9112 §7.1).
//!
//! The proxy forwards chunked bodies verbatim — no decode/re-encode copy —
//! but every byte passes through this state machine first, so a body whose
//! framing is ambiguous (bad hex, missing CRLF, oversized size line) is cut
//! off with `BadChunk` instead of being forwarded for an origin to read
//! differently. It also tells where the body ends, which keep-alive needs.

use pier_error::Kind;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Size {
        digits: u8,
    },
    Ext,
    SizeLf,
    Data,
    DataCr,
    DataLf,
    /// At the start of a trailer line (or the final empty line).
    TrailerStart,
    TrailerLine,
    TrailerLf {
        empty: bool,
    },
    Done,
}

#[derive(Debug, Clone)]
pub struct ChunkedScanner {
    state: State,
    size: u64,
    /// Bytes of the current size line / trailer section, bounded.
    line: usize,
    trailer_bytes: usize,
    /// A whole size line has been scanned.
    sized: bool,
}

const MAX_SIZE_DIGITS: u8 = 16;
const MAX_EXT: usize = 4096;
const MAX_TRAILERS: usize = 16384;

impl Default for ChunkedScanner {
    fn default() -> Self {
        Self::new()
    }
}

impl ChunkedScanner {
    pub fn new() -> Self {
        ChunkedScanner {
            state: State::Size { digits: 0 },
            size: 0,
            line: 0,
            trailer_bytes: 0,
            sized: false,
        }
    }

    pub fn is_done(&self) -> bool {
        self.state == State::Done
    }

    /// Whether a complete chunk-size line has been scanned (the scanner is in
    /// chunk data, or past it). Used to vet a body's framing before its head
    /// is forwarded anywhere.
    pub fn past_first_size(&self) -> bool {
        self.sized
    }

    /// Scan `buf`; returns how many bytes belong to the body (all of `buf`
    /// unless the body ends inside it).
    pub fn feed(&mut self, buf: &[u8]) -> Result<usize, Kind> {
        self.feed_data(buf, |_| {})
    }

    /// Like `feed`, also reporting where chunk data lies in `buf` (for body
    /// filters that need the decoded payload).
    pub fn feed_data(
        &mut self,
        buf: &[u8],
        on_data: impl FnMut(std::ops::Range<usize>),
    ) -> Result<usize, Kind> {
        self.feed_parts(buf, on_data, |_| {})
    }

    /// Like `feed_data`, also reporting where the trailer section lies in
    /// `buf` (every byte after the last chunk's size line, up to and
    /// including the final CRLF), for clients that keep trailers.
    pub fn feed_parts(
        &mut self,
        buf: &[u8],
        mut on_data: impl FnMut(std::ops::Range<usize>),
        mut on_trailer: impl FnMut(std::ops::Range<usize>),
    ) -> Result<usize, Kind> {
        let mut i = 0;
        while i < buf.len() {
            let b = buf[i];
            match self.state {
                State::Size { digits } => {
                    if let Some(v) = hex(b) {
                        if digits >= MAX_SIZE_DIGITS {
                            return Err(Kind::BadChunk);
                        }
                        self.size = (self.size << 4) | v as u64;
                        self.state = State::Size { digits: digits + 1 };
                    } else if digits == 0 {
                        return Err(Kind::BadChunk);
                    } else if b == b';' {
                        self.line = 0;
                        self.state = State::Ext;
                    } else if b == b'\r' {
                        self.state = State::SizeLf;
                    } else {
                        return Err(Kind::BadChunk);
                    }
                    i += 1;
                }
                State::Ext => {
                    // Extensions are ignored but must be printable, bounded.
                    if b == b'\r' {
                        self.state = State::SizeLf;
                    } else if b == b'\n' || b == 0 || self.line >= MAX_EXT {
                        return Err(Kind::BadChunk);
                    }
                    self.line += 1;
                    i += 1;
                }
                State::SizeLf => {
                    if b != b'\n' {
                        return Err(Kind::BadChunk);
                    }
                    i += 1;
                    self.sized = true;
                    self.state = if self.size == 0 {
                        State::TrailerStart
                    } else {
                        State::Data
                    };
                }
                State::Data => {
                    let take = ((buf.len() - i) as u64).min(self.size) as usize;
                    on_data(i..i + take);
                    i += take;
                    self.size -= take as u64;
                    if self.size == 0 {
                        self.state = State::DataCr;
                    }
                }
                State::DataCr => {
                    if b != b'\r' {
                        return Err(Kind::BadChunk);
                    }
                    i += 1;
                    self.state = State::DataLf;
                }
                State::DataLf => {
                    if b != b'\n' {
                        return Err(Kind::BadChunk);
                    }
                    i += 1;
                    self.state = State::Size { digits: 0 };
                }
                State::TrailerStart => {
                    on_trailer(i..i + 1);
                    i += 1;
                    if b == b'\r' {
                        self.state = State::TrailerLf { empty: true };
                    } else if b == b'\n' || b == b' ' || b == b'\t' || b == 0 {
                        // bare LF, or obs-fold in trailers
                        return Err(Kind::BadChunk);
                    } else {
                        self.state = State::TrailerLine;
                    }
                    self.bump_trailer()?;
                }
                State::TrailerLine => {
                    on_trailer(i..i + 1);
                    i += 1;
                    if b == b'\r' {
                        self.state = State::TrailerLf { empty: false };
                    } else if b == b'\n' || b == 0 {
                        return Err(Kind::BadChunk);
                    }
                    self.bump_trailer()?;
                }
                State::TrailerLf { empty } => {
                    if b != b'\n' {
                        return Err(Kind::BadChunk);
                    }
                    on_trailer(i..i + 1);
                    i += 1;
                    if empty {
                        self.state = State::Done;
                        return Ok(i);
                    }
                    self.state = State::TrailerStart;
                }
                State::Done => return Ok(i),
            }
        }
        Ok(i)
    }

    fn bump_trailer(&mut self) -> Result<(), Kind> {
        self.trailer_bytes += 1;
        if self.trailer_bytes > MAX_TRAILERS {
            return Err(Kind::BadChunk);
        }
        Ok(())
    }
}

#[inline]
fn hex(b: u8) -> Option<u8> {
    match b {
        b'0'..=b'9' => Some(b - b'0'),
        b'a'..=b'f' => Some(b - b'a' + 10),
        b'A'..=b'F' => Some(b - b'A' + 10),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scan_all(s: &[u8]) -> Result<usize, Kind> {
        let mut c = ChunkedScanner::new();
        let n = c.feed(s)?;
        assert!(c.is_done(), "not done");
        Ok(n)
    }

    #[test]
    fn good_bodies() {
        let b = b"5\r\nhello\r\n0\r\n\r\nNEXT";
        assert_eq!(scan_all(b), Ok(b.len() - 4));
        let b = b"5;ext=1\r\nhello\r\n10\r\n0123456789abcdef\r\n0\r\nx-trailer: done\r\n\r\n";
        assert_eq!(scan_all(b), Ok(b.len()));
    }

    #[test]
    fn byte_at_a_time() {
        let b = b"5\r\nhello\r\n0\r\nt: 1\r\n\r\n";
        let mut c = ChunkedScanner::new();
        for &x in b.iter() {
            assert_eq!(c.feed(&[x]), Ok(1));
        }
        assert!(c.is_done());
    }

    #[test]
    fn data_spans() {
        let b = b"5\r\nhello\r\n3;x\r\nabc\r\n0\r\n\r\n";
        let mut c = ChunkedScanner::new();
        let mut data = Vec::new();
        c.feed_data(b, |r| data.extend_from_slice(&b[r])).unwrap();
        assert_eq!(data, b"helloabc");
        assert!(c.is_done());
    }

    #[test]
    fn trailer_spans() {
        let b = b"3\r\nabc\r\n0\r\nx-a: 1\r\nx-b: 2\r\n\r\nNEXT";
        for split in 0..b.len() {
            let mut c = ChunkedScanner::new();
            let (mut data, mut trailer) = (Vec::new(), Vec::new());
            let mut used = 0;
            for part in [&b[..split], &b[split..]] {
                used += c
                    .feed_parts(
                        part,
                        |r| data.extend_from_slice(&part[r]),
                        |r| trailer.extend_from_slice(&part[r]),
                    )
                    .unwrap();
            }
            assert!(c.is_done());
            assert_eq!(used, b.len() - 4, "split at {split}");
            assert_eq!(data, b"abc");
            assert_eq!(trailer, b"x-a: 1\r\nx-b: 2\r\n\r\n", "split at {split}");
        }
        // No trailers: the section is the final CRLF.
        let mut c = ChunkedScanner::new();
        let mut trailer = Vec::new();
        c.feed_parts(
            b"0\r\n\r\n",
            |_| {},
            |r| trailer.extend_from_slice(&b"0\r\n\r\n"[r]),
        )
        .unwrap();
        assert_eq!(trailer, b"\r\n");
    }

    #[test]
    fn bad_bodies() {
        for b in [
            &b"x\r\n"[..],
            b"5\nhello\r\n0\r\n\r\n",
            b"5\r\nhelloXX0\r\n\r\n",
            b" 5\r\nhello\r\n",
            b"0x5\r\nhello\r\n",
            b"11111111111111111\r\n",
            b"5 \r\nhello\r\n",
            b"0\r\n bad\r\n\r\n",
            b"-1\r\n",
        ] {
            let mut c = ChunkedScanner::new();
            assert_eq!(
                c.feed(b),
                Err(Kind::BadChunk),
                "{:?}",
                String::from_utf8_lossy(b)
            );
        }
    }
}
