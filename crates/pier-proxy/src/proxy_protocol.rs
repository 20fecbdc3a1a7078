//! The PROXY protocol (HAProxy's, v1 text and v2 binary) on listeners that
//! ask for it (`proxy_protocol = true`): a load balancer in front of Pier
//! (AWS NLB, HAProxy) says who the client is before the client's bytes
//! (TLS or HTTP) follow. Only from the listener's `trusted_proxies`: from
//! anyone else, or without a valid header, the connection is closed and
//! counted, since the header would let any client name its own address.
//!
//! The header is read without reading past it (peeked, then consumed by
//! exactly its length), so what follows reaches the TLS or HTTP parser
//! untouched; its size is bounded ([`MAX_HEADER`]) and its time by
//! `client_header`.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Duration;
use tokio::io::AsyncReadExt;

/// Longest header accepted: v1's 107 bytes, or v2's 16 and its addresses
/// and TLVs (which Pier skips) up to this.
pub const MAX_HEADER: usize = 16 + 2048;

const V2_SIGNATURE: &[u8; 12] = b"\r\n\r\n\0\r\nQUIT\n";
const V1_MAX: usize = 107;

/// What a header said.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Header {
    /// The client's and the address it connected to.
    Proxied { src: SocketAddr, dst: SocketAddr },
    /// No client (v2 LOCAL, v1 UNKNOWN, or a family without addresses:
    /// the balancer's own health check): the connection is the balancer's.
    Local,
}

/// Not a PROXY protocol header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Malformed;

/// `buf` begins with a header: it and its length; None: not all of it is
/// here yet (every byte so far belongs to it); Err: not a valid header.
pub fn parse(buf: &[u8]) -> Result<Option<(Header, usize)>, Malformed> {
    let sig = V2_SIGNATURE.len().min(buf.len());
    if buf[..sig] == V2_SIGNATURE[..sig] {
        return parse_v2(buf);
    }
    let pre = b"PROXY ".len().min(buf.len());
    if buf[..pre] == b"PROXY "[..pre] {
        return parse_v1(buf);
    }
    Err(Malformed)
}

fn parse_v2(buf: &[u8]) -> Result<Option<(Header, usize)>, Malformed> {
    if buf.len() < 16 {
        return Ok(None);
    }
    let (ver_cmd, fam) = (buf[12], buf[13]);
    let len = u16::from_be_bytes([buf[14], buf[15]]) as usize;
    if ver_cmd >> 4 != 2 || 16 + len > MAX_HEADER {
        return Err(Malformed);
    }
    if buf.len() < 16 + len {
        return Ok(None);
    }
    let body = &buf[16..16 + len];
    let header = match ver_cmd & 0x0f {
        0 => Header::Local,
        1 => match fam >> 4 {
            // AF_INET, AF_INET6 (over STREAM or DGRAM; Pier's is a TCP one).
            1 if body.len() >= 12 => {
                let ip = |o: usize| Ipv4Addr::new(body[o], body[o + 1], body[o + 2], body[o + 3]);
                let port = |o: usize| u16::from_be_bytes([body[o], body[o + 1]]);
                Header::Proxied {
                    src: SocketAddr::new(IpAddr::V4(ip(0)), port(8)),
                    dst: SocketAddr::new(IpAddr::V4(ip(4)), port(10)),
                }
            }
            2 if body.len() >= 36 => {
                let ip = |o: usize| {
                    let mut a = [0u8; 16];
                    a.copy_from_slice(&body[o..o + 16]);
                    Ipv6Addr::from(a)
                };
                let port = |o: usize| u16::from_be_bytes([body[o], body[o + 1]]);
                Header::Proxied {
                    src: SocketAddr::new(IpAddr::V6(ip(0)), port(32)),
                    dst: SocketAddr::new(IpAddr::V6(ip(16)), port(34)),
                }
            }
            1 | 2 => return Err(Malformed),
            // AF_UNSPEC, AF_UNIX: no address Pier can use.
            _ => Header::Local,
        },
        _ => return Err(Malformed),
    };
    Ok(Some((header, 16 + len)))
}

