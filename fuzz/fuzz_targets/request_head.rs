//! RequestHead::parse on arbitrary bytes, then the body framing it chose:
//! the chunked scanner on the rest when chunked. Beyond "no panic", checks
//! what an accepted head must satisfy (the anti-smuggling invariants).
#![no_main]

use libfuzzer_sys::fuzz_target;
use pier_http::{BodyLen, ChunkedScanner, HeadLimits, RequestHead};

fn tchar(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

fuzz_target!(|data: &[u8]| {
    let limits = HeadLimits::default();
    let mut head = RequestHead::default();
    let n = match head.parse(data, &limits) {
        Ok(Some(n)) => n,
        Ok(None) | Err(_) => return,
    };
    assert!(n <= data.len() && data[..n].ends_with(b"\n"));
    assert!(head.method().iter().all(|&b| tchar(b)));
    let (mut te, mut cl) = (false, false);
    for (name, value) in head.headers.iter() {
        assert!(!name.is_empty() && name.iter().all(|&b| tchar(b)));
        assert!(!value.iter().any(|&b| b == 0 || b == b'\r' || b == b'\n'));
        te |= name.eq_ignore_ascii_case(b"transfer-encoding");
        cl |= name.eq_ignore_ascii_case(b"content-length");
    }
    let framing = head.body_len();
    assert!(
        !(te && cl),
        "accepted both Transfer-Encoding and Content-Length"
    );
    assert_eq!(te, framing == BodyLen::Chunked);
    assert!(framing != BodyLen::UntilClose);
    if te {
        assert_eq!(head.version, 1, "Transfer-Encoding accepted in HTTP/1.0");
    }

    // Self-delimiting: the head alone parses the same; one byte less is partial.
    let mut again = RequestHead::default();
    assert_eq!(again.parse(&data[..n], &limits), Ok(Some(n)));
    assert_eq!(again.body_len(), framing);
    assert_eq!(again.parse(&data[..n - 1], &limits), Ok(None));

    if framing == BodyLen::Chunked {
        let rest = &data[n..];
        let mut whole = ChunkedScanner::new();
        let got = whole.feed(rest);
        if let Ok(used) = got {
            assert!(used <= rest.len());
            assert!(whole.is_done() || used == rest.len());
        }
        // Split in two: the same verdict and end.
        let cut = rest.len() / 2;
        let mut split = ChunkedScanner::new();
        let got2 = split.feed(&rest[..cut]).and_then(|a| {
            if split.is_done() {
                Ok(a)
            } else {
                split.feed(&rest[cut..]).map(|b| a + b)
            }
        });
        assert_eq!(got, got2);
        assert_eq!(whole.is_done(), split.is_done());
    }
});
