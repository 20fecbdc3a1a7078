//! `ConfigPhases`: the phases a config file gives every route — `[[limit]]` rules, then
//! the route's Lua hooks (pier-lua), each only when configured, so a route
//! with neither costs two empty-slice checks.
//!
//! One instance per worker thread: it owns that thread's Lua engine (a
//! LuaJIT state is single-threaded), rebuilt when a reload bumps the config
//! generation.

use bytes::BytesMut;
use pier_config::LimitKeyPart;
use pier_config::{Config, LuaSource};
use pier_error::{Error, Kind};
use pier_http::{Headers, ResponseHead};
use pier_limits::Decision;
use pier_lua::{HttpView, LuaEngine, LuaSetup, Phase, RouteHooks, Source};
use pier_proxy::state::{LimitRt, State};
use pier_proxy::{Flow, LocalResponse, PeerChoice, Phases, Session};
use std::cell::RefCell;
use std::net::SocketAddr;
use std::rc::Rc;
use std::sync::Arc;

#[derive(Default)]
pub struct ConfigPhases {
    engine: RefCell<Option<(u64, Rc<LuaEngine>)>>,
    /// Reused buffer for limit keys (no allocation per request).
    keybuf: RefCell<Vec<u8>>,
}

/// Per-request state.
#[derive(Default)]
pub struct ConfigCtx {
    lua: Option<pier_lua::RequestCtx>,
    /// Concurrency-limit slots, released when the request ends.
    guards: Vec<pier_limits::Guard>,
    /// Response headers set before there is a response (Lua `access`).
    pending: Headers,
    engine: Option<Rc<LuaEngine>>,
    /// `pier.cache` controls (boxed: most requests set none).
    cache: Option<Box<pier_proxy::CacheCtl>>,
    /// The request body when a hook reads it (`ngx.req.read_body`).
    body: pier_proxy::ReqBody,
}

impl ConfigPhases {
    pub fn new() -> Self {
        Self::default()
    }

    /// This thread's engine for the config generation `st` belongs to.
    fn engine(&self, st: &State) -> Result<Option<Rc<LuaEngine>>, Error> {
        let Some(setup) = setup_of(st) else {
            // A reload that removed Lua: the old engine goes, and its timers
            // (which hold it weakly) with it.
            if self.engine.borrow().is_some() {
                self.engine.borrow_mut().take();
            }
            return Ok(None);
        };
        if let Some((g, e)) = &*self.engine.borrow() {
            if *g == st.generation {
                return Ok(Some(e.clone()));
            }
        }
        let e = LuaEngine::with_limits(setup, st.shdicts.clone(), lua_limits(&st.cfg)).map_err(
            |e| {
                tracing::error!(target: "pier::lua", "cannot start the Lua engine: {e}");
                Error::with_detail(Kind::HookError, e)
            },
        )?;
        e.start_timers();
        let e = Rc::new(e);
        *self.engine.borrow_mut() = Some((st.generation, e.clone()));
        Ok(Some(e))
    }

    /// The engine, if this route has a hook for `phase`.
    fn hook(
        &self,
        st: &State,
        s: &Session,
        ctx: &mut ConfigCtx,
        phase: Phase,
    ) -> Result<Option<Rc<LuaEngine>>, Error> {
        let Some(route) = s.route else {
            return Ok(None);
        };
        if st.scripts.is_none() {
            return Ok(None);
        }
        let e = match &ctx.engine {
            Some(e) => e.clone(),
            None => match self.engine(st)? {
                Some(e) => {
                    ctx.engine = Some(e.clone());
                    e
                }
                None => return Ok(None),
            },
        };
        Ok(e.has_hook(route, phase).then_some(e))
    }

