//! The disk tier: one file per stored variant under `disk_dir`, bounded in
//! bytes, its index in memory (rebuilt from the files' headers at start),
//! every file checksummed (a torn or corrupt file is dropped and counted).
//!
//! No worker thread ever touches the disk: writes go to one writer thread,
//! reads to a few reader threads, over bounded queues. A full write queue
//! skips the write (counted); a full read queue makes the lookup a miss.
//! A write that fails for lack of space pauses writes for a while (the zone
//! is memory-only meanwhile, counted); the client never sees it.
//!
//! Files are named `XX/<id>.<gen>` (`id` a stable hash of key and Vary
//! values, `gen` unique per write), so a file is never rewritten in place
//! and an unlink can only ever remove the version it was meant for.
//!
//! File layout (little-endian): magic `PIERC001`, meta length u32, body
//! length u64, CRC-32 of the meta, CRC-32 of the body, the meta (key,
//! status, times, validators, Vary values, fields), the body.

use crate::{Object, Stats};
use bytes::Bytes;
use parking_lot::Mutex;
use pier_http::{known, Headers};
use std::collections::{HashMap, VecDeque};
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::mpsc::{sync_channel, Receiver, RecvTimeoutError, SyncSender, TrySendError};
use std::sync::Arc;
use std::time::Duration;

const MAGIC: &[u8; 8] = b"PIERC001";
const PREFIX: usize = 28;
/// Larger metas are taken as corruption (fields are bounded far below).
const MAX_META: usize = 4 << 20;
/// How long writes pause after the filesystem said it is full.
const FULL_PAUSE_SECS: u64 = 10;
const READERS: usize = 2;

/// `[cache.NAME]` disk settings.
#[derive(Debug, Clone, PartialEq)]
pub struct DiskConfig {
    pub dir: PathBuf,
    /// Bytes on disk (files rounded up to 4 KiB blocks).
    pub max_bytes: u64,
    /// Hits in memory before an object is written to disk (0: every store).
    pub promote_hits: u32,
    /// Objects with less freshness left than this (seconds) stay in memory.
    pub min_ttl: u64,
    /// Writes and reads waiting for the I/O threads, each.
    pub queue: usize,
}

/// A stable 64-bit hash (FNV-1a): file names must survive restarts and
/// upgrades, which a seeded or versioned hash does not promise.
fn fnv(h: &mut u64, data: &[u8]) {
    for &b in data {
        *h ^= b as u64;
        *h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
}

pub(crate) fn key_hash(key: &[u8]) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325;
    fnv(&mut h, key);
    h
}

/// The file id of one variant of `key`.
pub(crate) fn file_id(key: &[u8], vary: &[(Vec<u8>, Option<Vec<u8>>)]) -> u64 {
    let mut h = key_hash(key);
    for (n, v) in vary {
        fnv(&mut h, &[0]);
        fnv(&mut h, n);
        match v {
            Some(v) => {
                fnv(&mut h, &[1]);
                fnv(&mut h, v);
            }
            None => fnv(&mut h, &[2]),
        }
    }
    h
}

struct FileMeta {
    gen: u64,
    key_hash: u64,
    key: Box<[u8]>,
    /// Bytes it takes on disk (rounded to blocks).
    size: u64,
    /// Read since the clock hand last passed (second chance).
    referenced: bool,
}

#[derive(Default)]
struct Index {
    files: HashMap<u64, FileMeta, foldhash::fast::RandomState>,
    by_key: HashMap<u64, Vec<u64>, foldhash::fast::RandomState>,
    /// CLOCK order of (id, gen); stale items skipped.
    clock: VecDeque<(u64, u64)>,
    /// Writes queued: id → (gen, key hash); a write whose entry is gone
    /// (invalidated or replaced meanwhile) is unlinked when it lands.
    pending: HashMap<u64, (u64, u64), foldhash::fast::RandomState>,
    /// Files to unlink (the writer drains it).
    unlink: Vec<(u64, u64)>,
    bytes: u64,
    next_gen: u64,
    /// Unix seconds until which writes are skipped (the disk was full).
    full_until: u64,
    /// Bytes held by queued writes.
    queued_bytes: usize,
    /// Variants kept per key (0: the default); a lookup reads them in turn.
    max_variants: usize,
}

impl Index {
    fn remove(&mut self, id: u64) -> bool {
        let Some(m) = self.files.remove(&id) else {
            return false;
        };
        self.bytes -= m.size;
        if let Some(ids) = self.by_key.get_mut(&m.key_hash) {
            ids.retain(|&i| i != id);
            if ids.is_empty() {
                self.by_key.remove(&m.key_hash);
            }
        }
        self.unlink.push((id, m.gen));
        if self.clock.len() > 2 * self.files.len() + 1024 {
            let files = &self.files;
            self.clock
                .retain(|(i, g)| files.get(i).is_some_and(|m| m.gen == *g));
        }
        true
    }

    fn add(&mut self, id: u64, meta: FileMeta) {
        self.remove(id);
        let max = match self.max_variants {
            0 => crate::memory::DEFAULT_MAX_VARIANTS,
            n => n,
        };
        // Full: the oldest variants of the key make room.
        loop {
            let oldest = match self.by_key.get(&meta.key_hash) {
                Some(ids) if ids.len() >= max => ids[0],
                _ => break,
            };
            if !self.remove(oldest) {
                // Not a file (cannot happen): forget it rather than loop.
                if let Some(ids) = self.by_key.get_mut(&meta.key_hash) {
                    ids.retain(|&i| i != oldest);
                }
            }
        }
        self.bytes += meta.size;
        self.clock.push_back((id, meta.gen));
        self.by_key.entry(meta.key_hash).or_default().push(id);
        self.files.insert(id, meta);
    }

