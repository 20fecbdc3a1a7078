//! gRPC-web ⇄ gRPC (a route option): a browser's gRPC-web request goes to
//! the origin as gRPC over HTTP/2, and the answer comes back as gRPC-web,
//! its trailers as the last frame of the body (flag 0x80). The text forms
//! (`application/grpc-web-text`) are base64 both ways, decoded and encoded
//! as the body streams (never buffered whole).
//!
//! Both are wrappers over the session traits, so the driver's relay and
//! pump run unchanged.

use base64::Engine as _;
use pier_error::{Error, Kind};
use pier_http::known;
use pier_http::{Headers, RequestHead, ResponseHead};
use pier_session::{BodySize, RequestSource, ResponseSink};

const B64: base64::engine::GeneralPurpose = base64::engine::general_purpose::STANDARD;

/// Which gRPC-web form a request uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Form {
    Binary,
    Text,
}

/// The request's gRPC-web form, from its content-type.
pub fn form_of(req: &RequestHead) -> Option<Form> {
    let ct = req.headers.get_known(known::CONTENT_TYPE)?;
    let lower = ct.to_ascii_lowercase();
    if lower.starts_with(b"application/grpc-web-text") {
        Some(Form::Text)
    } else if lower.starts_with(b"application/grpc-web") {
        Some(Form::Binary)
    } else {
        None
    }
}

/// The upstream request as gRPC: content-type `application/grpc[+proto]`,
/// `te: trailers`, no length when the body was base64 (it changes).
pub fn to_grpc_request(up: &mut RequestHead, form: Form) {
    let suffix = up
        .headers
        .get_known(known::CONTENT_TYPE)
        .map(|ct| {
            let skip = match form {
                Form::Text => "application/grpc-web-text".len(),
                Form::Binary => "application/grpc-web".len(),
            };
            ct.get(skip..).unwrap_or(b"").to_vec()
        })
        .unwrap_or_default();
    let mut ct = b"application/grpc".to_vec();
    ct.extend_from_slice(&suffix);
    up.headers.remove_known(known::CONTENT_TYPE);
    up.headers.append(b"content-type", &ct);
    up.headers.remove_known(known::TE);
    up.headers.append(b"te", b"trailers");
    up.headers.remove(b"x-grpc-web");
}

/// The client's body, base64-decoded in the text form.
pub struct WebSource<S> {
    inner: S,
    form: Form,
    /// Base64 characters not yet decoded (fewer than a group of 4).
    carry: Vec<u8>,
    out: Vec<u8>,
}

impl<S> WebSource<S> {
    pub fn new(inner: S, form: Form) -> Self {
        WebSource {
            inner,
            form,
            carry: Vec::new(),
            out: Vec::new(),
        }
    }
}

impl<S: RequestSource> RequestSource for WebSource<S> {
    async fn read_body(&mut self) -> Result<Option<&[u8]>, Error> {
        if self.form == Form::Binary {
            return self.inner.read_body().await;
        }
        loop {
            let Some(piece) = self.inner.read_body().await? else {
                if self.carry.iter().any(|c| !c.is_ascii_whitespace()) {
                    return Err(Error::new(Kind::BadChunk));
                }
                return Ok(None);
            };
            self.carry
                .extend(piece.iter().copied().filter(|c| !c.is_ascii_whitespace()));
            let whole = self.carry.len() / 4 * 4;
            if whole == 0 {
                continue;
            }
            self.out.clear();
            // Padding may end any group (frames are encoded one by one), so
            // decode group by group past the first '='.
            for g in self.carry[..whole].chunks(4) {
                B64.decode_vec(g, &mut self.out)
                    .map_err(|_| Error::new(Kind::BadChunk))?;
            }
            self.carry.drain(..whole);
            return Ok(Some(&self.out));
        }
    }
    fn trailers(&self) -> Option<&Headers> {
        None
    }
}

/// The answer as gRPC-web.
pub struct WebSink<S> {
    inner: S,
    form: Form,
    /// grpc-status/grpc-message of a trailers-only answer (in its head).
    head_trailers: Vec<(Vec<u8>, Vec<u8>)>,
    /// Bytes not yet base64-encoded (fewer than 3).
    carry: Vec<u8>,
    enc: Vec<u8>,
}