    /// Build a limit key into `buf`; `false` if a part is missing (the rule
    /// does not apply, as nginx skips empty keys).
    fn key(
        buf: &mut Vec<u8>,
        rule: &LimitRt,
        st: &State,
        s: &Session,
        peer: Option<SocketAddr>,
    ) -> bool {
        buf.clear();
        for part in &rule.rule.key {
            match part {
                LimitKeyPart::ClientIp => buf.extend_from_slice(s.client_ip.as_bytes()),
                LimitKeyPart::Header(h) => match s.up_req.headers.get(h.as_bytes()) {
                    Some(v) => buf.extend_from_slice(v),
                    None => return false,
                },
                LimitKeyPart::Cookie(c) => {
                    match s
                        .up_req
                        .headers
                        .get(b"cookie")
                        .and_then(|v| pier_lb::find_cookie(v, c.as_bytes()))
                    {
                        Some(v) => buf.extend_from_slice(v),
                        None => return false,
                    }
                }
                LimitKeyPart::Path => buf.extend_from_slice(s.up_req.path()),
                LimitKeyPart::Route => {
                    if let Some(r) = s.route {
                        buf.extend_from_slice(st.routes[r].name.as_bytes());
                    }
                }
                LimitKeyPart::UpstreamServer => match peer {
                    Some(p) => {
                        use std::io::Write;
                        let _ = write!(buf, "{p}");
                    }
                    None => return false,
                },
            }
            buf.push(0x1f);
        }
        true
    }

    /// Apply the rules at `idx`; a refusal becomes the local response.
    fn apply_limits(
        &self,
        st: &State,
        s: &Session,
        ctx: &mut ConfigCtx,
        idx: &[usize],
        peer: Option<SocketAddr>,
    ) -> Option<LocalResponse> {
        let mut buf = self.keybuf.borrow_mut();
        let now_ms = pier_limits::clock::now_ms();
        for &i in idx {
            let rule = &st.limits[i];
            if !Self::key(&mut buf, rule, st, s, peer) {
                continue;
            }
            if let Some(rate) = &rule.rate {
                match rate.check(&buf, now_ms) {
                    Decision::Allow => {}
                    Decision::DryRunDeny { .. } => {
                        tracing::debug!("limit {} would refuse (dry run)", rule.rule.name);
                    }
                    Decision::Deny { retry_after_secs } => {
                        return Some(refusal(rule, Kind::RateLimited, retry_after_secs));
                    }
                }
            }
            if let Some(g) = &rule.global {
                match g.check(&buf, now_ms) {
                    Decision::Allow => {}
                    Decision::DryRunDeny { .. } => {
                        tracing::debug!("global limit {} would refuse (dry run)", rule.rule.name);
                    }
                    Decision::Deny { retry_after_secs } => {
                        return Some(refusal(rule, Kind::RateLimited, retry_after_secs));
                    }
                }
            }
            if let Some(c) = &rule.conc {
                match c.acquire(&buf) {
                    Ok(g) => ctx.guards.push(g),
                    Err(r) => {
                        return Some(refusal(rule, Kind::ConcurrencyLimited, r.retry_after_secs))
                    }
                }
            }
        }
        None
    }
}

impl ConfigPhases {
    /// A failed attempt, for Lua: the route's `balancer` hook runs again
    /// (as OpenResty's `balancer_by_lua*` does per try), reading the failure
    /// from `pier.balancer.get_last_failure()`; another peer it sets is a
    /// `Flow::Retry` there, with the request as it left it. The peer that
    /// failed, set again (a hook that always picks one peer, written before
    /// retries ran it twice), or none: the driver's own policy, which does
    /// not retry a hook's peer.
    async fn balancer_again(
        &self,
        st: &State,
        s: &mut Session,
        ctx: &mut ConfigCtx,
        failed: SocketAddr,
        connect: bool,
        e: &Error,
    ) -> Result<Flow, Error> {
        let Some(eng) = self.hook(st, s, ctx, Phase::Balancer)? else {
            return Ok(Flow::Continue);
        };
        let route = s.route.unwrap_or(0);
        let lctx = ctx.lua.get_or_insert_with(Default::default);
        lctx.set_last_failure(connect, e.status());
        let mut v = View {
            sess: s,
            resp: None,
            pending: &mut ctx.pending,
            cache: &mut ctx.cache,
            body: &ctx.body,
        };
        let t0 = pier_proxy::trace::lua_start(v.sess);
        let c = eng.balancer(route, &mut v, lctx).await;
        if let Some(t0) = t0 {
            pier_proxy::trace::lua_phase(s, "balancer", t0);
        }
        let c = c.map_err(hook_error)?;
        Ok(match c.peer {
            Some(p) if p != failed => Flow::Retry { peer: Some(p) },
            _ => Flow::Continue,
        })
    }
}

