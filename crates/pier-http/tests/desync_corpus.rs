//! Pier's request parser against the request corpus of AWS's
//! `http_desync_guardian` crate (its `tests/*.yaml`, read from the crate's
//! source in the cargo registry), plus a corpus of chunked-body smuggling
//! shapes the YAML corpus cannot express (it carries no bodies).
//!
//! Verdicts, per the corpus' request tier:
//! - Severe: Pier refuses (an `Err` from `RequestHead::parse`).
//! - Compliant: Pier accepts, with the framing RFC 9112 §6.3 gives, except
//!   the cases in `STRICTER` (each with the exact error and why).
//! - Acceptable / Ambiguous: Pier refuses, or accepts with exactly the framing
//!   RFC 9112 §6.3 gives (`rfc_framing`); accepting a request whose framing
//!   the RFC leaves undefined or requires rejecting fails.
//!
//! Accepting also means: the head ends exactly where the corpus request ends
//! (no second request carved out of it), and a chunked body that follows is
//! scanned to its exact end.
//!
//! Cases where Pier is wrong stay asserted and are listed in `KNOWN_GAPS`:
//! the test fails if such a case starts passing, so the list stays honest.

use http_desync_guardian::request_analyzer::HttpRequestData;
use http_desync_guardian::{ClassificationReason, RequestSafetyTier};
use pier_error::{Kind, Source};
use pier_http::{BodyLen, ChunkedScanner, HeadLimits, RequestHead};
use serde::Deserialize;
use std::collections::{BTreeMap, HashSet};
use std::path::{Path, PathBuf};

/// Compliant corpus cases Pier refuses on purpose: (file, case name, method,
/// the exact error, why Pier is stricter).
const STRICTER: &[(&str, &str, &str, Kind, &str)] = &[
    (
        "rfc-compliant.yaml",
        "Transfer-Encoding with a param: chunked;custom_param",
        "POST",
        Kind::UnsupportedTransferEncoding,
        "codings carry `;` with no parameter after it (`gzip   ;`, `chunked;custom_param;`): \
         not RFC 9110 transfer-parameter syntax (token \"=\" value), and chunked has no \
         parameters; Pier frames only by a bare final `chunked`",
    ),
    (
        "more-compliant-tests.yaml",
        "TE with custom parameters OK",
        "POST",
        Kind::UnsupportedTransferEncoding,
        "same as above: `chunked;custom_param;` is not valid transfer-coding syntax",
    ),
    (
        "rfc-compliant.yaml",
        "Empty URI",
        "GET",
        Kind::InvalidRequestLine,
        "an empty request-target is not a valid request-line (RFC 9112 §3.2): \
         `GET  HTTP/1.1` has two spaces and no target",
    ),
];

/// Cases where Pier's behaviour is wrong today (the assertion is kept):
/// (file, case name, method, what is wrong). Reported to the parser's owner.
const KNOWN_GAPS: &[(&str, &str, &str, &str)] = &[];

#[derive(Deserialize)]
struct RawCase {
    name: String,
    uri: serde_yaml::Value,
    method: serde_yaml::Value,
    version: serde_yaml::Value,
    headers: Option<Vec<RawHeader>>,
    expected: RawExpected,
}

#[derive(Deserialize)]
struct RawHeader {
    name: serde_yaml::Value,
    value: serde_yaml::Value,
}

