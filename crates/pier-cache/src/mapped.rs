//! Large bodies in mappings of their own, read-only once written, so that
//! a hit can leave without being copied: the pages are spliced into a pipe
//! by reference (`vmsplice`) and from the pipe to the socket (`splice`),
//! which takes references to them as `sendfile` does to page-cache pages.
//! A body also keeps a pipe of its own holding references to all of its
//! pages, so that a hit only duplicates them (`tee`) instead of pinning
//! every page again (`vmsplice`: page-table walks, 13% of a 1 MiB hit's
//! CPU in perf).
//! A `write` copies every byte from the heap into socket buffers: that copy
//! made a 1 MiB hit cost Pier ~2× nginx's system time, whose `proxy_cache`
//! serves page-cache files by `sendfile`.
//!
//! Why not a memory file (`memfd`) and `sendfile`: measured here, a 1 MiB
//! `sendfile` from shmem took 2.7× the system time of one from ext4's page
//! cache (shmem looks up and locks every 4 KiB page), so Pier stayed behind
//! nginx; pinning anonymous pages walks page tables instead.
//!
//! The pages must never change while the kernel holds them (a socket may
//! keep them queued long after the send returned): the mapping is written
//! once, then made read-only, and never reused — when it is unmapped, the
//! pages the kernel still references stay alive until it lets them go,
//! and a new mapping gets fresh pages. The object's `body` is a `Bytes`
//! over the mapping (HTTP/2, TLS, compression and the disk tier read it as
//! before). How many mappings exist is bounded per process.

#![allow(unsafe_code)] // mmap, mprotect, munmap, vmsplice: the FFI boundary this module exists for.

use bytes::Bytes;
use rustix::mm::{MapFlags, MprotectFlags, ProtFlags};
use rustix::pipe::{IoSliceRaw, SpliceFlags};
use std::os::fd::{AsFd, BorrowedFd};
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::Arc;

/// Bodies from this size on get a mapping: below it a `write`'s copy costs
/// less than a mapping and the page references.
pub const MIN_MAPPED_BODY: usize = 64 * 1024;

/// At most this many mappings (the kernel's default `vm.max_map_count` is
/// 65,530 for everything a process maps).
const MAX_MAPPED: usize = 16_384;

/// Mappings alive in this process.
static MAPPED: AtomicUsize = AtomicUsize::new(0);

/// Bodies held in mappings now (a gauge for metrics and tests).
pub fn mapped() -> usize {
    MAPPED.load(Relaxed)
}

/// Pipes held by bodies in this process (each costs a descriptor).
static PIPES: AtomicUsize = AtomicUsize::new(0);

/// The process's soft descriptor limit, read once: bodies' pipes and the
/// pipes that carry them to sockets (pier-proxy) each take a share of it.
pub fn descriptor_limit() -> u64 {
    static LIMIT: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *LIMIT.get_or_init(|| {
        rustix::process::getrlimit(rustix::process::Resource::Nofile)
            .current
            .unwrap_or(u64::MAX)
    })
}

/// At most a quarter of the descriptor limit goes to bodies' pipes (the
/// rest is for connections), and never more than `MAX_MAPPED`.
fn max_pipes() -> usize {
    (descriptor_limit() / 4).min(MAX_MAPPED as u64) as usize
}

/// A body in a read-only anonymous mapping of its own.
pub struct MappedBody {
    ptr: std::ptr::NonNull<u8>,
    len: usize,
    /// A pipe holding references to all of the body's pages, filled once:
    /// a hit duplicates them into its own pipe (`tee`), which costs a
    /// reference per page instead of pinning every page again
    /// (`vmsplice`). None when the kernel or the descriptor budget says no.
    pipe: Option<std::os::fd::OwnedFd>,
}

