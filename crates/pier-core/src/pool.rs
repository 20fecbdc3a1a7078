//! The upstream connection pool, shared by every worker thread.
//!
//! Each worker has its own map from origin address to a LIFO stack of idle
//! connections, under its own (almost never contended) lock. A worker takes from its own stack first (the socket is registered
//! with its own reactor, so reuse costs no cross-thread wake-ups); only when
//! its stack is empty does it take one from another worker's stack, moving the
//! socket to its own reactor (two `epoll_ctl`s) — sharing without the
//! per-worker collapse nginx suffers (the Pingora lesson: 87% → 99.9% reuse).
//!
//! `max_idle_per_server` bounds a server's idle connections over all workers
//! together: each server has one shared counter, so the bound costs one
//! atomic add per put, like the total count beside it.
//!
//! Connections on a worker's io_uring are never taken by another worker (a
//! ring's stream works only on its thread), nor are TLS ones (their
//! reactor registration cannot move): with rings on, each worker reuses
//! its own, and `max_idle_per_server` still bounds them all together.
//!
//! Idle connections are checked without a syscall before reuse: an idle
//! HTTP/1.1 connection has nothing to read, so any read readiness (data or
//! EOF) the reactor recorded means the origin closed or misbehaved.

use crate::stream::{Conn, PeerKey};
use parking_lot::Mutex;
use std::collections::HashMap;

/// The pool's maps are looked up twice a request (take and put): foldhash,
/// not SipHash (which cost ~1,200 instructions a request here). Keys are the
/// configured origins, not chosen by clients, so flooding is not a concern;
/// private keys (a PROXY header per client connection) are, but they share
/// their server's `max_idle_per_server`, so there are never more of them.
type Map<V> = HashMap<PeerKey, V, foldhash::fast::RandomState>;
use std::pin::pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::sync::Arc;
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};
use tokio::io::Interest;
use tokio::net::TcpStream;

#[derive(Debug, Clone, Copy)]
pub struct PoolConfig {
    pub workers: usize,
    /// Idle connections kept per origin address (all workers together).
    pub max_idle_per_server: usize,
    pub idle_timeout: Duration,
}

struct Idle {
    stream: Conn,
    since: Instant,
}

/// One worker's idle connections. Only its owner puts into it; others lock it
/// only to steal when their own is empty, so the lock is almost never contended.
#[repr(align(128))]
#[derive(Default)]
struct WorkerStacks {
    map: Mutex<Map<Stack>>,
}

/// A worker's idle connections to one origin, and the count of idle
/// connections to that origin over all workers (one counter per origin,
/// shared by the workers' stacks), which `max_idle_per_server` bounds.
struct Stack {
    idle: Vec<Idle>,
    count: Arc<AtomicUsize>,
}

pub struct Pool {
    workers: Vec<WorkerStacks>,
    /// Idle connections per origin, all workers together.
    max_idle: AtomicUsize,
    idle_timeout_ms: AtomicU64,
    idle_total: AtomicUsize,
    /// The per-origin counters; locked only when a worker's map first meets
    /// an origin (or meets it again after a sweep emptied its stack).
    counts: Mutex<Map<Arc<AtomicUsize>>>,
}

impl Pool {
    pub fn new(cfg: PoolConfig) -> Self {
        let n = cfg.workers.max(1);
        let p = Pool {
            workers: (0..n).map(|_| WorkerStacks::default()).collect(),
            max_idle: AtomicUsize::new(0),
            idle_timeout_ms: AtomicU64::new(0),
            idle_total: AtomicUsize::new(0),
            counts: Mutex::new(Map::default()),
        };
        p.reconfigure(cfg.max_idle_per_server, cfg.idle_timeout);
        p
    }

    /// Config reloads may change the bounds.
    pub fn reconfigure(&self, max_idle_per_server: usize, idle_timeout: Duration) {
        self.max_idle.store(max_idle_per_server, Relaxed);
        self.idle_timeout_ms
            .store(idle_timeout.as_millis() as u64, Relaxed);
    }

    pub fn idle_count(&self) -> usize {
        self.idle_total.load(Relaxed)
    }

    fn timeout(&self) -> Duration {
        Duration::from_millis(self.idle_timeout_ms.load(Relaxed))
    }