#[derive(Deserialize)]
struct RawExpected {
    tier: String,
    reason: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Tier {
    Compliant,
    Acceptable,
    Ambiguous,
    Severe,
}

struct Case {
    file: String,
    name: String,
    method: String,
    uri: String,
    version: String,
    headers: Vec<(String, String)>,
    tier: Tier,
    reason: String,
}

impl Case {
    fn id(&self) -> String {
        format!("{}: {:?} ({})", self.file, self.name, self.method)
    }
    fn is(&self, file: &str, name: &str, method: &str) -> bool {
        self.file == file && self.name == name && self.method == method
    }
}

/// The registry copy of the crate's tests/ directory, for the version
/// Cargo.lock pins. `PIER_DESYNC_CORPUS` overrides (e.g. a vendored copy).
fn corpus_dir() -> PathBuf {
    if let Some(p) = std::env::var_os("PIER_DESYNC_CORPUS") {
        return PathBuf::from(p);
    }
    let lock = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../Cargo.lock");
    let lock = std::fs::read_to_string(&lock)
        .unwrap_or_else(|e| panic!("reading {}: {e}", lock.display()));
    let version = lock
        .split("[[package]]")
        .find(|p| p.contains("name = \"http_desync_guardian\""))
        .and_then(|p| p.lines().find_map(|l| l.strip_prefix("version = \"")))
        .and_then(|v| v.strip_suffix('"'))
        .expect("http_desync_guardian is not in Cargo.lock");
    let cargo_home = std::env::var_os("CARGO_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cargo")))
        .expect("neither CARGO_HOME nor HOME is set");
    let src = cargo_home.join("registry").join("src");
    let mut tried = Vec::new();
    if let Ok(rd) = std::fs::read_dir(&src) {
        for e in rd.flatten() {
            let d = e
                .path()
                .join(format!("http_desync_guardian-{version}"))
                .join("tests");
            if d.join("severe.yaml").is_file() {
                return d;
            }
            tried.push(d);
        }
    }
    panic!(
        "http_desync_guardian {version} corpus not found under {} (tried {tried:?}); \
         run `cargo fetch` or set PIER_DESYNC_CORPUS to its tests/ directory",
        src.display()
    );
}

fn scalar(v: &serde_yaml::Value, what: &str, case: &str) -> String {
    match v {
        serde_yaml::Value::String(s) => unescape(s),
        serde_yaml::Value::Number(n) => n.to_string(),
        serde_yaml::Value::Null => String::new(),
        other => panic!("case {case:?}: field {what} is {other:?}"),
    }
}

/// The corpus' own second escape layer (its harness applies it to every field
/// after YAML parsing): `\xHH`, `\b`, `\f`, `\n`, `\r`, `\t`, `\<c>` -> c.
fn unescape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut chars = s.chars();
    while let Some(c) = chars.next() {
        if c != '\\' {
            out.push(c);
            continue;
        }
        out.push(match chars.next() {
            Some('x') => {
                let hex: String = chars.by_ref().take(2).collect();
                char::from(u8::from_str_radix(&hex, 16).expect("bad \\x escape"))
            }
            Some('b') => '\x08',
            Some('f') => '\x0c',
            Some('n') => '\n',
            Some('r') => '\r',
            Some('t') => '\t',
            Some(c) => c,
            None => panic!("dangling backslash in {s:?}"),
        });
    }
    out
}

const FILES: [&str; 10] = [
    "acceptable.yaml",
    "ambiguous.yaml",
    "bad-header-characters.yaml",
    "edge-cases.yaml",
    "more-compliant-tests.yaml",
    "real-life-test-cases.yaml",
    "rfc-compliant.yaml",
    "severe.yaml",
    "single-case.yaml",
    "uri-specific-test-cases.yaml",
];

fn load_corpus() -> Vec<Case> {
    let dir = corpus_dir();
    let mut names: Vec<String> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".yaml"))
        .collect();
    names.sort();
    for f in FILES {
        assert!(
            names.iter().any(|n| n == f),
            "{f} missing in {}",
            dir.display()
        );
    }
    let mut cases = Vec::new();
    for file in &names {
        let text = std::fs::read_to_string(dir.join(file)).unwrap();
        let raw: Vec<RawCase> =
            serde_yaml::from_str(&text).unwrap_or_else(|e| panic!("{file}: {e}"));
        assert!(!raw.is_empty(), "{file} has no cases");
        for r in raw {
            let n = &r.name;
            let tier = match r.expected.tier.as_str() {
                "Compliant" => Tier::Compliant,
                "Acceptable" => Tier::Acceptable,
                "Ambiguous" => Tier::Ambiguous,
                "Severe" => Tier::Severe,
                t => panic!("{file}: case {n:?} has tier {t:?}"),
            };
            cases.push(Case {
                file: file.clone(),
                method: scalar(&r.method, "method", n),
                uri: scalar(&r.uri, "uri", n),
                version: scalar(&r.version, "version", n),
                headers: r
                    .headers
                    .unwrap_or_default()
                    .iter()
                    .map(|h| (scalar(&h.name, "name", n), scalar(&h.value, "value", n)))
                    .collect(),
                tier,
                reason: r.expected.reason,
                name: r.name,
            });
        }
    }
    let mut ids = HashSet::new();
    for c in &cases {
        assert!(ids.insert(c.id()), "duplicate case id {}", c.id());
    }
    cases
}

