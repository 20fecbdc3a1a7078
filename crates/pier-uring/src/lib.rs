//! Plain TCP connections on io_uring (`[server] io_uring = true`; issue 34
//! item 5).
//!
//! Why: at 50 connections two thirds of a proxy's CPU is the kernel's share
//! of the same loopback reads and writes, four system calls a request on
//! epoll. `bench/uring/` measured the same proxy on a ring 34–44% cheaper a
//! request. This module brings that to Pier's engine without changing it:
//! a [`UringStream`] is tokio's `AsyncRead` and `AsyncWrite` (and pier-core's
//! `Stream`), so the HTTP/1 driver runs over it unchanged.
//!
//! How, per worker thread (one ring each, in a thread-local):
//! - every connection has a multishot recv armed, its buffers picked from a
//!   provided-buffer ring; the bytes are copied into the connection's own
//!   buffer at once and the kernel's buffer goes straight back. A read is a
//!   copy from there: no system call;
//! - a write is copied into the connection's queue and sent by one SEND at a
//!   time (write-behind, as the kernel's socket buffer is for epoll). A
//!   write reports its length at once; past [`WRITE_MAX`] queued bytes it
//!   waits, so a client that does not read holds back the writer as a full
//!   socket buffer would;
//! - nothing is submitted by the task that queues it: the first entry queued
//!   wakes the worker's reaper task, which runs after the tasks already
//!   woken, so one `io_uring_enter` carries every entry of a round of tasks,
//!   and the completions it finds are handed out in the same pass. The ring's
//!   fd is registered with tokio's poller for completions that come later.
//!
//! Lifetimes: a connection's slot (its fd and buffers) lives in the driver,
//! not in the stream, and is freed only when no operation of it is in flight:
//! every pointer given to the kernel stays valid until its completion. A
//! stream dropped with bytes still queued lets them go out (as `close(2)`
//! on a socket would), for at most [`LINGER`]; then the socket is shut down.
//! Receives are bounded too: past [`READ_MAX`] unread bytes the recv is
//! cancelled until the reader catches up.
//!
//! Client connections of cleartext (HTTP/1 and h2c) and TLS listeners use
//! it (rustls runs over a [`UringStream`] as over a socket), and so do
//! cleartext upstream connections (the pool keeps them with their worker: a
//! stream works only on its ring's thread, and one dropped elsewhere is
//! handed back to it); HTTP/3 and TLS upstream connections run over tokio's
//! sockets. A thread whose ring
//! cannot be set up (old kernel, `io_uring_disabled`) says so once and
//! stays on epoll; so do new connections of a ring whose submits keep
//! failing ([`SUBMIT_FAILURES_MAX`]), while its own are retried after a
//! pause that doubles, never in a loop that would hold the worker.
//!
//! `unsafe` is allowed here, and only here in the engine: the ring is the
//! kernel's interface, shared memory and raw descriptors (each block says
//! why it is sound).
#![allow(unsafe_code)]

use std::cell::RefCell;
use std::collections::VecDeque;
use std::future::Future;
use std::io;
use std::os::fd::{AsRawFd, IntoRawFd, RawFd};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU16, AtomicU32, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use io_uring::{cqueue, opcode, squeue, types, IoUring};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

const RING_ENTRIES: u32 = 1024;
const BUF_GROUP: u16 = 0;
/// Provided buffers at most (a power of two): 512 × 4 KiB, 2 MiB a worker.
/// Bytes are copied out as soon as they arrive, so only one batch's worth
/// is ever held; a batch that needs more ends some multishot receives
/// (ENOBUFS), which are armed again at once.
const BUF_COUNT: u16 = 512;
/// Provided buffers a ring starts with, and adds each time a batch ran out
/// (ENOBUFS) until BUF_COUNT. The ring cycles through all it was given,
/// so each is touched: a lightly loaded worker (idle keep-alive and HTTP/2
/// connections) keeps 256 KiB of them resident rather than 2 MiB.
const BUF_STEP: u16 = 64;
const BUF_SIZE: usize = 4096;
/// Unread bytes past which a connection's recv is paused.
pub const READ_MAX: usize = 256 * 1024;
/// Queued bytes past which a write waits.
pub const WRITE_MAX: usize = 256 * 1024;
/// How long a dropped stream's queued bytes may take to go out.
pub const LINGER: Duration = Duration::from_secs(10);
/// Buffer capacity a busy connection keeps (more is freed when drained).
const KEEP_CAP: usize = 4096;
/// Buffer capacity a connection keeps while it waits for its peer with
/// nothing unread or unsent (an idle keep-alive or HTTP/2 connection):
/// none, as on epoll, where a waiting connection holds no buffer of ours.
/// The price is a small allocation for the next message (tcache's).
const IDLE_CAP: usize = 0;
/// Spare buffers a ring keeps for its connections' next messages, and the
/// largest it keeps: a 4 KiB answer took a fresh glibc allocation (and a
/// reallocation) a leg per response once its buffer was given back.
const SPARE_MAX: usize = 8;
const SPARE_CAP: usize = 16 * 1024;
/// Submits failed in a row (errors other than EINTR and EBUSY) after which
/// the worker's new connections stay on epoll; those on the ring keep
/// being retried, and their own timeouts end them if it never recovers.
pub const SUBMIT_FAILURES_MAX: u32 = 16;

const OP_RECV: u64 = 1;
const OP_SEND: u64 = 2;
const OP_CANCEL: u64 = 3;
const OP_POLL: u64 = 4;

fn user_data(slot: u32, gen: u32, op: u64) -> u64 {
    ((gen as u64) << 32) | ((slot as u64) << 8) | op
}

fn decode(ud: u64) -> (usize, u32, u64) {
    (
        ((ud >> 8) & 0xff_ffff) as usize,
        (ud >> 32) as u32,
        ud & 0xff,
    )
}

/// An anonymous private mapping, page aligned and zeroed, unmapped on drop.
struct Mapping {
    ptr: *mut u8,
    len: usize,
}

impl Mapping {
    fn new(len: usize) -> io::Result<Self> {
        // SAFETY: a fresh anonymous mapping; no existing memory is touched.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(Mapping {
            ptr: ptr.cast(),
            len,
        })
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: ptr/len are the mapping made in `new`; nothing refers to it
        // any more (the ring that used it is dropped first, see `Driver`).
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

/// The provided-buffer ring the multishot receives pick from.
struct BufRing {
    ring: Mapping,
    bufs: Mapping,
    tail: u16,
    /// Buffers handed to the kernel so far: ids 0..provided.
    provided: u16,
}

impl BufRing {
    fn new(uring: &IoUring) -> io::Result<Self> {
        let ring = Mapping::new(BUF_COUNT as usize * std::mem::size_of::<types::BufRingEntry>())?;
        let bufs = Mapping::new(BUF_COUNT as usize * BUF_SIZE)?;
        // SAFETY: `ring` holds BUF_COUNT entries, is page aligned, and lives
        // as long as `Driver::bufs`, dropped after `Driver::ring` (the
        // io_uring instance that unregisters it).
        unsafe {
            uring.submitter().register_buf_ring_with_flags(
                ring.ptr as u64,
                BUF_COUNT,
                BUF_GROUP,
                0,
            )?;
        }
        let mut br = BufRing {
            ring,
            bufs,
            tail: 0,
            provided: 0,
        };
        br.grow();
        Ok(br)
    }

    /// Hands BUF_STEP more buffers to the kernel (a batch ran out), up to
    /// BUF_COUNT. Each id is in the ring at most once: new ids only.
    fn grow(&mut self) {
        let to = self.provided.saturating_add(BUF_STEP).min(BUF_COUNT);
        for bid in self.provided..to {
            self.give_back(bid);
        }
        self.provided = to;
    }

