-- pier.socket.tcp() objects: a plain table holding the handle (slot index
-- and generation) of a Rust-side socket; methods call the (yielding)
-- natives. An ffi.gc anchor frees the Rust slot when the object is
-- collected; the request's end frees it too (a stale handle then fails).
local ffi = require "ffi"
local base = require "pier.base"

local native = base.native
local n_connect, n_send, n_receive, n_until = native.tcp_connect, native.tcp_send, native.tcp_receive,
  native.tcp_receiveuntil
local n_settimeout, n_keepalive, n_close, n_reused, n_free = native.tcp_settimeout, native.tcp_setkeepalive,
  native.tcp_close, native.tcp_reused, native.tcp_free

local Sock = {}
Sock.__index = Sock

function Sock.connect(self, host, port) return n_connect(self.id, host, port) end
function Sock.send(self, data) return n_send(self.id, data) end
-- pattern: "*l" (default, a line without CR/LF), "*a" (until closed), or a byte count
function Sock.receive(self, pattern) return n_receive(self.id, pattern) end
-- Returns an iterator reading up to (and consuming) `pattern`.
function Sock.receiveuntil(self, pattern)
  if type(pattern) ~= "string" or #pattern == 0 then error("bad argument #1 to receiveuntil (string expected)", 2) end
  -- The iterator holds the object (not just its id), so the socket lives
  -- as long as the iterator does.
  return function() return n_until(self.id, pattern) end
end
function Sock.settimeout(self, ms) n_settimeout(self.id, tonumber(ms) or 0) end
function Sock.setkeepalive(self, idle_ms, pool_size) return n_keepalive(self.id, idle_ms, pool_size) end
function Sock.getreusedtimes(self) return n_reused(self.id) end
function Sock.close(self) return n_close(self.id) end

return function()
  local id = native.tcp_new()
  local anchor = ffi.gc(ffi.new("char[1]"), function() n_free(id) end)
  return setmetatable({ id = id, anchor = anchor }, Sock)
end
