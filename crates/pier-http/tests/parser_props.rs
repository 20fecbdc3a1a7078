//! Properties of the request parser and the chunked scanner:
//! - parsing arbitrary (and HTTP-shaped) bytes never panics, and whatever it
//!   accepts satisfies the anti-smuggling invariants;
//! - a generated valid request round-trips (method, target, version,
//!   headers, framing);
//! - every strict prefix of a valid head is `Ok(None)`, and the whole gives
//!   the same result however the bytes arrived;
//! - the chunked scanner gives the same verdict, end and payload fed whole or
//!   in arbitrary pieces.

use pier_error::Kind;
use pier_http::{BodyLen, ChunkedScanner, HeadLimits, RequestHead};
use proptest::collection::vec;
use proptest::prelude::*;

fn config() -> ProptestConfig {
    // Bounded: the whole pier-http suite stays well under 20 s in debug.
    ProptestConfig {
        cases: 1024,
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

fn is_tchar(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

/// What any accepted head must satisfy, whatever the input.
fn check_accepted(
    buf: &[u8],
    n: usize,
    h: &RequestHead,
    limits: &HeadLimits,
) -> Result<(), TestCaseError> {
    prop_assert!(n <= buf.len());
    prop_assert!(buf[..n].ends_with(b"\n"), "head does not end a line");
    prop_assert!(!h.method().is_empty() && h.method().iter().all(|&b| is_tchar(b)));
    prop_assert!(!h.uri().is_empty());
    prop_assert!(h.uri().iter().all(|&b| b > b' ' && b != 0x7f));
    let (mut te, mut cl) = (0, Vec::new());
    for (name, value) in h.headers.iter() {
        prop_assert!(!name.is_empty() && name.iter().all(|&b| is_tchar(b)));
        prop_assert!(!value.iter().any(|&b| b == b'\r' || b == b'\n' || b == 0));
        if name.eq_ignore_ascii_case(b"transfer-encoding") {
            te += 1;
        }
        if name.eq_ignore_ascii_case(b"content-length") {
            cl.push(value);
        }
    }
    let framing = h.body_len();
    prop_assert!(
        framing != BodyLen::UntilClose,
        "a request is never read to close"
    );
    if te > 0 {
        prop_assert!(
            cl.is_empty(),
            "accepted both Transfer-Encoding and Content-Length"
        );
        prop_assert_eq!(h.version, 1, "accepted Transfer-Encoding in HTTP/1.0");
        prop_assert_eq!(framing, BodyLen::Chunked);
    } else if cl.is_empty() {
        prop_assert_eq!(framing, BodyLen::None);
    } else {
        // Every listed value is the same decimal, and it is the framing.
        let want = match framing {
            BodyLen::Length(n) => n,
            BodyLen::None => 0,
            other => return Err(TestCaseError::fail(format!("framing {other:?} with CL"))),
        };
        for v in cl {
            for part in v.split(|&b| b == b',') {
                let part = String::from_utf8_lossy(part);
                let part = part.trim_matches([' ', '\t']);
                prop_assert!(part.bytes().all(|b| b.is_ascii_digit()));
                prop_assert_eq!(part.parse::<u64>().ok(), Some(want));
            }
        }
    }
    // The head is self-delimiting: parsing just those bytes agrees.
    let mut again = RequestHead::default();
    prop_assert_eq!(again.parse(&buf[..n], limits), Ok(Some(n)));
    prop_assert_eq!(again.body_len(), framing);
    Ok(())
}

/// Mostly a well-formed piece, sometimes a near-miss, rarely random bytes.
fn pick(
    good: &'static [&'static [u8]],
    bad: &'static [&'static [u8]],
) -> impl Strategy<Value = Vec<u8>> + Clone {
    prop_oneof![
        80 => proptest::sample::select(good).prop_map(<[u8]>::to_vec),
        4 => proptest::sample::select(bad).prop_map(<[u8]>::to_vec),
        1 => vec(any::<u8>(), 1..3),
    ]
}

/// Requests built from near-miss pieces (the smuggling shapes: TE/CL
/// variants, odd separators, bare CR/LF, control bytes), so that many parse
/// and the accepted ones exercise the invariants.
fn http_noise() -> impl Strategy<Value = Vec<u8>> {
    let method = pick(
        &[b"GET", b"POST", b"PUT", b"HEAD"],
        &[b"G\x01T", b"", b"GET "],
    );
    let sep = pick(&[b" "], &[b"\t", b"  ", b"\x0b"]);
    let target = pick(
        &[b"/", b"/a?b=c", b"*", b"http://h/x"],
        &[b"/a b", b"/\x00", b""],
    );
    let version = pick(
        &[b"HTTP/1.1", b"HTTP/1.0"],
        &[b"HTTP/1.2", b"HTTP/1.1 ", b"HTTP/2"],
    );
    let eol = pick(&[b"\r\n", b"\n"], &[b"\r", b"\r\n ", b"\r\n\t", b"\n\r"]);
    let name = pick(
        &[
            b"Content-Length",
            b"content-length",
            b"Transfer-Encoding",
            b"TRANSFER-ENCODING",
            b"Host",
            b"X-A",
            b"Connection",
            b"Transfer_Encoding",
        ],
        &[
            b"Content-Length ",
            b" Transfer-Encoding",
            b"\x01Content-Length",
            b"Transfer-Encoding\t",
            b"",
        ],
    );
    let colon = pick(&[b":", b": ", b":\t"], &[b" :", b"::", b""]);
    let value = pick(
        &[
            b"chunked",
            b"Chunked",
            b"gzip, chunked",
            b"gzip",
            b"identity",
            b"0",
            b"5",
            b"10",
            b"5, 5",
            b"5,6",
            b"x",
            b"",
            b" ",
            b",",
        ],
        &[
            b"+5",
            b"-1",
            b"0x5",
            b"18446744073709551616",
            b"\x00",
            b"\x01",
            b"\x0b",
            b"\x80",
            b"\r",
            b"\n",
            b";q=1",
            b"chunked, chunked",
        ],
    );
    let line = (name, colon, vec(value, 1..3), eol.clone())
        .prop_map(|(n, c, v, e)| [n, c, v.concat(), e].concat());
    (
        (method, sep.clone(), target, sep, version, eol.clone()),
        any::<bool>(),
        vec(line, 0..6),
        eol,
    )
        .prop_map(|((m, s1, t, s2, v, e), host, lines, end)| {
            let mut out = [m, s1, t, s2, v, e].concat();
            if host {
                out.extend_from_slice(b"Host: h\r\n");
            }
            for l in lines {
                out.extend_from_slice(&l);
            }
            out.extend_from_slice(&end);
            out
        })
}

fn limits() -> impl Strategy<Value = HeadLimits> {
    (1usize..20000, 1usize..120, 1usize..9000).prop_map(|(b, h, u)| HeadLimits {
        max_header_bytes: b,
        max_headers: h,
        max_uri_bytes: u,
    })
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn never_panics_on_arbitrary_bytes(buf in vec(any::<u8>(), 0..1024), l in limits()) {
        let mut h = RequestHead::default();
        if let Ok(Some(n)) = h.parse(&buf, &l) {
            check_accepted(&buf, n, &h, &l)?;
        }
    }

    #[test]
    fn http_shaped_noise_keeps_the_invariants(buf in http_noise()) {
        let mut h = RequestHead::default();
        if let Ok(Some(n)) = h.parse(&buf, &HeadLimits::default()) {
            check_accepted(&buf, n, &h, &HeadLimits::default())?;
        }
    }

    /// A head the generator knows is valid followed by noise (pipelined
    /// bytes): accepted or not, never a panic, invariants when accepted.
    #[test]
    fn valid_head_then_noise(r in request(), tail in http_noise()) {
        let mut buf = r.bytes.clone();
        buf.extend_from_slice(&tail);
        let mut h = RequestHead::default();
        let got = h.parse(&buf, &HeadLimits::default());
        prop_assert_eq!(got, Ok(Some(r.bytes.len())));
        check_accepted(&buf, r.bytes.len(), &h, &HeadLimits::default())?;
    }

    #[test]
    fn valid_request_round_trips(r in request()) {
        let mut h = RequestHead::default();
        let n = h.parse(&r.bytes, &HeadLimits::default());
        prop_assert_eq!(n, Ok(Some(r.bytes.len())), "{:?}", String::from_utf8_lossy(&r.bytes));
        prop_assert_eq!(h.method(), r.method.as_bytes());
        prop_assert_eq!(h.uri(), r.uri.as_bytes());
        prop_assert_eq!(h.path(), r.uri.split('?').next().unwrap().as_bytes());
        prop_assert_eq!(h.version, r.version);
        prop_assert_eq!(h.body_len(), r.framing);
        let got: Vec<(Vec<u8>, Vec<u8>)> =
            h.headers.iter().map(|(n, v)| (n.to_vec(), v.to_vec())).collect();
        let want: Vec<(Vec<u8>, Vec<u8>)> =
            r.headers.iter().map(|(n, v)| (n.as_bytes().to_vec(), v.clone())).collect();
        prop_assert_eq!(got, want);
        prop_assert_eq!(h.host(), Some(&b"example.test"[..]));
        check_accepted(&r.bytes, r.bytes.len(), &h, &HeadLimits::default())?;
    }

    /// Every strict prefix of a valid head needs more bytes; the whole head,
    /// and any longer prefix of a pipelined stream, gives the same result.
    #[test]
    fn any_split_is_partial_then_the_same(r in request(), seed in any::<u64>()) {
        let limits = HeadLimits::default();
        let mut whole = RequestHead::default();
        let n = r.bytes.len();
        prop_assert_eq!(whole.parse(&r.bytes, &limits), Ok(Some(n)));
        let mut stream = r.bytes.clone();
        stream.extend_from_slice(b"GET /next HTTP/1.1\r\nHost: n\r\n\r\n");
        // One head instance reused across attempts, as a connection does.
        let mut h = RequestHead::default();
        for k in 0..n {
            prop_assert_eq!(h.parse(&stream[..k], &limits), Ok(None), "prefix {}", k);
        }
        // A few longer prefixes (all of them would be slow in debug).
        let mut x = seed | 1;
        for _ in 0..4 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let k = n + (x as usize) % (stream.len() - n + 1);
            prop_assert_eq!(h.parse(&stream[..k], &limits), Ok(Some(n)));
            prop_assert_eq!(h.method(), whole.method());
            prop_assert_eq!(h.uri(), whole.uri());
            prop_assert_eq!(h.body_len(), whole.body_len());
            let a: Vec<_> = h.headers.iter().collect();
            let b: Vec<_> = whole.headers.iter().collect();
            prop_assert_eq!(a, b);
        }
    }

    /// Fed whole or in arbitrary pieces, the scanner agrees on the verdict,
    /// where the body ends, and the payload; a generated valid body is
    /// accepted, ends exactly before what follows, and yields its payload.
    #[test]
    fn chunked_any_split_same_result(b in chunked_body(), cuts in vec(0usize..4096, 0..12)) {
        let follow: &[u8] = b"GET / HTTP/1.1\r\n";
        let mut input = b.bytes.clone();
        input.extend_from_slice(follow);
        let whole = scan(&input, &[]);
        let split = scan(&input, &cuts);
        prop_assert_eq!(&whole, &split);
        prop_assert_eq!(whole, Scan::Done(b.bytes.len(), b.payload));
    }

    #[test]
    fn chunked_mutations_same_result(
        b in chunked_body(),
        edits in vec((any::<usize>(), any::<u8>(), 0u8..3), 1..4),
        cuts in vec(0usize..4096, 0..12),
    ) {
        let mut input = b.bytes.clone();
        for (at, byte, op) in edits {
            let at = at % (input.len() + 1);
            match op {
                0 => input.insert(at, byte),
                1 if at < input.len() => input[at] = byte,
                _ if at < input.len() => {
                    input.remove(at);
                }
                _ => input.push(byte),
            }
        }
        prop_assert_eq!(scan(&input, &[]), scan(&input, &cuts));
    }

    #[test]
    fn chunked_arbitrary_bytes_same_result(
        input in vec(any::<u8>(), 0..256),
        cuts in vec(0usize..256, 0..12),
    ) {
        prop_assert_eq!(scan(&input, &[]), scan(&input, &cuts));
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Scan {
    /// Body complete after this many bytes; the decoded payload.
    Done(usize, Vec<u8>),
    /// Input ran out before the body ended.
    More(Vec<u8>),
    Err(Kind),
}

/// Feed `input` cut at `cuts` (positions taken modulo the length, sorted).
fn scan(input: &[u8], cuts: &[usize]) -> Scan {
    let mut points: Vec<usize> = cuts.iter().map(|c| c % (input.len() + 1)).collect();
    points.push(input.len());
    points.sort_unstable();
    let mut s = ChunkedScanner::new();
    let mut payload = Vec::new();
    let mut at = 0;
    for p in points {
        if p <= at {
            continue;
        }
        let piece = &input[at..p];
        match s.feed_data(piece, |r| payload.extend_from_slice(&piece[r])) {
            Err(k) => return Scan::Err(k),
            Ok(used) => {
                assert!(used <= piece.len());
                if s.is_done() {
                    return Scan::Done(at + used, payload);
                }
                assert_eq!(used, piece.len(), "stopped early without being done");
            }
        }
        at = p;
    }
    Scan::More(payload)
}

#[derive(Debug, Clone)]
struct Body {
    bytes: Vec<u8>,
    payload: Vec<u8>,
}

fn chunked_body() -> impl Strategy<Value = Body> {
    let chunk = (
        vec(any::<u8>(), 1..64),
        any::<bool>(),
        proptest::option::of("[a-z]{1,5}(=[a-z0-9]{1,5})?"),
        0usize..3,
    );
    let trailer = ("[A-Za-z][A-Za-z0-9-]{0,10}", "[ -~]{0,20}");
    (
        vec(chunk, 0..5),
        vec(trailer, 0..3),
        proptest::option::of("[a-z]{1,5}"),
    )
        .prop_map(|(chunks, trailers, last_ext)| {
            let mut bytes = Vec::new();
            let mut payload = Vec::new();
            for (data, upper, ext, zeros) in chunks {
                let size = format!("{}{:x}", "0".repeat(zeros), data.len());
                let size = if upper { size.to_uppercase() } else { size };
                bytes.extend_from_slice(size.as_bytes());
                if let Some(e) = ext {
                    bytes.push(b';');
                    bytes.extend_from_slice(e.as_bytes());
                }
                bytes.extend_from_slice(b"\r\n");
                bytes.extend_from_slice(&data);
                bytes.extend_from_slice(b"\r\n");
                payload.extend_from_slice(&data);
            }
            bytes.push(b'0');
            if let Some(e) = last_ext {
                bytes.push(b';');
                bytes.extend_from_slice(e.as_bytes());
            }
            bytes.extend_from_slice(b"\r\n");
            for (n, v) in trailers {
                bytes.extend_from_slice(format!("{n}: {v}\r\n").as_bytes());
            }
            bytes.extend_from_slice(b"\r\n");
            Body { bytes, payload }
        })
}

#[derive(Debug, Clone)]
struct Req {
    bytes: Vec<u8>,
    method: String,
    uri: String,
    version: u8,
    headers: Vec<(String, Vec<u8>)>,
    framing: BodyLen,
}

fn header_value() -> impl Strategy<Value = Vec<u8>> {
    // field-content: visible bytes (with obs-text) and inner SP/HTAB, never
    // leading or trailing whitespace.
    let vchar = prop_oneof![0x21u8..=0x7e, 0x80u8..=0xff];
    (
        vec(vchar.clone(), 0..3),
        vec(
            (
                vec(proptest::sample::select(vec![b' ', b'\t']), 1..3),
                vec(vchar, 1..8),
            ),
            0..4,
        ),
    )
        .prop_map(|(first, rest)| {
            let mut v = first;
            if v.is_empty() && !rest.is_empty() {
                v.push(b'v');
            }
            for (ws, word) in rest {
                v.extend(ws);
                v.extend(word);
            }
            v
        })
}

fn request() -> impl Strategy<Value = Req> {
    let method = prop_oneof![
        Just("GET".to_string()),
        Just("POST".to_string()),
        Just("PUT".to_string()),
        Just("DELETE".to_string()),
        "[A-Z]{1,10}",
        "[a-z!#$%&'*+.^_`|~-]{1,8}",
    ];
    let uri = prop_oneof![
        "/[A-Za-z0-9._~%!$&'()*+,;=:@/-]{0,40}",
        "/[a-z0-9/]{0,20}\\?[A-Za-z0-9=&%+-]{0,30}",
        Just("*".to_string()),
        "http://[a-z]{1,10}\\.test(:[0-9]{2,4})?/[a-z]{0,10}",
    ];
    let name = "[Xx]-[A-Za-z0-9!#$%&'*+.^_`|~-]{1,16}";
    let headers = vec((name, header_value(), "[ \t]{0,2}", "[ \t]{0,2}"), 0..12);
    let framing = prop_oneof![
        Just(None),
        (0u64..1_000_000).prop_map(Some),
        // The largest length Pier takes: 19 digits (it refuses 20-digit ones).
        Just(Some(9_999_999_999_999_999_999)),
    ];
    (
        method,
        uri,
        any::<bool>(),
        headers,
        framing,
        any::<bool>(),
        any::<bool>(),
    )
        .prop_map(|(method, uri, http11, hs, framing, chunked, lf_only)| {
            let eol: &[u8] = if lf_only { b"\n" } else { b"\r\n" };
            let version = u8::from(http11 || chunked);
            let mut bytes = Vec::new();
            bytes.extend_from_slice(method.as_bytes());
            bytes.push(b' ');
            bytes.extend_from_slice(uri.as_bytes());
            bytes.extend_from_slice(if version == 1 {
                b" HTTP/1.1"
            } else {
                b" HTTP/1.0"
            });
            bytes.extend_from_slice(eol);
            let mut headers = vec![("Host".to_string(), b"example.test".to_vec())];
            bytes.extend_from_slice(b"Host: example.test");
            bytes.extend_from_slice(eol);
            let mut body = BodyLen::None;
            let mut framing_line = |bytes: &mut Vec<u8>, headers: &mut Vec<(String, Vec<u8>)>| {
                if chunked {
                    headers.push(("Transfer-Encoding".into(), b"chunked".to_vec()));
                    bytes.extend_from_slice(b"Transfer-Encoding: chunked");
                    bytes.extend_from_slice(eol);
                    body = BodyLen::Chunked;
                } else if let Some(n) = framing {
                    let v = n.to_string().into_bytes();
                    bytes.extend_from_slice(b"Content-Length: ");
                    bytes.extend_from_slice(&v);
                    bytes.extend_from_slice(eol);
                    headers.push(("Content-Length".into(), v));
                    body = if n == 0 {
                        BodyLen::None
                    } else {
                        BodyLen::Length(n)
                    };
                }
            };
            let at = hs.len() / 2;
            for (i, (n, v, pre, post)) in hs.into_iter().enumerate() {
                if i == at {
                    framing_line(&mut bytes, &mut headers);
                }
                bytes.extend_from_slice(n.as_bytes());
                bytes.push(b':');
                bytes.extend_from_slice(pre.as_bytes());
                bytes.extend_from_slice(&v);
                bytes.extend_from_slice(post.as_bytes());
                bytes.extend_from_slice(eol);
                headers.push((n, v));
            }
            if headers.len() == 1 {
                framing_line(&mut bytes, &mut headers);
            }
            bytes.extend_from_slice(eol);
            Req {
                bytes,
                method,
                uri,
                version,
                headers,
                framing: body,
            }
        })
}