    /// Hands buffer `bid` (back) to the kernel.
    fn give_back(&mut self, bid: u16) {
        if bid >= BUF_COUNT {
            return;
        }
        let entries = self.ring.ptr.cast::<types::BufRingEntry>();
        // SAFETY: the index is masked into the ring's BUF_COUNT entries; the
        // entry at the tail is not read by the kernel until the tail is
        // published below; `bid` < BUF_COUNT, so the address is inside
        // `bufs`, which outlives the ring.
        unsafe {
            let e = &mut *entries.add((self.tail & (BUF_COUNT - 1)) as usize);
            e.set_addr(self.bufs.ptr.add(bid as usize * BUF_SIZE) as u64);
            e.set_len(BUF_SIZE as u32);
            e.set_bid(bid);
        }
        self.tail = self.tail.wrapping_add(1);
        // SAFETY: the tail field sits in the first entry of the mapped ring
        // (io_uring_buf_ring's layout); the kernel reads it with acquire.
        unsafe {
            let tail = types::BufRingEntry::tail(entries).cast::<AtomicU16>();
            (*tail).store(self.tail, Ordering::Release);
        }
    }

    /// The first `len` bytes of buffer `bid`, which a completion handed us.
    fn bytes(&self, bid: u16, len: usize) -> &[u8] {
        if bid >= BUF_COUNT {
            return &[];
        }
        let len = len.min(BUF_SIZE);
        // SAFETY: in bounds (checked above); the kernel wrote these bytes
        // before posting the completion and writes nothing more there until
        // `give_back(bid)`.
        unsafe { std::slice::from_raw_parts(self.bufs.ptr.add(bid as usize * BUF_SIZE), len) }
    }
}

/// A ring's spare buffers (LIFO: the last given back is still in cache).
#[derive(Default)]
struct Spares(Vec<Vec<u8>>);

impl Spares {
    /// A buffer for a connection that has none.
    fn take(&mut self) -> Vec<u8> {
        self.0.pop().unwrap_or_default()
    }
    /// A connection is done with `v`: kept if there is room and it is not
    /// too large (nor too small to matter), freed otherwise.
    fn keep(&mut self, mut v: Vec<u8>) {
        if (1024..=SPARE_CAP).contains(&v.capacity()) && self.0.len() < SPARE_MAX {
            v.clear();
            self.0.push(v);
        }
    }
}

#[derive(Default)]
struct Slot {
    fd: RawFd,
    gen: u32,
    /// A [`UringStream`] refers to the slot.
    owned: bool,
    /// Operations in flight (an armed multishot recv counts as one).
    inflight: u32,
    recv_armed: bool,
    /// A cancel of the recv was asked for (too many unread bytes, or the
    /// stream was dropped).
    cancelling: bool,
    eof: bool,
    /// The first error (errno) a receive or send met.
    err: Option<i32>,
    rbuf: Vec<u8>,
    rpos: usize,
    /// The bytes of the SEND in flight, from `spos` on.
    sending: Vec<u8>,
    spos: usize,
    in_send: bool,
    /// Bytes written since, for the next SEND.
    queue: Vec<u8>,
    rwaker: Option<Waker>,
    wwaker: Option<Waker>,
    /// A POLL_ADD for POLLOUT is in flight (a writer that writes to the fd
    /// itself, `splice`, waits on it).
    polling: bool,
    /// It completed since the writer last looked.
    writable: bool,
}

impl Slot {
    fn unread(&self) -> usize {
        self.rbuf.len() - self.rpos
    }
    /// The stream waits for its peer: with nothing unread, and nothing
    /// left to send, its buffers past [`IDLE_CAP`] go back, so a waiting
    /// connection holds its slot and little more (an idle HTTP/2 client
    /// on TLS kept ~3.5 KiB more on the ring than on epoll).
    fn trim_idle(&mut self, spares: &mut Spares) {
        if self.unread() == 0 && self.rbuf.capacity() > IDLE_CAP {
            spares.keep(std::mem::take(&mut self.rbuf));
            self.rpos = 0;
        }
        // Never the buffer of a SEND in flight: the kernel reads it.
        if !self.in_send && self.unsent() == 0 {
            if self.sending.capacity() > IDLE_CAP {
                spares.keep(std::mem::take(&mut self.sending));
                self.spos = 0;
            }
            if self.queue.capacity() > IDLE_CAP {
                spares.keep(std::mem::take(&mut self.queue));
            }
        }
    }
    fn unsent(&self) -> usize {
        self.sending.len() - self.spos + self.queue.len()
    }
}

struct Driver {
    ring: IoUring,
    /// Never unmapped, nor are the slots' buffers freed (see `Drop`).
    bufs: std::mem::ManuallyDrop<BufRing>,
    slots: std::mem::ManuallyDrop<Vec<Slot>>,
    free: Vec<u32>,
    /// Entries pushed and not yet submitted.
    queued: u32,
    reaper: Option<Waker>,
    /// Dropped streams whose bytes are still going out: (slot, gen, deadline).
    lingering: VecDeque<(u32, u32, tokio::time::Instant)>,
    cqes: Vec<(u64, i32, u32)>,
    /// Completions made here, for entries that could not be queued (the
    /// submission queue full and its submit failing): their operations end
    /// with the error instead of waiting for ever.
    made: Vec<(u64, i32, u32)>,
    /// Submits that failed in a row; 0 once one succeeds.
    failures: u32,
    /// This ring's number: a stream works only on the ring it names.
    id: u32,
    /// Streams of this ring dropped on other threads.
    inbox: Arc<Inbox>,
    spares: Spares,
}

/// Where a stream dropped on another thread (an idle upstream connection
/// in the shared pool, swept or dropped with it) is handed to the thread
/// whose ring it is on, whose reaper releases it as a local drop would.
#[derive(Default)]
struct Inbox {
    drops: Mutex<Vec<(u32, u32)>>,
    pending: AtomicBool,
    /// The ring thread's reaper (set once: a task's waker does not change).
    reaper: OnceLock<Waker>,
}

/// The inboxes of the rings that are up, by ring number.
type Inboxes = Mutex<Vec<(u32, Arc<Inbox>)>>;

fn inboxes() -> &'static Inboxes {
    static INBOXES: OnceLock<Inboxes> = OnceLock::new();
    INBOXES.get_or_init(Default::default)
}

static NEXT_RING: AtomicU32 = AtomicU32::new(1);

