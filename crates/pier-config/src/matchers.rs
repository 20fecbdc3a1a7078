//! Route matchers compiled from the file: host patterns and path matchers.
//!
//! Varnish's lesson: many "regex" routes are really exact, prefix or suffix
//! comparisons. `^/a/b$`, `^/a/` and `\.png$` are compiled to plain string
//! comparisons here, so they cost a `starts_with` instead of a regex run.

use crate::model::{Config, HostMatch, PathMatch, Route};

impl PathMatch {
    /// Does this matcher accept `path` (the request path, no query string)?
    pub fn matches(&self, path: &str) -> bool {
        match self {
            PathMatch::Any => true,
            PathMatch::Exact(p) => path == p,
            PathMatch::Prefix(p) => path.starts_with(p.as_str()),
            PathMatch::Suffix(s) => path.ends_with(s.as_str()),
            PathMatch::Regex(r) => r.is_match(path),
        }
    }
}

impl HostMatch {
    /// Does this pattern accept `host`, a Host header value as sent (any
    /// case, optional port, optional trailing dot)? Allocation-free.
    pub fn matches(&self, host: &str) -> bool {
        let h = host_name(host).as_bytes();
        match self {
            HostMatch::Exact(e) => h.eq_ignore_ascii_case(e.as_bytes()),
            // ".example.com" matches "a.example.com", not "example.com".
            HostMatch::Suffix(s) => {
                h.len() > s.len() && h[h.len() - s.len()..].eq_ignore_ascii_case(s.as_bytes())
            }
        }
    }
}

/// "Example.com:8080" -> "Example.com", "[::1]:80" -> "[::1]", "a.com." -> "a.com".
pub fn host_name(host: &str) -> &str {
    let h = if host.starts_with('[') {
        host.find(']').map_or(host, |i| &host[..=i])
    } else {
        match host.rfind(':') {
            Some(i) if host[i + 1..].bytes().all(|b| b.is_ascii_digit()) => &host[..i],
            _ => host,
        }
    };
    h.strip_suffix('.').unwrap_or(h)
}

impl Route {
    /// Does this route take a request for `host` (the Host header as sent,
    /// None when absent) and `path` (without the query string)?
    pub fn matches(&self, host: Option<&str>, path: &str) -> bool {
        let host_ok = match (&self.host, host) {
            (None, _) => true,
            (Some(m), Some(h)) => m.matches(h),
            (Some(_), None) => false,
        };
        host_ok && self.path.matches(path)
    }
}

impl Config {
    /// The first route (in file order) that takes this request.
    pub fn find_route(&self, host: Option<&str>, path: &str) -> Option<&Route> {
        self.routes.iter().find(|r| r.matches(host, path))
    }
}

/// Compiles a route's `regex`, turning plain anchored literals into the
/// cheaper variants. The regex is compiled first so that invalid patterns
/// are reported even when they look simple.
pub fn compile_path_regex(pattern: &str) -> Result<PathMatch, String> {
    let re = regex::Regex::new(pattern).map_err(|e| regex_error(&e))?;
    Ok(simplify(pattern).unwrap_or(PathMatch::Regex(re)))
}

/// regex's syntax errors span three lines (pattern, caret, message); config
/// errors are one line each.
fn regex_error(e: &regex::Error) -> String {
    match e {
        regex::Error::Syntax(text) => {
            let lines: Vec<&str> = text.lines().collect();
            let msg = lines
                .iter()
                .rev()
                .find_map(|l| l.strip_prefix("error: "))
                .unwrap_or(text.as_str());
            // The caret line is indented like the pattern line above it.
            let pos = lines.iter().position(|l| {
                l.trim_start().starts_with('^') && l.trim().chars().all(|c| c == '^' || c == '~')
            });
            match pos {
                Some(i) if i > 0 => {
                    let pattern_line = lines[i - 1];
                    let indent = pattern_line.len() - pattern_line.trim_start().len();
                    let at = lines[i].len() - lines[i].trim_start().len() - indent + 1;
                    format!("invalid regex: {msg} (at character {at} of the pattern)")
                }
                _ => format!("invalid regex: {msg}"),
            }
        }
        other => format!("invalid regex: {}", other.to_string().replace('\n', " ")),
    }
}

