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
    // The cache's own: read on every miss, which a scan by name made cost
    // ~3k instructions (bench/cache_instructions.sh).
    EXPIRES = 36, "expires";
    PRAGMA = 37, "pragma";
    SURROGATE_CONTROL = 38, "surrogate-control";
    SURROGATE_KEY = 39, "surrogate-key";
    CACHE_TAG = 40, "cache-tag";
    CACHE_STATUS = 41, "cache-status";
    // RFC 9213 targeted fields and Pier's refresh mark: looked for on every
    // miss and every cached response, where a scan by name cost ~1k
    // instructions a stored miss.
    PIER_CACHE_CONTROL = 42, "pier-cache-control";
    CDN_CACHE_CONTROL = 43, "cdn-cache-control";
    X_PIER_CACHE_REFRESH = 44, "x-pier-cache-refresh";
    // The tiered cache's mark (`pier_proxy::tier`), looked for on every
    // stored miss: a scan by name cost ~180 instructions.
    PIER_TIER = 45, "pier-tier";
}

/// Where `lookup` reads a name of `n` bytes (2..=24): three little-endian
/// windows that together cover it, overlapping rather than padded, so each
/// is one fixed-size load: 8-byte windows at 0, 8 (or n-8 if less) and n-8
/// for n >= 8; 4-byte ones at 0 and n-4 for 4..=7; 2-byte ones at 0 and n-2
/// for 2..=3. Same length + same windows = same name.
const fn window_starts(n: usize) -> ([usize; 3], usize) {
    if n >= 8 {
        let mid = if n - 8 < 8 { n - 8 } else { 8 };
        ([0, mid, n - 8], 8)
    } else if n >= 4 {
        ([0, n - 4, 0], 4)
    } else {
        ([0, n.saturating_sub(2), 0], 2)
    }
}

/// `windows` at compile time, for the (lower-case) known names.
const fn words(name: &[u8]) -> [u64; 3] {
    let (starts, width) = window_starts(name.len());
    let mut w = [0u64; 3];
    let mut k = 0;
    while k < 3 {
        if width == 8 || k < 2 {
            let mut i = 0;
            while i < width && starts[k] + i < name.len() {
                w[k] |= (name[starts[k] + i] as u64) << (i * 8);
                i += 1;
            }
        }
        k += 1;
    }
    w
}

const FOLDED: [[u64; 3]; COUNT] = {
    let mut t = [[0u64; 3]; COUNT];
    let mut k = 0;
    while k < COUNT {
        t[k] = words(NAMES[k].as_bytes());
        k += 1;
    }
    t
};

/// Map a header name to its slot, case-insensitively, without allocating:
/// dispatch on length first so most names compare against one or two
/// candidates, each compared a word at a time (the byte-wise
/// `eq_ignore_ascii_case` loop was ~100 instructions a header, the largest
/// share of head parsing).
pub fn lookup(name: &[u8]) -> Known {
    let cands: &[Known] = match name.len() {
        2 => &[TE],
        3 => &[VIA, AGE],
        4 => &[HOST, DATE, ETAG, VARY],
        5 => &[RANGE],
        6 => &[SERVER, COOKIE, ACCEPT, EXPECT, PRAGMA],
        7 => &[TRAILER, UPGRADE, EXPIRES],
        8 => &[LOCATION],
        9 => &[CACHE_TAG, PIER_TIER],
        10 => &[CONNECTION, KEEP_ALIVE, USER_AGENT, SET_COOKIE],
        11 => &[RETRY_AFTER],
        12 => &[CONTENT_TYPE, CACHE_STATUS],
        13 => &[
            CACHE_CONTROL,
            AUTHORIZATION,
            LAST_MODIFIED,
            IF_NONE_MATCH,
            SURROGATE_KEY,
        ],
        14 => &[CONTENT_LENGTH],
        15 => &[X_FORWARDED_FOR, ACCEPT_ENCODING],
        16 => &[PROXY_CONNECTION, X_FORWARDED_HOST, CONTENT_ENCODING],
        17 => &[
            TRANSFER_ENCODING,
            X_FORWARDED_PROTO,
            IF_MODIFIED_SINCE,
            SURROGATE_CONTROL,
            CDN_CACHE_CONTROL,
        ],
        18 => &[PROXY_AUTHENTICATE, PIER_CACHE_CONTROL],
        19 => &[PROXY_AUTHORIZATION],
        20 => &[X_PIER_CACHE_REFRESH],
        _ => return UNKNOWN,
    };
    let w = fold_fast(name);
    for &k in cands {
        if FOLDED[k as usize] == w {
            return k;
        }
    }
    UNKNOWN
}

/// ASCII upper case to lower in each byte of a word (exact: only `A`..=`Z`
/// change; no carry crosses bytes, as each is first cut to 7 bits).
#[inline(always)]
fn lower(x: u64) -> u64 {
    const LOW7: u64 = 0x7f7f_7f7f_7f7f_7f7f;
    const HIGH: u64 = 0x8080_8080_8080_8080;
    let low = x & LOW7;
    let ge_a = low + 0x3f3f_3f3f_3f3f_3f3f; // high bit set: byte >= 'A'
    let gt_z = low + 0x2525_2525_2525_2525; // high bit set: byte > 'Z'
    x | (((ge_a & !gt_z & !x) & HIGH) >> 2)
}

/// `words` of a name of 2..=24 bytes read at run time, case-folded.
#[inline(always)]
fn fold_fast(name: &[u8]) -> [u64; 3] {
    let n = name.len();
    let (st, width) = window_starts(n);
    let load = |at: usize| -> u64 {
        match width {
            8 => name
                .get(at..at + 8)
                .and_then(|b| b.try_into().ok())
                .map_or(0, u64::from_le_bytes),
            4 => name
                .get(at..at + 4)
                .and_then(|b| b.try_into().ok())
                .map_or(0, |b| u32::from_le_bytes(b) as u64),
            _ => name
                .get(at..at + 2)
                .and_then(|b| b.try_into().ok())
                .map_or(0, |b| u16::from_le_bytes(b) as u64),
        }
    };
    let third = if width == 8 { lower(load(st[2])) } else { 0 };
    [lower(load(st[0])), lower(load(st[1])), third]
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
        // Same length and letters apart from case-folding look-alikes.
        assert_eq!(lookup(b"hos\x14"), UNKNOWN);
        assert_eq!(lookup(b"content\x0dtype"), UNKNOWN);
        assert_eq!(lookup(b"content_type"), UNKNOWN);
        assert_eq!(lookup(b"x-forwarded-fox"), UNKNOWN);
        assert_eq!(lookup(b""), UNKNOWN);
    }

    /// The word-at-a-time compare agrees with a byte-wise case-insensitive
    /// one for every name with any one byte replaced by any value.
    #[test]
    fn word_compare_matches_bytewise() {
        let naive = |n: &[u8]| {
            NAMES
                .iter()
                .position(|k| n.eq_ignore_ascii_case(k.as_bytes()))
                .map_or(UNKNOWN, |i| i as Known)
        };
        for name in NAMES {
            for at in 0..name.len() {
                for b in 0..=255u8 {
                    let mut n = name.as_bytes().to_vec();
                    n[at] = b;
                    assert_eq!(lookup(&n), naive(&n), "{n:?}");
                }
            }
        }
    }
}
