//! What the upstream request carries that the client did not decide: the
//! one policy, decided once per attempt as an [`Outgoing`], that every
//! upstream codec (HTTP/1 `pier_h1::H1Upstream`, HTTP/2 `pier_h2::client::H2Upstream`)
//! serialises, so that no protocol has a list of its own (docs/security.md).
//!
//! - Hop-by-hop fields (`pier_http::HOP_BY_HOP`, and what `Connection`
//!   names, dropped when the upstream request is built) never go.
//! - Framing (`Content-Length`, `Transfer-Encoding`) never goes as received
//!   or as a hook set it: the codec states it from the body it sends
//!   ([`body`]). A request whose `Connection` names a framing field was
//!   refused when parsed.
//! - Forwarding fields that origins trust (`Forwarded`, `X-Forwarded-*`,
//!   `X-Real-IP`, `X-Original-URL`, `X-Rewrite-URL`) go only from a client
//!   in the listener's `trusted_proxies`; from anyone else Pier's own
//!   `X-Forwarded-For/-Proto/-Host` replace them.

use crate::session::Session;
use crate::state::State;
use pier_config::HostHeader;
use pier_http::known::{self, Known};
use pier_http::{BodyLen, RequestHead};
pub use pier_session::{FieldWriter, UpstreamRequest};
use std::net::SocketAddr;

/// The upstream request as policy decided it, for one attempt to `addr`:
/// which received fields go, the authority, Pier's forwarding fields and
/// the body's framing. A codec writes the method, the target, then
/// [`fields`](Self::fields), the authority (its Host or `:authority`),
/// [`forwarding`](Self::forwarding) and its own framing from
/// [`body`](Self::body), and decides nothing itself.
pub struct Outgoing<'a> {
    pub state: &'a State,
    pub sess: &'a Session,
    pub addr: SocketAddr,
    trusted: bool,
    /// `host_header = "upstream"`: the peer's name, not the client's Host.
    host_is_peer: bool,
}

impl<'a> Outgoing<'a> {
    pub fn new(state: &'a State, sess: &'a Session, addr: SocketAddr) -> Self {
        // A cache parent routes the request as this node did: by the
        // client's Host.
        let host_is_peer = !sess.to_parent
            && matches!(
                sess.route.map(|r| &state.routes[r].host_header),
                Some(HostHeader::Upstream)
            );
        Outgoing {
            state,
            sess,
            addr,
            trusted: trusted(state, sess),
            host_is_peer,
        }
    }
}

