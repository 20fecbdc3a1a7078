//! Ports for servers the tests start.

/// A free port, for a peer that must be told its port before it starts (a
/// responder named in a certificate, Pebble's validation port, a server that
/// cannot report the port 0 gave it), or that binds it again after a restart.
///
/// Taken below the kernel's ephemeral range (`ip_local_port_range`, 32768 up
/// by default), which is where port 0 and every outgoing connection's source
/// port come from: a port from there, free a moment ago, could be taken by
/// any connection a parallel test opened in between (a CI run lost an ACME
/// test so: "Address already in use" on the HTTP-01 port). Below it, only
/// this allocator hands ports out; its counter keeps the threads of one test
/// process apart, and each port is checked free (TCP and UDP) before use.
pub fn free_port() -> u16 {
    use std::sync::atomic::{AtomicU32, Ordering};
    static NEXT: AtomicU32 = AtomicU32::new(0);
    const LOW: u32 = 10_000;
    let high = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse::<u32>().ok())
        .filter(|&lo| lo > LOW + 1000)
        .unwrap_or(32_768);
    let span = high - LOW;
    // Test processes run one after another; a base per process keeps them
    // off each other's lingering ports.
    let base = std::process::id().wrapping_mul(7919) % span;
    for _ in 0..span {
        let port = (LOW + (base + NEXT.fetch_add(1, Ordering::Relaxed)) % span) as u16;
        let tcp = std::net::TcpListener::bind(("127.0.0.1", port)).is_ok();
        if tcp && std::net::UdpSocket::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}