fn refusal(rule: &LimitRt, kind: Kind, retry_after: u32) -> LocalResponse {
    let mut n = itoa::Buffer::new();
    let mut body = Vec::with_capacity(64);
    body.extend_from_slice(n.format(rule.rule.status).as_bytes());
    body.push(b' ');
    body.extend_from_slice(kind.reason().as_bytes());
    body.extend_from_slice(b" (limit ");
    body.extend_from_slice(rule.rule.name.as_bytes());
    body.extend_from_slice(b")\n");
    LocalResponse {
        status: rule.rule.status,
        headers: vec![(
            b"Retry-After".to_vec(),
            n.format(retry_after.max(1)).as_bytes().to_vec(),
        )],
        body,
        reason: kind.reason(),
        kind: Some(kind),
    }
}

fn hook_error(e: pier_lua::LuaError) -> Error {
    tracing::error!(target: "pier::lua", "{e}");
    Error::with_detail(Kind::HookError, e)
}

/// A Lua `Flow::Respond` as a local response, with the response headers the
/// hook set along the way.
fn lua_response(
    status: u16,
    headers: Vec<(Vec<u8>, Vec<u8>)>,
    body: Vec<u8>,
    pending: &Headers,
) -> LocalResponse {
    let mut all: Vec<(Vec<u8>, Vec<u8>)> = pending
        .iter()
        .map(|(n, v)| (n.to_vec(), v.to_vec()))
        .collect();
    all.extend(headers);
    LocalResponse {
        status,
        headers: all,
        body,
        reason: "",
        kind: None,
    }
}

impl Phases for ConfigPhases {
    type Ctx = ConfigCtx;

    fn init_worker(&self, st: &State) {
        // Start the engine now: runs init/init_worker and starts timers on this thread.
        let _ = self.engine(st);
    }

    async fn request_filter(
        &self,
        st: &State,
        s: &mut Session,
        ctx: &mut ConfigCtx,
    ) -> Result<Flow, Error> {
        let route = s.route.unwrap_or(0);
        if let Some(idx) = st.route_limits.get(route) {
            if !idx.is_empty() {
                if let Some(r) = self.apply_limits(st, s, ctx, idx, None) {
                    return Ok(Flow::Respond(r));
                }
            }
        }
        for phase in [Phase::Access, Phase::Content] {
            let Some(e) = self.hook(st, s, ctx, phase)? else {
                continue;
            };
            let lctx = ctx.lua.get_or_insert_with(Default::default);
            let mut v = View {
                sess: s,
                resp: None,
                pending: &mut ctx.pending,
                cache: &mut ctx.cache,
                body: &ctx.body,
            };
            let t0 = pier_proxy::trace::lua_start(v.sess);
            let flow = match phase {
                Phase::Access => e.access(route, &mut v, lctx).await,
                _ => e.content(route, &mut v, lctx).await,
            };
            if let Some(t0) = t0 {
                pier_proxy::trace::lua_phase(s, phase.name(), t0);
            }
            let flow = flow.map_err(hook_error)?;
            if let pier_lua::Flow::Respond {
                status,
                headers,
                body,
            } = flow
            {
                return Ok(Flow::Respond(lua_response(
                    status,
                    headers,
                    body,
                    &ctx.pending,
                )));
            }
        }
        Ok(Flow::Continue)
    }

