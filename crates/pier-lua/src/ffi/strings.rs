//! The C side of `ngx.re.*` and of ngx's string functions (`pier.ngx_str`).
//!
//! A table of its own ([`StrApi`], cdef'd as `pier_str_api_t` in
//! `lua/pier/ngx_str.lua`, same field order), reached like [`super::PierApi`]
//! through an address the bootstrap hands to Lua (`native.str_api_addr`).
//! None of these functions touch the request: they work in every phase.
//!
//! Regexes are PCRE2 (the engine OpenResty uses), through the raw bindings
//! of `pcre2-sys` (statically built from its bundled source when no system
//! library is found): ngx_lua's options need PCRE2_ANCHORED, DUPNAMES, the
//! name table and DFA matching, which the safe `pcre2` wrapper does not
//! expose. Compiled patterns live in a per-thread cache keyed by (pattern,
//! options), bounded like `lua_regex_cache_max_entries` ([`CACHE_MAX`],
//! least recently used evicted), so a hot `ngx.re.find` never recompiles,
//! with or without the `o` option. Match offsets go out through the
//! caller's reusable `int[]` (the ovector); strings out through a
//! per-thread buffer the wrapper copies with `ffi.string`.
//!
//! `ngx_hex_dump` and `ngx_atoi` are nginx's own C functions, which
//! lua-resty-string calls through `ffi.C`: they are exported unmangled here
//! and placed in the table so the linker keeps them; the `pier` binary (and
//! this crate's tests) export them dynamically (see the `build.rs` files).

use std::cell::RefCell;
use std::collections::HashMap;
use std::hash::BuildHasher;
use std::os::raw::{c_char, c_int};
use std::ptr;

use base64::Engine as _;
use hmac::Mac as _;
use md5::Digest as _;
use pcre2_sys as p2;

use super::{arg, guard, out, put, OutLen, OutPtr, PierPair, E_INVAL, SCRATCH};

/// No match (PCRE's own code, kept).
pub const RE_NOMATCH: c_int = -1;
/// The pattern did not compile: the message is in the error buffer.
pub const RE_COMPILE: c_int = -1000;
/// The ovector is too small: grow it to `2 * (info.ncap + 1)` and retry.
pub const RE_OVEC: c_int = -1001;
/// The match failed: PCRE2's code is in `*errcode`.
pub const RE_EXEC: c_int = -1002;
/// `ngx.re.sub`/`gsub`: the replacement template is invalid.
pub const RE_TEMPLATE: c_int = -1003;

/// Option bits, as the Lua wrapper encodes the option letters.
const F_CASELESS: u32 = 1; // i
const F_MULTILINE: u32 = 2; // m
const F_DOTALL: u32 = 4; // s
const F_EXTENDED: u32 = 8; // x
const F_ANCHORED: u32 = 16; // a
const F_UTF: u32 = 32; // u
const F_UTF_NOCHECK: u32 = 64; // U
const F_DUPNAMES: u32 = 128; // D
const F_JSCOMPAT: u32 = 256; // J
const F_JIT: u32 = 512; // j
const F_DFA: u32 = 1024; // d
/// Bits that change the compiled pattern (`o` is the wrapper's business).
const F_KEY: u32 = 2047;

/// Compiled patterns kept per thread (`lua_regex_cache_max_entries`).
pub const CACHE_MAX: usize = 1024;
/// Scratch output kept between calls up to this size (bigger is freed).
const KEEP_BYTES: usize = 1 << 20;
/// ngx_lua's JIT stack bounds (`ngx.re.opt("jit_stack_size", n)`).
const JIT_STACK_MIN: usize = 32 * 1024;
const JIT_STACK_MAX: usize = 64 << 20;
/// pcre2_dfa_match workspace, as ngx_lua (`NGX_LUA_RE_DFA_MODE_WORKSPACE_COUNT`).
const DFA_WORKSPACE: usize = 1000;

/// One named group, for the wrapper's captures table.
#[repr(C)]
pub struct ReName {
    pub name: *const c_char,
    pub len: usize,
    pub group: c_int,
}

/// What the wrapper needs of a compiled pattern; valid until the next call.
#[repr(C)]
pub struct ReInfo {
    pub ncap: c_int,
    pub name_count: c_int,
    pub names: *const ReName,
}

/// A compiled pattern and its match data (one thread uses it at a time).
struct Compiled {
    code: *mut p2::pcre2_code_8,
    md: *mut p2::pcre2_match_data_8,
    flags: u32,
    /// Capture groups of the pattern (0 in DFA mode, as ngx_lua).
    ncap: usize,
    _name_bytes: Box<[u8]>,
    /// Kept alive: `info.names` points into it.
    _names: Box<[ReName]>,
    info: ReInfo,
}

impl Drop for Compiled {
    fn drop(&mut self) {
        // SAFETY: both were created by PCRE2 for this value, are non-NULL
        // (checked in `compile`) and freed only here.
        unsafe {
            p2::pcre2_match_data_free_8(self.md);
            p2::pcre2_code_free_8(self.code);
        }
    }
}

struct Slot {
    pat: Box<[u8]>,
    flags: u32,
    used: u64,
    re: Compiled,
}

