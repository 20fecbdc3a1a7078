//! Builders shared by the integration tests.
#![allow(dead_code)]

use std::net::SocketAddr;
use std::time::Duration;

use pier_config::{Balance, HealthCheck, Upstream, UpstreamServer};

pub fn addr(i: usize) -> SocketAddr {
    SocketAddr::from(([10, 0, (i / 250) as u8, (i % 250) as u8 + 1], 8000))
}

/// An upstream of `weights.len()` servers at 10.0.x.y:8000.
pub fn upstream(balance: Balance, weights: &[u32]) -> Upstream {
    let servers = weights
        .iter()
        .enumerate()
        .map(|(i, &weight)| UpstreamServer::new(addr(i), weight))
        .collect();
    upstream_with(balance, servers, None)
}

pub fn upstream_with(
    balance: Balance,
    servers: Vec<UpstreamServer>,
    health_check: Option<HealthCheck>,
) -> Upstream {
    Upstream {
        name: "app".into(),
        servers,
        balance,
        health_check,
        max_fails: 3,
        passive_recover: Duration::from_secs(10),
        retries: 2,
        retry_budget_ratio: 0.2,
        retry_min_per_sec: 10,
        pool_idle_per_server: 16,
        max_connections_per_server: 0,
        max_inflight_per_server: 0,
        headers: Default::default(),
        host_header: Default::default(),
        tls: None,
        protocol: Default::default(),
        h2_max_streams: 100,
        send_proxy_protocol: None,
        resolve: Vec::new(),
    }
}