    /// Evict (CLOCK) until `bytes <= cap`; how many went.
    fn evict_to(&mut self, cap: u64) -> u64 {
        let mut n = 0;
        while self.bytes > cap {
            let Some((id, gen)) = self.clock.pop_front() else {
                break;
            };
            let Some(m) = self.files.get_mut(&id).filter(|m| m.gen == gen) else {
                continue;
            };
            if m.referenced {
                m.referenced = false;
                self.clock.push_back((id, gen));
                continue;
            }
            self.remove(id);
            n += 1;
        }
        n
    }
}

struct Shared {
    dir: PathBuf,
    cfg: DiskConfig,
    index: Mutex<Index>,
    stats: Arc<Stats>,
    /// The startup scan is over (lookups before it miss the disk).
    ready: std::sync::atomic::AtomicBool,
}

enum WriteJob {
    Write {
        id: u64,
        gen: u64,
        key: Box<[u8]>,
        obj: Arc<Object>,
    },
    /// Nothing to write: drain the unlink list now.
    Wake,
}

struct ReadJob {
    id: u64,
    gen: u64,
    reply: tokio::sync::oneshot::Sender<Option<(Box<[u8]>, Object)>>,
}

/// The disk tier of one zone.
pub(crate) struct Disk {
    shared: Arc<Shared>,
    writes: SyncSender<WriteJob>,
    reads: SyncSender<ReadJob>,
}

/// Disk counters (the zone's `Stats` holds them).
#[derive(Debug, Default)]
pub struct DiskStats {
    pub objects: AtomicU64,
    pub bytes: AtomicU64,
    pub promotions: AtomicU64,
    pub bytes_written: AtomicU64,
    pub writes: AtomicU64,
    /// Writes skipped: the queue was full.
    pub write_skipped_queue: AtomicU64,
    /// Writes skipped: the disk was full (memory-only meanwhile).
    pub write_skipped_full: AtomicU64,
    pub errors: AtomicU64,
    pub corrupt: AtomicU64,
    pub evicted: AtomicU64,
    pub hits: AtomicU64,
    /// Reads skipped: the queue was full (served as a miss).
    pub read_skipped: AtomicU64,
}

fn round_block(n: u64) -> u64 {
    n.div_ceil(4096) * 4096
}

fn path_of(dir: &Path, id: u64, gen: u64) -> PathBuf {
    dir.join(format!("{:02x}", id >> 56))
        .join(format!("{id:016x}.{gen:x}"))
}

impl Disk {
    pub fn open(cfg: DiskConfig, stats: Arc<Stats>) -> io::Result<Disk> {
        std::fs::create_dir_all(cfg.dir.join("tmp"))?;
        let queue = cfg.queue.max(1);
        let shared = Arc::new(Shared {
            dir: cfg.dir.clone(),
            cfg,
            index: Mutex::new(Index {
                next_gen: 1,
                ..Index::default()
            }),
            stats,
            ready: false.into(),
        });
        let (wtx, wrx) = sync_channel(queue);
        let (rtx, rrx) = sync_channel::<ReadJob>(queue);
        let s = shared.clone();
        std::thread::Builder::new()
            .name("pier-cache-disk-w".into())
            .spawn(move || writer(s, wrx))?;
        let rrx = Arc::new(std::sync::Mutex::new(rrx));
        for _ in 0..READERS {
            let (s, rrx) = (shared.clone(), rrx.clone());
            std::thread::Builder::new()
                .name("pier-cache-disk-r".into())
                .spawn(move || reader(s, rrx))?;
        }
        Ok(Disk {
            shared,
            writes: wtx,
            reads: rtx,
        })
    }

    pub fn config(&self) -> &DiskConfig {
        &self.shared.cfg
    }

    /// The startup scan is done.
    pub fn ready(&self) -> bool {
        self.shared.ready.load(Relaxed)
    }

    /// Queue `obj` for writing; false when it was not queued (full queue,
    /// full disk): the caller may try again on a later hit.
    pub fn write(&self, key: &[u8], obj: Arc<Object>, now: u64) -> bool {
        let st = &self.shared.stats.disk;
        let id = file_id(key, &obj.vary);
        let size = obj.size();
        let gen = {
            let mut ix = self.shared.index.lock();
            if ix.full_until > now {
                st.write_skipped_full.fetch_add(1, Relaxed);
                return false;
            }
            // Queued bodies are bounded in bytes as well as in number.
            if ix.queued_bytes + size > (self.shared.cfg.queue * 64 * 1024).max(64 << 20) {
                st.write_skipped_queue.fetch_add(1, Relaxed);
                return false;
            }
            let gen = ix.next_gen;
            ix.next_gen += 1;
            ix.pending.insert(id, (gen, key_hash(key)));
            ix.queued_bytes += size;
            gen
        };
        match self.writes.try_send(WriteJob::Write {
            id,
            gen,
            key: key.into(),
            obj,
        }) {
            Ok(()) => {
                st.promotions.fetch_add(1, Relaxed);
                true
            }
            Err(_) => {
                let mut ix = self.shared.index.lock();
                if ix.pending.get(&id).is_some_and(|p| p.0 == gen) {
                    ix.pending.remove(&id);
                }
                ix.queued_bytes -= size;
                st.write_skipped_queue.fetch_add(1, Relaxed);
                false
            }
        }
    }

    /// Drop the stored version of this variant (a newer one replaces it).
    pub fn remove_variant(&self, key: &[u8], vary: &[(Vec<u8>, Option<Vec<u8>>)]) {
        let id = file_id(key, vary);
        let mut ix = self.shared.index.lock();
        ix.pending.remove(&id);
        if ix.remove(id) {
            self.publish(&ix);
            drop(ix);
            let _ = self.writes.try_send(WriteJob::Wake);
        }
    }