/// The per-thread regex cache: slots (boxed: `ReInfo` pointers stay put)
/// and an index from a keyed hash of (pattern, options) to the slot.
struct Cache {
    hasher: std::collections::hash_map::RandomState,
    index: HashMap<u64, usize>,
    // Boxed so a slot never moves: Lua reads `*info` (a pointer into it)
    // after the call, possibly after other patterns were added.
    #[allow(clippy::vec_box)]
    slots: Vec<Box<Slot>>,
    tick: u64,
    /// A pattern compiled but not cached (a hash collision): kept until the
    /// next call so its `ReInfo` stays valid for the wrapper.
    spare: Option<Box<Slot>>,
    mctx: *mut p2::pcre2_match_context_8,
    jit_stack: *mut p2::pcre2_jit_stack_8,
    workspace: Vec<c_int>,
    /// The parsed replacement template of `re_sub` (reused).
    pieces: Vec<Piece>,
}

impl Drop for Cache {
    fn drop(&mut self) {
        // SAFETY: created by PCRE2 for this cache (or NULL), freed only here;
        // the slots using them are dropped after (they do not reference them).
        unsafe {
            if !self.mctx.is_null() {
                p2::pcre2_match_context_free_8(self.mctx);
            }
            if !self.jit_stack.is_null() {
                p2::pcre2_jit_stack_free_8(self.jit_stack);
            }
        }
    }
}

thread_local! {
    static CACHE: RefCell<Cache> = RefCell::new(Cache {
        hasher: Default::default(),
        index: HashMap::new(),
        slots: Vec::new(),
        tick: 0,
        spare: None,
        mctx: ptr::null_mut(),
        jit_stack: ptr::null_mut(),
        workspace: Vec::new(),
        pieces: Vec::new(),
    });
    /// String results (escape, base64, sub...), copied out by the wrapper.
    static OUT: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
}

fn compile_options(flags: u32) -> u32 {
    let mut o = 0;
    for (f, p) in [
        (F_CASELESS, p2::PCRE2_CASELESS),
        (F_MULTILINE, p2::PCRE2_MULTILINE),
        (F_DOTALL, p2::PCRE2_DOTALL),
        (F_EXTENDED, p2::PCRE2_EXTENDED),
        (F_ANCHORED, p2::PCRE2_ANCHORED),
        (F_UTF, p2::PCRE2_UTF),
        (F_DUPNAMES, p2::PCRE2_DUPNAMES),
        // PCRE1's JAVASCRIPT_COMPAT became these three in PCRE2.
        (
            F_JSCOMPAT,
            p2::PCRE2_ALT_BSUX | p2::PCRE2_MATCH_UNSET_BACKREF | p2::PCRE2_ALLOW_EMPTY_CLASS,
        ),
    ] {
        if flags & f != 0 {
            o |= p;
        }
    }
    if flags & F_UTF_NOCHECK != 0 {
        // ngx_lua's "U" skips the UTF-8 check, which makes invalid input
        // undefined behaviour in PCRE; MATCH_INVALID_UTF is the safe way to
        // skip the error: invalid sequences just never match.
        o |= p2::PCRE2_UTF | p2::PCRE2_MATCH_INVALID_UTF;
    }
    o
}

/// PCRE2's message for `code`.
fn pcre_message(code: c_int) -> String {
    let mut buf = [0u8; 256];
    // SAFETY: the buffer is writable for its length; PCRE2 NUL-terminates.
    let n = unsafe { p2::pcre2_get_error_message_8(code, buf.as_mut_ptr(), buf.len()) };
    let n = usize::try_from(n).unwrap_or(0).min(buf.len());
    String::from_utf8_lossy(&buf[..n]).into_owned()
}

fn info_u32(code: *const p2::pcre2_code_8, what: u32) -> u32 {
    let mut v: u32 = 0;
    // SAFETY: `code` is a live compiled pattern; these items are uint32_t.
    unsafe { p2::pcre2_pattern_info_8(code, what, (&mut v as *mut u32).cast()) };
    v
}

