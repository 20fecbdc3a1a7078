//! Connections a full worker may close to admit a new one.
//!
//! At `limits.max_connections` a plain refusal at accept lets a flood of
//! slowloris connections (or forgotten keep-alive ones) lock every
//! well-behaved client out until they time out. Like nginx, which reclaims
//! its "reusable" connections when it runs out, a worker that is full closes
//! its *oldest* connection that is waiting for a request head — idle between
//! requests, or still reading a head — and gives its slot to the new one.
//! Connections in the middle of a request are never evicted; when no waiting
//! connection is old enough, the new one is refused as before.
//!
//! Per worker thread (no atomics, no locks): each worker evicts among its own
//! connections, which is enough because reuseport spreads accepts over the
//! workers. Entering and leaving the registry is a slab insert/remove around
//! each head wait; the scan for the oldest happens only when full.

use std::cell::{Cell, RefCell};
use std::rc::Rc;
use tokio::sync::Notify;

/// A connection gets this long (in the waiting state) before it may be
/// evicted, so a client that just connected has time to send its head even
/// when a burst of newer connections arrives behind it (the accept loop also
/// yields every few accepts so that new connections get to read). Measured
/// in the flood test (bin/pier/tests/flood.rs): 100 ms left windows where
/// every waiting connection was younger and new ones were refused (1-4 of
/// ~155 good requests failed); 5 ms lost none in repeated runs.
pub const MIN_AGE_MS: u64 = 5;

/// One connection's eviction flag, shared between its task and the registry.
#[derive(Default)]
pub struct Slot {
    evicted: Cell<bool>,
    notify: Notify,
}

impl Slot {
    pub fn new() -> Rc<Slot> {
        Rc::new(Slot::default())
    }
    /// Whether this connection was evicted (its slot now belongs to another).
    pub fn evicted(&self) -> bool {
        self.evicted.get()
    }
    /// Resolves once the connection is evicted.
    pub async fn wait(&self) {
        if !self.evicted.get() {
            // `notify_one` leaves a permit when nobody waits yet.
            self.notify.notified().await;
        }
    }
    fn evict(&self) {
        self.evicted.set(true);
        self.notify.notify_one();
    }
}

/// The worker's connections that are waiting for a request head.
#[derive(Default)]
pub struct Registry {
    /// (entered at, ms; the connection's slot); `None` for free entries.
    entries: Vec<Option<(u64, Rc<Slot>)>>,
    free: Vec<usize>,
}

impl Registry {
    fn enter(&mut self, now_ms: u64, slot: &Rc<Slot>) -> usize {
        let e = Some((now_ms, slot.clone()));
        match self.free.pop() {
            Some(i) => {
                self.entries[i] = e;
                i
            }
            None => {
                self.entries.push(e);
                self.entries.len() - 1
            }
        }
    }

    /// Leave entry `i` if it is still `slot`'s (after an eviction the entry
    /// may already belong to another connection).
    fn leave(&mut self, i: usize, slot: &Rc<Slot>) {
        if matches!(&self.entries[i], Some((_, s)) if Rc::ptr_eq(s, slot)) {
            self.entries[i] = None;
            self.free.push(i);
        }
    }

    /// Evict the connection that has waited longest, if it has waited at
    /// least `min_age_ms`. Returns whether one was evicted.
    pub fn evict_oldest(&mut self, now_ms: u64, min_age_ms: u64) -> bool {
        let oldest = self
            .entries
            .iter()
            .enumerate()
            .filter_map(|(i, e)| e.as_ref().map(|(t, _)| (*t, i)))
            .min();
        match oldest {
            Some((t, i)) if now_ms.saturating_sub(t) >= min_age_ms => {
                if let Some((_, slot)) = self.entries[i].take() {
                    slot.evict();
                }
                self.free.push(i);
                true
            }
            _ => false,
        }
    }

    /// Connections currently waiting (evictable).
    pub fn waiting(&self) -> usize {
        self.entries.len() - self.free.len()
    }
}

/// Registered while alive: a connection waiting for a head.
pub struct Waiting<'a> {
    reg: &'a RefCell<Registry>,
    slot: &'a Rc<Slot>,
    i: usize,
}

impl<'a> Waiting<'a> {
    pub fn enter(reg: &'a RefCell<Registry>, now_ms: u64, slot: &'a Rc<Slot>) -> Self {
        let i = reg.borrow_mut().enter(now_ms, slot);
        Waiting { reg, slot, i }
    }
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.reg.borrow_mut().leave(self.i, self.slot);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn evicts_the_oldest_old_enough_and_only_waiting_ones() {
        let reg = RefCell::new(Registry::default());
        let (a, b, c) = (Slot::new(), Slot::new(), Slot::new());
        let wa = Waiting::enter(&reg, 1000, &a);
        let wb = Waiting::enter(&reg, 900, &b);
        {
            let _wc = Waiting::enter(&reg, 100, &c);
        } // c got its head: no longer evictable
        assert_eq!(reg.borrow().waiting(), 2);
        // Nobody old enough yet.
        assert!(!reg.borrow_mut().evict_oldest(950, 100));
        assert!(reg.borrow_mut().evict_oldest(1100, 100));
        assert!(b.evicted() && !a.evicted() && !c.evicted());
        assert_eq!(reg.borrow().waiting(), 1);
        // b's entry is reused by d; b's guard must not take it away.
        let d = Slot::new();
        let wd = Waiting::enter(&reg, 1100, &d);
        drop(wb);
        assert_eq!(reg.borrow().waiting(), 2);
        drop(wd);
        assert_eq!(reg.borrow().waiting(), 1);
        assert!(reg.borrow_mut().evict_oldest(1100, MIN_AGE_MS));
        assert!(a.evicted());
        drop(wa);
        assert_eq!(reg.borrow().waiting(), 0);
        assert!(!reg.borrow_mut().evict_oldest(5000, MIN_AGE_MS));
        // Freed entries are reused.
        let e = Slot::new();
        let _we = Waiting::enter(&reg, 5000, &e);
        assert_eq!(reg.borrow().entries.len(), 3, "no growth past the peak");
    }

    #[tokio::test]
    async fn wait_resolves_after_eviction_even_if_it_came_first() {
        let reg = RefCell::new(Registry::default());
        let s = Slot::new();
        let _w = Waiting::enter(&reg, 0, &s);
        assert!(reg.borrow_mut().evict_oldest(200, MIN_AGE_MS));
        tokio::time::timeout(std::time::Duration::from_secs(1), s.wait())
            .await
            .expect("evicted slot's wait must resolve");
    }
}
