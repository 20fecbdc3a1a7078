//! `${VAR}` / `${VAR:-default}` expansion on the raw file text, before TOML
//! parsing, so a variable can stand anywhere a value can (`workers = ${N:-0}`).
//!
//! Rules (documented in docs/config.md):
//! - `${NAME}` is replaced by the variable's value; unset is an error.
//! - `${NAME:-default}` uses `default` when NAME is unset or empty (shell
//!   semantics); the default is literal text up to the first `}`.
//! - `$$` is a literal `$`; any other `$` is left alone (so regexes such as
//!   `"\.png$"` need no escaping).
//! - Comments are not expanded: a comment can mention `${PIER_LISTEN}`
//!   without that variable having to exist.
//!
//! A variable's value is data, never TOML: it is fitted to the place it lands
//! in, so it cannot end a string or start a table.
//! - Inside a basic string (`"…"`, `"""…"""`) it is escaped: `\` and `"`
//!   get a backslash, control characters become `\n`, `\t`, `\uXXXX`.
//! - A literal string (`'…'`, `'''…'''`) has no escapes, so a value it could
//!   not hold as is (a `'`, a newline in `'…'`, `'''`, control characters) is
//!   an error that says to use a basic string.
//! - Outside strings (`workers = ${N}`) the value must be a bare scalar:
//!   letters, digits and `_ - + . :` (numbers, booleans, dates, times); anything
//!   else is an error that says to quote the reference.
//!
//! Defaults (`${NAME:-default}`) and `$$` are the config author's own text and
//! are inserted as written.
//!
//! Expansion shifts byte offsets, so it also returns a [`SourceMap`] that
//! maps offsets in the expanded text back to the original for error messages.

use std::ops::Range;

/// One substitution: `orig` in the original text became `expanded` in the output.
#[derive(Debug, Clone)]
struct Edit {
    orig: Range<usize>,
    expanded: Range<usize>,
}

/// Maps byte offsets in the expanded text back to the original text.
#[derive(Debug, Clone, Default)]
pub struct SourceMap {
    edits: Vec<Edit>,
}

impl SourceMap {
    /// Original offset for an expanded offset; an offset inside a
    /// substituted value maps to the start of its `${`.
    pub fn original(&self, pos: usize) -> usize {
        // Edits are sorted and disjoint; the shift after an edit is
        // orig.end - expanded.end.
        let mut shift: isize = 0;
        for e in &self.edits {
            if pos < e.expanded.start {
                break;
            }
            if pos < e.expanded.end || (e.expanded.is_empty() && pos == e.expanded.start) {
                return e.orig.start;
            }
            shift = e.orig.end as isize - e.expanded.end as isize;
        }
        (pos as isize + shift).max(0) as usize
    }
}

/// An expansion error at a byte offset of the original text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EnvError {
    pub offset: usize,
    pub message: String,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Lex {
    Normal,
    Comment,
    Basic,
    Literal,
    MlBasic,
    MlLiteral,
}

