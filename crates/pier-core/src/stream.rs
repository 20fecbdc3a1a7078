//! The byte streams sessions run over, and the connector that opens them.
//!
//! The engine never names a socket type: a downstream session runs over any
//! [`Stream`] (TCP today, TLS and in-memory pipes through the same trait),
//! and upstream connections are [`Conn`]s made by a [`Connector`] for a
//! [`PeerKey`] — the (address, TLS server name, ALPN) triple that the pool is
//! keyed by too, so a TLS and a cleartext connection to one address, or an
//! HTTP/2 and an HTTP/1.1 one, never mix.

use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite, DuplexStream, ReadBuf};
use tokio::net::TcpStream;

/// A byte stream a session can run over.
pub trait Stream: AsyncRead + AsyncWrite + Unpin + 'static {
    type Read<'a>: AsyncRead + Unpin
    where
        Self: 'a;
    type Write<'a>: AsyncWrite + Unpin + RawSocket
    where
        Self: 'a;
    /// Both directions at once (a request body goes up while the response
    /// comes down). Zero-cost for TCP.
    fn split(&mut self) -> (Self::Read<'_>, Self::Write<'_>);
    /// Wait until a read would make progress, without a buffer: an idle
    /// keep-alive connection then holds none. Streams that cannot tell
    /// (they buffer inside, as TLS does) are always ready, and the caller's
    /// read waits instead.
    fn readable(&self) -> impl std::future::Future<Output = io::Result<()>> {
        async { Ok(()) }
    }
    /// [`Stream::readable`] as a poll: the waker is kept by the socket's
    /// own registration, so a task waiting this way holds no waiter node
    /// (an idle connection's future is ~150 bytes smaller than with
    /// `readable()`). One task per stream may wait so.
    fn poll_readable(&self, _cx: &mut std::task::Context<'_>) -> std::task::Poll<io::Result<()>> {
        std::task::Poll::Ready(Ok(()))
    }
    /// Before the stream is dropped: say goodbye where the protocol has a
    /// word for it (TLS's close_notify, without which OpenSSL clients drop
    /// the session instead of resuming it). TCP's FIN comes with the close.
    fn close(&mut self) -> impl std::future::Future<Output = ()> {
        async {}
    }
}

/// A writer whose bytes reach a TCP socket unchanged (no TLS record, no
/// in-memory pipe): a file's pages can then go to the socket by
/// `splice`, without being copied through user space (cached bodies kept
/// in mappings of their own, `pier_cache::mapped`). Others say None and are
/// written to as usual.
pub trait RawSocket {
    fn raw_socket(&self) -> Option<SpliceOut<'_>> {
        None
    }
}

/// A TCP socket a writer may `send`/`splice` to itself.
pub enum SpliceOut<'a> {
    /// Registered with tokio's poller.
    Tcp(&'a TcpStream),
    /// On this worker's io_uring: its queue must be drained first.
    Uring(&'a pier_uring::UringStream),
}

impl SpliceOut<'_> {
    /// Wait until bytes written to the socket itself follow every byte
    /// written before through the stream.
    pub async fn ready(&self) -> io::Result<()> {
        match self {
            SpliceOut::Tcp(_) => Ok(()),
            SpliceOut::Uring(u) => std::future::poll_fn(|cx| u.poll_drained(cx)).await,
        }
    }
    /// The socket.
    pub fn fd(&self) -> io::Result<std::os::fd::BorrowedFd<'_>> {
        use std::os::fd::AsFd;
        match self {
            SpliceOut::Tcp(t) => Ok(t.as_fd()),
            SpliceOut::Uring(u) => u.fd().ok_or_else(|| io::ErrorKind::NotConnected.into()),
        }
    }
    /// `f` (a non-blocking write to [`Self::fd`]), again each time the
    /// socket has room, until it does not say WouldBlock.
    pub async fn write_with<R>(&self, mut f: impl FnMut() -> io::Result<R>) -> io::Result<R> {
        match self {
            SpliceOut::Tcp(t) => t.async_io(tokio::io::Interest::WRITABLE, f).await,
            SpliceOut::Uring(u) => loop {
                match f() {
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                        std::future::poll_fn(|cx| u.poll_writable(cx)).await?
                    }
                    r => return r,
                }
            },
        }
    }
}