/// Compiles `pat`, or returns ngx_lua's error message.
fn compile(pat: &[u8], flags: u32) -> Result<Compiled, String> {
    let mut err: c_int = 0;
    let mut off: usize = 0;
    // SAFETY: `pat` is valid for `pat.len()` bytes (PCRE2 takes the length,
    // NULs included); the out-pointers are locals.
    let code = unsafe {
        p2::pcre2_compile_8(
            pat.as_ptr(),
            pat.len(),
            compile_options(flags),
            &mut err,
            &mut off,
            ptr::null_mut(),
        )
    };
    if code.is_null() {
        let msg = pcre_message(err);
        let shown = String::from_utf8_lossy(pat);
        return Err(if off >= pat.len() {
            format!("pcre2_compile() failed: {msg} in \"{shown}\"")
        } else {
            let rest = String::from_utf8_lossy(&pat[off..]);
            format!("pcre2_compile() failed: {msg} in \"{shown}\" at \"{rest}\"")
        });
    }
    if flags & F_JIT != 0 {
        // A pattern the JIT cannot compile still matches, interpreted (as
        // ngx_lua, which ignores pcre_study's failure).
        // SAFETY: `code` is a live compiled pattern.
        unsafe { p2::pcre2_jit_compile_8(code, p2::PCRE2_JIT_COMPLETE) };
    }
    // SAFETY: `code` is a live compiled pattern.
    let md = unsafe { p2::pcre2_match_data_create_from_pattern_8(code, ptr::null_mut()) };
    if md.is_null() {
        // SAFETY: `code` is live and not used after this.
        unsafe { p2::pcre2_code_free_8(code) };
        return Err("no memory".into());
    }
    let ncap = if flags & F_DFA != 0 {
        0
    } else {
        info_u32(code, p2::PCRE2_INFO_CAPTURECOUNT) as usize
    };
    let count = info_u32(code, p2::PCRE2_INFO_NAMECOUNT) as usize;
    let entry = info_u32(code, p2::PCRE2_INFO_NAMEENTRYSIZE) as usize;
    // The name table: `count` entries of `entry` bytes, each a big-endian
    // group number and a NUL-terminated name. Copied into our own buffer.
    let mut name_bytes = Vec::new();
    let mut spans = Vec::with_capacity(count);
    if count > 0 && entry > 2 {
        let mut table: *const u8 = ptr::null();
        // SAFETY: NAMETABLE is a `PCRE2_SPTR` written to a local.
        unsafe {
            p2::pcre2_pattern_info_8(
                code,
                p2::PCRE2_INFO_NAMETABLE,
                (&mut table as *mut *const u8).cast(),
            )
        };
        if !table.is_null() {
            // SAFETY: PCRE2 documents the table as `count * entry` bytes,
            // alive with `code`.
            let t = unsafe { std::slice::from_raw_parts(table, count * entry) };
            for e in t.chunks_exact(entry) {
                let group = (usize::from(e[0]) << 8) | usize::from(e[1]);
                let name = &e[2..];
                let name = &name[..memchr::memchr(0, name).unwrap_or(name.len())];
                spans.push((name_bytes.len(), name.len(), group));
                name_bytes.extend_from_slice(name);
            }
        }
    }
    let name_bytes = name_bytes.into_boxed_slice();
    let names: Box<[ReName]> = spans
        .iter()
        .map(|&(at, len, group)| ReName {
            name: name_bytes.as_ptr().wrapping_add(at).cast(),
            len,
            group: c_int::try_from(group).unwrap_or(c_int::MAX),
        })
        .collect();
    let info = ReInfo {
        ncap: c_int::try_from(ncap).unwrap_or(c_int::MAX),
        name_count: c_int::try_from(names.len()).unwrap_or(0),
        names: names.as_ptr(),
    };
    Ok(Compiled {
        code,
        md,
        flags,
        ncap,
        _name_bytes: name_bytes,
        _names: names,
        info,
    })
}

impl Cache {
    /// The compiled `(pat, flags)`, from the cache or compiled now.
    fn get(&mut self, pat: &[u8], flags: u32) -> Result<&Compiled, String> {
        let flags = flags & F_KEY;
        self.tick += 1;
        self.spare = None;
        let h = self.hasher.hash_one((pat, flags));
        if let Some(&i) = self.index.get(&h) {
            let s = &mut self.slots[i];
            if s.flags == flags && *s.pat == *pat {
                s.used = self.tick;
                return Ok(&self.slots[i].re);
            }
            // A 64-bit collision: use the pattern uncached.
            let re = compile(pat, flags)?;
            let slot = self.spare.insert(Box::new(Slot {
                pat: pat.into(),
                flags,
                used: 0,
                re,
            }));
            return Ok(&slot.re);
        }
        let re = compile(pat, flags)?;
        let slot = Box::new(Slot {
            pat: pat.into(),
            flags,
            used: self.tick,
            re,
        });
        let at = if self.slots.len() < CACHE_MAX {
            self.slots.push(slot);
            self.slots.len() - 1
        } else {
            // Full: replace the least recently used.
            let (i, _) = self
                .slots
                .iter()
                .enumerate()
                .min_by_key(|(_, s)| s.used)
                .unwrap_or((0, &self.slots[0]));
            let old = &self.slots[i];
            let old_h = self.hasher.hash_one((&*old.pat, old.flags));
            self.index.remove(&old_h);
            self.slots[i] = slot;
            i
        };
        self.index.insert(h, at);
        Ok(&self.slots[at].re)
    }

    /// Runs `re` on `subj` from `pos`; PCRE2's return code.
    fn exec(
        mctx: *mut p2::pcre2_match_context_8,
        ws: &mut Vec<c_int>,
        re: &Compiled,
        subj: &[u8],
        pos: usize,
    ) -> c_int {
        if re.flags & F_DFA != 0 {
            ws.resize(DFA_WORKSPACE, 0);
            // SAFETY: live pattern and match data; subject valid for its
            // length; the workspace is writable for its length.
            let rc = unsafe {
                p2::pcre2_dfa_match_8(
                    re.code,
                    subj.as_ptr(),
                    subj.len(),
                    pos,
                    0,
                    re.md,
                    mctx,
                    ws.as_mut_ptr(),
                    ws.len(),
                )
            };
            // Only the longest match is reported (ngx_lua's ovector of 1).
            return if rc >= 0 { 1 } else { rc };
        }
        // SAFETY: live pattern and match data (sized for the pattern's
        // groups); subject valid for its length; `mctx` NULL or live.
        unsafe { p2::pcre2_match_8(re.code, subj.as_ptr(), subj.len(), pos, 0, re.md, mctx) }
    }
}

/// The ovector pair `i` of the last match of `re` (UNSET as `None`).
fn pair(re: &Compiled, i: usize) -> Option<(usize, usize)> {
    // SAFETY: the match data holds `ncap + 1` pairs (created from the
    // pattern); callers pass `i <= ncap` (or 0 in DFA mode).
    let ov = unsafe { p2::pcre2_get_ovector_pointer_8(re.md) };
    // SAFETY: as above, index within the ovector.
    let (a, b) = unsafe { (*ov.add(2 * i), *ov.add(2 * i + 1)) };
    (a != p2::PCRE2_UNSET && b != p2::PCRE2_UNSET && a <= b).then_some((a, b))
}

