//! Tracing (issue 36) against a real collector: Jaeger v2, started by each
//! test on free ports with its OTLP/HTTP receiver and query API, which the
//! spans are read back from. `.ci/install` builds it and names it in
//! JAEGER.

mod common;

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use common::*;

/// Jaeger, killed on drop.
struct Jaeger {
    child: Child,
    otlp: u16,
    otlp_grpc: u16,
    query: u16,
    _dir: TempDir,
}

impl Drop for Jaeger {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Jaeger {
    fn start() -> Jaeger {
        let bin = PathBuf::from(std::env::var("JAEGER").unwrap_or_else(|_| {
            panic!("JAEGER is not set: run .ci/install (it builds Jaeger) and source target/test-env.sh")
        }));
        let dir = TempDir::new();
        let (otlp, query, grpc) = (free_port(), free_port(), free_port());
        let otlp_grpc = free_port();
        let cfg = dir.path().join("jaeger.yaml");
        std::fs::write(
            &cfg,
            format!(
                "service:
  extensions: [jaeger_storage, jaeger_query]
  pipelines:
    traces:
      receivers: [otlp]
      processors: []
      exporters: [jaeger_storage_exporter]
  telemetry:
    metrics:
      level: none
extensions:
  jaeger_query:
    storage:
      traces: mem
    http:
      endpoint: 127.0.0.1:{query}
    grpc:
      endpoint: 127.0.0.1:{grpc}
  jaeger_storage:
    backends:
      mem:
        memory:
          max_traces: 10000
receivers:
  otlp:
    protocols:
      http:
        endpoint: 127.0.0.1:{otlp}
      grpc:
        endpoint: 127.0.0.1:{otlp_grpc}
exporters:
  jaeger_storage_exporter:
    trace_storage: mem
"
            ),
        )
        .unwrap();
        let log = std::fs::File::create(dir.path().join("jaeger.log")).unwrap();
        let child = Command::new(bin)
            .arg(format!("--config=file:{}", cfg.display()))
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("start jaeger");
        let j = Jaeger {
            child,
            otlp,
            otlp_grpc,
            query,
            _dir: dir,
        };
        let up = wait_until(Duration::from_secs(30), || {
            [otlp, otlp_grpc, query]
                .iter()
                .all(|p| std::net::TcpStream::connect(("127.0.0.1", *p)).is_ok())
        });
        assert!(
            up,
            "jaeger did not start: {}",
            std::fs::read_to_string(j._dir.path().join("jaeger.log")).unwrap_or_default()
        );
        j
    }

    fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}/v1/traces", self.otlp)
    }

    /// The OTLP/gRPC receiver.
    fn grpc_endpoint(&self) -> String {
        format!("grpc://127.0.0.1:{}", self.otlp_grpc)
    }

    /// The trace's spans as Jaeger's query API gives them (empty: none yet).
    fn spans(&self, trace: &str) -> Vec<serde_json::Value> {
        let out = curl(&[
            "-s",
            &format!("http://127.0.0.1:{}/api/traces/{trace}", self.query),
        ]);
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_default();
        v["data"][0]["spans"]
            .as_array()
            .cloned()
            .unwrap_or_default()
    }

    /// Wait for `n` spans of `trace`.
    fn wait_spans(&self, trace: &str, n: usize) -> Vec<serde_json::Value> {
        let mut last = Vec::new();
        wait_until(Duration::from_secs(20), || {
            last = self.spans(trace);
            last.len() >= n
        });
        assert_eq!(last.len(), n, "trace {trace}: {last:#?}");
        last
    }
}

fn tag<'a>(span: &'a serde_json::Value, key: &str) -> Option<&'a serde_json::Value> {
    span["tags"]
        .as_array()?
        .iter()
        .find(|t| t["key"] == key)
        .map(|t| &t["value"])
}

fn parent_of(span: &serde_json::Value) -> Option<String> {
    span["references"]
        .as_array()?
        .iter()
        .find(|r| r["refType"] == "CHILD_OF")
        .and_then(|r| r["spanID"].as_str())
        .map(str::to_string)
}

