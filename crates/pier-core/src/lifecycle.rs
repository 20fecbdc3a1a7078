//! A server's life: the accept loop, draining, and reload announcements.
//! What a connection *is* (HTTP/1, later TLS and HTTP/2) and whether it may
//! come in (connection caps, eviction) is the caller's, through [`Admission`].

use std::net::SocketAddr;
use std::time::Duration;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

/// Drain and reload signals, shared by every worker.
pub struct Lifecycle {
    drain_tx: watch::Sender<bool>,
    reload_tx: watch::Sender<u64>,
    handed_over: std::sync::atomic::AtomicBool,
}

impl Lifecycle {
    pub fn new(generation: u64) -> Self {
        Lifecycle {
            drain_tx: watch::channel(false).0,
            reload_tx: watch::channel(generation).0,
            handed_over: Default::default(),
        }
    }
    pub fn drain_rx(&self) -> watch::Receiver<bool> {
        self.drain_tx.subscribe()
    }
    /// Stop accepting; idle connections close, in-flight requests finish.
    pub fn start_drain(&self) {
        self.drain_tx.send_replace(true);
    }
    /// A binary upgrade: the listening sockets now belong to the new
    /// process too. Drains as [`Self::start_drain`]; what shares a socket
    /// by reading it (QUIC's UDP) must stop reading at once, or the two
    /// processes would take each other's packets.
    pub fn hand_over(&self) {
        self.handed_over
            .store(true, std::sync::atomic::Ordering::SeqCst);
        self.start_drain();
    }
    pub fn handed_over(&self) -> bool {
        self.handed_over.load(std::sync::atomic::Ordering::SeqCst)
    }
    pub fn draining(&self) -> bool {
        *self.drain_tx.borrow()
    }
    /// Config generations as they are installed.
    pub fn reloads(&self) -> watch::Receiver<u64> {
        self.reload_tx.subscribe()
    }
    pub fn announce_reload(&self, generation: u64) {
        self.reload_tx.send_replace(generation);
    }
}

/// What [`Admission::admit`] decided.
pub enum Admitted<S> {
    Yes(S),
    No,
    /// Ask again in this many milliseconds (only when `may_wait`).
    Wait(u64),
}

/// Who gets in, and what serves them.
pub trait Admission {
    /// Held for the connection's life (its slot in every cap).
    type Slot: 'static;
    /// Take a slot for a connection from `peer`, or refuse it (the socket is
    /// closed at once). With `may_wait`, a full server whose waiting
    /// connections are all too young to evict answers `Wait(ms)`: the accept
    /// loop holds this one socket that long (the next ones stay in the
    /// kernel's backlog, as nginx leaves them when it stops accepting) and
    /// asks again with `may_wait = false`. A client arriving in the middle of
    /// a burst then gets in a few ms late instead of being refused.
    fn admit(&self, peer: SocketAddr, may_wait: bool) -> Admitted<Self::Slot>;
    /// Serve an admitted connection (spawn its task).
    fn serve(&self, stream: TcpStream, peer: SocketAddr, slot: Self::Slot);
}

/// Accept until draining. In a burst, the connections just accepted get to
/// read their heads before more are accepted (a client that speaks at once
/// is then past its head wait, not evictable, before the burst can evict
/// it); accept errors (EMFILE and friends) back off instead of spinning.
pub async fn accept_loop<A: Admission>(
    listener: TcpListener,
    mut drain: watch::Receiver<bool>,
    admission: A,
) {
    let mut accepts = 0u32;
    loop {
        accepts = accepts.wrapping_add(1);
        if accepts & 15 == 0 {
            tokio::task::yield_now().await;
        }
        let accepted = tokio::select! {
            a = listener.accept() => a,
            _ = drain.changed() => break,
        };
        let (stream, peer) = match accepted {
            Ok(x) => x,
            Err(e) => {
                tracing::warn!("accept: {e}");
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        let slot = match admission.admit(peer, true) {
            Admitted::Yes(slot) => Some(slot),
            Admitted::No => None,
            Admitted::Wait(ms) => {
                tokio::select! {
                    _ = tokio::time::sleep(Duration::from_millis(ms)) => {}
                    _ = drain.changed() => break,
                }
                match admission.admit(peer, false) {
                    Admitted::Yes(slot) => Some(slot),
                    _ => None,
                }
            }
        };
        if let Some(slot) = slot {
            admission.serve(stream, peer, slot);
        }
        if *drain.borrow() {
            break;
        }
    }
}