    /// Drop every variant of `key`.
    pub fn remove_key(&self, key: &[u8]) -> bool {
        self.remove_where_hash(key_hash(key), |k| k == key) > 0
    }

    /// Drop every key for which `pred` holds; how many keys went.
    pub fn remove_where(&self, mut pred: impl FnMut(&[u8]) -> bool) -> usize {
        let mut ix = self.shared.index.lock();
        let ids: Vec<(u64, u64)> = ix
            .files
            .iter()
            .filter(|(_, m)| pred(&m.key))
            .map(|(id, m)| (*id, m.key_hash))
            .collect();
        let mut keys: Vec<u64> = ids.iter().map(|x| x.1).collect();
        keys.sort_unstable();
        keys.dedup();
        for (id, _) in &ids {
            ix.remove(*id);
        }
        ix.pending
            .retain(|_, (_, kh)| keys.binary_search(kh).is_err());
        self.publish(&ix);
        drop(ix);
        let _ = self.writes.try_send(WriteJob::Wake);
        keys.len()
    }

    fn remove_where_hash(&self, kh: u64, pred: impl Fn(&[u8]) -> bool) -> usize {
        let mut ix = self.shared.index.lock();
        let ids: Vec<u64> = ix
            .by_key
            .get(&kh)
            .map(|ids| {
                ids.iter()
                    .copied()
                    .filter(|id| ix.files.get(id).is_some_and(|m| pred(&m.key)))
                    .collect()
            })
            .unwrap_or_default();
        // Queued writes of the key are cancelled too.
        ix.pending.retain(|_, (_, h)| *h != kh);
        for id in &ids {
            ix.remove(*id);
        }
        self.publish(&ix);
        drop(ix);
        if !ids.is_empty() {
            let _ = self.writes.try_send(WriteJob::Wake);
        }
        ids.len()
    }

    /// Bound the variants kept per key (the oldest go as new ones land).
    pub fn set_max_variants(&self, n: usize) {
        self.shared.index.lock().max_variants = n;
    }

    fn publish(&self, ix: &Index) {
        let st = &self.shared.stats.disk;
        st.objects.store(ix.files.len() as u64, Relaxed);
        st.bytes.store(ix.bytes, Relaxed);
    }

    /// The variants of `key` on disk, read by the reader threads, the first
    /// one answering `req`. A corrupt file is dropped on the way.
    pub async fn lookup(&self, key: &[u8], req: &Headers) -> Option<Object> {
        let kh = key_hash(key);
        let cands: Vec<(u64, u64)> = {
            let mut ix = self.shared.index.lock();
            let ids = ix.by_key.get(&kh)?.clone();
            ids.iter()
                .filter_map(|id| {
                    let m = ix.files.get_mut(id)?;
                    if *m.key != *key {
                        return None;
                    }
                    m.referenced = true;
                    Some((*id, m.gen))
                })
                .collect()
        };
        for (id, gen) in cands {
            let (tx, rx) = tokio::sync::oneshot::channel();
            match self.reads.try_send(ReadJob { id, gen, reply: tx }) {
                Ok(()) => {}
                Err(TrySendError::Full(_)) | Err(TrySendError::Disconnected(_)) => {
                    self.shared.stats.disk.read_skipped.fetch_add(1, Relaxed);
                    return None;
                }
            }
            if let Ok(Some((k, obj))) = rx.await {
                if *k == *key && obj.matches(req) {
                    self.shared.stats.disk.hits.fetch_add(1, Relaxed);
                    return Some(obj);
                }
            }
        }
        None
    }
}

fn put_bytes(out: &mut Vec<u8>, b: &[u8]) {
    out.extend_from_slice(&(b.len() as u32).to_le_bytes());
    out.extend_from_slice(b);
}

/// The meta part of a file.
fn encode_meta(key: &[u8], o: &Object) -> Vec<u8> {
    let mut m = Vec::with_capacity(256 + key.len() + o.headers.capacity_bytes());
    put_bytes(&mut m, key);
    m.extend_from_slice(&o.status.to_le_bytes());
    for v in [
        o.lifetime,
        o.request_time,
        o.response_time,
        o.date,
        o.age_header,
    ] {
        m.extend_from_slice(&v.to_le_bytes());
    }
    // ETag and Last-Modified are in the fields too; they keep their
    // places in the format so that files of earlier runs still read.
    // Bit 0: an ETag follows; bit 1: the Last-Modified is synthetic.
    let flags = u8::from(o.etag().is_some()) | u8::from(o.synthetic_lm) << 1;
    m.push(flags);
    if let Some(e) = o.etag() {
        put_bytes(&mut m, e);
    }
    put_bytes(&mut m, o.last_modified());
    m.extend_from_slice(&(o.vary.len() as u32).to_le_bytes());
    for (n, v) in &o.vary {
        put_bytes(&mut m, n);
        match v {
            Some(v) => {
                m.push(1);
                put_bytes(&mut m, v);
            }
            None => m.push(0),
        }
    }
    m.extend_from_slice(&(o.headers.len() as u32).to_le_bytes());
    for (k, v) in o.headers.iter() {
        put_bytes(&mut m, k);
        put_bytes(&mut m, v);
    }
    m
}

struct Rd<'a>(&'a [u8]);

