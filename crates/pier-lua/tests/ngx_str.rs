//! `pier.ngx_str`: ngx.re.* (PCRE2) and ngx's string functions, checked
//! against ngx_lua's documented / tested outputs, plus Debian's
//! lua-resty-string (nginx.md5, nginx.sha1, ...) running unchanged.
#![allow(unsafe_code)] // `LuaEngine::lua`, whose handle must not outlive the engine; nothing else

mod support;

use std::sync::Arc;

use mlua::Table;
use pier_lua::{LuaEngine, LuaSetup, RequestCtx, RouteHooks};
use support::*;

const PRELUDE: &str = r##"
local S = require("pier.ngx_str")
local re = S.re
local function eq(a, b, what)
  if a ~= b then
    error((what or "value") .. ": expected " .. tostring(b) .. ", got " .. tostring(a), 2)
  end
end
"##;

/// Runs `code` (after PRELUDE) as an access hook; Lua asserts do the checks.
fn check_with(setup_fn: impl FnOnce(RouteHooks) -> LuaSetup, name: &str, code: &str) -> LuaEngine {
    let code = format!("{PRELUDE}\n{code}");
    let e = LuaEngine::new(
        Arc::new(setup_fn(RouteHooks {
            access: src(&format!("route ngx_str {name}"), &code),
            ..Default::default()
        })),
        registry(&[("cache", 1 << 20)]),
    )
    .unwrap();
    let mut v = TestView::default();
    let r = run(e.access(0, &mut v, &mut RequestCtx::new()));
    if let Err(err) = r {
        panic!("{name}: {err}");
    }
    e
}

fn check(name: &str, code: &str) -> LuaEngine {
    check_with(setup, name, code)
}

#[test]
fn re_match_captures_and_named() {
    check(
        "match",
        r##"
        local m = re.match("hello 1234", "([0-9])([0-9]+)")
        eq(m[0], "1234"); eq(m[1], "1"); eq(m[2], "234")
        eq(re.match("hello", "x"), nil)
        m = re.match("2024-05", [[(?<y>\d+)-(?<mo>\d+)]])
        eq(m.y, "2024", "named y"); eq(m.mo, "05"); eq(m[1], "2024"); eq(m[2], "05")
        -- unmatched groups are false, numbered and named
        m = re.match("ab", "(a)(?<opt>x)?b")
        eq(m[0], "ab"); eq(m[1], "a"); eq(m[2], false, "unmatched"); eq(m.opt, false, "unmatched named")
        m = re.match("a", "(a)|(b)")
        eq(m[2], false, "group past rc")
        -- res table reused
        local t = {}
        eq(re.match("ab", "(a)(b)", "", nil, t), t, "res reuse"); eq(t[2], "b")
        -- ctx.pos
        local ctx = { pos = 3 }
        m = re.match("a1b2c3", [[\d]], "jo", ctx)
        eq(m[0], "2"); eq(ctx.pos, 5)
        -- non-string subject
        eq(re.match(12345, "3")[0], "3")
        "##,
    );
}