/// Writes `msg` NUL-terminated into `(buf, cap)`, cut to `cap - 1` bytes
/// (ngx_lua's 128-byte error buffer does the same).
///
/// # Safety
/// `buf` is NULL or writable for `cap` bytes.
unsafe fn put_err(msg: &str, buf: *mut c_char, cap: usize) {
    if buf.is_null() || cap == 0 {
        return;
    }
    let n = msg.len().min(cap - 1);
    // SAFETY: `buf` is writable for `cap > n` bytes (the caller's contract).
    unsafe {
        ptr::copy_nonoverlapping(msg.as_ptr(), buf.cast::<u8>(), n);
        *buf.add(n) = 0;
    }
}

/// The next search position after an empty match at `at` (one character
/// further: a whole UTF-8 sequence in UTF mode).
fn step(re: &Compiled, subj: &[u8], at: usize) -> usize {
    let mut p = at + 1;
    if re.flags & (F_UTF | F_UTF_NOCHECK) != 0 {
        while p < subj.len() && subj[p] & 0xC0 == 0x80 {
            p += 1;
        }
    }
    p
}

/// Compiles (or finds) `pat` and matches it against `subj` from `pos`.
/// Returns the number of ovector pairs set (> 0) and writes the offsets
/// (`-1` for unset groups, all `ncap + 1` pairs) into `ovec`, or
/// [`RE_NOMATCH`], [`RE_COMPILE`] (message in `err`), [`RE_OVEC`] (grow
/// `ovec`), [`RE_EXEC`] (PCRE2 code in `*errcode`), [`E_INVAL`].
/// `*info` describes the pattern whenever it compiled.
#[allow(clippy::too_many_arguments)]
unsafe extern "C" fn re_exec(
    pat: *const c_char,
    plen: usize,
    flags: u32,
    subj: *const c_char,
    slen: usize,
    pos: c_int,
    ovec: *mut c_int,
    ovcap: c_int,
    info: *mut *const ReInfo,
    errcode: *mut c_int,
    err: *mut c_char,
    errcap: usize,
) -> c_int {
    guard(|| {
        // SAFETY: the ffi contract (Lua strings passed to this call).
        let (pat, subj) = unsafe { (arg(pat, plen), arg(subj, slen)) };
        // Offsets go out as C ints: Lua strings this large are refused.
        if subj.len() > c_int::MAX as usize || pos < 0 || ovec.is_null() {
            return E_INVAL;
        }
        CACHE.with_borrow_mut(|c| {
            let mctx = c.mctx;
            let mut ws = std::mem::take(&mut c.workspace);
            let rc = match c.get(pat, flags) {
                Err(msg) => {
                    // SAFETY: `err` is NULL or writable for `errcap` (contract).
                    unsafe { put_err(&msg, err, errcap) };
                    RE_COMPILE
                }
                Ok(re) => {
                    // SAFETY: out-pointer NULL or writable (contract).
                    unsafe { put(info, &re.info as *const ReInfo) };
                    let pairs = re.ncap + 1;
                    if usize::try_from(ovcap).unwrap_or(0) < 2 * pairs {
                        RE_OVEC
                    } else {
                        let rc = Cache::exec(mctx, &mut ws, re, subj, pos as usize);
                        if rc > 0 {
                            for i in 0..pairs {
                                let (a, b) =
                                    pair(re, i).map_or((-1, -1), |(a, b)| (a as c_int, b as c_int));
                                // SAFETY: `ovec` holds `ovcap >= 2 * pairs`
                                // ints (checked above; the contract).
                                unsafe {
                                    *ovec.add(2 * i) = a;
                                    *ovec.add(2 * i + 1) = b;
                                }
                            }
                            rc
                        } else if rc == RE_NOMATCH {
                            RE_NOMATCH
                        } else {
                            // SAFETY: out-pointer NULL or writable (contract).
                            unsafe { put(errcode, rc) };
                            RE_EXEC
                        }
                    }
                }
            };
            c.workspace = ws;
            rc
        })
    })
}

/// One piece of a compiled replacement template.
enum Piece {
    Lit(usize, usize),
    Cap(usize),
}

/// Parses a `ngx.re.sub` template as ngx_lua's script compiler does:
/// `$N`, `${N}`, `$$`; named variables and a lone `$` are errors.
fn parse_template(t: &[u8], out: &mut Vec<Piece>) -> bool {
    out.clear();
    let mut i = 0;
    while i < t.len() {
        if t[i] != b'$' {
            let s = i;
            while i < t.len() && t[i] != b'$' {
                i += 1;
            }
            out.push(Piece::Lit(s, i));
            continue;
        }
        i += 1;
        if i == t.len() {
            return false;
        }
        if t[i] == b'$' {
            out.push(Piece::Lit(i, i + 1));
            i += 1;
            continue;
        }
        let mut num_var = t[i].is_ascii_digit();
        let mut bracket = false;
        if t[i] == b'{' {
            bracket = true;
            i += 1;
            if i == t.len() {
                return false;
            }
            num_var = t[i].is_ascii_digit();
        }
        let mut n: usize = 0;
        let mut name_len = 0;
        while i < t.len() {
            let ch = t[i];
            if ch == b'}' && bracket {
                i += 1;
                bracket = false;
                break;
            }
            if num_var {
                if !ch.is_ascii_digit() {
                    break;
                }
                n = n.saturating_mul(10).saturating_add(usize::from(ch - b'0'));
            } else if !(ch.is_ascii_alphanumeric() || ch == b'_') {
                break;
            }
            i += 1;
            name_len += 1;
        }
        if bracket || name_len == 0 || !num_var {
            return false;
        }
        out.push(Piece::Cap(n));
    }
    true
}