    async fn upstream_peer(
        &self,
        st: &State,
        s: &mut Session,
        ctx: &mut ConfigCtx,
    ) -> Result<PeerChoice, Error> {
        let Some(e) = self.hook(st, s, ctx, Phase::Balancer)? else {
            return Ok(PeerChoice::default());
        };
        let route = s.route.unwrap_or(0);
        let lctx = ctx.lua.get_or_insert_with(Default::default);
        let mut v = View {
            sess: s,
            resp: None,
            pending: &mut ctx.pending,
            cache: &mut ctx.cache,
            body: &ctx.body,
        };
        let t0 = pier_proxy::trace::lua_start(v.sess);
        let c = e.balancer(route, &mut v, lctx).await;
        if let Some(t0) = t0 {
            pier_proxy::trace::lua_phase(s, "balancer", t0);
        }
        let c = c.map_err(hook_error)?;
        Ok(PeerChoice {
            addr: c.peer,
            retries: c.retries,
        })
    }

    async fn fail_to_connect(
        &self,
        st: &State,
        s: &mut Session,
        ctx: &mut ConfigCtx,
        peer: SocketAddr,
        e: &Error,
    ) -> Result<Flow, Error> {
        self.balancer_again(st, s, ctx, peer, true, e).await
    }

    async fn error_while_proxy(
        &self,
        st: &State,
        s: &mut Session,
        ctx: &mut ConfigCtx,
        peer: SocketAddr,
        e: &Error,
    ) -> Result<Flow, Error> {
        self.balancer_again(st, s, ctx, peer, false, e).await
    }

    fn peer_selected(
        &self,
        st: &State,
        s: &mut Session,
        ctx: &mut ConfigCtx,
        peer: SocketAddr,
    ) -> Result<Flow, Error> {
        let route = s.route.unwrap_or(0);
        if let Some(idx) = st.peer_limits.get(route) {
            if !idx.is_empty() {
                if let Some(r) = self.apply_limits(st, s, ctx, idx, Some(peer)) {
                    return Ok(Flow::Respond(r));
                }
            }
        }
        Ok(Flow::Continue)
    }

    async fn upstream_request_filter(
        &self,
        st: &State,
        s: &mut Session,
        ctx: &mut ConfigCtx,
    ) -> Result<Flow, Error> {
        let Some(e) = self.hook(st, s, ctx, Phase::UpstreamRequest)? else {
            return Ok(Flow::Continue);
        };
        let route = s.route.unwrap_or(0);
        let lctx = ctx.lua.get_or_insert_with(Default::default);
        let mut v = View {
            sess: s,
            resp: None,
            pending: &mut ctx.pending,
            cache: &mut ctx.cache,
            body: &ctx.body,
        };
        let t0 = pier_proxy::trace::lua_start(v.sess);
        let flow = e.upstream_request(route, &mut v, lctx).await;
        if let Some(t0) = t0 {
            pier_proxy::trace::lua_phase(s, "upstream_request", t0);
        }
        match flow.map_err(hook_error)? {
            pier_lua::Flow::Continue => Ok(Flow::Continue),
            pier_lua::Flow::Respond {
                status,
                headers,
                body,
            } => Ok(Flow::Respond(lua_response(
                status,
                headers,
                body,
                &ctx.pending,
            ))),
        }
    }

    fn response_filter(
        &self,
        st: &State,
        s: &mut Session,
        resp: &mut ResponseHead,
        ctx: &mut ConfigCtx,
    ) -> Result<(), Error> {
        if !ctx.pending.is_empty() {
            // What access set (`pier.resp.set_header`) replaces the
            // response's fields of those names, every value kept (two
            // Set-Cookie stay two). Idempotent: a hook's own answer, which
            // carries them already, gets them once.
            for (n, _) in ctx.pending.iter() {
                resp.headers.remove(n);
            }
            for (n, v) in ctx.pending.iter() {
                resp.headers.append(n, v);
            }
        }
        let Some(e) = self.hook(st, s, ctx, Phase::HeaderFilter)? else {
            return Ok(());
        };
        let route = s.route.unwrap_or(0);
        let lctx = ctx.lua.get_or_insert_with(Default::default);
        let mut v = View {
            sess: s,
            resp: Some(resp),
            pending: &mut ctx.pending,
            cache: &mut ctx.cache,
            body: &ctx.body,
        };
        let t0 = pier_proxy::trace::lua_start(v.sess);
        let r = e.header_filter(route, &mut v, lctx);
        if let Some(t0) = t0 {
            pier_proxy::trace::lua_phase(s, "header_filter", t0);
        }
        r.map_err(hook_error)
    }

