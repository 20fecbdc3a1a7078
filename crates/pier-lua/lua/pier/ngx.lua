-- The global `ngx`: OpenResty's API (lua-nginx-module 0.10.23 and
-- lua-resty-core) over the same FFI functions as `pier.*`, so libraries
-- written for ngx_lua run unchanged. No second implementation: each call
-- checks its phase the ngx way (so the error reads as ngx_lua's, at the
-- caller's line) and then goes through `pier.*` or the C table directly.
-- docs/lua.md has the compatibility table, call by call.
local ffi = require "ffi"
local base = require "pier.base"
local pier = require "pier"

local api, native, masks, fail = base.api, base.native, base.masks, base.fail
local ffi_string, type, tostring, tonumber, select, concat, error, rawget, rawset, setmetatable, pairs =
  ffi.string, type, tostring, tonumber, select, table.concat, error, rawget, rawset, setmetatable, pairs
local floor, str_find, str_sub, str_lower, str_gsub, str_byte, os_date =
  math.floor, string.find, string.sub, string.lower, string.gsub, string.byte, os.date
local co_yield = coroutine.yield

ffi.cdef [[
typedef struct {
  double (*wall_now)(void);
  int (*req_set_method)(const char *, size_t);
  int (*worker_id)(void);
  int (*worker_count)(void);
} pier_ngx_api_t;
]]
local napi = ffi.cast("const pier_ngx_api_t*", native.ngx_api_addr)
local C_wall_now, C_phase_allowed, C_phase = napi.wall_now, api.phase_allowed, api.phase

local ngx = {
  OK = 0, ERROR = -1, AGAIN = -2, DONE = -4, DECLINED = -5,
  -- methods (numbers, as ngx.req.set_method takes them)
  HTTP_GET = 2, HTTP_HEAD = 4, HTTP_POST = 8, HTTP_PUT = 16, HTTP_DELETE = 32,
  HTTP_MKCOL = 64, HTTP_COPY = 128, HTTP_MOVE = 256, HTTP_OPTIONS = 512,
  HTTP_PROPFIND = 1024, HTTP_PROPPATCH = 2048, HTTP_LOCK = 4096, HTTP_UNLOCK = 8192,
  HTTP_PATCH = 16384, HTTP_TRACE = 32768,
  -- statuses
  HTTP_CONTINUE = 100, HTTP_SWITCHING_PROTOCOLS = 101,
  HTTP_OK = 200, HTTP_CREATED = 201, HTTP_ACCEPTED = 202, HTTP_NO_CONTENT = 204,
  HTTP_PARTIAL_CONTENT = 206, HTTP_SPECIAL_RESPONSE = 300,
  HTTP_MOVED_PERMANENTLY = 301, HTTP_MOVED_TEMPORARILY = 302, HTTP_SEE_OTHER = 303,
  HTTP_NOT_MODIFIED = 304, HTTP_TEMPORARY_REDIRECT = 307, HTTP_PERMANENT_REDIRECT = 308,
  HTTP_BAD_REQUEST = 400, HTTP_UNAUTHORIZED = 401, HTTP_PAYMENT_REQUIRED = 402,
  HTTP_FORBIDDEN = 403, HTTP_NOT_FOUND = 404, HTTP_NOT_ALLOWED = 405,
  HTTP_NOT_ACCEPTABLE = 406, HTTP_REQUEST_TIMEOUT = 408, HTTP_CONFLICT = 409,
  HTTP_GONE = 410, HTTP_UPGRADE_REQUIRED = 426, HTTP_TOO_MANY_REQUESTS = 429,
  HTTP_CLOSE = 444, HTTP_ILLEGAL = 451,
  HTTP_INTERNAL_SERVER_ERROR = 500, HTTP_METHOD_NOT_IMPLEMENTED = 501,
  HTTP_BAD_GATEWAY = 502, HTTP_SERVICE_UNAVAILABLE = 503, HTTP_GATEWAY_TIMEOUT = 504,
  HTTP_VERSION_NOT_SUPPORTED = 505, HTTP_INSUFFICIENT_STORAGE = 507,
  -- log levels
  STDERR = 0, EMERG = 1, ALERT = 2, CRIT = 3, ERR = 4, WARN = 5, NOTICE = 6, INFO = 7, DEBUG = 8,
  null = native.null,
}

-- === phases ===

-- Pier's phase ids (src/phase.rs) → ngx.get_phase() names and the context
-- names of ngx_lua's "API disabled in the context of ..." errors.
local phase_names = { [0] = "init", "init_worker", "access", "content", "balancer",
  "access", "header_filter", "body_filter", "log", "timer" }
local contexts = { [0] = "init_by_lua*", "init_worker_by_lua*", "access_by_lua*",
  "content_by_lua*", "balancer_by_lua*", "access_by_lua*", "header_filter_by_lua*",
  "body_filter_by_lua*", "log_by_lua*", "ngx.timer" }

-- Raises ngx_lua's error for a call not allowed now, at the user's line
-- (`level` 3: the caller of the wrapper that called check).
local function disabled()
  error("API disabled in the context of " .. (contexts[C_phase()] or "(unknown)"), 3)
end

local M_REQ_READ, M_REQ_WRITE, M_RESP_READ, M_RESP_WRITE, M_EXIT, M_SAY, M_CTX, M_YIELD, M_TIMER =
  masks.req_read, masks.req_write, masks.resp_read, masks.resp_write, masks.exit, masks.say,
  masks.ctx, masks.yield, masks.timer

function ngx.get_phase()
  return phase_names[C_phase()] or "init"
end

-- === logging ===

local function log_piece(v)
  if v == nil then return "nil" end
  local t = type(v)
  if t == "string" then return v end
  if t == "boolean" or t == "number" then return tostring(v) end
  if v == native.null then return "null" end
  if t == "table" then
    local mt = getmetatable(v)
    if mt and mt.__tostring then return tostring(v) end
  end
  error("bad argument #" .. "? to 'log' (string, number, boolean, or nil expected, got " .. t .. ")", 3)
end

-- ngx.log(level, ...): the pieces concatenated as ngx_lua does (nil → "nil",
-- ngx.null → "null"); levels 0 (STDERR) to 8 (DEBUG).
function ngx.log(level, ...)
  level = tonumber(level)
  if not level then error("bad argument #1 to 'log' (number expected)", 2) end
  local n = select("#", ...)
  local parts = {}
  for i = 1, n do parts[i] = log_piece((select(i, ...))) end
  local msg = concat(parts)
  local info = debug.getinfo(2, "Sl")
  if info then msg = info.short_src .. ":" .. info.currentline .. ": " .. msg end
  if level == 0 then level = 4 end
  api.log(level, msg, #msg)
end

-- === time ===

function ngx.now()
  return C_wall_now()
end

function ngx.time()
  return floor(C_wall_now())
end

-- ngx.now() reads the clock on each call (a vDSO read), so there is no
-- cached time to refresh.
function ngx.update_time() end

function ngx.today()
  return os_date("%Y-%m-%d", floor(C_wall_now()))
end

function ngx.localtime()
  return os_date("%Y-%m-%d %H:%M:%S", floor(C_wall_now()))
end

function ngx.utctime()
  return os_date("!%Y-%m-%d %H:%M:%S", floor(C_wall_now()))
end

function ngx.http_time(sec)
  sec = tonumber(sec)
  if not sec then error("bad argument #1 to 'http_time' (number expected)", 2) end
  return os_date("!%a, %d %b %Y %H:%M:%S GMT", floor(sec))
end

function ngx.cookie_time(sec)
  sec = tonumber(sec)
  if not sec then error("bad argument #1 to 'cookie_time' (number expected)", 2) end
  return os_date("!%a, %d-%b-%y %H:%M:%S GMT", floor(sec))
end

local months = { Jan = 1, Feb = 2, Mar = 3, Apr = 4, May = 5, Jun = 6, Jul = 7, Aug = 8,
  Sep = 9, Oct = 10, Nov = 11, Dec = 12 }

-- Days from 1970-01-01 to y-m-d (proleptic Gregorian), without os.time's
-- local time zone.
local function days_from_civil(y, m, d)
  if m <= 2 then y = y - 1 end
  local era = floor(y / 400)
  local yoe = y - era * 400
  local mp = (m + 9) % 12
  local doy = floor((153 * mp + 2) / 5) + d - 1
  local doe = yoe * 365 + floor(yoe / 4) - floor(yoe / 100) + doy
  return era * 146097 + doe - 719468
end

-- The three date forms of RFC 9110 §5.6.7 (as nginx's ngx_parse_http_time).
function ngx.parse_http_time(str)
  if type(str) ~= "string" then error("bad argument #1 to 'parse_http_time' (string expected)", 2) end
  local d, mon, y, h, mi, s = str:match("^%a+, (%d%d?) (%a%a%a) (%d%d%d%d) (%d%d):(%d%d):(%d%d) GMT$")
  if not d then
    d, mon, y, h, mi, s = str:match("^%a+, (%d%d?)%-(%a%a%a)%-(%d%d) (%d%d):(%d%d):(%d%d) GMT$")
    if d then
      y = tonumber(y)
      y = y + (y < 70 and 2000 or 1900)
    else
      mon, d, h, mi, s, y = str:match("^%a+ (%a%a%a) +(%d%d?) (%d%d):(%d%d):(%d%d) (%d%d%d%d)$")
      if not mon then return nil end
    end
  end
  local m = months[mon]
  d, y, h, mi, s = tonumber(d), tonumber(y), tonumber(h), tonumber(mi), tonumber(s)
  if not m or d < 1 or d > 31 or h > 23 or mi > 59 or s > 60 then return nil end
  return days_from_civil(y, m, d) * 86400 + h * 3600 + mi * 60 + s
end

function ngx.sleep(sec)
  if C_phase_allowed(M_YIELD) == 0 then disabled() end
  sec = tonumber(sec)
  if not sec or sec < 0 then error("bad argument #1 to 'sleep' (invalid sleep duration)", 2) end
  return native.sleep(sec)
end

-- === flow and output ===

-- ngx.exit(status): >= 200 (or 444) answers now; ngx.OK (0) ends the hook
-- and goes on; ngx.ERROR and other negative codes answer 500.
function ngx.exit(status)
  local s = tonumber(status)
  if not s then error("bad argument #1 to 'exit' (number expected)", 2) end
  if C_phase_allowed(M_EXIT) == 0 then disabled() end
  if s < 0 then s = 500 end
  if s > 0 and s < 100 then s = 500 end
  -- ngx.exit(ngx.HTTP_OK) finishes with the status already set
  -- (`ngx.status = 201; ngx.say(...); ngx.exit(200)` answers 201).
  if s == 200 then
    local cur = api.resp_status()
    if cur > 0 then s = cur end
  end
  local rc = api.exit(s, nil, 0, 0)
  if rc < 0 then fail(rc, "ngx.exit") end
  co_yield()
end

function ngx.redirect(uri, status)
  if type(uri) ~= "string" then error("bad argument #1 to 'redirect' (string expected)", 2) end
  status = tonumber(status) or 302
  if status ~= 301 and status ~= 302 and status ~= 303 and status ~= 307 and status ~= 308 then
    error("only ngx.HTTP_MOVED_TEMPORARILY, ngx.HTTP_MOVED_PERMANENTLY, ngx.HTTP_PERMANENT_REDIRECT, "
      .. "ngx.HTTP_SEE_OTHER, and ngx.HTTP_TEMPORARY_REDIRECT are allowed", 2)
  end
  if C_phase_allowed(M_EXIT) == 0 then disabled() end
  local rc = api.redirect(uri, #uri, status)
  if rc < 0 then fail(rc, "ngx.redirect") end
  co_yield()
end

local null = native.null

-- Output pieces as ngx.say takes them: strings, numbers, booleans, nil,
-- ngx.null and (nested) arrays of those.
local function flatten(out, n, v, depth)
  local t = type(v)
  if t == "string" then
    n = n + 1; out[n] = v
  elseif t == "table" then
    if depth > 100 then error("nested table too deep", 4) end
    for i = 1, #v do n = flatten(out, n, v[i], depth + 1) end
  elseif t == "number" or t == "boolean" then
    n = n + 1; out[n] = tostring(v)
  elseif v == nil then
    n = n + 1; out[n] = "nil"
  elseif v == null then
    n = n + 1; out[n] = "null"
  else
    error("bad argument to 'say' (string, number, boolean, nil, ngx.null, or array table expected, got "
      .. t .. ")", 4)
  end
  return n
end

local L_say, E_PHASE = native.say_c, -2

local function emit(nl, ...)
  if select("#", ...) == 1 then
    -- One string or number, the common case: one classic C call, no table
    -- and no loop. It often runs right after a cosocket wait, which ends
    -- traces, so it is interpreted, where an FFI call costs far more. (A
    -- trace that starts here and leaves a loop is aborted, and after a
    -- random number of aborts LuaJIT blacklists the function for good.)
    local rc = L_say((...), nl)
    if rc ~= 1 then
      if rc == E_PHASE then return nil end
      return rc
    end
  end
  if C_phase_allowed(M_SAY) == 0 then return nil end
  local out, n = {}, 0
  for i = 1, select("#", ...) do n = flatten(out, n, (select(i, ...)), 0) end
  if nl then n = n + 1; out[n] = "\n" end
  local s = concat(out)
  return api.say(s, #s)
end

-- Output is buffered and sent when the hook ends (as ngx.say with
-- lua_http10_buffering; ngx.flush cannot push it earlier).
function ngx.say(...)
  local rc = emit(true, ...)
  if rc == nil then disabled() end
  if rc < 0 then fail(rc, "ngx.say") end
  return 1
end

function ngx.print(...)
  local rc = emit(false, ...)
  if rc == nil then disabled() end
  if rc < 0 then fail(rc, "ngx.print") end
  return 1
end

function ngx.flush()
  if C_phase_allowed(M_SAY) == 0 then disabled() end
  return 1
end

function ngx.eof()
  if C_phase_allowed(M_SAY) == 0 then disabled() end
  return 1
end

function ngx.send_headers()
  if C_phase_allowed(M_SAY) == 0 then disabled() end
  return 1
end

function ngx.on_abort()
  return nil, "lua_check_client_abort is off"
end

local function unsupported(what, instead)
  return function()
    error(what .. " is not supported by Pier" .. (instead and ("; " .. instead) or ""), 2)
  end
end

ngx.exec = unsupported("ngx.exec", "route with [[route]] rules instead")
ngx.location = {
  capture = unsupported("ngx.location.capture", "use ngx.socket.tcp or pier.http.request"),
  capture_multi = unsupported("ngx.location.capture_multi", "use ngx.thread.spawn with pier.http.request"),
}

-- === request ===

local preq, presp = pier.req, pier.resp
local method_names = { [2] = "GET", [4] = "HEAD", [8] = "POST", [16] = "PUT", [32] = "DELETE",
  [64] = "MKCOL", [128] = "COPY", [256] = "MOVE", [512] = "OPTIONS", [1024] = "PROPFIND",
  [2048] = "PROPPATCH", [4096] = "LOCK", [8192] = "UNLOCK", [16384] = "PATCH", [32768] = "TRACE" }

local req = {}
ngx.req = req

function req.get_method()
  if C_phase_allowed(M_REQ_READ) == 0 then disabled() end
  return preq.get_method()
end

function req.set_method(id)
  local name = method_names[tonumber(id) or 0]
  if not name then error("unsupported HTTP method: " .. tostring(id), 2) end
  if C_phase_allowed(M_REQ_WRITE) == 0 then disabled() end
  local rc = napi.req_set_method(name, #name)
  if rc < 0 then fail(rc, "ngx.req.set_method") end
end

-- The request's start: the clock snapshot taken when its head arrived.
function req.start_time()
  if C_phase_allowed(M_REQ_READ) == 0 then disabled() end
  return api.now()
end

function req.is_internal()
  return false
end

local function truncate_args(t, max)
  max = tonumber(max) or 100
  if max <= 0 then return t end
  local n, out = 0, {}
  for k, v in pairs(t) do
    local c = type(v) == "table" and #v or 1
    if n + c > max then return out, "truncated" end
    n = n + c
    out[k] = v
  end
  return out
end

function req.get_uri_args(max)
  if C_phase_allowed(M_REQ_READ) == 0 then disabled() end
  return truncate_args(preq.get_uri_args(), max)
end

function req.set_uri_args(args)
  if C_phase_allowed(M_REQ_WRITE) == 0 then disabled() end
  preq.set_uri_args(args)
end

-- set_uri(uri[, jump]): jump re-runs location matching in nginx; Pier has
-- matched the route already, so only the non-jumping form exists.
function req.set_uri(uri, jump)
  if type(uri) ~= "string" or #uri == 0 then error("bad argument #1 to 'set_uri' (non-empty string expected)", 2) end
  if jump then error("ngx.req.set_uri with jump = true is not supported by Pier (routes are matched before hooks)", 2) end
  if C_phase_allowed(M_REQ_WRITE) == 0 then disabled() end
  if str_byte(uri, 1) ~= 47 then uri = "/" .. uri end
  local rc = api.req_set_path(uri, #uri)
  if rc < 0 then fail(rc, "ngx.req.set_uri") end
end

function req.get_headers(max, raw)
  if C_phase_allowed(M_REQ_READ) == 0 then disabled() end
  local h = preq.get_headers()
  max = tonumber(max) or 100
  if max > 0 then
    local n = 0
    for _, v in pairs(h) do n = n + (type(v) == "table" and #v or 1) end
    if n > max then return truncate_args(h, max) end
  end
  return h
end

function req.set_header(name, value)
  if type(name) ~= "string" then error("bad argument #1 to 'set_header' (string expected)", 2) end
  if C_phase_allowed(M_REQ_WRITE) == 0 then disabled() end
  if value == nil then return preq.clear_header(name) end
  preq.set_header(name, value)
end

function req.clear_header(name)
  if type(name) ~= "string" then error("bad argument #1 to 'clear_header' (string expected)", 2) end
  if C_phase_allowed(M_REQ_WRITE) == 0 then disabled() end
  preq.clear_header(name)
end

-- Request bodies, as ngx_lua: read_body yields while the proxy reads the
-- whole body into memory (bounded by [limits] max_buffered_body_bytes and
-- max_body_bytes: past them the hook ends and the client gets 413), then
-- forwards it to the origin as received. Without read_body the body streams
-- to the origin and no hook sees it.
local function has_body()
  local te = preq.get_header("transfer-encoding")
  if te then return true end
  local cl = tonumber(preq.get_header("content-length") or "0")
  return cl == nil or cl > 0
end

function req.read_body()
  if C_phase_allowed(M_SAY) == 0 then disabled() end
  native.read_body()
end

-- The body stays with the client connection and streams to the origin (a
-- no-op, as discarding it would send the origin a request without it).
function req.discard_body()
  if C_phase_allowed(M_SAY) == 0 then disabled() end
end

function req.get_body_data()
  if C_phase_allowed(M_REQ_READ) == 0 then disabled() end
  return native.body_data()
end

-- Bodies are never spilled to a file: always nil, as ngx_lua's when the
-- body fits its buffer.
function req.get_body_file()
  if C_phase_allowed(M_REQ_READ) == 0 then disabled() end
  return nil
end

function req.get_post_args(max)
  if C_phase_allowed(M_REQ_READ) == 0 then disabled() end
  if max ~= nil and type(max) ~= "number" then
    error("bad argument #1 to 'get_post_args' (number expected, got " .. type(max) .. ")", 2)
  end
  max = max or 100
  local body = native.body_data()
  if body == nil then
    if has_body() then
      error("no request body found; maybe you should turn on lua_need_request_body?", 2)
    end
    return {}
  end
  local t = ngx.decode_args(body, max)
  if max > 0 then
    local n = 0
    for _ in string.gmatch(body, "[^&]+") do
      n = n + 1
      if n > max then return t, "truncated" end
    end
  end
  return t
end

function req.raw_header(no_request_line)
  if C_phase_allowed(M_REQ_READ) == 0 then disabled() end
  return native.raw_header(no_request_line and true or false)
end

-- From the request line raw_header rebuilds (HTTP/1.0, HTTP/1.1, HTTP/2.0).
function req.http_version()
  if C_phase_allowed(M_REQ_READ) == 0 then disabled() end
  local h = native.raw_header(false)
  local v = h and h:match("^[^\r]* HTTP/(%d%.%d)\r\n")
  return v and tonumber(v) or nil
end

-- ngx.req.socket(): the body as ngx_lua's downstream cosocket reads it
-- (receive, receiveany, receiveuntil: what lua-resty-upload uses), served
-- from the body read_body keeps in memory, so bounded as it is (413 past
-- max_buffered_body_bytes). Not raw: the connection is not lent to Lua.
local ReqSock = {}
ReqSock.__index = ReqSock

local function closed(self)
  local rest = str_sub(self.buf, self.pos)
  self.pos = #self.buf + 1
  return nil, "closed", rest
end

function ReqSock:receive(pat)
  if type(self) ~= "table" or getmetatable(self) ~= ReqSock then
    error("bad argument #1 to 'receive' (request socket expected)", 2)
  end
  local buf, pos = self.buf, self.pos
  if pat == nil or pat == "*l" then
    local nl = str_find(buf, "\n", pos, true)
    if not nl then return closed(self) end
    self.pos = nl + 1
    local last = nl - 1
    if last >= pos and str_byte(buf, last) == 13 then last = last - 1 end
    return str_sub(buf, pos, last)
  elseif pat == "*a" then
    self.pos = #buf + 1
    return str_sub(buf, pos)
  end
  local n = tonumber(pat)
  if not n or n < 0 or n ~= n then
    error("bad argument #1 to 'receive' (bad pattern argument)", 2)
  end
  n = floor(n)
  if pos + n - 1 > #buf then return closed(self) end
  self.pos = pos + n
  return str_sub(buf, pos, pos + n - 1)
end

function ReqSock:receiveany(max)
  local n = tonumber(max)
  if not n or n <= 0 or n ~= n then
    error("bad argument #1 to 'receiveany' (bad max argument)", 2)
  end
  local pos = self.pos
  if pos > #self.buf then return nil, "closed" end
  local last = math.min(pos + floor(n) - 1, #self.buf)
  self.pos = last + 1
  return str_sub(self.buf, pos, last)
end

function ReqSock:receiveuntil(pat, opts)
  if type(pat) ~= "string" or pat == "" then
    error("bad argument #1 to 'receiveuntil' (non-empty string expected)", 2)
  end
  local inclusive = type(opts) == "table" and opts.inclusive == true
  local hit = false  -- size mode, inclusive: the pattern went out, nil next
  return function(size)
    if hit then
      hit = false
      return nil
    end
    local buf, pos = self.buf, self.pos
    local s, e = str_find(buf, pat, pos, true)
    if not s then return closed(self) end
    local stop = inclusive and e or s - 1
    if size ~= nil then
      local n = tonumber(size)
      if not n or n <= 0 or n ~= n then
        error("bad argument #1 to iterator (bad size)", 2)
      end
      -- Pieces of at most `size` bytes, then nil (the pattern consumed).
      if pos > stop then
        self.pos = e + 1
        return nil
      end
      local last = math.min(pos + floor(n) - 1, stop)
      self.pos = last + 1
      hit = last == e
      return str_sub(buf, pos, last)
    end
    self.pos = e + 1
    return str_sub(buf, pos, stop)
  end
end

-- Timeouts do not apply: the body is in memory before the first receive.
function ReqSock.settimeout() end
function ReqSock.settimeouts() end

function req.socket(raw)
  if C_phase_allowed(M_SAY) == 0 then disabled() end
  if raw then
    return nil, "raw request socket not supported by Pier"
  end
  if not has_body() then return nil, "no body" end
  native.read_body()
  return setmetatable({ buf = native.body_data() or "", pos = 1 }, ReqSock)
end

-- === ngx.var ===

local pvar = pier.var

-- A cookie's value from the Cookie header (first match), as $cookie_NAME.
local function cookie_value(name)
  local h = preq.get_header("cookie")
  if not h then return nil end
  local pos, n = 1, #name
  while true do
    local s, e = str_find(h, name, pos, true)
    if not s then return nil end
    local before = s == 1 and 32 or str_byte(h, s - 1)
    if (before == 32 or before == 59 or before == 9 or before == 44) and str_byte(h, e + 1) == 61 then
      local stop = str_find(h, ";", e + 2, true)
      return str_sub(h, e + 2, (stop or #h + 1) - 1)
    end
    pos = e + 1
  end
end

-- A query argument's raw (still escaped) value, as $arg_NAME
-- (case-insensitive name).
local function arg_value(name)
  local args = pvar.args
  if not args or #args == 0 then return nil end
  name = str_lower(name)
  local n = #name
  local pos = 1
  while pos <= #args do
    local stop = str_find(args, "&", pos, true) or #args + 1
    local piece = str_sub(args, pos, stop - 1)
    local eq = str_find(piece, "=", 1, true)
    local k = eq and str_sub(piece, 1, eq - 1) or piece
    if #k == n and str_lower(k) == name then
      return eq and str_sub(piece, eq + 1) or ""
    end
    pos = stop + 1
  end
  return nil
end

local function binary_addr(ip)
  if not ip then return nil end
  local a, b, c, d = ip:match("^(%d+)%.(%d+)%.(%d+)%.(%d+)$")
  if a then return string.char(tonumber(a), tonumber(b), tonumber(c), tonumber(d)) end
  -- IPv6: expand "::" and pack the eight groups.
  local head, tail = ip:match("^([^:]*.-)::(.*)$")
  local groups = {}
  local function add(part)
    for g in part:gmatch("[^:]+") do groups[#groups + 1] = tonumber(g, 16) or 0 end
  end
  if head then
    add(head)
    local rest = {}
    for g in tail:gmatch("[^:]+") do rest[#rest + 1] = tonumber(g, 16) or 0 end
    for _ = 1, 8 - #groups - #rest do groups[#groups + 1] = 0 end
    for i = 1, #rest do groups[#groups + 1] = rest[i] end
  else
    add(ip)
  end
  local out = {}
  for i = 1, 8 do
    local g = groups[i] or 0
    out[i] = string.char(floor(g / 256) % 256, g % 256)
  end
  return concat(out)
end

local hostname
local computed = {
  request_time = function()
    local t = C_wall_now() - api.now()
    if t < 0 then t = 0 end
    return string.format("%.3f", t)
  end,
  msec = function() return string.format("%.3f", C_wall_now()) end,
  binary_remote_addr = function() return binary_addr(pvar.remote_addr) end,
  time_local = function() return os_date("%d/%b/%Y:%H:%M:%S %z", floor(C_wall_now())) end,
  time_iso8601 = function() return os_date("%Y-%m-%dT%H:%M:%S+00:00", floor(C_wall_now())) end,
  pid = function() return tostring(native.pid) end,
  hostname = function()
    if not hostname then
      local f = io.open("/proc/sys/kernel/hostname")
      hostname = f and f:read("*l") or "localhost"
      if f then f:close() end
    end
    return hostname
  end,
  content_type = function() return preq.get_header("content-type") end,
  content_length = function() return preq.get_header("content-length") end,
  http_cookie = function() return preq.get_header("cookie") end,
  server_name = function() return pvar.host end,
  request = function()
    local u = pvar.request_uri
    return preq.get_method() .. " " .. (u or "/") .. " HTTP/1.1"
  end,
  document_uri = function() return pvar.uri end,
}

-- Variables set by hooks (`ngx.var.NAME = value`) live in the request's
-- ctx under a private key: nginx needs `set $NAME` for them, Pier takes any
-- name that is not built in.
local VARS = {}

local builtin = {
  remote_addr = true, remote_port = true, host = true, request_uri = true, uri = true,
  args = true, query_string = true, is_args = true, scheme = true, request_method = true,
  server_port = true, status = true, https = true,
  realip_remote_addr = true, realip_remote_port = true, trace_id = true, span_id = true,
  trace_flags = true,
}
for k in pairs(computed) do builtin[k] = true end

ngx.var = setmetatable({}, {
  __index = function(_, name)
    if type(name) ~= "string" then
      if type(name) == "number" then return nil end
      error("bad variable name", 2)
    end
    if C_phase_allowed(M_REQ_READ) == 0 then disabled() end
    local f = computed[name]
    if f then return f() end
    local b = str_byte(name, 1)
    if b == 99 and str_sub(name, 1, 7) == "cookie_" then return cookie_value(str_sub(name, 8)) end
    if b == 97 and str_sub(name, 1, 4) == "arg_" then return arg_value(str_sub(name, 5)) end
    local v = pvar[name]
    if v ~= nil then return v end
    local ctx = pier.ctx
    local vars = rawget(ctx, VARS)
    return vars and vars[name]
  end,
  __newindex = function(_, name, value)
    if type(name) ~= "string" then error("bad variable name", 2) end
    if C_phase_allowed(M_REQ_READ) == 0 then disabled() end
    if builtin[name] or str_sub(name, 1, 5) == "http_" or str_sub(name, 1, 4) == "arg_"
      or str_sub(name, 1, 7) == "cookie_" or str_sub(name, 1, 4) == "ssl_" then
      error('variable "' .. name .. '" not changeable', 2)
    end
    if value ~= nil and type(value) ~= "string" then
      if type(value) == "number" then value = tostring(value)
      else error("bad variable value", 2) end
    end
    local ctx = pier.ctx
    local vars = rawget(ctx, VARS)
    if not vars then vars = {}; rawset(ctx, VARS, vars) end
    vars[name] = value
  end,
})

-- === ngx.header, ngx.status, ngx.ctx ===

-- Header names as ngx.header takes them: "_" means "-" (content_type).
local function header_name(k)
  if type(k) ~= "string" then k = tostring(k) end
  if str_find(k, "_", 1, true) then k = str_gsub(k, "_", "-") end
  return k
end

ngx.header = setmetatable({}, {
  __index = function(_, k)
    if C_phase_allowed(M_RESP_READ) == 0 then disabled() end
    k = header_name(k)
    local all = presp.get_headers()
    local v = all[str_lower(k)]
    return v
  end,
  __newindex = function(_, k, v)
    if C_phase_allowed(M_RESP_WRITE) == 0 then disabled() end
    k = header_name(k)
    if type(v) == "table" and #v == 0 then v = nil end
    presp.set_header(k, v)
  end,
})

ngx.resp = { get_headers = function(max, _raw)
  if C_phase_allowed(M_RESP_READ) == 0 then disabled() end
  return truncate_args(presp.get_headers(), max)
end }

ngx.arg = pier.arg

-- ngx.ctx, ngx.status, ngx.headers_sent and ngx.is_subrequest are fields
-- computed on each access, as in lua-nginx-module.
setmetatable(ngx, {
  __index = function(_, k)
    if k == "ctx" then
      if C_phase_allowed(M_CTX) == 0 then disabled() end
      return pier.ctx
    elseif k == "status" then
      if C_phase_allowed(M_RESP_READ) == 0 then disabled() end
      local s = api.resp_status()
      if s < 0 then fail(s, "ngx.status") end
      return s
    elseif k == "headers_sent" then
      return C_phase() >= 6 and C_phase() <= 8
    elseif k == "is_subrequest" then
      return false
    end
    return nil
  end,
  __newindex = function(t, k, v)
    if k == "ctx" then
      if C_phase_allowed(M_CTX) == 0 then disabled() end
      if type(v) ~= "table" then error("ctx should be a table while getting a " .. type(v), 2) end
      pier.ctx = v
    elseif k == "status" then
      if C_phase_allowed(M_RESP_WRITE) == 0 then disabled() end
      local s = tonumber(v)
      if not s then error("bad status value", 2) end
      local rc = api.resp_set_status(s)
      if rc < 0 then fail(rc, "ngx.status") end
    else
      rawset(t, k, v)
    end
  end,
})

-- === timers, shared dicts, config, worker ===

ngx.timer = {
  at = function(delay, fn, ...)
    if C_phase_allowed(M_TIMER) == 0 then disabled() end
    if type(fn) ~= "function" then error("bad argument #2 to 'at' (function expected, got " .. type(fn) .. ")", 2) end
    delay = tonumber(delay)
    if not delay or delay < 0 then error("bad argument #1 to 'at' (invalid delay)", 2) end
    return native.timer_at(delay, fn, ...)
  end,
  every = function(delay, fn, ...)
    if C_phase_allowed(M_TIMER) == 0 then disabled() end
    if type(fn) ~= "function" then error("bad argument #2 to 'every' (function expected, got " .. type(fn) .. ")", 2) end
    delay = tonumber(delay)
    if not delay or delay <= 0 then error("bad argument #1 to 'every' (invalid delay)", 2) end
    return native.timer_every(delay, fn, ...)
  end,
  running_count = function() return native.timer_running() end,
  pending_count = function() return native.timer_pending() end,
}

ngx.shared = pier.shared

ngx.config = {
  subsystem = "http",
  -- The lua-nginx-module release whose API this layer follows.
  ngx_lua_version = 10023,
  nginx_version = 1021004,
  debug = false,
  prefix = function() return "" end,
  nginx_configure = function() return "" end,
}

ngx.worker = {
  id = function() return napi.worker_id() end,
  count = function() return napi.worker_count() end,
  pid = function() return native.pid end,
  exiting = function() return false end,
}

-- `require "ngx.balancer"` (lua-resty-core) over pier.balancer.
package.preload["ngx.balancer"] = function()
  local pb = pier.balancer
  return {
    set_current_peer = function(addr, port)
      if port == nil then
        local host, p = tostring(addr):match("^(.*):(%d+)$")
        if not host then error("bad argument #1 to 'set_current_peer' (no port given)", 2) end
        addr, port = host:gsub("^%[(.*)%]$", "%1"), p
      end
      pb.set_peer(addr, port)
      return true
    end,
    set_more_tries = function(n)
      pb.set_retries(n)
      return true
    end,
    -- The balancer hook runs again after a failed attempt (as OpenResty's
    -- balancer_by_lua* does): "failed" or "next", and the status.
    get_last_failure = function() return pb.get_last_failure() end,
    set_timeouts = function()
      return nil, "not supported by Pier: set [upstream] timeouts in the config"
    end,
  }
end

-- === modules provided by pier.ngx_* ===

-- Strings (ngx.re, escaping, digests): merged as they are. Loading it
-- also puts libcrypto's symbols in the global namespace for lua-resty-string.
for k, v in pairs(require "pier.ngx_str") do ngx[k] = v end

-- Cosockets and light threads: their constructors checked the ngx way.
local function yielding(f)
  return function(...)
    if C_phase_allowed(M_YIELD) == 0 then disabled() end
    return f(...)
  end
end

do
  local ok, m = pcall(require, "pier.ngx_socket")
  if ok and type(m) == "table" then
    ngx.socket = {}
    for k, v in pairs(m) do ngx.socket[k] = yielding(v) end
  else
    local new = require "pier.socket"
    ngx.socket = { tcp = yielding(function() return new() end) }
  end
  ok, m = pcall(require, "pier.ngx_thread")
  if ok and type(m) == "table" then
    ngx.thread = {}
    for k, v in pairs(m) do ngx.thread[k] = yielding(v) end
  end
end

return ngx
