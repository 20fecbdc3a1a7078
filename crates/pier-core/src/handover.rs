//! Binary upgrades: the running Pier hands its listening sockets to a new
//! binary over a Unix socket (`SCM_RIGHTS`), as HAProxy's `-x` and
//! Pingora's upgrade do. The sockets themselves move, not their addresses:
//! connections waiting in an accept queue stay there and are accepted by the
//! new process, so nothing is refused while the binary changes.
//!
//! The exchange, on a `SOCK_SEQPACKET` socket (one message per read, one
//! descriptor per message, so no framing and no descriptor can be split):
//!
//! ```text
//! new → old   hello <pid>
//! old → new   tcp|udp|admin <name>      + SCM_RIGHTS [fd]   (one per socket)
//! old → new   end
//!             … the new one starts its workers on those sockets …
//! new → old   ready
//!             … the old one stops accepting and starts its drain …
//! old → new   bye
//! ```
//!
//! Until `ready`, the old process serves as before: a new binary that
//! fails its start (or dies) just goes away, and nothing changed. After
//! `bye` the new one takes the upgrade socket's path for the next upgrade
//! (bound beside it, then renamed over it: there is always one to connect
//! to). Only the same user (or root) may connect: whoever holds the
//! sockets holds the service.
//!
//! Written by hand over rustix's safe calls: the crates that pass
//! descriptors hand back raw ones, and the protocol is five lines.

use rustix::fd::{AsFd, BorrowedFd, OwnedFd};
use rustix::net::{
    AddressFamily, RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags, SocketAddrUnix, SocketFlags, SocketType,
};
use std::io::{self, IoSlice, IoSliceMut};
use std::mem::MaybeUninit;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// What a handed-over socket is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// A listener's TCP accept socket (one per worker).
    Tcp,
    /// A listener's UDP socket for HTTP/3 (one per worker).
    Udp,
    /// The admin listener.
    Admin,
}

impl Kind {
    fn as_str(self) -> &'static str {
        match self {
            Kind::Tcp => "tcp",
            Kind::Udp => "udp",
            Kind::Admin => "admin",
        }
    }
    fn parse(s: &str) -> Option<Kind> {
        match s {
            "tcp" => Some(Kind::Tcp),
            "udp" => Some(Kind::Udp),
            "admin" => Some(Kind::Admin),
            _ => None,
        }
    }
}

/// How long each side waits for the other's next message. The new process
/// may take a while between `end` and `ready` (Lua init, DNS, TLS setup);
/// a process that says nothing for this long is taken for dead.
const READY_WAIT: Duration = Duration::from_secs(120);
const STEP_WAIT: Duration = Duration::from_secs(10);
/// Longest message: a kind and a listener name.
const MSG_MAX: usize = 512;

fn seqpacket() -> io::Result<OwnedFd> {
    Ok(rustix::net::socket_with(
        AddressFamily::UNIX,
        SocketType::SEQPACKET,
        SocketFlags::CLOEXEC,
        None,
    )?)
}

fn send(fd: BorrowedFd<'_>, msg: &str, pass: Option<BorrowedFd<'_>>) -> io::Result<()> {
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    let fds;
    if let Some(p) = pass {
        fds = [p];
        control.push(SendAncillaryMessage::ScmRights(&fds));
    }
    rustix::net::sendmsg(
        fd,
        &[IoSlice::new(msg.as_bytes())],
        &mut control,
        SendFlags::NOSIGNAL,
    )?;
    Ok(())
}

