//! The file schema: what serde reads from the TOML file, before validation.
//!
//! Every struct denies unknown fields, so a typo is an error pointing at the
//! key. Values that need checking beyond their TOML type are wrapped in
//! [`Spanned`] so that `validate` can point at them too.
//!
//! Each top-level section (and each `[[listener]]`, `[[route]]` and
//! `[upstream.NAME]` entry) is deserialized on its own, so a typo in one
//! does not hide the errors in the others. Key reference: docs/config.md
//! (a test checks that every field here is documented there).

use std::collections::BTreeMap;
use std::fmt;
use std::ops::Range;

use serde::de::{DeserializeOwned, IntoDeserializer, MapAccess, Visitor};
use serde::{Deserialize, Deserializer};
pub use toml::Spanned;
use toml_edit::{ImDocument, Item};

use crate::error::RawError;

// === sections ===

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, expecting = "a [server] table")]
pub struct ServerSection {
    pub workers: Option<Spanned<i64>>,
    pub grace_period: Option<Spanned<String>>,
    pub upgrade_socket: Option<Spanned<String>>,
    pub io_uring: Option<Spanned<bool>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, expecting = "an [admin] table")]
pub struct AdminSection {
    pub listen: Spanned<String>,
    pub token: Option<Spanned<String>>,
    pub user: Option<Spanned<String>>,
    pub password: Option<Spanned<String>>,
    pub hosts: Option<Vec<Spanned<String>>>,
    /// `[admin.tls]`: HTTPS on the admin listener (the settings of
    /// `[listener.tls]`; ALPN is always `http/1.1`).
    pub tls: Option<ListenerTlsSection>,
}

/// `[analytics]`: the built-in traffic analytics.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, expecting = "an [analytics] table")]
pub struct AnalyticsSection {
    pub enabled: Option<Spanned<bool>>,
    pub path: Option<Spanned<String>>,
    pub keep_minutes: Option<Spanned<String>>,
    pub keep_hours: Option<Spanned<String>>,
    pub keep_days: Option<Spanned<String>>,
    pub max_keys: Option<Spanned<i64>>,
    pub queue: Option<Spanned<i64>>,
    pub kafka: Option<AnalyticsKafkaSection>,
}

/// `[analytics.kafka]`: events also go to a Kafka topic.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, expecting = "an [analytics.kafka] table")]
pub struct AnalyticsKafkaSection {
    pub brokers: Vec<Spanned<String>>,
    pub topic: Option<Spanned<String>>,
    pub batch_size: Option<Spanned<i64>>,
    pub linger: Option<Spanned<String>>,
    pub compression: Option<Spanned<String>>,
    pub queue: Option<Spanned<i64>>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, expecting = "a [log] table")]
pub struct LogSection {
    pub access: Option<Spanned<String>>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, expecting = "a [limits] table")]
pub struct LimitsSection {
    pub max_header_bytes: Option<Spanned<SizeValue>>,
    pub max_headers: Option<Spanned<i64>>,
    pub max_uri_bytes: Option<Spanned<SizeValue>>,
    pub max_body_bytes: Option<Spanned<SizeValue>>,
    pub max_buffered_body_bytes: Option<Spanned<SizeValue>>,
    pub max_connections: Option<Spanned<i64>>,
    pub body_min_rate: Option<Spanned<SizeValue>>,
    pub max_connections_per_ip: Option<Spanned<i64>>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, expecting = "a [timeouts] table")]
pub struct TimeoutsSection {
    pub client_header: Option<Spanned<String>>,
    pub client_idle: Option<Spanned<String>>,
    pub upstream_connect: Option<Spanned<String>>,
    pub upstream_response: Option<Spanned<String>>,
    pub upstream_idle: Option<Spanned<String>>,
    pub tunnel_idle: Option<Spanned<String>>,
    pub client_goaway: Option<Spanned<String>>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, expecting = "an [http] table")]
pub struct HttpSection {
    /// Protocols a client may switch to with `Upgrade` (e.g. "websocket").
    pub upgrade: Option<Vec<Spanned<String>>>,
    /// `"reject"`, `"decode"` or `"keep"`: an encoded slash in a path.
    pub escaped_slashes: Option<Spanned<String>>,
    pub merge_slashes: Option<bool>,
    /// Methods refused with 405 unless a route allows them (CONNECT, TRACE).
    pub allow_trace: Option<bool>,
    /// Write an RFC 7239 `Forwarded` field upstream.
    pub forwarded: Option<bool>,
}

