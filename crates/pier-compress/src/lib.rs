//! Response compression (`[route.compress]`): gzip, brotli and zstd chosen
//! by the client's `Accept-Encoding` (q-values, `identity`, `*`), by media
//! type and size, as a body filter in the engine's one response pipeline
//! (pier-proxy's `driver::relay`, for proxied, cached and Pier-made
//! answers alike), over any client protocol: the writer frames the result
//! (chunked, or HTTP/2 DATA frames).
//!
//! With a cache, a fill is compressed *before* it is stored
//! ([`EncodeSource`] sits between the origin and the cache's tee): one
//! compressed copy is kept (in `store`'s coding), and a client that does
//! not accept that coding gets it decoded, and re-encoded in a coding it
//! does accept if there is one (Varnish's `http_gzip_support`).
//!
//! Never on HEAD, 1xx/204/304, 206 or a request with `Range`,
//! `Cache-Control: no-transform`, or a body already in another coding.

use bytes::BytesMut;
use pier_config::{Coding, Compress};
use pier_error::{Error, Kind};
use pier_http::{known, Headers, Method, RequestHead, ResponseHead};
use pier_session::{BodySize, ResponseSource};
use std::io::Write;

/// Input fed to a decoder at a time: what one feed may expand to is
/// bounded by [`MAX_EXPANSION`], so a decompression bomb ends the response
/// instead of filling memory.
const FEED: usize = 512;
/// Decoded bytes one [`FEED`] of input may produce.
const MAX_EXPANSION: usize = 16 << 20;
/// Decoded bytes handed on at once (then the next piece is decoded).
const PIECE: usize = 128 << 10;
/// Brotli's window (2^19 = 512 KiB, as ngx_brotli): memory per stream.
const BR_LGWIN: u32 = 19;
/// zstd's window when encoding, and the largest accepted when decoding.
const ZSTD_WINDOW_LOG: u32 = 19;
const ZSTD_WINDOW_LOG_MAX: u32 = 23;

// === negotiation ===

/// The weight (0..=1000) the client's `Accept-Encoding` gives `coding`:
/// its own entry, else `*`'s, else 0. `None` when the field is absent.
fn weight(ae: &[u8], coding: Coding) -> u32 {
    let mut star = None;
    for item in ae.split(|&c| c == b',') {
        let mut parts = item.split(|&c| c == b';');
        let tok = parts.next().unwrap_or(b"").trim_ascii();
        if tok.is_empty() {
            continue;
        }
        let mut q = 1000;
        for p in parts {
            let p = p.trim_ascii();
            if p.len() > 2 && p[..2].eq_ignore_ascii_case(b"q=") {
                q = qvalue(&p[2..]).unwrap_or(0);
            }
        }
        if tok == b"*" {
            star = Some(q);
        } else if Coding::from_token(tok) == Some(coding) {
            return q;
        }
    }
    star.unwrap_or(0)
}

/// RFC 9110 §12.4.2 qvalue in thousandths; None if malformed.
fn qvalue(v: &[u8]) -> Option<u32> {
    let (int, frac) = match v.iter().position(|&c| c == b'.') {
        Some(i) => (&v[..i], &v[i + 1..]),
        None => (v, &b""[..]),
    };
    if int.len() != 1 || frac.len() > 3 || !frac.iter().all(u8::is_ascii_digit) {
        return None;
    }
    let mut n = match int[0] {
        b'0' => 0,
        b'1' => 1000,
        _ => return None,
    };
    let mut scale = 100;
    for &d in frac {
        n += u32::from(d - b'0') * scale;
        scale /= 10;
    }
    (n <= 1000).then_some(n)
}

/// Does the client take a body in `coding`? No `Accept-Encoding`: no (as
/// nginx and Varnish read it; RFC 9110 allows any, but clients that send
/// none often can't decode).
pub fn accepts(ae: Option<&[u8]>, coding: Coding) -> bool {
    ae.is_some_and(|ae| weight(ae, coding) > 0)
}

