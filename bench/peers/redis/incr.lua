-- One INCR per request on one redis-server, through lua-resty-redis (Debian's
-- lua-nginx-redis, unchanged), with the connection kept in a pool of 100 per worker.
-- The same file runs in Pier (content_file) and nginx (content_by_lua_file).
-- Templated by bench/redis_incr.sh: @REDIS@ (redis-server port).
local redis = require "nginx.redis"

local red = redis:new()
red:set_timeout(1000)
local ok, err = red:connect("127.0.0.1", @REDIS@)
if not ok then
    ngx.status = 502
    ngx.say("failed to connect: ", err)
    return ngx.exit(502)
end
local n, err = red:incr("hits")
if not n then
    ngx.status = 500
    ngx.say("failed to incr: ", err)
    return ngx.exit(500)
end
local ok, err = red:set_keepalive(10000, 100)
if not ok then
    ngx.log(ngx.ERR, "failed to set keepalive: ", err)
end
ngx.say(n)
