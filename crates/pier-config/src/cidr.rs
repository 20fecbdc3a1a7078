//! CIDR ranges for `security.deny_origins`.
//!
//! Pingora's deny list was bypassed with `::ffff:127.0.0.1`: the address was
//! compared as IPv6 against IPv4 rules. Here both the rule and the address
//! are normalised (IPv4-mapped IPv6 becomes IPv4) before comparing.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use crate::model::Cidr;

/// `::ffff:a.b.c.d` -> `a.b.c.d`; anything else unchanged.
pub fn normalize(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => ip,
        },
        v4 => v4,
    }
}

impl Cidr {
    /// Parses "10.0.0.0/8", "::1/128", "::ffff:0:0/96" or a bare address
    /// (a single host: /32 or /128). Host bits below the prefix are cleared.
    pub fn parse(s: &str) -> Result<Cidr, String> {
        let s = s.trim();
        let (addr_s, prefix_s) = match s.split_once('/') {
            Some((a, p)) => (a, Some(p)),
            None => (s, None),
        };
        let addr: IpAddr = addr_s
            .parse()
            .map_err(|_| format!("invalid CIDR {s:?}: {addr_s:?} is not an IP address"))?;
        let max = if addr.is_ipv4() { 32 } else { 128 };
        let prefix = match prefix_s {
            None => max,
            Some(p) => match p.parse::<u8>() {
                Ok(n) if n <= max && !p.starts_with('+') => n,
                _ => {
                    return Err(format!(
                        "invalid CIDR {s:?}: prefix length must be 0..={max}"
                    ))
                }
            },
        };
        Ok(normalize_rule(addr, prefix))
    }

    /// Does `ip` fall in this range? Both sides are compared in normalised form.
    pub fn contains(&self, ip: IpAddr) -> bool {
        // Rules are stored normalised by `parse`; normalise again in case the
        // struct was built by hand.
        let rule = normalize_rule(self.addr, self.prefix);
        match (rule.addr, normalize(ip)) {
            (IpAddr::V4(net), IpAddr::V4(a)) => {
                let mask = mask32(rule.prefix);
                u32::from(net) & mask == u32::from(a) & mask
            }
            (IpAddr::V6(net), IpAddr::V6(a)) => {
                let mask = mask128(rule.prefix);
                u128::from(net) & mask == u128::from(a) & mask
            }
            _ => false,
        }
    }
}

impl std::fmt::Display for Cidr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.addr, self.prefix)
    }
}

/// Is `ip` inside any range of `list`?
pub fn denied(list: &[Cidr], ip: IpAddr) -> bool {
    list.iter().any(|c| c.contains(ip))
}

fn mask32(prefix: u8) -> u32 {
    if prefix == 0 {
        0
    } else {
        u32::MAX << (32 - u32::from(prefix.min(32)))
    }
}

fn mask128(prefix: u8) -> u128 {
    if prefix == 0 {
        0
    } else {
        u128::MAX << (128 - u32::from(prefix.min(128)))
    }
}

