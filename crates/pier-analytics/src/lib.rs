//! Pier's built-in traffic analytics: the data structures, the embedded
//! store, and the [`hub`] that takes events from the proxy's logging step
//! to the one analytics thread.
//!
//! The analytics thread ([`hub::Hub`]) feeds every finished request to an
//! [`Aggregator`], which keeps one [`Rollup`] per minute and (host, route).
//! Closed minutes are written to a [`Store`] (SQLite), which keeps minute, hour
//! and day rows, and answers [`Query`]s with a [`Report`] for the admin API and
//! dashboard.
//!
//! ```
//! use pier_analytics::{Aggregator, EventRef, Query, Step, Store};
//! use std::net::{IpAddr, Ipv4Addr};
//!
//! let mut agg = Aggregator::new(1000);
//! agg.add(&EventRef {
//!     ts_ms: 1_700_000_000_000,
//!     host: b"Example.com:8080",
//!     route: "api",
//!     method: b"GET",
//!     path: b"/users",
//!     status: 200,
//!     bytes_in: 120,
//!     bytes_out: 5300,
//!     duration_us: 1800,
//!     upstream_us: 1500,
//!     client_ip: IpAddr::V4(Ipv4Addr::new(192, 0, 2, 7)),
//!     user_agent: b"curl/8.5.0",
//!     ..EventRef::EMPTY
//! });
//! // Once a minute: close the minutes before the current one.
//! let closed = agg.take_before(1_700_000_100);
//! let mut store = Store::open(std::path::Path::new(":memory:")).unwrap();
//! store.write_minutes(&closed).unwrap();
//!
//! let report = store
//!     .query(&Query {
//!         from_s: 1_699_999_200,
//!         to_s: 1_700_003_600,
//!         step: Step::Hour,
//!         host: Some("example.com".into()),
//!         route: None,
//!         top: 10,
//!     })
//!     .unwrap();
//! assert_eq!(report.total.requests, 1);
//! assert_eq!(report.total.unique_clients, 1);
//! assert_eq!(report.top_paths, vec![("/users".to_string(), 1)]);
//! ```
//!
//! # The sketches
//! Counters are exact. What cannot be counted exactly in bounded memory is
//! kept as a mergeable sketch, so a minute, an hour and a day are all the
//! merge of their parts and give the same answer whichever rows are read:
//! - [`hll::Hll`]: HyperLogLog (p = 14, 0.81% standard error) for unique
//!   client IPs, bit-compatible with PostgreSQL's `postgresql-hll`.
//! - [`sketch::Latency`]: DDSketch (1% relative error) for latency quantiles.
//! - [`topk::TopK`]: Space-Saving heavy hitters for top paths, clients and
//!   user agents.

pub mod agg;
pub mod hll;
pub mod hub;
pub mod sketch;
pub mod store;
pub mod topk;

mod codec;

pub use agg::{Aggregator, EventRef, Key, Rollup};
pub use codec::DecodeError;
pub use store::{Error, Point, Query, Report, Step, Store};

#[cfg(test)]
mod tests {
    /// The analytics thread owns the aggregator and the store; the admin API
    /// may receive rollups and reports from it.
    #[test]
    fn types_cross_threads() {
        fn send<T: Send>() {}
        fn send_sync<T: Send + Sync>() {}
        send::<crate::Store>();
        send::<crate::Aggregator>();
        send_sync::<crate::Rollup>();
        send_sync::<crate::Report>();
        send_sync::<crate::Key>();
    }
}
