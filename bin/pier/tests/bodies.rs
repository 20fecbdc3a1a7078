//! Bodies: chunked both ways with trailers, 100 MiB streamed both ways without
//! Pier's memory growing, slow clients, 100-continue.

mod common;

use std::io::Write;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;

const MIB: u64 = 1024 * 1024;
/// How much Pier's RSS may grow while streaming a body many times that size.
const RSS_GROWTH_LIMIT_KIB: u64 = 64 * 1024;

fn one_origin() -> (Origin, PierProcess) {
    let o = Origin::start();
    let p = pier(&simple_config(
        &[o.addr()],
        "[timeouts]\nupstream_response = \"60s\"\nclient_idle = \"60s\"",
        "",
    ));
    (o, p)
}

/// Samples Pier's RSS every 20 ms on a thread until dropped; reports the peak.
struct RssWatch {
    stop: Arc<AtomicBool>,
    peak: Arc<AtomicU64>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl RssWatch {
    fn start(pid: u32) -> RssWatch {
        let stop = Arc::new(AtomicBool::new(false));
        let peak = Arc::new(AtomicU64::new(rss_kib(pid).unwrap_or(0)));
        let (s, pk) = (stop.clone(), peak.clone());
        let thread = std::thread::spawn(move || {
            // Bounded: at most 10 minutes of samples.
            for _ in 0..30_000 {
                if s.load(Ordering::SeqCst) {
                    break;
                }
                if let Some(r) = rss_kib(pid) {
                    pk.fetch_max(r, Ordering::SeqCst);
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        });
        RssWatch {
            stop,
            peak,
            thread: Some(thread),
        }
    }

    fn peak(mut self) -> u64 {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        self.peak.load(Ordering::SeqCst)
    }
}

/// Pier's RSS after one small request has warmed it up.
fn warm_rss(p: &PierProcess) -> u64 {
    assert_eq!(get(p.listener("main"), "/hello").status, 200);
    p.rss_kib().expect("pier rss")
}

#[test]
fn chunked_upload_and_download_with_trailers() {
    let (_o, p) = one_origin();
    let mut c = RawConn::connect(p.listener("main"));
    // Request: chunks of odd sizes, a trailer. The origin echoes the chunks and the
    // trailers back, so this checks trailers in both directions.
    let body = pattern(3, 300_000);
    let mut req =
        b"POST /echo HTTP/1.1\r\nhost: a\r\ntransfer-encoding: chunked\r\ntrailer: x-sum\r\n\r\n"
            .to_vec();
    let mut off = 0;
    for (i, size) in [1usize, 7, 4096, 65536, 100_000, 12345]
        .iter()
        .cycle()
        .enumerate()
    {
        if off >= body.len() || i > 1000 {
            break;
        }
        let n = (*size).min(body.len() - off);
        req.extend_from_slice(format!("{n:x};ext=v\r\n").as_bytes());
        req.extend_from_slice(&body[off..off + n]);
        req.extend_from_slice(b"\r\n");
        off += n;
    }
    req.extend_from_slice(b"0\r\nx-sum: 300000\r\n\r\n");
    c.send(&req);
    let r = c.read_response().unwrap();
    assert_eq!(r.status, 200);
    assert!(
        r.chunked,
        "echo of a chunked body is chunked: {:?}",
        r.headers
    );
    assert_eq!(r.body.len(), body.len());
    assert!(r.body == body, "echoed body differs");
    assert_eq!(
        r.trailer("x-sum"),
        Some("300000"),
        "trailers: {:?}",
        r.trailers
    );

    // Response: chunked with a trailer from the origin.
    let r = c.get("/chunked/1000000").unwrap();
    assert!(r.chunked);
    assert_eq!(r.body.len(), 1_000_000);
    assert!(is_pattern(0, &r.body));
    assert_eq!(
        r.trailer("x-trailer"),
        Some("done"),
        "trailers: {:?}",
        r.trailers
    );
    // Still in sync.
    assert_eq!(c.get("/hello").unwrap().body, b"hello world\n");
}

#[test]
fn download_100_mib_streamed_without_growing_memory() {
    let (_o, p) = one_origin();
    let base = warm_rss(&p);
    let watch = RssWatch::start(p.pid());
    let mut c = RawConn::connect(p.listener("main"));
    c.send(format!("GET /bytes/{} HTTP/1.1\r\nhost: a\r\n\r\n", 100 * MIB).as_bytes());
    let (resp, good) = c.read_pattern_response().unwrap();
    let peak = watch.peak();
    assert_eq!(resp.status, 200);
    assert_eq!(resp.body_len, 100 * MIB);
    assert!(good, "body bytes differ from the pattern");
    assert!(
        peak.saturating_sub(base) < RSS_GROWTH_LIMIT_KIB,
        "pier RSS grew from {base} KiB to {peak} KiB while streaming 100 MiB"
    );
}

#[test]
fn upload_100_mib_echoed_without_growing_memory() {
    let (o, p) = one_origin();
    let base = warm_rss(&p);
    let watch = RssWatch::start(p.pid());
    let mut c = RawConn::connect(p.listener("main"));
    c.set_timeout(Duration::from_secs(30));
    let total = 100 * MIB;
    c.send(format!("POST /echo HTTP/1.1\r\nhost: a\r\ncontent-length: {total}\r\n\r\n").as_bytes());
    // Upload on a thread while the echo is read here: neither side may buffer it all.
    let mut w = c.writer();
    let writer = std::thread::spawn(move || -> std::io::Result<()> {
        let mut off = 0u64;
        while off < total {
            let n = (total - off).min(256 * 1024) as usize;
            w.write_all(&pattern(off, n))?;
            off += n as u64;
        }
        Ok(())
    });
    let (resp, good) = c.read_pattern_response().unwrap();
    writer.join().unwrap().unwrap();
    let peak = watch.peak();
    assert_eq!(resp.status, 200);
    assert_eq!(resp.body_len, total);
    assert!(good, "echoed bytes differ from what was sent");
    assert_eq!(o.requests(), 2);
    assert!(
        peak.saturating_sub(base) < RSS_GROWTH_LIMIT_KIB,
        "pier RSS grew from {base} KiB to {peak} KiB while streaming 100 MiB both ways"
    );
}

#[test]
fn chunked_upload_32_mib_echoed() {
    let (_o, p) = one_origin();
    let base = warm_rss(&p);
    let watch = RssWatch::start(p.pid());
    let mut c = RawConn::connect(p.listener("main"));
    c.set_timeout(Duration::from_secs(30));
    let total = 32 * MIB;
    c.send(b"POST /echo HTTP/1.1\r\nhost: a\r\ntransfer-encoding: chunked\r\n\r\n");
    let mut w = c.writer();
    let writer = std::thread::spawn(move || -> std::io::Result<()> {
        let mut off = 0u64;
        let mut step = 0u64;
        while off < total {
            let n = (total - off).min(1 + (step * 7919) % 70_000) as usize;
            w.write_all(format!("{n:x}\r\n").as_bytes())?;
            w.write_all(&pattern(off, n))?;
            w.write_all(b"\r\n")?;
            off += n as u64;
            step += 1;
        }
        w.write_all(b"0\r\n\r\n")
    });
    let (resp, good) = c.read_pattern_response().unwrap();
    writer.join().unwrap().unwrap();
    let peak = watch.peak();
    assert_eq!(resp.body_len, total);
    assert!(good);
    assert!(
        peak.saturating_sub(base) < RSS_GROWTH_LIMIT_KIB,
        "{base} -> {peak} KiB"
    );
}

#[test]
fn slow_reader_gets_everything_and_pier_does_not_buffer_it() {
    let (_o, p) = one_origin();
    let base = warm_rss(&p);
    let watch = RssWatch::start(p.pid());
    let mut c = RawConn::connect(p.listener("main"));
    let total = 48 * MIB;
    c.send(format!("GET /bytes/{total} HTTP/1.1\r\nhost: a\r\n\r\n").as_bytes());
    // Read nothing for a while: Pier must stop reading from the origin, not buffer.
    std::thread::sleep(Duration::from_millis(1500));
    let mut off = 0u64;
    let mut good = true;
    let mut pieces = 0u64;
    let resp = c
        .read_response_streaming(&mut |piece| {
            good &= is_pattern(off, piece);
            off += piece.len() as u64;
            pieces += 1;
            // A slow reader: a pause every few pieces.
            if pieces.is_multiple_of(64) {
                std::thread::sleep(Duration::from_millis(10));
            }
        })
        .unwrap();
    let peak = watch.peak();
    assert_eq!(resp.body_len, total);
    assert!(good);
    assert!(
        peak.saturating_sub(base) < 32 * 1024,
        "pier buffered a slow reader's response: RSS {base} -> {peak} KiB"
    );
}

#[test]
fn slow_uploader_is_waited_for() {
    let (_o, p) = one_origin();
    let mut c = RawConn::connect(p.listener("main"));
    c.send(b"POST /echo HTTP/1.1\r\nhost: a\r\ncontent-length: 10\r\n\r\n");
    for b in b"0123456789" {
        std::thread::sleep(Duration::from_millis(100));
        c.send(&[*b]);
    }
    let r = c.read_response().unwrap();
    assert_eq!(r.status, 200);
    assert_eq!(r.body, b"0123456789");
}

#[test]
fn slow_origin_body_is_streamed_as_it_comes() {
    let (_o, p) = one_origin();
    let mut c = RawConn::connect(p.listener("main"));
    let t = Instant::now();
    c.send(b"GET /slowbody/500 HTTP/1.1\r\nhost: a\r\n\r\n");
    // The head arrives before the origin has sent its last body byte (~5 s).
    let head = c.read_head_only().unwrap();
    assert_eq!(head.status, 200);
    assert!(
        t.elapsed() < Duration::from_secs(4),
        "head took {:?}: pier waited for the body",
        t.elapsed()
    );
}

#[test]
fn expect_100_continue() {
    let (_o, p) = one_origin();
    let mut c = RawConn::connect(p.listener("main"));
    c.send(
        b"POST /expect HTTP/1.1\r\nhost: a\r\ncontent-length: 5\r\nexpect: 100-continue\r\n\r\n",
    );
    // A client waiting for 100 Continue gets it (from Pier or the origin) before sending.
    let interim = c.read_head_only().unwrap();
    assert_eq!(interim.status, 100);
    c.send(b"abcde");
    let r = c.read_response().unwrap();
    assert_eq!(r.status, 200);
    assert!(r.body_str().contains("bytes: 5"), "{}", r.body_str());
    assert!(
        r.interim.is_empty(),
        "a second 100 was sent: {:?}",
        r.interim
    );
    assert_eq!(c.get("/hello").unwrap().status, 200);
}