fn parse_v1(buf: &[u8]) -> Result<Option<(Header, usize)>, Malformed> {
    let Some(end) = buf.windows(2).position(|w| w == b"\r\n") else {
        return if buf.len() >= V1_MAX {
            Err(Malformed)
        } else {
            Ok(None)
        };
    };
    if end + 2 > V1_MAX {
        return Err(Malformed);
    }
    let line = std::str::from_utf8(&buf[..end]).map_err(|_| Malformed)?;
    let mut f = line.split(' ');
    let (_, proto) = (f.next(), f.next().ok_or(Malformed)?);
    if proto == "UNKNOWN" {
        return Ok(Some((Header::Local, end + 2)));
    }
    let fields: Vec<&str> = f.collect();
    let [src, dst, sport, dport] = fields[..] else {
        return Err(Malformed);
    };
    let ip = |s: &str| -> Result<IpAddr, Malformed> {
        match proto {
            "TCP4" => s.parse::<Ipv4Addr>().map(IpAddr::V4).map_err(|_| Malformed),
            "TCP6" => s.parse::<Ipv6Addr>().map(IpAddr::V6).map_err(|_| Malformed),
            _ => Err(Malformed),
        }
    };
    let port = |s: &str| -> Result<u16, Malformed> {
        if s.is_empty() || s.len() > 5 || (s.len() > 1 && s.starts_with('0')) {
            return Err(Malformed);
        }
        s.parse().map_err(|_| Malformed)
    };
    Ok(Some((
        Header::Proxied {
            src: SocketAddr::new(ip(src)?, port(sport)?),
            dst: SocketAddr::new(ip(dst)?, port(dport)?),
        },
        end + 2,
    )))
}

/// Why a connection with `proxy_protocol` was closed before its header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refused {
    /// Not from one of the listener's `trusted_proxies`.
    Untrusted,
    /// Not a valid header, or longer than [`MAX_HEADER`].
    Invalid,
    /// Not all of it within `client_header`, or the peer closed first.
    Timeout,
}

/// Read the header off `stream` (its bytes only), within `within`.
pub async fn read(stream: &mut tokio::net::TcpStream, within: Duration) -> Result<Header, Refused> {
    match tokio::time::timeout(within, read_header(stream)).await {
        Ok(r) => r,
        Err(_) => Err(Refused::Timeout),
    }
}

async fn read_header(stream: &mut tokio::net::TcpStream) -> Result<Header, Refused> {
    // Bytes of the header already taken off the socket.
    let mut have: Vec<u8> = Vec::new();
    let mut peeked = [0u8; 512];
    loop {
        let room = (MAX_HEADER - have.len()).min(peeked.len());
        let n = stream
            .peek(&mut peeked[..room])
            .await
            .map_err(|_| Refused::Timeout)?;
        if n == 0 {
            return Err(Refused::Timeout);
        }
        let before = have.len();
        have.extend_from_slice(&peeked[..n]);
        match parse(&have) {
            Ok(Some((h, len))) => {
                // Take exactly the header's remaining bytes.
                let mut rest = vec![0u8; len - before];
                stream
                    .read_exact(&mut rest)
                    .await
                    .map_err(|_| Refused::Timeout)?;
                return Ok(h);
            }
            // All of it is the header's: take it, wait for more (a peek of
            // the same bytes again would not wait).
            Ok(None) if have.len() < MAX_HEADER => {
                stream
                    .read_exact(&mut peeked[..n])
                    .await
                    .map_err(|_| Refused::Timeout)?;
            }
            _ => return Err(Refused::Invalid),
        }
    }
}

/// Process-wide counts (`pier_proxy_protocol_total{result}` in /metrics):
/// ok, local, untrusted, invalid, timeout.
pub static COUNTS: [AtomicU64; 5] = [
    AtomicU64::new(0),
    AtomicU64::new(0),
    AtomicU64::new(0),
    AtomicU64::new(0),
    AtomicU64::new(0),
];

/// The label of each of [`COUNTS`].
pub const RESULTS: [&str; 5] = ["ok", "local", "untrusted", "invalid", "timeout"];

pub(crate) fn count(r: Result<&Header, Refused>) {
    let i = match r {
        Ok(Header::Proxied { .. }) => 0,
        Ok(Header::Local) => 1,
        Err(Refused::Untrusted) => 2,
        Err(Refused::Invalid) => 3,
        Err(Refused::Timeout) => 4,
    };
    COUNTS[i].fetch_add(1, Relaxed);
}

/// Which header Pier sends an upstream (`[upstream.NAME] send_proxy_protocol`).
pub use pier_config::SendProxy;

