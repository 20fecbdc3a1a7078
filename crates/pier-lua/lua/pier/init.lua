-- The global `pier` table.
local ffi = require "ffi"
local base = require "pier.base"

local api, native, masks, fail, check = base.api, base.native, base.masks, base.fail, base.check
local ptr, len, int = base.ptr, base.len, base.int
local ffi_string, type, tostring, tonumber, select, concat =
  ffi.string, type, tostring, tonumber, select, table.concat
local co_yield, getinfo = coroutine.yield, debug.getinfo

local pier = {
  req = require "pier.req",
  resp = require "pier.resp",
  var = require "pier.var",
  shared = require "pier.shared",
  -- pier.exit(pier.OK) ends the hook and goes on; log levels as nginx's.
  OK = 0, ERROR = -1,
  HTTP_OK = 200, HTTP_MOVED_PERMANENTLY = 301, HTTP_MOVED_TEMPORARILY = 302,
  HTTP_BAD_REQUEST = 400, HTTP_UNAUTHORIZED = 401, HTTP_FORBIDDEN = 403,
  HTTP_NOT_FOUND = 404, HTTP_TOO_MANY_REQUESTS = 429,
  HTTP_INTERNAL_SERVER_ERROR = 500, HTTP_BAD_GATEWAY = 502,
  HTTP_SERVICE_UNAVAILABLE = 503,
  STDERR = 2, EMERG = 1, ALERT = 2, CRIT = 3, ERR = 4, WARN = 5, NOTICE = 6, INFO = 7, DEBUG = 8,
}