/// `ngx.re.sub`/`gsub` with a template string, the whole loop here:
/// the count of substitutions (the result in `(*outp, *outlen)`, unset
/// when 0: the subject is the result), or an error code as [`re_exec`]
/// ([`RE_TEMPLATE`] for a bad template).
#[allow(clippy::too_many_arguments)]
unsafe extern "C" fn re_sub(
    pat: *const c_char,
    plen: usize,
    flags: u32,
    subj: *const c_char,
    slen: usize,
    tpl: *const c_char,
    tlen: usize,
    global: c_int,
    outp: OutPtr,
    outlen: OutLen,
    errcode: *mut c_int,
    err: *mut c_char,
    errcap: usize,
) -> c_int {
    guard(|| {
        // SAFETY: the ffi contract (Lua strings passed to this call).
        let (pat, subj, tpl) = unsafe { (arg(pat, plen), arg(subj, slen), arg(tpl, tlen)) };
        if subj.len() > c_int::MAX as usize {
            return E_INVAL;
        }
        CACHE.with_borrow_mut(|c| {
            let mctx = c.mctx;
            let mut ws = std::mem::take(&mut c.workspace);
            let mut pieces = std::mem::take(&mut c.pieces);
            let tpl_ok = parse_template(tpl, &mut pieces);
            let rc = match c.get(pat, flags) {
                Err(msg) => {
                    // SAFETY: `err` is NULL or writable for `errcap` (contract).
                    unsafe { put_err(&msg, err, errcap) };
                    RE_COMPILE
                }
                Ok(_) if !tpl_ok => RE_TEMPLATE,
                Ok(re) => substitute(
                    re,
                    mctx,
                    &mut ws,
                    subj,
                    tpl,
                    &pieces,
                    global != 0,
                    errcode,
                    outp,
                    outlen,
                ),
            };
            c.workspace = ws;
            c.pieces = pieces;
            rc
        })
    })
}

/// The substitution loop of [`re_sub`] (lua-resty-core's, empty matches
/// stepping one character).
#[allow(clippy::too_many_arguments)]
fn substitute(
    re: &Compiled,
    mctx: *mut p2::pcre2_match_context_8,
    ws: &mut Vec<c_int>,
    subj: &[u8],
    tpl: &[u8],
    pieces: &[Piece],
    global: bool,
    errcode: *mut c_int,
    outp: OutPtr,
    outlen: OutLen,
) -> c_int {
    OUT.with_borrow_mut(|o| {
        if o.capacity() > KEEP_BYTES {
            *o = Vec::new();
        }
        o.clear();
        let (mut count, mut pos, mut cp) = (0, 0usize, 0usize);
        loop {
            let rc = Cache::exec(mctx, ws, re, subj, pos);
            if rc == RE_NOMATCH {
                break;
            }
            if rc < 0 {
                // SAFETY: out-pointer NULL or writable (the ffi contract).
                unsafe { put(errcode, rc) };
                return RE_EXEC;
            }
            let Some((from, to)) = pair(re, 0) else { break };
            count += 1;
            o.extend_from_slice(&subj[cp.min(from)..from]);
            // `$N` past the groups set by this match is empty (ngx_lua).
            let set = usize::try_from(rc).unwrap_or(0).min(re.ncap + 1);
            for p in pieces {
                match *p {
                    Piece::Lit(a, b) => o.extend_from_slice(&tpl[a..b]),
                    Piece::Cap(n) if n < set => {
                        if let Some((a, b)) = pair(re, n) {
                            o.extend_from_slice(&subj[a..b]);
                        }
                    }
                    Piece::Cap(_) => {}
                }
            }
            cp = to;
            pos = to;
            if to == from {
                pos = step(re, subj, to);
                if pos > subj.len() {
                    break;
                }
            }
            if !global {
                break;
            }
        }
        if count > 0 {
            if cp < subj.len() {
                o.extend_from_slice(&subj[cp..]);
            }
            // SAFETY: out-pointers NULL or writable (the ffi contract).
            unsafe { out(o, outp, outlen) };
        }
        count
    })
}

/// Compiled patterns cached on this thread (tests, diagnostics).
unsafe extern "C" fn re_cache_count() -> c_int {
    guard(|| CACHE.with_borrow(|c| c.slots.len() as c_int))
}

/// `ngx.re.opt("jit_stack_size", n)`: 0 done, -1 when patterns are cached
/// already (ngx_lua refuses then), -3 bad size, -5 no memory.
unsafe extern "C" fn re_jit_stack_size(size: f64) -> c_int {
    guard(|| {
        if !size.is_finite() || size < 0.0 {
            return E_INVAL;
        }
        let size = (size as usize).clamp(JIT_STACK_MIN, JIT_STACK_MAX);
        CACHE.with_borrow_mut(|c| {
            if !c.slots.is_empty() {
                return -1;
            }
            // SAFETY: PCRE2 allocations, NULL-checked; the old stack is
            // freed only after the context no longer points at it.
            unsafe {
                if c.mctx.is_null() {
                    c.mctx = p2::pcre2_match_context_create_8(ptr::null_mut());
                    if c.mctx.is_null() {
                        return super::E_NOMEM;
                    }
                }
                let stack = p2::pcre2_jit_stack_create_8(JIT_STACK_MIN, size, ptr::null_mut());
                if stack.is_null() {
                    return super::E_NOMEM;
                }
                p2::pcre2_jit_stack_assign_8(c.mctx, None, stack.cast());
                if !c.jit_stack.is_null() {
                    p2::pcre2_jit_stack_free_8(c.jit_stack);
                }
                c.jit_stack = stack;
            }
            0
        })
    })
}