const HOST: &str = "corpus.test";

/// The request as the corpus' harness builds it (`{method} {uri} {version}`,
/// `{name}: {value}` lines), with a `Host` line added when the case has none:
/// the corpus classifies framing, and Pier refuses an HTTP/1.1 request without
/// Host (RFC 9112 §3.2), which would hide every other verdict.
fn raw_request(c: &Case) -> Vec<u8> {
    let mut s = format!("{} {} {}\r\n", c.method, c.uri, c.version);
    if !c
        .headers
        .iter()
        .any(|(n, _)| n.eq_ignore_ascii_case("host"))
    {
        s.push_str("Host: ");
        s.push_str(HOST);
        s.push_str("\r\n");
    }
    for (n, v) in &c.headers {
        s.push_str(n);
        s.push_str(": ");
        s.push_str(v);
        s.push_str("\r\n");
    }
    s.push_str("\r\n");
    s.into_bytes()
}

fn tchar(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

fn token(s: &[u8]) -> bool {
    !s.is_empty() && s.iter().all(|&b| tchar(b))
}

fn ows_trim(s: &str) -> &str {
    s.trim_matches([' ', '\t'])
}

/// transfer-coding = token *( OWS ";" OWS token BWS "=" BWS ( token / quoted-string ) )
/// (RFC 9110 §10.1.4, §5.6.6). Returns the coding name.
fn transfer_coding(s: &str) -> Option<&str> {
    let mut parts = s.split(';');
    let name = ows_trim(parts.next()?);
    if !token(name.as_bytes()) {
        return None;
    }
    for p in parts {
        let (k, v) = p.split_once('=')?;
        let (k, v) = (ows_trim(k), ows_trim(v));
        let quoted = v.len() >= 2 && v.starts_with('"') && v.ends_with('"');
        if !token(k.as_bytes()) || !(token(v.as_bytes()) || quoted) {
            return None;
        }
    }
    Some(name)
}

/// The framing RFC 9112 gives this request, or why the RFC requires (or
/// leaves no choice but) refusing it. Computed from the corpus' structured
/// fields, independently of Pier's parser.
fn rfc_framing(c: &Case) -> Result<BodyLen, &'static str> {
    if !token(c.method.as_bytes()) {
        return Err("method is not a token");
    }
    let uri = c.uri.as_bytes();
    if uri.is_empty() || uri.iter().any(|&b| b <= b' ' || b == 0x7f) {
        return Err("request-target empty or holds SP/CTL");
    }
    let http11 = match c.version.as_str() {
        "HTTP/1.0" => false,
        "HTTP/1.1" => true,
        // RFC 9112 §2.3: a higher minor version is processed as 1.1.
        v if v.len() == 8 && v.starts_with("HTTP/1.") && v.as_bytes()[7].is_ascii_digit() => true,
        _ => return Err("not an HTTP/1.x version"),
    };
    let mut te: Vec<&str> = Vec::new();
    let mut cl: Vec<&str> = Vec::new();
    for (n, v) in &c.headers {
        // §5.1: whitespace before the colon MUST be rejected; a name that is
        // not a token makes the field line invalid.
        if !token(n.as_bytes()) {
            return Err("field name is not a token");
        }
        if v.bytes().any(|b| b == b'\r' || b == b'\n' || b == 0) {
            return Err("CR/LF/NUL in a field value");
        }
        let framing =
            n.eq_ignore_ascii_case("transfer-encoding") || n.eq_ignore_ascii_case("content-length");
        if framing && v.bytes().any(|b| (b < b' ' && b != b'\t') || b >= 0x7f) {
            return Err("CTL or non-ASCII byte in a framing header");
        }
        if n.eq_ignore_ascii_case("transfer-encoding") {
            te.push(v);
        } else if n.eq_ignore_ascii_case("content-length") {
            cl.push(v);
        }
    }
    if !te.is_empty() {
        if !http11 {
            return Err("Transfer-Encoding in HTTP/1.0 (RFC 9112 §6.1: faulty framing)");
        }
        let mut codings = Vec::new();
        for v in &te {
            for item in v.split(',') {
                if ows_trim(item).is_empty() {
                    continue; // empty list elements are allowed (RFC 9110 §5.6.1)
                }
                codings.push(transfer_coding(item).ok_or("malformed transfer-coding")?);
            }
        }
        let chunked = codings
            .iter()
            .filter(|c| c.eq_ignore_ascii_case("chunked"))
            .count();
        let last = codings.last().ok_or("empty Transfer-Encoding")?;
        if chunked != 1 || !last.eq_ignore_ascii_case("chunked") {
            return Err("chunked is not the final coding exactly once (RFC 9112 §6.3 rule 4)");
        }
        // §6.3 rule 3: Transfer-Encoding overrides Content-Length.
        return Ok(BodyLen::Chunked);
    }
    let mut len: Option<u64> = None;
    for v in &cl {
        for item in v.split(',') {
            let item = ows_trim(item);
            if item.is_empty() || !item.bytes().all(|b| b.is_ascii_digit()) {
                return Err("Content-Length is not a list of decimals");
            }
            let n: u64 = item.parse().map_err(|_| "Content-Length overflows")?;
            if len.is_some_and(|l| l != n) {
                return Err("differing Content-Length values (RFC 9112 §6.3 rule 5)");
            }
            len = Some(n);
        }
    }
    Ok(norm(match len {
        Some(n) => BodyLen::Length(n),
        None => BodyLen::None,
    }))
}