/// The next message and the descriptor that came with it; `None` at EOF.
fn recv(fd: BorrowedFd<'_>) -> io::Result<Option<(String, Option<OwnedFd>)>> {
    let mut buf = [0u8; MSG_MAX];
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(4))];
    let mut control = RecvAncillaryBuffer::new(&mut space);
    let got = rustix::net::recvmsg(
        fd,
        &mut [IoSliceMut::new(&mut buf)],
        &mut control,
        RecvFlags::CMSG_CLOEXEC,
    )?;
    // Every descriptor that came is owned now (and closed when dropped);
    // a message is meant to carry one at most.
    let mut passed = Vec::new();
    for m in control.drain() {
        if let RecvAncillaryMessage::ScmRights(fds) = m {
            passed.extend(fds);
        }
    }
    if got.bytes == 0 && passed.is_empty() {
        return Ok(None);
    }
    let text = std::str::from_utf8(&buf[..got.bytes.min(MSG_MAX)])
        .map_err(|_| bad("a message that is not text"))?
        .to_string();
    if passed.len() > 1 {
        return Err(bad("more than one descriptor in a message"));
    }
    Ok(Some((text, passed.pop())))
}

fn bad(what: &str) -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidData,
        format!("upgrade protocol: {what}"),
    )
}

fn expect(fd: BorrowedFd<'_>, want: &str, wait: Duration) -> io::Result<()> {
    rustix::net::sockopt::set_socket_timeout(fd, rustix::net::sockopt::Timeout::Recv, Some(wait))?;
    match recv(fd)? {
        Some((m, None)) if m == want => Ok(()),
        Some((m, _)) => Err(bad(&format!("expected {want:?}, got {m:?}"))),
        None => Err(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            format!("the other process went away before {want:?}"),
        )),
    }
}

/// The old process's side: a listening upgrade socket at a path.
pub struct HandoverServer {
    listener: OwnedFd,
    path: PathBuf,
}

