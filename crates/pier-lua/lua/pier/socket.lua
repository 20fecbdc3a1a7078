-- TCP cosocket objects (pier.socket.tcp() and ngx.socket.tcp()), with
-- ngx_lua's methods, arguments and results. An object is a plain table
-- holding the handle (slot index and generation) of a Rust-side socket;
-- methods check their arguments here. The request's end frees the Rust
-- slot (a stale handle then fails); past a request's first few sockets, and
-- in timers, an ffi.gc anchor frees it too when the object is collected.
--
-- Every method calls Rust without mlua's machinery (src/io/tcp.rs, one
-- polled implementation): connect, sslhandshake, getreusedtimes, close and
-- options through the FFI (their call sites get compiled); send, receive*,
-- settimeout(s), setkeepalive (called right after the reply's receive) and
-- the anchor's finalizer as classic C functions (their call sites run
-- interpreted, next to the yield, where an FFI call costs far more). A
-- call that would block returns AGAIN, and the wrapper yields mlua's
-- pending marker (through ngx.thread's scheduler, so light threads run
-- meanwhile) until the connection or its deadline wakes the hook, then
-- calls again.
local ffi = require "ffi"
local base = require "pier.base"

local type, tonumber, tostring, error, setmetatable = type, tonumber, tostring, error, setmetatable
local ffi_string, concat = ffi.string, table.concat
local native = base.native
local n_free = native.tcp_free_c
local L_recv, L_send, L_settimeouts = native.tcp_recv_c, native.tcp_send_c, native.tcp_settimeouts_c
local L_keepalive = native.tcp_setkeepalive_c

ffi.cdef [[
typedef struct {
  double (*new)(void);
  int (*recv)(double, int, double, const char *, size_t, int, char *, size_t, int *);
  int (*send)(double, const char *, size_t, int);
  int (*errmsg)(double, char *, size_t);
  int (*setkeepalive)(double, double, double);
  int (*reused)(double);
  int (*connect)(double, const char *, size_t, int, const char *, size_t, int, int, int);
  int (*sslhandshake)(double, const char *, size_t, int, int);
  int (*close)(double);
  int (*setoption)(double, int, double);
  int (*getoption)(double, int);
} pier_sock_api_t;
]]
local S = ffi.cast("const pier_sock_api_t*", native.sock_api_addr)
local C_new, C_errmsg, C_reused, C_connect = S.new, S.errmsg, S.reused, S.connect
local C_ssl, C_close, C_setoption, C_getoption = S.sslhandshake, S.close, S.setoption, S.getoption

-- Waits for the hook's task to be woken (the pending marker, through the
-- light-thread scheduler's yield).
local wait = native.ngx_thread._yield
local PENDING = native.poll_pending

local AGAIN, E_TIMEOUT, E_CLOSED, E_IO, E_BADSOCK, E_BADREQ, E_BUSY, E_TOOLARGE, E_NEED, E_RAISE =
  -11, -20, -21, -22, -23, -24, -25, -26, -27, -28
local E_CONNECTING = -29
local E_PHASE, E_INVAL, E_DURATION = -2, -3, -9
local LINE, ALL, SIZE, ANY, UNTIL, UNTIL_INCL = 0, 1, 2, 3, 4, 5
local APPEND, RETRY, BOUNDED = 1, 2, 4
local NAN = 0 / 0

local ebuf = ffi.new("char[256]")

local contexts = { [0] = "init_by_lua*", "init_worker_by_lua*", "access_by_lua*",
  "content_by_lua*", "balancer_by_lua*", "access_by_lua*", "header_filter_by_lua*",
  "body_filter_by_lua*", "log_by_lua*", "ngx.timer" }

-- Errors that are raised, not returned (as ngx_lua raises them), at the
-- caller's line (level 3: the method's caller).
local function raise(rc, what)
  if rc == E_BADSOCK then error("bad socket (closed: collected, or its request ended)", 3) end
  if rc == E_BADREQ then error("bad request", 3) end
  if rc == E_TOOLARGE then error(what .. ": data over lua.socket_buffer bytes (receive buffer full)", 3) end
  if rc == E_PHASE then
    error("API disabled in the context of " .. (contexts[base.api.phase()] or "(unknown)"), 3)
  end
  if rc == E_DURATION then error("bad argument to " .. what .. ": invalid duration", 3) end
  error(what .. " failed (" .. tostring(rc) .. ")", 3)
end

local function errtext(id, rc)
  if rc == E_TIMEOUT then return "timeout" end
  if rc == E_CLOSED then return "closed" end
  if rc == E_CONNECTING then return "socket busy connecting" end
  if rc == E_IO or rc == E_RAISE then
    local n = C_errmsg(id, ebuf, 256)
    if n >= 0 then return ffi_string(ebuf, n < 256 and n or 256) end
  end
  return nil