fn by_kind<'a>(spans: &'a [serde_json::Value], kind: &str) -> Vec<&'a serde_json::Value> {
    spans
        .iter()
        .filter(|s| tag(s, "span.kind").and_then(|v| v.as_str()) == Some(kind))
        .collect()
}

/// GET `path` through Pier with extra request headers; the status and the
/// body (the origin's `/headers` echoes the request it got).
fn get(port: u16, path: &str, headers: &[&str]) -> (u16, String) {
    let mut args = vec!["-s".to_string(), "-w".into(), "\n%{http_code}".into()];
    for h in headers {
        args.push("-H".into());
        args.push(h.to_string());
    }
    args.push(format!("http://127.0.0.1:{port}{path}"));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let out = curl(&args);
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let (body, code) = text.rsplit_once('\n').unwrap_or(("", "0"));
    (code.trim().parse().unwrap_or(0), body.to_string())
}

fn header_of<'a>(body: &'a str, name: &str) -> Option<&'a str> {
    body.lines().find_map(|l| {
        let (n, v) = l.split_once(':')?;
        n.trim().eq_ignore_ascii_case(name).then(|| v.trim())
    })
}

/// One listener, one route to `origin`, no access log, and `[tracing]`
/// with `tracing` as its lines.
fn one_route(origin: std::net::SocketAddr, tracing: &str) -> String {
    format!(
        "[admin]\nlisten = \"127.0.0.1:0\"\n[log]\naccess = \"off\"\n[tracing]\n{tracing}\n\n\
         [[listener]]\nname = \"main\"\nlisten = \"127.0.0.1:0\"\n\n\
         [[route]]\nname = \"default\"\nupstream = \"app\"\n\n\
         [upstream.app]\nservers = [\"{origin}\"]\n"
    )
}

fn exported(p: &PierProcess) -> f64 {
    p.metric_value("pier_tracing_spans_total{result=\"exported\"}")
        .unwrap_or(0.0)
}

const PARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
const TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";

