-- pier.shared.NAME: dictionaries shared by all worker threads (the
-- ngx.shared.DICT API over the pier-shdict crate). The name is looked up
-- once; every call then passes the dict's index.
local ffi = require "ffi"
local base = require "pier.base"

local api, ptr, len, num, u32, pairs_out = base.api, base.ptr, base.len, base.num, base.u32, base.pairs
local fail, pairs_table = base.fail, base.pairs_table
local ffi_string, type, tostring, tonumber, setmetatable, rawset =
  ffi.string, type, tostring, tonumber, setmetatable, rawset

local E_INVAL, E_NOMEM, E_EXISTS, E_NOTFOUND, E_NAN =
  base.E_INVAL, base.E_NOMEM, base.E_EXISTS, base.E_NOTFOUND, base.E_NAN

local C_get, C_store, C_incr = api.shdict_get, api.shdict_store, api.shdict_incr

local Dict = {}
Dict.__index = Dict

local function key_of(key)
  if type(key) == "string" then return key end
  if key == nil then return nil end
  return tostring(key)
end

local buf, cap = base.buf, base.cap
local slen = ffi.new("int[1]")

local function value_of(rc)
  local f = u32[0]
  if f == 0 then f = nil end
  if rc == 4 then return ffi_string(buf, slen[0]), f end
  if rc == 3 then return num[0], f end
  if rc == 1 then return num[0] ~= 0, f end
  return nil
end

-- value, flags (flags only when non-zero)
function Dict.get(self, key)
  key = key_of(key)
  if not key or #key == 0 then return nil, "nil key" end
  local rc = C_get(self.idx, key, #key, 0, buf, cap, slen, num, u32)
  if rc == 4 and slen[0] > cap then
    buf, cap = base.grow(slen[0])
    rc = C_get(self.idx, key, #key, 0, buf, cap, slen, num, u32)
  end
  if rc > 0 then return value_of(rc) end
  if rc < 0 then fail(rc, "pier.shared.get") end
  return nil
end

-- value, flags, stale
function Dict.get_stale(self, key)
  key = key_of(key)
  if not key or #key == 0 then return nil, "nil key" end
  local rc = C_get(self.idx, key, #key, 1, buf, cap, slen, num, u32)
  if (rc == 4 or rc == 20) and slen[0] > cap then
    buf, cap = base.grow(slen[0])
    rc = C_get(self.idx, key, #key, 1, buf, cap, slen, num, u32)
  end
  if rc < 0 then fail(rc, "pier.shared.get_stale") end
  if rc == 0 then return nil end
  local stale = rc >= 16
  if stale then rc = rc - 16 end
  local v, f = value_of(rc)
  return v, f, stale
end

local errs = {
  [E_NOMEM] = "no memory", [E_EXISTS] = "exists", [E_NOTFOUND] = "not found",
  [E_NAN] = "not a number", [E_INVAL] = "invalid key or argument",
}

-- op: 0 set, 1 safe_set, 2 add, 3 safe_add, 4 replace
local function store(self, op, key, value, exptime, flags)
  key = key_of(key)
  if not key then return nil, "nil key" end
  local vt, vs, vl, vn = 0, nil, 0, 0
  local tv = type(value)
  if tv == "string" then
    vt, vs, vl = 4, value, #value
  elseif tv == "number" then
    vt, vn = 3, value
  elseif tv == "boolean" then
    vt, vn = 1, value and 1 or 0
  elseif tv ~= "nil" then
    return nil, "bad value type"
  end
  local rc = C_store(self.idx, op, key, #key, vt, vs, vl, vn, tonumber(exptime) or 0, tonumber(flags) or 0)
  if rc >= 0 then return true, nil, rc == 1 end
  local e = errs[rc]
  if e then return false, e, false end
  fail(rc, "pier.shared")
end

-- ok, err, forcible
function Dict.set(self, key, value, exptime, flags) return store(self, 0, key, value, exptime, flags) end
function Dict.safe_set(self, key, value, exptime, flags) return store(self, 1, key, value, exptime, flags) end
function Dict.add(self, key, value, exptime, flags) return store(self, 2, key, value, exptime, flags) end
function Dict.safe_add(self, key, value, exptime, flags) return store(self, 3, key, value, exptime, flags) end
function Dict.replace(self, key, value, exptime, flags) return store(self, 4, key, value, exptime, flags) end

-- newval, err, forcible
function Dict.incr(self, key, value, init, init_ttl)
  key = key_of(key)
  if not key then return nil, "nil key" end
  value = tonumber(value)
  if not value then error("bad argument #2 to incr (number expected)", 2) end
  local has_init = 0
  if init ~= nil then
    init = tonumber(init)
    if not init then error("bad argument #3 to incr (number expected)", 2) end
    has_init = 1
  else
    init = 0
  end
  local rc = C_incr(self.idx, key, #key, value, init, has_init, tonumber(init_ttl) or 0, num)
  if rc >= 0 then return num[0], nil, rc == 1 end
  local e = errs[rc]
  if e then return nil, e, false end
  fail(rc, "pier.shared.incr")
end

function Dict.delete(self, key)
  key = key_of(key)
  if not key then return nil, "nil key" end
  local rc = api.shdict_delete(self.idx, key, #key)
  if rc < 0 then fail(rc, "pier.shared.delete") end
  return true
end

-- seconds left (0: never expires), or nil, "not found"
function Dict.ttl(self, key)
  key = key_of(key)
  if not key then return nil, "nil key" end
  local rc = api.shdict_ttl(self.idx, key, #key, num)
  if rc == 1 then return num[0] end
  if rc < 0 then fail(rc, "pier.shared.ttl") end
  return nil, "not found"
end

function Dict.expire(self, key, exptime)
  key = key_of(key)
  if not key then return nil, "nil key" end
  local rc = api.shdict_expire(self.idx, key, #key, tonumber(exptime) or -1)
  if rc == 1 then return true end
  if rc < 0 then fail(rc, "pier.shared.expire") end
  return nil, "not found"
end

function Dict.flush_all(self)
  local rc = api.shdict_flush_all(self.idx)
  if rc < 0 then fail(rc, "pier.shared.flush_all") end
end

function Dict.flush_expired(self, max)
  local rc = api.shdict_flush_expired(self.idx, tonumber(max) or 0)
  if rc < 0 then fail(rc, "pier.shared.flush_expired") end
  return rc
end

-- Up to `max` keys (default 1024, 0 = all).
function Dict.get_keys(self, max)
  local n = api.shdict_keys(self.idx, tonumber(max) or 1024, pairs_out)
  if n < 0 then fail(n, "pier.shared.get_keys") end
  return pairs_table(pairs_out[0], n, true)
end

function Dict.capacity(self)
  local rc = api.shdict_capacity(self.idx, num, base.num2)
  if rc < 0 then fail(rc, "pier.shared.capacity") end
  return num[0]
end

function Dict.free_space(self)
  local rc = api.shdict_capacity(self.idx, base.num2, num)
  if rc < 0 then fail(rc, "pier.shared.free_space") end
  return num[0]
end

return setmetatable({}, {
  __index = function(t, name)
    if type(name) ~= "string" then return nil end
    local idx = api.shdict_index(name, #name)
    if idx < 0 then return nil end
    local d = setmetatable({ idx = idx, name = name }, Dict)
    rawset(t, name, d)
    return d
  end,
})