impl<'a> Rd<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        if self.0.len() < n {
            return None;
        }
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        Some(a)
    }
    fn u8(&mut self) -> Option<u8> {
        Some(self.take(1)?[0])
    }
    fn u16(&mut self) -> Option<u16> {
        Some(u16::from_le_bytes(self.take(2)?.try_into().ok()?))
    }
    fn u32(&mut self) -> Option<u32> {
        Some(u32::from_le_bytes(self.take(4)?.try_into().ok()?))
    }
    fn u64(&mut self) -> Option<u64> {
        Some(u64::from_le_bytes(self.take(8)?.try_into().ok()?))
    }
    fn bytes(&mut self) -> Option<&'a [u8]> {
        let n = self.u32()? as usize;
        self.take(n)
    }
    fn opt(&mut self) -> Option<Option<&'a [u8]>> {
        match self.u8()? {
            0 => Some(None),
            1 => Some(Some(self.bytes()?)),
            _ => None,
        }
    }
}

/// The key and the object of a meta (body empty); None: malformed.
fn decode_meta(meta: &[u8]) -> Option<(Box<[u8]>, Object)> {
    let mut r = Rd(meta);
    let key = r.bytes()?.into();
    let status = r.u16()?;
    let (lifetime, request_time, response_time, date, age_header) =
        (r.u64()?, r.u64()?, r.u64()?, r.u64()?, r.u64()?);
    // Nothing Pier writes is outside these (a status it stores, times and
    // lifetimes capped at 2^40 s): anything else is a tampered file.
    let sane = |t: u64| t <= 1 << 40;
    if !(100..=599).contains(&status)
        || ![lifetime, request_time, response_time, date, age_header]
            .into_iter()
            .all(sane)
    {
        return None;
    }
    let flags = r.u8()?;
    if flags > 3 {
        return None;
    }
    let etag = if flags & 1 != 0 {
        Some(r.bytes()?)
    } else {
        None
    };
    let mut synthetic_lm = flags & 2 != 0;
    let last_modified = r.bytes()?;
    let nv = r.u32()? as usize;
    let mut vary = Vec::with_capacity(nv.min(64));
    for _ in 0..nv {
        vary.push((r.bytes()?.to_vec(), r.opt()?.map(|v| v.to_vec())));
    }
    let nh = r.u32()? as usize;
    let mut headers = Headers::default();
    for _ in 0..nh {
        let (k, v) = (r.bytes()?, r.bytes()?);
        // What a client will be sent: a tampered file must not split a
        // response or overflow a field's bookkeeping.
        let name_ok = !k.is_empty()
            && k.len() <= usize::from(u16::MAX)
            && k.iter().all(|&c| c.is_ascii_graphic() && c != b':');
        if !name_ok || v.iter().any(|&c| matches!(c, b'\r' | b'\n' | 0)) {
            return None;
        }
        headers.append(k, v);
    }
    if !r.0.is_empty() {
        return None;
    }
    // Files written before the validators lived only in the fields.
    if let (Some(e), false) = (etag, headers.has_known(known::ETAG)) {
        headers.append(b"ETag", e);
    }
    if !last_modified.is_empty() && !headers.has_known(known::LAST_MODIFIED) {
        // Only a synthetic one was kept out of the fields.
        headers.append(b"Last-Modified", last_modified);
        synthetic_lm = true;
    }
    let cc = crate::policy::response_cc(&headers);
    Some((
        key,
        Object {
            status,
            headers,
            body: Bytes::new(),
            mapped: None,
            lifetime,
            request_time,
            response_time,
            date,
            age_header,
            cc,
            vary,
            synthetic_lm,
        },
    ))
}

/// The length a file with this prefix must have; None when the lengths a
/// tampered or torn prefix claims overflow (the file is then corrupt).
fn file_len(ml: usize, bl: u64) -> Option<u64> {
    u64::try_from(PREFIX.checked_add(ml)?).ok()?.checked_add(bl)
}

/// Prefix fields: (meta length, body length, meta CRC, body CRC).
fn parse_prefix(p: &[u8]) -> Option<(usize, u64, u32, u32)> {
    if p.len() < PREFIX || &p[..8] != MAGIC {
        return None;
    }
    let ml = u32::from_le_bytes(p[8..12].try_into().ok()?) as usize;
    let bl = u64::from_le_bytes(p[12..20].try_into().ok()?);
    let mc = u32::from_le_bytes(p[20..24].try_into().ok()?);
    let bc = u32::from_le_bytes(p[24..28].try_into().ok()?);
    (ml <= MAX_META).then_some((ml, bl, mc, bc))
}

fn write_file(shared: &Shared, id: u64, gen: u64, key: &[u8], obj: &Object) -> io::Result<u64> {
    let meta = encode_meta(key, obj);
    let mut prefix = Vec::with_capacity(PREFIX);
    prefix.extend_from_slice(MAGIC);
    prefix.extend_from_slice(&(meta.len() as u32).to_le_bytes());
    prefix.extend_from_slice(&(obj.body.len() as u64).to_le_bytes());
    prefix.extend_from_slice(&crc32fast::hash(&meta).to_le_bytes());
    prefix.extend_from_slice(&crc32fast::hash(&obj.body).to_le_bytes());
    let tmp = shared.dir.join("tmp").join(format!("{id:016x}.{gen:x}"));
    let fin = path_of(&shared.dir, id, gen);
    let res = (|| {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(&prefix)?;
        f.write_all(&meta)?;
        f.write_all(&obj.body)?;
        drop(f);
        if let Some(parent) = fin.parent() {
            std::fs::create_dir_all(parent)?;
        }
        std::fs::rename(&tmp, &fin)
    })();
    if res.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    res.map(|()| (PREFIX + meta.len()) as u64 + obj.body.len() as u64)
}

