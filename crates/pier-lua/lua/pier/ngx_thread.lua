-- ngx.thread (spawn / wait / kill): light threads of one request, as
-- coroutines scheduled from Lua on top of mlua's async natives.
--
-- How it works. An async native (pier.sleep, cosockets, semaphores...)
-- whose future is pending yields its coroutine with mlua's "poll pending"
-- marker; the future was polled with the hook task's waker, so the hook's
-- task is woken when it can progress, and the hook's coroutine is resumed.
-- A light thread is a coroutine resumed by this scheduler, so its pending
-- yield comes back here instead of reaching Rust: `spawn` then returns to
-- the parent. The children are resumed (each re-polls its own future, or
-- yields the marker again) every time their parent is resumed:
--  * in `wait`, which loops resuming them and yields the marker upwards
--    until one of the awaited threads ends;
--  * in the parent's own async natives: they are created (src/io/mod.rs)
--    while `coroutine.yield` is this module's `_yield`, which, when the
--    yielding coroutine has children, resumes them after each resume and
--    before the native polls its own future.
-- All of one request's threads share its task waker, so any of them
-- becoming ready wakes the task, and every resume of the parent gives each
-- child a poll. A child that yields without the marker (user
-- `coroutine.yield`, `ngx.exit`) makes the parent yield a plain value
-- upwards too, which mlua treats as "poll again at once" (and lets the
-- engine see an exit before any more code runs).
--
-- Loaded by src/io/mod.rs with the natives table (before the preloads
-- exist), and returned by `require "pier.ngx_thread"`.
local natives = ...

local co_create, co_resume, co_status, co_running =
  coroutine.create, coroutine.resume, coroutine.status, coroutine.running
local real_yield = coroutine.yield
local PENDING = natives.poll_pending
local select, type, error, tostring, unpack, setmetatable =
  select, type, error, tostring, unpack, setmetatable

local function pack(...) return { n = select("#", ...), ... } end

-- Light threads by coroutine: { parent = co, owner = request id,
-- state = "running" | "zombie" | "dead", ready = bool, res = results }.
-- Weak keys: a thread nobody refers to any more is collected with it.
local threads = setmetatable({}, { __mode = "k" })
-- Children not yet waited for, by parent coroutine: { owner = id, recs... }
-- where each rec is { co = child, t = threads[child] }.
local kids = setmetatable({}, { __mode = "k" })
-- Light threads spawned and still running on this state (lets `join`, run
-- after every hook, return at once in the usual case).
local nlive = 0

local base, api, masks, owner_of
-- pier.base needs the preloads, which exist after this file is loaded.
local function init()
  base = require "pier.base"
  api, masks, owner_of = base.api, base.masks, natives.owner
end

local contexts = { [0] = "init_by_lua*", "init_worker_by_lua*", "access_by_lua*",
  "content_by_lua*", "balancer_by_lua*", "access_by_lua*", "header_filter_by_lua*",
  "body_filter_by_lua*", "log_by_lua*", "ngx.timer" }

local function check_phase()
  if not base then init() end
  local phase = api.phase()
  if phase < 2 then error("no request found", 3) end
  if api.phase_allowed(masks.yield) == 0 then
    error("API disabled in the context of " .. (contexts[phase] or "(unknown)"), 3)
  end
end

-- The children list of `me`, dropping one left by an earlier request (hook
-- coroutines are pooled: a hook that returned with threads still running
-- left them behind).
local function kids_of(me)
  local list = kids[me]
  if list and list.owner ~= owner_of() then
    kids[me] = nil
    for i = 1, #list do
      if list[i].t.state == "running" then nlive = nlive - 1 end
      list[i].t.state = "dead"
    end
    return nil
  end
  return list
end