/// The coding to send: the highest weight among `offered`, ties going to
/// the earlier in `offered` (the route's order); None for identity.
pub fn negotiate(ae: Option<&[u8]>, offered: &[Coding]) -> Option<Coding> {
    let ae = ae?;
    let mut best: Option<(Coding, u32)> = None;
    for &c in offered {
        let w = weight(ae, c);
        if w > 0 && best.is_none_or(|(_, b)| w > b) {
            best = Some((c, w));
        }
    }
    best.map(|(c, _)| c)
}

/// Does the media type of `ct` match one of `types` (`type/sub`, `type/*`
/// or `*`)?
fn type_matches(types: &[String], ct: &[u8]) -> bool {
    let mt = ct.split(|&c| c == b';').next().unwrap_or(b"").trim_ascii();
    if mt.is_empty() {
        return false;
    }
    types.iter().any(|t| {
        let t = t.as_bytes();
        if t == b"*" || t == b"*/*" {
            return true;
        }
        match t.strip_suffix(b"/*") {
            Some(main) => {
                mt.len() > main.len()
                    && mt[..main.len()].eq_ignore_ascii_case(main)
                    && mt[main.len()] == b'/'
            }
            None => mt.eq_ignore_ascii_case(t),
        }
    })
}

fn has_token(headers: &Headers, name: &[u8], token: &[u8]) -> bool {
    headers.get_all(name).any(|v| {
        v.split(|&c| c == b',')
            .any(|t| t.trim_ascii().eq_ignore_ascii_case(token))
    })
}

/// The response's single content coding: Ok(None) for none/identity,
/// Ok(Some) for one Pier knows, Err for anything else (left alone).
fn content_coding(h: &Headers) -> Result<Option<Coding>, ()> {
    let mut it = h.get_all(b"content-encoding");
    let Some(v) = it.next() else {
        return Ok(None);
    };
    if it.next().is_some() || v.contains(&b',') {
        return Err(());
    }
    let v = v.trim_ascii();
    if v.is_empty() || v.eq_ignore_ascii_case(b"identity") {
        return Ok(None);
    }
    Coding::from_token(v).map(Some).ok_or(())
}

/// `"x"` → `W/"x"`: the body is no longer byte-for-byte the origin's.
fn weaken_etag(h: &mut Headers) {
    if let Some(e) = h.get(b"etag") {
        if !e.starts_with(b"W/") {
            let mut w = Vec::with_capacity(e.len() + 2);
            w.extend_from_slice(b"W/");
            w.extend_from_slice(e);
            h.insert(b"ETag", &w);
        }
    }
}

fn add_vary(h: &mut Headers) {
    if !has_token(h, b"vary", b"accept-encoding") && !has_token(h, b"vary", b"*") {
        h.append(b"Vary", b"Accept-Encoding");
    }
}

/// What happens to this response's body; None: it goes as it is.
/// Edits the head to match (Content-Encoding, Content-Length removed,
/// weak ETag, `Vary: Accept-Encoding`). `cfg`: the route's settings, when
/// the request may have its response transformed at all (the engine's
/// call: not for a Range request, gRPC or gRPC-web); `req` is the client's.
pub fn plan(
    cfg: Option<&Compress>,
    req: &RequestHead,
    resp: &mut ResponseHead,
    size: BodySize,
) -> Option<Box<Codec>> {
    let cfg = cfg?;
    if size == BodySize::None || req.method_kind() == Method::Head {
        head_only(cfg, req, resp);
        return None;
    }
    if matches!(resp.status, 100..=199 | 204 | 206 | 304)
        || has_token(&resp.headers, b"cache-control", b"no-transform")
    {
        return None;
    }
    let coding = content_coding(&resp.headers).ok()?;
    let type_ok = resp
        .headers
        .get_known(known::CONTENT_TYPE)
        .is_some_and(|ct| type_matches(&cfg.types, ct));
    if !type_ok && coding.is_none() {
        return None;
    }
    // The answer depends on Accept-Encoding whichever way it goes.
    add_vary(&mut resp.headers);
    let ae = req.headers.get(b"accept-encoding");
    let (dec, enc) = match coding {
        None => {
            if matches!(size, BodySize::Length(n) if n < cfg.min_size) {
                return None;
            }
            (None, Some(negotiate(ae, &cfg.algorithms)?))
        }
        Some(c) if accepts(ae, c) => return None,
        Some(c) => (
            Some(c),
            if type_ok {
                negotiate(ae, &cfg.algorithms)
            } else {
                None
            },
        ),
    };
    let codec = Codec::new(dec, enc, cfg.level).ok()?;
    set_coding(&mut resp.headers, enc);
    Some(Box::new(codec))
}

