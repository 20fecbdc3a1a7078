-- What Pier adds to a library as it is first required (modules.rs,
-- `fast_require`), without forking it: `after[name](module, ...)` returns
-- what `require` gives.
local base = require "pier.base"

local type, pairs, lower = type, pairs, string.lower
local C_phase_allowed, M_REQ_READ = base.api.phase_allowed, base.masks.req_read

local after = {}

-- lua-resty-http writes its requests itself on raw cosockets. With
-- [tracing], each carries the request's traceparent (its server span as the
-- parent), as a pier.http request does, unless the hook gave one. Outside a
-- request (a timer) nothing is added.
after["resty.http"] = function(m, ...)
  if type(m) ~= "table" or type(m.send_request) ~= "function" or m.__pier_traced then
    return m, ...
  end
  local send_request = m.send_request
  local var = require "pier.var"
  m.send_request = function(self, params)
    if type(params) ~= "table" or C_phase_allowed(M_REQ_READ) == 0 then
      return send_request(self, params)
    end
    local trace = var.trace_id
    if not trace then
      return send_request(self, params)
    end
    local headers = {}
    local given = params.headers
    if type(given) == "table" then
      for k, v in pairs(given) do
        if type(k) == "string" and lower(k) == "traceparent" then
          return send_request(self, params)
        end
        headers[k] = v
      end
    end
    headers.traceparent = "00-" .. trace .. "-" .. var.span_id .. "-" .. var.trace_flags
    -- A copy: the caller's tables are left as they were.
    local p = {}
    for k, v in pairs(params) do p[k] = v end
    p.headers = headers
    return send_request(self, p)
  end
  m.__pier_traced = true
  return m, ...
end

return after
