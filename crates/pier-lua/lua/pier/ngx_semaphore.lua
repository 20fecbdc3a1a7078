-- ngx.semaphore (lua-resty-core's API) over the semaphore natives
-- (src/io/sema.rs): per worker thread, as OpenResty's are per worker.
local base = require "pier.base"

local native, api, masks = base.native, base.api, base.masks
local C_new, C_post, C_count, C_wait =
  native.sema_new, native.sema_post, native.sema_count, native.sema_wait
local type, tonumber, error, setmetatable = type, tonumber, error, setmetatable
local M_YIELD = masks.yield

-- ngx_lua's context names for "API disabled in the context of ..."
-- (indexed by Pier's phase ids, src/phase.rs).
local contexts = { [0] = "init_by_lua*", "init_worker_by_lua*", "access_by_lua*",
  "content_by_lua*", "balancer_by_lua*", "access_by_lua*", "header_filter_by_lua*",
  "body_filter_by_lua*", "log_by_lua*", "ngx.timer" }

local _M = {}
local mt = { __index = _M }

local function check(self)
  if type(self) ~= "table" or type(self.sem) ~= "userdata" then
    error("not a semaphore instance", 3)
  end
end

function _M.new(n)
  n = tonumber(n) or 0
  if n < 0 then error("no negative number", 2) end
  return setmetatable({ sem = C_new(n) }, mt)
end

-- true; or nil, "timeout" at once (nothing free, timeout 0); or, after
-- waiting, false, "timeout" (ngx_lua's values).
function _M.wait(self, seconds)
  check(self)
  local phase = api.phase()
  -- No request in init / init_worker (lua-resty-core's "no request found").
  if phase < 2 then error("no request found", 2) end
  if api.phase_allowed(M_YIELD) == 0 then
    return nil, "API disabled in the context of " .. (contexts[phase] or "(unknown)")
  end
  local secs = tonumber(seconds)
  if not secs then error("bad argument #1 to 'wait' (number expected)", 2) end
  if secs < 0 then error("no negative number", 2) end
  return C_wait(self.sem, secs)
end

function _M.post(self, n)
  check(self)
  local num = n and tonumber(n) or 1
  if num < 1 then error("no negative number", 2) end
  C_post(self.sem, num)
  return true
end

-- resources minus waiters (negative while requests wait)
function _M.count(self)
  check(self)
  return C_count(self.sem)
end

return _M