#[test]
fn traces_are_continued_sampled_by_their_parent_sent_upstream_and_exported() {
    let jaeger = Jaeger::start();
    let origin = Origin::start_named("traced");
    let dead = dead_addr();
    let logs = TempDir::new();
    let access = logs.path().join("access.log");
    let cfg = format!(
        r#"[admin]
listen = "127.0.0.1:0"
[log]
access = "{access}"
[tracing]
endpoint = "{endpoint}"
service_name = "pier-test"
sample = 1.0

[[listener]]
name = "main"
listen = "127.0.0.1:0"

[[route]]
name = "quiet"
path = "/quiet"
upstream = "app"
[route.tracing]
sample = 0.0

[[route]]
name = "retried"
path = "/retry"
upstream = "flaky"

[[route]]
name = "lua"
path = "/lua"
upstream = "app"
[route.lua]
access = '''
ngx.req.set_header("x-seen-trace", ngx.var.trace_id .. "/" .. ngx.var.span_id)
local res = pier.http.request{{ url = "http://{origin}/headers" }}
local tp = res and res.body:match("traceparent: *([^\r\n]+)") or "none"
ngx.req.set_header("x-sub-traceparent", tp)
'''

[[route]]
name = "default"
upstream = "app"

[upstream.app]
servers = ["{origin}"]

[upstream.flaky]
servers = ["{dead}", "{origin}"]
retries = 1
"#,
        access = access.display(),
        endpoint = jaeger.endpoint(),
        origin = origin.addr(),
    );
    let p = pier(&cfg);
    let port = p.listener("main").port();

    // A sampled parent: continued. The server span is the client's span's
    // child, the attempt's client span the server span's, and the origin
    // is told the attempt's span; tracestate goes on untouched.
    let (status, body) = get(
        port,
        "/headers",
        &[
            &format!("traceparent: {PARENT}"),
            "tracestate: congo=t61rcWkgMzE",
        ],
    );
    assert_eq!(status, 200, "{body}");
    let spans = jaeger.wait_spans(TRACE, 2);
    let server = by_kind(&spans, "server");
    let client = by_kind(&spans, "client");
    assert_eq!((server.len(), client.len()), (1, 1), "{spans:#?}");
    let (server, client) = (server[0], client[0]);
    assert_eq!(parent_of(server).as_deref(), Some("00f067aa0ba902b7"));
    let server_id = server["spanID"].as_str().unwrap();
    let client_id = client["spanID"].as_str().unwrap();
    assert_eq!(parent_of(client).as_deref(), Some(server_id));
    assert_eq!(server["operationName"], "GET default");
    assert_eq!(tag(server, "http.response.status_code"), Some(&200.into()));
    assert_eq!(tag(server, "url.path"), Some(&"/headers".into()));
    assert_eq!(tag(server, "http.route"), Some(&"default".into()));
    assert_eq!(
        tag(client, "server.port"),
        Some(&i64::from(origin.addr().port()).into())
    );
    assert_eq!(tag(client, "pier.attempt"), Some(&0.into()));
    assert_eq!(
        header_of(&body, "traceparent"),
        Some(format!("00-{TRACE}-{client_id}-01").as_str()),
        "{body}"
    );
    assert_eq!(header_of(&body, "tracestate"), Some("congo=t61rcWkgMzE"));
    assert_eq!(body.matches("traceparent").count(), 1, "{body}");
    // The access log names the trace and the server span.
    let line = format!("\"trace_id\":\"{TRACE}\",\"span_id\":\"{server_id}\"");
    assert!(
        wait_until(Duration::from_secs(10), || std::fs::read_to_string(&access)
            .unwrap_or_default()
            .contains(&line)),
        "{}",
        std::fs::read_to_string(&access).unwrap_or_default()
    );

    // Lua sees the ids (ngx.var.trace_id, span_id), and may not set them.
    let (status, body) = get(port, "/lua/headers", &[&format!("traceparent: {PARENT}")]);
    assert_eq!(status, 200, "{body}");
    let seen = header_of(&body, "x-seen-trace")
        .expect("the hook's header")
        .to_string();
    assert!(
        seen.starts_with(&format!("{TRACE}/")) && seen.len() == 32 + 1 + 16,
        "{seen}"
    );
    // The first request's two, this one's server and client span, and its
    // `lua access` span.
    let spans = jaeger.wait_spans(TRACE, 5);
    assert!(
        spans.iter().any(|s| s["spanID"] == seen[33..]),
        "{spans:#?}"
    );
    // A hook's pier.http request carries the context, its parent the
    // request's server span.
    assert_eq!(
        header_of(&body, "x-sub-traceparent"),
        Some(format!("00-{TRACE}-{}-01", &seen[33..]).as_str()),
        "{body}"
    );

    // No parent: a new root (sample = 1.0), its id sent on.
    let (status, body) = get(port, "/headers", &[]);
    assert_eq!(status, 200);
    let sent = header_of(&body, "traceparent")
        .expect("a traceparent upstream")
        .to_string();
    let new_trace = &sent[3..35];
    assert_ne!(new_trace, TRACE);
    assert!(sent.ends_with("-01"), "{sent}");
    let spans = jaeger.wait_spans(new_trace, 2);
    assert!(by_kind(&spans, "server")
        .iter()
        .all(|s| parent_of(s).is_none()));
    // An invalid traceparent is as good as none (W3C: start a new trace).
    let (_, body) = get(
        port,
        "/headers",
        &["traceparent: 00-XYZ-00f067aa0ba902b7-01"],
    );
    let sent = header_of(&body, "traceparent").unwrap().to_string();
    assert!(sent.starts_with("00-") && &sent[3..35] != TRACE, "{sent}");
    assert!(!body.contains("XYZ"), "{body}");
    let after_sampled = 8.0;
    assert!(wait_until(Duration::from_secs(20), || exported(&p) >= after_sampled));

    // An unsampled parent is honoured: passed on with its trace id and
    // flags 00, nothing recorded; a route with sample = 0 starts unsampled
    // roots.
    let unsampled = format!("00-{}-00f067aa0ba902b7-00", "a".repeat(32));
    let (_, body) = get(port, "/headers", &[&format!("traceparent: {unsampled}")]);
    let sent = header_of(&body, "traceparent").unwrap().to_string();
    assert!(
        sent.starts_with(&format!("00-{}-", "a".repeat(32))) && sent.ends_with("-00"),
        "{sent}"
    );
    assert!(
        !sent.contains("00f067aa0ba902b7"),
        "a span of Pier's own (unsampled: the server span): {sent}"
    );
    let (_, body) = get(port, "/quiet/headers", &[]);
    assert!(
        header_of(&body, "traceparent").unwrap().ends_with("-00"),
        "{body}"
    );

    // A retry: the failed attempt and the one that answered, each a client
    // span under the request's server span (round robin may try the live
    // server first: a few requests find the dead one).
    let retries = || p.metric_value("pier_upstream_retries_total").unwrap_or(0.0);
    let mut retried = None;
    for _ in 0..6 {
        let before = retries();
        let (status, body) = get(port, "/retry/headers", &[]);
        assert_eq!(status, 200, "{body}");
        let trace = header_of(&body, "traceparent").unwrap()[3..35].to_string();
        if retries() > before {
            retried = Some(jaeger.wait_spans(&trace, 3));
            break;
        }
        jaeger.wait_spans(&trace, 2);
    }
    let spans = retried.expect("no request tried the dead server first");
    let server_id = by_kind(&spans, "server")[0]["spanID"]
        .as_str()
        .unwrap()
        .to_string();
    let mut attempts: Vec<_> = by_kind(&spans, "client")
        .into_iter()
        .map(|s| {
            assert_eq!(parent_of(s).as_deref(), Some(server_id.as_str()));
            (
                tag(s, "pier.attempt").and_then(|v| v.as_i64()).unwrap(),
                tag(s, "error").is_some(),
                tag(s, "server.port").and_then(|v| v.as_i64()).unwrap(),
            )
        })
        .collect();
    attempts.sort();
    assert_eq!(
        attempts,
        [
            (0, true, i64::from(dead.port())),
            (1, false, i64::from(origin.addr().port()))
        ]
    );
    // Nothing was dropped or lost on the way.
    assert_eq!(
        p.metric_value("pier_tracing_spans_total{result=\"dropped\"}"),
        Some(0.0)
    );
    assert_eq!(
        p.metric_value("pier_tracing_spans_total{result=\"failed\"}"),
        Some(0.0)
    );
}