// SAFETY: the mapping is read-only from `new` on and freed only by `drop`,
// so sharing the pointer between threads shares immutable bytes.
unsafe impl Send for MappedBody {}
// SAFETY: as above: nothing can change the bytes behind `ptr`.
unsafe impl Sync for MappedBody {}

impl MappedBody {
    /// A mapping holding a copy of `data`; None when `data` is empty, the
    /// process holds as many mappings as it may, or the kernel refuses (the
    /// caller keeps the body on the heap).
    pub fn new(data: &[u8]) -> Option<Arc<MappedBody>> {
        if data.is_empty() {
            return None;
        }
        if MAPPED.fetch_add(1, Relaxed) >= MAX_MAPPED {
            MAPPED.fetch_sub(1, Relaxed);
            return None;
        }
        let m = Self::map(data);
        if m.is_none() {
            MAPPED.fetch_sub(1, Relaxed);
        }
        m.map(Arc::new)
    }

    fn map(data: &[u8]) -> Option<MappedBody> {
        let len = data.len();
        // SAFETY: a fresh private anonymous mapping: it aliases nothing.
        // Populated at once (one fault pass, and RSS counts it).
        let ptr = unsafe {
            rustix::mm::mmap_anonymous(
                std::ptr::null_mut(),
                len,
                ProtFlags::READ | ProtFlags::WRITE,
                MapFlags::PRIVATE | MapFlags::POPULATE,
            )
        }
        .ok()?;
        let ptr = std::ptr::NonNull::new(ptr.cast::<u8>())?;
        // SAFETY: `ptr` maps `len` writable bytes that nothing else
        // references yet; `data` is a distinct allocation.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), ptr.as_ptr(), len) };
        // SAFETY: the mapping made above, whole; from here on read-only.
        if unsafe { rustix::mm::mprotect(ptr.as_ptr().cast(), len, MprotectFlags::READ) }.is_err() {
            // SAFETY: the mapping made above, not referenced by anything.
            let _ = unsafe { rustix::mm::munmap(ptr.as_ptr().cast(), len) };
            return None;
        }
        // From here `drop` unmaps it and gives its count back.
        let mut body = MappedBody {
            ptr,
            len,
            pipe: None,
        };
        body.pipe = body.fill_pipe();
        Some(body)
    }

    /// A pipe with every page of the body in it, or None.
    fn fill_pipe(&self) -> Option<std::os::fd::OwnedFd> {
        use rustix::pipe::PipeFlags;
        if PIPES.fetch_add(1, Relaxed) >= max_pipes() {
            PIPES.fetch_sub(1, Relaxed);
            return None;
        }
        let made = (|| {
            let (r, w) = rustix::pipe::pipe_with(PipeFlags::NONBLOCK | PipeFlags::CLOEXEC).ok()?;
            // Past `fs.pipe-max-size` (1 MiB) or the user's pipe pages,
            // the kernel refuses: the body is then pinned per hit.
            if rustix::pipe::fcntl_setpipe_size(&w, self.len).ok()? < self.len {
                return None;
            }
            let mut at = 0;
            while at < self.len {
                match self.splice_into(w.as_fd(), at, self.len - at) {
                    Ok(n) if n > 0 => at += n,
                    _ => return None,
                }
            }
            Some(r)
        })();
        if made.is_none() {
            PIPES.fetch_sub(1, Relaxed);
        }
        made
    }

    /// Duplicate the references to the body's first `len` bytes (at most)
    /// into `pipe` (`tee`); how many bytes, or None when the body has no
    /// pipe of its own (then `splice_into`).
    pub fn tee_into(&self, pipe: BorrowedFd<'_>, len: usize) -> Option<std::io::Result<usize>> {
        let own = self.pipe.as_ref()?;
        Some(
            rustix::pipe::tee(own, pipe, len.min(self.len), SpliceFlags::NONBLOCK)
                .map_err(std::io::Error::from),
        )
    }