// === string functions ===

/// nginx's `ngx_escape_uri` tables (lua-nginx-module's copy, which leaves
/// `!'()*` unescaped in components), indexed by the escape type:
/// URI, ARGS, URI_COMPONENT, HTML, REFRESH, MEMCACHED, MAIL_AUTH.
static ESCAPE: [[u32; 8]; 7] = {
    const HI: [u32; 4] = [0xffffffff; 4];
    const fn t(a: u32, b: u32, c: u32, d: u32, hi: bool) -> [u32; 8] {
        let h = if hi { HI } else { [0; 4] };
        [a, b, c, d, h[0], h[1], h[2], h[3]]
    }
    [
        t(0xffffffff, 0x80000029, 0x00000000, 0x80000000, true),
        t(0xffffffff, 0x80000829, 0x00000000, 0x80000000, true),
        t(0xffffffff, 0xfc00987d, 0x78000001, 0xb8000001, true),
        t(0xffffffff, 0x000000ad, 0x00000000, 0x80000000, true),
        t(0xffffffff, 0x00000085, 0x00000000, 0x80000000, true),
        t(0xffffffff, 0x00000021, 0x00000000, 0x00000000, false),
        t(0xffffffff, 0x00000021, 0x00000000, 0x00000000, false),
    ]
};

/// Fills the per-thread output buffer with `f` and publishes it.
///
/// # Safety
/// `outp`/`outlen` are NULL or writable.
unsafe fn with_out(outp: OutPtr, outlen: OutLen, f: impl FnOnce(&mut Vec<u8>) -> c_int) -> c_int {
    OUT.with_borrow_mut(|o| {
        if o.capacity() > KEEP_BYTES {
            *o = Vec::new();
        }
        o.clear();
        let rc = f(o);
        // SAFETY: the caller's contract.
        unsafe { out(o, outp, outlen) };
        rc
    })
}

/// `ngx.escape_uri(s, type)`: the number of bytes escaped (0: `s` as is).
unsafe extern "C" fn escape_uri(
    s: *const c_char,
    len: usize,
    kind: c_int,
    outp: OutPtr,
    outlen: OutLen,
) -> c_int {
    guard(|| {
        let Some(table) = usize::try_from(kind).ok().and_then(|k| ESCAPE.get(k)) else {
            return E_INVAL;
        };
        // SAFETY: the ffi contract.
        let s = unsafe { arg(s, len) };
        const HEX: &[u8; 16] = b"0123456789ABCDEF";
        // SAFETY: out-pointers NULL or writable (contract).
        unsafe {
            with_out(outp, outlen, |o| {
                let mut n: c_int = 0;
                for &c in s {
                    if table[usize::from(c >> 5)] & (1 << (c & 0x1f)) != 0 {
                        o.extend_from_slice(&[
                            b'%',
                            HEX[usize::from(c >> 4)],
                            HEX[usize::from(c & 15)],
                        ]);
                        n = n.saturating_add(1);
                    } else {
                        o.push(c);
                    }
                }
                n
            })
        }
    })
}

/// `ngx.unescape_uri(s)`: `%XX` and `+` decoded (ngx_lua's component rules,
/// the same as query-arg decoding in `pier.req`).
unsafe extern "C" fn unescape_uri(
    s: *const c_char,
    len: usize,
    outp: OutPtr,
    outlen: OutLen,
) -> c_int {
    guard(|| {
        // SAFETY: the ffi contract.
        let s = unsafe { arg(s, len) };
        // SAFETY: out-pointers NULL or writable (contract).
        unsafe {
            with_out(outp, outlen, |o| {
                super::req::unescape_into(s, o);
                0
            })
        }
    })
}

unsafe extern "C" fn encode_base64(
    s: *const c_char,
    len: usize,
    no_padding: c_int,
    outp: OutPtr,
    outlen: OutLen,
) -> c_int {
    guard(|| {
        // SAFETY: the ffi contract.
        let s = unsafe { arg(s, len) };
        let engine = if no_padding != 0 {
            &base64::engine::general_purpose::STANDARD_NO_PAD
        } else {
            &base64::engine::general_purpose::STANDARD
        };
        // SAFETY: out-pointers NULL or writable (contract).
        unsafe {
            with_out(outp, outlen, |o| {
                let start = o.len();
                o.resize(
                    start + base64::encoded_len(s.len(), no_padding == 0).unwrap_or(0),
                    0,
                );
                match engine.encode_slice(s, &mut o[start..]) {
                    Ok(n) => {
                        o.truncate(start + n);
                        0
                    }
                    Err(_) => E_INVAL,
                }
            })
        }
    })
}

