//! Request smuggling: ambiguous or malformed requests get a 400 with a reason, the
//! connection is closed, and nothing reaches the origin (its request counter, which
//! also counts heads it could not parse, stays at zero).

mod common;

use std::time::Duration;

use common::*;

fn setup() -> (Origin, PierProcess) {
    let o = Origin::start();
    let p = pier(&simple_config(&[o.addr()], "", ""));
    (o, p)
}

/// Sends `raw` on a new connection and checks Pier refused it with one of `statuses`
/// and a reason, closed the connection, and forwarded nothing. A request that is fine
/// afterwards shows Pier is serving (so a refusal is not an outage).
#[track_caller]
fn assert_refused(
    p: &PierProcess,
    o: &Origin,
    what: &str,
    raw: &[u8],
    statuses: &[u16],
    check_origin: bool,
) {
    let mut c = RawConn::connect(p.listener("main"));
    // Pier may close while a long request is still being written: that is fine.
    let _ = c.try_send(raw);
    let r = c
        .read_response()
        .unwrap_or_else(|e| panic!("{what}: no response: {e}"));
    assert!(
        statuses.contains(&r.status),
        "{what}: status {} (wanted {statuses:?}), body {:?}",
        r.status,
        r.body_str()
    );
    let reason = r.pier_reason().unwrap_or_default().to_string();
    assert!(
        !reason.is_empty(),
        "{what}: no x-pier-reason: {:?}",
        r.headers
    );
    assert!(
        c.is_closed(Duration::from_secs(5)),
        "{what}: connection left open after a refused request"
    );
    // The origin counts a request when its head arrives, which may be a moment after
    // Pier answered. So first wait for Pier to have logged the refusal: anything it
    // sent upstream for that request, it sent before, on an upstream connection it
    // counted (there was none in its pool to reuse). Then a request that must be the
    // only one the origin counted.
    assert!(
        wait_local_count(p, r.status, &reason, 1.0) >= 1.0,
        "{what}: the refusal was never counted"
    );
    let went_upstream = upstream_exchanges(p);
    let before = o.requests();
    assert_eq!(get(p.listener("main"), "/hello").status, 200);
    if check_origin {
        assert_eq!(
            went_upstream, 0.0,
            "{what}: Pier went upstream for a refused request"
        );
        assert_eq!(
            (before, o.requests()),
            (0, 1),
            "{what}: the refused request reached the origin"
        );
    }
    // Reset the count for the next case.
    o.stop();
}

/// Runs each case against a fresh origin (so its counter starts at zero) behind one Pier.
fn each_case(cases: &[(&str, &[u8])], statuses: &[u16]) {
    for (what, raw) in cases {
        let (o, p) = setup();
        assert_refused(&p, &o, what, raw, statuses, true);
    }
}

#[test]
fn conflicting_content_length_and_transfer_encoding() {
    each_case(
        &[
            (
                "CL then TE",
                b"POST /echo HTTP/1.1\r\nhost: a\r\ncontent-length: 4\r\ntransfer-encoding: chunked\r\n\r\n0\r\n\r\nGET /hello HTTP/1.1\r\nhost: a\r\n\r\n",
            ),
            (
                "TE then CL",
                b"POST /echo HTTP/1.1\r\nhost: a\r\ntransfer-encoding: chunked\r\ncontent-length: 30\r\n\r\n0\r\n\r\nGET /hello HTTP/1.1\r\nhost: a\r\n\r\n",
            ),
        ],
        &[400],
    );
}

#[test]
fn duplicate_differing_content_length() {
    each_case(
        &[
            (
                "two CL headers",
                b"POST /echo HTTP/1.1\r\nhost: a\r\ncontent-length: 5\r\ncontent-length: 6\r\n\r\nhello!",
            ),
            (
                "CL list",
                b"POST /echo HTTP/1.1\r\nhost: a\r\ncontent-length: 5, 6\r\n\r\nhello!",
            ),
            (
                "CL with sign",
                b"POST /echo HTTP/1.1\r\nhost: a\r\ncontent-length: +5\r\n\r\nhello",
            ),
            (
                "CL not a number",
                b"POST /echo HTTP/1.1\r\nhost: a\r\ncontent-length: 0x5\r\n\r\nhello",
            ),
            (
                "CL overflow",
                b"POST /echo HTTP/1.1\r\nhost: a\r\ncontent-length: 99999999999999999999999\r\n\r\nhello",
            ),
        ],
        &[400],
    );
}

#[test]
fn transfer_encoding_not_ending_in_chunked() {
    // RFC 9112 section 6.3: a request whose final coding is not chunked has no reliable
    // length; it must be refused (400; Pier answers 501 for a coding it does not
    // implement, which refuses it just as well).
    each_case(
        &[
            (
                "TE gzip",
                b"POST /echo HTTP/1.1\r\nhost: a\r\ntransfer-encoding: gzip\r\n\r\n0\r\n\r\n",
            ),
            (
                "TE chunked, gzip",
                b"POST /echo HTTP/1.1\r\nhost: a\r\ntransfer-encoding: chunked, gzip\r\n\r\n0\r\n\r\n",
            ),
            (
                "TE xchunked",
                b"POST /echo HTTP/1.1\r\nhost: a\r\ntransfer-encoding: xchunked\r\n\r\n0\r\n\r\n",
            ),
        ],
        &[400, 501],
    );
}