#[test]
fn re_option_letters() {
    check(
        "options",
        r##"
        eq(re.match("HELLO", "hello"), nil); eq(re.match("HELLO", "hello", "i")[0], "HELLO")
        eq(re.match("abc", "a b c"), nil); eq(re.match("abc", "a b c # comment", "x")[0], "abc")
        eq(re.match("a\nb", "a.b"), nil); eq(re.match("a\nb", "a.b", "s")[0], "a\nb")
        eq(re.match("x\nabc", "^abc"), nil); eq(re.match("x\nabc", "^abc", "m")[0], "abc")
        -- u: "." is one character, not one byte
        eq(re.match("h\195\169llo", "^h.llo$"), nil)
        eq(re.match("h\195\169llo", "^h.llo$", "u")[0], "h\195\169llo")
        -- invalid UTF-8: an error with "u", no error (and no match) with "U"
        local m, err = re.match("\255", ".", "u")
        assert(m == nil and err and err:find("pcre_exec() failed: ", 1, true), tostring(err))
        m, err = re.match("\255", "\\x{100}|.", "U")
        eq(m, nil); eq(err, nil)
        -- a: anchored at the start position
        eq(re.match("xabc", "abc", "a"), nil); eq(re.match("abc", "abc", "a")[0], "abc")
        local from, to = re.find("xxabc", "abc", "a", { pos = 3 })
        eq(from, 3); eq(to, 5)
        -- D: duplicate names, lists of the matched ones
        m = re.match("a1b", [[(?<n>a)\d(?<n>b)]], "D")
        assert(type(m.n) == "table" and m.n[1] == "a" and m.n[2] == "b", "dupnames")
        m = re.match("a1", [[(?<n>a)\d(?<n>b)?]], "D")
        eq(#m.n, 1, "unmatched dup not collected")
        m, err = re.match("a1b", [[(?<n>a)\d(?<n>b)]])
        assert(m == nil and err:find("pcre2_compile() failed:", 1, true), tostring(err))
        -- J: JavaScript compatibility (\u escapes)
        eq(re.match("A", [[\u0041]], "J")[0], "A")
        -- j and o: accepted
        eq(re.match("abc", "b", "jo")[0], "b")
        -- d: DFA, longest match, no captures
        eq(re.match("abcd", "a|ab|abc")[0], "a")
        m = re.match("abcd", "(a|ab|abc)", "d")
        eq(m[0], "abc"); eq(m[1], nil, "no captures in DFA mode")
        -- unknown letter: an error at the caller
        local ok, e = pcall(re.match, "a", "a", "Q")
        assert(not ok and e:find('unknown flag "Q"', 1, true), tostring(e))
        "##,
    );
}

#[test]
fn re_lookaround_backrefs_find_gmatch() {
    check(
        "pcre",
        r##"
        eq(re.match("price: 100USD", [[\d+(?=USD)]])[0], "100")
        eq(re.match("100EUR 7USD", [[\d+(?!\d|EUR)]])[0], "7")
        eq(re.match("cost $42", [[(?<=\$)\d+]])[0], "42")
        eq(re.match("x42 $7", [[(?<!\$)\b\d+]]), nil)
        eq(re.match("hello", [[(\w)\1]])[0], "ll")
        eq(re.match("abab", [[(?<p>ab)\k<p>]])[0], "abab")
        -- find: from, to; nth; ctx
        local from, to = re.find("hello 1234", "([0-9])([0-9]+)")
        eq(from, 7); eq(to, 10)
        from, to = re.find("hello 1234", "([0-9])([0-9]+)", "", nil, 2)
        eq(from, 8); eq(to, 10)
        local a, b, err = re.find("hello 1234", "([0-9])([0-9]+)", "", nil, 3)
        eq(a, nil); eq(err, "nth out of bound")
        eq(re.find("abc", "x"), nil)
        local ctx = { pos = 1 }
        from, to = re.find("a1b2c3", [[\d]], "jo", ctx); eq(from, 2); eq(ctx.pos, 3)
        from, to = re.find("a1b2c3", [[\d]], "jo", ctx); eq(from, 4); eq(ctx.pos, 5)
        -- gmatch
        local got = {}
        for m in re.gmatch("a1b22c333", [[\d+]]) do got[#got + 1] = m[0] end
        eq(table.concat(got, ","), "1,22,333")
        local it = re.gmatch("k1=v1, k2=v2", [[(\w+)=(?<v>\w+)]])
        local m = it(); eq(m[1], "k1"); eq(m.v, "v1")
        m = it(); eq(m[1], "k2"); eq(m.v, "v2")
        eq(it(), nil); eq(it(), nil)
        local n = 0
        for m in re.gmatch("abc", "") do n = n + 1; eq(m[0], "") end
        eq(n, 4, "empty matches")
        n = 0
        for m in re.gmatch("h\195\169", "", "u") do n = n + 1 end
        eq(n, 3, "empty matches step over a whole UTF-8 character")
        "##,
    );
}

#[test]
fn re_sub_gsub() {
    check(
        "sub",
        r##"
        local s, n = re.sub("hello, world", "[a-z]+", "howdy")
        eq(s, "howdy, world"); eq(n, 1)
        s, n = re.sub("hello, world", "[A-Z]+", "howdy")
        eq(s, "hello, world"); eq(n, 0)
        -- lua-nginx-module t/036-sub.t
        s, n = re.sub("a b c d", "(b) (c)", "[$0] [$1] [$2] [$3] [$134]")
        eq(s, "a [b c] [b] [c] [] [] d"); eq(n, 1)
        s, n = re.sub("b c d", "(b) (c)", "[$0] [$1] [${2}] [$3] [${134}]")
        eq(s, "[b c] [b] [c] [] [] d")
        eq(re.sub("abc", "b", "$$1"), "a$1c")
        eq(re.sub("abc", "(b)", "${1}x$1y"), "abxbyc")
        for _, bad in ipairs({ "[$hello]", "[${hello}]", "[${134]", "x$", "$-", "${}" }) do
          local r, c, err = re.sub("a b c d", "(b) (c)", bad)
          eq(r, nil, bad); eq(err, "failed to compile the replacement template", bad)
        end
        -- gsub
        s, n = re.gsub("hello world", "o", "0"); eq(s, "hell0 w0rld"); eq(n, 2)
        s, n = re.gsub("abc", "", "-"); eq(s, "-a-b-c-"); eq(n, 4)
        s, n = re.gsub("ab", "x*", "-"); eq(s, "-a-b-"); eq(n, 3)
        s, n = re.gsub("a1b22", [[(\d)(\d)?]], "<$1|$2>"); eq(s, "a<1|>b<2|2>")
        -- a replacement function gets the captures table
        s, n = re.gsub("a1b22", [[\d+]], function(m) return "<" .. m[0] .. ">" end)
        eq(s, "a<1>b<22>"); eq(n, 2)
        s, n = re.sub("k=v", [[(?<k>\w+)=(?<v>\w+)]], function(m) return m.v .. "=" .. m.k end)
        eq(s, "v=k"); eq(n, 1)
        s = re.gsub("abc", "", function() return "." end); eq(s, ".a.b.c.")
        -- a callback that uses ngx.re itself
        s = re.gsub("a1 b2", [[\w\d]], function(m) return (re.sub(m[0], [[\d]], "#")) end)
        eq(s, "a# b#")
        s = re.gsub("x", "x", 42); eq(s, "42")
        "##,
    );
}

#[test]
fn re_errors() {
    check(
        "errors",
        r##"
        local m, err = re.match("a", "(")
        eq(m, nil)
        eq(err, 'pcre2_compile() failed: missing closing parenthesis in "("')
        local a, b, e = re.find("a", "a)b")
        eq(a, nil); eq(b, nil)
        eq(e, 'pcre2_compile() failed: unmatched closing parenthesis in "a)b" at ")b"')
        local s, n, e2 = re.sub("a", "[", "x"); eq(s, nil); assert(e2:find("pcre2_compile"), e2)
        s, n, e2 = re.gsub("a", "[", function() return "" end); eq(s, nil); assert(e2)
        local it, e3 = re.gmatch("a", "*"); eq(it, nil); assert(e3:find("pcre2_compile"), e3)
        -- errors are cut to ngx_lua's 128-byte buffer
        local _, long = re.match("a", string.rep("x", 300) .. "(")
        eq(#long, 127)
        -- a bad regex after a good one with the same options is still an error
        eq(re.match("a", "a")[0], "a")
        eq(select(2, re.match("a", "(")) ~= nil, true)
        "##,
    );
}

#[test]
fn re_cache_is_bounded() {
    check(
        "cache",
        r##"
        for i = 1, 1100 do
          assert(re.find("x" .. i, "x" .. i .. "$", "jo"))
        end
        eq(S.regex_cache_count(), 1024, "cache bound")
        -- the hot pattern is reused, not added again
        for _ = 1, 100 do re.find("abc", "b") end
        eq(S.regex_cache_count(), 1024)
        -- patterns evicted earlier still work (recompiled)
        eq(re.find("x1", "x1$"), 1)
        -- jit stack size can no longer change, as ngx_lua
        local ngx_re = require("ngx.re")
        local ok, err = pcall(ngx_re.opt, "jit_stack_size", 200000)
        assert(not ok and err:find("not allowed", 1, true), tostring(err))
        ok, err = pcall(ngx_re.opt, "nope", 1)
        assert(not ok and err:find("unrecognized option name", 1, true), tostring(err))
        "##,
    );
}

#[test]
fn ngx_re_split() {
    check(
        "split",
        r##"
        local split = require("ngx.re").split
        local function j(t) return table.concat(t, "|") end
        eq(j(split("a,b,,c", ",")), "a|b||c")
        eq(j(split("a,b,", ",")), "a|b", "trailing empty dropped")
        eq(j(split("a1b2c", [[(\d)]])), "a|1|b|2|c", "captures kept")
        eq(j(split("a,b,c", ",", nil, nil, 2)), "a|b,c", "max")
        eq(j(split("a,b,c", ",", nil, { pos = 3 })), "b|c", "ctx.pos")
        eq(j(split("abc", "")), "a|b|c")
        local r, err = split("a", "(")
        eq(r, nil); assert(err:find("pcre2_compile"), err)
        "##,
    );
}

#[test]
fn uri_and_args() {
    check(
        "uri",
        r##"
        -- ngx.escape_uri: URI component by default (unreserved and !*'() kept)
        eq(S.escape_uri("a b/c?d=e&f+g!*'()~-._"), "a%20b%2Fc%3Fd%3De%26f%2Bg!*'()~-._")
        eq(S.escape_uri("\195\169\0"), "%C3%A9%00")
        eq(S.escape_uri("a b/c?d#e", 0), "a%20b/c%3Fd%23e", "ESCAPE_URI")
        eq(S.escape_uri("a+b c", 1), "a%2Bb%20c", "ESCAPE_ARGS")
        eq(S.escape_uri(nil), "")
        eq(S.escape_uri(12), "12")
        local ok, err = pcall(S.escape_uri, "a", 7)
        assert(not ok and err:find("out of range"), err)
        ok, err = pcall(S.escape_uri, "a", "x")
        assert(not ok and err:find("is not number"), err)
        eq(S.unescape_uri("a%20b+c%zz%4%41"), "a b c%zz%4A")
        eq(S.unescape_uri("%E4%BD%A0"), "\228\189\160")
        -- encode_args
        eq(S.encode_args({ a = "b c" }), "a=b%20c")
        eq(S.encode_args({ ["k y"] = { "x", 1.5, true, false } }), "k%20y=x&k%20y=1.5&k%20y")
        eq(S.encode_args({ flag = true, off = false }), "flag")
        eq(S.encode_args({}), "")
        ok, err = pcall(S.encode_args, { [1] = "x" })
        assert(not ok and err:find("non-string key", 1, true), err)
        ok, err = pcall(S.encode_args, { a = {} , b = function() end })
        assert(not ok and err:find("as query arg value"), err)
        local t = S.decode_args(S.encode_args({ x = "1&2=3", y = "\195\169" }))
        eq(t.x, "1&2=3"); eq(t.y, "\195\169")
        -- decode_args
        t = S.decode_args("a=1&b&c=x+y%21&a=2&=z&&d=&e=1=2")
        eq(t.a[1], "1"); eq(t.a[2], "2"); eq(t.b, true); eq(t.c, "x y!"); eq(t.d, ""); eq(t.e, "1=2")
        eq(t[""], nil)
        t = S.decode_args("a=1&b=2&c=3", 2)
        eq(t.a, "1"); eq(t.b, "2"); eq(t.c, nil, "max_args")
        t = S.decode_args("a=1&b=2&c=3", 0)
        eq(t.c, "3", "0 = unlimited")
        local many = {}
        for i = 1, 150 do many[i] = "k" .. i .. "=v" end
        t = S.decode_args(table.concat(many, "&"))
        eq(t.k100, "v"); eq(t.k101, nil, "default limit 100")
        "##,
    );
}

#[test]
fn base64_hashes_crc_sql() {
    check(
        "strings",
        r##"
        eq(S.encode_base64("hello"), "aGVsbG8=")
        eq(S.encode_base64("hello", true), "aGVsbG8")
        eq(S.encode_base64(""), "")
        eq(S.encode_base64(nil), "")
        eq(S.encode_base64("\255\254\253"), "//79")
        local ok, err = pcall(S.encode_base64, "a", 1)
        assert(not ok and err:find("boolean expected"), err)
        eq(S.decode_base64("aGVsbG8="), "hello")
        eq(S.decode_base64("aGVsbG8"), "hello")
        eq(S.decode_base64("YQ==garbage"), "a", "stops at '='")
        eq(S.decode_base64("YR=="), "a", "stray low bits accepted")
        eq(S.decode_base64(""), "")
        eq(S.decode_base64("a"), nil)
        eq(S.decode_base64("!!!!"), nil)
        eq(S.decode_base64("aGVs bG8="), nil)
        ok, err = pcall(S.decode_base64, 12)
        assert(not ok and err:find("string argument only"), err)
        local function hex(s) return (s:gsub(".", function(c) return string.format("%02x", c:byte()) end)) end
        eq(S.md5(""), "d41d8cd98f00b204e9800998ecf8427e")
        eq(S.md5("hello"), "5d41402abc4b2a76b9719d911017c592")
        eq(S.md5(nil), "d41d8cd98f00b204e9800998ecf8427e")
        eq(hex(S.md5_bin("hello")), "5d41402abc4b2a76b9719d911017c592")
        eq(hex(S.sha1_bin("abc")), "a9993e364706816aba3e25717850c26c9cd0d89d")
        eq(hex(S.hmac_sha1("key", "The quick brown fox jumps over the lazy dog")),
          "de7c9b85b8b78aa6bc8a7a36f70a90701c9db4d9")
        eq(#S.hmac_sha1("", ""), 20)
        ok, err = pcall(S.hmac_sha1, nil, "x")
        assert(not ok and err:find("string expected"), err)
        eq(S.crc32_short("hello"), 907060870)
        eq(S.crc32_long("The quick brown fox jumps over the lazy dog"), 1095738169)
        eq(S.crc32_short(""), 0)
        eq(S.quote_sql_str("a'b\"c\\d\ne\0f\26g\r\t\b"), "'a\\'b\\\"c\\\\d\\ne\\0f\\Zg\\r\\t\\b'")
        eq(S.quote_sql_str(""), "''")
        eq(S.quote_sql_str(42), "'42'")
        "##,
    );
}

/// Debian's lua-resty-string (package lua-nginx-string) unchanged: OpenSSL
/// through ffi.C (libcrypto loaded globally by pier.ngx_str) and nginx's
/// ngx_hex_dump / ngx_atoi (exported by this test binary, see build.rs).
/// `PIER_LUA_LIBS` names the unpacked libraries (`./test.sh` sets it, via
/// .ci/install); the test fails when it is unset or the library is missing.
#[test]
fn lua_resty_string_runs_unchanged() {
    let dir = std::env::var("PIER_LUA_LIBS").unwrap_or_else(|_| {
        panic!(
            "PIER_LUA_LIBS is unset: run ./test.sh (its .ci/install unpacks Debian's \
             lua-nginx-string), or `source target/test-env.sh` after one install"
        )
    });
    assert!(
        std::path::Path::new(&dir).join("nginx/string.lua").exists(),
        "PIER_LUA_LIBS={dir} lacks nginx/string.lua: the library install is broken"
    );
    check_with(
        |hooks| LuaSetup {
            routes: vec![hooks],
            package_path: vec![format!("{dir}/?.lua")],
            ..Default::default()
        },
        "resty.string",
        r##"
        local str = require "nginx.string"
        eq(str.to_hex("\1\255abc"), "01ff616263")
        eq(str.to_hex(""), "")
        eq(str.atoi("12345"), 12345)
        eq(str.atoi("12a"), -1)
        eq(str.atoi(""), -1)
        local md5 = require("nginx.md5"):new()
        assert(md5:update("hel")); assert(md5:update("lo"))
        eq(str.to_hex(md5:final()), "5d41402abc4b2a76b9719d911017c592")
        local sha1 = require("nginx.sha1"):new()
        sha1:update("abc")
        eq(str.to_hex(sha1:final()), "a9993e364706816aba3e25717850c26c9cd0d89d")
        local sha256 = require("nginx.sha256"):new()
        sha256:update("hello")
        eq(str.to_hex(sha256:final()), "2cf24dba5fb0a30e26e83b2ac5b9e29e1b161e5c1fa7425e73043362938b9824")
        local aes = require "nginx.aes"
        local a = assert(aes:new("secret-key", "saltsalt"))
        local enc = a:encrypt("attack at dawn")
        assert(enc and #enc == 16 and enc ~= "attack at dawn")
        eq(a:decrypt(enc), "attack at dawn")
        local a256 = assert(aes:new("k", nil, aes.cipher(256, "cbc"), aes.hash.sha256, 3))
        eq(a256:decrypt(a256:encrypt("x")), "x")
        local random = require "nginx.random"
        local r = random.bytes(16, true)
        eq(#r, 16)
        assert(r ~= random.bytes(16, true))
        "##,
    );
}

/// A hot `ngx.re.find` loop compiles to machine code: no trace abort in
/// pier.ngx_str's wrappers, and the pattern is compiled once.
#[test]
fn jit_hot_re_find() {
    let e = check(
        "jit",
        r##"
        local find = re.find
        local res = { stops = 0, bad = {} }
        local jutil = require("jit.util")
        local function on_trace(what, tr, func, pc, otr, oex)
          if what == "stop" then
            res.stops = res.stops + 1
          elseif what == "abort" then
            local fi = jutil.funcinfo(func, pc)
            local at = tostring(fi.source) .. ":" .. tostring(fi.currentline)
            -- trace-shape aborts (leaving/inner loop, unroll, down-recursion,
            -- return to lower frame) say nothing about the wrapper
            local shape = otr == 8 or otr == 9 or otr == 10 or otr == 14 or otr == 16
            if not shape and at:find("pier/", 1, true) then
              res.bad[#res.bad + 1] = at .. " (" .. tostring(otr) .. ")"
            end
          end
        end
        jit.flush()
        jit.attach(on_trace, "trace")
        local hits = 0
        local subj = "GET /api/v1/items/12345?x=1"
        for i = 1, 20000 do
          local from, to = find(subj, [[/items/(\d+)]], "jo")
          if from then hits = hits + to - from end
        end
        jit.attach(on_trace)
        eq(hits, 20000 * 11)
        JIT_RESULT = res
        "##,
    );
    // SAFETY: used while `e` lives, not kept.
    let res: Table = unsafe { e.lua() }.globals().get("JIT_RESULT").unwrap();
    let stops: i64 = res.get("stops").unwrap();
    let bad: Vec<String> = res
        .get::<Table>("bad")
        .unwrap()
        .sequence_values()
        .map(Result::unwrap)
        .collect();
    assert!(stops >= 1, "no trace compiled");
    assert!(bad.is_empty(), "trace aborts in pier.ngx_str: {bad:?}");
}

/// `require` answers a loaded module from Lua (a per-request `require` is
/// ngx_lua's idiom) and keeps LuaJIT's semantics for everything else:
/// preload, a module returning nothing, loops, missing modules, a replaced
/// `package.loaded`.
#[test]
fn require_keeps_luajits_semantics() {
    check(
        "require",
        r##"
        local S2 = require "pier.ngx_str"
        eq(S2, S, "a loaded module is the same table")
        eq(package.loaded["pier.ngx_str"], S)
        local n = 0
        package.preload["pier_t_mod"] = function(name) n = n + 1; return { name = name } end
        eq(require("pier_t_mod").name, "pier_t_mod")
        eq(require("pier_t_mod").name, "pier_t_mod")
        eq(n, 1, "preload runs once")
        package.preload["pier_t_nil"] = function() n = n + 1 end
        eq(require "pier_t_nil", true, "nothing returned")
        eq(require "pier_t_nil", true, "nothing returned, again")
        eq(n, 2)
        -- false is not loaded: LuaJIT loads the module again
        package.loaded["pier_t_mod"] = false
        eq(require("pier_t_mod").name, "pier_t_mod")
        eq(n, 3, "false reloads")
        package.preload["pier_t_loop"] = function() return require "pier_t_loop" end
        local ok, err = pcall(require, "pier_t_loop")
        eq(ok, false)
        assert(tostring(err):find("loop or previous error loading module 'pier_t_loop'", 1, true), err)
        ok, err = pcall(require, "pier_t_no_such_module")
        eq(ok, false)
        assert(tostring(err):find("module 'pier_t_no_such_module' not found", 1, true), err)
        -- the registry's table is what counts, as in LuaJIT
        local loaded = package.loaded
        package.loaded = {}
        eq(require "pier.ngx_str", S, "registry table, not package.loaded")
        package.loaded = loaded
        "##,
    );
}
