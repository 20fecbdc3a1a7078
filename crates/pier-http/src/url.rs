//! `http://` URLs of the services Pier calls on its own (an OCSP
//! responder, an ACME `ask` service, an OTLP collector): split once, here,
//! into what the request's `Host` names, where to connect and the request
//! target. (A hook's `pier.http` URLs have their own parser in pier-lua,
//! which also keys its pool by host.)

use std::borrow::Cow;

/// An `http://` URL, split.
#[derive(Debug, PartialEq, Eq)]
pub struct HttpUrl<'a> {
    /// `host[:port]` as written: the request's `Host`.
    pub authority: &'a str,
    /// `host:port` to connect to (the default port added when none is
    /// written; an IPv6 literal stays bracketed).
    pub connect: Cow<'a, str>,
    /// The request target: the path and query, `default_path` when the URL
    /// has none, `/` put in front of a bare query.
    pub path: Cow<'a, str>,
}

/// Split `url`, which must start with `http://` and name a host.
pub fn parse_http<'a>(
    url: &'a str,
    default_port: u16,
    default_path: &'static str,
) -> Result<HttpUrl<'a>, &'static str> {
    let rest = url.strip_prefix("http://").ok_or("not an http:// URL")?;
    let (authority, path) = match rest.find(['/', '?', '#']) {
        Some(i) => (&rest[..i], &rest[i..]),
        None => (rest, ""),
    };
    // A fragment is not sent.
    let path = path.split('#').next().unwrap_or("");
    if authority.is_empty() || authority.contains('@') {
        return Err("no host in URL (or user info, which is not supported)");
    }
    let has_port = authority
        .rsplit_once(':')
        .is_some_and(|(h, p)| p.parse::<u16>().is_ok() && (!h.contains(':') || h.ends_with(']')));
    let connect = if has_port {
        Cow::Borrowed(authority)
    } else if authority.contains(':') && !authority.ends_with(']') {
        return Err("bad port in URL");
    } else {
        Cow::Owned(format!("{authority}:{default_port}"))
    };
    let path = match path.as_bytes().first() {
        None => Cow::Borrowed(default_path),
        Some(b'?') => Cow::Owned(format!("/{path}")),
        _ => Cow::Borrowed(path),
    };
    Ok(HttpUrl {
        authority,
        connect,
        path,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn split(url: &str) -> Result<(String, String, String), &'static str> {
        parse_http(url, 4318, "/v1/traces")
            .map(|u| (u.authority.into(), u.connect.into(), u.path.into()))
    }

    #[test]
    fn urls_split_as_the_request_needs_them() {
        let s = |a: &str, c: &str, p: &str| Ok((a.into(), c.into(), p.into()));
        assert_eq!(split("http://c:1234/v1/x"), s("c:1234", "c:1234", "/v1/x"));
        assert_eq!(split("http://c"), s("c", "c:4318", "/v1/traces"));
        assert_eq!(split("http://c/"), s("c", "c:4318", "/"));
        assert_eq!(split("http://c?a=1"), s("c", "c:4318", "/?a=1"));
        assert_eq!(split("http://c/p?q#frag"), s("c", "c:4318", "/p?q"));
        assert_eq!(split("http://[::1]:99/p"), s("[::1]:99", "[::1]:99", "/p"));
        assert_eq!(split("http://[::1]/p"), s("[::1]", "[::1]:4318", "/p"));
        assert!(split("https://c/").is_err());
        assert!(split("http:///p").is_err());
        assert!(split("http://u:p@c/").is_err());
        assert!(split("http://c:x/").is_err());
        assert!(split("http://c:99999/").is_err());
    }
}