/// `[http2]`: SETTINGS and defences of HTTP/2 connections.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, expecting = "an [http2] table")]
pub struct Http2Section {
    pub max_concurrent_streams: Option<Spanned<i64>>,
    pub initial_window_size: Option<Spanned<SizeValue>>,
    pub max_frame_size: Option<Spanned<SizeValue>>,
    pub max_header_list_size: Option<Spanned<SizeValue>>,
    pub max_send_buffer: Option<Spanned<SizeValue>>,
    pub max_concurrent_reset_streams: Option<Spanned<i64>>,
    pub max_pending_accept_reset_streams: Option<Spanned<i64>>,
    pub max_local_error_reset_streams: Option<Spanned<i64>>,
    pub hpack_dynamic_table: Option<bool>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, expecting = "a [security] table")]
pub struct SecuritySection {
    pub deny_origins: Option<Vec<Spanned<String>>>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, expecting = "a [resolver] table")]
pub struct ResolverSection {
    pub nameservers: Option<Vec<Spanned<String>>>,
    pub min_ttl: Option<Spanned<String>>,
    pub max_ttl: Option<Spanned<String>>,
    pub timeout: Option<Spanned<String>>,
}

/// `[tracing]`: W3C trace context and OpenTelemetry spans over OTLP.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, expecting = "a [tracing] table")]
pub struct TracingSection {
    pub endpoint: Option<Spanned<String>>,
    pub sample: Option<Spanned<f64>>,
    pub service_name: Option<Spanned<String>>,
    pub queue: Option<Spanned<i64>>,
}

/// `[redis]`: the Redis a fleet of Piers shares (fleet-wide purges).
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, expecting = "a [redis] table")]
pub struct RedisSection {
    pub url: Option<Spanned<String>>,
    pub channel: Option<Spanned<String>>,
    pub timeout: Option<Spanned<String>>,
    pub sync_interval: Option<Spanned<String>>,
    pub key_prefix: Option<Spanned<String>>,
    pub sentinels: Option<Spanned<Vec<Spanned<String>>>>,
    pub master_name: Option<Spanned<String>>,
}

/// `[route.tracing]`: the route's own root sampling ratio.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, expecting = "a [route.tracing] table")]
pub struct RouteTracingSection {
    pub sample: Option<Spanned<f64>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, expecting = "a [demo] table")]
pub struct DemoSection {
    pub origin: Spanned<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, expecting = "a [[listener]] table")]
pub struct ListenerEntry {
    pub name: Option<Spanned<String>>,
    pub listen: Spanned<String>,
    /// Answer every request with a redirect to https (301, 302, 307 or 308).
    pub redirect_https: Option<Spanned<i64>>,
    /// The port in the redirect's Location (default: none, i.e. 443).
    pub https_port: Option<Spanned<i64>>,
    /// Cleartext HTTP/2 with prior knowledge beside HTTP/1.1 (`true`), or
    /// instead of it (`"only"`).
    pub h2c: Option<H2cValue>,
    /// HTTP/3 (QUIC) on the same port over UDP (TLS listeners only).
    pub http3: Option<Spanned<bool>>,
    /// With `http3`: every new QUIC client proves its address first (a
    /// Retry), not only under load (nginx's `quic_retry`).
    pub quic_retry: Option<Spanned<bool>>,
    /// With `http3`: 0-RTT requests on resumed QUIC connections, the
    /// replay-safe methods only.
    pub quic_early_data: Option<Spanned<bool>>,
    /// Every connection opens with a PROXY protocol header (v1 or v2)
    /// from one of `trusted_proxies`.
    pub proxy_protocol: Option<Spanned<bool>>,
    /// The header a trusted proxy names the client in (`X-Forwarded-For`
    /// or `Forwarded`).
    pub real_ip_header: Option<Spanned<String>>,
    pub tls: Option<ListenerTlsSection>,
    /// CIDRs whose Forwarded / X-Forwarded-* headers are kept.
    pub trusted_proxies: Option<Vec<Spanned<String>>>,
}

