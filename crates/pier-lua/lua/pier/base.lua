-- Shared plumbing of the pier.* wrappers: the FFI declaration of the Rust
-- API table (src/ffi/mod.rs, same field order), reusable out-parameter
-- buffers, and the error helpers.
local ffi = require "ffi"
local native = require "pier.native"

ffi.cdef [[
typedef struct { const char *k; size_t klen; const char *v; ptrdiff_t vlen; } pier_pair_t;
typedef struct {
  int (*phase)(void);
  int (*phase_allowed)(uint32_t);
  double (*now)(void);
  int (*log)(int, const char *, size_t);
  int (*req_method)(char *, size_t);
  int (*req_uri)(char *, size_t);
  int (*req_path)(char *, size_t);
  int (*req_set_path)(const char *, size_t);
  int (*req_set_args)(const char *, size_t);
  int (*req_args)(const pier_pair_t **);
  int (*req_header)(const char *, size_t, char *, size_t);
  int (*req_headers)(const pier_pair_t **);
  int (*req_set_header)(const char *, size_t, const char *, size_t, int);
  int (*var)(const char *, size_t, char *, size_t);
  int (*resp_status)(void);
  int (*resp_set_status)(int);
  int (*resp_header)(const char *, size_t, char *, size_t);
  int (*resp_headers)(const pier_pair_t **);
  int (*resp_set_header)(const char *, size_t, const char *, size_t, int);
  int (*ctx_ref)(void);
  int (*ctx_new_ref)(void);
  int (*exit)(int, const char *, size_t, int);
  int (*redirect)(const char *, size_t, int);
  int (*say)(const char *, size_t);
  int (*body_chunk)(const char **, size_t *, int *);
  int (*body_set_chunk)(const char *, size_t);
  int (*balancer_set_peer)(const char *, size_t, int);
  int (*balancer_set_retries)(int);
  int (*balancer_last_failure)(int *);
  int (*shdict_index)(const char *, size_t);
  int (*shdict_get)(int, const char *, size_t, int, char *, size_t, int *, double *, uint32_t *);
  int (*shdict_store)(int, int, const char *, size_t, int, const char *, size_t, double, double, uint32_t);
  int (*shdict_incr)(int, const char *, size_t, double, double, int, double, double *);
  int (*shdict_delete)(int, const char *, size_t);
  int (*shdict_ttl)(int, const char *, size_t, double *);
  int (*shdict_expire)(int, const char *, size_t, double);
  int (*shdict_flush_all)(int);
  int (*shdict_flush_expired)(int, int);
  int (*shdict_keys)(int, int, const pier_pair_t **);
  int (*shdict_capacity)(int, double *, double *);
  int (*hook_done)(void);
  double (*limit_incr)(const char *, size_t, double);
  double (*limit_rate)(const char *, size_t);
  int (*shdict_push)(int, int, const char *, size_t, int, const char *, size_t, double);
  int (*shdict_pop)(int, int, const char *, size_t, const char **, size_t *, double *);
  int (*shdict_llen)(int, const char *, size_t);
  int (*analytics_field)(const char *, size_t, const char *, size_t);
  int (*cache_set)(int, const char *, size_t, double);
  int (*trace_add)(int, const char *, size_t, int, const char *, size_t, double);
  double (*cache_purge)(int, const char *, size_t, const char *, size_t, const char **, size_t *);
} pier_api_t;
]]

local M = {
  api = ffi.cast("const pier_api_t*", native.api_addr),
  native = native,
  masks = native.masks,
  -- Out-parameters, reused by every call (one Lua state per thread, and a
  -- wrapper copies the result before any other call can run).
  ptr = ffi.new("const char *[1]"),
  len = ffi.new("size_t[1]"),
  pairs = ffi.new("const pier_pair_t *[1]"),
  num = ffi.new("double[1]"),
  num2 = ffi.new("double[1]"),
  int = ffi.new("int[1]"),
  u32 = ffi.new("uint32_t[1]"),
  E_PHASE = -2, E_INVAL = -3, E_INTERNAL = -4, E_NOMEM = -5,
  E_EXISTS = -6, E_NOTFOUND = -7, E_NAN = -8, E_DURATION = -9, E_TOO_LARGE = -10,
}

-- A reusable copy-out buffer for getters returning `len` (filled when
-- `len <= cap`): grown, never shrunk. `M.buf`/`M.cap` are the current one.
M.cap = 4096
M.buf = ffi.new("char[?]", M.cap)
function M.grow(n)
  local cap = M.cap
  while cap < n do cap = cap * 2 end
  M.cap, M.buf = cap, ffi.new("char[?]", cap)
  return M.buf, cap
end

local phases = { [0] = "init", "init_worker", "access", "content", "balancer",
  "upstream_request", "header_filter", "body_filter", "log", "timer" }

function M.phase_name()
  return phases[M.api.phase()] or "none"
end

local error, tostring = error, tostring

-- Raises the error for status `rc` of API `what`, pointing at the user's
-- line: call it as a statement (never `return fail(...)`, a tail call would
-- drop the wrapper's frame) directly from the function the user called.
function M.fail(rc, what)
  if rc == -2 then
    error("API " .. what .. " is disabled in phase " .. M.phase_name(), 3)
  elseif rc == -3 then
    error("bad argument to " .. what, 3)
  elseif rc == -4 then
    error("internal error in " .. what, 3)
  elseif rc == -9 then
    error("bad argument to " .. what .. ": invalid duration (seconds from 0 to one year)", 3)
  elseif rc == -10 then
    error(what .. ": response body too large (lua.max_response_body)", 3)
  end
  error(what .. " failed (" .. tostring(rc) .. ")", 3)
end

-- For the natives (sleep, timers, sockets): the phase check in Lua, so the
-- error carries the user's line.
function M.check(mask, what)
  if M.api.phase_allowed(mask) == 0 then
    error("API " .. what .. " is disabled in phase " .. M.phase_name(), 3)
  end
end

-- Lua string for a value given as a header value / body piece.
function M.tostr(v)
  if type(v) == "string" then return v end
  return tostring(v)
end

-- pairs array -> table; repeated keys become lists.
function M.pairs_table(p, n, keyonly)
  local t = {}
  local ffi_string, tonumber, type = ffi.string, tonumber, type
  for i = 0, n - 1 do
    local e = p[i]
    local k = ffi_string(e.k, e.klen)
    local v
    if keyonly then
      t[i + 1] = k
    else
      local vl = tonumber(e.vlen)
      if vl < 0 then v = true else v = ffi_string(e.v, vl) end
      local old = t[k]
      if old == nil then
        t[k] = v
      elseif type(old) == "table" then
        old[#old + 1] = v
      else
        t[k] = { old, v }
      end
    end
  end
  return t
end

return M