/// A rule on the IPv4-mapped block (`::ffff:a.b.c.d/n` with n >= 96) is the
/// IPv4 rule `a.b.c.d/(n-96)`; host bits are cleared.
fn normalize_rule(addr: IpAddr, prefix: u8) -> Cidr {
    match addr {
        IpAddr::V6(v6) => {
            if let (Some(v4), true) = (v6.to_ipv4_mapped(), prefix >= 96) {
                let p = (prefix - 96).min(32);
                return Cidr {
                    addr: IpAddr::V4(Ipv4Addr::from(u32::from(v4) & mask32(p))),
                    prefix: p,
                };
            }
            let p = prefix.min(128);
            Cidr {
                addr: IpAddr::V6(Ipv6Addr::from(u128::from(v6) & mask128(p))),
                prefix: p,
            }
        }
        IpAddr::V4(v4) => {
            let p = prefix.min(32);
            Cidr {
                addr: IpAddr::V4(Ipv4Addr::from(u32::from(v4) & mask32(p))),
                prefix: p,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }
    fn cidr(s: &str) -> Cidr {
        Cidr::parse(s).unwrap()
    }

    #[test]
    fn mapped_v6_is_checked_as_v4() {
        let loopback = cidr("127.0.0.0/8");
        assert!(loopback.contains(ip("127.0.0.1")));
        assert!(loopback.contains(ip("127.255.0.9")));
        // The Pingora bypass.
        assert!(loopback.contains(ip("::ffff:127.0.0.1")));
        assert!(loopback.contains(ip("::ffff:7f00:1")));
        assert!(!loopback.contains(ip("::ffff:128.0.0.1")));
        assert!(!loopback.contains(ip("128.0.0.1")));
        // ::1 is IPv6 loopback, not 127/8; it needs its own rule.
        assert!(!loopback.contains(ip("::1")));
        assert!(cidr("::1/128").contains(ip("::1")));
        assert!(cidr("::1").contains(ip("::1")));
        assert!(!cidr("::1/128").contains(ip("::2")));
        assert!(!cidr("::1/128").contains(ip("127.0.0.1")));
        // IPv4-compatible (deprecated ::a.b.c.d) is not mapped; leave it v6.
        assert!(!loopback.contains(ip("::127.0.0.1")));
    }

    #[test]
    fn private_ranges() {
        let ten = cidr("10.0.0.0/8");
        assert!(ten.contains(ip("10.1.2.3")));
        assert!(ten.contains(ip("::ffff:10.1.2.3")));
        assert!(!ten.contains(ip("11.0.0.0")));
        assert!(!ten.contains(ip("9.255.255.255")));
        let lan = cidr("192.168.0.0/16");
        assert!(lan.contains(ip("192.168.255.1")));
        assert!(lan.contains(ip("::ffff:192.168.0.1")));
        assert!(!lan.contains(ip("192.169.0.1")));
        let list = [ten, lan, cidr("::1/128")];
        assert!(denied(&list, ip("::ffff:10.0.0.1")));
        assert!(denied(&list, ip("::1")));
        assert!(!denied(&list, ip("8.8.8.8")));
        assert!(!denied(&[], ip("10.0.0.1")));
    }

    #[test]
    fn mapped_block_rules() {
        // A rule written on the mapped block covers both spellings of every IPv4 address.
        let all_mapped = cidr("::ffff:0:0/96");
        assert_eq!(all_mapped, cidr("0.0.0.0/0"));
        assert!(all_mapped.contains(ip("1.2.3.4")));
        assert!(all_mapped.contains(ip("::ffff:1.2.3.4")));
        assert!(!all_mapped.contains(ip("::1")));
        assert!(!all_mapped.contains(ip("2001:db8::1")));
        let mapped_loopback = cidr("::ffff:127.0.0.0/104");
        assert_eq!(mapped_loopback, cidr("127.0.0.0/8"));
        assert!(mapped_loopback.contains(ip("127.0.0.1")));
        // Shorter than /96 stays an IPv6 rule.
        let wide = cidr("::/64");
        assert!(wide.contains(ip("::1")));
        assert!(!wide.contains(ip("127.0.0.1")));
        // A hand-built mapped rule is normalised too.
        let hand = Cidr {
            addr: ip("::ffff:10.0.0.0"),
            prefix: 104,
        };
        assert!(hand.contains(ip("10.9.9.9")));
        assert!(hand.contains(ip("::ffff:10.9.9.9")));
    }

    #[test]
    fn prefix_edges() {
        let any4 = cidr("0.0.0.0/0");
        assert!(any4.contains(ip("255.255.255.255")));
        assert!(any4.contains(ip("::ffff:1.1.1.1")));
        assert!(
            !any4.contains(ip("::1")),
            "an IPv4 rule never matches real IPv6"
        );
        let any6 = cidr("::/0");
        assert!(any6.contains(ip("2001:db8::1")));
        assert!(any6.contains(ip("::1")));
        assert!(!any6.contains(ip("1.1.1.1")), "mapped addresses are IPv4");
        let host = cidr("10.0.0.1/32");
        assert!(host.contains(ip("10.0.0.1")));
        assert!(!host.contains(ip("10.0.0.2")));
        assert_eq!(cidr("10.0.0.1"), host);
        let host6 = cidr("2001:db8::1/128");
        assert!(host6.contains(ip("2001:db8::1")));
        assert!(!host6.contains(ip("2001:db8::2")));
        // Host bits are cleared.
        assert_eq!(cidr("10.1.2.3/8").addr, ip("10.0.0.0"));
        assert_eq!(cidr("10.1.2.3/8").to_string(), "10.0.0.0/8");
    }

    #[test]
    fn parse_errors() {
        for bad in [
            "",
            "10.0.0.0/33",
            "::/129",
            "10.0.0.0/",
            "10.0.0.0/-1",
            "10.0.0/8",
            "host/8",
            "10.0.0.0/+8",
        ] {
            assert!(Cidr::parse(bad).is_err(), "{bad:?}");
        }
    }
}