/// The collector down: requests are served as ever, the lost spans counted.
#[test]
fn a_collector_that_is_down_costs_requests_nothing() {
    let dead = dead_addr();
    for endpoint in [format!("http://{dead}/v1/traces"), format!("grpc://{dead}")] {
        collector_down(&endpoint);
    }
}

fn collector_down(endpoint: &str) {
    let origin = Origin::start();
    let p = pier(&one_route(
        origin.addr(),
        &format!("endpoint = \"{endpoint}\""),
    ));
    let port = p.listener("main").port();
    for _ in 0..20 {
        assert_eq!(get(port, "/hello", &[]).0, 200);
    }
    let failed = || {
        p.metric_value("pier_tracing_spans_total{result=\"failed\"}")
            .unwrap_or(0.0)
    };
    assert!(
        wait_until(Duration::from_secs(20), || failed() >= 40.0),
        "{endpoint}: failed {}",
        failed()
    );
    assert_eq!(exported(&p), 0.0);
}

/// OTLP/gRPC: the same spans reach Jaeger's gRPC receiver, batch after
/// batch over the one kept HTTP/2 connection.
#[test]
fn spans_are_exported_over_otlp_grpc() {
    let jaeger = Jaeger::start();
    let origin = Origin::start();
    let tracing = format!(
        "endpoint = \"{}\"\nservice_name = \"pier-grpc\"",
        jaeger.grpc_endpoint()
    );
    let p = pier(&one_route(origin.addr(), &tracing));
    let port = p.listener("main").port();
    for (i, trace) in [
        "4bf92f3577b34da6a3ce929d0e0e4736",
        "5bf92f3577b34da6a3ce929d0e0e4736",
    ]
    .iter()
    .enumerate()
    {
        let parent = format!("00-{trace}-00f067aa0ba902b7-01");
        assert_eq!(
            get(port, "/hello", &[&format!("traceparent: {parent}")]).0,
            200
        );
        let spans = jaeger.wait_spans(trace, 2);
        let server = by_kind(&spans, "server");
        assert_eq!(server.len(), 1, "{spans:#?}");
        assert_eq!(parent_of(server[0]).as_deref(), Some("00f067aa0ba902b7"));
        let client = by_kind(&spans, "client");
        assert_eq!(
            parent_of(client[0]),
            server[0]["spanID"].as_str().map(str::to_string)
        );
        // The second trace is exported in a later batch than the first.
        assert!(wait_until(Duration::from_secs(20), || exported(&p)
            >= 2.0 * (i + 1) as f64));
    }
    assert_eq!(
        p.metric_value("pier_tracing_spans_total{result=\"failed\"}"),
        Some(0.0)
    );
}