fn writer(s: Arc<Shared>, rx: Receiver<WriteJob>) {
    scan(&s);
    s.ready.store(true, Relaxed);
    let st = &s.stats.disk;
    loop {
        let job = rx.recv_timeout(Duration::from_millis(200));
        let unlink = std::mem::take(&mut s.index.lock().unlink);
        for (id, gen) in unlink {
            let _ = std::fs::remove_file(path_of(&s.dir, id, gen));
        }
        let (id, gen, key, obj) = match job {
            Ok(WriteJob::Write { id, gen, key, obj }) => (id, gen, key, obj),
            Ok(WriteJob::Wake) | Err(RecvTimeoutError::Timeout) => continue,
            Err(RecvTimeoutError::Disconnected) => return,
        };
        let res = write_file(&s, id, gen, &key, &obj);
        let mut ix = s.index.lock();
        ix.queued_bytes -= obj.size();
        match res {
            Ok(len) => {
                st.writes.fetch_add(1, Relaxed);
                st.bytes_written.fetch_add(len, Relaxed);
                if ix.pending.get(&id).is_some_and(|p| p.0 == gen) {
                    ix.pending.remove(&id);
                    ix.add(
                        id,
                        FileMeta {
                            gen,
                            key_hash: key_hash(&key),
                            key,
                            size: round_block(len),
                            referenced: false,
                        },
                    );
                    let n = ix.evict_to(s.cfg.max_bytes);
                    st.evicted.fetch_add(n, Relaxed);
                } else {
                    // Invalidated or replaced while queued.
                    ix.unlink.push((id, gen));
                }
            }
            Err(e) => {
                if ix.pending.get(&id).is_some_and(|p| p.0 == gen) {
                    ix.pending.remove(&id);
                }
                st.errors.fetch_add(1, Relaxed);
                if e.raw_os_error() == Some(28) || e.kind() == io::ErrorKind::StorageFull {
                    // ENOSPC: memory-only for a while; what is on disk stays.
                    ix.full_until = crate::now() + FULL_PAUSE_SECS;
                }
            }
        }
        st.objects.store(ix.files.len() as u64, Relaxed);
        st.bytes.store(ix.bytes, Relaxed);
    }
}

/// Rebuild the index from the files' prefixes and metas (bodies are
/// checked when read). Torn files (wrong length) and bad metas go.
fn scan(s: &Shared) {
    use std::io::Read;
    let st = &s.stats.disk;
    if let Ok(rd) = std::fs::read_dir(s.dir.join("tmp")) {
        for e in rd.flatten() {
            let _ = std::fs::remove_file(e.path());
        }
    }
    let Ok(top) = std::fs::read_dir(&s.dir) else {
        return;
    };
    for sub in top.flatten() {
        let name = sub.file_name();
        let Some(name) = name.to_str() else { continue };
        if name.len() != 2 || u8::from_str_radix(name, 16).is_err() {
            continue;
        }
        let Ok(files) = std::fs::read_dir(sub.path()) else {
            continue;
        };
        for f in files.flatten() {
            let path = f.path();
            let parsed = f.file_name().to_str().and_then(|n| {
                let (id, gen) = n.split_once('.')?;
                Some((
                    u64::from_str_radix(id, 16).ok()?,
                    u64::from_str_radix(gen, 16).ok()?,
                ))
            });
            let Some((id, gen)) = parsed else { continue };
            let read = (|| -> Option<(Box<[u8]>, u64)> {
                let mut file = std::fs::File::open(&path).ok()?;
                let len = file.metadata().ok()?.len();
                let mut p = [0u8; PREFIX];
                file.read_exact(&mut p).ok()?;
                let (ml, bl, mc, _) = parse_prefix(&p)?;
                if file_len(ml, bl) != Some(len) {
                    return None;
                }
                let mut meta = vec![0; ml];
                file.read_exact(&mut meta).ok()?;
                if crc32fast::hash(&meta) != mc {
                    return None;
                }
                let (key, obj) = decode_meta(&meta)?;
                (file_id(&key, &obj.vary) == id).then_some((key, len))
            })();
            let mut ix = s.index.lock();
            ix.next_gen = ix.next_gen.max(gen + 1);
            match read {
                Some((key, len)) => {
                    // Two versions of one variant (a crash between writes):
                    // the newer stays.
                    if ix.files.get(&id).is_some_and(|m| m.gen > gen) {
                        drop(ix);
                        let _ = std::fs::remove_file(&path);
                        continue;
                    }
                    ix.add(
                        id,
                        FileMeta {
                            gen,
                            key_hash: key_hash(&key),
                            key,
                            size: round_block(len),
                            referenced: false,
                        },
                    );
                }
                None => {
                    st.corrupt.fetch_add(1, Relaxed);
                    drop(ix);
                    let _ = std::fs::remove_file(&path);
                }
            }
        }
    }
    let mut ix = s.index.lock();
    let n = ix.evict_to(s.cfg.max_bytes);
    st.evicted.fetch_add(n, Relaxed);
    // Versions replaced during the scan were queued for unlinking.
    let unlink = std::mem::take(&mut ix.unlink);
    st.objects.store(ix.files.len() as u64, Relaxed);
    st.bytes.store(ix.bytes, Relaxed);
    drop(ix);
    for (id, gen) in unlink {
        let _ = std::fs::remove_file(path_of(&s.dir, id, gen));
    }
}

fn reader(s: Arc<Shared>, rx: Arc<std::sync::Mutex<Receiver<ReadJob>>>) {
    loop {
        let job = match rx.lock() {
            Ok(r) => r.recv(),
            Err(_) => return,
        };
        let Ok(job) = job else { return };
        let path = path_of(&s.dir, job.id, job.gen);
        let res = match std::fs::read(&path) {
            Ok(data) => match decode_file(data) {
                Some(x) => Some(x),
                None => {
                    // Torn or corrupt: dropped, counted; a miss.
                    s.stats.disk.corrupt.fetch_add(1, Relaxed);
                    drop_file(&s, job.id, job.gen);
                    None
                }
            },
            Err(_) => {
                s.stats.disk.errors.fetch_add(1, Relaxed);
                drop_file(&s, job.id, job.gen);
                None
            }
        };
        let _ = job.reply.send(res);
    }
}

