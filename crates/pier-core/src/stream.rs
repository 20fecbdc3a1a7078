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
    type Write<'a>: AsyncWrite + Unpin
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
}

impl Stream for TcpStream {
    type Read<'a> = tokio::net::tcp::ReadHalf<'a>;
    type Write<'a> = tokio::net::tcp::WriteHalf<'a>;
    fn split(&mut self) -> (Self::Read<'_>, Self::Write<'_>) {
        TcpStream::split(self)
    }
    async fn readable(&self) -> io::Result<()> {
        TcpStream::readable(self).await
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
}

impl PeerKey {
    /// Cleartext HTTP/1.1 to `addr`.
    pub fn plain(addr: SocketAddr) -> Self {
        PeerKey {
            addr,
            sni: None,
            alpn: Alpn::Http1,
        }
    }
}

/// An upstream connection.
pub enum Conn {
    Tcp(TcpStream),
    Mem(DuplexStream),
}

/// Makes in-memory upstream connections (see [`Connector::memory`]).
pub type MemoryDialer = dyn Fn(&PeerKey) -> io::Result<DuplexStream> + Send + Sync;

/// Opens upstream connections for a peer key.
#[derive(Clone, Default)]
pub struct Connector {
    memory: Option<Arc<MemoryDialer>>,
}

impl Connector {
    /// TCP to the key's address.
    pub fn tcp() -> Self {
        Connector::default()
    }
    /// Every connection is an in-memory pipe made by `dial` (in-process
    /// origins; tests that prove the engine needs no socket).
    pub fn memory(dial: Arc<MemoryDialer>) -> Self {
        Connector { memory: Some(dial) }
    }

    /// A new connection, within `limit`. A timeout is an error of kind
    /// `TimedOut`: nothing was sent, so any request may go elsewhere.
    pub async fn connect(&self, key: &PeerKey, limit: Duration) -> io::Result<Conn> {
        if let Some(dial) = &self.memory {
            return dial(key).map(Conn::Mem);
        }
        match tokio::time::timeout(limit, TcpStream::connect(key.addr)).await {
            Ok(Ok(s)) => {
                let _ = s.set_nodelay(true);
                Ok(Conn::Tcp(s))
            }
            Ok(Err(e)) => Err(e),
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
            Conn::Mem(_) => true,
        }
    }
    /// Move to the calling thread's reactor (taken from another worker).
    pub(crate) fn adopt(self) -> Option<Conn> {
        match self {
            Conn::Tcp(s) => crate::pool::tcp_adopt(s).map(Conn::Tcp),
            m => Some(m),
        }
    }
}

pub enum ConnRead<'a> {
    Tcp(tokio::net::tcp::ReadHalf<'a>),
    Mem(tokio::io::ReadHalf<&'a mut DuplexStream>),
}
pub enum ConnWrite<'a> {
    Tcp(tokio::net::tcp::WriteHalf<'a>),
    Mem(tokio::io::WriteHalf<&'a mut DuplexStream>),
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
                }
            }
            fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
                match self.get_mut() {
                    Self::Tcp(s) => Pin::new(s).poll_flush(cx),
                    Self::Mem(s) => Pin::new(s).poll_flush(cx),
                }
            }
            fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
                match self.get_mut() {
                    Self::Tcp(s) => Pin::new(s).poll_shutdown(cx),
                    Self::Mem(s) => Pin::new(s).poll_shutdown(cx),
                }
            }
        }
    };
}
delegate_read!(Conn);
delegate_write!(Conn);
delegate_read!(ConnRead<'_>);
delegate_write!(ConnWrite<'_>);