end

local Sock = {}
Sock.__index = Sock

local function argerr(n, fname, msg) error("bad argument #" .. n .. " to '" .. fname .. "' (" .. msg .. ")", 3) end

-- connect(host, port[, opts]) / connect("unix:/path"[, opts]); opts: pool,
-- pool_size, backlog (ngx_lua's rules and messages).
function Sock.connect(self, host, port, opts)
  if type(port) == "table" and opts == nil then port, opts = nil, port end
  local th = type(host)
  if th == "number" then host = tostring(host)
  elseif th ~= "string" then argerr(1, "connect", "string expected, got " .. th) end
  local pool, pool_size, backlog = nil, 0, -1
  if opts ~= nil then
    if type(opts) ~= "table" then argerr(3, "connect", "table expected, got " .. type(opts)) end
    local v = opts.pool_size
    if v ~= nil then
      local n = tonumber(v)
      if type(v) ~= "number" and not n then argerr(3, "connect", 'bad "pool_size" option type: ' .. type(v)) end
      if not (n >= 1) then argerr(3, "connect", 'bad "pool_size" option value: ' .. tostring(n)) end
      pool_size = n < 1e9 and n - n % 1 or 1e9
    end
    v = opts.backlog
    if v ~= nil and tonumber(v) then
      local n = tonumber(v)
      if not (n >= 0) then argerr(3, "connect", 'bad "backlog" option value: ' .. tostring(n)) end
      backlog = n < 1e9 and n - n % 1 or 1e9
      -- only a backlog: the default pool size
      if pool_size == 0 then pool_size = 30 end
    end
    v = opts.pool
    local tp = type(v)
    if tp == "number" then pool = tostring(v)
    elseif tp == "string" then pool = v
    elseif tp ~= "nil" then argerr(3, "connect", 'bad "pool" option type: ' .. tp) end
  end
  local p = tonumber(port)
  if p then
    if not (p >= 0 and p <= 65535) then return nil, "bad port number: " .. tostring(port) end
    p = p - p % 1
  elseif host:sub(1, 5):lower() == "unix:" then
    p = -1
  else
    return nil, "missing the port number"
  end
  -- An idle connection of the pool: no yield, nothing allocated. Else a
  -- new one (or a wait in the pool's backlog), waiting like receive does.
  local id, plen = self.id, pool and #pool or 0
  local rc = C_connect(id, host, #host, p, pool, plen, pool_size, backlog, 0)
  while rc == AGAIN do
    wait(PENDING)
    rc = C_connect(id, host, #host, p, pool, plen, pool_size, backlog, 1)
  end
  if rc == 1 then return 1 end
  if rc == E_TIMEOUT or rc == E_CLOSED or rc == E_IO then return nil, errtext(id, rc) end
  if rc == E_BUSY then return nil, "socket busy connecting" end
  if rc == E_RAISE then error(errtext(id, rc), 2) end
  raise(rc, "connect")
end

-- sslhandshake(reused_session, server_name, ssl_verify, send_status_req):
-- the session (an opaque value; rustls caches sessions by server name) or
-- true when reused_session is false.
local SESSION = setmetatable({}, { __tostring = function() return "ssl session" end })
function Sock.sslhandshake(self, reused_session, server_name, ssl_verify, send_status_req)
  if server_name ~= nil and type(server_name) ~= "string" then
    error("bad server_name arg: string expected, got " .. type(server_name), 2)
  end
  local id, nlen, verify = self.id, server_name and #server_name or 0, ssl_verify and 1 or 0
  local rc = C_ssl(id, server_name, nlen, verify, 0)
  while rc == AGAIN do
    wait(PENDING)
    rc = C_ssl(id, server_name, nlen, verify, 1)
  end
  if rc == 1 then
    if reused_session == false then return true end
    return SESSION
  end
  if rc == E_BUSY then return nil, "socket busy" end
  local err = errtext(id, rc)
  if err then return nil, err end
  raise(rc, "sslhandshake")
end

local null = native.null

-- Appends `v` (a string, scalar or nested array of them) to the socket's
-- send buffer, piece by piece (no concatenation in Lua); 0 or an error code.
local function append(id, v, depth)
  local t = type(v)
  if t == "string" then return L_send(id, v, APPEND) end
  if t == "table" then
    if depth >= 100 then error("bad argument #1 to 'send' (tables nested too deeply)", 3) end
    for i = 1, #v do
      local item = v[i]
      if item == nil then error("bad argument #1 to 'send' (non-array table found)", 3) end
      local rc = append(id, item, depth + 1)
      if rc < 0 then return rc end
    end
    return 0
  end
  local s
  if t == "number" or t == "boolean" or t == "nil" then
    s = tostring(v)
  elseif v == null then
    s = "null"
  else
    error("bad argument #1 to 'send' (bad data type " .. t .. " found)", 3)
  end
  return L_send(id, s, APPEND)
end

local function send_result(id, rc)
  while rc == AGAIN do
    wait(PENDING)
    rc = L_send(id, nil, RETRY)
  end
  if rc >= 0 then return rc end
  if rc == E_BUSY then return nil, "socket busy writing" end
  local err = errtext(id, rc)
  if err then return nil, err end
  raise(rc, "send")
end

-- data: a string, number, boolean, nil, or (nested) array of them -> bytes sent
function Sock.send(self, data)
  local id = self.id
  if type(data) == "string" then
    return send_result(id, L_send(id, data, 0))
  end
  local t = type(data)
  if t == "table" then
    -- A flat array of strings and numbers (what lua-resty-redis and most
    -- clients send): one concatenation and one call instead of a call per
    -- piece (this code runs interpreted: a coroutine yield ends traces).
    local flat = true
    for i = 1, #data do
      local tv = type(data[i])
      if tv ~= "string" and tv ~= "number" then flat = false break end
    end
    if flat then
      local s = concat(data)
      return send_result(id, L_send(id, s, BOUNDED))
    end
  elseif t ~= "number" and t ~= "boolean" and data ~= nil and data ~= null then
    error("bad argument #1 to 'send' (string, number, boolean, nil, or array table expected, got "
      .. t .. ")", 2)
  end
  local rc = append(id, data, 0)
  if rc >= 0 then rc = L_send(id, nil, 0) end
  return send_result(id, rc)
end

-- One receive: data, or nil, err, partial. `fin` (receiveuntil) says the
-- data ended at the pattern.
local function recv(id, mode, n, pat)
  local rc, data = L_recv(id, mode, n, pat, false)
  while true do
    if rc >= 0 then
      if rc == 2 then return nil end
      if rc == 1 then return data, nil, nil, true end
      return data
    end
    if rc ~= AGAIN then break end
    wait(PENDING)
    rc, data = L_recv(id, mode, n, pat, true)
  end
  if rc == E_BUSY then return nil, "socket busy reading" end
  local err = errtext(id, rc)
  -- The partial data comes with a timeout, closed or I/O error.
  if err then return nil, err, data end
  raise(rc, "receive")
end

-- pattern: "*l" (default: a line, CR/LF dropped), "*a" (until closed), or a byte count
function Sock.receive(self, pattern)
  if pattern == nil or pattern == "*l" then return recv(self.id, LINE, 0, nil) end
  if pattern == "*a" then return recv(self.id, ALL, 0, nil) end
  local n = tonumber(pattern)
  if not n then argerr(1, "receive", "bad pattern argument: " .. tostring(pattern)) end
  if not (n >= 0) then argerr(1, "receive", "bad pattern argument") end
  return recv(self.id, SIZE, n, nil)
end

-- At most max bytes, whatever arrives first.
function Sock.receiveany(self, max)
  local n = tonumber(max)
  if not n or not (n >= 1) then argerr(1, "receiveany", "bad max argument") end
  return recv(self.id, ANY, n, nil)
end

-- An iterator reading up to (and consuming) `pattern`; opts.inclusive
-- keeps the pattern in the data; iterator(size) returns at most size
-- bytes per call, then nil once the pattern is reached.
function Sock.receiveuntil(self, pattern, opts)
  local tp = type(pattern)
  if tp == "number" then pattern = tostring(pattern)
  elseif tp ~= "string" then argerr(1, "receiveuntil", "string expected, got " .. tp) end
  local mode = UNTIL
  if opts ~= nil then
    if type(opts) ~= "table" then argerr(2, "receiveuntil", "table expected, got " .. type(opts)) end
    local v = opts.inclusive
    if v ~= nil then
      if type(v) ~= "boolean" then error('bad "inclusive" option value type: ' .. type(v), 2) end
      if v then mode = UNTIL_INCL end
    end
  end
  if #pattern == 0 then return nil, "pattern is empty" end
  local done = false
  -- The iterator holds the object (not just its id), so the socket lives
  -- as long as the iterator does.
  return function(size)
    if done then
      done = false
      return nil
    end
    local n = 0
    if size ~= nil then
      n = tonumber(size)
      if not n or not (n >= 0) then error('bad "size" argument', 2) end
    end
    local data, err, partial, fin = recv(self.id, mode, n, pattern)
    if fin and n > 0 then done = true end
    return data, err, partial
  end
end

-- ms; 0 or nil: the default (60 s)
function Sock.settimeout(self, ms)
  local t = tonumber(ms) or 0
  local rc = L_settimeouts(self.id, t, t, t)
  if rc ~= 0 then raise(rc, "settimeout") end
end

function Sock.settimeouts(self, connect, send, read)
  local c, s, r = tonumber(connect) or 0, tonumber(send) or 0, tonumber(read) or 0
  local rc = L_settimeouts(self.id, c, s, r)
  if rc ~= 0 then raise(rc, "settimeouts") end
end

-- idle_ms: nil = 60 s, 0 = no timeout; pool_size: nil = 30 (used when the
-- pool is created)
function Sock.setkeepalive(self, idle_ms, pool_size)
  local idle, size = NAN, NAN
  if idle_ms ~= nil then
    idle = tonumber(idle_ms)
    if not idle then argerr(1, "setkeepalive", "number expected, got " .. type(idle_ms)) end
    -- NaN is "not given" to the C side: refuse it (and the other bad
    -- durations) here, as every duration from Lua is (docs/lua.md).
    if not (idle >= 0 and idle <= 31536000000) then
      error("bad argument #1 to 'setkeepalive' (invalid duration " .. tostring(idle) .. " ms)", 2)
    end
  end
  if pool_size ~= nil then
    size = tonumber(pool_size)
    if not size then argerr(2, "setkeepalive", "number expected, got " .. type(pool_size)) end
    if not (size >= 1 and size <= 1e9) then error('bad "pool_size" option value: ' .. tostring(size), 2) end
  end
  local id = self.id
  local rc = L_keepalive(id, idle, size)
  if rc >= 0 then return 1 end
  if rc == E_BUSY then return nil, "socket busy" end
  local err = errtext(id, rc)
  if err then return nil, err end
  raise(rc, "setkeepalive")
end

function Sock.getreusedtimes(self)
  local id = self.id
  local rc = C_reused(id)
  if rc >= 0 then return rc end
  if rc == E_CLOSED then return nil, "closed" end
  raise(rc, "getreusedtimes")
end

function Sock.close(self)
  local rc = C_close(self.id)
  if rc == 1 then return 1 end
  local err = errtext(self.id, rc)
  if err then return nil, err end
  raise(rc, "close")
end

-- An option call's result: the value, or nil, err.
local function optresult(id, rc, what)
  if rc >= 0 then return rc end
  local err = errtext(id, rc)
  if err then return nil, err end
  raise(rc, what)
end

local OPTIONS = { keepalive = 1, reuseaddr = 2, ["tcp-nodelay"] = 3, sndbuf = 4, rcvbuf = 5 }

function Sock.setoption(self, option, value)
  if option == nil then return nil, 'missing the "option" argument' end
  if value == nil then return nil, 'missing the "value" argument' end
  local o = OPTIONS[option]
  if not o then return nil, "unsupported option " .. tostring(option) end
  if value == true then value = 1 elseif value == false then value = 0 end
  local v = tonumber(value)
  if not v then argerr(2, "setoption", "number expected, got " .. type(value)) end
  local id = self.id
  local ok, err = optresult(id, C_setoption(id, o, v), "setoption")
  if ok then return true end
  return nil, err
end

function Sock.getoption(self, option)
  if option == nil then return nil, 'missing the "option" argument' end
  local o = OPTIONS[option]
  if not o then return nil, "unsupported option " .. tostring(option) end
  local id = self.id
  return optresult(id, C_getoption(id, o), "getoption")
end

-- The anchor holds the handle, so one finalizer serves every socket (no
-- closure per socket).
local function free_anchor(cd) n_free(cd[0]) end

local FULL = { [-1] = "no request",
  [-2] = "too many sockets in this request (lua.max_sockets_per_request)",
  [-3] = "too many sockets in this worker (lua.max_sockets_per_worker)" }

-- Added to the handle C_new returns when the object needs an anchor: a
-- request's first few sockets do not (its end frees them; see
-- UNANCHORED_PER_REQUEST in src/io/table.rs), later ones and timers' do.
local ANCHOR = 2 ^ 52
local double1 = ffi.typeof("double[1]")

return function()
  local id = C_new()
  if id < 0 then
    -- Sockets Lua no longer references may just not be collected yet:
    -- collect (their anchors free them) and try once more.
    if id ~= -1 then
      collectgarbage()
      id = C_new()
    end
    if id < 0 then error(FULL[id] or "internal error in tcp()", 3) end
  end
  if id < ANCHOR then return setmetatable({ id = id }, Sock) end
  id = id - ANCHOR
  return setmetatable({ id = id, anchor = ffi.gc(double1(id), free_anchor) }, Sock)
end