/// The header Pier sends an upstream before its own bytes (TLS or HTTP):
/// the client's connection as Pier took it — `src` the client (the
/// address a trusted balancer or `real_ip_header` named, else the peer),
/// `dst` the address it connected to. v2 carries the TLS server name the
/// client asked for (PP2_TYPE_AUTHORITY) and, for a TLS client, its
/// version and cipher (PP2_TYPE_SSL), as HAProxy's `send-proxy-v2-ssl`.
pub fn encode(
    version: SendProxy,
    src: SocketAddr,
    dst: SocketAddr,
    authority: Option<&str>,
    tls: Option<(&str, &str)>,
) -> Vec<u8> {
    // Both addresses in one family: a v4 client on a v6 listener (or the
    // reverse) is written as v4-mapped v6.
    let (src, dst) = match (src, dst) {
        (SocketAddr::V4(_), SocketAddr::V4(_)) | (SocketAddr::V6(_), SocketAddr::V6(_)) => {
            (src, dst)
        }
        _ => (v6(src), v6(dst)),
    };
    match version {
        SendProxy::V1 => {
            let fam = if src.is_ipv4() { "TCP4" } else { "TCP6" };
            format!(
                "PROXY {fam} {} {} {} {}\r\n",
                src.ip(),
                dst.ip(),
                src.port(),
                dst.port()
            )
            .into_bytes()
        }
        SendProxy::V2 => {
            let mut b = Vec::with_capacity(64);
            b.extend_from_slice(V2_SIGNATURE);
            b.push(0x21); // version 2, PROXY
            b.push(if src.is_ipv4() { 0x11 } else { 0x21 }); // TCP over IPv4 / IPv6
            b.extend_from_slice(&[0, 0]); // length, below
            match (src.ip(), dst.ip()) {
                (IpAddr::V4(s), IpAddr::V4(d)) => {
                    b.extend_from_slice(&s.octets());
                    b.extend_from_slice(&d.octets());
                }
                (IpAddr::V6(s), IpAddr::V6(d)) => {
                    b.extend_from_slice(&s.octets());
                    b.extend_from_slice(&d.octets());
                }
                _ => unreachable!("one family, above"),
            }
            b.extend_from_slice(&src.port().to_be_bytes());
            b.extend_from_slice(&dst.port().to_be_bytes());
            if let Some(a) = authority.filter(|a| !a.is_empty() && a.len() <= 255) {
                tlv(&mut b, 0x02, a.as_bytes());
            }
            if let Some((version, cipher)) = tls {
                // struct pp2_tlv_ssl: client (PP2_CLIENT_SSL), verify (0:
                // nothing to verify or verified), then sub-TLVs.
                let mut ssl = vec![0x01, 0, 0, 0, 0];
                tlv(&mut ssl, 0x21, version.as_bytes()); // PP2_SUBTYPE_SSL_VERSION
                tlv(&mut ssl, 0x23, cipher.as_bytes()); // PP2_SUBTYPE_SSL_CIPHER
                tlv(&mut b, 0x20, &ssl);
            }
            let len = (b.len() - 16) as u16;
            b[14..16].copy_from_slice(&len.to_be_bytes());
            b
        }
    }
}

fn v6(a: SocketAddr) -> SocketAddr {
    match a {
        SocketAddr::V4(v4) => SocketAddr::new(IpAddr::V6(v4.ip().to_ipv6_mapped()), v4.port()),
        v6 => v6,
    }
}

