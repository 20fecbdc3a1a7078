//! The epoll mode: a tokio current_thread runtime per worker thread (Pier's engine
//! model), a task per client connection, a per-worker pool of idle origin connections.

use std::cell::RefCell;
use std::net::SocketAddr;
use std::rc::Rc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use crate::http;

/// Idle origin connections kept per worker.
const MAX_IDLE: usize = 1024;
/// Bytes asked of each read.
const READ_SIZE: usize = 8192;

type Pool = Rc<RefCell<Vec<TcpStream>>>;

pub fn run(listener: std::net::TcpListener, origin: SocketAddr) -> std::io::Result<()> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .enable_time()
        .build()?;
    let local = tokio::task::LocalSet::new();
    local.block_on(&rt, async move {
        let listener = TcpListener::from_std(listener)?;
        let pool: Pool = Rc::new(RefCell::new(Vec::new()));
        loop {
            match listener.accept().await {
                Ok((s, _)) => {
                    let _ = s.set_nodelay(true);
                    tokio::task::spawn_local(client(s, pool.clone(), origin));
                }
                // Out of descriptors and the like: do not spin.
                Err(_) => tokio::time::sleep(Duration::from_millis(10)).await,
            }
        }
    })
}

async fn client(mut s: TcpStream, pool: Pool, origin: SocketAddr) {
    let mut rbuf = Vec::with_capacity(READ_SIZE);
    let mut resp = Vec::with_capacity(READ_SIZE);
    loop {
        let end = loop {
            if let Some(e) = http::head_end(&rbuf) {
                break e;
            }
            if rbuf.len() > http::MAX_HEAD {
                let _ = s.write_all(http::RESP_400).await;
                return;
            }
            rbuf.reserve(READ_SIZE);
            match s.read_buf(&mut rbuf).await {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
        };
        let Ok(req) = http::parse_request(&rbuf[..end]) else {
            let _ = s.write_all(http::RESP_400).await;
            return;
        };
        resp.clear();
        let ok = forward(&rbuf[..end], &mut resp, &pool, origin).await;
        rbuf.drain(..end);
        if !ok {
            let _ = s.write_all(http::RESP_502).await;
            return;
        }
        if s.write_all(&resp).await.is_err() || req.close {
            return;
        }
    }
}

/// Sends `head` to the origin and reads its response into `resp`. A pooled connection
/// that fails before any response byte (the origin closed it while idle) is retried
/// once on a new one; GET is idempotent.
async fn forward(head: &[u8], resp: &mut Vec<u8>, pool: &Pool, origin: SocketAddr) -> bool {
    for attempt in 0..2 {
        // The retry takes a new connection: the others in the pool may be stale too.
        let pooled = if attempt == 0 {
            pool.borrow_mut().pop()
        } else {
            None
        };
        let (mut up, reused) = match pooled {
            Some(u) => (u, true),
            None => match TcpStream::connect(origin).await {
                Ok(u) => {
                    let _ = u.set_nodelay(true);
                    (u, false)
                }
                Err(_) => return false,
            },
        };
        match exchange(&mut up, head, resp).await {
            Ok(reusable) => {
                let mut p = pool.borrow_mut();
                if reusable && p.len() < MAX_IDLE {
                    p.push(up);
                }
                return true;
            }
            Err(got_bytes) => {
                if reused && !got_bytes && attempt == 0 {
                    resp.clear();
                    continue;
                }
                return false;
            }
        }
    }
    false
}

/// Ok(reusable) with the whole response in `resp`, or Err(any response byte read).
async fn exchange(up: &mut TcpStream, head: &[u8], resp: &mut Vec<u8>) -> Result<bool, bool> {
    up.write_all(head).await.map_err(|_| false)?;
    loop {
        if let Some(h) = http::head_end(resp) {
            let r = http::parse_response(resp, h).map_err(|_| true)?;
            while resp.len() < r.total {
                resp.reserve((r.total - resp.len()).max(READ_SIZE));
                match up.read_buf(resp).await {
                    Ok(0) | Err(_) => return Err(true),
                    Ok(_) => {}
                }
            }
            if resp.len() > r.total {
                // Bytes after the response: the origin is not speaking HTTP/1.1 keep-alive.
                resp.truncate(r.total);
                return Ok(false);
            }
            return Ok(r.reusable);
        }
        if resp.len() > http::MAX_HEAD {
            return Err(true);
        }
        resp.reserve(READ_SIZE);
        match up.read_buf(resp).await {
            Ok(0) | Err(_) => return Err(!resp.is_empty()),
            Ok(_) => {}
        }
    }
}