/// What hooks add: attributes and events on the server span, a child span
/// per Lua phase (with the cosocket call's time in `lua access`), and bad
/// values refused with an error the hook can catch.
#[test]
fn hooks_add_attributes_events_and_lua_phase_spans() {
    let jaeger = Jaeger::start();
    let origin = Origin::start();
    let cfg = format!(
        r#"[admin]
listen = "127.0.0.1:0"
[log]
access = "off"
[tracing]
endpoint = "{endpoint}"

[[listener]]
name = "main"
listen = "127.0.0.1:0"

[lua]
package_path = ["{resty_http}/?.lua", "{libs}/?.lua"]

[[route]]
name = "resty"
path = "/resty"
upstream = "app"
[route.lua]
access = '''
-- Debian ships lua-resty-string as nginx.string.
package.loaded["resty.string"] = package.loaded["resty.string"] or require "nginx.string"
local http = require "resty.http"
local c = http.new()
local res, err = c:request_uri("http://{origin}/headers", {{ headers = {{ ["X-A"] = "1" }} }})
local tp = res and res.body:match("traceparent: *([^\r\n]+)") or ("none: " .. tostring(err))
ngx.req.set_header("x-resty-traceparent", tp)
local given = "00-aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa-bbbbbbbbbbbbbbbb-01"
res, err = c:request_uri("http://{origin}/headers", {{ headers = {{ Traceparent = given }} }})
tp = res and res.body:match("[Tt]raceparent: *([^\r\n]+)") or ("none: " .. tostring(err))
ngx.req.set_header("x-resty-given", tp)
local _, lines = (res and res.body or ""):lower():gsub("traceparent:", "")
ngx.req.set_header("x-resty-given-lines", tostring(lines))
'''

[[route]]
name = "default"
upstream = "app"
[route.lua]
access = '''
local res = pier.http.request{{ url = "http://{origin}/hello" }}
pier.trace.set_attribute("app.user", "u-42")
pier.trace.set_attribute("app.plan", "free")
pier.trace.set_attribute("app.plan", "pro")
pier.trace.set_attribute("app.ratio", 0.25)
pier.trace.add_event("auth.checked", {{ ok = true, tries = 2 }})
local bad = {{}}
bad[#bad + 1] = tostring(pcall(pier.trace.set_attribute, "", 1))
bad[#bad + 1] = tostring(pcall(pier.trace.set_attribute, "k", {{}}))
bad[#bad + 1] = tostring(pcall(pier.trace.set_attribute, "k", 1/0))
bad[#bad + 1] = tostring(pcall(pier.trace.set_attribute, "k", string.rep("x", 2000)))
local ok_n = 0
for i = 1, 40 do
  if pcall(pier.trace.set_attribute, "n" .. i, i) then ok_n = ok_n + 1 end
end
local t, s = pier.trace.ids()
ngx.req.set_header("x-bad", table.concat(bad, ","))
ngx.req.set_header("x-kept", tostring(ok_n))
ngx.req.set_header("x-ids", t .. "/" .. s)
'''
log = '''
-- Past the bound, a key already set is still replaced.
pier.trace.set_attribute("n1", true)
'''

[upstream.app]
servers = ["{origin}"]
"#,
        endpoint = jaeger.endpoint(),
        origin = origin.addr(),
        resty_http = concat!(env!("CARGO_MANIFEST_DIR"), "/../../vendor/lua-resty-http"),
        libs = std::env::var("PIER_LUA_LIBS")
            .expect("PIER_LUA_LIBS: source target/test-env.sh (bash .ci/install makes it)"),
    );
    let p = pier(&cfg);
    let port = p.listener("main").port();

    // lua-resty-http on raw cosockets: its requests carry the context (the
    // server span as the parent, the flags as sampled), unless the hook
    // gave a traceparent of its own.
    let resty = "8bf92f3577b34da6a3ce929d0e0e4736";
    let (status, body) = get(
        port,
        "/resty/headers",
        &[&format!("traceparent: 00-{resty}-00f067aa0ba902b7-01")],
    );
    assert_eq!(status, 200, "{body}");
    let sub = header_of(&body, "x-resty-traceparent").unwrap_or("");
    assert!(
        sub.starts_with(&format!("00-{resty}-")) && sub.ends_with("-01"),
        "{body}"
    );
    let spans = jaeger.wait_spans(resty, 3);
    let server = by_kind(&spans, "server");
    assert_eq!(
        Some(&sub[36..52]),
        server[0]["spanID"].as_str(),
        "{spans:#?}"
    );
    assert_eq!(
        header_of(&body, "x-resty-given"),
        Some("00-aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa-bbbbbbbbbbbbbbbb-01")
    );
    assert_eq!(header_of(&body, "x-resty-given-lines"), Some("1"), "{body}");

    let trace = "6bf92f3577b34da6a3ce929d0e0e4736";
    let (status, body) = get(
        port,
        "/headers",
        &[&format!("traceparent: 00-{trace}-00f067aa0ba902b7-01")],
    );
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        header_of(&body, "x-bad"),
        Some("false,false,false,false"),
        "{body}"
    );
    // 32 hook attributes a span: 3 set above (one twice), 29 of the 40.
    assert_eq!(header_of(&body, "x-kept"), Some("29"), "{body}");
    let ids = header_of(&body, "x-ids").unwrap();
    assert!(ids.starts_with(&format!("{trace}/")), "{ids}");
    // The server span, its attempt, and the access and log phases.
    let spans = jaeger.wait_spans(trace, 4);
    let server = by_kind(&spans, "server");
    assert_eq!(server.len(), 1, "{spans:#?}");
    let server = server[0];
    let sid = server["spanID"].as_str().unwrap();
    assert_eq!(&ids[33..], sid);
    assert_eq!(tag(server, "app.user"), Some(&"u-42".into()));
    assert_eq!(tag(server, "app.plan"), Some(&"pro".into()));
    assert_eq!(tag(server, "app.ratio"), Some(&0.25.into()));
    assert_eq!(tag(server, "n1"), Some(&true.into()));
    assert_eq!(tag(server, "n29"), Some(&29.into()));
    assert_eq!(tag(server, "n30"), None);
    let logs = server["logs"].as_array().expect("events");
    assert_eq!(logs.len(), 1, "{logs:#?}");
    let fields = logs[0]["fields"].as_array().unwrap();
    let field = |k: &str| {
        fields
            .iter()
            .find(|f| f["key"] == k)
            .map(|f| f["value"].clone())
    };
    assert_eq!(field("event"), Some("auth.checked".into()));
    assert_eq!(field("ok"), Some(true.into()));
    assert_eq!(field("tries"), Some(2.into()));
    let name = |s: &serde_json::Value| s["operationName"].as_str().unwrap_or("").to_string();
    let access = spans
        .iter()
        .find(|s| name(s) == "lua access")
        .unwrap_or_else(|| panic!("{spans:#?}"));
    assert_eq!(parent_of(access).as_deref(), Some(sid));
    assert!(spans.iter().any(|s| name(s) == "lua log"), "{spans:#?}");
    // The access hook's cosocket call is inside its span.
    assert!(access["duration"].as_i64().unwrap() > 0);

    // Not sampled: the same calls succeed and nothing is exported.
    let quiet = "7bf92f3577b34da6a3ce929d0e0e4736";
    let (status, body) = get(
        port,
        "/headers",
        &[&format!("traceparent: 00-{quiet}-00f067aa0ba902b7-00")],
    );
    assert_eq!(status, 200);
    assert_eq!(header_of(&body, "x-kept"), Some("40"), "{body}");
    assert_eq!(header_of(&body, "x-bad"), Some("false,false,false,false"));
}