    fn cache_ctl<'a>(&self, ctx: &'a mut ConfigCtx) -> Option<&'a mut pier_proxy::CacheCtl> {
        ctx.cache.as_deref_mut()
    }

    /// Routes with an `access` or `content` hook may read the body.
    fn req_body<'a>(
        &self,
        st: &State,
        s: &Session,
        ctx: &'a mut ConfigCtx,
    ) -> Option<&'a mut pier_proxy::ReqBody> {
        let hooked = ctx.body.is_armed()
            || [Phase::Access, Phase::Content]
                .into_iter()
                .any(|p| matches!(self.hook(st, s, ctx, p), Ok(Some(_))));
        hooked.then_some(&mut ctx.body)
    }

    fn has_body_filter(&self, st: &State, s: &Session) -> bool {
        let (Some(route), Some(_)) = (s.route, &st.scripts) else {
            return false;
        };
        matches!(&*self.engine.borrow(), Some((g, e)) if *g == st.generation && e.has_hook(route, Phase::BodyFilter))
    }

    fn body_filter(
        &self,
        st: &State,
        s: &mut Session,
        ctx: &mut ConfigCtx,
        chunk: &mut BytesMut,
        eof: bool,
    ) -> Result<(), Error> {
        let Some(e) = self.hook(st, s, ctx, Phase::BodyFilter)? else {
            return Ok(());
        };
        let route = s.route.unwrap_or(0);
        let lctx = ctx.lua.get_or_insert_with(Default::default);
        let mut v = View {
            sess: s,
            resp: None,
            pending: &mut ctx.pending,
            cache: &mut ctx.cache,
            body: &ctx.body,
        };
        let t0 = pier_proxy::trace::lua_start(v.sess);
        let r = e.body_filter(route, &mut v, lctx, chunk, eof);
        if let Some(t0) = t0 {
            pier_proxy::trace::lua_phase(s, "body_filter", t0);
        }
        r.map_err(hook_error)
    }

    fn logging(&self, st: &State, s: &mut Session, ctx: &mut ConfigCtx) {
        ctx.guards.clear();
        if let Ok(Some(e)) = self.hook(st, s, ctx, Phase::Log) {
            let route = s.route.unwrap_or(0);
            let lctx = ctx.lua.get_or_insert_with(Default::default);
            let mut v = View {
                sess: s,
                resp: None,
                pending: &mut ctx.pending,
                cache: &mut ctx.cache,
                body: &ctx.body,
            };
            let t0 = pier_proxy::trace::lua_start(v.sess);
            e.log(route, &mut v, lctx);
            if let Some(t0) = t0 {
                pier_proxy::trace::lua_phase(s, "log", t0);
            }
        }
    }
}

// === the request as Lua sees it ===

struct View<'a> {
    sess: &'a mut Session,
    /// The origin's response once there is one (header_filter).
    resp: Option<&'a mut ResponseHead>,
    pending: &'a mut Headers,
    /// `pier.cache`'s controls, made on first use.
    cache: &'a mut Option<Box<pier_proxy::CacheCtl>>,
    body: &'a pier_proxy::ReqBody,
}

