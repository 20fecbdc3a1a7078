-- pier.ngx_str: ngx.re.* and ngx's string functions, with ngx_lua's
-- semantics (lua-resty-core's regex.lua, ngx/re.lua, uri.lua, base64.lua,
-- hash.lua). The returned table is merged into `ngx` by pier.ngx; `ngx_re`
-- (hidden from pairs) is lua-resty-core's `require "ngx.re"` module.
-- The work is done in Rust (src/ffi/strings.rs) through its own table of
-- function pointers, `pier_str_api_t` (same field order as `StrApi`).
local ffi = require "ffi"
local bit = require "bit"
local base = require "pier.base"
local native = require "pier.native"

-- lua-resty-string (nginx.md5, nginx.sha1, nginx.aes, nginx.random...)
-- calls OpenSSL through ffi.C: load the system libcrypto into the global
-- namespace so ffi.C finds MD5_Init, EVP_*, RAND_bytes. No clash with
-- Pier's own TLS, which is aws-lc with prefixed symbols. Absent library:
-- those modules fail on use, nothing else does.
pcall(ffi.load, "libcrypto.so.3", true)

ffi.cdef [[
typedef struct { const char *name; size_t len; int group; } pier_re_name_t;
typedef struct { int ncap; int name_count; const pier_re_name_t *names; } pier_re_info_t;
typedef struct {
  int (*re_exec)(const char *, size_t, uint32_t, const char *, size_t, int, int *, int,
                 const pier_re_info_t **, int *, char *, size_t);
  int (*re_sub)(const char *, size_t, uint32_t, const char *, size_t, const char *, size_t,
                int, const char **, size_t *, int *, char *, size_t);
  int (*re_cache_count)(void);
  int (*re_jit_stack_size)(double);
  int (*escape_uri)(const char *, size_t, int, const char **, size_t *);
  int (*unescape_uri)(const char *, size_t, const char **, size_t *);
  int (*encode_base64)(const char *, size_t, int, const char **, size_t *);
  int (*decode_base64)(const char *, size_t, const char **, size_t *);
  int (*digest)(int, const char *, size_t, unsigned char *);
  int (*hmac_sha1)(const char *, size_t, const char *, size_t, unsigned char *);
  uint32_t (*crc32)(const char *, size_t);
  int (*quote_sql_str)(const char *, size_t, const char **, size_t *);
  int (*decode_args)(const char *, size_t, int, const pier_pair_t **);
  unsigned char *(*hex_dump)(unsigned char *, const unsigned char *, size_t);
  intptr_t (*atoi)(const unsigned char *, size_t);
} pier_str_api_t;
]]

local api = ffi.cast("const pier_str_api_t*", native.str_api_addr)
local ffi_new, ffi_string = ffi.new, ffi.string
local bor, band = bit.bor, bit.band
local type, tostring, tonumber, error, pairs = type, tostring, tonumber, error, pairs
local setmetatable, sub, byte, concat = setmetatable, string.sub, string.byte, table.concat
local max, min = math.max, math.min
local ptr, len, pairs_out = base.ptr, base.len, base.pairs
local new_tab
do
  local ok, nt = pcall(require, "table.new")
  new_tab = ok and nt or function() return {} end
end

local C_exec, C_sub, C_escape = api.re_exec, api.re_sub, api.escape_uri

local RE_NOMATCH, RE_COMPILE, RE_OVEC, RE_EXEC, RE_TEMPLATE = -1, -1000, -1001, -1002, -1003
local MAX_ERR_MSG_LEN = 128

-- Option letters -> bits (src/ffi/strings.rs F_*); "o" only says "cache",
-- which Rust does for every pattern.
local FLAG_BITS = { i = 1, m = 2, s = 4, x = 8, a = 16, u = 32, U = 64, D = 128,
  J = 256, j = 512, d = 1024, o = 0 }
local F_UTF, F_DUPNAMES = 32 + 64, 128
local opt_cache, opt_count = {}, 0

-- Called directly by the public functions: level 3 is the user's line.
local function parse_opts(opts)
  if type(opts) ~= "string" then opts = tostring(opts) end
  local f = opt_cache[opts]
  if f then return f end
  f = 0
  for i = 1, #opts do
    local b = FLAG_BITS[sub(opts, i, i)]
    if not b then error("unknown flag \"" .. sub(opts, i, i) .. "\"", 3) end
    f = bor(f, b)
  end
  if opt_count < 256 then
    opt_cache[opts], opt_count = f, opt_count + 1
  end
  return f