/// A listener's `h2c`: `true`, `false` or `"only"`.
#[derive(Debug, Deserialize)]
#[serde(untagged, expecting = "true, false or \"only\"")]
pub enum H2cValue {
    Flag(bool),
    Mode(String),
}

/// `[listener.tls]`: serve HTTPS on this listener.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, expecting = "a [listener.tls] table")]
pub struct ListenerTlsSection {
    /// Shorthand for one certificate: `cert` + `key`.
    pub cert: Option<Spanned<String>>,
    pub key: Option<Spanned<String>>,
    pub certificates: Option<Vec<CertTable>>,
    pub unknown_sni: Option<Spanned<String>>,
    pub min_version: Option<Spanned<String>>,
    pub alpn: Option<Vec<Spanned<String>>>,
    pub session_cache: Option<Spanned<i64>>,
    pub session_tickets: Option<bool>,
    pub session_ticket_keys: Option<Vec<Spanned<String>>>,
    pub client_ca: Option<Spanned<String>>,
    pub client_auth: Option<Spanned<String>>,
    pub handshake_timeout: Option<Spanned<String>>,
    pub max_handshakes: Option<Spanned<i64>>,
    pub max_pending_hellos: Option<Spanned<i64>>,
    pub ocsp_stapling: Option<bool>,
    pub ocsp_responder: Option<Spanned<String>>,
    pub acme: Option<AcmeSection>,
}

/// `[listener.tls.acme]`: certificates from an ACME CA.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, expecting = "a [listener.tls.acme] table")]
pub struct AcmeSection {
    #[serde(default)]
    pub domains: Vec<Spanned<String>>,
    pub email: Option<Spanned<String>>,
    pub directory: Option<Spanned<String>>,
    pub directory_ca: Option<Spanned<String>>,
    pub storage: Option<Spanned<String>>,
    pub renew_before: Option<Spanned<String>>,
    pub challenge: Option<Spanned<String>>,
    pub ari: Option<bool>,
    pub on_demand: Option<bool>,
    pub ask: Option<Spanned<String>>,
    pub on_demand_rate: Option<Spanned<i64>>,
    pub on_demand_max: Option<Spanned<i64>>,
}

/// `{ cert = "a.pem", key = "a.key" }`.
#[derive(Debug, Deserialize)]
#[serde(
    deny_unknown_fields,
    expecting = "a table { cert = \"FILE\", key = \"FILE\" }"
)]
pub struct CertTable {
    pub cert: Spanned<String>,
    pub key: Spanned<String>,
}

/// `[upstream.NAME.tls]`: TLS to the upstream's servers.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, expecting = "an [upstream.NAME.tls] table")]
pub struct UpstreamTlsSection {
    pub server_name: Option<Spanned<String>>,
    pub verify: Option<bool>,
    pub ca: Option<Spanned<String>>,
    pub cert: Option<Spanned<String>>,
    pub key: Option<Spanned<String>>,
    pub session_resumption: Option<bool>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, expecting = "a [[route]] table")]
pub struct RouteEntry {
    pub name: Option<Spanned<String>>,
    pub host: Option<Spanned<String>>,
    /// Prefix match.
    pub path: Option<Spanned<String>>,
    pub exact: Option<Spanned<String>>,
    pub regex: Option<Spanned<String>>,
    /// Required unless the route has a `content` hook.
    pub upstream: Option<Spanned<String>>,
    pub host_header: Option<Spanned<String>>,
    pub headers: Option<HeadersSection>,
    pub lua: Option<RouteLuaSection>,
    /// Convert gRPC-web requests to gRPC and the answers back.
    pub grpc_web: Option<bool>,
    pub cors: Option<CorsSection>,
    pub cache: Option<RouteCacheSection>,
    pub compress: Option<CompressSection>,
    pub tracing: Option<RouteTracingSection>,
}

/// `[route.compress]`: gzip, brotli and zstd by Accept-Encoding.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, expecting = "a [route.compress] table")]
pub struct CompressSection {
    pub types: Option<Vec<Spanned<String>>>,
    pub min_size: Option<Spanned<SizeValue>>,
    pub level: Option<Spanned<i64>>,
    pub algorithms: Option<Vec<Spanned<String>>>,
    pub store: Option<Spanned<String>>,
}