impl HttpView for View<'_> {
    fn method(&self) -> &[u8] {
        self.sess.up_req.method()
    }
    fn uri(&self) -> &[u8] {
        self.sess.up_req.uri()
    }
    fn set_uri(&mut self, uri: &[u8]) {
        self.sess.up_req.set_uri(uri);
    }
    fn set_method(&mut self, method: &[u8]) -> bool {
        self.sess.up_req.set_method(method);
        true
    }
    fn req_header(&self, name: &[u8]) -> Option<&[u8]> {
        self.sess.up_req.headers.get(name)
    }
    fn req_headers(&self, f: &mut dyn FnMut(&[u8], &[u8])) {
        for (n, v) in self.sess.up_req.headers.iter() {
            f(n, v);
        }
    }
    fn poll_read_body(&mut self, cx: &mut std::task::Context<'_>) -> std::task::Poll<()> {
        self.body.poll_read(cx)
    }
    fn req_body(&self) -> Option<&[u8]> {
        self.body.data()
    }
    /// The head as the client sent it (before hooks and header rules), in
    /// HTTP/1 form; an HTTP/2 request's says `HTTP/2.0`.
    fn raw_header(&self, no_request_line: bool, out: &mut Vec<u8>) {
        let req = &self.sess.req;
        if !no_request_line {
            out.extend_from_slice(req.method());
            out.push(b' ');
            out.extend_from_slice(req.uri());
            out.push(b' ');
            out.extend_from_slice(self.sess.conn.proto.version(req.version).as_bytes());
            out.extend_from_slice(b"\r\n");
        }
        for (n, v) in req.headers.iter() {
            out.extend_from_slice(n);
            out.extend_from_slice(b": ");
            out.extend_from_slice(v);
            out.extend_from_slice(b"\r\n");
        }
        out.extend_from_slice(b"\r\n");
    }
    fn set_req_header(&mut self, name: &[u8], value: Option<&[u8]>) {
        match value {
            Some(v) => self.sess.up_req.headers.insert(name, v),
            None => {
                self.sess.up_req.headers.remove(name);
            }
        }
    }
    fn add_req_header(&mut self, name: &[u8], value: &[u8]) {
        self.sess.up_req.headers.append(name, value);
    }
    fn client_addr(&self) -> SocketAddr {
        self.sess.client
    }
    fn peer_addr(&self) -> SocketAddr {
        self.sess.peer
    }
    fn server_protocol(&self) -> &'static [u8] {
        self.sess
            .conn
            .proto
            .version(self.sess.req.version)
            .as_bytes()
    }
    fn scheme(&self) -> &[u8] {
        self.sess.scheme().as_bytes()
    }
    fn tls_var(&self, name: &[u8]) -> Option<&[u8]> {
        let t = self.sess.conn.tls.as_deref();
        match name {
            b"https" => Some(if t.is_some() { b"on" } else { b"" }),
            b"ssl_protocol" => t.map(|t| t.version.as_bytes()),
            b"ssl_cipher" => t.map(|t| t.cipher.as_bytes()),
            b"ssl_server_name" => t.and_then(|t| t.sni.as_deref()).map(str::as_bytes),
            b"ssl_alpn_protocol" => t.and_then(|t| t.alpn.as_deref()).map(str::as_bytes),
            b"ssl_client_s_dn" => t
                .and_then(|t| t.client_subject.as_deref())
                .map(str::as_bytes),
            b"ssl_session_reused" => t.map(|t| &b".r"[t.resumed as usize..][..1]),
            _ => None,
        }
    }
    fn trace_child(&self) -> Option<[u8; 55]> {
        pier_proxy::trace::of(self.sess).map(|t| t.subrequest())
    }
    fn trace_add(&mut self, op: u8, key: &[u8], value: pier_trace::Value) -> Result<(), bool> {
        use pier_proxy::trace::{hook_add, HookAdd, HookRefused};
        let add = match op {
            0 => HookAdd::Attribute(key, value),
            1 => HookAdd::Event(key),
            _ => HookAdd::EventAttribute(key, value),
        };
        hook_add(self.sess, add).map_err(|e| e == HookRefused::TooMany)
    }
    fn trace_var(&self, name: &[u8]) -> Option<&[u8]> {
        let t = pier_proxy::trace::of(self.sess)?;
        match name {
            b"trace_id" => Some(t.trace_hex()),
            b"span_id" => Some(t.span_hex()),
            b"trace_flags" => Some(t.flags_hex()),
            _ => None,
        }
    }
    fn host(&self) -> &[u8] {
        self.sess.up_req.host().unwrap_or(b"")
    }
    fn server_port(&self) -> u16 {
        self.sess.local.port()
    }
    fn status(&self) -> u16 {
        self.resp
            .as_ref()
            .map(|r| r.status)
            .unwrap_or(self.sess.status)
    }
    fn set_status(&mut self, status: u16) {
        if let Some(r) = self.resp.as_mut() {
            r.set_status(status);
        }
    }
    fn resp_header(&self, name: &[u8]) -> Option<&[u8]> {
        match &self.resp {
            Some(r) => r.headers.get(name),
            None => self.pending.get(name),
        }
    }
    fn resp_headers(&self, f: &mut dyn FnMut(&[u8], &[u8])) {
        let h = match &self.resp {
            Some(r) => &r.headers,
            None => &*self.pending,
        };
        for (n, v) in h.iter() {
            f(n, v);
        }
    }
    fn set_resp_header(&mut self, name: &[u8], value: Option<&[u8]>) {
        let h = match self.resp.as_mut() {
            Some(r) => &mut r.headers,
            None => &mut *self.pending,
        };
        match value {
            Some(v) => h.insert(name, v),
            None => {
                h.remove(name);
            }
        }
    }
    fn add_resp_header(&mut self, name: &[u8], value: &[u8]) {
        match self.resp.as_mut() {
            Some(r) => r.headers.append(name, value),
            None => self.pending.append(name, value),
        }
    }
    fn now_ns(&self) -> u64 {
        self.sess.now_ns
    }
    fn cache(&mut self, op: pier_lua::CacheOp<'_>) -> bool {
        let c = self.cache.get_or_insert_with(Default::default);
        match op {
            pier_lua::CacheOp::Bypass => c.bypass = true,
            pier_lua::CacheOp::Key(k) => c.key = Some(k.to_vec()),
            pier_lua::CacheOp::Ttl(t) => c.ttl = Some(t),
            pier_lua::CacheOp::Cacheable(on) => c.cacheable = Some(on),
        }
        true
    }
}