impl RawSocket for tokio::net::tcp::WriteHalf<'_> {
    fn raw_socket(&self) -> Option<SpliceOut<'_>> {
        Some(SpliceOut::Tcp(self.as_ref()))
    }
}

/// Shared halves (TLS, in-memory pipes) transform or buffer what they carry.
impl<T> RawSocket for tokio::io::WriteHalf<T> {}

/// Upstream connections carry requests, not cached bodies.
impl RawSocket for ConnWrite<'_> {}

impl Stream for TcpStream {
    type Read<'a> = tokio::net::tcp::ReadHalf<'a>;
    type Write<'a> = tokio::net::tcp::WriteHalf<'a>;
    fn split(&mut self) -> (Self::Read<'_>, Self::Write<'_>) {
        TcpStream::split(self)
    }
    async fn readable(&self) -> io::Result<()> {
        TcpStream::readable(self).await
    }
    fn poll_readable(&self, cx: &mut std::task::Context<'_>) -> std::task::Poll<io::Result<()>> {
        self.poll_read_ready(cx)
    }
}

/// A TCP connection on this worker's io_uring (pier-uring): reads come
/// from what its multishot recv copied in, writes are queued for one SEND.
impl Stream for pier_uring::UringStream {
    type Read<'a> = pier_uring::UringHalf<'a>;
    type Write<'a> = pier_uring::UringHalf<'a>;
    fn split(&mut self) -> (Self::Read<'_>, Self::Write<'_>) {
        pier_uring::UringStream::split(self)
    }
    async fn readable(&self) -> io::Result<()> {
        std::future::poll_fn(|cx| pier_uring::UringStream::poll_readable(self, cx)).await
    }
    fn poll_readable(&self, cx: &mut std::task::Context<'_>) -> std::task::Poll<io::Result<()>> {
        pier_uring::UringStream::poll_readable(self, cx)
    }
}

/// Cached bodies are spliced to the socket once the ring's queue is out.
impl RawSocket for pier_uring::UringHalf<'_> {
    fn raw_socket(&self) -> Option<SpliceOut<'_>> {
        Some(SpliceOut::Uring(self.stream()))
    }
}

/// In-memory pipes: in-process origins and the engine's socket-free tests.
impl Stream for DuplexStream {
    type Read<'a> = tokio::io::ReadHalf<&'a mut DuplexStream>;
    type Write<'a> = tokio::io::WriteHalf<&'a mut DuplexStream>;
    fn split(&mut self) -> (Self::Read<'_>, Self::Write<'_>) {
        tokio::io::split(self)
    }
}

/// A server-side TLS connection (rustls over TCP); the halves share the
/// stream through tokio's split.
impl Stream for tokio_rustls::server::TlsStream<TcpStream> {
    type Read<'a> = tokio::io::ReadHalf<&'a mut Self>;
    type Write<'a> = tokio::io::WriteHalf<&'a mut Self>;
    fn split(&mut self) -> (Self::Read<'_>, Self::Write<'_>) {
        tokio::io::split(self)
    }
    /// rustls wants more bytes only when it holds no decrypted plaintext
    /// (tokio-rustls processes every complete record as it reads), so an
    /// idle connection waits on the socket without a read buffer; with
    /// plaintext (or a close_notify) pending, a read makes progress now.
    async fn readable(&self) -> io::Result<()> {
        let (tcp, conn) = self.get_ref();
        if conn.wants_read() {
            // A peek, not `readable()`: tokio-rustls's last read may have
            // left the readiness set without bytes behind it; a peek that
            // finds none clears it and waits.
            tcp.peek(&mut [0u8; 1]).await.map(|_| ())
        } else {
            Ok(())
        }
    }
    async fn close(&mut self) {
        // close_notify, flushed, then the TCP write side shut.
        let _ = tokio::io::AsyncWriteExt::shutdown(self).await;
    }
    fn poll_readable(&self, cx: &mut std::task::Context<'_>) -> std::task::Poll<io::Result<()>> {
        let (tcp, conn) = self.get_ref();
        if conn.wants_read() {
            let mut one = [0u8; 1];
            tcp.poll_peek(cx, &mut tokio::io::ReadBuf::new(&mut one))
                .map_ok(|_| ())
        } else {
            std::task::Poll::Ready(Ok(()))
        }
    }
}

