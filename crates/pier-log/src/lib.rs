//! Observability for Pier: `metrics` (counters sharded per worker thread,
//! rendered as Prometheus text) and `access` (JSON lines, formatted into a
//! per-worker buffer and written by a separate thread so a slow disk never
//! blocks a worker).
#![forbid(unsafe_code)]

pub mod access;
pub mod fields;
pub mod metrics;
pub mod openmetrics;

pub use access::{AccessLog, AccessRecord, TlsFields};
pub use metrics::{Metrics, WORKER_ID};