/// `[route.cache.key]`: what the cache key holds.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, expecting = "a [route.cache.key] table")]
pub struct CacheKeySection {
    pub headers: Option<Vec<Spanned<String>>>,
    pub cookies: Option<Vec<Spanned<String>>>,
    pub query: Option<Spanned<String>>,
    pub query_include: Option<Vec<Spanned<String>>>,
    pub query_exclude: Option<Vec<Spanned<String>>>,
}

/// `[route.cache]`: this route's responses go through a cache zone.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, expecting = "a [route.cache] table")]
pub struct RouteCacheSection {
    pub zone: Spanned<String>,
    /// Status code (as a string key) → TTL for responses without freshness.
    pub ttl: Option<BTreeMap<String, Spanned<String>>>,
    #[serde(rename = "override")]
    pub override_origin: Option<bool>,
    pub lock_timeout: Option<Spanned<String>>,
    pub hit_for_miss: Option<Spanned<String>>,
    pub grace: Option<Spanned<String>>,
    pub key: Option<CacheKeySection>,
    pub strip_tags: Option<bool>,
    /// `"pass"` (default) or `"store"`.
    pub set_cookie: Option<Spanned<String>>,
}

/// `[cache.NAME]`: a cache zone.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, expecting = "a [cache.NAME] table")]
pub struct CacheZoneSection {
    pub memory: Spanned<SizeValue>,
    pub max_object: Option<Spanned<SizeValue>>,
    /// Vary variants kept per key.
    pub max_variants: Option<Spanned<i64>>,
    /// A disk tier in this directory (created if missing).
    pub disk_dir: Option<Spanned<String>>,
    /// The disk tier's bytes.
    pub disk: Option<Spanned<SizeValue>>,
    /// Memory hits before an object is written to disk (0: at once).
    pub promote_hits: Option<Spanned<i64>>,
    /// Objects with less freshness left than this stay in memory.
    pub disk_min_ttl: Option<Spanned<String>>,
    /// Disk writes (and reads) waiting for the I/O threads, each.
    pub disk_queue: Option<Spanned<i64>>,
    /// Parent Piers a miss asks first (a tiered cache).
    pub parents: Option<Spanned<Vec<Spanned<String>>>>,
}

/// `[route.cors]`: CORS preflights answered by Pier, and the CORS fields of
/// actual responses.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, expecting = "a [route.cors] table")]
pub struct CorsSection {
    pub allow_origins: Option<Vec<Spanned<String>>>,
    pub allow_methods: Option<Vec<Spanned<String>>>,
    pub allow_headers: Option<Vec<Spanned<String>>>,
    pub expose_headers: Option<Vec<Spanned<String>>>,
    pub max_age: Option<Spanned<String>>,
    pub allow_credentials: Option<bool>,
}

/// `[route.headers]` / `[upstream.NAME.headers]`: header rewrite rules.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, expecting = "a headers table")]
pub struct HeadersSection {
    pub request_set: Option<HeaderTable>,
    pub request_add: Option<HeaderTable>,
    pub request_remove: Option<Vec<Spanned<String>>>,
    pub response_set: Option<HeaderTable>,
    pub response_add: Option<HeaderTable>,
    pub response_remove: Option<Vec<Spanned<String>>>,
}

/// `{ "X-Env" = "prod", ... }`: header name -> value, in file order.
#[derive(Debug, Default)]
pub struct HeaderTable(pub Vec<(Spanned<String>, Spanned<String>)>);

impl<'de> Deserialize<'de> for HeaderTable {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = HeaderTable;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a table of header names and values, e.g. { \"X-Env\" = \"prod\" }")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<HeaderTable, A::Error> {
                // toml_edit hands the entries over in file order.
                let mut pairs = Vec::new();
                while let Some(entry) = map.next_entry()? {
                    pairs.push(entry);
                }
                Ok(HeaderTable(pairs))
            }
        }
        d.deserialize_map(V)
    }
}

