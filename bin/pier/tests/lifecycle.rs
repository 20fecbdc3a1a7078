//! Lifecycle: SIGHUP reload under load (no failed request, no dropped connection),
//! invalid configs refused on reload, SIGTERM drain, SIGINT.

mod common;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::*;

fn v1(a: SocketAddr) -> String {
    simple_config(&[a], "", "")
}

/// v1 plus a route `/new` to another upstream.
fn v2(a: SocketAddr, b: SocketAddr) -> String {
    base_config(
        "",
        &format!(
            r#"[[route]]
name = "new"
path = "/new"
upstream = "other"

[[route]]
name = "default"
upstream = "app"

[upstream.app]
servers = ["{a}"]

[upstream.other]
servers = ["{b}"]"#
        ),
    )
}

#[test]
fn reload_under_load_drops_nothing_and_takes_effect() {
    let a = Origin::start_named("alpha");
    let b = Origin::start_named("beta");
    let mut p = pier(&v1(a.addr()));
    let addr = p.listener("main");
    let stop = Arc::new(AtomicBool::new(false));
    let ok = Arc::new(AtomicU64::new(0));
    let failures = Arc::new(Mutex::new(Vec::<String>::new()));
    let threads: Vec<_> = (0..4)
        .map(|t| {
            let (stop, ok, failures) = (stop.clone(), ok.clone(), failures.clone());
            std::thread::spawn(move || {
                // One keep-alive connection kept across the reload, plus a fresh
                // connection every few requests.
                let mut kept = RawConn::connect(addr);
                let started = Instant::now();
                for i in 0..200_000u64 {
                    if stop.load(Ordering::SeqCst) || started.elapsed() > Duration::from_secs(30) {
                        break;
                    }
                    let r = if i % 4 == 0 {
                        try_get(addr, "/name")
                    } else {
                        kept.get("/name")
                    };
                    match r {
                        Ok(r) if r.status == 200 => {
                            ok.fetch_add(1, Ordering::SeqCst);
                        }
                        Ok(r) => failures.lock().unwrap().push(format!(
                            "thread {t} request {i}: status {} {:?}",
                            r.status,
                            r.body_str()
                        )),
                        Err(e) => {
                            failures
                                .lock()
                                .unwrap()
                                .push(format!("thread {t} request {i} (kept={}): {e}", i % 4 != 0));
                            // Go on with a new connection so one failure is not all.
                            kept = RawConn::connect(addr);
                        }
                    }
                }
            })
        })
        .collect();

    // Load first (bounded wait, so a busy machine only makes it slower).
    assert!(wait_until(Duration::from_secs(10), || ok
        .load(Ordering::SeqCst)
        >= 50));
    let before = ok.load(Ordering::SeqCst);
    p.rewrite_config(&v2(a.addr(), b.addr()));
    p.signal(sig::SIGHUP);
    p.wait_generation(2);
    // The new route is live.
    let r = get(addr, "/new/name");
    assert_eq!((r.status, r.body_str().as_str()), (200, "beta"));
    // And load after it.
    let after = ok.load(Ordering::SeqCst);
    wait_until(Duration::from_secs(10), || {
        ok.load(Ordering::SeqCst) >= after + 50
    });
    stop.store(true, Ordering::SeqCst);
    for t in threads {
        t.join().unwrap();
    }
    let failures = failures.lock().unwrap();
    assert!(
        failures.is_empty(),
        "{} failed requests during reload, first: {:?}",
        failures.len(),
        &failures[..failures.len().min(5)]
    );
    let total = ok.load(Ordering::SeqCst);
    assert!(
        before >= 50 && total >= after + 50,
        "too little load to mean anything: {before} before the reload, {after} at its end, {total} in all"
    );
    assert_eq!(p.listener("main"), addr, "the listener moved on reload");
}