/// A response without a body (HEAD, 304…) of a stored copy in a coding
/// this client does not take: its head says what a GET would get (the
/// coding dropped, or the one negotiated), with no length.
fn head_only(cfg: &Compress, req: &RequestHead, resp: &mut ResponseHead) {
    if matches!(resp.status, 100..=199 | 206)
        || has_token(&resp.headers, b"cache-control", b"no-transform")
    {
        return;
    }
    let Ok(Some(c)) = content_coding(&resp.headers) else {
        return;
    };
    let ae = req.headers.get(b"accept-encoding");
    if accepts(ae, c) {
        return;
    }
    let type_ok = resp
        .headers
        .get_known(known::CONTENT_TYPE)
        .is_some_and(|ct| type_matches(&cfg.types, ct));
    add_vary(&mut resp.headers);
    let enc = if type_ok {
        negotiate(ae, &cfg.algorithms)
    } else {
        None
    };
    set_coding(&mut resp.headers, enc);
}

fn set_coding(h: &mut Headers, enc: Option<Coding>) {
    h.remove_known(known::CONTENT_LENGTH);
    match enc {
        Some(c) => h.insert(b"Content-Encoding", c.token().as_bytes()),
        None => {
            h.remove(b"content-encoding");
        }
    }
    weaken_etag(h);
}

// === coders ===

fn enc_err(e: std::io::Error) -> Error {
    tracing::debug!("compress: {e}");
    Error::answered(Kind::Internal)
}

fn dec_err(e: std::io::Error) -> Error {
    tracing::debug!("decompress: {e}");
    Error::answered(Kind::UpstreamProtocol)
}