end

-- Reused out-parameters: the ovector (grown on demand), the info pointer,
-- PCRE2's error code and ngx_lua's 128-byte error buffer.
local ovcap = 64
local ovec = ffi_new("int[?]", ovcap)
local infop = ffi_new("const pier_re_info_t*[1]")
local errc = ffi_new("int[1]")
local errbuf = ffi_new("char[?]", MAX_ERR_MSG_LEN)

local function exec(regex, flags, subj, pos)
  local rc = C_exec(regex, #regex, flags, subj, #subj, pos, ovec, ovcap, infop, errc,
    errbuf, MAX_ERR_MSG_LEN)
  if rc == RE_OVEC then
    ovcap = 2 * (infop[0].ncap + 1)
    ovec = ffi_new("int[?]", ovcap)
    rc = C_exec(regex, #regex, flags, subj, #subj, pos, ovec, ovcap, infop, errc,
      errbuf, MAX_ERR_MSG_LEN)
  end
  return rc
end

-- Compiles without matching (an ovector of 0 makes Rust stop there).
local function compile_only(regex, flags)
  local rc = C_exec(regex, #regex, flags, "", 0, 0, ovec, 0, infop, errc, errbuf,
    MAX_ERR_MSG_LEN)
  if rc == RE_COMPILE then return ffi_string(errbuf) end
  if rc ~= RE_OVEC then return "internal error (" .. tostring(rc) .. ")" end
  return nil
end

local function errstr(rc)
  if rc == RE_COMPILE then return ffi_string(errbuf) end
  if rc == RE_EXEC then return "pcre_exec() failed: " .. tostring(errc[0]) end
  if rc == -3 then return "bad argument" end
  return "internal error (" .. tostring(rc) .. ")"
end

-- A match position from ctx.pos (1-based) or nth: a C int, never NaN.
local function cpos(p)
  if p ~= p or p <= 0 then return 0 end
  return min(p - 1, 0x7fffffff)
end

-- Names of a pattern's named groups as a Lua list {name, group, ...},
-- cached per (flags, pattern) so a match builds no name strings.
local names_cache, names_count = {}, 0
local function names_of(info, flags, regex)
  local byflags = names_cache[flags]
  local list = byflags and byflags[regex]
  if list then return list end
  list = {}
  local names = info.names
  for k = 0, info.name_count - 1 do
    local e = names[k]
    list[2 * k + 1] = ffi_string(e.name, e.len)
    list[2 * k + 2] = e.group
  end
  if names_count >= 1024 then names_cache, names_count = {}, 0 end
  byflags = names_cache[flags]
  if not byflags then byflags = {}; names_cache[flags] = byflags end
  byflags[regex] = list
  names_count = names_count + 1
  return list
end

