//! `/metrics` in the OpenMetrics text format (`Accept: application/
//! openmetrics-text`), which is what Prometheus asks for when it stores
//! exemplars, and the only format that may carry them.
//!
//! Pier's collectors write the Prometheus text format (0.0.4), some of them
//! with their `# TYPE` lines grouped apart from the samples; rather than
//! teach every collector a second format, the finished text is regrouped
//! here into what OpenMetrics requires: each family's metadata and samples
//! together, once; a counter family named without its `_total` suffix (a
//! counter sample without one is typed `unknown`); `"` escaped in HELP;
//! and `# EOF` at the end. A scrape's work, not the request path's.

use std::collections::HashMap;

/// The content type of [`convert`]'s output.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// True when an `Accept` header asks for OpenMetrics.
pub fn wanted(accept: &[u8]) -> bool {
    accept
        .windows(b"application/openmetrics-text".len())
        .any(|w| w.eq_ignore_ascii_case(b"application/openmetrics-text"))
}

#[derive(Default)]
struct Family<'a> {
    help: Option<&'a str>,
    kind: Option<&'a str>,
    samples: Vec<&'a str>,
}

/// The Prometheus text `text` as OpenMetrics.
pub fn convert(text: &str) -> String {
    let mut order: Vec<&str> = Vec::new();
    let mut fams: HashMap<&str, Family> = HashMap::new();
    fn family<'a, 'm>(
        order: &mut Vec<&'a str>,
        fams: &'m mut HashMap<&'a str, Family<'a>>,
        name: &'a str,
    ) -> &'m mut Family<'a> {
        fams.entry(name).or_insert_with(|| {
            order.push(name);
            Family::default()
        })
    }
    // Metadata first, so that a sample can find its family's type.
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# HELP ") {
            let (name, help) = rest.split_once(' ').unwrap_or((rest, ""));
            family(&mut order, &mut fams, name).help = Some(help);
        } else if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').unwrap_or((rest, "untyped"));
            family(&mut order, &mut fams, name).kind = Some(kind.trim());
        }
    }
    for line in text.lines() {
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let end = line.find(['{', ' ']).unwrap_or(line.len());
        let name = &line[..end];
        let owner = if fams.get(name).is_some_and(|f| f.kind.is_some()) {
            name
        } else {
            ["_bucket", "_sum", "_count"]
                .iter()
                .filter_map(|s| name.strip_suffix(s))
                .find(|base| {
                    fams.get(base)
                        .is_some_and(|f| matches!(f.kind, Some("histogram" | "summary")))
                })
                .unwrap_or(name)
        };
        family(&mut order, &mut fams, owner).samples.push(line);
    }
    let mut out = String::with_capacity(text.len() + text.len() / 8);
    for name in order {
        let f = &fams[name];
        if f.samples.is_empty() {
            continue;
        }
        let (name, kind) = match f.kind.unwrap_or("unknown") {
            "counter" => match name.strip_suffix("_total") {
                Some(base) => (base, "counter"),
                None => (name, "unknown"),
            },
            "untyped" => (name, "unknown"),
            k => (name, k),
        };
        out.push_str("# TYPE ");
        out.push_str(name);
        out.push(' ');
        out.push_str(kind);
        out.push('\n');
        if let Some(help) = f.help {
            out.push_str("# HELP ");
            out.push_str(name);
            out.push(' ');
            // The text format escapes `\` and newlines already.
            out.push_str(&help.replace('"', "\\\""));
            out.push('\n');
        }
        for s in &f.samples {
            out.push_str(s);
            out.push('\n');
        }
    }
    out.push_str("# EOF\n");
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn regroups_renames_and_ends() {
        let text = "# HELP a_total Things \"done\".\n# TYPE a_total counter\n# TYPE g gauge\n# TYPE h histogram\na_total{x=\"1\"} 3\nh_bucket{le=\"+Inf\"} 2 # {trace_id=\"ab\"} 0.1 1.000\nh_sum 0.2\nh_count 2\ng 5\nloose_total 1\na_total{x=\"2\"} 4\n# TYPE empty gauge\n";
        assert_eq!(
            convert(text),
            "# TYPE a counter\n# HELP a Things \\\"done\\\".\na_total{x=\"1\"} 3\na_total{x=\"2\"} 4\n# TYPE g gauge\ng 5\n# TYPE h histogram\nh_bucket{le=\"+Inf\"} 2 # {trace_id=\"ab\"} 0.1 1.000\nh_sum 0.2\nh_count 2\n# TYPE loose_total unknown\nloose_total 1\n# EOF\n"
        );
    }

    #[test]
    fn accept_header() {
        assert!(wanted(
            b"application/OpenMetrics-text;version=1.0.0;q=0.5,text/plain;q=0.3"
        ));
        assert!(!wanted(b"text/plain;version=0.0.4"));
        assert!(!wanted(b""));
    }
}