const BAD_CHUNKS: &[(&str, &[u8])] = &[
            (
                "non-hex size",
                b"POST /echo HTTP/1.1\r\nhost: a\r\ntransfer-encoding: chunked\r\n\r\nzz\r\nhello\r\n0\r\n\r\n",
            ),
            (
                "negative size",
                b"POST /echo HTTP/1.1\r\nhost: a\r\ntransfer-encoding: chunked\r\n\r\n-5\r\nhello\r\n0\r\n\r\n",
            ),
            (
                "size overflow",
                b"POST /echo HTTP/1.1\r\nhost: a\r\ntransfer-encoding: chunked\r\n\r\n10000000000000005\r\nhello\r\n0\r\n\r\n",
            ),
            (
                "space inside size",
                b"POST /echo HTTP/1.1\r\nhost: a\r\ntransfer-encoding: chunked\r\n\r\n5 5\r\nhello\r\n0\r\n\r\n",
            ),
            (
                "bare LF after size",
                b"POST /echo HTTP/1.1\r\nhost: a\r\ntransfer-encoding: chunked\r\n\r\n5\nhello\r\n0\r\n\r\n",
            ),
        ];

#[test]
fn bad_chunk_sizes_are_refused() {
    for (what, raw) in BAD_CHUNKS {
        let (o, p) = setup();
        assert_refused(&p, &o, what, raw, &[400], false);
    }
}

#[test]

fn bad_chunk_sizes_never_reach_the_origin() {
    each_case(BAD_CHUNKS, &[400]);
}

#[test]
fn obs_fold() {
    each_case(
        &[
            (
                "folded custom header",
                b"GET /hello HTTP/1.1\r\nhost: a\r\nx-a: one\r\n two\r\n\r\n",
            ),
            (
                "folded transfer-encoding",
                b"POST /echo HTTP/1.1\r\nhost: a\r\ntransfer-encoding:\r\n chunked\r\n\r\n0\r\n\r\n",
            ),
        ],
        &[400],
    );
}

#[test]
fn invalid_header_names() {
    each_case(
        &[
            (
                "space before colon",
                b"POST /echo HTTP/1.1\r\nhost: a\r\ntransfer-encoding : chunked\r\n\r\n0\r\n\r\n",
            ),
            (
                "space inside name",
                b"GET /hello HTTP/1.1\r\nhost: a\r\nx a: b\r\n\r\n",
            ),
            (
                "control byte in name",
                b"GET /hello HTTP/1.1\r\nhost: a\r\nx\x01a: b\r\n\r\n",
            ),
            (
                "empty name",
                b"GET /hello HTTP/1.1\r\nhost: a\r\n: b\r\n\r\n",
            ),
            (
                "no colon",
                b"GET /hello HTTP/1.1\r\nhost: a\r\nbad header\r\n\r\n",
            ),
        ],
        &[400],
    );
}

#[test]
fn nul_and_cr_in_header_values() {
    each_case(
        &[
            (
                "NUL in value",
                b"GET /hello HTTP/1.1\r\nhost: a\r\nx-a: a\x00b\r\n\r\n",
            ),
            (
                "bare CR in value",
                b"GET /hello HTTP/1.1\r\nhost: a\r\nx-a: a\rb\r\n\r\n",
            ),
        ],
        &[400],
    );
}

#[test]
fn host_rules() {
    // RFC 9112 section 3.2: an HTTP/1.1 request without Host, or with more than one,
    // MUST get a 400.
    each_case(
        &[
            ("no host", b"GET /hello HTTP/1.1\r\n\r\n"),
            (
                "two hosts",
                b"GET /hello HTTP/1.1\r\nhost: a\r\nhost: b\r\n\r\n",
            ),
        ],
        &[400],
    );
}

#[test]
fn malformed_request_lines() {
    each_case(
        &[
            ("no version", b"GET /hello\r\nhost: a\r\n\r\n"),
            ("bad version", b"GET /hello HTTP/1.x\r\nhost: a\r\n\r\n"),
            ("two spaces", b"GET  /hello HTTP/1.1\r\nhost: a\r\n\r\n"),
            (
                "space in target",
                b"GET /hel lo HTTP/1.1\r\nhost: a\r\n\r\n",
            ),
        ],
        &[400],
    );
}

#[test]
fn the_request_after_a_refused_one_is_never_forwarded() {
    // The classic CL.TE attack: if anything read the body by one length and the rest by
    // the other, the "smuggled" GET /die would reach the origin.
    let (o, p) = setup();
    let mut c = RawConn::connect(p.listener("main"));
    c.send(b"POST /hello HTTP/1.1\r\nhost: a\r\ncontent-length: 6\r\ntransfer-encoding: chunked\r\n\r\n0\r\n\r\nGET /die HTTP/1.1\r\nhost: a\r\n\r\n");
    let r = c.read_response().unwrap();
    assert_eq!(r.status, 400);
    // Nothing else comes back on this connection.
    assert!(c.is_closed(Duration::from_secs(5)));
    assert!(
        c.buffered().is_empty(),
        "{:?}",
        String::from_utf8_lossy(c.buffered())
    );
    // Pier logged the refusal (after anything it could have sent upstream for it).
    assert!(wait_local_count(&p, 400, r.pier_reason().unwrap_or_default(), 1.0) >= 1.0);
    assert_eq!(upstream_exchanges(&p), 0.0, "Pier went upstream");
    assert_eq!(o.requests(), 0);
}