/// `Some(plain matcher)` when `pattern` is an anchored literal.
fn simplify(pattern: &str) -> Option<PathMatch> {
    let (anchored_start, rest) = match pattern.strip_prefix('^') {
        Some(r) => (true, r),
        None => (false, pattern),
    };
    // A trailing `$` that is not itself escaped (`\$` is a literal dollar).
    let (anchored_end, body) = match rest.strip_suffix('$') {
        Some(b) if !ends_with_odd_backslashes(b) => (true, b),
        _ => (false, rest),
    };
    // `.*` next to an anchor cancels it: `^/a/.*$` is the prefix `/a/` and
    // `^.*\.png$` the suffix `.png` (paths never hold a newline, the one
    // byte `.` refuses).
    let (anchored_start, body) = match body.strip_prefix(".*") {
        Some(b) => (false, b),
        None => (anchored_start, body),
    };
    let (anchored_end, body) = match body.strip_suffix(".*") {
        Some(b) if !ends_with_odd_backslashes(b) => (false, b),
        _ => (anchored_end, body),
    };
    let literal = unescape_literal(body)?;
    Some(match (anchored_start, anchored_end) {
        (true, true) => PathMatch::Exact(literal),
        (true, false) if literal.is_empty() => PathMatch::Any,
        (true, false) => PathMatch::Prefix(literal),
        (false, true) if literal.is_empty() => PathMatch::Any,
        (false, true) => PathMatch::Suffix(literal),
        (false, false) if literal.is_empty() => PathMatch::Any,
        // An unanchored literal is a substring search: leave it to the regex
        // engine, which already uses memchr-style literal search for it.
        (false, false) => return None,
    })
}

fn ends_with_odd_backslashes(s: &str) -> bool {
    s.bytes().rev().take_while(|&b| b == b'\\').count() % 2 == 1
}

/// The literal text of `body`, or None if it contains any regex syntax other
/// than escaped punctuation (`\.`, `\/`, `\-`, ...).
fn unescape_literal(body: &str) -> Option<String> {
    let mut out = String::with_capacity(body.len());
    let mut chars = body.chars();
    while let Some(c) = chars.next() {
        match c {
            '\\' => {
                let e = chars.next()?;
                // `\d`, `\w`, `\b`, `\n`... are classes or assertions.
                if !e.is_ascii_punctuation() {
                    return None;
                }
                out.push(e);
            }
            '.' | '+' | '*' | '?' | '(' | ')' | '|' | '[' | ']' | '{' | '}' | '^' | '$' => {
                return None
            }
            // Whitespace is literal in the default syntax, but `#` or space
            // under a later `(?x)` would change that; no flags can appear
            // here since `(` is rejected.
            c => out.push(c),
        }
    }
    Some(out)
}