/// A server-side TLS connection over this worker's io_uring: as over tokio's
/// TCP, except that the ring's readiness is exact (bytes, end or error
/// received), so no peek is needed to tell a stale one.
impl Stream for tokio_rustls::server::TlsStream<pier_uring::UringStream> {
    type Read<'a> = tokio::io::ReadHalf<&'a mut Self>;
    type Write<'a> = tokio::io::WriteHalf<&'a mut Self>;
    fn split(&mut self) -> (Self::Read<'_>, Self::Write<'_>) {
        tokio::io::split(self)
    }
    async fn readable(&self) -> io::Result<()> {
        std::future::poll_fn(|cx| Stream::poll_readable(self, cx)).await
    }
    async fn close(&mut self) {
        let _ = tokio::io::AsyncWriteExt::shutdown(self).await;
    }
    fn poll_readable(&self, cx: &mut std::task::Context<'_>) -> std::task::Poll<io::Result<()>> {
        let (tcp, conn) = self.get_ref();
        if conn.wants_read() {
            tcp.poll_readable(cx)
        } else {
            std::task::Poll::Ready(Ok(()))
        }
    }
}

/// What the application protocol to a peer is (negotiated by ALPN over TLS).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Alpn {
    #[default]
    Http1,
    H2,
}

/// Which upstream connections are interchangeable.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct PeerKey {
    pub addr: SocketAddr,
    /// TLS server name (SNI); `None` for cleartext.
    pub sni: Option<Arc<str>>,
    pub alpn: Alpn,
    /// A PROXY protocol header to send first (`send_proxy_protocol`): it
    /// names one client connection, so the connection is that client's
    /// alone, and the pool keeps it under this key only.
    pub proxy: Option<Arc<[u8]>>,
}

impl PeerKey {
    /// Cleartext HTTP/1.1 to `addr`.
    pub fn plain(addr: SocketAddr) -> Self {
        PeerKey {
            addr,
            sni: None,
            alpn: Alpn::Http1,
            proxy: None,
        }
    }
}

/// An upstream connection.
pub enum Conn {
    Tcp(TcpStream),
    Mem(DuplexStream),
    /// Boxed: a TLS client connection is ~1 KiB of state.
    Tls(Box<tokio_rustls::client::TlsStream<TcpStream>>),
    /// Cleartext TCP on the worker's io_uring (`[server] io_uring`): it
    /// works only on the worker that opened it, so the pool never hands it
    /// to another.
    Uring(pier_uring::UringStream),
}

/// An upstream's TLS: the rustls config and the name to send as SNI and
/// verify (the key's `sni` decides whether TLS is used at all).
pub type ClientConfig = Arc<rustls::ClientConfig>;

/// Makes in-memory upstream connections (see [`Connector::memory`]).
pub type MemoryDialer = dyn Fn(&PeerKey) -> io::Result<DuplexStream> + Send + Sync;

/// Opens upstream connections for a peer key.
#[derive(Clone, Default)]
pub struct Connector {
    memory: Option<Arc<MemoryDialer>>,
    /// Cleartext connections go on the worker's io_uring when it has one.
    ring: Arc<std::sync::atomic::AtomicBool>,
}

