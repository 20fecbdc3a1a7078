-- TCP cosocket objects (pier.socket.tcp() and ngx.socket.tcp()), with
-- ngx_lua's methods, arguments and results. An object is a plain table
-- holding the handle (slot index and generation) of a Rust-side socket;
-- methods check their arguments here and call the (yielding) natives. An
-- ffi.gc anchor frees the Rust slot when the object is collected; the
-- request's end frees it too (a stale handle then fails).
local ffi = require "ffi"
local base = require "pier.base"

local type, tonumber, tostring, error, setmetatable = type, tonumber, tostring, error, setmetatable
local native = base.native
local n_new, n_free = native.tcp_new, native.tcp_free
local n_connect, n_send, n_receive, n_any, n_until = native.tcp_connect, native.tcp_send, native.tcp_receive,
  native.tcp_receiveany, native.tcp_receiveuntil
local n_settimeouts, n_keepalive, n_close, n_reused = native.tcp_settimeouts, native.tcp_setkeepalive,
  native.tcp_close, native.tcp_reused
local n_ssl, n_setoption, n_getoption = native.tcp_sslhandshake, native.tcp_setoption, native.tcp_getoption

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
  return n_connect(self.id, host, p, pool, pool_size, backlog)
end

-- sslhandshake(reused_session, server_name, ssl_verify, send_status_req):
-- the session (an opaque value; rustls caches sessions by server name) or
-- true when reused_session is false.
local SESSION = setmetatable({}, { __tostring = function() return "ssl session" end })
function Sock.sslhandshake(self, reused_session, server_name, ssl_verify, send_status_req)
  if server_name ~= nil and type(server_name) ~= "string" then
    error("bad server_name arg: string expected, got " .. type(server_name), 2)
  end
  local ok, err = n_ssl(self.id, server_name, ssl_verify and true or false)
  if not ok then return nil, err end
  if reused_session == false then return true end
  return SESSION
end

-- data: a string, number, boolean, nil, or (nested) array of them -> bytes sent
function Sock.send(self, data) return n_send(self.id, data) end

-- pattern: "*l" (default: a line, CR/LF dropped), "*a" (until closed), or a byte count
function Sock.receive(self, pattern)
  if type(pattern) == "string" and pattern ~= "*l" and pattern ~= "*a" then
    local n = tonumber(pattern)
    if not n then argerr(1, "receive", "bad pattern argument: " .. pattern) end
    pattern = n
  end
  return n_receive(self.id, pattern)
end

-- At most max bytes, whatever arrives first.
function Sock.receiveany(self, max)
  local n = tonumber(max)
  if not n or not (n >= 1) then argerr(1, "receiveany", "bad max argument") end
  return n_any(self.id, n)
end

-- An iterator reading up to (and consuming) `pattern`; opts.inclusive
-- keeps the pattern in the data; iterator(size) returns at most size
-- bytes per call, then nil once the pattern is reached.
function Sock.receiveuntil(self, pattern, opts)
  local tp = type(pattern)
  if tp == "number" then pattern = tostring(pattern)
  elseif tp ~= "string" then argerr(1, "receiveuntil", "string expected, got " .. tp) end
  local inclusive = false
  if opts ~= nil then
    if type(opts) ~= "table" then argerr(2, "receiveuntil", "table expected, got " .. type(opts)) end
    local v = opts.inclusive
    if v ~= nil then
      if type(v) ~= "boolean" then error('bad "inclusive" option value type: ' .. type(v), 2) end
      inclusive = v
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
    local data, err, partial, fin = n_until(self.id, pattern, inclusive, n)
    if fin and n > 0 then done = true end
    return data, err, partial
  end
end

-- ms; 0 or nil: the default (60 s)
function Sock.settimeout(self, ms)
  local t = tonumber(ms) or 0
  n_settimeouts(self.id, t, t, t)
end

function Sock.settimeouts(self, connect, send, read)
  n_settimeouts(self.id, tonumber(connect) or 0, tonumber(send) or 0, tonumber(read) or 0)
end

-- idle_ms: nil = 60 s, 0 = no timeout; pool_size: nil = 30 (used when the
-- pool is created)
function Sock.setkeepalive(self, idle_ms, pool_size)
  if idle_ms ~= nil then
    local n = tonumber(idle_ms)
    if not n then argerr(1, "setkeepalive", "number expected, got " .. type(idle_ms)) end
    idle_ms = n
  end
  if pool_size ~= nil then
    local n = tonumber(pool_size)
    if not n then argerr(2, "setkeepalive", "number expected, got " .. type(pool_size)) end
    pool_size = n
  end
  return n_keepalive(self.id, idle_ms, pool_size)
end

function Sock.getreusedtimes(self) return n_reused(self.id) end
function Sock.close(self) return n_close(self.id) end

local OPTIONS = { keepalive = 1, reuseaddr = 2, ["tcp-nodelay"] = 3, sndbuf = 4, rcvbuf = 5 }

function Sock.setoption(self, option, value)
  if option == nil then return nil, 'missing the "option" argument' end
  if value == nil then return nil, 'missing the "value" argument' end
  local o = OPTIONS[option]
  if not o then return nil, "unsupported option " .. tostring(option) end
  if value == true then value = 1 elseif value == false then value = 0 end
  local v = tonumber(value)
  if not v then argerr(2, "setoption", "number expected, got " .. type(value)) end
  return n_setoption(self.id, o, v)
end

function Sock.getoption(self, option)
  if option == nil then return nil, 'missing the "option" argument' end
  local o = OPTIONS[option]
  if not o then return nil, "unsupported option " .. tostring(option) end
  return n_getoption(self.id, o)
end

return function()
  local id = n_new()
  local anchor = ffi.gc(ffi.new("char[1]"), function() n_free(id) end)
  return setmetatable({ id = id, anchor = anchor }, Sock)
end
