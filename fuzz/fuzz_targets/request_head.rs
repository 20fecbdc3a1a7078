//! RequestHead::parse on arbitrary bytes, then the body framing it chose:
//! the chunked scanner on the rest when chunked, and the canonical form
//! (`canonicalize`: one authority, a normalised path). Beyond "no panic",
//! checks what an accepted head must satisfy (the anti-smuggling
//! invariants, docs/security.md).
#![no_main]

use libfuzzer_sys::fuzz_target;
use pier_http::canon::{needs_normalising, valid_authority};
use pier_http::{BodyLen, ChunkedScanner, HeadLimits, PathPolicy, RequestHead};

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

    // Canonical: origin-form (or `*` / CONNECT's authority-form), at most
    // one valid Host, a path that normalising again leaves alone; and a
    // Connection field never names framing or Host.
    let mut canon = again.clone();
    if canon.canonicalize(&PathPolicy::DEFAULT).is_ok() {
        let u = canon.uri();
        let m = canon.method();
        assert!(u.first() == Some(&b'/') || u == b"*" || m == b"CONNECT");
        assert!(canon.headers.get_all_known(pier_http::known::HOST).count() <= 1);
        if let Some(h) = canon.host() {
            assert!(valid_authority(h));
            assert!(!h.iter().any(u8::is_ascii_uppercase));
        }
        if u.first() == Some(&b'/') {
            let p = canon.path().to_vec();
            let mut twice = canon.clone();
            assert!(twice.canonicalize(&PathPolicy::DEFAULT).is_ok());
            assert_eq!(twice.path(), &p[..], "normalising is idempotent");
            assert!(!p.windows(2).any(|w| w == b"//"));
            let _ = needs_normalising(&p);
        }
        for v in canon.headers.get_all_known(pier_http::known::CONNECTION) {
            for t in v.split(|&b| b == b',') {
                let t = pier_http::headers::trim(t);
                assert!(!t.eq_ignore_ascii_case(b"content-length"));
                assert!(!t.eq_ignore_ascii_case(b"transfer-encoding"));
                assert!(!t.eq_ignore_ascii_case(b"host"));
            }
        }
    }

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
