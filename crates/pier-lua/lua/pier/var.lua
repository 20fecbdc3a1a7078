-- pier.var.NAME: nginx-style request variables (read-only).
local ffi = require "ffi"
local base = require "pier.base"

local fail, C_var = base.fail, base.api.var
local ffi_string, type = ffi.string, type
local buf, cap = base.buf, base.cap

return setmetatable({}, {
  __index = function(_, name)
    if type(name) ~= "string" then return nil end
    local n = C_var(name, #name, buf, cap)
    if n >= 0 then
      if n > cap then
        buf, cap = base.grow(n)
        n = C_var(name, #name, buf, cap)
      end
      return ffi_string(buf, n)
    end
    if n ~= -1 then fail(n, "pier.var") end
    return nil
  end,
  __newindex = function(_, name)
    error("pier.var." .. tostring(name) .. " is read-only", 2)
  end,
})