    /// An idle connection for `key`, if one is alive. `worker` is the calling
    /// worker's index.
    pub fn take(&self, key: &PeerKey, worker: usize) -> Option<Conn> {
        let idle_timeout = self.timeout();
        let me = worker % self.workers.len();
        // Own stack first (LIFO: the hottest connection), then steal.
        // TLS connections stay with the worker that made them (see
        // `Conn::adopt`), so only cleartext ones are stolen.
        let steal = if key.sni.is_none() {
            self.workers.len()
        } else {
            0
        };
        let order = std::iter::once(me).chain((0..steal).filter(move |&w| w != me));
        for w in order {
            loop {
                let idle = {
                    let mut map = self.workers[w].map.lock();
                    let Some(stack) = map.get_mut(key) else {
                        break;
                    };
                    // Another worker's ring connections stay with it.
                    if w != me && stack.idle.last().is_some_and(|i| !i.stream.movable()) {
                        break;
                    }
                    let idle = match stack.idle.pop() {
                        Some(i) => {
                            stack.count.fetch_sub(1, Relaxed);
                            i
                        }
                        None => break,
                    };
                    // A client's private stack goes with its last connection
                    // (shared ones stay for the next put, until a sweep).
                    if key.proxy.is_some() && stack.idle.is_empty() {
                        map.remove(key);
                    }
                    idle
                };
                self.idle_total.fetch_sub(1, Relaxed);
                // The worker's last clock read: a connection may look up to
                // one request's processing older than it is, never younger.
                if pier_clock::recent().saturating_duration_since(idle.since) > idle_timeout {
                    continue; // dropped: expired
                }
                if w != me {
                    if let Some(s) = idle.stream.adopt() {
                        return Some(s);
                    }
                } else if idle.stream.looks_alive() {
                    return Some(idle.stream);
                }
            }
        }
        None
    }

    /// Return a connection that finished a response cleanly.
    pub fn put(&self, key: &PeerKey, worker: usize, stream: Conn) {
        let max = self.max_idle.load(Relaxed);
        if max == 0 {
            return;
        }
        let mut homeless = None;
        let evicted = {
            let mut map = self.workers[worker % self.workers.len()].map.lock();
            if !map.contains_key(key) {
                // A private connection (`send_proxy_protocol`: its key names
                // one client connection) counts against its server's budget,
                // not a budget of its own: keys chosen by clients must not
                // multiply the bound.
                let budget = PeerKey {
                    proxy: None,
                    ..key.clone()
                };
                let count = self.counts.lock().entry(budget).or_default().clone();
                map.insert(
                    key.clone(),
                    Stack {
                        idle: Vec::new(),
                        count,
                    },
                );
            }
            let full = map
                .get(key)
                .is_some_and(|s| s.idle.is_empty() && s.count.load(Relaxed) >= max);
            if full && key.proxy.is_some() {
                // The budget full of other clients' private connections:
                // this worker's oldest of them gives way, so clients gone
                // since do not hold the budget until `idle_timeout`.
                // Only one under the same budget (same server, TLS name
                // and ALPN): the swap leaves the shared count as it is.
                let budget = map.get(key).map(|s| s.count.clone());
                let victim = map
                    .iter()
                    .filter(|(k, s)| {
                        k.proxy.is_some()
                            && *k != key
                            && !s.idle.is_empty()
                            && budget.as_ref().is_some_and(|b| Arc::ptr_eq(b, &s.count))
                    })
                    .min_by_key(|(_, s)| s.idle[0].since)
                    .map(|(k, _)| k.clone());
                if let Some(v) = victim {
                    let old = map.get_mut(&v).map(|s| s.idle.remove(0));
                    if let Some(s) = map.get_mut(key) {
                        s.idle.push(Idle {
                            stream,
                            since: pier_clock::recent(),
                        });
                    }
                    map.retain(|_, s| !s.idle.is_empty());
                    drop(map);
                    drop(old); // closed outside the lock
                    return;
                }
            }
            let Some(stack) = map.get_mut(key) else {
                return;
            };
            if stack.count.fetch_add(1, Relaxed) < max {
                self.idle_total.fetch_add(1, Relaxed);
                stack.idle.push(Idle {
                    stream,
                    since: pier_clock::recent(),
                });
                None
            } else {
                // Full over all workers: keep the hot one in place of our
                // oldest; with none of ours to give up, close it, unless
                // it is one no other worker could take (on our ring, or
                // TLS): then another worker's oldest gives way, or a worker
                // whose stack stays empty would open one a request.
                stack.count.fetch_sub(1, Relaxed);
                if stack.idle.is_empty() && !stream.movable() && key.proxy.is_none() {
                    homeless = Some(stream);
                    None
                } else if stack.idle.is_empty() {
                    Some(stream)
                } else {
                    let oldest = stack.idle.remove(0);
                    stack.idle.push(Idle {
                        stream,
                        since: pier_clock::recent(),
                    });
                    Some(oldest.stream)
                }
            }
        };
        drop(evicted); // closed outside the lock
        if let Some(stream) = homeless {
            let me = worker % self.workers.len();
            let oldest = (0..self.workers.len()).filter(|&w| w != me).find_map(|w| {
                let mut map = self.workers[w].map.lock();
                let stack = map.get_mut(key).filter(|s| !s.idle.is_empty())?;
                Some((stack.idle.remove(0), stack.count.clone()))
            });
            // Its place in the count is ours now.
            let Some((oldest, count)) = oldest else {
                return; // closed
            };
            let mut map = self.workers[me].map.lock();
            let stack = map.entry(key.clone()).or_insert_with(|| Stack {
                idle: Vec::new(),
                count,
            });
            stack.idle.push(Idle {
                stream,
                since: pier_clock::recent(),
            });
            drop(map);
            drop(oldest); // closed outside the locks (by its own worker)
        }
    }

