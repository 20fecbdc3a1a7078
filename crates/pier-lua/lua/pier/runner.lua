-- The body of a pooled hook coroutine: runs one hook per resume, tells Rust
-- it finished (hook_done), then waits for the next hook. A hook's own
-- yields (I/O) pass through to the engine like any other.
-- Before reporting, the hook waits for the light threads it spawned
-- (ngx.thread.spawn), as ngx_lua does; `join` returns at once when none is
-- alive.
local api = require("pier.base").api
local join = require("pier.native").ngx_thread.join
local C_done, yield = api.hook_done, coroutine.yield

return function(f)
  while true do
    f()
    join()
    C_done()
    f = yield()
  end
end