#[test]
fn invalid_config_on_reload_is_refused_and_the_old_one_keeps_serving() {
    let a = Origin::start_named("alpha");
    let b = Origin::start_named("beta");
    let mut p = pier(&v1(a.addr()));
    let addr = p.listener("main");
    let mut kept = RawConn::connect(addr);
    assert_eq!(kept.get("/name").unwrap().body_str(), "alpha");

    for bad in [
        // Not TOML.
        "[[route]\nupstream = \n".to_string(),
        // TOML, but the route names an upstream that does not exist.
        base_config("", "[[route]]\nupstream = \"nowhere\"\n"),
    ] {
        p.rewrite_config(&bad);
        p.signal(sig::SIGHUP);
        assert!(
            !p.try_wait_generation(2, Duration::from_millis(1000)),
            "an invalid config was loaded:\n{bad}"
        );
        assert!(
            p.wait_exit(Duration::ZERO).is_none(),
            "pier exited on a bad reload"
        );
        assert_eq!(kept.get("/name").unwrap().body_str(), "alpha");
        assert_eq!(get(addr, "/name").body_str(), "alpha");
    }
    assert!(
        p.logs().contains("pier.toml"),
        "the refused reload is not logged with the file name:\n{}",
        p.logs()
    );

    // A good config afterwards is taken.
    p.rewrite_config(&v2(a.addr(), b.addr()));
    p.signal(sig::SIGHUP);
    p.wait_generation(2);
    assert_eq!(get(addr, "/new/name").body_str(), "beta");
    assert_eq!(
        wait_metric(&p, "pier_config_generation", 2.0),
        Some(2.0),
        "generation metric"
    );
}

#[test]
fn sigterm_drains_in_flight_requests_then_exits_0() {
    let a = Origin::start();
    let mut p = pier(&v1(a.addr()));
    let addr = p.listener("main");
    let mut idle = RawConn::connect(addr);
    assert_eq!(idle.get("/hello").unwrap().status, 200);

    let in_flight = std::thread::spawn(move || try_get(addr, "/slow/800"));
    assert!(wait_until(Duration::from_secs(5), || a.requests() == 2));
    let t = Instant::now();
    p.signal(sig::SIGTERM);

    // New connections are refused (or closed unanswered) while the old one finishes.
    assert!(
        wait_until(Duration::from_secs(2), || try_get(addr, "/hello").is_err()),
        "pier still answers new connections after SIGTERM"
    );
    let r = in_flight
        .join()
        .unwrap()
        .expect("in-flight request cut by SIGTERM");
    assert_eq!((r.status, r.body.as_slice()), (200, &b"slow\n"[..]));
    // An idle keep-alive connection is closed, not left hanging.
    assert!(idle.is_closed(Duration::from_secs(5)));
    let status = p
        .wait_exit(Duration::from_secs(10))
        .expect("pier did not exit after draining");
    assert!(status.success(), "exit status {status}");
    assert!(
        t.elapsed() < Duration::from_secs(5),
        "drain took {:?}",
        t.elapsed()
    );
}

#[test]
fn sigterm_gives_up_after_the_grace_period() {
    let a = Origin::start();
    let cfg = simple_config(&[a.addr()], "", "")
        .replace("grace_period = \"5s\"", "grace_period = \"1s\"");
    let mut p = pier(&cfg);
    let addr = p.listener("main");
    let in_flight = std::thread::spawn(move || try_get(addr, "/slow/20000"));
    assert!(wait_until(Duration::from_secs(5), || a.requests() == 1));
    let t = Instant::now();
    p.signal(sig::SIGTERM);
    let status = p
        .wait_exit(Duration::from_secs(10))
        .expect("pier did not exit after its grace period");
    assert!(status.success(), "exit status {status}");
    assert!(
        t.elapsed() < Duration::from_secs(4),
        "exit took {:?} with a 1s grace period",
        t.elapsed()
    );
    assert!(
        in_flight.join().unwrap().is_err(),
        "the cut request got a full response"
    );
}

