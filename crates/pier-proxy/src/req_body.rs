//! Request bodies read in full before anything goes upstream, on a phase's
//! demand (Lua's `ngx.req.read_body`), as ngx_lua reads them: the driver
//! otherwise streams the body to the origin while relaying the response.
//!
//! The phase asks through its context ([`Phases::req_body`],
//! [`ReqBody::poll_read`]); the
//! driver runs `request_filter` next to a reader that waits for that ask,
//! reads the whole body from the downstream (any protocol) into memory,
//! bounded, and wakes the phase. The exchange then sends the buffered body
//! upstream ([`BodyIn`]) instead of reading the client.

use crate::phases::{Flow, Phases};
use crate::session::Session;
use crate::state::State;
use bytes::{Bytes, BytesMut};
use pier_error::{Error, Kind};
use pier_http::{Headers, ResponseHead};
use pier_session::{Downstream, DownstreamOpts, RequestSource, ResponseSink};
use std::cell::{Cell, OnceCell, RefCell};
use std::rc::Rc;
use std::task::{Context, Poll, Waker};

#[derive(Default)]
pub(crate) struct Shared {
    /// The driver reads on demand now (during `request_filter` only: a
    /// later ask finds no reader and gets no body).
    open: Cell<bool>,
    /// A phase asked for the body.
    wanted: Cell<bool>,
    /// The body, once read.
    data: OnceCell<Bytes>,
    /// Trailers that came with it (forwarded as received).
    trailers: OnceCell<Headers>,
    /// The phase's task, woken when the body is in.
    waker: RefCell<Option<Waker>>,
}

/// The request body as a phase sees it. Empty (no allocation) for requests
/// without a body, and whenever nothing can read one.
#[derive(Default)]
pub struct ReqBody(Option<Rc<Shared>>);

impl ReqBody {
    /// Asks for the body and waits for it: `Ready` once it is in memory
    /// (at once when the request has none, or outside `request_filter`). A body that can't be read (too
    /// large, client gone, timeout) never becomes ready: the driver then
    /// ends the phase and answers the error itself.
    pub fn poll_read(&self, cx: &mut Context<'_>) -> Poll<()> {
        let Some(s) = &self.0 else {
            return Poll::Ready(());
        };
        if s.data.get().is_some() || !s.open.get() {
            return Poll::Ready(());
        }
        *s.waker.borrow_mut() = Some(cx.waker().clone());
        if !s.wanted.replace(true) {
            // The reader polls beside the phase in this task: poll again.
            cx.waker().wake_by_ref();
        }
        Poll::Pending
    }

    /// The body read by [`poll_read`](Self::poll_read); None before (or
    /// when there is no body).
    pub fn data(&self) -> Option<&[u8]> {
        self.0.as_ref()?.data.get().map(|b| &b[..])
    }

    /// Whether the driver set this request up for reading its body.
    pub fn is_armed(&self) -> bool {
        self.0.is_some()
    }

    /// Whether a body was read into memory (it is not pending on the
    /// client connection any more).
    pub fn is_read(&self) -> bool {
        self.0.as_ref().is_some_and(|s| s.data.get().is_some())
    }

    fn buffered(&self) -> Option<&Rc<Shared>> {
        self.0.as_ref().filter(|s| s.data.get().is_some())
    }
}