impl UpstreamRequest for Outgoing<'_> {
    /// The upstream request value (routed, rewritten, hooks applied).
    fn head(&self) -> &RequestHead {
        &self.sess.up_req
    }

    fn client_head(&self) -> &RequestHead {
        &self.sess.req
    }

    /// Whether a received field goes as it is: not hop-by-hop, not framing,
    /// not a forwarding field from an untrusted client, and not Host (the
    /// authority is written on its own, [`Self::client_authority`]).
    #[inline]
    fn keeps(&self, k: Known, name: &[u8]) -> bool {
        k != known::HOST
            && keep_field(k, name, self.trusted, self.state.cfg.forwarded)
            // With tracing on, the attempt's own `traceparent` replaces it.
            && !(k == known::UNKNOWN
                && name.len() == 11
                && self.sess.trace.is_some()
                && name.eq_ignore_ascii_case(b"traceparent")
                && crate::trace::of(self.sess).is_some())
    }

    /// The authority the request carries when it is the client's (its Host,
    /// after header rules and hooks); None: the peer's, written by
    /// [`Self::write_peer_authority`] (`host_header = "upstream"`, or no Host
    /// from an HTTP/1.0 client, as nginx does).
    fn client_authority(&self) -> Option<&[u8]> {
        if self.host_is_peer {
            return None;
        }
        self.head().host()
    }

    /// The peer's authority: its configured name and port, or its address.
    fn write_peer_authority(&self, out: &mut Vec<u8>) {
        match &self.sess.upstream_host {
            Some(h) => {
                out.extend_from_slice(h.as_bytes());
                out.push(b':');
                out.extend_from_slice(itoa::Buffer::new().format(self.addr.port()).as_bytes());
            }
            None => {
                // A hook's or a literal address: rare, formatted.
                use std::io::Write;
                let _ = write!(out, "{}", self.addr);
            }
        }
    }

    /// The body as it goes upstream, which the codec's framing states.
    fn body(&self) -> BodyLen {
        body(self.sess)
    }

    /// A bodiless request that still says `Content-Length: 0` ([`says_empty`]).
    fn says_empty(&self) -> bool {
        says_empty(self.sess)
    }

    /// The Upgrade to ask for (an allowed one: `driver::upgrade_allowed`).
    fn upgrade(&self) -> Option<&[u8]> {
        if !self.sess.upgrade {
            return None;
        }
        self.sess.req.headers.get_known(known::UPGRADE)
    }

    /// Pier's forwarding fields into `w`: X-Forwarded-For, -Proto, -Host,
    /// and with `[http] forwarded` an RFC 7239 Forwarded.
    fn forwarding(&self, w: &mut impl FieldWriter) {
        let (sess, trusted) = (self.sess, self.trusted);
        w.composed(b"X-Forwarded-For", |out| {
            x_forwarded_for(out, sess, trusted)
        });
        w.field(b"X-Forwarded-Proto", x_forwarded_proto(sess, trusted));
        if let Some(h) = x_forwarded_host(sess, trusted) {
            w.field(b"X-Forwarded-Host", h);
        }
        if self.state.cfg.forwarded {
            w.composed(b"Forwarded", |out| forwarded(out, sess, trusted));
        }
        if let Some(t) = crate::trace::of(sess) {
            w.field(b"traceparent", &t.header);
        }
    }
}

/// Well-known request fields no upstream request copies from the received
/// one: hop-by-hop, framing, and the forwarding fields Pier writes.
#[inline]
pub(crate) fn skip_known(k: Known) -> bool {
    pier_http::hop_by_hop(k)
        || matches!(
            k,
            known::CONTENT_LENGTH
                | known::TRANSFER_ENCODING
                | known::X_FORWARDED_FOR
                | known::X_FORWARDED_PROTO
                | known::X_FORWARDED_HOST
        )
}

/// Forwarding fields without a slot, compared by name: dropped unless the
/// client is a trusted proxy. Checked only for unknown names, by length
/// first (most names cost one compare of their length).
pub(crate) fn forwarding_name(name: &[u8]) -> bool {
    const NAMES: [&[u8]; 9] = [
        b"forwarded",
        b"x-real-ip",
        b"x-forwarded-port",
        b"x-forwarded-prefix",
        b"x-forwarded-server",
        b"x-forwarded-ssl",
        b"x-forwarded-scheme",
        b"x-original-url",
        b"x-rewrite-url",
    ];
    matches!(name.len(), 9 | 13 | 14 | 15 | 16 | 18)
        && NAMES
            .iter()
            .any(|n| n.len() == name.len() && n.eq_ignore_ascii_case(name))
}

/// Whether a received field goes upstream as it is (`trusted`: the client
/// is one of the listener's `trusted_proxies`; `ours`: Pier writes a
/// `Forwarded` of its own, which carries a trusted proxy's elements).
#[inline]
pub(crate) fn keep_field(k: Known, name: &[u8], trusted: bool, ours: bool) -> bool {
    if k != known::UNKNOWN {
        return !skip_known(k);
    }
    if !forwarding_name(name) {
        return true;
    }
    trusted && !(ours && name.eq_ignore_ascii_case(b"forwarded"))
}

/// The client is one of its listener's `trusted_proxies`.
pub(crate) fn trusted(state: &State, sess: &Session) -> bool {
    sess.conn
        .listener
        .and_then(|i| state.cfg.listeners.get(i))
        .is_some_and(|l| {
            !l.trusted_proxies.is_empty()
                && pier_config::denied(&l.trusted_proxies, pier_config::normalize(sess.peer.ip()))
        })
}