local function log_abort(err)
  if not base then init() end
  local msg = "lua user thread aborted: runtime error: " .. tostring(err)
  api.log(4, msg, #msg) -- ERR
end

-- Resumes `co` with the given values and records the outcome in `t`.
local function step(co, t, ...)
  local r = pack(co_resume(co, ...))
  if co_status(co) == "dead" then
    t.state, t.res, t.ready = "zombie", r, false
    nlive = nlive - 1
    if not r[1] then log_abort(r[2]) end
  else
    -- A pending yield waits for its future; anything else runs again at
    -- the next resume of the parent.
    t.ready = not (r.n == 2 and r[2] == PENDING)
  end
end

-- Gives every live child of `me` one resume; true if one is ready to run
-- again at once.
local function drive(me)
  local list = kids_of(me)
  if not list then return false end
  local ready = false
  for i = 1, #list do
    local rec = list[i]
    local t = rec.t
    if t.state == "running" then
      step(rec.co, t)
      if t.ready then ready = true end
    end
  end
  return ready
end

local function any_ready(list)
  for i = 1, #list do
    local t = list[i].t
    if t.state == "running" and t.ready then return true end
  end
  return false
end

local function forget(me, co)
  local list = kids[me]
  if not list then return end
  for i = 1, #list do
    if list[i].co == co then
      table.remove(list, i)
      break
    end
  end
  if #list == 0 then kids[me] = nil end
end

local M = {}

-- The `coroutine.yield` the async natives are created with: as the real one,
-- plus scheduling the yielding coroutine's children (see the top).
function M._yield(...)
  local me = co_running()
  local list = me and kids[me]
  if not list then return real_yield(...) end
  local r
  if any_ready(list) and select("#", ...) == 1 and (...) == PENDING then
    -- A child can run now: poll again at once rather than wait.
    r = pack(real_yield())
  else
    r = pack(real_yield(...))
  end
  -- Resumed by a poll (no values): the children get theirs first. A resume
  -- with values is mlua's terminate signal: passed through untouched.
  if r.n == 0 then
    while drive(me) do
      -- A child yielded plainly (e.g. ngx.exit): let the engine look
      -- before the parent runs on.
      real_yield()
    end
  end
  return unpack(r, 1, r.n)
end

-- ngx.thread.spawn(fn, ...): runs fn(...) in a new light thread until it
-- yields, then returns the thread.
function M.spawn(fn, ...)
  check_phase()
  if type(fn) ~= "function" then
    error("bad argument #1 to 'spawn' (Lua function expected)", 2)
  end
  local me = co_running()
  local owner = owner_of()
  local co = co_create(fn)
  local t = { parent = me, owner = owner, state = "running", ready = false }
  threads[co] = t
  local list = kids_of(me)
  if not list then
    list = { owner = owner }
    kids[me] = list
  end
  list[#list + 1] = { co = co, t = t }
  nlive = nlive + 1
  step(co, t, ...)
  return co
end

-- The argument at `i`: a light thread of `me` (raises as ngx_lua).
local function child(me, i, co, what)
  if type(co) ~= "thread" then
    error("bad argument #" .. i .. " to '" .. what .. "' (lua thread expected)", 3)
  end
  local t = threads[co]
  if not t then
    error("attempt to " .. what .. " on a coroutine that is not a user thread", 3)
  end
  if t.parent ~= me or t.owner ~= owner_of() then
    error("only the parent coroutine can " .. what .. " on the thread", 3)
  end
  return t
end

-- ngx.thread.wait(t1, t2, ...): the results of the first of them to end:
-- true, ... or false, err.
function M.wait(...)
  check_phase()
  local me = co_running()
  local n = select("#", ...)
  local ts = {}
  for i = 1, n do
    local co = select(i, ...)
    ts[i] = child(me, i, co, "wait")
  end
  while true do
    for i = 1, n do
      local t = ts[i]
      if t.state == "zombie" then
        t.state = "dead"
        forget(me, (select(i, ...)))
        local r = t.res
        t.res = nil
        return unpack(r, 1, r.n)
      elseif t.state == "dead" and i == n then
        return nil, "already waited or killed"
      end
    end
    local list = kids_of(me)
    -- Pending: this task is woken when any thread's future can progress.
    local r
    if list and any_ready(list) then r = pack(real_yield()) else r = pack(real_yield(PENDING)) end
    if r.n ~= 0 then
      -- mlua's terminate signal (never sent to Pier's hook coroutines):
      -- the task is going away.
      return real_yield()
    end
    drive(me)
  end
end

-- ngx.thread.kill(t): 1, or nil, err.
function M.kill(co)
  check_phase()
  local me = co_running()
  if type(co) ~= "thread" then
    error("bad argument #1 to 'kill' (lua thread expected)", 2)
  end
  local t = threads[co]
  if not t then return nil, "not user thread" end
  if t.parent ~= me or t.owner ~= owner_of() then return nil, "killer not parent" end
  if t.state == "zombie" then
    t.state, t.res = "dead", nil
    forget(me, co)
    return nil, "already terminated"
  elseif t.state == "dead" then
    return nil, "already waited or killed"
  end
  t.state = "dead"
  nlive = nlive - 1
  forget(me, co)
  -- Its pending operation is never resumed: release what must not wait
  -- for the coroutine's collection (a semaphore wait would hold a post).
  natives.sema_cancel_thread(co)
  return 1
end

-- Waits for the light threads the running entry function left running
-- (ngx_lua: a handler ends when all its threads have). For the hook runner
-- (after each hook) and timer runs (`_entry`).
function M.join()
  if nlive == 0 then return end
  local me = co_running()
  while true do
    local list = kids_of(me)
    if not list then return end
    local live = false
    for i = 1, #list do
      if list[i].t.state == "running" then
        live = true
        break
      end
    end
    if not live then
      kids[me] = nil
      return
    end
    local r
    if any_ready(list) then r = pack(real_yield()) else r = pack(real_yield(PENDING)) end
    if r.n ~= 0 then return real_yield() end
    drive(me)
  end
end

-- A timer run: `f(...)`, then its light threads.
function M._entry(f, ...)
  f(...)
  M.join()
end

return M