/// Expands `text` using `lookup` for variable values. Collects every error.
pub fn expand(
    text: &str,
    lookup: &dyn Fn(&str) -> Option<String>,
) -> Result<(String, SourceMap), Vec<EnvError>> {
    let bytes = text.as_bytes();
    let mut out = String::with_capacity(text.len());
    let mut map = SourceMap::default();
    let mut errors = Vec::new();
    let mut state = Lex::Normal;
    // Start of the not-yet-copied run of plain text.
    let mut copied = 0;
    let mut i = 0;
    while i < bytes.len() {
        let b = bytes[i];
        // Track just enough TOML lexing to know whether we are in a comment.
        match state {
            Lex::Comment => {
                if b == b'\n' {
                    state = Lex::Normal;
                }
                i += 1;
                continue;
            }
            Lex::Normal => match b {
                b'#' => {
                    state = Lex::Comment;
                    i += 1;
                    continue;
                }
                b'"' if bytes[i..].starts_with(b"\"\"\"") => {
                    state = Lex::MlBasic;
                    i += 3;
                    continue;
                }
                b'"' => {
                    state = Lex::Basic;
                    i += 1;
                    continue;
                }
                b'\'' if bytes[i..].starts_with(b"'''") => {
                    state = Lex::MlLiteral;
                    i += 3;
                    continue;
                }
                b'\'' => {
                    state = Lex::Literal;
                    i += 1;
                    continue;
                }
                _ => {}
            },
            Lex::Basic | Lex::MlBasic if b == b'\\' => {
                // Skip the escaped byte (it may be a quote).
                i += 2;
                continue;
            }
            Lex::Basic if b == b'"' || b == b'\n' => {
                state = Lex::Normal;
                i += 1;
                continue;
            }
            Lex::Literal if b == b'\'' || b == b'\n' => {
                state = Lex::Normal;
                i += 1;
                continue;
            }
            Lex::MlBasic if bytes[i..].starts_with(b"\"\"\"") => {
                state = Lex::Normal;
                i += 3;
                continue;
            }
            Lex::MlLiteral if bytes[i..].starts_with(b"'''") => {
                state = Lex::Normal;
                i += 3;
                continue;
            }
            _ => {}
        }
        if b != b'$' {
            i += 1;
            continue;
        }
        let start = i;
        let (end, value) = match bytes.get(i + 1) {
            Some(b'$') => (i + 2, Some("$".to_string())),
            Some(b'{') => match parse_ref(text, i) {
                Ok((end, name, default)) => {
                    let value = match (lookup(name), default) {
                        (Some(v), Some(d)) if v.is_empty() => Some(d.to_string()),
                        (Some(v), _) => match fit(&v, state) {
                            Ok(v) => Some(v),
                            Err(why) => {
                                errors.push(EnvError {
                                    offset: start,
                                    message: format!("environment variable `{name}` {why}"),
                                });
                                None
                            }
                        },
                        (None, Some(d)) => Some(d.to_string()),
                        (None, None) => {
                            errors.push(EnvError {
                                offset: start,
                                message: format!(
                                    "environment variable `{name}` is not set \
                                     (write ${{{name}:-default}} to give a default)"
                                ),
                            });
                            None
                        }
                    };
                    (end, value)
                }
                Err(e) => {
                    errors.push(e);
                    // Skip the `${` and keep scanning for more errors.
                    (i + 2, None)
                }
            },
            _ => {
                i += 1;
                continue;
            }
        };
        out.push_str(&text[copied..start]);
        let exp_start = out.len();
        if let Some(v) = &value {
            out.push_str(v);
        }
        map.edits.push(Edit {
            orig: start..end,
            expanded: exp_start..out.len(),
        });
        copied = end;
        i = end;
    }
    out.push_str(&text[copied..]);
    if errors.is_empty() {
        Ok((out, map))
    } else {
        Err(errors)
    }
}

/// Fits a variable's value to the lexical context it is substituted into,
/// so that it stays one value: escaped in basic strings, checked elsewhere.
/// `Err` says why it cannot go there.
fn fit(value: &str, state: Lex) -> Result<String, &'static str> {
    let control = |c: char| c.is_control() && c != '\t';
    match state {
        Lex::Basic | Lex::MlBasic => {
            let mut out = String::with_capacity(value.len() + 8);
            for c in value.chars() {
                match c {
                    '"' => out.push_str("\\\""),
                    '\\' => out.push_str("\\\\"),
                    '\n' => out.push_str("\\n"),
                    '\r' => out.push_str("\\r"),
                    '\t' => out.push_str("\\t"),
                    c if c.is_control() => out.push_str(&format!("\\u{:04X}", c as u32)),
                    c => out.push(c),
                }
            }
            Ok(out)
        }
        Lex::Literal => {
            if value.contains(['\'', '\n', '\r']) || value.chars().any(control) {
                Err(
                    "contains a quote, a newline or a control character, which a 'literal' \
                     string cannot hold: use a \"basic\" string around the reference",
                )
            } else {
                Ok(value.to_string())
            }
        }
        Lex::MlLiteral => {
            if value.contains("'") || value.chars().any(|c| control(c) && c != '\n') {
                Err(
                    "contains a quote or a control character, which a '''literal''' \
                     string cannot hold: use a \"basic\" string around the reference",
                )
            } else {
                Ok(value.to_string())
            }
        }
        Lex::Normal | Lex::Comment => {
            if value
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'+' | b'.' | b':'))
            {
                Ok(value.to_string())
            } else {
                Err("is not a bare number, boolean or date outside a string: \
                     put the reference inside quotes (\"${NAME}\") to use it as a string")
            }
        }
    }
}