/// A zero length and no body frame the same bytes.
fn norm(b: BodyLen) -> BodyLen {
    match b {
        BodyLen::Length(0) => BodyLen::None,
        b => b,
    }
}

#[derive(Debug)]
enum Outcome {
    Refused(Kind),
    Accepted(BodyLen),
}

const CHUNKED_BODY: &[u8] = b"5\r\nhello\r\n0\r\n\r\n";
const NEXT: &[u8] = b"GET /next HTTP/1.1\r\nHost: corpus.test\r\n\r\n";

/// Run Pier on one case; `Err` is an assertion failure message.
fn run_pier(c: &Case, raw: &[u8]) -> Result<Outcome, String> {
    let mut head = RequestHead::default();
    let limits = HeadLimits::default();
    match head.parse(raw, &limits) {
        Err(k) => {
            if k.source() != Source::Downstream || !(400..=501).contains(&k.status()) {
                return Err(format!("refused with {k:?}, not a client-error kind"));
            }
            Ok(Outcome::Refused(k))
        }
        Ok(None) => Err(format!(
            "complete request ({} bytes) parsed as partial",
            raw.len()
        )),
        Ok(Some(n)) => {
            if n != raw.len() {
                return Err(format!(
                    "head ends at {n} of {} bytes: a second request would start inside it",
                    raw.len()
                ));
            }
            if head.method() != c.method.as_bytes() {
                return Err(format!(
                    "method {:?}",
                    String::from_utf8_lossy(head.method())
                ));
            }
            let framing = head.body_len();
            if framing == BodyLen::Chunked {
                // The corpus has no bodies: follow the head with a valid chunked
                // body and a pipelined request, which must be left untouched.
                let mut rest = CHUNKED_BODY.to_vec();
                rest.extend_from_slice(NEXT);
                let mut s = ChunkedScanner::new();
                let used = s.feed(&rest).map_err(|k| format!("valid body: {k:?}"))?;
                if used != CHUNKED_BODY.len() || !s.is_done() {
                    return Err(format!("chunked body ended at {used}"));
                }
            }
            Ok(Outcome::Accepted(norm(framing)))
        }
    }
}