thread_local! {
    static DRIVER: RefCell<Option<Driver>> = const { RefCell::new(None) };
    /// [`init`] failed on this thread: not tried again.
    static FAILED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

fn with<R>(f: impl FnOnce(&mut Driver) -> R) -> Option<R> {
    DRIVER
        .try_with(|d| d.try_borrow_mut().ok().and_then(|mut d| d.as_mut().map(f)))
        .ok()
        .flatten()
}

/// This thread has a ring (see [`init`]).
pub fn enabled() -> bool {
    DRIVER
        .try_with(|d| d.try_borrow().is_ok_and(|d| d.is_some()))
        .unwrap_or(false)
}

/// This thread's ring, set up on first use (see [`init`]); false when it
/// cannot be (said once, in the log), or its submits keep failing, and the
/// caller stays on epoll.
pub fn ready() -> bool {
    // One look at the thread-local: None when there is no ring yet.
    // (In use, or the thread ending: not now.)
    let up = DRIVER
        .try_with(|d| match d.try_borrow() {
            Ok(d) => d.as_ref().map(|d| d.failures < SUBMIT_FAILURES_MAX),
            Err(_) => Some(false),
        })
        .unwrap_or(Some(false));
    if let Some(healthy) = up {
        return healthy;
    }
    if FAILED.with(|f| f.get()) {
        return false;
    }
    match init() {
        Ok(()) => true,
        Err(e) => {
            FAILED.with(|f| f.set(true));
            tracing::warn!("io_uring: cannot set up this worker's ring ({e}); epoll it is");
            false
        }
    }
}

/// Set up this thread's ring and start its reaper task. Call inside the
/// worker's `LocalSet`. An error leaves the thread on epoll.
pub fn init() -> io::Result<()> {
    if enabled() {
        return Ok(());
    }
    // Provided-buffer rings came in 5.19 and multishot receives in 6.0: a
    // 5.19 kernel would set the ring up and then fail every receive.
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    if !kernel_at_least(&release, (6, 0)) {
        return Err(io::Error::new(
            io::ErrorKind::Unsupported,
            format!("kernel {} is older than 6.0", release.trim()),
        ));
    }
    let ring = IoUring::builder()
        .setup_coop_taskrun()
        .setup_submit_all()
        .build(RING_ENTRIES)
        .or_else(|_| IoUring::new(RING_ENTRIES))?;
    let bufs = BufRing::new(&ring)?;
    // SAFETY (I/O safety): the ring's fd stays open while the AsyncFd is
    // registered: the ring lives in this thread's DRIVER until the thread
    // ends, and the AsyncFd, inside the reaper task of this thread's
    // LocalSet, is dropped before (the task ends when the driver is gone).
    let fd = unsafe {
        tokio::io::unix::AsyncFd::register_with_interest(
            RingFd(ring.as_raw_fd()),
            tokio::io::Interest::READABLE,
        )
    }
    .map_err(io::Error::from)?;
    let id = NEXT_RING.fetch_add(1, Ordering::Relaxed);
    let inbox = Arc::new(Inbox::default());
    DRIVER.with(|d| {
        *d.borrow_mut() = Some(Driver {
            ring,
            bufs: std::mem::ManuallyDrop::new(bufs),
            slots: std::mem::ManuallyDrop::new(Vec::new()),
            free: Vec::new(),
            queued: 0,
            reaper: None,
            lingering: VecDeque::new(),
            cqes: Vec::with_capacity(RING_ENTRIES as usize * 2),
            made: Vec::new(),
            failures: 0,
            id,
            inbox: inbox.clone(),
            spares: Spares::default(),
        })
    });
    inboxes()
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .push((id, inbox));
    tokio::task::spawn_local(reaper(fd));
    Ok(())
}

/// The thread is ending (its worker is done). Closing the ring cancels what
/// is in flight, but the kernel finishes that after `close` returns, so
/// the memory operations point at is left allocated: the provided buffers
/// and the slots' send buffers (once a thread, at exit). The sockets still
/// open are closed; their operations hold their own references.
impl Drop for Driver {
    fn drop(&mut self) {
        inboxes()
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .retain(|(id, _)| *id != self.id);
        for s in self.slots.iter_mut() {
            if s.fd >= 0 {
                // SAFETY: the slot's fd, handed to the driver and closed
                // nowhere else; no stream uses it any more (the thread's
                // tasks are gone before its thread-locals).
                unsafe { libc::close(s.fd) };
                s.fd = -1;
            }
        }
    }
}

/// `release` (`uname -r`: "6.18.44-fc-v1300") is `want` (major, minor) or later.
fn kernel_at_least(release: &str, want: (u32, u32)) -> bool {
    let mut parts = release
        .trim()
        .split(|c: char| !c.is_ascii_digit())
        .map(|p| p.parse::<u32>().ok());
    match (parts.next().flatten(), parts.next().flatten()) {
        (Some(major), Some(minor)) => (major, minor) >= want,
        _ => false,
    }
}

/// The ring's fd for tokio's poller; the ring owns (and closes) it.
struct RingFd(RawFd);
impl AsRawFd for RingFd {
    fn as_raw_fd(&self) -> RawFd {
        self.0
    }
}

/// Submits what the round's tasks queued, hands out completions (waking
/// their tasks), and sleeps until the ring's fd says more completions came,
/// an entry is queued, or a lingering stream's time is up.
async fn reaper(fd: tokio::io::unix::AsyncFd<RingFd>) {
    let mut wake = Vec::new();
    let sleep = tokio::time::sleep(LINGER);
    tokio::pin!(sleep);
    let mut sleeping_until = None;
    // The pause before a failed submit is tried again.
    let retry = tokio::time::sleep(Duration::ZERO);
    tokio::pin!(retry);
    let mut retrying = false;
    std::future::poll_fn(|cx| loop {
        let next = with(|d| {
            if !d.reaper.as_ref().is_some_and(|w| w.will_wake(cx.waker())) {
                d.reaper = Some(cx.waker().clone());
            }
            let _ = d.inbox.reaper.get_or_init(|| cx.waker().clone());
            if d.inbox.pending.swap(false, Ordering::Acquire) {
                d.release_foreign();
            }
            d.turn(&mut wake);
            d.lingering.front().map(|l| l.2)
        });
        for w in wake.drain(..) {
            w.wake();
        }
        let Some(next) = next else {
            // The driver is gone (thread ending).
            return Poll::Ready(());
        };
        if let Some(at) = next {
            if sleeping_until != Some(at) {
                sleep.as_mut().reset(at);
                sleeping_until = Some(at);
            }
            if sleep.as_mut().poll(cx).is_ready() {
                sleeping_until = None;
                with(|d| d.expire(tokio::time::Instant::now()));
                continue;
            }
        }
        match fd.poll_read_ready(cx) {
            Poll::Ready(Ok(mut g)) => {
                g.clear_ready();
                continue;
            }
            Poll::Ready(Err(e)) => {
                tracing::error!("io_uring: the ring's fd failed: {e}");
                return Poll::Ready(());
            }
            Poll::Pending => {
                // Entries queued by the wakes above are for the next turn,
                // at once; after a failed submit, after a pause that
                // doubles (1 to 128 ms), the worker's other tasks running
                // meanwhile: never a spin.
                match with(|d| (d.queued > 0 || !d.made.is_empty(), d.failures)) {
                    Some((true, 0)) => continue,
                    Some((true, n)) => {
                        if !retrying {
                            let pause = Duration::from_millis(1 << n.min(8).saturating_sub(1));
                            retry.as_mut().reset(tokio::time::Instant::now() + pause);
                            retrying = true;
                        }
                        if retry.as_mut().poll(cx).is_ready() {
                            retrying = false;
                            continue;
                        }
                        return Poll::Pending;
                    }
                    _ => return Poll::Pending,
                }
            }
        }
    })
    .await
}

impl Driver {
    /// Queues an entry; the reaper submits it. Submits at once when the
    /// queue is full.
    ///
    /// # Safety
    /// Every buffer and fd the entry refers to must stay valid until its
    /// completion arrives.
    unsafe fn push(&mut self, e: &squeue::Entry) {
        // SAFETY: the caller's contract, passed on.
        if unsafe { self.ring.submission().push(e) }.is_err() {
            // The queue is full: submit it now, and queue the entry after.
            // If that fails the entry's operation ends with the error (its
            // completion made here), rather than waiting for room that a
            // failing ring may never make.
            let queued = self.submit();
            // SAFETY: as above.
            if !queued || unsafe { self.ring.submission().push(e) }.is_err() {
                self.made.push((e.get_user_data(), -libc::EIO, 0));
                if let Some(w) = &self.reaper {
                    w.wake_by_ref();
                }
                return;
            }
        }
        self.queued += 1;
        if self.queued == 1 {
            if let Some(w) = &self.reaper {
                w.wake_by_ref();
            }
        }
    }

    /// Submits what is queued; false if that failed (EINTR and EBUSY, which
    /// the reaping that follows clears, are not counted as failures).
    fn submit(&mut self) -> bool {
        match self.enter() {
            Ok(_) => {
                self.queued = 0;
                self.failures = 0;
                true
            }
            Err(e)
                if e.kind() == io::ErrorKind::Interrupted
                    || e.raw_os_error() == Some(libc::EBUSY) =>
            {
                false
            }
            Err(e) => {
                self.failures = self.failures.saturating_add(1);
                if self.failures == 1 || self.failures == SUBMIT_FAILURES_MAX {
                    tracing::error!(
                        "io_uring: submit failed ({e}), {} time(s) in a row{}",
                        self.failures,
                        if self.failures >= SUBMIT_FAILURES_MAX {
                            "; new connections stay on epoll"
                        } else {
                            ""
                        }
                    );
                }
                false
            }
        }
    }

    fn enter(&mut self) -> io::Result<usize> {
        #[cfg(test)]
        if tests::FAIL_SUBMITS.with(|f| f.replace(f.get().saturating_sub(1))) > 0 {
            return Err(io::Error::from_raw_os_error(libc::ENOMEM));
        }
        self.ring.submit()
    }

    /// Submit, then take every completion; the wakers to call go to `wake`
    /// (called by the caller, outside the driver's borrow).
    fn turn(&mut self, wake: &mut Vec<Waker>) {
        loop {
            if self.queued > 0 {
                self.submit();
            }
            let mut cqes = std::mem::take(&mut self.cqes);
            cqes.append(&mut self.made);
            cqes.extend(
                self.ring
                    .completion()
                    .map(|c| (c.user_data(), c.result(), c.flags())),
            );
            if cqes.is_empty() {
                self.cqes = cqes;
                return;
            }
            for &(ud, res, flags) in &cqes {
                self.complete(ud, res, flags, wake);
            }
            cqes.clear();
            self.cqes = cqes;
        }
    }

    fn complete(&mut self, ud: u64, res: i32, flags: u32, wake: &mut Vec<Waker>) {
        let (slot, gen, op) = decode(ud);
        if op == OP_CANCEL {
            return;
        }
        if self.slots.get(slot).is_none_or(|s| s.gen != gen) {
            // Slots outlive their operations; ignore rather than crash.
            if let Some(bid) = cqueue::buffer_select(flags) {
                self.bufs.give_back(bid);
            }
            return;
        }
        match op {
            OP_RECV => self.on_recv(slot, res, flags, wake),
            OP_SEND => self.on_send(slot, res, wake),
            OP_POLL => {
                let s = &mut self.slots[slot];
                s.polling = false;
                s.writable = true;
                if res < 0 && res != -libc::ECANCELED {
                    s.err.get_or_insert(-res);
                }
                s.inflight -= 1;
                wake.extend(s.wwaker.take());
            }
            _ => {}
        }
        self.maybe_free(slot);
    }

    fn arm_recv(&mut self, slot: usize) {
        let s = &mut self.slots[slot];
        let e = opcode::RecvMulti::new(types::Fd(s.fd), BUF_GROUP)
            .build()
            .user_data(user_data(slot as u32, s.gen, OP_RECV));
        s.inflight += 1;
        s.recv_armed = true;
        s.cancelling = false;
        // SAFETY: the fd stays open until the slot is freed, which waits for
        // this recv's last completion; its buffers are the provided ring's.
        unsafe { self.push(&e) }
    }

    fn cancel_recv(&mut self, slot: usize) {
        let s = &mut self.slots[slot];
        if !s.recv_armed || s.cancelling {
            return;
        }
        s.cancelling = true;
        let e = opcode::AsyncCancel::new(user_data(slot as u32, s.gen, OP_RECV))
            .build()
            .user_data(user_data(slot as u32, s.gen, OP_CANCEL));
        // SAFETY: refers to no memory; the target is found by its user data.
        unsafe { self.push(&e) }
    }

    fn on_recv(&mut self, slot: usize, res: i32, flags: u32, wake: &mut Vec<Waker>) {
        let more = cqueue::more(flags);
        let s = &mut self.slots[slot];
        if !more {
            s.recv_armed = false;
            s.cancelling = false;
            s.inflight -= 1;
        }
        if let Some(bid) = cqueue::buffer_select(flags) {
            if res > 0 && s.owned {
                // What the reader took goes once it is at least what is
                // left (so each byte is moved at most once on average): a
                // reader that never quite catches up must not keep every
                // byte it ever read.
                if s.rpos > 0 && s.rpos >= s.unread() {
                    s.rbuf.drain(..s.rpos);
                    s.rpos = 0;
                }
                if s.rbuf.capacity() == 0 {
                    s.rbuf = self.spares.take();
                }
                s.rbuf.extend_from_slice(self.bufs.bytes(bid, res as usize));
            }
            self.bufs.give_back(bid);
        }
        if !s.owned {
            return;
        }
        if res >= 0 {
            if res == 0 {
                s.eof = true;
            }
            if let Some(w) = s.rwaker.take() {
                wake.push(w);
            }
        } else if res == -libc::ENOBUFS {
            // The batch wanted more buffers than the ring has: give it more.
            self.bufs.grow();
        } else if res != -libc::ECANCELED {
            s.err.get_or_insert(-res);
            wake.extend(s.rwaker.take());
            wake.extend(s.wwaker.take());
        }
        let (unread, eof, err) = (s.unread(), s.eof, s.err.is_some());
        if eof || err {
            return;
        }
        if unread >= READ_MAX {
            self.cancel_recv(slot);
        } else if !more && !self.slots[slot].recv_armed {
            // Out of provided buffers for a moment, the kernel ended the
            // multishot, or a pause that the reader has caught up with.
            self.arm_recv(slot);
        }
    }

    fn start_send(&mut self, slot: usize) {
        let s = &mut self.slots[slot];
        if s.in_send || s.err.is_some() {
            return;
        }
        if s.spos >= s.sending.len() {
            if s.queue.is_empty() {
                return;
            }
            s.sending.clear();
            std::mem::swap(&mut s.sending, &mut s.queue);
            s.spos = 0;
        }
        let rest = &s.sending[s.spos..];
        let e = opcode::Send::new(
            types::Fd(s.fd),
            rest.as_ptr(),
            rest.len().min(u32::MAX as usize) as u32,
        )
        .flags(libc::MSG_NOSIGNAL)
        .build()
        .user_data(user_data(slot as u32, s.gen, OP_SEND));
        s.in_send = true;
        s.inflight += 1;
        // SAFETY: `sending` is neither written nor moved while `in_send` (new
        // bytes go to `queue`), and the slot, which owns it and the fd, is
        // freed only after this send's completion.
        unsafe { self.push(&e) }
    }

    fn on_send(&mut self, slot: usize, res: i32, wake: &mut Vec<Waker>) {
        let s = &mut self.slots[slot];
        s.in_send = false;
        s.inflight -= 1;
        if res < 0 {
            s.err.get_or_insert(-res);
            s.sending.clear();
            s.queue.clear();
            s.spos = 0;
            wake.extend(s.rwaker.take());
        } else {
            s.spos += res as usize;
            if s.spos >= s.sending.len() {
                s.sending.clear();
                s.spos = 0;
                if s.sending.capacity() > KEEP_CAP {
                    self.spares.keep(std::mem::take(&mut s.sending));
                }
            }
        }
        wake.extend(s.wwaker.take());
        self.start_send(slot);
    }

    /// A slot whose stream is gone and whose operations are done closes its
    /// fd and is free for the next connection.
    fn maybe_free(&mut self, slot: usize) {
        let s = &mut self.slots[slot];
        if s.owned || s.inflight > 0 || s.fd < 0 {
            return;
        }
        // SAFETY: the fd was handed to the driver by `UringStream::new`, and
        // no operation refers to it any more.
        unsafe { libc::close(s.fd) };
        s.fd = -1;
        self.spares.keep(std::mem::take(&mut s.rbuf));
        self.spares.keep(std::mem::take(&mut s.sending));
        self.spares.keep(std::mem::take(&mut s.queue));
        s.rwaker = None;
        s.wwaker = None;
        self.free.push(slot as u32);
    }

    /// Shuts down the sockets of lingering streams whose time is up: their
    /// send then fails, and the slot is freed.
    fn expire(&mut self, now: tokio::time::Instant) {
        while let Some(&(slot, gen, at)) = self.lingering.front() {
            if at > now {
                break;
            }
            self.lingering.pop_front();
            let s = &mut self.slots[slot as usize];
            if s.gen == gen && !s.owned && s.fd >= 0 {
                // SAFETY: the fd is open (the slot is not freed).
                unsafe { libc::shutdown(s.fd, libc::SHUT_RDWR) };
            }
        }
    }
}

/// A TCP connection served by one thread's ring.
///
/// It holds only numbers (its state is in the ring's slot), so it may be
/// kept where other threads see it (an idle upstream connection in the
/// shared pool), but it works only on its ring's thread: elsewhere every
/// operation fails as if the connection were gone, and a drop is handed to
/// its ring's thread (see [`Inbox`]).
pub struct UringStream {
    ring: u32,
    slot: u32,
    gen: u32,
}

impl UringStream {
    /// Move a connection onto the ring (Err: this thread has none, or the
    /// socket could not leave tokio's poller; the stream is then gone).
    pub fn new(stream: tokio::net::TcpStream) -> io::Result<UringStream> {
        if !enabled() {
            return Err(io::ErrorKind::Unsupported.into());
        }
        let fd = stream.into_std()?.into_raw_fd();
        with(|d| {
            let slot = match d.free.pop() {
                Some(i) => i as usize,
                None => {
                    d.slots.push(Slot::default());
                    d.slots.len() - 1
                }
            };
            let s = &mut d.slots[slot];
            let gen = s.gen.wrapping_add(1);
            *s = Slot {
                fd,
                gen,
                owned: true,
                ..Slot::default()
            };
            d.arm_recv(slot);
            UringStream {
                ring: d.id,
                slot: slot as u32,
                gen,
            }
        })
        .ok_or_else(|| {
            // SAFETY: the fd is ours (just taken from the stream) and nothing
            // else refers to it.
            unsafe { libc::close(fd) };
            io::ErrorKind::Unsupported.into()
        })
    }

    fn slot<R>(&self, f: impl FnOnce(&mut Driver, usize) -> R) -> Option<R> {
        with(|d| {
            let i = self.slot as usize;
            (d.id == self.ring && d.slots.get(i).is_some_and(|s| s.gen == self.gen && s.owned))
                .then(|| f(d, i))
        })
        .flatten()
    }

    /// The stream is on this thread's ring (it works here).
    pub fn is_here(&self) -> bool {
        self.slot(|_, _| ()).is_some()
    }

    /// Nothing has arrived on an idle connection, not even its end, and it
    /// is on this thread's ring: it may carry another request (the upstream
    /// pool's check, without a call).
    pub fn looks_alive(&self) -> bool {
        self.slot(|d, i| {
            let s = &d.slots[i];
            s.unread() == 0 && !s.eof && s.err.is_none()
        })
        .unwrap_or(false)
    }

    fn gone() -> io::Error {
        io::Error::new(io::ErrorKind::NotConnected, "io_uring: the ring is gone")
    }

    fn poll_read_priv(&self, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        self.slot(|d, i| {
            let s = &mut d.slots[i];
            if s.unread() > 0 {
                let n = s.unread().min(buf.remaining());
                buf.put_slice(&s.rbuf[s.rpos..s.rpos + n]);
                s.rpos += n;
                if s.rpos == s.rbuf.len() {
                    s.rbuf.clear();
                    s.rpos = 0;
                    if s.rbuf.capacity() > KEEP_CAP {
                        d.spares.keep(std::mem::take(&mut s.rbuf));
                    }
                }
                // A paused recv resumes once the reader has caught up.
                if !s.recv_armed && !s.eof && s.err.is_none() && s.unread() < READ_MAX / 2 {
                    d.arm_recv(i);
                }
                return Poll::Ready(Ok(()));
            }
            if let Some(e) = s.err {
                return Poll::Ready(Err(io::Error::from_raw_os_error(e)));
            }
            if s.eof {
                return Poll::Ready(Ok(()));
            }
            if !s.rwaker.as_ref().is_some_and(|w| w.will_wake(cx.waker())) {
                s.rwaker = Some(cx.waker().clone());
            }
            s.trim_idle(&mut d.spares);
            if !s.recv_armed {
                d.arm_recv(i);
            }
            Poll::Pending
        })
        .unwrap_or_else(|| Poll::Ready(Err(Self::gone())))
    }

    fn poll_readable_priv(&self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.slot(|d, i| {
            let s = &mut d.slots[i];
            if s.unread() > 0 || s.eof || s.err.is_some() {
                return Poll::Ready(Ok(()));
            }
            if !s.rwaker.as_ref().is_some_and(|w| w.will_wake(cx.waker())) {
                s.rwaker = Some(cx.waker().clone());
            }
            s.trim_idle(&mut d.spares);
            if !s.recv_armed {
                d.arm_recv(i);
            }
            Poll::Pending
        })
        .unwrap_or_else(|| Poll::Ready(Err(Self::gone())))
    }

    fn poll_write_priv(
        &self,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        self.slot(|d, i| {
            let s = &mut d.slots[i];
            if let Some(e) = s.err {
                return Poll::Ready(Err(io::Error::from_raw_os_error(e)));
            }
            if s.unsent() >= WRITE_MAX {
                if !s.wwaker.as_ref().is_some_and(|w| w.will_wake(cx.waker())) {
                    s.wwaker = Some(cx.waker().clone());
                }
                return Poll::Pending;
            }
            let room = WRITE_MAX - s.unsent();
            if s.queue.capacity() == 0 {
                s.queue = d.spares.take();
            }
            let mut n = 0;
            for b in bufs {
                let take = b.len().min(room - n);
                s.queue.extend_from_slice(&b[..take]);
                n += take;
                if n == room {
                    break;
                }
            }
            d.start_send(i);
            Poll::Ready(Ok(n))
        })
        .unwrap_or_else(|| Poll::Ready(Err(Self::gone())))
    }

    fn poll_flush_priv(&self) -> Poll<io::Result<()>> {
        self.slot(|d, i| match d.slots[i].err {
            Some(e) => Poll::Ready(Err(io::Error::from_raw_os_error(e))),
            None => Poll::Ready(Ok(())),
        })
        .unwrap_or_else(|| Poll::Ready(Err(Self::gone())))
    }

    /// Waits for the queued bytes to go out, then shuts the write side.
    fn poll_shutdown_priv(&self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.slot(|d, i| {
            let s = &mut d.slots[i];
            if s.err.is_some() {
                return Poll::Ready(Ok(()));
            }
            if s.unsent() > 0 {
                if !s.wwaker.as_ref().is_some_and(|w| w.will_wake(cx.waker())) {
                    s.wwaker = Some(cx.waker().clone());
                }
                return Poll::Pending;
            }
            // SAFETY: the fd is open while the slot is owned.
            if unsafe { libc::shutdown(s.fd, libc::SHUT_WR) } < 0 {
                let e = io::Error::last_os_error();
                if e.raw_os_error() != Some(libc::ENOTCONN) {
                    return Poll::Ready(Err(e));
                }
            }
            Poll::Ready(Ok(()))
        })
        .unwrap_or_else(|| Poll::Ready(Err(Self::gone())))
    }
}

/// For writers that write to the socket themselves (`splice` of a cached
/// body's pages): first every queued byte out, then the fd, and a wait for
/// room in the socket's buffer.
impl UringStream {
    /// Ready once every byte queued before has gone out (or an error ended
    /// the connection, which it returns).
    pub fn poll_drained(&self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.slot(|d, i| {
            let s = &mut d.slots[i];
            if let Some(e) = s.err {
                return Poll::Ready(Err(io::Error::from_raw_os_error(e)));
            }
            if s.unsent() == 0 {
                return Poll::Ready(Ok(()));
            }
            if !s.wwaker.as_ref().is_some_and(|w| w.will_wake(cx.waker())) {
                s.wwaker = Some(cx.waker().clone());
            }
            Poll::Pending
        })
        .unwrap_or_else(|| Poll::Ready(Err(Self::gone())))
    }

    /// Ready when the socket may take bytes written to its fd directly:
    /// after a write that would block, one POLL_ADD for POLLOUT.
    pub fn poll_writable(&self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.slot(|d, i| {
            let s = &mut d.slots[i];
            if let Some(e) = s.err {
                return Poll::Ready(Err(io::Error::from_raw_os_error(e)));
            }
            if s.writable {
                s.writable = false;
                return Poll::Ready(Ok(()));
            }
            if !s.wwaker.as_ref().is_some_and(|w| w.will_wake(cx.waker())) {
                s.wwaker = Some(cx.waker().clone());
            }
            if !s.polling {
                let e = opcode::PollAdd::new(types::Fd(s.fd), libc::POLLOUT as u32)
                    .build()
                    .user_data(user_data(i as u32, s.gen, OP_POLL));
                s.polling = true;
                s.inflight += 1;
                // SAFETY: refers to no memory; the fd stays open until the
                // slot is freed, after this poll's completion.
                unsafe { d.push(&e) }
            }
            Poll::Pending
        })
        .unwrap_or_else(|| Poll::Ready(Err(Self::gone())))
    }

    /// The socket, for writes of its own (after [`Self::poll_drained`]).
    pub fn fd(&self) -> Option<std::os::fd::BorrowedFd<'_>> {
        self.slot(|d, i| d.slots[i].fd)
            .filter(|&fd| fd >= 0)
            // SAFETY: the fd is open as long as this stream is (the slot
            // closes it only after the stream is dropped), and the borrow
            // cannot outlive the stream.
            .map(|fd| unsafe { std::os::fd::BorrowedFd::borrow_raw(fd) })
    }
}

