//! The receive patterns: `receive` (`*l`, `*a`, a size), `receiveany(max)`
//! and `receiveuntil`'s iterator (`pat`, `inclusive`, `size`), as ngx_lua
//! has them, on the socket's buffer (bounded by `[lua] socket_buffer`).

use std::borrow::Cow;
use std::os::raw::{c_char, c_int};
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::{Buf, BufMut};

use super::{io_err, TcpSock, AGAIN, E_BUSY, E_CLOSED, E_CONNECTING, E_IO, E_NEED};
use super::{E_TIMEOUT, E_TOOLARGE};
use crate::ffi::put;

/// `recv` modes.
pub(super) const LINE: c_int = 0;
const ALL: c_int = 1;
pub(super) const SIZE: c_int = 2;
const ANY: c_int = 3;
pub(super) const UNTIL: c_int = 4;
pub(super) const UNTIL_INCLUSIVE: c_int = 5;

/// `recv` results besides errors: data, data ending at the pattern
/// (`receiveuntil`), and "nothing" (a sized `receiveuntil` at the pattern).
pub(super) const OK: c_int = 0;
pub(super) const FIN: c_int = 1;
const NOTHING: c_int = 2;

/// `fill`'s error when the receive buffer is full: raised as a Lua error.
const TOO_LARGE: &str = "receive buffer full";

/// Where a receive's result is.
enum Src {
    Buf(usize, usize),
    Scratch,
}

/// What happens to the buffer once the result is delivered.
enum After {
    Advance(usize),
    Clear,
    ClearClose,
}

struct Outcome {
    code: c_int,
    src: Src,
    after: After,
}

impl TcpSock {
    /// Reads more into `buf` without waiting; `Ready(Ok(false))` at EOF.
    fn poll_fill(&mut self, cx: &mut Context<'_>) -> Poll<Result<bool, Cow<'static, str>>> {
        let Some(c) = self.conn.as_mut() else {
            return Poll::Ready(Err("closed".into()));
        };
        let room = self.max_buf.saturating_sub(self.buf.len());
        if room == 0 {
            return Poll::Ready(Err(TOO_LARGE.into()));
        }
        self.buf.reserve(room.min(8192));
        // Never past the bound (a read fills all spare capacity).
        let mut limited = (&mut self.buf).limit(room);
        match tokio_util::io::poll_read_buf(Pin::new(c), cx, &mut limited) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(Err(e)) => Poll::Ready(Err(io_err(&e))),
            Poll::Ready(Ok(0)) => Poll::Ready(Ok(false)),
            Poll::Ready(Ok(_)) => Poll::Ready(Ok(true)),
        }
    }

    /// The receive `mode` from what is buffered, if it can end now.
    fn complete(&mut self, mode: c_int, n: usize, pat: &[u8]) -> Option<Outcome> {
        let len = self.buf.len();
        match mode {
            LINE => {
                let from = self.op.scanned.min(len);
                let Some(i) = memchr::memchr(b'\n', &self.buf[from..]) else {
                    self.op.scanned = len;
                    return None;
                };
                let end = from + i;
                let mut line_end = end;
                if line_end > 0 && self.buf[line_end - 1] == b'\r' {
                    line_end -= 1;
                }
                // CRs inside a line are dropped too (ngx_lua), at a copy's cost.
                let src = if memchr::memchr(b'\r', &self.buf[..line_end]).is_some() {
                    self.op.scratch.clear();
                    let buf = &self.buf[..line_end];
                    self.op.scratch.extend(buf.iter().filter(|&&b| b != b'\r'));
                    Src::Scratch
                } else {
                    Src::Buf(0, line_end)
                };
                Some(Outcome {
                    code: OK,
                    src,
                    after: After::Advance(end + 1),
                })
            }
            ALL => None,
            SIZE => (len >= n).then_some(Outcome {
                code: OK,
                src: Src::Buf(0, n),
                after: After::Advance(n),
            }),
            ANY => (len > 0).then(|| {
                let k = n.min(len);
                Outcome {
                    code: OK,
                    src: Src::Buf(0, k),
                    after: After::Advance(k),
                }
            }),
            _ => self.complete_until(n, pat, mode == UNTIL_INCLUSIVE),
        }
    }

    /// `receiveuntil`'s iterator step: the data before `pat` (with it when
    /// `inclusive`), or at most `size` bytes of it when `size` > 0.
    fn complete_until(&mut self, size: usize, pat: &[u8], inclusive: bool) -> Option<Outcome> {
        let len = self.buf.len();
        let from = self.op.scanned.min(len);
        if let Some(i) = memchr::memmem::find(&self.buf[from..], pat) {
            let i = from + i;
            let end = if inclusive { i + pat.len() } else { i };
            if size == 0 || end <= size {
                if end == 0 && size != 0 {
                    // Sized reads: nothing before the pattern, done.
                    return Some(Outcome {
                        code: NOTHING,
                        src: Src::Buf(0, 0),
                        after: After::Advance(pat.len()),
                    });
                }
                return Some(Outcome {
                    code: FIN,
                    src: Src::Buf(0, end),
                    after: After::Advance(i + pat.len()),
                });
            }
            if i > 0 {
                // The data before the pattern, in pieces of `size`.
                let k = i.min(size);
                return Some(Outcome {
                    code: OK,
                    src: Src::Buf(0, k),
                    after: After::Advance(k),
                });
            }
            // Inclusive, a pattern longer than `size`: it comes whole.
            return Some(Outcome {
                code: FIN,
                src: Src::Buf(0, pat.len()),
                after: After::Advance(pat.len()),
            });
        }
        // Bytes that cannot start a match are data.
        let safe = len.saturating_sub(pat.len() - 1);
        if size != 0 && safe >= size {
            return Some(Outcome {
                code: OK,
                src: Src::Buf(0, size),
                after: After::Advance(size),
            });
        }
        self.op.scanned = safe;
        None
    }