/// The Lua side of a config: route hooks in route order.
pub fn lua_setup(cfg: &Config) -> Option<LuaSetup> {
    let any = cfg.lua.init.is_some()
        || cfg.lua.init_worker.is_some()
        || cfg.routes.iter().any(|r| !r.lua.is_empty());
    if !any {
        return None;
    }
    let conv = |s: &Option<LuaSource>| {
        s.as_ref().map(|s| match s {
            LuaSource::Inline { code, name } => Source::Inline {
                code: code.clone(),
                name: name.clone(),
            },
            LuaSource::File(p) => Source::File(p.clone()),
        })
    };
    Some(LuaSetup {
        init: conv(&cfg.lua.init),
        init_worker: conv(&cfg.lua.init_worker),
        routes: cfg
            .routes
            .iter()
            .map(|r| RouteHooks {
                access: conv(&r.lua.access),
                content: conv(&r.lua.content),
                balancer: conv(&r.lua.balancer),
                upstream_request: conv(&r.lua.upstream_request),
                header_filter: conv(&r.lua.header_filter),
                body_filter: conv(&r.lua.body_filter),
                log: conv(&r.lua.log),
            })
            .collect(),
        shared_dicts: cfg.lua.shared.clone(),
        memory_limit: cfg.lua.memory_limit,
        package_path: cfg.lua.package_path.clone(),
    })
}

/// The `[lua]` bounds on what hooks make Rust hold.
pub fn lua_limits(cfg: &Config) -> pier_lua::LuaLimits {
    pier_lua::LuaLimits {
        max_response_body: cfg.lua.max_response_body,
        socket_buffer: cfg.lua.socket_buffer,
        http_max_body: cfg.lua.http_max_body,
        max_sockets_per_request: cfg.lua.max_sockets_per_request,
        max_sockets_per_worker: cfg.lua.max_sockets_per_worker,
        socket_pool_wait: cfg.lua.socket_pool_wait,
    }
}

/// Attach this config's Lua setup to a freshly built state (its `scripts`).
pub fn prepare(state: &mut State) {
    state.scripts =
        lua_setup(&state.cfg).map(|s| Arc::new(s) as Arc<dyn std::any::Any + Send + Sync>);
}