/// `real_ip_header`: when the connection's peer is one of the listener's
/// `trusted_proxies`, the request's client becomes the right-most address
/// of the header that is not (or the left-most, when all are): a client
/// can write anything to the left of what its proxies append, never to
/// the right. An element that is not an address (`unknown`, an obfuscated
/// `_name`) ends the search where it stands. Done once, before routing,
/// so every step reads the one client.
pub(crate) fn real_client(state: &State, sess: &mut Session) {
    use pier_config::RealIpHeader;
    let Some(l) = sess.conn.listener.and_then(|i| state.cfg.listeners.get(i)) else {
        return;
    };
    let Some(which) = l.real_ip_header else {
        return;
    };
    let is_trusted =
        |ip: std::net::IpAddr| pier_config::denied(&l.trusted_proxies, pier_config::normalize(ip));
    if !is_trusted(sess.peer.ip()) {
        return;
    }
    let lines: Vec<&[u8]> = match which {
        RealIpHeader::XForwardedFor => sess
            .req
            .headers
            .get_all_known(known::X_FORWARDED_FOR)
            .collect(),
        RealIpHeader::Forwarded => sess.req.headers.get_all(b"forwarded").collect(),
    };
    let mut found = None;
    'lines: for line in lines.iter().rev() {
        for item in line.rsplit(|&c| c == b',') {
            let addr = match which {
                RealIpHeader::XForwardedFor => address(item),
                RealIpHeader::Forwarded => forwarded_for(item).and_then(address),
            };
            let Some(ip) = addr else { break 'lines };
            found = Some(ip);
            if !is_trusted(ip) {
                break 'lines;
            }
        }
    }
    if let Some(ip) = found {
        let ip = pier_config::normalize(ip);
        sess.client = std::net::SocketAddr::new(ip, 0);
        crate::session::ip_text_into(ip, &mut sess.client_ip);
    }
}

/// An address as proxies write it: `192.0.2.1`, `2001:db8::1`, with a
/// port (`192.0.2.1:80`, `[2001:db8::1]:80`) or in brackets.
fn address(item: &[u8]) -> Option<std::net::IpAddr> {
    let s = std::str::from_utf8(item).ok()?.trim();
    let s = s.trim_matches('"');
    if let Ok(ip) = s.parse() {
        return Some(ip);
    }
    if let Ok(a) = s.parse::<std::net::SocketAddr>() {
        return Some(a.ip());
    }
    s.strip_prefix('[')?.strip_suffix(']')?.parse().ok()
}

/// The `for=` value of one `Forwarded` element (`for=…;proto=…`).
fn forwarded_for(element: &[u8]) -> Option<&[u8]> {
    element.split(|&c| c == b';').find_map(|p| {
        let p = p.trim_ascii();
        (p.len() > 4 && p[..4].eq_ignore_ascii_case(b"for=")).then(|| &p[4..])
    })
}

/// The body as it goes upstream, which its framing describes: the
/// client's, except a gRPC-web text body, which is decoded on the way (so
/// of another length: chunked).
pub(crate) fn body(sess: &Session) -> BodyLen {
    match (sess.req.body_len(), sess.grpc_web) {
        (BodyLen::Length(_), Some(pier_grpc::web::Form::Text)) => BodyLen::Chunked,
        (b, _) => b,
    }
}

/// A bodiless request still says `Content-Length: 0` when the client sent
/// one or its method gives a body meaning (RFC 9110 §8.6): origins answer
/// 411 to a POST without it.
pub(crate) fn says_empty(sess: &Session) -> bool {
    sess.req.headers.has_known(known::CONTENT_LENGTH)
        || matches!(
            sess.up_req.method_kind(),
            pier_http::Method::Post | pier_http::Method::Put | pier_http::Method::Patch
        )
}

/// `X-Forwarded-For`: the client, after what a trusted proxy sent.
pub(crate) fn x_forwarded_for(out: &mut Vec<u8>, sess: &Session, trusted: bool) {
    if trusted {
        for v in sess.req.headers.get_all_known(known::X_FORWARDED_FOR) {
            out.extend_from_slice(v);
            out.extend_from_slice(b", ");
        }
    }
    push_hop(out, sess, trusted, false);
}

