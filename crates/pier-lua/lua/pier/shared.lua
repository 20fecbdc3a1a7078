-- pier.shared.NAME: dictionaries shared by all worker threads (the
-- ngx.shared.DICT API over the pier-shdict crate). The name is looked up
-- once; every call then passes the dict's index.
local ffi = require "ffi"
local base = require "pier.base"

local api, ptr, len, num, u32, pairs_out = base.api, base.ptr, base.len, base.num, base.u32, base.pairs
local fail, pairs_table = base.fail, base.pairs_table
local ffi_string, type, tostring, tonumber, setmetatable, rawset, select, error =
  ffi.string, type, tostring, tonumber, setmetatable, rawset, select, error

local E_INVAL, E_NOMEM, E_EXISTS, E_NOTFOUND, E_NAN =
  base.E_INVAL, base.E_NOMEM, base.E_EXISTS, base.E_NOTFOUND, base.E_NAN

local C_get, C_store, C_incr = api.shdict_get, api.shdict_store, api.shdict_incr
local C_push, C_pop, C_llen = api.shdict_push, api.shdict_pop, api.shdict_llen
-- List functions only: the key holds a value that is not a list.
local E_NOT_LIST = -20

local Dict = {}
Dict.__index = Dict

-- The dict's index, or raises as lua-resty-core's check_zone (at the
-- user's line: call it directly from the method the user called).
local function zone(self)
  local idx = type(self) == "table" and self.idx
  if not idx then error('bad "zone" argument', 3) end
  return idx
end

-- key or nil, err: as lua-resty-core (non-strings go through tostring).
local function check_key(key)
  if key == nil then return nil, "nil key" end
  if type(key) ~= "string" then key = tostring(key) end
  local n = #key
  if n == 0 then return nil, "empty key" end
  if n > 65535 then return nil, "key too long" end
  return key
end

local buf, cap = base.buf, base.cap
local slen = ffi.new("int[1]")

-- value, flags (0 when none)
local function value_of(rc)
  local v
  if rc == 4 then
    v = ffi_string(buf, slen[0])
  elseif rc == 3 then
    v = num[0]
  elseif rc == 1 then
    v = num[0] ~= 0
  end
  return v, u32[0]
end

-- value, flags (flags only when non-zero); nil, err for a bad key or a list
function Dict.get(self, key)
  local idx = zone(self)
  local err
  key, err = check_key(key)
  if not key then return nil, err end
  local rc = C_get(idx, key, #key, 0, buf, cap, slen, num, u32)
  if rc == 4 and slen[0] > cap then
    buf, cap = base.grow(slen[0])
    rc = C_get(idx, key, #key, 0, buf, cap, slen, num, u32)
  end
  if rc > 0 then
    if rc == 5 then return nil, "value is a list" end
    local v, f = value_of(rc)
    -- As lua-resty-core: the flags only when non-zero.
    if f ~= 0 then return v, f end
    return v
  end
  if rc < 0 then fail(rc, "pier.shared.get") end
  return nil
end

-- value, flags, stale
function Dict.get_stale(self, key)
  local idx = zone(self)
  local err
  key, err = check_key(key)
  if not key then return nil, err end
  local rc = C_get(idx, key, #key, 1, buf, cap, slen, num, u32)
  if (rc == 4 or rc == 20) and slen[0] > cap then
    buf, cap = base.grow(slen[0])
    rc = C_get(idx, key, #key, 1, buf, cap, slen, num, u32)
  end
  if rc < 0 then fail(rc, "pier.shared.get_stale") end
  if rc == 0 then return nil end
  local stale = rc >= 16
  if stale then rc = rc - 16 end
  if rc == 5 then return nil, "value is a list" end
  local v, f = value_of(rc)
  if f == 0 then f = nil end
  return v, f, stale
end

local errs = {
  [E_NOMEM] = "no memory", [E_EXISTS] = "exists", [E_NOTFOUND] = "not found",
  [E_NAN] = "not a number", [E_INVAL] = "invalid key or argument",
}

-- op: 0 set, 1 safe_set, 2 add, 3 safe_add, 4 replace. `idx` is checked.
-- Always tail-called by the method the user called: error level 2 is the
-- user's line.
local function store(idx, op, key, value, exptime, flags)
  if not exptime then
    exptime = 0
  elseif exptime < 0 then
    error('bad "exptime" argument (invalid duration)', 2)
  end
  local err
  key, err = check_key(key)
  if not key then return nil, err end
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
  local rc = C_store(idx, op, key, #key, vt, vs, vl, vn, exptime, tonumber(flags) or 0)
  if rc >= 0 then return true, nil, rc == 1 end
  local e = errs[rc]
  if e then return false, e, false end
  fail(rc, "pier.shared")
end

-- ok, err, forcible
function Dict.set(self, key, value, exptime, flags)
  return store(zone(self), 0, key, value, exptime, flags)
end
function Dict.safe_set(self, key, value, exptime, flags)
  return store(zone(self), 1, key, value, exptime, flags)
end
function Dict.add(self, key, value, exptime, flags)
  return store(zone(self), 2, key, value, exptime, flags)
end
function Dict.safe_add(self, key, value, exptime, flags)
  return store(zone(self), 3, key, value, exptime, flags)
end
function Dict.replace(self, key, value, exptime, flags)
  return store(zone(self), 4, key, value, exptime, flags)
end
-- As lua-resty-core: `set(key, nil)`, so true, nil, false.
function Dict.delete(self, key)
  return store(zone(self), 0, key, nil)
end

-- newval (and nil, forcible when `init` is given), or nil, err
function Dict.incr(self, key, value, init, init_ttl)
  local idx = zone(self)
  local err
  key, err = check_key(key)
  if not key then return nil, err end
  value = tonumber(value)
  if not value then error("bad argument #2 to incr (number expected)", 2) end
  local has_init = 0
  if init then
    local t = type(init)
    init = tonumber(init)
    if not init then error("bad init arg: number expected, got " .. t, 2) end
    has_init = 1
  else
    init = 0
  end
  if init_ttl ~= nil then
    local t = type(init_ttl)
    init_ttl = tonumber(init_ttl)
    if not init_ttl then error("bad init_ttl arg: number expected, got " .. t, 2) end
    if init_ttl < 0 then error('bad "init_ttl" argument (invalid duration)', 2) end
    if has_init == 0 then error('must provide "init" when providing "init_ttl"', 2) end
  else
    init_ttl = 0
  end
  local rc = C_incr(idx, key, #key, value, init, has_init, init_ttl, num)
  if rc >= 0 then
    if has_init == 0 then return num[0] end
    return num[0], nil, rc == 1
  end
  local e = errs[rc]
  if e then return nil, e end
  fail(rc, "pier.shared.incr")
end

-- seconds left (0: never expires), or nil, "not found"
function Dict.ttl(self, key)
  local idx = zone(self)
  local err
  key, err = check_key(key)
  if not key then return nil, err end
  local rc = api.shdict_ttl(idx, key, #key, num)
  if rc == 1 then return num[0] end
  if rc < 0 then fail(rc, "pier.shared.ttl") end
  return nil, "not found"
end

-- true, or nil, "not found"
function Dict.expire(self, key, exptime)
  local idx = zone(self)
  if not exptime then error('bad "exptime" argument', 2) end
  local err
  key, err = check_key(key)
  if not key then return nil, err end
  local rc = api.shdict_expire(idx, key, #key, tonumber(exptime) or -1)
  if rc == 1 then return true end
  if rc < 0 then fail(rc, "pier.shared.expire") end
  return nil, "not found"
end

function Dict.flush_all(self)
  local rc = api.shdict_flush_all(zone(self))
  if rc < 0 then fail(rc, "pier.shared.flush_all") end
end

-- number of expired entries freed (at most `max`, 0 or none = all)
function Dict.flush_expired(self, max)
  local rc = api.shdict_flush_expired(zone(self), tonumber(max) or 0)
  if rc < 0 then fail(rc, "pier.shared.flush_expired") end
  return rc
end

-- Up to `max` keys (default 1024, 0 = all).
function Dict.get_keys(self, max)
  local n = api.shdict_keys(zone(self), tonumber(max) or 1024, pairs_out)
  if n < 0 then fail(n, "pier.shared.get_keys") end
  return pairs_table(pairs_out[0], n, true)
end

function Dict.capacity(self)
  local rc = api.shdict_capacity(zone(self), num, base.num2)
  if rc < 0 then fail(rc, "pier.shared.capacity") end
  return num[0]
end

function Dict.free_space(self)
  local rc = api.shdict_capacity(zone(self), base.num2, num)
  if rc < 0 then fail(rc, "pier.shared.free_space") end
  return num[0]
end

-- Lists (ngx_lua's C functions check their argument count: so do these).

local function nargs(want, n)
  if n ~= want then
    error("expecting " .. want .. " arguments, but only seen " .. n, 3)
  end
end

-- new length, or nil, err
local function push(front, self, key, value)
  local idx = zone(self)
  local err
  key, err = check_key(key)
  if not key then return nil, err end
  local rc
  local tv = type(value)
  if tv == "string" then
    rc = C_push(idx, front, key, #key, 4, value, #value, 0)
  elseif tv == "number" then
    rc = C_push(idx, front, key, #key, 3, nil, 0, value)
  else
    return nil, "bad value type"
  end
  if rc >= 0 then return rc end
  if rc == E_NOT_LIST then return nil, "value not a list" end
  if rc == E_NOMEM then return nil, "no memory" end
  fail(rc, front == 1 and "pier.shared.lpush" or "pier.shared.rpush")
end

-- the item, nil if the list is missing, or nil, err
local function pop(front, self, key)
  local idx = zone(self)
  local err
  key, err = check_key(key)
  if not key then return nil, err end
  local rc = C_pop(idx, front, key, #key, ptr, len, num)
  if rc == 4 then return ffi_string(ptr[0], len[0]) end
  if rc == 3 then return num[0] end
  if rc == 0 then return nil end
  if rc == E_NOT_LIST then return nil, "value not a list" end
  fail(rc, front == 1 and "pier.shared.lpop" or "pier.shared.rpop")
end

function Dict.lpush(...)
  nargs(3, select("#", ...))
  return push(1, ...)
end

function Dict.rpush(...)
  nargs(3, select("#", ...))
  return push(0, ...)
end

function Dict.lpop(...)
  nargs(2, select("#", ...))
  return pop(1, ...)
end

function Dict.rpop(...)
  nargs(2, select("#", ...))
  return pop(0, ...)
end

-- length (0 if missing), or nil, err
function Dict.llen(...)
  nargs(2, select("#", ...))
  local self, key = ...
  local idx = zone(self)
  local err
  key, err = check_key(key)
  if not key then return nil, err end
  local rc = C_llen(idx, key, #key)
  if rc >= 0 then return rc end
  if rc == E_NOT_LIST then return nil, "value not a list" end
  fail(rc, "pier.shared.llen")
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