/// The Lua setup a state carries, if its config has any Lua.
pub fn setup_of(st: &State) -> Option<Arc<LuaSetup>> {
    st.scripts.clone()?.downcast::<LuaSetup>().ok()
}

#[cfg(test)]
mod size_tests {
    use super::*;
    use std::net::SocketAddr;

    fn size_of_future<F, S, Fut>(_: F) -> usize
    where
        F: FnOnce(
            Arc<pier_proxy::Worker<ConfigPhases>>,
            S,
            SocketAddr,
            SocketAddr,
            pier_proxy::session::ConnInfo,
            Option<pier_proxy::Slot>,
        ) -> Fut,
    {
        std::mem::size_of::<Fut>()
    }

    /// Every connection's task holds this future for its whole life, idle or
    /// not: its size is most of an idle keep-alive connection's memory.
    /// 1,176 bytes until the idle wait stopped holding the session and
    /// buffers (`Busy`, pooled per worker), a watch waiter (a drain evicts
    /// idle connections) and a readiness waiter (`poll_readable`): 584.
    /// Then the connection's admission slots joined it (they were held by a
    /// wrapping `async` block whose captures made the task 896 bytes) and
    /// its idle timer left it (the worker's sweeper, evict.rs): 528, in a
    /// 640-byte task (tokio rounds a task to 128 bytes).
    #[test]
    fn connection_future_stays_small() {
        let n = size_of_future(
            pier_proxy::driver::serve_connection::<ConfigPhases, tokio::net::TcpStream>,
        );
        eprintln!("serve_connection future: {n} bytes");
        assert!(n <= 528, "serve_connection future grew to {n} bytes");
    }

    /// Each HTTP/2 stream allocates and copies this future (its task's
    /// box), so its size is on every stream's bill. 7,688 bytes in a release
    /// build until no async layer kept its arguments twice and the rarer
    /// steps (a cache fill, a tunnel, gRPC-web) were held outside it
    /// (`Downstream::hold`): 4,216 (docs/phases.md; `bench/future-sizes.sh`
    /// shows where the bytes are); 4,224 in this (dev) build.
    #[test]
    fn http2_stream_future_stays_small() {
        fn size_of_stream_future<F, Fut>(_: F) -> usize
        where
            F: FnOnce(
                pier_proxy::mux::Mux<ConfigPhases>,
                pier_h2::server::H2Downstream,
                pier_session::http_types::HttpHead,
            ) -> Fut,
        {
            std::mem::size_of::<Fut>()
        }
        let n = size_of_stream_future(
            <pier_proxy::mux::Mux<ConfigPhases> as pier_session::Engine>::serve_stream::<
                pier_h2::server::H2Downstream,
                pier_session::http_types::HttpHead,
            >,
        );
        eprintln!("HTTP/2 stream future: {n} bytes");
        assert!(n <= 4224, "the HTTP/2 stream future grew to {n} bytes");
    }

    /// A request's session (the request as received and the upstream
    /// request), boxed with its buffers while the connection is busy and
    /// pooled per worker while it idles.
    #[test]
    fn session_stays_small() {
        let n = std::mem::size_of::<Session>();
        eprintln!("Session: {n} bytes");
        // 576 since the chosen peer's host name (re-resolved upstream
        // names, issue 9) joined it: 16 bytes per connection; 592 since the
        // bytes received and the upstream header time (analytics, issue 12):
        // 240 KB more at 10,000 idle connections. 624 since the cache's
        // fields got slots (six more per header map, two maps): no longer
        // per idle connection (sessions are pooled per worker, at most 64).
        // 656 with the connection's peer beside the client (`real_ip_header`,
        // issue 35): 2 KB a worker. 664 with the trace context's box
        // (`[tracing]`, issue 36): one pointer, the context itself boxed.
        // 680 with slots for the targeted cache fields and the refresh mark
        // (issue 34: no scans by name per miss): three more slots per header map,
        // 1 KB a worker's pool.
        assert!(n <= 680, "Session grew to {n} bytes");
    }
}