fn tlv(b: &mut Vec<u8>, kind: u8, value: &[u8]) {
    b.push(kind);
    b.extend_from_slice(&(value.len() as u16).to_be_bytes());
    b.extend_from_slice(value);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v2(cmd: u8, fam: u8, body: &[u8]) -> Vec<u8> {
        let mut b = V2_SIGNATURE.to_vec();
        b.push(0x20 | cmd);
        b.push(fam);
        b.extend_from_slice(&(body.len() as u16).to_be_bytes());
        b.extend_from_slice(body);
        b
    }

    #[test]
    fn what_pier_sends_upstream_parses_back() {
        let src: SocketAddr = "192.0.2.7:56324".parse().unwrap();
        let dst: SocketAddr = "10.0.0.1:443".parse().unwrap();
        for v in [SendProxy::V1, SendProxy::V2] {
            let mut h = encode(
                v,
                src,
                dst,
                Some("site.test"),
                Some(("TLSv1.3", "TLS13_AES_128_GCM_SHA256")),
            );
            let len = h.len();
            h.extend_from_slice(b"GET / HTTP/1.1\r\n");
            assert_eq!(
                parse(&h).unwrap().unwrap(),
                (Header::Proxied { src, dst }, len),
                "{v:?}"
            );
        }
        let v1 = encode(SendProxy::V1, src, dst, None, None);
        assert_eq!(v1, b"PROXY TCP4 192.0.2.7 10.0.0.1 56324 443\r\n");
        // Mixed families: both as v6.
        let six: SocketAddr = "[2001:db8::1]:8443".parse().unwrap();
        let h = encode(SendProxy::V2, src, six, None, None);
        let (got, _) = parse(&h).unwrap().unwrap();
        assert_eq!(
            got,
            Header::Proxied {
                src: "[::ffff:192.0.2.7]:56324".parse().unwrap(),
                dst: six
            }
        );
        // The TLVs: authority, then SSL with version and cipher.
        let h = encode(
            SendProxy::V2,
            src,
            dst,
            Some("site.test"),
            Some(("TLSv1.3", "X")),
        );
        let tlvs = &h[16 + 12..];
        assert_eq!(&tlvs[..3], &[0x02, 0, 9]);
        assert_eq!(&tlvs[3..12], b"site.test");
        assert_eq!(tlvs[12], 0x20);
    }

    #[test]
    fn v1_headers() {
        let h = b"PROXY TCP4 192.0.2.7 10.0.0.1 56324 443\r\nGET / HTTP/1.1\r\n";
        let (got, len) = parse(h).unwrap().unwrap();
        assert_eq!(len, 41);
        assert_eq!(
            got,
            Header::Proxied {
                src: "192.0.2.7:56324".parse().unwrap(),
                dst: "10.0.0.1:443".parse().unwrap()
            }
        );
        let (got, _) = parse(b"PROXY TCP6 2001:db8::1 ::1 1 2\r\n")
            .unwrap()
            .unwrap();
        assert_eq!(
            got,
            Header::Proxied {
                src: "[2001:db8::1]:1".parse().unwrap(),
                dst: "[::1]:2".parse().unwrap()
            }
        );
        assert_eq!(
            parse(b"PROXY UNKNOWN ffff::1 ::1 1 2\r\n").unwrap(),
            Some((Header::Local, 31))
        );
        // Incomplete: every byte so far is the header's.
        assert_eq!(parse(b"PROX").unwrap(), None);
        assert_eq!(parse(b"PROXY TCP4 192.0.2.7 10.0.0").unwrap(), None);
        for bad in [
            &b"GET / HTTP/1.1\r\n"[..],
            b"PROXY TCP4 192.0.2.7 10.0.0.1 56324\r\n",
            b"PROXY TCP4 2001:db8::1 10.0.0.1 1 2\r\n",
            b"PROXY TCP4 192.0.2.7 10.0.0.1 65536 2\r\n",
            b"PROXY TCP4 192.0.2.7 10.0.0.1 01 2\r\n",
            b"PROXY TCP4 192.0.2.7  10.0.0.1 1 2\r\n",
            b"PROXY UDP4 192.0.2.7 10.0.0.1 1 2\r\n",
        ] {
            assert!(parse(bad).is_err(), "{:?}", String::from_utf8_lossy(bad));
        }
        // No CRLF within v1's 107 bytes.
        let long = format!("PROXY TCP4 {}", "1".repeat(120));
        assert!(parse(long.as_bytes()).is_err());
    }

    #[test]
    fn v2_headers() {
        let mut body = vec![192, 0, 2, 7, 10, 0, 0, 1];
        body.extend_from_slice(&56324u16.to_be_bytes());
        body.extend_from_slice(&443u16.to_be_bytes());
        // A TLV after the addresses (skipped).
        body.extend_from_slice(&[0x02, 0x00, 0x03, b'a', b'b', b'c']);
        let h = v2(1, 0x11, &body);
        let mut with_data = h.clone();
        with_data.extend_from_slice(b"\x16\x03\x01");
        assert_eq!(
            parse(&with_data).unwrap(),
            Some((
                Header::Proxied {
                    src: "192.0.2.7:56324".parse().unwrap(),
                    dst: "10.0.0.1:443".parse().unwrap()
                },
                h.len()
            ))
        );
        for cut in [1, 12, 15, 16, h.len() - 1] {
            assert_eq!(parse(&h[..cut]).unwrap(), None, "{cut}");
        }
        let mut six = vec![0u8; 36];
        six[15] = 1;
        six[31] = 2;
        six[32..34].copy_from_slice(&7u16.to_be_bytes());
        six[34..36].copy_from_slice(&8u16.to_be_bytes());
        assert_eq!(
            parse(&v2(1, 0x21, &six)).unwrap().unwrap().0,
            Header::Proxied {
                src: "[::1]:7".parse().unwrap(),
                dst: "[::2]:8".parse().unwrap()
            }
        );
        assert_eq!(parse(&v2(0, 0x00, b"")).unwrap().unwrap().0, Header::Local);
        assert_eq!(
            parse(&v2(1, 0x31, &[0; 216])).unwrap().unwrap().0,
            Header::Local
        );
        // A short address block, an unknown command, version 1, too long.
        assert!(parse(&v2(1, 0x11, &[1, 2, 3])).is_err());
        assert!(parse(&v2(2, 0x11, &body)).is_err());
        let mut v1 = v2(1, 0x11, &body);
        v1[12] = 0x11;
        assert!(parse(&v1).is_err());
        let mut long = V2_SIGNATURE.to_vec();
        long.extend_from_slice(&[0x21, 0x11, 0xff, 0xff]);
        assert!(parse(&long).is_err());
    }
}