enum Enc {
    Gzip(flate2::write::GzEncoder<Vec<u8>>),
    Br(Box<brotli::CompressorWriter<Vec<u8>>>),
    Zstd(zstd::stream::write::Encoder<'static, Vec<u8>>),
}

impl Enc {
    fn new(c: Coding, level: Option<i32>) -> std::io::Result<Enc> {
        Ok(match c {
            Coding::Gzip => Enc::Gzip(flate2::write::GzEncoder::new(
                Vec::new(),
                flate2::Compression::new(level.unwrap_or(6).clamp(1, 9) as u32),
            )),
            Coding::Br => Enc::Br(Box::new(brotli::CompressorWriter::new(
                Vec::new(),
                4096,
                level.unwrap_or(5).clamp(0, 11) as u32,
                BR_LGWIN,
            ))),
            Coding::Zstd => {
                let mut e =
                    zstd::stream::write::Encoder::new(Vec::new(), level.unwrap_or(3).clamp(1, 19))?;
                e.window_log(ZSTD_WINDOW_LOG)?;
                Enc::Zstd(e)
            }
        })
    }
    fn write(&mut self, data: &[u8]) -> std::io::Result<()> {
        match self {
            Enc::Gzip(e) => e.write_all(data),
            Enc::Br(e) => e.write_all(data),
            Enc::Zstd(e) => e.write_all(data),
        }
    }
    fn out(&mut self) -> &mut Vec<u8> {
        match self {
            Enc::Gzip(e) => e.get_mut(),
            Enc::Br(e) => e.get_mut(),
            Enc::Zstd(e) => e.get_mut(),
        }
    }
    fn finish(self) -> std::io::Result<Vec<u8>> {
        match self {
            Enc::Gzip(e) => e.finish(),
            Enc::Br(e) => Ok(e.into_inner()),
            Enc::Zstd(e) => e.finish(),
        }
    }
}

/// A decoder's output: refuses to grow past [`MAX_EXPANSION`] between
/// drains (a decompression bomb is an error, not memory).
struct Capped(Vec<u8>);

impl Write for Capped {
    fn write(&mut self, data: &[u8]) -> std::io::Result<usize> {
        if self.0.len() + data.len() > MAX_EXPANSION {
            return Err(std::io::Error::other("decoded body expands too much"));
        }
        self.0.extend_from_slice(data);
        Ok(data.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

enum Dec {
    Gzip(flate2::write::GzDecoder<Capped>),
    Br(Box<brotli::DecompressorWriter<Capped>>),
    Zstd(zstd::stream::write::Decoder<'static, Capped>),
}

impl Dec {
    fn new(c: Coding) -> std::io::Result<Dec> {
        Ok(match c {
            Coding::Gzip => Dec::Gzip(flate2::write::GzDecoder::new(Capped(Vec::new()))),
            Coding::Br => Dec::Br(Box::new(brotli::DecompressorWriter::new(
                Capped(Vec::new()),
                4096,
            ))),
            Coding::Zstd => {
                let mut d = zstd::stream::write::Decoder::new(Capped(Vec::new()))?;
                d.window_log_max(ZSTD_WINDOW_LOG_MAX)?;
                Dec::Zstd(d)
            }
        })
    }
    fn write(&mut self, data: &[u8]) -> std::io::Result<()> {
        match self {
            Dec::Gzip(d) => d.write_all(data),
            Dec::Br(d) => d.write_all(data),
            Dec::Zstd(d) => d.write_all(data),
        }
    }
    fn out(&mut self) -> &mut Vec<u8> {
        match self {
            Dec::Gzip(d) => &mut d.get_mut().0,
            Dec::Br(d) => &mut d.get_mut().0,
            Dec::Zstd(d) => &mut d.get_mut().0,
        }
    }
    /// The stream ended: flush what is left; an incomplete stream is an error.
    fn finish(&mut self) -> std::io::Result<()> {
        match self {
            Dec::Gzip(d) => d.try_finish(),
            Dec::Br(d) => d.close(),
            Dec::Zstd(d) => d.flush(),
        }
    }
}

/// One response's body transformation: decode (a stored or origin coding
/// the client does not take), then encode (the negotiated coding).
pub struct Codec {
    dec: Option<Dec>,
    enc: Option<Enc>,
}

impl Codec {
    fn new(dec: Option<Coding>, enc: Option<Coding>, level: Option<i32>) -> std::io::Result<Codec> {
        Ok(Codec {
            dec: dec.map(Dec::new).transpose()?,
            enc: enc.map(|c| Enc::new(c, level)).transpose()?,
        })
    }

    /// Move the next part of `input` into `out`, decoded when there is a
    /// decoder (at most about [`PIECE`] bytes a call); true while `input`
    /// has more (call again before reading further).
    pub fn decode_into(&mut self, input: &mut &[u8], out: &mut BytesMut) -> Result<bool, Error> {
        let Some(d) = &mut self.dec else {
            out.extend_from_slice(input);
            *input = &[];
            return Ok(false);
        };
        while !input.is_empty() && out.len() < PIECE {
            let n = input.len().min(FEED);
            d.write(&input[..n]).map_err(dec_err)?;
            *input = &input[n..];
            let o = d.out();
            out.extend_from_slice(o);
            o.clear();
        }
        Ok(!input.is_empty())
    }

    /// The body ended: the decoder's last bytes into `out`.
    pub fn decode_finish(&mut self, out: &mut BytesMut) -> Result<(), Error> {
        if let Some(d) = &mut self.dec {
            d.finish().map_err(dec_err)?;
            let o = d.out();
            out.extend_from_slice(o);
            o.clear();
        }
        Ok(())
    }

    /// Replace `p` by its encoding (possibly empty: the encoder buffers).
    pub fn encode(&mut self, p: &mut BytesMut) -> Result<(), Error> {
        let Some(e) = &mut self.enc else {
            return Ok(());
        };
        e.write(p).map_err(enc_err)?;
        p.clear();
        let o = e.out();
        p.extend_from_slice(o);
        o.clear();
        Ok(())
    }

    /// The body ended: `p` (decoded, filtered) and the encoder's trailer
    /// become `p`'s encoding.
    pub fn encode_finish(&mut self, p: &mut BytesMut) -> Result<(), Error> {
        if self.enc.is_none() {
            return Ok(());
        }
        self.encode(p)?;
        if let Some(e) = self.enc.take() {
            p.extend_from_slice(&e.finish().map_err(enc_err)?);
        }
        Ok(())
    }
}

// === the cache's copy ===

/// Between the origin and the cache's tee on a fill of a route with
/// `[route.compress]`: a compressible identity body is encoded in the
/// route's `store` coding, so the cache keeps one compressed copy whatever
/// this client accepts (delivery decodes it for clients that don't).
pub struct EncodeSource<'a, S> {
    inner: S,
    store: Option<&'a Compress>,
    enc: Option<Enc>,
    out: Vec<u8>,
    done: bool,
}

impl<'a, S> EncodeSource<'a, S> {
    /// `store`: the route's settings, as for [`plan`].
    pub fn new(inner: S, store: Option<&'a Compress>) -> Self {
        EncodeSource {
            inner,
            store,
            enc: None,
            out: Vec::new(),
            done: false,
        }
    }
}

impl<S: ResponseSource> ResponseSource for EncodeSource<'_, S> {
    const STORED: bool = S::STORED;
    fn origin_head(&mut self, head: &mut ResponseHead, req: &pier_http::Headers) {
        self.inner.origin_head(head, req)
    }
    async fn read_head(&mut self, head: &mut ResponseHead) -> Result<(), Error> {
        self.inner.read_head(head).await?;
        let Some(cfg) = self.store else {
            return Ok(());
        };
        let (coding, level, types, min) = (&cfg.store, &cfg.level, &cfg.types, &cfg.min_size);
        let size = self.inner.body_size();
        if head.status != 200
            || size == BodySize::None
            || matches!(size, BodySize::Length(n) if n < *min)
            || has_token(&head.headers, b"cache-control", b"no-transform")
            || !matches!(content_coding(&head.headers), Ok(None))
            || !head
                .headers
                .get_known(known::CONTENT_TYPE)
                .is_some_and(|ct| type_matches(types, ct))
        {
            return Ok(());
        }
        if let Ok(e) = Enc::new(*coding, *level) {
            self.enc = Some(e);
            set_coding(&mut head.headers, Some(*coding));
        }
        Ok(())
    }

    fn body_size(&self) -> BodySize {
        match (&self.enc, self.done) {
            (None, false) => self.inner.body_size(),
            _ => BodySize::Stream,
        }
    }

    async fn read_body(&mut self) -> Result<Option<(&[u8], bool)>, Error> {
        let Some(e) = &mut self.enc else {
            if self.done {
                return Ok(None);
            }
            return self.inner.read_body().await;
        };
        self.out.clear();
        match self.inner.read_body().await? {
            Some((data, _)) => {
                e.write(data).map_err(enc_err)?;
                std::mem::swap(&mut self.out, e.out());
                Ok(Some((&self.out, false)))
            }
            None => {
                let e = self.enc.take().expect("checked above");
                self.out = e.finish().map_err(enc_err)?;
                self.done = true;
                Ok(Some((&self.out, true)))
            }
        }
    }

    fn trailers(&self) -> Option<&pier_http::Headers> {
        self.inner.trailers()
    }

    fn reusable(&self) -> bool {
        self.inner.reusable()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn negotiation() {
        let all = [Coding::Br, Coding::Zstd, Coding::Gzip];
        let n = |ae: &str| negotiate(Some(ae.as_bytes()), &all);
        assert_eq!(negotiate(None, &all), None);
        assert_eq!(n("gzip, deflate"), Some(Coding::Gzip));
        assert_eq!(n("gzip, br, zstd"), Some(Coding::Br));
        assert_eq!(n("gzip;q=1.0, br;q=0.5"), Some(Coding::Gzip));
        assert_eq!(n("br;q=0, gzip;q=0.001"), Some(Coding::Gzip));
        assert_eq!(n("br;q=0, gzip;q=0, zstd;q=0"), None);
        assert_eq!(n("*"), Some(Coding::Br));
        assert_eq!(n("*;q=0.5, br;q=0"), Some(Coding::Zstd));
        assert_eq!(n("identity"), None);
        assert_eq!(n("GZIP ; Q=0.8"), Some(Coding::Gzip));
        assert_eq!(n("gzip;q=2"), None, "malformed qvalue counts as 0");
        assert_eq!(n("gzip;q=0.1234"), None);
        assert_eq!(n("x-gzip"), Some(Coding::Gzip));
        assert!(!accepts(Some(b"gzip;q=0"), Coding::Gzip));
        assert!(accepts(Some(b"*"), Coding::Zstd));
        assert!(!accepts(None, Coding::Gzip));
    }

    #[test]
    fn types() {
        let t = vec!["text/*".to_string(), "application/json".to_string()];
        assert!(type_matches(&t, b"text/html; charset=utf-8"));
        assert!(type_matches(&t, b"Application/JSON"));
        assert!(!type_matches(&t, b"textual/html"));
        assert!(!type_matches(&t, b"image/png"));
        assert!(!type_matches(&t, b""));
    }

    fn roundtrip(c: Coding) {
        let body: Vec<u8> = (0..200_000u32)
            .flat_map(|i| format!("line {} of a text body\n", i % 977).into_bytes())
            .collect();
        let mut enc = Codec::new(None, Some(c), None).unwrap();
        let mut wire = Vec::new();
        for piece in body.chunks(7_000) {
            let mut p = BytesMut::from(piece);
            enc.encode(&mut p).unwrap();
            wire.extend_from_slice(&p);
        }
        let mut p = BytesMut::new();
        enc.encode_finish(&mut p).unwrap();
        wire.extend_from_slice(&p);
        assert!(wire.len() < body.len() / 5, "{c:?}: {}", wire.len());
        let mut dec = Codec::new(Some(c), None, None).unwrap();
        let mut back = Vec::new();
        for piece in wire.chunks(3_000) {
            let mut input = piece;
            loop {
                let mut out = BytesMut::new();
                let more = dec.decode_into(&mut input, &mut out).unwrap();
                assert!(out.len() <= PIECE + MAX_EXPANSION);
                back.extend_from_slice(&out);
                if !more {
                    break;
                }
            }
        }
        let mut out = BytesMut::new();
        dec.decode_finish(&mut out).unwrap();
        back.extend_from_slice(&out);
        assert!(back == body, "{c:?} round trip");
        // A truncated stream is an error at its end, not a silent cut.
        let mut dec = Codec::new(Some(c), None, None).unwrap();
        let mut input = &wire[..wire.len() / 2];
        let mut out = BytesMut::new();
        while dec.decode_into(&mut input, &mut out).unwrap() {
            out.clear();
        }
        assert!(dec.decode_finish(&mut out).is_err() || c == Coding::Zstd);
    }

    #[test]
    fn round_trips() {
        roundtrip(Coding::Gzip);
        roundtrip(Coding::Br);
        roundtrip(Coding::Zstd);
    }

    #[test]
    fn expansion_is_capped() {
        let mut c = Capped(Vec::new());
        assert!(c.write_all(&vec![0; MAX_EXPANSION]).is_ok());
        assert!(c.write_all(b"x").is_err());
    }

    #[test]
    fn decoding_is_bounded_per_piece() {
        // 64 MiB of zeros gzip to ~64 KiB: one feed would expand past the cap.
        let mut e = Codec::new(None, Some(Coding::Gzip), Some(9)).unwrap();
        let mut wire = Vec::new();
        for _ in 0..64 {
            let mut p = BytesMut::from(&vec![0u8; 1 << 20][..]);
            e.encode(&mut p).unwrap();
            wire.extend_from_slice(&p);
        }
        let mut p = BytesMut::new();
        e.encode_finish(&mut p).unwrap();
        wire.extend_from_slice(&p);
        let mut d = Codec::new(Some(Coding::Gzip), None, None).unwrap();
        let mut input = &wire[..];
        let mut total = 0;
        let mut peak = 0;
        loop {
            let mut out = BytesMut::new();
            match d.decode_into(&mut input, &mut out) {
                Ok(more) => {
                    total += out.len();
                    peak = peak.max(out.len());
                    if !more {
                        break;
                    }
                }
                Err(_) => break,
            }
        }
        // gzip expands at most ~1032:1, so this one decodes, in bounded pieces.
        assert!(peak < PIECE + 2 * 1032 * FEED, "{peak}");
        assert!(total > 0);
    }
}
