//! ResponseHead::parse on arbitrary bytes (as an origin might send them),
//! then the body framing it chose, for a GET and for a HEAD, and the body
//! decoder on the rest. Beyond "no panic", checks what an accepted head must
//! satisfy and that `body_len` agrees with the headers.
#![no_main]

use libfuzzer_sys::fuzz_target;
use pier_http::{write, BodyDecoder, BodyLen, HeadLimits, Method, ResponseHead};

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

fuzz_target!(|data: &[u8]| {
    let limits = HeadLimits::default();
    let mut head = ResponseHead::default();
    let n = match head.parse(data, &limits) {
        Ok(Some(n)) => n,
        Ok(None) | Err(_) => return,
    };
    assert!(n <= data.len() && data[..n].ends_with(b"\n"));
    assert!((100..=999).contains(&head.status));
    assert!(head.version <= 1);
    assert!(!head.reason().iter().any(|&b| b == b'\r' || b == b'\n'));
    let (mut te, mut cl) = (false, false);
    for (name, value) in head.headers.iter() {
        assert!(!name.is_empty() && name.iter().all(|&b| tchar(b)));
        assert!(!value.iter().any(|&b| b == b'\r' || b == b'\n'));
        te |= name.eq_ignore_ascii_case(b"transfer-encoding");
        cl |= name.eq_ignore_ascii_case(b"content-length");
    }
    let _ = head.keep_alive();

    // Framing agrees with the status and the headers.
    let no_body = (100..200).contains(&head.status) || head.status == 204 || head.status == 304;
    assert_eq!(head.body_len(Method::Head), Ok(BodyLen::None));
    let framing = head.body_len(Method::Get);
    match framing {
        Ok(BodyLen::None) => assert!(no_body),
        Ok(BodyLen::Chunked) => assert!(te && !no_body),
        Ok(BodyLen::Length(_)) => assert!(cl && !te && !no_body),
        Ok(BodyLen::UntilClose) => assert!(!no_body && (te || !cl)),
        Err(_) => assert!(!no_body && (te || cl)),
    }

    // Self-delimiting: the head alone parses the same; one byte less is partial.
    let mut again = ResponseHead::default();
    assert_eq!(again.parse(&data[..n], &limits), Ok(Some(n)));
    assert_eq!(again.status, head.status);
    assert_eq!(again.body_len(Method::Get), framing);
    if n - 1 <= limits.max_header_bytes.max(65536) {
        assert_eq!(again.parse(&data[..n - 1], &limits), Ok(None));
    }

    // Written back out, it parses to the same status and headers.
    let mut out = Vec::new();
    write::response_head(&mut out, &head, |_| false);
    out.extend_from_slice(b"\r\n");
    let mut written = ResponseHead::default();
    assert_eq!(written.parse(&out, &limits), Ok(Some(out.len())));
    assert_eq!(written.status, head.status);
    assert!(written.headers.iter().eq(head.headers.iter()));
    assert_eq!(written.body_len(Method::Get), framing);

    // The body decoder gives the same verdict, end and payload fed whole or cut.
    if let Ok(framing) = framing {
        let rest = &data[n..];
        let whole = decode(framing, rest, rest.len());
        let cut = decode(framing, rest, rest.len() / 2);
        assert_eq!(whole, cut);
        if let BodyLen::Length(k) = framing {
            assert_eq!(whole.1 as u64, k.min(rest.len() as u64));
            assert_eq!(whole.2, &rest[..whole.1]);
        }
    }
});