    /// Drop expired idle connections (called periodically).
    pub fn sweep(&self) {
        let idle_timeout = self.timeout();
        let mut dropped = Vec::new();
        for w in &self.workers {
            let mut map = w.map.lock();
            for stack in map.values_mut() {
                // Oldest first: stop at the first one still fresh.
                let n = stack
                    .idle
                    .iter()
                    .take_while(|i| i.since.elapsed() > idle_timeout)
                    .count();
                stack.count.fetch_sub(n, Relaxed);
                dropped.extend(stack.idle.drain(..n));
            }
            map.retain(|_, s| !s.idle.is_empty());
        }
        // Counters no worker's stack refers to any more: origins met once
        // (e.g. picked by a Lua balancer) must not grow the map for ever.
        self.counts.lock().retain(|_, c| Arc::strong_count(c) > 1);
        self.idle_total.fetch_sub(dropped.len(), Relaxed);
        drop(dropped);
    }
}

/// No read readiness recorded by the reactor → nothing arrived, not even EOF.
pub(crate) fn tcp_looks_alive(s: &TcpStream) -> bool {
    let mut cx = Context::from_waker(Waker::noop());
    let fut = pin!(s.ready(Interest::READABLE));
    match fut.poll(&mut cx) {
        Poll::Pending => true,
        Poll::Ready(Ok(r)) => !(r.is_readable() || r.is_read_closed() || r.is_error()),
        Poll::Ready(Err(_)) => false,
    }
}

/// Move a socket registered with another worker's reactor to ours, checking
/// with a non-blocking peek that the origin has not closed it.
pub(crate) fn tcp_adopt(s: TcpStream) -> Option<TcpStream> {
    let std = s.into_std().ok()?;
    let mut b = [0u8; 1];
    match std.peek(&mut b) {
        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => TcpStream::from_std(std).ok(),
        _ => None, // EOF, stray bytes or error
    }
}