impl UringHalf<'_> {
    /// The stream this half is of.
    pub fn stream(&self) -> &UringStream {
        self.0
    }
}

impl Drop for UringStream {
    fn drop(&mut self) {
        let here = with(|d| {
            if d.id != self.ring {
                return false;
            }
            d.release(self.slot, self.gen);
            true
        });
        if here != Some(true) {
            forward_drop(self.ring, self.slot, self.gen);
        }
    }
}

/// A stream dropped away from its ring's thread: its ring's reaper
/// releases it. A ring that is gone (its thread ended) closed it already.
fn forward_drop(ring: u32, slot: u32, gen: u32) {
    let inbox = inboxes()
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .iter()
        .find(|(id, _)| *id == ring)
        .map(|(_, i)| i.clone());
    if let Some(inbox) = inbox {
        inbox
            .drops
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push((slot, gen));
        inbox.pending.store(true, Ordering::Release);
        if let Some(w) = inbox.reaper.get() {
            w.wake_by_ref();
        }
    }
}

impl Driver {
    /// The streams of this ring dropped on other threads.
    fn release_foreign(&mut self) {
        let drops =
            std::mem::take(&mut *self.inbox.drops.lock().unwrap_or_else(|e| e.into_inner()));
        for (slot, gen) in drops {
            self.release(slot, gen);
        }
    }