/// `[route.lua]` after a `[[route]]`: each phase inline or as a file.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, expecting = "a [route.lua] table")]
pub struct RouteLuaSection {
    pub access: Option<Spanned<String>>,
    pub access_file: Option<Spanned<String>>,
    pub content: Option<Spanned<String>>,
    pub content_file: Option<Spanned<String>>,
    pub balancer: Option<Spanned<String>>,
    pub balancer_file: Option<Spanned<String>>,
    pub upstream_request: Option<Spanned<String>>,
    pub upstream_request_file: Option<Spanned<String>>,
    pub header_filter: Option<Spanned<String>>,
    pub header_filter_file: Option<Spanned<String>>,
    pub body_filter: Option<Spanned<String>>,
    pub body_filter_file: Option<Spanned<String>>,
    pub log: Option<Spanned<String>>,
    pub log_file: Option<Spanned<String>>,
}

impl RouteLuaSection {
    /// (phase, inline code, file), in request order.
    #[allow(clippy::type_complexity)]
    pub fn phases(
        &self,
    ) -> [(
        &'static str,
        &Option<Spanned<String>>,
        &Option<Spanned<String>>,
    ); 7] {
        [
            ("access", &self.access, &self.access_file),
            ("content", &self.content, &self.content_file),
            ("balancer", &self.balancer, &self.balancer_file),
            (
                "upstream_request",
                &self.upstream_request,
                &self.upstream_request_file,
            ),
            (
                "header_filter",
                &self.header_filter,
                &self.header_filter_file,
            ),
            ("body_filter", &self.body_filter, &self.body_filter_file),
            ("log", &self.log, &self.log_file),
        ]
    }
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, expecting = "a [lua] table")]
pub struct LuaSection {
    pub init: Option<Spanned<String>>,
    pub init_file: Option<Spanned<String>>,
    pub init_worker: Option<Spanned<String>>,
    pub init_worker_file: Option<Spanned<String>>,
    pub memory_limit: Option<Spanned<SizeValue>>,
    pub package_path: Option<Vec<Spanned<String>>>,
    pub max_response_body: Option<Spanned<SizeValue>>,
    pub socket_buffer: Option<Spanned<SizeValue>>,
    pub http_max_body: Option<Spanned<SizeValue>>,
    pub max_sockets_per_request: Option<Spanned<i64>>,
    pub max_sockets_per_worker: Option<Spanned<i64>>,
    pub socket_pool_wait: Option<Spanned<String>>,
    /// `[lua.shared]`: dictionary name -> capacity.
    pub shared: Option<BTreeMap<String, Spanned<SizeValue>>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, expecting = "a [[limit]] table")]
pub struct LimitEntry {
    pub name: Option<Spanned<String>>,
    pub key: Spanned<OneOrMany>,
    pub rate: Option<Spanned<String>>,
    pub burst: Option<Spanned<i64>>,
    pub concurrent: Option<Spanned<i64>>,
    pub routes: Option<Spanned<Vec<Spanned<String>>>>,
    pub dry_run: Option<bool>,
    pub status: Option<Spanned<i64>>,
    pub scope: Option<Spanned<String>>,
    pub fail: Option<Spanned<String>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, expecting = "an [upstream.NAME] table")]
pub struct UpstreamEntry {
    pub servers: Spanned<Vec<Spanned<ServerSpec>>>,
    pub balance: Option<Spanned<String>>,
    pub hash_key: Option<Spanned<String>>,
    pub max_fails: Option<Spanned<i64>>,
    pub passive_recover: Option<Spanned<String>>,
    pub retries: Option<Spanned<i64>>,
    pub retry_budget: Option<Spanned<f64>>,
    pub retry_min_per_sec: Option<Spanned<i64>>,
    pub pool_idle_per_server: Option<Spanned<i64>>,
    pub max_connections_per_server: Option<Spanned<i64>>,
    pub max_inflight_per_server: Option<Spanned<i64>>,
    pub host_header: Option<Spanned<String>>,
    pub headers: Option<HeadersSection>,
    pub health_check: Option<HealthCheckSection>,
    pub tls: Option<UpstreamTlsSection>,
    pub protocol: Option<Spanned<String>>,
    pub h2_max_streams: Option<Spanned<i64>>,
    pub resolve: Option<bool>,
    pub send_proxy_protocol: Option<Spanned<String>>,
}

