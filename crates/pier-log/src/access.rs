//! JSON-lines access log.
//!
//! Each worker formats records into its own buffer (no `format!`, no
//! allocation once the buffer has grown) and hands full buffers to one
//! writer thread over a bounded channel. If the writer falls behind, buffers
//! are dropped and counted rather than blocking a worker.

use std::cell::RefCell;
use std::io::Write;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::mpsc::{sync_channel, SyncSender, TrySendError};
use std::sync::Arc;

const FLUSH_AT: usize = 32 * 1024;

pub struct AccessRecord<'a> {
    pub ts_ms: u64,
    pub client: &'a [u8],
    pub method: &'a [u8],
    pub uri: &'a [u8],
    /// The request's protocol as HTTP spells it (`HTTP/1.1`, `HTTP/2.0`,
    /// `HTTP/3.0`; nginx's `$server_protocol`).
    pub protocol: &'a str,
    pub host: &'a [u8],
    pub status: u16,
    pub bytes_sent: u64,
    pub duration_us: u64,
    pub route: &'a str,
    pub upstream: &'a [u8],
    pub reason: &'a str,
    /// What the connection's TLS handshake agreed on (None: cleartext).
    pub tls: Option<TlsFields<'a>>,
    /// The connection's peer when it is not `client` (a proxy that named
    /// the client, `real_ip_header`); "" otherwise, and then not written.
    pub peer: &'a [u8],
    /// The cache step's result (`HIT`, `MISS`, …; nginx's
    /// `$upstream_cache_status`); "" on a route without a cache, and then
    /// not written.
    pub cache: &'a str,
    /// `[tracing]`: the request's trace and server span ids (hex); ""
    /// without tracing, and then not written.
    pub trace_id: &'a [u8],
    pub span_id: &'a [u8],
}

/// TLS fields of an access record (logged as a `"tls"` object).
#[derive(Clone, Copy)]
pub struct TlsFields<'a> {
    pub version: &'a str,
    pub cipher: &'a str,
    pub sni: &'a str,
    pub alpn: &'a str,
    /// Verified client certificate subject, "" without one.
    pub client: &'a str,
}

/// A sink shared by all workers; cheap to clone.
#[derive(Clone)]
pub struct AccessLog {
    tx: Option<SyncSender<Vec<u8>>>,
    /// Set by [`AccessLog::reopen`]; the writer opens its file again before
    /// its next write.
    reopen: Arc<AtomicBool>,
}

fn open_append(path: &std::path::Path) -> std::io::Result<std::fs::File> {
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
}

thread_local! {
    static BUF: RefCell<Vec<u8>> = RefCell::new(Vec::with_capacity(FLUSH_AT + 1024));
}

impl AccessLog {
    pub fn off() -> Self {
        AccessLog {
            tx: None,
            reopen: Arc::default(),
        }
    }

    /// Start the writer thread for `w` (stdout).
    pub fn start(w: Box<dyn Write + Send>) -> Self {
        Self::spawn(w, None)
    }

    /// Open `path` for appending (created if missing) and start its writer
    /// thread. [`AccessLog::reopen`] opens it again, for log rotation.
    pub fn file(path: PathBuf) -> Result<Self, String> {
        let f = open_append(&path)
            .map_err(|e| format!("cannot open access log {}: {e}", path.display()))?;
        Ok(Self::spawn(Box::new(f), Some(path)))
    }

    fn spawn(mut w: Box<dyn Write + Send>, path: Option<PathBuf>) -> Self {
        let (tx, rx) = sync_channel::<Vec<u8>>(64);
        let reopen = Arc::new(AtomicBool::new(false));
        let asked = reopen.clone();
        std::thread::Builder::new()
            .name("pier-access-log".into())
            .spawn(move || {
                for buf in rx {
                    if asked.swap(false, Relaxed) {
                        if let Some(p) = &path {
                            // logrotate moved the file: what was written
                            // stays in it, and the rest goes to a new one.
                            // Not openable (removed directory, permissions):
                            // keep writing to the old one, and say so.
                            match open_append(p) {
                                Ok(f) => w = Box::new(f),
                                Err(e) => tracing::error!(
                                    "access log {}: cannot reopen: {e}; writing to the old file",
                                    p.display()
                                ),
                            }
                        }
                    }
                    let _ = w.write_all(&buf);
                    let _ = w.flush();
                }
            })
            .expect("spawn access log thread");
        AccessLog {
            tx: Some(tx),
            reopen,
        }
    }

    /// Open the log file again (SIGUSR1, after logrotate moved it, as
    /// nginx does): records already handed to the writer go to the old
    /// file, later ones to the new. Records a worker still buffers (up to a
    /// second's) land in the new file.
    pub fn reopen(&self) {
        let Some(tx) = &self.tx else { return };
        self.reopen.store(true, Relaxed);
        // An empty buffer wakes an idle writer so it reopens now, not at
        // the next record; dropped when the queue is full (it is awake).
        let _ = tx.try_send(Vec::new());
    }

    pub fn enabled(&self) -> bool {
        self.tx.is_some()
    }

    /// Append one record to this thread's buffer; returns the number of
    /// bytes dropped if a full buffer could not be handed off.
    pub fn log(&self, r: &AccessRecord<'_>) -> u64 {
        if self.tx.is_none() {
            return 0;
        }
        let full = BUF.with(|b| {
            let mut b = b.borrow_mut();
            write_record(&mut b, r);
            b.len() >= FLUSH_AT
        });
        if full {
            self.flush()
        } else {
            0
        }
    }

