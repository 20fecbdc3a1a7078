//! `pier.req.*` and `pier.var.*`.

use std::io::Write as _;
use std::os::raw::{c_char, c_int};

use super::copy_out;
use super::{arg, valid_name, valid_value, with_view, PierPair, E_INVAL, SCRATCH};
use crate::phase::mask;
use crate::view::HttpView;

/// The method copied to `buf` (see `copy_out`).
pub(super) unsafe extern "C" fn method(buf: *mut c_char, cap: usize) -> c_int {
    // SAFETY: out-pointers from Lua are NULL or writable (ffi contract).
    with_view(mask::REQ_READ, |v, _| unsafe {
        copy_out(v.method(), buf, cap)
    })
}

/// The request target (`path?query`) copied to `buf` (see `copy_out`).
pub(super) unsafe extern "C" fn uri(buf: *mut c_char, cap: usize) -> c_int {
    // SAFETY: out-pointers from Lua are NULL or writable (ffi contract).
    with_view(mask::REQ_READ, |v, _| unsafe {
        copy_out(v.uri(), buf, cap)
    })
}

fn split_uri(uri: &[u8]) -> (&[u8], Option<&[u8]>) {
    match memchr::memchr(b'?', uri) {
        Some(i) => (&uri[..i], Some(&uri[i + 1..])),
        None => (uri, None),
    }
}

/// The path copied to `buf` (see `copy_out`).
pub(super) unsafe extern "C" fn path(buf: *mut c_char, cap: usize) -> c_int {
    with_view(mask::REQ_READ, |v, _| {
        // SAFETY: out-pointers from Lua are NULL or writable (ffi contract).
        unsafe { copy_out(split_uri(v.uri()).0, buf, cap) }
    })
}

/// Replaces the path, keeping the query (as `ngx.req.set_uri`).
pub(super) unsafe extern "C" fn set_path(p: *const c_char, n: usize) -> c_int {
    // SAFETY: `(ptr, len)` arguments from Lua are valid for the call (ffi contract).
    let new_path = unsafe { arg(p, n) };
    if new_path.first() != Some(&b'/')
        || new_path
            .iter()
            .any(|&c| c <= b' ' || c == b'?' || c == 0x7f)
    {
        return E_INVAL;
    }
    with_view(mask::REQ_WRITE, |v, _| {
        SCRATCH.with_borrow_mut(|s| {
            s.bytes.clear();
            s.bytes.extend_from_slice(new_path);
            if let Some(q) = split_uri(v.uri()).1 {
                s.bytes.push(b'?');
                s.bytes.extend_from_slice(q);
            }
            v.set_uri(&s.bytes);
        });
        0
    })
}

/// Replaces the query string (already encoded by the Lua wrapper).
pub(super) unsafe extern "C" fn set_args(p: *const c_char, n: usize) -> c_int {
    // SAFETY: `(ptr, len)` arguments from Lua are valid for the call (ffi contract).
    let query = unsafe { arg(p, n) };
    if query.iter().any(|&c| c <= b' ' || c == b'#' || c == 0x7f) {
        return E_INVAL;
    }
    with_view(mask::REQ_WRITE, |v, _| {
        SCRATCH.with_borrow_mut(|s| {
            s.bytes.clear();
            s.bytes.extend_from_slice(split_uri(v.uri()).0);
            if !query.is_empty() {
                s.bytes.push(b'?');
                s.bytes.extend_from_slice(query);
            }
            v.set_uri(&s.bytes);
        });
        0
    })
}

fn hex(c: u8) -> Option<u8> {
    match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        b'A'..=b'F' => Some(c - b'A' + 10),
        _ => None,
    }
}

