//! Durations ("150ms", "10s", "2m", "1h", "1m30s") and sizes (16384, "16k",
//! "10m", "1g"; binary multiples as nginx uses).

use std::time::Duration;

/// Parses one or more `<integer><unit>` pairs; units: ms, s, m, h, d.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let err = || {
        format!("invalid duration {s:?}: expected a number and a unit (ms, s, m, h, d), e.g. \"150ms\", \"10s\", \"1m30s\"")
    };
    let t = s.trim();
    if t.is_empty() {
        return Err(err());
    }
    let b = t.as_bytes();
    let mut i = 0;
    let mut total_ms: u64 = 0;
    while i < b.len() {
        let n_start = i;
        while i < b.len() && b[i].is_ascii_digit() {
            i += 1;
        }
        if i == n_start {
            return Err(err());
        }
        let n: u64 = t[n_start..i].parse().map_err(|_| err())?;
        let u_start = i;
        while i < b.len() && b[i].is_ascii_alphabetic() {
            i += 1;
        }
        let unit_ms: u64 = match &t[u_start..i] {
            "ms" => 1,
            "s" => 1_000,
            "m" => 60_000,
            "h" => 3_600_000,
            "d" => 86_400_000,
            _ => return Err(err()),
        };
        total_ms = n
            .checked_mul(unit_ms)
            .and_then(|v| v.checked_add(total_ms))
            .ok_or_else(|| format!("duration {s:?} is too large"))?;
    }
    Ok(Duration::from_millis(total_ms))
}

/// Parses a byte size: plain digits, or digits followed by k, m or g
/// (case-insensitive, optional trailing "b": "16kb").
pub fn parse_size(s: &str) -> Result<u64, String> {
    let err = || {
        format!("invalid size {s:?}: expected bytes or a number with k, m or g, e.g. 16384, \"16k\", \"10m\", \"1g\"")
    };
    let t = s.trim().to_ascii_lowercase();
    let t = t.strip_suffix('b').unwrap_or(&t);
    let digits_end = t.bytes().take_while(|c| c.is_ascii_digit()).count();
    if digits_end == 0 {
        return Err(err());
    }
    let n: u64 = t[..digits_end].parse().map_err(|_| err())?;
    let mult: u64 = match &t[digits_end..] {
        "" => 1,
        "k" => 1 << 10,
        "m" => 1 << 20,
        "g" => 1 << 30,
        _ => return Err(err()),
    };
    n.checked_mul(mult)
        .ok_or_else(|| format!("size {s:?} is too large"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations() {
        assert_eq!(parse_duration("150ms"), Ok(Duration::from_millis(150)));
        assert_eq!(parse_duration("10s"), Ok(Duration::from_secs(10)));
        assert_eq!(parse_duration("2m"), Ok(Duration::from_secs(120)));
        assert_eq!(parse_duration("1h"), Ok(Duration::from_secs(3600)));
        assert_eq!(parse_duration("1d"), Ok(Duration::from_secs(86400)));
        assert_eq!(parse_duration("1m30s"), Ok(Duration::from_secs(90)));
        assert_eq!(parse_duration("0s"), Ok(Duration::ZERO));
        for bad in [
            "",
            "10",
            "s",
            "1.5s",
            "10 s",
            "-1s",
            "10sec",
            "1x",
            "99999999999999999999s",
        ] {
            assert!(parse_duration(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn sizes() {
        assert_eq!(parse_size("0"), Ok(0));
        assert_eq!(parse_size("16384"), Ok(16384));
        assert_eq!(parse_size("16k"), Ok(16384));
        assert_eq!(parse_size("16K"), Ok(16384));
        assert_eq!(parse_size("16kb"), Ok(16384));
        assert_eq!(parse_size("10m"), Ok(10 << 20));
        assert_eq!(parse_size("1g"), Ok(1 << 30));
        for bad in ["", "k", "1t", "-1", "1.5m", "1 k", "99999999999g"] {
            assert!(parse_size(bad).is_err(), "{bad:?}");
        }
    }
}