#[test]
fn sigint_exits_at_once() {
    let a = Origin::start();
    let mut p = pier(&v1(a.addr()));
    let addr = p.listener("main");
    let in_flight = std::thread::spawn(move || try_get(addr, "/slow/20000"));
    assert!(wait_until(Duration::from_secs(5), || a.requests() == 1));
    let t = Instant::now();
    p.signal(sig::SIGINT);
    assert!(
        p.wait_exit(Duration::from_secs(3)).is_some(),
        "pier did not exit on SIGINT"
    );
    assert!(
        t.elapsed() < Duration::from_secs(2),
        "SIGINT exit took {:?}",
        t.elapsed()
    );
    let _ = in_flight.join();
}

#[test]
fn reload_switches_servers_and_limits() {
    let a = Origin::start_named("alpha");
    let b = Origin::start_named("beta");
    let mut p = pier(&v1(a.addr()));
    let addr = p.listener("main");
    assert_eq!(get(addr, "/name").body_str(), "alpha");
    let long = format!("/name?{}", "q".repeat(600));
    assert_eq!(get(addr, &long).status, 200);

    p.rewrite_config(&simple_config(
        &[b.addr()],
        "[limits]\nmax_uri_bytes = 256",
        "",
    ));
    p.signal(sig::SIGHUP);
    p.wait_generation(2);
    // New upstream servers for new connections and for the kept-alive one.
    for _ in 0..5 {
        assert_eq!(get(addr, "/name").body_str(), "beta");
    }
    // New limits.
    assert_local(&get(addr, &long), 414, "uri-too-long");
    // alpha's pooled connection is not used any more.
    let before = a.requests();
    for _ in 0..5 {
        assert_eq!(get(addr, "/name").body_str(), "beta");
    }
    assert_eq!(a.requests(), before);
}

#[test]
fn reload_applies_to_kept_alive_connections() {
    let a = Origin::start_named("alpha");
    let b = Origin::start_named("beta");
    let mut p = pier(&v1(a.addr()));
    let mut kept = RawConn::connect(p.listener("main"));
    assert_eq!(kept.get("/name").unwrap().body_str(), "alpha");
    p.rewrite_config(&v1(b.addr()));
    p.signal(sig::SIGHUP);
    p.wait_generation(2);
    // Neither dropped (the contract: no connection dropped) nor left on the old config.
    let r = kept
        .get("/name")
        .expect("kept-alive connection dropped by the reload");
    assert_eq!(r.body_str(), "beta");
}

/// Log rotation as logrotate does it with nginx: the file is moved, SIGUSR1
/// makes Pier open its path again; what came before stays in the moved
/// file, what comes after goes to the new one, nothing is lost.
#[test]
fn sigusr1_reopens_the_access_log_for_rotation() {
    let o = Origin::start();
    let dir = TempDir::new();
    let log = dir.path().join("access.log");
    let cfg = simple_config(&[o.addr()], "", "").replace(
        "access = \"off\"",
        &format!("access = \"{}\"", log.display()),
    );
    assert!(cfg.contains(&log.display().to_string()), "{cfg}");
    let pier = pier(&cfg);
    let lines = |p: &std::path::Path| {
        std::fs::read_to_string(p)
            .unwrap_or_default()
            .lines()
            .filter(|l| l.contains("?before") || l.contains("?after"))
            .map(str::to_string)
            .collect::<Vec<_>>()
    };
    let addr = pier.listener("main");
    for _ in 0..3 {
        assert_eq!(get(addr, "/hello?before").status, 200);
    }
    assert!(wait_until(Duration::from_secs(10), || lines(&log).len() == 3));
    let rotated = dir.path().join("access.log.1");
    std::fs::rename(&log, &rotated).unwrap();
    pier.signal(libc::SIGUSR1);
    assert!(
        wait_until(Duration::from_secs(10), || log.exists()),
        "{}",
        pier.logs()
    );
    for _ in 0..2 {
        assert_eq!(get(addr, "/hello?after").status, 200);
    }
    assert!(wait_until(Duration::from_secs(10), || lines(&log).len() == 2));
    let old = lines(&rotated);
    assert_eq!(old.len(), 3, "{old:?}");
    assert!(old.iter().all(|l| l.contains("?before")));
    assert!(lines(&log).iter().all(|l| l.contains("?after")));
}
