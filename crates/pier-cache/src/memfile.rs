//! Large bodies in sealed memory files, so that a hit can leave by
//! `sendfile` (the socket takes references to the file's pages) instead of
//! a `write` that copies every byte from the heap into socket buffers —
//! the copy that made a 1 MiB hit cost Pier ~2× nginx's system time, whose
//! `proxy_cache` serves page-cache files by `sendfile`.
//!
//! A memory file (`memfd_create`) is written once, then sealed against any
//! change of bytes or size, then mapped read-only: the object's `body`
//! stays a `Bytes` over that mapping (HTTP/2, TLS, compression and the
//! disk tier read it as before), and the pages are held once, by the file.
//! The mapping is populated at once so that RSS counts what the file holds.
//! Each file costs a descriptor: how many may exist is bounded per process
//! (`MemFile::new` declines past it and the body stays on the heap).

#![allow(unsafe_code)] // mmap/munmap: the FFI boundary this module exists for.

use bytes::Bytes;
use rustix::fs::{MemfdFlags, SealFlags};
use rustix::mm::{MapFlags, ProtFlags};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, OnceLock};

/// Bodies from this size on go to memory files: below it a `write`'s copy
/// costs less than the page references a `sendfile` takes.
pub const MIN_FILE_BODY: usize = 64 * 1024;

/// Memory files alive in this process.
static FILES: AtomicUsize = AtomicUsize::new(0);

/// At most this many memory files: a quarter of the descriptor limit (the
/// rest is for connections), and never more than 16,384 mappings.
fn max_files() -> usize {
    static MAX: OnceLock<usize> = OnceLock::new();
    *MAX.get_or_init(|| {
        let soft = rustix::process::getrlimit(rustix::process::Resource::Nofile)
            .current
            .unwrap_or(u64::MAX);
        (soft / 4).min(16_384) as usize
    })
}

/// Memory files alive now (a gauge for metrics and tests).
pub fn files() -> usize {
    FILES.load(Relaxed)
}

/// A sealed, read-only memory file and its mapping.
pub struct MemFile {
    fd: OwnedFd,
    ptr: std::ptr::NonNull<u8>,
    len: usize,
}

// SAFETY: the mapping is read-only and its file sealed against writes,
// so sharing the pointer between threads shares immutable bytes.
unsafe impl Send for MemFile {}
// SAFETY: as above: nothing can change the bytes behind `ptr`.
unsafe impl Sync for MemFile {}

impl MemFile {
    /// A memory file holding `data`; None when `data` is empty, the
    /// process holds as many files as it may, or the kernel refuses (the
    /// caller keeps the body on the heap).
    pub fn new(data: &[u8]) -> Option<Arc<MemFile>> {
        if data.is_empty() {
            return None;
        }
        if FILES.fetch_add(1, Relaxed) >= max_files() {
            FILES.fetch_sub(1, Relaxed);
            return None;
        }
        let f = Self::create(data);
        if f.is_none() {
            FILES.fetch_sub(1, Relaxed);
        }
        f.map(Arc::new)
    }

    fn create(data: &[u8]) -> Option<MemFile> {
        let fd = rustix::fs::memfd_create(
            "pier-cache",
            MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING,
        )
        .ok()?;
        let mut at = 0;
        while at < data.len() {
            match rustix::io::write(&fd, &data[at..]) {
                Ok(0) => return None,
                Ok(n) => at += n,
                Err(rustix::io::Errno::INTR) => {}
                Err(_) => return None,
            }
        }
        rustix::fs::fcntl_add_seals(
            &fd,
            SealFlags::WRITE | SealFlags::SHRINK | SealFlags::GROW | SealFlags::SEAL,
        )
        .ok()?;
        // SAFETY: a fresh read-only shared mapping of a file this process
        // made and sealed: no one can write or truncate it, so the bytes
        // behind the pointer never change and never vanish while mapped.
        let ptr = unsafe {
            rustix::mm::mmap(
                std::ptr::null_mut(),
                data.len(),
                ProtFlags::READ,
                MapFlags::SHARED | MapFlags::POPULATE,
                &fd,
                0,
            )
        }
        .ok()?;
        Some(MemFile {
            fd,
            ptr: std::ptr::NonNull::new(ptr.cast())?,
            len: data.len(),
        })
    }

    /// The file, for `sendfile`.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The whole file as `Bytes` (no copy; the bytes keep the file alive).
    pub fn bytes(self: &Arc<Self>) -> Bytes {
        Bytes::from_owner(Owner(self.clone()))
    }
}

impl AsRef<[u8]> for MemFile {
    fn as_ref(&self) -> &[u8] {
        // SAFETY: `ptr` maps `len` readable bytes until `drop` unmaps it,
        // and they are immutable (sealed file, read-only mapping).
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for MemFile {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `create`, unmapped once; every slice
        // of it borrows `self` (or an `Arc` of it), so none outlives this.
        let _ = unsafe { rustix::mm::munmap(self.ptr.as_ptr().cast(), self.len) };
        FILES.fetch_sub(1, Relaxed);
    }
}

impl std::fmt::Debug for MemFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "MemFile({} bytes)", self.len)
    }
}

struct Owner(Arc<MemFile>);

impl AsRef<[u8]> for Owner {
    fn as_ref(&self) -> &[u8] {
        (*self.0).as_ref()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_memory_file_holds_its_bytes_sealed() {
        let data: Vec<u8> = (0..200_000u32).map(|i| (i % 251) as u8).collect();
        let f = MemFile::new(&data).expect("memfd");
        assert!(files() >= 1);
        let b = f.bytes();
        assert_eq!(&b[..], &data[..]);
        assert_eq!(&b.slice(1000..2000)[..], &data[1000..2000]);
        // Sealed: neither a write nor a truncation gets through.
        assert!(rustix::io::pwrite(f.fd(), b"x", 0).is_err());
        assert!(rustix::fs::ftruncate(f.fd(), 1).is_err());
        drop(f);
        assert_eq!(&b[..10], &data[..10], "the bytes keep the file");
        drop(b);
        assert!(MemFile::new(b"").is_none());
    }
}
