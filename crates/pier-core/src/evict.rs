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
//!
//! The registry is also the idle connections' timer: an entry may carry a
//! deadline (`client_idle`, `client_header` before a first byte), and one
//! sweeper task per worker ([`sweep`]) evicts the entries whose deadline has
//! passed. An idle connection then holds no timer of its own (a tokio
//! `Sleep` is ~120 bytes, and pushed its task over a 128-byte size class).
//! The sweeper sleeps until the earliest deadline (no earlier than
//! [`SWEEP_MS`] from now), is woken only when an earlier one enters, and
//! exits when no entry has a deadline.

use std::cell::RefCell;
use std::future::{poll_fn, Future};
use std::task::{Poll, Waker};
use std::time::Duration;

/// A connection gets this long (in the waiting state) before it may be
/// evicted, so a client that just connected has time to send its head even
/// when a burst of newer connections arrives behind it (the accept loop also
/// yields every few accepts so that new connections get to read). Measured
/// in the flood test (bin/pier/tests/flood.rs): 100 ms left windows where
/// every waiting connection was younger and new ones were refused (1-4 of
/// ~155 good requests failed); 5 ms lost none in repeated runs.
pub const MIN_AGE_MS: u64 = 5;

/// The sweeper's resolution: deadlines are met within this many
/// milliseconds (plus scheduling), and it scans at most this often.
pub const SWEEP_MS: u64 = 10;

/// An entry without a deadline (a head being read has its own timeout).
const NO_DEADLINE: u64 = u64::MAX;

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
    /// Evicted once the clock reaches it (`NO_DEADLINE`: never).
    deadline_ms: u64,
    /// What kind of wait (0: a request head; a TLS listener's ClientHello
    /// waits use their own, so one listener's flood evicts its own first).
    tag: u32,
    /// A kept-alive connection idle between requests: what a drain
    /// closes. Every other wait (a new connection's first bytes, a
    /// handshake, a head arriving) is left to end on its own bounds, so a
    /// client that connected just before a drain is still served.
    kept: bool,
    mark: Mark,
    waker: Option<Waker>,
}

/// The worker's connections that are waiting for a request head.
#[derive(Default)]
pub struct Registry {
    entries: Vec<Entry>,
    free: Vec<usize>,
    waiting: usize,
    sweeper: Sweeper,
}

/// The sweeper task's state, kept in the registry it sweeps.
struct Sweeper {
    running: bool,
    /// When it will next scan (`NO_DEADLINE`: not planned).
    planned_ms: u64,
    /// An earlier deadline entered: scan again now.
    poked: bool,
    waker: Option<Waker>,
}

impl Default for Sweeper {
    fn default() -> Self {
        Sweeper {
            running: false,
            planned_ms: NO_DEADLINE,
            poked: false,
            waker: None,
        }
    }
}