impl<S> WebSink<S> {
    pub fn new(inner: S, form: Form) -> Self {
        WebSink {
            inner,
            form,
            head_trailers: Vec::new(),
            carry: Vec::new(),
            enc: Vec::new(),
        }
    }
}

impl<S: ResponseSink> WebSink<S> {
    async fn emit(&mut self, data: &[u8], flush: bool) -> Result<(), Error> {
        if self.form == Form::Binary {
            return self.inner.write_body(data).await;
        }
        self.carry.extend_from_slice(data);
        let whole = if flush {
            self.carry.len()
        } else {
            self.carry.len() / 3 * 3
        };
        if whole == 0 {
            return Ok(());
        }
        self.enc.clear();
        self.enc.resize(whole.div_ceil(3) * 4, 0);
        let n = B64
            .encode_slice(&self.carry[..whole], &mut self.enc)
            .map_err(|_| Error::new(Kind::Internal))?;
        self.enc.truncate(n);
        self.carry.drain(..whole);
        self.inner.write_body(&self.enc).await
    }
}

impl<S: ResponseSink> ResponseSink for WebSink<S> {
    async fn write_interim(&mut self, head: &ResponseHead) -> Result<(), Error> {
        self.inner.write_interim(head).await
    }

    async fn write_head(&mut self, head: &ResponseHead, _size: BodySize) -> Result<(), Error> {
        let mut h = head.clone();
        let suffix = h
            .headers
            .get_known(known::CONTENT_TYPE)
            .and_then(|ct| ct.strip_prefix(b"application/grpc"))
            .map(|s| s.to_vec())
            .unwrap_or_default();
        let mut ct = match self.form {
            Form::Text => b"application/grpc-web-text".to_vec(),
            Form::Binary => b"application/grpc-web".to_vec(),
        };
        ct.extend_from_slice(&suffix);
        h.headers.remove_known(known::CONTENT_TYPE);
        h.headers.append(b"content-type", &ct);
        h.headers.remove_known(known::CONTENT_LENGTH);
        for name in [&b"grpc-status"[..], b"grpc-message"] {
            if let Some(v) = head.headers.get(name) {
                self.head_trailers.push((name.to_vec(), v.to_vec()));
            }
        }
        // The trailer frame makes the length unknown up front.
        self.inner.write_head(&h, BodySize::Stream).await
    }

    async fn write_body(&mut self, data: &[u8]) -> Result<(), Error> {
        self.emit(data, false).await
    }

    async fn finish(&mut self, trailers: Option<&Headers>) -> Result<(), Error> {
        // Messages end here; the trailer frame is encoded on its own.
        self.emit(&[], true).await?;
        let mut block = Vec::new();
        match trailers {
            Some(t) if !t.is_empty() => {
                for (k, v) in t.iter() {
                    block.extend(k.iter().map(|c| c.to_ascii_lowercase()));
                    block.extend_from_slice(b":");
                    block.extend_from_slice(v);
                    block.extend_from_slice(b"\r\n");
                }
            }
            _ => {
                for (k, v) in &self.head_trailers {
                    block.extend_from_slice(k);
                    block.extend_from_slice(b":");
                    block.extend_from_slice(v);
                    block.extend_from_slice(b"\r\n");
                }
            }
        }
        let mut frame = Vec::with_capacity(5 + block.len());
        frame.push(0x80);
        frame.extend_from_slice(&(block.len() as u32).to_be_bytes());
        frame.extend_from_slice(&block);
        self.emit(&frame, true).await?;
        self.inner.finish(None).await
    }

    fn keep_alive(&self) -> bool {
        self.inner.keep_alive()
    }

    fn bytes_sent(&self) -> u64 {
        self.inner.bytes_sent()
    }
    const WATCHES_GONE: bool = S::WATCHES_GONE;
    async fn client_gone(&mut self) {
        self.inner.client_gone().await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base64_groups_decode_across_padding() {
        // Two frames encoded separately, so padding sits mid-stream.
        let a = B64.encode([0u8, 0, 0, 0, 1, 7]);
        let b = B64.encode([0x80u8, 0, 0, 0, 0]);
        let joined = format!("{a}{b}");
        let mut out = Vec::new();
        for g in joined.as_bytes().chunks(4) {
            B64.decode_vec(g, &mut out).unwrap();
        }
        assert_eq!(out, [0, 0, 0, 0, 1, 7, 0x80, 0, 0, 0, 0]);
    }
}
