//! A scripted origin: a function of the request says what to answer, in a few
//! lines of a test (varnishtest's `server s1 { rxreq; txresp … }`).
//!
//! Blocking, a thread a connection: what a test writes in the script runs as
//! it reads, so a reply may wait on a [`Gate`] the test opens, close without an
//! answer, or write raw bytes.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

/// A request as the scripted origin read it.
#[derive(Debug, Clone)]
pub struct Request {
    pub method: String,
    /// The request target as sent (with its query).
    pub path: String,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
    /// 1 for the first request this origin read, and so on (over every connection).
    pub n: usize,
}

impl Request {
    /// First value of a header (names compare case-insensitively).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

/// A raw writer of a [`Reply::raw`].
pub type RawReply = Box<dyn FnOnce(&mut TcpStream) + Send>;

enum Kind {
    /// Head, then body pieces each after its pause.
    Send {
        head: String,
        pieces: Vec<(Duration, Vec<u8>)>,
    },
    Close,
    Raw(RawReply),
}

/// What the scripted origin answers.
pub struct Reply {
    status: u16,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
    hold: Option<Gate>,
    kind: Option<Kind>,
}

impl std::fmt::Debug for Reply {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reply")
            .field("status", &self.status)
            .field("headers", &self.headers)
            .finish_non_exhaustive()
    }
}

impl Reply {
    /// `200 OK` with this body (and its Content-Length).
    pub fn ok(body: impl Into<Vec<u8>>) -> Reply {
        Reply::status(200, body)
    }

    /// This status with this body (Content-Length added unless a header frames it).
    pub fn status(status: u16, body: impl Into<Vec<u8>>) -> Reply {
        Reply {
            status,
            headers: Vec::new(),
            body: body.into(),
            hold: None,
            kind: None,
        }
    }

    /// Adds a header.
    pub fn header(mut self, name: &str, value: &str) -> Reply {
        self.headers.push((name.to_string(), value.to_string()));
        self
    }

    /// Answers only once `gate` is open (30 s at most): a slow origin without a
    /// pause to race.
    pub fn after(mut self, gate: &Gate) -> Reply {
        self.hold = Some(gate.clone());
        self
    }

    /// An exact head (status line and header lines, without the blank line
    /// that ends it), then body pieces, each written after its pause.
    pub fn wire(head: impl Into<String>, pieces: Vec<(Duration, Vec<u8>)>) -> Reply {
        Reply {
            kind: Some(Kind::Send {
                head: head.into(),
                pieces,
            }),
            ..Reply::ok("")
        }
    }

    /// Closes the connection without answering.
    pub fn close() -> Reply {
        Reply {
            kind: Some(Kind::Close),
            ..Reply::ok("")
        }
    }

    /// Writes the answer itself (e.g. a head, then a wait on a channel).
    pub fn raw(f: impl FnOnce(&mut TcpStream) + Send + 'static) -> Reply {
        Reply {
            kind: Some(Kind::Raw(Box::new(f))),
            ..Reply::ok("")
        }
    }

    fn into_kind(self) -> Kind {
        if let Some(k) = self.kind {
            return k;
        }
        let mut head = format!("HTTP/1.1 {} {}", self.status, reason(self.status));
        let framed = self.headers.iter().any(|(n, _)| {
            n.eq_ignore_ascii_case("content-length") || n.eq_ignore_ascii_case("transfer-encoding")
        });
        for (n, v) in &self.headers {
            head.push_str(&format!("\r\n{n}: {v}"));
        }
        if !framed && !matches!(self.status, 100..=199 | 204 | 304) {
            head.push_str(&format!("\r\ncontent-length: {}", self.body.len()));
        }
        Kind::Send {
            head,
            pieces: vec![(Duration::ZERO, self.body)],
        }
    }
}

fn reason(status: u16) -> &'static str {
    match status {
        200 => "OK",
        304 => "Not Modified",
        404 => "Not Found",
        500 => "Internal Server Error",
        502 => "Bad Gateway",
        503 => "Service Unavailable",
        _ => "Status",
    }
}

/// A gate a scripted reply waits on until the test opens it.
#[derive(Clone, Default, Debug)]
pub struct Gate(Arc<(Mutex<bool>, Condvar)>);

impl Gate {
    pub fn new() -> Gate {
        Gate::default()
    }

    /// Lets every reply waiting on the gate (and every later one) go.
    pub fn open(&self) {
        let (open, cv) = &*self.0;
        *open.lock().unwrap_or_else(|e| e.into_inner()) = true;
        cv.notify_all();
    }

