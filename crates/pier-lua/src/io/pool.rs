//! Per-thread keep-alive pool of idle TCP connections, shared by cosockets
//! (`setkeepalive`) and `pier.http` (keyed by `host:port`).

use std::cell::RefCell;
use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use tokio::net::TcpStream;

struct Idle {
    stream: TcpStream,
    /// Times this connection has been taken from the pool before.
    reused: u32,
    deadline: Instant,
}

thread_local! {
    static POOL: RefCell<HashMap<String, VecDeque<Idle>>> = RefCell::new(HashMap::new());
}

/// An idle connection to `key` that is still open, most recent first, with
/// the number of times it was reused before.
pub(crate) fn take(key: &str) -> Option<(TcpStream, u32)> {
    POOL.with_borrow_mut(|pool| {
        let list = pool.get_mut(key)?;
        let now = Instant::now();
        while let Some(idle) = list.pop_back() {
            if idle.deadline > now && still_open(&idle.stream) {
                return Some((idle.stream, idle.reused));
            }
        }
        None
    })
}

/// A pooled connection must have nothing to read: data or EOF means the
/// peer closed it or broke the protocol.
fn still_open(s: &TcpStream) -> bool {
    let mut b = [0u8; 1];
    matches!(s.try_read(&mut b), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock)
}

/// Parks `stream` for reuse for `idle`, keeping at most `size` per key
/// (the oldest goes first).
pub(crate) fn put(key: String, stream: TcpStream, reused: u32, idle: Duration, size: usize) {
    if size == 0 {
        return;
    }
    POOL.with_borrow_mut(|pool| {
        let list = pool.entry(key).or_default();
        while list.len() >= size {
            list.pop_front();
        }
        list.push_back(Idle {
            stream,
            reused,
            deadline: Instant::now() + idle,
        });
    });
}

/// Idle connections pooled for `key` (tests).
pub(crate) fn idle_count(key: &str) -> usize {
    POOL.with_borrow(|pool| pool.get(key).map_or(0, VecDeque::len))
}