impl HandoverServer {
    /// Listen at `path`: bound beside it and renamed over it, so a client
    /// always finds one, mode 0600.
    pub fn bind(path: &Path) -> io::Result<HandoverServer> {
        let fd = seqpacket()?;
        let tmp = {
            let mut t = path.as_os_str().to_owned();
            t.push(format!(".{}", std::process::id()));
            PathBuf::from(t)
        };
        let _ = std::fs::remove_file(&tmp);
        rustix::net::bind(&fd, &SocketAddrUnix::new(&tmp)?)?;
        let placed = (|| {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o600))?;
            rustix::net::listen(&fd, 4)?;
            use std::os::unix::fs::MetadataExt;
            let m = std::fs::metadata(&tmp)?;
            let _ = OURS.set((m.dev(), m.ino()));
            std::fs::rename(&tmp, path)
        })();
        if let Err(e) = placed {
            let _ = std::fs::remove_file(&tmp);
            return Err(e);
        }
        Ok(HandoverServer {
            listener: fd,
            path: path.to_path_buf(),
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Serve upgrade requests until one succeeds (blocking: run it on a
    /// thread of its own). Each new process gets `sockets`; when one says
    /// `ready`, `on_ready` is called (it stops this process accepting) and
    /// this returns. A new process that fails before `ready` is logged and
    /// the next one is waited for.
    pub fn serve(&self, sockets: &[(Kind, String, OwnedFd)], on_ready: impl FnOnce()) {
        loop {
            let conn = match rustix::net::accept_with(&self.listener, SocketFlags::CLOEXEC) {
                Ok(c) => c,
                Err(e) => {
                    tracing::error!("upgrade socket {}: {e}", self.path.display());
                    std::thread::sleep(Duration::from_millis(100));
                    continue;
                }
            };
            match hand_over(conn.as_fd(), sockets) {
                Ok(()) => {
                    on_ready();
                    if let Err(e) = send(conn.as_fd(), "bye", None) {
                        tracing::warn!("upgrade: the new process did not take the last word: {e}");
                    }
                    return;
                }
                Err(e) => tracing::error!("upgrade failed, this process keeps serving: {e}"),
            }
        }
    }
}

/// Remove the upgrade socket at `path` on a plain exit (SIGTERM), unless
/// a newer process already put its own there.
pub fn remove_if_ours(path: &Path) {
    use std::os::unix::fs::MetadataExt;
    let mine = std::fs::metadata(path).ok().map(|m| (m.dev(), m.ino()));
    if mine.is_some() && mine == OURS.get().copied() {
        let _ = std::fs::remove_file(path);
    }
}

/// The upgrade socket this process bound (device, inode).
static OURS: std::sync::OnceLock<(u64, u64)> = std::sync::OnceLock::new();

/// One attempt: check who asks, pass the sockets, wait for `ready`.
fn hand_over(conn: BorrowedFd<'_>, sockets: &[(Kind, String, OwnedFd)]) -> io::Result<()> {
    let cred = rustix::net::sockopt::socket_peercred(conn)?;
    let me = rustix::process::geteuid();
    if cred.uid != me && !cred.uid.is_root() {
        return Err(bad(&format!(
            "refused a process of another user (uid {})",
            cred.uid.as_raw()
        )));
    }
    rustix::net::sockopt::set_socket_timeout(
        conn,
        rustix::net::sockopt::Timeout::Recv,
        Some(STEP_WAIT),
    )?;
    let pid = match recv(conn)? {
        Some((m, None)) if m.starts_with("hello ") => m[6..].to_string(),
        _ => return Err(bad("no hello")),
    };
    tracing::info!(
        "upgrade: process {pid} asks for the listening sockets; handing over {}",
        sockets.len()
    );
    for (kind, name, fd) in sockets {
        let mut msg = String::with_capacity(8 + name.len());
        msg.push_str(kind.as_str());
        msg.push(' ');
        msg.push_str(name);
        send(conn, &msg, Some(fd.as_fd()))?;
    }
    send(conn, "end", None)?;
    expect(conn, "ready", READY_WAIT)?;
    tracing::info!("upgrade: process {pid} serves; this one stops accepting and drains");
    Ok(())
}

/// The new process's side: the sockets it was handed, until it is ready.
pub struct Handover {
    conn: OwnedFd,
    sockets: Vec<(Kind, String, Option<OwnedFd>)>,
}

impl Handover {
    /// Ask the Pier listening at `path` for its sockets.
    pub fn connect(path: &Path) -> io::Result<Handover> {
        let conn = seqpacket()?;
        rustix::net::connect(&conn, &SocketAddrUnix::new(path)?).map_err(|e| {
            io::Error::new(
                io::Error::from(e).kind(),
                format!(
                    "no running Pier answers on the upgrade socket {}: {e}",
                    path.display()
                ),
            )
        })?;
        let mut hello = String::from("hello ");
        hello.push_str(&std::process::id().to_string());
        send(conn.as_fd(), &hello, None)?;
        rustix::net::sockopt::set_socket_timeout(
            &conn,
            rustix::net::sockopt::Timeout::Recv,
            Some(STEP_WAIT),
        )?;
        let mut sockets = Vec::new();
        loop {
            match recv(conn.as_fd())? {
                Some((m, None)) if m == "end" => break,
                Some((m, Some(fd))) => {
                    let (kind, name) = m
                        .split_once(' ')
                        .and_then(|(k, n)| Some((Kind::parse(k)?, n.to_string())))
                        .ok_or_else(|| bad(&format!("unknown socket {m:?}")))?;
                    sockets.push((kind, name, Some(fd)));
                }
                Some((m, None)) => return Err(bad(&format!("unexpected {m:?}"))),
                None => return Err(bad("the running Pier went away mid-handover")),
            }
        }
        Ok(Handover { conn, sockets })
    }

    /// How many sockets came.
    pub fn len(&self) -> usize {
        self.sockets.len()
    }

    pub fn is_empty(&self) -> bool {
        self.sockets.is_empty()
    }

    /// Take the handed-over sockets of one kind and name (all workers').
    pub fn take(&mut self, kind: Kind, name: &str) -> Vec<OwnedFd> {
        self.sockets
            .iter_mut()
            .filter(|(k, n, _)| *k == kind && n == name)
            .filter_map(|(_, _, fd)| fd.take())
            .collect()
    }

    /// [`Self::take`], when the sockets are bound where the new config
    /// wants them (`want`, or its address with any port for port 0); a
    /// listener that moved gets none and is bound anew (its old sockets
    /// are closed when this process is ready).
    pub fn take_bound(&mut self, kind: Kind, name: &str, want: SocketAddr) -> Vec<OwnedFd> {
        let fits = |fd: &OwnedFd| {
            let Some(a) = socket2::SockRef::from(fd)
                .local_addr()
                .ok()
                .and_then(|a| a.as_socket())
            else {
                return false;
            };
            a == want || (want.port() == 0 && a.ip() == want.ip())
        };
        let mut took = Vec::new();
        for (k, n, slot) in self.sockets.iter_mut() {
            if *k == kind && n == name && slot.as_ref().is_some_and(fits) {
                took.extend(slot.take());
            }
        }
        if took.is_empty()
            && self
                .sockets
                .iter()
                .any(|(k, n, s)| *k == kind && n == name && s.is_some())
        {
            tracing::warn!(
                "upgrade: listener {name} ({}) moved to {want}: bound anew",
                kind.as_str()
            );
        }
        took
    }

    /// Tell the old process this one serves; once it has stopped
    /// accepting, take over the upgrade socket at `path` for the next
    /// upgrade. Sockets not taken (a listener the new config dropped) are
    /// closed here.
    pub fn ready(self, path: &Path) -> io::Result<HandoverServer> {
        send(self.conn.as_fd(), "ready", None)?;
        expect(self.conn.as_fd(), "bye", STEP_WAIT)?;
        drop(self.sockets);
        HandoverServer::bind(path)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sockets_move_and_keep_their_queue() {
        let dir = std::env::temp_dir().join(format!("pier-handover-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("upgrade.sock");
        let server = HandoverServer::bind(&path).unwrap();
        let tcp = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = tcp.local_addr().unwrap();
        // A connection waiting in the queue before the handover…
        let _waiting = std::net::TcpStream::connect(addr).unwrap();
        let sockets = vec![(Kind::Tcp, "main".to_string(), OwnedFd::from(tcp))];
        let ready = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let r = ready.clone();
        let old = std::thread::spawn(move || {
            server.serve(&sockets, || {
                r.store(true, std::sync::atomic::Ordering::SeqCst)
            });
            drop(sockets);
        });
        let mut h = Handover::connect(&path).unwrap();
        assert_eq!(h.len(), 1);
        assert!(h.take(Kind::Udp, "main").is_empty());
        let fds = h.take(Kind::Tcp, "main");
        assert_eq!(fds.len(), 1);
        let next = h.ready(&path).unwrap();
        old.join().unwrap();
        assert!(ready.load(std::sync::atomic::Ordering::SeqCst));
        // …is accepted by the new owner after the old one closed its copy.
        let l = std::net::TcpListener::from(fds.into_iter().next().unwrap());
        assert_eq!(l.local_addr().unwrap(), addr);
        let (_c, _) = l.accept().unwrap();
        // The next upgrade finds the new process at the same path.
        assert_eq!(next.path(), path);
        let probe = seqpacket().unwrap();
        rustix::net::connect(&probe, &SocketAddrUnix::new(&path).unwrap()).unwrap();
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_new_process_that_dies_changes_nothing() {
        let dir = std::env::temp_dir().join(format!("pier-handover-fail-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("upgrade.sock");
        let server = HandoverServer::bind(&path).unwrap();
        let tcp = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let sockets = vec![(Kind::Tcp, "main".to_string(), OwnedFd::from(tcp))];
        let old = std::thread::spawn(move || {
            let mut n = 0;
            server.serve(&sockets, || n += 1);
            n
        });
        // The first new process takes the sockets and goes away…
        let h = Handover::connect(&path).unwrap();
        assert_eq!(h.len(), 1);
        drop(h);
        // …the old one serves the next, which succeeds.
        let h = Handover::connect(&path).unwrap();
        h.ready(&path).unwrap();
        assert_eq!(old.join().unwrap(), 1);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
