-- pier.req: the request. FFI calls; strings copied out with ffi.string.
local ffi = require "ffi"
local base = require "pier.base"

local api, ptr, len, pairs_out = base.api, base.ptr, base.len, base.pairs
local fail, tostr, pairs_table = base.fail, base.tostr, base.pairs_table
local ffi_string, type, tostring, pairs, concat = ffi.string, type, tostring, pairs, table.concat
local str_format, str_byte, setmetatable, rawget = string.format, string.byte, setmetatable, rawget

local req = {}
local C_req_set_header = api.req_set_header

local C_method, C_uri, C_path = api.req_method, api.req_uri, api.req_path
local sbuf, scap = base.buf, base.cap

-- Calls a copy-out getter `f(buf, cap)`, growing the buffer if needed.
local function get_string(f, what)
  local n = f(sbuf, scap)
  if n > scap then
    sbuf, scap = base.grow(n)
    n = f(sbuf, scap)
  end
  if n < 0 then fail(n, what) end
  return ffi_string(sbuf, n)
end

function req.get_method()
  local n = C_method(sbuf, scap)
  if n < 0 or n > scap then return get_string(C_method, "pier.req.get_method") end
  return ffi_string(sbuf, n)
end

function req.get_uri()
  local n = C_uri(sbuf, scap)
  if n < 0 or n > scap then return get_string(C_uri, "pier.req.get_uri") end
  return ffi_string(sbuf, n)
end

function req.get_path()
  local n = C_path(sbuf, scap)
  if n < 0 or n > scap then return get_string(C_path, "pier.req.get_path") end
  return ffi_string(sbuf, n)
end

-- Sets the path (starting with "/"), keeping the query, as ngx.req.set_uri.
function req.set_uri(uri)
  if type(uri) ~= "string" then error("bad argument #1 to pier.req.set_uri (string expected)", 2) end
  local rc = api.req_set_path(uri, #uri)
  if rc < 0 then fail(rc, "pier.req.set_uri") end
end

function req.get_uri_args()
  local n = api.req_args(pairs_out)
  if n < 0 then fail(n, "pier.req.get_uri_args") end
  return pairs_table(pairs_out[0], n)
end

local function escape(s)
  return (s:gsub("[^%w%-%._~]", function(c) return str_format("%%%02X", str_byte(c)) end))
end
req.escape_uri = escape

local function encode_args(t)
  local out, n = {}, 0
  for k, v in pairs(t) do
    k = escape(tostring(k))
    if type(v) == "table" then
      for _, x in ipairs(v) do
        n = n + 1
        out[n] = x == true and k or k .. "=" .. escape(tostring(x))
      end
    elseif v == true then
      n = n + 1; out[n] = k
    elseif v ~= false and v ~= nil then
      n = n + 1; out[n] = k .. "=" .. escape(tostring(v))
    end
  end
  return concat(out, "&")
end
req.encode_args = encode_args

-- args: an encoded query string or a table (values: string, number, true, list).
function req.set_uri_args(args)
  if type(args) == "table" then args = encode_args(args) end
  if type(args) ~= "string" then error("bad argument #1 to pier.req.set_uri_args (string or table expected)", 2) end
  local rc = api.req_set_args(args, #args)
  if rc < 0 then fail(rc, "pier.req.set_uri_args") end
end

-- Function pointers cached as upvalues: the interpreter then skips a cdata
-- field lookup (and a cdata allocation) per call.
local C_req_header = api.req_header

local buf, cap = base.buf, base.cap

-- The first value of header `name` (case-insensitive), or nil.
function req.get_header(name)
  if type(name) ~= "string" then name = tostring(name) end
  local n = C_req_header(name, #name, buf, cap)
  if n >= 0 then
    if n > cap then
      buf, cap = base.grow(n)
      n = C_req_header(name, #name, buf, cap)
    end
    return ffi_string(buf, n)
  end
  if n ~= -1 then fail(n, "pier.req.get_header") end
  return nil
end

local headers_mt = { __index = function(t, k)
  if type(k) == "string" then
    local lk = k:lower():gsub("_", "-")
    if lk ~= k then return rawget(t, lk) end
  end
end }

-- All headers: lowercase names; repeated headers as lists; lookups by any
-- case (and "_" for "-") work through the metatable.
function req.get_headers()
  local n = api.req_headers(pairs_out)
  if n < 0 then fail(n, "pier.req.get_headers") end
  return setmetatable(pairs_table(pairs_out[0], n), headers_mt)
end

local function set_header(name, value, what, mode)
  if type(name) ~= "string" then name = tostring(name) end
  local rc
  if value == nil then
    rc = C_req_set_header(name, #name, nil, 0, 2)
  elseif type(value) == "table" then
    rc = C_req_set_header(name, #name, nil, 0, 2)
    for i = 1, #value do
      if rc < 0 then break end
      local v = tostr(value[i])
      rc = C_req_set_header(name, #name, v, #v, 1)
    end
  else
    value = tostr(value)
    rc = C_req_set_header(name, #name, value, #value, mode)
  end
  return rc
end

-- value: string/number (replaces all), a list (one line each), nil (removes).
function req.set_header(name, value)
  local rc = set_header(name, value, "pier.req.set_header", 0)
  if rc < 0 then fail(rc, "pier.req.set_header") end
end

function req.add_header(name, value)
  local rc = set_header(name, value, "pier.req.add_header", 1)
  if rc < 0 then fail(rc, "pier.req.add_header") end
end

function req.clear_header(name)
  local rc = set_header(name, nil, "pier.req.clear_header", 2)
  if rc < 0 then fail(rc, "pier.req.clear_header") end
end

return req