    /// A receive that failed with `code`: the buffered data is its partial
    /// result (CRs dropped for `*l`); any error but a timeout closes.
    fn failed(&mut self, code: c_int, mode: c_int) -> Outcome {
        let src = if mode == LINE && memchr::memchr(b'\r', &self.buf).is_some() {
            self.op.scratch.clear();
            let buf = &self.buf[..];
            self.op.scratch.extend(buf.iter().filter(|&&b| b != b'\r'));
            Src::Scratch
        } else {
            Src::Buf(0, self.buf.len())
        };
        Outcome {
            code,
            src,
            after: if code == E_TIMEOUT {
                After::Clear
            } else {
                After::ClearClose
            },
        }
    }

    /// Copies the outcome's bytes to `(out, cap)`, or reports their size
    /// ([`E_NEED`]): a success is then computed again by the next call (the
    /// buffer is left as it is), an error is parked for it.
    fn deliver(&mut self, o: Outcome, out: *mut c_char, cap: usize, outlen: *mut c_int) -> c_int {
        let data: &[u8] = match o.src {
            Src::Buf(a, b) => &self.buf[a..b],
            Src::Scratch => &self.op.scratch,
        };
        let n = data.len();
        let Ok(n32) = c_int::try_from(n) else {
            return E_TOOLARGE;
        };
        // SAFETY: `outlen` is NULL or writable (the ffi contract).
        unsafe { put(outlen, n32) };
        if n > cap || (out.is_null() && n > 0) {
            if o.code < 0 {
                if let Src::Buf(a, b) = o.src {
                    let (buf, scratch) = (&self.buf, &mut self.op.scratch);
                    scratch.clear();
                    scratch.extend_from_slice(&buf[a..b]);
                }
                self.op.parked = Some(o.code);
                self.finish_recv(o.after);
            }
            return E_NEED;
        }
        if n > 0 {
            // SAFETY: `out` is writable for `cap >= n` bytes (ffi contract)
            // and does not overlap the socket's buffers.
            unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), out.cast::<u8>(), n) };
        }
        self.finish_recv(o.after);
        o.code
    }

    fn finish_recv(&mut self, after: After) {
        match after {
            After::Advance(k) => self.buf.advance(k),
            After::Clear => self.buf.clear(),
            After::ClearClose => self.close_conn(),
        }
        self.op.reading = false;
        self.op.scanned = 0;
        self.op.armed = false;
    }

    #[allow(clippy::too_many_arguments)] // the C function's arguments, plus the context
    pub(super) fn recv(
        &mut self,
        cx: &mut Context<'_>,
        mode: c_int,
        n: usize,
        pat: &[u8],
        retry: bool,
        out: *mut c_char,
        cap: usize,
        outlen: *mut c_int,
    ) -> c_int {
        if let Some(code) = self.op.parked {
            let n = self.op.scratch.len();
            let Ok(n32) = c_int::try_from(n) else {
                return E_TOOLARGE;
            };
            // SAFETY: `outlen` is NULL or writable (the ffi contract).
            unsafe { put(outlen, n32) };
            if n > cap || (out.is_null() && n > 0) {
                return E_NEED;
            }
            if n > 0 {
                // SAFETY: `out` is writable for `cap >= n` bytes (ffi contract).
                unsafe {
                    std::ptr::copy_nonoverlapping(self.op.scratch.as_ptr(), out.cast::<u8>(), n)
                };
            }
            self.op.parked = None;
            return code;
        }
        if !retry {
            if self.op.connect.is_some() {
                return E_CONNECTING;
            }
            if self.op.reading {
                return E_BUSY;
            }
            self.op.scanned = 0;
            self.op.armed = false;
        }
        if self.conn.is_none() {
            self.op.reading = false;
            // SAFETY: `outlen` is NULL or writable (the ffi contract).
            unsafe { put(outlen, 0) };
            return E_CLOSED;
        }
        loop {
            if let Some(o) = self.complete(mode, n, pat) {
                return self.deliver(o, out, cap, outlen);
            }
            match self.poll_fill(cx) {
                Poll::Ready(Ok(true)) => {}
                Poll::Ready(Ok(false)) => {
                    let o = if mode == ALL {
                        Outcome {
                            code: OK,
                            src: Src::Buf(0, self.buf.len()),
                            after: After::Clear,
                        }
                    } else {
                        self.failed(E_CLOSED, mode)
                    };
                    return self.deliver(o, out, cap, outlen);
                }
                Poll::Ready(Err(e)) => {
                    if e == TOO_LARGE {
                        self.close_conn();
                        self.buf = bytes::BytesMut::new();
                        self.op.reading = false;
                        return E_TOOLARGE;
                    }
                    let code = if e == "closed" { E_CLOSED } else { E_IO };
                    self.op.err = e;
                    let o = self.failed(code, mode);
                    return self.deliver(o, out, cap, outlen);
                }
                Poll::Pending => {
                    if self.timed_out(cx, self.read_timeout) {
                        let o = self.failed(E_TIMEOUT, mode);
                        return self.deliver(o, out, cap, outlen);
                    }
                    self.op.reading = true;
                    return AGAIN;
                }
            }
        }
    }
}