/// The verdict for one case: `Err(message)` when Pier's behaviour is wrong.
fn judge(c: &Case, outcome: &Outcome) -> Result<(), String> {
    let stricter = STRICTER
        .iter()
        .find(|(f, n, m, _, _)| c.is(f, n, m))
        .map(|&(_, _, _, k, _)| k);
    match (c.tier, outcome) {
        (Tier::Severe, Outcome::Refused(_)) => Ok(()),
        (Tier::Severe, Outcome::Accepted(f)) => Err(format!(
            "Severe (smuggling) request accepted with framing {f:?}"
        )),
        (Tier::Compliant, Outcome::Refused(k)) => match stricter {
            Some(want) if want == *k => Ok(()),
            Some(want) => Err(format!(
                "listed as refused with {want:?}, refused with {k:?}"
            )),
            None => Err(format!("Compliant request refused with {k:?}")),
        },
        (Tier::Compliant, Outcome::Accepted(f)) => {
            if stricter.is_some() {
                return Err("listed in STRICTER but accepted: remove it from the table".into());
            }
            match rfc_framing(c) {
                Ok(want) if want == *f => Ok(()),
                Ok(want) => Err(format!("framing {f:?}, RFC 9112 gives {want:?}")),
                Err(why) => Err(format!("accepted as {f:?}, but {why}")),
            }
        }
        (Tier::Acceptable | Tier::Ambiguous, Outcome::Refused(_)) => Ok(()),
        (Tier::Acceptable | Tier::Ambiguous, Outcome::Accepted(f)) => match rfc_framing(c) {
            Ok(want) if want == *f => Ok(()),
            Ok(want) => Err(format!("framing {f:?}, RFC 9112 gives {want:?}")),
            Err(why) => Err(format!("accepted as {f:?}, but {why}")),
        },
    }
}

/// The corpus' raw-request verdicts differ from its parsed ones for these
/// reasons (its own harness exempts them the same way).
const RAW_EXEMPT: [ClassificationReason; 5] = [
    ClassificationReason::MultilineHeader,
    ClassificationReason::MissingHeaderColon,
    ClassificationReason::SpaceInUri,
    ClassificationReason::AmbiguousUri,
    ClassificationReason::NonCrLfLineTermination,
];