impl Connector {
    /// TCP to the key's address.
    pub fn tcp() -> Self {
        Connector::default()
    }
    /// Every connection is an in-memory pipe made by `dial` (in-process
    /// origins; tests that prove the engine needs no socket).
    pub fn memory(dial: Arc<MemoryDialer>) -> Self {
        Connector {
            memory: Some(dial),
            ..Connector::default()
        }
    }

    /// Put new cleartext connections on the calling worker's io_uring
    /// (set up on first use; a worker without one stays on epoll). Any
    /// thread may set the flag; `connect` must then run on a worker's
    /// runtime, since setting a ring up spawns its task there.
    pub fn set_io_uring(&self, on: bool) {
        self.ring.store(on, std::sync::atomic::Ordering::Relaxed);
    }

    /// A new connection, within `limit`. A timeout is an error of kind
    /// `TimedOut`: nothing was sent, so any request may go elsewhere.
    ///
    /// With `key.sni` set and a `tls` config, the TLS handshake is part of
    /// the connect (and of its time limit); a handshake failure is an error
    /// of kind `InvalidData` carrying the rustls error (nothing was sent).
    pub async fn connect(
        &self,
        key: &PeerKey,
        limit: Duration,
        tls: Option<&ClientConfig>,
    ) -> io::Result<Conn> {
        if let Some(dial) = &self.memory {
            return dial(key).map(Conn::Mem);
        }
        let open = async {
            let mut s = TcpStream::connect(key.addr).await?;
            let _ = s.set_nodelay(true);
            if let Some(h) = &key.proxy {
                // Before TLS and HTTP: what the server reads first.
                tokio::io::AsyncWriteExt::write_all(&mut s, h).await?;
            }
            match (tls, &key.sni) {
                (Some(cfg), Some(name)) => {
                    let name = rustls::pki_types::ServerName::try_from(name.to_string())
                        .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
                    let t = tokio_rustls::TlsConnector::from(cfg.clone())
                        .connect(name, s)
                        .await?;
                    Ok(Conn::Tls(Box::new(t)))
                }
                _ if self.ring.load(std::sync::atomic::Ordering::Relaxed)
                    && pier_uring::ready() =>
                {
                    pier_uring::UringStream::new(s).map(Conn::Uring)
                }
                _ => Ok(Conn::Tcp(s)),
            }
        };
        match pier_clock::timeout(limit, open).await {
            Ok(r) => r,
            Err(_) => Err(io::ErrorKind::TimedOut.into()),
        }
    }
}

impl Conn {
    /// No read readiness recorded → nothing arrived, not even EOF (an idle
    /// HTTP/1.1 connection has nothing to say). Checked without a syscall.
    pub(crate) fn looks_alive(&self) -> bool {
        match self {
            Conn::Tcp(s) => crate::pool::tcp_looks_alive(s),
            // Anything readable on an idle TLS connection (a close_notify,
            // a late session ticket) is taken as a sign to not reuse it.
            Conn::Tls(s) => crate::pool::tcp_looks_alive(s.get_ref().0),
            Conn::Uring(s) => s.looks_alive(),
            Conn::Mem(_) => true,
        }
    }
    /// Another worker may take it from the pool: a ring's connection works
    /// only on its worker, and a TLS one stays with its reactor.
    pub(crate) fn movable(&self) -> bool {
        !matches!(self, Conn::Uring(_) | Conn::Tls(_))
    }
    /// Move to the calling thread's reactor (taken from another worker).
    pub(crate) fn adopt(self) -> Option<Conn> {
        match self {
            Conn::Tcp(s) => crate::pool::tcp_adopt(s).map(Conn::Tcp),
            // tokio-rustls cannot rebuild a stream around a re-registered
            // socket; the pool does not move TLS connections between workers.
            Conn::Tls(_) => None,
            Conn::Uring(s) => s.is_here().then_some(Conn::Uring(s)),
            m => Some(m),
        }
    }
}