/// The `request_filter` step for a request with a body, when the phases
/// keep a [`ReqBody`] in their context (the driver boxes this path): the
/// phase's future is polled beside a reader that, once the phase asks,
/// reads the whole body (at most `cap` bytes) and wakes it. `Err(kind)` when the body could not be read: the
/// phase was dropped where it waited, and the caller answers `kind`. A body
/// read stays in the context for the exchange ([`BodyIn`]).
pub(crate) async fn request_filter<P: Phases, D: Downstream>(
    phases: &P,
    state: &State,
    sess: &mut Session,
    ctx: &mut P::Ctx,
    down: &mut D,
    o: &DownstreamOpts,
) -> Result<Result<Flow, Error>, Kind> {
    let Some(slot) = phases.req_body(state, sess, ctx) else {
        return Ok(phases.request_filter(state, sess, ctx).await);
    };
    let shared = Rc::new(Shared::default());
    shared.open.set(true);
    *slot = ReqBody(Some(shared.clone()));
    let l = &state.cfg.limits;
    let cap = match l.max_body_bytes {
        0 => l.max_buffered_body_bytes,
        m => m.min(l.max_buffered_body_bytes),
    };
    let expect = sess.req.expects_continue();
    let r = {
        let read = async {
            std::future::poll_fn(|_| {
                if shared.wanted.get() {
                    Poll::Ready(())
                } else {
                    Poll::Pending
                }
            })
            .await;
            read_all(down, o, cap, expect).await
        };
        let phase = phases.request_filter(state, sess, ctx);
        tokio::pin!(read, phase);
        let mut read_done = false;
        loop {
            tokio::select! {
                biased;
                got = &mut read, if !read_done => {
                    read_done = true;
                    match got {
                        Ok((data, trailers)) => {
                            let _ = shared.data.set(data);
                            if let Some(t) = trailers {
                                let _ = shared.trailers.set(t);
                            }
                            if let Some(w) = shared.waker.borrow_mut().take() {
                                w.wake();
                            }
                        }
                        Err(k) => break Err(k),
                    }
                }
                r = &mut phase => break Ok(r),
            }
        }
    };
    shared.open.set(false);
    if let Some(d) = shared.data.get() {
        sess.bytes_received += d.len() as u64;
        // The client had its 100 Continue; the origin gets the whole body
        // at once and has nothing to wait for.
        if expect {
            sess.up_req.headers.remove(b"expect");
        }
    }
    r
}

/// The whole body into memory, at most `cap` bytes (413 past it). A client
/// waiting for `100 Continue` gets it first, as nginx sends it when it
/// reads a body.
async fn read_all<D: Downstream>(
    down: &mut D,
    o: &DownstreamOpts,
    cap: u64,
    expect: bool,
) -> Result<(Bytes, Option<Headers>), Kind> {
    let (mut src, mut snk) = down.open(o);
    if expect {
        let head = ResponseHead::local(100);
        snk.write_interim(&head)
            .await
            .map_err(|_| Kind::ClientClosed)?;
    }
    let mut buf = BytesMut::new();
    if let pier_http::BodyLen::Length(n) = o.body {
        if n > cap {
            return Err(Kind::BodyTooLarge);
        }
        buf.reserve(n as usize);
    }
    while let Some(piece) = src.read_body().await.map_err(|e| e.kind)? {
        if (buf.len() + piece.len()) as u64 > cap {
            return Err(Kind::BodyTooLarge);
        }
        buf.extend_from_slice(piece);
    }
    Ok((buf.freeze(), src.trailers().cloned()))
}

/// The request body the exchange sends upstream: the client's, streamed, or
/// the one a phase read into memory (shared, not copied: small in the
/// exchange's future).
pub(crate) enum BodyIn<S> {
    Client(S),
    Buffered { body: Rc<Shared>, sent: bool },
}

impl<S> BodyIn<S> {
    /// `received` (the session's count) already has a read body's bytes:
    /// they come off it, as the exchange counts what it sends.
    pub(crate) fn new(client: S, body: Option<&ReqBody>, received: &mut u64) -> Self {
        match body.and_then(ReqBody::buffered) {
            Some(body) => {
                let n = body.data.get().map_or(0, |d| d.len() as u64);
                *received = received.saturating_sub(n);
                BodyIn::Buffered {
                    body: body.clone(),
                    sent: false,
                }
            }
            None => BodyIn::Client(client),
        }
    }
}

impl<S: RequestSource> RequestSource for BodyIn<S> {
    async fn read_body(&mut self) -> Result<Option<&[u8]>, Error> {
        match self {
            BodyIn::Client(s) => s.read_body().await,
            BodyIn::Buffered { body, sent } => {
                let data = body.data.get().map_or(&[][..], |d| &d[..]);
                if *sent || data.is_empty() {
                    return Ok(None);
                }
                *sent = true;
                Ok(Some(data))
            }
        }
    }
    fn trailers(&self) -> Option<&Headers> {
        match self {
            BodyIn::Client(s) => s.trailers(),
            BodyIn::Buffered { body, .. } => body.trailers.get(),
        }
    }
    const WATCHES_GONE: bool = S::WATCHES_GONE;
    async fn client_gone(&mut self) {
        match self {
            BodyIn::Client(s) => s.client_gone().await,
            BodyIn::Buffered { .. } => std::future::pending().await,
        }
    }
}