-- pier.analytics.field(name, value): adds a field to this request's
-- analytics event (sent to Kafka with it; docs/analytics.md). Log phase only;
-- names of letters, digits, '_', '-', '.' (at most 64 bytes), values at most
-- 256 bytes, 16 fields a request.
do
  local C_field = api.analytics_field
  pier.analytics = {
    field = function(name, value)
      if type(name) ~= "string" then
        error("bad argument #1 to pier.analytics.field (string expected)", 2)
      end
      value = tostring(value)
      local rc = C_field(name, #name, value, #value)
      if rc == 0 then return true end
      if rc == -2 then
        error("API pier.analytics.field is disabled in phase " .. base.phase_name() .. " (log phase only)", 2)
      elseif rc == -11 then
        error("pier.analytics.field: a request has at most 16 fields", 2)
      end
      error("bad argument to pier.analytics.field (name: [A-Za-z0-9_.-]{1,64}, value: at most 256 bytes)", 2)
    end,
  }
end

-- pier.trace: this request's span ([tracing]; docs/tracing.md).
-- set_attribute(key, value) on the server span (a key set again is
-- replaced), add_event(name [, attributes]) at the current time; keys of 1
-- to 128 bytes of UTF-8, values strings (at most 1024 bytes), finite
-- numbers or booleans; 32 attributes, 32 events, 16 attributes an event.
-- Kept for a sampled request, accepted and dropped otherwise. ids() gives
-- the trace id and the server span id in hex (nil without [tracing]).
do
  local C_add = api.trace_add
  local function add(fname, op, key, value, level)
    if type(key) ~= "string" then
      error("bad argument #1 to pier.trace." .. fname .. " (string expected)", level)
    end
    local vt, s, n, num = 0, nil, 0, 0
    local t = type(value)
    if op == 1 then
      -- an event: its name only
    elseif t == "string" then
      s, n = value, #value
    elseif t == "number" then
      vt, num = 1, value
    elseif t == "boolean" then
      vt, num = 2, value and 1 or 0
    else
      error("bad argument #2 to pier.trace." .. fname .. " (string, number or boolean expected, got " .. t .. ")", level)
    end
    local rc = C_add(op, key, #key, vt, s, n, num)
    if rc == 0 then return true end
    if rc == -2 then
      error("API pier.trace." .. fname .. " is disabled in phase " .. base.phase_name(), level)
    elseif rc == -11 then
      error("pier.trace." .. fname .. ": too many (32 attributes, 32 events, 16 attributes an event)", level)
    end
    error("bad argument to pier.trace." .. fname .. " (key: 1 to 128 bytes of UTF-8; value: at most 1024 bytes, a finite number or a boolean)", level)
  end
  pier.trace = {
    set_attribute = function(key, value)
      return add("set_attribute", 0, key, value, 3)
    end,
    add_event = function(name, attributes)
      add("add_event", 1, name, nil, 3)
      if attributes ~= nil then
        if type(attributes) ~= "table" then
          error("bad argument #2 to pier.trace.add_event (table expected)", 2)
        end
        for k, v in pairs(attributes) do
          add("add_event", 2, tostring(k), v, 3)
        end
      end
      return true
    end,
    ids = function()
      local var = pier.var
      return var.trace_id, var.span_id
    end,
  }
end

-- pier.cache: this request's cache controls (docs/cache.md). In access:
-- bypass(), set_key(key), set_ttl(secs); in header_filter: set_cacheable(bool),
-- set_ttl(secs). A TTL is a number of seconds from 0 to a year (0: don't store).
do
  local C_set = api.cache_set
  local function done(name, rc, phases)
    if rc == 0 then return true end
    if rc == -2 then
      error("API pier.cache." .. name .. " is disabled in phase " .. base.phase_name() .. " (" .. phases .. ")", 3)
    elseif rc == -9 then
      error("bad argument #1 to pier.cache." .. name .. " (seconds from 0 to one year expected)", 3)
    end
    error("bad argument #1 to pier.cache." .. name .. " (1 to 4096 bytes without CR, LF or NUL expected)", 3)
  end
  pier.cache = {
    bypass = function()
      return done("bypass", C_set(0, nil, 0, 0), "access")
    end,
    set_key = function(key)
      if type(key) ~= "string" then
        error("bad argument #1 to pier.cache.set_key (string expected)", 2)
      end
      return done("set_key", C_set(1, key, #key, 0), "access")
    end,
    set_ttl = function(secs)
      local n = tonumber(secs)
      if type(secs) ~= "number" or n == nil then
        error("bad argument #1 to pier.cache.set_ttl (number expected)", 2)
      end
      return done("set_ttl", C_set(2, nil, 0, n), "access, header_filter")
    end,
    set_cacheable = function(on)
      if type(on) ~= "boolean" then
        error("bad argument #1 to pier.cache.set_cacheable (boolean expected)", 2)
      end
      return done("set_cacheable", C_set(3, nil, 0, on and 1 or 0), "header_filter")
    end,
  }
  -- pier.cache.purge(kind, value[, zone]): as the admin API's purge (kind
  -- "url", "prefix", "tag", "key" or "ban"), applied here and, with
  -- [redis], queued for every node of the fleet. Returns the objects
  -- removed here, or nil and the reason. Any phase, timers too.
  local C_purge = api.cache_purge
  local kinds = { url = 0, prefix = 1, tag = 2, key = 3, ban = 4 }
  pier.cache.purge = function(kind, value, zone)
    local k = kinds[kind]
    if k == nil then
      error("bad argument #1 to pier.cache.purge (\"url\", \"prefix\", \"tag\", \"key\" or \"ban\" expected)", 2)
    end
    if type(value) ~= "string" then
      error("bad argument #2 to pier.cache.purge (string expected)", 2)
    end
    if zone ~= nil and type(zone) ~= "string" then
      error("bad argument #3 to pier.cache.purge (string expected)", 2)
    end
    zone = zone or ""
    local n = C_purge(k, value, #value, zone, #zone, ptr, len)
    if n < 0 then
      return nil, ffi_string(ptr[0], len[0])
    end
    return n
  end
end

-- pier.limit: sliding per-second counters on a count-min sketch shared by
-- every worker (the same estimator as [[limit]] rules; fixed memory).
do
  local C_incr, C_rate = api.limit_incr, api.limit_rate
  pier.limit = {
    -- Count n (default 1) events for key; returns the key's count in the
    -- current one-second window (an estimate that never undercounts).
    incr = function(key, n)
      key = tostring(key)
      local r = C_incr(key, #key, tonumber(n or 1) or -1)
      if r < 0 then error("bad argument #2 to pier.limit.incr (a whole number from 0 to 1e9 expected)", 2) end
      return r
    end,
    -- Events per second for key, sliding over the last two windows.
    rate = function(key)
      key = tostring(key)
      return C_rate(key, #key)
    end,
  }
end

function pier.get_phase()
  return base.phase_name()
end

-- Seconds since the epoch (ms precision) from the request's clock snapshot.
local C_now, C_ctx_ref = api.now, api.ctx_ref

function pier.now()
  return C_now()
end

-- pier.exit(status[, body]): respond now (status >= 100) or, with 0, end
-- the hook and go on. Never returns: the hook's coroutine is abandoned.
function pier.exit(status, body)
  local s = tonumber(status)
  if not s then error("bad argument #1 to pier.exit (number expected)", 2) end
  local rc
  if body ~= nil then
    body = base.tostr(body)
    rc = api.exit(s, body, #body, 1)
  else
    rc = api.exit(s, nil, 0, 0)
  end
  if rc < 0 then fail(rc, "pier.exit") end
  co_yield()
end

function pier.redirect(uri, status)
  if type(uri) ~= "string" then error("bad argument #1 to pier.redirect (string expected)", 2) end
  local rc = api.redirect(uri, #uri, tonumber(status) or 302)
  if rc < 0 then fail(rc, "pier.redirect") end
  co_yield()
end

local function flatten(out, n, v)
  local t = type(v)
  if t == "table" then
    for i = 1, #v do n = flatten(out, n, v[i]) end
    return n
  end
  n = n + 1
  out[n] = t == "string" and v or tostring(v)
  return n
end

local function emit(what, nl, ...)
  local out, n = {}, 0
  for i = 1, select("#", ...) do n = flatten(out, n, (select(i, ...))) end
  if nl then n = n + 1; out[n] = "\n" end
  local s = concat(out)
  return api.say(s, #s)
end

-- Buffers body output; the response is sent when the hook ends.
function pier.say(...)
  local rc = emit("pier.say", true, ...)
  if rc < 0 then fail(rc, "pier.say") end
end

function pier.print(...)
  local rc = emit("pier.print", false, ...)
  if rc < 0 then fail(rc, "pier.print") end
end

function pier.log(level, ...)
  local parts = {}
  for i = 1, select("#", ...) do parts[i] = tostring((select(i, ...))) end
  local msg = concat(parts)
  local info = getinfo(2, "Sl")
  if info then msg = info.short_src .. ":" .. info.currentline .. ": " .. msg end
  api.log(tonumber(level) or 4, msg, #msg)
end

function pier.sleep(seconds)
  check(masks.yield, "pier.sleep")
  return native.sleep(tonumber(seconds) or -1)
end

pier.timer = {
  -- pier.timer.at(delay, fn, ...): fn(premature, ...) in its own coroutine.
  at = function(delay, fn, ...)
    check(masks.timer, "pier.timer.at")
    if type(fn) ~= "function" then error("bad argument #2 to pier.timer.at (function expected)", 2) end
    return native.timer_at(tonumber(delay) or -1, fn, ...)
  end,
  every = function(interval, fn, ...)
    check(masks.timer, "pier.timer.every")
    if type(fn) ~= "function" then error("bad argument #2 to pier.timer.every (function expected)", 2) end
    return native.timer_every(tonumber(interval) or -1, fn, ...)
  end,
  running_count = function() return native.timer_count() end,
}

local socket_new = require("pier.socket")
pier.socket = {
  -- A cosocket: connect/send/receive/receiveuntil/settimeout/setkeepalive/close.
  tcp = function()
    check(masks.yield, "pier.socket.tcp")
    return socket_new()
  end,
}

pier.http = {
  -- pier.http.request{method=, url="http://...", headers=, body=, timeout=ms}
  -- -> {status=, headers=, body=} or nil, err
  request = function(opts)
    check(masks.yield, "pier.http.request")
    if type(opts) ~= "table" then error("bad argument #1 to pier.http.request (table expected)", 2) end
    return native.http_request(opts)
  end,
}

pier.balancer = {
  set_peer = function(ip, port)
    ip = tostring(ip)
    local rc = api.balancer_set_peer(ip, #ip, tonumber(port) or -1)
    if rc < 0 then fail(rc, "pier.balancer.set_peer") end
  end,
  set_retries = function(n)
    local rc = api.balancer_set_retries(tonumber(n) or -1)
    if rc < 0 then fail(rc, "pier.balancer.set_retries") end
  end,
  -- -> nil on the first attempt; after a failed one (the hook runs again)
  -- "failed" (connect) or "next" (the origin failed the request), status.
  get_last_failure = function()
    local rc = api.balancer_last_failure(int)
    if rc < 0 then fail(rc, "pier.balancer.get_last_failure") end
    if rc == 0 then return nil end
    return rc == 1 and "failed" or "next", int[0]
  end,
}

-- body_filter: pier.arg[1] is the chunk (assign to replace), pier.arg[2] eof.
pier.arg = setmetatable({}, {
  __index = function(_, i)
    local rc = api.body_chunk(ptr, len, int)
    if rc < 0 then fail(rc, "pier.arg") end
    if i == 1 then return ffi_string(ptr[0], len[0]) end
    if i == 2 then return int[0] ~= 0 end
    return nil
  end,
  __newindex = function(_, i, v)
    if i ~= 1 then error("only pier.arg[1] can be assigned", 2) end
    if v == nil then v = "" end
    v = base.tostr(v)
    local rc = api.body_set_chunk(v, #v)
    if rc < 0 then fail(rc, "pier.arg") end
  end,
})

-- pier.ctx: a table per request, created on first use. Lua keeps the tables
-- in `ctxs`; Rust keeps each request's slot number (released with it).
local ctxs = {}
setmetatable(pier, {
  __index = function(_, k)
    if k ~= "ctx" then return nil end
    local ref = C_ctx_ref()
    if ref > 0 then return ctxs[ref] end
    if ref == -1 then ref = api.ctx_new_ref() end
    if ref < 0 then fail(ref, "pier.ctx") end
    local t = {}
    ctxs[ref] = t
    return t
  end,
  __newindex = function(t, k, v)
    if k ~= "ctx" then return rawset(t, k, v) end
    if type(v) ~= "table" then error("pier.ctx must be a table", 2) end
    local ref = api.ctx_ref()
    if ref == -1 then ref = api.ctx_new_ref() end
    if ref < 0 then fail(ref, "pier.ctx") end
    ctxs[ref] = v
  end,
})

return pier