#[derive(Debug, Deserialize)]
#[serde(
    deny_unknown_fields,
    expecting = "an [upstream.NAME.health_check] table"
)]
pub struct HealthCheckSection {
    #[serde(rename = "type")]
    pub kind: Option<Spanned<String>>,
    pub path: Option<Spanned<String>>,
    pub host: Option<Spanned<String>>,
    pub expect: Option<Spanned<String>>,
    pub interval: Option<Spanned<String>>,
    pub timeout: Option<Spanned<String>>,
    pub rise: Option<Spanned<i64>>,
    pub fall: Option<Spanned<i64>>,
    /// type = "grpc": the service asked about ("" = the server).
    pub service: Option<Spanned<String>>,
}

/// `{ addr = "...", weight = 3 }` form of an upstream server.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServerTable {
    pub addr: Spanned<String>,
    pub weight: Option<Spanned<i64>>,
}

// === values with two spellings ===

/// `"client_ip"` or `["client_ip", "header:X-Api-Key"]`.
#[derive(Debug)]
pub enum OneOrMany {
    One(String),
    Many(Vec<Spanned<String>>),
}

impl<'de> Deserialize<'de> for OneOrMany {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = OneOrMany;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a string or an array of strings")
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<OneOrMany, E> {
                Ok(OneOrMany::One(v.to_string()))
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                seq: A,
            ) -> Result<OneOrMany, A::Error> {
                Vec::deserialize(serde::de::value::SeqAccessDeserializer::new(seq))
                    .map(OneOrMany::Many)
            }
        }
        d.deserialize_any(V)
    }
}

/// An upstream server: `"127.0.0.1:9000"` or `{ addr = "...", weight = 3 }`.
#[derive(Debug)]
pub enum ServerSpec {
    Addr(String),
    Table(ServerTable),
}

impl<'de> Deserialize<'de> for ServerSpec {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = ServerSpec;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("an address \"IP:PORT\" or a table { addr = \"IP:PORT\", weight = N }")
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<ServerSpec, E> {
                Ok(ServerSpec::Addr(v.to_string()))
            }
            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<ServerSpec, A::Error> {
                // Hand the same map to the derived impl: keeps spans and
                // unknown-field checks.
                ServerTable::deserialize(serde::de::value::MapAccessDeserializer::new(map))
                    .map(ServerSpec::Table)
            }
        }
        d.deserialize_any(V)
    }
}

/// A size as written: an integer number of bytes or a string like "16k".
#[derive(Debug, Clone)]
pub enum SizeValue {
    Int(i64),
    Str(String),
}

impl<'de> Deserialize<'de> for SizeValue {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = SizeValue;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str(
                    "a size: bytes as an integer, or a string like \"16k\", \"10m\", \"1g\"",
                )
            }
            fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<SizeValue, E> {
                Ok(SizeValue::Int(v))
            }
            fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<SizeValue, E> {
                Ok(SizeValue::Int(i64::try_from(v).unwrap_or(i64::MAX)))
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<SizeValue, E> {
                Ok(SizeValue::Str(v.to_string()))
            }
        }
        d.deserialize_any(V)
    }
}

// === the whole file ===

/// Top-level sections, in the order the docs present them.
pub const SECTIONS: &[&str] = &[
    "server",
    "admin",
    "log",
    "limits",
    "timeouts",
    "http",
    "http2",
    "security",
    "resolver",
    "demo",
    "listener",
    "route",
    "upstream",
    "lua",
    "limit",
    "cache",
    "analytics",
    "tracing",
    "redis",
];

/// A `[upstream.NAME]` entry: its name (with the key's span) and its body,
/// or None when the body had schema errors (already reported).
#[derive(Debug)]
pub struct NamedUpstream {
    pub name: String,
    pub span: Option<Range<usize>>,
    pub entry: Option<UpstreamEntry>,
}

