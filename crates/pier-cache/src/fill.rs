//! A fill in flight, shared by its leader and its followers: the leader
//! publishes the response head and the body pieces as they come from the
//! origin; followers stream them as they arrive (readers follow the
//! writer) instead of waiting for the whole object.
//!
//! Memory: a fill keeps at most the zone's `max_object` bytes, and all fills
//! of the process together at most [`set_budget`] bytes; a fill that would
//! go past either stops keeping (it is not stored, and followers that were
//! streaming it are cut: they cannot get the rest).

use bytes::Bytes;
use parking_lot::Mutex;
use pier_http::Headers;
use smallvec::SmallVec;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;

/// Bytes held by all fills in flight, and their bound.
static IN_FLIGHT: AtomicUsize = AtomicUsize::new(0);
static BUDGET: AtomicUsize = AtomicUsize::new(256 << 20);

/// Bound the bytes all fills in flight may hold together (the sum of the
/// zones' memory is a natural choice: a fill becomes a stored object).
pub fn set_budget(bytes: usize) {
    BUDGET.store(bytes.max(1 << 20), Relaxed);
}

/// Bytes held by fills in flight now.
pub fn in_flight_bytes() -> usize {
    IN_FLIGHT.load(Relaxed)
}

/// The head of a response being filled, as it will be stored.
#[derive(Debug, Clone)]
pub struct FillHead {
    pub status: u16,
    /// Stored fields (hop-by-hop ones gone).
    pub headers: Headers,
    /// The origin's Content-Length, when it sent one.
    pub length: Option<u64>,
    /// The leader's request values of the fields the response's Vary
    /// names (`vary_of`): a follower streams the fill only when its own
    /// request selects the response under that Vary (RFC 9111 §4.1). The
    /// stored object takes them over.
    pub vary: crate::VaryValues,
}

#[derive(Default)]
struct State {
    /// Held here, not shared: a follower takes its own copy (most fills
    /// have none, and a shared head would cost every miss an allocation).
    head: Option<FillHead>,
    /// A follower took the head: it reads `chunks` by index until the end,
    /// so `finish` must leave them in place.
    followed: bool,
    /// One piece inline: a small body is one read, and needs no vector.
    chunks: SmallVec<[Bytes; 1]>,
    held: usize,
    /// Set once: the body is complete (true) or will never be (false).
    end: Option<bool>,
    /// The leader found the answer unfit for followers (uncacheable, a
    /// revalidation): they look again instead of streaming it.
    pass: bool,
}

/// One fill's shared state.
pub struct FillBuf {
    state: Mutex<State>,
    /// Bumped at every change; followers wait on it. Made by the first
    /// follower: most fills have none, and the channel is the costliest
    /// part of a fill to make and to drop.
    tx: std::sync::OnceLock<watch::Sender<u64>>,
    max: usize,
    /// The key filled (empty for a private fill): the zone's table of
    /// fills finds entries by it; the stored entry shares it.
    key: Arc<[u8]>,
}

/// What a follower found when the head was due.
pub enum HeadWait {
    /// Stream the body from here (the follower's copy of the head).
    Head(Box<FillHead>),
    /// Look again (the fill ended, or its answer is not for followers).
    Again,
    /// Nothing within the limit.
    Timeout,
}

/// The next piece for a reader at `index`.
pub enum Piece {
    Data(Bytes),
    /// Nothing yet: wait for a change.
    Wait,
    End,
    /// The fill stopped before the end.
    Cut,
}

impl FillBuf {
    /// A fill keeping at most `max` bytes.
    pub fn new(max: usize) -> Arc<FillBuf> {
        Self::keyed(Arc::from(&[][..]), max)
    }

    /// A fill of `key` keeping at most `max` bytes.
    pub fn keyed(key: Arc<[u8]>, max: usize) -> Arc<FillBuf> {
        Arc::new(FillBuf {
            state: Mutex::new(State::default()),
            tx: std::sync::OnceLock::new(),
            max,
            key,
        })
    }

