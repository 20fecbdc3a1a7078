-- pier.var.NAME: nginx-style request variables (read-only).
local ffi = require "ffi"
local base = require "pier.base"

local api, ptr, len, fail = base.api, base.ptr, base.len, base.fail
local ffi_string, type = ffi.string, type

return setmetatable({}, {
  __index = function(_, name)
    if type(name) ~= "string" then return nil end
    local rc = api.var(name, #name, ptr, len)
    if rc == 1 then return ffi_string(ptr[0], len[0]) end
    if rc < 0 then fail(rc, "pier.var") end
    return nil
  end,
  __newindex = function(_, name)
    error("pier.var." .. tostring(name) .. " is read-only", 2)
  end,
})