/// The file after deserialization; sections absent from the file are None.
#[derive(Debug, Default)]
pub struct RawFile {
    pub server: Option<ServerSection>,
    pub admin: Option<AdminSection>,
    pub analytics: Option<AnalyticsSection>,
    pub log: Option<LogSection>,
    pub limits: Option<LimitsSection>,
    pub timeouts: Option<TimeoutsSection>,
    pub http: Option<HttpSection>,
    pub http2: Option<Http2Section>,
    pub security: Option<SecuritySection>,
    pub resolver: Option<ResolverSection>,
    pub tracing: Option<TracingSection>,
    pub redis: Option<RedisSection>,
    pub demo: Option<DemoSection>,
    pub lua: Option<LuaSection>,
    /// Entries that deserialized; `listener_count` counts all of them, so
    /// that a broken entry does not also cause "no listener".
    pub listeners: Vec<ListenerEntry>,
    pub listener_count: usize,
    /// Each with the span of its table (a route missing its upstream is
    /// reported there).
    pub routes: Vec<(RouteEntry, Option<Range<usize>>)>,
    /// `[[limit]]` entries, each with the span of its table.
    pub limit_rules: Vec<(LimitEntry, Option<Range<usize>>)>,
    pub upstreams: Vec<NamedUpstream>,
    /// `upstream` was not a table (reported); route references can't be checked.
    pub upstreams_malformed: bool,
    /// `[cache.NAME]` zones, by name.
    pub caches: Vec<(String, Option<CacheZoneSection>)>,
}

/// Parses the (already env-expanded) text. A TOML syntax error is fatal
/// (`Err`); schema errors are collected per section and returned with
/// whatever did deserialize.
pub(crate) fn parse(text: &str) -> Result<(RawFile, Vec<RawError>), RawError> {
    let doc = ImDocument::parse(text).map_err(|e| RawError::at(e.span(), syntax_message(&e)))?;
    let root = doc.as_table();
    let mut file = RawFile::default();
    let mut errors = Vec::new();
    for (key, item) in root.iter() {
        let key_span = root.key(key).and_then(|k| k.span());
        let span = item_span(item).or(key_span.clone());
        match key {
            "server" => file.server = section(item, span, &mut errors),
            "admin" => file.admin = section(item, span, &mut errors),
            "analytics" => file.analytics = section(item, span, &mut errors),
            "log" => file.log = section(item, span, &mut errors),
            "limits" => file.limits = section(item, span, &mut errors),
            "timeouts" => file.timeouts = section(item, span, &mut errors),
            "http" => file.http = section(item, span, &mut errors),
            "http2" => file.http2 = section(item, span, &mut errors),
            "security" => file.security = section(item, span, &mut errors),
            "resolver" => file.resolver = section(item, span, &mut errors),
            "tracing" => file.tracing = section(item, span, &mut errors),
            "redis" => file.redis = section(item, span, &mut errors),
            "demo" => file.demo = section(item, span, &mut errors),
            "lua" => file.lua = section(item, span, &mut errors),
            "limit" => {
                file.limit_rules = array_entries(item, "limit", span, &mut errors)
                    .unwrap_or_default()
                    .into_iter()
                    .filter_map(|(it, sp)| Some((section(&it, sp.clone(), &mut errors)?, sp)))
                    .collect();
            }
            "listener" => {
                let entries = array_entries(item, "listener", span, &mut errors);
                // A wrongly shaped `listener` was reported; don't add "no listener".
                file.listener_count = entries.as_ref().map_or(1, Vec::len);
                file.listeners = entries
                    .unwrap_or_default()
                    .into_iter()
                    .filter_map(|(it, sp)| section(&it, sp, &mut errors))
                    .collect();
            }
            "route" => {
                file.routes = array_entries(item, "route", span, &mut errors)
                    .unwrap_or_default()
                    .into_iter()
                    .filter_map(|(it, sp)| Some((section(&it, sp.clone(), &mut errors)?, sp)))
                    .collect();
            }
            "upstream" => {
                let Some(table) = item.as_table_like() else {
                    errors.push(RawError::at(
                        span,
                        "`upstream` must be a table of named upstreams: write [upstream.NAME]",
                    ));
                    file.upstreams_malformed = true;
                    continue;
                };
                for (name, body) in table.iter() {
                    let name_span = table.get_key_value(name).and_then(|(k, _)| k.span());
                    let body_span = item_span(body).or(name_span.clone());
                    file.upstreams.push(NamedUpstream {
                        name: name.to_string(),
                        span: name_span,
                        entry: section(body, body_span, &mut errors),
                    });
                }
            }
            "cache" => {
                let Some(table) = item.as_table_like() else {
                    errors.push(RawError::at(
                        span,
                        "`cache` must be a table of named zones: write [cache.NAME]",
                    ));
                    continue;
                };
                for (name, body) in table.iter() {
                    let body_span = item_span(body);
                    file.caches
                        .push((name.to_string(), section(body, body_span, &mut errors)));
                }
            }
            other => errors.push(RawError::at(
                key_span,
                format!(
                    "unknown section `{other}`, expected one of: {}",
                    SECTIONS.join(", ")
                ),
            )),
        }
    }
    Ok((file, errors))
}

