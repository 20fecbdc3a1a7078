//! Worker threads and their listeners.

use socket2::{Domain, Protocol, Socket, Type};
use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::thread::JoinHandle;

/// What a worker thread gets: its index and its own accept sockets.
pub struct WorkerContext {
    pub id: usize,
    pub listeners: Vec<(String, std::net::TcpListener)>,
    /// UDP sockets (HTTP/3), by listener name, on the TCP listener's port.
    pub udp: Vec<(String, std::net::UdpSocket)>,
}

/// Bind a UDP socket with `SO_REUSEPORT` (one per worker on one address:
/// the kernel steers each client's datagrams, by address, to one of them).
pub fn bind_udp_reuseport(addr: SocketAddr) -> io::Result<std::net::UdpSocket> {
    let s = Socket::new(Domain::for_address(addr), Type::DGRAM, Some(Protocol::UDP))?;
    s.set_reuse_address(true)?;
    s.set_reuse_port(true)?;
    s.set_nonblocking(true)?;
    s.bind(&addr.into())?;
    Ok(s.into())
}

/// `workers` UDP sockets per address (each already resolved: the port of
/// the TCP listener it serves beside). `inherit` gives the sockets a
/// binary upgrade handed over for a listener (see [`bind_all`]).
pub fn bind_udp_all(
    workers: usize,
    addrs: &[(String, SocketAddr)],
    inherit: &mut dyn FnMut(&str, SocketAddr) -> Vec<std::net::UdpSocket>,
) -> io::Result<Vec<Vec<(String, std::net::UdpSocket)>>> {
    let mut per_worker: Vec<Vec<(String, std::net::UdpSocket)>> =
        (0..workers).map(|_| Vec::new()).collect();
    for (name, addr) in addrs {
        let got = inherit(name, *addr);
        let have = got.len();
        for (i, s) in got.into_iter().enumerate() {
            s.set_nonblocking(true)?;
            per_worker[i % workers].push((name.clone(), s));
        }
        for w in per_worker.iter_mut().skip(have) {
            let s = bind_udp_reuseport(*addr).map_err(|e| {
                io::Error::new(
                    e.kind(),
                    format!("cannot listen on udp {addr} (listener {name}, http3): {e}"),
                )
            })?;
            w.push((name.clone(), s));
        }
    }
    Ok(per_worker)
}

/// Bind a non-blocking listening socket with `SO_REUSEPORT`, so each worker
/// can have its own accept queue on the same address (the kernel spreads
/// connections; no thundering herd, no shared accept lock).
pub fn bind_reuseport(addr: SocketAddr, backlog: i32) -> io::Result<std::net::TcpListener> {
    let s = Socket::new(Domain::for_address(addr), Type::STREAM, Some(Protocol::TCP))?;
    s.set_reuse_address(true)?;
    s.set_reuse_port(true)?;
    s.set_nodelay(true)?;
    s.set_nonblocking(true)?;
    s.bind(&addr.into())?;
    s.listen(backlog)?;
    Ok(s.into())
}

/// Bind `workers` sockets per listener (port 0 is resolved by the first and
/// reused by the rest). Returns per-worker socket sets and the bound addresses.
///
/// `inherit` gives, for a listener, the accept sockets the process this one
/// replaces handed over (a binary upgrade; empty otherwise). They are used
/// as they are, shared round robin when this process has fewer workers, and
/// joined by new ones in the same reuseport group when it has more: the
/// queues of the handed-over sockets are never closed, so no connection
/// waiting in one is lost.
#[allow(clippy::type_complexity)]
pub fn bind_all(
    workers: usize,
    listeners: &[(String, SocketAddr)],
    inherit: &mut dyn FnMut(&str, SocketAddr) -> Vec<std::net::TcpListener>,
) -> io::Result<(
    Vec<Vec<(String, std::net::TcpListener)>>,
    Vec<(String, SocketAddr)>,
)> {
    let mut per_worker: Vec<Vec<(String, std::net::TcpListener)>> =
        (0..workers).map(|_| Vec::new()).collect();
    let mut bound = Vec::new();
    for (name, addr) in listeners {
        let got = inherit(name, *addr);
        let have = got.len();
        let real = match got.first() {
            Some(l) => l.local_addr()?,
            None => {
                let first = bind_reuseport(*addr, 4096).map_err(|e| {
                    io::Error::new(
                        e.kind(),
                        format!("cannot listen on {addr} (listener {name}): {e}"),
                    )
                })?;
                let real = first.local_addr()?;
                per_worker[0].push((name.clone(), first));
                real
            }
        };
        for (i, l) in got.into_iter().enumerate() {
            l.set_nonblocking(true)?;
            per_worker[i % workers].push((name.clone(), l));
        }
        bound.push((name.clone(), real));
        for w in per_worker.iter_mut().skip(have.max(1)) {
            w.push((name.clone(), bind_reuseport(real, 4096)?));
        }
    }
    Ok((per_worker, bound))
}

/// Start one thread per worker, each running `make(ctx)` to completion on
/// its own current-thread runtime inside a `LocalSet` (so `!Send` futures,
/// such as Lua coroutines, can be spawned with `spawn_local`).
pub fn spawn_workers<F, Fut>(
    sockets: Vec<Vec<(String, std::net::TcpListener)>>,
    mut udp: Vec<Vec<(String, std::net::UdpSocket)>>,
    make: F,
) -> io::Result<Vec<JoinHandle<()>>>
where
    F: Fn(WorkerContext) -> Fut + Send + Sync + Clone + 'static,
    Fut: Future<Output = ()> + 'static,
{
    let mut handles = Vec::new();
    udp.resize_with(sockets.len(), Vec::new);
    for (id, (listeners, udp)) in sockets.into_iter().zip(udp).enumerate() {
        let make = make.clone();
        let h = std::thread::Builder::new()
            .name(format!("pier-worker-{id}"))
            .spawn(move || {
                let rt = match tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    // One clock read per wake-up from the poller: the
                    // request path's deadlines and stamps use it.
                    .on_thread_unpark(|| {
                        pier_clock::now();
                    })
                    .build()
                {
                    Ok(rt) => rt,
                    Err(e) => {
                        tracing::error!("worker {id}: cannot build runtime: {e}");
                        return;
                    }
                };
                let local = tokio::task::LocalSet::new();
                local.block_on(&rt, make(WorkerContext { id, listeners, udp }));
            })?;
        handles.push(h);
    }
    Ok(handles)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn port_zero_shared_by_workers() {
        let (socks, bound) = bind_all(
            2,
            &[("main".into(), "127.0.0.1:0".parse().unwrap())],
            &mut |_, _| Vec::new(),
        )
        .unwrap();
        let port = bound[0].1.port();
        assert_ne!(port, 0);
        for w in &socks {
            assert_eq!(w[0].1.local_addr().unwrap().port(), port);
        }
        // A second, unrelated bind to the same port without reuseport fails
        // with "address in use" — which is how `pier` reports a busy port.
        assert!(std::net::TcpListener::bind(bound[0].1).is_err());
    }
}
