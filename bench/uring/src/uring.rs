//! The io_uring mode: one ring per worker thread, driven by one loop.
//!
//! - a multishot accept on the worker's SO_REUSEPORT listener;
//! - a multishot recv on every client and origin connection, selecting buffers from a
//!   provided-buffer ring (IORING_REGISTER_PBUF_RING): no buffer is tied to an idle
//!   connection, and an idle pooled origin connection that the origin closes is noticed
//!   (its recv completes with 0) without a syscall;
//! - sends and connects as SQEs;
//! - batched submission: every SQE the completions of one batch produce goes to the
//!   kernel in the next `submit_and_wait(1)`, one io_uring_enter for the lot;
//! - the ring is set up with SINGLE_ISSUER | DEFER_TASKRUN (and COOP_TASKRUN), falling
//!   back to a plain ring on kernels without them.
//!
//! The state machine does what `epoll.rs` does: read a request head, check it, forward
//! it over a pooled origin connection (a new one if none is idle; a pooled one that
//! fails before any response byte is retried once on a new one), read the response
//! framed by Content-Length, write it back, and go on with the next request.
//!
//! Lifetimes: a connection's slot (its buffers and its fd number) is freed only when no
//! operation of it is in flight (`inflight == 0`), so every pointer given to the kernel
//! stays valid until the operation's completion arrives.

use std::io;
use std::net::{SocketAddr, TcpListener};
use std::os::fd::{AsRawFd, IntoRawFd, RawFd};
use std::sync::atomic::{AtomicU16, Ordering};

use io_uring::{cqueue, opcode, squeue, types, IoUring};

use crate::http;

const RING_ENTRIES: u32 = 4096;
const BUF_GROUP: u16 = 0;
/// Provided buffers: a power of two, at most 32768.
const BUF_COUNT: u16 = 4096;
const BUF_SIZE: usize = 8192;
/// Idle origin connections kept per worker.
const MAX_IDLE: usize = 1024;
/// A client that sends more than this without us reading it (pipelining while its
/// previous response is in progress) is disconnected.
const MAX_BUFFERED: usize = 1024 * 1024;

const OP_ACCEPT: u64 = 1;
const OP_RECV: u64 = 2;
const OP_SEND: u64 = 3;
const OP_CONNECT: u64 = 4;
const OP_CANCEL: u64 = 5;

