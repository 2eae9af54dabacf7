-- wrk script: POST /v1/route with 8,000-token prompts (~50 KB of JSON each).
--
-- Each prompt is one of 16 "system prompts" of 6,000 tokens (token i of prompt p is
-- 1000 * p + i, as transport/examples/http_edge.rs preloads them) followed by one of 64
-- random 2,000-token suffixes; every request carries a unique request_id.
--
--   wrk -t1 -c32 -d10s -s route.lua --latency http://127.0.0.1:8088/v1/route

local sys, suf = {}, {}
local counter = 0
local threads = 0

function setup(thread)
  thread:set("tid", threads)
  threads = threads + 1
end

function init(args)
  math.randomseed(12345 + (tid or 0))
  for p = 0, 15 do
    local t = {}
    for i = 0, 5999 do t[#t + 1] = tostring(1000 * p + i) end
    sys[p] = table.concat(t, ",")
  end
  for k = 1, 64 do
    local t = {}
    for i = 1, 2000 do t[#t + 1] = tostring(math.random(0, 150000)) end
    suf[k] = table.concat(t, ",")
  end
end

local headers = { ["Content-Type"] = "application/json" }

function request()
  counter = counter + 1
  local p = counter % 16
  local k = (counter * 7) % 64 + 1
  local body = '{"request_id":"t' .. (tid or 0) .. '-' .. counter .. '","token_ids":[' ..
      sys[p] .. ',' .. suf[k] .. ']}'
  return wrk.format("POST", nil, headers, body)
end
