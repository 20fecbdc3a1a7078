//! Properties of the response-head parser and the body decoder, the same
//! invariants as the `response_head` fuzz target (fuzz/), run in `cargo test`:
//! - parsing arbitrary (and HTTP-shaped) bytes never panics;
//! - an accepted head ends a line, has a status in 100..=999, token header
//!   names, no CR/LF in values or reason;
//! - `body_len` agrees with the status and the headers;
//! - the head alone re-parses the same, one byte less is `Ok(None)`, and
//!   written back with `write::response_head` it parses to the same status,
//!   headers and framing;
//! - `BodyDecoder` gives the same verdict, end and payload fed whole or cut.

use pier_http::{write, BodyDecoder, BodyLen, HeadLimits, Method, ResponseHead};
use proptest::collection::vec;
use proptest::prelude::*;

fn config() -> ProptestConfig {
    ProptestConfig {
        cases: 1024,
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

fn tchar(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

/// Decode `rest` with `framing`, cut at `cut`: (verdict, used, payload, done).
fn decode(framing: BodyLen, rest: &[u8], cut: usize) -> (bool, usize, Vec<u8>, bool) {
    let mut d = BodyDecoder::new(framing);
    let mut payload = Vec::new();
    let mut used = 0;
    for piece in [&rest[..cut], &rest[cut..]] {
        if d.is_done() {
            break;
        }
        match d.decode(piece, |p| payload.extend_from_slice(p)) {
            Ok(n) => {
                assert!(n <= piece.len());
                assert!(d.is_done() || n == piece.len(), "stopped early, not done");
                used += n;
            }
            // Where it failed is the verdict; bytes consumed before it depend on the cut.
            Err(_) => return (false, 0, payload, false),
        }
    }
    if d.is_done() {
        let _ = d.trailers();
    }
    (true, used, payload, d.is_done())
}

/// Everything the fuzz target asserts; returns whether the head was accepted.
fn check(data: &[u8]) -> Result<bool, TestCaseError> {
    let limits = HeadLimits::default();
    let mut head = ResponseHead::default();
    let n = match head.parse(data, &limits) {
        Ok(Some(n)) => n,
        Ok(None) | Err(_) => return Ok(false),
    };
    prop_assert!(n <= data.len() && data[..n].ends_with(b"\n"));
    prop_assert!((100..=999).contains(&head.status));
    prop_assert!(head.version <= 1);
    prop_assert!(!head.reason().iter().any(|&b| b == b'\r' || b == b'\n'));
    let (mut te, mut cl) = (false, false);
    for (name, value) in head.headers.iter() {
        prop_assert!(!name.is_empty() && name.iter().all(|&b| tchar(b)));
        prop_assert!(!value.iter().any(|&b| b == b'\r' || b == b'\n'));
        te |= name.eq_ignore_ascii_case(b"transfer-encoding");
        cl |= name.eq_ignore_ascii_case(b"content-length");
    }
    let no_body = (100..200).contains(&head.status) || head.status == 204 || head.status == 304;
    prop_assert_eq!(head.body_len(Method::Head), Ok(BodyLen::None));
    let framing = head.body_len(Method::Get);
    match framing {
        Ok(BodyLen::None) => prop_assert!(no_body),
        Ok(BodyLen::Chunked) => prop_assert!(te && !no_body),
        Ok(BodyLen::Length(_)) => prop_assert!(cl && !te && !no_body),
        Ok(BodyLen::UntilClose) => prop_assert!(!no_body && (te || !cl)),
        Err(_) => prop_assert!(!no_body && (te || cl)),
    }

    let mut again = ResponseHead::default();
    prop_assert_eq!(again.parse(&data[..n], &limits), Ok(Some(n)));
    prop_assert_eq!(again.status, head.status);
    prop_assert_eq!(again.body_len(Method::Get), framing);
    prop_assert_eq!(again.parse(&data[..n - 1], &limits), Ok(None));

    let mut out = Vec::new();
    write::response_head(&mut out, &head, |_| false);
    out.extend_from_slice(b"\r\n");
    let mut written = ResponseHead::default();
    prop_assert_eq!(written.parse(&out, &limits), Ok(Some(out.len())));
    prop_assert_eq!(written.status, head.status);
    prop_assert!(written.headers.iter().eq(head.headers.iter()));
    prop_assert_eq!(written.body_len(Method::Get), framing);

    if let Ok(framing) = framing {
        let rest = &data[n..];
        let whole = decode(framing, rest, rest.len());
        for cut in [0, rest.len() / 3, rest.len() / 2] {
            prop_assert_eq!(&whole, &decode(framing, rest, cut));
        }
        if let BodyLen::Length(k) = framing {
            prop_assert_eq!(whole.1 as u64, k.min(rest.len() as u64));
            prop_assert_eq!(&whole.2[..], &rest[..whole.1]);
        }
    }
    Ok(true)
}

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

/// Responses built from common and near-miss pieces, then a body-ish tail.
fn response_noise() -> impl Strategy<Value = Vec<u8>> {
    let version = pick(
        &[b"HTTP/1.1", b"HTTP/1.0"],
        &[b"HTTP/1.2", b"HTTP/2", b"HTTP/1.1 "],
    );
    let sep = pick(&[b" "], &[b"  ", b"\t", b""]);
    let status = pick(
        &[
            b"200", b"204", b"304", b"100", b"101", b"103", b"404", b"999", b"500",
        ],
        &[b"099", b"2000", b"20", b"abc", b"000"],
    );
    let reason = pick(
        &[b" OK", b" Odd Reason", b"", b" "],
        &[b" \x80\xff", b" \x01"],
    );
    let eol = pick(&[b"\r\n", b"\n"], &[b"\r", b"\r\n ", b"\n\r"]);
    let name = pick(
        &[
            b"Content-Length",
            b"content-length",
            b"Transfer-Encoding",
            b"Connection",
            b"X-A",
            b"Set-Cookie",
        ],
        &[b"Content-Length ", b" X", b"Bad Name", b"\x01", b""],
    );
    let colon = pick(&[b":", b": ", b":\t"], &[b" :", b"::", b""]);
    let value = pick(
        &[
            b"chunked",
            b"gzip, chunked",
            b"gzip",
            b"close",
            b"0",
            b"5",
            b"10",
            b"5, 5",
            b"5,6",
            b"x",
            b"",
        ],
        &[
            b"+5",
            b"-1",
            b"18446744073709551616",
            b"\x00",
            b"\x80",
            b"\r",
            b"chunked, gzip",
        ],
    );
    let line = (name, colon, value, eol.clone()).prop_map(|(n, c, v, e)| [n, c, v, e].concat());
    let tail = pick(
        &[
            b"5\r\nhello\r\n0\r\n\r\n",
            b"hello",
            b"3\r\nabc\r\n0\r\nx-t: 1\r\n\r\nNEXT",
            b"",
        ],
        &[b"zz\r\n", b"5\r\nhel", b"0\r\n bad\r\n\r\n"],
    );
    (
        (version, sep, status, reason, eol.clone()),
        vec(line, 0..6),
        eol,
        tail,
    )
        .prop_map(|((v, s, st, r, e), lines, end, tail)| {
            let mut out = [v, s, st, r, e].concat();
            for l in lines {
                out.extend_from_slice(&l);
            }
            out.extend_from_slice(&end);
            out.extend_from_slice(&tail);
            out
        })
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn never_panics_on_arbitrary_bytes(buf in vec(any::<u8>(), 0..1024)) {
        check(&buf)?;
    }

    #[test]
    fn http_shaped_responses_keep_the_invariants(buf in response_noise()) {
        check(&buf)?;
    }
}

#[test]
fn the_fuzz_seeds_are_accepted_and_keep_the_invariants() {
    let dir =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/seeds/response_head");
    let mut n = 0;
    for e in std::fs::read_dir(&dir).unwrap() {
        let path = e.unwrap().path();
        let data = std::fs::read(&path).unwrap();
        let accepted = check(&data).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        assert!(accepted, "{} is not a response head", path.display());
        n += 1;
    }
    assert!(n >= 5, "{n} seeds");
}