/// Appends the `application/x-www-form-urlencoded` decoding of `s`.
pub(super) fn unescape_into(s: &[u8], out: &mut Vec<u8>) {
    let mut i = 0;
    while i < s.len() {
        match s[i] {
            b'+' => out.push(b' '),
            b'%' if i + 2 < s.len() => match (hex(s[i + 1]), hex(s[i + 2])) {
                (Some(h), Some(l)) => {
                    out.push(h << 4 | l);
                    i += 2;
                }
                _ => out.push(b'%'),
            },
            c => out.push(c),
        }
        i += 1;
    }
}

/// The decoded query args, in order (duplicates kept: the wrapper makes lists).
pub(super) unsafe extern "C" fn args(outp: *mut *const PierPair) -> c_int {
    with_view(mask::REQ_READ, |v, _| {
        SCRATCH.with_borrow_mut(|s| {
            s.bytes.clear();
            s.spans.clear();
            let Some(q) = split_uri(v.uri()).1 else {
                // SAFETY: out-pointers from Lua are NULL or writable (ffi contract).
                return unsafe { s.publish(outp) };
            };
            for part in q.split(|&c| c == b'&') {
                if part.is_empty() {
                    continue;
                }
                let (k, val) = match memchr::memchr(b'=', part) {
                    Some(i) => (&part[..i], Some(&part[i + 1..])),
                    None => (part, None),
                };
                let ks = s.bytes.len();
                unescape_into(k, &mut s.bytes);
                let kl = s.bytes.len() - ks;
                if kl == 0 {
                    continue;
                }
                let vs = s.bytes.len();
                let vl = match val {
                    Some(val) => {
                        unescape_into(val, &mut s.bytes);
                        (s.bytes.len() - vs) as isize
                    }
                    None => -1,
                };
                s.spans.push((ks, kl, vs, vl));
            }
            // SAFETY: out-pointers from Lua are NULL or writable (ffi contract).
            unsafe { s.publish(outp) }
        })
    })
}

/// The first value of header `name` copied to `buf` (see `copy_out`), or -1.
pub(super) unsafe extern "C" fn header(
    name: *const c_char,
    nlen: usize,
    buf: *mut c_char,
    cap: usize,
) -> c_int {
    // SAFETY: `(ptr, len)` arguments from Lua are valid for the call (ffi contract).
    let name = unsafe { arg(name, nlen) };
    with_view(mask::REQ_READ, |v, _| match v.req_header(name) {
        // SAFETY: out-pointers from Lua are NULL or writable (ffi contract).
        Some(val) => unsafe { copy_out(val, buf, cap) },
        None => -1,
    })
}

/// Collects `name, value` lines, names lowercased, into the scratch pairs.
pub(super) unsafe fn collect_headers(
    each: impl FnOnce(&mut dyn FnMut(&[u8], &[u8])),
    outp: *mut *const PierPair,
) -> c_int {
    SCRATCH.with_borrow_mut(|s| {
        s.bytes.clear();
        s.spans.clear();
        let (bytes, spans) = (&mut s.bytes, &mut s.spans);
        each(&mut |k: &[u8], val: &[u8]| {
            let ks = bytes.len();
            bytes.extend(k.iter().map(u8::to_ascii_lowercase));
            let vs = bytes.len();
            bytes.extend_from_slice(val);
            spans.push((ks, k.len(), vs, val.len() as isize));
        });
        // SAFETY: out-pointers from Lua are NULL or writable (ffi contract).
        unsafe { s.publish(outp) }
    })
}

pub(super) unsafe extern "C" fn headers(outp: *mut *const PierPair) -> c_int {
    with_view(mask::REQ_READ, |v, _| {
        // SAFETY: out-pointers from Lua are NULL or writable (ffi contract).
        unsafe { collect_headers(|f| v.req_headers(f), outp) }
    })
}

/// `mode`: 0 replace, 1 append, 2 remove.
pub(super) fn apply_header(
    name: &[u8],
    val: &[u8],
    mode: c_int,
    set: impl FnOnce(&[u8], Option<&[u8]>),
    add: impl FnOnce(&[u8], &[u8]),
) -> c_int {
    if !valid_name(name) || !valid_value(val) {
        return E_INVAL;
    }
    match mode {
        0 => set(name, Some(val)),
        1 => add(name, val),
        2 => set(name, None),
        _ => return E_INVAL,
    }
    0
}