/// This hop's address in a forwarding header: the client; or, when a
/// trusted proxy named the client (`real_ip_header`: it is in the chain
/// already), the proxy Pier heard from, as every hop before it wrote
/// its own. `bracket_v6`: an IPv6 address quoted in brackets (RFC 7239 §6).
fn push_hop(out: &mut Vec<u8>, sess: &Session, trusted: bool, bracket_v6: bool) {
    let named = trusted && sess.client != sess.peer;
    let ip = pier_config::normalize(sess.peer.ip());
    let quote = bracket_v6
        && if named {
            ip.is_ipv6()
        } else {
            sess.client.is_ipv6()
        };
    if quote {
        out.extend_from_slice(b"\"[");
    }
    if named {
        use std::io::Write;
        let _ = write!(out, "{ip}");
    } else {
        out.extend_from_slice(sess.client_ip.as_bytes());
    }
    if quote {
        out.extend_from_slice(b"]\"");
    }
}

/// `Forwarded` (RFC 7239, `[http] forwarded`): a trusted proxy's elements,
/// then this hop's `for`, `proto` and `host` (an IPv6 `for` and any `host`
/// quoted, as §6 wants for anything but a token).
pub(crate) fn forwarded(out: &mut Vec<u8>, sess: &Session, trusted: bool) {
    if trusted {
        for v in sess.req.headers.get_all(b"forwarded") {
            out.extend_from_slice(v);
            out.extend_from_slice(b", ");
        }
    }
    out.extend_from_slice(b"for=");
    push_hop(out, sess, trusted, true);
    out.extend_from_slice(b";proto=");
    out.extend_from_slice(sess.scheme().as_bytes());
    if let Some(h) = sess.req.host() {
        // A canonical authority holds no quote or backslash to escape.
        out.extend_from_slice(b";host=\"");
        out.extend_from_slice(h);
        out.push(b'"');
    }
}

/// `X-Forwarded-Proto`: a trusted proxy's, else the connection's scheme.
pub(crate) fn x_forwarded_proto(sess: &Session, trusted: bool) -> &[u8] {
    match sess.req.headers.get_known(known::X_FORWARDED_PROTO) {
        Some(v) if trusted => v,
        _ => sess.scheme().as_bytes(),
    }
}

/// `X-Forwarded-Host`: a trusted proxy's, else the request's one authority.
pub(crate) fn x_forwarded_host(sess: &Session, trusted: bool) -> Option<&[u8]> {
    match sess.req.headers.get_known(known::X_FORWARDED_HOST) {
        Some(v) if trusted => Some(v),
        _ => sess.req.host(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn forwarding_names_are_found_in_any_case_and_nothing_else_is() {
        for n in [
            "Forwarded",
            "X-Real-IP",
            "x-forwarded-port",
            "X-Forwarded-Prefix",
            "X-Original-URL",
            "X-REWRITE-URL",
        ] {
            assert!(forwarding_name(n.as_bytes()), "{n}");
        }
        for n in ["forwardex", "x-forwarded-portx", "accept", "x-request-id"] {
            assert!(!forwarding_name(n.as_bytes()), "{n}");
        }
        assert!(!keep_field(
            known::CONTENT_LENGTH,
            b"content-length",
            true,
            false
        ));
        assert!(!keep_field(
            known::TRANSFER_ENCODING,
            b"transfer-encoding",
            true,
            false
        ));
        assert!(!keep_field(known::CONNECTION, b"connection", true, false));
        assert!(keep_field(known::UNKNOWN, b"forwarded", true, false));
        assert!(!keep_field(known::UNKNOWN, b"Forwarded", true, true));
        assert!(keep_field(known::UNKNOWN, b"x-real-ip", true, true));
        assert!(!keep_field(known::UNKNOWN, b"forwarded", false, false));
        assert!(keep_field(known::COOKIE, b"cookie", false, false));
    }
}
