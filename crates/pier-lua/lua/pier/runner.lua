-- The body of a pooled hook coroutine: runs one hook per resume, tells Rust
-- it finished (hook_done), then waits for the next hook. A hook's own
-- yields (I/O) pass through to the engine like any other.
local api = require("pier.base").api
local C_done, yield = api.hook_done, coroutine.yield

return function(f)
  while true do
    f()
    C_done()
    f = yield()
  end
end
