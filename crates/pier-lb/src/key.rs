//! Extracting the consistent-hash key from a request, without allocating.

use pier_config::HashKey;

/// The bytes to hash for `key`, borrowed from the request.
///
/// `header(name)` returns the value of a request header (name as configured,
/// matched case-insensitively by the caller). `Cookie` looks for `name=value`
/// in the `cookie` header; `Path` drops the query string (as nginx's `$uri`).
/// `None` (header or cookie absent) hashes to one stable default peer.
pub fn extract_hash_key<'a>(
    key: &HashKey,
    header: impl Fn(&str) -> Option<&'a [u8]>,
    client_ip: &'a [u8],
    path: &'a [u8],
) -> Option<&'a [u8]> {
    match key {
        HashKey::Header(name) => header(name),
        HashKey::Cookie(name) => header("cookie").and_then(|c| find_cookie(c, name.as_bytes())),
        HashKey::ClientIp => Some(client_ip),
        HashKey::Path => Some(match path.iter().position(|&b| b == b'?') {
            Some(q) => &path[..q],
            None => path,
        }),
    }
}

/// The value of cookie `name` in a `Cookie` header value
/// (`a=1; b=2`, RFC 6265 §4.2), surrounding double quotes removed.
/// Names compare case-sensitively, as browsers send them.
pub fn find_cookie<'a>(header: &'a [u8], name: &[u8]) -> Option<&'a [u8]> {
    header.split(|&b| b == b';').find_map(|pair| {
        let pair = trim(pair);
        let eq = pair.iter().position(|&b| b == b'=')?;
        if trim(&pair[..eq]) != name {
            return None;
        }
        let v = trim(&pair[eq + 1..]);
        Some(match v {
            [b'"', inner @ .., b'"'] => inner,
            _ => v,
        })
    })
}

fn trim(mut s: &[u8]) -> &[u8] {
    while let [b' ' | b'\t', rest @ ..] = s {
        s = rest;
    }
    while let [rest @ .., b' ' | b'\t'] = s {
        s = rest;
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cookie_found_among_others() {
        let h = b"a=1; session=abc123;b=2";
        assert_eq!(find_cookie(h, b"session"), Some(&b"abc123"[..]));
        assert_eq!(find_cookie(h, b"a"), Some(&b"1"[..]));
        assert_eq!(find_cookie(h, b"b"), Some(&b"2"[..]));
        assert_eq!(find_cookie(h, b"sess"), None);
        assert_eq!(find_cookie(h, b"Session"), None);
        assert_eq!(find_cookie(b"x=\"q v\"", b"x"), Some(&b"q v"[..]));
        assert_eq!(find_cookie(b"x=", b"x"), Some(&b""[..]));
        assert_eq!(find_cookie(b"novalue; y=1", b"novalue"), None);
        assert_eq!(find_cookie(b"", b"x"), None);
        assert_eq!(find_cookie(b"k=a=b", b"k"), Some(&b"a=b"[..]));
    }

    #[test]
    fn extract_each_kind() {
        let hdrs: &[(&str, &[u8])] = &[("x-user", b"u42"), ("cookie", b"sid=s9; t=1")];
        let header = |n: &str| {
            hdrs.iter()
                .find(|(k, _)| k.eq_ignore_ascii_case(n))
                .map(|&(_, v)| v)
        };
        let ip: &[u8] = b"10.1.2.3";
        let path: &[u8] = b"/a/b?x=1";
        let ex = |k: &HashKey| extract_hash_key(k, header, ip, path);
        assert_eq!(ex(&HashKey::Header("X-User".into())), Some(&b"u42"[..]));
        assert_eq!(ex(&HashKey::Header("x-none".into())), None);
        assert_eq!(ex(&HashKey::Cookie("sid".into())), Some(&b"s9"[..]));
        assert_eq!(ex(&HashKey::Cookie("zz".into())), None);
        assert_eq!(ex(&HashKey::ClientIp), Some(ip));
        assert_eq!(ex(&HashKey::Path), Some(&b"/a/b"[..]));
    }
}
