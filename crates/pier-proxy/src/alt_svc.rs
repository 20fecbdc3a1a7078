//! `Alt-Svc` (RFC 7838) on the TCP responses of a listener with `http3`:
//! a response filter beside CORS, so that a browser moves to HTTP/3.

use crate::session::Session;
use crate::state::State;
use pier_http::ResponseHead;

/// `Alt-Svc: h3=":PORT"` on a response over TCP from a listener with
/// `http3` (its UDP port is its TCP port), so a browser moves to HTTP/3.
pub(crate) fn apply(state: &State, sess: &Session, resp: &mut ResponseHead) {
    if sess.conn.proto == pier_session::Protocol::Http3 {
        return;
    }
    let http3 = sess
        .conn
        .listener
        .and_then(|i| state.cfg.listeners.get(i))
        .is_some_and(|l| l.http3);
    if !http3 || resp.headers.get(b"alt-svc").is_some() {
        return;
    }
    let mut v = [0u8; 32];
    let mut port = itoa::Buffer::new();
    let p = port.format(sess.local.port()).as_bytes();
    let mut n = 0;
    for part in [&b"h3=\":"[..], p, b"\"; ma=86400"] {
        v[n..n + part.len()].copy_from_slice(part);
        n += part.len();
    }
    resp.headers.append(b"Alt-Svc", &v[..n]);
}