/// Metric exemplars: asked for OpenMetrics (as Prometheus does when it
/// keeps exemplars), `/metrics` has each duration bucket name the newest
/// sampled request that fell in it; the whole exposition is read back by
/// prometheus_client's OpenMetrics parser, which is strict (each family
/// once, counters by their base name, `# EOF`). The Prometheus text format
/// stays as it was, without them.
#[test]
fn duration_buckets_carry_sampled_traces_as_openmetrics_exemplars() {
    let origin = Origin::start();
    let tracing = format!(
        "endpoint = \"http://{}/v1/traces\"\nsample = 0.0",
        dead_addr()
    );
    let p = pier(&one_route(origin.addr(), &tracing));
    let port = p.listener("main").port();
    const UNSAMPLED: &str = "00-0000000000000000000000000000abcd-00f067aa0ba902b7-00";
    assert_eq!(
        get(port, "/hello", &[&format!("traceparent: {UNSAMPLED}")]).0,
        200
    );
    assert_eq!(
        get(port, "/hello", &[&format!("traceparent: {PARENT}")]).0,
        200
    );
    assert_eq!(get(port, "/hello", &[]).0, 200, "a root, not sampled");

    let plain = p.metrics();
    assert!(
        plain.contains("pier_request_duration_seconds_count 3"),
        "{plain}"
    );
    assert!(
        !plain.contains("trace_id"),
        "exemplars in the 0.0.4 format:\n{plain}"
    );

    let r = RawConn::connect(p.admin())
        .request(
            "GET",
            "/metrics",
            &[
                ("host", "127.0.0.1"),
                (
                    "accept",
                    "application/openmetrics-text;version=1.0.0;q=0.5,text/plain;version=0.0.4;q=0.3",
                ),
            ],
            b"",
        )
        .unwrap();
    assert_eq!(r.status, 200);
    assert_eq!(
        r.header("content-type"),
        Some("application/openmetrics-text; version=1.0.0; charset=utf-8")
    );
    let body = String::from_utf8(r.body).unwrap();
    assert!(body.ends_with("# EOF\n"), "{body}");
    assert!(
        !body.contains("0000abcd"),
        "an unsampled request's trace:\n{body}"
    );

    // The real parser: every exemplar it finds, as "name le trace_id".
    let script = r#"
import sys
from prometheus_client.openmetrics.parser import text_string_to_metric_families
n = 0
for fam in text_string_to_metric_families(sys.stdin.read()):
    n += 1
    for s in fam.samples:
        if s.exemplar:
            print(s.name, s.labels.get("le"), s.exemplar.labels["trace_id"], s.exemplar.labels["span_id"], s.exemplar.value)
print("families", n)
"#;
    let python = "/usr/bin/python3";
    let mut child = std::process::Command::new(python)
        .args(["-c", script])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("{python}: {e} (apt-get install python3-prometheus-client)"));
    use std::io::Write;
    child
        .stdin
        .take()
        .unwrap()
        .write_all(body.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "prometheus_client refused the exposition (or is missing: apt-get install python3-prometheus-client): {}\n{body}",
        String::from_utf8_lossy(&out.stderr)
    );
    let ex: Vec<Vec<&str>> = stdout
        .lines()
        .filter(|l| !l.starts_with("families"))
        .map(|l| l.split(' ').collect())
        .collect();
    assert_eq!(ex.len(), 1, "one sampled request, one exemplar: {stdout}");
    let e = &ex[0];
    assert_eq!(e[0], "pier_request_duration_seconds_bucket");
    assert_eq!(e[2], TRACE, "the client's trace");
    assert_eq!(e[3].len(), 16);
    assert_ne!(
        e[3], "00f067aa0ba902b7",
        "the server span, not the client's"
    );
    // The exemplar's value lies in its bucket.
    let le: f64 = e[1].parse().unwrap_or(f64::INFINITY);
    let v: f64 = e[4].parse().unwrap();
    assert!(v > 0.0 && v <= le, "{stdout}");
}
