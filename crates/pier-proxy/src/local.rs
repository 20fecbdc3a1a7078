//! A response Pier makes itself (an error, a limit's refusal, a hook's
//! answer) as a `ResponseSource`: it goes down the one response pipeline
//! (`driver::relay`) a proxied response and a cache hit take — response
//! rules and CORS, `response_filter`, body filters, compression, the
//! session's writer — with only the origin's steps (`upstream_response_filter`,
//! the cache store, upstream timing) skipped.

use crate::phases::LocalResponse;
use pier_error::Error;
use pier_http::known;
use pier_http::{Headers, ResponseHead};
use pier_session::{BodySize, ResponseSource};

pub struct LocalSource<'r> {
    r: &'r LocalResponse,
    /// A gRPC client's content type: the answer goes as a trailers-only
    /// gRPC response (grpc-status in its head, no body).
    grpc: Option<&'static [u8]>,
    sent: bool,
}

impl<'r> LocalSource<'r> {
    pub fn new(r: &'r LocalResponse, grpc: Option<&'static [u8]>) -> Self {
        LocalSource {
            r,
            grpc,
            sent: false,
        }
    }
}

impl ResponseSource for LocalSource<'_> {
    const FROM_ORIGIN: bool = false;

    async fn read_head(&mut self, head: &mut ResponseHead) -> Result<(), Error> {
        local_head(head, self.r);
        if let Some(ct) = self.grpc {
            pier_grpc::shape(head, self.r.reason, ct);
        }
        Ok(())
    }

    fn body_size(&self) -> BodySize {
        match self.grpc {
            Some(_) => BodySize::None,
            None => BodySize::Length(self.r.body.len() as u64),
        }
    }

    async fn read_body(&mut self) -> Result<Option<(&[u8], bool)>, Error> {
        if self.sent || self.grpc.is_some() || self.r.body.is_empty() {
            return Ok(None);
        }
        self.sent = true;
        Ok(Some((&self.r.body, true)))
    }

    fn trailers(&self) -> Option<&Headers> {
        None
    }

    fn reusable(&self) -> bool {
        false
    }
}

/// The head of a Pier-made response (the writer frames its body).
pub(crate) fn local_head(head: &mut ResponseHead, r: &LocalResponse) {
    head.headers.clear();
    head.version = 1;
    head.set_status(r.status);
    head.headers.append(b"Server", b"pier");
    let mut has_ct = false;
    for (n, v) in &r.headers {
        // A hook's framing fields are not the writer's.
        if matches!(
            known::lookup(n),
            known::CONTENT_LENGTH | known::TRANSFER_ENCODING
        ) {
            continue;
        }
        has_ct |= n.eq_ignore_ascii_case(b"content-type");
        head.headers.append(n, v);
    }
    if !has_ct {
        head.headers.append(b"Content-Type", b"text/plain");
    }
    if !r.reason.is_empty() {
        head.headers.append(b"x-pier-reason", r.reason.as_bytes());
    }
}
