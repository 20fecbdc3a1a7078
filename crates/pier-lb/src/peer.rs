//! One upstream server and its shared, lock-free state.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

/// Keeps a counter every core writes on its own cache line, so those
/// writes do not invalidate the read-mostly fields next to it.
#[derive(Debug, Default)]
#[repr(align(64))]
pub(crate) struct CachePadded<T>(pub(crate) T);

impl<T> std::ops::Deref for CachePadded<T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.0
    }
}

/// The TLS server name (SNI, and the name verified) for a server: the
/// upstream's configured `server_name`, else the server's host name, else
/// its address (verified against the certificate's IP SANs; rustls sends no
/// SNI for an IP). Requests and health checks both ask here.
pub fn tls_server_name(
    configured: Option<&Arc<str>>,
    host: Option<&Arc<str>>,
    addr: SocketAddr,
) -> Arc<str> {
    configured
        .or(host)
        .cloned()
        .unwrap_or_else(|| Arc::from(addr.ip().to_string()))
}

/// An upstream server of a [`crate::Group`].
///
/// Every field that changes at run time is an atomic: all worker threads
/// read and update the same `Peer` without a lock.
#[derive(Debug)]
pub struct Peer {
    pub addr: SocketAddr,
    /// The host name `addr` was resolved from (None for an IP literal): the
    /// SNI and the Host sent to this peer.
    pub host: Option<Arc<str>>,
    /// Configured weight, at least 1 (a 0 in the config is treated as 1).
    pub weight: u32,
    /// Up/down as seen by the balancer (active checks and passive failures).
    pub(crate) healthy: AtomicBool,
    /// Requests currently in flight to this peer (see [`ActiveGuard`]).
    /// Padded: written by every request, while `healthy` is read by every
    /// selection.
    pub(crate) active: CachePadded<AtomicUsize>,
    /// Consecutive failed attempts reported by the proxy (passive health).
    pub(crate) consecutive_fails: AtomicU32,
    /// Passive recovery without an active check: the clock_ms time after
    /// which one probe request may be let through to a down peer.
    pub(crate) retry_at_ms: AtomicU64,
    /// A probe request has been let through and its outcome is awaited.
    pub(crate) probing: AtomicBool,
    /// Failed attempts since start (metrics).
    pub(crate) fails_total: AtomicU64,
}

impl Peer {
    pub(crate) fn new(addr: SocketAddr, weight: u32, host: Option<Arc<str>>) -> Peer {
        Peer {
            addr,
            host,
            weight: weight.max(1),
            healthy: AtomicBool::new(true),
            active: CachePadded(AtomicUsize::new(0)),
            consecutive_fails: AtomicU32::new(0),
            retry_at_ms: AtomicU64::new(0),
            probing: AtomicBool::new(false),
            fails_total: AtomicU64::new(0),
        }
    }

    pub fn is_healthy(&self) -> bool {
        self.healthy.load(Ordering::Acquire)
    }

    /// Requests in flight to this peer.
    pub fn active(&self) -> usize {
        self.active.load(Ordering::Relaxed)
    }

    /// Consecutive failures reported through [`crate::Group::report`].
    pub fn consecutive_fails(&self) -> u32 {
        self.consecutive_fails.load(Ordering::Relaxed)
    }

    /// Failed attempts reported since start.
    pub fn fails_total(&self) -> u64 {
        self.fails_total.load(Ordering::Relaxed)
    }

    /// Force the health state (admin API, drains, tests). Returns the
    /// previous state. A peer forced down gets no passive-recovery probe;
    /// an active checker keeps running and brings it back after `rise`
    /// good checks.
    pub fn set_healthy(&self, up: bool) -> bool {
        self.probing.store(false, Ordering::Relaxed);
        if up {
            self.consecutive_fails.store(0, Ordering::Relaxed);
        } else {
            self.retry_at_ms.store(u64::MAX, Ordering::Release);
        }
        self.healthy.swap(up, Ordering::AcqRel)
    }
}

/// RAII in-flight marker: counts one request on a peer until dropped.
///
/// Holds an `Arc<Peer>` (a reference-count increment, not an allocation) so
/// it can live across `.await` points without borrowing the group.
#[derive(Debug)]
pub struct ActiveGuard {
    peer: Arc<Peer>,
    idx: usize,
}

impl ActiveGuard {
    pub(crate) fn new(peer: Arc<Peer>, idx: usize) -> ActiveGuard {
        peer.active.fetch_add(1, Ordering::Relaxed);
        ActiveGuard { peer, idx }
    }

    /// Count one more request on `peer` unless that would pass `max`
    /// (`0` = no cap); exact under concurrency (compare-and-swap).
    pub(crate) fn try_new(peer: Arc<Peer>, idx: usize, max: usize) -> Option<ActiveGuard> {
        if max == 0 {
            return Some(ActiveGuard::new(peer, idx));
        }
        peer.active
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| {
                (n < max).then_some(n + 1)
            })
            .ok()?;
        Some(ActiveGuard { peer, idx })
    }

    pub fn peer(&self) -> &Arc<Peer> {
        &self.peer
    }

    /// The peer's index in its group.
    pub fn idx(&self) -> usize {
        self.idx
    }
}

impl Drop for ActiveGuard {
    fn drop(&mut self) {
        self.peer.active.fetch_sub(1, Ordering::Relaxed);
    }
}
