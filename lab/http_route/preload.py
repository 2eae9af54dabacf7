#!/usr/bin/env python3
"""Registers 8 workers with a running kvengine and preloads their caches over HTTP.

Worker w holds the 6,000-token system prompts w and w + 8 and the first half of prompt
(w + 1) % 16; token i of prompt p is 1000 * p + i (route.lua sends the same prompts).

    python3 lab/http_route/preload.py http://127.0.0.1:8088
"""
import json
import sys
import urllib.request

BASE = sys.argv[1].rstrip("/")
WORKERS, PROMPTS, PROMPT_TOKENS, BLOCK = 8, 16, 6000, 16


def post(path, body):
    req = urllib.request.Request(BASE + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req) as resp:
        return json.load(resp)


for w in range(WORKERS):
    post("/v1/workers", {"worker_id": w})
    next_hash = w << 32
    for p, n in ((w, PROMPT_TOKENS), (w + 8, PROMPT_TOKENS), ((w + 1) % PROMPTS, PROMPT_TOKENS // 2)):
        tokens = [1000 * p + i for i in range(n)]
        blocks = [{"block_hash": next_hash + b, "token_ids": tokens[b * BLOCK:(b + 1) * BLOCK]}
                  for b in range(n // BLOCK)]
        next_hash += len(blocks)
        r = post("/v1/events", {"worker_id": w, "events": [
            {"type": "stored", "parent_hash": None, "blocks": blocks}]})
        assert r["applied"] == 1, r
print(f"preloaded {WORKERS} workers")
