//! uring-proxy: issue 34 item 5's experiment. A minimal HTTP/1.1 keep-alive reverse
//! proxy whose accept/read/write path runs either on epoll (a tokio current_thread
//! runtime per worker thread, as Pier's engine does) or, with the `uring` feature, on
//! io_uring (multishot accept, multishot recv into a provided-buffer ring, batched
//! submission, one ring per worker thread). Both modes do the same work: read a GET
//! head, forward it over a per-worker pool of keep-alive origin connections, read the
//! Content-Length-framed response, write it back. See bench/uring.sh.
//!
//!   uring-proxy --mode epoll|uring --workers N --listen 127.0.0.1:PORT --origin 127.0.0.1:PORT

mod epoll;
mod http;
#[cfg(feature = "uring")]
mod uring;

use std::net::{SocketAddr, TcpListener};
use std::process::ExitCode;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Mode {
    Epoll,
    Uring,
}

struct Args {
    mode: Mode,
    /// io_uring setup flags: SINGLE_ISSUER | DEFER_TASKRUN | COOP_TASKRUN (default), or none.
    plain_ring: bool,
    workers: usize,
    listen: SocketAddr,
    origin: SocketAddr,
}

const USAGE: &str = "usage: uring-proxy --mode epoll|uring [--workers N] [--ring defer|plain] \
                     --listen IP:PORT --origin IP:PORT";

fn parse_args() -> Result<Args, String> {
    let mut mode = Mode::Epoll;
    let mut plain_ring = false;
    let mut workers = 1;
    let (mut listen, mut origin) = (None, None);
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        if flag == "-h" || flag == "--help" {
            return Err(USAGE.into());
        }
        let value = it
            .next()
            .ok_or_else(|| format!("{flag} needs a value\n{USAGE}"))?;
        match flag.as_str() {
            "--mode" => {
                mode = match value.as_str() {
                    "epoll" => Mode::Epoll,
                    "uring" => Mode::Uring,
                    _ => return Err(format!("--mode is epoll or uring, not {value}")),
                }
            }
            "--ring" => {
                plain_ring = match value.as_str() {
                    "defer" => false,
                    "plain" => true,
                    _ => return Err(format!("--ring is defer or plain, not {value}")),
                }
            }
            "--workers" => {
                workers = value
                    .parse()
                    .map_err(|e| format!("--workers {value}: {e}"))?;
                if workers == 0 {
                    return Err("--workers must be at least 1".into());
                }
            }
            "--listen" => {
                listen = Some(
                    value
                        .parse()
                        .map_err(|e| format!("--listen {value}: {e}"))?,
                )
            }
            "--origin" => {
                origin = Some(
                    value
                        .parse()
                        .map_err(|e| format!("--origin {value}: {e}"))?,
                )
            }
            _ => return Err(format!("unknown flag {flag}\n{USAGE}")),
        }
    }
    Ok(Args {
        mode,
        plain_ring,
        workers,
        listen: listen.ok_or(USAGE)?,
        origin: origin.ok_or(USAGE)?,
    })
}

/// One listener per worker on the same address (SO_REUSEPORT), as Pier does: the
/// kernel spreads new connections over the workers.
fn listener(addr: SocketAddr) -> std::io::Result<TcpListener> {
    use socket2::{Domain, Socket, Type};
    let s = Socket::new(Domain::for_address(addr), Type::STREAM, None)?;
    s.set_reuse_address(true)?;
    s.set_reuse_port(true)?;
    s.set_nonblocking(true)?;
    s.set_cloexec(true)?;
    s.bind(&addr.into())?;
    s.listen(4096)?;
    Ok(s.into())
}

fn run_worker(
    mode: Mode,
    plain_ring: bool,
    l: TcpListener,
    origin: SocketAddr,
) -> std::io::Result<()> {
    match mode {
        Mode::Epoll => epoll::run(l, origin),
        #[cfg(feature = "uring")]
        Mode::Uring => uring::run(l, origin, plain_ring),
        #[cfg(not(feature = "uring"))]
        Mode::Uring => {
            let _ = plain_ring;
            Err(std::io::Error::other(
                "built without the `uring` feature (cargo build --features uring)",
            ))
        }
    }
}

fn main() -> ExitCode {
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::from(2);
        }
    };
    let mut listeners = Vec::new();
    for _ in 0..args.workers {
        match listener(args.listen) {
            Ok(l) => listeners.push(l),
            Err(e) => {
                eprintln!("listen on {}: {e}", args.listen);
                return ExitCode::FAILURE;
            }
        }
    }
    eprintln!(
        "uring-proxy: mode {:?}, {} worker(s), listening on {}, origin {}",
        args.mode, args.workers, args.listen, args.origin
    );
    let (mode, plain, origin) = (args.mode, args.plain_ring, args.origin);
    let threads: Vec<_> = listeners
        .into_iter()
        .enumerate()
        .map(|(i, l)| {
            std::thread::Builder::new()
                .name(format!("worker-{i}"))
                .spawn(move || run_worker(mode, plain, l, origin))
                .expect("spawn a worker thread")
        })
        .collect();
    let mut failed = false;
    for t in threads {
        match t.join() {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                eprintln!("worker failed: {e}");
                failed = true;
            }
            Err(_) => failed = true,
        }
    }
    if failed {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}