    /// Waits until the gate is open or `timeout` passes; whether it opened.
    pub fn wait(&self, timeout: Duration) -> bool {
        let (open, cv) = &*self.0;
        let guard = open.lock().unwrap_or_else(|e| e.into_inner());
        let (guard, _) = cv
            .wait_timeout_while(guard, timeout, |open| !*open)
            .unwrap_or_else(|e| e.into_inner());
        *guard
    }
}

/// The function of a scripted origin.
pub type ScriptFn = dyn Fn(&Request) -> Reply + Send + Sync;

/// A running scripted origin on 127.0.0.1:0. Stops accepting on drop
/// (connections already open finish what they do).
pub struct Script {
    addr: SocketAddr,
    count: Arc<AtomicUsize>,
    stop: Arc<AtomicBool>,
}

impl std::fmt::Debug for Script {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Script").field("addr", &self.addr).finish()
    }
}

impl Script {
    /// Starts an origin that answers every request with `answer(request)`.
    pub fn start(answer: impl Fn(&Request) -> Reply + Send + Sync + 'static) -> Script {
        Self::start_arc(Arc::new(answer))
    }

    pub(crate) fn start_arc(answer: Arc<ScriptFn>) -> Script {
        let l = TcpListener::bind("127.0.0.1:0").expect("bind scripted origin");
        let addr = l.local_addr().expect("local addr");
        let count = Arc::new(AtomicUsize::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let (c2, s2) = (count.clone(), stop.clone());
        std::thread::spawn(move || {
            for conn in l.incoming() {
                if s2.load(SeqCst) {
                    return;
                }
                let Ok(conn) = conn else { continue };
                let (count, answer) = (c2.clone(), answer.clone());
                std::thread::spawn(move || serve(conn, &count, &*answer));
            }
        });
        Script { addr, count, stop }
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Requests read so far (counted as each head and body arrive, before the
    /// answer is written).
    pub fn requests(&self) -> usize {
        self.count.load(SeqCst)
    }

    /// Stops accepting (connections already open stay).
    pub fn stop(&self) {
        if !self.stop.swap(true, SeqCst) {
            let _ = TcpStream::connect(self.addr);
        }
    }
}

impl Drop for Script {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Serves one connection: requests (Content-Length bodies) until it closes.
fn serve(mut conn: TcpStream, count: &AtomicUsize, answer: &ScriptFn) {
    let _ = conn.set_read_timeout(Some(Duration::from_secs(30)));
    let mut buf = Vec::new();
    let mut b = [0u8; 4096];
    loop {
        let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") else {
            match conn.read(&mut b) {
                Ok(0) | Err(_) => return,
                Ok(n) => buf.extend_from_slice(&b[..n]),
            }
            continue;
        };
        let head = String::from_utf8_lossy(&buf[..end]).to_string();
        let mut lines = head.split("\r\n");
        let mut first = lines.next().unwrap_or("").split(' ');
        let method = first.next().unwrap_or("").to_string();
        let path = first.next().unwrap_or("").to_string();
        let headers: Vec<(String, String)> = lines
            .filter_map(|l| {
                let (k, v) = l.split_once(':')?;
                Some((k.trim().to_string(), v.trim().to_string()))
            })
            .collect();
        let cl: usize = headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case("content-length"))
            .and_then(|(_, v)| v.parse().ok())
            .unwrap_or(0);
        while buf.len() < end + 4 + cl {
            match conn.read(&mut b) {
                Ok(0) | Err(_) => return,
                Ok(n) => buf.extend_from_slice(&b[..n]),
            }
        }
        let body = buf[end + 4..end + 4 + cl].to_vec();
        buf.drain(..end + 4 + cl);
        let n = count.fetch_add(1, SeqCst) + 1;
        let reply = answer(&Request {
            method,
            path,
            headers,
            body,
            n,
        });
        if let Some(gate) = &reply.hold {
            gate.wait(Duration::from_secs(30));
        }
        match reply.into_kind() {
            Kind::Close => return,
            Kind::Raw(f) => f(&mut conn),
            Kind::Send { head, pieces } => {
                if conn
                    .write_all(format!("{head}\r\n\r\n").as_bytes())
                    .is_err()
                {
                    return;
                }
                for (pause, p) in pieces {
                    if !pause.is_zero() {
                        std::thread::sleep(pause);
                    }
                    if conn.write_all(&p).is_err() {
                        return;
                    }
                }
            }
        }
    }
}