fn drop_file(s: &Shared, id: u64, gen: u64) {
    let mut ix = s.index.lock();
    if ix.files.get(&id).is_some_and(|m| m.gen == gen) {
        ix.remove(id);
    }
    s.stats.disk.objects.store(ix.files.len() as u64, Relaxed);
    s.stats.disk.bytes.store(ix.bytes, Relaxed);
    drop(ix);
    // Gone at once (this is an I/O thread); the writer's later unlink of
    // the same name finds nothing.
    let _ = std::fs::remove_file(path_of(&s.dir, id, gen));
}

/// A whole file, checked; the body shares the read buffer.
fn decode_file(data: Vec<u8>) -> Option<(Box<[u8]>, Object)> {
    let (ml, bl, mc, bc) = parse_prefix(&data)?;
    if file_len(ml, bl) != u64::try_from(data.len()).ok() {
        return None;
    }
    // In bounds: the length check above holds.
    let start = PREFIX.checked_add(ml)?;
    let meta = data.get(PREFIX..start)?;
    if crc32fast::hash(meta) != mc || crc32fast::hash(data.get(start..)?) != bc {
        return None;
    }
    let (key, mut obj) = decode_meta(meta)?;
    obj.body = if bl == 0 {
        Bytes::new()
    } else if start.saturating_mul(8) > data.len() {
        // A small body: copied, so the meta is not kept alive with it.
        Bytes::copy_from_slice(&data[start..])
    } else {
        Bytes::from(data).slice(start..)
    };
    Some((key, obj))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Zone;
    use std::time::Instant;

    struct TempDir(PathBuf);
    impl TempDir {
        fn new(tag: &str) -> TempDir {
            static N: AtomicU64 = AtomicU64::new(0);
            let p = std::env::temp_dir().join(format!(
                "pier-cache-{tag}-{}-{}",
                std::process::id(),
                N.fetch_add(1, Relaxed)
            ));
            let _ = std::fs::remove_dir_all(&p);
            TempDir(p)
        }
    }
    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn cfg(dir: &Path, max_bytes: u64, promote_hits: u32) -> DiskConfig {
        DiskConfig {
            dir: dir.to_path_buf(),
            max_bytes,
            promote_hits,
            min_ttl: 30,
            queue: 64,
        }
    }

    fn obj(body: &[u8], lifetime: u64) -> Object {
        let now = crate::now();
        let mut headers = Headers::default();
        headers.append(b"Content-Type", b"text/plain");
        headers.append(b"Cache-Control", b"max-age=600");
        headers.append(b"ETag", b"\"e1\"");
        headers.append(b"Last-Modified", b"Wed, 25 Nov 2026 00:00:00 GMT");
        Object {
            status: 200,
            headers,
            body: Bytes::copy_from_slice(body),
            mapped: None,
            lifetime,
            request_time: now,
            response_time: now,
            date: now,
            age_header: 0,
            cc: crate::policy::CacheControl::default(),
            vary: Vec::new(),
            synthetic_lm: false,
        }
    }

    fn wait(what: &str, f: impl Fn() -> bool) {
        let t = Instant::now();
        while !f() {
            assert!(t.elapsed() < Duration::from_secs(20), "timed out: {what}");
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    fn files(dir: &Path) -> Vec<PathBuf> {
        let mut out = Vec::new();
        for sub in std::fs::read_dir(dir).unwrap().flatten() {
            if sub.file_name() == "tmp" {
                continue;
            }
            for f in std::fs::read_dir(sub.path()).unwrap().flatten() {
                out.push(f.path());
            }
        }
        out
    }

    #[tokio::test(flavor = "current_thread")]
    async fn promoted_after_hits_and_kept_across_a_restart() {
        let d = TempDir::new("restart");
        let h = Headers::default();
        let z = Zone::open("t", 1 << 20, 1 << 19, Some(cfg(&d.0, 1 << 20, 2))).unwrap();
        wait("scan", || z.disk_ready());
        z.insert(b"k".to_vec(), obj(b"hello disk", 600));
        z.insert(b"short".to_vec(), obj(b"too short", 10));
        // One hit: memory only; the second promotes.
        assert!(z.lookup(b"k", &h).is_some());
        assert_eq!(z.stats.disk.promotions.load(Relaxed), 0);
        assert!(z.lookup(b"k", &h).is_some());
        assert!(z.lookup(b"k", &h).is_some());
        // Too little freshness left: never to disk, however hot.
        for _ in 0..5 {
            assert!(z.lookup(b"short", &h).is_some());
        }
        wait("write", || z.stats.disk.writes.load(Relaxed) == 1);
        assert_eq!(z.stats.disk.promotions.load(Relaxed), 1);
        assert_eq!(files(&d.0).len(), 1);
        drop(z);
        // A new zone on the same directory: the index is rebuilt.
        let z = Zone::open("t", 1 << 20, 1 << 19, Some(cfg(&d.0, 1 << 20, 2))).unwrap();
        wait("scan", || z.disk_ready());
        assert_eq!(z.tiers().1, Some((1, 4096)));
        assert!(z.lookup(b"k", &h).is_none(), "memory is empty");
        let o = z.get(b"k", &h).await.expect("a disk hit");
        assert_eq!(&o.body[..], b"hello disk");
        assert_eq!(o.etag(), Some(&b"\"e1\""[..]));
        assert_eq!(o.last_modified(), b"Wed, 25 Nov 2026 00:00:00 GMT");
        assert_eq!(o.headers.get(b"content-type"), Some(&b"text/plain"[..]));
        assert_eq!(o.cc.max_age, Some(600));
        assert_eq!(z.stats.disk.hits.load(Relaxed), 1);
        // Now in memory again; not written twice.
        assert!(z.lookup(b"k", &h).is_some());
        assert!(z.lookup(b"k", &h).is_some());
        assert_eq!(z.stats.disk.promotions.load(Relaxed), 0);
        // Invalidation reaches the disk.
        assert!(z.invalidate(b"k"));
        assert!(z.get(b"k", &h).await.is_none());
        wait("unlink", || files(&d.0).is_empty());
    }

    #[tokio::test(flavor = "current_thread")]
    async fn corrupt_and_torn_files_are_dropped() {
        let d = TempDir::new("corrupt");
        let h = Headers::default();
        let z = Zone::open("t", 1 << 20, 1 << 19, Some(cfg(&d.0, 1 << 20, 0))).unwrap();
        wait("scan", || z.disk_ready());
        // promote_hits = 0: written at once.
        z.insert(b"a".to_vec(), obj(&[b'a'; 5000], 600));
        z.insert(b"b".to_vec(), obj(&[b'b'; 5000], 600));
        wait("writes", || z.stats.disk.writes.load(Relaxed) == 2);
        drop(z);
        let path_a = path_of(&d.0, file_id(b"a", &[]), 1);
        let path_b = path_of(&d.0, file_id(b"b", &[]), 2);
        // a: a flipped byte in the body (caught when read);
        // b: torn (caught at the scan).
        let mut data = std::fs::read(&path_a).unwrap();
        let n = data.len();
        data[n - 10] ^= 0xff;
        std::fs::write(&path_a, data).unwrap();
        let data = std::fs::read(&path_b).unwrap();
        std::fs::write(&path_b, &data[..data.len() - 100]).unwrap();
        let z = Zone::open("t", 1 << 20, 1 << 19, Some(cfg(&d.0, 1 << 20, 0))).unwrap();
        wait("scan", || z.disk_ready());
        assert_eq!(z.stats.disk.corrupt.load(Relaxed), 1, "the torn one");
        assert_eq!(z.tiers().1.unwrap().0, 1);
        assert!(z.get(b"a", &h).await.is_none(), "a corrupt body is a miss");
        assert_eq!(z.stats.disk.corrupt.load(Relaxed), 2);
        assert_eq!(z.tiers().1, Some((0, 0)));
        assert!(files(&d.0).is_empty());
    }

    #[tokio::test(flavor = "current_thread")]
    async fn bounded_in_bytes_and_errors_never_reach_the_caller() {
        let d = TempDir::new("bound");
        let z = Zone::open("t", 4 << 20, 1 << 20, Some(cfg(&d.0, 64 * 1024, 0))).unwrap();
        wait("scan", || z.disk_ready());
        for i in 0..40 {
            z.insert(format!("k{i}").into_bytes(), obj(&[b'x'; 6000], 600));
        }
        wait("writes", || {
            let st = &z.stats.disk;
            st.writes.load(Relaxed) + st.write_skipped_queue.load(Relaxed) == 40
        });
        let (n, bytes) = z.tiers().1.unwrap();
        assert!(bytes <= 64 * 1024 && n == 8, "{n} objects, {bytes} bytes");
        assert!(z.stats.disk.evicted.load(Relaxed) >= 20);
        wait("unlinks", || files(&d.0).len() == 8);
        // The directory goes away under it: writes fail, counted; the
        // memory tier still answers.
        std::fs::remove_dir_all(&d.0).unwrap();
        std::fs::write(&d.0, b"not a directory").unwrap();
        z.insert(b"after".to_vec(), obj(b"still served", 600));
        wait("error", || z.stats.disk.errors.load(Relaxed) >= 1);
        let o = z.get(b"after", &Headers::default()).await.unwrap();
        assert_eq!(&o.body[..], b"still served");
        std::fs::remove_file(&d.0).unwrap();
    }

    /// Validators live in the stored fields; a meta written before that
    /// (ETag and Last-Modified only in their own places) still reads with
    /// them, and a meta written now does not get them twice.
    #[test]
    fn validators_read_from_old_and_new_metas() {
        let mut old = Vec::new();
        put_bytes(&mut old, b"k");
        old.extend_from_slice(&200u16.to_le_bytes());
        for v in [60u64, 1, 2, 3, 0] {
            old.extend_from_slice(&v.to_le_bytes());
        }
        old.push(1);
        put_bytes(&mut old, b"\"old\"");
        put_bytes(&mut old, b"Tue, 24 Nov 2026 00:00:00 GMT");
        old.extend_from_slice(&0u32.to_le_bytes());
        old.extend_from_slice(&1u32.to_le_bytes());
        put_bytes(&mut old, b"Content-Type");
        put_bytes(&mut old, b"text/plain");
        let (key, o) = decode_meta(&old).expect("an old meta reads");
        assert_eq!(&key[..], b"k");
        assert_eq!(o.etag(), Some(&b"\"old\""[..]));
        assert_eq!(o.last_modified(), b"Tue, 24 Nov 2026 00:00:00 GMT");
        // Then only a synthetic Last-Modified was kept out of the fields.
        assert!(o.synthetic_lm);

        let mut o = obj(b"x", 60);
        let (_, back) = decode_meta(&encode_meta(b"k", &o)).expect("a new meta reads");
        assert_eq!(back.headers.get_all(b"etag").count(), 1);
        assert_eq!(back.headers.get_all(b"last-modified").count(), 1);
        assert_eq!(back.etag(), Some(&b"\"e1\""[..]));
        assert!(!back.synthetic_lm);
        o.synthetic_lm = true;
        let (_, back) = decode_meta(&encode_meta(b"k", &o)).expect("a new meta reads");
        assert!(back.synthetic_lm);
        assert_eq!(back.headers.get_all(b"last-modified").count(), 1);
    }

    /// Issue 31, item 11: a prefix whose lengths overflow (a tampered file)
    /// is a corrupt file — a miss, counted — at the startup scan and when a
    /// reader meets it, and no I/O thread dies of it.
    #[tokio::test(flavor = "current_thread")]
    async fn lengths_that_overflow_are_corrupt_files_not_dead_threads() {
        let d = TempDir::new("overflow");
        let h = Headers::default();
        let keys: [&[u8]; 4] = [b"a", b"b", b"c", b"d"];
        let z = Zone::open("t", 1 << 20, 1 << 19, Some(cfg(&d.0, 1 << 20, 0))).unwrap();
        wait("scan", || z.disk_ready());
        for k in keys {
            z.insert(k.to_vec(), obj(b"body", 600));
        }
        wait("writes", || z.stats.disk.writes.load(Relaxed) == 4);
        drop(z);
        let path = |k: &[u8]| {
            let id = file_id(k, &[]);
            files(&d.0)
                .into_iter()
                .find(|p| {
                    p.file_name()
                        .unwrap()
                        .to_str()
                        .unwrap()
                        .starts_with(&format!("{id:016x}."))
                })
                .unwrap()
        };
        // The body length field, near u64::MAX: PREFIX + meta + it wraps.
        let tamper = |p: &Path| {
            let mut data = std::fs::read(p).unwrap();
            data[12..20].copy_from_slice(&(u64::MAX - 3).to_le_bytes());
            std::fs::write(p, data).unwrap();
        };
        let (pa, pb, pc) = (path(b"a"), path(b"b"), path(b"c"));
        tamper(&pa);
        let z = Zone::open("t", 1 << 20, 1 << 19, Some(cfg(&d.0, 1 << 20, 0))).unwrap();
        wait("scan", || z.disk_ready());
        assert_eq!(z.stats.disk.corrupt.load(Relaxed), 1, "found by the scan");
        assert_eq!(z.tiers().1.unwrap().0, 3);
        // Tampered after the scan: found by the readers (two threads, so
        // two such files would have killed both).
        tamper(&pb);
        tamper(&pc);
        assert!(z.get(b"b", &h).await.is_none());
        assert!(z.get(b"c", &h).await.is_none());
        assert_eq!(z.stats.disk.corrupt.load(Relaxed), 3);
        let o = z.get(b"d", &h).await.expect("the readers still read");
        assert_eq!(&o.body[..], b"body");
        // A meta that claims an impossible status or time is corrupt too.
        let mut o = obj(b"x", 60);
        o.age_header = u64::MAX;
        assert!(decode_meta(&encode_meta(b"k", &o)).is_none());
        o.age_header = 0;
        o.status = 0;
        assert!(decode_meta(&encode_meta(b"k", &o)).is_none());
    }

    /// Variants per key are bounded on disk as in memory: the oldest goes.
    #[tokio::test(flavor = "current_thread")]
    async fn variants_per_key_are_bounded_on_disk() {
        let d = TempDir::new("variants");
        let z = Zone::open("t", 1 << 20, 1 << 19, Some(cfg(&d.0, 1 << 20, 0))).unwrap();
        z.set_max_variants(2);
        wait("scan", || z.disk_ready());
        for v in [&b"1"[..], b"2", b"3"] {
            let mut o = obj(v, 600);
            o.vary = vec![(b"x-v".to_vec(), Some(v.to_vec()))];
            z.insert(b"k".to_vec(), o);
        }
        wait("writes", || z.stats.disk.writes.load(Relaxed) == 3);
        assert_eq!(z.tiers().1.unwrap().0, 2);
        assert_eq!(z.tiers().0 .0, 2, "memory holds two as well");
        wait("unlink", || files(&d.0).len() == 2);
    }

    /// Hostile bytes never panic the decoders: random files, and valid
    /// files with a byte of the meta changed (checksums made to match, so
    /// the meta's own parsing is what meets them).
    #[test]
    fn hostile_files_never_panic() {
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        let mut next = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        for _ in 0..5_000 {
            let n = (next() % 200) as usize;
            let mut data: Vec<u8> = (0..n).map(|_| next() as u8).collect();
            if n >= PREFIX && next() % 2 == 0 {
                data[..8].copy_from_slice(MAGIC);
            }
            let _ = decode_file(data);
        }
        let mut o = obj(b"body", 60);
        o.vary = vec![(b"accept-encoding".to_vec(), Some(b"gzip".to_vec()))];
        let meta = encode_meta(b"key", &o);
        for _ in 0..20_000 {
            let mut m = meta.clone();
            let i = (next() as usize) % m.len();
            m[i] = next() as u8;
            let mut f = Vec::new();
            f.extend_from_slice(MAGIC);
            f.extend_from_slice(&(m.len() as u32).to_le_bytes());
            f.extend_from_slice(&4u64.to_le_bytes());
            f.extend_from_slice(&crc32fast::hash(&m).to_le_bytes());
            f.extend_from_slice(&crc32fast::hash(b"body").to_le_bytes());
            f.extend_from_slice(&m);
            f.extend_from_slice(b"body");
            if let Some((_, back)) = decode_file(f) {
                assert!(back
                    .headers
                    .iter()
                    .all(|(k, v)| !k.is_empty() && !v.contains(&b'\n')));
            }
        }
    }
}