    /// The key filled.
    pub fn key(&self) -> &[u8] {
        &self.key
    }

    /// Wake the followers. Skipped when none is subscribed (the usual
    /// miss): a reader subscribes before it looks at the state, and the
    /// state is changed (under its lock) before this runs, so a reader
    /// that subscribes later sees the change itself.
    fn changed(&self) {
        if let Some(tx) = self.tx.get().filter(|tx| tx.receiver_count() > 0) {
            tx.send_modify(|v| *v = v.wrapping_add(1));
        }
    }

    /// The leader: the response will be stored; followers may stream it.
    pub fn publish_head(&self, head: FillHead) {
        self.state.lock().head = Some(head);
        self.changed();
    }

    /// The leader: followers should not stream this answer (they look
    /// again: hit-for-miss, a refreshed object, or a fill of their own).
    pub fn pass(&self) {
        self.state.lock().pass = true;
        self.changed();
    }

    /// The leader: one more piece of the body. False when it cannot be
    /// kept (over `max` or the process budget): the fill is then cut.
    pub fn push(&self, data: &[u8]) -> bool {
        let mut s = self.state.lock();
        if s.end.is_some() {
            return false;
        }
        let n = data.len();
        let budget = BUDGET.load(Relaxed);
        if s.held + n > self.max || IN_FLIGHT.fetch_add(n, Relaxed) + n > budget {
            if s.held + n <= self.max {
                IN_FLIGHT.fetch_sub(n, Relaxed);
            }
            Self::release(&mut s);
            s.end = Some(false);
            drop(s);
            self.changed();
            return false;
        }
        s.held += n;
        // A spare buffer an eviction left, when one fits (`recycle`).
        s.chunks.push(crate::recycle::body_copy(data));
        drop(s);
        self.changed();
        true
    }

    fn release(s: &mut State) {
        IN_FLIGHT.fetch_sub(s.held, Relaxed);
        s.held = 0;
        s.chunks = SmallVec::new();
    }

    /// The leader: the body is complete; the body in one piece and the
    /// published head (the caller stores them). Followers still reading
    /// go on reading the pieces by index; when none took the head (they
    /// take it only under the lock, and none can once it is taken here), a
    /// one-piece body is handed over rather than copied.
    pub fn finish(&self) -> (Bytes, Option<FillHead>) {
        let mut s = self.state.lock();
        if s.end.is_some() {
            return (Bytes::new(), None);
        }
        s.end = Some(true);
        let head = s.head.take();
        let body = match s.chunks.len() {
            0 => Bytes::new(),
            1 if !s.followed => s.chunks.pop().unwrap_or_default(),
            1 => s.chunks[0].clone(),
            _ => Bytes::from(s.chunks.concat()),
        };
        drop(s);
        self.changed();
        (body, head)
    }

    /// The fill ended without completing (the leader went away).
    pub fn close(&self) {
        let mut s = self.state.lock();
        if s.end.is_none() {
            s.end = Some(false);
        }
        drop(s);
        self.changed();
    }

    /// Whether the leader stopped keeping the body.
    pub fn cut(&self) -> bool {
        self.state.lock().end == Some(false)
    }

    /// A follower: wait up to `limit` for the head.
    pub async fn wait_head(&self, limit: Duration) -> HeadWait {
        let mut rx = self.subscribe();
        let r = tokio::time::timeout(limit, async {
            loop {
                {
                    let mut s = self.state.lock();
                    if s.pass || s.end == Some(false) {
                        return HeadWait::Again;
                    }
                    // Marked under the same lock as the copy: `finish`
                    // then leaves the pieces for this reader.
                    if let Some(h) = s.head.as_ref().map(|h| Box::new(h.clone())) {
                        s.followed = true;
                        return HeadWait::Head(h);
                    }
                    if s.end.is_some() {
                        return HeadWait::Again;
                    }
                }
                if rx.changed().await.is_err() {
                    return HeadWait::Again;
                }
            }
        })
        .await;
        r.unwrap_or(HeadWait::Timeout)
    }

