//! A request's one authority and one path, decided once after parsing and
//! read by everything after: the router, the cache key, the upstream head,
//! logs, analytics and Lua. An edge is attacked through the gaps between two
//! parsers (docs/security.md); these rules close the ones a request target
//! opens:
//!
//! - an absolute-form target's authority replaces Host (RFC 9112 §3.2.2)
//!   and the target becomes origin-form; no other form passes except `*`
//!   for OPTIONS and authority-form for CONNECT (refused later, 405);
//! - the authority is `host[:port]`, lower-cased, one trailing dot dropped;
//! - the path is normalised as nginx and Envoy match routes: unreserved
//!   characters percent-decoded (RFC 3986 §6.2.2.2), other escapes'
//!   hex upper-cased, dot-segments removed (§5.2.4), slashes merged; a
//!   dot-segment above the root and a malformed escape are refused, and an
//!   encoded slash or backslash (`%2F`, `%5C`) is refused, decoded or kept
//!   as [`EscapedSlashes`] says. What is routed is what goes upstream: there
//!   is no second, raw view of the path for an origin to resolve otherwise.

use crate::head::{Method, RequestHead};
use crate::known::HOST;
use pier_error::Kind;

/// `[http] escaped_slashes`: what an encoded `/` or `\` in a path does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum EscapedSlashes {
    /// 400: the safe default at an edge. An origin that decodes `%2F`
    /// would see other segments than the router did.
    #[default]
    Reject,
    /// `%2F` becomes `/` before routing and upstream alike (`%5C` is
    /// refused: no origin should see a raw backslash it may take as `/`).
    Decode,
    /// Kept as an ordinary character: routes and the origin see `%2F`.
    /// Only for origins known not to decode it (Envoy's default).
    Keep,
}

/// How paths are made canonical (`[http]`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PathPolicy {
    pub escaped_slashes: EscapedSlashes,
    /// `//a` is `/a` (nginx's `merge_slashes on`).
    pub merge_slashes: bool,
}

impl PathPolicy {
    pub const DEFAULT: PathPolicy = PathPolicy {
        escaped_slashes: EscapedSlashes::Reject,
        merge_slashes: true,
    };
}

impl Default for PathPolicy {
    fn default() -> Self {
        Self::DEFAULT
    }
}

impl RequestHead {
    /// Make the target and authority canonical (module docs). A request
    /// that passes is origin-form with at most one, valid, Host.
    pub fn canonicalize(&mut self, policy: &PathPolicy) -> Result<(), Kind> {
        let u = self.uri();
        if u.first() != Some(&b'/') {
            if u == b"*" && self.method_kind() == Method::Options {
                // No path; the authority is canonical all the same.
                return self.canonical_host();
            }
            if self.method_kind() == Method::Connect {
                // Authority-form; the driver answers 405 (no CONNECT proxy).
                return Ok(());
            }
            let Some((authority, rest)) = self.absolute_form() else {
                return Err(Kind::InvalidRequestLine);
            };
            if !valid_authority(authority) {
                return Err(Kind::InvalidHost);
            }
            // Rare: copies are fine. The target keeps its query.
            let authority = authority.to_vec();
            let mut target = Vec::with_capacity(rest.len() + 1);
            if rest.first() != Some(&b'/') {
                target.push(b'/');
            }
            target.extend_from_slice(rest);
            self.headers.insert(b"Host", &authority);
            self.set_uri(&target);
        }
        self.canonical_host()?;
        self.canonical_path(policy)
    }

    fn canonical_host(&mut self) -> Result<(), Kind> {
        let Some(h) = self.headers.get_known(HOST) else {
            return Ok(());
        };
        if !valid_authority(h) {
            return Err(Kind::InvalidHost);
        }
        let upper = h.iter().any(u8::is_ascii_uppercase);
        let dot = host_part(h).ends_with(b".");
        if upper || dot {
            self.headers.rewrite_known_value(HOST, |v| {
                v.make_ascii_lowercase();
                let hl = host_part(v).len();
                if hl > 1 && v[hl - 1] == b'.' {
                    v.copy_within(hl.., hl - 1);
                    v.len() - 1
                } else {
                    v.len()
                }
            });
        }
        Ok(())
    }