    /// A stream of slot `slot` (generation `gen`) is dropped: its recv is
    /// cancelled, and its queued bytes go out (for at most [`LINGER`])
    /// before the slot is freed.
    fn release(&mut self, slot: u32, gen: u32) {
        let i = slot as usize;
        if !self.slots.get(i).is_some_and(|s| s.gen == gen && s.owned) {
            return;
        }
        let s = &mut self.slots[i];
        s.owned = false;
        s.rwaker = None;
        s.wwaker = None;
        s.rbuf = Vec::new();
        s.rpos = 0;
        let (gen, sending) = (s.gen, s.unsent() > 0 && s.err.is_none());
        self.cancel_recv(i);
        if self.slots[i].polling {
            let e = opcode::AsyncCancel::new(user_data(i as u32, gen, OP_POLL))
                .build()
                .user_data(user_data(i as u32, gen, OP_CANCEL));
            // SAFETY: refers to no memory; the target is found by its user data.
            unsafe { self.push(&e) }
        }
        if sending {
            // Entries whose streams are done (their slot freed or reused)
            // go from the front, so the list holds about the streams
            // still sending, not every close of the last LINGER.
            while let Some(&(slot, gen, _)) = self.lingering.front() {
                let s = &self.slots[slot as usize];
                if s.gen == gen && !s.owned && s.fd >= 0 {
                    break;
                }
                self.lingering.pop_front();
            }
            self.lingering
                .push_back((i as u32, gen, tokio::time::Instant::now() + LINGER));
            if self.lingering.len() == 1 {
                if let Some(w) = &self.reaper {
                    w.wake_by_ref();
                }
            }
        }
        self.maybe_free(i);
    }
}

