//! The request a Lua hook is running for, published in a thread-local.
//!
//! Rust sets it immediately before each resume of a hook's coroutine and
//! restores the previous value right after ([`Scope`]), so the `extern "C"`
//! API functions find the request without Lua ever holding a pointer to it.
//! Outside a resume it is empty and every request API reports "disabled".

use std::cell::{Cell, RefCell};
use std::ptr::NonNull;
use std::task::Waker;

use bytes::BytesMut;

use crate::engine::{Inner, RequestCtx};
use crate::phase::Phase;
use crate::view::HttpView;

/// `dyn HttpView` with its lifetime erased: only dereferenced while a
/// [`Scope`] created from a live `&mut` is in place.
pub(crate) type ViewPtr = NonNull<dyn HttpView + 'static>;

#[derive(Clone, Copy)]
pub(crate) struct Current {
    pub phase: Option<Phase>,
    pub view: Option<ViewPtr>,
    pub ctx: Option<NonNull<RequestCtx>>,
    pub engine: Option<NonNull<Inner>>,
    /// The body chunk in `body_filter`, with its eof flag.
    pub chunk: Option<NonNull<BytesMut>>,
    pub eof: bool,
    /// Who owns the cosockets created now: the request's id
    /// ([`RequestCtx`]), or a timer run's; 0 outside both.
    pub owner: u64,
}

impl Current {
    pub const NONE: Current = Current {
        phase: None,
        view: None,
        ctx: None,
        engine: None,
        chunk: None,
        eof: false,
        owner: 0,
    };

    /// Whether the current phase is in `mask` (see [`crate::phase::mask`]).
    #[inline(always)]
    pub fn allows(&self, mask: u32) -> bool {
        match self.phase {
            Some(p) => mask & p.bit() != 0,
            None => false,
        }
    }
}

thread_local! {
    static CURRENT: Cell<Current> = const { Cell::new(Current::NONE) };
    /// The waker of the task polling a hook's coroutine, while it polls it:
    /// the cosockets (`io/tcp.rs`) register it with the
    /// connection and the socket's timer before asking Lua to yield.
    static WAKER: RefCell<Option<Waker>> = const { RefCell::new(None) };
    static NEXT_OWNER: Cell<u64> = const { Cell::new(1) };
}

/// A new owner id (a request or a timer run), unique on this thread.
pub(crate) fn new_owner() -> u64 {
    NEXT_OWNER.with(|n| {
        let id = n.get();
        n.set(id + 1);
        id
    })
}

#[inline(always)]
pub(crate) fn get() -> Current {
    CURRENT.with(Cell::get)
}

/// Erases the borrow's lifetime so the pointer can sit in the thread-local.
pub(crate) fn view_ptr(view: &mut dyn HttpView) -> ViewPtr {
    let p: NonNull<dyn HttpView + '_> = NonNull::from(view);
    // SAFETY: only the trait object's lifetime bound changes (same layout);
    // the pointer is dereferenced only while a `Scope` holding it is alive,
    // and every `Scope` is created and dropped inside a call that holds the
    // original `&mut` borrow.
    unsafe { std::mem::transmute::<NonNull<dyn HttpView + '_>, ViewPtr>(p) }
}

/// Publishes `cur` until dropped, then restores what was there (so nested
/// scopes, e.g. a timer started from a hook, unwind correctly).
pub(crate) struct Scope {
    prev: Current,
}

impl Scope {
    #[inline]
    pub fn enter(cur: Current) -> Scope {
        let prev = CURRENT.with(|c| c.replace(cur));
        Scope { prev }
    }
}

impl Drop for Scope {
    #[inline]
    fn drop(&mut self) {
        CURRENT.with(|c| c.set(self.prev));
    }
}

/// Publishes `waker` until dropped (see [`with_waker`]); a clone is kept
/// only when it would not wake the same task as the one already there.
pub(crate) struct WakerScope {
    prev: Option<Waker>,
    replaced: bool,
}

impl WakerScope {
    #[inline]
    pub fn enter(waker: &Waker) -> WakerScope {
        WAKER.with_borrow_mut(|w| match w {
            Some(cur) if cur.will_wake(waker) => WakerScope {
                prev: None,
                replaced: false,
            },
            _ => WakerScope {
                prev: w.replace(waker.clone()),
                replaced: true,
            },
        })
    }
}

impl Drop for WakerScope {
    #[inline]
    fn drop(&mut self) {
        if self.replaced {
            let prev = self.prev.take();
            // Dropping the replaced waker runs no Lua: safe under the borrow.
            let _ = WAKER.try_with(|w| {
                if let Ok(mut w) = w.try_borrow_mut() {
                    *w = prev;
                }
            });
        }
    }
}

/// Runs `f` with the polling task's waker, None outside a hook's poll.
#[inline]
pub(crate) fn with_waker<R>(f: impl FnOnce(Option<&Waker>) -> R) -> R {
    WAKER.with_borrow(|w| f(w.as_ref()))
}