#[test]
fn desync_guardian_corpus() {
    let cases = load_corpus();
    assert!(cases.len() >= 150, "only {} corpus cases", cases.len());
    let mut failures = Vec::new();
    let mut gaps_seen = Vec::new();
    // tier -> (refused, accepted)
    let mut counts: BTreeMap<Tier, (usize, usize)> = BTreeMap::new();
    let mut kinds: BTreeMap<String, usize> = BTreeMap::new();
    let mut accepted = Vec::new();
    for c in &cases {
        let raw = raw_request(c);
        // Check the bytes we built carry the corpus' meaning: the guardian's
        // own raw-request analyser must reach the corpus' tier.
        let g = HttpRequestData::analyze_raw_request(&raw);
        let want = match c.tier {
            Tier::Compliant => RequestSafetyTier::Compliant,
            Tier::Acceptable => RequestSafetyTier::Acceptable,
            Tier::Ambiguous => RequestSafetyTier::Ambiguous,
            Tier::Severe => RequestSafetyTier::Severe,
        };
        if RAW_EXEMPT.contains(&g.reason) {
            assert_ne!(g.tier, RequestSafetyTier::Compliant, "{}", c.id());
        } else {
            assert_eq!(
                g.tier,
                want,
                "harness built different bytes for {} ({}): {:?}",
                c.id(),
                c.reason,
                String::from_utf8_lossy(&raw)
            );
        }

        let verdict = run_pier(c, &raw).and_then(|o| {
            let e = counts.entry(c.tier).or_default();
            match &o {
                Outcome::Refused(k) => {
                    e.0 += 1;
                    *kinds.entry(format!("{k:?}")).or_default() += 1;
                }
                Outcome::Accepted(f) => {
                    e.1 += 1;
                    if c.tier != Tier::Compliant {
                        accepted.push(format!("{:?} {} -> {f:?}", c.tier, c.id()));
                    }
                }
            }
            judge(c, &o)
        });
        let gap = KNOWN_GAPS
            .iter()
            .find(|(f, n, m, _)| c.is(f, n, m))
            .map(|g| g.3);
        match (verdict, gap) {
            (Ok(()), None) => {}
            (Ok(()), Some(_)) => failures.push(format!(
                "{}: in KNOWN_GAPS but now passes: remove it from the list",
                c.id()
            )),
            (Err(e), Some(why)) => gaps_seen.push(format!("{}: {e} [{why}]", c.id())),
            (Err(e), None) => failures.push(format!(
                "{} [{:?}/{}]: {e}\n    bytes: {:?}",
                c.id(),
                c.tier,
                c.reason,
                String::from_utf8_lossy(&raw)
            )),
        }
    }
    println!("desync corpus: {} cases", cases.len());
    for (t, (r, a)) in &counts {
        println!("  {t:<10?} refused {r:>3}  accepted {a:>3}");
    }
    println!("  refusals by kind: {kinds:?}");
    for a in &accepted {
        println!("  accepted: {a}");
    }
    for g in &gaps_seen {
        println!("  known gap: {g}");
    }
    assert_eq!(
        gaps_seen.len(),
        KNOWN_GAPS.len(),
        "a KNOWN_GAPS entry matches no case"
    );
    assert!(
        failures.is_empty(),
        "{} corpus case(s) failed:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

/// The reference model itself, on the cases whose answer is plain from the
/// RFC: guards against a lenient oracle making the corpus test pass.
#[test]
fn rfc_framing_reference() {
    fn ok(version: &str, h: &[(&str, &str)]) -> Result<BodyLen, &'static str> {
        rfc_framing(&Case {
            file: String::new(),
            name: String::new(),
            method: "POST".into(),
            uri: "/".into(),
            version: version.into(),
            headers: h
                .iter()
                .map(|(n, v)| (n.to_string(), v.to_string()))
                .collect(),
            tier: Tier::Compliant,
            reason: String::new(),
        })
    }
    fn te(v: &str) -> Result<BodyLen, &'static str> {
        ok("HTTP/1.1", &[("Transfer-Encoding", v)])
    }
    assert_eq!(ok("HTTP/1.1", &[]), Ok(BodyLen::None));
    assert_eq!(
        ok("HTTP/1.1", &[("Content-Length", "0")]),
        Ok(BodyLen::None)
    );
    assert_eq!(
        ok("HTTP/1.1", &[("content-length", " 7 ")]),
        Ok(BodyLen::Length(7))
    );
    assert_eq!(
        ok("HTTP/1.1", &[("Content-Length", "7, 7")]),
        Ok(BodyLen::Length(7))
    );
    assert!(ok("HTTP/1.1", &[("Content-Length", "7, 8")]).is_err());
    assert!(ok("HTTP/1.1", &[("Content-Length", "+7")]).is_err());
    assert!(ok("HTTP/1.1", &[("Content-Length", "18446744073709551616")]).is_err());
    assert_eq!(te("chunked"), Ok(BodyLen::Chunked));
    assert_eq!(te("gzip;level=1 , chunked"), Ok(BodyLen::Chunked));
    assert!(te("chunked, gzip").is_err());
    assert!(te("chunked, chunked").is_err());
    assert!(te("chunked;").is_err());
    assert!(te("xchunked").is_err());
    assert!(ok("HTTP/1.0", &[("Transfer-Encoding", "chunked")]).is_err());
    assert_eq!(
        ok(
            "HTTP/1.1",
            &[("Transfer-Encoding", "chunked"), ("Content-Length", "3")]
        ),
        Ok(BodyLen::Chunked)
    );
    assert_eq!(
        ok("HTTP/1.1", &[("Transfer_Encoding", "chunked")]),
        Ok(BodyLen::None)
    );
    assert!(ok("HTTP/1.1", &[("Transfer-Encoding ", "chunked")]).is_err());
    assert!(ok("HTTP/0.9", &[]).is_err());
    assert_eq!(ok("HTTP/1.2", &[]), Ok(BodyLen::None));
}

