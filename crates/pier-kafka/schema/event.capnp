# One request as Pier sends it to Kafka: one Cap'n Proto message per Kafka
# record, in the packed encoding (`capnp::serialize_packed`), with no key.
#
# Fields follow pier_analytics::EventRef. Byte strings that come from the
# client (host, method, path, user agent, extra fields) are Data, not Text:
# they need not be UTF-8. Only add fields at the end (new ordinals), never
# renumber or retype one: old aggregators read new events and the reverse.
#
# The Rust code in src/event_capnp.rs is generated from this file and
# committed (a build does not need the `capnp` tool); the test
# `generated_code_is_current` checks it when `capnp` is installed; to
# regenerate: PIER_KAFKA_REGENERATE=1 cargo test -p pier-kafka generated_code

@0xb5ef60dd684c0340;

struct Event {
  tsMs @0 :UInt64;         # Unix time of the request's end, milliseconds
  listener @1 :Text;       # listener name, "" when unnamed
  host @2 :Data;           # Host header as received
  route @3 :Text;          # route name
  method @4 :Data;
  path @5 :Data;           # without the query string
  status @6 :UInt16;
  bytesIn @7 :UInt64;
  bytesOut @8 :UInt64;
  durationUs @9 :UInt64;
  upstreamUs @10 :UInt64;  # 0 when no upstream was used
  upstream @11 :Data;      # upstream server address as text, "" when none
  cache @12 :Text;         # "", "HIT", "MISS", "EXPIRED", ...
  protocol @13 :Text;      # "HTTP/1.0", "HTTP/1.1", "HTTP/2.0"
  tlsVersion @14 :Text;    # "TLSv1.3", "TLSv1.2", "" for cleartext
  clientIp @15 :Data;      # 16 bytes: IPv6, or IPv4 mapped (::ffff:a.b.c.d)
  userAgent @16 :Data;
  extra @17 :List(Field);  # fields a log hook added
  traceId @18 :Data;       # W3C trace id, 16 bytes; empty without [tracing]
  spanId @19 :Data;        # the request's server span id, 8 bytes; or empty

  struct Field {
    name @0 :Data;
    value @1 :Data;
  }
}