fn user_data(slot: usize, gen: u32, op: u64) -> u64 {
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
        // SAFETY: ptr/len are the mapping made in `new`; nothing refers to it any more
        // (the ring that used it is dropped first, see `Worker`'s field order).
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

/// The provided-buffer ring: BUF_COUNT buffers of BUF_SIZE bytes the kernel picks from
/// for every multishot recv, given back by us as soon as their bytes are copied out.
struct BufRing {
    ring: Mapping,
    bufs: Mapping,
    tail: u16,
}

impl BufRing {
    fn new(uring: &IoUring) -> io::Result<Self> {
        let ring = Mapping::new(BUF_COUNT as usize * std::mem::size_of::<types::BufRingEntry>())?;
        let bufs = Mapping::new(BUF_COUNT as usize * BUF_SIZE)?;
        // SAFETY: `ring` holds BUF_COUNT entries, is page aligned, and lives as long as
        // `Worker::bufs`, which is dropped after `Worker::ring` (the io_uring instance
        // that unregisters it).
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
        };
        for bid in 0..BUF_COUNT {
            br.give_back(bid);
        }
        Ok(br)
    }

    /// Hands buffer `bid` (back) to the kernel.
    fn give_back(&mut self, bid: u16) {
        let entries = self.ring.ptr.cast::<types::BufRingEntry>();
        // SAFETY: the index is masked into the ring's BUF_COUNT entries; the entry at the
        // tail is not one the kernel reads until the tail is published below; `bid` is
        // below BUF_COUNT, so the address is inside `bufs`, which outlives the ring.
        unsafe {
            let e = &mut *entries.add((self.tail & (BUF_COUNT - 1)) as usize);
            e.set_addr(self.bufs.ptr.add(bid as usize * BUF_SIZE) as u64);
            e.set_len(BUF_SIZE as u32);
            e.set_bid(bid);
        }
        self.tail = self.tail.wrapping_add(1);
        // SAFETY: the tail field sits in the first entry of the mapped ring (the
        // io_uring_buf_ring layout); the kernel reads it with acquire ordering.
        unsafe {
            let tail = types::BufRingEntry::tail(entries).cast::<AtomicU16>();
            (*tail).store(self.tail, Ordering::Release);
        }
    }

    /// The first `len` bytes of buffer `bid`, which a recv completion handed us.
    fn bytes(&self, bid: u16, len: usize) -> &[u8] {
        assert!(bid < BUF_COUNT && len <= BUF_SIZE);
        // SAFETY: in bounds (asserted); the kernel wrote these bytes before posting the
        // completion and writes nothing more there until `give_back(bid)`.
        unsafe { std::slice::from_raw_parts(self.bufs.ptr.add(bid as usize * BUF_SIZE), len) }
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Role {
    Client,
    Origin,
}

struct Conn {
    fd: RawFd,
    gen: u32,
    role: Role,
    /// The fd is closed; the slot waits for its operations in flight to complete.
    closed: bool,
    /// Operations in flight (an armed multishot recv counts as one).
    inflight: u32,
    recv_armed: bool,
    sending: bool,
    /// Bytes received and not yet consumed.
    rbuf: Vec<u8>,
    /// Bytes being sent (from `wpos` on). For an origin connection: the request head,
    /// kept until the response is complete so that it can be retried.
    wbuf: Vec<u8>,
    wpos: usize,
    /// The connection at the other end of the exchange in progress: (slot, gen).
    peer: Option<(usize, u32)>,
    // Client connections.
    /// A request is in progress (being forwarded, or its response being written).
    busy: bool,
    close_after: bool,
    // Origin connections.
    connected: bool,
    /// It has carried a response before (so it may have gone stale in the pool).
    reused: bool,
    /// The request it carries is already a retry.
    retry: bool,
    in_pool: bool,
}

impl Conn {
    fn new(fd: RawFd, role: Role, gen: u32) -> Conn {
        Conn {
            fd,
            gen,
            role,
            closed: false,
            inflight: 0,
            recv_armed: false,
            sending: false,
            rbuf: Vec::new(),
            wbuf: Vec::new(),
            wpos: 0,
            peer: None,
            busy: false,
            close_after: false,
            connected: false,
            reused: false,
            retry: false,
            in_pool: false,
        }
    }
}

/// `plain`: a ring without SINGLE_ISSUER | DEFER_TASKRUN | COOP_TASKRUN (completions
/// are then run as task work whenever the kernel gets to it, as with tokio-uring's or
/// monoio's default rings), for comparison.
pub fn run(listener: TcpListener, origin: SocketAddr, plain: bool) -> io::Result<()> {
    let ring = if plain {
        IoUring::builder().setup_submit_all().build(RING_ENTRIES)?
    } else {
        IoUring::builder()
            .setup_single_issuer()
            .setup_defer_taskrun()
            .setup_coop_taskrun()
            .setup_submit_all()
            .build(RING_ENTRIES)
            .or_else(|_| IoUring::new(RING_ENTRIES))?
    };
    let bufs = BufRing::new(&ring)?;
    let mut w = Worker {
        ring,
        bufs,
        conns: Vec::new(),
        free: Vec::new(),
        pool: Vec::new(),
        listener,
        origin: Box::new(socket2::SockAddr::from(origin)),
        cqes: Vec::with_capacity(RING_ENTRIES as usize * 2),
    };
    w.arm_accept()?;
    w.run()
}

struct Worker {
    // Dropped before `bufs`: the ring unregisters the buffer ring it points to.
    ring: IoUring,
    bufs: BufRing,
    conns: Vec<Conn>,
    free: Vec<usize>,
    pool: Vec<(usize, u32)>,
    listener: TcpListener,
    /// The origin's address, boxed: connect SQEs point at it for the worker's lifetime.
    origin: Box<socket2::SockAddr>,
    cqes: Vec<(u64, i32, u32)>,
}

impl Worker {
    /// Queues an SQE; submits the queue first when it is full.
    ///
    /// # Safety
    /// Every buffer, address and fd the entry refers to must stay valid until its
    /// completion arrives.
    unsafe fn push(&mut self, e: &squeue::Entry) -> io::Result<()> {
        loop {
            // SAFETY: the caller's contract, passed on.
            if unsafe { self.ring.submission().push(e) }.is_ok() {
                return Ok(());
            }
            self.ring.submit()?;
        }
    }

    fn arm_accept(&mut self) -> io::Result<()> {
        let e = opcode::AcceptMulti::new(types::Fd(self.listener.as_raw_fd()))
            .flags(libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC)
            .build()
            .user_data(user_data(0, 0, OP_ACCEPT));
        // SAFETY: the listener is owned by the worker and open as long as the ring
        // exists; no buffer is involved.
        unsafe { self.push(&e) }
    }

    fn run(&mut self) -> io::Result<()> {
        loop {
            match self.ring.submit_and_wait(1) {
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if e.raw_os_error() == Some(libc::EBUSY) => {}
                Err(e) => return Err(e),
            }
            let mut cqes = std::mem::take(&mut self.cqes);
            cqes.extend(
                self.ring
                    .completion()
                    .map(|c| (c.user_data(), c.result(), c.flags())),
            );
            for &(ud, res, flags) in &cqes {
                self.complete(ud, res, flags)?;
            }
            cqes.clear();
            self.cqes = cqes;
        }
    }

    fn complete(&mut self, ud: u64, res: i32, flags: u32) -> io::Result<()> {
        let (slot, gen, op) = decode(ud);
        match op {
            OP_ACCEPT => return self.on_accept(res, flags),
            OP_CANCEL => return Ok(()),
            _ => {}
        }
        if self.conns.get(slot).is_none_or(|c| c.gen != gen) {
            // Cannot happen (slots outlive their operations); ignore rather than crash.
            if let Some(bid) = cqueue::buffer_select(flags) {
                self.bufs.give_back(bid);
            }
            return Ok(());
        }
        match op {
            OP_RECV => self.on_recv(slot, res, flags),
            OP_SEND => self.on_send(slot, res),
            OP_CONNECT => self.on_connect(slot, res),
            _ => Ok(()),
        }
    }

    fn alloc(&mut self, fd: RawFd, role: Role) -> usize {
        if let Some(slot) = self.free.pop() {
            let c = &mut self.conns[slot];
            let (rbuf, wbuf) = (std::mem::take(&mut c.rbuf), std::mem::take(&mut c.wbuf));
            *c = Conn {
                rbuf,
                wbuf,
                ..Conn::new(fd, role, c.gen.wrapping_add(1))
            };
            slot
        } else {
            self.conns.push(Conn::new(fd, role, 0));
            self.conns.len() - 1
        }
    }

    fn maybe_free(&mut self, slot: usize) {
        let c = &mut self.conns[slot];
        if c.closed && c.inflight == 0 {
            c.rbuf.clear();
            c.wbuf.clear();
            c.fd = -1;
            c.inflight = u32::MAX; // marks the slot free until `alloc`
            self.free.push(slot);
        }
    }

    fn on_accept(&mut self, res: i32, flags: u32) -> io::Result<()> {
        if !cqueue::more(flags) {
            self.arm_accept()?;
        }
        if res < 0 {
            return Ok(()); // EMFILE and the like: the connection waits in the backlog
        }
        let fd = res;
        set_nodelay(fd);
        let slot = self.alloc(fd, Role::Client);
        self.arm_recv(slot)
    }

    fn arm_recv(&mut self, slot: usize) -> io::Result<()> {
        let c = &mut self.conns[slot];
        let e = opcode::RecvMulti::new(types::Fd(c.fd), BUF_GROUP)
            .build()
            .user_data(user_data(slot, c.gen, OP_RECV));
        c.inflight += 1;
        c.recv_armed = true;
        // SAFETY: the fd stays open until `close`, which cancels this recv; its buffers
        // come from the provided-buffer ring, which lives as long as the ring.
        unsafe { self.push(&e) }
    }

    fn on_recv(&mut self, slot: usize, res: i32, flags: u32) -> io::Result<()> {
        let more = cqueue::more(flags);
        let c = &mut self.conns[slot];
        if !more {
            c.recv_armed = false;
            c.inflight -= 1;
        }
        if let Some(bid) = cqueue::buffer_select(flags) {
            if res > 0 && !c.closed {
                c.rbuf.extend_from_slice(self.bufs.bytes(bid, res as usize));
            }
            self.bufs.give_back(bid);
        }
        if c.closed {
            self.maybe_free(slot);
            return Ok(());
        }
        let role = c.role;
        if res == -libc::ENOBUFS || (res > 0 && !more) {
            // Out of provided buffers for a moment, or the kernel ended the multishot.
            self.arm_recv(slot)?;
            if res < 0 {
                return Ok(());
            }
        }
        if res <= 0 {
            // End of stream or an error.
            return match role {
                Role::Client => self.close(slot),
                Role::Origin => self.origin_failed(slot),
            };
        }
        let c = &self.conns[slot];
        match role {
            Role::Client => {
                if c.rbuf.len() > MAX_BUFFERED {
                    self.close(slot)
                } else if c.busy {
                    Ok(())
                } else {
                    self.next_request(slot)
                }
            }
            Role::Origin => self.on_origin_data(slot),
        }
    }

    fn start_send(&mut self, slot: usize) -> io::Result<()> {
        let c = &mut self.conns[slot];
        debug_assert!(!c.sending && c.wpos < c.wbuf.len());
        let rest = &c.wbuf[c.wpos..];
        let e = opcode::Send::new(types::Fd(c.fd), rest.as_ptr(), rest.len() as u32)
            .flags(libc::MSG_NOSIGNAL)
            .build()
            .user_data(user_data(slot, c.gen, OP_SEND));
        c.inflight += 1;
        c.sending = true;
        // SAFETY: `wbuf` is neither written, reallocated nor freed while `sending` (every
        // writer checks it or runs only when no send is in flight), and the slot, which
        // owns it, is not freed while `inflight > 0`.
        unsafe { self.push(&e) }
    }

    fn on_send(&mut self, slot: usize, res: i32) -> io::Result<()> {
        let c = &mut self.conns[slot];
        c.inflight -= 1;
        c.sending = false;
        if c.closed {
            self.maybe_free(slot);
            return Ok(());
        }
        if res < 0 {
            return match c.role {
                Role::Client => self.close(slot),
                Role::Origin => self.origin_failed(slot),
            };
        }
        c.wpos += res as usize;
        if c.wpos < c.wbuf.len() {
            return self.start_send(slot); // a short write: the rest
        }
        if c.role == Role::Origin {
            return Ok(()); // the request is out; the response comes by recv
        }
        c.wbuf.clear();
        c.wpos = 0;
        if c.close_after {
            return self.close(slot);
        }
        c.busy = false;
        self.next_request(slot) // a pipelined request may be waiting
    }

    /// A client that is not busy: starts its next request if its head is complete.
    fn next_request(&mut self, slot: usize) -> io::Result<()> {
        let c = &mut self.conns[slot];
        let Some(end) = http::head_end(&c.rbuf) else {
            if c.rbuf.len() > http::MAX_HEAD {
                return self.respond_and_close(slot, http::RESP_400);
            }
            return Ok(());
        };
        let Ok(req) = http::parse_request(&c.rbuf[..end]) else {
            return self.respond_and_close(slot, http::RESP_400);
        };
        c.busy = true;
        c.close_after = req.close;
        let cgen = c.gen;
        let Some(up) = self.origin_conn(false)? else {
            return self.respond_and_close(slot, http::RESP_502);
        };
        let (cl, u) = two(&mut self.conns, slot, up);
        u.wbuf.clear();
        u.wbuf.extend_from_slice(&cl.rbuf[..end]);
        u.wpos = 0;
        cl.rbuf.drain(..end);
        cl.peer = Some((up, u.gen));
        u.peer = Some((slot, cgen));
        if u.connected {
            self.start_send(up)?;
        }
        Ok(())
    }

    /// A pooled origin connection, or a new one (connecting); a retry always takes a
    /// new one. None: no socket.
    fn origin_conn(&mut self, retry: bool) -> io::Result<Option<usize>> {
        while let Some((slot, gen)) = if retry { None } else { self.pool.pop() } {
            let c = &mut self.conns[slot];
            if c.gen == gen && c.in_pool && !c.closed {
                c.in_pool = false;
                c.retry = retry;
                return Ok(Some(slot));
            }
        }
        use socket2::{Domain, Socket, Type};
        let Ok(s) = Socket::new(
            Domain::for_address(self.origin.as_socket().expect("an IP address")),
            Type::STREAM.nonblocking().cloexec(),
            None,
        ) else {
            return Ok(None);
        };
        let _ = s.set_nodelay(true);
        let fd = s.into_raw_fd();
        let slot = self.alloc(fd, Role::Origin);
        let c = &mut self.conns[slot];
        c.retry = retry;
        c.inflight += 1;
        let e = opcode::Connect::new(
            types::Fd(fd),
            self.origin.as_ptr().cast(),
            self.origin.len(),
        )
        .build()
        .user_data(user_data(slot, c.gen, OP_CONNECT));
        // SAFETY: the address is boxed in the worker and never changes or moves; the fd
        // stays open until `close`, and the slot is not freed while the connect is in
        // flight.
        unsafe { self.push(&e)? };
        Ok(Some(slot))
    }

    fn on_connect(&mut self, slot: usize, res: i32) -> io::Result<()> {
        let c = &mut self.conns[slot];
        c.inflight -= 1;
        if c.closed {
            self.maybe_free(slot);
            return Ok(());
        }
        if res < 0 {
            return self.origin_failed(slot);
        }
        c.connected = true;
        self.arm_recv(slot)?;
        if self.conns[slot].peer.is_some() && !self.conns[slot].wbuf.is_empty() {
            self.start_send(slot)?;
        }
        Ok(())
    }

    fn on_origin_data(&mut self, slot: usize) -> io::Result<()> {
        let u = &self.conns[slot];
        let Some((cslot, _)) = u.peer else {
            // Bytes on an idle connection: it is out of step; drop it.
            return self.close(slot);
        };
        let Some(h) = http::head_end(&u.rbuf) else {
            if u.rbuf.len() > http::MAX_HEAD {
                return self.origin_failed(slot);
            }
            return Ok(());
        };
        let Ok(r) = http::parse_response(&u.rbuf, h) else {
            return self.origin_failed(slot);
        };
        if u.rbuf.len() < r.total {
            return Ok(());
        }
        // The whole response: hand it to the client, the connection to the pool.
        let reusable = r.reusable && u.rbuf.len() == r.total && !u.sending;
        let (cl, u) = two(&mut self.conns, cslot, slot);
        debug_assert!(!cl.sending && cl.wbuf.is_empty());
        std::mem::swap(&mut cl.wbuf, &mut u.rbuf);
        cl.wbuf.truncate(r.total);
        cl.wpos = 0;
        cl.peer = None;
        u.rbuf.clear();
        u.peer = None;
        u.reused = true;
        u.retry = false;
        if !u.sending {
            u.wbuf.clear();
            u.wpos = 0;
        }
        if reusable && self.pool.len() < MAX_IDLE {
            u.in_pool = true;
            self.pool.push((slot, u.gen));
        } else {
            self.close(slot)?;
        }
        self.start_send(cslot)
    }

    /// The origin connection failed (end of stream, error, refused connect): close it;
    /// its client, if any, gets a retry on a new connection (a stale pooled connection
    /// that never answered) or a 502.
    fn origin_failed(&mut self, slot: usize) -> io::Result<()> {
        let u = &mut self.conns[slot];
        let peer = u.peer.take();
        let can_retry = u.reused && u.rbuf.is_empty() && !u.retry;
        let head = if can_retry && peer.is_some() {
            u.wbuf.clone()
        } else {
            Vec::new()
        };
        self.close(slot)?;
        let Some((cslot, cgen)) = peer else {
            return Ok(());
        };
        self.conns[cslot].peer = None;
        if can_retry {
            if let Some(up) = self.origin_conn(true)? {
                let (cl, u) = two(&mut self.conns, cslot, up);
                u.wbuf = head;
                u.wpos = 0;
                cl.peer = Some((up, u.gen));
                u.peer = Some((cslot, cgen));
                if u.connected {
                    self.start_send(up)?;
                }
                return Ok(());
            }
        }
        self.respond_and_close(cslot, http::RESP_502)
    }

    fn respond_and_close(&mut self, slot: usize, msg: &[u8]) -> io::Result<()> {
        let c = &mut self.conns[slot];
        debug_assert!(!c.sending);
        c.wbuf.clear();
        c.wbuf.extend_from_slice(msg);
        c.wpos = 0;
        c.busy = true;
        c.close_after = true;
        self.start_send(slot)
    }

    /// Closes the fd and cancels the recv; the slot is freed once nothing of it is in
    /// flight. A client's origin connection in the middle of its exchange goes too.
    fn close(&mut self, slot: usize) -> io::Result<()> {
        let c = &mut self.conns[slot];
        if c.closed {
            return Ok(());
        }
        c.closed = true;
        c.in_pool = false;
        let (fd, gen, armed, role, peer) = (c.fd, c.gen, c.recv_armed, c.role, c.peer.take());
        // SAFETY: our own fd, closed once (`closed` guards it). Operations in flight hold
        // their own reference to the socket, so they complete (the recv is cancelled
        // below), and their buffers live in the slot, which is kept until they have.
        unsafe { libc::close(fd) };
        if armed {
            let e = opcode::AsyncCancel::new(user_data(slot, gen, OP_RECV))
                .build()
                .user_data(user_data(slot, gen, OP_CANCEL));
            // SAFETY: a cancel refers to no memory, only to the recv's user data.
            unsafe { self.push(&e)? };
        }
        if let (Role::Client, Some((uslot, ugen))) = (role, peer) {
            if self.conns[uslot].gen == ugen {
                self.conns[uslot].peer = None;
                self.close(uslot)?;
            }
        }
        self.maybe_free(slot);
        Ok(())
    }
}

/// Two distinct connections, mutably.
fn two(conns: &mut [Conn], a: usize, b: usize) -> (&mut Conn, &mut Conn) {
    assert_ne!(a, b);
    if a < b {
        let (x, y) = conns.split_at_mut(b);
        (&mut x[a], &mut y[0])
    } else {
        let (x, y) = conns.split_at_mut(a);
        (&mut y[0], &mut x[b])
    }
}

fn set_nodelay(fd: RawFd) {
    let one: libc::c_int = 1;
    // SAFETY: a valid fd we own and a pointer to a c_int on the stack for the call.
    unsafe {
        libc::setsockopt(
            fd,
            libc::IPPROTO_TCP,
            libc::TCP_NODELAY,
            (&one as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        );
    }
}
