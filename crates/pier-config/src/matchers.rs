//! Route matchers compiled from the file: host patterns and path matchers.
//!
//! Varnish's lesson: many "regex" routes are really exact, prefix or suffix
//! comparisons. `^/a/b$`, `^/a/` and `\.png$` are compiled to plain string
//! comparisons here, so they cost a `starts_with` instead of a regex run.

use crate::model::{HostMatch, PathMatch};

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
    /// Does this pattern accept `host` (already lower-cased, port removed)?
    pub fn matches(&self, host: &str) -> bool {
        match self {
            HostMatch::Exact(h) => host == h,
            // ".example.com" matches "a.example.com", not "example.com".
            HostMatch::Suffix(s) => host.len() > s.len() && host.ends_with(s.as_str()),
        }
    }
}

/// Compiles a route's `regex`, turning plain anchored literals into the
/// cheaper variants. The regex is compiled first so that invalid patterns
/// are reported even when they look simple.
pub fn compile_path_regex(pattern: &str) -> Result<PathMatch, String> {
    let re = regex::Regex::new(pattern).map_err(|e| format!("invalid regex: {e}"))?;
    Ok(simplify(pattern).unwrap_or(PathMatch::Regex(re)))
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
    }
}