-- The captures table of the last match: res[0..ncap], unmatched = false,
-- named captures by name (lists of the matched ones under "D").
local function collect(subj, rc, flags, regex, res)
  local info = infop[0]
  local ncap = info.ncap
  if not res then res = new_tab(ncap, info.name_count) end
  for i = 0, ncap do
    local from = ovec[2 * i]
    if i <= rc and from >= 0 then
      res[i] = sub(subj, from + 1, ovec[2 * i + 1])
    else
      res[i] = false
    end
  end
  if info.name_count > 0 then
    local list = names_of(info, flags, regex)
    local dup = band(flags, F_DUPNAMES) ~= 0
    for k = 1, #list, 2 do
      local name, cap = list[k], res[list[k + 1]]
      if dup then
        if cap then
          local old = res[name]
          if old then old[#old + 1] = cap else res[name] = { cap } end
        end
      else
        res[name] = cap
      end
    end
  end
  return res
end

-- After an empty match at 0-based `at`: one character further.
local function step(subj, at, flags)
  local p = at + 1
  if band(flags, F_UTF) ~= 0 then
    local n = #subj
    while p < n do
      local b = byte(subj, p + 1)
      if b < 0x80 or b >= 0xC0 then break end
      p = p + 1
    end
  end
  return p
end

local re = {}

function re.match(subj, regex, opts, ctx, res)
  local flags = 0
  if opts then flags = opt_cache[opts] or parse_opts(opts) end
  if type(subj) ~= "string" then subj = tostring(subj) end
  local pos = 0
  if ctx then
    local p = ctx.pos
    if p then pos = cpos(p) end
  end
  local rc = exec(regex, flags, subj, pos)
  if rc < 0 then
    if rc == RE_NOMATCH then return nil end
    return nil, errstr(rc)
  end
  if ctx then ctx.pos = ovec[1] + 1 end
  return collect(subj, rc, flags, regex, res)
end

function re.find(subj, regex, opts, ctx, nth)
  local flags = 0
  if opts then flags = opt_cache[opts] or parse_opts(opts) end
  if type(subj) ~= "string" then subj = tostring(subj) end
  local pos = 0
  if ctx then
    local p = ctx.pos
    if p then pos = cpos(p) end
  end
  local rc = exec(regex, flags, subj, pos)
  if rc < 0 then
    if rc == RE_NOMATCH then return nil end
    return nil, nil, errstr(rc)
  end
  if ctx then ctx.pos = ovec[1] + 1 end
  if not nth or nth < 0 then nth = 0 end
  if nth > infop[0].ncap then return nil, nil, "nth out of bound" end
  if nth >= rc then return nil, nil end
  local from, to = ovec[2 * nth] + 1, ovec[2 * nth + 1]
  if from < 0 or to < 0 then return nil, nil end
  return from, to
end

do
  local function iterate(self)
    local pos = self._pos
    if not pos then return nil end
    local subj, flags, regex = self._subj, self._flags, self._regex
    local rc = exec(regex, flags, subj, pos)
    if rc < 0 then
      self._pos = nil
      if rc == RE_NOMATCH then return nil end
      return nil, errstr(rc)
    end
    local cp = ovec[1]
    if cp == ovec[0] then
      cp = step(subj, cp, flags)
      if cp > #subj then
        self._pos = nil
        return collect(subj, rc, flags, regex)
      end
    end
    self._pos = cp
    return collect(subj, rc, flags, regex)
  end

  local iter_mt = { __call = iterate }

  -- A callable iterator, as lua-resty-core's (works in `for m in ...`).
  function re.gmatch(subj, regex, opts)
    local flags = 0
    if opts then flags = opt_cache[opts] or parse_opts(opts) end
    if type(subj) ~= "string" then subj = tostring(subj) end
    local err = compile_only(regex, flags)
    if err then return nil, err end
    return setmetatable({ _subj = subj, _regex = regex, _flags = flags, _pos = 0 }, iter_mt)
  end
end

-- sub/gsub with a replacement function: the loop in Lua (the callback may
-- call ngx.re again, so offsets are read before it runs).
local function sub_func(subj, regex, func, flags, global)
  local parts, np = {}, 0
  local count, pos, cp, n = 0, 0, 0, #subj
  while true do
    local rc = exec(regex, flags, subj, pos)
    if rc < 0 then
      if rc == RE_NOMATCH then break end
      return nil, nil, errstr(rc)
    end
    count = count + 1
    local from, to = ovec[0], ovec[1]
    local res = collect(subj, rc, flags, regex)
    parts[np + 1] = sub(subj, cp + 1, from)
    parts[np + 2] = tostring(func(res))
    np = np + 2
    cp, pos = to, to
    if to == from then
      pos = step(subj, to, flags)
      if pos > n then break end
    end
    if not global then break end
  end
  if count == 0 then return subj, 0 end
  if cp < n then parts[np + 1] = sub(subj, cp + 1) end
  return concat(parts), count
end

local function sub_helper(subj, regex, replace, flags, global)
  if type(subj) ~= "string" then subj = tostring(subj) end
  if type(replace) == "function" then
    local err = compile_only(regex, flags)
    if err then return nil, nil, err end
    return sub_func(subj, regex, replace, flags, global)
  end
  if type(replace) ~= "string" then replace = tostring(replace) end
  local n = C_sub(regex, #regex, flags, subj, #subj, replace, #replace, global and 1 or 0,
    ptr, len, errc, errbuf, MAX_ERR_MSG_LEN)
  if n > 0 then return ffi_string(ptr[0], len[0]), n end
  if n == 0 then return subj, 0 end
  if n == RE_TEMPLATE then return nil, nil, "failed to compile the replacement template" end
  return nil, nil, errstr(n)
end

function re.sub(subj, regex, replace, opts)
  local flags = 0
  if opts then flags = opt_cache[opts] or parse_opts(opts) end
  return sub_helper(subj, regex, replace, flags, false)
end

function re.gsub(subj, regex, replace, opts)
  local flags = 0
  if opts then flags = opt_cache[opts] or parse_opts(opts) end
  return sub_helper(subj, regex, replace, flags, true)
end

-- lua-resty-core's ngx.re module: split and opt.
local ngx_re = {}

do
  local split_ctx = {}

  local function split_helper(subj, regex, flags, ctx)
    local rc = exec(regex, flags, subj, max(ctx.pos, 0))
    if rc < 0 then
      if rc == RE_NOMATCH then return nil end
      return nil, nil, nil, errstr(rc)
    end
    local from, to = ovec[0], ovec[1]
    if from < 0 or to < 0 then return nil end
    if from == to then ctx.pos = step(subj, to, flags) else ctx.pos = to end
    local ncap = infop[0].ncap
    if ncap > 0 and rc > 1 then
      -- (An unset group gives the whole subject, as lua-resty-core's.)
      return from + 1, to + 1, sub(subj, ovec[2] + 1, ovec[3])
    end
    return from + 1, to + 1
  end

  function ngx_re.split(subj, regex, opts, ctx, maxn, res)
    subj = tostring(subj)
    local flags = 0
    if opts then flags = opt_cache[opts] or parse_opts(opts) end
    if not ctx then
      ctx = split_ctx
      ctx.pos = 1
    elseif not ctx.pos then
      ctx.pos = 1
    end
    maxn = maxn or 0
    if not res then
      res = new_tab(maxn > 0 and min(4, maxn) or 4, 0)
    elseif type(res) ~= "table" then
      error("res is not a table", 2)
    end
    local n = #subj
    if ctx.pos > n then
      res[1] = nil
      return res
    end
    local err = compile_only(regex, flags)
    if err then return nil, err end

    local sub_idx, res_idx, last_empty = ctx.pos, 0, nil
    ctx.pos = sub_idx - 1
    local count = 1
    while maxn <= 0 or count < maxn do
      local from, to, capture, e = split_helper(subj, regex, flags, ctx)
      if e then return nil, e end
      if not from then break end
      if last_empty then sub_idx = last_empty end
      if from == to then last_empty = from end
      if from > sub_idx or not last_empty then
        count = count + 1
        res_idx = res_idx + 1
        res[res_idx] = sub(subj, sub_idx, from - 1)
        if capture then
          res_idx = res_idx + 1
          res[res_idx] = capture
        end
        sub_idx = to
        if sub_idx > n then break end
      end
    end
    -- Without a limit, trailing empty fields are dropped.
    if maxn <= 0 and sub_idx > n then
      for i = res_idx, 1, -1 do
        if res[i] ~= "" then
          res_idx = i
          break
        end
        res[i] = nil
        if i == 1 then res_idx = 0 end
      end
    else
      res_idx = res_idx + 1
      res[res_idx] = sub(subj, sub_idx)
    end
    res[res_idx + 1] = nil
    return res
  end

  function ngx_re.opt(option, value)
    if option == "jit_stack_size" then
      if type(value) ~= "number" then error("bad jit_stack_size", 2) end
      local rc = api.re_jit_stack_size(value)
      if rc == 0 then return end
      if rc == -1 then
        error("changing jit stack size is not allowed when some regexs have already been "
          .. "compiled and cached", 2)
      end
      error("pcre jit stack allocation failed", 2)
    end
    error("unrecognized option name", 2)
  end
end

-- === string functions ===

local function checkstr(v, n, fname)
  local t = type(v)
  if t == "string" then return v end
  if t == "number" then return tostring(v) end
  error("bad argument #" .. n .. " to '" .. fname .. "' (string expected, got " .. t .. ")", 3)
end

-- nil/false -> "", other non-strings -> tostring (lua-resty-core's rule).
local function tostr(s)
  if type(s) == "string" then return s end
  if not s then return "" end
  return tostring(s)
end

local M = { re = re }

local ESCAPE_URI, ESCAPE_URI_COMPONENT, ESCAPE_MAIL_AUTH = 0, 2, 6

function M.escape_uri(s, esc_type)
  s = tostr(s)
  if esc_type == nil then
    esc_type = ESCAPE_URI_COMPONENT
  else
    if type(esc_type) ~= "number" then error("\"esc_type\" is not number", 2) end
    if esc_type < ESCAPE_URI or esc_type > ESCAPE_MAIL_AUTH or esc_type % 1 ~= 0 then
      error("\"esc_type\" " .. tostring(esc_type) .. " out of range", 2)
    end
  end
  local n = C_escape(s, #s, esc_type, ptr, len)
  if n == 0 then return s end
  return ffi_string(ptr[0], len[0])
end

function M.unescape_uri(s)
  s = tostr(s)
  api.unescape_uri(s, #s, ptr, len)
  return ffi_string(ptr[0], len[0])
end

local function escape_component(s)
  local n = C_escape(s, #s, ESCAPE_URI_COMPONENT, ptr, len)
  if n == 0 then return s end
  return ffi_string(ptr[0], len[0])
end

-- ngx.encode_args: pairs() order (lua_next's), values string/number/true
-- or lists of them; false skipped; URI-component escaping.
function M.encode_args(args)
  if type(args) ~= "table" then
    error("bad argument #1 to 'encode_args' (table expected, got " .. type(args) .. ")", 2)
  end
  local out, n = {}, 0
  for k, v in pairs(args) do
    if type(k) ~= "string" then
      error("attempt to use a non-string key in the \"args\" option table", 2)
    end
    local ek = escape_component(k)
    local tv = type(v)
    if tv == "number" or tv == "string" then
      n = n + 1
      out[n] = ek .. "=" .. escape_component(tostring(v))
    elseif tv == "boolean" then
      if v then
        n = n + 1
        out[n] = ek
      end
    elseif tv == "table" then
      for _, x in pairs(v) do
        local tx = type(x)
        if tx == "boolean" then
          if x then
            n = n + 1
            out[n] = ek
          end
        elseif tx == "number" or tx == "string" then
          n = n + 1
          out[n] = ek .. "=" .. escape_component(tostring(x))
        else
          error("attempt to use " .. tx .. " as query arg value", 2)
        end
      end
    else
      error("attempt to use " .. tv .. " as query arg value", 2)
    end
  end
  return concat(out, "&")
end

function M.decode_args(s, max_args)
  s = checkstr(s, 1, "decode_args")
  local m = 100
  if max_args ~= nil then
    if type(max_args) ~= "number" then
      error("bad argument #2 to 'decode_args' (number expected, got " .. type(max_args) .. ")", 2)
    end
    m = max_args ~= max_args and 0 or max(min(max_args, 0x7fffffff), -1)
  end
  local n = api.decode_args(s, #s, m, pairs_out)
  if n < 0 then error("internal error in decode_args", 2) end
  return base.pairs_table(pairs_out[0], n)
end

function M.encode_base64(s, no_padding)
  s = tostr(s)
  local np = 0
  if no_padding then
    if no_padding ~= true then
      error("bad no_padding: boolean expected, got " .. type(no_padding), 2)
    end
    np = 1
  end
  api.encode_base64(s, #s, np, ptr, len)
  return ffi_string(ptr[0], len[0])
end

function M.decode_base64(s)
  if type(s) ~= "string" then error("string argument only", 2) end
  if api.decode_base64(s, #s, ptr, len) ~= 0 then return nil end
  return ffi_string(ptr[0], len[0])
end

local digest_buf = ffi_new("unsigned char[32]")

function M.md5_bin(s)
  s = tostr(s)
  local n = api.digest(0, s, #s, digest_buf)
  return ffi_string(digest_buf, n)
end

function M.md5(s)
  s = tostr(s)
  local n = api.digest(1, s, #s, digest_buf)
  return ffi_string(digest_buf, n)
end

function M.sha1_bin(s)
  s = tostr(s)
  local n = api.digest(2, s, #s, digest_buf)
  return ffi_string(digest_buf, n)
end

function M.hmac_sha1(key, s)
  key = checkstr(key, 1, "hmac_sha1")
  s = checkstr(s, 2, "hmac_sha1")
  local n = api.hmac_sha1(key, #key, s, #s, digest_buf)
  if n < 0 then error("internal error in hmac_sha1", 2) end
  return ffi_string(digest_buf, n)
end

function M.crc32_short(s)
  s = checkstr(s, 1, "crc32_short")
  return tonumber(api.crc32(s, #s))
end

function M.crc32_long(s)
  s = checkstr(s, 1, "crc32_long")
  return tonumber(api.crc32(s, #s))
end

function M.quote_sql_str(s)
  s = checkstr(s, 1, "quote_sql_str")
  api.quote_sql_str(s, #s, ptr, len)
  return ffi_string(ptr[0], len[0])
end

-- For tests and diagnostics: patterns compiled and cached on this thread.
local hidden = { ngx_re = ngx_re, regex_cache_count = function() return api.re_cache_count() end }

return setmetatable(M, { __index = hidden })