    /// A follower: wait up to `limit` for the fill to end. False: timed out.
    pub async fn wait_end(&self, limit: Duration) -> bool {
        let mut rx = self.subscribe();
        tokio::time::timeout(limit, async {
            loop {
                {
                    let s = self.state.lock();
                    if s.end.is_some() || s.pass {
                        return;
                    }
                }
                if rx.changed().await.is_err() {
                    return;
                }
            }
        })
        .await
        .is_ok()
    }

    /// A reader's piece number `index`.
    pub fn piece(&self, index: usize) -> Piece {
        let s = self.state.lock();
        if s.end == Some(false) {
            return Piece::Cut;
        }
        match s.chunks.get(index) {
            Some(b) => Piece::Data(b.clone()),
            None if s.end == Some(true) => Piece::End,
            None => Piece::Wait,
        }
    }

    /// Wakes when anything changes (for a reader that got `Piece::Wait`).
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.tx.get_or_init(|| watch::channel(0).0).subscribe()
    }
}

impl Drop for FillBuf {
    fn drop(&mut self) {
        Self::release(&mut self.state.lock());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn followers_stream_what_the_leader_pushes() {
        let f = FillBuf::new(100);
        let f2 = f.clone();
        let reader = tokio::spawn(async move {
            let HeadWait::Head(h) = f2.wait_head(Duration::from_secs(5)).await else {
                panic!("head")
            };
            assert_eq!(h.status, 200);
            let mut rx = f2.subscribe();
            let mut got = Vec::new();
            let mut i = 0;
            loop {
                match f2.piece(i) {
                    Piece::Data(b) => {
                        got.extend_from_slice(&b);
                        i += 1;
                    }
                    Piece::Wait => {
                        rx.changed().await.unwrap();
                    }
                    Piece::End => return got,
                    Piece::Cut => panic!("cut"),
                }
            }
        });
        f.publish_head(FillHead {
            status: 200,
            headers: Headers::default(),
            length: None,
            vary: Vec::new(),
        });
        for p in [&b"ab"[..], b"cd", b"e"] {
            assert!(f.push(p));
            tokio::task::yield_now().await;
        }
        assert_eq!(&f.finish().0[..], b"abcde");
        assert_eq!(reader.await.unwrap(), b"abcde");
        // A one-piece body finished before a follower read it: the piece
        // stays for the follower (it holds a copy of the head, and reads
        // pieces by index), and the leader gets the same bytes.
        let one = FillBuf::new(100);
        one.publish_head(FillHead {
            status: 200,
            headers: Headers::default(),
            length: Some(3),
            vary: Vec::new(),
        });
        let HeadWait::Head(h) = one.wait_head(Duration::from_secs(5)).await else {
            panic!("head")
        };
        assert_eq!(h.length, Some(3));
        assert!(one.push(b"xyz"));
        let (body, head) = one.finish();
        assert_eq!(&body[..], b"xyz");
        assert!(head.is_some());
        assert!(matches!(one.piece(0), Piece::Data(b) if &b[..] == b"xyz"));
        assert!(matches!(one.piece(1), Piece::End));
        // Without a follower the piece is handed over, not kept twice.
        let solo = FillBuf::new(100);
        solo.publish_head(FillHead {
            status: 200,
            headers: Headers::default(),
            length: None,
            vary: Vec::new(),
        });
        assert!(solo.push(b"xyz"));
        assert_eq!(&solo.finish().0[..], b"xyz");
        assert!(matches!(solo.piece(0), Piece::End));
        drop(solo);
        drop(one);
        // Past `max`: cut, nothing held.
        let g = FillBuf::new(4);
        assert!(g.push(b"abc"));
        assert!(!g.push(b"de"));
        assert!(g.cut());
        assert!(matches!(g.piece(0), Piece::Cut));
        drop(g);
        drop(f);
        assert_eq!(in_flight_bytes(), 0);
    }
}