/// Parses `${NAME}` or `${NAME:-default}` starting at `at` (which holds `$`).
/// Returns (end offset, name, default).
fn parse_ref(text: &str, at: usize) -> Result<(usize, &str, Option<&str>), EnvError> {
    let body_start = at + 2;
    let rest = &text[body_start..];
    let Some(close) = rest
        .find(['}', '\n'])
        .filter(|&c| rest.as_bytes()[c] == b'}')
    else {
        return Err(EnvError {
            offset: at,
            message: "unterminated `${` (missing `}`; write `$$` for a literal `$`)".into(),
        });
    };
    let body = &rest[..close];
    let (name, default) = match body.find(":-") {
        Some(p) => (&body[..p], Some(&body[p + 2..])),
        None => (body, None),
    };
    let valid = !name.is_empty()
        && !name.as_bytes()[0].is_ascii_digit()
        && name.bytes().all(|c| c.is_ascii_alphanumeric() || c == b'_');
    if !valid {
        return Err(EnvError {
            offset: at,
            message: format!(
                "invalid variable reference `${{{body}}}`: expected ${{NAME}} or ${{NAME:-default}} \
                 with NAME made of letters, digits and `_`"
            ),
        });
    }
    Ok((body_start + close + 1, name, default))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(name: &str) -> Option<String> {
        match name {
            "HOST" => Some("10.0.0.1".into()),
            "EMPTY" => Some(String::new()),
            "PORT" => Some("8080".into()),
            "EVIL" => Some("x\"\n[admin]\nlisten=\"0.0.0.0:1\"".into()),
            "WIN" => Some("C:\\dir\t'q'".into()),
            "CTRL" => Some("a\u{1}b\u{7f}".into()),
            _ => None,
        }
    }

    fn ok(text: &str) -> String {
        expand(text, &env).expect("expands").0
    }

    #[test]
    fn set_unset_default_escape() {
        assert_eq!(ok("a = \"${HOST}:${PORT}\""), "a = \"10.0.0.1:8080\"");
        assert_eq!(ok("a = \"${NOPE:-x:1}\""), "a = \"x:1\"");
        assert_eq!(ok("a = \"${HOST:-x}\""), "a = \"10.0.0.1\"");
        assert_eq!(ok("a = \"${EMPTY:-d}\""), "a = \"d\"");
        assert_eq!(ok("a = \"${EMPTY}\""), "a = \"\"");
        assert_eq!(ok("a = \"${NOPE:-}\""), "a = \"\"");
        assert_eq!(ok("a = \"$${HOST}\""), "a = \"${HOST}\"");
        assert_eq!(ok("a = \"cost $$5\""), "a = \"cost $5\"");
        // Unbraced `$` stays: regex anchors need no escaping.
        assert_eq!(ok("r = '\\.png$'\ns = \"$x\""), "r = '\\.png$'\ns = \"$x\"");
        // Outside strings too.
        assert_eq!(ok("workers = ${NOPE:-4}"), "workers = 4");
    }

    /// What `key` holds once the expanded text is parsed as TOML.
    fn parsed(text: &str) -> String {
        let out = ok(text);
        let t: toml::Table = toml::from_str(&out).unwrap_or_else(|e| panic!("{out:?}: {e}"));
        assert_eq!(t.len(), 1, "{out:?} gave more than one key: {t:?}");
        t["key"].as_str().expect("a string").to_string()
    }

    #[test]
    fn values_stay_values_in_basic_strings() {
        let evil = env("EVIL").unwrap();
        assert_eq!(parsed("key = \"${EVIL}\""), evil);
        assert_eq!(parsed("key = \"<${EVIL}>\""), format!("<{evil}>"));
        assert_eq!(parsed("key = \"\"\"${EVIL}\"\"\""), evil);
        assert_eq!(parsed("key = \"${WIN}\""), "C:\\dir\t'q'");
        assert_eq!(parsed("key = \"${CTRL}\""), "a\u{1}b\u{7f}");
        // Defaults are the author's text, inserted as written.
        assert_eq!(parsed("key = \"${NOPE:-a\\tb}\""), "a\tb");
    }

    #[test]
    fn values_a_literal_string_cannot_hold_are_errors() {
        assert_eq!(parsed("key = '${HOST}'"), "10.0.0.1");
        assert_eq!(parsed("key = '''${HOST}'''"), "10.0.0.1");
        // A multi-line literal holds newlines and double quotes as they are.
        assert_eq!(parsed("key = '''${EVIL}'''"), env("EVIL").unwrap());
        for text in [
            "key = '${EVIL}'",
            "key = '''${WIN}'''",
            "key = '${WIN}'",
            "key = '${CTRL}'",
        ] {
            let errs = expand(text, &env).unwrap_err();
            assert_eq!(errs.len(), 1, "{text}: {errs:?}");
            assert_eq!(errs[0].offset, text.find("${").unwrap());
            assert!(errs[0].message.contains("literal"), "{errs:?}");
        }
    }

    #[test]
    fn bare_values_must_be_scalars() {
        assert_eq!(ok("n = ${PORT}"), "n = 8080");
        assert_eq!(ok("n = ${HOST}"), "n = 10.0.0.1");
        for text in ["n = ${EVIL}", "n = ${WIN}", "n = [${EVIL}]"] {
            let errs = expand(text, &env).unwrap_err();
            assert_eq!(errs.len(), 1, "{text}: {errs:?}");
            assert!(errs[0].message.contains("inside quotes"), "{errs:?}");
        }
    }

    #[test]
    fn comments_are_not_expanded() {
        assert_eq!(
            ok("# uses ${NOPE}\na = \"#${PORT}\" # ${NOPE2}\n"),
            "# uses ${NOPE}\na = \"#8080\" # ${NOPE2}\n"
        );
        // A `#` inside strings of every kind is not a comment.
        assert_eq!(ok("a = '#${PORT}'"), "a = '#8080'");
        assert_eq!(ok("a = \"\"\"#\n${PORT}\"\"\""), "a = \"\"\"#\n8080\"\"\"");
        assert_eq!(ok("a = '''#\n${PORT}'''"), "a = '''#\n8080'''");
        assert_eq!(ok("a = \"\\\"#${PORT}\""), "a = \"\\\"#8080\"");
    }

    #[test]
    fn errors_are_collected_with_offsets() {
        let text = "a = \"${NOPE}\"\nb = \"${ALSO_NOPE}\"\nc = \"${bad name}\"\nd = \"${OPEN\"\n";
        let errs = expand(text, &env).unwrap_err();
        assert_eq!(errs.len(), 4, "{errs:?}");
        assert_eq!(errs[0].offset, 5);
        assert!(errs[0].message.contains("`NOPE` is not set"));
        assert_eq!(errs[1].offset, text.find("${ALSO").unwrap());
        assert!(errs[2].message.contains("invalid variable reference"));
        assert_eq!(errs[3].offset, text.find("${OPEN").unwrap());
        assert!(errs[3].message.contains("unterminated"));
    }

    #[test]
    fn source_map_points_back() {
        let text = "a = \"${HOST}\"\nb = \"${NOPE:-}\"\nc = 1\n";
        let (out, map) = expand(text, &env).unwrap();
        // `c` keeps its identity across two shifts.
        assert_eq!(
            map.original(out.find('c').unwrap()),
            text.find('c').unwrap()
        );
        // Inside a substituted value: the `${` that produced it.
        assert_eq!(
            map.original(out.find("0.0").unwrap()),
            text.find("${HOST").unwrap()
        );
        // An empty substitution maps to its reference.
        assert_eq!(
            map.original(out.find("\"\"").unwrap() + 1),
            text.find("${NOPE").unwrap()
        );
        // Before any edit: identity.
        assert_eq!(map.original(2), 2);
    }
}
