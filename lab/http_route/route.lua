-- wrk script: POST /v1/route with 8,000-token prompts (~50 KB of JSON each).
--
-- Each prompt is one of 16 "system prompts" of 6,000 tokens (token i of prompt p is
-- 1000 * p + i, as preload.py stores them on the workers) followed by one of 32 random
-- 2,000-token suffixes. The 512 request bodies are built once in init(), so wrk spends its
-- CPU sending, not building 50 KB strings; the router generates the request ids.
--
--   wrk -t1 -c16 -d10s -s route.lua --latency http://127.0.0.1:8088/v1/route

local requests = {}
local counter = 0
local threads = 0

function setup(thread)
  thread:set("tid", threads)
  threads = threads + 1
end

function init(args)
  math.randomseed(12345 + (tid or 0))
  local sys, suf = {}, {}
  for p = 0, 15 do
    local t = {}
    for i = 0, 5999 do t[#t + 1] = tostring(1000 * p + i) end
    sys[p] = table.concat(t, ",")
  end
  for k = 1, 32 do
    local t = {}
    for i = 1, 2000 do t[#t + 1] = tostring(math.random(0, 150000)) end
    suf[k] = table.concat(t, ",")
  end
  local headers = { ["Content-Type"] = "application/json" }
  for n = 0, 511 do
    local body = '{"token_ids":[' .. sys[n % 16] .. ',' .. suf[(n * 7) % 32 + 1] .. ']}'
    requests[n + 1] = wrk.format("POST", nil, headers, body)
  end
end

function request()
  counter = counter + 1
  return requests[counter % 512 + 1]
end
