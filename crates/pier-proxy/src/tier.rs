//! A tiered cache (`[cache.NAME] parents`): on a miss, a lower-tier Pier
//! asks the parent Pier that owns the key before the origin, so that the
//! fleet fetches each object from the origin once (the parent coalesces
//! its children's misses as it does its clients').
//!
//! ```text
//!   client ─▶ child ─miss─▶ parent = ring(cache key) ─miss─▶ origin
//!                │             (Pier-Tier: 1 — the parent goes to the origin)
//!                └─ parent down (refused, reset): next parent on the ring;
//!                   none left, or the owner is this node itself: the origin
//! ```
//!
//! The parents form a consistent-hash ring (pier-lb's ketama ring, 160
//! points per parent, on the cache key), so every child with the same
//! `parents` sends a key to the same parent, and a parent that fails moves
//! only its own keys, to the next parent on the ring (passive health: one
//! failed connection marks it down for 5 s, then one request probes it).
//! Loads are bounded (`LOAD_FACTOR`): a parent far above the average is
//! passed over for the next on the ring.
//! The request carries `Pier-Tier: 1`; a Pier that receives it fills from
//! its origin and never from its own parents, so tiers cannot loop. The
//! mark is removed before the origin sees the request. A client that sends
//! it only makes its own miss skip the parents (the node still caches and
//! coalesces), which costs the origin no more than a fleet without tiers.

use crate::session::Session;
use crate::state::State;
use pier_config::{Balance, Config, HashKey, Upstream, UpstreamServer};
use pier_lb::Group;
use std::sync::Arc;
use std::time::Duration;

/// Bounded loads: a parent with this many times the average of this
/// node's requests in flight to the parents (and at least `LOAD_FLOOR`)
/// is passed over for the next on the ring (Vimeo's 1.25). The key's
/// owner then does not see that miss: the next parent fills it from the
/// origin, one more origin request, in exchange for no parent drowning
/// under one hot key. Below the floor keys never move, so a quiet fleet
/// fetches each object once.
const LOAD_FACTOR: f64 = 1.25;
const LOAD_FLOOR: usize = 32;

/// The loop-prevention mark on a request to a parent.
pub const HOP: &[u8] = b"pier-tier";
/// Its slot: every lookup that may fill looks for it.
const HOP_KNOWN: pier_http::known::Known = pier_http::known::PIER_TIER;

/// A miss on its way to the parents.
pub(crate) struct Tier {
    zone: usize,
    key: Arc<[u8]>,
    tried: [usize; 8],
    ntried: usize,
}

/// Per zone (as `cfg.caches`): its parents as a group hashed on the cache
/// key, or None. Parents that did not change keep their health.
pub(crate) fn groups(cfg: &Config, prev: Option<&State>) -> Vec<Option<Arc<Group>>> {
    cfg.caches
        .iter()
        .map(|z| {
            if z.parents.is_empty() {
                return None;
            }
            let mut u = Upstream::with_defaults(
                format!("cache-parents:{}", z.name),
                z.parents
                    .iter()
                    .map(|a| UpstreamServer::new(*a, 1))
                    .collect(),
            );
            // The key is given to `select_at` (the cache key), whatever
            // this says.
            u.balance = Balance::Hash(HashKey::Path);
            u.max_fails = 1;
            u.passive_recover = Duration::from_secs(5);
            let old = prev.and_then(|p| {
                p.cfg
                    .caches
                    .iter()
                    .position(|o| o.name == z.name)
                    .and_then(|i| p.cache_parents.get(i).cloned().flatten())
            });
            Some(Arc::new(match old {
                Some(g) => Group::reload(&u, &g),
                None => Group::new(&u),
            }))
        })
        .collect()
}

/// At a miss that fills the zone: the parents to ask, if the zone has
/// them and the request did not come from a child (which is then filled
/// from the origin). The mark is set on, or taken off, the upstream head.
pub(crate) fn begin(
    state: &State,
    sess: &mut Session,
    route: usize,
    key: Option<&Arc<[u8]>>,
) -> Option<Tier> {
    if sess.req.headers.has_known(HOP_KNOWN) {
        sess.up_req.headers.remove_known(HOP_KNOWN);
        return None;
    }
    let key = key?;
    let zone = state.cfg.routes[route].cache.as_ref()?.zone;
    state.cache_parents.get(zone)?.as_ref()?;
    sess.up_req.headers.insert(HOP, b"1");
    Some(Tier {
        zone,
        key: key.clone(),
        tried: [0; 8],
        ntried: 0,
    })
}

/// The parent for the next attempt: the first live one on the ring past
/// those tried. None: go to the origin (none left, or this node owns the
/// key: one of its own listeners is the parent).
pub(crate) fn pick<'s>(state: &'s State, t: &Tier) -> Option<(&'s Arc<Group>, usize)> {
    let g = state.cache_parents.get(t.zone)?.as_ref()?;
    let i = g.select_bounded(
        Some(&t.key),
        &t.tried[..t.ntried],
        pier_lb::recent_ms(),
        LOAD_FACTOR,
        LOAD_FLOOR,
    )?;
    let addr = g.peers()[i].addr;
    if state.cfg.listeners.iter().any(|l| l.addr == addr) {
        return None;
    }
    Some((g, i))
}

impl Tier {
    /// Parent `i` failed; false when no more can be skipped.
    pub(crate) fn tried(&mut self, i: usize) -> bool {
        if self.ntried < self.tried.len() {
            self.tried[self.ntried] = i;
            self.ntried += 1;
            return true;
        }
        false
    }
}

/// No parent (left): the request goes to the origin, without the mark.
pub(crate) fn give_up(tier: &mut Option<Tier>, sess: &mut Session) {
    if tier.take().is_some() {
        sess.up_req.headers.remove(HOP);
    }
}