impl AsyncRead for UringStream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        self.poll_read_priv(cx, buf)
    }
}

impl AsyncWrite for UringStream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        self.poll_write_priv(cx, &[io::IoSlice::new(buf)])
    }
    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        self.poll_write_priv(cx, bufs)
    }
    fn is_write_vectored(&self) -> bool {
        true
    }
    fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.poll_flush_priv()
    }
    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.poll_shutdown_priv(cx)
    }
}

/// A half of a [`UringStream`]: the state is the driver's, so both halves
/// are shared references.
pub struct UringHalf<'a>(&'a UringStream);

impl AsyncRead for UringHalf<'_> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        self.0.poll_read_priv(cx, buf)
    }
}

impl AsyncWrite for UringHalf<'_> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        self.0.poll_write_priv(cx, &[io::IoSlice::new(buf)])
    }
    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        self.0.poll_write_priv(cx, bufs)
    }
    fn is_write_vectored(&self) -> bool {
        true
    }
    fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.0.poll_flush_priv()
    }
    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.0.poll_shutdown_priv(cx)
    }
}

impl UringStream {
    /// Both directions at once.
    pub fn split(&mut self) -> (UringHalf<'_>, UringHalf<'_>) {
        (UringHalf(self), UringHalf(self))
    }
    /// Ready when a read would make progress (bytes, end of stream or an
    /// error), without a buffer.
    pub fn poll_readable(&self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.poll_readable_priv(cx)
    }
    /// Whether the connection opens with `want` (an h2c listener's test
    /// for HTTP/2's preface): waits for as many bytes as it takes to tell,
    /// consumes none. False when they differ or the stream ends first.
    pub async fn starts_with(&self, want: &[u8]) -> io::Result<bool> {
        std::future::poll_fn(|cx| {
            self.slot(|d, i| {
                let s = &mut d.slots[i];
                let have = &s.rbuf[s.rpos..];
                let n = have.len().min(want.len());
                if have[..n] != want[..n] {
                    return Poll::Ready(Ok(false));
                }
                if n == want.len() {
                    return Poll::Ready(Ok(true));
                }
                if let Some(e) = s.err {
                    return Poll::Ready(Err(io::Error::from_raw_os_error(e)));
                }
                if s.eof {
                    return Poll::Ready(Ok(false));
                }
                // A prefix so far: wait for the next bytes.
                if !s.rwaker.as_ref().is_some_and(|w| w.will_wake(cx.waker())) {
                    s.rwaker = Some(cx.waker().clone());
                }
                if !s.recv_armed {
                    d.arm_recv(i);
                }
                Poll::Pending
            })
            .unwrap_or_else(|| Poll::Ready(Err(Self::gone())))
        })
        .await
    }

