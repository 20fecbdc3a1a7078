-- wrk script: every request a distinct URL (a cache miss): PATH?m=<thread>-<n>.
local threads = 0
function setup(thread)
    threads = threads + 1
    thread:set("id", threads)
end
function init(args)
    n = 0
    base = wrk.path
end
function request()
    n = n + 1
    return wrk.format(nil, base .. "?m=" .. id .. "-" .. n)
end