use std::future::Future as _;

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncWriteExt;

    fn rt() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
    }

    /// A listener on port 0 standing for the origin, and a pool.
    async fn setup(
        workers: usize,
        max_idle_per_server: usize,
        idle_timeout: Duration,
    ) -> (tokio::net::TcpListener, std::net::SocketAddr, Pool) {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let pool = Pool::new(PoolConfig {
            workers,
            max_idle_per_server,
            idle_timeout,
        });
        (l, addr, pool)
    }

    #[test]
    fn reuse_and_staleness() {
        rt().block_on(async {
            let (l, addr, pool) = setup(2, 2, Duration::from_secs(5)).await;
            let key = PeerKey::plain(addr);
            let c1 = TcpStream::connect(addr).await.unwrap();
            let (mut s1, _) = l.accept().await.unwrap();
            pool.put(&key, 0, Conn::Tcp(c1));
            assert_eq!(pool.idle_count(), 1);
            let c = pool.take(&key, 0).expect("alive connection reused");
            pool.put(&key, 1, c);
            // Another worker's stack is used when ours is empty.
            let c = pool.take(&key, 0).expect("stolen from worker 1");
            pool.put(&key, 0, c);
            // Origin closes: the pool must not hand it out.
            s1.shutdown().await.unwrap();
            drop(s1);
            tokio::time::sleep(Duration::from_millis(50)).await;
            assert!(pool.take(&key, 0).is_none());
            assert_eq!(pool.idle_count(), 0);
        });
    }

    /// Connections on a worker's io_uring stay with it: another worker
    /// with none idle does not take them, and when the bound is full its
    /// own hot connection takes the place of another worker's oldest.
    #[test]
    fn ring_connections_stay_with_their_worker() {
        let rt = rt();
        tokio::task::LocalSet::new().block_on(&rt, async {
            if let Err(e) = pier_uring::init() {
                eprintln!("io_uring unavailable here ({e}); skipped");
                return;
            }
            let (l, addr, pool) = setup(2, 1, Duration::from_secs(5)).await;
            let key = PeerKey::plain(addr);
            let mut origin = Vec::new();
            let mut ring_conn = async || {
                let c = TcpStream::connect(addr).await.unwrap();
                origin.push(l.accept().await.unwrap().0);
                Conn::Uring(pier_uring::UringStream::new(c).unwrap())
            };
            let c0 = ring_conn().await;
            pool.put(&key, 0, c0);
            // Worker 1 has none idle and does not take worker 0's.
            assert!(pool.take(&key, 1).is_none());
            assert_eq!(pool.idle_count(), 1, "worker 0's connection was dropped");
            // Full: worker 1's connection takes the place of worker 0's.
            let c1 = ring_conn().await;
            pool.put(&key, 1, c1);
            assert_eq!(pool.idle_count(), 1);
            assert!(pool.take(&key, 0).is_none(), "worker 0's gave way");
            assert!(pool.take(&key, 1).is_some(), "worker 1's is kept");
            // The one that gave way was closed.
            let mut b = [0u8; 1];
            let n = tokio::time::timeout(
                Duration::from_secs(30),
                tokio::io::AsyncReadExt::read(&mut origin[0], &mut b),
            )
            .await
            .unwrap()
            .unwrap();
            assert_eq!(n, 0);
        });
    }

    #[test]
    fn bound_is_per_server_over_all_workers() {
        rt().block_on(async {
            let (l, addr, pool) = setup(2, 1, Duration::from_secs(5)).await;
            let key = PeerKey::plain(addr);
            let mut keep = Vec::new();
            for w in 0..2 {
                let c = TcpStream::connect(addr).await.unwrap();
                keep.push(l.accept().await.unwrap().0);
                pool.put(&key, w, Conn::Tcp(c));
            }
            assert_eq!(pool.idle_count(), 1, "worker 1's put went past the bound");
            // Taking one frees the slot for any worker.
            let c = pool.take(&key, 1).expect("worker 0's connection, stolen");
            pool.put(&key, 1, c);
            assert_eq!(pool.idle_count(), 1);
        });
    }

    #[test]
    fn private_connections_share_their_servers_bound() {
        rt().block_on(async {
            let (l, addr, pool) = setup(1, 2, Duration::from_secs(5)).await;
            let private = |client: u8| PeerKey {
                proxy: Some(Arc::from(vec![client; 16])),
                ..PeerKey::plain(addr)
            };
            let mut keep = Vec::new();
            // Ten clients, one connection each: two kept, the newest.
            for client in 0..10u8 {
                let c = TcpStream::connect(addr).await.unwrap();
                keep.push(l.accept().await.unwrap().0);
                // Each put stamped after the last (as a worker's clock read
                // per request does).
                std::thread::sleep(Duration::from_millis(1));
                pier_clock::now();
                pool.put(&private(client), 0, Conn::Tcp(c));
                assert!(pool.idle_count() <= 2, "client {client}: over the bound");
            }
            assert_eq!(pool.idle_count(), 2);
            assert!(pool.take(&private(0), 0).is_none(), "the oldest gave way");
            assert!(pool.take(&private(9), 0).is_some(), "the newest kept");
            assert!(pool.take(&private(8), 0).is_some());
            assert_eq!(pool.idle_count(), 0);
            assert_eq!(
                pool.workers[0].map.lock().len(),
                0,
                "no stack per gone client"
            );
            // A client's own connection is its own only.
            let c = TcpStream::connect(addr).await.unwrap();
            keep.push(l.accept().await.unwrap().0);
            pool.put(&private(1), 0, Conn::Tcp(c));
            assert!(pool.take(&private(2), 0).is_none());
            assert!(pool.take(&PeerKey::plain(addr), 0).is_none());
            assert!(pool.take(&private(1), 0).is_some());
        });
    }

    #[test]
    fn bounded_and_expiring() {
        rt().block_on(async {
            let (l, addr, pool) = setup(1, 2, Duration::from_millis(30)).await;
            let key = PeerKey::plain(addr);
            let mut keep = Vec::new();
            for _ in 0..3 {
                let c = TcpStream::connect(addr).await.unwrap();
                keep.push(l.accept().await.unwrap().0);
                pool.put(&key, 0, Conn::Tcp(c));
            }
            assert_eq!(pool.idle_count(), 2);
            tokio::time::sleep(Duration::from_millis(60)).await;
            pool.sweep();
            assert_eq!(pool.idle_count(), 0);
            assert!(pool.counts.lock().is_empty(), "per-origin counters pruned");
        });
    }
}