    /// The whole body as `Bytes` (no copy; the bytes keep the mapping).
    pub fn bytes(self: &Arc<Self>) -> Bytes {
        Bytes::from_owner(Owner(self.clone()))
    }

    /// Put up to `len` bytes from `offset` into the pipe `pipe` by
    /// reference (`vmsplice`), as much as the pipe takes; how many. The
    /// caller then splices the pipe into a socket: no byte is copied.
    pub fn splice_into(
        &self,
        pipe: BorrowedFd<'_>,
        offset: usize,
        len: usize,
    ) -> std::io::Result<usize> {
        let end = offset.saturating_add(len).min(self.len);
        if offset >= end {
            return Ok(0);
        }
        let part = &self.as_ref()[offset..end];
        let iov = [IoSliceRaw::from_slice(part)];
        // SAFETY: `part` is within the mapping, alive for this call. The
        // kernel keeps references to its pages, whose bytes never change
        // (read-only since `map`, never remapped); unmapping them later
        // leaves them to the kernel until it drops its references.
        let n = unsafe { rustix::pipe::vmsplice(pipe, &iov, SpliceFlags::NONBLOCK) }?;
        Ok(n)
    }
}

impl AsRef<[u8]> for MappedBody {
    fn as_ref(&self) -> &[u8] {
        // SAFETY: `ptr` maps `len` readable bytes until `drop` unmaps them,
        // and they are immutable (read-only mapping).
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for MappedBody {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `map`, unmapped once; every slice of
        // it borrows `self` (or an `Arc` of it), so none outlives this.
        let _ = unsafe { rustix::mm::munmap(self.ptr.as_ptr().cast(), self.len) };
        MAPPED.fetch_sub(1, Relaxed);
        if self.pipe.take().is_some() {
            PIPES.fetch_sub(1, Relaxed);
        }
    }
}

impl std::fmt::Debug for MappedBody {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "MappedBody({} bytes)", self.len)
    }
}

struct Owner(Arc<MappedBody>);

impl AsRef<[u8]> for Owner {
    fn as_ref(&self) -> &[u8] {
        (*self.0).as_ref()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_mapped_body_holds_its_bytes_and_splices_them_by_reference() {
        let data: Vec<u8> = (0..200_000u32).map(|i| (i % 251) as u8).collect();
        let m = MappedBody::new(&data).expect("mmap");
        assert!(mapped() >= 1);
        let b = m.bytes();
        assert_eq!(&b[..], &data[..]);
        assert_eq!(&b.slice(1000..2000)[..], &data[1000..2000]);
        // Through a pipe: what comes out is the body's bytes.
        let (r, w) = rustix::pipe::pipe_with(rustix::pipe::PipeFlags::NONBLOCK).unwrap();
        let n = m.splice_into(w.as_fd(), 5000, 100_000).unwrap();
        assert!(n > 0 && n <= 100_000);
        let mut out = vec![0u8; n];
        let mut got = 0;
        while got < n {
            got += rustix::io::read(&r, &mut out[got..]).unwrap();
        }
        assert_eq!(&out[..], &data[5000..5000 + n]);
        assert_eq!(m.splice_into(w.as_fd(), 300_000, 10).unwrap(), 0);
        // Its own pipe (where the kernel grants one) hands out its pages
        // from the start, as often as asked.
        if let Some(r2) = m.tee_into(w.as_fd(), 70_000) {
            let n = r2.unwrap();
            assert!(n > 0 && n <= 70_000);
            let mut out = vec![0u8; n];
            let mut got = 0;
            while got < n {
                got += rustix::io::read(&r, &mut out[got..]).unwrap();
            }
            assert_eq!(&out[..], &data[..n]);
            assert_eq!(m.tee_into(w.as_fd(), 10).unwrap().unwrap(), 10);
        }
        drop(m);
        assert_eq!(&b[..10], &data[..10], "the bytes keep the mapping");
        assert!(MappedBody::new(b"").is_none());
    }
}