    fn canonical_path(&mut self, policy: &PathPolicy) -> Result<(), Kind> {
        let path = self.path();
        if path.first() != Some(&b'/') || !needs_normalising(path) {
            return Ok(());
        }
        let mut out = Vec::with_capacity(self.uri().len());
        normalise_path(path, policy, &mut out)?;
        if let Some(q) = self.query() {
            out.push(b'?');
            out.extend_from_slice(q);
        }
        self.set_uri(&out);
        Ok(())
    }
}

/// The host of `host[:port]` (an IP literal with its brackets).
fn host_part(a: &[u8]) -> &[u8] {
    if a.first() == Some(&b'[') {
        return match memchr::memchr(b']', a) {
            Some(i) => &a[..=i],
            None => a,
        };
    }
    match memchr::memchr(b':', a) {
        Some(i) => &a[..i],
        None => a,
    }
}

/// `host[:port]`: a reg-name of letters, digits, `-._~` (no escapes, no
/// userinfo, no second colon) or a bracketed IPv6 literal, and a port of
/// 1–5 digits up to 65535.
pub fn valid_authority(a: &[u8]) -> bool {
    let port = if a.first() == Some(&b'[') {
        let Some(end) = memchr::memchr(b']', a) else {
            return false;
        };
        let inner = &a[1..end];
        if inner.is_empty()
            || !inner
                .iter()
                .all(|&b| b.is_ascii_hexdigit() || b == b':' || b == b'.')
        {
            return false;
        }
        &a[end + 1..]
    } else {
        let i = memchr::memchr(b':', a).unwrap_or(a.len());
        let host = &a[..i];
        if host.is_empty()
            || !host
                .iter()
                .all(|&b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~'))
        {
            return false;
        }
        &a[i..]
    };
    match port {
        [] => true,
        [b':', digits @ ..] => {
            !digits.is_empty()
                && digits.len() <= 5
                && digits.iter().all(u8::is_ascii_digit)
                && digits.iter().fold(0u32, |n, &d| n * 10 + (d - b'0') as u32) <= 65535
        }
        _ => false,
    }
}

/// Whether [`normalise_path`] could change `path`: an escape, or a slash
/// followed by a slash or a dot. One pass, no allocation (the common path).
#[inline]
pub fn needs_normalising(path: &[u8]) -> bool {
    let mut prev = 0u8;
    for &b in path {
        if b == b'%' || (prev == b'/' && (b == b'/' || b == b'.')) {
            return true;
        }
        prev = b;
    }
    false
}

fn hex(b: u8) -> Option<u8> {
    match b {
        b'0'..=b'9' => Some(b - b'0'),
        b'a'..=b'f' => Some(b - b'a' + 10),
        b'A'..=b'F' => Some(b - b'A' + 10),
        _ => None,
    }
}

fn unreserved(b: u8) -> bool {
    b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~')
}

/// The canonical form of an origin-form `path` (no query) into `out`
/// (module docs). `Err(InvalidPath)` for what is refused.
pub fn normalise_path(path: &[u8], policy: &PathPolicy, out: &mut Vec<u8>) -> Result<(), Kind> {
    const UPPER: &[u8; 16] = b"0123456789ABCDEF";
    // 1. Escapes: unreserved ones decoded, the rest with upper-case hex.
    let mut dec = Vec::with_capacity(path.len());
    let mut i = 0;
    while i < path.len() {
        let b = path[i];
        if b != b'%' {
            dec.push(b);
            i += 1;
            continue;
        }
        let (Some(h), Some(l)) = (
            path.get(i + 1).copied().and_then(hex),
            path.get(i + 2).copied().and_then(hex),
        ) else {
            return Err(Kind::InvalidPath);
        };
        let c = h << 4 | l;
        i += 3;
        if unreserved(c) {
            dec.push(c);
        } else if c == b'/' || c == b'\\' {
            match policy.escaped_slashes {
                EscapedSlashes::Reject => return Err(Kind::InvalidPath),
                EscapedSlashes::Decode if c == b'/' => dec.push(b'/'),
                EscapedSlashes::Decode => return Err(Kind::InvalidPath),
                EscapedSlashes::Keep => {
                    dec.extend_from_slice(&[b'%', UPPER[h as usize], UPPER[l as usize]])
                }
            }
        } else {
            dec.extend_from_slice(&[b'%', UPPER[h as usize], UPPER[l as usize]]);
        }
    }
    // 2. Dot-segments and empty segments, on the decoded form (so `%2e%2e`
    //    is `..`). Segments are spans of `dec`, kept on a stack.
    let mut stack: Vec<(usize, usize)> = Vec::with_capacity(8);
    let body = &dec[1..];
    let n = body.split(|&b| b == b'/').count();
    let mut off = 1;
    for (k, seg) in body.split(|&b| b == b'/').enumerate() {
        let last = k + 1 == n;
        let start = off;
        off += seg.len() + 1;
        match seg {
            b"." => {
                if last {
                    stack.push((start, 0));
                }
            }
            b".." => {
                // Above the root: refused, as nginx does.
                if stack.pop().is_none() {
                    return Err(Kind::InvalidPath);
                }
                if last {
                    stack.push((start, 0));
                }
            }
            b"" if policy.merge_slashes && !last => {}
            _ => stack.push((start, seg.len())),
        }
    }
    out.push(b'/');
    for (j, &(s, l)) in stack.iter().enumerate() {
        if j > 0 {
            out.push(b'/');
        }
        out.extend_from_slice(&dec[s..s + l]);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::head::HeadLimits;

    fn norm(p: &str, policy: PathPolicy) -> Result<String, Kind> {
        let mut out = Vec::new();
        normalise_path(p.as_bytes(), &policy, &mut out)?;
        Ok(String::from_utf8(out).unwrap())
    }

    #[test]
    fn the_bypass_forms_all_become_the_admin_path_or_are_refused() {
        let d = PathPolicy::DEFAULT;
        for p in [
            "/public/../admin/secret",
            "/public/%2e%2e/admin/secret",
            "/public/%2E%2E/admin/secret",
            "//admin/secret",
            "/%61dmin/secret",
            "/./admin/secret",
            "/admin/./secret",
            "/admin//secret",
            "/public/.%2e/admin/secret",
        ] {
            assert_eq!(norm(p, d).as_deref(), Ok("/admin/secret"), "{p}");
        }
        for p in ["/admin%2fsecret", "/public/..%2fadmin/secret", "/a%5cb"] {
            assert_eq!(norm(p, d), Err(Kind::InvalidPath), "{p}");
        }
        let dec = PathPolicy {
            escaped_slashes: EscapedSlashes::Decode,
            ..d
        };
        assert_eq!(norm("/admin%2fsecret", dec).as_deref(), Ok("/admin/secret"));
        assert_eq!(
            norm("/public/..%2fadmin/secret", dec).as_deref(),
            Ok("/admin/secret")
        );
        let keep = PathPolicy {
            escaped_slashes: EscapedSlashes::Keep,
            ..d
        };
        assert_eq!(
            norm("/admin%2fsecret", keep).as_deref(),
            Ok("/admin%2Fsecret")
        );
    }

    #[test]
    fn other_paths() {
        let d = PathPolicy::DEFAULT;
        assert_eq!(norm("/", d).as_deref(), Ok("/"));
        assert_eq!(norm("/a/", d).as_deref(), Ok("/a/"));
        assert_eq!(norm("/a/.", d).as_deref(), Ok("/a/"));
        assert_eq!(norm("/a/b/..", d).as_deref(), Ok("/a/"));
        assert_eq!(norm("/a/b/../", d).as_deref(), Ok("/a/"));
        assert_eq!(norm("/a//", d).as_deref(), Ok("/a/"));
        assert_eq!(norm("/a%20b", d).as_deref(), Ok("/a%20b"));
        assert_eq!(norm("/a%3fb", d).as_deref(), Ok("/a%3Fb"));
        assert_eq!(norm("/%7euser", d).as_deref(), Ok("/~user"));
        assert_eq!(norm("/..", d), Err(Kind::InvalidPath));
        assert_eq!(norm("/a/../..", d), Err(Kind::InvalidPath));
        assert_eq!(norm("/%zz", d), Err(Kind::InvalidPath));
        assert_eq!(norm("/%4", d), Err(Kind::InvalidPath));
        let no_merge = PathPolicy {
            merge_slashes: false,
            ..d
        };
        assert_eq!(norm("//a", no_merge).as_deref(), Ok("//a"));
        assert!(!needs_normalising(b"/a/b.c/d-e_f"));
        assert!(needs_normalising(b"/a/.b"));
    }

    fn canon(s: &str) -> Result<RequestHead, Kind> {
        let mut h = RequestHead::default();
        h.parse(s.as_bytes(), &HeadLimits::default())?.unwrap();
        h.canonicalize(&PathPolicy::DEFAULT)?;
        Ok(h)
    }

    #[test]
    fn one_authority() {
        let h = canon("GET http://Evil.Example./x?q=1 HTTP/1.1\r\nHost: victim.example\r\n\r\n")
            .unwrap();
        assert_eq!(h.host(), Some(&b"evil.example"[..]));
        assert_eq!(h.uri(), b"/x?q=1");
        assert_eq!(h.headers.get_all_known(HOST).count(), 1);
        let h = canon("GET http://a:8080?q HTTP/1.1\r\nHost: b\r\n\r\n").unwrap();
        assert_eq!(h.host(), Some(&b"a:8080"[..]));
        assert_eq!(h.uri(), b"/?q");
        let h = canon("GET / HTTP/1.1\r\nHost: [::1]:80\r\n\r\n").unwrap();
        assert_eq!(h.host(), Some(&b"[::1]:80"[..]));
        let h = canon("GET / HTTP/1.1\r\nHost: A.example.:81\r\n\r\n").unwrap();
        assert_eq!(h.host(), Some(&b"a.example:81"[..]));
        for bad in [
            "GET http://a:b/ HTTP/1.1\r\nHost: a\r\n\r\n",
            "GET http://a:99999/ HTTP/1.1\r\nHost: a\r\n\r\n",
            "GET http://a%2fb/ HTTP/1.1\r\nHost: a\r\n\r\n",
            "GET / HTTP/1.1\r\nHost: a:1:2\r\n\r\n",
            "GET / HTTP/1.1\r\nHost: [zz]\r\n\r\n",
            "GET / HTTP/1.1\r\nHost: a]\r\n\r\n",
        ] {
            assert_eq!(canon(bad).err(), Some(Kind::InvalidHost), "{bad}");
        }
        for bad in [
            "GET ftp://a/ HTTP/1.1\r\nHost: a\r\n\r\n",
            "GET http://u@a/ HTTP/1.1\r\nHost: a\r\n\r\n",
            "GET a/b HTTP/1.1\r\nHost: a\r\n\r\n",
            "GET * HTTP/1.1\r\nHost: a\r\n\r\n",
        ] {
            assert_eq!(canon(bad).err(), Some(Kind::InvalidRequestLine), "{bad}");
        }
        let h = canon("OPTIONS * HTTP/1.1\r\nHost: A.\r\n\r\n").unwrap();
        assert_eq!((h.uri(), h.host()), (&b"*"[..], Some(&b"a"[..])));
    }
}