/// nginx's decoder: stops at the first `=`, accepts missing padding and
/// stray low bits, refuses any other non-alphabet byte. -3 when invalid.
unsafe extern "C" fn decode_base64(
    s: *const c_char,
    len: usize,
    outp: OutPtr,
    outlen: OutLen,
) -> c_int {
    guard(|| {
        // SAFETY: the ffi contract.
        let s = unsafe { arg(s, len) };
        let s = &s[..memchr::memchr(b'=', s).unwrap_or(s.len())];
        if s.len() % 4 == 1 {
            return E_INVAL;
        }
        const LAX: base64::engine::GeneralPurpose = base64::engine::GeneralPurpose::new(
            &base64::alphabet::STANDARD,
            base64::engine::GeneralPurposeConfig::new()
                .with_decode_allow_trailing_bits(true)
                .with_decode_padding_mode(base64::engine::DecodePaddingMode::RequireNone),
        );
        // SAFETY: out-pointers NULL or writable (contract).
        unsafe {
            with_out(outp, outlen, |o| match LAX.decode_vec(s, o) {
                Ok(()) => 0,
                Err(_) => E_INVAL,
            })
        }
    })
}

/// Digests into `dst`: 0 = MD5 (16 bytes), 1 = MD5 as lowercase hex (32),
/// 2 = SHA-1 (20). Returns the length written.
unsafe extern "C" fn digest(kind: c_int, s: *const c_char, len: usize, dst: *mut u8) -> c_int {
    guard(|| {
        // SAFETY: the ffi contract.
        let s = unsafe { arg(s, len) };
        let mut buf = [0u8; 32];
        let n = match kind {
            0 => {
                buf[..16].copy_from_slice(&md5::Md5::digest(s));
                16
            }
            1 => {
                let d = md5::Md5::digest(s);
                hex_into(&d, &mut buf);
                32
            }
            2 => {
                buf[..20].copy_from_slice(&sha1::Sha1::digest(s));
                20
            }
            _ => return E_INVAL,
        };
        if dst.is_null() {
            return E_INVAL;
        }
        // SAFETY: `dst` is writable for 32 bytes (the wrapper's buffer).
        unsafe { ptr::copy_nonoverlapping(buf.as_ptr(), dst, n) };
        n as c_int
    })
}

/// `ngx.hmac_sha1(key, s)` into `dst` (20 bytes).
unsafe extern "C" fn hmac_sha1(
    key: *const c_char,
    klen: usize,
    s: *const c_char,
    len: usize,
    dst: *mut u8,
) -> c_int {
    guard(|| {
        // SAFETY: the ffi contract.
        let (key, s) = unsafe { (arg(key, klen), arg(s, len)) };
        let Ok(mut mac) = hmac::Hmac::<sha1::Sha1>::new_from_slice(key) else {
            return E_INVAL;
        };
        mac.update(s);
        let d = mac.finalize().into_bytes();
        if dst.is_null() {
            return E_INVAL;
        }
        // SAFETY: `dst` is writable for 32 bytes (the wrapper's buffer).
        unsafe { ptr::copy_nonoverlapping(d.as_ptr(), dst, 20) };
        20
    })
}

/// `ngx.crc32_short`/`crc32_long` (the same CRC-32 in nginx).
unsafe extern "C" fn crc32(s: *const c_char, len: usize) -> u32 {
    // SAFETY: the ffi contract.
    let s = unsafe { arg(s, len) };
    std::panic::catch_unwind(|| crc32fast::hash(s)).unwrap_or(0)
}

/// `ngx.quote_sql_str(s)`: MySQL escapes, in single quotes.
unsafe extern "C" fn quote_sql_str(
    s: *const c_char,
    len: usize,
    outp: OutPtr,
    outlen: OutLen,
) -> c_int {
    guard(|| {
        // SAFETY: the ffi contract.
        let s = unsafe { arg(s, len) };
        // SAFETY: out-pointers NULL or writable (contract).
        unsafe {
            with_out(outp, outlen, |o| {
                o.push(b'\'');
                for &c in s {
                    let e = match c {
                        0 => b'0',
                        8 => b'b',
                        b'\n' => b'n',
                        b'\r' => b'r',
                        b'\t' => b't',
                        26 => b'Z',
                        b'\\' | b'\'' | b'"' => c,
                        _ => {
                            o.push(c);
                            continue;
                        }
                    };
                    o.extend_from_slice(&[b'\\', e]);
                }
                o.push(b'\'');
                0
            })
        }
    })
}

/// `ngx.decode_args(s, max)`, split as ngx_lua's `ngx_http_lua_parse_args`
/// (a key without `=` is `true`, empty keys dropped but counted towards
/// `max`, 0 = no limit): pairs in order (`vlen < 0`: no value).
unsafe extern "C" fn decode_args(
    s: *const c_char,
    len: usize,
    max: c_int,
    outp: *mut *const PierPair,
) -> c_int {
    guard(|| {
        // SAFETY: the ffi contract.
        let s = unsafe { arg(s, len) };
        SCRATCH.with_borrow_mut(|sc| {
            sc.bytes.clear();
            sc.spans.clear();
            let mut count: c_int = 0;
            let add = |sc: &mut super::Scratch, k: &[u8], v: Option<&[u8]>| {
                let ks = sc.bytes.len();
                super::req::unescape_into(k, &mut sc.bytes);
                let kl = sc.bytes.len() - ks;
                if kl == 0 {
                    sc.bytes.truncate(ks);
                    return;
                }
                let vs = sc.bytes.len();
                let vl = match v {
                    Some(v) => {
                        super::req::unescape_into(v, &mut sc.bytes);
                        (sc.bytes.len() - vs) as isize
                    }
                    None => -1,
                };
                sc.spans.push((ks, kl, vs, vl));
            };
            let mut parts = s.split(|&c| c == b'&').peekable();
            while let Some(part) = parts.next() {
                let last = parts.peek().is_none();
                // The piece after the last '&' is taken only if non-empty.
                if last && part.is_empty() {
                    break;
                }
                match memchr::memchr(b'=', part) {
                    Some(eq) => add(sc, &part[..eq], Some(&part[eq + 1..])),
                    None => add(sc, part, None),
                }
                // Only pairs ended by '&' count towards `max` (as nginx).
                if !last {
                    count += 1;
                    if max > 0 && count == max {
                        break;
                    }
                }
            }
            // SAFETY: out-pointer NULL or writable (contract).
            unsafe { sc.publish(outp) }
        })
    })
}

