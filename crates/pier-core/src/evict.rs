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

use std::cell::RefCell;
use std::future::poll_fn;
use std::task::{Poll, Waker};

/// A connection gets this long (in the waiting state) before it may be
/// evicted, so a client that just connected has time to send its head even
/// when a burst of newer connections arrives behind it (the accept loop also
/// yields every few accepts so that new connections get to read). Measured
/// in the flood test (bin/pier/tests/flood.rs): 100 ms left windows where
/// every waiting connection was younger and new ones were refused (1-4 of
/// ~155 good requests failed); 5 ms lost none in repeated runs.
pub const MIN_AGE_MS: u64 = 5;

#[derive(Clone, Copy, PartialEq, Eq)]
enum Mark {
    Free,
    Waiting,
    Evicted,
}

/// One registry entry: owned by a connection from `Waiting::enter` until the
/// guard drops (also after an eviction, so an entry is never reused under a
/// connection that still refers to it). No allocation per connection: the
/// connection's waker is kept here.
struct Entry {
    since_ms: u64,
    mark: Mark,
    waker: Option<Waker>,
}

/// The worker's connections that are waiting for a request head.
#[derive(Default)]
pub struct Registry {
    entries: Vec<Entry>,
    free: Vec<usize>,
    waiting: usize,
}

impl Registry {
    fn enter(&mut self, now_ms: u64) -> usize {
        self.waiting += 1;
        let e = Entry {
            since_ms: now_ms,
            mark: Mark::Waiting,
            waker: None,
        };
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

    fn leave(&mut self, i: usize) {
        let e = &mut self.entries[i];
        if e.mark == Mark::Waiting {
            self.waiting -= 1;
        }
        e.mark = Mark::Free;
        e.waker = None;
        self.free.push(i);
    }

    /// Evict the connection that has waited longest, if it has waited at
    /// least `min_age_ms`. Returns whether one was evicted.
    pub fn evict_oldest(&mut self, now_ms: u64, min_age_ms: u64) -> bool {
        let oldest = self
            .entries
            .iter()
            .enumerate()
            .filter(|(_, e)| e.mark == Mark::Waiting)
            .map(|(i, e)| (e.since_ms, i))
            .min();
        match oldest {
            Some((t, i)) if now_ms.saturating_sub(t) >= min_age_ms => {
                let e = &mut self.entries[i];
                e.mark = Mark::Evicted;
                self.waiting -= 1;
                if let Some(w) = e.waker.take() {
                    w.wake();
                }
                true
            }
            _ => false,
        }
    }

    /// Milliseconds until the oldest waiting connection is `min_age_ms` old
    /// (0: it already is); `None` when no connection is waiting.
    pub fn ms_until_evictable(&self, now_ms: u64, min_age_ms: u64) -> Option<u64> {
        self.entries
            .iter()
            .filter(|e| e.mark == Mark::Waiting)
            .map(|e| e.since_ms)
            .min()
            .map(|t| min_age_ms.saturating_sub(now_ms.saturating_sub(t)))
    }

    /// Evict every waiting connection (the worker drains: idle ones close
    /// now, quietly, as nginx's do at a graceful stop).
    pub fn evict_all(&mut self) {
        for e in &mut self.entries {
            if e.mark == Mark::Waiting {
                e.mark = Mark::Evicted;
                self.waiting -= 1;
                if let Some(w) = e.waker.take() {
                    w.wake();
                }
            }
        }
    }

    /// Connections currently waiting (evictable).
    pub fn waiting(&self) -> usize {
        self.waiting
    }
}

/// Registered while alive: a connection waiting for a head.
pub struct Waiting<'a> {
    reg: &'a RefCell<Registry>,
    i: usize,
}

impl<'a> Waiting<'a> {
    pub fn enter(reg: &'a RefCell<Registry>, now_ms: u64) -> Self {
        let i = reg.borrow_mut().enter(now_ms);
        Waiting { reg, i }
    }

    /// Resolves once this connection is evicted.
    pub async fn evicted(&self) {
        poll_fn(|cx| {
            let mut r = self.reg.borrow_mut();
            let e = &mut r.entries[self.i];
            if e.mark == Mark::Evicted {
                return Poll::Ready(());
            }
            if !e.waker.as_ref().is_some_and(|w| w.will_wake(cx.waker())) {
                e.waker = Some(cx.waker().clone());
            }
            Poll::Pending
        })
        .await
    }

    /// Whether this connection was evicted.
    pub fn is_evicted(&self) -> bool {
        self.reg.borrow().entries[self.i].mark == Mark::Evicted
    }
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.reg.borrow_mut().leave(self.i);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn evicts_the_oldest_old_enough_and_only_waiting_ones() {
        let reg = RefCell::new(Registry::default());
        let wa = Waiting::enter(&reg, 1000);
        let wb = Waiting::enter(&reg, 900);
        {
            let _wc = Waiting::enter(&reg, 100);
        } // c got its head: no longer evictable
        assert_eq!(reg.borrow().waiting(), 2);
        // Nobody old enough yet.
        assert!(!reg.borrow_mut().evict_oldest(950, 100));
        assert_eq!(reg.borrow().ms_until_evictable(950, 100), Some(50));
        assert_eq!(reg.borrow().ms_until_evictable(1100, 100), Some(0));
        assert!(reg.borrow_mut().evict_oldest(1100, 100));
        assert!(wb.is_evicted() && !wa.is_evicted());
        assert_eq!(reg.borrow().waiting(), 1);
        // An evicted entry stays its connection's until the guard drops.
        let wd = Waiting::enter(&reg, 1100);
        assert_ne!(wd.i, wb.i);
        drop(wb);
        assert_eq!(reg.borrow().waiting(), 2);
        assert!(reg.borrow_mut().evict_oldest(1200, 100));
        assert!(wa.is_evicted() && !wd.is_evicted());
        drop(wa);
        drop(wd);
        assert_eq!(reg.borrow().waiting(), 0);
        assert!(!reg.borrow_mut().evict_oldest(5000, MIN_AGE_MS));
        assert_eq!(reg.borrow().ms_until_evictable(5000, MIN_AGE_MS), None);
        // Freed entries are reused.
        let _we = Waiting::enter(&reg, 5000);
        assert_eq!(reg.borrow().entries.len(), 3, "no growth past the peak");
    }

    #[tokio::test]
    async fn evicted_resolves_whether_it_waited_before_or_not() {
        let reg = RefCell::new(Registry::default());
        // Evicted before anyone waits.
        let a = Waiting::enter(&reg, 0);
        assert!(reg.borrow_mut().evict_oldest(200, MIN_AGE_MS));
        tokio::time::timeout(std::time::Duration::from_secs(1), a.evicted())
            .await
            .expect("an evicted connection's wait must resolve");
        // Evicted while waiting: the stored waker is woken.
        let b = Waiting::enter(&reg, 300);
        let wait = b.evicted();
        tokio::pin!(wait);
        assert!(futures_poll_once(wait.as_mut()).is_pending());
        assert!(reg.borrow_mut().evict_oldest(400, MIN_AGE_MS));
        tokio::time::timeout(std::time::Duration::from_secs(1), wait)
            .await
            .expect("woken on eviction");
    }

    fn futures_poll_once<F: std::future::Future>(f: std::pin::Pin<&mut F>) -> Poll<F::Output> {
        let mut cx = std::task::Context::from_waker(Waker::noop());
        f.poll(&mut cx)
    }
}