pub(super) unsafe extern "C" fn set_header(
    name: *const c_char,
    nlen: usize,
    val: *const c_char,
    vlen: usize,
    mode: c_int,
) -> c_int {
    // SAFETY: `(ptr, len)` arguments from Lua are valid for the call (ffi contract).
    let (name, val) = unsafe { (arg(name, nlen), arg(val, vlen)) };
    with_view(mask::REQ_WRITE, |v, _| {
        // Two closures need the view: go through a raw reborrow per call.
        let vp: *mut dyn HttpView = v;
        apply_header(
            name,
            val,
            mode,
            // SAFETY: only one of the two closures runs, once.
            |k, x| unsafe { (*vp).set_req_header(k, x) },
            // SAFETY: as above.
            |k, x| unsafe { (*vp).add_req_header(k, x) },
        )
    })
}

/// `pier.var.NAME` copied to `buf` (see `copy_out`), or -1 for an
/// unknown/absent variable.
pub(super) unsafe extern "C" fn var(
    name: *const c_char,
    nlen: usize,
    p: *mut c_char,
    n: usize,
) -> c_int {
    // SAFETY: `(ptr, len)` arguments from Lua are valid for the call (ffi contract).
    let name = unsafe { arg(name, nlen) };
    with_view(mask::REQ_READ, |v, _| {
        let direct: Option<&[u8]> = match name {
            b"request_method" => Some(v.method()),
            b"request_uri" => Some(v.uri()),
            b"uri" => Some(split_uri(v.uri()).0),
            b"args" | b"query_string" => Some(split_uri(v.uri()).1.unwrap_or(b"")),
            b"is_args" => Some(if split_uri(v.uri()).1.is_some() {
                b"?"
            } else {
                b""
            }),
            b"scheme" => Some(v.scheme()),
            b"server_protocol" => Some(v.server_protocol()),
            b"host" => Some(v.host()),
            b"trace_id" | b"span_id" | b"trace_flags" => v.trace_var(name),
            _ => v.tls_var(name),
        };
        if let Some(val) = direct {
            // SAFETY: out-pointers from Lua are NULL or writable (ffi contract).
            return unsafe { copy_out(val, p, n) };
        }
        if let Some(h) = name.strip_prefix(b"http_") {
            return SCRATCH.with_borrow_mut(|s| {
                s.bytes.clear();
                s.bytes
                    .extend(h.iter().map(|&c| if c == b'_' { b'-' } else { c }));
                match v.req_header(&s.bytes) {
                    // SAFETY: out-pointers from Lua are NULL or writable (ffi contract).
                    Some(val) => unsafe { copy_out(val, p, n) },
                    None => -1,
                }
            });
        }
        SCRATCH.with_borrow_mut(|s| {
            s.bytes.clear();
            let ok = match name {
                b"remote_addr" => write!(s.bytes, "{}", v.client_addr().ip()).is_ok(),
                b"remote_port" => push_int(&mut s.bytes, v.client_addr().port()),
                b"realip_remote_addr" => write!(s.bytes, "{}", v.peer_addr().ip()).is_ok(),
                b"realip_remote_port" => push_int(&mut s.bytes, v.peer_addr().port()),
                b"server_port" => push_int(&mut s.bytes, v.server_port()),
                b"status" => push_int(&mut s.bytes, v.status()),
                _ => false,
            };
            if ok {
                // SAFETY: out-pointers from Lua are NULL or writable (ffi contract).
                unsafe { copy_out(&s.bytes, p, n) }
            } else {
                -1
            }
        })
    })
}

fn push_int(out: &mut Vec<u8>, n: u16) -> bool {
    out.extend_from_slice(itoa::Buffer::new().format(n).as_bytes());
    true
}
