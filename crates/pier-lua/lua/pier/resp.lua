-- pier.resp: the response status and headers (headers set before the
-- response exists apply to it when it comes).
local ffi = require "ffi"
local base = require "pier.base"

local api, ptr, len, pairs_out = base.api, base.ptr, base.len, base.pairs
local fail, tostr, pairs_table = base.fail, base.tostr, base.pairs_table
local ffi_string, type, tostring, tonumber = ffi.string, type, tostring, tonumber

local resp = {}

function resp.get_status()
  local rc = api.resp_status()
  if rc < 0 then fail(rc, "pier.resp.get_status") end
  return rc
end

function resp.set_status(status)
  local rc = api.resp_set_status(tonumber(status) or -1)
  if rc < 0 then fail(rc, "pier.resp.set_status") end
end

local C_resp_header, C_resp_set_header = api.resp_header, api.resp_set_header
local buf, cap = base.buf, base.cap

function resp.get_header(name)
  if type(name) ~= "string" then name = tostring(name) end
  local n = C_resp_header(name, #name, buf, cap)
  if n >= 0 then
    if n > cap then
      buf, cap = base.grow(n)
      n = C_resp_header(name, #name, buf, cap)
    end
    return ffi_string(buf, n)
  end
  if n ~= -1 then fail(n, "pier.resp.get_header") end
  return nil
end

function resp.get_headers()
  local n = api.resp_headers(pairs_out)
  if n < 0 then fail(n, "pier.resp.get_headers") end
  return pairs_table(pairs_out[0], n)
end

local function set(name, value, mode)
  -- (C_resp_set_header: cached function pointer, see get_header)
  if type(name) ~= "string" then name = tostring(name) end
  if value == nil then
    return C_resp_set_header(name, #name, nil, 0, 2)
  elseif type(value) == "table" then
    local rc = C_resp_set_header(name, #name, nil, 0, 2)
    for i = 1, #value do
      if rc < 0 then return rc end
      local v = tostr(value[i])
      rc = C_resp_set_header(name, #name, v, #v, 1)
    end
    return rc
  end
  value = tostr(value)
  return C_resp_set_header(name, #name, value, #value, mode)
end

function resp.set_header(name, value)
  local rc = set(name, value, 0)
  if rc < 0 then fail(rc, "pier.resp.set_header") end
end

function resp.add_header(name, value)
  local rc = set(name, value, 1)
  if rc < 0 then fail(rc, "pier.resp.add_header") end
end

function resp.clear_header(name)
  local rc = set(name, nil, 2)
  if rc < 0 then fail(rc, "pier.resp.clear_header") end
end

return resp