    /// The next byte a read would return, left unread; None at the end of
    /// the stream (what a one-byte `MSG_PEEK` tells: a TLS listener looks
    /// at it to tell a handshake from plain HTTP).
    pub async fn peek_first(&self) -> io::Result<Option<u8>> {
        std::future::poll_fn(|cx| self.poll_readable_priv(cx)).await?;
        self.slot(|d, i| {
            let s = &d.slots[i];
            match s.err {
                _ if s.unread() > 0 => Ok(Some(s.rbuf[s.rpos])),
                Some(e) => Err(io::Error::from_raw_os_error(e)),
                None => Ok(None),
            }
        })
        .unwrap_or_else(|| Err(Self::gone()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    thread_local! {
        /// The next this many submits of this thread's ring fail (ENOMEM).
        pub(super) static FAIL_SUBMITS: std::cell::Cell<u32> = const { std::cell::Cell::new(0) };
    }

    fn local<F: std::future::Future>(f: F) -> F::Output {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        tokio::task::LocalSet::new().block_on(&rt, f)
    }

    async fn pair() -> (UringStream, tokio::net::TcpStream) {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let c = tokio::net::TcpStream::connect(l.local_addr().unwrap())
            .await
            .unwrap();
        let (s, _) = l.accept().await.unwrap();
        (UringStream::new(s).unwrap(), c)
    }

    fn supported() -> bool {
        match init() {
            Ok(()) => true,
            Err(e) => {
                eprintln!("io_uring unavailable here ({e}); skipped");
                false
            }
        }
    }

    #[test]
    fn kernel_releases() {
        assert!(kernel_at_least("6.18.44-fc-v1300\n", (6, 0)));
        assert!(kernel_at_least("6.0.0", (6, 0)));
        assert!(kernel_at_least("10.1", (6, 0)));
        assert!(!kernel_at_least("5.19.17-generic", (6, 0)));
        assert!(!kernel_at_least("", (6, 0)));
        assert!(!kernel_at_least("garbage", (6, 0)));
    }

    #[test]
    fn echo_both_ways_and_eof() {
        local(async {
            if !supported() {
                return;
            }
            let (mut s, mut c) = pair().await;
            c.write_all(b"hello").await.unwrap();
            let mut buf = [0u8; 16];
            let n = s.read(&mut buf).await.unwrap();
            assert_eq!(&buf[..n], b"hello");
            s.write_all(b"world").await.unwrap();
            s.flush().await.unwrap();
            let mut got = [0u8; 5];
            c.read_exact(&mut got).await.unwrap();
            assert_eq!(&got, b"world");
            drop(c);
            assert_eq!(s.read(&mut buf).await.unwrap(), 0);
        });
    }

    /// Many megabytes both ways at once through one stream: the read pause
    /// (READ_MAX) and the write wait (WRITE_MAX) both engage, and no byte
    /// is lost or reordered.
    #[test]
    fn large_transfers_with_backpressure() {
        local(async {
            if !supported() {
                return;
            }
            let (mut s, mut c) = pair().await;
            const N: usize = 8 << 20;
            let data: Vec<u8> = (0..N).map(|i| (i * 31 % 251) as u8).collect();
            let up = data.clone();
            let writer = tokio::task::spawn_local(async move {
                let (mut cr, mut cw) = c.split();
                let send = async {
                    for chunk in up.chunks(100_000) {
                        cw.write_all(chunk).await.unwrap();
                    }
                    cw.shutdown().await.unwrap();
                };
                let mut back = Vec::new();
                let recv = cr.read_to_end(&mut back);
                let ((), r) = tokio::join!(send, recv);
                r.unwrap();
                back
            });
            // Echo with a slow start, so the client's bytes pile up first.
            tokio::time::sleep(Duration::from_millis(50)).await;
            let (mut r, mut w) = s.split();
            let mut buf = vec![0u8; 65536];
            loop {
                let n = r.read(&mut buf).await.unwrap();
                if n == 0 {
                    break;
                }
                w.write_all(&buf[..n]).await.unwrap();
            }
            w.shutdown().await.unwrap();
            let back = writer.await.unwrap();
            assert_eq!(back.len(), N);
            assert!(back == data);
        });
    }

    /// A dropped stream's queued bytes still reach the peer, then its FIN;
    /// the slot is reused by the next connection.
    #[test]
    fn drop_flushes_then_frees() {
        local(async {
            if !supported() {
                return;
            }
            let (mut s, mut c) = pair().await;
            let body = vec![7u8; 300_000];
            s.write_all(&body[..200_000]).await.unwrap();
            drop(s);
            let mut got = Vec::new();
            c.read_to_end(&mut got).await.unwrap();
            assert_eq!(got.len(), 200_000);
            // The slot goes back once its last completion is in.
            let freed = async {
                while with(|d| d.free.len()).unwrap_or(0) == 0 {
                    tokio::task::yield_now().await;
                }
            };
            tokio::time::timeout(Duration::from_secs(10), freed)
                .await
                .unwrap();
            let (s2, _c2) = pair().await;
            assert_eq!(s2.slot, 0);
        });
    }

    /// Submits that fail (as a kernel out of memory makes them) are tried
    /// again after a pause, never in a loop that holds the worker: other
    /// tasks run meanwhile, the stream's bytes go through once submits
    /// work again, and a ring that keeps failing takes no new connections.
    #[test]
    fn failing_submits_are_retried_without_spinning() {
        local(async {
            if !supported() {
                return;
            }
            let (mut s, mut c) = pair().await;
            // A few failures: the echo is only late.
            FAIL_SUBMITS.with(|f| f.set(5));
            s.write_all(b"late").await.unwrap();
            let ticks = std::rc::Rc::new(std::cell::Cell::new(0u32));
            let t = ticks.clone();
            let ticker = tokio::task::spawn_local(async move {
                loop {
                    t.set(t.get() + 1);
                    tokio::task::yield_now().await;
                }
            });
            let mut got = [0u8; 4];
            tokio::time::timeout(Duration::from_secs(20), c.read_exact(&mut got))
                .await
                .unwrap()
                .unwrap();
            assert_eq!(&got, b"late");
            assert!(ticks.get() > 0, "the worker's other tasks ran");
            assert!(ready(), "five failures leave the ring in use");
            // Failing for good: new connections go to epoll, and the
            // worker's other tasks go on running.
            FAIL_SUBMITS.with(|f| f.set(u32::MAX));
            s.write_all(b"never").await.unwrap();
            let before = ticks.get();
            let failing = async {
                while ready() {
                    tokio::task::yield_now().await;
                }
            };
            tokio::time::timeout(Duration::from_secs(60), failing)
                .await
                .unwrap();
            assert!(ticks.get() > before);
            // Each failed submit was followed by a pause: a spin would have
            // tried thousands of times.
            let tries = u32::MAX - FAIL_SUBMITS.with(|f| f.get());
            assert!(tries <= 2 * SUBMIT_FAILURES_MAX, "{tries} submits tried");
            // Recovered: the queued bytes go out, and new connections may
            // use the ring again.
            FAIL_SUBMITS.with(|f| f.set(0));
            let mut got = [0u8; 5];
            tokio::time::timeout(Duration::from_secs(20), c.read_exact(&mut got))
                .await
                .unwrap()
                .unwrap();
            assert_eq!(&got, b"never");
            assert!(ready());
            ticker.abort();
        });
    }

    /// Each stream dropped while sending is in the linger list; those that
    /// finished leave it as later ones come, so closing many connections
    /// does not grow it by one entry each for LINGER.
    #[test]
    fn finished_lingerers_leave_the_list() {
        local(async {
            if !supported() {
                return;
            }
            for _ in 0..50 {
                let (mut s, mut c) = pair().await;
                s.write_all(&[1u8; 100_000]).await.unwrap();
                drop(s);
                let mut got = Vec::new();
                c.read_to_end(&mut got).await.unwrap();
                assert_eq!(got.len(), 100_000);
            }
            let len = with(|d| d.lingering.len()).unwrap();
            assert!(len <= 2, "{len} entries left");
        });
    }

    #[test]
    fn peek_first_leaves_the_byte() {
        local(async {
            if !supported() {
                return;
            }
            let (mut s, mut c) = pair().await;
            c.write_all(b"\x16abc").await.unwrap();
            assert_eq!(s.peek_first().await.unwrap(), Some(0x16));
            assert_eq!(s.peek_first().await.unwrap(), Some(0x16));
            let mut buf = [0u8; 4];
            s.read_exact(&mut buf).await.unwrap();
            assert_eq!(&buf, b"\x16abc");
            drop(c);
            assert_eq!(s.peek_first().await.unwrap(), None);
        });
    }

    /// A stream taken to another thread fails there as a gone connection,
    /// and its drop there is carried out by its own ring: the bytes it had
    /// queued arrive, then the peer sees the end, and the slot is free.
    #[test]
    fn a_stream_dropped_on_another_thread_is_released_by_its_ring() {
        local(async {
            if !supported() {
                return;
            }
            let (mut s, mut c) = pair().await;
            assert!(s.is_here() && s.looks_alive());
            s.write_all(b"before").await.unwrap();
            let slot = s.slot as usize;
            let elsewhere = std::thread::spawn(move || {
                let failed = local(async {
                    assert!(!s.is_here() && !s.looks_alive());
                    let mut buf = [0u8; 4];
                    let e = s.read(&mut buf).await.unwrap_err();
                    assert_eq!(e.kind(), io::ErrorKind::NotConnected);
                    s.write_all(b"x").await.is_err()
                });
                drop(s);
                failed
            });
            assert!(
                elsewhere.join().unwrap(),
                "a write on another thread must fail"
            );
            let mut got = Vec::new();
            pier_test_timeout(c.read_to_end(&mut got)).await.unwrap();
            assert_eq!(got, b"before");
            // The end came with the close, which frees the slot.
            assert!(with(|d| d.free.contains(&(slot as u32))).unwrap());
        });
    }

    async fn pier_test_timeout<F: std::future::Future>(f: F) -> F::Output {
        tokio::time::timeout(Duration::from_secs(30), f)
            .await
            .expect("timed out")
    }

    /// A reader that never quite catches up (it always leaves a few bytes
    /// unread while more arrive) holds about what is unread, not every
    /// byte that came.
    #[test]
    fn a_reader_behind_does_not_keep_what_it_read() {
        local(async {
            if !supported() {
                return;
            }
            let (mut s, mut c) = pair().await;
            const TOTAL: usize = 32 << 20;
            let writer = tokio::task::spawn_local(async move {
                let chunk = vec![7u8; 64 * 1024];
                for _ in 0..TOTAL / chunk.len() {
                    c.write_all(&chunk).await.unwrap();
                }
                c
            });
            let (mut got, mut most) = (0, 0);
            let mut buf = vec![0u8; 1000];
            while got < TOTAL {
                // Read all but the last few bytes that are in, then let
                // more arrive: the buffer is never drained.
                let unread = s.slot(|d, i| d.slots[i].unread()).unwrap();
                if unread <= 50 && got + unread < TOTAL {
                    tokio::task::yield_now().await;
                    continue;
                }
                let want = if got + unread == TOTAL {
                    unread
                } else {
                    unread - 50
                };
                let want = want.min(buf.len());
                let n = pier_test_timeout(s.read(&mut buf[..want])).await.unwrap();
                assert!(n > 0, "early end after {got} bytes");
                got += n;
                let cap = s.slot(|d, i| d.slots[i].rbuf.capacity()).unwrap();
                most = most.max(cap);
            }
            let _c = writer.await.unwrap();
            // Unread bytes pass READ_MAX by at most one turn's completions
            // (every provided buffer, 2 MiB) before the recv pauses; the
            // buffer doubles past that. Without the compaction it is all 32.
            assert!(most <= 8 << 20, "the read buffer grew to {most} bytes");
        });
    }

    /// `starts_with` waits for a prefix to become the whole, tells a
    /// mismatch at its first byte, consumes nothing, and says false at an
    /// end before the whole.
    #[test]
    fn starts_with_waits_for_enough_bytes_and_consumes_none() {
        local(async {
            if !supported() {
                return;
            }
            const PRI: &[u8] = b"PRI * HTTP/2.0";
            let (mut s, mut c) = pair().await;
            c.write_all(b"PRI * H").await.unwrap();
            {
                let mut waiting = std::pin::pin!(s.starts_with(PRI));
                // Give the ring a few turns: a prefix alone does not decide.
                for _ in 0..20 {
                    let mut cx = Context::from_waker(std::task::Waker::noop());
                    assert!(waiting.as_mut().poll(&mut cx).is_pending());
                    tokio::task::yield_now().await;
                }
                c.write_all(b"TTP/2.0\r\n").await.unwrap();
                assert!(waiting.await.unwrap());
            }
            let mut b = [0u8; 16];
            s.read_exact(&mut b).await.unwrap();
            assert_eq!(&b, b"PRI * HTTP/2.0\r\n");

            let (s, mut c) = pair().await;
            c.write_all(b"GET / HTTP/1.1\r\n").await.unwrap();
            assert!(!s.starts_with(PRI).await.unwrap());
            let (s, mut c) = pair().await;
            c.write_all(b"PRI").await.unwrap();
            drop(c);
            assert!(!s.starts_with(PRI).await.unwrap());
        });
    }

    fn provided() -> u16 {
        with(|d| d.bufs.provided).unwrap()
    }

    /// The ring starts with BUF_STEP provided buffers and adds more only
    /// when a batch of receives runs out of them; no byte is lost when one
    /// does (the receive is armed again).
    #[test]
    fn the_buffer_ring_grows_only_when_a_batch_runs_out() {
        local(async {
            if !supported() {
                return;
            }
            // Light use: request and answer, one connection at a time.
            for _ in 0..(BUF_STEP as usize * 3) {
                let (mut s, mut c) = pair().await;
                c.write_all(b"ping").await.unwrap();
                let mut b = [0u8; 4];
                s.read_exact(&mut b).await.unwrap();
                assert_eq!(&b, b"ping");
            }
            assert_eq!(provided(), BUF_STEP, "light use needed no more");
            // 200 connections with 8 KiB each, all arriving before the
            // ring's reaper runs: 400 buffers wanted at once.
            let mut pairs = Vec::new();
            for _ in 0..200 {
                pairs.push(pair().await);
            }
            for (i, (_, c)) in pairs.iter_mut().enumerate() {
                c.write_all(&[i as u8; 8192]).await.unwrap();
            }
            for (i, (s, _)) in pairs.iter_mut().enumerate() {
                let mut got = vec![0u8; 8192];
                s.read_exact(&mut got).await.unwrap();
                assert!(got.iter().all(|&b| b == i as u8), "connection {i}");
            }
            let n = provided();
            assert!(n > BUF_STEP && n <= BUF_COUNT, "{n} buffers provided");
        });
    }

    /// Buffers a connection gives back go to the ring's spares (bounded),
    /// and its next messages, both ways, land in them rather than in fresh
    /// allocations.
    #[test]
    fn given_back_buffers_are_reused() {
        local(async {
            if !supported() {
                return;
            }
            let (mut s, mut c) = pair().await;
            let spares = || with(|d| d.spares.0.iter().map(|v| v.as_ptr()).collect::<Vec<_>>());
            let mut got = vec![0u8; 6000];
            for round in 0..3 {
                let before = spares().unwrap();
                // An answer larger than KEEP_CAP, each way.
                c.write_all(&[7u8; 6000]).await.unwrap();
                std::future::poll_fn(|cx| s.poll_readable(cx))
                    .await
                    .unwrap();
                let rbuf = s.slot(|d, i| d.slots[i].rbuf.as_ptr()).unwrap();
                s.read_exact(&mut got).await.unwrap();
                assert!(got.iter().all(|&b| b == 7));
                s.write_all(&[8u8; 6000]).await.unwrap();
                let wbuf = s
                    .slot(|d, i| (d.slots[i].sending.as_ptr(), d.slots[i].queue.as_ptr()))
                    .unwrap();
                c.read_exact(&mut got).await.unwrap();
                std::future::poll_fn(|cx| s.poll_drained(cx)).await.unwrap();
                let mut cx = Context::from_waker(std::task::Waker::noop());
                assert!(s.poll_readable(&mut cx).is_pending());
                let after = spares().unwrap();
                assert!((1..=SPARE_MAX).contains(&after.len()), "{after:?}");
                if round > 0 {
                    assert!(before.contains(&rbuf), "round {round}: a fresh read buffer");
                    assert!(
                        before.contains(&wbuf.0) || before.contains(&wbuf.1),
                        "round {round}: a fresh write buffer"
                    );
                    assert_eq!(after.len(), before.len(), "round {round}: spares piled up");
                }
            }
            // Never more than SPARE_MAX, nor one past SPARE_CAP.
            with(|d| {
                for _ in 0..SPARE_MAX * 2 {
                    d.spares.keep(Vec::with_capacity(4096));
                }
                d.spares.keep(Vec::with_capacity(SPARE_CAP * 2));
                assert_eq!(d.spares.0.len(), SPARE_MAX);
                assert!(d.spares.0.iter().all(|v| v.capacity() <= SPARE_CAP));
            });
        });
    }

    /// A connection waiting for its peer keeps no buffer past IDLE_CAP.
    #[test]
    fn a_waiting_connection_gives_its_buffers_back() {
        local(async {
            if !supported() {
                return;
            }
            let (mut s, mut c) = pair().await;
            c.write_all(&[1u8; 3000]).await.unwrap();
            let mut got = vec![0u8; 3000];
            s.read_exact(&mut got).await.unwrap();
            s.write_all(&[2u8; 3000]).await.unwrap();
            c.read_exact(&mut got).await.unwrap();
            // Its SEND's completion handed out.
            std::future::poll_fn(|cx| s.poll_drained(cx)).await.unwrap();
            let caps = |s: &UringStream| {
                s.slot(|d, i| {
                    let t = &d.slots[i];
                    (t.rbuf.capacity(), t.sending.capacity(), t.queue.capacity())
                })
                .unwrap()
            };
            let (r, w1, w2) = caps(&s);
            assert!(r > IDLE_CAP && w1.max(w2) > IDLE_CAP, "{r} {w1} {w2}");
            // Wait for the next bytes: nothing unread or unsent.
            let waker = std::task::Waker::noop();
            let mut cx = Context::from_waker(waker);
            assert!(s.poll_readable(&mut cx).is_pending());
            let (r, w1, w2) = caps(&s);
            assert_eq!((r, w1, w2), (0, 0, 0), "IDLE_CAP is none");
            // And it still works.
            c.write_all(b"more").await.unwrap();
            let mut b = [0u8; 4];
            s.read_exact(&mut b).await.unwrap();
            assert_eq!(&b, b"more");
        });
    }
}
