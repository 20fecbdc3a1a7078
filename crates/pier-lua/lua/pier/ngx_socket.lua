-- ngx.socket: { tcp, udp, connect, stream } as ngx_lua has them. TCP
-- objects are pier.socket's; UDP objects (connected datagram sockets,
-- UDP or unix) are defined here. Phase checks are the caller's (ngx.lua).
local ffi = require "ffi"
local base = require "pier.base"
local tcp_new = require "pier.socket"

local type, tonumber, tostring, error, select, setmetatable = type, tonumber, tostring, error, select, setmetatable
local native = base.native
local n_new, n_free, n_peer, n_send, n_receive, n_settimeout, n_close = native.udp_new, native.udp_free,
  native.udp_setpeername, native.udp_send, native.udp_receive, native.udp_settimeout, native.udp_close

local function tcp(...)
  local n = select("#", ...)
  if n ~= 0 then error("expecting zero arguments, but got " .. n, 2) end
  return tcp_new()
end

local Udp = {}
Udp.__index = Udp

-- setpeername(host, port) / setpeername("unix:/path")
function Udp.setpeername(self, host, port)
  local th = type(host)
  if th == "number" then host = tostring(host)
  elseif th ~= "string" then error("bad argument #1 to 'setpeername' (string expected, got " .. th .. ")", 2) end
  local p = tonumber(port)
  if p then
    if not (p >= 0 and p <= 65535) then return nil, "bad port number: " .. tostring(port) end
    p = p - p % 1
  elseif host:sub(1, 5):lower() == "unix:" then
    p = -1
  else
    return nil, "missing the port number"
  end
  return n_peer(self.id, host, p)
end

-- data: as tcp send -> 1
function Udp.send(self, data) return n_send(self.id, data) end

-- size: at most 8192 (the default)
function Udp.receive(self, size)
  if size ~= nil then
    local n = tonumber(size)
    if not n or not (n >= 1) then error("bad argument #1 to 'receive' (bad size)", 2) end
    size = n
  end
  return n_receive(self.id, size)
end

function Udp.settimeout(self, ms) n_settimeout(self.id, tonumber(ms) or 0) end
function Udp.close(self) return n_close(self.id) end

local function udp(...)
  local n = select("#", ...)
  if n ~= 0 then error("expecting zero arguments, but got " .. n, 2) end
  local id = n_new()
  local anchor = ffi.gc(ffi.new("char[1]"), function() n_free(id) end)
  return setmetatable({ id = id, anchor = anchor }, Udp)
end

-- tcp() + connect(...): the socket, or nil, err
local function connect(...)
  local sock = tcp_new()
  local ok, err = sock:connect(...)
  if ok then return sock end
  return nil, err
end

return { tcp = tcp, stream = tcp, udp = udp, connect = connect }