impl Registry {
    fn enter(&mut self, now_ms: u64, deadline_ms: u64, tag: u32, kept: bool) -> usize {
        self.waiting += 1;
        if deadline_ms < self.sweeper.planned_ms {
            self.sweeper.planned_ms = deadline_ms;
            self.sweeper.poked = true;
            if let Some(w) = self.sweeper.waker.take() {
                w.wake();
            }
        }
        let e = Entry {
            since_ms: now_ms,
            deadline_ms,
            tag,
            kept,
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
        self.evict_oldest_where(now_ms, min_age_ms, |_| true)
    }

    /// As `evict_oldest`, among the entries with this tag only.
    pub fn evict_oldest_tagged(&mut self, tag: u32, now_ms: u64, min_age_ms: u64) -> bool {
        self.evict_oldest_where(now_ms, min_age_ms, |t| t == tag)
    }

    fn evict_oldest_where(
        &mut self,
        now_ms: u64,
        min_age_ms: u64,
        pick: impl Fn(u32) -> bool,
    ) -> bool {
        let oldest = self
            .entries
            .iter()
            .enumerate()
            .filter(|(_, e)| e.mark == Mark::Waiting && pick(e.tag))
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

    /// Evict every kept-alive connection idle between requests (the
    /// worker drains: they close now, quietly, as nginx's do at a graceful
    /// stop). Connections not yet served a request are not evicted: at a
    /// binary upgrade they were accepted from a queue the new process
    /// shares, and their clients are owed an answer.
    pub fn evict_kept(&mut self) {
        for e in &mut self.entries {
            if e.mark == Mark::Waiting && e.kept {
                e.mark = Mark::Evicted;
                self.waiting -= 1;
                if let Some(w) = e.waker.take() {
                    w.wake();
                }
            }
        }
    }

    /// Evict the waiting connections whose deadline is at or before
    /// `now_ms`; the earliest deadline left, if any.
    fn expire(&mut self, now_ms: u64) -> Option<u64> {
        let mut next = NO_DEADLINE;
        for e in &mut self.entries {
            if e.mark != Mark::Waiting {
                continue;
            }
            if e.deadline_ms <= now_ms {
                e.mark = Mark::Evicted;
                self.waiting -= 1;
                if let Some(w) = e.waker.take() {
                    w.wake();
                }
            } else {
                next = next.min(e.deadline_ms);
            }
        }
        (next != NO_DEADLINE).then_some(next)
    }

    /// Whether the caller must start the sweeper (none is running): true
    /// once, until it exits.
    pub fn claim_sweeper(&mut self) -> bool {
        !std::mem::replace(&mut self.sweeper.running, true)
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
        let i = reg.borrow_mut().enter(now_ms, NO_DEADLINE, 0, false);
        Waiting { reg, i }
    }

    /// As `enter`, with a tag that [`Registry::evict_oldest_tagged`] picks.
    pub fn enter_tagged(reg: &'a RefCell<Registry>, now_ms: u64, tag: u32) -> Self {
        let i = reg.borrow_mut().enter(now_ms, NO_DEADLINE, tag, false);
        Waiting { reg, i }
    }

    /// As `enter`, and evicted by the sweeper at `deadline_ms` (the caller
    /// starts one when `Registry::claim_sweeper` says so).
    pub fn enter_until(reg: &'a RefCell<Registry>, now_ms: u64, deadline_ms: u64) -> Self {
        let i = reg.borrow_mut().enter(now_ms, deadline_ms, 0, false);
        Waiting { reg, i }
    }

    /// As `enter_until`, for a kept-alive connection idle between
    /// requests: also evicted by a drain ([`Registry::evict_kept`]).
    pub fn enter_kept_until(reg: &'a RefCell<Registry>, now_ms: u64, deadline_ms: u64) -> Self {
        let i = reg.borrow_mut().enter(now_ms, deadline_ms, 0, true);
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

/// The worker's sweeper: evicts waiting connections whose deadline passed
/// (`now_ms` is the worker's millisecond clock), sleeping in between; returns
/// when no waiting connection has a deadline. Start it when
/// [`Registry::claim_sweeper`] returns true.
pub async fn sweep(reg: &RefCell<Registry>, now_ms: impl Fn() -> u64) {
    let sleep = tokio::time::sleep(Duration::ZERO);
    tokio::pin!(sleep);
    loop {
        let now = now_ms();
        let at = {
            let mut r = reg.borrow_mut();
            let Some(next) = r.expire(now) else {
                r.sweeper = Sweeper::default();
                return;
            };
            let at = next.max(now + SWEEP_MS);
            r.sweeper.planned_ms = at;
            r.sweeper.poked = false;
            at
        };
        sleep
            .as_mut()
            .reset(tokio::time::Instant::now() + Duration::from_millis(at - now));
        poll_fn(|cx| {
            let mut r = reg.borrow_mut();
            if r.sweeper.poked || sleep.as_mut().poll(cx).is_ready() {
                return Poll::Ready(());
            }
            if !r
                .sweeper
                .waker
                .as_ref()
                .is_some_and(|w| w.will_wake(cx.waker()))
            {
                r.sweeper.waker = Some(cx.waker().clone());
            }
            Poll::Pending
        })
        .await;
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

    #[test]
    fn tagged_eviction_picks_only_its_tag() {
        let reg = RefCell::new(Registry::default());
        let head = Waiting::enter(&reg, 0);
        let a = Waiting::enter_tagged(&reg, 100, 7);
        let b = Waiting::enter_tagged(&reg, 50, 7);
        let other = Waiting::enter_tagged(&reg, 10, 8);
        assert!(reg.borrow_mut().evict_oldest_tagged(7, 1000, MIN_AGE_MS));
        assert!(b.is_evicted() && !a.is_evicted() && !head.is_evicted() && !other.is_evicted());
        assert!(reg.borrow_mut().evict_oldest_tagged(7, 1000, MIN_AGE_MS));
        assert!(!reg.borrow_mut().evict_oldest_tagged(7, 1000, MIN_AGE_MS));
        assert!(!reg.borrow_mut().evict_oldest_tagged(9, 1000, MIN_AGE_MS));
        // The untagged eviction still takes the oldest of all.
        assert!(reg.borrow_mut().evict_oldest(1000, MIN_AGE_MS));
        assert!(head.is_evicted() && !other.is_evicted());
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

    /// The sweeper evicts entries whose deadline passed (never before),
    /// is woken when an earlier deadline enters, and exits when no entry
    /// has a deadline. Waits on conditions, with generous bounds.
    #[tokio::test]
    async fn the_sweeper_evicts_at_deadlines_and_exits_when_none_is_left() {
        use std::rc::Rc;
        let t0 = std::time::Instant::now();
        let clock = move || t0.elapsed().as_millis() as u64;
        let reg = Rc::new(RefCell::new(Registry::default()));
        let local = tokio::task::LocalSet::new();
        local
            .run_until(async {
                let a = Waiting::enter_until(&reg, clock(), clock() + 600_000);
                let no_deadline = Waiting::enter(&reg, clock());
                assert!(reg.borrow_mut().claim_sweeper());
                assert!(!reg.borrow_mut().claim_sweeper(), "one sweeper at a time");
                let r2 = reg.clone();
                let sweeper = tokio::task::spawn_local(async move { sweep(&r2, clock).await });
                tokio::task::yield_now().await;
                // An earlier deadline than the planned one wakes it.
                let deadline = clock() + 50;
                let b = Waiting::enter_until(&reg, clock(), deadline);
                tokio::time::timeout(Duration::from_secs(30), b.evicted())
                    .await
                    .expect("evicted at its deadline");
                assert!(clock() >= deadline, "not before its deadline");
                assert!(!a.is_evicted() && !no_deadline.is_evicted());
                drop((a, b));
                // The last entry with a deadline goes: the sweeper exits
                // after its scan and may be claimed again.
                let c = Waiting::enter_until(&reg, clock(), clock() + 20);
                tokio::time::timeout(Duration::from_secs(30), sweeper)
                    .await
                    .expect("the sweeper exits")
                    .unwrap();
                assert!(c.is_evicted() && !no_deadline.is_evicted());
                assert!(reg.borrow_mut().claim_sweeper());
                assert_eq!(reg.borrow().waiting(), 1);
            })
            .await;
    }

    fn futures_poll_once<F: std::future::Future>(f: std::pin::Pin<&mut F>) -> Poll<F::Output> {
        let mut cx = std::task::Context::from_waker(Waker::noop());
        f.poll(&mut cx)
    }
}