/// Parses a route `host`: "example.com" or "*.example.com" (any subdomain);
/// "*" or "" mean any host (None). Lower-cased.
pub fn parse_host(s: &str) -> Result<Option<HostMatch>, String> {
    let h = s.trim().to_ascii_lowercase();
    if h.is_empty() || h == "*" {
        return Ok(None);
    }
    let (suffix, name) = match h.strip_prefix("*.") {
        Some(rest) => (true, rest),
        None => (false, h.as_str()),
    };
    let ok_char =
        |c: char| c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '_' | '[' | ']' | ':');
    if name.is_empty() || !name.chars().all(ok_char) || name.starts_with('.') {
        return Err(format!(
            "invalid host {s:?}: expected a name such as \"example.com\" or \"*.example.com\" (no port, no path)"
        ));
    }
    Ok(Some(if suffix {
        HostMatch::Suffix(format!(".{name}"))
    } else {
        HostMatch::Exact(name.to_string())
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kind(p: &str) -> String {
        match compile_path_regex(p).unwrap() {
            PathMatch::Any => "any".into(),
            PathMatch::Exact(s) => format!("exact:{s}"),
            PathMatch::Prefix(s) => format!("prefix:{s}"),
            PathMatch::Suffix(s) => format!("suffix:{s}"),
            PathMatch::Regex(r) => format!("regex:{}", r.as_str()),
        }
    }

    #[test]
    fn plain_regexes_become_string_comparisons() {
        assert_eq!(kind("^/a/b$"), "exact:/a/b");
        assert_eq!(kind("^/a/"), "prefix:/a/");
        assert_eq!(kind("\\.png$"), "suffix:.png");
        assert_eq!(kind("^\\/api\\-v2\\/"), "prefix:/api-v2/");
        assert_eq!(kind("^/static/.*"), "prefix:/static/");
        assert_eq!(kind(".*\\.css$"), "suffix:.css");
        assert_eq!(kind("^/x/.*$"), "prefix:/x/");
        assert_eq!(kind("^.*\\.png$"), "suffix:.png");
        assert_eq!(kind(".*"), "any");
        assert_eq!(kind("^"), "any");
        assert_eq!(kind("^$"), "exact:");
        assert_eq!(kind("^/price\\$$"), "exact:/price$");
        assert_eq!(
            kind("^/a\\$"),
            "prefix:/a$",
            "an escaped `$` is a literal dollar"
        );
    }

    #[test]
    fn real_regexes_stay_regexes() {
        for p in [
            "^/img/.*\\.png$",
            "^/a.b$",
            "^/v[12]/",
            "^/(a|b)$",
            "\\d+$",
            "^/a+",
            "/plain",
            "(?i)^/a$",
            "^/x?$",
        ] {
            assert!(kind(p).starts_with("regex:"), "{p} -> {}", kind(p));
        }
    }

    #[test]
    fn simplified_matchers_agree_with_the_regex() {
        let paths = [
            "/",
            "/a/b",
            "/a/bc",
            "/a/",
            "/a",
            "/x.png",
            "/x.pngs",
            "/api-v2/x",
            "/price$",
        ];
        for p in [
            "^/a/b$",
            "^/a/",
            "\\.png$",
            "^\\/api\\-v2\\/",
            "^/price\\$$",
            "^/a/.*$",
            ".*\\.png$",
        ] {
            let re = regex::Regex::new(p).unwrap();
            let m = compile_path_regex(p).unwrap();
            assert!(!matches!(m, PathMatch::Regex(_)), "{p}");
            for path in paths {
                assert_eq!(m.matches(path), re.is_match(path), "{p} on {path}");
            }
        }
    }

    #[test]
    fn invalid_regex_is_an_error() {
        assert!(compile_path_regex("^/a(").is_err());
        assert!(compile_path_regex("^/[").is_err());
    }

    #[test]
    fn hosts() {
        assert_eq!(
            parse_host("Example.COM"),
            Ok(Some(HostMatch::Exact("example.com".into())))
        );
        assert_eq!(
            parse_host("*.example.com"),
            Ok(Some(HostMatch::Suffix(".example.com".into())))
        );
        assert_eq!(parse_host("*"), Ok(None));
        for bad in ["exa mple.com", "example.com/x", "*.", "a*.b", "*.*.b", ".x"] {
            assert!(parse_host(bad).is_err(), "{bad}");
        }
        let s = parse_host("*.example.com").unwrap().unwrap();
        assert!(s.matches("a.example.com"));
        assert!(s.matches("a.b.example.com"));
        assert!(!s.matches("example.com"));
        assert!(!s.matches("badexample.com"));
        assert!(s.matches("A.Example.COM:8443"));
        assert!(s.matches("a.example.com."));
        let e = parse_host("example.com").unwrap().unwrap();
        assert!(e.matches("EXAMPLE.com:80"));
        assert!(!e.matches("example.co"));
        assert!(!e.matches("www.example.com"));
        assert_eq!(host_name("[::1]:8080"), "[::1]");
        assert_eq!(host_name("[::1]"), "[::1]");
        assert_eq!(host_name("a.b:x"), "a.b:x");
    }
}