/// Chunked-body smuggling shapes (bodies the YAML corpus can't carry): each
/// is `body ++ NEXT`; a valid body must end exactly before NEXT, fed whole and
/// a byte at a time; an invalid one must be refused both ways.
#[test]
fn chunked_body_corpus() {
    let cases: &[(&[u8], bool, &str)] = &[
        (b"5\r\nhello\r\n0\r\n\r\n", true, "plain"),
        (b"5;a=b;c=\"d\"\r\nhello\r\n0\r\n\r\n", true, "extensions"),
        (
            b"A\r\n0123456789\r\n0\r\nT: 1\r\n\r\n",
            true,
            "upper hex, trailer",
        ),
        (b"a\r\n0123456789\r\n0\r\n\r\n", true, "lower hex"),
        (b"5\nhello\r\n0\r\n\r\n", false, "bare LF after size"),
        (b"5\rhello\r\n0\r\n\r\n", false, "bare CR after size"),
        (
            b"5;ext\nhello\r\n0\r\n\r\n",
            false,
            "bare LF ending an extension",
        ),
        (
            b"5;a=\"x\ny\"\r\nhello\r\n0\r\n\r\n",
            false,
            "LF inside a quoted extension",
        ),
        (
            b"5;a\rb\r\nhello\r\n0\r\n\r\n",
            false,
            "bare CR inside an extension",
        ),
        (b"5\r\nhello\n0\r\n\r\n", false, "bare LF after data"),
        (b"5\r\nhello\r0\r\n\r\n", false, "bare CR after data"),
        (
            b"5\r\nhelloXX\r\n0\r\n\r\n",
            false,
            "data longer than its size",
        ),
        (
            b"5\r\nhell\r\n0\r\n\r\n",
            false,
            "data shorter than its size",
        ),
        (b"0x5\r\nhello\r\n0\r\n\r\n", false, "0x prefix"),
        (b"+5\r\nhello\r\n0\r\n\r\n", false, "sign"),
        (b"-5\r\nhello\r\n0\r\n\r\n", false, "negative"),
        (b" 5\r\nhello\r\n0\r\n\r\n", false, "leading space"),
        (b"5\t\r\nhello\r\n0\r\n\r\n", false, "trailing tab"),
        (b"\r\nhello\r\n0\r\n\r\n", false, "empty size line"),
        (b"g\r\n", false, "not hex"),
        (b"5\x00\r\nhello\r\n0\r\n\r\n", false, "NUL after size"),
        (b"5;\x00\r\nhello\r\n0\r\n\r\n", false, "NUL in extension"),
        (b"10000000000000000\r\n", false, "size overflows 64 bits"),
        (b"0\r\n\n", false, "bare LF ending the body"),
        (b"0\r\nT: 1\n\r\n", false, "bare LF ending a trailer"),
        (b"0\r\nT: 1\r\n x\r\n\r\n", false, "obs-fold in trailers"),
        (
            b"0\r\nT: 1\r\n\tx\r\n\r\n",
            false,
            "obs-fold (tab) in trailers",
        ),
        (b"0\r\nT: a\x00b\r\n\r\n", false, "NUL in a trailer"),
        (b"0\r\n\r\r\n", false, "CR CR LF ending the body"),
    ];
    for &(body, valid, what) in cases {
        let mut input = body.to_vec();
        input.extend_from_slice(NEXT);
        let mut whole = ChunkedScanner::new();
        let got_whole = whole.feed(&input);
        // Byte at a time: the same verdict and the same end.
        let mut bytewise = ChunkedScanner::new();
        let mut got_bytes = Ok(0usize);
        for (i, b) in input.iter().enumerate() {
            match bytewise.feed(std::slice::from_ref(b)) {
                Err(k) => {
                    got_bytes = Err(k);
                    break;
                }
                Ok(1) if !bytewise.is_done() => {}
                Ok(n) => {
                    got_bytes = Ok(i + n);
                    break;
                }
            }
        }
        if valid {
            let n = body.len();
            assert_eq!(got_whole, Ok(n), "{what}");
            assert!(whole.is_done(), "{what}");
            assert_eq!(got_bytes, Ok(n), "{what} (byte at a time)");
        } else {
            assert_eq!(got_whole, Err(Kind::BadChunk), "{what}");
            assert_eq!(got_bytes, Err(Kind::BadChunk), "{what} (byte at a time)");
        }
    }
}