fn hex_into(src: &[u8], dst: &mut [u8]) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    for (i, &b) in src.iter().enumerate() {
        dst[2 * i] = HEX[usize::from(b >> 4)];
        dst[2 * i + 1] = HEX[usize::from(b & 15)];
    }
}

/// nginx's `ngx_hex_dump`: lowercase hex of `src` into `dst`, returns the
/// end of what was written. Called by lua-resty-string through `ffi.C`.
///
/// # Safety
/// `src` is valid for `len` bytes and `dst` writable for `2 * len`.
#[no_mangle]
pub unsafe extern "C" fn ngx_hex_dump(dst: *mut u8, src: *const u8, len: usize) -> *mut u8 {
    if dst.is_null() || src.is_null() || len == 0 {
        return dst;
    }
    // SAFETY: the caller's contract (C semantics of nginx's function).
    let (s, d) = unsafe {
        (
            std::slice::from_raw_parts(src, len),
            std::slice::from_raw_parts_mut(dst, 2 * len),
        )
    };
    hex_into(s, d);
    d.as_mut_ptr_range().end
}

/// nginx's `ngx_atoi`: the decimal value of `line[..n]`, or -1 (empty,
/// a non-digit, overflow). Called by lua-resty-string through `ffi.C`.
///
/// # Safety
/// `line` is valid for `n` bytes.
#[no_mangle]
pub unsafe extern "C" fn ngx_atoi(line: *const u8, n: usize) -> isize {
    if line.is_null() || n == 0 {
        return -1;
    }
    // SAFETY: the caller's contract.
    let s = unsafe { std::slice::from_raw_parts(line, n) };
    let mut v: isize = 0;
    for &c in s {
        if !c.is_ascii_digit() {
            return -1;
        }
        v = match v
            .checked_mul(10)
            .and_then(|v| v.checked_add(isize::from(c - b'0')))
        {
            Some(v) => v,
            None => return -1,
        };
    }
    v
}

/// The table; field order and types must match `pier_str_api_t` in
/// `lua/pier/ngx_str.lua`.
#[repr(C)]
pub(crate) struct StrApi {
    re_exec: unsafe extern "C" fn(
        *const c_char,
        usize,
        u32,
        *const c_char,
        usize,
        c_int,
        *mut c_int,
        c_int,
        *mut *const ReInfo,
        *mut c_int,
        *mut c_char,
        usize,
    ) -> c_int,
    re_sub: unsafe extern "C" fn(
        *const c_char,
        usize,
        u32,
        *const c_char,
        usize,
        *const c_char,
        usize,
        c_int,
        OutPtr,
        OutLen,
        *mut c_int,
        *mut c_char,
        usize,
    ) -> c_int,
    re_cache_count: unsafe extern "C" fn() -> c_int,
    re_jit_stack_size: unsafe extern "C" fn(f64) -> c_int,
    escape_uri: unsafe extern "C" fn(*const c_char, usize, c_int, OutPtr, OutLen) -> c_int,
    unescape_uri: unsafe extern "C" fn(*const c_char, usize, OutPtr, OutLen) -> c_int,
    encode_base64: unsafe extern "C" fn(*const c_char, usize, c_int, OutPtr, OutLen) -> c_int,
    decode_base64: unsafe extern "C" fn(*const c_char, usize, OutPtr, OutLen) -> c_int,
    digest: unsafe extern "C" fn(c_int, *const c_char, usize, *mut u8) -> c_int,
    hmac_sha1: unsafe extern "C" fn(*const c_char, usize, *const c_char, usize, *mut u8) -> c_int,
    crc32: unsafe extern "C" fn(*const c_char, usize) -> u32,
    quote_sql_str: unsafe extern "C" fn(*const c_char, usize, OutPtr, OutLen) -> c_int,
    decode_args: unsafe extern "C" fn(*const c_char, usize, c_int, *mut *const PierPair) -> c_int,
    hex_dump: unsafe extern "C" fn(*mut u8, *const u8, usize) -> *mut u8,
    atoi: unsafe extern "C" fn(*const u8, usize) -> isize,
}

static STR_API: StrApi = StrApi {
    re_exec,
    re_sub,
    re_cache_count,
    re_jit_stack_size,
    escape_uri,
    unescape_uri,
    encode_base64,
    decode_base64,
    digest,
    hmac_sha1,
    crc32,
    quote_sql_str,
    decode_args,
    hex_dump: ngx_hex_dump,
    atoi: ngx_atoi,
};

/// The address Lua casts to `const pier_str_api_t*` (fits a double).
pub(crate) fn str_api_addr() -> usize {
    &STR_API as *const StrApi as usize
}