/// toml_edit's messages start with a newline-separated block; keep them on one line.
fn syntax_message(e: &toml_edit::TomlError) -> String {
    let m = e.message().trim();
    format!("TOML syntax error: {}", m.replace('\n', "; "))
}

/// serde names Rust types ("expected i64"); say what the user must write.
fn friendly(message: &str) -> String {
    let mut m = message.trim().to_string();
    for (rust, user) in [
        ("expected i64", "expected an integer"),
        ("expected f64", "expected a number"),
        ("expected a string", "expected a string (in quotes)"),
        ("expected a sequence", "expected an array [...]"),
    ] {
        if m.ends_with(rust) {
            m.truncate(m.len() - rust.len());
            m.push_str(user);
        }
    }
    m
}

fn item_span(item: &Item) -> Option<Range<usize>> {
    match item {
        Item::Table(t) => t.span(),
        other => other.span(),
    }
}

/// Deserializes one section or entry; on error records it and returns None.
fn section<T: DeserializeOwned>(
    item: &Item,
    fallback: Option<Range<usize>>,
    errors: &mut Vec<RawError>,
) -> Option<T> {
    let value = match item.clone().into_value() {
        Ok(v) => v,
        Err(_) => {
            errors.push(RawError::at(fallback, "expected a value"));
            return None;
        }
    };
    match T::deserialize(value.into_deserializer()) {
        Ok(v) => Some(v),
        Err(e) => {
            let e: toml_edit::de::Error = e;
            errors.push(RawError::at(e.span().or(fallback), friendly(e.message())));
            None
        }
    }
}

/// The tables of `[[name]]` (or `name = [{...}, ...]`), each with its span;
/// None (error recorded) when `name` is not an array.
fn array_entries(
    item: &Item,
    name: &str,
    span: Option<Range<usize>>,
    errors: &mut Vec<RawError>,
) -> Option<Vec<(Item, Option<Range<usize>>)>> {
    Some(match item {
        Item::ArrayOfTables(a) => a
            .iter()
            .map(|t| (Item::Table(t.clone()), t.span().or(span.clone())))
            .collect(),
        Item::Value(toml_edit::Value::Array(a)) => a
            .iter()
            .map(|v| (Item::Value(v.clone()), v.span().or(span.clone())))
            .collect(),
        _ => {
            errors.push(RawError::at(
                span,
                format!("`{name}` must be an array of tables: write [[{name}]]"),
            ));
            return None;
        }
    })
}

/// Field names of a schema struct, read from serde's derived impl itself
/// (so the docs test cannot drift from the code).
#[cfg(test)]
pub fn fields_of<T: DeserializeOwned>() -> Vec<&'static str> {
    struct Collector(Vec<&'static str>);
    #[derive(Debug)]
    struct Stop;
    impl fmt::Display for Stop {
        fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
            f.write_str("stop")
        }
    }
    impl std::error::Error for Stop {}
    impl serde::de::Error for Stop {
        fn custom<M: fmt::Display>(_: M) -> Self {
            Stop
        }
    }
    impl<'de> Deserializer<'de> for &mut Collector {
        type Error = Stop;
        fn deserialize_any<V: Visitor<'de>>(self, _: V) -> Result<V::Value, Stop> {
            Err(Stop)
        }
        fn deserialize_struct<V: Visitor<'de>>(
            self,
            _: &'static str,
            fields: &'static [&'static str],
            _: V,
        ) -> Result<V::Value, Stop> {
            self.0.extend_from_slice(fields);
            Err(Stop)
        }
        serde::forward_to_deserialize_any! {
            bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string
            bytes byte_buf option unit unit_struct newtype_struct seq tuple
            tuple_struct map enum identifier ignored_any
        }
    }
    let mut c = Collector(Vec::new());
    let _ = T::deserialize(&mut c);
    c.0
}