    /// Hand this thread's buffer to the writer (workers call it every second).
    pub fn flush(&self) -> u64 {
        let Some(tx) = &self.tx else { return 0 };
        BUF.with(|b| {
            let mut b = b.borrow_mut();
            if b.is_empty() {
                return 0;
            }
            let out = std::mem::replace(&mut *b, Vec::with_capacity(FLUSH_AT + 1024));
            let n = out.len() as u64;
            match tx.try_send(out) {
                Ok(()) => 0,
                Err(TrySendError::Full(_)) | Err(TrySendError::Disconnected(_)) => n,
            }
        })
    }
}

fn write_record(b: &mut Vec<u8>, r: &AccessRecord<'_>) {
    let mut n = itoa::Buffer::new();
    b.extend_from_slice(b"{\"ts_ms\":");
    b.extend_from_slice(n.format(r.ts_ms).as_bytes());
    b.extend_from_slice(b",\"client\":\"");
    escape(b, r.client);
    b.extend_from_slice(b"\",\"method\":\"");
    escape(b, r.method);
    b.extend_from_slice(b"\",\"uri\":\"");
    escape(b, r.uri);
    b.extend_from_slice(b"\",\"protocol\":\"");
    escape(b, r.protocol.as_bytes());
    b.extend_from_slice(b"\",\"host\":\"");
    escape(b, r.host);
    b.extend_from_slice(b"\",\"status\":");
    b.extend_from_slice(n.format(r.status).as_bytes());
    b.extend_from_slice(b",\"bytes\":");
    b.extend_from_slice(n.format(r.bytes_sent).as_bytes());
    b.extend_from_slice(b",\"duration_us\":");
    b.extend_from_slice(n.format(r.duration_us).as_bytes());
    b.extend_from_slice(b",\"route\":\"");
    escape(b, r.route.as_bytes());
    b.extend_from_slice(b"\",\"upstream\":\"");
    escape(b, r.upstream);
    b.extend_from_slice(b"\",\"reason\":\"");
    escape(b, r.reason.as_bytes());
    b.push(b'"');
    if !r.peer.is_empty() {
        b.extend_from_slice(b",\"peer\":\"");
        escape(b, r.peer);
        b.push(b'"');
    }
    if !r.cache.is_empty() {
        b.extend_from_slice(b",\"cache\":\"");
        escape(b, r.cache.as_bytes());
        b.push(b'"');
    }
    if !r.trace_id.is_empty() {
        b.extend_from_slice(b",\"trace_id\":\"");
        escape(b, r.trace_id);
        b.extend_from_slice(b"\",\"span_id\":\"");
        escape(b, r.span_id);
        b.push(b'"');
    }
    if let Some(t) = &r.tls {
        for (k, v) in [
            (&b",\"tls\":{\"version\":\""[..], t.version),
            (b"\",\"cipher\":\"", t.cipher),
            (b"\",\"sni\":\"", t.sni),
            (b"\",\"alpn\":\"", t.alpn),
            (b"\",\"client\":\"", t.client),
        ] {
            b.extend_from_slice(k);
            escape(b, v.as_bytes());
        }
        b.extend_from_slice(b"\"}");
    }
    b.extend_from_slice(b"}\n");
}

/// JSON string escaping; bytes that are not valid UTF-8 become \u00XX so
/// every line stays valid JSON whatever a client sends.
fn escape(out: &mut Vec<u8>, s: &[u8]) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    for &c in s {
        match c {
            b'"' => out.extend_from_slice(b"\\\""),
            b'\\' => out.extend_from_slice(b"\\\\"),
            0x20..=0x7e => out.push(c),
            _ => {
                out.extend_from_slice(b"\\u00");
                out.push(HEX[(c >> 4) as usize]);
                out.push(HEX[(c & 15) as usize]);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_are_json_lines() {
        let mut b = Vec::new();
        write_record(
            &mut b,
            &AccessRecord {
                ts_ms: 1,
                client: b"127.0.0.1",
                method: b"GET",
                uri: b"/a\"b\x01\xff",
                protocol: "HTTP/1.1",
                host: b"h",
                status: 200,
                bytes_sent: 12,
                duration_us: 5,
                route: "r",
                upstream: b"127.0.0.1:9000",
                reason: "",
                tls: None,
                peer: b"",
                cache: "",
                trace_id: b"",
                span_id: b"",
            },
        );
        let s = String::from_utf8(b).unwrap();
        assert_eq!(
            s,
            "{\"ts_ms\":1,\"client\":\"127.0.0.1\",\"method\":\"GET\",\"uri\":\"/a\\\"b\\u0001\\u00ff\",\"protocol\":\"HTTP/1.1\",\"host\":\"h\",\"status\":200,\"bytes\":12,\"duration_us\":5,\"route\":\"r\",\"upstream\":\"127.0.0.1:9000\",\"reason\":\"\"}\n"
        );
        // A cached route's record says what the cache did.
        let mut b = Vec::new();
        write_record(
            &mut b,
            &AccessRecord {
                ts_ms: 1,
                client: b"::1",
                method: b"GET",
                uri: b"/",
                protocol: "HTTP/2.0",
                host: b"",
                status: 200,
                bytes_sent: 0,
                duration_us: 0,
                route: "",
                upstream: b"",
                reason: "",
                tls: None,
                peer: b"",
                cache: "HIT",
                trace_id: b"",
                span_id: b"",
            },
        );
        assert!(String::from_utf8(b)
            .unwrap()
            .ends_with(",\"reason\":\"\",\"cache\":\"HIT\"}\n"));
    }
}