type TlsClient = tokio_rustls::client::TlsStream<TcpStream>;

pub enum ConnRead<'a> {
    Tcp(tokio::net::tcp::ReadHalf<'a>),
    Mem(tokio::io::ReadHalf<&'a mut DuplexStream>),
    Tls(tokio::io::ReadHalf<&'a mut TlsClient>),
    Uring(pier_uring::UringHalf<'a>),
}
pub enum ConnWrite<'a> {
    Tcp(tokio::net::tcp::WriteHalf<'a>),
    Mem(tokio::io::WriteHalf<&'a mut DuplexStream>),
    Tls(tokio::io::WriteHalf<&'a mut TlsClient>),
    Uring(pier_uring::UringHalf<'a>),
}

impl Stream for Conn {
    type Read<'a> = ConnRead<'a>;
    type Write<'a> = ConnWrite<'a>;
    fn split(&mut self) -> (ConnRead<'_>, ConnWrite<'_>) {
        match self {
            Conn::Tcp(s) => {
                let (r, w) = s.split();
                (ConnRead::Tcp(r), ConnWrite::Tcp(w))
            }
            Conn::Mem(s) => {
                let (r, w) = tokio::io::split(s);
                (ConnRead::Mem(r), ConnWrite::Mem(w))
            }
            Conn::Tls(s) => {
                let (r, w) = tokio::io::split(&mut **s);
                (ConnRead::Tls(r), ConnWrite::Tls(w))
            }
            Conn::Uring(s) => {
                let (r, w) = s.split();
                (ConnRead::Uring(r), ConnWrite::Uring(w))
            }
        }
    }
}

/// Delegate the tokio I/O traits to each variant.
macro_rules! delegate_read {
    ($t:ty) => {
        impl AsyncRead for $t {
            fn poll_read(
                self: Pin<&mut Self>,
                cx: &mut Context<'_>,
                buf: &mut ReadBuf<'_>,
            ) -> Poll<io::Result<()>> {
                match self.get_mut() {
                    Self::Tcp(s) => Pin::new(s).poll_read(cx, buf),
                    Self::Mem(s) => Pin::new(s).poll_read(cx, buf),
                    Self::Tls(s) => Pin::new(s).poll_read(cx, buf),
                    Self::Uring(s) => Pin::new(s).poll_read(cx, buf),
                }
            }
        }
    };
}
macro_rules! delegate_write {
    ($t:ty) => {
        impl AsyncWrite for $t {
            fn poll_write(
                self: Pin<&mut Self>,
                cx: &mut Context<'_>,
                buf: &[u8],
            ) -> Poll<io::Result<usize>> {
                match self.get_mut() {
                    Self::Tcp(s) => Pin::new(s).poll_write(cx, buf),
                    Self::Mem(s) => Pin::new(s).poll_write(cx, buf),
                    Self::Tls(s) => Pin::new(s).poll_write(cx, buf),
                    Self::Uring(s) => Pin::new(s).poll_write(cx, buf),
                }
            }
            fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
                match self.get_mut() {
                    Self::Tcp(s) => Pin::new(s).poll_flush(cx),
                    Self::Mem(s) => Pin::new(s).poll_flush(cx),
                    Self::Tls(s) => Pin::new(s).poll_flush(cx),
                    Self::Uring(s) => Pin::new(s).poll_flush(cx),
                }
            }
            fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
                match self.get_mut() {
                    Self::Tcp(s) => Pin::new(s).poll_shutdown(cx),
                    Self::Mem(s) => Pin::new(s).poll_shutdown(cx),
                    Self::Tls(s) => Pin::new(s).poll_shutdown(cx),
                    Self::Uring(s) => Pin::new(s).poll_shutdown(cx),
                }
            }
        }
    };
}
delegate_read!(Conn);
delegate_write!(Conn);
delegate_read!(ConnRead<'_>);
delegate_write!(ConnWrite<'_>);
