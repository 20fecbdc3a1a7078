//! Well-known header names and their fixed slots (the Varnish lesson: header
//! lookup is a linear scan unless the names you care about have a slot).

/// Index of a well-known header; `UNKNOWN` for everything else.
pub type Known = u8;
pub const UNKNOWN: Known = u8::MAX;

macro_rules! known_headers {
    ($($id:ident = $idx:expr, $name:expr;)*) => {
        $(pub const $id: Known = $idx;)*
        /// Canonical lower-case names, by slot.
        pub const NAMES: &[&str] = &[$($name),*];
        pub const COUNT: usize = NAMES.len();
    };
}

known_headers! {
    HOST = 0, "host";
    CONTENT_LENGTH = 1, "content-length";
    TRANSFER_ENCODING = 2, "transfer-encoding";
    CONNECTION = 3, "connection";
    KEEP_ALIVE = 4, "keep-alive";
    PROXY_CONNECTION = 5, "proxy-connection";
    TE = 6, "te";
    TRAILER = 7, "trailer";
    UPGRADE = 8, "upgrade";
    EXPECT = 9, "expect";
    DATE = 10, "date";
    SERVER = 11, "server";
    X_FORWARDED_FOR = 12, "x-forwarded-for";
    X_FORWARDED_PROTO = 13, "x-forwarded-proto";
    X_FORWARDED_HOST = 14, "x-forwarded-host";
    COOKIE = 15, "cookie";
    USER_AGENT = 16, "user-agent";
    CONTENT_TYPE = 17, "content-type";
    ACCEPT = 18, "accept";
    ACCEPT_ENCODING = 19, "accept-encoding";
    CACHE_CONTROL = 20, "cache-control";
    AUTHORIZATION = 21, "authorization";
    PROXY_AUTHORIZATION = 22, "proxy-authorization";
    PROXY_AUTHENTICATE = 23, "proxy-authenticate";
    SET_COOKIE = 24, "set-cookie";
    LOCATION = 25, "location";
    VIA = 26, "via";
    ETAG = 27, "etag";
    LAST_MODIFIED = 28, "last-modified";
    IF_NONE_MATCH = 29, "if-none-match";
    IF_MODIFIED_SINCE = 30, "if-modified-since";
    CONTENT_ENCODING = 31, "content-encoding";
    VARY = 32, "vary";
    AGE = 33, "age";
    RANGE = 34, "range";
    RETRY_AFTER = 35, "retry-after";
}

#[inline]
fn eq(a: &[u8], lower: &str) -> bool {
    a.eq_ignore_ascii_case(lower.as_bytes())
}

/// Map a header name to its slot, case-insensitively, without allocating:
/// dispatch on length first so most names compare against one or two
/// candidates.
pub fn lookup(name: &[u8]) -> Known {
    let cands: &[Known] = match name.len() {
        2 => &[TE],
        3 => &[VIA, AGE],
        4 => &[HOST, DATE, ETAG, VARY],
        5 => &[RANGE],
        6 => &[SERVER, COOKIE, ACCEPT, EXPECT],
        7 => &[TRAILER, UPGRADE],
        8 => &[LOCATION],
        10 => &[CONNECTION, KEEP_ALIVE, USER_AGENT, SET_COOKIE],
        11 => &[RETRY_AFTER],
        12 => &[CONTENT_TYPE],
        13 => &[CACHE_CONTROL, AUTHORIZATION, LAST_MODIFIED, IF_NONE_MATCH],
        14 => &[CONTENT_LENGTH],
        15 => &[X_FORWARDED_FOR, ACCEPT_ENCODING],
        16 => &[PROXY_CONNECTION, X_FORWARDED_HOST, CONTENT_ENCODING],
        17 => &[TRANSFER_ENCODING, X_FORWARDED_PROTO, IF_MODIFIED_SINCE],
        18 => &[PROXY_AUTHENTICATE],
        19 => &[PROXY_AUTHORIZATION],
        _ => &[],
    };
    for &k in cands {
        if eq(name, NAMES[k as usize]) {
            return k;
        }
    }
    UNKNOWN
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_name_maps_to_its_slot() {
        for (i, n) in NAMES.iter().enumerate() {
            assert_eq!(lookup(n.as_bytes()), i as Known, "{n}");
            assert_eq!(lookup(n.to_ascii_uppercase().as_bytes()), i as Known);
        }
        assert_eq!(lookup(b"x-custom"), UNKNOWN);
        assert_eq!(lookup(b""), UNKNOWN);
    }
}
